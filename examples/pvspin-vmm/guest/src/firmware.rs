//! What the VMM's firmware tables say, read once by the boot vCPU under PVH boot: the CPU list
//! (ACPI MADT, else the MP table) and how to power off (FADT, and `\_S5_` in the DSDT).
//!
//! Every table is VMM data: lengths are bounded, checksums checked, and a table that does not
//! make sense is treated as absent.

use pvspin_vmm_proto::MAX_VCPUS;

/// The CPUs the VMM lists, in its order: their (x)APIC IDs.
pub struct CpuList {
    /// APIC IDs; only the first `count` mean anything.
    pub apic_ids: [u8; MAX_VCPUS as usize],
    /// How many CPUs.
    pub count: usize,
    /// Where the list came from, for the boot line.
    pub source: &'static str,
}

impl CpuList {
    const fn new(source: &'static str) -> Self {
        Self {
            apic_ids: [0; MAX_VCPUS as usize],
            count: 0,
            source,
        }
    }

    fn push(&mut self, apic_id: u32) {
        // 0xff is the xAPIC broadcast ID; IDs beyond it need x2APIC, which this guest does not
        // use.
        let Ok(id) = u8::try_from(apic_id) else {
            return;
        };
        if id == 0xff
            || self
                .apic_ids
                .iter()
                .take(self.count)
                .any(|known| *known == id)
        {
            return;
        }
        if let Some(slot) = self.apic_ids.get_mut(self.count) {
            *slot = id;
            self.count += 1;
        }
    }

    /// The index of `apic_id` in the list.
    pub fn index_of(&self, apic_id: u8) -> Option<usize> {
        self.apic_ids
            .iter()
            .take(self.count)
            .position(|id| *id == apic_id)
    }
}

/// How to power off, from the FADT.
#[derive(Clone, Copy, Default)]
pub struct PowerOff {
    /// The hardware-reduced sleep control register (an I/O port), 0 if none.
    pub sleep_control_port: u16,
    /// PM1a control block (an I/O port), 0 if none.
    pub pm1a_control_port: u16,
    /// PM1b control block, 0 if none.
    pub pm1b_control_port: u16,
    /// `SLP_TYP` of S5, from the DSDT's `\_S5_` package.
    pub s5_sleep_type: u8,
}

/// Reads `N` bytes of guest-physical memory.
fn bytes<const N: usize>(addr: u64) -> [u8; N] {
    // SAFETY: the PVH page tables identity-map the first 4 GiB, and every caller keeps `addr`
    // below 4 GiB; the VMM's tables are plain memory, read without side effects.
    unsafe { (addr as *const [u8; N]).read_unaligned() }
}

fn u8_at(addr: u64) -> u8 {
    bytes::<1>(addr)[0]
}

fn u16_at(addr: u64) -> u16 {
    u16::from_le_bytes(bytes(addr))
}

fn u32_at(addr: u64) -> u32 {
    u32::from_le_bytes(bytes(addr))
}

fn u64_at(addr: u64) -> u64 {
    u64::from_le_bytes(bytes(addr))
}

/// The most bytes any one table may span (a bound on what a bad length makes the guest read).
const MAX_TABLE_BYTES: u32 = 1 << 20;
/// Tables must lie below 4 GiB, the part the guest maps.
const MAPPED_LIMIT: u64 = 1 << 32;

fn checksum_ok(addr: u64, len: u32) -> bool {
    (0..u64::from(len)).fold(0u8, |sum, i| sum.wrapping_add(u8_at(addr + i))) == 0
}

/// A system description table at `addr` with signature `sig`, valid checksum and a sane
/// length; returns its length.
fn table(addr: u64, sig: &[u8; 4]) -> Option<u32> {
    if addr == 0 || addr + 36 > MAPPED_LIMIT || &bytes::<4>(addr) != sig {
        return None;
    }
    let len = u32_at(addr + 4);
    (36..=MAX_TABLE_BYTES)
        .contains(&len)
        .then_some(len)
        .filter(|len| addr + u64::from(*len) <= MAPPED_LIMIT && checksum_ok(addr, *len))
}

/// Finds the RSDP: at `hint` (the start info's `rsdp_paddr`), else in the first KiB of the
/// EBDA or the BIOS area 0xe0000..0x100000, on 16-byte boundaries.
fn find_rsdp(hint: u64) -> Option<u64> {
    let valid = |addr: u64| &bytes::<8>(addr) == b"RSD PTR " && checksum_ok(addr, 20);
    if hint != 0 && hint + 36 <= MAPPED_LIMIT && valid(hint) {
        return Some(hint);
    }
    let ebda = u64::from(u16_at(0x40e)) << 4;
    let ebda_range = if (0x8_0000..0xa_0000).contains(&ebda) {
        ebda..ebda + 1024
    } else {
        0..0
    };
    ebda_range
        .step_by(16)
        .chain((0xe_0000..0x10_0000).step_by(16))
        .find(|addr| valid(*addr))
}

/// Calls `visit(signature, address)` for every table the RSDT or XSDT lists.
fn for_each_table(rsdp: u64, mut visit: impl FnMut(&[u8; 4], u64)) {
    let revision = u8_at(rsdp + 15);
    let xsdt = if revision >= 2 && checksum_ok(rsdp, 36) {
        u64_at(rsdp + 24)
    } else {
        0
    };
    let (root, entry_size) = match table(xsdt, b"XSDT") {
        Some(len) => ((xsdt, len), 8),
        None => {
            let rsdt = u64::from(u32_at(rsdp + 16));
            match table(rsdt, b"RSDT") {
                Some(len) => ((rsdt, len), 4),
                None => return,
            }
        }
    };
    let (addr, len) = root;
    let entries = (u64::from(len) - 36) / entry_size;
    for i in 0..entries {
        let at = addr + 36 + i * entry_size;
        let entry = if entry_size == 8 {
            u64_at(at)
        } else {
            u64::from(u32_at(at))
        };
        if entry != 0 && entry + 36 <= MAPPED_LIMIT {
            visit(&bytes::<4>(entry), entry);
        }
    }
}

/// The CPUs in the MADT: enabled processor local APIC entries (type 0) and x2APIC entries
/// (type 9) with IDs below 255.
fn madt_cpus(madt: u64, len: u32) -> CpuList {
    let mut cpus = CpuList::new("ACPI MADT");
    let end = madt + u64::from(len);
    let mut at = madt + 44;
    while at + 2 <= end {
        let (kind, entry_len) = (u8_at(at), u64::from(u8_at(at + 1)));
        if entry_len < 2 || at + entry_len > end {
            break;
        }
        match (kind, entry_len) {
            (0, 8..) if u32_at(at + 4) & 1 != 0 => cpus.push(u32::from(u8_at(at + 3))),
            (9, 16..) if u32_at(at + 8) & 1 != 0 => cpus.push(u32_at(at + 4)),
            _ => {}
        }
        at += entry_len;
    }
    cpus
}

/// `SLP_TYP` of S5 from the DSDT's `Name (_S5_, Package () { a, ... })`, by a byte scan (no
/// AML interpreter: the name and package encoding are fixed bytes).
fn s5_sleep_type(dsdt: u64) -> Option<u8> {
    let len = table(dsdt, b"DSDT")?;
    let end = dsdt + u64::from(len);
    let mut at = dsdt + 36;
    while at + 8 <= end {
        if &bytes::<4>(at) == b"_S5_" && u8_at(at + 4) == 0x12 {
            // PackageOp, PkgLength (1 to 4 bytes), NumElements, then the first element.
            let extra = u64::from(u8_at(at + 5) >> 6);
            let element = at + 5 + 1 + extra + 1;
            if element + 2 > end {
                return None;
            }
            return match u8_at(element) {
                0x0a => Some(u8_at(element + 1)), // BytePrefix
                0x00 => Some(0),                  // ZeroOp
                0x01 => Some(1),                  // OneOp
                value if value < 0x08 => Some(value),
                _ => None,
            };
        }
        at += 1;
    }
    None
}

fn fadt_power_off(fadt: u64, len: u32) -> PowerOff {
    let flags = if len >= 116 { u32_at(fadt + 112) } else { 0 };
    let hardware_reduced = flags & (1 << 20) != 0;
    let port = |offset: u64| -> u16 {
        if u64::from(len) >= offset + 4 {
            u16::try_from(u32_at(fadt + offset)).unwrap_or(0)
        } else {
            0
        }
    };
    // SLEEP_CONTROL_REG, a generic address: space 1 is system I/O.
    let sleep_control_port = if hardware_reduced && len >= 256 && u8_at(fadt + 244) == 1 {
        u16::try_from(u64_at(fadt + 248)).unwrap_or(0)
    } else {
        0
    };
    let x_dsdt = if len >= 148 { u64_at(fadt + 140) } else { 0 };
    let dsdt = if x_dsdt != 0 {
        x_dsdt
    } else {
        u64::from(u32_at(fadt + 40))
    };
    PowerOff {
        sleep_control_port,
        pm1a_control_port: if hardware_reduced { 0 } else { port(64) },
        pm1b_control_port: if hardware_reduced { 0 } else { port(68) },
        s5_sleep_type: s5_sleep_type(dsdt).unwrap_or(if hardware_reduced { 5 } else { 0 }),
    }
}

/// The CPU list of the MP table (Intel MultiProcessor Specification 1.4): processor entries
/// with the enabled flag.
fn mp_table_cpus() -> Option<CpuList> {
    let ebda = u64::from(u16_at(0x40e)) << 4;
    let floating = [(ebda, 1024), (0x9_fc00, 1024), (0xf_0000, 0x1_0000)]
        .into_iter()
        .filter(|(start, _)| (0x8_0000..0x10_0000).contains(start))
        .flat_map(|(start, len)| (start..start + len).step_by(16))
        .find(|addr| &bytes::<4>(*addr) == b"_MP_" && checksum_ok(*addr, 16))?;
    let config = u64::from(u32_at(floating + 4));
    if config == 0 || config + 44 > MAPPED_LIMIT || &bytes::<4>(config) != b"PCMP" {
        return None;
    }
    let len = u64::from(u16_at(config + 4));
    if len < 44 || !checksum_ok(config, len as u32) {
        return None;
    }
    let mut cpus = CpuList::new("MP table");
    let end = config + len;
    let mut at = config + 44;
    for _ in 0..u16_at(config + 34) {
        let entry_len = if u8_at(at) == 0 { 20 } else { 8 };
        if at + entry_len > end {
            break;
        }
        if u8_at(at) == 0 && u8_at(at + 3) & 1 != 0 {
            cpus.push(u32::from(u8_at(at + 1)));
        }
        at += entry_len;
    }
    Some(cpus)
}

/// What the firmware tables say.
pub struct Firmware {
    /// The CPUs, when a table lists them.
    pub cpus: Option<CpuList>,
    /// How to power off.
    pub power_off: PowerOff,
}

/// Reads the MADT and FADT through the RSDP (`rsdp_hint`, or a scan); the MP table when there
/// is no MADT.
pub fn read(rsdp_hint: u64) -> Firmware {
    let mut cpus = None;
    let mut power_off = PowerOff::default();
    if let Some(rsdp) = find_rsdp(rsdp_hint) {
        for_each_table(rsdp, |sig, addr| match sig {
            b"APIC" => {
                if let Some(len) = table(addr, b"APIC") {
                    cpus = Some(madt_cpus(addr, len)).filter(|list| list.count > 0);
                }
            }
            b"FACP" => {
                if let Some(len) = table(addr, b"FACP") {
                    power_off = fadt_power_off(addr, len);
                }
            }
            _ => {}
        });
    }
    if cpus.is_none() {
        cpus = mp_table_cpus().filter(|list| list.count > 0);
    }
    Firmware { cpus, power_off }
}
