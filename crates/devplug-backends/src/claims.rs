//! The backends whose devices go to DRA claims whole, exactly as their device plugin hands
//! them to a container: nothing is made at prepare, nothing removed at unprepare, no shares.
//! (`virtual` and `nvidia` implement [`ClaimBackend`] beside their code: shares, partitions.)

use devplug::dra::ClaimBackend;

impl ClaimBackend for crate::FilesBackend {}
impl ClaimBackend for crate::HostdevBackend {}
impl ClaimBackend for crate::AmdgpuBackend {}
impl ClaimBackend for crate::IntelGpuBackend {}
/// `vfio`, `qat`, `ascend` and `fpga`.
impl ClaimBackend for crate::NodeBackend {}
