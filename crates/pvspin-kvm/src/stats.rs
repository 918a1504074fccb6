//! A reader for KVM's binary statistics (`KVM_GET_STATS_FD` in KVM's `api.rst`), which
//! kvm-ioctls has no API for.
//!
//! The stats fd of a VM or vCPU holds, at offsets it announces itself: a 24-byte header
//! (`kvm_stats_header`: flags, name_size, num_desc, id_offset, desc_offset, data_offset), an id
//! string, `num_desc` descriptors of `16 + name_size` bytes (`kvm_stats_desc`: flags, exponent,
//! size, offset, bucket_size, NUL-terminated name) and a data block of `u64` values; descriptor
//! `d` owns `d.size` values at `data_offset + d.offset`. Header, id and descriptors are fixed
//! for the fd's life; only the data changes.
//!
//! Two layers:
//! * pure parsing, no I/O, safe on any input (it is fuzzed, `fuzz/fuzz_targets/kvm_stats_parser.rs`):
//!   [`StatsHeader::parse`], [`Layout::parse`], [`Layout::snapshot`] and the one-call [`parse`];
//!   every malformed input gives a [`StatsError`], never a panic, and allocation is bounded;
//! * a thin fd layer: [`StatsFd::for_vm`], [`StatsFd::for_vcpu`], [`StatsFd::read`].
//!
//! A [`Snapshot`] is looked up by name ([`Snapshot::value`], [`Snapshot::get`]) and two
//! snapshots of the same fd give a [`Snapshot::delta`].

use std::collections::HashMap;
use std::fs::File;
use std::os::fd::{AsRawFd, FromRawFd};
use std::os::unix::fs::FileExt;
use std::sync::Arc;

use kvm_bindings::{
    KVM_STATS_BASE_MASK, KVM_STATS_BASE_POW10, KVM_STATS_BASE_POW2, KVM_STATS_BASE_SHIFT,
    KVM_STATS_TYPE_CUMULATIVE, KVM_STATS_TYPE_INSTANT, KVM_STATS_TYPE_LINEAR_HIST,
    KVM_STATS_TYPE_LOG_HIST, KVM_STATS_TYPE_MASK, KVM_STATS_TYPE_PEAK, KVM_STATS_UNIT_BOOLEAN,
    KVM_STATS_UNIT_BYTES, KVM_STATS_UNIT_CYCLES, KVM_STATS_UNIT_MASK, KVM_STATS_UNIT_NONE,
    KVM_STATS_UNIT_SECONDS,
};
use kvm_ioctls::{VcpuFd, VmFd};
use serde::Serialize;

/// Size of `kvm_stats_header`.
pub const HEADER_SIZE: usize = 24;
/// Size of `kvm_stats_desc` without its name.
pub const DESC_FIXED_SIZE: usize = 16;
/// Largest `name_size` accepted.
pub const MAX_NAME_SIZE: u32 = 1024;
/// Most descriptors accepted.
pub const MAX_DESCRIPTORS: u32 = 16 * 1024;
/// Most values one descriptor may own.
pub const MAX_STAT_SIZE: u16 = 4096;
/// Largest data block accepted, in bytes.
pub const MAX_DATA_BYTES: usize = 16 << 20;

mod ioctl_nr {
    // `_IO(KVMIO, 0xce)`, not in kvm-ioctls.
    vmm_sys_util::ioctl_io_nr!(KVM_GET_STATS_FD, 0xAE, 0xce);
}
use ioctl_nr::KVM_GET_STATS_FD;

/// Errors of the stats reader.
#[derive(Debug, thiserror::Error, displaydoc::Display)]
pub enum StatsError {
    /// stats {what}: need {need} bytes, have {have}
    Truncated {
        /// Which block.
        what: StatsBlock,
        /// Bytes needed.
        need: usize,
        /// Bytes given.
        have: usize,
    },
    /// stats header: name_size {0} out of range 1..={MAX_NAME_SIZE:}
    NameSize(u32),
    /// stats header: num_desc {0} above {MAX_DESCRIPTORS:}
    TooManyDescriptors(u32),
    /// stats descriptor {index}: bad name ({why})
    BadName {
        /// Descriptor index.
        index: usize,
        /// What is wrong.
        why: NameFault,
    },
    /// stats descriptor {index}: duplicate name {name:?}
    DuplicateName {
        /// Descriptor index.
        index: usize,
        /// The stat's name, as KVM's descriptor spells it.
        name: String,
    },
    /// stats descriptor {name:?}: size {size} out of range 1..={MAX_STAT_SIZE:}
    BadSize {
        /// The stat's name, as KVM's descriptor spells it.
        name: String,
        /// The size.
        size: u16,
    },
    /// stats descriptor {name:?}: offset {offset} invalid (unaligned or beyond {MAX_DATA_BYTES:}
    /// bytes)
    BadOffset {
        /// The stat's name, as KVM's descriptor spells it.
        name: String,
        /// The offset.
        offset: u32,
    },
    /// stats descriptor {name:?}: linear histogram with bucket_size 0
    ZeroBucketSize {
        /// The stat's name, as KVM's descriptor spells it.
        name: String,
    },
    /// stats delta: the snapshots come from different stats layouts
    LayoutMismatch,
    /// stats delta: cumulative {name:?} went backwards ({earlier} -> {later})
    WentBackwards {
        /// The stat's name, as KVM's descriptor spells it.
        name: String,
        /// Earlier value.
        earlier: u64,
        /// Later value.
        later: u64,
    },
    /// KVM_GET_STATS_FD failed: {0}
    Ioctl(#[source] std::io::Error),
    /// reading stats {what}: {source}
    Io {
        /// Which block.
        what: StatsBlock,
        /// The error.
        #[source]
        source: std::io::Error,
    },
}

/// What is wrong with a descriptor's name ([`StatsError::BadName`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, displaydoc::Display)]
pub enum NameFault {
    /// no NUL terminator
    NoNul,
    /// empty
    Empty,
    /// not UTF-8
    NotUtf8(std::str::Utf8Error),
}

/// The part of the stats file a read or a length check was about.
#[derive(Clone, Copy, Debug, PartialEq, Eq, displaydoc::Display)]
pub enum StatsBlock {
    /// header
    Header,
    /// descriptors
    Descriptors,
    /// data
    Data,
    /// id
    Id,
    /// value
    Value,
}

type Result<T> = std::result::Result<T, StatsError>;

/// `kvm_stats_header`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct StatsHeader {
    /// Always 0 so far (not checked, for forward compatibility).
    pub flags: u32,
    /// Bytes of each descriptor's name field, NUL included.
    pub name_size: u32,
    /// Number of descriptors.
    pub num_desc: u32,
    /// File offset of the id string.
    pub id_offset: u32,
    /// File offset of the descriptor block.
    pub desc_offset: u32,
    /// File offset of the data block.
    pub data_offset: u32,
}

fn u32_at(b: &[u8], at: usize) -> u32 {
    let mut a = [0u8; 4];
    a.copy_from_slice(&b[at..at + 4]);
    u32::from_ne_bytes(a)
}

impl StatsHeader {
    /// Parses and range-checks the header from its 24 bytes (more are ignored).
    pub fn parse(bytes: &[u8]) -> Result<StatsHeader> {
        if bytes.len() < HEADER_SIZE {
            return Err(StatsError::Truncated {
                what: StatsBlock::Header,
                need: HEADER_SIZE,
                have: bytes.len(),
            });
        }
        let h = StatsHeader {
            flags: u32_at(bytes, 0),
            name_size: u32_at(bytes, 4),
            num_desc: u32_at(bytes, 8),
            id_offset: u32_at(bytes, 12),
            desc_offset: u32_at(bytes, 16),
            data_offset: u32_at(bytes, 20),
        };
        if h.name_size == 0 || h.name_size > MAX_NAME_SIZE {
            return Err(StatsError::NameSize(h.name_size));
        }
        if h.num_desc > MAX_DESCRIPTORS {
            return Err(StatsError::TooManyDescriptors(h.num_desc));
        }
        Ok(h)
    }

    /// Bytes per descriptor.
    pub fn desc_stride(&self) -> usize {
        DESC_FIXED_SIZE + self.name_size as usize
    }

    /// Bytes of the descriptor block (bounded by the limits `parse` checked).
    pub fn desc_block_len(&self) -> usize {
        self.desc_stride() * self.num_desc as usize
    }
}

/// The type of a stat (`KVM_STATS_TYPE_*`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum StatKind {
    /// Only grows (until the fd's owner is reset).
    Cumulative,
    /// A current value.
    Instant,
    /// The largest value seen.
    Peak,
    /// Linear histogram: bucket `i` covers `[i*bucket_size, (i+1)*bucket_size)`, the last is open.
    LinearHist,
    /// Log histogram: bucket 0 covers `[0, 1)`, bucket `i>0` covers `[2^(i-1), 2^i)`, the last is open.
    LogHist,
    /// A type this reader does not know (kept, rendered as a gauge).
    Unknown(u32),
}

impl StatKind {
    fn from_flags(flags: u32) -> StatKind {
        match flags & KVM_STATS_TYPE_MASK {
            KVM_STATS_TYPE_CUMULATIVE => StatKind::Cumulative,
            KVM_STATS_TYPE_INSTANT => StatKind::Instant,
            KVM_STATS_TYPE_PEAK => StatKind::Peak,
            KVM_STATS_TYPE_LINEAR_HIST => StatKind::LinearHist,
            KVM_STATS_TYPE_LOG_HIST => StatKind::LogHist,
            other => StatKind::Unknown(other),
        }
    }

    /// Histograms (values are per-bucket counts).
    pub fn is_histogram(self) -> bool {
        matches!(self, StatKind::LinearHist | StatKind::LogHist)
    }

    /// Values only grow, so a delta is meaningful (cumulative counters and histogram buckets).
    pub fn is_monotonic(self) -> bool {
        matches!(
            self,
            StatKind::Cumulative | StatKind::LinearHist | StatKind::LogHist
        )
    }
}

/// The unit of a stat (`KVM_STATS_UNIT_*`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum StatUnit {
    /// A count.
    None,
    /// Bytes.
    Bytes,
    /// Seconds (with the exponent: -9 is ns).
    Seconds,
    /// CPU cycles.
    Cycles,
    /// 0 or 1.
    Boolean,
    /// A unit this reader does not know.
    Unknown(u32),
}

impl StatUnit {
    fn from_flags(flags: u32) -> StatUnit {
        match flags & KVM_STATS_UNIT_MASK {
            KVM_STATS_UNIT_NONE => StatUnit::None,
            KVM_STATS_UNIT_BYTES => StatUnit::Bytes,
            KVM_STATS_UNIT_SECONDS => StatUnit::Seconds,
            KVM_STATS_UNIT_CYCLES => StatUnit::Cycles,
            KVM_STATS_UNIT_BOOLEAN => StatUnit::Boolean,
            other => StatUnit::Unknown(other >> 4),
        }
    }
}

/// The base of a stat's exponent (`KVM_STATS_BASE_*`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum StatBase {
    /// 10^exponent.
    Pow10,
    /// 2^exponent.
    Pow2,
    /// A base this reader does not know (scale taken as 1).
    Unknown(u32),
}

impl StatBase {
    fn from_flags(flags: u32) -> StatBase {
        match flags & KVM_STATS_BASE_MASK {
            KVM_STATS_BASE_POW10 => StatBase::Pow10,
            KVM_STATS_BASE_POW2 => StatBase::Pow2,
            other => StatBase::Unknown(other >> KVM_STATS_BASE_SHIFT),
        }
    }
}

/// One decoded `kvm_stats_desc`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Descriptor {
    /// The stat's name (e.g. `halt_exits`).
    pub name: String,
    /// Type.
    pub kind: StatKind,
    /// Unit.
    pub unit: StatUnit,
    /// Base of the exponent.
    pub base: StatBase,
    /// Exponent: a value `v` means `v * base^exponent` units.
    pub exponent: i16,
    /// Number of `u64` values (buckets for histograms, 1 otherwise).
    pub size: u16,
    /// Byte offset of the first value in the data block.
    pub offset: u32,
    /// Bucket width of a linear histogram.
    pub bucket_size: u32,
}

impl Descriptor {
    /// The factor that turns a raw value into the unit (`base^exponent`; 1 for unknown bases).
    pub fn scale(&self) -> f64 {
        let e = i32::from(self.exponent);
        match self.base {
            StatBase::Pow10 => 10f64.powi(e),
            StatBase::Pow2 => 2f64.powi(e),
            StatBase::Unknown(_) => 1.0,
        }
    }

    /// For histograms: the exclusive upper bound of each bucket in raw units (`None` for the
    /// last, open bucket). Empty for other kinds.
    pub fn bucket_upper_bounds(&self) -> Vec<Option<u64>> {
        let n = usize::from(self.size);
        (0..n)
            .map(|i| {
                if i + 1 == n {
                    return None;
                }
                let i = i as u64;
                match self.kind {
                    StatKind::LinearHist => (i + 1).checked_mul(u64::from(self.bucket_size)),
                    StatKind::LogHist => 1u64.checked_shl(i as u32),
                    _ => None,
                }
            })
            .take(if self.kind.is_histogram() { n } else { 0 })
            .collect()
    }
}

/// The fixed part of a stats fd: header and decoded descriptors.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Layout {
    /// The header.
    pub header: StatsHeader,
    /// The descriptors, in fd order.
    pub descriptors: Vec<Descriptor>,
    /// Bytes of data the descriptors cover (from the start of the data block).
    pub data_len: usize,
    index: HashMap<String, usize>,
}

impl Layout {
    /// Parses the descriptor block for `header` (pure; bytes beyond the block are ignored).
    pub fn parse(header: StatsHeader, desc_bytes: &[u8]) -> Result<Layout> {
        let stride = header.desc_stride();
        let need = header.desc_block_len();
        if desc_bytes.len() < need {
            return Err(StatsError::Truncated {
                what: StatsBlock::Descriptors,
                need,
                have: desc_bytes.len(),
            });
        }
        let n = header.num_desc as usize;
        let mut descriptors = Vec::with_capacity(n);
        let mut index = HashMap::with_capacity(n);
        let mut data_len = 0usize;
        for i in 0..n {
            let d = &desc_bytes[i * stride..(i + 1) * stride];
            let flags = u32_at(d, 0);
            let exponent = i16::from_ne_bytes([d[4], d[5]]);
            let size = u16::from_ne_bytes([d[6], d[7]]);
            let offset = u32_at(d, 8);
            let bucket_size = u32_at(d, 12);
            let raw = &d[DESC_FIXED_SIZE..];
            let nul = raw
                .iter()
                .position(|&c| c == 0)
                .ok_or(StatsError::BadName {
                    index: i,
                    why: NameFault::NoNul,
                })?;
            if nul == 0 {
                return Err(StatsError::BadName {
                    index: i,
                    why: NameFault::Empty,
                });
            }
            let name = std::str::from_utf8(&raw[..nul])
                .map_err(|err| StatsError::BadName {
                    index: i,
                    why: NameFault::NotUtf8(err),
                })?
                .to_owned();
            if size == 0 || size > MAX_STAT_SIZE {
                return Err(StatsError::BadSize { name, size });
            }
            let end = offset as usize + usize::from(size) * 8;
            if offset % 8 != 0 || end > MAX_DATA_BYTES {
                return Err(StatsError::BadOffset { name, offset });
            }
            let kind = StatKind::from_flags(flags);
            if kind == StatKind::LinearHist && bucket_size == 0 {
                return Err(StatsError::ZeroBucketSize { name });
            }
            if index.insert(name.clone(), i).is_some() {
                return Err(StatsError::DuplicateName { index: i, name });
            }
            data_len = data_len.max(end);
            descriptors.push(Descriptor {
                name,
                kind,
                unit: StatUnit::from_flags(flags),
                base: StatBase::from_flags(flags),
                exponent,
                size,
                offset,
                bucket_size,
            });
        }
        Ok(Layout {
            header,
            descriptors,
            data_len,
            index,
        })
    }

    /// The descriptor named `name`.
    pub fn descriptor(&self, name: &str) -> Option<&Descriptor> {
        self.index.get(name).map(|&i| &self.descriptors[i])
    }

    /// Decodes a data block (pure; bytes beyond [`Layout::data_len`] are ignored).
    pub fn snapshot(self: &Arc<Self>, data: &[u8]) -> Result<Snapshot> {
        if data.len() < self.data_len {
            return Err(StatsError::Truncated {
                what: StatsBlock::Data,
                need: self.data_len,
                have: data.len(),
            });
        }
        let values = self
            .descriptors
            .iter()
            .map(|d| {
                let start = d.offset as usize;
                data[start..start + usize::from(d.size) * 8]
                    .chunks_exact(8)
                    .map(|c| {
                        let mut a = [0u8; 8];
                        a.copy_from_slice(c);
                        u64::from_ne_bytes(a)
                    })
                    .collect()
            })
            .collect();
        Ok(Snapshot {
            layout: Arc::clone(self),
            values,
        })
    }
}

/// Parses a whole stats image in one call (pure): the 24 header bytes, the descriptor block
/// and the data block, each starting at its own offset. This is what the fuzz target drives.
pub fn parse(header: &[u8], descriptors: &[u8], data: &[u8]) -> Result<Snapshot> {
    let h = StatsHeader::parse(header)?;
    let layout = Arc::new(Layout::parse(h, descriptors)?);
    layout.snapshot(data)
}

/// One stat in a snapshot.
#[derive(Clone, Copy, Debug)]
pub struct Stat<'a> {
    /// Its descriptor.
    pub desc: &'a Descriptor,
    /// Its values (one, or one per bucket).
    pub values: &'a [u64],
}

/// The values of every stat at one moment (or, from [`Snapshot::delta`], their change).
#[derive(Clone, Debug)]
pub struct Snapshot {
    layout: Arc<Layout>,
    values: Vec<Vec<u64>>,
}

impl Snapshot {
    /// The layout this snapshot was decoded with.
    pub fn layout(&self) -> &Arc<Layout> {
        &self.layout
    }

    /// The stat named `name`.
    pub fn get(&self, name: &str) -> Option<Stat<'_>> {
        self.layout.index.get(name).map(|&i| Stat {
            desc: &self.layout.descriptors[i],
            values: &self.values[i],
        })
    }

    /// The value of the scalar stat `name` (`None` if absent or a histogram).
    pub fn value(&self, name: &str) -> Option<u64> {
        self.get(name)
            .filter(|s| !s.desc.kind.is_histogram())
            .and_then(|s| s.values.first().copied())
    }

    /// The buckets of the histogram `name`.
    pub fn histogram(&self, name: &str) -> Option<&[u64]> {
        self.get(name)
            .filter(|s| s.desc.kind.is_histogram())
            .map(|s| s.values)
    }

    /// Every stat, in fd order.
    pub fn iter(&self) -> impl Iterator<Item = Stat<'_>> {
        self.layout
            .descriptors
            .iter()
            .zip(&self.values)
            .map(|(desc, values)| Stat { desc, values })
    }

    /// `self - earlier`: cumulative stats and histogram buckets become differences, instant and
    /// peak stats keep `self`'s value. Refuses snapshots of different layouts and counters that
    /// went backwards.
    pub fn delta(&self, earlier: &Snapshot) -> Result<Snapshot> {
        if !Arc::ptr_eq(&self.layout, &earlier.layout) && self.layout != earlier.layout {
            return Err(StatsError::LayoutMismatch);
        }
        let mut values = Vec::with_capacity(self.values.len());
        for ((d, later), before) in self
            .layout
            .descriptors
            .iter()
            .zip(&self.values)
            .zip(&earlier.values)
        {
            if !d.kind.is_monotonic() {
                values.push(later.clone());
                continue;
            }
            let mut v = Vec::with_capacity(later.len());
            for (&l, &e) in later.iter().zip(before) {
                v.push(l.checked_sub(e).ok_or_else(|| StatsError::WentBackwards {
                    name: d.name.clone(),
                    earlier: e,
                    later: l,
                })?);
            }
            values.push(v);
        }
        Ok(Snapshot {
            layout: Arc::clone(&self.layout),
            values,
        })
    }
}

/// One stat as it appears in JSON.
#[derive(Clone, Debug, Serialize)]
pub struct StatJson<'a> {
    /// Name.
    pub name: &'a str,
    /// Type.
    pub kind: StatKind,
    /// Unit.
    pub unit: StatUnit,
    /// `base^exponent`.
    pub scale: f64,
    /// Scalar value (non-histograms).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub value: Option<u64>,
    /// Buckets (histograms).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub buckets: Option<&'a [u64]>,
}

impl Serialize for Snapshot {
    fn serialize<S: serde::Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        use serde::ser::SerializeMap;
        let mut m = s.serialize_map(Some(self.values.len()))?;
        for st in self.iter() {
            let hist = st.desc.kind.is_histogram();
            m.serialize_entry(
                &st.desc.name,
                &StatJson {
                    name: &st.desc.name,
                    kind: st.desc.kind,
                    unit: st.desc.unit,
                    scale: st.desc.scale(),
                    value: if hist {
                        None
                    } else {
                        st.values.first().copied()
                    },
                    buckets: if hist { Some(st.values) } else { None },
                },
            )?;
        }
        m.end()
    }
}

/// An open stats fd of a VM or vCPU, with its layout read once.
#[derive(Debug)]
pub struct StatsFd {
    file: File,
    layout: Arc<Layout>,
    id: String,
}

impl StatsFd {
    /// Opens the stats fd of a VM.
    pub fn for_vm(vm: &VmFd) -> Result<StatsFd> {
        Self::open(vm)
    }

    /// Opens the stats fd of a vCPU.
    pub fn for_vcpu(vcpu: &VcpuFd) -> Result<StatsFd> {
        Self::open(vcpu)
    }

    fn open<F: AsRawFd>(owner: &F) -> Result<StatsFd> {
        // SAFETY: KVM_GET_STATS_FD takes no argument and returns a new fd or -1; `owner` is a
        // valid KVM VM or vCPU fd for the duration of the call.
        let fd = unsafe { vmm_sys_util::ioctl::ioctl(owner, KVM_GET_STATS_FD()) };
        if fd < 0 {
            return Err(StatsError::Ioctl(std::io::Error::last_os_error()));
        }
        // SAFETY: `fd` was just returned by the kernel and nothing else owns it.
        let file = unsafe { File::from_raw_fd(fd) };
        let mut hb = [0u8; HEADER_SIZE];
        read_at(&file, &mut hb, 0, StatsBlock::Header)?;
        let header = StatsHeader::parse(&hb)?;
        let mut idb = vec![0u8; header.name_size as usize];
        read_at(&file, &mut idb, u64::from(header.id_offset), StatsBlock::Id)?;
        let id_len = idb.iter().position(|&c| c == 0).unwrap_or(idb.len());
        let id = String::from_utf8_lossy(&idb[..id_len]).into_owned();
        let mut db = vec![0u8; header.desc_block_len()];
        read_at(
            &file,
            &mut db,
            u64::from(header.desc_offset),
            StatsBlock::Descriptors,
        )?;
        let layout = Arc::new(Layout::parse(header, &db)?);
        Ok(StatsFd { file, layout, id })
    }

    /// The id string (e.g. `kvm-1234` for a VM, `kvm-1234/vcpu-0` for a vCPU).
    pub fn id(&self) -> &str {
        &self.id
    }

    /// The descriptors.
    pub fn descriptors(&self) -> &[Descriptor] {
        &self.layout.descriptors
    }

    /// The layout.
    pub fn layout(&self) -> &Arc<Layout> {
        &self.layout
    }

    /// Reads every value now (one `pread` of the data block).
    pub fn read(&self) -> Result<Snapshot> {
        let mut data = vec![0u8; self.layout.data_len];
        read_at(
            &self.file,
            &mut data,
            u64::from(self.layout.header.data_offset),
            StatsBlock::Data,
        )?;
        self.layout.snapshot(&data)
    }
}

impl StatsFd {
    /// A reader of the one-value stat `name` (e.g. the instant `blocking`), for polling it
    /// cheaply: each [`StatValue::read`] is one 8-byte `pread`. `None` when the fd has no such
    /// stat, or it is a histogram.
    pub fn value_reader(&self, name: &str) -> Option<std::io::Result<StatValue>> {
        let desc = self.layout.descriptor(name)?;
        if desc.size != 1 {
            return None;
        }
        let at = u64::from(self.layout.header.data_offset) + u64::from(desc.offset);
        Some(self.file.try_clone().map(|file| StatValue { file, at }))
    }
}

/// One value of a stats fd ([`StatsFd::value_reader`]), readable from any thread.
#[derive(Debug)]
pub struct StatValue {
    file: File,
    at: u64,
}

impl StatValue {
    /// The value now (the raw `u64`, unscaled).
    pub fn read(&self) -> Result<u64> {
        let mut b = [0u8; 8];
        read_at(&self.file, &mut b, self.at, StatsBlock::Value)?;
        Ok(u64::from_ne_bytes(b))
    }
}

fn read_at(file: &File, buf: &mut [u8], at: u64, what: StatsBlock) -> Result<()> {
    file.read_exact_at(buf, at)
        .map_err(|source| StatsError::Io { what, source })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Builds a stats image: (header, descriptors, data). Each stat: (name, flags, exponent,
    /// values, bucket_size); offsets are assigned in order.
    fn image(
        name_size: u32,
        stats: &[(&str, u32, i16, &[u64], u32)],
    ) -> (Vec<u8>, Vec<u8>, Vec<u8>) {
        let stride = DESC_FIXED_SIZE + name_size as usize;
        let mut h = Vec::new();
        for v in [0u32, name_size, stats.len() as u32, 24, 24 + name_size, 0] {
            h.extend_from_slice(&v.to_ne_bytes());
        }
        let mut d = Vec::new();
        let mut data = Vec::new();
        for (name, flags, exp, vals, bucket) in stats {
            d.extend_from_slice(&flags.to_ne_bytes());
            d.extend_from_slice(&exp.to_ne_bytes());
            d.extend_from_slice(&(vals.len() as u16).to_ne_bytes());
            d.extend_from_slice(&(data.len() as u32).to_ne_bytes());
            d.extend_from_slice(&bucket.to_ne_bytes());
            let mut n = name.as_bytes().to_vec();
            n.resize(name_size as usize, 0);
            d.extend_from_slice(&n);
            for v in *vals {
                data.extend_from_slice(&v.to_ne_bytes());
            }
        }
        assert_eq!(d.len(), stride * stats.len());
        (h, d, data)
    }

    const NS: u32 = KVM_STATS_UNIT_SECONDS | KVM_STATS_BASE_POW10;

    fn sample() -> (Vec<u8>, Vec<u8>, Vec<u8>) {
        image(
            48,
            &[
                ("exits", KVM_STATS_TYPE_CUMULATIVE, 0, &[10], 0),
                (
                    "halt_wait_ns",
                    KVM_STATS_TYPE_CUMULATIVE | NS,
                    -9,
                    &[5000],
                    0,
                ),
                (
                    "blocking",
                    KVM_STATS_TYPE_INSTANT | KVM_STATS_UNIT_BOOLEAN,
                    0,
                    &[1],
                    0,
                ),
                ("max_rmap", KVM_STATS_TYPE_PEAK, 0, &[7], 0),
                (
                    "halt_wait_hist",
                    KVM_STATS_TYPE_LOG_HIST | NS,
                    -9,
                    &[1, 2, 3, 4],
                    0,
                ),
                ("lin", KVM_STATS_TYPE_LINEAR_HIST, 0, &[0, 5, 6], 10),
            ],
        )
    }

    #[test]
    fn decodes_every_kind_unit_and_base() {
        let (h, d, data) = sample();
        let s = parse(&h, &d, &data).unwrap();
        assert_eq!(s.value("exits"), Some(10));
        let w = s.get("halt_wait_ns").unwrap();
        assert_eq!(w.desc.unit, StatUnit::Seconds);
        assert_eq!(w.desc.base, StatBase::Pow10);
        assert!((w.desc.scale() - 1e-9).abs() < 1e-18);
        assert_eq!(s.get("blocking").unwrap().desc.kind, StatKind::Instant);
        assert_eq!(s.get("blocking").unwrap().desc.unit, StatUnit::Boolean);
        assert_eq!(s.get("max_rmap").unwrap().desc.kind, StatKind::Peak);
        assert_eq!(s.histogram("halt_wait_hist"), Some(&[1, 2, 3, 4][..]));
        assert_eq!(s.value("halt_wait_hist"), None);
        let hd = s.get("halt_wait_hist").unwrap().desc;
        assert_eq!(
            hd.bucket_upper_bounds(),
            vec![Some(1), Some(2), Some(4), None]
        );
        let ld = s.get("lin").unwrap().desc;
        assert_eq!(ld.kind, StatKind::LinearHist);
        assert_eq!(ld.bucket_upper_bounds(), vec![Some(10), Some(20), None]);
        assert!(s
            .get("exits")
            .unwrap()
            .desc
            .bucket_upper_bounds()
            .is_empty());
        assert_eq!(s.value("nope"), None);
        assert_eq!(s.iter().count(), 6);
    }

    #[test]
    fn delta_subtracts_monotonic_stats_only() {
        let (h, d, data) = sample();
        let a = parse(&h, &d, &data).unwrap();
        let (_, _, data2) = image(
            48,
            &[
                ("exits", 0, 0, &[15], 0),
                ("halt_wait_ns", 0, 0, &[9000], 0),
                ("blocking", 0, 0, &[0], 0),
                ("max_rmap", 0, 0, &[9], 0),
                ("halt_wait_hist", 0, 0, &[1, 3, 3, 9], 0),
                ("lin", 0, 0, &[0, 5, 7], 0),
            ],
        );
        let b = a.layout().snapshot(&data2).unwrap();
        let dlt = b.delta(&a).unwrap();
        assert_eq!(dlt.value("exits"), Some(5));
        assert_eq!(dlt.value("halt_wait_ns"), Some(4000));
        assert_eq!(dlt.value("blocking"), Some(0));
        assert_eq!(dlt.value("max_rmap"), Some(9));
        assert_eq!(dlt.histogram("halt_wait_hist"), Some(&[0, 1, 0, 5][..]));
        assert!(matches!(
            a.delta(&b).unwrap_err(),
            StatsError::WentBackwards { .. }
        ));
        let (h2, d2, data3) = image(48, &[("other", 0, 0, &[1], 0)]);
        let c = parse(&h2, &d2, &data3).unwrap();
        assert!(matches!(
            c.delta(&a).unwrap_err(),
            StatsError::LayoutMismatch
        ));
    }

    #[test]
    fn malformed_inputs_are_errors() {
        let (h, d, data) = sample();
        assert!(matches!(
            parse(&h[..23], &d, &data),
            Err(StatsError::Truncated {
                what: StatsBlock::Header,
                ..
            })
        ));
        assert!(matches!(
            parse(&h, &d[..d.len() - 1], &data),
            Err(StatsError::Truncated {
                what: StatsBlock::Descriptors,
                ..
            })
        ));
        assert!(matches!(
            parse(&h, &d, &data[..data.len() - 1]),
            Err(StatsError::Truncated {
                what: StatsBlock::Data,
                ..
            })
        ));
        let mut bad = h.clone();
        bad[4..8].copy_from_slice(&0u32.to_ne_bytes());
        assert!(matches!(
            parse(&bad, &d, &data),
            Err(StatsError::NameSize(0))
        ));
        bad[4..8].copy_from_slice(&(MAX_NAME_SIZE + 1).to_ne_bytes());
        assert!(matches!(
            parse(&bad, &d, &data),
            Err(StatsError::NameSize(_))
        ));
        let mut bad = h.clone();
        bad[8..12].copy_from_slice(&u32::MAX.to_ne_bytes());
        assert!(matches!(
            parse(&bad, &d, &data),
            Err(StatsError::TooManyDescriptors(_))
        ));

        let one = |name: &str, flags: u32, vals: &[u64], bucket: u32| {
            let (h, d, data) = image(8, &[(name, flags, 0, vals, bucket)]);
            parse(&h, &d, &data)
        };
        assert!(matches!(
            one("12345678", 0, &[1], 0),
            Err(StatsError::BadName { .. })
        ));
        assert!(matches!(
            one("", 0, &[1], 0),
            Err(StatsError::BadName { .. })
        ));
        assert!(matches!(
            one("x", 0, &[], 0),
            Err(StatsError::BadSize { .. })
        ));
        assert!(matches!(
            one("x", KVM_STATS_TYPE_LINEAR_HIST, &[1, 2], 0),
            Err(StatsError::ZeroBucketSize { .. })
        ));
        let (h, mut d, data) = image(8, &[("x", 0, 0, &[1], 0)]);
        d[16] = 0xff;
        assert!(matches!(
            parse(&h, &d, &data),
            Err(StatsError::BadName {
                why: NameFault::NotUtf8(_),
                ..
            })
        ));
        let (h, mut d, data) = image(8, &[("x", 0, 0, &[1], 0)]);
        d[8..12].copy_from_slice(&4u32.to_ne_bytes());
        assert!(matches!(
            parse(&h, &d, &data),
            Err(StatsError::BadOffset { .. })
        ));
        d[8..12].copy_from_slice(&u32::MAX.wrapping_sub(7).to_ne_bytes());
        assert!(matches!(
            parse(&h, &d, &data),
            Err(StatsError::BadOffset { .. })
        ));
        let (h, d, data) = image(8, &[("x", 0, 0, &[1], 0), ("x", 0, 0, &[2], 0)]);
        assert!(matches!(
            parse(&h, &d, &data),
            Err(StatsError::DuplicateName { .. })
        ));
    }

    #[test]
    fn unknown_kinds_and_units_are_kept() {
        let (h, d, data) = image(8, &[("x", 0xf | (0xa << 4) | (0x3 << 8), 2, &[3], 0)]);
        let s = parse(&h, &d, &data).unwrap();
        let x = s.get("x").unwrap().desc;
        assert_eq!(x.kind, StatKind::Unknown(0xf));
        assert_eq!(x.unit, StatUnit::Unknown(0xa));
        assert_eq!(x.base, StatBase::Unknown(3));
        assert_eq!(x.scale(), 1.0);
    }

    #[test]
    fn json_lists_every_stat() {
        let (h, d, data) = sample();
        let s = parse(&h, &d, &data).unwrap();
        let v: serde_json::Value = serde_json::to_value(&s).unwrap();
        assert_eq!(v["exits"]["value"], 10);
        assert_eq!(v["halt_wait_hist"]["buckets"][3], 4);
        assert_eq!(v["halt_wait_hist"]["kind"], "log_hist");
        assert_eq!(v.as_object().unwrap().len(), 6);
    }

    #[test]
    fn pseudo_random_inputs_never_panic() {
        // A tiny deterministic fuzz in unit tests (the real one is the cargo-fuzz target).
        let (h, d, data) = sample();
        let mut x = 0x9e37_79b9_7f4a_7c15u64;
        for _ in 0..2000 {
            let (mut h, mut d, mut data) = (h.clone(), d.clone(), data.clone());
            for _ in 0..4 {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                let which = x % 3;
                let buf = match which {
                    0 => &mut h,
                    1 => &mut d,
                    _ => &mut data,
                };
                if !buf.is_empty() {
                    let i = (x >> 8) as usize % buf.len();
                    buf[i] = (x >> 40) as u8;
                }
                if x % 7 == 0 {
                    let l = buf.len();
                    buf.truncate(l.saturating_sub((x >> 20) as usize % 9));
                }
            }
            let _ = parse(&h, &d, &data);
        }
    }
}
