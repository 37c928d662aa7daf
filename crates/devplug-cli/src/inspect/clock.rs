//! UTC timestamps for `devplug inspect --watch`, in RFC 3339 form with milliseconds
//! (`2026-05-09T07:31:05.123Z`), computed from `SystemTime` without a date-time crate.

use std::time::{SystemTime, UNIX_EPOCH};

/// The current time, formatted.
pub fn now() -> String {
    // A clock before 1970 is a broken clock; show the epoch rather than fail.
    let since = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap_or_default();
    format_utc(since.as_secs(), since.subsec_millis())
}

/// Formats `secs` since the Unix epoch (plus `millis`) as an RFC 3339 UTC timestamp.
pub fn format_utc(secs: u64, millis: u32) -> String {
    let days = secs / 86_400;
    let rest = secs % 86_400;
    let (year, month, day) = civil_from_days(days);
    format!(
        "{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}.{millis:03}Z",
        rest / 3600,
        rest % 3600 / 60,
        rest % 60
    )
}

/// The proleptic Gregorian date `days` after 1970-01-01.
///
/// Works in 400-year eras (146,097 days each) counted from 0000-03-01, so that the leap day is
/// the last day of each shifted year; then maps the March-based year back to January.
fn civil_from_days(days: u64) -> (u64, u32, u32) {
    // Days from 0000-03-01 to 1970-01-01.
    const EPOCH_SHIFT: u64 = 719_468;
    let z = days + EPOCH_SHIFT;
    let era = z / 146_097;
    let day_of_era = z % 146_097;
    let year_of_era =
        (day_of_era - day_of_era / 1460 + day_of_era / 36_524 - day_of_era / 146_096) / 365;
    let day_of_year = day_of_era - (365 * year_of_era + year_of_era / 4 - year_of_era / 100);
    // Months counted from March = 0; each five-month block is 153 days.
    let shifted_month = (5 * day_of_year + 2) / 153;
    let day = day_of_year - (153 * shifted_month + 2) / 5 + 1;
    let month = if shifted_month < 10 {
        shifted_month + 3
    } else {
        shifted_month - 9
    };
    let year = year_of_era + era * 400 + u64::from(month <= 2);
    // Both are small (1..=31, 1..=12), so the conversions cannot fail.
    (
        year,
        u32::try_from(month).unwrap_or(0),
        u32::try_from(day).unwrap_or(0),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn known_instants() {
        assert_eq!(format_utc(0, 0), "1970-01-01T00:00:00.000Z");
        assert_eq!(format_utc(951_782_400, 7), "2000-02-29T00:00:00.007Z");
        assert_eq!(format_utc(951_868_799, 999), "2000-02-29T23:59:59.999Z");
        assert_eq!(format_utc(1_700_000_000, 0), "2023-11-14T22:13:20.000Z");
        assert_eq!(format_utc(4_107_542_400, 0), "2100-03-01T00:00:00.000Z");
        assert_eq!(format_utc(1_709_164_800, 0), "2024-02-29T00:00:00.000Z");
        assert_eq!(format_utc(1_735_689_599, 0), "2024-12-31T23:59:59.000Z");
    }

    #[test]
    fn every_day_follows_the_previous_one() {
        // Walk 1970..2200 day by day and check the calendar never skips or repeats.
        let mut previous = civil_from_days(0);
        for days in 1..84_000 {
            let (y, m, d) = civil_from_days(days);
            let (py, pm, pd) = previous;
            let next_day = y == py && m == pm && d == pd + 1;
            let next_month = y == py && m == pm + 1 && d == 1 && pd >= 28;
            let next_year = y == py + 1 && m == 1 && d == 1 && pm == 12 && pd == 31;
            assert!(
                next_day || next_month || next_year,
                "{previous:?} -> {:?}",
                (y, m, d)
            );
            previous = (y, m, d);
        }
    }
}
