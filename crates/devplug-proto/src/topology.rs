//! Building a device's `TopologyInfo` from its NUMA node ids, the one way both plugins and the
//! simulator's fake plugin need it.

use crate::v1beta1::{NumaNode, TopologyInfo};

impl TopologyInfo {
    /// The topology of a device on `nodes`; `None` when there are none, which the kubelet reads
    /// as "no NUMA preference".
    pub fn for_numa_nodes(nodes: &[i64]) -> Option<Self> {
        (!nodes.is_empty()).then(|| TopologyInfo {
            nodes: nodes.iter().map(|&id| NumaNode { id }).collect(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn no_nodes_means_no_topology() {
        assert_eq!(TopologyInfo::for_numa_nodes(&[]), None);
        let topology = TopologyInfo::for_numa_nodes(&[0, 3]).unwrap_or_default();
        assert_eq!(topology.nodes, [NumaNode { id: 0 }, NumaNode { id: 3 }]);
    }
}
