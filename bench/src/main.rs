//! dprank-bench: load generator and benchmarks for dprank (see `--help`).

mod client;
mod loadgen;
mod procs;
mod trace;

use std::net::SocketAddr;
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
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Replay a seeded trace against an endpoint and print latency, throughput and rank imbalance.
    Load(LoadArgs),
}

/// Shape of the trace: arrivals and lengths.
#[derive(Debug, Clone, Args)]
struct TraceArgs {
    /// Arrivals per simulated second (Poisson).
    #[arg(long, default_value_t = 10.0)]
    rate: f64,
    /// Simulated seconds of arrivals.
    #[arg(long, default_value_t = 30.0)]
    duration: f64,
    #[arg(long, default_value_t = 42)]
    seed: u64,
    /// Median prompt tokens (lognormal).
    #[arg(long, default_value_t = LengthModel::SHAREGPT_INPUT.median)]
    input_median: f64,
    #[arg(long, default_value_t = LengthModel::SHAREGPT_INPUT.sigma)]
    input_sigma: f64,
    #[arg(long, default_value_t = LengthModel::SHAREGPT_INPUT.max)]
    input_max: u32,
    /// Median output tokens (lognormal).
    #[arg(long, default_value_t = LengthModel::SHAREGPT_OUTPUT.median)]
    output_median: f64,
    #[arg(long, default_value_t = LengthModel::SHAREGPT_OUTPUT.sigma)]
    output_sigma: f64,
    #[arg(long, default_value_t = LengthModel::SHAREGPT_OUTPUT.max)]
    output_max: u32,
}

impl TraceArgs {
    fn spec(&self) -> TraceSpec {
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
    match cli.command {
        Command::Load(args) => load(args).await,
    }
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
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
