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

use super::gie::Gie;
use super::smg::CacheAware;

/// Where a request goes: a worker, and the rank it names (None: the
/// worker's own controller picks).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Placement {
    pub worker: usize,
    pub rank: Option<usize>,
}

/// A poll dprank dispatched: its token, the worker it asks, the path.
#[derive(Debug, Clone)]
pub struct PollCall {
    pub token: u32,
    pub worker: usize,
    pub path: String,
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
                let path = headers
                    .iter()
                    .find(|(k, _)| k == ":path")
                    .map(|(_, v)| v.clone())
                    .unwrap_or_default();
                Some(PollCall {
                    token,
                    worker: *worker,
                    path,
                })
            })
            .collect()
    }

    /// A poll's answer (what the worker last published: `/v1/loads`, or a
    /// vLLM server's `/metrics`) at `t_s`.
    pub fn poll_answer(&mut self, t_s: f64, call: PollCall, status: u32, body: &[u8]) {
        self.set_time(t_s);
        *self.host.callout.borrow_mut() = (Some(status), body.to_vec());
        self.poller
            .on_response(&self.config, &self.host, call.token, Some(status), body);
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
        let chosen = self
            .host
            .header(&self.config.route_header)
            .and_then(|value| first_endpoint(&value).and_then(|e| self.workers.get(e)).copied());
        let placement = match chosen {
            Some(worker) => Placement {
                worker,
                rank: self.rank_named(),
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

    /// The rank dprank named for the request just routed: in its first rank
    /// header in header mode (vLLM), else in the body.
    fn rank_named(&self) -> Option<usize> {
        match self.config.header_transport() {
            Some(h) => h
                .rank_headers
                .first()
                .and_then(|name| self.host.header(name))
                .and_then(|value| value.parse().ok()),
            None => rank_in(&self.host.request_body.borrow(), &self.config.rank_field),
        }
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

/// The worker a route header names first: Envoy's `override_host` sends
/// there, the alternates after it only serve retries.
fn first_endpoint(value: &str) -> Option<&str> {
    value.split(',').next().map(str::trim).filter(|e| !e.is_empty())
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
    /// A model of the Inference Extension's endpoint picker (per pod).
    Gie(Box<Gie>),
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
            Front::Gie(gie) => (gie.route(&prompt_text(body)), Held::None),
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

/// The prompt text of a serving body as a gateway reads it: the rendered
/// conversation of a chat, else `prompt` or `text`.
fn prompt_text(body: &[u8]) -> Vec<u8> {
    let Ok(value) = serde_json::from_slice::<serde_json::Value>(body) else {
        return Vec::new();
    };
    if let Some(text) = value.get("messages").and_then(dprank_sim::chat::template_json) {
        return text.into_bytes();
    }
    value
        .get("prompt")
        .or_else(|| value.get("text"))
        .and_then(|v| v.as_str())
        .map(|text| text.as_bytes().to_vec())
        .unwrap_or_default()
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

    #[test]
    fn the_route_header_sends_to_its_first_endpoint() {
        assert_eq!(
            first_endpoint("10.0.0.2:30000,10.0.0.1:30000"),
            Some("10.0.0.2:30000")
        );
        assert_eq!(first_endpoint("10.0.0.2:30000"), Some("10.0.0.2:30000"));
        assert_eq!(first_endpoint(""), None);
    }

    #[test]
    fn a_gateway_routes_where_dprank_chose_not_by_its_fallback() {
        let config = crate::offline::driver::dprank_config(
            &crate::variant::Variant::parse("dprank").unwrap(),
            2,
            false,
        )
        .unwrap();
        let mut g = DprankGateway::new(config, 0, 1_000_000);
        let loads = |waiting: u64| {
            serde_json::json!({"loads": [{"dp_rank": 0, "num_total_tokens": waiting, "num_waiting_reqs": 0}]})
                .to_string()
        };
        for call in g.tick(0.0) {
            let body = if call.worker == 1 { loads(0) } else { loads(50_000) };
            g.poll_answer(0.001, call, 200, body.as_bytes());
        }
        let body = br#"{"text":"hello","sampling_params":{"max_new_tokens":4}}"#;
        for i in 0..4 {
            let (placement, _) = g.route(0.01 + f64::from(i) * 0.001, "/generate", body);
            assert_eq!((placement.worker, placement.rank), (1, Some(0)), "request {i}");
        }
    }

    #[test]
    fn a_gateway_in_front_of_vllm_reads_metrics_and_names_the_engine_in_its_header() {
        use clap::Parser;
        let args = [
            "dprank-sim",
            "--engine",
            "vllm",
            "--dp-size",
            "2",
            "--listen",
            "127.0.0.1:1",
        ];
        let sim = dprank_sim::Cli::try_parse_from(args).unwrap().sim;
        let mut fleet = dprank_sim::offline::Fleet::new(sim, 2).unwrap();
        let config = crate::offline::driver::dprank_config(
            &crate::variant::Variant::parse("dprank").unwrap(),
            2,
            true,
        )
        .unwrap();
        let mut g = DprankGateway::new(config, 0, 1_000_000);
        // Engine 1 of worker 0 is busy: a long prompt is running there.
        let prompt = dprank_sim::offline::Prompt::Text("the cat sat far ".repeat(2000));
        fleet
            .submit(0.0, 0, dprank_sim::offline::Request::new(prompt, 4096).on_rank(1))
            .unwrap();
        fleet.run_until(3.0);
        for call in g.tick(3.0) {
            let body = fleet.metrics(call.worker);
            g.poll_answer(3.001, call, 200, body.as_bytes());
        }
        assert_eq!(
            g.host.counter("dprank.poll_ok.w0"),
            1,
            "the /metrics answer was read"
        );
        assert_eq!(g.host.counter("dprank.poll_ok.w1"), 1);
        assert!(g
            .host
            .gauge_value("dprank.tokens.w0.rank_1")
            .is_some_and(|t| t > 0));
        assert_eq!(g.host.gauge_value("dprank.tokens.w0.rank_0"), Some(0));
        let body = br#"{"model":"m","prompt":"hello","max_tokens":4}"#;
        let (placement, _) = g.route(3.01, "/v1/completions", body);
        assert!(
            placement.rank.is_some(),
            "the engine is named in x-data-parallel-rank"
        );
        assert_ne!(
            (placement.worker, placement.rank),
            (0, Some(1)),
            "not the busy engine"
        );
        assert_eq!(
            g.host.request_body.borrow().as_slice(),
            body,
            "the body is untouched"
        );
    }
}
