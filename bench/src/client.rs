//! HTTP/1.1 clients with TCP_NODELAY: a pooled client for the workloads
//! (streamed requests, read event by event) and single dedicated
//! connections for closed-loop overhead runs.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::client::conn::http1::SendRequest;
use hyper::{Request, Response};
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::{TokioExecutor, TokioIo};

use crate::workload::Api;

pub type PooledClient = Client<HttpConnector, Full<Bytes>>;

/// A pooled client; every socket it opens has TCP_NODELAY (Nagle would add
/// up to 40 ms to small writes and swamp what is measured).
pub fn pooled_client() -> PooledClient {
    let mut connector = HttpConnector::new();
    connector.set_nodelay(true);
    Client::builder(TokioExecutor::new())
        .pool_max_idle_per_host(4096)
        .build(connector)
}

/// What one streamed request showed the client.
#[derive(Debug, Clone, Default)]
pub struct StreamOutcome {
    pub error: Option<String>,
    /// Time to the first token event.
    pub ttft: Option<Duration>,
    /// Gaps between successive token events (0 for events that arrived together).
    pub itls: Vec<Duration>,
    /// From sending to the end of the stream.
    pub e2e: Duration,
    /// Token events received.
    pub tokens: u32,
    /// Prompt and cached prompt tokens as the server reported them.
    pub prompt_tokens: Option<u64>,
    pub cached_tokens: Option<u64>,
    /// The answer's text (chat streams, when asked for).
    pub text: String,
    /// Refused by the gateway's overload protection: its status (429;
    /// 408, smg's queue time-out; 503 with dprank's admission header). Not
    /// an error: the request was answered, without a token.
    pub rejected: Option<u16>,
}

/// How to read a stream: which API shaped it and whether to keep the text.
#[derive(Debug, Clone, Copy)]
pub struct StreamKind {
    pub api: Api,
    pub keep_text: bool,
    /// The priority class header's value, if the request has a class.
    pub priority: Option<&'static str>,
}

fn post(uri: &str, body: Bytes, priority: Option<&str>) -> Result<Request<Full<Bytes>>, String> {
    let mut request = Request::post(uri)
        .header("content-type", "application/json")
        .header("accept", "text/event-stream");
    if let Some(class) = priority {
        request = request.header(crate::workload::PRIORITY_HEADER, class);
    }
    request
        .body(Full::new(body))
        .map_err(|e| format!("bad request for {uri}: {e}"))
}

/// Whether an answer is a refusal by overload protection (not a failure).
pub fn is_refusal(status: u16, admission_header: bool) -> bool {
    status == 429 || status == 408 || (status == 503 && admission_header)
}

/// Finds the end of the next SSE event (`\n\n`) at or after `from`.
fn event_end(buf: &[u8], from: usize) -> Option<usize> {
    buf.get(from..)?
        .windows(2)
        .position(|w| w == b"\n\n")
        .map(|p| p + from)
}

/// Sends a streamed request and times every token event as it arrives.
pub async fn stream_request(
    client: &PooledClient,
    uri: &str,
    body: Bytes,
    kind: StreamKind,
) -> StreamOutcome {
    let start = Instant::now();
    let mut out = StreamOutcome::default();
    let result = stream_into(client, uri, body, kind, start, &mut out).await;
    out.e2e = start.elapsed();
    if let Err(e) = result {
        out.error = Some(e);
    }
    out
}

/// What one SSE data payload is.
#[derive(Debug, PartialEq)]
enum Event {
    Done,
    /// A token event (with the chat delta's text, when kept).
    Token,
    /// Anything else (a usage-only chunk).
    Other,
}

/// Classifies one chat or completions payload, recording usage and text.
fn read_openai_event(payload: &[u8], kind: StreamKind, out: &mut StreamOutcome) -> Result<Event, String> {
    let value: serde_json::Value =
        serde_json::from_slice(payload).map_err(|e| format!("stream event is not JSON: {e}"))?;
    if let Some(error) = value.get("error") {
        return Err(format!(
            "error event: {}",
            error.to_string().chars().take(200).collect::<String>()
        ));
    }
    if let Some(usage) = value.get("usage").filter(|u| !u.is_null()) {
        read_usage(usage, out);
    }
    let Some(choice) = value
        .get("choices")
        .and_then(|c| c.as_array())
        .and_then(|c| c.first())
    else {
        return Ok(Event::Other);
    };
    if kind.keep_text {
        let piece = choice
            .get("delta")
            .and_then(|d| d.get("content"))
            .or_else(|| choice.get("text"))
            .and_then(|t| t.as_str())
            .unwrap_or_default();
        out.text.push_str(piece);
    }
    Ok(Event::Token)
}

/// OpenAI usage: `prompt_tokens`, `prompt_tokens_details.cached_tokens`.
fn read_usage(usage: &serde_json::Value, out: &mut StreamOutcome) {
    if let Some(p) = usage.get("prompt_tokens").and_then(|v| v.as_u64()) {
        out.prompt_tokens = Some(p);
    }
    if let Some(c) = usage
        .get("prompt_tokens_details")
        .and_then(|d| d.get("cached_tokens"))
        .and_then(|v| v.as_u64())
    {
        out.cached_tokens = Some(c);
    }
}

/// SGLang `/generate`: `meta_info.prompt_tokens` and `cached_tokens` of the
/// last event (events carry the cumulative text, so only the last is read).
fn read_generate_tail(payload: &[u8], out: &mut StreamOutcome) {
    let Ok(value) = serde_json::from_slice::<serde_json::Value>(payload) else {
        return;
    };
    let item = value.as_array().and_then(|a| a.first()).unwrap_or(&value);
    if let Some(meta) = item.get("meta_info") {
        out.prompt_tokens = meta.get("prompt_tokens").and_then(|v| v.as_u64());
        out.cached_tokens = meta.get("cached_tokens").and_then(|v| v.as_u64());
    }
}

async fn stream_into(
    client: &PooledClient,
    uri: &str,
    body: Bytes,
    kind: StreamKind,
    start: Instant,
    out: &mut StreamOutcome,
) -> Result<(), String> {
    let response = client
        .request(post(uri, body, kind.priority)?)
        .await
        .map_err(|e| format!("transport: {e}"))?;
    let status = response.status();
    let admission = response.headers().contains_key("x-dprank-admission");
    let mut body = response.into_body();
    if is_refusal(status.as_u16(), admission) {
        let _ = body.collect().await;
        out.rejected = Some(status.as_u16());
        return Ok(());
    }
    if !status.is_success() {
        let text = body
            .collect()
            .await
            .map(|b| String::from_utf8_lossy(&b.to_bytes()).into_owned())
            .unwrap_or_default();
        return Err(format!(
            "HTTP {}: {}",
            status.as_u16(),
            text.chars().take(200).collect::<String>()
        ));
    }
    let mut pending: Vec<u8> = Vec::new();
    let mut scanned = 0;
    let mut last_token: Option<Instant> = None;
    let mut last_generate_payload: Vec<u8> = Vec::new();
    let mut done = false;
    loop {
        let Some(frame) = body.frame().await else { break };
        let frame = frame.map_err(|e| format!("stream: {e}"))?;
        let Ok(data) = frame.into_data() else {
            continue;
        };
        let now = Instant::now();
        pending.extend_from_slice(&data);
        let mut tokens_now = 0u32;
        let mut consumed = 0;
        while let Some(end) = event_end(&pending, scanned.max(consumed)) {
            let event = pending.get(consumed..end).unwrap_or_default();
            if let Some(payload) = event.strip_prefix(b"data:") {
                let payload = payload.trim_ascii();
                let class = if payload == b"[DONE]" {
                    Event::Done
                } else if kind.api == Api::Generate {
                    last_generate_payload.clear();
                    last_generate_payload.extend_from_slice(payload);
                    Event::Token
                } else {
                    read_openai_event(payload, kind, out)?
                };
                match class {
                    Event::Done => done = true,
                    Event::Token => tokens_now += 1,
                    Event::Other => {}
                }
            }
            consumed = end + 2;
        }
        pending.drain(..consumed);
        // The next search may start where this one stopped (minus one byte of a split "\n\n").
        scanned = pending.len().saturating_sub(1);
        if tokens_now > 0 {
            match last_token {
                None => out.ttft = Some(now - start),
                Some(last) => out.itls.push(now - last),
            }
            for _ in 1..tokens_now {
                out.itls.push(Duration::ZERO);
            }
            out.tokens += tokens_now;
            last_token = Some(now);
        }
    }
    if kind.api == Api::Generate && !last_generate_payload.is_empty() {
        read_generate_tail(&last_generate_payload, out);
    }
    if !done {
        return Err("stream ended without [DONE]".into());
    }
    Ok(())
}

/// GET returning the body (load samples, counters).
pub async fn get_text(client: &PooledClient, uri: &str) -> Result<String, String> {
    let request = Request::get(uri)
        .body(Full::new(Bytes::new()))
        .map_err(|e| format!("bad request for {uri}: {e}"))?;
    let response = client
        .request(request)
        .await
        .map_err(|e| format!("GET {uri}: {e}"))?;
    let status = response.status();
    let bytes = response
        .into_body()
        .collect()
        .await
        .map_err(|e| format!("GET {uri}: {e}"))?
        .to_bytes();
    if !status.is_success() {
        return Err(format!("GET {uri}: HTTP {}", status.as_u16()));
    }
    Ok(String::from_utf8_lossy(&bytes).into_owned())
}

/// POST a JSON body, returning the response body (control calls).
pub async fn post_json(client: &PooledClient, uri: &str, body: String) -> Result<String, String> {
    let request = Request::post(uri)
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(body)))
        .map_err(|e| format!("bad request for {uri}: {e}"))?;
    let response = client
        .request(request)
        .await
        .map_err(|e| format!("POST {uri}: {e}"))?;
    let status = response.status();
    let bytes = response
        .into_body()
        .collect()
        .await
        .map_err(|e| format!("POST {uri}: {e}"))?
        .to_bytes();
    let text = String::from_utf8_lossy(&bytes).into_owned();
    if !status.is_success() {
        return Err(format!("POST {uri}: HTTP {}: {text}", status.as_u16()));
    }
    Ok(text)
}

/// One dedicated keep-alive HTTP/1.1 connection (closed-loop clients).
pub struct Connection {
    sender: SendRequest<Full<Bytes>>,
    authority: String,
}

impl Connection {
    pub async fn open(addr: SocketAddr) -> Result<Connection, String> {
        let stream = tokio::net::TcpStream::connect(addr)
            .await
            .map_err(|e| format!("connect {addr}: {e}"))?;
        stream
            .set_nodelay(true)
            .map_err(|e| format!("TCP_NODELAY on {addr}: {e}"))?;
        let (sender, connection) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
            .await
            .map_err(|e| format!("handshake {addr}: {e}"))?;
        tokio::spawn(connection);
        Ok(Connection {
            sender,
            authority: addr.to_string(),
        })
    }

    /// Sends a JSON POST of `body` to `path`; returns when it was sent and
    /// the response (its head read, not its body).
    async fn send(&mut self, path: &str, body: Bytes) -> Result<(Instant, Response<Incoming>), String> {
        let request = Request::post(path)
            .header("host", &self.authority)
            .header("content-type", "application/json")
            .body(Full::new(body))
            .map_err(|e| format!("bad request: {e}"))?;
        let start = Instant::now();
        self.sender
            .ready()
            .await
            .map_err(|e| format!("connection: {e}"))?;
        let response = self
            .sender
            .send_request(request)
            .await
            .map_err(|e| format!("transport: {e}"))?;
        Ok((start, response))
    }

    /// POSTs `body` to `path`, reads the whole response; returns the latency.
    pub async fn post(&mut self, path: &str, body: Bytes) -> Result<Duration, String> {
        let (start, response) = self.send(path, body).await?;
        let status = response.status();
        response
            .into_body()
            .collect()
            .await
            .map_err(|e| format!("body: {e}"))?;
        if !status.is_success() {
            return Err(format!("HTTP {}", status.as_u16()));
        }
        Ok(start.elapsed())
    }

    /// POSTs a streamed request and reads the response as it comes; returns
    /// when its first and its last body bytes arrived, from the send.
    pub async fn post_streamed(&mut self, path: &str, body: Bytes) -> Result<(Duration, Duration), String> {
        let (start, response) = self.send(path, body).await?;
        if !response.status().is_success() {
            return Err(format!("HTTP {}", response.status().as_u16()));
        }
        let mut body = response.into_body();
        let (mut first, mut last) = (None, Duration::ZERO);
        while let Some(frame) = body.frame().await {
            let frame = frame.map_err(|e| format!("body: {e}"))?;
            if frame.data_ref().is_some_and(|d| !d.is_empty()) {
                last = start.elapsed();
                first.get_or_insert(last);
            }
        }
        Ok((first.unwrap_or(last), last))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn openai_events_yield_tokens_text_and_usage() {
        let kind = StreamKind {
            priority: None,
            api: Api::Chat,
            keep_text: true,
        };
        let mut out = StreamOutcome::default();
        let token =
            br#"{"choices":[{"index":0,"delta":{"role":"assistant","content":" the"}}],"usage":null}"#;
        assert_eq!(read_openai_event(token, kind, &mut out), Ok(Event::Token));
        let usage = br#"{"choices":[],"usage":{"prompt_tokens":90,"completion_tokens":3,"prompt_tokens_details":{"cached_tokens":64}}}"#;
        assert_eq!(read_openai_event(usage, kind, &mut out), Ok(Event::Other));
        assert_eq!(
            (out.text.as_str(), out.prompt_tokens, out.cached_tokens),
            (" the", Some(90), Some(64))
        );
        assert!(read_openai_event(br#"{"error":{"message":"boom"}}"#, kind, &mut out).is_err());
        assert!(read_openai_event(b"not json", kind, &mut out).is_err());
    }

    #[test]
    fn generate_tail_reads_meta_info() {
        let mut out = StreamOutcome::default();
        read_generate_tail(
            br#"{"text":"a b","meta_info":{"prompt_tokens":12,"cached_tokens":8,"completion_tokens":2}}"#,
            &mut out,
        );
        assert_eq!((out.prompt_tokens, out.cached_tokens), (Some(12), Some(8)));
    }
}
