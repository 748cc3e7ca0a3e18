//! TC programs of the egress gateway datapath. Entry points only: each calls its
//! module's `run`, which returns the TC verdict (every exit counted with a stable reason).
#![no_std]
// `asm!` for BPF (`parse::word`): Debian's compiler, run with RUSTC_BOOTSTRAP for
// `-Z build-std` already.
#![feature(asm_experimental_arch)]
#![no_main]

mod answer;
mod back;
mod conntrack;
mod counters;
mod decap;
mod fib;
mod flows;
mod from_pod;
mod from_secondary;
mod from_tunnel;
mod gateway;
mod handoff;
mod icmp_error;
mod maps;
mod mem;
mod netpol;
mod parse;
mod parse6;
mod pod_device;
mod policy;
mod reset;
mod rewrite;
mod scratch;
mod source;
mod tunnel;
mod underlay;
mod unknown;

use aya_ebpf::{macros::classifier, programs::TcContext};

/// TC ingress on the host side of pod devices.
#[classifier]
pub fn from_pod(ctx: TcContext) -> i32 {
    from_pod::run(&ctx)
}

/// TC ingress on the agent's collect-metadata VXLAN device.
#[classifier]
pub fn from_tunnel(ctx: TcContext) -> i32 {
    from_tunnel::run(&ctx)
}

/// TC ingress on the underlay interface (the one holding this node's IPv4 underlay
/// address): our VXLAN packets decapsulated, then `from_tunnel`'s paths; anything else
/// goes on untouched.
#[classifier]
pub fn from_underlay(ctx: TcContext) -> i32 {
    match decap::decapsulate(&ctx) {
        Some(meta) => from_tunnel::run_from(&ctx, Some(meta)),
        None => decap::NOT_OURS,
    }
}

/// TC ingress on the gateway's egress (secondary) interfaces.
#[classifier]
pub fn from_secondary(ctx: TcContext) -> i32 {
    from_secondary::run(&ctx)
}

#[cfg(not(test))]
#[panic_handler]
fn panic(_info: &core::panic::PanicInfo) -> ! {
    loop {}
}

#[unsafe(link_section = "license")]
#[unsafe(no_mangle)]
static LICENSE: [u8; 4] = *b"GPL\0";
