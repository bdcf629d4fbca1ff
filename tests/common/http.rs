//! Blocking HTTP helpers: a ureq client that returns every status as a
//! [`Reply`], and a raw HTTP/1.1 client for what ureq will not send as is
//! (a chunked body written piece by piece, a body the server refuses early).

use serde_json::Value;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::{Duration, Instant};

/// A complete HTTP response.
#[derive(Clone)]
pub struct Reply {
    pub status: u16,
    /// Lowercase names.
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
}

impl std::fmt::Debug for Reply {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "Reply {{ status: {}, headers: {:?}, body: {:?} }}",
            self.status,
            self.headers,
            String::from_utf8_lossy(&self.body[..self.body.len().min(400)])
        )
    }
}

impl Reply {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }

    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }

    pub fn json(&self) -> Value {
        serde_json::from_slice(&self.body)
            .unwrap_or_else(|e| panic!("reply body is not JSON ({e}): {self:?}"))
    }

    /// The rank the simulator served on (`x-sim-dp-rank`, -1 = none).
    pub fn rank(&self) -> i64 {
        self.header("x-sim-dp-rank")
            .and_then(|r| r.parse().ok())
            .unwrap_or_else(|| panic!("reply without x-sim-dp-rank: {self:?}"))
    }
}

#[derive(Clone)]
pub struct Client {
    agent: ureq::Agent,
}

impl Default for Client {
    fn default() -> Self {
        Client::new()
    }
}

impl Client {
    pub fn new() -> Client {
        Client {
            agent: ureq::AgentBuilder::new()
                .timeout_connect(Duration::from_secs(5))
                .timeout_read(Duration::from_secs(60))
                .timeout_write(Duration::from_secs(60))
                .build(),
        }
    }

    fn finish(result: Result<ureq::Response, ureq::Error>, what: &str) -> Reply {
        let response = match result {
            Ok(r) => r,
            Err(ureq::Error::Status(_, r)) => r,
            Err(e) => panic!("{what}: {e}"),
        };
        let status = response.status();
        let headers = response
            .headers_names()
            .into_iter()
            .filter_map(|name| {
                let value = response.header(&name)?.to_string();
                Some((name.to_ascii_lowercase(), value))
            })
            .collect();
        let mut body = Vec::new();
        response
            .into_reader()
            .take(256 << 20)
            .read_to_end(&mut body)
            .unwrap_or_else(|e| panic!("{what}: reading the body: {e}"));
        Reply {
            status,
            headers,
            body,
        }
    }

    fn request(&self, method: &str, url: &str, headers: &[(&str, &str)]) -> ureq::Request {
        headers
            .iter()
            .fold(self.agent.request(method, url), |r, (k, v)| r.set(k, v))
    }

    pub fn get(&self, url: &str, headers: &[(&str, &str)]) -> Reply {
        Client::finish(self.request("GET", url, headers).call(), &format!("GET {url}"))
    }

    /// POST with a content-length body.
    pub fn post(&self, url: &str, headers: &[(&str, &str)], body: &[u8]) -> Reply {
        Client::finish(
            self.request("POST", url, headers).send_bytes(body),
            &format!("POST {url}"),
        )
    }

    /// POST, then hands the response to `read` while it streams.
    pub fn post_streaming<T>(
        &self,
        url: &str,
        body: &[u8],
        read: impl FnOnce(u16, &mut dyn BufRead) -> T,
    ) -> T {
        let response = match self
            .request("POST", url, &[("content-type", "application/json")])
            .send_bytes(body)
        {
            Ok(r) => r,
            Err(ureq::Error::Status(_, r)) => r,
            Err(e) => panic!("POST {url}: {e}"),
        };
        let status = response.status();
        let mut reader = BufReader::new(response.into_reader());
        read(status, &mut reader)
    }
}

/// One HTTP/1.1 exchange on a fresh connection (`connection: close`): writes
/// `head` (request line and headers, without the blank line), then each body
/// part with `pause` between them; reads the whole response. Write errors
/// after the head are ignored: a server may answer and close before the body
/// is complete (413).
pub fn raw_exchange(addr: SocketAddr, head: &str, parts: &[&[u8]], pause: Duration) -> Reply {
    raw_exchange_bytes(addr, head.as_bytes(), parts, pause)
}

/// [`raw_exchange`] with a head that may hold bytes that are not UTF-8.
pub fn raw_exchange_bytes(addr: SocketAddr, head: &[u8], parts: &[&[u8]], pause: Duration) -> Reply {
    let mut stream = TcpStream::connect(addr).expect("connect to Envoy");
    stream
        .set_read_timeout(Some(Duration::from_secs(60)))
        .expect("set read timeout");
    stream.set_nodelay(true).expect("set nodelay");
    let end = head
        .iter()
        .rposition(|b| !b.is_ascii_whitespace())
        .map_or(0, |i| i + 1);
    let mut head = head[..end].to_vec();
    head.extend_from_slice(b"\r\nconnection: close\r\n\r\n");
    stream.write_all(&head).expect("write head");
    for (i, part) in parts.iter().enumerate() {
        if i > 0 && !pause.is_zero() {
            std::thread::sleep(pause);
        }
        if stream.write_all(part).and_then(|_| stream.flush()).is_err() {
            break;
        }
    }
    let mut raw = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut buf = [0u8; 64 * 1024];
    loop {
        match stream.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => raw.extend_from_slice(&buf[..n]),
            // A reset after a complete response (the server refused the rest of the body).
            Err(_) if !raw.is_empty() => break,
            Err(e) => panic!("reading the response: {e}"),
        }
        assert!(Instant::now() < deadline, "response not complete after 60 s");
    }
    parse_response(&raw)
}

/// Parses a complete HTTP/1.x response (content-length, chunked or until close).
pub fn parse_response(raw: &[u8]) -> Reply {
    let split = raw
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .unwrap_or_else(|| panic!("no response head in {:?}", String::from_utf8_lossy(raw)));
    let head = String::from_utf8_lossy(&raw[..split]).into_owned();
    let mut lines = head.split("\r\n");
    let status: u16 = lines
        .next()
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("bad status line in {head:?}"));
    let headers: Vec<(String, String)> = lines
        .filter_map(|l| l.split_once(':'))
        .map(|(k, v)| (k.trim().to_ascii_lowercase(), v.trim().to_string()))
        .collect();
    let rest = &raw[split + 4..];
    let chunked = headers
        .iter()
        .any(|(k, v)| k == "transfer-encoding" && v.eq_ignore_ascii_case("chunked"));
    let body = if chunked {
        decode_chunked(rest)
    } else {
        rest.to_vec()
    };
    Reply {
        status,
        headers,
        body,
    }
}

fn decode_chunked(mut rest: &[u8]) -> Vec<u8> {
    let mut body = Vec::new();
    while let Some(eol) = rest.windows(2).position(|w| w == b"\r\n") {
        let size_text = String::from_utf8_lossy(&rest[..eol]);
        let size_text = size_text.split(';').next().unwrap_or("").trim();
        let size =
            usize::from_str_radix(size_text, 16).unwrap_or_else(|_| panic!("bad chunk size {size_text:?}"));
        rest = &rest[eol + 2..];
        if size == 0 {
            break;
        }
        body.extend_from_slice(&rest[..size.min(rest.len())]);
        rest = &rest[(size + 2).min(rest.len())..];
    }
    body
}

/// Encodes `parts` as HTTP/1.1 chunks, one chunk per part, plus the last chunk.
pub fn chunked(parts: &[&[u8]]) -> Vec<Vec<u8>> {
    let mut out: Vec<Vec<u8>> = parts
        .iter()
        .map(|p| {
            let mut chunk = format!("{:x}\r\n", p.len()).into_bytes();
            chunk.extend_from_slice(p);
            chunk.extend_from_slice(b"\r\n");
            chunk
        })
        .collect();
    out.push(b"0\r\n\r\n".to_vec());
    out
}
