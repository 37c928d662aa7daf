//! deploy-check: strict checks for the Kubernetes manifests in `deploy/`, run as tests.
//!
//! Typed Kubernetes bindings (k8s-openapi) ignore fields they do not know, so a misspelt or
//! misplaced field would pass a plain deserialization and be dropped silently by the API server
//! too. [`strict`] therefore deserializes a document into its typed form (a wrong type fails,
//! with the path), serializes it back, and requires the result to equal the original document;
//! the first path that differs is reported (an unknown field is one that vanished).
//!
//! The typed objects themselves are only dev-dependencies: see `tests/manifests.rs`.

use serde::de::DeserializeOwned;
use serde::Serialize;
use serde_json::{Map, Value};
use std::fmt;
use std::path::{Path, PathBuf};

/// Why a manifest failed a check.
#[derive(Debug, thiserror::Error)]
pub enum CheckError {
    /// The file cannot be read.
    #[error("cannot read {path}: {source}")]
    Read {
        /// The file.
        path: PathBuf,
        /// The error.
        #[source]
        source: std::io::Error,
    },
    /// The file is not valid YAML.
    #[error("{path} is not valid YAML: {message}")]
    Yaml {
        /// The file.
        path: PathBuf,
        /// The parser's message.
        message: String,
    },
    /// A field has the wrong type (or a required field is missing).
    #[error("{path}: {message}")]
    Type {
        /// Where, e.g. `spec.template.spec.containers[0].ports[0].containerPort`.
        path: String,
        /// What the typed form expected.
        message: String,
    },
    /// The typed form could not be serialized back (a bug in the bindings).
    #[error("cannot serialize the typed object back: {0}")]
    Serialize(#[from] serde_json::Error),
    /// The round trip through the typed form changed the document.
    #[error("{0}")]
    Differs(Difference),
}

/// The first place where a document and its typed round trip differ.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Difference {
    /// Where, e.g. `spec.template.spec.hostNetwrok`.
    pub path: String,
    /// What differs.
    pub problem: String,
}

impl fmt::Display for Difference {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", display_path(&self.path), self.problem)
    }
}

fn display_path(path: &str) -> &str {
    if path.is_empty() {
        "(document)"
    } else {
        path
    }
}

/// The repository root (two levels above this crate).
pub fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// The `.yaml` and `.yml` files directly in `dir`, sorted.
pub fn yaml_files(dir: &Path) -> Result<Vec<PathBuf>, CheckError> {
    let entries = std::fs::read_dir(dir).map_err(|source| CheckError::Read {
        path: dir.to_owned(),
        source,
    })?;
    let mut files: Vec<PathBuf> = entries
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.is_file() && p.extension().is_some_and(|e| e == "yaml" || e == "yml"))
        .collect();
    files.sort();
    Ok(files)
}

/// Every YAML document in the file at `path`, as JSON values. Empty documents are skipped;
/// duplicate keys are errors.
pub fn documents(path: &Path) -> Result<Vec<Value>, CheckError> {
    let text = std::fs::read_to_string(path).map_err(|source| CheckError::Read {
        path: path.to_owned(),
        source,
    })?;
    serde_saphyr::from_multiple::<Value>(&text)
        .map(|docs| docs.into_iter().filter(|d| !d.is_null()).collect())
        .map_err(|err| CheckError::Yaml {
            path: path.to_owned(),
            message: err.to_string(),
        })
}

/// Deserializes `doc` into `T` and requires that `T` keeps every field of it.
///
/// Explicit nulls in `doc` count as absent, as the API server treats them.
pub fn strict<T: DeserializeOwned + Serialize>(doc: &Value) -> Result<T, CheckError> {
    let typed: T = serde_path_to_error::deserialize(doc.clone()).map_err(|err| {
        let path = err.path().to_string();
        CheckError::Type {
            path: if path == "." {
                "(document)".into()
            } else {
                path
            },
            message: err.into_inner().to_string(),
        }
    })?;
    let back = serde_json::to_value(&typed)?;
    match first_difference(&without_nulls(doc), &back) {
        Some(difference) => Err(CheckError::Differs(difference)),
        None => Ok(typed),
    }
}

/// `value` with every null-valued object member removed, recursively.
pub fn without_nulls(value: &Value) -> Value {
    match value {
        Value::Object(map) => Value::Object(
            map.iter()
                .filter(|(_, v)| !v.is_null())
                .map(|(k, v)| (k.clone(), without_nulls(v)))
                .collect::<Map<String, Value>>(),
        ),
        Value::Array(items) => Value::Array(items.iter().map(without_nulls).collect()),
        other => other.clone(),
    }
}

/// The first difference between a document and its typed round trip, in document order of
/// keys (sorted), or `None` if they are equal.
pub fn first_difference(original: &Value, typed: &Value) -> Option<Difference> {
    diff_at(String::new(), original, typed)
}

fn child(path: &str, key: &str) -> String {
    let plain = !key.is_empty()
        && key
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-');
    match (path.is_empty(), plain) {
        (true, true) => key.to_owned(),
        (false, true) => format!("{path}.{key}"),
        (_, false) => format!("{path}[{key:?}]"),
    }
}

fn diff_at(path: String, original: &Value, typed: &Value) -> Option<Difference> {
    match (original, typed) {
        (Value::Object(a), Value::Object(b)) => {
            for (key, value) in a {
                let here = child(&path, key);
                match b.get(key) {
                    None => {
                        return Some(Difference {
                            path: here,
                            problem: "unknown field: the Kubernetes type has no such field here"
                                .into(),
                        })
                    }
                    Some(other) => {
                        if let Some(d) = diff_at(here, value, other) {
                            return Some(d);
                        }
                    }
                }
            }
            b.keys()
                .find(|k| !a.contains_key(*k))
                .map(|key| Difference {
                    path: child(&path, key),
                    problem: "the typed object has this field but the document does not".into(),
                })
        }
        (Value::Array(a), Value::Array(b)) if a.len() == b.len() => a
            .iter()
            .zip(b)
            .enumerate()
            .find_map(|(i, (x, y))| diff_at(format!("{path}[{i}]"), x, y)),
        (a, b) if a == b => None,
        (a, b) => Some(Difference {
            path,
            problem: format!("{a} became {b} in the typed object"),
        }),
    }
}

/// What kustomize's image transformer makes of `image` (`name[:tag]`) with a kustomization's
/// `images:` entries: the entry whose `name` matches gives `newName` and `newTag`.
pub fn image_transformed(image: &str, entries: &[Value]) -> String {
    let (name, tag) = match image.rsplit_once(':') {
        Some((name, tag)) if !tag.contains('/') => (name, Some(tag)),
        _ => (image, None),
    };
    for entry in entries {
        if entry["name"] == name {
            let name = entry["newName"].as_str().unwrap_or(name);
            return match entry["newTag"].as_str().or(tag) {
                Some(tag) => format!("{name}:{tag}"),
                None => name.to_owned(),
            };
        }
    }
    image.to_owned()
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde::Deserialize;
    use serde_json::json;

    /// Like the Kubernetes bindings: unknown fields are ignored.
    #[derive(Debug, Deserialize, Serialize)]
    #[serde(rename_all = "camelCase")]
    struct Port {
        container_port: i32,
        #[serde(skip_serializing_if = "Option::is_none")]
        name: Option<String>,
    }

    #[test]
    fn unknown_fields_and_wrong_types_are_caught_with_their_path() {
        let ok = json!({"containerPort": 8080, "name": "metrics", "extra": null});
        assert!(strict::<Port>(&ok).is_ok());

        let unknown = json!({"containerPort": 8080, "nmae": "metrics"});
        let err = strict::<Port>(&unknown).unwrap_err();
        assert_eq!(
            err.to_string(),
            "nmae: unknown field: the Kubernetes type has no such field here"
        );

        let wrong = json!({"containerPort": "8080"});
        let err = strict::<Port>(&wrong).unwrap_err();
        assert!(
            err.to_string()
                .starts_with("containerPort: invalid type: string"),
            "{err}"
        );
    }

    #[test]
    fn paths_quote_keys_with_dots_and_index_arrays() {
        let a =
            json!({"metadata": {"labels": {"app.kubernetes.io/name": "x"}}, "l": [1, {"k": 2}]});
        let b =
            json!({"metadata": {"labels": {"app.kubernetes.io/name": "y"}}, "l": [1, {"k": 2}]});
        let d = first_difference(&a, &b).unwrap();
        assert_eq!(d.path, "metadata.labels[\"app.kubernetes.io/name\"]");
        let c =
            json!({"metadata": {"labels": {"app.kubernetes.io/name": "x"}}, "l": [1, {"k": 3}]});
        assert_eq!(first_difference(&a, &c).unwrap().path, "l[1].k");
        assert_eq!(first_difference(&a, &a), None);
    }
}
