//! What a device says about itself for Dynamic Resource Allocation: attributes (model, NUMA
//! node, PCI address, UUID…) and capacities (memory…) that CEL selectors in a DeviceClass or a
//! ResourceClaim test (`device.attributes["npu.example.com"].model == "x1"`). Optional data on a
//! [`Device`](crate::Device): the device plugin path ignores it, the DRA driver publishes it in
//! ResourceSlices. Names follow the API server's rules for a ResourceSlice, so
//! a backend finds a bad name in its own tests rather than as a refused slice.

use std::collections::BTreeMap;

/// The longest attribute or capacity name the API server takes, without a domain prefix.
pub const MAX_NAME_LEN: usize = 32;

/// How many attributes and capacities one device may have together in a ResourceSlice.
pub const MAX_PER_DEVICE: usize = 32;

/// One attribute's value; the API server knows exactly these four kinds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum AttributeValue {
    /// An integer, e.g. a NUMA node or a core count.
    Int(i64),
    /// A flag.
    Bool(bool),
    /// A string of at most 64 bytes, e.g. a model name or a UUID.
    String(String),
    /// A semantic version (`1.2.3`), compared as a version by CEL.
    Version(String),
}

/// How claims consume one capacity of a device shared by capacity (Kubernetes' consumable
/// capacity, `resource.k8s.io/v1` `DeviceCapacity.requestPolicy`): a claim's request is rounded
/// up to `min + n × step`; a claim that does not ask for this capacity consumes `default`. The
/// scheduler keeps the sum of what the shares consumed within the capacity.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CapacityRequestPolicy {
    /// The least one share consumes.
    pub min: u64,
    /// The unit above `min`.
    pub step: u64,
    /// What a claim that does not ask for this capacity consumes.
    pub default: u64,
}

impl CapacityRequestPolicy {
    /// Shares of `step` and its multiples, a claim that names nothing getting one step.
    pub fn steps_of(step: u64) -> CapacityRequestPolicy {
        CapacityRequestPolicy {
            min: step,
            step,
            default: step,
        }
    }

    /// Checks the policy against the capacity's `value` by the API server's rules: `step` at
    /// least 1, `min + step` at most `value`, `default` one of `min + n × step` within `value`.
    pub fn check(&self, value: u64) -> Result<(), String> {
        if self.step == 0 {
            return Err("step must be at least 1".to_owned());
        }
        if self.min.checked_add(self.step).is_none_or(|m| m > value) {
            return Err(format!(
                "min ({}) + step ({}) is more than the capacity ({value})",
                self.min, self.step
            ));
        }
        let aligned = self
            .default
            .checked_sub(self.min)
            .is_some_and(|above| above % self.step == 0);
        if !aligned || self.default > value {
            return Err(format!(
                "default ({}) must be min ({}) plus a multiple of step ({}), at most the \
                 capacity ({value})",
                self.default, self.min, self.step
            ));
        }
        Ok(())
    }
}

/// A named set of counters that devices of a pool consume when they are allocated: the parts of
/// a partitionable device (`resource.k8s.io/v1` `CounterSet`, Kubernetes' partitionable
/// devices). The scheduler allocates a device only while what it consumes is left, so devices
/// that overlap (a whole GPU and its halves) are never given out together.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct CounterSet {
    /// The set's name, a DNS label, unique in the pool.
    pub name: String,
    /// Counters (DNS labels) and how much of each there is.
    pub counters: BTreeMap<String, u64>,
}

/// What a device consumes of one [`CounterSet`] when it is allocated.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct CounterConsumption {
    /// The counter set's name.
    pub set: String,
    /// Counters and how much of each.
    pub counters: BTreeMap<String, u64>,
}

/// The most counter sets a ResourceSlice holds (`ResourceSliceSpec.sharedCounters`).
pub const MAX_COUNTER_SETS: usize = 8;

/// The most counters one set, or one device's consumption of it, may have.
pub const MAX_COUNTERS: usize = 32;

/// A device's attributes and capacities, by name. A name is a C identifier of at most 32
/// characters (the driver's own domain), or `domain/identifier` for a name another driver or
/// Kubernetes defines (`resource.kubernetes.io/pciBusID`).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct DeviceAttributes {
    /// Attributes, for selectors.
    pub attributes: BTreeMap<String, AttributeValue>,
    /// Capacities (bytes, counts), published as quantities.
    pub capacity: BTreeMap<String, u64>,
    /// The device is shared by capacity: claims consume parts of its capacities by these
    /// policies, one for every capacity, and several claims hold it at once (the DRA driver
    /// publishes it with `allowMultipleAllocations`). Empty: the device goes to one claim.
    pub shared: BTreeMap<String, CapacityRequestPolicy>,
    /// The counters of its list's [`CounterSet`]s the device consumes when allocated (a
    /// partition of a partitionable device, or the whole of it). Empty: none.
    pub consumes: Vec<CounterConsumption>,
}

impl DeviceAttributes {
    /// True when there is nothing to publish.
    pub fn is_empty(&self) -> bool {
        self.attributes.is_empty()
            && self.capacity.is_empty()
            && self.shared.is_empty()
            && self.consumes.is_empty()
    }

    /// Whether claims share the device by capacity.
    pub fn is_shared(&self) -> bool {
        !self.shared.is_empty()
    }

    /// Checks every name and value against the API server's rules; returns what is wrong.
    pub fn check(&self) -> Result<(), String> {
        let total = self.attributes.len().saturating_add(self.capacity.len());
        if total > MAX_PER_DEVICE {
            return Err(format!(
                "{total} attributes and capacities; a ResourceSlice takes at most {MAX_PER_DEVICE} \
                 a device"
            ));
        }
        for name in self.attributes.keys().chain(self.capacity.keys()) {
            check_name(name)?;
        }
        for (name, policy) in &self.shared {
            let value = self.capacity.get(name).ok_or_else(|| {
                format!("shared capacity {name}: the device has no capacity of that name")
            })?;
            policy
                .check(*value)
                .map_err(|e| format!("shared capacity {name}: {e}"))?;
        }
        for consumption in &self.consumes {
            check_label(&consumption.set)
                .map_err(|e| format!("counter set {:?}: {e}", consumption.set))?;
            if consumption.counters.len() > MAX_COUNTERS {
                return Err(format!(
                    "{} counters of set {}; a device consumes at most {MAX_COUNTERS} of one set",
                    consumption.counters.len(),
                    consumption.set
                ));
            }
            for counter in consumption.counters.keys() {
                check_label(counter).map_err(|e| format!("counter {counter:?}: {e}"))?;
            }
        }
        if self.is_shared() {
            if let Some(name) = self.capacity.keys().find(|n| !self.shared.contains_key(*n)) {
                return Err(format!(
                    "capacity {name} has no share policy: on a shared device every capacity \
                     is consumed, and a claim that does not name it would take all of it"
                ));
            }
        }
        for (name, value) in &self.attributes {
            if let AttributeValue::String(s) | AttributeValue::Version(s) = value {
                if s.len() > 64 {
                    return Err(format!(
                        "attribute {name}: {} bytes; the API server takes at most 64",
                        s.len()
                    ));
                }
            }
        }
        Ok(())
    }
}

/// Checks an attribute or capacity name: `identifier` or `domain/identifier`, the identifier a
/// C identifier of at most [`MAX_NAME_LEN`] characters, the domain a DNS subdomain.
pub fn check_name(name: &str) -> Result<(), String> {
    let (domain, id) = match name.rsplit_once('/') {
        Some((domain, id)) => (Some(domain), id),
        None => (None, name),
    };
    let c_identifier = id
        .chars()
        .next()
        .is_some_and(|c| c.is_ascii_alphabetic() || c == '_')
        && id.chars().all(|c| c.is_ascii_alphanumeric() || c == '_');
    if !c_identifier || id.len() > MAX_NAME_LEN {
        return Err(format!(
            "attribute name {name:?}: the part after the domain must be a C identifier (letters, \
             digits, '_', not starting with a digit) of at most {MAX_NAME_LEN} characters"
        ));
    }
    if let Some(domain) = domain {
        check_dns_subdomain(domain).map_err(|e| format!("attribute name {name:?}: {e}"))?;
    }
    Ok(())
}

/// Checks a DNS label (RFC 1123: lower-case letters, digits and '-', at most 63 characters,
/// starting and ending with a letter or digit), as counter and counter set names must be.
pub fn check_label(name: &str) -> Result<(), String> {
    let ok = !name.is_empty()
        && name.len() <= 63
        && name
            .chars()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-')
        && !name.starts_with('-')
        && !name.ends_with('-');
    if ok {
        Ok(())
    } else {
        Err(
            "must be a DNS label: lower-case letters, digits and '-', at most 63, starting and \
             ending with a letter or digit"
                .to_owned(),
        )
    }
}

/// Checks a DNS subdomain (RFC 1123: lower-case letters, digits, '-' and '.', at most 253
/// characters, each label starting and ending with a letter or digit), as DRA driver names and
/// attribute domains must be.
pub fn check_dns_subdomain(name: &str) -> Result<(), String> {
    if name.is_empty() || name.len() > 253 {
        return Err(format!(
            "{name:?} must be a DNS subdomain of 1 to 253 characters"
        ));
    }
    for label in name.split('.') {
        let ok = !label.is_empty()
            && label.len() <= 63
            && label
                .chars()
                .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-')
            && !label.starts_with('-')
            && !label.ends_with('-');
        if !ok {
            return Err(format!(
                "{name:?} is not a DNS subdomain: lower-case letters, digits, '-' and '.', each \
                 part starting and ending with a letter or digit (e.g. npu.example.com)"
            ));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_follow_the_api_servers_rules() {
        assert!(check_name("model").is_ok());
        assert!(check_name("resource.kubernetes.io/pciBusID").is_ok());
        assert!(check_name("numa_node").is_ok());
        assert!(check_name("1numa").is_err());
        assert!(check_name("pci-bus").is_err());
        assert!(check_name(&"x".repeat(33)).is_err());
        assert!(check_name("Example.com/model").is_err());
        assert!(check_name("/model").is_err());
        // One '/' at most: the domain is a DNS subdomain, which has none.
        assert!(check_name("a.example.com/b/c").is_err());
        assert!(check_name("").is_err());
    }

    #[test]
    fn driver_names_are_dns_subdomains() {
        assert!(check_dns_subdomain("npu.example.com").is_ok());
        assert!(check_dns_subdomain("example.com/npu").is_err());
        assert!(check_dns_subdomain("NPU.example.com").is_err());
        assert!(check_dns_subdomain("-a.com").is_err());
        assert!(check_dns_subdomain("a..com").is_err());
    }

    #[test]
    fn check_counts_and_lengths() {
        let mut attrs = DeviceAttributes::default();
        assert!(attrs.is_empty() && attrs.check().is_ok());
        attrs
            .attributes
            .insert("uuid".into(), AttributeValue::String("x".repeat(65)));
        assert!(attrs.check().unwrap_err().contains("at most 64"));
        attrs.attributes.clear();
        for i in 0..33 {
            attrs.capacity.insert(format!("c{i}"), 1);
        }
        assert!(attrs.check().unwrap_err().contains("at most 32"));
    }

    #[test]
    fn share_policies_follow_the_api_servers_rules() {
        let mut attrs = DeviceAttributes::default();
        attrs.capacity.insert("cores".into(), 100);
        attrs.capacity.insert("memory".into(), 16 << 30);
        attrs
            .shared
            .insert("cores".into(), CapacityRequestPolicy::steps_of(1));
        assert!(attrs
            .check()
            .unwrap_err()
            .contains("memory has no share policy"));
        attrs
            .shared
            .insert("memory".into(), CapacityRequestPolicy::steps_of(256 << 20));
        assert!(attrs.is_shared() && attrs.check().is_ok());
        attrs
            .shared
            .insert("power".into(), CapacityRequestPolicy::steps_of(1));
        assert!(attrs
            .check()
            .unwrap_err()
            .contains("no capacity of that name"));
        attrs.shared.remove("power");
        let bad = [
            (
                CapacityRequestPolicy {
                    min: 0,
                    step: 0,
                    default: 0,
                },
                "step must be",
            ),
            (
                CapacityRequestPolicy {
                    min: 50,
                    step: 60,
                    default: 50,
                },
                "more than the capacity",
            ),
            (
                CapacityRequestPolicy {
                    min: 10,
                    step: 20,
                    default: 20,
                },
                "plus a multiple",
            ),
            (
                CapacityRequestPolicy {
                    min: 10,
                    step: 20,
                    default: 5,
                },
                "plus a multiple",
            ),
        ];
        for (policy, message) in bad {
            attrs.shared.insert("cores".into(), policy);
            assert!(attrs.check().unwrap_err().contains(message), "{policy:?}");
        }
    }
}
