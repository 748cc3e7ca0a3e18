//! `from_underlay`: our VXLAN packets decapsulated at the underlay interface's ingress,
//! before they reach the tunnel device, then handed to `from_tunnel`'s checks and paths
//! with the sender and VNI read from the headers removed.
//!
//! The collect-metadata device gives every packet it receives a freshly allocated
//! metadata dst: measured in the lab, that cost our TCP stream 14 % against a kernel
//! tunnel of point-to-point devices (`docs/profile.md`). Only the IPv4 underlay is
//! decapsulated here; anything else goes on to the device as before (`TC_ACT_UNSPEC`:
//! the next program on the interface, or the stack): IPv6 underlay, another address or
//! port, IP options or fragments, VXLAN flags other than the VNI's, an inner frame that
//! is neither IPv4 nor IPv6, headers that are not there, and outer headers the stack
//! would refuse or trim (a wrong IPv4 checksum, lengths that disagree with the frame:
//! [`vouched`]).
//!
//! Nor a GSO packet (a GRO aggregate, or a segment train that crossed a veth): removing
//! its headers with `bpf_skb_adjust_room` leaves its tunnel GSO state
//! (`SKB_GSO_UDP_TUNNEL`, `skb->encapsulation`), which only the tunnel device clears
//! (`iptunnel_pull_offloads`) before Linux's `BPF_F_ADJ_ROOM_DECAP_L4_UDP`, newer than
//! every kernel here: left stale, the inner packet's segmentation on its way out breaks,
//! and the skb cannot be resized (an answer made of it, `answer`, fails). The device
//! decapsulates those once per aggregate, where the per-packet cost was.

use aya_ebpf::{
    bindings::{
        BPF_F_ADJ_ROOM_DECAP_L3_IPV4, BPF_F_ADJ_ROOM_DECAP_L3_IPV6, BPF_F_ADJ_ROOM_FIXED_GSO,
        TC_ACT_UNSPEC, bpf_adj_room_mode::BPF_ADJ_ROOM_MAC,
    },
    helpers::generated::bpf_skb_pull_data,
    programs::TcContext,
};
use egress_common::config::DEFAULT_TUNNEL_PORT;

use crate::{maps, parse6, scratch, tunnel::Received, underlay};

/// The tunnel's UDP port, set by the agent when it loads the object (`--tunnel-port`).
#[unsafe(no_mangle)]
static TUNNEL_PORT: u16 = DEFAULT_TUNNEL_PORT;

/// Not ours: the next program on the interface, or the stack (and the tunnel device).
pub const NOT_OURS: i32 = TC_ACT_UNSPEC;

/// Outer Ethernet, IPv4 without options, UDP, VXLAN, inner Ethernet: what is removed,
/// but the outer Ethernet header, which the inner packet keeps.
const ETH: usize = 14;
const HEADERS: usize = ETH + 20 + 8 + 8 + ETH;
const REMOVED: i32 = (HEADERS - ETH) as i32;

/// Byte offsets in the frame.
const IP: usize = ETH;
const UDP: usize = IP + 20;
const VXLAN: usize = UDP + 8;
const INNER_ETHERTYPE: usize = VXLAN + 8 + 12;

/// `Some` when the frame is our VXLAN packet, decapsulated: the packet is now the inner
/// one behind the outer Ethernet header, and its metadata is returned (in the per-CPU
/// scratch slot: `from_tunnel`'s paths take the whole stack). `None`: left as it was.
/// Out of line: its frame is gone before those paths start.
#[inline(never)]
pub fn decapsulate(ctx: &TcContext) -> Option<&'static Received> {
    let cfg = maps::config()?;
    let s = scratch::scratch()?;
    let node = underlay::node_ip(cfg).v4_host()?;
    // SAFETY: the context pointer is valid for the program's lifetime.
    if unsafe { (*ctx.skb.skb).gso_size } != 0 {
        return None;
    }
    if ctx.data() + HEADERS > ctx.data_end() {
        // The headers may sit in fragments (a GRO packet): pull them in, or give up.
        // SAFETY: the context's skb.
        if unsafe { bpf_skb_pull_data(ctx.skb.skb.cast(), HEADERS as u32) } != 0 {
            return None;
        }
    }
    let (start, end) = (ctx.data(), ctx.data_end());
    if start + HEADERS > end {
        return None;
    }
    let b = |i: usize| -> u8 {
        // SAFETY: `i` is a constant below `HEADERS`, checked above.
        unsafe { *(start as *const u8).add(i) }
    };
    let be16 = |i: usize| u16::from_be_bytes([b(i), b(i + 1)]);
    let be32 = |i: usize| u32::from_be_bytes([b(i), b(i + 1), b(i + 2), b(i + 3)]);
    // Ethernet IPv4; version 4 and no options; UDP; no fragment (MF and offset zero).
    if be16(12) != 0x0800 || b(IP) != 0x45 || b(IP + 9) != 17 || be16(IP + 6) & 0x3fff != 0 {
        return None;
    }
    // SAFETY: a plain read of a load-time constant.
    let port = unsafe { core::ptr::read_volatile(&TUNNEL_PORT) };
    if be32(IP + 16) != node || be16(UDP + 2) != port {
        return None;
    }
    if !vouched(&b, ctx.len()) {
        return None;
    }
    // VXLAN: the VNI flag alone, reserved bytes zero (the device refuses anything else).
    if b(VXLAN) != 0x08 || b(VXLAN + 1) | b(VXLAN + 2) | b(VXLAN + 3) | b(VXLAN + 7) != 0 {
        return None;
    }
    let inner = be16(INNER_ETHERTYPE);
    let family = match inner {
        0x0800 => BPF_F_ADJ_ROOM_DECAP_L3_IPV4,
        0x86dd if parse6::IPV6_DATAPATH => BPF_F_ADJ_ROOM_DECAP_L3_IPV6,
        _ => return None,
    };
    set_sender(&mut s.decap, be32(IP + 12));
    s.decap.vni = be32(VXLAN + 4) >> 8;
    // The segment size stays: the sender clamped it to the tunnel (see `tunnel`).
    let flags = u64::from(BPF_F_ADJ_ROOM_FIXED_GSO | family);
    ctx.adjust_room(-REMOVED, BPF_ADJ_ROOM_MAC, flags).ok()?;
    if inner != 0x0800 {
        // The outer header said IPv4.
        let (start, end) = (ctx.data(), ctx.data_end());
        if start + ETH > end {
            return None;
        }
        // SAFETY: 14 bytes checked above.
        unsafe { *(start as *mut [u8; 2]).byte_add(12) = inner.to_be_bytes() };
    }
    Some(&s.decap)
}

/// `m.sender` = the IPv4-mapped underlay address of `v4` (host order), in four word
/// stores: zeroing the array first became a `memset` call.
/// Whether the stack would take the outer headers as they are: the IPv4 header's
/// checksum right, its total length the frame's and the UDP length the IP payload's. The
/// stack checks these before the tunnel device sees a packet and drops what fails; a
/// frame that fails one here goes on to the stack (`NOT_OURS`), which drops it or trims
/// it as it always did, rather than being decapsulated with a header nobody checked (a
/// corrupted sender or length). The UDP checksum, which covers the whole frame, is not
/// verified here (ours carry one: the tunnel key asks for it); the inner packet's own
/// checksums are its receiver's to check.
#[inline(always)]
fn vouched(b: &impl Fn(usize) -> u8, len: u32) -> bool {
    let be16 = |i: usize| u32::from(u16::from_be_bytes([b(i), b(i + 1)]));
    let mut sum = 0u32;
    let mut i = IP;
    while i < UDP {
        sum += be16(i);
        i += 2;
    }
    sum = (sum & 0xffff) + (sum >> 16);
    sum = (sum & 0xffff) + (sum >> 16);
    let total = be16(IP + 2);
    sum == 0xffff && total + ETH as u32 == len && be16(UDP + 4) + 20 == total
}

#[inline(always)]
fn set_sender(m: &mut Received, v4: u32) {
    const { assert!(core::mem::offset_of!(Received, sender) % 4 == 0) };
    const { assert!(core::mem::align_of::<Received>() >= 4) };
    let w = (&raw mut m.sender).cast::<u32>();
    // SAFETY: 16 bytes at a 4-aligned offset of a 4-aligned struct (asserted above);
    // any bytes are a valid underlay address.
    unsafe {
        w.write(0);
        w.add(1).write(0);
        w.add(2).write(u32::from_ne_bytes([0, 0, 0xff, 0xff]));
        w.add(3).write(v4.to_be());
    }
}
