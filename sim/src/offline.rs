//! The model driven in virtual time: no HTTP, no sleeping, deterministic.
//! Submit requests at virtual times, advance the clock, read the loads as
//! `/v1/loads` would answer them, and get each request's first token and
//! finish with their times.
//!
//! ```
//! use dprank_sim::offline::{Fleet, Prompt, Request};
//! use dprank_sim::SimConfig;
//!
//! let mut fleet = Fleet::new(SimConfig::default(), 2).unwrap();
//! let id = fleet
//!     .submit(0.0, 0, Request::new(Prompt::Text("Hello there".into()), 8))
//!     .unwrap();
//! let reports = fleet.run_until(10.0);
//! assert!(reports.iter().any(|report| report.req == id && report.finished));
//! let loads = fleet.v1_loads(0);
//! // The default cost model: a DeepSeek-V3-class node of 8 ranks.
//! assert_eq!(loads["dp_rank_count"], 8);
//! ```

use std::collections::{BTreeSet, HashMap};
use std::time::{Duration, SystemTime};

use serde_json::Value;

use crate::chat::{self, Message};
use crate::config::SimConfig;
use crate::engine::{self, Arrival, Event, EventKind, Micros, RankSnapshot, ReqId};
use crate::loads::{self, LoadView};
use crate::metrics::{self, Garble, MetricsView};
use crate::{protocol, tokenizer};

/// A prompt as a client sends it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Prompt {
    /// `/generate` `text` or `/v1/completions` `prompt`.
    Text(String),
    /// `/v1/chat/completions` `messages`.
    Chat(Vec<Message>),
    /// `input_ids`: taken as given, nothing to tokenize.
    Tokens(Vec<u32>),
}

/// One request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Request {
    pub prompt: Prompt,
    /// The client's cap; admission reserves from it.
    pub max_new_tokens: u64,
    /// Where the answer ends (the simulated model's EOS), if known; None
    /// runs to `max_new_tokens`. Given apart from the prompt, as
    /// `/_sim/answers` gives it to the HTTP server (`crate::answers`).
    pub answer_tokens: Option<u64>,
    /// The rank the request names (`routed_dp_rank`), if any: the worker's
    /// local index, whatever its start rank.
    pub rank: Option<usize>,
    /// vLLM mode: the `X-data-parallel-rank` header it carries, read as the
    /// server's frontend reads it (`--vllm-frontend`: a local index for
    /// Python, a global rank for Rust); `rank` wins if both are set.
    pub rank_header: Option<String>,
    /// Its `priority`, if it sent one.
    pub priority: Option<i64>,
}

impl Request {
    pub fn new(prompt: Prompt, max_new_tokens: u64) -> Self {
        Self {
            prompt,
            max_new_tokens,
            answer_tokens: None,
            rank: None,
            rank_header: None,
            priority: None,
        }
    }

    /// vLLM mode: sends `X-data-parallel-rank: value` (see `rank_header`).
    pub fn with_rank_header(mut self, value: impl Into<String>) -> Self {
        self.rank_header = Some(value.into());
        self
    }

    /// The answer ends after `tokens` tokens (or at the cap, if lower).
    pub fn answer_after(mut self, tokens: u64) -> Self {
        self.answer_tokens = Some(tokens);
        self
    }

    pub fn on_rank(mut self, rank: usize) -> Self {
        self.rank = Some(rank);
        self
    }

    pub fn with_priority(mut self, priority: i64) -> Self {
        self.priority = Some(priority);
        self
    }
}

/// What happened to a request: its first token, then its finish.
#[derive(Debug, Clone, PartialEq)]
pub struct Report {
    pub req: ReqId,
    /// Virtual time in seconds.
    pub at: f64,
    pub worker: usize,
    pub rank: usize,
    /// false: first token; true: the request finished.
    pub finished: bool,
    pub prompt_tokens: u64,
    pub cached_tokens: u64,
    pub completion_tokens: u64,
}

#[derive(Debug)]
struct Tracked {
    prompt_tokens: u64,
    /// Output tokens it will produce (its answer, at most the cap).
    output: u64,
    first_seen: bool,
    open: usize,
    cached_tokens: u64,
    worker: usize,
    rank: usize,
}

/// A fleet of simulated servers in virtual time.
#[derive(Debug)]
pub struct Fleet {
    config: SimConfig,
    engine: engine::Fleet,
    now: Micros,
    /// Steps in progress by end time: (end, worker, group).
    step_ends: BTreeSet<(Micros, usize, usize)>,
    tracked: HashMap<ReqId, Tracked>,
    reports: Vec<Report>,
    events: Vec<Event>,
    retractions: Vec<(ReqId, f64)>,
}

fn micros(seconds: f64) -> Micros {
    (seconds.max(0.0) * 1e6).round() as Micros
}

fn seconds(at: Micros) -> f64 {
    at as f64 / 1e6
}

impl Fleet {
    /// `workers` servers, each with `config.dp_size` ranks. `time_scale`,
    /// `instant` and the HTTP-only options play no part.
    pub fn new(config: SimConfig, workers: usize) -> Result<Self, String> {
        config.validate()?;
        config.validate_workers(workers)?;
        let mut engine = engine::Fleet::new(&config, workers);
        engine.set_every_token(false);
        Ok(Self {
            config,
            engine,
            now: 0,
            step_ends: BTreeSet::new(),
            tracked: HashMap::new(),
            reports: Vec::new(),
            events: Vec::new(),
            retractions: Vec::new(),
        })
    }

    /// The current virtual time in seconds.
    pub fn now(&self) -> f64 {
        seconds(self.now)
    }

    /// Submits a request arriving at `worker` at virtual time `at` (not
    /// before `now()`); time advances to `at` first.
    pub fn submit(&mut self, at: f64, worker: usize, request: Request) -> Result<ReqId, String> {
        let at = micros(at);
        if at < self.now {
            return Err(format!(
                "requests must be submitted in time order ({} s is before now, {} s)",
                seconds(at),
                seconds(self.now)
            ));
        }
        if worker >= self.engine.workers() {
            return Err(format!("worker {worker} does not exist"));
        }
        if let Some(rank) = request.rank {
            if rank >= self.engine.dp_size() {
                return Err(format!(
                    "rank {rank} is out of range [0, {})",
                    self.engine.dp_size()
                ));
            }
        }
        let rank = match (request.rank, &request.rank_header) {
            (Some(rank), _) => Some(rank),
            (None, Some(value)) => self.header_rank(worker, value)?,
            (None, None) => None,
        };
        self.advance(at);
        let (prompt, pretokenized) = match request.prompt {
            Prompt::Text(text) => (tokenizer::tokens(&text), false),
            Prompt::Chat(messages) => (tokenizer::tokens(&chat::template(&messages)), false),
            Prompt::Tokens(ids) => (ids, true),
        };
        let prompt_tokens = prompt.len().max(1) as u64;
        let prompt = if prompt.is_empty() { vec![0] } else { prompt };
        let Some(max_new) = self.config.fit_output(prompt_tokens, request.max_new_tokens) else {
            return Err(format!(
                "the input ({prompt_tokens} tokens) is longer than the KV cache capacity ({} tokens) of a rank",
                self.config.kv_capacity()
            ));
        };
        let arrival = Arrival {
            prompts: vec![prompt],
            max_new_tokens: max_new,
            answer_tokens: vec![request.answer_tokens],
            rank,
            room: None,
            pretokenized,
            priority: request.priority,
        };
        let output = arrival.stop_at(0);
        let submitted = self.engine.submit(at, worker, arrival);
        self.tracked.insert(
            submitted.req,
            Tracked {
                prompt_tokens,
                output,
                first_seen: false,
                open: 1,
                cached_tokens: 0,
                worker: submitted.worker,
                rank: 0,
            },
        );
        // Due now if the tokenizer takes no time.
        self.advance(at);
        Ok(submitted.req)
    }

    /// The local engine an `X-data-parallel-rank` value pins on `worker`,
    /// read as the HTTP server reads it (vLLM mode only); an out-of-range
    /// rank is the error message the server answers 400 with.
    fn header_rank(&self, worker: usize, value: &str) -> Result<Option<usize>, String> {
        if !self.config.is_vllm() {
            return Err(
                "a rank header needs --engine vllm (SGLang requests name their rank with `rank`)".into(),
            );
        }
        let value = axum::http::HeaderValue::from_str(value)
            .map_err(|err| format!("invalid header value {value:?}: {err}"))?;
        let mut headers = axum::http::HeaderMap::new();
        headers.insert("x-data-parallel-rank", value);
        let scope = protocol::RankScope {
            start_rank: self.config.start_rank(worker),
            port_rank: None,
        };
        protocol::parse_request_at(
            protocol::Api::Completions,
            br#"{"prompt":"x"}"#,
            &headers,
            &self.config,
            &scope,
        )
        .map(|parsed| parsed.rank)
        .map_err(|rejection| rejection.message)
    }

    /// Advances virtual time to `until` seconds; returns what happened
    /// since the last call.
    pub fn run_until(&mut self, until: f64) -> Vec<Report> {
        let until = micros(until).max(self.now);
        self.advance(until);
        std::mem::take(&mut self.reports)
    }

    /// Runs until nothing is left to do; returns what happened.
    pub fn run_to_end(&mut self) -> Vec<Report> {
        while let Some(next) = self.next_event() {
            self.advance(next);
        }
        std::mem::take(&mut self.reports)
    }

    fn next_event(&self) -> Option<Micros> {
        let step = self.step_ends.first().map(|(at, _, _)| *at);
        match (step, self.engine.next_ready()) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }

    fn advance(&mut self, until: Micros) {
        while let Some(next) = self.next_event().filter(|next| *next <= until) {
            self.now = next;
            // Arrivals first: a step ending now plans with them.
            let mut wake = BTreeSet::new();
            for dispatched in self.engine.dispatch_due(next) {
                if let Some(tracked) = self.tracked.get_mut(&dispatched.req) {
                    tracked.worker = dispatched.worker;
                    tracked.rank = dispatched.rank;
                }
                wake.insert((dispatched.worker, dispatched.group));
            }
            while let Some(&(end, worker, group)) = self.step_ends.first() {
                if end > next {
                    break;
                }
                self.step_ends.pop_first();
                self.engine.end_step(worker, group, end, &mut self.events);
                wake.insert((worker, group));
            }
            for (worker, group) in wake {
                self.start_step(worker, group);
            }
            self.absorb();
        }
        self.now = until;
    }

    fn start_step(&mut self, worker: usize, group: usize) {
        if self.engine.in_step(worker, group) {
            return;
        }
        loop {
            let duration = self.engine.begin_step(worker, group, self.now, &mut self.events);
            // Decode role: the KV arrives at once offline.
            let transfers: Vec<(ReqId, usize)> = self
                .events
                .iter()
                .filter(|event| event.kind == EventKind::TransferStart)
                .map(|event| (event.req, event.seq))
                .collect();
            self.events.retain(|event| event.kind != EventKind::TransferStart);
            for &(req, seq) in &transfers {
                self.engine
                    .transfer_done(self.now, req, seq, Ok(()), &mut self.events);
            }
            match duration {
                Some(duration) => {
                    self.step_ends.insert((self.now + duration, worker, group));
                    return;
                }
                None if transfers.is_empty() => return,
                None => {}
            }
        }
    }

    /// Turns engine events into reports.
    fn absorb(&mut self) {
        for event in std::mem::take(&mut self.events) {
            if event.kind == EventKind::Retracted {
                self.retractions.push((event.req, seconds(event.at)));
                continue;
            }
            let EventKind::Token {
                count,
                cached_tokens,
                done,
            } = event.kind
            else {
                continue;
            };
            let Some(tracked) = self.tracked.get_mut(&event.req) else {
                continue;
            };
            let placed = (tracked.worker, tracked.rank);
            tracked.cached_tokens = cached_tokens;
            if !tracked.first_seen {
                tracked.first_seen = true;
                self.reports.push(Report {
                    req: event.req,
                    at: seconds(event.at),
                    worker: placed.0,
                    rank: placed.1,
                    finished: false,
                    prompt_tokens: tracked.prompt_tokens,
                    cached_tokens,
                    completion_tokens: count,
                });
            }
            if done {
                tracked.open -= 1;
                if tracked.open == 0 {
                    self.reports.push(Report {
                        req: event.req,
                        at: seconds(event.at),
                        worker: placed.0,
                        rank: placed.1,
                        finished: true,
                        prompt_tokens: tracked.prompt_tokens,
                        cached_tokens: tracked.cached_tokens,
                        completion_tokens: tracked.output,
                    });
                    self.tracked.remove(&event.req);
                }
            }
        }
    }

    /// Every retraction so far: (request, virtual time in seconds).
    pub fn retractions(&self) -> &[(ReqId, f64)] {
        &self.retractions
    }

    /// The loads each rank of `worker` last published.
    pub fn snapshots(&self, worker: usize) -> Vec<RankSnapshot> {
        self.engine.published(worker)
    }

    fn view<'a>(&self, snapshots: &'a [RankSnapshot], first_rank: usize) -> LoadView<'a> {
        LoadView {
            snapshots,
            base_tokens: &[],
            capacity: self.config.kv_capacity(),
            max_running: self.config.max_running(),
            with_total: !self.config.no_total_tokens,
            extra_ranks: 0,
            first_rank,
            timestamp: SystemTime::UNIX_EPOCH + Duration::from_micros(self.now),
        }
    }

    /// What `GET /v1/loads` on `worker` would answer now (`dp_rank` counted
    /// from the worker's start rank).
    pub fn v1_loads(&self, worker: usize) -> Value {
        let snapshots = self.snapshots(worker);
        loads::v1_loads(&self.view(&snapshots, self.config.start_rank(worker)))
    }

    /// SGLang `--rank-ports`: what `GET /v1/loads` on the port of `worker`'s
    /// rank `rank` (local index) answers with the per-rank loads: that rank
    /// alone, `dp_rank` its global rank.
    pub fn rank_v1_loads(&self, worker: usize, rank: usize) -> Value {
        let snapshots: Vec<RankSnapshot> = self.snapshots(worker).get(rank).copied().into_iter().collect();
        loads::v1_loads(&self.view(&snapshots, self.config.global_rank(worker, rank)))
    }

    /// The global rank of `worker`'s engine or rank `local` (what `/metrics`
    /// labels it, `x-sim-dp-rank` names it); [`Report::rank`] is the local one.
    pub fn global_rank(&self, worker: usize, local: usize) -> usize {
        self.config.global_rank(worker, local)
    }

    /// vLLM mode: what each engine of `worker` last reported.
    pub fn engine_stats(&self, worker: usize) -> Vec<crate::engine::EngineStats> {
        self.engine.engine_stats(worker)
    }

    /// vLLM mode: what `GET /metrics` on `worker` would answer now (one API
    /// process unless `--api-server-count` or the release says more; the
    /// series created at virtual time 0).
    pub fn metrics(&self, worker: usize) -> String {
        let stats = self.engine_stats(worker);
        metrics::exposition(&MetricsView {
            stats: &stats,
            extra_engines: 0,
            first_engine: self.config.start_rank(worker),
            model: &self.config.model,
            block_size: self.config.block_size(),
            num_gpu_blocks: self.config.num_gpu_blocks(),
            created: 0.0,
            multiprocess: self.config.api_servers() > 1,
            garble: Garble::None,
        })
    }

    /// What `GET /get_load` on `worker` would answer now.
    pub fn get_load(&self, worker: usize) -> Value {
        let snapshots = self.snapshots(worker);
        loads::get_load(&self.view(&snapshots, self.config.start_rank(worker)))
    }

    /// The model itself, for tests that look inside.
    pub fn engine(&mut self) -> &mut engine::Fleet {
        &mut self.engine
    }
}
