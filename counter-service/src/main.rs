//! `sluice-counter-service`: see the README for flags and endpoints.

use std::process::ExitCode;

use clap::Parser;
use sluice_counter_service::{server, AppState, Settings};
use tokio::net::TcpListener;
use tracing_subscriber::EnvFilter;

#[tokio::main]
async fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(
            EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info")),
        )
        .with_writer(std::io::stderr)
        .init();

    let settings = Settings::parse();
    if let Err(reason) = settings.validate() {
        eprintln!("sluice-counter-service: {reason}");
        return ExitCode::from(2);
    }
    let tls = match settings.tls() {
        Ok(tls) => tls.map(std::sync::Arc::new),
        Err(reason) => {
            eprintln!("sluice-counter-service: {reason}");
            return ExitCode::from(2);
        }
    };
    let bind = settings.bind;
    let rls = match (&settings.grpc_bind, &settings.rls_config) {
        (Some(address), Some(path)) => match sluice_counter_service::rls::load(path) {
            Ok(config) => Some((*address, path.clone(), config)),
            Err(reason) => {
                eprintln!("sluice-counter-service: {reason}");
                return ExitCode::from(2);
            }
        },
        _ => None,
    };
    let cluster = settings.is_cluster();
    let admin_api = settings.admin_api();
    let state = match AppState::new(settings) {
        Ok(state) => state,
        Err(error) => {
            eprintln!("sluice-counter-service: {error}");
            return ExitCode::from(2);
        }
    };
    // Settings Redis refuses (an untrusted certificate, a wrong user or password) stop the
    // service here, naming the flag; a Redis that is down does not.
    match state.backend.check_at_start().await {
        Ok(None) => {}
        Ok(Some(reason)) => {
            tracing::warn!(%reason, "Redis does not answer yet: starting anyway (503 until it does)")
        }
        Err(reason) => {
            eprintln!("sluice-counter-service: {reason}");
            return ExitCode::from(2);
        }
    }
    let listener = match TcpListener::bind(bind).await {
        Ok(listener) => listener,
        Err(error) => {
            eprintln!("sluice-counter-service: cannot listen on {bind}: {error}");
            return ExitCode::FAILURE;
        }
    };
    let address = listener.local_addr().unwrap_or(bind);
    // One line on stdout that tools can wait for (the port is the real one with `--bind …:0`).
    println!("sluice-counter-service listening on {address}");
    let https = tls.is_some();
    let client_certs = https && state.settings.tls_client_ca_file.is_some();
    tracing::info!(%address, cluster, admin_api, https, client_certs, "listening");
    if let Some(tls) = &tls {
        tls.clone().watch();
    }
    sluice_counter_service::reload::watch_credentials(state.clone());
    if let Some((address, path, config)) = rls {
        let listener = match TcpListener::bind(address).await {
            Ok(listener) => listener,
            Err(error) => {
                eprintln!(
                    "sluice-counter-service: cannot listen on {address} (--grpc-bind): {error}"
                );
                return ExitCode::FAILURE;
            }
        };
        let address = listener.local_addr().unwrap_or(address);
        println!("sluice-counter-service rate limit service listening on {address}");
        tracing::info!(%address, "rate limit service listening");
        let config = std::sync::Arc::new(std::sync::RwLock::new(std::sync::Arc::new(config)));
        sluice_counter_service::rls::watch(path, config.clone());
        let router = sluice_counter_service::rls::RateLimiter::new(state.clone(), config).router();
        let (settings, metrics, tls) = (state.settings.clone(), state.metrics.clone(), tls.clone());
        tokio::spawn(async move {
            let served = server::serve_router(
                listener,
                router,
                &settings,
                metrics,
                tls,
                server::Protocol::Http2,
                std::future::pending(),
            )
            .await;
            if let Err(error) = served {
                tracing::error!(%error, "the rate limit service failed");
            }
        });
    }

    let served = server::serve_with(listener, state, tls, shutdown()).await;
    match served {
        Ok(()) => {
            tracing::info!("stopped");
            ExitCode::SUCCESS
        }
        Err(error) => {
            tracing::error!(%error, "server failed");
            ExitCode::FAILURE
        }
    }
}

/// Resolves on SIGINT or SIGTERM: the server then stops accepting and drains what is in flight.
async fn shutdown() {
    let interrupt = async {
        if tokio::signal::ctrl_c().await.is_err() {
            std::future::pending::<()>().await;
        }
    };
    #[cfg(unix)]
    let terminate = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut signal) => {
                signal.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let terminate = std::future::pending::<()>();
    tokio::select! {
        () = interrupt => {},
        () = terminate => {},
    }
    tracing::info!("shutting down: draining requests in flight");
}
