//! Per-request routing: body in, decision out. Knows nothing of proxy-wasm;
//! the HTTP context applies the decision.

use crate::body::{json_string, may_name_a_rank, BodyError, JsonObject};
use crate::config::{Config, FailMode, Prefill, RankOf, Worker};
use crate::host::{shared_update, Host};
use crate::scheduler::{self, Candidate};
use crate::state::{Ticket, WorkerState};

/// Why a request went through untouched (also the suffix of its counter).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PassReason {
    Method,
    Path,
    EmptyBody,
    Encoded,
    NotJson,
    NotObject,
    NoFreshData,
    /// A trusted client asked for a rank no fresh worker has.
    ClientRankUnavailable,
    /// Not JSON to dprank, yet it names a rank a lenient server parser could honour.
    UnreadableRank,
}

impl PassReason {
    pub fn as_str(self) -> &'static str {
        match self {
            PassReason::Method => "method",
            PassReason::Path => "path",
            PassReason::EmptyBody => "empty_body",
            PassReason::Encoded => "content_encoding",
            PassReason::NotJson => "not_json",
            PassReason::NotObject => "not_object",
            PassReason::NoFreshData => "no_fresh_data",
            PassReason::ClientRankUnavailable => "client_rank_unavailable",
            PassReason::UnreadableRank => "unreadable_rank",
        }
    }
}

#[derive(Debug, PartialEq, Eq)]
pub struct Routed {
    pub worker: usize,
    pub rank: u32,
    /// Value for the route header (`ip:port`).
    pub endpoint: String,
    /// The rewritten body, or None to keep the client's (a trusted client rank).
    pub body: Option<Vec<u8>>,
    /// To release when the request ends; None if accounting could not be written.
    pub ticket: Option<Ticket>,
}

#[derive(Debug, PartialEq, Eq)]
pub enum Decision {
    Route(Routed),
    PassThrough {
        reason: PassReason,
        /// The body with untrusted client rank fields neutralised, if it had any.
        body: Option<Vec<u8>>,
    },
    /// PD mode: send `prefill_body` to the prefill worker, forward the decode body.
    Pd(PdRouted),
    Reject {
        status: u32,
        body: String,
    },
}

pub fn worker_key(config: &Config, worker: usize) -> String {
    let endpoint = config.worker(worker).map(|w| w.endpoint()).unwrap_or_default();
    format!("{}.w.{}", config.state_key, endpoint)
}

/// Shared state of every worker, indexed like `Config::all_workers`.
pub fn read_worker_states(config: &Config, host: &dyn Host) -> Vec<Option<WorkerState>> {
    (0..config.all_workers().count())
        .map(|i| {
            host.shared_get(&worker_key(config, i))
                .and_then(|(bytes, _)| WorkerState::decode(&bytes))
        })
        .collect()
}

fn error_body(kind: &str, message: &str) -> String {
    serde_json::json!({"error": {"message": message, "type": kind, "code": "dprank"}}).to_string()
}

const NOT_AN_OBJECT: &str = "request body must be a JSON object (dprank routes by its fields)";

/// Counts a pass-through and, in closed mode, turns routing failures into errors.
fn pass_or_reject(config: &Config, host: &dyn Host, reason: PassReason, body: Option<Vec<u8>>) -> Decision {
    let refusal = match (config.fail_mode, reason) {
        // Passing it on would let the client pick its rank: refused in every mode.
        (_, PassReason::UnreadableRank) => Some((
            400,
            "invalid_request_error",
            "request body is not strict JSON (RFC 8259) and names a rank field: dprank can neither read nor neutralise it",
        )),
        (FailMode::Closed, PassReason::NotJson | PassReason::NotObject) => {
            Some((400, "invalid_request_error", NOT_AN_OBJECT))
        }
        (FailMode::Closed, PassReason::ClientRankUnavailable) => Some((
            400,
            "invalid_request_error",
            "no worker with fresh load data has the requested rank",
        )),
        (FailMode::Closed, PassReason::NoFreshData) => {
            Some((503, "service_unavailable", "no worker has fresh load data"))
        }
        _ => None,
    };
    match refusal {
        Some((status, kind, message)) => reject(host, reason, status, kind, message),
        None => {
            host.count(&format!("dprank.passthrough.{}", reason.as_str()), 1);
            Decision::PassThrough { reason, body }
        }
    }
}

/// Counts a refusal and answers it with an OpenAI-style JSON error.
fn reject(host: &dyn Host, reason: PassReason, status: u32, kind: &str, message: &str) -> Decision {
    host.count(&format!("dprank.rejected.{}", reason.as_str()), 1);
    Decision::Reject {
        status,
        body: error_body(kind, message),
    }
}

fn reject_bad_body(host: &dyn Host, reason: PassReason) -> Decision {
    reject(host, reason, 400, "invalid_request_error", NOT_AN_OBJECT)
}

/// Counts a request that is not routed for a reason seen before its body.
pub fn pass_early(host: &dyn Host, reason: PassReason) {
    host.count(&format!("dprank.passthrough.{}", reason.as_str()), 1);
}

fn parse_body(body: &[u8]) -> Result<JsonObject<'_>, PassReason> {
    JsonObject::parse(body).map_err(|e| match e {
        BodyError::NotJson => PassReason::NotJson,
        BodyError::NotObject => PassReason::NotObject,
    })
}

/// The rank a trusted client asked for, if it asked with a valid integer.
fn client_rank(config: &Config, body: &JsonObject) -> Option<u32> {
    config.rank_field_names().into_iter().find_map(|name| {
        let raw = body.raw_value(name)?;
        std::str::from_utf8(raw).ok()?.parse::<u32>().ok()
    })
}

/// The best (worker, rank) of one pool: `workers` are `Config::all_workers`
/// from `offset` on; the candidate's `worker` is a global index.
#[allow(clippy::too_many_arguments)]
fn choose(
    config: &Config,
    host: &dyn Host,
    states: &[Option<WorkerState>],
    workers: &[Worker],
    offset: usize,
    only_rank: Option<u32>,
    pin: Option<&str>,
    tie_breaker: u64,
) -> Option<Candidate> {
    let states = states.get(offset..offset + workers.len())?;
    let candidates = || {
        let fresh = scheduler::fresh_candidates(workers, states, host.now_ms(), config.stale_after_ms);
        scheduler::only_rank(fresh, only_rank)
    };
    let pinned = pin.and_then(|p| {
        let hit = scheduler::pinned(candidates(), workers, p);
        if hit.is_none() {
            host.count("dprank.pin_ignored", 1);
        }
        hit
    });
    let mut choice = pinned.or_else(|| scheduler::least_loaded(candidates(), tie_breaker))?;
    choice.worker += offset;
    Some(choice)
}

/// Adds a routed request's estimate to its rank and counts the route.
fn account(config: &Config, host: &dyn Host, worker: usize, rank: u32, cost: u64) -> Option<Ticket> {
    let ticket = shared_update(host, &worker_key(config, worker), |current| {
        let mut state = current.and_then(WorkerState::decode)?;
        let ticket = state.add(worker, rank, cost)?;
        Some((state.encode(), ticket))
    });
    if ticket.is_none() {
        host.count("dprank.accounting_skipped", 1);
    }
    if let Some(w) = config.worker(worker) {
        host.count(&format!("dprank.routed.{}.rank_{rank}", w.name), 1);
    }
    ticket
}

/// The body with `set` written and every other field of `neutralise` that
/// the client sent set to null (null = let the server decide).
fn rewrite(object: &JsonObject, set: &[(&str, String)], neutralise: &[&str]) -> Vec<u8> {
    let mut fields: Vec<(&str, &str)> = set.iter().map(|(k, v)| (*k, v.as_str())).collect();
    for name in neutralise {
        if !set.iter().any(|(k, _)| k == name) && object.has_any(&[name]) {
            fields.push((name, "null"));
        }
    }
    object.with_fields(&fields)
}

/// Decides where a request with this body goes. `pin` is the test-only pin
/// header (already None unless the config enables it). `tie_breaker` varies
/// per request so equal loads spread.
pub fn route(config: &Config, host: &dyn Host, body: &[u8], pin: Option<&str>, tie_breaker: u64) -> Decision {
    if let Some(prefill) = &config.prefill {
        return route_pd(config, prefill, host, body, pin, tie_breaker);
    }
    if body.is_empty() {
        // A chunked or HTTP/2 request whose body turned out empty.
        pass_early(host, PassReason::EmptyBody);
        return Decision::PassThrough {
            reason: PassReason::EmptyBody,
            body: None,
        };
    }
    let object = match parse_body(body) {
        Ok(o) => o,
        Err(PassReason::NotJson)
            if !config.keep_client_rank && may_name_a_rank(body, &config.rank_field_names()) =>
        {
            return pass_or_reject(config, host, PassReason::UnreadableRank, None)
        }
        Err(reason) => return pass_or_reject(config, host, reason, None),
    };
    let rank_names = config.rank_field_names();
    let trusted_rank = config
        .keep_client_rank
        .then(|| client_rank(config, &object))
        .flatten();
    let states = read_worker_states(config, host);
    let Some(Candidate { worker, rank, .. }) = choose(
        config,
        host,
        &states,
        &config.workers,
        0,
        trusted_rank,
        pin,
        tie_breaker,
    ) else {
        if trusted_rank.is_some()
            && choose(config, host, &states, &config.workers, 0, None, None, 0).is_some()
        {
            return pass_or_reject(config, host, PassReason::ClientRankUnavailable, None);
        }
        let neutralised = (trusted_rank.is_none() && object.has_any(&rank_names))
            .then(|| rewrite(&object, &[], &rank_names));
        return pass_or_reject(config, host, PassReason::NoFreshData, neutralised);
    };
    let ticket = account(
        config,
        host,
        worker,
        rank,
        object.estimated_tokens(config.cost_estimate),
    );
    let body = trusted_rank.is_none().then(|| {
        rewrite(
            &object,
            &[(config.rank_field.as_str(), rank.to_string())],
            &rank_names,
        )
    });
    Decision::Route(Routed {
        worker,
        rank,
        endpoint: config.worker(worker).map(|w| w.endpoint()).unwrap_or_default(),
        body,
        ticket,
    })
}

/// A worker and, when load data allowed a choice, its rank.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Target {
    /// Index in `Config::all_workers`.
    pub worker: usize,
    pub rank: Option<u32>,
    pub endpoint: String,
}

#[derive(Debug, PartialEq, Eq)]
pub struct PdRouted {
    pub prefill: Target,
    /// None when no decode worker has fresh data: the cluster's fallback picks.
    pub decode: Option<Target>,
    pub prefill_body: Vec<u8>,
    pub decode_body: Vec<u8>,
    pub prefill_ticket: Option<Ticket>,
    pub decode_ticket: Option<Ticket>,
}

/// Number of prompts in a batched request (`text` or `input_ids` of arrays), if batched.
fn batch_size(object: &JsonObject) -> Option<usize> {
    if let Some(text) = object.raw_value("text") {
        return serde_json::from_slice::<Vec<serde::de::IgnoredAny>>(text)
            .ok()
            .map(|v| v.len());
    }
    let ids = object.raw_value("input_ids")?;
    let rows: Vec<&serde_json::value::RawValue> = serde_json::from_slice(ids).ok()?;
    rows.first()
        .filter(|r| r.get().trim_start().starts_with('['))
        .map(|_| rows.len())
}

/// PD mode: picks a prefill and a decode (worker, rank) from their pools and
/// writes the bootstrap fields both sides need to meet.
fn route_pd(
    config: &Config,
    prefill: &Prefill,
    host: &dyn Host,
    body: &[u8],
    pin: Option<&str>,
    tie_breaker: u64,
) -> Decision {
    let object = match parse_body(body) {
        // Without the bootstrap fields neither side could serve it.
        Err(reason) => return reject_bad_body(host, reason),
        Ok(o) => o,
    };
    let (prefill_pin, decode_pin) = match pin.map(|p| p.split_once(',').unwrap_or((p, ""))) {
        Some((p, d)) => (
            Some(p.trim()).filter(|p| !p.is_empty()),
            Some(d.trim()).filter(|d| !d.is_empty()),
        ),
        None => (None, None),
    };
    let states = read_worker_states(config, host);
    let offset = config.workers.len();
    let p = choose(
        config,
        host,
        &states,
        &prefill.workers,
        offset,
        None,
        prefill_pin,
        tie_breaker,
    );
    let d = choose(
        config,
        host,
        &states,
        &config.workers,
        0,
        None,
        decode_pin,
        tie_breaker,
    );
    if p.is_none() {
        host.count("dprank.passthrough.no_fresh_data_prefill", 1);
    }
    if d.is_none() {
        host.count("dprank.passthrough.no_fresh_data", 1);
    }
    // Without prefill data, rotate over the prefill workers and let them pick the rank.
    let prefill_index = p
        .map(|c| c.worker - offset)
        .unwrap_or((tie_breaker % prefill.workers.len().max(1) as u64) as usize);
    let Some(prefill_worker) = prefill.workers.get(prefill_index) else {
        return reject_bad_body(host, PassReason::NoFreshData);
    };

    let cost = object.estimated_tokens(config.cost_estimate);
    let prefill_ticket = p.and_then(|c| account(config, host, c.worker, c.rank, cost));
    let decode_ticket = d.and_then(|c| account(config, host, c.worker, c.rank, cost));

    let host_json = json_string(&prefill_worker.address.ip().to_string());
    let port_json = prefill_worker
        .bootstrap_port
        .map_or("null".to_string(), |p| p.to_string());
    let (bootstrap_host, bootstrap_port, bootstrap_room) = match batch_size(&object) {
        Some(n) => {
            let rooms: Vec<String> = (0..n).map(|_| (host.random_u64() >> 1).to_string()).collect();
            (
                format!("[{}]", vec![host_json; n].join(",")),
                format!("[{}]", vec![port_json; n].join(",")),
                format!("[{}]", rooms.join(",")),
            )
        }
        None => (host_json, port_json, (host.random_u64() >> 1).to_string()),
    };
    let bootstrap = [
        ("bootstrap_host", bootstrap_host),
        ("bootstrap_port", bootstrap_port),
        ("bootstrap_room", bootstrap_room),
    ];
    let ranks = (p.map(|c| c.rank), d.map(|c| c.rank));
    let neutralise = prefill.field_names();
    let prefill_body = rewrite(
        &object,
        &pd_body_fields(&bootstrap, &prefill.prefill_body_fields, ranks),
        &neutralise,
    );
    let decode_body = rewrite(
        &object,
        &pd_body_fields(&bootstrap, &prefill.decode_body_fields, ranks),
        &neutralise,
    );
    let target = |worker: usize, rank: Option<u32>| Target {
        worker,
        rank,
        endpoint: config.worker(worker).map(|w| w.endpoint()).unwrap_or_default(),
    };
    Decision::Pd(PdRouted {
        prefill: target(offset + prefill_index, p.map(|c| c.rank)),
        decode: d.map(|c| target(c.worker, Some(c.rank))),
        prefill_body,
        decode_body,
        prefill_ticket,
        decode_ticket,
    })
}

/// The bootstrap fields plus each rank field whose rank is known; `ranks` is
/// (prefill rank, decode rank).
fn pd_body_fields<'a>(
    bootstrap: &[(&'a str, String)],
    rank_fields: &'a [(String, RankOf)],
    ranks: (Option<u32>, Option<u32>),
) -> Vec<(&'a str, String)> {
    let mut set = bootstrap.to_vec();
    for (name, of) in rank_fields {
        let rank = match of {
            RankOf::Prefill => ranks.0,
            RankOf::Decode => ranks.1,
        };
        if let Some(rank) = rank {
            set.push((name.as_str(), rank.to_string()));
        }
    }
    set
}

/// Gives back a routed request's estimate when its stream ends.
pub fn release(config: &Config, host: &dyn Host, ticket: &Ticket) {
    shared_update(host, &worker_key(config, ticket.worker), |current| {
        let mut state = current.and_then(WorkerState::decode)?;
        state.release(ticket);
        Some((state.encode(), ()))
    });
}

/// What the client gets when the prefill leg ended: None if it succeeded,
/// else the status and JSON error body. A prefill that did not answer at all
/// also takes its worker out of rotation until its next good poll.
pub fn prefill_outcome(
    config: &Config,
    host: &dyn Host,
    worker: usize,
    status: Option<u32>,
    body: &[u8],
) -> Option<(u32, String)> {
    let (endpoint, name) = config
        .worker(worker)
        .map(|w| (w.endpoint(), w.name.clone()))
        .unwrap_or_default();
    if let Some(200..=299) = status {
        host.count(&format!("dprank.prefill_ok.{name}"), 1);
        return None;
    }
    host.count(&format!("dprank.prefill_failed.{name}"), 1);
    // Envoy answers 503 itself when it cannot connect; 502/504 mean the same
    // from a proxy in between. Either way, stop sending there until a poll succeeds.
    if matches!(status, None | Some(502..=504)) {
        mark_unreachable(config, host, worker);
    }
    let detail = String::from_utf8_lossy(body.get(..body.len().min(512)).unwrap_or_default()).into_owned();
    Some(match status {
        // The client's own mistakes (4xx) keep their status.
        Some(code @ 400..=499) => (
            code,
            prefill_error(&format!(
                "prefill worker {endpoint} answered HTTP {code}: {detail}"
            )),
        ),
        Some(code) => (
            502,
            prefill_error(&format!(
                "prefill worker {endpoint} answered HTTP {code}: {detail}"
            )),
        ),
        None => (
            502,
            prefill_error(&format!(
                "prefill worker {endpoint} did not answer (timeout or reset)"
            )),
        ),
    })
}

fn prefill_error(message: &str) -> String {
    error_body("prefill_failed", message)
}

/// The prefill leg could not even be dispatched (Envoy refused the call).
pub fn prefill_not_sent(config: &Config, host: &dyn Host, worker: usize) -> (u32, String) {
    let name = config.worker(worker).map(|w| w.name.clone()).unwrap_or_default();
    host.count(&format!("dprank.prefill_failed.{name}"), 1);
    (
        502,
        prefill_error("the prefill leg could not be dispatched (is the prefill cluster defined?)"),
    )
}

/// A prefill worker that could not be reached gets no more requests until a
/// poll succeeds again.
pub fn mark_unreachable(config: &Config, host: &dyn Host, worker: usize) {
    shared_update(host, &worker_key(config, worker), |current| {
        let mut state = current.and_then(WorkerState::decode)?;
        state.mark_unreachable();
        Some((state.encode(), ()))
    });
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::host::fake::FakeHost;

    fn config(extra: &str) -> Config {
        Config::from_json(
            format!(
                r#"{{"workers":[{{"address":"127.0.0.1:1","name":"a"}},{{"address":"127.0.0.1:2","name":"b"}}]{extra}}}"#
            )
            .as_bytes(),
        )
        .unwrap()
    }

    /// Installs a snapshot for worker `i` as the poller would.
    fn poll(config: &Config, host: &FakeHost, i: usize, tokens: &[u64]) {
        let key = worker_key(config, i);
        let mut s = host
            .shared_get(&key)
            .and_then(|(b, _)| WorkerState::decode(&b))
            .unwrap_or_default();
        let seq = s.begin_poll();
        s.apply_snapshot(
            seq,
            host.now_ms(),
            &tokens.iter().map(|t| Some(*t)).collect::<Vec<_>>(),
        );
        host.shared_set(&key, &s.encode(), None).unwrap();
    }

    fn routed(d: Decision) -> Routed {
        match d {
            Decision::Route(r) => r,
            other => panic!("expected a route, got {other:?}"),
        }
    }

    fn fleet(extra: &str) -> (Config, FakeHost) {
        let c = config(extra);
        let h = FakeHost::default();
        h.now.set(10_000);
        poll(&c, &h, 0, &[100, 50, 100, 100]);
        poll(&c, &h, 1, &[100, 100, 20, 100]);
        (c, h)
    }

    #[test]
    fn routes_to_the_joint_minimum_and_injects_the_rank() {
        let (c, h) = fleet("");
        let r = routed(route(&c, &h, br#"{"text":"hi"}"#, None, 0));
        assert_eq!((r.worker, r.rank, r.endpoint.as_str()), (1, 2, "127.0.0.1:2"));
        assert_eq!(r.body.unwrap(), br#"{"routed_dp_rank":2,"text":"hi"}"#);
        assert_eq!(h.counter("dprank.routed.b.rank_2"), 1);
    }

    #[test]
    fn estimates_spread_a_burst_between_polls() {
        let (c, h) = fleet("");
        let prompt = format!(r#"{{"text":"{}"}}"#, "x".repeat(4 * 40)); // 40 tokens
        let picks: Vec<(usize, u32)> = (0..3)
            .map(|i| {
                let r = routed(route(&c, &h, prompt.as_bytes(), None, i));
                (r.worker, r.rank)
            })
            .collect();
        // 20 -> 60 after the first, so the second goes to the 50-token rank.
        assert_eq!(picks, vec![(1, 2), (0, 1), (1, 2)]);
    }

    #[test]
    fn ended_requests_give_their_estimate_back() {
        let (c, h) = fleet("");
        let r = routed(route(
            &c,
            &h,
            br#"{"text":"a long prompt indeed, long"}"#,
            None,
            0,
        ));
        let states = read_worker_states(&c, &h);
        assert!(states[1].as_ref().unwrap().pending_total() > 0);
        release(&c, &h, &r.ticket.unwrap());
        let states = read_worker_states(&c, &h);
        assert_eq!(states[1].as_ref().unwrap().pending_total(), 0);
    }

    #[test]
    fn accounting_survives_concurrent_writers() {
        let (c, h) = fleet("");
        h.conflicts.set(3);
        let r = routed(route(&c, &h, br#"{"text":"hi"}"#, None, 0));
        assert!(r.ticket.is_some());
        h.conflicts.set(1000);
        let r = routed(route(&c, &h, br#"{"text":"hi"}"#, None, 0));
        assert!(r.ticket.is_none(), "routing goes on without accounting");
        assert_eq!(h.counter("dprank.accounting_skipped"), 1);
    }

    #[test]
    fn client_rank_fields_are_overwritten_by_default() {
        let (c, h) = fleet("");
        let r = routed(route(
            &c,
            &h,
            br#"{"data_parallel_rank":0,"routed_dp_rank":3,"text":"x"}"#,
            None,
            0,
        ));
        assert_eq!(
            r.body.unwrap(),
            br#"{"data_parallel_rank":null,"routed_dp_rank":2,"text":"x"}"#
        );
    }

    #[test]
    fn trusted_client_rank_keeps_the_body_and_picks_the_worker() {
        let (c, h) = fleet(r#","keep_client_rank":true"#);
        let r = routed(route(&c, &h, br#"{"routed_dp_rank":1,"text":"x"}"#, None, 0));
        assert_eq!((r.worker, r.rank, r.body), (0, 1, None));
        // Not an integer: ignored, routed normally.
        let r = routed(route(&c, &h, br#"{"routed_dp_rank":"1","text":"x"}"#, None, 0));
        assert_eq!((r.worker, r.rank), (1, 2));
    }

    #[test]
    fn no_fresh_data_passes_through_and_neutralises_client_ranks() {
        let c = config("");
        let h = FakeHost::default();
        assert_eq!(
            route(&c, &h, br#"{"text":"x"}"#, None, 0),
            Decision::PassThrough {
                reason: PassReason::NoFreshData,
                body: None
            }
        );
        let d = route(&c, &h, br#"{"routed_dp_rank":1,"text":"x"}"#, None, 0);
        assert_eq!(
            d,
            Decision::PassThrough {
                reason: PassReason::NoFreshData,
                body: Some(br#"{"routed_dp_rank":null,"text":"x"}"#.to_vec())
            }
        );
        assert_eq!(h.counter("dprank.passthrough.no_fresh_data"), 2);
    }

    #[test]
    fn stale_data_counts_as_none() {
        let (c, h) = fleet("");
        h.now.set(10_000 + c.stale_after_ms + 1);
        assert!(matches!(
            route(&c, &h, b"{}", None, 0),
            Decision::PassThrough { .. }
        ));
    }

    #[test]
    fn fail_closed_rejects_with_json_errors() {
        let c = config(r#","fail_mode":"closed""#);
        let h = FakeHost::default();
        match route(&c, &h, b"{}", None, 0) {
            Decision::Reject { status, body } => {
                assert_eq!(status, 503);
                let v: serde_json::Value = serde_json::from_str(&body).unwrap();
                assert!(v["error"]["message"].as_str().unwrap().contains("fresh"));
            }
            other => panic!("{other:?}"),
        }
        assert!(matches!(
            route(&c, &h, b"[1]", None, 0),
            Decision::Reject { status: 400, .. }
        ));
        assert_eq!(h.counter("dprank.rejected.not_object"), 1);
    }

    #[test]
    fn bad_bodies_pass_through_in_open_mode() {
        let (c, h) = fleet("");
        for (body, reason) in [
            (&b"nope"[..], PassReason::NotJson),
            (b"[]", PassReason::NotObject),
        ] {
            assert_eq!(
                route(&c, &h, body, None, 0),
                Decision::PassThrough { reason, body: None }
            );
        }
        assert_eq!(h.counter("dprank.passthrough.not_json"), 1);
    }

    #[test]
    fn pin_header_overrides_when_it_names_a_candidate() {
        let (c, h) = fleet(r#","pin_header":"x-dprank-pin""#);
        let r = routed(route(&c, &h, b"{}", Some("a/3"), 0));
        assert_eq!((r.worker, r.rank), (0, 3));
        let r = routed(route(&c, &h, b"{}", Some("a/9"), 0));
        assert_eq!((r.worker, r.rank), (1, 2));
        assert_eq!(h.counter("dprank.pin_ignored"), 1);
    }

    #[test]
    fn legacy_naming_injects_data_parallel_rank() {
        let (c, h) = fleet(r#","naming":"legacy""#);
        let r = routed(route(&c, &h, br#"{"prompt":"x"}"#, None, 0));
        assert_eq!(r.body.unwrap(), br#"{"data_parallel_rank":2,"prompt":"x"}"#);
    }
    fn pd_fleet(extra: &str) -> (Config, FakeHost) {
        let c = Config::from_json(
            format!(
                r#"{{"prefill_workers":[{{"address":"10.0.0.1:30000","name":"p0","bootstrap_port":8998}},{{"address":"10.0.0.2:30000","name":"p1"}}],
                    "decode_workers":[{{"address":"10.0.1.1:30000","name":"d0"}},{{"address":"10.0.1.2:30000","name":"d1"}}]{extra}}}"#
            )
            .as_bytes(),
        )
        .unwrap();
        let h = FakeHost::default();
        h.now.set(10_000);
        poll(&c, &h, 0, &[50, 50]); // d0
        poll(&c, &h, 1, &[50, 5]); // d1: rank 1 lowest
        poll(&c, &h, 2, &[9, 1]); // p0: rank 1 lowest
        poll(&c, &h, 3, &[30, 30]); // p1
        (c, h)
    }

    fn pd(d: Decision) -> PdRouted {
        match d {
            Decision::Pd(pd) => pd,
            other => panic!("expected PD routing, got {other:?}"),
        }
    }

    fn json(bytes: &[u8]) -> serde_json::Value {
        serde_json::from_slice(bytes).unwrap()
    }

    #[test]
    fn pd_picks_both_pools_and_writes_matching_bootstrap_fields() {
        let (c, h) = pd_fleet("");
        let r = pd(route(&c, &h, br#"{"text":"hello","stream":true}"#, None, 0));
        assert_eq!(
            (r.prefill.worker, r.prefill.rank, r.prefill.endpoint.as_str()),
            (2, Some(1), "10.0.0.1:30000")
        );
        let decode = r.decode.unwrap();
        assert_eq!(
            (decode.worker, decode.rank, decode.endpoint.as_str()),
            (1, Some(1), "10.0.1.2:30000")
        );
        let (p, d) = (json(&r.prefill_body), json(&r.decode_body));
        assert_eq!(p["bootstrap_host"], "10.0.0.1");
        assert_eq!(p["bootstrap_port"], 8998);
        assert_eq!(p["bootstrap_room"], d["bootstrap_room"]);
        assert!(p["bootstrap_room"].as_u64().unwrap() <= i64::MAX as u64);
        assert_eq!(
            (p["routed_dp_rank"].as_u64(), p.get("disagg_prefill_dp_rank")),
            (Some(1), None)
        );
        assert_eq!(
            (d["routed_dp_rank"].as_u64(), d["disagg_prefill_dp_rank"].as_u64()),
            (Some(1), Some(1))
        );
        assert_eq!(d["bootstrap_host"], "10.0.0.1");
        assert_eq!(
            (p["text"].as_str(), d["stream"].as_bool()),
            (Some("hello"), Some(true))
        );
        assert!(r.prefill_ticket.is_some() && r.decode_ticket.is_some());
        assert_eq!(
            h.counter("dprank.routed.p0.rank_1") + h.counter("dprank.routed.d1.rank_1"),
            2
        );
    }

    #[test]
    fn pd_legacy_naming_sends_both_ranks_on_both_bodies() {
        let (c, h) = pd_fleet(r#","naming":"legacy""#);
        let r = pd(route(&c, &h, br#"{"text":"hello"}"#, None, 0));
        for body in [&r.prefill_body, &r.decode_body] {
            let v = json(body);
            assert_eq!(
                (v["data_parallel_rank"].as_u64(), v["decode_dp_rank"].as_u64()),
                (Some(1), Some(1))
            );
            assert!(v.get("routed_dp_rank").is_none());
        }
    }

    #[test]
    fn pd_batched_text_gets_one_room_per_prompt() {
        let (c, h) = pd_fleet("");
        let r = pd(route(&c, &h, br#"{"text":["a","b","c"]}"#, None, 0));
        let (p, d) = (json(&r.prefill_body), json(&r.decode_body));
        assert_eq!(
            p["bootstrap_host"],
            serde_json::json!(["10.0.0.1", "10.0.0.1", "10.0.0.1"])
        );
        assert_eq!(p["bootstrap_port"], serde_json::json!([8998, 8998, 8998]));
        let rooms = p["bootstrap_room"].as_array().unwrap();
        assert_eq!(rooms.len(), 3);
        assert_ne!(rooms[0], rooms[1]);
        assert_eq!(p["bootstrap_room"], d["bootstrap_room"]);
    }

    #[test]
    fn pd_without_prefill_data_rotates_and_lets_the_prefill_server_pick_its_rank() {
        let c = Config::from_json(
            br#"{"prefill_workers":[{"address":"10.0.0.1:1"},{"address":"10.0.0.2:1"}],"decode_workers":[{"address":"10.0.1.1:1"}]}"#,
        )
        .unwrap();
        let h = FakeHost::default();
        h.now.set(10_000);
        poll(&c, &h, 0, &[3, 1]);
        let a = pd(route(&c, &h, br#"{"text":"x","routed_dp_rank":5}"#, None, 0));
        let b = pd(route(&c, &h, br#"{"text":"x"}"#, None, 1));
        assert_ne!(a.prefill.worker, b.prefill.worker);
        assert_eq!(a.prefill.rank, None);
        let p = json(&a.prefill_body);
        assert_eq!(
            p["routed_dp_rank"],
            serde_json::Value::Null,
            "client value neutralised"
        );
        assert_eq!(p["bootstrap_port"], serde_json::Value::Null);
        let d = json(&a.decode_body);
        assert_eq!(
            (d["routed_dp_rank"].as_u64(), d.get("disagg_prefill_dp_rank")),
            (Some(1), None)
        );
        assert_eq!(h.counter("dprank.passthrough.no_fresh_data_prefill"), 2);
    }

    #[test]
    fn pd_rejects_bodies_it_cannot_extend() {
        let (c, h) = pd_fleet("");
        assert!(matches!(
            route(&c, &h, b"not json", None, 0),
            Decision::Reject { status: 400, .. }
        ));
        assert!(matches!(
            route(&c, &h, b"[1]", None, 0),
            Decision::Reject { status: 400, .. }
        ));
    }

    #[test]
    fn pd_pin_names_both_sides() {
        let (c, h) = pd_fleet(r#","pin_header":"x-pin""#);
        let r = pd(route(&c, &h, b"{}", Some("p1/0, d0/1"), 0));
        assert_eq!((r.prefill.worker, r.prefill.rank), (3, Some(0)));
        assert_eq!(r.decode.map(|d| (d.worker, d.rank)), Some((0, Some(1))));
    }

    #[test]
    fn prefill_outcomes() {
        let (c, h) = pd_fleet("");
        let fresh = |h: &FakeHost| {
            read_worker_states(&c, h)[2]
                .as_ref()
                .unwrap()
                .is_fresh(10_000, c.stale_after_ms)
        };
        assert_eq!(prefill_outcome(&c, &h, 2, Some(200), b"{}"), None);
        assert_eq!(h.counter("dprank.prefill_ok.p0"), 1);
        let (status, body) = prefill_outcome(&c, &h, 2, Some(500), b"internal").unwrap();
        assert_eq!(status, 502);
        assert!(body.contains("500") && body.contains("internal"));
        assert_eq!(json(body.as_bytes())["error"]["type"], "prefill_failed");
        assert_eq!(prefill_outcome(&c, &h, 2, Some(400), b"too long").unwrap().0, 400);
        assert!(fresh(&h), "an answering worker stays in rotation");
        assert_eq!(prefill_outcome(&c, &h, 2, None, b"").unwrap().0, 502);
        assert!(!fresh(&h));
        poll(&c, &h, 2, &[9, 1]);
        assert!(fresh(&h), "a good poll brings it back");
        let (status, body) = prefill_outcome(&c, &h, 2, Some(503), b"upstream connect error").unwrap();
        assert_eq!(status, 502);
        assert!(body.contains("upstream connect error"));
        assert!(!fresh(&h), "Envoy's own 503 means unreachable");
        // The dead prefill worker gets no more traffic.
        for i in 0..4 {
            assert_eq!(pd(route(&c, &h, b"{}", None, i)).prefill.worker, 3);
        }
        assert_eq!(h.counter("dprank.prefill_failed.p0"), 4);
    }

    #[test]
    fn a_trusted_rank_nobody_has_is_told_apart_from_no_data() {
        let (c, h) = fleet(r#","keep_client_rank":true"#);
        let d = route(&c, &h, br#"{"routed_dp_rank":7}"#, None, 0);
        assert_eq!(
            d,
            Decision::PassThrough {
                reason: PassReason::ClientRankUnavailable,
                body: None
            }
        );
        assert_eq!(h.counter("dprank.passthrough.client_rank_unavailable"), 1);
        let (c, h) = fleet(r#","keep_client_rank":true,"fail_mode":"closed""#);
        assert!(matches!(
            route(&c, &h, br#"{"routed_dp_rank":7}"#, None, 0),
            Decision::Reject { status: 400, .. }
        ));
    }

    #[test]
    fn an_empty_body_passes_through_as_empty() {
        let (c, h) = fleet(r#","fail_mode":"closed""#);
        assert_eq!(
            route(&c, &h, b"", None, 0),
            Decision::PassThrough {
                reason: PassReason::EmptyBody,
                body: None
            }
        );
        assert_eq!(h.counter("dprank.passthrough.empty_body"), 1);
    }

    #[test]
    fn unreadable_bodies_naming_a_rank_are_refused_unless_clients_are_trusted() {
        let (c, h) = fleet("");
        let nan = br#"{"text":"x","routed_dp_rank":3,"temperature":NaN}"#;
        assert!(matches!(
            route(&c, &h, nan, None, 0),
            Decision::Reject { status: 400, .. }
        ));
        assert_eq!(h.counter("dprank.rejected.unreadable_rank"), 1);
        assert!(matches!(
            route(&c, &h, b"text=hi", None, 0),
            Decision::PassThrough {
                reason: PassReason::NotJson,
                ..
            }
        ));
        let (c, h) = fleet(r#","keep_client_rank":true"#);
        assert!(matches!(
            route(&c, &h, nan, None, 0),
            Decision::PassThrough {
                reason: PassReason::NotJson,
                ..
            }
        ));
    }
}
