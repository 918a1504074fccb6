//! Prometheus text exposition (format 0.0.4), shared by pvspin's telemetry and `pvspind`.
//!
//! [`Families`] collects samples into metric families in first-seen order and renders each
//! family once, `# HELP` and `# TYPE` first; the helpers escape label values and help texts,
//! turn arbitrary names into metric names and print floats as Prometheus reads them.
#![deny(missing_docs)]

use std::collections::BTreeMap;
use std::fmt::{Display, Write as _};

/// Metric families in first-seen order, each with its type, help and sample lines.
#[derive(Debug, Default)]
pub struct Families {
    order: Vec<String>,
    by_name: BTreeMap<String, Family>,
}

#[derive(Debug)]
struct Family {
    typ: String,
    help: String,
    lines: Vec<String>,
}

impl Families {
    /// Adds one sample of `family` (of type `typ`: `counter`, `gauge`, `histogram`, ...),
    /// named `family` + `suffix` (`_bucket`, `_sum`, `_count` for histograms, else empty).
    /// The first sample of a family sets its type and help; a sample of another type is
    /// dropped and logged, so the document stays valid.
    pub fn sample(
        &mut self,
        family: &str,
        typ: &str,
        help: &str,
        suffix: &str,
        labels: &[(&str, String)],
        value: impl Display,
    ) {
        // Looked up before inserting: a family is made once, its samples are many (about 300
        // per vCPU with KVM's histograms), and a key allocation per sample would be one too
        // many.
        if !self.by_name.contains_key(family) {
            self.order.push(family.to_owned());
            self.by_name.insert(
                family.to_owned(),
                Family {
                    typ: typ.to_owned(),
                    help: help.to_owned(),
                    lines: Vec::new(),
                },
            );
        }
        let Some(entry) = self.by_name.get_mut(family) else {
            return;
        };
        if entry.typ != typ {
            log::warn!(
                "telemetry: metric family {family} seen as {} and {typ}; sample dropped",
                entry.typ
            );
            return;
        }
        let mut line = String::with_capacity(family.len() + suffix.len() + 48);
        line.push_str(family);
        line.push_str(suffix);
        if !labels.is_empty() {
            line.push('{');
            for (i, (k, v)) in labels.iter().enumerate() {
                if i > 0 {
                    line.push(',');
                }
                let _ = write!(line, "{k}=\"{}\"", escape_label(v));
            }
            line.push('}');
        }
        let _ = write!(line, " {value}");
        entry.lines.push(line);
    }

    /// A counter sample.
    pub fn counter(&mut self, family: &str, help: &str, labels: &[(&str, String)], value: u64) {
        self.sample(family, "counter", help, "", labels, value);
    }

    /// A gauge sample.
    pub fn gauge(
        &mut self,
        family: &str,
        help: &str,
        labels: &[(&str, String)],
        value: impl Display,
    ) {
        self.sample(family, "gauge", help, "", labels, value);
    }

    /// The document.
    pub fn render(&self) -> String {
        let mut s = String::new();
        for name in &self.order {
            let f = &self.by_name[name];
            let _ = writeln!(s, "# HELP {name} {}", escape_help(&f.help));
            let _ = writeln!(s, "# TYPE {name} {}", f.typ);
            for l in &f.lines {
                s.push_str(l);
                s.push('\n');
            }
        }
        s
    }
}

/// A label value with `\`, `"` and newlines escaped.
pub fn escape_label(v: &str) -> String {
    v.replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

/// A help text with `\` and newlines escaped.
pub fn escape_help(v: &str) -> String {
    v.replace('\\', "\\\\").replace('\n', "\\n")
}

/// `name` as a metric name: every character outside `[A-Za-z0-9_]` becomes `_` (and an
/// empty name `_`).
pub fn sanitize(name: &str) -> String {
    let mut s: String = name
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '_' {
                c
            } else {
                '_'
            }
        })
        .collect();
    if s.is_empty() {
        s.push('_');
    }
    s
}

/// A float as Prometheus reads it (`+Inf`, `-Inf`, `NaN`, else Rust's shortest form).
pub fn fmt_f64(v: f64) -> String {
    if v.is_infinite() {
        if v > 0.0 { "+Inf" } else { "-Inf" }.to_owned()
    } else if v.is_nan() {
        "NaN".to_owned()
    } else {
        format!("{v}")
    }
}

#[doc = include_str!("../README.md")]
#[cfg(doctest)]
pub struct ReadmeDoctests;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn families_come_out_together_in_first_seen_order() {
        let mut f = Families::default();
        f.counter("a_total", "A.", &[("vcpu", "0".into())], 1);
        f.gauge("b", "B.", &[], 2);
        f.counter("a_total", "A.", &[("vcpu", "1".into())], 3);
        assert_eq!(
            f.render(),
            "# HELP a_total A.\n# TYPE a_total counter\na_total{vcpu=\"0\"} 1\n\
             a_total{vcpu=\"1\"} 3\n# HELP b B.\n# TYPE b gauge\nb 2\n"
        );
    }

    #[test]
    fn a_sample_of_another_type_is_dropped() {
        let mut f = Families::default();
        f.counter("x", "X.", &[], 1);
        f.gauge("x", "X.", &[], 2);
        assert_eq!(f.render(), "# HELP x X.\n# TYPE x counter\nx 1\n");
    }

    #[test]
    fn labels_help_and_names_are_escaped() {
        let mut f = Families::default();
        f.gauge(
            "g",
            "line\\one\nline two",
            &[("vm", "a\"b\\c\nd".into())],
            0,
        );
        assert_eq!(
            f.render(),
            "# HELP g line\\\\one\\nline two\n# TYPE g gauge\ng{vm=\"a\\\"b\\\\c\\nd\"} 0\n"
        );
        assert_eq!(sanitize("a-b.c"), "a_b_c");
        assert_eq!(sanitize(""), "_");
    }

    #[test]
    fn floats_print_as_prometheus_reads_them() {
        assert_eq!(fmt_f64(f64::INFINITY), "+Inf");
        assert_eq!(fmt_f64(f64::NEG_INFINITY), "-Inf");
        assert_eq!(fmt_f64(f64::NAN), "NaN");
        assert_eq!(fmt_f64(0.5), "0.5");
        assert_eq!(fmt_f64(3.0 / 1e9), "0.000000003");
    }
}
