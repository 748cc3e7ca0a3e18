//! Underlay (node) addresses: the outer addresses of the tunnel between nodes.
//!
//! The underlay is IPv4 or IPv6, so every underlay field is 16 bytes: an IPv6 address as
//! is, an IPv4 address IPv4-mapped (`::ffff:a.b.c.d`). Zero means "none".

use core::net::{IpAddr, Ipv6Addr};

/// A node's underlay address, 16 bytes in network order (IPv4 as `::ffff:a.b.c.d`).
pub type Underlay = [u8; 16];

/// The first 12 bytes of an IPv4-mapped IPv6 address.
pub const V4_MAPPED_PREFIX: [u8; 12] = [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff];

/// `a.b.c.d` as `::ffff:a.b.c.d`.
#[inline(always)]
pub const fn from_v4(a: [u8; 4]) -> Underlay {
    [
        0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff, a[0], a[1], a[2], a[3],
    ]
}

/// The IPv4 address inside an IPv4-mapped underlay address, `None` for IPv6.
#[inline(always)]
pub fn as_v4(u: &Underlay) -> Option<[u8; 4]> {
    // Two word compares: cheaper for the verifier and the JIT than twelve byte compares.
    let hi = u64::from_ne_bytes([u[0], u[1], u[2], u[3], u[4], u[5], u[6], u[7]]);
    let mid = u32::from_be_bytes([u[8], u[9], u[10], u[11]]);
    if hi == 0 && mid == 0x0000_ffff {
        Some([u[12], u[13], u[14], u[15]])
    } else {
        None
    }
}

/// An address of either family as an underlay address.
pub fn from_ip(ip: IpAddr) -> Underlay {
    match ip {
        IpAddr::V4(a) => from_v4(a.octets()),
        IpAddr::V6(a) => a.octets(),
    }
}

/// The address an underlay value stands for (IPv4-mapped back to IPv4).
pub fn to_ip(u: &Underlay) -> IpAddr {
    match as_v4(u) {
        Some(a) => IpAddr::from(a),
        None => IpAddr::V6(Ipv6Addr::from(*u)),
    }
}

/// The bytes of `struct bpf_tunnel_key` that the datapath passes to
/// `bpf_skb_get_tunnel_key` and `bpf_skb_set_tunnel_key`: the layout up to and including
/// `tunnel_label` (`tunnel_id`, `remote_ipv4` / `remote_ipv6`, `tunnel_tos`, `tunnel_ttl`,
/// `tunnel_ext`, `tunnel_label`), without `local_ipv4` / `local_ipv6`, which the datapath
/// never sets. Linux 5.19 added those 16 bytes (`sizeof` became 44) and kept 28 among the
/// sizes both helpers accept; before it, 28 was `sizeof` itself and anything larger was
/// refused with EINVAL (every tunneled packet a `DROP_TUNNEL_KEY`). So 28 is accepted by
/// every kernel the datapath runs on, whatever it reports: no probe to get wrong.
pub const TUNNEL_KEY_SIZE: u32 = 28;

/// The sizes each kernel's `bpf_skb_set_tunnel_key` accepts (`net/core/filter.c`): before
/// 5.19 (`sizeof` 28 and the older layouts ending at `tunnel_label`, `tunnel_ext` and
/// `remote_ipv6[1]`, the last for IPv4 only), and from 5.19 on (`sizeof` 44, and 28 added
/// to the older layouts).
pub const TUNNEL_KEY_SIZES_BEFORE_5_19: [u32; 4] = [28, 24, 22, 8];
pub const TUNNEL_KEY_SIZES_SINCE_5_19: [u32; 5] = [44, 28, 24, 22, 8];

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trips_both_families() {
        for s in ["192.0.2.7", "2001:db8::7", "0.0.0.1"] {
            let ip: IpAddr = s.parse().unwrap();
            assert_eq!(to_ip(&from_ip(ip)), ip, "{s}");
        }
        assert_eq!(as_v4(&from_v4([10, 0, 0, 1])), Some([10, 0, 0, 1]));
        assert_eq!(as_v4(&"::1".parse::<Ipv6Addr>().unwrap().octets()), None);
        assert_eq!(from_v4([1, 2, 3, 4])[..12], V4_MAPPED_PREFIX);
    }

    /// The size works on old and new kernels, and holds what the datapath writes: the
    /// IPv6 remote (bytes 4..20) and the flow label (24..28), which the 8-byte layout
    /// lacks (IPv4 only) and the 22- and 24-byte ones cut.
    #[test]
    fn the_tunnel_key_size_is_one_every_kernel_accepts_with_an_ipv6_remote() {
        assert!(TUNNEL_KEY_SIZES_BEFORE_5_19.contains(&TUNNEL_KEY_SIZE));
        assert!(TUNNEL_KEY_SIZES_SINCE_5_19.contains(&TUNNEL_KEY_SIZE));
        const REMOTE_IPV6_END: u32 = 20;
        const TUNNEL_LABEL_END: u32 = 28;
        let fits = |size: u32| size >= REMOTE_IPV6_END.max(TUNNEL_LABEL_END);
        assert!(fits(TUNNEL_KEY_SIZE));
        // The largest size both eras accept is the one chosen.
        let common = TUNNEL_KEY_SIZES_SINCE_5_19
            .iter()
            .filter(|s| TUNNEL_KEY_SIZES_BEFORE_5_19.contains(s))
            .max();
        assert_eq!(common, Some(&TUNNEL_KEY_SIZE));
    }
}
