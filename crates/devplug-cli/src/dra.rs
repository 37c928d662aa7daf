//! `dra:` resources of `devplug run`: each one's backend served as a DRA driver on this node
//! (ResourceSlices through the API server, `DRAPlugin` for the kubelet), started with the config
//! and restarted when a reload changes the resource. Prepared claims outlive a restart (the
//! driver's checkpoint); only the node's slices are taken down and published again.

use crate::config::{BuiltBackend, ResourceConfig};
use devplug_cluster::policy_check::Feature;
use devplug_dra::kubelet::{KubeletDirs, Registered};
use devplug_dra::runtime::{node_cdi_support, CdiSupport};
use devplug_dra::{DraDriver, DraDriverSettings, DraStartError};
use std::collections::BTreeMap;
use std::path::PathBuf;

/// What every driver of this process shares.
pub struct DraSetup {
    /// The kubelet's plugin folders.
    pub dirs: KubeletDirs,
    /// The folder of dynamic CDI specs.
    pub cdi_dir: PathBuf,
    /// This node's name and the API client.
    pub cluster: std::sync::Arc<crate::cluster_context::ClusterContext>,
    /// Where `/readyz` learns of a runtime that cannot apply CDI, by driver.
    pub problems: crate::endpoints::Problems,
    /// Where `/readyz` and `/metrics` find the running drivers.
    pub drivers: crate::endpoints::Drivers,
    /// The cluster features' context: node events, for a runtime that cannot apply CDI, and
    /// the gate of the drivers' slices (their admission policy in force).
    pub features: crate::cluster_features::ClusterFeatures,
}

impl crate::endpoints::DriverView for devplug_dra::DraHealth {
    fn not_ready(&self) -> Option<String> {
        devplug_dra::DraHealth::not_ready(self)
    }

    fn working(&self) -> Result<(), String> {
        devplug_dra::DraHealth::working(self)
    }

    fn counters(&self) -> crate::endpoints::DriverCounters {
        use std::sync::atomic::Ordering::Relaxed;
        let c = &self.counters;
        crate::endpoints::DriverCounters {
            publishes: c.publishes.load(Relaxed),
            errors: c.errors.load(Relaxed),
            consecutive_failures: c.consecutive_failures.load(Relaxed),
            last_success_unix: c.last_success_unix.load(Relaxed),
            resyncs: c.resyncs.load(Relaxed),
            registered: u64::from(matches!(
                *self.registered.borrow(),
                devplug_dra::kubelet::Registered::Yes
            )),
            status_writes: self.status.writes.load(Relaxed),
            status_errors: self.status.errors.load(Relaxed),
            claims: self.claims.snapshot(),
        }
    }
}

/// The `dra:` resources of `resources`, by name.
fn wanted(resources: &[ResourceConfig]) -> BTreeMap<&str, &ResourceConfig> {
    resources
        .iter()
        .filter(|r| r.dra.is_some())
        .map(|r| (r.name.as_str(), r))
        .collect()
}

/// The running drivers, by resource name.
pub struct DraDrivers {
    setup: DraSetup,
    running: BTreeMap<String, (ResourceConfig, DraDriver)>,
    /// The node's runtime, judged once: `None` until read.
    runtime: Option<CdiSupport>,
    /// Drivers whose runtime problem is not yet published as a Node event.
    unannounced: Vec<(String, String)>,
}

impl DraDrivers {
    /// No drivers yet.
    pub fn new(setup: DraSetup) -> DraDrivers {
        DraDrivers {
            setup,
            running: BTreeMap::new(),
            runtime: None,
            unannounced: Vec::new(),
        }
    }

    /// Starts the drivers of `resources` (the `dra:` ones) that do not run, after
    /// [`DraDrivers::stop_changed`] stopped the removed and changed ones. `shared` gives a
    /// backend already built for a resource's device plugin, so both serve one instance.
    /// Returns the resources that failed.
    async fn serve(
        &mut self,
        resources: &[ResourceConfig],
        shared: &BTreeMap<String, BuiltBackend>,
    ) -> Vec<(String, anyhow::Error)> {
        let wanted = wanted(resources);
        let mut failed = Vec::new();
        for (name, resource) in wanted {
            if self.running.contains_key(name) {
                continue;
            }
            match self.start(resource, shared.get(name).cloned()).await {
                Ok(Some(driver)) => {
                    let health = driver.health();
                    self.setup
                        .drivers
                        .write()
                        .unwrap_or_else(|e| e.into_inner())
                        .insert(health.driver.clone(), Box::new(health));
                    self.running
                        .insert(name.to_owned(), (resource.clone(), driver));
                }
                // Refused alone, and said in `/readyz`: the other resources go on.
                Ok(None) => {}
                Err(err) => failed.push((name.to_owned(), err)),
            }
        }
        failed
    }

    /// Stops the drivers whose resource left `resources` or changed (before a changed
    /// resource's new backend is built: one instance at a time).
    async fn stop_changed(&mut self, resources: &[ResourceConfig]) {
        let wanted = wanted(resources);
        let stale: Vec<String> = self
            .running
            .iter()
            .filter(|(name, (config, _))| wanted.get(name.as_str()) != Some(&config))
            .map(|(name, _)| name.clone())
            .collect();
        for name in stale {
            if let Some((config, driver)) = self.running.remove(&name) {
                if let Some(dra) = &config.dra {
                    self.setup
                        .drivers
                        .write()
                        .unwrap_or_else(|e| e.into_inner())
                        .remove(&dra.driver);
                    self.setup
                        .problems
                        .write()
                        .unwrap_or_else(|e| e.into_inner())
                        .remove(&format!("DRA driver {}", dra.driver));
                }
                // A driver the new config still serves (its resource changed) keeps its slices
                // for its next instance, which publishes over them; one it no longer serves
                // takes them down now.
                let still_served = config.dra.as_ref().is_some_and(|old| {
                    wanted
                        .values()
                        .any(|r| r.dra.as_ref().is_some_and(|new| new.driver == old.driver))
                });
                let problems = if still_served {
                    driver.shutdown().await
                } else {
                    driver.remove().await
                };
                for problem in problems {
                    tracing::warn!(resource = %name, %problem, "DRA driver not fully cleaned up");
                }
            }
        }
    }

    /// Starts one driver. `Ok(None)`: this driver alone cannot start, for a reason in `/readyz`
    /// and the log that takes an operator (a checkpoint it cannot use: the claims it lists may
    /// still be in use, so neither guessing nor starting empty is safe).
    async fn start(
        &mut self,
        resource: &ResourceConfig,
        backend: Option<BuiltBackend>,
    ) -> anyhow::Result<Option<DraDriver>> {
        let Some(dra) = &resource.dra else {
            anyhow::bail!("{} has no dra: settings", resource.name);
        };
        let node = self.setup.cluster.need_node("dra: resources need")?;
        let backend = match backend {
            Some(backend) => backend,
            None => {
                resource
                    .build()
                    .map_err(|(key, err)| anyhow::anyhow!("{}: {key}.{err}", resource.name))?
                    .backend
            }
        };
        // A problem from an earlier attempt is said again below if it still holds.
        self.setup
            .problems
            .write()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&format!("DRA driver {}", dra.driver));
        let client = self.setup.cluster.client().await?;
        self.check_runtime(&client, &node, &dra.driver).await;
        let settings = DraDriverSettings {
            driver: dra.driver.clone(),
            node,
            dirs: self.setup.dirs.clone(),
            cdi_dir: self.setup.cdi_dir.clone(),
            no_execute_after: dra.no_execute_after,
            device_metadata: dra.device_metadata,
        };
        // Its slices wait for the proof that the policy keeping them to this node is in
        // force (with --require-policies; without, a missing one is said once and they go),
        // then for the kubelet to have registered the driver: a slice published before that
        // lets the scheduler bind a pod the kubelet cannot prepare yet ("DRA driver ... is not
        // registered"), which it retries only after its pod sync backoff (13-16 s on the
        // whole node, docs/benchmarks.md). Slices kept from an earlier instance stay published
        // meanwhile.
        let gate = self.setup.features.gate(&client, &settings.node);
        let (registration_tx, registration) =
            tokio::sync::watch::channel(None::<tokio::sync::watch::Receiver<Registered>>);
        let slices_gate: devplug_dra::slices::WriteGate = std::sync::Arc::new(move || {
            let gate = gate.clone();
            let mut registration = registration.clone();
            Box::pin(async move {
                gate.pass(Feature::DraSlices).await;
                // The driver's registration status, once its start has returned.
                let Ok(status) = registration
                    .wait_for(Option::is_some)
                    .await
                    .map(|r| r.clone())
                else {
                    return;
                };
                if let Some(mut status) = status {
                    let _ = status.wait_for(|r| *r == Registered::Yes).await;
                }
            })
        });
        let started = DraDriver::start_gated(settings, backend, client, Some(slices_gate)).await;
        if let Ok(driver) = &started {
            let _ = registration_tx.send(Some(driver.registered()));
        }
        let driver = match started {
            Ok(driver) => driver,
            Err(DraStartError::Checkpoint(err)) => {
                tracing::error!(resource = %resource.name, driver = %dra.driver, error = %err, "this DRA driver cannot start; the other resources run");
                self.setup
                    .problems
                    .write()
                    .unwrap_or_else(|e| e.into_inner())
                    .insert(format!("DRA driver {}", dra.driver), err.to_string());
                return Ok(None);
            }
            Err(err) => {
                return Err(anyhow::Error::new(err).context(format!(
                    "cannot start DRA driver {} for {}",
                    dra.driver, resource.name
                )))
            }
        };
        tracing::info!(resource = %resource.name, driver = %dra.driver, "serving as a DRA driver");
        Ok(Some(driver))
    }

    /// Says, at ERROR and in `/readyz`, when this node's runtime cannot apply the CDI specs
    /// through which `driver` hands its devices over (read from the Node once per process).
    async fn check_runtime(&mut self, client: &kube::Client, node: &str, driver: &str) {
        if self.runtime.is_none() {
            match node_cdi_support(client.clone(), node).await {
                Ok((version, support)) => {
                    match &support {
                        CdiSupport::No(problem) => {
                            tracing::error!(%node, %problem, "DRA claims will reach no container on this node")
                        }
                        CdiSupport::IfEnabled(problem) => {
                            tracing::warn!(%node, %problem, "check that the container runtime applies CDI specs")
                        }
                        CdiSupport::Yes => {
                            tracing::debug!(%node, %version, "the container runtime applies CDI specs")
                        }
                        CdiSupport::Unknown => {
                            tracing::info!(%node, %version, "cannot tell whether this container runtime applies CDI specs; DRA devices reach containers only if it does")
                        }
                    }
                    self.runtime = Some(support);
                }
                Err(err) => {
                    tracing::warn!(%node, %err, "cannot read the Node's container runtime version; not checked for CDI");
                    return;
                }
            }
        }
        if let Some(CdiSupport::No(problem)) = &self.runtime {
            self.setup
                .problems
                .write()
                .unwrap_or_else(|e| e.into_inner())
                .insert(format!("DRA driver {driver}"), problem.clone());
            self.unannounced.push((driver.to_owned(), problem.clone()));
        }
    }

    /// Publishes the runtime problems found since the last call as Node events.
    fn announce_runtime_problems(&mut self) {
        let problems = std::mem::take(&mut self.unannounced);
        let Some(events) = self.setup.features.events() else {
            return;
        };
        for (driver, problem) in problems {
            events.publish(devplug_cluster::events::NodeEvent {
                warning: true,
                reason: "ContainerRuntimeWithoutCDI".into(),
                action: driver.clone(),
                note: format!("DRA driver {driver}: {problem}"),
            });
        }
    }
}

#[async_trait::async_trait]
impl crate::cluster_feature::ClusterFeature for DraDrivers {
    fn name(&self) -> &'static str {
        "dra"
    }

    fn stage(&self) -> crate::cluster_feature::Stage {
        crate::cluster_feature::Stage::AfterHost
    }

    /// Stops the drivers whose resource left or changed, before the host builds the new
    /// backends.
    async fn release(&mut self, config: &crate::config::Config) {
        self.stop_changed(&config.resources).await;
    }

    /// Starts the new and changed drivers, a `device_plugin: true` resource's with the backend
    /// the host built for it; the first that failed is the error.
    async fn apply(&mut self, desired: &crate::cluster_feature::Desired<'_>) -> anyhow::Result<()> {
        let failed = self
            .serve(&desired.config.resources, desired.backends)
            .await;
        self.announce_runtime_problems();
        match failed.into_iter().next() {
            None => Ok(()),
            Some((name, err)) => Err(err.context(format!("cannot serve {name} as a DRA driver"))),
        }
    }

    /// Stops every driver: sockets removed; the node's slices and prepared claims kept for the
    /// next start (the kubelet wipes the slices of a driver that does not come back).
    async fn stop(&mut self) {
        for (name, (_, driver)) in std::mem::take(&mut self.running) {
            for problem in driver.shutdown().await {
                tracing::warn!(resource = %name, %problem, "DRA driver not fully cleaned up");
            }
        }
    }
}
