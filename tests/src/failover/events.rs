//! Who holds an egress IP, from the kernel's own address notifications: `ip -ts monitor
//! address` in every gateway's namespace. Unlike [`super::holders`]'s sampler there is no
//! interval between looks, so two holders for a few milliseconds show.

use std::{collections::BTreeMap, net::IpAddr, path::PathBuf, thread, time::Duration};

use anyhow::{Context as _, Result};

use super::rfc3339_unix_ms;
use crate::{cluster, lab::Lab, netns::NsChild};

/// An address added to or deleted from a gateway's interface.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AddressEvent {
    /// Microseconds of the gateways' shared clock.
    pub at_us: u64,
    pub gateway: String,
    pub ip: IpAddr,
    pub added: bool,
}

/// The monitors, one per gateway, with what each gateway held of `ips` when they started.
pub struct AddressEvents {
    monitors: Vec<(String, NsChild, PathBuf)>,
    initial: Vec<AddressEvent>,
}

impl AddressEvents {
    /// Start a monitor in every gateway of `lab` (logs in the lab's directory, named after
    /// `label`), then read who holds each of `ips` now.
    pub fn start(lab: &Lab, ips: &[IpAddr], label: &str) -> Result<Self> {
        let mut monitors = Vec::new();
        for gw in lab.gateways() {
            let log = lab.dir().join(format!("addresses-{label}-{gw}.log"));
            let child = lab
                .ns(gw)?
                .spawn("ip", &["-ts", "monitor", "address"], &log)?;
            monitors.push((gw.to_owned(), child, log));
        }
        // The monitors subscribe as they start: what changes before is in `initial`.
        thread::sleep(Duration::from_millis(300));
        let now_us = super::unix_ms() * 1000;
        let initial = ips
            .iter()
            .flat_map(|ip| {
                cluster::holders(lab, *ip)
                    .into_iter()
                    .map(move |(gateway, _)| AddressEvent {
                        at_us: now_us,
                        gateway,
                        ip: *ip,
                        added: true,
                    })
            })
            .collect();
        Ok(Self { monitors, initial })
    }

    /// Stop the monitors; what they saw, after the initial holders, in time order.
    pub fn stop(self) -> Result<Vec<AddressEvent>> {
        let mut out = self.initial;
        for (gw, mut child, log) in self.monitors {
            child.kill();
            let text = std::fs::read_to_string(&log)
                .with_context(|| format!("failed to read {}", log.display()))?;
            out.extend(parse(&gw, &text));
        }
        out.sort_by_key(|e| e.at_us);
        Ok(out)
    }
}

/// The address events of `ip -ts monitor address` output from `gateway`.
pub fn parse(gateway: &str, text: &str) -> Vec<AddressEvent> {
    text.lines()
        .filter_map(|line| {
            let rest = line.strip_prefix('[')?;
            let (stamp, rest) = rest.split_once("] ")?;
            let (added, rest) = match rest.strip_prefix("Deleted ") {
                Some(r) => (false, r),
                None => (true, rest),
            };
            let mut words = rest.split_whitespace();
            let ip = words
                .find(|w| *w == "inet" || *w == "inet6")
                .and_then(|_| words.next())
                .and_then(|cidr| cidr.split('/').next()?.parse().ok())?;
            Some(AddressEvent {
                at_us: stamp_us(stamp)?,
                gateway: gateway.to_owned(),
                ip,
                added,
            })
        })
        .collect()
}

/// `2026-12-05T07:46:12.493210` (the gateways' local time: only differences matter) in
/// microseconds.
fn stamp_us(stamp: &str) -> Option<u64> {
    let (_, frac) = stamp.split_once('.')?;
    let micros: u64 = format!("{frac:0<6}").get(..6)?.parse().ok()?;
    let ms = rfc3339_unix_ms(&format!("{stamp}Z"))?;
    Some((ms / 1000) * 1_000_000 + micros)
}

/// Every stretch in which two or more gateways held `ip`, in words with its length
/// (`gw1+gw2 for 3.2 ms`), from `events` in time order.
pub fn two_holders(events: &[AddressEvent], ip: IpAddr) -> Vec<String> {
    let mut held: BTreeMap<&str, bool> = BTreeMap::new();
    let mut since: Option<(u64, String)> = None;
    let mut out = Vec::new();
    for e in events.iter().filter(|e| e.ip == ip) {
        held.insert(&e.gateway, e.added);
        let now: Vec<&str> = held.iter().filter(|(_, h)| **h).map(|(g, _)| *g).collect();
        match (&since, now.len() >= 2) {
            (None, true) => since = Some((e.at_us, now.join("+"))),
            (Some((from, who)), false) => {
                let ms = (e.at_us - from) as f64 / 1000.0;
                out.push(format!("{who} for {ms:.1} ms"));
                since = None;
            }
            _ => {}
        }
    }
    if let Some((_, who)) = since {
        out.push(format!("{who} until the end"));
    }
    out
}

/// After `ip` was first let go (the gateways fenced themselves), every change beyond one
/// gateway taking it, in words (`gw1 let it go 30.2 ms after taking it`): empty when the
/// address was taken once and kept.
pub fn retaken(events: &[AddressEvent], ip: IpAddr) -> Vec<String> {
    let of_ip: Vec<&AddressEvent> = events.iter().filter(|e| e.ip == ip).collect();
    let Some(fenced) = of_ip.iter().position(|e| !e.added) else {
        return Vec::new();
    };
    let after = &of_ip[fenced + 1..];
    let mut out = Vec::new();
    for pair in after.windows(2) {
        let (a, b) = (pair[0], pair[1]);
        let ms = (b.at_us - a.at_us) as f64 / 1000.0;
        out.push(match (a.added, b.added) {
            (true, false) => format!(
                "{} took it, {} let it go {ms:.1} ms later",
                a.gateway, b.gateway
            ),
            _ => format!(
                "{} {} it, then {} {} it {ms:.1} ms later",
                a.gateway,
                if a.added { "took" } else { "let go of" },
                b.gateway,
                if b.added { "took" } else { "let go of" },
            ),
        });
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    const OUT: &str = "\
[2026-12-05T07:46:12.493210] 3: sec-a    inet 192.168.101.50/24 scope global sec-a
       valid_lft forever preferred_lft forever
[2026-12-05T07:46:12.500436] 3: sec-a    inet6 fd00:101::50/64 scope global nodad
       valid_lft forever preferred_lft forever
[2026-12-05T07:46:12.504738] Deleted 3: sec-a    inet 192.168.101.50/24 scope global sec-a
       valid_lft forever preferred_lft forever
";

    #[test]
    fn monitor_lines_are_events_to_the_microsecond() {
        let e = parse("gw1", OUT);
        let a: IpAddr = "192.168.101.50".parse().unwrap();
        assert_eq!(e.len(), 3);
        assert_eq!((e[0].ip, e[0].added), (a, true));
        assert_eq!(e[1].ip, "fd00:101::50".parse::<IpAddr>().unwrap());
        assert_eq!((e[2].ip, e[2].added), (a, false));
        assert_eq!(e[2].at_us - e[0].at_us, 11_528);
    }

    fn ip_a() -> IpAddr {
        "192.168.101.50".parse().unwrap()
    }

    fn ev(at_us: u64, gateway: &str, added: bool) -> AddressEvent {
        AddressEvent {
            at_us,
            gateway: gateway.to_owned(),
            ip: ip_a(),
            added,
        }
    }

    #[test]
    fn a_few_milliseconds_of_two_holders_are_seen() {
        let a = ip_a();
        let events = [
            ev(0, "gw1", true),
            ev(1_000, "gw2", true),
            ev(4_200, "gw1", false),
            ev(9_000, "gw1", true),
        ];
        assert_eq!(
            two_holders(&events, a),
            ["gw1+gw2 for 3.2 ms", "gw1+gw2 until the end"]
        );
        assert!(two_holders(&events[..1], a).is_empty());
    }

    #[test]
    fn an_address_taken_let_go_and_taken_again_after_the_fence_is_seen() {
        let a = ip_a();
        let kept = [
            ev(0, "gw1", true),
            ev(500, "gw1", false),
            ev(900, "gw1", true),
        ];
        assert!(retaken(&kept, a).is_empty());
        let flapped = [
            ev(0, "gw1", true),
            ev(500_000, "gw1", false),
            ev(604_000, "gw1", true),
            ev(634_000, "gw1", false),
            ev(675_000, "gw2", true),
        ];
        assert_eq!(
            retaken(&flapped, a),
            [
                "gw1 took it, gw1 let it go 30.0 ms later",
                "gw1 let go of it, then gw2 took it 41.0 ms later"
            ]
        );
    }
}
