//! `dprank-bench overhead`: what a router adds in front of a worker that
//! answers at once (`dprank-sim --instant`): closed-loop clients on dedicated
//! keep-alive connections, non-streamed `/generate`.

use std::fmt::Write as _;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use bytes::Bytes;
use clap::Args;

use crate::client::{pooled_client, Connection};
use crate::cpu::CpuTimes;
use crate::envoy::{Balancer, DprankSettings};
use crate::fleet::{smg_front, smg_launch_args, start_envoy, Front, SimFleet, SimOptions, Tools};
use crate::report::{fmt_spread, markdown_table, report_header};
use crate::stats::{median, percentile};
use crate::workload::bodies;

#[derive(Debug, Clone, Args)]
pub struct OverheadArgs {
    /// Measured seconds per (router, connections, body) cell and run.
    #[arg(long, default_value_t = 2.0)]
    pub seconds: f64,
    #[arg(long, default_value_t = 3)]
    pub runs: usize,
    #[arg(long, default_value = "bench-results")]
    pub out: PathBuf,
}

impl OverheadArgs {
    pub fn defaults() -> OverheadArgs {
        OverheadArgs {
            seconds: 2.0,
            runs: 3,
            out: PathBuf::from("bench-results"),
        }
    }
}

const CONNECTIONS: [usize; 2] = [1, 16];
const BODIES: [(usize, &str); 2] = [(1024, "1 KB"), (100 * 1024, "100 KB")];

struct Target {
    name: &'static str,
    addr: SocketAddr,
}

/// One cell: latencies (us) and requests per second.
struct Cell {
    p50_us: f64,
    p99_us: f64,
    rps: f64,
    errors: usize,
}

async fn measure(addr: SocketAddr, connections: usize, body: Bytes, seconds: f64) -> Result<Cell, String> {
    let mut tasks = tokio::task::JoinSet::new();
    let warmup = Duration::from_millis(300);
    let start = Instant::now();
    let measure_from = start + warmup;
    let end = measure_from + Duration::from_secs_f64(seconds);
    for _ in 0..connections {
        let body = body.clone();
        tasks.spawn(async move {
            let mut latencies = Vec::new();
            let mut errors = 0usize;
            let mut connection = Connection::open(addr).await?;
            while Instant::now() < end {
                let sent = Instant::now();
                match connection.post("/generate", body.clone()).await {
                    Ok(latency) if sent >= measure_from => latencies.push(latency.as_secs_f64() * 1e6),
                    Ok(_) => {}
                    Err(_) => {
                        errors += 1;
                        connection = Connection::open(addr).await?;
                    }
                }
            }
            Ok::<_, String>((latencies, errors))
        });
    }
    let mut all = Vec::new();
    let mut errors = 0;
    while let Some(done) = tasks.join_next().await {
        let (latencies, e) = done.map_err(|e| format!("client task: {e}"))??;
        all.extend(latencies);
        errors += e;
    }
    Ok(Cell {
        p50_us: percentile(&all, 50.0),
        p99_us: percentile(&all, 99.0),
        rps: all.len() as f64 / seconds,
        errors,
    })
}

pub async fn overhead(tools: &Tools, args: &OverheadArgs, command_line: &str) -> Result<(), String> {
    let client = pooled_client();
    let sim = SimOptions {
        workers: 1,
        dp_size: 4,
        time_scale: 1.0,
        dispatch: "round_robin",
        instant: true,
        extra: Vec::new(),
    };
    let fleet = SimFleet::start(tools, &sim, "overhead-sim")?;
    let worker = *fleet.workers.first().ok_or("no worker")?;
    let mut fronts: Vec<(&'static str, Front)> = vec![
        (
            "envoy",
            start_envoy(tools, &client, &fleet, &Balancer::RoundRobin, "overhead-envoy").await?,
        ),
        (
            "envoy+dprank",
            start_envoy(
                tools,
                &client,
                &fleet,
                &Balancer::Dprank(DprankSettings::polling_every(1000)),
                "overhead-envoy-dprank",
            )
            .await?,
        ),
    ];
    match &tools.smg {
        Some(smg) => {
            let (port, mut args) = smg_launch_args()?;
            args.extend([
                "--policy".into(),
                "round_robin".into(),
                "--dp-aware".into(),
                "--worker-urls".into(),
            ]);
            args.push(format!("http://{worker}"));
            let front = smg_front(tools, &client, smg, &args, port, "overhead-smg").await?;
            fronts.push(("smg --dp-aware", front));
        }
        None => println!(
            "overhead: smg skipped, not installed (DPRANK_WITH_SMG=1 ./scripts/setup.sh installs it)"
        ),
    }
    let mut targets = vec![Target {
        name: "direct",
        addr: worker,
    }];
    targets.extend(fronts.iter().map(|(name, f)| Target { name, addr: f.addr }));

    // results[(target, connections, body)] = cells of every run
    let mut results: Vec<((usize, usize, usize), Vec<Cell>)> = Vec::new();
    let cpu_start = CpuTimes::now();
    for run in 0..args.runs {
        for (ci, connections) in CONNECTIONS.iter().enumerate() {
            for (bi, (size, label)) in BODIES.iter().enumerate() {
                let body = bodies::generate_of_size(*size);
                for (ti, target) in targets.iter().enumerate() {
                    let cell = measure(target.addr, *connections, body.clone(), args.seconds).await?;
                    println!(
                        "  run {} {:>15} {:>2} conn {:>6}: p50 {:>7.0} us p99 {:>7.0} us {:>8.0} req/s{}",
                        run + 1,
                        target.name,
                        connections,
                        label,
                        cell.p50_us,
                        cell.p99_us,
                        cell.rps,
                        if cell.errors > 0 {
                            format!(" ({} errors)", cell.errors)
                        } else {
                            String::new()
                        }
                    );
                    match results.iter_mut().find(|(k, _)| *k == (ti, ci, bi)) {
                        Some((_, cells)) => cells.push(cell),
                        None => results.push(((ti, ci, bi), vec![cell])),
                    }
                }
            }
        }
    }
    let busy = CpuTimes::now().busy_since(&cpu_start);
    drop(fronts);
    drop(fleet);

    let cells = |ti: usize, ci: usize, bi: usize| -> &[Cell] {
        results
            .iter()
            .find(|(k, _)| *k == (ti, ci, bi))
            .map_or(&[], |(_, c)| c.as_slice())
    };
    // Per-run differences, then the median of them.
    let added = |ti: usize, base: usize, ci: usize, bi: usize, f: fn(&Cell) -> f64| -> Vec<f64> {
        cells(ti, ci, bi)
            .iter()
            .zip(cells(base, ci, bi))
            .map(|(a, b)| f(a) - f(b))
            .collect()
    };
    let header = [
        "router",
        "connections",
        "body",
        "p50 us",
        "p99 us",
        "added p50 us (vs direct)",
        "added p99 us (vs direct)",
        "req/s",
        "errors",
    ];
    let mut rows = Vec::new();
    for (ci, connections) in CONNECTIONS.iter().enumerate() {
        for (bi, (_, label)) in BODIES.iter().enumerate() {
            for (ti, target) in targets.iter().enumerate() {
                let c = cells(ti, ci, bi);
                rows.push(vec![
                    target.name.to_string(),
                    connections.to_string(),
                    label.to_string(),
                    fmt_spread(&c.iter().map(|c| c.p50_us).collect::<Vec<_>>(), 0),
                    fmt_spread(&c.iter().map(|c| c.p99_us).collect::<Vec<_>>(), 0),
                    if ti == 0 {
                        "-".into()
                    } else {
                        fmt_spread(&added(ti, 0, ci, bi, |c| c.p50_us), 0)
                    },
                    if ti == 0 {
                        "-".into()
                    } else {
                        fmt_spread(&added(ti, 0, ci, bi, |c| c.p99_us), 0)
                    },
                    fmt_spread(&c.iter().map(|c| c.rps).collect::<Vec<_>>(), 0),
                    c.iter().map(|c| c.errors).sum::<usize>().to_string(),
                ]);
            }
        }
    }
    let table = markdown_table(&header, &rows);
    println!("\n{table}");

    let index = |name: &str| targets.iter().position(|t| t.name == name);
    let mut findings = String::new();
    if let (Some(envoy), Some(dprank)) = (index("envoy"), index("envoy+dprank")) {
        for (bi, (_, label)) in BODIES.iter().enumerate() {
            let goal = if bi == 0 { 40 } else { 100 };
            let p50 = median(&added(dprank, envoy, 0, bi, |c| c.p50_us));
            let p99 = median(&added(dprank, envoy, 0, bi, |c| c.p99_us));
            let _ = writeln!(findings, "- dprank's own cost (Envoy + dprank minus plain Envoy), 1 connection, {label}: p50 **{p50:+.0} us** (target <= {goal} us), p99 {p99:+.0} us");
        }
        for (bi, (_, label)) in BODIES.iter().enumerate() {
            let d = median(&cells(dprank, 1, bi).iter().map(|c| c.rps).collect::<Vec<_>>());
            let e = median(&cells(envoy, 1, bi).iter().map(|c| c.rps).collect::<Vec<_>>());
            let _ = write!(findings, "- 16 connections, {label}: Envoy + dprank {d:.0} req/s = **{:.0} %** of plain Envoy {e:.0} (target >= 80 %)", 100.0 * d / e);
            if let Some(smg) = index("smg --dp-aware") {
                let s = median(&cells(smg, 1, bi).iter().map(|c| c.rps).collect::<Vec<_>>());
                let _ = write!(
                    findings,
                    "; **{:.2} x** smg {s:.0} req/s (target >= 1.5 x)",
                    d / s
                );
            }
            findings.push('\n');
        }
    }
    println!("{findings}");
    let busy_line = format!(
        "CPU: {} cores, {:.0} % busy on average while measuring.",
        crate::cpu::cores(),
        busy.unwrap_or(f64::NAN) * 100.0
    );
    println!("{busy_line}");

    let mut md = report_header("dprank overhead: what the router adds per request", command_line);
    let _ = writeln!(md, "One `dprank-sim --instant` worker (4 ranks, answers at once) behind, in turn: nothing (direct), plain Envoy (envoy/dprank.yaml without the wasm filter), Envoy + dprank (the shipped config, poll interval 1 s), and `smg launch --dp-aware --policy round_robin` (regular mode, injects a rank). All run at once; each cell is {} s of closed-loop `POST /generate` (non-streamed, `max_new_tokens` 1) on N dedicated keep-alive connections with TCP_NODELAY after 0.3 s of warm-up; median over {} runs (min–max). The load generator, the worker and the routers share the {} cores, so at 16 connections req/s is what the whole machine sustains.\n", args.seconds, args.runs, crate::cpu::cores());
    md.push_str(&table);
    let _ = writeln!(md, "\n## Targets (medians)\n\n{findings}\n{busy_line}");
    let path = args.out.join("overhead.md");
    std::fs::create_dir_all(&args.out).map_err(|e| format!("cannot create {}: {e}", args.out.display()))?;
    std::fs::write(&path, md).map_err(|e| format!("cannot write {}: {e}", path.display()))?;
    println!("wrote {}", path.display());
    Ok(())
}
