//! A [`MapState`] in plain text, one map entry per line (`MAP key -> value`, fields by
//! their ABI names), stable: what the golden tests (`egress-agent/tests/golden/`) compare,
//! so that a change to the compiler or to the conversion into ABI values shows as a
//! reviewable diff of the entries the agent would write.

use std::fmt::Write as _;

use egress_common::{
    maps::{Map, def},
    policy::{
        DestValueV4, DestValueV6, PortFilter, SelectedValueV4, SelectedValueV6, action, coverage,
    },
    underlay,
};

use super::state::{FamilyMaps, MapState};
use crate::family::{Family, V4, V6};

/// What the rendering reads of a family's values beyond [`Family`]: the prefix-length
/// sets, laid out differently in each family's ABI.
trait Shown: Family {
    /// `SELECTED_*`: (entries, lengths, flags).
    fn selected_parts(v: &<Self::Selected as Map>::Value) -> (u32, Vec<u32>, u32);
    /// `DESTS_*`: (own length, lengths of the chain).
    fn dest_parts(v: &<Self::Dests as Map>::Value) -> (u32, Vec<u32>);
    /// The `filter` of a `POLICY_*` value.
    fn filter(v: &<Self::Policy as Map>::Value) -> u16;
    /// The pod of an `ADMITTED_*` key.
    fn admitted_pod(k: &<Self::Admitted as Map>::Key) -> Self::Addr;
}

/// The bits set in `words` (bit n of word w: n + 64 w).
fn bits(words: &[u64]) -> Vec<u32> {
    (0..64 * words.len() as u32)
        .filter(|n| words[(n / 64) as usize] & (1 << (n % 64)) != 0)
        .collect()
}

impl Shown for V4 {
    fn selected_parts(v: &SelectedValueV4) -> (u32, Vec<u32>, u32) {
        (v.entries, bits(&[v.lengths]), v.flags)
    }
    fn dest_parts(v: &DestValueV4) -> (u32, Vec<u32>) {
        (v.len, bits(&[v.lengths()]))
    }
    fn filter(v: &egress_common::policy::PolicyValueV4) -> u16 {
        v.filter
    }
    fn admitted_pod(k: &egress_common::policy::AdmittedKeyV4) -> Self::Addr {
        k.pod.into()
    }
}

impl Shown for V6 {
    fn selected_parts(v: &SelectedValueV6) -> (u32, Vec<u32>, u32) {
        (v.entries, bits(&v.lengths), v.flags)
    }
    fn dest_parts(v: &DestValueV6) -> (u32, Vec<u32>) {
        (v.len, bits(&v.lengths))
    }
    fn filter(v: &egress_common::policy::PolicyValueV6) -> u16 {
        v.filter
    }
    fn admitted_pod(k: &egress_common::policy::AdmittedKeyV6) -> Self::Addr {
        k.pod.into()
    }
}

fn action_name(a: u8) -> String {
    match a {
        action::FORWARD => "forward".to_owned(),
        action::EXCLUDE => "exclude".to_owned(),
        action::NO_GATEWAY_DROP => "no-gateway-drop".to_owned(),
        action::NO_GATEWAY_PASS => "no-gateway-pass".to_owned(),
        action::DENY => "deny".to_owned(),
        a => format!("unknown({a})"),
    }
}

fn list(lengths: &[u32]) -> String {
    lengths
        .iter()
        .map(u32::to_string)
        .collect::<Vec<_>>()
        .join(",")
}

/// One `PORT_FILTERS` value: its ranges as `proto/first-last`.
fn port_filter(f: &PortFilter) -> String {
    let ranges: Vec<String> = f
        .ranges
        .iter()
        .take(f.count as usize)
        .map(|r| format!("{}/{}-{}", r.proto, r.first, r.last))
        .collect();
    format!("count={} ranges={}", f.count, ranges.join(","))
}

/// Every entry of `maps`, map by map (`NODES`, the IPv4 maps, the IPv6 maps,
/// `PORT_FILTERS`); empty maps print nothing.
pub fn maps(maps: &MapState) -> String {
    let mut s = String::new();
    for (ip, v) in &maps.nodes {
        let name = def::Nodes::SPEC.name;
        let _ = writeln!(s, "{name} {} -> node_id={}", underlay::to_ip(ip), v.node_id);
    }
    family(&mut s, &maps.v4);
    family(&mut s, &maps.v6);
    for (id, f) in &maps.port_filters {
        let name = def::PortFilters::SPEC.name;
        let _ = writeln!(s, "{name} {id} -> {}", port_filter(f));
    }
    s
}

/// One family's maps, source side first.
fn family<F: Shown>(s: &mut String, m: &FamilyMaps<F>) {
    for (k, v) in &m.policy {
        let r = F::policy_row(k, v);
        let _ = writeln!(
            s,
            "{} pod={} dst={}/{} -> gateway={} egress_ip={} rule_id={} action={} filter={}",
            F::Policy::SPEC.name,
            r.pod,
            r.dst.0,
            r.dst.1,
            underlay::to_ip(&r.gateway),
            r.egress_ip,
            r.rule_id,
            action_name(r.action),
            F::filter(v)
        );
    }
    for ((len, net), v) in &m.dests {
        let (own, lengths) = F::dest_parts(v);
        let _ = writeln!(
            s,
            "{} {}/{len} -> len={own} lengths={}",
            F::Dests::SPEC.name,
            F::Addr::from(*net),
            list(&lengths)
        );
    }
    for (pod, v) in &m.selected {
        let (entries, lengths, flags) = F::selected_parts(v);
        let _ = writeln!(
            s,
            "{} {} -> entries={entries} lengths={} flags={flags}",
            F::Selected::SPEC.name,
            F::Addr::from(*pod),
            list(&lengths)
        );
    }
    for pod in m.known_pods.keys() {
        let _ = writeln!(s, "{} {}", F::KnownPods::SPEC.name, F::Addr::from(*pod));
    }
    for (pod, v) in &m.pod_devices {
        let name = F::PodDevices::SPEC.name;
        let _ = writeln!(s, "{name} {} -> ifindex={}", F::Addr::from(*pod), v.ifindex);
    }
    for ((len, net), v) in &m.covered {
        let what = if v.covered == coverage::COVERED {
            "covered"
        } else {
            "excepted"
        };
        let name = F::Covered::SPEC.name;
        let _ = writeln!(s, "{name} {}/{len} -> {what}", F::Addr::from(*net));
    }
    for (id, v) in &m.rules {
        let (egress_ip, ifindex) = F::rule_row(v);
        let name = F::Rules::SPEC.name;
        let _ = writeln!(s, "{name} {id} -> egress_ip={egress_ip} ifindex={ifindex}");
    }
    for (ip, v) in &m.egress_ips {
        let _ = writeln!(
            s,
            "{} {} -> ifindex={} flags={}",
            F::EgressIps::SPEC.name,
            F::Addr::from(*ip),
            v.ifindex,
            v.flags
        );
    }
    for (pod, v) in &m.pod_owner {
        let _ = writeln!(
            s,
            "{} {} -> node={}",
            F::PodOwner::SPEC.name,
            F::Addr::from(*pod),
            underlay::to_ip(&v.node)
        );
    }
    for k in m.admitted.keys() {
        let _ = writeln!(
            s,
            "{} pod={} rule_id={}",
            F::Admitted::SPEC.name,
            F::admitted_pod(k),
            F::admitted_rule(k)
        );
    }
}
