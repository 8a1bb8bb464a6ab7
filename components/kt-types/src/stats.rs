//! Summary statistics over recorded samples: the workspace's one
//! percentile, nearest rank. The empty-input rule: an empty sample has no
//! percentile ([`None`]); each caller says what it shows instead (a
//! budget check compares 0, a bench table prints NaN as `-`).
//! (`kt_bench::histogram::Histogram::percentile` answers the same question
//! for bucketed counts, not for a sample.)

/// The nearest-rank `p`th percentile (`p` clamped to 0..=100) of `sorted`
/// (ascending): the smallest value with at least `p`% of the sample at or
/// below it; `p` = 0 gives the minimum. `None` when `sorted` is empty.
pub fn percentile(sorted: &[f64], p: f64) -> Option<f64> {
    if sorted.is_empty() {
        return None;
    }
    let p = if p.is_nan() { 0.0 } else { p.clamp(0.0, 100.0) };
    let rank = ((p / 100.0) * sorted.len() as f64).ceil() as usize;
    Some(sorted[rank.clamp(1, sorted.len()) - 1])
}

#[cfg(test)]
mod tests {
    use super::percentile;

    #[test]
    fn percentiles_are_nearest_rank() {
        let v: Vec<f64> = (1..=100).map(f64::from).collect();
        assert_eq!(percentile(&v, 50.0), Some(50.0));
        assert_eq!(percentile(&v, 95.0), Some(95.0));
        assert_eq!(percentile(&v, 100.0), Some(100.0));
        assert_eq!(percentile(&v, 0.0), Some(1.0));
        assert_eq!(percentile(&v, 250.0), Some(100.0));
        assert_eq!(percentile(&[1.0, 2.0, 3.0, 4.0], 50.0), Some(2.0));
        assert_eq!(percentile(&[7.0], 95.0), Some(7.0));
    }

    #[test]
    fn an_empty_sample_has_no_percentile() {
        assert_eq!(percentile(&[], 50.0), None);
    }
}
