//! Owns the eBPF object, its pinned maps and its attachments (TCX links, or legacy tc
//! filters where the kernel has no TCX: [`hook`]); applies diffs of the desired state.
//! The only room that writes maps (the compiler never does; the agent's tasks write
//! through it: [`nexthop`], [`sweep`]).
//!
//! Everything is kept under one directory per agent (`--bpffs-dir`): maps by name, TCX
//! links as `link-<program>@<ifname>@<ifindex>`, tc filters recorded as
//! `tc-<program>@<ifname>@<ifindex>`. A restarted agent re-opens the same maps (traffic
//! keeps flowing on the old programs meanwhile), swaps its new programs into the existing
//! links or filters atomically, reads what the maps hold and removes only what is stale.

mod attach;
pub use attach::attach_elsewhere;
pub mod carry;
pub mod cleanup;
pub mod dump;
pub mod hook;
pub mod lock;
pub mod nexthop;
mod order;
pub mod remap;
pub mod render;
pub mod state;
pub mod sweep;
pub mod table;
pub mod tc;

use std::{
    collections::{BTreeMap, BTreeSet},
    fs,
    net::IpAddr,
    path::{Path, PathBuf},
};

use aya::{
    Ebpf, EbpfLoader,
    maps::{Array, MapData, MapError, MapInfo, MapType},
    programs::{ProgramError, SchedClassifier},
};
use egress_common::{
    config::Config,
    maps::{self as names, Map, def},
};
pub use hook::{AttachMode, Hook};
pub use state::{FamilyMaps, MapState};

use crate::{
    ebpf,
    family::{Family, V4, V6, family_maps},
};
use order::{FamilyMap, Phase, Step};
use table::{Hash, Lpm, Reader, Rows, Table, Value};

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("failed to load the eBPF object: {0}")]
    Load(#[from] aya::EbpfError),
    #[error("failed to open map {name}: {source}")]
    Map {
        name: &'static str,
        #[source]
        source: MapError,
    },
    #[error("failed to {verb} {what}: {source}")]
    Program {
        verb: &'static str,
        what: String,
        #[source]
        source: ProgramError,
    },
    #[error("failed to {verb} {path}: {source}")]
    Io {
        verb: &'static str,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("failed to {verb} {program} on {ifname}: {source}")]
    Tc {
        verb: &'static str,
        program: String,
        ifname: String,
        #[source]
        source: std::io::Error,
    },
    #[error(
        "failed to attach on {ifname}: its ingress priority {priority} holds {found}, which          is not ours: pick a free priority with --tc-priority (EGRESS_TC_PRIORITY)"
    )]
    Foreign {
        ifname: String,
        priority: u16,
        found: String,
    },
    #[error("{said} (refused {ago_s} s ago, not tried again yet)")]
    Refused { said: String, ago_s: u64 },
    #[error("map {name} is missing from the object")]
    MissingMap { name: &'static str },
    #[error(
        "no agent has run here (no maps under {}): start `egress-agent run`, or pass \
         --bpffs-dir",
        dir.display()
    )]
    NoAgent { dir: PathBuf },
}

pub type Result<T, E = Error> = std::result::Result<T, E>;

/// How long a program the kernel refused is not loaded again ([`Datapath::load_program`]):
/// a pass asks for it each time, and each try would run the verifier (most of a second).
pub const RELOAD_REFUSED: std::time::Duration = std::time::Duration::from_secs(60);

/// How many entries an `apply` changed, and which writes failed, per map (never logged
/// per entry: a full map would log one line per entry on every pass).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ApplyStats {
    pub inserted: usize,
    pub removed: usize,
    pub failed: usize,
    pub failures: BTreeMap<&'static str, MapFailures>,
}

/// The writes to one map that failed in one `apply`.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct MapFailures {
    pub inserts: usize,
    pub removals: usize,
    /// The first failure: the entry and the error.
    pub first: String,
    /// The map's capacity, when the failures are inserts into a full map.
    pub full_at: Option<usize>,
}

impl ApplyStats {
    pub fn changed(&self) -> usize {
        self.inserted + self.removed
    }

    /// One line per map with failed writes, saying what to do when the map is full.
    pub fn problems(&self) -> Vec<String> {
        self.failures
            .iter()
            .map(|(name, f)| {
                let what = match (f.inserts, f.removals) {
                    (i, 0) => format!("{i} entries not inserted"),
                    (0, r) => format!("{r} entries not removed"),
                    (i, r) => format!("{i} entries not inserted and {r} not removed"),
                };
                let full = f.full_at.map_or(String::new(), |cap| {
                    format!(
                        ": the map is full at {cap} entries ({})",
                        capacity_flag(name)
                    )
                });
                format!("map {name}: {what}{full}; first: {}", f.first)
            })
            .collect()
    }

    fn failed(&mut self, name: &'static str, insert: bool, entry: String, full_at: Option<usize>) {
        self.failed += 1;
        let f = self.failures.entry(name).or_default();
        if f.inserts + f.removals == 0 {
            f.first = entry;
        }
        if insert {
            f.inserts += 1;
        } else {
            f.removals += 1;
        }
        f.full_at = f.full_at.or(full_at);
    }
}

/// What sets map `name`'s capacity, and what to do when it is full: the limits table of
/// docs/operations.md says the same.
pub fn capacity_flag(name: &str) -> String {
    let family = name.trim_end_matches("_V4").trim_end_matches("_V6");
    match family {
        "POLICY" | "DESTS" => {
            "raise --policy-map-entries (both maps), or select fewer pods or prefixes".to_owned()
        }
        "CT" | "FLOWS" => "raise --conntrack-entries".to_owned(),
        "ADMITTED" => "new flows of the pods left out are dropped as DROP_NOT_ADMITTED: \
                       raise --admitted-entries, or serve fewer rules here"
            .to_owned(),
        "POD_OWNER" => "raise --pod-owner-entries (both maps)".to_owned(),
        _ => format!(
            "a build constant, {family}_MAX_ENTRIES in egress-common/src/maps.rs: \
             spread the load over more nodes"
        ),
    }
}

/// A TC attachment: which program on which interface.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Attachment {
    pub program: &'static str,
    pub ifname: String,
    pub ifindex: u32,
}

pub struct Datapath {
    ebpf: Ebpf,
    pin_dir: PathBuf,
    /// What the maps hold, as last read or written.
    held: MapState,
    attached: BTreeSet<Attachment>,
    /// Programs the kernel refused ([`Datapath::load_program`]): when, and what it said.
    refused: BTreeMap<&'static str, (std::time::Instant, String)>,
    /// TCX links or legacy tc filters ([`Datapath::set_hook`]; probed at open).
    hook: Hook,
}

/// The capacities an operator may set (the others are the object's).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Capacities {
    /// Entries of each policy map (`POLICY_V4`, `POLICY_V6`): (selected pods on the node)
    /// x (their prefixes); also the capacity of `DESTS_V4` / `_V6`, which hold at most one
    /// entry per policy entry.
    pub policy: u32,
    /// Entries of each conntrack map (`CT_V4`, `CT_V6`; two per flow), preallocated by the
    /// kernel whatever they hold; also the capacity of `FLOWS_V4` / `_V6` (one per pod
    /// with flows, so never more than conntrack's).
    pub conntrack: u32,
    /// Entries of each pod owner map (`POD_OWNER_V4`, `POD_OWNER_V6`): every running pod
    /// of the cluster on a gateway, the node's own elsewhere; preallocated by the kernel
    /// whatever they hold.
    pub pod_owner: u32,
    /// Entries of each admitted-pairs map (`ADMITTED_V4`, `ADMITTED_V6`): (selected pod,
    /// rule) pairs of the rules this node serves as a gateway; not preallocated, but its
    /// hash buckets are (8 bytes each).
    pub admitted: u32,
}

impl Default for Capacities {
    fn default() -> Self {
        Self {
            policy: names::POLICY_MAX_ENTRIES,
            conntrack: names::CT_MAX_ENTRIES,
            pod_owner: names::POD_OWNER_MAX_ENTRIES,
            admitted: names::ADMITTED_MAX_ENTRIES,
        }
    }
}

impl Capacities {
    /// The capacity this build gives map `name`, when an operator may change it.
    fn of(&self, name: &str) -> Option<u32> {
        match name {
            names::POLICY_V4 | names::POLICY_V6 | names::DESTS_V4 | names::DESTS_V6 => {
                Some(self.policy)
            }
            names::CT_V4 | names::CT_V6 | names::FLOWS_V4 | names::FLOWS_V6 => Some(self.conntrack),
            names::POD_OWNER_V4 | names::POD_OWNER_V6 => Some(self.pod_owner),
            names::ADMITTED_V4 | names::ADMITTED_V6 => Some(self.admitted),
            _ => None,
        }
    }
}

/// Unpin every map under `pin_dir` whose key or value size is not this build's (an agent
/// of another version left it): adopting it would feed the programs entries of another
/// layout. The loader then creates it afresh; the next pass refills it from cluster state
/// (a replaced conntrack map loses its flows, which is why this is logged as a warning).
/// The same for a map whose capacity the operator changed (`capacities`).
fn replace_foreign_pins(pin_dir: &Path, capacities: &Capacities) -> Result<()> {
    for spec in names::REGISTRY {
        let (name, key_size, value_size) = (spec.name, spec.key_size, spec.value_size);
        let path = pin_dir.join(name);
        if !path.exists() {
            continue;
        }
        let info = MapInfo::from_pin(&path).map_err(|source| Error::Map { name, source })?;
        if let Some(want) = capacities.of(name)
            && info.max_entries() != want
        {
            let then = match name {
                names::CT_V4 | names::CT_V6 => "its flows are carried over",
                names::FLOWS_V4 | names::FLOWS_V6 => {
                    "the conntrack sweeper's next walk recounts it"
                }
                _ => "the next pass refills it",
            };
            tracing::warn!(
                map = name,
                pinned = info.max_entries(),
                ours = want,
                then,
                "pinned map has another capacity: replacing it"
            );
            fs::remove_file(&path).map_err(|source| Error::Io {
                verb: "unpin the map of another capacity at",
                path: path.clone(),
                source,
            })?;
            continue;
        }
        let same_kind = info.map_type().is_ok_and(|t| t == map_type(spec.kind));
        if same_kind && (info.key_size(), info.value_size()) == (key_size, value_size) {
            continue;
        }
        tracing::warn!(
            map = name,
            path = %path.display(),
            pinned = %format!("{}/{}", info.key_size(), info.value_size()),
            ours = %format!("{key_size}/{value_size}"),
            kind = ?spec.kind,
            "pinned map has another layout (map type or key/value bytes): replacing it"
        );
        fs::remove_file(&path).map_err(|source| Error::Io {
            verb: "unpin the map of another layout at",
            path: path.clone(),
            source,
        })?;
    }
    Ok(())
}

/// The kernel map type of a registry entry.
fn map_type(kind: names::MapKind) -> MapType {
    use names::MapKind;
    match kind {
        MapKind::Hash => MapType::Hash,
        MapKind::Array => MapType::Array,
        MapKind::PerCpuArray => MapType::PerCpuArray,
        MapKind::LruHash => MapType::LruHash,
        MapKind::LruPerCpuHash => MapType::LruPerCpuHash,
        MapKind::LpmTrie => MapType::LpmTrie,
    }
}

impl Datapath {
    /// Load the programs, open or create the pinned maps under `pin_dir`, and read what
    /// they hold.
    pub fn open(pin_dir: &Path) -> Result<Self> {
        Self::open_with(pin_dir, &Capacities::default())
    }

    /// [`Datapath::open`] with the operator's map capacities.
    pub fn open_with(pin_dir: &Path, capacities: &Capacities) -> Result<Self> {
        Self::open_at(
            pin_dir,
            capacities,
            egress_common::config::DEFAULT_TUNNEL_PORT,
        )
    }

    /// [`Datapath::open_with`] for a tunnel on UDP port `tunnel_port`.
    pub fn open_at(pin_dir: &Path, capacities: &Capacities, tunnel_port: u16) -> Result<Self> {
        fs::create_dir_all(pin_dir).map_err(|source| Error::Io {
            verb: "create the pin directory",
            path: pin_dir.to_owned(),
            source,
        })?;
        // Before the conntrack maps of an earlier layout are replaced.
        let carried = carry::Carried::read(pin_dir, capacities).unwrap_or_else(|e| {
            tracing::warn!(
                "failed to read the earlier agent's conntrack: {e}: its flows start over"
            );
            carry::Carried::default()
        });
        replace_foreign_pins(pin_dir, capacities)?;
        let mut loader = EbpfLoader::new();
        loader.override_global(ebpf::TUNNEL_PORT, &tunnel_port, true);
        for name in names::names() {
            loader.map_pin_path(name, pin_dir.join(name));
            if let Some(entries) = capacities.of(name) {
                loader.map_max_entries(name, entries);
            }
        }
        let mut ebpf = loader.load(ebpf::OBJECT)?;
        if !carried.is_empty() {
            let read = carried.len();
            match carried.write(pin_dir) {
                Ok(n) => tracing::info!(
                    read,
                    written = n,
                    "conntrack of an earlier layout carried over into the new maps"
                ),
                Err(e) => tracing::warn!("failed to carry the earlier conntrack over: {e}"),
            }
        }
        if let Err(e) = aya_log::EbpfLogger::init(&mut ebpf) {
            tracing::debug!("no eBPF log channel: {e}");
        }
        let mut dp = Self {
            ebpf,
            pin_dir: pin_dir.to_owned(),
            held: MapState::default(),
            attached: BTreeSet::new(),
            refused: BTreeMap::new(),
            hook: Hook::resolve(AttachMode::Auto, tc::DEFAULT_PRIORITY).map_or(
                Hook::Tc {
                    priority: tc::DEFAULT_PRIORITY,
                },
                |(h, _)| h,
            ),
        };
        // An earlier agent attached `from_secondary` here (this node served): loaded now,
        // before the probes start. The first pass swaps it in, and a first pass that
        // waited for the verifier would hold this node's first hellos back past its
        // peers' detection time: a restarted holder would cut itself off.
        let served = attach::records(pin_dir).iter().any(|name| {
            hook::RecordName::parse(name).is_some_and(|r| r.program == ebpf::FROM_SECONDARY)
        });
        let at_open = ebpf::AT_OPEN.into_iter();
        for prog in at_open.chain(served.then_some(ebpf::FROM_SECONDARY)) {
            dp.load_program(prog)?;
        }
        dp.held = MapState::read(&mut dp)?;
        Ok(dp)
    }

    /// Load program `prog` into the kernel unless it is loaded already. The verifier's
    /// work is most of an agent's start (0.7-1 s of kernel CPU per program on this
    /// project's 2-core machine, docs/benchmarks.md), so only [`ebpf::AT_OPEN`] is loaded
    /// when the datapath opens (and `from_secondary` where an earlier agent attached it);
    /// `from_secondary` otherwise when this node may serve (the agent asks for it then,
    /// [`crate::agent`]) or when it is first attached. A refusal is kept
    /// for [`RELOAD_REFUSED`]: asked again meanwhile (each pass asks), it is returned
    /// without the verifier running again.
    pub fn load_program(&mut self, prog: &'static str) -> Result<()> {
        if let Some((at, said)) = self.refused.get(prog)
            && at.elapsed() < RELOAD_REFUSED
        {
            return Err(Error::Refused {
                said: said.clone(),
                ago_s: at.elapsed().as_secs(),
            });
        }
        let p: &mut SchedClassifier = self
            .ebpf
            .program_mut(prog)
            .ok_or(ProgramError::NotLoaded)
            .and_then(|p| p.try_into())
            .map_err(|source| Error::Program {
                verb: "find program",
                what: prog.into(),
                source,
            })?;
        if p.fd().is_ok() {
            return Ok(());
        }
        let started = std::time::Instant::now();
        match load_retrying(p) {
            Ok(()) => {
                self.refused.remove(prog);
                tracing::info!(
                    verify_ms = started.elapsed().as_millis(),
                    "loaded program {prog}"
                );
                Ok(())
            }
            Err(source) => {
                let e = Error::Program {
                    verb: "load program",
                    what: prog.into(),
                    source,
                };
                self.refused
                    .insert(prog, (std::time::Instant::now(), e.to_string()));
                Err(e)
            }
        }
    }

    /// Whether program `prog` is loaded in the kernel by this datapath.
    pub fn is_loaded(&self, prog: &str) -> bool {
        self.ebpf
            .program(prog)
            .and_then(|p| <&SchedClassifier>::try_from(p).ok())
            .is_some_and(|p| p.fd().is_ok())
    }

    /// What the maps hold now (as last read or written).
    pub fn held(&self) -> &MapState {
        &self.held
    }

    /// Is `name` an optional map that this object lacks? The IPv6 maps are optional: an
    /// object built before the IPv6 datapath has none, and the agent then syncs IPv4 only.
    fn skip_missing(&self, name: &'static str) -> bool {
        let optional = names::spec(name).is_some_and(|m| m.optional);
        let skip = optional && self.ebpf.map(name).is_none();
        if skip {
            tracing::debug!("map {name} is not in the eBPF object: not synced");
        }
        skip
    }

    fn map_data(&mut self, name: &'static str) -> Result<&mut aya::maps::Map> {
        self.ebpf.map_mut(name).ok_or(Error::MissingMap { name })
    }

    /// Write this node's configuration (programs pass everything until it is written).
    pub fn set_config(&mut self, cfg: &Config) -> Result<()> {
        let name = def::Config::SPEC.name;
        let mut a: Array<&mut MapData, <def::Config as Map>::Value> =
            Array::try_from(self.map_data(name)?).map_err(|source| Error::Map { name, source })?;
        a.set(0, cfg, 0)
            .map_err(|source| Error::Map { name, source })
    }

    pub fn config(&mut self) -> Result<Config> {
        let name = def::Config::SPEC.name;
        let a: Array<&mut MapData, <def::Config as Map>::Value> =
            Array::try_from(self.map_data(name)?).map_err(|source| Error::Map { name, source })?;
        a.get(&0, 0).map_err(|source| Error::Map { name, source })
    }

    /// Bring every map in line with `want`, touching only entries that differ: removals
    /// first, then additions and changes, each map in the order of [`order::sequence`].
    /// A failed entry is counted and logged; the rest still applies.
    pub fn apply(&mut self, want: &MapState) -> Result<ApplyStats> {
        let mut stats = ApplyStats::default();
        let mut held = std::mem::take(&mut self.held);
        let result = self.sync_all(&mut held, want, &mut stats);
        self.held = held;
        result?;
        Ok(stats)
    }

    /// Bring the pod-device maps alone (`POD_DEVICES_*`) in line with `bound` (pod ->
    /// its device): the bindings are decided by the devices step of a pass, after the other
    /// maps' apply. Touches only entries that differ, as [`Datapath::apply`] does.
    pub fn apply_pod_devices(
        &mut self,
        bound: &BTreeMap<IpAddr, egress_common::policy::PodDeviceValue>,
    ) -> Result<ApplyStats> {
        let mut stats = ApplyStats::default();
        let mut held = std::mem::take(&mut self.held);
        let want = (
            state::pod_devices::<V4>(bound),
            state::pod_devices::<V6>(bound),
        );
        let mut result = Ok(());
        for phase in Phase::ALL {
            let mut pass = Pass {
                phase,
                stats: &mut stats,
            };
            result = self
                .sync::<Hash<def::PodDevicesV4>>(&mut held.v4.pod_devices, &want.0, &mut pass)
                .and_then(|()| {
                    self.sync::<Hash<def::PodDevicesV6>>(
                        &mut held.v6.pod_devices,
                        &want.1,
                        &mut pass,
                    )
                });
            if result.is_err() {
                break;
            }
        }
        self.held = held;
        result?;
        Ok(stats)
    }

    /// Every step of [`order::sequence`], phase by phase; stops at the first map that
    /// cannot be opened.
    fn sync_all(
        &mut self,
        held: &mut MapState,
        want: &MapState,
        stats: &mut ApplyStats,
    ) -> Result<()> {
        for phase in Phase::ALL {
            let mut pass = Pass {
                phase,
                stats: &mut *stats,
            };
            for (_, step) in order::sequence(phase) {
                self.sync_step(step, held, want, &mut pass)?;
            }
        }
        Ok(())
    }

    /// One step of an apply: one map.
    fn sync_step(
        &mut self,
        step: Step,
        held: &mut MapState,
        want: &MapState,
        pass: &mut Pass<'_>,
    ) -> Result<()> {
        match step {
            Step::Nodes => self.sync::<Hash<def::Nodes>>(&mut held.nodes, &want.nodes, pass),
            Step::PortFilters => self.sync::<Hash<def::PortFilters>>(
                &mut held.port_filters,
                &want.port_filters,
                pass,
            ),
            Step::V4(map) => self.sync_family_map(map, &mut held.v4, &want.v4, pass),
            Step::V6(map) => self.sync_family_map(map, &mut held.v6, &want.v6, pass),
        }
    }

    /// One map of family `F`.
    fn sync_family_map<F: Family>(
        &mut self,
        map: FamilyMap,
        h: &mut FamilyMaps<F>,
        w: &FamilyMaps<F>,
        pass: &mut Pass<'_>,
    ) -> Result<()> {
        if map == FamilyMap::Selected && pass.phase == Phase::Remove {
            // A pod that becomes incomplete is marked before its policy entries go (later
            // in this phase, `order.rs`): never selected, unmarked and without its
            // entries, when its packets would pass untranslated.
            let marked = newly_incomplete::<F>(&h.selected, &w.selected);
            if !marked.is_empty() {
                let mut early = Pass {
                    phase: Phase::Upsert,
                    stats: &mut *pass.stats,
                };
                self.sync::<Hash<F::Selected>>(&mut h.selected, &marked, &mut early)?;
            }
        }
        macro_rules! sync_one {
            ($(
                $(#[$doc:meta])*
                $Map:ident $field:ident $kind:ident [$v4:ident $v6:ident] [$($bound:tt)*],
            )*) => {
                match map {
                    $( FamilyMap::$Map => {
                        self.sync::<$kind<F::$Map>>(&mut h.$field, &w.$field, pass)
                    } )*
                }
            };
        }
        family_maps!(sync_one)
    }

    /// One phase of bringing table `T` from `held` to `want` (nothing when an older
    /// object lacks its map).
    fn sync<T: Table>(
        &mut self,
        held: &mut BTreeMap<T::At, Value<T>>,
        want: &BTreeMap<T::At, Value<T>>,
        pass: &mut Pass<'_>,
    ) -> Result<()> {
        let name = T::Map::SPEC.name;
        if self.skip_missing(name) {
            return Ok(());
        }
        let mut h = T::open(self.map_data(name)?).map_err(|source| Error::Map { name, source })?;
        sync(name, held, want, pass, |at, v| T::write(&mut h, at, v));
        Ok(())
    }

    /// Put back what vanished from the pin directory behind this agent's back (someone
    /// removed the files, or ran `cleanup` around the lock): the maps this process still
    /// holds are pinned again, and attachments whose link pin is gone (the link detached
    /// with it) are forgotten, so that the next [`Datapath::sync_attachments`] attaches
    /// them afresh. Returns what it restored, in words (empty when nothing was missing).
    pub fn restore_pins(&mut self) -> Result<Vec<String>> {
        let mut restored = Vec::new();
        if !self.pin_dir.is_dir() {
            fs::create_dir_all(&self.pin_dir).map_err(|source| Error::Io {
                verb: "create the pin directory",
                path: self.pin_dir.clone(),
                source,
            })?;
            restored.push(format!("pin directory {}", self.pin_dir.display()));
        }
        let mut maps = Vec::new();
        for name in names::names() {
            let path = self.pin_dir.join(name);
            let Some(map) = self.ebpf.map(name) else {
                continue;
            };
            if path.exists() {
                continue;
            }
            map.pin(&path).map_err(|e| Error::Io {
                verb: "pin the map again at",
                path,
                source: std::io::Error::other(e.to_string()),
            })?;
            maps.push(name);
        }
        if !maps.is_empty() {
            restored.push(format!("map pins {}", maps.join(", ")));
        }
        let gone: Vec<Attachment> = self
            .attached
            .iter()
            .filter(|a| !self.pin_dir.join(self.record_name(a)).exists())
            .cloned()
            .collect();
        for a in &gone {
            self.attached.remove(a);
            restored.push(format!("{} on {} (attached again)", a.program, a.ifname));
        }
        Ok(restored)
    }
}

/// One phase of an apply, with the counts of the whole apply.
struct Pass<'a> {
    phase: Phase,
    stats: &'a mut ApplyStats,
}

/// The open datapath reads the maps it loaded.
impl Reader for Datapath {
    type Error = Error;

    /// Every entry of table `T` (none when an older object lacks its map).
    fn read<T: Table>(&mut self) -> Result<Rows<T>> {
        let name = T::Map::SPEC.name;
        if self.skip_missing(name) {
            return Ok(BTreeMap::new());
        }
        let h = T::open(self.map_data(name)?).map_err(|source| Error::Map { name, source })?;
        Ok(T::read(&h))
    }
}

/// Load `p`, again when the verifier gave up with `EAGAIN`: a transient refusal, not a
/// verdict on the program. The verifier gives up so whenever the loading thread has a
/// signal pending (a child's `SIGCHLD` in a busy process: CI once saw five tries in a row
/// refused), so each try runs with this thread's signals blocked (they go to another
/// thread, or wait the few milliseconds until the mask is restored), and the tries are
/// spaced out.
pub fn load_retrying(p: &mut SchedClassifier) -> Result<(), ProgramError> {
    const TRIES: u32 = 5;
    let mut tries = 1;
    loop {
        match with_signals_blocked(|| p.load()) {
            Err(ProgramError::LoadError { io_error, .. })
                if io_error.raw_os_error() == Some(libc::EAGAIN) && tries < TRIES =>
            {
                tracing::debug!(
                    "the verifier returned EAGAIN (try {tries} of {TRIES}): loading again"
                );
                std::thread::sleep(std::time::Duration::from_millis(20 * u64::from(tries)));
                tries += 1;
            }
            other => return other,
        }
    }
}

/// Run `f` with every blockable signal blocked in this thread; the earlier mask is
/// restored afterwards, also if `f` panics.
fn with_signals_blocked<T>(f: impl FnOnce() -> T) -> T {
    struct Restore(libc::sigset_t);
    impl Drop for Restore {
        fn drop(&mut self) {
            // SAFETY: a valid mask saved by `pthread_sigmask` below.
            unsafe { libc::pthread_sigmask(libc::SIG_SETMASK, &self.0, std::ptr::null_mut()) };
        }
    }
    // SAFETY: plain C structs, filled by `sigfillset` and `pthread_sigmask` before use.
    let mut all: libc::sigset_t = unsafe { std::mem::zeroed() };
    let mut old: libc::sigset_t = unsafe { std::mem::zeroed() };
    // SAFETY: valid pointers to the two sets above.
    unsafe {
        libc::sigfillset(&mut all);
        libc::pthread_sigmask(libc::SIG_BLOCK, &all, &mut old);
    }
    let _restore = Restore(old);
    f()
}

/// Whether a map write failed because the map is full (E2BIG from a hash, ENOSPC from an
/// LPM trie).
fn is_full(e: &MapError) -> bool {
    matches!(e, MapError::SyscallError(s) if matches!(s.io_error.raw_os_error(), Some(libc::E2BIG | libc::ENOSPC)))
}

/// The `SELECTED_*` entries that `want` marks incomplete and `held` holds unmarked: written
/// in the remove phase, before the pods' policy entries are removed.
fn newly_incomplete<F: Family>(
    held: &BTreeMap<F::Octets, <F::Selected as Map>::Value>,
    want: &BTreeMap<F::Octets, <F::Selected as Map>::Value>,
) -> BTreeMap<F::Octets, <F::Selected as Map>::Value> {
    want.iter()
        .filter(|(k, v)| F::incomplete(v) && held.get(*k).is_some_and(|o| !F::incomplete(o)))
        .map(|(k, v)| (*k, *v))
        .collect()
}

/// One phase of a map diff: `held` tracks what the map holds after each write;
/// `write(k, Some(v))` inserts, `write(k, None)` removes.
fn sync<K: Ord + Copy + std::fmt::Debug, V: PartialEq + Copy>(
    name: &'static str,
    held: &mut BTreeMap<K, V>,
    want: &BTreeMap<K, V>,
    pass: &mut Pass<'_>,
    mut write: impl FnMut(&K, Option<&V>) -> Result<(), MapError>,
) {
    let stats = &mut *pass.stats;
    match pass.phase {
        Phase::Remove => {
            let stale: Vec<K> = state::differences(held, want)
                .0
                .into_iter()
                .copied()
                .collect();
            for k in stale {
                match write(&k, None) {
                    Ok(()) | Err(MapError::KeyNotFound) => {
                        held.remove(&k);
                        stats.removed += 1;
                    }
                    Err(e) => stats.failed(name, false, format!("remove {k:?}: {e}"), None),
                }
            }
        }
        Phase::Upsert => {
            let changed: Vec<(K, V)> = state::differences(held, want)
                .1
                .into_iter()
                .map(|(k, v)| (*k, *v))
                .collect();
            for (k, v) in &changed {
                match write(k, Some(v)) {
                    Ok(()) => {
                        held.insert(*k, *v);
                        stats.inserted += 1;
                    }
                    Err(e) => {
                        let full = is_full(&e).then_some(held.len());
                        stats.failed(name, true, format!("insert {k:?}: {e}"), full);
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use egress_common::policy::{SelectedValueV4, selected_flags};

    use super::*;
    use crate::family::V4;

    #[test]
    fn only_pods_turning_incomplete_are_marked_early() {
        let v = |lengths: u64, flags: u32| SelectedValueV4 {
            lengths,
            entries: u32::from(flags == 0),
            flags,
        };
        let (stays, turns, was, new) = ([10, 0, 0, 1], [10, 0, 0, 2], [10, 0, 0, 3], [10, 0, 0, 4]);
        let held = BTreeMap::from([
            (stays, v(1 << 24, 0)),
            (turns, v(1 << 24, 0)),
            (was, v(0, selected_flags::INCOMPLETE)),
        ]);
        let want = BTreeMap::from([
            (stays, v(1 << 25, 0)),
            (turns, v(0, selected_flags::INCOMPLETE)),
            (was, v(0, selected_flags::INCOMPLETE)),
            (new, v(0, selected_flags::INCOMPLETE)),
        ]);
        // A new incomplete pod was never selected unmarked: the upsert phase adds it.
        let early = newly_incomplete::<V4>(&held, &want);
        assert_eq!(early.keys().copied().collect::<Vec<_>>(), [turns]);
    }
}
