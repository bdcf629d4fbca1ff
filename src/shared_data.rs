//! Everything dprank keeps in proxy-wasm shared data: the keys, the poll
//! lease, and the read-modify-write helpers. No other module names a key
//! (`codec.rs` encodes the values). The key table and the concurrency rules
//! are in docs/architecture.md ("Shared data").

use crate::codec::{decode, decode_view, encode, encode_into, Record};
use crate::config::Config;
use crate::health::Health;
use crate::host::{Host, HostError, SharedSetError};
use crate::metrics;
use crate::prefix::index::{IndexRecord, IndexView};
use crate::worker_state::WorkerState;
use serde::{Deserialize, Serialize};
use std::net::SocketAddr;

pub mod cache;
pub mod changes;
#[cfg(test)]
pub(crate) mod testing;

/// How many times a read-modify-write on shared data is retried when another
/// thread wrote in between.
pub const CAS_ATTEMPTS: usize = 16;

thread_local! {
    /// The encoding buffer of read-modify-writes, reused (one VM per thread).
    static ENCODED: std::cell::RefCell<Vec<u8>> = const { std::cell::RefCell::new(Vec::new()) };
    /// Tags of the state writes made inside `logged_together`, appended at its end.
    static BATCH: std::cell::RefCell<Option<Vec<u64>>> = const { std::cell::RefCell::new(None) };
}

/// The names of the keys of one configuration's shared data.
pub struct Keys<'a> {
    prefix: &'a str,
}

impl<'a> Keys<'a> {
    pub fn of(config: &'a Config) -> Keys<'a> {
        Keys {
            prefix: &config.state_key,
        }
    }
    pub fn worker(&self, address: &SocketAddr) -> String {
        format!("{}.w.{address}", self.prefix)
    }
    pub fn lease(&self) -> String {
        format!("{}.lease", self.prefix)
    }
    pub fn vms(&self) -> String {
        format!("{}.vms", self.prefix)
    }
    pub fn members(&self) -> String {
        format!("{}.members", self.prefix)
    }
    pub fn config(&self) -> String {
        format!("{}.config", self.prefix)
    }
    pub fn prefix_index(&self, address: &SocketAddr) -> String {
        format!("{}.px.{address}", self.prefix)
    }
    pub fn health(&self) -> String {
        format!("{}.health", self.prefix)
    }
    pub fn refused(&self) -> String {
        format!("{}.refused", self.prefix)
    }
    pub fn changes(&self) -> String {
        format!("{}.changes", self.prefix)
    }
    /// Admission: the requests held on every thread (`admission/held_record.rs`).
    pub fn held(&self) -> String {
        format!("{}.held", self.prefix)
    }
}

/// The poll lease: who polls, until when, and when the last round started,
/// so a new holder keeps the cadence.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Lease {
    pub owner: u64,
    pub expires_ms: u64,
    pub last_poll_ms: u64,
    /// When the holder's configuration was applied: a newer configuration
    /// (a reload) takes the lease at once instead of waiting for the old
    /// filter chain to drain.
    pub generation: u64,
}

impl Record for Lease {
    const TAG: [u8; 4] = *b"DPL1";
}

/// How many VMs have asked for an id.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct VmCount(pub u64);

impl Record for VmCount {
    const TAG: [u8; 4] = *b"DPV1";
}

/// The usable hosts of the followed cluster, sorted.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Members(pub Vec<SocketAddr>);

impl Record for Members {
    const TAG: [u8; 4] = *b"DPM1";
}

/// Workers whose last load report was refused (ranks not one run S..S+N-1), sorted:
/// so that whichever VM polls, a refusal is logged once, not per poll.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Refused(pub Vec<SocketAddr>);

impl Record for Refused {
    const TAG: [u8; 4] = *b"DPR1";
}

/// Records whether `worker`'s last report was refused; true when that
/// changed (the caller logs it).
pub fn set_refused(config: &Config, host: &dyn Host, worker: SocketAddr, refused: bool) -> bool {
    update(host, &Keys::of(config).refused(), |list: Option<Refused>| {
        let mut list = list.unwrap_or_default();
        match (list.0.binary_search(&worker), refused) {
            (Err(at), true) => list.0.insert(at, worker),
            (Ok(at), false) => {
                list.0.remove(at);
            }
            _ => return None,
        }
        Some((list, ()))
    })
    .is_some()
}

/// A hash of the configuration last logged at start-up, so that the VMs of
/// every thread log a configuration once between them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Announced(pub u64);

impl Record for Announced {
    const TAG: [u8; 4] = *b"DPC1";
}

/// Writes `record` at `key`, by compare-and-swap against `cas` when given,
/// encoded in this thread's reused buffer (no allocation per write).
pub fn write_record<R: Record>(
    host: &dyn Host,
    key: &str,
    record: &R,
    cas: Option<u32>,
) -> Result<(), SharedSetError> {
    ENCODED.with_borrow_mut(|buffer| match encode_into(record, buffer) {
        Some(bytes) => host.shared_set(key, bytes, cas),
        // Too large for the encoder: nothing the proxy said.
        None => Err(SharedSetError::Failed(HostError::BAD_ARGUMENT)),
    })
}

/// A key's value and cas; None when absent, and when the proxy refuses the
/// read (it does not, but a reader treats it as absent rather than fail).
/// A read-modify-write never writes after a refused read (it would
/// overwrite what it could not read): it calls `shared_get` itself.
pub fn read(host: &dyn Host, key: &str) -> Option<(Vec<u8>, u32)> {
    host.shared_get(key).ok().flatten()
}

/// What a key holds between its creation and its first record: no
/// record's tag, so it reads as none.
const NO_RECORD: &[u8] = b"\0";

/// Read-modify-write of one key under compare-and-swap. `update` gets the
/// current value (None when absent or unreadable) and returns the new value
/// and a result, or None to write nothing. Returns None when nothing was
/// written.
pub fn update<T: Record, R>(
    host: &dyn Host,
    key: &str,
    mut update: impl FnMut(Option<T>) -> Option<(T, R)>,
) -> Option<R> {
    for _ in 0..CAS_ATTEMPTS {
        let Some((bytes, cas)) = host.shared_get(key).ok()? else {
            // Envoy ignores the token when a key does not exist, so two
            // threads that both found it absent would both "win" (two VMs
            // with one id, two first poll rounds). Create it holding no
            // record first (racing creators write the same), then swap as
            // usual. Not empty: an empty value reads back as absent.
            update(None)?;
            match host.shared_set(key, NO_RECORD, None) {
                Ok(()) | Err(SharedSetError::CasMismatch) => continue,
                Err(SharedSetError::Failed(_)) => return None,
            }
        };
        let (new, result) = update(decode(&bytes))?;
        match write_record(host, key, &new, Some(cas)) {
            Ok(()) => return Some(result),
            Err(SharedSetError::CasMismatch) => continue,
            Err(SharedSetError::Failed(_)) => return None,
        }
    }
    host.count(metrics::SHARED_DATA_CONFLICTS, 1);
    None
}

/// Creates worker `index`'s prefix index, empty, if it keeps one and it
/// does not exist yet; true when it exists now. Only the poller calls
/// this, under its lease: a write to an absent key ignores the
/// compare-and-swap token (Envoy inserts it whatever the token), so two
/// routing threads that both found the key absent would each write their
/// own first index and the later write would erase the earlier one.
pub fn create_index(config: &Config, host: &dyn Host, index: usize) -> bool {
    let (Some(prefix), Some(worker)) = (&config.prefix, config.worker(index)) else {
        return false;
    };
    if !config.keeps_prefix_index(index) {
        return false;
    }
    let key = Keys::of(config).prefix_index(&worker.address);
    match host.shared_get(&key) {
        Ok(Some(_)) => return true,
        // Unreadable: writing now could erase an index that exists.
        Err(_) => return false,
        Ok(None) => {}
    }
    let empty = IndexRecord::empty(prefix.block_bytes, host.now_ms());
    host.shared_set(&key, &encode(&empty), None).is_ok()
}

/// Worker `index`'s prefix index as stored, with its cas (None: absent).
pub fn read_prefix_index(config: &Config, host: &dyn Host, index: usize) -> Option<(Vec<u8>, u32)> {
    let worker = config.worker(index)?;
    read(host, &Keys::of(config).prefix_index(&worker.address))
}

/// Read-modify-write of worker `index`'s prefix index under
/// compare-and-swap. `first` is a value already read (None: read it here);
/// `change` gets the current index, if readable, and returns the new one, or
/// None to write nothing. False when nothing was written, and always while
/// the index does not exist: the poller creates it ([`create_index`]).
pub fn update_index(
    config: &Config,
    host: &dyn Host,
    index: usize,
    mut first: Option<Option<(Vec<u8>, u32)>>,
    mut change: impl FnMut(Option<IndexView>) -> Option<IndexRecord>,
) -> bool {
    let Some(worker) = config.worker(index) else {
        return false;
    };
    let key = Keys::of(config).prefix_index(&worker.address);
    for _ in 0..CAS_ATTEMPTS {
        let Some((bytes, cas)) = first.take().unwrap_or_else(|| read(host, &key)) else {
            return false;
        };
        let Some(new) = change(decode_view(&bytes)) else {
            return false;
        };
        match host.shared_set(&key, &encode(&new), Some(cas)) {
            Ok(()) => return true,
            Err(SharedSetError::CasMismatch) => continue,
            Err(SharedSetError::Failed(_)) => return false,
        }
    }
    host.count(metrics::SHARED_DATA_CONFLICTS, 1);
    false
}

/// What `update_worker` does for a worker that has no state yet: never
/// polled, or dropped from a cluster's membership.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum IfMissing {
    /// Write nothing. The routing side (estimates, releases, taking a worker
    /// out of rotation) only adjusts states a poll created: a request cannot
    /// have been routed by load to a worker without one, and writing would
    /// bring back the state of a worker that has left.
    Skip,
    /// Start from an empty state. The poller creates states: it polls every
    /// configured worker, known or not.
    Create,
}

/// Read-modify-write of worker `index`'s state (`Config::all_workers`
/// order). `change` returns None to write nothing.
pub fn update_worker<R>(
    config: &Config,
    host: &dyn Host,
    index: usize,
    if_missing: IfMissing,
    mut change: impl FnMut(&mut WorkerState) -> Option<R>,
) -> Option<R> {
    let worker = config.worker(index)?;
    let keys = Keys::of(config);
    let key = keys.worker(&worker.address);
    let result = update(host, &key, |current| {
        let mut state = match (current, if_missing) {
            (Some(state), _) => state,
            (None, IfMissing::Create) => WorkerState::default(),
            (None, IfMissing::Skip) => return None,
        };
        let result = change(&mut state)?;
        Some((state, result))
    })?;
    log_state_write(config, host, &key);
    Some(result)
}

/// Logs a successful write of the state at `state_key` when `config`'s
/// readers follow the change log (`changes.rs`); every state write calls it.
pub fn log_state_write(config: &Config, host: &dyn Host, state_key: &str) {
    if config.reads_change_log() {
        log_tagged_write(
            host,
            &Keys::of(config).changes(),
            changes::worker_tag(state_key),
            None,
        );
    }
}

/// Logs a successful write of the state tagged `tag` in the log at
/// `changes_key`, or keeps it for the end of `logged_together`. For callers
/// that already know the log follows (`StateCache`, which holds both);
/// `known` is the log as the caller read it, if it has it
/// (`changes::append_onto`).
pub fn log_tagged_write(
    host: &dyn Host,
    changes_key: &str,
    tag: u64,
    known: Option<(changes::ChangeLog, u32)>,
) {
    let batched = BATCH.with_borrow_mut(|batch| batch.as_mut().map(|tags| tags.push(tag)).is_some());
    if !batched {
        changes::append_onto(host, changes_key, known, tag);
    }
}

/// Runs `writes` (state writes made at once, such as a poll round's) and
/// logs them together at the end: one append instead of one per write.
/// Each entry still follows its write, so nothing is missed.
pub fn logged_together<R>(config: &Config, host: &dyn Host, writes: impl FnOnce() -> R) -> R {
    let outer = BATCH.with_borrow_mut(|batch| batch.replace(Vec::new()));
    let result = writes();
    let tags = BATCH
        .with_borrow_mut(|batch| std::mem::replace(batch, outer))
        .unwrap_or_default();
    if !tags.is_empty() {
        changes::append(host, &Keys::of(config).changes(), &tags);
    }
    result
}

/// The shared state of every worker, indexed like `Config::all_workers`.
pub fn read_worker_states(config: &Config, host: &dyn Host) -> Vec<Option<WorkerState>> {
    let keys = Keys::of(config);
    config
        .all_workers()
        .map(|w| read(host, &keys.worker(&w.address)).and_then(|(bytes, _)| decode(&bytes)))
        .collect()
}

/// The health record (empty when absent or unreadable).
pub fn read_health(config: &Config, host: &dyn Host) -> Health {
    read(host, &Keys::of(config).health())
        .and_then(|(bytes, _)| decode(&bytes))
        .unwrap_or_default()
}

/// Read-modify-write of the health record; `change` returns None to write nothing.
pub fn update_health<R>(
    config: &Config,
    host: &dyn Host,
    mut change: impl FnMut(&mut Health) -> Option<R>,
) -> Option<R> {
    update(host, &Keys::of(config).health(), |current: Option<Health>| {
        let mut health = current.unwrap_or_default();
        let result = change(&mut health)?;
        Some((health, result))
    })
}

/// A number unique to this VM among those sharing the data (0 if none could be had).
pub fn next_vm_id(config: &Config, host: &dyn Host) -> u64 {
    update(host, &Keys::of(config).vms(), |count: Option<VmCount>| {
        let n = count.map_or(0, |c| c.0) + 1;
        Some((VmCount(n), n))
    })
    .unwrap_or(0)
}

/// Takes or renews the poll lease for VM `me`, whose configuration was
/// applied at `generation`; true when it holds the lease and a poll round is
/// due. Another holder keeps the lease while it is unexpired and its
/// configuration is not older than ours.
pub fn claim_poll_round(config: &Config, host: &dyn Host, me: u64, generation: u64, ttl_ms: u64) -> bool {
    let now = host.now_ms();
    update(host, &Keys::of(config).lease(), |lease: Option<Lease>| {
        let last_poll_ms = match lease {
            Some(l) if l.owner != me && l.expires_ms > now && l.generation >= generation => return None,
            Some(l) => l.last_poll_ms,
            None => 0,
        };
        let due = now.saturating_sub(last_poll_ms) >= config.poll_interval_ms;
        let renewed = Lease {
            owner: me,
            expires_ms: now + ttl_ms,
            last_poll_ms: if due { now } else { last_poll_ms },
            generation,
        };
        Some((renewed, due))
    })
    .unwrap_or(false)
}

/// The published members, when their cas differs from `known_cas`.
pub fn members_if_changed(
    config: &Config,
    host: &dyn Host,
    known_cas: Option<u32>,
) -> Option<(Members, u32)> {
    let (bytes, cas) = read(host, &Keys::of(config).members())?;
    (Some(cas) != known_cas).then(|| (decode(&bytes).unwrap_or_default(), cas))
}

/// Publishes a new membership; workers that left lose their state (so one
/// that comes back starts afresh). Returns the previous members, or None
/// when nothing changed or the write failed.
pub fn publish_members(config: &Config, host: &dyn Host, members: &Members) -> Option<Members> {
    let keys = Keys::of(config);
    let key = keys.members();
    let previous: Members = read(host, &key)
        .and_then(|(bytes, _)| decode(&bytes))
        .unwrap_or_default();
    if previous == *members || host.shared_set(&key, &encode(members), None).is_err() {
        return None;
    }
    for gone in previous.0.iter().filter(|a| !members.0.contains(a)) {
        let key = keys.worker(gone);
        if host.shared_set(&key, b"", None).is_ok() {
            log_state_write(config, host, &key);
        }
    }
    Some(previous)
}

/// Whether this VM is the first to apply the configuration `json`: the
/// others sharing the data (one VM per Envoy thread) stay silent about it.
pub fn first_to_announce(config: &Config, host: &dyn Host, json: &str) -> bool {
    // FNV-1a: stable across VMs and builds, unlike std's hasher.
    let hash = json.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
    });
    update(host, &Keys::of(config).config(), |last: Option<Announced>| {
        (last != Some(Announced(hash))).then_some((Announced(hash), ()))
    })
    .is_some()
}

/// Bytes dprank keeps in shared data for this configuration.
pub fn shared_bytes(config: &Config, host: &dyn Host) -> u64 {
    let keys = Keys::of(config);
    let fixed = [
        keys.lease(),
        keys.vms(),
        keys.members(),
        keys.config(),
        keys.health(),
        keys.changes(),
        keys.held(),
    ];
    let workers = config.all_workers().map(|w| keys.worker(&w.address));
    let indexes = config
        .all_workers()
        .enumerate()
        .filter(|(i, _)| config.keeps_prefix_index(*i))
        .map(|(_, w)| keys.prefix_index(&w.address));
    fixed
        .into_iter()
        .chain(workers)
        .chain(indexes)
        .filter_map(|k| read(host, &k))
        .map(|(b, _)| b.len() as u64)
        .sum()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::host::fake::FakeHost;

    fn config() -> Config {
        Config::from_json(br#"{"workers":[{"address":"127.0.0.1:1"}],"state_key":"fleet"}"#).unwrap()
    }

    fn polled(tokens: &[u64]) -> WorkerState {
        let mut w = WorkerState::default();
        let seq = w.begin_poll();
        w.apply_snapshot(seq, 1000, &tokens.iter().map(|t| Some(*t)).collect::<Vec<_>>());
        w
    }

    #[test]
    fn only_the_poller_creates_a_prefix_index() {
        let c = config();
        let h = FakeHost::default();
        let key = Keys::of(&c).prefix_index(&c.routed()[0].address);
        let touch = |h: &FakeHost| {
            update_index(&c, h, 0, None, |view| {
                let mut record = IndexRecord::from_view(view.as_ref(), 512, 1000);
                record.touch(0, &[&[1, 2]], 1000, 60_000, 100).then_some(record)
            })
        };
        // A router never writes an absent index: its write would ignore the
        // cas and could erase another thread's first index.
        assert!(!touch(&h));
        assert!(h.shared.get(&key).is_none());
        create_index(&c, &h, 0);
        let (_, created) = h.shared.get(&key).unwrap();
        assert!(touch(&h));
        // Created once: a later poll leaves what routers wrote.
        create_index(&c, &h, 0);
        let (bytes, cas) = h.shared.get(&key).unwrap();
        assert_ne!(cas, created);
        let view: IndexView = decode_view(&bytes).unwrap();
        assert_eq!(view.rank(0).map_or(0, |r| r.matched(&[1, 2], 0)), 2);
    }

    #[test]
    fn a_pd_fleet_keeps_prefix_indexes_for_its_prefill_workers_only() {
        let c = Config::from_json(
            br#"{"prefill_workers":[{"address":"10.0.0.1:1"}],"decode_workers":[{"address":"10.0.0.2:1"}]}"#,
        )
        .unwrap();
        let h = FakeHost::default();
        for i in 0..2 {
            create_index(&c, &h, i);
        }
        let keys = Keys::of(&c);
        let exists = |a: &str| h.shared.get(&keys.prefix_index(&a.parse().unwrap())).is_some();
        assert!(exists("10.0.0.1:1") && !exists("10.0.0.2:1"));
        let off =
            Config::from_json(br#"{"workers":[{"address":"127.0.0.1:1"}],"prefix_affinity":false}"#).unwrap();
        create_index(&off, &h, 0);
        assert!(h
            .shared
            .get(&Keys::of(&off).prefix_index(&off.routed()[0].address))
            .is_none());
    }

    #[test]
    fn key_layout() {
        let c = config();
        let keys = Keys::of(&c);
        assert_eq!(
            keys.worker(&"10.0.0.1:8000".parse().unwrap()),
            "fleet.w.10.0.0.1:8000"
        );
        assert_eq!(keys.worker(&"[::1]:8000".parse().unwrap()), "fleet.w.[::1]:8000");
        assert_eq!(
            (keys.lease(), keys.vms(), keys.members()),
            ("fleet.lease".into(), "fleet.vms".into(), "fleet.members".into())
        );
        assert_eq!(keys.config(), "fleet.config");
        assert_eq!(keys.health(), "fleet.health");
        assert_eq!(keys.refused(), "fleet.refused");
        assert_eq!(keys.changes(), "fleet.changes");
    }

    #[test]
    fn worker_state_round_trip_and_strictness() {
        let mut w = polled(&[5, u64::MAX - 1, 7]);
        w.begin_poll();
        w.add(1, 2, 99).unwrap();
        w.source.write(&crate::load::sglang::FellBack(true));
        w.mark_unreachable();
        let bytes = encode(&w);
        assert_eq!(decode::<WorkerState>(&bytes), Some(w.clone()));
        assert_eq!(decode::<WorkerState>(&bytes[..bytes.len() - 1]), None);
        let mut longer = bytes.clone();
        longer.push(0);
        assert_eq!(decode::<WorkerState>(&longer), None);
        let mut other_version = bytes.clone();
        other_version[3] = b'5';
        assert_eq!(decode::<WorkerState>(&other_version), None);
        assert_eq!(decode::<WorkerState>(b""), None);
        assert_eq!(decode::<Lease>(&bytes), None, "another record's tag");
    }

    #[test]
    fn decode_rejects_absurd_sizes_without_allocating() {
        let mut bytes = WorkerState::TAG.to_vec();
        bytes.extend_from_slice(&[0; 5]);
        bytes.extend_from_slice(&[0xff, 0xff, 0xff, 0xff, 0x0f]); // u32::MAX ranks
        assert_eq!(decode::<WorkerState>(&bytes), None);
        let too_many = polled(&vec![1; crate::config::MAX_DP_SIZE as usize + 1]);
        assert_eq!(decode::<WorkerState>(&encode(&too_many)), None);
    }

    #[test]
    fn every_record_round_trips() {
        let lease = Lease {
            owner: 3,
            expires_ms: u64::MAX,
            last_poll_ms: 7,
            generation: 9,
        };
        assert_eq!(decode(&encode(&lease)), Some(lease));
        assert_eq!(decode(&encode(&VmCount(12))), Some(VmCount(12)));
        let members = Members(vec!["10.0.0.1:1".parse().unwrap(), "[::1]:2".parse().unwrap()]);
        assert_eq!(decode(&encode(&members)), Some(members));
        assert_eq!(decode::<Members>(b"10.0.0.1:1"), None);
    }

    #[test]
    fn update_worker_missing_state_policy() {
        let c = config();
        let h = FakeHost::default();
        assert_eq!(update_worker(&c, &h, 0, IfMissing::Skip, |_| Some(())), None);
        assert!(h.shared.is_empty(), "skip writes nothing");
        let seq = update_worker(&c, &h, 0, IfMissing::Create, |s| Some(s.begin_poll()));
        assert_eq!(seq, Some(1));
        let seq = update_worker(&c, &h, 0, IfMissing::Skip, |s| Some(s.begin_poll()));
        assert_eq!(seq, Some(2), "an existing state is updated either way");
        assert_eq!(update_worker(&c, &h, 0, IfMissing::Skip, |_| None::<()>), None);
        assert_eq!(read_worker_states(&c, &h)[0].as_ref().unwrap().sent_seq, 2);
        assert_eq!(
            update_worker(&c, &h, 5, IfMissing::Create, |_| Some(())),
            None,
            "no such worker"
        );
    }

    #[test]
    fn state_writes_are_logged_when_readers_follow_the_change_log() {
        let logged = |c: &Config, h: &FakeHost| -> Vec<u64> {
            changes::read(h, &Keys::of(c).changes()).map_or_else(Vec::new, |l| l.tags)
        };
        let tag = |c: &Config, a: &str| changes::worker_tag(&Keys::of(c).worker(&a.parse().unwrap()));
        // Reading every state: nothing logged, no extra call.
        let every = config();
        let h = FakeHost::default();
        update_worker(&every, &h, 0, IfMissing::Create, |s| Some(s.begin_poll()));
        assert!(logged(&every, &h).is_empty());
        // Created empty, then written under its token: no log write.
        assert_eq!(h.host_calls("shared_set"), 2);
        // Following the log: every successful write, once; a declined one not.
        let c = Config::from_json(
            br#"{"workers":[{"address":"10.0.0.1:1"},{"address":"10.0.0.2:1"}],"state_reads":"change_log"}"#,
        )
        .unwrap();
        let h = FakeHost::default();
        update_worker(&c, &h, 1, IfMissing::Create, |s| Some(s.begin_poll()));
        update_worker(&c, &h, 0, IfMissing::Skip, |s| Some(s.begin_poll()));
        update_worker(&c, &h, 1, IfMissing::Skip, |_| None::<()>);
        assert_eq!(logged(&c, &h), [tag(&c, "10.0.0.2:1")]);
        // A worker that left: its emptied state is logged too.
        let (a, b) = ("10.0.0.1:1".parse().unwrap(), "10.0.0.2:1".parse().unwrap());
        publish_members(&c, &h, &Members(vec![a, b]));
        publish_members(&c, &h, &Members(vec![a]));
        assert_eq!(logged(&c, &h), [tag(&c, "10.0.0.2:1"), tag(&c, "10.0.0.2:1")]);
    }

    #[test]
    fn writes_logged_together_are_appended_once_at_the_end() {
        let c = Config::from_json(
            br#"{"workers":[{"address":"10.0.0.1:1"},{"address":"10.0.0.2:1"}],"state_reads":"change_log"}"#,
        )
        .unwrap();
        let h = FakeHost::default();
        let key = Keys::of(&c).changes();
        let seen_inside = logged_together(&c, &h, || {
            update_worker(&c, &h, 1, IfMissing::Create, |s| Some(s.begin_poll()));
            update_worker(&c, &h, 0, IfMissing::Create, |s| Some(s.begin_poll()));
            h.shared.get(&key)
        });
        assert!(
            seen_inside.is_none(),
            "nothing appended before the writes are all made"
        );
        let tag = |i: usize| changes::worker_tag(&Keys::of(&c).worker(&c.routed()[i].address));
        let log = changes::read(&h, &key).unwrap();
        assert_eq!(log.tags, [tag(1), tag(0)]);
        // The log created empty, then one append.
        assert_eq!(h.shared.writes(&key), 2, "one append");
        // Afterwards, writes are logged one by one again.
        update_worker(&c, &h, 0, IfMissing::Skip, |s| Some(s.begin_poll()));
        assert_eq!(changes::read(&h, &key).unwrap().tags, [tag(1), tag(0), tag(0)]);
        // Nothing written: nothing appended.
        logged_together(&c, &h, || ());
        assert_eq!(h.shared.writes(&key), 3);
    }

    #[test]
    fn updates_retry_on_conflicts_then_give_up() {
        let c = config();
        let h = FakeHost::default();
        h.conflicts.set(3);
        assert_eq!(next_vm_id(&c, &h), 1);
        assert_eq!(next_vm_id(&c, &h), 2);
        h.conflicts.set(CAS_ATTEMPTS);
        assert_eq!(next_vm_id(&c, &h), 0);
        assert_eq!(h.counter(metrics::SHARED_DATA_CONFLICTS), 1);
    }

    #[test]
    fn refusals_are_recorded_once_per_worker_until_cleared() {
        let c = config();
        let h = FakeHost::default();
        let (a, b): (SocketAddr, SocketAddr) = ("10.0.0.2:1".parse().unwrap(), "10.0.0.1:1".parse().unwrap());
        assert!(!set_refused(&c, &h, a, false), "nothing to clear");
        assert!(set_refused(&c, &h, a, true));
        assert!(!set_refused(&c, &h, a, true), "another VM, the same episode");
        assert!(set_refused(&c, &h, b, true));
        let (bytes, _) = h.shared.get(&Keys::of(&c).refused()).unwrap();
        assert_eq!(decode::<Refused>(&bytes), Some(Refused(vec![b, a])));
        assert!(set_refused(&c, &h, a, false));
        assert!(set_refused(&c, &h, a, true), "a new episode");
    }

    #[test]
    fn a_configuration_is_announced_once() {
        let c = config();
        let h = FakeHost::default();
        assert!(first_to_announce(&c, &h, r#"{"a":1}"#));
        assert!(
            !first_to_announce(&c, &h, r#"{"a":1}"#),
            "another thread, same configuration"
        );
        assert!(first_to_announce(&c, &h, r#"{"a":2}"#), "a reload with a new one");
    }

    #[test]
    fn publishing_members_drops_the_state_of_those_that_left() {
        let c = config();
        let h = FakeHost::default();
        let a: SocketAddr = "10.0.0.1:1".parse().unwrap();
        let b: SocketAddr = "10.0.0.2:1".parse().unwrap();
        assert_eq!(
            publish_members(&c, &h, &Members(vec![a, b])),
            Some(Members::default())
        );
        assert_eq!(publish_members(&c, &h, &Members(vec![a, b])), None, "unchanged");
        h.shared_set(&Keys::of(&c).worker(&a), &encode(&polled(&[1])), None)
            .unwrap();
        assert_eq!(
            publish_members(&c, &h, &Members(vec![b])),
            Some(Members(vec![a, b]))
        );
        assert!(h.shared.get(&Keys::of(&c).worker(&a)).is_none(), "emptied");
        let (members, cas) = members_if_changed(&c, &h, None).unwrap();
        assert_eq!(members, Members(vec![b]));
        assert!(members_if_changed(&c, &h, Some(cas)).is_none());
    }
}
