//! A limit: how many requests per period, with how much burst. A small validated value.

pub mod algorithm;
pub mod calendar;
pub mod concurrency;
pub mod dynamic;
pub mod registry;
pub mod sliding_log;
pub mod table;
pub mod token_bucket;

use std::fmt;

/// The period a limit is counted over: a named period of the clock or calendar, or a
/// duration ([`Period::Every`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Period {
    Second,
    Minute,
    Hour,
    Day,
    /// A calendar week, Monday 00:00 UTC to Monday 00:00 UTC (`fixed_window` only).
    Week,
    /// A calendar month, the 1st 00:00 UTC to the next 1st (`fixed_window` only).
    Month,
    /// A duration of this many seconds, between [`Period::MIN_SECONDS`] and
    /// [`Period::MAX_SECONDS`] (`"15m"`, `"6h"`, `900`): its windows are aligned to the Unix
    /// epoch (a 15-minute window starts at a multiple of 900 s since 1970-01-01 00:00 UTC), as
    /// the named periods up to a day are.
    Every(u32),
}

impl Period {
    pub const NAMES: &'static str = "second, minute, hour, day, week, month";
    /// The shortest duration.
    pub const MIN_SECONDS: u64 = 1;
    /// The longest duration: 366 days, the longest period the counter service takes.
    pub const MAX_SECONDS: u64 = 366 * 86_400;
    /// What `per` takes, for error messages.
    pub const EXPECTED: &'static str =
        "one of second, minute, hour, day, week, month, or a duration (\"15m\", \"6h\", 900)";

    /// A period as configured: a name (`"minute"`) or a duration (`"15m"`), or why not. A
    /// number of seconds written as a number is [`Period::from_seconds`]'s.
    pub fn parse(text: &str) -> Result<Period, String> {
        match text {
            "second" => return Ok(Period::Second),
            "minute" => return Ok(Period::Minute),
            "hour" => return Ok(Period::Hour),
            "day" => return Ok(Period::Day),
            "week" => return Ok(Period::Week),
            "month" => return Ok(Period::Month),
            _ => {}
        }
        // Echoed in the error, at most 40 characters of it.
        let shown: String = text.chars().take(40).collect();
        let refused = |why: &str| format!("{why}, got {shown:?}");
        if text.is_empty() {
            return Err(format!("expected {}, got \"\"", Period::EXPECTED));
        }
        if text.trim() != text {
            return Err(refused("must not start or end with spaces"));
        }
        let digits = text.bytes().take_while(u8::is_ascii_digit).count();
        let (number, unit) = text.split_at(digits);
        if number.is_empty() {
            return Err(refused(&format!("expected {}", Period::EXPECTED)));
        }
        if unit.is_empty() {
            return Err(refused(&format!(
                "a number of seconds is written as a JSON number ({number}) or with its unit (\"{number}s\")"
            )));
        }
        let scale: u64 = match unit {
            "s" => 1,
            "m" => 60,
            "h" => 3_600,
            "d" => 86_400,
            _ if unit.starts_with('.') => 0,
            _ if unit.bytes().skip(1).any(|b| b.is_ascii_digit()) => {
                return Err(refused(
                    "a duration is one whole number and one unit: write 1m30s as \"90s\"",
                ))
            }
            _ => return Err(refused(
                "the unit must be s, m, h or d (a calendar week or month is \"week\" or \"month\")",
            )),
        };
        if scale == 0 {
            return Err(refused(
                "a duration is a whole number of its unit: write 1.5h as \"90m\"",
            ));
        }
        // Too many digits for a u64 is too long a period all the same.
        let seconds = number
            .parse::<u64>()
            .ok()
            .and_then(|n| n.checked_mul(scale))
            .unwrap_or(u64::MAX);
        Period::from_seconds(seconds).map_err(|why| refused(&why))
    }

    /// A duration of `seconds`, or why not: between [`Period::MIN_SECONDS`] and
    /// [`Period::MAX_SECONDS`].
    pub fn from_seconds(seconds: u64) -> Result<Period, String> {
        if seconds < Period::MIN_SECONDS {
            return Err("must be at least 1 second".to_string());
        }
        if seconds > Period::MAX_SECONDS {
            return Err(format!(
                "must be at most 366 days ({} seconds)",
                Period::MAX_SECONDS
            ));
        }
        u32::try_from(seconds)
            .map(Period::Every)
            .map_err(|_| "must be at most 366 days".to_string())
    }

    /// Whether windows of this period follow the calendar rather than a fixed length.
    pub fn calendar(self) -> bool {
        matches!(self, Period::Week | Period::Month)
    }

    /// The length in seconds; a month counts as 30 days where one length is needed (rates,
    /// the `w=` of the `RateLimit-Policy` header).
    pub fn seconds(self) -> u64 {
        match self {
            Period::Second => 1,
            Period::Minute => 60,
            Period::Hour => 3_600,
            Period::Day => 86_400,
            Period::Week => 7 * 86_400,
            Period::Month => 30 * 86_400,
            Period::Every(seconds) => seconds as u64,
        }
    }

    pub fn micros(self) -> u64 {
        self.seconds() * 1_000_000
    }
}

impl Period {
    /// The name of a named period (`"minute"`); `None` for a duration.
    pub fn static_name(self) -> Option<&'static str> {
        Some(match self {
            Period::Second => "second",
            Period::Minute => "minute",
            Period::Hour => "hour",
            Period::Day => "day",
            Period::Week => "week",
            Period::Month => "month",
            Period::Every(_) => return None,
        })
    }

    /// The period as configured: its name, or a duration in its largest whole unit (`"15m"`
    /// for 900 seconds, `"90s"`), which reads back as the same period.
    pub fn name(self) -> std::borrow::Cow<'static, str> {
        use std::borrow::Cow;
        match (self.static_name(), self) {
            (Some(name), _) => Cow::Borrowed(name),
            (None, _) => {
                let seconds = self.seconds();
                let (count, unit) = [(86_400, "d"), (3_600, "h"), (60, "m")]
                    .into_iter()
                    .find(|(scale, _)| seconds.is_multiple_of(*scale))
                    .map_or((seconds, "s"), |(scale, unit)| (seconds / scale, unit));
                Cow::Owned(format!("{count}{unit}"))
            }
        }
    }
}

impl fmt::Display for Period {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.name())
    }
}

/// How a limit counts. Each keeps 16 bytes of state per key and limit ([`crate::limit::token_bucket`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum Algorithm {
    /// `burst` at once, refilled at `requests` per `period`.
    #[default]
    TokenBucket,
    /// The same admissions as the token bucket from one timestamp, the theoretical arrival
    /// time: exact `Retry-After`.
    Gcra,
    /// `requests` per window, windows aligned to the UTC clock and calendar.
    FixedWindow,
    /// The previous window's count weighted by its overlap with the last `period`, plus the
    /// current window's.
    SlidingWindow,
    /// Shaping: requests leave at `requests` per `period`; a burst's first `delay` pass at
    /// once, the next `queue` wait for their slot (at most `max_delay_ms`), the rest are refused.
    LeakyBucket,
    /// Exact: one timestamp per request admitted in the last `period`; admitted while fewer
    /// than `requests` are.
    SlidingLog,
    /// Per-key concurrency: at most `requests` in flight at once, each slot held until its
    /// stream ends or `period` (`max_hold`) has passed ([`crate::limit::concurrency`]).
    Concurrency,
}

/// A leaky bucket's shaping: how many of a burst pass at once, how many wait, for how long.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct Shaping {
    pub delay: u32,
    pub queue: u32,
    pub max_delay_ms: u32,
}

impl Algorithm {
    pub const NAMES: &'static str =
        "token_bucket, gcra, fixed_window, sliding_window, sliding_log, leaky_bucket, concurrency";

    pub fn parse(name: &str) -> Option<Algorithm> {
        match name {
            "token_bucket" => Some(Algorithm::TokenBucket),
            "gcra" => Some(Algorithm::Gcra),
            "fixed_window" => Some(Algorithm::FixedWindow),
            "sliding_window" => Some(Algorithm::SlidingWindow),
            "leaky_bucket" => Some(Algorithm::LeakyBucket),
            "sliding_log" => Some(Algorithm::SlidingLog),
            "concurrency" => Some(Algorithm::Concurrency),
            _ => None,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Algorithm::TokenBucket => "token_bucket",
            Algorithm::Gcra => "gcra",
            Algorithm::FixedWindow => "fixed_window",
            Algorithm::SlidingWindow => "sliding_window",
            Algorithm::LeakyBucket => "leaky_bucket",
            Algorithm::SlidingLog => "sliding_log",
            Algorithm::Concurrency => "concurrency",
        }
    }

    /// Whether it counts in windows (no burst of its own: `requests` per window).
    pub fn windowed(self) -> bool {
        matches!(self, Algorithm::FixedWindow | Algorithm::SlidingWindow)
    }
}

/// `requests` per `period`, counted by `algorithm`. For the token bucket and GCRA, `burst`
/// tokens: at most `burst` at once, and `requests` more every `period` after that.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Limit {
    requests: u64,
    period: Period,
    burst: u64,
    algorithm: Algorithm,
    shaping: Shaping,
}

/// Largest accepted `requests` or `burst`: keeps every token count exact in an `f64` and a `u32`.
pub use sluice_protocol::{MAX_LOG, MAX_TOKENS};

impl Limit {
    /// One request a second: a placeholder where a limit is needed and none is configured.
    pub const UNIT: Limit = Limit {
        requests: 1,
        period: Period::Second,
        burst: 1,
        algorithm: Algorithm::TokenBucket,
        shaping: Shaping {
            delay: 0,
            queue: 0,
            max_delay_ms: 0,
        },
    };

    /// A limit, or the reason it is not one. `burst` defaults to `requests`.
    pub fn new(requests: u64, period: Period, burst: Option<u64>) -> Result<Limit, &'static str> {
        let burst = burst.unwrap_or(requests);
        if requests == 0 {
            return Err("must be at least 1");
        }
        if requests > MAX_TOKENS {
            return Err("must be at most 2147483648");
        }
        if burst == 0 || burst > MAX_TOKENS {
            return Err("burst must be between 1 and 2147483648");
        }
        if period.calendar() {
            return Err(
                "week and month are calendar windows: use them with the fixed_window algorithm",
            );
        }
        Ok(Limit {
            requests,
            period,
            burst,
            algorithm: Algorithm::TokenBucket,
            shaping: Shaping::default(),
        })
    }

    /// A limit counted by a windowed `algorithm`: `requests` per window (no burst).
    pub fn windowed(
        requests: u64,
        period: Period,
        algorithm: Algorithm,
    ) -> Result<Limit, &'static str> {
        if !algorithm.windowed() {
            return Err("not a windowed algorithm");
        }
        if requests == 0 {
            return Err("must be at least 1");
        }
        // A window's count and its ghost (see `bucket`) need fewer requests than microseconds.
        if requests >= period.micros() / 2 || requests > MAX_TOKENS {
            return Err("too many for one window: at most one request per two microseconds of it");
        }
        if period.calendar() && algorithm != Algorithm::FixedWindow {
            return Err(
                "week and month are calendar windows: use them with the fixed_window algorithm",
            );
        }
        Ok(Limit {
            requests,
            period,
            burst: requests,
            algorithm,
            shaping: Shaping::default(),
        })
    }

    /// A sliding log of `requests` timestamps per key: at most [`MAX_LOG`] (each takes 8
    /// bytes of every key's record).
    pub fn logged(requests: u64, period: Period) -> Result<Limit, &'static str> {
        if requests == 0 {
            return Err("must be at least 1");
        }
        if requests > MAX_LOG {
            return Err("a sliding_log keeps one timestamp per request: at most 1000 requests (use sliding_window for more)");
        }
        if period.calendar() {
            return Err(
                "week and month are calendar windows: use them with the fixed_window algorithm",
            );
        }
        Ok(Limit {
            requests,
            period,
            burst: requests,
            algorithm: Algorithm::SlidingLog,
            shaping: Shaping::default(),
        })
    }

    /// Per-key concurrency: at most `concurrent` requests in flight (at most [`MAX_LOG`], each
    /// a place in every key's record), a slot held no longer than `max_hold` (a duration of at
    /// most [`concurrency::MAX_MAX_HOLD_S`]). Its `requests` and `burst` are `concurrent`, its
    /// period `max_hold`.
    pub fn concurrent(concurrent: u64, max_hold: Period) -> Result<Limit, &'static str> {
        if concurrent == 0 {
            return Err("must be at least 1");
        }
        if concurrent > MAX_LOG {
            return Err("a key's record keeps one place per slot: at most 1000");
        }
        if max_hold.calendar() || max_hold.seconds() > concurrency::MAX_MAX_HOLD_S {
            return Err("max_hold must be a duration of at most a day (86400 seconds)");
        }
        Ok(Limit {
            requests: concurrent,
            period: max_hold,
            burst: concurrent,
            algorithm: Algorithm::Concurrency,
            shaping: Shaping::default(),
        })
    }

    /// Places a key's record keeps for this limit: a sliding log's timestamps, a concurrency
    /// limit's slots; else 0.
    pub fn log_len(&self) -> usize {
        if matches!(
            self.algorithm,
            Algorithm::SlidingLog | Algorithm::Concurrency
        ) {
            self.requests as usize
        } else {
            0
        }
    }

    /// A leaky bucket: `requests` per `period` leave, `shaping` says how a burst waits.
    pub fn leaky(requests: u64, period: Period, shaping: Shaping) -> Result<Limit, &'static str> {
        let base = Limit::new(requests, period, None)?;
        // The request leaving now, the `delay` passing with it, the `queue` waiting.
        let room = 1 + shaping.delay as u64 + shaping.queue as u64;
        Ok(Limit {
            burst: room,
            algorithm: Algorithm::LeakyBucket,
            shaping,
            ..base
        })
    }

    pub fn shaping(&self) -> Shaping {
        self.shaping
    }

    /// One of `proxies` equal shares of this limit (a fleet-share fallback): `requests` and
    /// `burst` divided, rounded up, so the shares cover the limit; at least 1 request a period,
    /// and at least `cost` at once (a window's `requests`, a bucket's `burst`) so a request can
    /// still pass. Never more than the limit itself when `cost` is within its burst, as a rule's
    /// checks make it. A shaping or concurrency limit is not divided (no fallback has one).
    pub fn share(&self, proxies: u64, cost: u64) -> Limit {
        let proxies = proxies.max(1);
        let cost = cost.max(1);
        match self.algorithm {
            Algorithm::LeakyBucket | Algorithm::Concurrency => *self,
            Algorithm::TokenBucket | Algorithm::Gcra => Limit {
                requests: self.requests.div_ceil(proxies).max(1),
                burst: self.burst.div_ceil(proxies).max(cost),
                ..*self
            },
            Algorithm::FixedWindow | Algorithm::SlidingWindow | Algorithm::SlidingLog => {
                let requests = self.requests.div_ceil(proxies).max(cost);
                Limit {
                    requests,
                    burst: requests,
                    ..*self
                }
            }
        }
    }

    /// This limit times `factor` (in (0, 1]: a rule's `scale`): `requests` and `burst` rounded
    /// up, at least 1 request a period and at least `cost` at once (a window's `requests`, a
    /// bucket's `burst`), so a request can still pass; never more than the limit itself when
    /// `cost` is within its burst, as a rule's checks make it.
    pub fn scaled(&self, factor: f64, cost: u64) -> Limit {
        let factor = if factor.is_nan() {
            1.0
        } else {
            factor.clamp(0.0, 1.0)
        };
        let times = |n: u64| ((n as f64 * factor).ceil() as u64).clamp(1, n.max(1));
        let cost = cost.max(1);
        match self.algorithm {
            Algorithm::LeakyBucket | Algorithm::Concurrency | Algorithm::SlidingLog => *self,
            Algorithm::TokenBucket | Algorithm::Gcra => Limit {
                requests: times(self.requests),
                burst: times(self.burst).max(cost.min(self.burst)),
                ..*self
            },
            Algorithm::FixedWindow | Algorithm::SlidingWindow => {
                let requests = times(self.requests).max(cost.min(self.requests));
                Limit {
                    requests,
                    burst: requests,
                    ..*self
                }
            }
        }
    }

    /// This limit with `requests` in place of its own (a rule's `limits_from`): a bucket's burst
    /// in the proportion of its own (rounded up, at least 1), a window's its requests; the period
    /// and algorithm kept. `None` for a limit whose record depends on its requests (a sliding log,
    /// a concurrency limit), a leaky bucket, or `requests` no such limit can have.
    pub fn with_requests(&self, requests: u64) -> Option<Limit> {
        match self.algorithm {
            Algorithm::TokenBucket | Algorithm::Gcra => {
                let burst = if self.burst == self.requests {
                    requests
                } else {
                    let scaled = (self.burst as u128 * requests as u128)
                        .div_ceil(self.requests.max(1) as u128);
                    u64::try_from(scaled)
                        .unwrap_or(u64::MAX)
                        .clamp(1, MAX_TOKENS)
                };
                let limit = Limit::new(requests, self.period, Some(burst)).ok()?;
                Some(Limit {
                    algorithm: self.algorithm,
                    ..limit
                })
            }
            Algorithm::FixedWindow | Algorithm::SlidingWindow => {
                Limit::windowed(requests, self.period, self.algorithm).ok()
            }
            Algorithm::SlidingLog | Algorithm::Concurrency | Algorithm::LeakyBucket => None,
        }
    }

    /// The same limit counted by GCRA (the token bucket's admissions).
    pub fn gcra(self) -> Limit {
        Limit {
            algorithm: Algorithm::Gcra,
            ..self
        }
    }

    pub fn algorithm(&self) -> Algorithm {
        self.algorithm
    }

    pub fn requests(&self) -> u64 {
        self.requests
    }

    pub fn period(&self) -> Period {
        self.period
    }

    pub fn burst(&self) -> u64 {
        self.burst
    }

    /// Tokens refilled per microsecond.
    pub fn rate_per_micro(&self) -> f64 {
        self.requests as f64 / self.period.micros() as f64
    }
}

/// A limit as the wire carries it. `gcra` travels as `token_bucket`: the service's token
/// bucket admits exactly what GCRA admits (keep it so). A calendar window names its calendar,
/// with its nominal length in `period_ms`; see [`sluice_protocol::LimitSpec`].
impl From<&Limit> for sluice_protocol::LimitSpec {
    fn from(limit: &Limit) -> Self {
        use sluice_protocol::{AlgorithmSpec, Calendar};
        let algorithm = match limit.algorithm {
            Algorithm::FixedWindow => AlgorithmSpec::FixedWindow,
            Algorithm::SlidingWindow => AlgorithmSpec::SlidingWindow,
            Algorithm::SlidingLog => AlgorithmSpec::SlidingLog,
            // token_bucket and gcra; algorithms of one proxy only never reach the service.
            _ => AlgorithmSpec::TokenBucket,
        };
        let calendar = match limit.period {
            Period::Week => Some(Calendar::Week),
            Period::Month => Some(Calendar::Month),
            _ => None,
        };
        sluice_protocol::LimitSpec {
            requests: limit.requests,
            period_ms: limit.period.seconds() * 1_000,
            burst: limit.burst,
            algorithm,
            calendar,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn burst_defaults_to_requests() {
        let limit = Limit::new(100, Period::Minute, None).unwrap();
        assert_eq!(limit.burst(), 100);
    }

    #[test]
    fn zero_is_refused() {
        assert!(Limit::new(0, Period::Second, None).is_err());
        assert!(Limit::new(5, Period::Second, Some(0)).is_err());
    }

    #[test]
    fn the_wire_names_windows_and_calendars_and_sends_gcra_as_a_token_bucket() {
        use sluice_protocol::{AlgorithmSpec, Calendar, LimitSpec};
        let bucket = Limit::new(10, Period::Second, Some(20)).unwrap();
        assert_eq!(
            LimitSpec::from(&bucket),
            LimitSpec::token_bucket(10, 1_000, 20)
        );
        assert_eq!(
            LimitSpec::from(&bucket.gcra()),
            LimitSpec::token_bucket(10, 1_000, 20)
        );
        let daily = Limit::windowed(3, Period::Day, Algorithm::FixedWindow).unwrap();
        assert_eq!(
            LimitSpec::from(&daily),
            LimitSpec::window(AlgorithmSpec::FixedWindow, 3, 86_400_000)
        );
        let sliding = Limit::windowed(5, Period::Minute, Algorithm::SlidingWindow).unwrap();
        assert_eq!(
            LimitSpec::from(&sliding),
            LimitSpec::window(AlgorithmSpec::SlidingWindow, 5, 60_000)
        );
        for (period, calendar) in [
            (Period::Week, Calendar::Week),
            (Period::Month, Calendar::Month),
        ] {
            let limit = Limit::windowed(100, period, Algorithm::FixedWindow).unwrap();
            assert_eq!(LimitSpec::from(&limit), LimitSpec::calendar(100, calendar));
        }
    }

    /// A duration travels as the named periods up to a day do, its length in `period_ms` and
    /// no new field: every service that counts windows aligns a `period_ms` window to the
    /// epoch, so it counts "7m" as the proxy does, and "1d" as "day".
    #[test]
    fn a_duration_travels_as_its_length_alone() {
        use sluice_protocol::{AlgorithmSpec, LimitSpec};
        let seven = Period::parse("7m").unwrap();
        let window = Limit::windowed(5, seven, Algorithm::FixedWindow).unwrap();
        assert_eq!(
            serde_json::to_string(&LimitSpec::from(&window)).unwrap(),
            r#"{"requests":5,"period_ms":420000,"burst":5,"algorithm":"fixed_window"}"#
        );
        let day = Limit::windowed(5, Period::Day, Algorithm::SlidingWindow).unwrap();
        let one_d = Limit::windowed(5, Period::parse("1d").unwrap(), Algorithm::SlidingWindow);
        assert_eq!(LimitSpec::from(&one_d.unwrap()), LimitSpec::from(&day));
        let bucket = Limit::new(5, Period::from_seconds(900).unwrap(), Some(9)).unwrap();
        assert_eq!(
            LimitSpec::from(&bucket),
            LimitSpec::token_bucket(5, 900_000, 9)
        );
        assert_eq!(
            LimitSpec::from(&Limit::logged(5, seven).unwrap()).algorithm,
            AlgorithmSpec::SlidingLog
        );
    }

    /// A duration's windows start at multiples of its length since the epoch: 7 minutes (which
    /// divides no day) at T is 49,510 s into the day but 310 s into its window.
    #[test]
    fn a_duration_window_is_aligned_to_the_epoch() {
        use super::calendar::{end_us, start_us};
        // 2026-11-30 13:45:10.5 UTC.
        const T: u64 = 1_796_046_310_500_000;
        let seven = Period::Every(420);
        assert_eq!(T / 1_000_000 % 420, 310);
        assert_eq!(start_us(seven, T), T - 310_500_000);
        assert_eq!(end_us(seven, T), T - 310_500_000 + 420_000_000);
        // A day's midnight is no 7-minute boundary; a 2-day window turns on every other one.
        let midnight = 1_795_996_800_000_000;
        assert_ne!(start_us(seven, midnight), midnight);
        assert_eq!(start_us(Period::Every(86_400), T), midnight);
        assert_eq!(start_us(Period::Every(172_800), T) % 172_800_000_000, 0);
    }
}
