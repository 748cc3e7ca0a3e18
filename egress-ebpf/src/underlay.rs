//! Underlay addresses read in words. An [`Underlay`] is `[u8; 16]`, of alignment one, so
//! LLVM reads it byte by byte (the BPF target emits no load it cannot prove aligned):
//! sixteen loads and the shifts that put them together, per address. Comparing the
//! gateway with this node's address and handing it to the tunnel key took about 180
//! instructions on every tunneled packet. The ABI structs hold their underlay fields at
//! 4-aligned offsets and are aligned to 4 or more (asserted below, field by field), so a
//! reference to such a field is 4-aligned and can be read as four words.

use egress_common::{
    config::Config,
    conntrack::{CtEntryV4, CtEntryV6},
    policy::{PolicyValueV4, PolicyValueV6},
    underlay::Underlay,
};

use crate::handoff::Origin;

/// An underlay address as four words, each holding four of its bytes in order
/// (native-endian words, as `bpf_tunnel_key::remote_ipv6` wants them).
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct Words(pub [u32; 4]);

/// The third word of an IPv4-mapped address (`::ffff:a.b.c.d`): bytes 0, 0, 0xff, 0xff.
const V4_MAPPED_WORD: u32 = u32::from_ne_bytes([0, 0, 0xff, 0xff]);

impl Words {
    /// `u` read in four word loads.
    ///
    /// # Safety
    /// `u` is 4-aligned.
    #[inline(always)]
    unsafe fn read(u: &Underlay) -> Self {
        let p = u.as_ptr().cast::<u32>();
        // SAFETY: 16 readable bytes, 4-aligned (the caller's word).
        unsafe { Self([p.read(), p.add(1).read(), p.add(2).read(), p.add(3).read()]) }
    }

    /// `u` wherever it sits, put together byte by byte (for an address on the stack,
    /// whose alignment nothing promises).
    #[inline(always)]
    pub fn of(u: &Underlay) -> Self {
        let w = |i: usize| u32::from_ne_bytes([u[i], u[i + 1], u[i + 2], u[i + 3]]);
        Self([w(0), w(4), w(8), w(12)])
    }

    /// The IPv4 address of an IPv4-mapped address, in host order (as
    /// `bpf_tunnel_key::remote_ipv4` wants it); `None` for IPv6.
    #[inline(always)]
    pub fn v4_host(self) -> Option<u32> {
        let [a, b, c, d] = self.0;
        if a == 0 && b == 0 && c == V4_MAPPED_WORD {
            Some(u32::from_be(d))
        } else {
            None
        }
    }
}

/// A safe reader of one underlay field of one struct: the field's offset is a multiple
/// of 4 and the struct's alignment at least 4 (checked at compile time), so any
/// reference to the struct puts the field at a 4-aligned address.
macro_rules! field {
    ($(#[$doc:meta])* $name:ident, $T:ty, $f:ident) => {
        $(#[$doc])*
        #[inline(always)]
        pub fn $name(v: &$T) -> Words {
            const {
                assert!(core::mem::offset_of!($T, $f) % 4 == 0);
                assert!(core::mem::align_of::<$T>() >= 4);
            };
            // SAFETY: a 4-aligned field of a 4-aligned struct (asserted above).
            unsafe { Words::read(&v.$f) }
        }
    };
}

field!(
    /// This node's underlay address.
    node_ip,
    Config,
    node_ip
);
field!(
    /// The gateway of an IPv4 policy entry.
    gateway,
    PolicyValueV4,
    gateway
);
field!(
    /// The gateway of an IPv6 policy entry.
    gateway6,
    PolicyValueV6,
    gateway
);
field!(
    /// The node of the pod of an IPv4 flow.
    pod_node,
    CtEntryV4,
    pod_node
);
field!(
    /// The node of the pod of an IPv6 flow.
    pod_node6,
    CtEntryV6,
    pod_node
);
field!(
    /// The node of the pod that sent a packet into the gateway path.
    origin,
    Origin,
    pod_node
);
