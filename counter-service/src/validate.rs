//! Bounds on what a request may ask, checked before Redis sees it. Each error names its field
//! (`entries[3].key`, `entries[0].limits[1].burst`).
//!
//! A sync batch is refused whole only for what concerns the batch (the proxy id, the number of
//! entries, the load report); an entry out of bounds is refused alone ([`sync_entry`]). The
//! counts of an entry are cut to what its limits make possible ([`report_cap`]).

use sluice_protocol::{
    AlgorithmSpec, CheckRequest, LimitSpec, LoadReport, SyncEntry, SyncRequest, MAX_PENALTY_MS,
    MIN_PENALTY_MS,
};
use sluice_protocol::{MAX_LOG, MAX_TOKENS};

use crate::error::AppError;
use crate::settings::Settings;

/// Most limits one entry may have.
pub use sluice_protocol::MAX_LIMITS;
/// Longest period a limit may count over: 366 days.
pub const MAX_PERIOD_MS: u64 = 366 * 86_400_000;
/// Largest count one sync may report (exact in the scripts' doubles); a larger one refuses the
/// entry. Counts below it are still cut to [`report_cap`].
pub const MAX_COUNT: u64 = 1 << 53;
/// How long a proxy may have been cut off from the service (its fallback deciding) and still
/// have its report counted in full, beyond the lifetime of its lease: one minute.
pub const OUTAGE_ALLOWANCE_MS: u64 = 60_000;
/// Largest utilization a load report may give: a proxy's in-flight requests may exceed its
/// limit briefly, ten times is a report that cannot be right.
pub const MAX_UTILIZATION: f64 = 10.0;
/// Largest upstream latency a load report may give: an hour, in milliseconds.
pub const MAX_LATENCY_MS: f64 = 3_600_000.0;

/// The checks that refuse a whole batch: the proxy id, the number of entries and the load
/// report. (The interval is not refused: the service clamps it, see
/// [`Settings::sync_interval_ms`].)
pub fn sync_batch(request: &SyncRequest, settings: &Settings) -> Result<(), AppError> {
    name("proxy", &request.proxy, settings.max_key_bytes)?;
    if request.entries.len() > settings.max_batch {
        return Err(AppError::invalid(
            "entries",
            format!("more than {} entries in one batch", settings.max_batch),
        ));
    }
    if let Some(load) = &request.load {
        load_report(load)?;
    }
    if request.top.len() > sluice_protocol::MAX_TOP_RULES {
        return Err(AppError::invalid(
            "top",
            format!(
                "more than {} rules in one batch",
                sluice_protocol::MAX_TOP_RULES
            ),
        ));
    }
    Ok(())
}

/// A load report's values: finite, `utilization` in [0, [`MAX_UTILIZATION`]], `shed_rate` in
/// [0, 1], `latency_ms` in [0, [`MAX_LATENCY_MS`]]. The error names the field (`load.shed_rate`).
pub fn load_report(load: &LoadReport) -> Result<(), AppError> {
    let bounds = [
        ("utilization", load.utilization, MAX_UTILIZATION),
        ("shed_rate", load.shed_rate, 1.0),
        ("latency_ms", load.latency_ms, MAX_LATENCY_MS),
    ];
    for (field, value, max) in bounds {
        // a NaN fails the range test too
        if !(value.is_finite() && (0.0..=max).contains(&value)) {
            return Err(AppError::invalid(
                format!("load.{field}"),
                format!("must be a number between 0 and {max}"),
            ));
        }
    }
    Ok(())
}

/// The checks of entry `index`: a failure refuses this entry alone.
pub fn sync_entry(index: usize, entry: &SyncEntry, settings: &Settings) -> Result<(), AppError> {
    let at = format!("entries[{index}]");
    name(&format!("{at}.key"), &entry.key, settings.max_key_bytes)?;
    limits(&format!("{at}.limits"), &entry.limits)?;
    if let Some(j) = entry
        .limits
        .iter()
        .position(|l| l.algorithm == AlgorithmSpec::SlidingLog)
    {
        return Err(AppError::invalid(
            format!("{at}.limits[{j}].algorithm"),
            "sliding_log is decided request by request (/v1/check), never leased",
        ));
    }
    for (field, value) in [("spent", entry.spent), ("denied", entry.denied)] {
        if value > MAX_COUNT {
            return Err(AppError::invalid(
                format!("{at}.{field}"),
                format!("must be at most {MAX_COUNT}"),
            ));
        }
    }
    penalty(&format!("{at}.penalty_ms"), entry.penalty_ms)
}

/// A rule's penalty: 0 (none), or [`MIN_PENALTY_MS`] to [`MAX_PENALTY_MS`], as a configuration
/// takes it. Refused, not clamped: a proxy sending another is not a sluice proxy's rule.
fn penalty(field: &str, penalty_ms: u64) -> Result<(), AppError> {
    if penalty_ms != 0 && !(MIN_PENALTY_MS..=MAX_PENALTY_MS).contains(&penalty_ms) {
        return Err(AppError::invalid(
            field,
            format!("must be 0 (none) or between {MIN_PENALTY_MS} and {MAX_PENALTY_MS}"),
        ));
    }
    Ok(())
}

/// How long one report may legitimately cover for a sync at `interval_ms` (clamped): the
/// lifetime of the proxy's lease plus [`OUTAGE_ALLOWANCE_MS`].
pub fn report_window_ms(settings: &Settings, interval_ms: u64) -> u64 {
    settings
        .grant_ttl_ms(interval_ms)
        .saturating_add(OUTAGE_ALLOWANCE_MS)
}

/// The most tokens one report can have spent (or been denied, as demand) on an entry over
/// `window_ms`: for each limit `burst + ceil(requests × window_ms / period_ms)`, the smallest.
/// This is also how deep `lua/sync.lua` lets a limit's debt go.
pub fn report_cap(limits: &[LimitSpec], window_ms: u64) -> u64 {
    limits
        .iter()
        .map(|limit| {
            let refill = (u128::from(limit.requests) * u128::from(window_ms))
                .div_ceil(u128::from(limit.period_ms.max(1)));
            u128::from(limit.burst).saturating_add(refill)
        })
        .min()
        .map_or(0, |cap| {
            u64::try_from(cap).unwrap_or(u64::MAX).min(MAX_COUNT)
        })
}

pub fn check_request(request: &CheckRequest, settings: &Settings) -> Result<(), AppError> {
    name("key", &request.key, settings.max_key_bytes)?;
    if let Some(proxy) = &request.proxy {
        name("proxy", proxy, settings.max_key_bytes)?;
    }
    limits("limits", &request.limits)?;
    if request.cost == 0 || request.cost > MAX_TOKENS {
        return Err(AppError::invalid(
            "cost",
            format!("must be between 1 and {MAX_TOKENS}"),
        ));
    }
    // As the configuration refuses a rule whose cost is more than a limit ever admits at once
    // (`check_rule`): no sluice proxy sends one, and its certain denial would start the penalty
    // of a key it names.
    let least = request
        .limits
        .iter()
        .enumerate()
        .min_by_key(|(_, l)| l.burst);
    if let Some((j, least)) = least {
        if request.cost > least.burst {
            return Err(AppError::invalid(
                "cost",
                format!(
                    "{} is more than limits[{j}] ever admits at once ({}): no request could pass",
                    request.cost, least.burst
                ),
            ));
        }
    }
    penalty("penalty_ms", request.penalty_ms)
}

fn name(field: &str, value: &str, max_bytes: usize) -> Result<(), AppError> {
    if value.is_empty() {
        return Err(AppError::invalid(field, "must not be empty"));
    }
    if value.len() > max_bytes {
        return Err(AppError::invalid(
            field,
            format!("longer than {max_bytes} bytes"),
        ));
    }
    Ok(())
}

fn limits(field: &str, limits: &[LimitSpec]) -> Result<(), AppError> {
    if limits.is_empty() {
        return Err(AppError::invalid(field, "must have at least one limit"));
    }
    if limits.len() > MAX_LIMITS {
        return Err(AppError::invalid(
            field,
            format!("more than {MAX_LIMITS} limits"),
        ));
    }
    for (j, limit) in limits.iter().enumerate() {
        let bounds = [
            ("requests", limit.requests, MAX_TOKENS),
            ("period_ms", limit.period_ms, MAX_PERIOD_MS),
            ("burst", limit.burst, MAX_TOKENS),
        ];
        for (name, value, max) in bounds {
            if value == 0 || value > max {
                return Err(AppError::invalid(
                    format!("{field}[{j}].{name}"),
                    format!("must be between 1 and {max}"),
                ));
            }
        }
        window(&format!("{field}[{j}]"), limit)?;
        if limit.algorithm != limits[0].algorithm {
            return Err(AppError::invalid(
                format!("{field}[{j}].algorithm"),
                format!(
                    "the limits of one key share one algorithm ({} here)",
                    limits[0].algorithm.name()
                ),
            ));
        }
    }
    Ok(())
}

/// The bounds of a window, as `sluice_core::Limit::windowed` holds them: no burst of its own
/// (`burst` equals `requests`), fewer requests than half the window's microseconds, and a
/// calendar only for a fixed window, with its nominal length in `period_ms`.
fn window(at: &str, limit: &LimitSpec) -> Result<(), AppError> {
    if let Some(calendar) = limit.calendar {
        if limit.algorithm != AlgorithmSpec::FixedWindow {
            return Err(AppError::invalid(
                format!("{at}.calendar"),
                format!(
                    "week and month are calendar windows of fixed_window, not of {}",
                    limit.algorithm.name()
                ),
            ));
        }
        if limit.period_ms != calendar.period_ms() {
            return Err(AppError::invalid(
                format!("{at}.period_ms"),
                format!(
                    "a {} window travels with its nominal length, {} ms",
                    calendar.name(),
                    calendar.period_ms()
                ),
            ));
        }
    }
    if !limit.algorithm.windowed() {
        return Ok(());
    }
    if limit.burst != limit.requests {
        return Err(AppError::invalid(
            format!("{at}.burst"),
            format!(
                "{} has no burst: it must equal requests",
                limit.algorithm.name()
            ),
        ));
    }
    if limit.algorithm == AlgorithmSpec::SlidingLog && limit.requests > MAX_LOG {
        return Err(AppError::invalid(
            format!("{at}.requests"),
            format!("a sliding_log keeps one member per request: at most {MAX_LOG}"),
        ));
    }
    // core's bound: a count and its ghost need fewer requests than microseconds.
    if u128::from(limit.requests) * 2 >= u128::from(limit.period_ms) * 1_000 {
        return Err(AppError::invalid(
            format!("{at}.requests"),
            "too many for one window: fewer than half its microseconds",
        ));
    }
    Ok(())
}

/// Longest rule or tier name, as in the filter's configuration.
pub const MAX_NAME_BYTES: usize = 64;

/// A rule's name (`rule`), or a tier's (`rule/tier`): each 1 to [`MAX_NAME_BYTES`] characters
/// of a-z, A-Z, 0-9, `-`, `_`, `.`, as the filter's configuration names them.
pub fn target_name(field: &str, value: &str) -> Result<(), AppError> {
    let name_ok = |name: &str| {
        !name.is_empty()
            && name.len() <= MAX_NAME_BYTES
            && name
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b"-_.".contains(&b))
    };
    let valid = match value.split_once('/') {
        Some((rule, tier)) => name_ok(rule) && name_ok(tier),
        None => name_ok(value),
    };
    if valid {
        Ok(())
    } else {
        Err(AppError::invalid(
            field,
            format!(
                "must be a rule's name, or rule/tier: each 1 to {MAX_NAME_BYTES} characters of \
                 a-z, A-Z, 0-9, '-', '_', '.', got {value:?}"
            ),
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    fn settings() -> Settings {
        Settings::parse_from(["sluice-counter-service", "--token", "t"])
    }

    fn entry(key: &str, limits: Vec<LimitSpec>) -> SyncEntry {
        SyncEntry {
            key: key.into(),
            limits,
            spent: 0,
            denied: 0,
            round: 0,
            penalty_ms: 0,
        }
    }

    fn message(request: &SyncRequest) -> String {
        let settings = settings();
        let batch = sync_batch(request, &settings).err();
        let entry = request
            .entries
            .iter()
            .enumerate()
            .find_map(|(i, entry)| sync_entry(i, entry, &settings).err());
        batch.or(entry).map(|e| e.to_string()).unwrap_or_default()
    }

    const TEN: LimitSpec = LimitSpec::token_bucket(10, 1000, 10);

    #[test]
    fn each_error_names_its_field() {
        let mut request = SyncRequest {
            proxy: "p".into(),
            interval_ms: 100,
            entries: vec![entry("a", vec![TEN]), entry(&"k".repeat(513), vec![TEN])],
            load: None,
            overrides_version: 0,
            overrides_delta: false,
            fleet_share: false,
            top: Vec::new(),
        };
        assert_eq!(message(&request), "entries[1].key: longer than 512 bytes");
        request.entries[1] = entry("b", vec![]);
        assert_eq!(
            message(&request),
            "entries[1].limits: must have at least one limit"
        );
        request.entries[1] = entry("b", vec![TEN; 9]);
        assert_eq!(message(&request), "entries[1].limits: more than 8 limits");
        let zero_burst = LimitSpec { burst: 0, ..TEN };
        request.entries[1] = entry("b", vec![TEN, zero_burst]);
        assert_eq!(
            message(&request),
            "entries[1].limits[1].burst: must be between 1 and 2147483648"
        );
        request.entries[1] = entry(
            "b",
            vec![LimitSpec {
                period_ms: 0,
                ..TEN
            }],
        );
        assert_eq!(
            message(&request),
            "entries[1].limits[0].period_ms: must be between 1 and 31622400000"
        );
        request.entries[1] = entry("b", vec![TEN]);
        request.entries[1].denied = MAX_COUNT + 1;
        assert_eq!(
            message(&request),
            "entries[1].denied: must be at most 9007199254740992"
        );
        request.entries[1] = entry("b", vec![TEN]);
        assert_eq!(message(&request), "");
        request.proxy = String::new();
        assert_eq!(message(&request), "proxy: must not be empty");
    }

    #[test]
    fn a_load_report_out_of_bounds_refuses_the_batch_naming_the_field() {
        let fine = LoadReport {
            utilization: 0.5,
            shed_rate: 0.1,
            latency_ms: 20.0,
        };
        let mut request = SyncRequest {
            proxy: "p".into(),
            interval_ms: 100,
            entries: vec![entry("a", vec![TEN])],
            load: Some(fine),
            overrides_version: 0,
            overrides_delta: false,
            fleet_share: false,
            top: Vec::new(),
        };
        assert_eq!(message(&request), "");
        // the bounds themselves are fine: a brief overload, nothing shed or all, an hour
        for edge in [
            LoadReport {
                utilization: 0.0,
                shed_rate: 0.0,
                latency_ms: 0.0,
            },
            LoadReport {
                utilization: 10.0,
                shed_rate: 1.0,
                latency_ms: 3_600_000.0,
            },
        ] {
            request.load = Some(edge);
            assert_eq!(message(&request), "", "{edge:?}");
        }
        let cases = [
            (
                LoadReport {
                    utilization: 10.5,
                    ..fine
                },
                "load.utilization: must be a number between 0 and 10",
            ),
            (
                LoadReport {
                    utilization: -0.1,
                    ..fine
                },
                "load.utilization: must be a number between 0 and 10",
            ),
            (
                LoadReport {
                    utilization: f64::NAN,
                    ..fine
                },
                "load.utilization: must be a number between 0 and 10",
            ),
            (
                LoadReport {
                    shed_rate: 1.01,
                    ..fine
                },
                "load.shed_rate: must be a number between 0 and 1",
            ),
            (
                LoadReport {
                    shed_rate: f64::NEG_INFINITY,
                    ..fine
                },
                "load.shed_rate: must be a number between 0 and 1",
            ),
            (
                LoadReport {
                    latency_ms: 3_600_000.5,
                    ..fine
                },
                "load.latency_ms: must be a number between 0 and 3600000",
            ),
            (
                LoadReport {
                    latency_ms: f64::INFINITY,
                    ..fine
                },
                "load.latency_ms: must be a number between 0 and 3600000",
            ),
        ];
        for (load, expected) in cases {
            request.load = Some(load);
            assert_eq!(message(&request), expected, "{load:?}");
            let error = sync_batch(&request, &settings()).unwrap_err();
            assert_eq!(error.kind(), "invalid_request");
        }
        // a sync without a report is not checked for one
        request.load = None;
        assert_eq!(message(&request), "");
    }

    #[test]
    fn a_report_is_capped_by_its_tightest_limit() {
        // 10/s with a burst of 10, over 60.3 s: 10 + 603
        assert_eq!(report_cap(&[TEN], 60_300), 613);
        let per_minute = LimitSpec::token_bucket(3, 60_000, 3);
        // 3/min: 3 + ceil(3 × 60300 / 60000) = 3 + 4
        assert_eq!(report_cap(&[TEN, per_minute], 60_300), 7);
        let huge = LimitSpec::token_bucket(MAX_TOKENS, 1, MAX_TOKENS);
        assert_eq!(report_cap(&[huge], u64::MAX), MAX_COUNT);
        assert_eq!(report_cap(&[], 1_000), 0);
        // the default settings: 100 ms syncs, leases of 3 intervals, plus a minute
        assert_eq!(report_window_ms(&settings(), 100), 60_300);
    }

    #[test]
    fn windows_are_bounded_as_in_core_and_leased_too() {
        use sluice_protocol::Calendar;
        let settings = settings();
        let check = |limits: Vec<LimitSpec>| {
            let request = CheckRequest {
                key: "k".into(),
                limits,
                cost: 1,
                penalty_ms: 0,
                proxy: None,
            };
            check_request(&request, &settings)
                .err()
                .map(|e| e.to_string())
                .unwrap_or_default()
        };
        let daily = LimitSpec::window(AlgorithmSpec::FixedWindow, 3, 86_400_000);
        let sliding = LimitSpec::window(AlgorithmSpec::SlidingWindow, 5, 1_000);
        let monthly = LimitSpec::calendar(100, Calendar::Month);
        assert_eq!(check(vec![daily, monthly]), "");
        assert_eq!(check(vec![sliding]), "");
        // at most one request per two microseconds: 499,999 a second
        assert_eq!(
            check(vec![LimitSpec::window(
                AlgorithmSpec::FixedWindow,
                499_999,
                1_000
            )]),
            ""
        );
        assert_eq!(
            check(vec![LimitSpec::window(
                AlgorithmSpec::FixedWindow,
                500_000,
                1_000
            )]),
            "limits[0].requests: too many for one window: fewer than half its microseconds"
        );
        assert_eq!(
            check(vec![daily, LimitSpec { burst: 4, ..daily }]),
            "limits[1].burst: fixed_window has no burst: it must equal requests"
        );
        assert_eq!(
            check(vec![LimitSpec {
                algorithm: AlgorithmSpec::SlidingWindow,
                ..monthly
            }]),
            "limits[0].calendar: week and month are calendar windows of fixed_window, not of sliding_window"
        );
        assert_eq!(
            check(vec![LimitSpec {
                period_ms: 31 * 86_400_000,
                ..monthly
            }]),
            "limits[0].period_ms: a month window travels with its nominal length, 2592000000 ms"
        );
        assert_eq!(
            check(vec![LimitSpec {
                algorithm: AlgorithmSpec::TokenBucket,
                ..monthly
            }]),
            "limits[0].calendar: week and month are calendar windows of fixed_window, not of token_bucket"
        );
        assert_eq!(
            check(vec![daily, sliding]),
            "limits[1].algorithm: the limits of one key share one algorithm (fixed_window here)"
        );
        assert_eq!(
            check(vec![TEN, daily]),
            "limits[1].algorithm: the limits of one key share one algorithm (token_bucket here)"
        );
        let log = LimitSpec::window(AlgorithmSpec::SlidingLog, 1_000, 3_600_000);
        assert_eq!(check(vec![log]), "");
        assert_eq!(
            check(vec![LimitSpec {
                requests: 1_001,
                burst: 1_001,
                ..log
            }]),
            "limits[0].requests: a sliding_log keeps one member per request: at most 1000"
        );
        // a log is never leased: a sync refuses the entry alone
        let logged = SyncRequest {
            proxy: "p".into(),
            interval_ms: 100,
            entries: vec![entry("a", vec![TEN]), entry("b", vec![log])],
            load: None,
            overrides_version: 0,
            overrides_delta: false,
            fleet_share: false,
            top: Vec::new(),
        };
        assert_eq!(
            message(&logged),
            "entries[1].limits[0].algorithm: sliding_log is decided request by request (/v1/check), never leased"
        );
        // a sync leases windows too (sync_window.lua), within the same bounds
        let mut request = SyncRequest {
            proxy: "p".into(),
            interval_ms: 100,
            entries: vec![entry("a", vec![TEN]), entry("b", vec![sliding, sliding])],
            load: None,
            overrides_version: 0,
            overrides_delta: false,
            fleet_share: false,
            top: Vec::new(),
        };
        assert_eq!(message(&request), "");
        request.entries[1] = entry(
            "b",
            vec![LimitSpec {
                burst: 6,
                ..sliding
            }],
        );
        assert_eq!(
            message(&request),
            "entries[1].limits[0].burst: sliding_window has no burst: it must equal requests"
        );
    }
}
