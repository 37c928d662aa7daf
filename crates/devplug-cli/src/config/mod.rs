//! The config file: which resources to serve and with which backend. YAML, unknown fields are
//! errors, and every error names the resource and the field.
//!
//! ```yaml
//! resources:
//!   - name: example.com/npu
//!     virtual:
//!       count: 64
//!       env: DUMMY_VISIBLE_DEVICES
//! ```
//!
//! `registration: socket | watcher` (top level, or per resource; default `socket`) picks how the
//! kubelet learns of a resource: `kubelet.sock`, or a socket in its plugin-watcher folder.
//!
//! Some settings need the Kubernetes API client (`advertise:`), which only the full build has
//! (cargo feature `cluster`); [`needs_cluster`] finds them, and the device-plugin-only build
//! (`devplug-lite`) refuses such a file with [`ConfigError::NeedsCluster`].
//!
//! The file is read in its raw shape (`raw`: each backend key an optional field), then resolved
//! at once into [`Config`], where each resource holds its one [`ResourceKind`] (`kind`: devices
//! from one [`BackendConfig`], or advertised capacity) and `backend` has the key, settings check,
//! dry run and start of each backend, one `match` each; `validate`
//! has the checks across resources and the DRA rules, `messages` the wording of parse errors.

mod backend;
#[cfg(test)]
mod fuzz;
mod kind;
mod messages;
mod raw;
mod validate;

pub use backend::{BackendConfig, Built, BuiltBackend};
pub use kind::{AdvertiseSettings, ResourceKind};
pub use messages::not_in_this_build;
pub use validate::needs_cluster;

use serde::Deserialize;
use std::path::{Path, PathBuf};

/// The longest `health_hold_down`: a recovered device kept from pods for more than an hour is
/// a mistake in the file, not a policy.
pub const MAX_HEALTH_HOLD_DOWN: std::time::Duration = std::time::Duration::from_secs(3600);

/// The whole config file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Config {
    /// How resources register with the kubelet unless they say otherwise (default `socket`).
    pub registration: Option<RegistrationRoute>,
    /// What `run` does with pods the kubelet refused at admission for one of the device plugin
    /// resources (default `delete-replaced`; full `devplug` with `NODE_NAME` only).
    pub refused_pods: RefusedPodsPolicy,
    /// Whether and how `run` writes the node labels the backends describe the node with
    /// (default `off`; full `devplug` with `NODE_NAME` only).
    pub node_labels: NodeLabelsSettings,
    /// The resources to serve, each on its own socket.
    pub resources: Vec<ResourceConfig>,
}

/// `node_labels:` the labels the GPU backends describe the node with (`nvidia.com/gpu.product`,
/// `amd.com/gpu.family`, …, as the vendors' own labellers name them), and how they reach the
/// Node.
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NodeLabelsSettings {
    /// `direct`, `node-feature` or `off` (default).
    #[serde(default)]
    pub mode: NodeLabelsMode,
}

/// How node labels reach the Node.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum NodeLabelsMode {
    /// Not written.
    #[default]
    Off,
    /// On our own Node by server-side apply (only our keys, removed when they go).
    Direct,
    /// In a NodeFeature object that Node Feature Discovery turns into labels.
    NodeFeature,
}

/// `refused_pods:` what `run` does with pods the kubelet refused at admission
/// (`UnexpectedAdmissionError`) for a resource of this file, as after a node reboot when the
/// kubelet admits its pods before devplug's DaemonSet pod runs again.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum RefusedPodsPolicy {
    /// Delete those whose controller (ReplicaSet, StatefulSet, DaemonSet) replaces them; report
    /// the others (bare pods, Job pods) with an event on each and one on the Node.
    #[default]
    DeleteReplaced,
    /// Report every one; delete none.
    Report,
    /// Leave them alone.
    Off,
}

/// How a resource registers with the kubelet.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum RegistrationRoute {
    /// `Register` on `device-plugins/kubelet.sock`, the documented route.
    Socket,
    /// A registration socket in the kubelet's `plugins_registry/` (the plugin watcher).
    Watcher,
}

impl From<RegistrationRoute> for devplug::Registration {
    fn from(route: RegistrationRoute) -> Self {
        match route {
            RegistrationRoute::Socket => devplug::Registration::Socket,
            RegistrationRoute::Watcher => devplug::Registration::Watcher,
        }
    }
}

/// One resource and its one backend.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ResourceConfig {
    /// Extended resource name, e.g. `example.com/npu`.
    pub name: String,
    /// What it is: devices from one backend, or advertised capacity (the file's one key
    /// beside the name and options).
    pub kind: ResourceKind,
    /// How long a recovered device must stay healthy before the kubelet is told (e.g. `5s`;
    /// default 5s; at most [`MAX_HEALTH_HOLD_DOWN`]).
    pub health_hold_down: Option<std::time::Duration>,
    /// How this resource registers with the kubelet (default: the file's `registration`, else
    /// `socket`; [`Config::parse`] fills it in).
    pub registration: Option<RegistrationRoute>,
    /// Serve this resource's devices as a DRA driver (ResourceSlices, claim preparation); by
    /// itself, or beside its device plugin with `device_plugin: true`.
    pub dra: Option<DraSettings>,
}

/// A resource served as a Dynamic Resource Allocation driver.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DraSettings {
    /// The driver's name: a DNS subdomain such as `npu.example.com` (no `/`; the API server
    /// refuses `example.com/npu`). DeviceClasses select it with `device.driver == "…"`.
    pub driver: String,
    /// Also serve the device plugin (default false). Both at once offer the same devices to
    /// two allocators that do not know of each other: only for devices that can be shared, or
    /// while moving a node from one to the other.
    #[serde(default)]
    pub device_plugin: bool,
    /// How long a device stays unhealthy before its taint turns from `NoSchedule` to
    /// `NoExecute` (e.g. `10m`), so that the cluster evicts the pods using it that do not
    /// tolerate the taint; default: never.
    #[serde(default, deserialize_with = "crate::duration::deserialize_opt")]
    pub no_execute_after: Option<std::time::Duration>,
    /// Give the containers of each claim a file per request naming their devices and the
    /// attributes the ResourceSlice publishes (Kubernetes' device metadata, KEP-5304, read with
    /// `k8s.io/dynamic-resource-allocation/devicemetadata`), at
    /// `/var/run/kubernetes.io/dra-device-attributes/…`; default false.
    #[serde(default)]
    pub device_metadata: bool,
}

impl ResourceConfig {
    /// True when the resource is served through the kubelet's device plugin API.
    pub fn serves_device_plugin(&self) -> bool {
        self.kind.backend().is_some() && self.dra.as_ref().is_none_or(|d| d.device_plugin)
    }
}

/// Why a config file cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// The file cannot be read.
    #[error("cannot read config file {path}: {source}")]
    Read {
        /// The file.
        path: PathBuf,
        /// The error.
        #[source]
        source: std::io::Error,
    },
    /// The file is not valid YAML of the expected shape.
    #[error("config file {path} is not valid: {message}")]
    Parse {
        /// The file.
        path: PathBuf,
        /// The parser's message, with line and column.
        message: String,
    },
    /// A resource's settings cannot work.
    #[error("config file {path}: resources[{index}] ({name}): {problem}")]
    Resource {
        /// The file.
        path: PathBuf,
        /// Position in the `resources` list.
        index: usize,
        /// The resource name as written.
        name: String,
        /// The field and what to do.
        problem: String,
    },
    /// Several resources' settings cannot work: each one, in file order
    /// (`resources[i] (name): problem`).
    #[error("config file {path}: {} problems:\n  {}", problems.len(), problems.join("\n  "))]
    Resources {
        /// The file.
        path: PathBuf,
        /// One line each.
        problems: Vec<String>,
    },
    /// The file uses the API server (e.g. `advertise:`), and this build has no client for it.
    #[error("config file {path}: {}", not_in_this_build(field))]
    NeedsCluster {
        /// The file.
        path: PathBuf,
        /// Where in the file, e.g. `resources[2].advertise`.
        field: String,
    },
}

/// Whether this binary has the Kubernetes API client (the `cluster` feature): `devplug`, not
/// `devplug-lite`.
pub const HAS_CLUSTER: bool = cfg!(feature = "cluster");

impl Config {
    /// Reads, parses and validates the file at `path`; returns the config and the text it came
    /// from (to notice later whether the file really changed).
    pub fn load(path: &Path) -> Result<(Config, String), ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
            path: path.to_owned(),
            source,
        })?;
        Ok((Config::parse(&text, path)?, text))
    }

    /// Parses and validates `text`; `path` is only used in messages.
    pub fn parse(text: &str, path: &Path) -> Result<Config, ConfigError> {
        if messages::is_empty(text) {
            return Err(ConfigError::Parse {
                path: path.to_owned(),
                message: messages::EMPTY.into(),
            });
        }
        // serde_path_to_error records where in the document a type error happened (the YAML
        // parser's own message only has the line and column).
        let mut at = String::new();
        let parsed = serde_saphyr::with_deserializer_from_str(text, |de| {
            serde_path_to_error::deserialize::<_, raw::RawConfig>(de).map_err(|err| {
                at = err.path().to_string();
                err.into_inner()
            })
        });
        let raw = parsed.map_err(|err| ConfigError::Parse {
            path: path.to_owned(),
            message: messages::parse_message(&err.to_string(), &at, text, path),
        })?;
        let mut config = Config::resolve(raw, path)?;
        config.check_build(path, HAS_CLUSTER)?;
        // Each resource carries its route, so that a reload sees a changed default as a change.
        let default_route = config.registration.unwrap_or(RegistrationRoute::Socket);
        for resource in &mut config.resources {
            resource.registration.get_or_insert(default_route);
        }
        Ok(config)
    }

    /// Refuses a config that needs the API client when this build (`has_cluster` false) has none.
    pub(super) fn check_build(&self, path: &Path, has_cluster: bool) -> Result<(), ConfigError> {
        match needs_cluster(self) {
            Some(field) if !has_cluster => Err(ConfigError::NeedsCluster {
                path: path.to_owned(),
                field,
            }),
            _ => Ok(()),
        }
    }
}

/// `text` parsed as the file `test.yaml`, or the error as the user sees it.
#[cfg(test)]
fn test_parse(text: &str) -> Result<Config, String> {
    Config::parse(text, Path::new("test.yaml")).map_err(|e| e.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;
    use test_parse as parse;

    #[test]
    fn node_labels_pick_a_mode_and_a_wrong_one_names_the_field_and_the_choices() {
        let body = "resources:\n  - name: nvidia.com/gpu\n    virtual: { count: 1 }\n";
        assert_eq!(parse(body).unwrap().node_labels.mode, NodeLabelsMode::Off);
        for (text, mode) in [
            ("direct", NodeLabelsMode::Direct),
            ("node-feature", NodeLabelsMode::NodeFeature),
            ("off", NodeLabelsMode::Off),
        ] {
            let config = parse(&format!("node_labels: {{ mode: {text} }}\n{body}")).unwrap();
            assert_eq!(config.node_labels.mode, mode, "{text}");
        }
        let err = parse(&format!("node_labels: {{ mode: nfd }}\n{body}")).unwrap_err();
        assert!(
            err.contains("node_labels") && err.contains("node-feature"),
            "{err}"
        );
        let err = parse(&format!(
            "node_labels: {{ mode: direct, prefix: x }}\n{body}"
        ))
        .unwrap_err();
        assert!(err.contains("prefix") && err.contains("mode"), "{err}");
    }

    #[test]
    #[cfg(feature = "cluster")] // devplug-lite refuses `dra:` (its own test says so)
    fn dra_parses_and_decides_the_device_plugin() {
        let config = parse(
            "resources:\n  - name: example.com/npu\n    virtual: { count: 2 }\n    dra: { driver: npu.example.com }\n  - name: example.com/both\n    virtual: { count: 2 }\n    dra: { driver: both.example.com, device_plugin: true, no_execute_after: 10m, device_metadata: true }\n  - name: example.com/dp\n    virtual: { count: 2 }\n",
        )
        .unwrap();
        let serves: Vec<bool> = config
            .resources
            .iter()
            .map(ResourceConfig::serves_device_plugin)
            .collect();
        assert_eq!(serves, [false, true, true]);
        assert_eq!(
            config.resources[0].dra,
            Some(DraSettings {
                driver: "npu.example.com".into(),
                device_plugin: false,
                no_execute_after: None,
                device_metadata: false,
            })
        );
        assert!(config.resources[1]
            .dra
            .as_ref()
            .is_some_and(|d| d.device_metadata));
        assert_eq!(
            config.resources[1]
                .dra
                .as_ref()
                .and_then(|d| d.no_execute_after),
            Some(std::time::Duration::from_secs(600))
        );
    }

    #[test]
    fn registration_route_defaults_and_overrides() {
        let config = parse(
            "registration: watcher
resources:
  - name: a.com/x
    virtual: { count: 1 }
  - name: a.com/y
    virtual: { count: 1 }
    registration: socket
",
        )
        .unwrap();
        assert_eq!(
            config.resources[0].registration,
            Some(RegistrationRoute::Watcher)
        );
        assert_eq!(
            config.resources[1].registration,
            Some(RegistrationRoute::Socket)
        );
        let plain = parse("resources:\n  - name: a.com/x\n    virtual: { count: 1 }\n").unwrap();
        assert_eq!(
            plain.resources[0].registration,
            Some(RegistrationRoute::Socket)
        );
        let err =
            parse("registration: dra\nresources:\n  - name: a.com/x\n    virtual: { count: 1 }\n")
                .unwrap_err();
        assert!(err.contains("registration"), "{err}");
    }
}
