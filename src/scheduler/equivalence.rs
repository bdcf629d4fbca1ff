//! `choose`, `alternates` and `choose_with_alternates` against a
//! straightforward implementation of the same policy (load only): every
//! candidate listed in (worker, rank) order with its cost computed from the
//! state itself, then the least cost with ties sampled as `least_cost`
//! documents, or `headroom` offered the same candidates. The pipeline's
//! shortcuts (steps skipped when they do not apply, the slots past
//! `only_rank`, the picker's early exit, the load scorer's branch-free loop,
//! the alternates collected in the choice's pass, the workers passed over by
//! the pruning, the ties it counts without slots: `pruning/`) must never
//! change a choice.

use super::pickers::headroom;
use super::pickers::least_cost::{mix, next_take};
use super::pruning;
use super::runner::alternates_in_same_pass;
use super::testing::{eject, loads_at, state, worker};
use super::*;
use crate::cost::{MAX_COST, REMOVED};
use crate::health::Target;

/// A small deterministic generator (splitmix64 steps).
struct Draw(u64);

impl Draw {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(1);
        mix(self.0, 0x5EED)
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }
    fn chance(&mut self, percent: u64) -> bool {
        self.below(100) < percent
    }
}

/// Each worker's candidates as the policy defines them, costs from the
/// state (not from `LoadTable`): `REMOVED` for a rank that may not be chosen.
fn candidates(pool: &Pool, ctx: &Context) -> Vec<(usize, Vec<Slot>)> {
    let mut out = Vec::new();
    for (index, (w, state)) in pool.workers.iter().zip(pool.states).enumerate() {
        let Some(state) = state else { continue };
        if !state.is_fresh(ctx.now_ms, ctx.stale_after_ms) {
            continue;
        }
        let ranks = w
            .dp_size
            .map_or(state.ranks(), |dp| state.ranks().min(dp as usize));
        let mut slots = vec![0; ranks];
        let Some(ranks_out) = ctx.health.admitted(w.address, ctx.now_ms, ctx.admit_probing) else {
            continue;
        };
        for rank in ranks_out {
            if let Some(slot) = slots.get_mut(rank as usize) {
                *slot = REMOVED;
            }
        }
        if let Some(only) = ctx.constraint.only_rank {
            let only = only as usize;
            if only >= ranks {
                continue;
            }
            for (r, slot) in slots.iter_mut().enumerate() {
                if r != only {
                    *slot = REMOVED;
                }
            }
        }
        if let Some(pin) = ctx.constraint.pin {
            let Some((name, rank)) = pin.rsplit_once('/') else {
                continue;
            };
            let name = name.trim();
            if w.name != name && w.address.to_string() != name {
                continue;
            }
            match rank.trim().parse::<usize>() {
                Ok(rank) if rank < ranks => {
                    for (r, slot) in slots.iter_mut().enumerate() {
                        if r != rank {
                            *slot = REMOVED;
                        }
                    }
                }
                _ => continue,
            }
        }
        let others = u64::from(ctx.gateways.saturating_sub(1));
        for (r, slot) in slots.iter_mut().enumerate() {
            if *slot == REMOVED {
                continue;
            }
            *slot = match state.effective_tokens(r) {
                None => REMOVED,
                Some(tokens) => {
                    let peers = state.pending_tokens(r).saturating_mul(others);
                    tokens.min(MAX_COST).saturating_add(peers).min(MAX_COST)
                }
            };
        }
        out.push((index, slots));
    }
    out
}

fn straightforward_choice(pool: &Pool, ctx: &Context) -> Option<Candidate> {
    let listed = candidates(pool, ctx);
    let chosen = match ctx.pick {
        Pick::LeastCost => {
            let mut best: Option<Candidate> = None;
            // Reservoir sampling as `least_cost` skips through it.
            let (mut ties, mut next) = (0u64, 0u64);
            for (worker, slots) in &listed {
                for (rank, &cost) in slots.iter().enumerate() {
                    if cost == REMOVED {
                        continue;
                    }
                    let c = Candidate {
                        worker: *worker,
                        rank: rank as u32,
                        cost,
                    };
                    match best {
                        Some(b) if cost > b.cost => {}
                        Some(b) if cost == b.cost => {
                            ties += 1;
                            if ties == next {
                                best = Some(c);
                                next = next_take(ctx.tie_breaker, ties);
                            }
                        }
                        _ => {
                            best = Some(c);
                            ties = 1;
                            next = next_take(ctx.tie_breaker, ties);
                        }
                    }
                }
            }
            best
        }
        Pick::Headroom { .. } => {
            let mut picker = headroom::Headroom::new(ctx);
            for (worker, slots) in &listed {
                picker.offer(*worker, slots);
            }
            picker.pick()
        }
    }?;
    Some(Candidate {
        worker: chosen.worker + pool.offset,
        ..chosen
    })
}

fn straightforward_alternates(pool: &Pool, ctx: &Context, chosen: &Candidate, max: usize) -> Vec<Candidate> {
    let strict = Context {
        constraint: Constraint {
            only_rank: Some(chosen.rank),
            pin: None,
        },
        admit_probing: false,
        ..*ctx
    };
    let mut found: Vec<Candidate> = candidates(pool, &strict)
        .into_iter()
        .filter(|(w, _)| w + pool.offset != chosen.worker)
        .filter_map(|(w, slots)| {
            let cost = *slots.get(chosen.rank as usize)?;
            (cost != REMOVED).then_some(Candidate {
                worker: w + pool.offset,
                rank: chosen.rank,
                cost,
            })
        })
        .collect();
    found.sort_by_key(|c| (c.cost, c.worker));
    found.truncate(max);
    found
}

#[test]
fn choices_and_alternates_match_a_straightforward_implementation() {
    let mut draw = Draw(7);
    let (mut chosen, mut ties_broken, mut pinned, mut only, mut probed, mut alternated) = (0, 0, 0, 0, 0, 0);
    let mut folded = 0;
    let passed_over = pruning::PASSED_OVER.get();
    let tallied = pruning::COUNTED_UNSCORED.get();
    for _fleet in 0..3000 {
        // Now and then a larger fleet, where most workers are passed over (`pruning`).
        let most = if draw.chance(10) { 64 } else { 12 };
        let n = 1 + draw.below(most) as usize;
        let workers: Vec<Worker> = (0..n)
            .map(|i| {
                let dp = draw.chance(30).then(|| 1 + draw.below(6) as u32);
                worker(&format!("w{i}"), 1000 + i as u16, dp)
            })
            .collect();
        // Small token counts so that ties are common; a few unknown ranks,
        // stale, unreachable and unpolled workers, and pending estimates.
        // Now and then an idle fleet: every known rank at 0, all tie.
        let spread = match draw.below(10) {
            0..=1 => 1,
            2..=5 => 4,
            _ => 60_000,
        };
        let states: Vec<Option<WorkerState>> = (0..n)
            .map(|i| {
                if draw.chance(8) {
                    return None;
                }
                if draw.chance(4) {
                    return Some(WorkerState::default());
                }
                // Up to 12 ranks: workers past 8 are scored in another buffer.
                let ranks = 1 + draw.below(12) as usize;
                let tokens: Vec<u64> = (0..ranks).map(|_| draw.below(spread)).collect();
                let at = if draw.chance(10) {
                    0
                } else {
                    1000 + draw.below(500)
                };
                let mut s = state(&tokens, at);
                if draw.chance(5) {
                    let seq = s.begin_poll();
                    let partial: Vec<Option<u64>> =
                        tokens.iter().map(|t| (!draw.chance(25)).then_some(*t)).collect();
                    s.apply_snapshot(seq, at, &partial);
                }
                for _ in 0..draw.below(4) {
                    let rank = draw.below(ranks as u64) as u32;
                    let _ = s.add(i, rank, draw.below(spread));
                }
                if draw.chance(4) {
                    s.mark_unreachable();
                }
                Some(s)
            })
            .collect();
        let now_ms = 1500 + if draw.chance(10) { draw.below(4000) } else { 0 };
        let mut health = Health::default();
        if draw.chance(40) {
            for _ in 0..1 + draw.below(4) {
                let w = &workers[draw.below(n as u64) as usize];
                let rank = draw.chance(60).then(|| draw.below(8) as u32);
                let at = now_ms.saturating_sub(draw.below(2500));
                let target = Target {
                    worker: w.address,
                    rank,
                };
                eject(&mut health, target, at);
            }
            if draw.chance(30) {
                health
                    .envoy_unhealthy
                    .push(workers[draw.below(n as u64) as usize].address);
                health.envoy_unhealthy.sort();
            }
        }
        let offset = draw.below(3) as usize;
        let loads = loads_at(offset, &states);
        let pool = Pool {
            workers: &workers,
            states: &states,
            loads: &loads,
            offset,
        };
        let pin = {
            let w = &workers[draw.below(n as u64) as usize];
            let rank = draw.below(9);
            match draw.below(5) {
                0 => format!("{}/{rank}", w.name),
                1 => format!(" {} / {rank}", w.address),
                2 => w.name.clone(),
                _ => "nobody/0".into(),
            }
        };
        for _request in 0..8 {
            let constraint = Constraint {
                only_rank: draw.chance(20).then(|| draw.below(9) as u32),
                pin: draw.chance(15).then_some(pin.as_str()),
            };
            let pick = if draw.chance(30) {
                Pick::Headroom {
                    choices: 1 + draw.below(crate::config::gateways::MAX_CHOICES as u64) as u32,
                }
            } else {
                Pick::LeastCost
            };
            let ctx = Context {
                now_ms,
                stale_after_ms: 3000,
                constraint,
                tie_breaker: draw.next(),
                health: &health,
                admit_probing: draw.chance(30),
                prefix: None,
                pick,
                gateways: 1 + draw.below(4) as u32,
                room: None,
            };
            let expected = straightforward_choice(&pool, &ctx);
            let got = choose(&pool, &ctx);
            assert_eq!(
                got, expected,
                "ctx {ctx:?}\nworkers {workers:?}\nstates {states:?}"
            );
            let Some(c) = got else {
                assert_eq!(choose_with_alternates(&pool, &ctx, 2), None);
                continue;
            };
            chosen += 1;
            pinned += usize::from(constraint.pin.is_some());
            only += usize::from(constraint.only_rank.is_some());
            probed += usize::from(ctx.admit_probing && !health.is_empty());
            // The first of the least costs, as a picker without sampling would take.
            let first = candidates(&pool, &ctx).iter().find_map(|(w, s)| {
                s.iter()
                    .position(|x| *x == c.cost)
                    .map(|r| (w + offset, r as u32))
            });
            ties_broken += usize::from(first != Some((c.worker, c.rank)));
            for max in [0, 1, 2, 5] {
                let alts = alternates(&pool, &ctx, &c, max);
                assert_eq!(
                    alts,
                    straightforward_alternates(&pool, &ctx, &c, max),
                    "max {max}, ctx {ctx:?}"
                );
                alternated += usize::from(alts.len() > 1);
                // In one pass where the costs allow (else two): the same
                // choice, and the alternates of the same context by load.
                let by_load = Context {
                    constraint: Constraint::default(),
                    prefix: None,
                    ..ctx
                };
                let expected = alternates(&pool, &by_load, &c, max);
                assert_eq!(
                    choose_with_alternates(&pool, &ctx, max),
                    Some((c, expected.clone())),
                    "max {max}, ctx {ctx:?}"
                );
                folded += usize::from(alternates_in_same_pass(&ctx) && expected.len() > 1);
            }
        }
    }
    // The draws must reach what they are meant to test.
    for (what, count) in [
        ("chosen", chosen),
        ("a tie not broken to the first", ties_broken),
        ("pinned", pinned),
        ("only_rank", only),
        ("probing", probed),
        ("several alternates", alternated),
        ("several alternates in one pass", folded),
        ("a worker passed over", pruning::PASSED_OVER.get() - passed_over),
        ("a worker tallied", pruning::COUNTED_UNSCORED.get() - tallied),
    ] {
        assert!(count > 50, "{what}: only {count} cases");
    }
}

#[test]
fn idle_fleets_match_a_straightforward_implementation() {
    // Every rank at the same load: every worker ties the pick and most are
    // counted by `pruning::count_ties`; some are stale, unpolled, unreachable,
    // capped by dp_size, out of rotation or cheaper (a tie taken or beaten).
    let mut draw = Draw(13);
    let tallied = pruning::COUNTED_UNSCORED.get();
    let (mut checked, mut not_first) = (0, 0);
    for _fleet in 0..400 {
        let n = 1 + draw.below(80) as usize;
        let workers: Vec<Worker> = (0..n)
            .map(|i| {
                let dp = draw.chance(20).then(|| 1 + draw.below(8) as u32);
                worker(&format!("w{i}"), 2000 + i as u16, dp)
            })
            .collect();
        let load = draw.below(3) * 100;
        let states: Vec<Option<WorkerState>> = (0..n)
            .map(|_| {
                if draw.chance(5) {
                    return None;
                }
                if draw.chance(3) {
                    return Some(WorkerState::default());
                }
                let most = if draw.chance(10) { 12 } else { 8 };
                let ranks = 1 + draw.below(most) as usize;
                let tokens: Vec<u64> = (0..ranks)
                    .map(|_| {
                        if draw.chance(2) {
                            load.saturating_sub(1)
                        } else {
                            load
                        }
                    })
                    .collect();
                let at = if draw.chance(8) { 0 } else { 1000 };
                let mut s = state(&tokens, at);
                if draw.chance(3) {
                    s.mark_unreachable();
                }
                Some(s)
            })
            .collect();
        let mut health = Health::default();
        if draw.chance(25) {
            let w = &workers[draw.below(n as u64) as usize];
            let rank = draw.chance(50).then(|| draw.below(8) as u32);
            let target = Target {
                worker: w.address,
                rank,
            };
            eject(&mut health, target, 1400);
        }
        let offset = draw.below(3) as usize;
        let loads = loads_at(offset, &states);
        let pool = Pool {
            workers: &workers,
            states: &states,
            loads: &loads,
            offset,
        };
        for _request in 0..10 {
            let ctx = Context {
                now_ms: 1500 + if draw.chance(10) { 3000 } else { 0 },
                stale_after_ms: 3000,
                constraint: Constraint {
                    only_rank: draw.chance(10).then(|| draw.below(9) as u32),
                    pin: None,
                },
                tie_breaker: draw.next(),
                health: &health,
                admit_probing: draw.chance(20),
                prefix: None,
                pick: Pick::LeastCost,
                gateways: if draw.chance(15) { 2 } else { 1 },
                room: None,
            };
            let expected = straightforward_choice(&pool, &ctx);
            assert_eq!(choose(&pool, &ctx), expected, "ctx {ctx:?}\nstates {states:?}");
            let Some(c) = expected else {
                assert_eq!(choose_with_alternates(&pool, &ctx, 2), None);
                continue;
            };
            checked += 1;
            not_first += usize::from(c.worker != candidates(&pool, &ctx).first().map_or(0, |w| w.0 + offset));
            let by_load = Context {
                constraint: Constraint::default(),
                ..ctx
            };
            for max in [0, 1, 2, 5] {
                let alts = straightforward_alternates(&pool, &by_load, &c, max);
                assert_eq!(
                    choose_with_alternates(&pool, &ctx, max),
                    Some((c, alts)),
                    "max {max}, ctx {ctx:?}"
                );
            }
        }
    }
    let tallied = pruning::COUNTED_UNSCORED.get() - tallied;
    assert!(
        checked > 1000 && not_first > 500 && tallied > 10_000,
        "{checked} {not_first} {tallied}"
    );
}
