//! Real Redis servers for tests (Debian's `redis-server`, never a mock): one on a free loopback
//! port, or a local Redis Cluster of several primaries (with replicas or none). Each lives in a temp dir, persists nothing,
//! and is killed when dropped (or when the thread that started it ends). A Redis can listen
//! over TLS only ([`Redis::start_tls`]), with certificates the test makes ([`TestCertificates`]).

mod binaries;
mod cluster;
mod ports;
mod resp;
mod sentinel;
mod server;
mod tls;

pub use binaries::{redis_cli, redis_server};
pub use cluster::{ClusterOptions, NodeView, RedisCluster};
pub use resp::{query, Reply};
pub use sentinel::Sentinel;
pub use server::Redis;
pub use tls::{TestCertificates, TlsClient};
