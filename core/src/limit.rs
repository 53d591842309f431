//! A limit: how many requests per period, with how much burst. A small validated value.

use std::fmt;

/// The period a limit is counted over.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Period {
    Second,
    Minute,
    Hour,
    Day,
}

impl Period {
    pub const NAMES: &'static str = "second, minute, hour, day";

    pub fn parse(name: &str) -> Option<Period> {
        match name {
            "second" => Some(Period::Second),
            "minute" => Some(Period::Minute),
            "hour" => Some(Period::Hour),
            "day" => Some(Period::Day),
            _ => None,
        }
    }

    pub fn seconds(self) -> u64 {
        match self {
            Period::Second => 1,
            Period::Minute => 60,
            Period::Hour => 3_600,
            Period::Day => 86_400,
        }
    }

    pub fn micros(self) -> u64 {
        self.seconds() * 1_000_000
    }
}

impl fmt::Display for Period {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Period::Second => "second",
            Period::Minute => "minute",
            Period::Hour => "hour",
            Period::Day => "day",
        })
    }
}

/// `requests` per `period`, with a bucket of `burst` tokens: at most `burst` at once, and
/// `requests` more every `period` after that.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Limit {
    requests: u64,
    period: Period,
    burst: u64,
}

/// Largest accepted `requests` or `burst`: keeps every token count exact in an `f64` and a `u32`.
pub use sluice_protocol::MAX_TOKENS;

impl Limit {
    /// One request a second: a placeholder where a limit is needed and none is configured.
    pub const UNIT: Limit = Limit {
        requests: 1,
        period: Period::Second,
        burst: 1,
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
        Ok(Limit {
            requests,
            period,
            burst,
        })
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

/// A limit as the wire carries it.
impl From<&Limit> for sluice_protocol::LimitSpec {
    fn from(limit: &Limit) -> Self {
        sluice_protocol::LimitSpec {
            requests: limit.requests,
            period_ms: limit.period.seconds() * 1_000,
            burst: limit.burst,
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
}
