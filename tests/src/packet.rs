//! A small packet builder for `test_run` tables: Ethernet + IPv4 (with options) + TCP, UDP,
//! ICMP echo or any other protocol, with every checksum computed from scratch. Tests build
//! the frame they send and the frame they expect back with the same builder, so a rewrite
//! is checked field by field *and* against checksums that owe nothing to the datapath's
//! incremental updates.

use std::net::Ipv4Addr;

pub const ETH_P_IP: u16 = 0x0800;
pub const ETH_P_ARP: u16 = 0x0806;
pub const PROTO_ICMP: u8 = 1;
pub const PROTO_TCP: u8 = 6;
pub const PROTO_UDP: u8 = 17;
pub const PROTO_GRE: u8 = 47;

pub const TCP_FIN: u8 = 0x01;
pub const TCP_SYN: u8 = 0x02;
pub const TCP_RST: u8 = 0x04;
pub const TCP_ACK: u8 = 0x10;

/// IPv4 "don't fragment" and "more fragments" bits of the flags/offset word.
pub const IP_DF: u16 = 0x4000;
pub const IP_MF: u16 = 0x2000;

/// The transport part of a packet.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum L4 {
    Tcp {
        sport: u16,
        dport: u16,
        flags: u8,
        seq: u32,
        ack: u32,
        /// Raw TCP options, padded by the builder to a multiple of 4.
        options: Vec<u8>,
        payload: Vec<u8>,
    },
    Udp {
        sport: u16,
        dport: u16,
        /// Send (and expect) a zero checksum: "no checksum" in IPv4.
        no_checksum: bool,
        payload: Vec<u8>,
    },
    /// ICMP echo request (type 8) or reply (type 0).
    Echo {
        reply: bool,
        id: u16,
        seq: u16,
        payload: Vec<u8>,
    },
    /// Any other protocol: the bytes after the IP header, as they are.
    Raw { proto: u8, payload: Vec<u8> },
}

impl L4 {
    pub fn tcp(sport: u16, dport: u16, flags: u8) -> Self {
        L4::Tcp {
            sport,
            dport,
            flags,
            seq: 0x0102_0304,
            ack: if flags & TCP_ACK != 0 { 0x0a0b_0c0d } else { 0 },
            options: Vec::new(),
            payload: Vec::new(),
        }
    }

    /// A SYN with an MSS option (and a few other common options around it).
    pub fn syn(sport: u16, dport: u16, mss: u16) -> Self {
        let [hi, lo] = mss.to_be_bytes();
        L4::Tcp {
            sport,
            dport,
            flags: TCP_SYN,
            seq: 0x0102_0304,
            ack: 0,
            // NOP, NOP, SACK permitted, MSS, window scale 7, EOL padding.
            options: vec![1, 1, 4, 2, 2, 4, hi, lo, 3, 3, 7, 0],
            payload: Vec::new(),
        }
    }

    pub fn udp(sport: u16, dport: u16, payload: &[u8]) -> Self {
        L4::Udp {
            sport,
            dport,
            no_checksum: false,
            payload: payload.to_vec(),
        }
    }

    pub fn udp_no_checksum(sport: u16, dport: u16, payload: &[u8]) -> Self {
        L4::Udp {
            sport,
            dport,
            no_checksum: true,
            payload: payload.to_vec(),
        }
    }

    pub fn echo_request(id: u16, seq: u16) -> Self {
        L4::Echo {
            reply: false,
            id,
            seq,
            payload: b"abcdefghijklmnop".to_vec(),
        }
    }

    pub fn echo_reply(id: u16, seq: u16) -> Self {
        L4::Echo {
            reply: true,
            id,
            seq,
            payload: b"abcdefghijklmnop".to_vec(),
        }
    }

    pub fn raw(proto: u8, payload: &[u8]) -> Self {
        L4::Raw {
            proto,
            payload: payload.to_vec(),
        }
    }

    pub fn proto(&self) -> u8 {
        match self {
            L4::Tcp { .. } => PROTO_TCP,
            L4::Udp { .. } => PROTO_UDP,
            L4::Echo { .. } => PROTO_ICMP,
            L4::Raw { proto, .. } => *proto,
        }
    }

    /// The source port (ICMP: the identifier of a request).
    pub fn with_sport(mut self, port: u16) -> Self {
        match &mut self {
            L4::Tcp { sport, .. } | L4::Udp { sport, .. } => *sport = port,
            L4::Echo {
                id, reply: false, ..
            } => *id = port,
            _ => panic!("no source port in {self:?}"),
        }
        self
    }

    /// The destination port (ICMP: the identifier of a reply).
    pub fn with_dport(mut self, port: u16) -> Self {
        match &mut self {
            L4::Tcp { dport, .. } | L4::Udp { dport, .. } => *dport = port,
            L4::Echo {
                id, reply: true, ..
            } => *id = port,
            _ => panic!("no destination port in {self:?}"),
        }
        self
    }

    fn bytes(&self, src: Ipv4Addr, dst: Ipv4Addr) -> Vec<u8> {
        match self {
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
                b.extend_from_slice(&[0, 0, 0, 0]); // checksum, urgent pointer
                b.extend_from_slice(&opts);
                b.extend_from_slice(payload);
                let c = checksum(&[&pseudo_header(src, dst, PROTO_TCP, b.len()), &b]);
                b[16..18].copy_from_slice(&c.to_be_bytes());
                b
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
                if !no_checksum {
                    let c = checksum(&[&pseudo_header(src, dst, PROTO_UDP, b.len()), &b]);
                    // A computed zero is sent as all ones (RFC 768).
                    let c = if c == 0 { 0xffff } else { c };
                    b[6..8].copy_from_slice(&c.to_be_bytes());
                }
                b
            }
            L4::Echo {
                reply,
                id,
                seq,
                payload,
            } => {
                let mut b = vec![if *reply { 0 } else { 8 }, 0, 0, 0];
                b.extend_from_slice(&id.to_be_bytes());
                b.extend_from_slice(&seq.to_be_bytes());
                b.extend_from_slice(payload);
                let c = checksum(&[&b]);
                b[2..4].copy_from_slice(&c.to_be_bytes());
                b
            }
            L4::Raw { payload, .. } => payload.clone(),
        }
    }
}

/// ICMP error types (RFC 792).
pub const ICMP_DEST_UNREACH: u8 = 3;
pub const ICMP_TIME_EXCEEDED: u8 = 11;

/// An ICMP error (`kind`, `code`, the 4 bytes after the checksum: unused, or the next-hop
/// MTU of "fragmentation needed") quoting `quoted` (an IP header and what follows, as
/// much as the sender quotes), its checksum computed.
pub fn icmp_error(kind: u8, code: u8, rest: [u8; 4], quoted: &[u8]) -> L4 {
    let mut b = vec![kind, code, 0, 0];
    b.extend_from_slice(&rest);
    b.extend_from_slice(quoted);
    let c = checksum(&[&b]);
    b[2..4].copy_from_slice(&c.to_be_bytes());
    L4::raw(PROTO_ICMP, &b)
}

/// The IP packet of `frame` (an Ethernet frame) cut to its first `n` bytes: what a router
/// quotes in an error about it.
pub fn quote(frame: &[u8], n: usize) -> Vec<u8> {
    frame[14..14 + n].to_vec()
}

/// An Ethernet frame carrying IPv4.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Ipv4Packet {
    pub eth_dst: [u8; 6],
    pub eth_src: [u8; 6],
    pub src: Ipv4Addr,
    pub dst: Ipv4Addr,
    pub ttl: u8,
    pub id: u16,
    /// Flags and fragment offset, as in the header (e.g. [`IP_DF`]).
    pub frag: u16,
    /// Raw IP options, padded by the builder to a multiple of 4.
    pub options: Vec<u8>,
    pub l4: L4,
}

/// Default MACs of test frames: pod side and host side of a veth.
pub const POD_MAC: [u8; 6] = [0x02, 0, 0, 0, 0xaa, 0x01];
pub const HOST_MAC: [u8; 6] = [0x02, 0, 0, 0, 0xbb, 0x01];

impl Ipv4Packet {
    pub fn new(src: Ipv4Addr, dst: Ipv4Addr, l4: L4) -> Self {
        Ipv4Packet {
            eth_dst: HOST_MAC,
            eth_src: POD_MAC,
            src,
            dst,
            ttl: 64,
            id: 0x1234,
            frag: IP_DF,
            options: Vec::new(),
            l4,
        }
    }

    pub fn src(mut self, src: Ipv4Addr) -> Self {
        self.src = src;
        self
    }

    pub fn dst(mut self, dst: Ipv4Addr) -> Self {
        self.dst = dst;
        self
    }

    pub fn ttl(mut self, ttl: u8) -> Self {
        self.ttl = ttl;
        self
    }

    pub fn frag(mut self, frag: u16) -> Self {
        self.frag = frag;
        self
    }

    pub fn options(mut self, options: &[u8]) -> Self {
        self.options = options.to_vec();
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

    /// The frame, with the IPv4 header checksum and the transport checksum computed.
    pub fn build(&self) -> Vec<u8> {
        let mut opts = self.options.clone();
        while !opts.len().is_multiple_of(4) {
            opts.push(0);
        }
        let ihl = 20 + opts.len();
        let l4 = self.l4.bytes(self.src, self.dst);
        let mut f = Vec::with_capacity(14 + ihl + l4.len());
        f.extend_from_slice(&self.eth_dst);
        f.extend_from_slice(&self.eth_src);
        f.extend_from_slice(&ETH_P_IP.to_be_bytes());
        let mut ip = Vec::with_capacity(ihl);
        ip.push(0x40 | (ihl / 4) as u8);
        ip.push(0);
        ip.extend_from_slice(&((ihl + l4.len()) as u16).to_be_bytes());
        ip.extend_from_slice(&self.id.to_be_bytes());
        ip.extend_from_slice(&self.frag.to_be_bytes());
        ip.push(self.ttl);
        ip.push(self.l4.proto());
        ip.extend_from_slice(&[0, 0]);
        ip.extend_from_slice(&self.src.octets());
        ip.extend_from_slice(&self.dst.octets());
        ip.extend_from_slice(&opts);
        let c = checksum(&[&ip]);
        ip[10..12].copy_from_slice(&c.to_be_bytes());
        f.extend_from_slice(&ip);
        f.extend_from_slice(&l4);
        f
    }
}

/// `inner` (a frame) in VXLAN over IPv4 from `sender` to `dst`, UDP port `port`, VNI
/// `vni`, as a node's tunnel device sends it to the underlay (outer header checksum
/// right, UDP checksum zero).
pub fn vxlan(sender: Ipv4Addr, dst: Ipv4Addr, port: u16, vni: u32, inner: &[u8]) -> Vec<u8> {
    let ip_len = (20 + 8 + 8 + inner.len()) as u16;
    let mut f = Vec::new();
    f.extend_from_slice(&[
        0x02, 0, 0, 0, 0xcc, 0x01, 0x02, 0, 0, 0, 0xcc, 0x02, 0x08, 0,
    ]);
    f.extend_from_slice(&[0x45, 0]);
    f.extend_from_slice(&ip_len.to_be_bytes());
    f.extend_from_slice(&[0, 0, 0, 0, 64, PROTO_UDP, 0, 0]);
    f.extend_from_slice(&sender.octets());
    f.extend_from_slice(&dst.octets());
    let c = checksum(&[&f[14..34]]);
    f[24..26].copy_from_slice(&c.to_be_bytes());
    f.extend_from_slice(&54_321u16.to_be_bytes());
    f.extend_from_slice(&port.to_be_bytes());
    f.extend_from_slice(&(ip_len - 20).to_be_bytes());
    f.extend_from_slice(&[0, 0, 0x08, 0, 0, 0]);
    f.extend_from_slice(&(vni << 8).to_be_bytes());
    f.extend_from_slice(inner);
    f
}

/// A frame that is not IPv4 (an ARP request).
pub fn arp_frame() -> Vec<u8> {
    let mut f = Vec::new();
    f.extend_from_slice(&[0xff; 6]);
    f.extend_from_slice(&POD_MAC);
    f.extend_from_slice(&ETH_P_ARP.to_be_bytes());
    f.extend_from_slice(&[0, 1, 8, 0, 6, 4, 0, 1]);
    f.extend_from_slice(&POD_MAC);
    f.extend_from_slice(&[10, 244, 1, 5]);
    f.extend_from_slice(&[0; 6]);
    f.extend_from_slice(&[10, 244, 1, 1]);
    f
}

fn pseudo_header(src: Ipv4Addr, dst: Ipv4Addr, proto: u8, len: usize) -> Vec<u8> {
    let mut p = Vec::with_capacity(12);
    p.extend_from_slice(&src.octets());
    p.extend_from_slice(&dst.octets());
    p.push(0);
    p.push(proto);
    p.extend_from_slice(&(len as u16).to_be_bytes());
    p
}

/// The Internet checksum (RFC 1071) over the concatenation of `parts` (each of even
/// length, except possibly the last).
pub fn checksum(parts: &[&[u8]]) -> u16 {
    let mut sum: u32 = 0;
    let mut bytes = parts.iter().flat_map(|p| p.iter().copied());
    loop {
        match (bytes.next(), bytes.next()) {
            (Some(hi), Some(lo)) => sum += u32::from(u16::from_be_bytes([hi, lo])),
            (Some(hi), None) => {
                sum += u32::from(hi) << 8;
                break;
            }
            _ => break,
        }
    }
    while sum > 0xffff {
        sum = (sum & 0xffff) + (sum >> 16);
    }
    !(sum as u16)
}

/// A readable diff of two frames: offsets and bytes that differ, for assertion messages.
pub fn diff(got: &[u8], want: &[u8]) -> String {
    let mut out = String::new();
    if got.len() != want.len() {
        out.push_str(&format!(
            "length {} != expected {}; ",
            got.len(),
            want.len()
        ));
    }
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        if g != w {
            out.push_str(&format!("[{i}] {g:#04x}!={w:#04x} "));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn checksums_verify_to_zero() {
        let src = Ipv4Addr::new(10, 244, 1, 5);
        let dst = Ipv4Addr::new(10, 100, 0, 7);
        for l4 in [
            L4::syn(40_000, 80, 1460),
            L4::udp(5353, 53, b"odd"),
            L4::echo_request(7, 1),
        ] {
            let f = Ipv4Packet::new(src, dst, l4.clone())
                .options(&[7, 7, 4, 0, 0, 0, 0])
                .build();
            let ihl = usize::from(f[14] & 0xf) * 4;
            assert_eq!(checksum(&[&f[14..14 + ihl]]), 0);
            let seg = &f[14 + ihl..];
            let sum = if l4.proto() == PROTO_ICMP {
                checksum(&[seg])
            } else {
                checksum(&[&pseudo_header(src, dst, l4.proto(), seg.len()), seg])
            };
            assert_eq!(sum, 0, "{l4:?}");
        }
    }
}
