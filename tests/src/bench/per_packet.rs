//! Per-packet cost of each datapath path, timed with `BPF_PROG_TEST_RUN` next to an
//! empty-program floor.
//!
//! Everything runs on one thread in an anonymous network namespace of its own
//! (`unshare(CLONE_NEWNET)`), which holds the devices, routes and permanent neighbours
//! the gateway's FIB lookups need and vanishes with the thread. `test_run` gives the
//! skb that namespace's loopback as its device.
//!
//! Each case is checked before it is timed (verdict, the exact counters it must bump,
//! and for translations the rewritten addresses), and every timed round checks again
//! that the counters moved by exactly (runs x expected reasons) and by nothing else, so
//! a misconfigured bench fails instead of timing a drop path.
//!
//! The established rows of `from_tunnel` (4, 4s, 4v6) time the flow's cached next hop
//! (`NextHop` in the conntrack entry), which no counter tells from a FIB lookup. Their
//! flows' ORIGINAL entries are checked after verification and after every round: the
//! cache is valid as the datapath judges it, and a packet sent with a poisoned
//! destination MAC in the (otherwise valid) cache leaves with that MAC, which no FIB
//! lookup gives. Each round starts with the caches' stamps renewed and must leave them
//! as it found them: a cache that expired or went stale mid-round would have been filled
//! again by the FIB lookup of the packet that found it so.
//!
//! `test_run` re-runs the *same* skb `repeat` times, so a path that rewrites the packet
//! sees its own output on the next run. Two consequences, both handled here:
//! * translated flows (established SNAT, reverse NAT) get a partner flow whose tuple is
//!   the first flow's translation and which translates back to it (A -> B -> A ...):
//!   every run is then a conntrack hit of an established flow;
//! * forwarding decrements the TTL, so those paths start at TTL 255 and run in calls of
//!   [`TTL_CHUNK`] repeats; the time per run is the kernel's average per call, weighted
//!   over the calls of a round.

use std::{
    net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr},
    ops::Range,
    process::Command,
    thread,
    time::Instant,
};

use anyhow::{Context as _, Result, bail, ensure};
use aya::{
    Ebpf, EbpfLoader,
    maps::{Array, HashMap, LpmTrie, Map, MapData, PerCpuArray, lpm_trie::Key},
    programs::{SchedClassifier, TestRun as _, TestRunOptions},
};
use egress_agent::{
    ebpf::{FROM_POD, FROM_SECONDARY, FROM_TUNNEL, OBJECT, TEST_TUNNEL_FROM_CB},
    family::{Family, V4, V6},
};
use egress_common::{
    config::{Config, flags},
    conntrack::{
        self, CtEntryV4, CtEntryV6, CtKeyV4, CtKeyV6, NEXT_HOP_MAX_AGE_NS, NextHop, dir, state,
    },
    counters::{self, Counter, MAX_REASONS, reason},
    maps,
    policy::{
        AdmittedKeyV4, AdmittedKeyV6, AdmittedValue, EgressIpValue, NodeValue, PodOwnerValue,
        RuleValueV4, RuleValueV6, action,
    },
    underlay::{self, Underlay},
};
use ipnet::{Ipv4Net, Ipv6Net};

use super::{
    Plan, Run, Spread,
    empty::EmptyProgram,
    frame::{self, TCP_ACK, TCP_SYN, Tcp},
};
use crate::packet6::ETH_P_IPV6;

pub const TC_ACT_OK: u32 = 0;
pub const TC_ACT_REDIRECT: u32 = 7;

/// Repeats per call on the paths that decrement the TTL (frames start at 255).
pub const TTL_CHUNK: u32 = 250;

/// The capacity of the policy and destination maps (`POLICY_*`, `DESTS_*`, both
/// families) in the benchmark object. The agent's object holds 65,536 entries (its own
/// pods only); the 100k and 1M rows need more. The maps are not preallocated, so the
/// limit does not change the cost of a lookup.
pub const POLICY_BENCH_MAX_ENTRIES: u32 = 1_048_576;

const fn a(a: u8, b: u8, c: u8, d: u8) -> Ipv4Addr {
    Ipv4Addr::new(a, b, c, d)
}

/// This node (source node and gateway).
const NODE: Ipv4Addr = a(192, 168, 0, 10);
/// The remote gateway (source side) and the pods' node (gateway side).
const PEER: Ipv4Addr = a(192, 168, 0, 20);
/// sec0's address on the egress network, the egress IP and a host behind it.
const SEC0_ADDR: &str = "192.168.101.11/24";
const EGRESS: Ipv4Addr = a(192, 168, 101, 50);
const DEST: Ipv4Addr = a(192, 168, 101, 100);
const DEST_MAC: [u8; 6] = [0x02, 0, 0, 0, 0x65, 0x64];
/// What the cache checks write into a cached next hop: no FIB lookup answers with it.
const POISON_MAC: [u8; 6] = [0x02, 0, 0, 0, 0xba, 0xd0];
const DPORT: u16 = 443;
const RULE: u32 = 1;

const fn net4(addr: Ipv4Addr, len: u8) -> Ipv4Net {
    Ipv4Net::new_assert(addr, len)
}

const fn net6(addr: Ipv6Addr, len: u8) -> Ipv6Net {
    Ipv6Net::new_assert(addr, len)
}

/// First pod of the policy tables: 10.244.0.1, 10.244.0.2, ...
const POD_BASE: Ipv4Addr = a(10, 244, 0, 1);
/// A local pod that no rule selects (outside the 100k pods of the largest table).
const UNSELECTED_POD: Ipv4Addr = a(10, 247, 200, 9);
/// Destination of the tunnel case, inside the 4th prefix (10.100.0.0/16).
const TUNNEL_DEST: Ipv4Addr = a(10, 100, 7, 9);
/// Destination prefixes of every selected pod (ten per pod, mixed lengths, none inside
/// another).
const PREFIXES: [Ipv4Net; 10] = [
    net4(a(192, 168, 101, 0), 24),
    net4(a(192, 168, 102, 0), 24),
    net4(a(172, 16, 0, 0), 12),
    net4(a(10, 100, 0, 0), 16),
    net4(a(10, 101, 4, 0), 22),
    net4(a(10, 102, 8, 0), 28),
    net4(a(100, 64, 0, 0), 10),
    net4(a(198, 18, 0, 0), 15),
    net4(a(203, 0, 113, 0), 24),
    net4(a(192, 0, 2, 128), 25),
];
/// The prefix of the tunnel destination, in both families' lists.
const TUNNEL_PREFIX: usize = 3;

/// The IPv6 policy tables' twins of the above (rows 1v6 and 2v6): pods fd00:244::1,
/// fd00:244::2, ...; the unselected pod, outside them; the destination prefixes, global
/// unicast (`from_pod` passes link-scoped destinations to the kernel before any lookup)
/// of lengths in each of `SelectedValueV6::lengths`' three words, none inside another;
/// the tunnel destination, inside the 4th (2001:db8:100:7::/64).
const POD_BASE6: Ipv6Addr = Ipv6Addr::new(0xfd00, 0x244, 0, 0, 0, 0, 0, 1);
const UNSELECTED_POD6: Ipv6Addr = Ipv6Addr::new(0xfd00, 0x247, 0x200, 0, 0, 0, 0, 9);
const TUNNEL_DEST6: Ipv6Addr = Ipv6Addr::new(0x2001, 0xdb8, 0x100, 7, 0, 0, 0, 9);
const PREFIXES6: [Ipv6Net; 10] = [
    net6(Ipv6Addr::new(0x2001, 0xdb8, 0x101, 0, 0, 0, 0, 0), 48),
    net6(Ipv6Addr::new(0x2001, 0xdb8, 0x102, 0, 0, 0, 0, 0), 48),
    net6(Ipv6Addr::new(0x2001, 0xdb8, 0x8000, 0, 0, 0, 0, 0), 33),
    net6(Ipv6Addr::new(0x2001, 0xdb8, 0x100, 7, 0, 0, 0, 0), 64),
    net6(Ipv6Addr::new(0x2001, 0xdb8, 0x103, 0x40, 0, 0, 0, 0), 58),
    net6(Ipv6Addr::new(0x2001, 0xdb8, 0x104, 0, 0, 0, 0x10, 0), 124),
    net6(Ipv6Addr::new(0x2001, 0xdb8, 0x200, 0, 0, 0, 0, 0), 40),
    net6(Ipv6Addr::new(0x2001, 0xdb8, 0x105, 0, 0x8000, 0, 0, 0), 65),
    net6(Ipv6Addr::new(0x2001, 0xdb8, 0x106, 0, 0, 0, 0, 1), 128),
    net6(Ipv6Addr::new(0x2001, 0xdb8, 0x107, 0, 0, 0, 0, 0), 96),
];

/// Pod of the established flow (its node is `PEER`) and its port; the egress port.
const FLOW_POD: Ipv4Addr = a(10, 244, 1, 5);
const FLOW_SPORT: u16 = 40_000;
const FLOW_EPORT: u16 = 50_000;
/// Pod of the new flows; source ports `NEW_SPORT_BASE + i`.
const NEW_POD: Ipv4Addr = a(10, 244, 1, 7);
const NEW_SPORT_BASE: u16 = 1024;
/// The new flow of the check before timing (source port 65535), outside the timed range.
const NEW_FLOW_CHECK: u32 = (u16::MAX - NEW_SPORT_BASE) as u32;

/// The IPv6 (NAT66) rows' twins of the above, over the same IPv4 underlay: sec0's IPv6
/// address, the egress IP and the destination behind it, the flow's pod (ports as
/// above).
const SEC0_ADDR6: &str = "fd00:101::11/64";
const EGRESS6: Ipv6Addr = Ipv6Addr::new(0xfd00, 0x101, 0, 0, 0, 0, 0, 0x50);
const DEST6: Ipv6Addr = Ipv6Addr::new(0xfd00, 0x101, 0, 0, 0, 0, 0, 0x100);
const FLOW_POD6: Ipv6Addr = Ipv6Addr::new(0xfd00, 0x244, 1, 0, 0, 0, 0, 5);

/// Background conntrack: this many flows (two entries each), pods 10.246.x.y to
/// 198.18.x.y, none of which share a tuple with the measured flows.
pub const CT_FLOWS: u32 = 100_000;

// ---- the namespace ----

/// Run `f` on a new thread in a new, anonymous network namespace (loopback up).
pub fn in_private_netns<T: Send + 'static>(
    f: impl FnOnce() -> Result<T> + Send + 'static,
) -> Result<T> {
    let handle = thread::Builder::new()
        .name("bench-netns".into())
        .spawn(move || -> Result<T> {
            // SAFETY: unshare(2) only changes the calling thread's namespace membership.
            let rc = unsafe { libc::unshare(libc::CLONE_NEWNET) };
            if rc != 0 {
                bail!(
                    "failed to unshare the network namespace: {} (the benchmark needs root)",
                    std::io::Error::last_os_error()
                );
            }
            ip("link set lo up")?;
            f()
        })
        .context("failed to spawn the benchmark thread")?;
    handle
        .join()
        .map_err(|_| anyhow::anyhow!("the benchmark thread panicked"))?
}

/// `ip <args>` in the calling thread's namespace.
fn ip(args: &str) -> Result<()> {
    let out = Command::new("ip")
        .args(args.split_whitespace())
        .output()
        .with_context(|| format!("failed to run `ip {args}`"))?;
    ensure!(
        out.status.success(),
        "failed to run `ip {args}`: {}",
        String::from_utf8_lossy(&out.stderr).trim()
    );
    Ok(())
}

fn ifindex(name: &str) -> Result<u32> {
    let c = std::ffi::CString::new(name).context("interface name")?;
    // SAFETY: valid NUL-terminated string.
    let i = unsafe { libc::if_nametoindex(c.as_ptr()) };
    ensure!(i != 0, "failed to find interface {name}");
    Ok(i)
}

fn ktime_ns() -> Result<u64> {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: valid out pointer.
    // The datapath's clock (`bpf_ktime_get_coarse_ns`).
    let rc = unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC_COARSE, &mut ts) };
    ensure!(
        rc == 0,
        "failed to read CLOCK_MONOTONIC_COARSE: {}",
        std::io::Error::last_os_error()
    );
    Ok(ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64)
}

fn mac(m: [u8; 6]) -> String {
    m.map(|b| format!("{b:02x}")).join(":")
}

/// Interfaces of the namespace:
/// `tun0` (veth, stands in for the collect-metadata VXLAN device) and `sec0` (veth,
/// 192.168.101.11/24 and fd00:101::11/64, the egress network) with permanent neighbours
/// for `DEST` and `DEST6`; forwarding on for both families.
struct Net {
    tun0: u32,
    sec0: u32,
}

fn topology() -> Result<Net> {
    // veth, not dummy: the dummy driver is not built into every test kernel.
    ip("link add tun0 type veth peer name tun0p")?;
    ip("link set tun0 up")?;
    ip("link add sec0 address 02:00:00:00:65:0b type veth peer name sec0p")?;
    ip(&format!("addr add {SEC0_ADDR} dev sec0"))?;
    // `nodad`: usable at once.
    ip(&format!("addr add {SEC0_ADDR6} dev sec0 nodad"))?;
    ip("link set sec0 up")?;
    ip("link set sec0p up")?;
    for dest in [IpAddr::V4(DEST), IpAddr::V6(DEST6)] {
        ip(&format!(
            "neigh replace {dest} lladdr {} dev sec0 nud permanent",
            mac(DEST_MAC)
        ))?;
    }
    // The FIB helper refuses to forward otherwise.
    for family in ["ipv4", "ipv6"] {
        std::fs::write(format!("/proc/sys/net/{family}/conf/all/forwarding"), "1").with_context(
            || format!("failed to enable {family} forwarding in the benchmark namespace"),
        )?;
    }
    Ok(Net {
        tun0: ifindex("tun0")?,
        sec0: ifindex("sec0")?,
    })
}

// ---- the loaded object ----

/// One copy of the object: fresh maps and counters, the three programs loaded.
struct Bed {
    ebpf: Ebpf,
    config: Array<MapData, Config>,
    policy4: PolicyMaps<V4>,
    policy6: PolicyMaps<V6>,
    rules: HashMap<MapData, u32, RuleValueV4>,
    nodes: HashMap<MapData, Underlay, NodeValue>,
    pod_owner: HashMap<MapData, [u8; 4], PodOwnerValue>,
    ct: HashMap<MapData, CtKeyV4, CtEntryV4>,
    /// Set by [`gateway6`].
    ct6: Option<HashMap<MapData, CtKeyV6, CtEntryV6>>,
    nh_gen: Array<MapData, u32>,
    egress_ips: HashMap<MapData, [u8; 4], EgressIpValue>,
    admitted: HashMap<MapData, AdmittedKeyV4, AdmittedValue>,
    counters: PerCpuArray<MapData, Counter>,
    /// Set when conntrack is kept full: new flows evict background flows, so every new
    /// flow removed again is replaced by a fresh background flow.
    refill: Option<Refill>,
}

/// The next background flow to insert when conntrack is kept full, and its interface.
#[derive(Clone, Copy, Debug)]
struct Refill {
    next: u32,
    ifindex: u32,
}

fn take(ebpf: &mut Ebpf, name: &str) -> Result<Map> {
    ebpf.take_map(name)
        .with_context(|| format!("failed to find map {name} in the object"))
}

impl Bed {
    fn load(net: &Net) -> Result<Bed> {
        let mut ebpf = EbpfLoader::new()
            .override_global(TEST_TUNNEL_FROM_CB, &1u8, true)
            .map_max_entries(maps::POLICY_V4, POLICY_BENCH_MAX_ENTRIES)
            .map_max_entries(maps::DESTS_V4, POLICY_BENCH_MAX_ENTRIES)
            .map_max_entries(maps::POLICY_V6, POLICY_BENCH_MAX_ENTRIES)
            .map_max_entries(maps::DESTS_V6, POLICY_BENCH_MAX_ENTRIES)
            .load(OBJECT)
            .context("failed to load the eBPF object")?;
        for name in [FROM_POD, FROM_TUNNEL, FROM_SECONDARY] {
            let p: &mut SchedClassifier = ebpf
                .program_mut(name)
                .with_context(|| format!("failed to find program {name}"))?
                .try_into()
                .with_context(|| format!("failed to use {name} as a classifier"))?;
            // The verifier gives up with EAGAIN when a signal is pending: the agent's
            // loader blocks this thread's signals and retries.
            egress_agent::datapath::load_retrying(p)
                .with_context(|| format!("failed to load program {name}"))?;
        }
        let mut bed = Bed {
            config: take(&mut ebpf, maps::CONFIG)?.try_into()?,
            policy4: PolicyMaps::take(&mut ebpf)?,
            policy6: PolicyMaps::take(&mut ebpf)?,
            rules: take(&mut ebpf, maps::RULES_V4)?.try_into()?,
            nodes: take(&mut ebpf, maps::NODES)?.try_into()?,
            pod_owner: take(&mut ebpf, maps::POD_OWNER_V4)?.try_into()?,
            ct: take(&mut ebpf, maps::CT_V4)?.try_into()?,
            ct6: None,
            nh_gen: take(&mut ebpf, maps::NH_GEN)?.try_into()?,
            egress_ips: take(&mut ebpf, maps::EGRESS_IPS_V4)?.try_into()?,
            admitted: take(&mut ebpf, maps::ADMITTED_V4)?.try_into()?,
            counters: take(&mut ebpf, maps::COUNTERS)?.try_into()?,
            refill: None,
            ebpf,
        };
        bed.config.set(
            0,
            Config {
                node_ip: underlay::from_v4(NODE.octets()),
                tunnel_ifindex: net.tun0,
                port_min: 1024,
                port_max: 65_535,
                tunnel_mtu: 1450,
                flags: flags::READY,
                max_flows_per_pod: 0,
            },
            0,
        )?;
        bed.nodes.insert(
            underlay::from_v4(NODE.octets()),
            NodeValue { node_id: 1 },
            0,
        )?;
        bed.nodes.insert(
            underlay::from_v4(PEER.octets()),
            NodeValue { node_id: 2 },
            0,
        )?;
        bed.rules.insert(
            RULE,
            RuleValueV4 {
                egress_ip: EGRESS.octets(),
                ifindex: net.sec0,
            },
            0,
        )?;
        bed.egress_ips.insert(
            EGRESS.octets(),
            EgressIpValue {
                ifindex: net.sec0,
                flags: 0,
            },
            0,
        )?;
        Ok(bed)
    }

    /// Both entries of an established TCP flow (pod:sport -> dst:dport, seen as
    /// xaddr:xport on the egress side).
    #[expect(clippy::too_many_arguments, reason = "one flow, spelled out")]
    fn ct_flow(
        &mut self,
        pod: Ipv4Addr,
        sport: u16,
        dst: Ipv4Addr,
        dport: u16,
        xaddr: Ipv4Addr,
        xport: u16,
        ifindex: u32,
        now: u64,
    ) -> Result<()> {
        let site = FlowSite {
            egress: xaddr,
            ifindex,
            pod_node: PEER,
            rule_id: RULE,
        };
        for (key, entry) in flow_entries((pod, sport), (dst, dport), xport, &site, now) {
            self.ct.insert(key, entry, 0)?;
        }
        Ok(())
    }

    /// Background established flows `flows` (indexes) that the measured packets never
    /// touch.
    fn fill_ct(&mut self, ifindex: u32, flows: std::ops::Range<u32>) -> Result<()> {
        let now = ktime_ns()?;
        let site = FlowSite {
            egress: EGRESS,
            ifindex,
            pod_node: PEER,
            rule_id: RULE,
        };
        for i in flows {
            for (key, entry) in background_flow(i, &site, now) {
                self.ct
                    .insert(key, entry, 0)
                    .with_context(|| format!("failed to fill conntrack entry {i}"))?;
            }
        }
        Ok(())
    }

    /// Keep conntrack full: `flows` flows were removed, insert as many fresh background
    /// flows (nothing unless [`Bed::refill`] is set).
    fn refill(&mut self, flows: u32) -> Result<()> {
        let Some(r) = self.refill else {
            return Ok(());
        };
        self.fill_ct(r.ifindex, r.next..r.next + flows)?;
        self.refill = Some(Refill {
            next: r.next + flows,
            ..r
        });
        Ok(())
    }

    /// Entries in conntrack now (one map walk).
    fn ct_entries(&self) -> usize {
        self.ct.keys().filter(Result::is_ok).count()
    }

    /// The next hop cached in `flow`'s ORIGINAL entry, and the interface the entry sends
    /// its flow out of.
    fn next_hop(&self, flow: &CachedFlow) -> Result<(NextHop, u32)> {
        let e = match &flow.key {
            FlowKey::V4(k) => self.ct.get(k, 0).map(|e| (e.next_hop, e.ifindex)),
            FlowKey::V6(k) => self.ct6()?.get(k, 0).map(|e| (e.next_hop, e.ifindex)),
        };
        e.with_context(|| format!("failed to find the conntrack entry of {}", flow.name))
    }

    /// Replace the next hop cached in `flow`'s ORIGINAL entry (the rest stays).
    fn set_next_hop(&mut self, flow: &CachedFlow, nh: NextHop) -> Result<()> {
        let what = || format!("failed to write the cached next hop of {}", flow.name);
        match &flow.key {
            FlowKey::V4(k) => {
                let e = self.ct.get(k, 0).with_context(what)?;
                let e = CtEntryV4 { next_hop: nh, ..e };
                self.ct.insert(k, e, 0).with_context(what)
            }
            FlowKey::V6(k) => {
                let ct = self.ct6.as_mut().context("CT_V6 is not set up")?;
                let e = ct.get(k, 0).with_context(what)?;
                let e = CtEntryV6 { next_hop: nh, ..e };
                ct.insert(k, e, 0).with_context(what)
            }
        }
    }

    fn ct6(&self) -> Result<&HashMap<MapData, CtKeyV6, CtEntryV6>> {
        self.ct6.as_ref().context("CT_V6 is not set up")
    }

    /// `NH_GEN`: the generation a cached next hop must have to be used.
    fn generation(&self) -> Result<u32> {
        self.nh_gen
            .get(&0, 0)
            .context("failed to read the next-hop generation (NH_GEN)")
    }

    fn counters(&self) -> Result<Vec<u64>> {
        (0..MAX_REASONS)
            .map(|r| {
                let v = self
                    .counters
                    .get(&r, 0)
                    .with_context(|| format!("failed to read counter {r}"))?;
                Ok(v.iter().map(|c| c.packets).sum())
            })
            .collect()
    }

    fn program(&self, name: &str) -> Result<&SchedClassifier> {
        self.ebpf
            .program(name)
            .with_context(|| format!("failed to find program {name}"))?
            .try_into()
            .with_context(|| format!("failed to use {name} as a classifier"))
    }

    fn call(
        &self,
        empty: &EmptyProgram,
        prog: Prog,
        data: &[u8],
        ctx: &[u8],
        repeat: u32,
        out: Option<&mut [u8]>,
    ) -> Result<Run> {
        match prog {
            Prog::Empty => empty.test_run(data, ctx, repeat),
            Prog::Datapath(name) => {
                let r = self
                    .program(name)?
                    .test_run(TestRunOptions {
                        data_in: Some(data),
                        data_out: out,
                        ctx_in: Some(ctx),
                        repeat,
                        ..TestRunOptions::new()
                    })
                    .with_context(|| format!("failed to test_run {name}"))?;
                Ok(Run {
                    verdict: r.return_value,
                    ns: u32::try_from(r.duration.as_nanos()).unwrap_or(u32::MAX),
                })
            }
        }
    }
}

/// A map's key and value types (`egress_common::maps::Map`).
type MapKey<M> = <M as maps::Map>::Key;
type MapValue<M> = <M as maps::Map>::Value;

/// One family's tables of `from_pod`'s policy lookup (`POLICY_*`, `DESTS_*`,
/// `SELECTED_*`), filled with the agent's own per-family helpers ([`Family`]).
struct PolicyMaps<F: Family> {
    policy: HashMap<MapData, MapKey<F::Policy>, MapValue<F::Policy>>,
    dests: LpmTrie<MapData, F::Octets, MapValue<F::Dests>>,
    selected: HashMap<MapData, F::Octets, MapValue<F::Selected>>,
}

impl<F: Family> PolicyMaps<F> {
    fn take(ebpf: &mut Ebpf) -> Result<Self> {
        Ok(Self {
            policy: take(ebpf, <F::Policy as maps::Map>::SPEC.name)?.try_into()?,
            dests: take(ebpf, <F::Dests as maps::Map>::SPEC.name)?.try_into()?,
            selected: take(ebpf, <F::Selected as maps::Map>::SPEC.name)?.try_into()?,
        })
    }

    /// Select `pods`, each with an entry for every prefix of `prefixes` (the i-th under
    /// rule `RULE + i`), all tunneled to `PEER` with the egress IP `egress`: `POLICY_*`,
    /// `SELECTED_*` (entries and prefix lengths) and `DESTS_*` (the prefixes' chains) as
    /// the agent fills them.
    fn fill(
        &mut self,
        pods: impl Iterator<Item = F::Addr>,
        prefixes: &[F::Net],
        egress: F::Addr,
    ) -> Result<()> {
        let gateway = underlay::from_v4(PEER.octets());
        let entries = u32::try_from(prefixes.len()).context("too many prefixes per pod")?;
        let mut keys = Vec::new();
        for pod in pods {
            let mut selected = F::selected(entries);
            for (i, dst) in prefixes.iter().enumerate() {
                let key = F::policy_key(pod, *dst);
                let value = F::policy_value(
                    gateway,
                    F::octets(egress),
                    RULE + i as u32,
                    action::FORWARD,
                    0,
                );
                self.policy.insert(key, value, 0).with_context(|| {
                    format!(
                        "failed to insert the {} policy entry {pod} -> {dst}",
                        F::NAME
                    )
                })?;
                F::add_length(&mut selected, u32::from(F::split(*dst).1));
                keys.push(key);
            }
            self.selected
                .insert(F::octets(pod), selected, 0)
                .with_context(|| format!("failed to select the {} pod {pod}", F::NAME))?;
        }
        for ((len, net), v) in F::dests(keys.iter()) {
            self.dests
                .insert(&Key::new(len, net), v, 0)
                .with_context(|| {
                    format!(
                        "failed to insert a {} entry",
                        <F::Dests as maps::Map>::SPEC.name
                    )
                })?;
        }
        Ok(())
    }
}

/// What a conntrack flow's entries point at on the gateway: the egress IP (the
/// translation), its interface, the pod's node and the rule.
#[derive(Clone, Copy, Debug)]
pub struct FlowSite {
    pub egress: Ipv4Addr,
    pub ifindex: u32,
    pub pod_node: Ipv4Addr,
    pub rule_id: u32,
}

/// Both entries (original, reply) of an established TCP flow `pod` -> `dst`, translated
/// to the site's egress IP and `xport`, last seen at `now`.
pub fn flow_entries(
    pod: (Ipv4Addr, u16),
    dst: (Ipv4Addr, u16),
    xport: u16,
    site: &FlowSite,
    now: u64,
) -> [(CtKeyV4, CtEntryV4); 2] {
    let (orig, reply) = ct_keys(pod.0, pod.1, dst.0, dst.1, site.egress, xport);
    let entry = CtEntryV4 {
        xlate_addr: site.egress.octets(),
        xlate_port_be: xport.to_be(),
        state: state::ESTABLISHED,
        _pad0: 0,
        pod_node: underlay::from_v4(site.pod_node.octets()),
        ifindex: site.ifindex,
        rule_id: site.rule_id,
        last_seen_ns: now,
        next_hop: Default::default(),
    };
    let back = CtEntryV4 {
        xlate_addr: pod.0.octets(),
        xlate_port_be: pod.1.to_be(),
        ..entry
    };
    [(orig, entry), (reply, back)]
}

/// Background flow `i`: pod 10.246.0.0 + i to one of 2,000 destinations (198.18.x.y) on
/// port 443, translated to egress port 1024 + i / 2000 (unique tuples both ways); no
/// measured packet shares a tuple with it.
pub fn background_flow(i: u32, site: &FlowSite, now: u64) -> [(CtKeyV4, CtEntryV4); 2] {
    let pod = Ipv4Addr::from(u32::from(a(10, 246, 0, 0)) + i);
    let dst = Ipv4Addr::from(u32::from(a(198, 18, 0, 0)) + i % 2000);
    flow_entries(
        (pod, 30_000 + (i % 1000) as u16),
        (dst, DPORT),
        1024 + (i / 2000) as u16,
        site,
        now,
    )
}

fn pod(i: u32) -> Ipv4Addr {
    Ipv4Addr::from(u32::from(POD_BASE) + i)
}

/// (original, reply) conntrack keys of a TCP flow translated to xaddr:xport.
fn ct_keys(
    pod: Ipv4Addr,
    sport: u16,
    dst: Ipv4Addr,
    dport: u16,
    xaddr: Ipv4Addr,
    xport: u16,
) -> (CtKeyV4, CtKeyV4) {
    let orig = CtKeyV4 {
        src: pod.octets(),
        dst: dst.octets(),
        src_port_be: sport.to_be(),
        dst_port_be: dport.to_be(),
        proto: frame::PROTO_TCP,
        dir: dir::ORIGINAL,
        _pad: [0; 2],
    };
    let reply = CtKeyV4 {
        src: dst.octets(),
        dst: xaddr.octets(),
        src_port_be: dport.to_be(),
        dst_port_be: xport.to_be(),
        proto: frame::PROTO_TCP,
        dir: dir::REPLY,
        _pad: [0; 2],
    };
    (orig, reply)
}

fn ctx(tunnel: Option<(Ipv4Addr, u32)>) -> Vec<u8> {
    crate::testrun::skb_ctx(0, tunnel.map(|(sender, vni)| (sender.into(), vni))).to_vec()
}

// ---- cases ----

#[derive(Clone, Copy, Debug)]
enum Prog {
    Empty,
    Datapath(&'static str),
}

/// Which floor a row is compared with.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FloorKind {
    /// The row is a floor.
    None,
    /// The empty program, repeated runs.
    Repeated,
    /// The empty program, single runs (same method as the new-flow row).
    Single,
}

/// A target from issue 7.
#[derive(Clone, Copy, Debug)]
pub enum Target {
    /// At most this many times the floor.
    FloorRatio(f64),
    /// At most this many nanoseconds.
    Ns(f64),
}

/// How a row was measured.
#[derive(Clone, Copy, Debug)]
pub enum Method {
    /// `repeat` runs per round, in calls of `chunk`.
    Repeated { chunk: u32 },
    /// The median of single-run (`repeat = 1`) durations in each round.
    Single,
}

impl Mode {
    fn method(self) -> Method {
        match self {
            Mode::Repeated { chunk } => Method::Repeated { chunk },
            Mode::Single | Mode::NewFlows => Method::Single,
        }
    }
}

/// What the report shows for one row.
#[derive(Clone, Debug)]
pub struct Meta {
    pub id: &'static str,
    pub path: &'static str,
    pub program: &'static str,
    pub state: String,
    pub floor: FloorKind,
    pub targets: Vec<Target>,
}

/// One timed row: its rounds (ns per packet).
#[derive(Clone, Debug)]
pub struct Timing {
    pub meta: Meta,
    pub method: Method,
    pub rounds: Vec<f64>,
}

impl Timing {
    pub fn spread(&self) -> Option<Spread> {
        Spread::of(&self.rounds)
    }
}

/// New flows: SYN from `NEW_POD`, source port `NEW_SPORT_BASE + i`.
#[derive(Clone, Copy, Debug)]
struct NewFlows;

impl NewFlows {
    fn frame(i: u32) -> Vec<u8> {
        Tcp::new(NEW_POD, NEW_SPORT_BASE + i as u16, DEST, DPORT, TCP_SYN).frame()
    }

    /// Remove both entries of new flow `i`.
    fn remove(bed: &mut Bed, i: u32) -> Result<()> {
        let sport = NEW_SPORT_BASE + i as u16;
        let (orig, _) = ct_keys(NEW_POD, sport, DEST, DPORT, EGRESS, 0);
        let e = bed
            .ct
            .get(&orig, 0)
            .with_context(|| format!("failed to find the conntrack entry of new flow {i}"))?;
        let (_, reply) = ct_keys(
            NEW_POD,
            sport,
            DEST,
            DPORT,
            Ipv4Addr::from(e.xlate_addr),
            u16::from_be(e.xlate_port_be),
        );
        bed.ct.remove(&orig)?;
        bed.ct.remove(&reply)?;
        Ok(())
    }
}

#[derive(Clone, Copy, Debug)]
enum Mode {
    Repeated { chunk: u32 },
    Single,
    NewFlows,
}

/// What the first run must do to the frame, checked before timing.
/// Arguments: the frame sent, the frame returned.
type Check = fn(&[u8], &[u8]) -> Result<()>;

struct Case {
    meta: Meta,
    prog: Prog,
    frame: Vec<u8>,
    ctx: Vec<u8>,
    mode: Mode,
    verdict: u32,
    /// Reasons bumped by exactly one per run; every other counter must stay put.
    counts: &'static [u32],
    check: Option<Check>,
    /// The flows whose cached next hops the timed runs take: the row's own flow first
    /// (its verification packet fills the cache), then any partner. Empty when the path
    /// has no cache.
    cached: Vec<CachedFlow>,
}

impl Case {
    /// "case 4 (path, state)", for messages.
    fn label(&self) -> String {
        format!(
            "case {} ({}, {})",
            self.meta.id, self.meta.path, self.meta.state
        )
    }
}

/// An ORIGINAL conntrack key of either family.
#[derive(Clone, Copy, Debug)]
enum FlowKey {
    V4(CtKeyV4),
    V6(CtKeyV6),
}

/// An established flow whose ORIGINAL entry caches the next hop that a row's packets
/// take, and the packet of that flow as `from_tunnel` receives it.
#[derive(Clone, Debug)]
struct CachedFlow {
    /// "pod:port -> destination:port", for messages.
    name: String,
    key: FlowKey,
    frame: Vec<u8>,
}

impl CachedFlow {
    /// The IPv4 flow `src` -> `DEST`:`DPORT` of [`gateway_bed`] (the measured flow or
    /// its partner).
    fn v4(src: (Ipv4Addr, u16)) -> CachedFlow {
        // The reply key's translation is irrelevant here.
        let (key, _) = ct_keys(src.0, src.1, DEST, DPORT, DEST, 0);
        CachedFlow {
            name: format!(
                "{} -> {}",
                SocketAddr::from(src),
                SocketAddr::from((DEST, DPORT))
            ),
            key: FlowKey::V4(key),
            frame: Tcp::new(src.0, src.1, DEST, DPORT, TCP_ACK)
                .ttl(255)
                .frame(),
        }
    }

    /// The IPv6 flow `src` -> `DEST6`:`DPORT` of [`gateway6`].
    fn v6(src: (Ipv6Addr, u16)) -> CachedFlow {
        CachedFlow {
            name: format!(
                "{} -> {}",
                SocketAddr::from(src),
                SocketAddr::from((DEST6, DPORT))
            ),
            key: FlowKey::V6(ct_key6(src, (DEST6, DPORT), dir::ORIGINAL)),
            frame: frame::tcp6_ack(src.0, src.1, DEST6, DPORT),
        }
    }
}

fn floor_cases() -> Vec<Case> {
    let data = Tcp::new(UNSELECTED_POD, FLOW_SPORT, DEST, DPORT, TCP_ACK).frame();
    vec![
        Case {
            meta: Meta {
                id: "F0",
                path: "floor: empty TC program (`r0 = TC_ACT_OK; exit`)",
                program: "(empty)",
                state: "-".into(),
                floor: FloorKind::None,
                targets: vec![],
            },
            prog: Prog::Empty,
            frame: data.clone(),
            ctx: ctx(None),
            mode: Mode::Repeated { chunk: u32::MAX },
            verdict: TC_ACT_OK,
            counts: &[],
            check: None,
            cached: Vec::new(),
        },
        Case {
            meta: Meta {
                id: "F1",
                path: "floor': ARP frame (reads the ethertype, returns TC_ACT_OK)",
                program: FROM_POD,
                state: "-".into(),
                floor: FloorKind::Repeated,
                targets: vec![],
            },
            prog: Prog::Datapath(FROM_POD),
            frame: frame::arp(UNSELECTED_POD, a(10, 244, 0, 254)),
            ctx: ctx(None),
            mode: Mode::Repeated { chunk: u32::MAX },
            verdict: TC_ACT_OK,
            counts: &[],
            check: None,
            cached: Vec::new(),
        },
    ]
}

/// What rows 1 and 2 and their IPv6 twins take from their family.
trait PolicyRows: Family {
    /// (id, path) of the miss row and of the tunnel row.
    const ROWS: [(&'static str, &'static str); 2];
    /// Destination prefixes of every selected pod.
    const PREFIXES: [Self::Net; 10];
    /// Destination of both rows, in `PREFIXES[TUNNEL_PREFIX]`.
    const TUNNEL_DEST: Self::Addr;
    /// Source of the miss row: a local pod that no rule selects.
    const UNSELECTED_POD: Self::Addr;
    /// The egress IP the policy entries name.
    const EGRESS: Self::Addr;
    /// Selected pod `i` (a table of n pods selects pods 0..n).
    fn pod(i: u32) -> Self::Addr;
    /// A TCP ACK from `src`:`FLOW_SPORT` to `dst`:`DPORT`.
    fn frame(src: Self::Addr, dst: Self::Addr) -> Vec<u8>;
    fn maps(bed: &mut Bed) -> &mut PolicyMaps<Self>;
    /// Issue 7's targets (IPv4 paths): of the tunnel row if `tunnel`, else of the miss
    /// row, with `pods` selected pods.
    fn targets(_tunnel: bool, _pods: u32) -> Vec<Target> {
        Vec::new()
    }
}

impl PolicyRows for V4 {
    const ROWS: [(&'static str, &'static str); 2] = [
        ("1", "miss: packet from an unselected pod"),
        ("2", "selected packet into the tunnel (remote gateway)"),
    ];
    const PREFIXES: [Ipv4Net; 10] = PREFIXES;
    const TUNNEL_DEST: Ipv4Addr = TUNNEL_DEST;
    const UNSELECTED_POD: Ipv4Addr = UNSELECTED_POD;
    const EGRESS: Ipv4Addr = EGRESS;

    fn pod(i: u32) -> Ipv4Addr {
        pod(i)
    }

    fn frame(src: Ipv4Addr, dst: Ipv4Addr) -> Vec<u8> {
        Tcp::new(src, FLOW_SPORT, dst, DPORT, TCP_ACK).frame()
    }

    fn maps(bed: &mut Bed) -> &mut PolicyMaps<V4> {
        &mut bed.policy4
    }

    fn targets(tunnel: bool, pods: u32) -> Vec<Target> {
        match (tunnel, pods >= 10_000) {
            (false, _) => vec![Target::FloorRatio(2.0), Target::Ns(50.0)],
            (true, true) => vec![Target::Ns(150.0)],
            (true, false) => vec![],
        }
    }
}

impl PolicyRows for V6 {
    const ROWS: [(&'static str, &'static str); 2] = [
        ("1v6", "miss: packet from an unselected IPv6 pod"),
        (
            "2v6",
            "selected IPv6 packet into the tunnel (remote gateway)",
        ),
    ];
    const PREFIXES: [Ipv6Net; 10] = PREFIXES6;
    const TUNNEL_DEST: Ipv6Addr = TUNNEL_DEST6;
    const UNSELECTED_POD: Ipv6Addr = UNSELECTED_POD6;
    const EGRESS: Ipv6Addr = EGRESS6;

    fn pod(i: u32) -> Ipv6Addr {
        Ipv6Addr::from(u128::from(POD_BASE6) + u128::from(i))
    }

    fn frame(src: Ipv6Addr, dst: Ipv6Addr) -> Vec<u8> {
        frame::tcp6_ack(src, FLOW_SPORT, dst, DPORT)
    }

    fn maps(bed: &mut Bed) -> &mut PolicyMaps<V6> {
        &mut bed.policy6
    }
}

/// Fill `F`'s policy tables with `pods` selected pods, each with the prefixes
/// `F::PREFIXES[prefixes]`, and return the rows on them, labelled `state`: the miss
/// (from the unselected pod) and the tunnel (from the pod in the middle of the table),
/// both to the tunnel destination, both leaving the frame as it came.
fn policy_rows<F: PolicyRows>(
    bed: &mut Bed,
    state: &str,
    pods: u32,
    prefixes: Range<usize>,
) -> Result<[Case; 2]> {
    let all = F::PREFIXES;
    let prefixes = all
        .get(prefixes.clone())
        .with_context(|| format!("no {} prefixes {prefixes:?}", F::NAME))?;
    F::maps(bed).fill((0..pods).map(F::pod), prefixes, F::EGRESS)?;
    let [(miss_id, miss_path), (tunnel_id, tunnel_path)] = F::ROWS;
    let row = |id, path, src, verdict, counts, tunnel| Case {
        meta: Meta {
            id,
            path,
            program: FROM_POD,
            state: state.to_owned(),
            floor: FloorKind::Repeated,
            targets: F::targets(tunnel, pods),
        },
        prog: Prog::Datapath(FROM_POD),
        frame: F::frame(src, F::TUNNEL_DEST),
        ctx: ctx(None),
        mode: Mode::Repeated { chunk: u32::MAX },
        verdict,
        counts,
        check: Some(unchanged),
        cached: Vec::new(),
    };
    Ok([
        row(miss_id, miss_path, F::UNSELECTED_POD, TC_ACT_OK, &[], false),
        row(
            tunnel_id,
            tunnel_path,
            F::pod(pods / 2),
            TC_ACT_REDIRECT,
            &[reason::TUNNELED],
            true,
        ),
    ])
}

fn unchanged(data: &[u8], out: &[u8]) -> Result<()> {
    ensure!(
        out.get(..data.len()) == Some(data),
        "the frame changed, so repeated runs would not see the same packet"
    );
    Ok(())
}

fn octets_at<const N: usize>(f: &[u8], off: usize) -> Result<[u8; N]> {
    f.get(off..off + N)
        .context("short frame")?
        .try_into()
        .context("short frame")
}

fn be16_at(f: &[u8], off: usize) -> Result<u16> {
    octets_at(f, off).map(u16::from_be_bytes)
}

/// A frame's (source, destination) endpoints: Ethernet, then IPv4 without options or
/// IPv6 without extension headers, then TCP.
fn endpoints(f: &[u8]) -> Result<[(IpAddr, u16); 2]> {
    let (src, dst, l4): (IpAddr, IpAddr, usize) = match be16_at(f, 12)? {
        frame::ETH_P_IP => (
            Ipv4Addr::from(octets_at::<4>(f, 26)?).into(),
            Ipv4Addr::from(octets_at::<4>(f, 30)?).into(),
            34,
        ),
        ETH_P_IPV6 => (
            Ipv6Addr::from(octets_at::<16>(f, 22)?).into(),
            Ipv6Addr::from(octets_at::<16>(f, 38)?).into(),
            54,
        ),
        other => bail!("the frame's ethertype is {other:#06x}, not IPv4 or IPv6"),
    };
    Ok([(src, be16_at(f, l4)?), (dst, be16_at(f, l4 + 2)?)])
}

/// The rewrite `what` must have left `want` as the frame's (address, port).
fn expect(what: &str, got: (IpAddr, u16), want: (IpAddr, u16)) -> Result<()> {
    ensure!(
        got == want,
        "{what} wrote {}, expected {}",
        SocketAddr::from(got),
        SocketAddr::from(want)
    );
    Ok(())
}

fn snat_check(_data: &[u8], out: &[u8]) -> Result<()> {
    expect("SNAT", endpoints(out)?[0], (EGRESS.into(), FLOW_EPORT))
}

fn reverse_nat_check(_data: &[u8], out: &[u8]) -> Result<()> {
    expect(
        "reverse NAT",
        endpoints(out)?[1],
        (FLOW_POD.into(), FLOW_SPORT),
    )
}

fn snat_check6(_data: &[u8], out: &[u8]) -> Result<()> {
    expect("NAT66", endpoints(out)?[0], (EGRESS6.into(), FLOW_EPORT))
}

fn reverse_nat_check6(_data: &[u8], out: &[u8]) -> Result<()> {
    expect(
        "reverse NAT66",
        endpoints(out)?[1],
        (FLOW_POD6.into(), FLOW_SPORT),
    )
}

fn new_flow_check(_data: &[u8], out: &[u8]) -> Result<()> {
    let (src, _) = endpoints(out)?[0];
    ensure!(
        src == IpAddr::V4(EGRESS),
        "new-flow SNAT wrote {src}, expected {EGRESS}"
    );
    Ok(())
}

/// The gateway's rows with conntrack in `state` (the report's label).
fn ct_cases(state: String) -> Vec<Case> {
    let flow = CachedFlow::v4((FLOW_POD, FLOW_SPORT));
    // Row 4's every other run is the partner's packet (see the module docs).
    let partner = CachedFlow::v4((EGRESS, FLOW_EPORT));
    vec![
        Case {
            meta: Meta {
                id: "F2",
                path: "floor, single runs: empty TC program, `repeat = 1`",
                program: "(empty)",
                state: "-".into(),
                floor: FloorKind::None,
                targets: vec![],
            },
            prog: Prog::Empty,
            frame: Tcp::new(NEW_POD, NEW_SPORT_BASE, DEST, DPORT, TCP_SYN).frame(),
            ctx: ctx(Some((PEER, RULE))),
            mode: Mode::Single,
            verdict: TC_ACT_OK,
            counts: &[],
            check: None,
            cached: Vec::new(),
        },
        Case {
            meta: Meta {
                id: "3",
                path: "SNAT of a new flow (TCP SYN, conntrack create)",
                program: FROM_TUNNEL,
                state: state.clone(),
                floor: FloorKind::Single,
                targets: vec![],
            },
            prog: Prog::Datapath(FROM_TUNNEL),
            frame: NewFlows::frame(0),
            ctx: ctx(Some((PEER, RULE))),
            mode: Mode::NewFlows,
            verdict: TC_ACT_REDIRECT,
            counts: &[reason::SNAT_NEW, reason::FORWARDED],
            check: Some(new_flow_check),
            cached: Vec::new(),
        },
        established(
            Meta {
                id: "4",
                path: "SNAT of an established flow",
                program: FROM_TUNNEL,
                state: state.clone(),
                floor: FloorKind::Repeated,
                targets: vec![Target::Ns(200.0)],
            },
            flow.frame.clone(),
            snat_check,
            vec![flow.clone(), partner],
        ),
        Case {
            meta: Meta {
                id: "4s",
                path: "SNAT of an established flow, single runs (compare with row 3)",
                program: FROM_TUNNEL,
                state: state.clone(),
                floor: FloorKind::Single,
                targets: vec![],
            },
            prog: Prog::Datapath(FROM_TUNNEL),
            frame: flow.frame.clone(),
            ctx: ctx(Some((PEER, RULE))),
            mode: Mode::Single,
            verdict: TC_ACT_REDIRECT,
            counts: &[reason::SNAT_HIT, reason::FORWARDED],
            check: Some(snat_check),
            cached: vec![flow],
        },
        established(
            Meta {
                id: "5",
                path: "reverse NAT of a reply, tunneled back to the pod's node",
                program: FROM_SECONDARY,
                state,
                floor: FloorKind::Repeated,
                targets: vec![Target::Ns(200.0)],
            },
            Tcp::new(DEST, DPORT, EGRESS, FLOW_EPORT, TCP_ACK)
                .ttl(255)
                .frame(),
            reverse_nat_check,
            Vec::new(),
        ),
    ]
}

/// The IPv6 twins of rows 4 and 5: NAT66 of the established IPv6 flow of [`gateway6`]
/// (the inner packet of the IPv4 underlay) and of its reply.
fn ct6_cases() -> Vec<Case> {
    let state = || "1 flow (IPv6), and its partner".to_owned();
    let flow = CachedFlow::v6((FLOW_POD6, FLOW_SPORT));
    let partner = CachedFlow::v6((EGRESS6, FLOW_EPORT));
    vec![
        established(
            Meta {
                id: "4v6",
                path: "NAT66 of an established flow",
                program: FROM_TUNNEL,
                state: state(),
                floor: FloorKind::Repeated,
                targets: vec![],
            },
            flow.frame.clone(),
            snat_check6,
            vec![flow, partner],
        ),
        established(
            Meta {
                id: "5v6",
                path: "reverse NAT66 of a reply, tunneled back to the pod's node",
                program: FROM_SECONDARY,
                state: state(),
                floor: FloorKind::Repeated,
                targets: vec![],
            },
            frame::tcp6_ack(DEST6, DPORT, EGRESS6, FLOW_EPORT),
            reverse_nat_check6,
            Vec::new(),
        ),
    ]
}

/// A row of an established flow's packet (TTL or hop limit 255, see the module docs)
/// through `meta.program` on the gateway: `from_tunnel` translates it (sent by `PEER`
/// under `RULE`) and forwards it by the `cached` next hops (the flow's and its
/// partner's), `from_secondary` translates the reply back and tunnels it to the pod's
/// node (no next hop cache: `cached` is empty).
fn established(meta: Meta, frame: Vec<u8>, check: Check, cached: Vec<CachedFlow>) -> Case {
    let (ctx, counts): (_, &'static [u32]) = if meta.program == FROM_TUNNEL {
        (
            ctx(Some((PEER, RULE))),
            &[reason::SNAT_HIT, reason::FORWARDED],
        )
    } else {
        (ctx(None), &[reason::REVERSE_NAT, reason::RETURN_TUNNELED])
    };
    Case {
        prog: Prog::Datapath(meta.program),
        meta,
        frame,
        ctx,
        mode: Mode::Repeated { chunk: TTL_CHUNK },
        verdict: TC_ACT_REDIRECT,
        counts,
        check: Some(check),
        cached,
    }
}

// ---- measuring ----

/// How a check that finds the row on another path than it names ends its message.
const NOT_TIMED: &str = "the bench is not timing the path it names";

fn check_counters(case: &Case, before: &[u64], after: &[u64], runs: u64) -> Result<()> {
    for (r, (b, a)) in before.iter().zip(after).enumerate() {
        let r = r as u32;
        let want = if case.counts.contains(&r) { runs } else { 0 };
        let got = a.wrapping_sub(*b);
        if got != want {
            bail!(
                "{}: counter {} moved by {got}, expected {want} over {runs} runs: {NOT_TIMED}",
                case.label(),
                counters::name(r).unwrap_or("(unassigned)"),
            );
        }
    }
    Ok(())
}

fn check_verdict(case: &Case, run: &Run) -> Result<()> {
    ensure!(
        run.verdict == case.verdict,
        "{}: verdict {}, expected {}",
        case.label(),
        run.verdict,
        case.verdict
    );
    Ok(())
}

/// One run with the frame returned: verdict, counters, rewritten fields.
fn verify(bed: &mut Bed, empty: &EmptyProgram, case: &Case) -> Result<()> {
    let before = bed.counters()?;
    let data = match case.mode {
        // A flow outside the timed range, removed again below.
        Mode::NewFlows => NewFlows::frame(NEW_FLOW_CHECK),
        _ => case.frame.clone(),
    };
    let mut out = vec![0u8; data.len() + 128];
    let run = bed.call(empty, case.prog, &data, &case.ctx, 1, Some(&mut out))?;
    check_verdict(case, &run)?;
    check_counters(case, &before, &bed.counters()?, 1)?;
    if let Some(check) = case.check {
        check(&data, &out).with_context(|| case.label())?;
    }
    if let Mode::NewFlows = case.mode {
        NewFlows::remove(bed, NEW_FLOW_CHECK)?;
        bed.refill(1)?;
    }
    eprintln!(
        "  verified {:>2} {} [{}]: verdict {}, counters {}",
        case.meta.id,
        case.meta.path,
        case.meta.state,
        case.verdict,
        if case.counts.is_empty() {
            "unchanged".to_owned()
        } else {
            case.counts
                .iter()
                .map(|r| format!("+1 {}", counters::name(*r).unwrap_or("?")))
                .collect::<Vec<_>>()
                .join(", ")
        }
    );
    Ok(())
}

fn median(v: &[f64]) -> f64 {
    Spread::of(v).map_or(f64::NAN, |s| s.median)
}

/// One round of a case: ns per packet.
fn round(bed: &mut Bed, empty: &EmptyProgram, case: &Case, plan: &Plan) -> Result<f64> {
    let stamped = stamp_caches(bed, case)?;
    let started = Instant::now();
    let before = bed.counters()?;
    let (runs, ns) = match case.mode {
        Mode::Repeated { chunk } => {
            let mut left = plan.repeats;
            let mut total = 0.0;
            while left > 0 {
                let n = left.min(chunk);
                let run = bed.call(empty, case.prog, &case.frame, &case.ctx, n, None)?;
                check_verdict(case, &run)?;
                total += f64::from(run.ns) * f64::from(n);
                left -= n;
            }
            (u64::from(plan.repeats), total / f64::from(plan.repeats))
        }
        Mode::Single => {
            let mut samples = Vec::with_capacity(plan.singles as usize);
            for _ in 0..plan.singles {
                let run = bed.call(empty, case.prog, &case.frame, &case.ctx, 1, None)?;
                check_verdict(case, &run)?;
                samples.push(f64::from(run.ns));
            }
            (u64::from(plan.singles), median(&samples))
        }
        Mode::NewFlows => {
            let frames: Vec<Vec<u8>> = (0..plan.singles).map(NewFlows::frame).collect();
            let mut samples = Vec::with_capacity(frames.len());
            for f in &frames {
                let run = bed.call(empty, case.prog, f, &case.ctx, 1, None)?;
                check_verdict(case, &run)?;
                samples.push(f64::from(run.ns));
            }
            (u64::from(plan.singles), median(&samples))
        }
    };
    check_counters(case, &before, &bed.counters()?, runs)?;
    check_caches_kept(bed, case, &stamped, started)?;
    check_caches(bed, empty, case, "after a timed round")?;
    if let Mode::NewFlows = case.mode {
        // The next round starts from the same table.
        for i in 0..plan.singles {
            NewFlows::remove(bed, i)?;
        }
        bed.refill(plan.singles)?;
    }
    Ok(ns)
}

/// Verify every case, then time them round-robin (round 1 of each, round 2 of each, ...)
/// so that load drift on the machine spreads over all of them.
fn measure(
    bed: &mut Bed,
    empty: &EmptyProgram,
    cases: &[Case],
    plan: &Plan,
    out: &mut Vec<Timing>,
) -> Result<()> {
    for case in cases {
        verify(bed, empty, case)?;
        check_caches_filled(bed, empty, case)?;
    }
    let mut rounds: Vec<Vec<f64>> = vec![Vec::new(); cases.len()];
    for r in 0..plan.rounds {
        for (case, samples) in cases.iter().zip(&mut rounds) {
            let ns = round(bed, empty, case, plan)?;
            eprintln!(
                "  round {}/{} {:>2} [{}]: {ns:.1} ns",
                r + 1,
                plan.rounds,
                case.meta.id,
                case.meta.state
            );
            samples.push(ns);
        }
    }
    for (case, samples) in cases.iter().zip(rounds) {
        // Floors are measured in every phase and pooled.
        if let Some(t) = out
            .iter_mut()
            .find(|t| t.meta.id == case.meta.id && t.meta.state == case.meta.state)
        {
            t.rounds.extend(samples);
        } else {
            out.push(Timing {
                meta: case.meta.clone(),
                method: case.mode.method(),
                rounds: samples,
            });
        }
    }
    Ok(())
}

// ---- the cached next hop (rows 4, 4s, 4v6) ----

/// After a row's verification: the next hops its timed runs take are cached, each by its
/// flow's first packet (the verification's for the row's own flow; a partner's is sent
/// here, as the row's first timed run would), and pass [`check_caches`].
fn check_caches_filled(bed: &mut Bed, empty: &EmptyProgram, case: &Case) -> Result<()> {
    if case.cached.is_empty() {
        return Ok(());
    }
    for partner in case.cached.iter().skip(1) {
        let run = bed.call(empty, case.prog, &partner.frame, &case.ctx, 1, None)?;
        check_verdict(case, &run)?;
    }
    check_caches(bed, empty, case, "after verification")?;
    eprintln!(
        "  verified {:>2} [{}]: cached next hop valid and taken (poisoned MAC out) by {}",
        case.meta.id,
        case.meta.state,
        case.cached
            .iter()
            .map(|f| f.name.as_str())
            .collect::<Vec<_>>()
            .join(" and ")
    );
    Ok(())
}

/// For each flow of `case.cached`, `when` (after verification, after a round): its next
/// hop is cached and valid now ([`cache_fault`]), holds what the FIB answers (the
/// destination's MAC, the flow's interface), and is what a packet of the flow takes
/// ([`poison_check`]).
fn check_caches(bed: &mut Bed, empty: &EmptyProgram, case: &Case, when: &str) -> Result<()> {
    let generation = bed.generation()?;
    for flow in &case.cached {
        let (nh, ifindex) = bed.next_hop(flow)?;
        if let Some(fault) = cache_fault(&nh, generation, ktime_ns()?, flow.frame.len()) {
            bail!(
                "{}: {when}, the cached next hop of {} is not valid ({fault}), so its packets \
                 take the FIB lookup: {NOT_TIMED}",
                case.label(),
                flow.name
            );
        }
        ensure!(
            nh.ifindex == ifindex && nh.dmac == DEST_MAC,
            "{}: {when}, {} has {} on interface {} cached, expected the destination's MAC {} \
             on the flow's interface {ifindex}",
            case.label(),
            flow.name,
            mac(nh.dmac),
            nh.ifindex,
            mac(DEST_MAC)
        );
        poison_check(bed, empty, case, flow, nh, when)?;
    }
    Ok(())
}

/// Why `nh`, a flow's cached next hop, would not carry the flow's `len`-byte frame at
/// `now` under the generation `generation`, judged as the datapath judges it
/// (`fib::cache_valid`; the frames are not GSO); `None` when it would.
fn cache_fault(nh: &NextHop, generation: u32, now: u64, len: usize) -> Option<String> {
    // Frame = MTU + Ethernet header + one VLAN tag (`fib::cache_valid`).
    const L2_ROOM: usize = 14 + 4;
    if nh.ifindex == 0 {
        Some("nothing is cached".to_owned())
    } else if nh.generation != conntrack::generation(generation) {
        Some(format!(
            "cached under generation {} (low 16 bits), NH_GEN is {generation}",
            nh.generation
        ))
    } else if !conntrack::fresh(nh.filled, now) {
        Some(format!(
            "cached {} ms ago, a cache lives {} ms",
            stamp_ms(conntrack::stamp(now).wrapping_sub(nh.filled)),
            NEXT_HOP_MAX_AGE_NS / 1_000_000
        ))
    } else if len > usize::from(nh.mtu) + L2_ROOM {
        Some(format!("the {len}-byte frame exceeds its MTU {}", nh.mtu))
    } else {
        None
    }
}

/// A packet of `flow` takes its valid cached next hop `nh`, not a FIB lookup: with
/// [`POISON_MAC`] as the cache's destination MAC (otherwise as valid: same generation,
/// stamped now), the packet leaves with that MAC, which no FIB lookup answers. `nh` is
/// put back after.
fn poison_check(
    bed: &mut Bed,
    empty: &EmptyProgram,
    case: &Case,
    flow: &CachedFlow,
    nh: NextHop,
    when: &str,
) -> Result<()> {
    let poisoned = NextHop {
        dmac: POISON_MAC,
        filled: conntrack::stamp(ktime_ns()?),
        ..nh
    };
    bed.set_next_hop(flow, poisoned)?;
    let mut out = vec![0u8; flow.frame.len() + 128];
    let run = bed.call(empty, case.prog, &flow.frame, &case.ctx, 1, Some(&mut out));
    bed.set_next_hop(flow, nh)?;
    check_verdict(case, &run?)?;
    let dmac = octets_at::<6>(&out, 0)?;
    ensure!(
        dmac == POISON_MAC,
        "{}: {when}, the packet of {} left with destination MAC {}, not the poisoned {} of \
         its valid cached next hop: it took a FIB lookup, {NOT_TIMED}",
        case.label(),
        flow.name,
        mac(dmac),
        mac(POISON_MAC)
    );
    Ok(())
}

/// Before a round: the stamps of the row's cached next hops renewed (outside the timed
/// calls), so that only a round longer than a cache's life could see one expire (1 s; a
/// quick round of row 4 takes about 20 ms, of 4v6 about 40 ms, a full one five times as
/// long; the time between two rounds of a row may come near a second). Returns the next
/// hops as written.
fn stamp_caches(bed: &mut Bed, case: &Case) -> Result<Vec<NextHop>> {
    let now = ktime_ns()?;
    let mut stamped = Vec::with_capacity(case.cached.len());
    for flow in &case.cached {
        let (nh, _) = bed.next_hop(flow)?;
        let nh = NextHop {
            filled: conntrack::stamp(now),
            ..nh
        };
        bed.set_next_hop(flow, nh)?;
        stamped.push(nh);
    }
    Ok(stamped)
}

/// After a round (started at `started`): every cached next hop is as [`stamp_caches`]
/// left it. A packet that found one invalid (expired, of another generation) took the
/// FIB lookup, which fills the cache again; and one still valid now, unchanged, was
/// valid for the whole round.
fn check_caches_kept(bed: &Bed, case: &Case, stamped: &[NextHop], started: Instant) -> Result<()> {
    for (flow, before) in case.cached.iter().zip(stamped) {
        let (nh, _) = bed.next_hop(flow)?;
        ensure!(
            nh == *before,
            "{}: the cached next hop of {} was filled again during the round (generation {} \
             when the round started, {} after; filled {} ms after the round's stamp; the round \
             took {} ms, a cache lives {} ms): a packet found it invalid and took the FIB \
             lookup, {NOT_TIMED}",
            case.label(),
            flow.name,
            before.generation,
            nh.generation,
            stamp_ms(nh.filled.wrapping_sub(before.filled)),
            started.elapsed().as_millis(),
            NEXT_HOP_MAX_AGE_NS / 1_000_000
        );
    }
    Ok(())
}

/// Milliseconds in `units` of [`NextHop::filled`] (2^20 ns each).
fn stamp_ms(units: u32) -> u64 {
    (u64::from(units) << conntrack::STAMP_SHIFT) / 1_000_000
}

/// Policy table sizes: (label, selected pods, the prefixes of each (indexes into
/// `PolicyRows::PREFIXES`), whether the IPv6 rows are measured too, on IPv6 tables of
/// the same shape).
const POLICY_SIZES: [(&str, u32, Range<usize>, bool); 4] = [
    // The single entry covers the tunnel destination.
    ("1 policy entry", 1, TUNNEL_PREFIX..TUNNEL_PREFIX + 1, true),
    ("10k entries (1k pods x 10)", 1_000, 0..10, false),
    ("100k entries (10k pods x 10)", 10_000, 0..10, true),
    ("1M entries (100k pods x 10)", 100_000, 0..10, false),
];

/// Every per-packet row, floors first. Runs in a private network namespace.
pub fn run(plan: Plan) -> Result<Vec<Timing>> {
    in_private_netns(move || {
        let net = topology()?;
        let empty = EmptyProgram::load()?;
        let mut out = Vec::new();
        for (label, pods, prefixes, v6) in POLICY_SIZES {
            let families = if v6 { "IPv4 and IPv6 tables" } else { "table" };
            eprintln!("per-packet: policy {families} with {label}");
            let mut bed = Bed::load(&net)?;
            let mut cases = floor_cases();
            cases.extend(policy_rows::<V4>(&mut bed, label, pods, prefixes.clone())?);
            if v6 {
                cases.extend(policy_rows::<V6>(&mut bed, label, pods, prefixes)?);
            }
            measure(&mut bed, &empty, &cases, &plan, &mut out)?;
        }

        eprintln!("per-packet: gateway with {CT_FLOWS} conntrack flows and one IPv6 flow");
        let mut bed = gateway_bed(&net, CT_FLOWS)?;
        gateway6(&mut bed, &net)?;
        let mut cases = floor_cases();
        cases.extend(ct_cases(format!(
            "{}k CT flows ({}k entries)",
            CT_FLOWS / 1000,
            CT_FLOWS / 500
        )));
        cases.extend(ct6_cases());
        measure(&mut bed, &empty, &cases, &plan, &mut out)?;
        drop(bed);
        ct_full(&net, &empty, &plan, &mut out)?;
        Ok(out)
    })
}

/// Only the gateway's rows with conntrack full (`egress-bench --scale`), floors included.
pub fn run_ct_full(plan: Plan) -> Result<Vec<Timing>> {
    in_private_netns(move || {
        let net = topology()?;
        let empty = EmptyProgram::load()?;
        let mut out = Vec::new();
        ct_full(&net, &empty, &plan, &mut out)?;
        Ok(out)
    })
}

/// Background flows that fill CT_V4 to its capacity next to the measured flows' four
/// entries (two flows and their partners, [`gateway_bed`]).
const CT_FULL_FLOWS: u32 = maps::CT_MAX_ENTRIES / 2 - 2;

/// The gateway's rows with CT_V4 at its full size (issue 15): the LRU map then evicts an
/// old flow for every entry a new flow creates, and new flows removed after a round are
/// replaced by fresh background flows, so every round starts full.
fn ct_full(net: &Net, empty: &EmptyProgram, plan: &Plan, out: &mut Vec<Timing>) -> Result<()> {
    eprintln!("per-packet: gateway with CT_V4 full ({CT_FULL_FLOWS} background flows)");
    let mut bed = gateway_bed(net, CT_FULL_FLOWS)?;
    bed.refill = Some(Refill {
        next: CT_FULL_FLOWS,
        ifindex: net.sec0,
    });
    let held = bed.ct_entries();
    let capacity = maps::CT_MAX_ENTRIES as usize;
    // A full LRU map may have evicted a few entries early (per-CPU free lists).
    ensure!(
        held * 100 >= capacity * 99,
        "CT_V4 holds {held} entries after filling, expected about {capacity}"
    );
    let mut cases = floor_cases();
    cases.extend(ct_cases(format!(
        "CT_V4 full: {} of {} entries",
        super::report::thousands(held as u64),
        super::report::thousands(capacity as u64)
    )));
    measure(&mut bed, empty, &cases, plan, out)?;
    let after = bed.ct_entries();
    ensure!(
        after * 100 >= capacity * 99,
        "CT_V4 held {after} entries after the rounds, expected about {capacity}: the rows \
         were not timed on a full table"
    );
    eprintln!("per-packet: CT_V4 held {held} entries before the rounds, {after} after");
    Ok(())
}

/// A gateway with `background` established flows in conntrack, the measured flows (an
/// established one and its partner, see the module docs), their pods' owners and
/// admissions, and the new-flow pod's.
fn gateway_bed(net: &Net, background: u32) -> Result<Bed> {
    let mut bed = Bed::load(net)?;
    bed.fill_ct(net.sec0, 0..background)?;
    for pod in [FLOW_POD, NEW_POD] {
        bed.pod_owner.insert(
            pod.octets(),
            PodOwnerValue {
                node: underlay::from_v4(PEER.octets()),
            },
            0,
        )?;
        let key = AdmittedKeyV4 {
            pod: pod.octets(),
            rule_id: RULE,
        };
        bed.admitted.insert(key, AdmittedValue::default(), 0)?;
    }
    // Partner flows: each established flow's translation is a flow that translates
    // back (see the module docs). Inserted last: the newest entries of a full LRU map.
    let now = ktime_ns()?;
    let sec0 = net.sec0;
    bed.ct_flow(
        FLOW_POD, FLOW_SPORT, DEST, DPORT, EGRESS, FLOW_EPORT, sec0, now,
    )?;
    bed.ct_flow(
        EGRESS, FLOW_EPORT, DEST, DPORT, FLOW_POD, FLOW_SPORT, sec0, now,
    )?;
    bed.pod_owner.insert(
        EGRESS.octets(),
        PodOwnerValue {
            node: underlay::from_v4(PEER.octets()),
        },
        0,
    )?;
    bed.egress_ips.insert(
        FLOW_POD.octets(),
        EgressIpValue {
            ifindex: sec0,
            flags: 0,
        },
        0,
    )?;
    Ok(bed)
}

/// The IPv6 rows' state on a gateway bed, as [`gateway_bed`] sets up IPv4 but without
/// background flows: the rule (egress IP `EGRESS6` on sec0), the flow's pod admitted,
/// and in CT_V6 the established flow `FLOW_POD6` -> `DEST6` translated to `EGRESS6` and
/// its partner (the translation, which translates back), each with its source's owner
/// (`PEER`) and its translation's egress IP. The map handles are dropped after filling
/// (the loaded programs hold the maps), but CT_V6's, which the bed keeps for the cache
/// checks.
fn gateway6(bed: &mut Bed, net: &Net) -> Result<()> {
    let ebpf = &mut bed.ebpf;
    let mut rules: HashMap<MapData, u32, RuleValueV6> = take(ebpf, maps::RULES_V6)?.try_into()?;
    let mut admitted: HashMap<MapData, AdmittedKeyV6, AdmittedValue> =
        take(ebpf, maps::ADMITTED_V6)?.try_into()?;
    let mut pod_owner: HashMap<MapData, [u8; 16], PodOwnerValue> =
        take(ebpf, maps::POD_OWNER_V6)?.try_into()?;
    let mut egress_ips: HashMap<MapData, [u8; 16], EgressIpValue> =
        take(ebpf, maps::EGRESS_IPS_V6)?.try_into()?;
    let mut ct: HashMap<MapData, CtKeyV6, CtEntryV6> = take(ebpf, maps::CT_V6)?.try_into()?;
    let rule = RuleValueV6 {
        egress_ip: EGRESS6.octets(),
        ifindex: net.sec0,
    };
    rules.insert(RULE, rule, 0)?;
    let key = AdmittedKeyV6 {
        pod: FLOW_POD6.octets(),
        rule_id: RULE,
    };
    admitted.insert(key, AdmittedValue::default(), 0)?;
    let now = ktime_ns()?;
    let flow = (FLOW_POD6, FLOW_SPORT);
    let xlate = (EGRESS6, FLOW_EPORT);
    for (src, x) in [(flow, xlate), (xlate, flow)] {
        for (key, entry) in flow_entries6(src, (DEST6, DPORT), x, net.sec0, now) {
            ct.insert(key, entry, 0)
                .with_context(|| format!("failed to insert the CT_V6 entries of {src:?}"))?;
        }
        let owner = PodOwnerValue {
            node: underlay::from_v4(PEER.octets()),
        };
        pod_owner.insert(src.0.octets(), owner, 0)?;
        let eip = EgressIpValue {
            ifindex: net.sec0,
            flags: 0,
        };
        egress_ips.insert(x.0.octets(), eip, 0)?;
    }
    bed.ct6 = Some(ct);
    Ok(())
}

/// Both CT_V6 entries (original, reply) of an established TCP flow `pod` -> `dst`
/// translated to `xlate`, of `RULE` out of `ifindex`, its pod on `PEER`, last seen at
/// `now`; no cached next hop (the first packet's FIB lookup fills it in).
fn flow_entries6(
    pod: (Ipv6Addr, u16),
    dst: (Ipv6Addr, u16),
    xlate: (Ipv6Addr, u16),
    ifindex: u32,
    now: u64,
) -> [(CtKeyV6, CtEntryV6); 2] {
    let entry = CtEntryV6 {
        xlate_addr: xlate.0.octets(),
        xlate_port_be: xlate.1.to_be(),
        state: state::ESTABLISHED,
        _pad0: 0,
        pod_node: underlay::from_v4(PEER.octets()),
        ifindex,
        rule_id: RULE,
        _pad1: 0,
        last_seen_ns: now,
        next_hop: Default::default(),
    };
    let back = CtEntryV6 {
        xlate_addr: pod.0.octets(),
        xlate_port_be: pod.1.to_be(),
        ..entry
    };
    [
        (ct_key6(pod, dst, dir::ORIGINAL), entry),
        (ct_key6(dst, xlate, dir::REPLY), back),
    ]
}

/// The CT_V6 key of TCP `src` -> `dst` in direction `dir`.
fn ct_key6(src: (Ipv6Addr, u16), dst: (Ipv6Addr, u16), dir: u8) -> CtKeyV6 {
    CtKeyV6 {
        src: src.0.octets(),
        dst: dst.0.octets(),
        src_port_be: src.1.to_be(),
        dst_port_be: dst.1.to_be(),
        proto: frame::PROTO_TCP,
        dir,
        _pad: [0; 2],
    }
}
