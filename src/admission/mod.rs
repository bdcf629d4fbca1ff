//! Admission control (docs/overload.md): a request let in now, held until a
//! rank has room, or refused. One call decides, [`Controller::admit`]; the
//! policies behind it are the interfaces here, each implemented in a file
//! of its own (the saturation detector, per-class limits, fairness among
//! tenants, the order within a line). The request lifecycle acts on the
//! [`Verdict`]. docs/architecture.md shows the whole and how to add a policy.

mod controller;
pub mod fairness;
pub mod held_record;
pub mod limits;
pub mod ordering;
pub mod queue;
mod refusal;
pub mod saturation;

pub use controller::Controller;
pub use refusal::{Refusal, ADMISSION_HEADER, MAX_RETRY_AFTER_S};
pub use saturation::Judgement;

use crate::config::Admission as Settings;
use crate::headers::HeaderMap;
use crate::worker_state::saturation::Limits;
use crate::worker_state::RankQueue;
use std::collections::VecDeque;

/// Judges a pool (the Inference Extension's `SaturationDetector`): whether
/// one more request finds a candidate rank with room, and how far past its
/// limit each rank is.
pub trait SaturationDetector {
    /// The pool of `candidates` (the queues of the ranks the request could
    /// be sent to) under `limits`: room as soon as one rank has it.
    fn judge(&self, candidates: impl IntoIterator<Item = RankQueue>, limits: &Limits) -> Judgement;

    /// Whether one rank has no room under `limits`.
    fn is_saturated(&self, rank: &RankQueue, limits: &Limits) -> bool;
}

/// The limits a request of each class finds a rank saturated at (the
/// Inference Extension's `UsageLimitPolicy`: lower classes stop short of
/// where higher ones still go, keeping room for them).
pub trait UsageLimitPolicy {
    /// The limits of class `class` (an index in the configured classes).
    fn limits(&self, class: usize) -> Limits;
}

/// Fairness among the tenants of one class (the Inference Extension's
/// `FairnessPolicy`): a class's lines are served front first, one request
/// at a time; the policy says where a served line goes next.
pub trait FairnessPolicy {
    /// Puts back `served`, a line that was served and still holds requests.
    fn requeue<T>(&self, lines: &mut VecDeque<Line<T>>, served: Line<T>);
}

/// The order within one tenant's line (the Inference Extension's
/// `OrderingPolicy`): its front goes first.
pub trait OrderingPolicy {
    /// Whether `a` goes before `b`.
    fn before<T>(&self, a: &Waiting<T>, b: &Waiting<T>) -> bool;
}

/// Who asks to be let in: a request's class and tenant, read from its
/// headers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Applicant {
    /// Index in the configured classes, 0 the highest.
    pub class: usize,
    /// A hash of the tenant header's value (0: none).
    pub tenant: u64,
}

impl Applicant {
    /// The class the priority header names (else the default class) and
    /// the tenant the tenant header names.
    pub fn of(settings: &Settings, headers: &HeaderMap) -> Applicant {
        Applicant {
            class: settings.class_of(headers.get(&settings.priority_header)),
            tenant: settings
                .tenant_header
                .as_ref()
                .and_then(|h| headers.get_bytes(h))
                .map_or(0, tenant_key),
        }
    }
}

/// The queue's key for a tenant header value (0 is "no tenant").
fn tenant_key(value: &[u8]) -> u64 {
    xxhash_rust::xxh3::xxh3_64(value).max(1)
}

/// Every candidate rank of the judged pool is saturated: the request is
/// not let in now.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Overloaded {
    /// How long until the least saturated rank has room, as far as known.
    pub retry_after_ms: u64,
    /// Candidate ranks judged (all saturated).
    pub saturated_ranks: u32,
}

/// What admission decided for a request whose routing decided `D`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Verdict<D> {
    /// Let in: what routing decided.
    Admitted(D),
    /// Answered now, coming back after `retry_after_ms`.
    Refused { refusal: Refusal, retry_after_ms: u64 },
    /// Queue mode: held until a rank has room; `retry_after_ms` is what
    /// the fleet said (0: not asked, others wait already).
    Held { retry_after_ms: u64 },
}

/// A held request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Waiting<T> {
    /// The request's context id (unique per thread).
    pub id: u32,
    /// Index in the configured classes, 0 the highest.
    pub class: usize,
    /// A hash of the tenant header's value (0: none).
    pub tenant: u64,
    /// When it started waiting (ms).
    pub since_ms: u64,
    /// Arrival order, to tell the newest among equal times.
    pub seq: u64,
    pub payload: T,
}

/// A tenant's line in a class: its requests, the next first.
#[derive(Debug)]
pub struct Line<T> {
    tenant: u64,
    waiting: VecDeque<Waiting<T>>,
}

impl<T> Line<T> {
    /// The tenant whose line it is.
    pub fn tenant(&self) -> u64 {
        self.tenant
    }

    /// Requests in the line.
    pub fn len(&self) -> usize {
        self.waiting.len()
    }

    pub fn is_empty(&self) -> bool {
        self.waiting.is_empty()
    }
}
