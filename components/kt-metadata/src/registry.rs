//! The registry as a plain state machine: keys, the node agents that serve
//! them, and which agents are peers of which keys. No I/O, no clock (callers
//! pass `now`).
//!
//! A key has one origin (its `holder`: the store, or the producer pod's agent)
//! and any number of peers (agents that downloaded its current version).
//! An agent is live while its last heartbeat is younger than the agent TTL;
//! only live agents are offered as sources, and stale ones are evicted by
//! [`Registry::evict_stale`].
//!
//! Ownership and lifespans follow the base path: a key whose first segment
//! names a service the registry knows ([`Registry::know_services`]: one an
//! agent announced, a token acted within, a put claimed for its own base
//! path, or the tokens file grants) belongs to that service. A put that
//! names no lifespan gets `resource` there and for zero-copy data,
//! `cluster` elsewhere; a zero-copy `resource` key whose holder is gone and
//! that no live peer holds is stale ([`Registry::is_stale`]): neither
//! listed nor served.

use std::collections::{BTreeMap, BTreeSet};

use kt_types::api::{AgentHeartbeat, AgentInfo, LeaseRequest, ListEntry, RegisterIf, RegisterKey};
use kt_types::{Key, KeyPrefix, KeyRecord, Lifespan, Locale, STORE_HOLDER, Source};

use crate::leases::Candidate;

/// How long an agent stays live after a heartbeat, unless configured.
pub const DEFAULT_AGENT_TTL_MS: u64 = 10_000;

/// Why no source can be offered for a key.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SourceError {
    #[error("key {0} not found")]
    UnknownKey(Key),
    #[error("key {key} has no live source: {reason}")]
    NoSource { key: Key, reason: String },
    #[error(
        "key {0} holds tensors, served from its producer's memory: receive it with get_tensor (kt tensor get), not as files"
    )]
    Tensors(Key),
    #[error(
        "key {key} is stale: its holder pod {holder} is gone and no live peer holds it (zero-copy data of lifespan resource; put it with lifespan=cluster to keep it listed)"
    )]
    Stale { key: Key, holder: String },
}

#[derive(Debug, Clone)]
struct Agent {
    info: AgentInfo,
    /// Keys whose `peers` name this agent, kept in step with the records.
    peer_of: BTreeSet<Key>,
}

/// What a heartbeat changed.
#[derive(Debug, Default, Clone, PartialEq)]
pub struct Beat {
    /// Served keys without a live record, whose current version is another,
    /// or that the agent may not read.
    pub drop: Vec<Key>,
    /// Records whose peers or origin URL changed (to persist).
    pub changed: Vec<KeyRecord>,
    /// The agent's entry when it is new or its URL or service changed (to persist).
    pub agent: Option<AgentInfo>,
}

/// What an eviction changed.
#[derive(Debug, Default, Clone, PartialEq)]
pub struct Eviction {
    /// Agents removed, by id.
    pub agents: Vec<String>,
    /// Records that lost a peer (to persist).
    pub changed: Vec<KeyRecord>,
}

/// The sources of one key that a getter may be handed.
#[derive(Debug, Clone, PartialEq)]
pub struct Sources {
    pub record: KeyRecord,
    pub candidates: Vec<Candidate>,
}

#[derive(Debug, Clone)]
pub struct Registry {
    keys: BTreeMap<Key, KeyRecord>,
    agents: BTreeMap<String, Agent>,
    agent_ttl_ms: u64,
    /// Agents of torn-down services: their heartbeats are told to drop
    /// everything and never make them sources again (until they register a
    /// local put themselves). In memory: a restart forgets them.
    retired: BTreeSet<String>,
    /// Keys deleted within [`TOMBSTONE_MS`], with when: a conditional
    /// registration ([`RegisterIf::AbsentOrHeld`]) does not bring them back.
    /// In memory, at most [`MAX_TOMBSTONES`].
    tombstones: BTreeMap<Key, u64>,
    /// Services known to exist: a key under one's base path is its own.
    /// Persisted; never forgotten (a torn-down service keeps its name).
    services: BTreeSet<String>,
}

/// How long a deleted key refuses conditional registrations.
pub const TOMBSTONE_MS: u64 = 60 * 60 * 1000;
/// Most deletions remembered; past it the oldest are forgotten first.
pub const MAX_TOMBSTONES: usize = 100_000;

/// Why a conditional registration was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Refused {
    #[error("{key} was deleted since; not registered again")]
    Deleted { key: Key },
    #[error("{key} is now held by {holder} at version {version}; not replaced")]
    HeldElsewhere {
        key: Key,
        holder: String,
        version: String,
    },
}

impl Default for Registry {
    fn default() -> Self {
        Self::new(DEFAULT_AGENT_TTL_MS)
    }
}

impl Registry {
    pub fn new(agent_ttl_ms: u64) -> Self {
        Registry {
            keys: BTreeMap::new(),
            agents: BTreeMap::new(),
            agent_ttl_ms,
            retired: BTreeSet::new(),
            tombstones: BTreeMap::new(),
            services: BTreeSet::new(),
        }
    }

    /// Rebuilds the registry from what the database held. Every agent is
    /// treated as seen at `now_ms` (a full TTL to beat again); peers naming an
    /// agent the database does not hold are dropped.
    pub fn restore(
        agent_ttl_ms: u64,
        records: impl IntoIterator<Item = KeyRecord>,
        agents: impl IntoIterator<Item = AgentInfo>,
        services: impl IntoIterator<Item = String>,
        now_ms: u64,
    ) -> Self {
        let mut r = Self::new(agent_ttl_ms);
        r.services.extend(services);
        for mut info in agents {
            info.last_seen_ms = now_ms;
            r.agents.insert(
                info.id.clone(),
                Agent {
                    info,
                    peer_of: BTreeSet::new(),
                },
            );
        }
        for record in records {
            r.insert(record);
        }
        r
    }

    pub fn len(&self) -> usize {
        self.keys.len()
    }

    pub fn is_empty(&self) -> bool {
        self.keys.is_empty()
    }

    /// Records a published version; keeps the creation time of an existing key.
    pub fn upsert(&mut self, key: Key, reg: RegisterKey, now_ms: u64) -> KeyRecord {
        let record = self.record_for(key, reg, now_ms);
        self.insert(record.clone());
        record
    }

    /// Stores `record` as is, but for its peers: only known agents other than
    /// the holder, once each.
    pub fn insert(&mut self, mut record: KeyRecord) {
        self.retain_valid_peers(&mut record);
        self.tombstones.remove(&record.key);
        if let Some(old) = self.keys.remove(&record.key) {
            self.unindex(&old);
        }
        for p in &record.peers {
            if let Some(a) = self.agents.get_mut(&p.id) {
                a.peer_of.insert(record.key.clone());
            }
        }
        self.keys.insert(record.key.clone(), record);
    }

    fn retain_valid_peers(&self, record: &mut KeyRecord) {
        let mut seen = BTreeSet::new();
        let holder = &record.holder;
        record.peers.retain(|p| {
            &p.id != holder && self.agents.contains_key(&p.id) && seen.insert(p.id.clone())
        });
    }

    fn unindex(&mut self, r: &KeyRecord) {
        for p in &r.peers {
            if let Some(a) = self.agents.get_mut(&p.id) {
                a.peer_of.remove(&r.key);
            }
        }
    }

    /// The record a registration would produce, without applying it. A new
    /// version starts without peers (their copies no longer match); the same
    /// version registered again keeps them.
    pub fn record_for(&self, key: Key, reg: RegisterKey, now_ms: u64) -> KeyRecord {
        let existing = self.keys.get(&key);
        let created_at_ms = existing.map(|r| r.created_at_ms).unwrap_or(now_ms);
        // Peers hold the version's manifest: one that changed under the
        // same version id (a damaged re-registration) keeps none.
        let peers = existing
            .filter(|r| r.version == reg.version && r.digest == reg.digest)
            .map(|r| r.peers.clone())
            .unwrap_or_default();
        // Under a service's base path the key is that service's, whatever
        // the put said; elsewhere the put's service, else the first segment.
        let base = self.base_owner(&key).map(str::to_owned);
        let service = base
            .clone()
            .or_else(|| reg.options.service.clone())
            .unwrap_or_else(|| key.service().to_owned());
        let lifespan = reg.options.lifespan.unwrap_or({
            if base.is_some() || reg.locale == Locale::Local {
                Lifespan::Resource
            } else {
                Lifespan::Cluster
            }
        });
        let mut record = KeyRecord {
            locale: reg.locale,
            source: reg.source,
            holder: reg.holder.unwrap_or_else(|| STORE_HOLDER.to_owned()),
            peers,
            version: reg.version,
            is_dir: reg.is_dir,
            size: reg.size,
            files: reg.files,
            tensors: reg.tensors,
            digest: reg.digest,
            lifespan,
            lifespan_by_rule: reg.options.lifespan.is_none(),
            service,
            expires_at_ms: reg
                .options
                .ttl_secs
                .map(|t| now_ms.saturating_add(t.saturating_mul(1000))),
            created_at_ms,
            updated_at_ms: now_ms,
            key,
        };
        self.retain_valid_peers(&mut record);
        record
    }

    /// A live record: unexpired, and not stale ([`Registry::is_stale`]).
    pub fn get(&self, key: &Key, now_ms: u64) -> Option<&KeyRecord> {
        self.get_unexpired(key, now_ms)
            .filter(|r| !self.is_stale(r, now_ms))
    }

    /// The live record of `key`, or why there is none to serve.
    pub fn served(&self, key: &Key, now_ms: u64) -> Result<&KeyRecord, SourceError> {
        match self.get_unexpired(key, now_ms) {
            None => Err(SourceError::UnknownKey(key.clone())),
            Some(r) if self.is_stale(r, now_ms) => Err(SourceError::Stale {
                key: key.clone(),
                holder: r.holder.clone(),
            }),
            Some(r) => Ok(r),
        }
    }

    /// An unexpired record, stale or not (what `rm` deletes).
    pub fn get_unexpired(&self, key: &Key, now_ms: u64) -> Option<&KeyRecord> {
        self.keys.get(key).filter(|r| !is_expired(r, now_ms))
    }

    /// True for zero-copy data of lifespan `resource` whose holder (the
    /// producer pod's agent) is not live and that no live peer holds:
    /// nobody serves it, so it is neither listed nor handed out. It comes
    /// back if its holder beats again; its service's teardown deletes it.
    pub fn is_stale(&self, r: &KeyRecord, now_ms: u64) -> bool {
        r.holder != STORE_HOLDER
            && r.lifespan == Lifespan::Resource
            && !self.is_live(&r.holder, now_ms)
            && !r.peers.iter().any(|p| self.is_live(&p.id, now_ms))
    }

    /// Adds services to the known ones; those that were not known yet (to
    /// persist).
    pub fn know_services<'a>(&mut self, names: impl IntoIterator<Item = &'a str>) -> Vec<String> {
        names
            .into_iter()
            .filter(|n| self.services.insert((*n).to_owned()))
            .map(str::to_owned)
            .collect()
    }

    /// Whether `name` is a known service.
    pub fn is_service(&self, name: &str) -> bool {
        self.services.contains(name)
    }

    /// The service whose base path holds `key`: its first segment, when
    /// that names a known service.
    pub fn base_owner<'a>(&self, key: &'a Key) -> Option<&'a str> {
        Some(key.service()).filter(|s| self.is_service(s))
    }

    /// Who may write `key` besides admin: the service whose base path holds
    /// it (`true`), else the service of its unexpired record (`false`).
    pub fn owner(&self, key: &Key, now_ms: u64) -> Option<(String, bool)> {
        match self.base_owner(key) {
            Some(s) => Some((s.to_owned(), true)),
            None => self
                .get_unexpired(key, now_ms)
                .map(|r| (r.service.clone(), false)),
        }
    }

    /// A record, expired or not.
    pub fn get_any(&self, key: &Key) -> Option<&KeyRecord> {
        self.keys.get(key)
    }

    /// Removes a key's record, remembering the deletion for
    /// [`TOMBSTONE_MS`].
    pub fn remove(&mut self, key: &Key, now_ms: u64) -> Option<KeyRecord> {
        let r = self.keys.remove(key)?;
        self.unindex(&r);
        if self.tombstones.len() >= MAX_TOMBSTONES {
            self.forget_deletions(now_ms, MAX_TOMBSTONES / 10);
        }
        self.tombstones.insert(key.clone(), now_ms);
        Some(r)
    }

    /// Forgets deletions older than [`TOMBSTONE_MS`], then the oldest until
    /// `room` more fit under [`MAX_TOMBSTONES`].
    pub fn forget_deletions(&mut self, now_ms: u64, room: usize) {
        self.tombstones
            .retain(|_, at| now_ms.saturating_sub(*at) < TOMBSTONE_MS);
        let excess = (self.tombstones.len() + room).saturating_sub(MAX_TOMBSTONES);
        if excess > 0 {
            let mut times: Vec<u64> = self.tombstones.values().copied().collect();
            times.select_nth_unstable(excess - 1);
            let cut = times[excess - 1];
            self.tombstones.retain(|_, at| *at > cut);
        }
    }

    /// Checks a registration's condition against the key's record.
    pub fn admits(&self, key: &Key, reg: &RegisterKey, now_ms: u64) -> Result<(), Refused> {
        let Some(RegisterIf::AbsentOrHeld) = reg.only_if else {
            return Ok(());
        };
        let holder = reg.holder.as_deref().unwrap_or(STORE_HOLDER);
        match self.keys.get(key) {
            Some(r) if r.holder == holder => Ok(()),
            Some(r) => Err(Refused::HeldElsewhere {
                key: key.clone(),
                holder: r.holder.clone(),
                version: r.version.clone(),
            }),
            None if self
                .tombstones
                .get(key)
                .is_some_and(|at| now_ms.saturating_sub(*at) < TOMBSTONE_MS) =>
            {
                Err(Refused::Deleted { key: key.clone() })
            }
            None => Ok(()),
        }
    }

    /// Live keys equal to or below `prefix`.
    pub fn keys_within(&self, prefix: &KeyPrefix, now_ms: u64) -> Vec<KeyRecord> {
        let from: Box<dyn Iterator<Item = (&Key, &KeyRecord)>> = match Key::parse(prefix.as_str()) {
            Ok(start) => Box::new(self.keys.range(start..)),
            Err(_) => Box::new(self.keys.iter()),
        };
        from.take_while(|(k, _)| k.as_str().starts_with(prefix.as_str()))
            .filter(|(k, r)| k.is_within(prefix) && !is_expired(r, now_ms))
            .map(|(_, r)| r.clone())
            .collect()
    }

    /// True when live keys lie strictly below `key`.
    pub fn has_children(&self, key: &Key, now_ms: u64) -> bool {
        let p = KeyPrefix::from(key.clone());
        self.keys_within(&p, now_ms).iter().any(|r| &r.key != key)
    }

    /// Live keys within `prefix` that `visible` lets a caller see (those of
    /// the services its token reads).
    fn visible_within(
        &self,
        prefix: &KeyPrefix,
        now_ms: u64,
        visible: &dyn Fn(&KeyRecord) -> bool,
    ) -> Vec<KeyRecord> {
        let mut keys = self.keys_within(prefix, now_ms);
        keys.retain(|r| visible(r) && !self.is_stale(r, now_ms));
        keys
    }

    /// The immediate children of `prefix`: one entry per name, merged across
    /// keys, of the keys `visible` lets the caller see.
    pub fn list(
        &self,
        prefix: &KeyPrefix,
        now_ms: u64,
        visible: &dyn Fn(&KeyRecord) -> bool,
    ) -> Vec<ListEntry> {
        let mut out: BTreeMap<String, ListEntry> = BTreeMap::new();
        for r in self.visible_within(prefix, now_ms, visible) {
            let Some((name, deeper)) = prefix.child_of(&r.key) else {
                continue;
            };
            let full = if prefix.as_str().is_empty() {
                name.to_owned()
            } else {
                format!("{}/{name}", prefix.as_str())
            };
            let e = out.entry(name.to_owned()).or_insert_with(|| ListEntry {
                name: name.to_owned(),
                key: full,
                has_children: false,
                record: None,
            });
            if deeper {
                e.has_children = true;
            } else {
                e.record = Some(r.clone());
            }
        }
        if out.is_empty()
            && let Ok(key) = Key::parse(prefix.as_str())
            && let Some(r) = self.get(&key, now_ms).filter(|r| visible(r))
        {
            // Like `ls FILE`: a key with nothing below it lists itself.
            return vec![ListEntry {
                name: key.name().to_owned(),
                key: key.to_string(),
                has_children: false,
                record: Some(r.clone()),
            }];
        }
        out.into_values().collect()
    }

    /// Every key strictly below `prefix` (at any depth), named by its path
    /// below it: what a prefix get (`kt get team/run/`) fetches.
    pub fn list_below(
        &self,
        prefix: &KeyPrefix,
        now_ms: u64,
        visible: &dyn Fn(&KeyRecord) -> bool,
    ) -> Vec<ListEntry> {
        self.visible_within(prefix, now_ms, visible)
            .into_iter()
            .filter_map(|r| {
                let name = if prefix.as_str().is_empty() {
                    r.key.as_str()
                } else {
                    r.key
                        .as_str()
                        .strip_prefix(prefix.as_str())?
                        .strip_prefix('/')?
                };
                Some(ListEntry {
                    name: name.to_owned(),
                    key: r.key.to_string(),
                    has_children: self
                        .visible_within(&KeyPrefix::from(r.key.clone()), now_ms, visible)
                        .iter()
                        .any(|c| c.key != r.key),
                    record: Some(r.clone()),
                })
            })
            .collect()
    }

    /// Records whose TTL has passed.
    pub fn expired(&self, now_ms: u64) -> Vec<KeyRecord> {
        self.keys
            .values()
            .filter(|r| is_expired(r, now_ms))
            .cloned()
            .collect()
    }
}

/// Everything held, as the scrape-time gauges and `kt status` read it.
impl Registry {
    /// Every record, expired or not.
    pub fn all_records(&self) -> impl Iterator<Item = &KeyRecord> {
        self.keys.values()
    }

    /// Every agent known, live or not.
    pub fn known_agents(&self) -> impl Iterator<Item = &AgentInfo> {
        self.agents.values().map(|a| &a.info)
    }
}

/// Agents, peers and sources.
impl Registry {
    /// True while agent `id` has beaten (or registered a key) within the agent TTL.
    pub fn is_live(&self, id: &str, now_ms: u64) -> bool {
        self.live_agent(id, now_ms).is_some()
    }

    fn live_agent(&self, id: &str, now_ms: u64) -> Option<&AgentInfo> {
        self.agents
            .get(id)
            .map(|a| &a.info)
            .filter(|a| now_ms.saturating_sub(a.last_seen_ms) < self.agent_ttl_ms)
    }

    /// Live agents, by id.
    pub fn agents(&self, now_ms: u64) -> Vec<AgentInfo> {
        self.agents
            .keys()
            .filter_map(|id| self.live_agent(id, now_ms))
            .cloned()
            .collect()
    }

    /// Records that agent `id` is alive at `url` now; `service` replaces the
    /// known one when given. Returns the entry when it is new or its URL or
    /// service changed (what is persisted; `last_seen_ms` is not).
    pub fn touch_agent(
        &mut self,
        id: &str,
        url: &str,
        service: Option<&str>,
        now_ms: u64,
    ) -> Option<AgentInfo> {
        // A registration (a new local put) brings a retired agent back.
        self.retired.remove(id);
        let Some(agent) = self.agents.get_mut(id) else {
            let info = AgentInfo {
                id: id.to_owned(),
                url: url.to_owned(),
                service: service.map(str::to_owned),
                last_seen_ms: now_ms,
            };
            let agent = Agent {
                info: info.clone(),
                peer_of: BTreeSet::new(),
            };
            self.agents.insert(id.to_owned(), agent);
            return Some(info);
        };
        let info = &mut agent.info;
        info.last_seen_ms = info.last_seen_ms.max(now_ms);
        let mut changed = false;
        if info.url != url {
            info.url = url.to_owned();
            changed = true;
        }
        if let Some(s) = service
            && info.service.as_deref() != Some(s)
        {
            info.service = Some(s.to_owned());
            changed = true;
        }
        changed.then(|| info.clone())
    }

    /// Reconciles what an agent serves with the records: it becomes (or stays)
    /// a peer of every listed key whose current version it serves (unless it
    /// is that key's origin), stops being a peer of keys it no longer lists,
    /// and is told to drop listed keys that are gone or at another version.
    pub fn heartbeat(&mut self, hb: AgentHeartbeat, now_ms: u64) -> Beat {
        self.heartbeat_reading(hb, now_ms, |_, _| true)
    }

    /// [`Registry::heartbeat`] of an agent whose token reads only the
    /// services `may_read(key, service)` allows: it is a peer only of
    /// those keys (the others come back in [`Beat::drop`]); it stays the
    /// origin of what it holds.
    pub fn heartbeat_reading(
        &mut self,
        hb: AgentHeartbeat,
        now_ms: u64,
        may_read: impl Fn(&Key, &str) -> bool,
    ) -> Beat {
        if self.retired.contains(&hb.id) {
            // Torn down: serve nothing, be no source.
            return Beat {
                drop: hb.serves.into_iter().map(|s| s.key).collect(),
                changed: Vec::new(),
                agent: None,
            };
        }
        let agent = self.touch_agent(&hb.id, &hb.url, hb.service.as_deref(), now_ms);
        let mut drop = BTreeSet::new();
        let mut listed = BTreeSet::new();
        let mut changed = BTreeSet::new();
        for served in hb.serves {
            let Some(r) = self
                .keys
                .get_mut(&served.key)
                .filter(|r| !is_expired(r, now_ms) && r.version == served.version)
            else {
                drop.insert(served.key);
                continue;
            };
            if r.holder != hb.id && !may_read(&served.key, &r.service) {
                drop.insert(served.key);
                continue;
            }
            if r.holder == hb.id {
                // The origin: nothing to add, but follow it if its URL moved.
                if r.source != hb.url {
                    r.source.clone_from(&hb.url);
                    changed.insert(served.key);
                }
                continue;
            }
            let peer = Source {
                id: hb.id.clone(),
                url: hb.url.clone(),
                version: served.version,
            };
            match r.peers.iter_mut().find(|p| p.id == hb.id) {
                Some(p) if *p == peer => {}
                Some(p) => {
                    *p = peer;
                    changed.insert(served.key.clone());
                }
                None => {
                    // Sorted by id: listings and snapshots do not depend on
                    // the order agents beat in.
                    let at = r.peers.partition_point(|p| p.id < peer.id);
                    r.peers.insert(at, peer);
                    changed.insert(served.key.clone());
                }
            }
            listed.insert(served.key);
        }
        let was = match self.agents.get_mut(&hb.id) {
            Some(a) => std::mem::replace(&mut a.peer_of, listed.clone()),
            None => BTreeSet::new(),
        };
        for key in was.difference(&listed) {
            if let Some(r) = self.keys.get_mut(key) {
                r.peers.retain(|p| p.id != hb.id);
                changed.insert(key.clone());
            }
        }
        Beat {
            drop: drop.into_iter().collect(),
            changed: self.records(changed),
            agent,
        }
    }

    fn records(&self, keys: BTreeSet<Key>) -> Vec<KeyRecord> {
        keys.into_iter()
            .filter_map(|k| self.keys.get(&k).cloned())
            .collect()
    }

    /// Removes agents (and them as peers of every key). Keys they hold as
    /// origin keep their records, without a live origin.
    pub fn evict(&mut self, ids: &[String]) -> Eviction {
        let mut agents = Vec::new();
        let mut changed = BTreeSet::new();
        for id in ids {
            let Some(a) = self.agents.remove(id) else {
                continue;
            };
            for key in a.peer_of {
                if let Some(r) = self.keys.get_mut(&key) {
                    r.peers.retain(|p| &p.id != id);
                    changed.insert(key);
                }
            }
            agents.push(id.clone());
        }
        Eviction {
            agents,
            changed: self.records(changed),
        }
    }

    /// Evicts the agents of a torn-down service for good: their later
    /// heartbeats are answered with "drop everything".
    pub fn retire(&mut self, ids: &[String]) -> Eviction {
        self.retired.extend(ids.iter().cloned());
        self.evict(ids)
    }

    /// Evicts agents that have not beaten within the agent TTL.
    pub fn evict_stale(&mut self, now_ms: u64) -> Eviction {
        let stale: Vec<String> = self
            .agents
            .keys()
            .filter(|id| !self.is_live(id, now_ms))
            .cloned()
            .collect();
        self.evict(&stale)
    }

    /// Stops offering agent `id` as a peer of `key`; the changed record, if
    /// it was one.
    pub fn remove_peer(&mut self, key: &Key, id: &str) -> Option<KeyRecord> {
        let r = self.keys.get_mut(key)?;
        let before = r.peers.len();
        r.peers.retain(|p| p.id != id);
        if r.peers.len() == before {
            return None;
        }
        if let Some(a) = self.agents.get_mut(id) {
            a.peer_of.remove(key);
        }
        Some(r.clone())
    }

    /// The live sources of `key` that `req` accepts: its origin when live
    /// (the store when one is registered, or the holder's agent, also when
    /// the holder is the getter) unless excluded, and its live peers other
    /// than the getter and the excluded ones.
    pub fn sources(
        &self,
        key: &Key,
        req: &LeaseRequest,
        store_registered: bool,
        now_ms: u64,
    ) -> Result<Sources, SourceError> {
        let record = self.served(key, now_ms)?;
        if record.tensors.is_some() {
            return Err(SourceError::Tensors(key.clone()));
        }
        let refused = |id: &str| {
            if req.getter.as_deref() == Some(id) {
                Some("is the getter itself")
            } else if req.exclude.iter().any(|e| e == id) {
                Some("was excluded by the getter")
            } else {
                None
            }
        };
        let source = |id: &str, url: &str| Source {
            id: id.to_owned(),
            url: url.to_owned(),
            version: record.version.clone(),
        };
        let mut candidates = Vec::new();
        let origin = if record.holder == STORE_HOLDER {
            "the store".to_owned()
        } else {
            format!("pod {}", record.holder)
        };
        // The getter's own agent is never handed out as a peer, but it may
        // be the origin: a producer getting its own local key copies it
        // through its agent.
        let origin_why = if req.exclude.iter().any(|e| e == &record.holder) {
            Some(format!("its origin {origin} was excluded by the getter"))
        } else if record.holder == STORE_HOLDER {
            if store_registered {
                candidates.push(Candidate {
                    source: source(STORE_HOLDER, &record.source),
                    origin: true,
                });
                None
            } else {
                Some("no store is registered".to_owned())
            }
        } else if let Some(a) = self.live_agent(&record.holder, now_ms) {
            candidates.push(Candidate {
                source: source(&record.holder, &a.url),
                origin: true,
            });
            None
        } else {
            Some(format!("its origin {origin} is gone"))
        };
        let mut unusable = Vec::new();
        for p in &record.peers {
            if let Some(why) = refused(&p.id) {
                unusable.push(format!("{} {why}", p.id));
            } else if let Some(a) = self.live_agent(&p.id, now_ms) {
                candidates.push(Candidate {
                    source: source(&p.id, &a.url),
                    origin: false,
                });
            } else {
                unusable.push(format!("{} is gone", p.id));
            }
        }
        if candidates.is_empty() {
            let peers_why = if unusable.is_empty() {
                format!("no peer holds version {}", record.version)
            } else {
                format!(
                    "no live peer holds version {} ({})",
                    record.version,
                    unusable.join(", ")
                )
            };
            return Err(SourceError::NoSource {
                key: key.clone(),
                reason: match origin_why {
                    Some(o) => format!("{o} and {peers_why}"),
                    None => peers_why,
                },
            });
        }
        Ok(Sources {
            record: record.clone(),
            candidates,
        })
    }

    /// What tearing down `service` removes (expired or not): its
    /// `resource` keys, every key under its base path (`service/...`) but
    /// those put with an explicit `lifespan=cluster`, and the `resource`
    /// keys its agents hold (zero-copy data); and its agents, by id.
    pub fn teardown_plan(&self, service: &str) -> (Vec<KeyRecord>, Vec<String>) {
        let agents: Vec<String> = self
            .agents
            .values()
            .filter(|a| a.info.service.as_deref() == Some(service))
            .map(|a| a.info.id.clone())
            .collect();
        let keys = self
            .keys
            .values()
            .filter(|r| {
                let resource = r.lifespan == Lifespan::Resource;
                (resource && (r.service == service || agents.contains(&r.holder)))
                    || (r.key.service() == service && (resource || r.lifespan_by_rule))
            })
            .cloned()
            .collect();
        (keys, agents)
    }
}

fn is_expired(r: &KeyRecord, now_ms: u64) -> bool {
    r.expires_at_ms.is_some_and(|t| t <= now_ms)
}

#[cfg(test)]
mod tests {
    use super::*;
    use kt_types::Locale;
    use kt_types::api::{PutOptions, Served};

    fn reg(ttl: Option<u64>) -> RegisterKey {
        RegisterKey {
            holder: None,
            locale: Locale::Store,
            source: "http://store".into(),
            version: "v1".into(),
            is_dir: true,
            size: 10,
            files: 2,
            tensors: None,
            digest: None,
            options: PutOptions {
                lifespan: Some(Lifespan::Cluster),
                ttl_secs: ttl,
                service: None,
            },
            only_if: None,
        }
    }
    fn k(s: &str) -> Key {
        Key::parse(s).unwrap()
    }

    #[test]
    fn upsert_keeps_created_time() {
        let mut r = Registry::default();
        let a = r.upsert(k("svc/a"), reg(None), 100);
        assert_eq!((a.created_at_ms, a.updated_at_ms), (100, 100));
        assert_eq!(a.service, "svc");
        let b = r.upsert(k("svc/a"), reg(None), 200);
        assert_eq!((b.created_at_ms, b.updated_at_ms), (100, 200));
    }

    #[test]
    fn lists_immediate_children() {
        let mut r = Registry::default();
        for key in ["a/b", "a/b/c", "a/d/e", "a-x", "b"] {
            r.upsert(k(key), reg(None), 1);
        }
        let names = |p: &str| -> Vec<(String, bool, bool)> {
            r.list(&KeyPrefix::parse(p).unwrap(), 1, &|_| true)
                .into_iter()
                .map(|e| (e.name, e.has_children, e.record.is_some()))
                .collect()
        };
        assert_eq!(
            names(""),
            vec![
                ("a".into(), true, false),
                ("a-x".into(), false, true),
                ("b".into(), false, true)
            ]
        );
        assert_eq!(
            names("a"),
            vec![("b".into(), true, true), ("d".into(), true, false)]
        );
        assert_eq!(names("a/b"), vec![("c".into(), false, true)]);
        assert_eq!(names("a/b/c"), vec![("c".into(), false, true)]);
        assert!(names("zzz").is_empty());
        assert_eq!(r.keys_within(&KeyPrefix::parse("a").unwrap(), 1).len(), 3);
        assert!(r.has_children(&k("a/b"), 1));
        assert!(!r.has_children(&k("a/b/c"), 1));
    }

    #[test]
    fn lists_every_key_below_a_prefix() {
        let mut r = Registry::default();
        for key in ["a", "a/b", "a/b/c", "a/d/e", "a-x", "b"] {
            r.upsert(k(key), reg(None), 1);
        }
        let below = |p: &str| -> Vec<(String, String, bool)> {
            r.list_below(&KeyPrefix::parse(p).unwrap(), 1, &|_| true)
                .into_iter()
                .map(|e| (e.name, e.key, e.has_children))
                .collect()
        };
        // Not the prefix itself, not a sibling sharing its first letters.
        assert_eq!(
            below("a"),
            vec![
                ("b".into(), "a/b".into(), true),
                ("b/c".into(), "a/b/c".into(), false),
                ("d/e".into(), "a/d/e".into(), false),
            ]
        );
        assert_eq!(below("").len(), 6);
        // A caller sees only the keys `visible` passes: "a/b/c" hidden, "a/b"
        // has no children it can see.
        let hide = |r: &KeyRecord| r.key.as_str() != "a/b/c";
        let seen: Vec<(String, bool)> = r
            .list_below(&KeyPrefix::parse("a").unwrap(), 1, &hide)
            .into_iter()
            .map(|e| (e.key, e.has_children))
            .collect();
        assert_eq!(seen, vec![("a/b".into(), false), ("a/d/e".into(), false)]);
        let names: Vec<String> = r
            .list(&KeyPrefix::parse("a/b").unwrap(), 1, &hide)
            .into_iter()
            .map(|e| e.key)
            .collect();
        assert_eq!(names, vec!["a/b".to_string()]);
        assert!(
            r.list(&KeyPrefix::parse("b").unwrap(), 1, &|_| false)
                .is_empty()
        );
        assert!(below("a/b/c").is_empty());
        assert!(below("zzz").is_empty());
    }

    #[test]
    fn ttl_hides_and_reports_expired() {
        let mut r = Registry::default();
        r.upsert(k("t/x"), reg(Some(10)), 1_000);
        assert!(r.get(&k("t/x"), 10_999).is_some());
        assert!(r.get(&k("t/x"), 11_000).is_none());
        assert_eq!(r.expired(11_000).len(), 1);
        assert!(r.list(&KeyPrefix::root(), 11_000, &|_| true).is_empty());
    }

    const TTL: u64 = 1_000;

    fn local(holder: &str, version: &str, lifespan: Lifespan) -> RegisterKey {
        RegisterKey {
            holder: Some(holder.into()),
            locale: Locale::Local,
            source: format!("http://{holder}"),
            version: version.into(),
            options: PutOptions {
                lifespan: Some(lifespan),
                ..PutOptions::default()
            },
            ..reg(None)
        }
    }
    fn beat(id: &str, service: Option<&str>, serves: &[(&str, &str)]) -> AgentHeartbeat {
        AgentHeartbeat {
            id: id.into(),
            url: format!("http://{id}"),
            service: service.map(Into::into),
            serves: serves
                .iter()
                .map(|(key, version)| Served {
                    key: k(key),
                    version: (*version).into(),
                })
                .collect(),
        }
    }
    fn peer_ids(r: &Registry, key: &str) -> Vec<String> {
        r.get_any(&k(key))
            .unwrap()
            .peers
            .iter()
            .map(|p| p.id.clone())
            .collect()
    }
    fn keys_of(records: &[KeyRecord]) -> Vec<String> {
        records.iter().map(|r| r.key.to_string()).collect()
    }
    fn source_ids(s: &Sources) -> Vec<(String, bool)> {
        s.candidates
            .iter()
            .map(|c| (c.source.id.clone(), c.origin))
            .collect()
    }

    #[test]
    fn retired_agents_stay_out_until_they_register_again() {
        let mut r = Registry::new(TTL);
        r.upsert(k("s/a"), reg(None), 0);
        r.heartbeat(beat("p1", Some("s"), &[("s/a", "v1")]), 0);
        assert_eq!(peer_ids(&r, "s/a"), ["p1"]);
        assert_eq!(r.retire(&["p1".into()]).agents, ["p1"]);
        let b = r.heartbeat(beat("p1", Some("s"), &[("s/a", "v1")]), 1);
        assert_eq!(b.drop, vec![k("s/a")], "told to drop what it serves");
        assert!(peer_ids(&r, "s/a").is_empty(), "and not a source again");
        // A local put of its own brings it back.
        r.touch_agent("p1", "http://p1", None, 2);
        r.heartbeat(beat("p1", Some("s"), &[("s/a", "v1")]), 3);
        assert_eq!(peer_ids(&r, "s/a"), ["p1"]);
    }

    #[test]
    fn heartbeats_add_refresh_and_remove_peers() {
        let mut r = Registry::new(TTL);
        r.upsert(k("s/a"), reg(None), 0);
        r.upsert(k("s/b"), reg(None), 0);
        let b = r.heartbeat(beat("p1", Some("s"), &[("s/a", "v1"), ("s/b", "v1")]), 0);
        assert_eq!(b.drop, Vec::<Key>::new());
        assert_eq!(keys_of(&b.changed), ["s/a", "s/b"]);
        assert_eq!(b.agent.unwrap().service.as_deref(), Some("s"));
        assert_eq!(peer_ids(&r, "s/a"), ["p1"]);
        // The same beat again changes nothing (nothing to persist).
        let b = r.heartbeat(beat("p1", Some("s"), &[("s/a", "v1"), ("s/b", "v1")]), 10);
        assert_eq!(b, Beat::default());
        // A new URL refreshes the agent and its peer entries, without duplicates.
        let mut moved = beat("p1", Some("s"), &[("s/a", "v1"), ("s/a", "v1")]);
        moved.url = "http://p1-new".into();
        let b = r.heartbeat(moved, 20);
        assert_eq!(b.agent.unwrap().url, "http://p1-new");
        // s/a refreshed, s/b no longer listed: p1 stops being its peer.
        assert_eq!(keys_of(&b.changed), ["s/a", "s/b"]);
        let a = r.get_any(&k("s/a")).unwrap();
        assert_eq!(a.peers.len(), 1);
        assert_eq!(a.peers[0].url, "http://p1-new");
        assert!(peer_ids(&r, "s/b").is_empty());
        // A second agent joins as another peer.
        r.heartbeat(beat("p2", None, &[("s/a", "v1")]), 20);
        assert_eq!(peer_ids(&r, "s/a"), ["p1", "p2"]);
        assert_eq!(r.agents(20).len(), 2);
    }

    #[test]
    fn heartbeats_drop_what_is_gone_or_superseded() {
        let mut r = Registry::new(TTL);
        r.upsert(k("s/a"), reg(None), 0);
        r.upsert(k("s/t"), reg(Some(1)), 0);
        r.heartbeat(beat("p1", None, &[("s/a", "v1"), ("s/t", "v1")]), 0);
        assert_eq!(peer_ids(&r, "s/t"), ["p1"]);
        // s/a is re-put at v2: peers of v1 are cleared; s/t expired; s/gone never existed.
        let mut v2 = reg(None);
        v2.version = "v2".into();
        assert!(r.upsert(k("s/a"), v2, 5).peers.is_empty());
        let b = r.heartbeat(
            beat(
                "p1",
                None,
                &[("s/a", "v1"), ("s/t", "v1"), ("s/gone", "v1")],
            ),
            1_000,
        );
        assert_eq!(b.drop, vec![k("s/a"), k("s/gone"), k("s/t")]);
        // The expired key loses p1 as a peer too.
        assert_eq!(keys_of(&b.changed), ["s/t"]);
        assert!(peer_ids(&r, "s/t").is_empty());
        // The same version registered again keeps its peers.
        r.heartbeat(beat("p1", None, &[("s/a", "v2")]), 1_000);
        let mut again = reg(None);
        again.version = "v2".into();
        assert_eq!(r.upsert(k("s/a"), again, 1_001).peers.len(), 1);
    }

    #[test]
    fn the_origin_is_not_its_own_peer() {
        let mut r = Registry::new(TTL);
        r.touch_agent("p1", "http://p1", None, 0);
        r.upsert(k("s/l"), local("p1", "v1", Lifespan::Cluster), 0);
        let mut hb = beat("p1", None, &[("s/l", "v1")]);
        hb.url = "http://p1:9".into();
        let b = r.heartbeat(hb, 1);
        assert!(b.drop.is_empty());
        // Not a peer, but the origin's URL follows the agent.
        assert!(peer_ids(&r, "s/l").is_empty());
        assert_eq!(keys_of(&b.changed), ["s/l"]);
        assert_eq!(r.get_any(&k("s/l")).unwrap().source, "http://p1:9");
        // A peer that becomes the holder of the same version is no longer a peer.
        r.heartbeat(beat("p2", None, &[("s/l", "v1")]), 1);
        assert_eq!(peer_ids(&r, "s/l"), ["p2"]);
        let rec = r.upsert(k("s/l"), local("p2", "v1", Lifespan::Cluster), 2);
        assert!(rec.peers.is_empty());
    }

    #[test]
    fn stale_agents_are_not_sources_and_are_evicted() {
        let mut r = Registry::new(TTL);
        r.touch_agent("p1", "http://p1", None, 0);
        r.upsert(k("s/l"), local("p1", "v1", Lifespan::Cluster), 0);
        r.upsert(k("s/a"), reg(None), 0);
        r.heartbeat(beat("p2", None, &[("s/l", "v1"), ("s/a", "v1")]), 500);
        let req = LeaseRequest::default();
        let s = r.sources(&k("s/l"), &req, true, 999).unwrap();
        assert_eq!(source_ids(&s), [("p1".into(), true), ("p2".into(), false)]);
        // p1 is past its TTL: not offered even before a sweep.
        let s = r.sources(&k("s/l"), &req, true, 1_000).unwrap();
        assert_eq!(source_ids(&s), [("p2".into(), false)]);
        let e = r.evict_stale(1_000);
        assert_eq!(e.agents, ["p1"]);
        assert!(e.changed.is_empty());
        // The local key keeps its record without a live origin.
        assert_eq!(r.get(&k("s/l"), 1_000).unwrap().holder, "p1");
        let e = r.evict_stale(1_500);
        assert_eq!(e.agents, ["p2"]);
        assert_eq!(keys_of(&e.changed), ["s/a", "s/l"]);
        assert!(peer_ids(&r, "s/a").is_empty());
        assert!(r.agents(1_500).is_empty());
        let err = r.sources(&k("s/l"), &req, true, 1_500).unwrap_err();
        assert_eq!(
            err.to_string(),
            "key s/l has no live source: its origin pod p1 is gone and no peer holds version v1"
        );
    }

    #[test]
    fn a_producer_may_get_its_own_local_key() {
        let mut r = Registry::new(TTL);
        let mut local = reg(None);
        local.locale = Locale::Local;
        local.holder = Some("p1".into());
        local.source = "http://p1".into();
        r.touch_agent("p1", "http://p1", None, 0);
        r.upsert(k("s/a"), local, 0);
        let req = LeaseRequest {
            exclude: vec![],
            getter: Some("p1".into()),
        };
        let s = r.sources(&k("s/a"), &req, false, 1).unwrap();
        assert_eq!(source_ids(&s), [("p1".to_owned(), true)]);
    }

    #[test]
    fn sources_honour_exclusions_and_explain_refusals() {
        let mut r = Registry::new(TTL);
        r.upsert(k("s/a"), reg(None), 0);
        r.heartbeat(beat("p1", None, &[("s/a", "v1")]), 0);
        r.heartbeat(beat("p2", None, &[("s/a", "v1")]), 0);
        let req = |exclude: &[&str], getter: Option<&str>| LeaseRequest {
            exclude: exclude.iter().map(|s| s.to_string()).collect(),
            getter: getter.map(Into::into),
        };
        let s = r.sources(&k("s/a"), &req(&[], None), true, 0).unwrap();
        assert_eq!(s.record.version, "v1");
        assert_eq!(
            source_ids(&s),
            [
                ("store".into(), true),
                ("p1".into(), false),
                ("p2".into(), false)
            ]
        );
        assert_eq!(s.candidates[0].source.url, "http://store");
        let s = r
            .sources(&k("s/a"), &req(&["store", "p2"], Some("p9")), true, 0)
            .unwrap();
        assert_eq!(source_ids(&s), [("p1".into(), false)]);
        let err = r
            .sources(&k("s/a"), &req(&["store", "p2"], Some("p1")), true, 0)
            .unwrap_err();
        assert_eq!(
            err.to_string(),
            "key s/a has no live source: its origin the store was excluded by the getter \
             and no live peer holds version v1 (p1 is the getter itself, p2 was excluded by the getter)"
        );
        // Without a registered store, a store key's origin is not offered.
        let err = r
            .sources(&k("s/a"), &req(&["p1", "p2"], None), false, 0)
            .unwrap_err();
        assert!(err.to_string().contains("no store is registered"), "{err}");
        assert_eq!(
            r.sources(&k("s/zz"), &req(&[], None), true, 0),
            Err(SourceError::UnknownKey(k("s/zz")))
        );
    }

    #[test]
    fn removed_peers_and_evicted_agents_leave_the_index() {
        let mut r = Registry::new(TTL);
        r.upsert(k("s/a"), reg(None), 0);
        r.heartbeat(beat("p1", None, &[("s/a", "v1")]), 0);
        assert_eq!(r.remove_peer(&k("s/a"), "p1").unwrap().peers, vec![]);
        assert!(r.remove_peer(&k("s/a"), "p1").is_none());
        // The next beat re-adds it (it still serves the version).
        let b = r.heartbeat(beat("p1", None, &[("s/a", "v1")]), 1);
        assert_eq!(keys_of(&b.changed), ["s/a"]);
        // Removing the key forgets p1 as its peer: a later beat just drops it.
        r.remove(&k("s/a"), 0);
        let b = r.heartbeat(beat("p1", None, &[]), 2);
        assert!(b.changed.is_empty());
        assert!(r.evict(&["p1".into(), "nobody".into()]).agents == ["p1"]);
    }

    #[test]
    fn an_agent_is_a_peer_only_of_keys_it_may_read() {
        let mut r = Registry::new(TTL);
        r.upsert(k("alpha/model"), reg(None), 0);
        r.upsert(k("beta/data"), reg(None), 0);
        r.upsert(k("beta/mine"), local("p1", "l1", Lifespan::Cluster), 0);
        let beta_only = |key: &Key, service: &str| {
            assert_eq!(key.service(), service);
            service == "beta"
        };
        let b = r.heartbeat_reading(
            beat(
                "p1",
                Some("beta"),
                &[
                    ("alpha/model", "v1"),
                    ("beta/data", "v1"),
                    ("beta/mine", "l1"),
                ],
            ),
            0,
            beta_only,
        );
        assert_eq!(b.drop, [k("alpha/model")]);
        assert!(peer_ids(&r, "alpha/model").is_empty());
        assert_eq!(peer_ids(&r, "beta/data"), ["p1"]);
        // Its own origin stays its own, whatever it reads.
        let b = r.heartbeat_reading(beat("p1", None, &[("beta/mine", "l1")]), 1, |_, _| false);
        assert!(b.drop.is_empty());
        assert_eq!(r.get(&k("beta/mine"), 1).unwrap().holder, "p1");
    }

    #[test]
    fn a_version_registered_again_with_another_digest_keeps_no_peers() {
        let mut r = Registry::new(TTL);
        let with = |d: u8| RegisterKey {
            digest: Some(kt_types::Hash([d; 32])),
            ..reg(None)
        };
        r.upsert(k("s/a"), with(1), 0);
        r.heartbeat(beat("p1", None, &[("s/a", "v1")]), 0);
        r.upsert(k("s/a"), with(1), 1);
        assert_eq!(peer_ids(&r, "s/a"), ["p1"]);
        r.upsert(k("s/a"), with(2), 2);
        assert!(peer_ids(&r, "s/a").is_empty());
        assert_eq!(
            r.get(&k("s/a"), 2).unwrap().digest,
            Some(kt_types::Hash([2; 32]))
        );
    }

    #[test]
    fn teardown_selects_resource_keys_and_agents_of_the_service() {
        let mut r = Registry::new(TTL);
        let resource = |holder: Option<&str>| RegisterKey {
            options: PutOptions {
                lifespan: Some(Lifespan::Resource),
                ..PutOptions::default()
            },
            ..match holder {
                Some(h) => local(h, "v1", Lifespan::Resource),
                None => reg(None),
            }
        };
        r.heartbeat(beat("p1", Some("svc"), &[]), 0);
        r.heartbeat(beat("p2", Some("other"), &[]), 0);
        r.upsert(k("svc/store"), resource(None), 0);
        r.upsert(k("svc/local"), resource(Some("p1")), 0);
        r.upsert(k("svc/kept"), reg(None), 0);
        r.upsert(k("other/x"), resource(None), 0);
        let mut named = resource(None);
        named.options.service = Some("svc".into());
        r.upsert(k("misc/owned"), named, 0);
        let (keys, agents) = r.teardown_plan("svc");
        assert_eq!(keys_of(&keys), ["misc/owned", "svc/local", "svc/store"]);
        assert_eq!(agents, ["p1"]);
        assert_eq!(r.teardown_plan("nothing"), (vec![], vec![]));
    }

    #[test]
    fn restore_gives_agents_a_full_ttl_and_drops_unknown_peers() {
        let mut r = Registry::new(TTL);
        r.upsert(k("s/a"), reg(None), 0);
        r.heartbeat(beat("p1", None, &[("s/a", "v1")]), 0);
        r.heartbeat(beat("p2", None, &[("s/a", "v1")]), 0);
        let records: Vec<KeyRecord> = r.keys_within(&KeyPrefix::root(), 0);
        let agents: Vec<AgentInfo> = r.agents(0).into_iter().filter(|a| a.id == "p1").collect();
        let restored = Registry::restore(TTL, records, agents, Vec::new(), 50_000);
        assert_eq!(peer_ids(&restored, "s/a"), ["p1"]);
        assert!(restored.is_live("p1", 50_999));
        assert!(!restored.is_live("p1", 51_000));
    }

    #[test]
    fn late_registrations_neither_replace_another_holder_nor_revive_a_deletion() {
        let mut r = Registry::default();
        let late = |version: &str| RegisterKey {
            only_if: Some(RegisterIf::AbsentOrHeld),
            version: version.into(),
            ..reg(None)
        };
        // Absent and never deleted, or held by the store: admitted.
        assert_eq!(r.admits(&k("s/a"), &late("v1"), 0), Ok(()));
        r.upsert(k("s/a"), reg(None), 0);
        assert_eq!(r.admits(&k("s/a"), &late("v2"), 0), Ok(()));
        // Held by an agent: refused; unconditional: admitted.
        r.upsert(k("s/a"), local("p1", "l1", Lifespan::Cluster), 0);
        assert!(matches!(
            r.admits(&k("s/a"), &late("v2"), 0),
            Err(Refused::HeldElsewhere { ref holder, .. }) if holder == "p1"
        ));
        assert_eq!(r.admits(&k("s/a"), &reg(None), 0), Ok(()));
        // Deleted: refused for an hour, then admitted again.
        r.remove(&k("s/a"), 1_000);
        assert_eq!(
            r.admits(&k("s/a"), &late("v2"), 1_000 + TOMBSTONE_MS - 1),
            Err(Refused::Deleted { key: k("s/a") })
        );
        assert_eq!(
            r.admits(&k("s/a"), &late("v2"), 1_000 + TOMBSTONE_MS),
            Ok(())
        );
        // A new record clears the deletion.
        r.upsert(k("s/a"), reg(None), 2_000);
        r.remove(&k("s/a"), 3_000);
        r.upsert(k("s/a"), reg(None), 4_000);
        assert!(r.tombstones.is_empty());
    }

    #[test]
    fn deletions_are_forgotten_by_age_and_oldest_first_past_the_cap() {
        let mut r = Registry::default();
        for i in 0..MAX_TOMBSTONES as u64 {
            r.tombstones.insert(k(&format!("s/k{i}")), i);
        }
        r.upsert(k("s/new"), reg(None), 0);
        r.remove(&k("s/new"), MAX_TOMBSTONES as u64);
        // Room was made by forgetting the oldest tenth; the newest stays.
        assert_eq!(r.tombstones.len(), MAX_TOMBSTONES - MAX_TOMBSTONES / 10 + 1);
        assert!(!r.tombstones.contains_key(&k("s/k0")));
        assert!(r.tombstones.contains_key(&k("s/new")));
        r.forget_deletions(MAX_TOMBSTONES as u64 + TOMBSTONE_MS - 1, 0);
        assert_eq!(
            r.tombstones.len(),
            1,
            "only the newest is under an hour old"
        );
    }

    /// A registration naming no lifespan (and `service`, if given).
    fn by_rule(service: Option<&str>) -> RegisterKey {
        let mut r = reg(None);
        r.options.lifespan = None;
        r.options.service = service.map(Into::into);
        r
    }

    #[test]
    fn the_rule_gives_base_paths_and_zero_copy_data_resource_and_the_rest_cluster() {
        let mut r = Registry::new(TTL);
        assert_eq!(r.know_services(["svc", "svc"]), ["svc"]);
        assert!(r.know_services(["svc"]).is_empty());
        let rec = |r: &mut Registry, key: &str, reg: RegisterKey| {
            let got = r.upsert(k(key), reg, 0);
            (got.lifespan, got.lifespan_by_rule, got.service)
        };
        let resource = |s: &str| (Lifespan::Resource, true, s.to_owned());
        assert_eq!(rec(&mut r, "svc/keep", by_rule(None)), resource("svc"));
        // Under a service's base path the key is that service's, whatever
        // the put said.
        assert_eq!(
            rec(&mut r, "svc/named", by_rule(Some("other"))),
            resource("svc")
        );
        assert_eq!(
            rec(&mut r, "models/final", by_rule(None)),
            (Lifespan::Cluster, true, "models".to_owned())
        );
        assert_eq!(
            rec(&mut r, "models/mine", by_rule(Some("other"))),
            (Lifespan::Cluster, true, "other".to_owned())
        );
        let mut zero_copy = local("p1", "v1", Lifespan::Cluster);
        zero_copy.options.lifespan = None;
        assert_eq!(rec(&mut r, "models/local", zero_copy), resource("models"));
        // An explicit lifespan is kept as said.
        assert_eq!(
            rec(&mut r, "svc/final", reg(None)),
            (Lifespan::Cluster, false, "svc".to_owned())
        );
        assert_eq!(r.owner(&k("svc/x"), 0), Some(("svc".to_owned(), true)));
        assert_eq!(
            r.owner(&k("models/mine"), 0),
            Some(("other".to_owned(), false))
        );
        assert_eq!(r.owner(&k("nobody/x"), 0), None);
    }

    #[test]
    fn zero_copy_resource_keys_are_stale_while_their_holder_is_gone() {
        let mut r = Registry::new(TTL);
        r.heartbeat(beat("p1", Some("svc"), &[]), 0);
        r.upsert(k("m/temp"), local("p1", "v1", Lifespan::Resource), 0);
        r.upsert(k("m/pinned"), local("p1", "v1", Lifespan::Cluster), 0);
        let listed = |r: &Registry, now| -> Vec<String> {
            r.list(&KeyPrefix::parse("m").unwrap(), now, &|_| true)
                .into_iter()
                .map(|e| e.key)
                .collect()
        };
        assert_eq!(listed(&r, 1), ["m/pinned", "m/temp"]);
        // p1 falls silent: its resource key is neither listed nor served,
        // but `rm` still finds it; the cluster one stays listed.
        let late = TTL + 1;
        assert!(r.get(&k("m/temp"), late).is_none());
        assert!(r.get_unexpired(&k("m/temp"), late).is_some());
        assert_eq!(listed(&r, late), ["m/pinned"]);
        let req = LeaseRequest::default();
        let stale = r.sources(&k("m/temp"), &req, true, late).unwrap_err();
        assert!(
            matches!(&stale, SourceError::Stale { holder, .. } if holder == "p1"),
            "{stale}"
        );
        r.evict_stale(late);
        assert_eq!(listed(&r, late), ["m/pinned"]);
        // It beats again: its data is served again.
        r.heartbeat(beat("p1", Some("svc"), &[("m/temp", "v1")]), late);
        assert_eq!(listed(&r, late), ["m/pinned", "m/temp"]);
        // A live peer holding it keeps it served after its holder is gone.
        r.heartbeat(beat("p2", None, &[("m/temp", "v1")]), late + TTL);
        let later = late + TTL + 1;
        assert!(!r.is_live("p1", later));
        assert_eq!(listed(&r, later), ["m/pinned", "m/temp"]);
        assert_eq!(
            r.sources(&k("m/temp"), &req, true, later)
                .unwrap()
                .candidates[0]
                .source
                .id,
            "p2"
        );
    }

    #[test]
    fn teardown_takes_the_base_path_but_explicit_cluster_keys_and_the_pods_zero_copy_data() {
        let mut r = Registry::new(TTL);
        r.heartbeat(beat("p1", Some("svc"), &[]), 0);
        // Put before `svc` was known: the rule chose cluster, but the key
        // lies under svc's base path.
        r.upsert(k("svc/early"), by_rule(None), 0);
        r.know_services(["svc"]);
        r.upsert(k("svc/keep"), by_rule(None), 0);
        r.upsert(k("svc/final"), reg(None), 0);
        let mut elsewhere = local("p1", "v1", Lifespan::Cluster);
        elsewhere.options.lifespan = None;
        r.upsert(k("models/zero-copy"), elsewhere, 0);
        r.upsert(k("models/final"), by_rule(None), 0);
        let (keys, agents) = r.teardown_plan("svc");
        assert_eq!(
            keys_of(&keys),
            ["models/zero-copy", "svc/early", "svc/keep"]
        );
        assert_eq!(agents, ["p1"]);
    }
}
