//! `kubectl egress status`: the cluster's egress state from the API alone (no agent's
//! metrics endpoint needed): each policy's conditions and egress IPs with their holders and
//! pod counts (its status, as the elected agent writes it), and what each EgressNode says
//! it holds, with the disagreements between the two.

use std::{collections::BTreeMap, fmt::Write as _, time::Duration};

use kube::{Api, Client, api::ListParams};

use crate::api::{EgressGatewayPolicy, EgressNode};

/// Errors of listing the cluster's egress objects.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("failed to list {plural}: {source}{}", hint(.source, .plural))]
    List {
        plural: &'static str,
        #[source]
        source: kube::Error,
    },
    #[error("failed to list {plural} within {secs} s: is the API server reachable?")]
    Timeout { plural: &'static str, secs: u64 },
}

/// What to fix, for the answers that say it.
fn hint(e: &kube::Error, plural: &str) -> String {
    match e {
        kube::Error::Api(status) if status.code == 404 => {
            " (is the CRD installed? `egress-agent crd | kubectl apply -f -`)".to_owned()
        }
        kube::Error::Api(status) if status.code == 401 || status.code == 403 => {
            format!(" (this user may not list {plural}: see the RBAC in deploy/)")
        }
        kube::Error::Service(_) | kube::Error::HyperError(_) => {
            " (is the API server of the kubeconfig's current context reachable?)".to_owned()
        }
        _ => String::new(),
    }
}

/// Every EgressGatewayPolicy and EgressNode of the cluster, each list within `timeout`.
pub async fn list(
    client: &Client,
    timeout: Duration,
) -> Result<(Vec<EgressGatewayPolicy>, Vec<EgressNode>), Error> {
    async fn all<K>(
        client: &Client,
        timeout: Duration,
        plural: &'static str,
    ) -> Result<Vec<K>, Error>
    where
        K: kube::Resource<DynamicType = (), Scope = kube::core::ClusterResourceScope>
            + Clone
            + serde::de::DeserializeOwned
            + std::fmt::Debug,
    {
        let api: Api<K> = Api::all(client.clone());
        let list = tokio::time::timeout(timeout, api.list(&ListParams::default()))
            .await
            .map_err(|_| Error::Timeout {
                plural,
                secs: timeout.as_secs(),
            })?
            .map_err(|source| Error::List { plural, source })?;
        Ok(list.items)
    }
    let policies = all(client, timeout, "egressgatewaypolicies").await?;
    let nodes = all(client, timeout, "egressnodes").await?;
    Ok((policies, nodes))
}

/// The overview as text: policies (sorted by name), then nodes (sorted by name).
pub fn text(policies: &[EgressGatewayPolicy], nodes: &[EgressNode]) -> String {
    let mut s = String::new();
    // What each node says it holds: (ip) -> (node, interface).
    let mut held: BTreeMap<&str, Vec<(&str, &str)>> = BTreeMap::new();
    for n in nodes {
        let name = n.metadata.name.as_deref().unwrap_or_default();
        for h in n.status.iter().flat_map(|st| &st.egress_ips) {
            held.entry(h.ip.as_str())
                .or_default()
                .push((name, h.interface.as_str()));
        }
    }
    let mut policies: Vec<&EgressGatewayPolicy> = policies.iter().collect();
    policies.sort_by(|a, b| a.metadata.name.cmp(&b.metadata.name));
    if policies.is_empty() {
        let _ = writeln!(s, "no EgressGatewayPolicies");
    }
    for p in policies {
        policy(&mut s, p, &held);
    }
    let mut nodes: Vec<&EgressNode> = nodes.iter().collect();
    nodes.sort_by(|a, b| a.metadata.name.cmp(&b.metadata.name));
    let _ = writeln!(s, "\nnodes ({}):", nodes.len());
    for n in nodes {
        node(&mut s, n);
    }
    s
}

fn policy(s: &mut String, p: &EgressGatewayPolicy, held: &BTreeMap<&str, Vec<(&str, &str)>>) {
    let name = p.metadata.name.as_deref().unwrap_or_default();
    let Some(status) = &p.status else {
        let _ = writeln!(
            s,
            "policy {name}: no status yet (no agent has written it: are the agents running?)"
        );
        return;
    };
    let stale = match (status.observed_generation, p.metadata.generation) {
        (Some(seen), Some(now)) if seen < now => {
            format!(" (status of generation {seen}, the spec is at {now})")
        }
        _ => String::new(),
    };
    let summary: Vec<String> = status
        .conditions
        .iter()
        .map(|c| format!("{}={}", c.type_, c.status))
        .collect();
    let _ = writeln!(s, "policy {name}: {}{stale}", summary.join(" "));
    for c in &status.conditions {
        let healthy = matches!(c.type_.as_str(), "Accepted" | "Ready");
        if (c.status == "True") != healthy {
            let _ = writeln!(s, "  {}={} {}: {}", c.type_, c.status, c.reason, c.message);
        }
    }
    if status.egress_ips.is_empty() {
        let _ = writeln!(s, "  no egress IPs in use");
    }
    for ip in &status.egress_ips {
        let pods = ip.pods.map_or("? pods".to_owned(), |n| {
            format!("{n} pod{}", if n == 1 { "" } else { "s" })
        });
        let why = match (&ip.reason, &ip.since) {
            (Some(r), Some(t)) => format!(", {r} since {t}"),
            (Some(r), None) => format!(", {r}"),
            (None, Some(t)) => format!(", since {t}"),
            (None, None) => String::new(),
        };
        let claims = held.get(ip.ip.as_str()).cloned().unwrap_or_default();
        let agrees = claims.iter().any(|(n, _)| *n == ip.node);
        let others: Vec<String> = claims
            .iter()
            .filter(|(n, _)| *n != ip.node)
            .map(|(n, i)| format!("{n} ({i})"))
            .collect();
        let mut note = String::new();
        if !agrees && !claims.is_empty() {
            let _ = write!(note, "; its EgressNode does not list it");
        }
        if !others.is_empty() {
            let _ = write!(note, "; also claimed by {}", others.join(", "));
        }
        let _ = writeln!(
            s,
            "  {} on {} ({}): {pods}{why}{note}",
            ip.ip, ip.node, ip.interface
        );
    }
}

fn node(s: &mut String, n: &EgressNode) {
    let name = n.metadata.name.as_deref().unwrap_or_default();
    let underlay = n
        .spec
        .underlay_ip
        .as_deref()
        .unwrap_or("no underlay address");
    let Some(st) = &n.status else {
        let _ = writeln!(s, "  {name} ({underlay}): no status yet");
        return;
    };
    let version = st.agent_version.as_deref().unwrap_or("unknown");
    let alive = st.peers.iter().filter(|p| p.alive).count();
    let mut line = format!(
        "  {name} ({underlay}): agent {version}, peers {alive}/{} alive",
        st.peers.len()
    );
    if st.cut_off {
        line.push_str(", CUT OFF (holds nothing until it hears its peers)");
    }
    let down: Vec<&str> = st
        .interfaces
        .iter()
        .filter(|i| !i.up)
        .map(|i| i.name.as_str())
        .collect();
    if !down.is_empty() {
        let _ = write!(line, ", interfaces down: {}", down.join(", "));
    }
    let _ = writeln!(s, "{line}");
    for h in &st.egress_ips {
        let why = h
            .reason
            .as_deref()
            .map_or(String::new(), |r| format!(", {r}"));
        let _ = writeln!(
            s,
            "    holds {} on {} (epoch {}{why})",
            h.ip, h.interface, h.epoch
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::api::{
        EgressGatewayPolicySpec, EgressIpStatus, EgressNodeSpec, EgressNodeStatus, HeldEgressIp,
        PeerLiveness, PolicyCondition, PolicyStatus,
    };

    fn condition(type_: &str, status: &str, reason: &str, message: &str) -> PolicyCondition {
        PolicyCondition {
            type_: type_.to_owned(),
            status: match status {
                "True" => crate::api::ConditionStatus::True,
                "False" => crate::api::ConditionStatus::False,
                _ => crate::api::ConditionStatus::Unknown,
            },
            observed_generation: None,
            reason: reason.to_owned(),
            message: message.to_owned(),
            last_transition_time: None,
        }
    }

    #[test]
    fn policies_and_nodes_with_holders_pods_and_disagreements() {
        let mut payments = EgressGatewayPolicy::new("payments", EgressGatewayPolicySpec::default());
        payments.metadata.generation = Some(2);
        payments.status = Some(PolicyStatus {
            observed_generation: Some(2),
            conditions: vec![
                condition("Accepted", "True", "Accepted", "the policy is valid"),
                condition(
                    "Ready",
                    "False",
                    "NoEligibleGateway",
                    "rules[1]: no gateway",
                ),
            ],
            egress_ips: vec![
                EgressIpStatus {
                    ip: "198.51.100.10".to_owned(),
                    node: "gw-1".to_owned(),
                    interface: "ens224".to_owned(),
                    since: Some("2026-01-01T00:00:00Z".to_owned()),
                    reason: Some("Assigned".to_owned()),
                    pods: Some(3),
                },
                EgressIpStatus {
                    ip: "198.51.100.11".to_owned(),
                    node: "gw-2".to_owned(),
                    interface: "ens224".to_owned(),
                    since: None,
                    reason: Some("HolderUnreachable".to_owned()),
                    pods: Some(1),
                },
            ],
        });
        let fresh = EgressGatewayPolicy::new("fresh", EgressGatewayPolicySpec::default());
        let gw1 = EgressNode {
            metadata: kube::api::ObjectMeta {
                name: Some("gw-1".to_owned()),
                ..Default::default()
            },
            spec: EgressNodeSpec {
                underlay_ip: Some("10.0.0.11".to_owned()),
            },
            status: Some(EgressNodeStatus {
                egress_ips: vec![
                    HeldEgressIp {
                        ip: "198.51.100.10".to_owned(),
                        interface: "ens224".to_owned(),
                        epoch: 1,
                        since: None,
                        reason: Some("Assigned".to_owned()),
                    },
                    HeldEgressIp {
                        ip: "198.51.100.11".to_owned(),
                        interface: "ens224".to_owned(),
                        epoch: 1,
                        since: None,
                        reason: None,
                    },
                ],
                peers: vec![PeerLiveness {
                    name: "gw-2".to_owned(),
                    alive: false,
                }],
                agent_version: Some("0.1.0".to_owned()),
                ..Default::default()
            }),
        };
        let text = text(&[payments, fresh], &[gw1]);
        assert_eq!(
            text,
            "policy fresh: no status yet (no agent has written it: are the agents running?)\n\
             policy payments: Accepted=True Ready=False\n  \
             Ready=False NoEligibleGateway: rules[1]: no gateway\n  \
             198.51.100.10 on gw-1 (ens224): 3 pods, Assigned since 2026-01-01T00:00:00Z\n  \
             198.51.100.11 on gw-2 (ens224): 1 pod, HolderUnreachable; its EgressNode does \
             not list it; also claimed by gw-1 (ens224)\n\
             \nnodes (1):\n  \
             gw-1 (10.0.0.11): agent 0.1.0, peers 0/1 alive\n    \
             holds 198.51.100.10 on ens224 (epoch 1, Assigned)\n    \
             holds 198.51.100.11 on ens224 (epoch 1)\n"
        );
    }
}
