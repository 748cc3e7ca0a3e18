//! Userspace-only impls: lets the agent store these types in aya maps.

use crate::{config::Config, conntrack::*, counters::Counter, policy::*};

macro_rules! pod {
    ($($t:ty),*) => { $(
        // SAFETY: repr(C), Copy, no padding (asserted next to each type), any bit pattern valid.
        unsafe impl aya::Pod for $t {}
    )* };
}

pod!(
    PolicyKeyV4,
    PolicyValueV4,
    RuleValueV4,
    NodeValue,
    PodOwnerValue,
    EgressIpValue,
    SelectedValueV4,
    SelectedValueV6,
    DestValueV4,
    DestValueV6,
    CtKeyV4,
    CtEntryV4,
    Counter,
    Config,
    PolicyKeyV6,
    PolicyValueV6,
    RuleValueV6,
    CtKeyV6,
    CtEntryV6,
    RemapValueV4,
    RemapValueV6,
    AdmittedKeyV4,
    AdmittedKeyV6,
    AdmittedValue,
    KnownPodValue,
    PodDeviceValue,
    FlowCount,
    CoveredValue,
    PortFilter
);
