//! Worker health: passive health's state machine per worker and per
//! (worker, rank) target, what a finished request's outcome says about
//! them, and Envoy's own view (hosts it reports unhealthy). Kept in one
//! shared record listing only targets that are not plainly healthy; the
//! rules and why are in docs/architecture.md ("Passive health").

use crate::codec::Record;
use crate::config::PassiveHealth;
use serde::{Deserialize, Serialize};
use std::net::SocketAddr;

/// How a finished request went, for one target.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// The worker answered: 1xx-4xx except 429.
    Success,
    /// A rank answered 5xx, broke its stream, or timed out.
    Failure,
    /// The worker could not be reached: connection refused or failed, or
    /// reset before any answer. No rank saw the request.
    Unreachable,
    /// Says nothing about the worker: 429, the client left, Envoy's own
    /// limits, no upstream at all.
    Neutral,
}

impl Outcome {
    fn is_failure(self) -> bool {
        matches!(self, Outcome::Failure | Outcome::Unreachable)
    }
}

/// A worker, or one rank of it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Target {
    pub worker: SocketAddr,
    pub rank: Option<u32>,
}

/// The passive state of one target that is not plainly healthy.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Entry {
    pub target: Target,
    /// Failures in a row in the current healthy phase.
    pub failures: u32,
    /// Ejections in a row: the last cooldown was `cooldown_ms * 2^(ejections-1)`.
    pub ejections: u32,
    /// When it was ejected; 0 while in rotation.
    pub ejected_at_ms: u64,
    /// When the cooldown ends and probing starts.
    pub probe_from_ms: u64,
    /// When it last returned to rotation (0: never ejected).
    pub returned_at_ms: u64,
    /// The last failure counted was `Unreachable`: a poll that reaches the
    /// worker ends its cooldown.
    pub unreachable: bool,
}

/// Where a target stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Phase {
    Healthy,
    Ejected { until_ms: u64 },
    Probing,
}

/// What applying an outcome did, for stats and logs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Change {
    /// A failure was counted; the target stays in rotation.
    Counted { failures: u32 },
    /// The target left rotation for `cooldown_ms` (`ejections` in a row).
    Ejected { cooldown_ms: u64, ejections: u32 },
    /// A probe succeeded: back in rotation.
    Returned,
    /// A success cleared earlier failures.
    Cleared,
}

impl Entry {
    fn new(target: Target) -> Entry {
        Entry {
            target,
            failures: 0,
            ejections: 0,
            ejected_at_ms: 0,
            probe_from_ms: 0,
            returned_at_ms: 0,
            unreachable: false,
        }
    }

    pub fn phase(&self, now_ms: u64) -> Phase {
        if self.ejected_at_ms == 0 {
            Phase::Healthy
        } else if now_ms < self.probe_from_ms {
            Phase::Ejected {
                until_ms: self.probe_from_ms,
            }
        } else {
            Phase::Probing
        }
    }

    /// When the current phase began: outcomes of requests routed earlier do not count.
    fn phase_start(&self, now_ms: u64) -> u64 {
        match self.phase(now_ms) {
            Phase::Healthy => self.returned_at_ms,
            Phase::Ejected { .. } => self.ejected_at_ms,
            Phase::Probing => self.probe_from_ms,
        }
    }

    /// Whether a request may be sent to this target now.
    fn admits(&self, now_ms: u64, admit_probing: bool) -> bool {
        match self.phase(now_ms) {
            Phase::Healthy => true,
            Phase::Ejected { .. } => false,
            Phase::Probing => admit_probing,
        }
    }

    fn eject(&mut self, policy: &PassiveHealth, now_ms: u64) -> Change {
        // A long healthy spell forgives earlier ejections.
        if self.ejected_at_ms == 0 && now_ms.saturating_sub(self.returned_at_ms) >= policy.max_cooldown_ms {
            self.ejections = 0;
        }
        self.ejections = self.ejections.saturating_add(1);
        let cooldown_ms = cooldown(policy, self.ejections);
        self.failures = 0;
        self.ejected_at_ms = now_ms.max(1);
        self.probe_from_ms = now_ms.saturating_add(cooldown_ms);
        Change::Ejected {
            cooldown_ms,
            ejections: self.ejections,
        }
    }

    /// Applies the outcome of a request routed at `routed_at_ms`; None when
    /// nothing changed.
    fn observe(
        &mut self,
        policy: &PassiveHealth,
        outcome: Outcome,
        routed_at_ms: u64,
        now_ms: u64,
    ) -> Option<Change> {
        if outcome == Outcome::Neutral || routed_at_ms < self.phase_start(now_ms) {
            return None;
        }
        let phase = self.phase(now_ms);
        if outcome.is_failure() && !matches!(phase, Phase::Ejected { .. }) {
            self.unreachable = outcome == Outcome::Unreachable;
        }
        match (phase, outcome.is_failure()) {
            (Phase::Healthy, true) => {
                self.failures = self.failures.saturating_add(1);
                if self.failures >= policy.consecutive_failures {
                    Some(self.eject(policy, now_ms))
                } else {
                    Some(Change::Counted {
                        failures: self.failures,
                    })
                }
            }
            (Phase::Healthy, false) if self.failures > 0 => {
                self.failures = 0;
                Some(Change::Cleared)
            }
            (Phase::Probing, true) => Some(self.eject(policy, now_ms)),
            (Phase::Probing, false) => {
                self.ejected_at_ms = 0;
                self.probe_from_ms = 0;
                self.failures = 0;
                self.returned_at_ms = now_ms;
                Some(Change::Returned)
            }
            _ => None,
        }
    }

    /// Plainly healthy again: no failures counted, and any ejection forgiven.
    fn forgotten(&self, policy: &PassiveHealth, now_ms: u64) -> bool {
        self.ejected_at_ms == 0
            && self.failures == 0
            && (self.ejections == 0 || now_ms.saturating_sub(self.returned_at_ms) >= policy.max_cooldown_ms)
    }
}

/// The cooldown of the `ejections`-th ejection in a row: doubling, capped.
pub fn cooldown(policy: &PassiveHealth, ejections: u32) -> u64 {
    let doublings = ejections.saturating_sub(1).min(63);
    policy
        .cooldown_ms
        .saturating_mul(1u64 << doublings)
        .min(policy.max_cooldown_ms)
}

/// The health record of one configuration, in shared data (`shared_data.rs`).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Health {
    /// Targets that are not plainly healthy (failures counted, ejected,
    /// probing, or recently returned); the rest have no entry.
    pub entries: Vec<Entry>,
    /// Workers Envoy reports unhealthy (active health check, outlier
    /// detection, EDS status), sorted; kept out of every choice.
    pub envoy_unhealthy: Vec<SocketAddr>,
}

/// Kept at `<p>.health` (`shared_data.rs`).
impl Record for Health {
    const TAG: [u8; 4] = *b"DPH1";
    fn within_limits(&self) -> bool {
        Health::within_limits(self)
    }
}

/// A record with nothing in it (every worker in rotation).
pub static NO_HEALTH: Health = Health {
    entries: Vec::new(),
    envoy_unhealthy: Vec::new(),
};

/// A worker's standing, as its `health.<worker>` gauge shows it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Standing {
    InRotation = 0,
    Probing = 1,
    Ejected = 2,
    EnvoyUnhealthy = 3,
}

/// Most entries a record may hold (a bound on what decoding accepts).
pub const MAX_ENTRIES: usize = 65_536;

impl Health {
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty() && self.envoy_unhealthy.is_empty()
    }

    pub fn within_limits(&self) -> bool {
        self.entries.len() <= MAX_ENTRIES && self.envoy_unhealthy.len() <= MAX_ENTRIES
    }

    pub fn entry(&self, target: &Target) -> Option<&Entry> {
        self.entries.iter().find(|e| e.target == *target)
    }

    /// Whether some target is probing: only then does a request need to
    /// decide whether it is a probe.
    pub fn any_probing(&self, now_ms: u64) -> bool {
        self.entries.iter().any(|e| e.phase(now_ms) == Phase::Probing)
    }

    /// Whether `worker` may be chosen now (a probe only if `admit_probing`):
    /// None when not at all, else the ranks of it that may not be.
    pub fn admitted(
        &self,
        worker: SocketAddr,
        now_ms: u64,
        admit_probing: bool,
    ) -> Option<impl Iterator<Item = u32> + '_> {
        let closed = move |e: &&Entry| e.target.worker == worker && !e.admits(now_ms, admit_probing);
        let whole_out = self.envoy_unhealthy.contains(&worker)
            || self
                .entries
                .iter()
                .filter(closed)
                .any(|e| e.target.rank.is_none());
        (!whole_out).then(|| self.entries.iter().filter(closed).filter_map(|e| e.target.rank))
    }

    /// A worker's standing for its gauge (its ranks are not shown there).
    pub fn standing(&self, worker: SocketAddr, now_ms: u64) -> Standing {
        if self.envoy_unhealthy.contains(&worker) {
            return Standing::EnvoyUnhealthy;
        }
        let whole = Target { worker, rank: None };
        match self.entry(&whole).map(|e| e.phase(now_ms)) {
            Some(Phase::Ejected { .. }) => Standing::Ejected,
            Some(Phase::Probing) => Standing::Probing,
            _ => Standing::InRotation,
        }
    }

    /// A load poll of `worker` found nobody there (no answer, or a proxy's
    /// 502-504) while it is out of rotation: it is unreachable now, whatever
    /// ejected it. True if that changed.
    pub fn poll_unanswered(&mut self, worker: SocketAddr, now_ms: u64) -> bool {
        let whole = Target { worker, rank: None };
        match self.entries.iter_mut().find(|e| e.target == whole) {
            Some(e) if !e.unreachable && e.phase(now_ms) != Phase::Healthy => {
                e.unreachable = true;
                true
            }
            _ => false,
        }
    }

    /// A load poll reached `worker`: if it was ejected for being
    /// unreachable, its cooldown ends now (it is probed). True if it changed.
    pub fn poll_answered(&mut self, worker: SocketAddr, now_ms: u64) -> bool {
        let whole = Target { worker, rank: None };
        match self.entries.iter_mut().find(|e| e.target == whole) {
            Some(e) if e.unreachable && matches!(e.phase(now_ms), Phase::Ejected { .. }) => {
                e.probe_from_ms = now_ms;
                true
            }
            _ => false,
        }
    }

    /// Applies an outcome to a target; None when nothing changed.
    pub fn observe(
        &mut self,
        policy: &PassiveHealth,
        target: Target,
        outcome: Outcome,
        routed_at_ms: u64,
        now_ms: u64,
    ) -> Option<Change> {
        match self.entries.iter().position(|e| e.target == target) {
            Some(i) => {
                let entry = self.entries.get_mut(i)?;
                let change = entry.observe(policy, outcome, routed_at_ms, now_ms);
                if change.is_some() && entry.forgotten(policy, now_ms) {
                    self.entries.remove(i);
                }
                change
            }
            None if outcome.is_failure() => {
                let mut entry = Entry::new(target);
                let change = entry.observe(policy, outcome, routed_at_ms, now_ms);
                self.entries.push(entry);
                change
            }
            None => None,
        }
    }

    /// Drops entries nobody needs any more: of workers no longer configured,
    /// and healthy ones whose ejections are forgiven. True if any went.
    pub fn prune(
        &mut self,
        policy: Option<&PassiveHealth>,
        now_ms: u64,
        known: impl Fn(&SocketAddr) -> bool,
    ) -> bool {
        let before = self.entries.len();
        self.entries
            .retain(|e| known(&e.target.worker) && policy.is_some_and(|p| !e.forgotten(p, now_ms)));
        self.entries.len() != before
    }
}

/// Whether the request with this tie breaker is one of the `share` of
/// requests that may probe (a hash of the per-request tie breaker, so no
/// host call is needed).
pub fn is_probe(share: f64, tie_breaker: u64) -> bool {
    let mut z = tie_breaker ^ 0xD1B5_4A32_D192_ED03;
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^= z >> 31;
    ((z >> 11) as f64) < share * (1u64 << 53) as f64
}

/// What Envoy reports about a finished request (properties read when it is logged).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Finished {
    /// `response.code`; None or 0 when nothing was answered.
    pub code: Option<u64>,
    /// `response.code_details`: `via_upstream` for a worker's own answer,
    /// otherwise why Envoy answered itself.
    pub details: Option<String>,
    /// `upstream.address`: the host of the last attempt.
    pub upstream: Option<SocketAddr>,
    /// `upstream.request_attempt_count`: attempts made, retries included.
    pub attempts: Option<u64>,
}

/// How the last attempt went, from the status and Envoy's code details.
pub fn classify(code: Option<u64>, details: Option<&str>) -> Outcome {
    let details = details.unwrap_or_default();
    if details == "via_upstream" {
        return match code {
            Some(429) | None => Outcome::Neutral,
            Some(500..=599) => Outcome::Failure,
            Some(_) => Outcome::Success,
        };
    }
    // `upstream_reset_{before,after}_response_started{<reason>[,<transport failure>]}`:
    // the worker refused, dropped or broke the stream, except when Envoy
    // itself reset it (the client left) or its circuit breaker overflowed.
    let worker_reset = |prefix: &str| {
        details
            .strip_prefix(prefix)
            .map(|reason| !reason.contains("local_reset") && !reason.contains("overflow"))
    };
    match (
        worker_reset("upstream_reset_before_response_started"),
        worker_reset("upstream_reset_after_response_started"),
    ) {
        (Some(true), _) => Outcome::Unreachable,
        (_, Some(true)) => Outcome::Failure,
        (Some(false), _) | (_, Some(false)) => Outcome::Neutral,
        _ if details.starts_with("upstream_response_timeout") || details.starts_with("upstream_per_try") => {
            Outcome::Failure
        }
        _ => Outcome::Neutral,
    }
}

/// The targets an outcome counts for: the worker, and the rank that
/// answered unless the worker could not be reached.
pub fn targets(worker: SocketAddr, rank: Option<u32>, outcome: Outcome) -> Vec<(Target, Outcome)> {
    let mut out = vec![(Target { worker, rank: None }, outcome)];
    if let (Some(rank), false) = (rank, outcome == Outcome::Unreachable) {
        out.push((
            Target {
                worker,
                rank: Some(rank),
            },
            outcome,
        ));
    }
    out
}

/// The outcomes one finished request gives, by target. `hosts` is the list
/// dprank sent in the route header (first the chosen worker, then the
/// alternates Envoy retries on, in order); `rank` the rank in the body.
/// Each attempt before the last went to the next listed host and failed
/// (the route retries only failures); the last attempt's host is
/// `upstream`, wherever it is, listed or picked by the fallback policy.
pub fn outcomes(finished: &Finished, hosts: &[SocketAddr], rank: Option<u32>) -> Vec<(Target, Outcome)> {
    let attempts = finished.attempts.unwrap_or(1).max(1);
    let last = finished.upstream;
    let earlier = match last.and_then(|u| hosts.iter().position(|h| *h == u)) {
        Some(at) => at,
        None => (attempts as usize - 1).min(hosts.len()),
    };
    // The shipped route retries only when the worker never answered.
    let mut out: Vec<(Target, Outcome)> = hosts
        .iter()
        .take(earlier)
        .map(|h| {
            (
                Target {
                    worker: *h,
                    rank: None,
                },
                Outcome::Unreachable,
            )
        })
        .collect();
    if let Some(worker) = last {
        let outcome = classify(finished.code, finished.details.as_deref());
        if outcome != Outcome::Neutral {
            out.extend(targets(worker, rank, outcome));
        }
    }
    out
}

#[cfg(test)]
mod tests;
