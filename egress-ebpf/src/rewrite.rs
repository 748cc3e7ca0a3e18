//! Packet rewrites with incremental checksum updates: addresses, ports, TTL, MSS, MACs.

use aya_ebpf::{
    bindings::{BPF_F_MARK_MANGLED_0, BPF_F_PSEUDO_HDR},
    programs::TcContext,
};

use crate::parse::{
    IP_CSUM_OFF, IP_DST_OFF, IP_SRC_OFF, IP_TTL_OFF, Ipv4, L4, PROTO_ICMP, PROTO_TCP, PROTO_UDP,
};

/// Failed to write the packet (the skb could not be made writable).
pub struct WriteFailed;

type Result<T = ()> = core::result::Result<T, WriteFailed>;

fn ok(r: core::result::Result<(), i64>) -> Result {
    r.map_err(|_| WriteFailed)
}

/// Offset of the transport checksum, and the flags its updates need.
#[inline(always)]
fn l4_csum(ip: &Ipv4) -> (usize, u64) {
    match ip.proto {
        PROTO_TCP => (ip.l4 + 16, 0),
        // A zero UDP checksum means "none": keep it zero, and never produce zero.
        PROTO_UDP => (ip.l4 + 6, u64::from(BPF_F_MARK_MANGLED_0)),
        _ => (ip.l4 + 2, 0),
    }
}

/// Replace one IPv4 address (at `addr_off`) and the port at `port_off`.
#[inline(always)]
#[expect(
    clippy::too_many_arguments,
    reason = "two call sites (SNAT, DNAT); a struct would only rename the arguments"
)]
fn rewrite_addr_port(
    ctx: &TcContext,
    ip: &Ipv4,
    addr_off: usize,
    old_addr: [u8; 4],
    new_addr: [u8; 4],
    port_off: usize,
    old_port_be: u16,
    new_port_be: u16,
) -> Result {
    let (csum_off, extra) = l4_csum(ip);
    let old_a = u64::from(u32::from_ne_bytes(old_addr));
    let new_a = u64::from(u32::from_ne_bytes(new_addr));
    if old_addr != new_addr {
        // ICMP has no pseudo-header: only the IP header checksum sees the address.
        if ip.proto != PROTO_ICMP {
            ok(ctx.l4_csum_replace(
                csum_off,
                old_a,
                new_a,
                u64::from(BPF_F_PSEUDO_HDR) | extra | 4,
            ))?;
        }
        ok(ctx.l3_csum_replace(IP_CSUM_OFF, old_a, new_a, 4))?;
        ok(ctx.store(addr_off, &new_addr, 0))?;
    }
    if old_port_be != new_port_be {
        ok(ctx.l4_csum_replace(
            csum_off,
            u64::from(old_port_be),
            u64::from(new_port_be),
            extra | 2,
        ))?;
        ok(ctx.store(port_off, &new_port_be, 0))?;
    }
    Ok(())
}

/// Source NAT: the source address becomes `addr`, the pod-side port (or ICMP echo
/// identifier) becomes `port_be`.
#[inline(always)]
pub fn snat(ctx: &TcContext, ip: &Ipv4, l4: &L4, addr: [u8; 4], port_be: u16) -> Result {
    // TCP/UDP source port at +0; ICMP echo identifier at +4.
    let port_off = if ip.proto == PROTO_ICMP {
        ip.l4 + 4
    } else {
        ip.l4
    };
    rewrite_addr_port(
        ctx,
        ip,
        IP_SRC_OFF,
        ip.src,
        addr,
        port_off,
        l4.sport_be,
        port_be,
    )
}

/// Destination NAT of a reply: the destination address becomes `addr`, the pod-side port
/// (or ICMP echo identifier) becomes `port_be`.
#[inline(always)]
pub fn dnat(ctx: &TcContext, ip: &Ipv4, l4: &L4, addr: [u8; 4], port_be: u16) -> Result {
    let port_off = if ip.proto == PROTO_ICMP {
        ip.l4 + 4
    } else {
        ip.l4 + 2
    };
    rewrite_addr_port(
        ctx,
        ip,
        IP_DST_OFF,
        ip.dst,
        addr,
        port_off,
        l4.dport_be,
        port_be,
    )
}

/// Decrement the TTL by one. The caller has checked that it is above one.
#[inline(always)]
pub fn dec_ttl(ctx: &TcContext, ip: &Ipv4) -> Result {
    // TTL and protocol form one 16-bit word of the header checksum.
    let old: u16 = ctx.load(IP_TTL_OFF).map_err(|_| WriteFailed)?;
    let new = u16::from_ne_bytes([ip.ttl - 1, ip.proto]);
    ok(ctx.l3_csum_replace(IP_CSUM_OFF, u64::from(old), u64::from(new), 2))?;
    ok(ctx.store(IP_TTL_OFF, &(ip.ttl - 1), 0))
}

/// Write the Ethernet addresses.
#[inline(always)]
pub fn set_macs(ctx: &TcContext, dst: &[u8; 6], src: &[u8; 6]) -> Result {
    ok(ctx.store(0, dst, 0))?;
    ok(ctx.store(6, src, 0))
}

const TCPOPT_EOL: u8 = 0;
const TCPOPT_NOP: u8 = 1;
const TCPOPT_MSS: u8 = 2;
/// At most 40 bytes of TCP options.
const MAX_OPT_STEPS: usize = 40;

/// Lower the MSS option of a SYN to `max_mss`. Returns whether the packet changed.
#[inline(always)]
pub fn clamp_mss(ctx: &TcContext, ip: &Ipv4, l4: &L4, max_mss: u16) -> Result<bool> {
    let opts_end = ip.l4 + l4.tcp_hdr_len;
    let mut off = ip.l4 + 20;
    for _ in 0..MAX_OPT_STEPS {
        if off >= opts_end {
            break;
        }
        let kind: u8 = ctx.load(off).map_err(|_| WriteFailed)?;
        match kind {
            TCPOPT_EOL => break,
            TCPOPT_NOP => off += 1,
            _ => {
                let len: u8 = ctx.load(off + 1).map_err(|_| WriteFailed)?;
                if len < 2 {
                    break;
                }
                if kind == TCPOPT_MSS && len == 4 && off + 4 <= opts_end {
                    let old_be: u16 = ctx.load(off + 2).map_err(|_| WriteFailed)?;
                    if u16::from_be(old_be) <= max_mss {
                        return Ok(false);
                    }
                    let new_be = max_mss.to_be();
                    ok(ctx.l4_csum_replace(ip.l4 + 16, u64::from(old_be), u64::from(new_be), 2))?;
                    ok(ctx.store(off + 2, &new_be, 0))?;
                    return Ok(true);
                }
                off += usize::from(len);
            }
        }
    }
    Ok(false)
}
