//! A new set of resources applied to a running host, as on a config reload: resources that are
//! gone are removed, new ones added, changed ones swapped through [`Host::update`] (in place
//! where the kubelet allows: same socket, same streams), and unchanged ones left alone. The
//! caller keeps what it applied, keyed by resource name, in its own config type; parsing and
//! watching a file stay the caller's (`devplug run` does both).

use super::{Host, HostError, ResourceSettings, Updated};
use crate::backend::Backend;
use std::collections::BTreeMap;
use std::fmt::Display;
use std::sync::Arc;

/// A resource [`Host::apply`] could not apply.
#[derive(Debug, thiserror::Error)]
pub enum ApplyFailure {
    /// Its backend could not be built from its config.
    #[error("{resource}: {error}")]
    Build {
        /// The resource.
        resource: String,
        /// What the build said.
        error: String,
    },
    /// The host refused to serve it.
    #[error("cannot serve {resource}: {error}")]
    Serve {
        /// The resource.
        resource: String,
        /// Why (shown in this error's message, so not also its source).
        error: HostError,
    },
}

impl ApplyFailure {
    /// The resource that failed.
    pub fn resource(&self) -> &str {
        match self {
            ApplyFailure::Build { resource, .. } | ApplyFailure::Serve { resource, .. } => resource,
        }
    }
}

/// What [`Host::apply`] did, resource by resource.
#[derive(Debug, Default)]
pub struct Applied {
    /// Resources served from now on.
    pub added: Vec<String>,
    /// Resources whose config changed, and how each was swapped.
    pub changed: Vec<(String, Updated)>,
    /// Resources no longer served.
    pub removed: Vec<String>,
    /// Resources whose config is the same: untouched.
    pub unchanged: Vec<String>,
    /// Resources that could not be built or served, with why; each keeps its previous config
    /// (or stays absent if it was new).
    pub failed: Vec<ApplyFailure>,
}

impl Applied {
    /// True when every resource was applied.
    pub fn is_complete(&self) -> bool {
        self.failed.is_empty()
    }
}

impl Host {
    /// Makes this host serve `wanted`, given `applied`: what the caller applied before (empty the
    /// first time), which this call brings up to date. A resource whose config `C` equals the
    /// applied one is left alone; any other is built by `build` (backend and settings from its
    /// config) and added, or swapped with [`Host::update`]. A resource that cannot be built or
    /// served is reported in [`Applied::failed`] and keeps its previous config, so a bad entry
    /// never takes the others down.
    pub async fn apply<C, E>(
        &self,
        applied: &mut BTreeMap<String, C>,
        wanted: BTreeMap<String, C>,
        mut build: impl FnMut(&str, &C) -> Result<(Arc<dyn Backend>, ResourceSettings), E>,
    ) -> Applied
    where
        C: PartialEq,
        E: Display,
    {
        let mut report = Applied::default();
        let gone: Vec<String> = applied
            .keys()
            .filter(|name| !wanted.contains_key(*name))
            .cloned()
            .collect();
        for name in gone {
            self.remove(&name).await;
            applied.remove(&name);
            report.removed.push(name);
        }
        for (name, config) in wanted {
            let previous = applied.get(&name);
            if previous == Some(&config) {
                report.unchanged.push(name);
                continue;
            }
            let (backend, settings) = match build(&name, &config) {
                Ok(built) => built,
                Err(err) => {
                    report.failed.push(ApplyFailure::Build {
                        resource: name,
                        error: err.to_string(),
                    });
                    continue;
                }
            };
            let served = if previous.is_some() {
                self.update(&name, backend, settings)
                    .await
                    .map(|how| report.changed.push((name.clone(), how)))
            } else {
                self.add_with(&name, backend, settings)
                    .map(|_| report.added.push(name.clone()))
            };
            match served {
                Ok(()) => {
                    applied.insert(name, config);
                }
                Err(error) => report.failed.push(ApplyFailure::Serve {
                    resource: name,
                    error,
                }),
            }
        }
        report
    }
}
