//! Logs on stderr: text (coloured on a terminal) or JSON lines (`--log-format json`), which
//! ones by `RUST_LOG` (default `info`; e.g. `egress_agent=debug,kube=warn`).

use std::io::Write;

use tracing_subscriber::{EnvFilter, fmt::MakeWriter};

/// `--log-format`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum LogFormat {
    /// `<time> <LEVEL> <target>: <message> <field>=<value> ...`.
    #[default]
    Text,
    /// One JSON object per line: `timestamp`, `level`, `target`, `message` and each field
    /// at the top level.
    Json,
}

/// The filter of `RUST_LOG`, or `info`.
fn filter() -> EnvFilter {
    EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into())
}

/// A subscriber writing `format` to `writer`, filtered by `filter` (`ansi`: colours, text
/// only).
fn subscriber<W>(
    format: LogFormat,
    filter: EnvFilter,
    writer: W,
    ansi: bool,
) -> Box<dyn tracing::Subscriber + Send + Sync>
where
    W: for<'w> MakeWriter<'w> + Send + Sync + 'static,
{
    let logs = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(writer);
    match format {
        LogFormat::Text => Box::new(logs.with_ansi(ansi).finish()),
        LogFormat::Json => Box::new(logs.json().flatten_event(true).finish()),
    }
}

/// Log to stderr in `format` for the rest of the process.
pub fn init(format: LogFormat) {
    let ansi = std::io::IsTerminal::is_terminal(&std::io::stderr());
    let s = subscriber(format, filter(), std::io::stderr, ansi);
    if tracing::subscriber::set_global_default(s).is_err() {
        let _ = writeln!(std::io::stderr(), "egress-agent: logs were set up already");
    }
}

#[cfg(test)]
mod tests {
    use std::sync::{Arc, Mutex};

    use super::*;

    /// A writer into a shared buffer.
    #[derive(Clone, Default)]
    struct Buffer(Arc<Mutex<Vec<u8>>>);

    impl Write for Buffer {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            self.0.lock().expect("buffer").extend_from_slice(buf);
            Ok(buf.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    impl<'w> MakeWriter<'w> for Buffer {
        type Writer = Buffer;
        fn make_writer(&'w self) -> Self::Writer {
            self.clone()
        }
    }

    fn logged(format: LogFormat) -> String {
        let buf = Buffer::default();
        let s = subscriber(format, EnvFilter::new("info"), buf.clone(), false);
        tracing::subscriber::with_default(s, || {
            tracing::info!(
                ip = "192.168.101.50",
                interface = "sec-a",
                "holding egress IP"
            );
            tracing::debug!("not at info");
        });
        let bytes = buf.0.lock().expect("buffer").clone();
        String::from_utf8(bytes).expect("utf-8")
    }

    #[test]
    fn json_lines_carry_level_target_message_and_fields_at_the_top() {
        let text = logged(LogFormat::Json);
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines.len(), 1, "{text}");
        let v: serde_json::Value = serde_json::from_str(lines[0]).expect("one JSON object");
        assert_eq!(v["level"], "INFO");
        assert_eq!(v["message"], "holding egress IP");
        assert_eq!(v["ip"], "192.168.101.50");
        assert_eq!(v["interface"], "sec-a");
        assert_eq!(v["target"], "egress_agent::logs::tests");
        assert!(v["timestamp"].is_string(), "{v}");
    }

    #[test]
    fn text_lines_read_as_before() {
        let text = logged(LogFormat::Text);
        assert!(
            text.contains(
                "INFO egress_agent::logs::tests: holding egress IP ip=\"192.168.101.50\""
            ),
            "{text}"
        );
    }
}
