//! Every write to the shared health record, with the stats and logs that
//! go with it: how a request ended (read from Envoy's properties), what
//! load polls and Envoy's admin API tell. The state machine itself is in
//! `health.rs`; the record's key and read-modify-write in `shared_data.rs`.

use crate::config::Config;
use crate::health::{classify, outcomes, Change, Finished, Outcome, Standing, Target};
use crate::host::Host;
use crate::metrics::{self, PerWorker};
use crate::shared_data;
use std::net::SocketAddr;

/// What a request needs to report when it ends.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SentTo {
    /// The route header's hosts: the chosen worker, then its alternates
    /// (empty when the cluster's fallback policy picked the host).
    pub hosts: Vec<SocketAddr>,
    /// The rank written into the body, if any.
    pub rank: Option<u32>,
    pub routed_at_ms: u64,
    /// The health record listed nothing when the request was routed: a
    /// success then needs neither a read nor a write.
    pub health_was_clean: bool,
}

/// A property of the ending request; one the proxy refuses tells nothing,
/// as one it does not have.
fn property(host: &dyn Host, path: &[&str]) -> Option<Vec<u8>> {
    host.property(path).ok().flatten()
}

fn u64_property(host: &dyn Host, path: &[&str]) -> Option<u64> {
    let bytes = property(host, path)?;
    Some(u64::from_le_bytes(bytes.get(..8)?.try_into().ok()?))
}

fn text_property(host: &dyn Host, path: &[&str]) -> Option<String> {
    property(host, path).and_then(|b| String::from_utf8(b).ok())
}

/// The host of the last attempt.
fn upstream_property(host: &dyn Host) -> Option<SocketAddr> {
    text_property(host, &["upstream", "address"]).and_then(|a| a.parse().ok())
}

/// Counts where a retried request ended: on a listed alternate, or on a
/// host the fallback policy picked after every listed one failed.
fn count_retries(host: &dyn Host, finished: &Finished, hosts: &[SocketAddr]) {
    if finished.attempts.unwrap_or(1) <= 1 || hosts.is_empty() {
        return;
    }
    match finished.upstream.and_then(|u| hosts.iter().position(|h| *h == u)) {
        Some(0) => {}
        Some(_) => host.count(metrics::RETRIED_TO_ALTERNATE, 1),
        None => host.count(metrics::RETRIED_TO_FALLBACK, 1),
    }
}

/// The request ended: counts its retries and applies its outcomes to the
/// health record (when passive health is on). Envoy's properties are read
/// lazily: a request answered at the first attempt costs one read (the
/// attempts) with passive health off; with it on, two (and the status) when
/// the record was clean and the status is below 500 and not 429 (a success,
/// or Envoy's own answer: neither is written), else three (and the code
/// details); the upstream address only after a retry or when something is
/// written.
pub fn request_ended(config: &Config, host: &dyn Host, sent_to: &SentTo) {
    let attempts = u64_property(host, &["upstream", "request_attempt_count"])
        .unwrap_or(1)
        .max(1);
    if config.passive_health.is_none() {
        if attempts > 1 {
            let finished = Finished {
                upstream: upstream_property(host),
                attempts: Some(attempts),
                ..Finished::default()
            };
            count_retries(host, &finished, &sent_to.hosts);
        }
        return;
    }
    let status = u64_property(host, &["response", "code"]).filter(|c| *c != 0);
    // Below 500 and not 429 is a worker's success or Envoy's own answer
    // (which says nothing): on a clean record neither is written.
    let plain = status.is_some_and(|c| c < 500 && c != 429);
    if attempts == 1 && plain && sent_to.health_was_clean {
        return;
    }
    let details = text_property(host, &["response", "code_details"]);
    // The status only matters for the worker's own answers.
    let code = status.filter(|_| details.as_deref() == Some("via_upstream"));
    let last = classify(code, details.as_deref());
    let tells = match last {
        Outcome::Neutral => false,
        Outcome::Success => !sent_to.health_was_clean,
        Outcome::Failure | Outcome::Unreachable => true,
    };
    if attempts == 1 && !tells {
        return;
    }
    let finished = Finished {
        code,
        details,
        upstream: upstream_property(host),
        attempts: Some(attempts),
    };
    count_retries(host, &finished, &sent_to.hosts);
    let mut observed = outcomes(&finished, &sent_to.hosts, sent_to.rank);
    // A rank port stands for its worker.
    for (target, _) in &mut observed {
        target.worker = config.worker_address_of(target.worker);
    }
    record(
        config,
        host,
        &observed,
        sent_to.routed_at_ms,
        sent_to.health_was_clean,
    );
}

/// Applies `observed` (outcomes of one request routed at `routed_at_ms`) to
/// the shared health record under compare-and-swap, then counts and logs
/// what changed. `health_was_clean`: successes alone need no write.
pub fn record(
    config: &Config,
    host: &dyn Host,
    observed: &[(Target, Outcome)],
    routed_at_ms: u64,
    health_was_clean: bool,
) {
    let Some(policy) = &config.passive_health else {
        return;
    };
    let failures = observed
        .iter()
        .filter(|(_, o)| matches!(o, Outcome::Failure | Outcome::Unreachable));
    for (target, _) in failures.filter(|(t, _)| t.rank.is_none()) {
        if let Some(w) = worker_named(config, &target.worker) {
            host.count(&PerWorker::Failures.of(&w), 1);
        }
    }
    if observed.is_empty() || (health_was_clean && observed.iter().all(|(_, o)| *o == Outcome::Success)) {
        return;
    }
    let now = host.now_ms();
    let changes = shared_data::update_health(config, host, |health| {
        let changes: Vec<(Target, Change)> = observed
            .iter()
            .filter_map(|(t, o)| Some((*t, health.observe(policy, *t, *o, routed_at_ms, now)?)))
            .collect();
        (!changes.is_empty()).then_some(changes)
    });
    for (target, change) in changes.unwrap_or_default() {
        report_change(config, host, &target, change);
    }
}

/// The stat name of a configured worker.
fn worker_named(config: &Config, address: &SocketAddr) -> Option<String> {
    config
        .all_workers()
        .find(|w| w.address == *address)
        .map(|w| w.name.clone())
}

fn report_change(config: &Config, host: &dyn Host, target: &Target, change: Change) {
    let Some(name) = worker_named(config, &target.worker) else {
        return;
    };
    let what = match target.rank {
        None => format!("worker {}", target.worker),
        Some(r) => format!("rank {r} of worker {}", target.worker),
    };
    match change {
        Change::Ejected {
            cooldown_ms,
            ejections,
        } => {
            let kind = match target.rank {
                None => PerWorker::Ejections,
                Some(_) => PerWorker::RankEjections,
            };
            host.count(&kind.of(&name), 1);
            if target.rank.is_none() {
                host.gauge(&PerWorker::Health.of(&name), Standing::Ejected as u64);
            }
            log::warn!(
                "{what} leaves rotation for {cooldown_ms} ms after failing (ejection {ejections} in a row)"
            );
        }
        Change::Returned => {
            if target.rank.is_none() {
                host.gauge(&PerWorker::Health.of(&name), Standing::InRotation as u64);
            }
            log::info!("{what} answered its probe: back in rotation");
        }
        Change::Counted { .. } | Change::Cleared => {}
    }
}

/// A load poll of `worker` succeeded: a cooldown it serves for being
/// unreachable ends now.
pub fn poll_answered(config: &Config, host: &dyn Host, worker: SocketAddr) {
    if config.passive_health.is_none() {
        return;
    }
    let now = host.now_ms();
    let changed = shared_data::update_health(config, host, |health| {
        health.poll_answered(worker, now).then_some(())
    });
    if changed.is_some() {
        log::info!("worker {worker} answers its load poll again: probing it");
    }
}

/// A load poll of `worker` found nobody there: an ejected worker counts as
/// unreachable from now on, so its next good poll ends its cooldown (a
/// worker killed mid-stream was ejected for the streams it broke).
pub fn poll_unanswered(config: &Config, host: &dyn Host, worker: SocketAddr) {
    if config.passive_health.is_none() {
        return;
    }
    let now = host.now_ms();
    shared_data::update_health(config, host, |health| {
        health.poll_unanswered(worker, now).then_some(())
    });
}

/// Stores the hosts Envoy reports unhealthy among the configured workers;
/// logs the changes. Entries of workers no longer configured are dropped.
pub fn set_envoy_unhealthy(config: &Config, host: &dyn Host, mut unhealthy: Vec<SocketAddr>) {
    unhealthy.retain(|a| config.all_workers().any(|w| w.address == *a));
    unhealthy.sort();
    unhealthy.dedup();
    let now = host.now_ms();
    let known = |a: &SocketAddr| config.all_workers().any(|w| w.address == *a);
    let before = shared_data::update_health(config, host, |health| {
        let pruned = health.prune(config.passive_health.as_ref(), now, known);
        if health.envoy_unhealthy == unhealthy && !pruned {
            return None;
        }
        Some(std::mem::replace(&mut health.envoy_unhealthy, unhealthy.clone()))
    });
    let Some(before) = before else {
        return;
    };
    for a in unhealthy.iter().filter(|a| !before.contains(a)) {
        log::warn!("Envoy reports worker {a} unhealthy: out of rotation until it is healthy again");
    }
    for a in before.iter().filter(|a| !unhealthy.contains(a)) {
        log::info!("Envoy reports worker {a} healthy again");
    }
}

/// Once a poll round: drops entries nobody needs any more (so that a
/// healthy fleet's record is empty again) and sets every worker's
/// `health.<worker>` gauge (the end of a cooldown changes a standing
/// without any request).
pub fn poll_round(config: &Config, host: &dyn Host) {
    if !config.reads_health() {
        return;
    }
    let now = host.now_ms();
    let known = |a: &SocketAddr| config.all_workers().any(|w| w.address == *a);
    shared_data::update_health(config, host, |health| {
        health
            .prune(config.passive_health.as_ref(), now, known)
            .then_some(())
    });
    let health = shared_data::read_health(config, host);
    for w in config.all_workers() {
        host.gauge(
            &PerWorker::Health.of(&w.name),
            health.standing(w.address, now) as u64,
        );
    }
}
