//! docs/configuration.md lists exactly the fields the config file accepts: for each table (the
//! top level, a resource, each backend and their nested settings), the real binary's
//! `check-config` is given a file with an unknown field at that place, and the fields its
//! error names (`unknown field `zz_unknown`, expected one of a, b, …`) must be the table's
//! first column.
#![allow(clippy::unwrap_used, clippy::expect_used)] // a panic in a test is a failed test

use std::path::Path;
use std::process::Command;

const BIN: &str = env!("CARGO_BIN_EXE_devplug");

/// Each table's heading in docs/configuration.md, and a config with `zz_unknown` where that
/// table's fields go.
const TABLES: &[(&str, &str)] = &[
    ("## Top-level keys", "zz_unknown: 1\nresources: []\n"),
    (
        "## Resource keys",
        "resources:\n  - name: example.com/x\n    zz_unknown: 1\n",
    ),
    (
        "### `virtual`",
        "resources:\n  - name: example.com/x\n    virtual: { count: 1, zz_unknown: 1 }\n",
    ),
    (
        "#### `virtual` sharing (`share`)",
        "resources:\n  - name: example.com/x\n    virtual: { count: 1, share: { zz_unknown: 1 } }\n",
    ),
    (
        "#### `virtual` partitions (`partitions`)",
        "resources:\n  - name: example.com/x\n    virtual: { count: 1, partitions: { slices: 4, sizes: [2], zz_unknown: 1 } }\n",
    ),
    (
        "### `files`",
        "resources:\n  - name: example.com/x\n    files: { dir: /x, zz_unknown: 1 }\n",
    ),
    (
        "### `hostdev`",
        "resources:\n  - name: example.com/x\n    hostdev: { groups: [], zz_unknown: 1 }\n",
    ),
    (
        "#### `hostdev` groups",
        "resources:\n  - name: example.com/x\n    hostdev: { groups: [ { zz_unknown: 1 } ] }\n",
    ),
    (
        "#### `hostdev` USB ids (`usb`)",
        "resources:\n  - name: example.com/x\n    hostdev: { groups: [ { usb: [ { vendor: \"0403\", zz_unknown: 1 } ] } ] }\n",
    ),
    (
        "#### `hostdev` PCI ids (`pci`)",
        "resources:\n  - name: example.com/x\n    hostdev: { groups: [ { pci: [ { zz_unknown: 1 } ] } ] }\n",
    ),
    (
        "#### `hostdev` mounts (`mounts`)",
        "resources:\n  - name: example.com/x\n    hostdev: { groups: [ { mounts: [ { host_path: /a, container_path: /b, zz_unknown: 1 } ] } ] }\n",
    ),
    (
        "### `amdgpu`",
        "resources:\n  - name: example.com/x\n    amdgpu: { zz_unknown: 1 }\n",
    ),
    (
        "### `intel_gpu`",
        "resources:\n  - name: example.com/x\n    intel_gpu: { zz_unknown: 1 }\n",
    ),
    (
        "### `nvidia`",
        "resources:\n  - name: example.com/x\n    nvidia: { zz_unknown: 1 }\n",
    ),
    (
        "#### `nvidia` health",
        "resources:\n  - name: example.com/x\n    nvidia: { health: { zz_unknown: 1 } }\n",
    ),
    (
        "#### `nvidia` replica overrides",
        "resources:\n  - name: example.com/x\n    nvidia: { replica_overrides: [ { gpus: [\"0\"], replicas: 1, zz_unknown: 1 } ] }\n",
    ),
    (
        "#### `nvidia` sharing through MPS (`share`)",
        "resources:\n  - name: example.com/x\n    nvidia: { share: { zz_unknown: 1 } }\n",
    ),
    (
        "### `vfio`",
        "resources:\n  - name: example.com/x\n    vfio: { pci: [], zz_unknown: 1 }\n",
    ),
    (
        "### `qat`",
        "resources:\n  - name: example.com/x\n    qat: { zz_unknown: 1 }\n",
    ),
    (
        "### `ascend`",
        "resources:\n  - name: example.com/x\n    ascend: { zz_unknown: 1 }\n",
    ),
    (
        "### `fpga`",
        "resources:\n  - name: example.com/x\n    fpga: { zz_unknown: 1 }\n",
    ),
    (
        "### `advertise`",
        "resources:\n  - name: example.com/x\n    advertise: { count: 1, zz_unknown: 1 }\n",
    ),
    (
        "### `dra`",
        "resources:\n  - name: example.com/x\n    virtual: { count: 1 }\n    dra: { driver: x.example.com, zz_unknown: 1 }\n",
    ),
];

/// The first column of the first table after the line `heading`, backticks removed.
fn table_fields(doc: &str, heading: &str) -> Vec<String> {
    let mut lines = doc.lines().skip_while(|l| l.trim_end() != heading);
    assert!(
        lines.next().is_some(),
        "docs/configuration.md has no heading {heading:?}"
    );
    let rows: Vec<&str> = lines
        .skip_while(|l| !l.starts_with('|'))
        .take_while(|l| l.starts_with('|'))
        .collect();
    assert!(
        rows.len() > 2 && rows[0].starts_with("| field |"),
        "no field table after {heading:?}"
    );
    rows[2..]
        .iter()
        .map(|row| row.split('|').nth(1).unwrap().trim().replace('`', ""))
        .collect()
}

/// The fields `check-config` says it accepts where `config` has `zz_unknown`.
fn accepted_fields(config: &str) -> Vec<String> {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("config.yaml");
    std::fs::write(&file, config).unwrap();
    let out = Command::new(BIN)
        .args(["check-config", "--config"])
        .arg(&file)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "check-config accepted:\n{config}");
    let line = stderr
        .lines()
        .find(|l| l.contains("unknown field `zz_unknown`"))
        .unwrap_or_else(|| panic!("no unknown-field error for:\n{config}\ngot:\n{stderr}"));
    let (_, list) = line
        .split_once("unknown field `zz_unknown`, expected ")
        .unwrap_or_else(|| panic!("unexpected message shape: {line}"));
    let list = list.strip_prefix("one of ").unwrap_or(list);
    list.split(", ")
        .map(|f| f.trim().trim_matches('`').to_owned())
        .collect()
}

#[test]
fn each_table_in_the_config_reference_lists_exactly_the_accepted_fields() {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../docs/configuration.md");
    let doc = std::fs::read_to_string(&path).unwrap();
    let mut problems = Vec::new();
    for (heading, config) in TABLES {
        let mut documented = table_fields(&doc, heading);
        let mut accepted = accepted_fields(config);
        documented.sort();
        accepted.sort();
        if documented != accepted {
            problems.push(format!(
                "{heading}: the table lists {documented:?}, the config accepts {accepted:?}"
            ));
        }
    }
    assert!(
        problems.is_empty(),
        "docs/configuration.md is out of date:\n{}",
        problems.join("\n")
    );
}
