//! Any period: `per` takes a duration (`"15m"`, `"10s"`, `"6h"`, `"2d"`) or a number of seconds
//! (`900`) beside the named periods, for every algorithm and consistency; a duration's windows
//! are aligned to the Unix epoch; and every value an operator (or a live override) may write
//! that is not one is refused, naming `per`.

use serde_json::{json, Value};
use sluice_core::protocol::LimitSpec;
use sluice_core::{Exchange, Limiter, MemoryStore, Moment, Period, PlainRequest, Reply, Step};

const SECOND: u64 = 1_000_000;
/// 2023-11-14 22:13:20 UTC: 20 s into a 7-minute window of the epoch, 800 s into a
/// 15-minute one (and 240 s past a 7-minute boundary at its day's midnight, which is no
/// boundary of the epoch's).
const T0: u64 = 1_700_000_000 * SECOND;

fn policy(limit: Value, consistency: &str) -> Result<sluice_core::Policy, String> {
    let service = if consistency == "local" {
        json!(null)
    } else {
        json!({"cluster": "svc"})
    };
    let config = json!({
        "service": service,
        "headers": "both",
        "rules": [{"name": "r", "key": ["client_ip"], "consistency": consistency,
                   "limits": [limit]}]
    });
    let mut config = config;
    if consistency == "local" {
        config.as_object_mut().unwrap().remove("service");
    }
    sluice_core::parse(config.to_string().as_bytes()).map_err(|e| e.to_string())
}

#[test]
fn every_algorithm_and_consistency_takes_a_duration_or_seconds() {
    let forms = [
        (json!("15m"), 900),
        (json!(900), 900),
        (json!("10s"), 10),
        (json!("6h"), 21_600),
        (json!("2d"), 172_800),
        (json!("7m"), 420),
        (json!("90s"), 90),
        (json!("366d"), 366 * 86_400),
        (json!(1), 1),
    ];
    let algorithms = [
        "token_bucket",
        "gcra",
        "fixed_window",
        "sliding_window",
        "sliding_log",
        "leaky_bucket",
    ];
    let mut accepted = 0;
    for (per, seconds) in &forms {
        for algorithm in algorithms {
            for consistency in ["local", "cached", "strict"] {
                // The service counts neither sliding logs nor leaky buckets ahead of a sync.
                let shared = consistency != "local";
                if (algorithm == "leaky_bucket" && shared)
                    || (algorithm == "sliding_log" && consistency == "cached")
                {
                    continue;
                }
                let limit = json!({"requests": 5, "per": per, "algorithm": algorithm});
                let policy = policy(limit, consistency)
                    .unwrap_or_else(|e| panic!("{per} {algorithm} {consistency}: {e}"));
                let limit = policy.rules[0].limits[0];
                assert_eq!(limit.period().seconds(), *seconds, "{per} {algorithm}");
                assert_eq!(limit.period(), Period::Every(*seconds as u32));
                // What the configuration reads back as: the same period.
                assert_eq!(
                    Period::parse(&limit.period().to_string()),
                    Ok(limit.period())
                );
                // The service gets the same length the proxy counts.
                assert_eq!(LimitSpec::from(&limit).period_ms, seconds * 1_000);
                accepted += 1;
            }
        }
    }
    assert_eq!(accepted, forms.len() * 15);
}

#[test]
fn durations_read_back_in_their_largest_whole_unit() {
    for (seconds, name) in [
        (1, "1s"),
        (90, "90s"),
        (420, "7m"),
        (900, "15m"),
        (5_400, "90m"),
        (21_600, "6h"),
        (86_400, "1d"),
        (90_000, "25h"),
        (172_800, "2d"),
    ] {
        let period = Period::from_seconds(seconds).unwrap();
        assert_eq!(period.to_string(), name);
        assert_eq!(Period::parse(name), Ok(period));
    }
}

/// Each value an operator may write in `per` that is no period, with the error naming it.
const REFUSED: &[(&str, &str)] = &[
    ("0", "must be at least 1 second, got 0"),
    ("\"0s\"", "must be at least 1 second, got \"0s\""),
    ("-5", "must be at least 1 second, got -5"),
    ("\"-5m\"", "expected one of second, minute, hour, day, week, month, or a duration (\"15m\", \"6h\", 900), got \"-5m\""),
    ("1.5", "a number of seconds is an integer (write 1.5 minutes as 90 or \"90s\"), got 1.5"),
    ("-1.5", "must be at least 1 second, got -1.5"),
    ("900.0", "a number of seconds is an integer (write 1.5 minutes as 90 or \"90s\"), got 900.0"),
    ("\"1.5h\"", "a duration is a whole number of its unit: write 1.5h as \"90m\", got \"1.5h\""),
    ("31622401", "must be at most 366 days (31622400 seconds), got 31622401"),
    ("\"367d\"", "must be at most 366 days (31622400 seconds), got \"367d\""),
    // Overflows in seconds, in microseconds and in a u64 are all just too long.
    ("\"18446744073709551615s\"", "must be at most 366 days (31622400 seconds), got \"18446744073709551615s\""),
    ("\"5124095576030431d\"", "must be at most 366 days (31622400 seconds), got \"5124095576030431d\""),
    ("\"99999999999999999999999m\"", "must be at most 366 days (31622400 seconds), got \"99999999999999999999999m\""),
    ("18446744073709551615", "must be at most 366 days (31622400 seconds), got 18446744073709551615"),
    ("1e30", "must be at most 366 days (31622400 seconds), got 1e+30"),
    ("\"15x\"", "the unit must be s, m, h or d (a calendar week or month is \"week\" or \"month\"), got \"15x\""),
    ("\"1w\"", "the unit must be s, m, h or d (a calendar week or month is \"week\" or \"month\"), got \"1w\""),
    ("\"15M\"", "the unit must be s, m, h or d (a calendar week or month is \"week\" or \"month\"), got \"15M\""),
    ("\"15ms\"", "the unit must be s, m, h or d (a calendar week or month is \"week\" or \"month\"), got \"15ms\""),
    ("\"\"", "expected one of second, minute, hour, day, week, month, or a duration (\"15m\", \"6h\", 900), got \"\""),
    ("\"m\"", "expected one of second, minute, hour, day, week, month, or a duration (\"15m\", \"6h\", 900), got \"m\""),
    ("\"1m30s\"", "a duration is one whole number and one unit: write 1m30s as \"90s\", got \"1m30s\""),
    ("\" 15m\"", "must not start or end with spaces, got \" 15m\""),
    ("\"15m \"", "must not start or end with spaces, got \"15m \""),
    ("\"15 m\"", "the unit must be s, m, h or d (a calendar week or month is \"week\" or \"month\"), got \"15 m\""),
    ("\"+15m\"", "expected one of second, minute, hour, day, week, month, or a duration (\"15m\", \"6h\", 900), got \"+15m\""),
    ("\"900\"", "a number of seconds is written as a JSON number (900) or with its unit (\"900s\"), got \"900\""),
    ("\"Minute\"", "expected one of second, minute, hour, day, week, month, or a duration (\"15m\", \"6h\", 900), got \"Minute\""),
    ("null", "expected one of second, minute, hour, day, week, month, or a duration (\"15m\", \"6h\", 900), got null"),
    ("true", "expected one of second, minute, hour, day, week, month, or a duration (\"15m\", \"6h\", 900), got a boolean"),
    ("[900]", "expected one of second, minute, hour, day, week, month, or a duration (\"15m\", \"6h\", 900), got an array"),
];

#[test]
fn every_bad_period_is_refused_naming_per() {
    for (per, message) in REFUSED {
        let config = format!(
            r#"{{"rules": [{{"name": "r", "key": ["client_ip"], "limits": [{{"requests": 5, "per": {per}}}]}}]}}"#
        );
        let error = sluice_core::parse(config.as_bytes())
            .err()
            .unwrap_or_else(|| panic!("per {per} was accepted"))
            .to_string();
        assert_eq!(
            error,
            format!("rules[0].limits[0].per: {message}"),
            "per {per}"
        );
    }
}

#[test]
fn a_live_override_with_a_bad_period_is_refused_naming_per() {
    let policy = policy(json!({"requests": 5, "per": "minute"}), "local").unwrap();
    for (per, message) in REFUSED {
        let limit: Value =
            serde_json::from_str(&format!(r#"{{"requests": 5, "per": {per}}}"#)).unwrap();
        let error =
            sluice_core::overrides::check_limits(&policy, "r", &[limit], "target", "limits")
                .err()
                .unwrap_or_else(|| panic!("override per {per} was accepted"))
                .to_string();
        assert_eq!(error, format!("limits[0].per: {message}"), "per {per}");
    }
    let good = json!({"requests": 5, "per": "15m", "algorithm": "fixed_window"});
    let rules =
        sluice_core::overrides::check_limits(&policy, "r", &[good], "target", "limits").unwrap();
    assert_eq!(rules[0].1.limits[0].period(), Period::Every(900));
}

#[test]
fn a_long_bad_period_is_echoed_short() {
    let long = format!("\"{}\"", "9".repeat(10_000) + "x");
    let config = format!(
        r#"{{"rules": [{{"name": "r", "key": ["client_ip"], "limits": [{{"requests": 5, "per": {long}}}]}}]}}"#
    );
    let error = sluice_core::parse(config.as_bytes())
        .unwrap_err()
        .to_string();
    assert!(error.len() < 200, "{error}");
}

/// A request from one client at `now_us`: admitted, or the local reply.
fn ask(limiter: &Limiter, store: &mut MemoryStore, now_us: u64) -> Option<Reply> {
    let mut request = PlainRequest::get("/").from_ip("10.0.0.1");
    let (_, step, _) = Exchange::start(limiter, &mut request, None, Moment::at(now_us), store);
    match step {
        Step::Continue => None,
        Step::Respond(reply) => Some(reply),
        other => panic!("{other:?}"),
    }
}

/// A 7-minute fixed window (420 s, which divides no day) starts at a multiple of 420 s since
/// the epoch: at T0 it is 20 s old and ends 400 s later, whatever the time of day.
#[test]
fn a_fixed_window_of_seven_minutes_is_aligned_to_the_epoch() {
    let limiter = Limiter::new(
        policy(
            json!({"requests": 2, "per": "7m", "algorithm": "fixed_window"}),
            "local",
        )
        .unwrap(),
    );
    let mut store = MemoryStore::default();
    let end = T0 + 400 * SECOND;
    assert_eq!(ask(&limiter, &mut store, T0), None);
    assert_eq!(ask(&limiter, &mut store, end - 2 * SECOND), None);
    let denied = ask(&limiter, &mut store, end - 1).expect("a third request in the window");
    assert_eq!(denied.status, 429);
    assert_eq!(denied.headers.get("retry-after"), Some("1"));
    assert_eq!(
        denied.headers.get("ratelimit-policy"),
        Some("\"r\";q=2;w=420")
    );
    assert_eq!(denied.headers.get("ratelimit"), Some("\"r\";r=0;t=1"));
    let body: Value = serde_json::from_str(&denied.body).unwrap();
    assert_eq!(body["retryAfter"], 1);
    assert_eq!(
        body["message"],
        "rate limit exceeded: 2 requests per 7m for rule r; retry in 1 s"
    );
    // The next window starts at the epoch's boundary, not at the day's.
    assert_eq!(ask(&limiter, &mut store, end), None);
    assert_eq!(ask(&limiter, &mut store, end + 419 * SECOND), None);
    assert!(ask(&limiter, &mut store, end + 420 * SECOND - 1).is_some());
}

/// A token bucket of 5 per 900 seconds refills one every 180 s: the wait is the duration's.
#[test]
fn a_bucket_of_a_number_of_seconds_refills_at_its_pace() {
    let limiter = Limiter::new(policy(json!({"requests": 5, "per": 900}), "local").unwrap());
    let mut store = MemoryStore::default();
    for _ in 0..5 {
        assert_eq!(ask(&limiter, &mut store, T0), None);
    }
    let denied = ask(&limiter, &mut store, T0).expect("a sixth request");
    assert_eq!(denied.headers.get("retry-after"), Some("180"));
    assert_eq!(
        denied.headers.get("ratelimit-policy"),
        Some("\"r\";q=5;w=900")
    );
    assert_eq!(ask(&limiter, &mut store, T0 + 180 * SECOND), None);
    assert!(ask(&limiter, &mut store, T0 + 180 * SECOND).is_some());
}

/// A sliding window of "10s" weighs the previous 10-second window of the epoch.
#[test]
fn a_sliding_window_of_ten_seconds_slides_over_epoch_windows() {
    let limiter = Limiter::new(
        policy(
            json!({"requests": 4, "per": "10s", "algorithm": "sliding_window"}),
            "local",
        )
        .unwrap(),
    );
    let mut store = MemoryStore::default();
    // T0 starts a 10-second window; four requests fill it.
    for _ in 0..4 {
        assert_eq!(ask(&limiter, &mut store, T0), None);
    }
    assert!(ask(&limiter, &mut store, T0 + 9 * SECOND).is_some());
    // 2.5 s into the next window, 75% of the previous window's 4 still count: 3, so one fits.
    assert_eq!(ask(&limiter, &mut store, T0 + 12_500_000), None);
    let denied = ask(&limiter, &mut store, T0 + 12_500_000).expect("full again");
    assert_eq!(
        denied.headers.get("ratelimit-policy"),
        Some("\"r\";q=4;w=10")
    );
}
