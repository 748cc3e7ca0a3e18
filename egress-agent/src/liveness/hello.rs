//! The hello datagram agents send each other over the underlay (UDP, next to the tunnel's
//! port). Big-endian, versioned by its magic, at most [`MAX_LEN`] bytes:
//!
//! ```text
//! 0   "EGH1"            magic and version
//! 4   flags u8          bit 0: the sender is cut off (holds nothing); bit 1: its agent
//!                       is restarting (SIGTERM): its datapath keeps serving meanwhile
//! 5   grace_s u16       with bit 1: how long to count the sender alive without hellos
//! 7   reserved u8       zero
//! 8   incarnation u32   random per agent start: a restarted sender starts its sequence anew
//! 12  seq u64           per sender, +1 per hello (to any peer)
//! 20  sent_us u64       sender's monotonic clock
//! 28  echo_us u64       the receiver's own sent_us last seen by the sender (0: none)
//! 36  echo_held_us u32  how long the sender held that echo before this hello
//! 40  name              u8 length + UTF-8 (the sender's node name)
//!     seen              u8 count, each u8 length + name: gateways the sender hears directly
//!     down              u8 count, each u8 length + name: the sender's interfaces that are down
//!     claims            u8 count, each: family u8 (4 | 6), address (4 | 16), epoch u64,
//!                       u8 length + interface name: egress IPs the sender holds
//! ```
//!
//! Decoding is strict (magic, lengths, UTF-8, families, no trailing bytes): a datagram
//! that is not exactly a hello is refused whole.

use std::{
    collections::{BTreeMap, BTreeSet},
    net::{IpAddr, Ipv4Addr, Ipv6Addr},
};

use bytes::{Buf, BufMut, BytesMut};

pub const MAGIC: [u8; 4] = *b"EGH1";
/// Largest hello: fits an IPv6 underlay's 1280-byte minimum MTU with headers to spare.
pub const MAX_LEN: usize = 1200;
/// Fixed part, up to the name.
const HEADER_LEN: usize = 40;

pub mod flags {
    /// The sender hears too few peers and holds nothing.
    pub const CUT_OFF: u8 = 1;
    /// The sender's agent stops for a restart (SIGTERM); its pinned datapath keeps
    /// forwarding, so peers count it alive for `grace_s` more seconds.
    pub const RESTARTING: u8 = 2;
}

/// One egress IP the sender holds.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct Claim {
    pub interface: String,
    /// Ownership generation of the address: a new holder takes the largest it knows + 1.
    pub epoch: u64,
}

#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Hello {
    pub flags: u8,
    /// With [`flags::RESTARTING`]: seconds to count the sender alive without hellos.
    pub grace_s: u16,
    pub incarnation: u32,
    pub seq: u64,
    pub sent_us: u64,
    pub echo_us: u64,
    pub echo_held_us: u32,
    pub name: String,
    pub seen: BTreeSet<String>,
    pub down: BTreeSet<String>,
    pub claims: BTreeMap<IpAddr, Claim>,
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum Error {
    #[error("failed to decode a hello: {0}")]
    Decode(&'static str),
    #[error("failed to encode a hello: {0}")]
    Encode(String),
}

impl Hello {
    pub fn encode(&self) -> Result<BytesMut, Error> {
        let mut b = BytesMut::with_capacity(256);
        b.put_slice(&MAGIC);
        b.put_u8(self.flags);
        b.put_u16(self.grace_s);
        b.put_u8(0);
        b.put_u32(self.incarnation);
        b.put_u64(self.seq);
        b.put_u64(self.sent_us);
        b.put_u64(self.echo_us);
        b.put_u32(self.echo_held_us);
        put_str(&mut b, &self.name, "name")?;
        put_list(&mut b, &self.seen, "seen")?;
        put_list(&mut b, &self.down, "down")?;
        put_count(&mut b, self.claims.len(), "claims")?;
        for (ip, c) in &self.claims {
            match ip {
                IpAddr::V4(a) => {
                    b.put_u8(4);
                    b.put_slice(&a.octets());
                }
                IpAddr::V6(a) => {
                    b.put_u8(6);
                    b.put_slice(&a.octets());
                }
            }
            b.put_u64(c.epoch);
            put_str(&mut b, &c.interface, "claims.interface")?;
        }
        if b.len() > MAX_LEN {
            return Err(Error::Encode(format!(
                "{} bytes, over the {MAX_LEN}-byte limit",
                b.len()
            )));
        }
        Ok(b)
    }

    pub fn decode(mut b: &[u8]) -> Result<Self, Error> {
        if b.len() > MAX_LEN {
            return Err(Error::Decode("too long"));
        }
        if b.len() < HEADER_LEN {
            return Err(Error::Decode("shorter than the header"));
        }
        if b[..4] != MAGIC {
            return Err(Error::Decode("bad magic or version"));
        }
        b.advance(4);
        let flags = b.get_u8();
        let grace_s = b.get_u16();
        if b.get_u8() != 0 {
            return Err(Error::Decode("reserved byte set"));
        }
        let mut h = Hello {
            flags,
            grace_s,
            incarnation: b.get_u32(),
            seq: b.get_u64(),
            sent_us: b.get_u64(),
            echo_us: b.get_u64(),
            echo_held_us: b.get_u32(),
            ..Hello::default()
        };
        h.name = get_str(&mut b)?;
        if h.name.is_empty() {
            return Err(Error::Decode("empty name"));
        }
        h.seen = get_list(&mut b)?;
        h.down = get_list(&mut b)?;
        let n = get_u8(&mut b)?;
        for _ in 0..n {
            let ip = match get_u8(&mut b)? {
                4 => {
                    let o: [u8; 4] = take(&mut b)?;
                    IpAddr::V4(Ipv4Addr::from(o))
                }
                6 => {
                    let o: [u8; 16] = take(&mut b)?;
                    IpAddr::V6(Ipv6Addr::from(o))
                }
                _ => return Err(Error::Decode("bad address family in a claim")),
            };
            let epoch = u64::from_be_bytes(take(&mut b)?);
            let interface = get_str(&mut b)?;
            h.claims.insert(ip, Claim { interface, epoch });
        }
        if b.has_remaining() {
            return Err(Error::Decode("trailing bytes"));
        }
        Ok(h)
    }
}

fn put_count(b: &mut BytesMut, n: usize, field: &str) -> Result<(), Error> {
    let n = u8::try_from(n).map_err(|_| Error::Encode(format!("{field}: {n} items, over 255")))?;
    b.put_u8(n);
    Ok(())
}

fn put_str(b: &mut BytesMut, s: &str, field: &str) -> Result<(), Error> {
    put_count(b, s.len(), field)?;
    b.put_slice(s.as_bytes());
    Ok(())
}

fn put_list(b: &mut BytesMut, items: &BTreeSet<String>, field: &str) -> Result<(), Error> {
    put_count(b, items.len(), field)?;
    items.iter().try_for_each(|s| put_str(b, s, field))
}

fn get_u8(b: &mut &[u8]) -> Result<u8, Error> {
    if b.is_empty() {
        return Err(Error::Decode("truncated"));
    }
    Ok(b.get_u8())
}

fn take<const N: usize>(b: &mut &[u8]) -> Result<[u8; N], Error> {
    if b.len() < N {
        return Err(Error::Decode("truncated"));
    }
    let mut out = [0; N];
    b.copy_to_slice(&mut out);
    Ok(out)
}

fn get_str(b: &mut &[u8]) -> Result<String, Error> {
    let n = usize::from(get_u8(b)?);
    if b.len() < n {
        return Err(Error::Decode("truncated string"));
    }
    let s = std::str::from_utf8(&b[..n]).map_err(|_| Error::Decode("a string is not UTF-8"))?;
    let s = s.to_owned();
    b.advance(n);
    Ok(s)
}

fn get_list(b: &mut &[u8]) -> Result<BTreeSet<String>, Error> {
    let n = get_u8(b)?;
    (0..n).map(|_| get_str(b)).collect()
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    fn sample() -> Hello {
        Hello {
            flags: flags::CUT_OFF,
            grace_s: 0,
            incarnation: 7,
            seq: 42,
            sent_us: 1_000_000,
            echo_us: 999_000,
            echo_held_us: 250,
            name: "gw1".into(),
            seen: ["gw1".into(), "gw2".into()].into(),
            down: ["sec-b".into()].into(),
            claims: [
                (
                    "192.168.101.50".parse().expect("ip"),
                    Claim {
                        interface: "sec-a".into(),
                        epoch: 3,
                    },
                ),
                (
                    "fd00:101::50".parse().expect("ip"),
                    Claim {
                        interface: "sec-a".into(),
                        epoch: 1,
                    },
                ),
            ]
            .into(),
        }
    }

    #[test]
    fn a_hello_round_trips() {
        let h = sample();
        let bytes = h.encode().expect("encode");
        assert_eq!(Hello::decode(&bytes), Ok(h));
    }

    #[test]
    fn anything_but_an_exact_hello_is_refused() {
        let good = sample().encode().expect("encode").to_vec();
        for cut in 0..good.len() {
            assert!(Hello::decode(&good[..cut]).is_err(), "cut at {cut}");
        }
        let mut trailing = good.clone();
        trailing.push(0);
        assert_eq!(
            Hello::decode(&trailing),
            Err(Error::Decode("trailing bytes"))
        );
        let mut magic = good.clone();
        magic[3] = b'2';
        assert_eq!(
            Hello::decode(&magic),
            Err(Error::Decode("bad magic or version"))
        );
    }

    #[test]
    fn a_hello_too_large_to_send_is_an_error_not_a_truncation() {
        let mut h = sample();
        h.seen = (0..200)
            .map(|i| format!("node-with-a-long-name-{i}"))
            .collect();
        assert!(matches!(h.encode(), Err(Error::Encode(_))));
    }

    proptest! {
        #[test]
        fn decoding_random_bytes_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..1300)) {
            let _ = Hello::decode(&bytes);
        }

        #[test]
        fn mutated_hellos_decode_to_something_or_fail_cleanly(i in 0usize..200, v in any::<u8>()) {
            let mut b = sample().encode().expect("encode").to_vec();
            let at = i % b.len();
            b[at] = v;
            if let Ok(h) = Hello::decode(&b) {
                prop_assert_eq!(Hello::decode(&h.encode().expect("re-encode")), Ok(h));
            }
        }
    }
}
