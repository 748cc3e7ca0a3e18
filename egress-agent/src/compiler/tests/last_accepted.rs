//! A policy whose spec turns invalid keeps being served from its last accepted version.

use super::*;

fn compile_after(view: &ClusterView, last: &BTreeMap<String, EgressGatewayPolicy>) -> Compiled {
    compile_remembering(view, &PeerView::default(), last, "worker-1")
}

#[test]
fn a_broken_edit_keeps_the_last_accepted_translation_and_says_what_to_fix() {
    let good = with_policies(base(), vec![policy("payments", PAYMENTS)]);
    let first = compile_after(&good, &BTreeMap::new());
    assert_eq!(status(&first, "payments", condition::READY).status, "True");
    assert!(first.accepted.contains_key("payments"));

    let mut broken_policy = policy(
        "payments",
        &PAYMENTS.replace("192.0.2.0/24", "192.0.2.0/33"),
    );
    broken_policy.metadata.generation = Some(2);
    let broken = with_policies(base(), vec![broken_policy]);
    let c = compile_after(&broken, &first.accepted);
    assert_eq!(
        c.desired, first.desired,
        "the same maps: traffic keeps its translation"
    );
    assert_eq!(
        c.holders, first.holders,
        "the egress IPs stay where they are"
    );
    let accepted = status(&c, "payments", condition::ACCEPTED);
    assert_eq!(
        (accepted.status.as_str(), accepted.reason.as_str()),
        ("False", reason::INVALID_CIDR)
    );
    assert!(
        accepted.message.contains("rules[0].destinations[0]"),
        "{accepted:?}"
    );
    let ready = status(&c, "payments", condition::READY);
    assert_eq!(
        (ready.status.as_str(), ready.reason.as_str()),
        ("False", reason::SERVING_LAST_ACCEPTED)
    );
    assert!(ready.message.contains("generation 1"), "{ready:?}");
    assert_eq!(c.statuses["payments"].observed_generation, Some(2));
    assert_eq!(
        c.accepted["payments"].spec, first.accepted["payments"].spec,
        "still the last accepted version, for the next compile"
    );
    // Another broken edit on top: still the first accepted version.
    let again = compile_after(&broken, &c.accepted);
    assert_eq!(again.desired, first.desired);

    // The fix is served at once.
    let fixed_policy = policy("payments", &PAYMENTS.replace("192.0.2.", "192.0.3."));
    let fixed = compile_after(&with_policies(base(), vec![fixed_policy]), &c.accepted);
    assert_eq!(status(&fixed, "payments", condition::READY).status, "True");
    assert!(
        fixed
            .desired
            .v4
            .policy
            .keys()
            .any(|(_, n)| *n == net("192.0.3.0/24"))
    );
}

#[test]
fn without_a_last_accepted_version_an_invalid_rule_follows_the_failure_policy() {
    let broken = policy(
        "payments",
        &PAYMENTS.replace("192.0.2.0/24", "192.0.2.0/33"),
    );
    let c = compile_after(&with_policies(base(), vec![broken]), &BTreeMap::new());
    assert_eq!(
        status(&c, "payments", condition::READY).reason,
        reason::NOT_ACCEPTED
    );
    assert!(!c.accepted.contains_key("payments"));
}

#[test]
fn a_deleted_policy_is_not_kept() {
    let first = compile_after(
        &with_policies(base(), vec![policy("payments", PAYMENTS)]),
        &BTreeMap::new(),
    );
    let c = compile_after(&base(), &first.accepted);
    assert!(c.statuses.is_empty() && c.holders.is_empty());
    assert!(c.desired.v4.policy.is_empty());
    assert!(c.accepted.is_empty());
}

/// The memo takes a compile again only for the very snapshot, equal peers and equal
/// accepted policies of the last one; any other input compiles anew, to what a compile
/// without the memo gives.
#[test]
fn the_memo_takes_the_last_compile_again_only_when_nothing_it_reads_changed() {
    use std::sync::Arc;

    use crate::source::Snapshot;
    let snapshot = |view: ClusterView| {
        Arc::new(Snapshot {
            view,
            errors: Vec::new(),
        })
    };
    let mut view = with_policies(base(), vec![policy("payments", PAYMENTS)]);
    // In (namespace, name) order, as the sources hand pods over.
    view.pods
        .sort_by(|a, b| (&a.namespace, &a.name).cmp(&(&b.namespace, &b.name)));
    let first = snapshot(view.clone());
    let mut memo = Memo::default();
    let none = BTreeMap::new();
    let peers = PeerView::default();
    let (a, made) = memo.compile(&first, &peers, &none, "worker-1");
    assert_eq!(made, Made::Compiled, "the first compile");
    assert_eq!(*a, compile_after(&view, &none));
    let (b, made) = memo.compile(&first, &peers, &none, "worker-1");
    assert!(
        made == Made::Again && Arc::ptr_eq(&a, &b),
        "nothing changed: taken again"
    );
    // A new snapshot of the same objects: taken again too.
    let equal_copy = snapshot(view.clone());
    let (b, made) = memo.compile(&equal_copy, &peers, &none, "worker-1");
    assert!(made == Made::Again && Arc::ptr_eq(&a, &b));
    // Each input changed in turn: compiled anew, as without the memo.
    let mut dead = peers.clone();
    dead.dead.insert("gw-1".to_owned());
    let (c, made) = memo.compile(&equal_copy, &dead, &none, "worker-1");
    assert_eq!(made, Made::Compiled);
    assert_eq!(*c, compile_remembering(&view, &dead, &none, "worker-1"));
    let (d, made) = memo.compile(&equal_copy, &dead, &c.accepted, "worker-1");
    assert_eq!(made, Made::Compiled);
    assert_eq!(
        *d,
        compile_remembering(&view, &dead, &c.accepted, "worker-1")
    );
    let (e, made) = memo.compile(&equal_copy, &dead, &c.accepted, "gw-1");
    assert_eq!(made, Made::Compiled);
    assert_eq!(*e, compile_remembering(&view, &dead, &c.accepted, "gw-1"));
}
