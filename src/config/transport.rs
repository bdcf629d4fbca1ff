//! Where the chosen rank travels (`rank_transport`): in the JSON body, which
//! every SGLang version reads, or in request headers, which current servers
//! read on some endpoints (docs/rank-headers.md) and vLLM reads only, and
//! which spare the filter from rewriting the body (and, without prefix
//! affinity, from buffering it).

use super::{ConfigError, CostEstimate, Mode};
use crate::headers::is_lowercase_header_name;
use serde::{Deserialize, Serialize};

/// Headers header mode writes the rank to unless `rank_headers` says
/// otherwise: SGLang (>= 0.5.10) and vLLM (>= 0.14) read the first on their
/// OpenAI routes; SGLang reads the second on `/generate` (>= 0.5.15) and chat
/// (>= 0.5.18) when started with `SGLANG_ENABLE_REQUEST_HEADER_OVERRIDES=1`.
pub const DEFAULT_RANK_HEADERS: [&str; 2] = ["x-data-parallel-rank", "x-override-routed-dp-rank"];

/// Tokens a request without `content-length` is counted as in header mode
/// (smg counts the same per request when it knows no length).
pub const DEFAULT_COST_WITHOUT_LENGTH: u64 = 1024;

/// `rank_transport` as written.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum RankTransport {
    Body,
    Header,
}

/// Header mode's settings.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct HeaderTransport {
    /// Each gets the chosen rank.
    pub rank_headers: Vec<String>,
    /// Tokens counted for a request without `content-length`, when the
    /// choice is made from the headers.
    pub cost_without_length: u64,
    /// The choice waits for the whole body, read for prefix affinity (and
    /// never changed); otherwise it is made when the headers arrive.
    pub reads_body: bool,
}

/// Where the chosen rank travels.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Transport {
    /// Spliced into the JSON body, which is buffered whole first.
    Body,
    /// Written to request headers, decided when the headers arrive (the
    /// body is never buffered or read) or, under prefix affinity, at the end
    /// of the body; the body is never changed.
    Header(HeaderTransport),
}

fn invalid(key: &str, reason: impl Into<String>) -> ConfigError {
    ConfigError::Invalid {
        key: key.to_string(),
        reason: reason.into(),
    }
}

/// What header mode cannot do without the body, refused by name.
pub struct TransportInput<'a> {
    pub rank_transport: Option<RankTransport>,
    pub rank_headers: Option<Vec<String>>,
    pub cost_without_length: Option<u64>,
    pub mode: &'a Mode,
    pub keep_client_rank: bool,
    pub cost_estimate: CostEstimate,
    /// Prefix affinity is on: header mode reads the body for the prompt.
    pub reads_body: bool,
    /// Headers already taken (route and pin header).
    pub taken: &'a [&'a str],
}

/// Validates `rank_transport` and the keys that go with it.
pub fn transport(input: TransportInput) -> Result<Transport, ConfigError> {
    let header = match input.rank_transport.unwrap_or(RankTransport::Body) {
        RankTransport::Body => {
            if input.rank_headers.is_some() {
                return Err(invalid("rank_headers", "applies to rank_transport header only"));
            }
            if input.cost_without_length.is_some() {
                return Err(invalid(
                    "cost_without_length",
                    "applies to rank_transport header only",
                ));
            }
            return Ok(Transport::Body);
        }
        RankTransport::Header => input,
    };
    if matches!(header.mode, Mode::Pd(_)) {
        return Err(invalid(
            "rank_transport",
            "PD mode needs `body`: its prefill leg is an HTTP call that carries the request body, which header mode never reads",
        ));
    }
    if header.keep_client_rank {
        return Err(invalid(
            "keep_client_rank",
            "keeps a client's body rank field, while rank_transport header writes dprank's rank to headers, which servers prefer",
        ));
    }
    if header.cost_estimate == CostEstimate::Words && !header.reads_body {
        return Err(invalid(
            "cost_estimate",
            "rank_transport header without prefix affinity sees only content-length: use `bytes` (content-length / 4) or `one`",
        ));
    }
    if header.reads_body && header.cost_without_length.is_some() {
        return Err(invalid(
            "cost_without_length",
            "applies when rank_transport header decides from the headers; under prefix affinity the cost comes from the body",
        ));
    }
    let rank_headers = match header.rank_headers {
        None => DEFAULT_RANK_HEADERS.iter().map(|h| h.to_string()).collect(),
        Some(list) => rank_headers(list, header.taken)?,
    };
    let cost_without_length = header.cost_without_length.unwrap_or(DEFAULT_COST_WITHOUT_LENGTH);
    if cost_without_length == 0 {
        return Err(invalid("cost_without_length", "must be at least 1"));
    }
    Ok(Transport::Header(HeaderTransport {
        rank_headers,
        cost_without_length,
        reads_body: header.reads_body,
    }))
}

fn rank_headers(list: Vec<String>, taken: &[&str]) -> Result<Vec<String>, ConfigError> {
    if list.is_empty() {
        return Err(invalid("rank_headers", "at least one header is required"));
    }
    for (i, name) in list.iter().enumerate() {
        if !is_lowercase_header_name(name) {
            return Err(invalid(
                "rank_headers",
                format!("`{name}` is not a lowercase header name"),
            ));
        }
        if taken.contains(&name.as_str()) || list[..i].contains(name) {
            return Err(invalid("rank_headers", format!("`{name}` is used twice")));
        }
    }
    Ok(list)
}
