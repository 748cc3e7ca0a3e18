//! Conntrack preloaded on the serving gateway (issue 15): established background flows
//! written into its pinned CT_V4 while its agent runs, so that the lab's traffic meets a
//! conntrack table of production size. The flows are those of the per-packet bench
//! ([`per_packet::background_flow`]), translated to the egress IP the traffic uses; their
//! last-seen time is now, so the agent's sweeper keeps them.

use anyhow::{Context as _, Result, ensure};
use aya::maps::{HashMap, Map, MapData};
use egress_agent::datapath::sweep::now_ns;
use egress_common::{
    conntrack::{CtEntryV4, CtKeyV4},
    maps as names,
};

use crate::{
    bench::per_packet::{FlowSite, background_flow},
    lab::{Lab, addr},
};

/// Flows preloaded (two entries each).
pub const FLOWS: u32 = 100_000;

fn ct_map(lab: &Lab, node: &str) -> Result<HashMap<MapData, CtKeyV4, CtEntryV4>> {
    let path = lab.bpffs_dir(node).join(names::CT_V4);
    let data =
        MapData::from_pin(&path).with_context(|| format!("failed to open {}", path.display()))?;
    HashMap::try_from(Map::LruHashMap(data)).context("CT_V4 is not an LRU hash")
}

fn site() -> FlowSite {
    FlowSite {
        egress: addr::EGRESS_IP_A,
        ifindex: 0,
        pod_node: addr::W2,
        rule_id: 0,
    }
}

/// Entries in `node`'s CT_V4 now (one map walk).
pub fn entries(lab: &Lab, node: &str) -> Result<usize> {
    Ok(ct_map(lab, node)?.keys().filter(Result::is_ok).count())
}

/// Write [`FLOWS`] background flows into `node`'s CT_V4; returns the entries it then
/// holds (checked: at least the preloaded ones).
pub fn load(lab: &Lab, node: &str) -> Result<usize> {
    let mut ct = ct_map(lab, node)?;
    let (site, now) = (site(), now_ns());
    for i in 0..FLOWS {
        for (key, entry) in background_flow(i, &site, now) {
            ct.insert(key, entry, 0)
                .with_context(|| format!("failed to preload flow {i} into {node}'s CT_V4"))?;
        }
    }
    let held = entries(lab, node)?;
    ensure!(
        held >= 2 * FLOWS as usize,
        "{node}'s CT_V4 holds {held} entries after preloading {} flows",
        FLOWS
    );
    Ok(held)
}

/// Remove the preloaded flows from `node`'s CT_V4 (those still there).
pub fn unload(lab: &Lab, node: &str) -> Result<()> {
    let mut ct = ct_map(lab, node)?;
    let (site, now) = (site(), now_ns());
    for i in 0..FLOWS {
        for (key, _) in background_flow(i, &site, now) {
            let _ = ct.remove(&key);
        }
    }
    Ok(())
}
