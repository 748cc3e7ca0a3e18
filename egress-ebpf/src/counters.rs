//! Per-CPU counters by stable reason (`egress_common::counters::reason`).

use aya_ebpf::{
    bindings::{TC_ACT_OK, TC_ACT_SHOT},
    programs::TcContext,
};

use crate::maps::COUNTERS;

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
