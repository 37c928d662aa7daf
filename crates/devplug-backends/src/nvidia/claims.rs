//! The `nvidia` backend as a DRA claim backend: whole GPUs and MIG devices as the device plugin
//! hands them, MIG partitions made at prepare and destroyed at unprepare
//! (`mig_strategy: dynamic`), and GPUs shared by capacity through an MPS daemon per GPU.

use super::{partitions, view, MigStrategy, NvidiaBackend};
use devplug::dra::{ClaimBackend, ReleaseError};
use devplug::{AllocateError, ContainerEdits};
use std::collections::BTreeMap;

impl ClaimBackend for NvidiaBackend {
    /// MIG partitions among `ids` are made now, through NVML; whole GPUs and MIG devices are
    /// given with their nodes and the driver's files in the claim's own spec.
    fn prepare_devices(&self, ids: &[String]) -> Result<ContainerEdits, AllocateError> {
        let view = self.view();
        if partitions::any(&view, ids) {
            let partitioner = self.partitioner().map_err(AllocateError::Failed)?;
            let made = partitions::create(&self.settings, &view, partitioner, ids)?;
            return Ok(self.container_edits(&view, &made));
        }
        self.claim_edits(ids)
    }

    /// A share of a whole GPU: the GPU as a claim is given it, on the GPU's MPS daemon
    /// (started now if this is its first share), with the share's limits.
    fn prepare_share(
        &self,
        id: &str,
        consumed: &BTreeMap<String, u64>,
    ) -> Result<ContainerEdits, AllocateError> {
        let (mps, program, uuid) = self.mps_for(id)?;
        mps.ensure(&program, &uuid).map_err(AllocateError::Failed)?;
        let gpu = self.claim_edits(&[id.to_owned()])?;
        let cores = consumed.get(view::MPS_CORES).copied();
        let memory = consumed.get("memory").copied();
        Ok(gpu.merge(mps.share_edits(&uuid, cores, memory)))
    }

    /// Destroys the MIG partitions among `ids` (`mig_strategy: dynamic`).
    fn unprepare_devices(&self, ids: &[String]) -> Result<(), ReleaseError> {
        if self.settings.mig_strategy != MigStrategy::Dynamic {
            return Ok(());
        }
        let partitioner = self.partitioner().map_err(ReleaseError)?;
        partitions::release(&self.view(), partitioner, ids).map_err(ReleaseError)
    }

    fn unprepare_shares(&self, id: &str) {
        match self.mps_for(id) {
            Ok((mps, program, uuid)) => drop(mps.stop(&program, &uuid)),
            Err(err) => tracing::warn!(gpu = id, %err, "cannot stop the GPU's MPS daemon"),
        }
    }

    fn restore_shares(&self, id: &str) {
        let started = self.mps_for(id).and_then(|(mps, program, uuid)| {
            mps.ensure(&program, &uuid).map_err(AllocateError::Failed)
        });
        if let Err(err) = started {
            tracing::warn!(gpu = id, %err, "cannot start the MPS daemon of a GPU with shares from before the restart");
        }
    }
}
