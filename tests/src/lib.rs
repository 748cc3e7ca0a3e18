//! Shared by the integration tests, the lab demo and the benchmarks: the lab (network
//! namespaces), a packet builder and `BPF_PROG_TEST_RUN` plumbing.

pub mod aborts;
pub mod alloc;
pub mod bed;
pub mod bench;
pub mod cluster;
pub mod deployed;
pub mod failover;
pub mod fuzz;
pub mod hooks;
pub mod lab;
pub mod netns;
pub mod packet;
pub mod packet6;
pub mod scale_lab;
pub mod soak;
pub mod spread;
pub mod stream;
pub mod table;
pub mod testrun;
