//! SGLang / OpenAI request parsing and response shapes.

use bytes::Bytes;
use serde_json::{json, Map, Value};

use crate::config::Role;

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

/// Everything the simulator needs from a serving request body.
#[derive(Debug, Clone)]
pub struct ParsedRequest {
    pub api: Api,
    /// Prompt tokens of each sequence (more than one for batched input).
    pub prompt_tokens: Vec<u64>,
    /// The input was a list of prompts (answers are then lists too).
    pub batched: bool,
    pub max_new_tokens: u64,
    pub stream: bool,
    pub include_usage: bool,
    /// The rank the caller asked for, if any.
    pub rank: Option<usize>,
    pub bootstrap: Option<Bootstrap>,
    pub model: Option<String>,
}

/// A request the simulator refuses, with the HTTP status to answer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Rejection {
    pub status: u16,
    pub message: String,
}

fn bad_request(message: impl Into<String>) -> Rejection {
    Rejection {
        status: 400,
        message: message.into(),
    }
}

/// The byte-count token estimate: ceil(bytes / 4), at least 1.
pub fn tokens_of_text(text: &str) -> u64 {
    (text.len() as u64).div_ceil(4).max(1)
}

/// Rank fields in the order they are honoured, by role.
fn rank_fields(role: Role) -> &'static [&'static str] {
    match role {
        Role::Decode => &["routed_dp_rank", "decode_dp_rank", "data_parallel_rank"],
        Role::Regular | Role::Prefill => &["routed_dp_rank", "data_parallel_rank"],
    }
}

fn parse_rank(body: &Map<String, Value>, role: Role, dp_size: usize) -> Result<Option<usize>, Rejection> {
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
        if rank < 0 || rank as u64 >= dp_size as u64 {
            return Err(bad_request(format!(
                "{name}={rank} is out of range [0, {dp_size})"
            )));
        }
        if chosen.is_none() {
            chosen = Some(rank as usize);
        }
    }
    Ok(chosen)
}

/// Token counts of a prompt given as text, text array, id list or id
/// lists, and whether it was a batch.
fn prompt_token_counts(value: &Value, field: &str) -> Result<(Vec<u64>, bool), Rejection> {
    match value {
        Value::String(text) => Ok((vec![tokens_of_text(text)], false)),
        Value::Array(items) if items.is_empty() => Err(bad_request(format!("{field} is empty"))),
        Value::Array(items) => {
            if items.iter().all(Value::is_number) {
                return Ok((vec![(items.len() as u64).max(1)], false));
            }
            let counts = items
                .iter()
                .map(|item| match item {
                    Value::String(text) => Ok(tokens_of_text(text)),
                    Value::Array(ids) if ids.iter().all(Value::is_number) => Ok((ids.len() as u64).max(1)),
                    _ => Err(bad_request(format!(
                        "{field} has an element of an unsupported type"
                    ))),
                })
                .collect::<Result<Vec<u64>, Rejection>>()?;
            Ok((counts, true))
        }
        _ => Err(bad_request(format!("{field} must be a string or an array"))),
    }
}

fn chat_prompt_tokens(body: &Map<String, Value>) -> Result<u64, Rejection> {
    let Some(Value::Array(messages)) = body.get("messages") else {
        return Err(bad_request("messages must be an array"));
    };
    let mut bytes = 0u64;
    for message in messages {
        match message.get("content") {
            Some(Value::String(text)) => bytes += text.len() as u64,
            Some(Value::Array(parts)) => {
                for part in parts {
                    if let Some(Value::String(text)) = part.get("text") {
                        bytes += text.len() as u64;
                    }
                }
            }
            _ => {}
        }
    }
    Ok(bytes.div_ceil(4).max(1))
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

fn parse_bootstrap(body: &Map<String, Value>, role: Role) -> Result<Option<Bootstrap>, Rejection> {
    if role == Role::Regular {
        return Ok(None);
    }
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

/// Parses and validates a serving request body.
pub fn parse_request(api: Api, body: &[u8], role: Role, dp_size: usize) -> Result<ParsedRequest, Rejection> {
    let value: Value =
        serde_json::from_slice(body).map_err(|err| bad_request(format!("invalid JSON body: {err}")))?;
    let Value::Object(body) = value else {
        return Err(bad_request("the body must be a JSON object"));
    };
    let (prompt_tokens, batched) = match api {
        Api::Generate => match (body.get("input_ids"), body.get("text")) {
            (Some(ids), _) if !ids.is_null() => prompt_token_counts(ids, "input_ids")?,
            (_, Some(text)) if !text.is_null() => prompt_token_counts(text, "text")?,
            _ => return Err(bad_request("either text or input_ids must be given")),
        },
        Api::Completions => match body.get("prompt") {
            Some(prompt) => prompt_token_counts(prompt, "prompt")?,
            None => return Err(bad_request("prompt is required")),
        },
        Api::Chat => (vec![chat_prompt_tokens(&body)?], false),
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
    Ok(ParsedRequest {
        api,
        max_new_tokens: max_new_tokens(api, &body)?,
        prompt_tokens,
        batched,
        stream,
        include_usage,
        rank: parse_rank(&body, role, dp_size)?,
        bootstrap: parse_bootstrap(&body, role)?,
        model: body.get("model").and_then(Value::as_str).map(str::to_string),
    })
}

/// The JSON error body SGLang answers with.
pub fn error_body(status: u16, message: &str) -> Value {
    let kind = match status {
        400 => "BadRequestError",
        404 => "NotFoundError",
        503 => "ServiceUnavailableError",
        _ => "InternalServerError",
    };
    json!({"error": {"message": message, "type": kind, "code": status}})
}

const WORDS: [&str; 8] = [
    " the", " quick", " brown", " fox", " jumps", " over", " lazy", " dog",
];

/// The text of output token `index` (1-based).
pub fn token_text(index: u64) -> &'static str {
    WORDS[((index.max(1) - 1) % WORDS.len() as u64) as usize]
}

/// The text of the first `count` output tokens.
pub fn text_upto(count: u64) -> String {
    (1..=count).map(token_text).collect()
}

/// Formats the responses of one admitted request.
#[derive(Debug, Clone)]
pub struct ResponseShape {
    pub api: Api,
    pub id: String,
    pub model: String,
    pub created: u64,
    pub prompt_tokens: Vec<u64>,
    /// Output tokens each sequence will produce.
    pub max_new_tokens: u64,
    /// Whether the input was a batch (responses are then per item).
    pub batched: bool,
    pub include_usage: bool,
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
    sse(&error_body(500, message))
}

impl ResponseShape {
    fn sequences(&self) -> usize {
        self.prompt_tokens.len()
    }

    fn usage(&self, completion: u64) -> Value {
        let prompt: u64 = self.prompt_tokens.iter().sum();
        let completion = completion * self.sequences() as u64;
        json!({"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion})
    }

    fn finish_reason(&self, count: u64) -> Value {
        if count >= self.max_new_tokens {
            json!("length")
        } else {
            Value::Null
        }
    }

    fn generate_item(&self, index: usize, count: u64, elapsed_s: f64) -> Value {
        let finish = if count >= self.max_new_tokens {
            json!({"type": "length", "length": count})
        } else {
            Value::Null
        };
        let mut item = json!({
            "text": text_upto(count),
            "meta_info": {
                "id": format!("{}-{index}", self.id),
                "finish_reason": finish,
                "prompt_tokens": self.prompt_tokens.get(index).copied().unwrap_or(1),
                "completion_tokens": count,
                "cached_tokens": 0,
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

    /// SSE events announcing that every sequence now has `count` tokens.
    pub fn stream_events(&self, count: u64, elapsed_s: f64) -> Vec<Bytes> {
        (0..self.sequences())
            .map(|index| match self.api {
                Api::Generate => sse(&self.generate_item(index, count, elapsed_s)),
                Api::Completions => sse(&json!({
                    "id": self.id, "object": "text_completion", "created": self.created,
                    "model": self.model,
                    "choices": [{"index": index, "text": token_text(count), "logprobs": null,
                                 "finish_reason": self.finish_reason(count)}],
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
                                     "finish_reason": self.finish_reason(count)}],
                        "usage": null,
                    }))
                }
            })
            .collect()
    }

    /// Events after the last token: the usage chunk if asked for, then [DONE].
    pub fn stream_tail(&self, count: u64) -> Vec<Bytes> {
        let mut events = Vec::new();
        if self.include_usage && self.api != Api::Generate {
            let object = match self.api {
                Api::Chat => "chat.completion.chunk",
                _ => "text_completion",
            };
            events.push(sse(&json!({
                "id": self.id, "object": object, "created": self.created, "model": self.model,
                "choices": [], "usage": self.usage(count),
            })));
        }
        events.push(sse_done());
        events
    }

    /// The whole response of a non-streamed request with `count` tokens.
    pub fn full(&self, count: u64, elapsed_s: f64) -> Value {
        match self.api {
            Api::Generate => {
                if self.batched {
                    Value::Array(
                        (0..self.sequences())
                            .map(|index| self.generate_item(index, count, elapsed_s))
                            .collect(),
                    )
                } else {
                    self.generate_item(0, count, elapsed_s)
                }
            }
            Api::Completions => json!({
                "id": self.id, "object": "text_completion", "created": self.created,
                "model": self.model,
                "choices": (0..self.sequences()).map(|index| json!({
                    "index": index, "text": text_upto(count), "logprobs": null,
                    "finish_reason": self.finish_reason(count),
                })).collect::<Vec<_>>(),
                "usage": self.usage(count),
            }),
            Api::Chat => json!({
                "id": self.id, "object": "chat.completion", "created": self.created,
                "model": self.model,
                "choices": [{"index": 0,
                             "message": {"role": "assistant", "content": text_upto(count)},
                             "logprobs": null, "finish_reason": self.finish_reason(count)}],
                "usage": self.usage(count),
            }),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_text_input_ids_and_batches() {
        let parsed = parse_request(Api::Generate, br#"{"text":"abcdefghi"}"#, Role::Regular, 4).unwrap();
        assert_eq!(parsed.prompt_tokens, vec![3]);
        let parsed = parse_request(Api::Generate, br#"{"text":["abcd","abcde"]}"#, Role::Regular, 4).unwrap();
        assert_eq!(parsed.prompt_tokens, vec![1, 2]);
        let parsed = parse_request(
            Api::Generate,
            br#"{"text":"x","input_ids":[1,2,3,4,5]}"#,
            Role::Regular,
            4,
        )
        .unwrap();
        assert_eq!(parsed.prompt_tokens, vec![5]);
        let parsed = parse_request(Api::Completions, br#"{"prompt":[[1,2],[3]]}"#, Role::Regular, 4).unwrap();
        assert_eq!(parsed.prompt_tokens, vec![2, 1]);
        let parsed = parse_request(Api::Completions, br#"{"prompt":""}"#, Role::Regular, 4).unwrap();
        assert_eq!(parsed.prompt_tokens, vec![1]);
        let parsed = parse_request(
            Api::Chat,
            br#"{"messages":[{"role":"user","content":"abcdef"},{"role":"user","content":[{"type":"text","text":"ab"}]}]}"#,
            Role::Regular,
            4,
        )
        .unwrap();
        assert_eq!(parsed.prompt_tokens, vec![2]);
    }

    #[test]
    fn output_length_defaults_and_clamps() {
        let parsed = parse_request(Api::Generate, br#"{"text":"a"}"#, Role::Regular, 4).unwrap();
        assert_eq!(parsed.max_new_tokens, DEFAULT_MAX_NEW_TOKENS);
        let parsed = parse_request(
            Api::Generate,
            br#"{"text":"a","sampling_params":{"max_new_tokens":100000}}"#,
            Role::Regular,
            4,
        )
        .unwrap();
        assert_eq!(parsed.max_new_tokens, MAX_NEW_TOKENS_LIMIT);
        let parsed = parse_request(
            Api::Chat,
            br#"{"messages":[],"max_tokens":3,"max_completion_tokens":5}"#,
            Role::Regular,
            4,
        )
        .unwrap();
        assert_eq!(parsed.max_new_tokens, 5);
    }

    #[test]
    fn rank_fields_and_their_errors() {
        let parse = |body: &str, role| parse_request(Api::Generate, body.as_bytes(), role, 4);
        assert_eq!(
            parse(r#"{"text":"a","routed_dp_rank":2}"#, Role::Regular)
                .unwrap()
                .rank,
            Some(2)
        );
        assert_eq!(
            parse(r#"{"text":"a","data_parallel_rank":3}"#, Role::Regular)
                .unwrap()
                .rank,
            Some(3)
        );
        assert_eq!(
            parse(r#"{"text":"a","data_parallel_rank":null}"#, Role::Regular)
                .unwrap()
                .rank,
            None
        );
        assert_eq!(
            parse(r#"{"text":"a","routed_dp_rank":4}"#, Role::Regular)
                .unwrap_err()
                .status,
            400
        );
        assert_eq!(
            parse(r#"{"text":"a","routed_dp_rank":-1}"#, Role::Regular)
                .unwrap_err()
                .status,
            400
        );
        assert_eq!(
            parse(r#"{"text":"a","routed_dp_rank":"1"}"#, Role::Regular)
                .unwrap_err()
                .status,
            400
        );
        assert_eq!(
            parse(r#"{"text":"a","routed_dp_rank":1.5}"#, Role::Regular)
                .unwrap_err()
                .status,
            400
        );
        let decode =
            r#"{"text":"a","decode_dp_rank":1,"bootstrap_host":"h","bootstrap_port":1,"bootstrap_room":7}"#;
        assert_eq!(parse(decode, Role::Decode).unwrap().rank, Some(1));
        assert_eq!(parse(decode, Role::Regular).unwrap().rank, None);
    }

    #[test]
    fn bootstrap_fields() {
        let parse = |body: &str, role| parse_request(Api::Generate, body.as_bytes(), role, 4);
        let batched =
            r#"{"text":["a","b"],"bootstrap_host":["h","h"],"bootstrap_port":[9,9],"bootstrap_room":[1,2]}"#;
        let bootstrap = parse(batched, Role::Decode).unwrap().bootstrap.unwrap();
        assert_eq!(
            bootstrap,
            Bootstrap {
                host: "h".into(),
                port: Some(9),
                rooms: vec![1, 2]
            }
        );
        let no_port = r#"{"text":"a","bootstrap_host":"h","bootstrap_port":null,"bootstrap_room":1}"#;
        assert_eq!(parse(no_port, Role::Decode).unwrap_err().status, 400);
        assert!(parse(no_port, Role::Prefill).unwrap().bootstrap.is_some());
        assert_eq!(parse(r#"{"text":"a"}"#, Role::Prefill).unwrap_err().status, 400);
        let big_room =
            r#"{"text":"a","bootstrap_host":"h","bootstrap_port":1,"bootstrap_room":9223372036854775807}"#;
        assert_eq!(
            parse(big_room, Role::Prefill).unwrap().bootstrap.unwrap().rooms,
            vec![i64::MAX as u64]
        );
    }

    #[test]
    fn invalid_bodies_are_rejected() {
        assert_eq!(
            parse_request(Api::Generate, b"{not json", Role::Regular, 4)
                .unwrap_err()
                .status,
            400
        );
        assert_eq!(
            parse_request(Api::Generate, b"[1]", Role::Regular, 4)
                .unwrap_err()
                .status,
            400
        );
        assert_eq!(
            parse_request(Api::Generate, b"{}", Role::Regular, 4)
                .unwrap_err()
                .status,
            400
        );
    }
}
