fn main() {
    println!("{}", egress_agent::ebpf::OBJECT.len());
}
