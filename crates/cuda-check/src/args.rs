//! The command line: `cuda-check [--elements N] [--device I] [--mem-bytes N]`.

/// What to run.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Args {
    /// How many floats the kernel works on (default 1 Mi).
    pub elements: u32,
    /// The CUDA device ordinal (default 0).
    pub device: i32,
    /// After the check, try to allocate this many bytes and say whether it was refused.
    pub mem_bytes: Option<u64>,
}

/// The usage text.
pub const USAGE: &str = "usage: cuda-check [--elements N] [--device I] [--mem-bytes N]
  --elements N   floats the kernel works on (default 1048576, at most 16777216)
  --device I     the CUDA device ordinal (default 0)
  --mem-bytes N  then allocate N bytes (suffixes Ki, Mi, Gi, K, M, G) and say whether the
                 driver refused (e.g. beyond an MPS memory limit)
exit codes: 0 ok; 2 bad arguments; 3 no GPU here (libcuda.so.1 cannot be loaded, or the
driver reports no device); 4 a wrong result; 5 a CUDA call failed; 6 the --mem-bytes
allocation was refused (everything else ok)";

/// The most elements: indices stay exact in `f32` (2^24).
pub const MAX_ELEMENTS: u32 = 1 << 24;

impl Default for Args {
    fn default() -> Self {
        Args {
            elements: 1 << 20,
            device: 0,
            mem_bytes: None,
        }
    }
}

/// A byte count: digits with an optional binary (`Ki`, `Mi`, `Gi`) or decimal (`K`, `M`, `G`)
/// suffix.
pub fn bytes(text: &str) -> Result<u64, String> {
    let split = text
        .find(|c: char| !c.is_ascii_digit())
        .unwrap_or(text.len());
    let (digits, suffix) = text.split_at(split);
    let n: u64 = digits
        .parse()
        .map_err(|_| format!("{text:?} is not a byte count"))?;
    let unit: u64 = match suffix {
        "" => 1,
        "K" => 1_000,
        "M" => 1_000_000,
        "G" => 1_000_000_000,
        "Ki" => 1 << 10,
        "Mi" => 1 << 20,
        "Gi" => 1 << 30,
        _ => return Err(format!("{text:?}: unknown suffix {suffix:?}")),
    };
    n.checked_mul(unit)
        .ok_or_else(|| format!("{text:?} is too large"))
}

/// Parses the arguments (without the program name). `Ok(None)`: help was asked for.
pub fn parse<I: IntoIterator<Item = String>>(args: I) -> Result<Option<Args>, String> {
    let mut out = Args::default();
    let mut args = args.into_iter();
    while let Some(arg) = args.next() {
        let (flag, inline) = match arg.split_once('=') {
            Some((f, v)) if f.starts_with("--") => (f.to_owned(), Some(v.to_owned())),
            _ => (arg.clone(), None),
        };
        if flag == "-h" || flag == "--help" {
            return Ok(None);
        }
        let mut value = || {
            inline
                .clone()
                .or_else(|| args.next())
                .ok_or_else(|| format!("{flag} needs a value"))
        };
        match flag.as_str() {
            "--elements" => {
                let v = value()?;
                let n: u32 = v
                    .parse()
                    .map_err(|_| format!("--elements {v:?} is not a count"))?;
                if n == 0 || n > MAX_ELEMENTS {
                    return Err(format!("--elements must be 1..={MAX_ELEMENTS}, not {n}"));
                }
                out.elements = n;
            }
            "--device" => {
                let v = value()?;
                out.device = v
                    .parse()
                    .ok()
                    .filter(|d: &i32| *d >= 0)
                    .ok_or_else(|| format!("--device {v:?} is not a device ordinal"))?;
            }
            "--mem-bytes" => out.mem_bytes = Some(bytes(&value()?)?),
            _ => return Err(format!("unknown argument {arg:?}")),
        }
    }
    Ok(Some(out))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(list: &[&str]) -> Result<Option<Args>, String> {
        parse(list.iter().map(|s| s.to_string()))
    }

    #[test]
    fn no_arguments_is_the_default_check() {
        assert_eq!(args(&[]), Ok(Some(Args::default())));
        assert_eq!(Args::default().elements, 1_048_576);
    }

    #[test]
    fn each_option_takes_its_value_separately_or_after_an_equals_sign() {
        let want = Args {
            elements: 1000,
            device: 1,
            mem_bytes: Some(3 << 30),
        };
        assert_eq!(
            args(&["--elements", "1000", "--device", "1", "--mem-bytes", "3Gi"]),
            Ok(Some(want.clone()))
        );
        assert_eq!(
            args(&["--elements=1000", "--device=1", "--mem-bytes=3221225472"]),
            Ok(Some(want))
        );
        assert_eq!(args(&["--help"]), Ok(None));
        assert_eq!(args(&["--elements", "5", "-h"]), Ok(None));
    }

    #[test]
    fn byte_counts_take_binary_and_decimal_suffixes() {
        assert_eq!(bytes("0"), Ok(0));
        assert_eq!(bytes("512Mi"), Ok(512 << 20));
        assert_eq!(bytes("2G"), Ok(2_000_000_000));
        assert_eq!(bytes("4Ki"), Ok(4096));
        assert!(bytes("").is_err());
        assert!(bytes("Gi").is_err());
        assert!(bytes("1Ti").is_err());
        assert!(bytes("-1").is_err());
        assert!(bytes("99999999999999999999").is_err());
        assert!(bytes("18446744073709551615Gi").is_err());
    }

    #[test]
    fn bad_arguments_say_what_is_wrong() {
        for (list, says) in [
            (&["--elements"][..], "needs a value"),
            (&["--elements", "0"], "1..="),
            (&["--elements", "16777217"], "1..="),
            (&["--elements", "many"], "not a count"),
            (&["--device", "-1"], "not a device ordinal"),
            (&["--mem-bytes", "lots"], "not a byte count"),
            (&["--frobnicate"], "unknown argument"),
            (&["extra"], "unknown argument"),
        ] {
            let err = args(list).unwrap_err();
            assert!(err.contains(says), "{list:?}: {err}");
        }
    }
}
