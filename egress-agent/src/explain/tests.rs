//! `explain` on crafted views: a cluster of two workers and two gateways, one policy (or
//! NetworkPolicy) per case, and what it must say.

use std::net::IpAddr;

use super::*;
use crate::source::yaml;

/// Two workers, two gateways with two secondary networks each; pods of team payments
/// (shop) and another namespace.
const CLUSTER: &str = r#"
apiVersion: v1
kind: Namespace
metadata: {name: shop, labels: {team: payments}}
---
apiVersion: v1
kind: Namespace
metadata: {name: other}
---
apiVersion: v1
kind: Node
metadata: {name: worker-1}
spec: {podCIDRs: [10.244.1.0/24]}
status:
  addresses: [{type: InternalIP, address: 10.0.0.1}]
  conditions: [{type: Ready, status: "True"}]
---
apiVersion: v1
kind: Node
metadata: {name: worker-2}
spec: {podCIDRs: [10.244.2.0/24]}
status:
  addresses: [{type: InternalIP, address: 10.0.0.2}]
  conditions: [{type: Ready, status: "True"}]
---
apiVersion: v1
kind: Node
metadata: {name: gw-1, labels: {egress.dev/gateway: "true"}}
spec: {podCIDRs: [10.244.11.0/24]}
status:
  addresses: [{type: InternalIP, address: 10.0.0.11}]
  conditions: [{type: Ready, status: "True"}]
---
apiVersion: v1
kind: Node
metadata: {name: gw-2, labels: {egress.dev/gateway: "true"}}
spec: {podCIDRs: [10.244.12.0/24]}
status:
  addresses: [{type: InternalIP, address: 10.0.0.12}]
  conditions: [{type: Ready, status: "True"}]
---
apiVersion: v1
kind: Pod
metadata: {name: api-1, namespace: shop, labels: {app: api}}
spec: {nodeName: worker-1, containers: [{name: c, image: x}]}
status: {phase: Running, podIPs: [{ip: 10.244.1.11}]}
---
apiVersion: v1
kind: Pod
metadata: {name: web-1, namespace: shop, labels: {app: web}}
spec: {nodeName: worker-1, containers: [{name: c, image: x}]}
status: {phase: Running, podIPs: [{ip: 10.244.1.12}]}
---
apiVersion: v1
kind: Pod
metadata: {name: api-2, namespace: shop, labels: {app: api}}
spec: {nodeName: worker-2, containers: [{name: c, image: x}]}
status: {phase: Running, podIPs: [{ip: 10.244.2.11}]}
---
apiVersion: v1
kind: Pod
metadata: {name: api-9, namespace: other, labels: {app: api}}
spec: {nodeName: worker-2, containers: [{name: c, image: x}]}
status: {phase: Running, podIPs: [{ip: 10.244.2.99}]}
---
apiVersion: v1
kind: Pod
metadata: {name: api-3, namespace: shop, labels: {app: api}}
spec: {nodeName: worker-2, containers: [{name: c, image: x}]}
status: {phase: Pending}
---
apiVersion: egress.dev/v1alpha1
kind: EgressNode
metadata: {name: gw-1}
spec: {underlayIP: 10.0.0.11}
status:
  interfaces:
  - {name: ens224, up: true, addresses: ["198.51.100.2/24"], routes: ["198.51.100.0/24"]}
  - {name: ens256, up: true, addresses: ["203.0.113.2/24"], routes: ["203.0.113.0/24"]}
---
apiVersion: egress.dev/v1alpha1
kind: EgressNode
metadata: {name: gw-2}
spec: {underlayIP: 10.0.0.12}
status:
  interfaces:
  - {name: ens224, up: true, addresses: ["198.51.100.3/24"], routes: ["198.51.100.0/24"]}
  - {name: ens256, up: true, addresses: ["203.0.113.3/24"], routes: ["203.0.113.0/24"]}
"#;

/// The policy `payments` (team payments, app api) with `rules` (YAML), and `extra`
/// documents.
fn view(rules: &str, extra: &str) -> ClusterView {
    let policy = format!(
        "apiVersion: egress.dev/v1alpha1\nkind: EgressGatewayPolicy\n\
         metadata: {{name: payments, generation: 1}}\nspec:\n  \
         namespaceSelector: {{matchLabels: {{team: payments}}}}\n  \
         podSelector: {{matchLabels: {{app: api}}}}\n  \
         gatewaySelector: {{matchLabels: {{egress.dev/gateway: \"true\"}}}}\n{rules}"
    );
    let text = format!("{CLUSTER}---\n{policy}\n---\n{extra}");
    let snapshot = yaml::load_str("cluster.yaml", &text);
    assert!(snapshot.errors.is_empty(), "{:?}", snapshot.errors);
    snapshot.view
}

const EGRESS_IP: &str = "  rules:\n  - destinations: [\"192.0.2.0/24\"]\n    \
                         except: [\"192.0.2.128/28\"]\n    egressIP: 198.51.100.10\n";

fn ask(view: &ClusterView, pod: &str, to: &str) -> Explanation {
    let pod: PodRef = pod.parse().expect("test pod");
    let to: Destination = to.parse().expect("test destination");
    explain(view, &pod, to).expect("explains")
}

fn matched(e: &Explanation) -> &Match {
    match &e.outcome {
        Outcome::Matched(m) => m,
        other => panic!("expected a match, got {other:?}"),
    }
}

fn misses(e: &Explanation) -> &[Miss] {
    match &e.outcome {
        Outcome::Untouched(m) => m,
        other => panic!("expected no match, got {other:?}"),
    }
}

fn ip(s: &str) -> IpAddr {
    s.parse().expect("test IP")
}

fn net(s: &str) -> IpNet {
    s.parse().expect("test prefix")
}

/// The holder of `egress_ip`, as the compiler places it.
fn holder(view: &ClusterView, egress_ip: &str) -> String {
    compiler::compile(view, "worker-1")
        .holders
        .iter()
        .find(|h| h.ip == ip(egress_ip))
        .map(|h| h.node.clone())
        .expect("held")
}

#[test]
fn an_egress_ip_rule_names_policy_prefix_gateway_interface_and_address() {
    let v = view(EGRESS_IP, "");
    let e = ask(&v, "shop/api-1", "192.0.2.7:443");
    let m = matched(&e);
    let gw = holder(&v, "198.51.100.10");
    assert_eq!(e.node.as_deref(), Some("worker-1"));
    assert_eq!(e.pod_ip, Some(ip("10.244.1.11")));
    assert_eq!((m.policy.as_str(), m.rule), ("payments", 0));
    assert_eq!(m.action, PolicyAction::Forward);
    assert_eq!(m.prefix, net("192.0.2.0/24"));
    assert_eq!(m.origin, Origin::Listed(net("192.0.2.0/24")));
    assert_eq!(m.target, Target::EgressIp(ip("198.51.100.10")));
    assert_eq!(m.egress_ip, Some(ip("198.51.100.10")));
    let hop = m.gateway.as_ref().expect("a gateway");
    assert_eq!(hop.node, gw);
    assert_eq!(hop.interface.as_deref(), Some("ens224"));
    assert!(!hop.local);
    assert_eq!(m.network_policy, NetworkPolicyVerdict::NotRestricted);
    assert_eq!(m.failure_policy, FailurePolicy::Drop);
    assert!(m.conditions.is_empty(), "{:?}", m.conditions);
    let text = render::text(&e);
    for want in [
        "pod:            shop/api-1 (10.244.1.11, on node worker-1)\n",
        "destination:    192.0.2.7:443/tcp\n",
        &format!("verdict:        redirected: leaves gateway {gw} by ens224 as 198.51.100.10\n"),
        "matched:        192.0.2.0/24 (destination 192.0.2.0/24 of the rule; the longest of \
         the pod's 2 prefixes containing it)\n",
        "egress IP:      198.51.100.10 (the rule's egressIP)\n",
        "NetworkPolicy:  allowed (no NetworkPolicy selects the pod for Egress)\n",
        "no gateway:     failurePolicy Drop: dropped and counted (DROP_NO_GATEWAY)",
    ] {
        assert!(text.contains(want), "missing {want:?} in\n{text}");
    }
}

#[test]
fn the_longest_prefix_wins_an_except_inside_a_destination() {
    let v = view(EGRESS_IP, "");
    let e = ask(&v, "shop/api-1", "192.0.2.130");
    let m = matched(&e);
    assert_eq!(m.action, PolicyAction::Exclude);
    assert_eq!(m.prefix, net("192.0.2.128/28"));
    assert_eq!(m.origin, Origin::Except(net("192.0.2.128/28")));
    assert_eq!(m.network_policy, NetworkPolicyVerdict::LeftToCni);
    assert!(m.gateway.is_none());
    let text = render::text(&e);
    assert!(
        text.contains("verdict:        untouched: an except of the policy"),
        "{text}"
    );
    assert!(!text.contains("no gateway:"), "{text}");
    assert!(!text.contains("egress IP:"), "{text}");
}

#[test]
fn egress_ips_name_the_address_each_pod_hashes_to() {
    // As in the golden case egress-ips: api-1 hashes to .11 (gw-1), api-2 to .10 (gw-2).
    let v = view(
        "  rules:\n  - destinations: [\"192.0.2.0/24\"]\n    \
         egressIPs: [198.51.100.10, 198.51.100.11]\n",
        "",
    );
    let all = vec![ip("198.51.100.10"), ip("198.51.100.11")];
    for (pod, want, gw, underlay) in [
        ("shop/api-1", "198.51.100.11", "gw-1", "10.0.0.11"),
        ("shop/api-2", "198.51.100.10", "gw-2", "10.0.0.12"),
    ] {
        let e = ask(&v, pod, "192.0.2.7");
        let m = matched(&e);
        assert_eq!(m.target, Target::EgressIps(all.clone()), "{pod}");
        assert_eq!(m.egress_ip, Some(ip(want)), "{pod}");
        let hop = m.gateway.as_ref().expect("a gateway");
        assert_eq!(
            (hop.node.as_str(), hop.underlay),
            (gw, Some(ip(underlay))),
            "{pod}"
        );
        let text = render::text(&e);
        assert!(
            text.contains(&format!(
                "egress IP:      {want}, the one of egressIPs 198.51.100.10, 198.51.100.11 \
                 this pod's address hashes to"
            )),
            "{text}"
        );
    }
}

#[test]
fn an_interface_rule_leaves_with_the_gateways_own_address() {
    let v = view(
        "  rules:\n  - destinations: [\"172.16.0.0/16\"]\n    interface: ens256\n",
        "",
    );
    let e = ask(&v, "shop/api-1", "172.16.4.4:8080");
    let m = matched(&e);
    assert_eq!(m.target, Target::Interface("ens256".to_owned()));
    let hop = m.gateway.as_ref().expect("a gateway");
    let own = if hop.node == "gw-1" {
        "203.0.113.2"
    } else {
        "203.0.113.3"
    };
    assert_eq!(m.egress_ip, Some(ip(own)));
    assert_eq!(hop.interface.as_deref(), Some("ens256"));
    let text = render::text(&e);
    assert!(
        text.contains(&format!(
            "egress IP:      {own}, the gateway's own address on ens256 (interface rule"
        )),
        "{text}"
    );
}

#[test]
fn pods_not_selected_say_which_selector() {
    let v = view(EGRESS_IP, "");
    let e = ask(&v, "shop/web-1", "192.0.2.7");
    assert_eq!(
        misses(&e),
        [Miss::PodNotSelected {
            policy: "payments".to_owned()
        }]
    );
    let e = ask(&v, "other/api-9", "192.0.2.7");
    assert_eq!(
        misses(&e),
        [Miss::NamespaceNotSelected {
            policy: "payments".to_owned()
        }]
    );
    let text = render::text(&e);
    assert!(
        text.contains(
            "why:            policy payments does not select the pod's namespace \
             (spec.namespaceSelector)"
        ),
        "{text}"
    );
}

#[test]
fn a_destination_no_rule_covers_lists_the_pods_prefixes() {
    let v = view(EGRESS_IP, "");
    let e = ask(&v, "shop/api-1", "8.8.8.8:53/udp");
    assert_eq!(
        misses(&e),
        [Miss::NotCovered {
            policy: "payments".to_owned(),
            prefixes: vec![net("192.0.2.0/24")],
        }]
    );
    assert!(render::text(&e).contains(
        "policy payments selects the pod, but the destination is in none of its \
             prefixes for it (192.0.2.0/24)"
    ));
}

#[test]
fn a_refused_policy_names_its_reason() {
    let v = view(
        "  rules:\n  - destinations: [\"192.0.2.0/33\"]\n    egressIP: 198.51.100.10\n",
        "",
    );
    let e = ask(&v, "shop/api-1", "192.0.2.7");
    let [
        Miss::NotAccepted {
            policy,
            reason,
            message,
        },
    ] = misses(&e)
    else {
        panic!("expected a refused policy: {:?}", e.outcome);
    };
    assert_eq!(policy, "payments");
    assert_eq!(reason, compiler::reason::INVALID_CIDR);
    assert!(message.contains("rules[0].destinations[0]"), "{message}");
    assert!(
        render::text(&e).contains("why:            policy payments is not accepted (InvalidCIDR: ")
    );
}

#[test]
fn without_a_gateway_the_failure_policy_decides() {
    for (failure, action, verdict) in [
        (
            "Drop",
            PolicyAction::NoGatewayDrop,
            "dropped: the rule has no usable gateway",
        ),
        (
            "Fallthrough",
            PolicyAction::NoGatewayPass,
            "untouched: the rule has no usable gateway (failurePolicy Fallthrough",
        ),
    ] {
        let policy = format!(
            "apiVersion: egress.dev/v1alpha1\nkind: EgressGatewayPolicy\n\
             metadata: {{name: payments, generation: 1}}\nspec:\n  \
             podSelector: {{matchLabels: {{app: api}}}}\n  \
             gatewaySelector: {{matchLabels: {{role: none}}}}\n  \
             failurePolicy: {failure}\n  \
             rules:\n  - destinations: [\"192.0.2.0/24\"]\n    egressIP: 198.51.100.10\n"
        );
        let snapshot = yaml::load_str("c.yaml", &format!("{CLUSTER}---\n{policy}"));
        let e = ask(&snapshot.view, "shop/api-1", "192.0.2.7");
        let m = matched(&e);
        assert_eq!(m.action, action, "{failure}");
        assert!(m.gateway.is_none());
        assert!(
            m.conditions
                .iter()
                .any(|c| c.0 == condition::READY && c.1 == "False"),
            "{:?}",
            m.conditions
        );
        let text = render::text(&e);
        assert!(text.contains(verdict), "{text}");
        assert!(text.contains("condition:      Ready=False "), "{text}");
        assert!(
            text.contains(
                "egress IP:      198.51.100.10 (the rule's egressIP); no gateway serves it now"
            ),
            "{text}"
        );
    }
}

/// A NetworkPolicy of shop isolating app=api for egress: TCP 443 to 192.0.2.0/24 only.
const HTTPS_ONLY: &str = r#"
apiVersion: networking.k8s.io/v1
kind: NetworkPolicy
metadata: {name: https-only, namespace: shop}
spec:
  podSelector: {matchLabels: {app: api}}
  policyTypes: [Egress]
  egress:
  - to: [{ipBlock: {cidr: 192.0.2.0/25}}]
    ports: [{protocol: TCP, port: 443}]
"#;

#[test]
fn network_policies_allow_or_deny_the_asked_port() {
    let v = view(EGRESS_IP, HTTPS_ONLY);
    let by = vec!["shop/https-only".to_owned()];
    let e = ask(&v, "shop/api-1", "192.0.2.7:443/tcp");
    let m = matched(&e);
    assert_eq!(m.prefix, net("192.0.2.0/25"));
    assert_eq!(m.origin, Origin::Listed(net("192.0.2.0/24")));
    assert_eq!(
        m.network_policy,
        NetworkPolicyVerdict::Ports {
            by: by.clone(),
            ports: vec![(6, 443, 443)],
            asked: Some(true)
        }
    );
    assert!(render::text(&e).contains("verdict:        redirected"));

    let e = ask(&v, "shop/api-1", "192.0.2.7:53/udp");
    let m = matched(&e);
    assert!(m.network_policy.drops());
    let text = render::text(&e);
    assert!(
        text.contains("verdict:        dropped: its egress NetworkPolicies do not allow it"),
        "{text}"
    );
    assert!(
        text.contains(
            "NetworkPolicy:  denied: shop/https-only allow only tcp/443 there \
             (DROP_NETWORK_POLICY)"
        ),
        "{text}"
    );

    // Outside the ipBlock: nothing is allowed there.
    let e = ask(&v, "shop/api-1", "192.0.2.200:443");
    let m = matched(&e);
    assert_eq!(m.action, PolicyAction::Deny);
    assert_eq!(m.network_policy, NetworkPolicyVerdict::Denied { by });
    assert!(render::text(&e).contains(
        "NetworkPolicy:  denied: shop/https-only isolate the pod for Egress and allow \
             nothing toward it"
    ));
}

#[test]
fn pods_the_datapath_cannot_steer_say_why() {
    let v = view(EGRESS_IP, "");
    let e = ask(&v, "shop/api-3", "192.0.2.7");
    assert_eq!(e.outcome, Outcome::NotSteered(NotSteered::NotRunning));
    let e = ask(&v, "shop/api-1", "2001:db8::7");
    assert_eq!(
        e.outcome,
        Outcome::NotSteered(NotSteered::NoAddressOfFamily {
            family: "IPv6",
            ips: vec![ip("10.244.1.11")]
        })
    );
    assert!(render::text(&e).contains("why:            the pod has no IPv6 address"));
}

#[test]
fn an_unknown_pod_is_an_error_naming_where_its_name_is() {
    let v = view(EGRESS_IP, "");
    let to: Destination = "192.0.2.7".parse().expect("destination");
    let e = explain(&v, &"default/api-1".parse().expect("pod"), to).expect_err("unknown");
    assert_eq!(
        e.to_string(),
        "failed to find pod default/api-1: no such pod in the view (a pod of that name is \
         in namespace shop: did you mean --pod shop/...?)"
    );
    let e = explain(&v, &"shop/nope".parse().expect("pod"), to).expect_err("unknown");
    assert_eq!(
        e.to_string(),
        "failed to find pod shop/nope: no such pod in the view (check the namespace and the \
         name)"
    );
}

#[test]
fn no_policy_at_all_is_said_so() {
    let snapshot = yaml::load_str("c.yaml", CLUSTER);
    let e = ask(&snapshot.view, "shop/api-1", "192.0.2.7");
    assert!(misses(&e).is_empty());
    assert!(render::text(&e).contains("why:            no EgressGatewayPolicy exists"));
}

#[test]
fn counters_without_pins_are_one_line() {
    let v = view(EGRESS_IP, "");
    let e = ask(&v, "shop/api-1", "192.0.2.7");
    let dir = tempfile::tempdir().expect("tempdir");
    let text = counters::text(&e, dir.path());
    assert_eq!(
        text,
        format!(
            "counters:       not available: no agent's maps pinned under {} (run this on \
             the pod's node or its gateway, or pass --bpffs-dir)\n",
            dir.path().display()
        )
    );
}

#[test]
fn a_status_that_puts_the_address_elsewhere_is_noted() {
    // The agents found gw-1 dead and moved .11 to gw-2: their status says so, the
    // EgressNodes (and so this compile) do not yet.
    let v = view(
        "  rules:\n  - destinations: [\"192.0.2.0/24\"]\n    \
         egressIPs: [198.51.100.10, 198.51.100.11]\nstatus:\n  egressIPs:\n  \
         - {ip: 198.51.100.11, node: gw-2, interface: ens224, reason: HolderUnreachable}\n",
        "",
    );
    let e = ask(&v, "shop/api-1", "192.0.2.7");
    let m = matched(&e);
    assert_eq!(m.gateway.as_ref().map(|g| g.node.as_str()), Some("gw-1"));
    assert_eq!(
        m.status_holder,
        Some(("gw-2".to_owned(), Some("HolderUnreachable".to_owned())))
    );
    assert!(render::text(&e).contains(
        "note:           the policy's status puts 198.51.100.11 on gw-2 \
             (HolderUnreachable): the agents probe the gateways"
    ));
    // Where they agree, nothing is said.
    let e = ask(&v, "shop/api-2", "192.0.2.7");
    assert_eq!(matched(&e).status_holder, None);
}
