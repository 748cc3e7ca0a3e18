//! The events of a run, each measured at the far side from every worker: a holder that
//! fails (silently, or by drain) under a TCP stream from every worker's selected pod, and
//! a policy edit or a gateway route under a UDP stream from each, timed until the far
//! host sees the new source from that node.

use std::{
    net::{IpAddr, Ipv4Addr, SocketAddr},
    path::PathBuf,
    time::{Duration, Instant},
};

use anyhow::{Context as _, Result, bail};
use serde_json::json;

use super::{
    Options, check, percentile,
    timeline::{self, Timeline},
};
use crate::{
    cluster,
    failover::{self, Kind},
    lab::{GatewayRoute, Lab, addr, payments_policy},
    netns::NsChild,
    stream::{Recovery, Summary, unix_ms},
};

/// Rule A's egress IP after the policy edit.
pub const EDITED_EGRESS_IP: Ipv4Addr = Ipv4Addr::new(192, 168, 101, 51);
/// Between two lines of a failover's TCP streams.
const TCP_INTERVAL_MS: u64 = 100;
/// Between two datagrams (each a new flow) of a propagation's UDP streams.
const UDP_INTERVAL_MS: u64 = 100;
/// A gap between replies longer than this counts as an interruption.
const MIN_GAP_MS: u64 = 3 * TCP_INTERVAL_MS;

/// How the holder fails.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum How {
    /// Agent SIGKILLed, its underlay and secondary links down, its Node still Ready.
    Silent,
    /// The Node gets `egress.dev/drain=true` (a planned move).
    Drain,
}

impl How {
    fn kind(self) -> Kind {
        match self {
            How::Silent => Kind::SilentDeath,
            How::Drain => Kind::Drain,
        }
    }
}

/// Per node: milliseconds from the event until its traffic was back (or showed the
/// change); `None`: never, within the event's time.
#[derive(Clone, Debug, Default)]
pub struct NodeTimes(pub Vec<(String, Option<u64>)>);

impl NodeTimes {
    pub fn missing(&self) -> Vec<&str> {
        self.0
            .iter()
            .filter(|(_, t)| t.is_none())
            .map(|(n, _)| n.as_str())
            .collect()
    }

    fn times(&self) -> Vec<u64> {
        self.0.iter().filter_map(|(_, t)| *t).collect()
    }

    /// (p50, p99, max, min) over the nodes that got there.
    pub fn spread(&self) -> (u64, u64, u64, u64) {
        let t = self.times();
        (
            percentile(&t, 50),
            percentile(&t, 99),
            t.iter().copied().max().unwrap_or(0),
            t.iter().copied().min().unwrap_or(0),
        )
    }

    /// The node that took longest.
    pub fn slowest(&self) -> Option<(&str, u64)> {
        self.0
            .iter()
            .filter_map(|(n, t)| t.map(|t| (n.as_str(), t)))
            .max_by_key(|(_, t)| *t)
    }
}

/// A holder's failure, seen from every worker.
#[derive(Clone, Debug, Default)]
pub struct Failover {
    pub how: String,
    pub from: String,
    /// The gateways holding the egress IP once every worker was back.
    pub to: Vec<String>,
    /// Event -> the reply that ended each worker's worst gap (0: no gap).
    pub back: NodeTimes,
    /// Workers whose TCP stream was reset or failed.
    pub broken: Vec<String>,
    pub streams: usize,
    /// Where the time went, agent by agent.
    pub timeline: Timeline,
}

impl Failover {
    pub fn failures(&self) -> Vec<String> {
        let mut out = Vec::new();
        if !self.broken.is_empty() {
            out.push(format!(
                "{}: TCP streams broken on {}",
                self.how,
                self.broken.join(", ")
            ));
        }
        let missing = self.back.missing();
        if !missing.is_empty() {
            out.push(format!(
                "{}: traffic not back on {}",
                self.how,
                missing.join(", ")
            ));
        }
        if self.to.len() != 1 || self.to.contains(&self.from) {
            out.push(format!(
                "{}: egress IP A held by {:?} afterwards (failed: {})",
                self.how, self.to, self.from
            ));
        }
        out
    }
}

/// A change, timed until each node's traffic shows it at the far host.
#[derive(Clone, Debug, Default)]
pub struct Propagation {
    pub what: String,
    pub shown: NodeTimes,
    /// Where the time went, agent by agent.
    pub timeline: Timeline,
}

impl Propagation {
    pub fn failures(&self) -> Vec<String> {
        let missing = self.shown.missing();
        if missing.is_empty() {
            return Vec::new();
        }
        vec![format!(
            "{}: never shown on {}",
            self.what,
            missing.join(", ")
        )]
    }
}

/// One worker's stream: its process, output and events file.
struct Stream {
    node: String,
    child: NsChild,
    log: PathBuf,
    events: PathBuf,
}

/// A stream from every worker's selected pod to `host`: TCP, or UDP with a new flow per
/// datagram (`udp`: an established flow keeps its gateway and translation by design, so
/// a change shows on new flows).
fn start_streams(lab: &Lab, proto: &str, host: IpAddr, label: &str) -> Result<Vec<Stream>> {
    let interval = if proto == "tcp" {
        TCP_INTERVAL_MS
    } else {
        UDP_INTERVAL_MS
    };
    let target = SocketAddr::new(host, addr::ECHO_PORT).to_string();
    let mut out = Vec::new();
    for pod in lab.pods().iter().filter(|p| check::selected(p)) {
        let log = lab.dir().join(format!("{label}-{}.log", pod.name));
        let events = lab.dir().join(format!("{label}-{}.events", pod.name));
        let interval = interval.to_string();
        let events_arg = events.to_string_lossy();
        let mut args = vec![
            "stream",
            proto,
            &target,
            "--interval-ms",
            &interval,
            "--duration-ms",
            "600000",
            "--events",
            &events_arg,
        ];
        if proto == "udp" {
            args.push("--new-flows");
        }
        let child = lab
            .ns(&pod.name)?
            .spawn(&lab.spec().echo_bin, &args, &log)?;
        out.push(Stream {
            node: pod.node.clone(),
            child,
            log,
            events,
        });
    }
    Ok(out)
}

/// The replies in a stream's events file so far: (unix ms, source address).
fn replies(events: &PathBuf) -> Vec<(u64, IpAddr)> {
    let text = std::fs::read_to_string(events).unwrap_or_default();
    text.lines()
        .filter_map(|l| {
            let mut w = l.split_whitespace();
            let at = w.next()?.parse().ok()?;
            (w.next()? == "reply").then_some(())?;
            let src: SocketAddr = w.nth(1)?.parse().ok()?;
            Some((at, src.ip()))
        })
        .collect()
}

/// Wait until every stream has had a reply from `source` (any, if `None`) at or after
/// `since`, and its latest reply is recent; or until `timeout`.
fn wait_flowing(streams: &[Stream], since: u64, source: Option<IpAddr>, timeout: Duration) {
    let deadline = Instant::now() + timeout;
    while Instant::now() < deadline {
        let now = unix_ms();
        let all = streams.iter().all(|s| {
            let r = replies(&s.events);
            let fresh = r
                .last()
                .is_some_and(|(at, _)| now.saturating_sub(*at) < 500);
            fresh
                && r.iter()
                    .any(|(at, ip)| *at >= since && source.is_none_or(|s| s == *ip))
        });
        if all {
            return;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// Stop the streams and read their summaries (node, summary).
fn stop_streams(streams: Vec<Stream>) -> Result<Vec<(String, Summary, PathBuf)>> {
    let mut streams = streams;
    streams.iter_mut().for_each(|s| s.child.signal_term());
    let mut out = Vec::new();
    for mut s in streams {
        s.child.wait_for(Duration::from_secs(5))?;
        let text = std::fs::read_to_string(&s.log)
            .with_context(|| format!("failed to read {}", s.log.display()))?;
        let summary = Summary::find_in(&text)
            .with_context(|| format!("{}: no stream summary in {}", s.node, s.log.display()))?;
        out.push((s.node, summary, s.events));
    }
    Ok(out)
}

/// Fail the holder of egress IP A `how`, with a TCP stream from every worker through it;
/// then undo the failure and wait until the lab is steady again.
pub fn fail_holder(lab: &mut Lab, how: How, opts: &Options) -> Result<Failover> {
    let ip = IpAddr::from(addr::EGRESS_IP_A);
    let holder = cluster::holder(lab, ip).context("egress IP A has no holder")?;
    let label = format!("scale-{:?}", how).to_lowercase();
    let streams = start_streams(lab, "tcp", addr::HOST_A.into(), &label)?;
    let n = streams.len();
    wait_flowing(&streams, 0, Some(ip), Duration::from_secs(30));
    std::thread::sleep(Duration::from_secs(1));
    let before = timeline::sample(lab);
    let t = unix_ms();
    eprintln!("scale lab: {how:?}: {} fails (holder of {ip})", holder.0);
    failover::inject(lab, how.kind(), &holder)?;
    // Moved first (a drain is a Node edit every agent must read), then flowing.
    let deadline = Instant::now() + opts.event_timeout;
    while Instant::now() < deadline {
        let now = cluster::holders(lab, ip);
        if now.len() == 1 && now[0].0 != holder.0 {
            break;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    wait_flowing(
        &streams,
        t + 1,
        Some(ip),
        deadline.saturating_duration_since(Instant::now()),
    );
    // Long enough to see a second interruption, if there is one.
    std::thread::sleep(Duration::from_secs(2));
    let timeline = timeline::measure(lab, &before, t);
    let to: Vec<String> = cluster::holders(lab, ip).into_iter().map(|h| h.0).collect();
    let seen = stop_streams(streams)?;
    let mut report = Failover {
        how: match how {
            How::Silent => "silent death".to_owned(),
            How::Drain => "drain".to_owned(),
        },
        from: holder.0.clone(),
        to,
        streams: n,
        timeline,
        ..Failover::default()
    };
    for (node, s, events) in &seen {
        if !s.unbroken() {
            report.broken.push(node.clone());
            eprint!(
                "{}",
                tell_broken(lab, opts, node, events, t, &holder.0, &report.to)
            );
        }
        let back = match s.recovery_after(t, MIN_GAP_MS, 1000) {
            Recovery::Unbroken => Some(0),
            Recovery::After(ms) => Some(ms),
            Recovery::Never => None,
        };
        report.back.0.push((node.clone(), back));
    }
    failover::recover(lab, how.kind(), &holder)?;
    wait_steady(lab, ip, opts)?;
    Ok(report)
}

/// What a broken stream's worker saw, and the counters of the gateways between which the
/// egress IP moved: so that a failed run says where the stream broke, not only that it did.
fn tell_broken(
    lab: &Lab,
    opts: &Options,
    node: &str,
    events: &PathBuf,
    t: u64,
    from: &str,
    to: &[String],
) -> String {
    use std::fmt::Write as _;
    let mut out = format!("--- {node}'s stream broke (event at {t}); its last events ---\n");
    let text = std::fs::read_to_string(events).unwrap_or_default();
    let lines: Vec<&str> = text.lines().collect();
    for l in lines
        .iter()
        .take(3)
        .chain(&lines[lines.len().saturating_sub(12)..])
    {
        let _ = writeln!(out, "  {l}");
    }
    for gw in std::iter::once(from).chain(to.iter().map(String::as_str)) {
        let _ = writeln!(out, "--- counters of {gw} ---");
        let dump = std::process::Command::new(&opts.agent_bin)
            .args(["maps", "--bpffs-dir"])
            .arg(lab.bpffs_dir(gw))
            .output()
            .map(|o| String::from_utf8_lossy(&o.stdout).into_owned())
            .unwrap_or_else(|e| format!("egress-agent maps: {e}\n"));
        let counters = dump
            .split("\ncounters (packets, bytes):\n")
            .nth(1)
            .and_then(|c| c.split("\n\n").next())
            .unwrap_or("(no counters)");
        let _ = writeln!(out, "{counters}");
        let saved = std::env::temp_dir().join(format!("egress-broken-{node}-{gw}.maps"));
        if std::fs::write(&saved, &dump).is_ok() {
            let _ = writeln!(
                out,
                "(the whole of `egress-agent maps` on {gw}: {})",
                saved.display()
            );
        }
        let log = lab.agent_log(gw);
        let _ = writeln!(out, "--- {gw}'s log about egress IPs ---");
        for l in log
            .lines()
            .filter(|l| l.contains("egress IP"))
            .rev()
            .take(6)
            .collect::<Vec<_>>()
            .into_iter()
            .rev()
        {
            let _ = writeln!(out, "  {l}");
        }
    }
    out
}

/// One holder of `egress_a` and of B, every selected pod served by both.
fn wait_steady(lab: &Lab, egress_a: IpAddr, opts: &Options) -> Result<()> {
    let b = IpAddr::from(addr::EGRESS_IP_B);
    let deadline = Instant::now() + opts.event_timeout;
    loop {
        if cluster::holders(lab, egress_a).len() == 1
            && cluster::holders(lab, b).len() == 1
            && check::served(lab, egress_a, b)
        {
            return Ok(());
        }
        if Instant::now() > deadline {
            bail!(
                "the lab is not steady {} s after the event: {egress_a} held by {:?}, {b} by {:?}",
                opts.event_timeout.as_secs(),
                cluster::holders(lab, egress_a),
                cluster::holders(lab, b)
            );
        }
        std::thread::sleep(Duration::from_millis(500));
    }
}

/// `change` at T under a UDP stream from every worker to `host`: per node, the time until
/// the host sees `source` from it.
fn propagation(
    lab: &Lab,
    what: &str,
    host: IpAddr,
    source: IpAddr,
    opts: &Options,
    expect_flowing: bool,
    change: impl FnOnce(&Lab) -> Result<()>,
) -> Result<Propagation> {
    let label = format!("scale-{}", what.replace(' ', "-"));
    let streams = start_streams(lab, "udp", host, &label)?;
    if expect_flowing {
        wait_flowing(&streams, 0, None, Duration::from_secs(30));
    } else {
        std::thread::sleep(Duration::from_secs(1));
    }
    let before = timeline::sample(lab);
    let t = unix_ms();
    change(lab)?;
    wait_flowing(&streams, t, Some(source), opts.event_timeout);
    let timeline = timeline::measure(lab, &before, t);
    let seen = stop_streams(streams)?;
    let mut shown = NodeTimes::default();
    for (node, _, events) in &seen {
        let first = replies(events)
            .into_iter()
            .find(|(at, ip)| *at >= t && *ip == source)
            .map(|(at, _)| at - t);
        shown.0.push((node.clone(), first));
    }
    Ok(Propagation {
        what: what.to_owned(),
        shown,
        timeline,
    })
}

/// Rule A's egress IP edited to [`EDITED_EGRESS_IP`].
pub fn policy_edit(lab: &mut Lab, opts: &Options) -> Result<Propagation> {
    let edited = edited_policy();
    let p = propagation(
        lab,
        "policy edit",
        addr::HOST_A.into(),
        EDITED_EGRESS_IP.into(),
        opts,
        true,
        |lab| lab.write_policy(&edited),
    )?;
    wait_steady(lab, EDITED_EGRESS_IP.into(), opts)?;
    Ok(p)
}

/// The sample policy with rule A's egress IP edited.
pub fn edited_policy() -> String {
    payments_policy(vec![
        json!({"destinations": [addr::NET_A], "egressIP": EDITED_EGRESS_IP.to_string()}),
        json!({"destinationsFrom": "Routes", "egressIP": addr::EGRESS_IP_B.to_string()}),
    ])
}

/// A route to network E added on every gateway (as NMState would, one after another):
/// `destinationsFrom: Routes` learns it, and the pods reach E by egress IP B.
pub fn route_change(lab: &mut Lab, opts: &Options) -> Result<Propagation> {
    let gateways: Vec<&'static str> = lab.gateways().collect();
    propagation(
        lab,
        "gateway route",
        addr::HOST_E.into(),
        addr::EGRESS_IP_B.into(),
        opts,
        false,
        |lab| {
            for gw in &gateways {
                lab.add_gateway_route(gw, &GatewayRoute::net_e(false))?;
            }
            Ok(())
        },
    )
}
