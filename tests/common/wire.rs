//! HTTP/1.1 answers broken at the wire, the ways a worker that crashes, is
//! killed or misbehaves breaks them: a reset before any byte, a head or a
//! body cut short, a bad chunk, a trickle, a head too large, a 1xx first, a
//! body the caller did not ask to be compressed. `faulty::LoadFront` sends
//! them in place of a worker's answer to the calls the filter makes.

use flate2::write::GzEncoder;
use flate2::Compression;
use std::io::{Read, Write};
use std::net::{Shutdown, TcpStream};
use std::time::{Duration, Instant};

/// One way to answer (or not) a request at the wire.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WireFault {
    /// The connection is reset (RST) before a byte of the answer.
    ResetBeforeAnyByte,
    /// The status line and half a header line, then the connection closes.
    HeadersCutMidLine,
    /// The head with `content-length`, half the body, then a close.
    BodyCutShort,
    /// A chunked body cut in the middle of its first chunk.
    ChunkedCutMidChunk,
    /// A chunked body whose first chunk size is not hexadecimal.
    BadChunkSize,
    /// HTTP/1.0 without a length: the body ends when the connection closes
    /// (a whole answer).
    CloseDelimited,
    /// The head, then the body one byte a second (past any poll timeout).
    Trickle,
    /// A head of 66 KiB (more than the 60 KiB Envoy allows a client's).
    HugeHeaders,
    /// `103 Early Hints`, then the whole answer.
    EarlyHintsThenWhole,
    /// `103 Early Hints`, then a head and half the body, then a close.
    EarlyHintsThenCut,
    /// The body gzipped, with `content-encoding: gzip`, though the request
    /// did not ask for it.
    GzipUnasked,
    /// A well-formed 200 with the answer of another endpoint.
    OtherPath,
    /// The whole answer on a kept-alive connection, closed by the worker
    /// 50 ms later, before the next request.
    KeepAliveClosed,
}

impl WireFault {
    /// Every fault, for a matrix.
    pub const ALL: [WireFault; 13] = [
        WireFault::ResetBeforeAnyByte,
        WireFault::HeadersCutMidLine,
        WireFault::BodyCutShort,
        WireFault::ChunkedCutMidChunk,
        WireFault::BadChunkSize,
        WireFault::CloseDelimited,
        WireFault::Trickle,
        WireFault::HugeHeaders,
        WireFault::EarlyHintsThenWhole,
        WireFault::EarlyHintsThenCut,
        WireFault::GzipUnasked,
        WireFault::OtherPath,
        WireFault::KeepAliveClosed,
    ];

    /// Whether the caller gets a whole, readable answer of the right
    /// endpoint: Some(true) it does, Some(false) it does not, None it is
    /// the proxy's choice (a head of 66 KiB is within Envoy 1.40's limit
    /// for answers to its own calls).
    pub fn delivers_answer(self) -> Option<bool> {
        match self {
            WireFault::CloseDelimited | WireFault::EarlyHintsThenWhole | WireFault::KeepAliveClosed => {
                Some(true)
            }
            WireFault::HugeHeaders => None,
            _ => Some(false),
        }
    }
}

/// A request as read off the connection: its head (its body is read and
/// dropped, so that the next request starts where it should).
#[derive(Debug, Clone)]
pub struct Request {
    pub head: Vec<u8>,
}

impl Request {
    fn start_line(&self) -> String {
        let text = String::from_utf8_lossy(&self.head);
        text.lines().next().unwrap_or_default().to_string()
    }

    pub fn method(&self) -> String {
        self.start_line()
            .split_whitespace()
            .next()
            .unwrap_or_default()
            .to_string()
    }

    pub fn path(&self) -> String {
        self.start_line()
            .split_whitespace()
            .nth(1)
            .unwrap_or("/")
            .to_string()
    }
}

/// Reads one request head into `buf` and takes it out; None at EOF.
pub fn read_head(stream: &mut TcpStream, buf: &mut Vec<u8>) -> Option<Vec<u8>> {
    let mut chunk = [0u8; 8192];
    loop {
        if let Some(at) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            return Some(buf.drain(..at + 4).collect());
        }
        match stream.read(&mut chunk) {
            Ok(0) | Err(_) => return None,
            Ok(n) => buf.extend_from_slice(&chunk[..n]),
        }
    }
}

/// The request whose head was read, its body (by `content-length`) read off.
pub fn with_body(head: Vec<u8>, stream: &mut TcpStream, buf: &mut Vec<u8>) -> Option<Request> {
    let text = String::from_utf8_lossy(&head).to_ascii_lowercase();
    let length: usize = text
        .lines()
        .find_map(|l| l.strip_prefix("content-length:"))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(0);
    let mut chunk = [0u8; 8192];
    while buf.len() < length {
        match stream.read(&mut chunk) {
            Ok(0) | Err(_) => return None,
            Ok(n) => buf.extend_from_slice(&chunk[..n]),
        }
    }
    buf.drain(..length);
    Some(Request { head })
}

/// The next request on a kept-alive connection, body included.
pub fn read_request(stream: &mut TcpStream, buf: &mut Vec<u8>) -> Option<Request> {
    let head = read_head(stream, buf)?;
    with_body(head, stream, buf)
}

fn head(status: u16, content_type: &str, extra: &str) -> String {
    format!("HTTP/1.1 {status} X\r\ncontent-type: {content_type}\r\n{extra}")
}

/// Sends `fault` in place of the answer (`status`, `content_type`, `body`).
/// True when the connection stays open for another request.
pub fn answer(
    stream: &mut TcpStream,
    fault: WireFault,
    status: u16,
    content_type: &str,
    body: &[u8],
) -> bool {
    let half = &body[..body.len() / 2];
    let whole = |s: &mut TcpStream| -> std::io::Result<()> {
        s.write_all(
            head(
                status,
                content_type,
                &format!("content-length: {}\r\n\r\n", body.len()),
            )
            .as_bytes(),
        )?;
        s.write_all(body)
    };
    let cut = |s: &mut TcpStream| -> std::io::Result<()> {
        s.write_all(
            head(
                status,
                content_type,
                &format!("content-length: {}\r\n\r\n", body.len().max(2)),
            )
            .as_bytes(),
        )?;
        s.write_all(half)?;
        s.flush()
    };
    let written = match fault {
        WireFault::ResetBeforeAnyByte => {
            reset(stream);
            return false;
        }
        WireFault::HeadersCutMidLine => stream.write_all(b"HTTP/1.1 200 OK\r\ncontent-ty"),
        WireFault::BodyCutShort => cut(stream),
        WireFault::ChunkedCutMidChunk => stream
            .write_all(head(status, content_type, "transfer-encoding: chunked\r\n\r\n").as_bytes())
            .and_then(|_| stream.write_all(format!("{:x}\r\n", body.len().max(2)).as_bytes()))
            .and_then(|_| stream.write_all(half)),
        WireFault::BadChunkSize => stream
            .write_all(head(status, content_type, "transfer-encoding: chunked\r\n\r\n").as_bytes())
            .and_then(|_| stream.write_all(b"zz\r\n"))
            .and_then(|_| stream.write_all(body)),
        WireFault::CloseDelimited => stream
            .write_all(format!("HTTP/1.0 {status} X\r\ncontent-type: {content_type}\r\n\r\n").as_bytes())
            .and_then(|_| stream.write_all(body)),
        WireFault::Trickle => {
            let started = Instant::now();
            let mut result = stream.write_all(
                head(
                    status,
                    content_type,
                    &format!("content-length: {}\r\n\r\n", body.len()),
                )
                .as_bytes(),
            );
            for byte in body {
                if result.is_err() || started.elapsed() > Duration::from_secs(10) {
                    break;
                }
                std::thread::sleep(Duration::from_secs(1));
                result = stream.write_all(&[*byte]);
            }
            result
        }
        WireFault::HugeHeaders => {
            let pad = format!("x-pad: {}\r\n", "a".repeat(1000));
            let mut extra = pad.repeat(66);
            extra.push_str(&format!("content-length: {}\r\n\r\n", body.len()));
            stream
                .write_all(head(status, content_type, &extra).as_bytes())
                .and_then(|_| stream.write_all(body))
        }
        WireFault::EarlyHintsThenWhole => {
            let hints =
                stream.write_all(b"HTTP/1.1 103 Early Hints\r\nlink: </style.css>; rel=preload\r\n\r\n");
            match hints.and_then(|_| whole(stream)) {
                Ok(()) => return true,
                Err(_) => return false,
            }
        }
        WireFault::EarlyHintsThenCut => stream
            .write_all(b"HTTP/1.1 103 Early Hints\r\nlink: </style.css>; rel=preload\r\n\r\n")
            .and_then(|_| cut(stream)),
        WireFault::GzipUnasked => {
            let mut encoder = GzEncoder::new(Vec::new(), Compression::default());
            let zipped = encoder
                .write_all(body)
                .and_then(|_| encoder.finish())
                .unwrap_or_default();
            stream
                .write_all(
                    head(
                        status,
                        content_type,
                        &format!(
                            "content-encoding: gzip\r\ncontent-length: {}\r\n\r\n",
                            zipped.len()
                        ),
                    )
                    .as_bytes(),
                )
                .and_then(|_| stream.write_all(&zipped))
        }
        WireFault::OtherPath => {
            let other = br#"{"model_path":"deepseek-ai/DeepSeek-V3","tokenizer_path":"deepseek-ai/DeepSeek-V3","version":"0.5.0"}"#;
            match stream
                .write_all(
                    head(
                        200,
                        "application/json",
                        &format!("content-length: {}\r\n\r\n", other.len()),
                    )
                    .as_bytes(),
                )
                .and_then(|_| stream.write_all(other))
            {
                Ok(()) => return true,
                Err(_) => return false,
            }
        }
        WireFault::KeepAliveClosed => {
            let _ = whole(stream);
            std::thread::sleep(Duration::from_millis(50));
            Ok(())
        }
    };
    let _ = written;
    let _ = stream.shutdown(Shutdown::Both);
    false
}

/// Makes the connection close with a reset (RST, not FIN) when its last
/// handle is dropped.
pub fn reset(stream: &TcpStream) {
    let _ = socket2::SockRef::from(stream).set_linger(Some(Duration::ZERO));
}
