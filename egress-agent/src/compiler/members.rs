//! Who takes part, as the agent needs it after a compile: whom this node probes and
//! counts for its quorum, which addresses any policy names (the only ones an agent may
//! remove), and which agent writes the policy statuses. Derived from the same view as the
//! rest of [`super::Compiled`], so the agent never goes back to the view for them.

use std::{collections::BTreeSet, net::IpAddr};

use super::nodes::{gateway_candidates, node_addresses, node_ready, node_underlay};
use crate::{
    liveness::Membership,
    source::{ClusterView, PodScope},
};

/// Whom the node named `me` probes and counts (see [`crate::liveness::tracker`]): every
/// node with an underlay address, its other addresses, the possible gateways, and the
/// Ready nodes other than `me` whose agents run (they have an EgressNode).
pub fn membership(view: &ClusterView, me: &str, held: &BTreeSet<IpAddr>) -> Membership {
    let agents: BTreeSet<&str> = view
        .egress_nodes
        .iter()
        .filter_map(|n| n.metadata.name.as_deref())
        .collect();
    Membership {
        nodes: view
            .nodes
            .iter()
            .filter_map(|n| Some((n.metadata.name.clone()?, node_underlay(n, held)?)))
            .collect(),
        aliases: view
            .nodes
            .iter()
            .filter_map(|n| {
                n.status.as_ref()?.addresses.as_ref()?;
                let ips = node_addresses(n, held).map(|(ip, _)| ip).collect();
                Some((n.metadata.name.clone()?, ips))
            })
            .collect(),
        gateways: gateway_candidates(view),
        expected: view
            .nodes
            .iter()
            .filter(|n| node_ready(n))
            .filter_map(|n| n.metadata.name.as_deref())
            .filter(|n| *n != me && agents.contains(n))
            .map(str::to_owned)
            .collect(),
        speakers: view
            .egress_nodes
            .iter()
            .filter(|n| {
                n.status
                    .as_ref()
                    .and_then(|s| s.hello_version)
                    .is_some_and(|v| v >= 2)
            })
            .filter_map(|n| n.metadata.name.clone())
            .collect(),
    }
}

/// Every egress IP (both families) that any policy names, accepted or not: the only
/// addresses an agent may remove from an interface (with those it holds or published).
pub fn policy_egress_ips(view: &ClusterView) -> BTreeSet<IpAddr> {
    view.policies
        .iter()
        .flat_map(|p| p.spec.rules.iter())
        .flat_map(|r| r.egress_ip.iter().chain(&r.egress_ips))
        .filter_map(|t| t.parse().ok())
        .collect()
}

/// The one agent that writes policy statuses and Events: the first Ready node by name
/// that its peers do not know to be dead (`dead`), so that agents whose views differ for a
/// moment do not fight over the status. A silently dead node may still look Ready: the
/// next one writes.
pub fn status_writer(view: &ClusterView, dead: &BTreeSet<String>) -> Option<String> {
    view.nodes
        .iter()
        .filter(|n| node_ready(n))
        .filter_map(|n| n.metadata.name.as_deref())
        .filter(|name| !dead.contains(*name))
        .min()
        .map(str::to_owned)
}

/// Which pods the node named `me` needs, as far as `view` tells without liveness or the
/// policies' last accepted versions: what the Kubernetes source watches before the agent's
/// first compile, and whenever the view alone says more is needed than the compile last
/// asked for. The compile's own answer ([`super::Compiled::pods_needed`]) adds the
/// gateways of policies served from a last accepted version, and the status writer as
/// the probes elect it.
pub fn pods_needed(view: &ClusterView, me: &str) -> PodScope {
    let gateway = gateway_candidates(view).contains(me);
    needed(view, gateway, me, &BTreeSet::new())
}

/// Every pod of the cluster, for:
///
/// * a gateway (`gateway`: some policy's gatewaySelector, current or served, selects
///   `me`): it admits the selected pods of every node and checks each tunneled packet's
///   inner source against its owner;
/// * the status writer ([`status_writer`] with `dead`): statuses count pods cluster-wide
///   and report their conflicts;
/// * every node of a cluster whose CIDRs are not declared (`cluster_cidrs` empty: no
///   `--cluster-cidr`, no OpenShift Network): the compiler carves each pod address that
///   no cluster or node pod CIDR holds out of every destination, on every node, so a
///   worker would need every pod's address.
///
/// Else only the node's own pods: its policy entries, NetworkPolicy restrictions, known
/// pods (`--unknown-pods drop`) and pod owners (the return path's check) are of its own
/// pods, and a NetworkPolicy's pod or namespace peers never allow a redirected
/// destination (`compiler::netpol`).
pub(super) fn needed(
    view: &ClusterView,
    gateway: bool,
    me: &str,
    dead: &BTreeSet<String>,
) -> PodScope {
    let writer = status_writer(view, dead).as_deref() == Some(me);
    if gateway || writer || view.cluster_cidrs.is_empty() {
        PodScope::Cluster
    } else {
        PodScope::Node
    }
}
