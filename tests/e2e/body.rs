//! The body a worker receives is the client's, byte for byte, plus the rank
//! field; lengths stay right; responses stream through.

use crate::common::http::{chunked, raw_exchange};
use crate::common::{EnvoyOptions, World};
use serde_json::json;
use std::io::BufRead;
use std::time::{Duration, Instant};

/// Asserts `received` is `client` with `"routed_dp_rank":<rank>` (and one
/// separating comma) added, every other byte unchanged.
fn assert_spliced(client: &[u8], received: &[u8], rank: i64) {
    let field = format!("\"routed_dp_rank\":{rank}");
    let at = received
        .windows(field.len())
        .position(|w| w == field.as_bytes())
        .unwrap_or_else(|| {
            panic!(
                "{field} not in the received body {:?}",
                String::from_utf8_lossy(received)
            )
        });
    let mut rest = received[..at].to_vec();
    rest.extend_from_slice(&received[at + field.len()..]);
    if rest.get(at) == Some(&b',') {
        rest.remove(at);
    } else if at > 0 && rest.get(at - 1) == Some(&b',') {
        rest.remove(at - 1);
    }
    assert!(
        rest == client,
        "received body is not the client's plus {field}:\nclient:   {:?}\nreceived: {:?}",
        String::from_utf8_lossy(client),
        String::from_utf8_lossy(received)
    );
}

/// Bodies with whitespace, unicode, escapes, nesting and an unsorted key order
/// a re-serialising proxy would not keep.
fn odd_bodies() -> Vec<(&'static str, String)> {
    vec![
        (
            "/generate",
            " \n{ \"text\" :\t\"h\u{e9}llo \\\"w\u{f6}rld\\\" \\u00e9 \u{1f680} \\n\\\\ {not: json}\" ,\n  \
             \"sampling_params\":{\"max_new_tokens\":1,  \"temperature\":0.50 , \"stop\":[\"}\",\"{\"]},\
             \"zeta\":{\"z\":[1,2.50,{\"a\":null}],\"a\":true,\"e\":1e3},\"alpha\":\"last\"   }\r\n "
                .to_string(),
        ),
        (
            "/v1/completions",
            "{\"prompt\":\"\u{65e5}\u{672c}\u{8a9e} \\t tab \\ud83d\\ude00\",\"max_tokens\":1,\"stream\":false,\
             \"logit_bias\":{\"50256\":-100},\"b\":[],\"a\":{}}"
                .to_string(),
        ),
        (
            "/v1/chat/completions",
            "{\n  \"model\": \"sim-model\",\n  \"messages\": [\n    {\"role\": \"system\", \"content\": \"Be \\\"brief\\\".\"},\n    \
             {\"role\": \"user\", \"content\": [{\"type\": \"text\", \"text\": \"\u{c9}l\u{e8}ve \u{2014} caf\u{e9}\"}]}\n  ],\n  \
             \"max_tokens\": 1\n}\n"
                .to_string(),
        ),
    ]
}

#[test]
fn bodies_arrive_byte_for_byte_and_responses_stream() {
    // Five times faster than real: the long prompt prefills in ~0.5 s, the stream lasts ~1 s.
    let world = World::start(
        "body_fidelity",
        2,
        &[
            "--time-scale",
            "5",
            // Room for a multi-megabyte prompt, prefilled at once: no step
            // cost for its thousands of chunks, no attention term.
            "--kv-capacity",
            "4000000",
            "--prefill-tokens-per-s",
            "100000000",
            "--prefill-step-ms",
            "0",
            "--prefill-attention-ns",
            "0",
        ],
        &[],
        EnvoyOptions::default(),
    );

    // Content-length bodies, small and large.
    let mut bodies = odd_bodies();
    let long_text = "ab\u{e7}d\u{1f600} \\\" ".repeat(15_000);
    bodies.push((
        "/generate",
        format!("{{\"sampling_params\":{{\"max_new_tokens\":1}},\"text\":\"{long_text}\"}}"),
    ));
    // Past Envoy's default 1 MiB buffer: the shipped limits let it through.
    let huge_text = "0123456789abcdef".repeat(6 << 16);
    bodies.push((
        "/generate",
        format!("{{\"text\":\"{huge_text}\",\"sampling_params\":{{\"max_new_tokens\":1}}}}"),
    ));
    // A query string does not stop routing.
    bodies.push((
        "/v1/completions?trace=1",
        r#"{"prompt":"q","max_tokens":1}"#.to_string(),
    ));
    for (path, body) in &bodies {
        let reply = world.client.post(
            &world.envoy.url(path),
            &[("content-type", "application/json")],
            body.as_bytes(),
        );
        assert_eq!(reply.status, 200, "{path}: {reply:?}");
        let recorded = world.sim_of(&reply).last_request();
        assert_eq!(recorded.path, path.split('?').next().unwrap());
        assert_spliced(body.as_bytes(), &recorded.body, reply.rank());
        assert_eq!(
            recorded.header("content-length"),
            Some(recorded.body.len().to_string().as_str()),
            "{path}: content-length must match the body sent upstream"
        );
    }

    // A chunked body written in pieces (split inside a UTF-8 character too).
    let body = odd_bodies()[0].1.clone().into_bytes();
    let cut = body
        .iter()
        .position(|b| *b == 0xc3)
        .expect("a two-byte character")
        + 1;
    let parts: Vec<&[u8]> = vec![&body[..5], &body[5..cut], &body[cut..cut + 20], &body[cut + 20..]];
    let chunks = chunked(&parts);
    let chunk_refs: Vec<&[u8]> = chunks.iter().map(Vec::as_slice).collect();
    let reply = raw_exchange(
        world.envoy.listener,
        "POST /generate HTTP/1.1\r\nhost: dprank\r\ncontent-type: application/json\r\ntransfer-encoding: chunked",
        &chunk_refs,
        Duration::from_millis(30),
    );
    assert_eq!(reply.status, 200, "chunked body: {reply:?}");
    let recorded = world.sim_of(&reply).last_request();
    assert_spliced(&body, &recorded.body, reply.rank());
    if let Some(length) = recorded.header("content-length") {
        assert_eq!(length, recorded.body.len().to_string(), "chunked body");
    }
    assert_eq!(world.envoy.stat("passthrough.not_json"), 0);

    // A streamed response: 200 decode steps of 4 ms come out as they are made.
    let request = json!({
        "messages": [{"role": "user", "content": "stream please"}],
        "max_tokens": 200,
        "stream": true
    })
    .to_string();
    let sent = Instant::now();
    let (status, events) = world.client.post_streaming(
        &world.envoy.url("/v1/chat/completions"),
        request.as_bytes(),
        |status, reader: &mut dyn BufRead| {
            let mut events: Vec<(Duration, String)> = Vec::new();
            let mut line = String::new();
            while reader.read_line(&mut line).expect("read the stream") > 0 {
                if let Some(data) = line.trim_end().strip_prefix("data: ") {
                    events.push((sent.elapsed(), data.to_string()));
                }
                line.clear();
            }
            (status, events)
        },
    );
    assert_eq!(status, 200);
    let (done_at, last) = events.last().cloned().expect("stream events");
    assert_eq!(last, "[DONE]", "the stream ends with [DONE]");
    assert!(
        events.len() >= 150,
        "{} events, expected one per token",
        events.len()
    );
    let first_at = events[0].0;
    eprintln!(
        "stream: {} events, first after {first_at:?}, [DONE] after {done_at:?}",
        events.len()
    );
    assert!(
        first_at + Duration::from_millis(400) < done_at,
        "the first chunk ({first_at:?}) must arrive well before the end ({done_at:?}): is the response buffered?"
    );
}
