//! `egress-agent`: the per-node agent of the egress gateway datapath.

use std::{net::SocketAddr, path::PathBuf, process::ExitCode, time::Duration};

use anyhow::{Context as _, Result};
use clap::{Parser, Subcommand};
use egress_agent::{agent, api, check, datapath, doctor, ebpf, liveness};
use egress_common::config::{DEFAULT_PORT_MAX, DEFAULT_PORT_MIN, DEFAULT_TUNNEL_PORT};
use ipnet::IpNet;

/// The VXLAN device of `run` and `cleanup`.
const DEFAULT_TUNNEL_DEVICE: &str = "egress0";

#[derive(Parser)]
#[command(
    version = egress_agent::VERSION,
    about = "Per-destination egress gateways for Kubernetes, in eBPF",
    long_about = "Runs on every node (a DaemonSet). Pods selected by an EgressGatewayPolicy \
                  reach each destination network through a gateway node, leaving with that \
                  network's egress IP. The agent compiles cluster state into BPF maps, holds \
                  egress IPs on gateways and attaches the TC programs."
)]
struct Cli {
    /// How logs are written to stderr: `text` (coloured on a terminal) or `json` (one
    /// object per line: timestamp, level, target, message and fields, for a log
    /// collector). Which logs: `RUST_LOG` (default `info`; e.g. `egress_agent=debug`).
    #[arg(
        long,
        global = true,
        env = "EGRESS_LOG_FORMAT",
        value_enum,
        default_value_t
    )]
    log_format: egress_agent::logs::LogFormat,
    #[command(subcommand)]
    command: Command,
}

// Parsed once per process: the size of `Run`'s flags costs nothing worth a `Box`.
#[allow(clippy::large_enum_variant)]
#[derive(Subcommand)]
enum Command {
    /// Run the agent for one node.
    Run(Box<RunArgs>),
    /// Check this node for what the agent needs: kernel (BTF, TCX or legacy tc, map types,
    /// the programs loaded, JIT), bpffs,
    /// capabilities, the tunnel port, Open vSwitch hardware offload, rp_filter, MTU
    /// headroom, egress IPs (subnet on an up interface, nobody else answering for them). One line per check: ok, warn or
    /// fail, with what to do; exits non-zero if any check fails.
    Doctor {
        /// This node's name in the cluster state (default: the Node whose InternalIP is
        /// one of this host's addresses).
        #[arg(long, env = "NODE_NAME")]
        node_name: Option<String>,
        /// Read policies, Nodes and EgressNodes from this state directory (as `run
        /// --state-dir`), to check the egress IPs of the policies that select this node.
        #[arg(long, env = "EGRESS_STATE_DIR")]
        state_dir: Option<PathBuf>,
        /// An egress IP to check (subnet on an up interface, duplicate address probe).
        /// Repeat the flag for several.
        #[arg(long = "egress-ip", value_name = "IP")]
        egress_ips: Vec<std::net::IpAddr>,
        #[command(flatten)]
        node: NodeArgs,
        /// Do not probe the network for the egress IPs.
        #[arg(long)]
        no_dad: bool,
        /// OVSDB's unix socket, asked whether Open vSwitch offloads flows to the NIC
        /// (`other_config:hw-offload`); no socket: no Open vSwitch.
        #[arg(long, env = "EGRESS_OVSDB", default_value = egress_agent::iface::ovsdb::DEFAULT_SOCKET)]
        ovsdb: PathBuf,
    },
    /// Print a running agent's view: the egress IPs it holds, its peers (alive, round
    /// trip), every holder and why (from its --metrics-addr).
    Status {
        /// The agent's `--status-socket` (what `kubectl exec` into the agent's pod finds).
        #[arg(long, env = "EGRESS_STATUS_SOCKET", default_value = egress_agent::endpoints::DEFAULT_STATUS_SOCKET)]
        socket: PathBuf,
        /// Ask the agent's `--metrics-addr` instead (plain HTTP only: with TLS on, use the
        /// socket).
        #[arg(long)]
        metrics_addr: Option<SocketAddr>,
    },
    /// Print an agent's maps, conntrack and counters in human terms.
    Maps {
        #[arg(long, default_value = ebpf::DEFAULT_BPFFS_DIR)]
        bpffs_dir: PathBuf,
    },
    /// Validate a state directory offline: one line per problem, non-zero exit if any.
    Check {
        #[arg(long)]
        state_dir: PathBuf,
        #[command(flatten)]
        cluster: ClusterArgs,
    },
    /// Say why a pod's traffic to a destination leaves the way it does: the policy, rule
    /// and prefix that match (longest prefix), the gateway, interface and egress IP, the
    /// NetworkPolicy verdict and the failure policy; or why no policy takes it. Reads a
    /// state directory, or the Kubernetes API; adds the counters of the maps pinned here.
    Explain(Box<egress_agent::explain::cli::ExplainArgs>),
    /// Print the CustomResourceDefinitions (EgressGatewayPolicy, EgressNode).
    Crd,
    /// Translate OVN-Kubernetes EgressIP objects (YAML files or stdin, such as `kubectl get
    /// egressips -o yaml`, or the cluster's with --from-cluster) into
    /// EgressGatewayPolicies, printed as YAML, with what EgressIP
    /// does not say (destinations: all; the gateway nodes; the failure policy) in
    /// comments. An object that does not translate is named on stderr with its field and
    /// why; the others are still printed, and the exit code is non-zero.
    ImportEgressip(egress_agent::import::cli::ImportArgs),
    /// Install the chained CNI plugin `egress-cni` into a CNI bin directory (the
    /// DaemonSet's init container, with the host's /opt/cni/bin mounted): the image's
    /// plugin bundle, run by a script with its own loader and libraries.
    InstallCni {
        /// The CNI bin directory (the host's, mounted).
        #[arg(long, default_value = "/opt/cni/bin")]
        dir: PathBuf,
        /// The plugin bundle.
        #[arg(long, default_value = egress_agent::cni::BUNDLE_DIR)]
        bundle: PathBuf,
    },
    /// Uninstall an agent's datapath from this node: detach its programs, remove its pinned
    /// maps, its tunnel device and the egress IPs it added (one line per thing removed).
    #[command(
        long_about = "Uninstall an agent's datapath from this node: detach its TC \
        programs (pinned TCX links, or its tc filters: ours alone, a CNI's stay), remove its pinned maps, its tunnel device and the \
        dedicated egress IPs it added (read from its maps), and with --cni-bin-dir the CNI \
        plugin, printing one line per thing removed.\n\n\
        Refused while an agent runs on the same --bpffs-dir. Stopping an agent with \
        SIGTERM is not an uninstall: it keeps the whole datapath (maps, links, tunnel \
        device, egress IPs), so that traffic keeps flowing until the next agent adopts \
        it. Run cleanup after stopping the agent for good (e.g. after deleting the \
        DaemonSet); deploy/uninstall runs it on every node from the agent's image."
    )]
    Cleanup {
        #[arg(long, default_value = ebpf::DEFAULT_BPFFS_DIR)]
        bpffs_dir: PathBuf,
        /// The agent's VXLAN device (as its `run --tunnel-device`).
        #[arg(long, default_value = DEFAULT_TUNNEL_DEVICE)]
        tunnel_device: String,
        /// The CNI bin directory `install-cni` wrote the plugin into (the host's
        /// /opt/cni/bin, mounted): remove `egress-cni` and `egress-cni.d/` from it too.
        /// Unchain the plugin from the CNI configuration first: a runtime that still
        /// calls it fails every pod's ADD on this node.
        #[arg(long, value_name = "DIR")]
        cni_bin_dir: Option<PathBuf>,
    },
    /// Do nothing until SIGTERM or SIGINT: the container of the uninstall DaemonSet
    /// (deploy/uninstall) once its init container has run `cleanup`, so that the pod stays
    /// Ready and the DaemonSet's rollout says every node is done.
    Pause,
}

/// `run`'s flags.
#[derive(clap::Args)]
struct RunArgs {
    /// This node's name, as in its Node object (the Downward API's spec.nodeName).
    #[arg(long, env = "NODE_NAME")]
    node_name: String,
    /// Read cluster state from this directory of Kubernetes-shaped YAML documents
    /// (Nodes, Namespaces, Pods, EgressGatewayPolicies), watched for changes.
    #[arg(
        long,
        env = "EGRESS_STATE_DIR",
        required_unless_present = "kube",
        conflicts_with = "kube"
    )]
    state_dir: Option<PathBuf>,
    /// Read cluster state from the Kubernetes API (in cluster, or --kubeconfig).
    #[arg(long)]
    kube: bool,
    /// Kubeconfig for --kube outside a cluster (default: the usual inference).
    #[arg(long, requires = "kube")]
    kubeconfig: Option<PathBuf>,
    #[command(flatten)]
    node: NodeArgs,
    /// First SNAT port (1 or more: port 0 is no port on the wire).
    #[arg(long, default_value_t = DEFAULT_PORT_MIN, value_parser = clap::value_parser!(u16).range(1..))]
    port_min: u16,
    /// Last SNAT port.
    #[arg(long, default_value_t = DEFAULT_PORT_MAX, value_parser = clap::value_parser!(u16).range(1..))]
    port_max: u16,
    /// Serve /metrics, /status, /healthz and /readyz here.
    #[arg(long)]
    metrics_addr: Option<SocketAddr>,
    /// Serve them over HTTPS with this PEM certificate chain (leaf first); read again
    /// every 30 s, so a rotated certificate is served without a restart.
    #[arg(
        long,
        env = "EGRESS_METRICS_TLS_CERT_FILE",
        requires = "metrics_tls_key_file"
    )]
    metrics_tls_cert_file: Option<PathBuf>,
    /// The PEM private key of --metrics-tls-cert-file.
    #[arg(
        long,
        env = "EGRESS_METRICS_TLS_KEY_FILE",
        requires = "metrics_tls_cert_file"
    )]
    metrics_tls_key_file: Option<PathBuf>,
    /// PEM CA certificates: /metrics and /status answer only clients presenting a
    /// certificate one of them signed (401 otherwise); /healthz and /readyz stay open to
    /// the kubelet's probes. Needs --metrics-tls-cert-file.
    #[arg(
        long,
        env = "EGRESS_METRICS_CLIENT_CA_FILE",
        requires = "metrics_tls_cert_file"
    )]
    metrics_client_ca_file: Option<PathBuf>,
    /// Serve /status and /metrics on this Unix socket too (mode 0600), plain HTTP with
    /// no client certificate, for `egress-agent status` on the node; empty: none.
    #[arg(long, env = "EGRESS_STATUS_SOCKET", default_value = egress_agent::endpoints::DEFAULT_STATUS_SOCKET)]
    status_socket: PathBuf,
    /// Full resync interval in seconds, on top of change notifications.
    #[arg(long, default_value_t = 10)]
    resync_secs: u64,
    /// While passes are expensive and the cluster keeps changing, a state change waits
    /// until the last pass has rested three times its own duration (passes then take at
    /// most a quarter of a core), but at most this many milliseconds after that pass
    /// ended; changes meanwhile share one pass. A quiet agent passes at once; probes,
    /// netlink and timers never wait. 0: every change passes at once.
    #[arg(long, env = "EGRESS_STATE_BATCH_MAX_MS",
          default_value_t = egress_agent::agent::batch::DEFAULT_MAX_REST_MS,
          value_parser = clap::value_parser!(u64).range(0..=60_000))]
    state_batch_max_ms: u64,
    /// Milliseconds between two liveness probes (hellos) to each peer.
    #[arg(long, env = "EGRESS_PROBE_INTERVAL_MS", default_value_t = 100,
          value_parser = clap::value_parser!(u64).range(10..=60_000))]
    probe_interval_ms: u64,
    /// Probes missed in a row before a peer counts as unreachable (detection time =
    /// interval x misses, plus one interval for what other nodes relay).
    #[arg(long, env = "EGRESS_PROBE_MISSES", default_value_t = 3,
          value_parser = clap::value_parser!(u32).range(1..=100))]
    probe_misses: u32,
    /// Seconds peers keep this node alive after its agent stops with SIGTERM (a
    /// restart: the pinned datapath keeps forwarding meanwhile). 0: fail over at once.
    /// Cordon a gateway before shutting it down: its egress IPs then move first.
    #[arg(long, env = "EGRESS_RESTART_GRACE_SECS", default_value_t = 15,
          value_parser = clap::value_parser!(u16))]
    restart_grace_secs: u16,
    /// UDP port of the liveness probes on the underlay; default: the tunnel port + 1.
    #[arg(long, env = "EGRESS_PROBE_PORT")]
    probe_port: Option<u16>,
    /// The cluster's liveness keys: one hex key (32 bytes or more) per line, the first
    /// signs, all are accepted (rotation). Hellos are then signed and only signed ones
    /// taken. Without it liveness is unauthenticated (a warning says so).
    #[arg(long, env = "EGRESS_LIVENESS_KEY_FILE", value_name = "PATH")]
    liveness_key_file: Option<PathBuf>,
    /// A routing table (by number) whose routes this node publishes for rules with
    /// `destinationsFrom: Routes`, besides the main table: for policy routing (NMState
    /// route rules). Repeat the flag, or separate numbers with commas in the variable.
    #[arg(long = "route-table", value_name = "ID", env = "EGRESS_ROUTE_TABLES",
          value_delimiter = ',', value_parser = clap::value_parser!(u32).range(1..))]
    route_tables: Vec<u32>,
    /// The unix socket where the chained CNI plugin (`egress-cni`) asks this agent to
    /// attach to a new pod's device before the runtime finishes the pod; empty: none.
    #[arg(long, env = "EGRESS_CNI_SOCKET", default_value = egress_agent::cni::DEFAULT_SOCKET)]
    cni_socket: PathBuf,
    /// Entries of each policy map (POLICY_V4, POLICY_V6): the selected pods on this
    /// node times their destination prefixes (listed or learned from routes) must fit.
    /// Changing it replaces the pinned maps at start (refilled on the first pass).
    #[arg(long, env = "EGRESS_POLICY_MAP_ENTRIES",
          default_value_t = egress_common::maps::POLICY_MAX_ENTRIES,
          value_parser = clap::value_parser!(u32).range(1_024..=16_777_216))]
    policy_map_entries: u32,
    /// Entries of each conntrack map (CT_V4, CT_V6): two per translated flow through
    /// this gateway. The kernel allocates them at start whatever they hold, about 144
    /// bytes per entry for IPv4 and 184 for IPv6 (82 MiB at the default); a node that
    /// never serves as a gateway translates nothing and can run with the minimum. A full
    /// map evicts its least recently used flows. Changing it replaces the pinned maps at
    /// start; their flows are carried over.
    #[arg(long, env = "EGRESS_CONNTRACK_ENTRIES",
          default_value_t = egress_common::maps::CT_MAX_ENTRIES,
          value_parser = clap::value_parser!(u32).range(1_024..=8_388_608))]
    conntrack_entries: u32,
    /// Entries of each pod owner map (POD_OWNER_V4, POD_OWNER_V6): on a gateway every
    /// running pod of the cluster must fit (it tunnels their replies back by it), on any
    /// other node its own pods (the return path's check). Preallocated: about 90 bytes
    /// per entry for IPv4 and 96 for IPv6 (46 MiB at the default). Changing it replaces
    /// the pinned maps at start (refilled on the first pass).
    #[arg(long, env = "EGRESS_POD_OWNER_ENTRIES",
          default_value_t = egress_common::maps::POD_OWNER_MAX_ENTRIES,
          value_parser = clap::value_parser!(u32).range(1_024..=8_388_608))]
    pod_owner_entries: u32,
    /// Entries of each admitted-pairs map (ADMITTED_V4, ADMITTED_V6): the (selected pod,
    /// rule) pairs of the rules this node serves as a gateway. Entries are allocated as
    /// they are inserted, but the hash buckets are not (8 MiB per family at the
    /// default); a node that never serves a gateway admits nothing and can run with the
    /// minimum. Changing it replaces the pinned maps at start (refilled on the first pass).
    #[arg(long, env = "EGRESS_ADMITTED_ENTRIES",
          default_value_t = egress_common::maps::ADMITTED_MAX_ENTRIES,
          value_parser = clap::value_parser!(u32).range(1_024..=8_388_608))]
    admitted_entries: u32,
    /// What this node does with packets from a pod address it has not seen yet (its
    /// Pod object has not reached the agent, or it is not Running) toward a destination
    /// that any rule of any policy covers: `pass` them (normal routing, the node's
    /// address) or `drop` and count them (DROP_UNKNOWN_POD) until the agent has seen
    /// the pod. `drop` attaches to every device a route of this node's pod CIDRs uses.
    #[arg(long, env = "EGRESS_UNKNOWN_PODS", value_enum, default_value_t = agent::UnknownPods::Pass)]
    unknown_pods: agent::UnknownPods,
    /// Live flows a pod may hold on this gateway: new flows over it are dropped and
    /// counted (DROP_POD_FLOW_LIMIT, and against the pod in `egress-agent maps`), so
    /// that one pod cannot take every SNAT port of a destination. Default: half the
    /// port range (--port-min..--port-max); 0: no limit.
    #[arg(long, env = "EGRESS_MAX_FLOWS_PER_POD")]
    max_flows_per_pod: Option<u32>,
    /// Claim egress IPs without duplicate address detection. By default a gateway
    /// sends ARP probes (IPv6: DAD neighbour solicitations) before it first claims an
    /// egress IP and refuses one that another host answers for; this costs 200 ms per
    /// address nobody answers for, and nothing on failover (moves between gateways are
    /// not probed).
    #[arg(long, env = "EGRESS_NO_DAD")]
    no_dad: bool,
    /// How the TC programs are attached: `auto` takes TCX links where the kernel has them
    /// (Linux 6.6 and later, probed, not read from the version) and the legacy tc path
    /// elsewhere (a clsact qdisc and direct-action bpf filters: RHEL 9, Debian 12,
    /// Ubuntu 22.04); `tcx` or `tc` forces one. Either keeps traffic flowing while the
    /// agent restarts, and a new agent replaces its programs in place.
    #[arg(long, env = "EGRESS_ATTACH", value_enum, default_value_t = datapath::AttachMode::Auto)]
    attach: datapath::AttachMode,
    /// The ingress priority of our tc filters with the legacy tc path (1 runs first). Each
    /// program has a handle of its own there (0x0e9e0001..4), named egress/<program>.
    #[arg(long, env = "EGRESS_TC_PRIORITY", default_value_t = datapath::tc::DEFAULT_PRIORITY,
          value_parser = clap::value_parser!(u16).range(1..=0xffdf))]
    tc_priority: u16,
    /// How the host side of each local pod's interface is found: `routes`, the device
    /// the main table's host route (/32, /128) to the pod leaves by (Calico); `veth`,
    /// the veth whose peer's namespace holds the pod's address, read over rtnetlink
    /// (OVN-Kubernetes, Flannel, the bridge plugin: pods without host routes); `ovs`,
    /// Open vSwitch's interface whose external_ids:iface-id is <namespace>_<pod>, as
    /// OVN-Kubernetes sets it (--ovsdb); `auto`, routes where they find the pod, else the
    /// veth, else OVS when its socket exists.
    #[arg(long, env = "EGRESS_POD_DEVICES", value_enum,
          default_value_t = agent::attachments::PodDevices::Auto)]
    pod_devices: agent::attachments::PodDevices,
    /// OVSDB's unix socket, read for `--pod-devices ovs` (and `auto`, when it exists).
    #[arg(long, env = "EGRESS_OVSDB", default_value = egress_agent::iface::ovsdb::DEFAULT_SOCKET)]
    ovsdb: std::path::PathBuf,
    #[command(flatten)]
    cluster: ClusterArgs,
}

impl RunArgs {
    /// The agent's configuration, once the flags agree with each other.
    fn into_config(self) -> Result<agent::RunConfig> {
        anyhow::ensure!(
            self.port_min <= self.port_max,
            "invalid --port-min {} / --port-max {}: the range is empty",
            self.port_min,
            self.port_max
        );
        let source = match (self.state_dir, self.kube) {
            (Some(dir), false) => agent::Source::Yaml(dir),
            _ => agent::Source::Kube {
                kubeconfig: self.kubeconfig,
            },
        };
        Ok(agent::RunConfig {
            node_name: self.node_name,
            source,
            bpffs_dir: self.node.bpffs_dir,
            tunnel_device: self.node.tunnel_device,
            tunnel_port: self.node.tunnel_port,
            tunnel_mtu: self.node.tunnel_mtu,
            port_min: self.port_min,
            port_max: self.port_max,
            metrics_addr: self.metrics_addr,
            metrics_tls: match (self.metrics_tls_cert_file, self.metrics_tls_key_file) {
                (Some(cert), Some(key)) => Some(egress_agent::endpoints::TlsFiles {
                    cert,
                    key,
                    client_ca: self.metrics_client_ca_file,
                }),
                _ => None,
            },
            status_socket: Some(self.status_socket).filter(|p| !p.as_os_str().is_empty()),
            resync: Duration::from_secs(self.resync_secs.max(1)),
            state_batch_max: Duration::from_millis(self.state_batch_max_ms),
            probe: liveness::Settings {
                interval: Duration::from_millis(self.probe_interval_ms),
                misses: self.probe_misses,
                restart_grace: Duration::from_secs(self.restart_grace_secs.into()),
            },
            probe_port: self
                .probe_port
                .unwrap_or(self.node.tunnel_port.wrapping_add(1)),
            liveness_key_file: self.liveness_key_file,
            route_tables: self.route_tables,
            cluster_cidrs: self.cluster.cluster_cidrs,
            capacities: datapath::Capacities {
                policy: self.policy_map_entries,
                conntrack: self.conntrack_entries,
                pod_owner: self.pod_owner_entries,
                admitted: self.admitted_entries,
            },
            unknown_pods: self.unknown_pods,
            cni_socket: (!self.cni_socket.as_os_str().is_empty()).then_some(self.cni_socket),
            max_flows_per_pod: self.max_flows_per_pod.unwrap_or_else(|| {
                (u32::from(self.port_max) - u32::from(self.port_min) + 1).div_ceil(2)
            }),
            dad: !self.no_dad,
            attach: self.attach,
            tc_priority: self.tc_priority,
            pod_devices: self.pod_devices,
            ovsdb: self.ovsdb,
        })
    }
}

/// Where the agent's datapath lives on this node: `run` sets it up there, `doctor`
/// checks it.
#[derive(clap::Args)]
struct NodeArgs {
    /// Where this agent pins its maps and links (one directory per agent).
    #[arg(long, default_value = ebpf::DEFAULT_BPFFS_DIR)]
    bpffs_dir: PathBuf,
    /// Name of the VXLAN device the agent owns.
    #[arg(long, default_value = DEFAULT_TUNNEL_DEVICE)]
    tunnel_device: String,
    /// UDP port of the tunnel (clear of 4789, 8472 and 6081 used by CNIs).
    #[arg(long, default_value_t = DEFAULT_TUNNEL_PORT)]
    tunnel_port: u16,
    /// MTU inside the tunnel; default: the largest underlay MTU minus 50.
    #[arg(long)]
    tunnel_mtu: Option<u32>,
}

/// What the agent is told about the cluster rather than reads from it.
#[derive(clap::Args)]
struct ClusterArgs {
    /// A pod or service CIDR of the cluster, such as 10.244.0.0/16: routes that overlap
    /// one never make destinations for `destinationsFrom: Routes`. Repeat the flag, or
    /// separate CIDRs with commas in the variable.
    #[arg(long = "cluster-cidr", value_name = "CIDR", env = "EGRESS_CLUSTER_CIDRS",
          value_delimiter = ',', value_parser = parse_cidr)]
    cluster_cidrs: Vec<IpNet>,
}

/// A prefix without host bits.
fn parse_cidr(s: &str) -> Result<IpNet, String> {
    let net: IpNet = s
        .trim()
        .parse()
        .map_err(|_| "expected a CIDR such as 10.244.0.0/16 or fd00:10:244::/56".to_owned())?;
    if net.trunc() != net {
        return Err(format!(
            "it has host bits set; did you mean {}?",
            net.trunc()
        ));
    }
    Ok(net)
}

fn main() -> ExitCode {
    match real_main() {
        Ok(code) => code,
        Err(e) => {
            eprintln!("egress-agent: {}", egress_agent::report::chain(e.as_ref()));
            ExitCode::FAILURE
        }
    }
}

fn real_main() -> Result<ExitCode> {
    let cli = Cli::parse();
    egress_agent::logs::init(cli.log_format);
    match cli.command {
        Command::Run(args) => {
            let cfg = args.into_config()?;
            // The runtime's threads give way to the probes' hellos thread
            // (egress_agent::priority); agent::run makes the main thread give way too
            // once the probes run.
            tokio::runtime::Builder::new_multi_thread()
                .worker_threads(2)
                .on_thread_start(egress_agent::priority::give_way)
                .enable_all()
                .build()
                .context("failed to start the runtime")?
                .block_on(agent::run(cfg))?;
            Ok(ExitCode::SUCCESS)
        }
        Command::Status {
            socket,
            metrics_addr,
        } => {
            let status = match metrics_addr {
                Some(addr) => fetch_status(addr)?,
                None => fetch_status_unix(&socket)?,
            };
            print!("{status}");
            Ok(ExitCode::SUCCESS)
        }
        Command::InstallCni { dir, bundle } => {
            let path = egress_agent::cni::install(&bundle, &dir)?;
            println!("installed {}", path.display());
            Ok(ExitCode::SUCCESS)
        }
        Command::Maps { bpffs_dir } => {
            print!("{}", datapath::dump::render(&bpffs_dir)?);
            Ok(ExitCode::SUCCESS)
        }
        Command::Check { state_dir, cluster } => Ok(check(&state_dir, &cluster.cluster_cidrs)),
        Command::Explain(args) => {
            print!(
                "{}",
                runtime(0)?.block_on(egress_agent::explain::cli::run(&args))?
            );
            Ok(ExitCode::SUCCESS)
        }
        Command::Doctor {
            node_name,
            state_dir,
            egress_ips,
            node,
            no_dad,
            ovsdb,
        } => {
            let view = state_dir.map(|dir| egress_agent::source::yaml::load_dir(&dir).view);
            let settings = doctor::Settings {
                bpffs_dir: node.bpffs_dir,
                tunnel_device: node.tunnel_device,
                tunnel_port: node.tunnel_port,
                tunnel_mtu: node.tunnel_mtu,
                node_name,
                egress_ips,
                dad: if no_dad {
                    doctor::Dad::Off
                } else {
                    doctor::Dad::Now
                },
                load_programs: true,
                ovsdb,
            };
            doctor(&settings, view.as_ref())
        }
        Command::ImportEgressip(args) => import_egressip(&args),
        Command::Crd => {
            print!("{}", api::crd_yaml());
            Ok(ExitCode::SUCCESS)
        }
        Command::Cleanup {
            bpffs_dir,
            tunnel_device,
            cni_bin_dir,
        } => cleanup(&bpffs_dir, &tunnel_device, cni_bin_dir.as_deref()),
        Command::Pause => {
            runtime(0)?.block_on(pause())?;
            Ok(ExitCode::SUCCESS)
        }
    }
}

/// A tokio runtime: multi-threaded with `workers` threads, or on this thread for 0.
fn runtime(workers: usize) -> Result<tokio::runtime::Runtime> {
    let mut b = if workers == 0 {
        tokio::runtime::Builder::new_current_thread()
    } else {
        let mut b = tokio::runtime::Builder::new_multi_thread();
        b.worker_threads(workers);
        b
    };
    b.enable_all()
        .build()
        .context("failed to start the runtime")
}

/// `egress-agent import-egressip`: the policies on stdout, each refusal on stderr.
fn import_egressip(args: &egress_agent::import::cli::ImportArgs) -> Result<ExitCode> {
    let (yaml, refused) = runtime(0)?.block_on(egress_agent::import::cli::run(args))?;
    print!("{yaml}");
    for r in &refused {
        eprintln!("egress-agent import-egressip: {r}");
    }
    if refused.is_empty() {
        Ok(ExitCode::SUCCESS)
    } else {
        Ok(ExitCode::FAILURE)
    }
}

/// `egress-agent check`: every problem of the state directory, one per line.
fn check(state_dir: &std::path::Path, cluster_cidrs: &[ipnet::IpNet]) -> ExitCode {
    let problems = check::check_dir(state_dir, cluster_cidrs);
    for p in &problems {
        println!("{p}");
    }
    if problems.is_empty() {
        println!("{}: no problems", state_dir.display());
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}

/// `egress-agent doctor`: every check, one per line; fails if any failed.
fn doctor(
    settings: &doctor::Settings,
    view: Option<&egress_agent::source::ClusterView>,
) -> Result<ExitCode> {
    let checks = runtime(0)?.block_on(doctor::run(settings, view));
    for c in &checks {
        println!("{}", doctor::line(c));
    }
    let failed = checks
        .iter()
        .filter(|c| c.result == doctor::Level::Fail)
        .count();
    if failed == 0 {
        Ok(ExitCode::SUCCESS)
    } else {
        println!("{failed} check(s) failed");
        Ok(ExitCode::FAILURE)
    }
}

/// `egress-agent cleanup`: remove what an agent left on this node (and the CNI plugin from
/// `cni_bin_dir`), saying what.
fn cleanup(
    bpffs_dir: &std::path::Path,
    tunnel_device: &str,
    cni_bin_dir: Option<&std::path::Path>,
) -> Result<ExitCode> {
    let mut removed = runtime(0)?.block_on(datapath::cleanup::uninstall(
        bpffs_dir,
        tunnel_device,
        |line| println!("{line}"),
    ))?;
    if let Some(dir) = cni_bin_dir {
        removed += egress_agent::cni::uninstall(dir, |line| println!("{line}"))?;
    }
    if removed == 0 {
        let plugin = cni_bin_dir
            .map(|d| format!(", no CNI plugin in {}", d.display()))
            .unwrap_or_default();
        println!(
            "nothing to remove: no pins under {}, no device {tunnel_device}{plugin}",
            bpffs_dir.display()
        );
    }
    Ok(ExitCode::SUCCESS)
}

/// `egress-agent pause`: until SIGTERM or SIGINT.
async fn pause() -> Result<()> {
    use tokio::signal::unix::{SignalKind, signal};
    let mut term = signal(SignalKind::terminate()).context("failed to wait for SIGTERM")?;
    println!("egress-agent pause: waiting for SIGTERM");
    tokio::select! {
        _ = term.recv() => {}
        r = tokio::signal::ctrl_c() => r.context("failed to wait for SIGINT")?,
    }
    Ok(())
}

/// GET /status from a running agent's metrics endpoint (plain HTTP).
fn fetch_status(addr: SocketAddr) -> Result<String> {
    let timeout = Duration::from_secs(5);
    let sock = std::net::TcpStream::connect_timeout(&addr, timeout).with_context(|| {
        format!("failed to reach the agent at {addr}: is it running with --metrics-addr {addr}?")
    })?;
    sock.set_read_timeout(Some(timeout))?;
    get_status(sock, &addr.to_string()).context(
        "an agent serving HTTPS there is asked by its --status-socket: drop --metrics-addr",
    )
}

/// GET /status from a running agent's `--status-socket`.
fn fetch_status_unix(path: &std::path::Path) -> Result<String> {
    let sock = std::os::unix::net::UnixStream::connect(path).with_context(|| {
        format!(
            "failed to reach the agent at {}: is it running on this node, with this \
             --status-socket? (or ask its --metrics-addr)",
            path.display()
        )
    })?;
    sock.set_read_timeout(Some(Duration::from_secs(5)))?;
    get_status(sock, &path.display().to_string())
}

/// One `GET /status` on `sock`: the body of a 200, else an error with what was said.
fn get_status(mut sock: impl std::io::Read + std::io::Write, at: &str) -> Result<String> {
    sock.write_all(b"GET /status HTTP/1.0\r\nhost: localhost\r\n\r\n")?;
    let mut resp = Vec::new();
    sock.read_to_end(&mut resp)
        .with_context(|| format!("failed to read the status from {at}"))?;
    let resp = String::from_utf8_lossy(&resp);
    let (head, body) = resp
        .split_once("\r\n\r\n")
        .with_context(|| format!("failed to read the status from {at}: not HTTP"))?;
    let line = head.lines().next().unwrap_or_default();
    anyhow::ensure!(
        line.split_whitespace().nth(1) == Some("200"),
        "{at} answered {line}: {}",
        body.trim()
    );
    Ok(body.to_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `--port-min 0` would let the SNAT hand out port 0: refused, naming the flag.
    #[test]
    fn a_port_range_from_zero_is_refused_naming_the_flag() {
        for flag in ["--port-min", "--port-max"] {
            let Err(e) = Cli::try_parse_from(["egress-agent", "run", flag, "0"]) else {
                panic!("{flag} 0 was accepted");
            };
            assert_eq!(e.kind(), clap::error::ErrorKind::ValueValidation, "{e}");
            assert!(e.to_string().contains(flag), "{e}");
        }
        let args = [
            "egress-agent",
            "run",
            "--node-name",
            "n1",
            "--state-dir",
            "/nonexistent",
            "--port-min",
            "1",
        ];
        let ok = Cli::try_parse_from(args);
        assert!(
            ok.is_ok(),
            "--port-min 1: {:?}",
            ok.err().map(|e| e.to_string())
        );
    }
}
