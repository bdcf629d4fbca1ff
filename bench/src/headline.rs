//! `make bench` (`dprank-bench bench`): the headline, regenerated at the
//! current commit, one folder per simulator preset under `--out` (by
//! default the two ends of the lockstep bracket), and in each one folder
//! per question, each with a README line (question, command, commit, date,
//! machine), and an index:
//!
//! - `capacity/`: the sustainable capacity per workload and KV (virtual time);
//! - `capacity-check/`: 10 minutes at 85% of it (the clairvoyant chooser's
//!   TTFT p90 within the SLO: the capacity is real) and at 110% (its TTFT
//!   grows: the capacity is a limit);
//! - `virtual/`: every workload and two public traces at 50/70/85/95% of
//!   capacity, small and large KV, judging seeds, in virtual time;
//! - `harness/` (first preset only): three cells on the harness (real
//!   Envoy, real smg at its default and its best setting) at 85%;
//! - `agreement/` (first preset only): harness ÷ virtual TTFT p90 for
//!   dprank and in-server in those cells, with intervals.
//!
//! smg's best setting comes from `smg-sweep` (tuning seeds; one file for
//! every preset, `--out/smg-sweep/smg-best.json`), run before;
//! without its `smg-best.json` the tables carry smg's default only and say so.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use clap::Args;

use crate::capacity::{self, CapacityFile};
use crate::fleet::Tools;
use crate::folders::{folder_readme, QUESTIONS};
use crate::offline::{driver, sim_config};
use crate::preset;
use crate::preset::Kv;
use crate::provenance::Provenance;
use crate::report::{markdown_table, pooled_ttft, report_header};
use crate::runner::{FleetShape, ResultsFile, RunRecord};
use crate::seeds::SeedSet;
use crate::stats::{cluster_estimate, paired_cluster_ratio, percentile, Pooled, SeedRequests, Slo};
use crate::suites::{self, run_suite, Suite, SuiteArgs, SMG_BEST_FILE};
use crate::variant::Variant;
use crate::workload::{Shape, Workload, WorkloadKind};

/// The budget `make bench` must fit on this machine.
pub const BUDGET_S: f64 = 2.0 * 3600.0;

/// The headline's presets: the low and the high end of the lockstep
/// penalty's bracket (`sim/README.md`, "Step costs"), so every comparison
/// shows whether its winner changes across what the figures cannot pin.
pub const HEADLINE_PRESETS: [&str; 2] = ["deepseek-v3-ep-low", "deepseek-v3-ep-high"];

#[derive(Debug, Clone, Args)]
pub struct BenchArgs {
    /// The results directory: one folder per question below it.
    #[arg(long, default_value = "bench-results/headline")]
    pub out: PathBuf,
    /// Keep finished runs and run only the missing ones.
    #[arg(long)]
    pub resume: bool,
    /// Print what would run and the estimated time, run nothing.
    #[arg(long)]
    pub dry_run: bool,
    /// Judging seeds of the virtual-time tables (5, and 1 on the harness,
    /// fit the budget at both ends on a 2-core machine: bench/README.md,
    /// "Budget").
    #[arg(long, default_value_t = 5)]
    pub seeds: u64,
    /// Judging seeds of the harness cells.
    #[arg(long, default_value_t = 1)]
    pub harness_seeds: u64,
    /// Judging seeds of the capacity check.
    #[arg(long, default_value_t = 3)]
    pub check_seeds: u64,
    /// Simulator presets, each a folder of its own under `--out` (default:
    /// the two ends of the lockstep bracket); the harness cells run on the
    /// first.
    #[arg(long = "sim-preset", value_delimiter = ',', default_values_t = HEADLINE_PRESETS.map(String::from))]
    pub sim_presets: Vec<String>,
    /// Harness time scale (default: the preset's per KV).
    #[arg(long)]
    pub time_scale: Option<f64>,
    /// Virtual-time runs at once (default: the cores).
    #[arg(long)]
    pub jobs: Option<usize>,
    /// Directory of the Mooncake traces.
    #[arg(long)]
    pub trace_dir: Option<PathBuf>,
    /// smg's best settings (default: <out>/smg-sweep/smg-best.json).
    #[arg(long)]
    pub smg_best: Option<PathBuf>,
    /// Skip the harness part (virtual time only).
    #[arg(long)]
    pub no_harness: bool,
    /// Put runs of different commits or machines in one table, flagged.
    #[arg(long)]
    pub allow_mixed: bool,
    /// Smoke runs only: simulated seconds of warm-up and of measured
    /// arrivals, and requests per seed, instead of the headline's 60, 300
    /// and 1,000 (a report made so is no headline).
    #[arg(long)]
    pub warmup: Option<f64>,
    #[arg(long)]
    pub duration: Option<f64>,
    #[arg(long)]
    pub min_requests: Option<usize>,
}

/// Writes the index of the results directory: one line per folder present.
fn index(out: &Path) -> Result<(), String> {
    let mut md = String::from(
        "# Results\n\nOne folder per question; each README names its command, commit, date and machine.\n\n",
    );
    let mut rows = Vec::new();
    for (folder, q) in QUESTIONS {
        let readme = out.join(folder).join("README.md");
        if let Ok(text) = std::fs::read_to_string(&readme) {
            let field = |name: &str| {
                text.lines()
                    .find_map(|l| l.strip_prefix(&format!("- {name}: ")))
                    .unwrap_or("")
                    .to_string()
            };
            rows.push(vec![
                format!("[{folder}/]({folder}/)"),
                q.to_string(),
                field("commit"),
                field("date"),
                field("machine"),
            ]);
        }
    }
    md.push_str(&markdown_table(
        &["folder", "question", "commit", "date", "machine"],
        &rows,
    ));
    std::fs::write(out.join("README.md"), md)
        .map_err(|e| format!("cannot write {}/README.md: {e}", out.display()))
}

fn suite_args(args: &BenchArgs, out: &Path) -> SuiteArgs {
    SuiteArgs {
        out: Some(out.to_path_buf()),
        resume: args.resume,
        dry_run: args.dry_run,
        sim_preset: Some(args.sim_presets[0].clone()),
        trace_dir: args.trace_dir.clone(),
        capacity_dir: Some(args.out.join("capacity")),
        // Set by `bench` for every preset (one file for all of them).
        smg_best: args.smg_best.clone(),
        jobs: args.jobs,
        time_scale: args.time_scale,
        allow_mixed: args.allow_mixed,
        warmup: args.warmup,
        duration: args.duration,
        min_requests: args.min_requests,
        ..SuiteArgs::default()
    }
}

/// The virtual-time suite of the headline.
fn virtual_suite(args: &BenchArgs) -> Result<(Suite, SuiteArgs), String> {
    let sa = SuiteArgs {
        seeds: Some(args.seeds),
        ..suite_args(args, &args.out.join("virtual"))
    };
    Ok((sa.apply(Suite::named("virtual")?)?, sa))
}

/// The harness suite of the headline.
fn harness_suite(args: &BenchArgs) -> Result<(Suite, SuiteArgs), String> {
    let sa = SuiteArgs {
        seeds: Some(args.harness_seeds),
        ..suite_args(args, &args.out.join("harness"))
    };
    Ok((sa.apply(Suite::named("harness")?)?, sa))
}

pub async fn bench(
    tools: Option<&Tools>,
    args: &BenchArgs,
    command_line: &str,
    root: &Path,
) -> Result<(), String> {
    if args.sim_presets.is_empty() {
        return Err("--sim-preset: name at least one preset".into());
    }
    let mut total_s = 0.0;
    for (i, name) in args.sim_presets.iter().enumerate() {
        preset::preset(name)?;
        let one = BenchArgs {
            out: args.out.join(name),
            sim_presets: vec![name.clone()],
            no_harness: args.no_harness || i > 0,
            smg_best: Some(
                args.smg_best
                    .clone()
                    .unwrap_or_else(|| args.out.join("smg-sweep").join(SMG_BEST_FILE)),
            ),
            ..args.clone()
        };
        println!("preset `{name}`: {}", one.out.display());
        total_s += bench_preset(tools, &one, command_line, root).await?;
    }
    if args.dry_run {
        println!(
            "make bench, every preset: {:.0} min of a {:.0} min budget",
            total_s / 60.0,
            BUDGET_S / 60.0
        );
        if total_s > BUDGET_S {
            println!("OVER BUDGET: lower --seeds / --harness-seeds or raise --jobs");
        }
        return Ok(());
    }
    presets_index(&args.out, &args.sim_presets)?;
    println!("wrote {}/README.md", args.out.display());
    Ok(())
}

/// The index of the headline: one line per preset folder, those just run
/// first, then any other preset's folder present (an earlier headline).
fn presets_index(out: &Path, presets: &[String]) -> Result<(), String> {
    let mut md = String::from(
        "# The headline\n\nOne folder per simulator preset (`make bench`, `dprank-bench bench`); each indexes its questions (capacity, capacity check, virtual time, and on the first preset the harness cells and their agreement with virtual time).\n\n",
    );
    let run_now = |name: &str| presets.iter().any(|p| p == name);
    let earlier = preset::PRESETS
        .iter()
        .filter(|p| !run_now(p.name) && out.join(p.name).join("README.md").exists());
    for p in presets
        .iter()
        .filter_map(|name| preset::preset(name).ok())
        .chain(earlier)
    {
        let when = if run_now(p.name) {
            ""
        } else {
            " (an earlier headline, not regenerated by this run)"
        };
        let _ = writeln!(md, "- [{0}/]({0}/){when}: {1}", p.name, p.about);
    }
    std::fs::write(out.join("README.md"), md)
        .map_err(|e| format!("cannot write {}/README.md: {e}", out.display()))
}

/// The headline on one preset (`args.sim_presets[0]`) into `args.out`; the
/// estimated seconds on a dry run.
async fn bench_preset(
    tools: Option<&Tools>,
    args: &BenchArgs,
    command_line: &str,
    root: &Path,
) -> Result<f64, String> {
    let provenance = Provenance::current(root, command_line);
    let (virtual_suite, virtual_args) = virtual_suite(args)?;
    let (harness, harness_args) = harness_suite(args)?;
    // 1. Capacities (also what the dry run needs to know the rates).
    let capacity_dir = args.out.join("capacity");
    let file = CapacityFile::new(&capacity_dir);
    let mut all = virtual_suite.clone();
    all.workloads.extend(harness.workloads.iter().cloned());
    all.workloads.dedup_by(|a, b| a.name() == b.name());
    let measured_before = file.load()?.len();
    let started = std::time::Instant::now();
    let slos = suites::Slos::of_suite(&all)?;
    let rates = suites::capacities(&all, &slos, &file, false, args.dry_run, &provenance)?;
    if !args.dry_run {
        folder_readme(
            &capacity_dir,
            "capacity",
            &provenance,
            &format!(
                "SLOs: {}. Entries in capacity.json:\n\n{}",
                slos.describe(),
                file.load()?
                    .iter()
                    .filter(|e| e.method == capacity::METHOD)
                    .map(|e| format!("- {}", e.describe()))
                    .collect::<Vec<_>>()
                    .join("\n")
            ),
        )?;
        if file.load()?.len() > measured_before {
            println!(
                "capacities measured in {:.1} min",
                started.elapsed().as_secs_f64() / 60.0
            );
        }
    }
    // 2. The capacity check, in virtual time.
    let check = CheckArgs {
        out: args.out.join("capacity-check"),
        capacity_dir: capacity_dir.clone(),
        seeds: args.check_seeds,
        sim_preset: args.sim_presets[0].clone(),
        trace_dir: args.trace_dir.clone(),
        jobs: args.jobs,
        workloads: Vec::new(),
        kv: vec![Kv::Small, Kv::Large],
        dry_run: args.dry_run,
    };
    let check_s = capacity_check(&check, command_line, root)?;
    // 3. and 4.: the virtual tables and the harness cells.
    let virtual_s = estimate(&virtual_suite, &rates, None);
    let best_known = harness
        .smg_best
        .as_ref()
        .is_some_and(|p| suites::SmgBest::load(p).ok().flatten().is_some());
    let harness_s = if args.no_harness {
        0.0
    } else if best_known {
        estimate(&harness, &rates, None)
    } else {
        // Until smg-sweep has run, count the dearest case: a best setting
        // without --dp-aware, with dprank's wall-poll control beside it.
        let worst = suites::SmgBest {
            preset: harness.preset.name.into(),
            kv: "small".into(),
            load: 0.85,
            seeds: Vec::new(),
            criterion: "estimate".into(),
            choices: harness
                .workloads
                .iter()
                .map(|w| suites::SmgChoice {
                    workload: w.name(),
                    variant: "smg-cache-aware-workers".into(),
                    p90_ms: f64::NAN,
                    default_p90_ms: f64::NAN,
                })
                .collect(),
            provenance: None,
        };
        println!(
            "smg's best settings not found ({}): run `dprank-bench smg-sweep --out {}` first; the estimate counts smg's best and dprank's wall-poll control in every harness cell",
            harness.smg_best.as_ref().map_or(String::new(), |p| p.display().to_string()),
            harness
                .smg_best
                .as_ref()
                .and_then(|p| p.parent())
                .map_or(String::new(), |d| d.display().to_string())
        );
        estimate(&harness, &rates, Some(&worst))
    };
    if args.dry_run {
        let total = check_s + virtual_s + harness_s;
        println!(
            "preset `{}`, estimated: capacity check {:.0} min + virtual time {:.0} min ({} jobs) + harness {:.0} min = {:.0} min{}",
            args.sim_presets[0],
            check_s / 60.0,
            virtual_s / 60.0,
            virtual_suite.jobs,
            harness_s / 60.0,
            total / 60.0,
            if rates.len() < all.workloads.len() * 2 {
                " (capacities still to measure are not counted: a few minutes each)"
            } else {
                ""
            }
        );
        return Ok(total);
    }
    run_suite(tools, &virtual_suite, &virtual_args, command_line, root).await?;
    folder_readme(
        &args.out.join("virtual"),
        "virtual",
        &provenance,
        "Tables: [virtual.md](virtual.md); records: runs.jsonl (committed packed as runs.jsonl.gz, `dprank-bench pack`; every command reads either).",
    )?;
    if !args.no_harness {
        run_suite(tools, &harness, &harness_args, command_line, root).await?;
        folder_readme(
            &args.out.join("harness"),
            "harness",
            &provenance,
            "Tables: [harness.md](harness.md); records: runs.jsonl (every run carries its CPU use per process and a CPU-bound flag).",
        )?;
        // 5. Agreement.
        let agreement = agreement(&args.out.join("harness"), &args.out.join("virtual"))?;
        let dir = args.out.join("agreement");
        folder_readme(&dir, "agreement", &provenance, &agreement)?;
    }
    index(&args.out)?;
    Ok(0.0)
}

/// Estimated wall seconds of a suite with the known capacities (smg's best
/// settings from the suite's file, or `best`).
fn estimate(suite: &Suite, rates: &[(String, Kv, f64, String)], best: Option<&suites::SmgBest>) -> f64 {
    let rate_of = |w: &Workload, kv: Kv, load: f64| -> Result<(f64, Option<(String, f64)>), String> {
        Ok(suites::capacity_of(rates, w, kv).map_or((f64::NAN, None), |(c, _)| (c * load, None)))
    };
    let slo = Slo {
        ttft_ms: 1.0,
        tpot_ms: 1.0,
    };
    let stored = suite
        .smg_best
        .as_ref()
        .and_then(|p| suites::SmgBest::load(p).ok().flatten());
    let Ok(cells) = suite.cells(
        &rate_of,
        &|_, _| Ok(slo),
        best.or(stored.as_ref()),
        &Provenance::default(),
    ) else {
        return f64::NAN;
    };
    let known: Vec<&crate::runner::Cell> = cells.iter().filter(|c| c.rate.is_finite()).collect();
    suites::suite_estimate_s(suite, &known)
}

/// The agreement table: harness ÷ virtual TTFT p90, pooled, per cell, for
/// dprank and in-server, paired by seed.
pub fn agreement(harness_dir: &Path, virtual_dir: &Path) -> Result<String, String> {
    let harness = ResultsFile::new(&harness_dir.join("runs.jsonl")).load()?;
    let virtual_runs = ResultsFile::new(&virtual_dir.join("runs.jsonl")).load()?;
    let requests = |records: &[RunRecord], r: &RunRecord| -> Vec<SeedRequests> {
        records
            .iter()
            .filter(|x| {
                x.workload == r.workload && x.kv == r.kv && x.variant == r.variant && x.load == r.load
            })
            .map(RunRecord::requests)
            .collect()
    };
    let mut rows = Vec::new();
    let mut seen: Vec<(String, String, String)> = Vec::new();
    for r in harness
        .iter()
        .filter(|r| ["dprank", "in-server"].contains(&r.variant.as_str()))
    {
        let key = (r.workload.clone(), r.kv.clone(), r.variant.clone());
        if seen.contains(&key) {
            continue;
        }
        seen.push(key);
        let h = requests(&harness, r);
        let v = requests(&virtual_runs, r);
        let p90 = |side: &[SeedRequests]| cluster_estimate(&Pooled::new(side), pooled_ttft(90.0));
        let ratio = paired_cluster_ratio(&h, &v, pooled_ttft(90.0));
        let verdict = match ratio {
            Some(e) if (e.point - 1.0).abs() <= 0.15 => "within 15%".to_string(),
            Some(e) => format!("**differ by {:.0}%**", (e.point - 1.0) * 100.0),
            None => "no shared seeds".to_string(),
        };
        rows.push(vec![
            format!("`{}`", r.workload),
            r.kv.clone(),
            format!("{:.0}%", r.load.unwrap_or(f64::NAN) * 100.0),
            format!("`{}`", r.variant),
            p90(&h).display(0),
            if v.is_empty() {
                "–".into()
            } else {
                p90(&v).display(0)
            },
            ratio.map_or("–".into(), |e| e.display_ratio()),
            verdict,
        ]);
    }
    let mut md = String::from("Harness ÷ virtual time, TTFT p90 pooled over the seeds both ran, 95% cluster-bootstrap interval (seeds resampled, the same for both). Above 1: the harness is slower (Envoy, HTTP, the machine). Where they differ by more than 15% the top-level README says which to trust and why.\n\n");
    md.push_str(&markdown_table(
        &[
            "workload",
            "KV",
            "load",
            "variant",
            "harness p90 [95%]",
            "virtual p90 [95%]",
            "harness ÷ virtual [95%]",
            "",
        ],
        &rows,
    ));
    Ok(md)
}

#[derive(Debug, Clone, Args)]
pub struct CheckArgs {
    #[arg(
        long,
        default_value = "bench-results/headline/deepseek-v3-ep-low/capacity-check"
    )]
    pub out: PathBuf,
    /// Where capacity.json is (measured there first if missing).
    #[arg(long, default_value = "bench-results/headline/deepseek-v3-ep-low/capacity")]
    pub capacity_dir: PathBuf,
    /// Judging seeds.
    #[arg(long, default_value_t = 3)]
    pub seeds: u64,
    #[arg(long, default_value = HEADLINE_PRESETS[0])]
    pub sim_preset: String,
    #[arg(long)]
    pub trace_dir: Option<PathBuf>,
    #[arg(long)]
    pub jobs: Option<usize>,
    /// Workloads (default: the synthetic ones and two public traces).
    #[arg(long, value_delimiter = ',')]
    pub workloads: Vec<String>,
    #[arg(long, value_delimiter = ',', default_value = "small,large")]
    pub kv: Vec<Kv>,
    #[arg(long)]
    pub dry_run: bool,
}

/// Whether mean TTFTs by thirds of the window show a growing queue: the
/// last third's exceeds the first's by more than the SLO, and by half.
fn growing(thirds: &[f64; 3], slo_ms: f64) -> bool {
    thirds[2] - thirds[0] > slo_ms && thirds[2] > 1.5 * thirds[0]
}

/// Each measured request of a run: (sent at, TTFT ms).
type SentTtft = Vec<(f64, f64)>;

/// One capacity-check seed: its (sent, TTFT) pairs and its TPOTs, in ms.
type CheckRun = (SentTtft, Vec<f64>);

/// The loads of the capacity check, as fractions of the capacity.
pub const CHECK_LOADS: [f64; 2] = [0.85, 1.10];

/// Mean TTFT (ms) of the requests sent in each third of the measured
/// window, pooled over seeds (failures left out).
fn thirds(runs: &[SentTtft]) -> [f64; 3] {
    let third = capacity::WINDOW_S / 3.0;
    let mut out = [f64::NAN; 3];
    for (i, slot) in out.iter_mut().enumerate() {
        let from = capacity::WARMUP_S + i as f64 * third;
        let values: Vec<f64> = runs
            .iter()
            .flat_map(|r| {
                r.iter()
                    .filter(|(sent, t)| *sent >= from && *sent < from + third && t.is_finite())
                    .map(|(_, t)| *t)
            })
            .collect();
        if !values.is_empty() {
            *slot = values.iter().sum::<f64>() / values.len() as f64;
        }
    }
    out
}

/// TTFT p90 per minute of send time after the warm-up, pooled over seeds.
fn per_minute(runs: &[Vec<(f64, f64)>]) -> Vec<f64> {
    let minutes = (capacity::WINDOW_S / 60.0) as usize;
    (0..minutes)
        .map(|m| {
            let from = capacity::WARMUP_S + m as f64 * 60.0;
            let values: Vec<f64> = runs
                .iter()
                .flat_map(|r| {
                    r.iter()
                        .filter(|(sent, _)| *sent >= from && *sent < from + 60.0)
                        .map(|(_, t)| *t)
                })
                .collect();
            percentile(&values, 90.0)
        })
        .collect()
}

/// `capacity-check`: 10 minutes (60 s warm-up + 600 s measured) of the
/// clairvoyant chooser at 85% and 110% of the sustainable capacity, in
/// virtual time, on judging seeds. Returns the estimated seconds (dry run)
/// or the seconds taken.
pub fn capacity_check(args: &CheckArgs, command_line: &str, root: &Path) -> Result<f64, String> {
    let preset = preset::preset(&args.sim_preset)?;
    let provenance = Provenance::current(root, command_line);
    let workloads: Vec<Workload> = if args.workloads.is_empty() {
        WorkloadKind::SYNTHETIC
            .into_iter()
            .filter(|k| *k != WorkloadKind::Bursty)
            .chain(WorkloadKind::PUBLIC_TRACES)
            .map(Workload::new)
            .collect()
    } else {
        args.workloads
            .iter()
            .map(|w| WorkloadKind::parse(w).map(Workload::new))
            .collect::<Result<_, _>>()?
    };
    let workloads: Vec<Workload> = workloads
        .into_iter()
        .map(|mut w| {
            w.trace.dir = args.trace_dir.clone();
            w.trace.input_scale = preset.trace_input_scale;
            w
        })
        .collect();
    let fleet = FleetShape {
        dp_size: preset.dp_size,
        ..FleetShape::default()
    };
    let file = CapacityFile::new(&args.capacity_dir);
    let seeds = SeedSet::Judge.seeds(args.seeds)?;
    let jobs = args.jobs.unwrap_or_else(crate::cpu::cores).max(1);
    let clairvoyant = Variant::parse("clairvoyant")?;
    let started = std::time::Instant::now();
    let mut estimate = 0.0;
    let mut rows = Vec::new();
    let mut slo_lines = Vec::new();
    for w in &workloads {
        for kv in &args.kv {
            let (slo, why) = crate::slo::for_workload(preset, w, *kv, crate::slo::SloOverride::default())?;
            slo_lines.push(format!(
                "`{}`, KV {}: TTFT <= {} ms ({why})",
                w.name(),
                kv.name(),
                slo.ttft_ms
            ));
            let entry = match file.lookup(w, *kv, &fleet, preset, &slo)? {
                Some(e) => e,
                None if args.dry_run => {
                    println!(
                        "capacity check: no capacity for {} KV {} yet",
                        w.name(),
                        kv.name()
                    );
                    continue;
                }
                None => capacity::get_or_measure(
                    &file,
                    &capacity::CapacityJob {
                        workload: w,
                        kv: *kv,
                        fleet,
                        preset,
                        slo,
                        jobs,
                        provenance: &provenance,
                    },
                    false,
                )?,
            };
            for load in CHECK_LOADS {
                let rate = entry.rps * load;
                let requests = rate * (capacity::WARMUP_S + capacity::WINDOW_S);
                estimate +=
                    seeds.len() as f64 * (0.05 + requests * suites::VIRTUAL_S_PER_REQUEST) / jobs as f64;
                if args.dry_run {
                    continue;
                }
                let work: Vec<crate::offline::Job<'_, Result<CheckRun, String>>> = seeds
                    .iter()
                    .map(|seed| {
                        let (clairvoyant, w, seed) = (&clairvoyant, w, *seed);
                        Box::new(move || {
                            let plan = w.plan(&Shape {
                                rate,
                                duration_s: capacity::WARMUP_S + capacity::WINDOW_S,
                                seed,
                                max_prompt: preset.max_prompt(*kv),
                                max_output: preset.max_output,
                            })?;
                            let spec = driver::RunSpec {
                                variant: clairvoyant,
                                sim: sim_config(preset, *kv, fleet.dp_size, &[])?,
                                workers: fleet.workers,
                                seed,
                                turn_horizon_s: capacity::WARMUP_S
                                    + capacity::WINDOW_S
                                    + crate::workload::chat::TAIL_S,
                                cut_at_s: None,
                                requests_out: None,
                                give_up: None,
                            };
                            let outcome = driver::run(&plan, &spec)?;
                            let measured = || {
                                outcome
                                    .output
                                    .records
                                    .iter()
                                    .filter(|r| r.sent_s >= capacity::WARMUP_S)
                            };
                            let sent_ttft =
                                measured().map(|r| (r.sent_s, capacity::latencies(r).0)).collect();
                            let tpot = measured().map(|r| capacity::latencies(r).1).collect();
                            Ok((sent_ttft, tpot))
                        }) as crate::offline::Job<'_, _>
                    })
                    .collect();
                let outputs: Vec<CheckRun> = crate::offline::parallel(jobs, work)
                    .into_iter()
                    .collect::<Result<_, _>>()?;
                let tpot: Vec<f64> = outputs.iter().flat_map(|(_, t)| t.iter().copied()).collect();
                let tpot_p90 = crate::stats::percentile(&tpot, 90.0);
                let runs: Vec<SentTtft> = outputs.into_iter().map(|(r, _)| r).collect();
                let pooled = Pooled::new(
                    &runs
                        .iter()
                        .zip(&seeds)
                        .map(|(r, seed)| SeedRequests {
                            seed: *seed,
                            ttft_ms: r.iter().map(|x| x.1).collect(),
                            good: 0.0,
                            sent: r.len() as f64,
                        })
                        .collect::<Vec<_>>(),
                );
                let p90 = cluster_estimate(&pooled, pooled_ttft(90.0));
                let minutes = per_minute(&runs);
                let means = thirds(&runs);
                let within = p90.point <= slo.ttft_ms && tpot_p90 <= slo.tpot_ms;
                let verdict = if load < 1.0 {
                    if within {
                        "within the SLO: the capacity is real".to_string()
                    } else {
                        "**misses the SLO**".to_string()
                    }
                } else if growing(&means, slo.ttft_ms) {
                    "growing: the capacity is a limit".to_string()
                } else if !within {
                    "beyond the SLO, not growing: the SLO binds before the throughput does".to_string()
                } else {
                    "**within the SLO: the capacity is underestimated**".to_string()
                };
                let by_thirds = format!("{:.0} / {:.0} / {:.0}", means[0], means[1], means[2]);
                println!(
                    "capacity check {} KV {} at {:.0}%: TTFT p90 {} ms, TPOT p90 {tpot_p90:.1} ms, mean TTFT by thirds {by_thirds} ms: {verdict}",
                    w.name(),
                    kv.name(),
                    load * 100.0,
                    p90.display(0)
                );
                rows.push(vec![
                    format!("`{}`", w.name()),
                    kv.name().to_string(),
                    format!("{:.0}% = {rate:.2} req/s", load * 100.0),
                    format!("{} / {}", slo.ttft_ms, slo.tpot_ms),
                    p90.display(0),
                    format!("{tpot_p90:.1}"),
                    minutes
                        .iter()
                        .map(|m| format!("{m:.0}"))
                        .collect::<Vec<_>>()
                        .join(" "),
                    by_thirds,
                    verdict,
                ]);
            }
        }
    }
    if args.dry_run {
        println!(
            "capacity check: {} workloads x {} KV x {} loads x {} seeds, estimated {:.1} min",
            workloads.len(),
            args.kv.len(),
            CHECK_LOADS.len(),
            seeds.len(),
            estimate / 60.0
        );
        return Ok(estimate);
    }
    let mut md = report_header(
        "Capacity check: is the sustainable capacity real, and a limit?",
        command_line,
    );
    let _ = writeln!(
        md,
        "The clairvoyant chooser, {} s of warm-up then {} s measured, in virtual time (preset `{}`), judging seeds {:?}. SLO per workload and KV (the table's column): {}. TTFT p90 pooled over the seeds with its 95% cluster-bootstrap interval, and per minute of send time (pooled over seeds). Within the SLO means TTFT p90 and TPOT p90 both within it (pooled over the seeds). At 110% a queue that grows shows as a mean TTFT that climbs from the first third of the window to the last: the verdict says growing when it climbed by more than the SLO, and by half at least; a rate whose decode batches break the TPOT objective without a growing queue is beyond the SLO, not growing.\n",
        capacity::WARMUP_S,
        capacity::WINDOW_S,
        preset.name,
        seeds,
        slo_lines.join("; ")
    );
    md.push_str(&markdown_table(
        &[
            "workload",
            "KV",
            "offered",
            "SLO TTFT / TPOT ms",
            "TTFT p90 [95%]",
            "TPOT p90 ms",
            "TTFT p90 per minute",
            "mean TTFT by thirds, ms",
            "verdict",
        ],
        &rows,
    ));
    std::fs::create_dir_all(&args.out).map_err(|e| format!("cannot create {}: {e}", args.out.display()))?;
    std::fs::write(args.out.join("capacity-check.md"), &md)
        .map_err(|e| format!("cannot write {}: {e}", args.out.display()))?;
    folder_readme(
        &args.out,
        "capacity-check",
        &provenance,
        "Table: [capacity-check.md](capacity-check.md).",
    )?;
    Ok(started.elapsed().as_secs_f64())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_index_names_the_presets_run_then_earlier_headlines_found() {
        let out = std::env::temp_dir().join(format!("dprank-headline-index-{}", std::process::id()));
        for folder in ["deepseek-v3-dp8", "deepseek-v3-ep-low", "vllm-dense-8b-not-run"] {
            std::fs::create_dir_all(out.join(folder)).unwrap();
            std::fs::write(out.join(folder).join("README.md"), "x").unwrap();
        }
        let run: Vec<String> = HEADLINE_PRESETS.map(String::from).to_vec();
        presets_index(&out, &run).unwrap();
        let index = std::fs::read_to_string(out.join("README.md")).unwrap();
        let lines: Vec<&str> = index.lines().filter(|l| l.starts_with("- [")).collect();
        assert_eq!(lines.len(), 3, "{index}");
        assert!(
            lines[0].starts_with("- [deepseek-v3-ep-low/](deepseek-v3-ep-low/): "),
            "{index}"
        );
        assert!(
            lines[1].starts_with("- [deepseek-v3-ep-high/](deepseek-v3-ep-high/): "),
            "{index}"
        );
        assert!(
            lines[2].starts_with(
                "- [deepseek-v3-dp8/](deepseek-v3-dp8/) (an earlier headline, not regenerated by this run): "
            ),
            "{index}"
        );
        std::fs::remove_dir_all(&out).unwrap();
    }

    #[test]
    fn per_minute_p90s_follow_a_growing_queue() {
        let run: Vec<(f64, f64)> = (0..6000)
            .map(|i| {
                let sent = capacity::WARMUP_S + f64::from(i) * 0.1;
                (sent, sent * 10.0)
            })
            .collect();
        let minutes = per_minute(std::slice::from_ref(&run));
        assert_eq!(minutes.len(), 10);
        assert!(minutes.windows(2).all(|w| w[1] > w[0]), "{minutes:?}");
        let means = thirds(&[run]);
        assert!(growing(&means, 1000.0), "{means:?}");
        assert!(!growing(&[50.0, 60.0, 55.0], 1000.0));
    }

    #[test]
    fn every_folder_has_a_question_and_the_index_lists_what_exists() {
        let dir = std::env::temp_dir().join(format!("dprank-headline-{}", std::process::id()));
        let p = Provenance {
            command: "dprank-bench bench".into(),
            commit: "abc".into(),
            date: "d".into(),
            machine: "m".into(),
        };
        folder_readme(&dir.join("virtual"), "virtual", &p, "x").unwrap();
        index(&dir).unwrap();
        let text = std::fs::read_to_string(dir.join("README.md")).unwrap();
        assert!(
            text.contains("[virtual/](virtual/)") && text.contains("| abc |"),
            "{text}"
        );
        assert!(!text.contains("harness/"));
        for (folder, q) in QUESTIONS {
            assert!(!q.is_empty(), "{folder}");
        }
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
