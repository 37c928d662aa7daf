//! Reads which functions a program ran from callgrind's output file (`callgrind.out.<pid>`).
//!
//! Callgrind names every function that executed at least one instruction in a `fn=` line, and
//! every callee in a `cfn=` line. With string compression (its default) a name is written once
//! as `fn=(12) name` and then only as `fn=(12)`; without it, `fn=name` every time. Recursion
//! levels are written as `name'2`. Functions without a symbol are written as their address
//! (`0x0000000000401000`), and the frame below `main` as `(below main)`; neither can be ordered.

use std::collections::HashSet;

/// The names of the functions in a callgrind output, each once, in the order they first appear.
pub fn functions_run(text: &str) -> Vec<String> {
    let mut seen = HashSet::new();
    let mut names = Vec::new();
    for line in text.lines() {
        let Some(rest) = line
            .strip_prefix("fn=")
            .or_else(|| line.strip_prefix("cfn="))
        else {
            continue;
        };
        let Some(name) = name_of(rest) else {
            continue;
        };
        if seen.insert(name.to_owned()) {
            names.push(name.to_owned());
        }
    }
    names
}

/// The symbol name in what follows `fn=`: without the compression id, the recursion level and
/// anything that is not a symbol.
fn name_of(spec: &str) -> Option<&str> {
    let name = match spec.strip_prefix('(') {
        // `(12) name` defines id 12; `(12)` alone refers to a name given before.
        Some(compressed) => compressed.split_once(')')?.1.trim(),
        None => spec.trim(),
    };
    let name = match name.rsplit_once('\'') {
        Some((base, level)) if !level.is_empty() && level.bytes().all(|b| b.is_ascii_digit()) => {
            base
        }
        _ => name,
    };
    let is_symbol = !name.is_empty()
        && !name.starts_with("0x")
        && !name.starts_with('(')
        && !name.contains(char::is_whitespace);
    is_symbol.then_some(name)
}

#[cfg(test)]
mod tests {
    use super::*;

    // The shape of a real file (callgrind 3.19, `--demangle=no`), cut down.
    const OUTPUT: &str = "\
# callgrind format
version: 1
creator: callgrind-3.19.0
pid: 5412
cmd:  /tmp/devplug run --config c.yaml
part: 1

positions: line
events: Ir
summary: 6196411

ob=(1) /tmp/devplug
fl=(1) ???
fn=(1) _ZN7devplug4main17h0123456789abcdefE
0 12
cfl=(1)
cfn=(2) _ZN5tokio7runtime5block17hfedcba9876543210E
calls=1 0
0 400
fn=(2)
0 380
cfn=(3) __syscall_cp'2
calls=2 0
0 20
fn=(3)
0 20
fn=(4) 0x0000000000327f9a
0 3
fn=(5) (below main)
0 1
fn=(1)
0 2
";

    #[test]
    fn every_named_function_once_in_first_seen_order() {
        assert_eq!(
            functions_run(OUTPUT),
            [
                "_ZN7devplug4main17h0123456789abcdefE",
                "_ZN5tokio7runtime5block17hfedcba9876543210E",
                "__syscall_cp",
            ]
        );
    }

    #[test]
    fn uncompressed_names_are_read_too() {
        let text = "fn=malloc\ncfn=memcpy\nfn=malloc\ncfn=free'3\n";
        assert_eq!(functions_run(text), ["malloc", "memcpy", "free"]);
    }

    #[test]
    fn a_quote_that_is_not_a_recursion_level_stays() {
        assert_eq!(name_of("(1) a'b"), Some("a'b"));
        assert_eq!(name_of("(1) a'"), Some("a'"));
        assert_eq!(name_of("(7)"), None);
        assert_eq!(name_of(""), None);
    }
}
