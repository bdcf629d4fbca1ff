//! Which engine the fleet runs (`engine`): it selects the load source and
//! the defaults of the keys that depend on it, and refuses the keys that
//! mean nothing (or harm) for it. vLLM has no body field for the rank, so
//! every key that would write one is refused by name (docs/vllm.md).

use super::json::ConfigJson;
use super::{ConfigError, RankTransport};
use serde::{Deserialize, Serialize};

/// `engine` as written.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum EngineKind {
    /// SGLang: loads from `/v1/loads` or `/get_load`, the rank in the body or headers.
    #[default]
    Sglang,
    /// vLLM: loads from `/metrics`, the rank in `x-data-parallel-rank` only.
    Vllm,
}

/// The engine of the fleet, validated.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Engine {
    Sglang,
    Vllm {
        /// Only the figures labelled with this `model_name` are read; None:
        /// the one model the answer reports.
        served_model_name: Option<String>,
    },
}

/// The one header vLLM reads the rank from (`X-data-parallel-rank`, any case).
pub const VLLM_RANK_HEADER: &str = "x-data-parallel-rank";
/// The routes vLLM pins by the header from 0.14 on.
pub const VLLM_PATHS: [&str; 2] = ["/v1/completions", "/v1/chat/completions"];

fn invalid(key: &str, reason: impl Into<String>) -> ConfigError {
    ConfigError::Invalid {
        key: key.to_string(),
        reason: reason.into(),
    }
}

/// `engine` and `served_model_name`. For vLLM, refuses every key that would
/// send a body rank field or read SGLang's load endpoints, and writes its
/// defaults into `json` where the keys are left out (the rank in headers,
/// prefix affinity on, vLLM's routes), so the steps after this one see them.
pub fn engine(json: &mut ConfigJson) -> Result<Engine, ConfigError> {
    let kind = json.engine.unwrap_or_default();
    let model = json.served_model_name.take();
    if kind == EngineKind::Sglang {
        if model.is_some() {
            return Err(invalid("served_model_name", "applies to engine vllm only"));
        }
        return Ok(Engine::Sglang);
    }
    let no_body_field = "vLLM has no body field for the rank: it reads x-data-parallel-rank only";
    let refused = [
        ("rank_transport", json.rank_transport == Some(RankTransport::Body)),
        ("rank_field", json.rank_field.is_some()),
        ("naming", json.naming.is_some()),
        ("keep_client_rank", json.keep_client_rank == Some(true)),
        ("prefill_workers", json.prefill_workers.is_some()),
        ("decode_workers", json.decode_workers.is_some()),
        (
            "admission.server_priority",
            json.admission
                .as_ref()
                .is_some_and(|a| a.server_priority.is_some()),
        ),
    ];
    if let Some((key, _)) = refused.iter().find(|(_, set)| *set) {
        let why = match *key {
            "prefill_workers" | "decode_workers" => {
                "PD mode writes its ranks and bootstrap fields into the bodies; with engine vllm, list `workers`"
            }
            "admission.server_priority" => {
                "vLLM reads a request's priority from its body only, and dprank writes no vLLM body"
            }
            _ => no_body_field,
        };
        return Err(invalid(key, format!("not with engine vllm: {why}")));
    }
    if json.load_endpoint.is_some() {
        return Err(invalid(
            "load_endpoint",
            "names SGLang's load endpoints; engine vllm reads /metrics",
        ));
    }
    if let Some(headers) = &json.rank_headers {
        if !headers.iter().any(|h| h == VLLM_RANK_HEADER) {
            return Err(invalid(
                "rank_headers",
                format!("engine vllm reads the rank from `{VLLM_RANK_HEADER}` only: list it"),
            ));
        }
    }
    if model.as_deref() == Some("") {
        return Err(invalid("served_model_name", "must not be empty"));
    }
    json.rank_transport = Some(RankTransport::Header);
    json.rank_headers
        .get_or_insert_with(|| vec![VLLM_RANK_HEADER.to_string()]);
    json.paths
        .get_or_insert_with(|| VLLM_PATHS.iter().map(|p| p.to_string()).collect());
    json.prefix_affinity.get_or_insert(true);
    Ok(Engine::Vllm {
        served_model_name: model,
    })
}

impl Engine {
    pub fn is_vllm(&self) -> bool {
        matches!(self, Engine::Vllm { .. })
    }
}
