//! What every request of one VM shares ([`Routing`]): the configuration in
//! force with the cluster's current members, the decoded worker states and
//! health record, the tie-break sequence, admission's queue on this
//! thread, and what answers showed SLO admission since its last tick.

use super::held::Held;
use crate::config::Config;
use crate::discovery::Membership;
use crate::host::Host;
use crate::shared_data::cache::StateCache;
use crate::worker_state::slo::Observation;
use std::cell::{Cell, RefCell};
use std::rc::Rc;

pub struct Routing {
    membership: RefCell<Membership>,
    pub(super) states: RefCell<StateCache>,
    tie_breaks: Cell<u64>,
    /// Admission's queue on this thread.
    pub(super) held: Held,
    /// SLO admission: what answers showed since this thread's last tick,
    /// written to the workers' shared states at the next one.
    pub(super) delivered: RefCell<Vec<Delivered>>,
}

/// One observation of a rank, by a request routed under `config`.
#[derive(Debug)]
pub(super) struct Delivered {
    pub config: Rc<Config>,
    /// Index in `config.all_workers`.
    pub worker: usize,
    /// The rank's index in the worker's state.
    pub rank: usize,
    pub observation: Observation,
}

/// Most observations a thread keeps between two ticks (more are dropped).
pub const MAX_DELIVERED: usize = 4096;

impl Routing {
    /// `seed` starts this VM's tie-break sequence apart from other threads'.
    pub fn new(config: Rc<Config>, seed: u64) -> Routing {
        Routing {
            membership: RefCell::new(Membership::new(config)),
            states: RefCell::new(StateCache::default()),
            tie_breaks: Cell::new(seed),
            held: Held::default(),
            delivered: RefCell::new(Vec::new()),
        }
    }

    /// This VM's id among those sharing the data (admission's shared record).
    pub fn set_vm(&self, vm: u64) {
        self.held.vm.set(vm);
    }

    /// The configuration with the current cluster membership, if any.
    pub fn current(&self, host: &dyn Host) -> Rc<Config> {
        self.membership.borrow_mut().current(host)
    }

    /// The configuration as written (headers-time decisions need nothing more).
    pub(super) fn base(&self) -> Rc<Config> {
        self.membership.borrow().base()
    }

    pub(super) fn next_tie_breaker(&self) -> u64 {
        let t = self.tie_breaks.get().wrapping_add(1);
        self.tie_breaks.set(t);
        t
    }
}
