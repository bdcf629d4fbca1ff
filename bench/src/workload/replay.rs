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
//! id alone, so equal ids give equal text and shared prefixes stay shared;
//! each prompt then ends with its answer tag (`super::answer_tag`).
//! Lengths are scaled (`input_scale` multiplies input lengths and the block
//! size alike, keeping the sharing structure) when production prompts are
//! longer than a simulated rank holds. Each seed replays a window of
//! `rate x duration` consecutive requests of the file ([`WINDOWS`]), with
//! timestamps rescaled so the window's mean rate is the offered rate.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use super::trace_format::{parse, TraceLine, BLOCK_TOKENS};
use super::{answer_tag, bodies, synth, text, Api, OpenRequest, OutputCap, Plan, Shape, TraceOptions};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

const TAG: u64 = 5;
/// Seeds from here on are judging seeds (`crate::suites::SeedSet`).
const FIRST_JUDGING_SEED: u64 = 101;
/// Seeds from here on measure capacities: windows from the whole file.
const FIRST_CAPACITY_SEED: u64 = 1_000_000;

/// How a seed's window of a trace file is chosen (said in every report).
pub const WINDOWS: &str = "windows of tuning seeds (1-100) lie in the first half of the file, of judging seeds (101 and up) in the second half, so the two sets replay different requests (a window longer than half the file is drawn from the whole file, and the report says so)";

type Loaded = Arc<Vec<TraceLine>>;
static LOADED: Mutex<Option<HashMap<PathBuf, Loaded>>> = Mutex::new(None);

/// The file's lines sorted by timestamp (read once per process).
pub fn load(path: &Path) -> Result<Loaded, String> {
    if let Some(lines) = LOADED
        .lock()
        .ok()
        .and_then(|cache| cache.as_ref()?.get(path).cloned())
    {
        return Ok(lines);
    }
    let text =
        std::fs::read_to_string(path).map_err(|e| format!("cannot read trace {}: {e}", path.display()))?;
    let mut lines = parse(&text, &path.display().to_string())?;
    lines.sort_by(|a, b| a.timestamp.total_cmp(&b.timestamp));
    let lines = Arc::new(lines);
    if let Ok(mut cache) = LOADED.lock() {
        cache
            .get_or_insert_with(HashMap::new)
            .insert(path.to_path_buf(), lines.clone());
    }
    Ok(lines)
}

/// `app-sessions`: a synthetic trace drawn from the seed, replayed whole.
pub fn generated(options: &TraceOptions, shape: &Shape, cap: OutputCap) -> Vec<OpenRequest> {
    let wanted = ((shape.rate * shape.duration_s).round() as usize).max(1);
    let lines = synth::generate(shape.seed, wanted);
    from_lines(&lines, options, shape, cap).0
}

/// The first line and the end of a seed's window of `wanted` of `len`
/// lines, and what the report must say about it.
pub fn window(len: usize, wanted: usize, seed: u64) -> (usize, usize, Vec<String>) {
    let half = len / 2;
    let (region, set) = match seed {
        s if s >= FIRST_CAPACITY_SEED => (0..len, "capacity"),
        s if s >= FIRST_JUDGING_SEED => (half..len, "judging"),
        _ => (0..half, "tuning"),
    };
    let mut notes = Vec::new();
    let region = if wanted <= region.len() {
        region
    } else {
        if set != "capacity" {
            notes.push(format!(
                "a window of {wanted} requests is longer than half the trace ({len}): drawn from the whole file, so tuning and judging windows overlap"
            ));
        }
        0..len
    };
    let window = wanted.min(region.len());
    if window < wanted {
        notes.push(format!(
            "the trace holds {len} requests: this run replays {window}, not the {wanted} its rate and length ask for"
        ));
    }
    let mut rng = StdRng::seed_from_u64(text::seed_of(&[TAG, seed]));
    let start = region.start + rng.random_range(0..=region.len() - window);
    (start, start + window, notes)
}

/// A trace file's window for this seed, as a plan.
pub fn from_file(path: &Path, options: &TraceOptions, shape: &Shape, cap: OutputCap) -> Result<Plan, String> {
    let lines = load(path)?;
    let wanted = ((shape.rate * shape.duration_s).round() as usize).max(1);
    let (start, end, mut notes) = window(lines.len(), wanted, shape.seed);
    let (requests, clamped) = from_lines(&lines[start..end], options, shape, cap);
    if clamped > 0 {
        notes.push(format!(
            "{clamped} of {} prompts (after scaling) were cut to the {}-token limit",
            requests.len(),
            shape.max_prompt
        ));
    }
    Ok(Plan {
        requests,
        sessions: Vec::new(),
        notes,
    })
}

/// Requests for `lines` (sorted by timestamp): times rescaled to
/// `shape.rate`, lengths scaled and clamped, text from the block ids, each
/// prompt ending with its answer tag; and how many prompts were clamped.
pub fn from_lines(
    lines: &[TraceLine],
    options: &TraceOptions,
    shape: &Shape,
    cap: OutputCap,
) -> (Vec<OpenRequest>, usize) {
    let Some(first) = lines.first() else {
        return (Vec::new(), 0);
    };
    let span_s = (lines[lines.len() - 1].timestamp - first.timestamp) / 1000.0;
    // Seconds of replay per second of trace.
    let stretch = if lines.len() > 1 && span_s > 0.0 {
        ((lines.len() - 1) as f64 / span_s) / shape.rate
    } else {
        0.0
    };
    let block = ((f64::from(BLOCK_TOKENS) * options.input_scale).round() as u32).max(1);
    let mut clamped = 0;
    let requests = lines
        .iter()
        .enumerate()
        .map(|(i, line)| {
            let at_s = if stretch > 0.0 {
                (line.timestamp - first.timestamp) / 1000.0 * stretch
            } else {
                i as f64 / shape.rate
            };
            let wanted = (line.input_length as f64 * options.input_scale).round();
            if wanted > f64::from(shape.max_prompt) {
                clamped += 1;
            }
            let input_tokens = scaled(line.input_length, options.input_scale, shape.max_prompt);
            let output_tokens = scaled(line.output_length, options.output_scale, shape.max_output);
            let (tag_text, tag_tokens, tag) = text::tag(answer_tag(&[TAG, shape.seed, i as u64]));
            let body_tokens = input_tokens.saturating_sub(tag_tokens).max(1);
            let mut prompt = prompt_from_blocks(&line.hash_ids, body_tokens, block, (shape.seed, i as u64));
            prompt.push_str(&tag_text);
            let max_tokens = cap.cap(output_tokens);
            OpenRequest {
                at_s,
                api: Api::Generate,
                body: bodies::generate(&prompt, max_tokens, true),
                input_tokens: body_tokens + tag_tokens,
                output_tokens,
                answer_tag: tag,
                tenant: None,
                high: None,
            }
        })
        .collect();
    (requests, clamped)
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

    fn source(scale: f64) -> TraceOptions {
        TraceOptions {
            input_scale: scale,
            ..TraceOptions::default()
        }
    }

    const CAP: OutputCap = OutputCap::Fixed(4096);

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
        let requests = from_lines(&lines, &source(0.5), &shape(), CAP).0;
        let text = |r: &OpenRequest| -> String {
            let v: serde_json::Value = serde_json::from_slice(&r.body).unwrap();
            v["text"].as_str().unwrap().to_string()
        };
        let (a, b, c) = (text(&requests[0]), text(&requests[1]), text(&requests[2]));
        assert_eq!(requests[0].input_tokens, 550);
        assert_eq!(text::count_tokens(&a), 550);
        assert_eq!(text::count_tokens(&b), 350);
        // Blocks of 256 tokens: the second request's two blocks (the second
        // cut short) are the first request's opening, up to its tag.
        let b_untagged = &b[..b.rfind(" zqxj").unwrap()];
        assert!(a.starts_with(b_untagged));
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
        let (r, clamped) = from_lines(&lines, &source(1.0), &shape(), CAP);
        assert_eq!((r[0].input_tokens, r[0].output_tokens, clamped), (8000, 1, 1));
        // The cap is what a client sends, not the answer's length.
        let body: serde_json::Value = serde_json::from_slice(&r[0].body).unwrap();
        assert_eq!(body["sampling_params"]["max_new_tokens"], 4096);
        assert!(body.get("ignore_eos").is_none() && body["sampling_params"].get("ignore_eos").is_none());
    }

    #[test]
    fn a_file_window_depends_on_the_seed_and_its_set() {
        let dir = std::env::temp_dir().join(format!("dprank-replay-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("t.jsonl");
        let body: String = (0..200)
            .map(|i| format!("{{\"timestamp\": {}, \"input_length\": {}, \"output_length\": 5, \"hash_ids\": [{i}]}}\n", i * 100, 100 + i))
            .collect();
        std::fs::write(&path, body).unwrap();
        let plan = |seed| from_file(&path, &source(1.0), &Shape { seed, ..shape() }, CAP).unwrap();
        assert_eq!(plan(1).requests.len(), 20);
        assert!(plan(1).notes.is_empty());
        // Input lengths are 100 + the line's index (the tag included).
        let first = |seed| plan(seed).requests[0].input_tokens - 100;
        let tuning: std::collections::HashSet<u32> = (1..=10).map(first).collect();
        let judging: std::collections::HashSet<u32> = (101..=110).map(first).collect();
        assert!(tuning.len() > 5 && judging.len() > 5, "{tuning:?} {judging:?}");
        // Tuning windows end in the first half, judging windows start in the second.
        assert!(tuning.iter().all(|i| i + 20 <= 100), "{tuning:?}");
        assert!(judging.iter().all(|i| *i >= 100), "{judging:?}");
        // A window longer than half the file is drawn from the whole and says so.
        let long = from_file(
            &path,
            &source(1.0),
            &Shape {
                seed: 1,
                duration_s: 60.0,
                ..shape()
            },
            CAP,
        )
        .unwrap();
        assert_eq!(long.requests.len(), 120);
        assert!(long.notes[0].contains("overlap"), "{:?}", long.notes);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
