//! What is attached to a device's ingress, as the kernel reports it: TCX programs (aya
//! asks the kernel: this host's bpftool predates TCX) and tc filters (netlink, as `tc
//! filter show` does). In the calling thread's network namespace.

use aya::programs::{SchedClassifier, TcAttachType};
use egress_agent::datapath::tc;

/// One program on a device's ingress, by hook.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Ingress {
    /// A TCX program, by its name in the kernel.
    Tcx(String),
    /// A tc filter: priority, handle, and a bpf filter's name.
    Tc {
        priority: u16,
        handle: u32,
        name: String,
    },
}

impl Ingress {
    /// The program's or filter's name.
    pub fn name(&self) -> &str {
        match self {
            Self::Tcx(n) | Self::Tc { name: n, .. } => n,
        }
    }

    /// Whether it is our `program` (`from_pod`, ...) on either hook.
    pub fn is(&self, program: &str) -> bool {
        match self {
            Self::Tcx(n) => n == program,
            Self::Tc { name, .. } => *name == tc::filter_name(program),
        }
    }
}

/// Everything on `dev`'s ingress: TCX programs first, then tc filters in dump order.
pub fn ingress(dev: &str) -> Vec<Ingress> {
    let mut out: Vec<Ingress> = SchedClassifier::query_tcx(dev, TcAttachType::Ingress)
        .map(|(_, progs)| progs)
        .unwrap_or_default()
        .into_iter()
        .map(|p| Ingress::Tcx(p.name_as_str().unwrap_or("?").to_owned()))
        .collect();
    let Some(ifindex) = ifindex(dev) else {
        return out;
    };
    out.extend(
        tc::filters(ifindex, false)
            .unwrap_or_default()
            .into_iter()
            .map(|f| Ingress::Tc {
                priority: f.priority,
                handle: f.handle,
                name: f.name.unwrap_or_else(|| f.kind.clone()),
            }),
    );
    out
}

/// `dev`'s tc ingress filters' program ids, by filter name.
pub fn tc_prog_ids(dev: &str) -> Vec<(String, u32)> {
    let Some(ifindex) = ifindex(dev) else {
        return Vec::new();
    };
    tc::filters(ifindex, false)
        .unwrap_or_default()
        .into_iter()
        .filter_map(|f| Some((f.name?, f.prog_id?)))
        .collect()
}

fn ifindex(dev: &str) -> Option<u32> {
    let c = std::ffi::CString::new(dev).ok()?;
    // SAFETY: a valid NUL-terminated string.
    let i = unsafe { libc::if_nametoindex(c.as_ptr()) };
    (i != 0).then_some(i)
}

/// The names of the programs the kernel holds that use a map pinned in `pin_dir`, sorted:
/// what an agent's datapath has loaded, as the kernel lists it (none when nothing is
/// pinned there).
pub fn loaded_with_maps_in(pin_dir: &std::path::Path) -> Vec<String> {
    let ours: std::collections::BTreeSet<u32> = egress_common::maps::REGISTRY
        .iter()
        .filter_map(|m| aya::maps::MapInfo::from_pin(pin_dir.join(m.name)).ok())
        .map(|i| i.id())
        .collect();
    if ours.is_empty() {
        return Vec::new();
    }
    let mut names: Vec<String> = aya::programs::loaded_programs()
        .filter_map(Result::ok)
        .filter(|p| {
            p.map_ids()
                .ok()
                .flatten()
                .is_some_and(|ids| ids.iter().any(|id| ours.contains(id)))
        })
        .filter_map(|p| p.name_as_str().map(str::to_owned))
        .collect();
    names.sort();
    names
}
