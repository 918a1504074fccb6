//! What the VMM's firmware tables say, read once by the guest's boot vCPU under PVH boot: the
//! CPU list (ACPI MADT, else the MP table) and how to power off (FADT, and `\_S5_` in the
//! DSDT).
//!
//! Every table is VMM data: lengths are bounded, checksums checked, and a table that does not
//! make sense is treated as absent. The guest reads physical memory directly; the tests read
//! the tables `pvspin-vmm` writes from a buffer ([`PhysRead`]).

use crate::MAX_VCPUS;

/// Guest-physical memory the tables are read from.
pub trait PhysRead {
    /// The `len` bytes at `addr`, or `None` when that memory cannot be read (then the caller
    /// sees zeros). A slice, not a copy: in the guest every instruction of the boot path is
    /// emulated on some hosts, and the checksums and the DSDT scan cover whole tables.
    fn slice(&self, addr: u64, len: usize) -> Option<&[u8]>;
}

/// The CPUs the VMM lists, in its order: their (x)APIC IDs.
#[derive(Clone, Debug)]
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
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PowerOff {
    /// The hardware-reduced sleep control register (an I/O port), 0 if none.
    pub sleep_control_port: u16,
    /// PM1a control block (an I/O port), 0 if none.
    pub pm1a_control_port: u16,
    /// PM1b control block, 0 if none.
    pub pm1b_control_port: u16,
    /// The FADT says hardware-reduced ACPI.
    pub hardware_reduced: bool,
    /// GPA of the DSDT (0: none), whose `\_S5_` package gives S5's `SLP_TYP`
    /// ([`s5_sleep_type`]: read only when powering off, since the DSDT is the largest table and
    /// the boot path is emulated on some hosts).
    pub dsdt: u64,
}

/// `SLP_TYP` of S5 for `power`: the DSDT's `\_S5_` package, else 5 with hardware-reduced ACPI
/// (Cloud Hypervisor's and QEMU microvm's value) and 0 otherwise (QEMU's PC machines').
pub fn s5_sleep_type(memory: &impl PhysRead, power: &PowerOff) -> u8 {
    Reader(memory)
        .s5_sleep_type(power.dsdt)
        .unwrap_or(if power.hardware_reduced { 5 } else { 0 })
}

/// The most bytes any one table may span (a bound on what a bad length makes the guest read).
const MAX_TABLE_BYTES: u32 = 1 << 20;
/// Tables must lie below 4 GiB, the part the guest maps.
const MAPPED_LIMIT: u64 = 1 << 32;

/// Reads the tables through a [`PhysRead`]; unreadable memory reads as zeros.
struct Reader<'a, M: PhysRead>(&'a M);

impl<M: PhysRead> Reader<'_, M> {
    /// `len` bytes at `addr` below 4 GiB, when readable.
    fn slice(&self, addr: u64, len: usize) -> Option<&[u8]> {
        if addr
            .checked_add(len as u64)
            .is_none_or(|end| end > MAPPED_LIMIT)
        {
            return None;
        }
        self.0.slice(addr, len).filter(|s| s.len() == len)
    }

    fn bytes<const N: usize>(&self, addr: u64) -> [u8; N] {
        self.slice(addr, N)
            .and_then(|s| <[u8; N]>::try_from(s).ok())
            .unwrap_or([0; N])
    }

    /// The first 16-byte-aligned address in `[start, start + len)` holding `signature` for
    /// which `valid` holds.
    fn find_signature(
        &self,
        start: u64,
        len: usize,
        signature: &[u8],
        valid: &dyn Fn(u64) -> bool,
    ) -> Option<u64> {
        let area = self.slice(start, len)?;
        area.chunks(16)
            .enumerate()
            .filter(|(_, chunk)| chunk.starts_with(signature))
            .map(|(i, _)| start + 16 * i as u64)
            .find(|addr| valid(*addr))
    }

    fn u8_at(&self, addr: u64) -> u8 {
        self.bytes::<1>(addr)[0]
    }

    fn u16_at(&self, addr: u64) -> u16 {
        u16::from_le_bytes(self.bytes(addr))
    }

    fn u32_at(&self, addr: u64) -> u32 {
        u32::from_le_bytes(self.bytes(addr))
    }

    fn u64_at(&self, addr: u64) -> u64 {
        u64::from_le_bytes(self.bytes(addr))
    }

    fn checksum_ok(&self, addr: u64, len: u32) -> bool {
        self.slice(addr, len as usize)
            .is_some_and(|bytes| bytes.iter().fold(0u8, |sum, b| sum.wrapping_add(*b)) == 0)
    }

    /// A system description table at `addr` with signature `sig`, valid checksum and a sane
    /// length; returns its length.
    fn table(&self, addr: u64, sig: &[u8; 4]) -> Option<u32> {
        if addr == 0 || addr.saturating_add(36) > MAPPED_LIMIT || &self.bytes::<4>(addr) != sig {
            return None;
        }
        let len = self.u32_at(addr + 4);
        (36..=MAX_TABLE_BYTES)
            .contains(&len)
            .then_some(len)
            .filter(|len| {
                addr.saturating_add(u64::from(*len)) <= MAPPED_LIMIT && self.checksum_ok(addr, *len)
            })
    }

    /// Finds the RSDP: at `hint` (the start info's `rsdp_paddr`), else in the first KiB of the
    /// EBDA or the BIOS area 0xe0000..0x100000, on 16-byte boundaries.
    fn find_rsdp(&self, hint: u64) -> Option<u64> {
        let valid = |addr: u64| &self.bytes::<8>(addr) == b"RSD PTR " && self.checksum_ok(addr, 20);
        if hint != 0 && hint.saturating_add(36) <= MAPPED_LIMIT && valid(hint) {
            return Some(hint);
        }
        let ebda = u64::from(self.u16_at(0x40e)) << 4;
        let ebda_area = (0x8_0000..0xa_0000).contains(&ebda).then_some((ebda, 1024));
        ebda_area
            .into_iter()
            .chain([(0xe_0000, 0x2_0000)])
            .find_map(|(start, len)| self.find_signature(start, len, b"RSD PTR ", &valid))
    }

    /// Calls `visit(signature, address)` for every table the RSDT or XSDT lists.
    fn for_each_table(&self, rsdp: u64, mut visit: impl FnMut(&[u8; 4], u64)) {
        let revision = self.u8_at(rsdp + 15);
        let xsdt = if revision >= 2 && self.checksum_ok(rsdp, 36) {
            self.u64_at(rsdp + 24)
        } else {
            0
        };
        let (root, entry_size) = match self.table(xsdt, b"XSDT") {
            Some(len) => ((xsdt, len), 8),
            None => {
                let rsdt = u64::from(self.u32_at(rsdp + 16));
                match self.table(rsdt, b"RSDT") {
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
                self.u64_at(at)
            } else {
                u64::from(self.u32_at(at))
            };
            if entry != 0 && entry.saturating_add(36) <= MAPPED_LIMIT {
                visit(&self.bytes::<4>(entry), entry);
            }
        }
    }

    /// The CPUs in the MADT: enabled processor local APIC entries (type 0) and x2APIC entries
    /// (type 9) with IDs below 255.
    fn madt_cpus(&self, madt: u64, len: u32) -> CpuList {
        let mut cpus = CpuList::new("ACPI MADT");
        let end = madt + u64::from(len);
        let mut at = madt + 44;
        while at + 2 <= end {
            let (kind, entry_len) = (self.u8_at(at), u64::from(self.u8_at(at + 1)));
            if entry_len < 2 || at + entry_len > end {
                break;
            }
            match (kind, entry_len) {
                (0, 8..) if self.u32_at(at + 4) & 1 != 0 => {
                    cpus.push(u32::from(self.u8_at(at + 3)));
                }
                (9, 16..) if self.u32_at(at + 8) & 1 != 0 => cpus.push(self.u32_at(at + 4)),
                _ => {}
            }
            at += entry_len;
        }
        cpus
    }

    /// `SLP_TYP` of S5 from the DSDT's `Name (_S5_, Package () { a, ... })`, by a byte scan (no
    /// AML interpreter: the name and package encoding are fixed bytes).
    fn s5_sleep_type(&self, dsdt: u64) -> Option<u8> {
        let len = self.table(dsdt, b"DSDT")?;
        let end = dsdt + u64::from(len);
        let body = self.slice(dsdt + 36, len as usize - 36)?;
        let at = dsdt + 36 + body.windows(5).position(|w| w == b"_S5_\x12")? as u64;
        // PackageOp, PkgLength (1 to 4 bytes), NumElements, then the first element.
        let extra = u64::from(self.u8_at(at + 5) >> 6);
        let element = at + 5 + 1 + extra + 1;
        if element + 2 > end {
            return None;
        }
        match self.u8_at(element) {
            0x0a => Some(self.u8_at(element + 1)), // BytePrefix
            0x00 => Some(0),                       // ZeroOp
            0x01 => Some(1),                       // OneOp
            value if value < 0x08 => Some(value),
            _ => None,
        }
    }

    fn fadt_power_off(&self, fadt: u64, len: u32) -> PowerOff {
        let flags = if len >= 116 {
            self.u32_at(fadt + 112)
        } else {
            0
        };
        let hardware_reduced = flags & (1 << 20) != 0;
        let port = |offset: u64| -> u16 {
            if u64::from(len) >= offset + 4 {
                u16::try_from(self.u32_at(fadt + offset)).unwrap_or(0)
            } else {
                0
            }
        };
        // SLEEP_CONTROL_REG, a generic address: space 1 is system I/O.
        let sleep_control_port = if hardware_reduced && len >= 256 && self.u8_at(fadt + 244) == 1 {
            u16::try_from(self.u64_at(fadt + 248)).unwrap_or(0)
        } else {
            0
        };
        let x_dsdt = if len >= 148 {
            self.u64_at(fadt + 140)
        } else {
            0
        };
        let dsdt = if x_dsdt != 0 {
            x_dsdt
        } else {
            u64::from(self.u32_at(fadt + 40))
        };
        PowerOff {
            sleep_control_port,
            pm1a_control_port: if hardware_reduced { 0 } else { port(64) },
            pm1b_control_port: if hardware_reduced { 0 } else { port(68) },
            hardware_reduced,
            dsdt,
        }
    }

    /// The CPU list of the MP table (Intel MultiProcessor Specification 1.4): processor entries
    /// with the enabled flag.
    fn mp_table_cpus(&self) -> Option<CpuList> {
        let ebda = u64::from(self.u16_at(0x40e)) << 4;
        let valid = |addr: u64| self.checksum_ok(addr, 16);
        let floating = [(ebda, 1024), (0x9_fc00, 1024), (0xf_0000, 0x1_0000)]
            .into_iter()
            .filter(|(start, _)| (0x8_0000..0x10_0000).contains(start))
            .find_map(|(start, len)| self.find_signature(start, len, b"_MP_", &valid))?;
        let config = u64::from(self.u32_at(floating + 4));
        if config == 0
            || config.saturating_add(44) > MAPPED_LIMIT
            || &self.bytes::<4>(config) != b"PCMP"
        {
            return None;
        }
        let len = u64::from(self.u16_at(config + 4));
        if len < 44 || !self.checksum_ok(config, len as u32) {
            return None;
        }
        let mut cpus = CpuList::new("MP table");
        let end = config + len;
        let mut at = config + 44;
        for _ in 0..self.u16_at(config + 34) {
            let entry_len = if self.u8_at(at) == 0 { 20 } else { 8 };
            if at + entry_len > end {
                break;
            }
            if self.u8_at(at) == 0 && self.u8_at(at + 3) & 1 != 0 {
                cpus.push(u32::from(self.u8_at(at + 1)));
            }
            at += entry_len;
        }
        Some(cpus)
    }
}

/// What the firmware tables say.
#[derive(Clone, Debug)]
pub struct Firmware {
    /// The CPUs, when a table lists them.
    pub cpus: Option<CpuList>,
    /// How to power off.
    pub power_off: PowerOff,
}

/// Reads the MADT and FADT through the RSDP (`rsdp_hint`, or a scan); the MP table when there
/// is no MADT.
pub fn read(memory: &impl PhysRead, rsdp_hint: u64) -> Firmware {
    let reader = Reader(memory);
    let mut cpus = None;
    let mut power_off = PowerOff::default();
    if let Some(rsdp) = reader.find_rsdp(rsdp_hint) {
        reader.for_each_table(rsdp, |sig, addr| match sig {
            b"APIC" => {
                if let Some(len) = reader.table(addr, b"APIC") {
                    cpus = Some(reader.madt_cpus(addr, len)).filter(|list| list.count > 0);
                }
            }
            b"FACP" => {
                if let Some(len) = reader.table(addr, b"FACP") {
                    power_off = reader.fadt_power_off(addr, len);
                }
            }
            _ => {}
        });
    }
    if cpus.is_none() {
        cpus = reader.mp_table_cpus().filter(|list| list.count > 0);
    }
    Firmware { cpus, power_off }
}

#[cfg(test)]
mod tests {
    extern crate std;
    use std::vec;
    use std::vec::Vec;

    use super::*;

    /// 1 MiB of guest memory from GPA 0.
    struct Memory(Vec<u8>);

    impl Memory {
        fn new() -> Self {
            Self(vec![0; 1 << 20])
        }

        fn put(&mut self, addr: u64, bytes: &[u8]) {
            self.0[addr as usize..addr as usize + bytes.len()].copy_from_slice(bytes);
        }
    }

    impl PhysRead for Memory {
        fn slice(&self, addr: u64, len: usize) -> Option<&[u8]> {
            self.0.get(addr as usize..(addr as usize).checked_add(len)?)
        }
    }

    fn fix_checksum(bytes: &mut [u8], at: usize, len: usize) {
        bytes[at] = 0;
        let sum = bytes[..len].iter().fold(0u8, |s, b| s.wrapping_add(*b));
        bytes[at] = 0u8.wrapping_sub(sum);
    }

    fn sdt(sig: &[u8; 4], body: &[u8]) -> Vec<u8> {
        let mut t = Vec::new();
        t.extend_from_slice(sig);
        t.extend_from_slice(&(36 + body.len() as u32).to_le_bytes());
        t.extend_from_slice(&[1, 0]);
        t.extend_from_slice(&[b'T'; 26]);
        t.extend_from_slice(body);
        let len = t.len();
        fix_checksum(&mut t, 9, len);
        t
    }

    /// An RSDP (revision 2) at `at` whose XSDT at `xsdt` lists `tables`.
    fn acpi(memory: &mut Memory, at: u64, xsdt: u64, tables: &[u64]) {
        let mut rsdp = Vec::new();
        rsdp.extend_from_slice(b"RSD PTR ");
        rsdp.push(0);
        rsdp.extend_from_slice(b"TESTID");
        rsdp.push(2);
        rsdp.extend_from_slice(&0u32.to_le_bytes());
        rsdp.extend_from_slice(&36u32.to_le_bytes());
        rsdp.extend_from_slice(&xsdt.to_le_bytes());
        rsdp.extend_from_slice(&[0; 4]);
        fix_checksum(&mut rsdp, 8, 20);
        fix_checksum(&mut rsdp, 32, 36);
        memory.put(at, &rsdp);
        let body: Vec<u8> = tables.iter().flat_map(|t| t.to_le_bytes()).collect();
        memory.put(xsdt, &sdt(b"XSDT", &body));
    }

    fn madt(entries: &[&[u8]]) -> Vec<u8> {
        let mut body = vec![0, 0, 0xe0, 0xfe, 1, 0, 0, 0];
        for entry in entries {
            body.extend_from_slice(entry);
        }
        sdt(b"APIC", &body)
    }

    #[test]
    fn the_madt_lists_enabled_cpus_in_order_and_skips_the_rest() {
        let mut memory = Memory::new();
        acpi(&mut memory, 0xe_0000, 0xe_0100, &[0xe_0200]);
        let x2apic = |id: u32, flags: u32| {
            let mut e = vec![9, 16, 0, 0];
            e.extend_from_slice(&id.to_le_bytes());
            e.extend_from_slice(&flags.to_le_bytes());
            e.extend_from_slice(&[0; 4]);
            e
        };
        memory.put(
            0xe_0200,
            &madt(&[
                &[0, 8, 0, 2, 1, 0, 0, 0],
                &[0, 8, 1, 0, 1, 0, 0, 0],
                &[0, 8, 2, 7, 0, 0, 0, 0], // disabled (a hot-plug slot)
                &[1, 12, 0, 0, 0, 0, 0xc0, 0xfe, 0, 0, 0, 0], // an IOAPIC
                &x2apic(5, 1),
                &x2apic(300, 1),           // needs x2APIC: not this guest's
                &[0, 8, 3, 2, 1, 0, 0, 0], // a duplicate ID
            ]),
        );
        // Found by the hint and by the scan alike.
        for hint in [0xe_0000, 0] {
            let cpus = read(&memory, hint).cpus.expect("a CPU list");
            assert_eq!(cpus.source, "ACPI MADT");
            assert_eq!(&cpus.apic_ids[..cpus.count], &[2, 0, 5]);
            assert_eq!(cpus.index_of(5), Some(2));
            assert_eq!(cpus.index_of(7), None);
        }
    }

    #[test]
    fn broken_tables_count_as_absent_and_never_read_out_of_bounds() {
        let mut memory = Memory::new();
        // A MADT whose checksum is wrong, an XSDT entry far above 4 GiB, and one at u64::MAX.
        acpi(
            &mut memory,
            0xe_0000,
            0xe_0100,
            &[0xe_0200, u64::MAX - 4, 1 << 40],
        );
        let mut bad = madt(&[&[0, 8, 0, 0, 1, 0, 0, 0]]);
        bad[9] ^= 1;
        memory.put(0xe_0200, &bad);
        assert!(read(&memory, 0xe_0000).cpus.is_none());
        // An entry of length 0 ends the walk instead of looping.
        memory.put(0xe_0200, &madt(&[&[0, 8, 0, 0, 1, 0, 0, 0], &[0, 0, 0, 0]]));
        let cpus = read(&memory, 0xe_0000).cpus.unwrap();
        assert_eq!(cpus.count, 1);
        // A length past the table ends it too.
        memory.put(0xe_0200, &madt(&[&[0, 200, 0, 0, 1, 0, 0, 0]]));
        assert!(read(&memory, 0xe_0000).cpus.is_none());
        // No RSDP anywhere: nothing, and the default power-off.
        let empty = Memory::new();
        let firmware = read(&empty, 0);
        assert!(firmware.cpus.is_none());
        assert_eq!(firmware.power_off.sleep_control_port, 0);
    }

    fn fadt(flags: u32, pm1a: u32, sleep_control: Option<u16>, dsdt: u64) -> Vec<u8> {
        let mut body = vec![0u8; 276 - 36];
        let mut put = |offset: usize, bytes: &[u8]| {
            body[offset - 36..offset - 36 + bytes.len()].copy_from_slice(bytes);
        };
        put(40, &(dsdt as u32).to_le_bytes());
        put(64, &pm1a.to_le_bytes());
        put(112, &flags.to_le_bytes());
        if let Some(port) = sleep_control {
            put(244, &[1, 8, 0, 1]);
            put(248, &u64::from(port).to_le_bytes());
        }
        sdt(b"FACP", &body)
    }

    #[test]
    fn power_off_comes_from_the_fadt_and_the_dsdts_s5() {
        let mut memory = Memory::new();
        acpi(&mut memory, 0xe_0000, 0xe_0100, &[0xe_0400]);
        // Hardware-reduced (Cloud Hypervisor's kind): the sleep control register, S5 = 5.
        memory.put(0xe_0400, &fadt(1 << 20, 0, Some(0x600), 0xe_0800));
        let aml = [
            0x10, 0x08, b'_', b'S', b'5', b'_', 0x12, 0x04, 0x01, 0x0a, 0x05,
        ];
        memory.put(0xe_0800, &sdt(b"DSDT", &aml));
        let power = read(&memory, 0xe_0000).power_off;
        assert_eq!(power.sleep_control_port, 0x600);
        assert_eq!(power.pm1a_control_port, 0);
        assert_eq!(s5_sleep_type(&memory, &power), 5);
        // PM1 control blocks (QEMU's PC machines), S5 = ZeroOp.
        memory.put(0xe_0400, &fadt(0, 0x604, None, 0xe_0800));
        let aml = [
            0x08, b'_', b'S', b'5', b'_', 0x12, 0x06, 0x04, 0x00, 0x00, 0x00, 0x00,
        ];
        memory.put(0xe_0800, &sdt(b"DSDT", &aml));
        let power = read(&memory, 0xe_0000).power_off;
        assert_eq!(
            (power.sleep_control_port, power.pm1a_control_port),
            (0, 0x604)
        );
        assert_eq!(s5_sleep_type(&memory, &power), 0);
        // A DSDT without \_S5_, or a broken one: the default of the FADT's kind.
        memory.put(0xe_0800, &sdt(b"DSDT", &[0x10, 0x08]));
        assert_eq!(s5_sleep_type(&memory, &power), 0);
        let hardware_reduced = PowerOff {
            hardware_reduced: true,
            ..power
        };
        assert_eq!(s5_sleep_type(&memory, &hardware_reduced), 5);
    }

    #[test]
    fn the_mp_table_lists_the_cpus_when_there_is_no_madt() {
        let mut memory = Memory::new();
        let config = 0x9_fd00u64;
        let mut table = Vec::new();
        table.extend_from_slice(b"PCMP");
        table.extend_from_slice(&[0, 0, 4, 0]); // length (below), revision, checksum
        table.extend_from_slice(&[0; 34 - 8]);
        table.extend_from_slice(&3u16.to_le_bytes()); // entry count
        table.extend_from_slice(&[0; 44 - 36]);
        let processor = |id: u8, flags: u8| {
            let mut e = vec![0, id, 0x14, flags];
            e.extend_from_slice(&[0; 16]);
            e
        };
        table.extend_from_slice(&processor(0, 3));
        table.extend_from_slice(&[1, 0, 0, 0, 0, 0, 0, 0]); // a bus
        table.extend_from_slice(&processor(1, 1));
        let len = table.len() as u16;
        table[4..6].copy_from_slice(&len.to_le_bytes());
        fix_checksum(&mut table, 7, len as usize);
        memory.put(config, &table);
        let mut floating = Vec::new();
        floating.extend_from_slice(b"_MP_");
        floating.extend_from_slice(&(config as u32).to_le_bytes());
        floating.extend_from_slice(&[1, 4, 0, 0, 0, 0, 0, 0]);
        fix_checksum(&mut floating, 10, 16);
        memory.put(0x9_fc00, &floating);
        let cpus = read(&memory, 0).cpus.expect("the MP table's CPUs");
        assert_eq!(cpus.source, "MP table");
        // The bus entry (8 bytes) is stepped over, and is no CPU.
        assert_eq!(&cpus.apic_ids[..cpus.count], &[0, 1]);
    }
}
