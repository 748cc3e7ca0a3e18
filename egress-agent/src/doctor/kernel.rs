//! What the kernel offers: BTF, TCX links, LPM tries, the BPF JIT.

use std::{
    io, mem,
    os::fd::{FromRawFd as _, OwnedFd},
    path::Path,
};

use aya::{maps::MapType, util::KernelVersion};

use super::{Check, fail, ok, warn};

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

/// TCX links arrived in Linux 6.6; the agent attaches its programs with them (pinned, so
/// that a restarted agent adopts them).
pub fn tcx() -> Check {
    match KernelVersion::current() {
        Ok(v) if v >= KernelVersion::new(6, 6, 0) => ok(
            "tcx",
            format!("kernel {v}: TCX links (Linux 6.6 and later)"),
        ),
        Ok(v) => fail(
            "tcx",
            format!(
                "kernel {v} predates TCX links (Linux 6.6), which the agent attaches its \
                 programs with: run the gateways and workers on Linux 6.6 or later"
            ),
        ),
        Err(e) => warn(
            "tcx",
            format!("failed to read the kernel version ({e}): TCX links need Linux 6.6 or later"),
        ),
    }
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

const BPF_PROG_LOAD: libc::c_long = 5;
const BPF_OBJ_GET_INFO_BY_FD: libc::c_long = 15;
const BPF_PROG_TYPE_SOCKET_FILTER: u32 = 1;

/// The part of `union bpf_attr` that BPF_PROG_LOAD reads here.
#[repr(C)]
#[derive(Default)]
struct ProgLoad {
    prog_type: u32,
    insn_cnt: u32,
    insns: u64,
    license: u64,
}

/// The part of `union bpf_attr` that BPF_OBJ_GET_INFO_BY_FD reads.
#[repr(C)]
#[derive(Default)]
struct InfoByFd {
    bpf_fd: u32,
    info_len: u32,
    info: u64,
}

/// bpf(2) with command `cmd` and attributes `attr`.
///
/// # Safety
///
/// Every pointer in `attr` must be valid for what `cmd` does with it during the call.
unsafe fn bpf<T>(cmd: libc::c_long, attr: &T) -> io::Result<libc::c_long> {
    // SAFETY: `attr` is live memory of the size passed; its pointers are the caller's duty.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_bpf,
            cmd,
            std::ptr::from_ref(attr),
            mem::size_of::<T>(),
        )
    };
    if rc < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(rc)
    }
}

/// Load `r0 = 0; exit` as a socket filter and ask the kernel for its JIT-compiled size.
fn jitted_test_program() -> io::Result<bool> {
    // BPF_MOV64_IMM(BPF_REG_0, 0), BPF_EXIT_INSN().
    let insns: [u64; 2] = [
        u64::from_le_bytes([0xb7, 0, 0, 0, 0, 0, 0, 0]),
        u64::from_le_bytes([0x95, 0, 0, 0, 0, 0, 0, 0]),
    ];
    let license = c"GPL";
    let attr = ProgLoad {
        prog_type: BPF_PROG_TYPE_SOCKET_FILTER,
        insn_cnt: 2,
        insns: insns.as_ptr() as u64,
        license: license.as_ptr() as u64,
    };
    // SAFETY: the instructions and license that `attr` points at live for the call.
    let fd = unsafe { bpf(BPF_PROG_LOAD, &attr) }?;
    let fd = i32::try_from(fd).map_err(|_| io::Error::other("fd out of range"))?;
    // SAFETY: `fd` is a fresh descriptor that nothing else owns or closes.
    let prog = unsafe { OwnedFd::from_raw_fd(fd) };
    // struct bpf_prog_info: type, id, tag[8], jited_prog_len, xlated_prog_len, ...
    let mut info = [0u8; 32];
    let attr = InfoByFd {
        bpf_fd: fd as u32,
        info_len: info.len() as u32,
        info: info.as_mut_ptr() as u64,
    };
    // SAFETY: `info` lives for the call; the kernel writes at most `info_len` bytes to it.
    let result = unsafe { bpf(BPF_OBJ_GET_INFO_BY_FD, &attr) };
    drop(prog);
    result?;
    Ok(u32::from_ne_bytes([info[16], info[17], info[18], info[19]]) > 0)
}
