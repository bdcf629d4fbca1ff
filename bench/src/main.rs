//! dprank-bench: load generator and benchmarks for dprank (see `--help` and
//! bench/README.md).

mod capacity;
mod client;
mod cpu;
mod demo;
mod envoy;
mod figure;
mod fleet;
mod host_calls;
mod loadgen;
mod offline;
mod overhead;
mod plot;
mod procs;
mod report;
mod runner;
mod selection;
mod stats;
mod suites;
mod variant;
mod workload;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use clap::{Args, Parser, Subcommand};

use crate::loadgen::{run_plan, Drain, LoadOptions};
use crate::runner::{FleetShape, Kv, ResultsFile};
use crate::suites::{run_suite, Suite, SuiteArgs};
use crate::workload::{Shape, Workload, WorkloadKind};

#[derive(Debug, Parser)]
#[command(
    name = "dprank-bench",
    about = "Benchmarks for dprank: workloads, baselines on equal terms, regimes, statistics, demo"
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
    /// A quick look (<= 10 min): two workloads, the headline variants, 3 seeds.
    Quick(SuiteArgs),
    /// The headline tables (`make bench`, <= 60 min): every workload, the headline variants, 10 seeds; then overhead and selection.
    Bench(BenchArgs),
    /// Every baseline on every workload, 10 seeds (part of `full`).
    Tables(SuiteArgs),
    /// Offered load x KV size sweep with plots (part of `full`).
    Sweep(SuiteArgs),
    /// Prefill/decode: dprank vs the old rule vs smg, equal freshness and defaults.
    Pd(SuiteArgs),
    /// smg's PD worker policies at equal freshness (part of `full`).
    PdPolicies(SuiteArgs),
    /// Everything for the committed results: tables, pd, pd-policies, sweep, overhead, selection.
    Full(BenchArgs),
    /// A custom suite: name workloads, variants, loads, KV sizes, seeds.
    Run(SuiteArgs),
    /// Measure (or re-measure) the fleet's capacity for workloads and KV sizes.
    Capacity(CapacityArgs),
    /// Rebuild the reports from runs.jsonl without running anything.
    Report {
        #[arg(long, default_value = "bench-results")]
        out: PathBuf,
    },
    /// The demo (`make demo`): one seeded trace through Envoy round robin, then Envoy + dprank.
    Demo(demo::DemoArgs),
    /// Write a synthetic trace in the block-hash JSONL format.
    MakeTrace {
        #[arg(long, default_value_t = 1)]
        seed: u64,
        #[arg(long, default_value_t = 600)]
        requests: usize,
        #[arg(long, default_value = "bench/traces/sample.jsonl")]
        out: PathBuf,
    },
    /// Replay a workload open-loop against an endpoint and print what it measured.
    Load(LoadArgs),
    /// Latency and throughput a router adds in front of an instant worker.
    Overhead(overhead::OverheadArgs),
    /// What one proxy-wasm host call of each kind dprank makes costs inside Envoy (about 4 min).
    HostCalls(host_calls::HostCallsArgs),
    /// Cost of the filter's selection step and body handling (host micro-benchmark).
    Selection(selection::SelectionArgs),
    /// The several-gateways figure from stored runs: TTFT p99 ÷ one gateway's against the number of gateways.
    GatewaysFigure(figure::GatewaysFigureArgs),
    /// Routing rules compared in virtual time (a model without Envoy): fast, deterministic.
    Offline(offline::OfflineArgs),
}

#[derive(Debug, Clone, Args)]
struct BenchArgs {
    #[arg(long, default_value = "bench-results")]
    out: PathBuf,
    /// Keep finished runs in runs.jsonl and run only the missing ones.
    #[arg(long)]
    resume: bool,
    /// Print the runs and their estimated duration, run nothing.
    #[arg(long)]
    dry_run: bool,
    /// Seeds 1..=N (default 10).
    #[arg(long)]
    seeds: Option<u64>,
    /// Simulated seconds of measured arrivals per run.
    #[arg(long)]
    duration: Option<f64>,
    /// Simulated seconds of warm-up arrivals per run.
    #[arg(long)]
    warmup: Option<f64>,
    /// Runs per overhead cell.
    #[arg(long, default_value_t = 3)]
    overhead_runs: usize,
}

impl BenchArgs {
    fn suite_args(&self) -> SuiteArgs {
        SuiteArgs {
            out: Some(self.out.clone()),
            resume: self.resume,
            dry_run: self.dry_run,
            seeds: self.seeds,
            duration: self.duration,
            warmup: self.warmup,
            ..SuiteArgs::default()
        }
    }
}

#[derive(Debug, Clone, Args)]
struct CapacityArgs {
    #[arg(long, default_value = "bench-results")]
    out: PathBuf,
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "no-prefix,bursty,tenants,chat,replay"
    )]
    workloads: Vec<String>,
    #[arg(long, value_delimiter = ',', default_value = "small")]
    kv: Vec<Kv>,
    /// Default per KV size.
    #[arg(long)]
    time_scale: Option<f64>,
}

#[derive(Debug, Clone, Args)]
struct LoadArgs {
    /// Base URL(s) to send to; requests spread over them.
    #[arg(long = "target", required = true)]
    targets: Vec<String>,
    /// Worker address (ip:port) whose /v1/loads is sampled every 100 ms; repeat.
    #[arg(long = "worker")]
    workers: Vec<SocketAddr>,
    /// The workers' --time-scale: trace times are simulated seconds.
    #[arg(long, default_value_t = 1.0)]
    time_scale: f64,
    #[arg(long, default_value = "no-prefix")]
    workload: String,
    /// Arrivals per simulated second.
    #[arg(long, default_value_t = 12.0)]
    rate: f64,
    /// Simulated seconds of arrivals.
    #[arg(long, default_value_t = 60.0)]
    duration: f64,
    #[arg(long, default_value_t = 42)]
    seed: u64,
    /// Accepted for compatibility; every workload picks its own API.
    #[arg(long, default_value = "/generate")]
    path: String,
}

async fn load(args: LoadArgs) -> Result<(), String> {
    let workload = Workload::new(WorkloadKind::parse(&args.workload)?);
    let plan = workload.plan(&Shape {
        rate: args.rate,
        duration_s: args.duration,
        seed: args.seed,
        max_prompt: 8192,
        max_output: runner::MAX_OUTPUT,
    })?;
    let options = LoadOptions {
        gateways: args.targets,
        spread: loadgen::Spread::Request,
        workers: args.workers,
        time_scale: args.time_scale,
        sample_every: Duration::from_millis(100),
        request_timeout: Duration::from_secs(300),
        seed: args.seed,
        progress: true,
        label: "load".into(),
        cut_at_s: None,
        drain: Drain::Complete,
        turn_horizon_s: None,
    };
    let output = run_plan(&plan, &options).await?;
    let ok: Vec<_> = output.records.iter().filter(|r| r.ok()).collect();
    let ttft: Vec<f64> = ok.iter().filter_map(|r| r.ttft_ms).collect();
    let e2e: Vec<f64> = ok.iter().map(|r| r.e2e_ms).collect();
    let gaps: Vec<f64> = ok
        .iter()
        .flat_map(|r| r.gaps_us.iter().map(|g| f64::from(*g) / 1000.0))
        .collect();
    let itl = |p: f64| stats::percentile(&gaps, p);
    let ranks = output.samples.first().map_or(0, |s| s.tokens.len());
    println!(
        "load: {} sent, {} ok, {} errors | TTFT p50 {:.0} p99 {:.0} ms | ITL p50 {:.1} p99 {:.1} ms | E2E p50 {:.0} p99 {:.0} ms | {:.2} req/s | imbalance {} (times simulated)",
        output.records.len(),
        ok.len(),
        output.records.len() - ok.len(),
        stats::percentile(&ttft, 50.0),
        stats::percentile(&ttft, 99.0),
        itl(50.0),
        itl(99.0),
        stats::percentile(&e2e, 50.0),
        stats::percentile(&e2e, 99.0),
        ok.len() as f64 / output.span_s.max(1e-9),
        loadgen::imbalance(&output.samples, 0.0, output.arrival_window_s, 0..ranks)
            .map_or("n/a".into(), |v| format!("{v:.3}")),
    );
    for e in output.records.iter().filter_map(|r| r.error.as_ref()).take(5) {
        println!("  error: {e}");
    }
    Ok(())
}

async fn suite(
    tools: &fleet::Tools,
    preset: &str,
    args: &SuiteArgs,
    command_line: &str,
) -> Result<(), String> {
    let suite = args.apply(Suite::preset(preset)?)?;
    run_suite(tools, &suite, args, command_line).await
}

async fn bench(
    tools: &fleet::Tools,
    args: &BenchArgs,
    presets: &[&str],
    command_line: &str,
) -> Result<(), String> {
    let suite_args = args.suite_args();
    for preset in presets {
        suite(tools, preset, &suite_args, command_line).await?;
    }
    if args.dry_run {
        println!("then overhead (about 2 min) and selection (about 1 min)");
        return Ok(());
    }
    let mut overhead_args = overhead::OverheadArgs::defaults();
    overhead_args.out = args.out.clone();
    overhead_args.runs = args.overhead_runs;
    overhead::overhead(tools, &overhead_args, command_line).await?;
    let mut selection_args = selection::SelectionArgs::defaults();
    selection_args.out = args.out.clone();
    selection::selection(&selection_args, command_line)
}

/// Rebuilds every suite's report from the records.
fn rebuild_reports(out: &std::path::Path, command_line: &str) -> Result<(), String> {
    let records = ResultsFile::new(&out.join("runs.jsonl")).load()?;
    let mut names: Vec<String> = Vec::new();
    for r in &records {
        if !names.contains(&r.suite) {
            names.push(r.suite.clone());
        }
    }
    for name in names {
        let mut suite = Suite::preset(&name).or_else(|_| Suite::preset("run"))?;
        suite.name = name.clone();
        let mine: Vec<_> = records.iter().filter(|r| r.suite == name).cloned().collect();
        let path = suites::write_report(
            out,
            &suite,
            &mine,
            &[],
            command_line,
            &capacity::CapacityFile::new(out),
        )?;
        println!("wrote {}", path.display());
    }
    Ok(())
}

async fn run(cli: Cli) -> Result<(), String> {
    procs::install_kill_guards();
    let command_line = std::env::args()
        .map(|a| if a.contains(' ') { format!("'{a}'") } else { a })
        .collect::<Vec<_>>()
        .join(" ");
    let tools = || fleet::Tools::find(&cli.root);
    match &cli.command {
        Command::Quick(args) => suite(&tools()?, "quick", args, &command_line).await,
        Command::Tables(args) => suite(&tools()?, "tables", args, &command_line).await,
        Command::Sweep(args) => suite(&tools()?, "sweep", args, &command_line).await,
        Command::Pd(args) => suite(&tools()?, "pd", args, &command_line).await,
        Command::PdPolicies(args) => suite(&tools()?, "pd-policies", args, &command_line).await,
        Command::Run(args) => suite(&tools()?, "run", args, &command_line).await,
        Command::Bench(args) => bench(&tools()?, args, &["bench"], &command_line).await,
        Command::Full(args) => {
            bench(
                &tools()?,
                args,
                &["tables", "pd-policies", "pd", "sweep"],
                &command_line,
            )
            .await
        }
        Command::Capacity(args) => {
            let tools = tools()?;
            let features = variant::SimFeatures::detect(&tools.sim)?;
            let file = capacity::CapacityFile::new(&args.out);
            for w in &args.workloads {
                let workload = Workload::new(WorkloadKind::parse(w)?);
                for kv in &args.kv {
                    let time_scale = args.time_scale.unwrap_or_else(|| suites::default_time_scale(*kv));
                    let entry = capacity::measure(
                        &tools,
                        &features,
                        &workload,
                        *kv,
                        FleetShape::default(),
                        time_scale,
                    )
                    .await?;
                    println!("{}, KV {}: {:.2} req/s", entry.workload, entry.kv, entry.rps);
                    file.store(&entry)?;
                }
            }
            println!("wrote {}", file.path.display());
            Ok(())
        }
        Command::Report { out } => rebuild_reports(out, &command_line),
        Command::GatewaysFigure(args) => figure::gateways_figure(args),
        Command::Demo(args) => demo::demo(&tools()?, args).await,
        Command::MakeTrace { seed, requests, out } => {
            let lines = workload::synth::generate(*seed, *requests);
            if let Some(dir) = out.parent().filter(|d| !d.as_os_str().is_empty()) {
                std::fs::create_dir_all(dir).map_err(|e| format!("cannot create {}: {e}", dir.display()))?;
            }
            std::fs::write(out, workload::synth::to_jsonl(&lines))
                .map_err(|e| format!("cannot write {}: {e}", out.display()))?;
            println!("wrote {} ({} requests)", out.display(), lines.len());
            Ok(())
        }
        Command::Load(args) => load(args.clone()).await,
        Command::Overhead(args) => overhead::overhead(&tools()?, args, &command_line).await,
        Command::HostCalls(args) => host_calls::host_calls(&tools()?, args, &command_line).await,
        Command::Selection(args) => selection::selection(args, &command_line),
        Command::Offline(args) => offline::offline(args, &command_line),
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
