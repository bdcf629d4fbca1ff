//! Suites: which cells run (workloads x KV sizes x offered loads x variants
//! x seeds), in what order, on the harness (real processes) or in virtual
//! time (the offline model), and the report they produce. The named suites
//! fit the budgets in bench/README.md; every field can be overridden from
//! the command line.
//!
//! Every suite names its simulator preset and its seed set; offered loads
//! are fractions of the sustainable capacity (`capacity.rs`), measured in
//! virtual time for both modes.

use std::collections::{HashMap, HashSet};
use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::time::Instant;

use clap::Args;
use serde::{Deserialize, Serialize};

use crate::capacity::{self, CapacityFile, CapacityJob};
use crate::fleet::Tools;
use crate::plot;
use crate::preset::Kv;
use crate::preset::{self, SimPreset};
use crate::provenance::Provenance;
use crate::report::{self, group, group_notes, group_table, group_title, report_header};
use crate::runner::{
    measured_window, run_cell, settings_of, Cell, FleetShape, ResultsFile, RunRecord, Skipped,
};
use crate::seeds::SeedSet;
use crate::slo::SloOverride;
use crate::stats::{Pooled, Slo};
use crate::variant::{SimFeatures, Variant};
use crate::workload::{switching, OutputCap, Workload, WorkloadKind};

/// Simulated seconds of warm-up arrivals (not counted) and of measured ones.
pub const DEFAULT_WARMUP_S: f64 = 60.0;
pub const DEFAULT_DURATION_S: f64 = 300.0;
/// A measured window holds at least this many requests per seed (it is
/// lengthened at low rates, and the report says so).
pub const DEFAULT_MIN_REQUESTS: usize = 1000;

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
    "clairvoyant",
];

/// Variants of the harness tables: round robin, the in-server balancer,
/// smg at its default and its best setting per workload (`smg-best`,
/// chosen on tuning seeds by `smg-sweep`), dprank, the clairvoyant chooser.
pub const HEADLINE: [&str; 6] = [
    "rr",
    "in-server",
    "smg-cache-aware",
    SMG_BEST,
    "dprank",
    "clairvoyant",
];

/// Variants of the virtual-time headline: dprank, dprank on loads alone
/// (the seed's rule), the in-server balancer without and with SGLang's
/// prefill delayer, round robin, the clairvoyant chooser, and the model of
/// smg at its default and its best setting (tables label them a model).
pub const VIRTUAL_HEADLINE: [&str; 8] = [
    "dprank",
    "dprank-load-only",
    "in-server",
    "in-server-delayer",
    "rr",
    "clairvoyant",
    "smg-cache-aware",
    SMG_BEST,
];

/// Stands for smg's best setting on the cell's workload (`smg-best.json`).
pub const SMG_BEST: &str = "smg-best";
/// Stands for dprank polling every wall second, on workloads whose best smg
/// setting polls loads (without `--dp-aware`): the equal-freshness control.
pub const WALL_CONTROL: &str = "@wall-control";

/// smg's `cache_aware` settings the sweep tries: with `--dp-aware`,
/// `--cache-threshold` x `--balance-abs-threshold` x
/// `--balance-rel-threshold`; without it (smg picks workers, polling loads
/// every wall second, the workers' minimum-tokens controllers pick ranks),
/// `--cache-threshold` x `--balance-abs-threshold`. The first is smg's
/// default.
pub const SMG_SWEEP: [&str; 12] = [
    "smg-cache-aware",
    "smg-cache-aware:cache-threshold=0.6",
    "smg-cache-aware:balance-abs=4",
    "smg-cache-aware:balance-rel=1.1",
    "smg-cache-aware:cache-threshold=0.6:balance-abs=4",
    "smg-cache-aware:cache-threshold=0.6:balance-rel=1.1",
    "smg-cache-aware:balance-abs=4:balance-rel=1.1",
    "smg-cache-aware:cache-threshold=0.6:balance-abs=4:balance-rel=1.1",
    "smg-cache-aware-workers",
    "smg-cache-aware-workers:cache-threshold=0.6",
    "smg-cache-aware-workers:balance-abs=4",
    "smg-cache-aware-workers:cache-threshold=0.6:balance-abs=4",
];

/// The harness cells of the headline: no shared prefix, a shared-prefix
/// workload, a real trace.
pub const HARNESS_WORKLOADS: [WorkloadKind; 3] = [
    WorkloadKind::NoPrefix,
    WorkloadKind::Tenants,
    WorkloadKind::MooncakeConversation,
];

/// PD variants. Time scale 5: smg's interval is in whole wall seconds, so
/// `interval=2` is its default 10 s in simulated time and `interval=1`
/// (5 s simulated) its freshest; dprank polls every simulated second by
/// default and every wall second (5 s simulated) at equal freshness.
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

/// smg's best setting per workload, chosen on tuning seeds.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct SmgBest {
    pub preset: String,
    pub kv: String,
    pub load: f64,
    pub seeds: Vec<u64>,
    pub criterion: String,
    /// Workload name -> the chosen variant and the figures behind it.
    pub choices: Vec<SmgChoice>,
    pub provenance: Option<Provenance>,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct SmgChoice {
    pub workload: String,
    pub variant: String,
    pub p90_ms: f64,
    pub default_p90_ms: f64,
}

pub const SMG_BEST_FILE: &str = "smg-best.json";

impl SmgBest {
    pub fn load(path: &Path) -> Result<Option<SmgBest>, String> {
        match std::fs::read_to_string(path) {
            Ok(text) => serde_json::from_str(&text)
                .map(Some)
                .map_err(|e| format!("{}: {e}", path.display())),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(format!("cannot read {}: {e}", path.display())),
        }
    }

    /// The best setting for `workload`.
    pub fn for_workload(&self, workload: &str) -> Option<&SmgChoice> {
        self.choices.iter().find(|c| c.workload == workload)
    }

    /// Chooses per workload the sweep variant with the lowest pooled TTFT
    /// p90 (ties: smg's default, then the order of [`SMG_SWEEP`]).
    pub fn choose(records: &[RunRecord], preset: &str, provenance: Provenance) -> Option<SmgBest> {
        let sweep: Vec<&RunRecord> = records
            .iter()
            .filter(|r| SMG_SWEEP.contains(&r.variant.as_str()))
            .collect();
        let first = sweep.first()?;
        let mut workloads: Vec<&str> = sweep.iter().map(|r| r.workload.as_str()).collect();
        workloads.dedup();
        workloads.sort_unstable();
        workloads.dedup();
        let p90 = |w: &str, v: &str| {
            let runs: Vec<&RunRecord> = sweep
                .iter()
                .copied()
                .filter(|r| r.workload == w && r.variant == v)
                .collect();
            let pooled = Pooled::new(&report::seed_requests(&runs));
            (
                runs.len(),
                pooled.percentile(&crate::stats::all_once(pooled.seeds()), 90.0),
            )
        };
        let choices = workloads
            .iter()
            .filter_map(|w| {
                let figures: Vec<(&str, f64)> = SMG_SWEEP
                    .iter()
                    .map(|v| (*v, p90(w, v)))
                    .filter(|(_, (n, _))| *n > 0)
                    .map(|(v, (_, p))| (v, p))
                    .collect();
                let default = figures
                    .iter()
                    .find(|(v, _)| *v == SMG_SWEEP[0])
                    .map_or(f64::NAN, |f| f.1);
                let best = figures
                    .iter()
                    .filter(|(_, p)| !p.is_nan())
                    .min_by(|a, b| a.1.total_cmp(&b.1))?;
                Some(SmgChoice {
                    workload: w.to_string(),
                    variant: best.0.to_string(),
                    p90_ms: best.1,
                    default_p90_ms: default,
                })
            })
            .collect();
        let mut seeds: Vec<u64> = sweep.iter().map(|r| r.seed).collect();
        seeds.sort_unstable();
        seeds.dedup();
        Some(SmgBest {
            preset: preset.to_string(),
            kv: first.kv.clone(),
            load: first.load.unwrap_or(f64::NAN),
            seeds,
            criterion: "lowest TTFT p90 pooled over the tuning seeds' requests".into(),
            choices,
            provenance: Some(provenance),
        })
    }
}

/// The overload suite's offered loads (shares of the sustainable capacity).
pub const OVERLOAD_LOADS: [f64; 5] = [0.8, 1.0, 1.15, 1.3, 1.5];
/// Share of the overload suite's requests in the high class.
pub const OVERLOAD_HIGH_SHARE: f64 = 0.2;
/// The overload suite's variants: smg's limiter at three limits (its queue
/// times out after 1 s, the legacy preset's TTFT target; the best is read
/// off the table), the IE model in virtual time only.
pub const OVERLOAD_VARIANTS: [&str; 8] = [
    "dprank",
    "dprank-reject",
    "dprank-queue",
    "smg:limit=32:queue-timeout=1",
    "smg:limit=64:queue-timeout=1",
    "smg:limit=128:queue-timeout=1",
    "ie-model",
    "in-server",
];

#[derive(Debug, Clone)]
pub struct Suite {
    pub name: String,
    pub about: String,
    pub workloads: Vec<Workload>,
    pub kvs: Vec<Kv>,
    /// Offered loads as fractions of the sustainable capacity.
    pub loads: Vec<f64>,
    /// A fixed offered rate instead (requests per simulated second).
    pub rate: Option<f64>,
    pub variants: Vec<String>,
    pub seed_set: SeedSet,
    pub seeds: Vec<u64>,
    /// Simulated seconds of arrivals before the measured window.
    pub warmup_s: f64,
    /// Simulated seconds of measured arrivals (lengthened to hold `min_requests`).
    pub duration_s: f64,
    pub min_requests: usize,
    /// None: the preset's time scale per KV size.
    pub time_scale: Option<f64>,
    pub reference: String,
    pub fleet: FleetShape,
    pub preset: &'static SimPreset,
    /// Figures of the SLO set on the command line; the rest per workload
    /// (`slo::for_workload`).
    pub slo_override: SloOverride,
    /// Where records and reports go.
    pub out: PathBuf,
    /// Run in virtual time (the offline model) instead of on the harness.
    pub virtual_time: bool,
    /// Virtual-time runs at once.
    pub jobs: usize,
    /// Where smg's best settings are read (`smg-best.json`).
    pub smg_best: Option<PathBuf>,
    /// Two priority classes, this share of the requests in the high one.
    pub high_share: Option<f64>,
}

fn synthetic_workloads() -> Vec<Workload> {
    WorkloadKind::SYNTHETIC.into_iter().map(Workload::new).collect()
}

impl Suite {
    pub fn named(name: &str) -> Result<Suite, String> {
        let default = preset::preset(preset::DEFAULT_PRESET)?;
        let base = Suite {
            name: name.to_string(),
            about: String::new(),
            workloads: synthetic_workloads(),
            kvs: vec![Kv::Small],
            loads: vec![0.85],
            rate: None,
            variants: HEADLINE.map(str::to_string).to_vec(),
            seed_set: SeedSet::Judge,
            seeds: SeedSet::Judge.seeds(10)?,
            warmup_s: DEFAULT_WARMUP_S,
            duration_s: DEFAULT_DURATION_S,
            min_requests: DEFAULT_MIN_REQUESTS,
            time_scale: None,
            reference: "dprank".into(),
            fleet: FleetShape {
                dp_size: default.dp_size,
                ..FleetShape::default()
            },
            preset: default,
            slo_override: SloOverride::default(),
            out: PathBuf::from("bench-results"),
            virtual_time: false,
            jobs: 1,
            smg_best: None,
            high_share: None,
        };
        let workloads = |kinds: &[WorkloadKind]| kinds.iter().map(|k| Workload::new(*k)).collect();
        Ok(match name {
            "quick" => Suite {
                about: "a quick look: two workloads, the headline variants, 3 tuning seeds, short traces".into(),
                out: PathBuf::from("target/bench-quick"),
                workloads: workloads(&[WorkloadKind::NoPrefix, WorkloadKind::Tenants]),
                seed_set: SeedSet::Tune,
                seeds: SeedSet::Tune.seeds(3)?,
                warmup_s: 10.0,
                duration_s: 20.0,
                min_requests: 0,
                ..base
            },
            "harness" => Suite {
                about: "the headline on the harness: no-prefix, tenants and the Mooncake conversation trace at 85% of sustainable capacity, small KV, real Envoy and real smg (its default and its best setting)".into(),
                workloads: workloads(&HARNESS_WORKLOADS),
                variants: ["dprank", "in-server", "smg-cache-aware", SMG_BEST, WALL_CONTROL]
                    .map(str::to_string)
                    .to_vec(),
                seeds: SeedSet::Judge.seeds(3)?,
                ..base
            },
            "smg-sweep" => Suite {
                about: "smg's cache_aware settings on tuning seeds, with and without --dp-aware, beside dprank polling every wall second (the control for smg's load polls); chooses smg's best setting per workload".into(),
                workloads: workloads(&HARNESS_WORKLOADS),
                variants: SMG_SWEEP
                    .iter()
                    .map(|v| v.to_string())
                    .chain(["dprank".to_string(), "dprank-wall-1s".to_string()])
                    .collect(),
                seed_set: SeedSet::Tune,
                seeds: SeedSet::Tune.seeds(3)?,
                ..base
            },
            "tables" => Suite {
                about: "every baseline on every synthetic workload at 85% of sustainable capacity with small KV".into(),
                variants: EVERY_BASELINE.map(str::to_string).to_vec(),
                ..base
            },
            "sweep" => Suite {
                about: "offered load 50/70/85/95% of sustainable capacity x KV small/large on the no-prefix and tenants workloads".into(),
                workloads: workloads(&[WorkloadKind::NoPrefix, WorkloadKind::Tenants]),
                kvs: vec![Kv::Small, Kv::Large],
                loads: vec![0.5, 0.7, 0.85, 0.95],
                variants: ["rr", "in-server", "smg-cache-aware", "dprank", "clairvoyant"].map(str::to_string).to_vec(),
                ..base
            },
            "pd" => Suite {
                about: "prefill/decode disaggregation (2 prefill x 4 ranks, 2 decode x 4 ranks): dprank, the old rule and smg's minimum-tokens scheduler, at equal freshness and each at its default".into(),
                workloads: workloads(&[WorkloadKind::NoPrefix]),
                variants: PD.map(str::to_string).to_vec(),
                time_scale: Some(5.0),
                reference: "dprank-pd".into(),
                ..base
            },
            "pd-policies" => Suite {
                about: "smg's PD worker policies with the minimum-tokens scheduler, all at equal freshness (1 s wall = 5 s simulated), against dprank at the same interval".into(),
                workloads: workloads(&[WorkloadKind::NoPrefix]),
                variants: std::iter::once("dprank-pd:poll-wall=1000".to_string())
                    .chain(PD_POLICIES.map(str::to_string))
                    .collect(),
                time_scale: Some(5.0),
                reference: "dprank-pd:poll-wall=1000".into(),
                ..base
            },
            "virtual" => Suite {
                about: "virtual time (the offline model: the simulator's engine, dprank's own request lifecycle and poller, no Envoy)".into(),
                workloads: synthetic_workloads()
                    .into_iter()
                    .chain(WorkloadKind::PUBLIC_TRACES.map(Workload::new))
                    .collect(),
                kvs: vec![Kv::Small, Kv::Large],
                loads: vec![0.5, 0.7, 0.85, 0.95],
                variants: VIRTUAL_HEADLINE.map(str::to_string).to_vec(),
                virtual_time: true,
                jobs: crate::cpu::cores(),
                ..base
            },
            "offline" => Suite {
                about: "routing rules in virtual time (the offline model), for exploring rules and settings on tuning seeds".into(),
                out: PathBuf::from("target/offline"),
                workloads: workloads(&[WorkloadKind::Tenants]),
                loads: vec![0.8],
                variants: ["rr", "in-server", "clairvoyant", "smg-cache-aware", "dprank-load-only", "dprank"]
                    .map(str::to_string)
                    .to_vec(),
                seed_set: SeedSet::Tune,
                seeds: SeedSet::Tune.seeds(10)?,
                virtual_time: true,
                jobs: crate::cpu::cores(),
                ..base
            },
            "overload" => Suite {
                about: "overload protection: offered load from 80% to 150% of sustainable capacity, steady (`no-prefix`) and on/off bursts (`bursty`), two priority classes (20% high, sent with the priority header); dprank without admission, with `reject` and `queue`, smg's concurrency limiter and queue at three limits, a model of the Inference Extension's saturation detector (virtual time only) and SGLang's in-server balancer".into(),
                workloads: workloads(&[WorkloadKind::NoPrefix, WorkloadKind::Bursty]),
                loads: OVERLOAD_LOADS.to_vec(),
                variants: OVERLOAD_VARIANTS.map(str::to_string).to_vec(),
                seeds: SeedSet::Judge.seeds(5)?,
                high_share: Some(OVERLOAD_HIGH_SHARE),
                out: PathBuf::from("bench-results/overload"),
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
        if self.virtual_time {
            1.0
        } else {
            self.time_scale.unwrap_or_else(|| self.preset.time_scale(kv))
        }
    }

    /// The variant specs of a cell of `workload`: [`SMG_BEST`] and
    /// [`WALL_CONTROL`] resolved from `best` (left out without it).
    fn variants_for(&self, workload: &Workload, best: Option<&SmgBest>) -> Result<Vec<Variant>, String> {
        let choice = best.and_then(|b| b.for_workload(&workload.name()));
        let mut out = Vec::new();
        for spec in &self.variants {
            match spec.as_str() {
                SMG_BEST => {
                    if let Some(choice) = choice {
                        let mut v = Variant::parse(&choice.variant)?;
                        v.name = format!("{SMG_BEST} = {}", choice.variant);
                        out.push(v);
                    }
                }
                WALL_CONTROL => {
                    let polls = choice
                        .and_then(|c| Variant::parse(&c.variant).ok())
                        .is_some_and(|v| {
                            matches!(v.front, crate::variant::Front::Smg { dp_aware: false, .. })
                        });
                    if polls {
                        out.push(Variant::parse("dprank-wall-1s")?);
                    }
                }
                _ => out.push(Variant::parse(spec)?),
            }
        }
        Ok(out)
    }

    /// Every cell, seeds outermost and variants innermost, so slow drift of
    /// the machine touches every variant of a seed alike. `rate_of` gives
    /// the offered rate and what it is a fraction of, per (workload, KV, load).
    #[allow(clippy::type_complexity)]
    pub fn cells(
        &self,
        rate_of: &dyn Fn(&Workload, Kv, f64) -> Result<(f64, Option<(String, f64)>), String>,
        slo_of: &dyn Fn(&Workload, Kv) -> Result<Slo, String>,
        best: Option<&SmgBest>,
        provenance: &Provenance,
    ) -> Result<Vec<Cell>, String> {
        let mut out = Vec::new();
        for seed in &self.seeds {
            for workload in &self.workloads {
                let variants = self.variants_for(workload, best)?;
                for kv in &self.kvs {
                    let slo = slo_of(workload, *kv)?;
                    for load in &self.loads {
                        let (rate, capacity) = match self.rate {
                            Some(rate) => (rate, None),
                            None => rate_of(workload, *kv, *load)?,
                        };
                        let time_scale = self.time_scale_for(*kv);
                        for variant in &variants {
                            out.push(Cell {
                                suite: self.name.clone(),
                                workload: workload.clone(),
                                variant: variant.for_cell(slo.ttft_ms, slo.tpot_ms, time_scale),
                                seed: *seed,
                                kv: *kv,
                                preset: self.preset,
                                rate,
                                load: self.rate.is_none().then_some(*load),
                                warmup_s: self.warmup_s,
                                duration_s: measured_window(rate, self.duration_s, self.min_requests),
                                nominal_duration_s: self.duration_s,
                                time_scale,
                                fleet: self.fleet,
                                slo,
                                capacity: capacity.clone(),
                                provenance: provenance.clone(),
                                high_share: self.high_share,
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
    /// Workloads (comma-separated or repeated): no-prefix, bursty, tenants,
    /// chat, app-sessions, mooncake-conversation, mooncake-synthetic,
    /// mooncake-toolagent, trace-file (with --replay-trace).
    #[arg(long, alias = "workload", value_delimiter = ',')]
    pub workloads: Vec<String>,
    /// Variants (comma-separated or repeated specs or aliases; see bench/README.md).
    #[arg(long, alias = "variant", value_delimiter = ',')]
    pub variants: Vec<String>,
    /// Seeds: the first N of the seed set.
    #[arg(long)]
    pub seeds: Option<u64>,
    /// tune (seeds 1-10) or judge (101 and up); published suites judge.
    #[arg(long, value_enum)]
    pub seed_set: Option<SeedSet>,
    /// Offered loads as fractions of the sustainable capacity.
    #[arg(long, alias = "load", value_delimiter = ',')]
    pub loads: Vec<f64>,
    /// A fixed offered rate (requests per simulated second) instead of loads.
    #[arg(long, alias = "capacity-rate")]
    pub rate: Option<f64>,
    /// KV sizes per rank: small, large.
    #[arg(long, value_delimiter = ',')]
    pub kv: Vec<Kv>,
    /// Simulated seconds of measured arrivals per run.
    #[arg(long)]
    pub duration: Option<f64>,
    /// Simulated seconds of arrivals before the measured ones (not counted).
    #[arg(long)]
    pub warmup: Option<f64>,
    /// Lengthen the measured window so each seed holds this many requests.
    #[arg(long)]
    pub min_requests: Option<usize>,
    /// Simulated time runs this many times faster than wall time (harness; default per preset and KV).
    #[arg(long)]
    pub time_scale: Option<f64>,
    /// The variant ratios are taken against.
    #[arg(long)]
    pub reference: Option<String>,
    /// Workers (regular mode) and ranks per worker (default: the preset's).
    #[arg(long)]
    pub workers: Option<usize>,
    #[arg(long)]
    pub dp_size: Option<usize>,
    /// The simulated model: deepseek-v3-ep (the default), its bracket
    /// deepseek-v3-ep-low and deepseek-v3-ep-high, deepseek-v3-dp8 (the
    /// first fit), legacy, dense-8b, vllm-dense-8b, vllm-deepseek-v3-dp8.
    #[arg(long)]
    pub sim_preset: Option<String>,
    /// The file `trace-file` (or `replay`) replays.
    #[arg(long, alias = "trace")]
    pub replay_trace: Option<PathBuf>,
    /// Directory of the Mooncake trace files (else DPRANK_TRACE_DIR, else target/traces/mooncake).
    #[arg(long)]
    pub trace_dir: Option<PathBuf>,
    /// Multiplies the block-hash traces' input lengths (default: the preset's).
    #[arg(long, alias = "input-scale")]
    pub replay_input_scale: Option<f64>,
    #[arg(long)]
    pub replay_output_scale: Option<f64>,
    /// What requests send as max tokens: N (fixed) or xK (K x the answer); default per workload.
    #[arg(long)]
    pub output_cap: Option<String>,
    /// Goodput SLO, simulated ms (default: the preset's).
    #[arg(long)]
    pub slo_ttft_ms: Option<f64>,
    #[arg(long)]
    pub slo_tpot_ms: Option<f64>,
    /// Measure capacities again even if capacity.json has them.
    #[arg(long)]
    pub remeasure: bool,
    /// Read capacities from (and store them in) this directory's capacity.json.
    #[arg(long)]
    pub capacity_dir: Option<PathBuf>,
    /// smg's best settings (default: <out>/smg-best.json).
    #[arg(long)]
    pub smg_best: Option<PathBuf>,
    /// Suite name in the records and report (default: the suite's).
    #[arg(long)]
    pub name: Option<String>,
    /// Run in virtual time (the offline model) instead of on the harness.
    #[arg(long = "virtual")]
    pub virtual_time: bool,
    /// Virtual-time runs at once (default: the cores).
    #[arg(long)]
    pub jobs: Option<usize>,
    /// Write every request of every run as JSONL here, a file per run
    /// (the harness knows no worker or rank; virtual time adds them).
    #[arg(long)]
    pub requests_out: Option<PathBuf>,
    /// Put runs of different commits or machines in one table, flagged.
    #[arg(long)]
    pub allow_mixed: bool,
}

impl SuiteArgs {
    pub fn apply(&self, mut suite: Suite) -> Result<Suite, String> {
        if let Some(name) = &self.name {
            suite.name = name.clone();
        }
        if let Some(out) = &self.out {
            suite.out = out.clone();
        }
        if let Some(name) = &self.sim_preset {
            suite.preset = preset::preset(name)?;
            suite.fleet.dp_size = suite.preset.dp_size;
        }
        if !self.workloads.is_empty() {
            suite.workloads = self
                .workloads
                .iter()
                .map(|w| {
                    let kind = match (w.as_str(), &self.replay_trace) {
                        ("replay", Some(_)) => WorkloadKind::TraceFile,
                        _ => WorkloadKind::parse(w)?,
                    };
                    Ok(Workload::new(kind))
                })
                .collect::<Result<_, String>>()?;
        }
        let cap = self.output_cap.as_deref().map(OutputCap::parse).transpose()?;
        for w in &mut suite.workloads {
            w.trace.dir = self.trace_dir.clone();
            w.trace.file = self.replay_trace.clone();
            w.trace.input_scale = self.replay_input_scale.unwrap_or(suite.preset.trace_input_scale);
            w.trace.output_scale = self.replay_output_scale.unwrap_or(1.0);
            if let Some(cap) = cap {
                w.cap = cap;
            }
        }
        if !self.variants.is_empty() {
            suite.variants = self.variants.clone();
        }
        if let Some(set) = self.seed_set {
            suite.seed_set = set;
            suite.seeds = set.seeds(suite.seeds.len() as u64)?;
        }
        if let Some(n) = self.seeds {
            suite.seeds = suite.seed_set.seeds(n)?;
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
        if let Some(n) = self.min_requests {
            suite.min_requests = n;
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
        if self.slo_ttft_ms.is_some() || self.slo_tpot_ms.is_some() {
            suite.slo_override = SloOverride {
                ttft_ms: self.slo_ttft_ms.or(suite.slo_override.ttft_ms),
                tpot_ms: self.slo_tpot_ms.or(suite.slo_override.tpot_ms),
            };
        }
        if self.virtual_time {
            suite.virtual_time = true;
        }
        if let Some(j) = self.jobs {
            suite.jobs = j.max(1);
        }
        if self.smg_best.is_some() {
            suite.smg_best = self.smg_best.clone();
        }
        // Fail early on a bad spec.
        for v in suite
            .variants
            .iter()
            .filter(|v| !v.starts_with('@') && v.as_str() != SMG_BEST)
        {
            Variant::parse(v)?;
        }
        Ok(suite)
    }
}

/// Estimated wall seconds of one harness run: start-up (smg takes longer
/// than Envoy), then the arrivals and the wait for the last answer to end,
/// in simulated seconds divided by the time scale. Chat sessions run on to
/// the turn horizon. Calibrated on smoke runs (bench/README.md, "Budgets")
/// and, for the last answers' decode, on bursty runs at 150% (20 s).
pub fn estimate_run_s(cell: &Cell) -> f64 {
    let startup = if cell.variant.uses_smg() { 2.5 } else { 1.5 } * cell.variant.gateways as f64;
    let tail_sim = match cell.workload.kind {
        WorkloadKind::Chat => crate::workload::chat::TAIL_S + 20.0,
        _ => 20.0,
    };
    startup + (cell.warmup_s + cell.duration_s + tail_sim) / cell.time_scale
}

/// CPU seconds per simulated request of a virtual-time run, and per run
/// (plan, summary): measured on a 2-core AMD EPYC, legacy preset, 336 runs
/// of every workload: 0.04-0.13 ms per request (chat and tenants the
/// dearest), 0.1 s per run. Longer prompts cost more to generate and
/// tokenize: block-hash traces scale by their input scale.
pub const VIRTUAL_S_PER_REQUEST: f64 = 0.00013;
pub const VIRTUAL_S_PER_RUN: f64 = 0.1;

/// Estimated CPU seconds of one virtual-time run.
pub fn estimate_virtual_run_s(cell: &Cell) -> f64 {
    let requests = cell.rate * (cell.warmup_s + cell.duration_s);
    let long_prompts = if cell.workload.kind.is_block_hash() {
        (cell.workload.trace.input_scale * 8.0).max(1.0)
    } else {
        1.0
    };
    VIRTUAL_S_PER_RUN + requests * VIRTUAL_S_PER_REQUEST * long_prompts
}

/// The SLO of each (workload, KV) of a suite (`slo::for_workload`), each
/// resolved once, with how it was set.
pub struct Slos {
    entries: Vec<(String, Kv, Slo, String)>,
}

impl Slos {
    pub fn of_suite(suite: &Suite) -> Result<Slos, String> {
        let mut entries: Vec<(String, Kv, Slo, String)> = Vec::new();
        // A mix's parts too: each part's capacity is measured under its own SLO.
        let parts = suite.workloads.iter().flat_map(capacity::capacity_parts);
        for workload in suite.workloads.iter().cloned().chain(parts) {
            if entries.iter().any(|(name, _, _, _)| *name == workload.name()) {
                continue;
            }
            for kv in &suite.kvs {
                let (slo, why) = crate::slo::for_workload(suite.preset, &workload, *kv, suite.slo_override)?;
                entries.push((workload.name(), *kv, slo, why));
            }
        }
        Ok(Slos { entries })
    }

    pub fn of(&self, workload: &Workload, kv: Kv) -> Result<Slo, String> {
        let name = workload.name();
        self.entries
            .iter()
            .find(|(w, k, _, _)| *w == name && *k == kv)
            .map(|(_, _, slo, _)| *slo)
            .ok_or_else(|| format!("no SLO resolved for {name} with KV {}", kv.name()))
    }

    /// One line per (workload, KV): the SLO and how it was set.
    pub fn describe(&self) -> String {
        let lines: Vec<String> = self
            .entries
            .iter()
            .map(|(w, kv, slo, why)| {
                format!(
                    "`{w}`, KV {}: TTFT <= {} ms, TPOT <= {} ms ({why})",
                    kv.name(),
                    slo.ttft_ms,
                    slo.tpot_ms
                )
            })
            .collect();
        lines.join("; ")
    }
}

/// The capacities a suite needs, measured (in virtual time) when missing.
#[allow(clippy::too_many_arguments)]
pub fn capacities(
    suite: &Suite,
    slos: &Slos,
    file: &CapacityFile,
    remeasure: bool,
    dry_run: bool,
    provenance: &Provenance,
) -> Result<Vec<(String, Kv, f64, String)>, String> {
    let mut rates = Vec::new();
    if suite.rate.is_some() {
        return Ok(rates);
    }
    for workload in suite.workloads.iter().flat_map(capacity::capacity_parts) {
        let workload = &workload;
        for kv in &suite.kvs {
            let slo = slos.of(workload, *kv)?;
            let job = CapacityJob {
                workload,
                kv: *kv,
                fleet: suite.fleet,
                preset: suite.preset,
                slo,
                jobs: suite.jobs.max(crate::cpu::cores()),
                provenance,
            };
            let known = if remeasure {
                None
            } else {
                file.lookup(workload, *kv, &suite.fleet, suite.preset, &slo)?
            };
            let entry = match known {
                Some(entry) => entry,
                None if dry_run => {
                    println!(
                        "capacity of {} with KV {} ({}) not in {}: measured first in virtual time (a few minutes)",
                        workload.name(),
                        kv.name(),
                        suite.preset.name,
                        file.path.display()
                    );
                    continue;
                }
                None => capacity::get_or_measure(file, &job, true)?,
            };
            println!("capacity: {}", entry.describe());
            let method = format!(
                "sustainable: clairvoyant chooser's TTFT p90 within {} ms over {} s, virtual time",
                entry.slo_ttft_ms, entry.window_s
            );
            rates.push((capacity::workload_key(workload), *kv, entry.rps, method));
        }
    }
    Ok(rates)
}

/// The capacity (req/s) [`capacities`] found for `workload` with KV `kv`,
/// and how it was measured.
pub fn capacity_of<'a>(
    rates: &'a [(String, Kv, f64, String)],
    workload: &Workload,
    kv: Kv,
) -> Option<(f64, &'a str)> {
    let key = capacity::workload_key(workload);
    rates
        .iter()
        .find(|(k, v, _, _)| *k == key && *v == kv)
        .map(|(_, _, rps, method)| (*rps, method.as_str()))
}

/// Sets each `switching` workload's trace share from the capacities: the
/// trace's ÷ `no-prefix`'s, so both parts are offered the same share of
/// their own capacity. One KV size per suite (the share depends on it).
fn set_trace_rate_shares(
    suite: &mut Suite,
    rates: &[(String, Kv, f64, String)],
    dry_run: bool,
) -> Result<(), String> {
    let kvs = suite.kvs.clone();
    for w in suite
        .workloads
        .iter_mut()
        .filter(|w| w.kind == WorkloadKind::Switching)
    {
        let [kv] = kvs[..] else {
            return Err("`switching` runs one KV size per suite (its parts' capacities depend on it)".into());
        };
        let rate_of = |kind| capacity_of(rates, &switching::part(w, kind), kv).map(|(rps, _)| rps);
        match (
            rate_of(WorkloadKind::NoPrefix),
            rate_of(WorkloadKind::MooncakeConversation),
        ) {
            (Some(synthetic), Some(trace)) => w.trace_rate_share = Some(trace / synthetic),
            _ if dry_run => {}
            _ => {
                return Err(format!(
                    "`switching`: no capacity for its parts with KV {}",
                    kv.name()
                ))
            }
        }
    }
    Ok(())
}

/// Runs `suite`, appending records to `<out>/runs.jsonl`, then writes its report.
pub async fn run_suite(
    tools: Option<&Tools>,
    suite: &Suite,
    args: &SuiteArgs,
    command_line: &str,
    root: &Path,
) -> Result<(), String> {
    let started = Instant::now();
    let provenance = Provenance::current(root, command_line);
    let features = match (tools, suite.virtual_time) {
        (Some(tools), false) => Some(SimFeatures::detect(&tools.sim)?),
        (None, false) => return Err("harness runs need the tools (Envoy, the simulator)".into()),
        _ => None,
    };
    if let Some(features) = &features {
        features.check_preset(suite.preset)?;
    }
    let slos = Slos::of_suite(suite)?;
    let results = ResultsFile::new(&suite.out.join("runs.jsonl"));
    let capacity_file = CapacityFile::new(args.capacity_dir.as_deref().unwrap_or(&suite.out));
    let rates = capacities(
        suite,
        &slos,
        &capacity_file,
        args.remeasure,
        args.dry_run,
        &provenance,
    )?;
    let rate_of = |w: &Workload, kv: Kv, load: f64| -> Result<(f64, Option<(String, f64)>), String> {
        match capacity_of(&rates, w, kv) {
            Some((capacity, method)) => Ok((capacity * load, Some((method.to_string(), capacity)))),
            None if args.dry_run => Ok((f64::NAN, None)),
            None => Err(format!(
                "no capacity for {} with KV {}",
                capacity::workload_key(w),
                kv.name()
            )),
        }
    };
    let mut suite = suite.clone();
    set_trace_rate_shares(&mut suite, &rates, args.dry_run)?;
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
    let best_path = suite
        .smg_best
        .clone()
        .unwrap_or_else(|| suite.out.join(SMG_BEST_FILE));
    let best = SmgBest::load(&best_path)?;
    if suite.variants.iter().any(|v| v == SMG_BEST) {
        match &best {
            Some(b) => println!("smg's best settings from {} ({} on {:?})", best_path.display(), b.criterion, b.seeds),
            None => println!(
                "smg's best settings: {} not found, so `{SMG_BEST}` is left out (run `dprank-bench smg-sweep` first)",
                best_path.display()
            ),
        }
    }
    let suite = &suite;
    let cells = suite.cells(&rate_of, &|w, kv| slos.of(w, kv), best.as_ref(), &provenance)?;
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
    let estimate = suite_estimate_s(suite, &todo);
    println!(
        "suite {} ({}, preset {}, {}): {} runs ({} already done), estimated {:.0} min; writing to {}",
        suite.name,
        if suite.virtual_time {
            "virtual time"
        } else {
            "harness"
        },
        suite.preset.name,
        suite.seed_set.describe(),
        todo.len(),
        cells.len() - todo.len(),
        estimate / 60.0,
        results.path.display()
    );
    if args.dry_run {
        for c in todo.iter().take(if suite.virtual_time { 20 } else { usize::MAX }) {
            println!(
                "  {} {} kv={} rate={:.2} seed={} {}+{} s ts={} ~{:.0} s",
                c.workload.name(),
                c.variant.name,
                c.kv.name(),
                c.rate,
                c.seed,
                c.warmup_s,
                c.duration_s,
                c.time_scale,
                if suite.virtual_time {
                    estimate_virtual_run_s(c)
                } else {
                    estimate_run_s(c)
                }
            );
        }
        if suite.virtual_time && todo.len() > 20 {
            println!("  ... and {} more", todo.len() - 20);
        }
        return Ok(());
    }
    if !args.resume {
        drop_suite_records(&results, &suite.name)?;
    }
    let (skipped, failed) = if suite.virtual_time {
        run_virtual(&todo, suite, &results, args.requests_out.as_deref())?
    } else {
        let (Some(tools), Some(features)) = (tools, &features) else {
            return Err("harness runs need the tools".into());
        };
        run_harness(&todo, tools, features, &results, args.requests_out.as_deref()).await?
    };
    let records: Vec<RunRecord> = results
        .load()?
        .into_iter()
        .filter(|r| r.suite == suite.name)
        .collect();
    if suite.name == "smg-sweep" {
        if let Some(chosen) = SmgBest::choose(&records, suite.preset.name, provenance.clone()) {
            let path = suite.out.join(SMG_BEST_FILE);
            let text = serde_json::to_string_pretty(&chosen).map_err(|e| e.to_string())?;
            std::fs::write(&path, text + "\n")
                .map_err(|e| format!("cannot write {}: {e}", path.display()))?;
            println!("wrote {}", path.display());
        }
        crate::folders::folder_readme(
            &suite.out,
            "smg-sweep",
            &provenance,
            &format!(
                "Tables: [{0}.md]({0}.md); smg's best setting per workload: [{SMG_BEST_FILE}]({SMG_BEST_FILE}).",
                suite.name
            ),
        )?;
    }
    let context = ReportContext {
        slo_why: slos.describe(),
        capacities: capacity_file.load()?,
        allow_mixed: args.allow_mixed,
        smg_best: best,
    };
    let path = write_report(&suite.out, suite, &records, &skipped, command_line, &context)?;
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

/// Estimated wall seconds of `todo`: harness runs one after the other,
/// virtual-time runs `jobs` at once.
/// Cells whose rate is not known yet (a dry run before the capacities are
/// measured) are left out.
pub fn suite_estimate_s(suite: &Suite, todo: &[&Cell]) -> f64 {
    let known = todo.iter().filter(|c| c.rate.is_finite());
    if suite.virtual_time {
        known.map(|c| estimate_virtual_run_s(c)).fold(0.0, |a, b| a + b) / suite.jobs.max(1) as f64
    } else {
        known.map(|c| estimate_run_s(c)).fold(0.0, |a, b| a + b)
    }
}

type Outcomes = (Vec<(String, String)>, Vec<String>);

async fn run_harness(
    todo: &[&Cell],
    tools: &Tools,
    features: &SimFeatures,
    results: &ResultsFile,
    requests_out: Option<&Path>,
) -> Result<Outcomes, String> {
    let mut skipped: Vec<(String, String)> = Vec::new();
    let mut failed: Vec<String> = Vec::new();
    for (i, cell) in todo.iter().enumerate() {
        if skipped.iter().any(|(v, _)| *v == cell.variant.name) {
            continue;
        }
        // A run that fails (a process that would not start, say) is
        // reported and the suite goes on; `--resume` retries it later.
        let outcome = match run_cell(tools, features, cell, true).await {
            Ok(outcome) => outcome,
            Err(e) => {
                println!(
                    "[{}/{}] {} {} s{}: run failed: {e}",
                    i + 1,
                    todo.len(),
                    cell.workload.name(),
                    cell.variant.name,
                    cell.seed
                );
                failed.push(format!(
                    "{} {} seed {}: {e}",
                    cell.workload.name(),
                    cell.variant.name,
                    cell.seed
                ));
                continue;
            }
        };
        match outcome {
            Ok(run) => {
                let record = run.record;
                let bound = record
                    .cpu
                    .as_ref()
                    .and_then(|c| c.bound.clone())
                    .map_or(String::new(), |why| format!(", CPU-BOUND ({why})"));
                println!(
                    "[{}/{}] {} {} s{}: TTFT p50 {:.0} p99 {:.0} ms, goodput {:.1} %, {} errors, {:.0} s wall{bound}",
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
                if let Some(dir) = requests_out {
                    let lines: Vec<_> = run
                        .requests
                        .iter()
                        .map(crate::loadgen::RequestRecord::to_json)
                        .collect();
                    crate::loadgen::write_requests(&cell.requests_file(dir), &lines)?;
                }
            }
            Err(Skipped(reason)) => {
                println!("  {}: skipped, {reason}", cell.variant.name);
                skipped.push((cell.variant.name.clone(), reason));
            }
        }
    }
    Ok((skipped, failed))
}

fn run_virtual(
    todo: &[&Cell],
    suite: &Suite,
    results: &ResultsFile,
    requests_out: Option<&Path>,
) -> Result<Outcomes, String> {
    let mut failed = Vec::new();
    let chunk = (suite.jobs.max(1) * 4).max(1);
    let mut done = 0;
    for cells in todo.chunks(chunk) {
        let started = Instant::now();
        let work: Vec<crate::offline::Job<'_, Result<RunRecord, String>>> = cells
            .iter()
            .map(|cell| {
                let cell: &Cell = cell;
                Box::new(move || crate::offline::run_cell(cell, requests_out))
                    as crate::offline::Job<'_, Result<RunRecord, String>>
            })
            .collect();
        for (cell, result) in cells.iter().zip(crate::offline::parallel(suite.jobs, work)) {
            match result {
                Ok(record) => results.append(&record)?,
                Err(e) => failed.push(format!(
                    "{} {} seed {}: {e}",
                    cell.workload.name(),
                    cell.variant.name,
                    cell.seed
                )),
            }
        }
        done += cells.len();
        eprintln!(
            "virtual: {done}/{} runs ({} in {:.1} s)",
            todo.len(),
            cells.len(),
            started.elapsed().as_secs_f64()
        );
    }
    Ok((Vec::new(), failed))
}

/// With `--resume`, a cell another suite already ran into the same results
/// file (same workload, KV, variant, rate, seed, durations, time scale and
/// preset) is not run again: its record is copied under this suite's name.
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
    for path in [results.path.clone(), results.packed_path()] {
        if path.exists() {
            std::fs::remove_file(&path).map_err(|e| format!("cannot rewrite {}: {e}", path.display()))?;
        }
    }
    for r in &kept {
        results.append(r)?;
    }
    Ok(())
}

/// What a report says besides its tables.
pub struct ReportContext {
    /// How the SLO was set.
    pub slo_why: String,
    pub capacities: Vec<capacity::CapacityEntry>,
    pub allow_mixed: bool,
    pub smg_best: Option<SmgBest>,
}

/// Writes `<out>/<suite>.md` (and plots) from the suite's records.
pub fn write_report(
    out: &Path,
    suite: &Suite,
    records: &[RunRecord],
    skipped: &[(String, String)],
    command_line: &str,
    context: &ReportContext,
) -> Result<PathBuf, String> {
    std::fs::create_dir_all(out).map_err(|e| format!("cannot create {}: {e}", out.display()))?;
    let groups = group(records);
    let mixed = report::check_mixed(&groups, context.allow_mixed)?;
    let mut md = report_header(
        &format!("dprank benchmark `{}`: {}", suite.name, suite.about),
        command_line,
    );
    for line in &mixed {
        let _ = writeln!(md, "**WARNING: {line}**\n");
    }
    let _ = writeln!(
        md,
        "Latencies in simulated ms. Each table: TTFT percentiles and goodput pooled over every seed's measured requests, with 95% cluster-bootstrap intervals (seeds resampled), beside the per-seed medians; ratios `{}` ÷ the variant of the pooled figures, paired by seed (the same resample for both); below 1 means `{}` had the lower TTFT, above 1 the higher goodput; an interval containing 1 is no difference. How each figure is measured: bench/README.md.\n",
        suite.reference, suite.reference
    );
    let _ = writeln!(
        md,
        "- Simulator preset: {}.\n- SLO: TTFT <= {} ms, TPOT <= {} ms ({}).\n- Seeds: {}.\n- The clairvoyant chooser is greedy: a strong reference, not a bound; a router can beat it.\n",
        suite.preset.describe(),
        records.first().map_or(f64::NAN, |r| r.slo.ttft_ms),
        records.first().map_or(f64::NAN, |r| r.slo.tpot_ms),
        context.slo_why,
        suite.seed_set.describe()
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
    md.push_str(&report::overview_table(&groups, &suite.reference));
    for (i, g) in groups.iter().enumerate() {
        let _ = writeln!(md, "## {}\n", group_title(g));
        md.push_str(&group_table(g, &suite.reference));
        md.push_str(&report::overload_table(g));
        md.push_str(&group_notes(g));
        md.push('\n');
        if !sweep {
            // The whole TTFT distribution, every request of every seed.
            let file = format!(
                "{}-{}-{}-ttft-cdf.png",
                suite.name,
                g.workload.replace([':', '/'], "_"),
                i + 1
            );
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
    if sweep {
        let _ = writeln!(md, "## Against the offered load\n");
        let p99 = report::sweep_series(&groups, report::pooled_ttft(99.0));
        let good = report::sweep_series(&groups, report::pooled_goodput);
        for ((workload, kv), series) in &p99 {
            let slug = workload.replace([':', '/'], "_");
            let file = format!("{}-{slug}-{kv}-ttft-p99.png", suite.name);
            plot::lines(
                &out.join(&file),
                &format!("TTFT p99 (pooled over seeds), {workload}, KV {kv}"),
                "offered load, share of sustainable capacity",
                "TTFT p99, simulated ms (log)",
                series,
                true,
            )?;
            let _ = writeln!(md, "![TTFT p99, {workload}, KV {kv}]({file})\n");
            if let Some(series) = good.get(&(workload.clone(), kv.clone())) {
                let file = format!("{}-{slug}-{kv}-goodput.png", suite.name);
                plot::lines(
                    &out.join(&file),
                    &format!("goodput (pooled over seeds), {workload}, KV {kv}"),
                    "offered load, share of sustainable capacity",
                    "share of requests within the SLO",
                    series,
                    false,
                )?;
                let _ = writeln!(md, "![goodput, {workload}, KV {kv}]({file})\n");
            }
        }
    }
    if let Some(best) = &context.smg_best {
        let _ = writeln!(
            md,
            "## smg's best setting per workload\n\nChosen by `smg-sweep` on seeds {:?} (preset `{}`, KV {}, {:.0}% of capacity): {}.\n",
            best.seeds,
            best.preset,
            best.kv,
            best.load * 100.0,
            best.criterion
        );
        for c in &best.choices {
            let _ = writeln!(
                md,
                "- `{}`: `{}` (TTFT p90 {:.0} ms; smg's default {:.0} ms)",
                c.workload, c.variant, c.p90_ms, c.default_p90_ms
            );
        }
        md.push('\n');
    }
    let _ = writeln!(md, "## Set-up\n");
    let fleet = records.first().map_or(String::new(), |r| r.fleet.clone());
    let _ = writeln!(
        md,
        "- Fleet: {fleet}, simulated (`dprank-sim`, preset `{}`), a fresh fleet per run{}.",
        suite.preset.name,
        if suite.virtual_time {
            ", in virtual time (no Envoy, no HTTP: dprank's own request lifecycle and poller on an in-memory host)"
        } else {
            ""
        }
    );
    for kv in &suite.kvs {
        let _ = writeln!(
            md,
            "- KV `{}`: {}{}.",
            kv.name(),
            suite.preset.describe_kv(*kv),
            if suite.virtual_time {
                String::new()
            } else {
                format!("; time scale {}", suite.time_scale_for(*kv))
            }
        );
    }
    let _ = writeln!(
        md,
        "- Seeds: {:?} ({}); {} simulated s of warm-up, then {} s measured (longer where a seed would hold fewer than {} requests).",
        suite.seeds,
        suite.seed_set.name(),
        suite.warmup_s,
        suite.duration_s,
        suite.min_requests
    );
    let _ = writeln!(md, "- Workloads:");
    for w in &suite.workloads {
        let _ = writeln!(md, "  - `{}` ({}): {}", w.name(), w.source(), w.describe());
    }
    let _ = writeln!(md, "- Variants:");
    let mut described: Vec<String> = Vec::new();
    for r in records {
        if described.contains(&r.variant) {
            continue;
        }
        described.push(r.variant.clone());
        let spec = r.variant.split(" = ").last().unwrap_or(&r.variant);
        if let Ok(variant) = Variant::parse(spec) {
            let model = if suite.virtual_time && variant.uses_smg() {
                "a model of smg (not smg itself): "
            } else {
                ""
            };
            let _ = writeln!(md, "  - `{}`: {model}{}", r.variant, variant.describe());
        }
    }
    let used: Vec<&capacity::CapacityEntry> = context
        .capacities
        .iter()
        .filter(|e| e.method == capacity::METHOD && e.preset == suite.preset.name)
        .collect();
    if !used.is_empty() {
        let _ = writeln!(
            md,
            "- Sustainable capacities (capacity.json; bench/README.md, \"Capacity\"):"
        );
        for e in used {
            let _ = writeln!(md, "  - {}", e.describe());
        }
    }
    let path = out.join(format!("{}.md", suite.name));
    std::fs::write(&path, md).map_err(|e| format!("cannot write {}: {e}", path.display()))?;
    Ok(path)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rate(_: &Workload, _: Kv, load: f64) -> Result<(f64, Option<(String, f64)>), String> {
        Ok((10.0 * load, Some(("test".into(), 10.0))))
    }

    fn slo() -> Slo {
        Slo {
            ttft_ms: 1000.0,
            tpot_ms: 60.0,
        }
    }

    #[test]
    fn suites_parse_and_order_cells_seed_first() {
        for name in [
            "quick",
            "harness",
            "smg-sweep",
            "tables",
            "sweep",
            "pd",
            "pd-policies",
            "virtual",
            "offline",
            "run",
        ] {
            let suite = Suite::named(name).unwrap();
            for v in suite
                .variants
                .iter()
                .filter(|v| !v.starts_with('@') && v.as_str() != SMG_BEST)
            {
                Variant::parse(v).unwrap();
            }
        }
        assert!(Suite::named("nope").is_err());
        let suite = Suite::named("quick").unwrap();
        let cells = suite
            .cells(&rate, &|_, _| Ok(slo()), None, &Provenance::default())
            .unwrap();
        // smg-best is left out without a choice.
        assert_eq!(cells.len(), 2 * 5 * 3);
        assert_eq!(cells[0].seed, 1);
        assert_eq!(cells[1].seed, 1);
        assert_ne!(cells[0].variant.name, cells[1].variant.name);
        assert_eq!(cells[0].rate, 8.5);
        assert_eq!(cells.last().unwrap().seed, 3);
    }

    #[test]
    fn published_suites_judge_and_windows_hold_enough_requests() {
        for name in ["harness", "tables", "sweep", "pd", "virtual", "run"] {
            assert_eq!(Suite::named(name).unwrap().seed_set, SeedSet::Judge, "{name}");
        }
        for name in ["quick", "smg-sweep", "offline"] {
            assert_eq!(Suite::named(name).unwrap().seed_set, SeedSet::Tune, "{name}");
        }
        let suite = Suite::named("run").unwrap();
        assert_eq!(
            (suite.warmup_s, suite.duration_s, suite.seeds[0]),
            (60.0, 300.0, 101)
        );
        let slow = |_: &Workload, _: Kv, _: f64| Ok((2.0, None));
        let cells = suite
            .cells(&slow, &|_, _| Ok(slo()), None, &Provenance::default())
            .unwrap();
        assert!(cells
            .iter()
            .all(|c| c.duration_s == 500.0 && c.nominal_duration_s == 300.0));
        let args = SuiteArgs {
            seed_set: Some(SeedSet::Tune),
            seeds: Some(4),
            ..SuiteArgs::default()
        };
        assert_eq!(
            args.apply(Suite::named("run").unwrap()).unwrap().seeds,
            vec![1, 2, 3, 4]
        );
        let too_many = SuiteArgs {
            seed_set: Some(SeedSet::Tune),
            seeds: Some(11),
            ..SuiteArgs::default()
        };
        assert!(too_many.apply(Suite::named("run").unwrap()).is_err());
    }

    #[test]
    fn smg_best_is_resolved_per_workload_with_its_wall_poll_control() {
        let best = SmgBest {
            preset: "legacy".into(),
            kv: "small".into(),
            load: 0.85,
            seeds: vec![1, 2, 3],
            criterion: "c".into(),
            choices: vec![
                SmgChoice {
                    workload: "no-prefix".into(),
                    variant: "smg-cache-aware:balance-abs=4".into(),
                    p90_ms: 1.0,
                    default_p90_ms: 2.0,
                },
                SmgChoice {
                    workload: "tenants".into(),
                    variant: "smg-cache-aware-workers".into(),
                    p90_ms: 1.0,
                    default_p90_ms: 2.0,
                },
            ],
            provenance: None,
        };
        let suite = Suite::named("harness").unwrap();
        let names = |kind| -> Vec<String> {
            suite
                .variants_for(&Workload::new(kind), Some(&best))
                .unwrap()
                .into_iter()
                .map(|v| v.name)
                .collect()
        };
        let no_prefix = names(WorkloadKind::NoPrefix);
        assert!(no_prefix.contains(&"smg-best = smg-cache-aware:balance-abs=4".to_string()));
        assert!(!no_prefix.contains(&"dprank-wall-1s".to_string()));
        // smg without --dp-aware polls loads: dprank at the same wall interval runs beside it.
        assert!(names(WorkloadKind::Tenants).contains(&"dprank-wall-1s".to_string()));
        // No choice for a workload: neither runs.
        assert_eq!(names(WorkloadKind::MooncakeConversation).len(), 3);
    }

    #[test]
    fn the_sweep_chooses_the_lowest_pooled_p90_per_workload() {
        let record = |variant: &str, workload: &str, seed: u64, p99: f64| RunRecord {
            variant: variant.into(),
            workload: workload.into(),
            load: Some(0.85),
            ..crate::report::tests::record(variant, seed, p99, 8.5)
        };
        let mut records = Vec::new();
        for seed in 1..=3 {
            records.push(record(SMG_SWEEP[0], "tenants", seed, 900.0));
            records.push(record(SMG_SWEEP[2], "tenants", seed, 500.0));
            records.push(record(SMG_SWEEP[8], "tenants", seed, 700.0));
            records.push(record("dprank", "tenants", seed, 100.0));
        }
        let best = SmgBest::choose(&records, "legacy", Provenance::default()).unwrap();
        assert_eq!(best.choices.len(), 1);
        assert_eq!(best.choices[0].variant, SMG_SWEEP[2]);
        assert!(best.choices[0].p90_ms < best.choices[0].default_p90_ms);
        assert_eq!(best.seeds, vec![1, 2, 3]);
    }

    #[test]
    fn resume_reuses_another_suites_run_of_the_same_cell() {
        let bench = Suite::named("sweep").unwrap();
        let tables = Suite {
            name: "other".into(),
            ..bench.clone()
        };
        let p = Provenance::default();
        let bench_cells = bench.cells(&rate, &|_, _| Ok(slo()), None, &p).unwrap();
        let tables_cells = tables.cells(&rate, &|_, _| Ok(slo()), None, &p).unwrap();
        let ran = |c: &Cell| RunRecord {
            key: c.key(),
            suite: c.suite.clone(),
            variant: c.variant.name.clone(),
            ..crate::report::tests::record("x", c.seed, 1.0, 1.0)
        };
        let records: Vec<RunRecord> = bench_cells.iter().map(ran).collect();
        let reused = reusable(&records, "other", &tables_cells);
        assert_eq!(reused.len(), bench_cells.len());
        let keys: HashSet<String> = tables_cells.iter().map(Cell::key).collect();
        assert!(reused.iter().all(|r| r.suite == "other" && keys.contains(&r.key)));
        let mut records = records;
        records.extend(reused);
        assert!(reusable(&records, "other", &tables_cells).is_empty());
        let longer = Suite {
            duration_s: 400.0,
            ..tables
        };
        assert!(reusable(
            &records,
            "other",
            &longer.cells(&rate, &|_, _| Ok(slo()), None, &p).unwrap()
        )
        .is_empty());
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
        let suite = args.apply(Suite::named("run").unwrap()).unwrap();
        let cells = suite
            .cells(
                &|_, _, _| Err("no capacity needed".into()),
                &|_, _| Ok(slo()),
                None,
                &Provenance::default(),
            )
            .unwrap();
        assert_eq!(cells.len(), 4);
        assert!(cells.iter().all(|c| c.rate == 7.0 && c.load.is_none()));
        assert_eq!(cells[0].variant.gateways, 4);
        let bad = SuiteArgs {
            variants: vec!["dprank:nope=1".into()],
            ..SuiteArgs::default()
        };
        assert!(bad.apply(Suite::named("run").unwrap()).is_err());
        // A preset sets the ranks and the trace scale.
        let deep = SuiteArgs {
            sim_preset: Some("deepseek-v3-dp8".into()),
            workloads: vec!["mooncake-conversation".into()],
            ..SuiteArgs::default()
        };
        let suite = deep.apply(Suite::named("run").unwrap()).unwrap();
        assert_eq!(suite.fleet.dp_size, 8);
        assert_eq!(suite.workloads[0].trace.input_scale, 0.25);
        let replay = SuiteArgs {
            workloads: vec!["replay".into()],
            replay_trace: Some(PathBuf::from("t.jsonl")),
            ..SuiteArgs::default()
        };
        let suite = replay.apply(Suite::named("run").unwrap()).unwrap();
        assert_eq!(suite.workloads[0].kind, WorkloadKind::TraceFile);
        assert_eq!(suite.workloads[0].trace.input_scale, 0.25);
    }
}
