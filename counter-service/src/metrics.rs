//! The service's Prometheus metrics (OpenMetrics text at `GET /metrics`), and the Redis latency
//! average that drives backpressure.

use std::sync::atomic::AtomicU64;
use std::time::Duration;

use prometheus_client::encoding::text::encode;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::Registry;

use crate::backpressure::Ewma;

type Labels = Vec<(&'static str, &'static str)>;

/// Every metric, registered once.
pub struct Metrics {
    registry: Registry,
    /// `POST /v1/sync` batches answered.
    pub syncs: Counter,
    /// Entries (keys) applied by syncs.
    pub entries_synced: Counter,
    /// Entries refused alone (out of bounds): their counts were not applied.
    pub refused_entries: Counter,
    /// Entries whose `spent` or `denied` was cut to what their limits make possible.
    pub capped_entries: Counter,
    /// Sync entries that replayed a report already applied (same proxy, key and round): answered,
    /// not counted again.
    pub replayed_entries: Counter,
    /// Script calls, by script: one per hash slot per sync batch.
    script_calls: Family<Labels, Counter>,
    /// Strict checks, by decision.
    checks: Family<Labels, Counter>,
    /// Descriptors of the rate limit service counted (`--grpc-bind`), by decision.
    rls_descriptors: Family<Labels, Counter>,
    /// Requests the proxies reported as denied (unmet demand).
    pub reported_denials: Counter,
    /// Grants answered, and those of zero tokens.
    pub grants: Counter,
    pub empty_grants: Counter,
    /// Tokens handed out in grants.
    pub granted_tokens: Counter,
    /// Redis call latency, by operation and outcome.
    redis_seconds: Family<Labels, Histogram, fn() -> Histogram>,
    /// Error responses, by kind.
    errors: Family<Labels, Counter>,
    /// Requests in flight on `/v1`, and the last `next_sync_ms` hint.
    pub in_flight: Gauge,
    /// Connections open.
    pub connections: Gauge,
    pub next_sync_ms: Gauge,
    /// The last fleet load level this replica answered, and how many proxies' reports it was
    /// the mean of.
    pub fleet_load_level: Gauge<f64, AtomicU64>,
    pub fleet_proxies: Gauge,
    /// How many credentials the last fleet load level answered was the mean of.
    pub fleet_credentials: Gauge,
    /// The last count of proxies with a fleet-share fallback this replica answered.
    pub fleet_share_proxies: Gauge,
    /// Fleet-share counts, by outcome: `recorded`, `full` (the credential counts as many proxy
    /// ids as it may: not counted, answered all the same), `error` (Redis failed: no count).
    fleet_shares: Family<Labels, Counter>,
    /// Load reports, by outcome: `recorded`, `full` (the credential had as many fresh reports as
    /// it may: not recorded, answered all the same), `error` (Redis failed: no level answered).
    load_reports: Family<Labels, Counter>,
    /// Top-keys reports (one per rule of a sync), by outcome: `kept`, `full` (the credential or
    /// the replica keeps as many rules as it may), `refused` (out of bounds).
    top_reports: Family<Labels, Counter>,
    /// Changes made through the admin API, by action (`set_limits`, `delete_key`, …).
    admin_changes: Family<Labels, Counter>,
    /// Overrides removed because their ttl ran out.
    pub overrides_expired: Counter,
    /// Sync answers that carried the whole set of live overrides (the proxy's version was not
    /// the current one).
    pub overrides_sent: Counter,
    /// Syncs answered the live overrides from this replica's last read (within
    /// `--overrides-refresh-ms`), without a Redis call.
    pub overrides_reads_shared: Counter,
    /// The version of the live overrides this replica last read or wrote.
    pub overrides_version: Gauge,
    /// Sync answers that carried a delta of the live overrides (the changes since the proxy's
    /// version).
    pub overrides_deltas_sent: Counter,
    /// Bytes of the live overrides sync answers carried (their JSON), by kind (`whole`, `delta`).
    overrides_answered_bytes: Family<Labels, Counter>,
    /// The size of the live overrides as the last read found it, as proxies receive them.
    pub overrides_bytes: Gauge,
    /// 1 while the emergency bypass is on, as the last read of the live overrides found it.
    pub bypass: Gauge,
    /// Redis latency, moving average, for backpressure.
    pub redis_latency: Ewma,
}

fn latency_histogram() -> Histogram {
    // 100 µs .. ~1.6 s
    Histogram::new(exponential_buckets(0.0001, 2.0, 15))
}

impl Metrics {
    pub fn new() -> Metrics {
        let mut registry = Registry::with_prefix("sluice");
        let metrics = Metrics {
            syncs: Counter::default(),
            entries_synced: Counter::default(),
            refused_entries: Counter::default(),
            capped_entries: Counter::default(),
            replayed_entries: Counter::default(),
            script_calls: Family::default(),
            checks: Family::default(),
            rls_descriptors: Family::default(),
            reported_denials: Counter::default(),
            grants: Counter::default(),
            empty_grants: Counter::default(),
            granted_tokens: Counter::default(),
            redis_seconds: Family::new_with_constructor(latency_histogram),
            errors: Family::default(),
            in_flight: Gauge::default(),
            connections: Gauge::default(),
            next_sync_ms: Gauge::default(),
            fleet_load_level: Gauge::default(),
            fleet_proxies: Gauge::default(),
            fleet_credentials: Gauge::default(),
            fleet_share_proxies: Gauge::default(),
            fleet_shares: Family::default(),
            load_reports: Family::default(),
            top_reports: Family::default(),
            admin_changes: Family::default(),
            overrides_expired: Counter::default(),
            overrides_sent: Counter::default(),
            overrides_reads_shared: Counter::default(),
            overrides_version: Gauge::default(),
            overrides_deltas_sent: Counter::default(),
            overrides_answered_bytes: Family::default(),
            overrides_bytes: Gauge::default(),
            bypass: Gauge::default(),
            redis_latency: Ewma::new(0.2),
            registry: Registry::default(),
        };
        registry.register("syncs", "Sync batches answered", metrics.syncs.clone());
        registry.register(
            "sync_entries",
            "Keys applied by syncs",
            metrics.entries_synced.clone(),
        );
        registry.register(
            "refused_entries",
            "Sync entries refused alone (out of bounds), their counts not applied",
            metrics.refused_entries.clone(),
        );
        registry.register(
            "capped_entries",
            "Sync entries whose spent or denied was cut to what their limits make possible",
            metrics.capped_entries.clone(),
        );
        registry.register(
            "replayed_entries",
            "Sync entries replaying a report already applied (a resent batch): answered, not counted again",
            metrics.replayed_entries.clone(),
        );
        registry.register(
            "script_calls",
            "Lua script calls, by script",
            metrics.script_calls.clone(),
        );
        registry.register(
            "checks",
            "Strict checks, by decision",
            metrics.checks.clone(),
        );
        registry.register(
            "rls_descriptors",
            "Descriptors of Envoy's rate limit protocol counted, by decision",
            metrics.rls_descriptors.clone(),
        );
        registry.register(
            "reported_denials",
            "Requests the proxies reported as denied",
            metrics.reported_denials.clone(),
        );
        registry.register("grants", "Grants answered", metrics.grants.clone());
        registry.register(
            "empty_grants",
            "Grants of zero tokens",
            metrics.empty_grants.clone(),
        );
        registry.register(
            "granted_tokens",
            "Tokens handed out in grants",
            metrics.granted_tokens.clone(),
        );
        registry.register(
            "redis_seconds",
            "Redis call latency, by operation and outcome",
            metrics.redis_seconds.clone(),
        );
        registry.register("errors", "Error responses, by kind", metrics.errors.clone());
        registry.register(
            "in_flight",
            "Requests in flight on /v1",
            metrics.in_flight.clone(),
        );
        registry.register(
            "connections",
            "Connections open",
            metrics.connections.clone(),
        );
        registry.register(
            "next_sync_ms",
            "The last next_sync_ms hint",
            metrics.next_sync_ms.clone(),
        );
        registry.register(
            "fleet_load_level",
            "The last fleet load level answered (mean over credentials of their fresh reports' mean utilization)",
            metrics.fleet_load_level.clone(),
        );
        registry.register(
            "fleet_proxies",
            "Proxies whose load report was fresh at the last fleet load level answered",
            metrics.fleet_proxies.clone(),
        );
        registry.register(
            "fleet_credentials",
            "Credentials the last fleet load level answered was the mean of",
            metrics.fleet_credentials.clone(),
        );
        registry.register(
            "fleet_share_proxies",
            "Proxies with a fleet-share fallback counted at the last count answered",
            metrics.fleet_share_proxies.clone(),
        );
        registry.register(
            "fleet_shares",
            "Syncs that asked for the fleet-share count, by outcome",
            metrics.fleet_shares.clone(),
        );
        registry.register(
            "load_reports",
            "Load reports, by outcome",
            metrics.load_reports.clone(),
        );
        registry.register(
            "top_reports",
            "Top-keys reports, by outcome",
            metrics.top_reports.clone(),
        );
        registry.register(
            "admin_changes",
            "Changes made through the admin API, by action",
            metrics.admin_changes.clone(),
        );
        registry.register(
            "overrides_expired",
            "Live overrides removed because their ttl ran out",
            metrics.overrides_expired.clone(),
        );
        registry.register(
            "overrides_sent",
            "Sync answers that carried the whole set of live overrides",
            metrics.overrides_sent.clone(),
        );
        registry.register(
            "overrides_reads_shared",
            "Syncs answered the live overrides from the replica's last read, without Redis",
            metrics.overrides_reads_shared.clone(),
        );
        registry.register(
            "overrides_version",
            "The version of the live overrides this replica last read or wrote",
            metrics.overrides_version.clone(),
        );
        registry.register(
            "overrides_deltas_sent",
            "Sync answers that carried a delta of the live overrides",
            metrics.overrides_deltas_sent.clone(),
        );
        registry.register(
            "overrides_answered_bytes",
            "Bytes of live overrides sync answers carried, by kind (whole, delta)",
            metrics.overrides_answered_bytes.clone(),
        );
        registry.register(
            "overrides_bytes",
            "The size of the live overrides as proxies receive them, at the last read",
            metrics.overrides_bytes.clone(),
        );
        registry.register(
            "bypass",
            "1 while the emergency bypass is on, as the last read of the live overrides found it",
            metrics.bypass.clone(),
        );
        Metrics {
            registry,
            ..metrics
        }
    }

    pub fn observe_redis(&self, op: &'static str, elapsed: Duration, ok: bool) {
        let outcome = if ok { "ok" } else { "error" };
        self.redis_seconds
            .get_or_create(&vec![("op", op), ("outcome", outcome)])
            .observe(elapsed.as_secs_f64());
        self.redis_latency.observe(elapsed.as_secs_f64() * 1000.0);
    }

    pub fn script_called(&self, script: &'static str, calls: u64) {
        self.script_calls
            .get_or_create(&vec![("script", script)])
            .inc_by(calls);
    }

    /// A descriptor of the rate limit service counted: `allowed`, `denied`, or (over, but in
    /// `shadow_mode`) `shadow_denied`.
    pub fn rls_decided(&self, allowed: bool, shadow: bool) {
        let decision = match (allowed, shadow) {
            (true, _) => "allowed",
            (false, false) => "denied",
            (false, true) => "shadow_denied",
        };
        self.rls_descriptors
            .get_or_create(&vec![("decision", decision)])
            .inc();
    }

    pub fn checked(&self, allowed: bool) {
        let decision = if allowed { "allowed" } else { "denied" };
        self.checks
            .get_or_create(&vec![("decision", decision)])
            .inc();
    }

    /// A load report's outcome: `recorded`, `full` or `error`.
    pub fn fleet_share_counted(&self, outcome: &'static str) {
        self.fleet_shares
            .get_or_create(&vec![("outcome", outcome)])
            .inc();
    }

    pub fn top_reported(&self, outcome: &'static str) {
        self.top_reports
            .get_or_create(&vec![("outcome", outcome)])
            .inc();
    }

    pub fn load_reported(&self, outcome: &'static str) {
        self.load_reports
            .get_or_create(&vec![("outcome", outcome)])
            .inc();
    }

    /// A change made through the admin API (`set_limits`, `delete_key`, …).
    /// Bytes of live overrides answered to a sync, as a whole set or a delta.
    pub fn overrides_answered_bytes(&self, kind: &'static str, bytes: u64) {
        self.overrides_answered_bytes
            .get_or_create(&vec![("kind", kind)])
            .inc_by(bytes);
    }

    pub fn admin_changed(&self, action: &'static str) {
        self.admin_changes
            .get_or_create(&vec![("action", action)])
            .inc();
    }

    pub fn error(&self, kind: &'static str) {
        self.errors.get_or_create(&vec![("kind", kind)]).inc();
    }

    /// The OpenMetrics text of every metric.
    pub fn render(&self) -> Result<String, std::fmt::Error> {
        let mut text = String::new();
        encode(&mut text, &self.registry)?;
        Ok(text)
    }
}

impl Default for Metrics {
    fn default() -> Metrics {
        Metrics::new()
    }
}
