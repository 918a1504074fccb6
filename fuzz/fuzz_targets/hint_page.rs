//! Fuzzes the hint pages (ABI 0.3) as the host reads them: arbitrary registrations (any page
//! frame, any vCPU), arbitrary guest writes anywhere in the pages (the guest owns its line
//! and may scribble over the host's), and the host's reactions: taking wait reports into the
//! budgets (`pvspin_yield::SpinBudgets`), publishing budgets, NOT_RUNNING, reading the
//! guest's hints. Invariants: nothing panics; a page registers only inside guest RAM; the
//! budgets stay within their configured bounds whatever the guest reports; what the host
//! publishes is what its budgets say; a wait report is taken once.
#![no_main]

use std::sync::atomic::Ordering;
use std::sync::Arc;

use libfuzzer_sys::fuzz_target;
use pvspin_abi::hint;
use pvspin_hints::{BufferPageMap, HintPages};
use pvspin_yield::budget::{ns_to_tsc, tsc_to_ns, BudgetConfig, SpinBudgets};

const PAGES: usize = 4;
const VCPUS: usize = 3;
const TSC_KHZ: u32 = 2_000_000;

fuzz_target!(|data: &[u8]| {
    let map = Arc::new(BufferPageMap::new(PAGES));
    let pages = HintPages::new(map.clone(), VCPUS);
    let cfg = BudgetConfig::default();
    let budgets = SpinBudgets::new(VCPUS, cfg).expect("default budgets are valid");
    for op in data.chunks_exact(10) {
        let v = usize::from(op[1]) % (VCPUS + 1); // VCPUS itself: no such vCPU
        let word = u64::from_le_bytes(op[2..10].try_into().unwrap());
        match op[0] % 5 {
            // SHARED_PAGE with an arbitrary frame (0 unregisters).
            0 => {
                let pfn = word as u32;
                match pages.register(v, pfn) {
                    Ok(Some(page)) => {
                        assert!(
                            v < VCPUS && (pfn as usize) < PAGES,
                            "registered {pfn} for {v}"
                        );
                        assert_eq!(
                            map.word(pfn as usize * 4096).load(Ordering::Relaxed) as u32,
                            hint::LAYOUT_VERSION
                        );
                        page.publish_wait_bounds(
                            ns_to_tsc(cfg.wait_after_min_ns, TSC_KHZ),
                            ns_to_tsc(cfg.wait_after_max_ns, TSC_KHZ),
                        );
                    }
                    Ok(None) => assert!(v < VCPUS && !hint::is_registration(pfn)),
                    Err(_) => assert!(v >= VCPUS || pfn as usize >= PAGES),
                }
            }
            // A guest write anywhere in guest RAM (its own line, the host's, other pages).
            1 => {
                let gpa = (word as usize >> 16) % (PAGES * 4096);
                map.word(gpa).store(word, Ordering::Relaxed);
            }
            // An exit of vCPU v: its wait report, if any, adapts its budget, then publish.
            2 => {
                let Some(page) = pages.get(v) else { continue };
                if let Some(cycles) = page.take_last_wait() {
                    assert_ne!(cycles, 0);
                    assert_eq!(page.take_last_wait(), None, "a report is taken once");
                    let after = budgets.on_wait(v, tsc_to_ns(cycles, TSC_KHZ));
                    assert!(
                        (cfg.wait_after_min_ns..=cfg.wait_after_max_ns).contains(&after),
                        "wait budget {after} outside its bounds"
                    );
                }
                let (notify, wait) = (budgets.notify_after_ns(v), budgets.wait_after_ns(v));
                page.publish_budgets(
                    ns_to_tsc(notify, TSC_KHZ),
                    ns_to_tsc(wait, TSC_KHZ),
                    TSC_KHZ,
                );
                assert_eq!(
                    page.budgets(),
                    (ns_to_tsc(notify, TSC_KHZ), ns_to_tsc(wait, TSC_KHZ))
                );
            }
            // A spin notification of v was useful or not.
            3 => {
                if v < VCPUS {
                    let after = budgets.on_notification(v, word & 1 == 0);
                    assert!((cfg.notify_after_ns..=cfg.notify_after_max_ns).contains(&after));
                }
            }
            // The host parks or resumes v; the guest reads its hints meanwhile.
            _ => {
                let Some(page) = pages.get(v) else { continue };
                page.set_not_running(word & 1 == 1);
                assert_eq!(page.not_running(), word & 1 == 1);
                let _ = page.guest_hints();
            }
        }
    }
});
