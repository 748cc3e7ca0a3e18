//! Running the real programs with `BPF_PROG_TEST_RUN`: a copy of the embedded object whose
//! maps a case starts from empty (a fresh load, or [`Datapath::reset`]: the tables reuse
//! one verified object per worker), typed map setters, and a private network namespace
//! per case for the FIB lookups.
//!
//! [`in_netns`] runs a closure on a new thread that has done `unshare(CLONE_NEWNET)`: the
//! namespace belongs to that thread alone (and to the `ip` commands it starts), and it
//! disappears with the thread, so there is nothing to clean up.

use std::{
    collections::BTreeMap,
    ffi::CString,
    net::{IpAddr, Ipv4Addr, Ipv6Addr},
    process::Command,
    thread,
};

use aya::{
    Ebpf, EbpfLoader,
    maps::{Array, HashMap, LpmTrie, MapData, PerCpuArray, lpm_trie::Key},
    programs::{SchedClassifier, TestRun as _, TestRunOptions},
};
use egress_agent::{
    ebpf::{OBJECT, TEST_TUNNEL_FROM_CB},
    family::{Family, V4, V6},
};
use egress_common::{
    config::Config,
    conntrack::{CtEntryV4, CtEntryV6, CtKeyV4, CtKeyV6, FlowCount},
    counters::{Counter, MAX_REASONS},
    maps,
    policy::{
        AdmittedKeyV4, AdmittedKeyV6, AdmittedValue, CoveredValue, DestValueV4, DestValueV6,
        EgressIpValue, KnownPodValue, NodeValue, PodDeviceValue, PodOwnerValue, PolicyKeyV4,
        PolicyKeyV6, PolicyValueV4, PolicyValueV6, RuleValueV4, RuleValueV6, SelectedValueV4,
        SelectedValueV6, coverage,
    },
    underlay::{self, Underlay},
};

pub const TC_ACT_OK: u32 = 0;
pub const TC_ACT_SHOT: u32 = 2;
pub const TC_ACT_REDIRECT: u32 = 7;
/// `TC_ACT_UNSPEC` (-1) as `test_run` reports it: the next program, or the stack.
pub const TC_ACT_UNSPEC: u32 = u32::MAX;

/// The source port range and tunnel MTU of the tests' configurations.
pub const PORT_MIN: u16 = 20_000;
pub const PORT_MAX: u16 = 29_999;
pub const TUNNEL_MTU: u16 = 1450;

/// The configuration of a ready node at `node_ip` with its tunnel device at
/// `tunnel_ifindex`: the tests' port range and tunnel MTU, no flow limit.
pub fn ready_config(node_ip: IpAddr, tunnel_ifindex: u32) -> Config {
    Config {
        node_ip: underlay::from_ip(node_ip),
        tunnel_ifindex,
        port_min: PORT_MIN,
        port_max: PORT_MAX,
        tunnel_mtu: TUNNEL_MTU,
        flags: egress_common::config::flags::READY,
        max_flows_per_pod: 0,
    }
}

/// Run `f` on a thread of its own in a new, empty network namespace (loopback up).
pub fn in_netns<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> T {
    let handle = thread::spawn(move || {
        // SAFETY: affects only the calling thread's namespace membership.
        let rc = unsafe { libc::unshare(libc::CLONE_NEWNET) };
        assert_eq!(
            rc,
            0,
            "failed to unshare the network namespace: {} (tests need root)",
            std::io::Error::last_os_error()
        );
        ip("link set lo up");
        f()
    });
    match handle.join() {
        Ok(v) => v,
        Err(panic) => std::panic::resume_unwind(panic),
    }
}

/// Run `ip <args>` (split on whitespace) in the calling thread's namespace.
pub fn ip(args: &str) {
    let out = Command::new("ip")
        .args(args.split_whitespace())
        .output()
        .expect("failed to run ip");
    assert!(
        out.status.success(),
        "failed to run `ip {args}`: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Write a sysctl of the calling thread's namespace (`net/ipv4/conf/all/forwarding`).
pub fn sysctl(path: &str, value: &str) {
    let p = format!("/proc/sys/{path}");
    std::fs::write(&p, value).unwrap_or_else(|e| panic!("failed to write {p}: {e}"));
}

/// Ifindex of `name` in the calling thread's namespace.
pub fn ifindex(name: &str) -> u32 {
    let c = CString::new(name).expect("interface name");
    // SAFETY: valid NUL-terminated string.
    let i = unsafe { libc::if_nametoindex(c.as_ptr()) };
    assert_ne!(i, 0, "no interface {name}");
    i
}

/// `CLOCK_MONOTONIC_COARSE` in nanoseconds: the datapath's clock
/// (`bpf_ktime_get_coarse_ns`).
pub fn ktime_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: valid out pointer.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC_COARSE, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

/// The datapath's clock `age_s` seconds ago: the last-seen time of an entry a test ages by
/// hand. The datapath counts an entry stamped at or ahead of its clock as fresh, so on a
/// machine up for less than `age_s` (a guest just booted: `cargo xtask vm`) no stamp is old
/// enough; this waits until the clock has run that long.
pub fn ktime_ago_ns(age_s: u64) -> u64 {
    let age = age_s * 1_000_000_000;
    loop {
        let now = ktime_ns();
        if let Some(then) = now.checked_sub(age) {
            return then;
        }
        thread::sleep(std::time::Duration::from_nanos(age - now));
    }
}

/// The `__sk_buff` passed as `ctx_in`: `ifindex` (0: loopback) and, when given, the
/// tunnel sender in `cb[0..4]` (its 16 underlay bytes) and the VNI in `cb[4]`, where
/// `from_tunnel` reads them when loaded with `TEST_TUNNEL_FROM_CB`.
pub fn skb_ctx(ifindex: u32, tunnel: Option<(IpAddr, u32)>) -> [u8; SKB_CTX_LEN] {
    skb_ctx_gso(ifindex, tunnel, None)
}

/// [`skb_ctx`] of a GSO packet: `gso` is (segment size, segments), as the kernel keeps
/// them for a GRO aggregate or a TSO train (the programs read `gso_size`).
pub fn skb_ctx_gso(
    ifindex: u32,
    tunnel: Option<(IpAddr, u32)>,
    gso: Option<(u32, u32)>,
) -> [u8; SKB_CTX_LEN] {
    let mut ctx = [0u8; SKB_CTX_LEN];
    if let Some((size, segs)) = gso {
        ctx[SKB_GSO_SIZE_OFF..SKB_GSO_SIZE_OFF + 4].copy_from_slice(&size.to_ne_bytes());
        ctx[SKB_GSO_SEGS_OFF..SKB_GSO_SEGS_OFF + 4].copy_from_slice(&segs.to_ne_bytes());
    }
    ctx[SKB_IFINDEX_OFF..SKB_IFINDEX_OFF + 4].copy_from_slice(&ifindex.to_ne_bytes());
    if let Some((sender, vni)) = tunnel {
        ctx[SKB_CB_OFF..SKB_CB_OFF + 16].copy_from_slice(&underlay::from_ip(sender));
        ctx[SKB_CB_OFF + 16..SKB_CB_OFF + 20].copy_from_slice(&vni.to_ne_bytes());
    }
    ctx
}

/// Offsets in `struct __sk_buff` (uapi/linux/bpf.h).
const SKB_IFINDEX_OFF: usize = 40;
const SKB_CB_OFF: usize = 48;
const SKB_GSO_SEGS_OFF: usize = 164;
const SKB_GSO_SIZE_OFF: usize = 176;
/// `ctx_in` up to the end of `gso_size`: the kernel accepts a prefix of `__sk_buff`, and
/// of the fields in it only `mark`, `priority`, `ingress_ifindex`, `ifindex`, `cb`,
/// `tstamp`, `wire_len`, `gso_segs` and `gso_size` may be non-zero.
pub const SKB_CTX_LEN: usize = SKB_GSO_SIZE_OFF + 4;

/// What a program did with one packet.
#[derive(Debug)]
pub struct Outcome {
    pub verdict: u32,
    pub frame: Vec<u8>,
}

/// The loaded object, and what its array maps held when it was loaded ([`Datapath::reset`]).
pub struct Datapath {
    ebpf: Ebpf,
    arrays: Vec<(String, Vec<Vec<u8>>)>,
}

fn v4(a: Ipv4Addr) -> [u8; 4] {
    a.octets()
}

/// The capacity of each map of a [`Datapath::load`]: more than any table fills.
pub const TEST_MAP_ENTRIES: u32 = 32_768;

impl Datapath {
    /// Load the embedded object with `TEST_TUNNEL_FROM_CB` set; programs are loaded (and
    /// verified) on first use. Every map holds at most [`TEST_MAP_ENTRIES`]: the kernel
    /// preallocates hash maps whole, and the tables load a fresh object per case (under
    /// emulation, in the Linux 6.1 VM, the full sizes made a table take minutes).
    pub fn load() -> Self {
        let mut loader = EbpfLoader::new();
        loader.override_global(TEST_TUNNEL_FROM_CB, &1u8, true);
        for name in egress_common::maps::names() {
            let full = egress_common::maps::spec(name).map_or(0, |s| s.max_entries);
            if full > TEST_MAP_ENTRIES {
                loader.map_max_entries(name, TEST_MAP_ENTRIES);
            }
        }
        let ebpf = loader.load(OBJECT).expect("failed to load the eBPF object");
        let mut dp = Datapath {
            ebpf,
            arrays: Vec::new(),
        };
        let mut arrays = Vec::new();
        for (name, map) in dp.ebpf.maps() {
            let (d, kind) = raw::of(name, map);
            if kind == raw::Kind::Array {
                arrays.push((name.to_owned(), raw::values(d)));
            }
        }
        dp.arrays = arrays;
        dp
    }

    /// Empty every map as a fresh load has it: every key of the hashes, LRU hashes and
    /// tries deleted, every array as it was loaded (zeroes, counters on every CPU). The
    /// programs stay loaded: a table verifies each once per worker instead of once per
    /// case (under emulation, in the 6.1 guest, tens of seconds each).
    pub fn reset(&mut self) {
        for (name, map) in self.ebpf.maps() {
            let (d, kind) = raw::of(name, map);
            match kind {
                raw::Kind::Keyed => raw::clear(d),
                raw::Kind::Array => {
                    let (_, values) = self
                        .arrays
                        .iter()
                        .find(|(n, _)| n == name)
                        .expect("an array map not seen at load");
                    raw::restore(d, values);
                }
                raw::Kind::Frozen => {}
            }
        }
    }

    /// The program `name`, loaded into the kernel.
    pub fn program(&mut self, name: &str) -> &mut SchedClassifier {
        let p: &mut SchedClassifier = self
            .ebpf
            .program_mut(name)
            .unwrap_or_else(|| panic!("no program {name}"))
            .try_into()
            .expect("not a classifier");
        // The verifier gives up with EAGAIN when a signal is pending, and the `ip`
        // children of the other cases' threads keep SIGCHLD coming: the agent's loader
        // blocks this thread's signals and retries.
        if p.fd().is_err() {
            egress_agent::datapath::load_retrying(p)
                .unwrap_or_else(|e| panic!("failed to load program {name}: {e:?}"));
        }
        p
    }

    /// Run program `name` on `frame`, as if it arrived on `ifindex` (0: loopback), with
    /// `cb[0..4]` = tunnel sender (its 16 underlay bytes) and `cb[4]` = VNI when given.
    pub fn run(
        &mut self,
        name: &str,
        frame: &[u8],
        ifindex: u32,
        tunnel: Option<(IpAddr, u32)>,
    ) -> Outcome {
        self.run_gso(name, frame, ifindex, tunnel, None)
    }

    /// [`Datapath::run`] as a GSO packet of `gso` (segment size, segments).
    pub fn run_gso(
        &mut self,
        name: &str,
        frame: &[u8],
        ifindex: u32,
        tunnel: Option<(IpAddr, u32)>,
        gso: Option<(u32, u32)>,
    ) -> Outcome {
        let ctx = skb_ctx_gso(ifindex, tunnel, gso);
        let mut out = vec![0u8; frame.len() + 256];
        let r = self
            .program(name)
            .test_run(TestRunOptions {
                data_in: Some(frame),
                data_out: Some(&mut out),
                ctx_in: Some(&ctx),
                ..TestRunOptions::new()
            })
            .unwrap_or_else(|e| panic!("failed to test_run {name}: {e:?}"));
        out.truncate(r.data_size_out as usize);
        Outcome {
            verdict: r.return_value,
            frame: out,
        }
    }

    /// The map `name`, for setters that live with their tests (the IPv6 tables).
    pub fn map(&mut self, name: &str) -> &mut aya::maps::Map {
        self.ebpf
            .map_mut(name)
            .unwrap_or_else(|| panic!("no map {name}"))
    }

    /// Write the configuration as given (without `flags::READY`, the programs treat the
    /// node as unconfigured).
    pub fn config(&mut self, cfg: Config) {
        let mut a: Array<&mut MapData, Config> = Array::try_from(self.map(maps::CONFIG)).unwrap();
        a.set(0, cfg, 0).unwrap();
    }

    /// Set the next-hop generation (`NH_GEN`), as the agent's bump does.
    pub fn nh_gen(&mut self, generation: u32) {
        let mut a: Array<&mut MapData, u32> = Array::try_from(self.map(maps::NH_GEN)).unwrap();
        a.set(0, generation, 0).unwrap();
    }

    /// A policy entry for (pod, dst/len); the pod's prefix lengths in `SELECTED_V4` follow
    /// when it is selected already (as the agent keeps them).
    pub fn policy(&mut self, pod: Ipv4Addr, dst: Ipv4Addr, len: u32, value: PolicyValueV4) {
        let mut t: HashMap<&mut MapData, PolicyKeyV4, PolicyValueV4> =
            HashMap::try_from(self.map(maps::POLICY_V4)).unwrap();
        t.insert(PolicyKeyV4::new(v4(pod), v4(dst), len), value, 0)
            .unwrap();
        let mut m: HashMap<&mut MapData, [u8; 4], SelectedValueV4> =
            HashMap::try_from(self.map(maps::SELECTED_V4)).unwrap();
        if let Ok(mut v) = m.get(&v4(pod), 0) {
            v.add_length(len);
            v.entries += 1;
            m.insert(v4(pod), v, 0).unwrap();
        }
        // The destination chains of every entry so far, as the agent computes them.
        let t: HashMap<&mut MapData, PolicyKeyV4, PolicyValueV4> =
            HashMap::try_from(self.map(maps::POLICY_V4)).unwrap();
        let keys: Vec<PolicyKeyV4> = t.keys().map(Result::unwrap).collect();
        let mut d: LpmTrie<&mut MapData, [u8; 4], DestValueV4> =
            LpmTrie::try_from(self.map(maps::DESTS_V4)).unwrap();
        for ((len, net), v) in V4::dests(keys.iter()) {
            d.insert(&Key::new(len, net), v, 0).unwrap();
        }
    }

    /// Select `pod`, with the prefix lengths of its policy entries so far.
    pub fn selected(&mut self, pod: Ipv4Addr) {
        let t: HashMap<&mut MapData, PolicyKeyV4, PolicyValueV4> =
            HashMap::try_from(self.map(maps::POLICY_V4)).unwrap();
        let mut v = SelectedValueV4::default();
        for k in t.keys().flatten().filter(|k| k.pod == v4(pod)) {
            v.add_length(k.dst_len);
            v.entries += 1;
        }
        let mut m: HashMap<&mut MapData, [u8; 4], SelectedValueV4> =
            HashMap::try_from(self.map(maps::SELECTED_V4)).unwrap();
        m.insert(v4(pod), v, 0).unwrap();
    }

    /// Mark `pod` selected with no entries and `selected_flags::INCOMPLETE`: what the agent
    /// writes for a pod whose entries did not fit the policy map.
    pub fn selected_incomplete(&mut self, pod: Ipv4Addr) {
        let v = SelectedValueV4 {
            flags: egress_common::policy::selected_flags::INCOMPLETE,
            ..SelectedValueV4::default()
        };
        let mut m: HashMap<&mut MapData, [u8; 4], SelectedValueV4> =
            HashMap::try_from(self.map(maps::SELECTED_V4)).unwrap();
        m.insert(v4(pod), v, 0).unwrap();
    }

    /// [`Datapath::policy`] for an IPv6 pod.
    pub fn policy_v6(&mut self, pod: Ipv6Addr, dst: Ipv6Addr, len: u32, value: PolicyValueV6) {
        let mut t: HashMap<&mut MapData, PolicyKeyV6, PolicyValueV6> =
            HashMap::try_from(self.map(maps::POLICY_V6)).unwrap();
        t.insert(PolicyKeyV6::new(pod.octets(), dst.octets(), len), value, 0)
            .unwrap();
        let mut m: HashMap<&mut MapData, [u8; 16], SelectedValueV6> =
            HashMap::try_from(self.map(maps::SELECTED_V6)).unwrap();
        if let Ok(mut v) = m.get(&pod.octets(), 0) {
            v.add_length(len);
            v.entries += 1;
            m.insert(pod.octets(), v, 0).unwrap();
        }
        let t: HashMap<&mut MapData, PolicyKeyV6, PolicyValueV6> =
            HashMap::try_from(self.map(maps::POLICY_V6)).unwrap();
        let keys: Vec<PolicyKeyV6> = t.keys().map(Result::unwrap).collect();
        let mut d: LpmTrie<&mut MapData, [u8; 16], DestValueV6> =
            LpmTrie::try_from(self.map(maps::DESTS_V6)).unwrap();
        for ((len, net), v) in V6::dests(keys.iter()) {
            d.insert(&Key::new(len, net), v, 0).unwrap();
        }
    }

    /// [`Datapath::selected`] for an IPv6 pod.
    pub fn selected_v6(&mut self, pod: Ipv6Addr) {
        let t: HashMap<&mut MapData, PolicyKeyV6, PolicyValueV6> =
            HashMap::try_from(self.map(maps::POLICY_V6)).unwrap();
        let mut v = SelectedValueV6::default();
        for k in t.keys().flatten().filter(|k| k.pod == pod.octets()) {
            v.add_length(k.dst_len);
            v.entries += 1;
        }
        let mut m: HashMap<&mut MapData, [u8; 16], SelectedValueV6> =
            HashMap::try_from(self.map(maps::SELECTED_V6)).unwrap();
        m.insert(pod.octets(), v, 0).unwrap();
    }

    /// A rule this gateway serves, of the egress IP's family (`RULES_V4`/`_V6`).
    pub fn rule(&mut self, id: u32, egress_ip: impl Into<IpAddr>, ifindex: u32) {
        match egress_ip.into() {
            IpAddr::V4(ip) => {
                let v = RuleValueV4 {
                    egress_ip: v4(ip),
                    ifindex,
                };
                self.insert(maps::RULES_V4, id, v);
            }
            IpAddr::V6(ip) => {
                let v = RuleValueV6 {
                    egress_ip: ip.octets(),
                    ifindex,
                };
                self.insert(maps::RULES_V6, id, v);
            }
        }
    }

    /// Let `pod` (either family) use `rule_id` on this gateway (`ADMITTED_V4`/`_V6`).
    pub fn admit(&mut self, pod: impl Into<IpAddr>, rule_id: u32) {
        let v = AdmittedValue::default();
        match pod.into() {
            IpAddr::V4(pod) => {
                let mut m: HashMap<&mut MapData, AdmittedKeyV4, AdmittedValue> =
                    HashMap::try_from(self.map(maps::ADMITTED_V4)).unwrap();
                let key = AdmittedKeyV4 {
                    pod: v4(pod),
                    rule_id,
                };
                m.insert(key, v, 0).unwrap();
            }
            IpAddr::V6(pod) => {
                let mut m: HashMap<&mut MapData, AdmittedKeyV6, AdmittedValue> =
                    HashMap::try_from(self.map(maps::ADMITTED_V6)).unwrap();
                let key = AdmittedKeyV6 {
                    pod: pod.octets(),
                    rule_id,
                };
                m.insert(key, v, 0).unwrap();
            }
        }
    }

    /// Live flows of an IPv4 pod on this gateway (`FLOWS_V4`; 0 when absent).
    pub fn flows(&mut self, pod: Ipv4Addr) -> u32 {
        let m: HashMap<&mut MapData, [u8; 4], FlowCount> =
            HashMap::try_from(self.map(maps::FLOWS_V4)).unwrap();
        m.get(&v4(pod), 0).map_or(0, |c| c.flows)
    }

    /// A local pod address the agent has seen (`KNOWN_PODS_V4`/`_V6`).
    pub fn known_pod(&mut self, pod: impl Into<IpAddr>) {
        let v = KnownPodValue::default();
        match pod.into() {
            IpAddr::V4(pod) => {
                let mut m: HashMap<&mut MapData, [u8; 4], KnownPodValue> =
                    HashMap::try_from(self.map(maps::KNOWN_PODS_V4)).unwrap();
                m.insert(v4(pod), v, 0).unwrap();
            }
            IpAddr::V6(pod) => {
                let mut m: HashMap<&mut MapData, [u8; 16], KnownPodValue> =
                    HashMap::try_from(self.map(maps::KNOWN_PODS_V6)).unwrap();
                m.insert(pod.octets(), v, 0).unwrap();
            }
        }
    }

    /// A local pod address bound to its host-side device (`POD_DEVICES_V4`/`_V6`), its
    /// replies left to the FIB (not a veth whose peer is the pod's).
    pub fn pod_device(&mut self, pod: impl Into<IpAddr>, ifindex: u32) {
        self.pod_device_with(pod, ifindex, 0);
    }

    /// [`Self::pod_device`] with `flags` (`pod_device_flags`).
    pub fn pod_device_with(&mut self, pod: impl Into<IpAddr>, ifindex: u32, flags: u32) {
        let v = PodDeviceValue { ifindex, flags };
        match pod.into() {
            IpAddr::V4(pod) => self.insert(maps::POD_DEVICES_V4, v4(pod), v),
            IpAddr::V6(pod) => self.insert(maps::POD_DEVICES_V6, pod.octets(), v),
        }
    }

    /// A destination prefix some rule covers (`covered`), or an except hole in one
    /// (`COVERED_V4`/`_V6`).
    pub fn covered(&mut self, dst: impl Into<IpAddr>, len: u32, covered: bool) {
        let v = CoveredValue {
            covered: if covered {
                coverage::COVERED
            } else {
                coverage::EXCEPTED
            },
        };
        match dst.into() {
            IpAddr::V4(dst) => {
                let mut t: LpmTrie<&mut MapData, [u8; 4], CoveredValue> =
                    LpmTrie::try_from(self.map(maps::COVERED_V4)).unwrap();
                t.insert(&Key::new(len, v4(dst)), v, 0).unwrap();
            }
            IpAddr::V6(dst) => {
                let mut t: LpmTrie<&mut MapData, [u8; 16], CoveredValue> =
                    LpmTrie::try_from(self.map(maps::COVERED_V6)).unwrap();
                t.insert(&Key::new(len, dst.octets()), v, 0).unwrap();
            }
        }
    }

    pub fn node(&mut self, ip: impl Into<IpAddr>, node_id: u32) {
        let mut m: HashMap<&mut MapData, Underlay, NodeValue> =
            HashMap::try_from(self.map(maps::NODES)).unwrap();
        m.insert(underlay::from_ip(ip.into()), NodeValue { node_id }, 0)
            .unwrap();
    }

    /// The node owning `pod`, of the pod's family (`POD_OWNER_V4`/`_V6`).
    pub fn pod_owner(&mut self, pod: impl Into<IpAddr>, node: impl Into<IpAddr>) {
        let v = PodOwnerValue {
            node: underlay::from_ip(node.into()),
        };
        match pod.into() {
            IpAddr::V4(pod) => self.insert(maps::POD_OWNER_V4, v4(pod), v),
            IpAddr::V6(pod) => self.insert(maps::POD_OWNER_V6, pod.octets(), v),
        }
    }

    /// An egress IP of this gateway, of either family (`EGRESS_IPS_V4`/`_V6`).
    pub fn egress_ip(&mut self, ip: impl Into<IpAddr>, ifindex: u32, flags: u32) {
        let v = EgressIpValue { ifindex, flags };
        match ip.into() {
            IpAddr::V4(ip) => self.insert(maps::EGRESS_IPS_V4, v4(ip), v),
            IpAddr::V6(ip) => self.insert(maps::EGRESS_IPS_V6, ip.octets(), v),
        }
    }

    pub fn ct_insert(&mut self, key: CtKeyV4, entry: CtEntryV4) {
        self.insert(maps::CT_V4, key, entry);
    }

    /// Every conntrack entry.
    pub fn ct(&mut self) -> Vec<(CtKeyV4, CtEntryV4)> {
        self.entries(maps::CT_V4)
    }

    /// [`Datapath::ct_insert`] for an IPv6 flow (`CT_V6`).
    pub fn ct_insert_v6(&mut self, key: CtKeyV6, entry: CtEntryV6) {
        self.insert(maps::CT_V6, key, entry);
    }

    /// Every IPv6 conntrack entry.
    pub fn ct_v6(&mut self) -> Vec<(CtKeyV6, CtEntryV6)> {
        self.entries(maps::CT_V6)
    }

    /// Write `key` -> `value` into the hash map `name`.
    fn insert<K: aya::Pod, V: aya::Pod>(&mut self, name: &str, key: K, value: V) {
        let mut m: HashMap<&mut MapData, K, V> = HashMap::try_from(self.map(name)).unwrap();
        m.insert(key, value, 0)
            .unwrap_or_else(|e| panic!("failed to insert into {name}: {e}"));
    }

    /// Every entry of the hash map `name`.
    fn entries<K: aya::Pod, V: aya::Pod>(&mut self, name: &str) -> Vec<(K, V)> {
        let m: HashMap<&mut MapData, K, V> = HashMap::try_from(self.map(name)).unwrap();
        m.iter().map(|r| r.unwrap()).collect()
    }

    /// Non-zero counters, reason -> packets, summed over CPUs.
    pub fn counters(&mut self) -> BTreeMap<u32, u64> {
        let a: PerCpuArray<&mut MapData, Counter> =
            PerCpuArray::try_from(self.map(maps::COUNTERS)).unwrap();
        let mut out = BTreeMap::new();
        for reason in 0..MAX_REASONS {
            let packets: u64 = a.get(&reason, 0).unwrap().iter().map(|c| c.packets).sum();
            if packets != 0 {
                out.insert(reason, packets);
            }
        }
        out
    }
}

/// Map operations on any map by its descriptor (`bpf(2)`), whatever its key and value
/// types: what [`Datapath::reset`] needs, which aya's typed maps cannot give generically.
mod raw {
    use std::os::fd::{AsFd as _, AsRawFd as _};

    use aya::maps::{Map, MapData, MapType};

    const BPF_MAP_LOOKUP_ELEM: libc::c_long = 1;
    const BPF_MAP_UPDATE_ELEM: libc::c_long = 2;
    const BPF_MAP_DELETE_ELEM: libc::c_long = 3;
    const BPF_MAP_GET_NEXT_KEY: libc::c_long = 4;

    /// `bpf_attr` for the element commands.
    #[repr(C)]
    struct ElemAttr {
        map_fd: u32,
        _pad: u32,
        key: u64,
        value: u64,
        flags: u64,
    }

    #[derive(PartialEq, Eq)]
    pub enum Kind {
        /// Emptied by deleting every key.
        Keyed,
        /// Every index always exists: restored to its values at load.
        Array,
        /// Read-only to everyone (`.rodata`): nothing to reset.
        Frozen,
    }

    /// The map's data and how it is reset; a kind of map the datapath did not have when
    /// this was written fails the test rather than keep its state between cases.
    pub fn of<'a>(name: &str, map: &'a Map) -> (&'a MapData, Kind) {
        match map {
            Map::HashMap(d)
            | Map::LruHashMap(d)
            | Map::PerCpuHashMap(d)
            | Map::PerCpuLruHashMap(d)
            | Map::LpmTrie(d) => (d, Kind::Keyed),
            Map::Array(d) | Map::PerCpuArray(d) if name.starts_with(".rodata") => (d, Kind::Frozen),
            Map::Array(d) | Map::PerCpuArray(d) => (d, Kind::Array),
            _ => panic!("Datapath::reset does not know how to empty map {name}"),
        }
    }

    fn bpf(cmd: libc::c_long, d: &MapData, key: *const u8, value: *mut u8) -> std::io::Result<()> {
        let attr = ElemAttr {
            map_fd: d.fd().as_fd().as_raw_fd() as u32,
            _pad: 0,
            key: key as u64,
            value: value as u64,
            flags: 0,
        };
        // SAFETY: `attr` is a valid `bpf_attr` prefix for the element commands; `key` and
        // `value` point to buffers of the map's key and value sizes (or are null where
        // the command allows it), alive for the call.
        let rc = unsafe {
            libc::syscall(
                libc::SYS_bpf,
                cmd,
                &raw const attr,
                std::mem::size_of::<ElemAttr>(),
            )
        };
        if rc < 0 {
            return Err(std::io::Error::last_os_error());
        }
        Ok(())
    }

    /// The size of one value as the element commands read and write it: per CPU, each
    /// CPU's value rounded up to 8 bytes.
    fn value_len(d: &MapData) -> usize {
        let info = d.info().expect("map info");
        let size = info.value_size() as usize;
        match info.map_type() {
            Ok(MapType::PerCpuArray | MapType::PerCpuHash | MapType::LruPerCpuHash) => {
                size.next_multiple_of(8) * aya::util::nr_cpus().expect("possible CPUs")
            }
            _ => size,
        }
    }

    /// Delete every key.
    pub fn clear(d: &MapData) {
        let info = d.info().expect("map info");
        let mut key = vec![0u8; info.key_size() as usize];
        // The first key, again and again: each is deleted before the next is asked for.
        while bpf(BPF_MAP_GET_NEXT_KEY, d, std::ptr::null(), key.as_mut_ptr()).is_ok() {
            bpf(BPF_MAP_DELETE_ELEM, d, key.as_ptr(), std::ptr::null_mut())
                .expect("failed to delete a map entry");
        }
    }

    /// Every index's value.
    pub fn values(d: &MapData) -> Vec<Vec<u8>> {
        let n = d.info().expect("map info").max_entries();
        (0..n)
            .map(|i| {
                let mut v = vec![0u8; value_len(d)];
                bpf(
                    BPF_MAP_LOOKUP_ELEM,
                    d,
                    i.to_ne_bytes().as_ptr(),
                    v.as_mut_ptr(),
                )
                .expect("failed to read an array map");
                v
            })
            .collect()
    }

    /// Write `values` back, index by index.
    pub fn restore(d: &MapData, values: &[Vec<u8>]) {
        for (i, v) in (0u32..).zip(values) {
            let mut v = v.clone();
            bpf(
                BPF_MAP_UPDATE_ELEM,
                d,
                i.to_ne_bytes().as_ptr(),
                v.as_mut_ptr(),
            )
            .expect("failed to write an array map");
        }
    }
}
