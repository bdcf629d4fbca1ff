//! Workers that fail in ways the simulator cannot show by itself: a worker
//! process restarted on the same address (with other options), and a load
//! front that stands at a worker's address, pipes serving traffic to a real
//! simulator and answers load polls itself: late, or with a report the test
//! writes.

use super::sim::{kill_child, spawn};
use super::{tail, Sim, TestDir};
use std::io::{BufReader, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::path::PathBuf;
use std::process::{Child, ChildStdout};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// A `dprank-sim` process listening on a given address: a worker restarted
/// where Envoy expects it. Reach it through the [`Sim`] handle of the worker
/// it replaces (same address); this guard only owns the process.
pub struct SimProcess {
    pub addr: SocketAddr,
    child: Option<Child>,
    _stdout: Option<BufReader<ChildStdout>>,
    stderr_path: PathBuf,
}

impl SimProcess {
    /// Starts `dprank-sim --listen <addr> --dp-size <dp_size> <extra_args>`,
    /// retrying for a few seconds while the address is still taken.
    pub fn start_at(
        dir: &TestDir,
        label: &str,
        addr: SocketAddr,
        dp_size: u32,
        extra_args: &[&str],
    ) -> SimProcess {
        let stderr_path = dir.file(&format!("sim-{label}.stderr"));
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let (child, stdout, line, read) = spawn(&stderr_path, &addr.to_string(), dp_size, extra_args);
            let ready = read && line.starts_with("ready ");
            if ready {
                return SimProcess {
                    addr,
                    child: Some(child),
                    _stdout: Some(stdout),
                    stderr_path,
                };
            }
            kill_child(&mut Some(child));
            assert!(
                Instant::now() < deadline,
                "simulator {label} could not listen on {addr}; stderr:\n{}",
                tail(&stderr_path, 20)
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    pub fn kill(&mut self) {
        kill_child(&mut self.child);
    }
}

impl Drop for SimProcess {
    fn drop(&mut self) {
        let was_running = self.child.is_some();
        self.kill();
        if std::thread::panicking() && was_running {
            eprintln!(
                "---- restarted simulator at {} stderr, last lines ----\n{}",
                self.addr,
                tail(&self.stderr_path, 30)
            );
        }
    }
}

/// How a [`LoadFront`] answers load polls (`GET /v1/loads...`, `GET /get_load`).
#[derive(Debug, Clone)]
pub enum LoadAnswer {
    /// The simulator's own answer (status and body), sent `delay` late.
    Forward { delay: Duration },
    /// A fixed 200 JSON report.
    Fixed(String),
}

/// Stands at a worker's address: connections whose first request is a load
/// poll are answered by the front (see [`LoadAnswer`]); every other
/// connection is piped byte for byte to the simulator behind it.
pub struct LoadFront {
    pub addr: SocketAddr,
    answer: Arc<Mutex<LoadAnswer>>,
    polls: Arc<AtomicU64>,
    stop: Arc<AtomicBool>,
    connections: Arc<Mutex<Vec<TcpStream>>>,
    accept: Option<JoinHandle<()>>,
}

fn is_load_poll(head: &[u8]) -> bool {
    head.starts_with(b"GET /v1/loads") || head.starts_with(b"GET /get_load")
}

impl LoadFront {
    pub fn start(listen: SocketAddr, backend: SocketAddr) -> LoadFront {
        let listener =
            TcpListener::bind(listen).unwrap_or_else(|e| panic!("load front: cannot bind {listen}: {e}"));
        let addr = listener.local_addr().expect("load front address");
        let answer = Arc::new(Mutex::new(LoadAnswer::Forward {
            delay: Duration::ZERO,
        }));
        let polls = Arc::new(AtomicU64::new(0));
        let stop = Arc::new(AtomicBool::new(false));
        let connections = Arc::new(Mutex::new(Vec::new()));
        let accept = {
            let (answer, polls, stop, connections) =
                (answer.clone(), polls.clone(), stop.clone(), connections.clone());
            std::thread::spawn(move || {
                for client in listener.incoming() {
                    if stop.load(Ordering::SeqCst) {
                        break;
                    }
                    let Ok(client) = client else { continue };
                    if let Ok(clone) = client.try_clone() {
                        connections.lock().unwrap().push(clone);
                    }
                    let (answer, polls, connections) = (answer.clone(), polls.clone(), connections.clone());
                    std::thread::spawn(move || serve(client, backend, &answer, &polls, &connections));
                }
            })
        };
        LoadFront {
            addr,
            answer,
            polls,
            stop,
            connections,
            accept: Some(accept),
        }
    }

    pub fn set(&self, answer: LoadAnswer) {
        *self.answer.lock().unwrap() = answer;
    }

    /// Load polls received so far.
    pub fn polls(&self) -> u64 {
        self.polls.load(Ordering::SeqCst)
    }
}

impl Drop for LoadFront {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        for connection in self.connections.lock().unwrap().drain(..) {
            let _ = connection.shutdown(Shutdown::Both);
        }
        // Wake the accept loop so it sees the stop flag.
        let _ = TcpStream::connect_timeout(&self.addr, Duration::from_secs(1));
        if let Some(accept) = self.accept.take() {
            let _ = accept.join();
        }
    }
}

/// Reads one request head (no body: polls are GETs) into `buf`; None at EOF.
fn read_request_head(stream: &mut TcpStream, buf: &mut Vec<u8>) -> Option<Vec<u8>> {
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

fn serve(
    mut client: TcpStream,
    backend: SocketAddr,
    answer: &Mutex<LoadAnswer>,
    polls: &AtomicU64,
    connections: &Mutex<Vec<TcpStream>>,
) {
    let mut buf = Vec::new();
    let Some(first) = read_request_head(&mut client, &mut buf) else {
        return;
    };
    if !is_load_poll(&first) {
        pipe(client, backend, first, buf, connections);
        return;
    }
    // A poll connection (Envoy keeps it alive): answer each poll in turn.
    let agent = ureq::AgentBuilder::new().timeout(Duration::from_secs(2)).build();
    let mut head = first;
    loop {
        polls.fetch_add(1, Ordering::SeqCst);
        let path = String::from_utf8_lossy(&head)
            .split_whitespace()
            .nth(1)
            .unwrap_or("/v1/loads")
            .to_string();
        let plan = answer.lock().unwrap().clone();
        let reply = match plan {
            LoadAnswer::Fixed(body) => Some((200, body)),
            LoadAnswer::Forward { delay } => {
                let fetched = match agent.get(&format!("http://{backend}{path}")).call() {
                    Ok(r) => Some(r),
                    Err(ureq::Error::Status(_, r)) => Some(r),
                    // The simulator hangs or is gone: so does the front.
                    Err(_) => None,
                }
                .map(|r| (r.status(), r.into_string().unwrap_or_default()));
                std::thread::sleep(delay);
                fetched
            }
        };
        let Some((status, body)) = reply else {
            let _ = client.shutdown(Shutdown::Both);
            return;
        };
        let response = format!(
            "HTTP/1.1 {status} X\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
            body.len()
        );
        if client.write_all(response.as_bytes()).is_err() {
            return;
        }
        match read_request_head(&mut client, &mut buf) {
            Some(next) => head = next,
            None => return,
        }
    }
}

/// Pipes a serving connection to the simulator, starting with what was read.
fn pipe(
    client: TcpStream,
    backend: SocketAddr,
    head: Vec<u8>,
    rest: Vec<u8>,
    connections: &Mutex<Vec<TcpStream>>,
) {
    let Ok(mut upstream) = TcpStream::connect(backend) else {
        let _ = client.shutdown(Shutdown::Both);
        return;
    };
    let _ = upstream.set_nodelay(true);
    let _ = client.set_nodelay(true);
    if upstream
        .write_all(&head)
        .and_then(|_| upstream.write_all(&rest))
        .is_err()
    {
        return;
    }
    let (Ok(mut up_read), Ok(mut client_write), Ok(clone)) =
        (upstream.try_clone(), client.try_clone(), upstream.try_clone())
    else {
        return;
    };
    connections.lock().unwrap().push(clone);
    let mut client_read = client;
    let back = std::thread::spawn(move || {
        let _ = std::io::copy(&mut up_read, &mut client_write);
        let _ = client_write.shutdown(Shutdown::Write);
    });
    let _ = std::io::copy(&mut client_read, &mut upstream);
    let _ = upstream.shutdown(Shutdown::Write);
    let _ = back.join();
}

/// The simulator behind a [`LoadFront`] and the front itself.
pub struct Fronted {
    pub front: LoadFront,
    /// The simulator; its replies name its own address, not the front's.
    pub backend: Sim,
}

/// A worker behind a load front. Returns a [`Sim`] handle at the front's
/// address (the address Envoy and the filter know; its control, request and
/// counter calls reach the simulator through the front) and the front. The
/// address is taken from a throwaway simulator (started, then killed).
pub fn fronted_sim(dir: &TestDir, name: &str, dp_size: u32, extra_args: &[&str]) -> (Sim, Fronted) {
    let mut handle = Sim::start(dir, name, dp_size, extra_args);
    handle.kill();
    let backend = Sim::start(dir, &format!("{name}-backend"), dp_size, extra_args);
    let front = LoadFront::start(handle.addr, backend.addr);
    (handle, Fronted { front, backend })
}
