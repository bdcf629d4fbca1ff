//! Each VM's decoded copy of the workers' shared states, and what it needs
//! per request without allocating: the keys, the route header values and
//! the routed counters' names of the configuration in force.
//!
//! Every routing decision reads every worker's state (one shared-data read
//! each: proxy-wasm has no multi-key read and no way to learn a key's cas
//! without its value), but decodes only the states whose cas changed since
//! this VM last read them. Under load a request changes one or two workers
//! (its estimate, another's release), so the rest of the fleet is not
//! decoded again. The cas read with a state also lets the estimate be
//! written in one call when nobody wrote the worker in between.

use super::{decode, encode_into, update_worker, IfMissing, Keys};
use crate::config::Config;
use crate::host::{Host, SharedSetError};
use crate::metrics;
use crate::scheduler::Loads;
use crate::state::{Ticket, WorkerState};
use std::rc::Rc;

#[derive(Default)]
pub struct StateCache {
    /// The configuration the entries below follow.
    config: Option<Rc<Config>>,
    keys: Vec<String>,
    endpoints: Vec<Rc<str>>,
    /// cas of each state as read; None: absent, or written by this VM since.
    cas: Vec<Option<u32>>,
    states: Vec<Option<WorkerState>>,
    /// Effective tokens per rank, derived from `states` when they change.
    loads: Loads,
    /// `routed.<worker>.rank_<r>` names, filled as ranks are routed to.
    routed_names: Vec<Vec<String>>,
    /// Encoding buffer, reused.
    encoded: Vec<u8>,
}

impl StateCache {
    /// Follows `config` (rebuilding the per-worker tables when it changed)
    /// and reads every worker's state, decoding only those whose cas changed.
    pub fn refresh(&mut self, config: &Rc<Config>, host: &dyn Host) {
        if !self.config.as_ref().is_some_and(|c| Rc::ptr_eq(c, config)) {
            self.follow(config);
        }
        let mut relayout = false;
        for (index, ((key, cas), state)) in self
            .keys
            .iter()
            .zip(&mut self.cas)
            .zip(&mut self.states)
            .enumerate()
        {
            let changed = match host.shared_get(key) {
                Some((bytes, read)) if *cas != Some(read) => {
                    *state = decode(&bytes);
                    *cas = Some(read);
                    true
                }
                Some(_) => false,
                None => {
                    let had = state.is_some();
                    *state = None;
                    *cas = None;
                    had
                }
            };
            if changed && !relayout {
                relayout = !self.loads.update(index, state.as_ref());
            }
        }
        if relayout {
            self.loads.rebuild(&self.states);
        }
    }

    fn follow(&mut self, config: &Rc<Config>) {
        let keys = Keys::of(config);
        self.keys = config.all_workers().map(|w| keys.worker(&w.address)).collect();
        self.endpoints = config.all_workers().map(|w| Rc::from(w.endpoint())).collect();
        self.routed_names = vec![Vec::new(); self.keys.len()];
        self.cas = vec![None; self.keys.len()];
        self.states = vec![None; self.keys.len()];
        self.loads = Loads::of(&self.states);
        self.config = Some(config.clone());
    }

    /// The states as last read, indexed like `Config::all_workers`.
    pub fn states(&self) -> &[Option<WorkerState>] {
        &self.states
    }

    /// The loads derived from the states, indexed like them.
    pub fn loads(&self) -> &Loads {
        &self.loads
    }

    /// The route header value (`ip:port`) of worker `index`.
    pub fn endpoint(&self, index: usize) -> Rc<str> {
        self.endpoints.get(index).cloned().unwrap_or_else(|| Rc::from(""))
    }

    /// The name of the counter of requests routed to (`worker`, `rank`).
    pub fn routed_name(&mut self, worker: usize, rank: u32) -> &str {
        let name = self
            .config
            .as_ref()
            .and_then(|c| c.worker(worker))
            .map_or("", |w| w.name.as_str());
        let Some(names) = self.routed_names.get_mut(worker) else {
            return "";
        };
        while names.len() <= rank as usize {
            names.push(metrics::routed(name, names.len() as u32));
        }
        names.get(rank as usize).map_or("", String::as_str)
    }

    /// Adds a routed request's estimate to worker `index`'s state: one write
    /// when nobody wrote the state since it was read, else a read-modify-write.
    /// None when the worker has no state or the write failed.
    pub fn add_estimate(
        &mut self,
        config: &Config,
        host: &dyn Host,
        index: usize,
        rank: u32,
        cost: u64,
    ) -> Option<Ticket> {
        if let (Some(Some(cas)), Some(Some(state)), Some(key)) = (
            self.cas.get(index),
            self.states.get_mut(index),
            self.keys.get(index),
        ) {
            let ticket = state.add(index, rank, cost)?;
            if let Some(bytes) = encode_into(&*state, &mut self.encoded) {
                match host.shared_set(key, bytes, Some(*cas)) {
                    Ok(()) => {
                        // The new cas is unknown: the next read decodes this state again.
                        if let Some(cas) = self.cas.get_mut(index) {
                            *cas = None;
                        }
                        return Some(ticket);
                    }
                    Err(SharedSetError::Failed) => {
                        self.forget(index);
                        return None;
                    }
                    Err(SharedSetError::CasMismatch) => {}
                }
            }
            // Another thread wrote first: the cached copy is out of date.
            self.forget(index);
        }
        update_worker(config, host, index, IfMissing::Skip, |state| {
            state.add(index, rank, cost)
        })
    }

    /// Gives back a routed request's estimate: one write when this VM read the
    /// worker's state since anyone wrote it (under load another request
    /// usually has), else a read-modify-write. `config` is the one the
    /// request was routed with.
    pub fn release(&mut self, config: &Rc<Config>, host: &dyn Host, ticket: &Ticket) {
        let index = ticket.worker;
        let current = self.config.as_ref().is_some_and(|c| Rc::ptr_eq(c, config));
        if let (true, Some(Some(cas)), Some(Some(state)), Some(key)) = (
            current,
            self.cas.get(index),
            self.states.get_mut(index),
            self.keys.get(index),
        ) {
            state.release(ticket);
            let written = encode_into(&*state, &mut self.encoded)
                .map(|bytes| host.shared_set(key, bytes, Some(*cas)).is_ok())
                .unwrap_or(false);
            // Either way the cached copy is no longer known to match a cas.
            self.forget(index);
            if written {
                return;
            }
        }
        update_worker(config, host, index, IfMissing::Skip, |state| {
            state.release(ticket);
            Some(())
        });
    }

    /// Drops worker `index`'s cached state (the next read decodes it).
    fn forget(&mut self, index: usize) {
        if let (Some(cas), Some(state)) = (self.cas.get_mut(index), self.states.get_mut(index)) {
            *cas = None;
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
    use crate::router::testing::{fleet, poll};

    fn shared_reads(h: &FakeHost) -> u64 {
        h.host_calls("shared_get")
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
        assert_eq!(shared_reads(&h) - reads, 2, "one read per worker, every time");
        assert_eq!(cache.states(), first.as_slice());
        // Another thread writes worker 1: only its state changes.
        poll(&c, &h, 1, &[7, 7, 7, 7]);
        cache.refresh(&c, &h);
        assert_eq!(cache.states()[0], first[0]);
        assert_eq!(cache.states()[1].as_ref().unwrap().polled_tokens(0), Some(7));
        assert_eq!(
            cache.loads(),
            &Loads::of(cache.states()),
            "loads follow the states"
        );
        // A key emptied (a worker that left) reads as no state.
        h.shared_set(&Keys::of(&c).worker(&c.routed()[0].address), b"", None)
            .unwrap();
        cache.refresh(&c, &h);
        assert_eq!(cache.states()[0], None);
        assert_eq!(cache.loads(), &Loads::of(cache.states()));
    }

    #[test]
    fn an_estimate_is_one_write_unless_someone_wrote_in_between() {
        let (c, h) = fleet("");
        let c = Rc::new(c);
        let mut cache = StateCache::default();
        cache.refresh(&c, &h);
        let (reads, writes) = (shared_reads(&h), h.host_calls("shared_set"));
        let ticket = cache.add_estimate(&c, &h, 1, 2, 30).unwrap();
        assert_eq!(
            (shared_reads(&h) - reads, h.host_calls("shared_set") - writes),
            (0, 1)
        );
        assert_eq!(ticket.cost, 30);
        cache.refresh(&c, &h);
        assert_eq!(cache.states()[1].as_ref().unwrap().effective_tokens(2), Some(50));

        // Written by another thread since the read: read-modify-write, nothing lost.
        poll(&c, &h, 1, &[100, 100, 20, 100]);
        cache.add_estimate(&c, &h, 1, 2, 5).unwrap();
        cache.refresh(&c, &h);
        let state = cache.states()[1].clone().unwrap();
        assert_eq!(
            state.effective_tokens(2),
            Some(20 + 5),
            "the newer poll covers the first estimate"
        );
        assert_eq!(cache.add_estimate(&c, &h, 1, 9, 5), None, "no such rank");
    }

    #[test]
    fn a_release_is_one_write_when_the_state_was_read_since() {
        let (c, h) = fleet("");
        let c = Rc::new(c);
        let mut cache = StateCache::default();
        cache.refresh(&c, &h);
        let ticket = cache.add_estimate(&c, &h, 1, 2, 30).unwrap();
        cache.refresh(&c, &h); // another request of this VM read it since
        let (reads, writes) = (shared_reads(&h), h.host_calls("shared_set"));
        cache.release(&c, &h, &ticket);
        assert_eq!(
            (shared_reads(&h) - reads, h.host_calls("shared_set") - writes),
            (0, 1)
        );
        cache.refresh(&c, &h);
        assert_eq!(cache.states()[1].as_ref().unwrap().pending_total(), 0);

        // Not read since its own write: read-modify-write.
        let ticket = cache.add_estimate(&c, &h, 1, 2, 30).unwrap();
        let reads = shared_reads(&h);
        cache.release(&c, &h, &ticket);
        assert_eq!(shared_reads(&h) - reads, 1);
        // Routed with another configuration (a membership change): by its own indices.
        let ticket = cache.add_estimate(&c, &h, 1, 2, 30).unwrap();
        cache.refresh(&c, &h);
        let older = Rc::new((*c).clone());
        cache.release(&older, &h, &ticket);
        cache.refresh(&c, &h);
        assert_eq!(cache.states()[1].as_ref().unwrap().pending_total(), 0);
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
