//! One run of one cell: a fresh simulated fleet, the variant's gateways in
//! front of it, the workload's plan for one seed, and a record of what it
//! measured. Records are appended to a JSONL file as they finish, so a long
//! suite can be stopped and resumed, and every table and plot is rebuilt
//! from the records alone.

use std::collections::BTreeMap;
use std::fs::OpenOptions;
use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use crate::client::{pooled_client, PooledClient};
use crate::cpu::{CpuMeter, CpuTimes, CpuUse};
use crate::envoy::{Balancer, DprankSettings};
use crate::fleet::{
    dprank_counters, smg_front, smg_launch_args, start_envoy, start_envoy_pd, DprankCounters, Front,
    SimFleet, Tools,
};
use crate::loadgen::{imbalance, run_plan, LoadOptions, RequestRecord, RunOutput};
use crate::preset::{Kv, SimPreset};
use crate::provenance::Provenance;
use crate::stats::{goodput, percentile, SeedRequests, Slo};
use crate::variant::{Dispatch, Front as VariantFront, SimFeatures, Variant};
use crate::workload::{Shape, Workload};

/// Workers and ranks of the simulated fleets.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct FleetShape {
    /// Regular mode: workers; PD mode: prefill workers and decode workers.
    pub workers: usize,
    pub prefill: usize,
    pub decode: usize,
    pub dp_size: usize,
}

impl Default for FleetShape {
    fn default() -> Self {
        FleetShape {
            workers: 2,
            prefill: 2,
            decode: 2,
            dp_size: 4,
        }
    }
}

/// Everything that defines one run.
#[derive(Debug, Clone)]
pub struct Cell {
    /// Which suite the record belongs to (the results file holds several).
    pub suite: String,
    pub workload: Workload,
    pub variant: Variant,
    pub seed: u64,
    pub kv: Kv,
    /// The simulated model and its regime.
    pub preset: &'static SimPreset,
    /// Offered requests per simulated second.
    pub rate: f64,
    /// The offered load as a fraction of the measured capacity, when known.
    pub load: Option<f64>,
    /// Simulated seconds of arrivals before the measured window: the fleet
    /// fills up first, so the figures describe a loaded fleet, not an empty one.
    pub warmup_s: f64,
    /// Simulated seconds of arrivals that are measured (lengthened from
    /// the suite's window when that would hold too few requests).
    pub duration_s: f64,
    /// The suite's measured window before any lengthening.
    pub nominal_duration_s: f64,
    pub time_scale: f64,
    pub fleet: FleetShape,
    pub slo: Slo,
    /// What the offered load is a fraction of (method, rate), when known.
    pub capacity: Option<(String, f64)>,
    pub provenance: Provenance,
    /// Two priority classes, this share of the requests in the high one.
    pub high_share: Option<f64>,
}

/// The measured window for `rate`: `duration_s`, or longer when that holds
/// fewer than `min_requests` arrivals (whole seconds).
pub fn measured_window(rate: f64, duration_s: f64, min_requests: usize) -> f64 {
    if rate > 0.0 && rate * duration_s < min_requests as f64 {
        (min_requests as f64 / rate).ceil()
    } else {
        duration_s
    }
}

impl Cell {
    /// What identifies a finished run in the results file: the suite, then
    /// the run's settings (`settings_of` takes them back out).
    pub fn key(&self) -> String {
        format!(
            "{}|{}|{}|{}|{:.4}|{}|{}+{}|{}|{}|{}",
            self.suite,
            self.workload.name(),
            self.kv.name(),
            self.variant.name,
            self.rate,
            self.seed,
            self.warmup_s,
            self.duration_s,
            self.time_scale,
            self.preset.name,
            self.workload.cap.describe()
        ) + &self.high_share.map_or(String::new(), |h| format!("|high={h}"))
    }

    /// Where `--requests-out DIR` puts this cell's requests.
    pub fn requests_file(&self, dir: &Path) -> PathBuf {
        dir.join(format!(
            "{}-{}-{:.0}-{}-{}.jsonl",
            self.workload.name().replace(['/', ':'], "_"),
            self.kv.name(),
            self.load.unwrap_or(0.0) * 100.0,
            self.variant.name.replace(['/', ':', '"', ' ', '='], "_"),
            self.seed
        ))
    }

    /// The seed's plan, with its priority classes if the cell has them.
    pub fn plan(&self) -> Result<crate::workload::Plan, String> {
        let mut plan = self.workload.plan(&self.shape())?;
        if let Some(share) = self.high_share {
            plan.assign_classes(share, self.seed);
        }
        Ok(plan)
    }

    /// What the workload's plan is drawn with.
    pub fn shape(&self) -> Shape {
        Shape {
            rate: self.rate,
            duration_s: self.warmup_s + self.duration_s,
            seed: self.seed,
            max_prompt: self.preset.max_prompt(self.kv),
            max_output: self.preset.max_output,
        }
    }
}

/// The run's settings in a `Cell::key` (everything after the suite): two
/// suites' runs with equal settings are the same run.
pub fn settings_of(key: &str) -> &str {
    key.split_once('|').map_or(key, |(_, settings)| settings)
}

/// What one run measured; one JSON line in the results file.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct RunRecord {
    pub key: String,
    pub suite: String,
    pub workload: String,
    pub kv: String,
    pub load: Option<f64>,
    #[serde(deserialize_with = "crate::stats::nan_from_null")]
    pub rate: f64,
    #[serde(default)]
    pub warmup_s: f64,
    #[serde(deserialize_with = "crate::stats::nan_from_null")]
    pub duration_s: f64,
    #[serde(deserialize_with = "crate::stats::nan_from_null")]
    pub time_scale: f64,
    pub variant: String,
    pub seed: u64,
    pub fleet: String,
    pub freshness: String,
    /// `harness` (real processes) or `virtual` (the offline model).
    #[serde(default)]
    pub mode: Option<String>,
    /// The simulator preset (None: records made before presets: `legacy`).
    #[serde(default)]
    pub preset: Option<String>,
    /// Real trace or synthetic generator (`Workload::source`).
    #[serde(default)]
    pub source: Option<String>,
    /// What `max_tokens` the requests carried.
    #[serde(default)]
    pub output_cap: Option<String>,
    /// What the offered load is a fraction of: method and rate.
    #[serde(default)]
    pub capacity: Option<(String, f64)>,
    /// The suite's measured window when this run's was lengthened to hold
    /// enough requests.
    #[serde(default)]
    pub lengthened_from_s: Option<f64>,
    /// Facts about this run's plan a report must say.
    #[serde(default)]
    pub notes: Vec<String>,
    /// Requests sent during the warm-up (not in any figure).
    #[serde(default)]
    pub warmup_requests: usize,
    /// Requests sent in the measured window.
    pub sent: usize,
    pub ok: usize,
    pub errors: usize,
    pub abandoned: usize,
    /// Chat turns not sent: they would have started after the turn horizon.
    #[serde(default)]
    pub beyond_horizon: usize,
    pub error_examples: Vec<String>,
    /// Mean prompt and output tokens asked for (every sent request).
    #[serde(deserialize_with = "crate::stats::nan_from_null")]
    pub mean_input_tokens: f64,
    #[serde(deserialize_with = "crate::stats::nan_from_null")]
    pub mean_output_tokens: f64,
    /// Requests sent through each gateway.
    pub per_gateway: Vec<usize>,
    /// TTFT of every successful request, simulated ms, in send order.
    pub ttft_ms: Vec<f32>,
    #[serde(deserialize_with = "crate::stats::nan_from_null")]
    pub ttft_p50: f64,
    #[serde(deserialize_with = "crate::stats::nan_from_null")]
    pub ttft_p90: f64,
    #[serde(deserialize_with = "crate::stats::nan_from_null")]
    pub ttft_p99: f64,
    #[serde(deserialize_with = "crate::stats::nan_from_null")]
    pub tpot_p50: f64,
    #[serde(deserialize_with = "crate::stats::nan_from_null")]
    pub tpot_p99: f64,
    #[serde(deserialize_with = "crate::stats::nan_from_null")]
    pub itl_p50: f64,
    #[serde(deserialize_with = "crate::stats::nan_from_null")]
    pub itl_p99: f64,
    #[serde(deserialize_with = "crate::stats::nan_from_null")]
    pub e2e_p50: f64,
    #[serde(deserialize_with = "crate::stats::nan_from_null")]
    pub e2e_p99: f64,
    pub slo: Slo,
    #[serde(deserialize_with = "crate::stats::nan_from_null")]
    pub goodput: f64,
    #[serde(deserialize_with = "crate::stats::nan_from_null")]
    pub throughput_rps: f64,
    #[serde(deserialize_with = "crate::stats::nan_from_null")]
    pub output_tokens_per_s: f64,
    /// Cached / prompt tokens over the responses that report both.
    pub cache_hit: Option<f64>,
    /// Rank token imbalance (all ranks; decode ranks in PD mode).
    pub imbalance: Option<f64>,
    /// PD: prefill requests per rank, max / mean.
    pub prefill_spread: Option<f64>,
    pub served_per_rank: Vec<u64>,
    /// Load-endpoint requests per worker per simulated second (every router).
    #[serde(deserialize_with = "crate::stats::nan_from_null")]
    pub load_polls_per_worker_s: f64,
    pub cpu_busy: Option<f64>,
    /// Per process group and machine, harness runs only.
    #[serde(default)]
    pub cpu: Option<CpuUse>,
    /// Requests within the SLO among `sent`.
    #[serde(default)]
    pub good: Option<usize>,
    /// Overload protection: refusals, the classes, held requests (runs
    /// with classes or with a refusal).
    #[serde(default)]
    pub overload: Option<OverloadFigures>,
    #[serde(deserialize_with = "crate::stats::nan_from_null")]
    pub wall_s: f64,
    pub dprank_counters: Option<String>,
    pub started: String,
    /// Command, commit, date, machine.
    #[serde(default)]
    pub provenance: Option<Provenance>,
}

impl RunRecord {
    /// The run's measured requests for pooled figures: every TTFT, each
    /// failure as an infinite one.
    pub fn requests(&self) -> SeedRequests {
        let mut ttft: Vec<f64> = self.ttft_ms.iter().map(|v| f64::from(*v)).collect();
        ttft.extend(std::iter::repeat_n(f64::INFINITY, self.errors));
        SeedRequests {
            seed: self.seed,
            ttft_ms: ttft,
            good: self
                .good
                .map_or_else(|| (self.goodput * self.sent as f64).round(), |g| g as f64),
            sent: self.sent as f64,
        }
    }

    /// The preset's name (`legacy` for records made before presets).
    pub fn preset_name(&self) -> &str {
        self.preset.as_deref().unwrap_or("legacy")
    }
}

/// Why a cell did not run.
#[derive(Debug, Clone)]
pub struct Skipped(pub String);

/// The fleets of one run.
pub enum Fleets {
    Regular(SimFleet),
    Pd { prefill: SimFleet, decode: SimFleet },
}

impl Fleets {
    fn all(&self) -> Vec<&SimFleet> {
        match self {
            Fleets::Regular(f) => vec![f],
            Fleets::Pd { prefill, decode } => vec![prefill, decode],
        }
    }

    async fn load_polls(&self, client: &PooledClient) -> u64 {
        let mut total = 0;
        for f in self.all() {
            total += f.load_polls(client).await.iter().sum::<u64>();
        }
        total
    }

    fn worker_count(&self) -> usize {
        self.all().iter().map(|f| f.workers.len()).sum()
    }

    /// Every simulator process (their process groups).
    fn pids(&self) -> Vec<u32> {
        self.all().iter().map(|f| f.pid()).collect()
    }

    /// Tells every simulator process where each answer ends.
    async fn tell_answers(&self, client: &PooledClient, answers: &[(&str, u32)]) -> Result<(), String> {
        for f in self.all() {
            f.tell_answers(client, answers).await?;
        }
        Ok(())
    }
}

fn listen_args(count: usize, bootstrap: bool) -> Vec<String> {
    let mut out = Vec::new();
    for _ in 0..count {
        out.extend(["--listen".to_string(), "127.0.0.1:0".to_string()]);
        if bootstrap {
            out.extend(["--bootstrap-port".to_string(), "0".to_string()]);
        }
    }
    out
}

/// Starts the simulated fleet(s) of `cell`.
pub fn start_fleets(
    tools: &Tools,
    features: &SimFeatures,
    cell: &Cell,
    name: &str,
) -> Result<Fleets, String> {
    let vllm = cell.preset.vllm;
    let common = |dispatch: &str| -> Vec<String> {
        let mut args = vec![
            "--dp-size".to_string(),
            cell.fleet.dp_size.to_string(),
            "--time-scale".into(),
            cell.time_scale.to_string(),
            "--dispatch".into(),
            dispatch.to_string(),
            // Requests are not inspected after the run: keep no copies.
            "--record-limit".into(),
            "0".into(),
        ];
        args.extend(cell.preset.sim_args(cell.kv));
        if features.noise_seed {
            args.extend(SimPreset::noise_seed_args(cell.seed));
        }
        if features.cache_report {
            // The cache-hit column reads usage.prompt_tokens_details, which
            // SGLang reports only with this flag.
            args.push("--enable-cache-report".into());
        }
        args.extend(cell.variant.sim_args.iter().cloned());
        args
    };
    if cell.variant.is_pd() {
        let mut prefill_args = listen_args(cell.fleet.prefill, true);
        prefill_args.extend(common(features.dispatch_arg(Dispatch::RoomModulo, vllm)?));
        prefill_args.extend(["--role".into(), "prefill".into()]);
        let prefill = SimFleet::spawn(
            tools,
            &prefill_args,
            cell.fleet.prefill,
            &format!("{name}-prefill"),
        )?;
        let mut decode_args = listen_args(cell.fleet.decode, false);
        decode_args.extend(common(features.dispatch_arg(cell.variant.dispatch, vllm)?));
        decode_args.extend(["--role".into(), "decode".into()]);
        let decode = SimFleet::spawn(tools, &decode_args, cell.fleet.decode, &format!("{name}-decode"))?;
        Ok(Fleets::Pd { prefill, decode })
    } else {
        let mut args = listen_args(cell.fleet.workers, false);
        args.extend(common(features.dispatch_arg(cell.variant.dispatch, vllm)?));
        Ok(Fleets::Regular(SimFleet::spawn(
            tools,
            &args,
            cell.fleet.workers,
            &format!("{name}-sim"),
        )?))
    }
}

/// Starts the variant's gateways (one process each) in front of `fleets`.
pub async fn start_fronts(
    tools: &Tools,
    client: &PooledClient,
    variant: &Variant,
    fleets: &Fleets,
    time_scale: f64,
    name: &str,
) -> Result<Vec<Front>, String> {
    let mut fronts = Vec::new();
    for g in 0..variant.gateways {
        let name = if variant.gateways > 1 {
            format!("{name}-gw{}", g + 1)
        } else {
            name.to_string()
        };
        let front = match (&variant.front, fleets) {
            (VariantFront::Envoy(balancer), Fleets::Regular(fleet)) => {
                start_envoy(tools, client, fleet, balancer, &name, None).await?
            }
            (VariantFront::Dprank { poll, set }, Fleets::Regular(fleet)) => {
                let settings = DprankSettings {
                    poll_interval_ms: poll.wall_ms(time_scale),
                    set: set.clone(),
                    time_scale,
                };
                // With admission, Envoy's own clock on refusals and holds.
                let log = set
                    .contains_key("admission")
                    .then(|| tools.logs.join(format!("{name}-access.log")));
                start_envoy(
                    tools,
                    client,
                    fleet,
                    &Balancer::Dprank(settings),
                    &name,
                    log.as_deref(),
                )
                .await?
            }
            (VariantFront::DprankPd { poll, set }, Fleets::Pd { prefill, decode }) => {
                let settings = DprankSettings {
                    poll_interval_ms: poll.wall_ms(time_scale),
                    set: set.clone(),
                    time_scale,
                };
                start_envoy_pd(tools, client, prefill, decode, &settings, &name).await?
            }
            (VariantFront::Smg { .. } | VariantFront::SmgPd { .. }, _) => {
                let smg = tools.smg.as_ref().ok_or("smg is not installed")?;
                let (port, mut args) = smg_launch_args()?;
                args.extend(smg_variant_args(&variant.front, fleets));
                smg_front(tools, client, smg, &args, port, &name).await?
            }
            _ => return Err(format!("variant {} does not fit this fleet", variant.name)),
        };
        fronts.push(front);
    }
    Ok(fronts)
}

/// smg's flags for a variant: mode, workers, policies, interval.
pub fn smg_variant_args(front: &VariantFront, fleets: &Fleets) -> Vec<String> {
    let mut args: Vec<String> = Vec::new();
    let interval = |args: &mut Vec<String>, interval_s: &Option<u32>| {
        if let Some(s) = interval_s {
            args.extend(["--load-monitor-interval".into(), s.to_string()]);
        }
    };
    match (front, fleets) {
        (
            VariantFront::Smg {
                policy,
                interval_s,
                dp_aware,
                args: extra,
            },
            Fleets::Regular(fleet),
        ) => {
            args.extend(["--policy".into(), policy.clone()]);
            if *dp_aware {
                args.push("--dp-aware".into());
            }
            args.push("--worker-urls".into());
            args.extend(fleet.workers.iter().map(|w| format!("http://{w}")));
            interval(&mut args, interval_s);
            args.extend(extra.iter().cloned());
        }
        (
            VariantFront::SmgPd {
                prefill: prefill_policy,
                decode: decode_policy,
                minimum_tokens,
                interval_s,
                args: extra,
            },
            Fleets::Pd { prefill, decode },
        ) => {
            args.push("--pd-disaggregation".into());
            for (addr, bootstrap) in prefill.workers.iter().zip(&prefill.bootstrap) {
                args.extend(["--prefill".into(), format!("http://{addr}")]);
                args.push(bootstrap.map_or("none".to_string(), |p| p.to_string()));
            }
            for addr in &decode.workers {
                args.extend(["--decode".into(), format!("http://{addr}")]);
            }
            args.extend([
                "--policy".into(),
                prefill_policy.clone(),
                "--prefill-policy".into(),
                prefill_policy.clone(),
                "--decode-policy".into(),
                decode_policy.clone(),
            ]);
            // Never --dp-aware in PD mode: smg then polls no loads.
            if *minimum_tokens {
                args.push("--dp-minimum-tokens-scheduler".into());
            }
            interval(&mut args, interval_s);
            args.extend(extra.iter().cloned());
        }
        _ => {}
    }
    args
}

/// One finished run: its record and the load samples behind its imbalance.
pub struct CellRun {
    pub record: RunRecord,
    pub samples: Vec<crate::loadgen::LoadSample>,
    pub requests: Vec<crate::loadgen::RequestRecord>,
}

/// Runs one cell; `Err(Skipped)` when it cannot run here (smg missing, a
/// variant the simulator build does not support).
pub async fn run_cell(
    tools: &Tools,
    features: &SimFeatures,
    cell: &Cell,
    progress: bool,
) -> Result<Result<CellRun, Skipped>, String> {
    if cell.variant.uses_smg() && tools.smg.is_none() {
        return Ok(Err(Skipped(
            "smg is not installed (DPRANK_WITH_SMG=1 ./scripts/setup.sh installs it)".into(),
        )));
    }
    if let Err(reason) = features.dispatch_arg(cell.variant.dispatch, cell.preset.vllm) {
        return Ok(Err(Skipped(reason)));
    }
    if cell.variant.ie_detector {
        return Ok(Err(Skipped(
            "a model of the Inference Extension's saturation detector runs in virtual time only".into(),
        )));
    }
    if matches!(cell.variant.front, VariantFront::Gie { .. }) {
        return Ok(Err(Skipped(
            "the Inference Extension is modelled in virtual time only".into(),
        )));
    }
    features.check_preset(cell.preset)?;
    let plan = cell.plan()?;
    // A vLLM server has no /generate: those requests go to /v1/completions.
    let plan = if cell.preset.vllm { plan.to_openai() } else { plan };
    let started_at = crate::provenance::now_utc();
    let wall_start = Instant::now();
    let client = pooled_client();
    let name = format!(
        "{}-{}-{}-s{}",
        cell.suite,
        cell.workload.kind.name(),
        sanitize(&cell.variant.name),
        cell.seed
    );
    let fleets = start_fleets(tools, features, cell, &name)?;
    fleets.tell_answers(&client, &plan.answers()).await?;
    let fronts = start_fronts(tools, &client, &cell.variant, &fleets, cell.time_scale, &name).await?;
    let workers: Vec<_> = fleets
        .all()
        .iter()
        .flat_map(|f| f.workers.iter().copied())
        .collect();
    let prefill_served_before = match &fleets {
        Fleets::Pd { prefill, .. } => Some(prefill.served_per_rank(&client).await),
        Fleets::Regular(_) => None,
    };
    let served_before: Vec<u64> = match &fleets {
        Fleets::Regular(f) => f.served_per_rank(&client).await,
        Fleets::Pd { decode, .. } => decode.served_per_rank(&client).await,
    };
    let polls_before = fleets.load_polls(&client).await;
    let options = LoadOptions {
        gateways: fronts.iter().map(|f| f.url.clone()).collect(),
        spread: cell.variant.spread,
        workers,
        time_scale: cell.time_scale,
        sample_every: Duration::from_millis(100),
        request_timeout: Duration::from_secs(600),
        seed: cell.seed,
        progress,
        label: format!(
            "{} {} s{}",
            cell.workload.kind.name(),
            cell.variant.name,
            cell.seed
        ),
        cut_at_s: None,
        turn_horizon_s: Some(cell.warmup_s + cell.duration_s + crate::workload::chat::TAIL_S),
    };
    let cpu = CpuTimes::now();
    let meter = CpuMeter::start(fronts.iter().map(|f| f.pid()).collect(), fleets.pids());
    let run_start = Instant::now();
    let measured_from_unix = crate::provenance::unix_s() + cell.warmup_s / cell.time_scale.max(1e-9);
    let output = run_plan(&plan, &options).await?;
    let run_sim_s = run_start.elapsed().as_secs_f64() * cell.time_scale;
    let cpu_busy = CpuTimes::now().busy_since(&cpu);
    let cpu_use = meter.finish();
    // The load samplers' own polls are not a router's.
    let samples = output.samples.len() as u64 * fleets.worker_count() as u64;
    let polls = fleets
        .load_polls(&client)
        .await
        .saturating_sub(polls_before)
        .saturating_sub(samples);
    let served_after: Vec<u64> = match &fleets {
        Fleets::Regular(f) => f.served_per_rank(&client).await,
        Fleets::Pd { decode, .. } => decode.served_per_rank(&client).await,
    };
    let prefill_spread = match (&fleets, prefill_served_before) {
        (Fleets::Pd { prefill, .. }, Some(before)) => {
            served_spread(&before, &prefill.served_per_rank(&client).await)
        }
        _ => None,
    };
    let mut counters: Option<DprankCounters> = None;
    for admin in fronts.iter().filter_map(|f| f.admin) {
        if let Some(c) = dprank_counters(&client, admin).await {
            counters.get_or_insert_with(DprankCounters::default).add(&c);
        }
    }
    let logs: Vec<&Path> = fronts.iter().filter_map(|f| f.access_log.as_deref()).collect();
    let proxy = crate::access_log::collect(&logs, measured_from_unix).await?;
    drop(fronts);
    let ranks = match &fleets {
        Fleets::Regular(f) => 0..f.workers.len() * cell.fleet.dp_size,
        Fleets::Pd { prefill, decode } => {
            let p = prefill.workers.len() * cell.fleet.dp_size;
            p..p + decode.workers.len() * cell.fleet.dp_size
        }
    };
    let worker_count = fleets.worker_count();
    drop(fleets);
    let counters = counters.filter(|c| c.routed + c.passthrough + c.polls_ok > 0);
    let record = summarize(
        cell,
        &output,
        Summary {
            started: started_at,
            wall_s: wall_start.elapsed().as_secs_f64(),
            cpu_busy,
            served_per_rank: served_after
                .iter()
                .zip(served_before.iter().chain(std::iter::repeat(&0)))
                .map(|(a, b)| a.saturating_sub(*b))
                .collect(),
            load_polls_per_worker_s: polls as f64 / worker_count.max(1) as f64 / run_sim_s.max(1e-9),
            imbalance: imbalance(&output.samples, cell.warmup_s, output.arrival_window_s, ranks),
            prefill_spread,
            counters,
            cpu: Some(cpu_use),
            mode: "harness",
            notes: plan.notes.clone(),
        },
    );
    let record = RunRecord {
        overload: record.overload.map(|o| OverloadFigures { proxy, ..o }),
        ..record
    };
    Ok(Ok(CellRun {
        record,
        samples: output.samples,
        requests: output.records,
    }))
}

/// The parts of a record that come from the fleet, not the client.
pub struct Summary {
    pub started: String,
    pub wall_s: f64,
    pub cpu_busy: Option<f64>,
    pub served_per_rank: Vec<u64>,
    pub load_polls_per_worker_s: f64,
    pub imbalance: Option<f64>,
    pub prefill_spread: Option<f64>,
    pub counters: Option<DprankCounters>,
    pub cpu: Option<CpuUse>,
    /// `harness` or `virtual`.
    pub mode: &'static str,
    pub notes: Vec<String>,
}

/// Folds a run's request records into its summary record: only requests
/// sent after the warm-up count.
pub fn summarize(cell: &Cell, output: &RunOutput, fleet: Summary) -> RunRecord {
    let measured: Vec<_> = output
        .records
        .iter()
        .filter(|r| r.sent_s >= cell.warmup_s)
        .collect();
    let ok: Vec<_> = measured.iter().copied().filter(|r| r.ok()).collect();
    let errors: Vec<_> = measured.iter().copied().filter(|r| r.failed()).collect();
    let refused = measured.iter().filter(|r| r.rejected.is_some()).count();
    let ttft: Vec<f64> = ok.iter().filter_map(|r| r.ttft_ms).collect();
    let tpot: Vec<f64> = ok.iter().map(|r| r.tpot_ms).collect();
    let e2e: Vec<f64> = ok.iter().map(|r| r.e2e_ms).collect();
    let pairs: Vec<(f64, f64)> = ok.iter().filter_map(|r| Some((r.ttft_ms?, r.tpot_ms))).collect();
    let (cached, prompt) = ok
        .iter()
        .filter_map(|r| Some((r.cached_tokens?, r.prompt_tokens?)))
        .fold((0u64, 0u64), |(c, p), (rc, rp)| (c + rc, p + rp));
    let tokens: u64 = ok.iter().map(|r| u64::from(r.tokens)).sum();
    let span = (output.span_s - cell.warmup_s).max(1e-9);
    let gaps: Vec<f64> = ok
        .iter()
        .flat_map(|r| r.gaps_us.iter().map(|g| f64::from(*g) / 1000.0))
        .collect();
    let itl = |p: f64| percentile(&gaps, p);
    let good = pairs
        .iter()
        .filter(|(ttft, tpot)| *ttft <= cell.slo.ttft_ms && (tpot.is_nan() || *tpot <= cell.slo.tpot_ms))
        .count();
    RunRecord {
        key: cell.key(),
        suite: cell.suite.clone(),
        workload: cell.workload.name(),
        kv: cell.kv.name().into(),
        load: cell.load,
        rate: cell.rate,
        warmup_s: cell.warmup_s,
        duration_s: cell.duration_s,
        time_scale: cell.time_scale,
        variant: cell.variant.name.clone(),
        seed: cell.seed,
        fleet: if cell.variant.is_pd() {
            format!(
                "{} prefill + {} decode x {} ranks",
                cell.fleet.prefill, cell.fleet.decode, cell.fleet.dp_size
            )
        } else {
            format!("{} workers x {} ranks", cell.fleet.workers, cell.fleet.dp_size)
        },
        freshness: cell.variant.freshness(cell.time_scale),
        mode: Some(fleet.mode.to_string()),
        preset: Some(cell.preset.name.to_string()),
        source: Some(cell.workload.source()),
        output_cap: Some(cell.workload.cap.describe()),
        capacity: cell.capacity.clone(),
        lengthened_from_s: (cell.duration_s > cell.nominal_duration_s).then_some(cell.nominal_duration_s),
        notes: fleet.notes,
        warmup_requests: output.records.len() - measured.len(),
        sent: measured.len(),
        ok: ok.len(),
        errors: errors.len(),
        abandoned: output.abandoned,
        beyond_horizon: output.beyond_horizon,
        error_examples: errors.iter().filter_map(|r| r.error.clone()).take(3).collect(),
        mean_input_tokens: mean(measured.iter().map(|r| f64::from(r.input_tokens))),
        mean_output_tokens: mean(measured.iter().map(|r| f64::from(r.output_tokens))),
        per_gateway: (0..cell.variant.gateways)
            .map(|g| measured.iter().filter(|r| r.gateway == g).count())
            .collect(),
        ttft_ms: ttft
            .iter()
            .map(|v| ((v * 100.0).round() / 100.0) as f32)
            .collect(),
        ttft_p50: percentile(&ttft, 50.0),
        ttft_p90: percentile(&ttft, 90.0),
        ttft_p99: percentile(&ttft, 99.0),
        tpot_p50: percentile(&tpot, 50.0),
        tpot_p99: percentile(&tpot, 99.0),
        itl_p50: itl(50.0),
        itl_p99: itl(99.0),
        e2e_p50: percentile(&e2e, 50.0),
        e2e_p99: percentile(&e2e, 99.0),
        slo: cell.slo,
        goodput: goodput(&pairs, errors.len() + refused, &cell.slo),
        throughput_rps: ok.len() as f64 / span,
        output_tokens_per_s: tokens as f64 / span,
        cache_hit: (prompt > 0).then(|| cached as f64 / prompt as f64),
        imbalance: fleet.imbalance,
        prefill_spread: fleet.prefill_spread,
        served_per_rank: fleet.served_per_rank,
        load_polls_per_worker_s: fleet.load_polls_per_worker_s,
        cpu_busy: fleet.cpu_busy,
        cpu: fleet.cpu,
        good: Some(good),
        overload: OverloadFigures::of(&measured, &cell.slo, cell.high_share.is_some(), cell.time_scale),
        wall_s: fleet.wall_s,
        dprank_counters: fleet.counters.map(|c| c.summary()),
        started: fleet.started,
        provenance: Some(cell.provenance.clone()),
    }
}

/// What a run shows of overload protection.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct OverloadFigures {
    /// Requests refused by the gateway (429, 408, dprank's 503), by status.
    pub rejected: BTreeMap<u16, usize>,
    /// The high class: requests sent, and within the SLO.
    pub high_sent: usize,
    pub high_good: usize,
    /// The other class (or every request, without classes).
    pub low_sent: usize,
    pub low_good: usize,
    /// How long each refusal took as the client saw it, in wall ms (on the
    /// harness: the proxy's answer time; in virtual time the model's).
    pub rejection_wall_ms: Vec<f32>,
    /// How long each request the gateway held and sent on was held
    /// (simulated ms; virtual time only).
    pub held_ms: Vec<f32>,
    /// On the harness, what Envoy's access log measured (`access_log`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub proxy: Option<crate::access_log::ProxyTimes>,
}

impl OverloadFigures {
    /// Of the measured requests; None for a run without classes and
    /// without a refusal.
    fn of(measured: &[&RequestRecord], slo: &Slo, classes: bool, time_scale: f64) -> Option<OverloadFigures> {
        let refused = measured.iter().any(|r| r.rejected.is_some());
        if !classes && !refused {
            return None;
        }
        let good = |r: &RequestRecord| {
            r.ok()
                && r.ttft_ms.is_some_and(|t| t <= slo.ttft_ms)
                && (r.tpot_ms.is_nan() || r.tpot_ms <= slo.tpot_ms)
        };
        let mut f = OverloadFigures::default();
        for r in measured {
            if let Some(status) = r.rejected {
                *f.rejected.entry(status).or_default() += 1;
                f.rejection_wall_ms.push((r.e2e_ms / time_scale.max(1e-9)) as f32);
            }
            if let Some(held) = r.held_ms {
                f.held_ms.push(held as f32);
            }
            let (sent, good_count) = match r.high {
                Some(true) => (&mut f.high_sent, &mut f.high_good),
                _ => (&mut f.low_sent, &mut f.low_good),
            };
            *sent += 1;
            *good_count += usize::from(good(r));
        }
        Some(f)
    }
}

fn mean(values: impl Iterator<Item = f64>) -> f64 {
    let (sum, n) = values.fold((0.0, 0usize), |(s, n), v| (s + v, n + 1));
    if n == 0 {
        f64::NAN
    } else {
        sum / n as f64
    }
}

/// Max / mean of the per-rank differences `after - before`.
fn served_spread(before: &[u64], after: &[u64]) -> Option<f64> {
    if before.len() != after.len() || after.is_empty() {
        return None;
    }
    let counts: Vec<f64> = after
        .iter()
        .zip(before)
        .map(|(a, b)| a.saturating_sub(*b) as f64)
        .collect();
    let mean = counts.iter().sum::<f64>() / counts.len() as f64;
    let max = counts.iter().copied().fold(0.0, f64::max);
    (mean > 0.0).then(|| max / mean)
}

/// A variant spec as a file-name part.
fn sanitize(name: &str) -> String {
    name.chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '-' {
                c
            } else {
                '_'
            }
        })
        .collect()
}

/// The JSONL file records go to, and its packed copy beside it
/// (`runs.jsonl.gz`, what `pack` makes of it for the repository): loading
/// reads the packed records first, then the plain ones; new runs are
/// appended to the plain file.
pub struct ResultsFile {
    pub path: PathBuf,
}

impl ResultsFile {
    pub fn new(path: &Path) -> ResultsFile {
        ResultsFile {
            path: path.to_path_buf(),
        }
    }

    /// The packed copy: the path with `.gz` added.
    pub fn packed_path(&self) -> PathBuf {
        let mut name = self.path.clone().into_os_string();
        name.push(".gz");
        PathBuf::from(name)
    }

    /// The text of both files, packed first (empty where neither exists).
    fn text(&self) -> Result<String, String> {
        let mut text = String::new();
        let packed = self.packed_path();
        match std::fs::File::open(&packed) {
            Ok(file) => {
                std::io::Read::read_to_string(&mut flate2::read::GzDecoder::new(file), &mut text)
                    .map_err(|e| format!("cannot read {}: {e}", packed.display()))?;
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(format!("cannot read {}: {e}", packed.display())),
        }
        match std::fs::read_to_string(&self.path) {
            Ok(plain) => text.push_str(&plain),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(format!("cannot read {}: {e}", self.path.display())),
        }
        Ok(text)
    }

    /// Every record in the files (none if neither exists); lines that do
    /// not parse are reported and skipped.
    pub fn load(&self) -> Result<Vec<RunRecord>, String> {
        let text = self.text()?;
        let mut out = Vec::new();
        for (i, line) in text.lines().enumerate() {
            if line.trim().is_empty() {
                continue;
            }
            match serde_json::from_str::<RunRecord>(line) {
                Ok(record) => out.push(record),
                Err(e) => eprintln!(
                    "{}:{}: skipped, not a run record: {e}",
                    self.path.display(),
                    i + 1
                ),
            }
        }
        Ok(out)
    }

    /// Folds the plain file into the packed one and removes it; the
    /// records and their order are unchanged. Returns the packed path.
    pub fn pack(&self) -> Result<PathBuf, String> {
        let text = self.text()?;
        let packed = self.packed_path();
        let partial = packed.with_extension("gz.partial");
        let write = || -> std::io::Result<()> {
            let file = std::fs::File::create(&partial)?;
            let mut encoder = flate2::write::GzEncoder::new(file, flate2::Compression::best());
            encoder.write_all(text.as_bytes())?;
            encoder.finish()?.sync_all()?;
            std::fs::rename(&partial, &packed)
        };
        write().map_err(|e| format!("cannot write {}: {e}", packed.display()))?;
        match std::fs::remove_file(&self.path) {
            Ok(()) => Ok(packed),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(packed),
            Err(e) => Err(format!("cannot remove {}: {e}", self.path.display())),
        }
    }

    pub fn append(&self, record: &RunRecord) -> Result<(), String> {
        if let Some(dir) = self.path.parent() {
            std::fs::create_dir_all(dir).map_err(|e| format!("cannot create {}: {e}", dir.display()))?;
        }
        let mut line = serde_json::to_string(record).map_err(|e| format!("cannot encode a record: {e}"))?;
        line.push('\n');
        OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.path)
            .and_then(|mut f| f.write_all(line.as_bytes()))
            .map_err(|e| format!("cannot append to {}: {e}", self.path.display()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::loadgen::RequestRecord;
    use crate::workload::WorkloadKind;

    fn cell() -> Cell {
        Cell {
            suite: "t".into(),
            workload: Workload::new(WorkloadKind::NoPrefix),
            variant: Variant::parse("dprank").unwrap(),
            seed: 3,
            kv: Kv::Small,
            preset: crate::preset::preset("legacy").unwrap(),
            rate: 10.0,
            load: Some(0.85),
            warmup_s: 0.0,
            duration_s: 30.0,
            nominal_duration_s: 30.0,
            time_scale: 5.0,
            fleet: FleetShape::default(),
            slo: Slo {
                ttft_ms: 1000.0,
                tpot_ms: 60.0,
            },
            capacity: None,
            provenance: Provenance::default(),
            high_share: None,
        }
    }

    fn request(ttft: Option<f64>, tpot: f64, error: Option<&str>) -> RequestRecord {
        RequestRecord {
            sent_s: 0.0,
            end_s: 10.0,
            gateway: 0,
            input_tokens: 100,
            output_tokens: 10,
            ttft_ms: ttft,
            tpot_ms: tpot,
            e2e_ms: 500.0,
            tokens: 10,
            prompt_tokens: Some(100),
            cached_tokens: Some(25),
            error: error.map(str::to_string),
            session: None,
            gaps_us: vec![30_000],
            high: None,
            rejected: None,
            held_ms: None,
        }
    }

    fn fleet() -> Summary {
        Summary {
            started: "now".into(),
            wall_s: 1.0,
            cpu_busy: None,
            served_per_rank: vec![],
            load_polls_per_worker_s: 1.0,
            imbalance: None,
            prefill_spread: None,
            counters: None,
            cpu: None,
            mode: "harness",
            notes: Vec::new(),
        }
    }

    #[test]
    fn packed_records_load_before_plain_ones_and_packing_keeps_them_all() {
        let dir = std::env::temp_dir().join(format!("dprank-pack-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let file = ResultsFile::new(&dir.join("runs.jsonl"));
        let output = RunOutput {
            records: vec![request(Some(100.0), 30.0, None)],
            abandoned: 0,
            beyond_horizon: 0,
            samples: Vec::new(),
            arrival_window_s: 5.0,
            span_s: 10.0,
        };
        let mut a = summarize(&cell(), &output, fleet());
        a.seed = 1;
        let mut b = a.clone();
        b.seed = 2;
        file.append(&a).unwrap();
        file.pack().unwrap();
        assert!(!file.path.exists() && file.packed_path().exists());
        file.append(&b).unwrap();
        let seeds = |f: &ResultsFile| f.load().unwrap().iter().map(|r| r.seed).collect::<Vec<_>>();
        assert_eq!(seeds(&file), [1, 2]);
        file.pack().unwrap();
        assert_eq!(seeds(&file), [1, 2]);
        assert!(!file.path.exists());
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn summary_counts_goodput_errors_and_cache_hits() {
        let output = RunOutput {
            records: vec![
                request(Some(100.0), 30.0, None),
                request(Some(2000.0), 30.0, None),
                request(Some(100.0), 90.0, None),
                request(None, f64::NAN, Some("HTTP 500")),
            ],
            abandoned: 0,
            beyond_horizon: 0,
            samples: Vec::new(),
            arrival_window_s: 5.0,
            span_s: 10.0,
        };
        let r = summarize(&cell(), &output, fleet());
        assert_eq!((r.sent, r.ok, r.errors), (4, 3, 1));
        assert_eq!(r.goodput, 0.25);
        assert_eq!(r.cache_hit, Some(0.25));
        assert_eq!(r.ttft_p99, 2000.0);
        assert_eq!(r.throughput_rps, 0.3);
        assert_eq!(r.error_examples, vec!["HTTP 500"]);
        assert!(r.freshness.contains("200 ms wall"));
    }

    #[test]
    fn warm_up_requests_are_sent_but_not_counted() {
        let mut early = request(Some(5000.0), 30.0, None);
        early.sent_s = 1.0;
        let mut late = request(Some(100.0), 30.0, None);
        late.sent_s = 12.0;
        let output = RunOutput {
            records: vec![early, late],
            abandoned: 0,
            beyond_horizon: 0,
            samples: Vec::new(),
            arrival_window_s: 20.0,
            span_s: 20.0,
        };
        let cell = Cell {
            warmup_s: 10.0,
            ..cell()
        };
        let r = summarize(&cell, &output, fleet());
        assert_eq!((r.sent, r.warmup_requests, r.ttft_p99), (1, 1, 100.0));
        assert_eq!(r.throughput_rps, 0.1);
        assert_eq!(r.itl_p50, 30.0);
    }

    #[test]
    fn records_round_trip_through_the_results_file() {
        let dir = std::env::temp_dir().join(format!("dprank-results-{}", std::process::id()));
        let file = ResultsFile::new(&dir.join("runs.jsonl"));
        assert!(file.load().unwrap().is_empty());
        let output = RunOutput {
            records: vec![request(Some(10.0), 5.0, None)],
            abandoned: 0,
            beyond_horizon: 0,
            samples: Vec::new(),
            arrival_window_s: 1.0,
            span_s: 1.0,
        };
        let fleet = Summary {
            cpu_busy: Some(0.5),
            served_per_rank: vec![1, 2],
            load_polls_per_worker_s: 0.0,
            imbalance: Some(1.2),
            ..fleet()
        };
        let record = summarize(&cell(), &output, fleet);
        file.append(&record).unwrap();
        file.append(&record).unwrap();
        std::fs::write(
            &file.path,
            std::fs::read_to_string(&file.path).unwrap() + "garbage\n",
        )
        .unwrap();
        let loaded = file.load().unwrap();
        assert_eq!(loaded.len(), 2);
        assert_eq!(loaded[0].imbalance, Some(1.2));
        assert!(file.load().unwrap().iter().any(|r| r.key == cell().key()));
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn served_spread_is_max_over_mean() {
        assert_eq!(served_spread(&[0, 0], &[3, 1]), Some(1.5));
        assert_eq!(served_spread(&[0], &[0]), None);
        assert_eq!(served_spread(&[0], &[1, 2]), None);
    }

    #[test]
    fn short_windows_are_lengthened_to_hold_enough_requests() {
        assert_eq!(measured_window(10.0, 300.0, 1000), 300.0);
        assert_eq!(measured_window(2.0, 300.0, 1000), 500.0);
        assert_eq!(measured_window(3.0, 300.0, 1000), 334.0);
    }

    #[test]
    fn pooled_requests_count_failures_as_infinite() {
        let output = RunOutput {
            records: vec![
                request(Some(100.0), 30.0, None),
                request(None, f64::NAN, Some("HTTP 500")),
            ],
            abandoned: 0,
            beyond_horizon: 0,
            samples: Vec::new(),
            arrival_window_s: 5.0,
            span_s: 10.0,
        };
        let fleet = Summary {
            mode: "virtual",
            notes: vec!["a note".into()],
            ..fleet()
        };
        let r = summarize(&cell(), &output, fleet);
        let requests = r.requests();
        assert_eq!(requests.ttft_ms, vec![100.0, f64::INFINITY]);
        assert_eq!((requests.good, requests.sent), (1.0, 2.0));
        assert_eq!(r.mode.as_deref(), Some("virtual"));
        assert_eq!(r.notes, vec!["a note"]);
        assert_eq!(r.preset_name(), "legacy");
    }
}
