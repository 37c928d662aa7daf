//! The files every project has: the licence the manifests name, and a changelog.
#![allow(clippy::unwrap_used, clippy::expect_used)] // a panic in a test is a failed test

use std::path::PathBuf;

fn repo_file(name: &str) -> String {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../..")
        .join(name);
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

#[test]
fn the_licence_is_the_full_apache_2_text_the_manifests_name() {
    let manifest = repo_file("Cargo.toml");
    assert!(manifest.contains("license = \"Apache-2.0\""));
    let licence = repo_file("LICENSE");
    for needle in [
        "Apache License",
        "Version 2.0, January 2004",
        "TERMS AND CONDITIONS FOR USE, REPRODUCTION, AND DISTRIBUTION",
        "9. Accepting Warranty or Additional Liability.",
        "END OF TERMS AND CONDITIONS",
        "APPENDIX: How to apply the Apache License to your work.",
    ] {
        assert!(licence.contains(needle), "LICENSE lacks {needle:?}");
    }
    assert_eq!(
        licence.lines().count(),
        202,
        "the standard text has 202 lines"
    );
}

#[test]
fn the_changelog_keeps_a_changelog_and_knows_this_version() {
    let changelog = repo_file("CHANGELOG.md");
    assert!(changelog.starts_with("# Changelog\n"));
    assert!(changelog.contains("https://keepachangelog.com/en/1.1.0/"));
    assert!(changelog.contains("## [Unreleased]"));
    // Until a release, everything is under Unreleased, and the text names the coming version.
    let version = env!("CARGO_PKG_VERSION");
    assert!(
        changelog.contains(&format!("## [{version}]"))
            || changelog.contains("the version the first release will carry"),
        "CHANGELOG.md says nothing of {version}"
    );
    assert!(changelog.contains(&format!("crates say {version}")));
    for command in [
        "devplug run",
        "devplug demo",
        "devplug inspect",
        "devplug check-config",
    ] {
        assert!(
            changelog.contains(command),
            "CHANGELOG.md does not mention {command}"
        );
    }
    for line in changelog.lines().filter(|l| l.starts_with("### ")) {
        let kind = &line[4..];
        assert!(
            [
                "Added",
                "Changed",
                "Deprecated",
                "Removed",
                "Fixed",
                "Security"
            ]
            .contains(&kind),
            "{line:?} is not a Keep a Changelog section"
        );
    }
}
