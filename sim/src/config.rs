//! Command line and model parameters.

use std::net::SocketAddr;

use clap::{Args, Parser, ValueEnum};

/// How a worker picks a rank for a request that names none.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Dispatch {
    /// SGLang's default controller behaviour.
    #[value(name = "round_robin", alias = "round-robin")]
    RoundRobin,
    /// The rank holding the fewest tokens right now (exact in-process
    /// knowledge: the ideal balancer).
    #[value(name = "minimum_tokens", alias = "minimum-tokens")]
    MinimumTokens,
    /// `bootstrap_room % dp_size` (the first room of a batch), as an SGLang
    /// prefill server picks a rank when the router names none; requests
    /// without a room fall back to round robin.
    #[value(name = "room_modulo", alias = "room-modulo")]
    RoomModulo,
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

/// Options shared by every worker of one process.
#[derive(Debug, Clone, Args)]
pub struct SimConfig {
    /// Data-parallel ranks per worker.
    #[arg(long, default_value_t = 4)]
    pub dp_size: usize,
    /// Rank choice for requests that carry no rank field.
    #[arg(long, value_enum, default_value_t = Dispatch::RoundRobin)]
    pub dispatch: Dispatch,
    /// Every modelled duration is divided by this (10 = ten times faster).
    #[arg(long, default_value_t = 1.0)]
    pub time_scale: f64,
    /// Prefill throughput of one rank.
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
    /// Maximum running sequences per rank.
    #[arg(long, default_value_t = 64)]
    pub max_running: u64,
    /// Step all ranks of a worker together, each step lasting as long as
    /// the slowest rank's (DP attention synchronises every forward pass).
    #[arg(long)]
    pub lockstep: bool,
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
            lockstep: false,
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
        Ok(())
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
