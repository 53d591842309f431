//! Windows aligned to the UTC clock and calendar: a minute starts at :00, a day at 00:00 UTC, a
//! week on Monday 00:00 UTC, a month on the 1st 00:00 UTC. Time is microseconds since the
//! Unix epoch, which began on a Thursday at 00:00 UTC.

use crate::limit::Period;

const DAY_US: u64 = 86_400_000_000;

/// The start of the window of `period` that holds `now_us`.
pub fn start_us(period: Period, now_us: u64) -> u64 {
    match period {
        Period::Week => {
            let days = now_us / DAY_US;
            // Day 0 was a Thursday: Monday is 3 days later in the week's count.
            let since_monday = (days + 3) % 7;
            days.saturating_sub(since_monday) * DAY_US
        }
        Period::Month => {
            let (year, month, _) = civil_from_days(now_us / DAY_US);
            days_from_civil(year, month, 1) * DAY_US
        }
        _ => {
            let length = period.micros();
            now_us - now_us % length
        }
    }
}

/// The end (exclusive) of the window of `period` that holds `now_us`: the next one's start.
pub fn end_us(period: Period, now_us: u64) -> u64 {
    match period {
        Period::Week => start_us(period, now_us) + 7 * DAY_US,
        Period::Month => {
            let (year, month, _) = civil_from_days(now_us / DAY_US);
            let (year, month) = if month == 12 {
                (year + 1, 1)
            } else {
                (year, month + 1)
            };
            days_from_civil(year, month, 1) * DAY_US
        }
        _ => start_us(period, now_us) + period.micros(),
    }
}

/// Days since 1970-01-01 of a proleptic Gregorian date (H. Hinnant's algorithm), for dates
/// from 1970 on.
fn days_from_civil(year: u64, month: u64, day: u64) -> u64 {
    let year = if month <= 2 { year - 1 } else { year };
    let era = year / 400;
    let yoe = year - era * 400;
    let mp = (month + 9) % 12;
    let doy = (153 * mp + 2) / 5 + day - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    (era * 146_097 + doe).saturating_sub(719_468)
}

/// The date of a day since 1970-01-01: (year, month 1..=12, day 1..=31).
fn civil_from_days(days: u64) -> (u64, u64, u64) {
    let z = days + 719_468;
    let era = z / 146_097;
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1_460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + (month <= 2) as u64;
    (year, month, day)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// 2026-11-30 (a Monday) 13:45:10.5 UTC.
    const T: u64 = 1_796_046_310_500_000;

    #[test]
    fn windows_follow_the_clock_and_the_calendar() {
        assert_eq!(start_us(Period::Second, T), 1_796_046_310_000_000);
        assert_eq!(start_us(Period::Minute, T), 1_796_046_300_000_000);
        assert_eq!(start_us(Period::Hour, T), 1_796_043_600_000_000);
        // 2026-11-30 00:00 UTC.
        let midnight = 1_795_996_800_000_000;
        assert_eq!(start_us(Period::Day, T), midnight);
        assert_eq!(end_us(Period::Day, T), midnight + DAY_US);
        // A Monday: its own week starts at its midnight.
        assert_eq!(start_us(Period::Week, T), midnight);
        assert_eq!(end_us(Period::Week, T), midnight + 7 * DAY_US);
        // November 2026 began 29 days earlier; December has 31 days.
        assert_eq!(start_us(Period::Month, T), midnight - 29 * DAY_US);
        assert_eq!(end_us(Period::Month, T), midnight + DAY_US);
        let december = end_us(Period::Month, T);
        assert_eq!(end_us(Period::Month, december), december + 31 * DAY_US);
        // 1970-01-01 was a Thursday: the first Monday is day 4.
        assert_eq!(start_us(Period::Week, 4 * DAY_US + 1), 4 * DAY_US);
        assert_eq!(start_us(Period::Week, 11 * DAY_US - 1), 4 * DAY_US);
    }

    #[test]
    fn leap_years_and_year_ends() {
        // 2028-02-01 .. 2028-03-01 is 29 days; 2027-12 runs into 2028-01-01.
        let feb_2028 = days_from_civil(2028, 2, 1) * DAY_US;
        assert_eq!(end_us(Period::Month, feb_2028 + 5), feb_2028 + 29 * DAY_US);
        let dec_2027 = days_from_civil(2027, 12, 31) * DAY_US;
        assert_eq!(
            end_us(Period::Month, dec_2027),
            days_from_civil(2028, 1, 1) * DAY_US
        );
        for days in [0, 59, 365, 10_956, 20_000, 24_000] {
            let (y, m, d) = civil_from_days(days);
            assert_eq!(days_from_civil(y, m, d), days);
        }
        assert_eq!(civil_from_days(0), (1970, 1, 1));
    }
}
