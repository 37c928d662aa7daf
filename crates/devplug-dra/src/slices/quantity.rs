//! Capacities as quantities: written in the canonical form the API server writes back, and
//! read back from the forms it may use ([`devplug::quantity`]), so a published capacity
//! compares equal and is never written again for nothing.

pub(crate) use devplug::dra::parse_quantity;
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;

/// `value` as the API server writes it back.
pub(super) fn quantity(value: u64) -> Quantity {
    Quantity(devplug::dra::canonical_quantity(value))
}
