//! Per-request routing: body in, decision out. Knows nothing of proxy-wasm;
//! the HTTP context applies the decision.

use crate::body::JsonObject;
use crate::config::{Config, FailMode};
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
    Reject {
        status: u32,
        body: String,
    },
}

pub fn worker_key(config: &Config, worker: usize) -> String {
    let endpoint = config
        .workers
        .get(worker)
        .map(|w| w.endpoint())
        .unwrap_or_default();
    format!("{}.w.{}", config.state_key, endpoint)
}

pub fn read_worker_states(config: &Config, host: &dyn Host) -> Vec<Option<WorkerState>> {
    (0..config.workers.len())
        .map(|i| {
            host.shared_get(&worker_key(config, i))
                .and_then(|(bytes, _)| WorkerState::decode(&bytes))
        })
        .collect()
}

fn error_body(kind: &str, message: &str) -> String {
    serde_json::json!({"error": {"message": message, "type": kind, "code": "dprank"}}).to_string()
}

/// Counts a pass-through and, in closed mode, turns routing failures into errors.
fn pass_or_reject(
    config: &Config,
    host: &dyn Host,
    reason: PassReason,
    body: Option<Vec<u8>>,
) -> Decision {
    match (config.fail_mode, reason) {
        (FailMode::Closed, PassReason::NotJson | PassReason::NotObject) => {
            host.count(&format!("dprank.rejected.{}", reason.as_str()), 1);
            Decision::Reject {
                status: 400,
                body: error_body(
                    "invalid_request_error",
                    "request body must be a JSON object (dprank routes by its fields)",
                ),
            }
        }
        (FailMode::Closed, PassReason::NoFreshData) => {
            host.count(&format!("dprank.rejected.{}", reason.as_str()), 1);
            Decision::Reject {
                status: 503,
                body: error_body("service_unavailable", "no worker has fresh load data"),
            }
        }
        _ => {
            host.count(&format!("dprank.passthrough.{}", reason.as_str()), 1);
            Decision::PassThrough { reason, body }
        }
    }
}

/// Counts a request that is not routed for a reason seen before its body.
pub fn pass_early(host: &dyn Host, reason: PassReason) {
    host.count(&format!("dprank.passthrough.{}", reason.as_str()), 1);
}

/// The rank a trusted client asked for, if it asked with a valid integer.
fn client_rank(config: &Config, body: &JsonObject) -> Option<u32> {
    config.rank_field_names().into_iter().find_map(|name| {
        let raw = body.raw_value(name)?;
        std::str::from_utf8(raw).ok()?.parse::<u32>().ok()
    })
}

/// Decides where a request with this body goes. `pin` is the test-only pin
/// header (already None unless the config enables it). `tie_breaker` varies
/// per request so equal loads spread.
pub fn route(
    config: &Config,
    host: &dyn Host,
    body: &[u8],
    pin: Option<&str>,
    tie_breaker: u64,
) -> Decision {
    let object = match JsonObject::parse(body) {
        Ok(o) => o,
        Err(e) => {
            let reason = match e {
                crate::body::BodyError::NotJson => PassReason::NotJson,
                crate::body::BodyError::NotObject => PassReason::NotObject,
            };
            return pass_or_reject(config, host, reason, None);
        }
    };
    let rank_names = config.rank_field_names();
    let trusted_rank = if config.keep_client_rank {
        client_rank(config, &object)
    } else {
        None
    };

    let states = read_worker_states(config, host);
    let mut candidates = scheduler::fresh_candidates(
        &config.workers,
        &states,
        host.now_ms(),
        config.stale_after_ms,
    );
    if let Some(rank) = trusted_rank {
        candidates = scheduler::only_rank(candidates, rank);
    }
    let pinned = pin.and_then(|p| {
        let hit = scheduler::pinned(&candidates, &config.workers, p);
        if hit.is_none() {
            host.count("dprank.pin_ignored", 1);
        }
        hit
    });
    let Some(Candidate { worker, rank, .. }) =
        pinned.or_else(|| scheduler::least_loaded(&candidates, tie_breaker))
    else {
        // Untrusted client rank fields are neutralised (null = let the server decide).
        let neutralised = (trusted_rank.is_none() && object.has_any(&rank_names)).then(|| {
            let nulls: Vec<(&str, &str)> = rank_names.iter().map(|n| (*n, "null")).collect();
            object.with_fields(&nulls_present(&object, &nulls))
        });
        return pass_or_reject(config, host, PassReason::NoFreshData, neutralised);
    };

    let cost = object.prompt.estimate(config.cost_estimate);
    let ticket = shared_update(host, &worker_key(config, worker), |current| {
        let mut state = current.and_then(WorkerState::decode)?;
        let ticket = state.add(worker, rank, cost)?;
        Some((state.encode(), ticket))
    });
    if ticket.is_none() {
        host.count("dprank.accounting_skipped", 1);
    }

    let body = if trusted_rank.is_some() {
        None
    } else {
        let rank_text = rank.to_string();
        let mut set: Vec<(&str, &str)> = vec![(config.rank_field.as_str(), rank_text.as_str())];
        // Aliases the client sent get the same value, so no client value survives.
        set.extend(nulls_present(
            &object,
            &rank_names
                .iter()
                .skip(1)
                .map(|n| (*n, rank_text.as_str()))
                .collect::<Vec<_>>(),
        ));
        Some(object.with_fields(&set))
    };

    let name = config
        .workers
        .get(worker)
        .map(|w| w.name.as_str())
        .unwrap_or("unknown");
    host.count(&format!("dprank.routed.{name}.rank_{rank}"), 1);
    Decision::Route(Routed {
        worker,
        rank,
        endpoint: config
            .workers
            .get(worker)
            .map(|w| w.endpoint())
            .unwrap_or_default(),
        body,
        ticket,
    })
}

/// The subset of `fields` whose keys the body already has.
fn nulls_present<'a>(
    object: &JsonObject,
    fields: &[(&'a str, &'a str)],
) -> Vec<(&'a str, &'a str)> {
    fields
        .iter()
        .filter(|(k, _)| object.has_any(&[k]))
        .copied()
        .collect()
}

/// Gives back a routed request's estimate when its stream ends.
pub fn release(config: &Config, host: &dyn Host, ticket: &Ticket) {
    shared_update(host, &worker_key(config, ticket.worker), |current| {
        let mut state = current.and_then(WorkerState::decode)?;
        state.release(ticket);
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
        assert_eq!(
            (r.worker, r.rank, r.endpoint.as_str()),
            (1, 2, "127.0.0.1:2")
        );
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
            br#"{"data_parallel_rank":2,"routed_dp_rank":2,"text":"x"}"#
        );
    }

    #[test]
    fn trusted_client_rank_keeps_the_body_and_picks_the_worker() {
        let (c, h) = fleet(r#","keep_client_rank":true"#);
        let r = routed(route(
            &c,
            &h,
            br#"{"routed_dp_rank":1,"text":"x"}"#,
            None,
            0,
        ));
        assert_eq!((r.worker, r.rank, r.body), (0, 1, None));
        // Not an integer: ignored, routed normally.
        let r = routed(route(
            &c,
            &h,
            br#"{"routed_dp_rank":"1","text":"x"}"#,
            None,
            0,
        ));
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
}
