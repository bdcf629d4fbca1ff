//! Holding, admission's queue mode on one thread: the requests held here
//! ([`Held`], in the order of `admission::queue`), their places in the
//! shared record (`admission/held_record.rs`), and a request's stay: held,
//! refused, let in, or gone. The routing task (`route.rs`) refuses or holds
//! a request here as admission decides; the passes that let held requests
//! in or answer them are in `passes.rs`.

use super::{Action, Request};
use crate::admission::held_record::{self, Reserved};
use crate::admission::queue::HeldQueue;
use crate::admission::{Applicant, Controller, Refusal, Waiting};
use crate::config::{Config, WhenSaturated};
use crate::host::Host;
use crate::metrics::{self, AdmissionEvent, HostCall};
use crate::poller;
use hashbrown::HashMap;
use std::cell::{Cell, RefCell};
use std::rc::Weak;

/// Tick period in queue mode, at most (ms): a held request is answered at
/// most a tick before its time is up, and room a poll or another thread
/// made is used within one.
pub const QUEUE_TICK_MS: u64 = 50;

pub(super) type Entry = Weak<RefCell<Request>>;

/// This thread's held requests.
#[derive(Default)]
pub struct Held {
    /// This VM's id in the shared record.
    pub(super) vm: Cell<u64>,
    pub(super) queue: RefCell<HeldQueue<Entry>>,
    /// The highest class another thread held at this thread's last look.
    pub(super) elsewhere: Cell<Option<usize>>,
    /// A pass is running (a pass never starts another).
    pub(super) passing: Cell<bool>,
    /// PD: prefill calls the root dispatched for requests it let in, by
    /// token (their answers come to the root).
    pub(super) callouts: RefCell<HashMap<u32, (u32, Entry)>>,
}

/// The tick period: the poller's, at most [`QUEUE_TICK_MS`] in queue mode.
pub fn queue_tick_period_ms(config: &Config) -> u64 {
    let tick = poller::tick_period_ms(config);
    match config.admission.as_ref().map(|a| a.when_saturated) {
        Some(WhenSaturated::Queue { .. }) => tick.min(QUEUE_TICK_MS),
        _ => tick,
    }
}

/// Admission's view of one request (admission on).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Admitting {
    pub applicant: Applicant,
    /// While held: since when (ms).
    held_since: Option<u64>,
    /// While held: its place in the shared record is its own (not given
    /// to a higher class already).
    holds_place: bool,
}

impl Admitting {
    pub fn new(applicant: Applicant) -> Admitting {
        Admitting {
            applicant,
            held_since: None,
            holds_place: false,
        }
    }

    pub fn is_held(&self) -> bool {
        self.held_since.is_some()
    }
}

/// How a held request left the queue.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Left {
    Admitted,
    Refused,
    /// Its client went away.
    Gone,
}

impl Held {
    /// The highest class held, here or on another thread at the last look
    /// (0 the highest; None: nothing).
    pub(super) fn highest(&self) -> Option<usize> {
        let here = self.queue.borrow().highest_class();
        here.into_iter().chain(self.elsewhere.get()).min()
    }

    /// How many are held on this thread.
    pub fn len(&self) -> usize {
        self.queue.borrow().len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub(super) fn remove(&self, id: u32) {
        self.queue.borrow_mut().remove(id);
    }

    /// A request of `class` asks for a place (it is context `id`, on the
    /// effective context). A full queue gives it the place of the newest of
    /// the lowest class below it, here (answered now) or on another thread
    /// (answered at that thread's next tick); else it is refused.
    #[allow(clippy::too_many_arguments)]
    fn enter(
        &self,
        config: &Config,
        host: &dyn Host,
        id: u32,
        me: &Entry,
        class: usize,
        tenant: u64,
        now_ms: u64,
        retry_after_ms: u64,
    ) -> Result<(), Refusal> {
        let Some(WhenSaturated::Queue { max_queued, .. }) =
            config.admission.as_ref().map(|a| a.when_saturated)
        else {
            return Err(Refusal::Saturated);
        };
        if me.strong_count() == 0 {
            // Not a request Envoy can resume (tests and tools without contexts).
            return Err(Refusal::QueueFull);
        }
        let lowest = self.queue.borrow().lowest_class();
        let vm = self.vm.get();
        let reserved =
            held_record::update(config, host, |r| r.reserve(vm, class, max_queued, now_ms, lowest));
        match reserved {
            None | Some(Reserved::Full) => return Err(Refusal::QueueFull),
            Some(Reserved::DisplacesLocal(lowest)) => {
                let victim = {
                    let mut queue = self.queue.borrow_mut();
                    queue.newest_in(lowest).and_then(|v| queue.remove(v))
                };
                if let Some(victim) = victim {
                    // Its place in the record went to this request already.
                    answer(
                        config,
                        self,
                        host,
                        victim,
                        Refusal::Displaced,
                        retry_after_ms,
                        false,
                    );
                    back_to(host, id);
                }
            }
            Some(Reserved::Held | Reserved::DisplacesElsewhere) => {}
        }
        self.queue
            .borrow_mut()
            .push(id, class, tenant, now_ms, me.clone());
        Ok(())
    }

    /// A request of `class` left this thread's queue: its place is free.
    pub(super) fn released(&self, config: &Config, host: &dyn Host, class: usize) {
        let (vm, now) = (self.vm.get(), host.now_ms());
        held_record::update(config, host, |r| r.release(vm, class, now));
    }
}

/// Answers a held request, already out of the queue, with `refusal`. With
/// `counted`, its place in the record is still its own and is freed.
pub(super) fn answer(
    config: &Config,
    held: &Held,
    host: &dyn Host,
    w: Waiting<Entry>,
    refusal: Refusal,
    retry_after_ms: u64,
    counted: bool,
) {
    let Some(request) = w.payload.upgrade() else {
        // Its context went without ending here.
        if counted {
            held.released(config, host, w.class);
        }
        return;
    };
    let mut request = request.borrow_mut();
    if !counted {
        // Leaving must not free a place that is no longer its own.
        forget_place(&mut request);
    }
    if act_on(host, w.id) {
        answer_held(&mut request, host, refusal, retry_after_ms);
    } else {
        leave_queue(&mut request, host, Left::Gone);
    }
}

/// Makes held request `id` the effective context; false (counted) if its
/// stream is gone: it only leaves the queue then.
pub(super) fn act_on(host: &dyn Host, id: u32) -> bool {
    let ok = host.set_effective_context(id).is_ok();
    if !ok {
        host.count(&metrics::host_refused(HostCall::EffectiveContext), 1);
    }
    ok
}

/// Makes `id` (the context a pass started from) effective again. It is the
/// context of the callback running: the proxy does not refuse it.
pub(super) fn back_to(host: &dyn Host, id: u32) {
    if let Err(e) = host.set_effective_context(id) {
        log::warn!("cannot return to context {id} after an admission pass: {e}");
    }
}

// A request's side of admission: refused, held, and its stay in the queue.

/// Counts `event` for the request's class (admission on).
fn count_event(req: &Request, host: &dyn Host, event: AdmissionEvent) {
    if let Some(a) = req.admitting {
        Controller::new(req.config.admission.as_ref()).count(host, event, a.applicant.class);
    }
}

/// Refuses the request (it is on the effective context) with
/// `refusal`, counted by reason and class.
pub(super) fn refuse(req: &Request, host: &dyn Host, refusal: Refusal, retry_after_ms: u64) -> Action {
    let class = req.admitting.map(|a| a.applicant.class);
    Controller::new(req.config.admission.as_ref()).count_refusal(host, refusal, class);
    refusal.reply(retry_after_ms).send(host);
    Action::Pause
}

/// Queue mode: holds the request for room (paused), or refuses it when
/// the queue is full; `retry_after_ms` is what the fleet said (0: not
/// asked, others wait already).
pub(super) fn hold(req: &mut Request, host: &dyn Host, retry_after_ms: u64) -> Action {
    let Some(a) = req.admitting else {
        return Action::Continue;
    };
    let now = host.now_ms();
    let Applicant { class, tenant } = a.applicant;
    let entered = req.routing.held.enter(
        &req.config,
        host,
        req.id,
        &req.me,
        class,
        tenant,
        now,
        retry_after_ms,
    );
    match entered {
        Ok(()) => {
            req.admitting = Some(Admitting {
                held_since: Some(now),
                holds_place: true,
                ..a
            });
            count_event(req, host, AdmissionEvent::Queued);
            Action::Pause
        }
        Err(refusal) => refuse(req, host, refusal, retry_after_ms),
    }
}

/// A held request leaves the queue (already taken out of it), `how`.
pub(super) fn leave_queue(req: &mut Request, host: &dyn Host, how: Left) {
    let Some(a) = req.admitting else {
        return;
    };
    let Some(since) = a.held_since else {
        return;
    };
    req.admitting = Some(Admitting {
        held_since: None,
        holds_place: false,
        ..a
    });
    if a.holds_place {
        req.routing.held.released(&req.config, host, a.applicant.class);
    }
    host.histogram(
        metrics::ADMISSION_QUEUE_WAIT_MS,
        host.now_ms().saturating_sub(since),
    );
    if how == Left::Gone {
        count_event(req, host, AdmissionEvent::ClientGone);
    }
}

/// Its place in the shared record went to a higher class already.
fn forget_place(req: &mut Request) {
    if let Some(a) = &mut req.admitting {
        a.holds_place = false;
    }
}

/// A held request (on the effective context, out of the queue) is
/// answered by admission with `refusal`.
fn answer_held(req: &mut Request, host: &dyn Host, refusal: Refusal, retry_after_ms: u64) {
    leave_queue(req, host, Left::Refused);
    refuse(req, host, refusal, retry_after_ms);
}

/// The request ends while held (its client went away): it gives up its
/// place.
pub(super) fn leave_if_held(req: &mut Request, host: &dyn Host) {
    if req.is_held() {
        req.routing.held.remove(req.id);
        leave_queue(req, host, Left::Gone);
    }
}
