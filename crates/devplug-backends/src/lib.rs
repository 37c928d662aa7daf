//! Ready device backends for devplug, each chosen by a key in the config file.
//!
//! - [`virtual_devices`] (`virtual:`): devices that exist only in software, like the dummy NPU of
//!   the classic tutorial, for demos, tests and scheduling experiments.
//! - [`files`] (`files:`): each regular file in a watched folder is a device; its first line is
//!   its health.
//!
//! Each backend has a settings struct that deserializes from the config file (unknown fields are
//! errors) and a `validate` that names the field and the fix.

pub mod files;
mod inotify_batch;
pub mod settings;
pub mod virtual_devices;

pub use files::{FilesBackend, FilesSettings};
pub use settings::SettingsError;
pub use virtual_devices::{VirtualBackend, VirtualSettings};
