//! dprank-bench: load generator and benchmarks for dprank (see `--help` and
//! bench/README.md).

mod access_log;
mod capacity;
mod client;
mod cpu;
mod demo;
mod envoy;
mod figure;
mod fleet;
mod folders;
mod headline;
mod host_calls;
mod loadgen;
mod offline;
mod overhead;
mod plot;
mod preset;
mod procs;
mod provenance;
mod report;
mod runner;
mod seeds;
mod selection;
mod slo;
mod stats;
mod suites;
mod variant;
mod workload;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use clap::{Args, Parser, Subcommand};

use crate::loadgen::{run_plan, LoadOptions};
use crate::runner::ResultsFile;
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
    /// A quick look (<= 10 min): two workloads, the headline variants, 3 tuning seeds.
    Quick(SuiteArgs),
    /// The headline (`make bench`, <= 2 h): capacities, the capacity check, every workload in virtual time, three harness cells, their agreement.
    Bench(headline::BenchArgs),
    /// The harness cells of the headline alone (real Envoy, real smg at its default and best setting).
    Harness(SuiteArgs),
    /// smg's cache_aware settings on tuning seeds; writes smg-best.json (its best setting per workload).
    SmgSweep(SuiteArgs),
    /// Every baseline on every synthetic workload, judging seeds (part of `full`).
    Tables(SuiteArgs),
    /// Offered load x KV size sweep with plots (part of `full`).
    Sweep(SuiteArgs),
    /// Prefill/decode: dprank vs the old rule vs smg, equal freshness and defaults.
    Pd(SuiteArgs),
    /// smg's PD worker policies at equal freshness (part of `full`).
    PdPolicies(SuiteArgs),
    /// Overload protection: 80-150% of capacity, steady and bursty, two classes (`--virtual` for virtual time).
    Overload(SuiteArgs),
    /// tables, pd-policies, pd, sweep, then overhead and selection.
    Full(FullArgs),
    /// A custom suite: name workloads, variants, loads, KV sizes, seeds (`--virtual` for virtual time).
    Run(SuiteArgs),
    /// Routing rules in virtual time (a model without Envoy): fast, deterministic; tuning seeds by default.
    Offline(SuiteArgs),
    /// Measure (or re-measure) sustainable capacities in virtual time.
    Capacity(SuiteArgs),
    /// 10 minutes at 85% and 110% of the sustainable capacity: is it real, and a limit?
    CapacityCheck(headline::CheckArgs),
    /// The SLO of each simulator preset and workload, and the idle
    /// latencies it rests on.
    Slo {
        /// Where the public traces are (default: DPRANK_TRACE_DIR, then
        /// target/traces/mooncake).
        #[arg(long)]
        trace_dir: Option<std::path::PathBuf>,
    },
    /// Rebuild the reports from runs.jsonl without running anything.
    Report {
        #[arg(long, default_value = "bench-results")]
        out: PathBuf,
        /// Put runs of different commits or machines in one table, flagged.
        #[arg(long)]
        allow_mixed: bool,
    },
    /// Fold a folder's runs.jsonl into runs.jsonl.gz (how records are kept
    /// in the repository; every command reads both).
    Pack {
        #[arg(long)]
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
}

#[derive(Debug, Clone, Args)]
struct FullArgs {
    #[arg(long, default_value = "bench-results")]
    out: PathBuf,
    /// Keep finished runs in runs.jsonl and run only the missing ones.
    #[arg(long)]
    resume: bool,
    /// Print the runs and their estimated duration, run nothing.
    #[arg(long)]
    dry_run: bool,
    /// Seeds: the first N judging seeds (default 10).
    #[arg(long)]
    seeds: Option<u64>,
    /// Runs per overhead cell.
    #[arg(long, default_value_t = 3)]
    overhead_runs: usize,
}

#[derive(Debug, Clone, Args)]
struct LoadArgs {
    /// Base URL(s) to send to; requests spread over them.
    #[arg(long = "target", required = true)]
    targets: Vec<String>,
    /// Worker address (ip:port) whose /v1/loads is sampled every 100 ms, and
    /// which is told the answer lengths; repeat.
    #[arg(long = "worker")]
    workers: Vec<SocketAddr>,
    /// Simulated worker (ip:port) told the answer lengths only (no
    /// sampling); repeat.
    #[arg(long = "tell")]
    tell: Vec<SocketAddr>,
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
    let legacy = preset::preset("legacy")?;
    let plan = workload.plan(&Shape {
        rate: args.rate,
        duration_s: args.duration,
        seed: args.seed,
        max_prompt: legacy.max_prompt(crate::preset::Kv::Large),
        max_output: legacy.max_output,
    })?;
    // Where each answer ends goes to the simulated workers, not in the requests.
    let told: Vec<SocketAddr> = args.workers.iter().chain(&args.tell).copied().collect();
    if told.is_empty() {
        eprintln!("load: no --worker or --tell given: answers run to their max tokens (the simulator is not told their lengths)");
    }
    let client = client::pooled_client();
    let lengths: serde_json::Map<String, serde_json::Value> = plan
        .answers()
        .iter()
        .map(|(tag, n)| (tag.to_string(), serde_json::Value::from(*n)))
        .collect();
    let body = serde_json::json!({"lengths": lengths}).to_string();
    for worker in &told {
        let uri = format!("http://{worker}/_sim/answers");
        if let Err(e) = client::post_json(&client, &uri, body.clone()).await {
            eprintln!("load: {e} (its answers run to their max tokens)");
        }
    }
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
    tools: Option<&fleet::Tools>,
    name: &str,
    args: &SuiteArgs,
    command_line: &str,
    root: &std::path::Path,
) -> Result<(), String> {
    let suite = args.apply(Suite::named(name)?)?;
    run_suite(tools, &suite, args, command_line, root).await
}

async fn full(
    tools: &fleet::Tools,
    args: &FullArgs,
    command_line: &str,
    root: &std::path::Path,
) -> Result<(), String> {
    let suite_args = SuiteArgs {
        out: Some(args.out.clone()),
        resume: args.resume,
        dry_run: args.dry_run,
        seeds: args.seeds,
        ..SuiteArgs::default()
    };
    for name in ["tables", "pd-policies", "pd", "sweep"] {
        suite(Some(tools), name, &suite_args, command_line, root).await?;
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

/// Measures the sustainable capacities a suite's settings name.
fn capacities(args: &SuiteArgs, command_line: &str, root: &std::path::Path) -> Result<(), String> {
    let mut suite = args.apply(Suite::named("run")?)?;
    suite.jobs = args.jobs.unwrap_or_else(cpu::cores);
    let slos = suites::Slos::of_suite(&suite)?;
    println!("SLOs: {}", slos.describe());
    let dir = args.capacity_dir.clone().unwrap_or_else(|| suite.out.clone());
    let file = capacity::CapacityFile::new(&dir);
    let provenance = provenance::Provenance::current(root, command_line);
    suites::capacities(&suite, &slos, &file, args.remeasure, args.dry_run, &provenance)?;
    println!("capacities in {}", file.path.display());
    Ok(())
}

/// Every preset's SLO with the idle latencies behind it.
fn slos(trace_dir: Option<std::path::PathBuf>) -> Result<(), String> {
    use workload::{Workload, WorkloadKind};
    for p in &preset::PRESETS {
        let (ttft, tpot) = slo::idle_latencies(p, preset::IDLE_PROMPT_TOKENS)?;
        println!(
            "{}: idle TTFT {ttft:.1} ms, TPOT {tpot:.2} ms ({}-token prompt)",
            p.name,
            preset::IDLE_PROMPT_TOKENS
        );
        let kinds = WorkloadKind::SYNTHETIC
            .into_iter()
            .chain(WorkloadKind::PUBLIC_TRACES);
        for kind in kinds {
            let mut w = Workload::new(kind);
            w.trace.dir = trace_dir.clone();
            w.trace.input_scale = p.trace_input_scale;
            for kv in [crate::preset::Kv::Small, crate::preset::Kv::Large] {
                match slo::for_workload(p, &w, kv, slo::SloOverride::default()) {
                    Ok((s, why)) => println!(
                        "  {} KV {}: TTFT <= {} ms, TPOT <= {} ms: {why}",
                        w.name(),
                        kv.name(),
                        s.ttft_ms,
                        s.tpot_ms
                    ),
                    Err(e) => println!("  {} KV {}: {e}", w.name(), kv.name()),
                }
            }
        }
    }
    Ok(())
}

/// Rebuilds every suite's report from the records.
fn rebuild_reports(out: &std::path::Path, allow_mixed: bool, command_line: &str) -> Result<(), String> {
    let records = ResultsFile::new(&out.join("runs.jsonl")).load()?;
    let mut names: Vec<String> = Vec::new();
    for r in &records {
        if !names.contains(&r.suite) {
            names.push(r.suite.clone());
        }
    }
    for name in names {
        let mut suite = Suite::named(&name).or_else(|_| Suite::named("run"))?;
        suite.name = name.clone();
        let mine: Vec<_> = records.iter().filter(|r| r.suite == name).cloned().collect();
        if let Some(first) = mine.first() {
            suite.preset = preset::preset(first.preset_name())?;
            suite.virtual_time = first.mode.as_deref() == Some("virtual");
        }
        let context = suites::ReportContext {
            slo_why: "as recorded".into(),
            capacities: capacity::CapacityFile::new(out).load()?,
            allow_mixed,
            smg_best: suites::SmgBest::load(&out.join(suites::SMG_BEST_FILE))?,
        };
        let path = suites::write_report(out, &suite, &mine, &[], command_line, &context)?;
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
    let root = cli.root.as_path();
    let line = command_line.as_str();
    match &cli.command {
        Command::Quick(args) => suite(Some(&tools()?), "quick", args, line, root).await,
        Command::Harness(args) => suite(Some(&tools()?), "harness", args, line, root).await,
        Command::SmgSweep(args) => suite(Some(&tools()?), "smg-sweep", args, line, root).await,
        Command::Tables(args) => suite(Some(&tools()?), "tables", args, line, root).await,
        Command::Sweep(args) => suite(Some(&tools()?), "sweep", args, line, root).await,
        Command::Pd(args) => suite(Some(&tools()?), "pd", args, line, root).await,
        Command::PdPolicies(args) => suite(Some(&tools()?), "pd-policies", args, line, root).await,
        Command::Overload(args) if args.virtual_time => suite(None, "overload", args, line, root).await,
        Command::Overload(args) => suite(Some(&tools()?), "overload", args, line, root).await,
        Command::Run(args) if args.virtual_time => suite(None, "run", args, line, root).await,
        Command::Run(args) => suite(Some(&tools()?), "run", args, line, root).await,
        Command::Offline(args) => suite(None, "offline", args, line, root).await,
        Command::Bench(args) => {
            let tools = if args.no_harness || args.dry_run {
                None
            } else {
                Some(tools()?)
            };
            headline::bench(tools.as_ref(), args, line, root).await
        }
        Command::Full(args) => full(&tools()?, args, line, root).await,
        Command::Capacity(args) => capacities(args, line, root),
        Command::CapacityCheck(args) => headline::capacity_check(args, line, root).map(|_| ()),
        Command::Slo { trace_dir } => slos(trace_dir.clone()),
        Command::Report { out, allow_mixed } => rebuild_reports(out, *allow_mixed, line),
        Command::Pack { out } => {
            let packed = ResultsFile::new(&out.join("runs.jsonl")).pack()?;
            println!("packed {}", packed.display());
            Ok(())
        }
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
        Command::Overhead(args) => overhead::overhead(&tools()?, args, line).await,
        Command::HostCalls(args) => host_calls::host_calls(&tools()?, args, line).await,
        Command::Selection(args) => selection::selection(args, line),
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
