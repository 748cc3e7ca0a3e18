//! What the agents cost over a window: CPU per node type, memory (resident, and the
//! kernel's for the maps), and the underlay's packets and bytes (only hellos while idle).

use std::{
    path::Path,
    time::{Duration, Instant},
};

use anyhow::{Context as _, Result};

use crate::{
    bench::lab::at_scale::{cpu_ticks, maps_bytes},
    bench::lab::control::status_kib,
    lab::Lab,
};

/// Clock ticks per second of `/proc/<pid>/stat` (USER_HZ).
pub(super) const TICKS_PER_SEC: f64 = 100.0;

/// One node type's agents over a window.
#[derive(Clone, Debug, Default)]
pub struct RoleCost {
    pub role: String,
    pub agents: usize,
    /// CPU seconds per second (user + system), mean and largest over the agents.
    pub cpu_mean: f64,
    pub cpu_max: f64,
    pub rss_mean_kib: u64,
    pub rss_max_kib: u64,
    /// Largest peak resident size (VmHWM).
    pub hwm_max_kib: u64,
    /// `bytes_memlock` of the maps each agent pinned.
    pub maps_mean_bytes: u64,
    pub maps_max_bytes: u64,
}

/// Packets and bytes the nodes sent on the underlay, per second.
#[derive(Clone, Copy, Debug, Default)]
pub struct Underlay {
    pub packets_per_sec: f64,
    pub bytes_per_sec: f64,
}

/// Everything measured over one window.
#[derive(Clone, Debug, Default)]
pub struct Cost {
    pub window: Duration,
    pub roles: Vec<RoleCost>,
    pub underlay: Underlay,
}

/// Sample, run `f`, wait out `window` (counted from the start), sample again.
pub fn measure(
    lab: &mut Lab,
    window: Duration,
    f: impl FnOnce(&mut Lab) -> Result<()>,
) -> Result<Cost> {
    let nodes: Vec<(&'static str, bool)> =
        lab.nodes().iter().map(|n| (n.name, n.gateway)).collect();
    let pids =
        |lab: &Lab| -> Vec<Option<u32>> { nodes.iter().map(|(n, _)| lab.agent_pid(n)).collect() };
    let before_pids = pids(&*lab);
    let ticks_before: Vec<u64> = before_pids
        .iter()
        .map(|p| p.map_or(0, |p| cpu_ticks(p as i32)))
        .collect();
    let ul_before = underlay_counters(lab)?;
    let t = Instant::now();
    f(lab)?;
    if let Some(rest) = window.checked_sub(t.elapsed()) {
        std::thread::sleep(rest);
    }
    let secs = t.elapsed().as_secs_f64();
    let ul_after = underlay_counters(lab)?;
    let after_pids = pids(lab);
    let mut roles = Vec::new();
    for (role, gateway) in [("worker", false), ("gateway", true)] {
        let mut rc = RoleCost {
            role: role.to_owned(),
            ..RoleCost::default()
        };
        let (mut cpu, mut rss, mut maps) = (Vec::new(), Vec::new(), Vec::new());
        for (i, (node, g)) in nodes.iter().enumerate() {
            if *g != gateway {
                continue;
            }
            let Some(pid) = after_pids[i] else { continue };
            // An agent restarted during the window (a silent death's recovery) counts
            // from its start.
            let from = if before_pids[i] == Some(pid) {
                ticks_before[i]
            } else {
                0
            };
            let pid = pid as i32;
            cpu.push(cpu_ticks(pid).saturating_sub(from) as f64 / TICKS_PER_SEC / secs);
            rss.push(status_kib(pid, "VmRSS:"));
            rc.hwm_max_kib = rc.hwm_max_kib.max(status_kib(pid, "VmHWM:"));
            maps.push(maps_bytes(&lab.bpffs_dir(node)));
        }
        rc.agents = cpu.len();
        if rc.agents == 0 {
            continue;
        }
        let n = rc.agents as f64;
        rc.cpu_mean = cpu.iter().sum::<f64>() / n;
        rc.cpu_max = cpu.iter().copied().fold(0.0, f64::max);
        rc.rss_mean_kib = rss.iter().sum::<u64>() / rc.agents as u64;
        rc.rss_max_kib = rss.iter().copied().max().unwrap_or(0);
        rc.maps_mean_bytes = maps.iter().sum::<u64>() / rc.agents as u64;
        rc.maps_max_bytes = maps.iter().copied().max().unwrap_or(0);
        roles.push(rc);
    }
    Ok(Cost {
        window: t.elapsed(),
        roles,
        underlay: Underlay {
            packets_per_sec: ul_after.0.saturating_sub(ul_before.0) as f64 / secs,
            bytes_per_sec: ul_after.1.saturating_sub(ul_before.1) as f64 / secs,
        },
    })
}

/// (packets, bytes) the underlay switch received on its ports from the nodes: each
/// port's `rx` in the `ul` namespace, summed over the nodes' ports.
fn underlay_counters(lab: &Lab) -> Result<(u64, u64)> {
    let out = lab.exec("ul", "ip", &["-s", "-j", "link", "show"])?;
    let links: serde_json::Value =
        serde_json::from_slice(&out.stdout).context("ip -s -j link show in ul: not JSON")?;
    let nodes: Vec<&str> = lab.nodes().iter().map(|n| n.name).collect();
    let (mut packets, mut bytes) = (0, 0);
    for l in links.as_array().into_iter().flatten() {
        let name = l["ifname"].as_str().unwrap_or_default();
        if nodes.contains(&name) {
            packets += l["stats64"]["rx"]["packets"].as_u64().unwrap_or(0);
            bytes += l["stats64"]["rx"]["bytes"].as_u64().unwrap_or(0);
        }
    }
    Ok((packets, bytes))
}

/// The summed size of the files under `dir`.
pub fn dir_bytes(dir: &Path) -> u64 {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return 0;
    };
    entries
        .flatten()
        .map(|e| match e.metadata() {
            Ok(m) if m.is_dir() => dir_bytes(&e.path()),
            Ok(m) => m.len(),
            Err(_) => 0,
        })
        .sum()
}
