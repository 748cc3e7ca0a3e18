//! The agents' hellos cost no allocation per hello (issue 49): in the steady state of a
//! 100-node cluster with 10 gateways, a gateway and a worker write their hellos and take
//! their peers' with the agent's own tracker and codec, this binary counting every
//! allocation (`egress_tests::alloc`). A hello that changes its sender's lists is
//! decoded (and allocates); one that repeats them, nearly all of them, does not.

use egress_tests::{alloc, bench::probes};

#[global_allocator]
static ALLOCATOR: alloc::Counting = alloc::Counting;

#[test]
fn hellos_sent_and_taken_in_the_steady_state_allocate_nothing() {
    let [gw_sent, gw_received, w_sent, w_received] =
        probes::allocations_per_hello().expect("this binary counts allocations");
    assert_eq!(
        (gw_sent, gw_received, w_sent, w_received),
        (0.0, 0.0, 0.0, 0.0),
        "allocations per hello: gateway sent, received; worker sent, received"
    );
}

#[test]
fn the_count_sees_allocations() {
    let (v, n) = alloc::during(|| vec![1u8; 3]);
    assert_eq!((v.len(), n), (3, Some(1)));
}
