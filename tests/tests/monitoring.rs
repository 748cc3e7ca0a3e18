//! `deploy/monitoring/`: the PrometheusRule's rules pass `promtool check rules` and the unit
//! tests of `rules.test.yaml` (`promtool test rules`: each alert fires on the series that
//! should fire it, with its labels and annotations, and not on the others); the
//! ServiceMonitor scrapes the base's metrics Service by its labels and port name; the
//! dashboard's every panel queries at least one of the agent's metrics. That every metric
//! named there is one the agent serves is egress-agent's test
//! (`every_metric_named_in_the_docs_and_deploy_is_served`). Needs `promtool` (Debian's
//! `prometheus` package) and `kubectl`, which `cargo xtask bootstrap` installs.

use std::{path::Path, process::Command};

use serde_json::Value;

fn workspace() -> &'static Path {
    Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/.."))
}

fn monitoring(file: &str) -> String {
    let p = workspace().join("deploy/monitoring").join(file);
    std::fs::read_to_string(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()))
}

fn yaml(text: &str) -> Value {
    serde_yaml_ng::from_str(text).unwrap()
}

/// `kubectl kustomize <dir>` (relative to the workspace): the objects.
fn kustomize(dir: &str) -> Vec<Value> {
    let out = Command::new("kubectl")
        .arg("kustomize")
        .arg(workspace().join(dir))
        .output()
        .expect("failed to run kubectl (cargo xtask bootstrap installs it)");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8(out.stdout).unwrap();
    serde_yaml_ng::Deserializer::from_str(&text)
        .map(|d| serde::Deserialize::deserialize(d).unwrap())
        .collect()
}

/// `promtool <args>` in `dir`: its output, asserted successful.
fn promtool(dir: &Path, args: &[&str]) -> String {
    let out = Command::new("promtool")
        .args(args)
        .current_dir(dir)
        .output()
        .expect("failed to run promtool (cargo xtask bootstrap installs Debian's prometheus)");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "promtool {args:?}:\n{text}");
    text
}

/// The PrometheusRule's spec as a rules file, beside the unit tests, in a fresh directory.
fn rules_dir() -> tempfile::TempDir {
    let rule = yaml(&monitoring("prometheusrule.yaml"));
    assert_eq!(rule["kind"], "PrometheusRule");
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(
        dir.path().join("rules.yaml"),
        serde_yaml_ng::to_string(&rule["spec"]).unwrap(),
    )
    .unwrap();
    std::fs::write(
        dir.path().join("rules.test.yaml"),
        monitoring("rules.test.yaml"),
    )
    .unwrap();
    dir
}

#[test]
fn alert_rules_pass_promtool_check_and_their_unit_tests() {
    let dir = rules_dir();
    let checked = promtool(dir.path(), &["check", "rules", "rules.yaml"]);
    assert!(checked.contains("SUCCESS"), "{checked}");
    let tested = promtool(dir.path(), &["test", "rules", "rules.test.yaml"]);
    assert!(tested.contains("SUCCESS"), "{tested}");
}

/// Every alert of the rules has a unit test that expects it to fire.
#[test]
fn every_alert_is_unit_tested_firing() {
    let rule = yaml(&monitoring("prometheusrule.yaml"));
    let tests = yaml(&monitoring("rules.test.yaml"));
    let alerts: Vec<&str> = rule["spec"]["groups"]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|g| g["rules"].as_array().unwrap())
        .filter_map(|r| r["alert"].as_str())
        .collect();
    assert!(alerts.len() >= 6, "{alerts:?}");
    let fired: Vec<&str> = tests["tests"]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|t| t["alert_rule_test"].as_array().unwrap())
        .filter(|a| a["exp_alerts"].as_array().is_some_and(|e| !e.is_empty()))
        .filter_map(|a| a["alertname"].as_str())
        .collect();
    let untested: Vec<&&str> = alerts.iter().filter(|a| !fired.contains(a)).collect();
    assert!(
        untested.is_empty(),
        "alerts never tested firing: {untested:?}"
    );
}

/// Each alert of a cluster-wide fact is tested firing once among 100 observers: a group of
/// `rules.test.yaml` whose series come from at least 100 instances expects exactly one
/// alert of it (one dead gateway, one unheld egress IP, one outage), not one per node.
#[test]
fn cluster_wide_alerts_fire_once_among_100_observers() {
    let tests = yaml(&monitoring("rules.test.yaml"));
    let once_at_scale: Vec<&str> = tests["tests"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|t| {
            let instances: std::collections::BTreeSet<&str> = t["input_series"]
                .as_array()
                .unwrap()
                .iter()
                .filter_map(|s| s["series"].as_str())
                .filter_map(|s| s.split("instance=\"").nth(1)?.split('"').next())
                .collect();
            instances.len() >= 100
        })
        .flat_map(|t| t["alert_rule_test"].as_array().unwrap())
        .filter(|a| a["exp_alerts"].as_array().is_some_and(|e| e.len() == 1))
        .filter_map(|a| a["alertname"].as_str())
        .collect();
    for alert in [
        "EgressIPUnheld",
        "EgressPeerUnreachable",
        "EgressPeerPartlyUnreachable",
        "EgressNodesCutOff",
        "EgressReconcileErrorsWidespread",
        "EgressDatapathDrops",
    ] {
        assert!(
            once_at_scale.contains(&alert),
            "{alert}: no test of it firing once among 100 observers ({once_at_scale:?})"
        );
    }
}

/// Every alert says what to do: a `runbook` annotation of a few steps besides its summary
/// and description.
#[test]
fn every_alert_has_a_runbook() {
    let rule = yaml(&monitoring("prometheusrule.yaml"));
    for r in rule["spec"]["groups"]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|g| g["rules"].as_array().unwrap())
        .filter(|r| r["alert"].is_string())
    {
        let alert = r["alert"].as_str().unwrap();
        for key in ["summary", "description", "runbook"] {
            let text = r["annotations"][key].as_str().unwrap_or_default();
            assert!(
                text.len() > 20,
                "alert {alert}: annotations.{key} is missing or empty"
            );
        }
    }
}

/// A broken rule fails the check: the test above can fail.
#[test]
fn promtool_refuses_a_broken_rule() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(
        dir.path().join("rules.yaml"),
        "groups:\n- name: x\n  rules:\n  - alert: Broken\n    expr: max by (ip (egress_ip_unheld)\n",
    )
    .unwrap();
    let out = Command::new("promtool")
        .args(["check", "rules", "rules.yaml"])
        .current_dir(dir.path())
        .output()
        .expect("failed to run promtool");
    assert!(!out.status.success());
}

/// The ServiceMonitor finds the base's metrics Service by its labels and port name.
#[test]
fn the_service_monitor_selects_the_metrics_service() {
    let monitor = yaml(&monitoring("servicemonitor.yaml"));
    let service = yaml(
        &std::fs::read_to_string(workspace().join("deploy/base/metrics-service.yaml")).unwrap(),
    );
    let want = monitor["spec"]["selector"]["matchLabels"]
        .as_object()
        .unwrap();
    for (k, v) in want {
        assert_eq!(&service["metadata"]["labels"][k], v, "label {k:?}");
    }
    let port = monitor["spec"]["endpoints"][0]["port"].as_str().unwrap();
    assert!(
        service["spec"]["ports"]
            .as_array()
            .unwrap()
            .iter()
            .any(|p| p["name"] == port),
        "no port {port} on the Service"
    );
    assert_eq!(
        monitor["spec"]["namespaceSelector"]["matchNames"][0],
        service["metadata"]["namespace"]
    );
}

/// Each panel of the dashboard has queries, each naming one of the agent's metrics, on
/// the dashboard's data source variable; kustomize packs it in a labelled ConfigMap.
#[test]
fn every_dashboard_panel_queries_the_agents_metrics() {
    let dash: Value = serde_json::from_str(&monitoring("dashboards/egress-gateway.json")).unwrap();
    let panels = dash["panels"].as_array().unwrap();
    assert!(panels.len() >= 10);
    for p in panels {
        let title = p["title"].as_str().unwrap();
        let targets = p["targets"].as_array().unwrap();
        assert!(!targets.is_empty(), "{title}: no query");
        for t in targets {
            let expr = t["expr"].as_str().unwrap();
            assert!(expr.contains("egress_"), "{title}: {expr}");
            assert_eq!(t["datasource"]["uid"], "${datasource}", "{title}");
        }
    }
    let objects = kustomize("deploy/monitoring");
    let kinds: Vec<&str> = objects.iter().filter_map(|o| o["kind"].as_str()).collect();
    assert_eq!(kinds.len(), 3, "{kinds:?}");
    let cm = objects.iter().find(|o| o["kind"] == "ConfigMap").unwrap();
    assert_eq!(cm["metadata"]["labels"]["grafana_dashboard"], "1");
    assert_eq!(cm["metadata"]["namespace"], "egress-system");
    let packed: Value =
        serde_json::from_str(cm["data"]["egress-gateway.json"].as_str().unwrap()).unwrap();
    assert_eq!(packed, dash);
}

/// `deploy/openshift/monitoring`: the same alerts and dashboard, scraped over HTTPS with
/// the service CA's certificate verified for the metrics Service's name.
#[test]
fn openshift_scrapes_over_https_verifying_the_service_ca() {
    let objects = kustomize("deploy/openshift/monitoring");
    let mut kinds: Vec<&str> = objects.iter().filter_map(|o| o["kind"].as_str()).collect();
    kinds.sort_unstable();
    assert_eq!(
        kinds,
        ["ConfigMap", "ConfigMap", "PrometheusRule", "ServiceMonitor"]
    );
    let monitor = objects
        .iter()
        .find(|o| o["kind"] == "ServiceMonitor")
        .unwrap();
    let endpoint = &monitor["spec"]["endpoints"][0];
    assert_eq!(endpoint["scheme"], "https");
    assert_eq!(endpoint["port"], "metrics");
    assert_eq!(
        endpoint["tlsConfig"]["serverName"],
        "egress-agent-metrics.egress-system.svc"
    );
    assert_eq!(
        endpoint["tlsConfig"]["ca"]["configMap"]["name"],
        "openshift-service-ca.crt"
    );
}

/// Panel types the OpenShift console's dashboards draw (openshift/monitoring-plugin,
/// `legacy-dashboard.tsx`; rows are expanded): any other type is left out without a word.
const CONSOLE_PANEL_TYPES: &[&str] = &[
    "gauge",
    "grafana-piechart-panel",
    "graph",
    "singlestat",
    "table",
];

/// Units the console's graphs know (`GraphUnits`).
const CONSOLE_UNITS: &[&str] = &[
    "Bytes",
    "bytes",
    "bps",
    "Bps",
    "pps",
    "ms",
    "s",
    "percentunit",
    "short",
];

/// `deploy/openshift/monitoring`: the dashboard as the OpenShift console reads it, a
/// ConfigMap labelled `console.openshift.io/dashboard` in `openshift-config-managed`
/// holding one Grafana-format dashboard, with only panel types the console draws (tables
/// with the column styles it needs, graphs in units it knows, widths in its 12 columns),
/// and the Grafana dashboard's panels and queries, in its order: what one shows, the
/// other does. Every metric it names is served (egress-agent's
/// `every_metric_named_in_the_docs_and_deploy_is_served` reads deploy/).
#[test]
fn the_console_dashboard_shows_the_grafana_dashboards_queries() {
    let objects = kustomize("deploy/openshift/monitoring");
    let console: Vec<&Value> = objects
        .iter()
        .filter(|o| o["metadata"]["labels"]["console.openshift.io/dashboard"] == "true")
        .collect();
    assert_eq!(console.len(), 1, "one console dashboard");
    let cm = console[0];
    assert_eq!(cm["kind"], "ConfigMap");
    assert_eq!(cm["metadata"]["namespace"], "openshift-config-managed");
    let data = cm["data"].as_object().unwrap();
    assert_eq!(data.len(), 1, "the console reads the first entry only");
    let (file, text) = data.iter().next().unwrap();
    let dash: Value = serde_json::from_str(text.as_str().unwrap()).unwrap();
    let on_disk: Value = serde_json::from_str(
        &std::fs::read_to_string(
            workspace()
                .join("deploy/openshift/monitoring/dashboards")
                .join(file),
        )
        .unwrap(),
    )
    .unwrap();
    assert_eq!(dash, on_disk, "{file}");
    assert!(dash["title"].as_str().is_some_and(|t| !t.is_empty()));

    let mut shown = Vec::new();
    for p in dash["panels"].as_array().unwrap() {
        let title = p["title"].as_str().unwrap();
        let kind = p["type"].as_str().unwrap();
        if kind == "row" {
            assert_eq!(p["showTitle"], true, "row {title}: its title shows");
            continue;
        }
        assert!(
            CONSOLE_PANEL_TYPES.contains(&kind),
            "{title}: the console does not draw {kind:?} panels"
        );
        let span = p["span"].as_u64().unwrap_or(12);
        assert!((1..=12).contains(&span), "{title}: span {span}");
        match kind {
            "table" => {
                let styles = p["styles"].as_array().expect("a table's column styles");
                assert!(
                    styles.iter().any(|s| s["alias"].is_string()),
                    "{title}: no column shows"
                );
            }
            "graph" => {
                let unit = p["yaxes"][0]["format"].as_str().unwrap_or("short");
                assert!(CONSOLE_UNITS.contains(&unit), "{title}: unit {unit}");
            }
            _ => {}
        }
        shown.push(queries(p));
    }
    let grafana: Value =
        serde_json::from_str(&monitoring("dashboards/egress-gateway.json")).unwrap();
    let wanted: Vec<_> = grafana["panels"]
        .as_array()
        .unwrap()
        .iter()
        .map(queries)
        .collect();
    assert_eq!(
        shown, wanted,
        "the console's panels are not the Grafana dashboard's"
    );
}

/// A panel's title and its queries (expression and legend), in order.
fn queries(panel: &Value) -> (String, Vec<(String, String)>) {
    let title = panel["title"].as_str().unwrap().to_owned();
    let targets = panel["targets"].as_array().unwrap();
    assert!(!targets.is_empty(), "{title}: no query");
    let q = targets
        .iter()
        .map(|t| {
            let expr = t["expr"].as_str().unwrap();
            assert!(expr.contains("egress_"), "{title}: {expr}");
            (
                expr.to_owned(),
                t["legendFormat"].as_str().unwrap_or_default().to_owned(),
            )
        })
        .collect();
    (title, q)
}
