//! What `explain` is asked: a pod (`--pod NS/NAME`) and a destination (`--to
//! ADDR[:PORT][/PROTO]`), parsed with errors that say what to type instead.

use std::{
    fmt,
    net::{IpAddr, Ipv6Addr},
    str::FromStr,
};

use super::Error;

/// A pod by namespace and name.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct PodRef {
    pub namespace: String,
    pub name: String,
}

impl FromStr for PodRef {
    type Err = Error;

    fn from_str(text: &str) -> Result<Self, Error> {
        let bad = || Error::BadPod {
            text: text.to_owned(),
        };
        let (namespace, name) = text.trim().split_once('/').ok_or_else(bad)?;
        if namespace.is_empty() || name.is_empty() || name.contains('/') {
            return Err(bad());
        }
        Ok(Self {
            namespace: namespace.to_owned(),
            name: name.to_owned(),
        })
    }
}

impl fmt::Display for PodRef {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.namespace, self.name)
    }
}

/// The protocols a destination may name.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Proto {
    Tcp,
    Udp,
    Sctp,
    Icmp,
}

impl Proto {
    /// The IP protocol number (ICMP: of the destination's family).
    pub fn number(self, ip: IpAddr) -> u8 {
        match self {
            Self::Tcp => 6,
            Self::Udp => 17,
            Self::Sctp => 132,
            Self::Icmp if ip.is_ipv6() => 58,
            Self::Icmp => 1,
        }
    }

    /// Whether it has ports.
    pub fn has_ports(self) -> bool {
        !matches!(self, Self::Icmp)
    }
}

impl fmt::Display for Proto {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Tcp => "tcp",
            Self::Udp => "udp",
            Self::Sctp => "sctp",
            Self::Icmp => "icmp",
        })
    }
}

/// A destination address, with the port and protocol when given. A port without a
/// protocol is TCP's (as in a NetworkPolicy).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Destination {
    pub ip: IpAddr,
    pub port: Option<u16>,
    pub proto: Option<Proto>,
}

impl FromStr for Destination {
    type Err = Error;

    fn from_str(text: &str) -> Result<Self, Error> {
        let bad = |detail: String| Error::BadTo {
            text: text.to_owned(),
            detail,
        };
        let trimmed = text.trim();
        let (addr_port, proto) = match trimmed.rsplit_once('/') {
            Some((rest, p)) => {
                let proto = match p.to_ascii_lowercase().as_str() {
                    "tcp" => Proto::Tcp,
                    "udp" => Proto::Udp,
                    "sctp" => Proto::Sctp,
                    "icmp" | "icmpv6" | "ping" => Proto::Icmp,
                    _ if p.parse::<u8>().is_ok() => {
                        return Err(bad(format!(
                            "{p:?} after the slash is not a protocol (a destination is one \
                             address, not a prefix)"
                        )));
                    }
                    _ => {
                        return Err(bad(format!(
                            "{p:?} is not a protocol (tcp, udp, sctp or icmp)"
                        )));
                    }
                };
                (rest, Some(proto))
            }
            None => (trimmed, None),
        };
        let (ip, port) = split_port(addr_port).map_err(bad)?;
        if port.is_some() && proto == Some(Proto::Icmp) {
            return Err(bad("icmp has no ports".to_owned()));
        }
        Ok(Self {
            ip,
            port,
            proto: proto.or(port.map(|_| Proto::Tcp)),
        })
    }
}

/// `ADDR`, `IPv4:PORT`, `[IPv6]` or `[IPv6]:PORT`.
fn split_port(text: &str) -> Result<(IpAddr, Option<u16>), String> {
    let port_of = |p: &str| {
        p.parse::<u16>()
            .ok()
            .filter(|p| *p > 0)
            .ok_or_else(|| format!("{p:?} is not a port (1 to 65535)"))
    };
    if let Some(rest) = text.strip_prefix('[') {
        let (addr, after) = rest
            .split_once(']')
            .ok_or_else(|| "an opening [ without its closing ]".to_owned())?;
        let ip: Ipv6Addr = addr
            .parse()
            .map_err(|_| format!("{addr:?} is not an IPv6 address"))?;
        let port = match after {
            "" => None,
            p => Some(port_of(p.strip_prefix(':').ok_or_else(|| {
                format!("{after:?} after the address: expected :PORT")
            })?)?),
        };
        return Ok((IpAddr::V6(ip), port));
    }
    if let Ok(ip) = text.parse::<IpAddr>() {
        return Ok((ip, None));
    }
    match text.rsplit_once(':') {
        Some((addr, p)) if !addr.contains(':') => {
            let ip: IpAddr = addr
                .parse()
                .map_err(|_| format!("{addr:?} is not an IP address"))?;
            Ok((ip, Some(port_of(p)?)))
        }
        Some(_) => Err(format!(
            "{text:?} is not an IP address (an IPv6 address with a port is written \
             [ADDR]:PORT)"
        )),
        None => Err(format!("{text:?} is not an IP address")),
    }
}

impl fmt::Display for Destination {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match (self.ip, self.port) {
            (IpAddr::V6(ip), Some(port)) => write!(f, "[{ip}]:{port}")?,
            (ip, Some(port)) => write!(f, "{ip}:{port}")?,
            (ip, None) => write!(f, "{ip}")?,
        }
        if let Some(proto) = self.proto {
            write!(f, "/{proto}")?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn to(text: &str) -> Result<Destination, String> {
        text.parse::<Destination>().map_err(|e| e.to_string())
    }

    #[test]
    fn destinations_parse_with_and_without_port_and_protocol() {
        let ip = |s: &str| s.parse::<IpAddr>().expect("ip");
        let cases = [
            ("192.0.2.7", ip("192.0.2.7"), None, None),
            (
                "192.0.2.7:443",
                ip("192.0.2.7"),
                Some(443),
                Some(Proto::Tcp),
            ),
            (
                "192.0.2.7:53/udp",
                ip("192.0.2.7"),
                Some(53),
                Some(Proto::Udp),
            ),
            ("192.0.2.7/icmp", ip("192.0.2.7"), None, Some(Proto::Icmp)),
            ("2001:db8::7", ip("2001:db8::7"), None, None),
            ("[2001:db8::7]", ip("2001:db8::7"), None, None),
            (
                "[2001:db8::7]:443/TCP",
                ip("2001:db8::7"),
                Some(443),
                Some(Proto::Tcp),
            ),
            (
                "2001:db8::7/sctp",
                ip("2001:db8::7"),
                None,
                Some(Proto::Sctp),
            ),
        ];
        for (text, ip, port, proto) in cases {
            assert_eq!(to(text), Ok(Destination { ip, port, proto }), "{text}");
            assert_eq!(
                to(&to(text).expect("parses").to_string()),
                to(text),
                "{text}"
            );
        }
    }

    #[test]
    fn bad_destinations_say_what_to_fix() {
        let cases = [
            ("192.0.2.0/24", "\"24\" after the slash is not a protocol"),
            ("192.0.2.7:0", "\"0\" is not a port (1 to 65535)"),
            ("192.0.2.7:http", "\"http\" is not a port"),
            ("example.com", "\"example.com\" is not an IP address"),
            (
                "192.0.2.7/gre",
                "\"gre\" is not a protocol (tcp, udp, sctp or icmp)",
            ),
            ("[2001:db8::7", "an opening [ without its closing ]"),
            (
                "2001:db8::7:443:x",
                "is not an IP address (an IPv6 address with a port",
            ),
            ("192.0.2.7:7/icmp", "icmp has no ports"),
        ];
        for (text, want) in cases {
            let e = to(text).expect_err(text);
            assert!(
                e.starts_with(&format!("failed to parse --to {text:?}: ")) && e.contains(want),
                "{text}: {e}"
            );
        }
    }

    #[test]
    fn pods_are_namespace_slash_name() {
        assert_eq!(
            "shop/api-1".parse::<PodRef>().map_err(|e| e.to_string()),
            Ok(PodRef {
                namespace: "shop".to_owned(),
                name: "api-1".to_owned()
            })
        );
        for bad in ["api-1", "/api-1", "shop/", "a/b/c"] {
            let e = bad.parse::<PodRef>().expect_err(bad).to_string();
            assert_eq!(
                e,
                format!(
                    "failed to parse --pod {bad:?}: expected NAMESPACE/NAME, such as shop/api-1"
                )
            );
        }
    }
}
