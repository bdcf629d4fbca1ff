//! The shared-data codec (`codec.rs`) of `WorkerState`, and the accounting it carries.
//!
//! Properties:
//! - `shared_data::decode` never panics on arbitrary bytes; what it accepts
//!   re-encodes to bytes that decode to the same state;
//! - for states built through the public API (`begin_poll`, `apply_snapshot`,
//!   `add`, `release`, `mark_unreachable`) driven by arbitrary operations,
//!   `decode(encode(x)) == Some(x)` after every operation;
//! - and the accounting of worker_state.rs holds against a model: a snapshot is
//!   applied only if its sequence is newer than the last one and was
//!   dispatched; `add` succeeds only for a rank the last report listed and its
//!   ticket names the last dispatched poll; the pending estimates are exactly
//!   those of the requests not yet released whose poll no snapshot has
//!   covered (a report listing fewer ranks keeps them: their requests still
//!   end); effective tokens = polled + those estimates, for listed ranks; an
//!   old ticket never takes a newer request's estimate. Releasing every
//!   ticket leaves nothing pending.
#![no_main]

use arbitrary::{Arbitrary, Result, Unstructured};
use dprank::codec::{decode, encode};
use dprank::config::MAX_DP_SIZE;
use dprank::worker_state::{Ticket, WorkerState};
use libfuzzer_sys::fuzz_target;

#[derive(Debug)]
enum Op {
    BeginPoll,
    /// `back` picks the sequence: the last dispatched one minus `back`
    /// (0 and beyond `sent_seq` included).
    Snapshot {
        back: u8,
        now: u64,
        tokens: Vec<Option<u64>>,
    },
    Add {
        rank: u16,
        cost: u64,
    },
    Release {
        which: u16,
    },
    Unreachable,
}

impl<'a> Arbitrary<'a> for Op {
    fn arbitrary(u: &mut Unstructured<'a>) -> Result<Self> {
        Ok(match u.int_in_range(0..=9)? {
            0 | 1 => Op::BeginPoll,
            2 | 3 => {
                let len = if u.ratio(1, 50)? {
                    u.int_in_range(0..=MAX_DP_SIZE as usize)?
                } else {
                    u.int_in_range(0..=8)?
                };
                let mut tokens = Vec::with_capacity(len);
                for _ in 0..len {
                    tokens.push(match u.int_in_range(0..=9)? {
                        0 => None,
                        1 => Some(u64::MAX),
                        2 => Some(u.arbitrary()?),
                        _ => Some(u.int_in_range(0..=100_000)?),
                    });
                }
                Op::Snapshot {
                    back: u.int_in_range(0..=4)?,
                    now: u.arbitrary()?,
                    tokens,
                }
            }
            4..=6 => Op::Add {
                rank: u.int_in_range(0..=9)?,
                cost: if u.ratio(1, 20)? {
                    u.arbitrary()?
                } else {
                    u.int_in_range(0..=5000)?
                },
            },
            7 | 8 => Op::Release {
                which: u.arbitrary()?,
            },
            _ => Op::Unreachable,
        })
    }
}

/// A ticket not released yet, and whether its estimate should still count.
struct Outstanding {
    ticket: Ticket,
    counted: bool,
}

/// `DPRANK_FUZZ_TRACE=1`: print the operations (to read a crash).
fn trace() -> bool {
    static TRACE: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *TRACE.get_or_init(|| std::env::var_os("DPRANK_FUZZ_TRACE").is_some())
}

fn roundtrip(w: &WorkerState) {
    let bytes = encode(w);
    assert_eq!(
        decode::<WorkerState>(&bytes).as_ref(),
        Some(w),
        "decode(encode(x)) != x"
    );
}

fn check_raw(data: &[u8]) {
    if let Some(w) = decode::<WorkerState>(data) {
        assert_eq!(decode::<WorkerState>(&encode(&w)), Some(w));
    }
}

fn check_ops(data: &[u8]) {
    let mut u = Unstructured::new(data);
    let mut w = WorkerState::default();
    let mut out: Vec<Outstanding> = Vec::new();
    // Exact sums only while nothing can have saturated.
    let mut added: u128 = 0;
    let mut polled: Vec<Option<u64>> = Vec::new();
    roundtrip(&w);
    while !u.is_empty() {
        let Ok(op) = Op::arbitrary(&mut u) else { break };
        if trace() {
            eprintln!("{op:?}");
        }
        match op {
            Op::BeginPoll => {
                let before = w.sent_seq;
                assert_eq!(w.begin_poll(), before + 1);
            }
            Op::Snapshot { back, now, tokens } => {
                let seq = w.sent_seq.saturating_add(1).saturating_sub(u64::from(back));
                let newer = seq > w.snapshot_seq && seq <= w.sent_seq;
                assert_eq!(
                    w.apply_snapshot(seq, now, &tokens),
                    newer,
                    "snapshot {seq} applied?"
                );
                if newer {
                    assert_eq!(
                        (w.snapshot_seq, w.snapshot_at_ms, w.unreachable),
                        (seq, now, false)
                    );
                    assert_eq!(w.ranks(), tokens.len());
                    polled = tokens.iter().map(|t| t.map(|v| v.min(u64::MAX - 1))).collect();
                    // The poll covers the requests routed before it left. The
                    // estimates on ranks the report no longer lists stay until
                    // their requests end (worker_state.rs: a worker restarted smaller).
                    for o in &mut out {
                        if o.ticket.seq < seq {
                            o.counted = false;
                        }
                    }
                }
            }
            Op::Add { rank, cost } => {
                let known_rank = usize::from(rank) < w.ranks();
                let sent = w.sent_seq;
                match w.add(7, u32::from(rank), cost) {
                    Some(t) => {
                        assert!(known_rank);
                        assert_eq!(
                            t,
                            Ticket {
                                worker: 7,
                                rank: u32::from(rank),
                                seq: sent,
                                cost
                            }
                        );
                        added += u128::from(cost);
                        out.push(Outstanding {
                            ticket: t,
                            counted: true,
                        });
                    }
                    None => assert!(!known_rank, "add refused for rank {rank} of {}", w.ranks()),
                }
            }
            Op::Release { which } => {
                if !out.is_empty() {
                    let o = out.remove(usize::from(which) % out.len());
                    if trace() {
                        eprintln!("  releases {:?}", o.ticket);
                    }
                    w.release(&o.ticket);
                }
            }
            Op::Unreachable => {
                w.mark_unreachable();
                assert!(w.unreachable && !w.is_fresh(w.snapshot_at_ms, u64::MAX));
            }
        }
        roundtrip(&w);
        if added < u128::from(u64::MAX / 2) {
            check_accounting(&w, &out, &polled);
        }
    }
    for o in out.drain(..) {
        w.release(&o.ticket);
    }
    roundtrip(&w);
    assert_eq!(w.pending_total(), 0, "estimates left after every request ended");
}

fn check_accounting(w: &WorkerState, out: &[Outstanding], polled: &[Option<u64>]) {
    let pending = |rank: usize| -> u64 {
        out.iter()
            .filter(|o| o.counted && o.ticket.rank as usize == rank)
            .map(|o| o.ticket.cost)
            .sum()
    };
    let total: u64 = out.iter().filter(|o| o.counted).map(|o| o.ticket.cost).sum();
    assert_eq!(w.pending_total(), total, "pending estimates");
    for rank in 0..w.ranks() + 1 {
        let want = polled
            .get(rank)
            .copied()
            .flatten()
            .map(|p| p.saturating_add(pending(rank)));
        assert_eq!(w.effective_tokens(rank), want, "effective tokens of rank {rank}");
        assert_eq!(w.polled_tokens(rank), polled.get(rank).copied().flatten());
    }
}

fuzz_target!(|data: &[u8]| {
    check_raw(data);
    check_ops(data);
});
