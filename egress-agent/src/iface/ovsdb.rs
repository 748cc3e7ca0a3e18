//! What Open vSwitch's database says, read-only: which port is which pod (the `Interface`
//! table's `external_ids:iface-id`, which OVN-Kubernetes sets to `<namespace>_<pod>` on
//! the host side of each pod's veth on `br-int`), and whether it offloads flows to the
//! NIC (`other_config:hw-offload` of the `Open_vSwitch` table, for `doctor`). One
//! `select` over OVSDB's JSON-RPC (RFC 7047) on its unix socket each; no `ovs-vsctl` in
//! the image.

use std::{path::Path, time::Duration};

use serde_json::{Value, json};
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};

/// The socket `ovsdb-server` listens on, as Open vSwitch's packages and OVN-Kubernetes
/// (OpenShift) start it.
pub const DEFAULT_SOCKET: &str = "/var/run/openvswitch/db.sock";

/// How long one query may take.
const TIMEOUT: Duration = Duration::from_secs(3);

/// An OVSDB reply is refused beyond this size.
const MAX_REPLY: usize = 64 << 20;

/// One row of the `Interface` table that names a pod.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PodPort {
    /// The interface's name (the host side of the pod's veth).
    pub name: String,
    /// `external_ids:iface-id`: `<namespace>_<pod>` under OVN-Kubernetes.
    pub iface_id: String,
}

/// The interfaces of the OVSDB at `socket` that carry an `iface-id`. The error names
/// the socket and what failed.
pub async fn pod_ports(socket: &Path) -> Result<Vec<PodPort>, String> {
    let rows = select(socket, "Interface", &["name", "external_ids"]).await?;
    Ok(pod_ports_of(&rows))
}

/// `other_config:hw-offload` of the `Open_vSwitch` table's row (`ovs-vsctl get
/// Open_vSwitch . other_config:hw-offload`); `None` when it is not set, which is off.
pub async fn hw_offload(socket: &Path) -> Result<Option<String>, String> {
    let rows = select(socket, "Open_vSwitch", &["other_config"]).await?;
    Ok(hw_offload_of(&rows))
}

/// The rows of `table` (only `columns`), or an error naming the socket and what failed.
async fn select(socket: &Path, table: &str, columns: &[&str]) -> Result<Vec<Value>, String> {
    let what = || format!("OVSDB at {} (--ovsdb)", socket.display());
    tokio::time::timeout(TIMEOUT, query(socket, table, columns))
        .await
        .map_err(|_| format!("{}: no answer within {TIMEOUT:?}", what()))?
        .map_err(|e| format!("{}: {e}", what()))
}

async fn query(socket: &Path, table: &str, columns: &[&str]) -> Result<Vec<Value>, String> {
    let mut stream = tokio::net::UnixStream::connect(socket)
        .await
        .map_err(|e| format!("failed to connect: {e}"))?;
    let request = json!({
        "id": 1,
        "method": "transact",
        "params": ["Open_vSwitch", {
            "op": "select",
            "table": table,
            "where": [],
            "columns": columns,
        }],
    });
    stream
        .write_all(request.to_string().as_bytes())
        .await
        .map_err(|e| format!("failed to send the query: {e}"))?;
    let mut buf = Vec::new();
    let mut chunk = [0u8; 16384];
    loop {
        let n = stream
            .read(&mut chunk)
            .await
            .map_err(|e| format!("failed to read the reply: {e}"))?;
        if n == 0 {
            return Err("the server closed the connection before replying".into());
        }
        buf.extend_from_slice(&chunk[..n]);
        if buf.len() > MAX_REPLY {
            return Err(format!("the reply is over {MAX_REPLY} bytes"));
        }
        let mut values = serde_json::Deserializer::from_slice(&buf).into_iter::<Value>();
        match values.next() {
            Some(Ok(reply)) => return parse_reply(&reply),
            Some(Err(e)) if e.is_eof() => continue,
            Some(Err(e)) => return Err(format!("the reply is not JSON: {e}")),
            None => continue,
        }
    }
}

/// The rows of a `transact` reply to one `select`.
fn parse_reply(reply: &Value) -> Result<Vec<Value>, String> {
    if let Some(e) = reply.get("error").filter(|e| !e.is_null()) {
        return Err(format!("the server refused the query: {e}"));
    }
    let result = &reply["result"][0];
    if let Some(e) = result.get("error") {
        return Err(format!("the select failed: {e}"));
    }
    result["rows"]
        .as_array()
        .cloned()
        .ok_or_else(|| format!("the reply has no rows: {reply}"))
}

/// The pod ports among rows of the `Interface` table.
fn pod_ports_of(rows: &[Value]) -> Vec<PodPort> {
    rows.iter()
        .filter_map(|row| {
            let name = row["name"].as_str()?.to_owned();
            let iface_id = map_value(&row["external_ids"], "iface-id")?;
            Some(PodPort { name, iface_id })
        })
        .collect()
}

/// `other_config:hw-offload` of the `Open_vSwitch` table's rows (there is one).
fn hw_offload_of(rows: &[Value]) -> Option<String> {
    rows.iter()
        .find_map(|row| map_value(&row["other_config"], "hw-offload"))
}

/// `key` of an OVSDB map, `["map", [[k, v], ...]]`.
fn map_value(map: &Value, key: &str) -> Option<String> {
    let pairs = map
        .as_array()
        .filter(|m| m.first().is_some_and(|t| t == "map"))?
        .get(1)?;
    pairs.as_array()?.iter().find_map(|pair| {
        let pair = pair.as_array()?;
        (pair.first()?.as_str()? == key).then(|| pair.get(1)?.as_str().map(str::to_owned))?
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pod_ports_are_the_interfaces_with_an_iface_id() {
        let reply = json!({"id": 1, "error": null, "result": [{"rows": [
            {"name": "br-int", "external_ids": ["map", []]},
            {"name": "a1b2c3d4e5f6a7b", "external_ids": ["map", [
                ["attached_mac", "0a:58:0a:80:02:05"],
                ["iface-id", "shop_web-7d9f"],
                ["ip_addresses", "10.128.2.5/23"],
            ]]},
            {"name": "ovn-k8s-mp0", "external_ids": ["map", [["iface-id", "k8s-node-a"]]]},
        ]}]});
        assert_eq!(
            pod_ports_of(&parse_reply(&reply).unwrap()),
            [
                PodPort {
                    name: "a1b2c3d4e5f6a7b".into(),
                    iface_id: "shop_web-7d9f".into()
                },
                PodPort {
                    name: "ovn-k8s-mp0".into(),
                    iface_id: "k8s-node-a".into()
                },
            ]
        );
    }

    #[test]
    fn hw_offload_is_the_open_vswitch_rows_other_config() {
        let rows = |pairs: Value| vec![json!({"other_config": ["map", pairs]})];
        let on = rows(json!([["hw-offload", "true"], ["max-idle", "10000"]]));
        assert_eq!(hw_offload_of(&on).as_deref(), Some("true"));
        assert_eq!(hw_offload_of(&rows(json!([["max-idle", "10000"]]))), None);
        assert_eq!(hw_offload_of(&[]), None);
    }

    /// The query as Open vSwitch answers it, over a unix socket: a fake server reads the
    /// request (a select of `Open_vSwitch`'s `other_config`) and sends a reply in two
    /// pieces.
    #[tokio::test]
    async fn hw_offload_asks_ovsdb_over_its_socket() {
        let dir = tempfile::tempdir().expect("a temporary directory");
        let socket = dir.path().join("db.sock");
        let listener = tokio::net::UnixListener::bind(&socket).expect("bind");
        let server = tokio::spawn(async move {
            let (mut conn, _) = listener.accept().await.expect("accept");
            let mut buf = vec![0u8; 4096];
            let n = conn.read(&mut buf).await.expect("read");
            let request: Value = serde_json::from_slice(&buf[..n]).expect("JSON");
            let reply = json!({"id": 1, "error": null, "result": [{"rows": [
                {"other_config": ["map", [["hw-offload", "true"]]]},
            ]}]})
            .to_string();
            let (a, b) = reply.split_at(reply.len() / 2);
            conn.write_all(a.as_bytes()).await.expect("write");
            conn.flush().await.expect("flush");
            conn.write_all(b.as_bytes()).await.expect("write");
            request
        });
        assert_eq!(hw_offload(&socket).await, Ok(Some("true".to_owned())));
        let request = server.await.expect("the server");
        assert_eq!(request["params"][1]["table"], "Open_vSwitch");
        assert_eq!(request["params"][1]["columns"], json!(["other_config"]));
        let e = hw_offload(&dir.path().join("none.sock")).await.unwrap_err();
        assert!(e.contains("none.sock (--ovsdb): failed to connect"), "{e}");
    }

    #[test]
    fn a_refused_query_says_why() {
        let reply = json!({"id": 1, "result": [{"error": "unknown table", "details": "x"}]});
        assert!(parse_reply(&reply).unwrap_err().contains("unknown table"));
        let reply = json!({"id": 1, "error": "unknown database", "result": null});
        assert!(
            parse_reply(&reply)
                .unwrap_err()
                .contains("unknown database")
        );
    }
}
