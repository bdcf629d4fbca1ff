//! The queueing model of one data-parallel rank.
//!
//! A rank holds a FIFO waiting queue, a batch being prefilled, a running
//! (decoding) batch and, in the decode role, requests whose KV cache is
//! still being transferred from the prefill worker. KV is reserved for the
//! whole request (prompt + every output token) at admission, so a running
//! request never has to be preempted; `used_kv` counts the tokens actually
//! written so far, which is what SGLang reports as `num_used_tokens`.

use std::collections::VecDeque;

use tokio::sync::mpsc::UnboundedSender;

use crate::config::Role;
use crate::protocol::Bootstrap;

/// Progress of a request, sent from the rank to the HTTP handler.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Event {
    /// Every sequence of the request now has this many output tokens.
    Tokens(u64),
    /// The request failed with this HTTP status.
    Failed { status: u16, message: String },
}

/// The sequences of one HTTP request (more than one for batched input);
/// they are scheduled together and advance in lockstep.
#[derive(Debug)]
pub struct SeqGroup {
    pub id: u64,
    pub seqs: u64,
    /// Prompt tokens of all sequences together.
    pub prompt_tokens: u64,
    /// Output tokens per sequence.
    pub max_new_tokens: u64,
    pub generated: u64,
    /// KV reserved at admission: prompt + seqs * max_new_tokens.
    pub reserved: u64,
    pub events: UnboundedSender<Event>,
    /// PD bootstrap fields (prefill: rooms to mark ready; decode: where to
    /// fetch the KV from).
    pub bootstrap: Option<Bootstrap>,
}

impl SeqGroup {
    /// KV tokens written so far.
    pub fn used(&self) -> u64 {
        self.prompt_tokens + self.seqs * self.generated
    }

    /// The client went away (SGLang aborts such requests).
    pub fn cancelled(&self) -> bool {
        self.events.is_closed()
    }

    fn finished(&self) -> bool {
        self.generated >= self.max_new_tokens
    }

    /// Records one more token per sequence and tells the handler; false if
    /// the handler is gone.
    fn emit_token(&mut self) -> bool {
        self.generated += 1;
        self.events.send(Event::Tokens(self.generated)).is_ok()
    }
}

/// What a rank reports to the load endpoints.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RankLoad {
    /// Sequences being prefilled or decoded.
    pub running: u64,
    /// Sequences queued (including, in the decode role, those waiting for
    /// their KV transfer).
    pub waiting: u64,
    /// KV tokens in use.
    pub used_tokens: u64,
    /// Prompt tokens of queued requests not yet admitted.
    pub pending_tokens: u64,
    /// HTTP requests on this rank not yet finished.
    pub in_flight: u64,
}

/// The next thing the rank's scheduler does.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Step {
    /// Prefill this many prompt tokens.
    Prefill {
        tokens: u64,
    },
    /// One decode step over a batch holding this many KV tokens.
    Decode {
        batch_tokens: u64,
    },
    Idle,
}

/// A request admitted in the decode role whose KV must now be fetched.
#[derive(Debug, Clone)]
pub struct TransferStart {
    pub id: u64,
    pub bootstrap: Option<Bootstrap>,
}

#[derive(Debug, Default)]
pub struct RankState {
    pub waiting: VecDeque<SeqGroup>,
    pub prefilling: Vec<SeqGroup>,
    pub running: Vec<SeqGroup>,
    pub transferring: Vec<SeqGroup>,
    pub used_kv: u64,
    pub reserved_kv: u64,
    /// Requests being answered in --instant mode (no scheduling).
    pub instant_requests: u64,
    pub instant_seqs: u64,
    pub instant_tokens: u64,
}

fn seqs_of<'a>(groups: impl IntoIterator<Item = &'a SeqGroup>) -> u64 {
    groups.into_iter().map(|group| group.seqs).sum()
}

impl RankState {
    pub fn load(&self) -> RankLoad {
        RankLoad {
            running: seqs_of(&self.prefilling) + seqs_of(&self.running) + self.instant_seqs,
            waiting: seqs_of(&self.waiting) + seqs_of(&self.transferring),
            used_tokens: self.used_kv + self.instant_tokens,
            pending_tokens: self.waiting.iter().map(|group| group.prompt_tokens).sum(),
            in_flight: (self.waiting.len()
                + self.prefilling.len()
                + self.running.len()
                + self.transferring.len()) as u64
                + self.instant_requests,
        }
    }

    /// Sequences holding a running slot.
    fn active_seqs(&self) -> u64 {
        seqs_of(&self.prefilling) + seqs_of(&self.running) + seqs_of(&self.transferring)
    }

    /// Frees the KV of a group leaving the rank.
    pub fn release(&mut self, group: &SeqGroup) {
        self.used_kv = self.used_kv.saturating_sub(group.used());
        self.reserved_kv = self.reserved_kv.saturating_sub(group.reserved);
    }

    /// Drops requests whose client went away, freeing their KV.
    pub fn purge_cancelled(&mut self) {
        self.waiting.retain(|group| !group.cancelled());
        let (gone, kept): (Vec<_>, Vec<_>) = std::mem::take(&mut self.running)
            .into_iter()
            .partition(SeqGroup::cancelled);
        self.running = kept;
        for group in &gone {
            self.release(group);
        }
    }

    /// Admits waiting requests in FIFO order while KV and running slots
    /// allow; the first that does not fit blocks those behind it. Returns
    /// the KV transfers to start (decode role).
    pub fn admit(&mut self, kv_capacity: u64, max_running: u64, role: Role) -> Vec<TransferStart> {
        let mut transfers = Vec::new();
        while let Some(front) = self.waiting.front() {
            let active = self.active_seqs();
            let fits_kv = self.reserved_kv + front.reserved <= kv_capacity;
            // A batch larger than max_running still runs, alone.
            let fits_slots = active == 0 || active + front.seqs <= max_running;
            if !(fits_kv && fits_slots) {
                break;
            }
            let Some(group) = self.waiting.pop_front() else {
                break;
            };
            self.reserved_kv += group.reserved;
            self.used_kv += group.prompt_tokens;
            if role == Role::Decode {
                transfers.push(TransferStart {
                    id: group.id,
                    bootstrap: group.bootstrap.clone(),
                });
                self.transferring.push(group);
            } else {
                self.prefilling.push(group);
            }
        }
        transfers
    }

    pub fn next_step(&self) -> Step {
        if !self.prefilling.is_empty() {
            Step::Prefill {
                tokens: self.prefilling.iter().map(|group| group.prompt_tokens).sum(),
            }
        } else if !self.running.is_empty() {
            Step::Decode {
                batch_tokens: self.running.iter().map(SeqGroup::used).sum(),
            }
        } else {
            Step::Idle
        }
    }

    /// Ends a prefill step: each prefilled request gets its first token.
    /// In the prefill role the request is then done and `mark_ready` is
    /// called with its rooms before the handler hears of it.
    pub fn finish_prefill(&mut self, role: Role, mark_ready: &mut dyn FnMut(&[u64])) {
        for mut group in std::mem::take(&mut self.prefilling) {
            if role == Role::Prefill {
                if let Some(bootstrap) = &group.bootstrap {
                    mark_ready(&bootstrap.rooms);
                }
            }
            let delivered = group.emit_token();
            self.used_kv += group.seqs;
            if !delivered || group.finished() || role == Role::Prefill {
                self.release(&group);
            } else {
                self.running.push(group);
            }
        }
    }

    /// Ends a decode step: every running request gets one more token.
    pub fn finish_decode(&mut self) {
        for mut group in std::mem::take(&mut self.running) {
            let delivered = group.emit_token();
            self.used_kv += group.seqs;
            if !delivered || group.finished() {
                self.release(&group);
            } else {
                self.running.push(group);
            }
        }
    }

    /// Ends the KV transfer of a decode-role request: on success it joins
    /// the running batch with the first token (computed by the prefill);
    /// on failure its KV is freed and the handler is told.
    pub fn finish_transfer(&mut self, id: u64, outcome: Result<(), String>) {
        let Some(position) = self.transferring.iter().position(|group| group.id == id) else {
            return;
        };
        let mut group = self.transferring.swap_remove(position);
        match outcome {
            Ok(()) => {
                let delivered = group.emit_token();
                self.used_kv += group.seqs;
                if !delivered || group.finished() {
                    self.release(&group);
                } else {
                    self.running.push(group);
                }
            }
            Err(message) => {
                self.release(&group);
                let _ = group.events.send(Event::Failed { status: 500, message });
            }
        }
    }

    /// Whether a transferring request is gone or its client left.
    pub fn transfer_abandoned(&self, id: u64) -> bool {
        self.transferring
            .iter()
            .find(|group| group.id == id)
            .is_none_or(SeqGroup::cancelled)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver};

    fn group(id: u64, prompt: u64, max_new: u64) -> (SeqGroup, UnboundedReceiver<Event>) {
        let (events, receiver) = unbounded_channel();
        let group = SeqGroup {
            id,
            seqs: 1,
            prompt_tokens: prompt,
            max_new_tokens: max_new,
            generated: 0,
            reserved: prompt + max_new,
            events,
            bootstrap: None,
        };
        (group, receiver)
    }

    #[test]
    fn admission_respects_kv_and_slots_in_fifo_order() {
        let mut state = RankState::default();
        let (a, _ra) = group(1, 500, 100);
        let (b, _rb) = group(2, 500, 100);
        let (c, _rc) = group(3, 10, 10);
        state.waiting.extend([a, b, c]);
        state.admit(1000, 64, Role::Regular);
        // b does not fit (600 + 600 > 1000) and blocks c behind it.
        assert_eq!(state.prefilling.len(), 1);
        assert_eq!(state.waiting.len(), 2);
        assert_eq!(state.load().pending_tokens, 510);
        assert_eq!(state.load().used_tokens, 500);

        let mut state = RankState::default();
        let (a, _ra) = group(1, 5, 5);
        let (b, _rb) = group(2, 5, 5);
        state.waiting.extend([a, b]);
        state.admit(1000, 1, Role::Regular);
        assert_eq!(state.prefilling.len(), 1);
        assert_eq!(state.waiting.len(), 1);
    }

    #[test]
    fn tokens_flow_and_kv_is_freed() {
        let mut state = RankState::default();
        let (a, mut receiver) = group(1, 100, 3);
        state.waiting.push_back(a);
        state.admit(1000, 64, Role::Regular);
        assert_eq!(state.next_step(), Step::Prefill { tokens: 100 });
        state.finish_prefill(Role::Regular, &mut |_| {});
        assert_eq!(receiver.try_recv().unwrap(), Event::Tokens(1));
        assert_eq!(state.next_step(), Step::Decode { batch_tokens: 101 });
        state.finish_decode();
        state.finish_decode();
        assert_eq!(receiver.try_recv().unwrap(), Event::Tokens(2));
        assert_eq!(receiver.try_recv().unwrap(), Event::Tokens(3));
        assert_eq!(state.next_step(), Step::Idle);
        assert_eq!((state.used_kv, state.reserved_kv), (0, 0));
    }

    #[test]
    fn cancelled_requests_free_their_kv() {
        let mut state = RankState::default();
        let (a, receiver) = group(1, 100, 50);
        state.waiting.push_back(a);
        state.admit(1000, 64, Role::Regular);
        state.finish_prefill(Role::Regular, &mut |_| {});
        drop(receiver);
        state.purge_cancelled();
        assert_eq!((state.used_kv, state.reserved_kv), (0, 0));
        assert_eq!(state.load(), RankLoad::default());
    }

    #[test]
    fn decode_role_waits_for_transfer() {
        let mut state = RankState::default();
        let (a, mut receiver) = group(7, 100, 2);
        state.waiting.push_back(a);
        let transfers = state.admit(1000, 64, Role::Decode);
        assert_eq!(transfers.len(), 1);
        assert_eq!(state.next_step(), Step::Idle);
        assert_eq!(state.load().waiting, 1);
        assert_eq!(state.load().used_tokens, 100);
        state.finish_transfer(7, Ok(()));
        assert_eq!(receiver.try_recv().unwrap(), Event::Tokens(1));
        state.finish_decode();
        assert_eq!(receiver.try_recv().unwrap(), Event::Tokens(2));
        assert_eq!((state.used_kv, state.reserved_kv), (0, 0));

        let (b, mut receiver) = group(8, 100, 2);
        state.waiting.push_back(b);
        state.admit(1000, 64, Role::Decode);
        state.finish_transfer(8, Err("timeout".into()));
        assert!(matches!(
            receiver.try_recv().unwrap(),
            Event::Failed { status: 500, .. }
        ));
        assert_eq!((state.used_kv, state.reserved_kv), (0, 0));
    }
}
