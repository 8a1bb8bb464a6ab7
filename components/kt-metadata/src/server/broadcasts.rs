//! Broadcast groups over WebSockets: one connection per member, its `Join`,
//! then the group's messages out and the member's reports in, until it
//! closes, fails or the server stops. The groups themselves are
//! [`crate::broadcast`]'s pure state machine; this module locks it, commits
//! what must be persisted and delivers what it decides.

use std::collections::HashMap;
use std::sync::PoisonError;
use std::time::{Duration, Instant};

use axum::extract::ws::rejection::WebSocketUpgradeRejection;
use axum::extract::ws::{CloseFrame, Message, WebSocket, WebSocketUpgrade, close_code};
use axum::extract::{Path, State};
use axum::response::{IntoResponse, Response};
use kt_service::{ApiError, ApiJson};
use kt_types::ErrorCode;
use kt_types::api::LeaseRequest;
use kt_types::auth::Role;
use kt_types::broadcast::{GetterMessage, GroupInfo, GroupMessage, JoinRequest, Parent};
use tokio::sync::mpsc;

use super::leases::readable_sources;
use super::{AppState, Inner, check_agent_id, check_url, db_err, now_ms};
use crate::broadcast::{Events, Groups, JoinError, Joined};
use crate::db::Batch;

/// How long a new connection has to send its `Join`.
const JOIN_TIMEOUT: Duration = Duration::from_secs(5);
/// Largest message (and frame) a member may send.
const MAX_MEMBER_MESSAGE: usize = 64 << 10;
/// Read buffer of a member's connection.
const MEMBER_BUFFER: usize = 4 << 10;
/// How often a member's connection is pinged.
const PING_INTERVAL: Duration = Duration::from_secs(15);
/// A member connection silent this long (not even a pong) is closed.
const MEMBER_SILENCE: Duration = Duration::from_secs(45);

/// A member's queue of messages, held by the session of its connection.
type MemberQueue = (u64, mpsc::UnboundedSender<GroupMessage>);

/// The broadcast groups and, per connected member, where its messages go.
#[derive(Debug)]
pub(super) struct Broadcasts {
    groups: Groups,
    /// By group, then rank.
    senders: HashMap<String, HashMap<u32, MemberQueue>>,
}

impl Broadcasts {
    /// The groups (read by the scrape-time gauges).
    pub(super) fn groups(&self) -> &Groups {
        &self.groups
    }

    /// `groups`, none of whose members is connected yet.
    pub(super) fn new(groups: Groups) -> Self {
        Broadcasts {
            groups,
            senders: HashMap::new(),
        }
    }

    /// Queues `events` to members of `group`; a member with no connection
    /// here has left and needs none of them.
    fn dispatch(&self, group: &str, events: Events) {
        let senders = self.senders.get(group);
        for (rank, msg) in events {
            match &msg {
                GroupMessage::Parent { parent } => tracing::info!(
                    group,
                    rank,
                    parent = parent.rank,
                    url = %parent.url,
                    "broadcast member moved to another parent"
                ),
                GroupMessage::Release => tracing::debug!(group, rank, "broadcast member released"),
                GroupMessage::Error { code, message } => tracing::info!(
                    group,
                    rank,
                    code = %code,
                    message,
                    "broadcast member cannot go on"
                ),
                GroupMessage::Assigned { .. } => {}
            }
            if let Some((_, tx)) = senders.and_then(|ranks| ranks.get(&rank)) {
                // A closed queue belongs to a connection that is ending.
                let _ = tx.send(msg);
            }
        }
    }
}

fn lock_broadcasts(s: &Inner) -> std::sync::MutexGuard<'_, Broadcasts> {
    s.broadcasts.lock().unwrap_or_else(PoisonError::into_inner)
}

impl From<JoinError> for ApiError {
    fn from(e: JoinError) -> Self {
        ApiError::new(e.code(), e.to_string())
    }
}

/// `GET /api/v1/broadcasts/join`: the WebSocket of one broadcast member.
pub(super) async fn join_broadcast(
    State(s): State<AppState>,
    axum::extract::Extension(who): axum::extract::Extension<kt_types::auth::Principal>,
    ws: Result<WebSocketUpgrade, WebSocketUpgradeRejection>,
) -> Response {
    match ws {
        Ok(ws) => ws
            // Small messages on many connections: small buffers (the
            // defaults, 128 KiB each, would cost GiBs for 10,000 members).
            .read_buffer_size(MEMBER_BUFFER)
            .write_buffer_size(0)
            .max_message_size(MAX_MEMBER_MESSAGE)
            .max_frame_size(MAX_MEMBER_MESSAGE)
            .on_upgrade(move |socket| {
                let sessions = s.sessions.clone();
                sessions.track_future(member_session(s, who, socket))
            }),
        Err(r) => ApiError::bad_request(format!(
            "broadcast members join over a WebSocket: {}",
            r.body_text()
        ))
        .into_response(),
    }
}

/// `GET /api/v1/broadcasts/{group}`: the tree as it stands.
pub(super) async fn get_broadcast(
    State(s): State<AppState>,
    Path(group): Path<String>,
) -> Result<ApiJson<GroupInfo>, ApiError> {
    let b = lock_broadcasts(&s);
    match b.groups.info(&group, now_ms()) {
        Some(info) => Ok(ApiJson(info)),
        None if b.groups.has_ended(&group) => Err(ApiError::not_found(format!(
            "broadcast group {group:?} has ended"
        ))),
        None => Err(ApiError::not_found(format!(
            "broadcast group {group:?} is unknown"
        ))),
    }
}

/// The membership a connection holds.
#[derive(Debug)]
struct Membership {
    group: String,
    rank: u32,
    session: u64,
    /// The group's key and version, and the version's manifest digest
    /// (from the key's record): what every parent handed to this member
    /// is checked against, and what its capabilities read.
    key: kt_types::Key,
    version: String,
    digest: Option<kt_types::Hash>,
    /// Who the member is, for the capabilities minted for it.
    getter: String,
    /// Whose token joined: what it later reports is held to it (a
    /// `served_by` on its pod's IP).
    who: kt_types::auth::Principal,
}

/// Why a member's session ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum SessionEnd {
    /// The getter closed the connection, or it broke.
    Closed,
    /// The getter was sent an error.
    Refused,
    /// The server is stopping.
    ShuttingDown,
    /// Nothing heard for [`MEMBER_SILENCE`].
    Silent,
}

/// One member's connection: its `Join`, then messages out and reports in
/// until it closes, fails, or the server stops.
async fn member_session(s: AppState, who: kt_types::auth::Principal, mut socket: WebSocket) {
    if s.shutdown.is_cancelled() {
        return;
    }
    let req = match first_join(&mut socket).await {
        Ok(req) => req,
        Err(e) => return refuse(&mut socket, e).await,
    };
    let (tx, mut rx) = mpsc::unbounded_channel();
    let member = match admit(&s, &who, &req, tx).await {
        Ok(m) => m,
        Err(e) => {
            tracing::debug!(key = %req.key, group = ?req.group, error = %e, "broadcast join refused");
            return refuse(&mut socket, e).await;
        }
    };
    let end = serve_member(&s, &mut socket, &member, &mut rx).await;
    leave(&s, &member);
    tracing::debug!(group = %member.group, rank = member.rank, ?end, "broadcast member left");
    if end != SessionEnd::Closed {
        let code = match end {
            SessionEnd::ShuttingDown => close_code::AWAY,
            _ => close_code::NORMAL,
        };
        let _ = socket
            .send(Message::Close(Some(CloseFrame {
                code,
                reason: "".into(),
            })))
            .await;
    }
}

/// Reads the connection's first message, which must be a `Join`.
async fn first_join(socket: &mut WebSocket) -> Result<JoinRequest, ApiError> {
    let text = tokio::time::timeout(JOIN_TIMEOUT, async {
        loop {
            match socket.recv().await {
                Some(Ok(Message::Text(text))) => return Ok(text),
                Some(Ok(Message::Ping(_) | Message::Pong(_))) => {}
                Some(Ok(Message::Binary(_))) => {
                    return Err(ApiError::bad_request(
                        "broadcast messages are JSON text frames",
                    ));
                }
                Some(Ok(Message::Close(_))) | None => {
                    return Err(ApiError::bad_request("closed before joining"));
                }
                Some(Err(e)) => return Err(ApiError::bad_request(format!("connection: {e}"))),
            }
        }
    })
    .await
    .map_err(|_| {
        ApiError::bad_request(format!(
            "no join within {} s of connecting",
            JOIN_TIMEOUT.as_secs()
        ))
    })??;
    match serde_json::from_str::<GetterMessage>(&text) {
        Ok(GetterMessage::Join(req)) => Ok(req),
        Ok(_) => Err(ApiError::bad_request(
            "the first message on a broadcast connection must be a join",
        )),
        Err(e) => Err(ApiError::bad_request(format!(
            "invalid broadcast message: {e}"
        ))),
    }
}

/// Sends `e` as an error message, then closes.
async fn refuse(socket: &mut WebSocket, e: ApiError) {
    let msg = GroupMessage::Error {
        code: e.code,
        message: e.message,
    };
    if send_message(socket, &msg).await.is_ok() {
        let _ = socket
            .send(Message::Close(Some(CloseFrame {
                code: close_code::NORMAL,
                reason: "".into(),
            })))
            .await;
    }
}

async fn send_message(socket: &mut WebSocket, msg: &GroupMessage) -> Result<(), axum::Error> {
    let text = serde_json::to_string(msg).map_err(axum::Error::new)?;
    socket.send(Message::Text(text.into())).await
}

/// Refuses a URL `who` may not advertise (a pod-bound token: only on its
/// pod's IP): members are sent to it.
fn may_advertise(who: &kt_types::auth::Principal, field: &str, url: &str) -> Result<(), ApiError> {
    if who.may_advertise(url) {
        return Ok(());
    }
    Err(kt_service::forbidden(format!(
        "this pod's token may advertise its own IP only, not {url:?} ({field})"
    )))
}

/// Admits a getter: resolves the key's origin and version, joins it to its
/// group (committing the group's record first when it changed), queues its
/// `Assigned` and registers its queue. A reservation of ranks ahead is
/// committed in the background.
async fn admit(
    s: &AppState,
    who: &kt_types::auth::Principal,
    req: &JoinRequest,
    tx: mpsc::UnboundedSender<GroupMessage>,
) -> Result<Membership, ApiError> {
    check_url("relay_url", &req.relay_url)?;
    // Children present the relay key to their parent, never their own
    // tokens: a member without one would have them sent its way.
    match &req.relay_key {
        None => {
            return Err(ApiError::bad_request(
                "a broadcast member needs a relay_key: its children present it, not their tokens",
            ));
        }
        Some(k) if k.len() < 16 || k.len() > 128 || !k.bytes().all(|b| b.is_ascii_graphic()) => {
            return Err(ApiError::bad_request(
                "relay_key is 16 to 128 printable characters without spaces",
            ));
        }
        Some(_) => {}
    }
    may_advertise(who, "relay_url", &req.relay_url)?;
    if let Some(url) = req.rejoin.as_ref().and_then(|rj| rj.served_by.as_ref()) {
        check_url("served_by", url)?;
        may_advertise(who, "served_by", url)?;
    }
    if let Some(getter) = &req.getter {
        check_agent_id(getter)?;
        // An agent's or pod's token speaks for its own agent only: the
        // capabilities minted for this member name the getter as source.
        if matches!(who.role, Role::Agent | Role::Pod) && !who.is_agent(getter) {
            return Err(kt_service::forbidden(format!(
                "this token may join a broadcast as its own agent only, not {getter:?}"
            )));
        }
    }
    let now = now_ms();
    let lease_req = LeaseRequest {
        exclude: Vec::new(),
        getter: req.getter.clone(),
    };
    // Its parents' relays trust the metadata server's word (the relay key):
    // only a getter that may read the key joins.
    let sources = readable_sources(s, who, &req.key, &lease_req, now).await?;
    // Rank 0: the origin, or the first live peer when the origin is gone.
    let origin = sources
        .candidates
        .iter()
        .find(|c| c.origin)
        .or_else(|| sources.candidates.first())
        .map(|c| Parent {
            rank: 0,
            url: c.source.url.clone(),
            id: c.source.id.clone(),
            key: None,
        })
        .ok_or_else(|| ApiError::internal("a key with sources yielded none"))?;

    let mut guard = lock_broadcasts(s);
    let b = &mut *guard;
    let mut joined: Joined = b.groups.join(
        req,
        origin,
        &sources.record.version,
        sources.record.size,
        now,
        &mut || uuid::Uuid::new_v4().as_u64_pair().0,
    )?;
    if let Some(record) = &joined.persist
        && let Err(e) = s.db.write(&Batch {
            put_groups: vec![record.clone()],
            ..Batch::default()
        })
    {
        let events = b.groups.undo_join(&joined, now);
        b.dispatch(&joined.group, events);
        return Err(db_err(e));
    }
    if joined.created {
        tracing::info!(group = %joined.group, key = %req.key, version = %joined.version, fanout = joined.fanout, "broadcast group started");
    }
    tracing::debug!(
        group = %joined.group,
        rank = joined.rank,
        parent = joined.parent.rank,
        rejoin = joined.rejoined,
        getter = ?req.getter,
        "broadcast member joined"
    );
    // Queued first, so it precedes every message the member gets.
    let _ = tx.send(joined.assigned());
    // A rejoin on a new connection drops the old one's queue, which ends it.
    b.senders
        .entry(joined.group.clone())
        .or_default()
        .insert(joined.rank, (joined.session, tx));
    let events = std::mem::take(&mut joined.events);
    b.dispatch(&joined.group, events);
    drop(guard);
    if let Some(record) = joined.reserve_ahead.take() {
        let s = s.clone();
        // Tracked (the token lives as long as the closure): the database is
        // not used after `run` returns.
        let tracked = s.sessions.token();
        kt_sync::task::spawn(move || {
            let _tracked = tracked;
            let written = s.db.write(&Batch {
                put_groups: vec![record.clone()],
                ..Batch::default()
            });
            let mut b = lock_broadcasts(&s);
            match written {
                Ok(()) => b.groups.reservation_committed(&record.id, record.reserved),
                Err(e) => {
                    tracing::warn!(group = %record.id, error = %e, "could not reserve broadcast ranks ahead; retried");
                    b.groups.reservation_failed(&record.id);
                }
            }
        });
    }
    let digest = (sources.record.version == joined.version)
        .then_some(sources.record.digest)
        .flatten();
    Ok(Membership {
        group: joined.group,
        rank: joined.rank,
        session: joined.session,
        key: req.key.clone(),
        version: joined.version,
        digest,
        getter: req
            .getter
            .clone()
            .or_else(|| who.name.clone())
            .unwrap_or_else(|| "workload".into()),
        who: who.clone(),
    })
}

/// Forwards the member's messages and handles its reports until the session ends.
async fn serve_member(
    s: &Inner,
    socket: &mut WebSocket,
    m: &Membership,
    rx: &mut mpsc::UnboundedReceiver<GroupMessage>,
) -> SessionEnd {
    let start = tokio::time::Instant::now() + PING_INTERVAL;
    let mut ping = tokio::time::interval_at(start, PING_INTERVAL);
    let mut heard = Instant::now();
    loop {
        tokio::select! {
            _ = s.shutdown.cancelled() => return SessionEnd::ShuttingDown,
            msg = rx.recv() => {
                let Some(msg) = msg else {
                    let e = ApiError::new(ErrorCode::Conflict, format!(
                        "rank {} of broadcast group {:?} rejoined on another connection",
                        m.rank, m.group
                    ));
                    refuse(socket, e).await;
                    return SessionEnd::Refused;
                };
                let last = matches!(msg, GroupMessage::Error { .. });
                if send_message(socket, &seal(s, m, msg)).await.is_err() {
                    return SessionEnd::Closed;
                }
                if last {
                    return SessionEnd::Refused;
                }
            }
            frame = socket.recv() => {
                heard = Instant::now();
                let report = match frame {
                    Some(Ok(Message::Text(text))) => on_report(s, m, &text),
                    Some(Ok(Message::Binary(_))) => Err(ApiError::bad_request(
                        "broadcast messages are JSON text frames",
                    )),
                    Some(Ok(Message::Ping(_) | Message::Pong(_))) => Ok(()),
                    Some(Ok(Message::Close(_))) | None => return SessionEnd::Closed,
                    Some(Err(e)) => {
                        tracing::debug!(group = %m.group, rank = m.rank, error = %e, "broadcast connection failed");
                        return SessionEnd::Closed;
                    }
                };
                if let Err(e) = report {
                    let msg = GroupMessage::Error { code: e.code, message: e.message };
                    let _ = send_message(socket, &msg).await;
                    return SessionEnd::Refused;
                }
            }
            _ = ping.tick() => {
                if heard.elapsed() >= MEMBER_SILENCE {
                    tracing::info!(group = %m.group, rank = m.rank, "broadcast member silent; closing");
                    return SessionEnd::Silent;
                }
                if socket.send(Message::Ping(axum::body::Bytes::new())).await.is_err() {
                    return SessionEnd::Closed;
                }
            }
        }
    }
}

/// `msg` as `m` gets it: its parent's capability (for a parent that is an
/// agent: a relay's key is already set, the store takes the member's
/// token) and, in `Assigned`, the digest its manifests must have.
fn seal(s: &Inner, m: &Membership, mut msg: GroupMessage) -> GroupMessage {
    let seal_parent = |p: &mut Parent| {
        if p.key.is_none() && p.id != kt_types::STORE_HOLDER && !p.url.is_empty() {
            // The origin is named by its agent id; a finished member is
            // served by its own agent, the one it joined with.
            let agent = match p.rank {
                0 => Some(p.id.clone()),
                r => lock_broadcasts(s).groups.agent_of(&m.group, r),
            };
            if let Some(id) = agent {
                let source = kt_types::Source {
                    id,
                    url: p.url.clone(),
                    version: m.version.clone(),
                };
                p.key = s.capability_for(&m.key, &source, Some(&m.getter), now_ms());
            }
        }
    };
    match &mut msg {
        GroupMessage::Assigned { parent, digest, .. } => {
            seal_parent(parent);
            *digest = m.digest;
        }
        GroupMessage::Parent { parent } => seal_parent(parent),
        GroupMessage::Release | GroupMessage::Error { .. } => {}
    }
    msg
}

/// A report of the member: `Done` or `ParentFailed`.
fn on_report(s: &Inner, m: &Membership, text: &str) -> Result<(), ApiError> {
    let msg = serde_json::from_str::<GetterMessage>(text)
        .map_err(|e| ApiError::bad_request(format!("invalid broadcast message: {e}")))?;
    let now = now_ms();
    // Computed and queued under one lock, so that members get messages in
    // the order the state changed.
    let mut b = lock_broadcasts(s);
    let events = match msg {
        GetterMessage::Done { served_by } => {
            if let Some(url) = &served_by {
                check_url("served_by", url)?;
                // Its children are sent there: on the member's pod only.
                may_advertise(&m.who, "served_by", url)?;
            }
            tracing::debug!(group = %m.group, rank = m.rank, ?served_by, "broadcast member done");
            b.groups.done(&m.group, m.rank, m.session, served_by, now)
        }
        GetterMessage::ParentFailed {
            parent,
            reason,
            transient,
        } => {
            tracing::info!(group = %m.group, rank = m.rank, parent, transient, %reason, "a broadcast parent failed a member");
            let failure = crate::broadcast::ParentFailure { parent, transient };
            b.groups
                .parent_failed(&m.group, m.rank, m.session, failure, now)
        }
        GetterMessage::Join(_) => {
            return Err(ApiError::bad_request(
                "this connection already joined; one join per connection",
            ));
        }
    };
    b.dispatch(&m.group, events);
    Ok(())
}

/// The member's connection ended: it leaves (unless a rejoin took its place).
fn leave(s: &Inner, m: &Membership) {
    let mut guard = lock_broadcasts(s);
    let b = &mut *guard;
    if let Some(ranks) = b.senders.get_mut(&m.group) {
        if ranks
            .get(&m.rank)
            .is_some_and(|(session, _)| *session == m.session)
        {
            ranks.remove(&m.rank);
        }
        if ranks.is_empty() {
            b.senders.remove(&m.group);
        }
    }
    if s.shutdown.is_cancelled() {
        // Every member leaves with the server; they rejoin the next one.
        return;
    }
    let events = b.groups.disconnected(&m.group, m.rank, m.session, now_ms());
    b.dispatch(&m.group, events);
}

/// Releases, drops ended groups and forgets their records.
pub(super) fn sweep_broadcasts(s: &Inner, now: u64) {
    let forget = {
        let mut guard = lock_broadcasts(s);
        let b = &mut *guard;
        let swept = b.groups.sweep(now);
        for (group, events) in swept.events {
            b.dispatch(&group, events);
        }
        for id in &swept.dropped {
            b.senders.remove(id);
            tracing::debug!(group = %id, "broadcast group ended");
        }
        swept.forget
    };
    if forget.is_empty() {
        return;
    }
    let batch = Batch {
        remove_groups: forget,
        ..Batch::default()
    };
    if let Err(e) = s.db.write(&batch) {
        tracing::warn!(error = %e, "could not forget ended broadcast groups; retried at the next start");
    }
}
