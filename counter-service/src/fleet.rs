//! The fleet's load level (`lua/fleet.lua`): a sync that carries a [`LoadReport`] records it under
//! its credential, and is answered the mean over the credentials of each one's mean utilization
//! over its proxies whose report is fresh, which every proxy sheds by besides its own load (load
//! balancing is never perfectly even).
//!
//! What one caller can do to the level is bounded here: a report's utilization and shed rate are
//! clamped to [0, 1]; the service, not the proxy, decides how long a report stays fresh (at most
//! `--fleet-report-max-age-ms`); every credential weighs 1 however many proxy ids it reports
//! under, and holds at most `--fleet-max-proxies-per-credential` of them, so what one credential
//! writes costs the others nothing. (Each proxy also believes the level only up to its own
//! utilization plus its `fleet_margin`.)
//!
//! The fleet's size (`lua/fleet_share.lua`): a sync that sets `fleet_share` (its proxy divides
//! a fallback among the fleet) counts its proxy for the same window a load report stays fresh,
//! and is answered how many proxies count, what such a fallback divides its limits by. The same
//! bounds hold: the service decides the window, and a credential counts at most
//! `--fleet-max-proxies-per-credential` proxy ids, so it can add at most that many to the count
//! and take nothing from it.
//!
//! The level is advisory: when Redis fails for it, the sync is answered its grants and no level.
//! Freshness is measured with Redis `TIME`, so every replica of the service agrees on it.

use sluice_protocol::LoadReport;

use crate::backend::BackendError;
use crate::state::AppState;

/// The hash of the credentials' aggregates and the fleet's totals (see `lua/fleet.lua`). Every
/// fleet key carries the `{fleet}` hash tag, so one call's keys share a Redis Cluster hash slot;
/// they start `sluice:fleet:`, so no entry key (`sluice:{…`) can name them.
pub const FLEET_CREDENTIALS_KEY: &str = "sluice:fleet:{fleet}:credentials";
/// The credential under which the reports of a shared token (or of no token) are kept: not a
/// valid credential name, so no `--tokens-file` name can be it.
pub const SHARED_CREDENTIAL: &str = "*";
/// A report stays fresh for this many of the intervals the service answered its proxy...
pub const FRESH_INTERVALS: u64 = 3;
/// ...and at least this long, in milliseconds (and never longer than
/// `--fleet-report-max-age-ms`).
pub const MIN_FRESH_MS: u64 = 1_000;
/// How old (ms) a credential's aggregate or the fleet's totals may grow before they are rebuilt
/// from what they sum (in between they are kept up to date at each report).
pub const REFRESH_MS: u64 = 100;

/// The sorted set of the proxies that divide their fallbacks among the fleet (see
/// `lua/fleet_share.lua`), each scored by when it stops counting.
pub const FLEET_SHARE_KEY: &str = "sluice:fleet:{fleet}:share";

/// The same set for the proxy ids of one credential only (its cap).
pub fn share_key(credential: &str) -> String {
    format!("{FLEET_SHARE_KEY}:{credential}")
}

/// The hash of one credential's load reports: one field per proxy id.
pub fn proxies_key(credential: &str) -> String {
    format!("sluice:fleet:{{fleet}}:proxies:{credential}")
}

/// How long a report stays fresh, in milliseconds: three of the intervals the service answered
/// (`interval_ms`), at least [`MIN_FRESH_MS`], at most `max_age_ms`. Whatever interval a proxy
/// names, its report counts no longer than `max_age_ms`.
pub fn fresh_window_ms(interval_ms: u64, max_age_ms: u64) -> u64 {
    interval_ms
        .saturating_mul(FRESH_INTERVALS)
        .max(MIN_FRESH_MS)
        .min(max_age_ms)
        .max(1)
}

/// A fraction as the fleet counts it: in [0, 1] (0 for what is not a number).
pub fn unit(value: f64) -> f64 {
    if value.is_nan() {
        0.0
    } else {
        value.clamp(0.0, 1.0)
    }
}

/// What `lua/fleet.lua` answered for one report.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Fleet {
    /// The mean over the credentials of their mean utilization, in [0, 1] (0 if none is fresh).
    pub level: f64,
    /// How many proxies' reports are counted, this one's included when recorded.
    pub proxies: u64,
    /// How many credentials the level is the mean of.
    pub credentials: u64,
    /// Whether this report was recorded (not when its credential already had
    /// `--fleet-max-proxies-per-credential` fresh reports under other ids).
    pub recorded: bool,
}

/// The fleet level to answer a sync that carried `load`: records the report of `proxy` (the id
/// as the service keeps it, namespaced by its credential) under `credential` (its name with
/// `--tokens-file`, `None` with a shared token) and answers the level, or `None` if no report is
/// fresh or Redis failed (logged and counted: the level is advisory, the sync goes on).
/// `interval_ms` is the longest the proxy waits before its next sync: the hint it is answered,
/// which is never below its clamped interval.
pub async fn level(
    state: &AppState,
    credential: Option<&str>,
    proxy: &str,
    load: &LoadReport,
    interval_ms: u64,
) -> Option<f64> {
    let metrics = &state.metrics;
    let credential = credential.unwrap_or(SHARED_CREDENTIAL);
    match report(state, credential, proxy, load, interval_ms, 0).await {
        Ok(fleet) => {
            if fleet.recorded {
                metrics.load_reported("recorded");
            } else {
                metrics.load_reported("full");
                tracing::debug!(
                    proxy,
                    credential,
                    "load report not recorded: its credential has {} fresh reports already",
                    state.settings.fleet_max_proxies_per_credential
                );
            }
            metrics.fleet_load_level.set(fleet.level);
            metrics.fleet_proxies.set(fleet.proxies as i64);
            metrics.fleet_credentials.set(fleet.credentials as i64);
            if fleet.credentials > 0 {
                let now = std::time::Instant::now();
                state.status.fleet_answered(fleet.level, fleet.proxies, now);
            }
            (fleet.credentials > 0).then_some(fleet.level)
        }
        Err(error) => {
            metrics.load_reported("error");
            tracing::warn!(proxy, "fleet load level not answered: {error}");
            None
        }
    }
}

/// What `lua/fleet_share.lua` answered for one sync.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Share {
    /// How many proxy ids count now, this one's included when recorded.
    pub proxies: u64,
    /// Whether this proxy counts (not when its credential already counts
    /// `--fleet-max-proxies-per-credential` other ids).
    pub recorded: bool,
}

/// The count to answer a sync that set `fleet_share`: counts `proxy` (the id as the service
/// keeps it) under `credential` (`None` with a shared token) and answers how many proxies count,
/// or `None` when Redis failed (logged and counted: the proxy keeps its last count). It counts
/// for [`fresh_window_ms`] of `interval_ms`, the interval the proxy was advised.
pub async fn share_count(
    state: &AppState,
    credential: Option<&str>,
    proxy: &str,
    interval_ms: u64,
) -> Option<u64> {
    let metrics = &state.metrics;
    let credential = credential.unwrap_or(SHARED_CREDENTIAL);
    match share(state, credential, proxy, interval_ms, 0).await {
        Ok(share) => {
            if share.recorded {
                metrics.fleet_share_counted("recorded");
            } else {
                metrics.fleet_share_counted("full");
                tracing::debug!(
                    proxy,
                    credential,
                    "fleet share not counted: its credential counts {} proxies already",
                    state.settings.fleet_max_proxies_per_credential
                );
            }
            metrics.fleet_share_proxies.set(share.proxies as i64);
            Some(share.proxies)
        }
        Err(error) => {
            metrics.fleet_share_counted("error");
            tracing::warn!(proxy, "fleet share count not answered: {error}");
            None
        }
    }
}

/// Counts `proxy` under `credential` ([`SHARED_CREDENTIAL`] for a shared token) among the
/// proxies that divide their fallbacks, and reads how many count: one `lua/fleet_share.lua`
/// call. The proxy counts for [`fresh_window_ms`] of `interval_ms`. `now_override_us` is 0 in
/// service (Redis `TIME` is the clock); tests pass a fake time.
pub async fn share(
    state: &AppState,
    credential: &str,
    proxy: &str,
    interval_ms: u64,
    now_override_us: u64,
) -> Result<Share, BackendError> {
    let settings = &state.settings;
    let window_ms = fresh_window_ms(interval_ms, settings.fleet_report_max_age_ms);
    let mut invocation = state.scripts.fleet_share.prepare_invoke();
    invocation
        .key(FLEET_SHARE_KEY)
        .key(share_key(credential))
        .arg(now_override_us)
        .arg(proxy)
        .arg(window_ms)
        .arg(settings.fleet_max_proxies_per_credential)
        .arg(settings.fleet_report_max_age_ms);
    state.metrics.script_called("fleet_share", 1);
    let (proxies, recorded): (i64, i64) = state.backend.invoke("fleet_share", &invocation).await?;
    Ok(Share {
        proxies: u64::try_from(proxies).unwrap_or(0),
        recorded: recorded == 1,
    })
}

/// Records a (validated) report of `proxy` under `credential` ([`SHARED_CREDENTIAL`] for a
/// shared token) and reads the fleet: one `lua/fleet.lua` call. The report's utilization and
/// shed rate are clamped to [0, 1] first; it stays fresh for [`fresh_window_ms`] of
/// `interval_ms`. `now_override_us` is 0 in service (Redis `TIME` is the clock); tests pass a
/// fake time.
pub async fn report(
    state: &AppState,
    credential: &str,
    proxy: &str,
    load: &LoadReport,
    interval_ms: u64,
    now_override_us: u64,
) -> Result<Fleet, BackendError> {
    let settings = &state.settings;
    let window_ms = fresh_window_ms(interval_ms, settings.fleet_report_max_age_ms);
    let mut invocation = state.scripts.fleet.prepare_invoke();
    invocation
        .key(FLEET_CREDENTIALS_KEY)
        .key(proxies_key(credential))
        .arg(now_override_us)
        .arg(credential)
        .arg(proxy)
        .arg(unit(load.utilization))
        .arg(unit(load.shed_rate))
        .arg(load.latency_ms)
        .arg(window_ms)
        .arg(settings.fleet_max_proxies_per_credential)
        .arg(REFRESH_MS);
    state.metrics.script_called("fleet", 1);
    let (level, proxies, recorded, credentials): (String, i64, i64, i64) =
        state.backend.invoke("fleet", &invocation).await?;
    let level = level
        .parse::<f64>()
        .ok()
        .filter(|level| level.is_finite())
        .ok_or_else(|| BackendError::Reply(format!("fleet.lua answered the level {level:?}")))?;
    Ok(Fleet {
        level: unit(level),
        proxies: u64::try_from(proxies).unwrap_or(0),
        credentials: u64::try_from(credentials).unwrap_or(0),
        recorded: recorded == 1,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_service_decides_how_long_a_report_is_fresh() {
        // three intervals, at least a second
        assert_eq!(fresh_window_ms(100, 5_000), 1_000);
        assert_eq!(fresh_window_ms(1_000, 5_000), 3_000);
        // never longer than the cap, whatever interval was named
        assert_eq!(fresh_window_ms(60_000, 5_000), 5_000);
        assert_eq!(fresh_window_ms(u64::MAX, 5_000), 5_000);
        assert_eq!(fresh_window_ms(100, 500), 500);
        assert_eq!(fresh_window_ms(0, 0), 1);
    }

    #[test]
    fn a_fraction_is_clamped_to_0_1() {
        assert_eq!(unit(10.0), 1.0);
        assert_eq!(unit(-0.5), 0.0);
        assert_eq!(unit(f64::NAN), 0.0);
        assert_eq!(unit(f64::INFINITY), 1.0);
        assert_eq!(unit(0.25), 0.25);
    }
}
