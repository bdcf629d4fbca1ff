//! `bursty`: the `no-prefix` requests with arrivals in bursts. Arrivals
//! follow a two-state Markov-modulated Poisson process: bursts of mean
//! `BURST_S` at `PEAK` x the mean rate alternate with calm spells of mean
//! `CALM_S` at `CALM` x the mean rate; the long-run mean is the asked rate.
//! Bursts shorter than a load-poll interval are what a polling router sees
//! only after the fact.

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use rand_distr::{Distribution, Exp};

use super::{no_prefix, text, OpenRequest, OutputCap, Shape};

pub const DESCRIPTION: &str = "the no-prefix requests, arrivals in bursts: a two-state modulated Poisson process, bursts of mean 1.5 s at 3x the mean rate, calm spells of mean 6 s at 0.5x (same mean rate)";

pub const PEAK: f64 = 3.0;
pub const CALM: f64 = 0.5;
pub const BURST_S: f64 = 1.5;
pub const CALM_S: f64 = 6.0;
const TAG: u64 = 2;

pub fn requests(shape: &Shape, cap: OutputCap) -> Result<Vec<OpenRequest>, String> {
    let mut rng = StdRng::seed_from_u64(text::seed_of(&[TAG, shape.seed]));
    let arrivals = modulated_arrivals(shape.rate, shape.duration_s, &mut rng)?;
    Ok(no_prefix::with_lengths(&arrivals, shape, cap, TAG, &mut rng))
}

/// Arrival times over [0, duration_s) with mean `rate`, bursty as above.
pub fn modulated_arrivals(rate: f64, duration_s: f64, rng: &mut StdRng) -> Result<Vec<f64>, String> {
    let burst_share = BURST_S / (BURST_S + CALM_S);
    // The two rates keep the long-run mean at `rate`: share x PEAK + (1 - share) x CALM = 1.
    debug_assert!((burst_share * PEAK + (1.0 - burst_share) * CALM - 1.0).abs() < 1e-9);
    let dwell = |mean: f64| Exp::new(1.0 / mean).map_err(|e| format!("bad dwell {mean}: {e}"));
    let (burst_dwell, calm_dwell) = (dwell(BURST_S)?, dwell(CALM_S)?);
    let mut bursting = rng.random::<f64>() < burst_share;
    let mut out = Vec::new();
    let mut t = 0.0;
    while t < duration_s {
        let (length, multiplier) = if bursting {
            (burst_dwell.sample(rng), PEAK)
        } else {
            (calm_dwell.sample(rng), CALM)
        };
        let end = (t + length).min(duration_s);
        let gaps = Exp::new(rate * multiplier)
            .map_err(|e| format!("arrival rate must be positive, got {rate}: {e}"))?;
        let mut at = t;
        loop {
            at += gaps.sample(rng);
            if at >= end {
                break;
            }
            out.push(at);
        }
        t = end;
        bursting = !bursting;
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keeps_the_mean_rate_but_is_burstier_than_poisson() {
        let mut rng = StdRng::seed_from_u64(4);
        let arrivals = modulated_arrivals(10.0, 2000.0, &mut rng).unwrap();
        let rate = arrivals.len() as f64 / 2000.0;
        assert!((9.0..11.0).contains(&rate), "rate {rate}");
        // Counts per second: a Poisson process has variance = mean; bursts
        // push the variance well above it.
        let mut counts = vec![0f64; 2000];
        for a in &arrivals {
            counts[*a as usize] += 1.0;
        }
        let mean = counts.iter().sum::<f64>() / counts.len() as f64;
        let var = counts.iter().map(|c| (c - mean).powi(2)).sum::<f64>() / counts.len() as f64;
        assert!(var > 3.0 * mean, "variance {var} vs mean {mean}");
    }
}
