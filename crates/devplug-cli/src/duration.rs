//! Durations in the config file: a number and a unit, `500ms`, `5s`, `2m`, `1h` (or `0`).
//! Parsing never overflows (huge values saturate); each field's allowed range is checked at
//! validation, where the message can name the field.

use serde::{Deserialize, Deserializer};
use std::time::Duration;

/// The units, for messages.
const UNITS_HINT: &str = "write e.g. 500ms, 5s, 2m or 1h";

/// Parses `500ms`, `5s`, `2m`, `1h`, `0`. A number too large for a [`Duration`] saturates to
/// [`Duration::MAX`]; range checks belong to the caller.
pub fn parse(text: &str) -> Result<Duration, String> {
    let text = text.trim();
    if text == "0" {
        return Ok(Duration::ZERO);
    }
    let split = text
        .find(|c: char| !c.is_ascii_digit())
        .unwrap_or(text.len());
    let (number, unit) = text.split_at(split);
    if number.is_empty() {
        return Err(format!("{text:?} is not a duration; {UNITS_HINT}"));
    }
    // All digits: the only failure left is a number over u64::MAX, which saturates.
    let value: u64 = number.parse().unwrap_or(u64::MAX);
    let seconds = |per_unit: u64| Duration::from_secs(value.saturating_mul(per_unit));
    match unit {
        "ms" => Ok(Duration::from_millis(value)),
        "s" => Ok(seconds(1)),
        "m" => Ok(seconds(60)),
        "h" => Ok(seconds(3600)),
        _ => Err(format!("{text:?} has no known unit; {UNITS_HINT}")),
    }
}

/// Writes `d` as the config file would, in the largest unit that keeps it exact.
pub fn format(d: Duration) -> String {
    let millis = d.as_millis();
    if millis == 0 {
        return "0s".into();
    }
    if !d.subsec_nanos().is_multiple_of(1_000_000) {
        return format!("{d:?}");
    }
    for (unit, per) in [("h", 3_600_000), ("m", 60_000), ("s", 1_000)] {
        if millis.is_multiple_of(per) {
            return format!("{}{unit}", millis / per);
        }
    }
    format!("{millis}ms")
}

/// Checks that the duration of `field` lies in `range`, naming the field and the range.
pub fn check_range(
    field: &str,
    value: Duration,
    range: std::ops::RangeInclusive<Duration>,
) -> Result<(), String> {
    if range.contains(&value) {
        Ok(())
    } else {
        Err(format!(
            "{field}: must be between {} and {}, got {}",
            format(*range.start()),
            format(*range.end()),
            format(value)
        ))
    }
}

/// serde helper for an optional duration field.
pub fn deserialize_opt<'de, D: Deserializer<'de>>(d: D) -> Result<Option<Duration>, D::Error> {
    let text = Option::<String>::deserialize(d)?;
    text.map(|t| parse(&t).map_err(serde::de::Error::custom))
        .transpose()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn units() {
        assert_eq!(parse("500ms"), Ok(Duration::from_millis(500)));
        assert_eq!(parse("5s"), Ok(Duration::from_secs(5)));
        assert_eq!(parse("2m"), Ok(Duration::from_secs(120)));
        assert_eq!(parse("1h"), Ok(Duration::from_secs(3600)));
        assert_eq!(parse("0"), Ok(Duration::ZERO));
        assert!(parse("5").unwrap_err().contains("no known unit"));
        assert!(parse("fast").unwrap_err().contains("not a duration"));
        assert!(parse("h").unwrap_err().contains("not a duration"));
        assert!(parse("-5s").unwrap_err().contains("not a duration"));
    }

    #[test]
    fn huge_values_saturate_instead_of_failing_or_wrapping() {
        assert_eq!(
            parse("18446744073709551615s"),
            Ok(Duration::from_secs(u64::MAX))
        );
        assert_eq!(
            parse("300000000000000000m"),
            Ok(Duration::from_secs(18_000_000_000_000_000_000))
        );
        assert_eq!(
            parse("300000000000000000h"),
            Ok(Duration::from_secs(u64::MAX))
        );
        assert_eq!(
            parse("99999999999999999999999h"),
            Ok(Duration::from_secs(u64::MAX))
        );
    }

    #[test]
    fn format_and_range_messages() {
        assert_eq!(format(Duration::ZERO), "0s");
        assert_eq!(format(Duration::from_secs(3600)), "1h");
        assert_eq!(format(Duration::from_secs(90)), "90s");
        assert_eq!(format(Duration::from_millis(1500)), "1500ms");
        let range = Duration::ZERO..=Duration::from_secs(3600);
        assert_eq!(
            check_range("f", Duration::from_secs(3600), range.clone()),
            Ok(())
        );
        assert_eq!(
            check_range("f", Duration::from_secs(3601), range),
            Err("f: must be between 0s and 1h, got 3601s".into())
        );
    }
}
