//! The policy compiler: a pure function from the cluster view to the desired state.
