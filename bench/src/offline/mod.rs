//! Virtual time: the routing rules compared without processes, fast and
//! deterministic (`dprank-bench offline`, `run --virtual`, the virtual half
//! of `make bench`).
//!
//! Each run drives the simulator's engine (`dprank_sim::offline::Fleet`,
//! the same model the HTTP simulator serves) with a workload's seeded plan,
//! through one or more gateways: Envoy's own balancers, a model of smg's
//! `cache_aware` (`smg.rs`), or dprank's real request lifecycle and poller
//! (`dprank::request`, `dprank::poller`) on an in-memory host with its own
//! shared data per gateway, parsing the fleet's real `/v1/loads` JSON
//! (`driver.rs`). What this leaves out: Envoy itself (no proxy latency, no
//! worker threads, no body copies), HTTP and its timing noise. Figures are a
//! model's; the harness (`dprank-bench run`) measures the real thing, and
//! `make bench` compares the two.

mod choice;
pub mod driver;
mod front;
mod gie;
mod smg;

use std::path::Path;
use std::time::Instant;

use dprank_sim::Cli as SimCli;

use crate::preset::{Kv, SimPreset};
use crate::runner::{summarize, Cell, RunRecord, Summary};

/// The simulator's configuration for a preset, KV size and ranks per worker.
pub fn sim_config(
    preset: &SimPreset,
    kv: Kv,
    dp_size: usize,
    extra: &[String],
) -> Result<dprank_sim::SimConfig, String> {
    use clap::Parser;
    let mut args: Vec<String> = vec![
        "dprank-sim".into(),
        "--listen".into(),
        "127.0.0.1:1".into(),
        "--dp-size".into(),
        dp_size.to_string(),
    ];
    args.extend(preset.sim_args(kv));
    args.extend(extra.iter().cloned());
    SimCli::try_parse_from(&args).map(|cli| cli.sim).map_err(|e| {
        if preset.sim_args.contains(&"--cost-model") {
            format!(
                "simulator preset `{}` needs the calibrated cost model (`--cost-model`), which this build of dprank-sim lacks: {e}",
                preset.name
            )
        } else {
            format!("simulator flags {args:?}: {e}")
        }
    })
}

/// One cell in virtual time, summarised as the harness summarises its runs;
/// with `requests_out`, every request as JSONL in that directory.
pub fn run_cell(cell: &Cell, requests_out: Option<&Path>) -> Result<RunRecord, String> {
    let plan = cell.plan()?;
    let started = Instant::now();
    let spec = driver::RunSpec {
        variant: &cell.variant,
        sim: sim_config(cell.preset, cell.kv, cell.fleet.dp_size, &{
            let mut extra = SimPreset::noise_seed_args(cell.seed).to_vec();
            extra.extend(cell.variant.sim_args.iter().cloned());
            extra
        })?,
        workers: cell.fleet.workers,
        seed: cell.seed,
        turn_horizon_s: cell.warmup_s + cell.duration_s + crate::workload::chat::TAIL_S,
        cut_at_s: None,
        requests_out: requests_out.map(|dir| cell.requests_file(dir)),
        give_up: None,
    };
    let outcome = driver::run(&plan, &spec)?;
    let mut record = summarize(
        cell,
        &outcome.output,
        Summary {
            started: crate::provenance::now_utc(),
            wall_s: started.elapsed().as_secs_f64(),
            cpu_busy: None,
            served_per_rank: Vec::new(),
            load_polls_per_worker_s: f64::NAN,
            imbalance: None,
            prefill_spread: None,
            counters: None,
            cpu: None,
            mode: "virtual",
            notes: plan.notes.clone(),
        },
    );
    record.freshness = format!("offline model: {}", record.freshness);
    record.dprank_counters = outcome.counters;
    Ok(record)
}

/// One piece of work for [`parallel`].
pub type Job<'a, T> = Box<dyn FnOnce() -> T + Send + 'a>;

/// Runs `jobs` closures at a time, results in order.
pub fn parallel<T: Send>(jobs: usize, work: Vec<Job<'_, T>>) -> Vec<T> {
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
