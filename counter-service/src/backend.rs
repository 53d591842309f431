//! Redis, single or cluster, chosen in this one place. Every call runs under the Redis timeout,
//! so a slow or absent Redis answers an error, never a hang.

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

struct Cluster {
    client: ClusterClient,
    connection: Mutex<Option<ClusterConnection>>,
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
                .retries(1)
                .build()?;
            Redis::Cluster(Box::new(Cluster {
                client,
                connection: Mutex::new(None),
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
        self.timed(op, async {
            let mut connection = self.connection().await?;
            Ok(invocation.invoke_async(&mut connection).await?)
        })
        .await
    }

    /// Runs one command (routed by its first key on a cluster).
    pub async fn query<T: FromRedisValue>(
        &self,
        op: &'static str,
        command: &Cmd,
    ) -> Result<T, BackendError> {
        self.timed(op, async {
            let mut connection = self.connection().await?;
            Ok(command.query_async(&mut connection).await?)
        })
        .await
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

    async fn connection(&self) -> Result<Connection, BackendError> {
        match &self.redis {
            Redis::Single(manager) => Ok(Connection::Single(manager.clone())),
            Redis::Cluster(cluster) => {
                let mut slot = cluster.connection.lock().await;
                if let Some(existing) = slot.as_ref() {
                    return Ok(Connection::Cluster(existing.clone()));
                }
                let fresh = cluster.client.get_async_connection().await?;
                *slot = Some(fresh.clone());
                Ok(Connection::Cluster(fresh))
            }
        }
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
