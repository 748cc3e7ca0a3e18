//! A directory of multi-document YAML files as the source of cluster state: Nodes,
//! Namespaces, Pods, EgressGatewayPolicies and EgressNodes, exactly as Kubernetes serves
//! them (`apiVersion`, `kind`, `metadata`, `spec`, `status`).
//!
//! Reading never stops at a bad document: each one is reported ([`super::DocumentError`], naming
//! file, document, object and field) and left out, and every good one is kept; the
//! watcher ([`watch`]) serves the last good version of an object whose file or document
//! broke. Files, documents and nesting are bounded ([`MAX_FILE_BYTES`],
//! [`MAX_DOCUMENT_BYTES`], [`MAX_DEPTH`]) before the YAML parser sees them. The agent
//! writes only its own `egressnode-<node>.yaml` there ([`write_egress_node`]), never
//! through a link planted in the directory.
//!
//! One module per job: [`documents`] (a file into documents, each into an object),
//! [`loading`] (a directory into a [`super::Snapshot`], last good versions kept for the watcher),
//! [`watching`] (inotify and polling) and [`writing`] (the agent's EgressNode file).

mod documents;
#[cfg(test)]
mod fixtures;
mod loading;
mod watching;
mod writing;

pub use documents::{MAX_DEPTH, MAX_DOCUMENT_BYTES};
pub use loading::{MAX_FILE_BYTES, QUIET, Rereads, load_dir, load_str};
pub use watching::{MAX_DELAY, MAX_SETTLE, SETTLE, watch};
pub use writing::{DirWriter, WriteError, egress_node_file_name, write_egress_node};
