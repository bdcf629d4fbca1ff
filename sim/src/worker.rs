//! One simulated SGLang server: its ranks, schedulers, test controls and
//! recordings.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant, SystemTime};

use base64::Engine;
use serde::{Deserialize, Serialize};
use serde_json::{json, Map, Value};
use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver};
use tokio::sync::Notify;

use crate::config::{Dispatch, Role, SimConfig};
use crate::model::{Event, RankLoad, RankState, SeqGroup, Step};
use crate::protocol::{Bootstrap, ParsedRequest, Rejection};

/// Locks a mutex, ignoring poisoning (no lock holder panics in this crate).
pub fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Fault injected into both load endpoints.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum LoadFault {
    #[default]
    None,
    #[serde(rename = "http_500")]
    Http500,
    Malformed,
    Truncated,
    Hang,
    WrongDpSize,
    NotFound,
}

/// Fault injected into the serving endpoints.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ServingFault {
    #[default]
    None,
    #[serde(rename = "http_500")]
    Http500,
    CloseMidStream,
}

/// Test controls, as reported by the control endpoint.
#[derive(Debug, Clone, Default, Serialize)]
pub struct Control {
    pub base_tokens: Vec<u64>,
    pub load_fault: LoadFault,
    pub serving_fault: ServingFault,
    pub response_delay_ms: u64,
}

/// A change to the controls; absent fields are left as they are.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ControlUpdate {
    pub base_tokens: Option<Vec<u64>>,
    pub load_fault: Option<LoadFault>,
    pub serving_fault: Option<ServingFault>,
    pub response_delay_ms: Option<u64>,
}

/// One recorded serving request.
#[derive(Debug, Clone)]
pub struct Record {
    pub path: String,
    pub query: Option<String>,
    pub method: String,
    pub headers: Vec<(String, String)>,
    pub body: bytes::Bytes,
    pub rank: Option<usize>,
    pub status: Option<u16>,
}

impl Record {
    pub fn to_json(&self) -> Value {
        let mut headers = Map::new();
        for (name, value) in &self.headers {
            match headers.get_mut(name) {
                // Repeated headers are joined as HTTP allows.
                Some(Value::String(existing)) => {
                    existing.push_str(", ");
                    existing.push_str(value);
                }
                _ => {
                    headers.insert(name.clone(), Value::String(value.clone()));
                }
            }
        }
        let mut object = Map::new();
        object.insert("path".into(), json!(self.path));
        object.insert("query".into(), json!(self.query));
        object.insert("method".into(), json!(self.method));
        object.insert("headers".into(), Value::Object(headers));
        match std::str::from_utf8(&self.body) {
            Ok(text) => object.insert("body".into(), json!(text)),
            Err(_) => object.insert(
                "body_base64".into(),
                json!(base64::engine::general_purpose::STANDARD.encode(&self.body)),
            ),
        };
        object.insert("rank".into(), json!(self.rank));
        object.insert("status".into(), json!(self.status));
        Value::Object(object)
    }
}

/// Prefill rooms whose KV is ready, bounded so a long run cannot grow it
/// without limit.
#[derive(Debug, Default)]
struct Rooms {
    ready: HashMap<u64, usize>,
    order: VecDeque<u64>,
}

const ROOMS_KEPT: usize = 1 << 16;

impl Rooms {
    fn mark(&mut self, room: u64, rank: usize) {
        if self.ready.insert(room, rank).is_none() {
            self.order.push_back(room);
            while self.order.len() > ROOMS_KEPT {
                if let Some(old) = self.order.pop_front() {
                    self.ready.remove(&old);
                }
            }
        }
    }
}

pub struct Rank {
    pub state: Mutex<RankState>,
    /// Wakes this rank's scheduler.
    pub wake: Notify,
}

/// A request accepted on a rank.
pub struct Admitted {
    pub rank: usize,
    pub max_new_tokens: u64,
    pub events: UnboundedReceiver<Event>,
    /// Keeps --instant requests counted in the load until dropped.
    pub instant_guard: Option<InstantGuard>,
}

/// Counts an --instant request in its rank's load while alive.
pub struct InstantGuard {
    worker: Arc<Worker>,
    rank: usize,
    seqs: u64,
    tokens: u64,
}

impl Drop for InstantGuard {
    fn drop(&mut self) {
        if let Some(rank) = self.worker.ranks.get(self.rank) {
            let mut state = lock(&rank.state);
            state.instant_requests = state.instant_requests.saturating_sub(1);
            state.instant_seqs = state.instant_seqs.saturating_sub(self.seqs);
            state.instant_tokens = state.instant_tokens.saturating_sub(self.tokens);
        }
    }
}

pub struct Worker {
    pub config: Arc<SimConfig>,
    /// The listen address, as put in `x-sim-worker`.
    pub name: String,
    pub ranks: Vec<Rank>,
    /// Makes "look at the loads, then enqueue" atomic for minimum_tokens.
    dispatch_lock: Mutex<()>,
    round_robin: AtomicUsize,
    next_id: AtomicU64,
    control: Mutex<Control>,
    /// The latest `--record-limit` serving requests, oldest first.
    records: Mutex<VecDeque<Arc<Mutex<Record>>>>,
    get_load_polls: AtomicU64,
    v1_loads_polls: AtomicU64,
    served: Vec<AtomicU64>,
    rooms: Mutex<Rooms>,
    /// Wakes the --lockstep scheduler when any rank has work.
    any_wake: Notify,
    http: reqwest::Client,
    pub started: Instant,
}

impl Worker {
    pub fn new(config: Arc<SimConfig>, name: String) -> Result<Arc<Self>, String> {
        let http = reqwest::Client::builder()
            .no_proxy()
            .tcp_nodelay(true)
            .build()
            .map_err(|err| format!("cannot build the HTTP client: {err}"))?;
        let dp_size = config.dp_size;
        Ok(Arc::new(Self {
            name,
            ranks: (0..dp_size)
                .map(|_| Rank {
                    state: Mutex::new(RankState::default()),
                    wake: Notify::new(),
                })
                .collect(),
            dispatch_lock: Mutex::new(()),
            round_robin: AtomicUsize::new(0),
            next_id: AtomicU64::new(1),
            control: Mutex::new(Control {
                base_tokens: vec![0; dp_size],
                ..Control::default()
            }),
            records: Mutex::new(VecDeque::new()),
            get_load_polls: AtomicU64::new(0),
            v1_loads_polls: AtomicU64::new(0),
            served: (0..dp_size).map(|_| AtomicU64::new(0)).collect(),
            rooms: Mutex::new(Rooms::default()),
            any_wake: Notify::new(),
            http,
            started: Instant::now(),
            config,
        }))
    }

    pub fn control(&self) -> Control {
        lock(&self.control).clone()
    }

    pub fn apply_control(&self, update: ControlUpdate) -> Result<Control, String> {
        let dp_size = self.config.dp_size;
        if let Some(base) = &update.base_tokens {
            if base.len() > dp_size {
                return Err(format!(
                    "base_tokens has {} entries but dp_size is {dp_size}",
                    base.len()
                ));
            }
        }
        let mut control = lock(&self.control);
        if let Some(mut base) = update.base_tokens {
            base.resize(dp_size, 0);
            control.base_tokens = base;
        }
        if let Some(fault) = update.load_fault {
            control.load_fault = fault;
        }
        if let Some(fault) = update.serving_fault {
            control.serving_fault = fault;
        }
        if let Some(delay) = update.response_delay_ms {
            control.response_delay_ms = delay;
        }
        Ok(control.clone())
    }

    /// Clears recordings and counters.
    pub fn reset(&self) {
        lock(&self.records).clear();
        self.get_load_polls.store(0, Ordering::Relaxed);
        self.v1_loads_polls.store(0, Ordering::Relaxed);
        for served in &self.served {
            served.store(0, Ordering::Relaxed);
        }
    }

    pub fn record(&self, record: Record) -> Arc<Mutex<Record>> {
        let record = Arc::new(Mutex::new(record));
        let limit = self.config.record_limit;
        if limit > 0 {
            let mut records = lock(&self.records);
            if records.len() >= limit {
                records.pop_front();
            }
            records.push_back(record.clone());
        }
        record
    }

    pub fn records_json(&self) -> Value {
        let records: Vec<Arc<Mutex<Record>>> = lock(&self.records).iter().cloned().collect();
        Value::Array(records.iter().map(|record| lock(record).to_json()).collect())
    }

    pub fn count_load_poll(&self, v1: bool) {
        let counter = if v1 {
            &self.v1_loads_polls
        } else {
            &self.get_load_polls
        };
        counter.fetch_add(1, Ordering::Relaxed);
    }

    pub fn counters_json(&self) -> Value {
        let loads = self.rank_loads();
        json!({
            "load_requests": {
                "/get_load": self.get_load_polls.load(Ordering::Relaxed),
                "/v1/loads": self.v1_loads_polls.load(Ordering::Relaxed),
            },
            "served_per_rank": self.served.iter().map(|n| n.load(Ordering::Relaxed)).collect::<Vec<_>>(),
            "in_flight_per_rank": loads.iter().map(|load| load.in_flight).collect::<Vec<_>>(),
        })
    }

    /// The model's loads right now (without the control offsets).
    pub fn rank_loads(&self) -> Vec<RankLoad> {
        self.ranks.iter().map(|rank| lock(&rank.state).load()).collect()
    }

    fn choose_rank(&self, request: &ParsedRequest) -> usize {
        let dp_size = self.ranks.len().max(1);
        let room = request.bootstrap.as_ref().and_then(|b| b.rooms.first().copied());
        match (self.config.dispatch, room) {
            (Dispatch::RoomModulo, Some(room)) => (room % dp_size as u64) as usize,
            (Dispatch::RoundRobin | Dispatch::RoomModulo, _) => {
                self.round_robin.fetch_add(1, Ordering::Relaxed) % dp_size
            }
            (Dispatch::MinimumTokens, _) => self
                .rank_loads()
                .iter()
                .enumerate()
                .min_by_key(|(index, load)| (load.used_tokens + load.pending_tokens, *index))
                .map_or(0, |(index, _)| index),
        }
    }

    /// Accepts a request on its rank: queued for the scheduler, or answered
    /// at once in --instant mode.
    pub fn submit(self: &Arc<Self>, request: &ParsedRequest) -> Result<Admitted, Rejection> {
        let config = &self.config;
        let seqs = request.prompt_tokens.len().max(1) as u64;
        let prompt_tokens: u64 = request.prompt_tokens.iter().sum();
        if prompt_tokens + seqs > config.kv_capacity {
            return Err(Rejection {
                status: 400,
                message: format!(
                    "The input ({prompt_tokens} tokens) is longer than the KV cache capacity ({} tokens) of a rank.",
                    config.kv_capacity
                ),
            });
        }
        // A prefill worker only computes the first token; longer outputs
        // are clamped to what fits in the KV cache, as SGLang clamps to
        // the context length.
        let wanted = if config.role == Role::Prefill {
            1
        } else {
            request.max_new_tokens
        };
        let max_new_tokens = wanted.min((config.kv_capacity - prompt_tokens) / seqs).max(1);
        let (sender, events) = unbounded_channel();
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let group = SeqGroup {
            id,
            seqs,
            prompt_tokens,
            max_new_tokens,
            generated: 0,
            reserved: prompt_tokens + seqs * max_new_tokens,
            events: sender,
            bootstrap: request.bootstrap.clone(),
        };

        let dispatch_guard = lock(&self.dispatch_lock);
        let rank = request.rank.unwrap_or_else(|| self.choose_rank(request));
        let Some(rank_slot) = self.ranks.get(rank) else {
            return Err(Rejection {
                status: 400,
                message: format!("rank {rank} is out of range"),
            });
        };
        if let Some(served) = self.served.get(rank) {
            served.fetch_add(1, Ordering::Relaxed);
        }
        let mut instant = None;
        {
            let mut state = lock(&rank_slot.state);
            if config.instant {
                state.instant_requests += 1;
                state.instant_seqs += seqs;
                state.instant_tokens += prompt_tokens;
                instant = Some(group);
            } else {
                state.waiting.push_back(group);
            }
        }
        drop(dispatch_guard);
        let instant_guard = match instant {
            Some(group) => {
                self.answer_instantly(rank, group);
                Some(InstantGuard {
                    worker: self.clone(),
                    rank,
                    seqs,
                    tokens: prompt_tokens,
                })
            }
            None => {
                self.wake(rank);
                None
            }
        };
        Ok(Admitted {
            rank,
            max_new_tokens,
            events,
            instant_guard,
        })
    }

    /// --instant: every token at once (after the prefill room in the
    /// decode role: that wait is protocol, not modelled time).
    fn answer_instantly(self: &Arc<Self>, rank: usize, group: SeqGroup) {
        let send_all = |group: &SeqGroup| {
            for count in 1..=group.max_new_tokens {
                let _ = group.events.send(Event::Tokens(count));
            }
        };
        match (self.config.role, group.bootstrap.clone()) {
            (Role::Decode, Some(bootstrap)) => {
                let worker = self.clone();
                tokio::spawn(async move {
                    match worker.wait_for_rooms(&bootstrap, || group.cancelled()).await {
                        Ok(()) => send_all(&group),
                        Err(message) => {
                            let _ = group.events.send(Event::Failed { status: 500, message });
                        }
                    }
                });
            }
            (Role::Prefill, Some(bootstrap)) => {
                self.mark_rooms_ready(&bootstrap.rooms, rank);
                send_all(&group);
            }
            _ => send_all(&group),
        }
    }

    fn mark_rooms_ready(&self, rooms: &[u64], rank: usize) {
        let mut ready = lock(&self.rooms);
        for room in rooms {
            ready.mark(*room, rank);
        }
    }

    /// The rank that prefilled a room, once it is ready.
    pub fn room_rank(&self, room: u64) -> Option<usize> {
        lock(&self.rooms).ready.get(&room).copied()
    }

    fn scaled(&self, seconds: f64) -> Duration {
        Duration::from_secs_f64((seconds / self.config.time_scale).max(0.0))
    }

    /// Admits what fits on a rank and says what it does next; starts the
    /// KV transfers of requests admitted in the decode role.
    fn plan_step(self: &Arc<Self>, index: usize) -> Step {
        let Some(rank) = self.ranks.get(index) else {
            return Step::Idle;
        };
        let config = &self.config;
        let (step, transfers) = {
            let mut state = lock(&rank.state);
            state.purge_cancelled();
            let transfers = state.admit(config.kv_capacity, config.max_running, config.role);
            (state.next_step(), transfers)
        };
        for transfer in transfers {
            tokio::spawn(self.clone().transfer_kv(index, transfer.id, transfer.bootstrap));
        }
        step
    }

    fn step_duration(&self, step: Step) -> Duration {
        let config = &self.config;
        match step {
            Step::Idle => Duration::ZERO,
            Step::Prefill { tokens } => self.scaled(tokens as f64 / config.prefill_tokens_per_s),
            Step::Decode { batch_tokens } => self.scaled(
                config.decode_step_ms / 1e3 + config.decode_step_us_per_token * batch_tokens as f64 / 1e6,
            ),
        }
    }

    fn finish_step(&self, index: usize, step: Step) {
        let Some(rank) = self.ranks.get(index) else {
            return;
        };
        let mut state = lock(&rank.state);
        match step {
            Step::Idle => {}
            Step::Prefill { .. } => {
                state.finish_prefill(self.config.role, &mut |rooms| self.mark_rooms_ready(rooms, index))
            }
            Step::Decode { .. } => state.finish_decode(),
        }
    }

    /// Wakes a rank's scheduler (and the lockstep scheduler).
    fn wake(&self, index: usize) {
        if let Some(rank) = self.ranks.get(index) {
            rank.wake.notify_one();
        }
        self.any_wake.notify_one();
    }

    /// The scheduler of one rank; runs until aborted.
    pub async fn run_rank(self: Arc<Self>, index: usize) {
        let Some(rank) = self.ranks.get(index) else {
            return;
        };
        loop {
            let step = self.plan_step(index);
            if step == Step::Idle {
                rank.wake.notified().await;
                continue;
            }
            tokio::time::sleep(self.step_duration(step)).await;
            self.finish_step(index, step);
        }
    }

    /// --lockstep: one scheduler for all ranks. Under DP attention every
    /// forward pass is synchronised across ranks (the MoE layers are
    /// shared), so a step lasts as long as the slowest rank's batch.
    pub async fn run_lockstep(self: Arc<Self>) {
        loop {
            let steps: Vec<Step> = (0..self.ranks.len()).map(|index| self.plan_step(index)).collect();
            if steps.iter().all(|step| *step == Step::Idle) {
                self.any_wake.notified().await;
                continue;
            }
            let longest = steps
                .iter()
                .map(|step| self.step_duration(*step))
                .max()
                .unwrap_or_default();
            tokio::time::sleep(longest).await;
            for (index, step) in steps.into_iter().enumerate() {
                self.finish_step(index, step);
            }
        }
    }

    /// Decode role: waits for the prefill's room, then lets the request
    /// decode (or fails it after --kv-wait-timeout-ms).
    async fn transfer_kv(self: Arc<Self>, rank: usize, id: u64, bootstrap: Option<Bootstrap>) {
        let Some(rank_slot) = self.ranks.get(rank) else {
            return;
        };
        let outcome = match bootstrap {
            Some(bootstrap) => {
                self.wait_for_rooms(&bootstrap, || lock(&rank_slot.state).transfer_abandoned(id))
                    .await
            }
            None => Err("no bootstrap fields".to_string()),
        };
        lock(&rank_slot.state).finish_transfer(id, outcome);
        self.wake(rank);
    }

    /// Polls `http://host:port/_sim/kv/<room>` until every room is ready.
    pub async fn wait_for_rooms(
        &self,
        bootstrap: &Bootstrap,
        abandoned: impl Fn() -> bool,
    ) -> Result<(), String> {
        let timeout = Duration::from_millis(self.config.kv_wait_timeout_ms);
        let deadline = Instant::now() + timeout;
        let Some(port) = bootstrap.port else {
            return Err("bootstrap_port is null".into());
        };
        let host = if bootstrap.host.contains(':') && !bootstrap.host.starts_with('[') {
            format!("[{}]", bootstrap.host)
        } else {
            bootstrap.host.clone()
        };
        let mut pending: Vec<u64> = bootstrap.rooms.clone();
        pending.dedup();
        let interval = Duration::from_millis(self.config.kv_poll_interval_ms.max(1));
        loop {
            let mut still_pending = Vec::new();
            for room in pending {
                let remaining = deadline.saturating_duration_since(Instant::now());
                let ready = match self
                    .http
                    .get(format!("http://{host}:{port}/_sim/kv/{room}"))
                    .timeout(remaining.clamp(Duration::from_millis(1), Duration::from_secs(1)))
                    .send()
                    .await
                {
                    Ok(response) => response.status().is_success(),
                    Err(_) => false,
                };
                if !ready {
                    still_pending.push(room);
                }
            }
            pending = still_pending;
            let Some(room) = pending.first() else {
                return Ok(());
            };
            if abandoned() {
                return Err("the client went away".into());
            }
            if Instant::now() >= deadline {
                return Err(format!(
                    "KV cache of bootstrap_room {room} not ready at {host}:{port} after {} ms",
                    timeout.as_millis()
                ));
            }
            tokio::time::sleep(interval).await;
        }
    }

    /// The load report as `/get_load` shapes it.
    pub fn get_load_json(&self, extra_ranks: usize) -> Value {
        let base = self.control().base_tokens;
        let loads = self.rank_loads();
        let rows: Vec<Value> = (0..loads.len() + extra_ranks)
            .map(|rank| {
                let load = loads.get(rank).copied().unwrap_or_default();
                let offset = base.get(rank).copied().unwrap_or(0);
                json!({
                    "dp_rank": rank,
                    "num_reqs": load.running + load.waiting,
                    "num_waiting_reqs": load.waiting,
                    "num_tokens": load.used_tokens + load.pending_tokens + offset,
                })
            })
            .collect();
        Value::Array(rows)
    }

    /// The load report as `/v1/loads` shapes it.
    pub fn v1_loads_json(&self, extra_ranks: usize) -> Value {
        let base = self.control().base_tokens;
        let loads = self.rank_loads();
        let capacity = self.config.kv_capacity;
        let with_total = !self.config.no_total_tokens;
        let mut sums = [0u64; 6];
        let rows: Vec<Value> = (0..loads.len() + extra_ranks)
            .map(|rank| {
                let load = loads.get(rank).copied().unwrap_or_default();
                let offset = base.get(rank).copied().unwrap_or(0);
                let used = load.used_tokens + offset;
                let total = used + load.pending_tokens;
                let values = [
                    load.running,
                    load.waiting,
                    load.running + load.waiting,
                    used,
                    total,
                    capacity,
                ];
                for (sum, value) in sums.iter_mut().zip(values) {
                    *sum += value;
                }
                let mut row = json!({
                    "dp_rank": rank,
                    "num_running_reqs": load.running,
                    "num_waiting_reqs": load.waiting,
                    "num_total_reqs": load.running + load.waiting,
                    "num_used_tokens": used,
                    "max_total_num_tokens": capacity,
                    "token_usage": used as f64 / capacity as f64,
                });
                if with_total {
                    if let Some(object) = row.as_object_mut() {
                        object.insert("num_total_tokens".into(), json!(total));
                    }
                }
                row
            })
            .collect();
        let mut aggregate = json!({
            "num_running_reqs": sums[0],
            "num_waiting_reqs": sums[1],
            "num_total_reqs": sums[2],
            "num_used_tokens": sums[3],
            "max_total_num_tokens": sums[5],
            "token_usage": if sums[5] == 0 { 0.0 } else { sums[3] as f64 / sums[5] as f64 },
        });
        if with_total {
            if let Some(object) = aggregate.as_object_mut() {
                object.insert("num_total_tokens".into(), json!(sums[4]));
            }
        }
        json!({
            "timestamp": humantime::format_rfc3339_millis(SystemTime::now()).to_string(),
            "version": "sim",
            "dp_rank_count": rows.len(),
            "loads": rows,
            "aggregate": aggregate,
        })
    }
}
