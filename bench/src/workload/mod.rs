//! What the benchmark sends: five workloads, each a deterministic function of
//! a seed, an arrival rate and a duration (in simulated seconds).
//!
//! - `no-prefix`: independent `/generate` requests, Poisson arrivals,
//!   ShareGPT-like lengths (the trace the earlier benchmarks used);
//! - `bursty`: the same requests, arrivals in bursts (a two-state modulated
//!   Poisson process with the same mean rate);
//! - `tenants`: chat requests whose long system prompt belongs to one of a
//!   few tenants with Zipf popularity (some very hot prefixes);
//! - `chat`: multi-turn sessions, closed loop: each turn carries the whole
//!   history, answers included, and is sent after the previous answer plus a
//!   think time;
//! - `replay`: a trace in the public block-hash format (JSONL with
//!   `timestamp`, `input_length`, `output_length`, `hash_ids`), prompt text
//!   generated from the block ids so equal ids give equal text.
//!
//! A plan holds open-loop requests (sent at their time whatever happens) and
//! closed-loop sessions (each turn waits for the previous answer).

pub mod bursty;
pub mod chat;
pub mod lengths;
pub mod no_prefix;
pub mod replay;
pub mod synth;
pub mod tenants;
pub mod text;

use std::path::PathBuf;

use bytes::Bytes;
use serde::{Deserialize, Serialize};

/// The model name the simulated workers serve (`dprank-sim --model`).
pub const MODEL: &str = "sim-model";

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, clap::ValueEnum, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum WorkloadKind {
    NoPrefix,
    Bursty,
    Tenants,
    Chat,
    Replay,
}

impl WorkloadKind {
    pub const ALL: [WorkloadKind; 5] = [
        WorkloadKind::NoPrefix,
        WorkloadKind::Bursty,
        WorkloadKind::Tenants,
        WorkloadKind::Chat,
        WorkloadKind::Replay,
    ];

    pub fn name(self) -> &'static str {
        match self {
            WorkloadKind::NoPrefix => "no-prefix",
            WorkloadKind::Bursty => "bursty",
            WorkloadKind::Tenants => "tenants",
            WorkloadKind::Chat => "chat",
            WorkloadKind::Replay => "replay",
        }
    }

    pub fn parse(name: &str) -> Result<WorkloadKind, String> {
        WorkloadKind::ALL
            .into_iter()
            .find(|k| k.name() == name)
            .ok_or_else(|| {
                format!(
                    "unknown workload `{name}`; known: {}",
                    WorkloadKind::ALL.map(|k| k.name()).join(", ")
                )
            })
    }
}

/// Which HTTP API a request uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Api {
    /// SGLang's native `POST /generate` (streamed SSE, cumulative text).
    Generate,
    /// OpenAI `POST /v1/chat/completions` (streamed deltas, usage chunk).
    Chat,
}

impl Api {
    pub fn path(self) -> &'static str {
        match self {
            Api::Generate => "/generate",
            Api::Chat => "/v1/chat/completions",
        }
    }
}

/// One open-loop request: sent at `at_s` simulated seconds.
#[derive(Debug, Clone)]
pub struct OpenRequest {
    pub at_s: f64,
    pub api: Api,
    pub body: Bytes,
    /// Prompt tokens as the simulator counts them.
    pub input_tokens: u32,
    pub output_tokens: u32,
    /// The tenant sending it, in workloads whose clients share a prompt
    /// (`tenants`); the load generator can keep a tenant on one gateway.
    pub tenant: Option<u32>,
}

/// One closed-loop chat session.
#[derive(Debug, Clone)]
pub struct Session {
    pub id: u32,
    pub start_s: f64,
    pub system: String,
    pub turns: Vec<Turn>,
}

#[derive(Debug, Clone)]
pub struct Turn {
    /// Simulated seconds between the previous answer's end and this turn
    /// (0 for the first turn).
    pub think_s: f64,
    pub user: String,
    pub output_tokens: u32,
}

/// Everything one run sends.
#[derive(Debug, Clone, Default)]
pub struct Plan {
    pub requests: Vec<OpenRequest>,
    pub sessions: Vec<Session>,
}

impl Plan {
    /// Requests the plan sends (open-loop requests plus every session turn).
    pub fn request_count(&self) -> usize {
        self.requests.len() + self.sessions.iter().map(|s| s.turns.len()).sum::<usize>()
    }

    /// When the last open-loop request arrives or the last session starts.
    pub fn last_arrival_s(&self) -> f64 {
        let last_request = self.requests.last().map(|r| r.at_s);
        let starts = self.sessions.iter().map(|s| s.start_s);
        last_request.into_iter().chain(starts).fold(0.0, f64::max)
    }
}

/// The arrival rate, length and bounds of one plan.
#[derive(Debug, Clone, Copy)]
pub struct Shape {
    /// Requests per simulated second (for `chat`: turns per second, nominal).
    pub rate: f64,
    /// Simulated seconds over which arrivals (or session starts) happen.
    pub duration_s: f64,
    pub seed: u64,
    /// Longest prompt any request may have (the workers' KV must hold it).
    pub max_prompt: u32,
    /// Longest output.
    pub max_output: u32,
}

/// How `replay` finds and scales its trace.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ReplaySource {
    /// A JSONL trace file; None: a synthetic trace generated from the seed
    /// (the generator of the committed sample, `dprank-bench make-trace`).
    pub file: Option<PathBuf>,
    /// Multiplies input lengths and the 512-token block size (real traces
    /// carry prompts far longer than a small simulated rank holds).
    pub input_scale: f64,
    /// Multiplies output lengths.
    pub output_scale: f64,
}

impl Default for ReplaySource {
    fn default() -> Self {
        ReplaySource {
            file: None,
            input_scale: replay::DEFAULT_INPUT_SCALE,
            output_scale: 1.0,
        }
    }
}

/// A workload with its options.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Workload {
    pub kind: WorkloadKind,
    pub replay: ReplaySource,
}

impl Workload {
    pub fn new(kind: WorkloadKind) -> Workload {
        Workload {
            kind,
            replay: ReplaySource::default(),
        }
    }

    /// The plan for one seed.
    pub fn plan(&self, shape: &Shape) -> Result<Plan, String> {
        if !(shape.rate.is_finite() && shape.rate > 0.0) {
            return Err(format!("arrival rate must be positive, got {}", shape.rate));
        }
        Ok(match self.kind {
            WorkloadKind::NoPrefix => Plan {
                requests: no_prefix::requests(shape)?,
                sessions: Vec::new(),
            },
            WorkloadKind::Bursty => Plan {
                requests: bursty::requests(shape)?,
                sessions: Vec::new(),
            },
            WorkloadKind::Tenants => Plan {
                requests: tenants::requests(shape)?,
                sessions: Vec::new(),
            },
            WorkloadKind::Chat => Plan {
                requests: Vec::new(),
                sessions: chat::sessions(shape)?,
            },
            WorkloadKind::Replay => Plan {
                requests: replay::requests(&self.replay, shape)?,
                sessions: Vec::new(),
            },
        })
    }

    /// One line for result files: the workload and its model.
    pub fn describe(&self) -> String {
        match self.kind {
            WorkloadKind::NoPrefix => no_prefix::DESCRIPTION.to_string(),
            WorkloadKind::Bursty => bursty::DESCRIPTION.to_string(),
            WorkloadKind::Tenants => tenants::DESCRIPTION.to_string(),
            WorkloadKind::Chat => chat::DESCRIPTION.to_string(),
            WorkloadKind::Replay => match &self.replay.file {
                Some(file) => format!(
                    "replay of {} (block-hash JSONL; input x {}, output x {}; a window of the trace per seed, timestamps rescaled to the offered rate)",
                    file.display(),
                    self.replay.input_scale,
                    self.replay.output_scale
                ),
                None => format!(
                    "replay of a synthetic block-hash trace generated per seed ({}; input x {}, output x {})",
                    synth::DESCRIPTION,
                    self.replay.input_scale,
                    self.replay.output_scale
                ),
            },
        }
    }
}

/// Request bodies, built with serde_json so every text is escaped.
pub mod bodies {
    use super::*;

    /// A `/generate` body asking for exactly `output` tokens.
    pub fn generate(text: &str, output: u32, stream: bool) -> Bytes {
        let body = serde_json::json!({
            "text": text,
            "sampling_params": {"max_new_tokens": output, "ignore_eos": true, "temperature": 0},
            "stream": stream,
        });
        Bytes::from(body.to_string())
    }

    /// A streamed `/v1/chat/completions` body (usage chunk asked for, so the
    /// response reports prompt and cached tokens).
    pub fn chat(messages: &[(&str, &str)], output: u32) -> Bytes {
        let messages: Vec<serde_json::Value> = messages
            .iter()
            .map(|(role, content)| serde_json::json!({"role": role, "content": content}))
            .collect();
        let body = serde_json::json!({
            "model": MODEL,
            "messages": messages,
            "max_tokens": output,
            "ignore_eos": true,
            "temperature": 0,
            "stream": true,
            "stream_options": {"include_usage": true},
        });
        Bytes::from(body.to_string())
    }

    /// A non-streamed `/generate` body of about `bytes` bytes (overhead runs).
    pub fn generate_of_size(bytes: usize) -> Bytes {
        let want = bytes.saturating_sub(generate("", 1, false).len()).max(1);
        // At least 2 bytes per token: enough text, then cut to size.
        let mut prompt = text::words(7, want.div_ceil(2) as u32);
        prompt.truncate(want);
        generate(&prompt, 1, false)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shape(seed: u64) -> Shape {
        Shape {
            rate: 8.0,
            duration_s: 30.0,
            seed,
            max_prompt: 8000,
            max_output: 1024,
        }
    }

    #[test]
    fn every_workload_is_deterministic_per_seed_and_differs_between_seeds() {
        for kind in WorkloadKind::ALL {
            let w = Workload::new(kind);
            let a = w.plan(&shape(1)).unwrap();
            let b = w.plan(&shape(1)).unwrap();
            let c = w.plan(&shape(2)).unwrap();
            let key = |p: &Plan| -> Vec<(u64, usize)> {
                p.requests
                    .iter()
                    .map(|r| ((r.at_s * 1e6) as u64, r.body.len()))
                    .chain(p.sessions.iter().flat_map(|s| {
                        s.turns
                            .iter()
                            .map(move |t| ((s.start_s * 1e6) as u64, t.user.len() + s.system.len()))
                    }))
                    .collect()
            };
            assert!(a.request_count() > 0, "{}", kind.name());
            assert_eq!(key(&a), key(&b), "{}", kind.name());
            assert_ne!(key(&a), key(&c), "{}", kind.name());
        }
    }

    #[test]
    fn open_loop_rates_are_near_the_asked_rate() {
        for kind in [
            WorkloadKind::NoPrefix,
            WorkloadKind::Bursty,
            WorkloadKind::Tenants,
            WorkloadKind::Replay,
        ] {
            let plan = Workload::new(kind)
                .plan(&Shape {
                    duration_s: 300.0,
                    ..shape(3)
                })
                .unwrap();
            let n = plan.requests.len() as f64;
            assert!((1800.0..3000.0).contains(&n), "{}: {n}", kind.name());
            assert!(plan.requests.windows(2).all(|w| w[0].at_s <= w[1].at_s));
            assert!(plan
                .requests
                .iter()
                .all(|r| r.input_tokens <= 8000 && r.output_tokens <= 1024));
        }
    }

    #[test]
    fn bodies_are_valid_json_with_the_asked_output() {
        let g: serde_json::Value =
            serde_json::from_slice(&bodies::generate("a \"quoted\" text", 5, true)).unwrap();
        assert_eq!(g["sampling_params"]["max_new_tokens"], 5);
        assert_eq!(g["text"], "a \"quoted\" text");
        let c: serde_json::Value =
            serde_json::from_slice(&bodies::chat(&[("system", "s"), ("user", "u")], 7)).unwrap();
        assert_eq!(c["messages"][1]["role"], "user");
        assert_eq!(c["max_tokens"], 7);
        assert_eq!(c["stream_options"]["include_usage"], true);
        let big = bodies::generate_of_size(100_000);
        assert!((99_000..101_000).contains(&big.len()), "{}", big.len());
    }

    #[test]
    fn workload_names_round_trip() {
        for kind in WorkloadKind::ALL {
            assert_eq!(WorkloadKind::parse(kind.name()), Ok(kind));
        }
        assert!(WorkloadKind::parse("nope").is_err());
    }
}
