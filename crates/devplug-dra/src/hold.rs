//! [`Hold`]: how a claim holds one of its devices, as the scheduler allocated it. It decides
//! whether two claims may have the same device at once, whether the backend hands the device
//! over whole or as a share, and what a release gives back.

use serde::{Deserialize, Serialize};

/// How a claim holds a device.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(from = "HoldFields", into = "HoldFields")]
pub enum Hold {
    /// The device is this claim's alone, handed over whole.
    #[default]
    Exclusive,
    /// A share of a device with consumable capacity; other claims may hold other shares.
    Share {
        /// The share's id, as the scheduler allocated it (unique per device).
        share_id: String,
    },
    /// Admin access (monitoring, maintenance): the claim looks at a device that other claims
    /// may have too. On a device shared by capacity it comes with a share id.
    AdminAccess {
        /// The share's id, on a device shared by capacity.
        share_id: Option<String>,
    },
}

impl Hold {
    /// The hold from an allocation result's two fields.
    pub fn from_parts(share_id: Option<String>, admin_access: bool) -> Hold {
        match (share_id, admin_access) {
            (share_id, true) => Hold::AdminAccess { share_id },
            (Some(share_id), false) => Hold::Share { share_id },
            (None, false) => Hold::Exclusive,
        }
    }

    /// Whether the device goes to one claim at a time (and is released when it is done).
    pub fn is_exclusive(&self) -> bool {
        matches!(self, Hold::Exclusive)
    }

    /// The share id, where the device is shared by capacity: the backend hands it over as a
    /// share, and stops what serves the shares when the last one goes.
    pub fn share_id(&self) -> Option<&str> {
        match self {
            Hold::Exclusive | Hold::AdminAccess { share_id: None } => None,
            Hold::Share { share_id }
            | Hold::AdminAccess {
                share_id: Some(share_id),
            } => Some(share_id),
        }
    }

    /// Whether the claim has admin access.
    pub fn admin_access(&self) -> bool {
        matches!(self, Hold::AdminAccess { .. })
    }
}

/// The two fields a hold is written as (in the checkpoint, as in the API's allocation result).
#[derive(Serialize, Deserialize)]
struct HoldFields {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    share_id: Option<String>,
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    admin_access: bool,
}

impl From<HoldFields> for Hold {
    fn from(fields: HoldFields) -> Hold {
        Hold::from_parts(fields.share_id, fields.admin_access)
    }
}

impl From<Hold> for HoldFields {
    fn from(hold: Hold) -> HoldFields {
        HoldFields {
            admin_access: hold.admin_access(),
            share_id: hold.share_id().map(str::to_owned),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_two_fields_and_back() {
        for (share_id, admin) in [
            (None, false),
            (Some("s1".to_owned()), false),
            (None, true),
            (Some("s2".to_owned()), true),
        ] {
            let hold = Hold::from_parts(share_id.clone(), admin);
            assert_eq!(hold.share_id().map(str::to_owned), share_id);
            assert_eq!(hold.admin_access(), admin);
            assert_eq!(hold.is_exclusive(), share_id.is_none() && !admin);
        }
    }

    #[test]
    fn written_as_the_two_fields_of_older_checkpoints() {
        #[derive(Serialize, Deserialize, PartialEq, Debug)]
        struct Device {
            id: String,
            #[serde(flatten)]
            hold: Hold,
        }
        let exclusive = Device {
            id: "a".into(),
            hold: Hold::Exclusive,
        };
        assert_eq!(serde_json::to_string(&exclusive).unwrap(), r#"{"id":"a"}"#);
        let share: Device =
            serde_json::from_str(r#"{"id":"a","share_id":"s","admin_access":false}"#).unwrap();
        assert_eq!(
            share.hold,
            Hold::Share {
                share_id: "s".into()
            }
        );
        let admin: Device = serde_json::from_str(r#"{"id":"a","admin_access":true}"#).unwrap();
        assert_eq!(
            serde_json::to_string(&admin).unwrap(),
            r#"{"id":"a","admin_access":true}"#
        );
    }
}
