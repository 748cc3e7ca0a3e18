//! `from_pod`'s source check: a pod address that the agent bound to the host-side device
//! it found the pod behind (`POD_DEVICES_*`) is accepted on that device only, so that a
//! pod cannot send as another pod of its node (with CAP_NET_RAW, any pod can forge its
//! source address, and the CNI's own anti-spoofing runs after our redirect). An address
//! without a binding (a pod the agent has not bound yet) is left to the unknown-pod
//! policy, as before the check existed.

use aya_ebpf::programs::TcContext;

use crate::{
    fib,
    maps::{POD_DEVICES_V4, POD_DEVICES_V6},
};

/// Whether the agent bound `src` to another device than the one the packet arrived on.
#[inline(always)]
pub fn elsewhere4(ctx: &TcContext, src: &[u8; 4]) -> bool {
    // SAFETY: the value is copied out at once.
    let bound = unsafe { POD_DEVICES_V4.get(src) }.map(|d| d.ifindex);
    bound.is_some_and(|i| i != fib::ingress_ifindex(ctx))
}

/// [`elsewhere4`] for an IPv6 source.
#[inline(always)]
pub fn elsewhere6(ctx: &TcContext, src: &[u8; 16]) -> bool {
    // SAFETY: as above.
    let bound = unsafe { POD_DEVICES_V6.get(src) }.map(|d| d.ifindex);
    bound.is_some_and(|i| i != fib::ingress_ifindex(ctx))
}
