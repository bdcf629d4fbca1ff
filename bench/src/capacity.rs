//! The fleet's capacity for a workload: what offered loads are fractions of.
//!
//! Procedure (documented in bench/README.md): run the workload through the
//! best router the simulator offers (its fleet-wide oracle, else the
//! workers' own minimum-tokens balancer) at an offered rate well above what
//! the fleet can serve, for 60 simulated seconds, and count the requests that
//! complete in the last two thirds of that window, when the queues are full.
//! That completion rate is the capacity. If the fleet kept up (completions
//! above 90% of the offered rate), the offered rate was not high enough: it
//! is raised 1.6x and the run repeated. Results are kept in capacity.json
//! next to the run records and reused until `--remeasure`.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::client::pooled_client;
use crate::fleet::Tools;
use crate::loadgen::{run_plan, Drain, LoadOptions};
use crate::runner::{start_fleets, start_fronts, Cell, FleetShape, Kv, MAX_OUTPUT};
use crate::stats::Slo;
use crate::variant::{Dispatch, SimFeatures, Variant};
use crate::workload::{Shape, Workload};

/// Simulated seconds of one measuring run.
pub const WINDOW_S: f64 = 60.0;
/// The seed of the measuring runs (no benchmark run uses it).
pub const SEED: u64 = 1_000_000;
const MAX_ATTEMPTS: usize = 5;

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct CapacityEntry {
    /// Workload name (with the trace file for file replays).
    pub workload: String,
    pub kv: String,
    pub fleet: String,
    pub time_scale: f64,
    /// Completed requests per simulated second under overload.
    pub rps: f64,
    pub router: String,
    pub offered_rps: f64,
    pub measured: String,
}

/// The key a workload's capacity is stored under. `bursty` sends the
/// `no-prefix` requests and only times them differently, so its load is a
/// fraction of the `no-prefix` capacity: the arrival pattern is then the
/// only difference between the two.
pub fn workload_key(workload: &Workload) -> String {
    use crate::workload::WorkloadKind;
    match (&workload.replay.file, workload.kind) {
        (Some(file), WorkloadKind::Replay) => format!(
            "replay:{}",
            file.file_name()
                .map_or(String::new(), |f| f.to_string_lossy().into_owned())
        ),
        (_, WorkloadKind::Bursty) => WorkloadKind::NoPrefix.name().to_string(),
        (_, kind) => kind.name().to_string(),
    }
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

    pub fn lookup(
        &self,
        workload: &Workload,
        kv: Kv,
        fleet: &FleetShape,
    ) -> Result<Option<CapacityEntry>, String> {
        let key = workload_key(workload);
        Ok(self
            .load()?
            .into_iter()
            .find(|e| e.workload == key && e.kv == kv.name() && e.fleet == fleet_key(fleet)))
    }

    /// Stores `entry`, replacing one with the same workload, KV and fleet.
    pub fn store(&self, entry: &CapacityEntry) -> Result<(), String> {
        let mut entries = self.load()?;
        entries.retain(|e| !(e.workload == entry.workload && e.kv == entry.kv && e.fleet == entry.fleet));
        entries.push(entry.clone());
        entries.sort_by(|a, b| (&a.workload, &a.kv).cmp(&(&b.workload, &b.kv)));
        if let Some(dir) = self.path.parent() {
            std::fs::create_dir_all(dir).map_err(|e| format!("cannot create {}: {e}", dir.display()))?;
        }
        let text = serde_json::to_string_pretty(&entries).map_err(|e| format!("capacity.json: {e}"))?;
        std::fs::write(&self.path, text + "\n")
            .map_err(|e| format!("cannot write {}: {e}", self.path.display()))
    }
}

/// A first offered rate (requests per simulated second) for the search.
fn first_guess(kv: Kv) -> f64 {
    match kv {
        Kv::Small => 16.0,
        Kv::Large => 40.0,
    }
}

/// Whether a run that offered `offered` and completed `completed` per
/// second saturated the fleet.
pub fn saturated(offered: f64, completed: f64) -> bool {
    completed < 0.9 * offered
}

/// Completions per second among `ends` (simulated seconds) in the last two
/// thirds of a window of `window_s`.
pub fn completion_rate(ends: &[f64], window_s: f64) -> f64 {
    let from = window_s / 3.0;
    let count = ends.iter().filter(|e| **e >= from && **e <= window_s).count();
    count as f64 / (window_s - from)
}

/// Measures the capacity as described in the module documentation.
pub async fn measure(
    tools: &Tools,
    features: &SimFeatures,
    workload: &Workload,
    kv: Kv,
    fleet: FleetShape,
    time_scale: f64,
) -> Result<CapacityEntry, String> {
    // Workloads that share a capacity (see `workload_key`) measure it alike.
    let workload = &match workload.kind {
        crate::workload::WorkloadKind::Bursty => Workload::new(crate::workload::WorkloadKind::NoPrefix),
        _ => workload.clone(),
    };
    let router = if features.dispatch_arg(Dispatch::Oracle).is_ok() {
        "oracle"
    } else {
        "in-server"
    };
    let variant = Variant::parse(router)?;
    let mut offered = first_guess(kv);
    for attempt in 0..MAX_ATTEMPTS {
        let cell = Cell {
            suite: "capacity".into(),
            workload: workload.clone(),
            variant: variant.clone(),
            seed: SEED,
            kv,
            rate: offered,
            load: None,
            warmup_s: 0.0,
            duration_s: WINDOW_S,
            time_scale,
            fleet,
            slo: Slo {
                ttft_ms: f64::INFINITY,
                tpot_ms: f64::INFINITY,
            },
        };
        let plan = workload.plan(&Shape {
            rate: offered,
            duration_s: WINDOW_S,
            seed: SEED,
            max_prompt: kv.max_prompt(),
            max_output: MAX_OUTPUT,
        })?;
        let client = pooled_client();
        let name = format!("capacity-{}-{}-{attempt}", workload.kind.name(), kv.name());
        let fleets = start_fleets(tools, features, &cell, &name)?;
        let fronts = start_fronts(tools, &client, &variant, &fleets, time_scale, &name).await?;
        let options = LoadOptions {
            gateways: fronts.iter().map(|f| f.url.clone()).collect(),
            spread: variant.spread,
            workers: Vec::new(),
            time_scale,
            sample_every: std::time::Duration::from_secs(1),
            request_timeout: std::time::Duration::from_secs(600),
            seed: SEED,
            progress: true,
            label: format!("capacity {} {} @{offered:.1}", workload.kind.name(), kv.name()),
            cut_at_s: Some(WINDOW_S),
            drain: Drain::Complete,
            turn_horizon_s: None,
        };
        let output = run_plan(&plan, &options).await?;
        drop(fronts);
        drop(fleets);
        let ends: Vec<f64> = output
            .records
            .iter()
            .filter(|r| r.ok())
            .map(|r| r.end_s)
            .collect();
        let completed = completion_rate(&ends, WINDOW_S);
        println!(
            "  capacity {} KV {}: offered {offered:.1} req/s, completed {completed:.2} req/s in the last {:.0} s ({router})",
            workload.kind.name(),
            kv.name(),
            WINDOW_S * 2.0 / 3.0
        );
        if saturated(offered, completed) {
            return Ok(CapacityEntry {
                workload: workload_key(workload),
                kv: kv.name().into(),
                fleet: fleet_key(&fleet),
                time_scale,
                rps: completed,
                router: router.into(),
                offered_rps: offered,
                measured: crate::report::now_utc(),
            });
        }
        offered *= 1.6;
    }
    Err(format!(
        "capacity of {} with KV {}: the fleet kept up even at {offered:.1} req/s offered",
        workload.kind.name(),
        kv.name()
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::workload::WorkloadKind;

    #[test]
    fn completion_rate_counts_the_saturated_part_of_the_window() {
        let ends = [1.0, 10.0, 20.0, 30.0, 59.0, 60.0, 61.0];
        assert_eq!(completion_rate(&ends, 60.0), 4.0 / 40.0);
        assert!(saturated(10.0, 8.0) && !saturated(10.0, 9.5));
    }

    #[test]
    fn entries_are_stored_by_workload_kv_and_fleet() {
        let dir = std::env::temp_dir().join(format!("dprank-capacity-{}", std::process::id()));
        let file = CapacityFile::new(&dir);
        assert_eq!(workload_key(&Workload::new(WorkloadKind::Bursty)), "no-prefix");
        let w = Workload::new(WorkloadKind::Tenants);
        let fleet = FleetShape::default();
        assert_eq!(file.lookup(&w, Kv::Small, &fleet).unwrap(), None);
        let mut entry = CapacityEntry {
            workload: workload_key(&w),
            kv: "small".into(),
            fleet: "2x4".into(),
            time_scale: 5.0,
            rps: 11.0,
            router: "oracle".into(),
            offered_rps: 16.0,
            measured: "now".into(),
        };
        file.store(&entry).unwrap();
        entry.rps = 12.0;
        file.store(&entry).unwrap();
        assert_eq!(file.load().unwrap().len(), 1);
        assert_eq!(file.lookup(&w, Kv::Small, &fleet).unwrap().unwrap().rps, 12.0);
        assert_eq!(file.lookup(&w, Kv::Large, &fleet).unwrap(), None);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
