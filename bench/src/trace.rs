//! Seeded, reproducible request traces: Poisson arrivals and heavy-tailed
//! lognormal prompt and output lengths.
//!
//! Length model (documented in bench-results/compare.md): ShareGPT
//! conversations as reported in the vLLM paper (Kwon et al., SOSP 2023,
//! fig. 11: mean input 161 tokens, mean output 338 tokens) and in later
//! serving papers, with long right tails (inputs to several thousand
//! tokens). The raw data set cannot be fetched here, so these are lognormals
//! whose medians and spreads give means of the same order and a tail of a few
//! percent beyond 1,500 tokens, not a fit to the raw data.

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use rand_distr::{Distribution, Exp, LogNormal};

/// A lognormal length distribution, clamped to [min, max].
#[derive(Debug, Clone, Copy)]
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

    /// Mean of the unclamped distribution.
    pub fn mean(&self) -> f64 {
        self.median * (self.sigma * self.sigma / 2.0).exp()
    }

    fn sample(&self, distribution: &LogNormal<f64>, rng: &mut StdRng) -> u32 {
        let v = distribution.sample(rng).round();
        (v.max(self.min as f64).min(self.max as f64)) as u32
    }

    fn distribution(&self) -> Result<LogNormal<f64>, String> {
        LogNormal::new(self.median.ln(), self.sigma).map_err(|e| {
            format!(
                "bad lognormal (median {}, sigma {}): {e}",
                self.median, self.sigma
            )
        })
    }
}

#[derive(Debug, Clone)]
pub struct TraceSpec {
    /// Arrivals per simulated second.
    pub rate: f64,
    /// Simulated seconds of arrivals.
    pub duration_s: f64,
    pub seed: u64,
    pub input: LengthModel,
    pub output: LengthModel,
}

/// One request of a trace; `at_s` is its arrival in simulated seconds.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct TraceRequest {
    pub at_s: f64,
    pub input_tokens: u32,
    pub output_tokens: u32,
}

impl TraceSpec {
    pub fn generate(&self) -> Result<Vec<TraceRequest>, String> {
        if !(self.rate > 0.0 && self.rate.is_finite()) {
            return Err(format!("rate must be positive, got {}", self.rate));
        }
        let gaps = Exp::new(self.rate).map_err(|e| format!("bad rate {}: {e}", self.rate))?;
        let input = self.input.distribution()?;
        let output = self.output.distribution()?;
        let mut rng = StdRng::seed_from_u64(self.seed);
        let mut at_s = 0.0;
        let mut out = Vec::new();
        loop {
            at_s += gaps.sample(&mut rng);
            if at_s > self.duration_s {
                break;
            }
            out.push(TraceRequest {
                at_s,
                input_tokens: self.input.sample(&input, &mut rng),
                output_tokens: self.output.sample(&output, &mut rng),
            });
        }
        Ok(out)
    }
}

/// Three-letter words and a space: exactly 4 bytes per token, as the
/// simulator (and dprank's `bytes` estimate) count ceil(bytes / 4).
const WORDS: [&str; 8] = ["the ", "cat ", "sat ", "far ", "big ", "red ", "sky ", "old "];

/// Prompt text of `tokens` tokens at 4 bytes each.
pub fn prompt_text(tokens: u32, salt: u64) -> String {
    let mut text = String::with_capacity(tokens as usize * 4);
    let mut rng = StdRng::seed_from_u64(salt);
    for _ in 0..tokens {
        text.push_str(WORDS[rng.random_range(0..WORDS.len())]);
    }
    text
}

/// A `/generate` body asking for exactly `output` tokens.
pub fn generate_body(input: u32, output: u32, stream: bool, salt: u64) -> String {
    format!(
        r#"{{"text":"{}","sampling_params":{{"max_new_tokens":{},"ignore_eos":true,"temperature":0}},"stream":{}}}"#,
        prompt_text(input, salt),
        output,
        stream
    )
}

/// A non-streamed `/generate` body of about `bytes` bytes (overhead runs).
pub fn generate_body_of_size(bytes: usize) -> String {
    let frame = generate_body(0, 1, false, 0).len();
    let tokens = bytes.saturating_sub(frame).div_ceil(4).max(1);
    generate_body(tokens as u32, 1, false, 7)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(seed: u64) -> TraceSpec {
        TraceSpec {
            rate: 10.0,
            duration_s: 60.0,
            seed,
            input: LengthModel::SHAREGPT_INPUT,
            output: LengthModel::SHAREGPT_OUTPUT,
        }
    }

    #[test]
    fn same_seed_same_trace() {
        assert_eq!(spec(1).generate().unwrap(), spec(1).generate().unwrap());
        assert_ne!(spec(1).generate().unwrap(), spec(2).generate().unwrap());
    }

    #[test]
    fn rate_and_bounds_hold() {
        let trace = spec(3).generate().unwrap();
        assert!((500..700).contains(&trace.len()), "{}", trace.len());
        assert!(trace.windows(2).all(|w| w[0].at_s <= w[1].at_s));
        assert!(trace.iter().all(|r| (4..=8192).contains(&r.input_tokens)));
        assert!(trace.iter().all(|r| (1..=1024).contains(&r.output_tokens)));
    }

    #[test]
    fn prompt_is_four_bytes_per_token() {
        assert_eq!(prompt_text(100, 1).len(), 400);
        let body = generate_body_of_size(100_000);
        assert!((99_000..101_000).contains(&body.len()), "{}", body.len());
        let v: serde_json::Value = serde_json::from_str(&body).unwrap();
        assert_eq!(v["stream"], false);
    }
}
