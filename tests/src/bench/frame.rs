//! The frames the benchmarks send: Ethernet + IPv4 + TCP without payload (checksums
//! computed), and an ARP request for the floor. Deliberately separate from the test
//! packet builder: the benchmark needs only these two shapes and must not move when the
//! test tables grow. The IPv6 rows' one shape, [`tcp6_ack`], is fixed here but built
//! with the IPv6 test builder ([`crate::packet6`]) rather than a second serializer.

use std::net::{Ipv4Addr, Ipv6Addr};

use crate::{packet::L4, packet6::Ipv6Packet};

pub const ETH_P_IP: u16 = 0x0800;
pub const ETH_P_ARP: u16 = 0x0806;
pub const PROTO_TCP: u8 = 6;
pub const TCP_SYN: u8 = 0x02;
pub const TCP_ACK: u8 = 0x10;

const SRC_MAC: [u8; 6] = [0x02, 0, 0, 0, 0xaa, 0x01];
const DST_MAC: [u8; 6] = [0x02, 0, 0, 0, 0xbb, 0x01];

/// One TCP segment without payload.
#[derive(Clone, Copy, Debug)]
pub struct Tcp {
    pub src: Ipv4Addr,
    pub dst: Ipv4Addr,
    pub sport: u16,
    pub dport: u16,
    pub flags: u8,
    pub ttl: u8,
}

impl Tcp {
    pub fn new(src: Ipv4Addr, sport: u16, dst: Ipv4Addr, dport: u16, flags: u8) -> Self {
        Self {
            src,
            dst,
            sport,
            dport,
            flags,
            ttl: 64,
        }
    }

    pub fn ttl(mut self, ttl: u8) -> Self {
        self.ttl = ttl;
        self
    }

    /// The frame: 14 + 20 + 20 bytes, DF set, valid IP and TCP checksums.
    pub fn frame(&self) -> Vec<u8> {
        let mut f = Vec::with_capacity(54);
        f.extend_from_slice(&DST_MAC);
        f.extend_from_slice(&SRC_MAC);
        f.extend_from_slice(&ETH_P_IP.to_be_bytes());
        let ip_start = f.len();
        f.extend_from_slice(&[0x45, 0]);
        f.extend_from_slice(&40u16.to_be_bytes()); // total length
        f.extend_from_slice(&0x1234u16.to_be_bytes()); // id
        f.extend_from_slice(&0x4000u16.to_be_bytes()); // DF
        f.extend_from_slice(&[self.ttl, PROTO_TCP, 0, 0]);
        f.extend_from_slice(&self.src.octets());
        f.extend_from_slice(&self.dst.octets());
        let ip_csum = checksum(&f[ip_start..], 0);
        f[ip_start + 10..ip_start + 12].copy_from_slice(&ip_csum.to_be_bytes());
        let tcp_start = f.len();
        f.extend_from_slice(&self.sport.to_be_bytes());
        f.extend_from_slice(&self.dport.to_be_bytes());
        f.extend_from_slice(&1000u32.to_be_bytes()); // seq
        f.extend_from_slice(&2000u32.to_be_bytes()); // ack
        f.extend_from_slice(&[5 << 4, self.flags]);
        f.extend_from_slice(&64_240u16.to_be_bytes()); // window
        f.extend_from_slice(&[0, 0, 0, 0]); // checksum, urgent pointer
        let mut pseudo = 0u32;
        for a in [self.src, self.dst] {
            let o = a.octets();
            pseudo += u32::from(u16::from_be_bytes([o[0], o[1]]));
            pseudo += u32::from(u16::from_be_bytes([o[2], o[3]]));
        }
        pseudo += u32::from(PROTO_TCP) + 20;
        let tcp_csum = checksum(&f[tcp_start..], pseudo);
        f[tcp_start + 16..tcp_start + 18].copy_from_slice(&tcp_csum.to_be_bytes());
        f
    }
}

/// An IPv6 TCP ACK without payload at hop limit 255: 14 + 40 + 20 bytes, valid TCP
/// checksum over the pseudo-header.
pub fn tcp6_ack(src: Ipv6Addr, sport: u16, dst: Ipv6Addr, dport: u16) -> Vec<u8> {
    Ipv6Packet::new(src, dst, L4::tcp(sport, dport, TCP_ACK))
        .hop_limit(255)
        .build()
}

/// An ARP request (who-has `target` tell `sender`): 42 bytes.
pub fn arp(sender: Ipv4Addr, target: Ipv4Addr) -> Vec<u8> {
    let mut f = Vec::with_capacity(42);
    f.extend_from_slice(&[0xff; 6]);
    f.extend_from_slice(&SRC_MAC);
    f.extend_from_slice(&ETH_P_ARP.to_be_bytes());
    f.extend_from_slice(&[0, 1, 0x08, 0x00, 6, 4, 0, 1]); // Ethernet/IPv4, request
    f.extend_from_slice(&SRC_MAC);
    f.extend_from_slice(&sender.octets());
    f.extend_from_slice(&[0; 6]);
    f.extend_from_slice(&target.octets());
    f
}

/// Internet checksum of `data`, starting from a partial sum.
fn checksum(data: &[u8], initial: u32) -> u16 {
    let mut sum = initial;
    for pair in data.chunks(2) {
        let hi = pair[0];
        let lo = pair.get(1).copied().unwrap_or(0);
        sum += u32::from(u16::from_be_bytes([hi, lo]));
    }
    while sum > 0xffff {
        sum = (sum & 0xffff) + (sum >> 16);
    }
    !(sum as u16)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn checksums_verify_to_zero() {
        let f = Tcp::new(
            Ipv4Addr::new(10, 244, 1, 5),
            40_000,
            Ipv4Addr::new(192, 168, 101, 100),
            443,
            TCP_ACK,
        )
        .frame();
        assert_eq!(f.len(), 54);
        assert_eq!(checksum(&f[14..34], 0), 0);
        let mut pseudo = 0u32;
        for w in f[26..34].chunks(2) {
            pseudo += u32::from(u16::from_be_bytes([w[0], w[1]]));
        }
        pseudo += u32::from(PROTO_TCP) + 20;
        assert_eq!(checksum(&f[34..], pseudo), 0);
        assert_eq!(arp(Ipv4Addr::LOCALHOST, Ipv4Addr::LOCALHOST).len(), 42);
    }
}
