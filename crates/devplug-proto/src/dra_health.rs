//! A client's view of a DRA driver's device health stream (`DRAResourceHealth/
//! NodeWatchResources`) in either version a driver may serve: `v1` (Kubernetes 1.37+, which
//! prefers it) or `v1alpha1` (1.34+). The messages come in `v1`'s types whichever version was
//! opened (v1 is v1alpha1 promoted: the same fields). The kubelet simulator and
//! `devplug inspect` read health through it.

use crate::constants::DRA_HEALTH_SERVICES;
use crate::{dra_health_v1 as v1, dra_health_v1alpha1 as alpha};
use tonic::transport::Channel;

/// A version of the device health service (`DRAResourceHealth`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum HealthService {
    /// `v1.DRAResourceHealth` (kubelets 1.37+, which prefer it).
    V1,
    /// `v1alpha1.DRAResourceHealth` (kubelets 1.34+; 1.37-1.39 for drivers without v1).
    V1alpha1,
}

impl HealthService {
    /// Every version, newest first.
    pub const ALL: [HealthService; 2] = [HealthService::V1, HealthService::V1alpha1];

    /// The name a plugin lists in `supported_versions` (`"v1.DRAResourceHealth"`).
    pub fn name(self) -> &'static str {
        match self {
            HealthService::V1 => DRA_HEALTH_SERVICES[0],
            HealthService::V1alpha1 => DRA_HEALTH_SERVICES[1],
        }
    }

    /// The version a 1.37 kubelet opens for a plugin listing `supported`: `v1` where listed,
    /// else `v1alpha1` where listed, else none (the plugin serves no health stream).
    pub fn pick(supported: &[String]) -> Option<HealthService> {
        HealthService::ALL
            .into_iter()
            .find(|h| supported.iter().any(|s| s == h.name()))
    }
}

/// A driver's device health stream, in the version opened.
pub struct HealthStream {
    service: HealthService,
    inner: Inner,
}

enum Inner {
    V1(tonic::Streaming<v1::NodeWatchResourcesResponse>),
    V1alpha1(tonic::Streaming<alpha::NodeWatchResourcesResponse>),
}

impl HealthStream {
    /// Opens the stream on `channel` in `service`.
    pub async fn open(
        channel: Channel,
        service: HealthService,
    ) -> Result<HealthStream, tonic::Status> {
        let inner = match service {
            HealthService::V1 => Inner::V1(
                v1::dra_resource_health_client::DraResourceHealthClient::new(channel)
                    .node_watch_resources(v1::NodeWatchResourcesRequest {})
                    .await?
                    .into_inner(),
            ),
            HealthService::V1alpha1 => Inner::V1alpha1(
                alpha::dra_resource_health_client::DraResourceHealthClient::new(channel)
                    .node_watch_resources(alpha::NodeWatchResourcesRequest {})
                    .await?
                    .into_inner(),
            ),
        };
        Ok(HealthStream { service, inner })
    }

    /// Opens the stream in `v1`, or in `v1alpha1` where the driver answers `v1` with
    /// `Unimplemented` (a driver built before 1.37).
    pub async fn open_newest(channel: Channel) -> Result<HealthStream, tonic::Status> {
        match HealthStream::open(channel.clone(), HealthService::V1).await {
            Err(status) if status.code() == tonic::Code::Unimplemented => {
                HealthStream::open(channel, HealthService::V1alpha1).await
            }
            opened => opened,
        }
    }

    /// The version opened.
    pub fn service(&self) -> HealthService {
        self.service
    }

    /// The next message; `None` once the driver ended the stream.
    pub async fn message(
        &mut self,
    ) -> Result<Option<v1::NodeWatchResourcesResponse>, tonic::Status> {
        match &mut self.inner {
            Inner::V1(stream) => stream.message().await,
            Inner::V1alpha1(stream) => Ok(stream.message().await?.map(Into::into)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_the_registration_names() {
        assert_eq!(HealthService::V1.name(), "v1.DRAResourceHealth");
        assert_eq!(HealthService::V1alpha1.name(), "v1alpha1.DRAResourceHealth");
    }
}
