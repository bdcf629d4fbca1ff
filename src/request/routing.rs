//! What every request of one VM shares ([`Routing`]): the configuration in
//! force with the cluster's current members, the decoded worker states and
//! health record, the tie-break sequence, and admission's queue on this
//! thread.

use super::held::Held;
use crate::config::Config;
use crate::discovery::Membership;
use crate::host::Host;
use crate::shared_data::cache::StateCache;
use std::cell::{Cell, RefCell};
use std::rc::Rc;

pub struct Routing {
    membership: RefCell<Membership>,
    pub(super) states: RefCell<StateCache>,
    tie_breaks: Cell<u64>,
    /// Admission's queue on this thread.
    pub(super) held: Held,
}

impl Routing {
    /// `seed` starts this VM's tie-break sequence apart from other threads'.
    pub fn new(config: Rc<Config>, seed: u64) -> Routing {
        Routing {
            membership: RefCell::new(Membership::new(config)),
            states: RefCell::new(StateCache::default()),
            tie_breaks: Cell::new(seed),
            held: Held::default(),
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
