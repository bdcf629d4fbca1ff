//! Bad-input matrix: request bodies and clients of every odd kind, each with
//! its documented behaviour, run in fail_mode open and closed. A case is one
//! of:
//!
//! - **routed**: the worker receives exactly the client's bytes with the rank
//!   field added after the opening brace (or, where the client sent rank
//!   fields, exactly those values replaced: the current name by the rank,
//!   the legacy alias by `null`); `routed.<worker>.rank_<r>` counts it;
//! - **untouched**: the worker receives exactly the client's bytes;
//!   `passthrough.<reason>` counts it. In closed mode a body that is not a
//!   JSON object is refused instead: 400 with a JSON error from the filter,
//!   `rejected.<reason>`, and no worker sees it;
//! - **refused**: a body dprank cannot read that names a rank field (a
//!   lenient server parser, such as Python's `json`, could honour it): 400
//!   with a JSON error in every mode, `rejected.unreadable_rank`;
//! - **refused by Envoy**: the filter never sees it.
//!
//! The client's status is the worker's own answer to what it received (the
//! simulator refuses what SGLang would: not JSON, a `text` that is a number).
//! The gzip body and the listener's 413 are in `input.rs`.

use crate::common::http::{chunked, raw_exchange};
use crate::common::raw::{expect_continue_exchange, h2_exchange};
use crate::common::{EnvoyOptions, Reply, World};
use std::collections::HashMap;
use std::time::Duration;

/// How the request is sent.
enum Send {
    /// HTTP/1.1 through ureq (content-length), with these headers.
    Post(Vec<(&'static str, &'static str)>),
    /// Raw HTTP/1.x: a head (request line and headers) and the wire bytes
    /// after it, written with a short pause between parts.
    Raw(String, Vec<Vec<u8>>),
    /// curl-style `expect: 100-continue`.
    ExpectContinue,
    /// HTTP/2 with prior knowledge: DATA frames, trailers, with or without a
    /// content-length header.
    H2 {
        parts: usize,
        content_length: bool,
        trailers: bool,
    },
}

/// What must happen, in open mode.
#[derive(Clone, Copy)]
enum Expect {
    /// Routed; the worker receives the body with `"routed_dp_rank":<r>` spliced in.
    Spliced,
    /// Routed; the worker receives this text with every `{R}` replaced by the rank.
    Exact(&'static str),
    /// Untouched; the passthrough reason.
    Untouched(&'static str),
    /// Refused by the filter in every mode: 400 with a JSON error; the reason.
    Refused(&'static str),
    /// Envoy answers this status itself; nothing reaches the filter's counters or a worker.
    Envoy(u16),
}

struct Case {
    name: &'static str,
    path: &'static str,
    send: Send,
    body: Vec<u8>,
    expect: Expect,
    /// The client's status in open mode (the worker's answer).
    status: u16,
}

fn case(name: &'static str, body: impl Into<Vec<u8>>, expect: Expect, status: u16) -> Case {
    Case {
        name,
        path: "/generate",
        send: Send::Post(vec![("content-type", "application/json")]),
        body: body.into(),
        expect,
        status,
    }
}

fn sent_as(mut c: Case, send: Send) -> Case {
    c.send = send;
    c
}

const CHUNKED_HEAD: &str =
    "POST /generate HTTP/1.1\r\nhost: dprank\r\ncontent-type: application/json\r\ntransfer-encoding: chunked";

const OK: &str = r#"{"text":"ok","sampling_params":{"max_new_tokens":1}}"#;

/// An object whose `key` holds arrays nested `depth` deep (plus a prompt).
fn nested(key: &str, depth: usize) -> String {
    let prompt = if key == "text" { "" } else { r#""text":"deep","# };
    format!(
        r#"{{{prompt}"sampling_params":{{"max_new_tokens":1}},"{key}":{}"deep"{}}}"#,
        "[".repeat(depth),
        "]".repeat(depth)
    )
}

fn cases() -> Vec<Case> {
    use Expect::*;
    let many_keys = {
        let keys: Vec<String> = (0..5000).map(|i| format!("\"k{i}\":{i}")).collect();
        format!(
            r#"{{"text":"many","sampling_params":{{"max_new_tokens":1}},{}}}"#,
            keys.join(",")
        )
    };
    let mut bom = b"\xef\xbb\xbf".to_vec();
    bom.extend_from_slice(OK.as_bytes());
    let mut bom_rank = b"\xef\xbb\xbf".to_vec();
    bom_rank.extend_from_slice(br#"{"text":"x","routed_dp_rank":3}"#);
    let mut utf16_rank = vec![0xff, 0xfe];
    utf16_rank.extend(r#"{"text":"x","routed_dp_rank":3}"#.encode_utf16().flat_map(u16::to_le_bytes));
    let chunked_body =
        br#"{"text":"caf\u00e9 odd splits","routed_dp_rank":2,"sampling_params":{"max_new_tokens":1}}"#;
    let cut_in_key = chunked_body.windows(6).position(|w| w == b"dp_ran").unwrap() + 3;
    let cut_in_escape = chunked_body.windows(2).position(|w| w == b"\\u").unwrap() + 3;
    let odd_splits = chunked(&[
        &chunked_body[..1],
        &chunked_body[1..cut_in_escape],
        &chunked_body[cut_in_escape..cut_in_key],
        &chunked_body[cut_in_key..],
    ]);
    let bytewise: Vec<Vec<u8>> = chunked(&OK.as_bytes().chunks(1).collect::<Vec<_>>());
    let mut with_trailers = chunked(&[&OK.as_bytes()[..9], &OK.as_bytes()[9..]]);
    with_trailers.pop();
    with_trailers.push(b"0\r\nx-checksum: 1234\r\n\r\n".to_vec());

    vec![
        // Not JSON, or not an object.
        case("not JSON (form data)", "text=hello&n=1", Untouched("not_json"), 400),
        case("JSON array", r#"[{"text":"a","routed_dp_rank":3}]"#, Untouched("not_object"), 400),
        case("JSON string", r#""just a string""#, Untouched("not_object"), 400),
        case("JSON number", "42", Untouched("not_object"), 400),
        case("JSON null", "null", Untouched("not_object"), 400),
        case("whitespace only", " \n\t ", Untouched("not_json"), 400),
        case("invalid UTF-8 in a string", b"{\"text\":\"caf\xe9\"}".to_vec(), Untouched("not_json"), 400),
        case("UTF-8 BOM before the object", bom, Untouched("not_json"), 400),
        case("valid JSON then garbage", format!("{OK} garbage"), Untouched("not_json"), 400),
        case("two objects", format!("{OK}{OK}"), Untouched("not_json"), 400),
        case("trailing comma", r#"{"text":"x",}"#, Untouched("not_json"), 400),
        case("NaN literal", r#"{"text":"x","temperature":NaN}"#, Untouched("not_json"), 400),
        case("comment", r#"{/* c */"text":"x"}"#, Untouched("not_json"), 400),
        // Unreadable to dprank but naming a rank (Python's json reads all of these): refused.
        case("NaN, naming the rank", r#"{"text":"x","routed_dp_rank":3,"temperature":NaN}"#, Refused("unreadable_rank"), 400),
        case("UTF-8 BOM, naming the rank", bom_rank, Refused("unreadable_rank"), 400),
        case("UTF-16, naming the rank", utf16_rank, Refused("unreadable_rank"), 400),
        case("Infinity, alias escaped", r#"{"text":"x","data_parallel_\u0072ank":3,"top_p":Infinity}"#, Refused("unreadable_rank"), 400),
        case("not JSON, \"rank\" in the prompt", "text=frank+talk", Untouched("not_json"), 400),
        case("not JSON, a rank field's name in a form", "text=x&routed_dp_rank=1", Untouched("not_json"), 400),
        // Objects, however odd: routed. (The worker refuses what its own JSON
        // parser does: nesting beyond 128, lone surrogates, numbers beyond f64.)
        case("nesting 100 deep", nested("extra", 100), Spliced, 200),
        case("nesting 200 deep (serde_json's limit: 128)", nested("extra", 200), Spliced, 400),
        case("nesting 200 deep in the prompt", nested("text", 200), Spliced, 400),
        case("nesting 100000 deep", nested("extra", 100_000), Spliced, 400),
        case("nesting 100000 deep in the prompt", nested("messages", 100_000), Spliced, 400),
        case("lone surrogate in the prompt", r#"{"text":"\ud800"}"#, Spliced, 400),
        case("empty object", "{}", Exact(r#"{"routed_dp_rank":{R}}"#), 400),
        case("whitespace around the object", format!(" \r\n\t{OK} \n"), Spliced, 200),
        case("batched text", r#"{"text":["one","two","three"],"sampling_params":{"max_new_tokens":1}}"#, Spliced, 200),
        case("batched input_ids", r#"{"input_ids":[[1,2,3],[4,5]],"sampling_params":{"max_new_tokens":1}}"#, Spliced, 200),
        case("text is a number", r#"{"text":42}"#, Spliced, 400),
        case("duplicate keys", r#"{"text":"first","text":"second","sampling_params":{"max_new_tokens":1}}"#, Spliced, 200),
        case("unicode keys and values", "{\"t\u{eb}xt\":\"\u{fc}\",\"\u{d14d}\u{c2a4}\u{d2b8}\":\"\u{5024}\",\"text\":\"hi \u{1f680}\",\"sampling_params\":{\"max_new_tokens\":1}}", Spliced, 200),
        case("lone surrogate elsewhere", r#"{"text":"x","note":"\ud800","sampling_params":{"max_new_tokens":1}}"#, Spliced, 400),
        case("huge integer elsewhere", r#"{"text":"x","seed":123456789012345678901234567890,"sampling_params":{"max_new_tokens":1}}"#, Spliced, 200),
        case("1e400 elsewhere", r#"{"text":"x","seed":1e400,"sampling_params":{"max_new_tokens":1}}"#, Spliced, 400),
        case("1e400 in input_ids", r#"{"input_ids":[1e400],"sampling_params":{"max_new_tokens":1}}"#, Spliced, 400),
        case("5000 keys", many_keys, Spliced, 200),
        case("rank field nested, not top level", r#"{"text":"x","meta":{"routed_dp_rank":3},"sampling_params":{"max_new_tokens":1}}"#, Spliced, 200),
        // Client rank fields: overwritten in place, whatever their type.
        case("duplicate rank fields", r#"{"routed_dp_rank":3,"text":"x","routed_dp_rank":0}"#, Exact(r#"{"routed_dp_rank":{R},"text":"x","routed_dp_rank":{R}}"#), 200),
        case("rank as string", r#"{"text":"x","routed_dp_rank":"3"}"#, Exact(r#"{"text":"x","routed_dp_rank":{R}}"#), 200),
        case("rank as float", r#"{"text":"x","routed_dp_rank":3.0}"#, Exact(r#"{"text":"x","routed_dp_rank":{R}}"#), 200),
        case("rank negative", r#"{"text":"x","routed_dp_rank":-1}"#, Exact(r#"{"text":"x","routed_dp_rank":{R}}"#), 200),
        case("rank beyond u64", r#"{"text":"x","routed_dp_rank":18446744073709551616}"#, Exact(r#"{"text":"x","routed_dp_rank":{R}}"#), 200),
        case("rank null", r#"{"text":"x","routed_dp_rank":null}"#, Exact(r#"{"text":"x","routed_dp_rank":{R}}"#), 200),
        case("rank object", r#"{"text":"x","routed_dp_rank":{"rank":3}}"#, Exact(r#"{"text":"x","routed_dp_rank":{R}}"#), 200),
        case("rank array", r#"{"text":"x","routed_dp_rank":[3]}"#, Exact(r#"{"text":"x","routed_dp_rank":{R}}"#), 200),
        case("rank bool", r#"{"text":"x","routed_dp_rank":true}"#, Exact(r#"{"text":"x","routed_dp_rank":{R}}"#), 200),
        case("legacy alias only", r#"{"text":"x","data_parallel_rank":3}"#, Exact(r#"{"routed_dp_rank":{R},"text":"x","data_parallel_rank":null}"#), 200),
        case("escaped rank key", r#"{"routed\u005fdp_rank":3,"text":"x"}"#, Exact(r#"{"routed\u005fdp_rank":{R},"text":"x"}"#), 200),
        case("escaped alias key", r#"{"text":"x","data\u005fparallel_rank":3}"#, Exact(r#"{"routed_dp_rank":{R},"text":"x","data\u005fparallel_rank":null}"#), 200),
        case("look-alike rank key (Cyrillic e)", "{\"text\":\"x\",\"rout\u{435}d_dp_rank\":3}", Spliced, 200),
        // Headers.
        sent_as(case("content-type text/plain", OK, Spliced, 200), Send::Post(vec![("content-type", "text/plain")])),
        sent_as(case("no content-type", OK, Spliced, 200), Send::Post(vec![])),
        sent_as(case("content-encoding identity", OK, Spliced, 200), Send::Post(vec![("content-type", "application/json"), ("content-encoding", "identity")])),
        sent_as(case("content-encoding GZIP (upper case)", OK, Untouched("content_encoding"), 200), Send::Post(vec![("content-type", "application/json"), ("content-encoding", "GZIP")])),
        sent_as(case("content-encoding br", OK, Untouched("content_encoding"), 200), Send::Post(vec![("content-type", "application/json"), ("content-encoding", "br")])),
        // Clients and framings.
        sent_as(case("expect: 100-continue", OK, Spliced, 200), Send::ExpectContinue),
        sent_as(case("HTTP/2 prior knowledge, content-length", OK, Spliced, 200), Send::H2 { parts: 1, content_length: true, trailers: false }),
        sent_as(case("HTTP/2, 3 DATA frames, no length", OK, Spliced, 200), Send::H2 { parts: 3, content_length: false, trailers: false }),
        sent_as(case("HTTP/2 body ending with trailers", OK, Spliced, 200), Send::H2 { parts: 2, content_length: false, trailers: true }),
        sent_as(
            case("HTTP/1.0 with content-length", OK, Envoy(426), 426),
            Send::Raw(
                format!("POST /generate HTTP/1.0\r\nhost: dprank\r\ncontent-type: application/json\r\ncontent-length: {}", OK.len()),
                vec![OK.as_bytes().to_vec()],
            ),
        ),
        sent_as(
            case("chunked, one byte per chunk", OK, Spliced, 200),
            Send::Raw(CHUNKED_HEAD.to_string(), bytewise),
        ),
        sent_as(
            case("chunked, cut in a key and an escape", chunked_body.to_vec(), Exact(r#"{"text":"caf\u00e9 odd splits","routed_dp_rank":{R},"sampling_params":{"max_new_tokens":1}}"#), 200),
            Send::Raw(CHUNKED_HEAD.to_string(), odd_splits),
        ),
        sent_as(
            case("chunked, ending with trailers", OK, Spliced, 200),
            Send::Raw(CHUNKED_HEAD.to_string(), with_trailers),
        ),
        sent_as(
            case("empty body, content-length: 0", "", Untouched("empty_body"), 400),
            Send::Post(vec![("content-type", "application/json")]),
        ),
        sent_as(
            case("empty body, chunked", "", Untouched("empty_body"), 400),
            Send::Raw(CHUNKED_HEAD.to_string(), vec![b"0\r\n\r\n".to_vec()]),
        ),
        sent_as(
            case("empty body, HTTP/2 empty DATA frame", "", Untouched("empty_body"), 400),
            Send::H2 { parts: 1, content_length: false, trailers: false },
        ),
        // Last: the recordings then hold 8 MB.
        case(
            "8 MB prompt",
            format!(r#"{{"text":"{}","sampling_params":{{"max_new_tokens":1}}}}"#, "0123456789abcdef".repeat(1 << 19)),
            Spliced,
            200,
        ),
    ]
}

/// `body` with `"routed_dp_rank":<rank>` after its first `{` (and a comma
/// unless the object is empty).
fn spliced(body: &[u8], rank: u64) -> Vec<u8> {
    let open = body.iter().position(|b| *b == b'{').expect("an object") + 1;
    let empty = body[open..].iter().find(|b| !b.is_ascii_whitespace()) == Some(&b'}');
    let mut out = body[..open].to_vec();
    out.extend_from_slice(format!("\"routed_dp_rank\":{rank}").as_bytes());
    if !empty {
        out.push(b',');
    }
    out.extend_from_slice(&body[open..]);
    out
}

fn send(world: &World, c: &Case) -> Reply {
    let addr = world.envoy.listener;
    match &c.send {
        Send::Post(headers) => world.client.post(&world.envoy.url(c.path), headers, &c.body),
        Send::Raw(head, parts) => {
            let parts: Vec<&[u8]> = parts.iter().map(Vec::as_slice).collect();
            raw_exchange(addr, head, &parts, Duration::from_millis(5))
        }
        Send::ExpectContinue => {
            let head = format!(
                "POST {} HTTP/1.1\r\nhost: dprank\r\ncontent-type: application/json",
                c.path
            );
            let (interim, reply) = expect_continue_exchange(addr, &head, &c.body);
            assert!(interim, "{}: Envoy answers 100 Continue", c.name);
            reply
        }
        Send::H2 {
            parts,
            content_length,
            trailers,
        } => {
            let length = c.body.len().to_string();
            let mut headers = vec![("content-type", "application/json")];
            if *content_length {
                headers.push(("content-length", length.as_str()));
            }
            let size = c.body.len().div_ceil(*parts).max(1);
            let mut pieces: Vec<&[u8]> = c.body.chunks(size).collect();
            if pieces.is_empty() {
                // One empty DATA frame that ends the stream.
                pieces.push(b"");
            }
            let trailer_list: &[(&str, &str)] = if *trailers { &[("x-checksum", "1234")] } else { &[] };
            h2_exchange(addr, "POST", c.path, &headers, &pieces, trailer_list)
        }
    }
}

/// The filter's per-request counters (routing decisions), without polls and gauges.
fn decisions(world: &World) -> HashMap<String, u64> {
    world
        .envoy
        .stats()
        .into_iter()
        .filter(|(k, _)| {
            [
                "routed.",
                "passthrough.",
                "rejected.",
                "pin_ignored",
                "accounting_skipped",
            ]
            .iter()
            .any(|p| k.starts_with(p))
        })
        .collect()
}

/// Counters that changed, with their increase.
fn changed(before: &HashMap<String, u64>, after: &HashMap<String, u64>) -> Vec<(String, u64)> {
    let mut out: Vec<(String, u64)> = after
        .iter()
        .filter_map(|(k, v)| {
            let d = v - before.get(k).copied().unwrap_or(0);
            (d > 0).then(|| (k.clone(), d))
        })
        .collect();
    out.sort();
    out
}

fn reset(world: &World) {
    for sim in &world.sims {
        let reply = world.client.post(&sim.url("/_sim/reset"), &[], b"");
        assert_eq!(reply.status, 200, "{}: reset", sim.name);
    }
}

fn run_matrix(scenario: &str, closed: bool) {
    let world = World::start(
        scenario,
        2,
        &["--instant", "--kv-capacity", "4000000"],
        &World::base_tokens(&[&[5000, 1000, 5000, 7000], &[6000, 6000, 6000, 2000]]),
        EnvoyOptions::default(),
    );
    let cases = cases();
    let mode = if closed { "closed" } else { "open" };
    // Every case runs; the failures are reported together at the end.
    let mut failures = Vec::new();
    for c in &cases {
        let what = format!("[{mode}] {}", c.name);
        let result =
            std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| check(&world, c, closed, &what)));
        match result {
            Ok(outcome) => eprintln!("input matrix | {what:<52} | {outcome}"),
            Err(e) => failures.push(
                e.downcast_ref::<String>()
                    .cloned()
                    .or_else(|| e.downcast_ref::<&str>().map(|s| s.to_string()))
                    .unwrap_or_else(|| what.clone()),
            ),
        }
    }
    assert!(
        failures.is_empty(),
        "{} case(s) failed:\n{}",
        failures.len(),
        failures.join("\n\n")
    );
}

/// Sends one case and checks it; returns the outcome for the printed table.
fn check(world: &World, c: &Case, closed: bool, what: &str) -> String {
    {
        reset(world);
        let before = decisions(world);
        let reply = send(world, c);
        let delta = changed(&before, &decisions(world));
        let received: Vec<(String, Vec<u8>, Option<u64>)> = world
            .sims
            .iter()
            .flat_map(|s| {
                s.requests()
                    .into_iter()
                    .map(|r| (s.name.clone(), r.body, r.status))
            })
            .collect();
        let rejectable = matches!(c.expect, Expect::Untouched("not_json" | "not_object"));
        let refused = |reason: &str| {
            assert_eq!(reply.status, 400, "{what}: {reply:?}");
            assert_eq!(reply.header("content-type"), Some("application/json"), "{what}");
            assert!(reply.json()["error"]["message"].is_string(), "{what}: {reply:?}");
            assert!(
                reply.header("x-sim-worker").is_none(),
                "{what}: answered by the filter"
            );
            assert!(received.is_empty(), "{what}: no worker sees it: {received:?}");
            assert_eq!(delta, vec![(format!("rejected.{reason}"), 1)], "{what}");
            format!("400 JSON error, rejected.{reason}")
        };
        let outcome = match c.expect {
            Expect::Refused(reason) => refused(reason),
            Expect::Untouched(reason) if closed && rejectable => refused(reason),
            Expect::Untouched(reason) => {
                assert_eq!(reply.status, c.status, "{what}: {reply:?}");
                assert_eq!(received.len(), 1, "{what}: one worker request: {received:?}");
                let (worker, body, status) = &received[0];
                assert_eq!(
                    reply.header("x-sim-worker"),
                    Some(world.sim(worker).addr.to_string().as_str())
                );
                assert_eq!(*status, Some(u64::from(reply.status)), "{what}");
                assert!(
                    *body == c.body,
                    "{what}: the worker must receive the client's bytes:\nsent     {:?}\nreceived {:?}",
                    String::from_utf8_lossy(&c.body[..c.body.len().min(300)]),
                    String::from_utf8_lossy(&body[..body.len().min(300)])
                );
                assert_eq!(delta, vec![(format!("passthrough.{reason}"), 1)], "{what}");
                format!(
                    "untouched, passthrough.{reason}, worker answered {}",
                    reply.status
                )
            }
            Expect::Envoy(status) => {
                assert_eq!(reply.status, status, "{what}: {reply:?}");
                assert!(received.is_empty(), "{what}: {received:?}");
                assert!(delta.is_empty(), "{what}: {delta:?}");
                format!("Envoy answered {status}")
            }
            Expect::Spliced | Expect::Exact(_) => {
                assert_eq!(reply.status, c.status, "{what}: {reply:?}");
                assert_eq!(delta.len(), 1, "{what}: one routing decision: {delta:?}");
                let (key, _) = &delta[0];
                let (worker, rank) = key
                    .strip_prefix("routed.")
                    .and_then(|k| k.split_once(".rank_"))
                    .unwrap_or_else(|| panic!("{what}: not routed: {delta:?}"));
                let rank: u64 = rank.parse().unwrap();
                assert_eq!(received.len(), 1, "{what}: one worker request: {received:?}");
                let (got_worker, body, status) = &received[0];
                assert_eq!(got_worker, worker, "{what}: served where routed");
                assert_eq!(*status, Some(u64::from(reply.status)), "{what}");
                if reply.status == 200 {
                    assert_eq!(reply.rank(), rank as i64, "{what}: served on the routed rank");
                }
                let expected = match c.expect {
                    Expect::Exact(template) => template.replace("{R}", &rank.to_string()).into_bytes(),
                    _ => spliced(&c.body, rank),
                };
                assert!(
                    *body == expected,
                    "{what}: the worker must receive exactly the client's bytes plus the rank:\nexpected {:?}\nreceived {:?}",
                    String::from_utf8_lossy(&expected[..expected.len().min(300)]),
                    String::from_utf8_lossy(&body[..body.len().min(300)])
                );
                format!("routed to {worker} rank {rank}, worker answered {}", reply.status)
            }
        };
        outcome
    }
}

#[test]
fn input_matrix_fail_open() {
    assert!(cases().len() >= 30);
    run_matrix("input_matrix", false);
}

#[test]
fn input_matrix_fail_closed() {
    run_matrix("input_matrix_closed", true);
}
