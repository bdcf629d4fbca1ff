//! The requests admission holds on every thread of one Envoy, in shared
//! data (`<p>.held`): per VM, how many it holds of each class, when it last
//! said so, and how many it owes (a higher class that found the queue full
//! took the place of one of its lowest). It bounds the held requests over
//! every thread and lets a thread see a higher class waiting elsewhere. A
//! VM that stops saying (its thread gone) is forgotten after
//! [`HELD_TTL_MS`]. docs/overload.md says how the threads share the bound.

use crate::codec::{decode, Record};
use crate::config::admission::MAX_CLASSES;
use crate::config::Config;
use crate::host::Host;
use crate::shared_data::{self, Keys};
use serde::{Deserialize, Serialize};

/// An entry not written for this long is a thread that is gone (ms).
pub const HELD_TTL_MS: u64 = 2_000;
/// Most VMs the record keeps.
const MAX_VMS: usize = 4096;

#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct VmHeld {
    pub vm: u64,
    /// When this VM last wrote its entry (ms).
    pub at_ms: u64,
    /// Held requests per class.
    pub counts: Vec<u32>,
    /// Per class, requests this VM is to give up to a higher class.
    pub owed: Vec<u32>,
}

#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct HeldRecord {
    pub vms: Vec<VmHeld>,
}

impl Record for HeldRecord {
    const TAG: [u8; 4] = *b"DPQ1";
    fn within_limits(&self) -> bool {
        self.vms.len() <= MAX_VMS
            && self
                .vms
                .iter()
                .all(|v| v.counts.len() <= MAX_CLASSES && v.owed.len() <= MAX_CLASSES)
    }
}

/// Where a request that asked for a place in the queue stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reserved {
    /// It has a place.
    Held,
    /// It has the place of this thread's newest request of `class` (lower).
    DisplacesLocal(usize),
    /// It has a place another thread's lowest request gives up at that
    /// thread's next turn.
    DisplacesElsewhere,
    /// The queue is full of requests of its class or higher.
    Full,
}

fn at(v: &[u32], class: usize) -> u32 {
    v.get(class).copied().unwrap_or(0)
}

fn add(v: &mut Vec<u32>, class: usize, delta: i64) {
    if v.len() <= class {
        v.resize(class + 1, 0);
    }
    if let Some(c) = v.get_mut(class) {
        *c = (i64::from(*c) + delta).clamp(0, i64::from(u32::MAX)) as u32;
    }
}

impl HeldRecord {
    /// Drops the entries of threads gone silent (never `me`'s).
    fn prune(&mut self, me: u64, now_ms: u64) {
        self.vms
            .retain(|v| v.vm == me || v.at_ms.saturating_add(HELD_TTL_MS) >= now_ms);
    }

    fn live(&self, now_ms: u64) -> impl Iterator<Item = &VmHeld> {
        self.vms
            .iter()
            .filter(move |v| v.at_ms.saturating_add(HELD_TTL_MS) >= now_ms)
    }

    fn mine(&mut self, me: u64, now_ms: u64) -> &mut VmHeld {
        let i = match self.vms.iter().position(|v| v.vm == me) {
            Some(i) => i,
            None => {
                self.vms.push(VmHeld {
                    vm: me,
                    ..VmHeld::default()
                });
                self.vms.len() - 1
            }
        };
        let entry = &mut self.vms[i];
        entry.at_ms = now_ms;
        entry
    }

    /// Requests held over every live thread.
    pub fn total(&self, now_ms: u64) -> u64 {
        self.live(now_ms)
            .flat_map(|v| v.counts.iter())
            .map(|c| u64::from(*c))
            .sum()
    }

    /// The highest class (lowest index) another live thread holds.
    pub fn highest_elsewhere(&self, me: u64, now_ms: u64) -> Option<usize> {
        self.live(now_ms)
            .filter(|v| v.vm != me)
            .filter_map(|v| v.counts.iter().position(|c| *c > 0))
            .min()
    }

    /// Asks for a place for a request of `class` on thread `me`, at most
    /// `max` held in all; `local_lowest` is the lowest class `me` holds.
    pub fn reserve(
        &mut self,
        me: u64,
        class: usize,
        max: u32,
        now_ms: u64,
        local_lowest: Option<usize>,
    ) -> Reserved {
        self.prune(me, now_ms);
        let outcome = if self.total(now_ms) < u64::from(max) {
            Reserved::Held
        } else if let Some(lowest) = local_lowest.filter(|l| *l > class) {
            add(&mut self.mine(me, now_ms).counts, lowest, -1);
            Reserved::DisplacesLocal(lowest)
        } else if let Some((i, lowest)) = self.victim_elsewhere(me, class, now_ms) {
            add(&mut self.vms[i].owed, lowest, 1);
            Reserved::DisplacesElsewhere
        } else {
            return Reserved::Full;
        };
        add(&mut self.mine(me, now_ms).counts, class, 1);
        outcome
    }

    /// The thread holding the most of the lowest class below `class` not
    /// already owed, and that class.
    fn victim_elsewhere(&self, me: u64, class: usize, now_ms: u64) -> Option<(usize, usize)> {
        let spare = |v: &VmHeld, k: usize| at(&v.counts, k).saturating_sub(at(&v.owed, k));
        let lowest = self
            .live(now_ms)
            .filter(|v| v.vm != me)
            .filter_map(|v| (class + 1..MAX_CLASSES).rev().find(|k| spare(v, *k) > 0))
            .max()?;
        let (i, _) = self
            .vms
            .iter()
            .enumerate()
            .filter(|(_, v)| v.vm != me && v.at_ms.saturating_add(HELD_TTL_MS) >= now_ms)
            .max_by_key(|(_, v)| spare(v, lowest))?;
        Some((i, lowest))
    }

    /// A request of `class` left `me`'s queue.
    pub fn release(&mut self, me: u64, class: usize, now_ms: u64) {
        add(&mut self.mine(me, now_ms).counts, class, -1);
    }

    /// `me` says what it holds (`counts`, per class); returns what it owes.
    pub fn sync(&mut self, me: u64, counts: &[u32], now_ms: u64) -> Vec<u32> {
        self.prune(me, now_ms);
        let entry = self.mine(me, now_ms);
        entry.counts = counts.to_vec();
        std::mem::take(&mut entry.owed)
    }
}

/// The record as stored (empty when absent or unreadable).
pub fn read(config: &Config, host: &dyn Host) -> HeldRecord {
    shared_data::read(host, &Keys::of(config).held())
        .and_then(|(bytes, _)| decode(&bytes))
        .unwrap_or_default()
}

/// Read-modify-write of the record; None when the write failed (the
/// request is then refused as if the queue were full).
pub fn update<R>(
    config: &Config,
    host: &dyn Host,
    mut change: impl FnMut(&mut HeldRecord) -> R,
) -> Option<R> {
    shared_data::update(host, &Keys::of(config).held(), |record: Option<HeldRecord>| {
        let mut record = record.unwrap_or_default();
        let result = change(&mut record);
        Some((record, result))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_bound_holds_over_every_thread() {
        let mut r = HeldRecord::default();
        assert_eq!(r.reserve(1, 1, 2, 100, None), Reserved::Held);
        assert_eq!(r.reserve(2, 1, 2, 100, None), Reserved::Held);
        assert_eq!(r.total(100), 2);
        assert_eq!(r.reserve(2, 1, 2, 100, Some(1)), Reserved::Full, "same class");
        r.release(1, 1, 150);
        assert_eq!(r.reserve(2, 1, 2, 160, Some(1)), Reserved::Held);
        assert_eq!(r.total(160), 2);
    }

    #[test]
    fn a_higher_class_takes_a_lower_place_here_or_elsewhere() {
        let mut r = HeldRecord::default();
        r.reserve(1, 2, 3, 0, None);
        r.reserve(1, 2, 3, 0, None);
        r.reserve(2, 1, 3, 0, None);
        assert_eq!(
            r.reserve(2, 0, 3, 10, Some(1)),
            Reserved::DisplacesLocal(1),
            "its own lowest first"
        );
        assert_eq!(r.total(10), 3);
        assert_eq!(r.reserve(2, 0, 3, 10, Some(0)), Reserved::DisplacesElsewhere);
        assert_eq!(r.vms[0].owed, vec![0, 0, 1]);
        assert_eq!(r.total(10), 4, "until thread 1 gives one up");
        assert_eq!(r.reserve(2, 0, 3, 10, Some(0)), Reserved::DisplacesElsewhere);
        assert_eq!(
            r.reserve(2, 0, 3, 10, Some(0)),
            Reserved::Full,
            "both owed already"
        );
        assert_eq!(r.sync(1, &[0, 0, 0], 20), vec![0, 0, 2]);
        assert_eq!(r.total(20), 3);
        assert_eq!(r.highest_elsewhere(1, 20), Some(0));
        assert_eq!(r.highest_elsewhere(2, 20), None);
    }

    #[test]
    fn a_silent_thread_is_forgotten() {
        let mut r = HeldRecord::default();
        r.reserve(1, 0, 1, 0, None);
        assert_eq!(r.reserve(2, 0, 1, HELD_TTL_MS, None), Reserved::Full);
        assert_eq!(r.highest_elsewhere(2, HELD_TTL_MS), Some(0));
        assert_eq!(r.reserve(2, 0, 1, HELD_TTL_MS + 1, None), Reserved::Held);
        assert_eq!(r.vms.len(), 1, "pruned");
        assert_eq!(r.highest_elsewhere(2, HELD_TTL_MS + 1), None);
    }
}
