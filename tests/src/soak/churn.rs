//! The churn schedule: one event per period, round-robin over a cycle of policy edits
//! (harmless, broken and fixed), a selected pod removed and re-added, agents restarted
//! (SIGTERM) and killed (SIGKILL), and the holder of an egress IP failed and recovered in
//! the ways the failover runner knows (rotating over the cycles).

use std::{collections::BTreeMap, net::IpAddr, path::PathBuf};

use anyhow::{Context as _, Result};

use crate::{
    cluster,
    failover::{self, Kind},
    lab::{Lab, addr, sample_policy},
    stream::unix_ms,
};

/// Extra arguments of every agent the soak starts.
pub const AGENT_ARGS: [&str; 2] = ["--unknown-pods", "drop"];
/// A destination nobody sends to: added to rule A and removed again.
const SPARE_PREFIX: &str = "192.168.106.0/24";
/// After an event ends (a failure recovered, a pod re-added), packets and breaks within
/// this long still count as during it.
const AFTERMATH_MS: u64 = 3000;

/// The gateway failures the cycles rotate over (silent death is left out: its recovery
/// restarts the agent without the soak's arguments, and an agent kill is an event of its
/// own).
const GATEWAY_FAILURES: [Kind; 5] = [
    Kind::NotReady,
    Kind::UnderlayCut,
    Kind::Drain,
    Kind::SecondaryCut,
    Kind::GatewayPartition,
];

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Step {
    PolicyAddPrefix,
    PolicyRemovePrefix,
    PolicyUnparsable,
    PolicyInvalidCidr,
    PolicyFix,
    PodRemove,
    PodAdd,
    AgentRestart(&'static str),
    AgentKill(&'static str),
    /// Fail the holder of egress IP A (`false`) or B (`true`) the next way in turn.
    GatewayFail(bool),
    GatewayRecover,
}

/// One cycle. Agents are restarted on w2 and gw2 only: w1's and gw1's run the whole soak,
/// so that their memory is measured over it.
const CYCLE: [Step; 17] = [
    Step::PolicyAddPrefix,
    Step::PolicyRemovePrefix,
    Step::PodRemove,
    Step::PodAdd,
    Step::GatewayFail(false),
    Step::GatewayRecover,
    Step::PolicyUnparsable,
    Step::PolicyFix,
    // The pod's own node restarts its agent while the pod is unknown.
    Step::PodRemove,
    Step::AgentRestart("w2"),
    Step::PodAdd,
    Step::PolicyInvalidCidr,
    Step::PolicyFix,
    Step::AgentRestart("gw2"),
    Step::GatewayFail(true),
    Step::GatewayRecover,
    Step::AgentKill("w2"),
];

/// An event that happened, for the report and to name what was going on at a time.
#[derive(Clone, Debug)]
pub struct Event {
    pub start_ms: u64,
    /// When what it broke was repaired (a recovery, a re-add, a fix), else its own end.
    pub until_ms: u64,
    /// The kind, for the per-kind counts: `policy-edit`, `gateway-fail/notready`, ...
    pub kind: String,
    /// What exactly: `gateway-fail/notready gw1 (holder of 192.168.101.50)`.
    pub what: String,
}

/// The schedule and what it did.
pub(super) struct Churn {
    agent_bin: PathBuf,
    spare: &'static str,
    next: usize,
    failures_done: usize,
    /// The failure to recover: its kind, the holder, and its event's index.
    failed: Option<(Kind, (String, String), usize)>,
    /// The event that removed the spare pod or broke the policy, to close when repaired.
    pod_removed: Option<usize>,
    policy_broken: Option<usize>,
    pub(super) events: Vec<Event>,
    pub(super) errors: Vec<String>,
    /// Completed cycles.
    pub(super) cycles: u32,
}

impl Churn {
    pub(super) fn new(agent_bin: PathBuf, spare: &'static str) -> Self {
        Self {
            agent_bin,
            spare,
            next: 0,
            failures_done: 0,
            failed: None,
            pod_removed: None,
            policy_broken: None,
            events: Vec::new(),
            errors: Vec::new(),
            cycles: 0,
        }
    }

    /// Run the next event of the cycle.
    pub(super) fn step(&mut self, lab: &mut Lab) {
        let step = CYCLE[self.next];
        self.next = (self.next + 1) % CYCLE.len();
        if self.next == 0 {
            self.cycles += 1;
        }
        let start_ms = unix_ms();
        match self.apply(lab, step) {
            Ok((kind, what)) => {
                let end = unix_ms();
                self.events.push(Event {
                    start_ms,
                    until_ms: end,
                    kind,
                    what,
                });
            }
            Err(e) => {
                let msg = format!("{step:?}: {e:#}");
                eprintln!("soak: churn event failed: {msg}");
                self.errors.push(msg);
            }
        }
    }

    fn apply(&mut self, lab: &mut Lab, step: Step) -> Result<(String, String)> {
        let idx = self.events.len();
        let good = sample_policy();
        Ok(match step {
            Step::PolicyAddPrefix => {
                let listed = format!("- {}", addr::NET_A);
                let with: String = good
                    .lines()
                    .flat_map(|l| {
                        let extra =
                            (l.trim() == listed).then(|| l.replace(addr::NET_A, SPARE_PREFIX));
                        std::iter::once(l.to_owned()).chain(extra)
                    })
                    .map(|l| l + "\n")
                    .collect();
                anyhow::ensure!(with != good, "the sample policy lists network A");
                lab.write_policy(&with)?;
                (
                    "policy-edit".into(),
                    format!("policy: {SPARE_PREFIX} added to rule A"),
                )
            }
            Step::PolicyRemovePrefix => {
                lab.write_policy(&good)?;
                (
                    "policy-edit".into(),
                    format!("policy: {SPARE_PREFIX} removed"),
                )
            }
            Step::PolicyUnparsable => {
                lab.write_policy("apiVersion: egress.dev/v1alpha1\nkind: [EgressGatewayPolicy\n")?;
                self.policy_broken = Some(idx);
                ("policy-broken".into(), "policy: unparsable YAML".into())
            }
            Step::PolicyInvalidCidr => {
                let bad = good.replacen(addr::NET_A, "192.168.101.0/33", 1);
                lab.write_policy(&bad)?;
                self.policy_broken = Some(idx);
                (
                    "policy-broken".into(),
                    "policy: invalid CIDR 192.168.101.0/33 in rule A".into(),
                )
            }
            Step::PolicyFix => {
                lab.write_policy(&good)?;
                let i = self.policy_broken.take();
                self.close(i);
                ("policy-fix".into(), "policy: fixed".into())
            }
            Step::PodRemove => {
                lab.set_pod_announced(self.spare, false)?;
                self.pod_removed = Some(idx);
                (
                    "pod-remove".into(),
                    format!("pod {} removed (it keeps sending)", self.spare),
                )
            }
            Step::PodAdd => {
                lab.set_pod_announced(self.spare, true)?;
                let i = self.pod_removed.take();
                self.close(i);
                ("pod-add".into(), format!("pod {} re-added", self.spare))
            }
            Step::AgentRestart(node) => {
                lab.stop_agent(node)?;
                lab.start_agent(node, &self.agent_bin, &AGENT_ARGS)?;
                (
                    "agent-restart".into(),
                    format!("agent on {node}: SIGTERM, started"),
                )
            }
            Step::AgentKill(node) => {
                lab.kill_agent(node)?;
                lab.start_agent(node, &self.agent_bin, &AGENT_ARGS)?;
                (
                    "agent-kill".into(),
                    format!("agent on {node}: SIGKILL, started"),
                )
            }
            Step::GatewayFail(b) => {
                let ip: IpAddr = if b {
                    addr::EGRESS_IP_B.into()
                } else {
                    addr::EGRESS_IP_A.into()
                };
                let holders = cluster::holders(lab, ip);
                let [holder] = holders.as_slice() else {
                    return Ok((
                        "gateway-skipped".into(),
                        format!("no gateway failed: holders of {ip} {holders:?}"),
                    ));
                };
                let kind = GATEWAY_FAILURES[self.failures_done % GATEWAY_FAILURES.len()];
                self.failures_done += 1;
                let injected = failover::inject(lab, kind, holder);
                self.failed = Some((kind, holder.clone(), idx));
                injected.with_context(|| format!("{kind} on {}", holder.0))?;
                (
                    format!("gateway-fail/{kind}"),
                    format!("{kind} of {} (holder of {ip} on {})", holder.0, holder.1),
                )
            }
            Step::GatewayRecover => {
                let Some((kind, holder, i)) = self.failed.take() else {
                    return Ok(("gateway-skipped".into(), "nothing to recover".into()));
                };
                failover::recover(lab, kind, &holder)?;
                self.close(Some(i));
                (
                    "gateway-recover".into(),
                    format!("{kind} of {} recovered", holder.0),
                )
            }
        })
    }

    /// The event `i` lasted until now.
    fn close(&mut self, i: Option<usize>) {
        if let Some(e) = i.and_then(|i| self.events.get_mut(i)) {
            e.until_ms = unix_ms();
        }
    }

    /// End the churn: recover what is broken, re-add the pod, restore the policy, restart
    /// agents that are not running.
    pub(super) fn finish(&mut self, lab: &mut Lab) -> Result<()> {
        if let Some((kind, holder, i)) = self.failed.take() {
            failover::recover(lab, kind, &holder)?;
            self.close(Some(i));
        }
        lab.set_pod_announced(self.spare, true)?;
        let i = self.pod_removed.take();
        self.close(i);
        lab.write_policy(&sample_policy())?;
        let i = self.policy_broken.take();
        self.close(i);
        for node in lab.nodes().iter().map(|n| n.name).collect::<Vec<_>>() {
            if !lab.agent_running(node) {
                lab.start_agent(node, &self.agent_bin, &AGENT_ARGS)?;
            }
        }
        Ok(())
    }

    /// The event(s) in progress at `t` (within [`AFTERMATH_MS`] of their end), else the
    /// last one before it.
    pub(super) fn during(&self, t: u64) -> String {
        describe(&self.events, t)
    }

    /// Events per kind.
    pub(super) fn counts(&self) -> BTreeMap<String, u32> {
        let mut out = BTreeMap::new();
        for e in &self.events {
            *out.entry(e.kind.clone()).or_default() += 1;
        }
        out
    }
}

/// See [`Churn::during`].
pub fn describe(events: &[Event], t: u64) -> String {
    let active: Vec<String> = events
        .iter()
        .filter(|e| e.start_ms <= t && t <= e.until_ms + AFTERMATH_MS)
        .map(|e| format!("{} (+{} ms)", e.what, t - e.start_ms))
        .collect();
    if !active.is_empty() {
        return active.join("; ");
    }
    match events.iter().rev().find(|e| e.start_ms <= t) {
        Some(e) => format!("after {} (+{} ms)", e.what, t - e.start_ms),
        None => "before the first event".to_owned(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_cycle_undoes_what_it_breaks() {
        // Every failure is followed by its recovery; every broken policy by a fix.
        for w in CYCLE.windows(2) {
            if let Step::GatewayFail(_) = w[0] {
                assert_eq!(w[1], Step::GatewayRecover);
            }
            if matches!(w[0], Step::PolicyUnparsable | Step::PolicyInvalidCidr) {
                assert_eq!(w[1], Step::PolicyFix);
            }
        }
        // The pod is removed and re-added in turn, and there at the end of a cycle.
        let pod: Vec<Step> = CYCLE
            .iter()
            .copied()
            .filter(|s| matches!(s, Step::PodRemove | Step::PodAdd))
            .collect();
        assert!(pod.chunks(2).all(|c| c == [Step::PodRemove, Step::PodAdd]));
    }

    #[test]
    fn an_event_in_progress_names_the_time() {
        let ev = |start, until, what: &str| Event {
            start_ms: start,
            until_ms: until,
            kind: "k".into(),
            what: what.into(),
        };
        let events = [ev(1000, 5000, "fail"), ev(6000, 6010, "edit")];
        assert_eq!(describe(&events, 500), "before the first event");
        assert_eq!(describe(&events, 2000), "fail (+1000 ms)");
        assert_eq!(describe(&events, 6005), "fail (+5005 ms); edit (+5 ms)");
        assert_eq!(describe(&events, 20000), "after edit (+14000 ms)");
    }
}
