//! Errors in backend settings, shared by every backend: which field, and what to do about it.

use std::fmt;
use std::path::{Path, PathBuf};

/// A backend setting that cannot work, naming the field (relative to the backend's key, e.g.
/// `count`) and the fix.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SettingsError {
    /// The field, e.g. `count` or `groups[1].paths`.
    pub field: String,
    /// What is wrong and how to fix it.
    pub problem: String,
}

impl SettingsError {
    /// A problem with `field`.
    pub fn new(field: impl Into<String>, problem: impl Into<String>) -> Self {
        SettingsError {
            field: field.into(),
            problem: problem.into(),
        }
    }
}

impl fmt::Display for SettingsError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.field, self.problem)
    }
}

impl std::error::Error for SettingsError {}

/// Checks that `value` is a usable environment variable name.
pub fn check_env_name(field: &str, value: &str) -> Result<(), SettingsError> {
    let mut chars = value.chars();
    let first_ok = chars
        .next()
        .is_some_and(|c| c.is_ascii_alphabetic() || c == '_');
    if first_ok && chars.all(|c| c.is_ascii_alphanumeric() || c == '_') {
        Ok(())
    } else {
        Err(SettingsError::new(
            field,
            format!(
                "{value:?} is not an environment variable name (letters, digits and '_', not \
                 starting with a digit), e.g. DUMMY_VISIBLE_DEVICES"
            ),
        ))
    }
}

/// Checks that a path setting is absolute.
pub(crate) fn check_absolute(field: &str, path: &Path) -> Result<(), SettingsError> {
    if path.is_absolute() {
        Ok(())
    } else {
        Err(SettingsError::new(
            field,
            format!("{} must be an absolute path", path.display()),
        ))
    }
}

/// Checks the three roots the sysfs backends share: `cdi_dir`, `dev_root`, `sys_root`.
pub(crate) fn check_roots(
    cdi_dir: &Path,
    dev_root: &Path,
    sys_root: &Path,
) -> Result<(), SettingsError> {
    check_absolute("cdi_dir", cdi_dir)?;
    check_absolute("dev_root", dev_root)?;
    check_absolute("sys_root", sys_root)
}

/// `true`, for `#[serde(default = "…")]` on settings that default to on.
pub(crate) fn yes() -> bool {
    true
}

/// Default CDI spec folder of the GPU backends.
pub(crate) fn default_cdi_dir() -> PathBuf {
    PathBuf::from(devplug::cdi::DEFAULT_CDI_DIR)
}

/// Default dev root.
pub(crate) fn default_dev_root() -> PathBuf {
    PathBuf::from("/dev")
}

/// Default sysfs root.
pub(crate) fn default_sys_root() -> PathBuf {
    PathBuf::from("/sys")
}
