//! Tests of the interface layer. Each case runs on its own thread in a private, anonymous network namespace
//! (`unshare(CLONE_NEWNET)`), with a current-thread runtime on that thread: nothing
//! touches the host, and the namespace with everything in it vanishes with the thread.
//! They need root (CAP_SYS_ADMIN and CAP_NET_ADMIN).

use std::{future::Future, str::FromStr as _, time::Instant};

use rtnetlink::{LinkVeth, packet_route::route::RouteNextHop};

use super::*;

fn in_netns<F, Fut>(test: F)
where
    F: FnOnce() -> Fut + Send + 'static,
    Fut: Future<Output = ()>,
{
    let thread = std::thread::spawn(move || {
        // SAFETY: unshare(2) takes no pointers; CLONE_NEWNET moves only this thread.
        let rc = unsafe { libc::unshare(libc::CLONE_NEWNET) };
        assert_eq!(
            rc,
            0,
            "unshare(CLONE_NEWNET) failed (these tests need root): {}",
            io::Error::last_os_error()
        );
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("tokio runtime")
            .block_on(test());
    });
    if let Err(panic) = thread.join() {
        std::panic::resume_unwind(panic);
    }
}

fn ip(s: &str) -> IpAddr {
    IpAddr::from_str(s).expect("IP literal")
}

/// A veth pair with both ends up; returns their ifindexes.
async fn veth(nl: &Netlink, name: &str, peer: &str) -> (u32, u32) {
    nl.handle
        .link()
        .add(LinkVeth::new(name, peer).up().build())
        .execute()
        .await
        .expect("create veth pair");
    let a = nl
        .ifindex(name)
        .await
        .expect("lookup")
        .expect("veth exists");
    let b = nl
        .ifindex(peer)
        .await
        .expect("lookup")
        .expect("peer exists");
    nl.handle
        .link()
        .change(LinkUnspec::new_with_index(b).up().build())
        .execute()
        .await
        .expect("set peer up");
    // Frames sent before the kernel's link watcher has seen the carrier meet a device
    // without its queue yet (noop) and are dropped: wait for both ends to be up.
    for index in [a, b] {
        oper_up(nl, index).await;
    }
    (a, b)
}

/// Wait (at most 5 s) until link `index` reports the operational state `up`.
async fn oper_up(nl: &Netlink, index: u32) {
    let start = Instant::now();
    loop {
        let mut links = nl.handle.link().get().match_index(index).execute();
        let link = links
            .try_next()
            .await
            .expect("get link")
            .expect("link listed");
        let up = link
            .attributes
            .iter()
            .any(|a| matches!(a, LinkAttribute::OperState(State::Up)));
        if up {
            return;
        }
        assert!(
            start.elapsed() < Duration::from_secs(5),
            "link {index} not operationally up after 5 s: {:?}",
            link.attributes
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// Add a main-table route to `destination` (a prefix literal) out of `oif`, or a
/// blackhole route when `oif` is None.
async fn add_route(nl: &Netlink, destination: &str, oif: Option<u32>, metric: u32) {
    let mut message = match IpNet::from_str(destination).expect("prefix literal") {
        IpNet::V4(net) => RouteMessageBuilder::<Ipv4Addr>::new()
            .destination_prefix(net.addr(), net.prefix_len())
            .priority(metric)
            .build(),
        IpNet::V6(net) => RouteMessageBuilder::<Ipv6Addr>::new()
            .destination_prefix(net.addr(), net.prefix_len())
            .priority(metric)
            .build(),
    };
    match oif {
        Some(oif) => message.attributes.push(RouteAttribute::Oif(oif)),
        None => message.header.kind = RouteType::BlackHole,
    }
    nl.handle
        .route()
        .add(message)
        .execute()
        .await
        .unwrap_or_else(|e| panic!("add route {destination} dev {oif:?} metric {metric}: {e}"));
}

impl Interface {
    /// An up interface with MTU 1500, no MAC and `addresses` (literal, prefix length), for
    /// the tests elsewhere in the crate that take interfaces as a listing gave them.
    pub(crate) fn up_for_test(name: &str, ifindex: u32, addresses: &[(&str, u8)]) -> Self {
        Self {
            name: name.to_owned(),
            ifindex,
            up: true,
            mtu: 1500,
            mac: None,
            addresses: addresses.iter().map(|(a, len)| (ip(a), *len)).collect(),
            pod_like: false,
        }
    }
}

async fn interface(nl: &Netlink, ifindex: u32) -> Interface {
    nl.interfaces()
        .await
        .expect("list interfaces")
        .into_iter()
        .find(|i| i.ifindex == ifindex)
        .expect("interface listed")
}

#[test]
fn ensure_vxlan_creates_then_adopts() {
    in_netns(|| async {
        let nl = Netlink::new().expect("netlink");
        assert_eq!(nl.ifindex("egtun").await.expect("lookup"), None);

        let index = nl.ensure_vxlan("egtun", 4789, 1450).await.expect("create");
        assert_eq!(nl.ifindex("egtun").await.expect("lookup"), Some(index));
        let tun = interface(&nl, index).await;
        assert_eq!(tun.name, "egtun");
        assert_eq!(tun.mtu, 1450);
        assert!(tun.up, "{tun:?}");
        assert!(tun.mac.is_some(), "{tun:?}");

        // Adopting is idempotent and brings MTU and state back in line.
        nl.handle
            .link()
            .change(LinkUnspec::new_with_index(index).mtu(1400).down().build())
            .execute()
            .await
            .expect("disturb the device");
        assert_eq!(
            nl.ensure_vxlan("egtun", 4789, 1450).await.expect("adopt"),
            index
        );
        let tun = interface(&nl, index).await;
        assert_eq!((tun.mtu, tun.up), (1450, true), "{tun:?}");
    });
}

#[test]
fn ensure_vxlan_refuses_foreign_devices() {
    in_netns(|| async {
        let nl = Netlink::new().expect("netlink");

        // Another kind of device with that name: an error naming it, device untouched.
        let (veth_index, _) = veth(&nl, "egtun", "egtun-peer").await;
        let err = nl
            .ensure_vxlan("egtun", 4789, 1450)
            .await
            .expect_err("veth");
        assert!(matches!(err, Error::Conflict { .. }), "{err:?}");
        let message = err.to_string();
        assert!(
            message.starts_with("failed to adopt vxlan device egtun: a veth device"),
            "{message}"
        );
        assert_eq!(nl.ifindex("egtun").await.expect("lookup"), Some(veth_index));

        // A vxlan device on another port, or not in external mode.
        nl.ensure_vxlan("eg4790", 4790, 1450).await.expect("create");
        let err = nl
            .ensure_vxlan("eg4790", 4789, 1450)
            .await
            .expect_err("port");
        assert!(
            err.to_string().contains("uses UDP port 4790, not 4789"),
            "{err}"
        );
        nl.handle
            .link()
            .add(LinkVxlan::new("egvni", 42).port(4791).build())
            .execute()
            .await
            .expect("create a plain vxlan device");
        let err = nl
            .ensure_vxlan("egvni", 4791, 1450)
            .await
            .expect_err("not external");
        assert!(err.to_string().contains("not in external"), "{err}");

        // A second external device on a port that one already holds.
        let err = nl
            .ensure_vxlan("egother", 4790, 1450)
            .await
            .expect_err("port taken");
        assert!(err.to_string().contains("holds UDP port 4790"), "{err}");
        assert_eq!(nl.ifindex("egother").await.expect("lookup"), None);

        let err = nl
            .ensure_vxlan("a-name-far-too-long", 4789, 1450)
            .await
            .expect_err("name");
        assert!(matches!(err, Error::Invalid { .. }), "{err:?}");
    });
}

#[test]
fn addresses_are_idempotent_and_listed() {
    in_netns(|| async {
        let nl = Netlink::new().expect("netlink");
        let (index, _) = veth(&nl, "egsec", "egsec-peer").await;
        let v4 = (ip("192.0.2.10"), 24);
        let v6 = (ip("2001:db8::10"), 64);

        for (address, prefix_len) in [v4, v6] {
            for attempt in ["add", "add again"] {
                nl.add_address(index, address, prefix_len)
                    .await
                    .expect(attempt);
            }
        }
        let listed = interface(&nl, index).await.addresses;
        assert!(listed.contains(&v4) && listed.contains(&v6), "{listed:?}");

        // The same IPv6 address with another prefix length is a conflict, not a success.
        let err = nl
            .add_address(index, v6.0, 96)
            .await
            .expect_err("other prefix");
        assert!(
            err.to_string()
                .contains("already holds it as 2001:db8::10/64"),
            "{err}"
        );

        let err = nl.add_address(index, v4.0, 33).await.expect_err("prefix");
        assert!(matches!(err, Error::Invalid { .. }), "{err:?}");

        for (address, prefix_len) in [v4, v6] {
            for attempt in ["remove", "remove again"] {
                nl.del_address(index, address, prefix_len)
                    .await
                    .expect(attempt);
            }
        }
        let listed = interface(&nl, index).await.addresses;
        assert!(!listed.contains(&v4) && !listed.contains(&v6), "{listed:?}");

        let err = nl
            .add_address(9999, v4.0, 24)
            .await
            .expect_err("no such ifindex");
        assert_eq!(err.raw_os_error(), Some(libc::ENODEV), "{err:?}");
        assert!(
            err.to_string()
                .starts_with("failed to add address 192.0.2.10/24 to ifindex 9999: "),
            "{err}"
        );
    });
}

#[test]
fn route_oif_takes_longest_prefix_then_lowest_metric() {
    in_netns(|| async {
        let nl = Netlink::new().expect("netlink");
        let (r1, _) = veth(&nl, "r1", "r1-peer").await;
        let (r2, _) = veth(&nl, "r2", "r2-peer").await;
        let (r3, _) = veth(&nl, "r3", "r3-peer").await;

        assert_eq!(nl.route_oif(ip("10.1.2.3")).await.expect("lookup"), None);

        add_route(&nl, "10.0.0.0/8", Some(r1), 0).await;
        add_route(&nl, "10.1.0.0/16", Some(r2), 0).await;
        add_route(&nl, "10.2.0.0/16", Some(r1), 100).await;
        add_route(&nl, "10.2.0.0/16", Some(r3), 50).await;
        add_route(&nl, "10.4.0.0/16", None, 0).await;

        let cases = [
            ("10.1.2.3", Some(r2)), // /16 beats /8
            ("10.3.0.1", Some(r1)), // only the /8
            ("10.2.0.1", Some(r3)), // same /16: metric 50 beats 100
            ("10.4.0.1", None),     // the best match drops
            ("192.0.2.1", None),    // no default route
        ];
        for (destination, want) in cases {
            assert_eq!(
                nl.route_oif(ip(destination)).await.expect("lookup"),
                want,
                "{destination}"
            );
        }

        add_route(&nl, "0.0.0.0/0", Some(r3), 0).await;
        assert_eq!(
            nl.route_oif(ip("192.0.2.1")).await.expect("lookup"),
            Some(r3)
        );

        add_route(&nl, "2001:db8::/32", Some(r1), 0).await;
        add_route(&nl, "2001:db8:1::/48", Some(r2), 0).await;
        assert_eq!(
            nl.route_oif(ip("2001:db8:1::1")).await.expect("lookup"),
            Some(r2)
        );
        assert_eq!(
            nl.route_oif(ip("2001:db8:2::1")).await.expect("lookup"),
            Some(r1)
        );
        assert_eq!(nl.route_oif(ip("2001:db9::1")).await.expect("lookup"), None);
    });
}

/// One end of a veth pair, both up, with `addresses` (the kernel may lack the dummy
/// device module); returns its ifindex.
async fn addressed(nl: &Netlink, name: &str, addresses: &[(&str, u8)]) -> u32 {
    let (index, _) = veth(nl, name, &format!("{name}-peer")).await;
    for (address, prefix_len) in addresses {
        nl.add_address(index, ip(address), *prefix_len)
            .await
            .expect("add address");
    }
    index
}

/// Add the route `message`, named `what` in a failure.
async fn add(nl: &Netlink, what: &str, message: RouteMessage) {
    nl.handle
        .route()
        .add(message)
        .execute()
        .await
        .unwrap_or_else(|e| panic!("add route {what}: {e}"));
}

fn v4(s: &str) -> Ipv4Addr {
    Ipv4Addr::from_str(s).expect("IPv4 literal")
}

fn v6(s: &str) -> Ipv6Addr {
    Ipv6Addr::from_str(s).expect("IPv6 literal")
}

fn nets(list: &[&str]) -> BTreeSet<IpNet> {
    list.iter()
        .map(|n| IpNet::from_str(n).expect("prefix literal"))
        .collect()
}

#[test]
fn prefixes_by_oif_lists_the_unicast_routes_of_the_tables_asked_for() {
    in_netns(|| async {
        let nl = Netlink::new().expect("netlink");
        let d1 = addressed(
            &nl,
            "egd1",
            &[("192.168.104.1", 24), ("2001:db8:104::1", 64)],
        )
        .await;
        let d2 = addressed(&nl, "egd2", &[("192.168.105.1", 24)]).await;
        let via = |gateway: &str, oif: u32| {
            let mut hop = RouteNextHop::default();
            hop.interface_index = oif;
            hop.attributes = vec![RouteAttribute::Gateway(RouteAddress::Inet(v4(gateway)))];
            hop
        };

        let static_route = RouteMessageBuilder::<Ipv4Addr>::new()
            .destination_prefix(v4("10.20.0.0"), 16)
            .gateway(v4("192.168.104.254"))
            .output_interface(d1)
            .build();
        add(&nl, "10.20.0.0/16 via a gateway", static_route).await;
        let multipath = RouteMessageBuilder::<Ipv4Addr>::new()
            .destination_prefix(v4("10.30.0.0"), 16)
            .multipath(vec![via("192.168.104.254", d1), via("192.168.105.254", d2)])
            .build();
        add(&nl, "10.30.0.0/16 multipath", multipath).await;
        let default = RouteMessageBuilder::<Ipv4Addr>::new()
            .gateway(v4("192.168.104.254"))
            .output_interface(d1)
            .build();
        add(&nl, "default", default).await;
        let blackhole = RouteMessageBuilder::<Ipv4Addr>::new()
            .destination_prefix(v4("10.40.0.0"), 16)
            .kind(RouteType::BlackHole)
            .build();
        add(&nl, "blackhole 10.40.0.0/16", blackhole).await;
        let table_100 = RouteMessageBuilder::<Ipv4Addr>::new()
            .destination_prefix(v4("10.50.0.0"), 16)
            .gateway(v4("192.168.105.254"))
            .output_interface(d2)
            .table_id(100)
            .build();
        add(&nl, "10.50.0.0/16 in table 100", table_100).await;
        let tos = RouteMessageBuilder::<Ipv4Addr>::new()
            .destination_prefix(v4("10.60.0.0"), 16)
            .output_interface(d2)
            .tos(0x10)
            .build();
        add(&nl, "10.60.0.0/16 tos 0x10", tos).await;
        let v6_route = RouteMessageBuilder::<Ipv6Addr>::new()
            .destination_prefix(v6("2001:db8:200::"), 48)
            .output_interface(d1)
            .build();
        add(&nl, "2001:db8:200::/48", v6_route).await;
        let link_local = RouteMessageBuilder::<Ipv6Addr>::new()
            .destination_prefix(v6("fe80:0:0:1::"), 64)
            .output_interface(d2)
            .build();
        add(&nl, "fe80:0:0:1::/64", link_local).await;

        let main_only = nl.routes(&[]).await.expect("dump");
        let want_d1 = nets(&[
            "0.0.0.0/0",
            "10.20.0.0/16",
            "10.30.0.0/16",
            "192.168.104.0/24",
            "2001:db8:104::/64",
            "2001:db8:200::/48",
        ]);
        let listed = main_only.prefixes_by_oif();
        assert_eq!(listed.get(&d1), Some(&want_d1), "{listed:?}");
        assert_eq!(
            listed.get(&d2),
            Some(&nets(&["10.30.0.0/16", "192.168.105.0/24"])),
            "{listed:?}"
        );
        let all: Vec<&IpNet> = listed.values().flatten().collect();
        assert!(
            !all.iter()
                .any(|n| n.addr().is_ipv6() && n.addr().to_string().starts_with("fe80")),
            "link-local listed: {all:?}"
        );

        let with_100 = nl.routes(&[100]).await.expect("dump");
        let listed = with_100.prefixes_by_oif();
        assert_eq!(listed.get(&d1), Some(&want_d1), "{listed:?}");
        assert_eq!(
            listed.get(&d2),
            Some(&nets(&["10.30.0.0/16", "10.50.0.0/16", "192.168.105.0/24"])),
            "{listed:?}"
        );
        // Route lookups still read the main table only.
        assert_eq!(with_100.oif(ip("10.50.0.1")), Some(d1), "the default route");
        assert_eq!(with_100.oif(ip("10.40.0.1")), None, "the blackhole");
    });
}

#[test]
fn a_backup_route_of_a_higher_metric_is_not_listed_while_the_active_one_is_there() {
    in_netns(|| async {
        let nl = Netlink::new().expect("netlink");
        let primary = addressed(&nl, "egp", &[("192.168.106.1", 24)]).await;
        let backup = addressed(&nl, "egb", &[("192.168.107.1", 24)]).await;
        // The case: the active default route out of the primary network, a
        // backup one out of a secondary network; the same for a /16.
        add_route(&nl, "0.0.0.0/0", Some(primary), 0).await;
        add_route(&nl, "0.0.0.0/0", Some(backup), 100).await;
        add_route(&nl, "10.60.0.0/16", Some(primary), 10).await;
        add_route(&nl, "10.60.0.0/16", Some(backup), 20).await;
        add_route(&nl, "10.61.0.0/16", Some(backup), 20).await;
        let listed = nl.routes(&[]).await.expect("dump");
        let listed = listed.prefixes_by_oif();
        assert_eq!(
            listed.get(&backup),
            Some(&nets(&["10.61.0.0/16", "192.168.107.0/24"])),
            "{listed:?}"
        );
        assert_eq!(
            listed.get(&primary),
            Some(&nets(&["0.0.0.0/0", "10.60.0.0/16", "192.168.106.0/24"])),
            "{listed:?}"
        );
    });
}

#[test]
fn subscribe_changes_ticks_after_an_address_add() {
    in_netns(|| async {
        let nl = Netlink::new().expect("netlink");
        // The loopback device of a fresh namespace is down and quiet: no IPv6 link-local
        // DAD or carrier events that could tick in the address's place.
        let lo = nl.ifindex("lo").await.expect("lookup").expect("lo");
        let mut changes = Netlink::subscribe_changes().await.expect("subscribe");
        let quiet = tokio::time::timeout(Duration::from_millis(300), changes.recv()).await;
        assert!(quiet.is_err(), "ticked before any change: {quiet:?}");

        nl.add_address(lo, ip("198.51.100.1"), 32)
            .await
            .expect("add");
        let tick = tokio::time::timeout(Duration::from_secs(2), changes.recv()).await;
        assert_eq!(tick, Ok(Some(())));

        // Coalesced: a burst of changes leaves at most one tick pending.
        for last in 2..=5 {
            nl.add_address(lo, ip(&format!("198.51.100.{last}")), 32)
                .await
                .expect("add");
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
        assert_eq!(changes.try_recv(), Ok(()));
        assert!(changes.try_recv().is_err(), "more than one tick pending");
    });
}

/// A packet socket on `ifindex` that receives frames of `ethertype`, with a timeout.
struct Receiver(OwnedFd);

impl Receiver {
    fn open(ifindex: u32, ethertype: u16) -> Self {
        // SAFETY: socket(2) takes no pointers; the result is checked.
        let fd = unsafe {
            libc::socket(
                libc::AF_PACKET,
                libc::SOCK_RAW | libc::SOCK_CLOEXEC,
                i32::from(ethertype.to_be()),
            )
        };
        assert!(fd >= 0, "packet socket: {}", io::Error::last_os_error());
        // SAFETY: a fresh descriptor owned by nothing else.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        // SAFETY: all zeroes is a valid sockaddr_ll.
        let mut address: libc::sockaddr_ll = unsafe { mem::zeroed() };
        address.sll_family = libc::AF_PACKET as u16;
        address.sll_protocol = ethertype.to_be();
        address.sll_ifindex = i32::try_from(ifindex).expect("ifindex");
        // SAFETY: the address is live and its length is passed.
        let rc = unsafe {
            libc::bind(
                fd.as_raw_fd(),
                (&raw const address).cast(),
                mem::size_of::<libc::sockaddr_ll>() as libc::socklen_t,
            )
        };
        assert_eq!(rc, 0, "bind packet socket: {}", io::Error::last_os_error());
        let timeout = libc::timeval {
            tv_sec: 0,
            tv_usec: 200_000,
        };
        // SAFETY: the option value is live and its length is passed.
        let rc = unsafe {
            libc::setsockopt(
                fd.as_raw_fd(),
                libc::SOL_SOCKET,
                libc::SO_RCVTIMEO,
                (&raw const timeout).cast(),
                mem::size_of::<libc::timeval>() as libc::socklen_t,
            )
        };
        assert_eq!(rc, 0, "SO_RCVTIMEO: {}", io::Error::last_os_error());
        Self(fd)
    }

    /// The frames received within `within` that `keep` accepts.
    fn frames(&self, within: Duration, keep: impl Fn(&[u8]) -> bool) -> Vec<Vec<u8>> {
        let deadline = Instant::now() + within;
        let mut frames = Vec::new();
        while Instant::now() < deadline {
            let mut buffer = [0u8; 2048];
            // SAFETY: the buffer is live and its length is passed.
            let n = unsafe {
                libc::recv(
                    self.0.as_raw_fd(),
                    buffer.as_mut_ptr().cast(),
                    buffer.len(),
                    0,
                )
            };
            if let Ok(n) = usize::try_from(n)
                && keep(&buffer[..n])
            {
                frames.push(buffer[..n].to_vec());
            }
        }
        frames
    }
}

#[test]
fn announce_sends_gratuitous_arp() {
    in_netns(|| async {
        let nl = Netlink::new().expect("netlink");
        let (index, peer) = veth(&nl, "egann", "egann-peer").await;
        let mac = interface(&nl, index).await.mac.expect("veth has a MAC");
        let receiver = Receiver::open(peer, ETH_P_ARP);

        let held = Ipv4Addr::new(192, 0, 2, 77);
        announce(
            index,
            mac,
            IpAddr::V4(held),
            &[
                Duration::ZERO,
                Duration::from_millis(20),
                Duration::from_millis(40),
            ],
        )
        .await
        .expect("announce");

        let frames = receiver.frames(Duration::from_millis(600), |_| true);
        assert_eq!(frames.len(), 3, "{frames:02x?}");
        for frame in frames {
            assert!(frame.len() >= 42, "{frame:02x?}");
            assert_eq!(frame[0..6], BROADCAST_MAC, "destination");
            assert_eq!(frame[6..12], mac, "source");
            assert_eq!(frame[12..14], [0x08, 0x06], "ethertype");
            assert_eq!(
                frame[14..22],
                [0, 1, 0x08, 0x00, 6, 4, 0, 1],
                "Ethernet/IPv4 request"
            );
            assert_eq!(frame[22..28], mac, "sender MAC");
            assert_eq!(frame[28..32], held.octets(), "sender IP");
            assert_eq!(frame[38..42], held.octets(), "target IP");
        }
    });
}

#[test]
fn announce_sends_unsolicited_neighbour_advertisement() {
    in_netns(|| async {
        let nl = Netlink::new().expect("netlink");
        let (index, peer) = veth(&nl, "egna", "egna-peer").await;
        let mac = interface(&nl, index).await.mac.expect("veth has a MAC");
        let receiver = Receiver::open(peer, ETH_P_IPV6);

        let held = Ipv6Addr::from_str("2001:db8::77").expect("literal");
        announce(
            index,
            mac,
            IpAddr::V6(held),
            &[Duration::ZERO, Duration::from_millis(20)],
        )
        .await
        .expect("announce");

        // The veth ends send their own router solicitations and DAD probes: keep NAs.
        let frames = receiver.frames(Duration::from_millis(600), |f| {
            f.len() > 54 && f[20] == IPPROTO_ICMPV6 && f[54] == ND_NEIGHBOR_ADVERT
        });
        assert_eq!(frames.len(), 2, "{frames:02x?}");
        for frame in frames {
            assert_eq!(frame.len(), 14 + 40 + 32, "{frame:02x?}");
            assert_eq!(frame[0..6], ALL_NODES_MAC, "destination MAC");
            assert_eq!(frame[6..12], mac, "source MAC");
            assert_eq!(frame[12..14], [0x86, 0xdd], "ethertype");
            assert_eq!(frame[14] >> 4, 6, "IP version");
            assert_eq!(frame[18..20], [0, 32], "payload length");
            assert_eq!(frame[21], 255, "hop limit");
            assert_eq!(frame[22..38], held.octets(), "source IP");
            assert_eq!(frame[38..54], ALL_NODES.octets(), "destination IP");
            let icmp = &frame[54..];
            assert_eq!(icmp[1], 0, "code");
            assert_eq!(icmp[4], 0x20, "override set, router and solicited clear");
            assert_eq!(icmp[8..24], held.octets(), "target");
            assert_eq!(icmp[24..26], [2, 1], "target link-layer address option");
            assert_eq!(icmp[26..32], mac, "target link-layer address");
            // A correct checksum makes the sum over pseudo-header and message all ones.
            let mut pseudo = Vec::new();
            pseudo.extend_from_slice(&frame[22..54]);
            pseudo.extend_from_slice(&32u32.to_be_bytes());
            pseudo.extend_from_slice(&[0, 0, 0, 58]);
            pseudo.extend_from_slice(icmp);
            let mut sum: u32 = pseudo
                .chunks(2)
                .map(|w| u32::from(u16::from_be_bytes([w[0], w[1]])))
                .sum();
            while sum > 0xffff {
                sum = (sum & 0xffff) + (sum >> 16);
            }
            assert_eq!(sum, 0xffff, "checksum");
        }
    });
}

#[test]
fn sysctl_writes_in_the_callers_namespace() {
    in_netns(|| async {
        let path = "net/ipv4/conf/all/forwarding";
        sysctl(path, "1").expect("write");
        let read = std::fs::read_to_string(Path::new("/proc/sys").join(path)).expect("read");
        assert_eq!(read.trim(), "1");
        sysctl(path, "0").expect("write");

        for bad in [
            "",
            "/net/ipv4/ip_forward",
            "net/../../etc/passwd",
            "net//ipv4",
        ] {
            let err = sysctl(bad, "1").expect_err(bad);
            assert!(matches!(err, Error::Invalid { .. }), "{bad}: {err:?}");
        }
        let err = sysctl("net/ipv4/no_such_sysctl", "1").expect_err("missing");
        assert_eq!(
            err.to_string(),
            "failed to write sysctl net/ipv4/no_such_sysctl = 1: No such file or directory (os error 2)"
        );
    });
}
