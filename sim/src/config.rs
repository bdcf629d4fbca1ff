//! Command line and model parameters.

use std::net::SocketAddr;

use clap::{ArgAction, Args, Parser, ValueEnum};

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
    /// Data-parallel ranks per worker.
    #[arg(long, default_value_t = 4)]
    pub dp_size: usize,
    /// Rank choice for requests that carry no rank.
    #[arg(long, value_enum, default_value_t = Dispatch::RoundRobin)]
    pub dispatch: Dispatch,
    /// Every modelled duration is divided by this (10 = ten times faster).
    #[arg(long, default_value_t = 1.0)]
    pub time_scale: f64,
    /// Prefill throughput of one rank (uncached tokens).
    #[arg(long, default_value_t = 20_000.0)]
    pub prefill_tokens_per_s: f64,
    /// Base duration of one decode step.
    #[arg(long, default_value_t = 20.0)]
    pub decode_step_ms: f64,
    /// Extra decode-step time per KV token held by the running batch.
    #[arg(long, default_value_t = 0.25)]
    pub decode_step_us_per_token: f64,
    /// KV cache capacity of one rank, in tokens.
    #[arg(long, default_value_t = 200_000)]
    pub kv_capacity: u64,
    /// Maximum running requests per rank (SGLang --max-running-requests).
    #[arg(long, default_value_t = 64)]
    pub max_running: u64,
    /// Step all ranks of a worker together, each step lasting as long as
    /// the slowest rank's (DP attention); on unless --no-lockstep.
    #[arg(long, num_args = 0..=1, default_value_t = true, default_missing_value = "true", action = ArgAction::Set)]
    pub lockstep: bool,
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
    /// SGLang --enable-cache-report: usage.prompt_tokens_details on the
    /// OpenAI endpoints.
    #[arg(long)]
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
            dp_size: 4,
            dispatch: Dispatch::RoundRobin,
            time_scale: 1.0,
            prefill_tokens_per_s: 20_000.0,
            decode_step_ms: 20.0,
            decode_step_us_per_token: 0.25,
            kv_capacity: 200_000,
            max_running: 64,
            lockstep: true,
            no_lockstep: false,
            admission: Admission::Sglang,
            schedule_conservativeness: 1.0,
            prefix_cache: Toggle::On,
            page_size: 1,
            chunked_prefill_size: 8192,
            max_prefill_tokens: 16384,
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
        if self.dp_size == 0 {
            return Err("--dp-size must be at least 1".into());
        }
        if !(self.time_scale.is_finite() && self.time_scale > 0.0) {
            return Err("--time-scale must be a positive number".into());
        }
        if !(self.prefill_tokens_per_s.is_finite() && self.prefill_tokens_per_s > 0.0) {
            return Err("--prefill-tokens-per-s must be a positive number".into());
        }
        if !(self.decode_step_ms.is_finite() && self.decode_step_ms >= 0.0) {
            return Err("--decode-step-ms must be a non-negative number".into());
        }
        if !(self.decode_step_us_per_token.is_finite() && self.decode_step_us_per_token >= 0.0) {
            return Err("--decode-step-us-per-token must be a non-negative number".into());
        }
        if self.kv_capacity < 2 {
            return Err("--kv-capacity must be at least 2".into());
        }
        if self.max_running == 0 {
            return Err("--max-running must be at least 1".into());
        }
        if !(self.schedule_conservativeness.is_finite() && self.schedule_conservativeness >= 0.0) {
            return Err("--schedule-conservativeness must be a non-negative number".into());
        }
        if self.page_size == 0 || self.page_size > self.kv_capacity / 2 {
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
        Ok(())
    }

    /// The output a sequence with a `prompt`-token prompt may have: what it
    /// asks for, clamped so that prompt + output fits an empty rank with a
    /// page to spare (SGLang's admission needs that strictly); None if not
    /// even one output token fits.
    pub fn fit_output(&self, prompt: u64, wanted: u64) -> Option<u64> {
        let room = self.kv_capacity.checked_sub(prompt + self.page_size + 1)?;
        (room >= 1).then(|| wanted.clamp(1, room))
    }

    /// Whether the ranks of a worker step together.
    pub fn lockstep(&self) -> bool {
        self.lockstep && !self.no_lockstep
    }

    /// Prompt tokens one rank prefills per step, if chunking is on: SGLang
    /// divides --chunked-prefill-size by dp_size under DP attention.
    pub fn chunk_per_rank(&self) -> Option<u64> {
        (self.chunked_prefill_size > 0)
            .then(|| (self.chunked_prefill_size as u64 / self.dp_size.max(1) as u64).max(1))
    }

    /// SGLang's initial new_token_ratio: 0.7 x conservativeness, the
    /// conservativeness multiplied by 0.3 under DP attention.
    pub fn init_new_token_ratio(&self) -> f64 {
        (INIT_NEW_TOKEN_RATIO * self.schedule_conservativeness * DP_ATTENTION_CONSERVATIVENESS).min(1.0)
    }
}

/// The full command line: one worker per `--listen`.
#[derive(Debug, Parser)]
#[command(
    name = "dprank-sim",
    about = "Simulated SGLang server(s) with data-parallel ranks (--dp-size N --enable-dp-attention)"
)]
pub struct Cli {
    /// Address of one worker; repeat for a fleet served by this process.
    #[arg(long = "listen", required = true)]
    pub listen: Vec<SocketAddr>,
    /// Prefill role: a second listener per worker serving /_sim/kv/<room>;
    /// give none or one per --listen, in the same order.
    #[arg(long = "bootstrap-port")]
    pub bootstrap_port: Vec<u16>,
    #[command(flatten)]
    pub sim: SimConfig,
}
