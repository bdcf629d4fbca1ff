//! Admission's queue mode on one thread: the requests held here (in the
//! order of `router::admission::queue`), their places in the shared
//! record (`held_record.rs`), and the passes that let them in or answer
//! them: when a request ends here, at every tick, and when the filter goes
//! away. A pass acts on a held request through `set_effective_context`
//! (Envoy defers its resumption or reply until the callback returns) and
//! leaves the caller's context effective again. docs/overload.md says why
//! each pass runs where it does.

use super::held_record::{self, Reserved};
use super::{Action, Left, Request, Resumed, Routing};
use crate::config::{Config, WhenSaturated};
use crate::host::Host;
use crate::metrics::{self, HostCall};
use crate::poller;
use crate::router::admission_queue::{HeldQueue, Waiting};
use crate::router::{self, RejectReason};
use hashbrown::HashMap;
use std::cell::{Cell, RefCell};
use std::rc::Weak;

/// Tick period in queue mode, at most (ms): a held request is answered at
/// most a tick before its time is up, and room a poll or another thread
/// made is used within one.
pub const QUEUE_TICK_MS: u64 = 50;

type Entry = Weak<RefCell<Request>>;

/// This thread's held requests.
#[derive(Default)]
pub struct Held {
    /// This VM's id in the shared record.
    pub(super) vm: Cell<u64>,
    queue: RefCell<HeldQueue<Entry>>,
    /// The highest class another thread held at this thread's last look.
    elsewhere: Cell<Option<usize>>,
    /// A pass is running (a pass never starts another).
    passing: Cell<bool>,
    /// PD: prefill calls the root dispatched for requests it let in, by
    /// token (their answers come to the root).
    callouts: RefCell<HashMap<u32, (u32, Entry)>>,
}

/// The tick period: the poller's, at most [`QUEUE_TICK_MS`] in queue mode.
pub fn queue_tick_period_ms(config: &Config) -> u64 {
    let tick = poller::tick_period_ms(config);
    match config.admission.as_ref().map(|a| a.when_saturated) {
        Some(WhenSaturated::Queue { .. }) => tick.min(QUEUE_TICK_MS),
        _ => tick,
    }
}

impl Held {
    /// Whether a request of `class` must wait behind others: this thread,
    /// or another at the last look, holds requests of that class or higher.
    pub(super) fn must_wait(&self, class: usize) -> bool {
        let here = self.queue.borrow().highest_class();
        here.into_iter().chain(self.elsewhere.get()).any(|h| h <= class)
    }

    /// Whether anything is held, here or elsewhere at the last look.
    pub(super) fn any(&self) -> bool {
        !self.queue.borrow().is_empty() || self.elsewhere.get().is_some()
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
    pub(super) fn enter(
        &self,
        config: &Config,
        host: &dyn Host,
        id: u32,
        me: &Entry,
        class: usize,
        tenant: u64,
        now_ms: u64,
        retry_after_ms: u64,
    ) -> Result<(), RejectReason> {
        let Some(WhenSaturated::Queue { max_queued, .. }) =
            config.admission.as_ref().map(|a| a.when_saturated)
        else {
            return Err(RejectReason::Saturated);
        };
        if me.strong_count() == 0 {
            // Not a request Envoy can resume (tests and tools without contexts).
            return Err(RejectReason::QueueFull);
        }
        let lowest = self.queue.borrow().lowest_class();
        let vm = self.vm.get();
        let reserved =
            held_record::update(config, host, |r| r.reserve(vm, class, max_queued, now_ms, lowest));
        match reserved {
            None | Some(Reserved::Full) => return Err(RejectReason::QueueFull),
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
                        RejectReason::Displaced,
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

/// Answers a held request, already out of the queue, with `reason`. With
/// `counted`, its place in the record is still its own and is freed.
fn answer(
    config: &Config,
    held: &Held,
    host: &dyn Host,
    w: Waiting<Entry>,
    reason: RejectReason,
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
        request.forget_place();
    }
    if act_on(host, w.id) {
        request.answer_held(host, reason, retry_after_ms);
    } else {
        request.leave_queue(host, Left::Gone);
    }
}

/// Makes held request `id` the effective context; false (counted) if its
/// stream is gone: it only leaves the queue then.
fn act_on(host: &dyn Host, id: u32) -> bool {
    let ok = host.set_effective_context(id).is_ok();
    if !ok {
        host.count(&metrics::host_refused(HostCall::EffectiveContext), 1);
    }
    ok
}

/// Makes `id` (the context a pass started from) effective again. It is the
/// context of the callback running: the proxy does not refuse it.
fn back_to(host: &dyn Host, id: u32) {
    if let Err(e) = host.set_effective_context(id) {
        log::warn!("cannot return to context {id} after an admission pass: {e}");
    }
}

impl Routing {
    /// Lets held requests in, highest class first, while a rank has room
    /// and no other thread holds a higher class; `return_to` is the context
    /// to leave effective. From a request's end (`from_root` false) in PD
    /// mode nothing is let in: the prefill leg's answer would go to the
    /// context that dispatched it, which is ending.
    pub fn let_in(&self, host: &dyn Host, return_to: u32, from_root: bool) {
        let config = self.current(host);
        let queues = config.admission.as_ref().is_some_and(|a| a.queues());
        if !queues || (!from_root && config.pd().is_some()) || self.held.passing.replace(true) {
            return;
        }
        let mut acted = false;
        loop {
            let Some(next) = self.held.queue.borrow_mut().pop() else {
                break;
            };
            if self.held.elsewhere.get().is_some_and(|e| e < next.class) {
                self.held.queue.borrow_mut().unpop(next);
                break;
            }
            let Some(request) = next.payload.upgrade() else {
                // Its context went without ending here: free its place.
                self.held.released(&config, host, next.class);
                continue;
            };
            acted = true;
            if !act_on(host, next.id) {
                request.borrow_mut().leave_queue(host, Left::Gone);
                continue;
            }
            let resumed = request.borrow_mut().resume(host);
            match resumed {
                Resumed::Overloaded(_) => {
                    self.held.queue.borrow_mut().unpop(next);
                    break;
                }
                Resumed::Go(action) => {
                    if action == Action::Continue && host.resume_request().is_err() {
                        // Its stream went at this instant: its end releases
                        // what routing charged.
                        host.count(&metrics::host_refused(HostCall::ResumeRequest), 1);
                    }
                    if let (true, Some(token)) = (from_root, request.borrow().prefill_token) {
                        self.held
                            .callouts
                            .borrow_mut()
                            .insert(token, (next.id, next.payload.clone()));
                    }
                }
            }
        }
        if acted {
            back_to(host, return_to);
        }
        self.held.passing.set(false);
    }

    /// The root context's tick (`root` its context id): requests whose
    /// time is up are answered, those another thread's higher class took
    /// the place of too, this thread says what it holds, the gauges are
    /// set, and requests are let in where there is room.
    pub fn on_admission_tick(&self, host: &dyn Host, root: u32) {
        let config = self.current(host);
        let Some(settings) = config.admission.clone() else {
            return;
        };
        let now = host.now_ms();
        let (overload, saturated) = router::overload_now(&config, host, &mut self.states.borrow_mut());
        host.gauge(metrics::ADMISSION_SATURATED_RANKS, saturated);
        let WhenSaturated::Queue { timeout_ms, .. } = settings.when_saturated else {
            return;
        };
        let retry_after_ms = overload.map_or(0, |o| o.retry_after_ms);
        let mut acted = false;
        // Answered at the last tick before the time-out rather than the
        // first after it: never held longer than `queue_timeout_ms`.
        let next_tick = now.saturating_add(queue_tick_period_ms(&config));
        let expired = self
            .held
            .queue
            .borrow()
            .waiting_since(next_tick.saturating_sub(timeout_ms.saturating_add(1)));
        for id in expired {
            let taken = self.held.queue.borrow_mut().remove(id);
            if let Some(w) = taken {
                acted = true;
                answer(
                    &config,
                    &self.held,
                    host,
                    w,
                    RejectReason::QueueTimeout,
                    retry_after_ms,
                    true,
                );
            }
        }
        let vm = self.held.vm.get();
        let record = held_record::read(&config, host);
        let mine = record.vms.iter().find(|v| v.vm == vm);
        let counts = self.held.queue.borrow().counts();
        let stale = mine.is_some_and(|m| m.counts != counts || m.owed.iter().any(|o| *o > 0));
        let total = if !counts.is_empty() && counts.iter().any(|c| *c > 0) || stale {
            let synced = held_record::update(&config, host, |r| {
                let owed = r.sync(vm, &counts, now);
                (owed, r.highest_elsewhere(vm, now), r.total(now))
            });
            let (owed, elsewhere, total) = synced.unwrap_or_default();
            self.held.elsewhere.set(elsewhere);
            for (class, n) in owed.iter().enumerate() {
                for _ in 0..*n {
                    let taken = {
                        let mut queue = self.held.queue.borrow_mut();
                        queue.newest_in(class).and_then(|v| queue.remove(v))
                    };
                    let Some(w) = taken else { break };
                    acted = true;
                    answer(
                        &config,
                        &self.held,
                        host,
                        w,
                        RejectReason::Displaced,
                        retry_after_ms,
                        true,
                    );
                }
            }
            total
        } else {
            self.held.elsewhere.set(record.highest_elsewhere(vm, now));
            record.total(now)
        };
        host.gauge(metrics::ADMISSION_HELD, total);
        if acted {
            back_to(host, root);
        }
        if overload.is_none() {
            self.let_in(host, root, true);
        }
    }

    /// A callout answered at the root: if it is the prefill leg of a
    /// request the root let in, it is handed to that request (true).
    pub fn on_root_callout(
        &self,
        host: &dyn Host,
        token: u32,
        headers: usize,
        body_size: usize,
        root: u32,
    ) -> bool {
        let Some((id, entry)) = self.held.callouts.borrow_mut().remove(&token) else {
            return false;
        };
        let answer = host.callout_response(headers, body_size);
        if let Some(request) = entry.upgrade() {
            if act_on(host, id) {
                request.borrow_mut().on_prefill_answer(host, &answer);
                back_to(host, root);
            }
        }
        true
    }

    /// The filter is going away (its configuration replaced, or Envoy
    /// stopping): every held request is answered.
    pub fn drain_held(&self, host: &dyn Host, root: u32) {
        let config = self.current(host);
        let ids = self.held.queue.borrow().ids();
        for id in &ids {
            let taken = self.held.queue.borrow_mut().remove(*id);
            if let Some(w) = taken {
                answer(&config, &self.held, host, w, RejectReason::Draining, 1000, true);
            }
        }
        if !ids.is_empty() {
            back_to(host, root);
        }
    }
}
