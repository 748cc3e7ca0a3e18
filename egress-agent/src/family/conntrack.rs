//! Each family's conntrack key and entry in plain terms: what the sweeper and the dump
//! read of `CT_V4` / `CT_V6` (see [`super::Maps::CtKey`]).

use std::{
    fmt::Debug,
    net::{IpAddr, SocketAddr},
    sync::{Arc, Mutex},
};

use aya::Pod;
use egress_common::{
    conntrack::{CtEntryV4, CtEntryV6, CtKeyV4, CtKeyV6, dir, expired, reset_over},
    underlay::Underlay,
};

/// One address family's conntrack key, with its entry type.
pub trait CtKey: Pod + PartialEq + Debug {
    type Entry: Pod + Debug;
    /// A pod address of this family (the key of `FLOWS_V4` / `FLOWS_V6`).
    type Pod: Pod + Ord + Debug;
    /// The pod that started the flow, for an original-direction key.
    fn original_pod(&self) -> Option<Self::Pod>;
    /// The key of the other direction's entry of the flow that (`self`, `e`) belongs to.
    fn partner(&self, e: &Self::Entry) -> Self;
    /// Whether `e`, this key's entry, is idle past its timeout at `now`.
    fn expired(&self, e: &Self::Entry, now: u64) -> bool;
    /// Whether `e` ends its flow by itself at `now`: a RST crossed it and it is idle past
    /// the reset timeout (`egress_common::conntrack::reset_over`).
    fn reset_over(&self, e: &Self::Entry, now: u64) -> bool;
    /// This key and its entry in plain types; `None` for a reply-direction key.
    fn flow(&self, e: &Self::Entry) -> Option<Flow>;
}

/// A conntrack flow (its original-direction entry), of either family. Ports in network
/// order, as in the map.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Flow {
    pub proto: u8,
    pub src: (IpAddr, u16),
    pub dst: (IpAddr, u16),
    pub xlate: (IpAddr, u16),
    pub rule_id: u32,
    pub ifindex: u32,
    pub pod_node: Underlay,
}

impl Flow {
    /// This flow as a [`Remap`] when its translated port is not the pod's own (another
    /// flow to the same destination held that port here).
    pub fn remap(&self) -> Option<Remap> {
        let port = u16::from_be;
        (self.xlate.1 != self.src.1).then(|| Remap {
            proto: self.proto,
            pod: SocketAddr::new(self.src.0, port(self.src.1)),
            dst: SocketAddr::new(self.dst.0, port(self.dst.1)),
            egress: SocketAddr::new(self.xlate.0, port(self.xlate.1)),
        })
    }
}

/// A translation whose source port the egress IP's holder remapped: the pod's port was
/// taken (another pod's flow to the same destination and port had it). The holder shares
/// these with the other gateways ([`Outbox`], the hellos' remaps), so that one taking the
/// egress IP over gives the flow the same port (`REMAP_V4` / `_V6`). Ports in host order;
/// all three addresses of one family.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Remap {
    pub proto: u8,
    pub pod: SocketAddr,
    pub dst: SocketAddr,
    pub egress: SocketAddr,
}

impl Remap {
    /// The flow it translates: (protocol, pod, destination).
    pub fn flow(&self) -> (u8, SocketAddr, SocketAddr) {
        (self.proto, self.pod, self.dst)
    }
}

/// The remapped translations of the flows this gateway holds, as its conntrack sweeper
/// last saw them (replaced at the end of each walk).
pub type Outbox = Arc<Mutex<Vec<Remap>>>;

macro_rules! ct_key {
    ($Key:ty, $Entry:ty, $Pod:ty) => {
        impl CtKey for $Key {
            type Entry = $Entry;
            type Pod = $Pod;

            fn original_pod(&self) -> Option<$Pod> {
                (self.dir == dir::ORIGINAL).then_some(self.src)
            }

            fn partner(&self, e: &$Entry) -> Self {
                if self.dir == dir::ORIGINAL {
                    Self {
                        src: self.dst,
                        dst: e.xlate_addr,
                        src_port_be: self.dst_port_be,
                        dst_port_be: e.xlate_port_be,
                        proto: self.proto,
                        dir: dir::REPLY,
                        _pad: [0; 2],
                    }
                } else {
                    Self {
                        src: e.xlate_addr,
                        dst: self.src,
                        src_port_be: e.xlate_port_be,
                        dst_port_be: self.src_port_be,
                        proto: self.proto,
                        dir: dir::ORIGINAL,
                        _pad: [0; 2],
                    }
                }
            }

            fn expired(&self, e: &$Entry, now: u64) -> bool {
                expired(self.proto, e.state, e.last_seen_ns, now)
            }

            fn reset_over(&self, e: &$Entry, now: u64) -> bool {
                reset_over(self.proto, e.state, e.last_seen_ns, now)
            }

            fn flow(&self, e: &$Entry) -> Option<Flow> {
                (self.dir == dir::ORIGINAL).then(|| Flow {
                    proto: self.proto,
                    src: (IpAddr::from(self.src), self.src_port_be),
                    dst: (IpAddr::from(self.dst), self.dst_port_be),
                    xlate: (IpAddr::from(e.xlate_addr), e.xlate_port_be),
                    rule_id: e.rule_id,
                    ifindex: e.ifindex,
                    pod_node: e.pod_node,
                })
            }
        }
    };
}
ct_key!(CtKeyV4, CtEntryV4, [u8; 4]);
ct_key!(CtKeyV6, CtEntryV6, [u8; 16]);
