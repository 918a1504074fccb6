//! What `bench` and `report` show people: the table alone on stdout, the saved runs printed
//! again as the same table, and SVG plots a browser can draw.
//!
//! `fixtures/bench-lock-user-2vcpu.jsonl` and `.txt` are a real bench's `--json-out` and its
//! stdout: `pvspin-vmm bench --workload lock --cs-mode user --iterations 200 --vcpus 2 --hogs
//! 0,2 --runs 2 --variants ticket:off,ticket:kick --json-out bench-lock-user-2vcpu.jsonl`.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

const VMM: &str = env!("CARGO_BIN_EXE_pvspin-vmm");

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures")
        .join(name)
}

/// A directory of its own for a test's files.
fn scratch(test: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("pvspin-vmm-{test}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

fn vmm(args: &[&str]) -> Output {
    let out = Command::new(VMM).args(args).output().unwrap();
    assert!(
        out.status.success(),
        "pvspin-vmm {args:?}: {}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

fn stdout(out: &Output) -> String {
    String::from_utf8(out.stdout.clone()).unwrap()
}

/// Parses `svg` as XML; returns its text (every text node, one per line) after checking the
/// root is an `<svg>` element.
fn svg_text(svg: &str) -> String {
    let doc = roxmltree::Document::parse(svg).unwrap_or_else(|err| panic!("{err}\n{svg}"));
    let root = doc.root_element();
    assert_eq!(root.tag_name().name(), "svg");
    assert_eq!(
        root.tag_name().namespace(),
        Some("http://www.w3.org/2000/svg")
    );
    assert!(root.attribute("width").is_some() && root.attribute("height").is_some());
    doc.descendants()
        .filter(|n| n.has_tag_name("text"))
        .filter_map(|n| n.text())
        .map(|t| t.trim().to_string())
        .collect::<Vec<_>>()
        .join("\n")
}

#[test]
fn report_prints_the_table_bench_printed() {
    let jsonl = fixture("bench-lock-user-2vcpu.jsonl");
    let expected = std::fs::read_to_string(fixture("bench-lock-user-2vcpu.txt")).unwrap();
    let out = vmm(&["report", jsonl.to_str().unwrap()]);
    assert_eq!(stdout(&out), expected);
}

#[test]
fn report_ab_puts_two_saved_benches_side_by_side() {
    let jsonl = fixture("bench-lock-user-2vcpu.jsonl");
    let path = jsonl.to_str().unwrap();
    let text = stdout(&vmm(&["report", "--ab", path, path]));
    let rows: Vec<&str> = text.lines().filter(|l| l.starts_with("case ")).collect();
    assert_eq!(rows.len(), 4, "{text}");
    assert!(
        rows.iter().all(|r| r.ends_with("B/A 1.000 (+0.0%)")),
        "{text}"
    );
    // A file that is not a bench's records is refused, naming the file and line.
    let out = Command::new(VMM)
        .args([
            "report",
            fixture("bench-lock-user-2vcpu.txt").to_str().unwrap(),
        ])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("bench-lock-user-2vcpu.txt:1:"), "{err}");
}

/// The fixture's records with each bench's header and runs changed by `edit` (header first).
fn edited_fixture(edit: impl Fn(&mut serde_json::Value)) -> String {
    std::fs::read_to_string(fixture("bench-lock-user-2vcpu.jsonl"))
        .unwrap()
        .lines()
        .map(|line| {
            let mut record: serde_json::Value = serde_json::from_str(line).unwrap();
            edit(&mut record);
            format!("{record}\n")
        })
        .collect()
}

#[test]
fn plots_are_svg_with_their_series_axes_and_legends() {
    let dir = scratch("plots");
    let two = fixture("bench-lock-user-2vcpu.jsonl");
    // (a) Time over own 1x per variant and hog count.
    let svg_path = dir.join("overcommit.svg");
    vmm(&[
        "report",
        two.to_str().unwrap(),
        "--plot",
        svg_path.to_str().unwrap(),
    ]);
    let text = svg_text(&std::fs::read_to_string(&svg_path).unwrap());
    for expected in [
        "Overcommit: each variant's time over its own time at 1x (0 hogs)",
        "ticket:off",
        "ticket:kick:in-kernel",
        "time / own median at 1x (T/T1x, ratio)",
        "case: host load = (vCPUs + hog threads) / host CPUs",
        "1x (0 hogs)",
        "2x (2 hogs)",
        "line: median of the runs",
    ] {
        assert!(
            text.lines().any(|l| l == expected),
            "{expected:?} in\n{text}"
        );
    }
    // (b) Per-acquisition time against vCPUs: the same bench as if run on 4 vCPUs too.
    let four = dir.join("four.jsonl");
    std::fs::write(
        &four,
        edited_fixture(|r| {
            if r["record"] == "bench" {
                r["vcpus"] = 4.into();
            }
        }),
    )
    .unwrap();
    let svg_path = dir.join("scaling.svg");
    vmm(&[
        "report",
        two.to_str().unwrap(),
        four.to_str().unwrap(),
        "--plot",
        svg_path.to_str().unwrap(),
    ]);
    let text = svg_text(&std::fs::read_to_string(&svg_path).unwrap());
    assert!(
        text.contains("Scaling: time per lock acquisition against vCPUs"),
        "{text}"
    );
    assert!(text.contains("time per acquisition ("), "{text}");
    assert!(text.lines().any(|l| l == "vCPUs"), "{text}");
    assert!(
        text.contains("ticket:off, 0 hogs") && text.contains("ticket:off, 2 hogs"),
        "{text}"
    );
    // (c) Kick-to-wake percentiles per path: the runs as if they were ping-pong runs.
    let ping = dir.join("ping.jsonl");
    std::fs::write(
        &ping,
        edited_fixture(|r| {
            if r["record"] == "bench" {
                r["workload"] = "pingpong".into();
                r["hogs"] = serde_json::json!([0]);
            } else if r["hogs"] == 0 {
                r["report"]["kick_to_wake"] = serde_json::json!({
                    "samples": 100, "min_us": 2.0, "p50_us": 8.0, "p90_us": 20.0,
                    "p99_us": 90.0, "max_us": 400.0
                });
            } else {
                // Not a case of this bench: drop the line by making it a blank one.
                *r = serde_json::Value::Null;
            }
        })
        .replace("null\n", "\n"),
    )
    .unwrap();
    let svg_path = dir.join("ping.svg");
    let table = stdout(&vmm(&[
        "report",
        ping.to_str().unwrap(),
        "--plot",
        svg_path.to_str().unwrap(),
    ]));
    assert!(
        table.contains("kick-to-wake us, median of the runs: min 2.0  p50 8.0"),
        "{table}"
    );
    let text = svg_text(&std::fs::read_to_string(&svg_path).unwrap());
    for expected in [
        "Kick-to-wake latency per kick path",
        "kick-to-wake latency (µs)",
        "p99",
        "ticket:kick:in-kernel",
    ] {
        assert!(
            text.lines().any(|l| l == expected),
            "{expected:?} in\n{text}"
        );
    }
    // A/B: B over A per row, then each.
    let svg_path = dir.join("ab.svg");
    vmm(&[
        "report",
        "--ab",
        two.to_str().unwrap(),
        two.to_str().unwrap(),
        "--plot",
        svg_path.to_str().unwrap(),
    ]);
    let text = svg_text(&std::fs::read_to_string(&svg_path).unwrap());
    assert!(text.contains("A/B: B's time over A's, per row"), "{text}");
    assert!(
        text.contains("B / A median (ratio, below 1: B is faster)"),
        "{text}"
    );
    std::fs::remove_dir_all(dir).unwrap();
}

/// Whether /dev/kvm can be opened. When it cannot, the test fails unless
/// `PVSPIN_SKIP_KVM_TESTS=1` says this machine has no KVM on purpose; the outcome goes to the
/// tally of gated tests (`PVSPIN_TEST_TALLY_DIR`, format of `integration-tests/src/lib.rs`).
fn kvm_or_skip(test: &str) -> bool {
    let tally = |line: String| {
        if let Some(dir) = std::env::var_os("PVSPIN_TEST_TALLY_DIR") {
            let path = Path::new(&dir).join(format!("kvm--{test}"));
            std::fs::write(&path, line)
                .unwrap_or_else(|err| panic!("writing the tally {}: {err}", path.display()));
        }
    };
    match std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open("/dev/kvm")
    {
        Ok(_) => {
            tally("ran\n".into());
            true
        }
        Err(err) if std::env::var("PVSPIN_SKIP_KVM_TESTS").as_deref() == Ok("1") => {
            eprintln!("SKIPPED {test}: /dev/kvm cannot be opened ({err})");
            tally(format!("skipped\t/dev/kvm cannot be opened ({err})\n"));
            false
        }
        Err(err) => panic!(
            "{test} needs /dev/kvm, which cannot be opened ({err}); set PVSPIN_SKIP_KVM_TESTS=1 \
             to skip real-KVM tests on a machine without KVM"
        ),
    }
}

#[test]
fn bench_stdout_holds_the_table_alone() {
    if !kvm_or_skip("bench_stdout_holds_the_table_alone") {
        return;
    }
    let dir = scratch("bench-stdout");
    let (json, svg) = (dir.join("runs.jsonl"), dir.join("runs.svg"));
    let out = vmm(&[
        "bench",
        "--workload",
        "lock",
        "--cs-mode",
        "user",
        "--iterations",
        "200",
        "--vcpus",
        "2",
        "--hogs",
        "0",
        "--runs",
        "2",
        "--variants",
        "ticket:off,ticket:kick",
        "--json-out",
        json.to_str().unwrap(),
        "--plot",
        svg.to_str().unwrap(),
    ]);
    let table = stdout(&out);
    assert!(
        !table.lines().any(|l| l.trim_start().starts_with('{')),
        "{table}"
    );
    assert!(
        table.starts_with("lock workload on 2 vCPUs (user mode)"),
        "{table}"
    );
    assert_eq!(table.lines().filter(|l| l.starts_with("case ")).count(), 2);
    // stderr is not a terminal here: no progress bar on it.
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!err.contains(" runs ["), "{err}");
    // Every run in the JSON lines, the header first.
    let saved = std::fs::read_to_string(&json).unwrap();
    let records: Vec<serde_json::Value> = saved
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(records.len(), 5, "{saved}");
    assert_eq!(records[0]["record"], "bench");
    for (i, run) in records[1..].iter().enumerate() {
        assert_eq!(run["record"], "run");
        assert_eq!(run["run"], i / 2);
        assert_eq!(run["case"], "1x (0 hogs)");
        assert_eq!(run["command"][1], "bench");
        assert_eq!(run["report"]["counter"], 400);
    }
    // `report` prints the same table again.
    let again = stdout(&vmm(&["report", json.to_str().unwrap()]));
    assert_eq!(again, table);
    svg_text(&std::fs::read_to_string(&svg).unwrap());
    std::fs::remove_dir_all(dir).unwrap();
}

/// The `variants:` lines of a dry run, per table (`table NAME:` lines start one).
fn dry_run_variants(text: &str) -> Vec<(String, Vec<String>)> {
    let mut out: Vec<(String, Vec<String>)> = Vec::new();
    for line in text.lines() {
        if let Some(rest) = line.strip_prefix("table ") {
            out.push((rest.split(':').next().unwrap().to_string(), Vec::new()));
        } else if let Some(variants) = line.trim().strip_prefix("variants: ") {
            out.last_mut()
                .expect("variants inside a table")
                .1
                .push(variants.to_string());
        }
    }
    out
}

#[test]
fn every_suite_lists_and_dry_runs_its_tables() {
    let list = stdout(&vmm(&["bench", "--suite", "list"]));
    let names: Vec<&str> = list
        .lines()
        .skip(1)
        .filter_map(|l| l.split_whitespace().next())
        .collect();
    assert_eq!(
        names,
        [
            "seed",
            "seed-kernel",
            "overcommit",
            "actuators",
            "short-cs",
            "convoy",
            "kick-latency",
            "slots",
            "stock-slots",
            "size",
            "confinement",
            "vhost",
            "vhost-parity",
            "ab"
        ],
        "{list}"
    );
    for name in &names {
        let text = stdout(&vmm(&[
            "bench",
            "--suite",
            name,
            "--quick",
            "--dry-run",
            "--out",
            "OUT",
        ]));
        assert!(text.starts_with(&format!("suite {name}: ")), "{text}");
        let tables = dry_run_variants(&text);
        assert!(!tables.is_empty(), "{text}");
        for (table, variants) in &tables {
            // Every table's bench names its variants; confinement runs VMs by hand.
            assert!(
                *name == "confinement" || !variants.is_empty(),
                "{name} {table}: {text}"
            );
        }
    }
    // The published variants, table by table.
    let slots = stdout(&vmm(&["bench", "--suite", "slots", "--quick", "--dry-run"]));
    let four = "ticket:kick:in-kernel ticket:kick+yield:in-kernel ticket:kick:userspace \
                ticket:kick/slots:userspace";
    let expected: Vec<(String, Vec<String>)> = [
        ("user-4", four),
        ("user-6", four),
        ("user-8", four),
        ("user-2", four),
        ("kernel-4", four),
        ("kernel-6", four),
        ("kernel-8", four),
        ("kernel-2", four),
        ("vms", "ticket:kick:in-kernel ticket:kick/slots:userspace"),
    ]
    .iter()
    .map(|(t, v)| (t.to_string(), vec![v.to_string()]))
    .collect();
    assert_eq!(dry_run_variants(&slots), expected, "{slots}");
    assert!(slots.contains("--vms 2 "), "{slots}");
    assert!(slots.contains("--iterations 300 "), "quick: {slots}");
    // The convoy table: each pvspin variant told VCPUS_FIT beside the same told nothing.
    let convoy = stdout(&vmm(&[
        "bench",
        "--suite",
        "convoy",
        "--quick",
        "--dry-run",
    ]));
    let tables = dry_run_variants(&convoy);
    assert_eq!(tables[0].0, "convoy-2x-3x", "{convoy}");
    for (told, not_told) in [
        ("ticket:kick:", "ticket:kick/cpus=1:"),
        ("ticket:kick+yield:", "ticket:kick+yield/cpus=1:"),
        ("ticket:kick/slots:", "ticket:kick/slots/cpus=1:"),
    ] {
        assert!(tables[0].1[0].contains(told), "{told}: {convoy}");
        assert!(tables[0].1[0].contains(not_told), "{not_told}: {convoy}");
    }
    assert!(convoy.contains("--hogs 0,2,4 "), "{convoy}");
    let ab = stdout(&vmm(&[
        "bench",
        "--suite",
        "ab",
        "--dry-run",
        "--runs",
        "7",
        "--",
        "--cs-mode",
        "user",
        "--iterations",
        "2000000",
        "--hogs",
        "0",
        "--variants",
        "ticket:kick",
    ]));
    assert!(
        ab.contains("$BUILD_A bench --cs-mode user --iterations 2000000"),
        "{ab}"
    );
    assert!(ab.contains("$BUILD_B bench --cs-mode user"), "{ab}");
    assert!(ab.contains("(x7, round by round"), "{ab}");
    // Bench options the suite would ignore are refused.
    for extra in [
        &["--variants", "ticket:off"][..],
        &["--hogs", "0"],
        &["--plot", "x.svg"],
    ] {
        let mut args = vec!["bench", "--suite", "seed", "--dry-run"];
        args.extend_from_slice(extra);
        let out = Command::new(VMM).args(&args).output().unwrap();
        assert_eq!(out.status.code(), Some(2), "{args:?}");
    }
    // A suite without the builds or daemon it needs is refused before anything runs.
    let dir = scratch("suite-needs");
    let out = Command::new(VMM)
        .args(["bench", "--suite", "ab", "--out"])
        .arg(dir.join("ab"))
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("--build-a"));
    assert!(!dir.join("ab").exists());
    // An unknown suite is a usage error.
    let out = Command::new(VMM)
        .args(["bench", "--suite", "nope", "--dry-run"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
}

/// One real suite, scaled down: every table's runs, table and plot land in the output
/// directory, and the saved runs give the table again.
#[test]
fn a_quick_suite_writes_runs_tables_and_plots() {
    if !kvm_or_skip("a_quick_suite_writes_runs_tables_and_plots") {
        return;
    }
    let dir = scratch("suite");
    let out_dir = dir.join("out");
    let mut child = Command::new(VMM)
        .args([
            "bench",
            "--suite",
            "kick-latency",
            "--quick",
            "--runs",
            "2",
            "--out",
        ])
        .arg(&out_dir)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    // Bounded: the VMs have their own bounds, the suite must not outlive them.
    let start = std::time::Instant::now();
    while child.try_wait().unwrap().is_none() {
        if start.elapsed() > std::time::Duration::from_secs(240) {
            let _ = child.kill();
            let _ = child.wait();
            panic!("the quick suite ran past 240 s");
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    let out = child.wait_with_output().unwrap();
    let text = stdout(&out);
    assert!(
        out.status.success(),
        "{text}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    for table in ["kernel", "user"] {
        let jsonl = out_dir.join(format!("{table}.jsonl"));
        let saved = std::fs::read_to_string(out_dir.join(format!("{table}.txt"))).unwrap();
        let again = stdout(&vmm(&["report", jsonl.to_str().unwrap()]));
        assert!(saved.starts_with(&again), "{table}:\n{saved}\n---\n{again}");
        assert!(saved.contains("us/handoff"), "{saved}");
        assert_eq!(
            saved.lines().filter(|l| l.starts_with("case ")).count(),
            if table == "kernel" { 6 } else { 3 },
            "{saved}"
        );
        let svg = svg_text(&std::fs::read_to_string(out_dir.join(format!("{table}.svg"))).unwrap());
        assert!(svg.contains("Kick-to-wake latency per kick path"), "{svg}");
    }
    let log = std::fs::read_to_string(out_dir.join("suite.txt")).unwrap();
    assert!(log.contains("load average"), "{log}");
    assert!(
        log.contains("--variants ticket:kick/poll=0:in-kernel"),
        "{log}"
    );
    assert!(text.contains("== kernel:"), "{text}");
    std::fs::remove_dir_all(dir).unwrap();
}
