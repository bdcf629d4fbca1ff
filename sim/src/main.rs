use std::net::SocketAddr;
use std::process::ExitCode;
use std::sync::Arc;

use clap::Parser;
use dprank_sim::{Cli, SimServer};

async fn run(cli: Cli) -> Result<(), String> {
    if !cli.bootstrap_port.is_empty() && cli.bootstrap_port.len() != cli.listen.len() {
        return Err(format!(
            "give one --bootstrap-port per --listen ({} listeners, {} bootstrap ports)",
            cli.listen.len(),
            cli.bootstrap_port.len()
        ));
    }
    let config = Arc::new(cli.sim);
    // The bootstrap listener shares the worker's IP address.
    let listeners: Vec<(SocketAddr, Option<SocketAddr>)> = cli
        .listen
        .iter()
        .enumerate()
        .map(|(index, listen)| {
            let bootstrap = cli
                .bootstrap_port
                .get(index)
                .map(|port| SocketAddr::new(listen.ip(), *port));
            (*listen, bootstrap)
        })
        .collect();
    let servers = SimServer::start_fleet(config, &listeners).await?;
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
