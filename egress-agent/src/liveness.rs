//! Gateway liveness without the Kubernetes API: agents greet each other over the underlay
//! (a small UDP hello protocol next to the tunnel's port), and every agent derives from
//! what it hears which gateways are alive, whether it is itself cut off, and what each
//! peer holds. The compiler elects egress IP holders with that view ([`PeerView`]).
//!
//! * [`hello`]: the datagram (two versions, encode, strict decode, authentication).
//! * [`keys`]: the cluster keys hellos are signed with.
//! * [`remaps`]: the remapped translations gateways share through the hellos.
//! * [`tracker`]: the pure state machine (hellos and the clock in, the view out).
//! * [`service`]: the socket and the tasks around the tracker.

pub mod hello;
pub mod keys;
pub mod remaps;
pub mod service;
pub mod tracker;

pub use hello::Claim;
pub use tracker::{Membership, PeerStatus, PeerView, Report, Settings, Transition};
