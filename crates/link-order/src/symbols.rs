//! The functions of a linked binary, from its symbol table (`nm -S --defined-only`), and where an
//! ordering put them.
//!
//! `nm` comes with binutils, which linking with `cc` needs anyway; the binary must still have its
//! symbol table (built with `-C strip=none`, stripped afterwards).

use anyhow::{bail, Context};
use std::collections::HashMap;
use std::path::Path;
use std::process::Command;

/// One function symbol: its name (mangled, as the linker sees it), address and size in bytes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Function {
    /// The symbol's name, mangled.
    pub name: String,
    /// Its address in the binary.
    pub address: u64,
    /// Its size in bytes.
    pub size: u64,
}

/// The function symbols of `binary`, by running `nm -S --defined-only` on it.
pub fn read(binary: &Path) -> anyhow::Result<Vec<Function>> {
    let output = Command::new("nm")
        .args(["-S", "--defined-only"])
        .arg(binary)
        .output()
        .context("running nm (binutils) to read the binary's symbols")?;
    if !output.status.success() {
        bail!(
            "nm {} failed: {}",
            binary.display(),
            String::from_utf8_lossy(&output.stderr).trim()
        );
    }
    let functions = parse_nm(&String::from_utf8_lossy(&output.stdout));
    if functions.is_empty() {
        bail!(
            "{} has no function symbols: build it with `-C strip=none` (and strip it afterwards)",
            binary.display()
        );
    }
    Ok(functions)
}

/// Function symbols in `nm -S` output (`address size type name`): code types `t`, `T`, `W`
/// (weak, as musl's `malloc`), with a size.
pub fn parse_nm(text: &str) -> Vec<Function> {
    text.lines()
        .filter_map(|line| {
            let mut fields = line.split_whitespace();
            let address = u64::from_str_radix(fields.next()?, 16).ok()?;
            let size = u64::from_str_radix(fields.next()?, 16).ok()?;
            let kind = fields.next()?;
            let name = fields.next()?;
            (matches!(kind, "t" | "T" | "W") && size > 0).then(|| Function {
                name: name.to_owned(),
                address,
                size,
            })
        })
        .collect()
}

/// The functions named in `run` that `table` holds, each once, in address order: the ordering
/// file's content. Address order keeps the compiler's own neighbourhoods (a function next to
/// what it calls) inside the packed block.
pub fn order<'t>(run: &[String], table: &'t [Function]) -> Vec<&'t Function> {
    let by_name: HashMap<&str, &Function> = table.iter().map(|f| (f.name.as_str(), f)).collect();
    let mut picked: Vec<&Function> = run
        .iter()
        .filter_map(|name| by_name.get(name.as_str()).copied())
        .collect();
    picked.sort_by_key(|f| (f.address, f.name.clone()));
    picked.dedup_by(|a, b| a.name == b.name);
    picked
}

/// Where the functions of an ordering file ended up in a binary linked with it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Layout {
    /// Names in the ordering file.
    pub listed: usize,
    /// Of those, names the binary has.
    pub found: usize,
    /// Their total size in bytes.
    pub bytes: u64,
    /// From the lowest start to the highest end among them, in bytes.
    pub span: u64,
    /// All function code in the binary, in bytes.
    pub all_bytes: u64,
}

impl Layout {
    /// Whether the ordering took: nearly every listed function is in the binary, packed into a
    /// block hardly bigger than their sizes (alignment padding, and 64 KiB of slack: the
    /// kernel's fault-around window).
    pub fn is_packed(&self) -> bool {
        let found_enough = self.found.saturating_mul(100) >= self.listed.saturating_mul(95);
        let slack = self.bytes / 8 + 64 * 1024;
        found_enough && self.found > 0 && self.span <= self.bytes.saturating_add(slack)
    }
}

/// The layout of the functions named in `listed` within `table`.
pub fn layout(listed: &[String], table: &[Function]) -> Layout {
    let picked = order(listed, table);
    let start = picked.iter().map(|f| f.address).min().unwrap_or(0);
    let end = picked
        .iter()
        .map(|f| f.address.saturating_add(f.size))
        .max()
        .unwrap_or(0);
    Layout {
        listed: listed.len(),
        found: picked.len(),
        bytes: picked.iter().map(|f| f.size).sum(),
        span: end.saturating_sub(start),
        all_bytes: table.iter().map(|f| f.size).sum(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const NM: &str = "\
00000000004016c0 0000000000000008 V DW.ref.rust_eh_personality
00000000003d9d50 r GCC_except_table1107
0000000000001040 0000000000000100 t _ZN4cold17h0000000000000001E
0000000000001140 0000000000000040 T _ZN3hot17h0000000000000002E
0000000000001180 0000000000000020 W malloc
00000000000011a0 0000000000000000 t zero_sized
                 U undefined_here
";

    fn names(list: &[&str]) -> Vec<String> {
        list.iter().map(|s| (*s).to_owned()).collect()
    }

    #[test]
    fn functions_only_with_their_sizes() {
        let table = parse_nm(NM);
        assert_eq!(
            table.iter().map(|f| f.name.as_str()).collect::<Vec<_>>(),
            [
                "_ZN4cold17h0000000000000001E",
                "_ZN3hot17h0000000000000002E",
                "malloc"
            ]
        );
        assert_eq!(table[1].address, 0x1140);
        assert_eq!(table[1].size, 0x40);
    }

    #[test]
    fn the_order_keeps_known_names_once_in_address_order() {
        let table = parse_nm(NM);
        let run = names(&[
            "malloc",
            "not_in_binary",
            "_ZN3hot17h0000000000000002E",
            "malloc",
        ]);
        let picked: Vec<&str> = order(&run, &table)
            .iter()
            .map(|f| f.name.as_str())
            .collect();
        assert_eq!(picked, ["_ZN3hot17h0000000000000002E", "malloc"]);
    }

    #[test]
    fn a_packed_layout_passes_and_a_scattered_one_does_not() {
        let f = |name: &str, address: u64, size: u64| Function {
            name: name.to_owned(),
            address,
            size,
        };
        let listed = names(&["a", "b"]);
        let packed = [
            f("a", 0x1000, 0x8000),
            f("b", 0x9000, 0x8000),
            f("c", 0x20_0000, 0x10),
        ];
        let got = layout(&listed, &packed);
        assert_eq!((got.found, got.bytes, got.span), (2, 0x10000, 0x10000));
        assert!(got.is_packed());
        // The same two functions 1 MiB apart: the ordering did not take.
        let scattered = [f("a", 0x1000, 0x8000), f("b", 0x10_1000, 0x8000)];
        assert!(!layout(&listed, &scattered).is_packed());
        // Most listed names missing (another build's symbols): not packed either.
        let other_build = names(&["a", "x", "y", "z"]);
        assert!(!layout(&other_build, &packed).is_packed());
        assert!(!layout(&[], &packed).is_packed());
    }
}
