//! NetworkPolicy ports: whether a redirected packet's protocol and destination port are
//! among those its pod's egress NetworkPolicies allow toward its destination (the policy
//! entry's `filter`, a `PORT_FILTERS` key). Destinations the policies do not allow at all
//! have entries of their own (`action::DENY`); this only judges the ports.

use crate::maps::PORT_FILTERS;

/// Whether filter `id` lets protocol `proto` to destination port `dport_be` (network
/// order) pass. A filter missing from the map allows nothing: fail closed. A frame of its
/// own (scalars in, the filter read in place): `from_pod`'s gateway chains are near the
/// verifier's 512-byte stack.
#[inline(never)]
pub fn allows(id: u32, proto: u8, dport_be: u16) -> bool {
    // SAFETY: the agent writes this map; entries are plain values.
    let Some(f) = (unsafe { PORT_FILTERS.get(id) }) else {
        return false;
    };
    f.allows(proto, u16::from_be(dport_be))
}
