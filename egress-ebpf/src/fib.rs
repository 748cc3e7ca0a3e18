//! Next hop selection: a FIB lookup, then a redirect with the right MAC addresses.

use core::mem::{size_of, zeroed};

use aya_ebpf::{
    bindings::{
        BPF_FIB_LKUP_RET_NO_NEIGH, BPF_FIB_LKUP_RET_SUCCESS, BPF_FIB_LOOKUP_OUTPUT,
        bpf_fib_lookup as FibParams, bpf_redir_neigh,
    },
    helpers::generated::{bpf_fib_lookup, bpf_redirect, bpf_redirect_neigh},
    programs::TcContext,
};

use crate::{parse::Ipv4, rewrite};

const AF_INET: u8 = 2;

/// Where the lookup starts.
pub enum From {
    /// As if sent out of this interface: only routes through it qualify (egress path,
    /// so a rule's packets never leave by another interface).
    Output(u32),
    /// As if received on this interface (delivery towards a local pod).
    Input(u32),
}

/// Route the (already rewritten) packet from `src` to `dst` and redirect it. `Err` when
/// there is no usable route, or the route leaves by another interface than required.
#[inline(always)]
pub fn redirect(
    ctx: &TcContext,
    ip: &Ipv4,
    src: [u8; 4],
    dst: [u8; 4],
    from: From,
) -> Result<i32, ()> {
    // SAFETY: all-zero is a valid bpf_fib_lookup.
    let mut p: FibParams = unsafe { zeroed() };
    p.family = AF_INET;
    p.l4_protocol = ip.proto;
    // tot_len stays 0: the kernel then checks the MTU with is_skb_forwardable(), which
    // understands GSO/GRO packets (a non-zero tot_len would refuse every aggregated
    // TCP packet as "fragmentation needed").
    p.__bindgen_anon_3.ipv4_src = u32::from_ne_bytes(src);
    p.__bindgen_anon_4.ipv4_dst = u32::from_ne_bytes(dst);
    let (flags, required) = match from {
        From::Output(ifindex) => {
            p.ifindex = ifindex;
            (BPF_FIB_LOOKUP_OUTPUT, ifindex)
        }
        From::Input(ifindex) => {
            p.ifindex = ifindex;
            (0, 0)
        }
    };
    let ret = unsafe {
        bpf_fib_lookup(
            ctx.skb.skb as *mut _,
            &mut p,
            size_of::<FibParams>() as i32,
            flags,
        )
    };
    if required != 0 && p.ifindex != required {
        return Err(());
    }
    if ret == i64::from(BPF_FIB_LKUP_RET_SUCCESS) {
        rewrite::set_macs(ctx, &p.dmac, &p.smac).map_err(|_| ())?;
        Ok(unsafe { bpf_redirect(p.ifindex, 0) } as i32)
    } else if ret == i64::from(BPF_FIB_LKUP_RET_NO_NEIGH) {
        // The kernel resolves the neighbour (ARP) and fills in the MACs.
        let mut nh = bpf_redir_neigh {
            nh_family: u32::from(AF_INET),
            __bindgen_anon_1: unsafe { zeroed() },
        };
        nh.__bindgen_anon_1.ipv4_nh = unsafe { p.__bindgen_anon_4.ipv4_dst };
        Ok(
            unsafe {
                bpf_redirect_neigh(p.ifindex, &mut nh, size_of::<bpf_redir_neigh>() as i32, 0)
            } as i32,
        )
    } else {
        Err(())
    }
}

/// The interface the packet arrived on.
#[inline(always)]
pub fn ingress_ifindex(ctx: &TcContext) -> u32 {
    // SAFETY: the context pointer is valid for the program's lifetime.
    unsafe { (*ctx.skb.skb).ifindex }
}
