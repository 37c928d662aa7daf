//! Finding FPGA ports under the kernel's DFL driver (`Documentation/fpga/dfl.rst`):
//! `class/fpga_region/region<X>` for each FPGA, holding its management engine
//! `dfl-fme.<n>` and its ports `dfl-port.<m>`. A port's `afu_id` says which accelerator
//! function its partial-reconfiguration region carries (all `f` when none); the interface id
//! is the `compat_id` of the FME's own region (`dfl-fme.<n>/dfl-fme-region.<k>/fpga_region/
//! region<Y>/compat_id`), as Intel's FPGA plugin reads it. A port is used through
//! `/dev/dfl-port.<m>`.

use super::settings::{canonical_id, FpgaSettings};
use crate::dra_attributes::Attributes;
use crate::node_backend::{Found, Inventory};
use crate::sysfs::{numa_node, read_trimmed};
use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

/// The entries of `dir` whose names start with `prefix` and end in a number, sorted by it.
fn numbered(dir: &Path, prefix: &str) -> Vec<(u32, String)> {
    let mut out: Vec<(u32, String)> = std::fs::read_dir(dir)
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| {
            let name = e.file_name().into_string().ok()?;
            let n = name.strip_prefix(prefix)?.parse().ok()?;
            Some((n, name))
        })
        .collect();
    out.sort();
    out
}

/// The interface id of an FPGA region: its FME's region's `compat_id`.
fn interface_id(region: &Path) -> Option<String> {
    for (_, fme) in numbered(region, "dfl-fme.") {
        let fme = region.join(fme);
        for (_, sub) in numbered(&fme, "dfl-fme-region.") {
            let regions = fme.join(sub).join("fpga_region");
            for (_, r) in numbered(&regions, "region") {
                if let Some(id) = read_trimmed(&regions.join(r).join("compat_id")) {
                    return Some(canonical_id(&id));
                }
            }
        }
    }
    None
}

/// The PCI device an FPGA region sits below: the nearest folder named like `0000:5e:00.0`.
fn pci_address(region: &Path) -> Option<(String, PathBuf)> {
    region.ancestors().find_map(|p| {
        let name = p.file_name()?.to_str()?;
        crate::dra_attributes::pci_bus_id(name).map(|_| (name.to_owned(), p.to_owned()))
    })
}

/// Scans sysfs and /dev for the ports `settings` selects.
pub(crate) fn scan(settings: &FpgaSettings) -> Inventory {
    let (sys, dev) = (&settings.sys_root, &settings.dev_root);
    let class = sys.join("class/fpga_region");
    let want_afu = settings.afu_id.as_deref().map(canonical_id);
    let want_interface = settings.interface_id.as_deref().map(canonical_id);
    let mut inventory = Inventory {
        watch_dirs: BTreeSet::from([dev.to_owned(), class.clone()]),
        ..Inventory::default()
    };
    for (_, region_name) in numbered(&class, "region") {
        let Ok(region) = std::fs::canonicalize(class.join(&region_name)) else {
            continue;
        };
        inventory.watch_dirs.insert(region.clone());
        let interface = interface_id(&region);
        if want_interface.is_some() && interface != want_interface {
            continue;
        }
        let numa = numa_node(sys, &region);
        let pci = pci_address(&region);
        for (_, port) in numbered(&region, "dfl-port.") {
            let afu = read_trimmed(&region.join(&port).join("afu_id")).map(|a| canonical_id(&a));
            if want_afu.is_some() && afu != want_afu {
                let carries = afu.as_deref().unwrap_or("no readable afu_id");
                inventory
                    .absent
                    .insert(port.clone(), format!("now carries AFU {carries}"));
                continue;
            }
            let mut problems = Vec::new();
            if afu.as_deref().is_some_and(|a| a.bytes().all(|b| b == b'f')) {
                problems.push("carries no AFU (afu_id is all f)".to_owned());
            }
            let node = PathBuf::from(&port);
            if !dev.join(&node).exists() {
                problems.push(format!("/dev/{port} missing"));
            }
            let mut attributes = Attributes::default()
                .string("region", &region_name)
                .string_opt("afuID", afu.as_deref())
                .string_opt("interfaceID", interface.as_deref());
            if let Some((address, path)) = &pci {
                attributes = attributes.pci(address, Some(path));
            }
            inventory.found.push(Found {
                id: port.clone(),
                physical: port.clone(),
                nodes: vec![node],
                env_values: vec![port.clone()],
                numa,
                problem: (!problems.is_empty()).then(|| problems.join("; ")),
                attributes: attributes.build(),
            });
        }
    }
    inventory
}
