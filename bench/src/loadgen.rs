//! Runs a plan against one or more gateways: open-loop requests at their
//! times, closed-loop sessions turn by turn, every request streamed and timed;
//! meanwhile the workers' `/v1/loads` are sampled for the per-rank picture.
//!
//! Several gateways stand for replicas behind an L4 balancer: each open-loop
//! request lands on a gateway drawn from (seed, request), or under
//! [`Spread::Tenant`] from (seed, tenant), and each session keeps one gateway
//! for all its turns (its connection), so the spread is random but the same
//! for every variant run on the same seed.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use indicatif::{ProgressBar, ProgressStyle};
use tokio::sync::watch;
use tokio::task::JoinSet;

use crate::client::{get_text, pooled_client, stream_request, PooledClient, StreamKind, StreamOutcome};
use crate::workload::{bodies, text, Api, Plan, Session, HIGH_CLASS, LOW_CLASS};

/// How the L4 balancer in front of several gateways spreads open-loop
/// requests.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Spread {
    /// Each request on its own draw: clients with many connections, or a
    /// balancer that spreads connections without regard to who opened them.
    Request,
    /// All requests of one tenant on one gateway: each tenant a client whose
    /// connections a balancer with source-address affinity (consistent
    /// hashing on the client address) keeps on one replica. Requests of no
    /// tenant are drawn one by one.
    Tenant,
}

#[derive(Debug, Clone)]
pub struct LoadOptions {
    /// Gateway base URLs (`http://host:port`).
    pub gateways: Vec<String>,
    pub spread: Spread,
    /// Workers whose `/v1/loads` are sampled (may be empty).
    pub workers: Vec<SocketAddr>,
    /// Plan times are simulated seconds; wall time = simulated / time_scale.
    pub time_scale: f64,
    pub sample_every: Duration,
    /// Per-request limit (wall); a request still running then is an error.
    pub request_timeout: Duration,
    /// Spreads requests over gateways.
    pub seed: u64,
    pub progress: bool,
    pub label: String,
    /// Stop at this simulated time and abandon what is still running
    /// (capacity runs); None runs the whole plan.
    pub cut_at_s: Option<f64>,
    /// Session turns that would start after this simulated time are not
    /// sent (closed-loop sessions otherwise trail on at a falling load).
    pub turn_horizon_s: Option<f64>,
}

/// Per-rank state of every rank of every worker (in worker order), at `t_s`
/// simulated seconds after the start.
#[derive(Debug, Clone)]
pub struct LoadSample {
    pub t_s: f64,
    /// `num_total_tokens`, else `num_tokens`, else `num_used_tokens`.
    pub tokens: Vec<u64>,
    pub waiting: Vec<u64>,
    /// `cache_hit_rate` when the worker reports it (NaN otherwise).
    pub cache_hit_rate: Vec<f64>,
}

/// What happened to one request.
#[derive(Debug, Clone)]
pub struct RequestRecord {
    /// When it was sent, simulated seconds after the start.
    pub sent_s: f64,
    /// When it finished (or failed), simulated seconds after the start.
    pub end_s: f64,
    pub gateway: usize,
    pub input_tokens: u32,
    pub output_tokens: u32,
    /// Simulated ms; None when no token arrived.
    pub ttft_ms: Option<f64>,
    /// Mean gap between tokens after the first, simulated ms (NaN for < 2 tokens).
    pub tpot_ms: f64,
    pub e2e_ms: f64,
    pub tokens: u32,
    pub prompt_tokens: Option<u64>,
    pub cached_tokens: Option<u64>,
    pub error: Option<String>,
    /// Chat sessions: (session id, turn index).
    pub session: Option<(u32, u32)>,
    /// Gaps between token events after the first, simulated us.
    pub gaps_us: Vec<u32>,
    /// Its priority class, when the run has two: true for the high one.
    pub high: Option<bool>,
    /// Refused by the gateway's overload protection, with this status.
    pub rejected: Option<u16>,
    /// How long the gateway held it before sending it on (virtual time,
    /// dprank's queue; simulated ms).
    pub held_ms: Option<f64>,
}

impl RequestRecord {
    pub fn ok(&self) -> bool {
        self.error.is_none() && self.rejected.is_none() && self.ttft_ms.is_some()
    }

    /// Neither served nor refused: a failure.
    pub fn failed(&self) -> bool {
        !self.ok() && self.rejected.is_none()
    }

    /// What `--requests-out` writes of it, one JSON object per request.
    pub fn to_json(&self) -> serde_json::Value {
        serde_json::json!({
            "sent_s": self.sent_s, "gateway": self.gateway, "ttft_ms": self.ttft_ms,
            "tpot_ms": self.tpot_ms, "end_s": self.end_s, "prompt": self.prompt_tokens,
            "cached": self.cached_tokens, "output": self.tokens, "session": self.session,
            "high": self.high, "rejected": self.rejected, "held_ms": self.held_ms,
            "error": self.error,
        })
    }
}

/// Writes `--requests-out`'s file: one JSON object a line (harness and
/// virtual-time runs alike).
pub fn write_requests(path: &std::path::Path, lines: &[serde_json::Value]) -> Result<(), String> {
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir).map_err(|e| format!("cannot create {}: {e}", dir.display()))?;
    }
    let text: String = lines.iter().map(|line| line.to_string() + "\n").collect();
    std::fs::write(path, text).map_err(|e| format!("cannot write {}: {e}", path.display()))
}

/// Everything a run measured.
#[derive(Debug)]
pub struct RunOutput {
    pub records: Vec<RequestRecord>,
    /// Session turns never sent because an earlier turn failed.
    pub abandoned: usize,
    /// Session turns not sent because they fell after the turn horizon.
    pub beyond_horizon: usize,
    pub samples: Vec<LoadSample>,
    /// Simulated seconds from the start to the last arrival (open loop) or
    /// session start.
    pub arrival_window_s: f64,
    /// Simulated seconds from the start to the last completion.
    pub span_s: f64,
}

/// Parses `/v1/loads` (or the `/get_load` array) into per-rank figures,
/// ordered by rank.
pub fn parse_loads(text: &str) -> Option<Vec<(u64, u64, f64)>> {
    let value: serde_json::Value = serde_json::from_str(text).ok()?;
    let loads = match &value {
        serde_json::Value::Array(items) => items.clone(),
        serde_json::Value::Object(map) => map.get("loads")?.as_array()?.clone(),
        _ => return None,
    };
    let mut ranks: Vec<(u64, (u64, u64, f64))> = loads
        .iter()
        .filter_map(|l| {
            let rank = l.get("dp_rank")?.as_u64()?;
            let tokens = ["num_total_tokens", "num_tokens", "num_used_tokens"]
                .iter()
                .find_map(|k| l.get(*k).and_then(|v| v.as_u64()))?;
            let waiting = l.get("num_waiting_reqs").and_then(|v| v.as_u64()).unwrap_or(0);
            let hit = l
                .get("cache_hit_rate")
                .and_then(|v| v.as_f64())
                .unwrap_or(f64::NAN);
            Some((rank, (tokens, waiting, hit)))
        })
        .collect();
    ranks.sort_by_key(|(rank, _)| *rank);
    Some(ranks.into_iter().map(|(_, v)| v).collect())
}

/// max/mean of one sample's tokens; None when the fleet is (nearly) empty.
pub fn sample_imbalance(tokens: &[u64]) -> Option<f64> {
    let max = *tokens.iter().max()? as f64;
    let mean = tokens.iter().sum::<u64>() as f64 / tokens.len() as f64;
    (mean >= 1.0).then(|| max / mean)
}

/// Time average over samples taken in [from_s, to_s] of max/mean tokens
/// over the ranks in `ranks`.
pub fn imbalance(
    samples: &[LoadSample],
    from_s: f64,
    to_s: f64,
    ranks: std::ops::Range<usize>,
) -> Option<f64> {
    let ratios: Vec<f64> = samples
        .iter()
        .filter(|s| s.t_s >= from_s && s.t_s <= to_s)
        .filter_map(|s| s.tokens.get(ranks.clone()).and_then(sample_imbalance))
        .collect();
    (!ratios.is_empty()).then(|| ratios.iter().sum::<f64>() / ratios.len() as f64)
}

async fn sample_loads(
    client: PooledClient,
    workers: Vec<SocketAddr>,
    every: Duration,
    time_scale: f64,
    start: Instant,
    mut stop: watch::Receiver<bool>,
) -> Vec<LoadSample> {
    let mut samples = Vec::new();
    let mut vllm = vec![false; workers.len()];
    let mut tick = tokio::time::interval(every);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
    loop {
        tokio::select! {
            _ = tick.tick() => {}
            _ = stop.changed() => break,
        }
        let t_s = start.elapsed().as_secs_f64() * time_scale;
        let mut sample = LoadSample {
            t_s,
            tokens: Vec::new(),
            waiting: Vec::new(),
            cache_hit_rate: Vec::new(),
        };
        let mut complete = true;
        for (index, worker) in workers.iter().enumerate() {
            let ranks = if vllm[index] {
                sample_metrics(&client, worker).await
            } else {
                let uri = format!("http://{worker}/v1/loads?include=core");
                match get_text(&client, &uri).await {
                    Ok(text) => parse_loads(&text),
                    // A vLLM server: its engines' figures are on /metrics.
                    Err(e) if e.ends_with("HTTP 404") => {
                        vllm[index] = true;
                        sample_metrics(&client, worker).await
                    }
                    Err(_) => None,
                }
            };
            match ranks {
                Some(ranks) => {
                    for (tokens, waiting, hit) in ranks {
                        sample.tokens.push(tokens);
                        sample.waiting.push(waiting);
                        sample.cache_hit_rate.push(hit);
                    }
                }
                None => complete = false,
            }
        }
        if complete && !sample.tokens.is_empty() {
            samples.push(sample);
        }
    }
    samples
}

/// A vLLM server's engines as a sample has them, read from `/metrics` with
/// dprank's own reader: KV usage in millionths stands for the tokens (the
/// imbalance is a ratio), waiting requests as they are, the hit rate over
/// the whole run from the prefix-cache counters.
async fn sample_metrics(client: &PooledClient, worker: &SocketAddr) -> Option<Vec<(u64, u64, f64)>> {
    let text = get_text(client, &format!("http://{worker}/metrics")).await.ok()?;
    let report = dprank::load::vllm::parse_vllm_metrics(text.as_bytes(), None).ok()?;
    Some(
        report
            .engines
            .iter()
            .map(|engine| {
                let kv = (engine.kv_usage.unwrap_or(0.0) * 1e6).round() as u64;
                let hit = match (engine.prefix_hits, engine.prefix_queries) {
                    (Some(hits), Some(queries)) if queries > 0 => hits as f64 / queries as f64,
                    _ => f64::NAN,
                };
                (kv, engine.waiting.unwrap_or(0), hit)
            })
            .collect(),
    )
}

/// Which of `n` gateways gets `key` (a request index, a session id or a
/// tenant: see [`spread_key`]).
pub fn gateway_for(seed: u64, key: u64, n: usize) -> usize {
    (text::seed_of(&[0x6a7e, seed, key]) % n.max(1) as u64) as usize
}

/// The key a session is spread by (one gateway for all its turns).
pub fn session_key(id: u32) -> u64 {
    1 << 40 | u64::from(id)
}

/// The key an open-loop request is spread by.
pub fn spread_key(spread: Spread, index: usize, tenant: Option<u32>) -> u64 {
    match (spread, tenant) {
        (Spread::Tenant, Some(t)) => 1 << 41 | u64::from(t),
        _ => index as u64,
    }
}

/// Shared by every task of one run.
struct Context {
    client: PooledClient,
    gateways: Vec<String>,
    start: Instant,
    time_scale: f64,
    timeout: Duration,
    turn_horizon_s: Option<f64>,
}

impl Context {
    fn sim_s(&self, at: Instant) -> f64 {
        at.saturating_duration_since(self.start).as_secs_f64() * self.time_scale
    }

    fn wall(&self, sim_s: f64) -> Instant {
        self.start + Duration::from_secs_f64(sim_s.max(0.0) / self.time_scale)
    }

    async fn send(
        &self,
        gateway: usize,
        api: Api,
        body: bytes::Bytes,
        keep_text: bool,
        high: Option<bool>,
    ) -> StreamOutcome {
        let uri = format!("{}{}", self.gateways[gateway].trim_end_matches('/'), api.path());
        let priority = high.map(|h| if h { HIGH_CLASS } else { LOW_CLASS });
        let kind = StreamKind {
            api,
            keep_text,
            priority,
        };
        match tokio::time::timeout(self.timeout, stream_request(&self.client, &uri, body, kind)).await {
            Ok(outcome) => outcome,
            Err(_) => StreamOutcome {
                error: Some(format!("no complete response within {:?}", self.timeout)),
                e2e: self.timeout,
                ..StreamOutcome::default()
            },
        }
    }

    fn record(
        &self,
        outcome: &StreamOutcome,
        sent: Instant,
        gateway: usize,
        meta: (u32, u32),
    ) -> RequestRecord {
        let to_ms = |d: Duration| d.as_secs_f64() * 1000.0 * self.time_scale;
        let tpot_ms = if outcome.tokens >= 2 {
            let gaps: Duration = outcome.itls.iter().sum();
            to_ms(gaps) / f64::from(outcome.tokens - 1)
        } else {
            f64::NAN
        };
        RequestRecord {
            sent_s: self.sim_s(sent),
            end_s: self.sim_s(sent + outcome.e2e),
            gateway,
            input_tokens: meta.0,
            output_tokens: meta.1,
            ttft_ms: outcome.ttft.map(to_ms),
            tpot_ms,
            e2e_ms: to_ms(outcome.e2e),
            tokens: outcome.tokens,
            prompt_tokens: outcome.prompt_tokens,
            cached_tokens: outcome.cached_tokens,
            error: outcome.error.clone(),
            session: None,
            high: None,
            rejected: outcome.rejected,
            held_ms: None,
            gaps_us: if outcome.error.is_some() {
                Vec::new()
            } else {
                outcome
                    .itls
                    .iter()
                    .map(|g| (g.as_secs_f64() * 1e6 * self.time_scale).min(f64::from(u32::MAX)) as u32)
                    .collect()
            },
        }
    }
}

/// What a finished task hands back: records and turns it did not send.
type TaskResult = (Vec<RequestRecord>, Skip);

/// Session turns a task did not send, and why.
#[derive(Debug, Clone, Copy)]
enum Skip {
    None,
    /// An earlier turn failed.
    Failed(usize),
    /// Past the turn horizon.
    Horizon(usize),
}

async fn run_session(ctx: Arc<Context>, session: Session, gateway: usize) -> TaskResult {
    let mut records = Vec::new();
    let mut history: Vec<(String, String)> = Vec::new();
    let mut ready_at = ctx.wall(session.start_s);
    for (i, turn) in session.turns.iter().enumerate() {
        ready_at += Duration::from_secs_f64(turn.think_s / ctx.time_scale);
        if ctx.turn_horizon_s.is_some_and(|h| ctx.sim_s(ready_at) > h) {
            let left = session.turns.len() - i;
            return (records, Skip::Horizon(left));
        }
        tokio::time::sleep_until(ready_at.into()).await;
        let mut messages: Vec<(&str, &str)> = vec![("system", &session.system)];
        for (user, answer) in &history {
            messages.push(("user", user));
            messages.push(("assistant", answer));
        }
        messages.push(("user", &turn.user));
        let input_tokens = text::chat_tokens(&messages) as u32;
        let body = bodies::chat(&messages, turn.max_tokens);
        let sent = Instant::now();
        let outcome = ctx.send(gateway, Api::Chat, body, true, None).await;
        let mut record = ctx.record(&outcome, sent, gateway, (input_tokens, turn.output_tokens));
        record.session = Some((session.id, i as u32));
        records.push(record);
        if outcome.error.is_some() {
            let skipped = session.turns.len() - i - 1;
            return (records, Skip::Failed(skipped));
        }
        history.push((turn.user.clone(), outcome.text));
        ready_at = Instant::now();
    }
    (records, Skip::None)
}

/// Runs `plan` and measures it.
pub async fn run_plan(plan: &Plan, options: &LoadOptions) -> Result<RunOutput, String> {
    if options.gateways.is_empty() {
        return Err("no gateway to send to".into());
    }
    if !(options.time_scale.is_finite() && options.time_scale > 0.0) {
        return Err(format!("time scale must be positive, got {}", options.time_scale));
    }
    let client = pooled_client();
    let progress = if options.progress {
        let bar = ProgressBar::new(plan.request_count() as u64);
        if let Ok(style) =
            ProgressStyle::with_template("{msg:>28} [{elapsed_precise}] {wide_bar} {pos}/{len}")
        {
            bar.set_style(style);
        }
        bar.set_message(options.label.clone());
        bar
    } else {
        ProgressBar::hidden()
    };
    let start = Instant::now();
    let ctx = Arc::new(Context {
        client: client.clone(),
        gateways: options.gateways.clone(),
        start,
        time_scale: options.time_scale,
        timeout: options.request_timeout,
        turn_horizon_s: options.turn_horizon_s,
    });
    let (stop_tx, stop_rx) = watch::channel(false);
    let sampler = tokio::spawn(sample_loads(
        client,
        options.workers.clone(),
        options.sample_every,
        options.time_scale,
        start,
        stop_rx,
    ));

    let n = options.gateways.len();
    let mut tasks: JoinSet<TaskResult> = JoinSet::new();
    for session in plan.sessions.iter().cloned() {
        let ctx = ctx.clone();
        let gateway = gateway_for(options.seed, session_key(session.id), n);
        tasks.spawn(run_session(ctx, session, gateway));
    }
    let mut results: Vec<TaskResult> = Vec::new();
    let cut = options.cut_at_s;
    for (i, request) in plan.requests.iter().enumerate() {
        if cut.is_some_and(|c| request.at_s >= c) {
            break;
        }
        tokio::time::sleep_until(ctx.wall(request.at_s).into()).await;
        let ctx = ctx.clone();
        let request = request.clone();
        let gateway = gateway_for(options.seed, spread_key(options.spread, i, request.tenant), n);
        tasks.spawn(async move {
            let sent = Instant::now();
            let outcome = ctx
                .send(gateway, request.api, request.body, false, request.high)
                .await;
            let meta = (request.input_tokens, request.output_tokens);
            let mut record = ctx.record(&outcome, sent, gateway, meta);
            record.high = request.high;
            (vec![record], Skip::None)
        });
        while let Some(done) = tasks.try_join_next() {
            collect(done, &progress, &mut results);
        }
    }
    let last_arrival = plan.last_arrival_s();
    match cut {
        Some(cut_s) => {
            let deadline = ctx.wall(cut_s);
            loop {
                tokio::select! {
                    done = tasks.join_next() => match done {
                        Some(done) => collect(done, &progress, &mut results),
                        None => break,
                    },
                    _ = tokio::time::sleep_until(deadline.into()) => {
                        tasks.abort_all();
                        break;
                    }
                }
            }
        }
        // Every answer is read to its end, as virtual time does.
        None => {
            while let Some(done) = tasks.join_next().await {
                collect(done, &progress, &mut results);
            }
        }
    }
    let _ = stop_tx.send(true);
    let samples = sampler.await.unwrap_or_default();
    progress.finish_and_clear();

    let mut records = Vec::new();
    let (mut abandoned, mut beyond_horizon) = (0, 0);
    for (task_records, skipped) in results {
        records.extend(task_records);
        match skipped {
            Skip::None => {}
            Skip::Failed(n) => abandoned += n,
            Skip::Horizon(n) => beyond_horizon += n,
        }
    }
    records.sort_by(|a, b| a.sent_s.total_cmp(&b.sent_s));
    let span_s = records.iter().map(|r| r.end_s).fold(0.0, f64::max);
    Ok(RunOutput {
        records,
        abandoned,
        beyond_horizon,
        samples,
        arrival_window_s: cut.map_or(last_arrival, |c| c.min(last_arrival)),
        span_s,
    })
}

fn collect(
    done: Result<TaskResult, tokio::task::JoinError>,
    progress: &ProgressBar,
    results: &mut Vec<TaskResult>,
) {
    if let Ok(result) = done {
        progress.inc(result.0.len() as u64);
        results.push(result);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn loads_from_both_shapes_with_optional_fields() {
        let v1 = r#"{"loads":[{"dp_rank":1,"num_used_tokens":5,"num_total_tokens":9,"num_waiting_reqs":2,"cache_hit_rate":0.5},{"dp_rank":0,"num_used_tokens":3}]}"#;
        let parsed = parse_loads(v1).unwrap();
        assert_eq!((parsed[0].0, parsed[0].1), (3, 0));
        assert!(parsed[0].2.is_nan());
        assert_eq!(parsed[1], (9, 2, 0.5));
        let legacy = r#"[{"dp_rank":0,"num_tokens":4},{"dp_rank":1,"num_tokens":6}]"#;
        let tokens: Vec<u64> = parse_loads(legacy).unwrap().iter().map(|r| r.0).collect();
        assert_eq!(tokens, vec![4, 6]);
        assert!(parse_loads("nope").is_none());
    }

    #[test]
    fn imbalance_ignores_an_empty_fleet_and_late_samples() {
        assert_eq!(sample_imbalance(&[0, 0, 0, 0]), None);
        assert_eq!(sample_imbalance(&[10, 10, 10, 10]), Some(1.0));
        assert_eq!(sample_imbalance(&[40, 0, 0, 0]), Some(4.0));
        let sample = |t_s, tokens: Vec<u64>| LoadSample {
            t_s,
            waiting: vec![0; tokens.len()],
            cache_hit_rate: vec![f64::NAN; tokens.len()],
            tokens,
        };
        let samples = vec![
            sample(1.0, vec![30, 10, 0, 0]),
            sample(2.0, vec![10, 10, 20, 0]),
            sample(9.0, vec![90, 0, 0, 0]),
        ];
        assert_eq!(imbalance(&samples, 0.0, 5.0, 0..4), Some(2.5));
        assert_eq!(imbalance(&samples, 0.0, 5.0, 2..4), Some(2.0));
        assert_eq!(imbalance(&samples, 1.5, 5.0, 0..4), Some(2.0));
    }

    async fn sim(time_scale: f64) -> dprank_sim::SimServer {
        // The worker the harness runs: 4 ranks, the legacy cost model.
        let config = dprank_sim::SimConfig {
            time_scale,
            cost_model: dprank_sim::CostPreset::Legacy,
            dp_size: Some(4),
            ..dprank_sim::SimConfig::default()
        };
        dprank_sim::SimServer::start(Arc::new(config), "127.0.0.1:0".parse().unwrap(), None)
            .await
            .unwrap()
    }

    /// Tells the simulated worker where the plan's answers end.
    async fn tell(server: &dprank_sim::SimServer, plan: &Plan) {
        let lengths: serde_json::Map<String, serde_json::Value> = plan
            .answers()
            .iter()
            .map(|(tag, n)| (tag.to_string(), serde_json::Value::from(*n)))
            .collect();
        crate::client::post_json(
            &pooled_client(),
            &format!("http://{}/_sim/answers", server.addr),
            serde_json::json!({"lengths": lengths}).to_string(),
        )
        .await
        .unwrap();
    }

    fn options(server: &dprank_sim::SimServer, time_scale: f64) -> LoadOptions {
        LoadOptions {
            gateways: vec![format!("http://{}", server.addr)],
            spread: Spread::Request,
            workers: vec![server.addr],
            time_scale,
            sample_every: Duration::from_millis(20),
            request_timeout: Duration::from_secs(30),
            seed: 1,
            progress: false,
            label: "test".into(),
            cut_at_s: None,
            turn_horizon_s: None,
        }
    }

    fn shape(rate: f64, duration_s: f64) -> crate::workload::Shape {
        crate::workload::Shape {
            rate,
            duration_s,
            seed: 5,
            max_prompt: 4000,
            max_output: 200,
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn open_loop_requests_stream_from_a_simulated_worker() {
        let server = sim(50.0).await;
        let plan = crate::workload::Workload::new(crate::workload::WorkloadKind::Tenants)
            .plan(&shape(4.0, 10.0))
            .unwrap();
        tell(&server, &plan).await;
        let out = run_plan(&plan, &options(&server, 50.0)).await.unwrap();
        assert_eq!(out.records.len(), plan.requests.len());
        assert!(out.records.iter().all(|r| r.ok()), "{:?}", out.records[0]);
        // The worker reports the prompt size the workload asked for.
        let mut reported: Vec<(u64, u32)> = out
            .records
            .iter()
            .map(|r| (r.prompt_tokens.unwrap(), r.tokens))
            .collect();
        let mut asked: Vec<(u64, u32)> = plan
            .requests
            .iter()
            .map(|r| (u64::from(r.input_tokens), r.output_tokens))
            .collect();
        reported.sort_unstable();
        asked.sort_unstable();
        assert_eq!(reported, asked);
        assert!(!out.samples.is_empty() && out.samples[0].tokens.len() == 4);
        assert!(out.span_s >= out.arrival_window_s);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_run_reads_every_answer_to_its_end() {
        let server = sim(20.0).await;
        let mut plan = crate::workload::Workload::new(crate::workload::WorkloadKind::NoPrefix)
            .plan(&shape(5.0, 4.0))
            .unwrap();
        // One long answer arriving first: the run waits for its last token,
        // so its TPOT is over the whole answer, as in virtual time.
        plan.requests[0].body = crate::workload::bodies::generate("the cat sat far ", 1000, true);
        let out = run_plan(&plan, &options(&server, 20.0)).await.unwrap();
        assert!(out.records.iter().all(RequestRecord::ok));
        assert_eq!(out.records[0].tokens, 1000, "{:?}", out.records[0]);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn chat_sessions_resend_their_growing_history() {
        let server = sim(50.0).await;
        let plan = crate::workload::Workload::new(crate::workload::WorkloadKind::Chat)
            .plan(&shape(6.0, 10.0))
            .unwrap();
        tell(&server, &plan).await;
        let out = run_plan(&plan, &options(&server, 50.0)).await.unwrap();
        assert_eq!(out.records.len(), plan.request_count());
        assert!(out.records.iter().all(RequestRecord::ok));
        let mut checked = 0;
        for session in plan.sessions.iter().filter(|s| s.turns.len() >= 2) {
            let mut turns: Vec<&RequestRecord> = out
                .records
                .iter()
                .filter(|r| r.session.map(|s| s.0) == Some(session.id))
                .collect();
            turns.sort_by_key(|r| r.session.map(|s| s.1));
            assert_eq!(turns.len(), session.turns.len());
            for pair in turns.windows(2) {
                let (before, after) = (pair[0], pair[1]);
                // The next prompt holds the previous prompt and its whole answer.
                let prompt = |r: &RequestRecord| r.prompt_tokens.unwrap();
                assert!(
                    prompt(after) >= prompt(before) + u64::from(before.tokens),
                    "{before:?} then {after:?}"
                );
                // The worker counted what the bench meant to send.
                assert_eq!(prompt(after), u64::from(after.input_tokens));
            }
            checked += 1;
        }
        assert!(checked >= 3, "{checked} multi-turn sessions");
    }

    #[test]
    fn gateways_spread_evenly_and_reproducibly() {
        let mut counts = [0usize; 4];
        for key in 0..4000 {
            counts[gateway_for(7, key, 4)] += 1;
        }
        assert!(counts.iter().all(|c| (850..1150).contains(c)), "{counts:?}");
        assert_eq!(gateway_for(7, 11, 4), gateway_for(7, 11, 4));
        assert_eq!(gateway_for(7, 11, 1), 0);
    }

    #[test]
    fn tenant_spread_keeps_a_tenant_on_one_gateway_and_the_rest_per_request() {
        let (t, r) = (Spread::Tenant, Spread::Request);
        assert_eq!(spread_key(t, 3, Some(5)), spread_key(t, 900, Some(5)));
        assert_ne!(spread_key(t, 3, Some(5)), spread_key(t, 3, Some(6)));
        // A tenant's key is no request's index, nor a session's.
        assert_ne!(spread_key(t, 3, Some(3)), 3);
        assert_ne!(spread_key(t, 3, Some(3)), session_key(3));
        assert_eq!(spread_key(t, 3, None), 3);
        assert_eq!(spread_key(r, 3, Some(5)), 3);
        // Over four gateways the tenants land on more than one.
        let used: std::collections::BTreeSet<usize> = (0..16)
            .map(|tenant| gateway_for(7, spread_key(t, 0, Some(tenant)), 4))
            .collect();
        assert!(used.len() > 1, "{used:?}");
    }
}
