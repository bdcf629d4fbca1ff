//! Background client traffic that records every outcome, transport errors
//! included, so a test can count the failures a fault caused and attribute
//! each one (which worker answered, when it was sent, what the body said).

use std::io::Read;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// One request of the background traffic.
#[derive(Debug, Clone)]
pub struct Outcome {
    pub sent: Instant,
    pub done: Instant,
    /// 0 when the exchange failed below HTTP (reset, refused, cut body).
    pub status: u16,
    /// `x-sim-worker` of the reply: the worker that answered, if one did.
    pub worker: Option<String>,
    /// `x-sim-dp-rank` of the reply.
    pub rank: Option<i64>,
    /// The start of the reply body, or the transport error.
    pub detail: String,
}

impl Outcome {
    pub fn ok(&self) -> bool {
        self.status == 200
    }
}

/// POSTs in a loop (tiny prompts, one output token) until dropped or stopped.
pub struct Traffic {
    stop: Arc<AtomicBool>,
    outcomes: Arc<Mutex<Vec<Outcome>>>,
    thread: Option<JoinHandle<()>>,
}

/// When requests start.
#[derive(Debug, Clone, Copy)]
enum Pace {
    /// A pause after each answer.
    After(Duration),
    /// One start every so often.
    Every(Duration),
}

/// An SGLang `/generate` body: a tiny prompt, one output token.
pub fn sglang_body(seq: u64) -> String {
    format!(r#"{{"text":"background {seq}","sampling_params":{{"max_new_tokens":1}}}}"#)
}

impl Traffic {
    /// SGLang requests ([`sglang_body`]) to `url`, `pause` apart.
    pub fn start(url: String, pause: Duration) -> Traffic {
        Traffic::start_with(url, pause, sglang_body)
    }

    /// Requests with the bodies `body` makes of their sequence numbers,
    /// `pause` after each.
    pub fn start_with(url: String, pause: Duration, body: fn(u64) -> String) -> Traffic {
        Traffic::run(url, Pace::After(pause), body)
    }

    /// Requests started `every` apart (one at a time: a late one starts the
    /// next at once).
    pub fn paced(url: String, every: Duration, body: fn(u64) -> String) -> Traffic {
        Traffic::run(url, Pace::Every(every), body)
    }

    fn run(url: String, pace: Pace, body: fn(u64) -> String) -> Traffic {
        let stop = Arc::new(AtomicBool::new(false));
        let outcomes = Arc::new(Mutex::new(Vec::new()));
        let seq = AtomicU64::new(0);
        let thread = {
            let (stop, outcomes) = (stop.clone(), outcomes.clone());
            std::thread::spawn(move || {
                let agent = ureq::AgentBuilder::new()
                    .timeout_connect(Duration::from_secs(5))
                    .timeout(Duration::from_secs(30))
                    .build();
                let mut next = Instant::now();
                while !stop.load(Ordering::SeqCst) {
                    if let Pace::Every(every) = pace {
                        std::thread::sleep(next.saturating_duration_since(Instant::now()));
                        next = next.max(Instant::now() - every) + every;
                    }
                    let body = body(seq.fetch_add(1, Ordering::SeqCst));
                    let sent = Instant::now();
                    let result = agent
                        .post(&url)
                        .set("content-type", "application/json")
                        .send_bytes(body.as_bytes());
                    let response = match result {
                        Ok(r) | Err(ureq::Error::Status(_, r)) => Ok(r),
                        Err(e) => Err(e.to_string()),
                    };
                    let outcome = match response {
                        Ok(r) => {
                            let status = r.status();
                            let worker = r.header("x-sim-worker").map(str::to_string);
                            let rank = r.header("x-sim-dp-rank").and_then(|v| v.parse().ok());
                            // Read to the end: an answer cut mid-stream is a failure.
                            let mut bytes = Vec::new();
                            let read = r.into_reader().take(16 << 20).read_to_end(&mut bytes);
                            let text = String::from_utf8_lossy(&bytes);
                            Outcome {
                                sent,
                                done: Instant::now(),
                                status: if read.is_ok() { status } else { 0 },
                                worker,
                                rank,
                                detail: text.chars().take(300).collect(),
                            }
                        }
                        Err(e) => Outcome {
                            sent,
                            done: Instant::now(),
                            status: 0,
                            worker: None,
                            rank: None,
                            detail: e,
                        },
                    };
                    outcomes.lock().unwrap().push(outcome);
                    if let Pace::After(pause) = pace {
                        std::thread::sleep(pause);
                    }
                }
            })
        };
        Traffic {
            stop,
            outcomes,
            thread: Some(thread),
        }
    }

    /// Everything recorded so far.
    pub fn outcomes(&self) -> Vec<Outcome> {
        self.outcomes.lock().unwrap().clone()
    }

    /// Stops the loop (after the request in flight) and returns every outcome.
    pub fn stop(mut self) -> Vec<Outcome> {
        self.halt();
        self.outcomes()
    }

    fn halt(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

impl Drop for Traffic {
    fn drop(&mut self) {
        self.halt();
    }
}
