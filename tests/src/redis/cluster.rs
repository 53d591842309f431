//! A local Redis Cluster: several masters, no replicas, made with `redis-cli --cluster create`.

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};

use super::binaries::redis_cli;
use super::server::Redis;

/// A running Redis Cluster; every node is killed on drop.
pub struct RedisCluster {
    nodes: Vec<Redis>,
}

impl RedisCluster {
    /// Starts `masters` nodes (at least 3), joins them, and waits for `cluster_state:ok` on each.
    pub fn start(masters: usize) -> Result<RedisCluster> {
        let nodes = (0..masters)
            .map(|_| {
                Redis::start_with(&[
                    "--cluster-enabled",
                    "yes",
                    "--cluster-config-file",
                    "nodes.conf",
                    "--cluster-node-timeout",
                    "5000",
                ])
            })
            .collect::<Result<Vec<_>>>()?;
        let cluster = RedisCluster { nodes };
        let output = Command::new(redis_cli())
            .arg("--cluster")
            .arg("create")
            .args(cluster.nodes.iter().map(Redis::address))
            .args(["--cluster-replicas", "0", "--cluster-yes"])
            .stdin(Stdio::null())
            .output()
            .with_context(|| format!("running {} --cluster create", redis_cli().display()))?;
        if !output.status.success() {
            bail!(
                "redis-cli --cluster create failed: {}{}",
                String::from_utf8_lossy(&output.stdout),
                String::from_utf8_lossy(&output.stderr)
            );
        }
        cluster.wait_until_ok(Duration::from_secs(20))?;
        Ok(cluster)
    }

    pub fn nodes(&self) -> &[Redis] {
        &self.nodes
    }

    pub fn nodes_mut(&mut self) -> &mut [Redis] {
        &mut self.nodes
    }

    /// Every node's `redis://` URL.
    pub fn urls(&self) -> Vec<String> {
        self.nodes.iter().map(Redis::url).collect()
    }

    /// The node URLs, comma-separated (the service's `--redis-url` for a cluster).
    pub fn url_list(&self) -> String {
        self.urls().join(",")
    }

    /// The slot of `key`, as the cluster computes it (`CLUSTER KEYSLOT`).
    pub fn slot(&self, key: &str) -> Result<u16> {
        Ok(self.nodes[0].text(&["CLUSTER", "KEYSLOT", key])?.parse()?)
    }

    /// `command` calls summed over every node (see [`Redis::command_calls`]).
    pub fn command_calls(&self, command: &str) -> Result<u64> {
        self.nodes.iter().map(|n| n.command_calls(command)).sum()
    }

    /// `CONFIG RESETSTAT` on every node.
    pub fn reset_stats(&self) -> Result<()> {
        for node in &self.nodes {
            node.query(&["CONFIG", "RESETSTAT"])?;
        }
        Ok(())
    }

    fn wait_until_ok(&self, within: Duration) -> Result<()> {
        let deadline = Instant::now() + within;
        loop {
            let ok = self.nodes.iter().all(|node| {
                node.text(&["CLUSTER", "INFO"])
                    .map(|info| info.contains("cluster_state:ok"))
                    .unwrap_or(false)
            });
            if ok {
                return Ok(());
            }
            if Instant::now() > deadline {
                bail!("the cluster did not reach cluster_state:ok in {within:?}");
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}
