//! Addresses a cloud provider reports (issue 44, item 5): the vSphere provider, like
//! others, lists every address of a VM's NICs in `Node.status.addresses`, a held egress
//! IP included. A held egress IP is no address of the node that lists it, nor its
//! underlay; any other Node address still is.

use super::*;
use crate::liveness::hello::Claim;

/// Puts `ip` first in `name`'s Node addresses, as `kind`.
fn list_first(view: &mut ClusterView, name: &str, kind: &str, ip: &str) {
    let addrs = node_mut(view, name)
        .status
        .as_mut()
        .and_then(|s| s.addresses.as_mut())
        .expect("the Node's status.addresses");
    addrs.insert(
        0,
        NodeAddress {
            type_: kind.to_owned(),
            address: ip.to_owned(),
        },
    );
}

/// What every node's compile must show while `holder` holds A at epoch 4 and its
/// underlay is `underlay`: the same holder, Ready, the real underlay in the tunnel's
/// node ids and in the membership.
fn assert_served(view: &ClusterView, holder: &str, underlay: &str) {
    let underlay = node_ip(underlay);
    let a: IpAddr = A.parse().expect("ip");
    for me in ["worker-1", "gw-1", "gw-2"] {
        let c = compile_with(view, &PeerView::default(), me);
        let h = holder_record(&c);
        assert_eq!(
            (h.node.as_str(), h.epoch),
            (holder, 4),
            "{me}: {:?}",
            c.problems
        );
        let ready = status(&c, "payments", "Ready");
        assert_ne!(
            ready.reason,
            reason::EGRESS_IP_IS_NODE_ADDRESS,
            "{me}: {ready:?}"
        );
        assert!(
            c.desired.nodes.contains_key(&underlay),
            "{me}: {:?}",
            c.desired.nodes
        );
        assert!(
            !c.desired.nodes.contains_key(&a),
            "{me}: {:?}",
            c.desired.nodes
        );
        assert_eq!(c.membership.nodes.get(holder), Some(&underlay), "{me}");
        assert!(!c.membership.aliases[holder].contains(&a), "{me}");
    }
}

#[test]
fn a_holder_whose_node_lists_its_egress_ip_first_keeps_serving_it() {
    for kind in ["InternalIP", "ExternalIP"] {
        let mut view = held_view("gw-1", 4, None);
        list_first(&mut view, "gw-1", kind, A);
        assert_served(&view, "gw-1", "10.0.0.11");
    }
}

#[test]
fn an_egress_ip_claimed_only_in_a_hello_is_no_node_address_either() {
    let mut view = held_view("gw-1", 4, None);
    list_first(&mut view, "gw-1", "InternalIP", A);
    let mut peers = PeerView::default();
    let mut report = Report::default();
    report.claims.insert(
        A.parse().expect("ip"),
        Claim {
            interface: "ens224".to_owned(),
            epoch: 4,
        },
    );
    peers.reports.insert("gw-1".to_owned(), report);
    for en in &mut view.egress_nodes {
        en.status.as_mut().expect("status").egress_ips.clear();
    }
    let c = compile_with(&view, &peers, "worker-1");
    assert_eq!(
        holder_of(&c, A).as_deref(),
        Some("gw-1"),
        "{:?}",
        c.problems
    );
    assert_eq!(c.membership.nodes.get("gw-1"), Some(&node_ip("10.0.0.11")));
}

#[test]
fn a_stale_copy_on_the_old_holders_node_is_not_its_address() {
    // The egress IP moved to gw-2; the provider still lists it on gw-1.
    let mut view = held_view("gw-2", 4, None);
    list_first(&mut view, "gw-1", "InternalIP", A);
    assert_served(&view, "gw-2", "10.0.0.12");
    let c = compile_with(&view, &PeerView::default(), "worker-1");
    assert_eq!(c.membership.nodes.get("gw-1"), Some(&node_ip("10.0.0.11")));
}

#[test]
fn a_node_address_no_one_holds_is_still_refused() {
    let mut view = with_policies(base(), vec![policy("payments", PAYMENTS)]);
    list_first(&mut view, "gw-1", "ExternalIP", A);
    let c = compile_with(&view, &PeerView::default(), "worker-1");
    let ready = status(&c, "payments", "Ready");
    assert_eq!(ready.reason, reason::EGRESS_IP_IS_NODE_ADDRESS, "{ready:?}");
    assert!(
        ready.message.contains("node gw-1 (ExternalIP)"),
        "{ready:?}"
    );
}
