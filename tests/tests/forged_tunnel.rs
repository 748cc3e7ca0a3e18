//! End to end: tunnel packets forged on the underlay (issue 12). The tunnel is not
//! authenticated, so the gateway holding egress IP A checks every VXLAN packet it gets:
//! the outer source must be a node, the inner source a pod of that node, the VNI a rule
//! it serves, and the (pod, rule) pair one the policies admit. Each forged packet below
//! fails exactly one check; host-a (behind egress IP A) must receive none of them, and
//! the gateway must count each under its reason. A well-formed packet sent the same way
//! does arrive, translated: the forgeries would get through if a check were missing.
//! On the return path, a reply goes into its pod around the CNI only from the pod's
//! gateway ([`returned_into_the_pod`]).

use std::{
    net::{Ipv4Addr, SocketAddr, UdpSocket},
    time::Duration,
};

use anyhow::{Context as _, Result, ensure};
use egress_common::{
    config::DEFAULT_TUNNEL_PORT,
    counters::reason::{
        DROP_NOT_ADMITTED, DROP_SPOOFED_SOURCE, DROP_UNKNOWN_RULE, DROP_UNKNOWN_SENDER,
        TO_POD_DEVICE,
    },
    maps,
    policy::RETURN_VNI,
};
use egress_tests::{
    cluster::{self, counted, default_spec, holder, up_with_agents},
    lab::{Lab, addr},
    packet::{Ipv4Packet, L4},
};

/// Forged packets per case.
const COUNT: usize = 20;

/// One case: a tunnel packet named by `marker` (its payload), sent from `member`'s
/// namespace with outer source `from`, VNI `vni` and inner source `inner`; `reason`: the
/// counter that must count it (`None`: a well-formed control that must arrive).
struct Forged {
    marker: &'static str,
    member: &'static str,
    from: Ipv4Addr,
    vni: u32,
    inner: Ipv4Addr,
    reason: Option<u32>,
}

impl Forged {
    fn new(
        marker: &'static str,
        member: &'static str,
        from: Ipv4Addr,
        vni: u32,
        inner: Ipv4Addr,
    ) -> Self {
        Self {
            marker,
            member,
            from,
            vni,
            inner,
            reason: None,
        }
    }

    fn counted(self, reason: u32) -> Self {
        Self {
            reason: Some(reason),
            ..self
        }
    }
}

/// The id of the rule whose egress IP is `egress` in `gw`'s `RULES_V4` (bpftool's view).
fn rule_id_of(lab: &Lab, gw: &str, egress: Ipv4Addr) -> Result<u32> {
    let pin = lab.bpffs_dir(gw).join(maps::RULES_V4);
    let out = std::process::Command::new("bpftool")
        .args(["-j", "map", "dump", "pinned"])
        .arg(&pin)
        .output()?;
    let entries: serde_json::Value = serde_json::from_slice(&out.stdout)?;
    let want: Vec<u64> = egress.octets().iter().map(|o| u64::from(*o)).collect();
    entries
        .as_array()
        .into_iter()
        .flatten()
        .map(|e| &e["formatted"])
        .find(|f| {
            f["value"]["egress_ip"].as_array().is_some_and(|ip| {
                ip.iter()
                    .filter_map(|o| o.as_u64())
                    .eq(want.iter().copied())
            })
        })
        .and_then(|f| f["key"].as_u64())
        .and_then(|k| u32::try_from(k).ok())
        .with_context(|| format!("no rule with egress IP {egress} in {}", pin.display()))
}

/// VXLAN header (I flag, `vni`) and the inner frame: a UDP datagram from `inner_src` to
/// host-a's echo port whose payload names the case.
fn vxlan(vni: u32, inner_src: Ipv4Addr, marker: &str) -> Vec<u8> {
    let mut b = vec![0x08, 0, 0, 0];
    b.extend_from_slice(&(vni << 8).to_be_bytes());
    let inner = Ipv4Packet::new(
        inner_src,
        addr::HOST_A,
        L4::udp(40_123, addr::ECHO_PORT, marker.as_bytes()),
    );
    b.extend(inner.build());
    b
}

/// A reply as a gateway sends it back (`RETURN_VNI`): host-a's datagram to `pod`.
fn return_vxlan(pod: Ipv4Addr, marker: &str) -> Vec<u8> {
    let mut b = vec![0x08, 0, 0, 0];
    b.extend_from_slice(&(RETURN_VNI << 8).to_be_bytes());
    let inner = Ipv4Packet::new(
        addr::HOST_A,
        pod,
        L4::udp(addr::ECHO_PORT, 40_123, marker.as_bytes()),
    );
    b.extend(inner.build());
    b
}

/// Replies go into a pod (`TO_POD_DEVICE`, around the CNI) only from the gateway the
/// pod's node sends its traffic to that source through: the same reply to w1-p1 from
/// host-a, sent to w1 with `RETURN_VNI` from w2's address (a node, but not w1-p1's
/// gateway: what a pod of w2 can send where its CNI SNATs its traffic to other nodes,
/// as OVN-Kubernetes does) takes the node's routing, never the pod's device; sent from
/// the holder of egress IP A's address, it goes into the pod. `(forged, control)`: the
/// `TO_POD_DEVICE` counted on w1 for each.
fn returned_into_the_pod(lab: &Lab, gw: &str) -> Result<(u64, u64)> {
    let w1 = lab.node("w1")?.ip;
    let mut counts = Vec::new();
    for (member, marker) in [("w2", "forged-return"), (gw, "control-return")] {
        let before = counted(lab, "w1", TO_POD_DEVICE);
        let from = lab.node(member)?.ip;
        send(lab, member, from, w1, return_vxlan(addr::W1_P1, marker))?;
        std::thread::sleep(Duration::from_millis(300));
        counts.push(counted(lab, "w1", TO_POD_DEVICE) - before);
    }
    Ok((counts[0], counts[1]))
}

/// Send [`COUNT`] copies of a tunnel packet from `member`'s namespace, from its address
/// `from`, to `gateway`'s tunnel port.
fn send(lab: &Lab, member: &str, from: Ipv4Addr, gateway: Ipv4Addr, packet: Vec<u8>) -> Result<()> {
    lab.ns(member)?.run_in(move || {
        let s = UdpSocket::bind(SocketAddr::new(from.into(), 0))?;
        for _ in 0..COUNT {
            s.send_to(
                &packet,
                SocketAddr::new(gateway.into(), DEFAULT_TUNNEL_PORT),
            )?;
            std::thread::sleep(Duration::from_millis(5));
        }
        Ok(())
    })
}

#[test]
fn forged_tunnel_packets_are_dropped_and_counted_by_reason() -> Result<()> {
    let lab = up_with_agents(default_spec()?)?;
    let (gw, _) = holder(&lab, addr::EGRESS_IP_A).context("nobody holds egress IP A")?;
    let gw_ip = lab.node(&gw)?.ip;
    let rule_a = rule_id_of(&lab, &gw, addr::EGRESS_IP_A)?;
    let (mut dump, capture) =
        cluster::capture(&lab, "host-a", "udp dst port 7777", "host-a-forged.txt")?;

    let cases = [
        Forged::new("forged-stranger", "rtr", addr::ROUTER, rule_a, addr::W1_P1)
            .counted(DROP_UNKNOWN_SENDER),
        Forged::new("forged-foreign-pod", "w1", addr::W1, rule_a, addr::W2_P1)
            .counted(DROP_SPOOFED_SOURCE),
        Forged::new(
            "forged-unknown-rule",
            "w1",
            addr::W1,
            0x00ab_cdef,
            addr::W1_P1,
        )
        .counted(DROP_UNKNOWN_RULE),
        Forged::new("forged-unselected-pod", "w1", addr::W1, rule_a, addr::W1_P2)
            .counted(DROP_NOT_ADMITTED),
        Forged::new("control-well-formed", "w1", addr::W1, rule_a, addr::W1_P1),
    ];
    let mut report = Vec::new();
    for c in cases {
        let before = c.reason.map(|r| counted(&lab, &gw, r));
        send(
            &lab,
            c.member,
            c.from,
            gw_ip,
            vxlan(c.vni, c.inner, c.marker),
        )?;
        std::thread::sleep(Duration::from_millis(300));
        let counted_now = c
            .reason
            .map(|r| counted(&lab, &gw, r) - before.unwrap_or(0));
        report.push((c.marker, c.reason, counted_now));
    }
    let (forged, control) = returned_into_the_pod(&lab, &gw)?;
    println!("return path: into w1-p1 {forged} forged from w2, {control} from {gw} (of {COUNT})");
    ensure!(
        forged == 0,
        "{forged} replies forged from w2's address went into w1-p1"
    );
    ensure!(
        control >= COUNT as u64,
        "only {control} of {COUNT} replies from {gw} went into w1-p1: the test proves nothing"
    );
    std::thread::sleep(Duration::from_millis(300));
    let _ = dump.terminate(Duration::from_secs(1));
    let seen = std::fs::read_to_string(&capture)?;
    for (marker, reason, counted_now) in report {
        let arrived = seen.matches(marker).count();
        println!("{marker}: {arrived} of {COUNT} arrived at host-a, counted {counted_now:?}");
        match reason {
            Some(_) => {
                ensure!(
                    arrived == 0,
                    "{marker}: {arrived} forged packets reached host-a"
                );
                ensure!(
                    counted_now.unwrap_or(0) >= COUNT as u64,
                    "{marker}: the gateway counted {counted_now:?} of {COUNT}"
                );
            }
            None => {
                ensure!(
                    arrived > 0,
                    "the well-formed control packet never arrived: the test proves nothing"
                );
                let from_egress = seen
                    .lines()
                    .any(|l| l.contains(&format!("{}.40123 >", addr::EGRESS_IP_A)));
                ensure!(
                    from_egress,
                    "the control packet did not arrive from egress IP A:\n{seen}"
                );
            }
        }
    }
    Ok(())
}
