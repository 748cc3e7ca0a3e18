//! The next-hop generation. A conntrack entry caches the next hop (MAC addresses, output
//! interface) that its flow's first packet's FIB lookup found, and established packets
//! use it without a lookup while its generation is the one in the `NH_GEN` map
//! (`egress_common::conntrack::NextHop`). This task bumps `NH_GEN` on every IPv4/IPv6
//! route and neighbour notification from the kernel (`RTNLGRP_IPV4_ROUTE`,
//! `RTNLGRP_IPV6_ROUTE`, `RTNLGRP_NEIGH`), so that the next packet of every flow looks
//! its route up again. It listens on a netlink connection of its own, not through the
//! reconciler's subscription: neighbour entries change state all the time (reachable,
//! stale, probe...), which must cost one map write, not a reconcile pass.
//!
//! Every notification bumps, without asking what changed: a spurious bump costs each live
//! flow one FIB lookup, a missed one would keep a flow on a dead next hop. What no
//! notification reports (a change while no agent runs, a lost message on a socket
//! overrun) the datapath heals by itself: a cached next hop older than
//! `NEXT_HOP_MAX_AGE_NS` (1 s) is looked up again. The map write itself is
//! [`crate::datapath::nexthop`]'s, as every map write is the datapath's.

use std::path::Path;

use anyhow::{Context as _, Result};
use futures::{FutureExt as _, StreamExt as _};
use rtnetlink::MulticastGroup;

use crate::datapath::nexthop::Generation;

/// Start the task that bumps `NH_GEN` (pinned under `pin_dir`) on route and neighbour
/// changes. Bumps once at start: a next hop cached before this agent started may be
/// stale.
pub fn start(pin_dir: &Path) -> Result<()> {
    let mut generation = Generation::open(pin_dir)?;
    let (connection, _handle, mut messages) = rtnetlink::new_multicast_connection(&[
        MulticastGroup::Ipv4Route,
        MulticastGroup::Ipv6Route,
        MulticastGroup::Neigh,
    ])
    .context("failed to subscribe to route and neighbour notifications")?;
    bump(&mut generation);
    tokio::spawn(connection);
    tokio::spawn(async move {
        while messages.next().await.is_some() {
            // One bump covers every notification already queued.
            while let Some(Some(_)) = messages.next().now_or_never() {}
            bump(&mut generation);
        }
        tracing::warn!(
            "route and neighbour notifications stopped: cached next hops now follow \
             changes within a second (their age bound) instead of at once"
        );
    });
    Ok(())
}

/// Bump the generation. Logged, not fatal: the age bound still holds.
fn bump(generation: &mut Generation) {
    if let Err(e) = generation.bump() {
        tracing::warn!("failed to bump the next-hop generation: {e}");
    }
}
