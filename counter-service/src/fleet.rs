//! The fleet's load level (`lua/fleet.lua`): a sync that carries a [`LoadReport`] records it in
//! one Redis hash, and is answered the mean utilization of the proxies whose report is fresh,
//! which every proxy sheds by besides its own load (load balancing is never perfectly even).
//!
//! The level is advisory: when Redis fails for it, the sync is answered its grants and no level.
//! Freshness is measured with Redis `TIME`, so every replica of the service agrees on it.

use sluice_protocol::LoadReport;

use crate::backend::BackendError;
use crate::state::AppState;

/// The one Redis key of the fleet's load reports: a hash, one field per proxy id. (The limit keys
/// all start `sluice:{`, so no entry key can name it.)
pub const FLEET_KEY: &str = "sluice:fleet:load";
/// Most reports the hash holds: past it, a proxy not yet in it is not recorded (see
/// `lua/fleet.lua` for why a newcomer is refused rather than the oldest evicted).
pub const MAX_FLEET_PROXIES: u64 = 10_000;
/// A report stays fresh for this many of its proxy's sync intervals...
pub const FRESH_INTERVALS: u64 = 3;
/// ...and at least this long, in milliseconds.
pub const MIN_FRESH_MS: u64 = 1_000;

/// What `lua/fleet.lua` answered for one report.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Fleet {
    /// The mean utilization of the fresh reports, in [0, 1] (0 if none is fresh).
    pub level: f64,
    /// How many proxies' reports are fresh, this one's included when recorded.
    pub proxies: u64,
    /// Whether this report was recorded (not when the hash was full of fresh reports).
    pub recorded: bool,
}

/// The fleet level to answer a sync that carried `load`: records the report of `proxy` (the id
/// as the service keeps it, namespaced by its credential) and answers the level, or `None` if
/// no report is fresh or Redis failed (logged and counted: the level is advisory, the sync
/// goes on). `interval_ms` is the longest the proxy waits before its next sync: the hint it is
/// answered, which is never below its clamped interval.
pub async fn level(
    state: &AppState,
    proxy: &str,
    load: &LoadReport,
    interval_ms: u64,
) -> Option<f64> {
    let metrics = &state.metrics;
    match report(state, proxy, load, interval_ms, 0).await {
        Ok(fleet) => {
            if fleet.recorded {
                metrics.load_reported("recorded");
            } else {
                metrics.load_reported("full");
                tracing::debug!(
                    proxy,
                    "load report not recorded: {MAX_FLEET_PROXIES} fresh reports already"
                );
            }
            metrics.fleet_load_level.set(fleet.level);
            metrics.fleet_proxies.set(fleet.proxies as i64);
            (fleet.proxies > 0).then_some(fleet.level)
        }
        Err(error) => {
            metrics.load_reported("error");
            tracing::warn!(proxy, "fleet load level not answered: {error}");
            None
        }
    }
}

/// Records a (validated) report and reads the fleet: one `lua/fleet.lua` call.
/// `now_override_us` is 0 in service (Redis `TIME` is the clock); tests pass a fake time.
pub async fn report(
    state: &AppState,
    proxy: &str,
    load: &LoadReport,
    interval_ms: u64,
    now_override_us: u64,
) -> Result<Fleet, BackendError> {
    let mut invocation = state.scripts.fleet.prepare_invoke();
    invocation
        .key(FLEET_KEY)
        .arg(now_override_us)
        .arg(proxy)
        .arg(load.utilization)
        .arg(load.shed_rate)
        .arg(load.latency_ms)
        .arg(interval_ms)
        .arg(FRESH_INTERVALS)
        .arg(MIN_FRESH_MS)
        .arg(MAX_FLEET_PROXIES);
    state.metrics.script_called("fleet", 1);
    let (level, proxies, recorded): (String, i64, i64) =
        state.backend.invoke("fleet", &invocation).await?;
    let level = level
        .parse::<f64>()
        .ok()
        .filter(|level| level.is_finite())
        .ok_or_else(|| BackendError::Reply(format!("fleet.lua answered the level {level:?}")))?;
    Ok(Fleet {
        level: level.clamp(0.0, 1.0),
        proxies: u64::try_from(proxies).unwrap_or(0),
        recorded: recorded == 1,
    })
}
