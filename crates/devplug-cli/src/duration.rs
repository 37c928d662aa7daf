//! Durations in the config file: a number and a unit, `500ms`, `5s`, `2m` (or `0`).

use serde::{Deserialize, Deserializer};
use std::time::Duration;

/// Parses `500ms`, `5s`, `2m`, `0`.
pub fn parse(text: &str) -> Result<Duration, String> {
    let text = text.trim();
    if text == "0" {
        return Ok(Duration::ZERO);
    }
    let split = text
        .find(|c: char| !c.is_ascii_digit())
        .unwrap_or(text.len());
    let (number, unit) = text.split_at(split);
    let value: u64 = number
        .parse()
        .map_err(|_| format!("{text:?} is not a duration; write e.g. 500ms, 5s or 2m"))?;
    match unit {
        "ms" => Ok(Duration::from_millis(value)),
        "s" => Ok(Duration::from_secs(value)),
        "m" => Ok(Duration::from_secs(value.saturating_mul(60))),
        _ => Err(format!(
            "{text:?} has no known unit; write e.g. 500ms, 5s or 2m"
        )),
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
        assert_eq!(parse("0"), Ok(Duration::ZERO));
        assert!(parse("5").unwrap_err().contains("no known unit"));
        assert!(parse("fast").unwrap_err().contains("not a duration"));
    }
}
