//! The policy compiler: a pure function from the cluster view and this node's name to the
//! desired datapath state of this node, the status of every policy and the holder of every
//! egress address.
//!
//! No I/O and no clocks; everything is sorted, so the same view gives the same result on
//! every node. Policy statuses, holders and problems do not depend on the node name: every
//! agent (and `egress-agent check`) derives the same ones.

use std::{collections::BTreeMap, sync::Arc};

use self::plans::PolicyPlan;
use crate::{
    api::EgressGatewayPolicy,
    desired::Desired,
    liveness::PeerView,
    source::{ClusterView, Snapshot},
};

mod compiled;
pub mod condition;
mod coverage;
mod delta;
mod gateway_side;
mod hash;
mod members;
pub mod move_reason;
pub mod netpol;
mod nodes;
mod placement;
mod plans;
mod pods;
pub mod reason;
pub mod render;
mod routes;
mod rules;
mod selection;
mod source_side;
mod spread;
mod status;
#[cfg(test)]
mod tests;

pub use crate::selector::Selector;
pub use compiled::{Compiled, Holder, Object, Problem};
pub use hash::{fnv1a64, rule_ids};
pub use members::pods_needed;
pub use nodes::{
    DRAIN_ANNOTATION, gateway_candidates, held_egress_ips, node_drained, node_ready, node_underlay,
};
pub use pods::{Selection, selection};
pub use spread::PodRoute;

/// Compile `view` for the node named `node_name`, without liveness probes (every node
/// with an EgressNode counts as alive): what `egress-agent check` and tests see.
pub fn compile(view: &ClusterView, node_name: &str) -> Compiled {
    compile_with(view, &PeerView::default(), node_name)
}

/// Compile `view` for the node named `node_name`, with what its probes tell (`peers`):
/// dead gateways are not eligible, hellos correct the EgressNodes (interfaces down, IPs
/// held).
pub fn compile_with(view: &ClusterView, peers: &PeerView, node_name: &str) -> Compiled {
    compile_remembering(view, peers, &BTreeMap::new(), node_name)
}

/// [`compile_with`], remembering the policies' last accepted versions (`last_accepted`,
/// by name: [`Compiled::accepted`] of the previous compile): a policy whose spec turns
/// invalid keeps being served from its last accepted version (`Accepted=False`,
/// `Ready=False` with [`reason::SERVING_LAST_ACCEPTED`]) until it is fixed or deleted.
pub fn compile_remembering(
    view: &ClusterView,
    peers: &PeerView,
    last_accepted: &BTreeMap<String, EgressGatewayPolicy>,
    node_name: &str,
) -> Compiled {
    compile_indexed(view, peers, last_accepted, node_name, false).0
}

/// [`compile_remembering`], and with `index` what [`delta::patch`] needs to patch the
/// result for pods no policy selects.
fn compile_indexed(
    view: &ClusterView,
    peers: &PeerView,
    last_accepted: &BTreeMap<String, EgressGatewayPolicy>,
    node_name: &str,
    index: bool,
) -> (Compiled, Option<delta::Index>) {
    let mut desired = Desired::default();
    let held = nodes::held_egress_ips(view, peers);
    let nodes = nodes::index(view, peers, &held);
    let mut problems = nodes::register(&nodes, node_name, &mut desired);
    let pods = pods::Pods::index(view, &held, node_name);
    let reserved = routes::Reserved::new(view, &nodes, &pods);
    let policies = sorted_policies(view);
    let foreign = nodes::claimed_elsewhere(view);
    let full_maps = nodes::full_policy_maps(view);
    let mut plans = placement::plan(
        &policies,
        last_accepted,
        &nodes,
        peers,
        &reserved,
        &foreign,
        &full_maps,
    );
    let gateway = is_gateway(view, &plans, &nodes, node_name);
    pods.record_owners(&nodes, !gateway, &mut desired);
    pods.report_outside_cidrs(view, &nodes, &mut problems);
    let selected = selection::select(&mut plans, &pods, &view.unapplied);
    let (counts, pod_routes) = spread::spread(&plans, &selected);
    let (holders, egress_ips) = gateway_side::serve(&plans, &counts, node_name, &mut desired);
    source_side::claim(
        &mut plans,
        (&selected, pods.pods.len()),
        node_name,
        &mut desired,
    );
    coverage::cover(&plans, &pods, &mut desired);
    netpol::restrict(view, &pods, node_name, &mut desired, &mut problems);
    let reported = plans.iter().map(PolicyPlan::reported);
    let statuses = status::statuses(reported, egress_ips, &mut problems);
    problems.sort();
    problems.dedup();
    let accepted = plans
        .iter()
        .filter_map(|p| Some((p.name.clone(), p.accepted?.clone())))
        .collect();
    let index =
        index.then(|| delta::Index::new(view, (&pods, &plans, &nodes), &held, gateway, node_name));
    let compiled = Compiled {
        desired,
        statuses,
        holders,
        problems,
        accepted,
        membership: members::membership(view, node_name, &held),
        policy_egress_ips: members::policy_egress_ips(view),
        status_writer: members::status_writer(view, &peers.dead),
        pod_routes,
        pods_needed: members::needed(view, gateway, node_name, &peers.dead),
        pod_scope: view.pod_scope,
    };
    (compiled, index)
}

/// The last compile and what it was of. The compile is a pure function of the view, the
/// peers, the last accepted policies and the node's name: a compile of the same snapshot
/// (the very one, shared with the source: no comparison of its objects), equal peers and
/// equal accepted policies takes the last result again instead of making it anew. So the
/// resync tick's pass, and every pass woken by something the compile does not read (a
/// link, a timer, a retry), costs no compile. A snapshot that differs from the last only
/// in pods no policy selects patches the last result ([`delta`]): the pod events of
/// most of a cluster's pods cost their own entries.
#[derive(Default)]
pub struct Memo {
    last: Option<Memoized>,
}

struct Memoized {
    snapshot: Arc<Snapshot>,
    peers: PeerView,
    accepted: BTreeMap<String, EgressGatewayPolicy>,
    node: String,
    compiled: Arc<Compiled>,
    index: Option<delta::Index>,
}

/// How [`Memo::compile`] came by its result.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Made {
    /// Compiled anew.
    Compiled,
    /// The last result taken again: nothing it reads changed (the very snapshot, or
    /// one whose pods are the same).
    Again,
    /// The last result patched: only pods no policy selects changed.
    Patched,
}

impl Memo {
    /// [`compile_remembering`] of `snapshot`'s view, or the last result taken again or
    /// patched when its inputs are those of the last compile but for such pods; and how.
    pub fn compile(
        &mut self,
        snapshot: &Arc<Snapshot>,
        peers: &PeerView,
        last_accepted: &BTreeMap<String, EgressGatewayPolicy>,
        node_name: &str,
    ) -> (Arc<Compiled>, Made) {
        if let Some(m) = &mut self.last
            && m.peers == *peers
            && m.accepted == *last_accepted
            && m.node == node_name
        {
            if Arc::ptr_eq(&m.snapshot, snapshot) {
                return (Arc::clone(&m.compiled), Made::Again);
            }
            let patched = m.index.as_mut().and_then(|index| {
                delta::patch(index, &m.snapshot.view, &snapshot.view, &m.compiled)
            });
            if let Some(patch) = patched {
                m.snapshot = Arc::clone(snapshot);
                let made = match patch {
                    delta::Patch::Same => Made::Again,
                    delta::Patch::Patched(compiled) => {
                        m.compiled = Arc::from(compiled);
                        Made::Patched
                    }
                };
                return (Arc::clone(&m.compiled), made);
            }
        }
        let (compiled, index) =
            compile_indexed(&snapshot.view, peers, last_accepted, node_name, true);
        let compiled = Arc::new(compiled);
        self.last = Some(Memoized {
            snapshot: Arc::clone(snapshot),
            peers: peers.clone(),
            accepted: last_accepted.clone(),
            node: node_name.to_owned(),
            compiled: Arc::clone(&compiled),
            index,
        });
        (compiled, Made::Compiled)
    }
}

/// Whether some policy's gatewaySelector selects the node named `me`: as the view has
/// it (the gateways every agent probes), or as the accepted version a plan is served
/// from has it (an edit that is not accepted keeps the old gateways serving).
fn is_gateway(
    view: &ClusterView,
    plans: &[PolicyPlan<'_>],
    nodes: &[nodes::NodeInfo<'_>],
    me: &str,
) -> bool {
    if gateway_candidates(view).contains(me) {
        return true;
    }
    let Some(me) = nodes.iter().find(|n| n.name == me) else {
        return false;
    };
    plans
        .iter()
        .filter_map(|p| p.accepted)
        .filter_map(|a| Selector::gateways(&a.spec.gateway_selector).ok())
        .any(|s| s.matches(&me.labels))
}

/// The policies with a name, sorted and deduplicated by name.
fn sorted_policies(view: &ClusterView) -> Vec<&EgressGatewayPolicy> {
    let mut policies: Vec<&EgressGatewayPolicy> = view
        .policies
        .iter()
        .filter(|p| p.metadata.name.is_some())
        .collect();
    policies.sort_by(|a, b| a.metadata.name.cmp(&b.metadata.name));
    policies.dedup_by(|a, b| a.metadata.name == b.metadata.name);
    policies
}
