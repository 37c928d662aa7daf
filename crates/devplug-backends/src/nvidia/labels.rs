//! The node labels of an NVIDIA resource, named and formatted as NVIDIA's GPU Feature
//! Discovery writes them (k8s-device-plugin, `internal/lm/resource.go`, `nvml.go`,
//! `mig-strategy.go`, `strategy.go`, `machine-type.go`), so that a pod selecting
//! `nvidia.com/gpu.product=NVIDIA-H100-80GB-HBM3` lands as it did under GFD.
//!
//! They describe what this resource serves, from its view and the GPUs' health: a GPU that is
//! lost or unhealthy leaves `gpu.count`, a new MIG layout or driver version changes the labels
//! (the worker publishes them with every device list). What GFD writes and devplug does not
//! (`gfd.timestamp`, `vgpu.*`, `imex.*`, the MIG engine counts), and why, is in docs/gpus.md.

use super::seam::GpuInfo;
use super::seam::MigAttributes;
use super::settings::{MigStrategy, NvidiaSettings};
use super::view::{UnitKind, View};
use crate::NodeLabels;
use devplug::Health;
use std::collections::BTreeMap;
use std::path::Path;

/// The prefix of every label this backend writes.
pub const PREFIX: &str = "nvidia.com/";

/// The labels of `view`, with `health` the published health of a GPU (its UUID) or a MIG
/// device of it (its GPU-instance id).
pub(crate) fn node_labels(
    settings: &NvidiaSettings,
    view: &View,
    health: &dyn Fn(&str, Option<u32>) -> Health,
) -> NodeLabels {
    let mut labels = NodeLabels::new();
    if view.gpus.is_empty() {
        return labels;
    }
    let mut put = |key: &str, value: String| {
        labels.insert(format!("{PREFIX}{key}"), value);
    };
    put("gpu.present", "true".into());
    versions(view, &mut put);
    let physical = physical_gpus(view);
    put(
        "mig.capable",
        physical.iter().any(|g| g.mig_capable).to_string(),
    );
    let any_mig_on = physical.iter().any(|g| g.mig_enabled);
    let mps = settings.share.is_some() && !any_mig_on;
    put("mps.capable", mps.to_string());
    let shared = view.shared;
    put(
        "gpu.sharing-strategy",
        if mps {
            "mps"
        } else if shared {
            "time-slicing"
        } else {
            "none"
        }
        .into(),
    );
    if let Some(machine) = read_sanitised(&settings.sys_root.join("class/dmi/id/product_name")) {
        put("gpu.machine", machine);
    }
    if let Some(mode) = gpu_mode(&settings.sys_root, &physical) {
        put("gpu.mode", mode.into());
    }
    match settings.mig_strategy {
        MigStrategy::Single | MigStrategy::Mixed => {
            let name = match settings.mig_strategy {
                MigStrategy::Single => "single",
                _ => "mixed",
            };
            put("mig.strategy", name.into());
        }
        MigStrategy::None | MigStrategy::Dynamic => {}
    }
    // The whole GPUs, by the model most of them are (GFD labels one model; it warns when a
    // node has several).
    let Some(model) = main_model(&physical) else {
        return labels;
    };
    let healthy = |uuid: &str| health(uuid, None).is_healthy();
    let gpus_of_model: Vec<&&GpuInfo> = physical.iter().filter(|g| g.name == model).collect();
    let Some(first) = gpus_of_model.first() else {
        return labels;
    };
    let count = gpus_of_model.iter().filter(|g| healthy(&g.uuid)).count();
    let replicas = view
        .gpus
        .iter()
        .find(|g| g.info.name == model && matches!(g.kind, UnitKind::Gpu))
        .map_or(1, |g| g.ids.len());
    let single_migs: Vec<&super::seam::MigInfo> = view
        .gpus
        .iter()
        .filter_map(|g| match &g.kind {
            UnitKind::Mig { mig, .. } => Some(mig),
            UnitKind::Gpu | UnitKind::Partition(_) => None,
        })
        .collect();
    architecture(first, &mut put);
    if settings.mig_strategy == MigStrategy::Single && any_mig_on {
        // GFD's single strategy: the MIG devices are `nvidia.com/gpu`, one profile for all.
        let mut profiles: Vec<&str> = single_migs.iter().map(|m| m.profile.as_str()).collect();
        profiles.dedup();
        match (profiles.as_slice(), view.problem.is_none()) {
            ([profile], true) => {
                let migs = view.gpus.iter().filter_map(|g| match &g.kind {
                    UnitKind::Mig { mig, .. } => Some((g, mig)),
                    UnitKind::Gpu | UnitKind::Partition(_) => None,
                });
                let mut count = 0usize;
                let mut memory = 0u64;
                let mut attributes = None;
                for (g, mig) in migs {
                    memory = mig.memory_bytes >> 20;
                    attributes.get_or_insert(mig.attributes);
                    if health(&g.info.uuid, Some(mig.gi)).is_healthy() {
                        count = count.saturating_add(1);
                    }
                }
                put("gpu.product", product(&[model, "MIG", profile], false));
                put("gpu.count", count.to_string());
                put("gpu.replicas", replicas.to_string());
                put("gpu.memory", memory.to_string());
                if let Some(attributes) = attributes {
                    mig_attributes("gpu", &attributes, &mut put);
                }
            }
            _ => {
                put("gpu.product", product(&[model, "MIG", "INVALID"], false));
                put("gpu.count", "0".into());
                put("gpu.replicas", "0".into());
                put("gpu.memory", "0".into());
            }
        }
        return labels;
    }
    put("gpu.product", product(&[model], replicas > 1));
    put("gpu.count", count.to_string());
    put("gpu.replicas", replicas.to_string());
    put("gpu.memory", (first.memory_bytes >> 20).to_string());
    if settings.mig_strategy == MigStrategy::Mixed {
        // GFD's mixed strategy: a resource per MIG profile, `nvidia.com/mig-<profile>`.
        let mut by_profile: BTreeMap<&str, (usize, u64, usize, MigAttributes)> = BTreeMap::new();
        for g in &view.gpus {
            if let UnitKind::Mig { mig, .. } = &g.kind {
                let entry = by_profile.entry(mig.profile.as_str()).or_insert((
                    0,
                    mig.memory_bytes >> 20,
                    g.ids.len(),
                    mig.attributes,
                ));
                if health(&g.info.uuid, Some(mig.gi)).is_healthy() {
                    entry.0 = entry.0.saturating_add(1);
                }
            }
        }
        for (profile, (count, memory, replicas, attributes)) in by_profile {
            let key = format!("mig-{profile}");
            mig_attributes(&key, &attributes, &mut put);
            put(
                &format!("{key}.product"),
                product(&[model, "MIG", profile], replicas > 1),
            );
            put(&format!("{key}.count"), count.to_string());
            put(&format!("{key}.replicas"), replicas.to_string());
            put(&format!("{key}.memory"), memory.to_string());
        }
    }
    labels
}

/// GFD's labels of a MIG device's attributes (its `migAttributeLabeler`), under `resource`
/// (`gpu` with the single strategy, `mig-<profile>` with mixed): the first MIG device's, as GFD
/// reads them; a profile's devices all have the same.
fn mig_attributes(resource: &str, a: &MigAttributes, put: &mut impl FnMut(&str, String)) {
    let values = [
        ("multiprocessors", a.multiprocessors),
        ("slices.gi", a.gi_slices),
        ("slices.ci", a.ci_slices),
        ("engines.copy", a.copy_engines),
        ("engines.decoder", a.decoders),
        ("engines.encoder", a.encoders),
        ("engines.jpeg", a.jpeg_engines),
        ("engines.ofa", a.ofa_engines),
    ];
    for (name, value) in values {
        put(&format!("{resource}.{name}"), value.to_string());
    }
}

/// Each physical GPU of the view once (a GPU with several MIG devices is one).
fn physical_gpus(view: &View) -> Vec<&GpuInfo> {
    let mut out: Vec<&GpuInfo> = Vec::new();
    for g in &view.gpus {
        if !out.iter().any(|o| o.uuid == g.info.uuid) {
            out.push(&g.info);
        }
    }
    out
}

/// The model most GPUs are (the first GPU's on a tie).
fn main_model<'a>(gpus: &[&'a GpuInfo]) -> Option<&'a str> {
    let mut best: Option<(&str, usize)> = None;
    for g in gpus {
        let n = gpus.iter().filter(|o| o.name == g.name).count();
        if best.is_none_or(|(_, m)| n > m) {
            best = Some((g.name.as_str(), n));
        }
    }
    best.map(|(name, _)| name)
}

/// The driver and CUDA version labels, with GFD's old and new names.
fn versions(view: &View, put: &mut impl FnMut(&str, String)) {
    if let Some(full) = &view.driver_version {
        let parts: Vec<&str> = full.split('.').collect();
        if let [major, minor, rest @ ..] = parts.as_slice() {
            let rev = rest.first().copied().unwrap_or("");
            for (old, new, value) in [
                ("cuda.driver.major", "cuda.driver-version.major", major),
                ("cuda.driver.minor", "cuda.driver-version.minor", minor),
                ("cuda.driver.rev", "cuda.driver-version.revision", &rev),
            ] {
                put(old, (*value).to_owned());
                put(new, (*value).to_owned());
            }
            put("cuda.driver-version.full", full.clone());
        }
    }
    if let Some((major, minor)) = view.cuda_version {
        put("cuda.runtime.major", major.to_string());
        put("cuda.runtime.minor", minor.to_string());
        put("cuda.runtime-version.major", major.to_string());
        put("cuda.runtime-version.minor", minor.to_string());
        put("cuda.runtime-version.full", format!("{major}.{minor}"));
    }
}

/// `gpu.family` and `gpu.compute.major`/`minor`, when NVML gave the compute capability.
fn architecture(gpu: &GpuInfo, put: &mut impl FnMut(&str, String)) {
    let Some((major, minor)) = gpu.compute_capability.filter(|(major, _)| *major != 0) else {
        return;
    };
    put("gpu.family", family(major, minor).into());
    put("gpu.compute.major", major.to_string());
    put("gpu.compute.minor", minor.to_string());
}

/// GFD's architecture family of a compute capability (`getArchFamily`).
pub fn family(major: u32, minor: u32) -> &'static str {
    match (major, minor) {
        (1, _) => "tesla",
        (2, _) => "fermi",
        (3, _) => "kepler",
        (5, _) => "maxwell",
        (6, _) => "pascal",
        (7, m) if m < 5 => "volta",
        (7, _) => "turing",
        (8, m) if m < 9 => "ampere",
        (8, _) => "ada-lovelace",
        (9, _) => "hopper",
        (10, _) | (12, _) => "blackwell",
        // GFD v0.20.0 (Vera Rubin).
        (13, _) => "rubin",
        _ => "undefined",
    }
}

/// GFD's product value: the parts with spaces as `-`, joined by `-`, `-SHARED` for a
/// time-sliced resource; characters a label value cannot hold dropped, at most 63.
pub fn product(parts: &[&str], shared: bool) -> String {
    let mut all: Vec<&str> = parts.iter().copied().filter(|p| !p.is_empty()).collect();
    if shared {
        all.push("SHARED");
    }
    sanitise(&all.join(" "))
}

/// A label value from free text, as GFD's `sanitise`: only `[A-Za-z0-9-_. ]` kept, runs of
/// blanks as one `-`; then cut to 63 characters and trimmed to start and end alphanumeric, as
/// the API server requires.
pub fn sanitise(text: &str) -> String {
    let kept: String = text
        .chars()
        .filter(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.' | ' '))
        .collect();
    let joined = kept.split_whitespace().collect::<Vec<_>>().join("-");
    let cut: String = joined.chars().take(63).collect();
    cut.trim_matches(|c: char| !c.is_ascii_alphanumeric())
        .to_owned()
}

/// A file's first line as a label value, if it has one.
fn read_sanitised(path: &Path) -> Option<String> {
    let text = std::fs::read_to_string(path).ok()?;
    Some(sanitise(text.lines().next()?)).filter(|v| !v.is_empty())
}

/// `gpu.mode` from the GPUs' PCI class (`compute` for 3D controllers, `graphics` for VGA
/// controllers), when sysfs has it; the first GPUs' while they agree, as GFD.
fn gpu_mode(sys_root: &Path, gpus: &[&GpuInfo]) -> Option<&'static str> {
    let mut mode = None;
    for g in gpus {
        let path = sys_root
            .join("bus/pci/devices")
            .join(&g.bus_id)
            .join("class");
        let class = std::fs::read_to_string(path).ok()?;
        let this = match class.trim() {
            "0x030000" => "graphics",
            "0x030200" => "compute",
            _ => "unknown",
        };
        match mode {
            Some(m) if m != this => break,
            _ => mode = Some(this),
        }
    }
    mode
}

#[cfg(test)]
mod tests;
