//! Tensor registrations: who owns which key ([`Owner`]: a process, or the
//! control connection when the agent cannot see its pid), the registry and
//! its persistence in `<state>/tensors.json`, puts and drops, the reaper
//! ([`reap_loop`]), connection bookkeeping, and the release of lent CUDA
//! memory nothing uses any more.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::Duration;

use kt_service::ApiError;
use kt_tensor::engine::Lent;
use kt_types::api::{RegisterKey, Served};
use kt_types::tensor::{
    self as t, Device, MemHandle, PutTensors, QuorumKey, QuorumRole, TensorDesc, TensorEntry,
    TensorRegistration, TensorSummary, TensorsPut,
};
use kt_types::{ErrorCode, Key, Locale};
use serde::{Deserialize, Serialize};
use tokio_util::sync::CancellationToken;

use super::{Tensors, locked};

/// How often owners are checked for life (also on every closed connection).
const REAP_EVERY: Duration = Duration::from_millis(250);

/// Who owns a registration.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Owner {
    /// 0 when the agent cannot see the process.
    pub pid: u32,
    /// The process's start time (clock ticks since boot), against pid reuse.
    pub start: u64,
    /// The control connection that registered (owner when `pid` is 0).
    pub conn: u64,
}

impl Owner {
    /// The owner behind a control connection: `pid` from its peer credentials.
    pub fn of(pid: Option<i32>, conn: u64) -> Owner {
        let pid = pid.filter(|p| *p > 0).map(|p| p as u32);
        match pid.and_then(|p| proc_start(p).map(|s| (p, s))) {
            Some((pid, start)) => Owner { pid, start, conn },
            None => Owner {
                pid: 0,
                start: 0,
                conn,
            },
        }
    }

    pub(super) fn alive(&self, conns: &HashSet<u64>) -> bool {
        if self.pid == 0 {
            conns.contains(&self.conn)
        } else {
            proc_start(self.pid) == Some(self.start)
        }
    }

    /// Two owners are one process when both pids are known and match
    /// (with their start times), or when neither is known and they share a
    /// connection. A known and an unknown pid are never the same process:
    /// connection numbers restart with the agent, pids do not.
    fn same_process(&self, other: &Owner) -> bool {
        match (self.pid, other.pid) {
            (0, 0) => self.conn == other.conn,
            (0, _) | (_, 0) => false,
            _ => self.pid == other.pid && self.start == other.start,
        }
    }
}

/// A registration's broadcast put in progress (see `Tensors::broadcasting`),
/// forgotten on drop.
struct Broadcasting<'a> {
    tensors: &'a Tensors,
    version: Option<String>,
}

impl Drop for Broadcasting<'_> {
    fn drop(&mut self) {
        if let Some(v) = &self.version {
            locked(&self.tensors.broadcasting).remove(v);
        }
    }
}

/// A broadcast put waiting for its quorum: cancelled by the caller going
/// away (its connection's `gone`) or by a `WithdrawPut` of its process.
#[derive(Debug)]
pub(super) struct Waiting {
    /// Tells this entry from the others (see [`WaitingPut`]).
    id: u64,
    owner: Owner,
    key: Key,
    withdraw: CancellationToken,
}

/// Holds a [`Waiting`] entry while its put runs; removes it however the
/// put ends.
struct WaitingPut<'a> {
    tensors: &'a Tensors,
    id: u64,
    withdraw: CancellationToken,
}

impl Drop for WaitingPut<'_> {
    fn drop(&mut self) {
        locked(&self.tensors.waiting).retain(|w| w.id != self.id);
    }
}

/// Numbers [`Waiting`] entries.
static NEXT_WAITING: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// Field 22 of `/proc/<pid>/stat` (after the command, which may hold
/// spaces), for a process that still runs: a zombie (state `Z`, exited but
/// not reaped) or a dead one (`X`) has none.
fn proc_start(pid: u32) -> Option<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let rest = &stat[stat.rfind(')')? + 1..];
    let mut fields = rest.split_whitespace();
    // Fields after the command start at 3 (state); starttime is 22.
    if matches!(fields.next(), Some("Z" | "X" | "x")) {
        return None;
    }
    fields.nth(18)?.parse().ok()
}

/// One registered tensor set.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Registration {
    pub key: Key,
    pub version: String,
    pub owner: Owner,
    pub entries: Vec<TensorEntry>,
    /// Announced in heartbeats once the metadata server knows the version.
    #[serde(default)]
    pub published: bool,
}

impl Registration {
    pub(super) fn descs(&self) -> Vec<TensorDesc> {
        t::describe(&self.entries)
    }

    pub(super) fn device(&self) -> Device {
        self.entries
            .first()
            .map(|e| e.device)
            .unwrap_or(Device::Cpu)
    }

    fn info(&self) -> TensorRegistration {
        TensorRegistration {
            key: self.key.clone(),
            version: self.version.clone(),
            pid: self.owner.pid,
            tensors: self.entries.len() as u64,
            bytes: self.entries.iter().map(|e| e.mem.len()).sum(),
            device: self.device(),
        }
    }
}

impl Tensors {
    /// Registrations of the last run whose processes still live; the
    /// others (connection-owned ones included: their connections are gone)
    /// are queued for the next reap to unregister.
    pub(super) fn load(&self) {
        let Ok(bytes) = std::fs::read(&self.state_file) else {
            return;
        };
        let saved: Vec<Registration> = match serde_json::from_slice(&bytes) {
            Ok(v) => v,
            Err(e) => {
                tracing::warn!(file = %self.state_file.display(), error = %e, "unreadable tensor registrations; starting without");
                return;
            }
        };
        let none = HashSet::new();
        let mut regs = self.lock();
        let mut stale = locked(&self.stale);
        for r in saved {
            if r.owner.pid != 0 && r.owner.alive(&none) {
                tracing::info!(key = %r.key, pid = r.owner.pid, "tensor registration restored");
                regs.insert(r.key.clone(), r);
            } else {
                stale.push((r.key, r.version));
            }
        }
    }

    pub(super) fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<Key, Registration>> {
        locked(&self.regs)
    }

    /// Writes the registrations (write then rename: old or new, never half).
    fn save(&self, regs: &HashMap<Key, Registration>) {
        let list: Vec<&Registration> = regs.values().collect();
        let tmp = self.state_file.with_extension("json.tmp");
        let res = serde_json::to_vec(&list)
            .map_err(std::io::Error::other)
            .and_then(|b| {
                use std::io::Write;
                use std::os::unix::fs::OpenOptionsExt;
                std::fs::OpenOptions::new()
                    .write(true)
                    .create(true)
                    .truncate(true)
                    .mode(0o600)
                    .open(&tmp)?
                    .write_all(&b)
            })
            .and_then(|()| std::fs::rename(&tmp, &self.state_file));
        if let Err(e) = res {
            tracing::warn!(file = %self.state_file.display(), error = %e, "could not save tensor registrations");
        }
    }

    /// A control connection opened / closed (owners of pid-less registrations).
    pub fn connection_opened(&self, conn: u64) {
        locked(&self.conns).insert(conn);
    }

    pub fn connection_closed(&self, conn: u64) {
        locked(&self.conns).remove(&conn);
        self.wake.notify_one();
    }

    /// What the agent holds, for status.
    pub fn registrations(&self) -> Vec<TensorRegistration> {
        let mut v: Vec<_> = self.lock().values().map(Registration::info).collect();
        v.sort_by(|a, b| a.key.cmp(&b.key));
        v
    }

    /// Published registrations, for heartbeats (the metadata server answers
    /// with those deleted or superseded).
    pub fn serves(&self) -> Vec<Served> {
        self.lock()
            .values()
            .filter(|r| r.published)
            .map(|r| Served {
                key: r.key.clone(),
                version: r.version.clone(),
            })
            .collect()
    }

    /// Drops a registration the metadata server no longer knows (that version only).
    pub fn drop_version(&self, key: &Key, version: &str) -> bool {
        let mut regs = self.lock();
        if regs.get(key).is_some_and(|r| r.version == version) {
            let gone = regs.remove(key).map(|r| r.entries).unwrap_or_default();
            self.save(&regs);
            let dests = locked(&self.dests);
            self.release(unused(
                gone.iter().map(|e| &e.mem),
                regs.values().flat_map(|r| r.entries.iter().map(|e| &e.mem)),
                dests.iter().map(|(_, h)| h),
            ));
            tracing::info!(%key, version, "tensor registration dropped (deleted or superseded)");
            return true;
        }
        false
    }

    /// Closes what the CUDA backend keeps open for `handles` (nothing when
    /// no CUDA backend was made).
    fn release(&self, handles: Vec<MemHandle>) {
        if let Some(Ok(b)) = self.cuda.get() {
            for h in &handles {
                b.release(h);
            }
        }
    }

    /// Keeps a get's CUDA destinations as `owner`'s (each allocation once
    /// per owner) until the reaper finds the owner gone (`keep_mapped`).
    pub(super) fn keep_dests<'a>(
        &self,
        owner: &Owner,
        dest: impl IntoIterator<Item = &'a TensorEntry>,
    ) {
        let mut dests = locked(&self.dests);
        for e in dest {
            let lender = Lender::Owner(owner.clone());
            if !dests
                .iter()
                .any(|(l, h)| *l == lender && ipc(h) == ipc(&e.mem))
            {
                dests.push((lender, e.mem.clone()));
            }
        }
    }

    /// Marks a get's CUDA destinations in use for that get only: what the
    /// agent opened of them is closed when the returned guard is dropped
    /// (the get ended), unless a registration or another get uses it.
    pub(super) fn borrow_dests<'a>(
        &self,
        dest: impl IntoIterator<Item = &'a TensorEntry>,
    ) -> GetDests<'_> {
        let id = self
            .next_get
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let mut dests = locked(&self.dests);
        dests.extend(dest.into_iter().map(|e| (Lender::Get(id), e.mem.clone())));
        GetDests { tensors: self, id }
    }

    /// Registers the caller's tensors under `req.key`; a broadcast put
    /// then waits for its quorum only while the caller is there (`gone`).
    pub async fn put(
        &self,
        owner: Owner,
        req: PutTensors,
        gone: &CancellationToken,
    ) -> Result<TensorsPut, ApiError> {
        t::validate_entries(&req.tensors)
            .map_err(|m| ApiError::bad_request(format!("{}: {m}", req.key)))?;
        let device = req.tensors[0].device;
        let backend = self.backend(device)?;
        // Every handle must open before anything is registered; a broadcast
        // put moves these very regions, a plain one only needed the check.
        let regions = Self::map(backend.clone(), req.tensors.clone()).await?;
        let member = match &req.broadcast {
            Some(_) => super::quorum::member_id(&owner, req.member.as_deref())?,
            None => String::new(),
        };
        let mut broadcast = req.broadcast.clone().map(|w| (w, regions));
        let descs = t::describe(&req.tensors);
        let version = t::version_of(&descs, &uuid::Uuid::new_v4().to_string());
        // Another process of this pod holds the key: a broadcast put is one
        // more putter of it (several putters of a key each send their own
        // tensors), its memory lent for the transfer only; the
        // registration stays the holder's.
        let mut contributes = None;
        let waiter = owner.clone();
        {
            let mut regs = self.lock();
            let none = locked(&self.conns).clone();
            let busy = locked(&self.broadcasting);
            let held = regs.get(&req.key).filter(|cur| {
                if cur.owner.same_process(&owner) {
                    broadcast.is_some() && busy.contains(&cur.version)
                } else {
                    cur.owner.alive(&none)
                }
            });
            if let Some(cur) = held {
                drop(busy);
                if broadcast.is_none() {
                    return Err(ApiError::new(
                        ErrorCode::Conflict,
                        format!(
                            "{} is registered at this agent by another live process (pid {}); it must drop it, or exit, first",
                            req.key, cur.owner.pid
                        ),
                    ));
                }
                contributes = broadcast.take();
            } else {
                drop(busy);
                regs.insert(
                    req.key.clone(),
                    Registration {
                        key: req.key.clone(),
                        version: version.clone(),
                        owner,
                        entries: req.tensors.clone(),
                        published: false,
                    },
                );
                self.save(&regs);
                if broadcast.is_some() {
                    locked(&self.broadcasting).insert(version.clone());
                }
            }
        }
        // Until this put's broadcast ends, however it ends.
        let _broadcasting = Broadcasting {
            tensors: self,
            version: (contributes.is_none() && broadcast.is_some()).then(|| version.clone()),
        };
        // Its wait for the quorum ends when the caller goes, or when its
        // process withdraws it ([`Tensors::withdraw_put`]).
        let waiting = WaitingPut {
            tensors: self,
            id: NEXT_WAITING.fetch_add(1, std::sync::atomic::Ordering::Relaxed),
            withdraw: gone.child_token(),
        };
        if broadcast.is_some() || contributes.is_some() {
            locked(&self.waiting).push(Waiting {
                id: waiting.id,
                owner: waiter,
                key: req.key.clone(),
                withdraw: waiting.withdraw.clone(),
            });
        }
        let gone = &waiting.withdraw;
        if let Some((window, regions)) = contributes {
            // Not registered: what the agent opens of CUDA memory lent so
            // is closed when the put ends, as a get's destination is.
            let _in_use =
                matches!(device, Device::Cuda(_)).then(|| self.borrow_dests(&req.tensors));
            let stats = self
                .put_in_quorum(
                    &req.key, member, &version, descs, window, regions, backend, gone,
                )
                .await?;
            return Ok(TensorsPut {
                key: req.key,
                version,
                record: None,
                stats: Some(stats),
            });
        }
        let mut dtypes: Vec<_> = descs.iter().map(|d| d.meta.dtype).collect();
        dtypes.sort();
        dtypes.dedup();
        let reg = RegisterKey {
            locale: Locale::Local,
            source: self.url.clone(),
            holder: Some(self.id.clone()),
            version: version.clone(),
            is_dir: false,
            size: req.tensors.iter().map(|e| e.mem.len()).sum(),
            files: req.tensors.len() as u64,
            tensors: Some(TensorSummary {
                tensors: req.tensors.len() as u64,
                device,
                dtypes,
            }),
            digest: None,
            options: req.options.clone(),
            only_if: None,
        };
        let record = match self.metadata.register(&req.key, &reg).await {
            Ok(r) => r,
            Err(e) => {
                self.drop_version(&req.key, &version);
                return Err(e);
            }
        };
        let published = self
            .lock()
            .get_mut(&req.key)
            .filter(|r| r.version == version)
            .map(|r| r.published = true)
            .is_some();
        if !published {
            // Reaped (its owner died) or dropped while it was being
            // registered: the record just made names nothing here.
            self.unregister(&req.key, &version).await;
            return Err(ApiError::new(
                ErrorCode::Conflict,
                format!(
                    "{} was dropped while it was being registered (did its process exit?)",
                    req.key
                ),
            ));
        }
        tracing::info!(key = %req.key, %version, tensors = req.tensors.len(), %device, "tensors registered");
        let stats = match broadcast {
            None => None,
            Some((window, regions)) => Some(
                self.put_in_quorum(
                    &req.key, member, &version, descs, window, regions, backend, gone,
                )
                .await?,
            ),
        };
        Ok(TensorsPut {
            key: req.key,
            version,
            record: Some(Box::new(record)),
            stats,
        })
    }

    /// A broadcast put's part: joins the quorum as a putter of `key` with
    /// these mapped `regions`, and moves them.
    #[allow(clippy::too_many_arguments)]
    async fn put_in_quorum(
        &self,
        key: &Key,
        member: String,
        version: &str,
        descs: Vec<TensorDesc>,
        window: kt_types::BroadcastWindow,
        regions: Vec<Box<dyn kt_tensor::Region>>,
        backend: Arc<dyn kt_tensor::Backend>,
        gone: &CancellationToken,
    ) -> Result<kt_types::tensor::TensorStats, ApiError> {
        let device = regions.first().map(|r| r.device()).unwrap_or(Device::Cpu);
        let mut lent = Lent::new(device);
        lent.keys.insert(key.clone(), regions);
        let role = QuorumRole::Put {
            keys: vec![QuorumKey {
                from: None,
                key: key.clone(),
                version: version.to_owned(),
                tensors: descs,
            }],
        };
        // Boxed: the quorum's future is large, and `put` awaits it in two
        // places.
        Box::pin(self.quorum(key, member, role, &window, backend, lent, gone)).await
    }

    /// `WithdrawPut`: ends the quorum wait of `owner`'s process's broadcast
    /// puts of `key` (a put its caller interrupted, whose connection stays
    /// open for what it lent); how many were waiting. The owner must be a
    /// process the agent can see: connections are not processes.
    pub fn withdraw_put(&self, owner: &Owner, key: &Key) -> Result<u32, ApiError> {
        if owner.pid == 0 {
            return Err(ApiError::bad_request(
                "this agent cannot see the caller's process (no peer credentials): a put is withdrawn only when its connection closes",
            ));
        }
        let waiting = locked(&self.waiting);
        let mut joins = 0;
        for w in waiting
            .iter()
            .filter(|w| &w.key == key && w.owner.same_process(owner))
        {
            w.withdraw.cancel();
            joins += 1;
        }
        if joins > 0 {
            tracing::info!(%key, pid = owner.pid, joins, "broadcast put withdrawn by its process");
        }
        Ok(joins)
    }

    /// `drop_tensors`: the owner's own registration only.
    pub async fn drop_key(&self, owner: &Owner, key: &Key) -> Result<(), ApiError> {
        let version = {
            let regs = self.lock();
            match regs.get(key) {
                None => {
                    return Err(ApiError::not_found(format!(
                        "{key} is not registered at this agent"
                    )));
                }
                Some(r) if !r.owner.same_process(owner) => {
                    return Err(ApiError::new(
                        ErrorCode::Conflict,
                        format!(
                            "{key} was registered by another process (pid {})",
                            r.owner.pid
                        ),
                    ));
                }
                Some(r) => r.version.clone(),
            }
        };
        self.forget(key, &version).await;
        Ok(())
    }

    /// Drops a registration and unregisters that version at the metadata server.
    async fn forget(&self, key: &Key, version: &str) {
        if self.drop_version(key, version) {
            self.unregister(key, version).await;
        }
    }

    /// Unregisters `key` at `version` at the metadata server (a key put
    /// again meanwhile, or already gone, is left as it is).
    async fn unregister(&self, key: &Key, version: &str) {
        match self.metadata.unregister(key, version).await {
            Ok(()) => tracing::info!(%key, version, "tensor key unregistered"),
            Err(e) if matches!(e.code, ErrorCode::NotFound | ErrorCode::Conflict) => {}
            Err(e) => {
                tracing::warn!(%key, error = %e, "could not unregister a tensor key; it expires with this agent")
            }
        }
    }

    /// Drops what dead processes registered (and unregisters what the
    /// last run's dead owners left).
    pub async fn reap(&self) -> usize {
        let stale = std::mem::take(&mut *locked(&self.stale));
        for (key, version) in stale {
            tracing::info!(%key, version, "the process that registered these tensors did not outlive the agent's restart; unregistering them");
            self.unregister(&key, &version).await;
        }
        let conns = locked(&self.conns).clone();
        let dead: Vec<(Key, String, u32)> = self
            .lock()
            .values()
            .filter(|r| !r.owner.alive(&conns))
            .map(|r| (r.key.clone(), r.version.clone(), r.owner.pid))
            .collect();
        for (key, version, pid) in &dead {
            tracing::info!(%key, pid, "the process that registered these tensors is gone; dropping them");
            self.forget(key, version).await;
        }
        let released = {
            let regs = self.lock();
            let mut dests = locked(&self.dests);
            let (gone, kept): (Vec<_>, Vec<_>) = std::mem::take(&mut *dests)
                .into_iter()
                .partition(|(l, _)| matches!(l, Lender::Owner(o) if !o.alive(&conns)));
            *dests = kept;
            unused(
                gone.iter().map(|(_, h)| h),
                regs.values().flat_map(|r| r.entries.iter().map(|e| &e.mem)),
                dests.iter().map(|(_, h)| h),
            )
        };
        self.release(released);
        dead.len()
    }
}

/// Who a get's CUDA destination is mapped for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum Lender {
    /// Kept for this process until it goes away (`keep_mapped`).
    Owner(Owner),
    /// For the get of this number, until it ends.
    Get(u64),
}

/// A get's destinations in use ([`Tensors::borrow_dests`]).
pub(super) struct GetDests<'a> {
    tensors: &'a Tensors,
    id: u64,
}

impl Drop for GetDests<'_> {
    fn drop(&mut self) {
        let t = self.tensors;
        let released = {
            let regs = t.lock();
            let mut dests = locked(&t.dests);
            end_get(
                &mut dests,
                self.id,
                regs.values().flat_map(|r| r.entries.iter().map(|e| &e.mem)),
            )
        };
        t.release(released);
    }
}

/// Takes get `id`'s destinations out of `dests`: the handles no
/// registration (`registered`) and no other destination uses, to close.
fn end_get<'a>(
    dests: &mut Vec<(Lender, MemHandle)>,
    id: u64,
    registered: impl IntoIterator<Item = &'a MemHandle>,
) -> Vec<MemHandle> {
    let (mine, rest): (Vec<_>, Vec<_>) = std::mem::take(dests)
        .into_iter()
        .partition(|(l, _)| *l == Lender::Get(id));
    *dests = rest;
    unused(
        mine.iter().map(|(_, h)| h),
        registered,
        dests.iter().map(|(_, h)| h),
    )
}

/// The allocation a CUDA IPC handle names (`None` for shared memory).
fn ipc(h: &MemHandle) -> Option<&str> {
    match h {
        MemHandle::CudaIpc { handle, .. } => Some(handle.as_str()),
        MemHandle::Shm { .. } => None,
    }
}

/// The CUDA IPC handles among `gone` that neither `kept` nor `lent` use
/// (one allocation may back several tensors, keys and gets): those whose
/// mappings can be closed.
fn unused<'g, 'k, 'l>(
    gone: impl IntoIterator<Item = &'g MemHandle>,
    kept: impl IntoIterator<Item = &'k MemHandle>,
    lent: impl IntoIterator<Item = &'l MemHandle>,
) -> Vec<MemHandle> {
    let mut in_use: HashSet<&str> = HashSet::new();
    in_use.extend(kept.into_iter().filter_map(|h| ipc(h)));
    in_use.extend(lent.into_iter().filter_map(|h| ipc(h)));
    let mut seen = HashSet::new();
    gone.into_iter()
        .filter(|h| ipc(h).is_some_and(|id| !in_use.contains(id) && seen.insert(id)))
        .cloned()
        .collect()
}

/// Drops registrations of exited processes until `shutdown`.
pub async fn reap_loop(tensors: Arc<Tensors>, shutdown: CancellationToken) {
    loop {
        tokio::select! {
            _ = shutdown.cancelled() => return,
            _ = tokio::time::sleep(REAP_EVERY) => {}
            _ = tensors.wake.notified() => {}
        }
        tensors.reap().await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn owners_are_processes_with_their_start_time() {
        let me = Owner::of(Some(std::process::id() as i32), 1);
        assert_eq!(me.pid, std::process::id());
        assert!(me.start > 0);
        assert!(me.alive(&HashSet::new()));
        let reused = Owner {
            start: me.start + 1,
            ..me.clone()
        };
        assert!(!reused.alive(&HashSet::new()));
        let hidden = Owner::of(None, 7);
        assert_eq!(hidden.pid, 0);
        assert!(hidden.alive(&HashSet::from([7])));
        assert!(!hidden.alive(&HashSet::from([8])));
        assert!(me.same_process(&Owner {
            conn: 9,
            ..me.clone()
        }));
        // An exited child not yet reaped is not alive.
        let mut child = std::process::Command::new("true").spawn().unwrap();
        let pid = child.id();
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while std::fs::read_to_string(format!("/proc/{pid}/stat"))
            .is_ok_and(|s| !s.contains(") Z "))
        {
            assert!(
                std::time::Instant::now() < deadline,
                "the child never exited"
            );
            std::thread::yield_now();
        }
        assert_eq!(proc_start(pid), None);
        child.wait().unwrap();
    }

    /// A get's CUDA destinations are closed when it ends, unless another
    /// get, a `keep_mapped` get or a registration still uses them.
    #[test]
    fn a_gets_destinations_are_released_when_no_one_else_uses_them() {
        let h = |id: &str| MemHandle::CudaIpc {
            handle: id.into(),
            offset: 0,
            len: 4,
            device_uuid: None,
        };
        let owner = Owner::of(None, 7);
        let mut dests = vec![
            (Lender::Get(1), h("a")),
            (Lender::Get(1), h("b")),
            (Lender::Get(1), h("c")),
            (Lender::Get(1), h("d")),
            (Lender::Get(2), h("a")),
            (Lender::Owner(owner.clone()), h("b")),
        ];
        let registered = [h("c")];
        // a: get 2 still runs; b: kept for its owner; c: registered.
        assert_eq!(end_get(&mut dests, 1, &registered), vec![h("d")]);
        assert_eq!(dests.len(), 2);
        assert_eq!(end_get(&mut dests, 2, &registered), vec![h("a")]);
        assert_eq!(dests, vec![(Lender::Owner(owner), h("b"))]);
        assert!(end_get(&mut dests, 3, &registered).is_empty());
    }

    #[test]
    fn only_handles_nothing_else_uses_are_released() {
        let ipc = |h: &str, offset| MemHandle::CudaIpc {
            handle: h.into(),
            offset,
            len: 4,
            device_uuid: None,
        };
        let shm = MemHandle::Shm {
            path: "/dev/shm/x".into(),
            offset: 0,
            len: 4,
        };
        let gone = [ipc("a", 0), ipc("a", 4), ipc("b", 0), ipc("c", 0), shm];
        let kept = [ipc("b", 8)];
        let lent = [ipc("c", 0)];
        // "a" twice (two tensors of one allocation) is released once; "b"
        // backs a kept registration, "c" a live getter's destination.
        assert_eq!(unused(&gone, &kept, &lent), [ipc("a", 0)]);
        assert_eq!(unused(&gone, &[], &[]).len(), 3);
    }

    #[test]
    fn owners_with_and_without_pids_are_never_one_process() {
        let with = Owner {
            pid: 42,
            start: 7,
            conn: 3,
        };
        let without = Owner {
            pid: 0,
            start: 0,
            conn: 3,
        };
        assert!(!with.same_process(&without) && !without.same_process(&with));
        assert!(without.same_process(&without.clone()));
        assert!(with.same_process(&Owner {
            conn: 9,
            ..with.clone()
        }));
        assert!(!with.same_process(&Owner {
            start: 8,
            ..with.clone()
        }));
    }
}
