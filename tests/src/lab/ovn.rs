//! Real OVN under the lab's nodes ([`Cni::Ovn`]), built as OVN-Kubernetes builds it.
//!
//! One NB and one SB `ovsdb-server` and `ovn-northd` for the lab, in the underlay's
//! namespace, on unix sockets in the lab's directory (every node's `ovn-controller`
//! reaches the SB database by its path); per node an `ovn-controller` against the node's
//! own Open vSwitch (`system-id` the node's name, Geneve from its underlay address,
//! `physnet:br-ex` as its bridge mapping). The logical network, with `ovn-nbctl`, in
//! OVN-Kubernetes' names (go-controller/pkg/ovn/master.go, gateway.go,
//! base_network_controller.go):
//!
//! * per node a switch `<node>` (`other_config:subnet`) with the pods' ports
//!   `<namespace>_<pod>` (addresses and port security "MAC IP", the MAC `0a:58` and the
//!   IPv4 address), the management port `k8s-<node>` ("MAC IP" of `ovn-k8s-mp0`,
//!   `10.244.<octet>.2`, no port security) and `stor-<node>` to the cluster router;
//! * `ovn_cluster_router`: `rtos-<node>` (`10.244.<octet>.1/24`, the pods' gateway),
//!   `rtoj-ovn_cluster_router` (`100.64.0.1/16`) on the `join` switch; per node the
//!   source route of its subnet (shared gateway: to `GR_<node>`'s join address; local
//!   gateway: to the management port), a route to `GR_<node>`'s join address, and policy
//!   1004 rerouting the node's pods' traffic to its own address through the management
//!   port; policies 102 letting pod-to-pod and pod-to-join traffic skip the reroutes;
//! * per node `GR_<node>` (`options:chassis=<node>`): `rtoj-GR_<node>`
//!   (`100.64.0.<octet>/16`) on `join`, `rtoe-GR_<node>` with the node's address and
//!   `br-ex`'s MAC on `ext_<node>`, whose localnet port `br-ex_<node>` is `physnet`
//!   (`br-ex`); the SNAT of the cluster subnet to the node's address; routes to the
//!   cluster subnet through `ovn_cluster_router` and a default route to the underlay's
//!   router.
//!
//! `br-ex` carries the node's own traffic and `GR_<node>`'s, which share the node's
//! address and MAC: as OVN-Kubernetes' shared gateway bridge does, each side's
//! connections are committed to conntrack zone 64000 with a mark, and what comes in
//! from the NIC goes to OVN (the patch port) only as part of a connection OVN made; the
//! rest, ARP to both.
//!
//! In local gateway mode (`routingViaHost`) pods leave through `ovn-k8s-mp0` and the
//! node's routing, masqueraded to the node's address (OVN-Kubernetes' node-side NAT rule
//! for its subnet); `GR_<node>` is built all the same.

use super::*;

/// The cluster's pod network (every node's `10.244.<octet>.0/24`).
pub(super) const CLUSTER_SUBNET: &str = "10.244.0.0/16";
/// The `join` switch's network (OVN-Kubernetes' default `100.64.0.0/16`).
const JOIN_SUBNET: &str = "100.64.0.0/16";
/// `ovn_cluster_router`'s address on `join`.
const CLUSTER_ROUTER_JOIN_IP: Ipv4Addr = Ipv4Addr::new(100, 64, 0, 1);
/// The bridge mapping's network name (OVN-Kubernetes' `physnet`).
const PHYSNET: &str = "physnet";
/// Conntrack zone of `br-ex`'s steering flows (OVN-Kubernetes' `HostMasqCTZone`...
/// `64000` is the zone its shared gateway bridge commits to).
const BR_EX_CT_ZONE: u32 = 64000;
/// How long an OVN step may take before the lab fails (scaled by
/// `EGRESS_TEST_TIME_SCALE`): ovsdb and `ovn-controller` are slow to start under
/// emulation.
const OVN_STEP_TIMEOUT: Duration = Duration::from_secs(20);

/// OVN-Kubernetes' MAC for an address: `0a:58` and the IPv4 address's four bytes
/// (util.IPAddrToHWAddr).
pub(crate) fn ovn_mac(ip: Ipv4Addr) -> String {
    let [a, b, c, d] = ip.octets();
    format!("0a:58:{a:02x}:{b:02x}:{c:02x}:{d:02x}")
}

/// `GR_<node>`'s address on the `join` switch: `100.64.0.<node octet>`.
fn join_ip(node: &Node) -> Ipv4Addr {
    Ipv4Addr::new(100, 64, 0, node.ip.octets()[3])
}

/// A transaction of `ovn-nbctl` commands, joined with `--` as one invocation takes them.
#[derive(Default)]
struct Nb(Vec<String>);

impl Nb {
    fn cmd<S: AsRef<str>>(&mut self, words: &[S]) -> &mut Self {
        if !self.0.is_empty() {
            self.0.push("--".to_owned());
        }
        self.0.extend(words.iter().map(|w| w.as_ref().to_owned()));
        self
    }

    /// A logical switch port of type router, to `router_port`.
    fn router_lsp(&mut self, switch: &str, name: &str, router_port: &str) -> &mut Self {
        self.cmd(&["lsp-add", switch, name])
            .cmd(&["lsp-set-type", name, "router"])
            .cmd(&["lsp-set-addresses", name, "router"])
            .cmd(&[
                "lsp-set-options",
                name,
                &format!("router-port={router_port}"),
            ])
    }
}

impl Lab {
    /// Where the lab's OVN databases, `ovn-northd` and their logs live.
    pub fn ovn_dir(&self) -> PathBuf {
        self.dir.join("ovn-central")
    }

    fn ovn_socket(&self, db: &str) -> String {
        format!(
            "unix:{}",
            self.ovn_dir().join(format!("{db}.sock")).display()
        )
    }

    /// Run an OVN or Open vSwitch program in `member`'s namespace with `dir` as its
    /// run, log, database and configuration directory (OVS_* and OVN_* alike).
    fn ovn_command(
        &self,
        member: &str,
        dir: &Path,
        program: &str,
        args: &[&str],
    ) -> Result<Output> {
        let mut cmd = self.ns(member)?.command(program)?;
        cmd.args(args);
        for kind in ["OVS", "OVN"] {
            for what in ["RUNDIR", "LOGDIR", "DBDIR", "SYSCONFDIR"] {
                cmd.env(format!("{kind}_{what}"), dir);
            }
        }
        netns::run_checked(&mut cmd).with_context(|| format!("{program} in {member}"))
    }

    /// `ovn-nbctl` against the lab's NB database.
    pub fn ovn_nbctl(&self, args: &[&str]) -> Result<Output> {
        let db = format!("--db={}", self.ovn_socket("nb"));
        let timeout = format!(
            "--timeout={}",
            (OVN_STEP_TIMEOUT * crate::cluster::time_scale()).as_secs()
        );
        self.ovn_command(
            "ul",
            &self.ovn_dir(),
            "ovn-nbctl",
            &[&[db.as_str(), timeout.as_str()], args].concat(),
        )
    }

    /// `ovn-sbctl` against the lab's SB database.
    pub fn ovn_sbctl(&self, args: &[&str]) -> Result<Output> {
        let db = format!("--db={}", self.ovn_socket("sb"));
        self.ovn_command(
            "ul",
            &self.ovn_dir(),
            "ovn-sbctl",
            &[&[db.as_str(), "--timeout=30"], args].concat(),
        )
    }

    fn nb(&self, nb: &Nb) -> Result<()> {
        let args: Vec<&str> = nb.0.iter().map(String::as_str).collect();
        self.ovn_nbctl(&args).map(drop)
    }

    /// The OVN steps, once every node's Open vSwitch runs: the databases and northd, the
    /// cluster-wide topology, each node's controller and its part of the topology, the
    /// nodes' routes to the cluster, `br-ex`'s steering once OVN made its patch port, the
    /// local gateway's masquerade; then until every chassis has applied it all.
    pub(super) fn build_ovn(&self, mode: OvnGateway) -> Result<()> {
        self.start_ovn_central()?;
        self.nb(&cluster_topology())?;
        for node in &self.spec.nodes {
            self.start_ovn_controller(node)?;
            let br_ex_mac = self.link_mac(node.name, "br-ex")?;
            self.nb(&node_topology(node, &br_ex_mac, mode))?;
            let gw = node.pod_gateway();
            self.ns(node.name)?.ip_batch(&[
                format!("route replace {CLUSTER_SUBNET} via {gw} dev ovn-k8s-mp0"),
                format!("route replace {JOIN_SUBNET} via {gw} dev ovn-k8s-mp0"),
            ])?;
        }
        for node in &self.spec.nodes {
            self.steer_br_ex(node)?;
            if mode == OvnGateway::Local {
                self.masquerade_pods(node)?;
            }
            // `ipForwarding: Restricted`: forwarding on the interfaces OVN-Kubernetes
            // manages only (the node's `all` and `default` are off: `build_namespaces`).
            self.ns(node.name)?.sysctls(&[
                ("net.ipv4.conf.br-ex.forwarding", "1"),
                ("net.ipv4.conf.ovn-k8s-mp0.forwarding", "1"),
            ])?;
        }
        self.ovn_nbctl(&["--wait=hv", "sync"])
            .context("OVN's chassis did not all apply the topology")?;
        Ok(())
    }

    /// What a node under `ipForwarding: Restricted` does for our datapath, once the agents
    /// run (docs/operations.md: "the node must turn them on"; a MachineConfig's sysctl
    /// drop-in, which systemd-sysctl applies to a device when it appears): forwarding on
    /// the agent's tunnel device and on every secondary network's interface (`sec-*`). The
    /// agents run as deployed, with /proc/sys read-only: they name these and cannot set
    /// them. Nothing without OVN (its nodes forward everywhere).
    pub fn node_forwarding(&self) -> Result<()> {
        /// The agents' `--tunnel-device` (its default).
        const TUNNEL_DEVICE: &str = "egress0";
        if self.spec.cni.ovn().is_none() {
            return Ok(());
        }
        for node in &self.spec.nodes {
            let devices = || -> Result<Vec<String>> {
                let out = self.exec(node.name, "ls", &["/proc/sys/net/ipv4/conf"])?;
                Ok(String::from_utf8_lossy(&out.stdout)
                    .split_whitespace()
                    .filter(|d| *d == TUNNEL_DEVICE || d.starts_with("sec-"))
                    .map(str::to_owned)
                    .collect())
            };
            // The agent makes the tunnel device when it starts.
            crate::cluster::wait_until(std::time::Duration::from_secs(60), || {
                devices().is_ok_and(|d| d.iter().any(|d| d == TUNNEL_DEVICE))
            })
            .with_context(|| format!("{}'s agent made no {TUNNEL_DEVICE}", node.name))?;
            let keys: Vec<String> = devices()?
                .iter()
                .map(|d| format!("net.ipv4.conf.{d}.forwarding"))
                .collect();
            let kv: Vec<(&str, &str)> = keys.iter().map(|k| (k.as_str(), "1")).collect();
            self.ns(node.name)?.sysctls(&kv)?;
        }
        Ok(())
    }

    /// OVN-Kubernetes' EgressIP `ip` on `node` for `sources` (pods' addresses), as it
    /// renders one in OVN: a reroute policy at priority 100 on `ovn_cluster_router` for
    /// each pod toward `GR_<node>` (its address on `join`), and a `snat` of each pod to
    /// `ip` on that gateway router, which answers ARP for `ip` on `ext_<node>`. Policies
    /// of higher priority (pod to pod, 102; to a node's own address, 1004) still win.
    pub(super) fn render_ovn_egress_ip(
        &self,
        node: &str,
        sources: &[Ipv4Addr],
        ip: Ipv4Addr,
    ) -> Result<()> {
        let n = self
            .spec
            .nodes
            .iter()
            .find(|n| n.name == node)
            .with_context(|| format!("no node {node} for the EgressIP"))?;
        let mut nb = Nb::default();
        for src in sources {
            nb.cmd(&[
                "lr-policy-add",
                "ovn_cluster_router",
                "100",
                &format!("ip4.src == {src}"),
                "reroute",
                &join_ip(n).to_string(),
            ])
            .cmd(&[
                "lr-nat-add",
                &format!("GR_{node}"),
                "snat",
                &ip.to_string(),
                &src.to_string(),
            ]);
        }
        self.nb(&nb)?;
        self.ovn_nbctl(&["--wait=hv", "sync"])
            .context("OVN's chassis did not apply the EgressIP")
            .map(drop)
    }

    /// The NB and SB databases and `ovn-northd`, detached, in the underlay's namespace.
    fn start_ovn_central(&self) -> Result<()> {
        let dir = self.ovn_dir();
        std::fs::create_dir_all(&dir)
            .with_context(|| format!("failed to create {}", dir.display()))?;
        for db in ["nb", "sb"] {
            let schema = format!("/usr/share/ovn/ovn-{db}.ovsschema");
            anyhow::ensure!(
                Path::new(&schema).is_file(),
                "{schema} is missing: --cni ovn needs Debian's ovn-central and ovn-host \
                 (cargo xtask vm installs them)"
            );
            let file = dir.join(format!("{db}.db")).to_string_lossy().into_owned();
            self.ovn_command("ul", &dir, "ovsdb-tool", &["create", &file, &schema])?;
            let remote = format!("--remote=p{}", self.ovn_socket(db));
            self.detach("ul", &dir, "ovsdb-server", db, &[&file, &remote], true)?;
        }
        let (nb, sb) = (self.ovn_socket("nb"), self.ovn_socket("sb"));
        self.detach(
            "ul",
            &dir,
            "ovn-northd",
            "northd",
            &[&format!("--ovnnb-db={nb}"), &format!("--ovnsb-db={sb}")],
            true,
        )
    }

    /// Start `program` with `args`, detached, in `member`'s namespace, its pid and log
    /// files (and with `unixctl` its control socket) `<name>.pid`, `.log`, `.ctl` in `dir`.
    fn detach(
        &self,
        member: &str,
        dir: &Path,
        program: &str,
        name: &str,
        args: &[&str],
        unixctl: bool,
    ) -> Result<()> {
        let at = |what: &str| dir.join(format!("{name}.{what}")).display().to_string();
        let mut all: Vec<String> = args.iter().map(|a| (*a).to_owned()).collect();
        all.push(format!("--pidfile={}", at("pid")));
        all.push(format!("--log-file={}", at("log")));
        if unixctl {
            all.push(format!("--unixctl={}", at("ctl")));
        }
        all.extend(["--detach".to_owned(), "--no-chdir".to_owned()]);
        let all: Vec<&str> = all.iter().map(String::as_str).collect();
        self.ovn_command(member, dir, program, &all).map(drop)
    }

    /// `node`'s chassis: its Open vSwitch told where the SB database is, how to tunnel
    /// and which bridge is `physnet`, then `ovn-controller` against it.
    fn start_ovn_controller(&self, node: &Node) -> Result<()> {
        self.ovs_vsctl(
            node.name,
            &[
                "set",
                "bridge",
                "br-int",
                "fail-mode=secure",
                "other-config:disable-in-band=true",
                "--",
                "set",
                "open_vswitch",
                ".",
                &format!("external_ids:ovn-remote={}", self.ovn_socket("sb")),
                "external_ids:ovn-encap-type=geneve",
                &format!("external_ids:ovn-encap-ip={}", node.ip),
                &format!("external_ids:system-id={}", node.name),
                &format!("external_ids:ovn-bridge-mappings={PHYSNET}:br-ex"),
            ],
        )?;
        let db = format!("unix:{}", self.ovsdb_socket(node.name).display());
        // No control socket option: ovn-controller 23.03 takes none (its socket goes in
        // OVN_RUNDIR, the node's Open vSwitch directory).
        let dir = self.ovs_dir(node.name);
        self.detach(
            node.name,
            &dir,
            "ovn-controller",
            "ovn-controller",
            &[&db],
            false,
        )
    }

    /// `br-ex`'s flows once `ovn-controller` has made its patch port to `br-int` (for
    /// `ext_<node>`'s localnet port): the node's and `GR_<node>`'s connections apart in
    /// conntrack zone [`BR_EX_CT_ZONE`] (mark 1: OVN's, 2: the host's); from the NIC, IP
    /// to OVN only as a reply to OVN's, everything else to the host; ARP from the NIC to
    /// both.
    fn steer_br_ex(&self, node: &Node) -> Result<()> {
        let patch = format!("patch-br-ex_{}-to-br-int", node.name);
        let wait = format!(
            "--timeout={}",
            (OVN_STEP_TIMEOUT * crate::cluster::time_scale()).as_secs()
        );
        self.ovs_command(
            node.name,
            "ovs-vsctl",
            &[&wait, "wait-until", "interface", &patch],
        )
        .with_context(|| {
            format!(
                "{}: ovn-controller made no port {patch} on br-ex",
                node.name
            )
        })?;
        // By number: ovs-ofctl 3.1 takes no port name in a flow it reads from a file
        // ("invalid or unknown port for in_port").
        let ofport = |iface: &str| -> Result<String> {
            let out = self.ovs_vsctl(node.name, &["get", "interface", iface, "ofport"])?;
            Ok(String::from_utf8_lossy(&out.stdout).trim().to_owned())
        };
        let (nic, patch) = (ofport(self.spec.cni.uplink())?, ofport(&patch)?);
        self.ovs_vsctl(
            node.name,
            &["set", "bridge", "br-ex", "protocols=OpenFlow10,OpenFlow13"],
        )?;
        let z = BR_EX_CT_ZONE;
        let flows = [
            format!("table=0,priority=100,in_port={nic},ip,actions=ct(zone={z},table=1)"),
            format!("table=0,priority=50,in_port={nic},actions=FLOOD"),
            format!(
                "table=0,priority=100,in_port=LOCAL,ip,actions=ct(commit,zone={z},\
                 exec(set_field:0x2->ct_mark)),output:{nic}"
            ),
            format!("table=0,priority=10,in_port=LOCAL,actions=output:{nic}"),
            format!(
                "table=0,priority=100,in_port={patch},ip,actions=ct(commit,zone={z},\
                 exec(set_field:0x1->ct_mark)),output:{nic}"
            ),
            format!("table=0,priority=10,in_port={patch},actions=output:{nic}"),
            format!("table=1,priority=100,ct_state=+trk+est,ct_mark=0x1,actions=output:{patch}"),
            format!("table=1,priority=100,ct_state=+trk+rel,ct_mark=0x1,actions=output:{patch}"),
            "table=1,priority=0,actions=LOCAL".to_owned(),
        ];
        let path = self.ovs_dir(node.name).join("br-ex.flows");
        std::fs::write(&path, flows.join("\n") + "\n")
            .with_context(|| format!("failed to write {}", path.display()))?;
        self.ovs_command(
            node.name,
            "ovs-ofctl",
            // OpenFlow 1.3: the conntrack fields need OXM (OpenFlow 1.0 cannot carry them
            // with a table id: "switch does not support any of the usable flow formats").
            &[
                "-O",
                "OpenFlow13",
                "replace-flows",
                "br-ex",
                &path.to_string_lossy(),
            ],
        )?;
        Ok(())
    }

    /// Local gateway mode: the node masquerades its pods' traffic that its routing sends
    /// out (OVN-Kubernetes' NAT rule for the node's subnet), not what goes back into OVN.
    fn masquerade_pods(&self, node: &Node) -> Result<()> {
        let script = format!(
            "table ip ovnk_lgw {{
  chain post {{
    type nat hook postrouting priority 100; policy accept;
    ip saddr {} oifname != \"ovn-k8s-mp0\" masquerade
  }}
}}
",
            node.pod_cidr()
        );
        let path = self.dir.join(format!("ovn-lgw-{}.nft", node.name));
        std::fs::write(&path, script)
            .with_context(|| format!("failed to write {}", path.display()))?;
        self.exec(node.name, "nft", &["-f", &path.to_string_lossy()])?;
        Ok(())
    }

    /// `pod`'s logical port on its node's switch, as OVN-Kubernetes adds it, then until
    /// its node's `ovn-controller` has installed it (`ovn-installed` on the interface,
    /// what OVN-Kubernetes' CNI waits for).
    pub(super) fn add_ovn_pod(&self, pod: &Pod) -> Result<()> {
        let name = format!("{}_{}", pod.namespace, pod.name);
        let addresses = format!("{} {}", ovn_mac(pod.ip), pod.ip);
        let mut nb = Nb::default();
        nb.cmd(&["lsp-add", &pod.node, &name])
            .cmd(&["lsp-set-addresses", &name, &addresses])
            .cmd(&["lsp-set-port-security", &name, &addresses]);
        self.nb(&nb)?;
        let wait = format!(
            "--timeout={}",
            (OVN_STEP_TIMEOUT * crate::cluster::time_scale()).as_secs()
        );
        self.ovs_command(
            &pod.node,
            "ovs-vsctl",
            &[
                &wait,
                "wait-until",
                "interface",
                &pod.veth,
                "external_ids:ovn-installed=true",
            ],
        )
        .with_context(|| format!("{}: ovn-controller did not install {name}", pod.node))?;
        Ok(())
    }

    /// The NetworkPolicies of namespace `ns` as OVN-Kubernetes renders them
    /// (go-controller/pkg/ovn/policy.go, gress_policy.go): every pod of `ns` isolated
    /// for ingress and egress (port groups `<ns>_ingressDefaultDeny` and
    /// `<ns>_egressDefaultDeny`: `to-lport`/`from-lport` 1000 `drop` of IP, 1001 `allow`
    /// of ARP), and one policy selecting them all (port group `<ns>_allow`) whose rules
    /// are `allow-related` at 1001: ingress from the pods of `ns`, egress to the cluster's
    /// pods and to `egress_to`; on every node's switch the management port's address is
    /// `allow-related` (what OVN-Kubernetes adds for the kubelet's probes). Then until
    /// every chassis has applied it. A reply that crosses these ACLs without OVN's
    /// conntrack having seen its request is dropped: the request of a flow our datapath
    /// redirected never entered OVN.
    pub fn isolate_namespace(&self, ns: &str, egress_to: &[&str]) -> Result<()> {
        let ports: Vec<String> = self
            .pods
            .iter()
            .filter(|p| p.namespace == ns)
            .map(|p| format!("{ns}_{}", p.name))
            .collect();
        let members: Vec<String> = self
            .pods
            .iter()
            .filter(|p| p.namespace == ns)
            .map(|p| p.ip.to_string())
            .collect();
        let (ingress, egress, allow) = (
            format!("{ns}_ingressDefaultDeny"),
            format!("{ns}_egressDefaultDeny"),
            format!("{ns}_allow"),
        );
        let mut nb = Nb::default();
        for pg in [&ingress, &egress, &allow] {
            nb.cmd(&[&["pg-add".to_owned(), pg.clone()], ports.as_slice()].concat());
        }
        let acl = |nb: &mut Nb, pg: &str, dir: &str, prio: &str, m: String, verdict: &str| {
            nb.cmd(&["--type=port-group", "acl-add", pg, dir, prio, &m, verdict]);
        };
        acl(
            &mut nb,
            &ingress,
            "to-lport",
            "1000",
            format!("outport == @{ingress} && ip"),
            "drop",
        );
        acl(
            &mut nb,
            &ingress,
            "to-lport",
            "1001",
            format!("outport == @{ingress} && arp"),
            "allow",
        );
        acl(
            &mut nb,
            &egress,
            "from-lport",
            "1000",
            format!("inport == @{egress} && ip"),
            "drop",
        );
        acl(
            &mut nb,
            &egress,
            "from-lport",
            "1001",
            format!("inport == @{egress} && arp"),
            "allow",
        );
        acl(
            &mut nb,
            &allow,
            "to-lport",
            "1001",
            format!(
                "ip4.src == {{{}}} && outport == @{allow}",
                members.join(", ")
            ),
            "allow-related",
        );
        let to = [&[CLUSTER_SUBNET], egress_to].concat().join(", ");
        acl(
            &mut nb,
            &allow,
            "from-lport",
            "1001",
            format!("ip4.dst == {{{to}}} && inport == @{allow}"),
            "allow-related",
        );
        for node in self.nodes() {
            let m = format!("ip4.src == {}", node.ovn_management_ip());
            nb.cmd(&[
                "acl-add",
                node.name,
                "to-lport",
                "1001",
                &m,
                "allow-related",
            ]);
        }
        self.nb(&nb)?;
        self.ovn_nbctl(&["--wait=hv", "sync"])
            .context("the chassis did not apply the NetworkPolicy ACLs")?;
        Ok(())
    }

    /// `dev`'s MAC in `member`'s namespace.
    pub(super) fn link_mac(&self, member: &str, dev: &str) -> Result<String> {
        let out = self.exec(member, "ip", &["-br", "link", "show", "dev", dev])?;
        let text = String::from_utf8_lossy(&out.stdout).into_owned();
        text.split_whitespace()
            .nth(2)
            .map(str::to_owned)
            .with_context(|| format!("{member}: no MAC of {dev} in {text:?}"))
    }

    /// What OVN shows of the lab, for [`Lab::wiring_report`]: the NB and SB databases,
    /// `node`'s `br-ex` flows and the tails of its `ovn-controller`'s and northd's logs.
    pub(super) fn ovn_report(&self, node: &str, show: &mut dyn FnMut(String, Result<Output>)) {
        show("ovn-nbctl show".to_owned(), self.ovn_nbctl(&["show"]));
        show("ovn-sbctl show".to_owned(), self.ovn_sbctl(&["show"]));
        show(
            "ovn-nbctl lr-route-list ovn_cluster_router".to_owned(),
            self.ovn_nbctl(&["lr-route-list", "ovn_cluster_router"]),
        );
        show(
            "ovs-ofctl dump-flows br-ex".to_owned(),
            self.ovs_command(
                node,
                "ovs-ofctl",
                &["-O", "OpenFlow13", "dump-flows", "br-ex"],
            ),
        );
        for log in [
            self.ovs_dir(node).join("ovn-controller.log"),
            self.ovn_dir().join("northd.log"),
        ] {
            let tail = std::fs::read_to_string(&log).map(|t| {
                let lines: Vec<&str> = t.lines().collect();
                lines[lines.len().saturating_sub(20)..].join("\n") + "\n"
            });
            show(
                format!("{} (last 20 lines)", log.display()),
                tail.map(|t| Output {
                    status: std::os::unix::process::ExitStatusExt::from_raw(0),
                    stdout: t.into_bytes(),
                    stderr: Vec::new(),
                })
                .map_err(anyhow::Error::from),
            );
        }
    }
}

/// What OVN-Kubernetes creates once for the cluster: `ovn_cluster_router`, the `join`
/// switch and the router's port on it, the policies that keep pod-to-pod and pod-to-join
/// traffic on its routes.
fn cluster_topology() -> Nb {
    let mut nb = Nb::default();
    let rtoj = "rtoj-ovn_cluster_router";
    nb.cmd(&["lr-add", "ovn_cluster_router"])
        .cmd(&["ls-add", "join"])
        .cmd(&[
            "lrp-add",
            "ovn_cluster_router",
            rtoj,
            &ovn_mac(CLUSTER_ROUTER_JOIN_IP),
            &format!("{CLUSTER_ROUTER_JOIN_IP}/16"),
        ])
        .router_lsp("join", "jtor-ovn_cluster_router", rtoj);
    for dst in [CLUSTER_SUBNET, JOIN_SUBNET] {
        nb.cmd(&[
            "lr-policy-add",
            "ovn_cluster_router",
            "102",
            &format!("ip4.src == {CLUSTER_SUBNET} && ip4.dst == {dst}"),
            "allow",
        ]);
    }
    nb
}

/// What OVN-Kubernetes creates for `node`: its switch and management port, its router
/// port, `GR_<node>` on `join` and `ext_<node>`, the SNAT, the routes and the policy.
fn node_topology(node: &Node, br_ex_mac: &str, mode: OvnGateway) -> Nb {
    let n = node.name;
    let (gw, mgmt, join) = (node.pod_gateway(), node.ovn_management_ip(), join_ip(node));
    let gr = format!("GR_{n}");
    let (rtos, rtoj, rtoe) = (
        format!("rtos-{n}"),
        format!("rtoj-{gr}"),
        format!("rtoe-{gr}"),
    );
    let (k8s, ext, localnet) = (format!("k8s-{n}"), format!("ext_{n}"), format!("br-ex_{n}"));
    let mut nb = Nb::default();
    nb.cmd(&["ls-add", n])
        .cmd(&[
            "set",
            "logical_switch",
            n,
            &format!("other_config:subnet={}", node.pod_cidr()),
            &format!("other_config:exclude_ips={mgmt}"),
        ])
        .cmd(&[
            "lrp-add",
            "ovn_cluster_router",
            &rtos,
            &ovn_mac(gw),
            &format!("{gw}/24"),
        ])
        .router_lsp(n, &format!("stor-{n}"), &rtos)
        .cmd(&["lsp-add", n, &k8s])
        .cmd(&[
            "lsp-set-addresses",
            &k8s,
            &format!("{} {mgmt}", ovn_mac(mgmt)),
        ])
        // The gateway router.
        .cmd(&["lr-add", &gr])
        .cmd(&[
            "set",
            "logical_router",
            &gr,
            &format!("options:chassis={n}"),
            "options:lb_force_snat_ip=router_ip",
            "options:snat-ct-zone=0",
            "options:always_learn_from_arp_request=false",
            "options:dynamic_neigh_routers=true",
        ])
        .cmd(&["lrp-add", &gr, &rtoj, &ovn_mac(join), &format!("{join}/16")])
        .router_lsp("join", &format!("jtor-{gr}"), &rtoj)
        .cmd(&["lrp-add", &gr, &rtoe, br_ex_mac, &format!("{}/24", node.ip)])
        .cmd(&["ls-add", &ext])
        .router_lsp(&ext, &format!("etor-{gr}"), &rtoe)
        .cmd(&["lsp-add", &ext, &localnet])
        .cmd(&["lsp-set-type", &localnet, "localnet"])
        .cmd(&["lsp-set-addresses", &localnet, "unknown"])
        .cmd(&[
            "lsp-set-options",
            &localnet,
            &format!("network_name={PHYSNET}"),
        ])
        .cmd(&[
            "lr-route-add",
            &gr,
            CLUSTER_SUBNET,
            &CLUSTER_ROUTER_JOIN_IP.to_string(),
        ])
        .cmd(&[
            "lr-route-add",
            &gr,
            "0.0.0.0/0",
            &addr::ROUTER.to_string(),
            &rtoe,
        ])
        .cmd(&[
            "lr-nat-add",
            &gr,
            "snat",
            &node.ip.to_string(),
            CLUSTER_SUBNET,
        ])
        // The cluster router's routes for this node.
        .cmd(&[
            "lr-route-add",
            "ovn_cluster_router",
            &join.to_string(),
            &join.to_string(),
        ]);
    let next_hop = match mode {
        OvnGateway::Shared => join,
        OvnGateway::Local => mgmt,
    };
    nb.cmd(&[
        "--policy=src-ip",
        "lr-route-add",
        "ovn_cluster_router",
        &node.pod_cidr(),
        &next_hop.to_string(),
    ])
    .cmd(&[
        "lr-policy-add",
        "ovn_cluster_router",
        "1004",
        &format!("inport == \"{rtos}\" && ip4.dst == {} /* {n} */", node.ip),
        "reroute",
        &mgmt.to_string(),
    ]);
    nb
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn macs_are_ovn_kubernetes_ones() {
        assert_eq!(ovn_mac(Ipv4Addr::new(10, 244, 11, 2)), "0a:58:0a:f4:0b:02");
        assert_eq!(ovn_mac(CLUSTER_ROUTER_JOIN_IP), "0a:58:64:40:00:01");
    }

    #[test]
    fn a_node_routes_its_pods_by_the_gateway_mode() {
        let w1 = &NODES[0];
        let routes = |mode| {
            let nb = node_topology(w1, "02:00:00:00:00:01", mode);
            let at = nb.0.iter().position(|w| w == "--policy=src-ip").unwrap();
            nb.0[at + 3..at + 5].join(" ")
        };
        assert_eq!(routes(OvnGateway::Shared), "10.244.11.0/24 100.64.0.11");
        assert_eq!(routes(OvnGateway::Local), "10.244.11.0/24 10.244.11.2");
    }
}
