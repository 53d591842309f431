//! Every setting of the service, from flags or the environment, in one struct.

use std::net::SocketAddr;
use std::time::Duration;

use clap::Parser;

/// The counter service's settings. Each flag also reads an environment variable.
#[derive(Debug, Clone, Parser)]
#[command(
    name = "sluice-counter-service",
    version,
    about,
    args_override_self = true
)]
pub struct Settings {
    /// Address to listen on.
    #[arg(long, env = "SLUICE_BIND", default_value = "127.0.0.1:8081")]
    pub bind: SocketAddr,

    /// Redis URL (`redis://host:port`), or a comma-separated list of Redis Cluster node URLs.
    #[arg(
        long,
        env = "SLUICE_REDIS_URL",
        default_value = "redis://127.0.0.1:6379"
    )]
    pub redis_url: String,

    /// Treat `--redis-url` as a Redis Cluster (implied by a comma-separated list).
    #[arg(long, env = "SLUICE_REDIS_CLUSTER")]
    pub redis_cluster: bool,

    /// Shared bearer token the proxies send (`Authorization: Bearer <token>`).
    #[arg(long, env = "SLUICE_TOKEN", hide_env_values = true)]
    pub token: Option<String>,

    /// Accept requests without a token (local experiments only).
    #[arg(long, env = "SLUICE_INSECURE_NO_AUTH")]
    pub insecure_no_auth: bool,

    /// Deadline of every Redis call, in milliseconds.
    #[arg(long, env = "SLUICE_REDIS_TIMEOUT_MS", default_value_t = 50)]
    pub redis_timeout_ms: u64,

    /// Largest accepted request body, in bytes.
    #[arg(long, env = "SLUICE_MAX_BODY_BYTES", default_value_t = 1 << 20)]
    pub max_body_bytes: usize,

    /// Most entries in one sync batch.
    #[arg(long, env = "SLUICE_MAX_BATCH", default_value_t = 10_000)]
    pub max_batch: usize,

    /// Longest accepted key (and proxy id), in bytes.
    #[arg(long, env = "SLUICE_MAX_KEY_BYTES", default_value_t = 512)]
    pub max_key_bytes: usize,

    /// Most requests served at once; more are shed with 503.
    #[arg(long, env = "SLUICE_MAX_CONCURRENCY", default_value_t = 512)]
    pub max_concurrency: usize,

    /// Deadline of a whole request, in milliseconds.
    #[arg(long, env = "SLUICE_REQUEST_TIMEOUT_MS", default_value_t = 1000)]
    pub request_timeout_ms: u64,

    /// How many sync intervals a grant lives before it expires.
    #[arg(long, env = "SLUICE_GRANT_TTL_INTERVALS", default_value_t = 3)]
    pub grant_ttl_intervals: u64,
}

impl Settings {
    /// The settings, or the reason (naming the flag) they cannot run a service.
    pub fn validate(&self) -> Result<(), String> {
        if self.token.as_deref().unwrap_or("").is_empty() && !self.insecure_no_auth {
            return Err("--token (SLUICE_TOKEN) is required unless --insecure-no-auth".into());
        }
        let positive = [
            ("--redis-timeout-ms", self.redis_timeout_ms),
            ("--max-body-bytes", self.max_body_bytes as u64),
            ("--max-batch", self.max_batch as u64),
            ("--max-key-bytes", self.max_key_bytes as u64),
            ("--max-concurrency", self.max_concurrency as u64),
            ("--request-timeout-ms", self.request_timeout_ms),
            ("--grant-ttl-intervals", self.grant_ttl_intervals),
        ];
        for (flag, value) in positive {
            if value == 0 {
                return Err(format!("{flag} must be at least 1"));
            }
        }
        if self.redis_nodes().is_empty() {
            return Err("--redis-url (SLUICE_REDIS_URL) is empty".into());
        }
        Ok(())
    }

    /// The Redis URLs: one for a single Redis, the seed nodes for a cluster.
    pub fn redis_nodes(&self) -> Vec<String> {
        self.redis_url
            .split(',')
            .map(str::trim)
            .filter(|url| !url.is_empty())
            .map(str::to_owned)
            .collect()
    }

    /// Whether Redis is a cluster: the flag, or more than one node URL.
    pub fn is_cluster(&self) -> bool {
        self.redis_cluster || self.redis_nodes().len() > 1
    }

    pub fn redis_timeout(&self) -> Duration {
        Duration::from_millis(self.redis_timeout_ms)
    }

    pub fn request_timeout(&self) -> Duration {
        Duration::from_millis(self.request_timeout_ms)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(args: &[&str]) -> Settings {
        let mut all = vec!["sluice-counter-service"];
        all.extend_from_slice(args);
        Settings::try_parse_from(all).unwrap()
    }

    #[test]
    fn a_token_is_required_unless_insecure() {
        let settings = parse(&["--token", ""]);
        assert_eq!(
            settings.validate().unwrap_err(),
            "--token (SLUICE_TOKEN) is required unless --insecure-no-auth"
        );
        assert!(parse(&["--token", "t"]).validate().is_ok());
        assert!(parse(&["--token", "", "--insecure-no-auth"])
            .validate()
            .is_ok());
    }

    #[test]
    fn a_list_of_urls_is_a_cluster() {
        let settings = parse(&["--token", "t", "--redis-url", "redis://a:1, redis://b:2"]);
        assert_eq!(settings.redis_nodes(), ["redis://a:1", "redis://b:2"]);
        assert!(settings.is_cluster());
        assert!(!parse(&["--token", "t"]).is_cluster());
    }

    #[test]
    fn zero_limits_name_their_flag() {
        let settings = parse(&["--token", "t", "--max-batch", "0"]);
        assert_eq!(
            settings.validate().unwrap_err(),
            "--max-batch must be at least 1"
        );
    }
}
