//! The simulated servers of one process in real time: the shared model
//! and the tasks that step it, and each server's controls, recordings and
//! counters.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

use base64::Engine;
use serde::{Deserialize, Serialize};
use serde_json::{json, Map, Value};
use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver, UnboundedSender};
use tokio::sync::Notify;

use crate::answers::AnswerBook;
use crate::config::{Dispatch, Role, SimConfig};
use crate::engine::{Arrival, EngineStats, Event, EventKind, Fleet, Micros, RankSnapshot, ReqId};
use crate::loads::{self, LoadView};
use crate::metrics::{self, Garble, MetricsView};
use crate::protocol::{Bootstrap, ParsedRequest, Rejection};
use crate::sync::lock;

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
    /// vLLM `/metrics` only: running counts and KV usage read `NaN`.
    Nan,
    /// vLLM `/metrics` only: engine labels that are not engine numbers.
    WrongLabels,
    /// vLLM `/metrics` only: padded beyond 9 MiB.
    Huge,
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
    /// vLLM mode: requests added to each engine's `vllm:num_requests_waiting`
    /// (by local index), as `base_tokens` is to SGLang's token counts.
    pub base_waiting: Vec<u64>,
    pub load_fault: LoadFault,
    pub serving_fault: ServingFault,
    pub response_delay_ms: u64,
}

/// A change to the controls; absent fields are left as they are.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ControlUpdate {
    pub base_tokens: Option<Vec<u64>>,
    pub base_waiting: Option<Vec<u64>>,
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

/// What a request hears while it is served.
#[derive(Debug, Clone, PartialEq)]
pub enum Progress {
    /// It reached its rank's queue.
    Placed { worker: usize, rank: usize },
    /// Sequence `seq` now has `count` output tokens.
    Token { seq: usize, count: u64, cached: u64 },
    /// It failed with this HTTP status.
    Failed { status: u16, message: String },
}

/// A request being served by the model.
#[derive(Debug)]
struct Route {
    sender: UnboundedSender<Progress>,
    /// Sequences not yet finished.
    open: usize,
    /// Prefill role: rooms to mark ready once every sequence is done.
    rooms: Vec<u64>,
    /// Decode role: where to fetch the KV from.
    bootstrap: Option<Bootstrap>,
    /// The serving worker and rank, once placed.
    worker: usize,
    rank: usize,
}

/// The model and who listens to it.
#[derive(Debug)]
struct Model {
    fleet: Fleet,
    routes: HashMap<ReqId, Route>,
}

/// A request accepted by a server.
pub struct Admitted {
    pub max_new_tokens: u64,
    /// Output tokens each sequence will produce (its answer, at most the cap).
    pub stops: Vec<u64>,
    /// When it reaches the scheduler (after the tokenizer), real time.
    pub ready: Instant,
    pub events: UnboundedReceiver<Progress>,
    pub guard: RequestGuard,
}

/// Held while a request is in flight: dropping it aborts the request in
/// the model (SGLang aborts requests whose client went away) and ends its
/// in-flight count.
pub struct RequestGuard {
    shared: Arc<Shared>,
    req: Option<ReqId>,
    placed: Option<(usize, usize)>,
    /// --instant: counted in the rank's load while alive.
    instant: Option<(usize, usize, u64, u64)>,
}

impl RequestGuard {
    /// Notes where the request is served (counted in flight there).
    pub fn placed(&mut self, worker: usize, rank: usize) {
        if self.placed.is_none() {
            self.placed = Some((worker, rank));
        }
    }
}

impl Drop for RequestGuard {
    fn drop(&mut self) {
        if let Some(req) = self.req {
            let wake = {
                let mut model = lock(&self.shared.model);
                match model.routes.remove(&req) {
                    Some(_) => {
                        // Placed, though this handler may not have heard yet.
                        if let Some((worker, Some(rank))) = model.fleet.placement(req) {
                            self.placed.get_or_insert((worker, rank));
                        }
                        model.fleet.abort(req)
                    }
                    None => None,
                }
            };
            if let Some((worker, group)) = wake {
                self.shared.wake(worker, group);
            }
        }
        if let Some((worker, rank)) = self.placed {
            if let Some(counter) = self
                .shared
                .servers
                .get(worker)
                .and_then(|s| s.in_flight.get(rank))
            {
                counter.fetch_sub(1, Ordering::Relaxed);
            }
        }
        if let Some((worker, rank, seqs, tokens)) = self.instant {
            if let Some(server) = self.shared.servers.get(worker) {
                let mut instant = lock(&server.instant);
                if let Some(load) = instant.get_mut(rank) {
                    load.running = load.running.saturating_sub(seqs);
                    load.used_tokens = load.used_tokens.saturating_sub(tokens);
                    load.total_tokens = load.total_tokens.saturating_sub(tokens);
                }
            }
        }
    }
}

/// One server (one `--listen`): what is not the model.
pub struct Server {
    pub index: usize,
    /// The listen address, as put in `x-sim-worker`.
    pub name: String,
    control: Mutex<Control>,
    /// The latest `--record-limit` serving requests, oldest first.
    records: Mutex<VecDeque<Arc<Mutex<Record>>>>,
    get_load_polls: AtomicU64,
    v1_loads_polls: AtomicU64,
    metrics_polls: AtomicU64,
    served: Vec<AtomicU64>,
    in_flight: Vec<AtomicU64>,
    rooms: Mutex<Rooms>,
    /// --instant: what each rank holds (no model).
    instant: Mutex<Vec<RankSnapshot>>,
    round_robin: AtomicUsize,
}

/// Every server of one process and their shared model.
pub struct Shared {
    pub config: Arc<SimConfig>,
    pub servers: Vec<Server>,
    /// Answer lengths by prompt tag (`POST /_sim/answers`).
    pub answers: AnswerBook,
    model: Mutex<Model>,
    /// Wakes the task stepping each (worker, group).
    wakes: Vec<Vec<Notify>>,
    clock: Instant,
    /// Unix seconds at start (`_created` samples of `/metrics`).
    started_unix: f64,
    http: reqwest::Client,
}

impl Shared {
    /// The servers named `names` (their listen addresses), in order.
    pub fn new(config: Arc<SimConfig>, names: Vec<String>) -> Result<Arc<Self>, String> {
        let http = reqwest::Client::builder()
            .no_proxy()
            .tcp_nodelay(true)
            .build()
            .map_err(|err| format!("cannot build the HTTP client: {err}"))?;
        let dp_size = config.dp_size();
        let fleet = Fleet::new(&config, names.len());
        let wakes = (0..names.len())
            .map(|worker| (0..fleet.groups(worker)).map(|_| Notify::new()).collect())
            .collect();
        let servers = names
            .into_iter()
            .enumerate()
            .map(|(index, name)| Server {
                index,
                name,
                control: Mutex::new(Control {
                    base_tokens: vec![0; dp_size],
                    ..Control::default()
                }),
                records: Mutex::new(VecDeque::new()),
                get_load_polls: AtomicU64::new(0),
                v1_loads_polls: AtomicU64::new(0),
                metrics_polls: AtomicU64::new(0),
                served: (0..dp_size).map(|_| AtomicU64::new(0)).collect(),
                in_flight: (0..dp_size).map(|_| AtomicU64::new(0)).collect(),
                rooms: Mutex::new(Rooms::default()),
                instant: Mutex::new(vec![RankSnapshot::default(); dp_size]),
                round_robin: AtomicUsize::new(0),
            })
            .collect();
        Ok(Arc::new(Self {
            config,
            servers,
            answers: AnswerBook::default(),
            model: Mutex::new(Model {
                fleet,
                routes: HashMap::new(),
            }),
            wakes,
            clock: Instant::now(),
            started_unix: SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0.0, |elapsed| elapsed.as_secs_f64()),
            http,
        }))
    }

    /// Simulated time now.
    fn now(&self) -> Micros {
        (self.clock.elapsed().as_secs_f64() * self.config.time_scale * 1e6) as Micros
    }

    /// The real duration of a simulated one.
    fn real(&self, micros: Micros) -> Duration {
        Duration::from_secs_f64(micros as f64 / 1e6 / self.config.time_scale)
    }

    fn wake(&self, worker: usize, group: usize) {
        if let Some(notify) = self.wakes.get(worker).and_then(|groups| groups.get(group)) {
            notify.notify_one();
        }
    }

    /// (worker, group) pairs that step.
    pub fn groups(&self) -> Vec<(usize, usize)> {
        self.wakes
            .iter()
            .enumerate()
            .flat_map(|(worker, groups)| (0..groups.len()).map(move |group| (worker, group)))
            .collect()
    }

    /// Accepts a request arriving at server `receiving`: into the model
    /// (through the tokenizer), or answered at once with --instant.
    pub fn submit(
        self: &Arc<Self>,
        receiving: usize,
        request: &ParsedRequest,
    ) -> Result<Admitted, Rejection> {
        let config = &self.config;
        let seqs = request.prompts.len().max(1) as u64;
        let longest = request.prompts.iter().map(Vec::len).max().unwrap_or(1) as u64;
        let prompt_tokens: u64 = request.prompts.iter().map(|prompt| prompt.len() as u64).sum();
        // A prefill worker only computes the first token; longer outputs
        // are clamped to what fits in the KV cache, as SGLang clamps to
        // the context length.
        let wanted = if config.role == Role::Prefill {
            1
        } else {
            request.max_new_tokens
        };
        let Some(max_new_tokens) = config.fit_output(longest, wanted) else {
            return Err(Rejection {
                in_stream: false,
                body: None,
                status: 400,
                message: format!(
                    "The input ({longest} tokens) is longer than the KV cache capacity ({} tokens) of a rank.",
                    config.kv_capacity()
                ),
            });
        };
        let answer_tokens: Vec<Option<u64>> = request
            .answer_tags
            .iter()
            .map(|tag| tag.as_deref().and_then(|tag| self.answers.length(tag)))
            .collect();
        let arrival = Arrival {
            prompts: request.prompts.clone(),
            max_new_tokens,
            answer_tokens,
            rank: request.rank,
            room: request.bootstrap.as_ref().and_then(|b| b.rooms.first().copied()),
            pretokenized: request.pretokenized,
            priority: request.priority,
        };
        let stops: Vec<u64> = (0..seqs as usize).map(|seq| arrival.stop_at(seq)).collect();
        let (sender, events) = unbounded_channel();
        let mut guard = RequestGuard {
            shared: self.clone(),
            req: None,
            placed: None,
            instant: None,
        };
        if config.instant {
            let rank = request
                .rank
                .unwrap_or_else(|| self.instant_rank(receiving, request));
            {
                let server = &self.servers[receiving];
                let mut instant = lock(&server.instant);
                if let Some(load) = instant.get_mut(rank) {
                    load.running += seqs;
                    load.used_tokens += prompt_tokens;
                    load.total_tokens += prompt_tokens;
                }
            }
            guard.instant = Some((receiving, rank, seqs, prompt_tokens));
            self.count_served(receiving, rank);
            guard.placed(receiving, rank);
            let _ = sender.send(Progress::Placed {
                worker: receiving,
                rank,
            });
            self.answer_instantly(receiving, rank, request, stops.clone(), sender);
            return Ok(Admitted {
                max_new_tokens,
                stops,
                ready: Instant::now(),
                events,
                guard,
            });
        }
        let submitted = {
            let mut model = lock(&self.model);
            let submitted = model.fleet.submit(self.now(), receiving, arrival);
            model.routes.insert(
                submitted.req,
                Route {
                    sender,
                    open: request.prompts.len().max(1),
                    rooms: match config.role {
                        Role::Prefill => request
                            .bootstrap
                            .as_ref()
                            .map(|b| b.rooms.clone())
                            .unwrap_or_default(),
                        _ => Vec::new(),
                    },
                    bootstrap: request.bootstrap.clone(),
                    worker: submitted.worker,
                    rank: 0,
                },
            );
            submitted
        };
        guard.req = Some(submitted.req);
        Ok(Admitted {
            max_new_tokens,
            stops,
            ready: self.clock + self.real(submitted.ready_at),
            events,
            guard,
        })
    }

    /// --instant: the rank for a request naming none.
    fn instant_rank(&self, receiving: usize, request: &ParsedRequest) -> usize {
        let server = &self.servers[receiving];
        let dp_size = self.config.dp_size().max(1);
        let room = request.bootstrap.as_ref().and_then(|b| b.rooms.first().copied());
        match (self.config.dispatch(), room) {
            (Dispatch::RoomModulo, Some(room)) => (room % dp_size as u64) as usize,
            (Dispatch::TotalTokens | Dispatch::TotalRequests | Dispatch::Oracle | Dispatch::Vllm, _) => {
                lock(&server.instant)
                    .iter()
                    .enumerate()
                    .min_by_key(|(index, load)| (load.total_tokens, load.running, *index))
                    .map_or(0, |(index, _)| index)
            }
            _ => server.round_robin.fetch_add(1, Ordering::Relaxed) % dp_size,
        }
    }

    /// --instant: every token at once (after the prefill room in the
    /// decode role: that wait is protocol, not modelled time).
    fn answer_instantly(
        self: &Arc<Self>,
        receiving: usize,
        rank: usize,
        request: &ParsedRequest,
        stops: Vec<u64>,
        sender: UnboundedSender<Progress>,
    ) {
        let longest = stops.iter().copied().max().unwrap_or(1);
        let send_all = move |sender: &UnboundedSender<Progress>| {
            for count in 1..=longest {
                for (seq, stop) in stops.iter().enumerate() {
                    if count <= *stop {
                        let _ = sender.send(Progress::Token {
                            seq,
                            count,
                            cached: 0,
                        });
                    }
                }
            }
        };
        match (self.config.role, request.bootstrap.clone()) {
            (Role::Decode, Some(bootstrap)) => {
                let shared = self.clone();
                tokio::spawn(async move {
                    match shared.wait_for_rooms(&bootstrap, || sender.is_closed()).await {
                        Ok(()) => send_all(&sender),
                        Err(message) => {
                            let _ = sender.send(Progress::Failed { status: 500, message });
                        }
                    }
                });
            }
            (Role::Prefill, Some(bootstrap)) => {
                self.servers[receiving].mark_rooms_ready(&bootstrap.rooms, rank);
                send_all(&sender);
            }
            _ => send_all(&sender),
        }
    }

    fn count_served(&self, worker: usize, rank: usize) {
        if let Some(server) = self.servers.get(worker) {
            if let Some(served) = server.served.get(rank) {
                served.fetch_add(1, Ordering::Relaxed);
            }
            if let Some(in_flight) = server.in_flight.get(rank) {
                in_flight.fetch_add(1, Ordering::Relaxed);
            }
        }
    }

    /// Puts every request the tokenizers are done with on its rank's
    /// queue (called by each request once its tokenizer time has passed).
    pub fn dispatch_due(self: &Arc<Self>, ready: Instant) {
        let now = self.now().max((ready - self.clock).as_micros() as Micros);
        let mut wake = Vec::new();
        {
            let mut model = lock(&self.model);
            for dispatched in model.fleet.dispatch_due(now) {
                if let Some(route) = model.routes.get_mut(&dispatched.req) {
                    route.worker = dispatched.worker;
                    route.rank = dispatched.rank;
                    let _ = route.sender.send(Progress::Placed {
                        worker: dispatched.worker,
                        rank: dispatched.rank,
                    });
                }
                self.count_served(dispatched.worker, dispatched.rank);
                wake.push((dispatched.worker, dispatched.group));
            }
        }
        for (worker, group) in wake {
            self.wake(worker, group);
        }
    }

    /// Steps one group of ranks of one worker, in real time; runs until
    /// aborted.
    pub async fn run_group(self: Arc<Self>, worker: usize, group: usize) {
        // When a step follows the last one at once, it starts where that one
        // ended in model time, not when the timer woke the task: the timer's
        // resolution (1 ms) and wake-up latency would otherwise lengthen
        // every step, and the fleet would run slower than the model (at time
        // scale 5 a 20 ms decode step is 4 ms of wall time). A task woken
        // late catches up by not sleeping until model time is back level.
        let mut carried: Option<Micros> = None;
        loop {
            let step = {
                let mut model = lock(&self.model);
                let now = carried.take().unwrap_or_else(|| self.now());
                let mut events = Vec::new();
                let duration = model.fleet.begin_step(worker, group, now, &mut events);
                self.deliver(&mut model, events);
                duration.map(|duration| (now, duration))
            };
            let Some((start, duration)) = step else {
                if let Some(notify) = self.wakes.get(worker).and_then(|groups| groups.get(group)) {
                    notify.notified().await;
                }
                continue;
            };
            tokio::time::sleep_until((self.clock + self.real(start + duration)).into()).await;
            let mut model = lock(&self.model);
            let mut events = Vec::new();
            model.fleet.end_step(worker, group, start + duration, &mut events);
            self.deliver(&mut model, events);
            carried = Some(start + duration);
        }
    }

    /// Hands model events to the requests they concern.
    fn deliver(self: &Arc<Self>, model: &mut Model, events: Vec<Event>) {
        for event in events {
            let Some(route) = model.routes.get_mut(&event.req) else {
                continue;
            };
            match event.kind {
                EventKind::Token {
                    count,
                    cached_tokens,
                    done,
                } => {
                    if done {
                        route.open = route.open.saturating_sub(1);
                        if route.open == 0 && !route.rooms.is_empty() {
                            // The decode leg may fetch the KV before the
                            // prefill's answer reaches the router.
                            if let Some(server) = self.servers.get(route.worker) {
                                server.mark_rooms_ready(&route.rooms, route.rank);
                            }
                        }
                    }
                    let _ = route.sender.send(Progress::Token {
                        seq: event.seq,
                        count,
                        cached: cached_tokens,
                    });
                    if done && route.open == 0 {
                        model.routes.remove(&event.req);
                    }
                }
                EventKind::Failed { message } => {
                    let _ = route.sender.send(Progress::Failed { status: 500, message });
                    model.routes.remove(&event.req);
                }
                EventKind::TransferStart => {
                    let bootstrap = route.bootstrap.clone();
                    let worker = route.worker;
                    tokio::spawn(self.clone().transfer_kv(worker, event.req, event.seq, bootstrap));
                }
                EventKind::Retracted => {}
            }
        }
    }

    /// Decode role: waits for the prefill's room, then lets the request
    /// decode (or fails it after --kv-wait-timeout-ms).
    async fn transfer_kv(
        self: Arc<Self>,
        worker: usize,
        req: ReqId,
        seq: usize,
        bootstrap: Option<Bootstrap>,
    ) {
        let outcome = match bootstrap {
            Some(bootstrap) => {
                self.wait_for_rooms(&bootstrap, || !lock(&self.model).routes.contains_key(&req))
                    .await
            }
            None => Err("no bootstrap fields".to_string()),
        };
        let wake = {
            let mut model = lock(&self.model);
            let mut events = Vec::new();
            let wake = model
                .fleet
                .transfer_done(self.now(), req, seq, outcome, &mut events);
            self.deliver(&mut model, events);
            wake
        };
        let (worker, group) = wake.unwrap_or((worker, 0));
        self.wake(worker, group);
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

    /// The loads of a server's ranks as its load endpoints report them:
    /// what each rank last published (live counts with --instant).
    pub fn snapshots(&self, worker: usize) -> Vec<RankSnapshot> {
        if self.config.instant {
            return self
                .servers
                .get(worker)
                .map(|server| lock(&server.instant).clone())
                .unwrap_or_default();
        }
        lock(&self.model).fleet.published(worker)
    }

    /// The load report of `worker` (`v1`: `/v1/loads`, else `/get_load`):
    /// every rank, or with `rank` that one alone (a rank port's report),
    /// `dp_rank` counted from the worker's start rank.
    pub fn loads_json(&self, worker: usize, rank: Option<usize>, extra_ranks: usize, v1: bool) -> Value {
        let mut base = self.servers[worker].control().base_tokens;
        let mut snapshots = self.snapshots(worker);
        let mut first_rank = self.config.start_rank(worker);
        if let Some(rank) = rank {
            snapshots = snapshots.get(rank).copied().into_iter().collect();
            base = base.get(rank).copied().into_iter().collect();
            first_rank += rank;
        }
        let view = LoadView {
            snapshots: &snapshots,
            base_tokens: &base,
            capacity: self.config.kv_capacity(),
            max_running: self.config.max_running(),
            with_total: !self.config.no_total_tokens,
            extra_ranks,
            first_rank,
            timestamp: SystemTime::now(),
        };
        if v1 {
            loads::v1_loads(&view)
        } else {
            loads::get_load(&view)
        }
    }

    /// The load report as `/get_load` shapes it.
    pub fn get_load_json(&self, worker: usize, extra_ranks: usize) -> Value {
        self.loads_json(worker, None, extra_ranks, false)
    }

    /// vLLM mode: the `/metrics` text of a server (what each engine last
    /// reported; the requests being answered with --instant), garbled as
    /// `fault` says.
    pub fn metrics_text(&self, worker: usize, fault: LoadFault) -> String {
        let mut stats: Vec<EngineStats> = if self.config.instant {
            self.snapshots(worker)
                .iter()
                .map(|load| EngineStats {
                    running: load.running,
                    ..EngineStats::default()
                })
                .collect()
        } else {
            lock(&self.model).fleet.engine_stats(worker)
        };
        if let Some(server) = self.servers.get(worker) {
            let base = lock(&server.control).base_waiting.clone();
            for (engine, extra) in stats.iter_mut().zip(base) {
                engine.waiting += extra;
            }
        }
        let garble = match fault {
            LoadFault::Nan => Garble::Nan,
            LoadFault::WrongLabels => Garble::WrongLabels,
            LoadFault::Huge => Garble::Huge,
            _ => Garble::None,
        };
        metrics::exposition(&MetricsView {
            stats: &stats,
            extra_engines: if fault == LoadFault::WrongDpSize { 2 } else { 0 },
            first_engine: self.config.start_rank(worker),
            model: &self.config.model,
            block_size: self.config.block_size(),
            num_gpu_blocks: self.config.num_gpu_blocks(),
            created: self.started_unix,
            multiprocess: self.config.api_servers() > 1,
            garble,
        })
    }

    /// The load report as `/v1/loads` shapes it.
    pub fn v1_loads_json(&self, worker: usize, extra_ranks: usize) -> Value {
        self.loads_json(worker, None, extra_ranks, true)
    }
}

impl Server {
    pub fn control(&self) -> Control {
        lock(&self.control).clone()
    }

    /// Applies a control update; `vllm` says whether the server is vLLM
    /// (whose `/metrics` alone takes the exposition faults).
    pub fn apply_control(&self, update: ControlUpdate, vllm: bool) -> Result<Control, String> {
        let dp_size = self.served.len();
        if !vllm
            && matches!(
                update.load_fault,
                Some(LoadFault::Nan | LoadFault::WrongLabels | LoadFault::Huge)
            )
        {
            return Err(
                "load_fault nan, wrong_labels and huge apply to vLLM's /metrics (--engine vllm)".into(),
            );
        }
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
        if let Some(base) = update.base_waiting {
            control.base_waiting = base;
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
        self.metrics_polls.store(0, Ordering::Relaxed);
        for served in &self.served {
            served.store(0, Ordering::Relaxed);
        }
    }

    pub fn record(&self, record: Record, limit: usize) -> Arc<Mutex<Record>> {
        let record = Arc::new(Mutex::new(record));
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

    pub fn count_metrics_poll(&self) {
        self.metrics_polls.fetch_add(1, Ordering::Relaxed);
    }

    pub fn count_load_poll(&self, v1: bool) {
        let counter = if v1 {
            &self.v1_loads_polls
        } else {
            &self.get_load_polls
        };
        counter.fetch_add(1, Ordering::Relaxed);
    }

    /// The counters; `vllm` adds the `/metrics` polls to the load requests.
    pub fn counters_json(&self, vllm: bool) -> Value {
        let read = |counters: &[AtomicU64]| {
            counters
                .iter()
                .map(|n| n.load(Ordering::Relaxed))
                .collect::<Vec<_>>()
        };
        let mut load_requests = json!({
            "/get_load": self.get_load_polls.load(Ordering::Relaxed),
            "/v1/loads": self.v1_loads_polls.load(Ordering::Relaxed),
        });
        if vllm {
            load_requests["/metrics"] = json!(self.metrics_polls.load(Ordering::Relaxed));
        }
        json!({
            "load_requests": load_requests,
            "served_per_rank": read(&self.served),
            "in_flight_per_rank": read(&self.in_flight),
        })
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
}
