//! Clients for what ureq does not send: `expect: 100-continue` the way curl
//! sends it (head first, body after the interim 100), and HTTP/2 with prior
//! knowledge (h2c, as `curl --http2-prior-knowledge`), with optional request
//! trailers. HTTP/1.0 and chunked bodies with trailers need no more than
//! [`super::http::raw_exchange`].

use super::http::parse_response;
use super::Reply;
use bytes::Bytes;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::{Duration, Instant};

/// Reads from `stream` until `raw` holds a complete response head; returns its end.
fn read_head(stream: &mut TcpStream, raw: &mut Vec<u8>) -> Option<usize> {
    let mut buf = [0u8; 16 * 1024];
    loop {
        if let Some(at) = raw.windows(4).position(|w| w == b"\r\n\r\n") {
            return Some(at + 4);
        }
        match stream.read(&mut buf) {
            Ok(0) | Err(_) => return None,
            Ok(n) => raw.extend_from_slice(&buf[..n]),
        }
    }
}

/// An `expect: 100-continue` POST as curl sends it: the head alone, then the
/// body once the interim `100 Continue` arrived (or after 1 s without one, as
/// curl does). Returns whether a 100 came first, and the final response.
pub fn expect_continue_exchange(addr: SocketAddr, head: &str, body: &[u8]) -> (bool, Reply) {
    let mut stream = TcpStream::connect(addr).expect("connect to Envoy");
    stream.set_nodelay(true).expect("set nodelay");
    let head = format!(
        "{}\r\nexpect: 100-continue\r\ncontent-length: {}\r\nconnection: close\r\n\r\n",
        head.trim_end(),
        body.len()
    );
    stream.write_all(head.as_bytes()).expect("write head");
    stream
        .set_read_timeout(Some(Duration::from_secs(1)))
        .expect("set read timeout");
    let mut raw = Vec::new();
    let interim = match read_head(&mut stream, &mut raw) {
        Some(end) if raw.starts_with(b"HTTP/1.1 100") => {
            raw.drain(..end);
            true
        }
        // A final answer before the body (an error), or nothing within 1 s.
        _ => false,
    };
    if raw.is_empty() {
        stream.write_all(body).expect("write body");
    }
    stream
        .set_read_timeout(Some(Duration::from_secs(60)))
        .expect("set read timeout");
    let _ = stream.read_to_end(&mut raw);
    (interim, parse_response(&raw))
}

/// One HTTP/2 request over a fresh prior-knowledge (h2c) connection. The body
/// goes out as `parts` (one DATA frame each, flow control permitting), then
/// `trailers` if any. Returns the complete response (header names lowercase).
pub fn h2_exchange(
    addr: SocketAddr,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    parts: &[&[u8]],
    trailers: &[(&str, &str)],
) -> Reply {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("tokio runtime");
    let exchange = async {
        let tcp = tokio::net::TcpStream::connect(addr)
            .await
            .expect("connect to Envoy");
        tcp.set_nodelay(true).expect("set nodelay");
        let (client, connection) = h2::client::handshake(tcp).await.expect("h2 handshake");
        tokio::spawn(async move {
            let _ = connection.await;
        });
        let mut request = http::Request::builder()
            .method(method)
            .uri(format!("http://{addr}{path}"));
        for (name, value) in headers {
            request = request.header(*name, *value);
        }
        let request = request.body(()).expect("h2 request");
        let no_body = parts.is_empty() && trailers.is_empty();
        let mut client = client.ready().await.expect("h2 connection ready");
        let (response, mut send) = client.send_request(request, no_body).expect("send h2 request");
        for (i, part) in parts.iter().enumerate() {
            let last = i + 1 == parts.len() && trailers.is_empty();
            let mut rest = Bytes::copy_from_slice(part);
            loop {
                send.reserve_capacity(rest.len().max(1));
                let granted = std::future::poll_fn(|cx| send.poll_capacity(cx))
                    .await
                    .expect("h2 stream open")
                    .expect("h2 capacity");
                let chunk = rest.split_to(granted.min(rest.len()));
                let done = rest.is_empty();
                send.send_data(chunk, last && done).expect("send h2 data");
                if done {
                    break;
                }
            }
        }
        if !trailers.is_empty() {
            let mut map = http::HeaderMap::new();
            for (name, value) in trailers {
                map.append(
                    http::header::HeaderName::from_bytes(name.as_bytes()).expect("trailer name"),
                    http::HeaderValue::from_str(value).expect("trailer value"),
                );
            }
            send.send_trailers(map).expect("send h2 trailers");
        }
        let response = response.await.expect("h2 response");
        let status = response.status().as_u16();
        let headers: Vec<(String, String)> = response
            .headers()
            .iter()
            .map(|(k, v)| {
                (
                    k.as_str().to_ascii_lowercase(),
                    String::from_utf8_lossy(v.as_bytes()).into_owned(),
                )
            })
            .collect();
        let mut stream = response.into_body();
        let mut body = Vec::new();
        while let Some(data) = stream.data().await {
            let data = data.expect("h2 response body");
            let _ = stream.flow_control().release_capacity(data.len());
            body.extend_from_slice(&data);
        }
        Reply {
            status,
            headers,
            body,
        }
    };
    let deadline = Instant::now() + Duration::from_secs(60);
    runtime.block_on(async {
        tokio::time::timeout(deadline - Instant::now(), exchange)
            .await
            .expect("h2 exchange not complete after 60 s")
    })
}
