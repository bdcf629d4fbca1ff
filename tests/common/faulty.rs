//! Workers that fail in ways the simulator cannot show by itself: a worker
//! process restarted on the same address (with other options), and a front
//! that stands at a worker's address, pipes serving traffic to a real
//! simulator and answers the calls the filter makes itself (load polls, or
//! PD's prefill legs): late, with a report the test writes, or broken at the
//! wire (`wire.rs`).

use super::sim::{kill_child, spawn};
use super::wire::{self, Request, WireFault};
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

/// How a [`LoadFront`] answers the calls it intercepts.
#[derive(Debug, Clone)]
pub enum LoadAnswer {
    /// The simulator's own answer (status and body), sent `delay` late.
    Forward { delay: Duration },
    /// A fixed 200 JSON report.
    Fixed(String),
    /// The simulator's own answer (a synthetic one to a POST), broken at
    /// the wire as the fault says.
    Wire(WireFault),
}

/// Which connections a [`LoadFront`] answers itself (by their first
/// request); every other connection is piped to the simulator.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Intercept {
    /// Load polls: `GET /v1/loads...`, `GET /get_load`, `GET /metrics`.
    LoadPolls,
    /// POSTs but the simulator's own controls: the prefill legs a PD
    /// filter sends a prefill worker.
    Posts,
    /// Every connection (an admin API the filter reads).
    Everything,
}

impl Intercept {
    fn takes(self, head: &[u8]) -> bool {
        match self {
            Intercept::LoadPolls => {
                head.starts_with(b"GET /v1/loads")
                    || head.starts_with(b"GET /get_load")
                    || head.starts_with(b"GET /metrics")
            }
            Intercept::Posts => head.starts_with(b"POST ") && !head.starts_with(b"POST /_sim/"),
            Intercept::Everything => true,
        }
    }
}

/// Stands at a worker's address: connections whose first request is a load
/// poll are answered by the front (see [`LoadAnswer`]); every other
/// connection is piped byte for byte to the simulator behind it.
pub struct LoadFront {
    pub addr: SocketAddr,
    answer: Arc<Mutex<LoadAnswer>>,
    /// Requests the front answered itself.
    polls: Arc<AtomicU64>,
    /// Requests it is answering now.
    answering: Arc<AtomicU64>,
    stop: Arc<AtomicBool>,
    connections: Arc<Mutex<Vec<TcpStream>>>,
    accept: Option<JoinHandle<()>>,
}

impl LoadFront {
    /// A front at `listen` (port 0: any) answering what `intercept` names,
    /// piping the rest to `backend`.
    pub fn intercepting(listen: SocketAddr, backend: SocketAddr, intercept: Intercept) -> LoadFront {
        let listener =
            TcpListener::bind(listen).unwrap_or_else(|e| panic!("load front: cannot bind {listen}: {e}"));
        let addr = listener.local_addr().expect("load front address");
        let answer = Arc::new(Mutex::new(LoadAnswer::Forward {
            delay: Duration::ZERO,
        }));
        let polls = Arc::new(AtomicU64::new(0));
        let answering = Arc::new(AtomicU64::new(0));
        let stop = Arc::new(AtomicBool::new(false));
        let connections = Arc::new(Mutex::new(Vec::new()));
        let accept = {
            let (answer, polls, answering, stop, connections) = (
                answer.clone(),
                polls.clone(),
                answering.clone(),
                stop.clone(),
                connections.clone(),
            );
            std::thread::spawn(move || {
                for client in listener.incoming() {
                    if stop.load(Ordering::SeqCst) {
                        break;
                    }
                    let Ok(client) = client else { continue };
                    if let Ok(clone) = client.try_clone() {
                        connections.lock().unwrap().push(clone);
                    }
                    let counts = Counts {
                        polls: polls.clone(),
                        answering: answering.clone(),
                    };
                    let (answer, connections) = (answer.clone(), connections.clone());
                    std::thread::spawn(move || {
                        serve(client, backend, intercept, &answer, &counts, &connections)
                    });
                }
            })
        };
        LoadFront {
            addr,
            answer,
            polls,
            answering,
            stop,
            connections,
            accept: Some(accept),
        }
    }

    pub fn set(&self, answer: LoadAnswer) {
        *self.answer.lock().unwrap() = answer;
    }

    /// Requests the front answered itself so far.
    pub fn polls(&self) -> u64 {
        self.polls.load(Ordering::SeqCst)
    }

    /// Requests the front is answering now (a poll in flight).
    pub fn answering(&self) -> u64 {
        self.answering.load(Ordering::SeqCst)
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

/// What a front counts of the requests it answers.
struct Counts {
    polls: Arc<AtomicU64>,
    answering: Arc<AtomicU64>,
}

fn serve(
    mut client: TcpStream,
    backend: SocketAddr,
    intercept: Intercept,
    answer: &Mutex<LoadAnswer>,
    counts: &Counts,
    connections: &Mutex<Vec<TcpStream>>,
) {
    let mut buf = Vec::new();
    let Some(head) = wire::read_head(&mut client, &mut buf) else {
        return;
    };
    if !intercept.takes(&head) {
        pipe(client, backend, head, buf, connections);
        return;
    }
    let Some(first) = wire::with_body(head, &mut client, &mut buf) else {
        return;
    };
    // An intercepted connection (Envoy keeps it alive): answer each request in turn.
    let agent = ureq::AgentBuilder::new().timeout(Duration::from_secs(2)).build();
    let mut request = first;
    loop {
        counts.polls.fetch_add(1, Ordering::SeqCst);
        counts.answering.fetch_add(1, Ordering::SeqCst);
        let answered = Answered(&counts.answering);
        if !answer_one(&mut client, &agent, backend, &request, answer) {
            // The front's own handle goes too: a reset needs the last one closed.
            let peer = client.peer_addr().ok();
            connections.lock().unwrap().retain(|c| c.peer_addr().ok() != peer);
            return;
        }
        drop(answered);
        match wire::read_request(&mut client, &mut buf) {
            Some(next) => request = next,
            None => return,
        }
    }
}

/// Answers one intercepted request as the front is set to; false when the
/// connection is closed (or must be).
fn answer_one(
    client: &mut TcpStream,
    agent: &ureq::Agent,
    backend: SocketAddr,
    request: &Request,
    answer: &Mutex<LoadAnswer>,
) -> bool {
    let plan = answer.lock().unwrap().clone();
    let (status, content_type, body) = match plan {
        LoadAnswer::Fixed(body) => (200, "application/json".to_string(), body.into_bytes()),
        LoadAnswer::Forward { delay } => {
            let fetched = fetch(agent, backend, request);
            std::thread::sleep(delay);
            // The simulator hangs or is gone: so does the front.
            let Some(fetched) = fetched else {
                let _ = client.shutdown(Shutdown::Both);
                return false;
            };
            fetched
        }
        LoadAnswer::Wire(fault) => {
            let real = fetch(agent, backend, request);
            let (status, content_type, body) =
                real.unwrap_or((200, "application/json".to_string(), b"{}".to_vec()));
            return wire::answer(client, fault, status, &content_type, &body);
        }
    };
    let mut response = format!(
        "HTTP/1.1 {status} X\r\ncontent-type: {content_type}\r\ncontent-length: {}\r\n\r\n",
        body.len()
    )
    .into_bytes();
    response.extend_from_slice(&body);
    client.write_all(&response).is_ok()
}

/// Counts a request answered when dropped.
struct Answered<'a>(&'a AtomicU64);

impl Drop for Answered<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

/// The simulator's answer to a GET (status, content type, body); a POST
/// gets a synthetic 200 (a prefill leg's answer: only its status counts).
/// None when the simulator hangs or is gone.
fn fetch(agent: &ureq::Agent, backend: SocketAddr, request: &Request) -> Option<(u16, String, Vec<u8>)> {
    if request.method() != "GET" {
        return Some((
            200,
            "application/json".to_string(),
            br#"{"text":"","meta_info":{"finish_reason":{"type":"length"}}}"#.to_vec(),
        ));
    }
    let response = match agent.get(&format!("http://{backend}{}", request.path())).call() {
        Ok(r) => r,
        Err(ureq::Error::Status(_, r)) => r,
        Err(_) => return None,
    };
    let status = response.status();
    let content_type = response.content_type().to_string();
    let mut body = Vec::new();
    response.into_reader().read_to_end(&mut body).ok()?;
    Some((status, content_type, body))
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
    fronted_sim_intercepting(dir, name, dp_size, extra_args, Intercept::LoadPolls)
}

/// [`fronted_sim`] with a front answering what `intercept` names.
pub fn fronted_sim_intercepting(
    dir: &TestDir,
    name: &str,
    dp_size: u32,
    extra_args: &[&str],
    intercept: Intercept,
) -> (Sim, Fronted) {
    // The throwaway only takes an address: it gets no extra arguments (a
    // bootstrap port of the backend's own would be taken twice).
    let mut handle = Sim::start(dir, name, dp_size, &[]);
    handle.kill();
    let backend = Sim::start(dir, &format!("{name}-backend"), dp_size, extra_args);
    let front = LoadFront::intercepting(handle.addr, backend.addr, intercept);
    (handle, Fronted { front, backend })
}
