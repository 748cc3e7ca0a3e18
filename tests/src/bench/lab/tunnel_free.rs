//! What a tunnel-free path gives (issue 15: the routed baseline's target cannot be met
//! with a tunnel). The lab's pod on the serving gateway itself, gw1-p1 (payments,
//! app=api: the measured pod's policy, so the same rule and egress IP), leaves through
//! gw1's own datapath: `from_pod` on its veth, the gateway path (conntrack, SNAT, next
//! hop) and a redirect to `sec-a`, with no VXLAN either way. Next to it, the kernel doing
//! the same for the same pod: the routed baseline's `ip rule` and nftables SNAT on gw1.
//!
//! Ours against that kernel is the cost of our programs on a path without a tunnel; ours
//! from w1-p1 against ours from gw1-p1 is what the tunnel (with the underlay hop) costs
//! ours. Neither path crosses the underlay, so both are cheaper than the routed baseline
//! from w1-p1: this is the tunnel-free bound, not a like-for-like row.

use std::{collections::BTreeMap, time::Duration};

use anyhow::{Context as _, Result, bail, ensure};

use super::{
    AGENT_TUNNEL, LabPlan, LabRun, Samples, Side, Table, baseline, get, header, measure, ratio,
    spread_big, spread_text, times, why,
};
use crate::{
    bench::Spread,
    cluster::{holder, seen, wait_until},
    lab::{Lab, Proto, addr},
};

/// The pod on the serving gateway.
pub const POD: &str = "gw1-p1";
/// Its source ports (`ip_local_port_range`), apart from w1-p1's (10000-65000). Both
/// leave as the same egress IP with their ports kept, and host-a's echo server closes
/// first: its TIME_WAIT sockets of w1-p1's flows would meet gw1-p1's SYNs on the same
/// tuple, whose sequence numbers (hashed from the pod's own tuple) are no later, and
/// those connections would wait a second for their SYN's retry.
pub const PORTS: &str = "1024 9999";
/// How the facts of this section start (the other tables leave them out).
const FACT: &str = "Tunnel-free";

/// Host-a sees the egress IP as the source of [`POD`]'s traffic.
fn leaves_as_egress_ip(lab: &Lab) -> Result<()> {
    let egress = std::net::IpAddr::V4(addr::EGRESS_IP_A);
    wait_until(Duration::from_secs(30), || {
        seen(lab, POD, Proto::Tcp, addr::HOST_A) == Some(egress)
    })
    .map(|_| ())
    .with_context(|| format!("{POD} -> host-a did not leave as {egress}"))
}

/// Ours from [`POD`] (agents up): checked (gw1 holds the egress IP, host-a sees it, and
/// gw1's tunnel device sent nothing during the probe), then timed.
pub fn measure_ours(r: &mut LabRun, lab: &Lab, echo: &str, lp: &LabPlan) {
    let checked = r
        .step("ours from the gateway's own pod (no tunnel)", |r| {
            match holder(lab, addr::EGRESS_IP_A) {
                Some((gw, _)) if gw == "gw1" => {}
                other => bail!(
                    "{} is held by {}, not gw1: {POD}'s packets would be tunneled",
                    addr::EGRESS_IP_A,
                    other.map_or("nobody".to_owned(), |h| h.0)
                ),
            }
            let before = baseline::link_packets(lab, "gw1", AGENT_TUNNEL)?;
            leaves_as_egress_ip(lab)?;
            let after = baseline::link_packets(lab, "gw1", AGENT_TUNNEL)?;
            let sent = after.1.saturating_sub(before.1);
            ensure!(
                sent == 0,
                "gw1's {AGENT_TUNNEL} sent {sent} packets while {POD} probed host-a: its \
                 path is not tunnel-free"
            );
            r.facts.push(format!(
                "{FACT}, ours: gw1 holds {egress}; {POD}'s packets to host-a leave through \
                 gw1's own datapath (`from_pod` on its veth, conntrack and SNAT, redirect to \
                 `sec-a`). Checked before timing: host-a saw {egress}, and gw1's \
                 `{AGENT_TUNNEL}` sent no packet during the probe.",
                egress = addr::EGRESS_IP_A,
            ));
            Ok(())
        })
        .is_some();
    if checked {
        measure(r, lab, echo, Side::OursOnGateway, 1, lp);
    }
}

/// The kernel from [`POD`], on the routed baseline (up, our datapath gone): the pod's rule
/// and SNAT element added, checked (host-a sees the egress IP), timed, and removed again.
pub fn measure_kernel(r: &mut LabRun, lab: &Lab, echo: &str, lp: &LabPlan) {
    let up = r
        .step("the kernel from the gateway's own pod", |r| {
            baseline::gateway_pod_up(lab, addr::GW1_P1)?;
            leaves_as_egress_ip(lab)?;
            r.facts.push(format!(
                "{FACT}, kernel: the routed baseline's gw1 with one more `ip rule` (priority \
                 6000, created last) and SNAT map element, for {POD}. Checked before \
                 timing: host-a saw {}.",
                addr::EGRESS_IP_A,
            ));
            Ok(())
        })
        .is_some();
    if up {
        measure(r, lab, echo, Side::KernelOnGateway, 1, lp);
    }
    r.step("the kernel from the gateway's own pod: down", |_| {
        baseline::gateway_pod_down(lab, addr::GW1_P1)
    });
}

/// Whether a fact belongs to this section.
pub fn is_fact(f: &str) -> bool {
    f.starts_with(FACT)
}

/// Ours and the kernel from the gateway's own pod, and ours from w1-p1 (tunneled) for the
/// tunnel's cost.
pub fn table(run: Option<&LabRun>) -> Table {
    let cols = header(&[
        "traffic (1 served pod)",
        "ours, from gw1-p1 (no tunnel)",
        "kernel, from gw1-p1 (ip rule + nftables)",
        "ours / kernel",
        "ours, from w1-p1 (tunneled)",
        "ours tunneled / tunnel-free",
    ]);
    let empty = BTreeMap::new();
    let pick = |f: fn(&LabRun) -> &Samples| run.map_or(&empty, f);
    let row = |metric: &str, m: &Samples, fmt: fn(Option<Spread>) -> String| {
        let [free, kernel, tunneled] =
            [Side::OursOnGateway, Side::KernelOnGateway, Side::Ours].map(|s| get(m, s, 1));
        vec![
            metric.to_owned(),
            fmt(free),
            fmt(kernel),
            times(ratio(free, kernel)),
            fmt(tunneled),
            times(ratio(tunneled, free)),
        ]
    };
    let rows = vec![
        row("TCP, iperf3 (Gbit/s)", pick(|r| &r.tcp_gbps), |s| {
            spread_text(s, 2)
        }),
        row(
            "UDP, 64-byte (packets/s received)",
            pick(|r| &r.udp_pps),
            spread_big,
        ),
        row(
            "new TCP flows/s through the gateway",
            pick(|r| &r.flows),
            spread_big,
        ),
    ];
    let mut intro = why(run);
    intro.push(
        "What a tunnel-free path gives (issue 15: the routed baseline's target cannot be met \
         with a tunnel): gw1-p1, the lab's pod on the serving gateway, has the measured \
         pod's policy and leaves through gw1's own datapath without VXLAN either way; the \
         kernel serves the same pod with the routed baseline's `ip rule` and nftables SNAT \
         on gw1. Neither path crosses the underlay, so this bounds a tunnel-free path (a \
         gateway on the source node's L2 segment would add one hop); ours tunneled / \
         tunnel-free is what the tunnel and the hop cost ours."
            .to_owned(),
    );
    let notes = run
        .iter()
        .flat_map(|r| r.facts.iter())
        .filter(|f| is_fact(f))
        .cloned()
        .collect();
    Table {
        title: "Tunnel-free at one served pod: the gateway's own pod".to_owned(),
        intro,
        header: cols,
        rows,
        notes,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_table_sets_ours_against_the_kernel_and_against_our_tunnel() {
        let mut r = super::super::tcp_run(&[
            (Side::OursOnGateway, 20.0),
            (Side::KernelOnGateway, 16.0),
            (Side::Ours, 12.0),
        ]);
        r.facts.push(format!("{FACT}, ours: checked"));
        r.facts
            .push("Tunneled baseline: not this table's".to_owned());
        let t = table(Some(&r));
        let tcp = &t.rows[0];
        assert_eq!(
            (tcp[3].as_str(), tcp[5].as_str()),
            ("1.25x", "0.60x"),
            "{tcp:?}"
        );
        assert!(t.rows[1][3].contains("not measured"), "{:?}", t.rows[1]);
        assert_eq!(t.notes, vec![format!("{FACT}, ours: checked")]);
    }
}
