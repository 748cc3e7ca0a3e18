//! `egress-cni`: the chained CNI plugin that has the node's agent attach to a new pod's
//! device before the runtime finishes the pod (`egress_agent::cni`).

fn main() -> std::process::ExitCode {
    egress_agent::cni::plugin_main()
}
