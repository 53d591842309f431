//! The virtual clock: the only time a harnessed filter ever sees.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// A clock the test moves by hand. Shareable between proxies (`Arc`).
///
/// It keeps two readings, like a real host: wall time (`proxy_get_current_time_nanoseconds`,
/// WASI `CLOCK_REALTIME`) and monotonic time (WASI `CLOCK_MONOTONIC`, tick and callout timers).
/// [`advance`](Self::advance) moves both; [`set`](Self::set) moves wall time anywhere and
/// monotonic time only forward.
///
/// Moving the clock directly does not run timers: use [`Proxy::advance`](super::Proxy::advance),
/// or call [`Proxy::fire_due`](super::Proxy::fire_due) after moving a shared clock.
#[derive(Debug)]
pub struct VirtualClock {
    wall_nanos: AtomicU64,
    monotonic_nanos: AtomicU64,
}

impl VirtualClock {
    /// Where a new clock starts: 2023-11-14T22:13:20Z (1_700_000_000 s after the Unix epoch).
    pub const START: Duration = Duration::from_secs(1_700_000_000);

    /// A clock at [`VirtualClock::START`].
    pub fn new() -> Arc<VirtualClock> {
        VirtualClock::starting_at(UNIX_EPOCH + VirtualClock::START)
    }

    /// A clock whose wall time starts at `start` (clamped to the Unix epoch).
    pub fn starting_at(start: SystemTime) -> Arc<VirtualClock> {
        Arc::new(VirtualClock {
            wall_nanos: AtomicU64::new(nanos_since_epoch(start)),
            monotonic_nanos: AtomicU64::new(0),
        })
    }

    /// Wall-clock time.
    pub fn now(&self) -> SystemTime {
        UNIX_EPOCH + Duration::from_nanos(self.now_nanos())
    }

    /// Wall-clock time in nanoseconds since the Unix epoch, as the ABI returns it.
    pub fn now_nanos(&self) -> u64 {
        self.wall_nanos.load(Ordering::SeqCst)
    }

    /// Monotonic time since the clock was made.
    pub fn monotonic(&self) -> Duration {
        Duration::from_nanos(self.monotonic_nanos())
    }

    pub(crate) fn monotonic_nanos(&self) -> u64 {
        self.monotonic_nanos.load(Ordering::SeqCst)
    }

    /// Moves both readings forward by `by`.
    pub fn advance(&self, by: Duration) {
        let nanos = duration_nanos(by);
        self.wall_nanos.fetch_add(nanos, Ordering::SeqCst);
        self.monotonic_nanos.fetch_add(nanos, Ordering::SeqCst);
    }

    /// Sets wall time to `to`; monotonic time moves forward by the same amount if `to` is
    /// later than now, and stays put otherwise (a wall-clock step back, like an NTP correction).
    pub fn set(&self, to: SystemTime) {
        let to = nanos_since_epoch(to);
        let from = self.wall_nanos.swap(to, Ordering::SeqCst);
        if to > from {
            self.monotonic_nanos.fetch_add(to - from, Ordering::SeqCst);
        }
    }

    /// Steps wall time to `to` and leaves monotonic time alone: a wall-clock jump, forward or
    /// back, as an operator or NTP makes one (timers and callout timeouts run on monotonic
    /// time, so they do not notice).
    pub fn jump(&self, to: SystemTime) {
        self.wall_nanos
            .store(nanos_since_epoch(to), Ordering::SeqCst);
    }

    /// Moves forward until monotonic time reads `monotonic_nanos` (no-op if already past it).
    pub(crate) fn advance_to_monotonic(&self, monotonic_nanos: u64) {
        let now = self.monotonic_nanos();
        if monotonic_nanos > now {
            self.advance(Duration::from_nanos(monotonic_nanos - now));
        }
    }
}

pub(crate) fn duration_nanos(duration: Duration) -> u64 {
    u64::try_from(duration.as_nanos()).unwrap_or(u64::MAX)
}

fn nanos_since_epoch(time: SystemTime) -> u64 {
    time.duration_since(UNIX_EPOCH)
        .map(duration_nanos)
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn advance_moves_both_readings_and_set_moves_monotonic_only_forward() {
        let clock = VirtualClock::new();
        let start = clock.now();
        clock.advance(Duration::from_millis(1500));
        assert_eq!(clock.now(), start + Duration::from_millis(1500));
        assert_eq!(clock.monotonic(), Duration::from_millis(1500));
        clock.set(start);
        assert_eq!(clock.now(), start, "wall time steps back");
        assert_eq!(
            clock.monotonic(),
            Duration::from_millis(1500),
            "monotonic time does not"
        );
        clock.set(start + Duration::from_secs(10));
        assert_eq!(clock.monotonic(), Duration::from_millis(11_500));
        clock.jump(start + Duration::from_secs(70));
        assert_eq!(clock.now(), start + Duration::from_secs(70));
        assert_eq!(
            clock.monotonic(),
            Duration::from_millis(11_500),
            "a jump moves wall time only"
        );
    }
}
