//! Taking the lab down (or leaving it up).

use super::*;

impl Lab {
    /// Leave the lab up (namespaces, servers, agents, pins, temp dir); returns the prefix
    /// for [`Lab::teardown_by_prefix`].
    pub fn leak(mut self) -> String {
        self.leaked = true;
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

    fn teardown(&mut self, keep_dir: bool) {
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
        if !keep_dir {
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
