//! `POST /v1/sync`: a proxy's batch. Every entry's spend is debited from the global buckets and
//! the entry is answered with a lease (`lua/sync.lua`), one script call per Redis Cluster hash
//! slot, the calls of one batch in parallel.

use std::collections::HashMap;

use axum::extract::State;
use axum::Json;
use futures_util::future::try_join_all;
use sluice_core::protocol::{Grant, Hints, Overrides, SyncEntry, SyncRequest, SyncResponse};

use crate::backend::BackendError;
use crate::backpressure;
use crate::body::JsonBody;
use crate::error::AppError;
use crate::keys;
use crate::state::AppState;
use crate::validate;

/// Most entries in one script call, so that no call holds Redis for long.
pub const MAX_ENTRIES_PER_CALL: usize = 1_000;

pub async fn handle(
    State(state): State<AppState>,
    JsonBody(request): JsonBody<SyncRequest>,
) -> Result<Json<SyncResponse>, AppError> {
    let _in_flight = state.enter();
    validate::sync_request(&request, &state.settings)?;
    let grants = apply(&state, &request, 0).await?;

    let metrics = &state.metrics;
    metrics.syncs.inc();
    metrics.entries_synced.inc_by(request.entries.len() as u64);
    metrics
        .reported_denials
        .inc_by(request.entries.iter().map(|e| e.denied).sum());
    metrics.grants.inc_by(grants.len() as u64);
    metrics
        .empty_grants
        .inc_by(grants.iter().filter(|g| g.tokens == 0).count() as u64);
    metrics
        .granted_tokens
        .inc_by(grants.iter().map(|g| g.tokens).sum());

    let settings = &state.settings;
    let next_sync_ms = backpressure::next_sync_ms(
        request.interval_ms,
        metrics.redis_latency.value(),
        settings.redis_timeout_ms,
        state.in_flight(),
        settings.max_concurrency,
    );
    metrics.next_sync_ms.set(next_sync_ms as i64);
    Ok(Json(SyncResponse {
        grants,
        hints: Hints {
            next_sync_ms,
            overrides: Overrides::default(),
        },
    }))
}

/// Applies a (validated) batch and answers one grant per entry, in request order.
/// `now_override_us` is 0 in service (Redis `TIME` is the clock); tests pass a fake time.
pub async fn apply(
    state: &AppState,
    request: &SyncRequest,
    now_override_us: u64,
) -> Result<Vec<Grant>, BackendError> {
    let grant_ttl_ms = request
        .interval_ms
        .saturating_mul(state.settings.grant_ttl_intervals);
    let calls = calls(&request.entries, state.backend.is_cluster());
    state.metrics.script_called("sync", calls.len() as u64);
    let replies = try_join_all(
        calls
            .iter()
            .map(|entries| call(state, request, entries, grant_ttl_ms, now_override_us)),
    )
    .await?;
    let empty = Grant {
        tokens: 0,
        ttl_ms: 0,
        remaining: 0,
        reset_ms: 0,
        refused: None,
    };
    let mut grants = vec![empty; request.entries.len()];
    for (entries, reply) in calls.iter().zip(replies) {
        for (&i, grant) in entries.iter().zip(reply) {
            grants[i] = grant;
        }
    }
    Ok(grants)
}

/// The script calls of a batch, as lists of entry indexes: on a cluster, one per hash slot (every
/// key of a call in one slot); on one Redis, the batch in order. Each split in runs of at most
/// [`MAX_ENTRIES_PER_CALL`].
pub fn calls(entries: &[SyncEntry], cluster: bool) -> Vec<Vec<usize>> {
    let mut groups: Vec<Vec<usize>> = Vec::new();
    if cluster {
        let mut by_slot = HashMap::new();
        for (i, entry) in entries.iter().enumerate() {
            let group = *by_slot.entry(keys::slot(&entry.key)).or_insert_with(|| {
                groups.push(Vec::new());
                groups.len() - 1
            });
            groups[group].push(i);
        }
    } else if !entries.is_empty() {
        groups.push((0..entries.len()).collect());
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

async fn call(
    state: &AppState,
    request: &SyncRequest,
    entries: &[usize],
    grant_ttl_ms: u64,
    now_override_us: u64,
) -> Result<Vec<Grant>, BackendError> {
    let mut invocation = state.scripts.sync.prepare_invoke();
    invocation
        .arg(now_override_us)
        .arg(&request.proxy)
        .arg(request.interval_ms)
        .arg(grant_ttl_ms)
        .arg(entries.len());
    for entry in entries.iter().filter_map(|&i| request.entries.get(i)) {
        invocation
            .arg(entry.limits.len())
            .arg(entry.spent)
            .arg(entry.denied);
        for limit in &entry.limits {
            invocation
                .key(keys::limit_key(&entry.key, limit))
                .arg(limit.requests)
                .arg(limit.period_ms)
                .arg(limit.burst);
        }
    }
    let reply: Vec<i64> = state.backend.invoke("sync", &invocation).await?;
    if reply.len() != 4 * entries.len() {
        return Err(BackendError::Reply(format!(
            "sync.lua answered {} numbers for {} entries",
            reply.len(),
            entries.len()
        )));
    }
    Ok(reply
        .chunks_exact(4)
        .map(|four| Grant {
            tokens: non_negative(four[0]),
            ttl_ms: non_negative(four[1]),
            remaining: non_negative(four[2]),
            reset_ms: non_negative(four[3]),
            refused: None,
        })
        .collect())
}

fn non_negative(value: i64) -> u64 {
    u64::try_from(value).unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(key: &str) -> SyncEntry {
        SyncEntry {
            key: key.into(),
            limits: vec![],
            spent: 0,
            denied: 0,
        }
    }

    #[test]
    fn one_redis_takes_the_batch_in_one_call() {
        let entries: Vec<_> = (0..5).map(|i| entry(&format!("k{i}"))).collect();
        assert_eq!(calls(&entries, false), vec![vec![0, 1, 2, 3, 4]]);
        assert!(calls(&[], false).is_empty());
    }

    #[test]
    fn a_cluster_takes_one_call_per_slot_in_first_seen_order() {
        let entries = vec![entry("a"), entry("b"), entry("a"), entry("c"), entry("b")];
        let groups = calls(&entries, true);
        assert_eq!(groups, vec![vec![0, 2], vec![1, 4], vec![3]]);
    }

    #[test]
    fn big_groups_are_split() {
        let entries: Vec<_> = (0..2_500).map(|_| entry("same")).collect();
        let sizes: Vec<_> = calls(&entries, true).iter().map(Vec::len).collect();
        assert_eq!(sizes, [1_000, 1_000, 500]);
    }
}
