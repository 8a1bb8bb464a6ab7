//! A log-bucketed latency histogram in the spirit of HdrHistogram.
//!
//! Values (nanoseconds) below [`SUB_BUCKETS`] have a bucket each; above, every
//! power of two is split into [`SUB_BUCKETS`] equal buckets, so a recorded value
//! is known to within 1/64 (1.6 %) of itself, over the whole `u64` range, in a
//! fixed array of 3,776 counters. Recording is an index computation and an
//! increment; each worker records into its own histogram and they are merged
//! at the end.

use std::time::Duration;

/// Buckets per power of two (and the number of exact buckets at the bottom).
pub const SUB_BUCKETS: u64 = 64;
const SUB_BITS: u32 = SUB_BUCKETS.trailing_zeros();
/// Exact buckets, then `SUB_BUCKETS` for each exponent from `SUB_BITS` to 63.
const BUCKETS: usize = ((64 - SUB_BITS + 1) as usize) * SUB_BUCKETS as usize;

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Histogram {
    counts: Vec<u64>,
    total: u64,
    min: u64,
    max: u64,
}

impl Default for Histogram {
    fn default() -> Self {
        Histogram {
            counts: vec![0; BUCKETS],
            total: 0,
            min: u64::MAX,
            max: 0,
        }
    }
}

/// The bucket holding `v`.
fn index(v: u64) -> usize {
    if v < SUB_BUCKETS {
        return v as usize;
    }
    let exp = 63 - v.leading_zeros(); // >= SUB_BITS
    let shift = exp - SUB_BITS;
    // (v >> shift) lies in [SUB_BUCKETS, 2 * SUB_BUCKETS).
    (shift as usize + 1) * SUB_BUCKETS as usize + ((v >> shift) - SUB_BUCKETS) as usize
}

/// The largest value that lands in bucket `i` (what a percentile reports, as
/// HdrHistogram's "highest equivalent value" does).
fn highest_in(i: usize) -> u64 {
    let sub = SUB_BUCKETS as usize;
    if i < sub {
        return i as u64;
    }
    let shift = (i / sub - 1) as u32;
    let low = ((i % sub) as u64 + SUB_BUCKETS) << shift;
    low + ((1u64 << shift) - 1)
}

impl Histogram {
    pub fn new() -> Self {
        Self::default()
    }

    pub fn record(&mut self, nanos: u64) {
        self.counts[index(nanos)] += 1;
        self.total += 1;
        self.min = self.min.min(nanos);
        self.max = self.max.max(nanos);
    }

    pub fn record_duration(&mut self, d: Duration) {
        self.record(u64::try_from(d.as_nanos()).unwrap_or(u64::MAX));
    }

    pub fn merge(&mut self, other: &Histogram) {
        for (a, b) in self.counts.iter_mut().zip(&other.counts) {
            *a += b;
        }
        self.total += other.total;
        self.min = self.min.min(other.min);
        self.max = self.max.max(other.max);
    }

    pub fn count(&self) -> u64 {
        self.total
    }

    /// The largest recorded value (0 when empty).
    pub fn max(&self) -> u64 {
        self.max
    }

    /// The smallest recorded value (0 when empty).
    pub fn min(&self) -> u64 {
        if self.total == 0 { 0 } else { self.min }
    }

    /// The value below or at which `p` percent of the recorded values lie
    /// (nearest rank, reported as the bucket's highest value but never above
    /// the maximum); 0 when empty. `p` is clamped to 0..=100.
    pub fn percentile(&self, p: f64) -> u64 {
        if self.total == 0 {
            return 0;
        }
        let p = p.clamp(0.0, 100.0);
        // Nearest rank: the smallest value with at least p% of values at or below it.
        let rank = ((p / 100.0) * self.total as f64).ceil().max(1.0) as u64;
        let mut seen = 0;
        for (i, &c) in self.counts.iter().enumerate() {
            seen += c;
            if seen >= rank {
                return highest_in(i).min(self.max).max(self.min);
            }
        }
        self.max
    }
}

/// Nanoseconds as milliseconds.
pub fn ms(nanos: u64) -> f64 {
    nanos as f64 / 1e6
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buckets_are_contiguous_and_tight() {
        let mut prev_high = None;
        for i in 0..BUCKETS {
            let high = highest_in(i);
            if let Some(p) = prev_high {
                assert!(high > p, "bucket {i}");
                // The bucket starts right after the previous one ends.
                assert_eq!(index(p + 1), i);
            }
            assert_eq!(index(high), i, "bucket {i} high {high}");
            prev_high = Some(high);
        }
        assert_eq!(highest_in(BUCKETS - 1), u64::MAX);
        for v in [0, 1, 63, 64, 65, 127, 128, 1_000, 123_456_789, u64::MAX] {
            let high = highest_in(index(v));
            assert!(high >= v);
            // Relative precision: within one sub-bucket.
            assert!(high - v <= v / SUB_BUCKETS, "{v} -> {high}");
        }
    }

    #[test]
    fn empty() {
        let h = Histogram::new();
        assert_eq!(h.count(), 0);
        assert_eq!(h.percentile(99.0), 0);
        assert_eq!((h.min(), h.max()), (0, 0));
    }

    #[test]
    fn exact_below_sub_buckets() {
        let mut h = Histogram::new();
        for v in 1..=50 {
            h.record(v);
        }
        assert_eq!(h.percentile(50.0), 25);
        assert_eq!(h.percentile(98.0), 49);
        assert_eq!(h.percentile(100.0), 50);
        assert_eq!(h.percentile(0.0), 1);
        assert_eq!(h.min(), 1);
    }

    #[test]
    fn percentiles_of_uniform_values() {
        // 1..=100_000 µs: pN is N% of 100 ms, within the bucket precision.
        let mut h = Histogram::new();
        for us in 1..=100_000u64 {
            h.record(us * 1_000);
        }
        for (p, want_ms) in [(50.0, 50.0), (95.0, 95.0), (99.0, 99.0), (99.9, 99.9)] {
            let got = ms(h.percentile(p));
            assert!(
                got >= want_ms && got <= want_ms * (1.0 + 1.0 / SUB_BUCKETS as f64),
                "p{p}: {got} ms, want ~{want_ms}"
            );
        }
        assert_eq!(h.percentile(100.0), 100_000_000);
        assert_eq!(h.max(), 100_000_000);
    }

    #[test]
    fn tail_is_seen() {
        // 990 fast requests and 10 slow ones: p99 is fast, p99.1 and max are slow.
        let mut h = Histogram::new();
        for _ in 0..990 {
            h.record_duration(Duration::from_micros(200));
        }
        for _ in 0..10 {
            h.record_duration(Duration::from_millis(40));
        }
        assert!(ms(h.percentile(99.0)) < 0.21);
        assert!(ms(h.percentile(99.1)) >= 40.0);
        assert_eq!(h.max(), 40_000_000);
    }

    #[test]
    fn merge_adds_counts() {
        let mut a = Histogram::new();
        let mut b = Histogram::new();
        for v in 0..1_000 {
            a.record(v);
            b.record(v + 1_000_000);
        }
        a.merge(&b);
        assert_eq!(a.count(), 2_000);
        assert_eq!(a.min(), 0);
        assert_eq!(a.max(), 1_000_999);
        assert!(a.percentile(50.0) < 1_000);
        assert!(a.percentile(50.1) >= 1_000_000);
        // Merging an empty histogram changes nothing.
        let before = a.clone();
        a.merge(&Histogram::new());
        assert_eq!(a, before);
    }
}
