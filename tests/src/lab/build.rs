//! Bringing the lab up: namespaces, links, routes, sysctls, CNI wiring, OVS, echo
//! servers.

use super::*;

impl Lab {
    /// Build the whole lab: namespaces, links, routes, sysctls, echo servers, state dir;
    /// then check that every node reaches host C ([`Lab::check_underlay`]). Everything
    /// built so far is removed if a step fails.
    pub fn up(spec: LabSpec) -> Result<Lab> {
        validate(&spec)?;
        if !spec.echo_bin.is_file() {
            bail!(
                "failed to start the lab: egress-echo not found at {}",
                spec.echo_bin.display()
            );
        }
        // The remains of labs whose process was killed (SIGKILL, a machine restart) before
        // it could tear them down.
        Lab::sweep_abandoned();
        let (prefix, underlay) = reserve_prefix(spec.prefix.as_deref())?;
        netns::register_live(&prefix);
        let dir = std::env::temp_dir().join(format!("egress-lab-{prefix}"));
        let mut lab = Lab {
            prefix,
            dir,
            pods: Vec::new(),
            netns: BTreeMap::from([("ul".to_owned(), underlay)]),
            servers: Vec::new(),
            agents: BTreeMap::new(),
            pin_dirs: BTreeMap::new(),
            ready: spec
                .nodes
                .iter()
                .map(|n| (n.name.to_owned(), true))
                .collect(),
            drained: std::collections::BTreeSet::new(),
            unannounced: std::collections::BTreeSet::new(),
            extra_pod_cidrs: BTreeMap::new(),
            cloud_addresses: BTreeMap::new(),
            leaked: false,
            spec,
        };
        lab.build()
            .with_context(|| format!("failed to bring up lab {}", lab.prefix))?;
        Ok(lab)
    }

    /// The lab's steps, in order: each builds on what the ones before it made.
    fn build(&mut self) -> Result<()> {
        let _ = std::fs::remove_dir_all(&self.dir);
        std::fs::create_dir_all(self.state_dir())
            .with_context(|| format!("failed to create {}", self.state_dir().display()))?;
        if let Err(e) = super::teardown::write_owner(&self.dir) {
            let p = &self.prefix;
            eprintln!("lab {p}: {e:#} (a kill of this process leaves the lab behind)");
        }
        self.pods = assign_pod_ips(&self.spec)?;
        make_neighbour_room(self.spec.nodes.len(), self.pods.len())?;
        self.build_namespaces()?;
        self.build_bridges()?;
        self.build_underlay()?;
        if let Some(mode) = self.spec.cni.ovn() {
            self.build_ovn(mode)?;
        }
        self.build_router_b()?;
        self.build_routed_networks()?;
        self.build_secondaries()?;
        self.build_hosts()?;
        self.keep_neighbours_as_switches_do()?;
        self.build_pods()?;
        self.write_cluster()?;
        if self.spec.sample_policy {
            self.write_policy(&sample_policy_for(self.spec.family))?;
        }
        self.start_servers()?;
        self.check_underlay()
    }

    /// Namespaces first, with rp_filter off before any interface exists (new namespaces may
    /// inherit the host's rp_filter), forwarding on the routers and nodes.
    fn build_namespaces(&mut self) -> Result<()> {
        let v6 = self.spec.family.has_v6();
        let mut members = vec!["rtr".to_owned(), "rtr-b".to_owned()];
        members.extend(self.spec.nodes.iter().map(|n| n.name.to_owned()));
        for net in NETWORKS {
            members.push(format!("net-{}", net.id));
            members.push(format!("host-{}", net.id));
        }
        members.extend(self.pods.iter().map(|p| p.name.clone()));
        for m in &members {
            let ns = Netns::add(&self.ns_name(m))?;
            self.netns.insert(m.clone(), ns);
        }
        for (m, ns) in &self.netns {
            let mut kv = vec![
                ("net.ipv4.conf.all.rp_filter", "0"),
                ("net.ipv4.conf.default.rp_filter", "0"),
            ];
            let node = self.spec.nodes.iter().any(|n| n.name == m);
            let router = m == "rtr" || m == "rtr-b" || node;
            if node && self.spec.cni.ovn().is_some() {
                // OpenShift's `ipForwarding: Restricted` (its default since 4.14): off for
                // the node, on only where OVN-Kubernetes turns it on (`super::ovn`) and
                // where the node's settings do for our datapath (`Lab::node_forwarding`).
                kv.extend([
                    ("net.ipv4.conf.all.forwarding", "0"),
                    ("net.ipv4.conf.default.forwarding", "0"),
                ]);
            } else if router {
                kv.push(("net.ipv4.ip_forward", "1"));
            }
            if v6 {
                kv.extend([
                    ("net.ipv6.conf.all.disable_ipv6", "0"),
                    ("net.ipv6.conf.default.disable_ipv6", "0"),
                    ("net.ipv6.conf.all.accept_dad", "0"),
                    ("net.ipv6.conf.default.accept_dad", "0"),
                ]);
                if router {
                    kv.push(("net.ipv6.conf.all.forwarding", "1"));
                }
            }
            ns.sysctls(&kv)?;
        }
        Ok(())
    }

    /// Bridges: the underlay and one per external network. They stand for switches, which
    /// run no netfilter: where `br_netfilter` is loaded (this host: Docker and kube-proxy
    /// load it) a Linux bridge passes every frame through its namespace's IP and ARP
    /// hooks, every agent's every hello included, unless told not to.
    fn build_bridges(&self) -> Result<()> {
        let switches = std::iter::once("ul".to_owned())
            .chain(NETWORKS.iter().map(|n| format!("net-{}", n.id)));
        for name in switches {
            let ns = self.ns(&name)?;
            ns.ip_batch(&["link add br0 type bridge", "link set br0 up"])?;
            if Path::new("/proc/sys/net/bridge").exists() {
                ns.sysctls(&[
                    ("net.bridge.bridge-nf-call-iptables", "0"),
                    ("net.bridge.bridge-nf-call-ip6tables", "0"),
                    ("net.bridge.bridge-nf-call-arptables", "0"),
                ])?;
            }
        }
        Ok(())
    }

    /// The underlay: every node (with its CNI's devices; under OVN both ports of its bond,
    /// [`Node::underlay_ports`]) and the router, on one bridge.
    fn build_underlay(&self) -> Result<()> {
        let v6 = self.spec.family.has_v6();
        let ul = self.ns_name("ul");
        let mut ul_ports = Vec::new();
        let cni = self.spec.cni;
        let nodes = &self.spec.nodes;
        for node in nodes {
            let ports = node.underlay_ports(cni);
            let mut cmds: Vec<String> = ports
                .iter()
                .map(|(link, port)| {
                    format!("link add {link} type veth peer name {port} netns {ul}")
                })
                .collect();
            if cni.uplink() == "bond0" {
                // NMState's `type: bond`, `mode: active-backup`, `miimon: 100`, `primary:
                // eth0`: the bond carries the node on eth0 while its carrier is up, on
                // eth1 while it is not, and goes back to eth0 when it returns.
                cmds.push("link add bond0 type bond mode active-backup miimon 100".to_owned());
                cmds.extend(
                    ports
                        .iter()
                        .map(|(link, _)| format!("link set {link} master bond0")),
                );
                cmds.extend([
                    "link set bond0 type bond primary eth0".to_owned(),
                    "link set bond0 up".to_owned(),
                ]);
            }
            if cni == Cni::Bridge {
                cmds.extend([
                    "link add br-ul type bridge".to_owned(),
                    "link add cni0 type bridge".to_owned(),
                    format!("addr add {}/24 dev cni0", node.pod_gateway()),
                    "link set cni0 up".to_owned(),
                ]);
                if v6 {
                    cmds.push(format!(
                        "addr add {}/64 dev cni0 nodad",
                        node.pod_gateway_v6()
                    ));
                }
            }
            self.ns(node.name)?.ip_batch(&cmds)?;
            if cni.runs_ovs() {
                self.start_ovs(node)?;
            }
            self.ns(node.name)?
                .ip_batch(&node.underlay_config(nodes, v6, cni))?;
            ul_ports.extend(ports.into_iter().map(|(_, port)| port));
        }
        let mut rtr = vec![
            format!("link add eth0 type veth peer name rtr netns {ul}"),
            format!("addr add {}/24 dev eth0", addr::ROUTER),
            "link set eth0 up".to_owned(),
        ];
        for node in nodes {
            rtr.push(format!("route add {} via {}", node.pod_cidr(), node.ip));
        }
        if v6 {
            rtr.push(format!("addr add {}/64 dev eth0 nodad", addr6::ROUTER));
            for node in nodes {
                rtr.push(format!(
                    "route add {} via {}",
                    node.pod_cidr_v6(),
                    node.ip6()
                ));
            }
        }
        self.ns("rtr")?.ip_batch(&rtr)?;
        ul_ports.push("rtr".to_owned());
        let ul_cmds: Vec<String> = ul_ports
            .iter()
            .map(|p| format!("link set {p} master br0 up"))
            .collect();
        self.ns("ul")?.ip_batch(&ul_cmds)?;
        Ok(())
    }

    /// `rtr-b`: a leg on network B (`eth0`), nothing on the underlay.
    fn build_router_b(&self) -> Result<()> {
        let v6 = self.spec.family.has_v6();
        let net_b = self.ns_name("net-b");
        let mut rtr_b = vec![
            format!("link add eth0 type veth peer name rtr-b netns {net_b}"),
            format!("addr add {}/24 dev eth0", addr::RTR_B),
            "link set eth0 up".to_owned(),
        ];
        if v6 {
            rtr_b.push(format!("addr add {}/64 dev eth0 nodad", addr6::RTR_B));
        }
        self.ns("rtr-b")?.ip_batch(&rtr_b)?;
        self.ns("net-b")?
            .ip_batch(&["link set rtr-b master br0 up"])?;
        Ok(())
    }

    /// The routers' legs on the networks behind them: `net-<id>` (C on rtr; D, E on rtr-b).
    fn build_routed_networks(&self) -> Result<()> {
        let v6 = self.spec.family.has_v6();
        for net in NETWORKS {
            let Some(r) = net.router else { continue };
            let (id, member) = (net.id, r.member);
            let bridge_ns = self.ns_name(&format!("net-{id}"));
            let mut cmds = vec![
                format!("link add net-{id} type veth peer name {member} netns {bridge_ns}"),
                format!("addr add {}/24 dev net-{id}", r.ip),
                format!("link set net-{id} up"),
            ];
            if v6 {
                cmds.push(format!("addr add {}/64 dev net-{id} nodad", r.ip6));
            }
            self.ns(member)?.ip_batch(&cmds)?;
            self.ns(&format!("net-{id}"))?
                .ip_batch(&[format!("link set {member} master br0 up")])?;
        }
        Ok(())
    }

    /// Secondary networks: only the gateways have a leg on them, and a route to D via rtr-b.
    /// Under [`Cni::Ovs`] they are 802.1Q VLANs off the gateways' NIC, carried by the
    /// underlay switch to a trunk port of each network's bridge.
    fn build_secondaries(&self) -> Result<()> {
        let v6 = self.spec.family.has_v6();
        let cni = self.spec.cni;
        let ul = self.ns_name("ul");
        if cni.runs_ovs() {
            for id in ['a', 'b'] {
                let vid = secondary_vlan(id);
                self.ns(&format!("net-{id}"))?.ip_batch(&[
                    format!("link add trunk type veth peer name trunk-{id} netns {ul}"),
                    "link set trunk up".to_owned(),
                    format!("link add link trunk name trunk.{vid} type vlan id {vid}"),
                    format!("link set trunk.{vid} master br0 up"),
                ])?;
                self.ns("ul")?
                    .ip_batch(&[format!("link set trunk-{id} master br0 up")])?;
            }
        }
        for gw in self.spec.nodes.iter().filter(|n| n.gateway) {
            let gw_node = gw;
            let gw = gw.name;
            let mut cmds = Vec::new();
            for id in ['a', 'b'] {
                let (ip, ip6) = gw_node.secondary_addrs(id)?;
                let bridge_ns = self.ns_name(&format!("net-{id}"));
                cmds.push(if cni.runs_ovs() {
                    let vid = secondary_vlan(id);
                    format!(
                        "link add link {} name sec-{id} type vlan id {vid}",
                        cni.uplink()
                    )
                } else {
                    format!("link add sec-{id} type veth peer name {gw} netns {bridge_ns}")
                });
                cmds.extend([
                    format!("addr add {ip}/24 dev sec-{id}"),
                    format!("link set sec-{id} up"),
                ]);
                if v6 {
                    cmds.push(format!("addr add {ip6}/64 dev sec-{id} nodad"));
                }
            }
            self.ns(gw)?.ip_batch(&cmds)?;
            if !cni.runs_ovs() {
                for id in ['a', 'b'] {
                    self.ns(&format!("net-{id}"))?
                        .ip_batch(&[format!("link set {gw} master br0 up")])?;
                }
            }
            let routes: Vec<String> = gateway_static_routes(v6)
                .into_iter()
                .map(|r| format!("route add {r}"))
                .collect();
            self.ns(gw)?.ip_batch(&routes)?;
        }
        Ok(())
    }

    /// The hosts and routers on the secondary networks keep their neighbour entries as
    /// switches do ([`SWITCH_LIKE_NEIGHBOURS`]), on their leg there (`eth0`).
    fn keep_neighbours_as_switches_do(&self) -> Result<()> {
        let families: &[&str] = if self.spec.family.has_v6() {
            &["ipv4", "ipv6"]
        } else {
            &["ipv4"]
        };
        for member in ON_SECONDARY_NETWORKS {
            let kv: Vec<(String, &str)> = families
                .iter()
                .flat_map(|f| {
                    SWITCH_LIKE_NEIGHBOURS
                        .iter()
                        .map(move |(k, v)| (format!("net.{f}.neigh.eth0.{k}"), *v))
                })
                .collect();
            let kv: Vec<(&str, &str)> = kv.iter().map(|(k, v)| (k.as_str(), *v)).collect();
            self.ns(member)?.sysctls(&kv)?;
        }
        Ok(())
    }

    /// Hosts: only their own subnet, except those behind a router (C, D, E), which answer
    /// through it.
    fn build_hosts(&self) -> Result<()> {
        let v6 = self.spec.family.has_v6();
        for net in NETWORKS {
            let host = format!("host-{}", net.id);
            let bridge_ns = self.ns_name(&format!("net-{}", net.id));
            let mut cmds = vec![
                format!("link add eth0 type veth peer name {host} netns {bridge_ns}"),
                format!("addr add {}/24 dev eth0", net.host),
                "link set eth0 up".to_owned(),
            ];
            if let Some(r) = net.router {
                cmds.push(format!("route add default via {}", r.ip));
            }
            if v6 {
                cmds.push(format!("addr add {}/64 dev eth0 nodad", net.host_v6));
                if let Some(r) = net.router {
                    cmds.push(format!("route add ::/0 via {}", r.ip6));
                }
            }
            self.ns(&host)?.ip_batch(&cmds)?;
            self.ns(&format!("net-{}", net.id))?
                .ip_batch(&[format!("link set {host} master br0 up")])?;
        }
        Ok(())
    }

    /// Pods, as `cni` wires them (those wired later are left for the test).
    fn build_pods(&self) -> Result<()> {
        let later: BTreeSet<String> = self
            .spec
            .pods
            .iter()
            .filter(|p| p.wired_later)
            .map(|p| p.name.clone())
            .collect();
        for pod in self.pods.clone() {
            if !later.contains(&pod.name) {
                self.wire(&pod)?;
            }
        }
        Ok(())
    }

    /// Where `node`'s agent serves the CNI plugin (`--cni-socket`).
    pub fn cni_socket(&self, node: &str) -> PathBuf {
        self.dir.join(format!("{node}-cni.sock"))
    }

    /// [`Lab::wire_pod`], then `plugin` (`egress-cni`) chained after it as a container
    /// runtime would run it: `CNI_COMMAND=ADD`, the pod's namespace and interface, the
    /// network configuration with the main plugin's result as `prevResult` on stdin; in
    /// the node's namespace, against its agent's socket. Returns the plugin's stdout once
    /// it exits 0 (the program is on the pod's device then).
    pub fn wire_pod_with_cni(&self, name: &str, plugin: &Path) -> Result<String> {
        self.wire_pod(name)?;
        let out = self.cni_call(name, plugin, "ADD")?;
        let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
        anyhow::ensure!(
            out.status.success(),
            "{} ADD for {name}: {}: {stdout} {}",
            plugin.display(),
            out.status,
            String::from_utf8_lossy(&out.stderr)
        );
        Ok(stdout)
    }

    /// Run `plugin` (`egress-cni`) for the wired pod `name` as a container runtime would,
    /// in its node's namespace with this process's privileges: `CNI_COMMAND=command`, the
    /// pod's namespace and interface, the network configuration on stdin with a
    /// `prevResult` as a routed CNI returns it. Unchecked: the caller reads the status.
    pub fn cni_call(&self, name: &str, plugin: &Path, command: &str) -> Result<Output> {
        use std::io::Write as _;
        let pod = self.pod(name)?.clone();
        let netns_path = self.ns(name)?.path().to_string_lossy().into_owned();
        let config = serde_json::json!({
            "cniVersion": "1.0.0",
            "name": "k8s-pod-network",
            "type": "egress-cni",
            "agentSocket": self.cni_socket(&pod.node),
            "timeoutMs": 5000,
            "prevResult": {
                "cniVersion": "1.0.0",
                "interfaces": [
                    {"name": pod.veth},
                    {"name": "eth0", "sandbox": netns_path.clone()},
                ],
                "ips": pod
                    .addresses(self.spec.family)
                    .iter()
                    .map(|a| {
                        let len = if a.is_ipv4() { 32 } else { 128 };
                        serde_json::json!({"address": format!("{a}/{len}"), "interface": 1})
                    })
                    .collect::<Vec<_>>(),
            },
        });
        let mut child = self
            .ns(&pod.node)?
            .command(plugin)?
            .env("CNI_COMMAND", command)
            .env("CNI_CONTAINERID", format!("lab-{name}"))
            .env("CNI_NETNS", &netns_path)
            .env("CNI_IFNAME", "eth0")
            .env("CNI_PATH", plugin.parent().unwrap_or(Path::new("/")))
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .with_context(|| format!("failed to run {}", plugin.display()))?;
        child
            .stdin
            .take()
            .context("plugin stdin")?
            .write_all(config.to_string().as_bytes())?;
        child
            .wait_with_output()
            .with_context(|| format!("failed to wait for {}", plugin.display()))
    }

    /// Set up the network of a pod made with [`PodSpec::wired_later`], as a CNI's ADD
    /// would: its veth (the node side created in the node's namespace by the pod side's
    /// `ip link add ... netns`), addresses and routes. Returns when the node side is up
    /// and routed.
    pub fn wire_pod(&self, name: &str) -> Result<()> {
        let pod = self.pod(name)?.clone();
        self.wire(&pod)
    }

    fn wire(&self, pod: &Pod) -> Result<()> {
        match self.spec.cni {
            Cni::Routed => self.wire_routed(pod),
            Cni::Bridge | Cni::Ovs | Cni::Ovn(_) => self.wire_switched(pod),
        }
    }

    /// Calico's way: /32 on the pod, the node's veth answers for 169.254.1.1.
    fn wire_routed(&self, pod: &Pod) -> Result<()> {
        let v4 = self.spec.family.has_v4();
        let node_ns = self.ns_name(&pod.node);
        let mut cmds = vec![format!(
            "link add eth0 type veth peer name {} netns {node_ns}",
            pod.veth
        )];
        if v4 {
            cmds.push(format!("addr add {}/32 dev eth0", pod.ip));
        }
        if let Some(ip6) = pod.ipv6 {
            cmds.push(format!("addr add {ip6}/128 dev eth0 nodad"));
        }
        cmds.push("link set eth0 up".to_owned());
        if v4 {
            cmds.push(format!(
                "route add {} dev eth0 scope link",
                addr::POD_GATEWAY
            ));
            cmds.push(format!(
                "route add default via {} dev eth0",
                addr::POD_GATEWAY
            ));
        }
        if pod.ipv6.is_some() {
            cmds.push(format!(
                "route add ::/0 via {} dev eth0",
                addr6::POD_GATEWAY
            ));
        }
        self.ns(&pod.name)?.ip_batch(&cmds)?;
        let node = self.ns(&pod.node)?;
        node.sysctls(&[
            (&format!("net.ipv4.conf.{}.proxy_arp", pod.veth), "1"),
            (&format!("net.ipv4.neigh.{}.proxy_delay", pod.veth), "0"),
            (&format!("net.ipv4.conf.{}.rp_filter", pod.veth), "0"),
        ])?;
        let mut cmds = vec![format!("link set {} up", pod.veth)];
        if v4 {
            cmds.push(format!("route add {}/32 dev {}", pod.ip, pod.veth));
        }
        if let Some(ip6) = pod.ipv6 {
            cmds.push(format!(
                "addr add {}/64 dev {} nodad",
                addr6::POD_GATEWAY,
                pod.veth
            ));
            cmds.push(format!("route add {ip6}/128 dev {}", pod.veth));
        }
        node.ip_batch(&cmds)?;
        Ok(())
    }

    /// The bridge plugin's and OVN-Kubernetes' way: the pod in the node's subnet (/24,
    /// /64) with its gateway at `.1`, its veth a port of `cni0` or of `br-int` (with the
    /// `iface-id` OVN-Kubernetes sets), no route per pod on the node.
    fn wire_switched(&self, pod: &Pod) -> Result<()> {
        let v4 = self.spec.family.has_v4();
        let node = self.node(&pod.node)?;
        let node_ns = self.ns_name(&pod.node);
        let mut cmds = vec![format!(
            "link add eth0 type veth peer name {} netns {node_ns}",
            pod.veth
        )];
        if self.spec.cni.ovn().is_some() {
            // OVN-Kubernetes' MAC of a pod: 0a:58 and its IPv4 address.
            cmds.push(format!("link set eth0 address {}", ovn_mac(pod.ip)));
        }
        if v4 {
            cmds.push(format!("addr add {}/24 dev eth0", pod.ip));
        }
        if let Some(ip6) = pod.ipv6 {
            cmds.push(format!("addr add {ip6}/64 dev eth0 nodad"));
        }
        cmds.push("link set eth0 up".to_owned());
        if v4 {
            cmds.push(format!("route add default via {}", node.pod_gateway()));
        }
        if pod.ipv6.is_some() {
            cmds.push(format!("route add ::/0 via {}", node.pod_gateway_v6()));
        }
        self.ns(&pod.name)?.ip_batch(&cmds)?;
        if self.spec.cni.runs_ovs() {
            let ips: Vec<String> = pod
                .addresses(self.spec.family)
                .iter()
                .map(|a| match a {
                    IpAddr::V4(a) => format!("{a}/24"),
                    IpAddr::V6(a) => format!("{a}/64"),
                })
                .collect();
            self.ovs_vsctl(
                &pod.node,
                &[
                    "add-port",
                    "br-int",
                    &pod.veth,
                    "--",
                    "set",
                    "interface",
                    &pod.veth,
                    &format!("external_ids:iface-id={}_{}", pod.namespace, pod.name),
                    &format!("external_ids:ip_addresses={}", ips.join(",")),
                ],
            )?;
            self.ns(&pod.node)?
                .ip_batch(&[format!("link set {} up", pod.veth)])?;
            if self.spec.cni.ovn().is_some() {
                self.add_ovn_pod(pod)?;
            }
        } else {
            self.ns(&pod.node)?
                .ip_batch(&[format!("link set {} master cni0 up", pod.veth)])?;
        }
        Ok(())
    }

    /// Where `node`'s Open vSwitch keeps its database, socket, pid and log files
    /// ([`Cni::Ovs`]).
    pub fn ovs_dir(&self, node: &str) -> PathBuf {
        self.dir.join(format!("{node}-ovs"))
    }

    /// `node`'s OVSDB socket ([`Cni::Ovs`]): the agent's `--ovsdb`.
    pub fn ovsdb_socket(&self, node: &str) -> PathBuf {
        self.ovs_dir(node).join("db.sock")
    }

    /// Run an Open vSwitch command in `node`'s namespace against its own daemons.
    pub(super) fn ovs_command(&self, node: &str, program: &str, args: &[&str]) -> Result<Output> {
        let dir = self.ovs_dir(node);
        let mut cmd = self.ns(node)?.command(program)?;
        cmd.args(args)
            .env("OVS_RUNDIR", &dir)
            .env("OVS_LOGDIR", &dir)
            .env("OVS_DBDIR", &dir)
            .env("OVS_SYSCONFDIR", &dir);
        netns::run_checked(&mut cmd).with_context(|| format!("{program} on {node}"))
    }

    /// `ovs-vsctl` against `node`'s OVSDB.
    pub fn ovs_vsctl(&self, node: &str, args: &[&str]) -> Result<Output> {
        self.ovs_command(node, "ovs-vsctl", &[&["--timeout=30"], args].concat())
    }

    /// Start `node`'s own `ovsdb-server` and `ovs-vswitchd` in its namespace (no systemd:
    /// Debian's packages, started by hand), then wire it as OVN-Kubernetes leaves a node:
    /// `br-int` with the management port `ovn-k8s-mp0` (the pod subnet's gateway), and
    /// `br-ex` with the NIC ([`Cni::uplink`]: `eth0`, under OVN the bond `bond0`) as its
    /// port (the node's address goes on `br-ex`).
    fn start_ovs(&self, node: &Node) -> Result<()> {
        let dir = self.ovs_dir(node.name);
        std::fs::create_dir_all(&dir)
            .with_context(|| format!("failed to create {}", dir.display()))?;
        let db = dir.join("conf.db");
        let db = db.to_string_lossy();
        let schema = "/usr/share/openvswitch/vswitch.ovsschema";
        anyhow::ensure!(
            Path::new(schema).is_file(),
            "{schema} is missing: --cni ovs needs Debian's openvswitch-switch (cargo xtask vm \
             installs it)"
        );
        self.ovs_command(node.name, "ovsdb-tool", &["create", &db, schema])?;
        let sock = self.ovsdb_socket(node.name);
        let remote = format!("--remote=punix:{}", sock.display());
        self.ovs_command(
            node.name,
            "ovsdb-server",
            &[
                &db,
                &remote,
                "--pidfile",
                "--detach",
                "--no-chdir",
                "--log-file",
            ],
        )?;
        self.ovs_vsctl(node.name, &["--no-wait", "init"])?;
        wait_for_ovs_to_count_cpus();
        let db_remote = format!("unix:{}", sock.display());
        self.ovs_command(
            node.name,
            "ovs-vswitchd",
            &[
                &db_remote,
                "--pidfile",
                "--detach",
                "--no-chdir",
                "--log-file",
            ],
        )?;
        let mp0_id = format!("external_ids:iface-id=k8s-{}", node.name);
        // br-ex takes the NIC's MAC, as OVN-Kubernetes sets it: left to itself, OVS moves
        // the bridge's MAC to its lowest port's when it gets to it, after neighbours may
        // have learnt the first one.
        // (`/sys/class/net` is the host's here: a namespace entered with setns keeps
        // its mount namespace.)
        let mac_of = |dev: &str| -> Result<String> {
            let out = self.exec(node.name, "ip", &["-br", "link", "show", "dev", dev])?;
            let text = String::from_utf8_lossy(&out.stdout).into_owned();
            text.split_whitespace()
                .nth(2)
                .map(str::to_owned)
                .with_context(|| format!("{}: no MAC of {dev} in {text:?}", node.name))
        };
        let uplink = self.spec.cni.uplink();
        let nic_mac = mac_of(uplink)?;
        let hwaddr = format!("other-config:hwaddr=\"{nic_mac}\"");
        self.ovs_vsctl(
            node.name,
            &[
                "add-br",
                "br-int",
                "--",
                "add-br",
                "br-ex",
                "--",
                "set",
                "bridge",
                "br-ex",
                &hwaddr,
                "--",
                "add-port",
                "br-ex",
                uplink,
                "--",
                "add-port",
                "br-int",
                "ovn-k8s-mp0",
                "--",
                "set",
                "interface",
                "ovn-k8s-mp0",
                "type=internal",
                &mp0_id,
            ],
        )?;
        // ovs-vsctl returns once ovs-vswitchd has applied it.
        self.ensure_upcall_handlers(node.name)?;
        let br_ex_mac = mac_of("br-ex")?;
        anyhow::ensure!(
            br_ex_mac == nic_mac,
            "{}: br-ex has MAC {br_ex_mac}, not {uplink}'s {nic_mac}",
            node.name
        );
        // Under OVN the subnet's gateway (.1) is ovn_cluster_router's; the management
        // port takes .2 and OVN-Kubernetes' MAC for it, which its logical port lists.
        let mp0 = match self.spec.cni.ovn() {
            Some(_) => node.ovn_management_ip(),
            None => node.pod_gateway(),
        };
        let mut cmds = vec![];
        if self.spec.cni.ovn().is_some() {
            cmds.push(format!("link set ovn-k8s-mp0 address {}", ovn_mac(mp0)));
        }
        cmds.extend([
            format!("addr add {mp0}/24 dev ovn-k8s-mp0"),
            "link set br-int up".to_owned(),
            "link set ovn-k8s-mp0 up".to_owned(),
        ]);
        if self.spec.family.has_v6() {
            cmds.push(format!(
                "addr add {}/64 dev ovn-k8s-mp0 nodad",
                node.pod_gateway_v6()
            ));
        }
        self.ns(node.name)?.ip_batch(&cmds)
    }

    /// `node`'s `ovs-vswitchd` has threads to take the datapath's upcalls: its log does not
    /// say it set none ([`wait_for_ovs_to_count_cpus`]), which would leave every bridge of
    /// the node passing nothing.
    fn ensure_upcall_handlers(&self, node: &str) -> Result<()> {
        let log = self.ovs_dir(node).join("ovs-vswitchd.log");
        let text = std::fs::read_to_string(&log)
            .with_context(|| format!("failed to read {}", log.display()))?;
        anyhow::ensure!(
            !text.contains("Overriding n-handler-threads to 0,"),
            "{node}: ovs-vswitchd started with no upcall handler threads ({}: \"Overriding \
             n-handler-threads to 0\"), so its datapath drops every packet that misses its \
             flow cache and br-ex passes nothing",
            log.display()
        );
        Ok(())
    }

    fn start_servers(&mut self) -> Result<()> {
        let port = addr::ECHO_PORT.to_string();
        // One server on 0.0.0.0 and, with IPv6, one on the host's IPv6 address (a socket on
        // [::] would also take IPv4 and report it as ::ffff:a.b.c.d).
        let mut logs = Vec::new();
        for net in NETWORKS {
            let host = format!("host-{}", net.id);
            let log = self.dir.join(format!("{host}.log"));
            let child = self.ns(&host)?.spawn(
                &self.spec.echo_bin,
                &["serve", "--tcp", &port, "--udp", &port],
                &log,
            )?;
            self.servers.push(child);
            logs.push((net.id, log));
            if self.spec.family.has_v6() {
                let log = self.dir.join(format!("{host}-v6.log"));
                let bind = net.host_v6.to_string();
                let child = self.ns(&host)?.spawn(
                    &self.spec.echo_bin,
                    &["serve", "--bind", &bind, "--tcp", &port, "--udp", &port],
                    &log,
                )?;
                self.servers.push(child);
                logs.push((net.id, log));
            }
        }
        // Each server prints one "ready" line once both sockets are bound.
        let deadline = Instant::now() + Duration::from_secs(5);
        for (i, (id, log)) in logs.iter().enumerate() {
            loop {
                let text = std::fs::read_to_string(log).unwrap_or_default();
                if text.lines().any(|l| l.starts_with("ready ")) {
                    break;
                }
                if let Some(server) = self.servers.get_mut(i)
                    && let Some(status) = server.try_wait()?
                {
                    bail!("egress-echo on host-{id} exited ({status}): {text}");
                }
                if Instant::now() > deadline {
                    bail!("egress-echo on host-{id} not ready after 5 s: {text}");
                }
                thread::sleep(Duration::from_millis(10));
            }
        }
        Ok(())
    }
}

/// How long after the kernel's boot (`CLOCK_MONOTONIC`) Open vSwitch 3.1.0, Debian 12's,
/// first counts the CPUs: `count_cpu_cores` refreshes its cached count when 10 s have
/// passed since the last refresh, the first one counted from 0, so before then it answers
/// 0 (fixed in 3.1.1: "ovs-thread: Fix cpus not read for the first 10s"). With the
/// kernel's per-CPU upcall dispatch, `ovs-vswitchd` sizes its handler threads by that count
/// and starts with none; the datapath then loses every upcall (`dpctl/show`: "lookups:
/// hit:0 missed:175 lost:175"), no flow is ever installed and the node's bridges pass
/// nothing, which does not heal when the count turns 2 later. A guest of `cargo xtask vm`
/// boots in about 6 s and starts the first lab's first node, w1, around then.
const OVS_COUNTS_CPUS_AFTER: Duration = Duration::from_millis(10_500);

/// Sleep until the kernel has been up [`OVS_COUNTS_CPUS_AFTER`] (at once on a machine up
/// longer, as any but a fresh guest is).
fn wait_for_ovs_to_count_cpus() {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime writes the timespec it is given, which lives on this stack.
    if unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) } != 0 {
        return;
    }
    let up = Duration::new(
        u64::try_from(ts.tv_sec).unwrap_or(0),
        u32::try_from(ts.tv_nsec).unwrap_or(0),
    );
    if let Some(left) = OVS_COUNTS_CPUS_AFTER.checked_sub(up) {
        thread::sleep(left);
    }
}

/// The hosts and routers on the secondary networks (A and B), where egress IPs are
/// announced: their neighbour entries outlive a failover, as a switch's or a router's do.
pub const ON_SECONDARY_NETWORKS: [&str; 3] = ["host-a", "host-b", "rtr-b"];

/// Neighbour settings of [`ON_SECONDARY_NETWORKS`] (per device, of each family): entries
/// kept four hours, as core switches keep ARP (OVN-Kubernetes issue 6553). Linux's
/// defaults re-verify an entry within seconds of its use (reachable 15-45 s, then a
/// unicast probe after 5 s that the old holder no longer answers, then a broadcast that
/// the new one does): a lab with them heals a wrong announcement by itself and hides it.
/// With these an entry is only changed by an announcement (gratuitous ARP, unsolicited
/// NA), as on a switch.
const SWITCH_LIKE_NEIGHBOURS: [(&str, &str); 3] = [
    ("base_reachable_time_ms", "14400000"),
    ("delay_first_probe_time", "14400"),
    ("gc_stale_time", "14400"),
];

/// Raise the kernel's neighbour table limits (`gc_thresh2` and `gc_thresh3` of ARP and
/// NDP) where a lab of `nodes` and `pods` would overflow them. They count the entries of
/// every namespace together, and the defaults (512 and 1,024) are a single host's: 100
/// nodes that all probe each other on one underlay hold about 10,000 entries, and past
/// the limit the kernel refuses new ones ("arp_cache: neighbor table overflow!", and
/// ENOBUFS from a pod's first packet). The only setting the lab changes outside its own
/// namespaces; it only ever raises it, and says so.
fn make_neighbour_room(nodes: usize, pods: usize) -> Result<()> {
    let need = (nodes * (nodes + 8) + pods * 2 + 256) as u64;
    for family in ["ipv4", "ipv6"] {
        let dir = Path::new("/proc/sys/net")
            .join(family)
            .join("neigh/default");
        for (key, want) in [("gc_thresh2", need), ("gc_thresh3", need * 2)] {
            let path = dir.join(key);
            let now: u64 = std::fs::read_to_string(&path)
                .ok()
                .and_then(|s| s.trim().parse().ok())
                .unwrap_or(0);
            if now < want {
                std::fs::write(&path, want.to_string())
                    .with_context(|| format!("failed to raise {} to {want}", path.display()))?;
                eprintln!(
                    "lab: raised {} from {now} to {want} (a lab of {nodes} nodes)",
                    path.display()
                );
            }
        }
    }
    Ok(())
}

fn validate(spec: &LabSpec) -> Result<()> {
    if spec.cni.ovn().is_some() && spec.family != Family::V4 {
        bail!("invalid lab spec: the OVN wiring is built for IPv4 pods only (so far)");
    }
    if spec.underlay == Underlay::V6 && !spec.family.has_v6() {
        bail!("invalid lab spec: an IPv6 underlay needs IPv6 in the lab (family V6 or Dual)");
    }
    let mut seen = std::collections::BTreeSet::new();
    for pod in &spec.pods {
        if pod.name.is_empty()
            || pod.name.len() > 10
            || !pod
                .name
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || c == '-')
        {
            bail!(
                "invalid lab spec: pod name {:?} must be 1-10 characters of [a-zA-Z0-9-]",
                pod.name
            );
        }
        let reserved = ["ul", "rtr", "rtr-b"];
        if reserved.contains(&pod.name.as_str())
            || pod.name.starts_with("net-")
            || pod.name.starts_with("host-")
            || spec.nodes.iter().any(|n| n.name == pod.name)
        {
            bail!("invalid lab spec: pod name {:?} is reserved", pod.name);
        }
        if !seen.insert(pod.name.clone()) {
            bail!("invalid lab spec: pod {:?} listed twice", pod.name);
        }
        if !spec.nodes.iter().any(|n| n.name == pod.node) {
            bail!(
                "invalid lab spec: pod {:?} on unknown node {:?}",
                pod.name,
                pod.node
            );
        }
    }
    if let Some(p) = &spec.prefix
        && (p.is_empty() || p.len() > 12 || !p.chars().all(|c| c.is_ascii_alphanumeric()))
    {
        bail!("invalid lab spec: prefix {p:?} must be 1-12 alphanumeric characters");
    }
    Ok(())
}

pub(super) fn assign_pod_ips(spec: &LabSpec) -> Result<Vec<Pod>> {
    let (specs, family, cni) = (&spec.pods, spec.family, spec.cni);
    let mut used: std::collections::BTreeSet<Ipv4Addr> =
        specs.iter().filter_map(|p| p.ip).collect();
    let mut pods = Vec::new();
    for pod in specs {
        let node = spec
            .nodes
            .iter()
            .find(|n| n.name == pod.node)
            .with_context(|| format!("pod {} on unknown node {}", pod.name, pod.node))?;
        let ip = match pod.ip {
            Some(ip) => ip,
            None => {
                let octet = node.ip.octets()[3];
                let ip = (11..=254)
                    .map(|n| Ipv4Addr::new(10, 244, octet, n))
                    .find(|ip| !used.contains(ip))
                    .with_context(|| format!("no free pod address on {}", node.name))?;
                used.insert(ip);
                ip
            }
        };
        pods.push(Pod {
            name: pod.name.clone(),
            namespace: pod.namespace.clone(),
            node: pod.node.clone(),
            labels: pod.labels.clone(),
            ip,
            veth: cni.veth(&pod.name),
            ipv6: family.has_v6().then(|| {
                let [_, _, node, n] = ip.octets();
                Ipv6Addr::new(0xfd00, 0x244, hex_like(node), 0, 0, 0, 0, hex_like(n))
            }),
        });
    }
    Ok(pods)
}

/// Claim a prefix by creating its underlay namespace (`ip netns add` fails if it exists, so
/// two processes cannot both win).
fn reserve_prefix(fixed: Option<&str>) -> Result<(String, Netns)> {
    let existing = netns::list_netns()?;
    let taken = |p: &str| {
        let head = format!("{p}-");
        existing.iter().any(|n| n.starts_with(&head))
    };
    if let Some(p) = fixed {
        if taken(p) {
            bail!("failed to start lab {p}: namespaces {p}-* exist (Lab::teardown_by_prefix)");
        }
        return Ok((p.to_owned(), Netns::add(&format!("{p}-ul"))?));
    }
    let mut last = None;
    for _ in 0..100 {
        let p = netns::next_prefix();
        if taken(&p) {
            continue;
        }
        match Netns::add(&format!("{p}-ul")) {
            Ok(ns) => return Ok((p, ns)),
            Err(e) => last = Some(e),
        }
    }
    Err(last.unwrap_or_else(|| anyhow::anyhow!("every lab prefix of this process is taken")))
        .context("failed to reserve a lab prefix")
}
