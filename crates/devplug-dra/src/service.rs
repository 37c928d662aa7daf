//! The kubelet's `DRAPlugin` service, v1 and v1beta1, over a [`Preparer`]: the same answers in
//! both packages (v1beta1 lacks `share_id`). One template, instantiated per package, so the two
//! cannot drift apart.

use super::checkpoint::PreparedDevice;
use super::claims::ClaimRef;
use super::prepare::Preparer;
use std::sync::Arc;

/// The claims of a request (either package's `Claim`) as [`ClaimRef`]s.
macro_rules! claim_refs {
    ($claims:expr) => {
        $claims
            .into_iter()
            .map(|c| ClaimRef {
                namespace: c.namespace,
                name: c.name,
                uid: c.uid,
            })
            .collect::<Vec<ClaimRef>>()
    };
}

macro_rules! dra_service {
    ($name:ident, $pkg:ident, $device:path) => {
        /// `DRAPlugin` of package
        #[doc = concat!("`k8s.io.kubelet.pkg.apis.dra.", stringify!($pkg), "`.")]
        #[derive(Clone)]
        pub struct $name(pub Arc<Preparer>);

        impl $name {
            /// The tonic server of this service.
            pub fn server(
                preparer: Arc<Preparer>,
            ) -> devplug_proto::$pkg::dra_plugin_server::DraPluginServer<$name> {
                devplug_proto::$pkg::dra_plugin_server::DraPluginServer::new($name(preparer))
            }
        }

        #[tonic::async_trait]
        impl devplug_proto::$pkg::dra_plugin_server::DraPlugin for $name {
            async fn node_prepare_resources(
                &self,
                request: tonic::Request<devplug_proto::$pkg::NodePrepareResourcesRequest>,
            ) -> Result<
                tonic::Response<devplug_proto::$pkg::NodePrepareResourcesResponse>,
                tonic::Status,
            > {
                use devplug_proto::$pkg as pb;
                let claims = claim_refs!(request.into_inner().claims);
                let results = self.0.prepare(&claims).await;
                let claims = results
                    .into_iter()
                    .map(|(uid, result)| {
                        let answer = match result {
                            Ok(devices) => pb::NodePrepareResourceResponse {
                                devices: devices.into_iter().map($device).collect(),
                                error: String::new(),
                            },
                            Err(error) => pb::NodePrepareResourceResponse {
                                devices: Vec::new(),
                                error: error.to_string(),
                            },
                        };
                        (uid, answer)
                    })
                    .collect();
                Ok(tonic::Response::new(pb::NodePrepareResourcesResponse {
                    claims,
                }))
            }

            async fn node_unprepare_resources(
                &self,
                request: tonic::Request<devplug_proto::$pkg::NodeUnprepareResourcesRequest>,
            ) -> Result<
                tonic::Response<devplug_proto::$pkg::NodeUnprepareResourcesResponse>,
                tonic::Status,
            > {
                use devplug_proto::$pkg as pb;
                let claims = claim_refs!(request.into_inner().claims);
                let claims = self
                    .0
                    .unprepare(&claims)
                    .await
                    .into_iter()
                    .map(|(uid, result)| {
                        let error = result.err().map(|e| e.to_string()).unwrap_or_default();
                        (uid, pb::NodeUnprepareResourceResponse { error })
                    })
                    .collect();
                Ok(tonic::Response::new(pb::NodeUnprepareResourcesResponse {
                    claims,
                }))
            }
        }
    };
}

dra_service!(DraV1, dra_v1, v1_device);
dra_service!(DraV1beta1, dra_v1beta1, v1beta1_device);

fn v1_device(d: PreparedDevice) -> devplug_proto::dra_v1::Device {
    devplug_proto::dra_v1::Device {
        request_names: d.request_names,
        pool_name: d.pool,
        device_name: d.device,
        cdi_device_ids: d.cdi_device_ids,
        share_id: d.hold.share_id().map(str::to_owned),
    }
}

/// v1beta1 has no `share_id` (it came with v1 in Kubernetes 1.35).
fn v1beta1_device(d: PreparedDevice) -> devplug_proto::dra_v1beta1::Device {
    devplug_proto::dra_v1beta1::Device {
        request_names: d.request_names,
        pool_name: d.pool,
        device_name: d.device,
        cdi_device_ids: d.cdi_device_ids,
    }
}
