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

use devplug::Backend;
use devplug_backends::{
    ascend, fpga, vfio, AmdgpuBackend, AmdgpuSettings, AscendSettings, FilesBackend, FilesSettings,
    FpgaSettings, HostdevBackend, HostdevSettings, IntelGpuBackend, IntelGpuSettings,
    NvidiaBackend, NvidiaSettings, QatSettings, SettingsError, VfioSettings, VirtualBackend,
    VirtualSettings,
};
use devplug_proto::resource_name;
use serde::Deserialize;
use std::collections::HashSet;
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// The backend keys a resource can have, one of which it must.
const BACKEND_KEYS: [&str; 11] = [
    "virtual",
    "files",
    "hostdev",
    "amdgpu",
    "intel_gpu",
    "nvidia",
    "vfio",
    "qat",
    "ascend",
    "fpga",
    "advertise",
];

/// The longest `health_hold_down`: a recovered device kept from pods for more than an hour is
/// a mistake in the file, not a policy.
pub const MAX_HEALTH_HOLD_DOWN: std::time::Duration = std::time::Duration::from_secs(3600);

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
    /// NVIDIA GPUs through NVML, loaded at run time (e.g. `nvidia.com/gpu`).
    pub nvidia: Option<NvidiaSettings>,
    /// PCI devices bound to `vfio-pci`, one per IOMMU group (VMs, DPDK).
    pub vfio: Option<VfioSettings>,
    /// Intel QAT virtual functions bound to `vfio-pci`, by service (`qat.intel.com/cy`).
    pub qat: Option<QatSettings>,
    /// Huawei Ascend NPUs (`huawei.com/Ascend910`).
    pub ascend: Option<AscendSettings>,
    /// Intel FPGA ports under the DFL driver, by the AFU they carry.
    pub fpga: Option<FpgaSettings>,
    /// How long a recovered device must stay healthy before the kubelet is told (e.g. `5s`;
    /// default 5s; at most [`MAX_HEALTH_HOLD_DOWN`]).
    #[serde(default, deserialize_with = "crate::duration::deserialize_opt")]
    pub health_hold_down: Option<std::time::Duration>,
    /// How this resource registers with the kubelet (default: the file's `registration`, else
    /// `socket`).
    #[serde(default)]
    pub registration: Option<RegistrationRoute>,
    /// No device and no socket: `run` keeps `count` of this extended resource on its own Node's
    /// status, through the API server.
    pub advertise: Option<AdvertiseSettings>,
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
}

impl ResourceConfig {
    /// True when the resource is served through the kubelet's device plugin API.
    pub fn serves_device_plugin(&self) -> bool {
        self.advertise.is_none() && self.dra.as_ref().is_none_or(|d| d.device_plugin)
    }
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

/// The first place in `config` that needs the Kubernetes API client, as a field path
/// (`resources[2].advertise`), or `None` if the device-plugin-only build can serve it all.
///
/// The one list of config settings that need the `cluster` feature: a new one (say a `dra:`
/// resource) is added here, and the lean build then refuses it in `check-config`, `run` and
/// reloads, and the deploy manifests' choice of binary must follow (crates/deploy-check).
pub fn needs_cluster(config: &Config) -> Option<String> {
    config.resources.iter().enumerate().find_map(|(index, r)| {
        if r.advertise.is_some() {
            Some(format!("resources[{index}].advertise"))
        } else if r.dra.is_some() {
            Some(format!("resources[{index}].dra"))
        } else {
            None
        }
    })
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
        // serde_path_to_error records where in the document a type error happened (the YAML
        // parser's own message only has the line and column).
        let mut at = String::new();
        let parsed = serde_saphyr::with_deserializer_from_str(text, |de| {
            serde_path_to_error::deserialize::<_, Config>(de).map_err(|err| {
                at = err.path().to_string();
                err.into_inner()
            })
        });
        let mut config: Config = parsed.map_err(|err| {
            let message = name_the_file(
                &plain_types(err.to_string().trim_start_matches("error: ")),
                path,
            );
            let mut message = match at.as_str() {
                "" | "." => message,
                at => format!("{at}: {message}"),
            };
            if let Some(hint) = shape_hint(text) {
                message.push_str("\nhint: ");
                message.push_str(hint);
            }
            ConfigError::Parse {
                path: path.to_owned(),
                message,
            }
        })?;
        config.validate(path)?;
        config.check_build(path, HAS_CLUSTER)?;
        // Each resource carries its route, so that a reload sees a changed default as a change.
        let default_route = config.registration.unwrap_or(RegistrationRoute::Socket);
        for resource in &mut config.resources {
            resource.registration.get_or_insert(default_route);
        }
        Ok(config)
    }

    /// Refuses a config that needs the API client when this build (`has_cluster` false) has none.
    fn check_build(&self, path: &Path, has_cluster: bool) -> Result<(), ConfigError> {
        match needs_cluster(self) {
            Some(field) if !has_cluster => Err(ConfigError::NeedsCluster {
                path: path.to_owned(),
                field,
            }),
            _ => Ok(()),
        }
    }

    /// Every settings problem of every resource (the first of each resource: a later check
    /// may depend on an earlier one), not only the first in the file.
    fn validate(&self, path: &Path) -> Result<(), ConfigError> {
        if self.resources.is_empty() {
            return Err(ConfigError::Parse {
                path: path.to_owned(),
                message: "resources: the list is empty; add at least one resource".into(),
            });
        }
        let mut seen = HashSet::new();
        let mut drivers: std::collections::HashMap<&str, usize> = Default::default();
        let mut failed = Vec::new();
        for (index, resource) in self.resources.iter().enumerate() {
            if let Err(problem) = resource.problem(index, &mut seen, &mut drivers) {
                failed.push((index, resource.name.clone(), problem));
            }
        }
        let path = path.to_owned();
        match <[_; 1]>::try_from(failed) {
            Ok([(index, name, problem)]) => Err(ConfigError::Resource {
                path,
                index,
                name,
                problem,
            }),
            Err(failed) if failed.is_empty() => Ok(()),
            Err(failed) => Err(ConfigError::Resources {
                path,
                problems: failed
                    .into_iter()
                    .map(|(index, name, problem)| format!("resources[{index}] ({name}): {problem}"))
                    .collect(),
            }),
        }
    }
}

impl ResourceConfig {
    /// The first problem of this resource, `index` in the list; `seen` and `drivers` are the
    /// names and DRA drivers of the resources before it.
    fn problem<'a>(
        &'a self,
        index: usize,
        seen: &mut HashSet<&'a str>,
        drivers: &mut std::collections::HashMap<&'a str, usize>,
    ) -> Result<(), String> {
        resource_name::validate(&self.name).map_err(|e| format!("name: {e}"))?;
        if !seen.insert(self.name.as_str()) {
            return Err(
                "name: this resource is listed twice; each resource needs one entry".into(),
            );
        }
        self.settings_check()?;
        let virt = self.virtual_devices.as_ref();
        let dra_only = if virt.is_some_and(|v| v.share.is_some()) {
            Some("virtual.share")
        } else if virt.is_some_and(|v| v.partitions.is_some()) {
            Some("virtual.partitions")
        } else if self.nvidia.as_ref().is_some_and(|n| n.share.is_some()) {
            Some("nvidia.share")
        } else if self
            .nvidia
            .as_ref()
            .is_some_and(|n| n.mig_strategy == devplug_backends::nvidia::MigStrategy::Dynamic)
        {
            Some("nvidia.mig_strategy: dynamic")
        } else {
            None
        };
        if let Some(field) = dra_only.filter(|_| self.serves_device_plugin()) {
            return Err(format!(
                "{field}: devices shared by capacity or split into partitions are served by DRA \
                 only (the device plugin API counts whole devices); add dra: {{ driver: ... }} \
                 without device_plugin, or remove it"
            ));
        }
        if let Some(dra) = &self.dra {
            if self.advertise.is_some() {
                return Err(
                    "dra: an advertise: resource has no devices to serve as a DRA driver; \
                     remove one of the two"
                        .into(),
                );
            }
            devplug::attributes::check_dns_subdomain(&dra.driver)
                .map_err(|e| format!("dra.driver: {e}"))?;
            if dra
                .no_execute_after
                .is_some_and(|d| d < std::time::Duration::from_secs(1))
            {
                return Err(
                    "dra.no_execute_after: must be at least 1s (e.g. 10m); leave it out \
                            to never evict"
                        .into(),
                );
            }
            if let Some(first) = drivers.insert(dra.driver.as_str(), index) {
                return Err(format!(
                    "dra.driver: {} is already the driver of resources[{first}]; each driver \
                     serves one resource",
                    dra.driver
                ));
            }
        }
        Ok(())
    }
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
            o.contains_key("name") || BACKEND_KEYS.iter().any(|k| o.contains_key(*k))
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
        if self.nvidia.is_some() {
            keys.push("nvidia");
        }
        if self.vfio.is_some() {
            keys.push("vfio");
        }
        if self.qat.is_some() {
            keys.push("qat");
        }
        if self.ascend.is_some() {
            keys.push("ascend");
        }
        if self.fpga.is_some() {
            keys.push("fpga");
        }
        if self.advertise.is_some() {
            keys.push("advertise");
        }
        keys
    }

    fn settings_check(&self) -> Result<(), String> {
        if let Some(hold_down) = self.health_hold_down {
            crate::duration::check_range(
                "health_hold_down",
                hold_down,
                std::time::Duration::ZERO..=MAX_HEALTH_HOLD_DOWN,
            )?;
        }
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
        if let Some(settings) = &self.nvidia {
            settings.validate().map_err(|e| ("nvidia", e))?;
        }
        if let Some(settings) = &self.vfio {
            settings.validate().map_err(|e| ("vfio", e))?;
        }
        if let Some(settings) = &self.qat {
            settings.validate().map_err(|e| ("qat", e))?;
        }
        if let Some(settings) = &self.ascend {
            settings.validate().map_err(|e| ("ascend", e))?;
        }
        if let Some(settings) = &self.fpga {
            settings.validate().map_err(|e| ("fpga", e))?;
        }
        Ok(())
    }

    /// Starts the configured backend (watchers included; needs a tokio runtime). Errors name the
    /// backend key and the field.
    pub fn build(&self) -> Result<Arc<dyn Backend>, (&'static str, SettingsError)> {
        // What the backends log while starting (and, where they spawn in this span, after)
        // names the resource. At ERROR level so that no log filter disables the span itself.
        let _span = tracing::error_span!("resource", resource = %self.name).entered();
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
        if let Some(settings) = &self.nvidia {
            let backend = NvidiaBackend::start(&self.name, settings).map_err(|e| ("nvidia", e))?;
            return Ok(Arc::new(backend));
        }
        if let Some(settings) = &self.vfio {
            let backend = vfio::start(&self.name, settings).map_err(|e| ("vfio", e))?;
            return Ok(Arc::new(backend));
        }
        if let Some(settings) = &self.qat {
            let backend = vfio::start_qat(&self.name, settings).map_err(|e| ("qat", e))?;
            return Ok(Arc::new(backend));
        }
        if let Some(settings) = &self.ascend {
            let backend = ascend::start(&self.name, settings).map_err(|e| ("ascend", e))?;
            return Ok(Arc::new(backend));
        }
        if let Some(settings) = &self.fpga {
            let backend = fpga::start(&self.name, settings).map_err(|e| ("fpga", e))?;
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
    use devplug::health::HealthGate;
    use devplug::{Device, DeviceList, Health};
    use devplug_backends::nvidia::MigStrategy;
    use std::time::{Duration, Instant};

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
    fn accelerator_backends_parse() {
        let config = parse(
            "resources:
  - name: nvidia.com/GA102GL_A10
    vfio: { pci: [ { vendor: 10de, device: \"2236\" } ] }
  - name: qat.intel.com/cy
    qat: { service: cy }
  - name: huawei.com/Ascend910
    ascend: {}
  - name: fpga.example.com/nlb0
    fpga: { afu_id: d8424dc4a4a3c413f89e433683f9040b, env: FPGA_PORTS }
",
        )
        .unwrap();
        let keys: Vec<Vec<&str>> = config
            .resources
            .iter()
            .map(ResourceConfig::backend_keys)
            .collect();
        assert_eq!(keys, [["vfio"], ["qat"], ["ascend"], ["fpga"]]);
        let vfio = config.resources[0].vfio.as_ref().unwrap();
        assert_eq!(vfio.env, devplug_backends::vfio::VfioEnv::PciResource);
        let qat = config.resources[1].qat.as_ref().unwrap();
        assert_eq!(qat.service, devplug_backends::vfio::QatService::Cy);
        assert_eq!(qat.env_prefix, "QAT");
        let ascend = config.resources[2].ascend.as_ref().unwrap();
        assert_eq!(ascend.env, "ASCEND_VISIBLE_DEVICES");
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
        assert_eq!(intel.policy, devplug_backends::hostdev::ReplicaPolicy::Pack);
        assert!(!intel.by_path);
        assert_eq!(
            config.resources[2].backend_keys(),
            ["intel_gpu"],
            "the YAML key is intel_gpu"
        );
    }

    #[test]
    fn the_nvidia_shapes_parse() {
        let config = parse(
            "resources:
  - name: nvidia.com/gpu
    nvidia:
      exclude_models: [\"*H100*\"]
      replicas: 4
      replica_overrides: [ { gpus: [\"GPU-8a6e\", \"3\", \"*A10*\"], replicas: 2 } ]
      replica_policy: pack
      device_list_strategy: [cdi-cri, device-specs]
      health: { ignored_xids: [13, 43], check_interval_ms: 500 }
  - name: nvidia.com/h100
    nvidia: { models: [\"*H100*\"], library: /run/nvidia/driver/usr/lib64/libnvidia-ml.so.1 }
  - name: nvidia.com/mig-1g.10gb
    nvidia: { mig_strategy: mixed, mig_profile: 1g.10gb, proc_root: /host/proc }
  - name: nvidia.com/mig-gpu
    nvidia: { mig_strategy: single }
",
        )
        .unwrap();
        let gpu = config.resources[0].nvidia.as_ref().unwrap();
        assert_eq!(gpu.replicas, 4);
        assert_eq!(gpu.replica_overrides[0].gpus.len(), 3);
        assert_eq!(
            gpu.replica_policy,
            devplug_backends::hostdev::ReplicaPolicy::Pack
        );
        assert_eq!(gpu.health.ignored_xids, [13, 43]);
        assert!(gpu.health.enabled);
        assert!(!gpu.sends(devplug_backends::nvidia::ListStrategy::Envvar));
        let h100 = config.resources[1].nvidia.as_ref().unwrap();
        assert_eq!(h100.models, ["*H100*"]);
        assert_eq!(h100.mig_strategy, MigStrategy::None);
        assert_eq!(h100.mig_profile, None);
        assert_eq!(h100.proc_root, std::path::Path::new("/proc"));
        let mig = config.resources[2].nvidia.as_ref().unwrap();
        assert_eq!(mig.mig_strategy, MigStrategy::Mixed);
        assert_eq!(mig.mig_profile.as_deref(), Some("1g.10gb"));
        assert_eq!(mig.proc_root, std::path::Path::new("/host/proc"));
        let single = config.resources[3].nvidia.as_ref().unwrap();
        assert_eq!(single.mig_strategy, MigStrategy::Single);
        assert_eq!(
            h100.health.ignored_xids,
            devplug_backends::nvidia::DEFAULT_IGNORED_XIDS
        );
    }

    #[test]
    fn dra_parses_and_decides_the_device_plugin() {
        let config = parse(
            "resources:\n  - name: example.com/npu\n    virtual: { count: 2 }\n    dra: { driver: npu.example.com }\n  - name: example.com/both\n    virtual: { count: 2 }\n    dra: { driver: both.example.com, device_plugin: true, no_execute_after: 10m }\n  - name: example.com/dp\n    virtual: { count: 2 }\n",
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
            })
        );
        assert_eq!(
            config.resources[1]
                .dra
                .as_ref()
                .and_then(|d| d.no_execute_after),
            Some(std::time::Duration::from_secs(600))
        );
    }

    #[test]
    fn advertise_parses() {
        let text = "resources:\n  - name: example.com/dongle\n    advertise: { count: 4 }\n";
        if !HAS_CLUSTER {
            // devplug-lite: refused, naming the field (see the tests below).
            assert!(parse(text)
                .unwrap_err()
                .contains("resources[0].advertise: needs"));
            return;
        }
        let config = parse(text).unwrap();
        assert_eq!(
            config.resources[0].advertise,
            Some(AdvertiseSettings { count: 4 })
        );
    }

    /// A config as `Config::parse` makes it before the build check.
    fn unchecked(text: &str) -> Config {
        let config: Config = serde_saphyr::from_str(text).unwrap();
        config.validate(Path::new("test.yaml")).unwrap();
        config
    }

    #[test]
    fn needs_cluster_names_the_first_field_that_needs_the_api_client() {
        let plugins_only = unchecked(
            "resources:\n  - name: a.com/x\n    virtual: { count: 1 }\n  - name: a.com/y\n    files: { dir: /tmp }\n",
        );
        assert_eq!(needs_cluster(&plugins_only), None);
        let advertising = unchecked(
            "resources:
  - name: a.com/x
    virtual: { count: 1 }
  - name: a.com/y
    virtual: { count: 1 }
  - name: a.com/dongle
    advertise: { count: 4 }
  - name: a.com/other
    advertise: { count: 1 }
",
        );
        assert_eq!(
            needs_cluster(&advertising).as_deref(),
            Some("resources[2].advertise")
        );
    }

    #[test]
    fn the_device_plugin_only_build_refuses_cluster_settings_naming_field_and_fix() {
        let config = unchecked(
            "resources:\n  - name: a.com/x\n    virtual: { count: 1 }\n  - name: a.com/dongle\n    advertise: { count: 4 }\n",
        );
        let path = Path::new("/etc/devplug/config.yaml");
        assert!(config.check_build(path, true).is_ok());
        let err = config.check_build(path, false).unwrap_err().to_string();
        assert_eq!(
            err,
            "config file /etc/devplug/config.yaml: resources[1].advertise: needs the Kubernetes \
             API client, and this is devplug-lite, the device-plugin-only build; run the full \
             `devplug` binary instead (in the image: /devplug), or build with `--features cluster`"
        );
        // Nothing to refuse without cluster settings.
        let plain = unchecked("resources:\n  - name: a.com/x\n    virtual: { count: 1 }\n");
        assert!(plain.check_build(path, false).is_ok());
        // The build check comes after the file's own errors.
        assert!(
            parse("resources:\n  - name: a.com/x\n    advertise: { count: 0 }\n")
                .unwrap_err()
                .contains("advertise.count: must be between 1")
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
            ("resources:\n  - name: a.com/x\n", "resources[0] (a.com/x): no backend: add exactly one of virtual, files, hostdev, amdgpu, intel_gpu, nvidia, vfio, qat, ascend, fpga, advertise"),
            ("resources:\n  - name: a.com/x\n    advertise: { count: 0 }\n", "resources[0] (a.com/x): advertise.count: must be between 1"),
            ("resources:\n  - name: a.com/x\n    virtual: { count: 2 }\n    dra: { driver: a.com/x }\n", "resources[0] (a.com/x): dra.driver: \"a.com/x\" is not a DNS subdomain"),
            ("resources:\n  - name: a.com/x\n    virtual: { count: 2 }\n    dra: { driver: x.a.com }\n  - name: a.com/y\n    virtual: { count: 2 }\n    dra: { driver: x.a.com }\n", "resources[1] (a.com/y): dra.driver: x.a.com is already the driver of resources[0]"),
            ("resources:\n  - name: a.com/x\n    advertise: { count: 2 }\n    dra: { driver: x.a.com }\n", "resources[0] (a.com/x): dra: an advertise: resource"),
            ("resources:\n  - name: a.com/x\n    advertise: { count: 1 }\n    virtual: { count: 1 }\n", "2 backends (virtual, advertise)"),
            ("resources:\n  - name: a.com/x\n    hostdev: { groups: [ { paths: [ttyUSB0] } ] }\n", "resources[0] (a.com/x): hostdev.groups[0].paths[0]: \"ttyUSB0\" must be a device node path under /dev/"),
            ("resources:\n  - name: a.com/x\n    virtual: { count: 1 }\n    files: { dir: /x }\n", "2 backends (virtual, files)"),
            ("resources:\n  - name: a.com/x\n    files: { dir: colas }\n", "resources[0] (a.com/x): files.dir: colas must be an absolute path"),
            ("resources:\n  - name: a.com/x\n    files: { dir: /x, missing: sometimes }\n", "missing"),
            ("resources:\n  - name: a.com/x\n    virtual: { count: 1, env: 'A-B' }\n", "virtual.env"),
            ("resources:\n  - name: a.com/x\n    virtual: { count: 1, share: { cores: 100 } }\n", "resources[0] (a.com/x): virtual.share: devices shared by capacity or split into partitions are served by DRA only"),
            ("resources:\n  - name: a.com/x\n    virtual: { count: 1, share: {} }\n    dra: { driver: x.a.com, device_plugin: true }\n", "virtual.share: devices shared by capacity or split into partitions are served by DRA only"),
            ("resources:\n  - name: a.com/x\n    virtual: { count: 1, share: { memory: 16GB } }\n    dra: { driver: x.a.com }\n", "resources[0] (a.com/x): virtual.share.memory: \"16GB\" is not a whole quantity"),
            ("resources:\n  - name: a.com/x\n    nvidia: { share: {} }\n", "resources[0] (a.com/x): nvidia.share: devices shared by capacity or split into partitions are served by DRA only"),
            ("resources:\n  - name: a.com/x\n    virtual: { count: 1, partitions: { slices: 4, sizes: [2] } }\n", "resources[0] (a.com/x): virtual.partitions: devices shared by capacity or split into partitions are served by DRA only"),
            ("resources:\n  - name: a.com/x\n    virtual: { count: 1 }\n    dra: { driver: x.a.com, no_execute_after: 10ms }\n", "resources[0] (a.com/x): dra.no_execute_after: must be at least 1s"),
            ("resources:\n  - name: a.com/x\n    nvidia: { share: {}, replicas: 2 }\n    dra: { driver: x.a.com }\n", "nvidia.share: GPUs are shared either by time-slicing replicas or by capacity"),
            ("resources:\n  - name: a.com/x\n    nvidia: { mig_strategy: dynamic }\n", "resources[0] (a.com/x): nvidia.mig_strategy: dynamic: devices shared by capacity or split into partitions are served by DRA only"),
            ("resources:\n  - name: a.com/x\n    nvidia: { mig_strategy: dynamic, replicas: 2 }\n    dra: { driver: x.a.com }\n", "mig_strategy: dynamic MIG partitions are given whole, not as time-slicing replicas"),
            ("resource: []\n", "resource"),
            ("resources: []\n", "the list is empty"),
            ("resources:\n  - name: a.com/x\n    virtual: { count: many }\n", "count"),
            ("resources:\n  - name: amd.com/gpu\n    amdgpu: { partition_type: CPX }\n", "resources[0] (amd.com/gpu): amdgpu.partition_type: \"CPX\" must be"),
            ("resources:\n  - name: gpu.intel.com/i915\n    intel_gpu: { count: 0 }\n", "resources[0] (gpu.intel.com/i915): intel_gpu.count: must be between 1 and 1000"),
            ("resources:\n  - name: gpu.intel.com/xe\n    intel_gpu: { driver: nvidia }\n", "driver"),
            ("resources:\n  - name: example.com/gpu\n    vfio: { pci: [] }\n", "resources[0] (example.com/gpu): vfio.pci: the list is empty"),
            ("resources:\n  - name: example.com/gpu\n    vfio: { pci: [ { vendor: 10de } ], env: numbered }\n", "vfio.env_prefix: env: numbered needs a prefix"),
            ("resources:\n  - name: qat.intel.com/cy\n    qat: { service: crypto }\n", "service"),
            ("resources:\n  - name: huawei.com/Ascend910\n    ascend: { env: 1X }\n", "resources[0] (huawei.com/Ascend910): ascend.env: \"1X\" is not an environment variable name"),
            ("resources:\n  - name: fpga.example.com/nlb\n    fpga: {}\n", "resources[0] (fpga.example.com/nlb): fpga.afu_id: set afu_id"),
            ("resources:\n  - name: fpga.example.com/nlb\n    fpga: { afu_id: xyz }\n", "fpga.afu_id: \"xyz\" must be 32 hex digits"),
            ("resources:\n  - name: nvidia.com/mig-1g.10gb\n    nvidia: { mig_strategy: single, mig_profile: 1g.10gb }\n", "resources[0] (nvidia.com/mig-1g.10gb): nvidia.mig_profile: is only for mig_strategy: mixed"),
            ("resources:\n  - name: nvidia.com/mig-1g.10gb\n    nvidia: { mig_strategy: mixed, mig_profile: mig-1g.10gb }\n", "resources[0] (nvidia.com/mig-1g.10gb): nvidia.mig_profile: \"mig-1g.10gb\" is not a MIG profile name"),
            ("resources:\n  - name: nvidia.com/gpu\n    nvidia: { mig_strategy: auto }\n", "mig_strategy"),
            ("resources:\n  - name: nvidia.com/gpu\n    nvidia: { proc_root: proc }\n", "resources[0] (nvidia.com/gpu): nvidia.proc_root: proc must be an absolute path"),
            ("resources:\n  - name: nvidia.com/gpu\n    nvidia: { device_list_strategy: [volume-mounts] }\n", "volume-mounts"),
            ("resources:\n  - name: nvidia.com/gpu\n    nvidia: { replica_overrides: [ { gpus: [], replicas: 2 } ] }\n", "nvidia.replica_overrides[0].gpus: is empty"),
        ];
        for (text, needle) in cases {
            let err = parse(text).unwrap_err();
            assert!(
                err.contains(needle),
                "{text:?}: {err:?} should contain {needle:?}"
            );
        }
    }

    #[test]
    fn durations_are_bounded_and_name_the_field() {
        let with = |hold: &str| {
            parse(&format!(
                "resources:\n  - name: a.com/x\n    virtual: {{ count: 1 }}\n    health_hold_down: {hold}\n"
            ))
        };
        assert_eq!(
            with("1h").unwrap().resources[0].health_hold_down,
            Some(Duration::from_secs(3600))
        );
        assert_eq!(
            with("0").unwrap().resources[0].health_hold_down,
            Some(Duration::ZERO)
        );
        for hold in [
            "18446744073709551615s",
            "300000000000000000m",
            "61m",
            "2h",
            "3600001ms",
        ] {
            let err = with(hold).unwrap_err();
            assert!(
                err.contains("resources[0] (a.com/x): health_hold_down: must be between 0s and 1h"),
                "{hold}: {err}"
            );
        }
    }

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

    /// A small xorshift generator: the same inputs on every run, no dependency.
    struct XorShift(u64);

    impl XorShift {
        fn next(&mut self) -> u64 {
            self.0 ^= self.0 << 13;
            self.0 ^= self.0 >> 7;
            self.0 ^= self.0 << 17;
            self.0
        }

        fn below(&mut self, n: usize) -> usize {
            (self.next() % n as u64) as usize
        }

        fn pick<'a>(&mut self, items: &[&'a str]) -> &'a str {
            items[self.below(items.len())]
        }
    }

    /// A number as a config file may hold one: edge values and random digit strings.
    fn number(rng: &mut XorShift) -> String {
        match rng.below(8) {
            2..=4 => rng.below(100).to_string(),
            0 => rng
                .pick(&[
                    "0",
                    "1",
                    "59",
                    "3600",
                    "50000",
                    "50001",
                    "4294967295",
                    "4294967296",
                    "9223372036854775807",
                    "18446744073709551615",
                    "18446744073709551616",
                    "300000000000000000",
                    "-1",
                    "1.5",
                    "1e3",
                ])
                .to_owned(),
            1 => (0..rng.below(30) + 1)
                .map(|_| char::from(b'0' + rng.below(10) as u8))
                .collect(),
            _ => (rng.next() >> rng.below(64)).to_string(),
        }
    }

    fn duration_text(rng: &mut XorShift) -> String {
        let unit = rng.pick(&[
            "ms", "s", "m", "h", "ms", "s", "m", "h", "", "d", "us", " s", "S",
        ]);
        format!("{}{unit}", number(rng))
    }

    /// A config built from random parts: mostly valid shapes with random values.
    fn generated(rng: &mut XorShift) -> String {
        let mut text = String::from("resources:\n");
        for i in 0..rng.below(3) + 1 {
            text.push_str(&format!("  - name: example.com/r{i}\n"));
            match rng.below(3) {
                0 => text.push_str(&format!(
                    "    virtual: {{ count: {}, numa_nodes: {} }}\n",
                    number(rng),
                    number(rng)
                )),
                1 => text.push_str(&format!(
                    "    hostdev: {{ groups: [ {{ paths: [/dev/null] }} ], count: {} }}\n",
                    number(rng)
                )),
                _ => text.push_str(&format!("    files: {{ dir: /nonexistent/{i} }}\n")),
            }
            if rng.below(4) != 0 {
                text.push_str(&format!("    health_hold_down: {}\n", duration_text(rng)));
            }
        }
        text
    }

    /// `text` with a few random bytes replaced, inserted or removed.
    fn mutated(rng: &mut XorShift, text: &str) -> String {
        let mut bytes = text.as_bytes().to_vec();
        let alphabet = b" \n:-{}[],0123456789hmsx\"'#&*!|>";
        for _ in 0..rng.below(4) + 1 {
            let at = rng.below(bytes.len() + 1);
            let byte = alphabet[rng.below(alphabet.len())];
            match rng.below(3) {
                0 if at < bytes.len() => bytes[at] = byte,
                1 if at < bytes.len() => {
                    bytes.remove(at);
                }
                _ => bytes.insert(at, byte),
            }
        }
        String::from_utf8_lossy(&bytes).into_owned()
    }

    /// Does what `run` does with a resource's timing: a device breaks, recovers and is
    /// released after the hold-down, through the same gate the host uses.
    fn drive_health_gate(resource: &ResourceConfig) {
        let hold = resource
            .health_hold_down
            .unwrap_or(devplug::DEFAULT_HEALTH_HOLD_DOWN);
        let list = |health: Health| DeviceList::new([Device::new("d").with_health(health)]);
        let mut gate = HealthGate::new(hold);
        let t0 = tokio::time::Instant::now();
        gate.apply(&list(Health::Healthy), t0);
        gate.apply(&list(Health::unhealthy("fuzz")), t0);
        let back = gate.apply(&list(Health::Healthy), t0);
        if let Some(next) = back.next_check {
            let released = gate.apply(&list(Health::Healthy), next);
            assert!(released
                .list
                .get("d")
                .is_some_and(|d| d.health.is_healthy()));
        }
    }

    #[test]
    fn no_config_text_panics_the_parser_or_the_timing_it_configures() {
        let mut rng = XorShift(0x5eed_0008_2026_1123);
        let start = Instant::now();
        let (mut runs, mut accepted) = (0u32, 0u32);
        while runs < 20_000 && start.elapsed() < Duration::from_secs(3) {
            let base = generated(&mut rng);
            let text = if rng.below(3) == 0 {
                mutated(&mut rng, &base)
            } else {
                base
            };
            runs += 1;
            if let Ok(config) = Config::parse(&text, Path::new("fuzz.yaml")) {
                accepted += 1;
                for resource in &config.resources {
                    drive_health_gate(resource);
                    // Large lists are checked by the backend's own tests; keep runs quick.
                    if let Some(settings) = resource
                        .virtual_devices
                        .as_ref()
                        .filter(|s| s.count <= 2000)
                    {
                        let backend = devplug_backends::VirtualBackend::new(settings).unwrap();
                        let devices = devplug::Backend::devices(&backend).borrow().clone();
                        devices.to_wire().unwrap();
                    }
                }
            }
        }
        eprintln!("{runs} inputs, {accepted} valid configs");
        assert!(runs >= 200, "only {runs} inputs in the time budget");
        assert!(
            accepted > runs / 20,
            "too few valid configs ({accepted} of {runs}) to exercise the gate"
        );
    }
}
