//! Legacy tc against TCX (issue 27): the same lab, the same traffic, the agents restarted
//! with `--attach tcx` and `--attach tc` in alternate rounds, so the hook is the only
//! difference. Two paths of w1-p1's 64-byte UDP: the tunnel path to host-a (`from_pod`
//! tunnels it on w1; `from_underlay` and `from_tunnel` take it on the holder, which SNATs
//! it out of `sec-a`) and the miss path to host-c (`from_pod` finds no rule and passes it
//! on to w1's routing). Before each hook's rounds the hook is checked where it matters:
//! w1-p1's device carries `from_pod` as a TCX link, or as our tc filter and no TCX link.

use std::{collections::BTreeMap, net::Ipv4Addr, thread, time::Duration};

use anyhow::{Context as _, Result, bail};

use super::{LabPlan, LabRun, Table, converged, header, spread_big, times, traffic, why};
use crate::{
    bench::Spread,
    cluster,
    hooks::{self, Ingress},
    lab::{Lab, addr},
};

/// The hooks compared, as `--attach` names them.
pub const HOOKS: [&str; 2] = ["tcx", "tc"];

/// The paths timed: name, destination, what it crosses.
pub const PATHS: [(&str, Ipv4Addr, &str); 2] = [
    (
        "tunnel",
        addr::HOST_A,
        "to host-a: from_pod tunnels it on w1; from_underlay and from_tunnel on the holder",
    ),
    (
        "miss",
        addr::HOST_C,
        "to host-c: from_pod finds no rule and passes it on",
    ),
];

/// The pod whose traffic is timed, and its device on w1.
const POD: &str = "w1-p1";
const POD_DEVICE: &str = "cali-w1-p1";

/// Quiet time after the agents restarted, before the timed traffic.
const SETTLE: Duration = Duration::from_secs(5);

/// How the facts of this section start (the other tables leave them out).
const FACT: &str = "Hooks";

/// Restart every agent with `--attach hook` and wait until the lab has converged, then
/// check w1-p1's device carries `from_pod` on that hook alone.
fn attach_all(lab: &mut Lab, hook: &str) -> Result<()> {
    lab.stop_agents();
    let bin = cluster::agent_bin()?;
    let nodes: Vec<&'static str> = lab.nodes().iter().map(|n| n.name).collect();
    for node in nodes {
        lab.start_agent(node, &bin, &["--attach", hook])?;
    }
    converged(lab, addr::EGRESS_IP_A)?;
    // Converged on the earlier hook's attachments already (they stay while an agent
    // restarts): wait for the new agent's, and for the old ones to go.
    let want_tcx = hook == "tcx";
    let only_new = |on: &[Ingress]| {
        on.len() == 1
            && on[0].is(egress_agent::ebpf::FROM_POD)
            && matches!(on[0], Ingress::Tcx(_)) == want_tcx
    };
    let w1 = lab.ns("w1")?;
    let seen = || {
        w1.run_in(|| Ok(hooks::ingress(POD_DEVICE)))
            .unwrap_or_default()
    };
    if cluster::wait_until(Duration::from_secs(20), || only_new(&seen())).is_err() {
        bail!("{POD_DEVICE} on w1 with --attach {hook}: {:?}", seen());
    }
    // Four agents just started on two cores: their first passes and sweeps take CPU the
    // timed traffic would share (rounds right after a restart ran at a quarter the rate).
    thread::sleep(SETTLE);
    Ok(())
}

/// Alternate rounds of each hook; the agents end on TCX, as the rest of the run expects.
pub fn measure(r: &mut LabRun, lab: &mut Lab, lp: &LabPlan) {
    let server = r.step("iperf3 server on host-c", |_| {
        let log = lab.dir().join("iperf3-host-c.log");
        let s = lab.ns("host-c")?.spawn(
            "iperf3",
            &["-s", "-p", &traffic::IPERF_PORT.to_string()],
            &log,
        )?;
        thread::sleep(Duration::from_millis(300));
        Ok(s)
    });
    if server.is_none() {
        return;
    }
    // Untimed: the first seconds of traffic after the lab came up ran slower in every try.
    for (_, host, _) in PATHS {
        let _ = traffic::iperf_to(lab, POD, host, true, lp.iperf_secs);
    }
    for round in 0..lp.rounds {
        // Each round swaps the order, so that a drift of the machine favours neither.
        let order = if round % 2 == 0 {
            HOOKS
        } else {
            [HOOKS[1], HOOKS[0]]
        };
        for hook in order {
            if r.step(&format!("agents on --attach {hook}"), |_| {
                attach_all(lab, hook)
            })
            .is_none()
            {
                continue;
            }
            for (path, host, _) in PATHS {
                r.step(
                    &format!("{path} path on {hook}, round {}", round + 1),
                    |r| {
                        let t = traffic::iperf_to(lab, POD, host, true, lp.iperf_secs)?;
                        r.hook_pps.entry((path, hook)).or_default().push(t.received);
                        Ok(())
                    },
                );
            }
        }
    }
    if r.step("agents back on --attach tcx", |_| attach_all(lab, "tcx"))
        .is_some()
    {
        r.facts.push(format!(
            "{FACT}: {} rounds of each hook, alternated (TCX first in odd rounds, tc first in \
             even ones), after one untimed run per path; {} s of 64-byte UDP (iperf3 -u -l \
             64 -b 0) per path and round; before each hook's rounds every agent was \
             restarted with it, {POD_DEVICE} on w1 checked to carry from_pod on that hook \
             alone, and the lab left {} s to settle.",
            lp.rounds,
            lp.iperf_secs,
            SETTLE.as_secs()
        ));
    }
    drop(server);
}

/// The section's table: packets per second received, per path and hook, and tc / TCX.
pub fn table(run: Option<&LabRun>) -> Table {
    let empty = BTreeMap::new();
    let m = run.map_or(&empty, |r| &r.hook_pps);
    let get = |path: &str, hook: &str| -> Option<Spread> {
        m.iter()
            .find(|((p, h), _)| *p == path && *h == hook)
            .and_then(|(_, v)| Spread::of(v))
    };
    let rows = PATHS
        .iter()
        .map(|(path, _, what)| {
            let (tcx, tc) = (get(path, "tcx"), get(path, "tc"));
            vec![
                format!("{path} path ({what})"),
                spread_big(tcx),
                spread_big(tc),
                times(super::ratio(tc, tcx)),
            ]
        })
        .collect();
    // The lab's shared intro describes the throughput rounds; this section has its own.
    let mut intro = if run.is_none() { why(run) } else { Vec::new() };
    intro.push(
        "What legacy tc costs against TCX (issue 27): kernels before 6.6 have no TCX, and \
         the agent attaches there with a clsact qdisc and direct-action bpf filters. One \
         lab (`tests/src/lab.rs`), the same traffic, the agents restarted with each hook in \
         alternate rounds; packets per second received by the far host, the median and, in \
         brackets, the min-max over rounds."
            .to_owned(),
    );
    Table {
        title: "Legacy tc against TCX at one served pod".to_owned(),
        intro,
        header: header(&[
            "w1-p1, UDP 64-byte (packets/s received)",
            "TCX",
            "legacy tc",
            "tc / TCX",
        ]),
        rows,
        notes: run
            .iter()
            .flat_map(|r| r.facts.iter())
            .filter(|f| f.starts_with(FACT))
            .cloned()
            .collect(),
    }
}

/// Only this section, on a fresh lab (`egress-bench --hooks`).
pub fn run_alone(plan: &crate::bench::Plan) -> Result<LabRun> {
    let lp = LabPlan::of(plan);
    let mut r = LabRun {
        plan: Some(lp),
        ..LabRun::default()
    };
    let mut lab = cluster::up_with_agents(cluster::default_spec()?)
        .context("failed to bring up the lab with agents")?;
    let start = std::time::Instant::now();
    let host_a = super::start_iperf_server(&lab)?;
    measure(&mut r, &mut lab, &lp);
    drop(host_a);
    r.took = start.elapsed();
    if let Err(e) = lab.down() {
        r.errors.push(format!("teardown: {e:#}"));
    }
    Ok(r)
}
