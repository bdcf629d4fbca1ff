//! HTTP/1.1 clients with TCP_NODELAY: a pooled client for open-loop load and
//! single dedicated connections for closed-loop overhead runs.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::client::conn::http1::SendRequest;
use hyper::Request;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::{TokioExecutor, TokioIo};

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
    /// Time to the first SSE data event.
    pub ttft: Option<Duration>,
    /// Gaps between successive data events (0 for events that arrived together).
    pub itls: Vec<Duration>,
    pub e2e: Duration,
    pub tokens: u32,
}

fn post(uri: &str, body: Bytes) -> Result<Request<Full<Bytes>>, String> {
    Request::post(uri)
        .header("content-type", "application/json")
        .header("accept", "text/event-stream")
        .body(Full::new(body))
        .map_err(|e| format!("bad request for {uri}: {e}"))
}

/// Finds the end of the next SSE event (`\n\n`) at or after `from`.
fn event_end(buf: &[u8], from: usize) -> Option<usize> {
    buf.get(from..)?
        .windows(2)
        .position(|w| w == b"\n\n")
        .map(|p| p + from)
}

/// Sends a streamed request and times every SSE data event as it arrives.
pub async fn stream_request(client: &PooledClient, uri: &str, body: Bytes) -> StreamOutcome {
    let start = Instant::now();
    let mut out = StreamOutcome::default();
    let result = stream_into(client, uri, body, start, &mut out).await;
    out.e2e = start.elapsed();
    if let Err(e) = result {
        out.error = Some(e);
    }
    out
}

async fn stream_into(
    client: &PooledClient,
    uri: &str,
    body: Bytes,
    start: Instant,
    out: &mut StreamOutcome,
) -> Result<(), String> {
    let response = client
        .request(post(uri, body)?)
        .await
        .map_err(|e| format!("transport: {e}"))?;
    let status = response.status();
    let mut body = response.into_body();
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
    let mut done = false;
    while let Some(frame) = body.frame().await {
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
                if payload.trim_ascii() == b"[DONE]" {
                    done = true;
                } else {
                    tokens_now += 1;
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

    /// POSTs `body` to `path`, reads the whole response; returns the latency.
    pub async fn post(&mut self, path: &str, body: Bytes) -> Result<Duration, String> {
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
}
