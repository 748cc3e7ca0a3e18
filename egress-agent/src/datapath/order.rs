//! The order in which [`Datapath::apply`](super::Datapath::apply) writes the maps: one
//! pure function, [`sequence`], which the apply walks. The programs read the maps between
//! any two writes, so this order is what keeps a half-applied update safe; the tests
//! below hold each invariant the datapath relies on.

#[cfg(test)]
use egress_common::maps::Map;

#[cfg(test)]
use crate::family::Family;
use crate::family::family_maps;

/// The phases of an apply, in the order it runs them: every removal, then every
/// addition and change.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Phase {
    Remove,
    Upsert,
}

impl Phase {
    pub(super) const ALL: [Phase; 2] = [Phase::Remove, Phase::Upsert];
}

/// The maps an apply syncs together: the source side (what this node's pods send) and
/// the gateway side (what this node serves, and who may send to it).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Side {
    Source,
    Gateway,
}

/// One map sync of an apply: `NODES` (of no family: an underlay address is of either),
/// or one family's map.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Step {
    Nodes,
    /// `PORT_FILTERS`, of no family: the policy entries of both name them.
    PortFilters,
    V4(FamilyMap),
    V6(FamilyMap),
}

/// [`FamilyMap`] and its names, from [`family_maps!`].
macro_rules! family_map_enum {
    ($(
        $(#[$doc:meta])*
        $Map:ident $field:ident $kind:ident [$v4:ident $v6:ident] [$($bound:tt)*],
    )*) => {
        /// One of a family's maps (a field of [`FamilyMaps`](super::FamilyMaps)).
        #[derive(Clone, Copy, Debug, PartialEq, Eq)]
        pub(super) enum FamilyMap {
            $( $(#[$doc])* $Map, )*
        }

        impl FamilyMap {
            /// Every one, in the order [`family_maps!`] declares them.
            #[cfg(test)]
            pub(super) const ALL: &[FamilyMap] = &[ $( FamilyMap::$Map, )* ];

            /// The pinned map of family `F` it names.
            #[cfg(test)]
            pub(super) fn name<F: Family>(self) -> &'static str {
                match self {
                    $( FamilyMap::$Map => <F::$Map as Map>::SPEC.name, )*
                }
            }
        }
    };
}
family_maps!(family_map_enum);

/// The families, in the order a side syncs them: all of IPv4's maps, then IPv6's.
const FAMILIES: [fn(FamilyMap) -> Step; 2] = [Step::V4, Step::V6];

/// Every map sync of one phase, in order:
///
/// * removals start on the source side (stop selecting before forgetting), additions on
///   the gateway side (who may send, then rules, then the policy maps, their
///   destination tries and the selected set last): on a node that is its own pods'
///   gateway, `from_pod` hands their packets straight to the gateway path;
/// * `NODES` first on insertion, last on removal: `from_tunnel` takes an inner source
///   that `POD_OWNER_*` gives to the outer sender as proof that the sender is in
///   `NODES`, so every pod owner names a node of `NODES` at every moment;
/// * source side: the selected set after the policy entries on insertion, first on
///   removal (and a pod that turns incomplete, whose entries did not fit, has its mark
///   written at that step of the remove phase, before its entries go: `Datapath`'s
///   `newly_incomplete`); the destination chains after the entries they lead to (a chain naming a
///   length whose entry is not in yet, or gone already, only costs a probe that
///   misses); known pods (`--unknown-pods drop`) only after their selected entry is
///   in, so that a new selected pod never passes untranslated in between;
/// * gateway side: rules -> egress IPs -> admitted pairs -> pod owners on removal, the
///   reverse on insertion: a rule is served only while everything it needs is in (its
///   pods' owners and pairs, and its egress IP, without which `from_secondary` would
///   hand the replies of its flows to the host and `gateway::forward` would take a
///   shared address for a dedicated one);
/// * `PORT_FILTERS` before the policy entries on insertion, after them on removal: an
///   entry never names a filter that is not in, except one whose filter changed, between
///   the removal of its old one and its own update (a filter's id follows its contents,
///   so only an entry that moved to other ports meets this): `from_pod` then drops its
///   packets (`DROP_NETWORK_POLICY`) for that moment, failing closed;
/// * pod devices (`from_pod`'s source check) before the selected and known pods on
///   insertion, after them on removal: a pod is bound while it is selected or known, so
///   that no other pod can send as it (one that is not bound yet, or any more, is left to
///   the unknown-pod policy, as before the check).
pub(super) fn sequence(phase: Phase) -> Vec<(Side, Step)> {
    use FamilyMap::*;
    use Side::*;
    match phase {
        Phase::Remove => [
            both_families(
                Source,
                &[KnownPods, Covered, Selected, Policy, Dests, PodDevices],
            ),
            vec![(Source, Step::PortFilters)],
            both_families(Gateway, &[Rules, EgressIps, Admitted, PodOwner]),
            vec![(Gateway, Step::Nodes)],
        ]
        .concat(),
        Phase::Upsert => [
            vec![(Gateway, Step::Nodes)],
            both_families(Gateway, &[PodOwner, Admitted, EgressIps, Rules]),
            vec![(Source, Step::PortFilters)],
            both_families(
                Source,
                &[PodDevices, Policy, Dests, Selected, KnownPods, Covered],
            ),
        ]
        .concat(),
    }
}

/// `maps` of `side`, in this order for each family.
fn both_families(side: Side, maps: &[FamilyMap]) -> Vec<(Side, Step)> {
    FAMILIES
        .iter()
        .flat_map(|family| maps.iter().map(move |&m| (side, family(m))))
        .collect()
}

#[cfg(test)]
mod tests {
    use egress_common::maps as names;

    use super::{FamilyMap::*, *};
    use crate::family::{V4, V6};

    /// The pinned map a step writes.
    fn map_name(step: Step) -> &'static str {
        match step {
            Step::Nodes => names::NODES,
            Step::PortFilters => names::PORT_FILTERS,
            Step::V4(m) => m.name::<V4>(),
            Step::V6(m) => m.name::<V6>(),
        }
    }

    /// Every step an apply has: `NODES`, and each family's maps.
    fn every_step() -> Vec<Step> {
        let family_maps = FAMILIES
            .iter()
            .flat_map(|family| FamilyMap::ALL.iter().map(|m| family(*m)));
        [Step::Nodes, Step::PortFilters]
            .into_iter()
            .chain(family_maps)
            .collect()
    }

    /// Asserts that `steps` come in this order in `phase`'s sequence; the message names
    /// the `invariant` and `why` the datapath needs it.
    fn assert_order(phase: Phase, steps: &[Step], invariant: &str, why: &str) {
        let seq: Vec<Step> = sequence(phase).into_iter().map(|(_, s)| s).collect();
        let at = |step: Step| {
            seq.iter()
                .position(|&s| s == step)
                .unwrap_or_else(|| panic!("{step:?} is missing from the {phase:?} sequence"))
        };
        for pair in steps.windows(2) {
            let (first, then) = (pair[0], pair[1]);
            assert!(
                at(first) < at(then),
                "broken invariant: {invariant}. On {phase:?}, {first:?} must come before \
                 {then:?}, but it is at position {} and {then:?} at {}. Why: {why}.\n\
                 {phase:?} sequence: {seq:?}",
                at(first),
                at(then),
            );
        }
    }

    /// `maps` of each family in turn.
    fn each_family(maps: &[FamilyMap]) -> impl Iterator<Item = Vec<Step>> + '_ {
        FAMILIES
            .iter()
            .map(|family| maps.iter().map(|&m| family(m)).collect())
    }

    #[test]
    fn nodes_are_inserted_before_every_pod_owner_and_removed_after() {
        let why = "from_tunnel takes an inner source that POD_OWNER_* gives to the outer \
                   sender as proof that the sender is in NODES, so every pod owner must \
                   name a node of NODES at every moment";
        for owners in FAMILIES.map(|family| family(PodOwner)) {
            assert_order(
                Phase::Upsert,
                &[Step::Nodes, owners],
                "NODES is inserted before any pod owner",
                why,
            );
            assert_order(
                Phase::Remove,
                &[owners, Step::Nodes],
                "NODES is removed after every pod owner",
                why,
            );
        }
    }

    #[test]
    fn port_filters_are_inserted_before_every_policy_entry_and_removed_after() {
        let why = "from_pod drops a packet whose entry names a filter missing from \
                   PORT_FILTERS (fail closed): an entry written before its filter would \
                   drop what its NetworkPolicy allows";
        for policy in FAMILIES.map(|family| family(Policy)) {
            assert_order(
                Phase::Upsert,
                &[Step::PortFilters, policy],
                "PORT_FILTERS is inserted before any policy entry",
                why,
            );
            assert_order(
                Phase::Remove,
                &[policy, Step::PortFilters],
                "PORT_FILTERS is removed after every policy entry",
                why,
            );
        }
    }

    #[test]
    fn a_pod_is_selected_only_while_its_policy_entries_are_in() {
        let why = "from_pod probes POLICY only for a pod found in SELECTED, and takes a \
                   miss for a destination outside every rule: a pod selected without its \
                   entries would send untranslated to destinations its policy covers";
        for steps in each_family(&[Policy, Selected]) {
            assert_order(
                Phase::Upsert,
                &steps,
                "SELECTED is inserted after POLICY",
                why,
            );
        }
        for steps in each_family(&[Selected, Policy]) {
            assert_order(
                Phase::Remove,
                &steps,
                "SELECTED is removed before POLICY",
                why,
            );
        }
    }

    #[test]
    fn a_new_pod_is_known_only_once_it_is_selected() {
        let why = "with --unknown-pods drop, from_pod lets an unselected pod found in \
                   KNOWN_PODS pass untranslated: a new selected pod known before it is \
                   selected would send untranslated in between (unknown, it is dropped \
                   where a rule covers the destination)";
        for steps in each_family(&[Selected, KnownPods]) {
            assert_order(
                Phase::Upsert,
                &steps,
                "KNOWN_PODS is inserted after SELECTED",
                why,
            );
        }
    }

    #[test]
    fn a_pod_is_bound_to_its_device_while_it_is_selected_or_known() {
        let why = "from_pod drops a selected or known pod's packet that arrives on another \
                   device than its POD_DEVICES entry names, and lets an unbound one through \
                   as before: a pod selected or known before its binding is in, or after \
                   it is gone, could be sent as by another pod of the node";
        for steps in each_family(&[PodDevices, Selected, KnownPods]) {
            assert_order(
                Phase::Upsert,
                &steps,
                "POD_DEVICES is inserted before SELECTED and KNOWN_PODS",
                why,
            );
        }
        for steps in each_family(&[KnownPods, Selected, PodDevices]) {
            assert_order(
                Phase::Remove,
                &steps,
                "POD_DEVICES is removed after SELECTED and KNOWN_PODS",
                why,
            );
        }
    }

    #[test]
    fn gateway_side_goes_in_from_pod_owners_to_rules_and_out_the_other_way() {
        let owners = "from_tunnel checks a forwarded packet's owner (POD_OWNER) before the \
                      gateway checks its (pod, rule) pair (ADMITTED): an admitted pod whose \
                      owner is missing would be refused as an unknown or spoofing sender";
        let admitted = "the gateway refuses a new flow of a served rule (RULES) whose \
                        (pod, rule) pair is missing from ADMITTED as DROP_NOT_ADMITTED: a \
                        rule served without its pairs would refuse the pods its policies \
                        select";
        let egress_ips = "from_secondary claims the replies to an egress IP only when \
                          EGRESS_IPS holds it, and gateway::forward reads a rule's egress IP \
                          there (the shared-address check): a rule served without its egress \
                          IP would translate new flows whose replies the host answers with \
                          a reset, and take a shared address for a dedicated one";
        let links = [
            ([PodOwner, Admitted], "POD_OWNER", "ADMITTED", owners),
            ([Admitted, Rules], "ADMITTED", "RULES", admitted),
            ([EgressIps, Rules], "EGRESS_IPS", "RULES", egress_ips),
        ];
        for (pair, first, then, why) in links {
            for steps in each_family(&pair) {
                let invariant = format!("{then} is inserted after {first}");
                assert_order(Phase::Upsert, &steps, &invariant, why);
            }
            let reversed = [pair[1], pair[0]];
            for steps in each_family(&reversed) {
                let invariant = format!("{then} is removed before {first}");
                assert_order(Phase::Remove, &steps, &invariant, why);
            }
        }
    }

    #[test]
    fn removals_start_on_the_source_side_and_additions_on_the_gateway_side() {
        let why = "on a node that is its own pods' gateway, from_pod hands a selected pod's \
                   packet straight to the gateway path, which needs the rule (RULES) and the \
                   pod's pair (ADMITTED) that its policy entry names: the source side must \
                   never point at gateway entries not in yet, or gone already";
        for (phase, first, then) in [
            (Phase::Remove, Side::Source, Side::Gateway),
            (Phase::Upsert, Side::Gateway, Side::Source),
        ] {
            let seq = sequence(phase);
            let last_of_first = seq.iter().rposition(|&(side, _)| side == first);
            let first_of_then = seq.iter().position(|&(side, _)| side == then);
            assert!(
                last_of_first < first_of_then,
                "broken invariant: on {phase:?}, every {first:?}-side step comes before \
                 every {then:?}-side one. Why: {why}.\n{phase:?} sequence: {seq:?}"
            );
        }
    }

    #[test]
    fn every_map_is_synced_exactly_once_per_phase() {
        for phase in Phase::ALL {
            let seq: Vec<Step> = sequence(phase).into_iter().map(|(_, s)| s).collect();
            for step in every_step() {
                let times = seq.iter().filter(|&&s| s == step).count();
                assert_eq!(
                    times, 1,
                    "{step:?} is synced {times} times on {phase:?}: every map must be \
                     synced exactly once per phase, or the apply never writes its changes \
                     (or writes them out of order). {phase:?} sequence: {seq:?}"
                );
            }
            assert_eq!(
                seq.len(),
                every_step().len(),
                "the {phase:?} sequence has a step that is not in every_step(): {seq:?}"
            );
        }
    }

    #[test]
    fn the_steps_are_every_map_the_agent_diffs() {
        // Written by the programs, by `set_config`, by the conntrack sweep, by the
        // next-hop generation bump, by the remaps heard from peers or taken out by the
        // hellos (the fresh remaps), never diffed by
        // `apply`.
        let not_applied = [
            names::CT_V4,
            names::CT_V6,
            names::EXHAUSTED_V4,
            names::EXHAUSTED_V6,
            names::FLOWS_V4,
            names::FLOWS_V6,
            names::REMAP_V4,
            names::REMAP_V6,
            names::FRESH_REMAPS_V4,
            names::FRESH_REMAPS_V6,
            names::COUNTERS,
            names::CONFIG,
            names::NH_GEN,
        ];
        let steps: Vec<&str> = every_step().into_iter().map(map_name).collect();
        let without_step: Vec<&str> = names::names()
            .filter(|n| !steps.contains(n) && !not_applied.contains(n))
            .collect();
        assert!(
            without_step.is_empty(),
            "maps of egress_common's registry without a step in apply: {without_step:?}. \
             A map the agent fills needs a Step and a place in sequence(), or apply never \
             writes it; a map that something else writes goes in this test's list of maps \
             apply leaves alone"
        );
        for step in every_step() {
            assert!(
                !not_applied.contains(&map_name(step)),
                "{step:?} writes {}, which this test lists among the maps apply leaves alone",
                map_name(step)
            );
        }
    }
}
