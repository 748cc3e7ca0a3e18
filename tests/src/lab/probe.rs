//! Probes through the lab: `egress-echo` queries and what they saw.

use super::*;

/// Find `egress-echo` when nobody says where it is: `$EGRESS_ECHO_BIN`, else next to the
/// running executable or one directory up (a test binary lives in `target/<profile>/deps`).
pub fn locate_echo_bin() -> Result<PathBuf> {
    if let Some(p) = std::env::var_os("EGRESS_ECHO_BIN") {
        return Ok(PathBuf::from(p));
    }
    let exe = std::env::current_exe().context("failed to find the current executable")?;
    let mut dir = exe.parent();
    for _ in 0..2 {
        let Some(d) = dir else { break };
        let candidate = d.join("egress-echo");
        if candidate.is_file() {
            return Ok(candidate);
        }
        dir = d.parent();
    }
    bail!(
        "failed to find egress-echo next to {}: build it (cargo build -p egress-tests --bins) \
         or set EGRESS_ECHO_BIN",
        exe.display()
    )
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Proto {
    Tcp,
    Udp,
}

impl fmt::Display for Proto {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Proto::Tcp => "tcp",
            Proto::Udp => "udp",
        })
    }
}

/// What a host reported: the source address and port it saw.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Seen {
    pub ip: IpAddr,
    pub port: u16,
}

impl fmt::Display for Seen {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}:{}", self.ip, self.port)
    }
}

impl FromStr for Seen {
    type Err = anyhow::Error;

    /// Parses `seen 10.244.11.11:40000` (or without `seen `).
    fn from_str(s: &str) -> Result<Self> {
        let s = s.trim();
        let s = s.strip_prefix("seen ").unwrap_or(s);
        let sa: std::net::SocketAddr = s
            .parse()
            .with_context(|| format!("failed to parse seen line {s:?}"))?;
        Ok(Self {
            ip: sa.ip(),
            port: sa.port(),
        })
    }
}

/// One `egress-echo query` with all its knobs.
#[derive(Clone, Debug)]
pub struct Query {
    pub proto: Proto,
    pub host: IpAddr,
    pub port: u16,
    /// Payload bytes each way.
    pub size: usize,
    pub timeout: Duration,
    pub sport: Option<u16>,
    /// UDP only: send up to this many times within `timeout`.
    pub attempts: u32,
}

impl Query {
    pub fn new(proto: Proto, host: impl Into<IpAddr>, port: u16) -> Self {
        Self {
            proto,
            host: host.into(),
            port,
            size: 0,
            timeout: Duration::from_millis(2000),
            sport: None,
            attempts: 1,
        }
    }

    pub fn size(mut self, size: usize) -> Self {
        self.size = size;
        self
    }

    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    pub fn sport(mut self, sport: u16) -> Self {
        self.sport = Some(sport);
        self
    }

    pub fn attempts(mut self, attempts: u32) -> Self {
        self.attempts = attempts;
        self
    }

    fn args(&self) -> Vec<String> {
        let mut args = vec![
            "query".to_owned(),
            self.proto.to_string(),
            std::net::SocketAddr::new(self.host, self.port).to_string(),
            "--size".to_owned(),
            self.size.to_string(),
            "--timeout-ms".to_owned(),
            self.timeout.as_millis().to_string(),
            "--attempts".to_owned(),
            self.attempts.to_string(),
        ];
        if let Some(p) = self.sport {
            args.extend(["--sport".to_owned(), p.to_string()]);
        }
        args
    }
}

impl Lab {
    /// `egress-echo query` from a member's namespace (usually a pod) to `host:port`, with
    /// `size` payload bytes each way and a 2 s timeout.
    pub fn query(
        &self,
        from: &str,
        proto: Proto,
        host: impl Into<IpAddr>,
        port: u16,
        size: usize,
    ) -> Result<Seen> {
        self.query_with(from, &Query::new(proto, host, port).size(size))
    }

    pub fn query_with(&self, from: &str, q: &Query) -> Result<Seen> {
        let out = self
            .ns(from)?
            .exec_unchecked(&self.spec.echo_bin.to_string_lossy(), &q.args())?;
        let stdout = String::from_utf8_lossy(&out.stdout);
        if !out.status.success() {
            bail!(
                "query {} {}:{} from {from} failed: {}",
                q.proto,
                q.host,
                q.port,
                String::from_utf8_lossy(&out.stderr).trim()
            );
        }
        let line = stdout
            .lines()
            .find(|l| l.starts_with("seen "))
            .with_context(|| format!("query from {from}: no seen line in {stdout:?}"))?;
        line.parse()
    }

    /// Run a command in a member's namespace, checked.
    pub fn exec(&self, member: &str, program: &str, args: &[&str]) -> Result<Output> {
        self.ns(member)?.exec(program, args)
    }
}
