//! The `COUNTERS` array read whole in one `BPF_MAP_LOOKUP_BATCH` call (aya reads a per-CPU
//! array one index at a time: 64 system calls), so that every packet's counters can be
//! read before and after it at little cost.

use std::os::fd::{AsFd as _, AsRawFd as _, RawFd};

use egress_common::{counters::MAX_REASONS, maps};

use crate::testrun::Datapath;

const BPF_MAP_LOOKUP_BATCH: libc::c_long = 24;
const REASONS: usize = MAX_REASONS as usize;
/// `struct Counter`: packets, bytes (per-CPU values are 8-byte aligned; this one is 16).
const VALUE_LEN: usize = 16;

/// Packets and bytes of every reason, summed over CPUs.
pub type Snapshot = [(u64, u64); REASONS];

/// The `batch` member of `union bpf_attr`.
#[repr(C)]
struct BatchAttr {
    in_batch: u64,
    out_batch: u64,
    keys: u64,
    values: u64,
    count: u32,
    map_fd: u32,
    elem_flags: u64,
    flags: u64,
}

pub struct Reader {
    fd: RawFd,
    cpus: usize,
    keys: Vec<u32>,
    values: Vec<u8>,
}

impl Reader {
    /// A reader of `dp`'s counters (the descriptor stays `dp`'s: keep `dp` alive).
    pub fn new(dp: &mut Datapath) -> Self {
        let fd = match dp.map(maps::COUNTERS) {
            aya::maps::Map::PerCpuArray(m) => m.fd().as_fd().as_raw_fd(),
            _ => panic!("COUNTERS is not a per-CPU array"),
        };
        let cpus = aya::util::nr_cpus()
            .unwrap_or_else(|(what, e)| panic!("failed to read the possible CPUs ({what}): {e}"));
        Reader {
            fd,
            cpus,
            keys: vec![0; REASONS],
            values: vec![0; REASONS * cpus * VALUE_LEN],
        }
    }

    pub fn read(&mut self) -> Snapshot {
        let mut out_batch = 0u32;
        let mut attr = BatchAttr {
            in_batch: 0,
            out_batch: &raw mut out_batch as u64,
            keys: self.keys.as_mut_ptr() as u64,
            values: self.values.as_mut_ptr() as u64,
            count: REASONS as u32,
            map_fd: self.fd as u32,
            elem_flags: 0,
            flags: 0,
        };
        // SAFETY: the attribute points at buffers of the sizes the kernel writes (count
        // keys, count values of `cpus` slots each, one key for the batch cursor).
        let rc = unsafe {
            libc::syscall(
                libc::SYS_bpf,
                BPF_MAP_LOOKUP_BATCH,
                &raw mut attr,
                size_of::<BatchAttr>(),
            )
        };
        let err = std::io::Error::last_os_error();
        // ENOENT: the end of the map was reached, which is fine when it was all read.
        assert!(
            (rc == 0 || err.raw_os_error() == Some(libc::ENOENT)) && attr.count == REASONS as u32,
            "failed to read COUNTERS in one batch ({} of {REASONS} entries): {err}",
            attr.count
        );
        self.sum()
    }

    fn sum(&self) -> Snapshot {
        let mut s = [(0, 0); REASONS];
        for (i, key) in self.keys.iter().enumerate() {
            for cpu in 0..self.cpus {
                let at = (i * self.cpus + cpu) * VALUE_LEN;
                let v = &self.values[at..at + VALUE_LEN];
                let packets = u64::from_ne_bytes(v[..8].try_into().expect("8 bytes"));
                let bytes = u64::from_ne_bytes(v[8..].try_into().expect("8 bytes"));
                let slot: &mut (u64, u64) = &mut s[*key as usize];
                slot.0 += packets;
                slot.1 += bytes;
            }
        }
        s
    }
}

/// What one packet added: (reason, packets, bytes) of every reason that moved.
pub fn delta(before: &Snapshot, after: &Snapshot) -> Vec<(u32, u64, u64)> {
    before
        .iter()
        .zip(after)
        .enumerate()
        .filter(|(_, (b, a))| b != a)
        .map(|(r, (b, a))| (r as u32, a.0.wrapping_sub(b.0), a.1.wrapping_sub(b.1)))
        .collect()
}
