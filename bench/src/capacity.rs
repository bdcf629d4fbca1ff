//! The fleet's sustainable capacity for a workload: what offered loads are
//! fractions of, on the harness and offline alike.
//!
//! Definition: the highest offered rate at which the clairvoyant chooser
//! keeps the TTFT p90 and the TPOT p90 within the SLO over a 10-minute
//! simulated run (the SLO has both: a rate whose decode batches are too
//! large to meet it is not sustained, whatever its queues): 60 s
//! of warm-up arrivals, then 600 s measured, the p90 pooled over the
//! requests of five capacity seeds (1,000,001-1,000,005, never a table's).
//! Found by bisection in virtual time (the offline engine, deterministic):
//! first a start, the completion rate under overload (the earlier
//! definition of capacity), then a bracket [lo, hi] with lo meeting the SLO
//! and hi not (up from the start by 1.25x, then doubling; or down by
//! halves), halved until it is narrower than 2% of hi; the capacity is
//! lo. When no request finishes within the overload window (long prompts
//! on a slow preset), the overload throughput is not measured and the
//! search starts from the first overload rate instead, saying so; a rate
//! 256 times lower still missing the SLO is reported as out of reach. A
//! rate is given up as soon as its seeds together have more requests past
//! the TTFT or the TPOT target than a p90 allows (it fails). Results go to
//! capacity.json with how they were found, and are reused until
//! `--remeasure`. `bursty` sends the
//! `no-prefix` requests and only times them differently, so its load is a
//! fraction of the `no-prefix` capacity: the arrival pattern is then the
//! only difference between the two.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::loadgen::RequestRecord;
use crate::offline::{driver, sim_config};
use crate::preset::Kv;
use crate::preset::SimPreset;
use crate::provenance::Provenance;
use crate::runner::FleetShape;
use crate::stats::{percentile, Slo};
use crate::variant::Variant;
use crate::workload::{switching, Plan, Shape, Workload, WorkloadKind};

/// Simulated seconds of warm-up arrivals before the measured ones.
pub const WARMUP_S: f64 = 60.0;
/// Simulated seconds of measured arrivals.
pub const WINDOW_S: f64 = 600.0;
/// The seeds of the measuring runs (no table uses them).
pub const SEEDS: [u64; 5] = [1_000_001, 1_000_002, 1_000_003, 1_000_004, 1_000_005];
/// The bisection stops when the bracket is narrower than this share of its top.
pub const PRECISION: f64 = 0.02;
/// The TTFT percentile held within the SLO.
pub const PERCENTILE: f64 = 90.0;
/// The first step up from a start that keeps the SLO (then doubling): most
/// capacities lie within 1.25x of the overload throughput, and a probe far
/// above the capacity is the search's slowest.
const FIRST_RAISE: f64 = 1.25;
/// How entries found this way are marked.
pub const METHOD: &str = "sustainable";
/// The overload window that gives the upper bound (simulated s).
const OVERLOAD_WINDOW_S: f64 = 60.0;

/// One capacity seed's (TTFT, TPOT) pairs in ms, or `None` when the run was given up.
type SeedLatencies = Result<Option<Vec<(f64, f64)>>, String>;

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct CapacityEntry {
    /// [`workload_key`].
    pub workload: String,
    pub kv: String,
    pub fleet: String,
    /// The simulator preset (entries made before presets: `legacy`).
    #[serde(default = "legacy")]
    pub preset: String,
    /// [`METHOD`]; empty for entries of the earlier 40-second overload
    /// measurement, which are not used any more.
    #[serde(default)]
    pub method: String,
    /// Requests per simulated second.
    pub rps: f64,
    #[serde(default)]
    pub slo_ttft_ms: f64,
    /// The TPOT part of the SLO (0: entries measured on TTFT alone).
    #[serde(default)]
    pub slo_tpot_ms: f64,
    /// The pooled TTFT p90 at `rps`.
    #[serde(default)]
    pub p90_ms: f64,
    /// The pooled TPOT p90 at `rps`.
    #[serde(default)]
    pub tpot_p90_ms: f64,
    /// Every rate tried, with its pooled TTFT p90 (None: infinite, the run
    /// was given up).
    #[serde(default)]
    pub steps: Vec<(f64, Option<f64>)>,
    /// The completion rate under overload (the bracket's first top).
    #[serde(default)]
    pub overload_rps: f64,
    #[serde(default)]
    pub seeds: Vec<u64>,
    #[serde(default)]
    pub warmup_s: f64,
    #[serde(default)]
    pub window_s: f64,
    pub measured: String,
    #[serde(default)]
    pub provenance: Option<Provenance>,
}

fn legacy() -> String {
    "legacy".into()
}

impl CapacityEntry {
    /// How it was found, for a report: one line.
    pub fn describe(&self) -> String {
        if self.method != METHOD {
            return format!(
                "`{}`, KV {}, {}: {:.2} req/s by the earlier overload measurement (not used)",
                self.workload, self.kv, self.fleet, self.rps
            );
        }
        format!(
            "`{}`, KV {}, {}, preset `{}`: {:.2} req/s, the highest rate at which the clairvoyant chooser kept TTFT p90 within {} ms ({:.0} ms there) and TPOT p90 within {} ms ({:.1} ms there) over {} s of warm-up and {} s measured, pooled over seeds {:?}; {} ({})",
            self.workload,
            self.kv,
            self.fleet,
            self.preset,
            self.rps,
            self.slo_ttft_ms,
            self.p90_ms,
            self.slo_tpot_ms,
            self.tpot_p90_ms,
            self.warmup_s,
            self.window_s,
            self.seeds,
            if self.overload_rps > 0.0 {
                format!("overload throughput {:.2} req/s", self.overload_rps)
            } else {
                format!("overload throughput not measured (no request finished within the {OVERLOAD_WINDOW_S} s overload window)")
            },
            self.measured
        )
    }
}

/// The workload whose capacity `workload` uses: `bursty` uses `no-prefix`'s,
/// and so does `switching` (its trace part is offered the same share of the
/// trace's own capacity: [`capacity_parts`]).
pub fn capacity_workload(workload: &Workload) -> Workload {
    match workload.kind {
        WorkloadKind::Bursty => Workload {
            kind: WorkloadKind::NoPrefix,
            ..workload.clone()
        },
        WorkloadKind::Switching => switching::part(workload, WorkloadKind::NoPrefix),
        _ => workload.clone(),
    }
}

/// Every workload whose capacity `workload`'s rates need: itself, or for
/// `switching` its `no-prefix` and its trace part.
pub fn capacity_parts(workload: &Workload) -> Vec<Workload> {
    match workload.kind {
        WorkloadKind::Switching => vec![
            switching::part(workload, WorkloadKind::NoPrefix),
            switching::part(workload, WorkloadKind::MooncakeConversation),
        ],
        _ => vec![workload.clone()],
    }
}

/// The key a workload's capacity is stored under: its name, the trace
/// scale where it has one, and its output cap (admission reserves from it).
pub fn workload_key(workload: &Workload) -> String {
    let w = capacity_workload(workload);
    let scale = if w.kind.is_block_hash() {
        format!(", input x {}", w.trace.input_scale)
    } else {
        String::new()
    };
    format!("{} ({}{scale})", w.name(), w.cap.describe())
}

fn fleet_key(fleet: &FleetShape) -> String {
    format!("{}x{}", fleet.workers, fleet.dp_size)
}

pub struct CapacityFile {
    pub path: PathBuf,
}

impl CapacityFile {
    pub fn new(dir: &Path) -> CapacityFile {
        CapacityFile {
            path: dir.join("capacity.json"),
        }
    }

    pub fn load(&self) -> Result<Vec<CapacityEntry>, String> {
        match std::fs::read_to_string(&self.path) {
            Ok(text) => serde_json::from_str(&text).map_err(|e| format!("{}: {e}", self.path.display())),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(Vec::new()),
            Err(e) => Err(format!("cannot read {}: {e}", self.path.display())),
        }
    }

    fn matches(e: &CapacityEntry, key: &str, kv: Kv, fleet: &FleetShape, preset: &str, slo: &Slo) -> bool {
        e.method == METHOD
            && e.workload == key
            && e.kv == kv.name()
            && e.fleet == fleet_key(fleet)
            && e.preset == preset
            && e.slo_ttft_ms == slo.ttft_ms
            && e.slo_tpot_ms == slo.tpot_ms
    }

    /// The sustainable capacity stored for these settings.
    pub fn lookup(
        &self,
        workload: &Workload,
        kv: Kv,
        fleet: &FleetShape,
        preset: &SimPreset,
        slo: &Slo,
    ) -> Result<Option<CapacityEntry>, String> {
        let key = workload_key(workload);
        Ok(self
            .load()?
            .into_iter()
            .find(|e| Self::matches(e, &key, kv, fleet, preset.name, slo)))
    }

    /// Stores `entry`, replacing one with the same settings.
    pub fn store(&self, entry: &CapacityEntry) -> Result<(), String> {
        let mut entries = self.load()?;
        entries.retain(|e| {
            !(e.method == entry.method
                && e.workload == entry.workload
                && e.kv == entry.kv
                && e.fleet == entry.fleet
                && e.preset == entry.preset
                && e.slo_ttft_ms == entry.slo_ttft_ms
                && e.slo_tpot_ms == entry.slo_tpot_ms)
        });
        entries.push(entry.clone());
        entries.sort_by(|a, b| (&a.preset, &a.workload, &a.kv).cmp(&(&b.preset, &b.workload, &b.kv)));
        if let Some(dir) = self.path.parent() {
            std::fs::create_dir_all(dir).map_err(|e| format!("cannot create {}: {e}", dir.display()))?;
        }
        let text = serde_json::to_string_pretty(&entries).map_err(|e| format!("capacity.json: {e}"))?;
        std::fs::write(&self.path, text + "\n")
            .map_err(|e| format!("cannot write {}: {e}", self.path.display()))
    }
}

/// What one capacity measurement is of.
pub struct CapacityJob<'a> {
    pub workload: &'a Workload,
    pub kv: Kv,
    pub fleet: FleetShape,
    pub preset: &'static SimPreset,
    pub slo: Slo,
    /// Runs at once (each is single-threaded).
    pub jobs: usize,
    pub provenance: &'a Provenance,
}

impl CapacityJob<'_> {
    fn shape(&self, rate: f64, seed: u64, duration_s: f64) -> Shape {
        Shape {
            rate,
            duration_s,
            seed,
            max_prompt: self.preset.max_prompt(self.kv),
            max_output: self.preset.max_output,
        }
    }

    fn spec<'v>(&self, variant: &'v Variant, seed: u64) -> Result<driver::RunSpec<'v>, String> {
        Ok(driver::RunSpec {
            variant,
            sim: sim_config(
                self.preset,
                self.kv,
                self.fleet.dp_size,
                &SimPreset::noise_seed_args(seed),
            )?,
            workers: self.fleet.workers,
            seed,
            turn_horizon_s: f64::INFINITY,
            cut_at_s: None,
            requests_out: None,
            give_up: None,
        })
    }

    /// Completions per second under overload: the clairvoyant chooser at a
    /// rate the fleet cannot serve, completions in the last two thirds of a
    /// 60 s window; the rate doubles until the fleet falls behind.
    fn overload_throughput(&self, workload: &Workload) -> Result<f64, String> {
        let clairvoyant = Variant::parse("clairvoyant")?;
        let mut offered = self.first_overload_rate();
        for _ in 0..12 {
            let plan = workload.plan(&self.shape(offered, SEEDS[0], OVERLOAD_WINDOW_S))?;
            let mut spec = self.spec(&clairvoyant, SEEDS[0])?;
            spec.cut_at_s = Some(OVERLOAD_WINDOW_S);
            spec.turn_horizon_s = OVERLOAD_WINDOW_S;
            let outcome = driver::run(&plan, &spec)?;
            let from = OVERLOAD_WINDOW_S / 3.0;
            let completed = outcome
                .output
                .records
                .iter()
                .filter(|r| r.ok() && r.end_s >= from && r.end_s <= OVERLOAD_WINDOW_S)
                .count() as f64
                / (OVERLOAD_WINDOW_S - from);
            if completed < 0.9 * offered {
                return Ok(completed);
            }
            offered *= 2.0;
        }
        Err(format!(
            "capacity of `{}`: the fleet kept up even at {offered:.1} req/s",
            workload.name()
        ))
    }

    /// The rate the overload measurement starts from: two requests per
    /// second per rank.
    fn first_overload_rate(&self) -> f64 {
        2.0 * self.fleet.workers as f64 * self.fleet.dp_size as f64
    }

    /// The pooled TTFT p90 and TPOT p90 (ms) of the capacity seeds at
    /// `rate`; the TTFT ∞ when a run was given up (the p90 was then already
    /// past the SLO).
    pub fn p90_at(&self, workload: &Workload, rate: f64) -> Result<(f64, f64), String> {
        let clairvoyant = Variant::parse("clairvoyant")?;
        let plans: Vec<Plan> = SEEDS
            .iter()
            .map(|seed| workload.plan(&self.shape(rate, *seed, WARMUP_S + WINDOW_S)))
            .collect::<Result<_, _>>()?;
        let measured: usize = plans.iter().map(measured_requests).sum();
        // More late requests than this over the seeds put the pooled p90 past the SLO.
        let late_allowed = ((1.0 - PERCENTILE / 100.0) * measured as f64).floor() as usize;
        let counts = std::sync::Arc::new(driver::LateCounts::default());
        let work: Vec<crate::offline::Job<'_, SeedLatencies>> = plans
            .iter()
            .zip(SEEDS)
            .map(|(plan, seed)| {
                let clairvoyant = &clairvoyant;
                let counts = counts.clone();
                Box::new(move || {
                    let mut spec = self.spec(clairvoyant, seed)?;
                    spec.turn_horizon_s = WARMUP_S + WINDOW_S + crate::workload::chat::TAIL_S;
                    spec.give_up = Some(driver::GiveUp {
                        from_s: WARMUP_S,
                        ttft_s: self.slo.ttft_ms / 1000.0,
                        tpot_s: self.slo.tpot_ms / 1000.0,
                        late_allowed,
                        counts,
                    });
                    let outcome = driver::run(plan, &spec)?;
                    if outcome.gave_up {
                        return Ok(None);
                    }
                    Ok(Some(
                        outcome
                            .output
                            .records
                            .iter()
                            .filter(|r| r.sent_s >= WARMUP_S)
                            .map(latencies)
                            .collect(),
                    ))
                }) as crate::offline::Job<'_, _>
            })
            .collect();
        let (mut ttft, mut tpot) = (Vec::new(), Vec::new());
        for result in crate::offline::parallel(self.jobs, work) {
            match result? {
                Some(pairs) => {
                    for (a, b) in pairs {
                        ttft.push(a);
                        tpot.push(b);
                    }
                }
                None => return Ok((f64::INFINITY, f64::INFINITY)),
            }
        }
        Ok((percentile(&ttft, PERCENTILE), percentile(&tpot, PERCENTILE)))
    }

    /// Measures the sustainable capacity (module documentation).
    pub fn measure(&self) -> Result<CapacityEntry, String> {
        let workload = capacity_workload(self.workload);
        let label = format!("{} KV {} ({})", workload.name(), self.kv.name(), self.preset.name);
        let overload = self.overload_throughput(&workload)?;
        let start = search_start(overload, self.first_overload_rate());
        if start == overload {
            eprintln!("capacity {label}: overload throughput {overload:.2} req/s");
        } else {
            eprintln!(
                "capacity {label}: no request finished within the {OVERLOAD_WINDOW_S} s overload window, so the overload throughput was not measured; the search starts from {start:.1} req/s"
            );
        }
        let within = |(ttft, tpot): (f64, f64)| ttft <= self.slo.ttft_ms && tpot <= self.slo.tpot_ms;
        let mut steps: Vec<(f64, Option<f64>)> = Vec::new();
        let mut try_rate = |rate: f64| -> Result<(f64, f64), String> {
            let p90 = self.p90_at(&workload, rate)?;
            if p90.0.is_finite() {
                eprintln!(
                    "capacity {label}: {rate:.3} req/s -> TTFT p90 {:.0} ms, TPOT p90 {:.1} ms",
                    p90.0, p90.1
                );
            } else {
                eprintln!(
                    "capacity {label}: {rate:.3} req/s -> given up: more requests past the TTFT or the TPOT target than a p90 allows"
                );
            }
            steps.push((rate, p90.0.is_finite().then_some(p90.0)));
            Ok(p90)
        };
        // The bracket: from the start, up by FIRST_RAISE and then doubling
        // while the rate keeps the SLO, or down by halves while it does not.
        let (mut lo, mut hi, mut lo_p90);
        let start_p90 = try_rate(start)?;
        if within(start_p90) {
            (lo, lo_p90) = (start, start_p90);
            hi = start * FIRST_RAISE;
            let mut raises = 0;
            loop {
                let p90 = try_rate(hi)?;
                if !within(p90) {
                    break;
                }
                // The overload throughput of a short window can be far below
                // what is sustained (long answers finish after the window).
                (lo, lo_p90) = (hi, p90);
                hi *= 2.0;
                raises += 1;
                if raises > 12 {
                    return Err(format!(
                        "capacity {label}: the p90s stayed within the SLO up to {hi:.2} req/s"
                    ));
                }
            }
        } else {
            (lo, hi) = (start / 2.0, start);
            lo_p90 = try_rate(lo)?;
            let mut halvings = 0;
            while !within(lo_p90) {
                halvings += 1;
                if halvings > 8 {
                    return Err(format!(
                        "capacity {label}: not measured: even {lo:.3} req/s misses TTFT p90 <= {} ms or TPOT p90 <= {} ms ({:.0} ms, {:.1} ms): the SLO is out of reach on this preset",
                        self.slo.ttft_ms, self.slo.tpot_ms, lo_p90.0, lo_p90.1
                    ));
                }
                hi = lo;
                lo /= 2.0;
                lo_p90 = try_rate(lo)?;
            }
        }
        while (hi - lo) / hi > PRECISION {
            let mid = (lo + hi) / 2.0;
            let p90 = try_rate(mid)?;
            if within(p90) {
                (lo, lo_p90) = (mid, p90);
            } else {
                hi = mid;
            }
        }
        Ok(CapacityEntry {
            workload: workload_key(&workload),
            kv: self.kv.name().into(),
            fleet: fleet_key(&self.fleet),
            preset: self.preset.name.into(),
            method: METHOD.into(),
            rps: lo,
            slo_ttft_ms: self.slo.ttft_ms,
            slo_tpot_ms: self.slo.tpot_ms,
            p90_ms: lo_p90.0,
            tpot_p90_ms: lo_p90.1,
            steps,
            overload_rps: overload,
            seeds: SEEDS.to_vec(),
            warmup_s: WARMUP_S,
            window_s: WINDOW_S,
            measured: crate::provenance::now_utc(),
            provenance: Some(self.provenance.clone()),
        })
    }
}

/// The rate the bisection starts from: the overload throughput, or the
/// first overload rate when no request finished in the overload window
/// (then there is no throughput to start from, and a rate of 0 would plan
/// no arrivals).
fn search_start(overload: f64, first_overload_rate: f64) -> f64 {
    if overload > 0.0 && overload.is_finite() {
        overload
    } else {
        first_overload_rate
    }
}

/// A measured request's TTFT and TPOT in ms: infinite when it failed; the
/// TPOT NaN (left out of percentiles) for an answer of one token, which has
/// no time per output token.
pub fn latencies(r: &RequestRecord) -> (f64, f64) {
    if !r.ok() {
        return (f64::INFINITY, f64::INFINITY);
    }
    let ttft = r.ttft_ms.unwrap_or(f64::INFINITY);
    let tpot = if r.tokens > 1 { r.tpot_ms } else { f64::NAN };
    (ttft, tpot)
}

/// Requests of a plan sent after the warm-up (chat: turns of the sessions
/// starting after it).
fn measured_requests(plan: &Plan) -> usize {
    plan.requests.iter().filter(|r| r.at_s >= WARMUP_S).count()
        + plan
            .sessions
            .iter()
            .filter(|s| s.start_s >= WARMUP_S)
            .map(|s| s.turns.len())
            .sum::<usize>()
}

/// The stored capacity for these settings, measured first (and stored)
/// when there is none or `remeasure` asks.
pub fn get_or_measure(
    file: &CapacityFile,
    job: &CapacityJob,
    remeasure: bool,
) -> Result<CapacityEntry, String> {
    if !remeasure {
        if let Some(entry) = file.lookup(job.workload, job.kv, &job.fleet, job.preset, &job.slo)? {
            return Ok(entry);
        }
    }
    let entry = job.measure()?;
    file.store(&entry)?;
    Ok(entry)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::preset::preset;

    fn slo() -> Slo {
        Slo {
            ttft_ms: 1000.0,
            tpot_ms: 60.0,
        }
    }

    #[test]
    fn entries_are_stored_by_workload_kv_fleet_preset_and_slo() {
        let dir = std::env::temp_dir().join(format!("dprank-capacity-{}", std::process::id()));
        let file = CapacityFile::new(&dir);
        assert_eq!(
            workload_key(&Workload::new(WorkloadKind::Bursty)),
            workload_key(&Workload::new(WorkloadKind::NoPrefix))
        );
        let w = Workload::new(WorkloadKind::Tenants);
        let fleet = FleetShape::default();
        let legacy = preset("legacy").unwrap();
        assert_eq!(file.lookup(&w, Kv::Small, &fleet, legacy, &slo()).unwrap(), None);
        let mut entry = CapacityEntry {
            workload: workload_key(&w),
            kv: "small".into(),
            fleet: "2x4".into(),
            preset: "legacy".into(),
            method: METHOD.into(),
            rps: 11.0,
            slo_ttft_ms: 1000.0,
            slo_tpot_ms: 60.0,
            p90_ms: 900.0,
            tpot_p90_ms: 50.0,
            steps: vec![],
            overload_rps: 14.0,
            seeds: SEEDS.to_vec(),
            warmup_s: WARMUP_S,
            window_s: WINDOW_S,
            measured: "now".into(),
            provenance: None,
        };
        file.store(&entry).unwrap();
        entry.rps = 12.0;
        file.store(&entry).unwrap();
        assert_eq!(file.load().unwrap().len(), 1);
        assert_eq!(
            file.lookup(&w, Kv::Small, &fleet, legacy, &slo())
                .unwrap()
                .unwrap()
                .rps,
            12.0
        );
        assert_eq!(file.lookup(&w, Kv::Large, &fleet, legacy, &slo()).unwrap(), None);
        let tighter = Slo {
            ttft_ms: 500.0,
            ..slo()
        };
        assert_eq!(
            file.lookup(&w, Kv::Small, &fleet, legacy, &tighter).unwrap(),
            None
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn entries_of_the_earlier_overload_measurement_parse_and_are_not_used() {
        let dir = std::env::temp_dir().join(format!("dprank-capacity-old-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(
            dir.join("capacity.json"),
            r#"[{"workload":"tenants","kv":"small","fleet":"2x4","time_scale":5.0,"rps":11.0,"router":"oracle","offered_rps":16.0,"measured":"then"}]"#,
        )
        .unwrap();
        let file = CapacityFile::new(&dir);
        let entries = file.load().unwrap();
        assert_eq!(entries[0].preset, "legacy");
        assert!(entries[0].describe().contains("not used"));
        let w = Workload::new(WorkloadKind::Tenants);
        let legacy = preset("legacy").unwrap();
        assert_eq!(
            file.lookup(&w, Kv::Small, &FleetShape::default(), legacy, &slo())
                .unwrap(),
            None
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_window_where_nothing_finished_starts_the_search_from_the_first_overload_rate() {
        assert_eq!(search_start(12.5, 32.0), 12.5);
        assert_eq!(search_start(0.0, 32.0), 32.0);
        assert_eq!(search_start(f64::NAN, 32.0), 32.0);
        let entry = CapacityEntry {
            overload_rps: 0.0,
            ..serde_json::from_str::<CapacityEntry>(
                r#"{"workload":"mooncake-conversation","kv":"large","fleet":"2x8","rps":0.4,"method":"sustainable","measured":"then"}"#,
            )
            .unwrap()
        };
        assert_eq!(entry.method, METHOD);
        assert!(
            entry.describe().contains("overload throughput not measured"),
            "{}",
            entry.describe()
        );
    }

    #[test]
    fn a_small_fleet_has_a_sustainable_capacity_below_its_overload_throughput() {
        // One worker of two ranks on legacy small KV, no-prefix: quick.
        let legacy = preset("legacy").unwrap();
        let w = Workload::new(WorkloadKind::NoPrefix);
        let fleet = FleetShape {
            workers: 1,
            dp_size: 2,
            ..FleetShape::default()
        };
        let provenance = Provenance::default();
        let job = CapacityJob {
            workload: &w,
            kv: Kv::Small,
            fleet,
            preset: legacy,
            slo: slo(),
            jobs: 2,
            provenance: &provenance,
        };
        let entry = job.measure().unwrap();
        assert!(entry.rps > 0.5 && entry.rps < entry.overload_rps, "{entry:?}");
        assert!(entry.p90_ms <= 1000.0 && entry.tpot_p90_ms <= 60.0, "{entry:?}");
        // Just above it, a p90 misses the SLO: the bisection's top.
        let above = entry
            .steps
            .iter()
            .filter(|(r, _)| *r > entry.rps)
            .map(|s| s.0)
            .fold(f64::INFINITY, f64::min);
        assert!((above - entry.rps) / above <= PRECISION + 1e-9, "{entry:?}");
        let (ttft, tpot) = job.p90_at(&w, above).unwrap();
        assert!(ttft > 1000.0 || tpot > 60.0, "{ttft} {tpot}");
    }
}
