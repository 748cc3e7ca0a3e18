static OBJ: &[u8] = aya::include_bytes_aligned!(concat!(env!("OUT_DIR"), "/egress"));
fn main() { println!("{}", OBJ.len()); }
