//! The IPv6 counterpart of [`crate::packet`]: Ethernet + IPv6 (with extension headers) +
//! TCP, UDP, ICMPv6 echo or any other payload, every checksum computed from scratch over
//! the IPv6 pseudo-header. The transport part is described with the same [`L4`] as IPv4;
//! `L4::Echo` becomes ICMPv6 echo (128/129), and `L4::udp_no_checksum` sends a zero UDP
//! checksum, which IPv6 forbids.

use std::net::Ipv6Addr;

use crate::packet::{HOST_MAC, L4, POD_MAC, PROTO_UDP, checksum};

pub const ETH_P_IPV6: u16 = 0x86dd;
pub const PROTO_ICMPV6: u8 = 58;
pub const NEXTHDR_HOP: u8 = 0;
pub const NEXTHDR_ROUTING: u8 = 43;
pub const NEXTHDR_FRAGMENT: u8 = 44;
pub const NEXTHDR_DEST: u8 = 60;

pub const ICMPV6_ROUTER_SOLICIT: u8 = 133;
pub const ICMPV6_NEIGHBOUR_SOLICIT: u8 = 135;
pub const ICMPV6_NEIGHBOUR_ADVERT: u8 = 136;

/// ICMPv6 error types (RFC 4443).
pub const ICMPV6_DEST_UNREACH: u8 = 1;
pub const ICMPV6_PKT_TOO_BIG: u8 = 2;
pub const ICMPV6_TIME_EXCEEDED: u8 = 3;

/// An ICMPv6 error (`kind`, `code`, the 4 bytes after the checksum: unused, or the MTU of
/// "packet too big") quoting `quoted`; the builder computes its checksum over the
/// pseudo-header.
pub fn icmp6_error(kind: u8, code: u8, rest: [u8; 4], quoted: &[u8]) -> L4 {
    let mut b = vec![kind, code, 0, 0];
    b.extend_from_slice(&rest);
    b.extend_from_slice(quoted);
    L4::raw(PROTO_ICMPV6, &b)
}

/// An Ethernet frame carrying IPv6.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Ipv6Packet {
    pub eth_dst: [u8; 6],
    pub eth_src: [u8; 6],
    pub src: Ipv6Addr,
    pub dst: Ipv6Addr,
    pub hop_limit: u8,
    pub flow_label: u32,
    /// Extension headers in order: (header type, bytes after the next-header and length
    /// octets). The builder pads each to a multiple of 8 and chains the next headers.
    pub ext: Vec<(u8, Vec<u8>)>,
    pub l4: L4,
}

impl Ipv6Packet {
    pub fn new(src: Ipv6Addr, dst: Ipv6Addr, l4: L4) -> Self {
        Ipv6Packet {
            eth_dst: HOST_MAC,
            eth_src: POD_MAC,
            src,
            dst,
            hop_limit: 64,
            flow_label: 0x12345,
            ext: Vec::new(),
            l4,
        }
    }

    pub fn src(mut self, src: Ipv6Addr) -> Self {
        self.src = src;
        self
    }

    pub fn dst(mut self, dst: Ipv6Addr) -> Self {
        self.dst = dst;
        self
    }

    pub fn hop_limit(mut self, hop_limit: u8) -> Self {
        self.hop_limit = hop_limit;
        self
    }

    pub fn macs(mut self, dst: [u8; 6], src: [u8; 6]) -> Self {
        self.eth_dst = dst;
        self.eth_src = src;
        self
    }

    pub fn l4(mut self, l4: L4) -> Self {
        self.l4 = l4;
        self
    }

    /// Append an extension header of type `kind` with `body` (padded to 8n - 2 bytes).
    pub fn ext(mut self, kind: u8, body: &[u8]) -> Self {
        self.ext.push((kind, body.to_vec()));
        self
    }

    /// A hop-by-hop or destination options header with one PadN option.
    pub fn pad_options(self, kind: u8) -> Self {
        self.ext(kind, &[1, 4, 0, 0, 0, 0])
    }

    /// A fragment header (offset in 8-byte units, more-fragments flag).
    pub fn fragment(self, offset: u16, more: bool) -> Self {
        let word = (offset << 3) | u16::from(more);
        let [hi, lo] = word.to_be_bytes();
        self.ext(NEXTHDR_FRAGMENT, &[hi, lo, 0, 0, 0x12, 0x34])
    }

    /// A type 4 (segment routing) routing header with `segments_left` and one segment.
    pub fn routing(self, segments_left: u8) -> Self {
        let mut body = vec![4, segments_left, 0, 0, 0, 0];
        body.extend_from_slice(&self.dst.octets());
        self.ext(NEXTHDR_ROUTING, &body)
    }

    /// The IPv6 protocol number of the transport part.
    pub fn proto(&self) -> u8 {
        match &self.l4 {
            L4::Echo { .. } => PROTO_ICMPV6,
            l4 => l4.proto(),
        }
    }

    fn l4_bytes(&self) -> Vec<u8> {
        let proto = self.proto();
        let (mut b, csum_off) = match &self.l4 {
            L4::Tcp {
                sport,
                dport,
                flags,
                seq,
                ack,
                options,
                payload,
            } => {
                let mut opts = options.clone();
                while !opts.len().is_multiple_of(4) {
                    opts.push(0);
                }
                let hdr_len = 20 + opts.len();
                let mut b = Vec::with_capacity(hdr_len + payload.len());
                b.extend_from_slice(&sport.to_be_bytes());
                b.extend_from_slice(&dport.to_be_bytes());
                b.extend_from_slice(&seq.to_be_bytes());
                b.extend_from_slice(&ack.to_be_bytes());
                b.push(((hdr_len / 4) as u8) << 4);
                b.push(*flags);
                b.extend_from_slice(&64_240u16.to_be_bytes());
                b.extend_from_slice(&[0, 0, 0, 0]);
                b.extend_from_slice(&opts);
                b.extend_from_slice(payload);
                (b, Some(16))
            }
            L4::Udp {
                sport,
                dport,
                no_checksum,
                payload,
            } => {
                let mut b = Vec::with_capacity(8 + payload.len());
                b.extend_from_slice(&sport.to_be_bytes());
                b.extend_from_slice(&dport.to_be_bytes());
                b.extend_from_slice(&((8 + payload.len()) as u16).to_be_bytes());
                b.extend_from_slice(&[0, 0]);
                b.extend_from_slice(payload);
                (b, (!no_checksum).then_some(6))
            }
            L4::Echo {
                reply,
                id,
                seq,
                payload,
            } => {
                let mut b = vec![if *reply { 129 } else { 128 }, 0, 0, 0];
                b.extend_from_slice(&id.to_be_bytes());
                b.extend_from_slice(&seq.to_be_bytes());
                b.extend_from_slice(payload);
                (b, Some(2))
            }
            // ICMPv6 (neighbour discovery...) gets its checksum; anything else is raw.
            L4::Raw { payload, .. } => (
                payload.clone(),
                (proto == PROTO_ICMPV6 && payload.len() >= 4).then_some(2),
            ),
        };
        if let Some(off) = csum_off {
            let c = checksum(&[&pseudo_header6(self.src, self.dst, proto, b.len()), &b]);
            let c = if c == 0 && proto == PROTO_UDP {
                0xffff
            } else {
                c
            };
            b[off..off + 2].copy_from_slice(&c.to_be_bytes());
        }
        b
    }

    /// The frame, with the transport checksum computed.
    pub fn build(&self) -> Vec<u8> {
        let l4 = self.l4_bytes();
        let mut exts = Vec::new();
        for (i, (_, body)) in self.ext.iter().enumerate() {
            let next = self.ext.get(i + 1).map_or(self.proto(), |e| e.0);
            let mut h = vec![next, 0];
            h.extend_from_slice(body);
            while !h.len().is_multiple_of(8) {
                h.push(0);
            }
            h[1] = (h.len() / 8 - 1) as u8;
            exts.extend_from_slice(&h);
        }
        let first = self.ext.first().map_or(self.proto(), |e| e.0);
        let mut f = Vec::with_capacity(14 + 40 + exts.len() + l4.len());
        f.extend_from_slice(&self.eth_dst);
        f.extend_from_slice(&self.eth_src);
        f.extend_from_slice(&ETH_P_IPV6.to_be_bytes());
        f.extend_from_slice(&((6u32 << 28) | (self.flow_label & 0xf_ffff)).to_be_bytes());
        f.extend_from_slice(&((exts.len() + l4.len()) as u16).to_be_bytes());
        f.push(first);
        f.push(self.hop_limit);
        f.extend_from_slice(&self.src.octets());
        f.extend_from_slice(&self.dst.octets());
        f.extend_from_slice(&exts);
        f.extend_from_slice(&l4);
        f
    }
}

/// An ICMPv6 message of `kind` (code 0) with `body` after the checksum.
pub fn icmp6(kind: u8, body: &[u8]) -> L4 {
    let mut payload = vec![kind, 0, 0, 0];
    payload.extend_from_slice(body);
    L4::raw(PROTO_ICMPV6, &payload)
}

/// A neighbour solicitation (or advertisement) about `target`.
pub fn ndp(kind: u8, target: Ipv6Addr) -> L4 {
    let mut body = vec![0; 4];
    body.extend_from_slice(&target.octets());
    // Source link-layer address option.
    body.extend_from_slice(&[1, 1]);
    body.extend_from_slice(&POD_MAC);
    icmp6(kind, &body)
}

/// The solicited-node multicast address of `a` (ff02::1:ffXX:XXXX).
pub fn solicited_node(a: Ipv6Addr) -> Ipv6Addr {
    let o = a.octets();
    Ipv6Addr::new(
        0xff02,
        0,
        0,
        0,
        0,
        1,
        0xff00 | u16::from(o[13]),
        u16::from_be_bytes([o[14], o[15]]),
    )
}

pub fn pseudo_header6(src: Ipv6Addr, dst: Ipv6Addr, proto: u8, len: usize) -> Vec<u8> {
    let mut p = Vec::with_capacity(40);
    p.extend_from_slice(&src.octets());
    p.extend_from_slice(&dst.octets());
    p.extend_from_slice(&(len as u32).to_be_bytes());
    p.extend_from_slice(&[0, 0, 0, proto]);
    p
}

/// Offset of the transport header of an IPv6 frame built by [`Ipv6Packet::build`].
pub fn l4_offset(f: &[u8]) -> usize {
    let mut next = f[20];
    let mut off = 54;
    while matches!(
        next,
        NEXTHDR_HOP | NEXTHDR_ROUTING | NEXTHDR_DEST | NEXTHDR_FRAGMENT
    ) {
        next = f[off];
        off += (usize::from(f[off + 1]) + 1) * 8;
    }
    off
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn checksums_verify_to_zero() {
        let src: Ipv6Addr = "fd00:244:1::5".parse().unwrap();
        let dst: Ipv6Addr = "fd00:100::7".parse().unwrap();
        for l4 in [
            L4::syn(40_000, 80, 1440),
            L4::udp(5353, 53, b"odd"),
            L4::echo_request(7, 1),
            ndp(ICMPV6_NEIGHBOUR_SOLICIT, dst),
        ] {
            let p = Ipv6Packet::new(src, dst, l4.clone())
                .pad_options(NEXTHDR_HOP)
                .pad_options(NEXTHDR_DEST);
            let f = p.build();
            let off = l4_offset(&f);
            assert_eq!(off, 54 + 16);
            let seg = &f[off..];
            assert_eq!(
                checksum(&[&pseudo_header6(src, dst, p.proto(), seg.len()), seg]),
                0,
                "{l4:?}"
            );
        }
    }
}
