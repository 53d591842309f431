//! Limits that follow load and time: a rule's `scale` (its limits times a factor at the load
//! level) and `schedule` (other limits during UTC windows of the day).
//!
//! Decided from the request's clock and the load the host knows: nothing here reads a clock.
//! The limit in force is the schedule's window's limits (or the rule's own outside every
//! window), each scaled by the factor of the level at the time. A factor is at most 1, and a
//! scaled limit is rounded up to at least one request a period and to the rule's cost at once,
//! so neither a level nor a schedule ever makes a limit 0, nor raises it above its configured
//! value (a window's limits are configured values too).
//!
//! A window only changes `requests` and `burst`: each of its limits keeps the algorithm and the
//! period of the rule's limit in its place, so a key's counts carry over across the switch (its
//! record keeps one layout), as a live override that keeps a rule's layout does.

use crate::limit::table::MAX_LIMITS;
use crate::limit::{Algorithm, Limit};
use crate::shed::Level;

/// Microseconds in a day.
const DAY_US: u64 = 86_400_000_000;
/// Most windows a schedule has.
pub const MAX_WINDOWS: usize = 24;

/// Where a rule's `scale` reads the load level.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LevelSource {
    /// The level shedding computed for the request in its bulkhead (`normal` outside any).
    Proxy,
    /// The fleet level the counter service answered with the last sync, while fresh, read
    /// through the shedding thresholds (the default ones without shedding).
    Fleet,
}

impl LevelSource {
    pub fn name(self) -> &'static str {
        match self {
            LevelSource::Proxy => "proxy",
            LevelSource::Fleet => "fleet",
        }
    }
}

/// A rule's factors per load level, each in (0, 1].
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Scale {
    pub elevated: f64,
    pub high: f64,
    pub critical: f64,
    pub level: LevelSource,
}

impl Scale {
    /// The factor at `level`.
    pub fn factor(&self, level: Level) -> f64 {
        let f = match level {
            Level::Normal => 1.0,
            Level::Elevated => self.elevated,
            Level::High => self.high,
            Level::Critical => self.critical,
        };
        // Checked by the configuration; a factor is never above 1 nor NaN all the same.
        if f.is_nan() {
            1.0
        } else {
            f.clamp(f64::MIN_POSITIVE, 1.0)
        }
    }
}

/// One window of a schedule: from `start` to `end`, minutes of the UTC day (`end` before
/// `start`: the window crosses midnight), with its limits.
#[derive(Debug, Clone, PartialEq)]
pub struct Window {
    pub start_min: u16,
    pub end_min: u16,
    pub limits: Vec<Limit>,
}

impl Window {
    /// Whether minute `m` of the UTC day is in the window (its start in, its end out).
    pub fn holds(&self, m: u16) -> bool {
        if self.start_min < self.end_min {
            (self.start_min..self.end_min).contains(&m)
        } else {
            m >= self.start_min || m < self.end_min
        }
    }

    /// The window as configured, `"22:00-06:00"`.
    pub fn utc(&self) -> String {
        let hm = |m: u16| format!("{:02}:{:02}", m / 60, m % 60);
        format!("{}-{}", hm(self.start_min), hm(self.end_min))
    }
}

/// A rule's limits that follow load and time.
#[derive(Debug, Clone, PartialEq)]
pub struct Dynamic {
    pub scale: Option<Scale>,
    pub schedule: Vec<Window>,
}

/// The load levels the host knows at a request.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Load {
    /// Shedding's level of the request's bulkhead.
    pub proxy: Level,
    /// The fleet level, from the counter service's last fresh answer.
    pub fleet: Level,
}

/// The limits in force: at most [`MAX_LIMITS`], on the stack.
#[derive(Debug, Clone, Copy)]
pub struct InForce {
    limits: [Limit; MAX_LIMITS],
    len: usize,
}

impl InForce {
    pub fn as_slice(&self) -> &[Limit] {
        self.limits.get(..self.len).unwrap_or(&[])
    }
}

/// The minute of the UTC day at `now_us`.
pub fn minute_of_day(now_us: u64) -> u16 {
    ((now_us % DAY_US) / 60_000_000) as u16
}

impl Dynamic {
    /// The window in force at `now_us`, if any.
    pub fn window(&self, now_us: u64) -> Option<&Window> {
        let m = minute_of_day(now_us);
        self.schedule.iter().find(|w| w.holds(m))
    }

    /// The limits in force at `now_us` under `load`, in place of `configured` (the rule's own
    /// limits; a window whose layout no longer matches them, after a live override, is
    /// skipped). Never 0, never above the configured value.
    pub fn in_force(&self, configured: &[Limit], cost: u64, now_us: u64, load: Load) -> InForce {
        let base = match self.window(now_us) {
            Some(w) if same_layout(&w.limits, configured) => w.limits.as_slice(),
            _ => configured,
        };
        let factor = self.scale.map_or(1.0, |s| {
            s.factor(match s.level {
                LevelSource::Proxy => load.proxy,
                LevelSource::Fleet => load.fleet,
            })
        });
        let mut out = InForce {
            limits: [Limit::UNIT; MAX_LIMITS],
            len: 0,
        };
        for (slot, limit) in out.limits.iter_mut().zip(base) {
            *slot = if factor >= 1.0 {
                *limit
            } else {
                limit.scaled(factor, cost)
            };
            out.len += 1;
        }
        out
    }
}

/// Whether `a` may stand in for `b`: the same number of limits, each of the same algorithm and
/// period (a key's record reads the same).
pub fn same_layout(a: &[Limit], b: &[Limit]) -> bool {
    a.len() == b.len()
        && a.iter()
            .zip(b)
            .all(|(x, y)| x.algorithm() == y.algorithm() && x.period() == y.period())
}

/// Whether a limit's algorithm can follow load and time: its state is a count or a time that
/// reads the same under other `requests` and `burst` (not a sliding log's or concurrency's
/// slots, sized by `requests`, nor a leaky bucket's shaping).
pub fn follows(algorithm: Algorithm) -> bool {
    matches!(
        algorithm,
        Algorithm::TokenBucket
            | Algorithm::Gcra
            | Algorithm::FixedWindow
            | Algorithm::SlidingWindow
    )
}

/// A schedule window's `utc`, `"HH:MM-HH:MM"` (24-hour UTC): its start and end minutes, or why
/// not. A window of no length (`"06:00-06:00"`) is refused.
pub fn parse_utc(text: &str) -> Result<(u16, u16), String> {
    let shown: String = text.chars().take(40).collect();
    let bad = || format!("expected \"HH:MM-HH:MM\" in UTC, such as \"22:00-06:00\", got {shown:?}");
    let (a, b) = text.split_once('-').ok_or_else(bad)?;
    let minute = |hm: &str| -> Option<u16> {
        let (h, m) = hm.split_once(':')?;
        let two = |s: &str| -> Option<u16> {
            (s.len() == 2 && s.bytes().all(|c| c.is_ascii_digit()))
                .then(|| s.parse().ok())
                .flatten()
        };
        let (h, m) = (two(h)?, two(m)?);
        // 24:00 ends a window at midnight.
        (h < 24 && m < 60 || h == 24 && m == 0).then_some(h * 60 + m)
    };
    let start = minute(a).filter(|&m| m < 24 * 60).ok_or_else(bad)?;
    let end = minute(b).ok_or_else(bad)? % (24 * 60);
    if start == end {
        return Err(format!(
            "{shown:?} has no length: a window's start and end differ (the rule's own limits hold outside every window)"
        ));
    }
    Ok((start, end))
}

/// Whether two windows share a minute.
pub fn overlap(a: &Window, b: &Window) -> bool {
    // Each window is one or two plain ranges of the day.
    let ranges = |w: &Window| -> [(u16, u16); 2] {
        if w.start_min < w.end_min {
            [(w.start_min, w.end_min), (0, 0)]
        } else {
            [(w.start_min, 24 * 60), (0, w.end_min)]
        }
    };
    ranges(a).iter().any(|&(s1, e1)| {
        ranges(b)
            .iter()
            .any(|&(s2, e2)| s1 < e1 && s2 < e2 && s1 < e2 && s2 < e1)
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::limit::Period;

    const MIN: u64 = 60_000_000;
    /// 2023-11-14 00:00 UTC.
    const MIDNIGHT: u64 = 1_699_920_000_000_000;

    fn window(utc: &str, limits: Vec<Limit>) -> Window {
        let (start_min, end_min) = parse_utc(utc).unwrap();
        Window {
            start_min,
            end_min,
            limits,
        }
    }

    #[test]
    fn windows_parse_and_cross_midnight() {
        assert_eq!(parse_utc("22:00-06:00"), Ok((22 * 60, 6 * 60)));
        assert!(
            parse_utc("00:00-24:00").is_err(),
            "a whole day has no length either"
        );
        assert_eq!(parse_utc("09:30-24:00"), Ok((570, 0)));
        for bad in [
            "",
            "22:00",
            "22-06",
            "2:00-06:00",
            "22:00-06:0",
            "25:00-06:00",
            "22:60-06:00",
            "24:00-06:00",
            "22:00–06:00",
            " 22:00-06:00",
            "22:00-06:00-07:00",
            "+1:00-06:00",
            "06:00-06:00",
        ] {
            assert!(parse_utc(bad).is_err(), "{bad:?}");
        }
        let night = window("22:00-06:00", vec![]);
        for (m, held) in [
            (0, true),
            (359, true),
            (360, false),
            (1319, false),
            (1320, true),
        ] {
            assert_eq!(night.holds(m), held, "minute {m}");
        }
        assert_eq!(night.utc(), "22:00-06:00");
    }

    #[test]
    fn overlapping_windows_are_told_apart_from_adjacent_ones() {
        let w = |utc| window(utc, vec![]);
        assert!(overlap(&w("22:00-06:00"), &w("05:00-07:00")));
        assert!(overlap(&w("22:00-06:00"), &w("23:00-23:30")));
        assert!(overlap(&w("22:00-06:00"), &w("21:00-02:00")));
        assert!(!overlap(&w("22:00-06:00"), &w("06:00-22:00")));
        assert!(!overlap(&w("09:00-12:00"), &w("12:00-13:00")));
    }

    #[test]
    fn the_limits_in_force_follow_the_clock_and_the_level() {
        let day = Limit::new(100, Period::Minute, Some(50)).unwrap();
        let night = Limit::new(10, Period::Minute, Some(5)).unwrap();
        let dynamic = Dynamic {
            scale: Some(Scale {
                elevated: 1.0,
                high: 0.5,
                critical: 0.001,
                level: LevelSource::Fleet,
            }),
            schedule: vec![window("22:00-06:00", vec![night])],
        };
        let normal = Load::default();
        let high = Load {
            proxy: Level::Normal,
            fleet: Level::High,
        };
        let critical = Load {
            proxy: Level::Critical,
            fleet: Level::Critical,
        };
        let at = |h: u64, m: u64| MIDNIGHT + (h * 60 + m) * MIN;
        let got = |now, load, cost| dynamic.in_force(&[day], cost, now, load).as_slice()[0];
        assert_eq!(got(at(12, 0), normal, 1), day);
        assert_eq!(got(at(23, 59), normal, 1), night, "before midnight");
        assert_eq!(got(at(0, 0), normal, 1), night, "after midnight");
        assert_eq!(got(at(5, 59), normal, 1), night);
        assert_eq!(got(at(6, 0), normal, 1), day, "the end is out");
        let halved = got(at(12, 0), high, 1);
        assert_eq!((halved.requests(), halved.burst()), (50, 25));
        let proxy_only = Load {
            proxy: Level::Critical,
            fleet: Level::Normal,
        };
        assert_eq!(got(at(12, 0), proxy_only, 1), day, "the fleet level counts");
        // Never 0: a tiny factor rounds up to one request, and a burst to the cost.
        let floor = got(at(23, 0), critical, 1);
        assert_eq!((floor.requests(), floor.burst()), (1, 1));
        let costly = got(at(23, 0), critical, 4);
        assert_eq!((costly.requests(), costly.burst()), (1, 4));
        assert_eq!(got(at(23, 0), critical, 4).period(), Period::Minute);
    }

    #[test]
    fn a_window_whose_layout_an_override_changed_is_skipped() {
        let day = Limit::new(100, Period::Minute, None).unwrap();
        let night = Limit::new(10, Period::Minute, None).unwrap();
        let dynamic = Dynamic {
            scale: None,
            schedule: vec![window("00:00-12:00", vec![night])],
        };
        let overridden = Limit::new(7, Period::Second, None).unwrap();
        let got = dynamic.in_force(&[overridden], 1, MIDNIGHT, Load::default());
        assert_eq!(got.as_slice(), &[overridden]);
        let got = dynamic.in_force(&[day], 1, MIDNIGHT, Load::default());
        assert_eq!(got.as_slice(), &[night]);
    }

    #[test]
    fn a_factor_never_raises_a_limit() {
        let s = Scale {
            elevated: f64::NAN,
            high: 7.0,
            critical: -1.0,
            level: LevelSource::Proxy,
        };
        for level in [Level::Normal, Level::Elevated, Level::High, Level::Critical] {
            let f = s.factor(level);
            assert!(f > 0.0 && f <= 1.0, "{level:?}: {f}");
        }
    }
}
