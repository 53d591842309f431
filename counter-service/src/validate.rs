//! Bounds on what a request may ask, checked before Redis sees it. Each error names its field
//! (`entries[3].key`, `entries[0].limits[1].burst`).

use sluice_core::limit::MAX_TOKENS;
use sluice_core::protocol::{CheckRequest, LimitSpec, SyncEntry, SyncRequest};

use crate::error::AppError;
use crate::settings::Settings;

/// Most limits one entry may have.
pub const MAX_LIMITS: usize = 8;
/// Longest period a limit may count over: 366 days.
pub const MAX_PERIOD_MS: u64 = 366 * 86_400_000;
/// Longest sync interval: one hour.
pub const MAX_INTERVAL_MS: u64 = 3_600_000;
/// Largest count one sync may report (exact in the scripts' doubles).
pub const MAX_COUNT: u64 = 1 << 53;

pub fn sync_request(request: &SyncRequest, settings: &Settings) -> Result<(), AppError> {
    name("proxy", &request.proxy, settings.max_key_bytes)?;
    if request.interval_ms == 0 || request.interval_ms > MAX_INTERVAL_MS {
        return Err(AppError::invalid(
            "interval_ms",
            format!("must be between 1 and {MAX_INTERVAL_MS}"),
        ));
    }
    if request.entries.len() > settings.max_batch {
        return Err(AppError::invalid(
            "entries",
            format!("more than {} entries in one batch", settings.max_batch),
        ));
    }
    for (i, entry) in request.entries.iter().enumerate() {
        sync_entry(&format!("entries[{i}]"), entry, settings)?;
    }
    Ok(())
}

fn sync_entry(at: &str, entry: &SyncEntry, settings: &Settings) -> Result<(), AppError> {
    name(&format!("{at}.key"), &entry.key, settings.max_key_bytes)?;
    limits(&format!("{at}.limits"), &entry.limits)?;
    for (field, value) in [("spent", entry.spent), ("denied", entry.denied)] {
        if value > MAX_COUNT {
            return Err(AppError::invalid(
                format!("{at}.{field}"),
                format!("must be at most {MAX_COUNT}"),
            ));
        }
    }
    Ok(())
}

pub fn check_request(request: &CheckRequest, settings: &Settings) -> Result<(), AppError> {
    name("key", &request.key, settings.max_key_bytes)?;
    limits("limits", &request.limits)?;
    if request.cost > MAX_TOKENS {
        return Err(AppError::invalid(
            "cost",
            format!("must be at most {MAX_TOKENS}"),
        ));
    }
    Ok(())
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
    }
    Ok(())
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
        }
    }

    fn message(request: &SyncRequest) -> String {
        sync_request(request, &settings())
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default()
    }

    const TEN: LimitSpec = LimitSpec {
        requests: 10,
        period_ms: 1000,
        burst: 10,
    };

    #[test]
    fn each_error_names_its_field() {
        let mut request = SyncRequest {
            proxy: "p".into(),
            interval_ms: 100,
            entries: vec![entry("a", vec![TEN]), entry(&"k".repeat(513), vec![TEN])],
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
        assert_eq!(message(&request), "");
        request.interval_ms = 0;
        assert_eq!(
            message(&request),
            "interval_ms: must be between 1 and 3600000"
        );
    }
}
