//! Stable counter reasons. Numbers are never reused; a retired reason keeps its number.
//! Indexes into the per-CPU `COUNTERS` array.

#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct Counter {
    pub packets: u64,
    pub bytes: u64,
}
const _: () = assert!(core::mem::size_of::<Counter>() == 16);

pub const MAX_REASONS: u32 = 64;

macro_rules! reasons {
    ($($(#[$m:meta])* $name:ident = $num:literal, $text:literal;)*) => {
        pub mod reason {
            $($(#[$m])* pub const $name: u32 = $num;)*
        }
        /// Every reason as (number, name, description), in number order.
        pub const ALL: &[(u32, &str, &str)] = &[$(($num, stringify!($name), $text)),*];
    };
}

reasons! {
    TUNNELED = 1, "selected packet sent into the tunnel to its gateway";
    EXCLUDED = 2, "destination in an except prefix: passed untouched";
    FALLTHROUGH = 3, "rule has no gateway, failurePolicy Fallthrough: passed untouched";
    LOCAL_GATEWAY = 4, "selected packet whose gateway is this node: gateway path taken directly";
    SNAT_NEW = 5, "new flow translated to an egress IP";
    SNAT_HIT = 6, "packet of an established flow translated";
    REVERSE_NAT = 7, "reply translated back to the pod";
    RETURN_TUNNELED = 8, "reply sent back through the tunnel to the pod's node";
    RETURN_DELIVERED = 9, "reply from the tunnel delivered to a local pod";
    FORWARDED = 10, "packet redirected out of its egress interface";
    MSS_CLAMPED = 11, "TCP SYN MSS lowered to fit the tunnel";
    MALFORMED_PASSED = 12, "packet from a pod that could not be parsed: passed untouched";
    FRAG_NEEDED_SENT = 13, "packet of a selected pod too big for the gateway's egress interface: answered with ICMP fragmentation needed (IPv6: packet too big) carrying that interface's MTU, from the egress IP to the pod, which lowers its path MTU; the packet is not sent";
    RESET_MIDSTREAM = 14, "mid-stream TCP segment of an interface rule with no flow here (the gateway changed): reset so the pod fails fast";
    ICMP_ERROR_XLATED = 15, "ICMP error about a translated flow (fragmentation needed, unreachable, time exceeded) translated back to the pod, quoted packet included";
    CT_EXPIRED = 16, "conntrack entry of a flow idle past its timeout in both directions, removed by the agent's sweeper (packets: entries; bytes: 0)";
    TIME_EXCEEDED_SENT = 17, "packet of a selected pod whose TTL (hop limit) would reach zero at the gateway: answered with ICMP time exceeded from the egress IP to the pod (what traceroute shows as the gateway's hop); one the pod may not send through the rule is DROP_TTL_EXCEEDED";
    TO_POD_DEVICE = 18, "reply of a pod's flow through a rule (or an ICMP error about one) delivered into the pod through the device the agent bound it to (POD_DEVICES_*, a veth whose peer is the pod's), not by the node's routing: around the CNI's switch and its stateful ACLs, which never saw the request; counted besides RETURN_DELIVERED or FORWARDED";
    DROP_NO_GATEWAY = 32, "rule has no usable gateway (failurePolicy Drop)";
    DROP_UNKNOWN_SENDER = 33, "tunneled packet from an address that is not a known node";
    DROP_SPOOFED_SOURCE = 34, "tunneled packet whose inner source is not a pod of the sender";
    DROP_UNKNOWN_RULE = 35, "tunneled packet with a rule id this gateway does not serve";
    DROP_NO_CONNTRACK = 36, "packet to an egress IP without a conntrack entry";
    DROP_PORT_EXHAUSTED = 37, "no free SNAT port for a new flow";
    DROP_CT_INSERT = 38, "conntrack entry could not be written";
    DROP_MALFORMED = 39, "truncated or inconsistent headers";
    DROP_FRAGMENT = 40, "IP fragment of a selected flow (cannot be translated)";
    DROP_UNSUPPORTED_PROTO = 41, "protocol other than TCP, UDP, ICMP echo in a selected flow";
    DROP_FIB = 42, "no route, or the route leaves by another interface than the rule's";
    DROP_TTL_EXCEEDED = 43, "TTL would reach zero, not answered: a reply from outside, or a pod's packet through a rule it may not use (a pod's own is answered: TIME_EXCEEDED_SENT)";
    DROP_MTU = 44, "packet too big for the gateway's egress interface that cannot be answered: IPv4 without DF (a router would fragment it), IP options over 20 bytes, IPv6 extension headers, a packet the kernel will not resize";
    DROP_TUNNEL_KEY = 45, "tunnel key could not be set";
    DROP_NOT_LOCAL_POD = 46, "reply from the tunnel for a pod that is not on this node";
    DROP_NOT_READY = 47, "tunneled or reply packet before the agent configured this node";
    DROP_IPV6_EXT_HDR = 48, "IPv6 extension header in a selected flow (not walked)";
    DROP_ICMP_UNKNOWN_FLOW = 49, "ICMP error to an egress IP quoting a flow without a conntrack entry";
    DROP_ICMP_QUOTE = 50, "ICMP error to an egress IP whose quoted packet cannot be read (truncated, IP options or IPv6 extension headers, a later fragment, not TCP, UDP or echo)";
    DROP_NOT_ADMITTED = 51, "new flow of a rule served here from a pod that no policy selects for that rule (a forged or stale tunnel packet, or a pod on this gateway)";
    DROP_POD_FLOW_LIMIT = 53, "new flow of a pod that already holds its maximum of live flows on this gateway (--max-flows-per-pod): one pod cannot take every port of a destination";
    DROP_POLICY_MAP_FULL = 54, "packet of a selected pod whose policy entries did not fit this node's policy map, to a destination a rule covers: dropped, never sent with the pod's own address (--policy-map-entries)";
    DROP_NETWORK_POLICY = 55, "packet of a selected pod that its egress NetworkPolicies do not allow (destination, protocol or port), to a destination a rule redirects: dropped before the tunnel, as the CNI would have";
    DROP_UNKNOWN_POD = 52, "packet from a pod address the agent has not seen yet, to a destination that a rule covers (--unknown-pods drop)";
    DROP_SOURCE_DEVICE = 56, "packet from a pod address that the agent bound to another device of this node (POD_DEVICES_*): a pod sending as another pod, dropped whatever its destination";
}

/// Name of a reason number, or `None` for a number that was never assigned.
pub fn name(reason: u32) -> Option<&'static str> {
    let mut i = 0;
    while i < ALL.len() {
        if ALL[i].0 == reason {
            return Some(ALL[i].1);
        }
        i += 1;
    }
    None
}

/// Whether the reason counts a dropped packet.
pub const fn is_drop(reason: u32) -> bool {
    reason >= 32
}
