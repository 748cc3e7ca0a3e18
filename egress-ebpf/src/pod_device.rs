//! The last hop of a reply to a pod of this node: into the pod itself, through the device
//! the agent bound the pod to (`POD_DEVICES_*`), when that is a veth whose peer is the
//! pod's (`pod_device_flags::REPLY_TO_PEER`). The node's routing would hand the reply to
//! the CNI: on OVN-Kubernetes to its management port, into the pod's logical switch and
//! its stateful ACLs, which never saw the request leave (it left through `from_pod`'s
//! redirect) and drop the reply of a pod isolated for ingress.
//!
//! Only replies come here. On a gateway, a packet its conntrack translated back to a pod
//! of its own node (`from_secondary`, `icmp_error`): [`into4`]. From the tunnel
//! (`RETURN_VNI`, a known node, a pod of this node): [`from_gateway4`], which also
//! requires the sender to be the gateway this node sends the pod's traffic to the
//! reply's source through (the pod's policy entry for that address), as the sender of a
//! real reply is. The tunnel is not authenticated, and on OVN-Kubernetes any pod can
//! send from its node's address (the SNAT of its traffic to other nodes): a packet
//! forged that way by a pod of a worker, or naming a source the pod has no rule for,
//! takes the node's routing as before, into the CNI and its ACLs.

use aya_ebpf::{
    btf_maps::lpm_trie::Key,
    helpers::generated::{bpf_redirect_peer, bpf_skb_change_type},
    programs::TcContext,
};
use egress_common::{
    counters::reason,
    policy::{PodDeviceValue, action, pod_device_flags::REPLY_TO_PEER},
    underlay::Underlay,
};

use crate::{
    counters::count,
    maps::{POD_DEVICES_V4, POD_DEVICES_V6, SELECTED_V4, SELECTED_V6},
    policy,
    scratch::Scratch,
    underlay::{self, Words},
};

/// `PACKET_HOST`: the pod's stack takes only packets addressed to it, and a redirect to
/// the peer keeps the type the packet arrived with (a tunnel's inner frame may carry
/// another host's MAC).
const PACKET_HOST: u32 = 0;

/// The redirect of a packet to local pod `pod` into the pod, counted as
/// `TO_POD_DEVICE`; `None` when the pod is not bound to a veth whose peer it is (the
/// caller routes it as before). Called at TC ingress only, where a redirect to the peer
/// is allowed. Inline for IPv4 (a call from `from_tunnel`'s IPv4 path would stack its
/// frame on that path's, which has no room left; inline, its locals share that frame
/// with the gateway path's), out of line for IPv6 (whose path keeps its state in the
/// scratch slot and its frame small).
#[inline(always)]
pub fn into4(ctx: &TcContext, pod: &[u8; 4]) -> Option<i32> {
    // SAFETY: the value is copied out at once.
    let d = unsafe { POD_DEVICES_V4.get(pod) }.copied()?;
    into(ctx, d)
}

/// [`into4`] for a reply from the tunnel: `ip_src` to local pod `pod`, sent by `sender`,
/// which must be the gateway of the pod's policy entry for `ip_src` (else `None`).
#[inline(always)]
pub fn from_gateway4(
    ctx: &TcContext,
    pod: &[u8; 4],
    ip_src: &[u8; 4],
    sender: &Underlay,
) -> Option<i32> {
    // SAFETY: the values are read at once.
    let lengths = unsafe { SELECTED_V4.get(pod) }?.lengths;
    let entry = policy::lookup4(*pod, *ip_src, lengths)?;
    if entry.action != action::FORWARD || underlay::gateway(entry) != Words::of(sender) {
        return None;
    }
    into4(ctx, pod)
}

/// [`from_gateway4`] for IPv6: the packet's headers are `s.ip6` (the pod its
/// destination), its sender `s.x6.origin.pod_node` (in the scratch slot: an address
/// taken on the caller's stack grew its frame past the verifier's limit); `s.policy6`
/// and `s.dest6` are the policy lookup's keys.
#[inline(never)]
pub fn from_gateway6(ctx: &TcContext, s: &mut Scratch) -> Option<i32> {
    // By reference: a copy of the key would be made byte by byte. SAFETY: as above.
    let pod: &[u8; 16] = &s.ip6.dst;
    let lengths = unsafe { SELECTED_V6.get(pod) }?.lengths;
    s.policy6.pod = s.ip6.dst;
    s.dest6 = Key::new(128, s.ip6.src);
    let entry = policy::lookup6(&mut s.policy6, &s.dest6, &lengths)?;
    let sender = Words::of(&s.x6.origin.pod_node);
    if entry.action != action::FORWARD || underlay::gateway6(entry) != sender {
        return None;
    }
    into6(ctx, &s.ip6.dst)
}

/// [`into4`] for an IPv6 pod.
#[inline(never)]
pub fn into6(ctx: &TcContext, pod: &[u8; 16]) -> Option<i32> {
    // SAFETY: as above.
    let d = unsafe { POD_DEVICES_V6.get(pod) }.copied()?;
    into(ctx, d)
}

#[inline(always)]
fn into(ctx: &TcContext, d: PodDeviceValue) -> Option<i32> {
    if d.flags & REPLY_TO_PEER == 0 {
        return None;
    }
    // SAFETY: the helpers take the program's own context.
    unsafe { bpf_skb_change_type(ctx.skb.skb, PACKET_HOST) };
    count(ctx, reason::TO_POD_DEVICE);
    // SAFETY: as above; the redirect happens when the program returns.
    Some(unsafe { bpf_redirect_peer(d.ifindex, 0) } as i32)
}
