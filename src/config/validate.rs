//! `ConfigJson` -> `Config`, one named step per concern. Each step takes what
//! it validates out of the JSON and returns it checked, or an error naming
//! the key at fault.

use super::checks::{self, field_name, invalid, is_metric_name, non_empty};
use super::transport::{transport, TransportInput};
use super::workers::{mode, rank_ports_allowed};
use super::*;
use crate::headers::{is_lowercase_header_name, CLIENT_RANK_HEADERS, SERVER_PRIORITY_HEADER};

impl TryFrom<ConfigJson> for Config {
    type Error = ConfigError;

    fn try_from(mut json: ConfigJson) -> Result<Self, Self::Error> {
        // First: it writes its defaults into `json` for the steps below.
        let engine = super::engine::engine(&mut json)?;
        let naming = json.naming.unwrap_or(Naming::Current);
        let prefix = prefix::settings(&json)?;
        let (gateways, pick) = (super::gateways::gateways(&json)?, super::gateways::pick(&json)?);
        let mode = mode(&mut json, naming)?;
        rank_ports_allowed(&engine, &mode)?;
        let (poll_interval_ms, poll_timeout_ms, stale_after_ms) = poll_timing(&json)?;
        let rank_field = field_name(
            "rank_field",
            json.rank_field,
            match naming {
                Naming::Current => "routed_dp_rank",
                Naming::Legacy => "data_parallel_rank",
            },
        )?;
        let paths = paths(json.paths)?;
        let (route_header, pin_header) = headers(json.route_header, json.pin_header)?;
        let envoy_health = envoy_health(json.envoy_health, &mode)?;
        let retry_alternates = json.retry_alternates.unwrap_or(DEFAULT_RETRY_ALTERNATES);
        if retry_alternates > MAX_RETRY_ALTERNATES {
            return Err(invalid(
                "retry_alternates",
                format!("must be 0..={MAX_RETRY_ALTERNATES}, got {retry_alternates}"),
            ));
        }
        let state_refresh_ms = json.state_refresh_ms.unwrap_or(0);
        if state_refresh_ms > poll_interval_ms {
            // Longer, and a VM could miss whole polls: snapshots would look
            // older than they are, and `stale_after_ms` would mean less.
            return Err(invalid(
                "state_refresh_ms",
                format!("must be 0..=poll_interval_ms ({poll_interval_ms}), got {state_refresh_ms}"),
            ));
        }
        let state_reads = json.state_reads.unwrap_or(StateReads::Auto);
        if state_reads == StateReads::ChangeLog && state_refresh_ms > 0 {
            // The log already spares the reads, without the staleness.
            return Err(invalid(
                "state_refresh_ms",
                "applies to state_reads every_worker or auto only, not change_log",
            ));
        }
        let keep_client_rank = json.keep_client_rank.unwrap_or(false);
        let cost_estimate = json.cost_estimate.unwrap_or(CostEstimate::Bytes);
        let taken: Vec<&str> = [Some(route_header.as_str()), pin_header.as_deref()]
            .into_iter()
            .flatten()
            .collect();
        let transport = transport(TransportInput {
            rank_transport: json.rank_transport,
            rank_headers: json.rank_headers,
            cost_without_length: json.cost_without_length,
            mode: &mode,
            keep_client_rank,
            cost_estimate,
            reads_body: prefix.is_some(),
            taken: &taken,
        })?;
        let sets_priority = json
            .admission
            .as_ref()
            .is_some_and(|a| a.server_priority.is_some());
        let removed_headers = removed_headers(&taken, &transport, sets_priority);
        let removed: Vec<&str> = removed_headers.iter().map(String::as_str).collect();
        let admission = admission::settings(json.admission.take(), &removed)?;
        let delivery_timing = json.delivery_timing.unwrap_or(true);
        if !delivery_timing && admission.as_ref().is_some_and(|a| a.slo.is_some()) {
            return Err(super::checks::invalid(
                "delivery_timing",
                "admission.slo learns from the timed answers: it cannot be false with it",
            ));
        }
        Ok(Config {
            engine,
            mode,
            poll_cluster: non_empty("poll_cluster", json.poll_cluster, DEFAULT_POLL_CLUSTER)?,
            route_header,
            poll_interval_ms,
            poll_timeout_ms,
            stale_after_ms,
            load_endpoint: json.load_endpoint.unwrap_or(LoadEndpoint::Auto),
            rank_field,
            cost_estimate,
            fail_mode: json.fail_mode.unwrap_or(FailMode::Open),
            rank_numbering: json.rank_numbering.unwrap_or(RankNumbering::Local),
            delivery_timing,
            paths,
            keep_client_rank,
            pin_header,
            state_key: state_key(json.state_key)?,
            poll_loads: json.poll_loads.unwrap_or(true),
            prefix,
            gateways,
            pick,
            passive_health: passive_health(json.passive_health.unwrap_or_default())?,
            envoy_health,
            retry_alternates,
            state_refresh_ms,
            state_reads,
            transport,
            admission,
            removed_headers,
        })
    }
}

/// `passive_health`: on with the defaults unless `enabled: false`.
fn passive_health(json: PassiveHealthJson) -> Result<Option<PassiveHealth>, ConfigError> {
    let key = |field: &str| format!("passive_health.{field}");
    if json.enabled == Some(false) {
        return Ok(None);
    }
    let consecutive_failures = json.consecutive_failures.unwrap_or(DEFAULT_CONSECUTIVE_FAILURES);
    if !(1..=1000).contains(&consecutive_failures) {
        return Err(invalid(
            key("consecutive_failures"),
            format!("must be 1..=1000, got {consecutive_failures}"),
        ));
    }
    let cooldown_ms = json.cooldown_ms.unwrap_or(DEFAULT_COOLDOWN_MS);
    let max_cooldown_ms = json
        .max_cooldown_ms
        .unwrap_or(DEFAULT_MAX_COOLDOWN_MS.max(cooldown_ms));
    if !(MIN_POLL_INTERVAL_MS..=MAX_POLL_INTERVAL_MS).contains(&cooldown_ms) {
        return Err(invalid(
            key("cooldown_ms"),
            format!("must be {MIN_POLL_INTERVAL_MS}..={MAX_POLL_INTERVAL_MS}, got {cooldown_ms}"),
        ));
    }
    if !(cooldown_ms..=MAX_POLL_INTERVAL_MS).contains(&max_cooldown_ms) {
        return Err(invalid(
            key("max_cooldown_ms"),
            format!("must be cooldown_ms ({cooldown_ms})..={MAX_POLL_INTERVAL_MS}, got {max_cooldown_ms}"),
        ));
    }
    let probe_share = json.probe_share.unwrap_or(DEFAULT_PROBE_SHARE);
    // Not 0: a worker past its cooldown would never be tried again.
    if !(probe_share > 0.0 && probe_share <= 1.0) {
        return Err(invalid(
            key("probe_share"),
            format!("must be above 0 and at most 1, got {probe_share}"),
        ));
    }
    Ok(Some(PassiveHealth {
        consecutive_failures,
        cooldown_ms,
        max_cooldown_ms,
        probe_share,
    }))
}

/// `envoy_health`: for listed workers (and PD's decode workers, whose
/// cluster it names); `workers_from_cluster` follows Envoy's health already.
fn envoy_health(json: Option<DiscoveryJson>, mode: &Mode) -> Result<Option<Discovery>, ConfigError> {
    let Some(json) = json else {
        return Ok(None);
    };
    if matches!(mode, Mode::FromCluster { .. }) {
        return Err(invalid(
            "envoy_health",
            "workers_from_cluster already leaves out the hosts Envoy reports unhealthy",
        ));
    }
    checks::discovery("envoy_health", json).map(Some)
}

/// Every client header no request keeps: the filter's own (route, pin), the
/// rank and bootstrap headers servers read, the configured rank headers,
/// and the server's priority header when dprank `sets_priority`.
fn removed_headers(own: &[&str], transport: &Transport, sets_priority: bool) -> Vec<String> {
    let configured = match transport {
        Transport::Header(h) => h.rank_headers.as_slice(),
        Transport::Body => &[],
    };
    let priority = sets_priority.then_some(SERVER_PRIORITY_HEADER);
    let mut names: Vec<String> = own.iter().map(|h| h.to_string()).collect();
    for name in CLIENT_RANK_HEADERS
        .iter()
        .copied()
        .chain(configured.iter().map(String::as_str))
        .chain(priority)
    {
        if !names.iter().any(|n| n == name) {
            names.push(name.to_string());
        }
    }
    names
}

/// The poll interval, the per-poll timeout (at most the interval) and the
/// age beyond which a snapshot counts as no data (at least the interval).
fn poll_timing(json: &ConfigJson) -> Result<(u64, u64, u64), ConfigError> {
    let interval = json.poll_interval_ms.unwrap_or(DEFAULT_POLL_INTERVAL_MS);
    if !(MIN_POLL_INTERVAL_MS..=MAX_POLL_INTERVAL_MS).contains(&interval) {
        return Err(invalid(
            "poll_interval_ms",
            format!("must be {MIN_POLL_INTERVAL_MS}..={MAX_POLL_INTERVAL_MS}, got {interval}"),
        ));
    }
    let timeout = json.poll_timeout_ms.unwrap_or(interval.min(1000));
    if timeout == 0 || timeout > interval {
        return Err(invalid(
            "poll_timeout_ms",
            format!("must be 1..=poll_interval_ms ({interval}), got {timeout}"),
        ));
    }
    let stale = json.stale_after_ms.unwrap_or(3 * interval);
    if stale < interval {
        return Err(invalid(
            "stale_after_ms",
            format!("must be at least poll_interval_ms ({interval}), got {stale}"),
        ));
    }
    Ok((interval, timeout, stale))
}

/// The routed POST paths: absolute, without a query.
fn paths(paths: Option<Vec<String>>) -> Result<Vec<String>, ConfigError> {
    let Some(paths) = paths else {
        return Ok(DEFAULT_PATHS.iter().map(|p| p.to_string()).collect());
    };
    if paths.is_empty() {
        return Err(invalid("paths", "at least one path is required"));
    }
    if let Some(p) = paths.iter().find(|p| !p.starts_with('/') || p.contains('?')) {
        return Err(invalid(
            "paths",
            format!("`{p}` must start with '/' and hold no query"),
        ));
    }
    Ok(paths)
}

/// The route header and the optional test pin header: lowercase, distinct.
fn headers(route: Option<String>, pin: Option<String>) -> Result<(String, Option<String>), ConfigError> {
    let route = route.unwrap_or_else(|| DEFAULT_ROUTE_HEADER.to_string());
    if !is_lowercase_header_name(&route) {
        return Err(invalid(
            "route_header",
            format!("`{route}` is not a lowercase header name"),
        ));
    }
    let pin = match pin {
        Some(h) if !is_lowercase_header_name(&h) => {
            return Err(invalid(
                "pin_header",
                format!("`{h}` is not a lowercase header name"),
            ))
        }
        Some(h) if h == route => return Err(invalid("pin_header", "must differ from route_header")),
        other => other,
    };
    Ok((route, pin))
}

/// The prefix of every shared-data key: it must stay a plain name.
fn state_key(key: Option<String>) -> Result<String, ConfigError> {
    let key = key.unwrap_or_else(|| DEFAULT_STATE_KEY.to_string());
    if !is_metric_name(&key) {
        return Err(invalid(
            "state_key",
            format!("`{key}` may only hold letters, digits, '-' and '_'"),
        ));
    }
    Ok(key)
}
