//! Which devices the scheduler gave a claim: the `ResourceClaim`'s
//! `status.allocation.devices.results`, read from the API server by namespace and name and
//! checked against the UID the kubelet sent (a claim deleted and created again under the same
//! name is another claim). Only results of our driver count. Behind [`ClaimSource`] so that the
//! prepare path can be driven without an API server where that is the point of a test.

use crate::hold::Hold;
use crate::slices::quantity::parse_quantity;
use devplug::backend::BoxFuture;
use k8s_openapi::api::resource::v1::ResourceClaim;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// A claim as the kubelet names it in `NodePrepareResources`.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct ClaimRef {
    /// The claim's namespace.
    pub namespace: String,
    /// The claim's name.
    pub name: String,
    /// The claim's UID.
    pub uid: String,
}

impl std::fmt::Display for ClaimRef {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{} ({})", self.namespace, self.name, self.uid)
    }
}

/// One device the scheduler allocated to a claim, for one of the claim's requests.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AllocatedDevice {
    /// The request (`gpus`, or `gpus/small` for a sub-request of a prioritized list).
    pub request: String,
    /// The pool the device came from (ours: the node name).
    pub pool: String,
    /// The device's name in the ResourceSlice.
    pub device: String,
    /// How the claim holds the device: whole, a share of a device with consumable capacity,
    /// or with admin access (monitoring, maintenance: other claims may have it too).
    pub hold: Hold,
    /// What the share consumed of each capacity (empty for a whole device).
    pub consumed: BTreeMap<String, u64>,
    /// The request tolerates the driver's `<driver>/unhealthy` taint (a toleration with that
    /// key, or one for every key): it may have the device while it is unhealthy.
    pub tolerates_unhealthy: bool,
    /// The pod's name for the claim when it was made from a template (the claim's
    /// `resource.kubernetes.io/pod-claim-name` annotation; the same for every device of the
    /// claim): where its device metadata is mounted.
    pub pod_claim_name: Option<String>,
}

/// Where the prepare path learns a claim's allocation.
pub trait ClaimSource: Send + Sync + 'static {
    /// The devices of our driver allocated to `claim`, or why there are none to prepare.
    fn allocation<'a>(
        &'a self,
        claim: &'a ClaimRef,
    ) -> BoxFuture<'a, Result<Vec<AllocatedDevice>, String>>;

    /// Whether `claim` is still there: `Ok(true)` while it exists with this UID and is
    /// allocated, `Ok(false)` once it is gone (deleted, made again, deallocated), `Err` when
    /// that cannot be told (the API server did not answer). By default, whether
    /// [`ClaimSource::allocation`] finds it.
    fn exists<'a>(&'a self, claim: &'a ClaimRef) -> BoxFuture<'a, Result<bool, String>> {
        Box::pin(async move { Ok(self.allocation(claim).await.is_ok()) })
    }
}

/// Claims read from the API server.
#[derive(Clone)]
pub struct KubeClaims {
    client: kube::Client,
    driver: String,
}

impl KubeClaims {
    /// Reads claims with `client`, keeping the results of `driver`.
    pub fn new(client: kube::Client, driver: impl Into<String>) -> KubeClaims {
        KubeClaims {
            client,
            driver: driver.into(),
        }
    }

    /// The claim named as `claim` names it, if it exists (whatever its UID).
    async fn read(&self, claim: &ClaimRef) -> Result<Option<ResourceClaim>, String> {
        kube::Api::<ResourceClaim>::namespaced(self.client.clone(), &claim.namespace)
            .get_opt(&claim.name)
            .await
            .map_err(|e| format!("cannot read ResourceClaim {claim}: {e}"))
    }
}

impl ClaimSource for KubeClaims {
    fn allocation<'a>(
        &'a self,
        claim: &'a ClaimRef,
    ) -> BoxFuture<'a, Result<Vec<AllocatedDevice>, String>> {
        Box::pin(async move {
            let found = self
                .read(claim)
                .await?
                .ok_or_else(|| format!("ResourceClaim {claim} does not exist"))?;
            our_devices(&found, claim, &self.driver)
        })
    }

    fn exists<'a>(&'a self, claim: &'a ClaimRef) -> BoxFuture<'a, Result<bool, String>> {
        Box::pin(async move {
            Ok(self.read(claim).await?.is_some_and(|found| {
                found.metadata.uid.as_deref() == Some(claim.uid.as_str())
                    && found.status.and_then(|s| s.allocation).is_some()
            }))
        })
    }
}

/// The results of `driver` in `found`, after checking that it is the claim the kubelet meant.
pub fn our_devices(
    found: &ResourceClaim,
    claim: &ClaimRef,
    driver: &str,
) -> Result<Vec<AllocatedDevice>, String> {
    let uid = found.metadata.uid.as_deref().unwrap_or_default();
    if uid != claim.uid {
        return Err(format!(
            "ResourceClaim {}/{} has UID {uid:?}, not {:?}: it was deleted and created again",
            claim.namespace, claim.name, claim.uid
        ));
    }
    let results = found
        .status
        .as_ref()
        .and_then(|s| s.allocation.as_ref())
        .ok_or_else(|| format!("ResourceClaim {claim} is not allocated"))?
        .devices
        .as_ref()
        .and_then(|d| d.results.as_ref());
    let ours: Vec<AllocatedDevice> = results
        .into_iter()
        .flatten()
        .filter(|r| r.driver == driver)
        .map(|r| {
            let mut consumed = BTreeMap::new();
            for (name, q) in r.consumed_capacity.iter().flatten() {
                let value = parse_quantity(&q.0).ok_or_else(|| {
                    format!(
                        "ResourceClaim {claim}: device {} consumed {name} {:?}, not a whole \
                         number",
                        r.device, q.0
                    )
                })?;
                consumed.insert(name.clone(), value);
            }
            let pod_claim_name = found
                .metadata
                .annotations
                .as_ref()
                .and_then(|a| a.get(crate::prepare::POD_CLAIM_NAME_ANNOTATION))
                .cloned();
            let taint = crate::slices::unhealthy_taint_key(driver);
            let tolerates_unhealthy = r.tolerations.iter().flatten().any(|t| match &t.key {
                Some(key) => *key == taint,
                None => t.operator.as_deref() == Some("Exists"),
            });
            Ok(AllocatedDevice {
                request: r.request.clone(),
                pool: r.pool.clone(),
                device: r.device.clone(),
                hold: Hold::from_parts(r.share_id.clone(), r.admin_access.unwrap_or(false)),
                consumed,
                tolerates_unhealthy,
                pod_claim_name,
            })
        })
        .collect::<Result<_, String>>()?;
    if ours.is_empty() {
        return Err(format!(
            "ResourceClaim {claim} has no device of driver {driver} in its allocation"
        ));
    }
    Ok(ours)
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::api::resource::v1::{
        AllocationResult, DeviceAllocationResult, DeviceRequestAllocationResult,
        ResourceClaimStatus,
    };

    fn result(driver: &str, device: &str) -> DeviceRequestAllocationResult {
        DeviceRequestAllocationResult {
            driver: driver.into(),
            pool: "node-a".into(),
            device: device.into(),
            request: "npus".into(),
            ..Default::default()
        }
    }

    fn claim(uid: &str, results: Option<Vec<DeviceRequestAllocationResult>>) -> ResourceClaim {
        let mut claim = ResourceClaim::default();
        claim.metadata.uid = Some(uid.into());
        claim.status = Some(ResourceClaimStatus {
            allocation: results.map(|results| AllocationResult {
                devices: Some(DeviceAllocationResult {
                    results: Some(results),
                    config: None,
                }),
                ..Default::default()
            }),
            ..Default::default()
        });
        claim
    }

    #[test]
    fn keeps_our_results_and_checks_the_uid() {
        let want = ClaimRef {
            namespace: "ns".into(),
            name: "c".into(),
            uid: "u1".into(),
        };
        let found = claim(
            "u1",
            Some(vec![
                result("npu.example.com", "npu-1"),
                result("other.io", "x"),
            ]),
        );
        let ours = our_devices(&found, &want, "npu.example.com").unwrap();
        assert_eq!(ours.len(), 1);
        assert_eq!(
            (ours[0].device.as_str(), ours[0].request.as_str()),
            ("npu-1", "npus")
        );
        let err = our_devices(&claim("u2", None), &want, "npu.example.com").unwrap_err();
        assert!(err.contains("deleted and created again"), "{err}");
        let err = our_devices(&claim("u1", None), &want, "npu.example.com").unwrap_err();
        assert!(err.contains("not allocated"), "{err}");
        let err = our_devices(&found, &want, "gpu.example.com").unwrap_err();
        assert!(err.contains("no device of driver gpu.example.com"), "{err}");
    }

    #[test]
    fn shares_consumed_capacity_and_tolerations_are_read() {
        use k8s_openapi::api::resource::v1::DeviceToleration;
        use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
        let want = ClaimRef {
            namespace: "ns".into(),
            name: "c".into(),
            uid: "u1".into(),
        };
        let toleration = |key: Option<&str>, operator: &str| DeviceToleration {
            key: key.map(str::to_owned),
            operator: Some(operator.to_owned()),
            ..Default::default()
        };
        let with =
            |tolerations: Vec<DeviceToleration>, cores: &str| DeviceRequestAllocationResult {
                share_id: Some("s".into()),
                consumed_capacity: Some(BTreeMap::from([(
                    "cores".to_owned(),
                    Quantity(cores.into()),
                )])),
                tolerations: Some(tolerations),
                ..result("npu.example.com", "npu-1")
            };
        let read = |r: DeviceRequestAllocationResult| {
            our_devices(&claim("u1", Some(vec![r])), &want, "npu.example.com")
        };
        let ours = read(with(
            vec![toleration(Some("npu.example.com/unhealthy"), "Exists")],
            "40",
        ))
        .unwrap();
        assert_eq!(ours[0].consumed["cores"], 40);
        assert!(ours[0].tolerates_unhealthy);
        assert!(read(with(vec![toleration(None, "Exists")], "1k")).unwrap()[0].tolerates_unhealthy);
        let other = read(with(vec![toleration(Some("x.io/other"), "Exists")], "1")).unwrap();
        assert!(!other[0].tolerates_unhealthy);
        let err = read(with(vec![], "0.5")).unwrap_err();
        assert!(
            err.contains("consumed cores \"0.5\", not a whole number"),
            "{err}"
        );
    }
}
