//! A rolling upgrade in the lab, as a DaemonSet rolls: one node at a time, the workers
//! first, then the gateways that hold nothing, the holder of egress IP A last; each step
//! SIGTERMs the node's agent and starts the other build's on the same pins, while pod
//! `w1-p1` streams TCP, UDP and ping through A. Then the rollback, the same way back.
//!
//! Per step: who held A (an upgrade moves nothing), the time with two holders, whether TCP
//! survived or was reset, UDP's longest gap. `cargo xtask upgrade-test --from <rev>` runs
//! it with `<rev>` built in a worktree (`egress-lab --upgrade OLD NEW`).

use std::{fmt, path::PathBuf, thread, time::Duration};

use anyhow::{Context as _, Result, bail};

use super::{Target, TcpVerdict, Timing, flows::Flows, holders::Sampler, wait_steady};
use crate::{
    cluster,
    lab::{Lab, NODES},
    stream::{Summary, unix_ms},
};

/// One build of the agent.
#[derive(Clone, Debug)]
pub struct Build {
    /// How it is named in the table (`v0.1.0`, `HEAD`).
    pub label: String,
    pub bin: PathBuf,
    /// Started with the lab's liveness key (a build older than `--liveness-key-file`
    /// is not).
    pub keyed: bool,
}

/// One node's agent replaced, measured.
#[derive(Clone, Debug)]
pub struct StepReport {
    pub node: String,
    pub to: String,
    /// Holder sets of A over the step, as in [`super::CaseReport::holder_path`].
    pub holder_path: Vec<String>,
    /// Who held A when the flows stopped.
    pub end_holders: Vec<(String, String)>,
    pub two_holders_ms: u64,
    pub tcp: Summary,
    pub udp: Summary,
    pub ping: Summary,
    pub t_unix_ms: u64,
}

impl StepReport {
    pub fn tcp_verdict(&self) -> TcpVerdict {
        TcpVerdict::of(&self.tcp, self.t_unix_ms)
    }

    /// A stayed where it was, on one gateway.
    pub fn moved(&self) -> bool {
        self.holder_path.len() > 1
    }

    /// What the run holds a step to: nothing moved, never two holders, TCP unbroken.
    pub fn ok(&self) -> bool {
        !self.moved() && self.two_holders_ms == 0 && self.tcp_verdict() == TcpVerdict::Survived
    }

    pub fn header() -> String {
        format!(
            "{:<6} {:<10} {:<24} {:>10} {:>10} {:>10} {:>9} {:>10}",
            "node", "to", "holders of A", "2holders", "tcp", "tcp_gap", "udp_gap", "ping_lost"
        )
    }

    pub fn row(&self) -> String {
        let lost = self.ping.sent.saturating_sub(self.ping.received);
        format!(
            "{:<6} {:<10} {:<24} {:>8}ms {:>10} {:>8}ms {:>7}ms {:>10}",
            self.node,
            self.to,
            self.holder_path.join(" > "),
            self.two_holders_ms,
            self.tcp_verdict().to_string(),
            self.tcp.longest_gap_ms,
            self.udp.longest_gap_ms,
            format!("{lost}/{}", self.ping.sent),
        )
    }
}

impl fmt::Display for StepReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.row())
    }
}

/// The order a DaemonSet's rolling update takes here: workers, the gateways that do not
/// hold A, the holder last (the hardest case: the two-holder defect of a rollout).
pub fn order(lab: &Lab, target: &Target) -> Result<Vec<&'static str>> {
    let (holder, _) = cluster::holder(lab, target.egress)
        .with_context(|| format!("no gateway holds {}", target.egress))?;
    let mut out: Vec<&'static str> = NODES
        .iter()
        .filter(|n| !n.gateway)
        .map(|n| n.name)
        .collect();
    out.extend(
        NODES
            .iter()
            .filter(|n| n.gateway && n.name != holder)
            .map(|n| n.name),
    );
    out.extend(NODES.iter().filter(|n| n.name == holder).map(|n| n.name));
    Ok(out)
}

/// Replace every node's agent (running `from`) by `to`'s, in [`order`], one step each.
/// The lab must be steady; it is steady again after each step.
/// `each` sees every step's report as it is made.
pub fn roll(
    lab: &mut Lab,
    from: &Build,
    to: &Build,
    timing: &Timing,
    mut each: impl FnMut(&StepReport),
) -> Result<Vec<StepReport>> {
    let target = Target::of(lab.family());
    let nodes = order(lab, &target)?;
    let mut out = Vec::new();
    for node in nodes {
        let label = format!("upgrade-{}-{node}", to.label.replace(['/', '.'], "_"));
        let sampler = Sampler::start(lab, target.egress, timing.interval)?;
        let flows = Flows::start(lab, &target, timing, &label)?;
        thread::sleep(timing.before);
        if flows.tcp_progress().last_reply.is_none() {
            let seen = flows.stop()?;
            sampler.stop()?;
            bail!(
                "{node} ({} -> {}): the flows did not get through first (tcp: {:?})",
                from.label,
                to.label,
                seen.tcp.error
            );
        }
        let t = unix_ms();
        let replaced = lab
            .stop_agent(node)
            .and_then(|()| lab.start_agent_as(node, &to.bin, &[], to.keyed));
        // The new agent's first pass takes a second or two; then the flows go on.
        thread::sleep(timing.after + Duration::from_secs(2));
        let seen = flows.stop()?;
        let timeline = sampler.stop()?;
        replaced.with_context(|| format!("failed to replace the agent on {node}"))?;
        let report = StepReport {
            node: node.to_owned(),
            to: to.label.clone(),
            holder_path: timeline.path(t),
            end_holders: cluster::holders(lab, target.egress),
            two_holders_ms: timeline.two_holders_ms(),
            tcp: seen.tcp,
            udp: seen.udp,
            ping: seen.ping,
            t_unix_ms: t,
        };
        each(&report);
        out.push(report);
        wait_steady(lab, &target, timing).with_context(|| format!("after replacing {node}"))?;
        if let Some((n, status)) = lab.exited_agents().into_iter().next() {
            bail!("the agent on {n} exited ({status}): {}", lab.agent_log(&n));
        }
    }
    Ok(out)
}
