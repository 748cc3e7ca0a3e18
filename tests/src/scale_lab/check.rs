//! The sources the far hosts see, from every pod, per destination; and who holds what.

use std::{fmt, net::IpAddr};

use anyhow::Result;

use super::parallel;
use crate::{
    cluster,
    lab::{Lab, Proto, addr},
};

/// Queries at once (each is a process in a pod's namespace).
const THREADS: usize = 8;

/// What a destination must see from a pod.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Expect {
    /// This egress IP.
    Egress(IpAddr),
    /// The pod's own address (untouched).
    Own,
    /// Nothing: the pod has no way there.
    Unreachable,
}

/// A far host and what selected and unselected pods must look like there.
#[derive(Clone, Debug)]
pub struct Destination {
    pub name: &'static str,
    pub host: IpAddr,
    pub proto: Proto,
    pub selected: Expect,
    pub unselected: Expect,
}

/// One destination's verdict over every pod.
#[derive(Clone, Debug, Default)]
pub struct SourceCheck {
    pub destination: String,
    pub checked: usize,
    pub right: usize,
    /// `pod: saw X, expected Y`.
    pub wrong: Vec<String>,
}

impl fmt::Display for Expect {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Expect::Egress(ip) => write!(f, "{ip}"),
            Expect::Own => f.write_str("the pod's own address"),
            Expect::Unreachable => f.write_str("no answer"),
        }
    }
}

/// The destinations of the sample policy as the lab starts: A by egress IP A, B and D
/// (the gateways' route) by egress IP B, C untouched; unselected pods reach only C.
pub fn first_destinations() -> Vec<Destination> {
    let ea = Expect::Egress(addr::EGRESS_IP_A.into());
    let eb = Expect::Egress(addr::EGRESS_IP_B.into());
    vec![
        dest(
            "host-a tcp",
            addr::HOST_A.into(),
            Proto::Tcp,
            ea,
            Expect::Unreachable,
        ),
        dest(
            "host-a udp",
            addr::HOST_A.into(),
            Proto::Udp,
            ea,
            Expect::Unreachable,
        ),
        dest(
            "host-b tcp",
            addr::HOST_B.into(),
            Proto::Tcp,
            eb,
            Expect::Unreachable,
        ),
        dest(
            "host-d udp",
            addr::HOST_D.into(),
            Proto::Udp,
            eb,
            Expect::Unreachable,
        ),
        dest(
            "host-c tcp",
            addr::HOST_C.into(),
            Proto::Tcp,
            Expect::Own,
            Expect::Own,
        ),
    ]
}

fn dest(name: &'static str, host: IpAddr, proto: Proto, sel: Expect, unsel: Expect) -> Destination {
    Destination {
        name,
        host,
        proto,
        selected: sel,
        unselected: unsel,
    }
}

/// Every pod to every destination of [`first_destinations`].
pub fn sources(lab: &Lab) -> Result<Vec<SourceCheck>> {
    Ok(check(lab, &first_destinations()))
}

/// After the events: rule A leaves by the edited egress IP ([`super::events::EDITED_EGRESS_IP`])
/// and network E, now routed by the gateways, by egress IP B.
pub fn sources_after_events(lab: &Lab) -> Result<Vec<SourceCheck>> {
    let a2 = Expect::Egress(super::events::EDITED_EGRESS_IP.into());
    let eb = Expect::Egress(addr::EGRESS_IP_B.into());
    let mut out = first_destinations();
    for d in &mut out {
        if d.host == IpAddr::from(addr::HOST_A) {
            d.selected = a2;
        }
    }
    out.push(dest(
        "host-e udp",
        addr::HOST_E.into(),
        Proto::Udp,
        eb,
        Expect::Unreachable,
    ));
    Ok(check(lab, &out))
}

/// Query every pod against every destination, [`THREADS`] at a time.
pub fn check(lab: &Lab, dests: &[Destination]) -> Vec<SourceCheck> {
    let jobs: Vec<(usize, &crate::lab::Pod)> = (0..dests.len())
        .flat_map(|d| lab.pods().iter().map(move |p| (d, p)))
        .collect();
    let seen = parallel(&jobs, THREADS, |(d, pod)| {
        cluster::seen(lab, &pod.name, dests[*d].proto, dests[*d].host)
    });
    let mut out: Vec<SourceCheck> = dests
        .iter()
        .map(|d| SourceCheck {
            destination: d.name.to_owned(),
            ..SourceCheck::default()
        })
        .collect();
    for ((d, pod), saw) in jobs.iter().zip(seen) {
        let dest = &dests[*d];
        let expect = if selected(pod) {
            dest.selected
        } else {
            dest.unselected
        };
        let ok = match expect {
            Expect::Egress(ip) => saw == Some(ip),
            Expect::Own => saw == Some(IpAddr::V4(pod.ip)),
            Expect::Unreachable => saw.is_none(),
        };
        let c = &mut out[*d];
        c.checked += 1;
        if ok {
            c.right += 1;
        } else {
            let saw = saw.map_or("no answer".to_owned(), |ip| ip.to_string());
            c.wrong
                .push(format!("{}: saw {saw}, expected {expect}", pod.name));
        }
    }
    out
}

/// Whether the sample policy selects `pod` (app=api in payments).
pub fn selected(pod: &crate::lab::Pod) -> bool {
    pod.namespace == crate::lab::PAYMENTS
        && pod.labels.get("app").map(String::as_str) == Some("api")
}

/// Every selected pod reaches host A by `egress_a` and host B by `egress_b` (TCP).
pub fn served(lab: &Lab, egress_a: IpAddr, egress_b: IpAddr) -> bool {
    let pods: Vec<String> = lab
        .pods()
        .iter()
        .filter(|p| selected(p))
        .map(|p| p.name.clone())
        .collect();
    served_pods(lab, &pods, egress_a, egress_b).len() == pods.len()
}

/// Those of `pods` that reach host A by `egress_a` and host B by `egress_b` (TCP).
pub fn served_pods(lab: &Lab, pods: &[String], egress_a: IpAddr, egress_b: IpAddr) -> Vec<String> {
    let ok = parallel(pods, THREADS, |pod| {
        [(addr::HOST_A, egress_a), (addr::HOST_B, egress_b)]
            .iter()
            .all(|(host, egress)| cluster::seen(lab, pod, Proto::Tcp, *host) == Some(*egress))
    });
    pods.iter()
        .zip(ok)
        .filter(|(_, ok)| *ok)
        .map(|(p, _)| p.clone())
        .collect()
}

/// Egress IPs, each with the (gateway, interface) pairs that have it on an interface
/// that is up.
pub type Held = Vec<(IpAddr, Vec<(String, String)>)>;

/// `ips` with the gateways that have each on an interface that is up.
pub fn holders(lab: &Lab, ips: &[IpAddr]) -> Held {
    ips.iter()
        .map(|ip| (*ip, cluster::holders(lab, *ip)))
        .collect()
}
