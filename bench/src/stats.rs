//! The statistics every benchmark table rests on: nearest-rank percentiles,
//! medians, goodput against an SLO, the paired ratio of two variants over
//! seeds with a percentile-bootstrap confidence interval, and pooled tails:
//! percentiles and goodput over every seed's requests together, with a
//! cluster bootstrap (seeds resampled, the same resample for both sides of
//! a comparison).
//!
//! Why paired: every seed is a different trace, and some traces are simply
//! harder than others. Dividing dprank's figure by the peer's on the *same*
//! seed removes that trace-to-trace spread from the comparison; the median of
//! those ratios, with a bootstrap interval over seeds, is what the tables show.

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

/// Nearest-rank percentile `p` (0-100) of unsorted values, NaN values
/// ignored; NaN when nothing is left.
pub fn percentile(values: &[f64], p: f64) -> f64 {
    let mut sorted: Vec<f64> = values.iter().copied().filter(|v| !v.is_nan()).collect();
    if sorted.is_empty() {
        return f64::NAN;
    }
    sorted.sort_by(|a, b| a.total_cmp(b));
    percentile_sorted(&sorted, p)
}

/// Nearest-rank percentile of values already sorted ascending (non-empty).
fn percentile_sorted(sorted: &[f64], p: f64) -> f64 {
    let rank = ((p / 100.0) * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}

/// Median (mean of the two middle values for an even count), NaN values
/// ignored; NaN when nothing is left.
pub fn median(values: &[f64]) -> f64 {
    let mut v: Vec<f64> = values.iter().copied().filter(|x| !x.is_nan()).collect();
    if v.is_empty() {
        return f64::NAN;
    }
    v.sort_by(|a, b| a.total_cmp(b));
    median_sorted(&v)
}

fn median_sorted(sorted: &[f64]) -> f64 {
    let n = sorted.len();
    if n % 2 == 1 {
        sorted[n / 2]
    } else {
        (sorted[n / 2 - 1] + sorted[n / 2]) / 2.0
    }
}

/// Minimum and maximum of the non-NaN values.
pub fn min_max(values: &[f64]) -> Option<(f64, f64)> {
    let finite = values.iter().copied().filter(|v| !v.is_nan());
    finite.fold(None, |acc, v| match acc {
        None => Some((v, v)),
        Some((lo, hi)) => Some((lo.min(v), hi.max(v))),
    })
}

/// Reads an `f64` that JSON may hold as `null` (serde_json writes NaN and
/// infinities as `null`) back as NaN.
pub fn nan_from_null<'de, D: serde::Deserializer<'de>>(d: D) -> Result<f64, D::Error> {
    use serde::Deserialize;
    Ok(Option::<f64>::deserialize(d)?.unwrap_or(f64::NAN))
}

/// Service-level objective a request must meet to count towards goodput.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Slo {
    /// Time to first token, simulated ms.
    #[serde(deserialize_with = "nan_from_null")]
    pub ttft_ms: f64,
    /// Mean time per output token after the first (TPOT), simulated ms.
    #[serde(deserialize_with = "nan_from_null")]
    pub tpot_ms: f64,
}

/// Share of `requests` (TTFT ms, TPOT ms; TPOT NaN for one-token outputs)
/// meeting `slo`; `failed` requests count as missing it. NaN if there are none.
pub fn goodput(requests: &[(f64, f64)], failed: usize, slo: &Slo) -> f64 {
    let total = requests.len() + failed;
    if total == 0 {
        return f64::NAN;
    }
    let good = requests
        .iter()
        .filter(|(ttft, tpot)| *ttft <= slo.ttft_ms && (tpot.is_nan() || *tpot <= slo.tpot_ms))
        .count();
    good as f64 / total as f64
}

/// Median of the per-seed ratios `a / b` with its confidence interval.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PairedRatio {
    pub median: f64,
    pub lo: f64,
    pub hi: f64,
    /// Seeds present on both sides with a finite, positive denominator.
    pub pairs: usize,
    /// Pairs where a < b.
    pub below_one: usize,
}

impl PairedRatio {
    /// `0.81 [0.70, 0.93]`, or the point alone when there is one pair.
    pub fn display(&self) -> String {
        if self.pairs < 2 {
            format!("{:.2}", self.median)
        } else {
            format!("{:.2} [{:.2}, {:.2}]", self.median, self.lo, self.hi)
        }
    }
}

/// Resamples for the bootstrap; the RNG seed is fixed so a report rebuilt
/// from the same runs prints the same interval.
pub const BOOTSTRAP_RESAMPLES: usize = 10_000;
const BOOTSTRAP_SEED: u64 = 0x5eed_0fb0_07ed;

/// Pairs `a` and `b` by seed (`(seed, value)` lists), forms `a / b` for every
/// seed on both sides where both are finite and `b > 0`, and returns the
/// median ratio with a 95% percentile-bootstrap interval over seeds.
pub fn paired_ratio(a: &[(u64, f64)], b: &[(u64, f64)]) -> Option<PairedRatio> {
    let ratios: Vec<f64> = a
        .iter()
        .filter_map(|(seed, x)| {
            let y = b.iter().find(|(s, _)| s == seed)?.1;
            (x.is_finite() && y.is_finite() && y > 0.0).then_some(x / y)
        })
        .collect();
    if ratios.is_empty() {
        return None;
    }
    let (lo, hi) = bootstrap_median_interval(&ratios, 0.95, BOOTSTRAP_RESAMPLES, BOOTSTRAP_SEED);
    Some(PairedRatio {
        median: median(&ratios),
        lo,
        hi,
        pairs: ratios.len(),
        below_one: ratios.iter().filter(|r| **r < 1.0).count(),
    })
}

/// Percentile-bootstrap interval (two-sided, `confidence` in (0, 1)) of the
/// median of `values`: resample with replacement `resamples` times, take the
/// median of each resample, return the (1-c)/2 and (1+c)/2 quantiles of
/// those medians. A single value gives (value, value).
pub fn bootstrap_median_interval(values: &[f64], confidence: f64, resamples: usize, seed: u64) -> (f64, f64) {
    let values: Vec<f64> = values.iter().copied().filter(|v| !v.is_nan()).collect();
    match values.len() {
        0 => return (f64::NAN, f64::NAN),
        1 => return (values[0], values[0]),
        _ => {}
    }
    let mut rng = StdRng::seed_from_u64(seed);
    let mut sample = vec![0.0; values.len()];
    let mut medians = Vec::with_capacity(resamples.max(1));
    for _ in 0..resamples.max(1) {
        for slot in sample.iter_mut() {
            *slot = values[rng.random_range(0..values.len())];
        }
        sample.sort_by(|a, b| a.total_cmp(b));
        medians.push(median_sorted(&sample));
    }
    medians.sort_by(|a, b| a.total_cmp(b));
    let tail = (1.0 - confidence.clamp(0.0, 1.0)) / 2.0;
    (
        quantile_sorted(&medians, tail),
        quantile_sorted(&medians, 1.0 - tail),
    )
}

/// Linear-interpolated quantile `q` (0-1) of sorted, non-empty values.
fn quantile_sorted(sorted: &[f64], q: f64) -> f64 {
    let position = q.clamp(0.0, 1.0) * (sorted.len() - 1) as f64;
    let below = position.floor() as usize;
    let above = position.ceil() as usize;
    let weight = position - below as f64;
    sorted[below] * (1.0 - weight) + sorted[above] * weight
}

/// How many samples lie at or above the nearest-rank percentile `p` among
/// `n`: what a tail figure rests on (p99 of 700 requests is the 8th largest).
pub fn tail_samples(n: usize, p: f64) -> usize {
    n - ((p / 100.0) * n as f64).ceil().min(n as f64) as usize + usize::from(n > 0)
}

/// Resamples of the cluster bootstrap (seeds resampled, their requests
/// pooled); fixed RNG seed, so a rebuilt report prints the same interval.
pub const CLUSTER_RESAMPLES: usize = 2000;
const CLUSTER_SEED: u64 = 0x0c1a_57e2_b007;

/// A figure with its 95% interval.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Estimate {
    pub point: f64,
    pub lo: f64,
    pub hi: f64,
    /// Seeds it rests on.
    pub seeds: usize,
}

impl Estimate {
    /// `1234 [1100, 1400]` with `decimals`, `∞` for infinite values, the
    /// point alone from one seed.
    pub fn display(&self, decimals: usize) -> String {
        let f = |v: f64| {
            if v.is_infinite() {
                "∞".to_string()
            } else if v.is_nan() {
                "–".to_string()
            } else {
                format!("{v:.decimals$}")
            }
        };
        if self.seeds < 2 {
            f(self.point)
        } else {
            format!("{} [{}, {}]", f(self.point), f(self.lo), f(self.hi))
        }
    }

    /// A ratio with two significant digits at least (0.0043 stays 0.0043).
    pub fn display_ratio(&self) -> String {
        let v = self.point.abs();
        let decimals = if v > 0.0 && v.is_finite() {
            (1 - v.log10().floor() as i64).clamp(2, 5) as usize
        } else {
            2
        };
        self.display(decimals)
    }

    /// The same figure scaled (a share as a percentage).
    pub fn scaled(self, by: f64) -> Estimate {
        Estimate {
            point: self.point * by,
            lo: self.lo * by,
            hi: self.hi * by,
            seeds: self.seeds,
        }
    }
}

/// One seed's requests as pooled figures need them.
#[derive(Debug, Clone)]
pub struct SeedRequests {
    pub seed: u64,
    /// TTFT of every measured request, ms; a failed request is infinite.
    pub ttft_ms: Vec<f64>,
    /// Requests within the SLO, and all measured requests.
    pub good: f64,
    pub sent: f64,
}

/// Every request of several seeds, sorted once, so a percentile of any
/// weighting of the seeds (a bootstrap resample) is one walk.
#[derive(Debug, Clone)]
pub struct Pooled {
    /// (TTFT, seed index), ascending.
    merged: Vec<(f64, usize)>,
    counts: Vec<usize>,
    good: Vec<f64>,
    sent: Vec<f64>,
}

impl Pooled {
    pub fn new(seeds: &[SeedRequests]) -> Pooled {
        let mut merged: Vec<(f64, usize)> = seeds
            .iter()
            .enumerate()
            .flat_map(|(i, s)| s.ttft_ms.iter().filter(|v| !v.is_nan()).map(move |v| (*v, i)))
            .collect();
        merged.sort_by(|a, b| a.0.total_cmp(&b.0));
        let mut counts = vec![0; seeds.len()];
        for (_, i) in &merged {
            counts[*i] += 1;
        }
        Pooled {
            merged,
            counts,
            good: seeds.iter().map(|s| s.good).collect(),
            sent: seeds.iter().map(|s| s.sent).collect(),
        }
    }

    pub fn seeds(&self) -> usize {
        self.counts.len()
    }

    pub fn requests(&self) -> usize {
        self.merged.len()
    }

    /// Nearest-rank percentile `p` of the requests, seed i counted
    /// `weights[i]` times; NaN when there are none.
    pub fn percentile(&self, weights: &[u32], p: f64) -> f64 {
        let total: u64 = self
            .counts
            .iter()
            .zip(weights)
            .map(|(n, w)| *n as u64 * u64::from(*w))
            .sum();
        if total == 0 {
            return f64::NAN;
        }
        let rank = (((p / 100.0) * total as f64).ceil() as u64).clamp(1, total);
        let weight = |i: usize| u64::from(weights[i]);
        if rank * 2 <= total {
            let mut seen = 0;
            for (v, i) in &self.merged {
                seen += weight(*i);
                if seen >= rank {
                    return *v;
                }
            }
        } else {
            // The rank-th smallest is the (total - rank + 1)-th largest.
            let from_top = total - rank + 1;
            let mut seen = 0;
            for (v, i) in self.merged.iter().rev() {
                seen += weight(*i);
                if seen >= from_top {
                    return *v;
                }
            }
        }
        f64::NAN
    }

    /// Share of requests within the SLO, seeds weighted.
    pub fn goodput(&self, weights: &[u32]) -> f64 {
        let w = |i: usize| f64::from(weights[i]);
        let good: f64 = self.good.iter().enumerate().map(|(i, g)| g * w(i)).sum();
        let sent: f64 = self.sent.iter().enumerate().map(|(i, s)| s * w(i)).sum();
        if sent > 0.0 {
            good / sent
        } else {
            f64::NAN
        }
    }
}

/// Weights of every seed once.
pub fn all_once(seeds: usize) -> Vec<u32> {
    vec![1; seeds]
}

/// `resamples` draws of `seeds` seeds with replacement, as counts per seed.
pub fn resample_weights(seeds: usize, resamples: usize, rng_seed: u64) -> Vec<Vec<u32>> {
    let mut rng = StdRng::seed_from_u64(rng_seed);
    (0..resamples)
        .map(|_| {
            let mut w = vec![0u32; seeds];
            for _ in 0..seeds {
                w[rng.random_range(0..seeds.max(1))] += 1;
            }
            w
        })
        .collect()
}

/// The 2.5% and 97.5% quantiles of resampled figures (NaNs left out;
/// infinities kept, so an interval can reach ∞).
fn interval95(mut values: Vec<f64>) -> (f64, f64) {
    values.retain(|v| !v.is_nan());
    if values.is_empty() {
        return (f64::NAN, f64::NAN);
    }
    values.sort_by(|a, b| a.total_cmp(b));
    let q = |q: f64| values[((q * (values.len() - 1) as f64).round() as usize).min(values.len() - 1)];
    (q(0.025), q(0.975))
}

/// A pooled figure of one variant with its cluster-bootstrap interval:
/// seeds resampled with replacement, their requests pooled.
pub fn cluster_estimate(pooled: &Pooled, figure: impl Fn(&Pooled, &[u32]) -> f64) -> Estimate {
    let n = pooled.seeds();
    let point = figure(pooled, &all_once(n));
    let (lo, hi) = if n < 2 {
        (point, point)
    } else {
        interval95(
            resample_weights(n, CLUSTER_RESAMPLES, CLUSTER_SEED)
                .iter()
                .map(|w| figure(pooled, w))
                .collect(),
        )
    };
    Estimate {
        point,
        lo,
        hi,
        seeds: n,
    }
}

/// `a ÷ b` of a pooled figure, paired by seed: both sides pooled over the
/// seeds they share, every resample drawing the same seeds for both. None
/// without a shared seed.
pub fn paired_cluster_ratio(
    a: &[SeedRequests],
    b: &[SeedRequests],
    figure: impl Fn(&Pooled, &[u32]) -> f64,
) -> Option<Estimate> {
    let shared: Vec<u64> = a
        .iter()
        .map(|s| s.seed)
        .filter(|seed| b.iter().any(|t| t.seed == *seed))
        .collect();
    if shared.is_empty() {
        return None;
    }
    let pick = |side: &[SeedRequests]| -> Vec<SeedRequests> {
        shared
            .iter()
            .filter_map(|seed| side.iter().find(|s| s.seed == *seed).cloned())
            .collect()
    };
    let (pa, pb) = (Pooled::new(&pick(a)), Pooled::new(&pick(b)));
    let ratio = |w: &[u32]| figure(&pa, w) / figure(&pb, w);
    let n = shared.len();
    let point = ratio(&all_once(n));
    let (lo, hi) = if n < 2 {
        (point, point)
    } else {
        interval95(
            resample_weights(n, CLUSTER_RESAMPLES, CLUSTER_SEED)
                .iter()
                .map(|w| ratio(w))
                .collect(),
        )
    };
    Some(Estimate {
        point,
        lo,
        hi,
        seeds: n,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentile_is_nearest_rank_and_skips_nan() {
        let v: Vec<f64> = (1..=100).map(f64::from).collect();
        assert_eq!(percentile(&v, 50.0), 50.0);
        assert_eq!(percentile(&v, 99.0), 99.0);
        assert_eq!(percentile(&v, 100.0), 100.0);
        assert_eq!(percentile(&v, 0.0), 1.0);
        assert_eq!(percentile(&[3.0, f64::NAN, 1.0], 100.0), 3.0);
        assert!(percentile(&[], 50.0).is_nan());
        assert!(percentile(&[f64::NAN], 50.0).is_nan());
    }

    #[test]
    fn median_odd_even_and_min_max() {
        assert_eq!(median(&[3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(&[4.0, 1.0, 2.0, 3.0]), 2.5);
        assert!(median(&[]).is_nan());
        assert_eq!(min_max(&[2.0, f64::NAN, -1.0, 5.0]), Some((-1.0, 5.0)));
        assert_eq!(min_max(&[]), None);
    }

    #[test]
    fn goodput_counts_both_objectives_and_failures() {
        let slo = Slo {
            ttft_ms: 100.0,
            tpot_ms: 10.0,
        };
        let requests = [(50.0, 5.0), (150.0, 5.0), (50.0, 20.0), (100.0, f64::NAN)];
        // Two of four meet both; one failure makes it two of five.
        assert_eq!(goodput(&requests, 0, &slo), 0.5);
        assert_eq!(goodput(&requests, 1, &slo), 0.4);
        assert!(goodput(&[], 0, &slo).is_nan());
        assert_eq!(goodput(&[], 3, &slo), 0.0);
    }

    #[test]
    fn paired_ratio_pairs_by_seed_and_skips_bad_denominators() {
        let a = [(1, 50.0), (2, 80.0), (3, 30.0), (4, 10.0)];
        let b = [(2, 100.0), (1, 100.0), (3, 0.0), (5, 1.0)];
        let r = paired_ratio(&a, &b).unwrap();
        assert_eq!(r.pairs, 2);
        assert_eq!(r.median, 0.65);
        assert_eq!(r.below_one, 2);
        assert!(r.lo >= 0.5 && r.hi <= 0.8 && r.lo <= r.median && r.median <= r.hi);
        assert!(paired_ratio(&a, &[(9, 1.0)]).is_none());
    }

    #[test]
    fn identical_ratios_give_a_point_interval() {
        let a: Vec<(u64, f64)> = (0..10).map(|s| (s, 2.0 * (s + 1) as f64)).collect();
        let b: Vec<(u64, f64)> = (0..10).map(|s| (s, (s + 1) as f64)).collect();
        let r = paired_ratio(&a, &b).unwrap();
        assert_eq!((r.median, r.lo, r.hi, r.pairs), (2.0, 2.0, 2.0, 10));
        assert_eq!(r.display(), "2.00 [2.00, 2.00]");
    }

    #[test]
    fn bootstrap_interval_is_reproducible_and_brackets_the_median() {
        let values: Vec<f64> = (0..15).map(|i| 0.5 + f64::from(i) * 0.05).collect();
        let first = bootstrap_median_interval(&values, 0.95, 2000, 7);
        assert_eq!(first, bootstrap_median_interval(&values, 0.95, 2000, 7));
        let m = median(&values);
        assert!(first.0 < m && m < first.1, "{first:?} vs {m}");
        assert!(first.0 >= 0.5 && first.1 <= 1.2);
        // A wider confidence never gives a narrower interval.
        let wide = bootstrap_median_interval(&values, 0.99, 2000, 7);
        assert!(wide.0 <= first.0 && wide.1 >= first.1);
        assert_eq!(bootstrap_median_interval(&[4.0], 0.95, 100, 1), (4.0, 4.0));
    }

    #[test]
    fn bootstrap_interval_covers_a_known_median_most_of_the_time() {
        // Samples of 15 from a skewed distribution whose median is 1.0: the
        // 95% interval should cover it in most of 200 independent trials
        // (percentile bootstrap of a median undercovers a little at n = 15).
        let mut rng = StdRng::seed_from_u64(99);
        let mut covered = 0;
        for trial in 0..200 {
            let values: Vec<f64> = (0..15).map(|_| (rng.random::<f64>() - 0.5).exp()).collect();
            let (lo, hi) = bootstrap_median_interval(&values, 0.95, 1000, trial);
            if lo <= 1.0 && 1.0 <= hi {
                covered += 1;
            }
        }
        assert!((170..=200).contains(&covered), "covered {covered} of 200");
    }

    fn seed(seed: u64, ttft: &[f64], good: f64) -> SeedRequests {
        SeedRequests {
            seed,
            ttft_ms: ttft.to_vec(),
            good,
            sent: ttft.len() as f64,
        }
    }

    #[test]
    fn pooled_percentiles_weight_seeds_like_repeated_requests() {
        let seeds = [seed(1, &[1.0, 2.0, 3.0], 3.0), seed(2, &[10.0, 20.0], 1.0)];
        let pooled = Pooled::new(&seeds);
        assert_eq!(pooled.requests(), 5);
        let all: Vec<f64> = vec![1.0, 2.0, 3.0, 10.0, 20.0];
        for p in [0.0, 20.0, 50.0, 60.0, 90.0, 99.0, 100.0] {
            assert_eq!(pooled.percentile(&[1, 1], p), percentile(&all, p), "p{p}");
        }
        // Seed 2 drawn twice, seed 1 never: its requests twice over.
        let twice = [10.0, 20.0, 10.0, 20.0];
        for p in [10.0, 50.0, 75.0, 100.0] {
            assert_eq!(pooled.percentile(&[0, 2], p), percentile(&twice, p), "p{p}");
        }
        assert_eq!(pooled.goodput(&[1, 1]), 4.0 / 5.0);
        assert_eq!(pooled.goodput(&[0, 3]), 0.5);
        assert!(pooled.percentile(&[0, 0], 50.0).is_nan());
        // Failures are infinite and count in the tail.
        let failed = Pooled::new(&[seed(1, &[1.0, f64::INFINITY], 1.0)]);
        assert_eq!(failed.percentile(&[1], 99.0), f64::INFINITY);
    }

    #[test]
    fn cluster_intervals_bracket_the_point_and_pair_seeds() {
        let a: Vec<SeedRequests> = (1..=8)
            .map(|s| {
                seed(
                    s,
                    &(0..100).map(|i| f64::from(i) * s as f64).collect::<Vec<_>>(),
                    90.0,
                )
            })
            .collect();
        let b: Vec<SeedRequests> = a
            .iter()
            .map(|s| SeedRequests {
                ttft_ms: s.ttft_ms.iter().map(|v| v * 2.0).collect(),
                ..s.clone()
            })
            .collect();
        let p90 = |p: &Pooled, w: &[u32]| p.percentile(w, 90.0);
        let e = cluster_estimate(&Pooled::new(&a), p90);
        assert!(e.lo <= e.point && e.point <= e.hi && e.lo < e.hi, "{e:?}");
        assert_eq!(e.seeds, 8);
        // Every seed of b is twice a's: the paired ratio is exactly 0.5 in
        // every resample, though the seeds differ widely.
        let r = paired_cluster_ratio(&a, &b, p90).unwrap();
        assert_eq!((r.point, r.lo, r.hi), (0.5, 0.5, 0.5));
        assert_eq!(r.display(2), "0.50 [0.50, 0.50]");
        assert_eq!(r.display_ratio(), "0.50 [0.50, 0.50]");
        let small = Estimate {
            point: 0.0043,
            lo: 0.0031,
            hi: 0.0102,
            seeds: 5,
        };
        assert_eq!(small.display_ratio(), "0.0043 [0.0031, 0.0102]");
        assert!(paired_cluster_ratio(&a, &[seed(99, &[1.0], 1.0)], p90).is_none());
        let good = cluster_estimate(&Pooled::new(&a), |p, w| p.goodput(w));
        assert_eq!((good.point, good.lo, good.hi), (0.9, 0.9, 0.9));
    }

    #[test]
    fn tail_samples_counts_the_values_a_percentile_rests_on() {
        assert_eq!(tail_samples(700, 99.0), 8);
        assert_eq!(tail_samples(4951, 99.0), 50);
        assert_eq!(tail_samples(100, 50.0), 51);
        assert_eq!(tail_samples(0, 99.0), 0);
    }
}
