//! A heal, measured: every gateway is cut off from the majority at once (each fences
//! itself and lets its egress IPs go), then the underlay heals at once, so that the
//! gateways regain the majority in the same instant, each with a view of the others from
//! before. Who held what is read from the kernel's address notifications
//! ([`AddressEvents`]), and the neighbours on the secondary networks are read once the
//! announcements are over.

use std::{net::IpAddr, thread, time::Duration};

use anyhow::{Context as _, Result};

use super::{
    ANNOUNCEMENTS_OVER, Target, Timing,
    events::{self, AddressEvents},
    neighbours, wait_steady,
};
use crate::{
    cluster,
    lab::{Family, Lab, addr, addr6},
};

/// What one heal showed.
#[derive(Clone, Debug)]
pub struct HealReport {
    /// Each stretch with two holders of an egress IP (`192.168.101.50: gw1+gw2 for 3.2
    /// ms`): must be empty.
    pub two_holders: Vec<String>,
    /// Each address taken after the heal and let go again (a second gap for every
    /// flow): must be empty.
    pub retaken: Vec<String>,
    /// Neighbours pointing an egress IP elsewhere than at its holder afterwards.
    pub stale_neighbours: Vec<String>,
    /// From the heal until the lab was steady again.
    pub back_after: Duration,
    /// The address events of the round, in words, for a failure's message.
    pub path: Vec<String>,
}

/// Every egress IP of the lab's families.
fn egress_ips(family: Family) -> Vec<IpAddr> {
    let mut out: Vec<IpAddr> = Vec::new();
    if family.has_v4() {
        out.extend([IpAddr::from(addr::EGRESS_IP_A), addr::EGRESS_IP_B.into()]);
    }
    if family.has_v6() {
        out.extend([IpAddr::from(addr6::EGRESS_IP_A), addr6::EGRESS_IP_B.into()]);
    }
    out
}

/// Cut every gateway off from every other node, wait until none holds anything, heal,
/// wait until the lab is steady and the announcements are over, and report. The lab must
/// be steady before.
pub fn run(lab: &mut Lab, timing: &Timing, label: &str) -> Result<HealReport> {
    let ips = egress_ips(lab.family());
    let monitor = AddressEvents::start(lab, &ips, label)?;
    let back = isolate_and_heal(lab, &ips, timing);
    let seen = monitor.stop()?;
    let back_after = back?;
    let stale_neighbours = neighbours::stale(lab, false)?;
    let per_ip = |find: fn(&[events::AddressEvent], IpAddr) -> Vec<String>| -> Vec<String> {
        ips.iter()
            .flat_map(|ip| {
                find(&seen, *ip)
                    .into_iter()
                    .map(move |s| format!("{ip}: {s}"))
            })
            .collect()
    };
    let two_holders = per_ip(events::two_holders);
    let retaken = per_ip(events::retaken);
    let t0 = seen.first().map_or(0, |e| e.at_us);
    let path = seen
        .iter()
        .map(|e| {
            let verb = if e.added { "+" } else { "-" };
            let ms = (e.at_us - t0) as f64 / 1000.0;
            format!("{verb}{} {}@{ms:.1}", e.ip, e.gateway)
        })
        .collect();
    Ok(HealReport {
        two_holders,
        retaken,
        stale_neighbours,
        back_after,
        path,
    })
}

fn isolate_and_heal(lab: &mut Lab, ips: &[IpAddr], timing: &Timing) -> Result<Duration> {
    let gateways: Vec<&str> = lab.gateways().collect();
    let names: Vec<&str> = lab.nodes().iter().map(|n| n.name).collect();
    for (i, gw) in gateways.iter().enumerate() {
        // Each pair once: a gateway pair was cut by the first of the two.
        let others = names
            .iter()
            .filter(|n| *n != gw && !gateways[..i].contains(n));
        for other in others {
            lab.partition_underlay(gw, other)?;
        }
    }
    let fenced = cluster::wait_until(Duration::from_secs(15), || {
        ips.iter().all(|ip| cluster::holders(lab, *ip).is_empty())
    });
    let healed = lab.heal_underlay();
    fenced.context("the gateways, cut off from every node, did not let their egress IPs go")?;
    healed?;
    let back = wait_steady(lab, &Target::of(lab.family()), timing)
        .context("the lab is not steady after the heal")?;
    thread::sleep(ANNOUNCEMENTS_OVER);
    Ok(back)
}
