//! `--max-flows-per-pod`: how many live translated flows a pod holds on this gateway. A
//! new flow over the limit is refused before it takes a port, so that one pod's flood
//! cannot take every port of a destination from the others. The datapath counts up as it
//! creates flows; the agent's conntrack sweeper counts down (expired and evicted flows)
//! once per walk of the conntrack map.

use aya_ebpf::{bindings::BPF_NOEXIST, btf_maps::HashMap};
use egress_common::{config::Config, conntrack::FlowCount};

use crate::maps::{FLOWS_V4, FLOWS_V6};

/// Whether `pod` may open one more flow under `cfg`'s limit.
#[inline(always)]
pub fn allowed4(cfg: &Config, pod: &[u8; 4]) -> bool {
    allowed(&FLOWS_V4, cfg, pod)
}

/// [`allowed4`] for an IPv6 pod.
#[inline(always)]
pub fn allowed6(cfg: &Config, pod: &[u8; 16]) -> bool {
    allowed(&FLOWS_V6, cfg, pod)
}

/// Count a flow `pod` just opened.
#[inline(always)]
pub fn opened4(pod: &[u8; 4]) {
    opened(&FLOWS_V4, pod);
}

/// [`opened4`] for an IPv6 pod.
#[inline(always)]
pub fn opened6(pod: &[u8; 16]) {
    opened(&FLOWS_V6, pod);
}

#[inline(always)]
fn allowed<K, const N: usize, const F: usize>(
    m: &HashMap<K, FlowCount, N, F>,
    cfg: &Config,
    pod: &K,
) -> bool {
    if cfg.max_flows_per_pod == 0 {
        return true;
    }
    // SAFETY: a plain read of a counter; a racing increment only makes it one off.
    unsafe { m.get(pod) }.is_none_or(|c| c.flows < cfg.max_flows_per_pod)
}

#[inline(always)]
fn opened<K, const N: usize, const F: usize>(m: &HashMap<K, FlowCount, N, F>, pod: &K) {
    // The BPF target has no atomic read-modify-write in `core`: two CPUs adding at the
    // same instant lose one count, which the sweeper's next walk restores (the limit is
    // approximate by that much).
    match m.get_ptr_mut(pod) {
        // SAFETY: a map value, alive while this program runs.
        Some(c) => unsafe { (*c).flows = (*c).flows.saturating_add(1) },
        None => {
            let _ = m.insert(pod, FlowCount { flows: 1 }, u64::from(BPF_NOEXIST));
        }
    }
}
