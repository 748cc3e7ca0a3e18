//! What the kernel offers: BTF, TCX links or legacy tc, the map types, the programs
//! themselves (the verifier's word on every helper), the BPF JIT.

use std::{io, path::Path};

use aya::maps::MapType;

use super::{Check, fail, ok, warn};
use crate::{
    datapath::{self, hook},
    ebpf,
};

const VMLINUX_BTF: &str = "/sys/kernel/btf/vmlinux";
const JIT_SYSCTL: &str = "/proc/sys/net/core/bpf_jit_enable";

pub fn btf() -> Check {
    if Path::new(VMLINUX_BTF).exists() {
        ok("btf", format!("{VMLINUX_BTF} present"))
    } else {
        warn(
            "btf",
            format!(
                "no {VMLINUX_BTF} (a kernel without CONFIG_DEBUG_INFO_BTF): the datapath needs \
                 no CO-RE relocations and loads without it, but bpftool cannot print its maps \
                 by field name; use a kernel built with BTF where you can"
            ),
        )
    }
}

/// How the programs can be attached, probed (never read off the version): TCX links
/// (Linux 6.6 and later), else the legacy tc path (a clsact qdisc and a direct-action bpf
/// filter, tried in a private network namespace), which `run --attach auto` then takes.
pub fn attach() -> Check {
    attach_verdict(hook::tcx_supported(), hook::tc_supported())
}

/// What a process without the private namespace to try legacy tc in says: plainly, what
/// it did not try and why, and where it would be tried.
fn tc_not_tried(e: &io::Error) -> String {
    let why = if e.raw_os_error() == Some(libc::EPERM) {
        "needs CAP_SYS_ADMIN (a private network namespace to try it in), which this \
         process lacks (the agent's container is not granted it)"
            .to_owned()
    } else {
        format!("failed to make a private network namespace to try it in: {e}")
    };
    format!(
        "legacy tc not tried: {why}; doctor run privileged on the node tries it \
         (docs/operations.md, \"Running doctor\")"
    )
}

/// The verdict on the hooks from the TCX probe and the legacy tc trial.
pub(crate) fn attach_verdict(tcx: io::Result<bool>, tc: Result<(), hook::TcTrial>) -> Check {
    use hook::TcTrial::{Failed, NotTried};
    match (tcx, tc) {
        (Ok(true), Ok(())) => ok(
            "attach",
            "TCX links (the agent attaches with them); legacy tc works too (--attach tc)"
                .to_owned(),
        ),
        (Ok(true), Err(NotTried(e))) => ok(
            "attach",
            format!(
                "TCX links (the agent attaches with them); {}",
                tc_not_tried(&e)
            ),
        ),
        (Ok(true), Err(Failed(e))) => ok(
            "attach",
            format!(
                "TCX links (the agent attaches with them); legacy tc, which only --attach tc \
                 needs, fails: {e}"
            ),
        ),
        (Ok(false), Ok(())) => ok(
            "attach",
            "no TCX links in this kernel (Linux 6.6+): the agent attaches with legacy tc \
             (a clsact qdisc and direct-action bpf filters, tried here)"
                .to_owned(),
        ),
        (Ok(false), Err(NotTried(e))) => warn(
            "attach",
            format!(
                "no TCX links in this kernel (Linux 6.6+): the agent attaches with legacy tc; \
                 {}",
                tc_not_tried(&e)
            ),
        ),
        (Ok(false), Err(Failed(e))) => fail(
            "attach",
            format!(
                "no TCX links in this kernel (Linux 6.6+) and legacy tc fails: {e}: build the \
                 kernel with CONFIG_NET_SCH_INGRESS and CONFIG_NET_CLS_BPF (or load sch_ingress \
                 and cls_bpf)"
            ),
        ),
        (Err(e), _) => fail(
            "attach",
            format!(
                "failed to probe the kernel for TCX links: {e}: the agent needs CAP_BPF (or \
                 CAP_SYS_ADMIN) and a kernel with BPF"
            ),
        ),
    }
}

/// The map types the object uses, each with the first kernel that has it.
const MAP_TYPES: [(MapType, &str, &str); 5] = [
    (MapType::Hash, "hash", "3.19"),
    (MapType::Array, "array", "3.19"),
    (MapType::PerCpuArray, "per-CPU array", "4.6"),
    (MapType::LruHash, "LRU hash", "4.10"),
    (MapType::LruPerCpuHash, "LRU per-CPU hash", "4.10"),
];

/// Create (and drop) a small map of each type the datapath uses besides the LPM trie
/// (checked on its own), naming those the kernel lacks.
pub fn map_types() -> Check {
    let missing: Vec<String> = MAP_TYPES
        .iter()
        .filter(|(t, _, _)| !matches!(aya::sys::is_map_supported(*t), Ok(true)))
        .map(|(_, name, since)| format!("{name} (Linux {since})"))
        .collect();
    if missing.is_empty() {
        ok(
            "map-types",
            "hash, array, per-CPU array, LRU hash, LRU per-CPU hash".to_owned(),
        )
    } else {
        fail(
            "map-types",
            format!(
                "the kernel refuses map types the datapath uses: {}: use a newer kernel",
                missing.join(", ")
            ),
        )
    }
}

/// Load the agent's own programs (with small, unpinned maps), as the agent will: the
/// verifier of this kernel is the judge of every helper and instruction they use. A
/// refusal names the program and what the verifier said last (an unknown helper, say).
pub fn programs() -> Check {
    match load_programs() {
        Ok(()) => ok(
            "programs",
            format!(
                "the verifier accepts {} (helpers up to bpf_loop, Linux 5.17)",
                ebpf::PROGRAMS.join(", ")
            ),
        ),
        Err(e) => fail("programs", e),
    }
}

fn load_programs() -> Result<(), String> {
    let mut loader = aya::EbpfLoader::new();
    for name in egress_common::maps::names() {
        // Anonymous maps, sized down: nothing is allocated at full size.
        loader.map_max_entries(name, 1024);
    }
    let mut obj = loader
        .load(ebpf::OBJECT)
        .map_err(|e| format!("failed to create the object's maps: {e}"))?;
    for prog in ebpf::PROGRAMS {
        let p: &mut aya::programs::SchedClassifier = obj
            .program_mut(prog)
            .and_then(|p| p.try_into().ok())
            .ok_or_else(|| format!("program {prog} is missing from the object"))?;
        datapath::load_retrying(p).map_err(|e| {
            let said = match &e {
                aya::programs::ProgramError::LoadError { verifier_log, .. } => {
                    let log = verifier_log.to_string();
                    let last: Vec<&str> = log.lines().rev().take(3).collect();
                    last.into_iter().rev().collect::<Vec<_>>().join(" / ")
                }
                other => other.to_string(),
            };
            format!("the kernel refuses {prog}: {said}: see docs/operations.md, kernels")
        })?;
    }
    Ok(())
}

/// Create (and drop) a one-entry LPM trie, as the destination and coverage maps are.
pub fn lpm_trie() -> Check {
    match aya::sys::is_map_supported(MapType::LpmTrie) {
        Ok(true) => ok("lpm-trie", "created a test LPM trie map".to_owned()),
        Ok(false) => fail(
            "lpm-trie",
            "the kernel has no LPM trie maps (CONFIG_BPF_SYSCALL, Linux 4.11+), which hold \
             the policies: use a newer kernel"
                .to_owned(),
        ),
        Err(e) => fail(
            "lpm-trie",
            format!(
                "failed to create a test LPM trie map: {e}: the agent needs CAP_BPF (or \
                 CAP_SYS_ADMIN) and a kernel with BPF maps"
            ),
        ),
    }
}

/// The sysctl where this network namespace shows it (the initial one only), else whether
/// the kernel JIT-compiles a two-instruction program it is given.
pub fn jit() -> Check {
    let verdict = match std::fs::read_to_string(JIT_SYSCTL) {
        Ok(v) => match v.trim() {
            "0" => Some(false),
            _ => Some(true),
        },
        Err(_) => match jitted_test_program() {
            Ok(jitted) => Some(jitted),
            Err(e) => {
                return warn(
                    "jit",
                    format!(
                        "{JIT_SYSCTL} is not visible from this network namespace and a test \
                         program failed to load ({e}): check the host's sysctl; 1 is best"
                    ),
                );
            }
        },
    };
    match verdict {
        Some(true) => ok("jit", "the kernel JIT-compiles BPF programs".to_owned()),
        _ => warn(
            "jit",
            format!(
                "the BPF JIT is off: the datapath runs interpreted, several times slower; set \
                 {JIT_SYSCTL} to 1 (sysctl -w net.core.bpf_jit_enable=1)"
            ),
        ),
    }
}

const BPF_OBJ_GET_INFO_BY_FD: libc::c_long = 15;
const BPF_PROG_TYPE_SOCKET_FILTER: u32 = 1;

/// The part of `union bpf_attr` that BPF_OBJ_GET_INFO_BY_FD reads.
#[repr(C)]
#[derive(Default)]
struct InfoByFd {
    bpf_fd: u32,
    info_len: u32,
    info: u64,
}

/// Load `r0 = 0; exit` as a socket filter and ask the kernel for its JIT-compiled size.
fn jitted_test_program() -> io::Result<bool> {
    use std::os::fd::AsRawFd as _;
    let prog = hook::load_trivial(BPF_PROG_TYPE_SOCKET_FILTER, 0)?;
    // struct bpf_prog_info: type, id, tag[8], jited_prog_len, xlated_prog_len, ...
    let mut info = [0u8; 32];
    let attr = InfoByFd {
        bpf_fd: prog.as_raw_fd() as u32,
        info_len: info.len() as u32,
        info: info.as_mut_ptr() as u64,
    };
    // SAFETY: `info` lives for the call; the kernel writes at most `info_len` bytes to it.
    let result = unsafe { hook::bpf(BPF_OBJ_GET_INFO_BY_FD, &attr) };
    drop(prog);
    result?;
    Ok(u32::from_ne_bytes([info[16], info[17], info[18], info[19]]) > 0)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::api::PreflightResult::{Fail, Ok as Good, Warn};
    use hook::TcTrial::{Failed, NotTried};

    fn refused(errno: i32) -> Result<(), hook::TcTrial> {
        Err(NotTried(io::Error::from_raw_os_error(errno)))
    }

    /// A process without CAP_SYS_ADMIN (the agent's container) says it did not try legacy
    /// tc and why, where it would be tried, and fails nothing for it.
    #[test]
    fn attach_says_plainly_what_it_could_not_try() {
        let c = attach_verdict(Ok(true), refused(libc::EPERM));
        assert_eq!(c.result, Good, "{c:?}");
        assert!(
            c.message
                .contains("legacy tc not tried: needs CAP_SYS_ADMIN")
                && c.message.contains("\"Running doctor\""),
            "{}",
            c.message
        );
        let c = attach_verdict(Ok(false), refused(libc::EPERM));
        assert_eq!(c.result, Warn, "{c:?}");
        assert!(
            c.message
                .contains("attaches with legacy tc; legacy tc not tried: needs CAP_SYS_ADMIN"),
            "{}",
            c.message
        );
        // Another refusal is named as it is, not blamed on a capability.
        let c = attach_verdict(Ok(false), refused(libc::ENOSPC));
        assert_eq!(c.result, Warn, "{c:?}");
        assert!(
            c.message
                .contains("not tried: failed to make a private network namespace")
                && !c.message.contains("CAP_SYS_ADMIN"),
            "{}",
            c.message
        );
        let c = attach_verdict(
            Ok(false),
            Err(Failed("failed to add a clsact qdisc".into())),
        );
        assert_eq!(c.result, Fail, "{c:?}");
        let c = attach_verdict(Ok(true), Err(Failed("failed to add a clsact qdisc".into())));
        assert_eq!(c.result, Good, "{c:?}");
        assert!(
            c.message.contains("only --attach tc needs"),
            "{}",
            c.message
        );
        let c = attach_verdict(Ok(true), Ok(()));
        assert!(c.message.contains("legacy tc works too"), "{}", c.message);
    }
}
