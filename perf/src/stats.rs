//! Order statistics over samples: percentiles, summaries and ratios.

use serde_json::{json, Value};

/// Percentile `p` (0..=100) of `values` by linear interpolation between the closest ranks
/// (the "type 7" definition numpy and most spreadsheets use). NaNs are ignored.
/// `None` for an empty input or a `p` outside 0..=100.
pub fn percentile(values: &[f64], p: f64) -> Option<f64> {
    if !(0.0..=100.0).contains(&p) {
        return None;
    }
    let mut v: Vec<f64> = values.iter().copied().filter(|x| !x.is_nan()).collect();
    if v.is_empty() {
        return None;
    }
    v.sort_by(f64::total_cmp);
    Some(percentile_sorted(&v, p))
}

fn percentile_sorted(sorted: &[f64], p: f64) -> f64 {
    let rank = p / 100.0 * (sorted.len() - 1) as f64;
    let lo = rank.floor() as usize;
    let hi = rank.ceil() as usize;
    let frac = rank - lo as f64;
    sorted[lo] + (sorted[hi] - sorted[lo]) * frac
}

/// `a / b`, or `None` when either is missing or `b` is zero (or either is not finite).
pub fn ratio(a: Option<f64>, b: Option<f64>) -> Option<f64> {
    match (a, b) {
        (Some(a), Some(b)) if b != 0.0 && a.is_finite() && b.is_finite() => Some(a / b),
        _ => None,
    }
}

/// Distribution summary of one metric for one contender.
#[derive(Debug, Clone, PartialEq)]
pub struct Summary {
    pub n: usize,
    pub min: f64,
    pub p50: f64,
    pub p90: f64,
    pub p99: f64,
    pub max: f64,
    pub mean: f64,
}

impl Summary {
    /// `None` when there are no (non-NaN) values.
    pub fn of(values: &[f64]) -> Option<Summary> {
        let mut v: Vec<f64> = values.iter().copied().filter(|x| !x.is_nan()).collect();
        if v.is_empty() {
            return None;
        }
        v.sort_by(f64::total_cmp);
        Some(Summary {
            n: v.len(),
            min: v[0],
            p50: percentile(&v, 50.0)?,
            p90: percentile(&v, 90.0)?,
            p99: percentile(&v, 99.0)?,
            max: v[v.len() - 1],
            mean: v.iter().sum::<f64>() / v.len() as f64,
        })
    }

    pub fn to_json(&self) -> Value {
        json!({
            "n": self.n, "min": self.min, "p50": self.p50, "p90": self.p90,
            "p99": self.p99, "max": self.max, "mean": self.mean,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn close(a: f64, b: f64) -> bool {
        (a - b).abs() < 1e-9
    }

    #[test]
    fn percentile_of_empty_is_none() {
        assert_eq!(percentile(&[], 50.0), None);
        assert_eq!(percentile(&[f64::NAN], 50.0), None);
    }

    #[test]
    fn percentile_rejects_out_of_range() {
        assert_eq!(percentile(&[1.0], -1.0), None);
        assert_eq!(percentile(&[1.0], 100.5), None);
    }

    #[test]
    fn percentile_single_value() {
        for p in [0.0, 50.0, 90.0, 100.0] {
            assert_eq!(percentile(&[7.5], p), Some(7.5));
        }
    }

    #[test]
    fn median_odd_and_even() {
        assert_eq!(percentile(&[3.0, 1.0, 2.0], 50.0), Some(2.0));
        assert_eq!(percentile(&[4.0, 1.0, 3.0, 2.0], 50.0), Some(2.5));
    }

    #[test]
    fn percentile_interpolates_like_numpy() {
        // numpy.percentile([1..=10], 90) == 9.1; ([15,20,35,40,50], 40) == 29.0
        let v: Vec<f64> = (1..=10).map(f64::from).collect();
        assert!(close(percentile(&v, 90.0).unwrap(), 9.1));
        assert!(close(
            percentile(&[15.0, 20.0, 35.0, 40.0, 50.0], 40.0).unwrap(),
            29.0
        ));
        assert_eq!(percentile(&v, 0.0), Some(1.0));
        assert_eq!(percentile(&v, 100.0), Some(10.0));
    }

    #[test]
    fn percentile_ignores_nan_and_order() {
        let v = [5.0, f64::NAN, 1.0, 3.0];
        assert_eq!(percentile(&v, 50.0), Some(3.0));
    }

    #[test]
    fn summary_fields() {
        let v: Vec<f64> = (1..=10).rev().map(f64::from).collect();
        let s = Summary::of(&v).unwrap();
        assert_eq!(s.n, 10);
        assert_eq!(s.min, 1.0);
        assert_eq!(s.max, 10.0);
        assert!(close(s.p50, 5.5));
        assert!(close(s.p90, 9.1));
        assert!(close(s.p99, 9.91));
        assert!(close(s.mean, 5.5));
        assert_eq!(Summary::of(&[]), None);
    }

    #[test]
    fn ratio_handles_missing_and_zero() {
        assert_eq!(ratio(Some(1.0), Some(4.0)), Some(0.25));
        assert_eq!(ratio(Some(1.0), Some(0.0)), None);
        assert_eq!(ratio(None, Some(1.0)), None);
        assert_eq!(ratio(Some(1.0), None), None);
        assert_eq!(ratio(Some(f64::INFINITY), Some(1.0)), None);
    }
}
