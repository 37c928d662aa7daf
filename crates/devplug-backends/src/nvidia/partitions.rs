//! MIG partitions made per claim (`mig_strategy: dynamic`, DRA only). The view publishes each
//! GPU in MIG mode as a counter set (its memory slices and compute slices) and one device per
//! GPU-instance profile and placement consuming them, so the scheduler only picks partitions
//! that fit together. Allocation creates the partition's GPU instance and compute instance
//! through NVML ([`MigPartitioner`]) and gives the container the new MIG device (its UUID, its
//! GPU's node and its caps nodes, as [`super::edits`] gives them); release destroys them.
//!
//! Nothing is remembered here: a partition is found again by its GPU, profile and placement,
//! so a restart in between, or a release repeated, finds the same instance or none.

use super::edits::Given;
use super::seam::MigPartitioner;
use super::settings::NvidiaSettings;
use super::view::{caps_nodes, parse_mig_minors, Partition, ServedGpu, View, MIG_MINORS};
use devplug::AllocateError;

/// True when any of `ids` is a partition of `view`.
pub(super) fn any(view: &View, ids: &[String]) -> bool {
    ids.iter()
        .any(|id| view.served(id).is_ok_and(|g| g.partition().is_some()))
}

/// The partition served as `id`.
fn partition<'v>(view: &'v View, id: &str) -> Result<(&'v ServedGpu, &'v Partition), String> {
    let gpu = view.served(id).map_err(|e| e.to_string())?;
    match gpu.partition() {
        Some(part) => Ok((gpu, part)),
        None => Err(format!(
            "{id} is a whole GPU and the request also has MIG partitions; ask for them in \
             separate requests"
        )),
    }
}

/// Creates the partitions `ids` and returns their new MIG devices, each with its GPU's node and
/// its caps nodes. If one cannot be created, those created before it in this call are
/// destroyed again.
pub(super) fn create(
    settings: &NvidiaSettings,
    view: &View,
    partitioner: &dyn MigPartitioner,
    ids: &[String],
) -> Result<Vec<Given>, AllocateError> {
    let mut made: Vec<&String> = Vec::new();
    let undo = |made: &[&String]| {
        for id in made {
            if let Ok((gpu, part)) = partition(view, id) {
                if let Err(err) = partitioner.destroy(&gpu.info.uuid, part.profile.id, part.start) {
                    tracing::warn!(partition = %id, %err, "cannot destroy a MIG partition made for a request that failed");
                }
            }
        }
    };
    let mut made_units = Vec::new();
    let minors_path = settings.proc_root.join(MIG_MINORS);
    for id in ids {
        let created = partition(view, id)
            .map_err(AllocateError::InvalidRequest)
            .and_then(|(gpu, part)| {
                let mig = partitioner
                    .create(&gpu.info.uuid, &part.profile, part.start, part.size)
                    .map_err(|e| {
                        AllocateError::Failed(format!(
                            "cannot create MIG partition {id} ({} at memory slice {} of GPU {} \
                             {}): {e}",
                            part.name, part.start, gpu.info.index, gpu.info.uuid
                        ))
                    })?;
                made.push(id);
                // The caps minors of every GI and CI are listed when the driver loads; read
                // now, as the instance is new.
                let minors = std::fs::read_to_string(&minors_path)
                    .map(|text| parse_mig_minors(&text))
                    .map_err(|e| {
                        AllocateError::Failed(format!(
                            "cannot read {}: {e}; a MIG device needs its caps nodes",
                            minors_path.display()
                        ))
                    })?;
                let caps = caps_nodes(&minors, &gpu.info, &mig).map_err(AllocateError::Failed)?;
                Ok((gpu, mig, caps))
            });
        let (gpu, mig, caps) = match created {
            Ok(c) => c,
            Err(err) => {
                undo(&made);
                return Err(err);
            }
        };
        tracing::info!(partition = %id, mig = %mig.uuid, gi = mig.gi, ci = mig.ci, "MIG partition created");
        made_units.push(Given::partition(&gpu.info, &mig, caps));
    }
    Ok(made_units)
}

/// Destroys the partitions among `ids` (those already gone are fine). Every one is tried; the
/// error names those that could not be destroyed.
pub(super) fn release(
    view: &View,
    partitioner: &dyn MigPartitioner,
    ids: &[String],
) -> Result<(), String> {
    let mut failed = Vec::new();
    for id in ids {
        let (gpu, part) = match view.served(id) {
            Ok(gpu) => match gpu.partition() {
                Some(part) => (gpu, part),
                None => continue,
            },
            Err(_) if view.gpus.is_empty() => {
                failed.push(format!(
                    "{id}: the GPUs are not discovered yet (NVML not open)"
                ));
                continue;
            }
            Err(_) => {
                tracing::warn!(device = %id, "a released device is no longer served; nothing destroyed");
                continue;
            }
        };
        match partitioner.destroy(&gpu.info.uuid, part.profile.id, part.start) {
            Ok(true) => tracing::info!(partition = %id, "MIG partition destroyed"),
            Ok(false) => tracing::debug!(partition = %id, "MIG partition already gone"),
            Err(err) => failed.push(format!("{id}: {err}")),
        }
    }
    if failed.is_empty() {
        Ok(())
    } else {
        Err(format!(
            "cannot destroy MIG partitions: {}",
            failed.join("; ")
        ))
    }
}
