//! Registering a resource with the kubelet: one `Register` call on `kubelet.sock`.
//!
//! The kubelet dials our socket back and calls `GetDevicePluginOptions` inside this call, so the
//! caller must already be serving.

use crate::backend::Options;
use devplug_proto::constants::VERSION;
use devplug_proto::uds;
use devplug_proto::v1beta1::{
    registration_client::RegistrationClient, DevicePluginOptions, RegisterRequest,
};
use std::path::Path;
use std::time::Duration;

/// How long one registration may take: the kubelet's own dial back waits up to 10 s.
const REGISTER_TIMEOUT: Duration = Duration::from_secs(30);

/// Why a registration did not succeed.
#[derive(Debug, thiserror::Error)]
pub(crate) enum RegisterError {
    /// `kubelet.sock` did not accept a connection.
    #[error("cannot connect to {path}: {source}")]
    Connect {
        path: String,
        #[source]
        source: tonic::transport::Error,
    },
    /// The kubelet answered with an error.
    #[error("the kubelet refused the registration: {}", .0.message())]
    Refused(tonic::Status),
}

impl RegisterError {
    /// The kubelet answered and said no (as opposed to not answering yet).
    pub(crate) fn is_refusal(&self) -> bool {
        matches!(self, RegisterError::Refused(_))
    }
}

/// Sends one `RegisterRequest` for `resource`, served on `endpoint` (a file name in the folder).
pub(crate) async fn register(
    kubelet_socket: &Path,
    resource: &str,
    endpoint: &str,
    options: Options,
) -> Result<(), RegisterError> {
    let channel = uds::connect(kubelet_socket, REGISTER_TIMEOUT)
        .await
        .map_err(|source| RegisterError::Connect {
            path: kubelet_socket.display().to_string(),
            source,
        })?;
    let mut request = tonic::Request::new(RegisterRequest {
        version: VERSION.to_owned(),
        endpoint: endpoint.to_owned(),
        resource_name: resource.to_owned(),
        options: Some(DevicePluginOptions {
            pre_start_required: options.pre_start_required,
            get_preferred_allocation_available: options.preferred_allocation,
        }),
    });
    request.set_timeout(REGISTER_TIMEOUT);
    RegistrationClient::new(channel)
        .register(request)
        .await
        .map_err(RegisterError::Refused)?;
    Ok(())
}
