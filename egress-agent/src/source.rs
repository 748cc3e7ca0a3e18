//! Sources of cluster state: a YAML directory ([`yaml`]), or Kubernetes ([`kube`]).
//!
//! Every source produces the same [`ClusterView`]: the objects the compiler needs, in the
//! types Kubernetes serves them as.

use k8s_openapi::api::core::v1::{Namespace, Node, Pod};

use crate::api::{EgressGatewayPolicy, EgressNode};

pub mod kube;
pub mod yaml;

/// Everything the compiler reads about the cluster. Order does not matter: the compiler
/// sorts what it uses.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct ClusterView {
    pub policies: Vec<EgressGatewayPolicy>,
    pub namespaces: Vec<Namespace>,
    pub pods: Vec<Pod>,
    pub nodes: Vec<Node>,
    pub egress_nodes: Vec<EgressNode>,
}
