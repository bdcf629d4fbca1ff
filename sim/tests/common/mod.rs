// Test helpers: failing loudly is what a test wants.
#![allow(dead_code, clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, Instant};

use dprank_sim::{CostPreset, SimConfig, SimServer};
use reqwest::header::HeaderMap;
use reqwest::{Client, StatusCode};
use serde_json::Value;

pub async fn start(config: SimConfig) -> SimServer {
    SimServer::start(Arc::new(config), "127.0.0.1:0".parse().unwrap(), None)
        .await
        .unwrap()
}

pub async fn start_with_bootstrap(config: SimConfig) -> SimServer {
    SimServer::start(
        Arc::new(config),
        "127.0.0.1:0".parse().unwrap(),
        Some("127.0.0.1:0".parse().unwrap()),
    )
    .await
    .unwrap()
}

pub fn client() -> Client {
    Client::builder().no_proxy().build().unwrap()
}

pub struct Reply {
    pub status: StatusCode,
    pub headers: HeaderMap,
    pub text: String,
}

impl Reply {
    pub fn json(&self) -> Value {
        serde_json::from_str(&self.text).unwrap_or_else(|err| panic!("not JSON ({err}): {}", self.text))
    }

    pub fn rank(&self) -> i64 {
        self.headers["x-sim-dp-rank"].to_str().unwrap().parse().unwrap()
    }
}

pub async fn post(server: &SimServer, path: &str, body: &str) -> Reply {
    let response = client()
        .post(format!("{}{path}", server.url()))
        .header("content-type", "application/json")
        .body(body.to_string())
        .timeout(Duration::from_secs(30))
        .send()
        .await
        .unwrap();
    Reply {
        status: response.status(),
        headers: response.headers().clone(),
        text: response.text().await.unwrap(),
    }
}

pub async fn get(server: &SimServer, path: &str) -> Reply {
    let response = client()
        .get(format!("{}{path}", server.url()))
        .timeout(Duration::from_secs(30))
        .send()
        .await
        .unwrap();
    Reply {
        status: response.status(),
        headers: response.headers().clone(),
        text: response.text().await.unwrap(),
    }
}

pub async fn get_json(server: &SimServer, path: &str) -> Value {
    let reply = get(server, path).await;
    assert_eq!(reply.status, StatusCode::OK, "{path}: {}", reply.text);
    reply.json()
}

pub async fn control(server: &SimServer, body: &str) -> Value {
    let reply = post(server, "/_sim/control", body).await;
    assert_eq!(reply.status, StatusCode::OK, "{}", reply.text);
    reply.json()
}

/// Polls `check` until it returns Some, failing after `limit`.
pub async fn wait_for<T, F, Fut>(limit: Duration, mut check: F) -> T
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Option<T>>,
{
    let deadline = Instant::now() + limit;
    loop {
        if let Some(value) = check().await {
            return value;
        }
        assert!(
            Instant::now() < deadline,
            "condition not reached within {limit:?}"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// Per-rank `num_tokens` from /get_load.
pub async fn rank_tokens(server: &SimServer) -> Vec<u64> {
    get_json(server, "/get_load")
        .await
        .as_array()
        .unwrap()
        .iter()
        .map(|row| row["num_tokens"].as_u64().unwrap())
        .collect()
}

/// A text of exactly `tokens` tokens (" ab" is one token).
pub fn text_of(tokens: usize) -> String {
    " ab".repeat(tokens)
}

fn letter(n: usize) -> char {
    (b'a' + (n % 26) as u8) as char
}

/// `tokens` one-token words, different for each `salt` (no shared prefix).
pub fn distinct_text(tokens: usize, salt: usize) -> String {
    (0..tokens)
        .map(|i| {
            let mut word = format!(" {}", letter(salt));
            let mut n = i;
            loop {
                word.push(letter(n));
                n /= 26;
                if n == 0 {
                    break;
                }
            }
            word
        })
        .collect()
}

/// A small, fast model for tests (the legacy cost model, faster).
pub fn fast_config() -> SimConfig {
    SimConfig {
        cost_model: CostPreset::Legacy,
        dp_size: Some(4),
        prefill_tokens_per_s: Some(1e7),
        decode_step_ms: Some(5.0),
        decode_step_us_per_token: Some(0.0),
        tokenizer_delay_us: 0.0,
        tokenizer_us_per_token: 0.0,
        load_publish_interval: 1,
        ..SimConfig::default()
    }
}
