//! What sits in front of the simulated fleet in an offline run, one per
//! gateway: Envoy's own balancers (round robin, least request), or Envoy +
//! dprank, run as dprank's real request lifecycle (`dprank::request`) and
//! poller (`dprank::poller`) on an in-memory host with its own shared data.

use std::collections::HashMap;
use std::rc::Rc;

use dprank::config::Config;
use dprank::host::memory::MemoryHost;
use dprank::poller::{tick_period_ms, Poller, POLL_DESTINATION_HEADER};
use dprank::request::{Request, Routing};

use super::smg::CacheAware;

/// Where a request goes: a worker, and the rank it names (None: the
/// worker's own controller picks).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Placement {
    pub worker: usize,
    pub rank: Option<usize>,
}

/// A poll dprank dispatched: its token, and the worker it asks.
#[derive(Debug, Clone, Copy)]
pub struct PollCall {
    pub token: u32,
    pub worker: usize,
}

/// One Envoy + dprank.
pub struct DprankGateway {
    pub host: MemoryHost,
    pub config: Rc<Config>,
    routing: Rc<Routing>,
    poller: Poller,
    workers: HashMap<String, usize>,
    /// Round robin of the cluster's fallback policy (requests dprank passes).
    fallback: usize,
    /// Milliseconds since the Unix epoch at simulated time 0.
    epoch_ms: u64,
}

impl DprankGateway {
    /// `config` names the workers in fleet order.
    pub fn new(config: Config, seed: u64, epoch_ms: u64) -> DprankGateway {
        let host = MemoryHost::default();
        host.now.set(epoch_ms);
        let workers = config
            .all_workers()
            .enumerate()
            .map(|(i, w)| (w.endpoint(), i))
            .collect();
        let config = Rc::new(config);
        let mut poller = Poller::new(host.now.get());
        let vm = poller.vm_id(&config, &host);
        DprankGateway {
            routing: Rc::new(Routing::new(config.clone(), seed ^ vm.wrapping_mul(0x9E37_79B9))),
            host,
            config,
            poller,
            workers,
            fallback: seed as usize,
            epoch_ms,
        }
    }

    fn set_time(&self, t_s: f64) {
        self.host.now.set(self.epoch_ms + (t_s * 1000.0).round() as u64);
    }

    pub fn tick_period_s(&self) -> f64 {
        tick_period_ms(&self.config) as f64 / 1000.0
    }

    /// The poller's tick at `t_s`; returns the polls it dispatched.
    pub fn tick(&mut self, t_s: f64) -> Vec<PollCall> {
        self.set_time(t_s);
        self.poller.on_tick(&self.config, &self.host);
        let calls = std::mem::take(&mut *self.host.calls.borrow_mut());
        calls
            .into_iter()
            .filter_map(|(_, headers, token)| {
                let worker = headers
                    .iter()
                    .find(|(k, _)| k == POLL_DESTINATION_HEADER)
                    .and_then(|(_, v)| self.workers.get(v))?;
                Some(PollCall {
                    token,
                    worker: *worker,
                })
            })
            .collect()
    }

    /// A poll's answer (`/v1/loads` as the worker published it) at `t_s`.
    pub fn poll_answer(&mut self, t_s: f64, call: PollCall, body: &[u8]) {
        self.set_time(t_s);
        *self.host.callout.borrow_mut() = (Some(200), body.to_vec());
        self.poller
            .on_response(&self.config, &self.host, call.token, Some(200), body);
    }

    /// Routes a request at `t_s` through dprank's request lifecycle; the
    /// request is returned for its later callbacks.
    pub fn route(&mut self, t_s: f64, path: &str, body: &[u8]) -> (Placement, Request) {
        self.set_time(t_s);
        let length = body.len().to_string();
        self.host.start_request(
            &[
                (":method", "POST"),
                (":path", path),
                ("content-type", "application/json"),
                ("content-length", &length),
            ],
            body,
        );
        let mut request = Request::new(self.routing.clone());
        request.on_request_headers(&self.host, false);
        request.on_request_body(&self.host, body.len(), true);
        // The route header lists the chosen worker, then its retry alternates.
        let chosen = self.host.header(&self.config.route_header).and_then(|value| {
            let endpoint = value.split(',').next().unwrap_or_default();
            self.workers.get(endpoint).copied()
        });
        let placement = match chosen {
            Some(worker) => Placement {
                worker,
                rank: rank_in(&self.host.request_body.borrow(), &self.config.rank_field),
            },
            None => {
                // The cluster's fallback (round robin); the worker picks the rank.
                self.fallback = self.fallback.wrapping_add(1);
                Placement {
                    worker: self.fallback % self.workers.len().max(1),
                    rank: None,
                }
            }
        };
        (placement, request)
    }

    /// The response's head and first body chunk reached the gateway.
    pub fn first_bytes(&self, t_s: f64, request: &mut Request) {
        self.set_time(t_s);
        request.on_response_headers(&self.host);
        request.on_response_body(&self.host);
    }

    /// The stream ended (Envoy's access log callback).
    pub fn done(&self, t_s: f64, request: &mut Request) {
        self.set_time(t_s);
        request.on_done(&self.host);
    }
}

/// The rank dprank wrote into the body.
fn rank_in(body: &[u8], field: &str) -> Option<usize> {
    let value: serde_json::Value = serde_json::from_slice(body).ok()?;
    value.get(field)?.as_u64().map(|r| r as usize)
}

/// A gateway in front of the fleet.
pub enum Front {
    /// Envoy round robin over workers.
    RoundRobin {
        next: usize,
        workers: usize,
    },
    /// Envoy least_request (two random choices, fewer active requests).
    LeastRequest {
        active: Vec<usize>,
        draws: u64,
    },
    Dprank(Box<DprankGateway>),
    /// A model of smg's `cache_aware` policy with `--dp-aware`.
    Smg(Box<CacheAware>),
}

/// What a front keeps of one request until it ends.
pub enum Held {
    None,
    Dprank(Box<Request>),
}

impl Front {
    /// Chooses where a request goes.
    pub fn route(&mut self, t_s: f64, path: &str, body: &[u8]) -> (Placement, Held) {
        match self {
            Front::RoundRobin { next, workers } => {
                *next = next.wrapping_add(1);
                let worker = *next % (*workers).max(1);
                (Placement { worker, rank: None }, Held::None)
            }
            Front::LeastRequest { active, draws } => {
                *draws = draws.wrapping_add(1);
                let n = active.len().max(1);
                let a = (mix(*draws) % n as u64) as usize;
                let b = (mix(*draws ^ 0x5555) % n as u64) as usize;
                let worker = if active.get(b) < active.get(a) { b } else { a };
                if let Some(count) = active.get_mut(worker) {
                    *count += 1;
                }
                (Placement { worker, rank: None }, Held::None)
            }
            Front::Dprank(gateway) => {
                let (placement, request) = gateway.route(t_s, path, body);
                (placement, Held::Dprank(Box::new(request)))
            }
            Front::Smg(smg) => (smg.route(body), Held::None),
        }
    }

    pub fn first_bytes(&mut self, t_s: f64, held: &mut Held) {
        if let (Front::Dprank(gateway), Held::Dprank(request)) = (self, held) {
            gateway.first_bytes(t_s, request);
        }
    }

    pub fn done(&mut self, t_s: f64, placement: Placement, held: &mut Held) {
        match (self, held) {
            (Front::Dprank(gateway), Held::Dprank(request)) => gateway.done(t_s, request),
            (Front::LeastRequest { active, .. }, _) => {
                if let Some(count) = active.get_mut(placement.worker) {
                    *count = count.saturating_sub(1);
                }
            }
            (Front::Smg(smg), _) => smg.done(placement),
            _ => {}
        }
    }
}

/// splitmix64.
pub fn mix(x: u64) -> u64 {
    let mut z = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn loads(tokens: &[u64]) -> Vec<u8> {
        let entries: Vec<String> = tokens
            .iter()
            .enumerate()
            .map(|(rank, t)| format!(r#"{{"dp_rank":{rank},"num_total_tokens":{t}}}"#))
            .collect();
        format!(
            r#"{{"loads":[{}],"dp_rank_count":{}}}"#,
            entries.join(","),
            tokens.len()
        )
        .into_bytes()
    }

    /// dprank's own choice is the placement, not the fallback's: the route
    /// header also lists retry alternates after the chosen worker.
    #[test]
    fn dprank_places_on_the_chosen_worker_and_rank() {
        let config = Config::from_json(
            br#"{"workers":[{"address":"127.0.0.1:1"},{"address":"127.0.0.1:2"}],"prefix_affinity":false}"#,
        )
        .unwrap();
        assert!(config.retry_alternates > 0, "the case this test is about");
        let mut gateway = DprankGateway::new(config, 1, 1_000_000);
        let mut t = 0.0;
        while gateway.host.counter("dprank.poll_ok.127.0.0.1:2") == 0 && t < 5.0 {
            for call in gateway.tick(t) {
                let tokens: &[u64] = if call.worker == 0 { &[50, 60] } else { &[70, 5] };
                gateway.poll_answer(t, call, &loads(tokens));
            }
            t += 0.05;
        }
        for _ in 0..3 {
            let (placement, _) = gateway.route(t, "/generate", br#"{"text":"hi"}"#);
            assert_eq!(
                placement,
                Placement {
                    worker: 1,
                    rank: Some(1)
                }
            );
        }
    }
}
