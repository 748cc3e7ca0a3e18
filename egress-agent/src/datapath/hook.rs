//! Which kernel hook carries the programs: TCX links (Linux 6.6 and later) or the legacy
//! tc path ([`super::tc`]: a `clsact` qdisc and direct-action `bpf` filters), chosen by
//! probing what this kernel supports, never by its version number; and how an attachment
//! is remembered in the pin directory, so that the next agent adopts it:
//!
//! * a TCX link is pinned as `link-<program>@<ifname>@<ifindex>` (the pin holds it);
//! * a tc filter is recorded as `tc-<program>@<ifname>@<ifindex>`, a directory saying
//!   at which priority it sits and whether we added the device's `clsact` qdisc (the
//!   device holds the filter; the record only says where to find it).

use std::{
    fs, io, mem,
    os::fd::{AsRawFd as _, BorrowedFd, FromRawFd as _, OwnedFd},
    path::Path,
};

/// `--attach`: how the programs are attached.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum AttachMode {
    /// TCX links where the kernel has them, else legacy tc.
    #[default]
    Auto,
    /// TCX links only (Linux 6.6 and later).
    Tcx,
    /// Legacy tc: a clsact qdisc and direct-action bpf filters, on any kernel.
    Tc,
}

/// The hook in use.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Hook {
    Tcx,
    /// Filters at this priority (`--tc-priority`).
    Tc {
        priority: u16,
    },
}

impl Hook {
    /// The hook `mode` asks for on this kernel, with `priority` for tc filters. `Auto`
    /// takes TCX when the kernel has it and says why when it does not; `Tcx` on a kernel
    /// without it is an error naming the flag.
    pub fn resolve(mode: AttachMode, priority: u16) -> Result<(Self, String), String> {
        let tc = Self::Tc { priority };
        match (mode, tcx_supported()) {
            (AttachMode::Tc, _) => Ok((tc, "legacy tc (--attach tc)".to_owned())),
            (AttachMode::Tcx | AttachMode::Auto, Ok(true)) => {
                Ok((Self::Tcx, "TCX links (the kernel has them)".to_owned()))
            }
            (AttachMode::Tcx, Ok(false)) => Err(
                "--attach tcx: this kernel has no TCX links (Linux 6.6 and later): use \
                 --attach auto or --attach tc"
                    .to_owned(),
            ),
            (AttachMode::Tcx, Err(e)) => Err(format!(
                "--attach tcx: failed to probe the kernel for TCX links: {e}"
            )),
            (AttachMode::Auto, Ok(false)) => Ok((
                tc,
                "legacy tc (this kernel has no TCX links: a clsact qdisc and bpf filters)"
                    .to_owned(),
            )),
            (AttachMode::Auto, Err(e)) => Ok((
                tc,
                format!("legacy tc (failed to probe the kernel for TCX links: {e})"),
            )),
        }
    }

    /// The name under which an attachment of `program` on (`ifname`, `ifindex`) is kept
    /// in the pin directory with this hook.
    pub fn record_name(self, program: &str, ifname: &str, ifindex: u32) -> String {
        let kind = match self {
            Self::Tcx => "link",
            Self::Tc { .. } => "tc",
        };
        format!("{kind}-{program}@{ifname}@{ifindex}")
    }
}

impl std::fmt::Display for Hook {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Tcx => f.write_str("tcx"),
            Self::Tc { priority } => write!(f, "tc (priority {priority})"),
        }
    }
}

/// A name in the pin directory that records an attachment, taken apart.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RecordName<'a> {
    /// Whether it is a tc filter's record (else a TCX link's pin).
    pub tc: bool,
    pub program: &'a str,
    pub ifname: &'a str,
    pub ifindex: u32,
}

impl<'a> RecordName<'a> {
    /// `link-from_pod@eth0@3` or `tc-from_pod@eth0@3`; `None` for anything else (a map).
    pub fn parse(name: &'a str) -> Option<Self> {
        let (tc, rest) = if let Some(r) = name.strip_prefix("link-") {
            (false, r)
        } else if let Some(r) = name.strip_prefix("tc-") {
            (true, r)
        } else {
            return None;
        };
        let (program, rest) = rest.split_once('@')?;
        let (ifname, ifindex) = rest.rsplit_once('@')?;
        Some(Self {
            tc,
            program,
            ifname,
            ifindex: ifindex.parse().ok()?,
        })
    }
}

/// What a tc record holds. bpffs holds pinned objects and directories only, so a record
/// is a directory whose entries say it: `priority-<n>`, and `clsact-added` when we added
/// the device's qdisc.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TcRecord {
    pub priority: u16,
    /// We added the device's clsact qdisc (so an uninstall may remove it, once empty).
    pub created_clsact: bool,
}

impl TcRecord {
    /// The entries of the record's directory.
    pub fn entries(self) -> Vec<String> {
        let mut e = vec![format!("priority-{}", self.priority)];
        if self.created_clsact {
            e.push("clsact-added".to_owned());
        }
        e
    }

    /// The record of these entries; `None` when they are not one.
    pub fn from_entries<S: AsRef<str>>(entries: &[S]) -> Option<Self> {
        let priority = entries
            .iter()
            .find_map(|e| e.as_ref().strip_prefix("priority-")?.parse().ok())?;
        Some(Self {
            priority,
            created_clsact: entries.iter().any(|e| e.as_ref() == "clsact-added"),
        })
    }

    /// Read the record at `path`.
    pub fn read(path: &Path) -> Option<Self> {
        let entries: Vec<String> = fs::read_dir(path)
            .ok()?
            .flatten()
            .filter_map(|e| e.file_name().into_string().ok())
            .collect();
        Self::from_entries(&entries)
    }

    /// Write the record at `path`, replacing what was there.
    pub fn write(self, path: &Path) -> io::Result<()> {
        match fs::remove_dir_all(path) {
            Ok(()) => {}
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            Err(e) => return Err(e),
        }
        for e in self.entries() {
            fs::create_dir_all(path.join(e))?;
        }
        Ok(())
    }
}

const BPF_PROG_LOAD: libc::c_long = 5;
const BPF_OBJ_PIN: libc::c_long = 6;
const BPF_LINK_CREATE: libc::c_long = 28;
const BPF_PROG_TYPE_SCHED_CLS: u32 = 3;
/// `BPF_TCX_INGRESS` of `enum bpf_attach_type` (Linux 6.6).
const BPF_TCX_INGRESS: u32 = 46;

/// The part of `union bpf_attr` that BPF_PROG_LOAD reads here.
#[repr(C)]
#[derive(Default)]
pub(crate) struct ProgLoad {
    pub prog_type: u32,
    pub insn_cnt: u32,
    pub insns: u64,
    pub license: u64,
}

/// The part of `union bpf_attr` that BPF_LINK_CREATE reads for a TCX link.
#[repr(C)]
#[derive(Default)]
struct LinkCreate {
    prog_fd: u32,
    target_ifindex: u32,
    attach_type: u32,
    flags: u32,
}

/// The part of `union bpf_attr` that BPF_OBJ_PIN reads.
#[repr(C)]
struct ObjPin {
    pathname: u64,
    bpf_fd: u32,
    file_flags: u32,
}

/// A TCX link of `prog` at the end of `ifindex`'s ingress (as aya's default order puts
/// it), its descriptor the only reference until it is pinned.
pub fn tcx_link(prog: BorrowedFd<'_>, ifindex: u32) -> io::Result<OwnedFd> {
    let attr = LinkCreate {
        prog_fd: prog.as_raw_fd() as u32,
        target_ifindex: ifindex,
        attach_type: BPF_TCX_INGRESS,
        flags: 0,
    };
    // SAFETY: `attr` holds no pointers.
    let fd = unsafe { bpf(BPF_LINK_CREATE, &attr) }?;
    let fd = i32::try_from(fd).map_err(|_| io::Error::other("fd out of range"))?;
    // SAFETY: `fd` is a fresh descriptor that nothing else owns or closes.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// Pin the bpf object `fd` (a link, here) at `path` in a bpf filesystem.
pub fn pin(fd: BorrowedFd<'_>, path: &Path) -> io::Result<()> {
    let c = std::ffi::CString::new(path.as_os_str().as_encoded_bytes())
        .map_err(|_| io::Error::other("a path with a NUL byte"))?;
    let attr = ObjPin {
        pathname: c.as_ptr() as u64,
        bpf_fd: fd.as_raw_fd() as u32,
        file_flags: 0,
    };
    // SAFETY: the path `attr` points at lives for the call.
    unsafe { bpf(BPF_OBJ_PIN, &attr) }.map(drop)
}

/// bpf(2) with command `cmd` and attributes `attr`.
///
/// # Safety
///
/// Every pointer in `attr` must be valid for what `cmd` does with it during the call.
pub(crate) unsafe fn bpf<T>(cmd: libc::c_long, attr: &T) -> io::Result<libc::c_long> {
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

/// `BPF_PROG_TYPE_SCHED_CLS`, the type of our programs (for [`load_trivial`]).
pub const SCHED_CLS: u32 = BPF_PROG_TYPE_SCHED_CLS;

/// Load `r0 = imm; exit` as a program of `prog_type` (the probes' program; tests use one
/// as another loader's classifier).
pub fn load_trivial(prog_type: u32, imm: i32) -> io::Result<OwnedFd> {
    // BPF_MOV64_IMM(BPF_REG_0, imm), BPF_EXIT_INSN().
    let [a, b, c, d] = imm.to_le_bytes();
    let insns: [u64; 2] = [
        u64::from_le_bytes([0xb7, 0, 0, 0, a, b, c, d]),
        u64::from_le_bytes([0x95, 0, 0, 0, 0, 0, 0, 0]),
    ];
    let license = c"GPL";
    let attr = ProgLoad {
        prog_type,
        insn_cnt: 2,
        insns: insns.as_ptr() as u64,
        license: license.as_ptr() as u64,
    };
    // SAFETY: the instructions and license that `attr` points at live for the call.
    let fd = unsafe { bpf(BPF_PROG_LOAD, &attr) }?;
    let fd = i32::try_from(fd).map_err(|_| io::Error::other("fd out of range"))?;
    // SAFETY: `fd` is a fresh descriptor that nothing else owns or closes.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// Whether the kernel has TCX links: ask it to link a trivial classifier to the TCX
/// ingress hook of ifindex 0, which names no device. A kernel with TCX looks the device
/// up and answers ENODEV; one without refuses the attach type itself with EINVAL. Nothing
/// is attached either way.
pub fn tcx_supported() -> io::Result<bool> {
    // TC_ACT_UNSPEC: a program that would pass everything on, were it ever attached.
    let prog = load_trivial(BPF_PROG_TYPE_SCHED_CLS, -1)?;
    let attr = LinkCreate {
        prog_fd: prog.as_raw_fd() as u32,
        target_ifindex: 0,
        attach_type: BPF_TCX_INGRESS,
        flags: 0,
    };
    // SAFETY: `attr` holds no pointers.
    match unsafe { bpf(BPF_LINK_CREATE, &attr) } {
        Ok(fd) => {
            // Never expected (ifindex 0 is no device); close what we were given.
            // SAFETY: a fresh descriptor that nothing else owns.
            drop(unsafe { OwnedFd::from_raw_fd(fd as i32) });
            Ok(true)
        }
        Err(e) if e.raw_os_error() == Some(libc::ENODEV) => Ok(true),
        Err(e) if e.raw_os_error() == Some(libc::EINVAL) => Ok(false),
        Err(e) => Err(e),
    }
}

/// Why [`tc_supported`] did not show the legacy tc path to work.
#[derive(Debug)]
pub enum TcTrial {
    /// Not tried: no private network namespace to try it in (unshare(2) refused; EPERM
    /// means the process lacks CAP_SYS_ADMIN, as the agent's container does).
    NotTried(io::Error),
    /// Tried, and this step failed.
    Failed(String),
}

/// Whether the legacy tc path works: in a private network namespace (on a thread of its
/// own, gone with it), add a clsact qdisc to `lo` and a direct-action bpf filter with a
/// trivial classifier, as the agent would on a device. The namespace takes
/// CAP_SYS_ADMIN: without it, [`TcTrial::NotTried`].
pub fn tc_supported() -> Result<(), TcTrial> {
    std::thread::spawn(|| {
        // SAFETY: unshare(2) takes no pointers; CLONE_NEWNET moves only this thread.
        if unsafe { libc::unshare(libc::CLONE_NEWNET) } != 0 {
            return Err(TcTrial::NotTried(io::Error::last_os_error()));
        }
        fn failed(what: &'static str) -> impl Fn(io::Error) -> TcTrial {
            move |e| TcTrial::Failed(format!("{what}: {e}"))
        }
        let prog = load_trivial(BPF_PROG_TYPE_SCHED_CLS, -1)
            .map_err(failed("failed to load a trivial classifier"))?;
        super::tc::add_clsact(1).map_err(failed(
            "failed to add a clsact qdisc (sch_ingress, Linux 4.5+)",
        ))?;
        super::tc::replace_filter(1, 1, crate::ebpf::FROM_POD, prog.as_raw_fd())
            .map_err(failed("failed to add a direct-action bpf filter (cls_bpf)"))?;
        let found =
            super::tc::filters(1, false).map_err(failed("failed to list the tc filters"))?;
        if found.iter().any(|f| f.is_ours(crate::ebpf::FROM_POD, 1)) {
            Ok(())
        } else {
            Err(TcTrial::Failed(format!(
                "the bpf filter added is not listed as added: {found:?}"
            )))
        }
    })
    .join()
    .unwrap_or_else(|_| Err(TcTrial::Failed("the tc probe's thread panicked".to_owned())))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn record_names_of_both_hooks_read_back() {
        let tc = Hook::Tc { priority: 1 };
        let n = tc.record_name("from_pod", "cali1@x", 12);
        assert_eq!(n, "tc-from_pod@cali1@x@12");
        assert_eq!(
            RecordName::parse(&n),
            Some(RecordName {
                tc: true,
                program: "from_pod",
                ifname: "cali1@x",
                ifindex: 12
            })
        );
        let l = Hook::Tcx.record_name("from_tunnel", "egress0", 3);
        assert_eq!(RecordName::parse(&l).map(|r| r.tc), Some(false));
        assert_eq!(RecordName::parse("POLICY_V4"), None);
        assert_eq!(RecordName::parse("tc-from_pod@eth0@x"), None);
    }

    #[test]
    fn a_tc_record_reads_back_and_a_bad_one_is_none() {
        for r in [
            TcRecord {
                priority: 1,
                created_clsact: true,
            },
            TcRecord {
                priority: 49152,
                created_clsact: false,
            },
        ] {
            assert_eq!(TcRecord::from_entries(&r.entries()), Some(r));
            let dir = tempfile::tempdir().unwrap();
            let path = dir.path().join("tc-from_pod@eth0@2");
            r.write(&path).unwrap();
            assert_eq!(TcRecord::read(&path), Some(r));
        }
        assert_eq!(TcRecord::from_entries::<&str>(&[]), None);
        assert_eq!(TcRecord::from_entries(&["priority-x"]), None);
    }

    #[test]
    fn forced_tc_needs_no_probe_and_says_so() {
        let (hook, why) = Hook::resolve(AttachMode::Tc, 7).unwrap();
        assert_eq!(hook, Hook::Tc { priority: 7 });
        assert!(why.contains("--attach tc"), "{why}");
    }
}
