//! The wording of config errors that are not one resource's problem: the parser's message in
//! plain words, naming the file and where in it, with a hint for a file of the wrong shape; and
//! what devplug-lite says of a setting it cannot serve.

use super::ResourceKind;
use std::path::Path;

/// The message for a file the parser refused: `error` as the parser said it, `at` the path in
/// the document where it happened (`resources[1].virtual.count`, or empty / `.` for the top),
/// `text` the file and `path` its name.
pub(super) fn parse_message(error: &str, at: &str, text: &str, path: &Path) -> String {
    if let Some(limit) = budget_breached(error) {
        return limit;
    }
    let message = name_the_file(&plain_types(error.trim_start_matches("error: ")), path);
    let mut message = match at {
        "" | "." => message,
        at => format!("{at}: {message}"),
    };
    if let Some(hint) = shape_hint(text) {
        message.push_str("\nhint: ");
        message.push_str(hint);
    }
    message
}

/// What an empty file (or one of comments alone) gets: what a config needs.
pub(super) const EMPTY: &str = "the file is empty (nothing but blank lines and comments); a \
     config needs `resources:` with at least one resource, e.g.\n  resources:\n    - name: \
     example.com/npu\n      virtual: { count: 8 }\n(docs/configuration.md lists every key)";

/// Whether `text` holds no YAML: blank lines, comments and document markers only.
pub(super) fn is_empty(text: &str) -> bool {
    text.lines().all(|line| {
        let line = line.trim();
        line.is_empty() || line.starts_with('#') || line == "---" || line == "..."
    })
}

/// The parser's message for a file past one of its limits (`budget breached: Nodes { nodes:
/// 250001 }`, Rust's Debug output), in words; `None` for any other message.
fn budget_breached(error: &str) -> Option<String> {
    let rest = &error[error.find("budget breached: ")? + "budget breached: ".len()..];
    let kind: String = rest
        .chars()
        .take_while(char::is_ascii_alphanumeric)
        .collect();
    let count: String = rest
        .chars()
        .skip_while(|c| !c.is_ascii_digit())
        .take_while(char::is_ascii_digit)
        .collect();
    let what = match kind.as_str() {
        "Nodes" => "more than 250,000 YAML nodes (values, lists and mappings)".to_owned(),
        "Depth" => "lists or mappings nested more than 64 deep".to_owned(),
        "Events" => "more than 1,000,000 YAML events".to_owned(),
        "Aliases" | "Anchors" => format!("more than 50,000 YAML {}", kind.to_lowercase()),
        "Documents" => "more than 1,024 YAML documents".to_owned(),
        other => format!("more YAML than the parser allows ({other} {count})"),
    };
    Some(format!(
        "the file has {what}, past the YAML parser's limit, so it was not read; a config \
         file lists its resources and a few settings (docs/configuration.md): check that this \
         is the file meant"
    ))
}

/// What the device-plugin-only build says about `what` (a config field path, a flag or a
/// command) that needs the Kubernetes API client.
pub fn not_in_this_build(what: &str) -> String {
    format!(
        "{what}: needs the Kubernetes API client, and this is devplug-lite, the \
         device-plugin-only build; run the full `devplug` binary instead (in the image: \
         /devplug), or build with `--features cluster`"
    )
}

/// The parser's message with Rust type names in words (`invalid u64` → `expected a whole number
/// of 0 or more`; its own range is checked once it parses).
fn plain_types(message: &str) -> String {
    let mut message = message.to_owned();
    for ty in ["u128", "u64", "u32", "u16", "u8", "usize"] {
        message = message.replace(
            &format!("invalid {ty}"),
            "expected a whole number of 0 or more (no sign, no fraction)",
        );
    }
    for ty in ["i128", "i64", "i32", "i16", "i8", "isize"] {
        message = message.replace(&format!("invalid {ty}"), "expected a whole number");
    }
    message.replace("invalid boolean", "expected true or false")
}

/// The snippet's header names the file, not the parser's `<input>`.
fn name_the_file(message: &str, path: &Path) -> String {
    message.replace("--> <input>:", &format!("--> {}:", path.display()))
}

/// A hint for a file that holds resources but not under `resources:` (a snippet copied from
/// the docs, one resource or a bare list), or `None` if the file does not look like one.
fn shape_hint(text: &str) -> Option<&'static str> {
    let value: serde_json::Value = serde_saphyr::from_str(text).ok()?;
    let looks_like_resource = |v: &serde_json::Value| {
        v.as_object().is_some_and(|o| {
            o.contains_key("name") || ResourceKind::KEYS.iter().any(|k| o.contains_key(*k))
        })
    };
    match &value {
        serde_json::Value::Array(items) if items.iter().any(looks_like_resource) => Some(
            "this is a list of resources; a config file is a mapping with the list under \
             `resources:`, e.g.\n  resources:\n    - name: example.com/npu\n      \
             virtual: { count: 8 }",
        ),
        serde_json::Value::Object(o)
            if !o.contains_key("resources") && looks_like_resource(&value) =>
        {
            Some(
                "this looks like one resource; put it in the list under `resources:`, e.g.\n  \
                 resources:\n    - name: example.com/npu\n      virtual: { count: 8 }",
            )
        }
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use crate::config::test_parse as parse;

    #[test]
    fn type_errors_name_the_path() {
        let err = parse(
            "resources:\n  - name: a.com/x\n    virtual: { count: 1 }\n  - name: a.com/y\n    virtual: { count: many }\n",
        )
        .unwrap_err();
        assert!(err.contains("resources[1].virtual.count: "), "{err}");
        assert!(err.contains("line 5"), "the position is kept: {err}");
        let err =
            parse("resources:\n  - name: a.com/x\n    files: { dir: /x, read_only: maybe }\n")
                .unwrap_err();
        assert!(err.contains("resources[0].files.read_only: "), "{err}");
        let err = parse(
            "resources:\n  - name: a.com/x\n    virtual: { count: 1 }\n    health_hold_down: 5\n",
        )
        .unwrap_err();
        assert!(err.contains("resources[0].health_hold_down: "), "{err}");
        assert!(err.contains("no known unit"), "{err}");
    }

    #[test]
    fn an_empty_file_says_so_and_what_a_config_needs() {
        for text in ["", "\n\n", "# nothing yet\n", "---\n# x\n"] {
            let err = parse(text).unwrap_err();
            assert!(err.contains("the file is empty"), "{text:?}: {err}");
            assert!(err.contains("resources:"), "{err}");
            assert!(!err.contains("unexpected end"), "{err}");
        }
        // A file with something in it is parsed as before.
        assert!(!parse("resources: []\n")
            .unwrap_err()
            .contains("the file is empty"));
    }

    #[test]
    fn a_file_past_the_parsers_limits_is_said_in_words() {
        // 250,001 scalars in one list the parser reads to its end.
        let mut text =
            String::from("resources:\n  - name: a.com/x\n    hostdev: { groups: [ { paths: [");
        text.push_str(&"\"/dev/a\",".repeat(250_001));
        text.push_str("] } ] }\n");
        let err = parse(&text).unwrap_err();
        assert!(err.contains("more than 250,000 YAML nodes"), "{err}");
        assert!(!err.contains("Nodes {") && !err.contains("budget"), "{err}");
    }

    #[test]
    fn a_huge_name_is_cut_and_its_length_said() {
        let name = "x".repeat(10 * 1024 * 1024);
        let text = format!("resources:\n  - name: {name}\n    virtual: {{ count: 1 }}\n");
        let err = parse(&text).unwrap_err();
        assert!(err.len() < 2_000, "{} bytes of error", err.len());
        assert!(err.contains("10485760 bytes in all"), "{err}");
        assert!(err.contains("resources[0] ("), "{err}");
        assert!(err.contains("invalid resource name"), "{err}");
        // Two long ones: each cut.
        let text = format!(
            "resources:\n  - name: {name}\n    virtual: {{ count: 1 }}\n  - name: a{name}\n    virtual: {{ count: 1 }}\n"
        );
        let err = parse(&text).unwrap_err();
        assert!(err.len() < 4_000, "{} bytes of error", err.len());
        // A name of a normal length is shown whole, quoted.
        let err = parse("resources:\n  - name: npu\n    virtual: { count: 1 }\n").unwrap_err();
        assert!(
            err.contains("(npu): name: invalid resource name \"npu\""),
            "{err}"
        );
    }

    #[test]
    fn a_snippet_without_resources_gets_a_hint() {
        let one = parse("name: a.com/x\nvirtual: { count: 1 }\n").unwrap_err();
        assert!(one.contains("hint: this looks like one resource"), "{one}");
        let list = parse("- name: a.com/x\n  virtual: { count: 1 }\n").unwrap_err();
        assert!(list.contains("hint: this is a list of resources"), "{list}");
        let other = parse("resource: []\n").unwrap_err();
        assert!(!other.contains("hint"), "{other}");
        let typo = parse("resources:\n  - name: a.com/x\n    virtual: { cout: 1 }\n").unwrap_err();
        assert!(!typo.contains("hint"), "{typo}");
    }
}
