//! Announcing a held address to the segment: gratuitous ARP (IPv4) and unsolicited
//! neighbour advertisements (IPv6), sent raw through an AF_PACKET socket.

use super::*;

pub(crate) const ETH_P_ARP: u16 = 0x0806;
pub(crate) const ETH_P_IPV6: u16 = 0x86dd;
pub(crate) const BROADCAST_MAC: [u8; 6] = [0xff; 6];
/// ff02::1 (all nodes) mapped to Ethernet.
pub(super) const ALL_NODES_MAC: [u8; 6] = [0x33, 0x33, 0, 0, 0, 1];
pub(super) const ALL_NODES: Ipv6Addr = Ipv6Addr::new(0xff02, 0, 0, 0, 0, 0, 0, 1);
pub(crate) const IPPROTO_ICMPV6: u8 = 58;
pub(crate) const ND_NEIGHBOR_ADVERT: u8 = 136;
/// The override flag in the first byte of the flags word of a neighbour advertisement.
const ND_NA_FLAG_OVERRIDE: u8 = 0x20;
/// The target link-layer address option.
pub(crate) const ND_OPT_TARGET_LINKADDR: u8 = 2;

/// Announce `ip`, held on `ifindex` whose MAC is `mac`, once at each offset of `at`:
/// IPv4 with a gratuitous ARP request (sender = target = `ip`, broadcast), IPv6 with an
/// unsolicited neighbour advertisement to ff02::1 (override flag, target link-layer
/// address option), both sent raw through an AF_PACKET socket.
pub async fn announce(ifindex: u32, mac: [u8; 6], ip: IpAddr, at: &[Duration]) -> Result<()> {
    let (what, destination, ethertype, frame) = match ip {
        IpAddr::V4(v4) => (
            "gratuitous ARP",
            BROADCAST_MAC,
            ETH_P_ARP,
            gratuitous_arp(mac, v4),
        ),
        IpAddr::V6(v6) => (
            "unsolicited neighbour advertisement",
            ALL_NODES_MAC,
            ETH_P_IPV6,
            unsolicited_na(mac, v6),
        ),
    };
    let object = || format!("{what} for {ip} on ifindex {ifindex}");
    let socket = PacketSocket::open().map_err(|error| Error::Os {
        verb: "open a packet socket to send",
        object: object(),
        error,
    })?;
    let start = tokio::time::Instant::now();
    for offset in at {
        tokio::time::sleep_until(start + *offset).await;
        socket
            .send(ifindex, destination, ethertype, &frame)
            .map_err(|error| Error::Os {
                verb: "send",
                object: object(),
                error,
            })?;
    }
    Ok(())
}

/// An ARP request announcing `ip` at `mac` (RFC 5227 section 3: sender and target
/// protocol address both `ip`, target hardware address zero).
fn gratuitous_arp(mac: [u8; 6], ip: Ipv4Addr) -> Vec<u8> {
    arp_request(mac, ip, ip)
}

/// A broadcast ARP request from `mac` with sender protocol address `sender` for `target`
/// (target hardware address zero).
pub(crate) fn arp_request(mac: [u8; 6], sender: Ipv4Addr, target: Ipv4Addr) -> Vec<u8> {
    let mut frame = Vec::with_capacity(42);
    frame.extend_from_slice(&BROADCAST_MAC);
    frame.extend_from_slice(&mac);
    frame.extend_from_slice(&ETH_P_ARP.to_be_bytes());
    frame.extend_from_slice(&1u16.to_be_bytes()); // hardware type: Ethernet
    frame.extend_from_slice(&0x0800u16.to_be_bytes()); // protocol type: IPv4
    frame.extend_from_slice(&[6, 4]); // address lengths
    frame.extend_from_slice(&1u16.to_be_bytes()); // opcode: request
    frame.extend_from_slice(&mac);
    frame.extend_from_slice(&sender.octets());
    frame.extend_from_slice(&[0; 6]);
    frame.extend_from_slice(&target.octets());
    frame
}

/// An unsolicited neighbour advertisement for `ip` at `mac` (RFC 4861 section 7.2.6): from
/// `ip` to all nodes, hop limit 255, override set, solicited clear.
fn unsolicited_na(mac: [u8; 6], ip: Ipv6Addr) -> Vec<u8> {
    let mut icmp = Vec::with_capacity(32);
    icmp.extend_from_slice(&[ND_NEIGHBOR_ADVERT, 0, 0, 0]); // type, code, checksum
    icmp.extend_from_slice(&[ND_NA_FLAG_OVERRIDE, 0, 0, 0]);
    icmp.extend_from_slice(&ip.octets());
    icmp.extend_from_slice(&[ND_OPT_TARGET_LINKADDR, 1]); // length in units of 8 bytes
    icmp.extend_from_slice(&mac);
    let checksum = icmpv6_checksum(ip, ALL_NODES, &icmp);
    icmp[2..4].copy_from_slice(&checksum.to_be_bytes());

    let mut frame = Vec::with_capacity(14 + 40 + icmp.len());
    frame.extend_from_slice(&ALL_NODES_MAC);
    frame.extend_from_slice(&mac);
    frame.extend_from_slice(&ETH_P_IPV6.to_be_bytes());
    frame.extend_from_slice(&[0x60, 0, 0, 0]); // version 6, traffic class 0, flow label 0
    frame.extend_from_slice(&(icmp.len() as u16).to_be_bytes());
    frame.push(IPPROTO_ICMPV6);
    frame.push(255); // hop limit: receivers drop ND messages with any other
    frame.extend_from_slice(&ip.octets());
    frame.extend_from_slice(&ALL_NODES.octets());
    frame.extend_from_slice(&icmp);
    frame
}

/// The ICMPv6 checksum (RFC 4443 section 2.3) of `message`, whose checksum field is zero.
pub(crate) fn icmpv6_checksum(source: Ipv6Addr, destination: Ipv6Addr, message: &[u8]) -> u16 {
    let length = u32::try_from(message.len()).unwrap_or(u32::MAX);
    let mut sum = ones_complement_sum(0, &source.octets());
    sum = ones_complement_sum(sum, &destination.octets());
    sum = ones_complement_sum(sum, &length.to_be_bytes());
    sum = ones_complement_sum(sum, &[0, 0, 0, IPPROTO_ICMPV6]);
    sum = ones_complement_sum(sum, message);
    while sum > 0xffff {
        sum = (sum & 0xffff) + (sum >> 16);
    }
    !(sum as u16)
}

/// Add the big-endian 16-bit words of `bytes` (odd tail padded with zero) to `sum`,
/// folding carries so that the sum never overflows.
fn ones_complement_sum(mut sum: u32, bytes: &[u8]) -> u32 {
    for word in bytes.chunks(2) {
        let high = word.first().copied().unwrap_or(0);
        let low = word.get(1).copied().unwrap_or(0);
        sum += u32::from(u16::from_be_bytes([high, low]));
        sum = (sum & 0xffff) + (sum >> 16);
    }
    sum
}

/// A raw AF_PACKET socket that sends whole Ethernet frames and receives nothing
/// (protocol 0; [`crate::doctor::dad`] opens one that receives).
pub(crate) struct PacketSocket(pub(crate) OwnedFd);

impl PacketSocket {
    fn open() -> io::Result<Self> {
        // SAFETY: socket(2) takes no pointers; the result is checked before use.
        let fd = unsafe { libc::socket(libc::AF_PACKET, libc::SOCK_RAW | libc::SOCK_CLOEXEC, 0) };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: `fd` is a fresh descriptor that nothing else owns or closes.
        Ok(Self(unsafe { OwnedFd::from_raw_fd(fd) }))
    }

    pub(crate) fn send(
        &self,
        ifindex: u32,
        destination: [u8; 6],
        ethertype: u16,
        frame: &[u8],
    ) -> io::Result<()> {
        let ifindex =
            i32::try_from(ifindex).map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))?;
        // SAFETY: sockaddr_ll is plain old data, for which all zeroes is a valid value.
        let mut address: libc::sockaddr_ll = unsafe { mem::zeroed() };
        address.sll_family = libc::AF_PACKET as u16;
        address.sll_protocol = ethertype.to_be();
        address.sll_ifindex = ifindex;
        address.sll_halen = 6;
        address.sll_addr[..6].copy_from_slice(&destination);
        // SAFETY: `frame` and `address` are live for the call and the lengths passed are
        // theirs; the kernel only reads them.
        let sent = unsafe {
            libc::sendto(
                self.0.as_raw_fd(),
                frame.as_ptr().cast(),
                frame.len(),
                0,
                (&raw const address).cast(),
                mem::size_of::<libc::sockaddr_ll>() as libc::socklen_t,
            )
        };
        match usize::try_from(sent) {
            Err(_) => Err(io::Error::last_os_error()),
            Ok(n) if n != frame.len() => Err(io::Error::other(format!(
                "sent {n} of {} bytes",
                frame.len()
            ))),
            Ok(_) => Ok(()),
        }
    }
}
