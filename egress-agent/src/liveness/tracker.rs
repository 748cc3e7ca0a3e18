//! What one agent knows of its peers' liveness: a pure state machine fed with hellos and
//! the clock (passed in, never read), giving the [`PeerView`] the compiler elects with.
//!
//! The rules (documented for users in docs/failover.md):
//!
//! * **Direct**: a peer is heard directly if one of its hellos arrived within the
//!   detection time (`interval x misses`).
//! * **Alive**: heard directly, or listed in the `seen` of a peer heard directly (SWIM's
//!   indirect probe, one hop only: `seen` carries direct observations, never relayed
//!   ones). Two gateways that cannot reach each other but both reach the workers stay
//!   alive to each other, so neither takes the other's egress IPs.
//! * **Dead**: a watched gateway that is not alive, once the warm-up (one detection time
//!   and one interval after start) is over.
//! * **Cut off**: a gateway that hears fewer than a majority of the agents it expects (those
//!   on Ready nodes with an EgressNode, itself included; on a tie, the side with the
//!   smallest node name wins) counts itself dead: it holds nothing, so a holder whose
//!   underlay is cut gives its egress IPs up within the detection time, as its peers take
//!   them over.
//! * **Speakers only**: during a rolling upgrade some agents are older than the hello
//!   protocol, or speak a version this one cannot decode. A peer is judged by its hellos
//!   only once it speaks them: its EgressNode says so (`helloVersion`), or this agent
//!   has taken a hello of it since it started. Any other peer is never declared dead for
//!   its silence and does not count for the quorum: the API judges it (its Node's Ready
//!   condition), as on a node without probes. So an upgrade moves no egress IP.
//! * **Replays**: within an incarnation a hello's sequence number must grow; an
//!   incarnation the sender has left is not taken again; and under a key, a hello whose
//!   wall clock is off by more than `hello::MAX_SKEW` is refused (`service.rs`).

use std::{
    collections::{BTreeMap, BTreeSet},
    net::IpAddr,
    time::{Duration, Instant},
};

use bytes::BytesMut;

use super::{
    hello::{self, Claim, Fixed, Hello, HelloRef, Parts, flags},
    keys::Keyring,
};
use crate::family::conntrack::Remap;

/// Probe settings.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Settings {
    /// Time between two hellos to one peer.
    pub interval: Duration,
    /// Hellos missed in a row before a peer counts as unheard.
    pub misses: u32,
    /// How long peers count this node alive after its agent stops for a restart
    /// (SIGTERM; its pinned datapath keeps forwarding while the agent is away). An agent
    /// killed without a word (SIGKILL, power loss) gets no grace. Zero: none.
    pub restart_grace: Duration,
}

impl Default for Settings {
    fn default() -> Self {
        Self {
            interval: Duration::from_millis(100),
            misses: 3,
            restart_grace: Duration::from_secs(15),
        }
    }
}

impl Settings {
    /// How long after its last hello a peer stops being heard directly.
    pub fn detection(&self) -> Duration {
        self.interval * self.misses
    }

    /// How recently a gateway must have heard a majority not to fence itself: one interval
    /// less than the detection time, so that a cut-off holder lets its addresses go
    /// before its peers take them over.
    pub fn fence_window(&self) -> Duration {
        self.detection()
            .saturating_sub(self.interval)
            .max(self.interval)
    }

    /// How recently a hello of this node must have reached a peer (as the peer's echo
    /// shows) for the peer to count toward this node's quorum: half an interval less than
    /// the detection time after which that peer declares this node dead, and never less
    /// than two and a half intervals (the oldest echo of a healthy exchange is about two
    /// intervals old).
    pub fn echo_window(&self) -> Duration {
        self.detection()
            .saturating_sub(self.interval / 2)
            .max(self.interval * 5 / 2)
    }

    /// No peer is declared dead, and this node not cut off, before this much time after
    /// start: every live peer has had time to be heard.
    pub fn warm_up(&self) -> Duration {
        self.detection() + self.interval
    }
}

/// What a node says of itself in its hellos.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Report {
    /// It hears too few peers and holds nothing.
    pub cut_off: bool,
    /// Its interfaces that are down (fresher than its EgressNode).
    pub down: BTreeSet<String>,
    /// The egress IPs it holds, with their epochs.
    pub claims: BTreeMap<IpAddr, Claim>,
}

/// The liveness input of the compiler. The default (nobody dead, no reports) is what a
/// node without probes sees: the EgressNodes and the Node conditions decide alone.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PeerView {
    /// Gateways that are not alive (this node too, when it is cut off).
    pub dead: BTreeSet<String>,
    /// The latest report of every node heard since this agent started (dead ones
    /// included: their last claims carry the epochs a new holder must exceed), and of
    /// this node itself.
    pub reports: BTreeMap<String, Report>,
    /// The newest claim ever heard of each egress IP, (node, epoch), released ones
    /// included: a new holder's epoch exceeds it, and its reason names why that node
    /// let go.
    pub last_claims: BTreeMap<IpAddr, (String, u64)>,
}

/// Who the agent probes and counts, set after every reconcile.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Membership {
    /// Every node with an underlay address (where its hellos go).
    pub nodes: BTreeMap<String, IpAddr>,
    /// Other addresses a node's hellos may come from (its Node's other addresses, when
    /// its routes pick one of those as the source); hellos from anywhere else are refused.
    pub aliases: BTreeMap<String, BTreeSet<IpAddr>>,
    /// Nodes that some policy may use as a gateway: watched for liveness.
    pub gateways: BTreeSet<String>,
    /// Agents whose hellos count for the quorum (Ready nodes with an EgressNode).
    pub expected: BTreeSet<String>,
    /// Agents whose EgressNode says they speak hello version 2 or later: judged by their
    /// hellos from the start (see "Speakers only" above).
    pub speakers: BTreeSet<String>,
}

/// A peer's liveness as `egress-agent status` and the EgressNode show it.
#[derive(Clone, Debug, PartialEq)]
pub struct PeerStatus {
    pub name: String,
    pub alive: bool,
    /// Heard directly (else only through others, or not at all).
    pub direct: bool,
    /// Since its last hello.
    pub last_heard: Option<Duration>,
    pub rtt: Option<Duration>,
}

/// Why a hello was refused.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum Refused {
    #[error("hello from {from} names unknown node {name:?}")]
    UnknownNode { name: String, from: IpAddr },
    #[error("hello naming node {name} came from {from}, not its underlay address {want}")]
    WrongAddress {
        name: String,
        from: IpAddr,
        want: IpAddr,
    },
    #[error("hello names this node ({0}) as its sender")]
    FromMyself(String),
    #[error("stale hello from {name} (sequence {seq}, last {last})")]
    Stale { name: String, seq: u64, last: u64 },
    #[error("replayed hello from {name} (incarnation {incarnation:#x}, which it has left)")]
    Replayed { name: String, incarnation: u32 },
    #[error("hello from {name} was for node {to}, not this one")]
    NotForMe { name: String, to: String },
    #[error("hello from {name}: {error}")]
    Malformed { name: String, error: hello::Error },
}

impl Refused {
    /// The reason label of the refusal counter.
    pub fn reason(&self) -> &'static str {
        match self {
            Refused::UnknownNode { .. } => "unknown_node",
            Refused::WrongAddress { .. } => "wrong_address",
            Refused::FromMyself(_) => "from_myself",
            Refused::Malformed { .. } => "malformed",
            Refused::Stale { .. } | Refused::Replayed { .. } | Refused::NotForMe { .. } => {
                "replayed"
            }
        }
    }
}

/// Incarnations of a peer remembered as left, so that their hellos are not taken again.
const RETIRED: usize = 16;

/// A change the tracker noticed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Transition {
    /// A watched gateway died; `silent_for` is the time since it was last heard (the
    /// detection time actually taken).
    Died {
        name: String,
        silent_for: Duration,
    },
    Revived {
        name: String,
    },
    /// This gateway hears fewer than a majority: why, as counted then.
    CutOff(Quorum),
    Reconnected,
}

/// How a gateway counted its quorum, said when it cuts itself off: which of the peers it
/// expects were missing, and whether its own hellos had stopped (a stall of this agent,
/// not of the network, shows as a late last hello). It keeps serving while `counted` is
/// more than half of `expected`, or exactly half with the smallest expected name on its
/// side ([`has_quorum`]): of two halves, exactly one serves.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Quorum {
    /// The agents expected, this node included.
    pub expected: usize,
    /// Those it counts: heard within the fence window, echoing a recent hello of this
    /// node; itself included.
    pub counted: usize,
    /// Expected peers not heard within the fence window.
    pub unheard: usize,
    /// Expected peers heard, whose latest hello echoes none of this node's recent ones.
    pub not_echoing: usize,
    /// Since this node last sent its hellos (`None`: never).
    pub sent_ago: Option<Duration>,
}

struct Peer {
    incarnation: u32,
    /// Incarnations it has left, newest last (at most [`RETIRED`]).
    retired: Vec<u32>,
    /// The hello version it sent last.
    version: u8,
    seq: u64,
    last_heard: Instant,
    hello: Hello,
    /// Its seen, down and claims as they came, encoded: a hello that repeats them is
    /// taken without decoding them (see [`Tracker::on_received`]).
    lists: [Vec<u8>; 3],
    rtt: Option<Duration>,
    /// Its `sent_us` and when it arrived, echoed in our next hello to it.
    echo: (u64, Instant),
}

pub struct Tracker {
    me: String,
    settings: Settings,
    started: Instant,
    incarnation: u32,
    seq: u64,
    members: Membership,
    /// Whom to send hellos to, from `members` (see [`Tracker::targets`]).
    targets: Vec<(String, IpAddr)>,
    local: Report,
    peers: BTreeMap<String, Peer>,
    last_dead: BTreeSet<String>,
    last_cut_off: bool,
    /// When this node last heard a majority again after being cut off: the views of its
    /// peers it holds then are from before the heal (see [`Tracker::warm_at`]).
    rejoined: Option<Instant>,
    last_claims: BTreeMap<IpAddr, (String, u64)>,
    /// Since when each peer has said it speaks hellos (see [`Tracker::set_members_at`]).
    speakers_since: BTreeMap<String, Instant>,
    /// Unsigned version-1 hellos of older peers under a key ([`Tracker::echo_only`]):
    /// their `sent_us` and arrival, only to echo.
    echo_only: BTreeMap<String, (u64, Instant)>,
    /// Set by the farewell: every later hello says so too, so that one the probe loop
    /// sends between the farewell and the process's exit does not take the restart's
    /// grace back at the peers (which keep the latest hello's flags).
    leaving: bool,
    /// Counts the changes to what [`Tracker::view`] reads, but the clock: a hello that
    /// changes its sender's lists or flags, the membership, this node's own report, a
    /// claim remembered.
    changes: u64,
    /// `changes` and the clock's verdicts ([`Tracker::clock_verdicts`]) as of the last
    /// [`Tracker::observe_changed`] that gave a view: with both the same, so is the view.
    observed: Option<(u64, Vec<u8>)>,
    /// The verdicts of the current call, kept for their room (no allocation per call).
    verdicts: Vec<u8>,
    /// When this node last wrote its hellos.
    last_sent: Option<Instant>,
}

impl Tracker {
    pub fn new(me: &str, settings: Settings, incarnation: u32, now: Instant) -> Self {
        Self {
            me: me.to_owned(),
            settings,
            started: now,
            incarnation,
            seq: 0,
            members: Membership::default(),
            targets: Vec::new(),
            local: Report::default(),
            peers: BTreeMap::new(),
            last_dead: BTreeSet::new(),
            last_cut_off: false,
            rejoined: None,
            last_claims: BTreeMap::new(),
            speakers_since: BTreeMap::new(),
            echo_only: BTreeMap::new(),
            leaving: false,
            changes: 0,
            observed: None,
            verdicts: Vec::new(),
            last_sent: None,
        }
    }

    pub fn settings(&self) -> Settings {
        self.settings
    }

    /// When the warm-up ends: every live peer has been heard by then. It starts at the
    /// agent's start, and again when this node hears a majority after being cut off: at a
    /// heal, what it last heard of its peers is from before (a peer that was cut off too
    /// still says so, or is not heard yet), and two gateways healing in the same
    /// millisecond would each take what the other is taking. Nothing is taken until the
    /// peers' hellos from after the heal have arrived.
    pub fn warm_at(&self) -> Instant {
        self.rejoined.unwrap_or(self.started).max(self.started) + self.settings.warm_up()
    }

    /// Set who the peers are, as known at the agent's start.
    pub fn set_members(&mut self, members: Membership) {
        self.set_members_at(members, self.started);
    }

    /// Set who the peers are at `now`: a peer that says it speaks hellos from now on is
    /// judged by them once a warm-up has passed since (time for its first hellos to
    /// arrive: an upgraded agent's EgressNode may reach this node before its hellos do).
    /// A peer that stops saying so (rolled back to an older agent) is forgotten until it
    /// is heard again: under a key its unsigned hellos never will be, and the API judges
    /// it.
    pub fn set_members_at(&mut self, members: Membership, now: Instant) {
        self.changes += 1;
        let left: Vec<String> = self
            .speakers_since
            .keys()
            .filter(|n| !members.speakers.contains(*n))
            .cloned()
            .collect();
        for n in &left {
            self.speakers_since.remove(n);
            self.peers.remove(n);
        }
        for n in &members.speakers {
            self.speakers_since.entry(n.clone()).or_insert(now);
        }
        let gateway = members.gateways.contains(&self.me);
        self.targets = members
            .nodes
            .iter()
            .filter(|(n, _)| **n != self.me && (gateway || members.gateways.contains(*n)))
            .map(|(n, a)| (n.clone(), *a))
            .collect();
        self.members = members;
    }

    /// This node's own report (its down interfaces and the IPs it holds); `cut_off` is the
    /// tracker's to set.
    pub fn set_local(&mut self, down: BTreeSet<String>, claims: BTreeMap<IpAddr, Claim>) {
        self.changes += 1;
        remember(&mut self.last_claims, &self.me, &claims);
        self.local.down = down;
        self.local.claims = claims;
    }

    pub fn local(&self) -> &Report {
        &self.local
    }

    /// Whom to send hellos to: a gateway probes every node (so that it can count its
    /// quorum and every node hears it), any other node only the gateways.
    /// Whether some policy may use `name` as a gateway.
    pub fn is_gateway(&self, name: &str) -> bool {
        self.members.gateways.contains(name)
    }

    pub fn targets(&self) -> &[(String, IpAddr)] {
        &self.targets
    }

    /// The hello version to send `to`: the newest if its EgressNode or its own hellos say
    /// it speaks it, else version 1, which the agents before version 2 decode (so that an
    /// older holder still hears this one during a rollout and keeps its quorum).
    pub fn version_for(&self, to: &str) -> u8 {
        let peer = self.peers.get(to).map(|p| p.version);
        if self.members.speakers.contains(to) || peer == Some(super::hello::VERSION) {
            super::hello::VERSION
        } else {
            peer.unwrap_or(1)
        }
    }

    /// Whether `name`'s hellos judge it at `now`: it speaks them (see "Speakers only").
    fn judged_by_hellos(&self, name: &str, now: Instant) -> bool {
        self.peers.contains_key(name)
            || self
                .speakers_since
                .get(name)
                .is_some_and(|t| now.saturating_duration_since(*t) >= self.settings.warm_up())
    }

    fn micros(&self, now: Instant) -> u64 {
        u64::try_from(now.saturating_duration_since(self.started).as_micros())
            .unwrap_or(u64::MAX)
            .max(1)
    }

    /// Take a hello from `from` (its source address) at `now`. Returns whether it may
    /// change the view (a peer heard again, or a report that differs from its last one).
    pub fn on_hello(&mut self, h: Hello, from: IpAddr, now: Instant) -> Result<bool, Refused> {
        self.on_hello_version(h, super::hello::VERSION, from, now)
    }

    /// [`Tracker::on_hello`] for a hello that came in `version`: later hellos to the
    /// sender go out in the version it speaks.
    pub fn on_hello_version(
        &mut self,
        h: Hello,
        version: u8,
        from: IpAddr,
        now: Instant,
    ) -> Result<bool, Refused> {
        let from = from.to_canonical();
        self.admit(&h, from)?;
        self.changes += 1;
        let mine = self.micros(now);
        let rtt = (h.echo_us != 0 && h.echo_us <= mine).then(|| {
            Duration::from_micros((mine - h.echo_us).saturating_sub(u64::from(h.echo_held_us)))
        });
        remember(&mut self.last_claims, &h.name, &h.claims);
        let prev = self.peers.get(&h.name);
        let prev_rtt = prev.and_then(|p| p.rtt);
        let mut retired = prev.map(|p| p.retired.clone()).unwrap_or_default();
        if let Some(p) = prev
            && p.incarnation != h.incarnation
        {
            retired.push(p.incarnation);
            if retired.len() > RETIRED {
                retired.remove(0);
            }
        }
        let changed = prev.is_none_or(|p| {
            !self.direct(p, now)
                || p.hello.flags != h.flags
                || p.hello.seen != h.seen
                || p.hello.down != h.down
                || p.hello.claims != h.claims
        });
        self.peers.insert(
            h.name.clone(),
            Peer {
                incarnation: h.incarnation,
                retired,
                version,
                seq: h.seq,
                last_heard: now,
                echo: (h.sent_us, now),
                rtt: rtt.or(prev_rtt),
                hello: h,
                lists: Default::default(),
            },
        );
        Ok(changed)
    }

    /// Why a hello from `from` is not taken, if it is not: from this node itself, for
    /// another, from a node not in the cluster or not at its address, older than the last
    /// one of its incarnation, or of an incarnation retired.
    fn admit(&self, h: &Hello, from: IpAddr) -> Result<(), Refused> {
        self.admit_parts(&h.name, &h.to, &h.fixed(), from)
    }

    /// [`Tracker::admit`] of a hello's `sender`, addressee and fixed fields.
    fn admit_parts(&self, sender: &str, to: &str, h: &Fixed, from: IpAddr) -> Result<(), Refused> {
        let name = || sender.to_owned();
        if sender == self.me {
            return Err(Refused::FromMyself(name()));
        }
        if !to.is_empty() && to != self.me {
            return Err(Refused::NotForMe {
                name: name(),
                to: to.to_owned(),
            });
        }
        let Some(want) = self.members.nodes.get(sender) else {
            return Err(Refused::UnknownNode { name: name(), from });
        };
        let alias = self
            .members
            .aliases
            .get(sender)
            .is_some_and(|a| a.contains(&from));
        if *want != from && !alias {
            return Err(Refused::WrongAddress {
                name: name(),
                from,
                want: *want,
            });
        }
        let Some(p) = self.peers.get(sender) else {
            return Ok(());
        };
        if p.incarnation == h.incarnation && h.seq <= p.seq {
            return Err(Refused::Stale {
                name: name(),
                seq: h.seq,
                last: p.seq,
            });
        }
        if p.retired.contains(&h.incarnation) {
            return Err(Refused::Replayed {
                name: name(),
                incarnation: h.incarnation,
            });
        }
        Ok(())
    }

    /// Take a hello as it arrived (see [`Tracker::on_hello_version`]). One whose lists
    /// (seen, down, claims) are byte for byte those of its sender's last hello, in the
    /// same version, incarnation and flags, only moves that peer's clocks: nothing is
    /// decoded or allocated, as for almost every hello; any other is decoded (refused
    /// whole if a list does not decode) and taken as a new report.
    pub fn on_received(
        &mut self,
        h: &HelloRef<'_>,
        from: IpAddr,
        now: Instant,
    ) -> Result<bool, Refused> {
        let from = from.to_canonical();
        self.admit_parts(h.name, h.to, &h.fixed, from)?;
        if let Some(changed) = self.repeated(h, now) {
            return Ok(changed);
        }
        let hello = h.to_hello().map_err(|error| Refused::Malformed {
            name: h.name.to_owned(),
            error,
        })?;
        let changed = self.on_hello_version(hello, h.version, from, now)?;
        if let Some(p) = self.peers.get_mut(h.name) {
            for (kept, got) in p.lists.iter_mut().zip(h.lists) {
                kept.clear();
                kept.extend_from_slice(got);
            }
        }
        Ok(changed)
    }

    /// A hello (admitted) that repeats its sender's last lists, taken: whether it may
    /// change the view (the peer heard again). `None`: it does not repeat them.
    fn repeated(&mut self, h: &HelloRef<'_>, now: Instant) -> Option<bool> {
        let p = self.peers.get(h.name)?;
        let same = p.incarnation == h.fixed.incarnation
            && p.version == h.version
            && p.hello.flags == h.fixed.flags
            && p.hello.to == h.to
            && p.lists.iter().zip(h.lists).all(|(kept, got)| kept == got);
        if !same {
            return None;
        }
        let changed = !self.direct(p, now);
        let mine = self.micros(now);
        let f = h.fixed;
        let rtt = (f.echo_us != 0 && f.echo_us <= mine).then(|| {
            Duration::from_micros((mine - f.echo_us).saturating_sub(u64::from(f.echo_held_us)))
        });
        let p = self.peers.get_mut(h.name)?;
        p.seq = f.seq;
        p.last_heard = now;
        p.echo = (f.sent_us, now);
        p.rtt = rtt.or(p.rtt);
        p.hello.set_fixed(f);
        if remember(&mut self.last_claims, h.name, &p.hello.claims) {
            self.changes += 1;
        }
        Some(changed)
    }

    /// An unsigned version-1 hello under a key, from an agent older than version 2 (its
    /// EgressNode says no `helloVersion`): refused as evidence of anything (it could be
    /// forged), but echoed in the hellos this node sends it, so that the older agent,
    /// which counts its quorum by echoes, does not fence itself while its peers are
    /// upgraded. Ignored for a peer that speaks version 2 or from a wrong address.
    pub fn echo_only(&mut self, h: &Hello, from: IpAddr, now: Instant) {
        let from = from.to_canonical();
        if self.members.speakers.contains(&h.name) || self.members.nodes.get(&h.name) != Some(&from)
        {
            return;
        }
        self.echo_only.insert(h.name.clone(), (h.sent_us, now));
    }

    /// The last hello to `to` before this agent stops for a restart: the same, flagged.
    pub fn farewell_for(&mut self, to: &str, now: Instant) -> Hello {
        self.leaving = true;
        self.hello_for(to, now)
    }

    /// The next hello to `to`.
    pub fn hello_for(&mut self, to: &str, now: Instant) -> Hello {
        let fixed = self.next_fixed(to, now);
        let mut h = Hello {
            name: self.me.clone(),
            to: to.to_owned(),
            seen: self.heard_gateways(now).map(str::to_owned).collect(),
            down: self.local.down.clone(),
            claims: self.claims_to_send().clone(),
            remaps: Vec::new(),
            ..Hello::default()
        };
        h.set_fixed(fixed);
        h
    }

    /// Append the next hello to every target to `out`, in the version each speaks, with
    /// as many of `remaps` as fit in those to gateways (version 2); `unix_ms` is the wall
    /// clock to stamp. Writes into `out`'s buffers, which keep their room from one call
    /// to the next: once they have grown, a hello costs no allocation. Returns the most
    /// remaps one hello carried.
    pub fn write_hellos(
        &mut self,
        now: Instant,
        unix_ms: u64,
        (keys, remaps): (&Keyring, &[Remap]),
        out: &mut Outbox,
    ) -> usize {
        out.clear();
        // The gateways heard directly (every hello's `seen`), judged once for all.
        out.seen.extend(
            self.members
                .gateways
                .iter()
                .map(|g| self.heard_directly(g, now)),
        );
        let targets = std::mem::take(&mut self.targets);
        if !targets.is_empty() {
            self.last_sent = Some(now);
        }
        let mut most = 0;
        for (to, ip) in &targets {
            let version = self.version_for(to);
            let mut fixed = self.next_fixed(to, now);
            fixed.sent_unix_ms = unix_ms;
            let mut parts = Parts {
                fixed,
                name: &self.me,
                to,
                seen: self
                    .members
                    .gateways
                    .iter()
                    .zip(&out.seen)
                    .filter(|(_, heard)| **heard)
                    .map(|(g, _)| g.as_str()),
                down: &self.local.down,
                claims: self.claims_to_send(),
                remaps: &[],
            };
            let start = out.bytes.len();
            if let Err(e) = parts.write(version, keys, &mut out.bytes) {
                out.failed.push(e);
                continue;
            }
            // Remaps go to gateways (which may take an egress IP over), in what room the
            // hello leaves.
            if version >= 2 && !remaps.is_empty() && self.members.gateways.contains(to) {
                let room = hello::MAX_LEN - (out.bytes.len() - start);
                let n = fitting(remaps, room);
                if n > 0 {
                    parts.remaps = &remaps[..n];
                    out.bytes.truncate(start);
                    if let Err(e) = parts.write(version, keys, &mut out.bytes) {
                        out.failed.push(e);
                        continue;
                    }
                    most = most.max(n);
                }
            }
            out.hellos.push((*ip, start..out.bytes.len()));
        }
        self.targets = targets;
        most
    }

    /// The fixed fields of the next hello to `to` (its sequence number taken).
    fn next_fixed(&mut self, to: &str, now: Instant) -> Fixed {
        self.seq += 1;
        let held = |(sent_us, at): (u64, Instant)| {
            (
                sent_us,
                u32::try_from(now.saturating_duration_since(at).as_micros()).unwrap_or(u32::MAX),
            )
        };
        let detection = self.settings.detection();
        let (echo_us, echo_held_us) = match self.peers.get(to) {
            Some(p) if self.direct(p, now) => held(p.echo),
            _ => match self.echo_only.get(to) {
                Some(e) if now.saturating_duration_since(e.1) < detection => held(*e),
                _ => (0, 0),
            },
        };
        let grace = u16::try_from(self.settings.restart_grace.as_secs()).unwrap_or(u16::MAX);
        let restarting = self.leaving && grace > 0;
        let mut hello_flags = if self.last_cut_off { flags::CUT_OFF } else { 0 };
        if restarting {
            hello_flags |= flags::RESTARTING;
        }
        Fixed {
            flags: hello_flags,
            grace_s: if restarting { grace } else { 0 },
            incarnation: self.incarnation,
            seq: self.seq,
            sent_us: self.micros(now),
            echo_us,
            echo_held_us,
            // The service stamps its wall clock (the tracker reads no clock).
            sent_unix_ms: 0,
        }
    }

    /// The egress IPs this node says it holds: none while it is cut off.
    fn claims_to_send(&self) -> &BTreeMap<IpAddr, Claim> {
        static NONE: BTreeMap<IpAddr, Claim> = BTreeMap::new();
        if self.last_cut_off {
            &NONE
        } else {
            &self.local.claims
        }
    }

    fn direct(&self, p: &Peer, now: Instant) -> bool {
        self.heard_within(p, now, self.settings.detection())
    }

    /// Heard within `window` (or, for a peer whose agent is restarting, its grace).
    fn heard_within(&self, p: &Peer, now: Instant, window: Duration) -> bool {
        let window = if p.hello.flags & flags::RESTARTING != 0 {
            Duration::from_secs(p.hello.grace_s.into()).max(window)
        } else {
            window
        };
        now.saturating_duration_since(p.last_heard) < window
    }

    fn heard(&self, now: Instant) -> BTreeSet<&str> {
        self.peers
            .iter()
            .filter(|(_, p)| self.direct(p, now))
            .map(|(n, _)| n.as_str())
            .collect()
    }

    /// The peers heard within the fence window that hear this node too (for the quorum):
    /// a one-way path (a route on this node that sends its hellos elsewhere, a filter on
    /// one direction) must not count, or a holder whose hellos no longer reach its peers
    /// keeps its addresses while they take them over.
    fn heard_for_quorum(&self, now: Instant) -> BTreeSet<&str> {
        self.peers
            .iter()
            .filter(|(_, p)| self.counts_for_quorum(p, now))
            .map(|(n, _)| n.as_str())
            .collect()
    }

    /// Whether `p` counts toward this node's quorum: heard within the fence window, and
    /// hearing this node ([`Tracker::hears_me`]).
    fn counts_for_quorum(&self, p: &Peer, now: Instant) -> bool {
        self.heard_within(p, now, self.settings.fence_window()) && self.hears_me(p, now)
    }

    /// Whether `p`'s latest hello echoes one of this node's hellos sent within the echo
    /// window: `p` heard this node recently. A peer stops echoing one detection time
    /// after it last heard this node, and declares it dead then; the echo window ends
    /// half an interval before, so a node whose hellos stop arriving fences itself first.
    /// A restarting peer (in its grace) is not echoing anyone and counts as before.
    fn hears_me(&self, p: &Peer, now: Instant) -> bool {
        if p.hello.flags & flags::RESTARTING != 0 {
            return true;
        }
        let mine = self.micros(now);
        let echo = p.hello.echo_us;
        let window = u64::try_from(self.settings.echo_window().as_micros()).unwrap_or(u64::MAX);
        echo != 0 && echo <= mine && mine - echo < window
    }

    /// Whether the peer `name` is heard directly.
    fn heard_directly(&self, name: &str, now: Instant) -> bool {
        self.peers.get(name).is_some_and(|p| self.direct(p, now))
    }

    /// The gateways heard directly, by name.
    fn heard_gateways(&self, now: Instant) -> impl Iterator<Item = &str> + Clone {
        self.members
            .gateways
            .iter()
            .filter(move |g| self.heard_directly(g, now))
            .map(String::as_str)
    }

    fn warm(&self, now: Instant) -> bool {
        now.saturating_duration_since(self.started) >= self.settings.warm_up()
    }

    fn alive(&self, name: &str, heard: &BTreeSet<&str>) -> bool {
        heard.contains(name)
            || heard.iter().any(|p| {
                self.peers
                    .get(*p)
                    .is_some_and(|peer| peer.hello.seen.contains(name))
            })
    }

    /// The agents this node's quorum counts: those on Ready nodes with an EgressNode that
    /// are judged by their hellos.
    fn expected(&self, now: Instant) -> BTreeSet<String> {
        self.members
            .expected
            .iter()
            .filter(|n| self.judged_by_hellos(n, now))
            .cloned()
            .collect()
    }

    fn cut_off(&self, now: Instant) -> bool {
        self.members.gateways.contains(&self.me)
            && !has_quorum(&self.me, &self.heard_for_quorum(now), &self.expected(now))
    }

    /// How the quorum counts at `now` (see [`Quorum`]).
    pub fn quorum(&self, now: Instant) -> Quorum {
        let fence = self.settings.fence_window();
        let mut q = Quorum {
            expected: 1,
            counted: 1,
            sent_ago: self.last_sent.map(|t| now.saturating_duration_since(t)),
            ..Quorum::default()
        };
        for name in self.expected(now).iter().filter(|n| **n != self.me) {
            q.expected += 1;
            match self.peers.get(name) {
                Some(p) if self.counts_for_quorum(p, now) => q.counted += 1,
                Some(p) if self.heard_within(p, now, fence) => q.not_echoing += 1,
                _ => q.unheard += 1,
            }
        }
        q
    }

    /// A peer whose latest hello says it is cut off holds nothing and counts as dead.
    fn says_cut_off(&self, name: &str) -> bool {
        self.peers
            .get(name)
            .is_some_and(|p| p.hello.flags & flags::CUT_OFF != 0)
    }

    /// The view at `now`, without noting transitions.
    pub fn view(&self, now: Instant) -> PeerView {
        let heard = self.heard(now);
        let warm = self.warm(now);
        let cut_off = warm && self.cut_off(now);
        let mut dead: BTreeSet<String> = if warm {
            self.members
                .gateways
                .iter()
                .filter(|g| {
                    **g != self.me
                        && self.judged_by_hellos(g, now)
                        && (!self.alive(g, &heard) || self.says_cut_off(g))
                })
                .cloned()
                .collect()
        } else {
            BTreeSet::new()
        };
        if cut_off {
            dead.insert(self.me.clone());
        }
        let mut reports: BTreeMap<String, Report> = self
            .peers
            .iter()
            .map(|(n, p)| {
                (
                    n.clone(),
                    Report {
                        cut_off: p.hello.flags & flags::CUT_OFF != 0,
                        down: p.hello.down.clone(),
                        claims: p.hello.claims.clone(),
                    },
                )
            })
            .collect();
        let mut local = self.local.clone();
        local.cut_off = cut_off;
        reports.insert(self.me.clone(), local);
        PeerView {
            dead,
            reports,
            last_claims: self.last_claims.clone(),
        }
    }

    /// Every verdict of the clock that [`Tracker::view`] reads, in a fixed order, into
    /// `out`: whether the warm-up is over; for each peer, whether it is heard directly and
    /// whether it counts for the quorum; for each speaker, whether its own warm-up is over.
    /// Between two calls with the same [`Tracker::changes`] the view differs only if one
    /// of these does.
    fn clock_verdicts(&self, now: Instant, out: &mut Vec<u8>) {
        out.clear();
        out.push(u8::from(self.warm(now)));
        out.extend(self.peers.values().map(|p| {
            u8::from(self.direct(p, now)) | u8::from(self.counts_for_quorum(p, now)) << 1
        }));
        let warm_up = self.settings.warm_up();
        out.extend(
            self.speakers_since
                .values()
                .map(|t| u8::from(now.saturating_duration_since(*t) >= warm_up)),
        );
    }

    /// [`Tracker::observe`], or `None` when nothing the view reads has changed since the
    /// last call that gave one: the view would be that one, and nothing would be noted.
    /// Then it costs no allocation and no view (the hellos thread asks every interval: at
    /// 100 nodes a gateway's view is a hundred names and reports).
    pub fn observe_changed(&mut self, now: Instant) -> Option<(PeerView, Vec<Transition>)> {
        let mut verdicts = std::mem::take(&mut self.verdicts);
        self.clock_verdicts(now, &mut verdicts);
        let same = self
            .observed
            .as_ref()
            .is_some_and(|(changes, last)| *changes == self.changes && *last == verdicts);
        if same {
            self.verdicts = verdicts;
            return None;
        }
        let out = self.observed_now(now);
        let last = self.observed.get_or_insert_with(|| (0, Vec::new()));
        last.0 = self.changes;
        std::mem::swap(&mut last.1, &mut verdicts);
        self.verdicts = verdicts;
        Some(out)
    }

    /// The view at `now`, and what changed since the last call.
    pub fn observe(&mut self, now: Instant) -> (PeerView, Vec<Transition>) {
        self.observe_changed(now)
            .unwrap_or_else(|| (self.view(now), Vec::new()))
    }

    /// The view at `now`, and what changed since the last view noted.
    fn observed_now(&mut self, now: Instant) -> (PeerView, Vec<Transition>) {
        let view = self.view(now);
        let mut out = Vec::new();
        let cut_off = view.dead.contains(&self.me);
        if cut_off != self.last_cut_off {
            out.push(if cut_off {
                Transition::CutOff(self.quorum(now))
            } else {
                self.rejoined = Some(now);
                Transition::Reconnected
            });
        }
        for name in view.dead.difference(&self.last_dead) {
            if *name == self.me {
                continue;
            }
            let silent_for = self.peers.get(name).map_or(self.settings.detection(), |p| {
                now.saturating_duration_since(p.last_heard)
            });
            out.push(Transition::Died {
                name: name.clone(),
                silent_for,
            });
        }
        for name in self.last_dead.difference(&view.dead) {
            if *name != self.me {
                out.push(Transition::Revived { name: name.clone() });
            }
        }
        self.last_dead = view.dead.clone();
        self.last_cut_off = cut_off;
        (view, out)
    }

    /// Every peer this node probes or watches, for status pages.
    pub fn status(&self, now: Instant) -> Vec<PeerStatus> {
        let heard = self.heard(now);
        let warm = self.warm(now);
        let mut names: BTreeSet<String> = self.targets.iter().map(|(n, _)| n.clone()).collect();
        names.extend(
            self.members
                .gateways
                .iter()
                .filter(|g| **g != self.me)
                .cloned(),
        );
        names
            .into_iter()
            .map(|name| {
                let p = self.peers.get(&name);
                PeerStatus {
                    alive: !warm || !self.judged_by_hellos(&name, now) || self.alive(&name, &heard),
                    direct: heard.contains(name.as_str()),
                    last_heard: p.map(|p| now.saturating_duration_since(p.last_heard)),
                    rtt: p.and_then(|p| p.rtt),
                    name,
                }
            })
            .collect()
    }
}

/// Hellos written for sending, back to back in one buffer (see [`Tracker::write_hellos`]).
#[derive(Debug, Default)]
pub struct Outbox {
    pub bytes: BytesMut,
    /// Each hello's destination and bytes.
    pub hellos: Vec<(IpAddr, std::ops::Range<usize>)>,
    /// Hellos that could not be written (too large).
    pub failed: Vec<hello::Error>,
    /// Whether each gateway (in the membership's order) is heard directly.
    seen: Vec<bool>,
}

impl Outbox {
    fn clear(&mut self) {
        self.bytes.clear();
        self.hellos.clear();
        self.failed.clear();
        self.seen.clear();
    }
}

/// How many of `remaps`, from the first, fit in `room` bytes with the record's overhead.
fn fitting(remaps: &[Remap], room: usize) -> usize {
    let mut left = room.saturating_sub(hello::REMAPS_OVERHEAD);
    remaps
        .iter()
        .take_while(|r| {
            let n = hello::remap_len(r);
            let fits = n <= left;
            left = left.saturating_sub(n);
            fits
        })
        .count()
}

/// Note `node`'s claims where they are at least as new as what was heard before; whether
/// that changed what is remembered.
fn remember(
    last: &mut BTreeMap<IpAddr, (String, u64)>,
    node: &str,
    claims: &BTreeMap<IpAddr, Claim>,
) -> bool {
    let mut changed = false;
    for (ip, c) in claims {
        match last.get(ip) {
            Some((_, e)) if *e > c.epoch => {}
            Some((n, e)) if n == node && *e == c.epoch => {}
            _ => {
                last.insert(*ip, (node.to_owned(), c.epoch));
                changed = true;
            }
        }
    }
    changed
}

/// Whether `me`, hearing `heard` directly, sees a strict majority of `expected` plus
/// itself; on an exact tie, the side holding the smallest name wins. With nobody
/// expected, a node is its own majority.
pub fn has_quorum(me: &str, heard: &BTreeSet<&str>, expected: &BTreeSet<String>) -> bool {
    let others: BTreeSet<&str> = expected
        .iter()
        .map(String::as_str)
        .filter(|n| *n != me)
        .collect();
    let total = others.len() + 1;
    let side = others.iter().filter(|n| heard.contains(*n)).count() + 1;
    if 2 * side != total {
        return 2 * side > total;
    }
    let smallest = others.iter().copied().chain([me]).min().unwrap_or(me);
    smallest == me || heard.contains(smallest)
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use std::net::SocketAddr;

    use super::*;

    const NODES: [(&str, &str); 4] = [
        ("gw1", "10.0.0.1"),
        ("gw2", "10.0.0.2"),
        ("w1", "10.0.0.11"),
        ("w2", "10.0.0.12"),
    ];

    fn members() -> Membership {
        Membership {
            nodes: NODES
                .iter()
                .map(|(n, a)| ((*n).to_owned(), a.parse().expect("ip")))
                .collect(),
            aliases: BTreeMap::new(),
            gateways: ["gw1".to_owned(), "gw2".to_owned()].into(),
            expected: NODES.iter().map(|(n, _)| (*n).to_owned()).collect(),
            speakers: NODES.iter().map(|(n, _)| (*n).to_owned()).collect(),
        }
    }

    fn addr(name: &str) -> IpAddr {
        NODES
            .iter()
            .find(|(n, _)| *n == name)
            .expect("node")
            .1
            .parse()
            .expect("ip")
    }

    /// Trackers of the four lab nodes, started at `t0`.
    struct Cluster {
        t0: Instant,
        trackers: BTreeMap<&'static str, Tracker>,
        /// Each tracker's last view given by `observe_changed`.
        views: BTreeMap<&'static str, PeerView>,
    }

    impl Cluster {
        fn new() -> Self {
            Self::new_at(Instant::now())
        }

        fn new_at(t0: Instant) -> Self {
            let trackers = NODES
                .iter()
                .enumerate()
                .map(|(i, (n, _))| {
                    let mut t = Tracker::new(n, Settings::default(), i as u32 + 1, t0);
                    t.set_members(members());
                    (*n, t)
                })
                .collect();
            Self {
                t0,
                trackers,
                views: BTreeMap::new(),
            }
        }

        /// Run hellos every interval from `from_ms` to `to_ms`; `link(a, b)` says whether a
        /// hello from a reaches b.
        fn run(&mut self, from_ms: u64, to_ms: u64, link: impl Fn(&str, &str) -> bool) {
            let mut t = from_ms;
            while t < to_ms {
                let now = self.t0 + Duration::from_millis(t);
                // As the agents send and take them: written into an outbox, read in
                // place.
                let mut sent = Vec::new();
                let mut out = Outbox::default();
                for (name, tr) in &mut self.trackers {
                    tr.write_hellos(now, 0, (&Keyring::default(), &[]), &mut out);
                    assert!(out.failed.is_empty(), "{:?}", out.failed);
                    for (ip, range) in &out.hellos {
                        let to = NODES.iter().find(|(_, a)| *a == ip.to_string());
                        let to = to.expect("a node").0;
                        sent.push((*name, to, out.bytes[range.clone()].to_vec()));
                    }
                }
                for (from, to, b) in sent {
                    if link(from, to)
                        && let Some(tr) = self.trackers.get_mut(to)
                    {
                        let h = HelloRef::parse(&b, &Keyring::default()).expect("parsed");
                        tr.on_received(&h, addr(from), now).expect("accepted");
                    }
                }
                for (name, tr) in &mut self.trackers {
                    // A view not given again is the last one given.
                    match tr.observe_changed(now) {
                        Some((view, _)) => {
                            self.views.insert(name, view);
                        }
                        None => assert_eq!(Some(&tr.view(now)), self.views.get(name), "{name}"),
                    }
                }
                t += 100;
            }
        }

        fn dead(&self, node: &str, at_ms: u64) -> BTreeSet<String> {
            self.trackers[node]
                .view(self.t0 + Duration::from_millis(at_ms))
                .dead
        }
    }

    fn set(names: &[&str]) -> BTreeSet<String> {
        names.iter().map(|n| (*n).to_owned()).collect()
    }

    #[test]
    fn everyone_alive_when_every_hello_arrives() {
        let mut c = Cluster::new();
        c.run(0, 2000, |_, _| true);
        for n in ["gw1", "gw2", "w1", "w2"] {
            assert_eq!(c.dead(n, 2000), set(&[]), "{n}");
        }
    }

    #[test]
    fn nobody_is_dead_during_the_warm_up() {
        let c = Cluster::new();
        assert_eq!(c.dead("w1", 300), set(&[]));
        assert_eq!(c.dead("w1", 500), set(&["gw1", "gw2"]));
    }

    #[test]
    fn a_silent_gateway_is_dead_to_everyone_within_detection_plus_one_interval() {
        let mut c = Cluster::new();
        c.run(0, 1000, |_, _| true);
        c.run(1000, 1500, |from, _| from != "gw1");
        // Last hello from gw1 at 900 ms; direct views expire at 1200, relayed ones by 1300.
        for n in ["gw2", "w1", "w2"] {
            assert_eq!(c.dead(n, 1500), set(&["gw1"]), "{n}");
        }
    }

    #[test]
    fn a_holder_whose_underlay_is_cut_counts_itself_dead_as_its_peers_do() {
        let mut c = Cluster::new();
        let a: IpAddr = "192.168.101.50".parse().expect("ip");
        let claim = Claim {
            interface: "sec-a".into(),
            epoch: 1,
        };
        let gw1 = c.trackers.get_mut("gw1").expect("gw1");
        gw1.set_local(BTreeSet::new(), BTreeMap::from([(a, claim)]));
        c.run(0, 1000, |_, _| true);
        assert_eq!(
            c.trackers["w1"]
                .view(c.t0 + Duration::from_millis(1000))
                .reports["gw1"]
                .claims
                .len(),
            1
        );
        let cut = |a: &str, b: &str| a != "gw1" && b != "gw1";
        c.run(1000, 1200, cut);
        // Last exchange at 900 ms: gw1 fences itself at 1100, one interval before its
        // peers declare it dead (1200).
        assert!(
            c.dead("gw1", 1150).contains("gw1"),
            "gw1 must fence itself first"
        );
        let q = c.trackers["gw1"].quorum(c.t0 + Duration::from_millis(1150));
        assert_eq!((q.counted, q.unheard, q.not_echoing), (1, 3, 0), "{q:?}");
        assert_eq!(
            q.sent_ago,
            Some(Duration::from_millis(50)),
            "it still sends"
        );
        assert_eq!(c.dead("w1", 1150), set(&[]), "its peers have not moved yet");
        c.run(1200, 1500, cut);
        assert!(c.dead("gw1", 1500).contains("gw1"), "gw1 must fence itself");
        let t = c.t0 + Duration::from_millis(1500);
        let gw1 = c.trackers.get_mut("gw1").expect("gw1");
        assert!(
            gw1.hello_for("gw2", t).claims.is_empty(),
            "a cut-off node claims nothing"
        );
        assert!(gw1.hello_for("gw2", t).flags & flags::CUT_OFF != 0);
        for n in ["gw2", "w1", "w2"] {
            assert_eq!(c.dead(n, 1500), set(&["gw1"]), "{n}");
        }
    }

    #[test]
    fn a_holder_whose_hellos_stop_arriving_fences_itself_before_its_peers_move() {
        let mut c = Cluster::new();
        c.run(0, 1000, |_, _| true);
        // gw1 still hears everyone, but its own hellos go astray (a route on gw1 that
        // sends them out of another interface): its peers last hear it at 900 ms and
        // declare it dead at 1200; its echoes say so first.
        let one_way = |from: &str, _: &str| from != "gw1";
        c.run(1000, 1200, one_way);
        assert!(
            c.dead("gw1", 1150).contains("gw1"),
            "gw1 must fence itself while it still hears a majority one way"
        );
        // Its account says why: it hears all three, none echoes it.
        let q = c.trackers["gw1"].quorum(c.t0 + Duration::from_millis(1150));
        assert_eq!(
            (q.expected, q.counted, q.unheard, q.not_echoing),
            (4, 1, 0, 3),
            "{q:?}"
        );
        assert_eq!(c.dead("w1", 1150), set(&[]), "its peers have not moved yet");
        c.run(1200, 2000, one_way);
        assert!(c.dead("gw1", 2000).contains("gw1"));
        assert_eq!(c.dead("gw2", 2000), set(&["gw1"]));
        // Two-way again: gw1 is back.
        c.run(2000, 3000, |_, _| true);
        assert_eq!(c.dead("gw1", 3000), set(&[]));
    }

    #[test]
    fn hellos_that_only_leave_the_gateways_give_no_quorum_to_either_on_their_own() {
        let mut c = Cluster::new();
        c.run(0, 1000, |_, _| true);
        // The probe: both gateways route the workers' addresses out of their
        // secondary network, and cannot reach each other either; the workers' hellos
        // still arrive. Counting those one-way hellos gave each gateway a majority, and
        // each took the other's addresses.
        let astray = |from: &str, _: &str| !from.starts_with("gw");
        c.run(1000, 3000, astray);
        for g in ["gw1", "gw2"] {
            assert!(c.dead(g, 3000).contains(g), "{g} must fence itself");
        }
    }

    #[test]
    fn gateways_healing_together_take_nothing_before_they_have_heard_each_other_again() {
        let mut c = Cluster::new();
        c.run(0, 1000, |_, _| true);
        let started_warm = c.trackers["gw1"].warm_at();
        assert_eq!(started_warm, c.t0 + Settings::default().warm_up());
        // Both gateways fence themselves (the heal), then heal in the same
        // interval: each first hears the workers, while its last hello of the other
        // gateway still says "cut off".
        c.run(1000, 3000, |from: &str, _: &str| !from.starts_with("gw"));
        c.run(3000, 3200, |_, _| true);
        let healed = c.t0 + Duration::from_millis(3000);
        for g in ["gw1", "gw2"] {
            let t = &c.trackers[g];
            assert!(!c.dead(g, 3100).contains(g), "{g} hears a majority again");
            assert!(
                t.warm_at() >= healed + Settings::default().warm_up(),
                "{g} must wait one warm-up after the heal before it takes anything"
            );
        }
        // By the end of that wait each hears the other, alive and not cut off: both
        // elect from the same view.
        c.run(3200, 3600, |_, _| true);
        for g in ["gw1", "gw2"] {
            assert_eq!(c.dead(g, 3500), set(&[]), "{g}");
        }
    }

    #[test]
    fn gateways_that_cannot_reach_each_other_stay_alive_through_the_workers() {
        let mut c = Cluster::new();
        c.run(0, 1000, |_, _| true);
        let partition = |a: &str, b: &str| !(a.starts_with("gw") && b.starts_with("gw"));
        c.run(1000, 3000, partition);
        for n in ["gw1", "gw2", "w1", "w2"] {
            assert_eq!(c.dead(n, 3000), set(&[]), "{n}");
        }
    }

    #[test]
    fn a_restarting_agent_stays_alive_for_the_grace_but_a_killed_one_does_not() {
        let mut c = Cluster::new();
        c.run(0, 1000, |_, _| true);
        let t = c.t0 + Duration::from_millis(1000);
        let bye: Vec<(String, Hello)> = {
            let gw1 = c.trackers.get_mut("gw1").expect("gw1");
            gw1.targets()
                .to_vec()
                .into_iter()
                .map(|(to, _)| (to.clone(), gw1.farewell_for(&to, t)))
                .collect()
        };
        for (to, h) in bye {
            if let Some(tr) = c.trackers.get_mut(to.as_str()) {
                tr.on_hello(h, addr("gw1"), t).expect("accepted");
            }
        }
        c.run(1000, 5000, |from, _| from != "gw1");
        assert_eq!(c.dead("w1", 5000), set(&[]), "restarting: alive");
        c.run(5000, 16_500, |from, _| from != "gw1");
        assert_eq!(c.dead("w1", 16_500), set(&["gw1"]), "the grace has an end");
    }

    /// The probe loop may still send a hello between the farewell and the process's
    /// exit: it must keep the grace (the peers keep the latest hello's flags).
    #[test]
    fn a_hello_sent_after_the_farewell_keeps_the_grace() {
        let mut c = Cluster::new();
        c.run(0, 1000, |_, _| true);
        let t = c.t0 + Duration::from_millis(1000);
        let bye: Vec<(String, Hello)> = {
            let gw1 = c.trackers.get_mut("gw1").expect("gw1");
            gw1.targets()
                .to_vec()
                .into_iter()
                .flat_map(|(to, _)| {
                    let farewell = gw1.farewell_for(&to, t);
                    let late = gw1.hello_for(&to, t);
                    [(to.clone(), farewell), (to, late)]
                })
                .collect()
        };
        for (to, h) in bye {
            assert_ne!(h.flags & flags::RESTARTING, 0, "to {to}: restarting");
            if let Some(tr) = c.trackers.get_mut(to.as_str()) {
                tr.on_hello(h, addr("gw1"), t).expect("accepted");
            }
        }
        c.run(1000, 5000, |from, _| from != "gw1");
        assert_eq!(c.dead("w1", 5000), set(&[]), "restarting: alive");
    }

    #[test]
    fn a_dead_gateway_comes_back_when_heard_again() {
        let mut c = Cluster::new();
        c.run(0, 1000, |_, _| true);
        c.run(1000, 1600, |from, _| from != "gw1");
        assert_eq!(c.dead("w1", 1600), set(&["gw1"]));
        // gw1, unheard, fenced itself too: it counts a peer again once that peer echoes
        // one of its hellos (1700), and its next hello (1800) says it holds again.
        c.run(1600, 1900, |_, _| true);
        assert_eq!(c.dead("w1", 1900), set(&[]));
    }

    #[test]
    fn hellos_from_the_wrong_address_or_replayed_are_refused() {
        let t0 = Instant::now();
        let mut t = Tracker::new("w1", Settings::default(), 1, t0);
        t.set_members(members());
        let mut gw = Tracker::new("gw1", Settings::default(), 9, t0);
        gw.set_members(members());
        let h = gw.hello_for("w1", t0);
        assert!(matches!(
            t.on_hello(h.clone(), addr("gw2"), t0),
            Err(Refused::WrongAddress { .. })
        ));
        // A v4-mapped source is the same address.
        let mapped = match addr("gw1") {
            IpAddr::V4(a) => IpAddr::V6(a.to_ipv6_mapped()),
            other => other,
        };
        t.on_hello(h.clone(), mapped, t0).expect("accepted");
        assert!(matches!(
            t.on_hello(h, addr("gw1"), t0),
            Err(Refused::Stale { .. })
        ));
        let for_w2 = gw.hello_for("w2", t0);
        assert!(matches!(
            t.on_hello(for_w2, addr("gw1"), t0),
            Err(Refused::NotForMe { .. })
        ));
        let mut stranger = gw.hello_for("w1", t0);
        stranger.name = "mallory".into();
        assert!(matches!(
            t.on_hello(stranger, addr("gw1"), t0),
            Err(Refused::UnknownNode { .. })
        ));
        // A restarted sender (new incarnation) starts its sequence anew.
        let mut again = Tracker::new("gw1", Settings::default(), 10, t0);
        again.set_members(members());
        t.on_hello(again.hello_for("w1", t0), addr("gw1"), t0)
            .expect("a new incarnation is accepted");
    }

    #[test]
    fn a_hello_of_an_incarnation_its_sender_has_left_is_refused() {
        let t0 = Instant::now();
        let mut t = Tracker::new("w1", Settings::default(), 1, t0);
        t.set_members(members());
        let mut first = Tracker::new("gw1", Settings::default(), 9, t0);
        first.set_members(members());
        let recorded = first.hello_for("w1", t0);
        let mut later = first.hello_for("w1", t0);
        later.seq += 10;
        t.on_hello(recorded.clone(), addr("gw1"), t0)
            .expect("first");
        // gw1 restarts: a new incarnation.
        let mut again = Tracker::new("gw1", Settings::default(), 10, t0);
        again.set_members(members());
        t.on_hello(again.hello_for("w1", t0), addr("gw1"), t0)
            .expect("new incarnation");
        // The old incarnation's hellos, even with a higher sequence, are replays.
        assert_eq!(
            t.on_hello(later, addr("gw1"), t0),
            Err(Refused::Replayed {
                name: "gw1".into(),
                incarnation: 9
            })
        );
        assert_eq!(
            t.on_hello(recorded, addr("gw1"), t0)
                .map_err(|e| e.reason()),
            Err("replayed")
        );
    }

    /// Trackers of the lab's nodes where only `new` run this version: the others are
    /// older than the hello protocol (silent, no `helloVersion` in their EgressNode).
    fn mixed(new: &[&'static str]) -> Cluster {
        let mut c = Cluster::new();
        c.trackers.retain(|n, _| new.contains(n));
        let m = Membership {
            speakers: new.iter().map(|n| (*n).to_owned()).collect(),
            ..members()
        };
        for t in c.trackers.values_mut() {
            t.set_members(m.clone());
        }
        c
    }

    #[test]
    fn an_old_holder_that_never_spoke_is_not_declared_dead_by_upgraded_peers() {
        // The rollout's order: the workers, then the gateway holding nothing (gw2), and
        // gw1, the holder, last.
        for new in [&["w1", "w2"][..], &["w1", "w2", "gw2"]] {
            let mut c = mixed(new);
            c.run(0, 5_000, |_, _| true);
            for n in new {
                assert_eq!(c.dead(n, 5_000), set(&[]), "{n} with {new:?} upgraded");
            }
        }
    }

    #[test]
    fn a_new_holder_among_old_peers_keeps_its_quorum() {
        for new in [&["gw1"][..], &["gw1", "w1"], &["gw1", "gw2"]] {
            let mut c = mixed(new);
            c.run(0, 5_000, |_, _| true);
            assert_eq!(c.dead("gw1", 5_000), set(&[]), "{new:?} upgraded");
            // And it says version 1 to the peers that sent nothing yet.
            assert_eq!(c.trackers["gw1"].version_for("w2"), 1);
        }
    }

    #[test]
    fn an_upgraded_holder_whose_egress_node_arrives_before_its_hellos_is_not_declared_dead() {
        let t0 = Instant::now();
        // gw2 is an old agent throughout; gw1 is upgraded.
        let old = Membership {
            speakers: set(&["w1", "w2"]),
            ..members()
        };
        let new = Membership {
            speakers: set(&["w1", "w2", "gw1"]),
            ..members()
        };
        let mut t = Tracker::new("w1", Settings::default(), 1, t0);
        t.set_members(old.clone());
        let late = t0 + Duration::from_secs(30);
        assert!(t.view(late).dead.is_empty(), "gw1 is judged by the API");
        // gw1's new EgressNode says it speaks version 2; its first hello comes 250 ms on.
        t.set_members_at(new.clone(), late);
        assert!(t.view(late + Duration::from_millis(250)).dead.is_empty());
        let mut gw1 = Tracker::new("gw1", Settings::default(), 9, late);
        gw1.set_members(members());
        let h = gw1.hello_for("w1", late);
        t.on_hello(h, addr("gw1"), late + Duration::from_millis(250))
            .expect("hello");
        assert!(t.view(late + Duration::from_millis(500)).dead.is_empty());
        // A speaker that never sends one is dead once the warm-up has passed.
        let mut t = Tracker::new("w1", Settings::default(), 1, t0);
        t.set_members(old);
        t.set_members_at(new, late);
        let warm = Settings::default().warm_up();
        assert!(t.view(late + warm / 2).dead.is_empty());
        assert_eq!(t.view(late + warm).dead, set(&["gw1"]));
    }

    #[test]
    fn an_older_peers_unsigned_hellos_are_echoed_but_prove_nothing() {
        let t0 = Instant::now();
        let m = Membership {
            speakers: set(&["w1", "gw2"]),
            ..members()
        };
        let mut t = Tracker::new("w1", Settings::default(), 1, t0);
        t.set_members(m.clone());
        let mut old = Tracker::new("gw1", Settings::default(), 9, t0);
        old.set_members(m);
        let h = old.hello_for("w1", t0);
        t.echo_only(&h, addr("gw1"), t0);
        let back = t.hello_for("gw1", t0 + Duration::from_millis(10));
        assert_eq!((back.echo_us, back.echo_held_us), (h.sent_us, 10_000));
        // No liveness from it: gw1 is still judged by the API, not heard.
        assert!(t.status(t0).iter().all(|p| !p.direct));
        assert_eq!(t.version_for("gw1"), 1);
        // From another address, or once gw1 speaks version 2: not echoed.
        let mut t2 = Tracker::new("w1", Settings::default(), 1, t0);
        t2.set_members(members());
        t2.echo_only(&h, addr("gw1"), t0);
        t.echo_only(&h, addr("gw2"), t0 + Duration::from_secs(1));
        assert_eq!(t2.hello_for("gw1", t0).echo_us, 0);
        assert_eq!(t.hello_for("gw1", t0 + Duration::from_secs(1)).echo_us, 0);
    }

    #[test]
    fn a_peer_rolled_back_to_an_older_agent_is_judged_by_the_api_again() {
        let t0 = Instant::now();
        let mut t = Tracker::new("gw2", Settings::default(), 1, t0);
        t.set_members(members());
        let mut gw1 = Tracker::new("gw1", Settings::default(), 9, t0);
        gw1.set_members(members());
        t.on_hello(gw1.hello_for("gw2", t0), addr("gw1"), t0)
            .expect("v2");
        // gw1's EgressNode, rewritten by an older agent, no longer says it speaks v2; its
        // unsigned hellos are refused under the key: it is not dead for that silence.
        let later = t0 + Duration::from_secs(10);
        let rolled_back = Membership {
            speakers: set(&["w1", "w2", "gw2"]),
            ..members()
        };
        t.set_members_at(rolled_back, later);
        assert!(!t.view(later).dead.contains("gw1"));
        assert_eq!(t.version_for("gw1"), 1);
    }

    #[test]
    fn a_peer_that_spoke_is_judged_by_its_hellos_even_in_version_1() {
        let t0 = Instant::now();
        let m = Membership {
            speakers: BTreeSet::new(),
            ..members()
        };
        let mut t = Tracker::new("w1", Settings::default(), 1, t0);
        t.set_members(m.clone());
        let mut gw = Tracker::new("gw1", Settings::default(), 9, t0);
        gw.set_members(m);
        t.on_hello_version(gw.hello_for("w1", t0), 1, addr("gw1"), t0)
            .expect("v1");
        assert_eq!(t.version_for("gw1"), 1);
        assert_eq!(t.version_for("gw2"), 1);
        // gw1 falls silent: dead once the detection time has passed; gw2 never spoke.
        let later = t0 + Duration::from_secs(10);
        assert_eq!(t.view(later).dead, set(&["gw1"]));
        // Once gw1 speaks version 2, it is spoken to in version 2.
        let mut h = gw.hello_for("w1", later);
        h.seq += 1;
        t.on_hello_version(h, 2, addr("gw1"), later).expect("v2");
        assert_eq!(t.version_for("gw1"), 2);
    }

    #[test]
    fn the_round_trip_time_comes_from_the_echo() {
        let t0 = Instant::now();
        let mut a = Tracker::new("w1", Settings::default(), 1, t0);
        let mut b = Tracker::new("gw1", Settings::default(), 2, t0);
        a.set_members(members());
        b.set_members(members());
        let ms = |n| t0 + Duration::from_millis(n);
        b.on_hello(a.hello_for("gw1", ms(10)), addr("w1"), ms(12))
            .expect("ok");
        // gw1 answers 5 ms later; w1 gets it 2 ms after that: RTT 4 ms.
        a.on_hello(b.hello_for("w1", ms(17)), addr("gw1"), ms(19))
            .expect("ok");
        let st = a.status(ms(19));
        let gw1 = st.iter().find(|p| p.name == "gw1").expect("gw1");
        assert_eq!(gw1.rtt, Some(Duration::from_millis(4)));
    }

    #[test]
    fn quorum_is_a_strict_majority_and_a_tie_goes_to_the_smallest_name() {
        let expected = set(&["a", "b", "c", "d"]);
        let h =
            |names: &[&'static str]| -> BTreeSet<&'static str> { names.iter().copied().collect() };
        assert!(has_quorum("a", &h(&["b", "c"]), &expected));
        assert!(!has_quorum("d", &h(&[]), &expected));
        // 2 of 4: the side with "a" wins.
        assert!(has_quorum("a", &h(&["b"]), &expected));
        assert!(has_quorum("c", &h(&["a"]), &expected));
        assert!(!has_quorum("c", &h(&["d"]), &expected));
        assert!(has_quorum("solo", &h(&[]), &BTreeSet::new()));
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(256))]
        /// Whatever hellos are lost, one way or both, between any two of the four nodes:
        /// never does each gateway hold (not cut off) while counting the other dead,
        /// which would have both serve the other's egress IPs.
        #[test]
        fn lost_hellos_in_any_direction_never_make_two_holders(links in 0u16..4096) {
            let pairs: Vec<(&str, &str)> = NODES
                .iter()
                .flat_map(|(a, _)| NODES.iter().filter(move |(b, _)| a != b).map(move |(b, _)| (*a, *b)))
                .collect();
            let up = |from: &str, to: &str| {
                let i = pairs.iter().position(|p| *p == (from, to)).expect("pair");
                links >> i & 1 == 1
            };
            let mut c = Cluster::new();
            c.run(0, 1000, |_, _| true);
            c.run(1000, 2500, up);
            let holds = |g: &str| !c.dead(g, 2500).contains(g);
            let takes = |g: &str, other: &str| holds(g) && c.dead(g, 2500).contains(other);
            prop_assert!(
                !((takes("gw1", "gw2") && holds("gw2")) || (takes("gw2", "gw1") && holds("gw1"))),
                "links {links:#014b}: gw1 dead={:?}, gw2 dead={:?}",
                c.dead("gw1", 2500),
                c.dead("gw2", 2500)
            );
        }
    }

    proptest! {
        /// Under any split of four nodes into two sides, at most one side has a quorum.
        #[test]
        fn two_sides_of_a_partition_never_both_have_a_quorum(mask in 0u8..16) {
            let names = ["a", "b", "c", "d"];
            let expected: BTreeSet<String> = names.iter().map(|n| (*n).to_owned()).collect();
            let side = |bit: bool| -> Vec<&str> {
                names.iter().enumerate().filter(|(i, _)| (mask >> i & 1 == 1) == bit).map(|(_, n)| *n).collect()
            };
            let (left, right) = (side(true), side(false));
            let quorum = |members: &[&str]| {
                members.first().is_some_and(|me| {
                    let heard: BTreeSet<&str> = members.iter().copied().filter(|n| n != me).collect();
                    has_quorum(me, &heard, &expected)
                })
            };
            prop_assert!(!(quorum(&left) && quorum(&right)));
        }
    }

    /// A hello of `from` to w1: `change` picks its lists and flags (0: the usual ones;
    /// 1: cut off; 2: a gateway unheard, an interface down; 3: a claim moved on).
    fn hello_of(from: &str, change: u8, incarnation: u32, seq: u64) -> Hello {
        let mut h = Hello {
            incarnation,
            seq,
            sent_us: seq * 100_000,
            name: from.to_owned(),
            to: "w1".to_owned(),
            seen: set(&["gw1", "gw2"]),
            claims: [(
                "192.168.101.50".parse().expect("ip"),
                Claim {
                    interface: "sec-a".into(),
                    epoch: 1,
                },
            )]
            .into(),
            ..Hello::default()
        };
        match change {
            1 => h.flags = flags::CUT_OFF,
            2 => {
                h.seen = set(&["gw2"]);
                h.down = set(&["sec-b"]);
            }
            3 => h.claims.values_mut().for_each(|c| c.epoch = 2),
            _ => {}
        }
        h
    }

    proptest::proptest! {
        /// The agent reads hellos in place and decodes only those whose lists changed;
        /// a tracker fed so must know, say and send exactly what one fed each hello
        /// decoded whole knows, over any sequence of hellos from any peer.
        #[test]
        fn a_hello_read_in_place_is_taken_as_one_decoded_whole(
            steps in proptest::collection::vec((0usize..3, 0u8..5, 0u64..250), 1..80),
        ) {
            let t0 = Instant::now();
            let mut whole = Tracker::new("w1", Settings::default(), 1, t0);
            let mut in_place = Tracker::new("w1", Settings::default(), 1, t0);
            whole.set_members(members());
            in_place.set_members(members());
            let mut now = t0;
            let mut senders = [("gw1", 1u32, 0u64), ("gw2", 1, 0), ("w2", 1, 0)];
            for (who, change, ms) in steps {
                now += Duration::from_millis(ms);
                let s = &mut senders[who];
                // 4: the sender restarted.
                if change == 4 {
                    s.1 += 1;
                }
                s.2 += 1;
                let b = hello_of(s.0, change % 4, s.1, s.2)
                    .encode(2, &Keyring::default())
                    .expect("encode");
                let decoded = Hello::decode(&b, &Keyring::default()).expect("decode");
                let a = whole.on_hello_version(decoded.hello, decoded.version, addr(s.0), now);
                let read = HelloRef::parse(&b, &Keyring::default()).expect("parse");
                let r = in_place.on_received(&read, addr(s.0), now);
                proptest::prop_assert_eq!(a, r);
                proptest::prop_assert_eq!(whole.observe(now), in_place.observe(now));
                proptest::prop_assert_eq!(whole.status(now), in_place.status(now));
                proptest::prop_assert_eq!(whole.hello_for(s.0, now), in_place.hello_for(s.0, now));
            }
        }
    }

    /// What `write_hellos` writes is, byte for byte, what each target's `hello_for`
    /// encodes in the version it speaks, signed, with the remaps that fit in those to
    /// gateways.
    #[test]
    fn the_hellos_written_in_place_are_those_built_whole() {
        let mut c = Cluster::new();
        c.run(0, 1000, |_, _| true);
        let now = c.t0 + Duration::from_millis(1000);
        let keys = Keyring::new(vec![super::super::keys::Key::new(vec![7; 32])]);
        let remap = |port| Remap {
            proto: 6,
            pod: SocketAddr::from(([10, 244, 1, 5], port)),
            dst: SocketAddr::from(([192, 168, 101, 10], 443)),
            egress: SocketAddr::from(([192, 168, 101, 50], port + 1)),
        };
        // More than fit in one hello.
        let remaps: Vec<Remap> = (0..100).map(|i| remap(40_000 + i)).collect();
        let mut built = Cluster::new_at(c.t0);
        built.run(0, 1000, |_, _| true);
        let gw1 = c.trackers.get_mut("gw1").expect("gw1");
        let mut out = Outbox::default();
        let most = gw1.write_hellos(now, 1_790_000_000_000, (&keys, &remaps), &mut out);
        let twin = built.trackers.get_mut("gw1").expect("gw1");
        let mut want = Vec::new();
        let mut want_most = 0;
        for (to, ip) in twin.targets().to_vec() {
            let version = twin.version_for(&to);
            let mut h = twin.hello_for(&to, now);
            h.sent_unix_ms = 1_790_000_000_000;
            let without = h.encode(version, &keys).expect("encode").len();
            if twin.is_gateway(&to) {
                h.remaps = remaps[..fitting(&remaps, hello::MAX_LEN - without)].to_vec();
                want_most = want_most.max(h.remaps.len());
            }
            want.push((ip, h.encode(version, &keys).expect("encode").to_vec()));
        }
        let got: Vec<(IpAddr, Vec<u8>)> = out
            .hellos
            .iter()
            .map(|(ip, r)| (*ip, out.bytes[r.clone()].to_vec()))
            .collect();
        assert_eq!(got, want);
        assert!(most > 0 && most < remaps.len(), "{most} remaps");
        assert_eq!(most, want_most);
    }
}
