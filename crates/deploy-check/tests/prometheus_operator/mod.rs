//! The Prometheus Operator's objects the chart renders (`monitoring.coreos.com/v1` PodMonitor,
//! ServiceMonitor, PrometheusRule), typed with the field names and value formats of the
//! operator's CRDs, so that [`deploy_check::strict`] refuses a misspelled or misplaced field
//! and a malformed duration as it does for the Kubernetes API's own types. Only the fields the
//! chart can render are modelled: a new one gets its field here, checked against the CRD.

use k8s_openapi::apimachinery::pkg::apis::meta::v1::{LabelSelector, ObjectMeta};
use serde::{Deserialize, Deserializer, Serialize};
use std::collections::BTreeMap;

/// A duration as the CRDs' `Duration` pattern has it: `0`, or units from `y` down to `ms`, in
/// that order, each at most once (`30s`, `1h30m`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(transparent)]
pub struct Duration(pub String);

impl Duration {
    /// Whether `text` matches `^(0|(([0-9]+)y)?(([0-9]+)w)?(([0-9]+)d)?(([0-9]+)h)?(([0-9]+)m)?(([0-9]+)s)?(([0-9]+)ms)?)$`.
    pub fn valid(text: &str) -> bool {
        if text == "0" {
            return true;
        }
        if text.is_empty() {
            return false;
        }
        let units = ["y", "w", "d", "h", "m", "s", "ms"];
        let mut next = 0;
        let mut rest = text;
        while !rest.is_empty() {
            let digits = rest.bytes().take_while(u8::is_ascii_digit).count();
            if digits == 0 {
                return false;
            }
            rest = &rest[digits..];
            // "ms" before "m", so that 5ms is not read as 5m and a stray s.
            let Some(unit) = ["ms", "y", "w", "d", "h", "m", "s"]
                .into_iter()
                .find(|u| rest.starts_with(u))
            else {
                return false;
            };
            let Some(at) = units.iter().position(|u| *u == unit) else {
                return false;
            };
            if at < next {
                return false;
            }
            next = at + 1;
            rest = &rest[unit.len()..];
        }
        true
    }
}

impl<'de> Deserialize<'de> for Duration {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let text = String::deserialize(d)?;
        if Duration::valid(&text) {
            Ok(Duration(text))
        } else {
            Err(serde::de::Error::custom(format!(
                "{text:?} is not a Prometheus duration (e.g. 30s, 5m, 1h30m)"
            )))
        }
    }
}

/// `RelabelConfig`.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct RelabelConfig {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub source_labels: Option<Vec<String>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub separator: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub target_label: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub regex: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub replacement: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub action: Option<String>,
}

/// `NamespaceSelector`.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct NamespaceSelector {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub any: Option<bool>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub match_names: Option<Vec<String>>,
}

/// What the two monitors' endpoints share: a named port, the path, how often.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ScrapeEndpoint {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub port: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub path: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub scheme: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub interval: Option<Duration>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub scrape_timeout: Option<Duration>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub honor_labels: Option<bool>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub relabelings: Option<Vec<RelabelConfig>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub metric_relabelings: Option<Vec<RelabelConfig>>,
}

/// `PodMonitor.spec`.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct PodMonitorSpec {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub job_label: Option<String>,
    pub selector: LabelSelector,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub namespace_selector: Option<NamespaceSelector>,
    pub pod_metrics_endpoints: Vec<ScrapeEndpoint>,
}

/// `ServiceMonitor.spec`.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ServiceMonitorSpec {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub job_label: Option<String>,
    pub selector: LabelSelector,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub namespace_selector: Option<NamespaceSelector>,
    pub endpoints: Vec<ScrapeEndpoint>,
}

/// A rule of a `PrometheusRule` group: an alert or a recording rule.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Rule {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub alert: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub record: Option<String>,
    pub expr: String,
    #[serde(default, rename = "for", skip_serializing_if = "Option::is_none")]
    pub for_: Option<Duration>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub keep_firing_for: Option<Duration>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub labels: Option<BTreeMap<String, String>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub annotations: Option<BTreeMap<String, String>>,
}

/// A `PrometheusRule` group.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct RuleGroup {
    pub name: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub interval: Option<Duration>,
    pub rules: Vec<Rule>,
}

/// `PrometheusRule.spec`.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct PrometheusRuleSpec {
    pub groups: Vec<RuleGroup>,
}

/// An object of the operator's: apiVersion, kind, metadata and a spec of type `S`.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Monitoring<S> {
    pub api_version: String,
    pub kind: String,
    pub metadata: ObjectMeta,
    pub spec: S,
}

pub type PodMonitor = Monitoring<PodMonitorSpec>;
pub type ServiceMonitor = Monitoring<ServiceMonitorSpec>;
pub type PrometheusRule = Monitoring<PrometheusRuleSpec>;

#[test]
fn durations_follow_the_crd_pattern() {
    for good in ["0", "30s", "5m", "1h30m", "10ms", "1y2w3d4h5m6s7ms"] {
        assert!(Duration::valid(good), "{good}");
    }
    for bad in ["", "30", "5 m", "m", "30s5m", "1.5h", "5mm", "-1s", "1s1s"] {
        assert!(!Duration::valid(bad), "{bad}");
    }
}
