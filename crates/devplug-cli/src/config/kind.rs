//! What a resource is: devices, served by one backend ([`BackendConfig`]), or a count of an
//! extended resource kept on the Node with no device behind it ([`AdvertiseSettings`]). Every
//! concern over the kind is one `match` here; those over a backend are in `backend.rs`. The
//! file's shape is the same for both: one key per resource (`virtual:`, …, `advertise:`).

use super::BackendConfig;
use devplug_backends::SettingsError;
use serde::Deserialize;

/// A resource's kind: the one key it has in the config file besides its name and options.
// A config holds a handful of these, made once per load: boxing the backend would save nothing
// worth an indirection in every match.
#[allow(clippy::large_enum_variant)]
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ResourceKind {
    /// Devices, from the one backend the resource names.
    Devices(BackendConfig),
    /// `advertise`: no device and no socket; `run` keeps `count` of this extended resource on
    /// its own Node's status, through the API server.
    Advertise(AdvertiseSettings),
}

impl ResourceKind {
    /// Every key a resource may have for its kind, in the order the messages list them (the
    /// order of `raw::RawResource`'s fields): the backends' ([`BackendConfig::key`]), then
    /// `advertise`.
    pub const KEYS: [&'static str; 11] = [
        "virtual",
        "files",
        "hostdev",
        "amdgpu",
        "intel_gpu",
        "nvidia",
        "vfio",
        "qat",
        "ascend",
        "fpga",
        "advertise",
    ];

    /// The key this kind has in the config file; messages name its fields under it.
    pub fn key(&self) -> &'static str {
        match self {
            ResourceKind::Devices(backend) => backend.key(),
            ResourceKind::Advertise(_) => "advertise",
        }
    }

    /// Checks the settings without starting anything; the error's field is relative to
    /// [`ResourceKind::key`].
    pub fn validate(&self) -> Result<(), SettingsError> {
        match self {
            ResourceKind::Devices(backend) => backend.validate(),
            ResourceKind::Advertise(settings) => settings.validate(),
        }
    }

    /// The backend, for a resource of devices.
    pub fn backend(&self) -> Option<&BackendConfig> {
        match self {
            ResourceKind::Devices(backend) => Some(backend),
            ResourceKind::Advertise(_) => None,
        }
    }

    /// True for a kind that works through the Kubernetes API client, which only the full build
    /// has ([`super::needs_cluster`]). No backend does: they serve the kubelet.
    pub fn needs_cluster(&self) -> bool {
        match self {
            ResourceKind::Devices(_) => false,
            ResourceKind::Advertise(_) => true,
        }
    }

    /// The count to keep on the Node, for an `advertise:` resource.
    #[cfg(feature = "cluster")]
    pub fn advertised(&self) -> Option<u64> {
        match self {
            ResourceKind::Devices(_) => None,
            ResourceKind::Advertise(settings) => Some(settings.count),
        }
    }
}

/// An extended resource advertised on the Node, with no device plugin behind it.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AdvertiseSettings {
    /// How many to advertise (capacity and allocatable).
    pub count: u64,
}

/// The most an `advertise` count may be.
const ADVERTISE_MAX: u64 = 1_000_000_000;

impl AdvertiseSettings {
    /// Checks the count is one the Node can carry.
    fn validate(&self) -> Result<(), SettingsError> {
        if (1..=ADVERTISE_MAX).contains(&self.count) {
            return Ok(());
        }
        Err(SettingsError::new(
            "count",
            format!(
                "must be between 1 and {ADVERTISE_MAX} (to take a resource away, remove it from \
                 the config)"
            ),
        ))
    }
}
