//! Command line and model parameters.

use std::net::SocketAddr;

use clap::{ArgAction, Args, Parser, ValueEnum};

use crate::engine::cost::{CostModel, CostPreset, Deployment, StepNoise};

/// SGLANG_INIT_NEW_TOKEN_RATIO.
pub const INIT_NEW_TOKEN_RATIO: f64 = 0.7;
/// SGLANG_MIN_NEW_TOKEN_RATIO_FACTOR.
pub const MIN_NEW_TOKEN_RATIO_FACTOR: f64 = 0.14;
/// SGLANG_NEW_TOKEN_RATIO_DECAY_STEPS.
pub const NEW_TOKEN_RATIO_DECAY_STEPS: f64 = 600.0;
/// SGLANG_RETRACT_DECODE_STEPS.
pub const RETRACT_DECODE_STEPS: u64 = 20;
/// SGLANG_CLIP_MAX_NEW_TOKENS_ESTIMATION.
pub const CLIP_MAX_NEW_TOKENS: u64 = 4096;
/// server_args: schedule_conservativeness *= 0.3 with --enable-dp-attention.
pub const DP_ATTENTION_CONSERVATIVENESS: f64 = 0.3;
/// vLLM's `max_num_batched_tokens` for the OpenAI server on GPUs of 70 GiB
/// or more other than A100 (engine/arg_utils.py, `get_batch_defaults`).
pub const VLLM_MAX_NUM_BATCHED_TOKENS: u64 = 8192;

/// How a worker picks a rank for a request that names none.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Dispatch {
    /// SGLang's default `--load-balance-method round_robin`.
    #[value(name = "round_robin", alias = "round-robin")]
    RoundRobin,
    /// SGLang `--load-balance-method total_tokens`: the rank with the
    /// fewest `num_total_tokens` as the DP controller sees them (published
    /// snapshots read at most every 20 ms, plus its own increments).
    #[value(
        name = "total_tokens",
        alias = "total-tokens",
        alias = "minimum_tokens",
        alias = "minimum-tokens"
    )]
    TotalTokens,
    /// SGLang `--load-balance-method total_requests`.
    #[value(name = "total_requests", alias = "total-requests")]
    TotalRequests,
    /// `bootstrap_room % dp_size` (the first room of a batch), as an SGLang
    /// prefill server picks a rank when the router names none
    /// (`follow_bootstrap_room`); requests without a room: round robin.
    #[value(name = "room_modulo", alias = "room-modulo")]
    RoomModulo,
    /// The clairvoyant greedy chooser: fleet-wide, exact, instantaneous,
    /// over every worker of the process: the lowest projected time to
    /// first token (greedy, not optimal; not a bound).
    #[value(name = "oracle", alias = "clairvoyant")]
    Oracle,
    /// vLLM's internal balancer (`DPLBAsyncMPClient`), the only one a vLLM
    /// server has; the default with `--engine vllm`.
    #[value(name = "vllm", alias = "dplb")]
    Vllm,
}

impl Dispatch {
    /// The name `/server_info` reports as `load_balance_method`.
    pub fn name(self) -> &'static str {
        match self {
            Dispatch::RoundRobin => "round_robin",
            Dispatch::TotalTokens => "total_tokens",
            Dispatch::TotalRequests => "total_requests",
            Dispatch::RoomModulo => "follow_bootstrap_room",
            Dispatch::Oracle => "oracle",
            Dispatch::Vllm => "vllm",
        }
    }
}

/// The server the simulator speaks as.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum EngineKind {
    /// SGLang with `--dp-size N` (`/generate`, `/v1/loads`, body rank fields).
    #[value(name = "sglang")]
    Sglang,
    /// `vllm serve --data-parallel-size N`: one engine per rank behind one
    /// API server (`/metrics`, the `X-data-parallel-rank` header, vLLM's
    /// scheduler and internal balancer). See sim/README.md, "vLLM mode".
    #[value(name = "vllm")]
    Vllm,
}

/// The vLLM release whose behaviour the vLLM mode follows where releases
/// differ (the balancer, who publishes counts to it, the streamed answer
/// to an out-of-range rank, the API processes and `/metrics`' shape).
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum VllmVersion {
    /// 0.14 to 0.33 as read in 0.14: `waiting * 4 + running`, one API
    /// process.
    #[value(name = "0.14")]
    V0_14,
    /// 0.34: `max(in flight, waiting + running)` plus a KV-pressure penalty,
    /// rotating start, one API process per engine.
    #[value(name = "0.34")]
    V0_34,
}

impl VllmVersion {
    pub fn name(self) -> &'static str {
        match self {
            VllmVersion::V0_14 => "0.14.0",
            VllmVersion::V0_34 => "0.34.0",
        }
    }
}

/// How admission reserves KV for a request's output.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Admission {
    /// SGLang: the uncached prompt plus `new_token_ratio` x the remaining
    /// output of running requests; retract when the KV runs out.
    #[value(name = "sglang")]
    Sglang,
    /// Reserve prompt + every output token; never retract.
    #[value(name = "reserve_full", alias = "reserve-full")]
    ReserveFull,
}

/// An on/off switch spelled as a value.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Toggle {
    On,
    Off,
}

/// Which serving endpoints read the `x-data-parallel-rank` header.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum RankHeader {
    /// Every serving endpoint (SGLang main).
    #[value(name = "honour", alias = "honor")]
    Honour,
    /// `/v1/chat/completions` and `/v1/completions` only; `/generate`
    /// silently ignores it (SGLang from PR #19832 to at least v0.5.19).
    #[value(name = "openai")]
    Openai,
    /// No endpoint (SGLang before PR #19832).
    #[value(name = "ignore")]
    Ignore,
}

/// vLLM mode: the API server in front of the engines, which decides how
/// `X-data-parallel-rank` is read (sim/README.md, "Deployment layouts").
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum VllmFrontend {
    /// The default Python API server: Python `int()`, a LOCAL engine index
    /// `0..N` (`InputProcessor.process_inputs`, the engines the server
    /// manages being `--data-parallel-size-local` of them under hybrid or
    /// external load balancing).
    #[value(name = "python")]
    Python,
    /// `VLLM_USE_RUST_FRONTEND=1`: `trim().parse::<u32>()`, the GLOBAL rank
    /// of one of the engines this server manages, `S..S+N`
    /// (`RequestRegistry::choose_engine_for_request`).
    #[value(name = "rust")]
    Rust,
}

impl VllmFrontend {
    pub fn name(self) -> &'static str {
        match self {
            VllmFrontend::Python => "python",
            VllmFrontend::Rust => "rust",
        }
    }
}

/// SGLang `--rank-ports` layout: where the load endpoints answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum RankPortLoads {
    /// Each rank port answers `/v1/loads` and `/get_load` with its own rank
    /// only, as each rank's embedded Rust server serves the snapshots its
    /// scheduler publishes (rust/sglang-server `api_server/loads.rs`).
    #[value(name = "per-rank", alias = "per_rank")]
    PerRank,
    /// The base port (rank 0's) answers with every rank of the worker; the
    /// other rank ports answer 404 there.
    #[value(name = "base")]
    Base,
    /// No rank port answers them (404): loads only on `--loads-port`.
    #[value(name = "none")]
    None,
}

/// The disaggregation role of the simulated server.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Role {
    Regular,
    Prefill,
    Decode,
}

impl Role {
    /// The command-line spelling.
    pub fn name(self) -> &'static str {
        match self {
            Role::Regular => "regular",
            Role::Prefill => "prefill",
            Role::Decode => "decode",
        }
    }

    /// The value SGLang reports as `disaggregation_mode`.
    pub fn disaggregation_mode(self) -> &'static str {
        match self {
            Role::Regular => "null",
            Role::Prefill => "prefill",
            Role::Decode => "decode",
        }
    }
}

/// Options shared by every worker of one process. Defaults follow SGLang
/// (see sim/README.md).
#[derive(Debug, Clone, Args)]
pub struct SimConfig {
    /// The server simulated: SGLang, or vLLM (sim/README.md, "vLLM mode").
    #[arg(long, value_enum, default_value_t = EngineKind::Sglang)]
    pub engine: EngineKind,
    /// vLLM mode: the vLLM release whose behaviour is followed.
    #[arg(long, value_enum, default_value_t = VllmVersion::V0_14)]
    pub vllm_version: VllmVersion,
    /// The modelled deployment (step costs and shape); the flags below
    /// override its values one by one.
    #[arg(long, value_enum, default_value_t = CostPreset::DeepseekV3Ep)]
    pub cost_model: CostPreset,
    /// Data-parallel ranks per worker (default: the cost model's).
    #[arg(long)]
    pub dp_size: Option<usize>,
    /// Rank choice for requests that carry no rank (default: SGLang's
    /// round_robin; vLLM's internal balancer in vLLM mode).
    #[arg(long, value_enum)]
    pub dispatch: Option<Dispatch>,
    /// Every modelled duration is divided by this (10 = ten times faster).
    #[arg(long, default_value_t = 1.0)]
    pub time_scale: f64,
    /// Fixed duration of a prefill step.
    #[arg(long)]
    pub prefill_step_ms: Option<f64>,
    /// Prefill throughput of one rank in new (uncached) tokens, the
    /// attention term aside: 1 / the per-token cost.
    #[arg(long)]
    pub prefill_tokens_per_s: Option<f64>,
    /// Prefill attention cost per (new token, earlier token of its
    /// sequence) pair, in nanoseconds.
    #[arg(long)]
    pub prefill_attention_ns: Option<f64>,
    /// Fixed duration of a decode step.
    #[arg(long)]
    pub decode_step_ms: Option<f64>,
    /// Extra decode-step time per sequence of the running batch.
    #[arg(long)]
    pub decode_step_us_per_seq: Option<f64>,
    /// Extra decode-step time per KV token the running batch reads.
    #[arg(long)]
    pub decode_step_us_per_token: Option<f64>,
    /// Share (0 to 1) of the per-token prefill cost that is routed-expert
    /// work, spread over the ranks stepping together (default: the cost
    /// model's).
    #[arg(long)]
    pub prefill_shared: Option<f64>,
    /// Share (0 to 1) of the per-sequence decode cost spread over the ranks
    /// stepping together (default: the cost model's).
    #[arg(long)]
    pub decode_shared: Option<f64>,
    /// Relative standard deviation of each rank's own part of a step, per
    /// step (0.03 = 3%; default: the cost model's).
    #[arg(long)]
    pub step_noise: Option<f64>,
    /// Chance that a rank straggles in a step (default: the cost model's).
    #[arg(long)]
    pub straggler_chance: Option<f64>,
    /// How much longer a straggling rank's part takes (0.3 = 30%; default:
    /// the cost model's).
    #[arg(long)]
    pub straggler_slowdown: Option<f64>,
    /// Seed of the step-time noise (the same seed, the same run).
    #[arg(long, default_value_t = 0)]
    pub noise_seed: u64,
    /// SGLang --enable-prefill-delayer: under DP attention, ranks that could
    /// prefill wait (at most --prefill-delayer-max-delay-passes passes)
    /// while other ranks could not, so that the ranks prefill together.
    #[arg(long, alias = "enable-prefill-delayer", value_enum, num_args = 0..=1, default_missing_value = "on")]
    pub prefill_delayer: Option<Toggle>,
    /// SGLang --prefill-delayer-max-delay-passes.
    #[arg(long, default_value_t = 30)]
    pub prefill_delayer_max_delay_passes: u32,
    /// SGLang --prefill-delayer-token-usage-low-watermark: a rank whose KV
    /// usage is below it prefills at once (none by default).
    #[arg(long)]
    pub prefill_delayer_token_usage_low_watermark: Option<f64>,
    /// SGLang --enable-mixed-chunk: a prefill step carries the running
    /// batch's decodes in the same forward pass.
    #[arg(long, alias = "enable-mixed-chunk", value_enum, num_args = 0..=1, default_missing_value = "on")]
    pub mixed_chunk: Option<Toggle>,
    /// KV cache capacity of one rank, in tokens (default: the cost
    /// model's).
    #[arg(long)]
    pub kv_capacity: Option<u64>,
    /// Maximum running requests per rank (SGLang --max-running-requests,
    /// vLLM --max-num-seqs; default: the cost model's).
    #[arg(long, alias = "max-num-seqs")]
    pub max_running: Option<u64>,
    /// Step all ranks of a worker together, each step lasting as long as
    /// the slowest rank's (DP attention; default: on where the cost model
    /// has DP attention).
    #[arg(long, num_args = 0..=1, default_missing_value = "true", action = ArgAction::Set)]
    pub lockstep: Option<bool>,
    /// Let every rank step on its own.
    #[arg(long)]
    pub no_lockstep: bool,
    /// KV reservation rule at admission.
    #[arg(long, value_enum, default_value_t = Admission::Sglang)]
    pub admission: Admission,
    /// SGLang --schedule-conservativeness (x0.3 under DP attention).
    #[arg(long, default_value_t = 1.0)]
    pub schedule_conservativeness: f64,
    /// A radix (prefix) cache per rank.
    #[arg(long, value_enum, default_value_t = Toggle::On)]
    pub prefix_cache: Toggle,
    /// KV page size in tokens.
    #[arg(long, default_value_t = 1)]
    pub page_size: u64,
    /// SGLang --chunked-prefill-size for the server (divided by dp_size
    /// per rank); -1 disables chunking.
    #[arg(long, default_value_t = 8192, allow_negative_numbers = true)]
    pub chunked_prefill_size: i64,
    /// SGLang --max-prefill-tokens: prompt tokens per prefill batch.
    #[arg(long, default_value_t = 16384)]
    pub max_prefill_tokens: u64,
    /// SGLang --enable-priority-scheduling: each rank's waiting queue in the
    /// order of the requests' `priority` (higher first), arrival order
    /// within one (sim/README.md: preemption is not modelled).
    #[arg(long)]
    pub enable_priority_scheduling: bool,
    /// SGLang --schedule-low-priority-values-first: lower values first.
    #[arg(long)]
    pub schedule_low_priority_values_first: bool,
    /// vLLM mode: KV block size in tokens (default: the cost model's, as
    /// vLLM picks it for the model's attention backend).
    #[arg(long)]
    pub block_size: Option<u64>,
    /// vLLM mode: tokens one engine schedules per step, prefill chunks and
    /// decodes together (vLLM's default for the OpenAI server on a GPU of
    /// 70 GiB or more: 8192).
    #[arg(long, default_value_t = VLLM_MAX_NUM_BATCHED_TOKENS)]
    pub max_num_batched_tokens: u64,
    /// vLLM mode: API server processes, each with its own balancer (default:
    /// 1 for 0.14, one per engine for 0.34).
    #[arg(long)]
    pub api_server_count: Option<usize>,
    /// The global rank of each worker's first rank: its ranks are S..S+N-1
    /// (vLLM `--data-parallel-start-rank`, hybrid or external load
    /// balancing; SGLang with `--rank-ports`, a node of a multi-node DP
    /// group). None: 0; one: every worker; else one per `--listen`.
    #[arg(long = "dp-start-rank", alias = "data-parallel-start-rank")]
    pub dp_start_rank: Vec<usize>,
    /// vLLM mode: the API server reading `X-data-parallel-rank`.
    #[arg(long, value_enum, default_value_t = VllmFrontend::Python)]
    pub vllm_frontend: VllmFrontend,
    /// SGLang mode: each worker serves rank r on its own port, --listen's
    /// port + r, with no rank field needed (`SGLANG_RUST_SERVER=1`).
    #[arg(long)]
    pub rank_ports: bool,
    /// With --rank-ports: which ports answer `/v1/loads` and `/get_load`.
    #[arg(long, value_enum, default_value_t = RankPortLoads::PerRank)]
    pub rank_port_loads: RankPortLoads,
    /// Fixed delay from a request's arrival to its tokenized form reaching
    /// the scheduler, in microseconds.
    #[arg(long, default_value_t = 500.0)]
    pub tokenizer_delay_us: f64,
    /// Tokenization time per prompt token, in microseconds (one tokenizer
    /// per worker, first come first served).
    #[arg(long, default_value_t = 1.0)]
    pub tokenizer_us_per_token: f64,
    /// SGLang --load-snapshot-publish-interval: publish the load snapshot
    /// every N decode steps (prefill steps and idle always publish).
    #[arg(long, default_value_t = 15)]
    pub load_publish_interval: u32,
    /// Which endpoints honour the x-data-parallel-rank header.
    #[arg(long, value_enum, default_value_t = RankHeader::Honour)]
    pub rank_header: RankHeader,
    /// SGLANG_ENABLE_REQUEST_HEADER_OVERRIDES: honour the x-override-*
    /// headers on /generate and /v1/chat/completions.
    #[arg(long)]
    pub header_overrides: bool,
    /// SGLang --enable-cache-report (vLLM: --enable-prompt-tokens-details):
    /// usage.prompt_tokens_details on the OpenAI endpoints.
    #[arg(long, alias = "enable-prompt-tokens-details")]
    pub enable_cache_report: bool,
    /// Answer at once, modelling no delay at all (overhead benchmarks).
    #[arg(long)]
    pub instant: bool,
    /// Disaggregation role.
    #[arg(long, value_enum, default_value_t = Role::Regular)]
    pub role: Role,
    /// Omit `num_total_tokens` from /v1/loads (older builds).
    #[arg(long)]
    pub no_total_tokens: bool,
    /// Answer 404 on /v1/loads (stock images).
    #[arg(long)]
    pub no_v1_loads: bool,
    /// Serving requests kept for /_sim/requests (the latest ones; 0 keeps
    /// none), so long benchmarks do not grow without bound.
    #[arg(long, default_value_t = 100_000)]
    pub record_limit: usize,
    /// Model name reported by /v1/models and /server_info.
    #[arg(long, default_value = "sim-model")]
    pub model: String,
    /// Decode role: fail a request whose prefill room is not ready after
    /// this many real (unscaled) milliseconds.
    #[arg(long, default_value_t = 5000)]
    pub kv_wait_timeout_ms: u64,
    /// Decode role: interval between polls of the prefill's room.
    #[arg(long, default_value_t = 2)]
    pub kv_poll_interval_ms: u64,
}

impl Default for SimConfig {
    fn default() -> Self {
        Self {
            engine: EngineKind::Sglang,
            vllm_version: VllmVersion::V0_14,
            cost_model: CostPreset::DeepseekV3Ep,
            dp_size: None,
            dispatch: None,
            time_scale: 1.0,
            prefill_step_ms: None,
            prefill_tokens_per_s: None,
            prefill_attention_ns: None,
            decode_step_ms: None,
            decode_step_us_per_seq: None,
            decode_step_us_per_token: None,
            prefill_shared: None,
            decode_shared: None,
            step_noise: None,
            straggler_chance: None,
            straggler_slowdown: None,
            noise_seed: 0,
            prefill_delayer: None,
            prefill_delayer_max_delay_passes: 30,
            prefill_delayer_token_usage_low_watermark: None,
            mixed_chunk: None,
            kv_capacity: None,
            max_running: None,
            lockstep: None,
            no_lockstep: false,
            admission: Admission::Sglang,
            schedule_conservativeness: 1.0,
            prefix_cache: Toggle::On,
            page_size: 1,
            chunked_prefill_size: 8192,
            max_prefill_tokens: 16384,
            enable_priority_scheduling: false,
            schedule_low_priority_values_first: false,
            block_size: None,
            max_num_batched_tokens: VLLM_MAX_NUM_BATCHED_TOKENS,
            api_server_count: None,
            dp_start_rank: Vec::new(),
            vllm_frontend: VllmFrontend::Python,
            rank_ports: false,
            rank_port_loads: RankPortLoads::PerRank,
            tokenizer_delay_us: 500.0,
            tokenizer_us_per_token: 1.0,
            load_publish_interval: 15,
            rank_header: RankHeader::Honour,
            header_overrides: false,
            enable_cache_report: false,
            instant: false,
            role: Role::Regular,
            no_total_tokens: false,
            no_v1_loads: false,
            record_limit: 100_000,
            model: "sim-model".to_string(),
            kv_wait_timeout_ms: 5000,
            kv_poll_interval_ms: 2,
        }
    }
}

impl SimConfig {
    /// Rejects values the model cannot run with.
    pub fn validate(&self) -> Result<(), String> {
        if self.dp_size == Some(0) {
            return Err("--dp-size must be at least 1".into());
        }
        if !(self.time_scale.is_finite() && self.time_scale > 0.0) {
            return Err("--time-scale must be a positive number".into());
        }
        if let Some(rate) = self.prefill_tokens_per_s {
            if !(rate.is_finite() && rate > 0.0) {
                return Err("--prefill-tokens-per-s must be a positive number".into());
            }
        }
        for (name, value) in [
            ("--prefill-step-ms", self.prefill_step_ms),
            ("--prefill-attention-ns", self.prefill_attention_ns),
            ("--decode-step-ms", self.decode_step_ms),
            ("--decode-step-us-per-seq", self.decode_step_us_per_seq),
            ("--decode-step-us-per-token", self.decode_step_us_per_token),
        ] {
            if value.is_some_and(|value| !(value.is_finite() && value >= 0.0)) {
                return Err(format!("{name} must be a non-negative number"));
            }
        }
        for (name, value) in [
            ("--prefill-shared", self.prefill_shared),
            ("--decode-shared", self.decode_shared),
            ("--straggler-chance", self.straggler_chance),
        ] {
            if value.is_some_and(|value| !(0.0..=1.0).contains(&value)) {
                return Err(format!("{name} must be between 0 and 1"));
            }
        }
        for (name, value) in [
            ("--step-noise", self.step_noise),
            ("--straggler-slowdown", self.straggler_slowdown),
        ] {
            if value.is_some_and(|value| !(value.is_finite() && value >= 0.0)) {
                return Err(format!("{name} must be a non-negative number"));
            }
        }
        if self.prefill_delayer() && !self.lockstep() {
            return Err("--prefill-delayer needs ranks in lockstep (DP attention)".into());
        }
        let capacity = self.kv_capacity();
        if capacity < 2 {
            return Err("--kv-capacity must be at least 2".into());
        }
        if self.max_running() == 0 {
            return Err("--max-running must be at least 1".into());
        }
        if !(self.schedule_conservativeness.is_finite() && self.schedule_conservativeness >= 0.0) {
            return Err("--schedule-conservativeness must be a non-negative number".into());
        }
        if self.page_size == 0 || self.page_size > capacity / 2 {
            return Err("--page-size must be at least 1 and at most half of --kv-capacity".into());
        }
        if let Some(chunk) = self.chunk_per_rank() {
            if chunk < self.page_size {
                return Err(format!(
                    "--chunked-prefill-size / --dp-size ({chunk}) must be at least --page-size ({})",
                    self.page_size
                ));
            }
        }
        if self.max_prefill_tokens == 0 {
            return Err("--max-prefill-tokens must be at least 1".into());
        }
        for (name, value) in [
            ("--tokenizer-delay-us", self.tokenizer_delay_us),
            ("--tokenizer-us-per-token", self.tokenizer_us_per_token),
        ] {
            if !(value.is_finite() && value >= 0.0) {
                return Err(format!("{name} must be a non-negative number"));
            }
        }
        if self.engine == EngineKind::Vllm {
            self.validate_vllm()?;
        } else {
            self.validate_sglang_layout()?;
        }
        Ok(())
    }

    /// SGLang mode: the flags of the deployment layouts.
    fn validate_sglang_layout(&self) -> Result<(), String> {
        if self.dispatch == Some(Dispatch::Vllm) {
            return Err("--dispatch vllm needs --engine vllm".into());
        }
        if self.vllm_frontend != VllmFrontend::Python {
            return Err("--vllm-frontend needs --engine vllm".into());
        }
        if !self.rank_ports {
            if self.dp_start_rank.iter().any(|start| *start != 0) {
                return Err(
                    "--dp-start-rank in SGLang mode needs --rank-ports: SGLang's one HTTP server of a DP group numbers its ranks from 0"
                        .into(),
                );
            }
            if self.rank_port_loads != RankPortLoads::PerRank {
                return Err("--rank-port-loads needs --rank-ports".into());
            }
        }
        Ok(())
    }

    /// Checks the per-worker lists against the number of workers.
    pub fn validate_workers(&self, workers: usize) -> Result<(), String> {
        let starts = self.dp_start_rank.len();
        if starts > 1 && starts != workers {
            return Err(format!(
                "give none, one or one --dp-start-rank per --listen ({workers} workers, {starts} start ranks)"
            ));
        }
        Ok(())
    }

    /// The global rank of `worker`'s first rank (0 by default).
    pub fn start_rank(&self, worker: usize) -> usize {
        match self.dp_start_rank.as_slice() {
            [] => 0,
            [start] => *start,
            starts => starts.get(worker).copied().unwrap_or(0),
        }
    }

    /// The global rank of `worker`'s rank `local`.
    pub fn global_rank(&self, worker: usize, local: usize) -> usize {
        self.start_rank(worker) + local
    }

    fn validate_vllm(&self) -> Result<(), String> {
        if self.prefill_delayer() || self.mixed_chunk() {
            return Err("--prefill-delayer and --mixed-chunk are SGLang's; vLLM's scheduler mixes prefills and decodes always".into());
        }
        if self.role != Role::Regular {
            return Err("--engine vllm runs the regular role only (no prefill/decode roles)".into());
        }
        match self.dispatch() {
            Dispatch::Vllm | Dispatch::Oracle => {}
            other => {
                return Err(format!(
                    "--dispatch {} is SGLang's; a vLLM server has its internal balancer (`vllm`) or, in the simulator, `oracle`",
                    other.name()
                ))
            }
        }
        let block = self.block_size();
        if block == 0 || self.kv_capacity() / block < 2 {
            return Err(
                "--block-size must be at least 1 and --kv-capacity must hold at least 2 blocks".into(),
            );
        }
        if self.max_num_batched_tokens == 0 {
            return Err("--max-num-batched-tokens must be at least 1".into());
        }
        if self.api_server_count == Some(0) {
            return Err("--api-server-count must be at least 1".into());
        }
        if self.rank_ports {
            return Err("--rank-ports is SGLang's layout (SGLANG_RUST_SERVER=1); vLLM serves one port per API server (--dp-start-rank for hybrid or external load balancing)".into());
        }
        if self.rank_port_loads != RankPortLoads::PerRank {
            return Err("--rank-port-loads needs --rank-ports".into());
        }
        Ok(())
    }

    /// Whether the simulated server is vLLM.
    pub fn is_vllm(&self) -> bool {
        self.engine == EngineKind::Vllm
    }

    /// How a rank is chosen for a request naming none.
    pub fn dispatch(&self) -> Dispatch {
        self.dispatch.unwrap_or(match self.engine {
            EngineKind::Sglang => Dispatch::RoundRobin,
            EngineKind::Vllm => Dispatch::Vllm,
        })
    }

    /// vLLM mode: the KV block size.
    pub fn block_size(&self) -> u64 {
        self.block_size.unwrap_or(self.deployment().vllm_block_size)
    }

    /// vLLM mode: KV blocks per engine (`num_gpu_blocks`).
    pub fn num_gpu_blocks(&self) -> u64 {
        self.kv_capacity() / self.block_size().max(1)
    }

    /// vLLM mode: API server processes.
    pub fn api_servers(&self) -> usize {
        self.api_server_count
            .unwrap_or(match self.vllm_version {
                VllmVersion::V0_14 => 1,
                VllmVersion::V0_34 => self.dp_size(),
            })
            .max(1)
    }

    /// The output a sequence with a `prompt`-token prompt may have: what it
    /// asks for, clamped so that prompt + output fits an empty rank with a
    /// page to spare (SGLang's admission needs that strictly); None if not
    /// even one output token fits.
    pub fn fit_output(&self, prompt: u64, wanted: u64) -> Option<u64> {
        let (capacity, page) = if self.is_vllm() {
            (self.num_gpu_blocks() * self.block_size(), self.block_size())
        } else {
            (self.kv_capacity(), self.page_size)
        };
        let room = capacity.checked_sub(prompt + page + 1)?;
        (room >= 1).then(|| wanted.clamp(1, room))
    }

    /// The values of the chosen cost model, before the overriding flags.
    pub fn deployment(&self) -> Deployment {
        Deployment::of(self.cost_model)
    }

    /// Ranks per worker.
    pub fn dp_size(&self) -> usize {
        self.dp_size.unwrap_or(self.deployment().dp_size).max(1)
    }

    /// KV tokens per rank (vLLM mode: whole blocks of them are used).
    pub fn kv_capacity(&self) -> u64 {
        self.kv_capacity.unwrap_or(self.deployment().kv_capacity)
    }

    /// Running requests per rank (vLLM mode: `max_num_seqs`).
    pub fn max_running(&self) -> u64 {
        let deployment = self.deployment();
        self.max_running.unwrap_or(match self.engine {
            EngineKind::Sglang => deployment.max_running,
            EngineKind::Vllm => deployment.vllm_max_num_seqs,
        })
    }

    /// Whether the modelled server runs DP attention (SGLang
    /// `--enable-dp-attention`).
    pub fn dp_attention(&self) -> bool {
        self.deployment().dp_attention
    }

    /// Whether the ranks of a worker step together.
    pub fn lockstep(&self) -> bool {
        !self.no_lockstep && self.lockstep.unwrap_or(self.dp_attention())
    }

    /// A rank's step costs: the cost model's, with the overriding flags.
    pub fn cost(&self) -> CostModel {
        let mut cost = self.deployment().cost;
        if let Some(ms) = self.prefill_step_ms {
            cost.prefill_base_us = ms * 1e3;
        }
        if let Some(rate) = self.prefill_tokens_per_s {
            cost.prefill_us_per_token = 1e6 / rate;
        }
        if let Some(ns) = self.prefill_attention_ns {
            cost.prefill_us_per_pair = ns / 1e3;
        }
        if let Some(ms) = self.decode_step_ms {
            cost.decode_base_us = ms * 1e3;
        }
        if let Some(us) = self.decode_step_us_per_seq {
            cost.decode_us_per_seq = us;
        }
        if let Some(us) = self.decode_step_us_per_token {
            cost.decode_us_per_kv_token = us;
        }
        if let Some(share) = self.prefill_shared {
            cost.prefill_shared = share;
        }
        if let Some(share) = self.decode_shared {
            cost.decode_shared = share;
        }
        cost
    }

    /// The step-time noise: the cost model's, with the overriding flags.
    pub fn noise(&self) -> StepNoise {
        let mut noise = self.deployment().noise;
        if let Some(spread) = self.step_noise {
            noise.spread = spread;
        }
        if let Some(chance) = self.straggler_chance {
            noise.straggler_chance = chance;
        }
        if let Some(slowdown) = self.straggler_slowdown {
            noise.straggler_slowdown = slowdown;
        }
        noise
    }

    /// Whether SGLang's prefill delayer runs.
    pub fn prefill_delayer(&self) -> bool {
        self.prefill_delayer == Some(Toggle::On)
    }

    /// Whether prefill steps carry the running batch's decodes.
    pub fn mixed_chunk(&self) -> bool {
        self.mixed_chunk == Some(Toggle::On)
    }

    /// Prompt tokens one rank prefills per step, if chunking is on: SGLang
    /// divides --chunked-prefill-size by dp_size under DP attention.
    pub fn chunk_per_rank(&self) -> Option<u64> {
        let share = if self.dp_attention() {
            self.dp_size() as u64
        } else {
            1
        };
        (self.chunked_prefill_size > 0).then(|| (self.chunked_prefill_size as u64 / share).max(1))
    }

    /// SGLang's initial new_token_ratio: 0.7 x conservativeness, the
    /// conservativeness multiplied by 0.3 under DP attention.
    pub fn init_new_token_ratio(&self) -> f64 {
        let scale = if self.dp_attention() {
            DP_ATTENTION_CONSERVATIVENESS
        } else {
            1.0
        };
        (INIT_NEW_TOKEN_RATIO * self.schedule_conservativeness * scale).min(1.0)
    }
}

/// The full command line: one worker per `--listen`.
#[derive(Debug, Parser)]
#[command(
    name = "dprank-sim",
    // A later flag wins: harnesses append overrides to a base command line.
    args_override_self = true,
    about = "Simulated SGLang server(s) with data-parallel ranks (--dp-size N --enable-dp-attention), or vLLM servers (--engine vllm: vllm serve --data-parallel-size N)"
)]
pub struct Cli {
    /// Address of one worker; repeat for a fleet served by this process.
    #[arg(long = "listen", required = true)]
    pub listen: Vec<SocketAddr>,
    /// Prefill role: a second listener per worker serving /_sim/kv/<room>;
    /// give none or one per --listen, in the same order.
    #[arg(long = "bootstrap-port")]
    pub bootstrap_port: Vec<u16>,
    /// SGLang mode: a further listener per worker (same IP as --listen)
    /// answering `/v1/loads` and `/get_load` for every rank of the worker;
    /// give none or one per --listen, in the same order.
    #[arg(long = "loads-port")]
    pub loads_port: Vec<u16>,
    #[command(flatten)]
    pub sim: SimConfig,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(flags: &[&str]) -> SimConfig {
        let mut args = vec!["dprank-sim", "--listen", "127.0.0.1:0"];
        args.extend_from_slice(flags);
        Cli::try_parse_from(args)
            .map(|cli| cli.sim)
            .unwrap_or_else(|e| panic!("{e}"))
    }

    #[test]
    fn the_default_is_the_deepseek_node_and_flags_override_its_values() {
        let config = parse(&[]);
        assert_eq!(config.cost_model, CostPreset::DeepseekV3Ep);
        assert_eq!(
            (config.dp_size(), config.kv_capacity(), config.max_running()),
            (8, 300_000, 256)
        );
        assert!(config.lockstep() && config.dp_attention());
        let config = parse(&[
            "--dp-size",
            "2",
            "--kv-capacity",
            "1000",
            "--max-running",
            "3",
            "--prefill-tokens-per-s",
            "1000",
            "--decode-step-ms",
            "5",
            "--decode-step-us-per-seq",
            "2",
            "--decode-step-us-per-token",
            "0",
            "--prefill-step-ms",
            "1",
            "--prefill-attention-ns",
            "0",
            "--no-lockstep",
        ]);
        assert_eq!(
            (config.dp_size(), config.kv_capacity(), config.max_running()),
            (2, 1000, 3)
        );
        assert!(!config.lockstep() && config.dp_attention());
        let cost = config.cost();
        assert_eq!(
            (
                cost.prefill_base_us,
                cost.prefill_us_per_token,
                cost.prefill_us_per_pair
            ),
            (1000.0, 1000.0, 0.0)
        );
        assert_eq!(
            (
                cost.decode_base_us,
                cost.decode_us_per_seq,
                cost.decode_us_per_kv_token
            ),
            (5000.0, 2.0, 0.0)
        );
    }

    #[test]
    fn the_legacy_preset_keeps_the_old_defaults() {
        let config = parse(&["--cost-model", "legacy"]);
        assert_eq!(
            (config.dp_size(), config.kv_capacity(), config.max_running()),
            (4, 200_000, 64)
        );
        assert!(config.lockstep());
        assert_eq!(config.chunk_per_rank(), Some(2048));
        assert!((config.init_new_token_ratio() - 0.21).abs() < 1e-12);
    }

    #[test]
    fn the_dense_preset_has_no_dp_attention() {
        let config = parse(&["--cost-model", "dense-8b"]);
        assert!(!config.lockstep() && !config.dp_attention());
        // SGLang divides the chunk and scales the conservativeness only
        // under DP attention.
        assert_eq!(config.chunk_per_rank(), Some(8192));
        assert!((config.init_new_token_ratio() - 0.7).abs() < 1e-12);
        // Lockstep can still be asked for.
        assert!(parse(&["--cost-model", "dense-8b", "--lockstep"]).lockstep());
    }

    #[test]
    fn the_sglang_switches_take_both_spellings() {
        let config = parse(&["--enable-prefill-delayer", "--enable-mixed-chunk"]);
        assert!(config.prefill_delayer() && config.mixed_chunk());
        let config = parse(&["--prefill-delayer", "on", "--mixed-chunk", "off"]);
        assert!(config.prefill_delayer() && !config.mixed_chunk());
        assert!(!parse(&[]).prefill_delayer());
        let dense = parse(&["--cost-model", "dense-8b", "--prefill-delayer"]);
        assert!(dense.validate().unwrap_err().contains("lockstep"));
        let config = parse(&[
            "--cost-model",
            "deepseek-v3-ep-high",
            "--step-noise",
            "0",
            "--decode-shared",
            "0.5",
        ]);
        assert_eq!(config.noise().spread, 0.0);
        assert_eq!(config.noise().straggler_chance, 0.01);
        assert_eq!(config.cost().decode_shared, 0.5);
        assert!(parse(&["--decode-shared", "1.5"]).validate().is_err());
    }

    #[test]
    fn a_later_flag_wins() {
        let config = parse(&[
            "--cost-model",
            "legacy",
            "--kv-capacity",
            "10",
            "--cost-model",
            "dense-8b",
        ]);
        assert_eq!(
            (config.cost_model, config.kv_capacity()),
            (CostPreset::Dense8b, 10)
        );
    }
}
