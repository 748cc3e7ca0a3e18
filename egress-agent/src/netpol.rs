//! A NetworkPolicy read, as far as the traffic the datapath redirects goes: its pods'
//! selector, whether it isolates them for `Egress`, and its egress rules' `ipBlock`s and
//! ports. Below both the sources, which refuse a document that does not read (each error
//! names its field, as the API server would have refused it), and the compiler, which
//! applies what reads ([`crate::compiler::netpol`]).

use ipnet::IpNet;
use k8s_openapi::{
    api::networking::v1::{NetworkPolicy, NetworkPolicyEgressRule, NetworkPolicyPort},
    apimachinery::pkg::util::intstr::IntOrString,
};

use crate::{desired::PortSet, selector::Selector};

const TCP: u8 = 6;
const UDP: u8 = 17;
const SCTP: u8 = 132;

/// An `ipBlock`: its CIDR without its excepts.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Block {
    pub cidr: IpNet,
    pub except: Vec<IpNet>,
}

impl Block {
    pub fn holds(&self, p: &IpNet) -> bool {
        self.cidr.contains(p) && !self.except.iter().any(|x| x.contains(p))
    }
}

/// One egress rule, as it applies to destinations outside the cluster.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Allow {
    /// `None`: every destination (no `to`); else the `ipBlock`s (none: only pods).
    pub to: Option<Vec<Block>>,
    /// `None`: every port and protocol (no `ports`); else the ranges (none: only named
    /// ports).
    pub ports: Option<PortSet>,
}

/// A NetworkPolicy as far as redirected traffic goes.
#[derive(Clone, Debug)]
pub struct EgressPolicy {
    pub namespace: String,
    pub name: String,
    pub pods: Selector,
    /// Selects its pods for `Egress`.
    pub egress: bool,
    pub rules: Vec<Allow>,
    /// What it says that cannot apply here (field path first).
    pub notes: Vec<String>,
}

impl EgressPolicy {
    /// `namespace/name`.
    pub fn label(&self) -> String {
        format!("{}/{}", self.namespace, self.name)
    }
}

/// Read `np`: errors name the field (`spec.egress[0].to[1].ipBlock.cidr: ...`).
pub fn parse(np: &NetworkPolicy) -> Result<EgressPolicy, Vec<String>> {
    let namespace = np
        .metadata
        .namespace
        .clone()
        .unwrap_or_else(|| "default".to_owned());
    let name = np.metadata.name.clone().unwrap_or_default();
    let mut errors = Vec::new();
    let mut notes = Vec::new();
    let spec = np.spec.clone().unwrap_or_default();
    let pods = Selector::new(
        &spec.pod_selector.clone().unwrap_or_default(),
        "spec.podSelector",
    )
    .map_err(|e| errors.push(e))
    .unwrap_or_default();
    let egress = match &spec.policy_types {
        Some(types) => {
            for (i, t) in types.iter().enumerate() {
                if t != "Ingress" && t != "Egress" {
                    errors.push(format!(
                        "spec.policyTypes[{i}]: {t:?} is not Ingress or Egress"
                    ));
                }
            }
            types.iter().any(|t| t == "Egress")
        }
        None => spec.egress.as_ref().is_some_and(|e| !e.is_empty()),
    };
    let mut rules = Vec::new();
    for (i, rule) in spec.egress.iter().flatten().enumerate() {
        match parse_rule(rule, &format!("spec.egress[{i}]"), &mut notes) {
            Ok(r) => rules.push(r),
            Err(e) => errors.extend(e),
        }
    }
    if errors.is_empty() {
        Ok(EgressPolicy {
            namespace,
            name,
            pods,
            egress,
            rules,
            notes,
        })
    } else {
        Err(errors)
    }
}

fn parse_rule(
    rule: &NetworkPolicyEgressRule,
    at: &str,
    notes: &mut Vec<String>,
) -> Result<Allow, Vec<String>> {
    let mut errors = Vec::new();
    let to = match &rule.to {
        None => None,
        Some(peers) if peers.is_empty() => None,
        Some(peers) => {
            let mut blocks = Vec::new();
            for (j, peer) in peers.iter().enumerate() {
                let at = format!("{at}.to[{j}]");
                let Some(b) = &peer.ip_block else {
                    continue;
                };
                if peer.pod_selector.is_some() || peer.namespace_selector.is_some() {
                    errors.push(format!(
                        "{at}: ipBlock cannot be combined with podSelector or namespaceSelector"
                    ));
                    continue;
                }
                match parse_block(&b.cidr, b.except.as_deref().unwrap_or_default(), &at) {
                    Ok(block) => blocks.push(block),
                    Err(e) => errors.push(e),
                }
            }
            Some(blocks)
        }
    };
    let ports = match &rule.ports {
        None => None,
        Some(ports) if ports.is_empty() => None,
        Some(ports) => {
            let mut set = Vec::new();
            for (k, port) in ports.iter().enumerate() {
                let at = format!("{at}.ports[{k}]");
                match parse_port(port, &at) {
                    Ok(Some(range)) => set.push(range),
                    Ok(None) => notes.push(format!(
                        "{at}.port: named port {:?} cannot match a host outside the cluster: \
                         it allows nothing toward the destinations egress gateways redirect",
                        port_name(port)
                    )),
                    Err(e) => errors.push(e),
                }
            }
            Some(merge(set))
        }
    };
    if errors.is_empty() {
        Ok(Allow { to, ports })
    } else {
        Err(errors)
    }
}

fn port_name(port: &NetworkPolicyPort) -> String {
    match &port.port {
        Some(IntOrString::String(s)) => s.clone(),
        Some(IntOrString::Int(n)) => n.to_string(),
        None => String::new(),
    }
}

fn parse_block(cidr: &str, except: &[String], at: &str) -> Result<Block, String> {
    let net: IpNet = cidr
        .parse()
        .map_err(|_| format!("{at}.ipBlock.cidr: {cidr:?} is not a CIDR (such as 192.0.2.0/24)"))?;
    if net.trunc() != net {
        return Err(format!(
            "{at}.ipBlock.cidr: {cidr} has host bits set (did you mean {}?)",
            net.trunc()
        ));
    }
    let mut holes = Vec::new();
    for (k, x) in except.iter().enumerate() {
        let hole: IpNet = x.parse().map_err(|_| {
            format!("{at}.ipBlock.except[{k}]: {x:?} is not a CIDR (such as 192.0.2.0/28)")
        })?;
        if !net.contains(&hole) || hole.prefix_len() == net.prefix_len() {
            return Err(format!(
                "{at}.ipBlock.except[{k}]: {x} must be strictly inside {cidr}"
            ));
        }
        holes.push(hole.trunc());
    }
    Ok(Block {
        cidr: net,
        except: holes,
    })
}

/// One port entry's range; `None` for a named port.
fn parse_port(port: &NetworkPolicyPort, at: &str) -> Result<Option<(u8, u16, u16)>, String> {
    let proto = match port.protocol.as_deref().unwrap_or("TCP") {
        "TCP" => TCP,
        "UDP" => UDP,
        "SCTP" => SCTP,
        other => {
            return Err(format!("{at}.protocol: {other:?} is not TCP, UDP or SCTP"));
        }
    };
    let first = match &port.port {
        None => {
            if port.end_port.is_some() {
                return Err(format!("{at}.endPort: requires a numeric port"));
            }
            return Ok(Some((proto, 0, u16::MAX)));
        }
        Some(IntOrString::String(_)) => {
            if port.end_port.is_some() {
                return Err(format!("{at}.endPort: requires a numeric port"));
            }
            return Ok(None);
        }
        Some(IntOrString::Int(n)) => u16::try_from(*n)
            .ok()
            .filter(|n| *n > 0)
            .ok_or_else(|| format!("{at}.port: {n} is not a port (1 to 65535)"))?,
    };
    let last = match port.end_port {
        None => first,
        Some(e) => u16::try_from(e)
            .ok()
            .filter(|e| *e >= first)
            .ok_or_else(|| {
                format!("{at}.endPort: {e} must be a port (to 65535) at least port {first}")
            })?,
    };
    Ok(Some((proto, first, last)))
}

/// Sort and merge overlapping or adjacent ranges of one protocol.
pub fn merge(mut set: PortSet) -> PortSet {
    set.sort_unstable();
    let mut out: PortSet = Vec::with_capacity(set.len());
    for (p, a, b) in set {
        if let Some(last) = out.last_mut()
            && last.0 == p
            && u32::from(a) <= u32::from(last.2) + 1
        {
            last.2 = last.2.max(b);
            continue;
        }
        out.push((p, a, b));
    }
    out
}
