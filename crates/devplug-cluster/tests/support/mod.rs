//! What the API-server tests of devplug-cluster share: the writes a permission test tries, a
//! policy waited for, NFD's NodeFeature kind installed.

#![allow(dead_code, clippy::unwrap_used)] // each test binary uses part of it

use devplug_cluster::policy_check::{refused_by_policy, Feature, Probe};
use devplug_testkit::api_server::until;
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::api::PostParams;
use kube::Api;
use std::time::Duration;

/// How long a test waits for the API server to do what it is asked.
pub const WAIT: Duration = Duration::from_secs(30);

/// The writes a permission test tried, and what went wrong with them.
#[derive(Default)]
pub struct Attempts {
    pub tried: usize,
    pub wrong: Vec<String>,
}

impl Attempts {
    /// A write that must be refused by an admission policy (not by RBAC, not by validation).
    pub fn refused<T>(&mut self, what: &str, result: Result<T, kube::Error>) {
        self.tried += 1;
        match result {
            Ok(_) => self.wrong.push(format!("ACCEPTED: {what}")),
            Err(err) if refused_by_policy(&err) => {}
            Err(err) => self
                .wrong
                .push(format!("refused, but not by a policy: {what}: {err}")),
        }
    }

    /// A write a feature needs.
    pub fn allowed<T, E: std::fmt::Display>(&mut self, what: &str, result: Result<T, E>) {
        self.tried += 1;
        if let Err(err) = result {
            self.wrong.push(format!("REFUSED: {what}: {err}"));
        }
    }

    /// Panics listing every write that went wrong, if any did.
    pub fn assert_all_right(&self) {
        assert!(
            self.wrong.is_empty(),
            "{} of {} writes went wrong:\n{}",
            self.wrong.len(),
            self.tried,
            self.wrong.join("\n")
        );
    }
}

/// Waits until `probe` finds `feature`'s policy in force (the API server loads a new policy
/// within a second or two).
pub async fn in_force(probe: &Probe, feature: Feature) {
    until(
        &format!("the {} policy in force", feature.name()),
        WAIT,
        || async { probe.check(feature).await.in_force().then_some(()) },
    )
    .await;
}

/// Installs NFD's NodeFeature kind (once per API server; `tests/node_labels/nodefeature-crd.yaml`)
/// and waits until it is served.
pub async fn install_node_feature_crd(admin: &kube::Client) {
    let text = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/node_labels/nodefeature-crd.yaml"
    ))
    .unwrap();
    let crd: CustomResourceDefinition = serde_saphyr::from_str(&text).unwrap();
    let crds: Api<CustomResourceDefinition> = Api::all(admin.clone());
    match crds.create(&PostParams::default(), &crd).await {
        Ok(_) => {}
        Err(kube::Error::Api(e)) if e.code == 409 => {}
        Err(e) => panic!("cannot create the NodeFeature CRD: {e}"),
    }
    until("the NodeFeature CRD established", WAIT, || async {
        let crd = crds.get("nodefeatures.nfd.k8s-sigs.io").await.ok()?;
        crd.status?
            .conditions?
            .iter()
            .any(|c| c.type_ == "Established" && c.status == "True")
            .then_some(())
    })
    .await;
}
