//! What a lab just built must do before any agent runs, and what its wiring looked like
//! when it did not.

use super::*;

/// How long a node's query to host C may take before the lab counts it as failed (scaled by
/// `EGRESS_TEST_TIME_SCALE`, as under emulation).
const NODE_QUERY_TIMEOUT: Duration = Duration::from_millis(1500);

/// How much of `ovs-vswitchd`'s log [`Lab::wiring_report`] shows.
const LOG_LINES: usize = 40;

impl Lab {
    /// The underlay holds: every node reaches host C (behind the nodes' router, reached
    /// without any agent) over TCP from its own underlay address. Fails naming each node
    /// that did not, what it saw, and (under [`Cni::Ovs`]) its Open vSwitch's state.
    pub fn check_underlay(&self) -> Result<()> {
        let failed: Vec<(&Node, String)> = self
            .spec
            .nodes
            .iter()
            .filter_map(|node| {
                let (host, own) = self.underlay_probe(node);
                let q = Query::new(Proto::Tcp, host, addr::ECHO_PORT)
                    .timeout(NODE_QUERY_TIMEOUT * crate::cluster::time_scale());
                let seen = match self.query_with(node.name, &q) {
                    Ok(s) if s.ip == own => return None,
                    Ok(s) => format!("host-c saw {} instead of {own}", s.ip),
                    Err(e) => format!("no answer: {e:#}"),
                };
                Some((
                    node,
                    format!(
                        "{} does not reach host-c {host} over tcp from {own}: {seen}",
                        node.name
                    ),
                ))
            })
            .collect();
        if failed.is_empty() {
            return Ok(());
        }
        let mut text = format!(
            "the lab's {} wiring fails before any agent runs: {}",
            self.spec.cni,
            failed
                .iter()
                .map(|(_, why)| why.as_str())
                .collect::<Vec<_>>()
                .join("; ")
        );
        for (node, _) in &failed {
            text.push_str(&self.wiring_report(node.name));
        }
        bail!(text)
    }

    /// Host C's address and `node`'s own on the underlay's family.
    fn underlay_probe(&self, node: &Node) -> (IpAddr, IpAddr) {
        match self.spec.underlay {
            Underlay::V4 => (IpAddr::V4(addr::HOST_C), IpAddr::V4(node.ip)),
            Underlay::V6 => (IpAddr::V6(addr6::HOST_C), IpAddr::V6(node.ip6())),
        }
    }

    /// `node`'s addresses, routes and neighbours, and under [`Cni::Ovs`] and [`Cni::Ovn`]
    /// its Open vSwitch as its own tools show it (and OVN's databases and logs), each under a heading; a command that fails shows
    /// its error in its place.
    pub fn wiring_report(&self, node: &str) -> String {
        let mut out = String::new();
        let mut show = |title: String, result: Result<Output>| {
            out.push_str(&format!("\n== {node}: {title} ==\n"));
            match result {
                Ok(o) => {
                    out.push_str(&String::from_utf8_lossy(&o.stdout));
                    out.push_str(&String::from_utf8_lossy(&o.stderr));
                }
                Err(e) => out.push_str(&format!("{e:#}\n")),
            }
        };
        for args in [&["addr"][..], &["route"], &["neigh"]] {
            show(
                format!("ip {}", args.join(" ")),
                self.exec(node, "ip", args),
            );
        }
        if !self.spec.cni.runs_ovs() {
            return out;
        }
        // The bridges and ports, br-ex's OpenFlow table and what it learnt, then the kernel
        // datapath: its misses and lost upcalls, and the flows ovs-vswitchd installed.
        let ovs: [(&str, &[&str]); 6] = [
            ("ovs-vsctl", &["--timeout=10", "show"]),
            ("ovs-ofctl", &["dump-flows", "br-ex"]),
            ("ovs-appctl", &["--timeout=10", "fdb/show", "br-ex"]),
            ("ovs-appctl", &["--timeout=10", "dpctl/show", "-s"]),
            ("ovs-appctl", &["--timeout=10", "dpctl/dump-flows"]),
            ("ovs-appctl", &["--timeout=10", "upcall/show"]),
        ];
        for (program, args) in ovs {
            show(
                format!("{program} {}", args.join(" ")),
                self.ovs_command(node, program, args),
            );
        }
        if self.spec.cni.ovn().is_some() {
            self.ovn_report(node, &mut show);
        }
        let log = self.ovs_dir(node).join("ovs-vswitchd.log");
        out.push_str(&format!(
            "\n== {node}: {} (last {LOG_LINES} lines) ==\n",
            log.display()
        ));
        match std::fs::read_to_string(&log) {
            Ok(text) => {
                let lines: Vec<&str> = text.lines().collect();
                for l in &lines[lines.len().saturating_sub(LOG_LINES)..] {
                    out.push_str(l);
                    out.push('\n');
                }
            }
            Err(e) => out.push_str(&format!("{e}\n")),
        }
        out
    }
}
