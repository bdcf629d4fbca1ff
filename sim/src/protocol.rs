//! SGLang / vLLM / OpenAI request parsing and response shapes.

use axum::http::HeaderMap;
use bytes::Bytes;
use serde_json::{json, Map, Value};

use crate::config::{RankHeader, Role, SimConfig, VllmFrontend, VllmVersion};
use crate::output::{text_upto, token_text};
use crate::{answers, chat, tokenizer};

/// Largest number of output tokens one sequence may ask for.
pub const MAX_NEW_TOKENS_LIMIT: u64 = 4096;
/// Output tokens when the request names none.
pub const DEFAULT_MAX_NEW_TOKENS: u64 = 16;

/// The serving endpoint a request came in on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Api {
    Generate,
    Completions,
    Chat,
}

/// PD bootstrap fields of one request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Bootstrap {
    pub host: String,
    pub port: Option<u16>,
    pub rooms: Vec<u64>,
}

/// Everything the simulator needs from a serving request.
#[derive(Debug, Clone)]
pub struct ParsedRequest {
    pub api: Api,
    /// Token ids of each prompt (more than one for batched input).
    pub prompts: Vec<Vec<u32>>,
    /// The prompts were token ids: nothing to tokenize.
    pub pretokenized: bool,
    /// The input was a list of prompts (answers are then lists too).
    pub batched: bool,
    pub max_new_tokens: u64,
    /// The answer tag of each prompt's text ([`crate::answers`]), in order.
    pub answer_tags: Vec<Option<String>>,
    pub stream: bool,
    pub include_usage: bool,
    /// The rank the caller asked for, if any.
    pub rank: Option<usize>,
    /// SGLang's `priority` (body field, or `x-override-priority` when header
    /// overrides are on); only priority scheduling reads it.
    pub priority: Option<i64>,
    pub bootstrap: Option<Bootstrap>,
    pub model: Option<String>,
}

/// A request the simulator refuses, with the HTTP status to answer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Rejection {
    pub status: u16,
    pub message: String,
    /// Answered as a stream: 200, one SSE error event, then `[DONE]` (how
    /// vLLM 0.34 refuses an out-of-range rank on a streamed request).
    pub in_stream: bool,
    /// The JSON error body, when not [`error_body`]'s (vLLM's Rust frontend
    /// words its errors its own way).
    pub body: Option<Value>,
}

impl Rejection {
    /// The JSON body answered.
    pub fn json(&self) -> Value {
        self.body
            .clone()
            .unwrap_or_else(|| error_body(self.status, &self.message))
    }
}

fn bad_request(message: impl Into<String>) -> Rejection {
    Rejection {
        status: 400,
        message: message.into(),
        in_stream: false,
        body: None,
    }
}

/// Where a serving request arrived, as far as its rank goes: the global
/// rank of the worker's first rank, and the rank a rank port serves.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RankScope {
    /// The global rank of the worker's rank 0 (`--dp-start-rank`).
    pub start_rank: usize,
    /// SGLang `--rank-ports`: the (local) rank the port serves; rank fields
    /// and headers are then checked for their type only and ignored.
    pub port_rank: Option<usize>,
}

/// Python's `int(text)` on a header value: surrounding whitespace, an
/// optional sign, decimal digits with single underscores between them
/// (`" 1 "`, `"+1"`, `"1_0"`); None for anything else. Header bytes are
/// read as Latin-1, as the ASGI server hands them over. A number beyond
/// i128 saturates (it is out of any range all the same).
pub fn python_int(bytes: &[u8]) -> Option<i128> {
    let is_space = |b: &u8| {
        matches!(
            b,
            b' ' | b'\t' | b'\n' | 0x0b | 0x0c | b'\r' | 0x1c..=0x1f | 0x85 | 0xa0
        )
    };
    let start = bytes.iter().position(|b| !is_space(b))?;
    let end = bytes.iter().rposition(|b| !is_space(b))? + 1;
    let text = &bytes[start..end];
    let (negative, digits) = match text.first() {
        Some(b'-') => (true, &text[1..]),
        Some(b'+') => (false, &text[1..]),
        _ => (false, text),
    };
    let mut value: i128 = 0;
    let mut previous_digit = false;
    for byte in digits {
        match byte {
            b'0'..=b'9' => {
                value = value.saturating_mul(10).saturating_add(i128::from(byte - b'0'));
                previous_digit = true;
            }
            b'_' if previous_digit => previous_digit = false,
            _ => return None,
        }
    }
    if !previous_digit {
        return None;
    }
    Some(if negative { -value } else { value })
}

/// vLLM's Rust frontend's reading of a header value
/// (`process_common_headers`): visible ASCII (`HeaderValue::to_str`),
/// trimmed, parsed as a `u32` (`"+1"` is 1; `"-1"`, `"1_0"`, `"1.0"` and
/// numbers beyond `u32` are not ranks).
pub fn rust_u32(value: &axum::http::HeaderValue) -> Option<u32> {
    value.to_str().ok()?.trim().parse().ok()
}

/// vLLM: the (local) engine `X-data-parallel-rank` pins, or None for vLLM's
/// own balancer. Python frontend (`_get_data_parallel_rank`, then
/// `InputProcessor.process_inputs`): first value, Python `int()`, not an
/// integer = no rank, a local index that must lie in `[0, N)`. Rust frontend
/// (`process_common_headers`, then `choose_engine_for_request`): `u32`, not
/// one = no rank, the global rank of one of the server's engines `S..S+N`.
fn vllm_rank(
    headers: &HeaderMap,
    config: &SimConfig,
    scope: &RankScope,
    stream: bool,
) -> Result<Option<usize>, Rejection> {
    let Some(value) = headers.get("x-data-parallel-rank") else {
        return Ok(None);
    };
    let engines = config.dp_size();
    match config.vllm_frontend {
        VllmFrontend::Python => {
            let Some(rank) = python_int(value.as_bytes()) else {
                return Ok(None);
            };
            if rank < 0 || rank >= engines as i128 {
                return Err(Rejection {
                    status: 400,
                    message: format!("data_parallel_rank {rank} is out of range [0, {engines})."),
                    in_stream: stream && config.vllm_version == VllmVersion::V0_34,
                    body: None,
                });
            }
            Ok(Some(rank as usize))
        }
        VllmFrontend::Rust => {
            let Some(rank) = rust_u32(value) else {
                return Ok(None);
            };
            let local = (rank as usize).checked_sub(scope.start_rank);
            match local.filter(|local| *local < engines) {
                Some(local) => Ok(Some(local)),
                None => Err(rust_frontend_rank_error(rank, engines)),
            }
        }
    }
}

/// The Rust frontend's answer to a rank none of its engines has: 400
/// before any streaming (`Error::InvalidDataParallelRank`, a request
/// validation error, rendered by `ApiError::InvalidRequest`).
fn rust_frontend_rank_error(rank: u32, engines: usize) -> Rejection {
    let message = format!("data parallel rank {rank} is out of range for {engines} engine(s)");
    Rejection {
        status: 400,
        body: Some(json!({"error": {
            "message": message,
            "type": "invalid_request_error",
            "param": null,
            "code": "invalid_request_error",
        }})),
        message,
        in_stream: false,
    }
}

/// The tokens of a text prompt; an empty prompt still counts one token.
pub fn text_tokens(text: &str) -> Vec<u32> {
    let tokens = tokenizer::tokens(text);
    if tokens.is_empty() {
        vec![tokenizer::token_id(b"")]
    } else {
        tokens
    }
}

/// Token ids given as JSON numbers, taken as they are.
fn id_tokens(ids: &[Value]) -> Vec<u32> {
    let mut tokens: Vec<u32> = ids
        .iter()
        .map(|id| {
            id.as_u64()
                .or_else(|| id.as_i64().map(|v| v as u64))
                .unwrap_or_else(|| id.as_f64().unwrap_or(0.0) as u64) as u32
        })
        .collect();
    if tokens.is_empty() {
        tokens.push(tokenizer::token_id(b""));
    }
    tokens
}

/// Rank fields in the order they are honoured, by role.
fn rank_fields(role: Role) -> &'static [&'static str] {
    match role {
        Role::Decode => &["routed_dp_rank", "decode_dp_rank", "data_parallel_rank"],
        Role::Regular | Role::Prefill => &["routed_dp_rank", "data_parallel_rank"],
    }
}

/// A rank in `[0, dp_size)`; with no `dp_size` (a rank port, which ignores
/// the value) any integer passes.
fn check_range(name: &str, rank: i64, dp_size: Option<usize>) -> Result<usize, Rejection> {
    let Some(dp_size) = dp_size else {
        return Ok(rank.max(0) as usize);
    };
    if rank < 0 || rank as u64 >= dp_size as u64 {
        return Err(bad_request(format!(
            "{name}={rank} is out of range [0, {dp_size})"
        )));
    }
    Ok(rank as usize)
}

fn parse_rank(
    body: &Map<String, Value>,
    role: Role,
    dp_size: Option<usize>,
) -> Result<Option<usize>, Rejection> {
    let mut chosen = None;
    for name in rank_fields(role) {
        let Some(value) = body.get(*name) else {
            continue;
        };
        if value.is_null() {
            continue;
        }
        let Some(rank) = value.as_i64() else {
            return Err(bad_request(format!("{name} must be an integer, got {value}")));
        };
        let rank = check_range(name, rank, dp_size)?;
        if chosen.is_none() {
            chosen = Some(rank);
        }
    }
    Ok(chosen)
}

/// The body's `priority`: an integer or null (SGLang's request models
/// declare it `Optional[int]`).
fn parse_priority(body: &Map<String, Value>) -> Result<Option<i64>, Rejection> {
    match body.get("priority") {
        None | Some(Value::Null) => Ok(None),
        Some(value) => value
            .as_i64()
            .map(Some)
            .ok_or_else(|| bad_request(format!("priority must be an integer, got {value}"))),
    }
}

/// An integer request header (as SGLang casts it: surrounding spaces
/// allowed); a value that is not one is a 400.
fn header_int(headers: &HeaderMap, name: &str) -> Result<Option<i64>, Rejection> {
    let Some(value) = headers.get(name) else {
        return Ok(None);
    };
    value
        .to_str()
        .ok()
        .and_then(|text| text.trim().parse::<i64>().ok())
        .map(Some)
        .ok_or_else(|| bad_request(format!("invalid {name} header {value:?}: not an integer")))
}

fn header_str(headers: &HeaderMap, name: &str) -> Result<Option<String>, Rejection> {
    let Some(value) = headers.get(name) else {
        return Ok(None);
    };
    value
        .to_str()
        .map(|text| Some(text.to_string()))
        .map_err(|_| bad_request(format!("invalid {name} header: not text")))
}

/// The `x-override-*` headers SGLang honours with
/// SGLANG_ENABLE_REQUEST_HEADER_OVERRIDES (python/sglang/srt/entrypoints/request_headers.py).
#[derive(Debug, Default)]
struct Overrides {
    routed_dp_rank: Option<i64>,
    priority: Option<i64>,
    bootstrap_host: Option<String>,
    bootstrap_port: Option<i64>,
    bootstrap_room: Option<i64>,
}

fn parse_overrides(headers: &HeaderMap) -> Result<Overrides, Rejection> {
    // Validated even where the simulator has no use for them.
    header_int(headers, "x-override-disagg-prefill-dp-rank")?;
    Ok(Overrides {
        priority: header_int(headers, "x-override-priority")?,
        routed_dp_rank: header_int(headers, "x-override-routed-dp-rank")?,
        bootstrap_host: header_str(headers, "x-override-bootstrap-host")?,
        bootstrap_port: header_int(headers, "x-override-bootstrap-port")?,
        bootstrap_room: header_int(headers, "x-override-bootstrap-room")?,
    })
}

/// Whether this endpoint reads `x-data-parallel-rank` in the modelled
/// SGLang version.
fn reads_rank_header(api: Api, mode: RankHeader) -> bool {
    match mode {
        RankHeader::Honour => true,
        RankHeader::Openai => api != Api::Generate,
        RankHeader::Ignore => false,
    }
}

/// Whether this endpoint applies the `x-override-*` headers when enabled.
fn applies_overrides(api: Api) -> bool {
    matches!(api, Api::Generate | Api::Chat)
}

/// The prompts of a text, text array, id list or id lists, and whether
/// it was a batch and was given as ids.
fn prompt_tokens(value: &Value, field: &str) -> Result<(Vec<Vec<u32>>, bool, bool), Rejection> {
    match value {
        Value::String(text) => Ok((vec![text_tokens(text)], false, false)),
        Value::Array(items) if items.is_empty() => Err(bad_request(format!("{field} is empty"))),
        Value::Array(items) => {
            if items.iter().all(Value::is_number) {
                return Ok((vec![id_tokens(items)], false, true));
            }
            let mut pretokenized = true;
            let prompts = items
                .iter()
                .map(|item| match item {
                    Value::String(text) => {
                        pretokenized = false;
                        Ok(text_tokens(text))
                    }
                    Value::Array(ids) if ids.iter().all(Value::is_number) => Ok(id_tokens(ids)),
                    _ => Err(bad_request(format!(
                        "{field} has an element of an unsupported type"
                    ))),
                })
                .collect::<Result<Vec<Vec<u32>>, Rejection>>()?;
            Ok((prompts, true, pretokenized))
        }
        _ => Err(bad_request(format!("{field} must be a string or an array"))),
    }
}

fn chat_prompt(body: &Map<String, Value>) -> Result<Vec<u32>, Rejection> {
    let messages = body.get("messages").unwrap_or(&Value::Null);
    let text = chat::template_json(messages).ok_or_else(|| bad_request("messages must be an array"))?;
    Ok(text_tokens(&text))
}

fn optional_u64(body: &Map<String, Value>, name: &str) -> Result<Option<u64>, Rejection> {
    match body.get(name) {
        None | Some(Value::Null) => Ok(None),
        Some(value) => value
            .as_u64()
            .map(Some)
            .ok_or_else(|| bad_request(format!("{name} must be a non-negative integer"))),
    }
}

fn max_new_tokens(api: Api, body: &Map<String, Value>) -> Result<u64, Rejection> {
    let requested = match api {
        Api::Generate => match body.get("sampling_params") {
            Some(Value::Object(params)) => optional_u64(params, "max_new_tokens")?,
            None | Some(Value::Null) => None,
            Some(_) => return Err(bad_request("sampling_params must be an object")),
        },
        Api::Completions | Api::Chat => match optional_u64(body, "max_completion_tokens")? {
            Some(n) => Some(n),
            None => optional_u64(body, "max_tokens")?,
        },
    };
    Ok(requested
        .unwrap_or(DEFAULT_MAX_NEW_TOKENS)
        .clamp(1, MAX_NEW_TOKENS_LIMIT))
}

/// Reads a field that is a scalar or, for batched input, an array of them.
fn scalar_or_array<T>(
    value: Option<&Value>,
    name: &str,
    read: impl Fn(&Value) -> Option<T>,
) -> Result<Vec<Option<T>>, Rejection> {
    match value {
        None => Err(bad_request(format!("{name} is required in disaggregated mode"))),
        Some(Value::Array(items)) => Ok(items.iter().map(&read).collect()),
        Some(other) => Ok(vec![read(other)]),
    }
}

fn parse_bootstrap(
    body: &Map<String, Value>,
    role: Role,
    overrides: &Overrides,
) -> Result<Option<Bootstrap>, Rejection> {
    if role == Role::Regular {
        return Ok(None);
    }
    let mut body = body.clone();
    if let Some(host) = &overrides.bootstrap_host {
        body.insert("bootstrap_host".into(), json!(host));
    }
    if let Some(port) = overrides.bootstrap_port {
        body.insert("bootstrap_port".into(), json!(port));
    }
    if let Some(room) = overrides.bootstrap_room {
        body.insert("bootstrap_room".into(), json!(room));
    }
    let body = &body;
    let hosts = scalar_or_array(body.get("bootstrap_host"), "bootstrap_host", |v| {
        v.as_str().map(str::to_string)
    })?;
    let host = hosts
        .into_iter()
        .flatten()
        .next()
        .ok_or_else(|| bad_request("bootstrap_host must be a string"))?;
    let ports = scalar_or_array(body.get("bootstrap_port"), "bootstrap_port", |v| {
        v.as_u64().and_then(|p| u16::try_from(p).ok())
    })?;
    let port = ports.into_iter().flatten().next();
    let rooms = scalar_or_array(body.get("bootstrap_room"), "bootstrap_room", Value::as_u64)?;
    if rooms.is_empty() {
        return Err(bad_request("bootstrap_room is empty"));
    }
    let rooms = rooms
        .into_iter()
        .collect::<Option<Vec<u64>>>()
        .ok_or_else(|| bad_request("bootstrap_room must be a non-negative integer"))?;
    if role == Role::Decode && port.is_none() {
        return Err(bad_request(
            "bootstrap_port is required by the simulated decode worker to find the prefill's KV",
        ));
    }
    Ok(Some(Bootstrap { host, port, rooms }))
}

/// Parses and validates a serving request: its body and the rank and
/// override headers the modelled SGLang version reads.
pub fn parse_request(
    api: Api,
    body: &[u8],
    headers: &HeaderMap,
    config: &SimConfig,
) -> Result<ParsedRequest, Rejection> {
    parse_request_at(api, body, headers, config, &RankScope::default())
}

/// [`parse_request`] for a request that arrived where `scope` says: the
/// rank it names read against the worker's start rank (vLLM's Rust
/// frontend), or replaced by the rank of the port (SGLang `--rank-ports`).
/// The rank returned is the worker's local index.
pub fn parse_request_at(
    api: Api,
    body: &[u8],
    headers: &HeaderMap,
    config: &SimConfig,
    scope: &RankScope,
) -> Result<ParsedRequest, Rejection> {
    let value: Value =
        serde_json::from_slice(body).map_err(|err| bad_request(format!("invalid JSON body: {err}")))?;
    let Value::Object(body) = value else {
        return Err(bad_request("the body must be a JSON object"));
    };
    let (role, dp_size) = (config.role, config.dp_size());
    let (prompts, batched, pretokenized) = match api {
        Api::Generate => match (body.get("input_ids"), body.get("text")) {
            (Some(ids), _) if !ids.is_null() => prompt_tokens(ids, "input_ids")?,
            (_, Some(text)) if !text.is_null() => prompt_tokens(text, "text")?,
            _ => return Err(bad_request("either text or input_ids must be given")),
        },
        Api::Completions => match body.get("prompt") {
            Some(prompt) => prompt_tokens(prompt, "prompt")?,
            None => return Err(bad_request("prompt is required")),
        },
        Api::Chat => (vec![chat_prompt(&body)?], false, false),
    };
    let stream = match body.get("stream") {
        None | Some(Value::Null) => false,
        Some(Value::Bool(flag)) => *flag,
        Some(_) => return Err(bad_request("stream must be a boolean")),
    };
    let include_usage = body
        .get("stream_options")
        .and_then(|options| options.get("include_usage"))
        .and_then(Value::as_bool)
        .unwrap_or(false);
    // The rank, and SGLang's header overrides (None: vLLM, which has none).
    let (rank, overrides) = if config.is_vllm() {
        // vLLM has no body field for the rank: the header alone pins it,
        // on the OpenAI endpoints (the only serving ones it has here).
        let rank = if reads_rank_header(api, config.rank_header) {
            vllm_rank(headers, config, scope, stream)?
        } else {
            None
        };
        (rank, None)
    } else {
        // A rank port serves its rank whatever the request names.
        let limit = scope.port_rank.is_none().then_some(dp_size);
        let mut rank = parse_rank(&body, role, limit)?;
        if reads_rank_header(api, config.rank_header) {
            if let Some(header) = header_int(headers, "x-data-parallel-rank")? {
                rank = Some(check_range("x-data-parallel-rank", header, limit)?);
            }
        }
        let overrides = if config.header_overrides && applies_overrides(api) {
            parse_overrides(headers)?
        } else {
            Overrides::default()
        };
        if let Some(header) = overrides.routed_dp_rank {
            rank = Some(check_range("x-override-routed-dp-rank", header, limit)?);
        }
        if scope.port_rank.is_some() {
            rank = scope.port_rank;
        }
        (rank, Some(overrides))
    };
    Ok(ParsedRequest {
        api,
        max_new_tokens: max_new_tokens(api, &body)?,
        answer_tags: answer_tags(api, &body),
        prompts,
        pretokenized,
        batched,
        stream,
        include_usage,
        rank,
        priority: match overrides.as_ref().and_then(|o| o.priority) {
            Some(header) => Some(header),
            None => parse_priority(&body)?,
        },
        bootstrap: match &overrides {
            Some(overrides) => parse_bootstrap(&body, role, overrides)?,
            None => None,
        },
        model: body.get("model").and_then(Value::as_str).map(str::to_string),
    })
}

/// The answer tag in each prompt's text (chat: the rendered conversation,
/// whose last tag is the newest user message's), in prompt order.
fn answer_tags(api: Api, body: &Map<String, Value>) -> Vec<Option<String>> {
    let tag = |text: &str| answers::find_tag(text).map(str::to_string);
    let of = |value: Option<&Value>| match value {
        Some(Value::String(text)) => vec![tag(text)],
        Some(Value::Array(items)) => items.iter().map(|item| item.as_str().and_then(tag)).collect(),
        _ => Vec::new(),
    };
    match api {
        Api::Generate => of(body.get("text")),
        Api::Completions => of(body.get("prompt")),
        Api::Chat => body
            .get("messages")
            .and_then(chat::template_json)
            .map(|text| vec![tag(&text)])
            .unwrap_or_default(),
    }
}

/// The JSON error body SGLang and vLLM answer with.
pub fn error_body(status: u16, message: &str) -> Value {
    let kind = match status {
        400 => "BadRequestError",
        404 => "NotFoundError",
        503 => "ServiceUnavailableError",
        _ => "InternalServerError",
    };
    json!({"error": {"message": message, "type": kind, "param": null, "code": status}})
}

/// The responses of one admitted request, as its sequences progress.
#[derive(Debug, Clone)]
pub struct ResponseShape {
    pub api: Api,
    pub id: String,
    pub model: String,
    pub created: u64,
    pub prompt_tokens: Vec<u64>,
    /// The output cap (`max_new_tokens` as admitted).
    pub max_new_tokens: u64,
    /// Output tokens each sequence will produce: its answer's length, at
    /// most the cap.
    pub stops: Vec<u64>,
    /// Whether the input was a batch (responses are then per item).
    pub batched: bool,
    pub include_usage: bool,
    /// `--enable-cache-report`: cached tokens in OpenAI usage.
    pub cache_report: bool,
    /// vLLM: the details only when some prompt tokens were cached.
    pub cached_only_when_hit: bool,
    /// Output tokens so far, per sequence.
    pub counts: Vec<u64>,
    /// Prompt tokens served from the prefix cache, per sequence.
    pub cached: Vec<u64>,
}

fn sse(value: &Value) -> Bytes {
    Bytes::from(format!("data: {value}\n\n"))
}

/// The SSE terminator.
pub fn sse_done() -> Bytes {
    Bytes::from_static(b"data: [DONE]\n\n")
}

/// An error event inside an already started stream.
pub fn sse_error(message: &str) -> Bytes {
    sse_error_status(500, message)
}

/// An SSE error event with this status in its body.
pub fn sse_error_status(status: u16, message: &str) -> Bytes {
    sse(&error_body(status, message))
}

impl ResponseShape {
    /// Records that sequence `seq` now has `count` output tokens.
    pub fn record(&mut self, seq: usize, count: u64, cached_tokens: u64) {
        if let Some(slot) = self.counts.get_mut(seq) {
            *slot = count;
        }
        if let Some(slot) = self.cached.get_mut(seq) {
            *slot = cached_tokens;
        }
    }

    /// Every sequence has all its tokens.
    pub fn done(&self) -> bool {
        (0..self.counts.len()).all(|seq| self.count(seq) >= self.stop(seq))
    }

    fn stop(&self, seq: usize) -> u64 {
        self.stops.get(seq).copied().unwrap_or(self.max_new_tokens)
    }

    /// How sequence `seq` ended, once it has: at its answer's end (EOS) or
    /// at the cap.
    fn ended(&self, seq: usize) -> Option<&'static str> {
        let count = self.count(seq);
        if count < self.stop(seq) {
            None
        } else if count < self.max_new_tokens {
            Some("stop")
        } else {
            Some("length")
        }
    }

    fn count(&self, seq: usize) -> u64 {
        self.counts.get(seq).copied().unwrap_or(0)
    }

    fn usage(&self) -> Value {
        let prompt: u64 = self.prompt_tokens.iter().sum();
        let completion: u64 = self.counts.iter().sum();
        let mut usage = json!({"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion});
        let cached: u64 = self.cached.iter().sum();
        if self.cache_report && (cached > 0 || !self.cached_only_when_hit) {
            if let Some(object) = usage.as_object_mut() {
                object.insert("prompt_tokens_details".into(), json!({"cached_tokens": cached}));
            }
        }
        usage
    }

    fn finish_reason(&self, seq: usize) -> Value {
        self.ended(seq).map_or(Value::Null, |reason| json!(reason))
    }

    fn generate_item(&self, index: usize, elapsed_s: f64) -> Value {
        let count = self.count(index);
        let finish = match self.ended(index) {
            Some("stop") => json!({"type": "stop", "matched": answers::EOS_TOKEN_ID}),
            Some(_) => json!({"type": "length", "length": count}),
            None => Value::Null,
        };
        let mut item = json!({
            "text": text_upto(count),
            "meta_info": {
                "id": format!("{}-{index}", self.id),
                "finish_reason": finish,
                "prompt_tokens": self.prompt_tokens.get(index).copied().unwrap_or(1),
                "completion_tokens": count,
                "cached_tokens": self.cached.get(index).copied().unwrap_or(0),
                "e2e_latency": elapsed_s,
            }
        });
        if self.batched {
            if let Some(object) = item.as_object_mut() {
                object.insert("index".into(), json!(index));
            }
        }
        item
    }

    /// The SSE event for sequence `index`'s latest token.
    pub fn stream_event(&self, index: usize, elapsed_s: f64) -> Bytes {
        let count = self.count(index);
        match self.api {
            Api::Generate => sse(&self.generate_item(index, elapsed_s)),
            Api::Completions => sse(&json!({
                "id": self.id, "object": "text_completion", "created": self.created,
                "model": self.model,
                "choices": [{"index": index, "text": token_text(count), "logprobs": null,
                             "finish_reason": self.finish_reason(index)}],
                "usage": null,
            })),
            Api::Chat => {
                let delta = if count <= 1 {
                    json!({"role": "assistant", "content": token_text(count)})
                } else {
                    json!({"content": token_text(count)})
                };
                sse(&json!({
                    "id": self.id, "object": "chat.completion.chunk", "created": self.created,
                    "model": self.model,
                    "choices": [{"index": index, "delta": delta, "logprobs": null,
                                 "finish_reason": self.finish_reason(index)}],
                    "usage": null,
                }))
            }
        }
    }

    /// Events after the last token: the usage chunk if asked for, then [DONE].
    pub fn stream_tail(&self) -> Vec<Bytes> {
        let mut events = Vec::new();
        if self.include_usage && self.api != Api::Generate {
            let object = match self.api {
                Api::Chat => "chat.completion.chunk",
                _ => "text_completion",
            };
            events.push(sse(&json!({
                "id": self.id, "object": object, "created": self.created, "model": self.model,
                "choices": [], "usage": self.usage(),
            })));
        }
        events.push(sse_done());
        events
    }

    /// The whole response of a non-streamed request.
    pub fn full(&self, elapsed_s: f64) -> Value {
        match self.api {
            Api::Generate => {
                if self.batched {
                    Value::Array(
                        (0..self.counts.len())
                            .map(|index| self.generate_item(index, elapsed_s))
                            .collect(),
                    )
                } else {
                    self.generate_item(0, elapsed_s)
                }
            }
            Api::Completions => json!({
                "id": self.id, "object": "text_completion", "created": self.created,
                "model": self.model,
                "choices": (0..self.counts.len()).map(|index| json!({
                    "index": index, "text": text_upto(self.count(index)), "logprobs": null,
                    "finish_reason": self.finish_reason(index),
                })).collect::<Vec<_>>(),
                "usage": self.usage(),
            }),
            Api::Chat => json!({
                "id": self.id, "object": "chat.completion", "created": self.created,
                "model": self.model,
                "choices": [{"index": 0,
                             "message": {"role": "assistant", "content": text_upto(self.count(0))},
                             "logprobs": null, "finish_reason": self.finish_reason(0)}],
                "usage": self.usage(),
            }),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::http::HeaderValue;

    /// Four ranks: the range checks below are written against them.
    fn config(role: Role) -> SimConfig {
        SimConfig {
            role,
            dp_size: Some(4),
            ..SimConfig::default()
        }
    }

    fn parse(api: Api, body: &str, role: Role) -> Result<ParsedRequest, Rejection> {
        parse_request(api, body.as_bytes(), &HeaderMap::new(), &config(role))
    }

    fn lens(parsed: &ParsedRequest) -> Vec<usize> {
        parsed.prompts.iter().map(Vec::len).collect()
    }

    #[test]
    fn prompts_are_tokenized_or_taken_as_ids() {
        let parsed = parse(Api::Generate, r#"{"text":"Hello world"}"#, Role::Regular).unwrap();
        assert_eq!(parsed.prompts, vec![tokenizer::tokens("Hello world")]);
        assert!(!parsed.pretokenized);
        let parsed = parse(Api::Generate, r#"{"text":["a b","a b c"]}"#, Role::Regular).unwrap();
        assert_eq!(lens(&parsed), vec![2, 3]);
        assert!(parsed.batched);
        let parsed = parse(
            Api::Generate,
            r#"{"text":"x","input_ids":[1,2,3,4,5]}"#,
            Role::Regular,
        )
        .unwrap();
        assert_eq!(parsed.prompts, vec![vec![1, 2, 3, 4, 5]]);
        assert!(parsed.pretokenized);
        let parsed = parse(Api::Completions, r#"{"prompt":[[1,2],[3]]}"#, Role::Regular).unwrap();
        assert_eq!(parsed.prompts, vec![vec![1, 2], vec![3]]);
        let parsed = parse(Api::Completions, r#"{"prompt":""}"#, Role::Regular).unwrap();
        assert_eq!(lens(&parsed), vec![1]);
        let parsed = parse(
            Api::Chat,
            r#"{"messages":[{"role":"user","content":"abc"},{"role":"user","content":[{"type":"text","text":"ab"}]}]}"#,
            Role::Regular,
        )
        .unwrap();
        let text = chat::template(&[
            chat::Message::new("user", "abc"),
            chat::Message::new("user", "ab"),
        ]);
        assert_eq!(parsed.prompts, vec![tokenizer::tokens(&text)]);
    }

    #[test]
    fn output_length_defaults_and_clamps() {
        let parsed = parse(Api::Generate, r#"{"text":"a"}"#, Role::Regular).unwrap();
        assert_eq!(parsed.max_new_tokens, DEFAULT_MAX_NEW_TOKENS);
        let parsed = parse(
            Api::Generate,
            r#"{"text":"a","sampling_params":{"max_new_tokens":100000}}"#,
            Role::Regular,
        )
        .unwrap();
        assert_eq!(parsed.max_new_tokens, MAX_NEW_TOKENS_LIMIT);
        let parsed = parse(
            Api::Chat,
            r#"{"messages":[],"max_tokens":3,"max_completion_tokens":5}"#,
            Role::Regular,
        )
        .unwrap();
        assert_eq!(parsed.max_new_tokens, 5);
    }

    #[test]
    fn rank_fields_and_their_errors() {
        let rank = |body: &str, role| parse(Api::Generate, body, role).map(|parsed| parsed.rank);
        assert_eq!(
            rank(r#"{"text":"a","routed_dp_rank":2}"#, Role::Regular),
            Ok(Some(2))
        );
        assert_eq!(
            rank(r#"{"text":"a","data_parallel_rank":3}"#, Role::Regular),
            Ok(Some(3))
        );
        assert_eq!(
            rank(r#"{"text":"a","data_parallel_rank":null}"#, Role::Regular),
            Ok(None)
        );
        for body in [
            r#"{"text":"a","routed_dp_rank":4}"#,
            r#"{"text":"a","routed_dp_rank":-1}"#,
            r#"{"text":"a","routed_dp_rank":"1"}"#,
            r#"{"text":"a","routed_dp_rank":1.5}"#,
        ] {
            assert_eq!(rank(body, Role::Regular).unwrap_err().status, 400, "{body}");
        }
        let decode =
            r#"{"text":"a","decode_dp_rank":1,"bootstrap_host":"h","bootstrap_port":1,"bootstrap_room":7}"#;
        assert_eq!(rank(decode, Role::Decode), Ok(Some(1)));
        assert_eq!(rank(decode, Role::Regular), Ok(None));
    }

    fn with_headers(
        api: Api,
        body: &str,
        headers: &[(&'static str, &'static str)],
        config: &SimConfig,
    ) -> Result<ParsedRequest, Rejection> {
        let mut map = HeaderMap::new();
        for (name, value) in headers {
            map.append(*name, HeaderValue::from_static(value));
        }
        parse_request(api, body.as_bytes(), &map, config)
    }

    #[test]
    fn the_rank_header_wins_over_the_body_where_it_is_read() {
        let body = r#"{"text":"a","routed_dp_rank":1}"#;
        let chat = r#"{"messages":[],"routed_dp_rank":1}"#;
        let header = [("X-Data-Parallel-Rank", " 3 ")];
        let honour = config(Role::Regular);
        let rank = |api, body, config: &SimConfig| with_headers(api, body, &header, config).map(|p| p.rank);
        assert_eq!(rank(Api::Generate, body, &honour), Ok(Some(3)));
        assert_eq!(rank(Api::Chat, chat, &honour), Ok(Some(3)));
        let openai = SimConfig {
            rank_header: RankHeader::Openai,
            ..config(Role::Regular)
        };
        assert_eq!(rank(Api::Generate, body, &openai), Ok(Some(1)));
        assert_eq!(rank(Api::Chat, chat, &openai), Ok(Some(3)));
        let ignore = SimConfig {
            rank_header: RankHeader::Ignore,
            ..config(Role::Regular)
        };
        assert_eq!(rank(Api::Chat, chat, &ignore), Ok(Some(1)));
        for bad in ["abc", "1.5", "", "4", "-1"] {
            let mut map = HeaderMap::new();
            map.insert("x-data-parallel-rank", HeaderValue::from_static(bad));
            let error = parse_request(Api::Generate, body.as_bytes(), &map, &honour).unwrap_err();
            assert_eq!(error.status, 400, "{bad:?}");
            // Where the header is not read, a bad one does not matter.
            assert!(parse_request(Api::Generate, body.as_bytes(), &map, &ignore).is_ok());
        }
    }

    #[test]
    fn the_priority_comes_from_the_body_or_the_override_header() {
        let on = SimConfig {
            header_overrides: true,
            ..config(Role::Regular)
        };
        let read = |body: &str, headers: &[(&'static str, &'static str)]| {
            with_headers(Api::Generate, body, headers, &on).map(|r| r.priority)
        };
        assert_eq!(read(r#"{"text":"a"}"#, &[]).unwrap(), None);
        assert_eq!(read(r#"{"text":"a","priority":null}"#, &[]).unwrap(), None);
        assert_eq!(read(r#"{"text":"a","priority":-3}"#, &[]).unwrap(), Some(-3));
        assert_eq!(
            read(r#"{"text":"a","priority":1}"#, &[("x-override-priority", "7")]).unwrap(),
            Some(7),
            "the header wins"
        );
        assert_eq!(
            read(r#"{"text":"a","priority":"high"}"#, &[]).unwrap_err().status,
            400
        );
    }

    #[test]
    fn override_headers_need_the_switch_and_win_last() {
        let body = r#"{"text":"a","routed_dp_rank":1}"#;
        let headers = [("x-data-parallel-rank", "2"), ("x-override-routed-dp-rank", "3")];
        let off = config(Role::Regular);
        let on = SimConfig {
            header_overrides: true,
            ..config(Role::Regular)
        };
        assert_eq!(
            with_headers(Api::Generate, body, &headers, &off).unwrap().rank,
            Some(2)
        );
        assert_eq!(
            with_headers(Api::Generate, body, &headers, &on).unwrap().rank,
            Some(3)
        );
        // /v1/completions does not apply the overrides.
        let completion = r#"{"prompt":"a"}"#;
        assert_eq!(
            with_headers(Api::Completions, completion, &headers, &on)
                .unwrap()
                .rank,
            Some(2)
        );
        for bad in [
            ("x-override-routed-dp-rank", "x"),
            ("x-override-bootstrap-port", "p"),
            ("x-override-priority", "high"),
            ("x-override-disagg-prefill-dp-rank", "?"),
        ] {
            assert_eq!(
                with_headers(Api::Generate, body, &[bad], &on).unwrap_err().status,
                400
            );
            assert!(with_headers(Api::Generate, body, &[bad], &off).is_ok());
        }
        let prefill = SimConfig {
            header_overrides: true,
            ..config(Role::Prefill)
        };
        let pd = with_headers(
            Api::Generate,
            r#"{"text":"a"}"#,
            &[
                ("x-override-bootstrap-host", "10.0.0.1"),
                ("x-override-bootstrap-port", "8998"),
                ("x-override-bootstrap-room", "42"),
            ],
            &prefill,
        )
        .unwrap();
        assert_eq!(
            pd.bootstrap,
            Some(Bootstrap {
                host: "10.0.0.1".into(),
                port: Some(8998),
                rooms: vec![42]
            })
        );
    }

    #[test]
    fn bootstrap_fields() {
        let batched =
            r#"{"text":["a","b"],"bootstrap_host":["h","h"],"bootstrap_port":[9,9],"bootstrap_room":[1,2]}"#;
        let bootstrap = parse(Api::Generate, batched, Role::Decode)
            .unwrap()
            .bootstrap
            .unwrap();
        assert_eq!(
            bootstrap,
            Bootstrap {
                host: "h".into(),
                port: Some(9),
                rooms: vec![1, 2]
            }
        );
        let no_port = r#"{"text":"a","bootstrap_host":"h","bootstrap_port":null,"bootstrap_room":1}"#;
        assert_eq!(
            parse(Api::Generate, no_port, Role::Decode).unwrap_err().status,
            400
        );
        assert!(parse(Api::Generate, no_port, Role::Prefill)
            .unwrap()
            .bootstrap
            .is_some());
        assert_eq!(
            parse(Api::Generate, r#"{"text":"a"}"#, Role::Prefill)
                .unwrap_err()
                .status,
            400
        );
        let big_room =
            r#"{"text":"a","bootstrap_host":"h","bootstrap_port":1,"bootstrap_room":9223372036854775807}"#;
        assert_eq!(
            parse(Api::Generate, big_room, Role::Prefill)
                .unwrap()
                .bootstrap
                .unwrap()
                .rooms,
            vec![i64::MAX as u64]
        );
    }

    #[test]
    fn header_ranks_parse_as_python_int_does() {
        for (text, value) in [
            ("1", Some(1)),
            (" 1 ", Some(1)),
            ("+1", Some(1)),
            ("-3", Some(-3)),
            ("1_0", Some(10)),
            ("007", Some(7)),
            ("\t2\r", Some(2)),
            ("1__0", None),
            ("_1", None),
            ("1_", None),
            ("1.0", None),
            ("", None),
            ("  ", None),
            ("+", None),
            ("0x1", None),
            ("1 2", None),
        ] {
            assert_eq!(python_int(text.as_bytes()), value, "{text:?}");
        }
        // Latin-1 no-break space is whitespace to Python; a huge number is
        // still a number.
        assert_eq!(python_int(b"\xa01\xa0"), Some(1));
        assert_eq!(
            python_int(b"99999999999999999999999999999999999999999"),
            Some(i128::MAX)
        );
    }

    #[test]
    fn invalid_bodies_are_rejected() {
        for body in ["{not json", "[1]", "{}"] {
            assert_eq!(
                parse(Api::Generate, body, Role::Regular).unwrap_err().status,
                400,
                "{body}"
            );
        }
    }
}
