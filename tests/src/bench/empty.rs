//! The floor: an empty TC program (`r0 = TC_ACT_OK; exit`), loaded and run with the same
//! `BPF_PROG_TEST_RUN` command as the datapath programs. Our object has no empty program
//! and building a second object just for two instructions is not worth a build step, so
//! this goes through bpf(2) directly.

use std::{
    io,
    os::fd::{AsRawFd as _, FromRawFd as _, OwnedFd},
};

use anyhow::{Context as _, Result, bail};

use super::Run;

const BPF_PROG_LOAD: libc::c_long = 5;
const BPF_PROG_TEST_RUN: libc::c_long = 10;
const BPF_PROG_TYPE_SCHED_CLS: u32 = 3;

/// `mov64 r0, 0` (BPF_ALU64 | BPF_MOV | BPF_K) and `exit` (BPF_JMP | BPF_EXIT).
const INSNS: [u64; 2] = [u64::from_le_bytes([0xb7, 0, 0, 0, 0, 0, 0, 0]), 0x95];
const LICENSE: &[u8] = b"GPL\0";

/// The `BPF_PROG_LOAD` part of `union bpf_attr` (uapi/linux/bpf.h), up to
/// `expected_attach_type`; the kernel zero-fills the rest.
#[repr(C)]
#[derive(Default)]
struct ProgLoadAttr {
    prog_type: u32,
    insn_cnt: u32,
    insns: u64,
    license: u64,
    log_level: u32,
    log_size: u32,
    log_buf: u64,
    kern_version: u32,
    prog_flags: u32,
    prog_name: [u8; 16],
    prog_ifindex: u32,
    expected_attach_type: u32,
}

/// The `BPF_PROG_TEST_RUN` part of `union bpf_attr`, up to `batch_size`.
#[repr(C)]
#[derive(Default)]
struct TestRunAttr {
    prog_fd: u32,
    retval: u32,
    data_size_in: u32,
    data_size_out: u32,
    data_in: u64,
    data_out: u64,
    repeat: u32,
    duration: u32,
    ctx_size_in: u32,
    ctx_size_out: u32,
    ctx_in: u64,
    ctx_out: u64,
    flags: u32,
    cpu: u32,
    batch_size: u32,
    _pad: u32,
}

fn bpf<T>(cmd: libc::c_long, attr: &mut T) -> io::Result<libc::c_long> {
    // SAFETY: `attr` is a valid, initialised `repr(C)` prefix of `union bpf_attr` for
    // `cmd`, and every pointer in it refers to memory that outlives the call.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_bpf,
            cmd,
            attr as *mut T,
            std::mem::size_of::<T>() as libc::c_uint,
        )
    };
    if rc < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(rc)
}

/// The loaded empty program; closed on drop.
pub struct EmptyProgram {
    fd: OwnedFd,
}

impl EmptyProgram {
    pub fn load() -> Result<Self> {
        let mut name = [0u8; 16];
        name[..10].copy_from_slice(b"bench_empt");
        let mut attr = ProgLoadAttr {
            prog_type: BPF_PROG_TYPE_SCHED_CLS,
            insn_cnt: INSNS.len() as u32,
            insns: INSNS.as_ptr() as u64,
            license: LICENSE.as_ptr() as u64,
            prog_name: name,
            ..Default::default()
        };
        let fd = bpf(BPF_PROG_LOAD, &mut attr)
            .context("failed to load the empty TC program (BPF_PROG_LOAD)")?;
        let fd = i32::try_from(fd).context("failed to load the empty TC program: bad fd")?;
        // SAFETY: BPF_PROG_LOAD returned a new file descriptor that nothing else owns.
        Ok(Self {
            fd: unsafe { OwnedFd::from_raw_fd(fd) },
        })
    }

    /// `BPF_PROG_TEST_RUN` with `repeat` runs of `data` and context `ctx`.
    pub fn test_run(&self, data: &[u8], ctx: &[u8], repeat: u32) -> Result<Run> {
        if repeat == 0 {
            bail!("failed to run the empty program: repeat must be at least 1");
        }
        let mut attr = TestRunAttr {
            prog_fd: self.fd.as_raw_fd() as u32,
            data_size_in: data.len() as u32,
            data_in: data.as_ptr() as u64,
            repeat,
            ctx_size_in: ctx.len() as u32,
            ctx_in: ctx.as_ptr() as u64,
            ..Default::default()
        };
        bpf(BPF_PROG_TEST_RUN, &mut attr)
            .context("failed to run the empty TC program (BPF_PROG_TEST_RUN)")?;
        Ok(Run {
            verdict: attr.retval,
            ns: attr.duration,
        })
    }
}
