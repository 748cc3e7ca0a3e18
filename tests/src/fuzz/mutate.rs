//! Mutations of a well-formed frame, one to three per case: bits flipped and bytes set
//! (mostly in the headers), the frame cut short or lengthened, and the header fields
//! parsers trust set to what they should not hold: IHL, total and payload lengths,
//! fragment bits, version, protocol and next header, TTL and hop limit, TCP data offset,
//! ethertype. Checksums are left as they fall: the datapath never verifies them.

use super::{cases::min_len, rng::Rng};

const ETH: usize = 14;

pub fn mutate(rng: &mut Rng, f: &mut Vec<u8>) {
    for _ in 0..rng.range(1, 3) {
        one(rng, f);
    }
}

fn one(rng: &mut Rng, f: &mut Vec<u8>) {
    let v4 = f.len() >= ETH + 20 && f[12..14] == [0x08, 0x00];
    let v6 = f.len() >= ETH + 40 && f[12..14] == [0x86, 0xdd];
    match rng.below(100) {
        0..25 => flip_header_bit(rng, f),
        25..37 => set_byte(rng, f),
        37..49 => truncate(rng, f),
        49..53 => {
            let n = rng.range(1, 64);
            f.extend(rng.bytes(n));
        }
        53..57 => {
            let t = pick!(rng, [0x0800u16, 0x86dd, 0x8100, 0x0806, rng.u16()]);
            f[12..14].copy_from_slice(&t.to_be_bytes());
        }
        57..85 if v4 => ipv4_field(rng, f),
        57..85 if v6 => ipv6_field(rng, f),
        85..95 => transport_field(rng, f),
        _ => flip_header_bit(rng, f),
    }
}

/// A bit of the first 100 bytes (headers, usually).
fn flip_header_bit(rng: &mut Rng, f: &mut [u8]) {
    let i = rng.below(f.len().min(100));
    f[i] ^= 1 << rng.below(8);
}

fn set_byte(rng: &mut Rng, f: &mut [u8]) {
    let i = rng.below(f.len());
    f[i] = pick!(rng, [0, 0xff, 0x7f, 0x80, f[i].wrapping_add(1), rng.u8()]);
}

/// Cut anywhere from the end of the fixed headers on (what test_run takes: `min_len`).
fn truncate(rng: &mut Rng, f: &mut Vec<u8>) {
    let min = min_len(f);
    if f.len() > min {
        let len = rng.range(min, f.len() - 1);
        f.truncate(len);
    }
}

fn set16(f: &mut [u8], off: usize, v: u16) {
    f[off..off + 2].copy_from_slice(&v.to_be_bytes());
}

/// A 16-bit length near the true one, or anything.
fn length(rng: &mut Rng, truth: usize) -> u16 {
    let t = truth as i64;
    let v = pick!(
        rng,
        [
            t - 1,
            t + 1,
            t - 8,
            t + 8,
            0,
            19,
            65_535,
            i64::from(rng.u16())
        ]
    );
    v.clamp(0, 65_535) as u16
}

fn ipv4_field(rng: &mut Rng, f: &mut [u8]) {
    let ip_len = f.len() - ETH;
    match rng.below(8) {
        0 | 1 => f[ETH] = (f[ETH] & 0xf0) | rng.u8() & 0x0f,
        2 | 3 => set16(f, ETH + 2, length(rng, ip_len)),
        4 => {
            let frag = pick!(rng, [0x2000u16, 0x0001, 0x1fff, 0x8000, rng.u16()]);
            set16(f, ETH + 6, frag);
        }
        5 => f[ETH] = (rng.u8() << 4) | (f[ETH] & 0x0f),
        6 => f[ETH + 9] = pick!(rng, [6u8, 17, 1, 58, 0, rng.u8()]),
        _ => f[ETH + 8] = pick!(rng, [0u8, 1, 2]),
    }
}

fn ipv6_field(rng: &mut Rng, f: &mut [u8]) {
    let payload_len = f.len() - ETH - 40;
    match rng.below(6) {
        0..2 => set16(f, ETH + 4, length(rng, payload_len)),
        2..4 => f[ETH + 6] = pick!(rng, [0u8, 43, 44, 60, 6, 17, 58, 59, rng.u8()]),
        4 => f[ETH + 7] = pick!(rng, [0u8, 1]),
        _ => f[ETH] = (rng.u8() << 4) | (f[ETH] & 0x0f),
    }
}

/// Where the transport header of a well-formed frame starts: after IPv4's IHL, or after
/// IPv6's walked extension headers.
pub fn transport_offset(f: &[u8]) -> Option<usize> {
    match f.get(12..14)? {
        [0x08, 0x00] => Some(ETH + usize::from(f.get(ETH)? & 0x0f) * 4),
        [0x86, 0xdd] => ipv6_upper(f).map(|(_, off)| off),
        _ => None,
    }
}

/// The upper-layer protocol of an IP frame and the offset of its header (past IPv6
/// extension headers, as [`transport_offset`] walks them).
pub fn transport(f: &[u8]) -> Option<(u8, usize)> {
    match f.get(12..14)? {
        [0x08, 0x00] => Some((*f.get(ETH + 9)?, transport_offset(f)?)),
        [0x86, 0xdd] => ipv6_upper(f),
        _ => None,
    }
}

/// An IPv6 frame's upper-layer protocol and its offset, past extension headers.
fn ipv6_upper(f: &[u8]) -> Option<(u8, usize)> {
    let mut next = *f.get(ETH + 6)?;
    let mut off = ETH + 40;
    while matches!(next, 0 | 43 | 44 | 60) {
        next = *f.get(off)?;
        off += (usize::from(*f.get(off + 1)?) + 1) * 8;
    }
    Some((next, off))
}

/// The TCP data offset, a port, or an ICMP type.
fn transport_field(rng: &mut Rng, f: &mut [u8]) {
    let Some(off) = transport_offset(f).filter(|o| o + 14 <= f.len()) else {
        return flip_header_bit(rng, f);
    };
    match rng.below(3) {
        0 => f[off + 12] = (rng.u8() << 4) | (f[off + 12] & 0x0f),
        1 => {
            let port = pick!(rng, [0u16, 20_001, 4797, rng.u16()]);
            set16(f, off + 2 * rng.below(2), port);
        }
        _ => f[off] = pick!(rng, [0u8, 3, 8, 11, 1, 2, 128, 129, 135, rng.u8()]),
    }
}
