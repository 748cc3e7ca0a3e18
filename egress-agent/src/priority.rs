//! Which of the agent's threads gets the CPU first when they all want it: the liveness
//! probes' "hellos" thread (`liveness::service`), at the nice value the agent started
//! with; every other thread gives way ([`give_way`]) once the probes run. A node whose
//! passes delayed its hellos past the detection time is declared dead by its peers; at 100
//! agents on 2 cores, whose passes over that delayed their own hellos in turn, the lab
//! never settled (docs/benchmarks.md).

use tracing::debug;

/// The nice value of the agent's threads but the hellos thread: CFS gives a thread at 0
/// about 9 times the CPU of one at 10 when both want it.
const GIVE_WAY_NICE: libc::c_int = 10;

/// Make the calling thread give way to the hellos thread (nice [`GIVE_WAY_NICE`]). A
/// thread may always lower its own priority, so no capability is needed; threads it
/// starts afterwards inherit it. Within the agent's container (its cgroup) this only
/// orders the agent's own threads. A failure is a debug line: the agent works as before.
pub fn give_way() {
    // SAFETY: setpriority(2) on the calling thread (PRIO_PROCESS with its thread id: Linux
    // keeps a nice value per thread).
    let rc = unsafe {
        libc::setpriority(
            libc::PRIO_PROCESS,
            libc::gettid() as libc::id_t,
            GIVE_WAY_NICE,
        )
    };
    if rc != 0 {
        debug!(
            "failed to lower this thread's priority: {}",
            std::io::Error::last_os_error()
        );
    }
}

/// The calling thread's nice value.
pub fn nice() -> libc::c_int {
    // SAFETY: getpriority(2) on the calling thread; -1 is also a valid value, so errno
    // would tell an error apart, and with our own thread id there is none.
    unsafe { libc::getpriority(libc::PRIO_PROCESS, libc::gettid() as libc::id_t) }
}

/// The CPU time the calling thread has spent (`CLOCK_THREAD_CPUTIME_ID`): what a pass
/// costs the machine, where its wall time also counts the waits for a CPU that other
/// threads and processes had. Zero if the clock cannot be read.
pub fn thread_cpu() -> std::time::Duration {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime(2) writes the timespec it is given.
    if unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) } != 0 {
        return std::time::Duration::ZERO;
    }
    std::time::Duration::new(
        u64::try_from(ts.tv_sec).unwrap_or(0),
        u32::try_from(ts.tv_nsec).unwrap_or(0),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_thread_gives_way_alone_and_its_children_inherit_it() {
        let ours = nice();
        std::thread::spawn(|| {
            give_way();
            assert!(nice() >= GIVE_WAY_NICE, "{}", nice());
            let child = std::thread::spawn(nice).join().unwrap();
            assert_eq!(child, nice());
        })
        .join()
        .unwrap();
        assert_eq!(nice(), ours, "the test's own thread is untouched");
    }

    #[test]
    fn a_thread_counts_its_own_cpu_not_its_sleep() {
        let t0 = thread_cpu();
        std::thread::sleep(std::time::Duration::from_millis(50));
        let slept = thread_cpu().saturating_sub(t0);
        let t1 = thread_cpu();
        let wall = std::time::Instant::now();
        while wall.elapsed() < std::time::Duration::from_millis(50) {
            std::hint::black_box(0u64);
        }
        let spun = thread_cpu().saturating_sub(t1);
        assert!(slept < std::time::Duration::from_millis(20), "{slept:?}");
        assert!(
            spun > slept && spun > std::time::Duration::ZERO,
            "{spun:?} {slept:?}"
        );
    }
}
