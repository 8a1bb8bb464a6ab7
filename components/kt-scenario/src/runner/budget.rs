//! Timing budgets: the checks of a step's durations against its `budget`
//! (percentiles are [`kt_types::stats::percentile`]'s nearest rank).

use std::time::Duration;

use super::ms;
use crate::report::BudgetCheck;

/// The nearest-rank percentile of sorted `durations` ([`kt_types::stats::percentile`]);
/// 0 ms for a step with no durations (a check of an upper bound passes).
fn percentile(sorted: &[f64], p: f64) -> f64 {
    kt_types::stats::percentile(sorted, p).unwrap_or(0.0)
}

/// Budget checks of `durations` (ms, one per pod or one for the step).
pub fn budget_checks(b: &crate::format::Budget, durations: &[f64]) -> Vec<BudgetCheck> {
    let mut sorted = durations.to_vec();
    sorted.sort_by(f64::total_cmp);
    let mut out = Vec::new();
    let mut add = |kind: &str, limit: Option<Duration>, actual: f64, upper: bool| {
        if let Some(l) = limit {
            let limit_ms = ms(l);
            out.push(BudgetCheck {
                kind: kind.to_owned(),
                limit_ms,
                actual_ms: actual,
                ok: if upper {
                    actual <= limit_ms
                } else {
                    actual >= limit_ms
                },
            });
        }
    };
    add("max", b.max, sorted.last().copied().unwrap_or(0.0), true);
    add("min", b.min, sorted.first().copied().unwrap_or(0.0), false);
    add("p50", b.p50, percentile(&sorted, 50.0), true);
    add("p95", b.p95, percentile(&sorted, 95.0), true);
    out
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use super::*;
    use crate::format::Budget;

    #[test]
    fn a_step_without_durations_checks_zero() {
        assert_eq!(percentile(&[], 50.0), 0.0);
        assert_eq!(percentile(&[3.0, 9.0], 95.0), 9.0);
    }

    #[test]
    fn budgets_check_every_limit() {
        let b = Budget {
            max: Some(Duration::from_millis(100)),
            p50: Some(Duration::from_millis(20)),
            p95: None,
            min: Some(Duration::from_millis(5)),
        };
        let checks = budget_checks(&b, &[10.0, 30.0, 120.0]);
        let by: BTreeMap<&str, bool> = checks.iter().map(|c| (c.kind.as_str(), c.ok)).collect();
        assert!(!by["max"]);
        assert!(!by["p50"]);
        assert!(by["min"]);
    }
}
