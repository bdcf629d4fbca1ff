//! Length and arrival distributions shared by the workloads.
//!
//! ShareGPT-like lengths: conversations as reported in the vLLM paper (Kwon
//! et al., SOSP 2023, fig. 11: mean input 161 tokens, mean output 338 tokens)
//! and later serving papers, with long right tails. The raw data set is not
//! fetched here, so these are lognormals whose medians and spreads give means
//! of the same order and a tail of a few percent beyond 1,500 tokens, not a
//! fit to the raw data.

use rand::rngs::StdRng;
use rand::Rng;
use rand_distr::{Distribution, Exp, LogNormal};

/// A lognormal length distribution, clamped to [min, max].
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LengthModel {
    pub median: f64,
    pub sigma: f64,
    pub min: u32,
    pub max: u32,
}

impl LengthModel {
    /// Prompt tokens: median 200, sigma 1.1 (mean ~365, p99 ~2,600), 4..8,192.
    pub const SHAREGPT_INPUT: LengthModel = LengthModel {
        median: 200.0,
        sigma: 1.1,
        min: 4,
        max: 8192,
    };
    /// Output tokens: median 180, sigma 0.8 (mean ~250, p99 ~1,150), 1..1,024.
    pub const SHAREGPT_OUTPUT: LengthModel = LengthModel {
        median: 180.0,
        sigma: 0.8,
        min: 1,
        max: 1024,
    };

    /// One draw, rounded and clamped.
    pub fn sample(&self, rng: &mut StdRng) -> u32 {
        // A bad model (median <= 0, sigma < 0) degrades to the median itself.
        let v = LogNormal::new(self.median.max(1e-9).ln(), self.sigma.max(0.0))
            .map_or(self.median, |d| d.sample(rng))
            .round();
        v.clamp(f64::from(self.min), f64::from(self.max.max(self.min))) as u32
    }

    /// The same model with its maximum lowered to `max` (never below `min`).
    pub fn capped(self, max: u32) -> LengthModel {
        LengthModel {
            max: self.max.min(max).max(self.min),
            ..self
        }
    }
}

/// Arrival times (simulated seconds, ascending) of a Poisson process of
/// `rate` per second over [0, duration_s).
pub fn poisson_arrivals(rate: f64, duration_s: f64, rng: &mut StdRng) -> Result<Vec<f64>, String> {
    let gaps = Exp::new(rate).map_err(|e| format!("arrival rate must be positive, got {rate}: {e}"))?;
    if !(rate.is_finite() && rate > 0.0) {
        return Err(format!("arrival rate must be positive, got {rate}"));
    }
    let mut at = 0.0;
    let mut out = Vec::new();
    loop {
        at += gaps.sample(rng);
        if at >= duration_s {
            return Ok(out);
        }
        out.push(at);
    }
}

/// Draws an index in 0..n with probability proportional to 1 / (k+1)^s
/// (Zipf); `weights` comes from [`zipf_weights`].
pub fn zipf_pick(weights: &[f64], rng: &mut StdRng) -> usize {
    let total: f64 = weights.iter().sum();
    let mut x = rng.random::<f64>() * total;
    for (i, w) in weights.iter().enumerate() {
        if x < *w {
            return i;
        }
        x -= w;
    }
    weights.len().saturating_sub(1)
}

/// Zipf weights 1 / k^s for k = 1..=n.
pub fn zipf_weights(n: usize, s: f64) -> Vec<f64> {
    (1..=n).map(|k| 1.0 / (k as f64).powf(s)).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::SeedableRng;

    #[test]
    fn samples_stay_in_bounds_and_follow_the_median() {
        let mut rng = StdRng::seed_from_u64(1);
        let model = LengthModel::SHAREGPT_INPUT;
        let mut v: Vec<u32> = (0..4001).map(|_| model.sample(&mut rng)).collect();
        assert!(v.iter().all(|x| (4..=8192).contains(x)));
        v.sort_unstable();
        assert!((170..230).contains(&v[2000]), "median {}", v[2000]);
        let capped = model.capped(300);
        assert!((0..500).all(|_| capped.sample(&mut rng) <= 300));
    }

    #[test]
    fn poisson_rate_holds_and_bad_rates_are_refused() {
        let mut rng = StdRng::seed_from_u64(2);
        let a = poisson_arrivals(10.0, 100.0, &mut rng).unwrap();
        assert!((900..1100).contains(&a.len()), "{}", a.len());
        assert!(a.windows(2).all(|w| w[0] <= w[1]) && a.iter().all(|t| *t < 100.0));
        assert!(poisson_arrivals(0.0, 10.0, &mut rng).is_err());
        assert!(poisson_arrivals(f64::NAN, 10.0, &mut rng).is_err());
    }

    #[test]
    fn zipf_makes_the_first_item_the_hottest() {
        let weights = zipf_weights(16, 1.2);
        let mut rng = StdRng::seed_from_u64(3);
        let mut counts = [0usize; 16];
        for _ in 0..20_000 {
            counts[zipf_pick(&weights, &mut rng)] += 1;
        }
        let share = counts[0] as f64 / 20_000.0;
        assert!((0.33..0.40).contains(&share), "top share {share}");
        assert!(counts[0] > counts[1] && counts[1] > counts[15]);
    }
}
