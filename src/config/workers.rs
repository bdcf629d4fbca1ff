//! Who the workers are (`workers`, `workers_from_cluster`, or PD mode's
//! `prefill_workers` and `decode_workers`: exactly one mode), each worker
//! entry checked, and the layouts a worker may have.

use super::checks::{self, field_name, invalid, is_metric_name, non_empty};
use super::*;

/// Which of the three modes the worker keys describe; exactly one must fit.
pub(super) fn mode(json: &mut ConfigJson, naming: Naming) -> Result<Mode, ConfigError> {
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
    checks::discovery("workers_from_cluster", d)
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
pub(super) fn rank_ports_allowed(engine: &Engine, mode: &Mode) -> Result<(), ConfigError> {
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
