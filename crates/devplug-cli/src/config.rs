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

use devplug::Backend;
use devplug_backends::{
    AmdgpuBackend, AmdgpuSettings, FilesBackend, FilesSettings, HostdevBackend, HostdevSettings,
    IntelGpuBackend, IntelGpuSettings, SettingsError, VirtualBackend, VirtualSettings,
};
use devplug_proto::resource_name;
use serde::Deserialize;
use std::collections::HashSet;
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// The backend keys a resource can have, one of which it must.
const BACKEND_KEYS: [&str; 6] = [
    "virtual",
    "files",
    "hostdev",
    "amdgpu",
    "intel_gpu",
    "advertise",
];

/// The whole config file.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Config {
    /// How resources register with the kubelet unless they say otherwise (default `socket`).
    #[serde(default)]
    pub registration: Option<RegistrationRoute>,
    /// The resources to serve, each on its own socket.
    pub resources: Vec<ResourceConfig>,
}

/// How a resource registers with the kubelet (reliability.md §1).
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

/// One resource and its backend. Exactly one backend key must be set.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ResourceConfig {
    /// Extended resource name, e.g. `example.com/npu`.
    pub name: String,
    /// Software-only devices.
    #[serde(rename = "virtual")]
    pub virtual_devices: Option<VirtualSettings>,
    /// Each file in a watched folder is a device.
    pub files: Option<FilesSettings>,
    /// Host device nodes by glob, USB id or PCI id.
    pub hostdev: Option<HostdevSettings>,
    /// AMD GPUs and compute partitions from sysfs (e.g. `amd.com/gpu`).
    pub amdgpu: Option<AmdgpuSettings>,
    /// Intel GPUs from sysfs (`gpu.intel.com/i915` or `gpu.intel.com/xe`).
    pub intel_gpu: Option<IntelGpuSettings>,
    /// How long a recovered device must stay healthy before the kubelet is told (e.g. `5s`;
    /// default 5s).
    #[serde(default, deserialize_with = "crate::duration::deserialize_opt")]
    pub health_hold_down: Option<std::time::Duration>,
    /// How this resource registers with the kubelet (default: the file's `registration`, else
    /// `socket`).
    #[serde(default)]
    pub registration: Option<RegistrationRoute>,
    /// No device and no socket: `run` keeps `count` of this extended resource on its own Node's
    /// status (seed 003), through the API server.
    pub advertise: Option<AdvertiseSettings>,
}

/// An extended resource advertised on the Node, with no device plugin behind it.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AdvertiseSettings {
    /// How many to advertise (capacity and allocatable).
    pub count: u64,
}

/// The most an `advertise` count may be.
const ADVERTISE_MAX: u64 = 1_000_000_000;

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
}

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
        let mut config: Config =
            serde_saphyr::from_str(text).map_err(|err| ConfigError::Parse {
                path: path.to_owned(),
                message: err.to_string().trim_start_matches("error: ").to_owned(),
            })?;
        config.validate(path)?;
        // Each resource carries its route, so that a reload sees a changed default as a change.
        let default_route = config.registration.unwrap_or(RegistrationRoute::Socket);
        for resource in &mut config.resources {
            resource.registration.get_or_insert(default_route);
        }
        Ok(config)
    }

    fn validate(&self, path: &Path) -> Result<(), ConfigError> {
        let mut seen = HashSet::new();
        for (index, resource) in self.resources.iter().enumerate() {
            let fail = |problem: String| ConfigError::Resource {
                path: path.to_owned(),
                index,
                name: resource.name.clone(),
                problem,
            };
            resource_name::validate(&resource.name).map_err(|e| fail(format!("name: {e}")))?;
            if !seen.insert(resource.name.as_str()) {
                return Err(fail(
                    "name: this resource is listed twice; each resource needs one entry".into(),
                ));
            }
            resource.settings_check().map_err(fail)?;
        }
        if self.resources.is_empty() {
            return Err(ConfigError::Parse {
                path: path.to_owned(),
                message: "resources: the list is empty; add at least one resource".into(),
            });
        }
        Ok(())
    }
}

impl ResourceConfig {
    /// Which backend keys are set.
    fn backend_keys(&self) -> Vec<&'static str> {
        let mut keys = Vec::new();
        if self.virtual_devices.is_some() {
            keys.push("virtual");
        }
        if self.files.is_some() {
            keys.push("files");
        }
        if self.hostdev.is_some() {
            keys.push("hostdev");
        }
        if self.amdgpu.is_some() {
            keys.push("amdgpu");
        }
        if self.intel_gpu.is_some() {
            keys.push("intel_gpu");
        }
        if self.advertise.is_some() {
            keys.push("advertise");
        }
        keys
    }

    fn settings_check(&self) -> Result<(), String> {
        let keys = self.backend_keys();
        match keys.as_slice() {
            [] => Err(format!(
                "no backend: add exactly one of {}",
                BACKEND_KEYS.join(", ")
            )),
            [_] => self.check().map_err(|(key, e)| format!("{key}.{e}")),
            many => Err(format!(
                "{} backends ({}): a resource has exactly one",
                many.len(),
                many.join(", ")
            )),
        }
    }

    /// Checks the backend's settings without starting anything.
    fn check(&self) -> Result<(), (&'static str, SettingsError)> {
        if let Some(settings) = &self.advertise {
            if !(1..=ADVERTISE_MAX).contains(&settings.count) {
                return Err((
                    "advertise",
                    SettingsError::new(
                        "count",
                        format!(
                            "must be between 1 and {ADVERTISE_MAX} (to take a resource away, remove \
                             it from the config)"
                        ),
                    ),
                ));
            }
        }
        if let Some(settings) = &self.virtual_devices {
            settings.validate().map_err(|e| ("virtual", e))?;
        }
        if let Some(settings) = &self.files {
            settings.validate().map_err(|e| ("files", e))?;
        }
        if let Some(settings) = &self.hostdev {
            settings.validate().map_err(|e| ("hostdev", e))?;
        }
        if let Some(settings) = &self.amdgpu {
            settings.validate().map_err(|e| ("amdgpu", e))?;
        }
        if let Some(settings) = &self.intel_gpu {
            settings.validate().map_err(|e| ("intel_gpu", e))?;
        }
        Ok(())
    }

    /// Starts the configured backend (watchers included; needs a tokio runtime). Errors name the
    /// backend key and the field.
    pub fn build(&self) -> Result<Arc<dyn Backend>, (&'static str, SettingsError)> {
        if let Some(settings) = &self.virtual_devices {
            let backend = VirtualBackend::new(settings).map_err(|e| ("virtual", e))?;
            return Ok(Arc::new(backend));
        }
        if let Some(settings) = &self.files {
            let backend = FilesBackend::start(settings).map_err(|e| ("files", e))?;
            return Ok(Arc::new(backend));
        }
        if let Some(settings) = &self.hostdev {
            let backend = HostdevBackend::start(settings).map_err(|e| ("hostdev", e))?;
            return Ok(Arc::new(backend));
        }
        if let Some(settings) = &self.amdgpu {
            let backend = AmdgpuBackend::start(settings).map_err(|e| ("amdgpu", e))?;
            return Ok(Arc::new(backend));
        }
        if let Some(settings) = &self.intel_gpu {
            let backend = IntelGpuBackend::start(settings).map_err(|e| ("intel_gpu", e))?;
            return Ok(Arc::new(backend));
        }
        Err((
            "backend",
            SettingsError::new("", "no backend configured for this resource"),
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(text: &str) -> Result<Config, String> {
        Config::parse(text, Path::new("test.yaml")).map_err(|e| e.to_string())
    }

    #[test]
    fn the_documented_shape_parses() {
        let config = parse(
            "resources:\n  - name: example.com/npu\n    virtual:\n      count: 64\n      env: DUMMY_VISIBLE_DEVICES\n",
        )
        .unwrap();
        let settings = config.resources[0].virtual_devices.as_ref().unwrap();
        assert_eq!(settings.count, 64);
        assert_eq!(settings.env, "DUMMY_VISIBLE_DEVICES");
    }

    #[test]
    fn the_issue_config_shapes_parse() {
        let config = parse(
            "resources:
  - name: example.com/cola
    files: { dir: /etc/colas, env: COLA_DEVICES }
  - name: example.com/serial
    hostdev:
      groups:
        - paths: [\"/dev/ttyUSB*\"]
      count: 1
  - name: example.com/fuse
    hostdev: { groups: [ { paths: [\"/dev/fuse\"] } ], count: 100 }
",
        )
        .unwrap();
        assert_eq!(config.resources.len(), 3);
        assert_eq!(config.resources[2].hostdev.as_ref().unwrap().count, 100);
    }

    #[test]
    fn gpu_backends_parse() {
        let config = parse(
            "resources:
  - name: amd.com/gpu
    amdgpu: {}
  - name: amd.com/cpx_nps4
    amdgpu: { partition_type: cpx_nps4, cdi_dir: /run/cdi }
  - name: gpu.intel.com/xe
    intel_gpu: { driver: xe, count: 4, policy: pack, by_path: false }
",
        )
        .unwrap();
        let amd = config.resources[1].amdgpu.as_ref().unwrap();
        assert_eq!(amd.partition_type.as_deref(), Some("cpx_nps4"));
        assert_eq!(amd.cdi_dir, Path::new("/run/cdi"));
        assert!(config.resources[0].amdgpu.as_ref().unwrap().cdi);
        let intel = config.resources[2].intel_gpu.as_ref().unwrap();
        assert_eq!(intel.driver, devplug_backends::intel_gpu::IntelDriver::Xe);
        assert_eq!(intel.count, 4);
        assert_eq!(intel.policy, devplug_backends::hostdev::SharePolicy::Pack);
        assert!(!intel.by_path);
        assert_eq!(
            config.resources[2].backend_keys(),
            ["intel_gpu"],
            "the YAML key is intel_gpu"
        );
    }

    #[test]
    fn advertise_parses() {
        let config =
            parse("resources:\n  - name: example.com/dongle\n    advertise: { count: 4 }\n")
                .unwrap();
        assert_eq!(
            config.resources[0].advertise,
            Some(AdvertiseSettings { count: 4 })
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

    #[test]
    fn errors_name_the_resource_and_field() {
        let cases = [
            ("resources:\n  - name: example.com/npu\n    virtual: { cout: 3 }\n", "cout"),
            ("resources:\n  - name: example.com/npu\n    virtual: { count: 0 }\n", "resources[0] (example.com/npu): virtual.count: must be between 1"),
            ("resources:\n  - name: npu\n    virtual: { count: 1 }\n", "resources[0] (npu): name: invalid resource name"),
            ("resources:\n  - name: a.com/x\n    virtual: { count: 1 }\n  - name: a.com/x\n    virtual: { count: 1 }\n", "resources[1] (a.com/x): name: this resource is listed twice"),
            ("resources:\n  - name: a.com/x\n", "resources[0] (a.com/x): no backend: add exactly one of virtual, files, hostdev, amdgpu, intel_gpu, advertise"),
            ("resources:\n  - name: a.com/x\n    advertise: { count: 0 }\n", "resources[0] (a.com/x): advertise.count: must be between 1"),
            ("resources:\n  - name: a.com/x\n    advertise: { count: 1 }\n    virtual: { count: 1 }\n", "2 backends (virtual, advertise)"),
            ("resources:\n  - name: a.com/x\n    hostdev: { groups: [ { paths: [ttyUSB0] } ] }\n", "resources[0] (a.com/x): hostdev.groups[0].paths[0]: \"ttyUSB0\" must be a device node path under /dev/"),
            ("resources:\n  - name: a.com/x\n    virtual: { count: 1 }\n    files: { dir: /x }\n", "2 backends (virtual, files)"),
            ("resources:\n  - name: a.com/x\n    files: { dir: colas }\n", "resources[0] (a.com/x): files.dir: colas must be an absolute path"),
            ("resources:\n  - name: a.com/x\n    files: { dir: /x, missing: sometimes }\n", "missing"),
            ("resources:\n  - name: a.com/x\n    virtual: { count: 1, env: 'A-B' }\n", "virtual.env"),
            ("resource: []\n", "resource"),
            ("resources: []\n", "the list is empty"),
            ("resources:\n  - name: a.com/x\n    virtual: { count: many }\n", "count"),
            ("resources:\n  - name: amd.com/gpu\n    amdgpu: { partition_type: CPX }\n", "resources[0] (amd.com/gpu): amdgpu.partition_type: \"CPX\" must be"),
            ("resources:\n  - name: gpu.intel.com/i915\n    intel_gpu: { count: 0 }\n", "resources[0] (gpu.intel.com/i915): intel_gpu.count: must be between 1 and 1000"),
            ("resources:\n  - name: gpu.intel.com/xe\n    intel_gpu: { driver: nvidia }\n", "driver"),
        ];
        for (text, needle) in cases {
            let err = parse(text).unwrap_err();
            assert!(
                err.contains(needle),
                "{text:?}: {err:?} should contain {needle:?}"
            );
        }
    }
}
