//! Ready device backends for devplug, each chosen by a key in the config file.
//!
//! - [`virtual_devices`] (`virtual:`): devices that exist only in software, like the dummy NPU of
//!   the classic tutorial, for demos, tests and scheduling experiments.
//!
//! Each backend has a settings struct that deserializes from the config file (unknown fields are
//! errors) and a `validate` that names the field and the fix.

pub mod settings;
pub mod virtual_devices;

pub use settings::SettingsError;
pub use virtual_devices::{VirtualBackend, VirtualSettings};
