//! The churn soak (issue 13): traffic runs for N minutes through the lab while policies are
//! edited (harmless, broken and fixed), a selected pod is removed and re-added, agents are
//! restarted and killed, and gateways fail and recover; every second the far hosts'
//! captures are checked for a source other than the one expected there. At the end the
//! churn stops, the lab settles, and the maps, the agents' memory and the teardown are
//! checked. Shared by `cargo xtask soak --minutes N` (the `egress-soak` binary) and
//! `tests/tests/soak.rs` (two minutes).
//!
//! * Agents run with `--unknown-pods drop`; the primary network's router gets a leg on
//!   network A ([`Lab::connect_router_to`]), so a pod's packet that leaves its node
//!   untranslated reaches host-a with the pod's own address: a leak host-a would see.
//! * Long-lived flows ([`flows`]): TCP and UDP from selected pods to A and B, TCP and UDP
//!   from an unselected pod to C, and UDP every 20 ms from `w2-spare`, the selected pod
//!   the churn removes and re-adds (while it is unknown its packets must be dropped).
//! * New short flows ([`queries`]): `egress-echo query` one after another from three
//!   pods, about ten a second.
//! * Aborted connections ([`aborts`]): two selected pods of their own each open a TCP
//!   connection about three times a second and end it with a RST, by turns their own and
//!   the far host's; [`REUSE_POD`] always from the same source port (a reused tuple). Each
//!   also has a long-lived TCP stream, which runs on after the aborts stop: their live
//!   flows on the gateways must come back to their floor ([`floor`]: that stream, and
//!   what the churn stranded) within the reset timeout and the sweeper's walk (issue 45,
//!   item 3).
//! * Expected at the far hosts: host-a only egress IP A, host-b only egress IP B, host-c
//!   only the unselected pods that talk to it; anything else is a [`Violation`].

mod aborts;
mod capture;
mod churn;
mod floor;
mod report;
mod state;
mod traffic;

use std::{
    collections::BTreeMap,
    net::IpAddr,
    thread,
    time::{Duration, Instant},
};

use anyhow::{Context as _, Result};
use egress_agent::datapath::sweep;
use egress_common::counters::reason::DROP_UNKNOWN_POD;

use self::{aborts::Aborters, capture::Capture, churn::Churn, state::Remains, traffic::Queries};
pub use self::{
    aborts::{AbortReport, AbortSpec},
    capture::Violation,
    churn::{AGENT_ARGS, Event},
    floor::{Floor, PodFlows},
    state::{MapCounts, Rss, RssSummary},
    traffic::{Break, FlowReport, FlowSpec, QueryCounts, QuerySpec, WrongAnswer},
};
use crate::{
    cluster::{self, agent_bin, default_spec},
    failover::{self, Target, Timing},
    lab::{Family, Lab, PAYMENTS, PodSpec, Proto, addr},
    stream::unix_ms,
};

/// The selected pod that the churn removes and re-adds; it streams to host-a throughout.
pub const SPARE: &str = "w2-spare";
/// A selected pod that only aborts connections, each from a new source port.
pub const ABORT_POD: &str = "w1-abort";
/// A selected pod that only aborts connections, all from [`REUSED_PORT`].
pub const REUSE_POD: &str = "w2-reuse";
pub const REUSED_PORT: u16 = 41_000;
/// Nodes whose agents the churn never restarts: their memory growth is held to the target.
pub const STEADY_AGENTS: [&str; 2] = ["w1", "gw1"];
/// Target: an agent's resident memory grows by at most this much over the soak.
pub const RSS_GROWTH_LIMIT_PCT: f64 = 10.0;

/// How long and how busy.
#[derive(Clone, Debug)]
pub struct Config {
    pub duration: Duration,
    /// Between two churn events.
    pub period: Duration,
    /// Between two queries of one pod.
    pub query_pause: Duration,
    /// Between two memory samples.
    pub rss_every: Duration,
    /// The first memory sample that counts is the first after this (or after the first
    /// churn cycle, if that is earlier).
    pub warm_up: Duration,
    /// At most this long for the lab to be steady after the churn.
    pub steady_timeout: Duration,
    /// At most this long for the maps to come back (UDP conntrack entries idle out after
    /// 120 s, closed TCP ones after 30 s; the sweeper runs every 2 s).
    pub sweep_timeout: Duration,
}

impl Config {
    pub fn minutes(n: u64) -> Self {
        Self {
            duration: Duration::from_secs(n * 60),
            period: Duration::from_secs(3),
            query_pause: Duration::from_millis(100),
            rss_every: Duration::from_secs(10),
            warm_up: Duration::from_secs(60),
            steady_timeout: Duration::from_secs(90),
            sweep_timeout: Duration::from_secs(240),
        }
    }
}

/// Everything the soak saw; [`Report::ok`] says whether every target was met.
#[derive(Clone, Debug, Default)]
pub struct Report {
    pub prefix: String,
    pub churn_secs: f64,
    pub total_secs: f64,
    pub cycles: u32,
    pub events: Vec<Event>,
    pub events_by_kind: BTreeMap<String, u32>,
    pub churn_errors: Vec<String>,
    pub flows: Vec<FlowReport>,
    pub queries: Vec<((&'static str, Proto, IpAddr), QueryCounts)>,
    pub aborts: Vec<AbortReport>,
    /// Live flows of every pod on every node (`FLOWS_V4`): at their highest while the
    /// traffic ran (sampled every second), and when the aborting pods' were at their floor.
    pub flows_peak: u32,
    pub flows_at_floor: u32,
    /// IP packets captured per far host, and what tcpdump said it dropped.
    pub packets: Vec<(&'static str, u64, u64)>,
    pub violations: Vec<Violation>,
    pub wrong_answers: Vec<WrongAnswer>,
    /// The spare pod's packets dropped as DROP_UNKNOWN_POD on its node.
    pub unknown_pod_drops: u64,
    pub maps_start: MapCounts,
    pub maps_end: MapCounts,
    /// From the end of the traffic until the maps were back (`None`: they were not).
    pub maps_back_after: Option<Duration>,
    pub rss: BTreeMap<String, RssSummary>,
    pub leftovers: Vec<String>,
    /// Anything else that went wrong (the lab not steady, an agent that exited, ...).
    pub problems: Vec<String>,
}

impl Report {
    /// Sources other than the expected ones: at the far hosts, in query answers, or in the
    /// streams' echoes.
    pub fn wrong_sources(&self) -> usize {
        self.violations.len()
            + self.wrong_answers.len()
            + self
                .flows
                .iter()
                .map(|f| f.wrong_sources.len())
                .sum::<usize>()
            + self
                .aborts
                .iter()
                .map(|a| a.wrong_sources().len())
                .sum::<usize>()
    }

    /// Every aborting pod aborted, its flows were counted (the peak above the floor), and
    /// they came back to the floor in time; the churn stranded no more than one flow per
    /// event ([`floor`]).
    pub fn aborts_ok(&self) -> bool {
        !self.aborts.is_empty()
            && self.aborts.iter().all(|a| {
                a.summary.as_ref().is_some_and(|s| s.connections > 0)
                    && a.peak > a.floor.total()
                    && a.at_floor_after.is_some()
                    && a.floor.stranded as usize <= self.events.len()
            })
    }

    pub fn breaks(&self) -> Vec<&Break> {
        self.flows.iter().flat_map(|f| &f.breaks).collect()
    }

    pub fn rss_ok(&self) -> bool {
        STEADY_AGENTS.iter().all(|n| {
            self.rss
                .get(*n)
                .is_some_and(|r| !r.restarted && r.growth_pct() <= RSS_GROWTH_LIMIT_PCT)
        })
    }

    /// Every target met.
    pub fn ok(&self) -> bool {
        self.wrong_sources() == 0
            && self.breaks().is_empty()
            && self.maps_back_after.is_some()
            && self.aborts_ok()
            && self.rss_ok()
            && self.leftovers.is_empty()
            && self.churn_errors.is_empty()
            && self.problems.is_empty()
    }
}

/// Hosts A, B, C and egress IPs A, B.
struct Ends {
    a: IpAddr,
    b: IpAddr,
    c: IpAddr,
    ea: IpAddr,
    eb: IpAddr,
}

impl Ends {
    const V4: Ends = Ends {
        a: IpAddr::V4(addr::HOST_A),
        b: IpAddr::V4(addr::HOST_B),
        c: IpAddr::V4(addr::HOST_C),
        ea: IpAddr::V4(addr::EGRESS_IP_A),
        eb: IpAddr::V4(addr::EGRESS_IP_B),
    };
}

/// The long-lived flows.
pub fn flows() -> Vec<FlowSpec> {
    let Ends { a, b, c, ea, eb } = Ends::V4;
    let own = IpAddr::V4(addr::W1_P2);
    let f = |name, pod, proto, host, expect, interval_ms| FlowSpec {
        name,
        pod,
        proto,
        host,
        expect,
        interval_ms,
    };
    vec![
        f("tcp-w1-a", "w1-p1", Proto::Tcp, a, ea, 100),
        f("tcp-w2-b", "w2-p1", Proto::Tcp, b, eb, 100),
        f("tcp-gw1-b", "gw1-p1", Proto::Tcp, b, eb, 100),
        f("udp-w2-a", "w2-p1", Proto::Udp, a, ea, 100),
        f("udp-w1-b", "w1-p1", Proto::Udp, b, eb, 100),
        f("tcp-p2-c", "w1-p2", Proto::Tcp, c, own, 100),
        f("udp-p2-c", "w1-p2", Proto::Udp, c, own, 100),
        f("udp-spare-a", SPARE, Proto::Udp, a, ea, 20),
        // The aborting pods' own (to A: the reused port's tuple is toward B), stopped
        // only after their floor is seen.
        f("tcp-abort-a", ABORT_POD, Proto::Tcp, a, ea, 100),
        f("tcp-reuse-a", REUSE_POD, Proto::Tcp, a, ea, 100),
    ]
}

/// The aborting pods: one to host-a from a new port each time, one to host-b from
/// [`REUSED_PORT`] each time.
pub fn aborts() -> Vec<AbortSpec> {
    let Ends { a, b, ea, eb, .. } = Ends::V4;
    vec![
        AbortSpec {
            name: "abort-w1-a",
            pod: ABORT_POD,
            host: a,
            expect: ea,
            sport: None,
            interval_ms: 300,
        },
        AbortSpec {
            name: "reuse-w2-b",
            pod: REUSE_POD,
            host: b,
            expect: eb,
            sport: Some(REUSED_PORT),
            interval_ms: 300,
        },
    ]
}

/// The short flows.
pub fn queries() -> Vec<QuerySpec> {
    let Ends { a, b, c, ea, eb } = Ends::V4;
    let other = IpAddr::V4(addr::W2_P2);
    vec![
        QuerySpec {
            pod: "w1-p1",
            targets: vec![
                (Proto::Tcp, a, ea),
                (Proto::Udp, b, eb),
                (Proto::Udp, a, ea),
                (Proto::Tcp, b, eb),
            ],
        },
        QuerySpec {
            pod: "gw1-p1",
            targets: vec![(Proto::Udp, a, ea), (Proto::Tcp, b, eb)],
        },
        QuerySpec {
            pod: "w2-p2",
            targets: vec![(Proto::Tcp, c, other), (Proto::Udp, c, other)],
        },
    ]
}

/// Bring up the lab (with [`SPARE`], the aborting pods and a router leg on A), agents
/// with [`AGENT_ARGS`]; converged when both egress IPs are held and the selected pods,
/// the spare and the aborting ones among them, get through with them.
fn lab_up() -> Result<Lab> {
    let mut spec = default_spec()?;
    for (pod, node) in [(SPARE, "w2"), (ABORT_POD, "w1"), (REUSE_POD, "w2")] {
        spec.pods
            .push(PodSpec::new(pod, PAYMENTS, node, &[("app", "api")]));
    }
    let mut lab = Lab::up(spec)?;
    lab.connect_router_to('a')?;
    let bin = agent_bin()?;
    for node in lab.nodes().iter().map(|n| n.name).collect::<Vec<_>>() {
        lab.start_agent(node, &bin, &AGENT_ARGS)?;
    }
    let (ea, eb) = (IpAddr::V4(addr::EGRESS_IP_A), IpAddr::V4(addr::EGRESS_IP_B));
    cluster::wait_until(Duration::from_secs(60), || {
        cluster::holders(&lab, ea).len() == 1
            && cluster::holders(&lab, eb).len() == 1
            && ["w1-p1", "w2-p1", "gw1-p1", SPARE, ABORT_POD, REUSE_POD]
                .iter()
                .all(|pod| {
                    cluster::seen(&lab, pod, Proto::Udp, addr::HOST_A) == Some(ea)
                        && cluster::seen(&lab, pod, Proto::Tcp, addr::HOST_B) == Some(eb)
                })
    })
    .with_context(|| format!("agents did not converge; w2 log:\n{}", lab.agent_log("w2")))?;
    Ok(lab)
}

/// Run the soak; `Err` only when it could not run at all (the lab did not come up).
pub fn run(cfg: &Config) -> Result<Report> {
    let t0 = Instant::now();
    let mut lab = lab_up()?;
    let mut r = Report {
        prefix: lab.prefix().to_owned(),
        ..Report::default()
    };
    eprintln!(
        "soak: lab {} up with agents ({}) in {:.0}s; logs in {}",
        lab.prefix(),
        AGENT_ARGS.join(" "),
        t0.elapsed().as_secs_f64(),
        lab.dir().display()
    );
    let remains = Remains::of(&lab);
    r.maps_start = MapCounts::read(&lab)?;

    let far = [
        ("host-a", addr::HOST_A, vec![IpAddr::V4(addr::EGRESS_IP_A)]),
        ("host-b", addr::HOST_B, vec![IpAddr::V4(addr::EGRESS_IP_B)]),
        (
            "host-c",
            addr::HOST_C,
            vec![IpAddr::V4(addr::W1_P2), IpAddr::V4(addr::W2_P2)],
        ),
    ];
    let mut captures = far
        .into_iter()
        .map(|(host, dst, expect)| Capture::start(&lab, host, dst, expect))
        .collect::<Result<Vec<_>>>()?;
    thread::sleep(Duration::from_millis(700));

    let cap = cfg.duration + Duration::from_secs(600);
    let mut streams = traffic::Streams::start(&lab, &flows(), cap)?;
    let queries = Queries::start(&lab, &queries(), cfg.query_pause)?;
    let aborters = Aborters::start(&lab, &aborts(), cap)?;
    let mut peaks = Peaks::default();
    let mut churn = Churn::new(agent_bin()?, SPARE);
    let mut rss = Rss::default();

    let start = Instant::now();
    let start_ms = unix_ms();
    let mut next_event = start + cfg.period;
    let mut next_rss = start;
    let mut warm_ms = start_ms + cfg.warm_up.as_millis() as u64;
    let mut last_progress = start;
    while start.elapsed() < cfg.duration {
        thread::sleep(Duration::from_secs(1));
        check(&mut r, &mut captures, &mut streams, &queries, &churn, &lab);
        peaks.sample(&lab, &mut r);
        for (node, status) in lab.exited_agents() {
            let msg = format!("agent on {node} exited on its own ({status})");
            eprintln!("soak: {msg}; restarting it");
            r.problems.push(msg);
            let _ = lab.stop_agent(&node);
            let _ = lab.start_agent(&node, &agent_bin()?, &AGENT_ARGS);
        }
        if Instant::now() >= next_rss {
            rss.sample(&lab);
            next_rss += cfg.rss_every;
        }
        if Instant::now() >= next_event {
            let cycles = churn.cycles;
            churn.step(&mut lab);
            if cycles == 0 && churn.cycles == 1 {
                warm_ms = warm_ms.min(unix_ms());
            }
            next_event = Instant::now() + cfg.period;
        }
        if last_progress.elapsed() >= Duration::from_secs(60) {
            last_progress = Instant::now();
            eprintln!(
                "soak: {:.0}/{:.0} min, {} events, {} wrong sources, {} stream breaks",
                start.elapsed().as_secs_f64() / 60.0,
                cfg.duration.as_secs_f64() / 60.0,
                churn.events.len(),
                r.wrong_sources(),
                streams.breaks(),
            );
        }
    }
    r.churn_secs = start.elapsed().as_secs_f64();

    // The churn stops: repair what it left, and wait for the lab to be steady.
    if let Err(e) = churn.finish(&mut lab) {
        r.problems.push(format!("failed to end the churn: {e:#}"));
    }
    let timing = Timing {
        steady_timeout: cfg.steady_timeout,
        ..Timing::default()
    };
    if let Err(e) = failover::wait_steady(&lab, &Target::of(Family::V4), &timing) {
        r.problems
            .push(format!("not steady after the churn: {e:#}"));
    }
    let steady_ns = sweep::now_ns();
    check(&mut r, &mut captures, &mut streams, &queries, &churn, &lab);
    peaks.sample(&lab, &mut r);

    // The traffic stops: the aborts first, then all but the aborting pods' streams.
    let aborted = aborters.stop();
    let aborts_stopped = Instant::now();
    let aborting = |f: &FlowSpec| aborts().iter().any(|a| a.pod == f.pod);
    streams.stop_where(|f| !aborting(f));
    r.queries = queries.stop();
    thread::sleep(Duration::from_secs(1));
    for c in &mut captures {
        r.violations.extend(c.stop(|t| churn.during(t)));
        r.packets.push((c.host, c.packets, c.dropped_by_kernel));
    }
    let traffic_end = Instant::now();

    // The aborting pods' flows come back to their floor, their streams still running
    // (while the maps below cannot be back yet: they wait for every entry to be a minute
    // idle, and for the UDP streams' to time out).
    for (spec, summary) in aborted {
        let summary = summary.map_err(|e| r.problems.push(format!("{e:#}"))).ok();
        let pod = lab.pod(spec.pod)?.ip;
        r.aborts.push(AbortReport {
            floor: Floor {
                long_lived: long_lived(&lab, spec.pod)?,
                stranded: 0,
            },
            peak: peaks.by_pod.get(&pod).copied().unwrap_or(0),
            spec,
            summary,
            end: 0,
            flows: PodFlows::default(),
            at_floor_after: None,
        });
    }
    if let Err(e) = to_floor(&lab, &mut r, steady_ns, aborts_stopped) {
        r.problems.push(format!("{e:#}"));
    }
    r.flows = streams.stop(|t| churn.during(t));

    // The maps come back to the start's counts.
    loop {
        match MapCounts::read(&lab) {
            Ok(m) => {
                let back = m.back_to(&r.maps_start);
                r.maps_end = m;
                if back {
                    r.maps_back_after = Some(traffic_end.elapsed());
                    break;
                }
            }
            Err(e) => {
                r.problems.push(format!("{e:#}"));
                break;
            }
        }
        if traffic_end.elapsed() > cfg.sweep_timeout {
            break;
        }
        rss.sample(&lab);
        thread::sleep(Duration::from_secs(5));
    }
    rss.sample(&lab);
    r.rss = rss.summary(warm_ms);
    r.unknown_pod_drops = cluster::counted(&lab, "w2", DROP_UNKNOWN_POD);
    for (node, status) in lab.exited_agents() {
        r.problems
            .push(format!("agent on {node} exited on its own ({status})"));
    }
    r.problems.extend(failed_attachments(&lab));
    r.cycles = churn.cycles;
    r.events_by_kind = churn.counts();
    r.churn_errors = std::mem::take(&mut churn.errors);
    r.events = std::mem::take(&mut churn.events);

    // Teardown, and what it left.
    lab.stop_agents();
    if let Err(e) = lab.down() {
        r.problems.push(format!("{e:#}"));
    }
    r.leftovers = remains.left();
    r.total_secs = t0.elapsed().as_secs_f64();
    Ok(r)
}

/// Live flows (`FLOWS_V4`, summed over the nodes) at their highest: per pod, and of
/// every pod.
#[derive(Default)]
struct Peaks {
    by_pod: BTreeMap<std::net::Ipv4Addr, u32>,
}

impl Peaks {
    fn sample(&mut self, lab: &Lab, r: &mut Report) {
        let Ok(counted) = floor::counted(lab) else {
            return;
        };
        for (pod, n) in &counted {
            let p = self.by_pod.entry(*pod).or_default();
            *p = (*p).max(*n);
        }
        r.flows_peak = r.flows_peak.max(counted.values().sum());
    }
}

/// The long-lived flows of `pod` through a gateway (translated: the far host sees another
/// address than the pod's); the aborting pods' run until their floor is seen.
fn long_lived(lab: &Lab, pod: &str) -> Result<u32> {
    let ip = IpAddr::V4(lab.pod(pod)?.ip);
    Ok(flows()
        .iter()
        .filter(|f| f.pod == pod && f.expect != ip)
        .count() as u32)
}

/// Look at the aborting pods' flows every half second until each pod's count is at its
/// floor, or [`floor::WITHIN`] has passed since the aborts stopped; fills the reports.
fn to_floor(lab: &Lab, r: &mut Report, steady_ns: u64, stopped: Instant) -> Result<()> {
    let pods = r
        .aborts
        .iter()
        .map(|a| Ok(lab.pod(a.spec.pod)?.ip))
        .collect::<Result<Vec<_>>>()?;
    loop {
        let counted = floor::counted(lab)?;
        let flows = floor::pod_flows(lab, &pods, steady_ns)?;
        for (a, pod) in r.aborts.iter_mut().zip(&pods) {
            if a.at_floor_after.is_some() {
                continue;
            }
            a.end = counted.get(pod).copied().unwrap_or(0);
            a.flows = flows.get(pod).copied().unwrap_or_default();
            a.floor.stranded = a.flows.stranded;
            if a.floor.holds(a.end) {
                a.at_floor_after = Some(stopped.elapsed());
            }
        }
        r.flows_at_floor = counted.values().sum();
        if r.aborts.iter().all(|a| a.at_floor_after.is_some()) || stopped.elapsed() > floor::WITHIN
        {
            return Ok(());
        }
        thread::sleep(Duration::from_millis(500));
    }
}

/// Programs an agent failed to attach, from the agents' logs: a program the datapath
/// lacks (the soak once had `from_secondary` attached only through a dying agent's own
/// reference, and its exit let the gateway's kernel reset streams).
fn failed_attachments(lab: &Lab) -> Vec<String> {
    let mut out = Vec::new();
    for node in ["w1", "w2", "gw1", "gw2"] {
        let log = std::fs::read_to_string(lab.agent_log_path(node)).unwrap_or_default();
        let failed = log
            .lines()
            .filter(|l| l.contains("failed to attach"))
            .count();
        if failed > 0 {
            out.push(format!(
                "agent on {node}: {failed} log lines say a program failed to attach ({})",
                lab.agent_log_path(node).display()
            ));
        }
    }
    out
}

/// The per-second check: captures, broken streams (restarted), wrong answers; each
/// violation printed as it is found, with the churn event in progress.
fn check(
    r: &mut Report,
    captures: &mut [Capture],
    streams: &mut traffic::Streams,
    queries: &Queries,
    churn: &Churn,
    lab: &Lab,
) {
    let during = |t: u64| churn.during(t);
    for c in captures.iter_mut() {
        for v in c.poll(during) {
            eprintln!(
                "soak: WRONG SOURCE at {} ms: {} saw {} during {}: {}",
                v.at_ms, v.host, v.source, v.during, v.line
            );
            r.violations.push(v);
        }
    }
    for b in streams.poll(lab, during) {
        eprintln!(
            "soak: TCP STREAM BROKE at {} ms: {} ({}) during {}; restarted",
            b.at_ms, b.flow, b.why, b.during
        );
    }
    for w in queries.take_wrong() {
        eprintln!(
            "soak: WRONG ANSWER at {} ms: {} {} saw {} during {}",
            w.at_ms,
            w.pod,
            w.target,
            w.seen,
            churn.during(w.at_ms)
        );
        r.wrong_answers.push(w);
    }
}
