//! Rank fields, the control API, faults, recordings and the start-up
//! endpoints, through real HTTP.

mod common;

use std::time::Duration;

use common::*;
use dprank_sim::SimConfig;
use reqwest::StatusCode;
use serde_json::{json, Value};

fn instant() -> SimConfig {
    SimConfig {
        instant: true,
        ..fast_config()
    }
}

#[tokio::test]
async fn rank_fields_are_honoured_and_checked() {
    let server = start(instant()).await;
    for (path, body, rank) in [
        ("/generate", r#"{"text":"x","routed_dp_rank":2}"#, 2),
        ("/generate", r#"{"text":"x","data_parallel_rank":3}"#, 3),
        ("/v1/completions", r#"{"prompt":"x","data_parallel_rank":1}"#, 1),
        ("/v1/chat/completions", r#"{"messages":[],"routed_dp_rank":3}"#, 3),
        // The current name wins over the legacy alias.
        (
            "/generate",
            r#"{"text":"x","data_parallel_rank":1,"routed_dp_rank":2}"#,
            2,
        ),
    ] {
        let reply = post(&server, path, body).await;
        assert_eq!(reply.status, StatusCode::OK, "{body}: {}", reply.text);
        assert_eq!(reply.rank(), rank, "{body}");
        assert_eq!(reply.headers["x-sim-worker"], server.addr.to_string());
    }
    for body in [
        r#"{"text":"x","routed_dp_rank":4}"#,
        r#"{"text":"x","data_parallel_rank":-1}"#,
        r#"{"text":"x","routed_dp_rank":"1"}"#,
        r#"{"text":"x","routed_dp_rank":1.0}"#,
        r#"{"text":"x","routed_dp_rank":1,"data_parallel_rank":9}"#,
    ] {
        let reply = post(&server, "/generate", body).await;
        assert_eq!(reply.status, StatusCode::BAD_REQUEST, "{body}");
        assert!(reply.json()["error"]["message"].is_string());
        assert_eq!(reply.rank(), -1);
        assert_eq!(reply.headers["x-sim-worker"], server.addr.to_string());
    }
    let records = get_json(&server, "/_sim/requests").await;
    let ranks: Vec<Value> = records
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["rank"].clone())
        .collect();
    assert_eq!(
        ranks,
        vec![
            json!(2),
            json!(3),
            json!(1),
            json!(3),
            json!(2),
            json!(null),
            json!(null),
            json!(null),
            json!(null),
            json!(null)
        ]
    );
    let counters = get_json(&server, "/_sim/counters").await;
    assert_eq!(counters["served_per_rank"], json!([0, 1, 2, 2]));
}

#[tokio::test]
async fn invalid_json_gets_a_json_400() {
    let server = start(instant()).await;
    for body in ["{not json", "[]", "", r#"{"text":5}"#] {
        let reply = post(&server, "/generate", body).await;
        assert_eq!(reply.status, StatusCode::BAD_REQUEST, "{body}");
        assert!(reply.json()["error"]["message"].is_string());
    }
}

#[tokio::test]
async fn recording_holds_the_exact_bytes() {
    let server = start(instant()).await;
    let body = "{ \"text\" : \"h\u{e9}llo\",\n\"routed_dp_rank\":1 ,\"x\":1.50}";
    let response = client()
        .post(format!("{}/generate?debug=1", server.url()))
        .header("X-Request-Id", "abc")
        .header("content-type", "application/json")
        .body(body)
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), StatusCode::OK);
    let not_utf8: &[u8] = &[0xff, 0xfe, b'{'];
    let response = client()
        .post(format!("{}/v1/completions", server.url()))
        .body(not_utf8.to_vec())
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), StatusCode::BAD_REQUEST);

    let records = get_json(&server, "/_sim/requests").await;
    assert_eq!(records[0]["path"], "/generate");
    assert_eq!(records[0]["query"], "debug=1");
    assert_eq!(records[0]["method"], "POST");
    assert_eq!(records[0]["body"], body);
    assert_eq!(records[0]["headers"]["x-request-id"], "abc");
    assert_eq!(records[0]["rank"], 1);
    assert_eq!(records[0]["status"], 200);
    assert_eq!(records[1]["body_base64"], "//57");
    assert!(records[1].get("body").is_none());
    assert_eq!(records[1]["status"], 400);

    get(&server, "/get_load").await;
    let counters = get_json(&server, "/_sim/counters").await;
    assert_eq!(counters["load_requests"]["/get_load"], 1);
    assert_eq!(counters["served_per_rank"], json!([0, 1, 0, 0]));

    control(&server, r#"{"base_tokens":[7]}"#).await;
    let reply = post(&server, "/_sim/reset", "").await;
    assert_eq!(reply.status, StatusCode::OK);
    assert_eq!(get_json(&server, "/_sim/requests").await, json!([]));
    let counters = get_json(&server, "/_sim/counters").await;
    assert_eq!(counters["load_requests"], json!({"/get_load": 0, "/v1/loads": 0}));
    assert_eq!(counters["served_per_rank"], json!([0, 0, 0, 0]));
    // base_tokens survive a reset unless given.
    assert_eq!(rank_tokens(&server).await, vec![7, 0, 0, 0]);
    post(&server, "/_sim/reset", r#"{"base_tokens":[0,0,0,0]}"#).await;
    assert_eq!(rank_tokens(&server).await, vec![0, 0, 0, 0]);
}

#[tokio::test]
async fn base_tokens_are_added_to_every_token_count() {
    let server = start(instant()).await;
    let state = control(&server, r#"{"base_tokens":[100,0,5000,30]}"#).await;
    assert_eq!(state["base_tokens"], json!([100, 0, 5000, 30]));
    assert_eq!(rank_tokens(&server).await, vec![100, 0, 5000, 30]);
    let v1 = get_json(&server, "/v1/loads?include=core").await;
    assert_eq!(v1["loads"][2]["num_used_tokens"], 5000);
    assert_eq!(v1["loads"][2]["num_total_tokens"], 5000);
    assert_eq!(v1["aggregate"]["num_used_tokens"], 5130);
    let reply = post(&server, "/_sim/control", r#"{"base_tokens":[1,2,3,4,5]}"#).await;
    assert_eq!(reply.status, StatusCode::BAD_REQUEST);
    let reply = post(&server, "/_sim/control", r#"{"load_fault":"explode"}"#).await;
    assert_eq!(reply.status, StatusCode::BAD_REQUEST);
}

#[tokio::test]
async fn each_load_fault_behaves_as_specified() {
    let server = start(instant()).await;
    for path in ["/get_load", "/v1/loads?include=core"] {
        control(&server, r#"{"load_fault":"http_500"}"#).await;
        assert_eq!(get(&server, path).await.status, StatusCode::INTERNAL_SERVER_ERROR);

        control(&server, r#"{"load_fault":"not_found"}"#).await;
        assert_eq!(get(&server, path).await.status, StatusCode::NOT_FOUND);

        control(&server, r#"{"load_fault":"malformed"}"#).await;
        let reply = get(&server, path).await;
        assert_eq!(reply.status, StatusCode::OK);
        assert!(serde_json::from_str::<Value>(&reply.text).is_err());

        control(&server, r#"{"load_fault":"truncated"}"#).await;
        let reply = get(&server, path).await;
        assert_eq!(reply.status, StatusCode::OK);
        assert!(serde_json::from_str::<Value>(&reply.text).is_err());
        assert!(reply.text.starts_with(if path == "/get_load" {
            "[{\"dp_rank\":0"
        } else {
            "{\"aggregate\""
        }));

        control(&server, r#"{"load_fault":"wrong_dp_size"}"#).await;
        let body = get_json(&server, path).await;
        let rows = if path == "/get_load" {
            body.clone()
        } else {
            body["loads"].clone()
        };
        assert_eq!(rows.as_array().unwrap().len(), 6);
        if path != "/get_load" {
            assert_eq!(body["dp_rank_count"], 6);
        }

        control(&server, r#"{"load_fault":"hang"}"#).await;
        let outcome = client()
            .get(format!("{}{path}", server.url()))
            .timeout(Duration::from_millis(300))
            .send()
            .await;
        assert!(outcome.unwrap_err().is_timeout());

        control(&server, r#"{"load_fault":"none"}"#).await;
        let body = get_json(&server, path).await;
        let rows = if path == "/get_load" {
            body
        } else {
            body["loads"].clone()
        };
        assert_eq!(rows.as_array().unwrap().len(), 4);
    }
    let state = get_json(&server, "/_sim/control").await;
    assert_eq!(state["load_fault"], "none");
}

#[tokio::test]
async fn older_builds_can_be_emulated() {
    let server = start(SimConfig {
        no_v1_loads: true,
        ..instant()
    })
    .await;
    assert_eq!(
        get(&server, "/v1/loads?include=core").await.status,
        StatusCode::NOT_FOUND
    );
    assert_eq!(get_json(&server, "/get_load").await.as_array().unwrap().len(), 4);
    let server = start(SimConfig {
        no_total_tokens: true,
        ..instant()
    })
    .await;
    let body = get_json(&server, "/v1/loads").await;
    assert!(body["loads"][0].get("num_total_tokens").is_none());
    assert!(body["loads"][0].get("num_used_tokens").is_some());
    assert!(body["aggregate"].get("num_total_tokens").is_none());
}

#[tokio::test]
async fn serving_faults() {
    let server = start(fast_config()).await;
    control(&server, r#"{"serving_fault":"http_500"}"#).await;
    let reply = post(&server, "/generate", r#"{"text":"x"}"#).await;
    assert_eq!(reply.status, StatusCode::INTERNAL_SERVER_ERROR);
    assert!(reply.json()["error"]["message"].is_string());

    control(&server, r#"{"serving_fault":"close_mid_stream"}"#).await;
    let mut response = client()
        .post(format!("{}/generate", server.url()))
        .body(r#"{"text":"x","stream":true,"sampling_params":{"max_new_tokens":10}}"#)
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), StatusCode::OK);
    let mut text = String::new();
    let error = loop {
        match response.chunk().await {
            Ok(Some(chunk)) => text.push_str(std::str::from_utf8(&chunk).unwrap()),
            Ok(None) => panic!("the stream ended cleanly: {text}"),
            Err(error) => break error,
        }
    };
    assert!(text.starts_with("data: {"), "{text}");
    assert!(!text.contains("[DONE]"));
    drop(error);
    let outcome = client()
        .post(format!("{}/generate", server.url()))
        .body(r#"{"text":"x"}"#)
        .send()
        .await
        .unwrap()
        .text()
        .await;
    assert!(outcome.is_err());

    control(&server, r#"{"serving_fault":"none"}"#).await;
    assert_eq!(
        post(&server, "/generate", r#"{"text":"x"}"#).await.status,
        StatusCode::OK
    );
}

#[tokio::test]
async fn start_up_endpoints_satisfy_a_gateway() {
    let server = start(SimConfig {
        model: "org/sim-7b".into(),
        dp_size: Some(8),
        ..instant()
    })
    .await;
    assert_eq!(get(&server, "/health").await.status, StatusCode::OK);
    assert_eq!(get(&server, "/health_generate").await.status, StatusCode::OK);
    let models = get_json(&server, "/v1/models").await;
    assert_eq!(models["object"], "list");
    assert_eq!(models["data"][0]["id"], "org/sim-7b");
    assert_eq!(models["data"][0]["owned_by"], "sglang");
    for path in ["/server_info", "/get_server_info"] {
        let info = get_json(&server, path).await;
        assert_eq!(info["dp_size"], 8);
        assert_eq!(info["model_path"], "org/sim-7b");
        assert_eq!(info["enable_dp_attention"], true);
        assert_eq!(info["disaggregation_mode"], "null");
        assert!(info["tp_size"].is_u64());
        assert!(info["version"].is_string());
    }
    for path in ["/model_info", "/get_model_info"] {
        let info = get_json(&server, path).await;
        assert_eq!(info["model_path"], "org/sim-7b");
        assert_eq!(info["is_generation"], true);
    }
    let reply = get(&server, "/nowhere").await;
    assert_eq!(reply.status, StatusCode::NOT_FOUND);
    assert_eq!(reply.headers["x-sim-dp-rank"], "-1");
}

#[tokio::test]
async fn the_binary_serves_a_fleet_and_prints_ready_lines() {
    use tokio::io::{AsyncBufReadExt, BufReader};
    let mut child = tokio::process::Command::new(env!("CARGO_BIN_EXE_dprank-sim"))
        .args([
            "--listen",
            "127.0.0.1:0",
            "--listen",
            "127.0.0.1:0",
            "--dp-size",
            "2",
            "--instant",
        ])
        .stdout(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let mut addresses = Vec::new();
    for _ in 0..2 {
        let line = tokio::time::timeout(Duration::from_secs(10), lines.next_line())
            .await
            .unwrap()
            .unwrap()
            .unwrap();
        let mut words = line.split_whitespace();
        assert_eq!(words.next(), Some("ready"), "{line}");
        addresses.push(words.next().unwrap().to_string());
    }
    assert_ne!(addresses[0], addresses[1]);
    for address in &addresses {
        let response = client()
            .post(format!("http://{address}/generate"))
            .body(r#"{"text":"x","routed_dp_rank":1}"#)
            .send()
            .await
            .unwrap();
        assert_eq!(response.headers()["x-sim-worker"], address.as_str());
        assert_eq!(response.headers()["x-sim-dp-rank"], "1");
    }
    // Each listener is its own worker with its own counters.
    let counters: Value = client()
        .get(format!("http://{}/_sim/counters", addresses[0]))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .map(|text| serde_json::from_str(&text).unwrap())
        .unwrap();
    assert_eq!(counters["served_per_rank"], json!([0, 1]));
    child.kill().await.unwrap();
}

#[tokio::test]
async fn recordings_keep_the_latest_requests_up_to_the_limit() {
    let server = start(SimConfig {
        record_limit: 2,
        ..instant()
    })
    .await;
    for text in ["a", "b", "c"] {
        post(&server, "/generate", &json!({"text": text}).to_string()).await;
    }
    let records = get_json(&server, "/_sim/requests").await;
    let bodies: Vec<&str> = records
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["body"].as_str().unwrap())
        .collect();
    assert_eq!(bodies, vec![r#"{"text":"b"}"#, r#"{"text":"c"}"#]);
}
