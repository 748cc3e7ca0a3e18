//! The YAML state directory: `policy.yaml`, `cluster.yaml` and what they say.

use super::*;

impl Lab {
    /// Replace `policy.yaml` (atomically: write, then rename).
    pub fn write_policy(&self, yaml: &str) -> Result<()> {
        self.write_state_file(POLICY_FILE, yaml)
    }

    /// Write any file of the state directory atomically.
    pub fn write_state_file(&self, name: &str, contents: &str) -> Result<()> {
        let dir = self.state_dir();
        let tmp = dir.join(format!(".{name}.tmp"));
        std::fs::write(&tmp, contents)
            .with_context(|| format!("failed to write {}", tmp.display()))?;
        std::fs::rename(&tmp, dir.join(name))
            .with_context(|| format!("failed to rename {} to {name}", tmp.display()))
    }

    pub fn remove_state_file(&self, name: &str) -> Result<()> {
        let path = self.state_dir().join(name);
        std::fs::remove_file(&path).with_context(|| format!("failed to remove {}", path.display()))
    }

    /// Set a node's Ready condition in `cluster.yaml`.
    pub fn set_node_ready(&mut self, node: &str, ready: bool) -> Result<()> {
        self.node(node)?;
        self.ready.insert(node.to_owned(), ready);
        self.write_cluster()
    }

    /// Drain a node (annotation `egress.dev/drain: "true"` on its Node in `cluster.yaml`)
    /// or undrain it (no annotation). A drained node may not hold egress IPs.
    pub fn set_node_drain(&mut self, node: &str, drain: bool) -> Result<()> {
        self.node(node)?;
        if drain {
            self.drained.insert(node.to_owned());
        } else {
            self.drained.remove(node);
        }
        self.write_cluster()
    }

    /// List `cidr` after the node's own pod CIDR in its Node's `spec.podCIDRs` in
    /// `cluster.yaml` (Kubernetes allows one per family; the agents read them all). Only
    /// the Node changes: the caller routes what it puts there.
    pub fn add_pod_cidr(&mut self, node: &str, cidr: &str) -> Result<()> {
        self.node(node)?;
        self.extra_pod_cidrs
            .entry(node.to_owned())
            .or_default()
            .push(cidr.to_owned());
        self.write_cluster()
    }

    /// Leave a pod's Pod object out of `cluster.yaml` (`false`: its network is there, as
    /// after the CNI ran, but no agent has heard of it) or put it back (`true`).
    pub fn set_pod_announced(&mut self, pod: &str, announced: bool) -> Result<()> {
        self.pod(pod)?;
        if announced {
            self.unannounced.remove(pod);
        } else {
            self.unannounced.insert(pod.to_owned());
        }
        self.write_cluster()
    }

    /// Give the primary network's router (`rtr`, every node's default gateway) a leg on
    /// network `id` (`a` or `b`) at `.1`: a path to that network that does not go through
    /// a gateway, as a user's routed primary network may have. Packets that leave a node
    /// untranslated then reach the network's host with their own source address.
    pub fn connect_router_to(&self, id: char) -> Result<()> {
        let net = NETWORKS
            .iter()
            .find(|n| n.id == id && n.router.is_none())
            .with_context(|| format!("network {id:?} is not a gateway-only network"))?;
        let o = net.host.octets();
        let ip = Ipv4Addr::new(o[0], o[1], o[2], 1);
        let bridge_ns = self.ns_name(&format!("net-{id}"));
        self.ns("rtr")?.ip_batch(&[
            format!("link add net-{id} type veth peer name rtr netns {bridge_ns}"),
            format!("addr add {ip}/24 dev net-{id}"),
            format!("link set net-{id} up"),
        ])?;
        self.ns(&format!("net-{id}"))?
            .ip_batch(&["link set rtr master br0 up"])
    }

    /// Do what the vSphere cloud provider (and others) does: list every address on
    /// `node`'s NICs in its Node's `status.addresses`, as InternalIP and ExternalIP,
    /// before the lab's own, egress IPs it holds included. Read now and kept until the
    /// next call, as a provider's periodic sync leaves a copy that an egress IP's move
    /// makes stale.
    pub fn cloud_reports_nic_addresses(&mut self, node: &str) -> Result<Vec<IpAddr>> {
        self.node(node)?;
        let mut nic: Vec<IpAddr> = self
            .ns(node)?
            .up_addresses()?
            .into_iter()
            .filter(|(ifc, a)| ifc != "lo" && !a.is_loopback() && !is_link_local(a))
            .map(|(_, a)| a)
            .collect();
        // Held egress IPs first: the first InternalIP is what a naive reader tunnels to.
        nic.sort_by_key(|a| !self.gateway_egress_ip(a));
        nic.dedup();
        self.cloud_addresses.insert(node.to_owned(), nic.clone());
        self.write_cluster()?;
        Ok(nic)
    }

    /// Whether `a` is one of the lab's egress IPs.
    fn gateway_egress_ip(&self, a: &IpAddr) -> bool {
        [
            IpAddr::from(addr::EGRESS_IP_A),
            addr::EGRESS_IP_B.into(),
            addr6::EGRESS_IP_A.into(),
            addr6::EGRESS_IP_B.into(),
        ]
        .contains(a)
    }

    /// A Node's `status.addresses`: what a cloud provider reported off its NICs
    /// ([`Lab::cloud_reports_nic_addresses`]), then the InternalIPs, the underlay's family
    /// first (the agents tunnel to the first one), then the hostname.
    fn node_addresses(&self, node: &Node) -> Value {
        let v4 = json!({"type": "InternalIP", "address": node.ip.to_string()});
        let v6 = json!({"type": "InternalIP", "address": node.ip6().to_string()});
        let mut out: Vec<Value> = self
            .cloud_addresses
            .get(node.name)
            .into_iter()
            .flatten()
            .flat_map(|a| {
                ["InternalIP", "ExternalIP"].map(|t| json!({"type": t, "address": a.to_string()}))
            })
            .collect();
        out.extend(match (self.spec.underlay, self.spec.family) {
            (Underlay::V4, Family::V4) => vec![v4],
            (Underlay::V4, _) => vec![v4, v6],
            (Underlay::V6, _) => vec![v6, v4],
        });
        out.push(json!({"type": "Hostname", "address": node.name}));
        Value::Array(out)
    }
}

fn is_link_local(a: &IpAddr) -> bool {
    match a {
        IpAddr::V4(a) => a.is_link_local(),
        IpAddr::V6(a) => (a.segments()[0] & 0xffc0) == 0xfe80,
    }
}

impl Lab {
    /// The Namespace, Node and Pod documents, as written to `cluster.yaml`.
    pub fn cluster_yaml(&self) -> String {
        let mut docs = Vec::new();
        for (name, labels) in &self.spec.namespaces {
            let mut labels = labels.clone();
            labels.insert("kubernetes.io/metadata.name".to_owned(), name.clone());
            docs.push(json!({
                "apiVersion": "v1",
                "kind": "Namespace",
                "metadata": {"name": name, "labels": labels},
            }));
        }
        for node in &self.spec.nodes {
            let mut labels = BTreeMap::from([
                ("kubernetes.io/hostname".to_owned(), node.name.to_owned()),
                ("kubernetes.io/os".to_owned(), "linux".to_owned()),
            ]);
            if node.gateway {
                labels.insert(GATEWAY_LABEL.to_owned(), "true".to_owned());
            }
            let ready = self.ready.get(node.name).copied().unwrap_or(true);
            let mut metadata = json!({"name": node.name, "labels": labels});
            let mut pod_cidrs = vec![node.pod_cidr()];
            pod_cidrs.extend(
                self.extra_pod_cidrs
                    .get(node.name)
                    .into_iter()
                    .flatten()
                    .cloned(),
            );
            let mut annotations = serde_json::Map::new();
            if self.drained.contains(node.name) {
                annotations.insert(DRAIN_ANNOTATION.to_owned(), json!("true"));
            }
            // OVN-Kubernetes leaves spec.podCIDRs empty: the node's subnets are in an
            // annotation.
            let mut spec = json!({"podCIDR": node.pod_cidr(), "podCIDRs": pod_cidrs});
            if self.spec.cni.runs_ovs() {
                let mut subnets = pod_cidrs.clone();
                if self.spec.family.has_v6() {
                    subnets.push(node.pod_cidr_v6());
                }
                annotations.insert(
                    OVN_NODE_SUBNETS.to_owned(),
                    json!(json!({"default": subnets}).to_string()),
                );
                spec = json!({});
            }
            if !annotations.is_empty() {
                metadata["annotations"] = Value::Object(annotations);
            }
            docs.push(json!({
                "apiVersion": "v1",
                "kind": "Node",
                "metadata": metadata,
                "spec": spec,
                "status": {
                    "addresses": self.node_addresses(node),
                    "conditions": [{
                        "type": "Ready",
                        "status": if ready { "True" } else { "False" },
                        "reason": if ready { "KubeletReady" } else { "LabNotReady" },
                    }],
                },
            }));
        }
        for pod in self
            .pods
            .iter()
            .filter(|p| !self.unannounced.contains(&p.name))
        {
            let host_ip = self
                .spec
                .nodes
                .iter()
                .find(|n| n.name == pod.node)
                .map(|n| n.ip.to_string())
                .unwrap_or_default();
            let pod_ips: Vec<String> = pod
                .addresses(self.spec.family)
                .iter()
                .map(ToString::to_string)
                .collect();
            docs.push(json!({
                "apiVersion": "v1",
                "kind": "Pod",
                "metadata": {"name": pod.name, "namespace": pod.namespace, "labels": pod.labels},
                "spec": {
                    "nodeName": pod.node,
                    "containers": [{"name": "app", "image": "egress-echo"}],
                },
                "status": {
                    "phase": "Running",
                    "hostIP": host_ip,
                    "podIP": pod_ips.first().cloned().unwrap_or_default(),
                    "podIPs": pod_ips.iter().map(|ip| json!({"ip": ip})).collect::<Vec<_>>(),
                    "conditions": [{"type": "Ready", "status": "True"}],
                },
            }));
        }
        docs.iter().map(to_yaml_doc).collect()
    }

    pub(super) fn write_cluster(&self) -> Result<()> {
        self.write_state_file(CLUSTER_FILE, &self.cluster_yaml())
    }
}

/// The sample policy: pods app=api in namespaces team=payments, gateways
/// egress.dev/gateway=true; A listed, via 192.168.101.50; whatever the holder of
/// 192.168.102.50 routes out of `sec-b` (B itself, D behind rtr-b) via 192.168.102.50.
pub fn sample_policy() -> String {
    sample_policy_for(Family::V4)
}

/// The sample policy for a family: IPv4 rules (A listed, via 192.168.101.50;
/// `destinationsFrom: Routes` via 192.168.102.50), IPv6 rules (fd00:101::/64 via
/// fd00:101::50; `destinationsFrom: Routes` via fd00:102::50), or both in one policy.
pub fn sample_policy_for(family: Family) -> String {
    let mut rules = Vec::new();
    let mut family_rules = |net_a: &str, egress_a: IpAddr, egress_b: IpAddr| {
        rules.push(json!({"destinations": [net_a], "egressIP": egress_a.to_string()}));
        rules.push(json!({"destinationsFrom": "Routes", "egressIP": egress_b.to_string()}));
    };
    if family.has_v4() {
        family_rules(
            addr::NET_A,
            addr::EGRESS_IP_A.into(),
            addr::EGRESS_IP_B.into(),
        );
    }
    if family.has_v6() {
        family_rules(
            addr6::NET_A,
            addr6::EGRESS_IP_A.into(),
            addr6::EGRESS_IP_B.into(),
        );
    }
    payments_policy(rules)
}

/// The sample policy `payments` (team payments' app api pods, through the gateways, fail
/// closed) with `rules`.
pub fn payments_policy(rules: Vec<Value>) -> String {
    to_yaml_doc(&json!({
        "apiVersion": "egress.dev/v1alpha1",
        "kind": "EgressGatewayPolicy",
        "metadata": {"name": "payments"},
        "spec": {
            "namespaceSelector": {"matchLabels": {"team": "payments"}},
            "podSelector": {"matchLabels": {"app": "api"}},
            "gatewaySelector": {"matchLabels": {GATEWAY_LABEL: "true"}},
            "failurePolicy": "Drop",
            "rules": rules,
        },
    }))
}
