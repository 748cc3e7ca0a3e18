//! Holding egress IPs on this node, ordered so that no kernel ever sees a packet to an
//! egress IP that the datapath does not claim (the kernel would answer it with a RST):
//!
//! * **acquire**: maps first (the rule, and the egress IP in `EGRESS_IPS_*`, so that
//!   `from_secondary` drops replies without conntrack instead of handing them to the
//!   stack), then `from_secondary` attached, then the address, then announcements;
//! * **release**: the address first, then the maps, after a linger: for [`LINGER`] the
//!   released IP's rules and `EGRESS_IPS` entry stay, so packets still reaching this node
//!   (source nodes that have not moved yet, neighbours with a stale cache) are translated
//!   with the flow's conntrack entry or dropped, never answered by the host;
//! * **handover**: an address another live node still claims (a planned move, where the
//!   old holder releases on its own) is added only once that claim is gone, or after the
//!   detection time at most, so two nodes do not answer ARP for it at once.
//!
//! [`Ownership`] keeps what this node holds, lingers, waits for and refused, and acts
//! on the pure decisions below through [`Addresses`]: the kernel's in the agent, a fake
//! in the tests.

use std::{
    borrow::Cow,
    collections::{BTreeMap, BTreeSet},
    net::IpAddr,
    time::{Duration, Instant},
};

use tracing::{debug, info, warn};

use crate::{
    api::HeldEgressIp,
    by_family,
    compiler::{Compiled, Holder},
    desired::{Desired, Family, GatewayRule, HeldIp, V4, V6},
    iface::Interface,
    liveness::{Claim, PeerView},
};

/// How long a released egress IP keeps serving what still reaches this node.
pub const LINGER: Duration = Duration::from_secs(10);

/// When a new holder announces an address (gratuitous ARP, unsolicited neighbour
/// advertisement), after adding it: at once, then again for neighbours that missed it or
/// keep long ARP timers.
pub const ANNOUNCE_AT: [Duration; 5] = [
    Duration::ZERO,
    Duration::from_millis(100),
    Duration::from_millis(500),
    Duration::from_secs(1),
    Duration::from_secs(2),
];

/// An egress IP this node holds: on which interface, its epoch, since when and why.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Holding {
    pub interface: String,
    pub epoch: u64,
    /// RFC 3339.
    pub since: String,
    pub reason: String,
}

/// What a dedicated egress IP needs in the gateway-side maps of this node.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct GatewayPart {
    pub held: Option<HeldIp>,
    /// The rules leaving with this address: rule id -> interface.
    pub rules: BTreeMap<u32, String>,
}

/// A released egress IP still served from the maps until `until`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Lingering {
    pub until: Instant,
    pub part: GatewayPart,
}

/// How long an egress IP another host answered for is refused before it is probed again.
pub const REPROBE: Duration = Duration::from_secs(5);

/// How this node's addresses change: netlink and ARP/NDP in the agent
/// ([`NodeAddresses`]), a fake in the tests (the golden scripts' too).
#[expect(
    async_fn_in_trait,
    reason = "implemented in this crate and its tests only, awaited where they are called"
)]
pub trait Addresses {
    /// Add `ip/prefix_len` to `i`.
    async fn add(&mut self, i: &Interface, ip: IpAddr, prefix_len: u8) -> Result<(), String>;
    /// Remove what `r` names.
    async fn remove(&mut self, r: &Release) -> Result<(), String>;
    /// Duplicate address detection for `ip` on `i`: the problem that names the host
    /// answering for it, if one does; an error when no probe could be sent.
    async fn probe(&mut self, i: &Interface, ip: IpAddr) -> Result<Option<String>, String>;
    /// Tell `i`'s network that `ip` is here now (in the background, a few times over
    /// [`ANNOUNCE_AT`]), in place of what is still pending for `ip`.
    fn announce(&mut self, i: &Interface, ip: IpAddr);
    /// Stop announcing `ip`: nothing pending is sent after this returns (a send already
    /// under way on another thread completes). Called before the address is removed, so
    /// that no neighbour learns an address this node no longer has.
    fn silence(&mut self, ip: IpAddr);
}

/// What one pass knows besides the compile: who this node is, the time, the peers, and
/// the liveness clocks.
pub struct Pass<'a> {
    pub me: &'a str,
    pub now: Instant,
    /// `now` in RFC 3339, for the `since` of what is taken.
    pub stamp: &'a str,
    pub peers: &'a PeerView,
    /// When this agent has heard its peers (nothing is taken before).
    pub warm_at: Instant,
    /// The longest a handover waits for the previous holder to let go.
    pub detection: Duration,
    /// Probe before a first claim (`--no-dad` turns it off).
    pub dad: bool,
}

/// What a step changed, what went wrong, and the addresses it took with their reasons.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Done {
    pub changed: usize,
    pub problems: Vec<String>,
    pub acquired: Vec<(IpAddr, &'static str)>,
}

/// The egress IPs of this node: held, lingering after a release, waiting for a handover,
/// or refused because another host answers for them. One pass acts on it in order:
/// [`adopt`](Self::adopt), [`release`](Self::release), the maps from
/// [`serving`](Self::serving), [`acquire`](Self::acquire), [`remember`](Self::remember).
#[derive(Debug, Default)]
pub struct Ownership {
    holdings: BTreeMap<IpAddr, Holding>,
    /// The gateway-side map contents of every dedicated egress IP of the last pass.
    parts: BTreeMap<IpAddr, GatewayPart>,
    lingering: BTreeMap<IpAddr, Lingering>,
    /// Addresses to acquire that another live node still claims, since when.
    handover_since: BTreeMap<IpAddr, Instant>,
    /// An address waits for the end of this agent's warm-up.
    warm_pending: bool,
    /// Egress IPs another host answered for, when, and the problem that names it.
    refused: BTreeMap<IpAddr, (Instant, String)>,
    /// What the last pass saw of the peers, for [`Ownership::reannounce`].
    seen: PeerSnapshot,
}

impl Ownership {
    /// What this node holds, by address.
    pub fn holdings(&self) -> &BTreeMap<IpAddr, Holding> {
        &self.holdings
    }

    /// What this node says it holds, for its hellos.
    pub fn claims(&self) -> BTreeMap<IpAddr, Claim> {
        claims(&self.holdings)
    }

    /// The egress IPs refused because another host answers for them, with the problem.
    pub fn refused(&self) -> impl Iterator<Item = (IpAddr, &str)> {
        self.refused.iter().map(|(ip, (_, m))| (*ip, m.as_str()))
    }

    /// Take over what this node's EgressNode says it holds (`published`) and its
    /// interfaces still carry (the agent restarted), so that a restart moves nothing.
    pub fn adopt(&mut self, published: &[HeldEgressIp], ifaces: &[Interface]) -> Vec<IpAddr> {
        adopt(&mut self.holdings, published, |ifc, ip| {
            carries(ifaces, ifc, ip)
        })
    }

    /// Remove the egress addresses this node must no longer hold (before the maps
    /// change), and keep their map entries lingering. `published`: what this node's
    /// EgressNode says it holds (an earlier agent's too), which it may remove as well.
    pub async fn release(
        &mut self,
        addrs: &mut impl Addresses,
        compiled: &Compiled,
        published: &[HeldEgressIp],
        ifaces: &[Interface],
        now: Instant,
    ) -> Done {
        let mut removable = compiled.policy_egress_ips.clone();
        removable.extend(self.holdings.keys().copied());
        removable.extend(published.iter().filter_map(|h| h.ip.parse::<IpAddr>().ok()));
        let mut done = Done::default();
        for r in to_release(ifaces, &compiled.desired, &removable) {
            addrs.silence(r.ip);
            if let Err(e) = addrs.remove(&r).await {
                done.problems.push(format!("egress IP {}: {e}", r.ip));
                continue;
            }
            done.changed += 1;
            let epoch = self.holdings.remove(&r.ip).map(|h| h.epoch);
            if let Some(part) = self.parts.get(&r.ip) {
                let until = now + LINGER;
                let part = part.clone();
                self.lingering.insert(r.ip, Lingering { until, part });
            }
            info!(
                ip = %r.ip,
                interface = %r.interface,
                epoch = ?epoch,
                "released egress IP: {}",
                release_reason(r.ip, compiled)
            );
        }
        // Held IPs whose address vanished (the interface went away): not held any more.
        let vanished: Vec<IpAddr> = self
            .holdings
            .iter()
            .filter(|(ip, h)| !carries(ifaces, &h.interface, **ip))
            .map(|(ip, _)| *ip)
            .collect();
        for ip in vanished {
            addrs.silence(ip);
            self.holdings.remove(&ip);
        }
        self.lingering.retain(|_, l| l.until > now);
        done
    }

    /// What the maps serve: `desired`, with the released addresses that still linger
    /// where nothing current takes their place.
    pub fn serving<'d>(&self, desired: &'d Desired) -> Cow<'d, Desired> {
        if self.lingering.is_empty() {
            Cow::Borrowed(desired)
        } else {
            Cow::Owned(with_lingering(desired, &self.lingering))
        }
    }

    /// Add the egress addresses the compile gives this node (after the maps and
    /// attachments), waiting for the warm-up and for a live previous holder to let go,
    /// probing first claims, and announce them. `published`: what this agent last
    /// published, whose `since` an address already present keeps.
    pub async fn acquire(
        &mut self,
        addrs: &mut impl Addresses,
        compiled: &Compiled,
        ifaces: &[Interface],
        pass: &Pass<'_>,
        published: &[HeldEgressIp],
    ) -> Done {
        let mut done = Done::default();
        let mut wanted = BTreeSet::new();
        self.warm_pending = false;
        let mine = compiled
            .holders
            .iter()
            .filter(|h| h.node == pass.me && !h.shared);
        for h in mine {
            let Some(i) = ifaces.iter().find(|i| i.name == h.interface) else {
                continue;
            };
            wanted.insert(h.ip);
            if i.addresses.iter().any(|(a, _)| *a == h.ip) {
                // Already there (held before, or by the agent before this one).
                self.keep(h, published, pass.stamp);
                continue;
            }
            let Some(probe) = self.may_take(h, pass) else {
                continue;
            };
            if pass.dad
                && probe
                && let Some(refused) = self.answered_elsewhere(addrs, h.ip, i, pass.now).await
            {
                done.problems.push(format!("egress IP {}: {refused}", h.ip));
                continue;
            }
            let prefix_len = compiled
                .desired
                .egress_ip(h.ip)
                .map_or(32, |e| e.prefix_len);
            if let Err(e) = addrs.add(i, h.ip, prefix_len).await {
                done.problems.push(format!("egress IP {}: {e}", h.ip));
                continue;
            }
            self.took(h, pass.stamp);
            addrs.announce(i, h.ip);
            done.changed += 1;
            done.acquired.push((h.ip, h.reason));
        }
        self.handover_since.retain(|ip, _| wanted.contains(ip));
        self.refused.retain(|ip, _| wanted.contains(ip));
        done
    }

    /// Whether `h`'s address may be added now ([`take`]), and if so whether it is to be
    /// probed first; else it waits (for the warm-up, or a handover) and a pass is due.
    fn may_take(&mut self, h: &Holder, pass: &Pass<'_>) -> Option<bool> {
        let waiting = self.handover_since.get(&h.ip).copied();
        let (me, peers, now) = (pass.me, pass.peers, pass.now);
        match take(
            h.ip,
            h.reason,
            me,
            peers,
            now,
            pass.warm_at,
            waiting,
            pass.detection,
        ) {
            Take::AfterWarmUp => {
                self.warm_pending = true;
                None
            }
            Take::AfterHandover { holder, since } => {
                self.handover_since.insert(h.ip, since);
                debug!(ip = %h.ip, %holder, "waiting for the previous holder to release");
                None
            }
            Take::Now { probe, overdue } => {
                if let Some(holder) = overdue {
                    warn!(
                        ip = %h.ip,
                        %holder,
                        "the previous holder still claims the address after the detection \
                         time; taking it"
                    );
                }
                self.handover_since.remove(&h.ip);
                Some(probe)
            }
        }
    }

    /// Duplicate address detection before this node first claims `ip` on `i`: the
    /// problem to report when another host answers for it. A refused address is probed
    /// again once [`REPROBE`] has passed.
    async fn answered_elsewhere(
        &mut self,
        addrs: &mut impl Addresses,
        ip: IpAddr,
        i: &Interface,
        now: Instant,
    ) -> Option<String> {
        if let Some((at, refused)) = self.refused.get(&ip)
            && now.duration_since(*at) < REPROBE
        {
            return Some(refused.clone());
        }
        match addrs.probe(i, ip).await {
            Ok(None) => {
                self.refused.remove(&ip);
                None
            }
            Ok(Some(refused)) => {
                self.refused.insert(ip, (now, refused.clone()));
                Some(refused)
            }
            Err(e) => {
                warn!("failed to probe for {ip} before claiming it (claiming it anyway): {e}");
                None
            }
        }
    }

    /// Record `h`, whose address is already on its interface, as held (keeping the
    /// `since` published for its epoch).
    fn keep(&mut self, h: &Holder, published: &[HeldEgressIp], stamp: &str) {
        let ip = h.ip.to_string();
        let since = published
            .iter()
            .find(|p| p.ip == ip && p.epoch == h.epoch)
            .and_then(|p| p.since.clone());
        self.holdings
            .entry(h.ip)
            .or_insert_with(|| Holding {
                interface: h.interface.clone(),
                epoch: h.epoch,
                since: since.unwrap_or_else(|| stamp.to_owned()),
                reason: h.reason.to_owned(),
            })
            .epoch = h.epoch;
    }

    /// Record `h` as held from `stamp`: it no longer lingers.
    fn took(&mut self, h: &Holder, stamp: &str) {
        self.lingering.remove(&h.ip);
        let held = Holding {
            interface: h.interface.clone(),
            epoch: h.epoch,
            since: stamp.to_owned(),
            reason: h.reason.to_owned(),
        };
        self.holdings.insert(h.ip, held);
        info!(
            ip = %h.ip,
            interface = %h.interface,
            epoch = h.epoch,
            reason = h.reason,
            "holding egress IP"
        );
    }

    /// Announce again what this node holds when the network may have been told
    /// otherwise since: a peer let one of these addresses go (its announcements may have
    /// raced ours), or a peer is reachable again after a partition (a heal: it may have
    /// announced on its side). `fresh`: taken in this pass, announced already. The
    /// addresses announced again, with why.
    pub(crate) fn reannounce(
        &mut self,
        addrs: &mut impl Addresses,
        ifaces: &[Interface],
        peers: &PeerView,
        me: &str,
        fresh: &[IpAddr],
    ) -> Vec<(IpAddr, String)> {
        let now = PeerSnapshot::of(peers, me);
        let held = self.holdings.keys().filter(|ip| !fresh.contains(ip));
        let due = to_reannounce(held.copied(), &self.seen, &now);
        self.seen = now;
        let mut out = Vec::new();
        for (ip, why) in due {
            let Some(h) = self.holdings.get(&ip) else {
                continue;
            };
            let Some(i) = ifaces.iter().find(|i| i.name == h.interface) else {
                continue;
            };
            info!(%ip, interface = %i.name, "announcing egress IP again: {why}");
            addrs.announce(i, ip);
            out.push((ip, why));
        }
        out
    }

    /// Remember the gateway-side map contents of this pass's `desired`, for the linger of
    /// what a later pass releases.
    pub fn remember(&mut self, desired: &Desired) {
        self.parts = gateway_parts(desired);
    }

    /// When the next pass is due without an event: a handover's deadline, the end of a
    /// linger, of the warm-up, or of a refusal; now when something waits without one.
    pub fn next_pass(
        &self,
        now: Instant,
        detection: Duration,
        warm_at: Instant,
    ) -> Option<Instant> {
        let handovers = self.handover_since.values().map(|s| *s + detection);
        let lingers = self.lingering.values().map(|l| l.until);
        let warm = self.warm_pending.then_some(warm_at);
        let reprobes = self.refused.values().map(|(at, _)| *at + REPROBE);
        let next = handovers
            .chain(lingers)
            .chain(warm)
            .chain(reprobes)
            .filter(|t| *t > now)
            .min();
        let waiting = self.warm_pending || !self.handover_since.is_empty();
        next.or(waiting.then_some(now))
    }
}

/// What one pass saw of the peers, as far as announcements care: who else claims each
/// address, and who is unreachable.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PeerSnapshot {
    /// The other nodes whose latest report claims each address.
    pub claimants: BTreeMap<IpAddr, BTreeSet<String>>,
    /// Unreachable peers (this node left out).
    pub dead: BTreeSet<String>,
}

impl PeerSnapshot {
    pub fn of(peers: &PeerView, me: &str) -> Self {
        let mut claimants: BTreeMap<IpAddr, BTreeSet<String>> = BTreeMap::new();
        for (node, r) in peers.reports.iter().filter(|(n, _)| n.as_str() != me) {
            for ip in r.claims.keys() {
                claimants.entry(*ip).or_default().insert(node.clone());
            }
        }
        let dead = peers.dead.iter().filter(|n| *n != me).cloned().collect();
        Self { claimants, dead }
    }
}

/// Which of the `held` addresses to announce again between two passes that saw `before`
/// and `now`, and why: all of them when a peer is reachable again (a heal), and each one
/// that a peer claimed before and claims no more (it let go, and what it had pending may
/// have reached a neighbour after ours).
pub fn to_reannounce(
    held: impl Iterator<Item = IpAddr>,
    before: &PeerSnapshot,
    now: &PeerSnapshot,
) -> BTreeMap<IpAddr, String> {
    let revived: Vec<&str> = before
        .dead
        .difference(&now.dead)
        .map(String::as_str)
        .collect();
    let mut out = BTreeMap::new();
    for ip in held {
        let empty = BTreeSet::new();
        let was = before.claimants.get(&ip).unwrap_or(&empty);
        let is = now.claimants.get(&ip).unwrap_or(&empty);
        let let_go: Vec<&str> = was.difference(is).map(String::as_str).collect();
        if !let_go.is_empty() {
            out.insert(ip, format!("{} let it go", let_go.join(", ")));
        } else if !revived.is_empty() {
            out.insert(ip, format!("{} reachable again", revived.join(", ")));
        }
    }
    out
}

/// Whether `ifaces` has `ip` on the interface named `interface`.
fn carries(ifaces: &[Interface], interface: &str, ip: IpAddr) -> bool {
    ifaces
        .iter()
        .any(|i| i.name == interface && i.addresses.iter().any(|(a, _)| *a == ip))
}

/// Why this node no longer holds egress IP `ip`, in words for the log.
pub fn release_reason(ip: IpAddr, compiled: &Compiled) -> String {
    if let Some(h) = compiled.holders.iter().find(|h| h.ip == ip && !h.shared) {
        return format!(
            "{} holds it now ({}, policy {})",
            h.node, h.reason, h.policy
        );
    }
    let named: Vec<&String> = compiled
        .accepted
        .iter()
        .filter(|(_, p)| {
            p.spec
                .rules
                .iter()
                .any(|r| r.dedicated_ips().any(|a| a == ip))
        })
        .map(|(name, _)| name)
        .collect();
    if named.is_empty() {
        return "no accepted policy names it".to_owned();
    }
    let why: Vec<String> = named
        .iter()
        .filter_map(|name| {
            let ready = compiled
                .statuses
                .get(*name)?
                .conditions
                .iter()
                .find(|c| c.type_ == "Ready")?;
            Some(format!(
                "policy {name}: {}: {}",
                ready.reason, ready.message
            ))
        })
        .collect();
    format!("no eligible gateway holds it ({})", why.join("; "))
}

/// The node's own addresses: netlink for the address, ARP and NDP for the probes and
/// announcements.
pub(crate) struct NodeAddresses<'a> {
    pub nl: &'a crate::iface::Netlink,
    pub announcing: &'a mut Announcing,
}

/// The announcements still pending, by address: a release cancels them.
#[derive(Debug, Default)]
pub struct Announcing(BTreeMap<IpAddr, tokio::task::AbortHandle>);

impl Announcing {
    /// Start announcing `ip` on `ifindex` at `mac`, in place of what is pending for it.
    fn start(&mut self, ifindex: u32, mac: [u8; 6], ip: IpAddr) {
        self.stop(ip);
        self.0.retain(|_, h| !h.is_finished());
        let task = tokio::spawn(async move {
            if let Err(e) = crate::iface::announce(ifindex, mac, ip, &ANNOUNCE_AT).await {
                warn!("failed to announce {ip}: {e}");
            }
        });
        self.0.insert(ip, task.abort_handle());
    }

    /// Cancel what is pending for `ip`: the task sends nothing more (it sleeps between
    /// its sends, where an abort takes it).
    fn stop(&mut self, ip: IpAddr) {
        if let Some(h) = self.0.remove(&ip)
            && !h.is_finished()
        {
            h.abort();
            debug!(%ip, "pending announcements cancelled");
        }
    }
}

impl Addresses for NodeAddresses<'_> {
    async fn add(&mut self, i: &Interface, ip: IpAddr, prefix_len: u8) -> Result<(), String> {
        // The kernel's own IPv6 DAD stays off: see `add_address`.
        let added = self.nl.add_address(i.ifindex, ip, prefix_len).await;
        added.map_err(|e| e.to_string())
    }

    async fn remove(&mut self, r: &Release) -> Result<(), String> {
        let removed = self.nl.del_address(r.ifindex, r.ip, r.prefix_len).await;
        removed.map_err(|e| e.to_string())
    }

    async fn probe(&mut self, i: &Interface, ip: IpAddr) -> Result<Option<String>, String> {
        let Some(mac) = i.mac else { return Ok(None) };
        let t0 = Instant::now();
        let answer = crate::doctor::dad::probe(i.ifindex, mac, ip).await;
        let answer = answer.map_err(|e| e.to_string())?;
        if answer.is_none() {
            let took_ms = t0.elapsed().as_secs_f64() * 1e3;
            info!(%ip, interface = %i.name, took_ms, "no answer to duplicate address probes");
        }
        Ok(answer.map(|holder| crate::doctor::in_use_message(ip, &i.name, holder)))
    }

    fn announce(&mut self, i: &Interface, ip: IpAddr) {
        if let Some(mac) = i.mac {
            self.announcing.start(i.ifindex, mac, ip);
        }
    }

    fn silence(&mut self, ip: IpAddr) {
        self.announcing.stop(ip);
    }
}

/// The gateway-side map contents of every dedicated egress IP in `desired`, by address.
pub fn gateway_parts(desired: &Desired) -> BTreeMap<IpAddr, GatewayPart> {
    let mut out: BTreeMap<IpAddr, GatewayPart> = BTreeMap::new();
    add_parts::<V4>(desired, &mut out);
    add_parts::<V6>(desired, &mut out);
    out
}

/// [`gateway_parts`] of family `F`.
fn add_parts<F: Family>(desired: &Desired, out: &mut BTreeMap<IpAddr, GatewayPart>) {
    let d = F::part(desired);
    for (ip, h) in d.egress_ips.iter().filter(|(_, h)| !h.shared) {
        out.entry((*ip).into()).or_default().held = Some(h.clone());
    }
    for (id, r) in &d.rules {
        if let Some(p) = out.get_mut(&r.egress_ip.into()) {
            p.rules.insert(*id, r.interface.clone());
        }
    }
}

/// `desired` with the lingering IPs' entries added where nothing current takes their
/// place (an address or rule id in use now wins).
pub fn with_lingering(desired: &Desired, lingering: &BTreeMap<IpAddr, Lingering>) -> Desired {
    let mut out = desired.clone();
    for (ip, l) in lingering {
        let Some(held) = &l.part.held else { continue };
        let added = by_family!(*ip, |a: F| linger::<F>(&mut out, a, held, &l.part.rules));
        if added {
            out.egress_interfaces.insert(held.interface.clone());
        }
    }
    out
}

/// Add the lingering `ip` and its `rules` to `out` unless `ip` is in use now; rule ids
/// in use now keep their entries. Whether it was added.
fn linger<F: Family>(
    out: &mut Desired,
    ip: F::Addr,
    held: &HeldIp,
    rules: &BTreeMap<u32, String>,
) -> bool {
    let part = F::part_mut(out);
    if part.egress_ips.contains_key(&ip) {
        return false;
    }
    part.egress_ips.insert(ip, held.clone());
    for (id, interface) in rules {
        part.rules.entry(*id).or_insert_with(|| GatewayRule {
            egress_ip: ip,
            interface: interface.clone(),
        });
    }
    true
}

/// Another live node that still claims `ip` in its hellos (it is on its way out: the
/// compiler chose this node), if any.
pub fn other_claimant<'a>(ip: IpAddr, me: &str, peers: &'a PeerView) -> Option<&'a str> {
    peers
        .reports
        .iter()
        .filter(|(n, r)| n.as_str() != me && !r.cut_off && !peers.dead.contains(n.as_str()))
        .find(|(_, r)| r.claims.contains_key(&ip))
        .map(|(n, _)| n.as_str())
}

/// Addresses this node's EgressNode says it holds (`published`: ip, interface, epoch,
/// since, reason) that are on that interface now (`present`) but not in `holdings`: what
/// an agent that restarted (or replaced one) still holds. Adopted with their epochs, so a
/// restart moves nothing.
pub fn adopt(
    holdings: &mut BTreeMap<IpAddr, Holding>,
    published: &[crate::api::HeldEgressIp],
    present: impl Fn(&str, IpAddr) -> bool,
) -> Vec<IpAddr> {
    let mut adopted = Vec::new();
    for h in published {
        let Ok(ip) = h.ip.parse::<IpAddr>() else {
            continue;
        };
        if holdings.contains_key(&ip) || !present(&h.interface, ip) {
            continue;
        }
        holdings.insert(
            ip,
            Holding {
                interface: h.interface.clone(),
                epoch: h.epoch,
                since: h.since.clone().unwrap_or_default(),
                reason: h.reason.clone().unwrap_or_default(),
            },
        );
        adopted.push(ip);
    }
    adopted
}

/// An address to remove from an interface.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Release {
    pub ifindex: u32,
    pub interface: String,
    pub ip: IpAddr,
    pub prefix_len: u8,
}

/// The egress addresses to remove now: every address on an interface that this agent may
/// remove (`removable`: egress IPs that a policy names, that this node holds or published
/// as held) and that `desired` does not hold, dedicated, on that very interface. Other
/// addresses (the node's own, shared egress IPs, anything an operator added) stay.
pub fn to_release(
    ifaces: &[crate::iface::Interface],
    desired: &Desired,
    removable: &BTreeSet<IpAddr>,
) -> Vec<Release> {
    let mut out = Vec::new();
    for i in ifaces {
        for (a, len) in &i.addresses {
            let ours = desired
                .egress_ip(*a)
                .is_some_and(|h| !h.shared && h.interface == i.name);
            if removable.contains(a) && !ours {
                out.push(Release {
                    ifindex: i.ifindex,
                    interface: i.name.clone(),
                    ip: *a,
                    prefix_len: *len,
                });
            }
        }
    }
    out
}

/// What to do now about an egress IP the compiler gives this node and that is not on its
/// interface yet.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Take {
    /// Not before this agent has heard its peers (agents that start together would each
    /// elect from a different partial view).
    AfterWarmUp,
    /// `holder`, a live node, still claims it (a planned move): wait until it lets go,
    /// for one detection time at most, counted from `since`.
    AfterHandover { holder: String, since: Instant },
    /// Add it now. `probe`: a first claim, to be checked for another host answering for
    /// it (moves between our gateways are not probed: failover must not wait);
    /// `overdue`: the previous holder that still claims it after the detection time.
    Now {
        probe: bool,
        overdue: Option<String>,
    },
}

/// When to add `ip` (assigned for `reason`): `warm_at` is when this agent has heard its
/// peers, `waiting_since` when it started waiting for another claimant to let go, if it
/// did, and `detection` the longest such a wait may last.
#[allow(clippy::too_many_arguments)]
pub fn take(
    ip: IpAddr,
    reason: &str,
    me: &str,
    peers: &PeerView,
    now: Instant,
    warm_at: Instant,
    waiting_since: Option<Instant>,
    detection: Duration,
) -> Take {
    if now < warm_at {
        return Take::AfterWarmUp;
    }
    let claimant = other_claimant(ip, me, peers).map(str::to_owned);
    if let Some(holder) = &claimant {
        let since = waiting_since.unwrap_or(now);
        if now.duration_since(since) < detection {
            return Take::AfterHandover {
                holder: holder.clone(),
                since,
            };
        }
    }
    Take::Now {
        probe: reason == crate::compiler::move_reason::ASSIGNED && claimant.is_none(),
        overdue: claimant,
    }
}

/// What this node says it holds, for its hellos.
pub fn claims(holdings: &BTreeMap<IpAddr, Holding>) -> BTreeMap<IpAddr, Claim> {
    holdings
        .iter()
        .map(|(ip, h)| {
            (
                *ip,
                Claim {
                    interface: h.interface.clone(),
                    epoch: h.epoch,
                },
            )
        })
        .collect()
}

/// Names of the interfaces that are down, of those a node publishes.
pub fn down_interfaces<'a>(ifaces: impl IntoIterator<Item = (&'a str, bool)>) -> BTreeSet<String> {
    ifaces
        .into_iter()
        .filter(|(_, up)| !up)
        .map(|(n, _)| n.to_owned())
        .collect()
}

#[cfg(test)]
mod tests {
    use std::net::Ipv4Addr;

    use super::*;
    use crate::liveness::Report;

    fn desired_holding(ip: Ipv4Addr, rule: u32) -> Desired {
        let mut d = Desired::default();
        d.v4.egress_ips.insert(
            ip,
            HeldIp {
                interface: "sec-a".into(),
                prefix_len: 24,
                shared: false,
            },
        );
        d.v4.rules.insert(
            rule,
            GatewayRule {
                egress_ip: ip,
                interface: "sec-a".into(),
            },
        );
        d.egress_interfaces.insert("sec-a".into());
        d
    }

    #[test]
    fn a_released_ip_keeps_its_rules_and_egress_ip_entry_while_it_lingers() {
        let a = Ipv4Addr::new(192, 168, 101, 50);
        let before = desired_holding(a, 7);
        let parts = gateway_parts(&before);
        let lingering = BTreeMap::from([(
            IpAddr::V4(a),
            Lingering {
                until: Instant::now() + LINGER,
                part: parts[&IpAddr::V4(a)].clone(),
            },
        )]);
        let after = with_lingering(&Desired::default(), &lingering);
        assert_eq!(after.v4.egress_ips, before.v4.egress_ips);
        assert_eq!(after.v4.rules, before.v4.rules);
        assert!(after.egress_interfaces.contains("sec-a"));
    }

    #[test]
    fn what_is_current_wins_over_what_lingers() {
        let a = Ipv4Addr::new(192, 168, 101, 50);
        let b = Ipv4Addr::new(192, 168, 101, 60);
        let parts = gateway_parts(&desired_holding(a, 7));
        let lingering = BTreeMap::from([(
            IpAddr::V4(a),
            Lingering {
                until: Instant::now(),
                part: parts[&IpAddr::V4(a)].clone(),
            },
        )]);
        // Rule 7 now serves another egress IP: it keeps it.
        let now = desired_holding(b, 7);
        let merged = with_lingering(&now, &lingering);
        assert_eq!(merged.v4.rules[&7].egress_ip, b);
        assert!(merged.v4.egress_ips.contains_key(&a));
    }

    #[test]
    fn a_restarted_agent_adopts_what_its_egress_node_says_and_its_interfaces_show() {
        let published = [
            crate::api::HeldEgressIp {
                ip: "192.168.101.50".into(),
                interface: "sec-a".into(),
                epoch: 4,
                since: Some("2026-11-30T12:00:00Z".into()),
                reason: Some("HolderUnreachable".into()),
            },
            // Published, but no longer on the interface (released before the restart).
            crate::api::HeldEgressIp {
                ip: "192.168.102.50".into(),
                interface: "sec-b".into(),
                epoch: 2,
                ..Default::default()
            },
        ];
        let mut holdings = BTreeMap::new();
        let present = |ifc: &str, ip: IpAddr| ifc == "sec-a" && ip.to_string() == "192.168.101.50";
        let adopted = adopt(&mut holdings, &published, present);
        assert_eq!(adopted.len(), 1);
        let h = &holdings[&"192.168.101.50".parse::<IpAddr>().expect("ip")];
        assert_eq!((h.epoch, h.reason.as_str()), (4, "HolderUnreachable"));
        assert!(adopt(&mut holdings, &published, present).is_empty(), "once");
    }

    /// A peer's report that claims `ip` on sec-a at epoch 1.
    fn claiming(ip: IpAddr) -> Report {
        Report {
            claims: BTreeMap::from([(
                ip,
                Claim {
                    interface: "sec-a".into(),
                    epoch: 1,
                },
            )]),
            ..Report::default()
        }
    }

    #[test]
    fn a_handover_waits_for_a_live_claimant_only() {
        let ip: IpAddr = "192.168.101.50".parse().expect("ip");
        let claim = claiming(ip);
        let mut peers = PeerView::default();
        peers.reports.insert("gw1".into(), claim.clone());
        assert_eq!(other_claimant(ip, "gw2", &peers), Some("gw1"));
        assert_eq!(other_claimant(ip, "gw1", &peers), None, "not myself");
        peers.dead.insert("gw1".into());
        assert_eq!(
            other_claimant(ip, "gw2", &peers),
            None,
            "the dead hold nothing"
        );
        peers.dead.clear();
        peers.reports.insert(
            "gw1".into(),
            Report {
                cut_off: true,
                ..claim
            },
        );
        assert_eq!(other_claimant(ip, "gw2", &peers), None, "nor the cut off");
    }

    fn iface(name: &str, ifindex: u32, addresses: &[(&str, u8)]) -> crate::iface::Interface {
        crate::iface::Interface::up_for_test(name, ifindex, addresses)
    }

    #[test]
    fn release_removes_only_removable_addresses_not_held_here_on_their_interface() {
        let a: Ipv4Addr = "192.168.101.50".parse().unwrap();
        let desired = desired_holding(a, 1);
        let ifaces = [
            iface(
                "sec-a",
                3,
                &[
                    ("192.168.101.12", 24),
                    ("192.168.101.50", 24),
                    ("192.168.101.51", 24),
                ],
            ),
            // A held on the wrong interface (moved there by hand): removed there.
            iface(
                "sec-b",
                4,
                &[("192.168.102.12", 24), ("192.168.101.50", 32)],
            ),
        ];
        let removable: BTreeSet<IpAddr> = ["192.168.101.50", "192.168.101.51", "192.168.102.99"]
            .iter()
            .map(|a| a.parse().unwrap())
            .collect();
        let out = to_release(&ifaces, &desired, &removable);
        let got: Vec<(u32, String, u8)> = out
            .iter()
            .map(|r| (r.ifindex, r.ip.to_string(), r.prefix_len))
            .collect();
        assert_eq!(
            got,
            [
                (3, "192.168.101.51".to_owned(), 24),
                (4, "192.168.101.50".to_owned(), 32)
            ],
            "the held IP stays on its interface; the node's own and unnamed addresses stay"
        );

        assert!(
            to_release(&ifaces, &desired, &BTreeSet::new()).is_empty(),
            "nothing the agent may not remove"
        );
    }

    #[test]
    fn taken_after_the_warm_up_and_a_live_claimants_handover_of_one_detection_time_at_most() {
        use crate::compiler::move_reason::{ASSIGNED, REASSIGNED};
        let ip: IpAddr = "192.168.101.50".parse().unwrap();
        let t0 = Instant::now();
        let detection = Duration::from_millis(400);
        let at = |ms| t0 + Duration::from_millis(ms);
        let none = PeerView::default();
        let mut claimed = PeerView::default();
        claimed.reports.insert("gw1".into(), claiming(ip));
        let take_at = |peers: &PeerView, now, waiting, reason| {
            take(ip, reason, "gw2", peers, now, at(100), waiting, detection)
        };
        assert_eq!(take_at(&none, at(50), None, ASSIGNED), Take::AfterWarmUp);
        assert_eq!(
            take_at(&none, at(100), None, ASSIGNED),
            Take::Now {
                probe: true,
                overdue: None
            },
            "a first claim nobody else makes is probed"
        );
        assert_eq!(
            take_at(&none, at(100), None, REASSIGNED),
            Take::Now {
                probe: false,
                overdue: None
            },
            "a move between gateways is not"
        );
        assert_eq!(
            take_at(&claimed, at(200), None, ASSIGNED),
            Take::AfterHandover {
                holder: "gw1".into(),
                since: at(200)
            },
            "a live claimant: wait, from now"
        );
        assert_eq!(
            take_at(&claimed, at(500), Some(at(200)), ASSIGNED),
            Take::AfterHandover {
                holder: "gw1".into(),
                since: at(200)
            },
            "still within one detection time"
        );
        assert_eq!(
            take_at(&claimed, at(600), Some(at(200)), ASSIGNED),
            Take::Now {
                probe: false,
                overdue: Some("gw1".into())
            },
            "overdue: taken without a probe (the claimant would answer it)"
        );
    }

    /// The kernel's side of [`Ownership`] in these tests: interfaces whose addresses
    /// `add` and `remove` change, hosts that answer probes, and a log of every call.
    #[derive(Default)]
    struct Fake {
        ifaces: Vec<crate::iface::Interface>,
        /// Addresses another host answers probes for, with the problem it makes.
        answered: BTreeMap<IpAddr, String>,
        /// Removals that fail.
        stuck: BTreeSet<IpAddr>,
        log: Vec<String>,
    }

    impl Addresses for Fake {
        async fn add(&mut self, i: &Interface, ip: IpAddr, prefix_len: u8) -> Result<(), String> {
            self.log.push(format!("add {ip}/{prefix_len} {}", i.name));
            let i = self.ifaces.iter_mut().find(|f| f.name == i.name).unwrap();
            i.addresses.push((ip, prefix_len));
            Ok(())
        }

        async fn remove(&mut self, r: &Release) -> Result<(), String> {
            self.log.push(format!("remove {} {}", r.ip, r.interface));
            if self.stuck.contains(&r.ip) {
                return Err("Operation not permitted".to_owned());
            }
            for i in &mut self.ifaces {
                i.addresses.retain(|(a, _)| *a != r.ip);
            }
            Ok(())
        }

        async fn probe(&mut self, _: &Interface, ip: IpAddr) -> Result<Option<String>, String> {
            self.log.push(format!("probe {ip}"));
            Ok(self.answered.get(&ip).cloned())
        }

        fn announce(&mut self, i: &Interface, ip: IpAddr) {
            self.log.push(format!("announce {ip} {}", i.name));
        }

        fn silence(&mut self, ip: IpAddr) {
            self.log.push(format!("silence {ip}"));
        }
    }

    const A: Ipv4Addr = Ipv4Addr::new(192, 168, 101, 50);

    /// gw2, with sec-a on A's network, in a compile that gives it A for `reason`.
    fn gw2_holding_a(reason: &'static str) -> (Fake, Compiled) {
        let fake = Fake {
            ifaces: vec![iface("sec-a", 3, &[("192.168.101.12", 24)])],
            ..Fake::default()
        };
        let compiled = Compiled {
            desired: desired_holding(A, 7),
            holders: vec![Holder {
                ip: A.into(),
                node: "gw2".into(),
                interface: "sec-a".into(),
                policy: "p".into(),
                rule: 0,
                rule_id: 7,
                shared: false,
                epoch: 3,
                reason,
                pods: 0,
            }],
            policy_egress_ips: BTreeSet::from([A.into()]),
            ..Compiled::default()
        };
        (fake, compiled)
    }

    /// A pass of gw2 at `t0 + ms`, warm from `t0 + 100 ms`, detection 400 ms.
    fn pass_at<'a>(t0: Instant, ms: u64, peers: &'a PeerView) -> Pass<'a> {
        Pass {
            me: "gw2",
            now: t0 + Duration::from_millis(ms),
            stamp: "2026-12-03T10:00:00Z",
            peers,
            warm_at: t0 + Duration::from_millis(100),
            detection: Duration::from_millis(400),
            dad: true,
        }
    }

    fn acquire(own: &mut Ownership, fake: &mut Fake, c: &Compiled, pass: &Pass<'_>) -> Done {
        let ifaces = fake.ifaces.clone();
        futures::executor::block_on(own.acquire(fake, c, &ifaces, pass, &[]))
    }

    fn release(own: &mut Ownership, fake: &mut Fake, c: &Compiled, now: Instant) -> Done {
        let ifaces = fake.ifaces.clone();
        futures::executor::block_on(own.release(fake, c, &[], &ifaces, now))
    }

    #[test]
    fn a_first_claim_is_probed_added_announced_and_then_kept() {
        let (mut fake, c) = gw2_holding_a(crate::compiler::move_reason::ASSIGNED);
        let (mut own, t0, peers) = (Ownership::default(), Instant::now(), PeerView::default());
        let done = acquire(&mut own, &mut fake, &c, &pass_at(t0, 100, &peers));
        assert_eq!(
            fake.log,
            [
                "probe 192.168.101.50",
                "add 192.168.101.50/24 sec-a",
                "announce 192.168.101.50 sec-a"
            ]
        );
        assert_eq!(
            (done.changed, done.acquired),
            (1, vec![(IpAddr::V4(A), "Assigned")])
        );
        let held = &own.holdings()[&IpAddr::V4(A)];
        assert_eq!(
            (held.epoch, held.since.as_str()),
            (3, "2026-12-03T10:00:00Z")
        );
        assert_eq!(own.claims()[&IpAddr::V4(A)].epoch, 3);

        let later = Pass {
            stamp: "2026-12-03T10:05:00Z",
            ..pass_at(t0, 5000, &peers)
        };
        let done = acquire(&mut own, &mut fake, &c, &later);
        assert_eq!(fake.log.len(), 3, "already there: nothing more done");
        assert_eq!(done, Done::default());
        assert_eq!(own.holdings()[&IpAddr::V4(A)].since, "2026-12-03T10:00:00Z");
        assert_eq!(
            own.next_pass(later.now, later.detection, later.warm_at),
            None
        );
    }

    #[test]
    fn nothing_is_taken_before_the_warm_up_whose_end_is_the_next_pass() {
        let (mut fake, c) = gw2_holding_a(crate::compiler::move_reason::ASSIGNED);
        let (mut own, t0, peers) = (Ownership::default(), Instant::now(), PeerView::default());
        let early = pass_at(t0, 20, &peers);
        assert_eq!(acquire(&mut own, &mut fake, &c, &early), Done::default());
        assert!(fake.log.is_empty() && own.holdings().is_empty());
        assert_eq!(
            own.next_pass(early.now, early.detection, early.warm_at),
            Some(early.warm_at)
        );
    }

    #[test]
    fn a_handover_waits_for_the_live_claimant_one_detection_time_at_most() {
        use crate::compiler::move_reason::HOLDER_DRAINED;
        let (mut fake, c) = gw2_holding_a(HOLDER_DRAINED);
        let (mut own, t0) = (Ownership::default(), Instant::now());
        let mut peers = PeerView::default();
        peers.reports.insert("gw1".into(), claiming(A.into()));
        let first = pass_at(t0, 200, &peers);
        assert_eq!(acquire(&mut own, &mut fake, &c, &first).changed, 0);
        let deadline = first.now + first.detection;
        assert_eq!(
            own.next_pass(first.now, first.detection, first.warm_at),
            Some(deadline)
        );
        // Still claimed at the deadline: taken, unprobed (the claimant would answer).
        let done = acquire(&mut own, &mut fake, &c, &pass_at(t0, 600, &peers));
        assert_eq!(done.acquired, [(IpAddr::V4(A), "HolderDrained")]);
        assert_eq!(
            fake.log,
            [
                "add 192.168.101.50/24 sec-a",
                "announce 192.168.101.50 sec-a"
            ]
        );
    }

    #[test]
    fn an_address_another_host_answers_for_is_refused_until_a_later_probe() {
        let (mut fake, c) = gw2_holding_a(crate::compiler::move_reason::ASSIGNED);
        fake.answered
            .insert(A.into(), "in use: MAC 02:00:00:00:00:99 answered".into());
        let (mut own, t0, peers) = (Ownership::default(), Instant::now(), PeerView::default());
        let first = pass_at(t0, 100, &peers);
        let done = acquire(&mut own, &mut fake, &c, &first);
        assert_eq!(
            done.problems,
            ["egress IP 192.168.101.50: in use: MAC 02:00:00:00:00:99 answered"]
        );
        let refused: Vec<IpAddr> = own.refused().map(|(ip, _)| ip).collect();
        assert_eq!(refused, [IpAddr::V4(A)]);
        assert_eq!(
            own.next_pass(first.now, first.detection, first.warm_at),
            Some(first.now + REPROBE)
        );
        // Within REPROBE: refused again without a probe.
        let done = acquire(&mut own, &mut fake, &c, &pass_at(t0, 1000, &peers));
        assert_eq!((done.problems.len(), fake.log.len()), (1, 1));
        // The host went away: the next probe after REPROBE finds nobody.
        fake.answered.clear();
        let done = acquire(&mut own, &mut fake, &c, &pass_at(t0, 5200, &peers));
        assert_eq!((done.changed, own.refused().count()), (1, 0));
        assert_eq!(fake.log[1], "probe 192.168.101.50");
    }

    #[test]
    fn a_release_removes_the_address_first_and_its_map_entries_linger() {
        let (mut fake, c) = gw2_holding_a(crate::compiler::move_reason::ASSIGNED);
        let (mut own, t0, peers) = (Ownership::default(), Instant::now(), PeerView::default());
        acquire(&mut own, &mut fake, &c, &pass_at(t0, 100, &peers));
        own.remember(&c.desired);
        // A moved to gw1: gw2's desired state no longer holds it.
        let moved = Compiled {
            desired: Desired::default(),
            holders: vec![Holder {
                node: "gw1".into(),
                ..c.holders[0].clone()
            }],
            ..c.clone()
        };
        let now = t0 + Duration::from_secs(1);
        let done = release(&mut own, &mut fake, &moved, now);
        assert_eq!(done.changed, 1);
        assert_eq!(
            fake.log[fake.log.len() - 2..],
            ["silence 192.168.101.50", "remove 192.168.101.50 sec-a"],
            "pending announcements stop before the address goes"
        );
        assert!(own.holdings().is_empty() && own.claims().is_empty());
        let serving = own.serving(&moved.desired);
        assert_eq!(
            serving.v4.egress_ips, c.desired.v4.egress_ips,
            "A still served"
        );
        assert_eq!(serving.v4.rules, c.desired.v4.rules);
        let detection = Duration::from_millis(400);
        assert_eq!(own.next_pass(now, detection, t0), Some(now + LINGER));
        // Past the linger: gone from the maps too.
        release(&mut own, &mut fake, &moved, now + LINGER);
        assert!(matches!(own.serving(&moved.desired), Cow::Borrowed(_)));
        assert_eq!(own.next_pass(now + LINGER, detection, t0), None);
    }

    fn snapshot(claims: &[(&str, &str)], dead: &[&str]) -> PeerSnapshot {
        let mut claimants: BTreeMap<IpAddr, BTreeSet<String>> = BTreeMap::new();
        for (node, ip) in claims {
            let ip = ip.parse().unwrap();
            claimants.entry(ip).or_default().insert((*node).to_owned());
        }
        PeerSnapshot {
            claimants,
            dead: dead.iter().map(|n| (*n).to_owned()).collect(),
        }
    }

    #[test]
    fn what_is_held_is_announced_again_when_a_peer_lets_it_go_or_comes_back() {
        let (a, b): (IpAddr, IpAddr) = (A.into(), "192.168.102.50".parse().unwrap());
        let held = || [a, b].into_iter();
        let quiet = snapshot(&[], &[]);
        assert!(
            to_reannounce(held(), &quiet, &quiet).is_empty(),
            "nothing new"
        );
        // gw1 took A at a heal in the same millisecond as this node, and let it go: its
        // announcements may have reached a neighbour after ours.
        let both = snapshot(&[("gw1", "192.168.101.50")], &[]);
        assert_eq!(
            to_reannounce(held(), &both, &quiet),
            BTreeMap::from([(a, "gw1 let it go".to_owned())])
        );
        assert!(
            to_reannounce(held(), &quiet, &both).is_empty(),
            "a claim appearing is the compile's business, not an announcement's"
        );
        // A heal: a peer reachable again may have announced on its side.
        let partitioned = snapshot(&[], &["gw1"]);
        let again = to_reannounce(held(), &partitioned, &quiet);
        assert_eq!(again.keys().copied().collect::<Vec<_>>(), [a, b]);
        assert_eq!(again[&a], "gw1 reachable again");
        assert!(to_reannounce(held(), &quiet, &partitioned).is_empty());
    }

    #[test]
    fn reannounce_skips_what_this_pass_took_and_remembers_what_it_saw() {
        let (mut fake, c) = gw2_holding_a(crate::compiler::move_reason::ASSIGNED);
        let (mut own, t0) = (Ownership::default(), Instant::now());
        let quiet = PeerView::default();
        acquire(&mut own, &mut fake, &c, &pass_at(t0, 100, &quiet));
        let mut partitioned = PeerView::default();
        partitioned.dead.insert("gw1".to_owned());
        let ifaces = fake.ifaces.clone();
        own.reannounce(&mut fake, &ifaces, &partitioned, "gw2", &[]);
        fake.log.clear();
        let fresh = [IpAddr::from(A)];
        assert!(
            own.reannounce(&mut fake, &ifaces, &quiet, "gw2", &fresh)
                .is_empty()
        );
        assert!(fake.log.is_empty(), "taken in this pass: announced already");
        own.reannounce(&mut fake, &ifaces, &partitioned, "gw2", &[]);
        let again = own.reannounce(&mut fake, &ifaces, &quiet, "gw2", &[]);
        assert_eq!(again, [(IpAddr::from(A), "gw1 reachable again".to_owned())]);
        assert_eq!(fake.log, ["announce 192.168.101.50 sec-a"]);
        assert!(
            own.reannounce(&mut fake, &ifaces, &quiet, "gw2", &[])
                .is_empty()
        );
    }

    #[test]
    fn a_failed_removal_is_a_problem_and_the_address_stays_held() {
        let (mut fake, c) = gw2_holding_a(crate::compiler::move_reason::ASSIGNED);
        let (mut own, t0, peers) = (Ownership::default(), Instant::now(), PeerView::default());
        acquire(&mut own, &mut fake, &c, &pass_at(t0, 100, &peers));
        fake.stuck.insert(A.into());
        let gone = Compiled {
            desired: Desired::default(),
            holders: Vec::new(),
            ..c.clone()
        };
        let done = release(&mut own, &mut fake, &gone, t0 + Duration::from_secs(1));
        assert_eq!(
            done.problems,
            ["egress IP 192.168.101.50: Operation not permitted"]
        );
        assert!(
            own.holdings().contains_key(&IpAddr::V4(A)),
            "still on sec-a"
        );
        // An address this node may not remove (no policy names it, never held) stays.
        let mut own = Ownership::default();
        let unnamed = Compiled {
            policy_egress_ips: BTreeSet::new(),
            ..gone
        };
        fake.stuck.clear();
        let done = release(&mut own, &mut fake, &unnamed, t0);
        assert_eq!(done, Done::default());
    }
}
