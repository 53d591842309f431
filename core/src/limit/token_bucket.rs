//! The token bucket: a pure step from (limit, state, now, cost) to a verdict and a new state.
//!
//! Time is microseconds since the Unix epoch, passed in. Tokens are `f64`, and the arithmetic is
//! written in the same order as `lua/` so both agree bit for bit (see the shared test vectors).

use crate::limit::Limit;

/// A stamp further ahead of the clock than this means the clock was stepped back (not two
/// workers reading it microseconds apart): one second.
pub const CLOCK_STEP_US: u64 = 1_000_000;

/// The state of one bucket: tokens left at `stamp_us`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LimitState {
    pub tokens: f64,
    pub stamp_us: u64,
}

/// What one bucket says about one request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Verdict {
    pub allowed: bool,
    /// Whole tokens left after the decision.
    pub remaining: u64,
    /// When denied: microseconds until `cost` tokens are there. Zero when allowed.
    pub retry_after_us: u64,
    /// Microseconds until the bucket is full again.
    pub reset_us: u64,
    /// When allowed by a shaper (leaky bucket): how long the request waits before it leaves.
    pub delay_us: u64,
}

impl LimitState {
    /// A full bucket: a key seen for the first time has its whole burst.
    pub fn full(limit: &Limit, now_us: u64) -> LimitState {
        LimitState {
            tokens: limit.burst() as f64,
            stamp_us: now_us,
        }
    }

    /// The bucket at `now_us`: refilled for the time since `stamp_us`, never above the burst
    /// (a bucket kept from limits of a larger burst holds the new one at most, at once).
    /// A clock that went backwards refills nothing: by less than [`CLOCK_STEP_US`] (workers
    /// reading the clock microseconds apart) the stamp stays, so no time is refilled twice; by
    /// more (the clock was stepped back) the stamp moves back to `now_us`, tokens kept, so the
    /// bucket refills again from now instead of refusing until the clock is back where it was.
    pub fn refilled(self, limit: &Limit, now_us: u64) -> LimitState {
        if now_us <= self.stamp_us {
            let tokens = self.tokens.min(limit.burst() as f64);
            if self.stamp_us - now_us > CLOCK_STEP_US {
                return LimitState {
                    tokens,
                    stamp_us: now_us,
                };
            }
            return LimitState { tokens, ..self };
        }
        let elapsed = (now_us - self.stamp_us) as f64;
        let tokens =
            self.tokens + elapsed * limit.requests() as f64 / limit.period().micros() as f64;
        LimitState {
            tokens: tokens.min(limit.burst() as f64),
            stamp_us: now_us,
        }
    }

    /// Looks without spending: would `cost` tokens be there at `now_us`?
    pub fn peek(self, limit: &Limit, now_us: u64, cost: u64) -> (Verdict, LimitState) {
        let bucket = self.refilled(limit, now_us);
        let allowed = bucket.tokens >= cost as f64;
        let verdict = bucket.verdict(limit, allowed, cost);
        (verdict, bucket)
    }

    /// Spends `cost` tokens if they are all there; otherwise spends nothing.
    pub fn take(self, limit: &Limit, now_us: u64, cost: u64) -> (Verdict, LimitState) {
        let (verdict, mut bucket) = self.peek(limit, now_us, cost);
        if verdict.allowed {
            bucket.tokens -= cost as f64;
            return (bucket.verdict(limit, true, cost), bucket);
        }
        (verdict, bucket)
    }

    /// Gives back `cost` tokens spent by a request that another rule then denied.
    pub fn refund(self, limit: &Limit, cost: u64) -> LimitState {
        LimitState {
            tokens: (self.tokens + cost as f64).min(limit.burst() as f64),
            stamp_us: self.stamp_us,
        }
    }

    fn verdict(&self, limit: &Limit, allowed: bool, cost: u64) -> Verdict {
        let micros_per_token = limit.period().micros() as f64 / limit.requests() as f64;
        let tokens = self.tokens.max(0.0);
        let retry_after_us = if allowed {
            0
        } else {
            ((cost as f64 - self.tokens) * micros_per_token).ceil() as u64
        };
        Verdict {
            allowed,
            remaining: tokens.floor() as u64,
            retry_after_us,
            reset_us: ((limit.burst() as f64 - self.tokens) * micros_per_token).ceil() as u64,
            delay_us: 0,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::limit::Period;
    use proptest::prelude::*;

    const SECOND: u64 = 1_000_000;

    #[test]
    fn a_new_bucket_admits_its_burst_then_denies() {
        let limit = Limit::new(60, Period::Minute, Some(3)).unwrap();
        let now = 1_000 * SECOND;
        let mut bucket = LimitState::full(&limit, now);
        for left in [2, 1, 0] {
            let (verdict, next) = bucket.take(&limit, now, 1);
            assert!(verdict.allowed, "at {now} with {left} to go");
            assert_eq!(verdict.remaining, left);
            bucket = next;
        }
        let (verdict, _) = bucket.take(&limit, now, 1);
        assert!(!verdict.allowed);
        assert_eq!(verdict.retry_after_us, SECOND, "one token a second");
        assert_eq!(verdict.reset_us, 3 * SECOND);
    }

    #[test]
    fn refill_is_proportional_and_capped() {
        let limit = Limit::new(10, Period::Second, Some(10)).unwrap();
        let empty = LimitState {
            tokens: 0.0,
            stamp_us: 0,
        };
        assert_eq!(empty.refilled(&limit, SECOND / 2).tokens, 5.0);
        assert_eq!(empty.refilled(&limit, 60 * SECOND).tokens, 10.0);
        assert_eq!(empty.refilled(&limit, 0).tokens, 0.0, "no time, no tokens");
    }

    #[test]
    fn a_clock_going_backwards_refills_nothing() {
        let limit = Limit::new(10, Period::Second, None).unwrap();
        let bucket = LimitState {
            tokens: 1.0,
            stamp_us: 5 * SECOND,
        };
        assert_eq!(bucket.refilled(&limit, 4 * SECOND), bucket);
    }

    #[test]
    fn a_clock_stepped_back_refills_from_its_new_time_not_after_catching_up() {
        let limit = Limit::new(10, Period::Second, Some(10)).unwrap();
        let empty = LimitState {
            tokens: 0.0,
            stamp_us: 1_700_000_000 * SECOND,
        };
        // Stepped back a year: the bucket keeps its tokens and refills from the new time.
        let back = 1_700_000_000 * SECOND - 365 * 86_400 * SECOND;
        let (verdict, next) = empty.take(&limit, back, 1);
        assert!(!verdict.allowed, "no token appears from a step back");
        assert_eq!(next.stamp_us, back);
        let (verdict, _) = next.take(&limit, back + SECOND / 10, 1);
        assert!(verdict.allowed, "a tenth of a second later, one token");
        let (verdict, _) = empty.take(&limit, 1_700_000_000 * SECOND - SECOND / 2, 1);
        assert!(!verdict.allowed, "half a second back: the stamp stays");
    }

    proptest! {
        /// Never more than burst + rate × elapsed admitted, whatever the arrivals.
        #[test]
        fn never_admits_more_than_burst_plus_refill(
            requests in 1u64..1_000,
            burst in 1u64..1_000,
            gaps in proptest::collection::vec(0u64..200_000, 1..400),
        ) {
            let limit = Limit::new(requests, Period::Second, Some(burst)).unwrap();
            let start = 7 * SECOND;
            let mut now = start;
            let mut bucket = LimitState::full(&limit, now);
            let mut admitted = 0u64;
            for gap in gaps {
                now += gap;
                let (verdict, next) = bucket.take(&limit, now, 1);
                bucket = next;
                admitted += verdict.allowed as u64;
            }
            let bound = burst as f64 + (now - start) as f64 * limit.rate_per_micro();
            prop_assert!(admitted as f64 <= bound + 1e-9, "admitted {} > bound {} at {}", admitted, bound, now);
        }
    }
}
