//! A local Redis Cluster made with `redis-cli --cluster create`: several primaries, each with
//! replicas or none. A primary can be killed ([`RedisCluster::kill`]) and its replica's promotion
//! awaited ([`RedisCluster::wait_for_failover`]). Its nodes may listen over TLS only
//! ([`RedisCluster::start_tls`]).

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};

use super::binaries::redis_cli;
use super::server::Redis;
use super::tls::TestCertificates;

/// How to build a cluster.
#[derive(Debug, Clone)]
pub struct ClusterOptions {
    /// Primaries (at least 3).
    pub primaries: usize,
    /// Replicas of each primary (`--cluster-replicas`).
    pub replicas: usize,
    /// `cluster-node-timeout`: how long a node may be silent before it is failed (and its replica
    /// promoted): failover takes about this plus a second.
    pub node_timeout_ms: u64,
    /// `cluster-require-full-coverage`: with `false`, the slots whose primary is alive keep
    /// answering while another primary is down.
    pub require_full_coverage: bool,
}

impl ClusterOptions {
    /// `primaries` primaries, no replicas, the default timeout, full coverage required.
    pub fn new(primaries: usize) -> ClusterOptions {
        ClusterOptions {
            primaries,
            replicas: 0,
            node_timeout_ms: 5000,
            require_full_coverage: true,
        }
    }

    /// `primaries` primaries with `replicas` replicas each, failed over within a couple of
    /// seconds (node timeout 1 s), unaffected slots served meanwhile.
    pub fn with_replicas(primaries: usize, replicas: usize) -> ClusterOptions {
        ClusterOptions {
            primaries,
            replicas,
            node_timeout_ms: 1000,
            require_full_coverage: false,
        }
    }
}

/// One node as the cluster sees it (a line of `CLUSTER NODES`).
#[derive(Debug, Clone, PartialEq)]
pub struct NodeView {
    pub id: String,
    /// `127.0.0.1:<port>`
    pub address: String,
    pub primary: bool,
    /// Flagged `fail` (or `fail?`) by the node asked.
    pub failed: bool,
    /// The primary's id, for a replica.
    pub replica_of: Option<String>,
    /// Slot ranges served, inclusive.
    pub slots: Vec<(u16, u16)>,
}

/// A running Redis Cluster; every node is killed on drop.
pub struct RedisCluster {
    nodes: Vec<Redis>,
}

impl RedisCluster {
    /// Starts `masters` nodes (at least 3), no replicas, joins them, and waits for
    /// `cluster_state:ok` on each.
    pub fn start(masters: usize) -> Result<RedisCluster> {
        RedisCluster::start_with(ClusterOptions::new(masters))
    }

    /// Starts `primaries × (1 + replicas)` nodes, joins them (`redis-cli` picks which node is
    /// which), and waits until every node reports `cluster_state:ok` and sees every replica.
    pub fn start_with(options: ClusterOptions) -> Result<RedisCluster> {
        RedisCluster::start_nodes(options, &[], Redis::start_with, &[])
    }

    /// [`RedisCluster::start_with`], every node listening over TLS only (`--port 0 --tls-port`,
    /// [`Redis::start_tls`] with `certs`), the cluster bus and replication over TLS too
    /// (`tls-cluster`, `tls-replication`), each node showing `client.pem` to the others.
    /// `extra` goes to every node (e.g. `--aclfile`, `--tls-auth-clients yes`). `redis-cli`
    /// joins them over TLS; the fixture's own commands go over TLS ([`Redis::query`]).
    pub fn start_tls(
        options: ClusterOptions,
        certs: &TestCertificates,
        extra: &[&str],
    ) -> Result<RedisCluster> {
        let path = |name: &str| certs.path(name).display().to_string();
        let (client, client_key, ca) = (path("client.pem"), path("client.key"), path("ca.pem"));
        let mut tls: Vec<&str> = vec![
            "--tls-cluster",
            "yes",
            "--tls-replication",
            "yes",
            "--tls-client-cert-file",
            &client,
            "--tls-client-key-file",
            &client_key,
        ];
        tls.extend_from_slice(extra);
        let cli = [
            "--tls",
            "--cacert",
            ca.as_str(),
            "--cert",
            client.as_str(),
            "--key",
            client_key.as_str(),
        ];
        RedisCluster::start_nodes(options, &tls, |args| Redis::start_tls(certs, args), &cli)
    }

    /// Starts the nodes with `start` (the cluster's arguments, then `extra`), and joins them with
    /// `redis-cli` (`cli` before `--cluster create`).
    fn start_nodes(
        options: ClusterOptions,
        extra: &[&str],
        start: impl Fn(&[&str]) -> Result<Redis>,
        cli: &[&str],
    ) -> Result<RedisCluster> {
        let timeout = options.node_timeout_ms.to_string();
        let coverage = if options.require_full_coverage {
            "yes"
        } else {
            "no"
        };
        let count = options.primaries * (1 + options.replicas);
        let nodes = (0..count)
            .map(|_| {
                let mut args = vec![
                    "--cluster-enabled",
                    "yes",
                    "--cluster-config-file",
                    "nodes.conf",
                    "--cluster-node-timeout",
                    &timeout,
                    "--cluster-require-full-coverage",
                    coverage,
                    // A replica syncs with its primary at once (the default waits 5 s for
                    // more replicas), and takes over however long its link was down.
                    "--repl-diskless-sync-delay",
                    "0",
                    "--cluster-replica-validity-factor",
                    "0",
                ];
                args.extend_from_slice(extra);
                start(&args)
            })
            .collect::<Result<Vec<_>>>()?;
        let cluster = RedisCluster { nodes };
        let output = Command::new(redis_cli())
            .args(cli)
            .arg("--cluster")
            .arg("create")
            .args(cluster.nodes.iter().map(Redis::address))
            .args(["--cluster-replicas", &options.replicas.to_string()])
            .arg("--cluster-yes")
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
        cluster.wait_until_ok(Duration::from_secs(30))?;
        let replicas = options.primaries * options.replicas;
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            // Every node sees every replica, and every replica holds its primary's data.
            let seen = (0..cluster.nodes.len()).all(|i| {
                cluster.view_from(i).is_ok_and(|view| {
                    view.iter().filter(|n| n.replica_of.is_some()).count() == replicas
                        && view.iter().filter(|n| n.primary).count() == options.primaries
                })
            });
            let synced = cluster.nodes.iter().all(|node| {
                node.text(&["INFO", "replication"]).is_ok_and(|info| {
                    info.contains("role:master") || info.contains("master_link_status:up")
                })
            });
            let seen = seen && synced;
            if seen {
                break;
            }
            if Instant::now() > deadline {
                bail!("not every node saw {replicas} replica(s) in sync within 30 s");
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        Ok(cluster)
    }

    pub fn nodes(&self) -> &[Redis] {
        &self.nodes
    }

    pub fn nodes_mut(&mut self) -> &mut [Redis] {
        &mut self.nodes
    }

    /// Every node's URL: `redis://127.0.0.1:<port>`, or `rediss://localhost:<port>` over TLS.
    pub fn urls(&self) -> Vec<String> {
        self.nodes.iter().map(Redis::url).collect()
    }

    /// The node URLs, comma-separated (the service's `--redis-url` for a cluster).
    pub fn url_list(&self) -> String {
        self.urls().join(",")
    }

    /// The slot of `key`, as the cluster computes it (`CLUSTER KEYSLOT`).
    pub fn slot(&self, key: &str) -> Result<u16> {
        let node = self.live_node()?;
        Ok(self.nodes[node]
            .text(&["CLUSTER", "KEYSLOT", key])?
            .parse()?)
    }

    /// `command` calls summed over every running node (see [`Redis::command_calls`]).
    pub fn command_calls(&self, command: &str) -> Result<u64> {
        self.nodes
            .iter()
            .filter(|n| n.pid().is_some())
            .map(|n| n.command_calls(command))
            .sum()
    }

    /// `CONFIG RESETSTAT` on every running node.
    pub fn reset_stats(&self) -> Result<()> {
        for node in self.nodes.iter().filter(|n| n.pid().is_some()) {
            node.query(&["CONFIG", "RESETSTAT"])?;
        }
        Ok(())
    }

    /// The cluster as node `index` sees it (`CLUSTER NODES`).
    pub fn view_from(&self, index: usize) -> Result<Vec<NodeView>> {
        let text = self.nodes[index].text(&["CLUSTER", "NODES"])?;
        Ok(text.lines().filter_map(parse_node_line).collect())
    }

    /// The index (into [`RedisCluster::nodes`]) of the node serving `slot` as a primary, as the
    /// first running node sees it.
    pub fn primary_of(&self, slot: u16) -> Result<usize> {
        let view = self.view_from(self.live_node()?)?;
        let node = view
            .iter()
            .find(|n| n.primary && n.slots.iter().any(|&(a, b)| (a..=b).contains(&slot)))
            .with_context(|| format!("no primary serves slot {slot}: {view:?}"))?;
        self.index_of(&node.address)
    }

    /// The slot ranges node `index` serves as a primary (empty for a replica).
    pub fn slots_of(&self, index: usize) -> Result<Vec<(u16, u16)>> {
        let address = self.nodes[index].address();
        let view = self.view_from(self.live_node()?)?;
        Ok(view
            .into_iter()
            .find(|n| n.address == address && n.primary)
            .map(|n| n.slots)
            .unwrap_or_default())
    }

    /// Kills node `index` (SIGKILL: a crash). Its data is gone; its `nodes.conf` is kept.
    pub fn kill(&mut self, index: usize) {
        self.nodes[index].stop();
    }

    /// Waits until the slots the killed node `killed` served are served by another, running
    /// node (its replica, promoted), and every running node reports `cluster_state:ok`.
    /// Answers the index of the new primary.
    pub fn wait_for_failover(
        &self,
        killed: usize,
        slots: &[(u16, u16)],
        within: Duration,
    ) -> Result<usize> {
        let (first, _) = *slots.first().context("the killed node served no slot")?;
        let deadline = Instant::now() + within;
        let old = self.nodes[killed].address();
        loop {
            let promoted = self
                .primary_of(first)
                .ok()
                .filter(|&i| self.nodes[i].address() != old && self.nodes[i].pid().is_some());
            let all_ok = self.nodes.iter().filter(|n| n.pid().is_some()).all(|node| {
                node.text(&["CLUSTER", "INFO"])
                    .is_ok_and(|info| info.contains("cluster_state:ok"))
            });
            if let (Some(index), true) = (promoted, all_ok) {
                return Ok(index);
            }
            if Instant::now() > deadline {
                bail!("no replica took over slot {first} from {old} within {within:?}");
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    fn index_of(&self, address: &str) -> Result<usize> {
        self.nodes
            .iter()
            .position(|n| n.address() == address)
            .with_context(|| format!("{address} is not a node of this cluster"))
    }

    fn live_node(&self) -> Result<usize> {
        self.nodes
            .iter()
            .position(|n| n.pid().is_some())
            .context("no node of the cluster is running")
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

/// `<id> <ip:port@bus> <flags> <primary> <ping> <pong> <epoch> <link> <slot>...`
fn parse_node_line(line: &str) -> Option<NodeView> {
    let fields: Vec<&str> = line.split_whitespace().collect();
    if fields.len() < 8 {
        return None;
    }
    let address = fields[1].split('@').next()?.to_owned();
    let flags: Vec<&str> = fields[2].split(',').collect();
    let slots = fields[8..]
        .iter()
        .filter(|s| !s.starts_with('['))
        .filter_map(|s| match s.split_once('-') {
            Some((a, b)) => Some((a.parse().ok()?, b.parse().ok()?)),
            None => s.parse().ok().map(|n| (n, n)),
        })
        .collect();
    Some(NodeView {
        id: fields[0].to_owned(),
        address,
        primary: flags.contains(&"master"),
        failed: flags.contains(&"fail") || flags.contains(&"fail?"),
        replica_of: (fields[3] != "-").then(|| fields[3].to_owned()),
        slots,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_cluster_nodes_line_is_read() {
        let primary = parse_node_line(
            "07c3 127.0.0.1:30004@40004 myself,master - 0 0 1 connected 0-5460 6000 [93->-e7d]",
        )
        .unwrap();
        assert!(primary.primary && !primary.failed && primary.replica_of.is_none());
        assert_eq!(primary.address, "127.0.0.1:30004");
        assert_eq!(primary.slots, vec![(0, 5460), (6000, 6000)]);
        let replica =
            parse_node_line("e7d1 127.0.0.1:30005@40005 slave,fail 07c3 0 0 1 connected").unwrap();
        assert!(!replica.primary && replica.failed);
        assert_eq!(replica.replica_of.as_deref(), Some("07c3"));
    }
}
