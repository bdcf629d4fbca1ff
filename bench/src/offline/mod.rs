//! `dprank-bench offline`: the routing rules compared in virtual time, fast
//! and deterministic, for exploring rules and their settings.
//!
//! Each run drives the simulator's engine (`dprank_sim::offline::Fleet`,
//! the same model the HTTP simulator serves) with a workload's seeded plan,
//! through one or more gateways: Envoy's own balancers, a model of smg's
//! `cache_aware` (`smg.rs`), or dprank's real request lifecycle and poller
//! (`dprank::request`, `dprank::poller`) on an in-memory host with its own
//! shared data per gateway, parsing the fleet's real `/v1/loads` JSON
//! (`driver.rs`). What this leaves out: Envoy itself (no proxy latency, no
//! worker threads, no body copies), HTTP and its timing noise. Figures are a
//! model's; the real harness (`dprank-bench run`) confirms them.

mod capacity;
pub mod driver;
mod front;
mod smg;

use std::fmt::Write as _;
use std::path::PathBuf;
use std::time::Instant;

use clap::Args;
use dprank_sim::Cli as SimCli;

use crate::report::{fmt_spread, group, markdown_table, report_header, Group};
use crate::runner::{summarize, Cell, FleetShape, Kv, RunRecord, Summary, MAX_OUTPUT};
use crate::stats::{median, paired_ratio, Slo};
use crate::variant::Variant;
use crate::workload::{ReplaySource, Shape, Workload, WorkloadKind};

#[derive(Debug, Clone, Args)]
pub struct OfflineArgs {
    /// Workloads (repeat): no-prefix, bursty, tenants, chat, replay.
    #[arg(long = "workload", default_value = "tenants")]
    pub workloads: Vec<String>,
    /// KV sizes per rank (repeat): small, large.
    #[arg(long = "kv", value_enum, default_value = "small")]
    pub kvs: Vec<Kv>,
    /// Offered loads as fractions of the measured capacity (repeat).
    #[arg(long = "load", default_value = "0.8")]
    pub loads: Vec<f64>,
    /// Seeds 1..=N.
    #[arg(long, default_value_t = 10)]
    pub seeds: u64,
    /// Variants (repeat), as for `dprank-bench run`: rr, in-server, oracle,
    /// smg-cache-aware, dprank[:poll=MS][:gw=N][:set.KEY=JSON][:sim.FLAG=V].
    #[arg(long = "variant")]
    pub variants: Vec<String>,
    /// The variant the others are divided by.
    #[arg(long, default_value = "dprank")]
    pub reference: String,
    /// Simulated seconds of arrivals before the measured window.
    #[arg(long, default_value_t = 20.0)]
    pub warmup: f64,
    /// Simulated seconds of measured arrivals.
    #[arg(long, default_value_t = 120.0)]
    pub duration: f64,
    #[arg(long, default_value_t = 2)]
    pub workers: usize,
    #[arg(long, default_value_t = 4)]
    pub dp_size: usize,
    /// Replay: a block-hash JSONL trace (default: a synthetic one per seed).
    #[arg(long)]
    pub trace: Option<PathBuf>,
    /// Replay: multiplies input lengths.
    #[arg(long)]
    pub input_scale: Option<f64>,
    /// Use this capacity (req/s) instead of measuring it.
    #[arg(long)]
    pub capacity: Option<f64>,
    /// Runs in parallel (each run is single-threaded).
    #[arg(long, default_value_t = 1)]
    pub jobs: usize,
    /// Write `offline.md` and `offline-runs.jsonl` here.
    #[arg(long)]
    pub out: Option<PathBuf>,
    /// Write every request of every run (where it went, its TTFT, its cached
    /// tokens) as JSONL files in this directory.
    #[arg(long)]
    pub requests_out: Option<PathBuf>,
}

/// The variants compared when none are named.
pub const DEFAULT_VARIANTS: [&str; 6] = [
    "rr",
    "in-server",
    "oracle",
    "smg-cache-aware",
    "dprank:set.prefix_affinity=false",
    "dprank",
];

/// The simulator's configuration for a KV size and fleet.
pub fn sim_config(kv: Kv, dp_size: usize, extra: &[String]) -> Result<dprank_sim::SimConfig, String> {
    use clap::Parser;
    let mut args: Vec<String> = vec![
        "dprank-sim".into(),
        "--listen".into(),
        "127.0.0.1:1".into(),
        "--dp-size".into(),
        dp_size.to_string(),
    ];
    args.extend(kv.sim_args());
    args.extend(extra.iter().cloned());
    SimCli::try_parse_from(&args)
        .map(|cli| cli.sim)
        .map_err(|e| format!("simulator flags {args:?}: {e}"))
}

fn workload(args: &OfflineArgs, name: &str) -> Result<Workload, String> {
    let mut w = Workload::new(WorkloadKind::parse(name)?);
    if w.kind == WorkloadKind::Replay {
        w.replay = ReplaySource {
            file: args.trace.clone(),
            input_scale: args.input_scale.unwrap_or(w.replay.input_scale),
            ..w.replay
        };
    }
    Ok(w)
}

/// One run, summarised as the real harness summarises its runs.
#[allow(clippy::too_many_arguments)]
fn run_cell(
    args: &OfflineArgs,
    workload: &Workload,
    variant: &Variant,
    kv: Kv,
    seed: u64,
    rate: f64,
    load: Option<f64>,
    suite: &str,
) -> Result<RunRecord, String> {
    let fleet = FleetShape {
        workers: args.workers,
        dp_size: args.dp_size,
        ..FleetShape::default()
    };
    let cell = Cell {
        suite: suite.into(),
        workload: workload.clone(),
        variant: variant.clone(),
        seed,
        kv,
        rate,
        load,
        warmup_s: args.warmup,
        duration_s: args.duration,
        time_scale: 1.0,
        fleet,
        slo: Slo {
            ttft_ms: f64::INFINITY,
            tpot_ms: f64::INFINITY,
        },
    };
    let plan = workload.plan(&Shape {
        rate,
        duration_s: args.warmup + args.duration,
        seed,
        max_prompt: kv.max_prompt(),
        max_output: MAX_OUTPUT,
    })?;
    let started = Instant::now();
    let spec = driver::RunSpec {
        variant,
        sim: sim_config(kv, args.dp_size, &variant.sim_args)?,
        workers: args.workers,
        seed,
        turn_horizon_s: args.warmup + args.duration + crate::workload::chat::TAIL_S,
        cut_at_s: None,
        requests_out: args.requests_out.as_ref().map(|dir| {
            dir.join(format!(
                "{}-{}-{:.0}-{}-{seed}.jsonl",
                workload.kind.name(),
                kv.name(),
                load.unwrap_or(0.0) * 100.0,
                variant.name.replace(['/', ':', '"'], "_")
            ))
        }),
    };
    let (output, counters) = driver::run(&plan, &spec)?;
    let mut record = summarize(
        &cell,
        &output,
        Summary {
            started: crate::report::now_utc(),
            wall_s: started.elapsed().as_secs_f64(),
            cpu_busy: None,
            served_per_rank: Vec::new(),
            load_polls_per_worker_s: f64::NAN,
            imbalance: None,
            prefill_spread: None,
            counters: None,
        },
    );
    record.freshness = format!("offline model: {}", record.freshness);
    record.dprank_counters = counters;
    Ok(record)
}

/// Runs `jobs` closures at a time, results in order.
fn parallel<T: Send>(jobs: usize, work: Vec<Box<dyn FnOnce() -> T + Send + '_>>) -> Vec<T> {
    let jobs = jobs.max(1);
    let mut results: Vec<Option<T>> = (0..work.len()).map(|_| None).collect();
    let queue = std::sync::Mutex::new(work.into_iter().enumerate().collect::<Vec<_>>());
    let out = std::sync::Mutex::new(&mut results);
    std::thread::scope(|s| {
        for _ in 0..jobs {
            s.spawn(|| loop {
                let next = queue.lock().map(|mut q| q.pop()).ok().flatten();
                let Some((i, job)) = next else { break };
                let value = job();
                if let Ok(mut out) = out.lock() {
                    out[i] = Some(value);
                }
            });
        }
    });
    results.into_iter().flatten().collect()
}

pub fn offline(args: &OfflineArgs, command_line: &str) -> Result<(), String> {
    let variant_specs: Vec<String> = if args.variants.is_empty() {
        DEFAULT_VARIANTS.iter().map(|s| s.to_string()).collect()
    } else {
        args.variants.clone()
    };
    let variants: Vec<Variant> = variant_specs
        .iter()
        .map(|s| Variant::parse(s))
        .collect::<Result<_, _>>()?;
    let mut records: Vec<RunRecord> = Vec::new();
    let mut capacities = Vec::new();
    for name in &args.workloads {
        let workload = workload(args, name)?;
        for &kv in &args.kvs {
            let capacity = match args.capacity {
                Some(c) => c,
                None => capacity::measure(args, &workload, kv)?,
            };
            capacities.push(format!(
                "`{}` KV {}: {capacity:.2} req/s",
                workload.kind.name(),
                kv.name()
            ));
            eprintln!(
                "offline: {} KV {}: capacity {capacity:.2} req/s",
                workload.kind.name(),
                kv.name()
            );
            for &load in &args.loads {
                let rate = load * capacity;
                let mut work: Vec<Box<dyn FnOnce() -> Result<RunRecord, String> + Send + '_>> = Vec::new();
                for seed in 1..=args.seeds {
                    for variant in &variants {
                        let workload = workload.clone();
                        work.push(Box::new(move || {
                            run_cell(args, &workload, variant, kv, seed, rate, Some(load), "offline")
                        }));
                    }
                }
                let started = Instant::now();
                for record in parallel(args.jobs, work) {
                    records.push(record?);
                }
                eprintln!(
                    "offline: {} KV {} at {:.0}%: {} runs in {:.1} s",
                    workload.kind.name(),
                    kv.name(),
                    load * 100.0,
                    args.seeds as usize * variants.len(),
                    started.elapsed().as_secs_f64()
                );
            }
        }
    }
    let mut md = report_header(
        "dprank offline evaluation (a model without Envoy: virtual time, the simulator's engine, dprank's request lifecycle and poller on an in-memory host)",
        command_line,
    );
    let _ = writeln!(
        md,
        "{} workers x {} ranks; {} s warm-up + {} s measured arrivals per run; capacities (completions/s under overload with the oracle): {}.\n",
        args.workers,
        args.dp_size,
        args.warmup,
        args.duration,
        capacities.join(", ")
    );
    for g in group(&records) {
        let _ = writeln!(
            md,
            "### `{}`, KV {}, {}\n",
            g.workload,
            g.kv,
            g.load.map_or(format!("{:.2} req/s", g.rate), |l| format!(
                "{:.0}% of capacity ({:.2} req/s)",
                l * 100.0,
                g.rate
            ))
        );
        md.push_str(&table(&g, &args.reference));
        md.push('\n');
    }
    println!("{md}");
    if let Some(out) = &args.out {
        std::fs::create_dir_all(out).map_err(|e| format!("cannot create {}: {e}", out.display()))?;
        let path = out.join("offline.md");
        std::fs::write(&path, &md).map_err(|e| format!("cannot write {}: {e}", path.display()))?;
        let lines: Vec<String> = records
            .iter()
            .filter_map(|r| serde_json::to_string(r).ok())
            .collect();
        let runs = out.join("offline-runs.jsonl");
        std::fs::write(&runs, lines.join("\n") + "\n")
            .map_err(|e| format!("cannot write {}: {e}", runs.display()))?;
        eprintln!("wrote {} and {}", path.display(), runs.display());
    }
    Ok(())
}

/// Medians over seeds, and each variant divided by the reference, paired by
/// seed (median ratio, 95% bootstrap interval).
fn table(g: &Group, reference: &str) -> String {
    let reference_runs = g.variants.iter().find(|(v, _)| v == reference).map(|(_, r)| r);
    let per_seed = |runs: &[&RunRecord], f: &dyn Fn(&RunRecord) -> f64| -> Vec<(u64, f64)> {
        runs.iter().map(|r| (r.seed, f(r))).collect()
    };
    let values = |runs: &[&RunRecord], f: &dyn Fn(&RunRecord) -> f64| -> Vec<f64> {
        runs.iter().map(|r| f(r)).collect()
    };
    let mut rows = Vec::new();
    for (variant, runs) in &g.variants {
        let ratio = |f: &dyn Fn(&RunRecord) -> f64| match reference_runs {
            Some(base) if variant != reference => {
                paired_ratio(&per_seed(runs, f), &per_seed(base, f)).map_or("–".into(), |r| r.display())
            }
            _ => "–".into(),
        };
        let hit = |r: &RunRecord| r.cache_hit.unwrap_or(f64::NAN);
        rows.push(vec![
            if variant == reference {
                format!("**{variant}**")
            } else {
                format!("`{variant}`")
            },
            runs.len().to_string(),
            format!("{:.0}", median(&values(runs, &|r| r.ttft_p50))),
            format!("{:.0}", median(&values(runs, &|r| r.ttft_p90))),
            fmt_spread(&values(runs, &|r| r.ttft_p99), 0),
            format!("{:.1}", median(&values(runs, &|r| r.tpot_p50))),
            format!("{:.1} %", median(&values(runs, &hit)) * 100.0),
            ratio(&|r| r.ttft_p50),
            ratio(&|r| r.ttft_p90),
            ratio(&|r| r.ttft_p99),
            ratio(&hit),
        ]);
    }
    let header = [
        "variant",
        "seeds",
        "TTFT p50 ms",
        "TTFT p90 ms",
        "TTFT p99 ms (min–max)",
        "TPOT p50 ms",
        "cache hit",
        &format!("÷ {reference}: TTFT p50"),
        &format!("÷ {reference}: TTFT p90"),
        &format!("÷ {reference}: TTFT p99"),
        &format!("÷ {reference}: cache hit"),
    ];
    markdown_table(&header, &rows)
}
