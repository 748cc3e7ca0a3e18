//! What the host offers the agent: bpffs at the pin directory, capabilities, the tunnel
//! port, rp_filter on the secondary interfaces, MTU headroom. Each verdict is a pure
//! function of what was read, unit-tested; the readers around them are thin.

use std::{
    io,
    net::{Ipv4Addr, Ipv6Addr, SocketAddr, UdpSocket},
    path::Path,
};

use super::{Check, fail, ok, warn};
use crate::iface::{VXLAN_OVERHEAD, VXLAN_OVERHEAD_V6};

/// `BPF_FS_MAGIC` of statfs(2).
const BPF_FS_MAGIC: i64 = 0xcafe_4a11;

/// Is the pin directory (or, before the first start, its nearest existing parent) on bpffs?
pub fn bpffs(dir: &Path) -> Check {
    let mut at = dir;
    let magic = loop {
        match statfs_magic(at) {
            Ok(m) => break Ok(m),
            Err(e) if e.kind() == io::ErrorKind::NotFound => match at.parent() {
                Some(p) => at = p,
                None => break Err(e),
            },
            Err(e) => break Err(e),
        }
    };
    let shown = dir.display();
    match magic {
        Ok(BPF_FS_MAGIC) => ok("bpffs", format!("{shown} is on bpffs ({})", at.display())),
        Ok(m) => fail(
            "bpffs",
            format!(
                "{shown} is not on bpffs ({} has filesystem magic {m:#x}): the agent cannot \
                 pin its maps and links there; mount it (mount -t bpf bpf /sys/fs/bpf; in a pod, mount the host's \
                 /sys/fs/bpf) or pass --bpffs-dir under a bpffs mount",
                at.display()
            ),
        ),
        Err(e) => fail("bpffs", format!("failed to statfs {shown}: {e}")),
    }
}

fn statfs_magic(path: &Path) -> io::Result<i64> {
    use std::os::unix::ffi::OsStrExt as _;
    let c = std::ffi::CString::new(path.as_os_str().as_bytes())
        .map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))?;
    // SAFETY: statfs is plain old data, for which all zeroes is a valid value.
    let mut st: libc::statfs = unsafe { std::mem::zeroed() };
    // SAFETY: `c` is a NUL-terminated path and `st` a live statfs, both for the call.
    if unsafe { libc::statfs(c.as_ptr(), &raw mut st) } < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(st.f_type)
}

/// The capabilities the agent uses, by bit number, and what for.
pub const CAPABILITIES: [(u32, &str, &str); 4] = [
    (39, "CAP_BPF", "load programs, create and pin maps"),
    (38, "CAP_PERFMON", "programs that read packet memory"),
    (
        12,
        "CAP_NET_ADMIN",
        "TC links, addresses, the tunnel device",
    ),
    (
        13,
        "CAP_NET_RAW",
        "ARP/NA announcements and duplicate address detection",
    ),
];
const CAP_SYS_ADMIN: u32 = 21;

/// `CapEff` of a /proc/<pid>/status text.
pub fn cap_eff(status: &str) -> Option<u64> {
    let hex = status.lines().find_map(|l| l.strip_prefix("CapEff:"))?;
    u64::from_str_radix(hex.trim(), 16).ok()
}

/// The capabilities of [`CAPABILITIES`] missing from `eff` (CAP_SYS_ADMIN stands in for
/// CAP_BPF and CAP_PERFMON, as on kernels before 5.8).
pub fn missing_capabilities(eff: u64) -> Vec<(&'static str, &'static str)> {
    let has = |bit: u32| eff & (1 << bit) != 0;
    CAPABILITIES
        .iter()
        .filter(|(bit, name, _)| {
            let covered = has(CAP_SYS_ADMIN) && matches!(*name, "CAP_BPF" | "CAP_PERFMON");
            !has(*bit) && !covered
        })
        .map(|(_, name, what)| (*name, *what))
        .collect()
}

pub fn capabilities(status: &str) -> Check {
    let Some(eff) = cap_eff(status) else {
        return warn(
            "capabilities",
            "failed to read CapEff from /proc/self/status".to_owned(),
        );
    };
    let missing = missing_capabilities(eff);
    if missing.is_empty() {
        let names: Vec<&str> = CAPABILITIES.iter().map(|(_, n, _)| *n).collect();
        return ok(
            "capabilities",
            format!("holds {} (CapEff {eff:#x})", names.join(", ")),
        );
    }
    let list: Vec<String> = missing.iter().map(|(n, w)| format!("{n} ({w})")).collect();
    fail(
        "capabilities",
        format!(
            "lacks {}: add them to the container's securityContext.capabilities.add (see \
             deploy/base/daemonset.yaml), or run as root",
            list.join(", ")
        ),
    )
}

/// UDP ports of overlay networks that CNIs use: the tunnel must not share one.
pub const CNI_PORTS: [(u16, &str); 3] = [
    (
        4789,
        "the IANA VXLAN port (Calico, Cilium, Antrea, OVN-Kubernetes in VXLAN mode)",
    ),
    (8472, "Flannel's VXLAN port (and Cilium's default)"),
    (
        6081,
        "the Geneve port (OVN-Kubernetes, Antrea, Cilium in Geneve mode)",
    ),
];

/// What binding the tunnel port found.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum PortState {
    Free,
    /// Taken; by a vxlan device (its name) or a socket of a process (pid and command),
    /// when known.
    Taken {
        device: Option<String>,
        process: Option<String>,
    },
    /// Binding failed for another reason.
    Unknown(String),
}

/// The verdict on the tunnel port: free, or held by our own tunnel device, and none of
/// [`CNI_PORTS`].
pub fn tunnel_port_verdict(port: u16, our_device: &str, state: &PortState) -> Check {
    let check = "tunnel-port";
    let cni = CNI_PORTS.iter().find(|(p, _)| *p == port);
    let found = match state {
        PortState::Free => format!("UDP {port} is free"),
        PortState::Taken {
            device: Some(d), ..
        } if d == our_device => format!("UDP {port} is held by our tunnel device {d}"),
        PortState::Taken { device, process } => {
            let by = match (device, process) {
                (Some(d), _) => format!("vxlan device {d}"),
                (None, Some(p)) => p.clone(),
                (None, None) => format!("a socket (ss -ulpn 'sport = :{port}' names it)"),
            };
            return fail(
                check,
                format!(
                    "UDP {port} is taken by {by}: the tunnel device cannot open it; free it, \
                     or pass another --tunnel-port to every agent (they must agree; the \
                     probe port follows at tunnel port + 1)"
                ),
            );
        }
        PortState::Unknown(e) => {
            return warn(check, format!("failed to test UDP {port}: {e}"));
        }
    };
    match cni {
        Some((_, what)) => warn(
            check,
            format!(
                "{found}, but {port} is {what}: a CNI on this node would collide with the \
                 tunnel; pass another --tunnel-port (the default is 4797)"
            ),
        ),
        None => ok(check, found),
    }
}

/// Try the port: bind it on IPv4 (and IPv6, where the host has it).
pub fn bind_test(port: u16) -> Result<(), io::Error> {
    UdpSocket::bind(SocketAddr::from((Ipv4Addr::UNSPECIFIED, port)))?;
    match UdpSocket::bind(SocketAddr::from((Ipv6Addr::UNSPECIFIED, port))) {
        Ok(_) => Ok(()),
        Err(e) if e.raw_os_error() == Some(libc::EADDRINUSE) => Err(e),
        // No IPv6 on this host.
        Err(_) => Ok(()),
    }
}

/// The process whose socket is bound to local UDP `port`, from /proc/net/udp{,6} (this
/// network namespace) and the processes' open files: `pid 42 (name)`.
pub fn udp_port_owner(port: u16) -> Option<String> {
    let inodes: Vec<String> = ["/proc/net/udp", "/proc/net/udp6"]
        .iter()
        .filter_map(|p| std::fs::read_to_string(p).ok())
        .flat_map(|text| udp_inodes(&text, port))
        .collect();
    let wanted: Vec<String> = inodes.iter().map(|i| format!("socket:[{i}]")).collect();
    for entry in std::fs::read_dir("/proc").ok()?.flatten() {
        let pid = entry.file_name().to_string_lossy().into_owned();
        if !pid.bytes().all(|b| b.is_ascii_digit()) {
            continue;
        }
        let Ok(fds) = std::fs::read_dir(entry.path().join("fd")) else {
            continue;
        };
        for fd in fds.flatten() {
            let link = std::fs::read_link(fd.path()).unwrap_or_default();
            if wanted.iter().any(|w| link.as_os_str() == w.as_str()) {
                let comm = std::fs::read_to_string(entry.path().join("comm")).unwrap_or_default();
                return Some(format!("pid {pid} ({})", comm.trim()));
            }
        }
    }
    None
}

/// The socket inodes (not 0: the kernel's own) bound to local `port` in a /proc/net/udp
/// table.
fn udp_inodes(table: &str, port: u16) -> Vec<String> {
    table
        .lines()
        .skip(1)
        .filter_map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            let local_port = f.get(1)?.rsplit(':').next()?;
            let inode = *f.get(9)?;
            (u16::from_str_radix(local_port, 16).ok()? == port && inode != "0")
                .then(|| inode.to_owned())
        })
        .collect()
}

/// The rp_filter verdict for interface `name`: the kernel applies the larger of
/// `conf.all` and `conf.<name>`. Strict (1) drops replies to an egress IP on an egress
/// interface whenever the route back to their source leaves by another interface.
pub fn rp_filter_verdict(name: &str, all: u8, dev: u8, egress: bool) -> Check {
    let check = format!("rp-filter {name}");
    let effective = all.max(dev);
    let source = if all > dev {
        "net.ipv4.conf.all.rp_filter"
    } else {
        "its own"
    };
    match (effective, egress) {
        (1, true) => fail(
            &check,
            format!(
                "rp_filter is 1 (strict, {source}) on egress interface {name}: the kernel drops \
                 packets arriving there whose source it would route out of another interface, \
                 such as replies to an egress IP from destinations routed elsewhere; set it to \
                 2 (loose) or 0: sysctl -w net.ipv4.conf.{name}.rp_filter=2 (and \
                 net.ipv4.conf.all.rp_filter must not be 1: the kernel uses the larger)"
            ),
        ),
        (1, false) => ok(
            &check,
            format!("rp_filter is 1 (strict, {source}); {name} carries no egress IP"),
        ),
        (2, _) => ok(&check, "rp_filter is 2 (loose)".to_owned()),
        (0, _) => ok(&check, "rp_filter is 0 (off)".to_owned()),
        (v, _) => warn(&check, format!("rp_filter is {v}, not 0, 1 or 2")),
    }
}

/// The forwarding verdict for interface `name`, the datapath's `role` on it ("tunnel
/// device", "underlay", "egress interface"), `forwarding` its
/// `net.ipv4.conf.<name>.forwarding` (None: unreadable). bpf_fib_lookup answers
/// BPF_FIB_LKUP_RET_FWD_DISABLED when the device it looks up from does not forward
/// (net/core/filter.c), and the datapath looks up from these devices: forwarding is needed
/// on them, and only on them (`all` need not be on).
pub fn forwarding_verdict(name: &str, role: &str, forwarding: Option<u8>) -> Check {
    let check = format!("forwarding {name}");
    match forwarding {
        Some(0) => fail(
            &check,
            format!(
                "net.ipv4.conf.{name}.forwarding is 0 on {name} ({role}): the datapath's route \
                 lookups from it fail (BPF_FIB_LKUP_RET_FWD_DISABLED); turn it on for this \
                 interface on the node (the agent's /proc/sys is read-only in its container): \
                 sysctl -w net.ipv4.conf.{name}.forwarding=1"
            ),
        ),
        Some(_) => ok(
            &check,
            format!("net.ipv4.conf.{name}.forwarding is on ({role})"),
        ),
        None => warn(
            &check,
            format!("failed to read net.ipv4.conf.{name}.forwarding ({role})"),
        ),
    }
}

/// Read `net.ipv4.conf.<name>.forwarding`.
pub fn read_forwarding(name: &str) -> Option<u8> {
    std::fs::read_to_string(format!("/proc/sys/net/ipv4/conf/{name}/forwarding"))
        .ok()?
        .trim()
        .parse()
        .ok()
}

/// Read `net.ipv4.conf.<name>.rp_filter`.
pub fn read_rp_filter(name: &str) -> Option<u8> {
    std::fs::read_to_string(format!("/proc/sys/net/ipv4/conf/{name}/rp_filter"))
        .ok()?
        .trim()
        .parse()
        .ok()
}

/// What the MTU check read.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Mtus {
    /// The underlay interface and its MTU.
    pub underlay: (String, u32),
    pub underlay_v6: bool,
    /// The tunnel's MTU as the agent sets it (`--tunnel-mtu`, else the largest up MTU
    /// minus the overhead).
    pub tunnel: u32,
    /// The largest MTU of this node's pods' devices, and one of them.
    pub pods: Option<(String, u32)>,
}

pub fn mtu_verdict(m: &Mtus) -> Check {
    let (ul_name, ul_mtu) = &m.underlay;
    let overhead = if m.underlay_v6 {
        VXLAN_OVERHEAD_V6
    } else {
        VXLAN_OVERHEAD
    };
    let family = if m.underlay_v6 { "IPv6" } else { "IPv4" };
    let room = ul_mtu.saturating_sub(overhead);
    let found = format!(
        "underlay {ul_name} MTU {ul_mtu} ({family}, {overhead} bytes of VXLAN): tunnel MTU {}",
        m.tunnel
    );
    if m.tunnel > room {
        return fail(
            "mtu",
            format!(
                "{found} exceeds the {room} bytes the underlay carries: tunnelled packets \
                 that large are dropped; pass --tunnel-mtu {room} or less"
            ),
        );
    }
    match &m.pods {
        Some((dev, pod)) if *pod > m.tunnel => warn(
            "mtu",
            format!(
                "{found}, pods' MTU {pod} ({dev}): TCP through the tunnel is clamped to \
                 it, but larger non-TCP packets of pods on other nodes are fragmented or \
                 dropped on the way to a gateway; set the CNI's MTU to {} or less, or raise \
                 the underlay MTU to {} or more",
                m.tunnel,
                pod + overhead
            ),
        ),
        Some((_, pod)) => ok("mtu", format!("{found}, pods' MTU {pod}: fits")),
        None => ok(
            "mtu",
            format!(
                "{found}; pods' MTU unknown (no pod of this node in the state): keep the \
                 CNI's MTU at {} or less",
                m.tunnel
            ),
        ),
    }
}

/// Most nodes named in the underlay routes verdict; the rest are counted.
const MAX_ASTRAY_NAMED: usize = 3;

/// The peers' underlay addresses that this node routes out of an interface other than
/// its underlay interface (`underlay`), as messages: `peers` are (node, address), and
/// `oif` gives the interface name a route sends an address out of (`None`: no route).
/// Such a route (a `172.31.7.0/25 via R dev sec-b` that covers part of the underlay)
/// sends this node's hellos and tunneled packets the wrong way while the peers' still
/// arrive.
pub fn underlay_astray(
    underlay: &str,
    peers: &[(String, std::net::IpAddr)],
    oif: impl Fn(std::net::IpAddr) -> Option<String>,
) -> Vec<String> {
    peers
        .iter()
        .filter_map(|(name, ip)| {
            let out = oif(*ip);
            (out.as_deref() != Some(underlay)).then(|| match out {
                Some(other) => format!(
                    "underlay: node {name}'s address {ip} is routed out of {other}, not the \
                     underlay interface {underlay}: hellos and tunneled packets to it go \
                     astray; remove or narrow the route that covers it"
                ),
                None => format!(
                    "underlay: node {name}'s address {ip} has no route out of {underlay}: \
                     hellos and tunneled packets to it are dropped"
                ),
            })
        })
        .collect()
}

/// `doctor`'s `underlay-routes` check from [`underlay_astray`]'s messages over `total`
/// peers.
pub fn underlay_routes_verdict(underlay: &str, total: usize, astray: &[String]) -> Check {
    if astray.is_empty() {
        return ok(
            "underlay-routes",
            format!("every peer's address ({total}) is routed out of {underlay}"),
        );
    }
    let mut text = astray
        .iter()
        .take(MAX_ASTRAY_NAMED)
        .cloned()
        .collect::<Vec<_>>()
        .join("; ");
    if astray.len() > MAX_ASTRAY_NAMED {
        text.push_str(&format!(" (and {} more)", astray.len() - MAX_ASTRAY_NAMED));
    }
    fail("underlay-routes", text)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::api::PreflightResult::{Fail, Ok as Good, Warn};

    #[test]
    fn cap_eff_is_read_and_each_missing_capability_named() {
        let status = "Name:\tegress-agent\nCapInh:\t0000000000000000\nCapPrm:\t000001fffeffffff\n\
                      CapEff:\t000001fffeffffff\nCapBnd:\t000001fffeffffff\n";
        assert_eq!(cap_eff(status), Some(0x1ff_feff_ffff));
        assert!(missing_capabilities(0x1ff_feff_ffff).is_empty());
        // The DaemonSet's set: BPF, PERFMON, NET_ADMIN, NET_RAW.
        let daemonset = (1 << 39) | (1 << 38) | (1 << 12) | (1 << 13);
        assert!(missing_capabilities(daemonset).is_empty());
        let names = |eff| -> Vec<&str> {
            missing_capabilities(eff)
                .into_iter()
                .map(|(n, _)| n)
                .collect()
        };
        assert_eq!(names(daemonset & !(1 << 13)), ["CAP_NET_RAW"]);
        assert_eq!(
            names(0),
            ["CAP_BPF", "CAP_PERFMON", "CAP_NET_ADMIN", "CAP_NET_RAW"]
        );
        // CAP_SYS_ADMIN covers BPF and PERFMON (kernels before 5.8 have neither).
        assert_eq!(names((1 << 21) | (1 << 12) | (1 << 13)), Vec::<&str>::new());
        assert_eq!(cap_eff("Name: x\n"), None);
        let c = capabilities("CapEff:\t0000000000003000\n");
        assert_eq!(c.result, Fail);
        assert!(
            c.message.contains("CAP_BPF") && c.message.contains("securityContext"),
            "{}",
            c.message
        );
    }

    #[test]
    fn forwarding_off_on_a_device_the_datapath_looks_up_from_fails_naming_the_setting() {
        let off = forwarding_verdict("ens224", "egress interface", Some(0));
        assert_eq!(off.result, Fail, "{off:?}");
        assert!(
            off.message
                .contains("sysctl -w net.ipv4.conf.ens224.forwarding=1"),
            "{off:?}"
        );
        let on = forwarding_verdict("egress0", "tunnel device", Some(1));
        assert_eq!(on.result, Good, "{on:?}");
        let unread = forwarding_verdict("eth0", "underlay", None);
        assert_eq!(unread.result, Warn, "{unread:?}");
    }

    #[test]
    fn rp_filter_strict_fails_on_egress_interfaces_only_and_all_counts() {
        let v = |all, dev, egress| rp_filter_verdict("sec-a", all, dev, egress);
        assert_eq!(v(0, 1, true).result, Fail);
        assert!(
            v(0, 1, true)
                .message
                .contains("net.ipv4.conf.sec-a.rp_filter=2")
        );
        assert_eq!(v(1, 0, true).result, Fail, "conf.all wins when larger");
        assert!(
            v(1, 0, true)
                .message
                .contains("net.ipv4.conf.all.rp_filter")
        );
        assert_eq!(v(1, 2, true).result, Good, "loose wins over strict");
        assert_eq!(v(0, 0, true).result, Good);
        assert_eq!(v(0, 1, false).result, Good, "no egress IP there");
        assert_eq!(v(0, 7, true).result, Warn);
    }

    #[test]
    fn the_tunnel_port_is_ok_free_or_ours_and_cni_ports_warn() {
        let taken = |device: Option<&str>, process: Option<&str>| PortState::Taken {
            device: device.map(str::to_owned),
            process: process.map(str::to_owned),
        };
        assert_eq!(
            tunnel_port_verdict(4797, "egress0", &PortState::Free).result,
            Good
        );
        let ours = tunnel_port_verdict(4797, "egress0", &taken(Some("egress0"), None));
        assert_eq!(ours.result, Good);
        assert!(ours.message.contains("our tunnel device egress0"));
        let flannel = tunnel_port_verdict(8472, "egress0", &taken(Some("flannel.1"), None));
        assert_eq!(flannel.result, Fail);
        assert!(flannel.message.contains("vxlan device flannel.1"));
        let socket = tunnel_port_verdict(4797, "egress0", &taken(None, Some("pid 7 (nc)")));
        assert_eq!(socket.result, Fail);
        assert!(socket.message.contains("pid 7 (nc)") && socket.message.contains("--tunnel-port"));
        for port in [4789, 8472, 6081] {
            let v = tunnel_port_verdict(port, "egress0", &PortState::Free);
            assert_eq!(v.result, Warn, "{port}");
        }
    }

    #[test]
    fn udp_inodes_match_the_port_and_skip_kernel_sockets() {
        let table = "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode ref pointer drops\n\
            1: 00000000:12BD 00000000:0000 07 00000000:00000000 00:00000000 00000000     0        0 4242 2 0 0\n\
            2: 00000000:12B5 00000000:0000 07 00000000:00000000 00:00000000 00000000     0        0 0 2 0 0\n\
            3: 0100007F:1E61 00000000:0000 07 00000000:00000000 00:00000000 00000000     0        0 77 2 0 0\n";
        assert_eq!(udp_inodes(table, 4797), ["4242"]);
        assert!(
            udp_inodes(table, 4789).is_empty(),
            "inode 0: the kernel's (a vxlan device)"
        );
        assert_eq!(udp_inodes(table, 7777), ["77"]);
    }

    #[test]
    fn mtu_headroom_is_underlay_minus_vxlan_and_warns_for_larger_pods() {
        let m = |ul, v6, tunnel, pods: Option<u32>| Mtus {
            underlay: ("eth0".into(), ul),
            underlay_v6: v6,
            tunnel,
            pods: pods.map(|p| ("cali1".to_owned(), p)),
        };
        assert_eq!(mtu_verdict(&m(1500, false, 1450, Some(1450))).result, Good);
        let w = mtu_verdict(&m(1500, false, 1450, Some(1500)));
        assert_eq!(w.result, Warn);
        assert!(
            w.message.contains("1450 or less") && w.message.contains("1550"),
            "{}",
            w.message
        );
        assert_eq!(
            mtu_verdict(&m(1500, true, 1450, None)).result,
            Fail,
            "IPv6: 1430 room"
        );
        assert_eq!(mtu_verdict(&m(1500, true, 1430, None)).result, Good);
        assert_eq!(mtu_verdict(&m(9000, false, 8950, Some(1500))).result, Good);
    }

    #[test]
    fn a_peer_routed_off_the_underlay_is_named_with_its_interface() {
        let peers = vec![
            ("w1".to_owned(), "172.31.7.10".parse().expect("ip")),
            ("gw2".to_owned(), "172.31.7.200".parse().expect("ip")),
            ("w2".to_owned(), "172.31.7.11".parse().expect("ip")),
        ];
        // 172.31.7.0/25 via a router on sec-b; nothing routes 172.31.7.11's /32 at all.
        let oif = |ip: std::net::IpAddr| match ip.to_string().as_str() {
            "172.31.7.10" => Some("sec-b".to_owned()),
            "172.31.7.200" => Some("eth0".to_owned()),
            _ => None,
        };
        let astray = underlay_astray("eth0", &peers, oif);
        assert_eq!(astray.len(), 2, "{astray:?}");
        assert!(astray[0].contains("node w1's address 172.31.7.10 is routed out of sec-b"));
        assert!(astray[1].contains("node w2's address 172.31.7.11 has no route"));
        let c = underlay_routes_verdict("eth0", 3, &astray);
        assert_eq!((c.check.as_str(), c.result), ("underlay-routes", Fail));
        let c = underlay_routes_verdict("eth0", 3, &[]);
        assert_eq!(c.result, Good);
        assert!(c.message.contains("(3) is routed out of eth0"), "{c:?}");
    }
}
