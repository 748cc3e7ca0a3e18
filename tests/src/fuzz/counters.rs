//! The `COUNTERS` array read whole in one `BPF_MAP_LOOKUP_BATCH` call (aya reads a per-CPU
//! array one index at a time: 64 system calls), so that every packet's counters can be
//! read before and after it at little cost.

use std::os::fd::{AsFd as _, AsRawFd as _, BorrowedFd, RawFd};

use egress_common::{counters::MAX_REASONS, maps};

use crate::testrun::Datapath;

const REASONS: usize = MAX_REASONS as usize;
/// `struct Counter`: packets, bytes (per-CPU values are 8-byte aligned; this one is 16).
const VALUE_LEN: usize = 16;

/// Packets and bytes of every reason, summed over CPUs.
pub type Snapshot = [(u64, u64); REASONS];

pub struct Reader {
    fd: RawFd,
    cpus: usize,
    keys: Vec<u32>,
    values: Vec<[u8; VALUE_LEN]>,
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
            values: vec![[0; VALUE_LEN]; REASONS * cpus],
        }
    }

    pub fn read(&mut self) -> Snapshot {
        // SAFETY: the descriptor is `dp`'s, which the caller keeps alive (see `new`).
        let fd = unsafe { BorrowedFd::borrow_raw(self.fd) };
        let read =
            egress_agent::datapath::sweep::lookup_batch(fd, None, &mut self.keys, &mut self.values);
        // The end of the map (no next cursor) is fine when it was all read.
        match read {
            Ok((n, _)) if n == REASONS => {}
            Ok((n, _)) => panic!("failed to read COUNTERS in one batch ({n} of {REASONS} entries)"),
            Err(e) => panic!("failed to read COUNTERS in one batch: {e}"),
        }
        self.sum()
    }

    fn sum(&self) -> Snapshot {
        let mut s = [(0, 0); REASONS];
        for (i, key) in self.keys.iter().enumerate() {
            for cpu in 0..self.cpus {
                let v = &self.values[i * self.cpus + cpu];
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
