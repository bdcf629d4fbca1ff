//! HTTP endpoints of a simulated worker.

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

use crate::config::{Role, SimConfig};
use crate::model::Event;
use crate::protocol::{self, Api, ParsedRequest, Rejection, ResponseShape};
use crate::worker::{lock, ControlUpdate, InstantGuard, LoadFault, Record, ServingFault, Worker};

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

/// Adds the worker name to every response, and rank -1 where none was set.
async fn tag_response(State(worker): State<Arc<Worker>>, request: Request, next: Next) -> Response {
    let mut response = next.run(request).await;
    let headers = response.headers_mut();
    if let Ok(value) = HeaderValue::from_str(&worker.name) {
        headers.insert(WORKER_HEADER, value);
    }
    if !headers.contains_key(RANK_HEADER) {
        headers.insert(RANK_HEADER, HeaderValue::from_static("-1"));
    }
    response
}

/// The main router of a worker.
pub fn router(worker: Arc<Worker>) -> Router {
    Router::new()
        .route("/health", get(|| async { StatusCode::OK }))
        .route("/health_generate", get(|| async { StatusCode::OK }))
        .route("/v1/models", get(models))
        .route("/server_info", get(server_info))
        .route("/get_server_info", get(server_info))
        .route("/model_info", get(model_info))
        .route("/get_model_info", get(model_info))
        .route("/get_load", get(get_load))
        .route("/v1/loads", get(v1_loads))
        .route("/generate", post(generate))
        .route("/v1/completions", post(completions))
        .route("/v1/chat/completions", post(chat))
        .route("/_sim/control", get(control_get).post(control_post))
        .route("/_sim/reset", post(reset))
        .route("/_sim/requests", get(requests))
        .route("/_sim/counters", get(counters))
        .route("/_sim/kv/{room}", get(kv_room))
        .fallback(not_found)
        // Prompts near the KV capacity are megabytes of JSON.
        .layer(DefaultBodyLimit::max(256 << 20))
        .layer(middleware::from_fn_with_state(worker.clone(), tag_response))
        .with_state(worker)
}

/// The router of the prefill bootstrap listener: only the KV rooms.
pub fn bootstrap_router(worker: Arc<Worker>) -> Router {
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

async fn models(State(worker): State<Arc<Worker>>) -> Response {
    let model = &worker.config.model;
    json_response(
        StatusCode::OK,
        &json!({"object": "list", "data": [{
            "id": model, "object": "model", "created": 0, "owned_by": "sglang",
            "root": model, "max_model_len": worker.config.kv_capacity,
        }]}),
    )
}

async fn server_info(State(worker): State<Arc<Worker>>) -> Response {
    let config = &worker.config;
    json_response(
        StatusCode::OK,
        &json!({
            "model_path": config.model,
            "tokenizer_path": config.model,
            "served_model_name": config.model,
            "dp_size": config.dp_size,
            // DP attention splits the TP group into the DP ranks.
            "tp_size": config.dp_size,
            "enable_dp_attention": true,
            "load_balance_method": match config.dispatch {
                crate::config::Dispatch::RoundRobin => "round_robin",
                crate::config::Dispatch::MinimumTokens => "minimum_tokens",
                crate::config::Dispatch::RoomModulo => "room_modulo",
            },
            "disaggregation_mode": config.role.disaggregation_mode(),
            "max_total_num_tokens": config.kv_capacity,
            "max_running_requests": config.max_running,
            "version": "sim",
            "status": "ready",
        }),
    )
}

async fn model_info(State(worker): State<Arc<Worker>>) -> Response {
    let model = &worker.config.model;
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

async fn get_load(State(worker): State<Arc<Worker>>) -> Response {
    worker.count_load_poll(false);
    load_response(&worker, false).await
}

async fn v1_loads(State(worker): State<Arc<Worker>>) -> Response {
    worker.count_load_poll(true);
    if worker.config.no_v1_loads {
        return not_found().await;
    }
    load_response(&worker, true).await
}

async fn load_response(worker: &Worker, v1: bool) -> Response {
    let report = |extra_ranks| {
        if v1 {
            worker.v1_loads_json(extra_ranks)
        } else {
            worker.get_load_json(extra_ranks)
        }
    };
    match worker.control().load_fault {
        LoadFault::None => json_response(StatusCode::OK, &report(0)),
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

async fn kv_room(State(worker): State<Arc<Worker>>, Path(room): Path<String>) -> Response {
    match room.parse::<u64>().ok().and_then(|room| worker.room_rank(room)) {
        Some(rank) => json_response(StatusCode::OK, &json!({"ready": true, "dp_rank": rank})),
        None => json_response(StatusCode::NOT_FOUND, &json!({"ready": false})),
    }
}

async fn control_get(State(worker): State<Arc<Worker>>) -> Response {
    json_response(StatusCode::OK, &json!(worker.control()))
}

fn parse_control(body: &[u8]) -> Result<ControlUpdate, String> {
    if body.iter().all(u8::is_ascii_whitespace) {
        return Ok(ControlUpdate::default());
    }
    serde_json::from_slice(body).map_err(|err| format!("invalid control body: {err}"))
}

async fn control_post(State(worker): State<Arc<Worker>>, body: Bytes) -> Response {
    match parse_control(&body).and_then(|update| worker.apply_control(update)) {
        Ok(control) => json_response(StatusCode::OK, &json!(control)),
        Err(message) => error_response(400, &message),
    }
}

async fn reset(State(worker): State<Arc<Worker>>, body: Bytes) -> Response {
    match parse_control(&body).and_then(|update| worker.apply_control(update)) {
        Ok(control) => {
            worker.reset();
            json_response(StatusCode::OK, &json!(control))
        }
        Err(message) => error_response(400, &message),
    }
}

async fn requests(State(worker): State<Arc<Worker>>) -> Response {
    json_response(StatusCode::OK, &worker.records_json())
}

async fn counters(State(worker): State<Arc<Worker>>) -> Response {
    json_response(StatusCode::OK, &worker.counters_json())
}

async fn generate(
    State(worker): State<Arc<Worker>>,
    method: Method,
    uri: Uri,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    serve(worker, Api::Generate, method, uri, headers, body).await
}

async fn completions(
    State(worker): State<Arc<Worker>>,
    method: Method,
    uri: Uri,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    serve(worker, Api::Completions, method, uri, headers, body).await
}

async fn chat(
    State(worker): State<Arc<Worker>>,
    method: Method,
    uri: Uri,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    serve(worker, Api::Chat, method, uri, headers, body).await
}

/// Records a serving request, answers it and notes where it went.
async fn serve(
    worker: Arc<Worker>,
    api: Api,
    method: Method,
    uri: Uri,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let record = worker.record(Record {
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
    });
    let control = worker.control();
    let (mut response, rank) = answer(&worker, api, &body, control.serving_fault).await;
    {
        let mut record = lock(&record);
        record.rank = rank;
        record.status = Some(response.status().as_u16());
    }
    log::debug!(
        "{} {} {} -> {} rank {:?}",
        worker.name,
        method,
        uri,
        response.status(),
        rank
    );
    if control.response_delay_ms > 0 {
        tokio::time::sleep(Duration::from_millis(control.response_delay_ms)).await;
    }
    let rank_value = rank.map_or_else(|| "-1".to_string(), |rank| rank.to_string());
    if let Ok(value) = HeaderValue::from_str(&rank_value) {
        response.headers_mut().insert(RANK_HEADER, value);
    }
    response
}

fn rejection_response(rejection: &Rejection) -> Response {
    error_response(rejection.status, &rejection.message)
}

static RESPONSE_IDS: AtomicU64 = AtomicU64::new(1);

async fn answer(
    worker: &Arc<Worker>,
    api: Api,
    body: &[u8],
    fault: ServingFault,
) -> (Response, Option<usize>) {
    if fault == ServingFault::Http500 {
        return (error_response(500, "injected serving fault"), None);
    }
    let config: &SimConfig = &worker.config;
    let request: ParsedRequest = match protocol::parse_request(api, body, config.role, config.dp_size) {
        Ok(request) => request,
        Err(rejection) => return (rejection_response(&rejection), None),
    };
    let admitted = match worker.submit(&request) {
        Ok(admitted) => admitted,
        Err(rejection) => return (rejection_response(&rejection), None),
    };
    let rank = admitted.rank;
    let prefix = match api {
        Api::Generate => "",
        Api::Completions => "cmpl-",
        Api::Chat => "chatcmpl-",
    };
    let shape = ResponseShape {
        api,
        id: format!("{prefix}sim{:x}", RESPONSE_IDS.fetch_add(1, Ordering::Relaxed)),
        model: request.model.clone().unwrap_or_else(|| config.model.clone()),
        created: unix_seconds(),
        prompt_tokens: request.prompt_tokens.clone(),
        max_new_tokens: admitted.max_new_tokens,
        batched: request.batched,
        include_usage: request.include_usage,
    };
    let started = Instant::now();
    let mut events = admitted.events;
    let first = match events.recv().await {
        Some(Event::Tokens(count)) => count,
        Some(Event::Failed { status, message }) => return (error_response(status, &message), Some(rank)),
        None => return (error_response(500, "the request was aborted"), Some(rank)),
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
            last: 0,
            chunks_sent: 0,
            close_mid_stream,
            abort_next: false,
            done: false,
            _instant_guard: admitted.instant_guard,
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
        let mut count = first;
        while count < shape.max_new_tokens {
            match events.recv().await {
                Some(Event::Tokens(next)) => count = next,
                Some(Event::Failed { status, message }) => {
                    return (error_response(status, &message), Some(rank))
                }
                None => return (error_response(500, "the request was aborted"), Some(rank)),
            }
        }
        drop(admitted.instant_guard);
        let text = shape.full(count, started.elapsed().as_secs_f64()).to_string();
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
    (response, Some(rank))
}

/// Fails a response body: hyper then drops the connection mid-message.
async fn injected_close() -> Result<Bytes, io::Error> {
    // Give hyper time to flush what was sent before, or the client would
    // see no response at all.
    tokio::time::sleep(Duration::from_millis(20)).await;
    Err(io::Error::other("injected close_mid_stream"))
}

struct StreamState {
    events: UnboundedReceiver<Event>,
    shape: ResponseShape,
    started: Instant,
    /// The first token, received before the headers were sent.
    first: Option<u64>,
    last: u64,
    chunks_sent: u32,
    close_mid_stream: bool,
    abort_next: bool,
    done: bool,
    _instant_guard: Option<InstantGuard>,
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
    let count = match state.first.take() {
        Some(count) => count,
        None => match state.events.recv().await {
            Some(Event::Tokens(count)) => count,
            Some(Event::Failed { message, .. }) => {
                state.done = true;
                return Some((
                    Ok(concat(vec![protocol::sse_error(&message), protocol::sse_done()])),
                    state,
                ));
            }
            None => {
                state.done = true;
                let chunk = if state.last < state.shape.max_new_tokens {
                    concat(vec![
                        protocol::sse_error("the request was aborted"),
                        protocol::sse_done(),
                    ])
                } else {
                    concat(state.shape.stream_tail(state.last))
                };
                return Some((Ok(chunk), state));
            }
        },
    };
    state.last = count;
    state.chunks_sent += 1;
    let mut parts = state
        .shape
        .stream_events(count, state.started.elapsed().as_secs_f64());
    let finished = count >= state.shape.max_new_tokens;
    if state.close_mid_stream && (finished || state.chunks_sent >= CHUNKS_BEFORE_CLOSE) {
        state.abort_next = true;
    } else if finished {
        parts.extend(state.shape.stream_tail(count));
        state.done = true;
    }
    Some((Ok(concat(parts)), state))
}

/// A running simulated worker; dropping it stops its listeners and ranks.
pub struct SimServer {
    pub addr: SocketAddr,
    pub bootstrap_addr: Option<SocketAddr>,
    pub worker: Arc<Worker>,
    tasks: Vec<JoinHandle<()>>,
}

async fn bind(addr: SocketAddr) -> Result<TcpListener, String> {
    TcpListener::bind(addr)
        .await
        .map_err(|err| format!("cannot listen on {addr}: {err}"))
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
    /// Binds the worker (and its bootstrap listener, if any) and starts
    /// its rank schedulers. Port 0 picks a free port.
    pub async fn start(
        config: Arc<SimConfig>,
        listen: SocketAddr,
        bootstrap: Option<SocketAddr>,
    ) -> Result<Self, String> {
        config.validate()?;
        let listener = bind(listen).await?;
        let addr = listener.local_addr().map_err(|err| err.to_string())?;
        let bootstrap_listener = match bootstrap {
            Some(bootstrap) => Some(bind(bootstrap).await?),
            None => None,
        };
        let bootstrap_addr = match &bootstrap_listener {
            Some(listener) => Some(listener.local_addr().map_err(|err| err.to_string())?),
            None => None,
        };
        let worker = Worker::new(config.clone(), addr.to_string())?;
        let mut tasks = Vec::new();
        if config.instant {
            // Nothing is scheduled.
        } else if config.lockstep {
            tasks.push(tokio::spawn(worker.clone().run_lockstep()));
        } else {
            for rank in 0..config.dp_size {
                tasks.push(tokio::spawn(worker.clone().run_rank(rank)));
            }
        }
        tasks.push(spawn_server(listener, router(worker.clone())));
        if let Some(listener) = bootstrap_listener {
            tasks.push(spawn_server(listener, bootstrap_router(worker.clone())));
        }
        Ok(Self {
            addr,
            bootstrap_addr,
            worker,
            tasks,
        })
    }

    /// The line printed once the worker is bound.
    pub fn ready_line(&self) -> String {
        let config = &self.worker.config;
        let mut line = format!(
            "ready {} role={} dp_size={}",
            self.addr,
            config.role.name(),
            config.dp_size
        );
        if let Some(bootstrap) = self.bootstrap_addr {
            line.push_str(&format!(" bootstrap={bootstrap}"));
        }
        line
    }

    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }
}

impl Drop for SimServer {
    fn drop(&mut self) {
        for task in &self.tasks {
            task.abort();
        }
    }
}
