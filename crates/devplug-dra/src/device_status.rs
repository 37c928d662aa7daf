//! ResourceClaim device status (KEP-4817; beta since Kubernetes 1.33, GA in 1.37): for each
//! device this driver prepared, an entry in its claim's `status.devices` with the device's
//! driver, pool, name (and share id), a `Ready` condition and `data` that a workload's operator
//! reads with `kubectl get resourceclaim -o yaml`: the device's attributes as published (the
//! GPU's or MIG device's `uuid`, its `pciBusID`, its model...), the CDI devices the runtime
//! injects, and how the claim holds it. The condition follows the device's health; the entries
//! go when the claim is unprepared.
//!
//! Event-driven: the writer follows two latest-value channels, the prepared claims (sent by the
//! preparer after each checkpoint write) and the backend's device list, and writes only the
//! claims whose entries changed, after the kubelet has its answer (a prepare never waits for
//! it). Each write is a server-side apply of the status subresource with the driver's name as
//! field manager, so the entries of other drivers in the same claim are left alone, and
//! applying none removes ours. Kubernetes 1.36 checks such a write against
//! `resourceclaims/driver` with the verb `associated-node:patch` (the
//! `DRAResourceClaimGranularStatusAuthorization` gate, on by default): a node's token writes
//! only claims allocated on its own node, which is what the chart grants.
//!
//! A write the API server refuses (no permission, a claim made again under the same name) is
//! logged once per claim and counted, and not repeated until that claim's entries change; a
//! write that fails otherwise (API server away) is tried again after a jittered backoff.

use crate::checkpoint::{PreparedClaim, PreparedDevice};
use crate::hold::Hold;
use devplug::dra::AttributeValue;
use devplug::host::backoff::Backoff;
use devplug::{DeviceList, Health};
use k8s_openapi::api::resource::v1::ResourceClaim;
use k8s_openapi::jiff::Timestamp;
use kube::api::{Patch, PatchParams};
use serde_json::{json, Map, Value};
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

/// The prepared claims of a driver, by UID, as the preparer last saved them.
pub type PreparedClaims = Arc<BTreeMap<String, PreparedClaim>>;

/// The condition type every entry carries.
pub const READY: &str = "Ready";

/// How the writer has done, for metrics.
#[derive(Debug, Default)]
pub struct DeviceStatusCounters {
    /// Claims whose entries were written (set or removed).
    pub writes: AtomicU64,
    /// Writes the API server refused or that failed.
    pub errors: AtomicU64,
}

/// An entry's identity in a claim: (claim UID, device, share id).
type EntryKey = (String, String, Option<String>);

/// One device's entry as the writer wants it, without the condition's time.
#[derive(Debug, Clone, PartialEq)]
struct Entry {
    pool: String,
    device: String,
    share_id: Option<String>,
    ready: bool,
    reason: &'static str,
    message: String,
    data: Value,
}

/// What the writer wants in one claim.
#[derive(Debug, Clone, PartialEq)]
struct Wanted {
    namespace: String,
    name: String,
    entries: Vec<Entry>,
}

/// The running writer of one driver.
pub struct DeviceStatusWriter {
    counters: Arc<DeviceStatusCounters>,
}

impl DeviceStatusWriter {
    /// Follows `prepared` and `devices` and writes `driver`'s entries with `client` until
    /// `stop`. Entries stay at `stop`: the claims stay prepared across a restart.
    pub fn spawn(
        client: kube::Client,
        driver: &str,
        prepared: watch::Receiver<PreparedClaims>,
        devices: watch::Receiver<DeviceList>,
        stop: CancellationToken,
    ) -> DeviceStatusWriter {
        let counters = Arc::new(DeviceStatusCounters::default());
        let writer = Writer {
            client,
            driver: driver.to_owned(),
            counters: counters.clone(),
            written: BTreeMap::new(),
            since: BTreeMap::new(),
            warned: false,
        };
        tokio::spawn(writer.run(prepared, devices, stop));
        DeviceStatusWriter { counters }
    }

    /// The writer's counters.
    pub fn counters(&self) -> Arc<DeviceStatusCounters> {
        self.counters.clone()
    }
}

struct Writer {
    client: kube::Client,
    driver: String,
    counters: Arc<DeviceStatusCounters>,
    /// What each claim has from us, as last written (or refused), by UID.
    written: BTreeMap<String, Wanted>,
    /// Each entry's `Ready` and when it last changed, by (claim UID, device, share id).
    since: BTreeMap<EntryKey, (bool, Timestamp)>,
    /// Whether a refusal was logged at WARN already (the next ones go to DEBUG).
    warned: bool,
}

/// How a write ended.
enum Outcome {
    /// Written, or nothing to write any more (the claim is gone).
    Done,
    /// Refused for good: not tried again until the entries change.
    Refused(String),
    /// Failed for now: tried again.
    Retry(String),
}

impl Writer {
    async fn run(
        mut self,
        mut prepared: watch::Receiver<PreparedClaims>,
        mut devices: watch::Receiver<DeviceList>,
        stop: CancellationToken,
    ) {
        let mut backoff =
            Backoff::new(Duration::from_millis(500), Duration::from_secs(30)).jittered();
        loop {
            let claims = prepared.borrow_and_update().clone();
            let list = devices.borrow_and_update().clone();
            let wanted = wanted(&self.driver, &claims, &list);
            let retry = self.converge(wanted, &stop).await;
            let wait = if retry {
                backoff.next_delay()
            } else {
                backoff.reset();
                Duration::ZERO
            };
            tokio::select! {
                () = stop.cancelled() => return,
                changed = prepared.changed() => if changed.is_err() { return },
                changed = devices.changed() => if changed.is_err() { return },
                () = tokio::time::sleep(wait), if retry => {}
            }
        }
    }

    /// Writes every claim whose entries differ from what it has; whether one must be tried
    /// again.
    async fn converge(
        &mut self,
        wanted: BTreeMap<String, Wanted>,
        stop: &CancellationToken,
    ) -> bool {
        let mut retry = false;
        let gone: Vec<String> = self
            .written
            .keys()
            .filter(|uid| !wanted.contains_key(*uid))
            .cloned()
            .collect();
        for uid in gone {
            if stop.is_cancelled() {
                return false;
            }
            let Some(had) = self.written.get(&uid).cloned() else {
                continue;
            };
            let none = Wanted {
                entries: Vec::new(),
                ..had
            };
            match self.apply(&uid, &none).await {
                Outcome::Retry(why) => {
                    tracing::debug!(driver = %self.driver, claim = %uid, error = %why, "cannot remove the claim's device status yet");
                    retry = true;
                }
                Outcome::Done | Outcome::Refused(_) => {
                    self.written.remove(&uid);
                    self.since.retain(|(claim, _, _), _| claim != &uid);
                }
            }
        }
        for (uid, want) in wanted {
            if stop.is_cancelled() {
                return false;
            }
            if self.written.get(&uid) == Some(&want) {
                continue;
            }
            match self.apply(&uid, &want).await {
                Outcome::Done => {
                    self.written.insert(uid, want);
                }
                Outcome::Refused(why) => {
                    let claim = format!("{}/{} ({uid})", want.namespace, want.name);
                    if self.warned {
                        tracing::debug!(driver = %self.driver, %claim, error = %why, "the API server refused the claim's device status");
                    } else {
                        tracing::warn!(driver = %self.driver, %claim, error = %why,
                            "the API server refused the claim's device status; the claim is prepared, its status.devices is not written \
                             (the chart grants resourceclaims/status patch and resourceclaims/driver associated-node:patch; \
                             later refusals are logged at DEBUG and counted in devplug_dra_device_status_errors_total)");
                        self.warned = true;
                    }
                    self.written.insert(uid, want);
                }
                Outcome::Retry(why) => {
                    tracing::debug!(driver = %self.driver, claim = %uid, error = %why, "cannot write the claim's device status yet");
                    retry = true;
                }
            }
        }
        retry
    }

    /// One server-side apply of `want`'s entries to the claim with `uid`.
    async fn apply(&mut self, uid: &str, want: &Wanted) -> Outcome {
        let now = Timestamp::now();
        let devices: Vec<Value> = want
            .entries
            .iter()
            .map(|entry| {
                let key = (uid.to_owned(), entry.device.clone(), entry.share_id.clone());
                let at = match self.since.get(&key) {
                    Some((ready, at)) if *ready == entry.ready => *at,
                    _ => {
                        self.since.insert(key, (entry.ready, now));
                        now
                    }
                };
                entry_json(&self.driver, entry, at)
            })
            .collect();
        let patch = json!({
            "apiVersion": "resource.k8s.io/v1",
            "kind": "ResourceClaim",
            "metadata": {"name": want.name, "namespace": want.namespace, "uid": uid},
            "status": {"devices": devices},
        });
        let claims: kube::Api<ResourceClaim> =
            kube::Api::namespaced(self.client.clone(), &want.namespace);
        let params = PatchParams::apply(&self.driver).force();
        let result = claims
            .patch_status(&want.name, &params, &Patch::Apply(&patch))
            .await;
        match result {
            Ok(_) => {
                self.counters.writes.fetch_add(1, Relaxed);
                Outcome::Done
            }
            Err(kube::Error::Api(status)) if status.code == 404 => Outcome::Done,
            Err(kube::Error::Api(status))
                if (400..500).contains(&status.code) && status.code != 429 =>
            {
                self.counters.errors.fetch_add(1, Relaxed);
                Outcome::Refused(status.message)
            }
            Err(err) => {
                self.counters.errors.fetch_add(1, Relaxed);
                Outcome::Retry(err.to_string())
            }
        }
    }
}

/// What every prepared claim of `driver` should have in `status.devices`, by claim UID.
fn wanted(
    driver: &str,
    claims: &BTreeMap<String, PreparedClaim>,
    list: &DeviceList,
) -> BTreeMap<String, Wanted> {
    claims
        .iter()
        .map(|(uid, claim)| {
            let entries = claim
                .devices
                .iter()
                .map(|device| entry(driver, device, list))
                .collect();
            let want = Wanted {
                namespace: claim.namespace.clone(),
                name: claim.name.clone(),
                entries,
            };
            (uid.clone(), want)
        })
        .collect()
}

/// One prepared device's entry, its health read from `list`.
fn entry(driver: &str, prepared: &PreparedDevice, list: &DeviceList) -> Entry {
    let found = list.devices().iter().find(|d| d.id == prepared.id);
    let (ready, reason, message) = match found.map(|d| &d.health) {
        Some(Health::Healthy) => (true, "Prepared", format!("prepared by {driver}")),
        Some(Health::Unhealthy { reason }) => (false, "Unhealthy", reason.clone()),
        None => (
            false,
            "DeviceGone",
            format!("{driver} no longer finds the device on the node"),
        ),
    };
    let mut data = Map::new();
    if let Some(attributes) = found.and_then(|d| d.attributes.as_deref()) {
        let attributes: Map<String, Value> = attributes
            .attributes
            .iter()
            .map(|(name, value)| (name.clone(), attribute_json(value)))
            .collect();
        if !attributes.is_empty() {
            data.insert("attributes".into(), Value::Object(attributes));
        }
    }
    data.insert("cdiDevices".into(), json!(prepared.cdi_device_ids));
    data.insert("requests".into(), json!(prepared.request_names));
    let (hold, share_id) = match &prepared.hold {
        Hold::Exclusive => ("whole", None),
        Hold::Share { share_id } => ("share", Some(share_id.clone())),
        Hold::AdminAccess { share_id } => ("adminAccess", share_id.clone()),
    };
    data.insert("hold".into(), json!(hold));
    Entry {
        pool: prepared.pool.clone(),
        device: prepared.device.clone(),
        share_id,
        ready,
        reason,
        message,
        data: Value::Object(data),
    }
}

fn attribute_json(value: &AttributeValue) -> Value {
    match value {
        AttributeValue::Int(i) => json!(i),
        AttributeValue::Bool(b) => json!(b),
        AttributeValue::String(s) | AttributeValue::Version(s) => json!(s),
    }
}

/// The longest condition message the API server takes.
const MAX_MESSAGE: usize = 32_768;

/// An entry as `status.devices[]` holds it, its condition last changed `at`.
fn entry_json(driver: &str, entry: &Entry, at: Timestamp) -> Value {
    let mut object = json!({
        "driver": driver,
        "pool": entry.pool,
        "device": entry.device,
        "conditions": [{
            "type": READY,
            "status": if entry.ready { "True" } else { "False" },
            "reason": entry.reason,
            "message": entry.message.chars().take(MAX_MESSAGE).collect::<String>(),
            "lastTransitionTime": at.strftime("%Y-%m-%dT%H:%M:%SZ").to_string(),
        }],
        "data": entry.data,
    });
    if let (Some(share), Some(map)) = (&entry.share_id, object.as_object_mut()) {
        map.insert("shareID".into(), json!(share));
    }
    object
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use devplug::Device;

    fn prepared(id: &str, hold: Hold) -> PreparedDevice {
        PreparedDevice {
            request_names: vec!["gpu".into()],
            pool: "node-a".into(),
            device: crate::names::device_name(id),
            id: id.into(),
            cdi_device_ids: vec![format!("gpu.example.com/claim=uid-1-gpu")],
            hold,
        }
    }

    fn claims(devices: Vec<PreparedDevice>) -> BTreeMap<String, PreparedClaim> {
        let claim = PreparedClaim {
            namespace: "ns".into(),
            name: "c".into(),
            devices,
            cdi_spec: "/var/run/cdi/x.json".into(),
            cdi_spec_json: None,
        };
        BTreeMap::from([("uid-1".to_owned(), claim)])
    }

    #[test]
    fn each_prepared_device_gets_an_entry_with_its_attributes_and_health() {
        let list = DeviceList::new([
            Device::new("gpu-0").with_attribute("uuid", AttributeValue::String("GPU-0".into())),
            Device {
                health: Health::Unhealthy {
                    reason: "XID 79".into(),
                },
                ..Device::new("gpu-1")
            },
        ]);
        let claims = claims(vec![
            prepared("gpu-0", Hold::Exclusive),
            prepared(
                "gpu-1",
                Hold::Share {
                    share_id: "s1".into(),
                },
            ),
            prepared("gpu-2", Hold::Exclusive),
        ]);
        let wanted = wanted("gpu.example.com", &claims, &list);
        let entries = &wanted["uid-1"].entries;
        assert_eq!(entries.len(), 3);
        assert!(entries[0].ready);
        assert_eq!(entries[0].data["attributes"]["uuid"], "GPU-0");
        assert_eq!(entries[0].data["hold"], "whole");
        assert_eq!(
            (
                entries[1].ready,
                entries[1].reason,
                entries[1].message.as_str()
            ),
            (false, "Unhealthy", "XID 79")
        );
        assert_eq!(entries[1].share_id.as_deref(), Some("s1"));
        assert_eq!((entries[2].ready, entries[2].reason), (false, "DeviceGone"));
        let at = Timestamp::from_second(1_800_000_000).unwrap();
        let json = entry_json("gpu.example.com", &entries[1], at);
        assert_eq!(json["shareID"], "s1");
        assert_eq!(json["conditions"][0]["status"], "False");
        assert_eq!(
            json["conditions"][0]["lastTransitionTime"],
            "2027-01-15T08:00:00Z"
        );
        assert!(entry_json("gpu.example.com", &entries[0], at)
            .get("shareID")
            .is_none());
    }
}
