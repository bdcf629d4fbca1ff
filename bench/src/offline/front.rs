//! What sits in front of the simulated fleet in an offline run, one per
//! gateway: Envoy's own balancers (round robin, least request), Envoy +
//! dprank, run as dprank's real request lifecycle (`dprank::request`),
//! admission's passes and poller (`dprank::poller`) on an in-memory host
//! with its own shared data, the model of smg (and its limiter), or a
//! model of the Inference Extension's saturation detector in front of
//! dprank. A front may hold a request (dprank's queue, smg's limiter) and
//! send it on, or refuse it, later ([`Front::released`]).

use super::choice::{mix, Placement};
use std::cell::RefCell;
use std::collections::HashMap;
use std::rc::Rc;

use dprank::config::Config;
use dprank::headers::SERVER_PRIORITY_HEADER;
use dprank::host::memory::MemoryHost;
use dprank::host::{CalloutResponse, Host};
use dprank::poller::{Poller, POLL_DESTINATION_HEADER};
use dprank::request::{self, queue_tick_period_ms, Request, Routing};
use dprank::router::PRIORITY_FIELD;
use serde_json::Value;

use super::gie::Gie;
use super::smg::{CacheAware, Limiter, Permit};
use crate::workload::{HIGH_CLASS, LOW_CLASS, PRIORITY_HEADER};

/// A poll dprank dispatched: its token, the worker it asks, the path.
#[derive(Debug, Clone)]
pub struct PollCall {
    pub token: u32,
    pub worker: usize,
    pub path: String,
}

/// What a front does with an arriving request.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Arrival {
    /// Sent to the fleet now.
    Go(Placement),
    /// Held by the front: [`Front::released`] says later what became of it.
    Waiting,
    /// Refused at once with this status.
    Refused(u16),
}

/// A held request the front sent on, or refused, since the last look.
pub enum Released {
    Go {
        id: u64,
        placement: Placement,
        held: Held,
    },
    /// Refused with this status at this simulated time.
    Refused { id: u64, status: u16, at_s: f64 },
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
    /// Requests admission holds, by context id.
    waiting: HashMap<u32, Rc<RefCell<Request>>>,
    /// Replies (local answers) already looked at.
    replies_seen: usize,
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
        let routing = Routing::new(config.clone(), seed ^ vm.wrapping_mul(0x9E37_79B9));
        routing.set_vm(vm);
        DprankGateway {
            routing: Rc::new(routing),
            host,
            config,
            poller,
            workers,
            fallback: seed as usize,
            epoch_ms,
            waiting: HashMap::new(),
            replies_seen: 0,
        }
    }

    fn set_time(&self, t_s: f64) {
        self.host.now.set(self.epoch_ms + (t_s * 1000.0).round() as u64);
    }

    pub fn tick_period_s(&self) -> f64 {
        queue_tick_period_ms(&self.config) as f64 / 1000.0
    }

    /// The root context's tick at `t_s` (the poller's, then admission's);
    /// returns the polls it dispatched.
    pub fn tick(&mut self, t_s: f64) -> Vec<PollCall> {
        self.set_time(t_s);
        let _ = self.host.set_effective_context(0);
        self.poller.on_tick(&self.config, &self.host);
        request::on_admission_tick(&self.routing, &self.host, 0);
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
        let _ = self.host.set_effective_context(0);
        let answer = Ok(CalloutResponse {
            status,
            body: body.to_vec(),
        });
        self.poller
            .on_response(&self.config, &self.host, call.token, &answer);
        // As the filter's root context: a poll may show room.
        request::let_in(&self.routing, &self.host, 0, true);
    }

    /// Routes request `id` at `t_s` through dprank's request lifecycle
    /// (with the priority header when it has a class): sent, held or
    /// refused.
    pub fn route(
        &mut self,
        t_s: f64,
        id: u64,
        path: &str,
        body: &[u8],
        high: Option<bool>,
    ) -> (Arrival, Held) {
        self.set_time(t_s);
        let ctx = id as u32;
        let length = body.len().to_string();
        let mut headers = vec![
            (":method", "POST"),
            (":path", path),
            ("content-type", "application/json"),
            ("content-length", &length),
        ];
        if let Some(high) = high {
            headers.push((PRIORITY_HEADER, if high { HIGH_CLASS } else { LOW_CLASS }));
        }
        self.host.start_request_as(ctx, &headers, body);
        let request = Request::shared(self.routing.clone(), ctx);
        request.borrow_mut().on_request_headers(&self.host, false);
        request.borrow_mut().on_request_body(&self.host, body.len(), true);
        if let Some(status) = self.reply_to(ctx) {
            self.host.end_context(ctx);
            return (Arrival::Refused(status), Held::None);
        }
        if request.borrow().is_held() {
            self.waiting.insert(ctx, request);
            return (Arrival::Waiting, Held::None);
        }
        let placement = self.placement();
        (Arrival::Go(placement), Held::Dprank(ctx, request))
    }

    /// The status of a local reply to context `ctx` among those not looked
    /// at yet (the others are another context's, already counted).
    fn reply_to(&mut self, ctx: u32) -> Option<u16> {
        let contexts = self.host.reply_contexts.borrow();
        let replies = self.host.replies.borrow();
        let found = contexts[self.replies_seen..]
            .iter()
            .zip(&replies[self.replies_seen..])
            .find(|(c, _)| **c == ctx)
            .map(|(_, r)| r.0 as u16);
        found
    }

    /// Held requests admission let in or answered since the last look.
    pub fn released(&mut self, t_s: f64) -> Vec<Released> {
        let mut out = Vec::new();
        let resumed: Vec<u32> = std::mem::take(&mut *self.host.resumed_contexts.borrow_mut());
        for ctx in resumed {
            let Some(request) = self.waiting.remove(&ctx) else {
                continue;
            };
            let _ = self.host.set_effective_context(ctx);
            out.push(Released::Go {
                id: u64::from(ctx),
                placement: self.placement(),
                held: Held::Dprank(ctx, request),
            });
        }
        let replies: Vec<(u32, u16)> = {
            let contexts = self.host.reply_contexts.borrow();
            let replies = self.host.replies.borrow();
            contexts[self.replies_seen..]
                .iter()
                .zip(&replies[self.replies_seen..])
                .map(|(c, r)| (*c, r.0 as u16))
                .collect()
        };
        self.replies_seen += replies.len();
        for (ctx, status) in replies {
            if self.waiting.remove(&ctx).is_some() {
                self.host.end_context(ctx);
                out.push(Released::Refused {
                    id: u64::from(ctx),
                    status,
                    at_s: t_s,
                });
            }
        }
        out
    }

    /// Where the effective request goes, as its route header and body say.
    fn placement(&mut self) -> Placement {
        let chosen = self
            .host
            .header(&self.config.route_header)
            .and_then(|value| first_endpoint(&value).and_then(|e| self.workers.get(e)).copied());
        match chosen {
            Some(worker) => {
                let (rank, rank_header, priority) = self.named();
                Placement {
                    worker,
                    rank,
                    rank_header,
                    priority,
                }
            }
            None => {
                // The cluster's fallback (round robin); the worker picks the rank.
                self.fallback = self.fallback.wrapping_add(1);
                Placement {
                    worker: self.fallback % self.workers.len().max(1),
                    rank: None,
                    rank_header: None,
                    priority: None,
                }
            }
        }
    }

    /// The rank (a local index, or vLLM's header value as sent) and the
    /// scheduling priority (`admission.server_priority`) dprank named for
    /// the request just routed: in its headers in header mode (its first
    /// rank header; `x-override-priority`), else in the body, read once.
    fn named(&self) -> (Option<usize>, Option<u32>, Option<i64>) {
        let sets_priority = self
            .config
            .admission
            .as_ref()
            .is_some_and(|a| a.server_priority.is_some());
        match self.config.header_transport() {
            Some(h) => {
                let header = |name: &str| self.host.header(name);
                let rank = h.rank_headers.first().and_then(|name| header(name));
                let priority = sets_priority
                    .then(|| header(SERVER_PRIORITY_HEADER))
                    .flatten()
                    .and_then(|v| v.parse().ok());
                if self.config.engine.is_vllm() {
                    (None, rank.and_then(|v| v.parse().ok()), priority)
                } else {
                    (rank.and_then(|v| v.parse().ok()), None, priority)
                }
            }
            None => {
                let body = self.host.request_body.borrow();
                let Ok(value) = serde_json::from_slice::<Value>(&body) else {
                    return (None, None, None);
                };
                let rank = value.get(&self.config.rank_field).and_then(Value::as_u64);
                let priority = sets_priority.then(|| value.get(PRIORITY_FIELD).and_then(Value::as_i64));
                (rank.map(|r| r as usize), None, priority.flatten())
            }
        }
    }

    /// The response's head and first body chunk reached the gateway: a
    /// 200 stream of server-sent events whose first chunk is the first
    /// token when `streamed`, else a whole answer.
    pub fn first_bytes(&self, t_s: f64, ctx: u32, request: &RefCell<Request>, streamed: bool) {
        self.set_time(t_s);
        let _ = self.host.set_effective_context(ctx);
        if streamed {
            *self.host.response.borrow_mut() = (Some(200), Vec::new());
            *self.host.response_headers.borrow_mut() =
                vec![("content-type".into(), "text/event-stream".into())];
        } else {
            *self.host.response.borrow_mut() = (None, Vec::new());
            self.host.response_headers.borrow_mut().clear();
        }
        request.borrow_mut().on_response_headers(&self.host);
        request
            .borrow_mut()
            .on_response_body(&self.host, usize::from(streamed));
    }

    /// The stream ended (Envoy's access log callback), `later_chunks`
    /// chunks after the first (one per later token of a streamed answer:
    /// the gateway's mean gap between them is the answer's TPOT; they are
    /// handed over at the end, as only their count and the end matter).
    pub fn done(&self, t_s: f64, ctx: u32, request: &RefCell<Request>, later_chunks: u64) {
        self.set_time(t_s);
        let _ = self.host.set_effective_context(ctx);
        for _ in 0..later_chunks {
            request.borrow_mut().on_response_body(&self.host, 1);
        }
        request.borrow_mut().on_done(&self.host);
        self.host.end_context(ctx);
    }
}

/// A model of the Gateway API Inference Extension's saturation detector
/// (release-1.5, without flow control) in front of a dprank gateway: each
/// endpoint (worker) scores `max(waiting / 5, kv_usage / 0.8)` from its
/// metrics, polled every [`IE_POLL_S`]; the pool is saturated when the
/// mean score reaches 1; then sheddable requests (the low class here) are
/// refused with 429, and every other request is routed as dprank routes it.
/// Metrics older than 200 ms would count as saturated; polled every 50 ms
/// in virtual time, they never are.
pub struct IeDetector {
    pub gateway: DprankGateway,
    saturated: bool,
}

/// How often the model reads the endpoints' metrics (s).
pub const IE_POLL_S: f64 = 0.05;

impl IeDetector {
    pub fn new(gateway: DprankGateway) -> IeDetector {
        IeDetector {
            gateway,
            saturated: false,
        }
    }

    /// The endpoints' `/v1/loads` at this moment.
    pub fn poll(&mut self, loads: &[Value]) {
        let scores: Vec<f64> = loads.iter().map(ie_score).collect();
        self.saturated = !scores.is_empty() && scores.iter().sum::<f64>() / scores.len() as f64 >= 1.0;
    }
}

/// One endpoint's saturation score from its `/v1/loads`.
fn ie_score(loads: &Value) -> f64 {
    let ranks = loads
        .get("loads")
        .and_then(Value::as_array)
        .cloned()
        .unwrap_or_default();
    let field = |r: &Value, k: &str| r.get(k).and_then(Value::as_f64).unwrap_or(0.0);
    let waiting: f64 = ranks.iter().map(|r| field(r, "num_waiting_reqs")).sum();
    let used: f64 = ranks.iter().map(|r| field(r, "num_used_tokens")).sum();
    let max: f64 = ranks.iter().map(|r| field(r, "max_total_num_tokens")).sum();
    let kv = if max > 0.0 { used / max } else { 0.0 };
    (waiting / 5.0).max(kv / 0.8)
}

/// smg: its policy and, with `--max-concurrent-requests`, its limiter.
pub struct SmgFront {
    pub policy: CacheAware,
    pub limiter: Option<Limiter>,
}

/// The worker a route header names first: Envoy's `override_host` sends
/// there, the alternates after it only serve retries.
fn first_endpoint(value: &str) -> Option<&str> {
    value.split(',').next().map(str::trim).filter(|e| !e.is_empty())
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
    /// A model of smg's `cache_aware` policy (and its limiter).
    Smg(Box<SmgFront>),
    /// A model of the Inference Extension's saturation detector before dprank.
    Ie(Box<IeDetector>),
    /// A model of the Inference Extension's endpoint picker (per pod).
    Gie(Box<Gie>),
}

/// What a front keeps of one request until it ends.
pub enum Held {
    None,
    /// dprank's request: its context id and lifecycle.
    Dprank(u32, Rc<RefCell<Request>>),
}

impl Front {
    /// Chooses where request `id` goes (or holds, or refuses it).
    pub fn route(
        &mut self,
        t_s: f64,
        id: u64,
        path: &str,
        body: &[u8],
        high: Option<bool>,
    ) -> (Arrival, Held) {
        match self {
            Front::RoundRobin { next, workers } => {
                *next = next.wrapping_add(1);
                let worker = *next % (*workers).max(1);
                (
                    Arrival::Go(Placement {
                        worker,
                        rank: None,
                        rank_header: None,
                        priority: None,
                    }),
                    Held::None,
                )
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
                (
                    Arrival::Go(Placement {
                        worker,
                        rank: None,
                        rank_header: None,
                        priority: None,
                    }),
                    Held::None,
                )
            }
            Front::Dprank(gateway) => gateway.route(t_s, id, path, body, high),
            Front::Ie(ie) => {
                if ie.saturated && high == Some(false) {
                    return (Arrival::Refused(429), Held::None);
                }
                ie.gateway.route(t_s, id, path, body, high)
            }
            Front::Smg(smg) => {
                let permit = match &mut smg.limiter {
                    Some(limiter) => limiter.arrive(id, t_s, body),
                    None => Permit::Go,
                };
                match permit {
                    Permit::Go => (Arrival::Go(smg.policy.route(body)), Held::None),
                    Permit::Queued => (Arrival::Waiting, Held::None),
                    Permit::Refused(status, _) => (Arrival::Refused(status), Held::None),
                }
            }
            Front::Gie(gie) => (Arrival::Go(gie.route(&prompt_text(body))), Held::None),
        }
    }

    /// Held requests sent on or refused since the last look, at `t_s`.
    pub fn released(&mut self, t_s: f64) -> Vec<Released> {
        match self {
            Front::Dprank(gateway) => gateway.released(t_s),
            Front::Ie(ie) => ie.gateway.released(t_s),
            Front::Smg(smg) => {
                let Some(limiter) = &mut smg.limiter else {
                    return Vec::new();
                };
                limiter
                    .settle(t_s)
                    .into_iter()
                    .map(|(id, outcome)| match outcome {
                        Ok(body) => Released::Go {
                            id,
                            placement: smg.policy.route(&body),
                            held: Held::None,
                        },
                        Err((status, at_s)) => Released::Refused { id, status, at_s },
                    })
                    .collect()
            }
            Front::RoundRobin { .. } | Front::LeastRequest { .. } | Front::Gie(_) => Vec::new(),
        }
    }

    /// The dprank gateway of this front, if it has one.
    pub fn dprank(&mut self) -> Option<&mut DprankGateway> {
        match self {
            Front::Dprank(g) => Some(g),
            Front::Ie(ie) => Some(&mut ie.gateway),
            _ => None,
        }
    }

    pub fn first_bytes(&mut self, t_s: f64, held: &mut Held, streamed: bool) {
        if let (Some(gateway), Held::Dprank(ctx, request)) = (self.dprank(), held) {
            gateway.first_bytes(t_s, *ctx, request, streamed);
        }
    }

    /// The answer ended, `later_chunks` streamed chunks after its first.
    pub fn done(&mut self, t_s: f64, placement: Placement, held: &mut Held, later_chunks: u64) {
        match (self, held) {
            (Front::LeastRequest { active, .. }, _) => {
                if let Some(count) = active.get_mut(placement.worker) {
                    *count = count.saturating_sub(1);
                }
            }
            (Front::Smg(smg), _) => {
                smg.policy.done(placement);
                if let Some(limiter) = &mut smg.limiter {
                    limiter.done();
                }
            }
            (front, Held::Dprank(ctx, request)) => {
                if let Some(gateway) = front.dprank() {
                    gateway.done(t_s, *ctx, request, later_chunks);
                }
            }
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
            let (arrival, _) = g.route(0.01 + f64::from(i) * 0.001, i as u64 + 1, "/generate", body, None);
            assert_eq!(
                arrival,
                Arrival::Go(Placement {
                    worker: 1,
                    rank: Some(0),
                    rank_header: None,
                    priority: None,
                }),
                "request {i}"
            );
        }
    }

    /// Two vLLM servers of two engines each behind a gateway of `variant`,
    /// the servers started with `sim_flags`; the engines of worker 0 in
    /// `busy` run a long prompt. Returns the fleet, the gateway, and where
    /// a short request went once every server was polled.
    fn routed_in_front_of_vllm(
        sim_flags: &[&str],
        variant: &str,
        busy: &[(usize, usize)],
    ) -> (dprank_sim::offline::Fleet, DprankGateway, Placement) {
        use clap::Parser;
        let mut args = vec![
            "dprank-sim",
            "--engine",
            "vllm",
            "--dp-size",
            "2",
            "--listen",
            "127.0.0.1:1",
        ];
        args.extend_from_slice(sim_flags);
        let sim = dprank_sim::Cli::try_parse_from(args).unwrap().sim;
        let mut fleet = dprank_sim::offline::Fleet::new(sim, 2).unwrap();
        let config =
            crate::offline::driver::dprank_config(&crate::variant::Variant::parse(variant).unwrap(), 2, true)
                .unwrap();
        let mut g = DprankGateway::new(config, 0, 1_000_000);
        for &(worker, engine) in busy {
            let prompt = dprank_sim::offline::Prompt::Text("the cat sat far ".repeat(2000));
            fleet
                .submit(
                    0.0,
                    worker,
                    dprank_sim::offline::Request::new(prompt, 4096).on_rank(engine),
                )
                .unwrap();
        }
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
        let body = br#"{"model":"m","prompt":"hello","max_tokens":4}"#;
        let (arrival, _) = g.route(3.01, 1, "/v1/completions", body, None);
        let Arrival::Go(placement) = arrival else {
            panic!("routed, not held or refused: {arrival:?}");
        };
        assert_eq!(
            g.host.request_body.borrow().as_slice(),
            body,
            "the body is untouched"
        );
        (fleet, g, placement)
    }

    #[test]
    fn a_gateway_in_front_of_vllm_reads_metrics_and_names_the_engine_in_its_header() {
        let (_, g, placement) = routed_in_front_of_vllm(&[], "dprank", &[(0, 1)]);
        assert!(g
            .host
            .gauge_value("dprank.tokens.w0.rank_1")
            .is_some_and(|t| t > 0));
        assert_eq!(g.host.gauge_value("dprank.tokens.w0.rank_0"), Some(0));
        assert_eq!(placement.rank, None, "no body field");
        assert!(
            placement.rank_header.is_some(),
            "the engine is named in x-data-parallel-rank"
        );
        assert_ne!(
            (placement.worker, placement.rank_header),
            (0, Some(1)),
            "not the busy engine"
        );
    }

    #[test]
    fn on_the_second_node_of_a_hybrid_deployment_the_header_is_what_its_frontend_reads() {
        // Engines 0-1 on worker 0 (both busy), 2-3 on worker 1: the request
        // goes to worker 1, named by its local index for vLLM's Python
        // frontend and by its global rank for the Rust one; the server
        // takes the value (a wrong one would be refused).
        let hybrid = ["--dp-start-rank", "0", "--dp-start-rank", "2"];
        for (frontend, variant, values) in [
            ("python", "dprank", 0..=1),
            ("rust", "dprank:set.rank_numbering=global", 2..=3),
        ] {
            let mut flags = hybrid.to_vec();
            flags.extend(["--vllm-frontend", frontend]);
            let (mut fleet, _, placement) = routed_in_front_of_vllm(&flags, variant, &[(0, 0), (0, 1)]);
            assert_eq!(placement.worker, 1, "{frontend}: the idle node");
            let value = placement.rank_header.expect("a rank header");
            assert!(values.contains(&value), "{frontend}: header {value}");
            let short = dprank_sim::offline::Prompt::Text("hello".into());
            fleet
                .submit(
                    3.02,
                    1,
                    dprank_sim::offline::Request::new(short, 4).with_rank_header(value.to_string()),
                )
                .unwrap_or_else(|e| panic!("{frontend}: the server refused {value}: {e}"));
        }
    }
}
