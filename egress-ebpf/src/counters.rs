//! Per-CPU counters by stable reason (`egress_common::counters::reason`).

use aya_ebpf::{
    bindings::{BPF_NOEXIST, TC_ACT_OK, TC_ACT_SHOT},
    btf_maps::LruPerCpuHashMap,
    programs::TcContext,
};

use crate::maps::{COUNTERS, EXHAUSTED_V4, EXHAUSTED_V6};

/// Verdicts as the programs return them.
pub const OK: i32 = TC_ACT_OK;
pub const SHOT: i32 = TC_ACT_SHOT;

#[inline(always)]
pub fn count(ctx: &TcContext, reason: u32) {
    if let Some(c) = COUNTERS.get_ptr_mut(reason) {
        // SAFETY: per-CPU slot, no concurrent writer on this CPU.
        unsafe {
            (*c).packets += 1;
            (*c).bytes += u64::from(ctx.len());
        }
    }
}

/// Count `reason` and return `verdict`: the one way programs end on a counted path.
#[inline(always)]
pub fn verdict(ctx: &TcContext, reason: u32, verdict: i32) -> i32 {
    count(ctx, reason);
    verdict
}

/// Count a new flow of `pod` refused (no SNAT port free, `DROP_PORT_EXHAUSTED`, or over
/// the per-pod flow limit, `DROP_POD_FLOW_LIMIT`) against the pod, so that one pod's flood is attributable (`egress-agent maps`).
#[inline(always)]
pub fn exhausted4(pod: &[u8; 4]) {
    bump(&EXHAUSTED_V4, pod);
}

/// [`exhausted4`] for an IPv6 pod.
#[inline(always)]
pub fn exhausted6(pod: &[u8; 16]) {
    bump(&EXHAUSTED_V6, pod);
}

#[inline(always)]
fn bump<K, const N: usize>(m: &LruPerCpuHashMap<K, u64, N>, k: &K) {
    if let Some(c) = m.get_ptr_mut(k) {
        // SAFETY: per-CPU slot, no concurrent writer on this CPU.
        unsafe { *c += 1 };
    } else {
        // A race with another CPU's first count of this pod loses one count: this is a
        // rare path, kept short for the verifier.
        let _ = m.insert(k, 1u64, u64::from(BPF_NOEXIST));
    }
}
