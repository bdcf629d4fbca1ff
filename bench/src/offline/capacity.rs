//! The fleet's capacity for a workload, measured offline the way
//! `capacity.rs` measures it on the real harness: the oracle at an offered
//! rate above what the fleet serves, for `WINDOW_S` simulated seconds,
//! counting completions in the last two thirds of the window; an offered
//! rate the fleet kept up with is raised 1.6x and the run repeated.

use crate::capacity::{completion_rate, saturated, SEED, WINDOW_S};
use crate::runner::{Kv, MAX_OUTPUT};
use crate::variant::Variant;
use crate::workload::{Shape, Workload, WorkloadKind};

use super::{driver, sim_config, OfflineArgs};

const MAX_ATTEMPTS: usize = 8;

pub fn measure(args: &OfflineArgs, workload: &Workload, kv: Kv) -> Result<f64, String> {
    // Bursty sends no-prefix's requests: its load is a share of that capacity.
    let workload = &match workload.kind {
        WorkloadKind::Bursty => Workload::new(WorkloadKind::NoPrefix),
        _ => workload.clone(),
    };
    let oracle = Variant::parse("oracle")?;
    let mut offered = match kv {
        Kv::Small => 16.0,
        Kv::Large => 40.0,
    } * args.workers as f64
        / 2.0;
    for _ in 0..MAX_ATTEMPTS {
        let plan = workload.plan(&Shape {
            rate: offered,
            duration_s: WINDOW_S,
            seed: SEED,
            max_prompt: kv.max_prompt(),
            max_output: MAX_OUTPUT,
        })?;
        let spec = driver::RunSpec {
            variant: &oracle,
            sim: sim_config(kv, args.dp_size, &[])?,
            workers: args.workers,
            seed: SEED,
            turn_horizon_s: WINDOW_S,
            cut_at_s: Some(WINDOW_S),
            requests_out: None,
        };
        let (output, _) = driver::run(&plan, &spec)?;
        let ends: Vec<f64> = output.records.iter().map(|r| r.end_s).collect();
        let completed = completion_rate(&ends, WINDOW_S);
        if saturated(offered, completed) {
            return Ok(completed);
        }
        offered *= 1.6;
    }
    Err(format!(
        "capacity of `{}`: the fleet kept up even at {offered:.1} req/s",
        workload.kind.name()
    ))
}
