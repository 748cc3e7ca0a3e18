//! OpenShift's cluster network configuration (`config.openshift.io/v1` `Network`, the
//! object named `cluster`), read only: its cluster and service networks (10.128.0.0/14
//! and 172.30.0.0/16 unless the installer chose others) are the cluster's own prefixes,
//! which no learned route may steer to a gateway, as `--cluster-cidr` says elsewhere.

use ipnet::IpNet;
use kube::CustomResource;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

pub const API_VERSION: &str = "config.openshift.io/v1";
pub const KIND: &str = "Network";
/// The one object the cluster's configuration lives in.
pub const NAME: &str = "cluster";

/// The part of the spec (what the installer asked for) and of the status we read.
#[derive(CustomResource, Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[kube(
    group = "config.openshift.io",
    version = "v1",
    kind = "Network",
    plural = "networks",
    status = "NetworkStatus",
    derive = "PartialEq",
    derive = "Default"
)]
#[serde(rename_all = "camelCase")]
pub struct NetworkSpec {
    #[serde(default)]
    pub cluster_network: Vec<ClusterNetworkEntry>,
    #[serde(default)]
    pub service_network: Vec<String>,
}

/// What the cluster runs with, in the spec's fields (it wins over the spec when set).
pub type NetworkStatus = NetworkSpec;

#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ClusterNetworkEntry {
    pub cidr: String,
}

/// The cluster and service networks of the `cluster` object among `objects`: its status's
/// when it has any, else its spec's; prefixes that do not parse are left out.
pub fn cluster_cidrs(objects: &[Network]) -> Vec<IpNet> {
    let Some(cluster) = objects
        .iter()
        .find(|n| n.metadata.name.as_deref() == Some(NAME))
    else {
        return Vec::new();
    };
    let from = |pods: &[ClusterNetworkEntry], services: &[String]| -> Vec<IpNet> {
        pods.iter()
            .map(|e| e.cidr.as_str())
            .chain(services.iter().map(String::as_str))
            .filter_map(|s| s.trim().parse::<IpNet>().ok())
            .map(|n| n.trunc())
            .collect()
    };
    let status = cluster
        .status
        .as_ref()
        .map(|s| from(&s.cluster_network, &s.service_network))
        .unwrap_or_default();
    if status.is_empty() {
        from(&cluster.spec.cluster_network, &cluster.spec.service_network)
    } else {
        status
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn network(name: &str, status: Option<(&[&str], &[&str])>) -> Network {
        let entries = |c: &[&str]| {
            c.iter()
                .map(|c| ClusterNetworkEntry {
                    cidr: (*c).to_owned(),
                })
                .collect()
        };
        let mut n = Network::new(
            name,
            NetworkSpec {
                cluster_network: entries(&["10.128.0.0/14"]),
                service_network: vec!["172.30.0.0/16".into()],
            },
        );
        n.status = status.map(|(pods, services)| NetworkStatus {
            cluster_network: entries(pods),
            service_network: services.iter().map(|s| (*s).to_owned()).collect(),
        });
        n
    }

    fn texts(objects: &[Network]) -> Vec<String> {
        cluster_cidrs(objects)
            .iter()
            .map(ToString::to_string)
            .collect()
    }

    #[test]
    fn the_cluster_objects_status_wins_over_its_spec_and_other_objects_are_ignored() {
        assert_eq!(
            texts(&[network("cluster", None)]),
            ["10.128.0.0/14", "172.30.0.0/16"]
        );
        let custom = network(
            "cluster",
            Some((&["10.132.0.0/14", "fd01::/48", "bad"], &["172.31.0.0/16"])),
        );
        assert_eq!(
            texts(&[network("other", None), custom]),
            ["10.132.0.0/14", "fd01::/48", "172.31.0.0/16"]
        );
        assert!(texts(&[network("other", None)]).is_empty());
    }
}
