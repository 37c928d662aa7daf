//! The checks past the file's shape: each resource's name (unique in the file), hold-down,
//! backend and settings; the DRA rules (settings only a DRA driver serves, one resource per
//! driver); and which settings need the Kubernetes API client ([`needs_cluster`]). Every
//! resource's first problem is reported, not only the first in the file.

use super::raw::{RawConfig, RawResource};
use super::{Config, ConfigError, ResourceConfig, MAX_HEALTH_HOLD_DOWN};
use devplug_proto::resource_name;
use std::collections::{HashMap, HashSet};
use std::path::Path;

impl Config {
    /// The config of the file read as `raw`, each resource with its one backend, or every
    /// resource's first problem (a later check of a resource may depend on an earlier one).
    /// `path` is only used in messages.
    pub(super) fn resolve(raw: RawConfig, path: &Path) -> Result<Config, ConfigError> {
        if raw.resources.is_empty() {
            return Err(ConfigError::Parse {
                path: path.to_owned(),
                message: "resources: the list is empty; add at least one resource".into(),
            });
        }
        let mut seen = HashSet::new();
        let mut drivers = HashMap::new();
        let mut resources = Vec::with_capacity(raw.resources.len());
        let mut failed = Vec::new();
        for (index, resource) in raw.resources.into_iter().enumerate() {
            let name = shown_name(&resource.name);
            match resolve_resource(resource, index, &mut seen, &mut drivers) {
                Ok(resource) => resources.push(resource),
                Err(problem) => failed.push((index, name, problem)),
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
            Err(failed) if failed.is_empty() => Ok(Config {
                registration: raw.registration,
                refused_pods: raw.refused_pods,
                node_labels: raw.node_labels,
                resources,
            }),
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

/// Names longer than this are cut in messages.
const SHOWN_NAME_CHARS: usize = 80;

/// `name` as an error message shows it: whole, or cut (saying its length) when it is longer
/// than a name can be, so that a file with a 10 MB name does not make a 10 MB message.
pub(super) fn shown_name(name: &str) -> String {
    if name.chars().count() <= SHOWN_NAME_CHARS {
        return name.to_owned();
    }
    let start: String = name.chars().take(SHOWN_NAME_CHARS / 2).collect();
    format!(
        "{start}… (cut: {} bytes in all; a resource name has at most 308)",
        name.len()
    )
}

/// [`shown_name`], quoted where it is whole.
fn quoted_name(name: &str) -> String {
    if name.chars().count() <= SHOWN_NAME_CHARS {
        format!("{name:?}")
    } else {
        shown_name(name)
    }
}

/// The resource `raw`, `index` in the list, or its first problem; `seen` and `drivers` are the
/// names and DRA drivers of the resources before it.
fn resolve_resource(
    raw: RawResource,
    index: usize,
    seen: &mut HashSet<String>,
    drivers: &mut HashMap<String, usize>,
) -> Result<ResourceConfig, String> {
    resource_name::validate(&raw.name).map_err(|e| {
        format!(
            "name: invalid resource name {}: {} (expected the form vendor.example/device)",
            quoted_name(&e.name),
            e.reason
        )
    })?;
    if !seen.insert(raw.name.clone()) {
        return Err("name: this resource is listed twice; each resource needs one entry".into());
    }
    if let Some(hold_down) = raw.health_hold_down {
        crate::duration::check_range(
            "health_hold_down",
            hold_down,
            std::time::Duration::ZERO..=MAX_HEALTH_HOLD_DOWN,
        )?;
    }
    let resource = raw.resolve()?;
    resource
        .kind
        .validate()
        .map_err(|e| format!("{}.{e}", resource.kind.key()))?;
    dra_problem(&resource, index, drivers)?;
    Ok(resource)
}

/// The DRA rules for `resource`, `index` in the list: what only a DRA driver can serve, what a
/// driver needs, and one resource per driver (`drivers`: those of the resources before it).
fn dra_problem(
    resource: &ResourceConfig,
    index: usize,
    drivers: &mut HashMap<String, usize>,
) -> Result<(), String> {
    let dra_only = resource
        .kind
        .backend()
        .and_then(super::BackendConfig::dra_only_setting);
    if let Some(field) = dra_only.filter(|_| resource.serves_device_plugin()) {
        return Err(format!(
            "{field}: devices shared by capacity or split into partitions are served by DRA \
             only (the device plugin API counts whole devices); add dra: {{ driver: ... }} \
             without device_plugin, or remove it"
        ));
    }
    let Some(dra) = &resource.dra else {
        return Ok(());
    };
    if resource.kind.backend().is_none() {
        return Err(format!(
            "dra: an {}: resource has no devices to serve as a DRA driver; remove one of the two",
            resource.kind.key()
        ));
    }
    devplug::dra::check_dns_subdomain(&dra.driver).map_err(|e| format!("dra.driver: {e}"))?;
    if dra
        .no_execute_after
        .is_some_and(|d| d < std::time::Duration::from_secs(1))
    {
        return Err(
            "dra.no_execute_after: must be at least 1s (e.g. 10m); leave it out to never evict"
                .into(),
        );
    }
    if let Some(first) = drivers.insert(dra.driver.clone(), index) {
        return Err(format!(
            "dra.driver: {} is already the driver of resources[{first}]; each driver serves one \
             resource",
            dra.driver
        ));
    }
    Ok(())
}

/// The first place in `config` that needs the Kubernetes API client, as a field path
/// (`resources[2].advertise`), or `None` if the device-plugin-only build can serve it all.
///
/// The one rule for which config settings need the `cluster` feature (the backends that do
/// say so in [`super::ResourceKind::needs_cluster`]): a new one is added there or here, and
/// the lean build then refuses it in `check-config`, `run` and reloads, and the deploy
/// manifests' choice of binary must follow (crates/deploy-check).
pub fn needs_cluster(config: &Config) -> Option<String> {
    config.resources.iter().enumerate().find_map(|(index, r)| {
        if r.kind.needs_cluster() {
            Some(format!("resources[{index}].{}", r.kind.key()))
        } else if r.dra.is_some() {
            Some(format!("resources[{index}].dra"))
        } else {
            None
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::test_parse as parse;
    use std::time::Duration;

    /// A config as `Config::parse` makes it before the build check.
    fn unchecked(text: &str) -> Config {
        let raw: RawConfig = serde_saphyr::from_str(text).unwrap();
        Config::resolve(raw, Path::new("test.yaml")).unwrap()
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
}
