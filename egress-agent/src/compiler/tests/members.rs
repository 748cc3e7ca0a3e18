//! What the agent needs of the compile besides the datapath state: whom it probes and
//! counts, which addresses it may remove, who writes the statuses.

use super::*;

fn names(set: &BTreeSet<String>) -> Vec<&str> {
    set.iter().map(String::as_str).collect()
}

#[test]
fn membership_counts_ready_nodes_whose_agents_run_except_this_one() {
    let mut view = with_policies(base(), vec![policy("p", PAYMENTS)]);
    let m = compile(&view, "gw-1").membership;
    assert_eq!(
        m.nodes.len(),
        4,
        "every node with an underlay address is probed"
    );
    assert_eq!(m.nodes["gw-2"], node_ip("10.0.0.12"));
    assert_eq!(names(&m.gateways), ["gw-1", "gw-2"]);
    // Only gw-1 and gw-2 publish EgressNodes: the workers' agents do not run.
    assert_eq!(
        names(&m.expected),
        ["gw-2"],
        "not itself, not agentless nodes"
    );
    mark_not_ready(&mut view, "gw-2");
    let m = compile(&view, "gw-1").membership;
    assert!(
        m.expected.is_empty(),
        "a NotReady node does not count: {m:?}"
    );
    assert!(m.nodes.contains_key("gw-2"), "but it is still probed");
    let m = compile(&view, "worker-1").membership;
    assert_eq!(names(&m.expected), ["gw-1"]);
}

#[test]
fn every_egress_ip_a_policy_names_is_removable_accepted_or_not() {
    let broken = "namespaceSelector: {}\npodSelector: {}\n\
                  gatewaySelector: {matchLabels: {egress.dev/gateway: \"true\"}}\n\
                  rules:\n- {destinations: [\"192.0.2.0/33\"], egressIP: 203.0.113.77}\n";
    let view = with_policies(base(), vec![policy("p", PAYMENTS), policy("q", broken)]);
    let c = compile(&view, "worker-1");
    assert_eq!(
        status(&c, "q", condition::ACCEPTED).status,
        "False",
        "the test's second policy is refused"
    );
    let ips: Vec<String> = c
        .policy_egress_ips
        .iter()
        .map(|ip| ip.to_string())
        .collect();
    assert_eq!(ips, ["198.51.100.10", "203.0.113.77"]);
}

#[test]
fn the_status_writer_is_the_first_ready_live_node_by_name_on_every_node() {
    let mut view = with_policies(base(), vec![policy("p", PAYMENTS)]);
    let writer = |view: &ClusterView, dead: &[&str], me: &str| {
        let peers = PeerView {
            dead: dead.iter().map(|d| (*d).to_owned()).collect(),
            ..PeerView::default()
        };
        compile_with(view, &peers, me).status_writer
    };
    assert_eq!(writer(&view, &[], "worker-2").as_deref(), Some("gw-1"));
    assert_eq!(
        writer(&view, &[], "gw-2").as_deref(),
        Some("gw-1"),
        "the same everywhere"
    );
    assert_eq!(
        writer(&view, &["gw-1"], "gw-2").as_deref(),
        Some("gw-2"),
        "a silently dead node may look Ready: the next one writes"
    );
    mark_not_ready(&mut view, "gw-1");
    assert_eq!(writer(&view, &[], "gw-2").as_deref(), Some("gw-2"));
    for n in ["gw-2", "worker-1", "worker-2"] {
        mark_not_ready(&mut view, n);
    }
    assert_eq!(
        writer(&view, &[], "gw-2"),
        None,
        "no Ready node: nobody writes"
    );
}
