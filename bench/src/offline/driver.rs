//! One offline run: a workload's plan through a variant's gateways into the
//! simulator's engine in virtual time (`dprank_sim::offline::Fleet`).
//!
//! Events, in time order: arrivals (open-loop requests at their time; chat
//! turns after the previous answer and a think time), every dprank
//! gateway's poller ticks (at the filter's own tick period) and the answers
//! to the polls they dispatch (the worker's `/v1/loads` as published at that
//! moment, after `POLL_RTT_S`), and between them the engine's first tokens
//! and finishes, fed back to the gateway that routed the request as its
//! response head and first body chunk (streamed; a non-streamed response
//! arrives whole at the end) and its end. Nothing is random but the seeded
//! workload and tie-breaks: a run is a function of its inputs.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap};
use std::sync::atomic::Ordering;

use dprank_sim::chat::template_json;
use dprank_sim::offline::{Fleet, Prompt, Request};
use dprank_sim::output::text_upto;
use dprank_sim::SimConfig;
use serde_json::Value;

use super::choice::{mix, Placement};
use super::front::{
    Arrival, DprankGateway, Front, Held, IeDetector, PollCall, Released, SmgFront, IE_POLL_S,
};
use super::gie::{self, Gie, Reading};
use super::smg::{CacheAware, Limiter, SmgKnobs};
use crate::envoy::Balancer;
use crate::loadgen::{gateway_for, RequestRecord, RunOutput};
use crate::variant::{Dispatch, Front as VariantFront, GieReading, Variant};
use crate::workload::{bodies, text, Api, Plan};

/// Round trip of a load poll (the worker answers from its last published
/// snapshot at once).
pub const POLL_RTT_S: f64 = 0.001;
/// dprank's clock at simulated time 0 (ms since the Unix epoch).
const EPOCH_MS: u64 = 1_800_000_000_000;

/// Everything one run needs besides the plan.
pub struct RunSpec<'a> {
    pub variant: &'a Variant,
    pub sim: SimConfig,
    pub workers: usize,
    pub seed: u64,
    /// Chat turns that would start later than this are not sent.
    pub turn_horizon_s: f64,
    /// Stop here, whatever is still running (capacity runs).
    pub cut_at_s: Option<f64>,
    /// Write one JSON line per request here (where it went, what it got).
    pub requests_out: Option<std::path::PathBuf>,
    /// Stop early once the run cannot meet a TTFT target (capacity search).
    pub give_up: Option<GiveUp>,
}

/// When a run stops early (capacity search): more than `late_allowed`
/// requests sent at or after `from_s` waited longer than `ttft_s` for their
/// first token, or more than `late_allowed` finished with a time per output
/// token above `tpot_s`, counted together over every run that shares
/// `counts` (the seeds of one pooled percentile). Either percentile above
/// `1 - late_allowed / n` is then already beyond its target, whatever the
/// runs still to come do; which run notices first may vary, the verdict
/// does not. The run's output then says so ([`RunOutput`] is cut there).
#[derive(Debug, Clone)]
pub struct GiveUp {
    pub from_s: f64,
    pub ttft_s: f64,
    pub tpot_s: f64,
    pub late_allowed: usize,
    pub counts: std::sync::Arc<LateCounts>,
}

/// Late requests of the runs that share one [`GiveUp`].
#[derive(Debug, Default)]
pub struct LateCounts {
    /// First token later than the TTFT target (answered).
    pub ttft: std::sync::atomic::AtomicUsize,
    /// Finished with a TPOT above its target.
    pub tpot: std::sync::atomic::AtomicUsize,
}

/// The engine never runs further ahead of the event queue than this, so a
/// chat turn scheduled from a finish (its think time is at least 0.5 s)
/// never lands in the engine's past.
const MAX_STEP_S: f64 = 0.25;

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Event {
    /// Open-loop request `i` of the plan.
    Open(usize),
    /// Turn `turn` of session `session`.
    Turn {
        session: usize,
        turn: usize,
    },
    Tick(usize),
    /// The Inference Extension model reads the endpoints' metrics.
    IePoll(usize),
    Poll {
        gateway: usize,
        token: u32,
        worker: usize,
        /// The load endpoint asked: `/metrics` or SGLang's.
        metrics: bool,
    },
    /// An Inference Extension model's metrics refresh.
    GiePoll(usize),
}

struct Queue {
    heap: BinaryHeap<Reverse<(u64, u64, Event)>>,
    seq: u64,
}

impl Queue {
    fn push(&mut self, at_s: f64, event: Event) {
        self.seq += 1;
        let at = (at_s.max(0.0) * 1e6).round() as u64;
        self.heap.push(Reverse((at, self.seq, event)));
    }

    fn peek_s(&self) -> Option<f64> {
        self.heap.peek().map(|Reverse((at, _, _))| *at as f64 / 1e6)
    }

    fn pop(&mut self) -> Option<(f64, Event)> {
        self.heap.pop().map(|Reverse((at, _, e))| (at as f64 / 1e6, e))
    }
}

/// A request in the engine.
struct InFlight {
    gateway: usize,
    placement: Placement,
    held: Held,
    streamed: bool,
    record: RequestRecord,
    first_s: Option<f64>,
    /// Chat: (session, turn).
    turn: Option<(usize, usize)>,
    /// The hash of the prompt's first 512 bytes (which prompts share a start).
    head: Option<u32>,
}

/// A request a front holds: what it needs once sent on or refused.
struct Waiting {
    gateway: usize,
    body: bytes::Bytes,
    record: RequestRecord,
    turn: Option<(usize, usize)>,
}

/// The workers' addresses as dprank's configuration names them.
pub fn worker_address(i: usize) -> String {
    format!("10.0.{}.{}:30000", i / 250, i % 250 + 1)
}

/// dprank's configuration for a variant: the shipped filter keys, the
/// variant's poll interval (simulated ms) and overrides; `"engine": "vllm"`
/// in front of vLLM servers (unless the variant says otherwise).
pub fn dprank_config(
    variant: &Variant,
    workers: usize,
    vllm: bool,
) -> Result<dprank::config::Config, String> {
    let VariantFront::Dprank { poll, set } = &variant.front else {
        return Err(format!("`{}` is not a dprank variant", variant.name));
    };
    let list: Vec<Value> = (0..workers)
        .map(|i| serde_json::json!({"address": worker_address(i), "name": format!("w{i}")}))
        .collect();
    let mut json = serde_json::json!({
        "workers": list,
        "poll_interval_ms": poll.sim_ms(1.0) as u64,
    });
    if vllm {
        json["engine"] = Value::from("vllm");
    }
    if let Some(map) = json.as_object_mut() {
        for (k, v) in set {
            map.insert(k.clone(), v.clone());
        }
    }
    dprank::config::Config::from_json(json.to_string().as_bytes())
        .map_err(|e| format!("variant `{}`: {e}", variant.name))
}

fn fronts(spec: &RunSpec) -> Result<Vec<Front>, String> {
    let gateways = spec.variant.gateways.max(1);
    (0..gateways)
        .map(|g| {
            let salt = mix(spec.seed ^ (g as u64 + 1) << 32);
            Ok(match &spec.variant.front {
                VariantFront::Envoy(Balancer::RoundRobin) => Front::RoundRobin {
                    next: salt as usize,
                    workers: spec.workers,
                },
                VariantFront::Envoy(_) => Front::LeastRequest {
                    active: vec![0; spec.workers],
                    draws: salt,
                },
                VariantFront::Dprank { .. } => {
                    let config = dprank_config(spec.variant, spec.workers, spec.sim.is_vllm())?;
                    let gateway = DprankGateway::new(config, salt, EPOCH_MS);
                    if spec.variant.ie_detector {
                        Front::Ie(Box::new(IeDetector::new(gateway)))
                    } else {
                        Front::Dprank(Box::new(gateway))
                    }
                }
                VariantFront::Gie { reading } => Front::Gie(Box::new(Gie::new(
                    spec.workers,
                    match reading {
                        GieReading::FirstSample => Reading::FirstSample,
                        GieReading::Sum => Reading::Sum,
                    },
                    &spec.sim.model,
                    salt,
                ))),
                VariantFront::Smg {
                    policy,
                    dp_aware,
                    args,
                    ..
                } if policy == "cache_aware" => {
                    let knobs = SmgKnobs::from_args(args)?;
                    Front::Smg(Box::new(SmgFront {
                        policy: CacheAware::new(spec.workers, spec.sim.dp_size(), *dp_aware, &knobs),
                        limiter: Limiter::of(&knobs),
                    }))
                }
                _ => {
                    return Err(format!(
                        "`{}`: offline runs support rr, in-server, clairvoyant, gie, dprank[...] and smg cache_aware (with or without --dp-aware)",
                        spec.variant.name
                    ))
                }
            })
        })
        .collect()
}

/// The sim's request for a body whose answer is `answer` tokens long (the
/// plan's number, given out of band: the body carries only the cap).
fn sim_request(body: &[u8], placement: Placement, answer: u32) -> Result<(Request, bool), String> {
    let value: Value = serde_json::from_slice(body).map_err(|e| format!("body: {e}"))?;
    let prompt = match (
        value.get("messages"),
        value.get("text").or_else(|| value.get("prompt")),
    ) {
        (Some(messages), _) => Prompt::Text(template_json(messages).ok_or("messages not a list")?),
        (_, Some(Value::String(text))) => Prompt::Text(text.clone()),
        _ => return Err("a body with neither messages nor a text prompt".into()),
    };
    let max_new = value
        .pointer("/sampling_params/max_new_tokens")
        .or_else(|| value.get("max_tokens"))
        .and_then(Value::as_u64)
        .unwrap_or(1);
    let streamed = value.get("stream").and_then(Value::as_bool).unwrap_or(false);
    let mut request = Request::new(prompt, max_new).answer_after(u64::from(answer.max(1)));
    if let Some(rank) = placement.rank {
        request = request.on_rank(rank);
    }
    if let Some(value) = placement.rank_header {
        request = request.with_rank_header(value.to_string());
    }
    if let Some(priority) = placement.priority {
        request = request.with_priority(priority);
    }
    Ok((request, streamed))
}

fn empty_record(sent_s: f64, gateway: usize, input: u32, output: u32) -> RequestRecord {
    RequestRecord {
        sent_s,
        end_s: sent_s,
        gateway,
        input_tokens: input,
        output_tokens: output,
        ttft_ms: None,
        tpot_ms: f64::NAN,
        e2e_ms: f64::NAN,
        tokens: 0,
        prompt_tokens: None,
        cached_tokens: None,
        error: None,
        session: None,
        gaps_us: Vec::new(),
        high: None,
        rejected: None,
        held_ms: None,
    }
}

/// The chat body of a session's turn, with the answers before it.
fn turn_body(plan: &Plan, session: usize, turn: usize) -> (bytes::Bytes, u32) {
    let s = &plan.sessions[session];
    let answers: Vec<String> = s.turns[..turn]
        .iter()
        .map(|t| text_upto(u64::from(t.output_tokens)))
        .collect();
    let mut messages: Vec<(&str, &str)> = vec![("system", &s.system)];
    for (t, answer) in s.turns[..turn].iter().zip(&answers) {
        messages.push(("user", &t.user));
        messages.push(("assistant", answer));
    }
    messages.push(("user", &s.turns[turn].user));
    let input = text::chat_tokens(&messages) as u32;
    (bodies::chat(&messages, s.turns[turn].max_tokens), input)
}

/// What one offline run gives back.
pub struct Outcome {
    /// What the load generator would have measured.
    pub output: RunOutput,
    /// dprank's counters and the retractions, as one line.
    pub counters: Option<String>,
    /// The run stopped early under [`RunSpec::give_up`] (what had not been
    /// sent is counted in `output.abandoned`).
    pub gave_up: bool,
}

/// What a worker answers a load poll of `path` with: status and body.
pub fn poll_answer(fleet: &Fleet, vllm: bool, worker: usize, metrics: bool) -> (u32, String) {
    let not_found = || {
        (
            404,
            r#"{"error":{"message":"Not Found","type":"NotFoundError","param":null,"code":404}}"#.to_string(),
        )
    };
    match (vllm, metrics) {
        (true, true) => (200, fleet.metrics(worker)),
        (false, false) => (200, fleet.v1_loads(worker).to_string()),
        _ => not_found(),
    }
}

/// Runs `plan` under `spec`.
pub fn run(plan: &Plan, spec: &RunSpec) -> Result<Outcome, String> {
    let vllm = spec.sim.is_vllm();
    // A vLLM server has no /generate: its requests go to /v1/completions.
    let converted;
    let plan = if vllm {
        converted = plan.to_openai();
        &converted
    } else {
        plan
    };
    let mut sim = spec.sim.clone();
    sim.dispatch = Some(match (spec.variant.dispatch, sim.is_vllm()) {
        (Dispatch::Clairvoyant, _) => dprank_sim::Dispatch::Oracle,
        (Dispatch::RoomModulo, _) => return Err("PD variants do not run offline".into()),
        // A vLLM server has one balancer of its own.
        (_, true) => dprank_sim::Dispatch::Vllm,
        (Dispatch::InServer, false) => dprank_sim::Dispatch::TotalTokens,
        (Dispatch::RoundRobin, false) => dprank_sim::Dispatch::RoundRobin,
    });
    let mut fleet = Fleet::new(sim, spec.workers)?;
    let mut fronts = fronts(spec)?;
    let gateways = fronts.len();
    let mut queue = Queue {
        heap: BinaryHeap::new(),
        seq: 0,
    };
    for (i, r) in plan.requests.iter().enumerate() {
        queue.push(r.at_s, Event::Open(i));
    }
    for (i, s) in plan.sessions.iter().enumerate() {
        if !s.turns.is_empty() {
            queue.push(
                s.start_s + s.turns[0].think_s,
                Event::Turn { session: i, turn: 0 },
            );
        }
    }
    for (g, front) in fronts.iter_mut().enumerate() {
        // Gateways start at independent points of their poll cycle.
        let phase = |interval_s: f64| (mix(spec.seed ^ g as u64) % 1000) as f64 / 1000.0 * interval_s;
        if matches!(front, Front::Ie(_)) {
            queue.push(0.0, Event::IePoll(g));
        }
        if matches!(front, Front::Gie(_)) {
            queue.push(phase(gie::POLL_S), Event::GiePoll(g));
        }
        if let Some(gateway) = front.dprank() {
            let interval_s = gateway.config.poll_interval_ms as f64 / 1000.0;
            queue.push(phase(interval_s), Event::Tick(g));
        }
    }
    let mut in_flight: HashMap<u64, InFlight> = HashMap::new();
    let mut waiting: HashMap<(usize, u64), Waiting> = HashMap::new();
    let mut next_id: u64 = 0;
    let mut request_log: Option<Vec<serde_json::Value>> = spec.requests_out.as_ref().map(|_| Vec::new());
    let mut records: Vec<RequestRecord> = Vec::new();
    let mut beyond_horizon = 0usize;
    let mut arrivals_left = plan.request_count();
    let mut gave_up = false;
    loop {
        // Nothing left to send, hold or answer: ticks alone do not keep a
        // run going.
        if arrivals_left == 0 && in_flight.is_empty() && waiting.is_empty() {
            break;
        }
        if spec.cut_at_s.is_some_and(|cut| fleet.now() >= cut) {
            break;
        }
        if let Some(rule) = &spec.give_up {
            // Requests still waiting count as soon as they are late.
            let waiting_late = in_flight
                .values()
                .filter(|f| {
                    f.first_s.is_none()
                        && f.record.sent_s >= rule.from_s
                        && fleet.now() - f.record.sent_s > rule.ttft_s
                })
                .count();
            let ttft_late = rule.counts.ttft.load(Ordering::Relaxed);
            let tpot_late = rule.counts.tpot.load(Ordering::Relaxed);
            if ttft_late + waiting_late > rule.late_allowed || tpot_late > rule.late_allowed {
                gave_up = true;
                break;
            }
        }
        let horizon = fleet.now() + MAX_STEP_S;
        let reports = match queue.peek_s() {
            Some(t) if t <= horizon => fleet.run_until(t),
            _ => fleet.run_until(horizon),
        };
        for report in reports {
            let Some(flight) = in_flight.get_mut(&report.req) else {
                continue;
            };
            let front = &mut fronts[flight.gateway];
            if !report.finished {
                if let Some(rule) = &spec.give_up {
                    if flight.record.sent_s >= rule.from_s && report.at - flight.record.sent_s > rule.ttft_s {
                        rule.counts.ttft.fetch_add(1, Ordering::Relaxed);
                    }
                }
                flight.first_s = Some(report.at);
                flight.record.ttft_ms = Some((report.at - flight.record.sent_s) * 1000.0);
                flight.record.prompt_tokens = Some(report.prompt_tokens);
                flight.record.cached_tokens = Some(report.cached_tokens);
                if flight.streamed {
                    front.first_bytes(report.at, &mut flight.held, true);
                }
                continue;
            }
            let Some(mut flight) = in_flight.remove(&report.req) else {
                continue;
            };
            let front = &mut fronts[flight.gateway];
            if !flight.streamed {
                front.first_bytes(report.at, &mut flight.held, false);
            }
            let later_chunks = match flight.streamed {
                true => report.completion_tokens.saturating_sub(1),
                false => 0,
            };
            front.done(report.at, flight.placement, &mut flight.held, later_chunks);
            let first = flight.first_s.unwrap_or(report.at);
            let r = &mut flight.record;
            r.end_s = report.at;
            r.e2e_ms = (report.at - r.sent_s) * 1000.0;
            r.tokens = report.completion_tokens as u32;
            if report.completion_tokens >= 2 {
                r.tpot_ms = (report.at - first) * 1000.0 / (report.completion_tokens - 1) as f64;
                if let Some(rule) = &spec.give_up {
                    if r.sent_s >= rule.from_s && r.tpot_ms > rule.tpot_s * 1000.0 {
                        rule.counts.tpot.fetch_add(1, Ordering::Relaxed);
                    }
                }
            }
            if let Some((session, turn)) = flight.turn {
                let next_turn = turn + 1;
                if let Some(t) = plan.sessions[session].turns.get(next_turn) {
                    let at = report.at + t.think_s;
                    if at > spec.turn_horizon_s {
                        let left = plan.sessions[session].turns.len() - next_turn;
                        beyond_horizon += left;
                        arrivals_left -= left;
                    } else {
                        queue.push(
                            at,
                            Event::Turn {
                                session,
                                turn: next_turn,
                            },
                        );
                    }
                }
            }
            if let Some(log) = &mut request_log {
                let mut line = flight.record.to_json();
                line["worker"] = flight.placement.worker.into();
                line["rank"] = report.rank.into();
                line["head"] = serde_json::json!(flight.head);
                log.push(line);
            }
            records.push(flight.record);
        }
        let now = fleet.now();
        settle(
            &mut fleet,
            &mut fronts,
            &mut waiting,
            &mut in_flight,
            &mut records,
            now,
        )?;
        if queue.peek_s().is_none_or(|t| t > fleet.now()) {
            continue;
        }
        let Some((t, event)) = queue.pop() else {
            continue;
        };
        match event {
            Event::IePoll(g) => {
                let loads: Vec<Value> = (0..spec.workers).map(|w| fleet.v1_loads(w)).collect();
                if let Front::Ie(ie) = &mut fronts[g] {
                    ie.poll(&loads);
                }
                if arrivals_left > 0 || !in_flight.is_empty() || !waiting.is_empty() {
                    queue.push(t + IE_POLL_S, Event::IePoll(g));
                }
            }
            Event::Tick(g) => {
                if let Some(gateway) = fronts[g].dprank() {
                    for call in gateway.tick(t) {
                        queue.push(
                            t + POLL_RTT_S,
                            Event::Poll {
                                gateway: g,
                                token: call.token,
                                worker: call.worker,
                                metrics: call.path.starts_with("/metrics"),
                            },
                        );
                    }
                    queue.push(t + gateway.tick_period_s(), Event::Tick(g));
                }
            }
            Event::Poll {
                gateway,
                token,
                worker,
                metrics,
            } => {
                // The worker answers from what it last published.
                let (status, body) = poll_answer(&fleet, vllm, worker, metrics);
                if let Some(g) = fronts[gateway].dprank() {
                    let call = PollCall {
                        token,
                        worker,
                        path: String::new(),
                    };
                    g.poll_answer(t, call, status, body.as_bytes());
                }
            }
            Event::GiePoll(g) => {
                if let Front::Gie(model) = &mut fronts[g] {
                    for worker in 0..spec.workers {
                        model.poll(worker, &fleet.engine_stats(worker));
                    }
                    queue.push(t + gie::POLL_S, Event::GiePoll(g));
                }
            }
            Event::Open(i) => {
                arrivals_left -= 1;
                let r = &plan.requests[i];
                let g = gateway_for(spec.seed, i as u64, gateways);
                let mut record = empty_record(t, g, r.input_tokens, r.output_tokens);
                record.high = r.high;
                next_id += 1;
                let arrival = Arrive {
                    id: next_id,
                    gateway: g,
                    api: r.api,
                    body: r.body.clone(),
                    turn: None,
                };
                arrive(
                    &mut fleet,
                    &mut fronts,
                    &mut in_flight,
                    &mut waiting,
                    &mut records,
                    t,
                    arrival,
                    record,
                )?;
            }
            Event::Turn { session, turn } => {
                arrivals_left -= 1;
                let s = &plan.sessions[session];
                let g = gateway_for(spec.seed, 1 << 40 | u64::from(s.id), gateways);
                let (body, input) = turn_body(plan, session, turn);
                let mut record = empty_record(t, g, input, s.turns[turn].output_tokens);
                record.session = Some((s.id, turn as u32));
                next_id += 1;
                let arrival = Arrive {
                    id: next_id,
                    gateway: g,
                    api: Api::Chat,
                    body,
                    turn: Some((session, turn)),
                };
                arrive(
                    &mut fleet,
                    &mut fronts,
                    &mut in_flight,
                    &mut waiting,
                    &mut records,
                    t,
                    arrival,
                    record,
                )?;
            }
        }
    }
    if let (Some(path), Some(log)) = (&spec.requests_out, &request_log) {
        crate::loadgen::write_requests(path, log)?;
    }
    if gave_up {
        // What was still waiting failed its target: it counts as a failure.
        for flight in in_flight.into_values() {
            let mut r = flight.record;
            if r.ttft_ms.is_none() {
                r.error = Some("run given up: too many requests past the TTFT target".into());
            }
            records.push(r);
        }
    }
    records.sort_by(|a, b| a.sent_s.total_cmp(&b.sent_s));
    let last_arrival = plan.last_arrival_s();
    let span_s = records.iter().map(|r| r.end_s).fold(0.0, f64::max);
    let retractions = fleet.retractions().len();
    let counters = Some(match counter_summary(&fronts) {
        Some(c) => format!("{c} retractions={retractions}"),
        None => format!("retractions={retractions}"),
    });
    Ok(Outcome {
        output: RunOutput {
            records,
            abandoned: if gave_up { arrivals_left } else { 0 },
            beyond_horizon,
            samples: Vec::new(),
            arrival_window_s: last_arrival,
            span_s,
        },
        counters: counters.filter(|c| !c.is_empty()),
        gave_up,
    })
}

/// dprank's counters summed over its gateways, by kind (`routed`,
/// `poll_ok`, `passthrough.no_fresh_data`, ...), as one line.
fn counter_summary(fronts: &[Front]) -> Option<String> {
    let mut sums: std::collections::BTreeMap<String, u64> = std::collections::BTreeMap::new();
    for front in fronts {
        if let Front::Dprank(g) = front {
            for (name, value) in g.host.counters.borrow().iter() {
                let name = name.trim_start_matches("dprank.");
                let kind = match name.split('.').next() {
                    Some(
                        k @ ("routed" | "poll_ok" | "poll_failed" | "poll_skipped" | "prefix_forgotten"),
                    ) => k.to_string(),
                    _ => name.to_string(),
                };
                *sums.entry(kind).or_default() += value;
            }
        }
    }
    (!sums.is_empty()).then(|| {
        sums.iter()
            .map(|(k, v)| format!("{k}={v}"))
            .collect::<Vec<_>>()
            .join(" ")
    })
}

/// An arriving request: its id, gateway, body and chat turn.
struct Arrive {
    id: u64,
    gateway: usize,
    api: Api,
    body: bytes::Bytes,
    turn: Option<(usize, usize)>,
}

/// A request reaches its gateway at `t`: sent to the fleet, held, or
/// refused (recorded at once).
#[allow(clippy::too_many_arguments)]
fn arrive(
    fleet: &mut Fleet,
    fronts: &mut [Front],
    in_flight: &mut HashMap<u64, InFlight>,
    waiting: &mut HashMap<(usize, u64), Waiting>,
    records: &mut Vec<RequestRecord>,
    t: f64,
    a: Arrive,
    mut record: RequestRecord,
) -> Result<(), String> {
    let high = record.high;
    let (arrival, held) = fronts[a.gateway].route(t, a.id, a.api.path(), &a.body, high);
    match arrival {
        Arrival::Go(placement) => submit(
            fleet, in_flight, t, a.gateway, &a.body, placement, held, record, a.turn,
        ),
        Arrival::Waiting => {
            waiting.insert(
                (a.gateway, a.id),
                Waiting {
                    gateway: a.gateway,
                    body: a.body,
                    record,
                    turn: a.turn,
                },
            );
            Ok(())
        }
        Arrival::Refused(status) => {
            refuse(&mut record, status, t);
            records.push(record);
            Ok(())
        }
    }
}

/// A refusal at `at_s` (status kept; the request counts as rejected).
fn refuse(record: &mut RequestRecord, status: u16, at_s: f64) {
    record.rejected = Some(status);
    record.end_s = at_s;
    record.e2e_ms = (at_s - record.sent_s) * 1000.0;
}

/// What the fronts sent on or refused of the requests they held, at `t`.
fn settle(
    fleet: &mut Fleet,
    fronts: &mut [Front],
    waiting: &mut HashMap<(usize, u64), Waiting>,
    in_flight: &mut HashMap<u64, InFlight>,
    records: &mut Vec<RequestRecord>,
    t: f64,
) -> Result<(), String> {
    if waiting.is_empty() {
        return Ok(());
    }
    for (g, front) in fronts.iter_mut().enumerate() {
        for released in front.released(t) {
            match released {
                Released::Go { id, placement, held } => {
                    let Some(w) = waiting.remove(&(g, id)) else {
                        continue;
                    };
                    let mut record = w.record;
                    record.held_ms = Some((t - record.sent_s) * 1000.0);
                    submit(
                        fleet, in_flight, t, w.gateway, &w.body, placement, held, record, w.turn,
                    )?;
                }
                Released::Refused { id, status, at_s } => {
                    if let Some(w) = waiting.remove(&(g, id)) {
                        let mut record = w.record;
                        refuse(&mut record, status, at_s);
                        records.push(record);
                    }
                }
            }
        }
    }
    Ok(())
}

/// Sends a request its front placed to the fleet at `t`.
#[allow(clippy::too_many_arguments)]
fn submit(
    fleet: &mut Fleet,
    in_flight: &mut HashMap<u64, InFlight>,
    t: f64,
    gateway: usize,
    body: &[u8],
    placement: Placement,
    held: Held,
    record: RequestRecord,
    turn: Option<(usize, usize)>,
) -> Result<(), String> {
    let (request, streamed) = sim_request(body, placement, record.output_tokens)?;
    let id = fleet.submit(t.max(fleet.now()), placement.worker, request)?;
    in_flight.insert(
        id,
        InFlight {
            gateway,
            placement,
            held,
            streamed,
            record,
            first_s: None,
            turn,
            head: dprank::body::JsonObject::parse(body).ok().and_then(|o| {
                let blocks = dprank::prefix::PromptBlocks::of(&o, 512);
                blocks.chains.first()?.hashes.first().copied()
            }),
        },
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::preset::Kv;
    use crate::workload::{Shape, Workload, WorkloadKind};

    fn vllm_spec(variant: &Variant) -> RunSpec<'_> {
        let preset = crate::preset::preset("vllm-dense-8b").unwrap();
        RunSpec {
            variant,
            sim: crate::offline::sim_config(preset, Kv::Small, 4, &[]).unwrap(),
            workers: 2,
            seed: 3,
            turn_horizon_s: f64::INFINITY,
            cut_at_s: None,
            requests_out: None,
            give_up: None,
        }
    }

    #[test]
    fn vllm_fleets_run_behind_every_front_that_fits_them() {
        let shape = Shape {
            rate: 4.0,
            duration_s: 10.0,
            seed: 3,
            max_prompt: 4000,
            max_output: 256,
        };
        for kind in [WorkloadKind::NoPrefix, WorkloadKind::Tenants] {
            let plan = Workload::new(kind).plan(&shape).unwrap();
            for name in [
                "rr",
                "in-server",
                "in-server-rr",
                "gie",
                "gie-sum",
                "clairvoyant",
                "dprank",
            ] {
                let variant = Variant::parse(name).unwrap();
                let outcome = run(&plan, &vllm_spec(&variant)).unwrap();
                let records = &outcome.output.records;
                assert_eq!(records.len(), plan.request_count(), "{name} {kind:?}");
                assert!(records.iter().all(|r| r.ok()), "{name} {kind:?}");
                assert!(
                    records.iter().all(|r| r.prompt_tokens.unwrap_or(0) > 0),
                    "{name} {kind:?}"
                );
            }
        }
    }

    #[test]
    fn a_run_is_given_up_on_tpot_misses_and_on_what_its_sibling_seeds_counted() {
        let shape = Shape {
            rate: 4.0,
            duration_s: 20.0,
            seed: 3,
            max_prompt: 4000,
            max_output: 256,
        };
        let plan = Workload::new(WorkloadKind::NoPrefix).plan(&shape).unwrap();
        let variant = Variant::parse("clairvoyant").unwrap();
        let give_up = |tpot_s: f64, late_allowed: usize, counts: std::sync::Arc<LateCounts>| {
            let mut spec = vllm_spec(&variant);
            spec.give_up = Some(GiveUp {
                from_s: 0.0,
                ttft_s: 1e9,
                tpot_s,
                late_allowed,
                counts,
            });
            run(&plan, &spec).unwrap()
        };
        // Targets nothing misses: the run ends as without the rule.
        let kept = give_up(1e9, 0, Default::default());
        assert!(!kept.gave_up);
        assert_eq!(kept.output.records.len(), plan.request_count());
        // A TPOT target every answer misses, the TTFT target never missed.
        let counts = std::sync::Arc::new(LateCounts::default());
        let missed = give_up(0.0, 3, counts.clone());
        assert!(missed.gave_up);
        assert!(missed.output.records.len() < plan.request_count());
        assert_eq!(counts.tpot.load(Ordering::Relaxed), 4);
        // A sibling seed already counted past the allowance: given up at once.
        let counts = std::sync::Arc::new(LateCounts::default());
        counts.ttft.store(11, Ordering::Relaxed);
        let at_once = give_up(1e9, 10, counts);
        assert!(at_once.gave_up);
        assert!(at_once.output.records.is_empty());
    }

    #[test]
    fn a_vllm_server_answers_polls_of_metrics_and_refuses_sglang_s() {
        let preset = crate::preset::preset("vllm-dense-8b").unwrap();
        let sim = crate::offline::sim_config(preset, Kv::Small, 4, &[]).unwrap();
        let fleet = Fleet::new(sim, 2).unwrap();
        let (status, body) = poll_answer(&fleet, true, 1, true);
        assert_eq!(status, 200);
        let report = dprank::load::vllm::parse_vllm_metrics(body.as_bytes(), None).unwrap();
        assert_eq!(report.engines.len(), 4);
        assert_eq!(poll_answer(&fleet, true, 1, false).0, 404);
        let sglang =
            crate::offline::sim_config(crate::preset::preset("legacy").unwrap(), Kv::Small, 4, &[]).unwrap();
        let fleet = Fleet::new(sglang, 1).unwrap();
        assert_eq!(poll_answer(&fleet, false, 0, false).0, 200);
        assert_eq!(poll_answer(&fleet, false, 0, true).0, 404);
    }

    #[test]
    fn generate_requests_become_completions_for_vllm() {
        let shape = Shape {
            rate: 2.0,
            duration_s: 5.0,
            seed: 1,
            max_prompt: 2000,
            max_output: 100,
        };
        let plan = Workload::new(WorkloadKind::NoPrefix).plan(&shape).unwrap();
        let openai = plan.to_openai();
        for (before, after) in plan.requests.iter().zip(&openai.requests) {
            assert_eq!(after.api, Api::Completions);
            let a: Value = serde_json::from_slice(&before.body).unwrap();
            let b: Value = serde_json::from_slice(&after.body).unwrap();
            assert_eq!(a["text"], b["prompt"]);
            assert_eq!(a["sampling_params"]["max_new_tokens"], b["max_tokens"]);
            assert_eq!(a["stream"], b["stream"]);
        }
    }
}
