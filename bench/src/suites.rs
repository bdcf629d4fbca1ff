//! Suites: which cells run (workloads x KV sizes x offered loads x variants
//! x seeds), in what order, and the report they produce. The named presets
//! (`quick`, `bench`, `pd`, `sweep`, `tables`) fit the budgets in
//! bench/README.md; every field can be overridden from the command line, so
//! later work (prefix affinity, many gateways) reuses the harness by naming
//! its own variants.

use std::collections::{HashMap, HashSet};
use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::time::Instant;

use clap::Args;

use crate::capacity::{self, CapacityFile};
use crate::fleet::Tools;
use crate::plot;
use crate::report::{self, group, group_notes, group_table, group_title, report_header};
use crate::runner::{run_cell, settings_of, Cell, FleetShape, Kv, ResultsFile, RunRecord, Skipped};
use crate::stats::Slo;
use crate::variant::{SimFeatures, Variant};
use crate::workload::{ReplaySource, Workload, WorkloadKind};

/// The default SLO for goodput, simulated ms: about 25x an idle TTFT and
/// 2.4x an idle decode step of the simulated model.
pub const DEFAULT_SLO: Slo = Slo {
    ttft_ms: 1000.0,
    tpot_ms: 60.0,
};

/// Time scale per KV size: simulated time runs this many times faster than
/// wall time. Chosen so the token stream two cores carry through a proxy
/// stays below what they can push (bench/README.md, "Time scales").
pub fn default_time_scale(kv: Kv) -> f64 {
    match kv {
        Kv::Small => 5.0,
        Kv::Large => 2.0,
    }
}

#[derive(Debug, Clone)]
pub struct Suite {
    pub name: String,
    pub about: String,
    pub workloads: Vec<Workload>,
    pub kvs: Vec<Kv>,
    /// Offered loads as fractions of the measured capacity.
    pub loads: Vec<f64>,
    /// A fixed offered rate instead (requests per simulated second).
    pub rate: Option<f64>,
    pub variants: Vec<String>,
    pub seeds: Vec<u64>,
    /// Simulated seconds of arrivals before the measured window.
    pub warmup_s: f64,
    /// Simulated seconds of measured arrivals.
    pub duration_s: f64,
    /// None: [`default_time_scale`] per KV size.
    pub time_scale: Option<f64>,
    pub reference: String,
    pub fleet: FleetShape,
    pub slo: Slo,
    /// Where records and reports go.
    pub out: PathBuf,
}

/// Variants of the regular-mode tables: every baseline.
pub const EVERY_BASELINE: [&str; 10] = [
    "rr",
    "in-server",
    "smg-cache-aware",
    "smg-least-load",
    "smg-power-of-two",
    "smg-prefix-hash",
    "smg-round-robin",
    "smg-workers-least-load",
    "dprank",
    "oracle",
];

/// Variants of the headline and the sweep: round robin, the in-server
/// balancer, smg at its default and its best measured policy, dprank, the
/// oracle.
pub const HEADLINE: [&str; 6] = [
    "rr",
    "in-server",
    "smg-cache-aware",
    "smg-least-load",
    "dprank",
    "oracle",
];

/// PD variants. Time scale 5: smg's interval is in whole wall seconds, so
/// `interval=2` is its default 10 s in simulated time and `interval=1`
/// (5 s simulated) its freshest; dprank polls every simulated second by
/// default and every wall second (5 s simulated) at equal freshness.
/// Defaults against defaults: `dprank-pd` and smg with its default policy at
/// its default interval. Equal freshness: both every 5 simulated seconds,
/// smg with its best policy ([`BEST_PD_POLICY`], resolved from the
/// `pd-policies` records when there are any).
pub const PD: [&str; 5] = [
    "dprank-pd",
    "smg-pd-cache-aware:interval=2",
    "old-rule",
    "dprank-pd:poll-wall=1000",
    "smg-pd:policy=@best:interval=1",
];

/// Stands for smg's best PD policy in a variant spec.
pub const BEST_PD_POLICY: &str = "@best";

/// smg's best PD policy: the `pd-policies` variant with the lowest median
/// TTFT p99 over seeds, with how it was chosen; smg's default policy when
/// `records` hold no `pd-policies` run.
pub fn best_pd_policy(records: &[RunRecord]) -> (String, String) {
    let mut medians: Vec<(String, f64)> = Vec::new();
    for r in records.iter().filter(|r| r.suite == "pd-policies") {
        let Ok(variant) = Variant::parse(&r.variant) else {
            continue;
        };
        let crate::variant::Front::SmgPd { prefill, .. } = variant.front else {
            continue;
        };
        if medians.iter().all(|(p, _)| *p != prefill) {
            let p99: Vec<f64> = records
                .iter()
                .filter(|x| x.suite == "pd-policies" && x.variant == r.variant)
                .map(|x| x.ttft_p99)
                .collect();
            medians.push((prefill, crate::stats::median(&p99)));
        }
    }
    match medians
        .iter()
        .filter(|(_, m)| m.is_finite())
        .min_by(|a, b| a.1.total_cmp(&b.1))
    {
        Some((policy, _)) => (
            policy.clone(),
            format!(
                "lowest median TTFT p99 in pd-policies ({})",
                medians
                    .iter()
                    .map(|(p, m)| format!("{p} {m:.0} ms"))
                    .collect::<Vec<_>>()
                    .join(", ")
            ),
        ),
        None => (
            "cache_aware".into(),
            "no pd-policies records yet: smg's default policy".into(),
        ),
    }
}

/// The PD policy scan of the full run: each smg policy at equal freshness.
pub const PD_POLICIES: [&str; 4] = [
    "smg-pd-cache-aware:interval=1",
    "smg-pd-least-load:interval=1",
    "smg-pd-power-of-two:interval=1",
    "smg-pd:policy=round_robin:interval=1",
];

fn all_workloads() -> Vec<Workload> {
    WorkloadKind::ALL.into_iter().map(Workload::new).collect()
}

fn seeds(n: u64) -> Vec<u64> {
    (1..=n).collect()
}

impl Suite {
    pub fn preset(name: &str) -> Result<Suite, String> {
        let base = Suite {
            name: name.to_string(),
            about: String::new(),
            workloads: all_workloads(),
            kvs: vec![Kv::Small],
            loads: vec![0.85],
            rate: None,
            variants: HEADLINE.map(str::to_string).to_vec(),
            seeds: seeds(10),
            warmup_s: 10.0,
            duration_s: 25.0,
            time_scale: None,
            reference: "dprank".into(),
            fleet: FleetShape::default(),
            slo: DEFAULT_SLO,
            out: PathBuf::from("bench-results"),
        };
        Ok(match name {
            "quick" => Suite {
                about: "a quick look: two workloads, the headline variants, 3 seeds, short traces".into(),
                out: PathBuf::from("target/bench-quick"),
                workloads: vec![Workload::new(WorkloadKind::NoPrefix), Workload::new(WorkloadKind::Tenants)],
                seeds: seeds(3),
                warmup_s: 10.0,
                duration_s: 20.0,
                ..base
            },
            "bench" => Suite {
                about: "the headline tables: every workload at 85% of capacity with small KV, the headline variants, 10 seeds".into(),
                ..base
            },
            "tables" => Suite {
                about: "every baseline on every workload at 85% of capacity with small KV, 10 seeds".into(),
                variants: EVERY_BASELINE.map(str::to_string).to_vec(),
                ..base
            },
            "sweep" => Suite {
                about: "offered load 50/70/85/95% of capacity x KV small/large on the no-prefix and tenants workloads, the headline variants, 10 seeds".into(),
                workloads: vec![Workload::new(WorkloadKind::NoPrefix), Workload::new(WorkloadKind::Tenants)],
                kvs: vec![Kv::Small, Kv::Large],
                loads: vec![0.5, 0.7, 0.85, 0.95],
                ..base
            },
            "pd" => Suite {
                about: "prefill/decode disaggregation (2 prefill x 4 ranks, 2 decode x 4 ranks): dprank, the old rule and smg's minimum-tokens scheduler, at equal freshness and each at its default".into(),
                workloads: vec![Workload::new(WorkloadKind::NoPrefix)],
                variants: PD.map(str::to_string).to_vec(),
                time_scale: Some(5.0),
                reference: "dprank-pd".into(),
                ..base
            },
            "pd-policies" => Suite {
                about: "smg's PD worker policies with the minimum-tokens scheduler, all at equal freshness (1 s wall = 5 s simulated), against dprank at the same interval".into(),
                workloads: vec![Workload::new(WorkloadKind::NoPrefix)],
                variants: std::iter::once("dprank-pd:poll-wall=1000".to_string())
                    .chain(PD_POLICIES.map(str::to_string))
                    .collect(),
                time_scale: Some(5.0),
                reference: "dprank-pd:poll-wall=1000".into(),
                ..base
            },
            "run" => Suite {
                about: "a custom suite".into(),
                ..base
            },
            other => return Err(format!("unknown suite `{other}`")),
        })
    }

    pub fn time_scale_for(&self, kv: Kv) -> f64 {
        self.time_scale.unwrap_or_else(|| default_time_scale(kv))
    }

    /// Every cell, seeds outermost and variants innermost, so slow drift of
    /// the machine touches every variant of a seed alike. `rates` gives the
    /// offered rate per (workload, KV, load).
    pub fn cells(
        &self,
        rate_of: &dyn Fn(&Workload, Kv, f64) -> Result<f64, String>,
    ) -> Result<Vec<Cell>, String> {
        let variants: Vec<Variant> = self
            .variants
            .iter()
            .map(|v| Variant::parse(v))
            .collect::<Result<_, _>>()?;
        let mut out = Vec::new();
        for seed in &self.seeds {
            for workload in &self.workloads {
                for kv in &self.kvs {
                    for load in &self.loads {
                        let rate = match self.rate {
                            Some(rate) => rate,
                            None => rate_of(workload, *kv, *load)?,
                        };
                        for variant in &variants {
                            out.push(Cell {
                                suite: self.name.clone(),
                                workload: workload.clone(),
                                variant: variant.clone(),
                                seed: *seed,
                                kv: *kv,
                                rate,
                                load: self.rate.is_none().then_some(*load),
                                warmup_s: self.warmup_s,
                                duration_s: self.duration_s,
                                time_scale: self.time_scale_for(*kv),
                                fleet: self.fleet,
                                slo: self.slo,
                            });
                        }
                    }
                }
            }
        }
        Ok(out)
    }
}

/// Command-line overrides of a suite.
#[derive(Debug, Clone, Args, Default)]
pub struct SuiteArgs {
    /// Where runs.jsonl, capacity.json, the report and plots go (default:
    /// bench-results, or target/bench-quick for `quick`).
    #[arg(long)]
    pub out: Option<PathBuf>,
    /// Keep earlier records of this suite in runs.jsonl and run only the
    /// missing cells, reusing runs another suite made with the same settings
    /// (otherwise the suite's records are replaced).
    #[arg(long)]
    pub resume: bool,
    /// Print the cells and the estimated duration, run nothing.
    #[arg(long)]
    pub dry_run: bool,
    /// Workloads (comma-separated): no-prefix, bursty, tenants, chat, replay.
    #[arg(long, value_delimiter = ',')]
    pub workloads: Vec<String>,
    /// Variants (comma-separated specs or aliases; see bench/README.md).
    #[arg(long, value_delimiter = ',')]
    pub variants: Vec<String>,
    /// Seeds 1..=N.
    #[arg(long)]
    pub seeds: Option<u64>,
    /// Offered loads as fractions of capacity (comma-separated).
    #[arg(long, value_delimiter = ',')]
    pub loads: Vec<f64>,
    /// A fixed offered rate (requests per simulated second) instead of loads.
    #[arg(long)]
    pub rate: Option<f64>,
    /// KV sizes per rank (comma-separated): small, large.
    #[arg(long, value_delimiter = ',')]
    pub kv: Vec<Kv>,
    /// Simulated seconds of measured arrivals per run.
    #[arg(long)]
    pub duration: Option<f64>,
    /// Simulated seconds of arrivals before the measured ones (not counted).
    #[arg(long)]
    pub warmup: Option<f64>,
    /// Simulated time runs this many times faster than wall time (default per KV size).
    #[arg(long)]
    pub time_scale: Option<f64>,
    /// The variant ratios are taken against.
    #[arg(long)]
    pub reference: Option<String>,
    /// Workers (regular mode) and ranks per worker.
    #[arg(long)]
    pub workers: Option<usize>,
    #[arg(long)]
    pub dp_size: Option<usize>,
    /// A block-hash JSONL trace for the replay workload (default: a synthetic one per seed).
    #[arg(long)]
    pub replay_trace: Option<PathBuf>,
    #[arg(long)]
    pub replay_input_scale: Option<f64>,
    #[arg(long)]
    pub replay_output_scale: Option<f64>,
    /// Goodput SLO, simulated ms.
    #[arg(long)]
    pub slo_ttft_ms: Option<f64>,
    #[arg(long)]
    pub slo_tpot_ms: Option<f64>,
    /// Measure capacities again even if capacity.json has them.
    #[arg(long)]
    pub remeasure: bool,
    /// Suite name in the records and report (default: the preset's).
    #[arg(long)]
    pub name: Option<String>,
}

impl SuiteArgs {
    pub fn apply(&self, mut suite: Suite) -> Result<Suite, String> {
        if let Some(name) = &self.name {
            suite.name = name.clone();
        }
        if let Some(out) = &self.out {
            suite.out = out.clone();
        }
        if !self.workloads.is_empty() {
            suite.workloads = self
                .workloads
                .iter()
                .map(|w| WorkloadKind::parse(w).map(Workload::new))
                .collect::<Result<_, _>>()?;
        }
        let replay = ReplaySource {
            file: self.replay_trace.clone(),
            input_scale: self
                .replay_input_scale
                .unwrap_or(crate::workload::replay::DEFAULT_INPUT_SCALE),
            output_scale: self.replay_output_scale.unwrap_or(1.0),
        };
        for w in &mut suite.workloads {
            w.replay = replay.clone();
        }
        if !self.variants.is_empty() {
            suite.variants = self.variants.clone();
        }
        if let Some(n) = self.seeds {
            suite.seeds = seeds(n.max(1));
        }
        if !self.loads.is_empty() {
            suite.loads = self.loads.clone();
        }
        if self.rate.is_some() {
            suite.rate = self.rate;
            suite.loads = vec![f64::NAN];
        }
        if !self.kv.is_empty() {
            suite.kvs = self.kv.clone();
        }
        if let Some(d) = self.duration {
            suite.duration_s = d;
        }
        if let Some(w) = self.warmup {
            suite.warmup_s = w;
        }
        if self.time_scale.is_some() {
            suite.time_scale = self.time_scale;
        }
        if let Some(r) = &self.reference {
            suite.reference = r.clone();
        }
        if let Some(w) = self.workers {
            suite.fleet.workers = w;
        }
        if let Some(d) = self.dp_size {
            suite.fleet.dp_size = d;
        }
        if let Some(t) = self.slo_ttft_ms {
            suite.slo.ttft_ms = t;
        }
        if let Some(t) = self.slo_tpot_ms {
            suite.slo.tpot_ms = t;
        }
        // Fail early on a bad spec.
        for v in &suite.variants {
            Variant::parse(v)?;
        }
        Ok(suite)
    }
}

/// Estimated wall seconds of one run: start-up (smg takes longer than
/// Envoy), then the arrivals and the wait for the last first token, in
/// simulated seconds divided by the time scale. Chat sessions run on to the
/// turn horizon. Calibrated on smoke runs (bench/README.md, "Budgets").
pub fn estimate_run_s(cell: &Cell) -> f64 {
    let startup = if cell.variant.uses_smg() { 2.5 } else { 1.5 } * cell.variant.gateways as f64;
    let tail_sim = match cell.workload.kind {
        WorkloadKind::Chat => crate::workload::chat::TAIL_S + 5.0,
        _ => 5.0,
    };
    startup + (cell.warmup_s + cell.duration_s + tail_sim) / cell.time_scale
}

/// Runs `suite`, appending records to `<out>/runs.jsonl`, then writes its report.
pub async fn run_suite(
    tools: &Tools,
    suite: &Suite,
    args: &SuiteArgs,
    command_line: &str,
) -> Result<(), String> {
    let started = Instant::now();
    let features = SimFeatures::detect(&tools.sim)?;
    let results = ResultsFile::new(&suite.out.join("runs.jsonl"));
    let capacities = CapacityFile::new(&suite.out);

    // Capacities first (they decide the offered rates).
    let mut rates: Vec<(String, Kv, f64)> = Vec::new();
    if suite.rate.is_none() {
        for workload in &suite.workloads {
            for kv in &suite.kvs {
                let known = if args.remeasure {
                    None
                } else {
                    capacities.lookup(workload, *kv, &suite.fleet)?
                };
                let entry = match known {
                    Some(entry) => entry,
                    None if args.dry_run => {
                        println!(
                            "capacity of {} with KV {} unknown: about 1 min to measure",
                            workload.kind.name(),
                            kv.name()
                        );
                        continue;
                    }
                    None => {
                        let entry = capacity::measure(
                            tools,
                            &features,
                            workload,
                            *kv,
                            suite.fleet,
                            suite.time_scale_for(*kv),
                        )
                        .await?;
                        capacities.store(&entry)?;
                        entry
                    }
                };
                rates.push((capacity::workload_key(workload), *kv, entry.rps));
            }
        }
    }
    let rate_of = |w: &Workload, kv: Kv, load: f64| -> Result<f64, String> {
        let key = capacity::workload_key(w);
        match rates.iter().find(|(k, v, _)| *k == key && *v == kv) {
            Some((_, _, capacity)) => Ok(capacity * load),
            None if args.dry_run => Ok(f64::NAN),
            None => Err(format!("no capacity for {key} with KV {}", kv.name())),
        }
    };
    let mut suite = suite.clone();
    if suite.variants.iter().any(|v| v.contains(BEST_PD_POLICY)) {
        let (policy, why) = best_pd_policy(&results.load()?);
        println!("smg's best PD policy: {policy} ({why})");
        for v in &mut suite.variants {
            *v = v.replace(BEST_PD_POLICY, &policy);
        }
        suite
            .about
            .push_str(&format!("; smg's best PD policy taken as `{policy}`: {why}"));
    }
    let suite = &suite;
    let cells = suite.cells(&rate_of)?;
    let done = if args.resume {
        let records = results.load()?;
        let reused = reusable(&records, &suite.name, &cells);
        if !reused.is_empty() {
            println!(
                "{} run(s) another suite made with the same settings are reused",
                reused.len()
            );
        }
        if !args.dry_run {
            for record in &reused {
                results.append(record)?;
            }
        }
        records.iter().chain(&reused).map(|r| r.key.clone()).collect()
    } else {
        HashSet::new()
    };
    let todo: Vec<&Cell> = cells.iter().filter(|c| !done.contains(&c.key())).collect();
    let estimate: f64 = todo.iter().map(|c| estimate_run_s(c)).sum();
    println!(
        "suite {}: {} runs ({} already done), estimated {:.0} min; writing to {}",
        suite.name,
        todo.len(),
        cells.len() - todo.len(),
        estimate / 60.0,
        results.path.display()
    );
    if args.dry_run {
        for c in &todo {
            println!(
                "  {} {} kv={} rate={:.2} seed={} ts={} ~{:.0} s",
                c.workload.kind.name(),
                c.variant.name,
                c.kv.name(),
                c.rate,
                c.seed,
                c.time_scale,
                estimate_run_s(c)
            );
        }
        return Ok(());
    }
    if !args.resume {
        drop_suite_records(&results, &suite.name)?;
    }
    let mut skipped: Vec<(String, String)> = Vec::new();
    let mut failed: Vec<String> = Vec::new();
    for (i, cell) in todo.iter().enumerate() {
        if skipped.iter().any(|(v, _)| *v == cell.variant.name) {
            continue;
        }
        // A run that fails (a process that would not start, say) is
        // reported and the suite goes on; `--resume` retries it later.
        let outcome = match run_cell(tools, &features, cell, true).await {
            Ok(outcome) => outcome,
            Err(e) => {
                println!(
                    "[{}/{}] {} {} s{}: run failed: {e}",
                    i + 1,
                    todo.len(),
                    cell.workload.kind.name(),
                    cell.variant.name,
                    cell.seed
                );
                failed.push(format!(
                    "{} {} seed {}: {e}",
                    cell.workload.kind.name(),
                    cell.variant.name,
                    cell.seed
                ));
                continue;
            }
        };
        match outcome {
            Ok(run) => {
                let record = run.record;
                println!(
                    "[{}/{}] {} {} s{}: TTFT p50 {:.0} p99 {:.0} ms, goodput {:.1} %, {} errors, {:.0} s wall",
                    i + 1,
                    todo.len(),
                    record.workload,
                    record.variant,
                    record.seed,
                    record.ttft_p50,
                    record.ttft_p99,
                    record.goodput * 100.0,
                    record.errors,
                    record.wall_s
                );
                results.append(&record)?;
            }
            Err(Skipped(reason)) => {
                println!("  {}: skipped, {reason}", cell.variant.name);
                skipped.push((cell.variant.name.clone(), reason));
            }
        }
    }
    let records: Vec<RunRecord> = results
        .load()?
        .into_iter()
        .filter(|r| r.suite == suite.name)
        .collect();
    let path = write_report(&suite.out, suite, &records, &skipped, command_line, &capacities)?;
    println!(
        "suite {} done in {:.1} min; wrote {}",
        suite.name,
        started.elapsed().as_secs_f64() / 60.0,
        path.display()
    );
    if !failed.is_empty() {
        return Err(format!(
            "{} run(s) failed (the report holds the others; --resume retries them):\n  {}",
            failed.len(),
            failed.join("\n  ")
        ));
    }
    Ok(())
}

/// With `--resume`, a cell another suite already ran into the same results
/// file (same workload, KV, variant, rate, seed, durations and time scale) is
/// not run again: its record is copied under this suite's name. So `tables`
/// after `bench` runs only the baselines `bench` lacks.
fn reusable(records: &[RunRecord], suite: &str, cells: &[Cell]) -> Vec<RunRecord> {
    let done: HashSet<&str> = records.iter().map(|r| r.key.as_str()).collect();
    // The first run of each setting made by another suite.
    let mut others: HashMap<&str, &RunRecord> = HashMap::new();
    for r in records.iter().filter(|r| r.suite != suite) {
        others.entry(settings_of(&r.key)).or_insert(r);
    }
    let mut out = Vec::new();
    for cell in cells {
        let key = cell.key();
        if done.contains(key.as_str()) {
            continue;
        }
        if let Some(earlier) = others.get(settings_of(&key)) {
            let mut copy = (*earlier).clone();
            copy.suite = suite.to_string();
            copy.key = key;
            out.push(copy);
        }
    }
    out
}

/// Removes a suite's records from the results file (a fresh run replaces them).
fn drop_suite_records(results: &ResultsFile, suite: &str) -> Result<(), String> {
    let kept: Vec<RunRecord> = results.load()?.into_iter().filter(|r| r.suite != suite).collect();
    if results.path.exists() {
        std::fs::remove_file(&results.path)
            .map_err(|e| format!("cannot rewrite {}: {e}", results.path.display()))?;
    }
    for r in &kept {
        results.append(r)?;
    }
    Ok(())
}

/// Writes `<out>/<suite>.md` (and plots) from the suite's records.
pub fn write_report(
    out: &Path,
    suite: &Suite,
    records: &[RunRecord],
    skipped: &[(String, String)],
    command_line: &str,
    capacities: &CapacityFile,
) -> Result<PathBuf, String> {
    std::fs::create_dir_all(out).map_err(|e| format!("cannot create {}: {e}", out.display()))?;
    let mut md = report_header(
        &format!("dprank benchmark `{}`: {}", suite.name, suite.about),
        command_line,
    );
    let groups = group(records);
    let _ = writeln!(
        md,
        "Every cell: the median over seeds (each seed a different trace, every variant on a fresh simulated fleet). Latencies in simulated ms. Ratios: `{}` ÷ the variant on the same seed, median over seeds with a 95% percentile-bootstrap interval ({} resamples); below 1 means `{}` had the lower TTFT, above 1 the higher goodput. How each figure is measured: bench/README.md.\n",
        suite.reference,
        crate::stats::BOOTSTRAP_RESAMPLES,
        suite.reference
    );
    if !skipped.is_empty() {
        let _ = writeln!(md, "Skipped:");
        for (variant, reason) in skipped {
            let _ = writeln!(md, "- `{variant}`: {reason}");
        }
        md.push('\n');
    }
    let loads: std::collections::BTreeSet<u64> = groups
        .iter()
        .filter_map(|g| g.load)
        .map(|l| (l * 1000.0) as u64)
        .collect();
    let sweep = loads.len() > 1;
    for (i, g) in groups.iter().enumerate() {
        let _ = writeln!(md, "## {}\n", group_title(g));
        md.push_str(&group_table(g, &suite.reference));
        md.push_str(&group_notes(g));
        md.push('\n');
        if !sweep {
            // The whole TTFT distribution, every request of every seed.
            let file = format!("{}-{}-{}-ttft-cdf.png", suite.name, g.workload, i + 1);
            let series: Vec<(String, Vec<f64>)> = g
                .variants
                .iter()
                .map(|(v, runs)| {
                    (
                        v.clone(),
                        runs.iter()
                            .flat_map(|r| r.ttft_ms.iter().map(|t| f64::from(*t)))
                            .collect(),
                    )
                })
                .collect();
            plot::cdf(
                &out.join(&file),
                &format!("TTFT CDF, {} (all seeds pooled)", g.workload),
                "TTFT, simulated ms (log scale)",
                &series,
            )?;
            let _ = writeln!(md, "![TTFT CDF, {}]({file})\n", g.workload);
        }
    }
    // Sweep plots: a metric against the offered load, per workload and KV.
    if sweep {
        let _ = writeln!(md, "## Against the offered load\n");
        let p99 = report::sweep_series(&groups, |r| r.ttft_p99);
        let good = report::sweep_series(&groups, |r| r.goodput);
        for ((workload, kv), series) in &p99 {
            let file = format!("{}-{workload}-{kv}-ttft-p99.png", suite.name);
            plot::lines(
                &out.join(&file),
                &format!("TTFT p99 (median over seeds), {workload}, KV {kv}"),
                "offered load, share of measured capacity",
                "TTFT p99, simulated ms (log)",
                series,
                true,
            )?;
            let _ = writeln!(md, "![TTFT p99, {workload}, KV {kv}]({file})\n");
            if let Some(series) = good.get(&(workload.clone(), kv.clone())) {
                let file = format!("{}-{workload}-{kv}-goodput.png", suite.name);
                plot::lines(
                    &out.join(&file),
                    &format!("goodput (median over seeds), {workload}, KV {kv}"),
                    "offered load, share of measured capacity",
                    "share of requests within the SLO",
                    series,
                    false,
                )?;
                let _ = writeln!(md, "![goodput, {workload}, KV {kv}]({file})\n");
            }
        }
    }
    let _ = writeln!(md, "## Set-up\n");
    let fleet = records.first().map_or(String::new(), |r| r.fleet.clone());
    let _ = writeln!(
        md,
        "- Fleet: {fleet}, simulated (`dprank-sim`), a fresh fleet per run."
    );
    for kv in &suite.kvs {
        let _ = writeln!(
            md,
            "- KV `{}`: {}; time scale {}.",
            kv.name(),
            kv.describe(),
            suite.time_scale_for(*kv)
        );
    }
    let _ = writeln!(
        md,
        "- Seeds: {:?}; {} simulated s of arrivals per run.",
        suite.seeds, suite.duration_s
    );
    let _ = writeln!(md, "- Workloads:");
    for w in &suite.workloads {
        let _ = writeln!(md, "  - `{}`: {}", w.kind.name(), w.describe());
    }
    let _ = writeln!(md, "- Variants:");
    for v in &suite.variants {
        if let Ok(variant) = Variant::parse(v) {
            let _ = writeln!(md, "  - `{v}`: {}", variant.describe());
        }
    }
    let entries = capacities.load()?;
    if !entries.is_empty() {
        let _ = writeln!(md, "- Capacities (capacity.json; procedure in bench/README.md):");
        for e in entries {
            let _ = writeln!(
                md,
                "  - `{}`, KV {}, {}: {:.2} req/s ({} at {:.1} req/s offered, time scale {}, {})",
                e.workload, e.kv, e.fleet, e.rps, e.router, e.offered_rps, e.time_scale, e.measured
            );
        }
    }
    let path = out.join(format!("{}.md", suite.name));
    std::fs::write(&path, md).map_err(|e| format!("cannot write {}: {e}", path.display()))?;
    Ok(path)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn presets_parse_and_order_cells_seed_first() {
        for name in ["quick", "bench", "tables", "sweep", "pd", "pd-policies", "run"] {
            let suite = Suite::preset(name).unwrap();
            for v in &suite.variants {
                Variant::parse(v).unwrap();
            }
        }
        assert!(Suite::preset("nope").is_err());
        let suite = Suite::preset("quick").unwrap();
        let cells = suite.cells(&|_, _, load| Ok(10.0 * load)).unwrap();
        assert_eq!(cells.len(), 2 * 6 * 3);
        assert_eq!(cells[0].seed, 1);
        assert_eq!(cells[1].seed, 1);
        assert_ne!(cells[0].variant.name, cells[1].variant.name);
        assert_eq!(cells[0].rate, 8.5);
        assert_eq!(cells.last().unwrap().seed, 3);
    }

    #[test]
    fn the_best_pd_policy_comes_from_the_policy_scan() {
        let record = |suite: &str, variant: &str, p99: f64| RunRecord {
            suite: suite.into(),
            variant: variant.into(),
            ttft_p99: p99,
            ..crate::report::tests::record("x", 1, p99, 1.0)
        };
        assert_eq!(best_pd_policy(&[]).0, "cache_aware");
        let records = vec![
            record("pd-policies", "smg-pd-cache-aware:interval=1", 900.0),
            record("pd-policies", "smg-pd-least-load:interval=1", 500.0),
            record("pd-policies", "smg-pd-least-load:interval=1", 700.0),
            record("pd-policies", "dprank-pd:poll-wall=1000", 100.0),
            record("pd", "smg-pd-power-of-two:interval=1", 1.0),
        ];
        let (policy, why) = best_pd_policy(&records);
        assert_eq!(policy, "least_load");
        assert!(
            why.contains("least_load 600 ms") && why.contains("cache_aware 900 ms"),
            "{why}"
        );
    }

    #[test]
    fn resume_reuses_another_suites_run_of_the_same_cell() {
        let bench = Suite::preset("bench").unwrap();
        let tables = Suite::preset("tables").unwrap();
        let rate = |_: &Workload, _: Kv, load: f64| Ok(10.0 * load);
        let bench_cells = bench.cells(&rate).unwrap();
        let tables_cells = tables.cells(&rate).unwrap();
        let ran = |c: &Cell| RunRecord {
            key: c.key(),
            suite: c.suite.clone(),
            variant: c.variant.name.clone(),
            ..crate::report::tests::record("x", c.seed, 1.0, 1.0)
        };
        let records: Vec<RunRecord> = bench_cells.iter().map(ran).collect();
        let reused = reusable(&records, "tables", &tables_cells);
        // Every `bench` run is reused, under `tables`' name and key.
        assert_eq!(reused.len(), bench_cells.len());
        let keys: HashSet<String> = tables_cells.iter().map(Cell::key).collect();
        assert!(reused
            .iter()
            .all(|r| r.suite == "tables" && keys.contains(&r.key)));
        // Runs `tables` made itself are not copied again; other settings never match.
        let mut records = records;
        records.extend(reused);
        assert!(reusable(&records, "tables", &tables_cells).is_empty());
        let longer = Suite {
            duration_s: 30.0,
            ..tables
        };
        assert!(reusable(&records, "tables", &longer.cells(&rate).unwrap()).is_empty());
    }

    #[test]
    fn overrides_apply_and_bad_variants_fail_early() {
        let args = SuiteArgs {
            variants: vec!["dprank:gw=4".into(), "rr".into()],
            seeds: Some(2),
            rate: Some(7.0),
            workloads: vec!["chat".into()],
            ..SuiteArgs::default()
        };
        let suite = args.apply(Suite::preset("run").unwrap()).unwrap();
        let cells = suite.cells(&|_, _, _| Err("no capacity needed".into())).unwrap();
        assert_eq!(cells.len(), 4);
        assert!(cells.iter().all(|c| c.rate == 7.0 && c.load.is_none()));
        assert_eq!(cells[0].variant.gateways, 4);
        let bad = SuiteArgs {
            variants: vec!["dprank:nope=1".into()],
            ..SuiteArgs::default()
        };
        assert!(bad.apply(Suite::preset("run").unwrap()).is_err());
    }
}
