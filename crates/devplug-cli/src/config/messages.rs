//! The wording of config errors that are not one resource's problem: the parser's message in
//! plain words, naming the file and where in it, with a hint for a file of the wrong shape; and
//! what devplug-lite says of a setting it cannot serve.

use super::ResourceKind;
use std::path::Path;

/// The message for a file the parser refused: `error` as the parser said it, `at` the path in
/// the document where it happened (`resources[1].virtual.count`, or empty / `.` for the top),
/// `text` the file and `path` its name.
pub(super) fn parse_message(error: &str, at: &str, text: &str, path: &Path) -> String {
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
