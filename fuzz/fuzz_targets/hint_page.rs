//! Fuzzes the hint pages (ABI 0.3) as both hosts read and write them: arbitrary registrations
//! (any page frame or address, any vCPU, any guest TSC frequency, 0 included), arbitrary guest
//! writes anywhere in the pages (the guest owns its line and may scribble over the host's),
//! and the host's reactions through `pvspin_hints::PageBudgets`, the code the in-process host
//! and `pvspind` share: wait reports taken into the budgets (at exits in process; at kicks,
//! notifications and samples in the daemon), spin notifications useful or not, budgets and
//! bounds published, `NOT_RUNNING` set and cleared (the daemon's sampler), `VCPUS_FIT` said
//! for the VM (ABI 0.4), reading the guest's hints. Invariants: nothing panics; a page registers only inside guest RAM; the
//! budgets stay within their configured bounds whatever the guest reports; what the host
//! publishes (spin window, wait budget, TSC frequency, bounds) is what its budgets say for
//! that frequency, `HOST_SEQ` moves by one per publication; a wait report is taken once; a
//! page registered or told since the last `VCPUS_FIT` change shows it, whatever the guest
//! wrote, and setting one host flag leaves the other.
#![no_main]

use std::sync::atomic::Ordering;
use std::sync::Arc;

use libfuzzer_sys::fuzz_target;
use pvspin_abi::hint;
use pvspin_hints::{BufferPageMap, HintPage, HintPages, PageBudgets};
use pvspin_yield::budget::BudgetConfig;

const PAGES: usize = 4;
const VCPUS: usize = 3;

fn host_u32(map: &BufferPageMap, gpa: usize, offset: usize) -> u32 {
    let word = map.word(gpa + offset).load(Ordering::Relaxed);
    (word >> (8 * ((gpa + offset) % 8))) as u32
}

/// The page's host line matches what `budgets` says for `v` at `khz`.
fn check_published(
    map: &BufferPageMap,
    gpa: usize,
    page: HintPage,
    b: &PageBudgets,
    v: usize,
    khz: u32,
) {
    let want = b.tsc(v, khz);
    assert_eq!(page.budgets(), (want.spin_window, want.wait_after));
    assert_eq!(host_u32(map, gpa, hint::TSC_KHZ), khz);
    if khz == 0 {
        assert_eq!(want.spin_window, u64::MAX, "no frequency: never notify");
    } else if !b.notify() {
        assert_eq!(
            want.spin_window,
            u64::MAX,
            "no directed yield: never notify"
        );
    }
}

fuzz_target!(|data: &[u8]| {
    let Some((&first, data)) = data.split_first() else {
        return;
    };
    let map = Arc::new(BufferPageMap::new(PAGES));
    let pages = HintPages::new(map.clone(), VCPUS);
    let cfg = BudgetConfig::default();
    let budgets = PageBudgets::new(VCPUS, cfg, first & 1 == 0).expect("default budgets are valid");
    // Per vCPU: the registered page's address and the frequency it came with.
    let mut registered: [Option<(usize, u32)>; VCPUS] = [None; VCPUS];
    for op in data.chunks_exact(10) {
        let v = usize::from(op[1]) % (VCPUS + 1); // VCPUS itself: no such vCPU
        let word = u64::from_le_bytes(op[2..10].try_into().unwrap());
        match op[0] % 6 {
            // A registration: by frame (SHARED_PAGE) or by address (the virtio control
            // request), with a frequency (0: unknown; the daemon's guests give any u32).
            0 => {
                let khz = (word >> 32) as u32;
                let (gpa, result) = if op[0] & 0x80 == 0 {
                    let pfn = (word & 0xff) as u32;
                    (u64::from(pfn) * 4096, pages.register(v, pfn))
                } else {
                    let gpa = (word & 0xffff) << 4;
                    (gpa, pages.register_gpa(v, gpa))
                };
                match result {
                    Ok(Some(page)) => {
                        assert!(v < VCPUS, "registered for {v}");
                        assert!(
                            gpa < (PAGES * 4096) as u64 && gpa % 4096 == 0 && gpa != 0,
                            "page at {gpa:#x}"
                        );
                        let gpa = gpa as usize;
                        assert_eq!(host_u32(&map, gpa, hint::LAYOUT), hint::LAYOUT_VERSION);
                        assert_eq!(page.vcpus_fit(), pages.vcpus_fit());
                        let seq = host_u32(&map, gpa, hint::HOST_SEQ);
                        page.set_not_running(false);
                        budgets.on_register(v, page, khz);
                        assert_eq!(host_u32(&map, gpa, hint::HOST_SEQ), seq.wrapping_add(1));
                        let want = budgets.tsc(v, khz);
                        assert_eq!(
                            map.word(gpa + hint::WAIT_AFTER_MIN_TSC)
                                .load(Ordering::Relaxed),
                            want.wait_after_min
                        );
                        assert_eq!(
                            map.word(gpa + hint::WAIT_AFTER_MAX_TSC)
                                .load(Ordering::Relaxed),
                            want.wait_after_max
                        );
                        check_published(&map, gpa, page, &budgets, v, khz);
                        registered[v] = Some((gpa, khz));
                    }
                    Ok(None) => {
                        assert!(v < VCPUS && gpa == 0);
                        registered[v] = None;
                    }
                    Err(_) => {
                        assert!(v >= VCPUS || gpa >= (PAGES * 4096) as u64 || gpa % 4096 != 0)
                    }
                }
            }
            // A guest write anywhere in guest RAM (its own line, the host's, other pages).
            1 => {
                let gpa = (word as usize >> 16) % (PAGES * 4096);
                map.word(gpa).store(word, Ordering::Relaxed);
            }
            // A wait report taken: at an exit (in process), a kick, a notification or a
            // sample (the daemon).
            2 => {
                let (Some(page), Some(Some((gpa, khz)))) = (pages.get(v), registered.get(v)) else {
                    continue;
                };
                let seq = host_u32(&map, *gpa, hint::HOST_SEQ);
                let before = budgets.budgets().wait_after_ns(v);
                let reported = map.word(*gpa + hint::LAST_WAIT_TSC).load(Ordering::Relaxed);
                let taken = budgets.on_wait_report(v, page, *khz);
                assert_eq!(page.take_last_wait(), None, "a report is taken once");
                assert_eq!(taken.is_some(), reported != 0 && *khz != 0);
                let after = budgets.budgets().wait_after_ns(v);
                assert!(
                    (cfg.wait_after_min_ns..=cfg.wait_after_max_ns).contains(&after),
                    "wait budget {after} outside its bounds"
                );
                let published = u32::from(before != after);
                assert_eq!(
                    host_u32(&map, *gpa, hint::HOST_SEQ),
                    seq.wrapping_add(published)
                );
                if before != after {
                    check_published(&map, *gpa, page, &budgets, v, *khz);
                }
            }
            // A spin notification of v was useful or not.
            3 => {
                if v >= VCPUS {
                    continue;
                }
                let slot = registered[v];
                let page = pages.get(v);
                let before = budgets.budgets().notify_after_ns(v);
                let after =
                    budgets.on_notification(v, word & 1 == 0, page, slot.map_or(0, |s| s.1));
                assert!((cfg.notify_after_ns..=cfg.notify_after_max_ns).contains(&after));
                // Published at once when it changed.
                if let (Some(page), Some((gpa, khz)), true) = (page, slot, before != after) {
                    check_published(&map, gpa, page, &budgets, v, khz);
                }
            }
            // The host parks or resumes v, or the daemon's sampler sees it descheduled or not;
            // the guest reads its hints meanwhile.
            4 => {
                let Some(page) = pages.get(v) else { continue };
                let fit = page.vcpus_fit();
                page.set_not_running(word & 1 == 1);
                assert_eq!(page.not_running(), word & 1 == 1);
                assert_eq!(page.vcpus_fit(), fit, "NOT_RUNNING leaves VCPUS_FIT");
                let _ = page.guest_hints();
            }
            // The VM's CPUs changed (a new quota): every registered page says it.
            5 if op[0] & 0x80 != 0 => {
                pages.set_vcpus_fit(word & 1 == 1);
                for u in 0..VCPUS {
                    if let Some(page) = pages.get(u) {
                        assert_eq!(page.vcpus_fit(), word & 1 == 1);
                    }
                }
            }
            // A publication (the daemon republishes after a memory change; in process after
            // an adaptation).
            _ => {
                let (Some(page), Some(Some((gpa, khz)))) = (pages.get(v), registered.get(v)) else {
                    continue;
                };
                budgets.publish(v, page, *khz);
                check_published(&map, *gpa, page, &budgets, v, *khz);
            }
        }
    }
});
