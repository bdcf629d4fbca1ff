//! `replay`: requests from a trace in the public block-hash format, one JSON
//! object per line:
//!
//! ```text
//! {"timestamp": 27482, "input_length": 6955, "output_length": 52, "hash_ids": [46, 47, 48, ...]}
//! ```
//!
//! `timestamp` is the arrival in ms, `input_length` and `output_length` are
//! tokens, and `hash_ids` name the prompt's 512-token blocks in order: two
//! requests with the same first k ids share their first k blocks (a chained
//! hash, as in the Mooncake traces). Other fields are ignored.
//!
//! Prompt text is generated from the ids: a block's text is a function of its
//! id alone, so equal ids give equal text and shared prefixes stay shared.
//! Lengths are scaled (`input_scale` multiplies input lengths and the block
//! size alike, keeping the sharing structure) because production prompts are
//! far longer than a small simulated rank holds. Each seed replays a window
//! of `rate x duration` consecutive requests starting at a seeded offset,
//! with timestamps rescaled so the window's mean rate is the offered rate.

use std::path::Path;

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde::Deserialize;

use super::{bodies, synth, text, Api, OpenRequest, ReplaySource, Shape};

/// Tokens per block in the format.
pub const BLOCK_TOKENS: u32 = 512;
/// Default input scale: 512-token blocks become 64-token blocks, a 12k-token
/// prompt 1.5k tokens.
pub const DEFAULT_INPUT_SCALE: f64 = 0.125;
const TAG: u64 = 5;

/// One line of a block-hash trace.
#[derive(Debug, Clone, PartialEq, Deserialize, serde::Serialize)]
pub struct TraceLine {
    /// Arrival, ms.
    pub timestamp: f64,
    pub input_length: u64,
    pub output_length: u64,
    pub hash_ids: Vec<u64>,
}

/// Parses JSONL text; blank lines are skipped; `origin` names the source in
/// errors, which carry the line number.
pub fn parse(text: &str, origin: &str) -> Result<Vec<TraceLine>, String> {
    let mut out = Vec::new();
    for (number, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        let parsed: TraceLine = serde_json::from_str(line)
            .map_err(|e| format!("{origin}:{}: not a block-hash trace line: {e}", number + 1))?;
        if !parsed.timestamp.is_finite() {
            return Err(format!(
                "{origin}:{}: timestamp is not a finite number",
                number + 1
            ));
        }
        out.push(parsed);
    }
    if out.is_empty() {
        return Err(format!("{origin}: no trace lines"));
    }
    Ok(out)
}

pub fn load(path: &Path) -> Result<Vec<TraceLine>, String> {
    let text =
        std::fs::read_to_string(path).map_err(|e| format!("cannot read trace {}: {e}", path.display()))?;
    parse(&text, &path.display().to_string())
}

/// The plan's requests: a window of the file (or of a synthetic trace drawn
/// from the seed when no file is given).
pub fn requests(source: &ReplaySource, shape: &Shape) -> Result<Vec<OpenRequest>, String> {
    let wanted = ((shape.rate * shape.duration_s).round() as usize).max(1);
    let (mut lines, start) = match &source.file {
        Some(path) => {
            let lines = load(path)?;
            let window = wanted.min(lines.len());
            let mut rng = StdRng::seed_from_u64(text::seed_of(&[TAG, shape.seed]));
            let start = rng.random_range(0..=lines.len() - window);
            (lines, start)
        }
        None => (synth::generate(shape.seed, wanted), 0),
    };
    lines.sort_by(|a, b| a.timestamp.total_cmp(&b.timestamp));
    let end = (start + wanted).min(lines.len());
    Ok(from_lines(&lines[start..end], source, shape))
}

/// Requests for `lines` (sorted by timestamp): times rescaled to
/// `shape.rate`, lengths scaled and clamped, text from the block ids.
pub fn from_lines(lines: &[TraceLine], source: &ReplaySource, shape: &Shape) -> Vec<OpenRequest> {
    let Some(first) = lines.first() else {
        return Vec::new();
    };
    let span_s = (lines[lines.len() - 1].timestamp - first.timestamp) / 1000.0;
    // Seconds of replay per second of trace.
    let stretch = if lines.len() > 1 && span_s > 0.0 {
        ((lines.len() - 1) as f64 / span_s) / shape.rate
    } else {
        0.0
    };
    let block = ((f64::from(BLOCK_TOKENS) * source.input_scale).round() as u32).max(1);
    lines
        .iter()
        .enumerate()
        .map(|(i, line)| {
            let at_s = if stretch > 0.0 {
                (line.timestamp - first.timestamp) / 1000.0 * stretch
            } else {
                i as f64 / shape.rate
            };
            let input_tokens = scaled(line.input_length, source.input_scale, shape.max_prompt);
            let output_tokens = scaled(line.output_length, source.output_scale, shape.max_output);
            let prompt = prompt_from_blocks(&line.hash_ids, input_tokens, block, (shape.seed, i as u64));
            OpenRequest {
                at_s,
                api: Api::Generate,
                body: bodies::generate(&prompt, output_tokens, true),
                input_tokens,
                output_tokens,
                tenant: None,
            }
        })
        .collect()
}

fn scaled(length: u64, scale: f64, max: u32) -> u32 {
    ((length as f64 * scale).round() as u64).clamp(1, u64::from(max.max(1))) as u32
}

/// `tokens` tokens of text in blocks of `block` tokens: block j's text comes
/// from `ids[j]` alone (cut short for the last block); blocks beyond the ids
/// get text unique to this request (`unique` = seed, request index).
pub fn prompt_from_blocks(ids: &[u64], tokens: u32, block: u32, unique: (u64, u64)) -> String {
    let mut prompt = String::with_capacity(tokens as usize * 4);
    let mut left = tokens;
    let mut j = 0u64;
    while left > 0 {
        let take = left.min(block);
        let seed = match ids.get(j as usize) {
            Some(id) => text::seed_of(&[TAG, *id]),
            None => text::seed_of(&[TAG, u64::MAX, unique.0, unique.1, j]),
        };
        prompt.push_str(&text::words(seed, take));
        left -= take;
        j += 1;
    }
    prompt
}

#[cfg(test)]
mod tests {
    use super::*;

    const SAMPLE: &str = r#"
{"timestamp": 0, "input_length": 1100, "output_length": 40, "hash_ids": [1, 2, 3]}
{"timestamp": 500, "input_length": 700, "output_length": 10, "hash_ids": [1, 2], "extra": "ignored"}

{"timestamp": 2000.5, "input_length": 600, "output_length": 20, "hash_ids": [7, 8]}
"#;

    fn shape() -> Shape {
        Shape {
            rate: 2.0,
            duration_s: 10.0,
            seed: 1,
            max_prompt: 8000,
            max_output: 1024,
        }
    }

    fn source(scale: f64) -> ReplaySource {
        ReplaySource {
            file: None,
            input_scale: scale,
            output_scale: 1.0,
        }
    }

    #[test]
    fn parses_the_format_and_reports_bad_lines() {
        let lines = parse(SAMPLE, "t").unwrap();
        assert_eq!(lines.len(), 3);
        assert_eq!(lines[1].hash_ids, vec![1, 2]);
        let err = parse("{\"timestamp\": 1}\n", "f.jsonl").unwrap_err();
        assert!(err.starts_with("f.jsonl:1:"), "{err}");
        assert!(parse("\n\n", "e").is_err());
        assert!(parse("not json", "x").unwrap_err().contains("x:1"));
    }

    #[test]
    fn shared_ids_give_shared_text_and_lengths_scale() {
        let lines = parse(SAMPLE, "t").unwrap();
        let requests = from_lines(&lines, &source(0.5), &shape());
        let text = |r: &OpenRequest| -> String {
            let v: serde_json::Value = serde_json::from_slice(&r.body).unwrap();
            v["text"].as_str().unwrap().to_string()
        };
        let (a, b, c) = (text(&requests[0]), text(&requests[1]), text(&requests[2]));
        assert_eq!(requests[0].input_tokens, 550);
        assert_eq!(text::count_tokens(&a), 550);
        assert_eq!(text::count_tokens(&b), 350);
        // Blocks of 256 tokens: the second request's two blocks (the second
        // cut to 94 tokens) are the first request's opening.
        assert!(a.starts_with(&b));
        assert_ne!(a[..1024], c[..1024]);
        // Times rescaled: 3 lines over 2.0005 s of trace at 2 req/s -> 1 s apart on average.
        assert_eq!(requests[0].at_s, 0.0);
        assert!((requests[2].at_s - 1.0).abs() < 1e-9, "{}", requests[2].at_s);
    }

    #[test]
    fn blocks_beyond_the_ids_are_unique_and_lengths_are_clamped() {
        let p1 = prompt_from_blocks(&[5], 30, 10, (1, 1));
        let p2 = prompt_from_blocks(&[5], 30, 10, (1, 2));
        assert_eq!(p1[..40], p2[..40]);
        assert_ne!(p1[40..], p2[40..]);
        let lines = vec![TraceLine {
            timestamp: 0.0,
            input_length: 1_000_000,
            output_length: 0,
            hash_ids: vec![],
        }];
        let r = from_lines(&lines, &source(1.0), &shape());
        assert_eq!((r[0].input_tokens, r[0].output_tokens), (8000, 1));
    }

    #[test]
    fn a_file_window_depends_on_the_seed() {
        let dir = std::env::temp_dir().join(format!("dprank-replay-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("t.jsonl");
        let body: String = (0..200)
            .map(|i| format!("{{\"timestamp\": {}, \"input_length\": {}, \"output_length\": 5, \"hash_ids\": [{i}]}}\n", i * 100, 100 + i))
            .collect();
        std::fs::write(&path, body).unwrap();
        let src = ReplaySource {
            file: Some(path),
            ..source(1.0)
        };
        let first = |seed| requests(&src, &Shape { seed, ..shape() }).unwrap()[0].input_tokens;
        assert_eq!(requests(&src, &shape()).unwrap().len(), 20);
        let starts: std::collections::HashSet<u32> = (0..10).map(first).collect();
        assert!(starts.len() > 5, "{starts:?}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
