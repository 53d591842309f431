//! `POST /v1/sync`: a proxy's batch. Every entry's spend is debited from the global buckets
//! (`lua/sync.lua`) or counted in the global windows (`lua/sync_window.lua`, for `fixed_window`
//! and `sliding_window`) and the entry is answered with a lease, one script call per Redis
//! Cluster hash slot and script, the calls of one batch in parallel. An entry out of bounds is refused alone. A batch that
//! carries the proxy's load is also answered the fleet's load level, and one that sets
//! `fleet_share` how many proxies divide their fallbacks ([`fleet`]). Every batch is
//! answered the bypass, and the live overrides when the proxy's version is not the current one:
//! the changes since it when the proxy takes deltas and the change log holds them, else the
//! whole set ([`overrides`]).

use std::collections::HashMap;

use axum::extract::State;
use axum::{Extension, Json};
use futures_util::future::try_join_all;
use sluice_protocol::{Hints, Lease, SyncEntry, SyncRequest, SyncResponse};

use crate::backend::BackendError;
use crate::backpressure;
use crate::body::JsonBody;
use crate::credentials::Caller;
use crate::error::AppError;
use crate::fleet;
use crate::keys;
use crate::overrides;
use crate::state::AppState;
use crate::validate;

/// Most entries in one script call, so that no call holds Redis for long.
pub const MAX_ENTRIES_PER_CALL: usize = 1_000;

pub async fn handle(
    State(state): State<AppState>,
    caller: Option<Extension<Caller>>,
    JsonBody(request): JsonBody<SyncRequest>,
) -> Result<Json<SyncResponse>, AppError> {
    let _in_flight = state.enter();
    validate::sync_batch(&request, &state.settings)?;
    let caller = caller.map(|Extension(caller)| caller).unwrap_or_default();
    let proxy = caller.proxy_id(&request.proxy);
    let debtor = caller.debtor(&request.proxy);
    // The live overrides are read beside the grants (one more script call, concurrent): the
    // answer reflects every change made before it, on any replica.
    // The interval to advise (the proxy's own while all is well, longer under backpressure)
    // first: leases are sized and timed by the interval the proxy will sync at.
    let settings = &state.settings;
    let metrics = &state.metrics;
    let next_sync_ms = backpressure::next_sync_ms(
        settings.sync_interval_ms(request.interval_ms),
        metrics.redis_latency.value(),
        settings.redis_timeout_ms,
        state.in_flight(),
        settings.max_concurrency,
    );
    let (grants, mut overrides) = tokio::join!(
        apply_as(&state, &proxy, debtor, &request, next_sync_ms, 0),
        overrides::for_sync(
            &state,
            request.overrides_version,
            request.overrides_delta,
            0
        )
    );
    let grants = grants?;

    metrics.syncs.inc();
    let answered = grants.iter().filter(|g| g.refused.is_none());
    metrics.grants.inc_by(answered.clone().count() as u64);
    metrics
        .empty_grants
        .inc_by(answered.clone().filter(|g| g.tokens == 0).count() as u64);
    metrics
        .granted_tokens
        .inc_by(answered.map(|g| g.tokens).sum());

    metrics.next_sync_ms.set(next_sync_ms as i64);
    // A sync without a report leaves the fleet alone and gets no level: only a proxy that sheds
    // reports its load, and only it uses the level.
    let credential = caller.name.as_deref();
    let level = async {
        match &request.load {
            Some(load) => fleet::level(&state, credential, &proxy, load, next_sync_ms).await,
            None => None,
        }
    };
    // Likewise only a proxy that divides a fallback among the fleet is counted and answered.
    let share = async {
        match request.fleet_share {
            true => fleet::share_count(&state, credential, &proxy, next_sync_ms).await,
            false => None,
        }
    };
    (overrides.load_level, overrides.fleet_proxies) = tokio::join!(level, share);
    record_top(&state, credential, &request);
    Ok(Json(SyncResponse {
        grants,
        hints: Hints {
            next_sync_ms,
            overrides,
        },
    }))
}

/// Keeps the batch's top keys ([`crate::top`]) under its credential: a report out of bounds is
/// refused alone (logged and counted), the grants are answered all the same.
fn record_top(state: &AppState, credential: Option<&str>, request: &SyncRequest) {
    if request.top.is_empty() {
        return;
    }
    let credential = credential.unwrap_or(fleet::SHARED_CREDENTIAL);
    let now_ms = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64);
    for (i, report) in request.top.iter().enumerate() {
        let outcome = match state.top.record(credential, i, report, now_ms) {
            crate::top::Recorded::Kept { dropped: 0 } => "kept",
            crate::top::Recorded::Kept { dropped } => {
                tracing::debug!(credential, dropped, "top keys out of bounds dropped");
                "kept"
            }
            crate::top::Recorded::Full => "full",
            crate::top::Recorded::Refused(reason) => {
                tracing::debug!(credential, %reason, "a top-keys report refused");
                "refused"
            }
        };
        state.metrics.top_reported(outcome);
    }
}

/// Applies a batch as its own proxy id, its own debtor ([`apply_as`]).
pub async fn apply(
    state: &AppState,
    request: &SyncRequest,
    now_override_us: u64,
) -> Result<Vec<Lease>, BackendError> {
    apply_as(
        state,
        &request.proxy,
        &request.proxy,
        request,
        request.interval_ms,
        now_override_us,
    )
    .await
}

/// Applies a batch for the proxy id `proxy` (the request's, namespaced by its credential) and
/// answers one grant per entry, in request order. What the proxy reports spent beyond the lease
/// it was granted at its last sync of a key is counted all the same, and kept as `debtor`'s
/// debt ([`crate::credentials::Caller::debtor`]): no penalty starts from one debtor's alone. An entry out of bounds is refused alone: its
/// grant is empty and says why, and its counts are not applied. Leases are sized for
/// `interval_ms` (the interval the proxy is advised: its own, or longer under backpressure),
/// clamped to the service's bounds, and each entry's counts are cut to what its limits make possible over the
/// time one report may cover ([`validate::report_cap`]). An entry whose round is not newer than
/// the last one applied for this proxy on its key replays a report already applied (its batch
/// was resent after the answer was lost): it is answered a grant and counts nothing
/// ([`SyncEntry::round`]). The calls of a batch run in parallel: a proxy sends each key at most
/// once per batch. `now_override_us` is 0 in service (Redis `TIME` is the clock); tests pass a
/// fake time.
pub async fn apply_as(
    state: &AppState,
    proxy: &str,
    debtor: &str,
    request: &SyncRequest,
    interval_ms: u64,
    now_override_us: u64,
) -> Result<Vec<Lease>, BackendError> {
    let settings = &state.settings;
    let metrics = &state.metrics;
    let interval_ms = settings.sync_interval_ms(interval_ms);
    let window_ms = validate::report_window_ms(settings, interval_ms);
    let call = Call {
        proxy,
        debtor,
        interval_ms,
        grant_ttl_ms: settings.grant_ttl_ms(interval_ms),
        window_ms,
        now_override_us,
    };

    let mut grants = vec![empty_grant(None); request.entries.len()];
    let mut accepted = Vec::with_capacity(request.entries.len());
    for (i, entry) in request.entries.iter().enumerate() {
        if let Err(reason) = validate::sync_entry(i, entry, settings) {
            tracing::debug!(proxy, "refused: {reason}");
            grants[i] = empty_grant(Some(reason.to_string()));
            continue;
        }
        let cap = validate::report_cap(&entry.limits, window_ms);
        let (spent, denied) = (entry.spent.min(cap), entry.denied.min(cap));
        if (spent, denied) != (entry.spent, entry.denied) {
            tracing::debug!(
                proxy,
                key = entry.key,
                cap,
                "counts cut to the limit's bound"
            );
            metrics.capped_entries.inc();
        }
        accepted.push(Report {
            index: i,
            entry,
            spent,
            denied,
        });
    }
    let refused = request.entries.len() - accepted.len();
    metrics.refused_entries.inc_by(refused as u64);
    metrics.entries_synced.inc_by(accepted.len() as u64);
    metrics
        .reported_denials
        .inc_by(accepted.iter().map(|r| r.denied).sum());

    // Token buckets and windows go to their own scripts: one call per slot for each.
    let cluster = state.backend.is_cluster();
    let mut groups: Vec<(bool, Vec<usize>)> = Vec::new();
    for windowed in [false, true] {
        let members: Vec<usize> = (0..accepted.len())
            .filter(|&j| accepted[j].windowed() == windowed)
            .collect();
        let keys: Vec<&str> = members
            .iter()
            .map(|&j| accepted[j].entry.key.as_str())
            .collect();
        let calls = calls(&keys, cluster);
        let script = if windowed { "sync_window" } else { "sync" };
        if !windowed || !calls.is_empty() {
            metrics.script_called(script, calls.len() as u64);
        }
        groups.extend(
            calls
                .into_iter()
                .map(|group| (windowed, group.into_iter().map(|k| members[k]).collect())),
        );
    }
    let replies = try_join_all(groups.iter().map(|(windowed, group)| {
        let reports: Vec<&Report> = group.iter().filter_map(|&j| accepted.get(j)).collect();
        call.run(state, *windowed, reports)
    }))
    .await?;
    for ((_, group), reply) in groups.iter().zip(replies) {
        for (&j, grant) in group.iter().zip(reply) {
            if let Some(report) = accepted.get(j) {
                grants[report.index] = grant;
            }
        }
    }
    Ok(grants)
}

fn empty_grant(refused: Option<String>) -> Lease {
    Lease {
        tokens: 0,
        ttl_ms: 0,
        remaining: 0,
        reset_ms: 0,
        token_ms: None,
        refused,
        penalty_ms: 0,
    }
}

/// One accepted entry of a batch: its index in the request and its (capped) counts.
struct Report<'a> {
    index: usize,
    entry: &'a SyncEntry,
    spent: u64,
    denied: u64,
}

impl Report<'_> {
    /// Whether the entry's limits are windows (they share one algorithm, see `validate`).
    fn windowed(&self) -> bool {
        self.entry.limits.iter().any(|l| l.algorithm.windowed())
    }
}

/// The script calls of a batch, as lists of indexes into `keys` (the entry keys): on a cluster,
/// one per hash slot (every key of a call in one slot); on one Redis, the batch in order. Each
/// split in runs of at most [`MAX_ENTRIES_PER_CALL`].
pub fn calls(keys: &[&str], cluster: bool) -> Vec<Vec<usize>> {
    let mut groups: Vec<Vec<usize>> = Vec::new();
    if cluster {
        let mut by_slot = HashMap::new();
        for (i, key) in keys.iter().enumerate() {
            let group = *by_slot.entry(keys::slot(key)).or_insert_with(|| {
                groups.push(Vec::new());
                groups.len() - 1
            });
            groups[group].push(i);
        }
    } else if !keys.is_empty() {
        groups.push((0..keys.len()).collect());
    }
    groups
        .into_iter()
        .flat_map(|group| {
            group
                .chunks(MAX_ENTRIES_PER_CALL)
                .map(<[usize]>::to_vec)
                .collect::<Vec<_>>()
        })
        .collect()
}

/// What every script call of one batch shares.
struct Call<'a> {
    proxy: &'a str,
    debtor: &'a str,
    interval_ms: u64,
    grant_ttl_ms: u64,
    window_ms: u64,
    now_override_us: u64,
}

impl Call<'_> {
    /// One call of `sync.lua` (token buckets) or `sync_window.lua` (`windowed`).
    async fn run(
        &self,
        state: &AppState,
        windowed: bool,
        reports: Vec<&Report<'_>>,
    ) -> Result<Vec<Lease>, BackendError> {
        let (script, name) = if windowed {
            (&state.scripts.sync_window, "sync_window")
        } else {
            (&state.scripts.sync, "sync")
        };
        let mut invocation = script.prepare_invoke();
        invocation
            .arg(self.now_override_us)
            .arg(self.proxy)
            .arg(self.interval_ms)
            .arg(self.grant_ttl_ms)
            .arg(self.window_ms)
            .arg(reports.len())
            .arg(self.debtor);
        for report in &reports {
            let entry = report.entry;
            invocation
                .arg(entry.limits.len())
                .arg(report.spent)
                .arg(report.denied)
                .arg(entry.epoch())
                .arg(entry.counter());
            if windowed {
                keys::add_windows(&mut invocation, &entry.key, &entry.limits);
            } else {
                keys::add_limits(&mut invocation, &entry.key, &entry.limits);
            }
            keys::add_penalty(&mut invocation, &entry.key, &entry.limits, entry.penalty_ms);
        }
        let reply: Vec<i64> = state.backend.invoke(name, &invocation).await?;
        // Seven numbers per entry, the sixth its token_ms, the seventh its penalty_ms (sync.lua
        // and sync_window.lua alike).
        let width = 7;
        if reply.len() != width * reports.len() {
            return Err(BackendError::Reply(format!(
                "{name}.lua answered {} numbers for {} entries",
                reply.len(),
                reports.len()
            )));
        }
        let replayed = reply
            .chunks_exact(width)
            .filter(|entry| entry[4] == 1)
            .count();
        if replayed > 0 {
            tracing::debug!(
                proxy = self.proxy,
                replayed,
                "entries replaying a report already applied: not counted again"
            );
            state.metrics.replayed_entries.inc_by(replayed as u64);
        }
        Ok(reply
            .chunks_exact(width)
            .map(|entry| Lease {
                tokens: non_negative(entry[0]),
                ttl_ms: non_negative(entry[1]),
                remaining: non_negative(entry[2]),
                reset_ms: non_negative(entry[3]),
                token_ms: Some(non_negative(entry[5])),
                refused: None,
                penalty_ms: non_negative(entry[6]),
            })
            .collect())
    }
}

fn non_negative(value: i64) -> u64 {
    u64::try_from(value).unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_redis_takes_the_batch_in_one_call() {
        let keys: Vec<String> = (0..5).map(|i| format!("k{i}")).collect();
        let keys: Vec<&str> = keys.iter().map(String::as_str).collect();
        assert_eq!(calls(&keys, false), vec![vec![0, 1, 2, 3, 4]]);
        assert!(calls(&[], false).is_empty());
    }

    #[test]
    fn a_cluster_takes_one_call_per_slot_in_first_seen_order() {
        let groups = calls(&["a", "b", "a", "c", "b"], true);
        assert_eq!(groups, vec![vec![0, 2], vec![1, 4], vec![3]]);
    }

    #[test]
    fn big_groups_are_split() {
        let keys = vec!["same"; 2_500];
        let sizes: Vec<_> = calls(&keys, true).iter().map(Vec::len).collect();
        assert_eq!(sizes, [1_000, 1_000, 500]);
    }
}
