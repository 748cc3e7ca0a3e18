//! Coexistence with OVN-Kubernetes: an egress IP one of its `EgressIP` objects claims is
//! left to it and reported, never taken.

use super::*;
use crate::source::ovn;

fn ovn_egress_ip(name: &str, ips: &[&str]) -> ovn::EgressIP {
    let mut e = ovn::EgressIP::new(
        name,
        ovn::EgressIPSpec {
            egress_ips: ips.iter().map(|s| (*s).to_owned()).collect(),
        },
    );
    e.metadata.name = Some(name.to_owned());
    e
}

#[test]
fn an_egress_ip_ovn_claims_is_left_to_it_and_reported_as_a_conflict() {
    let mut view = with_policies(base(), vec![policy("payments", PAYMENTS)]);
    view.ovn_egress_ips = vec![ovn_egress_ip("prod", &["198.51.100.10", "192.0.2.99"])];
    let c = compile(&view, "worker-1");
    assert_eq!(holder_of(&c, "198.51.100.10"), None, "nobody takes it");
    let conflict = status(&c, "payments", condition::CONFLICT);
    assert_eq!(
        (conflict.status.as_str(), conflict.reason.as_str()),
        ("True", reason::EGRESS_IP_CLAIMED_ELSEWHERE)
    );
    assert!(
        conflict
            .message
            .contains("rules[0].egressIP: 198.51.100.10")
            && conflict.message.contains("OVN-Kubernetes EgressIP prod"),
        "{conflict:?}"
    );
    let ready = status(&c, "payments", condition::READY);
    assert_eq!(ready.status, "False", "{ready:?}");
    // The rule without an egress IP of OVN's (interface: ens256) is served as before.
    assert!(c.holders.iter().any(|h| h.rule == 1), "{:?}", c.holders);
    // On the gateways, nothing holds or serves the address.
    for gw in ["gw-1", "gw-2"] {
        let d = compile(&view, gw).desired;
        assert!(!d.v4.egress_ips.contains_key(&ip("198.51.100.10")), "{gw}");
    }
    // Without the OVN object, it is ours again.
    view.ovn_egress_ips.clear();
    assert!(holder_of(&compile(&view, "worker-1"), "198.51.100.10").is_some());
}
