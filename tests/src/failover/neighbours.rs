//! What the secondary networks believe: the neighbour entries that the hosts and routers
//! there (which keep them as switches do: `lab::build`) hold for each egress IP, against
//! the MAC of the interface that holds it now.

use std::net::IpAddr;

use anyhow::{Context as _, Result};
use serde_json::Value;

use crate::{
    cluster,
    lab::{Lab, addr, addr6},
};

/// The members of a network that must point at the holder of its egress IP, and whether
/// each must have an entry at all (host A: the failover flows reach it) or is checked
/// where it has one.
type Watchers = &'static [(&'static str, bool)];
const ON_A: Watchers = &[("host-a", true)];
const ON_B: Watchers = &[("host-b", false), ("rtr-b", false)];

/// Each egress IP of the lab's families, with the members that must point at its holder.
fn watched(lab: &Lab) -> Vec<(IpAddr, Watchers)> {
    let family = lab.family();
    let mut out: Vec<(IpAddr, Watchers)> = Vec::new();
    if family.has_v4() {
        out.push((addr::EGRESS_IP_A.into(), ON_A));
        out.push((addr::EGRESS_IP_B.into(), ON_B));
    }
    if family.has_v6() {
        out.push((addr6::EGRESS_IP_A.into(), ON_A));
        out.push((addr6::EGRESS_IP_B.into(), ON_B));
    }
    out
}

/// Every neighbour entry on the secondary networks that does not point at the holder of
/// its egress IP, in words (`host-a: 192.168.101.50 at 02:..:01 (gw1 sec-a), held by gw2
/// sec-a (02:..:02)`); empty when the network believes what is true. `required`: the
/// host of egress IP A must have an entry (flows went through it).
pub fn stale(lab: &Lab, required: bool) -> Result<Vec<String>> {
    let macs = gateway_macs(lab)?;
    let name_of = |mac: &str| {
        macs.iter()
            .find(|(_, _, m)| m == mac)
            .map_or_else(|| "no gateway".to_owned(), |(g, i, _)| format!("{g} {i}"))
    };
    let mut out = Vec::new();
    for (ip, members) in watched(lab) {
        let holders = cluster::holders(lab, ip);
        let [(gw, ifc)] = holders.as_slice() else {
            out.push(format!("{ip}: {} holders {holders:?}", holders.len()));
            continue;
        };
        let want = macs
            .iter()
            .find(|(g, i, _)| g == gw && i == ifc)
            .map(|(_, _, m)| m.clone())
            .with_context(|| format!("no MAC for {gw} {ifc}"))?;
        for (member, must) in members {
            match entry(lab, member, ip)? {
                Some(mac) if mac == want => {}
                Some(mac) => out.push(format!(
                    "{member}: {ip} at {mac} ({}), held by {gw} {ifc} ({want})",
                    name_of(&mac)
                )),
                None if required && *must => {
                    out.push(format!("{member}: no usable neighbour entry for {ip}"));
                }
                None => {}
            }
        }
    }
    Ok(out)
}

/// The link-layer address `member`'s neighbour entry for `ip` holds, if it has a usable
/// one (not FAILED or INCOMPLETE).
pub fn entry(lab: &Lab, member: &str, ip: IpAddr) -> Result<Option<String>> {
    let out = lab.exec(member, "ip", &["-j", "neigh", "show", &ip.to_string()])?;
    let entries: Value = serde_json::from_slice(&out.stdout)
        .with_context(|| format!("failed to parse `ip -j neigh` of {member}"))?;
    let usable = entries.as_array().into_iter().flatten().find(|e| {
        let states = e["state"].as_array().cloned().unwrap_or_default();
        !states.iter().any(|s| s == "FAILED" || s == "INCOMPLETE")
    });
    Ok(usable.and_then(|e| e["lladdr"].as_str().map(str::to_owned)))
}

/// (gateway, interface, MAC) of every gateway's interfaces.
fn gateway_macs(lab: &Lab) -> Result<Vec<(String, String, String)>> {
    let mut out = Vec::new();
    for gw in lab.gateways() {
        let links = lab.exec(gw, "ip", &["-j", "link", "show"])?;
        let links: Value = serde_json::from_slice(&links.stdout)
            .with_context(|| format!("failed to parse `ip -j link` of {gw}"))?;
        for l in links.as_array().into_iter().flatten() {
            if let (Some(name), Some(mac)) = (l["ifname"].as_str(), l["address"].as_str()) {
                out.push((gw.to_owned(), name.to_owned(), mac.to_owned()));
            }
        }
    }
    Ok(out)
}
