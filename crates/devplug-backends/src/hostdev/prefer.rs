//! Preferred allocation for host devices: shares on one NUMA node first (the smallest node that
//! can hold the whole request, else the largest), then the sharing policy across physical
//! devices: `spread` takes shares of as many different devices as possible, `pack` fills one
//! device before the next. Best effort: never fails.

use super::settings::SharePolicy;
use devplug::PreferenceRequest;
use std::collections::{BTreeMap, HashMap, HashSet};

/// Where a share lives.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct ShareInfo {
    /// Index of the physical device.
    pub(crate) physical: usize,
    /// Its NUMA node.
    pub(crate) numa: Option<i64>,
}

/// The ids to give the container.
pub(crate) fn prefer(
    request: &PreferenceRequest<'_>,
    shares: &HashMap<String, ShareInfo>,
    policy: SharePolicy,
) -> Vec<String> {
    let mut chosen: Vec<String> = request.must_include.to_vec();
    let taken: HashSet<&str> = chosen.iter().map(String::as_str).collect();
    let mut candidates: Vec<(&String, &ShareInfo)> = request
        .available
        .iter()
        .filter(|id| !taken.contains(id.as_str()))
        .filter_map(|id| shares.get(id).map(|s| (id, s)))
        .collect();
    candidates.sort_by(|a, b| a.0.cmp(b.0));
    let need = request.size.saturating_sub(chosen.len());
    if need == 0 {
        return chosen;
    }

    // NUMA: stay with the must-include devices' nodes; otherwise best fit.
    let chosen_nodes: HashSet<i64> = chosen
        .iter()
        .filter_map(|id| shares.get(id)?.numa)
        .collect();
    let mut per_node: BTreeMap<i64, usize> = BTreeMap::new();
    for (_, share) in &candidates {
        if let Some(n) = share.numa {
            *per_node.entry(n).or_default() += 1;
        }
    }
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
    let tier = |share: &ShareInfo| match share.numa {
        Some(n) if target.contains(&n) => 0,
        Some(_) => 1,
        None => 2,
    };

    // Shares per physical device: already chosen, and still free among the candidates.
    let mut used: HashMap<usize, usize> = HashMap::new();
    for id in &chosen {
        if let Some(s) = shares.get(id) {
            *used.entry(s.physical).or_default() += 1;
        }
    }
    let mut free: HashMap<usize, usize> = HashMap::new();
    for (_, s) in &candidates {
        *free.entry(s.physical).or_default() += 1;
    }

    let mut remaining = candidates;
    while chosen.len() < request.size && !remaining.is_empty() {
        let best = (0..remaining.len()).min_by_key(|&i| {
            let (id, share) = remaining[i];
            let used = used.get(&share.physical).copied().unwrap_or(0);
            let free = free.get(&share.physical).copied().unwrap_or(0);
            let placement = match policy {
                // Least used device first, then the one with most free shares.
                SharePolicy::Spread => (used as i64, -(free as i64)),
                // Most used device first, then the one with fewest free shares.
                SharePolicy::Pack => (-(used as i64), free as i64),
            };
            (tier(share), placement, share.physical, id.as_str())
        });
        let Some(best) = best else { break };
        let (id, share) = remaining.swap_remove(best);
        *used.entry(share.physical).or_default() += 1;
        if let Some(f) = free.get_mut(&share.physical) {
            *f = f.saturating_sub(1);
        }
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

    fn ask(available: &[&str], must: &[&str], size: usize, policy: SharePolicy) -> Vec<String> {
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
        assert_eq!(ask(&ALL, &[], 2, SharePolicy::Pack), ["gpu0-0", "gpu0-1"]);
    }

    #[test]
    fn spread_uses_distinct_devices_within_the_numa_node_when_it_fits() {
        // Both devices are alone on their node; spread still prefers one NUMA node when it fits.
        assert_eq!(ask(&ALL, &[], 2, SharePolicy::Spread), ["gpu0-0", "gpu0-1"]);
        // Four shares do not fit one node: the largest node first, then spread onto the other.
        let got = ask(&ALL, &[], 4, SharePolicy::Spread);
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
        assert_eq!(prefer(&req, &m, SharePolicy::Spread), ["d0-0", "d1-0"]);
        assert_eq!(prefer(&req, &m, SharePolicy::Pack), ["d0-0", "d0-1"]);
    }

    #[test]
    fn numa_best_fit_and_must_include() {
        // gpu0 has one free share left, gpu1 three: a request for 2 goes to NUMA 1.
        let got = ask(
            &["gpu0-2", "gpu1-0", "gpu1-1", "gpu1-2"],
            &[],
            2,
            SharePolicy::Pack,
        );
        assert_eq!(got, ["gpu1-0", "gpu1-1"]);
        // A must-include share pins the NUMA node.
        let got = ask(&ALL, &["gpu1-2"], 2, SharePolicy::Spread);
        assert_eq!(got[0], "gpu1-2");
        assert!(got[1].starts_with("gpu1"));
        // Asking for more than exists is best effort.
        assert_eq!(ask(&["gpu0-0"], &[], 3, SharePolicy::Spread), ["gpu0-0"]);
    }
}
