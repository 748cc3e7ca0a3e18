//! The lab's names and addresses: prefix, members, nodes, pods, directories, logs.

use super::*;

impl Lab {
    /// The lab's unique prefix, e.g. `eg4270`.
    pub fn prefix(&self) -> &str {
        &self.prefix
    }

    /// The pods' address families.
    pub fn family(&self) -> Family {
        self.spec.family
    }

    /// What the lab was built from.
    pub fn spec(&self) -> &LabSpec {
        &self.spec
    }

    /// The namespace name of a member: `<prefix>-<member>`.
    pub fn ns_name(&self, member: &str) -> String {
        format!("{}-{member}", self.prefix)
    }

    /// The namespace of a member: a node (`w1`, `w2`, `gw1`, `gw2`), a pod (`w1-p1`, ...),
    /// a host (`host-a` to `host-e`), a network bridge (`net-a`, ...), a router (`rtr`,
    /// `rtr-b`) or the underlay bridge (`ul`).
    pub fn ns(&self, member: &str) -> Result<&Netns> {
        self.netns.get(member).with_context(|| {
            format!(
                "lab {} has no member {member:?} (members: {:?})",
                self.prefix,
                self.netns.keys().collect::<Vec<_>>()
            )
        })
    }

    /// Every member name.
    pub fn members(&self) -> impl Iterator<Item = &str> {
        self.netns.keys().map(String::as_str)
    }

    /// The lab's temp directory (logs, state dir).
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The YAML state directory the agents read.
    pub fn state_dir(&self) -> PathBuf {
        self.dir.join("state")
    }

    pub fn nodes(&self) -> &[Node] {
        &self.spec.nodes
    }

    /// The gateways' names.
    pub fn gateways(&self) -> impl Iterator<Item = &'static str> + '_ {
        self.spec.nodes.iter().filter(|n| n.gateway).map(|n| n.name)
    }

    /// The workers' names.
    pub fn workers(&self) -> impl Iterator<Item = &'static str> + '_ {
        self.spec
            .nodes
            .iter()
            .filter(|n| !n.gateway)
            .map(|n| n.name)
    }

    pub fn node(&self, name: &str) -> Result<&Node> {
        self.spec
            .nodes
            .iter()
            .find(|n| n.name == name)
            .with_context(|| format!("lab has no node {name:?}"))
    }

    pub fn pods(&self) -> &[Pod] {
        &self.pods
    }

    /// The source a host outside the cluster sees for `pod`'s IPv4 traffic that no rule of
    /// ours takes: the pod's address, or under [`Cni::Ovn`] its node's, to which OVN-
    /// Kubernetes SNATs the cluster subnet (`GR_<node>` in shared gateway mode, the node's
    /// masquerade in local gateway mode).
    pub fn untouched_source(&self, pod: &str) -> Result<IpAddr> {
        let pod = self.pod(pod)?;
        Ok(match self.spec.cni {
            Cni::Ovn(_) => IpAddr::V4(self.node(&pod.node)?.ip),
            _ => IpAddr::V4(pod.ip),
        })
    }

    pub fn pod(&self, name: &str) -> Result<&Pod> {
        self.pods
            .iter()
            .find(|p| p.name == name)
            .with_context(|| format!("lab has no pod {name:?}"))
    }

    /// The bpffs pin directory of a node's agent: `/sys/fs/bpf/<prefix>-<node>`.
    pub fn bpffs_dir(&self, node: &str) -> PathBuf {
        Path::new("/sys/fs/bpf").join(self.ns_name(node))
    }

    /// The `--status-socket` of a node's agent (`egress-agent status --socket` asks it).
    pub fn status_socket(&self, node: &str) -> PathBuf {
        self.dir.join(format!("{node}-status.sock"))
    }

    /// `node`'s agent's Prometheus text (`GET /metrics` on its status socket).
    pub fn agent_metrics(&self, node: &str) -> Result<String> {
        self.agent_get(node, "/metrics")
    }

    /// Whether `node`'s agent has finished a pass since it started (`GET /readyz` answers
    /// 200 on its status socket).
    pub fn agent_ready(&self, node: &str) -> bool {
        self.agent_get(node, "/readyz").is_ok_and(|answer| {
            answer.starts_with("HTTP/1.0 200") || answer.starts_with("HTTP/1.1 200")
        })
    }

    /// The whole HTTP answer of `node`'s agent to `GET path` on its status socket.
    fn agent_get(&self, node: &str, path: &str) -> Result<String> {
        use std::io::{Read as _, Write as _};
        let socket = self.status_socket(node);
        let mut s = std::os::unix::net::UnixStream::connect(&socket)
            .with_context(|| format!("{node}: {}", socket.display()))?;
        s.set_read_timeout(Some(std::time::Duration::from_secs(5)))?;
        write!(s, "GET {path} HTTP/1.0\r\nHost: agent\r\n\r\n")?;
        let mut text = String::new();
        s.read_to_string(&mut text)?;
        Ok(text)
    }

    /// The log file of a node's agent.
    pub fn agent_log_path(&self, node: &str) -> PathBuf {
        self.dir.join(format!("agent-{node}.log"))
    }

    pub fn agent_log(&self, node: &str) -> String {
        std::fs::read_to_string(self.agent_log_path(node)).unwrap_or_default()
    }
}
