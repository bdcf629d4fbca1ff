//! The passes that let held requests in or answer them, on one thread:
//! when a request ends here, when a poll's answer arrives, at every tick of
//! the root context (time-outs, places another thread's higher class took,
//! what this thread holds, the gauges), and when the filter goes away. A
//! pass acts on a held request through `set_effective_context` (Envoy
//! defers its resumption or reply until the callback returns) and leaves
//! the caller's context effective again. docs/overload.md says why each
//! pass runs where it does.

use super::held::{self, act_on, answer, back_to, queue_tick_period_ms, Left};
use super::prefill;
use super::route;
use super::{Action, Routing};
use crate::admission::held_record;
use crate::admission::Refusal;
use crate::config::WhenSaturated;
use crate::host::Host;
use crate::metrics::{self, HostCall};
use crate::router;

/// Lets held requests in, highest class first, while a rank has room
/// and no other thread holds a higher class; `return_to` is the context
/// to leave effective. From a request's end (`from_root` false) in PD
/// mode nothing is let in: the prefill leg's answer would go to the
/// context that dispatched it, which is ending.
pub fn let_in(routing: &Routing, host: &dyn Host, return_to: u32, from_root: bool) {
    let config = routing.current(host);
    let queues = config.admission.as_ref().is_some_and(|a| a.queues());
    if !queues || (!from_root && config.pd().is_some()) || routing.held.passing.replace(true) {
        return;
    }
    let mut acted = false;
    loop {
        let Some(next) = routing.held.queue.borrow_mut().pop() else {
            break;
        };
        if routing.held.elsewhere.get().is_some_and(|e| e < next.class) {
            routing.held.queue.borrow_mut().unpop(next);
            break;
        }
        let Some(request) = next.payload.upgrade() else {
            // Its context went without ending here: free its place.
            routing.held.released(&config, host, next.class);
            continue;
        };
        acted = true;
        if !act_on(host, next.id) {
            held::leave_queue(&mut request.borrow_mut(), host, Left::Gone);
            continue;
        }
        let resumed = route::resume(&mut request.borrow_mut(), host);
        match resumed {
            None => {
                routing.held.queue.borrow_mut().unpop(next);
                break;
            }
            Some(action) => {
                if action == Action::Continue && host.resume_request().is_err() {
                    // Its stream went at this instant: its end releases
                    // what routing charged.
                    host.count(&metrics::host_refused(HostCall::ResumeRequest), 1);
                }
                if let (true, Some(token)) = (from_root, request.borrow().prefill.token()) {
                    routing
                        .held
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
    routing.held.passing.set(false);
}

/// The root context's tick (`root` its context id): requests whose
/// time is up are answered, those another thread's higher class took
/// the place of too, this thread says what it holds, the gauges are
/// set, and requests are let in where there is room.
pub fn on_admission_tick(routing: &Routing, host: &dyn Host, root: u32) {
    super::delivery::write_delivered(routing, host);
    let config = routing.current(host);
    let Some(settings) = config.admission.clone() else {
        return;
    };
    let now = host.now_ms();
    let (overloaded, saturated) = router::overloaded_now(&config, host, &mut routing.states.borrow_mut());
    host.gauge(metrics::ADMISSION_SATURATED_RANKS, saturated);
    let WhenSaturated::Queue { timeout_ms, .. } = settings.when_saturated else {
        return;
    };
    let retry_after_ms = overloaded.map_or(0, |o| o.retry_after_ms);
    let mut acted = false;
    // Answered at the last tick before the time-out rather than the
    // first after it: never held longer than `queue_timeout_ms`.
    let next_tick = now.saturating_add(queue_tick_period_ms(&config));
    let expired = routing
        .held
        .queue
        .borrow()
        .waiting_since(next_tick.saturating_sub(timeout_ms.saturating_add(1)));
    for id in expired {
        let taken = routing.held.queue.borrow_mut().remove(id);
        if let Some(w) = taken {
            acted = true;
            answer(
                &config,
                &routing.held,
                host,
                w,
                Refusal::QueueTimeout,
                retry_after_ms,
                true,
            );
        }
    }
    let vm = routing.held.vm.get();
    let record = held_record::read(&config, host);
    let mine = record.vms.iter().find(|v| v.vm == vm);
    let counts = routing.held.queue.borrow().counts();
    let stale = mine.is_some_and(|m| m.counts != counts || m.owed.iter().any(|o| *o > 0));
    let total = if !counts.is_empty() && counts.iter().any(|c| *c > 0) || stale {
        let synced = held_record::update(&config, host, |r| {
            let owed = r.sync(vm, &counts, now);
            (owed, r.highest_elsewhere(vm, now), r.total(now))
        });
        let (owed, elsewhere, total) = synced.unwrap_or_default();
        routing.held.elsewhere.set(elsewhere);
        for (class, n) in owed.iter().enumerate() {
            for _ in 0..*n {
                let taken = {
                    let mut queue = routing.held.queue.borrow_mut();
                    queue.newest_in(class).and_then(|v| queue.remove(v))
                };
                let Some(w) = taken else { break };
                acted = true;
                answer(
                    &config,
                    &routing.held,
                    host,
                    w,
                    Refusal::Displaced,
                    retry_after_ms,
                    true,
                );
            }
        }
        total
    } else {
        routing.held.elsewhere.set(record.highest_elsewhere(vm, now));
        record.total(now)
    };
    host.gauge(metrics::ADMISSION_HELD, total);
    if acted {
        back_to(host, root);
    }
    if overloaded.is_none() {
        let_in(routing, host, root, true);
    }
}

/// A callout answered at the root: if it is the prefill leg of a
/// request the root let in, it is handed to that request (true).
pub fn on_root_callout(
    routing: &Routing,
    host: &dyn Host,
    token: u32,
    headers: usize,
    body_size: usize,
    root: u32,
) -> bool {
    let Some((id, entry)) = routing.held.callouts.borrow_mut().remove(&token) else {
        return false;
    };
    let answer = host.callout_response(headers, body_size);
    if let Some(request) = entry.upgrade() {
        if act_on(host, id) {
            prefill::on_answer(&mut request.borrow_mut(), host, &answer);
            back_to(host, root);
        }
    }
    true
}

/// The filter is going away (its configuration replaced, or Envoy
/// stopping): every held request is answered.
pub fn drain_held(routing: &Routing, host: &dyn Host, root: u32) {
    let config = routing.current(host);
    let ids = routing.held.queue.borrow().ids();
    for id in &ids {
        let taken = routing.held.queue.borrow_mut().remove(*id);
        if let Some(w) = taken {
            answer(&config, &routing.held, host, w, Refusal::Draining, 1000, true);
        }
    }
    if !ids.is_empty() {
        back_to(host, root);
    }
}
