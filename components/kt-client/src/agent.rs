//! Talking to this pod's node agent over its control socket
//! ([`kt_types::agent`]), and starting one when none is running.

use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use kt_types::agent::{
    CONTROL_VERSION, ControlReply, ControlRequest, encode_traced_frame, frame_len,
};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::UnixStream;

use crate::ClientError;

/// How long an agent started on demand gets to open its socket.
const START_TIMEOUT: Duration = Duration::from_secs(10);
/// How long a running agent may take to answer the hello: a frozen one
/// (SIGSTOP, a node under memory pressure) fails the connection instead
/// of hanging the caller.
const HELLO_TIMEOUT: Duration = Duration::from_secs(10);
/// How long an agent that keeps the connection alive (it says `Working`
/// every [`kt_types::agent::KEEPALIVE`] while a request runs) may say
/// nothing before it counts as frozen.
const SILENCE: Duration = Duration::from_secs(30);

/// `$KT_AGENT_SOCKET`, else the agent's own default
/// ([`kt_service::cli::default_agent_socket`]).
pub fn default_socket() -> PathBuf {
    if let Some(p) = std::env::var_os(kt_types::env::AGENT_SOCKET).filter(|p| !p.is_empty()) {
        return PathBuf::from(p);
    }
    kt_service::cli::default_agent_socket()
}

/// An open control connection, past the version handshake.
#[derive(Debug)]
pub struct AgentConn {
    stream: UnixStream,
    /// The agent says `Working` while requests run: silence is bounded
    /// (by `silence`).
    keepalive: bool,
    silence: Duration,
    /// Why the connection is out of step (a request cut off midway).
    broken: Option<String>,
    /// The agent's id (its pod's name) and the URL peers fetch from.
    pub id: String,
    pub url: String,
    /// The agent's shared-memory directory, as it named it (older agents
    /// do not: `None`).
    pub shm_dir: Option<PathBuf>,
}

fn local(msg: impl Into<String>) -> ClientError {
    ClientError::Local(msg.into())
}

fn away(msg: impl Into<String>) -> ClientError {
    ClientError::Agent(msg.into())
}

impl AgentConn {
    /// Connects and says hello; `None` when no agent listens at `socket`.
    pub async fn connect(socket: &Path) -> Result<Option<AgentConn>, ClientError> {
        Self::connect_within(socket, HELLO_TIMEOUT).await
    }

    /// [`AgentConn::connect`], the hello answered within `limit`.
    async fn connect_within(
        socket: &Path,
        limit: Duration,
    ) -> Result<Option<AgentConn>, ClientError> {
        let stream = match UnixStream::connect(socket).await {
            Ok(s) => s,
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::NotFound | std::io::ErrorKind::ConnectionRefused
                ) =>
            {
                return Ok(None);
            }
            Err(e) if e.kind() == std::io::ErrorKind::PermissionDenied => {
                return Err(local(format!(
                    "agent socket {}: {e}: the node agent's socket is its user's alone; \
                     run kt as the agent's uid ({}), or the agent as this one's",
                    socket.display(),
                    socket_owner(socket).unwrap_or_else(|| "unknown".into())
                )));
            }
            Err(e) => {
                return Err(away(format!("agent socket {}: {e}", socket.display())));
            }
        };
        let mut conn = AgentConn {
            stream,
            keepalive: false,
            silence: SILENCE,
            broken: None,
            id: String::new(),
            url: String::new(),
            shm_dir: None,
        };
        let hello = conn.request(&ControlRequest::Hello {
            version: CONTROL_VERSION,
            keepalive: true,
        });
        let answer = tokio::time::timeout(limit, hello).await.map_err(|_| {
            away(format!(
                "the node agent at {} did not answer within {limit:?} (frozen?)",
                socket.display()
            ))
        })??;
        match answer {
            ControlReply::Hello {
                version,
                agent,
                url,
                keepalive,
                shm_dir,
            } if version == CONTROL_VERSION => {
                conn.id = agent;
                conn.url = url;
                conn.keepalive = keepalive;
                conn.shm_dir = shm_dir.map(PathBuf::from);
                if let Some(dir) = &conn.shm_dir {
                    // Host tensors this process lends go where the agent
                    // takes them, shared with its socket's group.
                    kt_tensor::shm::use_agent(kt_tensor::shm::Sharing {
                        dir: dir.clone(),
                        group: socket_group(socket),
                    });
                }
                Ok(Some(conn))
            }
            ControlReply::Hello { version, .. } => Err(local(format!(
                "the node agent speaks control protocol {version}, this kt speaks {CONTROL_VERSION}"
            ))),
            other => Err(unexpected(other)),
        }
    }

    /// Connects, starting `kt-agent` in the background when none runs (it
    /// gets this client's metadata server and token) unless
    /// `KT_AGENT_AUTOSTART=0` ([`autostart`]): the pod's own agent is then
    /// waited for (a sidecar being restarted) up to [`SIDECAR_WAIT`].
    pub async fn connect_or_start(
        socket: &Path,
        metadata_url: &str,
        token: &str,
    ) -> Result<AgentConn, ClientError> {
        Self::connect_or_start_as(socket, metadata_url, token, autostart()).await
    }

    /// [`AgentConn::connect_or_start`], starting an agent only when
    /// `autostart` says so.
    pub async fn connect_or_start_as(
        socket: &Path,
        metadata_url: &str,
        token: &str,
        autostart: bool,
    ) -> Result<AgentConn, ClientError> {
        if let Some(c) = AgentConn::connect(socket).await? {
            return Ok(c);
        }
        let within = if autostart {
            start_agent(socket, metadata_url, token)?;
            START_TIMEOUT
        } else {
            SIDECAR_WAIT
        };
        let deadline = Instant::now() + within;
        loop {
            if let Some(c) = AgentConn::connect(socket).await? {
                return Ok(c);
            }
            if Instant::now() >= deadline {
                return Err(away(if autostart {
                    format!(
                        "started kt-agent, but it did not open {} within {within:?}; see {}",
                        socket.display(),
                        agent_log(socket).display()
                    )
                } else {
                    format!(
                        "no node agent listens at {} (waited {within:?}); {}=0 says the pod's \
                         agent is run for it (a sidecar), so kt does not start one",
                        socket.display(),
                        kt_types::env::AGENT_AUTOSTART
                    )
                }));
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// One request, one reply. `Error` replies become errors.
    pub async fn request(&mut self, req: &ControlRequest) -> Result<ControlReply, ClientError> {
        if let Some(why) = &self.broken {
            return Err(away(format!(
                "the connection to the node agent broke earlier ({why}): connect again"
            )));
        }
        let trace = kt_api::trace::current().map(|t| t.to_string());
        let frame = encode_traced_frame(req, trace.as_deref())
            .map_err(|e| local(format!("encoding a request: {e}")))?;
        let reply = match self.exchange(&frame).await {
            Ok(r) => r,
            Err(e) => {
                // A request cut off midway leaves the connection out of step
                // (a late answer would be taken for the next request's).
                self.broken = Some(e.to_string());
                let _ = self.stream.shutdown().await;
                return Err(e);
            }
        };
        match reply {
            ControlReply::Error { code, message } => Err(ClientError::Api {
                status: code.http_status(),
                code,
                message: format!("node agent: {message}"),
            }),
            r => Ok(r),
        }
    }

    /// Writes `frame`, then reads until the answer (past `Working` frames),
    /// silence bounded where the agent keeps the connection alive.
    async fn exchange(&mut self, frame: &[u8]) -> Result<ControlReply, ClientError> {
        let (keepalive, silence) = (self.keepalive, self.silence);
        let frozen = || {
            away(format!(
                "the node agent said nothing for {silence:?} while it should have been saying it is working (frozen? out of CPU?)"
            ))
        };
        let io = |e: std::io::Error| away(format!("agent control socket: {e}"));
        let write = self.stream.write_all(frame);
        if keepalive {
            tokio::time::timeout(silence, write)
                .await
                .map_err(|_| frozen())?
                .map_err(io)?;
        } else {
            write.await.map_err(io)?;
        }
        loop {
            let next = self.read_reply();
            let reply = if keepalive {
                tokio::time::timeout(silence, next)
                    .await
                    .map_err(|_| frozen())??
            } else {
                next.await?
            };
            if reply != ControlReply::Working {
                return Ok(reply);
            }
        }
    }

    /// The next frame from the agent.
    async fn read_reply(&mut self) -> Result<ControlReply, ClientError> {
        let io = |e: std::io::Error| away(format!("agent control socket: {e}"));
        let mut head = [0u8; 4];
        self.stream.read_exact(&mut head).await.map_err(io)?;
        let n = frame_len(head).map_err(local)?;
        let mut body = Vec::new();
        (&mut self.stream)
            .take(n as u64)
            .read_to_end(&mut body)
            .await
            .map_err(io)?;
        if body.len() != n {
            return Err(away("the node agent closed the control socket mid-reply"));
        }
        serde_json::from_slice(&body)
            .map_err(|e| local(format!("unreadable reply from the node agent: {e}")))
    }
}

/// The agent's shared-memory directory, asked of the agent listening at
/// `socket` (its hello names it): `None` when no agent listens there. An
/// agent too old to name it gets `KT_SHM_DIR` (default `/dev/shm`), which
/// must then match its own. Connecting records the directory for this
/// process's host tensors too ([`kt_tensor::shm::lend_dir`]).
pub async fn shared_memory_dir(socket: &Path) -> Result<Option<PathBuf>, ClientError> {
    Ok(AgentConn::connect(socket)
        .await?
        .map(|c| c.shm_dir.unwrap_or_else(kt_tensor::shm::shm_dir)))
}

/// The group the agent shares its socket with (see
/// [`kt_tensor::shm::socket_group`]).
fn socket_group(socket: &Path) -> Option<u32> {
    use std::os::unix::fs::MetadataExt;
    let md = std::fs::metadata(socket).ok()?;
    kt_tensor::shm::socket_group(md.mode(), md.gid())
}

/// The uid owning the socket's directory (the agent's), when it can be seen.
fn socket_owner(socket: &Path) -> Option<String> {
    use std::os::unix::fs::MetadataExt;
    let dir = socket.parent()?;
    std::fs::metadata(dir).ok().map(|m| m.uid().to_string())
}

fn unexpected(r: ControlReply) -> ClientError {
    local(format!("unexpected reply from the node agent: {r:?}"))
}

fn agent_log(socket: &Path) -> PathBuf {
    socket.with_extension("log")
}

/// How long `kt` waits for a pod's own agent (`KT_AGENT_AUTOSTART=0`) to
/// come back: a sidecar restarted by its supervisor.
const SIDECAR_WAIT: Duration = Duration::from_secs(30);

/// Whether `kt` may start a node agent when none runs: yes unless
/// `KT_AGENT_AUTOSTART` is off (`0`, `false`, `no`, `off`: the pod's agent
/// is run for it; one `kt` started would present the workload's token,
/// which may not act as an agent).
pub fn autostart() -> bool {
    env_flag(kt_types::env::AGENT_AUTOSTART, true)
}

/// Boolean variable `var` ([`kt_types::env::boolish`]): `default` when
/// unset or empty, or (with a warning) when not a recognised boolean.
fn env_flag(var: &str, default: bool) -> bool {
    match std::env::var(var) {
        Ok(v) if !v.trim().is_empty() => flag_value(var, &v, default),
        _ => default,
    }
}

fn flag_value(var: &str, value: &str, default: bool) -> bool {
    kt_types::env::boolish(var, value).unwrap_or_else(|e| {
        tracing::warn!("{e}; taking {default}");
        default
    })
}

/// The agent binary's name.
const AGENT_BIN: &str = "kt-agent";
/// How long an agent started on demand stays once nothing needs it.
const IDLE_GRACE: &str = "30s";

/// Where to look for `kt-agent`, in order: `$KT_AGENT_BIN`, beside this
/// executable, then each directory of `$PATH`.
fn agent_candidates(
    explicit: Option<PathBuf>,
    exe: Option<PathBuf>,
    path: Option<std::ffi::OsString>,
) -> Vec<PathBuf> {
    let mut out: Vec<PathBuf> = explicit.into_iter().collect();
    if let Some(dir) = exe.as_deref().and_then(Path::parent) {
        out.push(dir.join(AGENT_BIN));
    }
    if let Some(p) = path {
        out.extend(
            std::env::split_paths(&p)
                .filter(|d| !d.as_os_str().is_empty())
                .map(|d| d.join(AGENT_BIN)),
        );
    }
    out
}

/// The first of `candidates` that is an executable file, or an error that
/// names every place looked at.
fn find_agent(candidates: &[PathBuf], socket: &Path) -> Result<PathBuf, ClientError> {
    use std::os::unix::fs::PermissionsExt;
    let runnable = |p: &&PathBuf| {
        std::fs::metadata(p).is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
    };
    candidates.iter().find(runnable).cloned().ok_or_else(|| {
        let tried: Vec<String> = candidates.iter().map(|p| p.display().to_string()).collect();
        away(format!(
            "no node agent listens at {} and none can be started: {AGENT_BIN} was not found \
             (looked for {}); install {AGENT_BIN} beside kt or on PATH, set KT_AGENT_BIN, \
             or run the agent as a sidecar",
            socket.display(),
            if tried.is_empty() {
                "nowhere: no KT_AGENT_BIN, executable path or PATH".to_owned()
            } else {
                tried.join(", ")
            }
        ))
    })
}

/// The address an agent started on demand listens on: the pod's IP
/// (`KT_POD_IP`, else `POD_IP`) on the agent's port, else loopback on any
/// free port. Never every interface.
fn listen_addr(pod_ip: Option<&str>) -> String {
    match pod_ip
        .map(str::trim)
        .and_then(|p| p.parse::<std::net::IpAddr>().ok())
    {
        Some(ip) => std::net::SocketAddr::new(ip, 8090).to_string(),
        None => "127.0.0.1:0".to_owned(),
    }
}

/// `KT_AGENT_STAY`, a boolean (1/0, true/false, yes/no, on/off): an agent
/// started on demand runs until stopped instead of ending when idle.
fn stay() -> bool {
    env_flag(kt_types::env::AGENT_STAY, false)
}

/// Starts `kt-agent` ([`agent_candidates`]) detached, in its own process
/// group, logging next to its socket; it listens on the pod's IP or
/// loopback ([`listen_addr`]) and ends once idle for [`IDLE_GRACE`]
/// (`--exit-when-idle`) unless `KT_AGENT_STAY` says it stays
/// (`KT_AGENT_LISTEN`, `KT_AGENT_EXIT_WHEN_IDLE` set in the environment
/// stand instead).
fn start_agent(socket: &Path, metadata_url: &str, token: &str) -> Result<(), ClientError> {
    let candidates = agent_candidates(
        std::env::var_os(kt_types::env::AGENT_BIN)
            .filter(|p| !p.is_empty())
            .map(PathBuf::from),
        std::env::current_exe().ok(),
        std::env::var_os("PATH"),
    );
    let exe = find_agent(&candidates, socket)?;
    if let Some(dir) = socket.parent() {
        std::fs::create_dir_all(dir)
            .map_err(|e| local(format!("creating {}: {e}", dir.display())))?;
    }
    let log_path = agent_log(socket);
    let log = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(&log_path)
        .map_err(|e| local(format!("{}: {e}", log_path.display())))?;
    let err = log
        .try_clone()
        .map_err(|e| local(format!("{}: {e}", log_path.display())))?;
    let pod_ip = std::env::var(kt_types::env::POD_IP)
        .ok()
        .or_else(|| std::env::var("POD_IP").ok());
    let mut cmd = std::process::Command::new(&exe);
    cmd.arg("--socket")
        .arg(socket)
        .arg("--metadata-url")
        .arg(metadata_url)
        .env(kt_types::env::TOKEN, token)
        .stdin(std::process::Stdio::null())
        .stdout(log)
        .stderr(err)
        .process_group(0);
    // What the environment sets for the agent stands.
    let set = |var: &str| std::env::var_os(var).is_some_and(|v| !v.is_empty());
    if !set(kt_types::env::AGENT_LISTEN) {
        cmd.arg("--listen").arg(listen_addr(pod_ip.as_deref()));
    }
    if !stay() && !set(kt_types::env::AGENT_EXIT_WHEN_IDLE) {
        cmd.arg("--exit-when-idle").arg(IDLE_GRACE);
    }
    cmd.spawn().map_err(|e| {
        away(format!(
            "no node agent at {}, and starting {} failed: {e}",
            socket.display(),
            exe.display()
        ))
    })?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use kt_types::agent::encode_frame;

    /// Every boolean form turns autostart off, not only `0`; an
    /// unrecognised value keeps the default (and is warned about).
    #[test]
    fn autostart_off_takes_every_boolean_form() {
        let var = kt_types::env::AGENT_AUTOSTART;
        for off in ["0", "false", "no", "off", " OFF ", "False"] {
            assert!(!flag_value(var, off, true), "{off}");
        }
        for on in ["1", "true", "yes", "on"] {
            assert!(flag_value(var, on, true), "{on}");
        }
        assert!(flag_value(var, "maybe", true));
        assert!(!flag_value(var, "maybe", false));
    }

    #[tokio::test]
    async fn no_agent_is_none_not_an_error() {
        let dir = tempfile::tempdir().unwrap();
        assert!(
            AgentConn::connect(&dir.path().join("nope.sock"))
                .await
                .unwrap()
                .is_none()
        );
    }

    #[tokio::test]
    async fn handshake_and_errors_over_a_fake_agent() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("a.sock");
        let listener = tokio::net::UnixListener::bind(&path).unwrap();
        tokio::spawn(async move {
            let (mut s, _) = listener.accept().await.unwrap();
            for reply in [
                ControlReply::Hello {
                    version: CONTROL_VERSION,
                    agent: "pod-a".into(),
                    url: "http://10.0.0.1:8090".into(),
                    keepalive: false,
                    shm_dir: None,
                },
                ControlReply::Error {
                    code: kt_types::ErrorCode::InvalidRequest,
                    message: "path must be absolute".into(),
                },
            ] {
                let mut head = [0u8; 4];
                s.read_exact(&mut head).await.unwrap();
                let mut body = vec![0; frame_len(head).unwrap()];
                s.read_exact(&mut body).await.unwrap();
                let _: ControlRequest = serde_json::from_slice(&body).unwrap();
                s.write_all(&encode_frame(&reply).unwrap()).await.unwrap();
            }
        });
        let mut c = AgentConn::connect(&path).await.unwrap().unwrap();
        assert_eq!(c.id, "pod-a");
        let err = c.request(&ControlRequest::Status).await.unwrap_err();
        assert_eq!(err.code(), Some(kt_types::ErrorCode::InvalidRequest));
        assert!(err.to_string().contains("path must be absolute"));
    }

    /// Frames of the fake agent below, one by one: `None` reads a request.
    async fn fake(path: &Path, script: Vec<Option<(Duration, ControlReply)>>) {
        let listener = tokio::net::UnixListener::bind(path).unwrap();
        tokio::spawn(async move {
            let (mut s, _) = listener.accept().await.unwrap();
            for step in script {
                match step {
                    None => {
                        let mut head = [0u8; 4];
                        s.read_exact(&mut head).await.unwrap();
                        let mut body = vec![0; frame_len(head).unwrap()];
                        s.read_exact(&mut body).await.unwrap();
                        let req: ControlRequest = serde_json::from_slice(&body).unwrap();
                        if let ControlRequest::Hello { keepalive, .. } = req {
                            assert!(keepalive, "this kt asks for keepalive");
                        }
                    }
                    Some((pause, reply)) => {
                        tokio::time::sleep(pause).await;
                        s.write_all(&encode_frame(&reply).unwrap()).await.unwrap();
                    }
                }
            }
            // Then silence, the connection open: a frozen agent.
            std::future::pending::<()>().await;
        });
    }

    #[tokio::test]
    async fn a_working_agent_may_take_long_a_silent_one_fails() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("busy.sock");
        let tick = Duration::from_millis(100);
        let mut script = vec![
            None,
            Some((
                Duration::ZERO,
                ControlReply::Hello {
                    version: CONTROL_VERSION,
                    agent: "pod-a".into(),
                    url: "http://10.0.0.1:8090".into(),
                    keepalive: true,
                    shm_dir: Some("/dev/shm/kt".into()),
                },
            )),
            None,
        ];
        // Six ticks of work: longer than the silence allowed, said aloud.
        script.extend((0..6).map(|_| Some((tick, ControlReply::Working))));
        script.push(Some((
            tick,
            ControlReply::Status {
                agent: "pod-a".into(),
                url: "http://10.0.0.1:8090".into(),
                exports: vec![],
                tensors: vec![],
            },
        )));
        script.push(None);
        fake(&path, script).await;
        let mut c = AgentConn::connect(&path).await.unwrap().unwrap();
        assert!(c.keepalive);
        assert_eq!(c.shm_dir, Some(PathBuf::from("/dev/shm/kt")));
        c.silence = Duration::from_millis(300);
        let t = Instant::now();
        let r = c.request(&ControlRequest::Status).await.unwrap();
        assert!(matches!(r, ControlReply::Status { .. }), "{r:?}");
        assert!(t.elapsed() >= 6 * tick, "{:?}", t.elapsed());
        // The next request meets silence.
        let e = c.request(&ControlRequest::Status).await.unwrap_err();
        assert!(e.to_string().contains("said nothing for 300ms"), "{e}");
        // Then the connection is out of step: refused at once.
        let t = Instant::now();
        let e = c.request(&ControlRequest::Status).await.unwrap_err();
        assert!(e.to_string().contains("broke earlier"), "{e}");
        assert!(t.elapsed() < Duration::from_millis(300));
    }

    #[test]
    fn the_agent_binary_is_looked_for_in_named_places() {
        let dir = tempfile::tempdir().unwrap();
        let bin = dir.path().join("bin");
        std::fs::create_dir(&bin).unwrap();
        let c = agent_candidates(
            Some("/opt/kt/kt-agent".into()),
            Some("/usr/lib/python3/kt/python3".into()),
            Some(std::env::join_paths([bin.clone(), "/usr/bin".into()]).unwrap()),
        );
        assert_eq!(
            c,
            vec![
                PathBuf::from("/opt/kt/kt-agent"),
                PathBuf::from("/usr/lib/python3/kt/kt-agent"),
                bin.join("kt-agent"),
                PathBuf::from("/usr/bin/kt-agent"),
            ]
        );
        let e = find_agent(&c, Path::new("/run/kt/agent.sock")).unwrap_err();
        let msg = e.to_string();
        assert!(msg.contains("none can be started"), "{msg}");
        assert!(msg.contains("/usr/lib/python3/kt/kt-agent"), "{msg}");
        assert!(
            msg.contains(&bin.join("kt-agent").display().to_string()),
            "{msg}"
        );
        // A file that is not executable does not count; an executable does.
        use std::os::unix::fs::PermissionsExt;
        let found = bin.join("kt-agent");
        std::fs::write(&found, "#!/bin/sh\n").unwrap();
        assert!(find_agent(&c, Path::new("/s")).is_err());
        std::fs::set_permissions(&found, std::fs::Permissions::from_mode(0o755)).unwrap();
        assert_eq!(find_agent(&c, Path::new("/s")).unwrap(), found);
    }

    #[test]
    fn an_agent_started_on_demand_listens_on_the_pod_ip_or_loopback() {
        assert_eq!(listen_addr(Some("10.1.2.3")), "10.1.2.3:8090");
        assert_eq!(listen_addr(Some("fd00::7")), "[fd00::7]:8090");
        assert_eq!(listen_addr(None), "127.0.0.1:0");
        assert_eq!(listen_addr(Some("not-an-ip")), "127.0.0.1:0");
    }

    #[tokio::test]
    async fn an_agent_that_never_answers_fails_the_connection() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("frozen.sock");
        // Accepted by the kernel's backlog, never answered: a frozen agent.
        let _listener = tokio::net::UnixListener::bind(&path).unwrap();
        let e = AgentConn::connect_within(&path, Duration::from_millis(200))
            .await
            .unwrap_err();
        assert!(e.to_string().contains("did not answer"), "{e}");
    }
}
