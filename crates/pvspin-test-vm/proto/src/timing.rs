//! The guest's timing of its own work: a log-scale histogram of section durations, its median
//! and a trimmed mean ([`RunResult::ncs_median_tsc`](crate::RunResult::ncs_median_tsc),
//! [`RunResult::ncs_mean_tsc`](crate::RunResult::ncs_mean_tsc)).
//!
//! Eight buckets per power of two (each 1/8 of its octave wide), so the median, interpolated
//! linearly inside its bucket, is within a few percent of the true one. Integers only: the
//! guest has no floating point.

/// Sub-buckets per power of two.
const SUB: u64 = 8;
/// log2 of [`SUB`].
const SUB_BITS: u32 = 3;
/// Powers of two covered: durations up to 2^43 - 1 TSC cycles (over an hour at 2 GHz); longer
/// ones count in the last bucket.
pub const OCTAVES: usize = 43;
/// Buckets in a histogram.
pub const BUCKETS: usize = OCTAVES * SUB as usize;

/// The bucket of a duration of `ticks` (0 counts as 1; beyond the range, the last bucket).
pub fn bucket(ticks: u64) -> usize {
    let ticks = ticks.max(1);
    let msb = 63 - ticks.leading_zeros();
    let sub = if msb >= SUB_BITS {
        (ticks >> (msb - SUB_BITS)) & (SUB - 1)
    } else {
        (ticks << (SUB_BITS - msb)) & (SUB - 1)
    };
    ((msb as usize) * SUB as usize + sub as usize).min(BUCKETS - 1)
}

/// The smallest duration that falls in bucket `b`, and the bucket's width (at least 1).
pub fn bounds(b: usize) -> (u64, u64) {
    let (msb, sub) = ((b as u64 / SUB) as u32, b as u64 % SUB);
    if msb >= SUB_BITS {
        ((SUB + sub) << (msb - SUB_BITS), 1 << (msb - SUB_BITS))
    } else {
        ((SUB + sub) >> (SUB_BITS - msb), 1)
    }
}

/// `(median, samples)` of a histogram given as its bucket counts in order; `(0, 0)` when it
/// is empty.
pub fn median(counts: impl Iterator<Item = u64> + Clone) -> (u64, u64) {
    let total: u64 = counts.clone().sum();
    if total == 0 {
        return (0, 0);
    }
    // The median's rank, from 0.
    let rank = (total - 1) / 2;
    let mut before = 0;
    for (b, count) in counts.enumerate() {
        if before + count > rank {
            let (lo, width) = bounds(b);
            return (lo + width * (rank - before) / count, total);
        }
        before += count;
    }
    (0, total)
}

/// The mean of the durations below `cap` times the median (each bucket counted at its middle),
/// and how many those are; `(0, 0)` when the histogram is empty. With a cap of a few medians
/// it leaves out sections the host preempted (milliseconds against microseconds) but keeps a
/// run's slow and fast stretches in proportion, which the median alone does not.
pub fn trimmed_mean(counts: impl Iterator<Item = u64> + Clone, cap: u64) -> (u64, u64) {
    let (median, total) = median(counts.clone());
    if total == 0 {
        return (0, 0);
    }
    let limit = median.saturating_mul(cap);
    let (mut sum, mut kept) = (0u128, 0u64);
    for (b, count) in counts.enumerate() {
        let (lo, width) = bounds(b);
        if count == 0 || lo >= limit {
            continue;
        }
        sum += u128::from(count) * u128::from(lo + width / 2);
        kept += count;
    }
    ((sum / u128::from(kept.max(1))) as u64, kept)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_duration_falls_in_the_bucket_whose_bounds_hold_it() {
        for ticks in (1..5_000u64).chain([13_500, 1 << 20, (1 << 42) + 12_345]) {
            let (lo, width) = bounds(bucket(ticks));
            assert!(lo <= ticks && ticks < lo + width, "{ticks}: {lo}+{width}");
        }
        assert_eq!(bucket(0), bucket(1));
        assert_eq!(bucket(u64::MAX), BUCKETS - 1, "clamped");
        // Eight buckets per octave: widths are an eighth of the octave's start.
        assert_eq!(bounds(bucket(16_384)), (16_384, 2_048));
    }

    #[test]
    fn the_median_is_within_a_bucket_of_the_true_one() {
        let mut counts = [0u64; BUCKETS];
        // 100 sections of 13,000-13,990 cycles and 40 preempted ones of 2 ms at 2 GHz.
        for i in 0..100u64 {
            counts[bucket(13_000 + 10 * i)] += 1;
        }
        counts[bucket(4_000_000)] += 40;
        let (m, n) = median(counts.iter().copied());
        assert_eq!(n, 140);
        // The true median of the 140: the 70th value, about 13,690.
        assert!((13_000..14_400).contains(&m), "{m}");
        assert_eq!(median([0u64; 4].iter().copied()), (0, 0));
        // Half the sections twice as slow: the median is in one half, the trimmed mean in
        // between; the preempted ones stay out of it.
        let mut mixed = [0u64; BUCKETS];
        mixed[bucket(10_000)] += 50;
        mixed[bucket(20_000)] += 50;
        mixed[bucket(4_000_000)] += 10;
        let (mean, kept) = trimmed_mean(mixed.iter().copied(), 3);
        assert_eq!(kept, 100);
        assert!((14_500..16_000).contains(&mean), "{mean}");
        assert_eq!(trimmed_mean([0u64; 4].iter().copied(), 3), (0, 0));
        let mut one = [0u64; BUCKETS];
        one[bucket(777)] = 1;
        assert_eq!(median(one.iter().copied()), (bounds(bucket(777)).0, 1));
    }
}
