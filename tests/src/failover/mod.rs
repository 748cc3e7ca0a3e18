//! Failover, measured in the lab: the gateway that holds egress IP A fails in one of six
//! ways while pod `w1-p1` streams TCP, UDP and ping through it to host A (and UDP to host C,
//! through no gateway, as a control); what the flows and the gateways showed around the
//! failure, one [`CaseReport`] per case.
//!
//! Shared by `cargo xtask lab --failover` ([`run_table`]) and `tests/tests/failover.rs`
//! (loose bounds on [`run_case`]).
//!
//! A case: find the holder; start a sampler of every gateway's addresses (`holders.rs`)
//! and the three flows (`flows.rs`); after [`Timing::before`], inject the failure at time
//! T; keep going for [`Timing::after`] (longer while TCP is stalled but not reset, up to
//! [`Timing::stall_grace`] more: retransmission backoff can hide a path that is already
//! back); stop everything; read the flows' summaries, the samples and the new holder's
//! agent log; recover, and wait until the lab is steady again.

pub mod events;
mod flows;
pub mod heal;
mod holders;
pub mod neighbours;
pub mod remapped;
mod table;
pub mod upgrade;

use std::{
    fmt,
    net::IpAddr,
    thread,
    time::{Duration, Instant},
};

use anyhow::{Context as _, Result, bail};

pub use self::table::{per_kind, run_table};
use self::{
    flows::{Flows, Seen},
    holders::Sampler,
};
use crate::{
    cluster,
    lab::{Family, Lab, NODES, Proto, addr, addr6},
    stream::{Recovery, Summary, unix_ms},
};

/// The pod whose flows are measured.
pub const POD: &str = "w1-p1";
/// More than this with two holders fails a case.
pub const TWO_HOLDERS_LIMIT_MS: u64 = 1000;
/// After a move, a holder's announcements (and any a released one had pending) are over
/// by then: the agent's schedule ends at 2 s.
pub const ANNOUNCEMENTS_OVER: Duration = Duration::from_millis(2500);
/// A stream whose last reply is older than this when it stops is stalled (TCP) or not
/// back (UDP).
const STALLED_AFTER_MS: u64 = 500;

/// How the holder of the egress IP fails.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Kind {
    NotReady,
    SilentDeath,
    UnderlayCut,
    SecondaryCut,
    GatewayPartition,
    Drain,
}

impl Kind {
    /// Every kind, in the order the table runs them.
    pub const ALL: [Kind; 6] = [
        Kind::NotReady,
        Kind::SilentDeath,
        Kind::UnderlayCut,
        Kind::SecondaryCut,
        Kind::GatewayPartition,
        Kind::Drain,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Kind::NotReady => "notready",
            Kind::SilentDeath => "silent-death",
            Kind::UnderlayCut => "underlay-cut",
            Kind::SecondaryCut => "secondary-cut",
            Kind::GatewayPartition => "gateway-partition",
            Kind::Drain => "drain",
        }
    }

    /// What happens at T, and how the lab recovers.
    pub fn what(self) -> &'static str {
        match self {
            Kind::NotReady => "the holder's Node turns NotReady; back: Ready",
            Kind::SilentDeath => {
                "agent SIGKILLed, sec-a, sec-b and underlay down, Node still Ready; \
                 back: up, agent restarted"
            }
            Kind::UnderlayCut => "only the underlay link goes down (agent running); back: up",
            Kind::SecondaryCut => "the link with the egress IP goes down; back: up",
            Kind::GatewayPartition => {
                "the gateways cannot reach each other (workers reach both): nothing may \
                 move; back: healed"
            }
            Kind::Drain => "the Node gets egress.dev/drain=true (a planned move); back: removed",
        }
    }

    /// Whether the egress IP must move to another gateway.
    pub fn expects_move(self) -> bool {
        self != Kind::GatewayPartition
    }
}

impl fmt::Display for Kind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// The clock of a case.
#[derive(Clone, Debug)]
pub struct Timing {
    /// Between two lines of a stream, two pings, two holder samples.
    pub interval: Duration,
    /// Flows running before T.
    pub before: Duration,
    /// Flows running after T.
    pub after: Duration,
    /// At most this much longer while TCP is stalled (not reset, nothing delivered).
    pub stall_grace: Duration,
    /// Steady means: one holder of each egress IP and the pod gets through, this long.
    pub settle: Duration,
    pub steady_timeout: Duration,
}

impl Default for Timing {
    fn default() -> Self {
        Self {
            interval: Duration::from_millis(20),
            before: Duration::from_secs(1),
            after: Duration::from_secs(4),
            stall_grace: Duration::from_secs(4),
            settle: Duration::from_millis(1500),
            steady_timeout: Duration::from_secs(45),
        }
    }
}

/// What the flows aim at: egress IP A of the lab's first family, host A; egress IP B must
/// be steady between cases too.
#[derive(Clone, Copy, Debug)]
pub struct Target {
    pub egress: IpAddr,
    pub other_egress: IpAddr,
    pub host: IpAddr,
    /// Host C: reached without any gateway, by the control flow.
    pub control_host: IpAddr,
}

impl Target {
    pub fn of(family: Family) -> Self {
        if family.has_v4() {
            Self {
                egress: addr::EGRESS_IP_A.into(),
                other_egress: addr::EGRESS_IP_B.into(),
                host: addr::HOST_A.into(),
                control_host: addr::HOST_C.into(),
            }
        } else {
            Self {
                egress: addr6::EGRESS_IP_A.into(),
                other_egress: addr6::EGRESS_IP_B.into(),
                host: addr6::HOST_A.into(),
                control_host: addr6::HOST_C.into(),
            }
        }
    }
}

/// What became of the TCP stream.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TcpVerdict {
    /// No reset, and delivering when it stopped.
    Survived,
    /// No reset, but nothing delivered for a while when it stopped.
    Stalled,
    /// ECONNRESET, EPIPE or EOF.
    Reset,
    /// Any other error (e.g. it could not connect).
    Failed,
}

impl fmt::Display for TcpVerdict {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            TcpVerdict::Survived => "yes",
            TcpVerdict::Stalled => "stalled",
            TcpVerdict::Reset => "reset",
            TcpVerdict::Failed => "error",
        })
    }
}

/// One case, measured.
#[derive(Clone, Debug)]
pub struct CaseReport {
    pub kind: Kind,
    /// The holder (gateway, interface) before T.
    pub old: (String, String),
    /// The first other gateway seen holding the IP after T.
    pub new: Option<(String, String)>,
    /// Who held it when the flows stopped.
    pub end_holders: Vec<(String, String)>,
    /// The holder sets the sampler saw, in order, with when each began (ms from T):
    /// `gw1 > -@+20 > gw2@+45`.
    pub holder_path: Vec<String>,
    /// The failure, in unix milliseconds.
    pub t_unix_ms: u64,
    /// T -> the new holder's agent logged "holding egress IP".
    pub detection_ms: Option<u64>,
    pub tcp: Summary,
    pub udp: Summary,
    pub ping: Summary,
    /// UDP to host C, through no gateway: its gaps are the machine's.
    pub control: Summary,
    /// Time with two gateways holding the IP on an up interface.
    pub two_holders_ms: u64,
    /// Between two lines of a stream ([`Timing::interval`]).
    pub interval_ms: u64,
    /// Neighbour entries on the secondary networks that did not point at the holder
    /// once the lab was steady again and announcements were over ([`neighbours::stale`]).
    pub stale_neighbours: Vec<String>,
    pub notes: Vec<String>,
}

impl TcpVerdict {
    /// What became of the TCP stream `t` around an event at `t_unix_ms`: reset, failed,
    /// stalled (nothing delivered after the event, or nothing lately), or survived.
    pub fn of(t: &Summary, t_unix_ms: u64) -> Self {
        if t.reset {
            TcpVerdict::Reset
        } else if t.error.is_some() {
            TcpVerdict::Failed
        } else if t.first_reply_after(t_unix_ms).is_none()
            || t.last_reply()
                .is_none_or(|last| last + STALLED_AFTER_MS < t.end_unix_ms)
        {
            TcpVerdict::Stalled
        } else {
            TcpVerdict::Survived
        }
    }
}

impl CaseReport {
    pub fn tcp_verdict(&self) -> TcpVerdict {
        TcpVerdict::of(&self.tcp, self.t_unix_ms)
    }

    /// How UDP came back from its worst interruption after T: a gap between replies of
    /// more than two and a half intervals, i.e. two or more replies missing in a row.
    pub fn udp_back(&self) -> Recovery {
        self.udp
            .recovery_after(self.t_unix_ms, self.interval_ms * 5 / 2, STALLED_AFTER_MS)
    }

    /// The IP ended on exactly one gateway, another than before.
    pub fn moved(&self) -> bool {
        matches!(self.end_holders.as_slice(), [(gw, _)] if *gw != self.old.0)
    }

    /// Whether the new holder let the address go after taking it: a `-` after its first
    /// entry in [`CaseReport::holder_path`] (`gw2@+159 > -@+246 > gw2@+434`), a second
    /// gap for every stream.
    pub fn new_holder_let_go(&self) -> bool {
        let Some((new, _)) = &self.new else {
            return false;
        };
        self.holder_path
            .iter()
            .skip_while(|p| p.split('@').next() != Some(new.as_str()))
            .any(|p| p.starts_with("-@"))
    }

    /// What the table's exit status holds a case to.
    pub fn ok(&self) -> bool {
        self.tcp_verdict() == TcpVerdict::Survived
            && self.two_holders_ms <= TWO_HOLDERS_LIMIT_MS
            && self.stale_neighbours.is_empty()
    }
}

/// One case: see the module documentation. The lab must be steady ([`wait_steady`]); it is
/// steady again when this returns `Ok`. `label` names the flows' logs in the lab directory.
pub fn run_case(lab: &mut Lab, kind: Kind, timing: &Timing, label: &str) -> Result<CaseReport> {
    let target = Target::of(lab.family());
    let old = cluster::holder(lab, target.egress)
        .with_context(|| format!("{kind}: no gateway holds {}", target.egress))?;
    let seen = observe(lab, kind, &old, &target, timing, label);
    let report = seen.map(|seen| seen.report(lab, kind, &old, &target, timing));
    // Recover also when the case failed half way, so that the lab is left as it was.
    recover(lab, kind, &old).with_context(|| format!("failed to recover from {kind}"))?;
    let mut report = report?;
    wait_steady(lab, &target, timing).with_context(|| format!("after recovering from {kind}"))?;
    // What the network believes once every announcement of the move and the recovery is
    // over: the hosts keep entries as switches do, so nothing but an announcement fixes a
    // wrong one.
    thread::sleep(ANNOUNCEMENTS_OVER);
    report.stale_neighbours = neighbours::stale(lab, true)?;
    report.notes.extend(
        report
            .stale_neighbours
            .iter()
            .map(|n| format!("neighbour {n}")),
    );
    Ok(report)
}

/// What a case saw: the failure's time, the flows, who held the IP when.
struct Observation {
    t: u64,
    seen: flows::Seen,
    timeline: holders::Timeline,
}

/// Start the sampler and the flows, inject the failure after [`Timing::before`], stop
/// everything after [`Timing::after`] (and the stall grace).
fn observe(
    lab: &mut Lab,
    kind: Kind,
    old: &(String, String),
    target: &Target,
    timing: &Timing,
    label: &str,
) -> Result<Observation> {
    let sampler = Sampler::start(lab, target.egress, timing.interval)?;
    let flows = Flows::start(lab, target, timing, label)?;
    thread::sleep(timing.before);
    if flows.tcp_progress().last_reply.is_none() {
        let seen = flows.stop()?;
        sampler.stop()?;
        bail!(
            "{kind}: the flows did not get through before the failure (tcp: {:?}, udp: {} replies)",
            seen.tcp.error,
            seen.udp.received
        );
    }
    let t = unix_ms();
    let injected = inject(lab, kind, old);
    if injected.is_ok() {
        thread::sleep(timing.after);
        // Give a stalled (not reset) TCP stream time to come back.
        let grace_end = Instant::now() + timing.stall_grace;
        while Instant::now() < grace_end && flows.tcp_progress().stalled() {
            thread::sleep(Duration::from_millis(100));
        }
    }
    let seen = flows.stop()?;
    let timeline = sampler.stop()?;
    injected.with_context(|| format!("failed to inject {kind} on {}", old.0))?;
    Ok(Observation { t, seen, timeline })
}

impl Observation {
    /// The report: who took over and when they said so, and what looks wrong.
    fn report(
        self,
        lab: &mut Lab,
        kind: Kind,
        old: &(String, String),
        target: &Target,
        timing: &Timing,
    ) -> CaseReport {
        let t = self.t;
        let new = self.timeline.first_other_holder(&old.0, t);
        let detection_ms = new
            .as_ref()
            .and_then(|(gw, _)| detection_ms(&lab.agent_log(gw), target.egress, t));
        let holder_path = self.timeline.path(t);
        let Seen {
            tcp,
            udp,
            ping,
            control,
        } = self.seen;
        let interval_ms = timing.interval.as_millis() as u64;
        let mut notes = Vec::new();
        // The control flow crosses no gateway: a gap there is the machine, not failover.
        if control.longest_gap_ms > interval_ms * 5 / 2 {
            notes.push(format!(
                "host stall: the control flow had a {} ms gap",
                control.longest_gap_ms
            ));
        }
        if self.timeline.holders_at(t) != [old.0.as_str()] {
            let at_t = self.timeline.holders_at(t);
            notes.push(format!("unsteady: holders at T {at_t:?}"));
        }
        if holder_path.len() > 2 {
            notes.push(format!("holders {}", holder_path.join(" > ")));
        }
        if udp.sources.len() > 1 {
            notes.push(format!("udp source {}", udp.sources.join(" > ")));
        }
        if let Some(e) = &tcp.error {
            notes.push(format!("tcp: {e}"));
        }
        for (node, status) in lab.exited_agents() {
            notes.push(format!("agent on {node} exited ({status})"));
        }
        CaseReport {
            kind,
            old: old.clone(),
            new,
            end_holders: cluster::holders(lab, target.egress),
            holder_path,
            t_unix_ms: t,
            detection_ms,
            two_holders_ms: self.timeline.two_holders_ms(),
            stale_neighbours: Vec::new(),
            tcp,
            udp,
            ping,
            control,
            interval_ms,
            notes,
        }
    }
}

/// Break `holder` (gateway, interface of the egress IP) the way `kind` says.
pub fn inject(lab: &mut Lab, kind: Kind, holder: &(String, String)) -> Result<()> {
    let (gw, ifc) = (holder.0.as_str(), holder.1.as_str());
    match kind {
        Kind::NotReady => lab.set_node_ready(gw, false),
        Kind::SilentDeath => {
            lab.kill_agent(gw)?;
            lab.set_secondary_link(gw, "sec-a", false)?;
            lab.set_secondary_link(gw, "sec-b", false)?;
            lab.set_underlay_link(gw, false)
        }
        Kind::UnderlayCut => lab.set_underlay_link(gw, false),
        Kind::SecondaryCut => lab.set_secondary_link(gw, ifc, false),
        Kind::GatewayPartition => {
            let [a, b] = gateways();
            lab.partition_underlay(a, b)
        }
        Kind::Drain => lab.set_node_drain(gw, true),
    }
}

/// Undo [`inject`] (idempotent: also after a partial injection).
pub fn recover(lab: &mut Lab, kind: Kind, holder: &(String, String)) -> Result<()> {
    let (gw, ifc) = (holder.0.as_str(), holder.1.as_str());
    match kind {
        Kind::NotReady => lab.set_node_ready(gw, true),
        Kind::SilentDeath => {
            // The underlay first: secondary networks may be VLANs on its NIC (Cni::Ovs).
            lab.set_underlay_link(gw, true)?;
            lab.set_secondary_link(gw, "sec-a", true)?;
            lab.set_secondary_link(gw, "sec-b", true)?;
            if lab.agent_running(gw) {
                return Ok(());
            }
            lab.start_agent(gw, &cluster::agent_bin()?, &[])
        }
        Kind::UnderlayCut => lab.set_underlay_link(gw, true),
        Kind::SecondaryCut => lab.set_secondary_link(gw, ifc, true),
        Kind::GatewayPartition => lab.heal_underlay(),
        Kind::Drain => lab.set_node_drain(gw, false),
    }
}

fn gateways() -> [&'static str; 2] {
    let mut gws = NODES.iter().filter(|n| n.gateway).map(|n| n.name);
    [gws.next().unwrap_or("gw1"), gws.next().unwrap_or("gw2")]
}

/// Wait until both egress IPs have exactly one holder and the pod gets through with egress
/// IP A over TCP and UDP, without a break for [`Timing::settle`].
pub fn wait_steady(lab: &Lab, target: &Target, timing: &Timing) -> Result<Duration> {
    let start = Instant::now();
    let mut since: Option<Instant> = None;
    loop {
        let steady = cluster::holders(lab, target.egress).len() == 1
            && cluster::holders(lab, target.other_egress).len() == 1
            && [Proto::Tcp, Proto::Udp]
                .iter()
                .all(|p| cluster::seen(lab, POD, *p, target.host) == Some(target.egress));
        if !steady {
            since = None;
        } else if since.get_or_insert_with(Instant::now).elapsed() >= timing.settle {
            return Ok(start.elapsed());
        }
        if start.elapsed() > timing.steady_timeout {
            bail!(
                "the lab is not steady after {:?}: holders of {} {:?}, of {} {:?}",
                timing.steady_timeout,
                target.egress,
                cluster::holders(lab, target.egress),
                target.other_egress,
                cluster::holders(lab, target.other_egress),
            );
        }
        thread::sleep(Duration::from_millis(100));
    }
}

/// Milliseconds from `t` to the first line of an agent log at or after `t` that says it
/// holds `ip` (`... holding egress IP ip=<ip> ...`, after an RFC 3339 timestamp).
pub fn detection_ms(log: &str, ip: IpAddr, t: u64) -> Option<u64> {
    let field = format!("ip={ip}");
    log.lines()
        .filter(|l| l.contains("holding egress IP") && l.split_whitespace().any(|w| w == field))
        .filter_map(|l| rfc3339_unix_ms(l.split_whitespace().next()?))
        .find(|at| *at >= t)
        .map(|at| at - t)
}

/// `2025-01-02T03:04:05.678901Z` (or with a `+01:00` offset) in unix milliseconds.
pub fn rfc3339_unix_ms(s: &str) -> Option<u64> {
    let (date, time) = s.split_once('T')?;
    let mut d = date.splitn(3, '-').map(str::parse::<i64>);
    let (y, m, day) = (d.next()?.ok()?, d.next()?.ok()?, d.next()?.ok()?);
    let (clock, offset_s) = match time.strip_suffix('Z') {
        Some(c) => (c, 0),
        None => {
            let i = time.rfind(['+', '-'])?;
            let (h, mi) = time[i + 1..].split_once(':')?;
            let off = h.parse::<i64>().ok()? * 3600 + mi.parse::<i64>().ok()? * 60;
            (&time[..i], if &time[i..=i] == "-" { -off } else { off })
        }
    };
    let (hms, frac) = clock.split_once('.').unwrap_or((clock, ""));
    let mut c = hms.splitn(3, ':').map(str::parse::<i64>);
    let (h, mi, sec) = (c.next()?.ok()?, c.next()?.ok()?, c.next()?.ok()?);
    let millis: i64 = format!("{frac:0<3}").get(..3)?.parse().ok()?;
    let secs = days_from_civil(y, m, day) * 86_400 + h * 3600 + mi * 60 + sec - offset_s;
    u64::try_from(secs * 1000 + millis).ok()
}

/// Days since 1970-01-01 of a proleptic Gregorian date (H. Hinnant's `days_from_civil`).
fn days_from_civil(y: i64, m: i64, d: i64) -> i64 {
    let y = if m <= 2 { y - 1 } else { y };
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let doy = (153 * (if m > 2 { m - 3 } else { m + 9 }) + 2) / 5 + d - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rfc3339_timestamps_of_tracing() {
        assert_eq!(rfc3339_unix_ms("1970-01-01T00:00:00Z"), Some(0));
        assert_eq!(
            rfc3339_unix_ms("2024-02-29T12:00:00.5Z"),
            Some(1_709_208_000_500)
        );
        assert_eq!(
            rfc3339_unix_ms("2024-02-29T13:00:00.123456+01:00"),
            Some(1_709_208_000_123)
        );
        assert_eq!(rfc3339_unix_ms("INFO"), None);
    }

    #[test]
    fn a_new_holder_that_lets_go_after_taking_is_seen_in_the_path() {
        let report = |path: &str| CaseReport {
            kind: Kind::NotReady,
            old: ("gw1".into(), "sec-a".into()),
            new: Some(("gw2".into(), "sec-a".into())),
            end_holders: vec![("gw2".into(), "sec-a".into())],
            holder_path: path.split(" > ").map(str::to_owned).collect(),
            t_unix_ms: 0,
            detection_ms: None,
            tcp: Summary::default(),
            udp: Summary::default(),
            ping: Summary::default(),
            control: Summary::default(),
            two_holders_ms: 0,
            interval_ms: 20,
            stale_neighbours: Vec::new(),
            notes: Vec::new(),
        };
        assert!(report("gw1 > -@+91 > gw2@+159 > -@+246 > gw2@+434").new_holder_let_go());
        assert!(!report("gw1 > -@+91 > gw2@+159").new_holder_let_go());
        assert!(!report("gw1 > gw1+gw2@+98 > gw2@+99").new_holder_let_go());
        assert!(report("gw1 > gw1+gw2@+98 > gw2@+99 > -@+120 > gw2@+200").new_holder_let_go());
    }

    #[test]
    fn detection_is_the_first_holding_line_for_the_ip_after_t() {
        let log = "\
2024-02-29T12:00:00.000000Z  INFO egress_agent::agent: holding egress IP ip=192.168.101.50 interface=sec-a
2024-02-29T12:00:01.000000Z  INFO egress_agent::agent: holding egress IP ip=192.168.102.50 interface=sec-b
2024-02-29T12:00:02.250000Z  INFO egress_agent::agent: holding egress IP ip=192.168.101.50 interface=sec-a
";
        let ip: IpAddr = addr::EGRESS_IP_A.into();
        let t = 1_709_208_000_500;
        assert_eq!(detection_ms(log, ip, t), Some(1750));
        assert_eq!(detection_ms(log, addr::EGRESS_IP_B.into(), t), Some(500));
        assert_eq!(detection_ms(log, ip, t + 5000), None);
    }
}
