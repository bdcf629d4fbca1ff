//! `switching`: traffic that changes under a fixed setting, as a service's
//! mix changes by the hour, here every few minutes: `no-prefix`, `bursty`
//! and the Mooncake conversation trace in turn, [`SEGMENT_S`] each, each at
//! the same share of its own sustainable capacity (the trace's rate is the
//! plan's rate x [`Workload::trace_rate_share`], which the suite sets from
//! the two capacities). A part keeps its own requests, output cap and
//! seed; only its arrivals outside its segments are dropped.

use super::{OutputCap, Plan, Shape, Workload, WorkloadKind};

pub const DESCRIPTION: &str = "no-prefix, bursty and the Mooncake conversation trace in turn, 180 s each, each at the offered share of its own sustainable capacity";

/// How long each part runs before the next takes over (simulated s).
pub const SEGMENT_S: f64 = 180.0;

/// The parts, in the order they take turns (`no-prefix` first).
pub const PARTS: [WorkloadKind; 3] = [
    WorkloadKind::NoPrefix,
    WorkloadKind::Bursty,
    WorkloadKind::MooncakeConversation,
];

/// The part whose segment holds simulated time `at_s`.
pub fn part_at(at_s: f64) -> WorkloadKind {
    PARTS[(at_s.max(0.0) / SEGMENT_S).floor() as usize % PARTS.len()]
}

/// Part `kind` of the mix as a workload of its own: the mix's trace
/// options, the part's own output cap.
pub fn part(mix: &Workload, kind: WorkloadKind) -> Workload {
    Workload {
        kind,
        trace: mix.trace.clone(),
        cap: OutputCap::default_for(kind),
        trace_rate_share: None,
    }
}

/// The plan: each part's plan over the whole run at its rate, kept in its
/// own segments (a part whose first segment starts after the run is not
/// planned).
pub fn plan(mix: &Workload, shape: &Shape) -> Result<Plan, String> {
    let share = mix.trace_rate_share.filter(|s| s.is_finite() && *s > 0.0).ok_or(
        "`switching` needs the trace's rate as a share of no-prefix's (set by the suite from their capacities)",
    )?;
    let mut out = Plan::default();
    for (turn, kind) in PARTS.into_iter().enumerate() {
        if turn as f64 * SEGMENT_S >= shape.duration_s {
            // Its first segment starts after the run.
            continue;
        }
        let rate = match kind.is_trace() {
            true => shape.rate * share,
            false => shape.rate,
        };
        let plan = part(mix, kind).plan(&Shape { rate, ..*shape })?;
        out.requests
            .extend(plan.requests.into_iter().filter(|r| part_at(r.at_s) == kind));
        out.notes.extend(plan.notes);
    }
    out.requests.sort_by(|a, b| a.at_s.total_cmp(&b.at_s));
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::workload::Api;

    #[test]
    fn the_parts_take_turns_every_segment() {
        assert_eq!(part_at(0.0), WorkloadKind::NoPrefix);
        assert_eq!(part_at(SEGMENT_S - 0.01), WorkloadKind::NoPrefix);
        assert_eq!(part_at(SEGMENT_S), WorkloadKind::Bursty);
        assert_eq!(part_at(2.0 * SEGMENT_S + 1.0), WorkloadKind::MooncakeConversation);
        assert_eq!(part_at(3.0 * SEGMENT_S), WorkloadKind::NoPrefix);
    }

    #[test]
    fn a_plan_without_the_trace_share_is_refused() {
        let mix = Workload::new(WorkloadKind::Switching);
        let shape = Shape {
            rate: 10.0,
            duration_s: 30.0,
            seed: 1,
            max_prompt: 8192,
            max_output: 1024,
        };
        let err = plan(&mix, &shape).unwrap_err();
        assert!(err.contains("share"), "{err}");
    }

    #[test]
    fn synthetic_segments_send_their_parts_requests_at_the_plans_rate() {
        // Two segments of the synthetic parts (the trace's needs its file).
        let mix = Workload {
            trace_rate_share: Some(0.1),
            ..Workload::new(WorkloadKind::Switching)
        };
        let shape = Shape {
            rate: 20.0,
            duration_s: 2.0 * SEGMENT_S,
            seed: 7,
            max_prompt: 8192,
            max_output: 1024,
        };
        let plan = plan(&mix, &shape).unwrap();
        let first: Vec<_> = plan.requests.iter().filter(|r| r.at_s < SEGMENT_S).collect();
        let second: Vec<_> = plan.requests.iter().filter(|r| r.at_s >= SEGMENT_S).collect();
        assert!(plan.requests.windows(2).all(|w| w[0].at_s <= w[1].at_s));
        for part in [&first, &second] {
            let rate = part.len() as f64 / SEGMENT_S;
            assert!((15.0..25.0).contains(&rate), "{rate}");
            assert!(part.iter().all(|r| r.api == Api::Generate));
        }
        // The same requests as the parts alone, in their segments.
        let alone = Workload::new(WorkloadKind::NoPrefix).plan(&shape).unwrap();
        let alone: Vec<_> = alone.requests.iter().filter(|r| r.at_s < SEGMENT_S).collect();
        assert_eq!(first.len(), alone.len());
        assert!(first
            .iter()
            .zip(&alone)
            .all(|(a, b)| a.body == b.body && a.at_s == b.at_s));
    }
}
