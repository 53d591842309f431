//! The HTTP/1.1 server (and the rate limit service's HTTP/2 one, [`Protocol`]): accepts at most `--max-connections` connections at once (more wait in the
//! listen backlog), closes a connection that does not send a request's headers within
//! `--header-read-timeout-ms` (also how long a kept-alive connection may stay idle), and drains
//! on shutdown. With TLS ([`crate::tls`]), each connection's handshake runs in its own task and
//! must end within the header read timeout; a client that speaks plain HTTP to it is closed
//! without an answer. The names of the client certificate a handshake verified go with every
//! request of its connection (a [`crate::client_certs::PeerCertificate`] extension).

use std::future::Future;
use std::io;
use std::sync::Arc;
use std::time::Duration;

use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto;
use hyper_util::server::graceful::GracefulShutdown;
use hyper_util::service::TowerToHyperService;
use tokio::net::TcpListener;
use tokio::sync::Semaphore;
use tower::ServiceExt;

use crate::app::app;
use crate::metrics::Metrics;
use crate::settings::Settings;
use crate::state::AppState;
use crate::tls::Tls;

/// What a listener speaks: the HTTP API (HTTP/1.1), or gRPC (HTTP/2, prior knowledge or TLS).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Protocol {
    Http1,
    Http2,
}

/// How long to wait after a failed `accept` (out of file descriptors, say) before the next one.
const ACCEPT_BACKOFF: Duration = Duration::from_millis(100);

/// Serves `state`'s service on `listener` until `shutdown` resolves, then stops accepting and
/// waits for the connections to finish their requests in flight (at most the header read
/// timeout plus the request timeout, then they are dropped).
pub async fn serve(
    listener: TcpListener,
    state: AppState,
    shutdown: impl Future<Output = ()>,
) -> io::Result<()> {
    serve_with(listener, state, None, shutdown).await
}

/// [`serve`], over TLS when `tls` is given (HTTPS only: no plain HTTP on the same port).
pub async fn serve_with(
    listener: TcpListener,
    state: AppState,
    tls: Option<Arc<Tls>>,
    shutdown: impl Future<Output = ()>,
) -> io::Result<()> {
    let settings = state.settings.clone();
    let metrics = state.metrics.clone();
    let router = app(state);
    serve_router(
        listener,
        router,
        &settings,
        metrics,
        tls,
        Protocol::Http1,
        shutdown,
    )
    .await
}

/// Serves `router` on `listener` as [`serve_with`] serves the HTTP API, speaking `protocol`:
/// the same connection cap, TLS and drain.
pub async fn serve_router(
    listener: TcpListener,
    router: axum::Router,
    settings: &Settings,
    metrics: Arc<Metrics>,
    tls: Option<Arc<Tls>>,
    protocol: Protocol,
    shutdown: impl Future<Output = ()>,
) -> io::Result<()> {
    let service = TowerToHyperService::new(router.clone());
    let mut http = auto::Builder::new(TokioExecutor::new());
    match protocol {
        Protocol::Http1 => {
            http = http.http1_only();
            http.http1()
                .timer(TokioTimer::new())
                .header_read_timeout(settings.header_read_timeout());
        }
        Protocol::Http2 => {
            http = http.http2_only();
            http.http2().timer(TokioTimer::new());
        }
    }
    let permits = Arc::new(Semaphore::new(settings.max_connections));
    let graceful = GracefulShutdown::new();
    tokio::pin!(shutdown);

    loop {
        // A free slot first: past the cap, connections wait in the backlog, not in memory.
        let permit = tokio::select! {
            () = &mut shutdown => break,
            permit = permits.clone().acquire_owned() => match permit {
                Ok(permit) => permit,
                Err(_) => break,
            },
        };
        let stream = tokio::select! {
            () = &mut shutdown => break,
            accepted = listener.accept() => match accepted {
                Ok((stream, _)) => stream,
                Err(error) => {
                    if !is_per_connection(&error) {
                        tracing::warn!(%error, "accept failed");
                        tokio::time::sleep(ACCEPT_BACKOFF).await;
                    }
                    continue;
                }
            },
        };
        let _ = stream.set_nodelay(true);
        let metrics = metrics.clone();
        metrics.connections.inc();
        let Some(tls) = &tls else {
            let (http, service, watcher) = (http.clone(), service.clone(), graceful.watcher());
            tokio::spawn(async move {
                let connection =
                    watcher.watch(http.serve_connection(TokioIo::new(stream), service));
                if let Err(error) = connection.await {
                    tracing::debug!(%error, "connection closed");
                }
                metrics.connections.dec();
                drop(permit);
            });
            continue;
        };
        // The certificate loaded last serves this connection, for as long as it lasts.
        let acceptor = match protocol {
            Protocol::Http1 => tls.acceptor(),
            Protocol::Http2 => tls.h2_acceptor(),
        };
        let watcher = graceful.watcher();
        let (http, router) = (http.clone(), router.clone());
        let handshake_timeout = settings.header_read_timeout();
        tokio::spawn(async move {
            match tokio::time::timeout(handshake_timeout, acceptor.accept(stream)).await {
                Ok(Ok(stream)) => {
                    let peer = crate::tls::peer_certificate(&stream);
                    let service = TowerToHyperService::new(router.map_request(
                        move |mut request: axum::extract::Request<hyper::body::Incoming>| {
                            if let Some(peer) = &peer {
                                request.extensions_mut().insert(peer.clone());
                            }
                            request
                        },
                    ));
                    let connection =
                        watcher.watch(http.serve_connection(TokioIo::new(stream), service));
                    if let Err(error) = connection.await {
                        tracing::debug!(%error, "connection closed");
                    }
                }
                Ok(Err(error)) => tracing::debug!(%error, "tls handshake failed"),
                Err(_) => tracing::debug!("tls handshake timed out"),
            }
            metrics.connections.dec();
            drop(permit);
        });
    }

    drop(listener);
    let drain = settings
        .header_read_timeout()
        .saturating_add(settings.request_timeout());
    if tokio::time::timeout(drain, graceful.shutdown())
        .await
        .is_err()
    {
        tracing::warn!(
            ?drain,
            "connections still open after the drain deadline: dropped"
        );
    }
    Ok(())
}

/// Errors of one incoming connection (it went away before it was accepted), not of the
/// listener.
fn is_per_connection(error: &io::Error) -> bool {
    matches!(
        error.kind(),
        io::ErrorKind::ConnectionRefused
            | io::ErrorKind::ConnectionAborted
            | io::ErrorKind::ConnectionReset
    )
}
