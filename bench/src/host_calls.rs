//! `dprank-bench host-calls`: what the proxy-wasm host calls dprank makes
//! cost inside Envoy, so that dprank's overhead over a no-op filter splits
//! into its host calls and the rest (its own code in V8).
//!
//! The no-op filter (`bench/noop-filter`) in `calls kind=n,...` mode makes
//! those calls per request and nothing else. Repeating one kind `REPEAT`
//! times gives one call's cost (its router CPU per request minus the
//! pass-through filter's, divided by `REPEAT`); making the calls dprank's
//! header mode makes beyond the no-op header router, once each, gives their
//! cost among other work. dprank and the no-op router run in the same runs:
//! what dprank adds over the router, less those calls, is its own code.

use std::fmt::Write as _;
use std::path::PathBuf;

use clap::Args;

use crate::client::pooled_client;
use crate::envoy::{Balancer, NoopMode};
use crate::fleet::{start_envoy, Front, Tools};
use crate::overhead::{
    header_mode, instant_worker, measure, pin_routers, with_interval, Cell, Shape, Target,
};
use crate::report::{fmt_spread, markdown_table, report_header};

#[derive(Debug, Clone, Args)]
pub struct HostCallsArgs {
    /// Measured seconds per (variant, cell) and run.
    #[arg(long, default_value_t = 2.0)]
    pub seconds: f64,
    /// Interleaved runs; intervals are over runs.
    #[arg(long, default_value_t = 5)]
    pub runs: usize,
    #[arg(long, default_value = "bench-results/cost")]
    pub out: PathBuf,
}

/// Calls per request in each one-kind variant: enough that their cost
/// stands well above the run-to-run noise of one request's CPU.
const REPEAT: u32 = 40;

/// One kind of host call: the no-op filter's name for it, what it is, and
/// the calls of the variant repeating it.
struct Kind {
    name: &'static str,
    what: &'static str,
    repeated: &'static [(&'static str, u32)],
}

const KINDS: [Kind; 8] = [
    Kind {
        name: "headers",
        what: "every request header, one call",
        repeated: &[("headers", REPEAT)],
    },
    Kind {
        name: "set-header",
        what: "one request header written",
        repeated: &[("set-header", REPEAT)],
    },
    Kind {
        name: "header-map",
        what: "the whole request header map written, 3 headers more, one call",
        repeated: &[("header-map", REPEAT)],
    },
    Kind {
        name: "shared-get",
        what: "shared-data read, 256 bytes",
        repeated: &[("shared-get", REPEAT)],
    },
    Kind {
        name: "shared-set",
        what: "shared-data write, 256 bytes, no cas",
        repeated: &[("shared-set", REPEAT)],
    },
    Kind {
        name: "time",
        what: "the clock",
        repeated: &[("time", REPEAT)],
    },
    Kind {
        name: "metric",
        what: "a counter incremented",
        repeated: &[("metric", REPEAT)],
    },
    Kind {
        name: "property",
        what: "`upstream.request_attempt_count`, when the request ends",
        repeated: &[("property", REPEAT)],
    },
];

/// The host calls dprank's header mode makes per routed request beyond the
/// no-op header router (which sets the same three headers), as the unit test
/// `host_calls_per_request` (src/request/tests.rs, header mode) counts them:
/// the headers read once; each worker's state, the health record and, to
/// release the estimate, the chosen state again read; the estimate and its
/// release written; the clock; the request counter; the attempts and the
/// status when the request ends. The test's fleet has two workers; this one
/// has one, so one state read fewer.
const DPRANK_CALLS: &[(&str, u32)] = &[
    ("headers", 1),
    ("shared-get", 3),
    ("shared-set", 2),
    ("time", 1),
    ("metric", 1),
    ("property", 2),
];

const PASS: &str = "no-op filter (pass)";
const ROUTER: &str = "no-op router (header)";
const DPRANK: &str = "dprank, header mode";
const MIX: &str = "no-op, dprank's calls once each";

/// The cell: 16 connections (CPU per request, the throughput figure), 1 KB.
const BUSY: Shape = Shape::Plain {
    connections: 16,
    bytes: 1024,
};
/// One connection: the latency the calls add.
const ONE: Shape = Shape::Plain {
    connections: 1,
    bytes: 1024,
};

pub async fn host_calls(tools: &Tools, args: &HostCallsArgs, command_line: &str) -> Result<(), String> {
    if args.runs == 0 {
        return Err("host-calls: --runs must be at least 1".into());
    }
    let client = pooled_client();
    let cores = crate::cpu::cores();
    let fleet = instant_worker(tools, "host-calls-sim")?;
    let mut variants: Vec<(&'static str, Balancer)> = vec![
        (PASS, Balancer::Noop(NoopMode::Pass)),
        (ROUTER, Balancer::Noop(NoopMode::RouteHeader)),
        (DPRANK, Balancer::Dprank(header_mode())),
        (MIX, Balancer::Noop(NoopMode::Calls(DPRANK_CALLS))),
    ];
    for kind in &KINDS {
        variants.push((kind.name, Balancer::Noop(NoopMode::Calls(kind.repeated))));
    }
    let mut fronts: Vec<(&'static str, Front)> = Vec::new();
    for (i, (name, balancer)) in variants.into_iter().enumerate() {
        let front = start_envoy(
            tools,
            &client,
            &fleet,
            &balancer,
            &format!("host-calls-{i}"),
            None,
        )
        .await?;
        fronts.push((name, front));
    }
    let pinned = cores >= 2 && pin_routers(&fleet, &fronts, cores);
    let targets: Vec<Target> = fronts
        .iter()
        .map(|(name, f)| Target {
            name,
            addr: f.addr,
            pid: Some(f.pid()),
        })
        .collect();
    let shapes = [BUSY, ONE];
    // cells[shape][target] = one cell per run
    let mut cells: Vec<Vec<Vec<Cell>>> = vec![vec![Vec::new(); targets.len()]; shapes.len()];
    for run in 0..args.runs {
        for (si, shape) in shapes.iter().enumerate() {
            for k in 0..targets.len() {
                let ti = (k + run) % targets.len();
                let cell = measure(&targets[ti], *shape, args.seconds).await?;
                println!(
                    "  run {} {:>28} {:>14}: p50 {:>6.0} us, cpu {:>6.1} us per request{}",
                    run + 1,
                    targets[ti].name,
                    shape.label(),
                    cell.p50_us,
                    cell.cpu_us,
                    if cell.errors > 0 {
                        format!(" ({} errors)", cell.errors)
                    } else {
                        String::new()
                    }
                );
                cells[si][ti].push(cell);
            }
        }
    }
    drop(fronts);
    drop(fleet);

    // Per-run differences, paired by run.
    let added = |si: usize, ti: usize, base: usize, f: fn(&Cell) -> f64| -> Vec<f64> {
        cells[si][ti]
            .iter()
            .zip(&cells[si][base])
            .map(|(a, b)| f(a) - f(b))
            .collect()
    };
    let per_call = |values: Vec<f64>| -> Vec<f64> { values.iter().map(|v| v / f64::from(REPEAT)).collect() };
    let (pass, router, dprank, mix) = (0, 1, 2, 3);
    let made_by_dprank = |name: &str| {
        DPRANK_CALLS
            .iter()
            .find(|(k, _)| *k == name)
            .map_or(0, |(_, n)| *n)
    };
    let header = [
        "host call",
        "what",
        "router CPU per call, us [95% interval] (16 conn)",
        "added p50 per call, us [95% interval] (1 conn)",
        "dprank header mode makes beyond the no-op router, per request",
    ];
    let mut rows = Vec::new();
    // dprank's further calls at their cost in a loop, per run.
    let mut looped = vec![0.0; args.runs];
    for (i, kind) in KINDS.iter().enumerate() {
        let ti = 4 + i;
        let cpu = per_call(added(0, ti, pass, |c| c.cpu_us));
        let count = made_by_dprank(kind.name);
        for (sum, c) in looped.iter_mut().zip(&cpu) {
            *sum += f64::from(count) * c;
        }
        rows.push(vec![
            format!("`{}`", kind.name),
            kind.what.to_string(),
            with_interval(&cpu, 2),
            with_interval(&per_call(added(1, ti, pass, |c| c.p50_us)), 2),
            count.to_string(),
        ]);
    }
    let table = markdown_table(&header, &rows);
    let dprank_over_router = added(0, dprank, router, |c| c.cpu_us);
    let calls_over_pass = added(0, mix, pass, |c| c.cpu_us);
    let own_code: Vec<f64> = dprank_over_router
        .iter()
        .zip(&calls_over_pass)
        .map(|(d, c)| d - c)
        .collect();
    let cpu_of = |ti: usize| fmt_spread(&cells[0][ti].iter().map(|c| c.cpu_us).collect::<Vec<_>>(), 1);
    let calls_made: u32 = DPRANK_CALLS.iter().map(|(_, n)| n).sum();
    let summary = format!(
        "- Router CPU per request at 16 connections, 1 KB, us: no-op filter (pass) {}; no-op router (header) {}; {MIX} {}; dprank header mode {}.\n\
         - dprank header mode over the no-op router: **{}** us of CPU per request.\n\
         - Its {calls_made} further host calls, made once each per request by the no-op filter with nothing around them: **{}** us over the pass-through filter (at their cost in a loop, from the table: {} us).\n\
         - The rest, dprank's own code in V8: **{}** us.\n\
         - Added p50 over the pass-through filter at 1 connection, us: no-op router {}; {MIX} {}; dprank header mode {}.",
        cpu_of(pass),
        cpu_of(router),
        cpu_of(mix),
        cpu_of(dprank),
        with_interval(&dprank_over_router, 1),
        with_interval(&calls_over_pass, 1),
        with_interval(&looped, 1),
        with_interval(&own_code, 1),
        with_interval(&added(1, router, pass, |c| c.p50_us), 0),
        with_interval(&added(1, mix, pass, |c| c.p50_us), 0),
        with_interval(&added(1, dprank, pass, |c| c.p50_us), 0),
    );
    println!("\n{table}\n{summary}");

    let mut md = report_header("Cost of proxy-wasm host calls inside Envoy", command_line);
    let _ = writeln!(
        md,
        "One `dprank-sim --instant` worker (4 ranks) behind Envoy (envoy/dprank.yaml) with, in turn: the no-op filter of `bench/noop-filter` passing the body through; the same filter making {REPEAT} host calls of one kind per request and nothing else (`calls <kind>={REPEAT}`); the same filter making the calls dprank's header mode makes beyond the no-op router, once each ({MIX}); the no-op router (header); and dprank in header mode (poll interval 1 s). Each cell is {} s of closed-loop `POST /generate` (1 KB) after 0.3 s of warm-up, on 16 connections (router CPU: the Envoy process's own CPU time over the window, per request) and on 1 (p50 latency); cells interleaved within each of {} runs, the order rotated from run to run. A call's cost in the table is its variant's figure minus the pass-through filter's, divided by {REPEAT}: a call repeated in a loop runs with warm caches, so this is a lower bound on its cost among other work, which the {MIX} variant measures. Differences are paired by run; intervals are 95% bootstrap intervals over runs. Router{}.\n",
        args.seconds,
        args.runs,
        if pinned {
            format!(" on core {}, load generator and worker on the others", cores - 1)
        } else {
            "s not pinned".into()
        }
    );
    md.push_str(&table);
    let _ = writeln!(md, "\n{summary}");
    let path = args.out.join("host-calls.md");
    std::fs::create_dir_all(&args.out).map_err(|e| format!("cannot create {}: {e}", args.out.display()))?;
    std::fs::write(&path, md).map_err(|e| format!("cannot write {}: {e}", path.display()))?;
    println!("wrote {}", path.display());
    Ok(())
}
