//! Flags every server binary shares (each with its env var).

use std::net::SocketAddr;
use std::path::PathBuf;

use kt_types::env;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

use crate::Token;
use crate::auth::{AuthFileError, TokenError};
use crate::tls::TlsError;

/// The flags every server shares, in pieces ([`TokenArgs`], [`AuthArgs`],
/// [`TlsArgs`], [`LimitArgs`], [`LogArgs`]): each flag, its environment
/// variable and its help are written once, here, and every server
/// flattens this.
#[derive(Debug, Clone, clap::Args)]
pub struct ServerArgs {
    #[command(flatten)]
    pub token: TokenArgs,
    #[command(flatten)]
    pub auth: AuthArgs,
    #[command(flatten)]
    pub tls: TlsArgs,
    #[command(flatten)]
    pub limits: LimitArgs,
    #[command(flatten)]
    pub log: LogArgs,
}

/// The server's own credential.
#[derive(Debug, Clone, clap::Args)]
pub struct TokenArgs {
    /// Bearer token (prefer --token-file).
    #[arg(long, env = env::TOKEN, hide_env_values = true)]
    pub token: Option<String>,
    /// File holding the bearer token.
    #[arg(long, env = env::TOKEN_FILE)]
    pub token_file: Option<PathBuf>,
}

/// Who may call the server.
#[derive(Debug, Clone, clap::Args)]
pub struct AuthArgs {
    /// Tokens file (JSON) granting roles (admin, store, agent, workload):
    /// only its tokens are accepted, and the token above is this server's
    /// own credential for its calls. Without it that token is admin.
    #[arg(long, env = env::AUTH_FILE)]
    pub auth_file: Option<PathBuf>,
    /// Callers present projected ServiceAccount tokens (audience kt): the
    /// metadata server reviews them with the Kubernetes API and maps them
    /// with its access map; the store and agents ask the metadata server.
    /// The token above is then only this server's own credential, read
    /// again as the kubelet rotates it.
    #[arg(long, env = env::KUBE_AUTH, value_parser = clap::builder::BoolishValueParser::new())]
    pub kube_auth: bool,
}

/// HTTPS.
#[derive(Debug, Clone, clap::Args)]
pub struct TlsArgs {
    /// Serve HTTPS with this PEM certificate chain (with --tls-key; read
    /// again as it is renewed). Clients trust the CAs of KT_CA_FILE.
    #[arg(long, env = env::TLS_CERT)]
    pub tls_cert: Option<PathBuf>,
    /// The PEM private key of --tls-cert.
    #[arg(long, env = env::TLS_KEY)]
    pub tls_key: Option<PathBuf>,
}

/// What the server takes on at once.
#[derive(Debug, Clone, clap::Args)]
pub struct LimitArgs {
    /// Requests served at once; more wait.
    #[arg(long, env = env::MAX_CONNECTIONS, default_value_t = DEFAULT_MAX_CONNECTIONS)]
    pub max_connections: usize,
}

/// Default of `--max-connections` and of [`ServerConfig::max_in_flight`].
pub const DEFAULT_MAX_CONNECTIONS: usize = 512;

/// The metadata server a store or agent registers with (the Dataset
/// controller's flag has a default, a Service name, and is its own).
#[derive(Debug, Clone, clap::Args)]
pub struct MetadataArgs {
    /// URL of the metadata server.
    #[arg(long, env = env::METADATA_URL)]
    pub metadata_url: String,
}

/// The server's logs.
#[derive(Debug, Clone, clap::Args)]
pub struct LogArgs {
    /// Log filter (tracing EnvFilter syntax).
    #[arg(long, env = env::LOG, default_value = "info")]
    pub log: String,
    /// Log format: json, text or auto (json unless stderr is a terminal).
    #[arg(long, env = env::LOG_FORMAT, default_value = "auto")]
    pub log_format: String,
}

impl TokenArgs {
    /// `--token`, else the contents of `--token-file`.
    pub fn resolve(&self) -> Result<Token, TokenError> {
        Token::resolve(self.token.as_deref(), self.token_file.as_deref())
    }
}

impl AuthArgs {
    /// The grants of `--auth-file`; `None` without one (the token alone is
    /// then admin).
    pub fn load(&self) -> Result<Option<crate::Auth>, crate::auth::AuthFileError> {
        self.auth_file
            .as_deref()
            .map(crate::Auth::from_file)
            .transpose()
    }
}

impl TlsArgs {
    /// `--tls-cert` and `--tls-key`, loaded (both or neither).
    pub fn load(&self) -> Result<Option<crate::tls::Tls>, crate::tls::TlsError> {
        crate::tls::Tls::from_args(self.tls_cert.as_deref(), self.tls_key.as_deref())
    }
}

impl LogArgs {
    /// Starts logging.
    pub fn init(&self) {
        crate::telemetry::init_logging(Some(&self.log), Some(&self.log_format));
    }
}

/// What every server takes from [`ServerArgs`], loaded: its own
/// credential, who may call it, HTTPS, and how much it takes on at once.
/// Each server's `Config` holds one (`config.server`), built by
/// [`ServerArgs::load`]: a shared flag is added here and in its `*Args`,
/// not in each server's `Config` and `main`.
#[derive(Debug, Clone)]
pub struct ServerConfig {
    /// This server's own credential for its calls (`--token`,
    /// `--token-file`); without [`ServerConfig::auth`], its callers' too.
    pub token: Token,
    /// Who may call this server (`--auth-file`, `--kube-auth`); `None`:
    /// the token alone, as admin.
    pub auth: Option<crate::Auth>,
    /// Serve HTTPS with this certificate (`--tls-cert`, `--tls-key`).
    pub tls: Option<crate::tls::Tls>,
    /// Requests served at once; more wait (`--max-connections`).
    pub max_in_flight: usize,
}

impl ServerConfig {
    /// `token` alone: its holder is admin; plain HTTP; the default limits.
    pub fn new(token: Token) -> Self {
        ServerConfig {
            token,
            auth: None,
            tls: None,
            max_in_flight: DEFAULT_MAX_CONNECTIONS,
        }
    }

    /// Who may call: [`ServerConfig::auth`], else the token, as admin.
    pub fn callers(&self) -> crate::Auth {
        self.auth
            .clone()
            .unwrap_or_else(|| self.token.clone().into())
    }
}

impl From<Token> for ServerConfig {
    fn from(token: Token) -> Self {
        ServerConfig::new(token)
    }
}

/// Why the shared flags cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum ServerArgsError {
    #[error(transparent)]
    Token(#[from] TokenError),
    #[error(transparent)]
    Auth(#[from] AuthFileError),
    #[error(transparent)]
    Tls(#[from] TlsError),
}

impl ServerArgs {
    /// Starts logging, then loads the rest into a [`ServerConfig`]: the
    /// token, the grants of `--auth-file`, TLS, the limits. With
    /// `--kube-auth` and a `metadata_url` (the store, agents and the
    /// Dataset controller), other tokens are what the metadata server
    /// there says of them, asked with this server's token; the metadata
    /// server passes `None` and reviews them itself.
    pub fn load(&self, metadata_url: Option<&str>) -> Result<ServerConfig, ServerArgsError> {
        self.log.init();
        let token = self.token.resolve()?;
        let mut auth = self.auth.load()?;
        if let (true, Some(url)) = (self.auth.kube_auth, metadata_url) {
            let ask = crate::auth::AskMetadata::new(url, token.credential())?;
            auth = Some(crate::Auth::asking(auth, std::sync::Arc::new(ask)));
        }
        Ok(ServerConfig {
            tls: self.tls.load()?,
            max_in_flight: self.limits.max_connections,
            token,
            auth,
        })
    }
}

/// Connections the kernel queues before a server accepts them. The usual
/// 128 drops SYNs when hundreds of getters join a broadcast at once (they
/// retry only after a second).
pub const LISTEN_BACKLOG: u32 = 4096;

/// Binds `addr` (address reuse on, as servers restart on their port) with a
/// [`LISTEN_BACKLOG`]-deep queue. Needs a runtime. `0.0.0.0` listens on
/// both families (`[::]`, not IPv6-only: an IPv6 or dual-stack cluster's
/// pods reach it too), falling back to IPv4 alone where the host has no
/// IPv6.
pub fn listen(addr: SocketAddr) -> std::io::Result<TcpListener> {
    if addr.ip() == std::net::IpAddr::from([0, 0, 0, 0]) {
        match listen_dual_stack(addr.port()) {
            Ok(l) => return Ok(l),
            Err(e) => tracing::debug!(error = %e, "no IPv6 here: listening on IPv4 only"),
        }
    }
    let socket = if addr.is_ipv4() {
        tokio::net::TcpSocket::new_v4()?
    } else {
        tokio::net::TcpSocket::new_v6()?
    };
    socket.set_reuseaddr(true)?;
    socket.bind(addr)?;
    socket.listen(LISTEN_BACKLOG)
}

fn listen_dual_stack(port: u16) -> std::io::Result<TcpListener> {
    use socket2::{Domain, Protocol, Socket, Type};
    let socket = Socket::new(Domain::IPV6, Type::STREAM, Some(Protocol::TCP))?;
    socket.set_only_v6(false)?;
    socket.set_reuse_address(true)?;
    socket.set_nonblocking(true)?;
    let any = SocketAddr::from((std::net::Ipv6Addr::UNSPECIFIED, port));
    socket.bind(&any.into())?;
    socket.listen(LISTEN_BACKLOG as i32)?;
    TcpListener::from_std(socket.into())
}

/// Binds `addr` and returns the listener with a shutdown token that SIGTERM and
/// SIGINT cancel: the start of every server's `main`.
pub async fn bind_with_shutdown(
    addr: SocketAddr,
) -> std::io::Result<(TcpListener, CancellationToken)> {
    let listener =
        listen(addr).map_err(|e| std::io::Error::new(e.kind(), format!("binding {addr}: {e}")))?;
    let shutdown = CancellationToken::new();
    crate::telemetry::cancel_on_signals(shutdown.clone());
    Ok((listener, shutdown))
}

/// The real uid of this process, from `/proc` (0 where it cannot be read).
pub fn uid() -> u32 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("Uid:"))
                .and_then(|v| v.split_whitespace().next().map(str::to_owned))
        })
        .and_then(|v| v.parse().ok())
        .unwrap_or(0)
}

/// Where a node agent's control socket is by default, for the agent and for
/// `kt` alike: `$XDG_RUNTIME_DIR/kt/agent.sock`, else
/// `/tmp/kt-<uid>/agent.sock` (a private directory, 0700, checked by the
/// agent before it binds; never a bare name in the world-writable /tmp).
pub fn default_agent_socket() -> std::path::PathBuf {
    match std::env::var_os("XDG_RUNTIME_DIR").filter(|d| !d.is_empty()) {
        Some(d) => std::path::PathBuf::from(d).join("kt").join("agent.sock"),
        None => std::path::PathBuf::from(format!("/tmp/kt-{}", uid())).join("agent.sock"),
    }
}

/// The values every boolean flag's environment variable accepts (DESIGN:
/// contracts): `KT_KUBE=1` must mean what `--kube` means.
pub const BOOLISH: [&str; 8] = ["1", "0", "true", "false", "yes", "no", "on", "off"];

/// Every boolean argument of `cmd` and its subcommands that reads an
/// environment variable but refuses one of [`BOOLISH`] (clap's default
/// parser for a `bool` takes only `true`/`false`), as `command --flag
/// (ENV): refuses "1", ...`. Each binary's tests assert this is empty; the
/// fix is `value_parser = clap::builder::BoolishValueParser::new()`.
pub fn unboolish_env_flags(cmd: &clap::Command) -> Vec<String> {
    let mut found = Vec::new();
    walk_unboolish(cmd, cmd.get_name(), &mut found);
    found
}

/// Panics naming every flag [`unboolish_env_flags`] finds in `C`'s command:
/// the one-line test each binary runs on its arguments.
pub fn assert_boolish_env_flags<C: clap::CommandFactory>() {
    let found = unboolish_env_flags(&C::command());
    assert!(
        found.is_empty(),
        "boolean flags whose env var refuses 1/0/yes/no/on/off (add value_parser = clap::builder::BoolishValueParser::new()):\n{}",
        found.join("\n")
    );
}

fn walk_unboolish(cmd: &clap::Command, path: &str, found: &mut Vec<String>) {
    for arg in cmd.get_arguments() {
        let (Some(env), parser) = (arg.get_env(), arg.get_value_parser()) else {
            continue;
        };
        if parser.type_id() != clap::builder::ValueParser::bool().type_id() {
            continue;
        }
        let accepted: Vec<String> = parser
            .possible_values()
            .into_iter()
            .flatten()
            .flat_map(|v| {
                v.get_name_and_aliases()
                    .map(str::to_owned)
                    .collect::<Vec<_>>()
            })
            .collect();
        let refused: Vec<&str> = BOOLISH
            .into_iter()
            .filter(|v| !accepted.iter().any(|a| a.eq_ignore_ascii_case(v)))
            .collect();
        if !refused.is_empty() {
            found.push(format!(
                "{path} --{} ({}): refuses {refused:?}",
                arg.get_long().unwrap_or(arg.get_id().as_str()),
                env.to_string_lossy()
            ));
        }
    }
    for sub in cmd.get_subcommands() {
        walk_unboolish(sub, &format!("{path} {}", sub.get_name()), found);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, clap::Parser)]
    struct Plain {
        #[arg(long, env = "CLI_TEST_PLAIN")]
        plain: bool,
        #[arg(long, env = "CLI_TEST_BOOLISH", value_parser = clap::builder::BoolishValueParser::new())]
        boolish: bool,
        #[arg(long)]
        no_env: bool,
        #[command(subcommand)]
        sub: Option<Sub>,
    }

    #[derive(Debug, clap::Subcommand)]
    enum Sub {
        Run {
            #[arg(long, env = "CLI_TEST_NESTED")]
            nested: bool,
        },
    }

    #[test]
    fn the_walk_finds_strict_bool_env_flags_in_subcommands_too() {
        let found = unboolish_env_flags(&<Plain as clap::CommandFactory>::command());
        assert_eq!(found.len(), 2, "{found:#?}");
        assert!(found[0].contains("--plain (CLI_TEST_PLAIN)"), "{found:#?}");
        assert!(found[0].contains("\"1\""), "{found:#?}");
        assert!(
            found[1].contains(" run --nested (CLI_TEST_NESTED)"),
            "{found:#?}"
        );
    }

    #[tokio::test]
    async fn the_unspecified_ipv4_address_listens_on_both_families() {
        let l = listen("0.0.0.0:0".parse().unwrap()).unwrap();
        let port = l.local_addr().unwrap().port();
        let accept = tokio::spawn(async move {
            for _ in 0..2 {
                l.accept().await.unwrap();
            }
        });
        tokio::net::TcpStream::connect(("127.0.0.1", port))
            .await
            .expect("IPv4");
        // Where the host has IPv6 (loopback ::1), over IPv6 too.
        let v6 = tokio::net::TcpStream::connect(("::1", port)).await;
        if v6.is_err() {
            tokio::net::TcpStream::connect(("127.0.0.1", port))
                .await
                .unwrap();
        }
        accept.await.unwrap();
    }

    #[test]
    fn server_args_load_into_one_server_config() {
        #[derive(Debug, clap::Parser)]
        struct Server {
            #[command(flatten)]
            server: ServerArgs,
        }
        let parse = |args: &[&str]| {
            <Server as clap::Parser>::try_parse_from([&["server"], args].concat())
                .unwrap()
                .server
        };
        let s = parse(&["--token", "t0k", "--max-connections", "7"])
            .load(None)
            .unwrap();
        assert_eq!(s.token.expose(), "t0k");
        assert_eq!(s.max_in_flight, 7);
        assert!(s.auth.is_none() && s.tls.is_none(), "{s:?}");
        // --kube-auth asks the metadata server where there is one; the
        // metadata server itself (None) reviews tokens on its own.
        let kube = parse(&["--token", "t0k", "--kube-auth"]);
        assert!(
            kube.load(Some("http://127.0.0.1:9"))
                .unwrap()
                .auth
                .is_some()
        );
        assert!(kube.load(None).unwrap().auth.is_none());
        let half = parse(&["--token", "t0k", "--tls-cert", "/nonexistent/cert.pem"]);
        let e = half.load(None).unwrap_err();
        assert!(matches!(e, ServerArgsError::Tls(_)), "{e}");
        let plain = ServerConfig::from(Token::new("t0k").unwrap());
        assert_eq!(plain.max_in_flight, DEFAULT_MAX_CONNECTIONS);
    }

    #[test]
    fn server_args_take_boolish_values() {
        #[derive(Debug, clap::Parser)]
        struct Server {
            #[command(flatten)]
            server: ServerArgs,
        }
        assert_boolish_env_flags::<Server>();
    }
}
