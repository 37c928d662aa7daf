//! The repository stands on its own: no tracked file outside `.ci/` points at the developers'
//! folder beside the checkout, at the project tracker's issue numbers or at the documents the
//! project started from. A user has none of these; docs and comments cite the kubelet's source
//! or this repository's own docs. (`.ci/` may: CI runs beside that folder.)
#![allow(clippy::unwrap_used, clippy::expect_used)] // a panic in a test is a failed test

use deploy_check::repo_root;
use std::process::Command;

/// This file: it spells the patterns out.
const SELF: &str = "crates/deploy-check/tests/repository.rs";

/// Why `line` points outside the repository, if it does.
fn outside_reference(line: &str) -> Option<&'static str> {
    let lower = line.to_ascii_lowercase();
    let folder = ["..", "/shared"].concat();
    if lower.contains(&folder) {
        return Some("the developers' folder beside the checkout");
    }
    for doc in ["design", "reliability", "peers", "protocol"] {
        if lower.contains(&format!("{doc}.md")) || lower.contains(&format!("{doc} §")) {
            return Some("an internal design note");
        }
    }
    if lower.contains(&["seeds", "/"].concat()) {
        return Some("a seed document");
    }
    let bytes = lower.as_bytes();
    for (word, why) in [
        ("issue", "a tracker issue number"),
        ("seed", "a seed document"),
    ] {
        let mut from = 0;
        while let Some(at) = lower[from..].find(word) {
            let start = from + at;
            from = start + word.len();
            // A word of its own: "issue", not "tissue".
            if start > 0 && bytes[start - 1].is_ascii_alphanumeric() {
                continue;
            }
            let mut rest = &lower[from..];
            rest = rest.strip_prefix('s').unwrap_or(rest);
            rest = rest.strip_prefix([' ', '-', '_']).unwrap_or(rest);
            rest = rest.strip_prefix('#').unwrap_or(rest);
            if rest.starts_with(|c: char| c.is_ascii_digit()) {
                return Some(why);
            }
        }
    }
    None
}

#[test]
fn the_patterns_catch_what_they_should_and_spare_external_references() {
    // Written with a '¦' inside the word, taken out here: this file must pass its own check.
    let unsplit = |text: &str| text.replace('¦', "");
    for caught in [
        "see ..¦/shared/k8s/README.md",
        "(iss¦ue 8, item 15)",
        "iss¦ues 8, 9 and 10 merged",
        "Iss¦ue #12",
        "se¦ed 003",
        "the Se¦eds/ folder",
        "DES¦IGN §7's goal",
        "reliabil¦ity.md §5",
        "[figures](docs/benchmarks.md#link-order-iss¦ue-8-item-15)",
    ]
    .map(unsplit)
    {
        assert!(outside_reference(&caught).is_some(), "{caught}");
    }
    for spared in [
        "kubernetes#52510",
        "NVIDIA/k8s-device-plugin#1974",
        "https://github.com/kubernetes/kubernetes/iss¦ues/52510",
        "let mut se¦ed = 0x2545_f491;",
        "issued 3 certificates",
        "tissue 4",
        "docs/gpus.md",
    ]
    .map(unsplit)
    {
        assert_eq!(outside_reference(&spared), None, "{spared}");
    }
}

#[test]
fn no_tracked_file_points_outside_the_repository() {
    let root = repo_root();
    let listed = Command::new("git")
        .arg("-C")
        .arg(&root)
        .args(["ls-files", "-z"])
        .output()
        .expect("git must be installed to check the repository's files");
    assert!(
        listed.status.success(),
        "git ls-files failed in {} (not a checkout?): {}",
        root.display(),
        String::from_utf8_lossy(&listed.stderr)
    );
    let files: Vec<String> = listed
        .stdout
        .split(|&b| b == 0)
        .filter(|p| !p.is_empty())
        .map(|p| String::from_utf8_lossy(p).into_owned())
        .filter(|p| !p.starts_with(".ci/") && p != SELF)
        .collect();
    assert!(files.len() > 50, "only {} tracked files?", files.len());
    let mut hits = Vec::new();
    for file in &files {
        // Binary files and ones deleted in the work tree have nothing to say.
        let Ok(text) = std::fs::read_to_string(root.join(file)) else {
            continue;
        };
        for (n, line) in text.lines().enumerate() {
            if let Some(why) = outside_reference(line) {
                hits.push(format!("{file}:{}: {why}: {}", n + 1, line.trim()));
            }
        }
    }
    assert!(
        hits.is_empty(),
        "tracked files point outside the repository (cite the kubelet's source or this \
         repository's docs instead):\n{}",
        hits.join("\n")
    );
}
