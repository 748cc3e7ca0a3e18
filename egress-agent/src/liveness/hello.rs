//! The hello datagram agents send each other over the underlay (UDP, next to the tunnel's
//! port). Big-endian, at most [`MAX_LEN`] bytes, in two versions.
//!
//! **Version 2** (`EGH2`, what this agent sends to every peer that speaks it): fields as
//! type-length-value records, so that a later version adds fields an older one skips,
//! then an authentication trailer:
//!
//! ```text
//! 0   "EGH2"
//! 4   records, each: type u8, length u16, value:
//!       1 header   flags u8, grace_s u16, incarnation u32, seq u64, sent_us u64,
//!                  echo_us u64, echo_held_us u32, sent_unix_ms u64 (43 bytes; a longer
//!                  header's extra bytes are a later version's and skipped)
//!       2 name     UTF-8 (the sender's node name)
//!       3 seen     u8 count, each u8 length + name: gateways the sender hears directly
//!       4 down     u8 count, each u8 length + name: the sender's interfaces that are down
//!       5 claims   u8 count, each: family u8 (4 | 6), address (4 | 16), epoch u64,
//!                  u8 length + interface name: egress IPs the sender holds
//!       6 to       UTF-8: the node the hello is for (a signed hello recorded on its way
//!                  to one node is refused by every other)
//!       7 remaps   u8 count, each: protocol u8, family u8 (4 | 6), then pod, destination
//!                  and egress IP as address (4 | 16) + port u16: translations of the
//!                  sender's whose source port it remapped (a slice of them per hello,
//!                  sent to gateways only; see `datapath::remap`)
//!     (any other type: skipped; header and name must be there, each record once)
//! -36 key id [4]        first 4 bytes of the SHA-256 of the key (zero: unsigned)
//! -32 MAC [32]          HMAC-SHA256 under that key of every byte before the MAC
//! ```
//!
//! **Version 1** (`EGH1`, the first agents with hellos; sent only to peers that speak
//! nothing newer, and never accepted under a key, since it has no MAC): the same fields
//! in a fixed order, without `sent_unix_ms` and without the trailer:
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
//! 40  name, seen, down, claims as the records above (name: u8 length + UTF-8)
//! ```
//!
//! Decoding is strict within what it knows (lengths, UTF-8, families, each field's bytes
//! exactly used): a datagram that is not a hello is refused whole.

use std::{
    collections::{BTreeMap, BTreeSet},
    net::{IpAddr, Ipv4Addr, Ipv6Addr},
    time::Duration,
};

use bytes::{Buf, BufMut, BytesMut};

use super::keys::{ID_LEN, Keyring, MAC_LEN};
use crate::family::conntrack::Remap;

pub const MAGIC_V1: [u8; 4] = *b"EGH1";
pub const MAGIC_V2: [u8; 4] = *b"EGH2";
/// The newest version this agent speaks (and advertises in its EgressNode).
pub const VERSION: u8 = 2;
/// Largest hello: fits an IPv6 underlay's 1280-byte minimum MTU with headers to spare.
pub const MAX_LEN: usize = 1200;
/// Version 1's fixed part, up to the name.
const HEADER_LEN_V1: usize = 40;
/// Version 2's header record.
const HEADER_LEN_V2: usize = 43;
/// Version 2's trailer: key id and MAC.
const TRAILER_LEN: usize = ID_LEN + MAC_LEN;

/// Version 2's record types.
mod record {
    pub const HEADER: u8 = 1;
    pub const NAME: u8 = 2;
    pub const SEEN: u8 = 3;
    pub const DOWN: u8 = 4;
    pub const CLAIMS: u8 = 5;
    pub const TO: u8 = 6;
    pub const REMAPS: u8 = 7;
}

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
    /// The sender's wall clock (ms since the Unix epoch; 0 in version 1): under a key, a
    /// hello older or newer than [`MAX_SKEW`] is a replay and refused.
    pub sent_unix_ms: u64,
    pub name: String,
    /// The node it is for (empty in version 1).
    pub to: String,
    pub seen: BTreeSet<String>,
    pub down: BTreeSet<String>,
    pub claims: BTreeMap<IpAddr, Claim>,
    /// Remapped translations the sender shares (version 2 only).
    pub remaps: Vec<Remap>,
}

/// The bytes one remap takes in a hello.
pub fn remap_len(r: &Remap) -> usize {
    2 + 3 * (if r.pod.is_ipv4() { 4 } else { 16 } + 2)
}

/// The bytes the remaps record adds besides its remaps: type, length and count.
pub const REMAPS_OVERHEAD: usize = 4;

/// A hello as it arrived: its version and the key that signed it (verified; `None`
/// when this agent has no keys, or for an unsigned hello then).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Received {
    pub hello: Hello,
    pub version: u8,
    pub key: Option<[u8; ID_LEN]>,
}

/// How far a signed hello's wall clock may be from the receiver's: bounds how long a
/// recorded hello can be replayed to an agent that restarted (and so forgot the sender's
/// last sequence number). Node clocks are kept within milliseconds by NTP.
pub const MAX_SKEW: Duration = Duration::from_secs(10);

#[derive(Clone, Debug, thiserror::Error, PartialEq, Eq)]
pub enum Error {
    #[error("failed to decode a hello: {0}")]
    Decode(&'static str),
    #[error("failed to encode a hello: {0}")]
    Encode(String),
    /// Under a key: not signed by an accepted key.
    #[error("unauthenticated hello: {0}")]
    Unauthenticated(&'static str),
}

impl Error {
    /// The reason label of the refusal counter.
    pub fn reason(&self) -> &'static str {
        match self {
            Error::Decode(_) | Error::Encode(_) => "malformed",
            Error::Unauthenticated(_) => "unauthenticated",
        }
    }
}

impl Hello {
    /// The hello in `version` (1 or 2; version 2 signed with `keys`' signing key, if any).
    pub fn encode(&self, version: u8, keys: &Keyring) -> Result<BytesMut, Error> {
        let mut b = BytesMut::with_capacity(256);
        self.parts().write(version, keys, &mut b)?;
        Ok(b)
    }

    /// Its fixed fields.
    pub fn fixed(&self) -> Fixed {
        Fixed {
            flags: self.flags,
            grace_s: self.grace_s,
            incarnation: self.incarnation,
            seq: self.seq,
            sent_us: self.sent_us,
            echo_us: self.echo_us,
            echo_held_us: self.echo_held_us,
            sent_unix_ms: self.sent_unix_ms,
        }
    }

    /// Take `f` as its fixed fields.
    pub fn set_fixed(&mut self, f: Fixed) {
        self.flags = f.flags;
        self.grace_s = f.grace_s;
        self.incarnation = f.incarnation;
        self.seq = f.seq;
        self.sent_us = f.sent_us;
        self.echo_us = f.echo_us;
        self.echo_held_us = f.echo_held_us;
        self.sent_unix_ms = f.sent_unix_ms;
    }

    fn parts(&self) -> Parts<'_, impl Iterator<Item = &str> + Clone> {
        Parts {
            fixed: self.fixed(),
            name: &self.name,
            to: &self.to,
            seen: self.seen.iter().map(String::as_str),
            down: &self.down,
            claims: &self.claims,
            remaps: &self.remaps,
        }
    }

    /// A hello of either version. With `keys` (not empty) only one signed by an
    /// accepted key is taken; without, the trailer is not checked.
    pub fn decode(b: &[u8], keys: &Keyring) -> Result<Received, Error> {
        let r = HelloRef::parse(b, keys)?;
        Ok(Received {
            hello: r.to_hello()?,
            version: r.version,
            key: r.key,
        })
    }
}

/// A hello's fixed fields: all but its names and lists.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Fixed {
    pub flags: u8,
    pub grace_s: u16,
    pub incarnation: u32,
    pub seq: u64,
    pub sent_us: u64,
    pub echo_us: u64,
    pub echo_held_us: u32,
    pub sent_unix_ms: u64,
}

/// A hello to write, borrowed from whoever holds its parts (the agent writes each hello
/// into a buffer it reuses, with no allocation per hello); `seen` lists names.
pub struct Parts<'a, S> {
    pub fixed: Fixed,
    pub name: &'a str,
    pub to: &'a str,
    pub seen: S,
    pub down: &'a BTreeSet<String>,
    pub claims: &'a BTreeMap<IpAddr, Claim>,
    pub remaps: &'a [Remap],
}

impl<'a, S: Iterator<Item = &'a str> + Clone> Parts<'a, S> {
    /// Append the hello in `version` (1 or 2; version 2 signed with `keys`' signing key,
    /// if any) to `out`; on an error `out` is left as it was.
    pub fn write(&self, version: u8, keys: &Keyring, out: &mut BytesMut) -> Result<(), Error> {
        let start = out.len();
        let written = match version {
            1 => self.write_v1(out),
            _ => self.write_v2(keys, out, start),
        };
        let len = out.len() - start;
        let result = written.and_then(|()| {
            if len > MAX_LEN {
                Err(Error::Encode(format!(
                    "{len} bytes, over the {MAX_LEN}-byte limit"
                )))
            } else {
                Ok(())
            }
        });
        if result.is_err() {
            out.truncate(start);
        }
        result
    }

    fn write_v1(&self, b: &mut BytesMut) -> Result<(), Error> {
        let f = &self.fixed;
        b.put_slice(&MAGIC_V1);
        b.put_u8(f.flags);
        b.put_u16(f.grace_s);
        b.put_u8(0);
        b.put_u32(f.incarnation);
        b.put_u64(f.seq);
        b.put_u64(f.sent_us);
        b.put_u64(f.echo_us);
        b.put_u32(f.echo_held_us);
        put_str(b, self.name, "name")?;
        put_list(b, self.seen.clone(), "seen")?;
        put_list(b, self.down.iter().map(String::as_str), "down")?;
        put_claims(b, self.claims)
    }

    fn write_v2(&self, keys: &Keyring, b: &mut BytesMut, start: usize) -> Result<(), Error> {
        let f = &self.fixed;
        b.put_slice(&MAGIC_V2);
        put_record(b, record::HEADER, |b| {
            b.put_u8(f.flags);
            b.put_u16(f.grace_s);
            b.put_u32(f.incarnation);
            b.put_u64(f.seq);
            b.put_u64(f.sent_us);
            b.put_u64(f.echo_us);
            b.put_u32(f.echo_held_us);
            b.put_u64(f.sent_unix_ms);
            Ok(())
        })?;
        put_record(b, record::NAME, |b| {
            b.put_slice(self.name.as_bytes());
            Ok(())
        })?;
        put_record(b, record::SEEN, |b| put_list(b, self.seen.clone(), "seen"))?;
        put_record(b, record::DOWN, |b| {
            put_list(b, self.down.iter().map(String::as_str), "down")
        })?;
        put_record(b, record::CLAIMS, |b| put_claims(b, self.claims))?;
        if !self.to.is_empty() {
            put_record(b, record::TO, |b| {
                b.put_slice(self.to.as_bytes());
                Ok(())
            })?;
        }
        if !self.remaps.is_empty() {
            put_record(b, record::REMAPS, |b| put_remaps(b, self.remaps))?;
        }
        match keys.signing() {
            Some(k) => {
                b.put_slice(&k.id);
                let mac = k.mac(&b[start..]);
                b.put_slice(&mac);
            }
            None => b.put_bytes(0, TRAILER_LEN),
        }
        Ok(())
    }
}

/// A hello as it arrived, borrowed from the datagram: its fixed fields, its names, and its
/// lists as their bytes (each a u8 count and its items, as the records above; empty: not
/// sent), checked and decoded only by [`HelloRef::to_hello`]. The tracker compares a
/// peer's lists byte for byte with its last hello's and decodes only those that changed,
/// so a hello that repeats its sender's state costs no allocation.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HelloRef<'a> {
    pub fixed: Fixed,
    pub name: &'a str,
    /// The node it is for (empty in version 1).
    pub to: &'a str,
    /// Seen, down and claims, as encoded.
    pub lists: [&'a [u8]; 3],
    /// Remaps, as encoded (version 2 only).
    pub remaps: &'a [u8],
    pub version: u8,
    /// The key that signed it (verified; `None` when the receiver has no keys).
    pub key: Option<[u8; ID_LEN]>,
}

impl<'a> HelloRef<'a> {
    /// A hello of either version, its lists not decoded yet. With `keys` (not empty) only
    /// one signed by an accepted key is taken; without, the trailer is not checked.
    pub fn parse(b: &'a [u8], keys: &Keyring) -> Result<Self, Error> {
        if b.len() > MAX_LEN {
            return Err(Error::Decode("too long"));
        }
        match b.get(..4) {
            Some(m) if *m == MAGIC_V1 => {
                let hello = Self::parse_v1(b)?;
                if !keys.is_empty() {
                    return Err(Error::Unauthenticated("version 1 carries no MAC"));
                }
                Ok(hello)
            }
            Some(m) if *m == MAGIC_V2 => {
                if b.len() < 4 + TRAILER_LEN {
                    return Err(Error::Decode("shorter than the trailer"));
                }
                let (signed, mac) = b.split_at(b.len() - MAC_LEN);
                let id = &signed[signed.len() - ID_LEN..];
                let key = if keys.is_empty() {
                    None
                } else {
                    if id.iter().all(|x| *x == 0) {
                        return Err(Error::Unauthenticated("not signed"));
                    }
                    let Some(k) = keys.get(id) else {
                        return Err(Error::Unauthenticated("signed by a key not accepted"));
                    };
                    if !k.verify(signed, mac) {
                        return Err(Error::Unauthenticated("bad MAC"));
                    }
                    Some(k.id)
                };
                let mut hello = Self::parse_v2(&signed[4..signed.len() - ID_LEN])?;
                hello.key = key;
                Ok(hello)
            }
            Some(_) => Err(Error::Decode("bad magic or version")),
            None => Err(Error::Decode("shorter than the magic")),
        }
    }

    fn parse_v1(mut b: &'a [u8]) -> Result<Self, Error> {
        if b.len() < HEADER_LEN_V1 {
            return Err(Error::Decode("shorter than the header"));
        }
        b.advance(4);
        let flags = b.get_u8();
        let grace_s = b.get_u16();
        if b.get_u8() != 0 {
            return Err(Error::Decode("reserved byte set"));
        }
        let fixed = Fixed {
            flags,
            grace_s,
            incarnation: b.get_u32(),
            seq: b.get_u64(),
            sent_us: b.get_u64(),
            echo_us: b.get_u64(),
            echo_held_us: b.get_u32(),
            sent_unix_ms: 0,
        };
        let name = take_str(&mut b)?;
        if name.is_empty() {
            return Err(Error::Decode("empty name"));
        }
        let seen = split(&mut b, skip_list)?;
        let down = split(&mut b, skip_list)?;
        let claims = split(&mut b, skip_claims)?;
        if b.has_remaining() {
            return Err(Error::Decode("trailing bytes"));
        }
        Ok(HelloRef {
            fixed,
            name,
            to: "",
            lists: [seen, down, claims],
            remaps: &[],
            version: 1,
            key: None,
        })
    }

    /// Version 2's records (between the magic and the trailer).
    fn parse_v2(mut b: &'a [u8]) -> Result<Self, Error> {
        let mut h = HelloRef {
            fixed: Fixed::default(),
            name: "",
            to: "",
            lists: [&[]; 3],
            remaps: &[],
            version: 2,
            key: None,
        };
        let mut seen_types: u64 = 0;
        while b.has_remaining() {
            let t = get_u8(&mut b)?;
            let len = usize::from(u16::from_be_bytes(take(&mut b)?));
            if b.len() < len {
                return Err(Error::Decode("truncated record"));
            }
            let (mut v, rest) = b.split_at(len);
            b = rest;
            if (1..=record::REMAPS).contains(&t) {
                if seen_types & (1 << t) != 0 {
                    return Err(Error::Decode("a record twice"));
                }
                seen_types |= 1 << t;
            }
            let utf8 =
                |v| std::str::from_utf8(v).map_err(|_| Error::Decode("a string is not UTF-8"));
            match t {
                record::HEADER => {
                    if v.len() < HEADER_LEN_V2 {
                        return Err(Error::Decode("short header record"));
                    }
                    // Anything after is a later version's.
                    h.fixed = Fixed {
                        flags: v.get_u8(),
                        grace_s: v.get_u16(),
                        incarnation: v.get_u32(),
                        seq: v.get_u64(),
                        sent_us: v.get_u64(),
                        echo_us: v.get_u64(),
                        echo_held_us: v.get_u32(),
                        sent_unix_ms: v.get_u64(),
                    };
                }
                record::NAME => {
                    h.name = utf8(v)?;
                    if h.name.is_empty() {
                        return Err(Error::Decode("empty name"));
                    }
                }
                record::TO => h.to = utf8(v)?,
                // Each decodes whole or not at all (`to_hello`); an empty one is
                // truncated.
                record::SEEN | record::DOWN | record::CLAIMS | record::REMAPS if v.is_empty() => {
                    return Err(Error::Decode("truncated"));
                }
                record::SEEN => h.lists[0] = v,
                record::DOWN => h.lists[1] = v,
                record::CLAIMS => h.lists[2] = v,
                record::REMAPS => h.remaps = v,
                // A later version's record.
                _ => {}
            }
        }
        for (t, what) in [(record::HEADER, "no header"), (record::NAME, "no name")] {
            if seen_types & (1 << t) == 0 {
                return Err(Error::Decode(what));
            }
        }
        Ok(h)
    }

    /// The whole hello, its lists decoded (strictly: each list's bytes exactly used).
    pub fn to_hello(&self) -> Result<Hello, Error> {
        let mut h = Hello {
            name: self.name.to_owned(),
            to: self.to.to_owned(),
            seen: whole(self.lists[0], get_list)?.unwrap_or_default(),
            down: whole(self.lists[1], get_list)?.unwrap_or_default(),
            claims: whole(self.lists[2], get_claims)?.unwrap_or_default(),
            remaps: self.remaps()?,
            ..Hello::default()
        };
        h.set_fixed(self.fixed);
        Ok(h)
    }

    /// Its remaps, decoded (none: no allocation).
    pub fn remaps(&self) -> Result<Vec<Remap>, Error> {
        Ok(whole(self.remaps, get_remaps)?.unwrap_or_default())
    }
}

/// `get` of `b`, which must use it exactly (`None` for no bytes: the field was not sent).
fn whole<T>(mut b: &[u8], get: fn(&mut &[u8]) -> Result<T, Error>) -> Result<Option<T>, Error> {
    if b.is_empty() {
        return Ok(None);
    }
    let out = get(&mut b)?;
    if b.has_remaining() {
        return Err(Error::Decode("trailing bytes in a record"));
    }
    Ok(Some(out))
}

/// The bytes `skip` passes over at the front of `b`, taken off it.
fn split<'a>(
    b: &mut &'a [u8],
    skip: fn(&mut &[u8]) -> Result<(), Error>,
) -> Result<&'a [u8], Error> {
    let all: &'a [u8] = b;
    let mut rest = all;
    skip(&mut rest)?;
    let (used, left) = all.split_at(all.len() - rest.len());
    *b = left;
    Ok(used)
}

fn skip_list(b: &mut &[u8]) -> Result<(), Error> {
    for _ in 0..get_u8(b)? {
        take_str(b)?;
    }
    Ok(())
}

fn skip_claims(b: &mut &[u8]) -> Result<(), Error> {
    for _ in 0..get_u8(b)? {
        let len = match get_u8(b)? {
            4 => 4,
            6 => 16,
            _ => return Err(Error::Decode("bad address family in a claim")),
        };
        if b.len() < len + 8 {
            return Err(Error::Decode("truncated"));
        }
        b.advance(len + 8);
        take_str(b)?;
    }
    Ok(())
}

/// Whether a signed hello sent at `sent_unix_ms` is fresh at the receiver's `now_unix_ms`.
pub fn fresh(sent_unix_ms: u64, now_unix_ms: u64) -> bool {
    let skew = MAX_SKEW.as_millis() as u64;
    sent_unix_ms.abs_diff(now_unix_ms) <= skew
}

fn put_record(
    b: &mut BytesMut,
    t: u8,
    value: impl FnOnce(&mut BytesMut) -> Result<(), Error>,
) -> Result<(), Error> {
    b.put_u8(t);
    let at = b.len();
    b.put_u16(0);
    value(b)?;
    let len = b.len() - at - 2;
    let len = u16::try_from(len).map_err(|_| Error::Encode(format!("a record of {len} bytes")))?;
    b[at..at + 2].copy_from_slice(&len.to_be_bytes());
    Ok(())
}

fn put_claims(b: &mut BytesMut, claims: &BTreeMap<IpAddr, Claim>) -> Result<(), Error> {
    put_count(b, claims.len(), "claims")?;
    for (ip, c) in claims {
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
        put_str(b, &c.interface, "claims.interface")?;
    }
    Ok(())
}

fn get_claims(b: &mut &[u8]) -> Result<BTreeMap<IpAddr, Claim>, Error> {
    let n = get_u8(b)?;
    let mut out = BTreeMap::new();
    for _ in 0..n {
        let ip = match get_u8(b)? {
            4 => {
                let o: [u8; 4] = take(b)?;
                IpAddr::V4(Ipv4Addr::from(o))
            }
            6 => {
                let o: [u8; 16] = take(b)?;
                IpAddr::V6(Ipv6Addr::from(o))
            }
            _ => return Err(Error::Decode("bad address family in a claim")),
        };
        let epoch = u64::from_be_bytes(take(b)?);
        let interface = get_str(b)?;
        out.insert(ip, Claim { interface, epoch });
    }
    Ok(out)
}

fn put_remaps(b: &mut BytesMut, remaps: &[Remap]) -> Result<(), Error> {
    put_count(b, remaps.len(), "remaps")?;
    for r in remaps {
        let family = match (r.pod.ip(), r.dst.ip(), r.egress.ip()) {
            (IpAddr::V4(_), IpAddr::V4(_), IpAddr::V4(_)) => 4,
            (IpAddr::V6(_), IpAddr::V6(_), IpAddr::V6(_)) => 6,
            _ => return Err(Error::Encode(format!("remap of mixed families: {r:?}"))),
        };
        b.put_u8(r.proto);
        b.put_u8(family);
        for a in [r.pod, r.dst, r.egress] {
            match a.ip() {
                IpAddr::V4(ip) => b.put_slice(&ip.octets()),
                IpAddr::V6(ip) => b.put_slice(&ip.octets()),
            }
            b.put_u16(a.port());
        }
    }
    Ok(())
}

fn get_remaps(b: &mut &[u8]) -> Result<Vec<Remap>, Error> {
    let n = get_u8(b)?;
    let mut out = Vec::with_capacity(usize::from(n));
    for _ in 0..n {
        let proto = get_u8(b)?;
        let family = get_u8(b)?;
        let mut addr = || -> Result<std::net::SocketAddr, Error> {
            let ip = match family {
                4 => IpAddr::V4(Ipv4Addr::from(take::<4>(b)?)),
                6 => IpAddr::V6(Ipv6Addr::from(take::<16>(b)?)),
                _ => return Err(Error::Decode("bad address family in a remap")),
            };
            Ok((ip, u16::from_be_bytes(take(b)?)).into())
        };
        let (pod, dst, egress) = (addr()?, addr()?, addr()?);
        out.push(Remap {
            proto,
            pod,
            dst,
            egress,
        });
    }
    Ok(out)
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

/// A u8 count, then each item (counted as written: `items` need not know its length).
fn put_list<'a>(
    b: &mut BytesMut,
    items: impl Iterator<Item = &'a str>,
    field: &str,
) -> Result<(), Error> {
    let at = b.len();
    b.put_u8(0);
    let mut n = 0usize;
    for s in items {
        put_str(b, s, field)?;
        n += 1;
    }
    b[at] = u8::try_from(n).map_err(|_| Error::Encode(format!("{field}: {n} items, over 255")))?;
    Ok(())
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

/// A u8 length and that many bytes of UTF-8, borrowed.
fn take_str<'a>(b: &mut &'a [u8]) -> Result<&'a str, Error> {
    let n = usize::from(get_u8(b)?);
    if b.len() < n {
        return Err(Error::Decode("truncated string"));
    }
    let (s, rest) = b.split_at(n);
    *b = rest;
    std::str::from_utf8(s).map_err(|_| Error::Decode("a string is not UTF-8"))
}

fn get_str(b: &mut &[u8]) -> Result<String, Error> {
    take_str(b).map(str::to_owned)
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
            sent_unix_ms: 0,
            name: "gw1".into(),
            to: "w1".into(),
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
            remaps: vec![
                Remap {
                    proto: 6,
                    pod: "10.244.1.5:40000".parse().expect("addr"),
                    dst: "192.168.101.10:443".parse().expect("addr"),
                    egress: "192.168.101.50:40001".parse().expect("addr"),
                },
                Remap {
                    proto: 17,
                    pod: "[fd00:10:244:1::5]:5353".parse().expect("addr"),
                    dst: "[fd00:101::10]:53".parse().expect("addr"),
                    egress: "[fd00:101::50]:61000".parse().expect("addr"),
                },
            ],
        }
    }

    #[test]
    fn remaps_take_the_bytes_remap_len_says() {
        let mut h = sample();
        let with = v2(&h, &none()).len();
        let remaps = std::mem::take(&mut h.remaps);
        let without = v2(&h, &none()).len();
        let said: usize = remaps.iter().map(remap_len).sum();
        assert_eq!(with - without, said + REMAPS_OVERHEAD);
        // Mixed families cannot be sent.
        h.remaps = vec![Remap {
            egress: "192.168.101.50:1".parse().expect("addr"),
            ..remaps[1]
        }];
        assert!(h.encode(2, &none()).is_err());
    }

    const A: &str = "00112233445566778899aabbccddeeff00112233445566778899aabbccddeeff";
    const B: &str = "ffeeddccbbaa99887766554433221100ffeeddccbbaa99887766554433221100";

    fn ring(text: &str) -> Keyring {
        Keyring::parse(text, std::path::Path::new("key")).expect("keys")
    }

    fn none() -> Keyring {
        Keyring::default()
    }

    fn v2(h: &Hello, keys: &Keyring) -> Vec<u8> {
        h.encode(2, keys).expect("encode").to_vec()
    }

    #[test]
    fn a_hello_round_trips_in_both_versions() {
        let mut h = sample();
        h.sent_unix_ms = 1_790_000_000_000;
        let got = Hello::decode(&v2(&h, &none()), &none()).expect("v2");
        assert_eq!((got.version, got.key, &got.hello), (2, None, &h));
        let signed = Hello::decode(&v2(&h, &ring(A)), &ring(A)).expect("signed");
        assert_eq!(signed.hello, h);
        assert!(signed.key.is_some());
        // Version 1 has no wall clock.
        let b = h.encode(1, &none()).expect("v1");
        assert_eq!(&b[..4], b"EGH1");
        let got = Hello::decode(&b, &none()).expect("v1");
        h.sent_unix_ms = 0;
        h.to = String::new();
        h.remaps.clear();
        assert_eq!((got.version, got.hello), (1, h));
    }

    #[test]
    fn version_1_is_byte_for_byte_what_the_first_agents_decode() {
        // The layout of EGH1 as the agents before version 2 wrote it.
        let h = Hello {
            name: "n".into(),
            seq: 1,
            ..Hello::default()
        };
        let b = h.encode(1, &ring(A)).expect("v1");
        let mut want = b"EGH1".to_vec();
        want.extend([0, 0, 0, 0]); // flags, grace_s, reserved
        want.extend([0; 4]); // incarnation
        want.extend(1u64.to_be_bytes());
        want.extend([0; 8 + 8 + 4]); // sent_us, echo_us, echo_held_us
        want.extend([1, b'n', 0, 0, 0]); // name, seen, down, claims
        assert_eq!(b.to_vec(), want);
    }

    #[test]
    fn records_of_a_later_version_are_skipped() {
        let h = sample();
        let b = v2(&h, &none());
        // A new record type before the trailer, and a longer header record.
        let body_end = b.len() - TRAILER_LEN;
        let mut later = b[..body_end].to_vec();
        later.extend([200, 0, 3, 1, 2, 3]);
        later.extend(&b[body_end..]);
        assert_eq!(Hello::decode(&later, &none()).expect("later").hello, h);
        let mut longer = b[..4].to_vec();
        longer.extend([record::HEADER, 0, (HEADER_LEN_V2 + 2) as u8]);
        longer.extend(&b[7..7 + HEADER_LEN_V2]);
        longer.extend([9, 9]);
        longer.extend(&b[7 + HEADER_LEN_V2..]);
        assert_eq!(Hello::decode(&longer, &none()).expect("longer").hello, h);
        // Signed after the change, under a key: still taken.
        let k = ring(A);
        let mut signed = later[..later.len() - TRAILER_LEN].to_vec();
        let key = k.signing().expect("key");
        signed.extend(key.id);
        let mac = key.mac(&signed);
        signed.extend(mac);
        assert_eq!(Hello::decode(&signed, &k).expect("signed").hello, h);
    }

    #[test]
    fn under_a_key_only_hellos_signed_by_an_accepted_key_are_taken() {
        let h = sample();
        let a = ring(A);
        let unsigned = v2(&h, &none());
        assert_eq!(
            Hello::decode(&unsigned, &a),
            Err(Error::Unauthenticated("not signed"))
        );
        assert_eq!(
            Hello::decode(&h.encode(1, &none()).expect("v1"), &a),
            Err(Error::Unauthenticated("version 1 carries no MAC"))
        );
        assert_eq!(
            Hello::decode(&v2(&h, &ring(B)), &a),
            Err(Error::Unauthenticated("signed by a key not accepted"))
        );
        // Any byte changed after signing: refused.
        let good = v2(&h, &a);
        for at in 4..good.len() - TRAILER_LEN {
            let mut b = good.clone();
            b[at] ^= 1;
            assert!(Hello::decode(&b, &a).is_err(), "byte {at} changed");
        }
        let mut b = good.clone();
        let last = b.len() - 1;
        b[last] ^= 1;
        assert_eq!(
            Hello::decode(&b, &a),
            Err(Error::Unauthenticated("bad MAC"))
        );
    }

    #[test]
    fn during_a_rotation_both_keys_are_taken() {
        let h = sample();
        let old_signs = ring(&format!("{A}\n{B}"));
        let new_signs = ring(&format!("{B}\n{A}"));
        for (signer, receiver) in [
            (&old_signs, &new_signs),
            (&new_signs, &old_signs),
            (&ring(B), &old_signs),
            (&old_signs, &ring(A)),
        ] {
            assert_eq!(
                Hello::decode(&v2(&h, signer), receiver)
                    .expect("rotation")
                    .hello,
                h
            );
        }
        // After step 3, the old key alone is refused.
        assert!(Hello::decode(&v2(&h, &ring(A)), &ring(B)).is_err());
    }

    #[test]
    fn anything_but_an_exact_hello_is_refused() {
        for version in [1, 2] {
            let good = sample().encode(version, &none()).expect("encode").to_vec();
            let end = if version == 1 {
                good.len()
            } else {
                good.len() - TRAILER_LEN
            };
            for cut in 0..end {
                let mut b = good[..cut].to_vec();
                if version == 2 {
                    b.extend(&good[end..]);
                }
                // Version 2's records after the name are optional: a cut at a record's
                // end decodes, but never to the hello that was sent.
                assert_ne!(
                    Hello::decode(&b, &none()).map(|r| r.hello),
                    Ok(sample()),
                    "version {version} cut at {cut}"
                );
                if version == 1 {
                    assert!(Hello::decode(&b, &none()).is_err(), "cut at {cut}");
                }
            }
        }
        let good = sample().encode(1, &none()).expect("encode").to_vec();
        let mut trailing = good.clone();
        trailing.push(0);
        assert_eq!(
            Hello::decode(&trailing, &none()),
            Err(Error::Decode("trailing bytes"))
        );
        let mut magic = good.clone();
        magic[3] = b'9';
        assert_eq!(
            Hello::decode(&magic, &none()),
            Err(Error::Decode("bad magic or version"))
        );
    }

    #[test]
    fn a_wall_clock_off_by_more_than_the_skew_is_stale() {
        let now = 1_790_000_000_000;
        let skew = MAX_SKEW.as_millis() as u64;
        assert!(fresh(now, now));
        assert!(fresh(now - skew, now));
        assert!(fresh(now + skew, now));
        assert!(!fresh(now - skew - 1, now));
        assert!(!fresh(now + skew + 1, now));
        assert!(!fresh(0, now));
    }

    #[test]
    fn a_hello_too_large_to_send_is_an_error_not_a_truncation() {
        let mut h = sample();
        h.seen = (0..200)
            .map(|i| format!("node-with-a-long-name-{i}"))
            .collect();
        assert!(matches!(h.encode(1, &none()), Err(Error::Encode(_))));
        assert!(matches!(h.encode(2, &none()), Err(Error::Encode(_))));
    }

    proptest! {
        #[test]
        fn decoding_random_bytes_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..1300), v2 in any::<bool>()) {
            let mut bytes = bytes;
            if v2 && bytes.len() >= 4 {
                bytes[..4].copy_from_slice(b"EGH2");
            }
            let _ = Hello::decode(&bytes, &none());
            let _ = Hello::decode(&bytes, &ring(A));
        }

        #[test]
        fn mutated_hellos_decode_to_something_or_fail_cleanly(i in 0usize..200, v in any::<u8>(), version in 1u8..=2) {
            let mut b = sample().encode(version, &none()).expect("encode").to_vec();
            let at = i % b.len();
            b[at] = v;
            if let Ok(r) = Hello::decode(&b, &none()) {
                let again = r.hello.encode(r.version, &none()).expect("re-encode");
                prop_assert_eq!(Hello::decode(&again, &none()).map(|r| r.hello), Ok(r.hello));
            }
        }
    }
}
