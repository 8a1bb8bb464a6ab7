//! `kt-bench-metadata --joins N`: N getters join one broadcast group at once.
//!
//! Every getter opens its own WebSocket (`GET /api/v1/broadcasts/join`),
//! sends a `Join` for the same key and named group (fanout 50 by default)
//! and waits for its `Assigned`; at most `concurrency` getters are between
//! connecting and being assigned at a time, and every connection stays open
//! until all N are assigned (as in a real broadcast, where members hold their
//! connection for the whole transfer). Then the tree is read back
//! (`GET /api/v1/broadcasts/{group}`) and checked: N members, ranks 1..=N,
//! each under its tree parent.
//!
//! The figures: the time from the first connection to the last assignment
//! (and joins per second over it), and the latency of one join (connect,
//! upgrade, `Join`, `Assigned`).
//!
//! One process cannot hold both ends of 10,000 connections under a 20,000
//! open-file limit, so unless `--url` names a server, the server runs in a
//! child process: this same binary with `--serve-metadata`. Both processes
//! raise their soft open-file limit to the hard one.

use std::path::Path;
use std::process::Stdio;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, bail, ensure};
use futures::{SinkExt, StreamExt};
use hyper::Method;
use hyper::header::{AUTHORIZATION, HeaderValue};
use kt_service::Token;
use kt_types::broadcast::{GetterMessage, GroupInfo, GroupMessage, JoinRequest, parent_rank};
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::net::TcpStream;
use tokio::sync::{Semaphore, mpsc};
use tokio_tungstenite::tungstenite::Message;
use tokio_tungstenite::tungstenite::client::IntoClientRequest;
use tokio_tungstenite::tungstenite::protocol::WebSocketConfig;
use tokio_tungstenite::{MaybeTlsStream, WebSocketStream};
use tokio_util::sync::CancellationToken;

use super::{Conn, Endpoint, Errors, Plan, TOKEN, Target, cleanup, seed, wait_ready};
use crate::histogram::{Histogram, ms};
use crate::scratch::ScratchDir;

/// Open files kept free besides the connections (the runtime, logs, the
/// seeding connections).
const SPARE_FILES: u64 = 256;
/// How long the child server has to say where it listens.
const CHILD_START: Duration = Duration::from_secs(30);
/// How long one getter may take from connecting to its assignment.
const JOIN_DEADLINE: Duration = Duration::from_secs(60);
/// How long the group accepts joins: far longer than any run.
const WINDOW_MS: u64 = 10 * 60 * 1000;

#[derive(Debug, Clone)]
pub struct JoinOptions {
    pub target: Target,
    /// Getters, each with its own connection.
    pub joins: usize,
    /// Getters between connecting and being assigned at once.
    pub concurrency: usize,
    pub fanout: u32,
}

/// What a join run measured.
#[derive(Debug, Clone)]
pub struct JoinOutcome {
    pub joins: usize,
    pub concurrency: usize,
    pub fanout: u32,
    /// Getters that were assigned a rank.
    pub assigned: usize,
    /// From the first connection to the last assignment.
    pub elapsed: Duration,
    /// Per getter: connect, upgrade, join, assignment.
    pub latency: Histogram,
    pub errors: Errors,
    /// The open-file limit of this process during the run.
    pub open_files: u64,
    /// Where the server ran.
    pub server: String,
}

impl JoinOutcome {
    pub fn joins_per_s(&self) -> f64 {
        super::per_second(self.assigned as u64, self.elapsed)
    }

    /// `joins=N assigned in Xs (Y joins/s), p99 Z ms`.
    pub fn summary_line(&self) -> String {
        format!(
            "joins={} assigned in {:.3}s ({:.0} joins/s), p99 {:.1} ms",
            self.assigned,
            self.elapsed.as_secs_f64(),
            self.joins_per_s(),
            ms(self.latency.percentile(99.0))
        )
    }

    /// The report above the summary line.
    pub fn report(&self) -> String {
        let h = &self.latency;
        let mut out = format!(
            "broadcast joins: {} getters, {} connecting at once, fanout {}, server {}\n\
             join latency ms: p50 {:.1}, p95 {:.1}, p99 {:.1}, max {:.1}\n\
             open-file limit: {}\n\
             errors: {}\n",
            self.joins,
            self.concurrency,
            self.fanout,
            self.server,
            ms(h.percentile(50.0)),
            ms(h.percentile(95.0)),
            ms(h.percentile(99.0)),
            ms(h.max()),
            self.open_files,
            self.errors.count
        );
        if let Some(first) = &self.errors.first {
            out.push_str(&format!("first error: {first}\n"));
        }
        out
    }
}

/// Raises this process's soft limit of open files to its hard limit;
/// answers the soft limit now.
#[allow(unsafe_code)]
pub fn raise_open_files() -> std::io::Result<u64> {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit and setrlimit only read and write the struct passed
    // by reference, which outlives both calls.
    unsafe {
        if libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) != 0 {
            return Err(std::io::Error::last_os_error());
        }
        if lim.rlim_cur < lim.rlim_max {
            let raised = libc::rlimit {
                rlim_cur: lim.rlim_max,
                rlim_max: lim.rlim_max,
            };
            if libc::setrlimit(libc::RLIMIT_NOFILE, &raised) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            lim = raised;
        }
    }
    Ok(lim.rlim_cur)
}

/// The hidden `--serve-metadata` mode: a metadata server on 127.0.0.1:0 with
/// its state in a work directory under `parent`; prints its URL on a line of
/// its own and serves until its standard input closes.
pub async fn serve_child(parent: &Path) -> anyhow::Result<()> {
    raise_open_files().context("raising the open-file limit")?;
    let dir = ScratchDir::create(parent)?;
    let listener = kt_service::cli::listen(std::net::SocketAddr::from(([127, 0, 0, 1], 0)))
        .context("listening")?;
    println!("http://{}", listener.local_addr()?);
    let shutdown = CancellationToken::new();
    let stop = shutdown.clone();
    // Any end of the standard input (the parent closed it, or died) stops
    // the server. A thread, not a task: a blocking read never ends otherwise.
    std::thread::Builder::new()
        .name("stdin-watch".into())
        .spawn(move || {
            let _ = std::io::copy(&mut std::io::stdin().lock(), &mut std::io::sink());
            stop.cancel();
        })
        .context("starting the stdin watcher")?;
    let config = kt_metadata::Config::new(dir.path().join("metadata"), Token::new(TOKEN)?);
    kt_metadata::run(listener, config, shutdown)
        .await
        .context("metadata server")?;
    Ok(())
}

/// A metadata server in a child process (this binary, `--serve-metadata`).
#[derive(Debug)]
struct ChildServer {
    url: String,
    child: tokio::process::Child,
    /// Kept open: a closed pipe would fail the child's later writes.
    _stdout: BufReader<tokio::process::ChildStdout>,
}

impl ChildServer {
    async fn start(parent: &Path) -> anyhow::Result<Self> {
        let exe = std::env::current_exe().context("locating this binary")?;
        let mut child = tokio::process::Command::new(exe)
            .arg("--serve-metadata")
            .arg(parent)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .kill_on_drop(true)
            .spawn()
            .context("starting the server process")?;
        let Some(stdout) = child.stdout.take() else {
            bail!("the server process has no standard output");
        };
        let mut stdout = BufReader::new(stdout);
        let mut line = String::new();
        tokio::time::timeout(CHILD_START, stdout.read_line(&mut line))
            .await
            .context("the server process did not say where it listens")?
            .context("reading the server process's address")?;
        let url = line.trim().to_owned();
        ensure!(
            url.starts_with("http://"),
            "the server process did not start (it printed {url:?})"
        );
        Ok(ChildServer {
            url,
            child,
            _stdout: stdout,
        })
    }

    /// Closes its standard input, which stops it; kills it if it lingers.
    async fn stop(mut self) -> anyhow::Result<()> {
        drop(self.child.stdin.take());
        match tokio::time::timeout(Duration::from_secs(20), self.child.wait()).await {
            Ok(status) => {
                let status = status.context("waiting for the server process")?;
                ensure!(status.success(), "the server process failed: {status}");
            }
            Err(_) => {
                self.child
                    .kill()
                    .await
                    .context("killing the server process")?;
                bail!("the server process did not stop in time; killed");
            }
        }
        Ok(())
    }
}

type Socket = WebSocketStream<MaybeTlsStream<TcpStream>>;

/// One getter's assignment, or why it got none.
type JoinResult = Result<(u32, Duration), String>;

/// Connects, joins, and waits for the assignment.
async fn join_once(url: &str, auth: &HeaderValue, join: String) -> Result<(Socket, u32), String> {
    let mut req = url
        .into_client_request()
        .map_err(|e| format!("request: {e}"))?;
    req.headers_mut().insert(AUTHORIZATION, auth.clone());
    // Small buffers, as a getter holding one connection for small messages
    // would use (the defaults take 128 KiB per connection).
    let config = WebSocketConfig::default()
        .read_buffer_size(4 << 10)
        .write_buffer_size(0);
    let (mut ws, _) = tokio_tungstenite::connect_async_with_config(req, Some(config), true)
        .await
        .map_err(|e| format!("connecting: {e}"))?;
    ws.send(Message::Text(join.into()))
        .await
        .map_err(|e| format!("sending the join: {e}"))?;
    loop {
        match ws.next().await {
            Some(Ok(Message::Text(text))) => match serde_json::from_str::<GroupMessage>(&text) {
                Ok(GroupMessage::Assigned { rank, .. }) => return Ok((ws, rank)),
                Ok(GroupMessage::Error { code, message }) => {
                    return Err(format!("refused: {code}: {message}"));
                }
                Ok(other) => return Err(format!("expected an assignment, got {other:?}")),
                Err(e) => return Err(format!("invalid message {text:?}: {e}")),
            },
            Some(Ok(Message::Ping(_) | Message::Pong(_))) => {}
            Some(Ok(other)) => return Err(format!("unexpected frame {other:?}")),
            Some(Err(e)) => return Err(format!("connection: {e}")),
            None => return Err("closed before the assignment".into()),
        }
    }
}

/// One getter: joins (holding a permit meanwhile), reports, then keeps its
/// connection open (answering pings) until `hold` is cancelled.
async fn getter(
    url: Arc<str>,
    auth: HeaderValue,
    join: String,
    permits: Arc<Semaphore>,
    report: mpsc::UnboundedSender<JoinResult>,
    hold: CancellationToken,
) {
    let Ok(permit) = permits.acquire_owned().await else {
        let _ = report.send(Err("the run was abandoned".into()));
        return;
    };
    let started = Instant::now();
    let joined = tokio::time::timeout(JOIN_DEADLINE, join_once(&url, &auth, join))
        .await
        .unwrap_or_else(|_| Err(format!("no assignment within {JOIN_DEADLINE:?}")));
    let took = started.elapsed();
    drop(permit);
    let mut ws = match joined {
        Ok((ws, rank)) => {
            let _ = report.send(Ok((rank, took)));
            ws
        }
        Err(e) => {
            let _ = report.send(Err(e));
            return;
        }
    };
    loop {
        tokio::select! {
            _ = hold.cancelled() => break,
            frame = ws.next() => if !matches!(frame, Some(Ok(_))) { break },
        }
    }
    let _ = ws.close(None).await;
}

/// Checks the tree the server reports: `joins` members, ranks 1..=joins,
/// each under its tree parent (nobody left).
fn check_tree(info: &GroupInfo, joins: usize, fanout: u32) -> Result<(), String> {
    if info.members.len() != joins {
        return Err(format!(
            "the group lists {} members, {joins} joined",
            info.members.len()
        ));
    }
    for (i, m) in info.members.iter().enumerate() {
        let want = parent_rank(m.rank, fanout);
        if usize::try_from(m.rank).ok() != Some(i + 1) || want != Some(m.parent) {
            return Err(format!(
                "member #{i} has rank {} under {} (want rank {} under {want:?})",
                m.rank,
                m.parent,
                i + 1
            ));
        }
    }
    Ok(())
}

/// Runs the join benchmark.
pub async fn run(opts: &JoinOptions) -> anyhow::Result<JoinOutcome> {
    ensure!(opts.joins > 0, "at least one join is needed");
    ensure!(
        opts.concurrency > 0,
        "the join concurrency must be positive"
    );
    let open_files = raise_open_files().context("raising the open-file limit")?;
    let needed = opts.joins as u64 + SPARE_FILES;
    ensure!(
        needed <= open_files,
        "{} connections need about {needed} open files; this process may open {open_files} \
         (the hard limit): lower --joins",
        opts.joins
    );
    let plan = Plan::new(&Plan::unique_prefix(), 1, 0, 0)?;
    let (child, ep, token) = match &opts.target {
        Target::InProcess { dir } => {
            let child = ChildServer::start(dir).await?;
            let ep = Endpoint::new(&child.url, TOKEN)?;
            println!("metadata server in a child process at {}", child.url);
            (Some(child), ep, TOKEN.to_owned())
        }
        Target::External { url, token } => (None, Endpoint::new(url, token)?, token.clone()),
    };
    let server = child.as_ref().map_or_else(
        || "given by --url".to_owned(),
        |c| format!("child process {}", c.url),
    );
    let ep = Arc::new(ep);
    wait_ready(&ep, None).await?;
    let seeded = seed(&ep, &plan, child.is_none()).await?;

    let group = format!("{}-joins", plan.service());
    let key = kt_types::Key::parse(&plan.key(0))?;
    let url: Arc<str> = Arc::from(format!(
        "ws://{}/api/v1/broadcasts/join",
        ep.authority.to_str()?
    ));
    let auth = HeaderValue::from_str(&format!("Bearer {token}"))?;
    let permits = Arc::new(Semaphore::new(opts.concurrency));
    let hold = CancellationToken::new();
    let (report, mut reports) = mpsc::unbounded_channel();
    println!(
        "{} getters join group {group} (fanout {}), {} connecting at once",
        opts.joins, opts.fanout, opts.concurrency
    );
    let started = Instant::now();
    let mut getters = tokio::task::JoinSet::new();
    for i in 0..opts.joins {
        let join = GetterMessage::Join(JoinRequest {
            key: key.clone(),
            group: Some(group.clone()),
            fanout: Some(opts.fanout),
            window_ms: Some(WINDOW_MS),
            relay_url: format!("http://{}-getter-{i}.invalid:8085", plan.service()),
            // Never presented: nobody fetches from these relays.
            relay_key: Some(format!("relay-key-of-getter-{i:08}")),
            getter: None,
            rejoin: None,
        });
        getters.spawn(getter(
            url.clone(),
            auth.clone(),
            serde_json::to_string(&join)?,
            permits.clone(),
            report.clone(),
            hold.clone(),
        ));
    }
    drop(report);
    let mut latency = Histogram::new();
    let mut errors = Errors::default();
    let mut assigned = 0;
    let mut elapsed = Duration::ZERO;
    while let Some(r) = reports.recv().await {
        match r {
            Ok((_rank, took)) => {
                assigned += 1;
                latency.record_duration(took);
                elapsed = started.elapsed();
            }
            Err(e) => errors.add(e),
        }
        if assigned + errors.count as usize == opts.joins {
            break;
        }
    }

    // Everyone is still connected: read the tree back.
    let mut conn = Conn::new(ep.clone());
    let path = format!("/api/v1/broadcasts/{group}");
    match conn.json::<GroupInfo>(Method::GET, &path, None).await {
        Ok(info) if errors.count == 0 => {
            if let Err(e) = check_tree(&info, opts.joins, opts.fanout) {
                errors.add(format!("the tree: {e}"));
            }
        }
        Ok(_) => {}
        Err(e) => errors.add(format!("{e:#}")),
    }
    hold.cancel();
    while getters.join_next().await.is_some() {}

    if child.is_none()
        && let Err(e) = cleanup(&ep, &plan, seeded.real_store).await
    {
        eprintln!(
            "warning: could not remove what was seeded under {}/: {e:#}",
            plan.service()
        );
    }
    if let Some(child) = child {
        child.stop().await?;
    }
    Ok(JoinOutcome {
        joins: opts.joins,
        concurrency: opts.concurrency,
        fanout: opts.fanout,
        assigned,
        elapsed,
        latency,
        errors,
        open_files,
        server,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use kt_types::broadcast::{MemberInfo, MemberState};

    fn info(members: &[(u32, u32)]) -> GroupInfo {
        GroupInfo {
            group: "g".into(),
            key: kt_types::Key::parse("a/b").unwrap(),
            version: "v".into(),
            fanout: 2,
            origin: "store".into(),
            open: true,
            members: members
                .iter()
                .map(|&(rank, parent)| MemberInfo {
                    rank,
                    parent,
                    state: MemberState::Active,
                    getter: None,
                    replaced: vec![],
                })
                .collect(),
        }
    }

    #[test]
    fn tree_check() {
        let good = info(&[(1, 0), (2, 0), (3, 1), (4, 1), (5, 2)]);
        assert_eq!(check_tree(&good, 5, 2), Ok(()));
        assert!(check_tree(&good, 6, 2).is_err());
        assert!(check_tree(&info(&[(1, 0), (3, 1)]), 2, 2).is_err());
        assert!(check_tree(&info(&[(1, 0), (2, 1)]), 2, 2).is_err());
    }

    #[test]
    fn summary_line_format() {
        let mut latency = Histogram::new();
        for _ in 0..100 {
            latency.record(12_000_000);
        }
        let o = JoinOutcome {
            joins: 10_000,
            concurrency: 256,
            fanout: 50,
            assigned: 10_000,
            elapsed: Duration::from_millis(800),
            latency,
            errors: Errors::default(),
            open_files: 20_000,
            server: "child process".into(),
        };
        assert_eq!(
            o.summary_line(),
            "joins=10000 assigned in 0.800s (12500 joins/s), p99 12.0 ms"
        );
        assert!(o.report().contains("errors: 0\n"));
    }

    #[test]
    fn open_files_can_be_raised() {
        let n = raise_open_files().unwrap();
        assert!(n >= 64, "{n}");
        assert_eq!(raise_open_files().unwrap(), n, "idempotent");
    }
}
