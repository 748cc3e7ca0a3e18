//! ABI shared by the eBPF programs (`egress-ebpf`) and the agent (`egress-agent`).
//!
//! Every key and value is `#[repr(C)]`, `Copy`, without implicit padding (explicit `_pad`
//! fields), with a size assertion. Addresses are byte arrays in network order; ports are
//! `u16` fields whose names end in `_be` (network order, as they sit in the packet).
//! Nothing here may depend on `std`, tokio or kube.
#![no_std]

pub mod config;
pub mod conntrack;
pub mod counters;
pub mod maps;
pub mod policy;
pub mod underlay;

#[cfg(feature = "user")]
mod user;
