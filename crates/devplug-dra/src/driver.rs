//! One backend served as a DRA driver on this node: the ResourceSlices of its devices, its
//! sockets and plugin-watcher registration, and claim preparation, started and stopped as one.

use super::checkpoint::{CheckpointError, PreparedClaim};
use super::claims::KubeClaims;
use super::kubelet::{KubeletDirs, KubeletSide, Registered};
use super::prepare::{PrepareFiles, Preparer};
use super::slices::{SliceError, SliceOptions, SlicePublisher, WriteGate};
use devplug::dra::ClaimBackend;
use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

/// Where and as what a driver runs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DraDriverSettings {
    /// The driver name (a DNS subdomain, e.g. `npu.example.com`).
    pub driver: String,
    /// This node's name: the pool name and the slices' node.
    pub node: String,
    /// The kubelet's plugin folders.
    pub dirs: KubeletDirs,
    /// The folder of dynamic CDI specs (`/var/run/cdi`).
    pub cdi_dir: PathBuf,
    /// How long a device stays unhealthy before its taint turns `NoExecute` (none: never).
    pub no_execute_after: Option<std::time::Duration>,
    /// Give each prepared claim's containers their device metadata files (KEP-5304).
    pub device_metadata: bool,
}

/// Why a driver could not start.
#[derive(Debug, thiserror::Error)]
pub enum DraStartError {
    /// The checkpoint of prepared claims cannot be used.
    #[error(transparent)]
    Checkpoint(#[from] CheckpointError),
    /// The slice publisher refused to start (a driver name the API server would refuse).
    #[error(transparent)]
    Slices(#[from] SliceError),
    /// A socket could not be served.
    #[error("DRA driver {driver}: cannot serve its sockets in {dir}: {source}")]
    Sockets {
        /// The driver.
        driver: String,
        /// The driver's folder.
        dir: String,
        /// Why.
        source: std::io::Error,
    },
}

/// A running DRA driver.
pub struct DraDriver {
    status: crate::device_status::DeviceStatusWriter,
    preparer: Arc<Preparer>,
    kubelet: KubeletSide,
    slices: SlicePublisher,
    stop: CancellationToken,
}

impl DraDriver {
    /// Starts publishing `backend`'s devices and serving the kubelet.
    pub async fn start(
        settings: DraDriverSettings,
        backend: Arc<dyn ClaimBackend>,
        client: kube::Client,
    ) -> Result<DraDriver, DraStartError> {
        Self::start_gated(settings, backend, client, None).await
    }

    /// [`DraDriver::start`], its ResourceSlices published only once `slices_gate` returns
    /// ([`WriteGate`]: the proof that the admission policy keeping them to this node is in
    /// force). The kubelet is served meanwhile: claims already allocated on this node are
    /// prepared; no new ones come while the node publishes no slices.
    pub async fn start_gated(
        settings: DraDriverSettings,
        backend: Arc<dyn ClaimBackend>,
        client: kube::Client,
        slices_gate: Option<WriteGate>,
    ) -> Result<DraDriver, DraStartError> {
        let driver = settings.driver.clone();
        let stop = CancellationToken::new();
        let slices = SlicePublisher::spawn_gated(
            client.clone(),
            &driver,
            &settings.node,
            backend.devices(),
            &stop,
            SliceOptions {
                no_execute_after: settings.no_execute_after,
            },
            slices_gate,
        )?;
        let files = PrepareFiles {
            cdi_dir: settings.cdi_dir.clone(),
            checkpoint: settings.dirs.driver_dir(&driver).join("checkpoint.json"),
        };
        let claims = Arc::new(KubeClaims::new(client.clone(), driver.clone()));
        let preparer = Arc::new(
            Preparer::new(&driver, &settings.node, backend.clone(), claims, files)?
                .with_device_metadata(settings.device_metadata),
        );
        // Devices with shares prepared before a restart: the backend starts what serves them
        // again (an MPS daemon), once it has found its devices.
        let restored: Vec<String> = preparer.shared_devices().await.into_iter().collect();
        if !restored.is_empty() {
            tokio::spawn(crate::prepare::restore_shares(backend.clone(), restored));
        }
        let status = crate::device_status::DeviceStatusWriter::spawn(
            client.clone(),
            &driver,
            preparer.saved(),
            backend.devices(),
            stop.child_token(),
        );
        let kubelet = KubeletSide::start(preparer.clone(), &settings.dirs).map_err(|source| {
            DraStartError::Sockets {
                driver: driver.clone(),
                dir: settings.dirs.driver_dir(&driver).display().to_string(),
                source,
            }
        })?;
        Ok(DraDriver {
            status,
            preparer,
            kubelet,
            slices,
            stop,
        })
    }

    /// The `DRAPlugin` socket this instance serves (its name is this instance's own).
    pub fn endpoint(&self) -> &std::path::Path {
        self.kubelet.endpoint()
    }

    /// The registration socket of this instance, which the kubelet's plugin watcher finds.
    pub fn registration_path(&self) -> &std::path::Path {
        self.kubelet.registration_path()
    }

    /// What the kubelet last said about the registration.
    pub fn registered(&self) -> watch::Receiver<Registered> {
        self.kubelet.registered()
    }

    /// The prepared claims, by UID.
    pub async fn prepared(&self) -> BTreeMap<String, PreparedClaim> {
        self.preparer.prepared().await
    }

    /// What probes and metrics read of this driver.
    pub fn health(&self) -> crate::DraHealth {
        crate::DraHealth {
            driver: self.preparer.driver().to_owned(),
            counters: self.slices.shared_counters(),
            claims: self.preparer.metrics().clone(),
            status: self.status.counters(),
            published: self.slices.published(),
            registered: self.kubelet.registered(),
            registry: self.kubelet.folder_health(),
        }
    }

    /// The slice publisher (counters, published generation).
    pub fn slices(&self) -> &SlicePublisher {
        &self.slices
    }

    /// Stops serving and removes the sockets, as at SIGTERM; the node's slices stay published
    /// for the next start ([`SlicePublisher::stop`]: no scheduling gap across a restart) and
    /// prepared claims stay prepared (their CDI specs and the checkpoint are kept). Returns what
    /// could not be cleaned up.
    pub async fn shutdown(self) -> Vec<String> {
        self.stop.cancel();
        let problems = self.kubelet.stop().await;
        self.slices.stop().await;
        problems
    }

    /// Stops serving for good (its resource left the config): the sockets and the node's slices
    /// of this driver removed; prepared claims stay prepared as with [`DraDriver::shutdown`].
    /// Returns what could not be cleaned up.
    pub async fn remove(self) -> Vec<String> {
        self.stop.cancel();
        let mut problems = self.kubelet.stop().await;
        if let Err(err) = self.slices.remove().await {
            problems.push(format!("ResourceSlices: {err}"));
        }
        problems
    }
}
