//! dprank-bench: load generator and benchmarks for dprank (see `--help`).

mod client;
mod compare;
mod cpu;
mod envoy;
mod fleet;
mod loadgen;
mod overhead;
mod pd;
mod plot;
mod procs;
mod selection;
mod stats;
mod trace;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use clap::{Args, Parser, Subcommand};

use crate::loadgen::{run_trace, LoadOptions};
use crate::trace::{LengthModel, TraceSpec};

#[derive(Debug, Parser)]
#[command(
    name = "dprank-bench",
    about = "Benchmarks for dprank: load generator, comparisons, overhead, selection cost"
)]
struct Cli {
    /// Repository root (where target/, envoy/ and .venv/ are).
    #[arg(long, global = true, default_value = ".")]
    root: PathBuf,
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Replay a seeded trace against an endpoint and print latency, throughput and rank imbalance.
    Load(LoadArgs),
    /// Same trace through Envoy round robin, Envoy + dprank, smg, the ideal, and two Envoys + dprank.
    Compare(compare::CompareArgs),
    /// Prefill/decode fleet: Envoy + dprank (PD mode) vs the old rule vs smg's minimum-tokens scheduler.
    Pd(pd::PdArgs),
    /// Latency and throughput a router adds in front of an instant worker.
    Overhead(overhead::OverheadArgs),
    /// Cost of the filter's selection step and body handling (host micro-benchmark).
    Selection(selection::SelectionArgs),
    /// compare, then pd, then overhead, then selection, with their defaults.
    All {
        #[arg(long, default_value = "bench-results")]
        out: PathBuf,
        /// Runs per compare variant and per overhead cell.
        #[arg(long, default_value_t = 3)]
        runs: usize,
    },
}

/// Shape of the trace: arrivals and lengths.
#[derive(Debug, Clone, Args)]
pub struct TraceArgs {
    /// Arrivals per simulated second (Poisson).
    #[arg(long, default_value_t = DEFAULT_RATE)]
    pub rate: f64,
    /// Simulated seconds of arrivals.
    #[arg(long, default_value_t = DEFAULT_DURATION_S)]
    pub duration: f64,
    #[arg(long, default_value_t = 42)]
    pub seed: u64,
    /// Median prompt tokens (lognormal).
    #[arg(long, default_value_t = LengthModel::SHAREGPT_INPUT.median)]
    pub input_median: f64,
    #[arg(long, default_value_t = LengthModel::SHAREGPT_INPUT.sigma)]
    pub input_sigma: f64,
    #[arg(long, default_value_t = LengthModel::SHAREGPT_INPUT.max)]
    pub input_max: u32,
    /// Median output tokens (lognormal).
    #[arg(long, default_value_t = LengthModel::SHAREGPT_OUTPUT.median)]
    pub output_median: f64,
    #[arg(long, default_value_t = LengthModel::SHAREGPT_OUTPUT.sigma)]
    pub output_sigma: f64,
    #[arg(long, default_value_t = LengthModel::SHAREGPT_OUTPUT.max)]
    pub output_max: u32,
}

/// Default load: near the saturation of the default compare fleet.
pub const DEFAULT_RATE: f64 = 12.0;
pub const DEFAULT_DURATION_S: f64 = 60.0;

impl TraceArgs {
    pub fn spec(&self) -> TraceSpec {
        TraceSpec {
            rate: self.rate,
            duration_s: self.duration,
            seed: self.seed,
            input: LengthModel {
                median: self.input_median,
                sigma: self.input_sigma,
                max: self.input_max,
                ..LengthModel::SHAREGPT_INPUT
            },
            output: LengthModel {
                median: self.output_median,
                sigma: self.output_sigma,
                max: self.output_max,
                ..LengthModel::SHAREGPT_OUTPUT
            },
        }
    }
}

#[derive(Debug, Args)]
struct LoadArgs {
    /// Base URL(s) to send to; requests alternate between them.
    #[arg(long = "target", required = true)]
    targets: Vec<String>,
    #[arg(long, default_value = "/generate")]
    path: String,
    /// Worker address (ip:port) whose /v1/loads is sampled every 100 ms; repeat.
    #[arg(long = "worker")]
    workers: Vec<SocketAddr>,
    /// The workers' --time-scale: trace times are simulated seconds.
    #[arg(long, default_value_t = 1.0)]
    time_scale: f64,
    #[command(flatten)]
    trace: TraceArgs,
}

async fn load(args: LoadArgs) -> Result<(), String> {
    let trace = args.trace.spec().generate()?;
    let options = LoadOptions {
        targets: args.targets,
        path: args.path,
        workers: args.workers,
        time_scale: args.time_scale,
        sample_every: Duration::from_millis(100),
        request_timeout: Duration::from_secs(300),
        progress: true,
        label: "load".into(),
    };
    let report = run_trace(&trace, &options).await?;
    println!("{}", report.summary());
    for e in &report.error_examples {
        println!("  error: {e}");
    }
    Ok(())
}

async fn run(cli: Cli) -> Result<(), String> {
    procs::install_kill_guards();
    let command_line = std::env::args()
        .map(|a| if a.contains(' ') { format!("'{a}'") } else { a })
        .collect::<Vec<_>>()
        .join(" ");
    match cli.command {
        Command::Load(args) => load(args).await,
        Command::Compare(args) => {
            compare::compare(&fleet::Tools::find(&cli.root)?, &args, &command_line).await
        }
        Command::Pd(args) => pd::pd(&fleet::Tools::find(&cli.root)?, &args, &command_line).await,
        Command::Overhead(args) => {
            overhead::overhead(&fleet::Tools::find(&cli.root)?, &args, &command_line).await
        }
        Command::Selection(args) => selection::selection(&args, &command_line),
        Command::All { out, runs } => {
            let tools = fleet::Tools::find(&cli.root)?;
            let mut parsed = Cli::parse_from(["dprank-bench", "compare"]);
            if let Command::Compare(mut args) = parsed.command {
                args.out = out.clone();
                args.runs = runs;
                compare::compare(&tools, &args, &command_line).await?;
            }
            parsed = Cli::parse_from(["dprank-bench", "pd"]);
            if let Command::Pd(mut args) = parsed.command {
                args.out = out.clone();
                args.runs = runs;
                pd::pd(&tools, &args, &command_line).await?;
            }
            parsed = Cli::parse_from(["dprank-bench", "overhead"]);
            if let Command::Overhead(mut args) = parsed.command {
                args.out = out.clone();
                args.runs = runs;
                overhead::overhead(&tools, &args, &command_line).await?;
            }
            parsed = Cli::parse_from(["dprank-bench", "selection"]);
            if let Command::Selection(mut args) = parsed.command {
                args.out = out;
                selection::selection(&args, &command_line)?;
            }
            Ok(())
        }
    }
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let runtime = match tokio::runtime::Builder::new_multi_thread().enable_all().build() {
        Ok(runtime) => runtime,
        Err(e) => {
            eprintln!("dprank-bench: cannot start the runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    let result = runtime.block_on(run(cli));
    procs::kill_all_children();
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(message) => {
            eprintln!("dprank-bench: {message}");
            ExitCode::FAILURE
        }
    }
}
