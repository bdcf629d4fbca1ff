//! `ConfigJson` -> `Config`, one named step per concern. Each step takes what
//! it validates out of the JSON and returns it checked, or an error naming
//! the key at fault.

use super::transport::{transport, TransportInput};
use super::*;
use crate::headers::{is_lowercase_header_name, CLIENT_RANK_HEADERS, SERVER_PRIORITY_HEADER};

fn invalid(key: impl Into<String>, reason: impl Into<String>) -> ConfigError {
    ConfigError::Invalid {
        key: key.into(),
        reason: reason.into(),
    }
}

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
    let admin_cluster = json
        .admin_cluster
        .unwrap_or_else(|| DEFAULT_ADMIN_CLUSTER.to_string());
    if json.cluster.is_empty() || admin_cluster.is_empty() {
        return Err(invalid(
            "envoy_health",
            "`cluster` and `admin_cluster` must not be empty",
        ));
    }
    Ok(Some(Discovery {
        cluster: json.cluster,
        admin_cluster,
    }))
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

/// Which of the three modes the worker keys describe; exactly one must fit.
fn mode(json: &mut ConfigJson, naming: Naming) -> Result<Mode, ConfigError> {
    let discovery = match json.workers_from_cluster.take() {
        Some(d) => Some(discovery(d, json)?),
        None => None,
    };
    let pools = (
        json.workers.take(),
        json.prefill_workers.take(),
        json.decode_workers.take(),
    );
    match (pools, discovery) {
        ((None, None, None), Some(discovery)) => {
            no_pd_keys(json)?;
            Ok(Mode::FromCluster {
                discovery,
                workers: Vec::new(),
            })
        }
        ((Some(workers), None, None), None) => {
            no_pd_keys(json)?;
            let workers = validate_workers("workers", workers, &[], false)?;
            Ok(Mode::StaticWorkers { workers })
        }
        ((None, Some(prefill), Some(decode)), None) => pd(json, naming, prefill, decode).map(Mode::Pd),
        ((None, None, None), None) => Err(invalid(
            "workers",
            "list `workers`, or `prefill_workers` and `decode_workers` for PD mode",
        )),
        ((Some(_), _, _), _) => Err(invalid(
            "workers",
            "use either `workers` or `prefill_workers` + `decode_workers`, not both",
        )),
        ((None, Some(_), None), _) => Err(invalid("decode_workers", "PD mode needs decode workers too")),
        ((None, _, _), _) => Err(invalid("prefill_workers", "PD mode needs prefill workers too")),
    }
}

/// `workers_from_cluster`: replaces every worker list.
fn discovery(d: DiscoveryJson, json: &ConfigJson) -> Result<Discovery, ConfigError> {
    if json.workers.is_some() || json.prefill_workers.is_some() || json.decode_workers.is_some() {
        return Err(invalid(
            "workers_from_cluster",
            "replaces `workers` (regular mode only): list workers or name a cluster, not both",
        ));
    }
    let admin_cluster = d
        .admin_cluster
        .unwrap_or_else(|| DEFAULT_ADMIN_CLUSTER.to_string());
    if d.cluster.is_empty() || admin_cluster.is_empty() {
        return Err(invalid(
            "workers_from_cluster",
            "`cluster` and `admin_cluster` must not be empty",
        ));
    }
    Ok(Discovery {
        cluster: d.cluster,
        admin_cluster,
    })
}

/// Regular mode: keys that only mean something in PD mode are refused.
fn no_pd_keys(json: &ConfigJson) -> Result<(), ConfigError> {
    let pd_only = [
        ("prefill_cluster", json.prefill_cluster.is_some()),
        ("prefill_timeout_ms", json.prefill_timeout_ms.is_some()),
        ("prefill_rank_field", json.prefill_rank_field.is_some()),
        ("decode_rank_field", json.decode_rank_field.is_some()),
        (
            "decode_prefill_rank_field",
            json.decode_prefill_rank_field.is_some(),
        ),
    ];
    match pd_only.iter().find(|(_, set)| *set) {
        Some((key, _)) => Err(invalid(
            *key,
            "applies to PD mode only (prefill_workers and decode_workers)",
        )),
        None => Ok(()),
    }
}

/// PD mode: both pools (addresses and names unique across them), the prefill
/// leg's cluster and timeout, and the rank fields of each body.
fn pd(
    json: &mut ConfigJson,
    naming: Naming,
    prefill: Vec<WorkerJson>,
    decode: Vec<WorkerJson>,
) -> Result<Pd, ConfigError> {
    let decode = validate_workers("decode_workers", decode, &[], false)?;
    let prefill = validate_workers("prefill_workers", prefill, &decode, true)?;
    let cluster = non_empty(
        "prefill_cluster",
        json.prefill_cluster.take(),
        DEFAULT_PREFILL_CLUSTER,
    )?;
    let timeout_ms = json.prefill_timeout_ms.unwrap_or(DEFAULT_PREFILL_TIMEOUT_MS);
    if timeout_ms == 0 {
        return Err(invalid("prefill_timeout_ms", "must be positive"));
    }
    if json.rank_field.is_some() {
        return Err(invalid(
            "rank_field",
            "PD mode names its fields with prefill_rank_field, decode_rank_field and decode_prefill_rank_field",
        ));
    }
    let (prefill_body_fields, decode_body_fields) = pd_fields(
        naming,
        json.prefill_rank_field.take(),
        json.decode_rank_field.take(),
        json.decode_prefill_rank_field.take(),
    )?;
    Ok(Pd {
        decode,
        prefill,
        cluster,
        timeout_ms,
        prefill_body_fields,
        decode_body_fields,
    })
}

type PdFields = (Vec<(String, RankOf)>, Vec<(String, RankOf)>);

/// The rank fields of each PD body. `current`: prefill body `routed_dp_rank`=p;
/// decode body `routed_dp_rank`=d and `disagg_prefill_dp_rank`=p. `legacy` (the
/// seed change, one body sent to both): `data_parallel_rank`=p, `decode_dp_rank`=d.
fn pd_fields(
    naming: Naming,
    prefill_rank: Option<String>,
    decode_rank: Option<String>,
    decode_prefill_rank: Option<String>,
) -> Result<PdFields, ConfigError> {
    let (p_default, d_default, dp_default) = match naming {
        Naming::Current => ("routed_dp_rank", "routed_dp_rank", "disagg_prefill_dp_rank"),
        Naming::Legacy => ("data_parallel_rank", "decode_dp_rank", "data_parallel_rank"),
    };
    let p = field_name("prefill_rank_field", prefill_rank, p_default)?;
    let d = field_name("decode_rank_field", decode_rank, d_default)?;
    let dp = field_name("decode_prefill_rank_field", decode_prefill_rank, dp_default)?;
    if d == dp {
        return Err(invalid(
            "decode_prefill_rank_field",
            "must differ from decode_rank_field",
        ));
    }
    let decode_fields = vec![(d.clone(), RankOf::Decode), (dp, RankOf::Prefill)];
    let prefill_fields = match naming {
        Naming::Legacy if p != d => vec![(p, RankOf::Prefill), (d, RankOf::Decode)],
        _ => vec![(p, RankOf::Prefill)],
    };
    Ok((prefill_fields, decode_fields))
}

/// A worker's stat name when the config gives none: its address, '_' for punctuation.
pub fn default_worker_name(address: &SocketAddr) -> String {
    address
        .to_string()
        .chars()
        .map(|c| if c.is_ascii_alphanumeric() { c } else { '_' })
        .collect()
}

/// One port per rank is SGLang's layout (its Rust server), in regular mode:
/// vLLM's servers of one engine each are workers of their own.
fn rank_ports_allowed(engine: &Engine, mode: &Mode) -> Result<(), ConfigError> {
    let with_ports = match mode {
        Mode::StaticWorkers { workers } => workers.iter().any(|w| w.rank_ports),
        Mode::Pd(pd) => pd.decode.iter().chain(&pd.prefill).any(|w| w.rank_ports),
        Mode::FromCluster { .. } => false,
    };
    if !with_ports {
        return Ok(());
    }
    if matches!(mode, Mode::Pd(_)) {
        return Err(invalid("rank_ports", "not in PD mode"));
    }
    if matches!(engine, Engine::Vllm { .. }) {
        return Err(invalid(
            "rank_ports",
            "SGLang's layout; with vLLM, give each server (one port) a worker entry of its own",
        ));
    }
    Ok(())
}

/// Validates one pool. `others` are the workers of pools already validated:
/// addresses and names must be unique across pools (they key shared state and stats).
fn validate_workers(
    list_key: &str,
    json: Vec<WorkerJson>,
    others: &[Worker],
    bootstrap_allowed: bool,
) -> Result<Vec<Worker>, ConfigError> {
    if json.is_empty() {
        return Err(invalid(list_key, "at least one worker is required"));
    }
    let mut workers: Vec<Worker> = Vec::with_capacity(json.len());
    for (i, w) in json.into_iter().enumerate() {
        let key = format!("{list_key}[{i}]");
        let worker = validate_worker(&key, w, bootstrap_allowed)?;
        if workers.iter().chain(others).any(|o| o.address == worker.address) {
            return Err(invalid(
                format!("{key}.address"),
                format!("{} is listed twice", worker.address),
            ));
        }
        if workers.iter().chain(others).any(|o| o.name == worker.name) {
            return Err(invalid(
                format!("{key}.name"),
                format!("`{}` is used twice", worker.name),
            ));
        }
        workers.push(worker);
    }
    Ok(workers)
}

/// One worker entry on its own; `key` is its path (`workers[2]`).
fn validate_worker(key: &str, w: WorkerJson, bootstrap_allowed: bool) -> Result<Worker, ConfigError> {
    if w.bootstrap_port.is_some() && !bootstrap_allowed {
        return Err(invalid(
            format!("{key}.bootstrap_port"),
            "only prefill workers have a bootstrap port",
        ));
    }
    let address: SocketAddr = w.address.parse().map_err(|_| {
        invalid(
            format!("{key}.address"),
            format!(
                "`{}` is not ip:port (Envoy's override_host matches host addresses, so give the address Envoy sees)",
                w.address
            ),
        )
    })?;
    if let Some(dp) = w.dp_size {
        if dp == 0 || dp > MAX_DP_SIZE {
            return Err(invalid(
                format!("{key}.dp_size"),
                format!("must be 1..={MAX_DP_SIZE}, got {dp}"),
            ));
        }
    }
    let rank_ports = w.rank_ports.unwrap_or(false);
    if rank_ports && (bootstrap_allowed || w.dp_size.is_none()) {
        return Err(invalid(
            format!("{key}.rank_ports"),
            "needs the worker's dp_size (its number of rank ports), in regular mode",
        ));
    }
    if rank_ports && u32::from(address.port()) + w.dp_size.unwrap_or(1) > u32::from(u16::MAX) + 1 {
        return Err(invalid(
            format!("{key}.rank_ports"),
            "its rank ports run past port 65535",
        ));
    }
    let loads_address = match w.loads_address {
        None => None,
        Some(_) if !rank_ports => {
            return Err(invalid(
                format!("{key}.loads_address"),
                "only a worker with rank_ports has one",
            ));
        }
        Some(a) => Some(
            a.parse::<SocketAddr>()
                .map_err(|_| invalid(format!("{key}.loads_address"), format!("`{a}` is not ip:port")))?,
        ),
    };
    let name = match w.name {
        Some(n) if is_metric_name(&n) => n,
        Some(n) => {
            return Err(invalid(
                format!("{key}.name"),
                format!("`{n}` may only hold letters, digits, '-' and '_' (it names stats)"),
            ))
        }
        None => default_worker_name(&address),
    };
    Ok(Worker {
        name,
        address,
        dp_size: w.dp_size,
        bootstrap_port: w.bootstrap_port,
        rank_numbering: w.rank_numbering,
        rank_ports,
        loads_address,
    })
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

/// A field name dprank writes into bodies verbatim: it must need no JSON escaping.
fn field_name(key: &str, name: Option<String>, default: &str) -> Result<String, ConfigError> {
    match name {
        Some(n) if n.is_empty() || n.chars().any(|c| c == '"' || c == '\\' || c.is_control()) => Err(invalid(
            key,
            format!("{n:?} is not usable as a JSON key written verbatim (no quotes, backslashes or control characters)"),
        )),
        Some(n) => Ok(n),
        None => Ok(default.to_string()),
    }
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

fn non_empty(key: &str, value: Option<String>, default: &str) -> Result<String, ConfigError> {
    let value = value.unwrap_or_else(|| default.to_string());
    if value.is_empty() {
        return Err(invalid(key, "must not be empty"));
    }
    Ok(value)
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

fn is_metric_name(name: &str) -> bool {
    !name.is_empty()
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
}
