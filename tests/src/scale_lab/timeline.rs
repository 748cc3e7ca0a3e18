//! Where one event's time goes, agent by agent (issue 49): from each agent's log, when
//! its first pass that acted on the event began (the event heard) and ended (the maps
//! written), and what woke it; from its own metrics, how many passes it ran over the
//! event and how long they took (`egress_reconciles_total`,
//! `egress_reconcile_duration_seconds_sum`); from `/proc/<pid>/stat`, the CPU it spent.
//! [`sample`] before the event, [`measure`] once its traffic is back.

use std::time::Duration;

use super::{cost::TICKS_PER_SEC, percentile};
use crate::{bench::lab::at_scale::cpu_ticks, failover::rfc3339_unix_ms, lab::Lab};

/// One agent's counters at a moment.
#[derive(Clone, Copy, Debug, Default)]
struct Counters {
    pid: u32,
    ticks: u64,
    passes: u64,
    pass_secs: f64,
}

/// Every agent's counters before an event, by node.
#[derive(Clone, Debug, Default)]
pub struct Sample(Vec<(String, bool, Option<Counters>)>);

/// One agent over an event.
#[derive(Clone, Debug, Default)]
pub struct AgentTimes {
    pub node: String,
    pub gateway: bool,
    /// Event -> the first logged pass after it began and ended (a pass is logged when it
    /// changed something, or when the cluster state woke it), and what woke it.
    pub began_ms: Option<u64>,
    pub ended_ms: Option<u64>,
    pub trigger: Option<String>,
    /// Passes over the event, their time, and the CPU the agent spent (milliseconds);
    /// `None` for an agent that restarted meanwhile (the silent death's).
    pub passes: Option<u64>,
    pub pass_ms: Option<f64>,
    pub cpu_ms: Option<u64>,
}

/// Every agent over one event.
#[derive(Clone, Debug, Default)]
pub struct Timeline {
    pub agents: Vec<AgentTimes>,
    /// From the event to [`measure`].
    pub window: Duration,
}

/// One role's spread over an event: p50, p99 and max of the heard and written times,
/// mean and max of the passes, their time and the CPU.
#[derive(Clone, Debug, Default)]
pub struct RoleTimes {
    pub role: &'static str,
    pub agents: usize,
    /// Agents with no logged pass over the event.
    pub quiet: usize,
    pub began: (u64, u64, u64),
    pub ended: (u64, u64, u64),
    pub passes: (f64, u64),
    pub pass_ms: (f64, f64),
    pub cpu_ms: (f64, u64),
    /// What woke the first pass that acted, counted.
    pub triggers: Vec<(String, usize)>,
}

impl Timeline {
    /// Workers first, then gateways.
    pub fn roles(&self) -> Vec<RoleTimes> {
        [("worker", false), ("gateway", true)]
            .into_iter()
            .filter_map(|(role, gateway)| {
                let mine: Vec<&AgentTimes> = self
                    .agents
                    .iter()
                    .filter(|a| a.gateway == gateway)
                    .collect();
                (!mine.is_empty()).then(|| role_times(role, &mine))
            })
            .collect()
    }
}

fn role_times(role: &'static str, agents: &[&AgentTimes]) -> RoleTimes {
    let spread = |v: Vec<u64>| {
        (
            percentile(&v, 50),
            percentile(&v, 99),
            v.iter().copied().max().unwrap_or(0),
        )
    };
    let mean = |v: &[f64]| {
        if v.is_empty() {
            0.0
        } else {
            v.iter().sum::<f64>() / v.len() as f64
        }
    };
    let passes: Vec<u64> = agents.iter().filter_map(|a| a.passes).collect();
    let pass_ms: Vec<f64> = agents.iter().filter_map(|a| a.pass_ms).collect();
    let cpu: Vec<u64> = agents.iter().filter_map(|a| a.cpu_ms).collect();
    let mut triggers: Vec<(String, usize)> = Vec::new();
    for t in agents.iter().filter_map(|a| a.trigger.as_deref()) {
        match triggers.iter_mut().find(|(n, _)| n == t) {
            Some((_, c)) => *c += 1,
            None => triggers.push((t.to_owned(), 1)),
        }
    }
    RoleTimes {
        role,
        agents: agents.len(),
        quiet: agents.iter().filter(|a| a.began_ms.is_none()).count(),
        began: spread(agents.iter().filter_map(|a| a.began_ms).collect()),
        ended: spread(agents.iter().filter_map(|a| a.ended_ms).collect()),
        passes: (
            mean(&passes.iter().map(|p| *p as f64).collect::<Vec<_>>()),
            passes.iter().copied().max().unwrap_or(0),
        ),
        pass_ms: (mean(&pass_ms), pass_ms.iter().copied().fold(0.0, f64::max)),
        cpu_ms: (
            mean(&cpu.iter().map(|c| *c as f64).collect::<Vec<_>>()),
            cpu.iter().copied().max().unwrap_or(0),
        ),
        triggers,
    }
}

/// Every agent's counters now.
pub fn sample(lab: &Lab) -> Sample {
    Sample(
        lab.nodes()
            .iter()
            .map(|n| {
                let counters = lab.agent_pid(n.name).map(|pid| counters(lab, n.name, pid));
                (n.name.to_owned(), n.gateway, counters)
            })
            .collect(),
    )
}

fn counters(lab: &Lab, node: &str, pid: u32) -> Counters {
    let (passes, pass_secs) = scrape(lab, node).unwrap_or_default();
    Counters {
        pid,
        ticks: cpu_ticks(pid as i32),
        passes,
        pass_secs,
    }
}

/// The event at `t` (unix ms), `before` sampled just ahead of it: every agent's times.
pub fn measure(lab: &Lab, before: &Sample, t: u64) -> Timeline {
    let now = crate::stream::unix_ms();
    let agents = before
        .0
        .iter()
        .map(|(node, gateway, was)| {
            let first = first_pass(&lab.agent_log(node), t);
            let now = lab.agent_pid(node).map(|pid| counters(lab, node, pid));
            let same = match (was, now) {
                (Some(a), Some(b)) if a.pid == b.pid => Some((*a, b)),
                _ => None,
            };
            AgentTimes {
                node: node.clone(),
                gateway: *gateway,
                began_ms: first.as_ref().map(|p| p.began.saturating_sub(t)),
                ended_ms: first.as_ref().map(|p| p.ended.saturating_sub(t)),
                trigger: first.map(|p| p.trigger),
                passes: same.map(|(a, b)| b.passes.saturating_sub(a.passes)),
                pass_ms: same.map(|(a, b)| (b.pass_secs - a.pass_secs).max(0.0) * 1e3),
                cpu_ms: same.map(|(a, b)| {
                    (b.ticks.saturating_sub(a.ticks) as f64 * 1e3 / TICKS_PER_SEC) as u64
                }),
            }
        })
        .collect();
    Timeline {
        agents,
        window: Duration::from_millis(now.saturating_sub(t)),
    }
}

/// A logged pass: when it began and ended (unix ms), and what woke it.
#[derive(Clone, Debug, PartialEq)]
struct LoggedPass {
    began: u64,
    ended: u64,
    trigger: String,
}

/// The first pass of an agent log that began at or after `t` (unix ms): its
/// `reconciled trigger=".." changed=.. problems=.. took_ms=..` line.
fn first_pass(log: &str, t: u64) -> Option<LoggedPass> {
    log.lines().filter_map(logged_pass).find(|p| p.began >= t)
}

fn logged_pass(line: &str) -> Option<LoggedPass> {
    if !line.ends_with(" reconciled") && !line.contains(" reconciled ") {
        return None;
    }
    let ended = rfc3339_unix_ms(line.split_whitespace().next()?)?;
    let field = |k: &str| {
        line.split_whitespace()
            .find_map(|w| w.strip_prefix(k)?.strip_prefix('='))
    };
    let took: f64 = field("took_ms")?.parse().ok()?;
    Some(LoggedPass {
        began: ended.saturating_sub(took.round() as u64),
        ended,
        trigger: field("trigger")?.trim_matches('"').to_owned(),
    })
}

/// (`egress_reconciles_total`, `egress_reconcile_duration_seconds_sum`) from the agent's
/// `/metrics` on its status socket.
fn scrape(lab: &Lab, node: &str) -> Option<(u64, f64)> {
    let text = lab.agent_metrics(node).ok()?;
    let value = |name: &str| {
        text.lines()
            .find_map(|l| l.strip_prefix(name)?.strip_prefix(' '))
            .and_then(|v| v.trim().parse::<f64>().ok())
    };
    Some((
        value("egress_reconciles_total")? as u64,
        value("egress_reconcile_duration_seconds_sum")?,
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_logged_pass_is_read_and_the_first_after_the_event_found() {
        let log = "\
2026-12-06T00:09:20.352105Z  INFO egress_agent::agent: reconciled trigger=\"resync\" changed=13 problems=1 took_ms=1323.1429699999999
2026-12-06T00:09:21.056088Z  INFO egress_agent::agent::problems: resolved: policy payments
2026-12-06T00:09:21.077120Z  INFO egress_agent::agent: reconciled trigger=\"probe\" changed=6 problems=0 took_ms=699.20583
";
        let at = |s: &str| rfc3339_unix_ms(s).unwrap();
        let first = first_pass(log, at("2026-12-06T00:09:20.000000Z")).unwrap();
        assert_eq!(first.trigger, "probe");
        assert_eq!(first.ended, at("2026-12-06T00:09:21.077120Z"));
        assert_eq!(first.began, first.ended - 699);
        assert_eq!(first_pass(log, at("2026-12-06T00:09:21.000000Z")), None);
        assert_eq!(logged_pass("2026-12-06T00:09:21Z INFO x: resolved"), None);
    }

    #[test]
    fn roles_spread_their_agents_times() {
        let agent = |gateway: bool, began: Option<u64>, trigger: &str| AgentTimes {
            node: String::new(),
            gateway,
            began_ms: began,
            ended_ms: began.map(|b| b + 10),
            trigger: began.map(|_| trigger.to_owned()),
            passes: Some(2),
            pass_ms: Some(20.0),
            cpu_ms: Some(30),
        };
        let t = Timeline {
            agents: vec![
                agent(false, Some(100), "probe"),
                agent(false, Some(300), "probe"),
                agent(false, None, ""),
                agent(true, Some(50), "state"),
            ],
            window: Duration::from_secs(1),
        };
        let roles = t.roles();
        assert_eq!(roles.len(), 2);
        let w = &roles[0];
        assert_eq!((w.role, w.agents, w.quiet), ("worker", 3, 1));
        assert_eq!(w.began.2, 300);
        assert_eq!(w.ended.2, 310);
        assert_eq!(w.triggers, [("probe".to_owned(), 2)]);
        assert_eq!(w.cpu_ms, (30.0, 30));
        assert_eq!(roles[1].triggers, [("state".to_owned(), 1)]);
    }
}
