//! A namespace isolated by NetworkPolicy under real OVN ([`Cni::Ovn`]): the policy as the
//! agents read it (a NetworkPolicy document) and as OVN-Kubernetes renders it (port
//! groups and ACLs, [`Lab::isolate_namespace`]), and the checks that its ACLs hold for
//! everything but the replies of flows our datapath carried.

use egress_common::counters::reason;

use super::*;
use crate::cluster::counted;

/// The NetworkPolicy file of [`Lab::isolate_payments`].
pub const ISOLATION_FILE: &str = "netpol-isolation.yaml";

/// The networks `payments`' pods may reach ([`Lab::isolate_payments`]): the lab's
/// external networks (C through OVN, the others through our rules).
const EGRESS_TO: [&str; 5] = [
    addr::NET_A,
    addr::NET_B,
    addr::NET_C,
    addr::NET_D,
    addr::NET_E,
];

/// One check of [`Lab::check_isolation`]: what was tried, whether it held, what was seen.
#[derive(Debug)]
pub struct IsolationCheck {
    pub what: String,
    pub ok: bool,
    pub seen: String,
}

/// The NetworkPolicy isolating `payments`: every pod selected for ingress and egress;
/// ingress from the namespace's own pods; egress to the cluster's pods and [`EGRESS_TO`].
pub fn isolation_policy() -> String {
    let to = std::iter::once(ovn::CLUSTER_SUBNET)
        .chain(EGRESS_TO)
        .map(|c| format!("    - ipBlock: {{cidr: {c}}}\n"))
        .collect::<String>();
    format!(
        "apiVersion: networking.k8s.io/v1\nkind: NetworkPolicy\n\
         metadata: {{name: isolate, namespace: {PAYMENTS}}}\n\
         spec:\n  podSelector: {{}}\n  policyTypes: [Ingress, Egress]\n  \
         ingress:\n  - from:\n    - podSelector: {{}}\n  egress:\n  - to:\n{to}"
    )
}

impl Lab {
    /// Isolate `payments` as a cluster would: the NetworkPolicy for the agents (which
    /// apply its egress rules to what they redirect) and OVN-Kubernetes' rendering of it
    /// in OVN. Returns the policy.
    pub fn isolate_payments(&self) -> Result<String> {
        let doc = isolation_policy();
        self.write_state_file(ISOLATION_FILE, &doc)?;
        self.isolate_namespace(PAYMENTS, &EGRESS_TO)?;
        Ok(doc)
    }

    /// What must hold once `payments` is isolated, each tried with packets: a pod of
    /// `payments` on another node reaches `w1-p1` over OVN (the allow rule); a pod of
    /// another namespace does not (OVN's default deny); host A, sending to egress IP A
    /// what is not a reply, reaches nothing (the gateway's conntrack drops it,
    /// `DROP_NO_CONNTRACK`); and the replies of `w1-p1`'s flows through our rules went
    /// into the pod (w1's `TO_POD_DEVICE` counted them), not through OVN, while replies a
    /// pod of another node forges as its node do not. `w1-p1` runs an
    /// echo server for the duration.
    pub fn check_isolation(&self) -> Result<Vec<IsolationCheck>> {
        let target = self.pod("w1-p1")?.ip;
        let port = addr::ECHO_PORT.to_string();
        let _server = self.ns("w1-p1")?.spawn(
            &self.spec.echo_bin,
            &["serve", "--tcp", &port, "--udp", &port],
            &self.dir.join("w1-p1-isolation-echo.log"),
        )?;
        std::thread::sleep(Duration::from_millis(300));
        let reach = |from: &str, proto: Proto, host: IpAddr| {
            let q = Query::new(proto, host, addr::ECHO_PORT)
                .timeout(Duration::from_millis(700))
                .attempts(2);
            self.query_with(from, &q).ok().map(|s| s.ip)
        };
        let shown = |s: Option<IpAddr>| s.map_or("nothing".to_owned(), |ip| ip.to_string());
        let mut out = Vec::new();
        let w2_p1 = IpAddr::V4(self.pod("w2-p1")?.ip);
        for proto in [Proto::Tcp, Proto::Udp] {
            let seen = reach("w2-p1", proto, IpAddr::V4(target));
            out.push(IsolationCheck {
                what: format!("w2-p1 (payments) -> w1-p1 {proto:?}: allowed"),
                ok: seen == Some(w2_p1),
                seen: shown(seen),
            });
            let seen = reach("w2-p2", proto, IpAddr::V4(target));
            out.push(IsolationCheck {
                what: format!("w2-p2 (other) -> w1-p1 {proto:?}: denied by OVN"),
                ok: seen.is_none(),
                seen: shown(seen),
            });
        }
        let (holder, _) = crate::cluster::holder(self, addr::EGRESS_IP_A)
            .context("no gateway holds egress IP A")?;
        let before = counted(self, &holder, reason::DROP_NO_CONNTRACK);
        let seen = reach("host-a", Proto::Tcp, IpAddr::V4(addr::EGRESS_IP_A));
        let after = counted(self, &holder, reason::DROP_NO_CONNTRACK);
        out.push(IsolationCheck {
            what: "host-a -> egress IP A, not a reply: dropped at its holder".to_owned(),
            ok: seen.is_none() && after > before,
            seen: format!(
                "{}; {holder}'s DROP_NO_CONNTRACK {before} -> {after}",
                shown(seen)
            ),
        });
        out.push(self.forged_return_from_a_pod()?);
        for gw in ["gw1", "gw2"] {
            out.push(self.restricted_forwarding(gw)?);
        }
        let into = counted(self, "w1", reason::TO_POD_DEVICE);
        out.push(IsolationCheck {
            what: "w1: replies of our flows went into the pods, not through OVN".to_owned(),
            ok: into > 0,
            seen: format!("TO_POD_DEVICE {into}"),
        });
        Ok(out)
    }

    /// `node` forwards as OpenShift's `ipForwarding: Restricted` leaves it, with the
    /// agent running: `all` off, on only for OVN-Kubernetes' interfaces and the
    /// datapath's (the tunnel device, the secondary networks': the node's settings).
    fn restricted_forwarding(&self, node: &str) -> Result<IsolationCheck> {
        let out = self.exec(
            node,
            "sysctl",
            &["-a", "-r", r"^net\.ipv4\.conf\..*\.forwarding$"],
        )?;
        let text = String::from_utf8_lossy(&out.stdout).into_owned();
        let on = |l: &&str| l.trim_end().ends_with("= 1");
        let name = |l: &str| {
            l.trim_start_matches("net.ipv4.conf.")
                .split(".forwarding")
                .next()
                .unwrap_or("")
                .to_owned()
        };
        let all_on = text
            .lines()
            .any(|l| l.starts_with("net.ipv4.conf.all.") && on(&l));
        let named: Vec<String> = text.lines().filter(on).map(name).collect();
        // Off but for OVN-Kubernetes' interfaces and the datapath's (`Lab::node_forwarding`):
        // the table's rows through this gateway show that this is enough.
        let expected = |n: &String| {
            ["br-ex", "ovn-k8s-mp0", "egress0"].contains(&n.as_str()) || n.starts_with("sec-")
        };
        Ok(IsolationCheck {
            what: format!("{node}: forwards with `all` forwarding off (Restricted)"),
            ok: !all_on && named.iter().all(expected) && named.iter().any(|n| n == "egress0"),
            seen: format!("on for: {}", named.join(", ")),
        })
    }

    /// A pod of another node (w2-p2) sends w1 replies to w1-p1 from host-a as a gateway
    /// would (`RETURN_VNI`); OVN SNATs them to w2's address, a known node's. None may go
    /// into the pod (`TO_POD_DEVICE` on w1 unchanged): w2 is not w1-p1's gateway, so they
    /// take w1's routing into OVN, whose ACLs drop them.
    fn forged_return_from_a_pod(&self) -> Result<IsolationCheck> {
        const COUNT: usize = 20;
        let mut packet = vec![0x08, 0, 0, 0];
        packet.extend_from_slice(&(egress_common::policy::RETURN_VNI << 8).to_be_bytes());
        packet.extend(
            crate::packet::Ipv4Packet::new(
                addr::HOST_A,
                self.pod("w1-p1")?.ip,
                crate::packet::L4::udp(addr::ECHO_PORT, 40_123, b"forged-by-a-pod"),
            )
            .build(),
        );
        let w1 = std::net::SocketAddr::new(
            self.node("w1")?.ip.into(),
            egress_common::config::DEFAULT_TUNNEL_PORT,
        );
        let (into, delivered) = (reason::TO_POD_DEVICE, reason::RETURN_DELIVERED);
        let before = (counted(self, "w1", into), counted(self, "w1", delivered));
        self.ns("w2-p2")?.run_in(move || {
            let s = std::net::UdpSocket::bind("0.0.0.0:0")?;
            for _ in 0..COUNT {
                s.send_to(&packet, w1)?;
                std::thread::sleep(Duration::from_millis(5));
            }
            Ok(())
        })?;
        std::thread::sleep(Duration::from_millis(300));
        let after = (counted(self, "w1", into), counted(self, "w1", delivered));
        Ok(IsolationCheck {
            what: "w2-p2 forges replies to w1-p1 as w2: never into the pod".to_owned(),
            ok: after.0 == before.0,
            seen: format!(
                "w1: TO_POD_DEVICE +{}, RETURN_DELIVERED +{} (to OVN) of {COUNT}",
                after.0 - before.0,
                after.1 - before.1
            ),
        })
    }
}
