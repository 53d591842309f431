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

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use redis::aio::{ConnectionLike, ConnectionManager, ConnectionManagerConfig};
use redis::cluster::ClusterClient;
use redis::cluster_async::ClusterConnection;
use redis::{Cmd, FromRedisValue, Pipeline, RedisFuture, ScriptInvocation, Value};
use tokio::sync::Mutex;

use crate::metrics::Metrics;
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
    /// One Redis: a multiplexed connection that reconnects by itself.
    Single(ConnectionManager),
    /// A Redis Cluster: connected on first use (so the service starts while Redis is down).
    Cluster(Box<Cluster>),
}

/// How often, at most, a cluster connection is replaced because a call timed out (a slow Redis
/// is not helped by reconnecting in a loop).
pub const RECONNECT_AFTER_TIMEOUT: Duration = Duration::from_millis(250);

struct Cluster {
    client: ClusterClient,
    connection: Mutex<Slot>,
}

/// The cluster connection in use (`None`: connect on the next call), how many have been made,
/// and when the last one was dropped.
#[derive(Default)]
struct Slot {
    connection: Option<ClusterConnection>,
    generation: u64,
    dropped_at: Option<Instant>,
}

impl Backend {
    /// A backend for the Redis the settings name. Connects lazily: never fails for a Redis that
    /// is down, only for a URL that is not one.
    pub fn new(settings: &Settings, metrics: Arc<Metrics>) -> Result<Backend, BackendError> {
        let timeout = settings.redis_timeout();
        let nodes = settings.redis_nodes();
        let redis = if settings.is_cluster() {
            let client = ClusterClient::builder(nodes)
                .connection_timeout(timeout)
                .response_timeout(timeout)
                .retries(0)
                .build()?;
            Redis::Cluster(Box::new(Cluster {
                client,
                connection: Mutex::new(Slot::default()),
            }))
        } else {
            let url = nodes.into_iter().next().unwrap_or_default();
            let client = redis::Client::open(url)?;
            let config = ConnectionManagerConfig::new()
                .set_connection_timeout(Some(timeout))
                .set_response_timeout(Some(timeout))
                .set_number_of_retries(1)
                .set_max_delay(Duration::from_millis(500));
            Redis::Single(ConnectionManager::new_lazy_with_config(client, config)?)
        };
        Ok(Backend {
            redis,
            timeout,
            metrics,
        })
    }

    pub fn is_cluster(&self) -> bool {
        matches!(self.redis, Redis::Cluster(_))
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

    /// A connection, and on a cluster which one (its generation, 1 for the first).
    async fn connection(&self) -> Result<(Connection, u64), BackendError> {
        match &self.redis {
            Redis::Single(manager) => Ok((Connection::Single(manager.clone()), 0)),
            Redis::Cluster(cluster) => {
                let mut slot = cluster.connection.lock().await;
                if let Some(existing) = slot.connection.as_ref() {
                    return Ok((Connection::Cluster(existing.clone()), slot.generation));
                }
                let fresh = cluster.client.get_async_connection().await?;
                slot.connection = Some(fresh.clone());
                slot.generation += 1;
                Ok((Connection::Cluster(fresh), slot.generation))
            }
        }
    }

    /// After a cluster call: if it failed for want of a node, drops the connection it used (not
    /// a newer one); after a timeout, unless one was dropped less than
    /// [`RECONNECT_AFTER_TIMEOUT`] ago.
    async fn after<T>(&self, outcome: &Result<T, BackendError>, generation: u64) {
        let Redis::Cluster(cluster) = &self.redis else {
            return;
        };
        let Err(error) = outcome else {
            return;
        };
        if generation == 0 || !wants_new_connection(error) {
            return;
        }
        let mut slot = cluster.connection.lock().await;
        let timed_out = matches!(error, BackendError::Timeout(_))
            || matches!(error, BackendError::Redis(e) if e.is_timeout());
        let recently = timed_out
            && slot
                .dropped_at
                .is_some_and(|at| at.elapsed() < RECONNECT_AFTER_TIMEOUT);
        if slot.generation == generation && slot.connection.is_some() && !recently {
            slot.connection = None;
            slot.dropped_at = Some(Instant::now());
            tracing::warn!(%error, "Redis Cluster: reconnecting to re-read the slots");
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
                    redis::ErrorKind::Server(redis::ServerErrorKind::MasterDown)
                )
        }
        BackendError::Reply(_) => false,
    }
}

/// One handle on either kind of Redis, usable wherever the redis crate takes a connection.
enum Connection {
    Single(ConnectionManager),
    Cluster(ClusterConnection),
}

impl ConnectionLike for Connection {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a Cmd) -> RedisFuture<'a, Value> {
        match self {
            Connection::Single(c) => c.req_packed_command(cmd),
            Connection::Cluster(c) => c.req_packed_command(cmd),
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
        }
    }

    fn get_db(&self) -> i64 {
        match self {
            Connection::Single(c) => c.get_db(),
            Connection::Cluster(c) => c.get_db(),
        }
    }
}
