//! Duplicate address detection before an egress IP is claimed: IPv4 with ARP probes (RFC
//! 5227 section 2.1.1: sender IP 0.0.0.0, target the address, broadcast), IPv6 with
//! neighbour solicitations from `::` to the address's solicited-node group (RFC 4862
//! section 5.4.2). Anyone that answers (an ARP packet or a neighbour advertisement for
//! the address from another MAC) holds the address, and is named by its MAC.
//!
//! Bounded: [`PROBES`] probes [`INTERVAL`] apart, then [`LISTEN_AFTER`] more; an answer
//! ends it at once. An address nobody holds costs [`BUDGET`] (200 ms), far below RFC
//! 5227's 1 to 3 s: a live host on a LAN answers in well under a millisecond, and three
//! probes survive the loss of two.

use std::{
    io, mem,
    net::{IpAddr, Ipv4Addr, Ipv6Addr},
    os::fd::{AsRawFd as _, FromRawFd as _, OwnedFd},
    time::Duration,
};

use tokio::{io::unix::AsyncFd, time::Instant};

use crate::iface::{
    self, BROADCAST_MAC, ETH_P_ARP, ETH_P_IPV6, IPPROTO_ICMPV6, ND_NEIGHBOR_ADVERT,
    ND_OPT_TARGET_LINKADDR, PacketSocket,
};

/// Probes sent, [`INTERVAL`] apart.
pub const PROBES: u32 = 3;
pub const INTERVAL: Duration = Duration::from_millis(50);
/// How long to listen after the last probe.
pub const LISTEN_AFTER: Duration = Duration::from_millis(100);
/// What a probe that nobody answers costs.
pub const BUDGET: Duration = Duration::from_millis(50 * (PROBES as u64 - 1) + 100);

const ND_NEIGHBOR_SOLICIT: u8 = 135;
/// `sll_pkttype` of frames this host sent (packet sockets see them too).
const PACKET_OUTGOING: u8 = 4;

/// `aa:bb:cc:dd:ee:ff`.
pub fn mac_string(mac: [u8; 6]) -> String {
    mac.map(|b| format!("{b:02x}")).join(":")
}

/// Probe for `ip` on `ifindex` (whose MAC is `mac`): the MAC of a host that answers, or
/// None after [`BUDGET`] without an answer. Acts in the network namespace of the calling
/// thread.
pub async fn probe(ifindex: u32, mac: [u8; 6], ip: IpAddr) -> iface::Result<Option<[u8; 6]>> {
    let (what, ethertype, destination, frame) = match ip {
        IpAddr::V4(v4) => ("ARP probe", ETH_P_ARP, BROADCAST_MAC, arp_probe(mac, v4)),
        IpAddr::V6(v6) => {
            let (destination, frame) = dad_solicit(mac, v6);
            ("DAD neighbour solicitation", ETH_P_IPV6, destination, frame)
        }
    };
    let os = |verb: &'static str| {
        move |error: io::Error| iface::Error::Os {
            verb,
            object: format!("{what} for {ip} on ifindex {ifindex}"),
            error,
        }
    };
    let socket = listening_socket(ifindex, ethertype).map_err(os("open a packet socket for"))?;
    // SAFETY: the PacketSocket owns its descriptor, which stays open and the same until
    // the AsyncFd drops it.
    let socket = unsafe { AsyncFd::register(socket) }
        .map_err(|e| os("register the packet socket of")(io::Error::from(e)))?;
    let start = Instant::now();
    let deadline = start + BUDGET;
    let mut sent = 0;
    let mut buf = [0u8; 256];
    loop {
        let now = Instant::now();
        if sent < PROBES && now >= start + INTERVAL * sent {
            socket
                .get_ref()
                .send(ifindex, destination, ethertype, &frame)
                .map_err(os("send"))?;
            sent += 1;
            continue;
        }
        if sent == PROBES && now >= deadline {
            return Ok(None);
        }
        let next = if sent < PROBES {
            start + INTERVAL * sent
        } else {
            deadline
        };
        tokio::select! {
            ready = socket.readable() => {
                let mut guard = ready.map_err(os("wait for answers to"))?;
                loop {
                    match guard.try_io(|s| receive(s.get_ref(), &mut buf)) {
                        Ok(Ok(Some(len))) => {
                            if let Some(holder) = answer(&buf[..len], ip, mac) {
                                return Ok(Some(holder));
                            }
                        }
                        Ok(Ok(None)) => {}
                        Ok(Err(e)) => return Err(os("receive answers to")(e)),
                        Err(_would_block) => break,
                    }
                }
            }
            () = tokio::time::sleep_until(next) => {}
        }
    }
}

/// A non-blocking AF_PACKET socket that receives `ethertype` frames of `ifindex` (and
/// sends, as [`PacketSocket::send`] does).
fn listening_socket(ifindex: u32, ethertype: u16) -> io::Result<PacketSocket> {
    let index = i32::try_from(ifindex).map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))?;
    // SAFETY: socket(2) takes no pointers; the result is checked before use.
    let fd = unsafe {
        libc::socket(
            libc::AF_PACKET,
            libc::SOCK_RAW | libc::SOCK_CLOEXEC | libc::SOCK_NONBLOCK,
            i32::from(ethertype.to_be()),
        )
    };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: `fd` is a fresh descriptor that nothing else owns or closes.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    // SAFETY: sockaddr_ll is plain old data, for which all zeroes is a valid value.
    let mut address: libc::sockaddr_ll = unsafe { mem::zeroed() };
    address.sll_family = libc::AF_PACKET as u16;
    address.sll_protocol = ethertype.to_be();
    address.sll_ifindex = index;
    // SAFETY: `address` is live for the call and the length passed is its size.
    let rc = unsafe {
        libc::bind(
            fd.as_raw_fd(),
            (&raw const address).cast(),
            mem::size_of::<libc::sockaddr_ll>() as libc::socklen_t,
        )
    };
    if rc < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(PacketSocket(fd))
}

impl std::os::fd::AsRawFd for PacketSocket {
    fn as_raw_fd(&self) -> std::os::fd::RawFd {
        self.0.as_raw_fd()
    }
}

/// One frame into `buf`: its length, or None for a frame this host sent.
fn receive(socket: &PacketSocket, buf: &mut [u8]) -> io::Result<Option<usize>> {
    // SAFETY: sockaddr_ll is plain old data, for which all zeroes is a valid value.
    let mut from: libc::sockaddr_ll = unsafe { mem::zeroed() };
    let mut from_len = mem::size_of::<libc::sockaddr_ll>() as libc::socklen_t;
    // SAFETY: `buf`, `from` and `from_len` are live for the call and the lengths passed are
    // theirs; the kernel writes within them.
    let n = unsafe {
        libc::recvfrom(
            socket.0.as_raw_fd(),
            buf.as_mut_ptr().cast(),
            buf.len(),
            0,
            (&raw mut from).cast(),
            &raw mut from_len,
        )
    };
    let n = usize::try_from(n).map_err(|_| io::Error::last_os_error())?;
    Ok((from.sll_pkttype != PACKET_OUTGOING).then_some(n))
}

/// An ARP probe for `ip` from `mac` (RFC 5227 section 2.1.1): a broadcast request with
/// sender protocol address 0.0.0.0, so that no host's cache learns anything from it.
fn arp_probe(mac: [u8; 6], ip: Ipv4Addr) -> Vec<u8> {
    iface::arp_request(mac, Ipv4Addr::UNSPECIFIED, ip)
}

/// A DAD neighbour solicitation for `ip` (RFC 4862 section 5.4.2): from `::` to the
/// solicited-node group of `ip`, no source link-layer option, hop limit 255. Returns the
/// Ethernet destination and the frame.
fn dad_solicit(mac: [u8; 6], ip: Ipv6Addr) -> ([u8; 6], Vec<u8>) {
    let o = ip.octets();
    let group = Ipv6Addr::new(
        0xff02,
        0,
        0,
        0,
        0,
        1,
        0xff00 | u16::from(o[13]),
        u16::from_be_bytes([o[14], o[15]]),
    );
    let destination = [0x33, 0x33, 0xff, o[13], o[14], o[15]];
    let mut icmp = Vec::with_capacity(24);
    icmp.extend_from_slice(&[ND_NEIGHBOR_SOLICIT, 0, 0, 0, 0, 0, 0, 0]);
    icmp.extend_from_slice(&o);
    let checksum = iface::icmpv6_checksum(Ipv6Addr::UNSPECIFIED, group, &icmp);
    icmp[2..4].copy_from_slice(&checksum.to_be_bytes());
    let mut frame = Vec::with_capacity(14 + 40 + icmp.len());
    frame.extend_from_slice(&destination);
    frame.extend_from_slice(&mac);
    frame.extend_from_slice(&ETH_P_IPV6.to_be_bytes());
    frame.extend_from_slice(&[0x60, 0, 0, 0]);
    frame.extend_from_slice(&(icmp.len() as u16).to_be_bytes());
    frame.push(IPPROTO_ICMPV6);
    frame.push(255);
    frame.extend_from_slice(&Ipv6Addr::UNSPECIFIED.octets());
    frame.extend_from_slice(&group.octets());
    frame.extend_from_slice(&icmp);
    (destination, frame)
}

/// The MAC of another host that `frame` shows holding `ip`: an ARP packet (request or
/// reply) with sender protocol address `ip`, or a neighbour advertisement for target `ip`
/// (its target link-layer address option, else the frame's source). Frames from `own`
/// are ours.
fn answer(frame: &[u8], ip: IpAddr, own: [u8; 6]) -> Option<[u8; 6]> {
    let ethertype = u16::from_be_bytes(frame.get(12..14)?.try_into().ok()?);
    let source: [u8; 6] = frame.get(6..12)?.try_into().ok()?;
    let holder = match ip {
        IpAddr::V4(v4) => {
            if ethertype != ETH_P_ARP || frame.get(14..20)? != [0, 1, 8, 0, 6, 4] {
                return None;
            }
            let sender: [u8; 6] = frame.get(22..28)?.try_into().ok()?;
            (frame.get(28..32)? == v4.octets()).then_some(sender)?
        }
        IpAddr::V6(v6) => {
            let icmp = frame.get(54..)?;
            if ethertype != ETH_P_IPV6
                || *frame.get(20)? != IPPROTO_ICMPV6
                || *icmp.first()? != ND_NEIGHBOR_ADVERT
                || icmp.get(8..24)? != v6.octets()
            {
                return None;
            }
            let option = icmp.get(24..32);
            match option {
                Some([ND_OPT_TARGET_LINKADDR, 1, m @ ..]) => (*m).try_into().ok()?,
                _ => source,
            }
        }
    };
    (holder != own && source != own).then_some(holder)
}

#[cfg(test)]
mod tests {
    use super::*;

    const OWN: [u8; 6] = [0x02, 0, 0, 0, 0, 1];
    const OTHER: [u8; 6] = [0x02, 0, 0, 0, 0, 0x99];

    fn ip(s: &str) -> IpAddr {
        s.parse().expect("IP literal")
    }

    /// An ARP reply from `mac` saying `sender` is at `mac`, as Linux answers a probe.
    fn arp_reply(mac: [u8; 6], sender: Ipv4Addr) -> Vec<u8> {
        let mut f = Vec::new();
        f.extend_from_slice(&OWN);
        f.extend_from_slice(&mac);
        f.extend_from_slice(&ETH_P_ARP.to_be_bytes());
        f.extend_from_slice(&[0, 1, 8, 0, 6, 4, 0, 2]);
        f.extend_from_slice(&mac);
        f.extend_from_slice(&sender.octets());
        f.extend_from_slice(&OWN);
        f.extend_from_slice(&[0; 4]);
        f
    }

    /// A neighbour advertisement for `target` from `mac`, with or without its option.
    fn na(mac: [u8; 6], target: Ipv6Addr, option: Option<[u8; 6]>) -> Vec<u8> {
        let mut f = Vec::new();
        f.extend_from_slice(&[0x33, 0x33, 0, 0, 0, 1]);
        f.extend_from_slice(&mac);
        f.extend_from_slice(&ETH_P_IPV6.to_be_bytes());
        f.extend_from_slice(&[0x60, 0, 0, 0, 0, 32, IPPROTO_ICMPV6, 255]);
        f.extend_from_slice(&target.octets());
        f.extend_from_slice(&Ipv6Addr::new(0xff02, 0, 0, 0, 0, 0, 0, 1).octets());
        f.extend_from_slice(&[ND_NEIGHBOR_ADVERT, 0, 0, 0, 0x20, 0, 0, 0]);
        f.extend_from_slice(&target.octets());
        if let Some(m) = option {
            f.extend_from_slice(&[ND_OPT_TARGET_LINKADDR, 1]);
            f.extend_from_slice(&m);
        }
        f
    }

    #[test]
    fn an_arp_probe_claims_nothing_and_asks_for_the_address() {
        let f = arp_probe(OWN, Ipv4Addr::new(192, 168, 101, 50));
        assert_eq!(f.len(), 42);
        assert_eq!(&f[0..6], &BROADCAST_MAC);
        assert_eq!(&f[20..22], &[0, 1], "request");
        assert_eq!(&f[28..32], &[0, 0, 0, 0], "sender IP 0.0.0.0");
        assert_eq!(&f[38..42], &[192, 168, 101, 50], "target IP");
    }

    #[test]
    fn a_dad_solicitation_goes_from_unspecified_to_the_solicited_node_group() {
        let target: Ipv6Addr = "fd00:101::50".parse().expect("literal");
        let (dst, f) = dad_solicit(OWN, target);
        assert_eq!(dst, [0x33, 0x33, 0xff, 0, 0, 0x50]);
        assert_eq!(&f[22..38], &[0; 16], "source ::");
        let group: Ipv6Addr = "ff02::1:ff00:50".parse().expect("literal");
        assert_eq!(&f[38..54], &group.octets());
        assert_eq!(f[54], ND_NEIGHBOR_SOLICIT);
        assert_eq!(&f[62..78], &target.octets());
        assert_eq!(
            iface::icmpv6_checksum(Ipv6Addr::UNSPECIFIED, group, &f[54..]),
            0,
            "a valid checksum sums to zero"
        );
    }

    #[test]
    fn answers_name_the_holder_and_ignore_ours_and_other_addresses() {
        let v4 = Ipv4Addr::new(192, 168, 101, 50);
        assert_eq!(
            answer(&arp_reply(OTHER, v4), IpAddr::V4(v4), OWN),
            Some(OTHER)
        );
        let elsewhere = Ipv4Addr::new(192, 168, 101, 51);
        assert_eq!(
            answer(&arp_reply(OTHER, elsewhere), IpAddr::V4(v4), OWN),
            None
        );
        assert_eq!(
            answer(&arp_reply(OWN, v4), IpAddr::V4(v4), OWN),
            None,
            "ours"
        );
        assert_eq!(
            answer(&arp_probe(OTHER, v4), IpAddr::V4(v4), OWN),
            None,
            "a probe claims nothing"
        );

        let v6: Ipv6Addr = "fd00:101::50".parse().expect("literal");
        let with_option = na(OTHER, v6, Some([0x02, 0, 0, 0, 0, 0x77]));
        assert_eq!(
            answer(&with_option, ip("fd00:101::50"), OWN),
            Some([0x02, 0, 0, 0, 0, 0x77])
        );
        assert_eq!(
            answer(&na(OTHER, v6, None), IpAddr::V6(v6), OWN),
            Some(OTHER)
        );
        assert_eq!(answer(&na(OTHER, v6, None), ip("fd00:101::51"), OWN), None);
        assert_eq!(answer(&dad_solicit(OTHER, v6).1, IpAddr::V6(v6), OWN), None);
        assert_eq!(answer(&[0; 10], IpAddr::V6(v6), OWN), None, "short frames");
    }

    #[test]
    fn the_budget_is_the_probes_and_the_wait_after_the_last() {
        assert_eq!(BUDGET, INTERVAL * (PROBES - 1) + LISTEN_AFTER);
        assert_eq!(mac_string(OTHER), "02:00:00:00:00:99");
    }
}
