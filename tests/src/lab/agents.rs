//! The agents: one `egress-agent run` per node, started, stopped, killed, watched.

use super::*;

impl Lab {
    /// Start one `egress-agent run` per node (see [`Lab::start_agent`]).
    pub fn start_agents(&mut self, agent_bin: &Path) -> Result<()> {
        for node in self.spec.nodes.clone() {
            self.start_agent(node.name, agent_bin, &[])?;
        }
        Ok(())
    }

    /// Start `<agent_bin> run --node-name N --state-dir <dir> --bpffs-dir
    /// /sys/fs/bpf/<prefix>-N [extra...]` in node N's namespace, output to
    /// [`Lab::agent_log_path`]. Mounts bpffs at /sys/fs/bpf if needed. The pin directory
    /// survives [`Lab::stop_agent`] (a restarted agent adopts it) and goes with the lab.
    /// With [`LabSpec::liveness_key`], also `--liveness-key-file` (the lab's key).
    pub fn start_agent(&mut self, node: &str, agent_bin: &Path, extra: &[&str]) -> Result<()> {
        let keyed = self.spec.liveness_key;
        self.start_agent_as(node, agent_bin, extra, keyed)
    }

    /// The lab's liveness key file (one random key, written on first use).
    pub fn liveness_key_file(&self) -> Result<PathBuf> {
        let path = self.dir().join("liveness.key");
        if !path.exists() {
            let mut key = [0u8; 32];
            std::fs::File::open("/dev/urandom")
                .and_then(|mut f| std::io::Read::read_exact(&mut f, &mut key))
                .context("failed to read /dev/urandom")?;
            let hex: String = key.iter().map(|b| format!("{b:02x}")).collect();
            std::fs::write(&path, format!("{hex}\n"))
                .with_context(|| format!("failed to write {}", path.display()))?;
        }
        Ok(path)
    }

    /// [`Lab::start_agent`], with the lab's liveness key or without (`keyed`: an older
    /// build without the flag).
    pub fn start_agent_as(
        &mut self,
        node: &str,
        agent_bin: &Path,
        extra: &[&str],
        keyed: bool,
    ) -> Result<()> {
        let role_args = if self.node(node)?.gateway {
            self.spec.gateway_agent_args.clone()
        } else {
            self.spec.worker_agent_args.clone()
        };
        if self.agents.contains_key(node) {
            bail!("failed to start the agent on {node}: it is running");
        }
        netns::ensure_bpffs()?;
        let pin = self.bpffs_dir(node);
        self.pin_dirs
            .entry(node.to_owned())
            .or_insert_with(|| DirGuard::adopt(&pin));
        let state = self.state_dir();
        let mut args = vec![
            "run".to_owned(),
            "--node-name".to_owned(),
            node.to_owned(),
            "--state-dir".to_owned(),
            state.to_string_lossy().into_owned(),
            "--bpffs-dir".to_owned(),
            pin.to_string_lossy().into_owned(),
            "--cni-socket".to_owned(),
            self.cni_socket(node).to_string_lossy().into_owned(),
        ];
        if keyed {
            args.extend([
                "--liveness-key-file".to_owned(),
                self.liveness_key_file()?.to_string_lossy().into_owned(),
            ]);
        }
        if self.spec.cni.runs_ovs() {
            // w1 and gw1 find pods by OVN-Kubernetes' naming of their ports; w2 and gw2 as
            // the DaemonSet does by default (auto: the veth's peer first).
            let mode = if matches!(node, "w1" | "gw1") {
                "ovs"
            } else {
                "auto"
            };
            args.extend([
                "--pod-devices".to_owned(),
                mode.to_owned(),
                "--ovsdb".to_owned(),
                self.ovsdb_socket(node).to_string_lossy().into_owned(),
            ]);
        }
        args.extend(role_args);
        args.extend(extra.iter().map(|s| (*s).to_owned()));
        let log = self.agent_log_path(node);
        let out = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&log)
            .with_context(|| format!("failed to open {}", log.display()))?;
        let err = out.try_clone()?;
        // As the manifests deploy it (crate::deployed), unless EGRESS_TEST_AS_DEPLOYED=0:
        // the lab's directory (state, sockets, key, Open vSwitch) stands in for the API,
        // the Secret and the node's sockets.
        let mut cmd = match crate::deployed::AgentContainer::for_tests()? {
            Some(container) => container.command(self.ns(node)?, agent_bin, &[self.dir()])?,
            None => self.ns(node)?.command(agent_bin)?,
        };
        cmd.args(&args)
            .env("RUST_LOG", &self.spec.agent_log)
            // An environment variable, not a flag, so that a build without it starts too.
            .env("EGRESS_STATUS_SOCKET", self.status_socket(node))
            .stdout(out)
            .stderr(err);
        let child = NsChild::spawn(cmd, &self.ns_name(node))?;
        self.agents.insert(node.to_owned(), child);
        Ok(())
    }

    /// SIGTERM one node's agent (SIGKILL after a grace period); its pins stay.
    pub fn stop_agent(&mut self, node: &str) -> Result<()> {
        let mut child = self
            .agents
            .remove(node)
            .with_context(|| format!("no agent running on {node}"))?;
        child.terminate(KILL_GRACE);
        Ok(())
    }

    /// SIGKILL one node's agent (a crash: no cleanup on its side, and no SIGTERM first,
    /// which would let it say goodbye to its peers).
    pub fn kill_agent(&mut self, node: &str) -> Result<()> {
        let mut child = self
            .agents
            .remove(node)
            .with_context(|| format!("no agent running on {node}"))?;
        child.kill();
        Ok(())
    }

    /// SIGTERM every agent at once, SIGKILL those still running after [`KILL_GRACE`].
    pub fn stop_agents(&mut self) {
        let mut agents = std::mem::take(&mut self.agents);
        agents.values_mut().for_each(NsChild::signal_term);
        let deadline = Instant::now() + KILL_GRACE;
        for (_, mut child) in agents {
            child.terminate(deadline.saturating_duration_since(Instant::now()));
        }
    }

    /// Whether this lab started an agent on `node` that it has not stopped or killed (it
    /// may have exited since: [`Lab::exited_agents`]).
    pub fn agent_running(&self, node: &str) -> bool {
        self.agents.contains_key(node)
    }

    /// The process id of the agent this lab started on `node` (see [`Lab::agent_running`]).
    pub fn agent_pid(&self, node: &str) -> Option<u32> {
        self.agents.get(node).and_then(NsChild::id)
    }

    /// Nodes whose agent process has exited, with the exit status.
    pub fn exited_agents(&mut self) -> Vec<(String, String)> {
        let mut out = Vec::new();
        for (node, child) in &mut self.agents {
            match child.try_wait() {
                Ok(Some(status)) => out.push((node.clone(), status.to_string())),
                Ok(None) => {}
                Err(e) => out.push((node.clone(), format!("{e:#}"))),
            }
        }
        out
    }

    /// Shell commands for a human exploring a kept lab.
    pub fn how_to(&self) -> String {
        let p = &self.prefix;
        let echo = self.spec.echo_bin.display();
        format!(
            "lab {p}: namespaces {p}-<member> (nodes w1 w2 gw1 gw2, pods {pods}, hosts host-a \
             to host-e, routers rtr and rtr-b)
  shell in a pod:      ip netns exec {p}-w1-p1 bash
  shell on a node (sees /sys/fs/bpf): nsenter --net=/run/netns/{p}-gw1 bash
  traffic:             ip netns exec {p}-w1-p1 {echo} query tcp {a}:{port} --size 1400
  agent maps:          <egress-agent> maps --bpffs-dir /sys/fs/bpf/{p}-gw1
  agent status:        <egress-agent> status --socket {dir}/gw1-status.sock
  raw maps:            bpftool map dump pinned /sys/fs/bpf/{p}-gw1/<map>
  logs and state dir:  {dir}
  tear down:           Lab::teardown_by_prefix(\"{p}\") (cargo xtask lab --down {p})
",
            pods = self
                .pods
                .iter()
                .map(|p| p.name.as_str())
                .collect::<Vec<_>>()
                .join(" "),
            a = addr::HOST_A,
            port = addr::ECHO_PORT,
            dir = self.dir.display(),
        )
    }
}
