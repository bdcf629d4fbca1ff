//! Each VM's decoded copy of the workers' shared states and of the health
//! record, and what a request needs from it without allocating (keys, route
//! header values, counter names). Only what changed is decoded, and writes
//! go by compare-and-swap against the token read with the copy; the read
//! modes (every state, the change log, `state_refresh_ms`) and why are in
//! docs/architecture.md ("Reading the states per request").

use super::changes::{self, ChangeLog, Place};
use super::{log_tagged_write, update_worker, IfMissing, Keys};
use crate::codec::{decode, encode_into};
use crate::config::{Config, RankNumbering};
use crate::health::{Health, NO_HEALTH};
use crate::host::Host;
use crate::metrics;
use crate::worker_state::rank_value::{self, Learned};
use crate::worker_state::{LoadTable, Ticket, WorkerState};
use std::rc::Rc;

/// What the cache keeps per worker besides its decoded state.
#[derive(Default)]
struct Entry {
    key: String,
    /// The change log's tag of `key` (`changes::worker_tag`); 0 when the
    /// configuration does not follow the log.
    tag: u64,
    endpoint: Rc<str>,
    /// cas of the state as read; None: absent, or written by this VM since.
    cas: Option<u32>,
    /// Bytes that decode to the cached state (empty: not known). A read that
    /// returns them again under a new cas (this VM's own write, or an
    /// identical one) needs no decoding.
    encoding: Vec<u8>,
    /// `routed.<worker>.rank_<r>` names, filled as ranks are routed to.
    routed_names: Vec<String>,
    /// The worker's first rank those names count from.
    routed_names_first: u32,
    /// With `rank_ports`: each rank's own `ip:port` (else empty).
    rank_endpoints: Vec<Rc<str>>,
}

#[derive(Default)]
pub struct StateCache {
    /// The configuration the entries follow.
    config: Option<Rc<Config>>,
    entries: Vec<Entry>,
    /// The decoded states, indexed like `Config::all_workers`.
    states: Vec<Option<WorkerState>>,
    /// Effective tokens per rank, derived from `states` when they change.
    loads: LoadTable,
    /// Encoding buffer, reused.
    encoded: Vec<u8>,
    /// `<p>.health`, when the configuration reads it.
    health: HealthCopy,
    /// When every state was last read (`state_refresh_ms`); None: not yet
    /// under this configuration.
    read_all_at_ms: Option<u64>,
    /// This VM's place in the change log, when the configuration follows it.
    log: LogReader,
}

/// What a VM keeps to follow the change log (`changes.rs`).
#[derive(Default)]
struct LogReader {
    /// `<p>.changes`; empty when the configuration reads every state.
    key: String,
    /// Where this VM last read the log; None: read every state next.
    place: Option<Place>,
    /// (tag, worker index), sorted by tag: the workers a logged tag names.
    tags: Vec<(u64, usize)>,
    /// The workers to read at this request, reused.
    wanted: Vec<usize>,
    /// The log and its cas as the current routing decision read them, until
    /// this VM appends: the decision's estimate is then logged with one
    /// compare-and-swap onto it instead of a read and a write
    /// (`changes::append_onto`). Dropped before a release (`write_as_routed`).
    read: Option<(ChangeLog, u32)>,
}

/// The health record as last read.
#[derive(Default)]
struct HealthCopy {
    /// Empty when the configuration reads no health.
    key: String,
    /// cas of the record as read; None: absent.
    cas: Option<u32>,
    record: Health,
}

impl StateCache {
    /// Follows `config` (rebuilding the per-worker tables when it changed)
    /// and reads the health record and the workers' states (every one, or
    /// those the change log names), decoding only those that changed.
    pub fn refresh(&mut self, config: &Rc<Config>, host: &dyn Host) {
        if !self.config.as_ref().is_some_and(|c| Rc::ptr_eq(c, config)) {
            self.follow(config);
        }
        self.refresh_health(host);
        if !self.log.key.is_empty() {
            self.refresh_from_log(host);
            return;
        }
        let every = config.state_refresh_ms;
        let now_ms = if every > 0 { host.now_ms() } else { 0 };
        let read_all = every == 0
            || self
                .read_all_at_ms
                .is_none_or(|at| now_ms.saturating_sub(at) >= every);
        if read_all && every > 0 {
            self.read_all_at_ms = Some(now_ms);
        }
        let mut relayout = false;
        for index in 0..self.entries.len() {
            if !read_all && self.entries.get(index).is_some_and(|e| e.cas.is_some()) {
                // Read within the last `state_refresh_ms`, and not written since by this VM.
                continue;
            }
            relayout |= self.read(host, index, relayout);
        }
        if relayout {
            self.loads.rebuild(&self.states);
        }
    }

    /// `refresh` under `state_reads` change_log: the log first, then only
    /// the states written since this VM's place in it (its own writes
    /// included: logged like any other, and read back for their cas); every
    /// state when the log cannot say (missing, another epoch, fallen behind,
    /// a new configuration).
    fn refresh_from_log(&mut self, host: &dyn Host) {
        // Read before the states: a write logged after this read is read at the next request.
        let read = changes::read_with_cas(host, &self.log.key);
        let log = read.as_ref().map(|(log, _)| log);
        let place = self.log.place.take();
        let mut wanted = std::mem::take(&mut self.log.wanted);
        wanted.clear();
        let read_all = match log.zip(place).and_then(|(log, place)| log.since(place)) {
            Some(tags) => {
                for tag in tags {
                    let at = self.log.tags.partition_point(|(t, _)| *t < tag);
                    let named = self.log.tags.get(at..).unwrap_or_default();
                    wanted.extend(named.iter().take_while(|(t, _)| *t == tag).map(|(_, i)| *i));
                }
                wanted.sort_unstable();
                wanted.dedup();
                false
            }
            None => true,
        };
        self.log.place = log.map(ChangeLog::place);
        self.log.read = read;
        let mut relayout = false;
        if read_all {
            for index in 0..self.entries.len() {
                relayout |= self.read(host, index, relayout);
            }
        } else {
            for &index in &wanted {
                relayout |= self.read(host, index, relayout);
            }
        }
        self.log.wanted = wanted;
        if relayout {
            self.loads.rebuild(&self.states);
        }
    }

    /// Reads worker `index`'s state, decoding it only when its bytes
    /// changed, and updates its loads unless `relayout` is already due. True
    /// when the loads need a rebuild.
    fn read(&mut self, host: &dyn Host, index: usize, relayout: bool) -> bool {
        let (Some(entry), Some(state)) = (self.entries.get_mut(index), self.states.get_mut(index)) else {
            return false;
        };
        let changed = match host.shared_get(&entry.key) {
            // Refused (it is not): the copy read last stays.
            Err(_) => false,
            Ok(Some((_, read))) if entry.cas == Some(read) => false,
            Ok(Some((bytes, read))) => {
                entry.cas = Some(read);
                if bytes == entry.encoding {
                    false
                } else {
                    *state = decode(&bytes);
                    entry.encoding = if state.is_some() { bytes } else { Vec::new() };
                    true
                }
            }
            Ok(None) => {
                entry.cas = None;
                entry.encoding.clear();
                state.take().is_some()
            }
        };
        changed && !relayout && !self.loads.update(index, state.as_ref())
    }

    fn refresh_health(&mut self, host: &dyn Host) {
        let copy = &mut self.health;
        if copy.key.is_empty() {
            return;
        }
        match host.shared_get(&copy.key) {
            Err(_) => {}
            Ok(Some((_, read))) if copy.cas == Some(read) => {}
            Ok(Some((bytes, read))) => {
                copy.cas = Some(read);
                copy.record = decode(&bytes).unwrap_or_default();
            }
            Ok(None) => {
                copy.cas = None;
                copy.record = Health::default();
            }
        }
    }

    fn follow(&mut self, config: &Rc<Config>) {
        let keys = Keys::of(config);
        self.health = HealthCopy {
            key: if config.reads_health() {
                keys.health()
            } else {
                String::new()
            },
            ..HealthCopy::default()
        };
        self.entries = config
            .all_workers()
            .map(|w| Entry {
                key: keys.worker(&w.address),
                endpoint: Rc::from(w.endpoint()),
                rank_endpoints: match w.rank_ports {
                    true => (0..w.dp_size.unwrap_or(1))
                        .map(|r| Rc::from(w.rank_address(r).to_string()))
                        .collect(),
                    false => Vec::new(),
                },
                ..Entry::default()
            })
            .collect();
        self.states = vec![None; self.entries.len()];
        self.loads = LoadTable::of(&self.states);
        self.read_all_at_ms = None;
        self.log = LogReader::default();
        if config.reads_change_log() {
            self.log.key = keys.changes();
            for entry in &mut self.entries {
                entry.tag = changes::worker_tag(&entry.key);
            }
            self.log.tags = self.entries.iter().enumerate().map(|(i, e)| (e.tag, i)).collect();
            self.log.tags.sort_unstable();
        }
        self.config = Some(config.clone());
    }

    /// The states as last read, indexed like `Config::all_workers`.
    pub fn states(&self) -> &[Option<WorkerState>] {
        &self.states
    }

    /// The health record as last read (empty when the configuration reads none).
    pub fn health(&self) -> &Health {
        if self.health.key.is_empty() {
            &NO_HEALTH
        } else {
            &self.health.record
        }
    }

    /// The loads derived from the states, indexed like them.
    pub fn loads(&self) -> &LoadTable {
        &self.loads
    }

    /// The route header value (`ip:port`) of worker `index`.
    pub fn endpoint(&self, index: usize) -> Rc<str> {
        self.entries
            .get(index)
            .map_or_else(|| Rc::from(""), |e| e.endpoint.clone())
    }

    /// The route header value of rank index `rank` of worker `index`: its
    /// rank port for a worker with `rank_ports`, else the worker's.
    pub fn rank_endpoint(&self, index: usize, rank: Option<u32>) -> Rc<str> {
        match (self.entries.get(index), rank) {
            (Some(e), Some(r)) if !e.rank_endpoints.is_empty() => e
                .rank_endpoints
                .get(r as usize)
                .cloned()
                .unwrap_or_else(|| e.endpoint.clone()),
            _ => self.endpoint(index),
        }
    }

    /// The rank value to write for rank index `rank` of worker `index`
    /// (`worker_state::rank_value`); None: none.
    pub fn rank_value(&self, index: usize, rank: u32) -> Option<u32> {
        let config = self.config.as_ref()?;
        let worker = config.worker(index)?;
        if worker.rank_ports {
            // The port selects the rank.
            return None;
        }
        // A worker routed to has a state; without one, only a local value is known.
        let (first, ranks, learned) = match self.states.get(index)?.as_ref() {
            Some(s) => (s.first_rank, s.ranks(), s.learned),
            None if rank_value::numbering(config, worker, Learned::Nothing) == Some(RankNumbering::Local) => {
                (0, 0, Learned::Nothing)
            }
            None => return None,
        };
        let in_header = config.header_transport().is_some();
        rank_value::value(
            rank_value::numbering(config, worker, learned),
            first,
            ranks,
            rank,
            in_header,
        )
    }

    /// The number worker `index` gives its first rank (0 without a state).
    pub fn first_rank(&self, index: usize) -> u32 {
        self.states
            .get(index)
            .and_then(Option::as_ref)
            .map_or(0, |s| s.first_rank)
    }

    /// The name of the counter of requests routed to (`worker`, rank index
    /// `rank`): by the rank as the worker names it.
    pub fn routed_name(&mut self, worker: usize, rank: u32) -> &str {
        let name = self
            .config
            .as_ref()
            .and_then(|c| c.worker(worker))
            .map_or("", |w| w.name.as_str());
        let first = self.first_rank(worker);
        let Some(entry) = self.entries.get_mut(worker) else {
            return "";
        };
        if entry.routed_names_first != first {
            entry.routed_names.clear();
            entry.routed_names_first = first;
        }
        let names = &mut entry.routed_names;
        while names.len() <= rank as usize {
            names.push(metrics::routed(name, first.saturating_add(names.len() as u32)));
        }
        names.get(rank as usize).map_or("", String::as_str)
    }

    /// Changes worker `index`'s state with `change` (None: nothing to
    /// write) and writes it: one write when nobody wrote the state since it
    /// was read, else a read-modify-write. `change` may run twice (on the
    /// cached copy, then on a fresh read), so it only changes the state.
    /// None when the worker has no state, `change` declined, or the write
    /// failed.
    pub fn write<T>(
        &mut self,
        config: &Config,
        host: &dyn Host,
        index: usize,
        mut change: impl FnMut(&mut WorkerState) -> Option<T>,
    ) -> Option<T> {
        match self.write_cached(host, index, &mut change) {
            Some(out) => out,
            None => update_worker(config, host, index, IfMissing::Skip, change),
        }
    }

    /// `write` for a request routed earlier (giving back its estimate, its
    /// prefill charge): `config` is the one it was routed with, whose
    /// indices may differ from the cache's after a membership change. When
    /// this VM wrote the state last, its cas is read first so that the write
    /// is still a single one.
    pub fn write_as_routed<T>(
        &mut self,
        config: &Rc<Config>,
        host: &dyn Host,
        index: usize,
        mut change: impl FnMut(&mut WorkerState) -> Option<T>,
    ) -> Option<T> {
        // The log as last read is as old as the request's routing, or older:
        // others have most likely appended since, and a swap onto it would
        // only add a failed call.
        self.log.read = None;
        if self.config.as_ref().is_some_and(|c| Rc::ptr_eq(c, config)) {
            self.read_cas_after_own_write(host, index);
            if let Some(out) = self.write_cached(host, index, &mut change) {
                return out;
            }
        }
        update_worker(config, host, index, IfMissing::Skip, change)
    }

    /// Whether this VM's copy of the state of a request routed under
    /// `config` shows a snapshot that counted it (`WorkerState::counted_by_snapshot`):
    /// the shared state, as new or newer, shows it too, so giving the
    /// estimate back needs no call. False when `config` is not the one
    /// followed (its indices may differ).
    pub fn counted_by_snapshot(&self, config: &Rc<Config>, ticket: &Ticket) -> bool {
        self.config.as_ref().is_some_and(|c| Rc::ptr_eq(c, config))
            && self
                .states
                .get(ticket.worker)
                .and_then(Option::as_ref)
                .is_some_and(|s| s.counted_by_snapshot(ticket))
    }

    /// When worker `index`'s cas is unknown because this VM wrote last,
    /// reads the state: the bytes it wrote need no decoding, another
    /// thread's are decoded here, so either way the write that follows is
    /// one call under the cas just read, not a second read. Nothing cached
    /// (the state absent or dropped): the read-modify-write reads it anyway.
    fn read_cas_after_own_write(&mut self, host: &dyn Host, index: usize) {
        if self
            .entries
            .get(index)
            .is_none_or(|e| e.cas.is_some() || e.encoding.is_empty())
        {
            return;
        }
        if self.read(host, index, false) {
            self.loads.rebuild(&self.states);
        }
    }

    /// Changes worker `index`'s cached state with `change` and writes it
    /// under the cas it was read with. None when that could not be tried or
    /// another thread wrote first (the cached copy is then dropped: the
    /// caller falls back to a read-modify-write); else what `change`
    /// returned (None: it declined, nothing written).
    fn write_cached<T>(
        &mut self,
        host: &dyn Host,
        index: usize,
        change: impl FnOnce(&mut WorkerState) -> Option<T>,
    ) -> Option<Option<T>> {
        let (Some(entry), Some(Some(state))) = (self.entries.get_mut(index), self.states.get_mut(index))
        else {
            return None;
        };
        let cas = entry.cas?;
        let Some(out) = change(state) else {
            return Some(None);
        };
        let bytes = encode_into(&*state, &mut self.encoded);
        let written = bytes.is_some_and(|b| host.shared_set(&entry.key, b, Some(cas)).is_ok());
        if !written {
            self.forget(index);
            return None;
        }
        if !self.log.key.is_empty() {
            log_tagged_write(host, &self.log.key, entry.tag, self.log.read.take());
        }
        // The new cas is unknown until the next read, which finds these bytes.
        entry.cas = None;
        entry.encoding.clear();
        entry.encoding.extend_from_slice(&self.encoded);
        if !self
            .loads
            .update(index, self.states.get(index).and_then(Option::as_ref))
        {
            self.loads.rebuild(&self.states);
        }
        Some(Some(out))
    }

    /// Drops worker `index`'s cached state (the next read decodes it).
    fn forget(&mut self, index: usize) {
        if let (Some(entry), Some(state)) = (self.entries.get_mut(index), self.states.get_mut(index)) {
            entry.cas = None;
            entry.encoding.clear();
            *state = None;
            if !self.loads.update(index, None) {
                self.loads.rebuild(&self.states);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::host::fake::FakeHost;
    use crate::shared_data::testing::{fleet, poll};

    fn shared_reads(h: &FakeHost) -> u64 {
        h.host_calls("shared_get")
    }

    /// Gives `ticket`'s estimate back as a request's end does; the
    /// shared-data reads and writes that took.
    fn give_back(cache: &mut StateCache, c: &Rc<Config>, h: &FakeHost, ticket: &Ticket) -> (u64, u64) {
        let (reads, writes) = (shared_reads(h), h.host_calls("shared_set"));
        cache.write_as_routed(c, h, ticket.worker, |s| {
            s.release(ticket);
            Some(())
        });
        (shared_reads(h) - reads, h.host_calls("shared_set") - writes)
    }

    #[test]
    fn states_are_decoded_only_when_their_cas_changed() {
        let (c, h) = fleet("");
        let c = Rc::new(c);
        let mut cache = StateCache::default();
        cache.refresh(&c, &h);
        let first = cache.states().to_vec();
        assert!(first.iter().all(Option::is_some));
        let reads = shared_reads(&h);
        cache.refresh(&c, &h);
        assert_eq!(
            shared_reads(&h) - reads,
            2 + 1,
            "one read per worker and one of the health record, every time"
        );
        assert_eq!(cache.states(), first.as_slice());
        // Another thread writes worker 1: only its state changes.
        poll(&c, &h, 1, &[7, 7, 7, 7]);
        cache.refresh(&c, &h);
        assert_eq!(cache.states()[0], first[0]);
        assert_eq!(cache.states()[1].as_ref().unwrap().polled_tokens(0), Some(7));
        assert_eq!(
            cache.loads(),
            &LoadTable::of(cache.states()),
            "loads follow the states"
        );
        // A key emptied (a worker that left) reads as no state.
        h.shared_set(&Keys::of(&c).worker(&c.routed()[0].address), b"", None)
            .unwrap();
        cache.refresh(&c, &h);
        assert_eq!(cache.states()[0], None);
        assert_eq!(cache.loads(), &LoadTable::of(cache.states()));
    }

    #[test]
    fn the_health_record_is_read_with_the_states_and_follows_its_writes() {
        let (c, h) = fleet("");
        let mut cache = StateCache::default();
        cache.refresh(&c, &h);
        assert!(cache.health().is_empty(), "never written: reads as empty");
        let b = c.routed()[1].address;
        crate::shared_data::update_health(&c, &h, |health| {
            health.envoy_unhealthy.push(b);
            Some(())
        });
        cache.refresh(&c, &h);
        assert_eq!(cache.health().envoy_unhealthy, [b]);
        cache.refresh(&c, &h);
        assert_eq!(
            cache.health().envoy_unhealthy,
            [b],
            "unchanged under the same cas"
        );
        crate::shared_data::update_health(&c, &h, |health| {
            health.envoy_unhealthy.clear();
            Some(())
        });
        cache.refresh(&c, &h);
        assert!(cache.health().is_empty());
        // A configuration without passive or Envoy health reads no record.
        let (off, h) = fleet(r#","passive_health":{"enabled":false}"#);
        crate::shared_data::update_health(&off, &h, |health| {
            health.envoy_unhealthy.push(b);
            Some(())
        });
        let mut cache = StateCache::default();
        cache.refresh(&off, &h);
        let reads = shared_reads(&h);
        cache.refresh(&off, &h);
        assert_eq!(shared_reads(&h) - reads, 2, "the states only");
        assert!(cache.health().is_empty());
    }

    #[test]
    fn an_estimate_is_one_write_unless_someone_wrote_in_between() {
        let (c, h) = fleet("");
        let c = Rc::new(c);
        let mut cache = StateCache::default();
        cache.refresh(&c, &h);
        let (reads, writes) = (shared_reads(&h), h.host_calls("shared_set"));
        let ticket = cache.write(&c, &h, 1, |s| s.add(1, 2, 30)).unwrap();
        assert_eq!(
            (shared_reads(&h) - reads, h.host_calls("shared_set") - writes),
            (0, 1)
        );
        assert_eq!(ticket.cost, 30);
        cache.refresh(&c, &h);
        assert_eq!(cache.states()[1].as_ref().unwrap().effective_tokens(2), Some(50));

        // Written by another thread since the read: read-modify-write, nothing lost.
        poll(&c, &h, 1, &[100, 100, 20, 100]);
        cache.write(&c, &h, 1, |s| s.add(1, 2, 5)).unwrap();
        cache.refresh(&c, &h);
        let state = cache.states()[1].clone().unwrap();
        assert_eq!(
            state.effective_tokens(2),
            Some(20 + 5),
            "the newer poll covers the first estimate"
        );
        assert_eq!(cache.write(&c, &h, 1, |s| s.add(1, 9, 5)), None, "no such rank");
    }

    #[test]
    fn a_release_is_one_write_when_the_state_was_read_since() {
        let (c, h) = fleet("");
        let c = Rc::new(c);
        let mut cache = StateCache::default();
        cache.refresh(&c, &h);
        let ticket = cache.write(&c, &h, 1, |s| s.add(1, 2, 30)).unwrap();
        cache.refresh(&c, &h); // another request of this VM read it since
        assert_eq!(give_back(&mut cache, &c, &h, &ticket), (0, 1));
        cache.refresh(&c, &h);
        assert_eq!(cache.states()[1].as_ref().unwrap().pending_total(), 0);

        // Not read since its own write: read-modify-write.
        let ticket = cache.write(&c, &h, 1, |s| s.add(1, 2, 30)).unwrap();
        assert_eq!(give_back(&mut cache, &c, &h, &ticket).0, 1);
        // Another thread wrote after this VM's own write: still one read and one write.
        let ticket = cache.write(&c, &h, 1, |s| s.add(1, 2, 30)).unwrap();
        let mut other = StateCache::default();
        other.refresh(&c, &h);
        let theirs = other.write(&c, &h, 1, |s| s.add(1, 3, 7)).unwrap();
        assert_eq!(give_back(&mut cache, &c, &h, &ticket), (1, 1));
        assert_current(&cache, &c, &h);
        let state = cache.states()[1].clone().unwrap();
        assert_eq!(
            (state.effective_tokens(2), state.pending_total()),
            (Some(20), 7),
            "the other's estimate kept"
        );
        give_back(&mut other, &c, &h, &theirs);
        // Routed with another configuration (a membership change): by its own indices.
        let ticket = cache.write(&c, &h, 1, |s| s.add(1, 2, 30)).unwrap();
        cache.refresh(&c, &h);
        let older = Rc::new(Config::clone(&c));
        give_back(&mut cache, &older, &h, &ticket);
        cache.refresh(&c, &h);
        assert_eq!(cache.states()[1].as_ref().unwrap().pending_total(), 0);
    }

    /// The cache's view is always what a fresh read of shared data decodes to.
    fn assert_current(cache: &StateCache, c: &Config, h: &FakeHost) {
        assert_eq!(
            cache.states(),
            crate::shared_data::read_worker_states(c, h).as_slice()
        );
        assert_eq!(cache.loads(), &LoadTable::of(cache.states()));
    }

    #[test]
    fn own_writes_and_other_threads_writes_interleave_consistently() {
        let (c, h) = fleet("");
        let c = Rc::new(c);
        let (mut mine, mut other) = (StateCache::default(), StateCache::default());
        mine.refresh(&c, &h);
        other.refresh(&c, &h);
        let a = mine.write(&c, &h, 1, |s| s.add(1, 2, 10)).unwrap();
        assert_current(&mine, &c, &h);
        let b = other.write(&c, &h, 1, |s| s.add(1, 2, 20)).unwrap(); // stale cas: read-modify-write
        other.refresh(&c, &h);
        mine.refresh(&c, &h);
        assert_current(&mine, &c, &h);
        assert_eq!(mine.states()[1].as_ref().unwrap().effective_tokens(2), Some(50));
        give_back(&mut mine, &c, &h, &a);
        give_back(&mut other, &c, &h, &b); // its cas is stale again: read-modify-write
        for cache in [&mut mine, &mut other] {
            cache.refresh(&c, &h);
            assert_current(cache, &c, &h);
            assert_eq!(cache.states()[1].as_ref().unwrap().effective_tokens(2), Some(20));
        }
    }

    #[test]
    fn with_state_refresh_ms_the_states_are_all_read_at_most_that_often() {
        let (c, h) = fleet(r#","state_refresh_ms":500"#);
        let c = Rc::new(c);
        let mut cache = StateCache::default();
        cache.refresh(&c, &h);
        assert_current(&cache, &c, &h);
        let reads = shared_reads(&h);
        cache.refresh(&c, &h);
        assert_eq!(shared_reads(&h) - reads, 1, "the health record only");
        // Another VM's poll of worker 1 is seen once the interval is over.
        poll(&c, &h, 1, &[7, 7, 7, 7]);
        h.now.set(10_499);
        cache.refresh(&c, &h);
        assert_eq!(cache.states()[1].as_ref().unwrap().polled_tokens(0), Some(100));
        h.now.set(10_500);
        let reads = shared_reads(&h);
        cache.refresh(&c, &h);
        assert_eq!(
            shared_reads(&h) - reads,
            2 + 1,
            "every state and the health record"
        );
        assert_current(&cache, &c, &h);
    }

    #[test]
    fn stale_reads_lose_no_write_of_the_chosen_worker() {
        let (c, h) = fleet(r#","state_refresh_ms":1000"#);
        let c = Rc::new(c);
        let (mut mine, mut other) = (StateCache::default(), StateCache::default());
        mine.refresh(&c, &h);
        other.refresh(&c, &h);
        other.write(&c, &h, 1, |s| s.add(1, 2, 10)).unwrap();
        mine.refresh(&c, &h);
        let tokens = |cache: &StateCache| cache.states()[1].as_ref().unwrap().effective_tokens(2);
        assert_eq!(tokens(&mine), Some(20), "the other VM's estimate is not seen yet");
        // Written against a stale cas: the swap fails and the write is
        // made on a fresh read, over the other VM's estimate.
        mine.write(&c, &h, 1, |s| s.add(1, 2, 20)).unwrap();
        let stored = crate::shared_data::read_worker_states(&c, &h);
        assert_eq!(stored[1].as_ref().unwrap().effective_tokens(2), Some(50));
        // Both VMs read a state they wrote at their next request, stale or not.
        for cache in [&mut mine, &mut other] {
            cache.refresh(&c, &h);
            assert_current(cache, &c, &h);
            assert_eq!(tokens(cache), Some(50));
        }
        // And the next estimate is one compare-and-swap on the state read.
        let writes = h.host_calls("shared_set");
        mine.write(&c, &h, 1, |s| s.add(1, 2, 1)).unwrap();
        assert_eq!(h.host_calls("shared_set") - writes, 1);
    }

    const CHANGE_LOG: &str = r#","state_reads":"change_log""#;

    fn log_place(h: &FakeHost, c: &Config) -> Place {
        changes::read(h, &Keys::of(c).changes()).unwrap().place()
    }

    #[test]
    fn with_the_change_log_only_the_states_written_since_are_read() {
        let (c, h) = fleet(CHANGE_LOG);
        let mut cache = StateCache::default();
        cache.refresh(&c, &h);
        assert_current(&cache, &c, &h);
        let reads = shared_reads(&h);
        cache.refresh(&c, &h);
        assert_eq!(
            shared_reads(&h) - reads,
            2,
            "the log and the health record, no state"
        );
        // Another VM's poll of worker 1: that state only.
        poll(&c, &h, 1, &[7, 7, 7, 7]);
        let reads = shared_reads(&h);
        cache.refresh(&c, &h);
        assert_eq!(shared_reads(&h) - reads, 3);
        assert_eq!(cache.states()[1].as_ref().unwrap().polled_tokens(0), Some(7));
        assert_current(&cache, &c, &h);
        // Its own estimate: one write and its log entry, swapped onto the
        // log as just read (no read); the state is read back once.
        let (reads, writes) = (shared_reads(&h), h.host_calls("shared_set"));
        cache.write(&c, &h, 0, |s| s.add(0, 1, 10)).unwrap();
        assert_eq!(
            (shared_reads(&h) - reads, h.host_calls("shared_set") - writes),
            (0, 2),
            "the state, then the log"
        );
        let reads = shared_reads(&h);
        cache.refresh(&c, &h);
        assert_eq!(shared_reads(&h) - reads, 3);
        assert_current(&cache, &c, &h);
        // A release comes later: its entry reads the log first.
        let ticket = cache.write(&c, &h, 0, |s| s.add(0, 1, 10)).unwrap();
        cache.refresh(&c, &h);
        assert_eq!(
            give_back(&mut cache, &c, &h, &ticket),
            (1, 2),
            "the log read, the state and the log written"
        );
        assert_current(&cache, &c, &h);
    }

    #[test]
    fn a_write_is_read_at_the_first_request_after_its_log_entry() {
        let (c, h) = fleet(CHANGE_LOG);
        let mut cache = StateCache::default();
        cache.refresh(&c, &h);
        // Another VM wrote worker 1 and has not appended its entry yet.
        let key = Keys::of(&c).worker(&c.routed()[1].address);
        let (bytes, _) = h.shared.get(&key).unwrap();
        let mut newer: WorkerState = decode(&bytes).unwrap();
        newer.add(1, 0, 500).unwrap();
        h.shared_set(&key, &crate::codec::encode(&newer), None).unwrap();
        cache.refresh(&c, &h);
        assert_ne!(
            cache.states()[1].as_ref(),
            Some(&newer),
            "not seen before its entry"
        );
        // The entry lands (after this VM's read of the log): the next request reads it.
        changes::append(&h, &Keys::of(&c).changes(), &[changes::worker_tag(&key)]);
        cache.refresh(&c, &h);
        assert_eq!(cache.states()[1].as_ref(), Some(&newer));
        assert_current(&cache, &c, &h);
    }

    #[test]
    fn without_a_usable_log_every_state_is_read() {
        let (c, h) = fleet(CHANGE_LOG);
        let log_key = Keys::of(&c).changes();
        let mut cache = StateCache::default();
        cache.refresh(&c, &h);
        let every = |cache: &mut StateCache, why: &str| {
            let reads = shared_reads(&h);
            cache.refresh(&c, &h);
            assert_eq!(shared_reads(&h) - reads, 2 + 2, "{why}");
            assert_current(cache, &c, &h);
        };
        // Missing (emptied here): every request reads every state until a write recreates it.
        h.shared_set(&log_key, b"", None).unwrap();
        every(&mut cache, "missing");
        every(&mut cache, "still missing");
        poll(&c, &h, 0, &[1, 1, 1, 1]);
        every(&mut cache, "a new epoch");
        let reads = shared_reads(&h);
        cache.refresh(&c, &h);
        assert_eq!(shared_reads(&h) - reads, 2, "followed again");
        // Fallen more than the ring behind: the writes of other VMs, here on worker 0 only.
        for _ in 0..=changes::CHANGE_LOG_LEN {
            poll(&c, &h, 0, &[2, 2, 2, 2]);
        }
        every(&mut cache, "fallen behind");
        // A new configuration (a reload, a membership change) starts with every state.
        let reloaded = Rc::new((*c).clone());
        let reads = shared_reads(&h);
        cache.refresh(&reloaded, &h);
        assert_eq!(shared_reads(&h) - reads, 2 + 2, "a new configuration");
    }

    #[test]
    fn a_restarted_log_sends_every_reader_to_a_full_read() {
        let (c, h) = fleet(CHANGE_LOG);
        let mut cache = StateCache::default();
        cache.refresh(&c, &h);
        let before = log_place(&h, &c);
        // Another VM wrote worker 1, and its append loses every swap: it restarts the log.
        let key = Keys::of(&c).worker(&c.routed()[1].address);
        let mut newer = cache.states()[1].clone().unwrap();
        newer.add(1, 0, 40).unwrap();
        h.shared_set(&key, &crate::codec::encode(&newer), None).unwrap();
        h.conflicts.set(crate::shared_data::CAS_ATTEMPTS);
        changes::append(&h, &Keys::of(&c).changes(), &[changes::worker_tag(&key)]);
        assert_ne!(log_place(&h, &c).epoch, before.epoch);
        let reads = shared_reads(&h);
        cache.refresh(&c, &h);
        assert_eq!(shared_reads(&h) - reads, 2 + 2);
        assert_eq!(cache.states()[1].as_ref(), Some(&newer));
        assert_current(&cache, &c, &h);
    }

    /// A small deterministic generator for the interleavings below.
    fn next(seed: &mut u64) -> u64 {
        *seed = seed
            .wrapping_mul(6_364_136_223_846_793_005)
            .wrapping_add(1_442_695_040_888_963_407);
        *seed >> 33
    }

    #[test]
    fn vms_following_the_log_always_see_what_a_full_read_sees() {
        let (c, h) = fleet(CHANGE_LOG);
        let hosts: Vec<FakeHost> = (0..3).map(|_| FakeHost::with_shared(h.shared.clone())).collect();
        for host in &hosts {
            host.now.set(h.now.get());
        }
        let mut caches: Vec<StateCache> = (0..3).map(|_| StateCache::default()).collect();
        let mut tickets = Vec::new();
        let mut seed = 7;
        for _ in 0..3000 {
            let vm = (next(&mut seed) % 3) as usize;
            let (cache, host) = (&mut caches[vm], &hosts[vm]);
            match next(&mut seed) % 6 {
                0 => poll(
                    &c,
                    host,
                    (next(&mut seed) % 2) as usize,
                    &[next(&mut seed) % 200; 4],
                ),
                1 if !tickets.is_empty() => {
                    let ticket: crate::worker_state::Ticket =
                        tickets.swap_remove(next(&mut seed) as usize % tickets.len());
                    cache.write_as_routed(&c, host, ticket.worker, |s| {
                        s.release(&ticket);
                        Some(())
                    });
                }
                2 => {
                    // A write from outside the cache (as the poller's, PD's).
                    crate::shared_data::update_worker(&c, host, 1, IfMissing::Skip, |s| s.add(1, 3, 1));
                }
                3 => host.conflicts.set((next(&mut seed) % 3) as usize),
                _ => {
                    cache.refresh(&c, host);
                    assert_current(cache, &c, host);
                    let worker = (next(&mut seed) % 2) as usize;
                    let rank = (next(&mut seed) % 4) as u32;
                    if next(&mut seed).is_multiple_of(2) {
                        // Another VM writes (and logs) between this one's
                        // read of the log and its estimate: the estimate's
                        // swap onto the log as read fails, and is retried.
                        let other = &hosts[(vm + 1) % 3];
                        let written = (next(&mut seed) % 2) as usize;
                        crate::shared_data::update_worker(&c, other, written, IfMissing::Skip, |s| {
                            s.add(written, 0, 1)
                        });
                    }
                    if let Some(t) = cache.write(&c, host, worker, |s| s.add(worker, rank, 5)) {
                        tickets.push(t);
                    }
                }
            }
        }
        for (cache, host) in caches.iter_mut().zip(&hosts) {
            host.conflicts.set(0);
            cache.refresh(&c, host);
            assert_current(cache, &c, host);
        }
    }

    #[test]
    fn a_new_configuration_gets_new_tables() {
        let (c, h) = fleet("");
        let c = Rc::new(c);
        let mut cache = StateCache::default();
        cache.refresh(&c, &h);
        assert_eq!(&*cache.endpoint(1), "127.0.0.1:2");
        assert_eq!(cache.routed_name(1, 3), "dprank.routed.b.rank_3");
        let one =
            Rc::new(Config::from_json(br#"{"workers":[{"address":"127.0.0.1:2","name":"z"}]}"#).unwrap());
        cache.refresh(&one, &h);
        assert_eq!(cache.states().len(), 1);
        assert_eq!(cache.routed_name(0, 0), "dprank.routed.z.rank_0");
        assert_eq!(&*cache.endpoint(5), "");
    }
}
