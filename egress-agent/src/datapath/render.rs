//! A [`MapState`] in plain text, one map entry per line (`MAP key -> value`, fields by
//! their ABI names), stable: what the golden tests (`egress-agent/tests/golden/`) compare,
//! so that a change to the compiler or to the conversion into ABI values shows as a
//! reviewable diff of the entries the agent would write; and what `egress-agent maps`
//! prints of the pinned maps (read into the same [`MapState`]), with the `CONFIG` entry.
//! Every field of every ABI key and value is shown (the tests hold each field name the
//! types have against the lines), reserved flags only when set.

use std::fmt::Write as _;

use egress_common::{
    config::{Config, flags},
    maps::{Map, def},
    policy::{
        DestValueV4, DestValueV6, PortFilter, SelectedValueV4, SelectedValueV6, action, coverage,
        pod_device_flags,
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

/// ` flags=N` when a reserved `flags` field (0 today, room for later use) is set.
fn reserved_flags(flags: u32) -> String {
    if flags == 0 {
        String::new()
    } else {
        format!(" flags={flags}")
    }
}

/// The names of the bits set in a `CONFIG` entry's flags (`not-ready` without `READY`:
/// every program passes everything), unnamed bits by number.
fn config_flags(f: u16) -> String {
    let mut names = vec![if f & flags::READY != 0 {
        "ready".to_owned()
    } else {
        "not-ready".to_owned()
    }];
    if f & flags::UNKNOWN_PODS_DROP != 0 {
        names.push("unknown-pods-drop".to_owned());
    }
    let rest = f & !(flags::READY | flags::UNKNOWN_PODS_DROP);
    if rest != 0 {
        names.push(format!("{rest:#x}"));
    }
    names.join(",")
}

/// This node's `CONFIG` entry on one line.
pub fn config(c: &Config) -> String {
    format!(
        "{} node_ip={} tunnel_ifindex={} port_min={} port_max={} tunnel_mtu={} flags={} \
         max_flows_per_pod={}",
        def::Config::SPEC.name,
        underlay::to_ip(&c.node_ip),
        c.tunnel_ifindex,
        c.port_min,
        c.port_max,
        c.tunnel_mtu,
        config_flags(c.flags),
        c.max_flows_per_pod
    )
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
    source_side(s, m);
    gateway_side(s, m);
}

/// What `from_pod` reads: policy entries, destination chains, selected, known and bound
/// pods, covered destinations.
fn source_side<F: Shown>(s: &mut String, m: &FamilyMaps<F>) {
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
    for (pod, v) in &m.known_pods {
        let name = F::KnownPods::SPEC.name;
        let flags = reserved_flags(v.flags);
        let _ = writeln!(s, "{name} {}{flags}", F::Addr::from(*pod));
    }
    for (pod, v) in &m.pod_devices {
        let name = F::PodDevices::SPEC.name;
        // The one flag by name, any other value by number.
        let flags = if v.flags == pod_device_flags::REPLY_TO_PEER {
            "replies-into-pod".to_owned()
        } else {
            v.flags.to_string()
        };
        let pod = F::Addr::from(*pod);
        let _ = writeln!(s, "{name} {pod} -> ifindex={} flags={flags}", v.ifindex);
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
}

/// What the gateway's programs read: rules, egress addresses, pod owners, admitted pods.
fn gateway_side<F: Shown>(s: &mut String, m: &FamilyMaps<F>) {
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
    for (k, v) in &m.admitted {
        let _ = writeln!(
            s,
            "{} pod={} rule_id={}{}",
            F::Admitted::SPEC.name,
            F::admitted_pod(k),
            F::admitted_rule(k),
            reserved_flags(v.flags)
        );
    }
}

#[cfg(test)]
mod tests {
    use std::{collections::BTreeSet, net::IpAddr};

    use egress_common::policy::{
        AdmittedKeyV4, AdmittedKeyV6, AdmittedValue, CoveredValue, EgressIpValue, KnownPodValue,
        NodeValue, PodDeviceValue, PodOwnerValue, PolicyKeyV4, PolicyKeyV6, PolicyValueV4,
        PolicyValueV6, PortRange, RuleValueV4, RuleValueV6,
    };

    use super::*;
    use crate::desired::{Desired, PolicyAction, PolicyEntry};

    /// The field names in a `{:?}` of ABI keys and values (plain numbers and arrays, no
    /// strings), padding left out.
    fn field_names(debug: &str) -> BTreeSet<String> {
        debug
            .split(|c: char| !(c.is_alphanumeric() || c == '_' || c == ':'))
            .filter_map(|w| w.strip_suffix(':'))
            .filter(|w| !w.is_empty() && !w.starts_with('_'))
            .map(str::to_owned)
            .collect()
    }

    /// Fields a line shows under another name: the prefix length inside `dst=a/len`,
    /// a range's parts inside `ranges=proto/first-last`, `covered` as the word itself.
    fn shown_as(field: &str) -> &str {
        match field {
            "dst_len" => "dst",
            "proto" | "first" | "last" => "ranges",
            "covered" => "-> covered",
            f => f,
        }
    }

    /// A map of one entry.
    fn one<K: Ord, V>(k: K, v: V) -> std::collections::BTreeMap<K, V> {
        [(k, v)].into()
    }

    /// One entry in every IPv4 map, every field set (non-zero, so that reserved flags
    /// show): struct literals without `..`, so a new map or field does not compile until
    /// it is given here.
    fn v4_maps() -> FamilyMaps<V4> {
        let (pod, dst, egress) = ([10, 244, 1, 5], [192, 0, 2, 0], [192, 0, 2, 50]);
        FamilyMaps {
            policy: one(
                PolicyKeyV4 {
                    pod,
                    dst,
                    dst_len: 24,
                },
                PolicyValueV4 {
                    gateway: underlay::from_v4([10, 200, 0, 21]),
                    egress_ip: egress,
                    rule_id: 7,
                    action: action::DENY,
                    _pad: 0,
                    filter: 3,
                },
            ),
            dests: one((24, dst), DestValueV4::new(24, 1 << 24)),
            selected: one(
                pod,
                SelectedValueV4 {
                    lengths: 1 << 24,
                    entries: 1,
                    flags: 1,
                },
            ),
            rules: one(
                7,
                RuleValueV4 {
                    egress_ip: egress,
                    ifindex: 4,
                },
            ),
            pod_owner: one(
                pod,
                PodOwnerValue {
                    node: underlay::from_v4([10, 200, 0, 1]),
                },
            ),
            egress_ips: one(
                egress,
                EgressIpValue {
                    ifindex: 4,
                    flags: 1,
                },
            ),
            admitted: one(
                AdmittedKeyV4 { pod, rule_id: 7 },
                AdmittedValue { flags: 2 },
            ),
            known_pods: one([10, 244, 1, 6], KnownPodValue { flags: 2 }),
            covered: one(
                (24, dst),
                CoveredValue {
                    covered: coverage::COVERED,
                },
            ),
            pod_devices: one(
                pod,
                PodDeviceValue {
                    ifindex: 9,
                    flags: pod_device_flags::REPLY_TO_PEER,
                },
            ),
        }
    }

    /// [`v4_maps`] for IPv6.
    fn v6_maps() -> FamilyMaps<V6> {
        let octets = |a: &str| a.parse::<std::net::Ipv6Addr>().unwrap().octets();
        let (pod, dst) = (octets("fd00:244:1::5"), octets("2001:db8::"));
        let egress = octets("fd00:101::50");
        FamilyMaps {
            policy: one(
                PolicyKeyV6 {
                    pod,
                    dst,
                    dst_len: 64,
                },
                PolicyValueV6 {
                    gateway: underlay::from_v4([10, 200, 0, 21]),
                    rule_id: 9,
                    action: action::FORWARD,
                    _pad: 0,
                    filter: 4,
                    egress_ip: egress,
                },
            ),
            dests: one(
                (64, dst),
                DestValueV6 {
                    lengths: [1, 0, 0],
                    len: 64,
                    _pad: 0,
                },
            ),
            selected: one(
                pod,
                SelectedValueV6 {
                    lengths: [1, 0, 0],
                    entries: 1,
                    flags: 1,
                },
            ),
            rules: one(
                9,
                RuleValueV6 {
                    egress_ip: egress,
                    ifindex: 4,
                },
            ),
            pod_owner: one(
                pod,
                PodOwnerValue {
                    node: underlay::from_v4([10, 200, 0, 1]),
                },
            ),
            egress_ips: one(
                egress,
                EgressIpValue {
                    ifindex: 4,
                    flags: 1,
                },
            ),
            admitted: one(
                AdmittedKeyV6 { pod, rule_id: 9 },
                AdmittedValue { flags: 2 },
            ),
            known_pods: one(pod, KnownPodValue { flags: 2 }),
            covered: one(
                (64, dst),
                CoveredValue {
                    covered: coverage::COVERED,
                },
            ),
            pod_devices: one(
                pod,
                PodDeviceValue {
                    ifindex: 9,
                    flags: pod_device_flags::REPLY_TO_PEER,
                },
            ),
        }
    }

    /// One entry in every map of both families and the shared ones.
    fn every_map() -> MapState {
        let range = PortRange {
            proto: 6,
            _pad: 0,
            first: 80,
            last: 443,
        };
        let mut filter = PortFilter {
            count: 1,
            ranges: Default::default(),
        };
        filter.ranges[0] = range;
        MapState {
            v4: v4_maps(),
            v6: v6_maps(),
            nodes: one(
                underlay::from_v4([10, 200, 0, 21]),
                NodeValue { node_id: 3 },
            ),
            port_filters: one(3, filter),
        }
    }

    #[test]
    fn every_field_of_every_map_is_shown() {
        let state = every_map();
        let text = maps(&state);
        let mut entries = state.v4.debug_entries();
        entries.extend(state.v6.debug_entries());
        for (ip, v) in &state.nodes {
            entries.push((def::Nodes::SPEC.name, format!("{ip:?} {v:?}")));
        }
        for (id, f) in &state.port_filters {
            entries.push((def::PortFilters::SPEC.name, format!("{id:?} {f:?}")));
        }
        let (sizes, lines) = (state.sizes().count(), text.lines().count());
        assert_eq!(entries.len(), sizes, "one entry in every map");
        assert_eq!(lines, sizes, "one line per entry:\n{text}");
        for (map, debug) in entries {
            let line = text
                .lines()
                .find(|l| l.split(' ').next() == Some(map))
                .unwrap_or_else(|| panic!("no line of {map} in:\n{text}"));
            for field in field_names(&debug) {
                let shown = shown_as(&field);
                assert!(
                    line.contains(&format!("{shown}="))
                        || (shown.contains(' ') && line.contains(shown)),
                    "{map}: field {field} of {debug} is not shown in {line:?}"
                );
            }
        }
        for want in [
            "action=deny filter=3",
            "action=forward filter=4",
            "-> count=1 ranges=6/80-443",
        ] {
            assert!(text.contains(want), "{want:?} in:\n{text}");
        }
    }

    #[test]
    fn every_config_field_is_shown() {
        let c = Config {
            node_ip: underlay::from_v4([10, 200, 0, 1]),
            tunnel_ifindex: 5,
            port_min: 1024,
            port_max: 65_000,
            tunnel_mtu: 1450,
            flags: flags::READY | flags::UNKNOWN_PODS_DROP | 1 << 7,
            max_flows_per_pod: 100,
        };
        let line = config(&c);
        for field in field_names(&format!("{c:?}")) {
            assert!(line.contains(&format!("{field}=")), "{field} in {line:?}");
        }
        assert_eq!(
            line,
            "CONFIG node_ip=10.200.0.1 tunnel_ifindex=5 port_min=1024 port_max=65000 \
             tunnel_mtu=1450 flags=ready,unknown-pods-drop,0x80 max_flows_per_pod=100"
        );
        let not_ready = config(&Config { flags: 0, ..c });
        assert!(not_ready.contains(" flags=not-ready "), "{not_ready}");
    }

    /// Every action the agent writes; the match fails to compile when an action is added
    /// and not listed here.
    fn every_action() -> Vec<PolicyAction> {
        let all = [
            PolicyAction::Forward,
            PolicyAction::Exclude,
            PolicyAction::NoGatewayDrop,
            PolicyAction::NoGatewayPass,
            PolicyAction::Deny,
        ];
        for a in all {
            match a {
                PolicyAction::Forward
                | PolicyAction::Exclude
                | PolicyAction::NoGatewayDrop
                | PolicyAction::NoGatewayPass
                | PolicyAction::Deny => {}
            }
        }
        all.into()
    }

    #[test]
    fn every_action_is_named_with_its_port_filter() {
        let mut d = Desired::default();
        let actions = every_action();
        for (i, action) in actions.iter().enumerate() {
            let pod: std::net::Ipv4Addr = format!("10.244.1.{}", i + 1).parse().unwrap();
            d.v4.policy.insert(
                (pod, "192.0.2.0/24".parse().unwrap()),
                PolicyEntry {
                    action: *action,
                    gateway: Some(IpAddr::from([10, 200, 0, 21])),
                    egress_ip: Some("192.0.2.50".parse().unwrap()),
                    rule_id: 7,
                    filter: u16::try_from(i).unwrap() + 1,
                },
            );
        }
        let (state, _) = MapState::from_desired(&d, |_| Some(4));
        let text = maps(&state);
        let named: BTreeSet<&str> = text
            .lines()
            .filter_map(|l| l.split(" action=").nth(1))
            .map(|rest| rest.split(' ').next().unwrap_or_default())
            .collect();
        assert_eq!(named.len(), actions.len(), "a name per action:\n{text}");
        assert!(!named.iter().any(|n| n.starts_with("unknown")), "{named:?}");
        for (i, _) in actions.iter().enumerate() {
            let filter = format!("filter={}", i + 1);
            assert!(text.contains(&filter), "{filter} in:\n{text}");
        }
        assert_eq!(action_name(0), "unknown(0)");
    }
}
