//! What a load poll's answer does to the shared states: a good report
//! becomes the worker's snapshot (trimmed to a configured `dp_size`, its
//! layout, drain rate and figures, the cache feedback to its prefix index,
//! the gauges), in one write; a report whose ranks make no sense is refused
//! and counted.

use crate::config::{Config, Worker};
use crate::host::Host;
use crate::load::{Reading, ReportContext};
use crate::metrics::{self, PerWorker};
use crate::prefix::index::IndexRecord;
use crate::shared_data::{self, IfMissing};
use crate::worker_state::RankFigures;

/// A report whose ranks are not one run S..S+N-1: counted, not applied (the
/// last good snapshot stays until it goes stale), and logged once per worker
/// until a good report comes, whichever VM polls.
pub(super) fn refuse(config: &Config, host: &dyn Host, w: &Worker, why: &str) {
    host.count(&PerWorker::ReportRefused.of(&w.name), 1);
    if shared_data::set_refused(config, host, w.address, true) {
        log::warn!(
            "refusing the load reports of {}: its ranks are not one run S..S+N-1 ({why}); keeping its last good snapshot until it is stale",
            w.endpoint()
        );
    }
}

/// Stores a good report as worker `index`'s snapshot (poll `seq`), trimmed
/// to a configured `dp_size`, and publishes its figures. The report is
/// worked out in the same write, with what the source remembers of the
/// worker and this gateway's mean request (`Reading::report`). Under prefix
/// affinity, ranks reporting far fewer cache hits than their index
/// expected lose part of their index.
pub(super) fn apply_report(
    config: &Config,
    host: &dyn Host,
    index: usize,
    w: &Worker,
    seq: u64,
    reading: &Reading,
) {
    let now = host.now_ms();
    let applied = shared_data::update_worker(config, host, index, IfMissing::Create, |state| {
        let context = ReportContext {
            now_ms: now,
            request_tokens: state.request_tokens(),
        };
        let report = reading.report(&mut state.source, &context);
        let first_rank = report.first_rank;
        let mut ranks = report.ranks;
        let reported = ranks.len();
        let (previous_ranks, had_snapshot) = (state.ranks(), state.snapshot_seq > 0);
        if let Some(dp) = w.dp_size {
            ranks.truncate(dp as usize);
        }
        let elapsed = match state.snapshot_seq {
            0 => 0,
            _ => now.saturating_sub(state.snapshot_at_ms),
        };
        let tokens: Vec<Option<u64>> = ranks.iter().map(|r| r.tokens).collect();
        if !state.apply_snapshot(seq, now, &tokens) {
            return None;
        }
        let moved = state
            .set_layout(first_rank, previous_ranks)
            .filter(|_| had_snapshot)
            .map(|before| (before, first_rank));
        if config.admission.is_some() {
            state.apply_drain(elapsed, &ranks, config.gateways);
        }
        let figures: Vec<RankFigures> = ranks.iter().map(RankFigures::from).collect();
        state.apply_figures(seq, &figures);
        let shrink = match config.prefix {
            Some(_) => state.prefill.cache_feedback(config.poll_interval_ms),
            None => Vec::new(),
        };
        Some((tokens, shrink, reported, first_rank, moved))
    });
    let Some((tokens, shrink, reported, first_rank, moved)) = applied else {
        // An answer older than the snapshot in place: answered, not applied.
        host.count(&PerWorker::PollOk.of(&w.name), 1);
        return;
    };
    if let Some(dp) = w.dp_size.filter(|dp| *dp as usize != reported) {
        host.count(&PerWorker::DpSizeMismatch.of(&w.name), 1);
        log::warn!(
            "{} reports {reported} ranks but dp_size is {dp}; using ranks below {dp}",
            w.endpoint()
        );
    }
    if let (Some(prefix), false) = (&config.prefix, shrink.is_empty()) {
        shared_data::update_index(config, host, index, None, |view| {
            let mut record = IndexRecord::from_view(view.as_ref(), prefix.block_bytes, now);
            let mut changed = false;
            for (rank, keep) in &shrink {
                changed |= record.shrink(*rank, *keep);
            }
            changed.then_some(record)
        });
        host.count(&PerWorker::PrefixForgotten.of(&w.name), shrink.len() as u64);
        log::info!(
            "{}: ranks {:?} report fewer cache hits than the prefix index expected; it forgets part of what it held there",
            w.endpoint(),
            shrink.iter().map(|(r, _)| r).collect::<Vec<_>>()
        );
    }
    if let Some((before, now_first)) = moved {
        host.count(&PerWorker::RanksRenumbered.of(&w.name), 1);
        log::warn!(
            "{} now names its ranks from {now_first} (before: from {before}): a server restarted in another place of its deployment",
            w.endpoint()
        );
    }
    for (rank, t) in tokens.iter().enumerate() {
        if let Some(t) = t {
            host.gauge(&metrics::tokens(&w.name, first_rank as usize + rank), *t);
        }
    }
    host.count(&PerWorker::PollOk.of(&w.name), 1);
}
