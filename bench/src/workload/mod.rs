//! What the benchmark sends: workloads, each a deterministic function of
//! a seed, an arrival rate and a duration (in simulated seconds).
//!
//! Synthetic (generated here):
//! - `no-prefix`: independent `/generate` requests, Poisson arrivals,
//!   ShareGPT-like lengths;
//! - `bursty`: the same requests, arrivals in bursts (a two-state modulated
//!   Poisson process with the same mean rate);
//! - `tenants`: chat requests whose long system prompt belongs to one of a
//!   few tenants with Zipf popularity (some very hot prefixes);
//! - `chat`: multi-turn sessions, closed loop: each turn carries the whole
//!   history, answers included, and is sent after the previous answer plus a
//!   think time;
//! - `app-sessions`: a generated trace in the public block-hash format
//!   (applications with system prompts, multi-turn sessions), replayed.
//!
//! Public traces (replayed, `traces.rs`): the Mooncake FAST'25 conversation,
//! synthetic and tool-and-agent traces, and any block-hash file
//! (`trace-file`).
//!
//! Every request is what a client sends: EOS on (no `ignore_eos`), and
//! `max_new_tokens` / `max_tokens` a cap ([`OutputCap`]), never the answer's
//! true length. Where the simulated answer ends is a property of the prompt:
//! each prompt ends with an opaque tag (`dprank_sim::answers`) and the plan's
//! [`Plan::answers`] go to the simulator out of band, where no router reads
//! them.
//!
//! A plan holds open-loop requests (sent at their time whatever happens) and
//! closed-loop sessions (each turn waits for the previous answer).

pub mod bursty;
pub mod chat;
pub mod lengths;
pub mod no_prefix;
pub mod replay;
pub mod switching;
pub mod synth;
pub mod tenants;
pub mod text;
pub mod trace_format;
pub mod traces;

use bytes::Bytes;
use serde::{Deserialize, Serialize};

pub use traces::TraceOptions;

/// The model name the simulated workers serve (`dprank-sim --model`).
pub const MODEL: &str = "sim-model";

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum WorkloadKind {
    NoPrefix,
    Bursty,
    Tenants,
    Chat,
    /// The block-hash session generator (`synth.rs`), replayed.
    AppSessions,
    /// Mooncake FAST'25 `conversation_trace.jsonl`.
    MooncakeConversation,
    /// Mooncake FAST'25 `synthetic_trace.jsonl` (a published trace file).
    MooncakeSynthetic,
    /// Mooncake FAST'25 `toolagent_trace.jsonl`.
    MooncakeToolagent,
    /// Any block-hash trace file (`--replay-trace FILE`).
    TraceFile,
    /// `no-prefix`, `bursty` and the Mooncake conversation trace in turn
    /// (`switching.rs`).
    Switching,
}

impl WorkloadKind {
    /// The synthetic workloads: what suites run when none are named.
    pub const SYNTHETIC: [WorkloadKind; 5] = [
        WorkloadKind::NoPrefix,
        WorkloadKind::Bursty,
        WorkloadKind::Tenants,
        WorkloadKind::Chat,
        WorkloadKind::AppSessions,
    ];
    /// The public traces available on this machine and in `make bench`
    /// (the tool-and-agent trace is accepted when given, not run by default).
    pub const PUBLIC_TRACES: [WorkloadKind; 2] = [
        WorkloadKind::MooncakeConversation,
        WorkloadKind::MooncakeSynthetic,
    ];
    pub const ALL: [WorkloadKind; 10] = [
        WorkloadKind::NoPrefix,
        WorkloadKind::Bursty,
        WorkloadKind::Tenants,
        WorkloadKind::Chat,
        WorkloadKind::AppSessions,
        WorkloadKind::MooncakeConversation,
        WorkloadKind::MooncakeSynthetic,
        WorkloadKind::MooncakeToolagent,
        WorkloadKind::TraceFile,
        WorkloadKind::Switching,
    ];

    pub fn name(self) -> &'static str {
        match self {
            WorkloadKind::NoPrefix => "no-prefix",
            WorkloadKind::Bursty => "bursty",
            WorkloadKind::Tenants => "tenants",
            WorkloadKind::Chat => "chat",
            WorkloadKind::AppSessions => "app-sessions",
            WorkloadKind::MooncakeConversation => "mooncake-conversation",
            WorkloadKind::MooncakeSynthetic => "mooncake-synthetic",
            WorkloadKind::MooncakeToolagent => "mooncake-toolagent",
            WorkloadKind::TraceFile => "trace-file",
            WorkloadKind::Switching => "switching",
        }
    }

    /// Parses a name; `replay` (the earlier name of the session generator)
    /// is `app-sessions`.
    pub fn parse(name: &str) -> Result<WorkloadKind, String> {
        if name == "replay" {
            return Ok(WorkloadKind::AppSessions);
        }
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

    /// Whether the requests come from a recorded trace (not a generator).
    pub fn is_trace(self) -> bool {
        self.trace_file().is_some() || self == WorkloadKind::TraceFile
    }

    /// The Mooncake trace this workload replays.
    pub fn trace_file(self) -> Option<&'static traces::PublicTrace> {
        let name = match self {
            WorkloadKind::MooncakeConversation => "conversation_trace.jsonl",
            WorkloadKind::MooncakeSynthetic => "synthetic_trace.jsonl",
            WorkloadKind::MooncakeToolagent => "toolagent_trace.jsonl",
            _ => return None,
        };
        traces::MOONCAKE.iter().find(|t| t.file == name)
    }

    /// Whether its prompts use the block-hash format (scaled by the trace
    /// input scale).
    pub fn is_block_hash(self) -> bool {
        self.is_trace() || self == WorkloadKind::AppSessions
    }
}

/// Which HTTP API a request uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Api {
    /// SGLang's native `POST /generate` (streamed SSE, cumulative text).
    Generate,
    /// OpenAI `POST /v1/chat/completions` (streamed deltas, usage chunk).
    Chat,
    /// OpenAI `POST /v1/completions` (streamed text, usage chunk): what a
    /// `/generate` request becomes for a vLLM server.
    Completions,
}

impl Api {
    pub fn path(self) -> &'static str {
        match self {
            Api::Generate => "/generate",
            Api::Chat => "/v1/chat/completions",
            Api::Completions => "/v1/completions",
        }
    }
}

/// What a client sends as `max_new_tokens` / `max_tokens`: a cap, never the
/// answer's length.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum OutputCap {
    /// The same cap on every request (a client's default).
    Fixed(u32),
    /// `k` x the answer's length, rounded up (clients that size their cap
    /// to the task, with room to spare).
    Multiple(f64),
}

impl OutputCap {
    /// The cap per workload, as its clients would send it (bench/README.md,
    /// "Requests"): API clients of `/generate` send a round default above
    /// their longest expected answer (2048: the synthetic answers end by
    /// 1024); chat applications send 4096 or nothing (SGLang then reserves
    /// for up to 4096 alike); the traces come from a chat service (Kimi).
    pub fn default_for(kind: WorkloadKind) -> OutputCap {
        match kind {
            WorkloadKind::NoPrefix | WorkloadKind::Bursty | WorkloadKind::Tenants => OutputCap::Fixed(2048),
            // Each part sends its own cap (`switching::part`); this one is unused.
            WorkloadKind::Switching => OutputCap::Fixed(2048),
            _ => OutputCap::Fixed(4096),
        }
    }

    /// `N` (fixed) or `xK` (a multiple of the answer).
    pub fn parse(text: &str) -> Result<OutputCap, String> {
        let bad = || format!("output cap `{text}`: a token count (2048) or a multiple of the answer (x4)");
        match text.strip_prefix('x') {
            Some(k) => k
                .parse::<f64>()
                .ok()
                .filter(|k| k.is_finite() && *k >= 1.0)
                .map(OutputCap::Multiple)
                .ok_or_else(bad),
            None => text
                .parse::<u32>()
                .ok()
                .filter(|n| *n >= 1)
                .map(OutputCap::Fixed)
                .ok_or_else(bad),
        }
    }

    /// The cap sent with an answer of `answer` tokens.
    pub fn cap(self, answer: u32) -> u32 {
        match self {
            OutputCap::Fixed(n) => n.max(1),
            OutputCap::Multiple(k) => (f64::from(answer.max(1)) * k).ceil().min(f64::from(u32::MAX)) as u32,
        }
    }

    pub fn describe(self) -> String {
        match self {
            OutputCap::Fixed(n) => format!("max tokens {n} on every request"),
            OutputCap::Multiple(k) => format!("max tokens {k} x the answer's length"),
        }
    }
}

/// The opaque answer tag of one request (`dprank_sim::answers`): a hash of
/// what identifies it, never of its length.
pub fn answer_tag(parts: &[u64]) -> u64 {
    let mut all = vec![0x7a67_a115];
    all.extend_from_slice(parts);
    text::seed_of(&all)
}

/// One open-loop request: sent at `at_s` simulated seconds.
#[derive(Debug, Clone)]
pub struct OpenRequest {
    pub at_s: f64,
    pub api: Api,
    pub body: Bytes,
    /// Prompt tokens as the simulator counts them.
    pub input_tokens: u32,
    /// The answer's length: where the simulated model stops (out of band).
    pub output_tokens: u32,
    /// The tag ending its prompt (`dprank_sim::answers::tag_letters`).
    pub answer_tag: String,
    /// The tenant sending it, in workloads whose clients share a prompt
    /// (`tenants`); the load generator can keep a tenant on one gateway.
    pub tenant: Option<u32>,
    /// Its priority class when the run has two (`Plan::assign_classes`):
    /// true for the high class. Sent as the priority header.
    pub high: Option<bool>,
}

/// The priority header and its values for the two classes
/// (dprank's default classes: `critical` above `standard`).
pub const PRIORITY_HEADER: &str = "x-dprank-priority";
pub const HIGH_CLASS: &str = "critical";
pub const LOW_CLASS: &str = "standard";

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
    /// The user message, ending with its answer tag.
    pub user: String,
    /// The answer's length (out of band).
    pub output_tokens: u32,
    /// The cap the body carries.
    pub max_tokens: u32,
    pub answer_tag: String,
}

/// Everything one run sends.
#[derive(Debug, Clone, Default)]
pub struct Plan {
    pub requests: Vec<OpenRequest>,
    pub sessions: Vec<Session>,
    /// Facts a report must say about this plan (a trace window that had to
    /// overlap others, say).
    pub notes: Vec<String>,
}

impl Plan {
    /// The plan for servers without SGLang's `/generate` (vLLM): every
    /// `/generate` request becomes the same prompt, cap and streaming on
    /// `/v1/completions`; chat is unchanged.
    pub fn to_openai(&self) -> Plan {
        let mut plan = self.clone();
        for request in &mut plan.requests {
            if request.api != Api::Generate {
                continue;
            }
            let Ok(value) = serde_json::from_slice::<serde_json::Value>(&request.body) else {
                continue;
            };
            let text = value.get("text").and_then(|t| t.as_str()).unwrap_or_default();
            let cap = value
                .pointer("/sampling_params/max_new_tokens")
                .and_then(|n| n.as_u64())
                .unwrap_or(1) as u32;
            let stream = value.get("stream").and_then(|s| s.as_bool()).unwrap_or(false);
            request.body = bodies::completions(text, cap, stream);
            request.api = Api::Completions;
        }
        plan
    }

    /// Requests the plan sends (open-loop requests plus every session turn).
    pub fn request_count(&self) -> usize {
        self.requests.len() + self.sessions.iter().map(|s| s.turns.len()).sum::<usize>()
    }

    /// Puts a `high_share` of the open-loop requests in the high class,
    /// drawn from (seed, index) alone: every variant of a seed gets the same
    /// classes.
    pub fn assign_classes(&mut self, high_share: f64, seed: u64) {
        for (i, r) in self.requests.iter_mut().enumerate() {
            let draw = text::seed_of(&[0xC1A5, seed, i as u64]) % 1_000_000;
            r.high = Some((draw as f64) < high_share * 1_000_000.0);
        }
    }

    /// When the last open-loop request arrives or the last session starts.
    pub fn last_arrival_s(&self) -> f64 {
        let last_request = self.requests.last().map(|r| r.at_s);
        let starts = self.sessions.iter().map(|s| s.start_s);
        last_request.into_iter().chain(starts).fold(0.0, f64::max)
    }

    /// Each request's answer length by its tag: what the simulator is told
    /// out of band (`POST /_sim/answers`).
    pub fn answers(&self) -> Vec<(&str, u32)> {
        self.requests
            .iter()
            .map(|r| (r.answer_tag.as_str(), r.output_tokens))
            .chain(
                self.sessions
                    .iter()
                    .flat_map(|s| s.turns.iter().map(|t| (t.answer_tag.as_str(), t.output_tokens))),
            )
            .collect()
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
    /// Longest answer.
    pub max_output: u32,
}

/// A workload with its options.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Workload {
    pub kind: WorkloadKind,
    pub trace: TraceOptions,
    pub cap: OutputCap,
    /// `switching` only: the trace's rate as a share of the plan's (its
    /// sustainable capacity ÷ `no-prefix`'s), set by the suite.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub trace_rate_share: Option<f64>,
}

impl Workload {
    pub fn new(kind: WorkloadKind) -> Workload {
        Workload {
            kind,
            trace: TraceOptions::default(),
            cap: OutputCap::default_for(kind),
            trace_rate_share: None,
        }
    }

    /// The workload's name as tables show it (a trace file's with its name).
    pub fn name(&self) -> String {
        match (self.kind, &self.trace.file) {
            (WorkloadKind::TraceFile, Some(file)) => format!(
                "trace-file:{}",
                file.file_name()
                    .map_or(String::new(), |f| f.to_string_lossy().into_owned())
            ),
            (kind, _) => kind.name().to_string(),
        }
    }

    /// The plan for one seed.
    pub fn plan(&self, shape: &Shape) -> Result<Plan, String> {
        if !(shape.rate.is_finite() && shape.rate > 0.0) {
            return Err(format!("arrival rate must be positive, got {}", shape.rate));
        }
        let open = |requests| Plan {
            requests,
            ..Plan::default()
        };
        Ok(match self.kind {
            WorkloadKind::NoPrefix => open(no_prefix::requests(shape, self.cap)?),
            WorkloadKind::Bursty => open(bursty::requests(shape, self.cap)?),
            WorkloadKind::Tenants => open(tenants::requests(shape, self.cap)?),
            WorkloadKind::Chat => Plan {
                sessions: chat::sessions(shape, self.cap)?,
                ..Plan::default()
            },
            WorkloadKind::AppSessions => open(replay::generated(&self.trace, shape, self.cap)),
            WorkloadKind::Switching => switching::plan(self, shape)?,
            kind => {
                let path = self.trace.path_of(kind)?;
                replay::from_file(&path, &self.trace, shape, self.cap)?
            }
        })
    }

    /// Where the requests come from, for every report: a generator here, or
    /// a recorded trace.
    pub fn source(&self) -> String {
        match self.kind {
            kind if kind.trace_file().is_some() => {
                format!("real: public trace {}", kind.trace_file().map_or("", |t| t.label))
            }
            WorkloadKind::TraceFile => "recorded: trace file".to_string(),
            WorkloadKind::Switching => format!(
                "synthetic and real: generated by the bench, and the public trace {}",
                WorkloadKind::MooncakeConversation
                    .trace_file()
                    .map_or("", |t| t.label)
            ),
            _ => "synthetic: generated by the bench".to_string(),
        }
    }

    /// One line for result files: the workload, its model and its cap.
    pub fn describe(&self) -> String {
        let scaled = || {
            format!(
                "input lengths and blocks x {}, outputs x {}",
                self.trace.input_scale, self.trace.output_scale
            )
        };
        let what = match self.kind {
            WorkloadKind::NoPrefix => no_prefix::DESCRIPTION.to_string(),
            WorkloadKind::Bursty => bursty::DESCRIPTION.to_string(),
            WorkloadKind::Tenants => tenants::DESCRIPTION.to_string(),
            WorkloadKind::Chat => chat::DESCRIPTION.to_string(),
            WorkloadKind::Switching => format!(
                "{} ({scale}; the trace at {share} x the synthetic parts' rate)",
                switching::DESCRIPTION,
                scale = scaled(),
                share = self.trace_rate_share.map_or("an unset share".into(), |s| format!("{s:.3}")),
            ),
            WorkloadKind::AppSessions => format!(
                "a block-hash trace generated per seed and replayed ({}; {})",
                synth::DESCRIPTION,
                scaled()
            ),
            kind => format!(
                "replay of {} (block-hash JSONL; {}; a window of the trace per seed, {}, timestamps rescaled to the offered rate)",
                // The file's name only: where it lies is the machine's business.
                self.trace.path_of(kind).map_or_else(
                    |e| e,
                    |p| p.file_name().map_or(String::new(), |f| f.to_string_lossy().into_owned())
                ),
                scaled(),
                replay::WINDOWS
            ),
        };
        format!(
            "{what}; {}; answers end at their own length (EOS)",
            self.cap.describe()
        )
    }
}

/// Request bodies, built with serde_json so every text is escaped. No
/// `ignore_eos`: answers end at their EOS; `max_tokens` is only a cap.
pub mod bodies {
    use super::*;

    /// A `/generate` body with the cap `max_new_tokens`.
    pub fn generate(text: &str, max_new_tokens: u32, stream: bool) -> Bytes {
        let body = serde_json::json!({
            "text": text,
            "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0},
            "stream": stream,
        });
        Bytes::from(body.to_string())
    }

    /// A streamed `/v1/chat/completions` body (usage chunk asked for, so the
    /// response reports prompt and cached tokens) with the cap `max_tokens`.
    pub fn chat(messages: &[(&str, &str)], max_tokens: u32) -> Bytes {
        let messages: Vec<serde_json::Value> = messages
            .iter()
            .map(|(role, content)| serde_json::json!({"role": role, "content": content}))
            .collect();
        let body = serde_json::json!({
            "model": MODEL,
            "messages": messages,
            "max_tokens": max_tokens,
            "temperature": 0,
            "stream": true,
            "stream_options": {"include_usage": true},
        });
        Bytes::from(body.to_string())
    }

    /// A `/v1/completions` body with the cap `max_tokens` (streamed: the
    /// usage chunk asked for, so the response reports prompt and cached
    /// tokens).
    pub fn completions(prompt: &str, max_tokens: u32, stream: bool) -> Bytes {
        let mut body = serde_json::json!({
            "model": MODEL,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0,
            "stream": stream,
        });
        if stream {
            body["stream_options"] = serde_json::json!({"include_usage": true});
        }
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
        for kind in WorkloadKind::SYNTHETIC {
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
            WorkloadKind::AppSessions,
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
        assert_eq!(WorkloadKind::parse("replay"), Ok(WorkloadKind::AppSessions));
        assert!(WorkloadKind::parse("nope").is_err());
        assert!(WorkloadKind::MooncakeConversation.is_trace() && WorkloadKind::TraceFile.is_trace());
        assert!(!WorkloadKind::AppSessions.is_trace() && WorkloadKind::AppSessions.is_block_hash());
        assert!(Workload::new(WorkloadKind::MooncakeSynthetic)
            .source()
            .starts_with("real"));
        assert!(Workload::new(WorkloadKind::AppSessions)
            .source()
            .starts_with("synthetic"));
    }

    /// What a router can read of a request: its body.
    fn visible(plan: &Plan) -> Vec<serde_json::Value> {
        let mut out: Vec<serde_json::Value> = plan
            .requests
            .iter()
            .map(|r| serde_json::from_slice(&r.body).unwrap())
            .collect();
        for s in &plan.sessions {
            for t in &s.turns {
                out.push(
                    serde_json::from_slice(&bodies::chat(
                        &[("system", &s.system), ("user", &t.user)],
                        t.max_tokens,
                    ))
                    .unwrap(),
                );
            }
        }
        out
    }

    #[test]
    fn requests_carry_a_cap_and_eos_never_the_answers_length() {
        for kind in WorkloadKind::SYNTHETIC {
            let w = Workload::new(kind);
            let plan = w.plan(&shape(4)).unwrap();
            let answers = plan.answers();
            assert_eq!(answers.len(), plan.request_count(), "{}", kind.name());
            let tags: std::collections::HashSet<&str> = answers.iter().map(|a| a.0).collect();
            assert_eq!(tags.len(), answers.len(), "{}: tags are unique", kind.name());
            for (body, (tag, length)) in visible(&plan).iter().zip(&answers) {
                let text = body.to_string();
                assert!(!text.contains("ignore_eos"), "{}: {text}", kind.name());
                let cap = body
                    .pointer("/sampling_params/max_new_tokens")
                    .or_else(|| body.get("max_tokens"))
                    .and_then(serde_json::Value::as_u64)
                    .unwrap();
                assert_eq!(cap, u64::from(w.cap.cap(*length)), "{}", kind.name());
                assert!(cap > u64::from(*length), "{}: cap {cap} vs {length}", kind.name());
                assert!(
                    text.contains(tag),
                    "{}: the prompt ends with its tag",
                    kind.name()
                );
            }
        }
    }

    #[test]
    fn what_a_router_sees_does_not_change_with_the_answers_lengths() {
        // The same trace with answers twice as long: identical bodies, other lengths.
        let short = Workload::new(WorkloadKind::AppSessions);
        let mut long = short.clone();
        long.trace.output_scale = 2.0;
        let (a, b) = (short.plan(&shape(6)).unwrap(), long.plan(&shape(6)).unwrap());
        assert_eq!(visible(&a), visible(&b));
        let lengths = |p: &Plan| p.answers().iter().map(|a| a.1).collect::<Vec<_>>();
        assert_ne!(lengths(&a), lengths(&b));
        // A multiple of the length is a cap too, and parses back.
        assert_eq!(OutputCap::parse("x4"), Ok(OutputCap::Multiple(4.0)));
        assert_eq!(OutputCap::parse("2048"), Ok(OutputCap::Fixed(2048)));
        assert!(OutputCap::parse("x0.5").is_err() && OutputCap::parse("0").is_err());
        assert_eq!(OutputCap::Multiple(4.0).cap(100), 400);
    }
}
