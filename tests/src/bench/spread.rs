//! Two gateways against one in the bench (`egressIPs`): aggregate TCP (iperf3, all at once)
//! of the lab's selected pods to host A, with network A's rule on one egress IP (every pod
//! through its holder) and on two (`egressIPs: [A, A2]`, one gateway each, the pods split
//! by the hash), alternating in one run, as a ratio. Measured and reported, never asserted.

use std::{collections::BTreeMap, time::Duration};

use anyhow::{Context as _, Result, bail};

use super::{
    Plan, Spread,
    lab::traffic::iperf_at,
    report::{NOT_MEASURED, Table},
};
use crate::{
    cluster,
    lab::{Lab, LabSpec, NODES, addr, sample_policy_for},
    netns::NsChild,
    spread,
};

/// The first port of the iperf3 servers on host-a, one per pod.
const FIRST_PORT: u16 = 5301;

/// How long the agents may take to move to the other policy.
const SWITCH_WITHIN: Duration = Duration::from_secs(20);

/// One measured setup.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Setup {
    One,
    Two,
}

/// Run the section on a fresh lab of `spec` (IPv4).
pub fn table(spec: LabSpec, plan: &Plan) -> Result<Table> {
    let lab = cluster::up_with_agents(spec)?;
    let pods: Vec<String> = selected_pods(&lab)?;
    let _servers = start_servers(&lab, pods.len())?;
    let secs = if plan.quick { 3 } else { 5 };
    let mut gbps: BTreeMap<Setup, Vec<f64>> = BTreeMap::new();
    let mut carried: BTreeMap<Setup, String> = BTreeMap::new();
    for _ in 0..plan.rounds {
        for setup in [Setup::One, Setup::Two] {
            let gateways = switch(&lab, setup, &pods)?;
            carried.insert(setup, gateways);
            gbps.entry(setup)
                .or_default()
                .push(aggregate(&lab, &pods, secs)?);
        }
    }
    lab.write_policy(&sample_policy_for(lab.family()))?;
    let one = Spread::of(gbps.get(&Setup::One).map_or(&[][..], Vec::as_slice));
    let two = Spread::of(gbps.get(&Setup::Two).map_or(&[][..], Vec::as_slice));
    let ratio = one
        .zip(two)
        .map(|(o, t)| t.median / o.median)
        .filter(|r| r.is_finite());
    let cell = |s: Option<Spread>| {
        s.map_or(NOT_MEASURED.to_owned(), |s| {
            format!("**{:.2}** ({:.2}-{:.2})", s.median, s.min, s.max)
        })
    };
    let row = |setup: Setup, what: &str, s: Option<Spread>, r: String| {
        vec![
            what.to_owned(),
            carried.get(&setup).cloned().unwrap_or_default(),
            cell(s),
            r,
        ]
    };
    Ok(Table {
        title: "Two gateways against one (egressIPs)".to_owned(),
        intro: vec![format!(
            "The lab's {} selected pods on workers ({}) each run `iperf3 -t {secs}` to host A at the \
             same time (one server per pod); the sum of what host A received, Gbit/s. \
             Network A's rule leaves by one egress IP (`egressIP: A`), then by two \
             (`egressIPs: [A, A2]`), alternating, {} rounds each, in one run.",
            pods.len(),
            pods.join(", "),
            plan.rounds,
        )],
        header: [
            "network A's rule",
            "who carries which pods",
            "aggregate TCP Gbit/s",
            "two / one",
        ]
        .iter()
        .map(|s| (*s).to_owned())
        .collect(),
        rows: vec![
            row(Setup::One, "egressIP: A", one, "1.00x".to_owned()),
            row(
                Setup::Two,
                "egressIPs: [A, A2]",
                two,
                ratio.map_or(NOT_MEASURED.to_owned(), |r| format!("{r:.2}x")),
            ),
        ],
        notes: vec![
            "Every namespace of the lab shares this machine's CPUs: the sum is bound by \
             them, not by a gateway's NIC or conntrack as in a cluster, so the ratio shows \
             what spreading costs or saves here, not the scaling of real gateways (each \
             adds its own NIC and CPUs)."
                .to_owned(),
        ],
    })
}

/// The lab's pods on workers that the sample policy selects (namespace payments, app
/// api): a gateway's own pod would leave locally with one address and through the tunnel
/// with two, which is not what spreading is for.
fn selected_pods(lab: &Lab) -> Result<Vec<String>> {
    let on_worker = |node: &str| NODES.iter().any(|n| n.name == node && !n.gateway);
    let pods: Vec<String> = lab
        .pods()
        .iter()
        .filter(|p| {
            p.namespace == "payments"
                && p.labels.get("app").map(String::as_str) == Some("api")
                && on_worker(&p.node)
        })
        .map(|p| p.name.clone())
        .collect();
    if pods.is_empty() {
        bail!("the lab has no pod on a worker that the sample policy selects");
    }
    Ok(pods)
}

/// One iperf3 server per pod on host-a, from [`FIRST_PORT`].
fn start_servers(lab: &Lab, n: usize) -> Result<Vec<NsChild>> {
    let host = lab.ns("host-a")?;
    let mut servers = Vec::new();
    for i in 0..n {
        let port = (FIRST_PORT + i as u16).to_string();
        let log = lab.dir().join(format!("iperf3-spread-{port}.log"));
        servers.push(host.spawn("iperf3", &["-s", "-p", &port], &log)?);
    }
    std::thread::sleep(Duration::from_millis(300));
    Ok(servers)
}

/// Network A's rule as `setup` says, served: returns who carries which of `pods`.
fn switch(lab: &Lab, setup: Setup, pods: &[String]) -> Result<String> {
    match setup {
        Setup::One => {
            lab.write_policy(&sample_policy_for(lab.family()))?;
            let [_, a2] = spread::addresses(false);
            cluster::wait_until(SWITCH_WITHIN, || {
                cluster::holder(lab, a2).is_none()
                    && cluster::seen(lab, "w1-p1", crate::lab::Proto::Tcp, addr::HOST_A)
                        == Some(addr::EGRESS_IP_A.into())
            })
            .context("network A's rule did not go back to one egress IP")?;
            let holder = cluster::holder(lab, addr::EGRESS_IP_A)
                .map(|(gw, _)| gw)
                .unwrap_or_default();
            Ok(format!("{holder}: all"))
        }
        Setup::Two => {
            let holders = spread::apply(lab, false)?;
            let rows = spread::rows(lab, false)?;
            let on = |gw: &str| {
                rows.iter()
                    .filter(|r| r.gateway.as_deref() == Some(gw) && pods.contains(&r.pod))
                    .map(|r| r.pod.as_str())
                    .collect::<Vec<_>>()
                    .join(", ")
            };
            Ok(format!(
                "{}: {}; {}: {}",
                holders[0],
                on(&holders[0]),
                holders[1],
                on(&holders[1])
            ))
        }
    }
}

/// Every pod's iperf3 at once: the sum of what host A received, Gbit/s.
fn aggregate(lab: &Lab, pods: &[String], secs: u32) -> Result<f64> {
    std::thread::scope(|s| {
        let runs: Vec<_> = pods
            .iter()
            .enumerate()
            .map(|(i, pod)| {
                let port = FIRST_PORT + i as u16;
                s.spawn(move || iperf_at(lab, pod, (addr::HOST_A, port), false, secs))
            })
            .collect();
        let mut sum = 0.0;
        for r in runs {
            let r = r
                .join()
                .map_err(|_| anyhow::anyhow!("an iperf3 thread panicked"))?;
            sum += r?.received;
        }
        Ok(sum)
    })
}
