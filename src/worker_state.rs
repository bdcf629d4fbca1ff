//! A worker's record in shared data: its last polled tokens per rank, plus
//! the estimates of requests this Envoy sent that no poll can have counted
//! yet, in buckets by the last dispatched poll (the accounting rule:
//! docs/architecture.md, "Concurrency rules"), and prefix affinity's
//! queued prefill, and what overload protection learns of each rank's
//! queue (`drain.rs`). `LoadTable` is their loads laid out for the scheduler.

/// Tokens value stored for a rank the report said nothing usable about.
const UNKNOWN: u64 = u64::MAX;
/// Requests the mean request estimate follows (a moving mean over about these).
const MEAN_SPAN: u64 = 64;
/// A request's estimate before any was routed to the worker: the tokens
/// header mode counts a request of unknown length.
pub const UNSIZED_REQUEST_TOKENS: u64 = crate::config::DEFAULT_COST_WITHOUT_LENGTH;

mod drain;
mod load_table;
mod prefill;
pub mod rank_value;
pub mod saturation;
pub mod slo;

use crate::codec::Record;
use crate::config::QueueMeasure;
use crate::load::RankLoad;
use crate::load::SourceMemory;
pub use drain::{DrainState, RankQueue};
pub use load_table::LoadTable;
pub use prefill::{Charge, PrefillState, PrefillTicket, RankFigures};
use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct WorkerState {
    /// Sequence number of the last poll dispatched to this worker.
    pub sent_seq: u64,
    /// Sequence number of the poll that produced `tokens` (0: none yet).
    pub snapshot_seq: u64,
    /// When that snapshot was received, ms since the epoch (0: never).
    pub snapshot_at_ms: u64,
    /// A request to this worker failed to connect: out of rotation until the next good poll.
    pub unreachable: bool,
    /// What the worker's load source keeps between polls (its own record,
    /// opaque here: `load/`).
    pub source: SourceMemory,
    /// This gateway's mean estimate of a request routed here, over about
    /// the last `MEAN_SPAN` requests (`request_tokens`), in 1/`MEAN_SPAN`
    /// tokens so that small steps are not lost to rounding.
    routed_mean: u64,
    /// Requests in that mean, up to `MEAN_SPAN`.
    routed_count: u64,
    /// Polled tokens per rank, `UNKNOWN` where the report had no usable figure.
    #[serde(with = "crate::codec::words")]
    tokens: Vec<u64>,
    /// Estimates of requests not yet covered by a snapshot, by poll bucket.
    pending: Vec<Pending>,
    /// Prefix affinity: queued prefill and the report's cache figures per rank.
    pub prefill: PrefillState,
    /// Overload protection: each rank's drain rate and KV use.
    pub drain: DrainState,
    /// SLO admission: what each rank's answers taught (`slo.rs`).
    pub slo: slo::SloState,
    /// How the worker numbers its ranks: `tokens[i]` is its rank
    /// `first_rank + i` (above 0 for a node of a multi-node deployment).
    pub first_rank: u32,
    /// What its answers taught about the rank value it reads.
    pub learned: rank_value::Learned,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
struct Pending {
    seq: u64,
    #[serde(with = "crate::codec::words")]
    tokens: Vec<u64>,
}

/// Kept at `<p>.w.<ip:port>` (`shared_data.rs`).
impl Record for WorkerState {
    const TAG: [u8; 4] = *b"DPWA";
    fn within_limits(&self) -> bool {
        WorkerState::within_limits(self)
    }
}

/// What a routed request must give back when it ends.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Ticket {
    pub worker: usize,
    pub rank: u32,
    pub seq: u64,
    pub cost: u64,
}

impl WorkerState {
    pub fn ranks(&self) -> usize {
        self.tokens.len()
    }

    pub fn is_fresh(&self, now_ms: u64, stale_after_ms: u64) -> bool {
        self.snapshot_seq > 0
            && !self.unreachable
            && now_ms.saturating_sub(self.snapshot_at_ms) <= stale_after_ms
    }

    pub fn polled_tokens(&self, rank: usize) -> Option<u64> {
        self.tokens.get(rank).copied().filter(|t| *t != UNKNOWN)
    }

    /// Polled tokens plus the pending estimates; None for an unknown rank.
    pub fn effective_tokens(&self, rank: usize) -> Option<u64> {
        let polled = self.polled_tokens(rank)?;
        let pending: u64 = self
            .pending
            .iter()
            .filter_map(|p| p.tokens.get(rank))
            .fold(0u64, |a, b| a.saturating_add(*b));
        Some(polled.saturating_add(pending))
    }

    /// Whether the sizes are within what dprank ever writes (a decoded value
    /// from elsewhere is refused).
    pub fn within_limits(&self) -> bool {
        let max = crate::config::MAX_DP_SIZE as usize;
        self.tokens.len() <= max
            && self.pending.len() <= max
            && self.pending.iter().all(|p| p.tokens.len() <= max)
            && self.prefill.within_limits(max)
            && self.drain.within_limits(max)
            && self.slo.within_limits(max)
            && self.source.within_limits(max)
    }

    /// This gateway's mean estimate of a request routed to the worker, in
    /// tokens (`UNSIZED_REQUEST_TOKENS` before the first): what a load
    /// source that counts requests without sizing them weighs each at.
    pub fn request_tokens(&self) -> u64 {
        match self.routed_count {
            0 => UNSIZED_REQUEST_TOKENS,
            _ => (self.routed_mean + MEAN_SPAN / 2) / MEAN_SPAN,
        }
    }

    /// Moves the mean request estimate toward a routed request's.
    fn note_request(&mut self, cost: u64) {
        self.routed_count = (self.routed_count + 1).min(MEAN_SPAN);
        let mean = self.routed_mean as f64;
        let cost = cost.min(u64::MAX / MEAN_SPAN / 2).saturating_mul(MEAN_SPAN) as f64;
        let moved = mean + ((cost - mean) / self.routed_count as f64).round();
        self.routed_mean = moved.max(0.0) as u64;
    }

    /// Estimates of requests a poll has not counted yet, on `rank`.
    pub fn pending_tokens(&self, rank: usize) -> u64 {
        self.pending
            .iter()
            .filter_map(|p| p.tokens.get(rank))
            .fold(0u64, |a, b| a.saturating_add(*b))
    }

    /// Pending estimate total (all ranks), for stats and tests.
    pub fn pending_total(&self) -> u64 {
        self.pending
            .iter()
            .flat_map(|p| p.tokens.iter())
            .fold(0u64, |a, b| a.saturating_add(*b))
    }

    /// Marks a poll as dispatched; returns its sequence number.
    pub fn begin_poll(&mut self) -> u64 {
        self.sent_seq += 1;
        self.sent_seq
    }

    /// Installs the result of poll `seq`. Older or repeated results are ignored
    /// (returns false): a slow response must not overwrite a newer one.
    pub fn apply_snapshot(&mut self, seq: u64, now_ms: u64, tokens: &[Option<u64>]) -> bool {
        if seq <= self.snapshot_seq || seq > self.sent_seq {
            return false;
        }
        self.snapshot_seq = seq;
        self.snapshot_at_ms = now_ms;
        self.unreachable = false;
        self.tokens = tokens
            .iter()
            .map(|t| t.map_or(UNKNOWN, |v| v.min(UNKNOWN - 1)))
            .collect();
        // Buckets keep estimates of ranks the report no longer lists (a worker
        // restarted smaller): their requests still end and give them back, and
        // nothing else can land there while the rank is gone.
        self.pending.retain(|p| p.seq >= seq);
        true
    }

    /// Records how the snapshot just installed numbers its ranks (the one
    /// before had `previous_ranks`). A change of layout (another first
    /// rank, another count) forgets that the worker was unpinned: its new
    /// layout is tried afresh. Returns the first rank before, when it changed.
    pub fn set_layout(&mut self, first_rank: u32, previous_ranks: usize) -> Option<u32> {
        let changed_first = (self.first_rank != first_rank).then_some(self.first_rank);
        let changed = changed_first.is_some() || previous_ranks != self.tokens.len();
        if changed && self.learned == rank_value::Learned::Unpinned {
            self.learned = rank_value::Learned::Nothing;
        }
        self.first_rank = first_rank;
        changed_first
    }

    /// Leaves out every rank from `ranks` up (the worker said it has no
    /// more), until the next snapshot. Their pending estimates stay, to be
    /// given back when their requests end.
    pub fn keep_ranks(&mut self, ranks: usize) {
        self.tokens.truncate(ranks);
        self.slo.keep_ranks(ranks);
    }

    /// Makes the worker stale until its next successful poll.
    pub fn mark_unreachable(&mut self) {
        self.unreachable = true;
    }

    /// Adds a routed request's estimate; returns the ticket to release it with.
    pub fn add(&mut self, worker: usize, rank: u32, cost: u64) -> Option<Ticket> {
        let ranks = self.tokens.len();
        let index = rank as usize;
        if index >= ranks {
            return None;
        }
        let seq = self.sent_seq;
        let bucket = match self.pending.iter().position(|p| p.seq == seq) {
            Some(i) => self.pending.get_mut(i)?,
            None => {
                self.pending.push(Pending {
                    seq,
                    tokens: vec![0; ranks],
                });
                self.pending.last_mut()?
            }
        };
        if bucket.tokens.len() < ranks {
            bucket.tokens.resize(ranks, 0);
        }
        let slot = bucket.tokens.get_mut(index)?;
        *slot = slot.saturating_add(cost);
        self.note_request(cost);
        Some(Ticket {
            worker,
            rank,
            seq,
            cost,
        })
    }

    /// Prefix affinity: charges a routed request's prefill to its rank (in
    /// the same write as its estimate).
    pub fn charge_prefill(
        &mut self,
        worker: usize,
        rank: u32,
        charge: Charge,
        streamed: bool,
    ) -> Option<PrefillTicket> {
        if rank as usize >= self.tokens.len() {
            return None;
        }
        self.drain.charged(rank as usize, charge.uncached());
        self.prefill.charge(self.sent_seq, worker, rank, charge, streamed)
    }

    /// Prefix affinity: the request's prefill is over (first byte, or its end).
    pub fn prefill_started(&mut self, ticket: &PrefillTicket) {
        self.prefill.started(self.sent_seq, ticket);
    }

    /// Installs the prefix figures of snapshot `seq`, once `apply_snapshot`
    /// has accepted it.
    pub fn apply_figures(&mut self, seq: u64, figures: &[RankFigures]) {
        if seq == self.snapshot_seq {
            self.prefill.on_snapshot(seq, figures);
        }
    }

    /// Overload protection: what the report `ranks` of a snapshot taken
    /// `elapsed_ms` after the previous one (0: none) teaches about each
    /// rank's queue; before `apply_figures` replaces the previous figures.
    pub fn apply_drain(&mut self, elapsed_ms: u64, ranks: &[RankLoad], gateways: u32) {
        let before: Vec<u64> = (0..ranks.len())
            .map(|r| self.prefill.polled_waiting(r).tokens)
            .collect();
        self.drain.on_snapshot(elapsed_ms, &before, ranks, gateways);
    }

    /// Overload protection's view of `rank`'s queue: the larger of the
    /// polled and the local measure (`worker_state/prefill.rs`), in
    /// tokens when the rank's reports count them, and its drain rate
    /// (`prior` tokens/s, plus what was learned if `learn`).
    pub fn rank_queue(&self, rank: usize, prior: f64, learn: bool) -> RankQueue {
        let queued = self.prefill.queued(rank, QueueMeasure::Max);
        RankQueue {
            tokens: self.drain.tokens_reported(rank).then_some(queued.tokens),
            requests: queued.requests,
            mean_request_tokens: self.drain.mean_request_tokens(rank),
            kv_usage: self.drain.kv_usage(rank),
            in_flight: self
                .prefill
                .running(rank)
                .map(|r| r.saturating_add(queued.requests)),
            drain_tokens_per_s: self.drain.rate(rank, prior, learn),
            learned: self.slo.learned(rank, self.ranks(), self.snapshot_at_ms),
        }
    }

    /// Whether a snapshot has counted the ticket's request, which took its
    /// estimate out: from this state and from every later one, since
    /// snapshots only move forward.
    pub fn counted_by_snapshot(&self, ticket: &Ticket) -> bool {
        ticket.seq < self.snapshot_seq
    }

    /// Removes an ended request's estimate if no snapshot has covered it
    /// yet; false when there was nothing to remove.
    pub fn release(&mut self, ticket: &Ticket) -> bool {
        let Some(i) = self.pending.iter().position(|p| p.seq == ticket.seq) else {
            return false;
        };
        let empty = match self.pending.get_mut(i) {
            Some(p) => {
                if let Some(slot) = p.tokens.get_mut(ticket.rank as usize) {
                    *slot = slot.saturating_sub(ticket.cost);
                }
                p.tokens.iter().all(|t| *t == 0)
            }
            None => false,
        };
        if empty {
            self.pending.remove(i);
        }
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn polled(tokens: &[u64]) -> WorkerState {
        let mut w = WorkerState::default();
        let seq = w.begin_poll();
        assert!(w.apply_snapshot(seq, 1000, &tokens.iter().map(|t| Some(*t)).collect::<Vec<_>>()));
        w
    }

    #[test]
    fn estimates_add_until_a_later_poll_covers_them() {
        let mut w = polled(&[100, 100]);
        w.add(0, 1, 50).unwrap();
        assert_eq!(w.effective_tokens(1), Some(150));
        // This poll left after the request: its figures include it.
        let seq = w.begin_poll();
        assert_eq!(w.effective_tokens(1), Some(150), "dispatch alone changes nothing");
        w.apply_snapshot(seq, 2000, &[Some(100), Some(148)]);
        assert_eq!(w.effective_tokens(1), Some(148), "not counted twice");
        assert_eq!(w.pending_total(), 0);
    }

    #[test]
    fn requests_after_a_dispatched_poll_survive_its_snapshot() {
        let mut w = polled(&[0]);
        let seq = w.begin_poll();
        let t = w.add(0, 0, 30).unwrap();
        assert_eq!(t.seq, seq);
        w.apply_snapshot(seq, 2000, &[Some(5)]);
        assert_eq!(w.effective_tokens(0), Some(35), "the poll may have missed it");
    }

    #[test]
    fn release_removes_an_uncovered_estimate() {
        let mut w = polled(&[10, 10]);
        let t = w.add(0, 0, 7).unwrap();
        w.release(&t);
        assert_eq!(w.effective_tokens(0), Some(10));
        assert_eq!(w.pending_total(), 0);
    }

    #[test]
    fn release_after_coverage_changes_nothing() {
        let mut w = polled(&[10]);
        let t = w.add(0, 0, 7).unwrap();
        let t2_seq = w.begin_poll();
        let t2 = w.add(0, 0, 3).unwrap();
        w.apply_snapshot(t2_seq, 2000, &[Some(17)]);
        assert!(w.counted_by_snapshot(&t) && !w.counted_by_snapshot(&t2));
        assert!(!w.release(&t), "covered: nothing to give back");
        assert_eq!(w.effective_tokens(0), Some(20));
        assert!(w.release(&t2));
        assert_eq!(w.effective_tokens(0), Some(17));
    }

    #[test]
    fn failed_polls_keep_estimates_until_requests_end() {
        let mut w = polled(&[0]);
        let mut tickets = vec![];
        for _ in 0..3 {
            w.begin_poll(); // never answered
            tickets.push(w.add(0, 0, 10).unwrap());
        }
        assert_eq!(w.effective_tokens(0), Some(30));
        for t in &tickets {
            w.release(t);
        }
        assert_eq!(w.effective_tokens(0), Some(0));
    }

    #[test]
    fn stale_and_duplicate_snapshots_are_ignored() {
        let mut w = polled(&[1]);
        let old = w.begin_poll();
        let new = w.begin_poll();
        assert!(w.apply_snapshot(new, 3000, &[Some(9)]));
        assert!(!w.apply_snapshot(old, 3100, &[Some(1)]));
        assert!(!w.apply_snapshot(new, 3100, &[Some(1)]));
        assert!(!w.apply_snapshot(new + 5, 3100, &[Some(1)]), "never dispatched");
        assert_eq!(w.polled_tokens(0), Some(9));
    }

    #[test]
    fn unreachable_until_the_next_good_poll() {
        let mut w = polled(&[1]);
        w.mark_unreachable();
        assert!(!w.is_fresh(1000, 3000));
        let seq = w.begin_poll();
        w.apply_snapshot(seq, 2000, &[Some(1)]);
        assert!(w.is_fresh(2000, 3000));
    }

    #[test]
    fn freshness_follows_the_stale_limit() {
        let w = polled(&[1]);
        assert!(w.is_fresh(1000 + 3000, 3000));
        assert!(!w.is_fresh(1000 + 3001, 3000));
        assert!(!WorkerState::default().is_fresh(0, 3000));
    }

    #[test]
    fn unknown_ranks_and_out_of_range_adds() {
        let mut w = WorkerState::default();
        let seq = w.begin_poll();
        w.apply_snapshot(seq, 1, &[None, Some(4)]);
        assert_eq!(w.effective_tokens(0), None);
        assert_eq!(w.effective_tokens(1), Some(4));
        assert_eq!(w.add(0, 2, 1), None);
        assert_eq!(w.effective_tokens(9), None);
    }

    #[test]
    fn the_mean_request_estimate_follows_the_routed_requests() {
        let mut w = polled(&[0, 0]);
        assert_eq!(w.request_tokens(), UNSIZED_REQUEST_TOKENS, "nothing routed yet");
        w.add(0, 0, 100).unwrap();
        assert_eq!(w.request_tokens(), 100);
        w.add(0, 1, 300).unwrap();
        assert_eq!(w.request_tokens(), 200);
        assert_eq!(
            w.add(0, 5, 1_000_000),
            None,
            "a request not added counts for nothing"
        );
        for _ in 0..1000 {
            w.add(0, 0, 10).unwrap();
        }
        assert_eq!(w.request_tokens(), 10, "older requests fade");
        w.add(0, 0, 74).unwrap();
        assert_eq!(
            w.request_tokens(),
            11,
            "one request moves it by a 64th of the gap"
        );
        w.add(0, 0, u64::MAX).unwrap();
        assert!(w.request_tokens() > u64::MAX / 64 / 128, "no overflow");
    }

    #[test]
    fn a_smaller_report_keeps_estimates_of_requests_still_running() {
        let mut w = polled(&[0, 0, 0, 0]);
        w.begin_poll();
        let on_rank_3 = w.add(0, 3, 10).unwrap();
        let on_rank_0 = w.add(0, 0, 10).unwrap();
        let seq = w.sent_seq;
        w.apply_snapshot(seq, 2000, &[Some(1), Some(2)]);
        assert_eq!(w.ranks(), 2);
        assert_eq!(w.effective_tokens(0), Some(11));
        assert_eq!(w.add(0, 3, 5), None, "rank 3 is gone");
        // The fleet grows back; a new request on rank 3 shares the bucket.
        w.apply_snapshot(seq, 3000, &[Some(1), Some(2), Some(0), Some(0)]);
        assert!(!w.apply_snapshot(seq, 3000, &[]), "same sequence: ignored");
        let seq = w.begin_poll();
        w.apply_snapshot(seq, 3000, &[Some(0), Some(0), Some(0), Some(0)]);
        let newer = w.add(0, 3, 7).unwrap();
        w.release(&on_rank_3);
        w.release(&on_rank_0);
        assert_eq!(
            w.effective_tokens(3),
            Some(7),
            "an old ticket never takes a new estimate"
        );
        w.release(&newer);
        assert_eq!(w.pending_total(), 0);
    }
}
