//! Preferred allocation over shares of physical devices: `hostdev` and `intel_gpu` shares, the
//! devices of [`crate::node_backend`] (one share each) and NVIDIA time-slicing replicas.
//!
//! The must-include ids come first. Each further pick takes the lowest free id of the best
//! physical device by the policy:
//! - `spread`: the device this request holds the fewest shares of, then the one with the fewest
//!   shares in use, then the one with the most free;
//! - `pack`: the device with the most shares in use; among equals, the smallest that holds the
//!   rest of the request, else the one with the most free.
//!
//! A device's shares in use are those not offered as available (held by other containers) plus
//! this request's. Ties go to the request's NUMA node (the must-include shares' nodes; else the
//! smallest node whose free shares hold the whole request, else the node with the most), then
//! to device order. Best effort: never fails, never answers an id that was not offered.

use devplug::PreferenceRequest;
use serde::Deserialize;
use std::collections::{BTreeMap, HashMap, HashSet};

/// How preferred allocation places shares of physical devices when a container needs several.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ReplicaPolicy {
    /// Take shares of as many different physical devices as possible, the least used first.
    #[default]
    Spread,
    /// Fill one physical device's shares before using the next, the most used first.
    Pack,
}

/// Where a share lives.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct ShareInfo {
    /// Index of the physical device.
    pub(crate) physical: usize,
    /// Its NUMA node.
    pub(crate) numa: Option<i64>,
}

/// One physical device during a request.
#[derive(Default)]
struct Physical<'a> {
    numa: Option<i64>,
    /// Its shares, offered or not.
    total: usize,
    /// Shares this request holds.
    mine: usize,
    /// Offered shares not taken yet, highest id first (`pop` gives the lowest).
    free: Vec<&'a String>,
}

impl Physical<'_> {
    fn in_use(&self) -> usize {
        self.total.saturating_sub(self.free.len())
    }
}

/// A count as a signed key (counts never come near `i64::MAX`).
fn signed(n: usize) -> i64 {
    i64::try_from(n).unwrap_or(i64::MAX)
}

/// The ids to give the container: `shares` maps every id of the resource (offered or not) to
/// its physical device.
pub(crate) fn prefer(
    request: &PreferenceRequest<'_>,
    shares: &HashMap<String, ShareInfo>,
    policy: ReplicaPolicy,
) -> Vec<String> {
    let mut chosen: Vec<String> = request.must_include.to_vec();
    let mut devices: BTreeMap<usize, Physical<'_>> = BTreeMap::new();
    for share in shares.values() {
        let device = devices.entry(share.physical).or_default();
        device.total = device.total.saturating_add(1);
        device.numa = device.numa.or(share.numa);
    }
    let taken: HashSet<&str> = chosen.iter().map(String::as_str).collect();
    let mut candidates: Vec<&String> = request
        .available
        .iter()
        .filter(|id| !taken.contains(id.as_str()) && shares.contains_key(*id))
        .collect();
    candidates.sort();
    candidates.dedup();
    let mut per_node: BTreeMap<i64, usize> = BTreeMap::new();
    for id in candidates.iter().rev() {
        let Some(share) = shares.get(*id) else {
            continue;
        };
        if let Some(device) = devices.get_mut(&share.physical) {
            device.free.push(id);
        }
        if let Some(n) = share.numa {
            *per_node.entry(n).or_default() += 1;
        }
    }
    for id in &chosen {
        if let Some(device) = shares.get(id).and_then(|s| devices.get_mut(&s.physical)) {
            device.mine = device.mine.saturating_add(1);
        }
    }
    let need = request.size.saturating_sub(chosen.len());
    if need == 0 {
        return chosen;
    }

    // NUMA: stay with the must-include shares' nodes; otherwise best fit.
    let chosen_nodes: HashSet<i64> = chosen
        .iter()
        .filter_map(|id| shares.get(id)?.numa)
        .collect();
    let target: HashSet<i64> = if !chosen_nodes.is_empty() {
        chosen_nodes
    } else {
        let fits = per_node
            .iter()
            .filter(|(_, c)| **c >= need)
            .min_by_key(|(_, c)| **c);
        let largest = per_node.iter().max_by_key(|(_, c)| **c);
        fits.or(largest).map(|(n, _)| *n).into_iter().collect()
    };
    let tier = |numa: Option<i64>| match numa {
        Some(n) if target.contains(&n) => 0u8,
        Some(_) => 1,
        None => 2,
    };

    while chosen.len() < request.size {
        let need = request.size.saturating_sub(chosen.len());
        let best = devices
            .iter()
            .filter(|(_, d)| !d.free.is_empty())
            .min_by_key(|&(&p, d)| {
                let (used, left) = (signed(d.in_use()), signed(d.free.len()));
                let placement = match policy {
                    ReplicaPolicy::Spread => (signed(d.mine), used, -left),
                    ReplicaPolicy::Pack => {
                        let fits = left >= signed(need);
                        (-used, i64::from(!fits), if fits { left } else { -left })
                    }
                };
                (placement, tier(d.numa), p)
            })
            .map(|(&p, _)| p);
        let Some(device) = best.and_then(|p| devices.get_mut(&p)) else {
            break;
        };
        let Some(id) = device.free.pop() else {
            break;
        };
        device.mine = device.mine.saturating_add(1);
        chosen.push(id.clone());
    }
    chosen
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Two physical devices with 3 shares each: gpu0 on NUMA 0, gpu1 on NUMA 1.
    fn shares() -> HashMap<String, ShareInfo> {
        let mut m = HashMap::new();
        for (p, numa) in [(0usize, 0i64), (1, 1)] {
            for k in 0..3 {
                m.insert(
                    format!("gpu{p}-{k}"),
                    ShareInfo {
                        physical: p,
                        numa: Some(numa),
                    },
                );
            }
        }
        m
    }

    fn ask(available: &[&str], must: &[&str], size: usize, policy: ReplicaPolicy) -> Vec<String> {
        let available: Vec<String> = available.iter().map(|s| s.to_string()).collect();
        let must: Vec<String> = must.iter().map(|s| s.to_string()).collect();
        let req = PreferenceRequest {
            available: &available,
            must_include: &must,
            size,
        };
        prefer(&req, &shares(), policy)
    }

    const ALL: [&str; 6] = ["gpu0-0", "gpu0-1", "gpu0-2", "gpu1-0", "gpu1-1", "gpu1-2"];

    #[test]
    fn pack_fills_one_device() {
        assert_eq!(ask(&ALL, &[], 2, ReplicaPolicy::Pack), ["gpu0-0", "gpu0-1"]);
    }

    #[test]
    fn spread_uses_distinct_devices_before_one_numa_node() {
        // Each device is alone on its node: spread takes both devices, NUMA only breaks ties.
        assert_eq!(
            ask(&ALL, &[], 2, ReplicaPolicy::Spread),
            ["gpu0-0", "gpu1-0"]
        );
        let got = ask(&ALL, &[], 4, ReplicaPolicy::Spread);
        assert_eq!(got.len(), 4);
        assert!(got.iter().any(|id| id.starts_with("gpu1")));
    }

    #[test]
    fn spread_across_devices_on_one_node() {
        let mut m = HashMap::new();
        for (p, k) in [(0usize, 0), (0, 1), (1, 0), (1, 1)] {
            m.insert(
                format!("d{p}-{k}"),
                ShareInfo {
                    physical: p,
                    numa: Some(0),
                },
            );
        }
        let available: Vec<String> = ["d0-0", "d0-1", "d1-0", "d1-1"]
            .iter()
            .map(|s| s.to_string())
            .collect();
        let req = PreferenceRequest {
            available: &available,
            must_include: &[],
            size: 2,
        };
        assert_eq!(prefer(&req, &m, ReplicaPolicy::Spread), ["d0-0", "d1-0"]);
        assert_eq!(prefer(&req, &m, ReplicaPolicy::Pack), ["d0-0", "d0-1"]);
    }

    #[test]
    fn pack_fills_the_most_used_device_and_numa_breaks_ties() {
        // gpu0 has 2 of its 3 shares in use, gpu1 none: pack fills gpu0 first.
        let got = ask(
            &["gpu0-2", "gpu1-0", "gpu1-1", "gpu1-2"],
            &[],
            2,
            ReplicaPolicy::Pack,
        );
        assert_eq!(got, ["gpu0-2", "gpu1-0"]);
        // Equally used devices: the one on the must-include share's node.
        let got = ask(&["gpu0-0", "gpu1-0"], &["gpu1-2"], 2, ReplicaPolicy::Pack);
        assert_eq!(got, ["gpu1-2", "gpu1-0"]);
        // A must-include share counts as this request's: spread goes to the other device.
        let got = ask(&ALL, &["gpu1-2"], 2, ReplicaPolicy::Spread);
        assert_eq!(got, ["gpu1-2", "gpu0-0"]);
        // Asking for more than exists is best effort.
        assert_eq!(ask(&["gpu0-0"], &[], 3, ReplicaPolicy::Spread), ["gpu0-0"]);
    }

    #[test]
    fn one_share_per_device_goes_to_one_numa_node() {
        // Single shares (node_backend): no policy difference, the best-fit node decides.
        let mut m = HashMap::new();
        for (p, numa) in [(0usize, 0i64), (1, 1), (2, 1), (3, 0), (4, 0)] {
            m.insert(
                format!("d{p}"),
                ShareInfo {
                    physical: p,
                    numa: Some(numa),
                },
            );
        }
        let available: Vec<String> = (0..5).map(|p| format!("d{p}")).collect();
        let req = PreferenceRequest {
            available: &available,
            must_include: &[],
            size: 2,
        };
        for policy in [ReplicaPolicy::Spread, ReplicaPolicy::Pack] {
            assert_eq!(prefer(&req, &m, policy), ["d1", "d2"]);
        }
    }

    #[test]
    fn duplicate_offers_are_answered_once() {
        let available: Vec<String> = ["gpu0-0", "gpu0-0", "gpu0-1"]
            .iter()
            .map(|s| s.to_string())
            .collect();
        let req = PreferenceRequest {
            available: &available,
            must_include: &[],
            size: 3,
        };
        assert_eq!(
            prefer(&req, &shares(), ReplicaPolicy::Pack),
            ["gpu0-0", "gpu0-1"]
        );
    }
}
