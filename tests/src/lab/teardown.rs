//! Taking the lab down (or leaving it up).

use super::*;

impl Lab {
    /// Leave the lab up (namespaces, servers, agents, pins, temp dir); returns the prefix
    /// for [`Lab::teardown_by_prefix`].
    pub fn leak(mut self) -> String {
        self.leaked = true;
        // Kept on purpose: no later lab sweeps it although this process ends.
        let _ = std::fs::write(self.dir.join(KEPT), "");
        for (_, ns) in std::mem::take(&mut self.netns) {
            ns.leak();
        }
        for child in std::mem::take(&mut self.servers) {
            child.leak();
        }
        for (_, child) in std::mem::take(&mut self.agents) {
            child.leak();
        }
        for (_, dir) in std::mem::take(&mut self.pin_dirs) {
            dir.leak();
        }
        netns::unregister_live(&self.prefix);
        self.prefix.clone()
    }

    /// Tear down every lab whose temp directory names an owner process that is gone
    /// (same pid and start time, so a reused pid is not mistaken for it) and that was not
    /// kept on purpose ([`Lab::leak`]). A lab of a live process is never touched.
    pub fn sweep_abandoned() {
        let Ok(entries) = std::fs::read_dir(std::env::temp_dir()) else {
            return;
        };
        for entry in entries.flatten() {
            let name = entry.file_name().to_string_lossy().into_owned();
            let Some(prefix) = name.strip_prefix("egress-lab-") else {
                continue;
            };
            let dir = entry.path();
            let Ok(owner) = std::fs::read_to_string(dir.join(OWNER)) else {
                continue;
            };
            if dir.join(KEPT).exists() || owner_alive(owner.trim()) {
                continue;
            }
            eprintln!(
                "lab {prefix}: its process {} is gone: tearing it down",
                owner.trim()
            );
            if let Err(e) = netns::teardown_prefix(prefix) {
                eprintln!("lab {prefix}: {e:#}");
            }
        }
    }

    /// Remove a kept lab (or the remains of a crashed one): processes in its namespaces,
    /// the namespaces, `/sys/fs/bpf/<prefix>-*` and its temp directory.
    pub fn teardown_by_prefix(prefix: &str) -> Result<()> {
        netns::teardown_prefix(prefix)
    }

    /// Tear down now and report what could not be removed.
    pub fn down(mut self) -> Result<()> {
        self.teardown(false);
        let left = netns::netns_with_prefix(&self.prefix)?;
        if !left.is_empty() {
            bail!("failed to tear down lab {}: left {left:?}", self.prefix);
        }
        Ok(())
    }

    /// Copy the lab's logs into a new directory under `to` (`EGRESS_LAB_KEEP_LOGS`: to
    /// read the agents of a run that passed, or of a lab that a later one replaced).
    fn copy_logs(&self, to: &Path) {
        let stamp = crate::stream::unix_ms();
        let dest = to.join(format!("{}-{stamp}", self.prefix));
        let Ok(entries) = std::fs::read_dir(&self.dir) else {
            return;
        };
        if let Err(e) = std::fs::create_dir_all(&dest) {
            eprintln!(
                "lab {}: failed to create {}: {e}",
                self.prefix,
                dest.display()
            );
            return;
        }
        for e in entries.flatten() {
            let path = e.path();
            if path.extension().is_some_and(|x| x == "log") {
                let _ = std::fs::copy(&path, dest.join(e.file_name()));
            }
        }
        eprintln!("lab {}: logs copied to {}", self.prefix, dest.display());
    }

    fn teardown(&mut self, keep_dir: bool) {
        if let Some(to) = std::env::var_os("EGRESS_LAB_KEEP_LOGS") {
            self.copy_logs(Path::new(&to));
        }
        self.stop_agents();
        for mut s in std::mem::take(&mut self.servers) {
            s.terminate(Duration::from_millis(500));
        }
        // Kill everything first, then delete: deleting the underlay also removes the
        // peers of veths in other namespaces.
        let namespaces = std::mem::take(&mut self.netns);
        for ns in namespaces.values() {
            netns::kill_netns_pids(ns.name());
        }
        drop(namespaces);
        // Sweep anything with our prefix that a guard did not own.
        if let Ok(left) = netns::netns_with_prefix(&self.prefix) {
            for ns in left {
                netns::delete_netns(&ns);
            }
        }
        // The agents' locks on their pin directories (the agents are gone).
        for pin_dir in self.pin_dirs.values() {
            let lock = egress_agent::datapath::lock::lock_path(
                Path::new(egress_agent::datapath::lock::LOCK_DIR),
                pin_dir.path(),
            );
            let _ = std::fs::remove_file(lock);
        }
        self.pin_dirs.clear();
        if keep_dir {
            // Torn down, its logs kept: nothing for a later lab to sweep (and delete).
            let _ = std::fs::remove_file(self.dir.join(OWNER));
        } else {
            let _ = std::fs::remove_dir_all(&self.dir);
        }
        netns::unregister_live(&self.prefix);
    }
}

impl Drop for Lab {
    fn drop(&mut self) {
        if self.leaked {
            return;
        }
        let panicking = thread::panicking();
        self.teardown(panicking);
        if panicking {
            eprintln!(
                "lab {}: torn down; logs and state kept in {}",
                self.prefix,
                self.dir.display()
            );
        }
    }
}

/// The lab's owner, in its temp directory: `<pid> <start time in clock ticks>`.
const OWNER: &str = "owner";
/// Present in a lab left up on purpose ([`Lab::leak`]).
const KEPT: &str = "kept";

/// A running process's start time (field 22 of `/proc/<pid>/stat`); `None` for no
/// process, or a zombie (killed, its parent has not reaped it yet).
fn start_time(pid: &str) -> Option<String> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let (_, rest) = stat.rsplit_once(')')?;
    let fields: Vec<&str> = rest.split_whitespace().collect();
    // After the command: state is field 3 (the first here), start time 22 (the 20th).
    if matches!(fields.first(), Some(&("Z" | "X"))) {
        return None;
    }
    fields.get(19).map(|s| (*s).to_owned())
}

/// Record this process as the owner of the lab at `dir`.
pub(super) fn write_owner(dir: &Path) -> Result<()> {
    let pid = std::process::id().to_string();
    let start = start_time(&pid).context("failed to read this process's start time")?;
    std::fs::create_dir_all(dir).with_context(|| format!("failed to create {}", dir.display()))?;
    std::fs::write(dir.join(OWNER), format!("{pid} {start}"))
        .with_context(|| format!("failed to write {}", dir.join(OWNER).display()))
}

/// Whether `owner` (`<pid> <start time>`) is a running process.
fn owner_alive(owner: &str) -> bool {
    let mut it = owner.split_whitespace();
    match (it.next(), it.next()) {
        (Some(pid), Some(start)) => start_time(pid).as_deref() == Some(start),
        // Unreadable: not ours to remove.
        _ => true,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_owner_is_alive_while_its_process_runs_and_not_after() {
        let me = std::process::id().to_string();
        let start = start_time(&me).expect("own start time");
        assert!(owner_alive(&format!("{me} {start}")));
        // The same pid with another start time: a reused pid, not the owner.
        assert!(!owner_alive(&format!("{me} 1")));
        let mut child = std::process::Command::new("sleep")
            .arg("10")
            .spawn()
            .expect("spawn");
        let pid = child.id().to_string();
        let s = start_time(&pid).expect("a running child's start time");
        assert!(owner_alive(&format!("{pid} {s}")));
        child.kill().expect("kill");
        // Killed, not reaped yet: a zombie is no owner.
        std::thread::sleep(std::time::Duration::from_millis(100));
        assert!(
            !owner_alive(&format!("{pid} {s}")),
            "a killed child is gone"
        );
        child.wait().expect("wait");
        assert!(
            !owner_alive(&format!("{pid} {s}")),
            "a reaped child is gone"
        );
        assert!(owner_alive("garbage"), "unreadable owners are left alone");
    }
}
