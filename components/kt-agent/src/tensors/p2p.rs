//! Point to point: a getter's agent looks each key's holder up at the
//! metadata server, with a capability to read it there (a tensor grant),
//! and opens one session per source (`POST /api/v1/tensors/sessions`,
//! several keys in one, each with its capability: the source is a peer, and
//! is never shown this agent's bearer token); the source checks
//! the destination layouts, answers a plan of two ranks (itself rank 0) and
//! both run it. A key held by this agent is copied locally. A broadcast get
//! joins a quorum instead.

use std::collections::HashSet;
use std::sync::Arc;

use kt_service::ApiError;
use kt_tensor::engine::{Lent, Many};
use kt_tensor::{Backend, Link};
use kt_types::tensor::{
    self as t, BackendKind, Device, Flow, FromPutters, GetTensors, Packing, QuorumKey, QuorumRole,
    Rank, SessionReply, SessionRequest, TensorEntry, TensorGet, TensorStats, TransferPlan,
};
use kt_types::{ErrorCode, Key, paths};

use super::{Owner, Tensors, blocking, comms, internal, locked, transport};
use tokio_util::sync::CancellationToken;

/// Checks a get of a key from several putters (`from`, `more`): only in a
/// quorum, as many destination sets as asked for, each of `dest`'s layout,
/// a reduction defined for its dtypes.
fn check_many(g: &TensorGet, broadcast: bool) -> Result<(), ApiError> {
    let Some(from) = &g.from else {
        if g.more.is_empty() {
            return Ok(());
        }
        return Err(ApiError::bad_request(format!(
            "{}: several destination sets need `from` (every putter's, or some by rank)",
            g.key
        )));
    };
    if !broadcast {
        return Err(ApiError::bad_request(format!(
            "{}: several putters' tensors (every one, by rank, or reduced) come from a quorum; \
             give a broadcast window",
            g.key
        )));
    }
    let layout = t::describe(&g.dest);
    from.check(&g.key, &layout).map_err(ApiError::bad_request)?;
    if from.sets() != 1 + g.more.len() {
        return Err(ApiError::bad_request(format!(
            "{}: {} destination sets lent, {} asked for",
            g.key,
            1 + g.more.len(),
            from.sets()
        )));
    }
    for (i, set) in g.more.iter().enumerate() {
        t::validate_entries(set).map_err(|m| {
            ApiError::bad_request(format!("destination set {} of {}: {m}", i + 2, g.key))
        })?;
        t::check_destination(&g.key, &layout, &t::describe(set)).map_err(|m| {
            ApiError::bad_request(format!(
                "destination set {} differs from the first (every putter brings one layout): {m}",
                i + 2
            ))
        })?;
    }
    Ok(())
}

impl Tensors {
    /// Receives `req`'s keys into the memory the caller lent; a broadcast
    /// get waits for its quorum only while the caller is there (`gone`).
    pub async fn get(
        &self,
        owner: &Owner,
        req: GetTensors,
        gone: &CancellationToken,
    ) -> Result<TensorStats, ApiError> {
        if req.gets.is_empty() {
            return Err(ApiError::bad_request("no keys to get"));
        }
        let mut seen = HashSet::new();
        for g in &req.gets {
            if !seen.insert(&g.key) {
                return Err(ApiError::bad_request(format!("{} asked twice", g.key)));
            }
            t::validate_entries(&g.dest)
                .map_err(|m| ApiError::bad_request(format!("destination of {}: {m}", g.key)))?;
            check_many(g, req.broadcast.is_some())?;
        }
        let device = req.gets[0].dest[0].device;
        let all_dests = || {
            req.gets
                .iter()
                .flat_map(|g| g.dest.iter().chain(g.more.iter().flatten()))
        };
        if let Some(e) = all_dests().find(|e| e.device != device) {
            return Err(ApiError::bad_request(format!(
                "destination tensor {:?} is on {}, the first on {device}: one get moves to one device",
                e.name, e.device
            )));
        }
        let backend = self.backend(device)?;
        // What the agent opens of CUDA destinations stays open after the get
        // only when asked (`keep_mapped`); otherwise it is closed as the get
        // ends, however it ends (`_in_use` is dropped).
        let cuda = matches!(device, Device::Cuda(_));
        let _in_use = if cuda && req.keep_mapped {
            self.keep_dests(owner, all_dests());
            None
        } else {
            cuda.then(|| self.borrow_dests(all_dests()))
        };
        if let Some(window) = &req.broadcast {
            if window.group_id.is_none() && req.gets.len() > 1 {
                // Each putter joins its own key's group: a getter of several
                // keys can only meet them all in one group they name.
                return Err(ApiError::bad_request(format!(
                    "a broadcast get of {} keys needs a group id (every putter and getter names the same one)",
                    req.gets.len()
                )));
            }
            let member = super::quorum::member_id(owner, req.member.as_deref())?;
            let mut lent = Lent::new(device);
            let mut keys = Vec::new();
            for g in &req.gets {
                let dest = Self::map(backend.clone(), g.dest.clone()).await?;
                match &g.from {
                    None => {
                        lent.keys.insert(g.key.clone(), dest);
                    }
                    Some(FromPutters::Reduce { op }) => {
                        lent.keys.insert(g.key.clone(), dest);
                        lent.many.insert(g.key.clone(), Many::Reduce(*op));
                    }
                    Some(from) => {
                        let mut sets = vec![dest];
                        for more in &g.more {
                            sets.push(Self::map(backend.clone(), more.clone()).await?);
                        }
                        let many = match from {
                            FromPutters::ByRank { ranks } => {
                                Many::ByRank(ranks.iter().copied().zip(sets).collect())
                            }
                            _ => Many::Each(sets),
                        };
                        lent.many.insert(g.key.clone(), many);
                    }
                }
                keys.push(QuorumKey {
                    from: g.from.clone(),
                    key: g.key.clone(),
                    version: String::new(),
                    tensors: t::describe(&g.dest),
                });
            }
            let first = req.gets[0].key.clone();
            // Boxed: the quorum's future is large.
            let quorum = self.quorum(
                &first,
                member,
                QuorumRole::Get { keys },
                window,
                backend,
                lent,
                gone,
            );
            return Box::pin(quorum).await;
        }
        let packing = req.packing.unwrap_or(Packing {
            pack: true,
            ..Packing::default()
        });
        packing.validate().map_err(ApiError::bad_request)?;
        // Batched per source: one session per holder.
        let mut by_source: Vec<Session> = Vec::new();
        let mut total = TensorStats {
            backend: Some(backend.kind()),
            ..TensorStats::default()
        };
        for g in req.gets {
            // The record, and what this agent shows its holder: the
            // metadata server checked that this agent's token reads it.
            let grant = self.metadata.tensor_grant(&g.key, &self.id).await?;
            let record = grant.record;
            let want = QuorumKey {
                from: None,
                key: g.key.clone(),
                version: record.version.clone(),
                tensors: t::describe(&g.dest),
            };
            if record.holder == self.id {
                add(&mut total, self.copy_local(&backend, want, g.dest).await?);
                continue;
            }
            let capability = grant.capability.ok_or_else(|| {
                internal(format!(
                    "the metadata server gave no capability for {} at {}",
                    g.key, record.holder
                ))
            })?;
            let wanted = Wanted {
                want,
                dest: g.dest,
                capability,
            };
            match by_source
                .iter_mut()
                .find(|s| s.holder == record.holder && s.source == record.source)
            {
                Some(s) => s.keys.push(wanted),
                None => by_source.push(Session {
                    holder: record.holder,
                    source: record.source,
                    keys: vec![wanted],
                }),
            }
        }
        // Reused: every session ran on a kept communicator.
        total.reused = !by_source.is_empty();
        for session in by_source {
            let s = self
                .fetch(session, backend.clone(), device, packing)
                .await?;
            total.reused &= s.reused;
            add(&mut total, s);
        }
        Ok(total)
    }

    /// A key this agent holds: copied from the producer's memory.
    async fn copy_local(
        &self,
        backend: &Arc<dyn Backend>,
        want: QuorumKey,
        dest: Vec<TensorEntry>,
    ) -> Result<TensorStats, ApiError> {
        let src = {
            let regs = self.lock();
            let r = regs
                .get(&want.key)
                .ok_or_else(|| gone(&want.key, &self.id))?;
            t::check_destination(&want.key, &r.descs(), &want.tensors)
                .map_err(ApiError::bad_request)?;
            r.entries.clone()
        };
        let started = std::time::Instant::now();
        let n = src.len() as u64;
        let bytes: u64 = src.iter().map(|e| e.mem.len()).sum();
        let from = Self::map(backend.clone(), src).await?;
        let mut to = Self::map(backend.clone(), dest).await?;
        let b = backend.clone();
        blocking(move || {
            for (s, d) in from.iter().zip(to.iter_mut()) {
                b.copy(&mut **d, 0, &**s, 0, s.len()).map_err(transport)?;
            }
            Ok(())
        })
        .await?;
        Ok(TensorStats {
            tensors: n,
            bytes,
            collectives: 0,
            seconds: started.elapsed().as_secs_f64(),
            backend: Some(backend.kind()),
            ..TensorStats::default()
        })
    }

    /// Getter's side of a point-to-point session with a holder's agent.
    async fn fetch(
        &self,
        session: Session,
        backend: Arc<dyn Backend>,
        device: Device,
        packing: Packing,
    ) -> Result<TensorStats, ApiError> {
        let Session { source, keys, .. } = session;
        let source = source.as_str();
        let ip = self.ip()?;
        // The destination is mapped before the source is asked: a handle
        // that does not open fails here, before the source has started its
        // side (and NCCL its bootstrap) for nothing.
        let mut lent = Lent::new(device);
        for w in &keys {
            let regions = Self::map(backend.clone(), w.dest.clone()).await?;
            lent.keys.insert(w.want.key.clone(), regions);
        }
        // Kept communicators are keyed by the GPU the memory is on (the
        // agent's numbering, found by UUID), not the application's number:
        // two processes that each see their own GPU as cuda:0 must not get
        // each other's communicator.
        let comm_device = lent.memory_device();
        let b = backend.clone();
        let endpoint = blocking(move || b.endpoint("p2p", &ip).map_err(transport)).await?;
        // NCCL communicators kept from earlier sessions with this source.
        let pair = comms::pair(source);
        let reserved =
            (backend.kind() == BackendKind::Nccl).then(|| self.comms.reserve(&pair, comm_device));
        let capabilities: Vec<String> = keys.iter().map(|w| w.capability.clone()).collect();
        let req = SessionRequest {
            keys: keys.iter().map(|w| w.want.clone()).collect(),
            agent: self.id.clone(),
            ip: self.ip()?,
            endpoint: endpoint.address(),
            backend: backend.kind(),
            packing,
            comms: reserved
                .as_ref()
                .map(|r| r.held.clone())
                .unwrap_or_default(),
            // The first is shown as the bearer, the rest travel here.
            capabilities: capabilities.clone(),
        };
        let reply = self.open_at(source, &capabilities[0], &req).await?;
        let plan = reply.plan;
        plan.validate()
            .map_err(|m| internal(format!("session plan from {source}: {m}")))?;
        for Wanted { want, .. } in &keys {
            let flow = plan
                .flows
                .iter()
                .find(|f| f.key == want.key)
                .ok_or_else(|| internal(format!("{source} sent a plan without {}", want.key)))?;
            t::check_destination(&want.key, &flow.tensors, &want.tensors)
                .map_err(ApiError::bad_request)?;
        }
        let kept = match (&reply.reuse, &reserved) {
            (None, _) => None,
            (Some(id), r) => Some(r.as_ref().and_then(|r| r.take(id)).ok_or_else(|| {
                internal(format!(
                    "{source} answered communicator {id}, which this agent did not offer"
                ))
            })?),
        };
        drop(reserved);
        let (timeout, b, p) = (self.timeout, backend.clone(), plan.clone());
        let (res, back) = blocking(move || {
            let link = match kept {
                Some(c) => Link::Reuse(c),
                None => Link::Connect {
                    endpoint,
                    rendezvous: reply.rendezvous.as_deref(),
                },
            };
            Ok(kt_tensor::transfer_on(&*b, &p, 1, link, lent, timeout))
        })
        .await?;
        if let Some(comm) = back
            && backend.kind() == BackendKind::Nccl
        {
            Self::retire(&backend, self.comms.keep(&pair, comm_device, &plan, comm));
        }
        res.map_err(transport)
    }

    /// `POST /api/v1/tensors/sessions` at `source`, showing `capability`
    /// (never this agent's token). Tried again for a moment while the
    /// source answers `unavailable`: one that has just started learns the
    /// metadata server's signing keys with its first heartbeat, and nothing
    /// of a session refused so has started.
    async fn open_at(
        &self,
        source: &str,
        capability: &str,
        req: &SessionRequest,
    ) -> Result<SessionReply, ApiError> {
        let api = kt_api::Api::new(self.peers.clone(), source, capability);
        let mut backoff = kt_api::Backoff::new(
            std::time::Duration::from_millis(50),
            std::time::Duration::from_secs(1),
        );
        let mut tries = 0;
        loop {
            match api.post(&paths::tensor_sessions()).json(req).fetch().await {
                Err(e) if e.server_away() && tries < SESSION_RETRIES => {
                    tries += 1;
                    backoff.wait().await;
                }
                res => return res.map_err(|e| agent_err(e, source)),
            }
        }
    }

    /// Source's side: checks the request, answers the plan, runs rank 0.
    pub async fn open_session(&self, req: SessionRequest) -> Result<SessionReply, ApiError> {
        if req.keys.is_empty() || req.keys.len() > 4096 {
            return Err(ApiError::bad_request("a session moves 1 to 4096 keys"));
        }
        req.ip
            .parse::<std::net::IpAddr>()
            .map_err(|_| ApiError::bad_request(format!("getter ip {:?} is not an IP", req.ip)))?;
        req.packing.validate().map_err(ApiError::bad_request)?;
        if req.comms.len() > t::MAX_HELD_COMMS {
            return Err(ApiError::bad_request(format!(
                "a session offers at most {} communicators, got {}",
                t::MAX_HELD_COMMS,
                req.comms.len()
            )));
        }
        let mut sets = Vec::new();
        {
            let conns = locked(&self.conns).clone();
            let regs = self.lock();
            for want in &req.keys {
                let r = regs
                    .get(&want.key)
                    .filter(|r| r.owner.alive(&conns))
                    .ok_or_else(|| gone(&want.key, &self.id))?;
                if !want.version.is_empty() && want.version != r.version {
                    return Err(ApiError::new(
                        ErrorCode::Conflict,
                        format!(
                            "{} is at version {} here, not {} (put again meanwhile)",
                            want.key, r.version, want.version
                        ),
                    ));
                }
                t::check_destination(&want.key, &r.descs(), &want.tensors)
                    .map_err(ApiError::bad_request)?;
                sets.push(r.clone());
            }
        }
        let device = sets[0].device();
        let backend = self.backend(device)?;
        if backend.kind() != req.backend {
            return Err(ApiError::bad_request(format!(
                "the tensors are on {device} ({} backend); the getter asked for {}",
                backend.kind(),
                req.backend
            )));
        }
        if let Some(s) = sets.iter().find(|s| s.device() != device) {
            return Err(ApiError::bad_request(format!(
                "{} is on {}, {} on {device}: get them separately",
                s.key,
                s.device(),
                sets[0].key
            )));
        }
        let ip = self.ip()?;
        let id = uuid::Uuid::new_v4().to_string();
        let b = backend.clone();
        let (ip2, id2) = (ip.clone(), id.clone());
        let endpoint = blocking(move || b.endpoint(&id2, &ip2).map_err(transport)).await?;
        let plan = TransferPlan {
            id,
            backend: backend.kind(),
            ranks: vec![
                Rank {
                    rank: 0,
                    agent: self.id.clone(),
                    member: String::new(),
                    node: String::new(),
                    ip,
                    endpoint: endpoint.address(),
                },
                Rank {
                    rank: 1,
                    agent: req.agent.clone(),
                    member: String::new(),
                    node: String::new(),
                    ip: req.ip.clone(),
                    endpoint: req.endpoint.clone(),
                },
            ],
            flows: sets
                .iter()
                .map(|r| Flow {
                    key: r.key.clone(),
                    version: r.version.clone(),
                    root: 0,
                    receivers: vec![1],
                    tensors: r.descs(),
                })
                .collect(),
            packing: req.packing,
            fanout: 1,
        };
        plan.validate().map_err(internal)?;
        // The source's memory is mapped before the rendezvous: NCCL's
        // unique id starts a bootstrap root, which must not wait for a
        // transfer that a handle failing to open has already ended.
        let mut lent = Lent::new(device);
        for r in &sets {
            lent.keys.insert(
                r.key.clone(),
                Self::map(backend.clone(), r.entries.clone()).await?,
            );
        }
        // A communicator this agent keeps with the getter and the getter
        // offered (both reserved it): no rendezvous.
        let pair = comms::pair(&req.agent);
        // By the GPU the memory is on, as the getter keys its side.
        let comm_device = lent.memory_device();
        let kept = if backend.kind() == BackendKind::Nccl {
            // The getter may offer the communicator of the session that just
            // ended on its side and is still ending on this one.
            let offered: Vec<&str> = req.comms.iter().map(|c| c.id.as_str()).collect();
            self.comms.settled(&offered, SETTLE_WAIT).await;
            let mine = self.comms.reserve(&pair, comm_device);
            req.comms
                .iter()
                .filter(|c| c.fits(&plan))
                .find_map(|c| mine.take(&c.id).map(|comm| (c.id.clone(), comm)))
        } else {
            None
        };
        let (reuse, kept) = match kept {
            Some((id, comm)) => (Some(id), Some(comm)),
            None => (None, None),
        };
        let rendezvous = if kept.is_some() {
            None
        } else {
            let b = backend.clone();
            let p = plan.clone();
            blocking(move || b.rendezvous(&p).map_err(transport)).await?
        };
        let (p, rv, timeout, getter) = (plan.clone(), rendezvous.clone(), self.timeout, req.agent);
        let comms = self.comms.clone();
        comms.expect(&plan.id);
        tokio::spawn(async move {
            let b = backend.clone();
            let p2 = p.clone();
            let res = blocking(move || {
                let link = match kept {
                    Some(c) => Link::Reuse(c),
                    None => Link::Connect {
                        endpoint,
                        rendezvous: rv.as_deref(),
                    },
                };
                Ok(kt_tensor::transfer_on(&*b, &p2, 0, link, lent, timeout))
            })
            .await
            .and_then(|(res, back)| {
                if let Some(comm) = back
                    && backend.kind() == BackendKind::Nccl
                {
                    Tensors::retire(&backend, comms.keep(&pair, comm_device, &p, comm));
                }
                res.map_err(transport)
            });
            comms.settle(&p.id);
            match res {
                Ok(s) => tracing::info!(
                    getter,
                    bytes = s.bytes,
                    tensors = s.tensors,
                    seconds = s.seconds,
                    "tensors sent"
                ),
                Err(e) => tracing::warn!(getter, error = %e.message, "sending tensors failed"),
            }
        });
        Ok(SessionReply {
            plan,
            rendezvous,
            reuse,
        })
    }
}

/// How long a source waits for the session a getter's offered
/// communicator comes from to end on its side.
const SETTLE_WAIT: std::time::Duration = std::time::Duration::from_secs(2);

/// How many more times a getter asks a source that answers `unavailable`
/// (with backoff from 50 ms to 1 s: a few seconds, a heartbeat or two).
const SESSION_RETRIES: u32 = 6;

/// A key a getter wants (with its destination layout), the memory it
/// lends, and the capability it shows the key's holder.
struct Wanted {
    want: QuorumKey,
    dest: Vec<TensorEntry>,
    capability: String,
}

/// The keys one session moves: those of one holder (its agent id, which
/// the capabilities name, and its URL).
struct Session {
    holder: String,
    source: String,
    keys: Vec<Wanted>,
}

fn add(total: &mut TensorStats, s: TensorStats) {
    total.tensors += s.tensors;
    total.bytes += s.bytes;
    total.collectives += s.collectives;
    total.seconds += s.seconds;
}

fn gone(key: &Key, agent: &str) -> ApiError {
    ApiError::new(
        ErrorCode::NoSource,
        format!(
            "{key} is not registered at agent {agent} any more: the process that put it exited or dropped it"
        ),
    )
}

/// A failed call to the agent holding the tensors, as this agent answers
/// it on ([`ApiError::from_call`]): unreachable is `no_source` (another
/// holder may have it), its own answer keeps its code.
fn agent_err(e: kt_api::CallError, source: &str) -> ApiError {
    let holder = format!("the agent holding the tensors ({source})");
    ApiError::from_call(e, &holder, ErrorCode::NoSource)
}
