//! Failures the tests inject (links, partitions) and the gateways' routes.

use super::*;

/// How long the kernel may take to act on a link going down or up ([`Lab::set_underlay_link`]).
pub const LINK_BACK_WITHIN: Duration = Duration::from_secs(30);

impl Lab {
    /// Take a node's underlay links ([`Cni::underlay_links`]: `eth0` in its namespace, and
    /// under OVN the bond's second port `eth1`) down, or bring them back up with the node's
    /// addresses and routes (the kernel drops static routes, and IPv6 addresses, of a link
    /// that goes down). Down, the node reaches no other node, and nothing reaches it.
    ///
    /// Each returns once the kernel has acted on it: down, once the switch's port stopped
    /// forwarding; up, once it forwards again and, with IPv6, the device has its
    /// link-local address. Both wait for the kernel's link watcher, which needs the RTNL
    /// lock: while another lab tears its namespaces down, a port has been seen to keep
    /// its old state for over ten seconds (and, had the test not waited, to go down only
    /// after the link was back up).
    pub fn set_underlay_link(&self, node: &str, up: bool) -> Result<()> {
        let n = self.node(node)?;
        let cni = self.spec.cni;
        let ports = n.underlay_ports(cni);
        if !up {
            let down: Vec<String> = ports
                .iter()
                .map(|(link, _)| format!("link set {link} down"))
                .collect();
            self.ns(node)?.ip_batch(&down)?;
            return ports
                .iter()
                .try_for_each(|(_, port)| self.wait_port("ul", port, false));
        }
        let v6 = self.spec.family.has_v6();
        self.ns(node)?
            .ip_batch(&n.underlay_config(&self.spec.nodes, v6, cni))?;
        ports
            .iter()
            .try_for_each(|(_, port)| self.wait_carried(node, cni.underlay_device(), "ul", port))
    }

    /// Take the underlay switch's port facing `node`'s `link` ([`Node::underlay_ports`])
    /// down, as a failing switch port goes: the node's link loses its carrier, nothing
    /// changes inside the node. Or bring it back up. Returns once the port forwards again,
    /// or no longer does.
    pub fn set_underlay_switch_port(&self, node: &str, link: &str, up: bool) -> Result<()> {
        let port = self
            .node(node)?
            .underlay_ports(self.spec.cni)
            .into_iter()
            .find_map(|(l, port)| (l == link).then_some(port))
            .with_context(|| format!("{node} has no underlay link {link}"))?;
        let state = if up { "up" } else { "down" };
        self.ns("ul")?
            .ip_batch(&[format!("link set {port} {state}")])?;
        self.wait_port("ul", &port, up)
    }

    /// The port `node`'s bond carries its traffic on (`bond0`'s active slave, from
    /// `ip -d link`), if it has one.
    pub fn bond_active_port(&self, node: &str) -> Result<Option<String>> {
        let uplink = self.spec.cni.uplink();
        let o = self.exec(node, "ip", &["-j", "-d", "link", "show", "dev", uplink])?;
        let links: serde_json::Value = serde_json::from_slice(&o.stdout)
            .with_context(|| format!("ip -j link show {uplink} in {node} is not JSON"))?;
        let data = &links[0]["linkinfo"]["info_data"];
        anyhow::ensure!(
            data["mode"] == "active-backup",
            "{node}'s {uplink} is not an active-backup bond: {data}"
        );
        Ok(data["active_slave"].as_str().map(str::to_owned))
    }

    /// Take a gateway's link to a secondary network (`sec-a`, `sec-b`) down, or bring it
    /// back up with the gateway's own addresses on it and the lab's static routes out of it
    /// ([`gateway_static_routes`]); egress IPs are the agent's to add, and routes added with
    /// [`Lab::add_gateway_route`] are gone with the link.
    pub fn set_secondary_link(&self, gw: &str, link: &str, up: bool) -> Result<()> {
        let id = match link {
            "sec-a" => 'a',
            "sec-b" => 'b',
            other => bail!("{other:?} is not a secondary link (sec-a, sec-b)"),
        };
        let (ip, ip6) = self.node(gw)?.secondary_addrs(id)?;
        let mut cmds = vec![format!(
            "link set {link} {}",
            if up { "up" } else { "down" }
        )];
        if up {
            cmds.push(format!("addr replace {ip}/24 dev {link}"));
            if self.spec.family.has_v6() {
                cmds.push(format!("addr replace {ip6}/64 dev {link} nodad"));
            }
            cmds.extend(
                gateway_static_routes(self.spec.family.has_v6())
                    .into_iter()
                    .filter(|r| r.dev == link)
                    .map(|r| format!("route replace {r}")),
            );
        }
        self.ns(gw)?.ip_batch(&cmds)?;
        // Under Cni::Ovs the link is a VLAN off the NIC: no port of its own.
        let port = (!self.spec.cni.runs_ovs()).then_some(gw);
        let bridge = format!("net-{id}");
        match (port, up) {
            (Some(port), false) => self.wait_port(&bridge, port, false),
            (None, false) => Ok(()),
            (Some(port), true) => self.wait_carried(gw, link, &bridge, port),
            (None, true) => self.wait_carried_at(gw, link, None),
        }
    }

    /// Wait until bridge port `port` in `bridge_ns` forwards (`forwarding`) or does not.
    fn wait_port(&self, bridge_ns: &str, port: &str, forwarding: bool) -> Result<()> {
        let deadline = Instant::now() + LINK_BACK_WITHIN;
        while self.port_forwards(bridge_ns, port)? != forwarding {
            if Instant::now() >= deadline {
                bail!(
                    "port {port} of {bridge_ns}'s bridge {} forwarding {}s after its link \
                     went {}",
                    if forwarding { "is not" } else { "is still" },
                    LINK_BACK_WITHIN.as_secs(),
                    if forwarding { "up" } else { "down" },
                );
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        Ok(())
    }

    /// Wait until `member`'s `dev` is carried again: `port` of the bridge in `bridge_ns`
    /// is up and forwarding, and `dev` has an IPv6 link-local address (in a dual or IPv6
    /// lab). An error after [`LINK_BACK_WITHIN`] names what is still missing.
    fn wait_carried(&self, member: &str, dev: &str, bridge_ns: &str, port: &str) -> Result<()> {
        self.wait_carried_at(member, dev, Some((bridge_ns, port)))
    }

    fn wait_carried_at(&self, member: &str, dev: &str, port: Option<(&str, &str)>) -> Result<()> {
        let v6 = self.spec.family.has_v6();
        let deadline = Instant::now() + LINK_BACK_WITHIN;
        loop {
            let mut missing = Vec::new();
            if let Some((bridge_ns, port)) = port
                && !self.port_forwards(bridge_ns, port)?
            {
                missing.push(format!("port {port} of {bridge_ns}'s bridge forwarding"));
            }
            if v6 {
                let o = self.exec(
                    member,
                    "ip",
                    &["-6", "-o", "addr", "show", "dev", dev, "scope", "link"],
                )?;
                if o.stdout.is_empty() {
                    missing.push(format!("an IPv6 link-local address on {member}'s {dev}"));
                }
            }
            if missing.is_empty() {
                return Ok(());
            }
            if Instant::now() >= deadline {
                bail!(
                    "{member}'s {dev} is not carried {}s after it came up: no {}",
                    LINK_BACK_WITHIN.as_secs(),
                    missing.join(", no ")
                );
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Whether bridge port `port` in `bridge_ns` is up and forwarding.
    fn port_forwards(&self, bridge_ns: &str, port: &str) -> Result<bool> {
        let o = self.exec(bridge_ns, "ip", &["-j", "-d", "link", "show", "dev", port])?;
        let links: serde_json::Value = serde_json::from_slice(&o.stdout)
            .with_context(|| format!("ip -j link show {port} in {bridge_ns} is not JSON"))?;
        let link = &links[0];
        Ok(link["operstate"] == "UP"
            && link["linkinfo"]["info_slave_data"]["state"] == "forwarding")
    }

    /// `ip route add <route>` in a gateway's namespace: a route that `destinationsFrom:
    /// Routes` learns (e.g. [`GatewayRoute::net_e`]).
    pub fn add_gateway_route(&self, node: &str, route: &GatewayRoute) -> Result<()> {
        self.gateway_route(node, "add", route)
    }

    /// `ip route del <route>` in a gateway's namespace.
    pub fn del_gateway_route(&self, node: &str, route: &GatewayRoute) -> Result<()> {
        self.gateway_route(node, "del", route)
    }

    fn gateway_route(&self, node: &str, verb: &str, route: &GatewayRoute) -> Result<()> {
        let family = if route.via.is_ipv6() { "-6" } else { "-4" };
        let args = format!("{family} route {verb} {route}");
        self.exec(node, "ip", &args.split_whitespace().collect::<Vec<_>>())
            .with_context(|| format!("failed to {verb} route {route} on {node}"))
            .map(drop)
    }

    /// Nodes `a` and `b` can no longer reach each other over the underlay: no IP packet of
    /// either family passes between them, as behind a filtering router; ARP and neighbour
    /// discovery still do (else their neighbour entries would fail and keep failing for
    /// seconds after the repair). Every other pair is untouched. The underlay bridge
    /// filters what it forwards between their ports (all of each node's, whichever its
    /// bond uses; nftables, bridge family, in the `ul` namespace): nothing changes inside
    /// the nodes themselves.
    pub fn partition_underlay(&self, a: &str, b: &str) -> Result<()> {
        let ports_of = |node: &str| -> Result<String> {
            let ports: Vec<String> = self
                .node(node)?
                .underlay_ports(self.spec.cni)
                .into_iter()
                .map(|(_, port)| format!("\"{port}\""))
                .collect();
            Ok(format!("{{ {} }}", ports.join(", ")))
        };
        let (a, b) = (ports_of(a)?, ports_of(b)?);
        let rules: String = [(&a, &b), (&b, &a)]
            .iter()
            .map(|(from, to)| {
                let ports = format!("iifname {from} oifname {to}");
                format!(
                    "    {ports} ether type arp accept
    {ports} icmpv6 type {{ nd-neighbor-solicit, nd-neighbor-advert }} accept
    {ports} drop
"
                )
            })
            .collect();
        let script = format!(
            "table bridge {PARTITION_TABLE} {{
  chain forward {{
    type filter hook forward priority 0; policy accept;
{rules}  }}
}}
"
        );
        let path = self.dir.join(format!("partition-{a}-{b}.nft"));
        std::fs::write(&path, script)
            .with_context(|| format!("failed to write {}", path.display()))?;
        self.exec("ul", "nft", &["-f", &path.to_string_lossy()])
            .map(drop)
    }

    /// OVN-Kubernetes' EgressIP `ip` on `node` for `pods` leaving by the primary network,
    /// and the `k8s.ovn.org/v1` EgressIP object in the state directory
    /// (`ovn-egressip-<ip>.yaml`), which the agents read. Under OVN (`--cni ovn`), rendered in
    /// OVN as OVN-Kubernetes renders it ([`Lab::render_ovn_egress_ip`]). Without OVN, what
    /// it does on a node in local gateway mode (pod egress routed by the host): `ip` on
    /// the node's underlay device (where OVN's gateway router would answer for it) and
    /// SNAT of the pods' packets leaving by it to `ip` (nftables, table `ovnk_egressip`).
    pub fn add_ovn_egress_ip(&self, node: &str, pods: &[&str], ip: Ipv4Addr) -> Result<()> {
        let dev = self.spec.cni.underlay_device();
        let addrs: Vec<Ipv4Addr> = pods
            .iter()
            .map(|p| Ok(self.pod(p)?.ip))
            .collect::<Result<_>>()?;
        if self.spec.cni.ovn().is_some() {
            self.render_ovn_egress_ip(node, &addrs, ip)?;
        } else {
            self.nft_egress_ip(node, dev, &addrs, ip)?;
        }
        let selected: Vec<&Pod> = pods.iter().map(|p| self.pod(p)).collect::<Result<_>>()?;
        let object = json!({
            "apiVersion": "k8s.ovn.org/v1",
            "kind": "EgressIP",
            "metadata": {"name": format!("lab-ovn-{ip}")},
            "spec": {
                "egressIPs": [ip.to_string()],
                "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": selected[0].namespace}},
                "podSelector": {"matchLabels": selected[0].labels},
            },
        });
        self.write_state_file(&format!("ovn-egressip-{ip}.yaml"), &to_yaml_doc(&object))
    }

    /// [`Lab::add_ovn_egress_ip`] without OVN: the address and an nftables SNAT.
    fn nft_egress_ip(&self, node: &str, dev: &str, addrs: &[Ipv4Addr], ip: Ipv4Addr) -> Result<()> {
        let sources: Vec<String> = addrs.iter().map(ToString::to_string).collect();
        self.ns(node)?
            .ip_batch(&[format!("addr add {ip}/32 dev {dev}")])?;
        let script = format!(
            "table ip ovnk_egressip {{
  chain post {{
    type nat hook postrouting priority 100; policy accept;
    ip saddr {{ {} }} oifname \"{dev}\" snat to {ip}
  }}
}}
",
            sources.join(", ")
        );
        let path = self.dir.join(format!("ovn-egressip-{node}.nft"));
        std::fs::write(&path, script)
            .with_context(|| format!("failed to write {}", path.display()))?;
        self.exec(node, "nft", &["-f", &path.to_string_lossy()])
            .map(drop)
    }

    /// Remove every partition of [`Lab::partition_underlay`].
    pub fn heal_underlay(&self) -> Result<()> {
        let out = self.ns("ul")?.exec_unchecked("nft", &["list", "tables"])?;
        if String::from_utf8_lossy(&out.stdout).contains(PARTITION_TABLE) {
            self.exec("ul", "nft", &["delete", "table", "bridge", PARTITION_TABLE])?;
        }
        Ok(())
    }
}
