use super::*;
use crate::check::check_dir;

/// The importer's output and refusals (as printed) for `input`, with `opts`.
fn imported(input: &str, opts: &Options) -> (String, Vec<String>) {
    let (docs, mut refused) = documents(input, "in.yaml");
    let (yaml, r) = import(&docs, opts);
    refused.extend(r);
    (yaml, refused.iter().map(ToString::to_string).collect())
}

const SHOP: &str = r#"
apiVersion: k8s.ovn.org/v1
kind: EgressIP
metadata: {name: shop, uid: 1c0ffee, resourceVersion: "7"}
spec:
  egressIPs: [192.0.2.10]
  namespaceSelector: {matchLabels: {team: shop}}
status:
  items:
  - {node: worker-1, egressIP: 192.0.2.10}
"#;

const PAYMENTS: &str = r#"
apiVersion: k8s.ovn.org/v1
kind: EgressIP
metadata: {name: payments}
spec:
  egressIPs: [192.0.2.20, "2001:db8::20", 192.0.2.21]
  namespaceSelector:
    matchExpressions: [{key: team, operator: In, values: [payments, billing]}]
  podSelector: {matchLabels: {app: api}}
"#;

/// Golden: one address, a namespace selector, where OVN placed it.
#[test]
fn one_egress_ip_becomes_one_rule_to_everything_through_the_egress_nodes() {
    let (yaml, refused) = imported(SHOP, &Options::default());
    assert_eq!(refused, Vec::<String>::new());
    let policy = yaml.split("---\n").nth(1).expect("a policy");
    assert_eq!(
        policy,
        "# From OVN-Kubernetes EgressIP \"shop\".\n\
         # OVN-Kubernetes holds 192.0.2.10 on node worker-1 (status.items).\n\
         apiVersion: egress.dev/v1alpha1\n\
         kind: EgressGatewayPolicy\n\
         metadata:\n  name: shop\n\
         spec:\n  \
           namespaceSelector:\n    matchLabels:\n      team: shop\n  \
           gatewaySelector:\n    matchLabels:\n      k8s.ovn.org/egress-assignable: ''\n  \
           failurePolicy: Drop\n  \
           rules:\n  \
           - destinations:\n    - 0.0.0.0/0\n    egressIP: 192.0.2.10\n"
    );
    // The header says what was assumed, and which flag changes it.
    for says in [
        "destinations: everything (0.0.0.0/0, ::/0)",
        "gatewaySelector: the nodes labelled k8s.ovn.org/egress-assignable= (--gateway-selector)",
        "failurePolicy: Drop",
        "with Drop it is dropped\n# until the EgressIP is gone",
        "docs/openshift.md, \"Migrating from\n# EgressIP\"",
    ] {
        assert!(
            yaml.starts_with('#') && yaml.contains(says),
            "{says}:\n{yaml}"
        );
    }
}

/// Golden: both families (one rule each), several addresses of one (egressIPs), a pod
/// selector and match expressions; the flags' gateway selector and failure policy.
#[test]
fn each_family_is_a_rule_and_the_flags_choose_gateways_and_failure() {
    let opts = Options {
        gateway_labels: BTreeMap::from([("egress.dev/gateway".to_owned(), "true".to_owned())]),
        failure_policy: FailurePolicy::Fallthrough,
    };
    let (yaml, refused) = imported(PAYMENTS, &opts);
    assert_eq!(refused, Vec::<String>::new());
    let policy = yaml.split("---\n").nth(1).expect("a policy");
    assert_eq!(
        policy,
        "# From OVN-Kubernetes EgressIP \"payments\".\n\
         # several addresses of one family: OVN-Kubernetes spreads a pod's flows over them; \
         egressIPs gives each pod one of them, the same while it lives.\n\
         apiVersion: egress.dev/v1alpha1\n\
         kind: EgressGatewayPolicy\n\
         metadata:\n  name: payments\n\
         spec:\n  \
           namespaceSelector:\n    matchExpressions:\n    - key: team\n      operator: In\n      \
             values:\n      - payments\n      - billing\n  \
           podSelector:\n    matchLabels:\n      app: api\n  \
           gatewaySelector:\n    matchLabels:\n      egress.dev/gateway: 'true'\n  \
           failurePolicy: Fallthrough\n  \
           rules:\n  \
           - destinations:\n    - 0.0.0.0/0\n    egressIPs:\n    - 192.0.2.20\n    - 192.0.2.21\n  \
           - destinations:\n    - ::/0\n    egressIP: 2001:db8::20\n"
    );
    assert!(yaml.contains("failurePolicy: Fallthrough (--failure-policy): with no usable gateway"));
}

/// A bad object names itself, the field and why; the good ones around it are still
/// translated, from several documents and from a `List`.
#[test]
fn bad_objects_are_refused_by_field_and_the_others_still_translate() {
    let bad = r#"
apiVersion: k8s.ovn.org/v1
kind: EgressIP
metadata: {name: foo}
spec:
  egressIPs: [192.0.2.30, x, 192.0.2.30, 7]
  podSelector: {matchLabels: {app: [1]}}
  nodeSelector: {matchLabels: {zone: a}}
---
apiVersion: k8s.ovn.org/v1
kind: EgressIP
metadata: {name: empty}
spec: {egressIPs: [], namespaceSelector: {}}
---
apiVersion: v1
kind: ConfigMap
metadata: {name: cm}
---
apiVersion: k8s.ovn.org/v1
kind: EgressIP
spec: {egressIPs: [192.0.2.40], namespaceSelector: {}}
"#;
    let list = format!(
        "apiVersion: v1\nkind: List\nitems:\n- {}",
        serde_json::to_string(&serde_yaml_ng::from_str::<Value>(SHOP).expect("YAML"))
            .expect("JSON")
    );
    let input = format!("{bad}---\n{list}\n");
    let (yaml, refused) = imported(&input, &Options::default());
    assert_eq!(
        refused,
        [
            "EgressIP \"foo\": spec.nodeSelector: not translated: import-egressip knows \
             egressIPs, namespaceSelector and podSelector only; move this object by hand",
            "EgressIP \"foo\": spec.egressIPs[1]: \"x\" is not an IP address",
            "EgressIP \"foo\": spec.egressIPs[2]: 192.0.2.30 is listed twice",
            "EgressIP \"foo\": spec.egressIPs[3]: 7 is not an IP address",
            "EgressIP \"foo\": spec.namespaceSelector: missing (OVN-Kubernetes requires it; a \
             policy without one would select the pods of every namespace)",
            "EgressIP \"foo\": spec.podSelector.matchLabels.app: not a label selector: invalid \
             type: sequence, expected a string",
            "EgressIP \"empty\": spec.egressIPs: missing or empty: an EgressIP without \
             addresses has nothing to translate",
            "EgressIP \"cm\": kind: v1/ConfigMap is not an OVN-Kubernetes EgressIP \
             (k8s.ovn.org/v1/EgressIP)",
            "in.yaml, document 4: metadata.name: missing",
        ]
    );
    let names: Vec<&str> = yaml
        .lines()
        .filter_map(|l| l.strip_prefix("  name: "))
        .collect();
    assert_eq!(names, ["shop"], "{yaml}");
    assert!(
        yaml.contains("# From OVN-Kubernetes EgressIP \"shop\"."),
        "{yaml}"
    );

    let (_, refused) = imported("a: [b\n", &Options::default());
    assert_eq!(refused.len(), 1);
    assert!(
        refused[0].starts_with("in.yaml, document 1: (document): not YAML"),
        "{refused:?}"
    );
}

/// The API's objects: all of them, or those `--name` picks (each once, in the list's
/// order); a name the list lacks is a refusal. Either way they take the translation a
/// file's objects take.
#[test]
fn names_pick_listed_objects_and_a_missing_name_is_refused() {
    let shop: Value = serde_yaml_ng::from_str(SHOP).expect("YAML");
    let payments: Value = serde_yaml_ng::from_str(PAYMENTS).expect("YAML");
    let listed = vec![payments.clone(), shop.clone()];
    let origins =
        |docs: &[Document]| -> Vec<String> { docs.iter().map(|d| d.origin.clone()).collect() };

    let (docs, refused) = cluster::picked(listed.clone(), &[]);
    assert_eq!(refused, []);
    assert_eq!(
        origins(&docs),
        [
            "egressips.k8s.ovn.org (the API), items[0]",
            "egressips.k8s.ovn.org (the API), items[1]"
        ]
    );
    let (yaml, refused) = import(&docs, &Options::default());
    assert_eq!(refused, []);
    assert_eq!(
        yaml,
        imported(&format!("{PAYMENTS}---\n{SHOP}"), &Options::default()).0
    );

    let names = ["shop", "gone", "shop"].map(str::to_owned);
    let (docs, refused) = cluster::picked(listed, &names);
    assert_eq!(docs.iter().map(|d| &d.value).collect::<Vec<_>>(), [&shop]);
    assert_eq!(
        origins(&docs),
        ["egressips.k8s.ovn.org (the API), items[1]"]
    );
    assert_eq!(
        refused.iter().map(ToString::to_string).collect::<Vec<_>>(),
        [
            "EgressIP \"gone\": --name: the cluster has no EgressIP of that name \
          (egressips.k8s.ovn.org)"
        ]
    );
}

/// An egress-assignable gateway at `underlay` with an up interface holding `addresses`.
fn gateway(name: &str, underlay: &str, addresses: &[&str]) -> String {
    format!(
        "apiVersion: v1\nkind: Node\n\
         metadata: {{name: {name}, labels: {{{EGRESS_ASSIGNABLE}: \"\"}}}}\n\
         status:\n  addresses: [{{type: InternalIP, address: {underlay}}}]\n  \
         conditions: [{{type: Ready, status: \"True\"}}]\n\
         ---\napiVersion: egress.dev/v1alpha1\nkind: EgressNode\nmetadata: {{name: {name}}}\n\
         status:\n  interfaces: [{{name: ens224, up: true, addresses: {addresses:?}}}]\n---\n"
    )
}

/// A cluster where the imported policies can be served: two egress-assignable gateways
/// with an interface in 192.0.2.0/24 and 2001:db8::/64, and a pod of each namespace.
fn cluster() -> String {
    let workloads = r#"
apiVersion: v1
kind: Namespace
metadata: {name: shop, labels: {team: shop}}
---
apiVersion: v1
kind: Namespace
metadata: {name: payments, labels: {team: payments}}
---
apiVersion: v1
kind: Pod
metadata: {name: web, namespace: shop}
spec: {nodeName: gw-1}
status: {phase: Running, podIPs: [{ip: 10.128.0.5}]}
---
apiVersion: v1
kind: Pod
metadata: {name: api, namespace: payments, labels: {app: api}}
spec: {nodeName: gw-1}
status: {phase: Running, podIPs: [{ip: 10.128.0.6}]}
"#;
    gateway("gw-1", "10.0.0.11", &["192.0.2.2/24", "2001:db8::2/64"])
        + &gateway("gw-2", "10.0.0.12", &["192.0.2.3/24", "2001:db8::3/64"])
        + workloads
}

/// What the importer prints is what the agents accept: `check` (the compiler over a state
/// directory) finds no problem in it but the note that 0.0.0.0/0 covers the cluster's own
/// addresses (its networks and the nodes'), which the agents carve out, as EgressIP
/// leaves traffic inside the cluster alone.
#[test]
fn the_imported_policies_compile_without_problems() {
    let (yaml, refused) = imported(&format!("{SHOP}---\n{PAYMENTS}"), &Options::default());
    assert_eq!(refused, Vec::<String>::new());
    let dir = tempfile::tempdir().expect("a temporary directory");
    let write = |name: &str, text: &str| {
        std::fs::write(dir.path().join(name), text).expect("write");
    };
    write("cluster.yaml", &cluster());
    write("policies.yaml", &yaml);
    let problems: Vec<String> = check_dir(
        dir.path(),
        &[
            "10.128.0.0/14".parse().expect("CIDR"),
            "172.30.0.0/16".parse().expect("CIDR"),
        ],
    )
    .iter()
    .map(ToString::to_string)
    .filter(|p| !p.contains(": 0.0.0.0/0 covers the cluster's own addresses ("))
    .collect();
    assert_eq!(problems, Vec::<String>::new());
    // And a policy the compiler refuses would show here: the check can fail.
    write(
        "policies.yaml",
        &yaml.replace("192.0.2.10", "198.51.100.10"),
    );
    assert!(!check_dir(dir.path(), &[]).is_empty());
}
