//! A synthetic trace in the block-hash format, shaped like a conversational
//! production trace: a few applications with long system prompts (Zipf
//! popularity), multi-turn sessions whose every turn repeats the session's
//! earlier blocks (history) and adds new ones, answers included. Lengths are
//! at production scale (512-token blocks); `replay` scales them down.
//!
//! `dprank-bench make-trace` writes one to a file (bench/traces/sample.jsonl
//! is `make-trace --seed 1 --requests 600`); the `replay` workload draws a
//! fresh one per seed when no file is given.

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use rand_distr::{Distribution, Exp, Geometric};

use super::lengths::{zipf_pick, zipf_weights, LengthModel};
use super::text;
use super::trace_format::{TraceLine, BLOCK_TOKENS};

pub const DESCRIPTION: &str = "8 applications with system prompts of 2-12 blocks (Zipf(1.0) popularity), sessions of 1 + geometric(mean 2) turns (at most 8) adding 1-3 user blocks per turn, answers lognormal(median 250, sigma 0.8) in [16, 2000] tokens kept in the history, Poisson session starts (1 per 10 s), think time exponential(mean 30 s)";

const APPS: usize = 8;
const APP_BLOCKS: (u64, u64) = (2, 12);
const USER_BLOCKS: (u64, u64) = (1, 3);
const MAX_TURNS: u64 = 8;
const SESSION_GAP_MEAN_S: f64 = 10.0;
const THINK_MEAN_S: f64 = 30.0;
const ANSWER: LengthModel = LengthModel {
    median: 250.0,
    sigma: 0.8,
    min: 16,
    max: 2000,
};
const TAG: u64 = 6;

/// `requests` lines (sorted by timestamp) drawn from `seed`.
pub fn generate(seed: u64, requests: usize) -> Vec<TraceLine> {
    let mut rng = StdRng::seed_from_u64(text::seed_of(&[TAG, seed]));
    let weights = zipf_weights(APPS, 1.0);
    let mut next_id: u64 = 0;
    let mut fresh = |count: u64| -> Vec<u64> {
        let ids = (next_id..next_id + count).collect();
        next_id += count;
        ids
    };
    let apps: Vec<Vec<u64>> = (0..APPS)
        .map(|_| {
            let blocks = rng.random_range(APP_BLOCKS.0..=APP_BLOCKS.1);
            fresh(blocks)
        })
        .collect();
    // Rates are positive constants, so these distributions always build.
    let session_gap = Exp::new(1.0 / SESSION_GAP_MEAN_S).ok();
    let think = Exp::new(1.0 / THINK_MEAN_S).ok();
    let extra_turns = Geometric::new(1.0 / 3.0).ok();
    let mut lines = Vec::with_capacity(requests);
    let mut session_start = 0.0;
    while lines.len() < requests {
        session_start += session_gap.map_or(SESSION_GAP_MEAN_S, |d| d.sample(&mut rng));
        let app = zipf_pick(&weights, &mut rng);
        let mut history = apps[app].clone();
        let turns = (1 + extra_turns.map_or(0, |d| d.sample(&mut rng))).min(MAX_TURNS);
        let mut at = session_start;
        for turn in 0..turns {
            if lines.len() >= requests {
                break;
            }
            if turn > 0 {
                at += think.map_or(THINK_MEAN_S, |d| d.sample(&mut rng));
            }
            let user_blocks = rng.random_range(USER_BLOCKS.0..=USER_BLOCKS.1);
            let mut ids = history.clone();
            ids.extend(fresh(user_blocks));
            // The last block is usually partial: its hash is this request's own.
            let cut = rng.random_range(0..BLOCK_TOKENS);
            let input_length = ids.len() as u64 * u64::from(BLOCK_TOKENS) - u64::from(cut);
            let output = ANSWER.sample(&mut rng);
            lines.push(TraceLine {
                timestamp: (at * 1000.0).round(),
                input_length,
                output_length: u64::from(output),
                hash_ids: ids.clone(),
            });
            // The next turn repeats this prompt's full blocks and the answer.
            ids.pop();
            ids.extend(fresh(1));
            ids.extend(fresh(u64::from(output).div_ceil(u64::from(BLOCK_TOKENS))));
            history = ids;
            // The answer takes a while to stream before the user thinks.
            at += f64::from(output) * 0.03;
        }
    }
    lines.sort_by(|a, b| a.timestamp.total_cmp(&b.timestamp));
    lines
}

/// The trace as JSONL, one line per request, fields in the format's usual
/// order (integer timestamps).
pub fn to_jsonl(lines: &[TraceLine]) -> String {
    let mut out = String::new();
    for line in lines {
        let ids: Vec<String> = line.hash_ids.iter().map(u64::to_string).collect();
        out.push_str(&format!(
            "{{\"timestamp\": {}, \"input_length\": {}, \"output_length\": {}, \"hash_ids\": [{}]}}\n",
            line.timestamp as u64,
            line.input_length,
            line.output_length,
            ids.join(", ")
        ));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::workload::trace_format;

    #[test]
    fn sessions_share_prefixes_and_the_output_parses_back() {
        let lines = generate(1, 300);
        assert_eq!(lines.len(), 300);
        assert!(lines.windows(2).all(|w| w[0].timestamp <= w[1].timestamp));
        assert_eq!(generate(1, 300), lines);
        assert_ne!(generate(2, 300), lines);
        // Most requests share at least their first block with another.
        let shared = lines
            .iter()
            .filter(|l| {
                lines
                    .iter()
                    .filter(|m| m.hash_ids.first() == l.hash_ids.first())
                    .count()
                    > 1
            })
            .count();
        assert!(shared > 250, "{shared}");
        // Lengths are consistent with the blocks.
        assert!(lines.iter().all(|l| {
            let full = l.hash_ids.len() as u64 * 512;
            l.input_length <= full && l.input_length > full - 512
        }));
        let parsed = trace_format::parse(&to_jsonl(&lines), "synth").unwrap();
        assert_eq!(parsed, lines);
    }

    #[test]
    fn the_committed_sample_is_what_make_trace_writes() {
        let path = concat!(env!("CARGO_MANIFEST_DIR"), "/traces/sample.jsonl");
        let committed = std::fs::read_to_string(path).unwrap();
        assert_eq!(
            committed,
            to_jsonl(&generate(1, 600)),
            "regenerate with `dprank-bench make-trace --seed 1 --requests 600`"
        );
    }
}
