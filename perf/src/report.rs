//! Samples of one scenario, their summaries, ratios, a table and JSON.

use std::collections::BTreeMap;
use std::fmt::Write as _;

use serde_json::{json, Value};

use crate::stats::{ratio, Summary};

/// A metric every sample may carry.
#[derive(Debug, Clone)]
pub struct Metric {
    pub key: &'static str,
    pub label: &'static str,
    pub unit: &'static str,
    /// Whether ours/baseline ratios make sense for it (not for rig-health figures).
    pub compare: bool,
}

/// A metric compared across contenders (ratios reported).
pub fn metric(key: &'static str, label: &'static str, unit: &'static str) -> Metric {
    Metric {
        key,
        label,
        unit,
        compare: true,
    }
}

/// A metric shown in the table but left out of the ratios (a breakdown).
pub fn detail(key: &'static str, label: &'static str, unit: &'static str) -> Metric {
    Metric {
        compare: false,
        ..metric(key, label, unit)
    }
}

/// One VMM configuration being measured.
#[derive(Debug, Clone)]
pub struct Contender {
    pub name: String,
    pub description: String,
    /// Command line (one sample's), for the record.
    pub command: String,
}

/// One run of one contender.
#[derive(Debug, Clone)]
pub struct Sample {
    pub contender: String,
    pub index: usize,
    pub values: BTreeMap<&'static str, f64>,
    /// Why this run does not count (then `values` is not used in the statistics).
    pub error: Option<String>,
}

impl Sample {
    /// One run of `contender`: its values, or why it failed.
    pub fn of(
        contender: &str,
        index: usize,
        outcome: Result<BTreeMap<&'static str, f64>, String>,
    ) -> Sample {
        let (values, error) = match outcome {
            Ok(values) => (values, None),
            Err(e) => (BTreeMap::new(), Some(e)),
        };
        Sample {
            contender: contender.into(),
            index,
            values,
            error,
        }
    }
}

/// A whole scenario: contenders, metrics, samples in the order they ran.
#[derive(Debug, Clone)]
pub struct Scenario {
    pub name: &'static str,
    pub title: String,
    pub method: String,
    pub metrics: Vec<Metric>,
    pub contenders: Vec<Contender>,
    /// (ours, baseline) pairs to report ratios for.
    pub comparisons: Vec<(String, String)>,
    pub samples: Vec<Sample>,
    /// Why the scenario did not run at all.
    pub skipped: Option<String>,
    /// Footnotes printed under the table and kept in the JSON.
    pub notes: Vec<String>,
}

impl Scenario {
    fn values(&self, contender: &str, metric: &str) -> Vec<f64> {
        self.samples
            .iter()
            .filter(|s| s.contender == contender && s.error.is_none())
            .filter_map(|s| s.values.get(metric).copied())
            .collect()
    }

    pub fn summary(&self, contender: &str, metric: &str) -> Option<Summary> {
        Summary::of(&self.values(contender, metric))
    }

    fn counts(&self, contender: &str) -> (usize, usize) {
        let all = self.samples.iter().filter(|s| s.contender == contender);
        let failed = all.clone().filter(|s| s.error.is_some()).count();
        (all.count() - failed, failed)
    }

    pub fn table(&self) -> String {
        let mut o = String::new();
        let _ = writeln!(o, "== {}", self.title);
        if let Some(why) = &self.skipped {
            let _ = writeln!(o, "   SKIPPED: {why}");
            return o;
        }
        let _ = writeln!(o, "   method: {}", self.method);
        for c in &self.contenders {
            let (ok, failed) = self.counts(&c.name);
            let _ = writeln!(
                o,
                "   {:<10} {} ({} ok, {} failed)",
                c.name, c.description, ok, failed
            );
        }
        let _ = writeln!(
            o,
            "   {:<34} {:<10} {:>3} {:>10} {:>10} {:>10} {:>10} {:>10}",
            "metric", "contender", "n", "min", "p50", "p90", "p99", "max"
        );
        for m in &self.metrics {
            let mut first = true;
            for c in &self.contenders {
                let Some(s) = self.summary(&c.name, m.key) else {
                    continue;
                };
                let label = if first {
                    format!("{} [{}]", m.label, m.unit)
                } else {
                    String::new()
                };
                first = false;
                let _ = writeln!(
                    o,
                    "   {:<34} {:<10} {:>3} {:>10} {:>10} {:>10} {:>10} {:>10}",
                    label,
                    c.name,
                    s.n,
                    fmt_num(s.min),
                    fmt_num(s.p50),
                    fmt_num(s.p90),
                    fmt_num(s.p99),
                    fmt_num(s.max)
                );
            }
        }
        let ratios = self.ratios();
        if !ratios.is_empty() {
            let _ = writeln!(o, "   ratios (lower is better for us):");
            for r in ratios {
                let _ = writeln!(
                    o,
                    "   {:<34} {:<22} p50 {:>8}  p90 {:>8}",
                    r.label,
                    format!("{}/{}", r.ours, r.baseline),
                    fmt_ratio(r.p50),
                    fmt_ratio(r.p90)
                );
            }
        }
        for n in &self.notes {
            let _ = writeln!(o, "   note: {n}");
        }
        let failures: Vec<&Sample> = self.samples.iter().filter(|s| s.error.is_some()).collect();
        if !failures.is_empty() {
            let _ = writeln!(o, "   failed runs:");
            for s in failures.iter().take(12) {
                let _ = writeln!(
                    o,
                    "   - {} #{}: {}",
                    s.contender,
                    s.index,
                    s.error.as_deref().unwrap_or("").replace('\n', " | ")
                );
            }
            if failures.len() > 12 {
                let _ = writeln!(o, "   ... {} more in the JSON", failures.len() - 12);
            }
        }
        o
    }

    fn ratios(&self) -> Vec<RatioRow> {
        let mut rows = Vec::new();
        for m in self.metrics.iter().filter(|m| m.compare) {
            for (ours, base) in &self.comparisons {
                let (a, b) = (self.summary(ours, m.key), self.summary(base, m.key));
                let (Some(a), Some(b)) = (a, b) else { continue };
                rows.push(RatioRow {
                    metric: m.key,
                    label: m.label,
                    ours: ours.clone(),
                    baseline: base.clone(),
                    p50: ratio(Some(a.p50), Some(b.p50)),
                    p90: ratio(Some(a.p90), Some(b.p90)),
                });
            }
        }
        rows
    }

    pub fn to_json(&self) -> Value {
        let contenders: serde_json::Map<String, Value> = self
            .contenders
            .iter()
            .map(|c| {
                let (ok, failed) = self.counts(&c.name);
                let metrics: serde_json::Map<String, Value> = self
                    .metrics
                    .iter()
                    .filter_map(|m| {
                        self.summary(&c.name, m.key)
                            .map(|s| (m.key.to_string(), s.to_json()))
                    })
                    .collect();
                (
                    c.name.clone(),
                    json!({
                        "description": c.description,
                        "command": c.command,
                        "ok": ok,
                        "failed": failed,
                        "metrics": metrics,
                    }),
                )
            })
            .collect();
        let ratios: Vec<Value> = self
            .ratios()
            .into_iter()
            .map(|r| {
                json!({
                    "metric": r.metric, "ours": r.ours, "baseline": r.baseline,
                    "p50_ratio": r.p50, "p90_ratio": r.p90,
                })
            })
            .collect();
        let samples: Vec<Value> = self
            .samples
            .iter()
            .map(|s| {
                json!({
                    "contender": s.contender, "index": s.index,
                    "values": s.values, "error": s.error,
                })
            })
            .collect();
        let metrics: Vec<Value> = self
            .metrics
            .iter()
            .map(|m| json!({"key": m.key, "label": m.label, "unit": m.unit}))
            .collect();
        json!({
            "name": self.name,
            "title": self.title,
            "method": self.method,
            "skipped": self.skipped,
            "notes": self.notes,
            "metrics": metrics,
            "contenders": contenders,
            "ratios": ratios,
            "samples": samples,
        })
    }
}

struct RatioRow {
    metric: &'static str,
    label: &'static str,
    ours: String,
    baseline: String,
    p50: Option<f64>,
    p90: Option<f64>,
}

/// Which side of a goal's limit meets it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Bound {
    Below,
    AtMost,
    AtLeast,
}

/// A note line checking `value` against a design goal: `goal WHAT < 5 ms: 4.000 ms -> met`.
pub fn goal(what: &str, value: Option<f64>, bound: Bound, limit: f64, unit: &str) -> String {
    let (op, met): (&str, fn(f64, f64) -> bool) = match bound {
        Bound::Below => ("<", |v, l| v < l),
        Bound::AtMost => ("<=", |v, l| v <= l),
        Bound::AtLeast => (">=", |v, l| v >= l),
    };
    match value {
        Some(v) => format!(
            "goal {what} {op} {limit} {unit}: {v:.3} {unit} -> {}",
            if met(v, limit) { "met" } else { "MISSED" }
        ),
        None => format!("goal {what} {op} {limit} {unit}: no data"),
    }
}

/// `goal` with a strict upper limit.
pub fn goal_line(what: &str, value: Option<f64>, limit: f64, unit: &str) -> String {
    goal(what, value, Bound::Below, limit, unit)
}

fn fmt_num(v: f64) -> String {
    if v.abs() >= 1000.0 {
        format!("{v:.0}")
    } else if v.abs() >= 10.0 {
        format!("{v:.1}")
    } else {
        format!("{v:.3}")
    }
}

fn fmt_ratio(r: Option<f64>) -> String {
    r.map_or_else(|| "n/a".into(), |r| format!("{r:.3}x"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample(c: &str, i: usize, v: f64, err: bool) -> Sample {
        Sample {
            contender: c.into(),
            index: i,
            values: [("t", v)].into_iter().collect(),
            error: err.then(|| "boom".to_string()),
        }
    }

    #[test]
    fn goal_lines() {
        assert_eq!(
            goal_line("x p50", Some(4.0), 5.0, "ms"),
            "goal x p50 < 5 ms: 4.000 ms -> met"
        );
        assert!(goal_line("x", Some(5.0), 5.0, "ms").ends_with("MISSED"));
        assert!(goal_line("x", None, 5.0, "ms").ends_with("no data"));
        assert!(goal("x", Some(2.0), Bound::AtMost, 2.0, "x").ends_with("-> met"));
        assert!(goal("x", Some(2.1), Bound::AtMost, 2.0, "x").ends_with("MISSED"));
        assert_eq!(
            goal("seq", Some(0.75), Bound::AtLeast, 0.75, "x"),
            "goal seq >= 0.75 x: 0.750 x -> met"
        );
        assert!(goal("seq", Some(0.5), Bound::AtLeast, 0.75, "x").ends_with("MISSED"));
    }

    #[test]
    fn failed_samples_are_excluded_and_ratios_use_medians() {
        let sc = Scenario {
            name: "x",
            title: "x".into(),
            method: "m".into(),
            metrics: vec![Metric {
                key: "t",
                label: "time",
                unit: "ms",
                compare: true,
            }],
            contenders: ["a", "b"]
                .iter()
                .map(|n| Contender {
                    name: n.to_string(),
                    description: String::new(),
                    command: String::new(),
                })
                .collect(),
            comparisons: vec![("a".into(), "b".into())],
            samples: vec![
                sample("a", 0, 1.0, false),
                sample("b", 0, 4.0, false),
                sample("a", 1, 3.0, false),
                sample("b", 1, 8.0, false),
                sample("a", 2, 1000.0, true),
            ],
            skipped: None,
            notes: vec![],
        };
        assert_eq!(sc.summary("a", "t").unwrap().p50, 2.0);
        assert_eq!(sc.counts("a"), (2, 1));
        let r = sc.ratios();
        assert_eq!(r.len(), 1);
        assert_eq!(r[0].p50, Some(2.0 / 6.0));
        let j = sc.to_json();
        assert_eq!(j["contenders"]["a"]["failed"], 1);
        assert!(sc.table().contains("failed runs"));
    }
}
