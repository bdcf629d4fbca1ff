//! The change log (`<p>.changes`): which workers' states were written
//! lately (an epoch, a sequence number and a ring of the last writes), so
//! that a VM reads only those at its next request instead of every
//! worker's (`state_reads`). Its ordering and recovery rules are in
//! docs/architecture.md ("Reading the states per request").

use super::{update, write_record};
use crate::codec::Record;
use crate::host::Host;
use serde::{Deserialize, Serialize};

/// Writes the ring remembers. A VM that misses more between two of its
/// requests (every thread's estimates and releases, and the poller's two
/// writes per worker per round: on a fleet larger than the ring, every VM
/// reads every state once per round) reads every state once instead.
pub const CHANGE_LOG_LEN: usize = 128;

/// The log as stored.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChangeLog {
    /// Random, drawn when the log starts; a new one voids every reader's place.
    pub epoch: u64,
    /// Writes appended in this epoch.
    pub seq: u64,
    /// Tag of write `q` (1-based) at `(q - 1) % CHANGE_LOG_LEN`: the last
    /// `min(seq, CHANGE_LOG_LEN)` writes.
    #[serde(with = "crate::codec::words")]
    pub tags: Vec<u64>,
}

impl Record for ChangeLog {
    const TAG: [u8; 4] = *b"DPG1";
    fn within_limits(&self) -> bool {
        self.tags.len() as u64 == self.seq.min(CHANGE_LOG_LEN as u64)
    }
}

/// A reader's place in the log: the epoch and sequence number it last read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Place {
    pub epoch: u64,
    pub seq: u64,
}

impl ChangeLog {
    fn new(epoch: u64) -> ChangeLog {
        ChangeLog {
            epoch,
            ..ChangeLog::default()
        }
    }

    fn push(&mut self, tag: u64) {
        let at = (self.seq % CHANGE_LOG_LEN as u64) as usize;
        match self.tags.get_mut(at) {
            Some(slot) => *slot = tag,
            None => self.tags.push(tag),
        }
        self.seq += 1;
    }

    /// Where a reader of this log now stands.
    pub fn place(&self) -> Place {
        Place {
            epoch: self.epoch,
            seq: self.seq,
        }
    }

    /// The tags written after `place`, oldest first; None when they are not
    /// all in the ring (another epoch, fallen behind, or a place ahead of
    /// the log): the reader then reads every state.
    pub fn since(&self, place: Place) -> Option<impl Iterator<Item = u64> + '_> {
        let behind = self.seq.checked_sub(place.seq)?;
        if place.epoch != self.epoch || behind > self.tags.len() as u64 {
            return None;
        }
        let len = CHANGE_LOG_LEN as u64;
        Some((place.seq..self.seq).filter_map(move |q| self.tags.get((q % len) as usize).copied()))
    }
}

/// The tag a worker's writes are logged under: a hash of its state key
/// (stable across VMs, builds and configurations, unlike an index).
pub fn worker_tag(state_key: &str) -> u64 {
    // FNV-1a, as `first_to_announce`.
    state_key.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
    })
}

/// The log, if present and readable.
pub fn read(host: &dyn Host, key: &str) -> Option<ChangeLog> {
    read_with_cas(host, key).map(|(log, _)| log)
}

/// The log and its cas, if present and readable: what [`append_onto`] needs.
pub fn read_with_cas(host: &dyn Host, key: &str) -> Option<(ChangeLog, u32)> {
    super::read(host, key).and_then(|(bytes, cas)| Some((super::decode(&bytes)?, cas)))
}

/// Logs a write of the state tagged `tag` onto `known`, the log as this VM
/// read it (with [`read_with_cas`]) earlier: one compare-and-swap when
/// nobody appended since, instead of [`append`]'s read and write; else (the
/// swap failed, or nothing known) [`append`].
pub fn append_onto(host: &dyn Host, key: &str, known: Option<(ChangeLog, u32)>, tag: u64) {
    if let Some((mut log, cas)) = known {
        log.push(tag);
        if write_record(host, key, &log, Some(cas)).is_ok() {
            return;
        }
    }
    append(host, key, &[tag]);
}

/// Logs writes of the states tagged `tags`, in order; called after the
/// writes succeeded. More than the ring holds leave every reader behind: each
/// then reads every state.
pub fn append(host: &dyn Host, key: &str, tags: &[u64]) {
    let appended = update(host, key, |log: Option<ChangeLog>| {
        let mut log = log.unwrap_or_else(|| ChangeLog::new(host.random_u64()));
        for tag in tags {
            log.push(*tag);
        }
        Some((log, ()))
    });
    if appended.is_none() {
        restart(host, key);
    }
}

/// Starts a new epoch without compare-and-swap, when an append could not be
/// made (`update` counted the conflict): every reader then reads every
/// state once, this write's included.
fn restart(host: &dyn Host, key: &str) {
    if write_record(host, key, &ChangeLog::new(host.random_u64()), None).is_err() {
        // Nothing more to try here: the writer's own next refresh reads
        // its write anyway (its cas is unknown), the others' at the next
        // logged write of this worker or at their next full read.
        log::warn!("dprank: the change log at {key} could not be written");
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::codec::{decode, encode};
    use crate::host::fake::FakeHost;
    use crate::host::memory::SharedData;
    use crate::shared_data::CAS_ATTEMPTS;

    const KEY: &str = "fleet.changes";

    fn log(h: &FakeHost) -> ChangeLog {
        read(h, KEY).unwrap()
    }

    fn tags_since(log: &ChangeLog, place: Place) -> Option<Vec<u64>> {
        log.since(place).map(Iterator::collect)
    }

    #[test]
    fn appends_are_read_back_in_order_from_a_place() {
        let h = FakeHost::default();
        assert_eq!(read(&h, KEY), None, "missing until the first write");
        append(&h, KEY, &[7]);
        let first = log(&h);
        assert_eq!((first.seq, first.tags.clone()), (1, vec![7]));
        let place = first.place();
        append(&h, KEY, &[8]);
        append(&h, KEY, &[7]);
        let now = log(&h);
        assert_eq!(now.epoch, first.epoch, "appends keep the epoch");
        assert_eq!(tags_since(&now, place), Some(vec![8, 7]));
        assert_eq!(tags_since(&now, now.place()), Some(vec![]));
        assert_eq!(decode::<ChangeLog>(&encode(&now)), Some(now));
    }

    #[test]
    fn an_append_onto_the_log_as_read_is_one_write_unless_someone_appended_since() {
        let h = FakeHost::default();
        append(&h, KEY, &[1]);
        // The shared-data reads and writes of one append onto `known`.
        let calls = |h: &FakeHost, known, tag| {
            let (reads, writes) = (h.host_calls("shared_get"), h.host_calls("shared_set"));
            append_onto(h, KEY, known, tag);
            (
                h.host_calls("shared_get") - reads,
                h.host_calls("shared_set") - writes,
            )
        };
        // Nobody appended since the read: one compare-and-swap, no read.
        let known = read_with_cas(&h, KEY);
        assert_eq!(calls(&h, known, 2), (0, 1));
        assert_eq!(log(&h).tags, [1, 2]);
        // Another VM appended in between: the swap fails, and the entry is
        // appended after it by a read and a write, nothing lost.
        let known = read_with_cas(&h, KEY);
        let other = FakeHost::with_shared(h.shared.clone());
        append(&other, KEY, &[3]);
        assert_eq!(calls(&h, known, 4), (1, 2));
        let l = log(&h);
        assert_eq!((l.seq, l.tags), (4, vec![1, 2, 3, 4]));
        // Nothing known (the log missing when read): a plain append.
        let h = FakeHost::default();
        append_onto(&h, KEY, None, 7);
        assert_eq!(log(&h).tags, [7]);
    }

    #[test]
    fn a_reader_more_than_the_ring_behind_reads_everything() {
        let h = FakeHost::default();
        append(&h, KEY, &[0]);
        let start = log(&h).place();
        for tag in 1..CHANGE_LOG_LEN as u64 {
            append(&h, KEY, &[tag]);
        }
        // Exactly the ring behind: every write since is still there.
        let full = log(&h);
        assert_eq!(full.tags.len(), CHANGE_LOG_LEN);
        let since = tags_since(&full, start).unwrap();
        assert_eq!(since, (1..CHANGE_LOG_LEN as u64).collect::<Vec<_>>());
        let older = Place {
            seq: start.seq - 1,
            ..start
        };
        assert_eq!(tags_since(&full, older).map(|t| t.len()), Some(CHANGE_LOG_LEN));
        // One more write wraps around over the oldest entry.
        append(&h, KEY, &[999]);
        let wrapped = log(&h);
        assert_eq!(wrapped.tags.len(), CHANGE_LOG_LEN);
        assert!(tags_since(&wrapped, older).is_none(), "fallen behind");
        let since = tags_since(&wrapped, start).unwrap();
        assert_eq!(since.len(), CHANGE_LOG_LEN);
        assert_eq!(since.last(), Some(&999));
        assert_eq!(since.first(), Some(&1));
    }

    #[test]
    fn another_epoch_or_a_place_ahead_of_the_log_reads_everything() {
        let h = FakeHost::default();
        append(&h, KEY, &[1]);
        let l = log(&h);
        let other_epoch = Place {
            epoch: l.epoch ^ 1,
            seq: 0,
        };
        assert!(tags_since(&l, other_epoch).is_none());
        let ahead = Place {
            epoch: l.epoch,
            seq: 2,
        };
        assert!(tags_since(&l, ahead).is_none());
    }

    #[test]
    fn inconsistent_or_foreign_values_read_as_missing_and_are_started_afresh() {
        let h = FakeHost::default();
        let bad = ChangeLog {
            epoch: 1,
            seq: 3,
            tags: vec![1],
        };
        h.shared_set(KEY, &encode(&bad), None).unwrap();
        assert_eq!(read(&h, KEY), None);
        append(&h, KEY, &[5]);
        let l = log(&h);
        assert_eq!((l.seq, l.tags), (1, vec![5]));
        assert_ne!(l.epoch, 1, "a new epoch");
    }

    #[test]
    fn concurrent_appends_retry_on_cas_mismatch_and_keep_every_entry() {
        let shared = SharedData::default();
        let (a, b) = (
            FakeHost::with_shared(shared.clone()),
            FakeHost::with_shared(shared),
        );
        append(&a, KEY, &[1]);
        let start = log(&a).place();
        // b's swap fails twice (another thread appended in between): it re-reads and retries.
        b.conflicts.set(2);
        append(&b, KEY, &[2]);
        assert_eq!(b.host_calls("shared_set"), 3);
        append(&a, KEY, &[3]);
        let l = log(&b);
        assert_eq!(l.epoch, start.epoch, "no restart");
        assert_eq!(tags_since(&l, start), Some(vec![2, 3]));
    }

    #[test]
    fn appends_from_threads_at_once_are_all_counted() {
        let shared = SharedData::default();
        let per_thread = 500u64;
        // Created first: two first writes at once would both go through
        // (the first write of a key ignores the cas), the case epochs cover.
        append(&FakeHost::with_shared(shared.clone()), KEY, &[u64::MAX]);
        let threads: Vec<_> = (0..4u64)
            .map(|t| {
                let shared = shared.clone();
                std::thread::spawn(move || {
                    let h = FakeHost::with_shared(shared);
                    for i in 0..per_thread {
                        append(&h, KEY, &[t * per_thread + i]);
                    }
                    h.counter(crate::metrics::SHARED_DATA_CONFLICTS)
                })
            })
            .collect();
        let gave_up: u64 = threads.into_iter().map(|t| t.join().unwrap()).sum();
        let l = log(&FakeHost::with_shared(shared));
        if gave_up == 0 {
            // Every swap that lost re-read and retried: no append overwrote another.
            assert_eq!(l.seq, 4 * per_thread + 1);
        }
        let mut last: Vec<u64> = l.tags.clone();
        last.sort_unstable();
        last.dedup();
        assert_eq!(last.len(), l.tags.len(), "each write logged once");
    }

    #[test]
    fn an_append_that_cannot_land_restarts_the_log_so_readers_read_everything() {
        let h = FakeHost::default();
        append(&h, KEY, &[1]);
        let place = log(&h).place();
        h.conflicts.set(CAS_ATTEMPTS);
        append(&h, KEY, &[2]);
        let l = log(&h);
        assert_ne!(l.epoch, place.epoch);
        assert!(
            tags_since(&l, place).is_none(),
            "every reader reads everything once"
        );
        assert_eq!(h.counter(crate::metrics::SHARED_DATA_CONFLICTS), 1);
    }

    #[test]
    fn tags_are_stable_and_tell_workers_apart() {
        assert_eq!(worker_tag("fleet.w.10.0.0.1:1"), worker_tag("fleet.w.10.0.0.1:1"));
        assert_ne!(worker_tag("fleet.w.10.0.0.1:1"), worker_tag("fleet.w.10.0.0.1:2"));
    }
}
