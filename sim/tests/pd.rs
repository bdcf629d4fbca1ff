//! Prefill/decode roles: the decode worker waits for the prefill's room.

mod common;

use std::time::{Duration, Instant};

use common::*;
use dprank_sim::{Role, SimConfig};
use reqwest::StatusCode;
use serde_json::json;

fn pd_body(port: u16, room: u64, rank_field: &str, rank: usize) -> String {
    let mut body = json!({
        "text": text_of(100), "sampling_params": {"max_new_tokens": 4},
        "bootstrap_host": "127.0.0.1", "bootstrap_port": port, "bootstrap_room": room,
    });
    body[rank_field] = json!(rank);
    body.to_string()
}

#[tokio::test]
async fn decode_waits_for_the_prefill_room() {
    let prefill = start_with_bootstrap(SimConfig {
        role: Role::Prefill,
        ..fast_config()
    })
    .await;
    let decode = start(SimConfig {
        role: Role::Decode,
        ..fast_config()
    })
    .await;
    let bootstrap_port = prefill.bootstrap_addr.unwrap().port();
    let room = 9_223_372_036_854_775_807u64;
    assert_eq!(
        get(&prefill, &format!("/_sim/kv/{room}")).await.status,
        StatusCode::NOT_FOUND
    );

    let mut decode_body: serde_json::Value =
        serde_json::from_str(&pd_body(bootstrap_port, room, "routed_dp_rank", 3)).unwrap();
    decode_body["disagg_prefill_dp_rank"] = json!(1);
    decode_body["stream"] = json!(true);
    let decode_url = format!("{}/generate", decode.url());
    let started = Instant::now();
    let decode_request = tokio::spawn(async move {
        let response = client()
            .post(decode_url)
            .body(decode_body.to_string())
            .send()
            .await
            .unwrap();
        let status = response.status();
        let rank = response.headers()["x-sim-dp-rank"].to_str().unwrap().to_string();
        (status, rank, started.elapsed(), response.text().await.unwrap())
    });
    // The decode rank holds the request's KV while it waits.
    let loads = wait_for(Duration::from_secs(5), || async {
        let loads = get_json(&decode, "/v1/loads").await;
        (loads["loads"][3]["num_waiting_reqs"] == 1).then_some(loads)
    })
    .await;
    assert_eq!(loads["loads"][3]["num_used_tokens"], 100);
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert!(!decode_request.is_finished());

    let prefill_reply = post(
        &prefill,
        "/generate",
        &pd_body(bootstrap_port, room, "routed_dp_rank", 1),
    )
    .await;
    assert_eq!(prefill_reply.status, StatusCode::OK, "{}", prefill_reply.text);
    assert_eq!(prefill_reply.rank(), 1);
    assert_eq!(prefill_reply.json()["meta_info"]["completion_tokens"], 1);
    // The room is served on the main port and on the bootstrap port.
    let ready = get_json(&prefill, &format!("/_sim/kv/{room}")).await;
    assert_eq!(ready, json!({"ready": true, "dp_rank": 1}));
    let on_bootstrap: serde_json::Value = client()
        .get(format!(
            "http://{}/_sim/kv/{room}",
            prefill.bootstrap_addr.unwrap()
        ))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .map(|text| serde_json::from_str(&text).unwrap())
        .unwrap();
    assert_eq!(on_bootstrap["ready"], true);

    let (status, rank, elapsed, text) = decode_request.await.unwrap();
    assert_eq!(status, StatusCode::OK);
    assert_eq!(rank, "3");
    assert!(elapsed >= Duration::from_millis(200));
    assert!(text.ends_with("data: [DONE]\n\n"), "{text}");
    assert!(text.contains(r#""completion_tokens":4"#), "{text}");
    let records = get_json(&decode, "/_sim/requests").await;
    assert!(records[0]["body"]
        .as_str()
        .unwrap()
        .contains(r#""disagg_prefill_dp_rank":1"#));
    assert_eq!(get_json(&decode, "/get_load").await[3]["num_tokens"], 0);
    let info = get_json(&decode, "/server_info").await;
    assert_eq!(info["disaggregation_mode"], "decode");
    let info = get_json(&prefill, "/server_info").await;
    assert_eq!(info["disaggregation_mode"], "prefill");
}

#[tokio::test]
async fn decode_fails_when_the_room_never_becomes_ready() {
    let prefill = start(SimConfig {
        role: Role::Prefill,
        ..fast_config()
    })
    .await;
    for instant in [false, true] {
        let decode = start(SimConfig {
            role: Role::Decode,
            kv_wait_timeout_ms: 300,
            instant,
            ..fast_config()
        })
        .await;
        let started = Instant::now();
        // The legacy decode-rank name is honoured.
        let reply = post(&decode, "/v1/completions", &{
            let mut body: serde_json::Value =
                serde_json::from_str(&pd_body(prefill.addr.port(), 5, "decode_dp_rank", 2)).unwrap();
            body["prompt"] = json!("abcd");
            body.to_string()
        })
        .await;
        assert_eq!(reply.status, StatusCode::INTERNAL_SERVER_ERROR, "{}", reply.text);
        assert!(reply.json()["error"]["message"]
            .as_str()
            .unwrap()
            .contains("not ready"));
        assert_eq!(reply.rank(), 2);
        assert!(started.elapsed() >= Duration::from_millis(300));
        assert_eq!(get_json(&decode, "/get_load").await[2]["num_tokens"], 0);
        assert_eq!(
            get_json(&decode, "/_sim/counters").await["in_flight_per_rank"],
            json!([0, 0, 0, 0])
        );
    }
}

#[tokio::test]
async fn pd_requests_need_their_bootstrap_fields() {
    let decode = start(SimConfig {
        role: Role::Decode,
        ..fast_config()
    })
    .await;
    let mut body: serde_json::Value = serde_json::from_str(&pd_body(1, 5, "routed_dp_rank", 0)).unwrap();
    body["bootstrap_port"] = serde_json::Value::Null;
    let reply = post(&decode, "/generate", &body.to_string()).await;
    assert_eq!(reply.status, StatusCode::BAD_REQUEST);
    let prefill = start(SimConfig {
        role: Role::Prefill,
        ..fast_config()
    })
    .await;
    let reply = post(&prefill, "/generate", r#"{"text":"x"}"#).await;
    assert_eq!(reply.status, StatusCode::BAD_REQUEST);
    // A null bootstrap port is fine for the prefill itself.
    let reply = post(&prefill, "/generate", &body.to_string()).await;
    assert_eq!(reply.status, StatusCode::OK);
}

#[tokio::test]
async fn batched_pd_requests_mark_and_wait_for_every_room() {
    let prefill = start(SimConfig {
        role: Role::Prefill,
        ..fast_config()
    })
    .await;
    let decode = start(SimConfig {
        role: Role::Decode,
        ..fast_config()
    })
    .await;
    let port = prefill.addr.port();
    let body = json!({
        "text": ["abcd", "abcdabcd"], "sampling_params": {"max_new_tokens": 3},
        "bootstrap_host": ["127.0.0.1", "127.0.0.1"], "bootstrap_port": [port, port],
        "bootstrap_room": [11, 12],
    })
    .to_string();
    let (prefill_reply, decode_reply) = tokio::join!(
        post(&prefill, "/generate", &body),
        post(&decode, "/generate", &body)
    );
    assert_eq!(prefill_reply.status, StatusCode::OK);
    assert_eq!(decode_reply.status, StatusCode::OK, "{}", decode_reply.text);
    assert_eq!(decode_reply.json().as_array().unwrap().len(), 2);
    assert_eq!(decode_reply.json()[1]["meta_info"]["completion_tokens"], 3);
}

#[tokio::test]
async fn room_modulo_dispatch_picks_the_room_modulo_dp_size() {
    let prefill = start_with_bootstrap(SimConfig {
        role: Role::Prefill,
        dispatch: Some(dprank_sim::Dispatch::RoomModulo),
        ..fast_config()
    })
    .await;
    let bootstrap_port = prefill.bootstrap_addr.unwrap().port();
    for room in [0u64, 5, 6, 11, 9_223_372_036_854_775_807] {
        let body = json!({
            "text": text_of(100), "sampling_params": {"max_new_tokens": 4},
            "bootstrap_host": "127.0.0.1", "bootstrap_port": bootstrap_port, "bootstrap_room": room,
        });
        let reply = post(&prefill, "/generate", &body.to_string()).await;
        assert_eq!(reply.status, StatusCode::OK, "{}", reply.text);
        assert_eq!(reply.rank() as u64, room % 4, "room {room}");
    }
    // A rank named by the router still wins.
    let reply = post(
        &prefill,
        "/generate",
        &pd_body(bootstrap_port, 5, "routed_dp_rank", 3),
    )
    .await;
    assert_eq!(reply.rank(), 3);
}
