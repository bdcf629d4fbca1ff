use std::net::SocketAddr;
use std::process::ExitCode;
use std::sync::Arc;

use clap::Parser;
use dprank_sim::server::WorkerAddrs;
use dprank_sim::{Cli, SimServer};

/// A per-worker port list: none, or one per `--listen`.
fn per_worker(flag: &str, ports: &[u16], listen: &[SocketAddr]) -> Result<Vec<Option<SocketAddr>>, String> {
    if !ports.is_empty() && ports.len() != listen.len() {
        return Err(format!(
            "give one {flag} per --listen ({} listeners, {} {flag} ports)",
            listen.len(),
            ports.len()
        ));
    }
    // These listeners share the worker's IP address.
    Ok(listen
        .iter()
        .enumerate()
        .map(|(index, listen)| ports.get(index).map(|port| SocketAddr::new(listen.ip(), *port)))
        .collect())
}

async fn run(cli: Cli) -> Result<(), String> {
    let bootstrap = per_worker("--bootstrap-port", &cli.bootstrap_port, &cli.listen)?;
    let loads = per_worker("--loads-port", &cli.loads_port, &cli.listen)?;
    let workers: Vec<WorkerAddrs> = cli
        .listen
        .iter()
        .zip(bootstrap.into_iter().zip(loads))
        .map(|(listen, (bootstrap, loads))| WorkerAddrs {
            listen: *listen,
            bootstrap,
            loads,
        })
        .collect();
    let config = Arc::new(cli.sim);
    let servers = SimServer::start_workers(config, &workers).await?;
    for server in &servers {
        println!("{}", server.ready_line());
    }
    wait_for_stop().await;
    drop(servers);
    Ok(())
}

async fn wait_for_stop() {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{signal, SignalKind};
        if let Ok(mut terminate) = signal(SignalKind::terminate()) {
            tokio::select! {
                _ = tokio::signal::ctrl_c() => {}
                _ = terminate.recv() => {}
            }
            return;
        }
    }
    let _ = tokio::signal::ctrl_c().await;
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    env_logger::Builder::from_env(env_logger::Env::default().default_filter_or("info")).init();
    let runtime = match tokio::runtime::Builder::new_multi_thread().enable_all().build() {
        Ok(runtime) => runtime,
        Err(err) => {
            eprintln!("dprank-sim: cannot start the runtime: {err}");
            return ExitCode::FAILURE;
        }
    };
    match runtime.block_on(run(cli)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(message) => {
            eprintln!("dprank-sim: {message}");
            ExitCode::FAILURE
        }
    }
}
