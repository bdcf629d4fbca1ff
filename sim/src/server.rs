//! HTTP endpoints of a simulated worker, and its listeners: the main port
//! (or, SGLang `--rank-ports`, one port per rank), the prefill bootstrap
//! port and the whole-worker loads port (sim/README.md, "Deployment
//! layouts").

use std::io;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use axum::body::{Body, Bytes};
use axum::extract::{DefaultBodyLimit, Path, Request, State};
use axum::http::{header, HeaderMap, HeaderValue, Method, StatusCode, Uri};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::serve::ListenerExt;
use axum::Router;
use futures_util::{stream, StreamExt};
use serde_json::{json, Value};
use tokio::net::TcpListener;
use tokio::sync::mpsc::UnboundedReceiver;
use tokio::task::JoinHandle;

use crate::answers::AnswersUpdate;
use crate::config::{RankPortLoads, Role, SimConfig};
use crate::protocol::{self, Api, ParsedRequest, RankScope, Rejection, ResponseShape};
use crate::sync::lock;
use crate::worker::{ControlUpdate, LoadFault, Progress, Record, RequestGuard, Server, ServingFault, Shared};

const WORKER_HEADER: &str = "x-sim-worker";
const RANK_HEADER: &str = "x-sim-dp-rank";
/// Stream chunks sent before a `close_mid_stream` fault drops the connection.
const CHUNKS_BEFORE_CLOSE: u32 = 2;

fn json_response(status: StatusCode, value: &Value) -> Response {
    (
        status,
        [(header::CONTENT_TYPE, HeaderValue::from_static("application/json"))],
        value.to_string(),
    )
        .into_response()
}

fn error_response(status: u16, message: &str) -> Response {
    let code = StatusCode::from_u16(status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    json_response(code, &protocol::error_body(code.as_u16(), message))
}

fn unix_seconds() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |elapsed| elapsed.as_secs())
}

/// One server of the process, as the HTTP handlers of one of its ports
/// see it.
#[derive(Clone)]
pub struct Listener {
    pub shared: Arc<Shared>,
    pub index: usize,
    /// SGLang `--rank-ports`: the (local) rank this port serves.
    pub port_rank: Option<usize>,
}

impl Listener {
    fn server(&self) -> &Server {
        &self.shared.servers[self.index]
    }

    /// How a request arriving here names its rank.
    fn scope(&self) -> RankScope {
        RankScope {
            start_rank: self.shared.config.start_rank(self.index),
            port_rank: self.port_rank,
        }
    }

    /// What this port's load endpoints report: Some(None) every rank of
    /// the worker, Some(Some(r)) rank r alone, None nothing (404).
    fn loads_scope(&self) -> Option<Option<usize>> {
        let Some(rank) = self.port_rank else {
            return Some(None);
        };
        match self.shared.config.rank_port_loads {
            RankPortLoads::PerRank => Some(Some(rank)),
            RankPortLoads::Base => (rank == 0).then_some(None),
            RankPortLoads::None => None,
        }
    }
}

/// Adds the worker name to every response (the serving worker's, set by
/// the handler, else this one's), and rank -1 where none was set.
async fn tag_response(State(listener): State<Listener>, request: Request, next: Next) -> Response {
    let mut response = next.run(request).await;
    let headers = response.headers_mut();
    if !headers.contains_key(WORKER_HEADER) {
        if let Ok(value) = HeaderValue::from_str(&listener.server().name) {
            headers.insert(WORKER_HEADER, value);
        }
    }
    if !headers.contains_key(RANK_HEADER) {
        headers.insert(RANK_HEADER, HeaderValue::from_static("-1"));
    }
    response
}

/// The main router of a worker.
pub fn router(worker: Listener) -> Router {
    let engine_routes = if worker.shared.config.is_vllm() {
        vllm_routes()
    } else {
        sglang_routes()
    };
    Router::new()
        .route("/health", get(|| async { StatusCode::OK }))
        .route("/v1/models", get(models))
        .route("/v1/completions", post(completions))
        .route("/v1/chat/completions", post(chat))
        .route("/_sim/control", get(control_get).post(control_post))
        .route("/_sim/reset", post(reset))
        .route("/_sim/requests", get(requests))
        .route("/_sim/counters", get(counters))
        .route("/_sim/answers", get(answers_get).post(answers_post))
        .merge(engine_routes)
        .fallback(not_found)
        // Prompts near the KV capacity are megabytes of JSON.
        .layer(DefaultBodyLimit::max(256 << 20))
        .layer(middleware::from_fn_with_state(worker.clone(), tag_response))
        .with_state(worker)
}

/// SGLang's own endpoints, beside the OpenAI ones and the control API.
fn sglang_routes() -> Router<Listener> {
    Router::new()
        .route("/health_generate", get(|| async { StatusCode::OK }))
        .route("/server_info", get(server_info))
        .route("/get_server_info", get(server_info))
        .route("/model_info", get(model_info))
        .route("/get_model_info", get(model_info))
        .route("/get_load", get(get_load))
        .route("/v1/loads", get(v1_loads))
        .route("/generate", post(generate))
        .route("/_sim/kv/{room}", get(kv_room))
}

/// A vLLM server's own endpoints (`/metrics` among them); SGLang's
/// (`/generate`, `/get_load`, `/v1/loads`, `/server_info`, ...) answer 404
/// there.
fn vllm_routes() -> Router<Listener> {
    Router::new()
        .route("/ping", get(|| async { StatusCode::OK }))
        .route("/version", get(version))
        .route("/metrics", get(metrics))
}

async fn version(State(worker): State<Listener>) -> Response {
    json_response(
        StatusCode::OK,
        &json!({"version": worker.shared.config.vllm_version.name()}),
    )
}

/// vLLM's `/metrics`: the exposition of what each engine last reported.
async fn metrics(State(worker): State<Listener>) -> Response {
    worker.server().count_metrics_poll();
    let text = |fault| worker.shared.metrics_text(worker.index, fault);
    let plain = |body: String| {
        (
            StatusCode::OK,
            [(
                header::CONTENT_TYPE,
                HeaderValue::from_static("text/plain; version=0.0.4; charset=utf-8"),
            )],
            body,
        )
            .into_response()
    };
    match worker.server().control().load_fault {
        LoadFault::None => plain(text(LoadFault::None)),
        fault @ (LoadFault::WrongDpSize | LoadFault::Nan | LoadFault::WrongLabels | LoadFault::Huge) => {
            plain(text(fault))
        }
        LoadFault::Http500 => error_response(500, "injected load fault"),
        LoadFault::NotFound => not_found().await,
        LoadFault::Malformed => (
            StatusCode::OK,
            [(header::CONTENT_TYPE, HeaderValue::from_static("text/html"))],
            "<html><body>this is not the exposition</body></html>",
        )
            .into_response(),
        LoadFault::Truncated => {
            let mut body = text(LoadFault::None);
            let mut cut = body.len() / 2;
            while !body.is_char_boundary(cut) {
                cut -= 1;
            }
            body.truncate(cut);
            plain(body)
        }
        LoadFault::Hang => std::future::pending::<Response>().await,
    }
}

/// The router of a worker's loads listener (`--loads-port`): the load
/// endpoints for every rank of the worker, whatever `--rank-port-loads`
/// says.
pub fn loads_router(worker: Listener) -> Router {
    Router::new()
        .route("/health", get(|| async { StatusCode::OK }))
        .route("/get_load", get(get_load))
        .route("/v1/loads", get(v1_loads))
        .fallback(not_found)
        .layer(middleware::from_fn_with_state(worker.clone(), tag_response))
        .with_state(Listener {
            port_rank: None,
            ..worker
        })
}

/// The router of the prefill bootstrap listener: only the KV rooms.
pub fn bootstrap_router(worker: Listener) -> Router {
    Router::new()
        .route("/health", get(|| async { StatusCode::OK }))
        .route("/_sim/kv/{room}", get(kv_room))
        .fallback(not_found)
        .layer(middleware::from_fn_with_state(worker.clone(), tag_response))
        .with_state(worker)
}

async fn not_found() -> Response {
    error_response(404, "Not Found")
}

async fn models(State(worker): State<Listener>) -> Response {
    let config = &worker.shared.config;
    let model = &config.model;
    let owner = if config.is_vllm() { "vllm" } else { "sglang" };
    json_response(
        StatusCode::OK,
        &json!({"object": "list", "data": [{
            "id": model, "object": "model", "created": unix_seconds(), "owned_by": owner,
            "root": model, "parent": null, "max_model_len": config.kv_capacity(),
        }]}),
    )
}

async fn server_info(State(worker): State<Listener>) -> Response {
    let config = &worker.shared.config;
    json_response(
        StatusCode::OK,
        &json!({
            "model_path": config.model,
            "tokenizer_path": config.model,
            "served_model_name": config.model,
            "dp_size": config.dp_size(),
            // DP attention splits the TP group into the DP ranks; without
            // it each rank is a whole replica (one GPU in the presets).
            "tp_size": if config.dp_attention() { config.dp_size() } else { 1 },
            "enable_dp_attention": config.dp_attention(),
            "load_balance_method": config.dispatch().name(),
            "page_size": config.page_size,
            "chunked_prefill_size": config.chunked_prefill_size,
            "max_prefill_tokens": config.max_prefill_tokens,
            "schedule_policy": "fcfs",
            "schedule_conservativeness": config.schedule_conservativeness,
            "disable_radix_cache": config.prefix_cache == crate::config::Toggle::Off,
            "enable_cache_report": config.enable_cache_report,
            "disaggregation_mode": config.role.disaggregation_mode(),
            "max_total_num_tokens": config.kv_capacity(),
            "max_running_requests": config.max_running(),
            "version": "sim",
            "status": "ready",
        }),
    )
}

async fn model_info(State(worker): State<Listener>) -> Response {
    let model = &worker.shared.config.model;
    json_response(
        StatusCode::OK,
        &json!({
            "model_path": model, "tokenizer_path": model, "is_generation": true,
            "preferred_sampling_params": null, "weight_version": "default",
            "has_image_understanding": false, "has_audio_understanding": false,
            "model_type": "sim", "architectures": ["SimForCausalLM"],
        }),
    )
}

async fn get_load(State(worker): State<Listener>) -> Response {
    worker.server().count_load_poll(false);
    if worker.shared.config.is_vllm() {
        return not_found().await;
    }
    match worker.loads_scope() {
        Some(rank) => load_response(&worker, rank, false).await,
        None => not_found().await,
    }
}

async fn v1_loads(State(worker): State<Listener>) -> Response {
    worker.server().count_load_poll(true);
    if worker.shared.config.no_v1_loads {
        return not_found().await;
    }
    match worker.loads_scope() {
        Some(rank) => load_response(&worker, rank, true).await,
        None => not_found().await,
    }
}

/// A load report: every rank of the worker, or `rank` alone.
async fn load_response(worker: &Listener, rank: Option<usize>, v1: bool) -> Response {
    let report = |extra_ranks| worker.shared.loads_json(worker.index, rank, extra_ranks, v1);
    match worker.server().control().load_fault {
        LoadFault::None | LoadFault::Nan | LoadFault::WrongLabels | LoadFault::Huge => {
            json_response(StatusCode::OK, &report(0))
        }
        LoadFault::WrongDpSize => json_response(StatusCode::OK, &report(2)),
        LoadFault::Http500 => error_response(500, "injected load fault"),
        LoadFault::NotFound => not_found().await,
        LoadFault::Malformed => (
            StatusCode::OK,
            [(header::CONTENT_TYPE, HeaderValue::from_static("application/json"))],
            "<html>this is not JSON",
        )
            .into_response(),
        LoadFault::Truncated => {
            let mut text = report(0).to_string();
            text.truncate(text.len() / 2);
            (
                StatusCode::OK,
                [(header::CONTENT_TYPE, HeaderValue::from_static("application/json"))],
                text,
            )
                .into_response()
        }
        // Never answers; the connection stays open until the client leaves.
        LoadFault::Hang => std::future::pending::<Response>().await,
    }
}

async fn kv_room(State(worker): State<Listener>, Path(room): Path<String>) -> Response {
    match room
        .parse::<u64>()
        .ok()
        .and_then(|room| worker.server().room_rank(room))
    {
        Some(rank) => json_response(StatusCode::OK, &json!({"ready": true, "dp_rank": rank})),
        None => json_response(StatusCode::NOT_FOUND, &json!({"ready": false})),
    }
}

async fn control_get(State(worker): State<Listener>) -> Response {
    json_response(StatusCode::OK, &json!(worker.server().control()))
}

fn parse_control(body: &[u8]) -> Result<ControlUpdate, String> {
    if body.iter().all(u8::is_ascii_whitespace) {
        return Ok(ControlUpdate::default());
    }
    serde_json::from_slice(body).map_err(|err| format!("invalid control body: {err}"))
}

async fn control_post(State(worker): State<Listener>, body: Bytes) -> Response {
    match parse_control(&body).and_then(|update| {
        worker
            .server()
            .apply_control(update, worker.shared.config.is_vllm())
    }) {
        Ok(control) => json_response(StatusCode::OK, &json!(control)),
        Err(message) => error_response(400, &message),
    }
}

async fn reset(State(worker): State<Listener>, body: Bytes) -> Response {
    match parse_control(&body).and_then(|update| {
        worker
            .server()
            .apply_control(update, worker.shared.config.is_vllm())
    }) {
        Ok(control) => {
            worker.server().reset();
            json_response(StatusCode::OK, &json!(control))
        }
        Err(message) => error_response(400, &message),
    }
}

async fn answers_get(State(worker): State<Listener>) -> Response {
    json_response(StatusCode::OK, &json!({"tags": worker.shared.answers.len()}))
}

/// Answer lengths by prompt tag, for every worker of the process.
async fn answers_post(State(worker): State<Listener>, body: Bytes) -> Response {
    let update = serde_json::from_slice::<AnswersUpdate>(&body)
        .map_err(|err| format!("invalid answers body: {err}"))
        .and_then(|update| worker.shared.answers.apply(update));
    match update {
        Ok(tags) => json_response(StatusCode::OK, &json!({"tags": tags})),
        Err(message) => error_response(400, &message),
    }
}

async fn requests(State(worker): State<Listener>) -> Response {
    json_response(StatusCode::OK, &worker.server().records_json())
}

async fn counters(State(worker): State<Listener>) -> Response {
    json_response(
        StatusCode::OK,
        &worker.server().counters_json(worker.shared.config.is_vllm()),
    )
}

async fn generate(
    State(worker): State<Listener>,
    method: Method,
    uri: Uri,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    serve(worker, Api::Generate, method, uri, headers, body).await
}

async fn completions(
    State(worker): State<Listener>,
    method: Method,
    uri: Uri,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    serve(worker, Api::Completions, method, uri, headers, body).await
}

async fn chat(
    State(worker): State<Listener>,
    method: Method,
    uri: Uri,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    serve(worker, Api::Chat, method, uri, headers, body).await
}

/// Records a serving request, answers it and notes where it went.
async fn serve(
    worker: Listener,
    api: Api,
    method: Method,
    uri: Uri,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let server = worker.server();
    let record = server.record(
        Record {
            path: uri.path().to_string(),
            query: uri.query().map(str::to_string),
            method: method.to_string(),
            headers: headers
                .iter()
                .map(|(name, value)| {
                    (
                        name.as_str().to_string(),
                        String::from_utf8_lossy(value.as_bytes()).into_owned(),
                    )
                })
                .collect(),
            body: body.clone(),
            rank: None,
            status: None,
        },
        worker.shared.config.record_limit,
    );
    let control = server.control();
    let (mut response, served) = answer(&worker, api, &headers, &body, control.serving_fault).await;
    // Recordings and `x-sim-dp-rank` name the global rank.
    let rank = served.map(|(serving, rank)| worker.shared.config.global_rank(serving, rank));
    {
        let mut record = lock(&record);
        record.rank = rank;
        record.status = Some(response.status().as_u16());
    }
    log::debug!(
        "{} {} {} -> {} {:?}",
        server.name,
        method,
        uri,
        response.status(),
        served
    );
    if control.response_delay_ms > 0 {
        tokio::time::sleep(Duration::from_millis(control.response_delay_ms)).await;
    }
    let rank_value = rank.map_or_else(|| "-1".to_string(), |rank| rank.to_string());
    if let Ok(value) = HeaderValue::from_str(&rank_value) {
        response.headers_mut().insert(RANK_HEADER, value);
    }
    if let Some(name) = served.and_then(|(worker_index, _)| worker.shared.servers.get(worker_index)) {
        if let Ok(value) = HeaderValue::from_str(&name.name) {
            response.headers_mut().insert(WORKER_HEADER, value);
        }
    }
    response
}

fn rejection_response(rejection: &Rejection) -> Response {
    if rejection.in_stream {
        let body = concat(vec![
            protocol::sse_error_status(rejection.status, &rejection.message),
            protocol::sse_done(),
        ]);
        return (
            StatusCode::OK,
            [(
                header::CONTENT_TYPE,
                HeaderValue::from_static("text/event-stream"),
            )],
            body,
        )
            .into_response();
    }
    let code = StatusCode::from_u16(rejection.status).unwrap_or(StatusCode::BAD_REQUEST);
    json_response(code, &rejection.json())
}

static RESPONSE_IDS: AtomicU64 = AtomicU64::new(1);

/// Answers a serving request; also says which (worker, rank) served it.
async fn answer(
    listener: &Listener,
    api: Api,
    headers: &HeaderMap,
    body: &[u8],
    fault: ServingFault,
) -> (Response, Option<(usize, usize)>) {
    if fault == ServingFault::Http500 {
        return (error_response(500, "injected serving fault"), None);
    }
    let shared = &listener.shared;
    let config = &shared.config;
    let request: ParsedRequest =
        match protocol::parse_request_at(api, body, headers, config, &listener.scope()) {
            Ok(request) => request,
            Err(rejection) => return (rejection_response(&rejection), None),
        };
    let admitted = match shared.submit(listener.index, &request) {
        Ok(admitted) => admitted,
        Err(rejection) => return (rejection_response(&rejection), None),
    };
    let mut guard = admitted.guard;
    let mut events = admitted.events;
    if !config.instant {
        // The tokenizer's time.
        tokio::time::sleep_until(admitted.ready.into()).await;
        shared.dispatch_due(admitted.ready);
    }
    let served = match events.recv().await {
        Some(Progress::Placed { worker, rank }) => {
            guard.placed(worker, rank);
            (worker, rank)
        }
        Some(Progress::Failed { status, message }) => return (error_response(status, &message), None),
        _ => return (error_response(500, "the request was aborted"), None),
    };
    let prefix = match api {
        Api::Generate => "",
        Api::Completions => "cmpl-",
        Api::Chat => "chatcmpl-",
    };
    let sequences = request.prompts.len().max(1);
    let mut shape = ResponseShape {
        api,
        id: format!("{prefix}sim{:x}", RESPONSE_IDS.fetch_add(1, Ordering::Relaxed)),
        model: request.model.clone().unwrap_or_else(|| config.model.clone()),
        created: unix_seconds(),
        prompt_tokens: request.prompts.iter().map(|prompt| prompt.len() as u64).collect(),
        max_new_tokens: admitted.max_new_tokens,
        stops: admitted.stops.clone(),
        batched: request.batched,
        include_usage: request.include_usage,
        cache_report: config.enable_cache_report,
        cached_only_when_hit: config.is_vllm(),
        counts: vec![0; sequences],
        cached: vec![0; sequences],
    };
    let started = Instant::now();
    let first = match events.recv().await {
        Some(Progress::Token { seq, count, cached }) => {
            shape.record(seq, count, cached);
            seq
        }
        Some(Progress::Failed { status, message }) => {
            return (error_response(status, &message), Some(served))
        }
        _ => return (error_response(500, "the request was aborted"), Some(served)),
    };
    let close_mid_stream = fault == ServingFault::CloseMidStream;
    // A prefill worker answers with one short JSON body, what the router drains.
    let streamed = request.stream && config.role != Role::Prefill;
    let response = if streamed {
        let state = StreamState {
            events,
            shape,
            started,
            first: Some(first),
            chunks_sent: 0,
            close_mid_stream,
            abort_next: false,
            done: false,
            _guard: guard,
        };
        let body = Body::from_stream(stream::unfold(state, next_stream_chunk));
        (
            StatusCode::OK,
            [
                (
                    header::CONTENT_TYPE,
                    HeaderValue::from_static("text/event-stream"),
                ),
                (header::CACHE_CONTROL, HeaderValue::from_static("no-cache")),
            ],
            body,
        )
            .into_response()
    } else {
        while !shape.done() {
            match events.recv().await {
                Some(Progress::Token { seq, count, cached }) => shape.record(seq, count, cached),
                Some(Progress::Failed { status, message }) => {
                    return (error_response(status, &message), Some(served))
                }
                Some(Progress::Placed { .. }) => {}
                None => return (error_response(500, "the request was aborted"), Some(served)),
            }
        }
        drop(guard);
        let text = shape.full(started.elapsed().as_secs_f64()).to_string();
        if close_mid_stream {
            let whole = Bytes::from(text.into_bytes());
            let half = whole.slice(0..whole.len() / 2);
            let parts = stream::once(async move { Ok::<Bytes, io::Error>(half) })
                .chain(stream::once(injected_close()));
            (
                StatusCode::OK,
                [(header::CONTENT_TYPE, HeaderValue::from_static("application/json"))],
                Body::from_stream(parts),
            )
                .into_response()
        } else {
            (
                StatusCode::OK,
                [(header::CONTENT_TYPE, HeaderValue::from_static("application/json"))],
                text,
            )
                .into_response()
        }
    };
    (response, Some(served))
}

/// Fails a response body: hyper then drops the connection mid-message.
async fn injected_close() -> Result<Bytes, io::Error> {
    // Give hyper time to flush what was sent before, or the client would
    // see no response at all.
    tokio::time::sleep(Duration::from_millis(20)).await;
    Err(io::Error::other("injected close_mid_stream"))
}

struct StreamState {
    events: UnboundedReceiver<Progress>,
    shape: ResponseShape,
    started: Instant,
    /// The sequence of the first token, received before the headers.
    first: Option<usize>,
    chunks_sent: u32,
    close_mid_stream: bool,
    abort_next: bool,
    done: bool,
    _guard: RequestGuard,
}

fn concat(parts: Vec<Bytes>) -> Bytes {
    let mut joined = Vec::with_capacity(parts.iter().map(Bytes::len).sum());
    for part in parts {
        joined.extend_from_slice(&part);
    }
    Bytes::from(joined)
}

async fn next_stream_chunk(mut state: StreamState) -> Option<(Result<Bytes, io::Error>, StreamState)> {
    if state.done {
        return None;
    }
    if state.abort_next {
        state.done = true;
        return Some((injected_close().await, state));
    }
    let seq = match state.first.take() {
        Some(seq) => seq,
        None => loop {
            match state.events.recv().await {
                Some(Progress::Token { seq, count, cached }) => {
                    state.shape.record(seq, count, cached);
                    break seq;
                }
                Some(Progress::Placed { .. }) => continue,
                Some(Progress::Failed { message, .. }) => {
                    state.done = true;
                    return Some((
                        Ok(concat(vec![protocol::sse_error(&message), protocol::sse_done()])),
                        state,
                    ));
                }
                None => {
                    state.done = true;
                    let chunk = if state.shape.done() {
                        concat(state.shape.stream_tail())
                    } else {
                        concat(vec![
                            protocol::sse_error("the request was aborted"),
                            protocol::sse_done(),
                        ])
                    };
                    return Some((Ok(chunk), state));
                }
            }
        },
    };
    state.chunks_sent += 1;
    let mut parts = vec![state
        .shape
        .stream_event(seq, state.started.elapsed().as_secs_f64())];
    let finished = state.shape.done();
    if state.close_mid_stream && (finished || state.chunks_sent >= CHUNKS_BEFORE_CLOSE) {
        state.abort_next = true;
    } else if finished {
        parts.extend(state.shape.stream_tail());
        state.done = true;
    }
    Some((Ok(concat(parts)), state))
}

/// Aborts the tasks it holds when dropped.
struct Tasks(Vec<JoinHandle<()>>);

impl Drop for Tasks {
    fn drop(&mut self) {
        for task in &self.0 {
            task.abort();
        }
    }
}

/// A running simulated worker; dropping every worker of a fleet stops the
/// model's tasks, dropping one stops its listeners.
pub struct SimServer {
    /// The main port (SGLang `--rank-ports`: rank 0's, the base port).
    pub addr: SocketAddr,
    pub bootstrap_addr: Option<SocketAddr>,
    /// SGLang `--rank-ports`: the port of each rank, in rank order
    /// (`addr` first); empty otherwise.
    pub rank_addrs: Vec<SocketAddr>,
    /// `--loads-port`: the listener answering the whole worker's loads.
    pub loads_addr: Option<SocketAddr>,
    pub shared: Arc<Shared>,
    pub index: usize,
    _listeners: Tasks,
    _model: Arc<Tasks>,
}

/// Where one worker listens: its main address (with `--rank-ports`, the
/// base port: rank r listens on its port + r), and the optional prefill
/// bootstrap and loads listeners. Port 0 picks free ports (with
/// `--rank-ports`, a free run of consecutive ones).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WorkerAddrs {
    pub listen: SocketAddr,
    pub bootstrap: Option<SocketAddr>,
    pub loads: Option<SocketAddr>,
}

impl WorkerAddrs {
    pub fn new(listen: SocketAddr) -> Self {
        Self {
            listen,
            bootstrap: None,
            loads: None,
        }
    }
}

async fn bind(addr: SocketAddr) -> Result<TcpListener, String> {
    TcpListener::bind(addr)
        .await
        .map_err(|err| format!("cannot listen on {addr}: {err}"))
}

fn local_addr(listener: &TcpListener) -> Result<SocketAddr, String> {
    listener.local_addr().map_err(|err| err.to_string())
}

/// Attempts at finding a free run of consecutive ports for `--rank-ports`
/// on port 0.
const RANK_PORT_ATTEMPTS: usize = 64;

/// The listeners of `count` rank ports: `base`, `base + 1`, ... (on port 0,
/// the first free run found).
async fn bind_rank_ports(base: SocketAddr, count: usize) -> Result<Vec<TcpListener>, String> {
    let consecutive = |first: SocketAddr, listener: TcpListener| async move {
        let mut listeners = vec![listener];
        for offset in 1..count {
            let port = u16::try_from(usize::from(first.port()) + offset)
                .map_err(|_| format!("rank port {} + {offset} is beyond 65535", first.port()))?;
            listeners.push(bind(SocketAddr::new(first.ip(), port)).await?);
        }
        Ok::<_, String>(listeners)
    };
    if base.port() != 0 {
        return consecutive(base, bind(base).await?).await;
    }
    let mut last_error = String::new();
    for _ in 0..RANK_PORT_ATTEMPTS {
        let first = bind(base).await?;
        let addr = local_addr(&first)?;
        match consecutive(addr, first).await {
            Ok(listeners) => return Ok(listeners),
            Err(err) => last_error = err,
        }
    }
    Err(format!(
        "no run of {count} free consecutive ports found on {} ({last_error})",
        base.ip()
    ))
}

/// The bound listeners of one worker, before the model starts.
struct BoundWorker {
    /// One, or one per rank with `--rank-ports` (rank 0's first).
    main: Vec<TcpListener>,
    addrs: Vec<SocketAddr>,
    bootstrap: Option<(TcpListener, SocketAddr)>,
    loads: Option<(TcpListener, SocketAddr)>,
}

async fn bind_optional(addr: Option<SocketAddr>) -> Result<Option<(TcpListener, SocketAddr)>, String> {
    match addr {
        Some(addr) => {
            let listener = bind(addr).await?;
            let addr = local_addr(&listener)?;
            Ok(Some((listener, addr)))
        }
        None => Ok(None),
    }
}

fn spawn_server(listener: TcpListener, app: Router) -> JoinHandle<()> {
    // Nagle + delayed ACK would add 40 ms stalls to small responses.
    let listener = listener.tap_io(|tcp| {
        let _ = tcp.set_nodelay(true);
    });
    tokio::spawn(async move {
        if let Err(err) = axum::serve(listener, app).await {
            log::error!("server stopped: {err}");
        }
    })
}

impl SimServer {
    /// One worker (and its bootstrap listener, if any), a fleet of one.
    /// Port 0 picks a free port.
    pub async fn start(
        config: Arc<SimConfig>,
        listen: SocketAddr,
        bootstrap: Option<SocketAddr>,
    ) -> Result<Self, String> {
        let mut servers = Self::start_fleet(config, &[(listen, bootstrap)]).await?;
        servers.pop().ok_or_else(|| "no worker started".to_string())
    }

    /// Workers sharing one model (the oracle dispatch chooses among them),
    /// each with its listener and optional bootstrap listener.
    pub async fn start_fleet(
        config: Arc<SimConfig>,
        listeners: &[(SocketAddr, Option<SocketAddr>)],
    ) -> Result<Vec<Self>, String> {
        let workers: Vec<WorkerAddrs> = listeners
            .iter()
            .map(|(listen, bootstrap)| WorkerAddrs {
                bootstrap: *bootstrap,
                ..WorkerAddrs::new(*listen)
            })
            .collect();
        Self::start_workers(config, &workers).await
    }

    /// Workers sharing one model, each listening where its [`WorkerAddrs`]
    /// say.
    pub async fn start_workers(config: Arc<SimConfig>, workers: &[WorkerAddrs]) -> Result<Vec<Self>, String> {
        config.validate()?;
        config.validate_workers(workers.len())?;
        if config.is_vllm() && workers.iter().any(|worker| worker.loads.is_some()) {
            return Err("--loads-port is SGLang's (vLLM publishes its loads on /metrics)".into());
        }
        let mut bound = Vec::new();
        for worker in workers {
            let main = if config.rank_ports {
                bind_rank_ports(worker.listen, config.dp_size()).await?
            } else {
                vec![bind(worker.listen).await?]
            };
            let addrs = main.iter().map(local_addr).collect::<Result<Vec<_>, _>>()?;
            bound.push(BoundWorker {
                main,
                addrs,
                bootstrap: bind_optional(worker.bootstrap).await?,
                loads: bind_optional(worker.loads).await?,
            });
        }
        let names = bound.iter().map(|worker| worker.addrs[0].to_string()).collect();
        let shared = Shared::new(config.clone(), names)?;
        let model = if config.instant {
            Arc::new(Tasks(Vec::new()))
        } else {
            Arc::new(Tasks(
                shared
                    .groups()
                    .into_iter()
                    .map(|(worker, group)| tokio::spawn(shared.clone().run_group(worker, group)))
                    .collect(),
            ))
        };
        let mut servers = Vec::new();
        for (index, worker) in bound.into_iter().enumerate() {
            let handle = Listener {
                shared: shared.clone(),
                index,
                port_rank: None,
            };
            let mut tasks = Vec::new();
            for (rank, listener) in worker.main.into_iter().enumerate() {
                let port = Listener {
                    port_rank: config.rank_ports.then_some(rank),
                    ..handle.clone()
                };
                tasks.push(spawn_server(listener, router(port)));
            }
            let bootstrap_addr = worker.bootstrap.map(|(listener, addr)| {
                tasks.push(spawn_server(listener, bootstrap_router(handle.clone())));
                addr
            });
            let loads_addr = worker.loads.map(|(listener, addr)| {
                tasks.push(spawn_server(listener, loads_router(handle.clone())));
                addr
            });
            servers.push(Self {
                addr: worker.addrs[0],
                bootstrap_addr,
                rank_addrs: if config.rank_ports {
                    worker.addrs
                } else {
                    Vec::new()
                },
                loads_addr,
                shared: shared.clone(),
                index,
                _listeners: Tasks(tasks),
                _model: model.clone(),
            });
        }
        Ok(servers)
    }

    /// The line printed once the worker is bound: `ready <addr> role=..
    /// dp_size=..`, then what differs from the defaults, every port among
    /// it.
    pub fn ready_line(&self) -> String {
        let config = &self.shared.config;
        let mut line = format!(
            "ready {} role={} dp_size={}",
            self.addr,
            config.role.name(),
            config.dp_size()
        );
        if let Some(bootstrap) = self.bootstrap_addr {
            line.push_str(&format!(" bootstrap={bootstrap}"));
        }
        if config.is_vllm() {
            line.push_str(&format!(" engine=vllm-{}", config.vllm_version.name()));
        }
        let start = config.start_rank(self.index);
        if start != 0 {
            line.push_str(&format!(" dp_start_rank={start}"));
        }
        if config.is_vllm() && config.vllm_frontend != crate::config::VllmFrontend::Python {
            line.push_str(&format!(" frontend={}", config.vllm_frontend.name()));
        }
        if !self.rank_addrs.is_empty() {
            let ports: Vec<String> = self.rank_addrs.iter().map(ToString::to_string).collect();
            line.push_str(&format!(" rank_ports={}", ports.join(",")));
        }
        if let Some(loads) = self.loads_addr {
            line.push_str(&format!(" loads={loads}"));
        }
        line
    }

    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// SGLang `--rank-ports`: the URL of rank `rank`'s port (local index).
    pub fn rank_url(&self, rank: usize) -> Option<String> {
        self.rank_addrs.get(rank).map(|addr| format!("http://{addr}"))
    }
}
