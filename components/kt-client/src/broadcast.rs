//! `kt get --broadcast`: one getter of a broadcast tree (the protocol is in
//! [`kt_types::broadcast`]).
//!
//! The getter starts its [`Relay`], joins the group over a WebSocket held by
//! a background session, and downloads from the parent it is given while its
//! relay serves every chunk it has to its own children. When the parent
//! fails it, or the server moves it, it resumes from the new parent with the
//! chunks it has. The session reconnects (keeping its rank) when the
//! metadata server goes away, e.g. across a restart: the data keeps flowing
//! meanwhile. Once complete, the copy is handed to this pod's agent and the
//! relay serves on until no child needs it.

use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures::{SinkExt, StreamExt};
use kt_types::api::MemberTimings;
use kt_types::broadcast::{GetterMessage, GroupMessage, JoinRequest, Parent, Rejoin};
use kt_types::{ErrorCode, Key, STORE_HOLDER, paths};
use tokio::net::TcpStream;
use tokio::sync::mpsc;
use tokio_tungstenite::tungstenite::Message;
use tokio_tungstenite::tungstenite::client::IntoClientRequest;
use tokio_tungstenite::tungstenite::protocol::WebSocketConfig;
use tokio_tungstenite::{MaybeTlsStream, WebSocketStream};

use crate::api::Client;
use crate::download::Download;
use crate::error::ClientError;
use crate::progress::Progress;
use crate::relay::{Relay, STALL, Timings};
use crate::retry::{Failures, Next};
use crate::transfer::GetSummary;

/// How long a session keeps trying to reach the metadata server again.
const RECONNECT_FOR: Duration = Duration::from_secs(120);
/// How long a getter waits for a replacement parent.
const PARENT_WAIT: Duration = Duration::from_secs(60);
/// The server pings every 15 s: this long without a word, the connection is
/// lost even if no FIN or RST said so (a vanished node).
const SILENCE: Duration = Duration::from_secs(60);
/// One attempt at reconnecting, from connect to the answer to the rejoin.
const REJOIN_ATTEMPT: Duration = Duration::from_secs(10);
/// The longest a finished getter serves on waiting for its release.
const MAX_LINGER: Duration = Duration::from_secs(600);

/// How a getter joins a broadcast.
#[derive(Debug, Clone, Default)]
pub struct BroadcastOptions {
    /// A group id unique to this run; `None` joins the key's unnamed group.
    pub group: Option<String>,
    /// Children per node (the group's first getter sets it).
    pub fanout: Option<u32>,
    /// How long the group accepts joins (the first getter sets it).
    pub window: Option<Duration>,
    /// A mirror get: afterwards the destination holds exactly the key's
    /// tree (see [`crate::GetOptions::delete`]).
    pub delete: bool,
}

/// What a broadcast get did.
#[derive(Debug, Clone)]
pub struct BroadcastSummary {
    pub get: GetSummary,
    pub group: String,
    pub rank: u32,
    /// The ranks fetched from, in order (more than one when a parent was replaced).
    pub parents: Vec<u32>,
    /// Bytes this getter's relay served to its children.
    pub relayed: u64,
    /// Where its time went.
    pub timings: MemberTimings,
}

/// This getter's membership, as the session re-presents it on reconnecting.
#[derive(Debug, Clone)]
struct Membership {
    request: JoinRequest,
    group: String,
    rank: u32,
    version: String,
    /// The digest the version's manifest has (from the key's record):
    /// a manifest from any parent is used only if it hashes to this.
    digest: Option<kt_types::Hash>,
    parent: u32,
    done: bool,
    served_by: Option<String>,
    /// What proves the rank is this getter's on a rejoin.
    secret: Option<String>,
}

type Socket = WebSocketStream<MaybeTlsStream<TcpStream>>;

fn lost(what: impl std::fmt::Display) -> ClientError {
    ClientError::Local(format!("broadcast session: {what}"))
}

/// The group connection, run in the background.
struct Session {
    shared: Arc<Mutex<Membership>>,
    out: mpsc::UnboundedSender<GetterMessage>,
    events: mpsc::UnboundedReceiver<GroupMessage>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for Session {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl Session {
    async fn connect(client: &Client) -> Result<Socket, ClientError> {
        let base = &client.cfg.metadata_url;
        let url = match base.split_once("://") {
            Some(("https", rest)) => format!("wss://{rest}{}", paths::broadcast_join()),
            Some((_, rest)) => format!("ws://{rest}{}", paths::broadcast_join()),
            None => format!("ws://{base}{}", paths::broadcast_join()),
        };
        let mut req = url.as_str().into_client_request().map_err(lost)?;
        let auth = format!("Bearer {}", client.bearer())
            .parse()
            .map_err(|_| lost("the token is not a valid header value"))?;
        req.headers_mut()
            .insert(reqwest::header::AUTHORIZATION, auth);
        // Small messages on a long-held connection: small buffers (the
        // defaults take 128 KiB per connection).
        let config = WebSocketConfig::default()
            .read_buffer_size(4 << 10)
            .write_buffer_size(0);
        // wss: the CAs of KT_CA_FILE, as for every other kt call.
        let tls = kt_api::tls::rustls_client()
            .map_err(lost)?
            .map(tokio_tungstenite::Connector::Rustls);
        let (ws, _) =
            tokio_tungstenite::connect_async_tls_with_config(req, Some(config), true, tls)
                .await
                .map_err(|e| lost(format!("{url}: {e}")))?;
        Ok(ws)
    }

    async fn send(ws: &mut Socket, msg: &GetterMessage) -> Result<(), ClientError> {
        let text = serde_json::to_string(msg).map_err(lost)?;
        ws.send(Message::text(text)).await.map_err(lost)
    }

    /// The next message from the group; `None` when the connection is gone.
    async fn next(ws: &mut Socket) -> Option<Result<GroupMessage, ClientError>> {
        loop {
            match ws.next().await? {
                Ok(Message::Text(t)) => {
                    return Some(serde_json::from_str(t.as_str()).map_err(lost));
                }
                Ok(Message::Close(_)) | Err(_) => return None,
                Ok(_) => {}
            }
        }
    }

    /// Joins, and hands the connection to a background task. A metadata
    /// server that cannot be reached, does not answer within the stall
    /// timeout or drops the connection before it answers is tried again
    /// with backoff within the connect timeout ([`crate::deadline`]); its
    /// answers (a refusal) are final.
    async fn join(
        client: &Client,
        request: JoinRequest,
    ) -> Result<(Session, Membership, Parent), ClientError> {
        let mut contact = crate::deadline::FirstContact::new(
            &client.cfg.metadata_url,
            client.cfg.connect_timeout,
        );
        let (ws, first) = loop {
            let answer =
                tokio::time::timeout(client.cfg.stall, Self::first_answer(client, &request)).await;
            match answer {
                Ok(Ok(got)) => break got,
                Ok(Err(e)) => contact.unanswered(e).await?,
                Err(_) => {
                    let stall = humantime::format_duration(client.cfg.stall);
                    contact
                        .unanswered(lost(format!("no answer to the join within {stall}")))
                        .await?
                }
            }
        };
        crate::deadline::enter(crate::deadline::Phase::Transferring);
        let (group, rank, version, parent, secret, digest) = match first {
            GroupMessage::Assigned {
                group,
                rank,
                version,
                parent,
                secret,
                digest,
                ..
            } => (group, rank, version, parent, secret, digest),
            GroupMessage::Error { code, message } => {
                return Err(ClientError::Api {
                    status: code.http_status(),
                    code,
                    message,
                });
            }
            other => return Err(lost(format!("expected an assignment, got {other:?}"))),
        };
        let membership = Membership {
            request,
            group,
            rank,
            version,
            digest,
            parent: parent.rank,
            done: false,
            served_by: None,
            secret,
        };
        let shared = Arc::new(Mutex::new(membership.clone()));
        let (out_tx, out_rx) = mpsc::unbounded_channel();
        let (ev_tx, ev_rx) = mpsc::unbounded_channel();
        let task = tokio::spawn(Self::run(client.clone(), ws, shared.clone(), out_rx, ev_tx));
        let session = Session {
            shared,
            out: out_tx,
            events: ev_rx,
            task,
        };
        Ok((session, membership, parent))
    }

    /// Connects and sends the join: the connection and the server's first
    /// message, or what kept it from answering (worth another try).
    async fn first_answer(
        client: &Client,
        request: &JoinRequest,
    ) -> Result<(Socket, GroupMessage), ClientError> {
        let mut ws = Self::connect(client).await?;
        Self::send(&mut ws, &GetterMessage::Join(request.clone())).await?;
        let first = Self::next(&mut ws)
            .await
            .unwrap_or_else(|| Err(lost("the metadata server closed the connection")))?;
        Ok((ws, first))
    }

    /// Relays messages both ways; on a lost connection, rejoins with the
    /// same rank until [`RECONNECT_FOR`] has passed.
    async fn run(
        client: Client,
        mut ws: Socket,
        shared: Arc<Mutex<Membership>>,
        mut out: mpsc::UnboundedReceiver<GetterMessage>,
        events: mpsc::UnboundedSender<GroupMessage>,
    ) {
        let mut unsent: Vec<GetterMessage> = Vec::new();
        loop {
            // Pass messages until the connection drops.
            loop {
                if let Some(m) = unsent.first() {
                    if Self::send(&mut ws, m).await.is_err() {
                        break;
                    }
                    unsent.remove(0);
                    continue;
                }
                tokio::select! {
                    m = out.recv() => match m {
                        Some(m) => unsent.push(m),
                        None => {
                            let _ = ws.close(None).await;
                            return;
                        }
                    },
                    ev = tokio::time::timeout(SILENCE, Self::next(&mut ws)) => match ev.ok().flatten() {
                        Some(Ok(ev)) => {
                            if let GroupMessage::Parent { parent } = &ev {
                                lock(&shared).parent = parent.rank;
                            }
                            if events.send(ev).is_err() {
                                return;
                            }
                        }
                        Some(Err(e)) => tracing::warn!(error = %e, "broadcast session: bad message"),
                        None => break,
                    },
                }
            }
            tracing::warn!("lost the metadata server; rejoining the broadcast group");
            let Some((again, moved)) = Self::rejoin(&client, &shared).await else {
                tracing::warn!("could not rejoin the broadcast group; going on without it");
                return;
            };
            ws = again;
            // The group may have placed it under another parent meanwhile.
            if let Some(parent) = moved {
                lock(&shared).parent = parent.rank;
                if events.send(GroupMessage::Parent { parent }).is_err() {
                    return;
                }
            }
            // A Done already given is carried by the rejoin.
            if lock(&shared).done {
                unsent.retain(|m| !matches!(m, GetterMessage::Done { .. }));
            }
        }
    }

    /// Reconnects with the same rank; also returns the parent the group
    /// gave it when that is not the one it has.
    async fn rejoin(
        client: &Client,
        shared: &Arc<Mutex<Membership>>,
    ) -> Option<(Socket, Option<Parent>)> {
        let started = Instant::now();
        // Jittered: the members of a large group lost the server together
        // and must not all come back in the same instant.
        let mut backoff = kt_api::Backoff::new(Duration::from_millis(50), Duration::from_secs(1));
        while started.elapsed() < RECONNECT_FOR {
            backoff.wait().await;
            let m = lock(shared).clone();
            let mut request = m.request.clone();
            request.rejoin = Some(Rejoin {
                group: m.group.clone(),
                rank: m.rank,
                version: m.version.clone(),
                parent: m.parent,
                done: m.done,
                served_by: m.served_by.clone(),
                secret: m.secret.clone(),
            });
            let attempt = async {
                let mut ws = Self::connect(client).await.ok()?;
                Self::send(&mut ws, &GetterMessage::Join(request))
                    .await
                    .ok()?;
                let answer = Self::next(&mut ws).await;
                Some((ws, answer))
            };
            let Ok(Some((ws, answer))) = tokio::time::timeout(REJOIN_ATTEMPT, attempt).await else {
                continue;
            };
            match answer {
                Some(Ok(GroupMessage::Assigned { rank, parent, .. })) if rank == m.rank => {
                    tracing::info!(rank, "rejoined the broadcast group");
                    // An empty url: its parent has not rejoined yet; it stays.
                    let moved =
                        (parent.rank != m.parent && !parent.url.is_empty()).then_some(parent);
                    return Some((ws, moved));
                }
                // Passing trouble on the server's side: try again.
                Some(Ok(GroupMessage::Error { code, message }))
                    if matches!(
                        code,
                        ErrorCode::Unavailable | ErrorCode::Internal | ErrorCode::NoSource
                    ) =>
                {
                    tracing::warn!(%code, %message, "rejoining the broadcast group; retrying");
                }
                Some(Ok(GroupMessage::Error { code, message })) => {
                    tracing::warn!(%code, %message, "the broadcast group refused the rejoin");
                    return None;
                }
                _ => continue,
            }
        }
        None
    }

    fn tell(&self, msg: GetterMessage) {
        if let GetterMessage::Done { served_by } = &msg {
            let mut m = lock(&self.shared);
            m.done = true;
            m.served_by = served_by.clone();
        }
        let _ = self.out.send(msg);
    }

    /// Waits for a replacement parent (skipping other messages).
    async fn next_parent(&mut self) -> Result<Parent, ClientError> {
        let deadline = tokio::time::Instant::now() + PARENT_WAIT;
        loop {
            match tokio::time::timeout_at(deadline, self.events.recv()).await {
                Err(_) => {
                    return Err(lost(format!(
                        "no replacement parent within {PARENT_WAIT:?}"
                    )));
                }
                Ok(None) => return Err(lost("the group connection is gone")),
                Ok(Some(GroupMessage::Parent { parent })) => return Ok(parent),
                Ok(Some(GroupMessage::Error { code, message })) => {
                    return Err(ClientError::Api {
                        status: code.http_status(),
                        code,
                        message,
                    });
                }
                Ok(Some(_)) => {}
            }
        }
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// The address this getter's relay listens on: the pod's IP inside a pod.
fn relay_ip() -> String {
    std::env::var(kt_types::env::POD_IP)
        .ok()
        .filter(|ip| !ip.is_empty())
        .unwrap_or_else(|| "127.0.0.1".to_owned())
}

impl Client {
    /// Gets `key` into `dest` as one member of a broadcast (see the module
    /// documentation).
    pub async fn get_broadcast(
        &self,
        key: &Key,
        dest: &Path,
        options: &BroadcastOptions,
        progress: Progress,
    ) -> Result<BroadcastSummary, ClientError> {
        self.call(
            || format!("broadcast get of {key}"),
            self.get_broadcast_inner(key, dest, options, progress),
        )
        .await
    }

    async fn get_broadcast_inner(
        &self,
        key: &Key,
        dest: &Path,
        options: &BroadcastOptions,
        progress: Progress,
    ) -> Result<BroadcastSummary, ClientError> {
        let started = Instant::now();
        let cpu_before = cpu_time();
        let mut agent = self.agent_if_serving().await;
        // Children present this key to the relay: it cannot check their
        // own tokens (other pods' ServiceAccount tokens).
        let relay_key = format!(
            "{}{}",
            uuid::Uuid::new_v4().simple(),
            uuid::Uuid::new_v4().simple()
        );
        let relay = Relay::start(&relay_ip(), &self.cfg.token, &relay_key).await?;
        let request = JoinRequest {
            key: key.clone(),
            group: options.group.clone(),
            fanout: options.fanout,
            window_ms: options.window.map(|w| w.as_millis() as u64),
            relay_url: relay.url.clone(),
            relay_key: Some(relay_key),
            getter: agent.as_ref().map(|a| a.id.clone()),
            rejoin: None,
        };
        let joined = Session::join(self, request).await;
        let (mut session, membership, parent) = match joined {
            Ok(j) => j,
            Err(e) => {
                relay.stop().await;
                return Err(e);
            }
        };
        tracing::debug!(group = %membership.group, rank = membership.rank, parent = parent.rank, "joined");
        let joined = Instant::now();
        let mut parents = vec![parent.rank];
        let fetched = self
            .fetch_tree(
                key,
                dest,
                (&membership.version, membership.digest.as_ref()),
                parent,
                &mut session,
                &relay,
                &mut parents,
                &progress,
                options.delete,
            )
            .await;
        progress.finish();
        let dl = match fetched {
            Ok(dl) => dl,
            Err(e) => {
                relay.board.fail(e.to_string());
                relay.stop().await;
                return Err(e);
            }
        };
        let placed = Instant::now();
        let mut served_by = None;
        if let Some(a) = agent.as_mut()
            && self.serve_copy(a, key, &dl.read, &dl.final_dest).await
        {
            served_by = Some(a.url.clone());
        }
        session.tell(GetterMessage::Done { served_by });
        // Serve on until no child needs this relay (bounded: a child that
        // hangs does not hold this getter forever).
        let linger = (options.window.unwrap_or(STALL).max(STALL) * 3).min(MAX_LINGER);
        let released = tokio::time::timeout(linger, async {
            while let Some(ev) = session.events.recv().await {
                if matches!(ev, GroupMessage::Release) {
                    return true;
                }
            }
            false
        })
        .await;
        if !matches!(released, Ok(true)) {
            tracing::debug!("leaving the broadcast without a release");
        }
        let relayed = relay.board.served();
        let phases = [started, joined, placed, Instant::now()];
        let cpu = cpu_before.zip(cpu_time()).map(|(a, b)| b.saturating_sub(a));
        let timings = member_timings(&relay.board.timings, phases, cpu);
        tracing::debug!(?timings, "broadcast get: where the time went");
        relay.stop().await;
        drop(session);
        Ok(BroadcastSummary {
            get: GetSummary {
                stats: dl.stats,
                files: dl.read.manifest.file_count(),
                dest: dl.final_dest.clone(),
                duration: started.elapsed(),
            },
            group: membership.group,
            rank: membership.rank,
            parents,
            relayed,
            timings,
        })
    }

    /// Downloads from the tree, moving to the parents the group assigns.
    #[allow(clippy::too_many_arguments)]
    async fn fetch_tree(
        &self,
        key: &Key,
        dest: &Path,
        version: (&str, Option<&kt_types::Hash>),
        mut parent: Parent,
        session: &mut Session,
        relay: &Relay,
        parents: &mut Vec<u32>,
        progress: &Progress,
        delete: bool,
    ) -> Result<Download, ClientError> {
        let mut dl: Option<Download> = None;
        let mut connected = true;
        // The store, the durable origin, is waited for while it restarts.
        let mut origin = Failures::new(self.cfg.deadline);
        loop {
            let before = Download::mark(&dl);
            let (outcome, moved) = {
                // A relay may wait up to its own STALL on its parent before
                // it answers `unavailable`: no stall is declared before that.
                let stall = if parent.rank == 0 {
                    self.cfg.stall
                } else {
                    self.cfg.stall.max(STALL + RELAY_GRACE)
                };
                let shown = crate::transfer::shown_to(&parent.id, parent.key.as_deref());
                let attempt = async {
                    self.fetch_from(
                        (&parent.url, shown?),
                        version,
                        key,
                        dest,
                        &mut dl,
                        Some(&relay.board),
                        progress,
                        stall,
                    )
                    .await
                };
                tokio::pin!(attempt);
                loop {
                    if !connected {
                        break (Some(attempt.as_mut().await), None);
                    }
                    tokio::select! {
                        r = attempt.as_mut() => break (Some(r), None),
                        ev = session.events.recv() => match ev {
                            // The parent it has (a confirmation): carry on.
                            Some(GroupMessage::Parent { parent: p }) if p == parent => {}
                            Some(GroupMessage::Parent { parent: p }) => break (None, Some(p)),
                            Some(GroupMessage::Error { code, message }) => {
                                return Err(ClientError::Api { status: code.http_status(), code, message });
                            }
                            Some(_) => {}
                            None => connected = false,
                        },
                    }
                }
            };
            if before.advanced(&dl) {
                origin.progressed();
                origin.recovered(STORE_HOLDER);
            }
            if let Some(p) = moved {
                tracing::info!(
                    from = parent.rank,
                    to = p.rank,
                    "parent replaced by the group"
                );
                parent = p;
                parents.push(parent.rank);
            }
            match outcome {
                None => continue,
                Some(Ok(())) => break,
                Some(Err(e)) if parent.id == STORE_HOLDER && store_may_return(&e) => {
                    origin.record(STORE_HOLDER, &e);
                    let wait = match origin.when_none_left(&[STORE_HOLDER.to_owned()]) {
                        Next::Now => Duration::ZERO,
                        Next::Wait(d) => d,
                        Next::GiveUp => {
                            let why = origin.give_up("waiting for the store", "");
                            tracing::warn!(error = %why, "the store did not come back");
                            if !connected {
                                return Err(why);
                            }
                            session.tell(GetterMessage::ParentFailed {
                                parent: parent.rank,
                                reason: why.to_string(),
                                transient: false,
                            });
                            parent = session.next_parent().await?;
                            parents.push(parent.rank);
                            continue;
                        }
                    };
                    tracing::warn!(error = %e, wait_ms = wait.as_millis() as u64, "the store failed; waiting for it");
                    // While waiting, the group may still move this getter.
                    let sleep = tokio::time::sleep(wait);
                    tokio::pin!(sleep);
                    while connected {
                        tokio::select! {
                            _ = sleep.as_mut() => break,
                            ev = session.events.recv() => match ev {
                                Some(GroupMessage::Parent { parent: p }) if p != parent => {
                                    parent = p;
                                    parents.push(parent.rank);
                                    break;
                                }
                                Some(GroupMessage::Error { code, message }) => {
                                    return Err(ClientError::Api { status: code.http_status(), code, message });
                                }
                                Some(_) => {}
                                None => connected = false,
                            },
                        }
                    }
                    if !connected {
                        sleep.await;
                    }
                }
                Some(Err(e)) if e.is_source_failure() && connected => {
                    tracing::warn!(parent = parent.rank, error = %e, "parent failed; asking for another");
                    session.tell(GetterMessage::ParentFailed {
                        parent: parent.rank,
                        reason: e.to_string(),
                        transient: e.is_transient(),
                    });
                    parent = session.next_parent().await?;
                    parents.push(parent.rank);
                }
                Some(Err(e)) => return Err(e),
            }
        }
        let dl = dl.ok_or_else(|| ClientError::Local("no download was planned".into()))?;
        dl.finish(delete, self.cfg.deadline).await?;
        Ok(dl)
    }
}

/// The phases of a broadcast get (see [`MemberTimings`]) from the instants
/// it started, joined, had its copy in place and left, and what its board
/// timed.
fn member_timings(
    t: &Timings,
    [started, joined, placed, left]: [Instant; 4],
    cpu: Option<Duration>,
) -> MemberTimings {
    let ms = |d: Duration| d.as_millis().min(u64::MAX as u128) as u64;
    let since = |a: Instant, b: Instant| ms(b.saturating_duration_since(a));
    // Bytes came between joining and the copy being in place.
    let (first, last) = match (t.first_byte(), t.last_byte()) {
        (Some(f), Some(l)) => {
            let f = f.clamp(joined, placed);
            (f, l.clamp(f, placed))
        }
        _ => (joined, joined),
    };
    MemberTimings {
        join_ms: since(started, joined),
        first_byte_ms: since(joined, first),
        receive_ms: since(first, last),
        waited_ms: ms(t.waited()),
        hash_ms: ms(t.hashing()),
        write_ms: ms(t.writing()),
        finish_ms: since(last, placed),
        serve_ms: since(placed, left),
        cpu_ms: cpu.map(ms),
    }
}

/// User and system time of this process so far (`/proc/self/stat`, in
/// the kernel's fixed 100 ticks a second); `None` where it cannot be read.
fn cpu_time() -> Option<Duration> {
    let stat = std::fs::read_to_string("/proc/self/stat").ok()?;
    // Fields are counted after the command's last `)`: state is the first,
    // utime and stime the 12th and 13th.
    let rest = &stat[stat.rfind(')')? + 1..];
    let mut fields = rest.split_whitespace().skip(11);
    let utime: u64 = fields.next()?.parse().ok()?;
    let stime: u64 = fields.next()?.parse().ok()?;
    Some(Duration::from_millis((utime + stime) * 10))
}

/// How much longer than a relay's own [`STALL`] a child waits on it.
const RELAY_GRACE: Duration = Duration::from_secs(5);

/// Whether the store failing a broadcast getter this way may serve it once
/// it is back: a transient failure, or a read lease it forgot in a restart.
/// (A version conflict is not: the group's version is fixed.)
fn store_may_return(e: &ClientError) -> bool {
    e.is_transient() || e.code() == Some(ErrorCode::NotFound)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The phases follow one another and add up to the whole get; the
    /// pauses and the pieces' times are the board's.
    #[test]
    fn a_member_s_phases_add_up_to_its_whole_time() {
        let t = Timings::default();
        let started = Instant::now();
        std::thread::sleep(Duration::from_millis(5));
        let joined = Instant::now();
        std::thread::sleep(Duration::from_millis(20));
        t.frame();
        std::thread::sleep(crate::relay::GAP + Duration::from_millis(10));
        t.frame();
        t.piece(Duration::from_millis(7), Duration::from_millis(11));
        std::thread::sleep(Duration::from_millis(5));
        let placed = Instant::now();
        std::thread::sleep(Duration::from_millis(30));
        let left = Instant::now();
        let m = member_timings(&t, [started, joined, placed, left], None);
        let whole = left.duration_since(started).as_millis() as u64;
        let sum = m.join_ms + m.first_byte_ms + m.receive_ms + m.finish_ms + m.serve_ms;
        // Each phase is rounded down to whole milliseconds.
        assert!(sum <= whole && whole - sum <= 5, "{m:?} vs {whole} ms");
        assert!(
            m.join_ms >= 5 && m.first_byte_ms >= 20 && m.serve_ms >= 30,
            "{m:?}"
        );
        assert!(m.receive_ms >= m.waited_ms && m.waited_ms >= 50, "{m:?}");
        assert_eq!((m.hash_ms, m.write_ms, m.cpu_ms), (7, 11, None));

        // Nothing received (the copy was there): no receiving at all.
        let m = member_timings(&Timings::default(), [started, joined, placed, left], None);
        assert_eq!((m.first_byte_ms, m.receive_ms, m.waited_ms), (0, 0, 0));
        assert_eq!(
            m.finish_ms,
            placed.duration_since(joined).as_millis() as u64
        );
    }

    #[test]
    fn this_process_s_cpu_time_is_read() {
        let before = cpu_time().expect("/proc/self/stat");
        // Busy for a while: the count moves (it ticks every 10 ms).
        let spin = Instant::now();
        let mut x = 0u64;
        while cpu_time().unwrap() <= before {
            x = x.wrapping_mul(31).wrapping_add(1);
            assert!(spin.elapsed() < Duration::from_secs(60), "{x}");
        }
    }
}
