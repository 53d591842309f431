//! Redis, single or cluster, chosen in this one place. Every call runs under the Redis timeout,
//! so a slow or absent Redis answers an error, never a hang.
//!
//! On a cluster, a call that fails for want of a node (refused, dropped, `MOVED`, `CLUSTERDOWN`,
//! `TRYAGAIN`, `MASTERDOWN`) drops the cluster connection it used, and a timeout does too, at most
//! once per [`RECONNECT_AFTER_TIMEOUT`]: the next call connects afresh and reads the slots from
//! the live nodes. Left to itself, the redis crate repairs a connection to a dead primary in
//! place, and meanwhile (its slot refreshes keep meeting the dead node) calls for every slot time
//! out, not only the dead primary's, for seconds after a replica took over (tests/tests/failover.rs
//! saw 10 s). A fresh connection answers the live primaries' slots at once, and the promoted
//! replica's as soon as the cluster has failed over. The crate does not retry a failed call
//! itself (`retries(0)`): the proxies retry at their next sync.
//!
//! Through Redis Sentinel the same rule holds: a call that finds the primary gone (or read-only,
//! or timed out) drops the connection, and the next asks the sentinels for the primary again
//! (tests/tests/sentinel.rs).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use redis::aio::{
    ConnectionLike, ConnectionManager, ConnectionManagerConfig, MultiplexedConnection,
};
use redis::cluster::ClusterClient;
use redis::cluster_async::ClusterConnection;
use redis::sentinel::{SentinelClient, SentinelClientBuilder, SentinelServerType};
use redis::{
    AsyncConnectionConfig, Cmd, FromRedisValue, IntoConnectionInfo, Pipeline, RedisFuture,
    ScriptInvocation, TlsMode, Value,
};
use tokio::sync::Mutex;

use crate::metrics::Metrics;
use crate::redis_access::RedisAccess;
use crate::settings::Settings;

/// Why a Redis call did not give an answer the service can use.
#[derive(Debug, thiserror::Error)]
pub enum BackendError {
    #[error("Redis did not answer within {0:?}")]
    Timeout(Duration),
    #[error("Redis: {0}")]
    Redis(#[from] redis::RedisError),
    #[error("unexpected reply from Redis: {0}")]
    Reply(String),
}

/// The Redis the service keeps its counters in.
pub struct Backend {
    redis: Redis,
    timeout: Duration,
    metrics: Arc<Metrics>,
}

enum Redis {
    /// One Redis: a multiplexed connection that reconnects by itself (and its client, for the
    /// check at start).
    Single(ConnectionManager, Box<redis::Client>),
    /// A Redis Cluster: connected on first use (so the service starts while Redis is down).
    Cluster(Box<Reconnecting>),
    /// A primary found through Redis Sentinel: connected on first use, and looked up again
    /// through the sentinels whenever a call finds it gone or read-only.
    Sentinel(Box<Reconnecting>),
}

/// How often, at most, a cluster (or Sentinel) connection is replaced because a call timed out
/// (a slow Redis is not helped by reconnecting in a loop).
pub const RECONNECT_AFTER_TIMEOUT: Duration = Duration::from_millis(250);

/// The longest the check at start waits for Redis before starting anyway.
pub const START_CHECK_TIMEOUT: Duration = Duration::from_secs(3);

/// A connection that is dropped when a call finds its node gone, and made afresh at the next.
struct Reconnecting {
    connector: Connector,
    connection: Mutex<Slot>,
}

enum Connector {
    Cluster(ClusterClient),
    Sentinel(Mutex<SentinelClient>, AsyncConnectionConfig),
}

/// The connection in use (`None`: connect on the next call), how many have been made, and when
/// the last one was dropped.
#[derive(Default)]
struct Slot {
    connection: Option<Connection>,
    generation: u64,
    dropped_at: Option<Instant>,
}

impl Backend {
    /// A backend for the Redis the settings name. Connects lazily: never fails for a Redis that
    /// is down, only for settings that cannot work (the reason names the flag).
    pub fn new(settings: &Settings, metrics: Arc<Metrics>) -> Result<Backend, String> {
        let access = settings.redis_access()?;
        Backend::with_access(settings, &access, metrics)
    }

    /// Like [`Backend::new`], with Redis's access already read.
    pub fn with_access(
        settings: &Settings,
        access: &RedisAccess,
        metrics: Arc<Metrics>,
    ) -> Result<Backend, String> {
        install_crypto();
        let timeout = settings.redis_timeout();
        let url_error =
            |error: redis::RedisError| format!("--redis-url (SLUICE_REDIS_URL): {error}");
        let redis = if let Some(name) = &settings.redis_sentinel {
            let mut sentinels = Vec::new();
            for url in &access.urls {
                let info = url.as_str().into_connection_info().map_err(url_error)?;
                sentinels.push(info.addr().clone());
            }
            let mut builder =
                SentinelClientBuilder::new(sentinels, name, SentinelServerType::Master)
                    .map_err(url_error)?;
            if let Some(user) = &access.username {
                builder = builder.set_client_to_redis_username(user);
            }
            if let Some(password) = &access.password {
                builder = builder.set_client_to_redis_password(password.expose());
            }
            if access.tls {
                builder = builder.set_client_to_redis_tls_mode(TlsMode::Secure);
                if let Some(certificates) = &access.certificates {
                    builder = builder
                        .set_client_to_redis_certificates(certificates.clone())
                        .set_client_to_sentinel_certificates(certificates.clone());
                }
            }
            let client = builder.build().map_err(url_error)?;
            let config = AsyncConnectionConfig::new()
                .set_connection_timeout(Some(timeout))
                .set_response_timeout(Some(timeout));
            Redis::Sentinel(Box::new(Reconnecting {
                connector: Connector::Sentinel(Mutex::new(client), config),
                connection: Mutex::new(Slot::default()),
            }))
        } else if settings.is_cluster() {
            let mut builder = ClusterClient::builder(access.urls.clone())
                .connection_timeout(timeout)
                .response_timeout(timeout)
                .retries(0);
            if let Some(user) = &access.username {
                builder = builder.username(user);
            }
            if let Some(password) = &access.password {
                builder = builder.password(password.expose());
            }
            if let Some(certificates) = &access.certificates {
                builder = builder.certs(certificates.clone());
            }
            Redis::Cluster(Box::new(Reconnecting {
                connector: Connector::Cluster(builder.build().map_err(url_error)?),
                connection: Mutex::new(Slot::default()),
            }))
        } else {
            let url = access.urls.first().cloned().unwrap_or_default();
            let mut info = url.as_str().into_connection_info().map_err(url_error)?;
            if let Some(password) = &access.password {
                let redis = info
                    .redis_settings()
                    .clone()
                    .set_password(password.expose());
                info = info.set_redis_settings(redis);
            }
            let client = match &access.certificates {
                Some(certificates) => redis::Client::build_with_tls(info, certificates.clone()),
                None => redis::Client::open(info),
            }
            .map_err(url_error)?;
            let config = ConnectionManagerConfig::new()
                .set_connection_timeout(Some(timeout))
                .set_response_timeout(Some(timeout))
                .set_number_of_retries(1)
                .set_max_delay(Duration::from_millis(500));
            let manager = ConnectionManager::new_lazy_with_config(client.clone(), config)
                .map_err(url_error)?;
            Redis::Single(manager, Box::new(client))
        };
        Ok(Backend {
            redis,
            timeout,
            metrics,
        })
    }

    /// The check at start: one `PING`, within [`START_CHECK_TIMEOUT`]. `Err` (naming the flag)
    /// when Redis refuses the service's settings: its certificate not trusted or not for the
    /// host, the client certificate refused, the user or password wrong, `PING` not allowed.
    /// A Redis that is down or slow is not a reason: the service starts and answers 503 until
    /// it comes (the reason is returned in `Ok` to be logged).
    pub async fn check_at_start(&self) -> Result<Option<String>, String> {
        let ping = async {
            let outcome: Result<String, BackendError> = match &self.redis {
                Redis::Single(_, client) => {
                    let config = AsyncConnectionConfig::new()
                        .set_connection_timeout(Some(START_CHECK_TIMEOUT))
                        .set_response_timeout(Some(START_CHECK_TIMEOUT));
                    match client
                        .get_multiplexed_async_connection_with_config(&config)
                        .await
                    {
                        Ok(mut connection) => redis::cmd("PING")
                            .query_async(&mut connection)
                            .await
                            .map_err(BackendError::from),
                        Err(error) => Err(error.into()),
                    }
                }
                _ => match self.connection().await {
                    Ok((mut connection, _)) => redis::cmd("PING")
                        .query_async(&mut connection)
                        .await
                        .map_err(BackendError::from),
                    Err(error) => Err(error),
                },
            };
            outcome
        };
        match tokio::time::timeout(START_CHECK_TIMEOUT, ping).await {
            Ok(Ok(_)) => Ok(None),
            Ok(Err(BackendError::Redis(error))) => match refusal(&error) {
                Some(reason) => Err(reason),
                None => Ok(Some(error.to_string())),
            },
            Ok(Err(error)) => Ok(Some(error.to_string())),
            Err(_) => Ok(Some(format!(
                "Redis did not answer within {START_CHECK_TIMEOUT:?}"
            ))),
        }
    }

    pub fn is_cluster(&self) -> bool {
        matches!(self.redis, Redis::Cluster(_))
    }

    pub fn is_sentinel(&self) -> bool {
        matches!(self.redis, Redis::Sentinel(_))
    }

    /// Runs a script by SHA (`EVALSHA`, loading it on `NOSCRIPT`). `op` names it in the metrics.
    pub async fn invoke<T: FromRedisValue>(
        &self,
        op: &'static str,
        invocation: &ScriptInvocation<'_>,
    ) -> Result<T, BackendError> {
        let generation = AtomicU64::new(0);
        let outcome = self
            .timed(op, async {
                let (mut connection, made) = self.connection().await?;
                generation.store(made, Ordering::Relaxed);
                Ok(invocation.invoke_async(&mut connection).await?)
            })
            .await;
        self.after(&outcome, generation.into_inner()).await;
        outcome
    }

    /// Runs one command (routed by its first key on a cluster).
    pub async fn query<T: FromRedisValue>(
        &self,
        op: &'static str,
        command: &Cmd,
    ) -> Result<T, BackendError> {
        let generation = AtomicU64::new(0);
        let outcome = self
            .timed(op, async {
                let (mut connection, made) = self.connection().await?;
                generation.store(made, Ordering::Relaxed);
                Ok(command.query_async(&mut connection).await?)
            })
            .await;
        self.after(&outcome, generation.into_inner()).await;
        outcome
    }

    /// Whether Redis answers `PING` within the timeout.
    pub async fn ping(&self) -> Result<(), BackendError> {
        let pong: String = self.query("ping", &redis::cmd("PING")).await?;
        if pong == "PONG" {
            Ok(())
        } else {
            Err(BackendError::Reply(format!("PING answered {pong:?}")))
        }
    }

    async fn timed<T>(
        &self,
        op: &'static str,
        call: impl std::future::Future<Output = Result<T, BackendError>>,
    ) -> Result<T, BackendError> {
        let start = Instant::now();
        let outcome = match tokio::time::timeout(self.timeout, call).await {
            Ok(outcome) => outcome,
            Err(_) => Err(BackendError::Timeout(self.timeout)),
        };
        self.metrics
            .observe_redis(op, start.elapsed(), outcome.is_ok());
        outcome
    }

    /// A connection, and on a cluster or through Sentinel which one (its generation, 1 for the
    /// first).
    async fn connection(&self) -> Result<(Connection, u64), BackendError> {
        let reconnecting = match &self.redis {
            Redis::Single(manager, _) => return Ok((Connection::Single(manager.clone()), 0)),
            Redis::Cluster(reconnecting) | Redis::Sentinel(reconnecting) => reconnecting,
        };
        let mut slot = reconnecting.connection.lock().await;
        if let Some(existing) = slot.connection.as_ref() {
            return Ok((existing.clone(), slot.generation));
        }
        let fresh = match &reconnecting.connector {
            Connector::Cluster(client) => Connection::Cluster(client.get_async_connection().await?),
            Connector::Sentinel(client, config) => {
                let primary = client.lock().await.async_get_client().await?;
                Connection::Primary(
                    primary
                        .get_multiplexed_async_connection_with_config(config)
                        .await?,
                )
            }
        };
        slot.connection = Some(fresh.clone());
        slot.generation += 1;
        Ok((fresh, slot.generation))
    }

    /// After a cluster or Sentinel call: if it failed for want of a node, drops the connection
    /// it used (not a newer one); after a timeout, unless one was dropped less than
    /// [`RECONNECT_AFTER_TIMEOUT`] ago.
    async fn after<T>(&self, outcome: &Result<T, BackendError>, generation: u64) {
        let reconnecting = match &self.redis {
            Redis::Single(..) => return,
            Redis::Cluster(reconnecting) | Redis::Sentinel(reconnecting) => reconnecting,
        };
        let Err(error) = outcome else {
            return;
        };
        if generation == 0 || !wants_new_connection(error) {
            return;
        }
        let mut slot = reconnecting.connection.lock().await;
        let timed_out = matches!(error, BackendError::Timeout(_))
            || matches!(error, BackendError::Redis(e) if e.is_timeout());
        let recently = timed_out
            && slot
                .dropped_at
                .is_some_and(|at| at.elapsed() < RECONNECT_AFTER_TIMEOUT);
        if slot.generation == generation && slot.connection.is_some() && !recently {
            slot.connection = None;
            slot.dropped_at = Some(Instant::now());
            if self.is_sentinel() {
                tracing::warn!(%error, "Redis Sentinel: asking the sentinels for the primary again");
            } else {
                tracing::warn!(%error, "Redis Cluster: reconnecting to re-read the slots");
            }
        }
    }
}

/// Whether an error says a node is gone or the slots moved (not a script's or a reply's error).
fn wants_new_connection(error: &BackendError) -> bool {
    match error {
        BackendError::Timeout(_) => true,
        BackendError::Redis(error) => {
            error.is_io_error()
                || error.is_timeout()
                || error.is_connection_dropped()
                || error.is_connection_refusal()
                || error.is_cluster_error()
                || matches!(
                    error.kind(),
                    redis::ErrorKind::Server(
                        redis::ServerErrorKind::MasterDown | redis::ServerErrorKind::ReadOnly
                    )
                )
        }
        BackendError::Reply(_) => false,
    }
}

/// One handle on any kind of Redis, usable wherever the redis crate takes a connection.
#[derive(Clone)]
enum Connection {
    Single(ConnectionManager),
    Cluster(ClusterConnection),
    /// The primary the sentinels named.
    Primary(MultiplexedConnection),
}

impl ConnectionLike for Connection {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a Cmd) -> RedisFuture<'a, Value> {
        match self {
            Connection::Single(c) => c.req_packed_command(cmd),
            Connection::Cluster(c) => c.req_packed_command(cmd),
            Connection::Primary(c) => c.req_packed_command(cmd),
        }
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        pipeline: &'a Pipeline,
        offset: usize,
        count: usize,
    ) -> RedisFuture<'a, Vec<Value>> {
        match self {
            Connection::Single(c) => c.req_packed_commands(pipeline, offset, count),
            Connection::Cluster(c) => c.req_packed_commands(pipeline, offset, count),
            Connection::Primary(c) => c.req_packed_commands(pipeline, offset, count),
        }
    }

    fn get_db(&self) -> i64 {
        match self {
            Connection::Single(c) => c.get_db(),
            Connection::Cluster(c) => c.get_db(),
            Connection::Primary(c) => c.get_db(),
        }
    }
}

/// rustls's crypto: ring, for the whole process (the redis crate builds its TLS configurations
/// with the process's default). Installing twice is harmless.
fn install_crypto() {
    let _ = rustls::crypto::ring::default_provider().install_default();
}

/// Why Redis refused the service's settings (naming the flag), if it did: not a Redis that is
/// down or slow. Never holds a secret: Redis's and rustls's messages quote none.
pub fn refusal(error: &redis::RedisError) -> Option<String> {
    const PASSWORD: &str = "--redis-password-file (SLUICE_REDIS_PASSWORD_FILE) or \
        SLUICE_REDIS_PASSWORD";
    if error.kind() == redis::ErrorKind::AuthenticationFailed {
        return Some(format!(
            "Redis refused the user or password: check the user in --redis-url \
             (SLUICE_REDIS_URL) and the password in {PASSWORD}"
        ));
    }
    match error.code() {
        Some("NOAUTH") => {
            return Some(format!(
                "Redis asks for a password and none was given: {PASSWORD}"
            ))
        }
        Some("NOPERM") => {
            return Some(format!(
                "Redis's ACL refuses the user in --redis-url (SLUICE_REDIS_URL) a command the \
                 service needs ({error}); docs/redis.md lists them"
            ))
        }
        _ => {}
    }
    let tls = tls_error(error)?;
    use rustls::{AlertDescription, CertificateError, Error};
    Some(match tls {
        Error::InvalidCertificate(
            CertificateError::NotValidForName | CertificateError::NotValidForNameContext { .. },
        ) => format!(
            "--redis-url (SLUICE_REDIS_URL): Redis's certificate is not for the URL's host: {tls}"
        ),
        Error::InvalidCertificate(_) => format!(
            "--redis-ca-file (SLUICE_REDIS_CA_FILE): Redis's certificate is not trusted (not \
             signed by a CA of the file, or of the system without the flag): {tls}"
        ),
        Error::AlertReceived(
            AlertDescription::CertificateRequired
            | AlertDescription::BadCertificate
            | AlertDescription::UnknownCA
            | AlertDescription::CertificateUnknown
            | AlertDescription::UnsupportedCertificate
            | AlertDescription::CertificateExpired
            | AlertDescription::CertificateRevoked
            | AlertDescription::AccessDenied,
        ) => format!(
            "--redis-client-cert-file (SLUICE_REDIS_CLIENT_CERT_FILE): Redis refused the \
             client certificate: {tls}"
        ),
        _ => format!("--redis-url (SLUICE_REDIS_URL): TLS with Redis failed: {tls}"),
    })
}

/// The rustls error under a Redis error, if any.
fn tls_error(error: &redis::RedisError) -> Option<&rustls::Error> {
    let mut cause: Option<&(dyn std::error::Error + 'static)> = std::error::Error::source(error);
    for _ in 0..8 {
        let current = cause?;
        // The redis crate keeps what it wraps in an `Arc`, and an I/O error keeps rustls's inside.
        let inner: &(dyn std::error::Error + 'static) =
            match current.downcast_ref::<Arc<dyn std::error::Error + Send + Sync>>() {
                Some(shared) => shared.as_ref(),
                None => current,
            };
        if let Some(tls) = inner.downcast_ref::<rustls::Error>() {
            return Some(tls);
        }
        if let Some(io) = inner.downcast_ref::<std::io::Error>() {
            if let Some(tls) = io
                .get_ref()
                .and_then(|inner| inner.downcast_ref::<rustls::Error>())
            {
                return Some(tls);
            }
        }
        cause = inner.source();
    }
    None
}
