//! Several egress IPs for one rule in the lab (`egressIPs`): the sample policy with its
//! network-A rule leaving by A and A2, where each address lives (the gateways' interfaces),
//! and, for each selected pod, the address its node's compile gives it (from the lab's own
//! state directory, as the agents read it) against the source the far host saw.

use std::{
    collections::{BTreeMap, BTreeSet},
    net::IpAddr,
    time::{Duration, Instant},
};

use anyhow::{Context as _, Result, bail};
use serde_json::json;

use crate::{
    cluster,
    failover::{self, Kind, TcpVerdict},
    lab::{Family, Lab, Proto, addr, addr6},
    stream::{Summary, unix_ms},
};

/// How long the agents may take to place a new address and serve it.
pub const PLACED_WITHIN: Duration = Duration::from_secs(20);

/// The second address of network A, beside [`addr::EGRESS_IP_A`]. The hash of pod over
/// addresses is fixed by them: with .57 the lab's three selected pods split between A and
/// A2 (w1-p1 and gw1-p1 on A2, w2-p1 on A), so that both workers' pods, which outlive a
/// gateway, are on different addresses (.51 would put all three on A2).
pub const EGRESS_IP_A2: std::net::Ipv4Addr = std::net::Ipv4Addr::new(192, 168, 101, 57);
/// Its IPv6 twin, beside [`addr6::EGRESS_IP_A`] (w1-p1 on A2, w2-p1 and gw1-p1 on A).
pub const EGRESS_IP6_A2: std::net::Ipv6Addr =
    std::net::Ipv6Addr::new(0xfd00, 0x101, 0, 0, 0, 0, 0, 0x57);

/// Network A's addresses of `v6`'s family: A and A2.
pub fn addresses(v6: bool) -> [IpAddr; 2] {
    if v6 {
        [addr6::EGRESS_IP_A.into(), EGRESS_IP6_A2.into()]
    } else {
        [addr::EGRESS_IP_A.into(), EGRESS_IP_A2.into()]
    }
}

/// The sample policy ([`crate::lab::sample_policy_for`]) with network A's rule of each
/// family leaving by two addresses (`egressIPs: [A, A2]`).
pub fn policy_for(family: Family) -> String {
    let mut rules = Vec::new();
    let mut family_rules = |v6: bool, net_a: &str, egress_b: IpAddr| {
        let ips: Vec<String> = addresses(v6).iter().map(IpAddr::to_string).collect();
        rules.push(json!({"destinations": [net_a], "egressIPs": ips}));
        rules.push(json!({"destinationsFrom": "Routes", "egressIP": egress_b.to_string()}));
    };
    if family.has_v4() {
        family_rules(false, addr::NET_A, addr::EGRESS_IP_B.into());
    }
    if family.has_v6() {
        family_rules(true, addr6::NET_A, addr6::EGRESS_IP_B.into());
    }
    crate::lab::payments_policy(rules)
}

/// One selected pod's view of network A.
#[derive(Clone, Debug)]
pub struct Row {
    pub pod: String,
    /// The address its node's compile gives it.
    pub expected: IpAddr,
    /// The source address the host on A saw (`None`: no answer).
    pub observed: Option<IpAddr>,
    /// Who has that address on an up interface.
    pub gateway: Option<String>,
}

impl Row {
    pub fn ok(&self) -> bool {
        self.observed == Some(self.expected) && self.gateway.is_some()
    }
}

/// Write [`policy_for`] and wait until both addresses of `v6`'s family are on an up
/// interface of a gateway; returns their holders, in the order of [`addresses`].
pub fn apply(lab: &Lab, v6: bool) -> Result<[String; 2]> {
    lab.write_policy(&policy_for(lab.family()))?;
    let mut holders = [String::new(), String::new()];
    cluster::wait_until(PLACED_WITHIN, || {
        let found: Vec<Option<String>> = addresses(v6)
            .iter()
            .map(|ip| cluster::holder(lab, *ip).map(|(gw, _)| gw))
            .collect();
        match found.as_slice() {
            [Some(a), Some(b)] => {
                holders = [a.clone(), b.clone()];
                true
            }
            _ => false,
        }
    })
    .context("the two addresses of network A were not both held")?;
    Ok(holders)
}

/// The address each selected pod address of `v6`'s family leaves with under network A's
/// rule, as its node's agent compiles it from the lab's state directory (policies, nodes,
/// pods, and the EgressNodes the agents write there).
pub fn expected(lab: &Lab, v6: bool) -> Result<BTreeMap<String, IpAddr>> {
    let snapshot = egress_agent::source::yaml::load_dir(&lab.state_dir());
    if let Some(e) = snapshot.errors.first() {
        bail!("the lab's state directory does not load: {e}");
    }
    let net_a: ipnet::IpNet = if v6 { addr6::NET_A } else { addr::NET_A }
        .parse()
        .context("network A")?;
    let mut out = BTreeMap::new();
    for pod in lab.pods() {
        let ip: IpAddr = match (v6, pod.ipv6) {
            (true, Some(ip6)) => ip6.into(),
            (true, None) => continue,
            (false, _) => pod.ip.into(),
        };
        let compiled = egress_agent::compiler::compile(&snapshot.view, &pod.node);
        let route = compiled
            .pod_routes
            .iter()
            .find(|r| r.pod_ip == ip && r.rule == rule_index(lab, v6) && r.egress_ip.is_some());
        if let Some(r) = route.and_then(|r| r.egress_ip)
            && net_a.contains(&r)
        {
            out.insert(pod.name.clone(), r);
        }
    }
    Ok(out)
}

/// Index of network A's rule of `v6`'s family in [`policy_for`].
fn rule_index(lab: &Lab, v6: bool) -> usize {
    if v6 && lab.family().has_v4() { 2 } else { 0 }
}

/// For each selected pod: a TCP connection to the host on A, what it saw, and who holds
/// the address it expected.
pub fn rows(lab: &Lab, v6: bool) -> Result<Vec<Row>> {
    let host: IpAddr = if v6 {
        addr6::HOST_A.into()
    } else {
        addr::HOST_A.into()
    };
    let expected = expected(lab, v6)?;
    if expected.is_empty() {
        bail!("no selected pod leaves by network A's rule");
    }
    Ok(expected
        .into_iter()
        .map(|(pod, expected)| Row {
            observed: cluster::seen(lab, &pod, Proto::Tcp, host),
            gateway: cluster::holder(lab, expected).map(|(gw, _)| gw),
            pod,
            expected,
        })
        .collect())
}

/// The addresses the rows' pods leave with.
pub fn used(rows: &[Row]) -> BTreeSet<IpAddr> {
    rows.iter().map(|r| r.expected).collect()
}

/// One selected pod's TCP stream to the host on A across a failure.
#[derive(Clone, Debug)]
pub struct StreamReport {
    pub pod: String,
    /// The address it leaves with.
    pub address: IpAddr,
    /// Its address was on the gateway that failed.
    pub on_failed: bool,
    pub tcp: Summary,
    pub verdict: TcpVerdict,
}

impl StreamReport {
    /// The far side saw only the pod's address, before and after.
    pub fn kept_address(&self) -> bool {
        self.tcp.sources.iter().all(|s| {
            s.parse::<std::net::SocketAddr>()
                .map(|a| a.ip())
                .or_else(|_| s.parse::<IpAddr>())
                .is_ok_and(|ip| ip == self.address)
        }) && !self.tcp.sources.is_empty()
    }
}

/// Network A with two addresses, a silent death of one address's holder.
#[derive(Clone, Debug)]
pub struct FailoverReport {
    /// The gateway that failed, and the address it held.
    pub failed: (String, IpAddr),
    /// Who held that address when the streams stopped.
    pub moved_to: Option<String>,
    /// Who held the other address before and when the streams stopped.
    pub other: (String, Option<String>),
    pub streams: Vec<StreamReport>,
}

impl FailoverReport {
    /// Streams of both addresses ran, every one survived with its address, the failed
    /// address moved, the other stayed.
    pub fn ok(&self) -> bool {
        let both = [true, false]
            .iter()
            .all(|f| self.streams.iter().any(|s| s.on_failed == *f));
        both && self
            .streams
            .iter()
            .all(|s| s.verdict == TcpVerdict::Survived && s.kept_address())
            && self.moved_to.as_ref().is_some_and(|m| *m != self.failed.0)
            && self.other.1.as_ref() == Some(&self.other.0)
    }
}

/// [`apply`], then one TCP stream from every selected pod to the host on A, a silent death
/// ([`Kind::SilentDeath`]) of the gateway holding A (the first address), what the streams
/// saw; then the gateway back, the sample policy back, the lab steady. `interval`: between
/// two lines of a stream.
pub fn failover(lab: &mut Lab, v6: bool, interval: Duration) -> Result<FailoverReport> {
    let [a, a2] = addresses(v6);
    let holders = apply(lab, v6)?;
    let rows = rows(lab, v6)?;
    let host: IpAddr = if v6 {
        addr6::HOST_A.into()
    } else {
        addr::HOST_A.into()
    };
    let failed = (holders[0].clone(), a);
    let mut streams = Vec::new();
    // A pod on the gateway that dies dies with it.
    let outlives = |r: &&Row| lab.pod(&r.pod).is_ok_and(|p| p.node != failed.0);
    for r in rows.iter().filter(outlives) {
        let log = lab.dir().join(format!("spread-{}-tcp.log", r.pod));
        let args = [
            "stream".to_owned(),
            "tcp".to_owned(),
            std::net::SocketAddr::new(host, addr::ECHO_PORT).to_string(),
            "--interval-ms".to_owned(),
            interval.as_millis().to_string(),
            "--duration-ms".to_owned(),
            "120000".to_owned(),
        ];
        let child = lab.ns(&r.pod)?.spawn(&lab.spec().echo_bin, &args, &log)?;
        streams.push((r.clone(), child, log));
    }
    std::thread::sleep(Duration::from_secs(1));
    let t = unix_ms();
    let holder = (failed.0.clone(), "sec-a".to_owned());
    let injected = failover::inject(lab, Kind::SilentDeath, &holder);
    if injected.is_ok() {
        // Until A moved, then long enough for a TCP stream out for that long to have
        // retransmitted since (its timeout doubles: by twice the outage and a second):
        // 5 s at least. Under emulation the move takes seconds, not the 0.4 s here.
        let t0 = Instant::now();
        let moved = cluster::wait_until(PLACED_WITHIN, || {
            cluster::holder(lab, a).is_some_and(|(gw, _)| gw != failed.0)
        });
        let outage = moved.unwrap_or_else(|_| t0.elapsed());
        let settle = (outage * 2 + Duration::from_secs(1)).max(Duration::from_secs(5));
        std::thread::sleep(settle.saturating_sub(t0.elapsed()));
    }
    let mut reports = Vec::new();
    for (row, mut child, log) in streams {
        child.signal_term();
        if child.wait_for(Duration::from_secs(3))?.is_none() {
            child.terminate(Duration::ZERO);
        }
        let text = std::fs::read_to_string(&log).unwrap_or_default();
        let tcp = Summary::find_in(&text).with_context(|| format!("{}'s TCP stream", row.pod))?;
        reports.push(StreamReport {
            verdict: TcpVerdict::of(&tcp, t),
            on_failed: row.expected == a,
            pod: row.pod,
            address: row.expected,
            tcp,
        });
    }
    let report = FailoverReport {
        moved_to: cluster::holder(lab, a).map(|(gw, _)| gw),
        other: (
            holders[1].clone(),
            cluster::holder(lab, a2).map(|(gw, _)| gw),
        ),
        failed,
        streams: reports,
    };
    failover::recover(lab, Kind::SilentDeath, &holder)?;
    injected?;
    lab.write_policy(&crate::lab::sample_policy_for(lab.family()))?;
    cluster::wait_until(PLACED_WITHIN, || cluster::holder(lab, a2).is_none())
        .context("A2 was not released after the policy went back")?;
    let target = failover::Target::of(lab.family());
    failover::wait_steady(lab, &target, &failover::Timing::default())?;
    Ok(report)
}

impl FailoverReport {
    /// The report as a small table: one line per stream, then what moved.
    pub fn table(&self) -> String {
        let mut out = format!(
            "{:<8} {:<16} {:<26} {:<10} {:<8} {:<14} ok\n",
            "pod", "address", "its gateway", "tcp", "gap_ms", "far side saw",
        );
        for s in &self.streams {
            let gateway = if s.on_failed {
                format!(
                    "{} -> {}",
                    self.failed.0,
                    self.moved_to.as_deref().unwrap_or("-")
                )
            } else {
                format!("{} (stays)", self.other.0)
            };
            let ok = s.verdict == TcpVerdict::Survived && s.kept_address();
            out.push_str(&format!(
                "{:<8} {:<16} {:<26} {:<10} {:<8} {:<14} {}\n",
                s.pod,
                s.address.to_string(),
                gateway,
                s.verdict.to_string(),
                s.tcp.longest_gap_ms,
                if s.kept_address() {
                    "its address"
                } else {
                    "ANOTHER"
                },
                if ok { "ok" } else { "FAIL" },
            ));
        }
        out.push_str(&format!(
            "{} held {}: silent death; {} now on {}; {} stayed on {}",
            self.failed.0,
            self.failed.1,
            self.failed.1,
            self.moved_to.as_deref().unwrap_or("nobody"),
            self.other.0,
            self.other.1.as_deref().unwrap_or("nobody"),
        ));
        out
    }
}
