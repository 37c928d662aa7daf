//! Kubernetes quantities of whole numbers (`16Gi`, `80G`, `1e3`), as device capacities and
//! config values are written: read in every integer form the API server takes, and written in
//! the canonical form it writes back, so a value read back compares equal.

/// `value` as the API server writes it back (a DecimalSI quantity in canonical form: trailing
/// zeros folded into k, M, G, T, P or E).
pub fn canonical_quantity(value: u64) -> String {
    const SUFFIXES: [&str; 6] = ["k", "M", "G", "T", "P", "E"];
    if value == 0 {
        return "0".to_owned();
    }
    let mut mantissa = value;
    let mut thousands = 0usize;
    while mantissa.is_multiple_of(1000) && thousands < SUFFIXES.len() {
        mantissa /= 1000;
        thousands = thousands.saturating_add(1);
    }
    match thousands.checked_sub(1).and_then(|i| SUFFIXES.get(i)) {
        Some(suffix) => format!("{mantissa}{suffix}"),
        None => mantissa.to_string(),
    }
}

/// The value of an integer quantity in the forms the API server writes (`123`, `5k`, `16Gi`,
/// `1e3`); `None` for anything else (fractions, negative values), which then compares as
/// different and is written again.
pub fn parse_quantity(q: &str) -> Option<u64> {
    let digits = q.bytes().take_while(u8::is_ascii_digit).count();
    let (number, suffix) = q.split_at(digits);
    let number: u64 = number.parse().ok()?;
    let factor: u64 = match suffix {
        "" => 1,
        "k" => 1_000,
        "M" => 1_000_000,
        "G" => 1_000_000_000,
        "T" => 1_000_000_000_000,
        "P" => 1_000_000_000_000_000,
        "E" => 1_000_000_000_000_000_000,
        "Ki" => 1 << 10,
        "Mi" => 1 << 20,
        "Gi" => 1 << 30,
        "Ti" => 1 << 40,
        "Pi" => 1 << 50,
        "Ei" => 1 << 60,
        _ => {
            let exp: u32 = suffix
                .strip_prefix('e')
                .or_else(|| suffix.strip_prefix('E'))?
                .parse()
                .ok()?;
            10u64.checked_pow(exp)?
        }
    };
    number.checked_mul(factor)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quantities_are_written_as_the_api_server_writes_them_back() {
        assert_eq!(canonical_quantity(0), "0");
        assert_eq!(canonical_quantity(1000), "1k");
        assert_eq!(canonical_quantity(80_000_000_000), "80G");
        assert_eq!(canonical_quantity(1_500_000), "1500k");
        assert_eq!(canonical_quantity(17_179_869_184), "17179869184");
        assert_eq!(canonical_quantity(7_000_000_000_000_000_000), "7E");
        for v in [0, 1, 999, 1000, 17_179_869_184, 80_000_000_000, 1 << 62] {
            assert_eq!(parse_quantity(&canonical_quantity(v)), Some(v));
        }
        assert_eq!(parse_quantity("16Gi"), Some(16 << 30));
        assert_eq!(parse_quantity("2e3"), Some(2000));
        assert_eq!(parse_quantity("1.5"), None);
        assert_eq!(parse_quantity("-1"), None);
        assert_eq!(parse_quantity("99E"), None, "overflow");
    }
}
