//! Keys: registration (`PUT`), lookup, listing and deletion under
//! `/api/v1/keys`, and `GET /api/v1/owners/{key}`.

use axum::extract::{Extension, Path, Query, State};
use kt_service::{ApiError, ApiJson, forbidden};
use kt_types::api::{DeleteQuery, DeleteResponse, KeyOwner, ListQuery, ListResponse, RegisterKey};
use kt_types::auth::{Principal, Role};
use kt_types::manifest::ManifestLimits;
use kt_types::{ErrorCode, Key, KeyPrefix, KeyRecord, Locale, STORE_HOLDER, paths};

use super::{
    AppState, Inner, check_agent_id, check_service, check_url, db_err, note_services, now_ms,
};
use crate::db::Batch;
use crate::registry::Registry;

pub(super) async fn put_key(
    State(s): State<AppState>,
    Extension(who): Extension<Principal>,
    Path(key): Path<String>,
    ApiJson(mut reg): ApiJson<RegisterKey>,
) -> Result<ApiJson<KeyRecord>, ApiError> {
    let key = Key::parse(&key)?;
    check_registration(&reg)?;
    // The store registers what it committed; an agent what it holds.
    let own = match who.role {
        Role::Admin => true,
        Role::Store => reg.locale == Locale::Store,
        Role::Agent | Role::Pod => {
            reg.locale == Locale::Local && reg.holder.as_deref().is_some_and(|h| who.is_agent(h))
        }
        Role::Workload | Role::Metrics => false,
    };
    if !own {
        return Err(forbidden(format!(
            "a {} token may not register {key} as {:?} held by {:?}",
            who.role,
            reg.locale,
            reg.holder.as_deref().unwrap_or(STORE_HOLDER)
        )));
    }
    if !who.may_advertise(&reg.source) {
        return Err(forbidden(format!(
            "this pod's token may advertise sources on its own IP only, not {:?}",
            reg.source
        )));
    }
    let now = now_ms();
    let mut registry = s.registry.lock().await;
    let mut services = note_services(&mut registry, &who);
    // A pod (or an agent given services) registers only its services'
    // keys, and never takes over a key another service owns; the store's
    // registrations were checked at the store, when the put came.
    if who.services.is_some() && matches!(who.role, Role::Agent | Role::Pod) {
        // Naming none: the one service it writes, if one (as at the store).
        if reg.options.service.is_none() {
            reg.options.service = who.sole_service().map(str::to_owned);
        }
        let service = who.write_service(&key, reg.options.service.as_deref());
        if let Some(why) = who.refuses_write(&key, &service) {
            return Err(forbidden(why));
        }
        check_owner(&registry, &who, &key, now)?;
    }
    // A put for the service its key's first segment names (the putter's
    // own, or named explicitly) makes that service known.
    if reg.options.service.as_deref() == Some(key.service()) {
        services.extend(registry.know_services([key.service()]));
    }
    // Checked once the caller is known to be allowed (a refused caller
    // learns nothing of what its registration lacks). Integrity is anchored
    // here: a record without it could not tell a getter which manifest is
    // the published one.
    if reg.tensors.is_none() && reg.digest.is_none() {
        return Err(ApiError::bad_request(
            "a filesystem key's registration needs `digest`, the blake3 of its manifest's encoding",
        ));
    }
    // An agent registering a local key is alive, even before its first beat.
    let agent = match (reg.locale, &reg.holder) {
        (Locale::Local, Some(holder)) => registry.touch_agent(holder, &reg.source, None, now),
        _ => None,
    };
    registry
        .admits(&key, &reg, now)
        .map_err(|e| ApiError::new(ErrorCode::Conflict, e.to_string()))?;
    let record = registry.record_for(key, reg, now);
    s.db.write(&Batch {
        put_records: vec![record.clone()],
        put_agents: agent.into_iter().collect(),
        put_services: services,
        ..Batch::default()
    })
    .map_err(db_err)?;
    let replaced = registry.get_any(&record.key).cloned();
    registry.insert(record.clone());
    drop(registry);
    if let Some(old) =
        replaced.filter(|old| old.holder == STORE_HOLDER && record.holder != STORE_HOLDER)
    {
        // A `locale=local` put took the key over from the store: the store's
        // copy is no one's source any more. The store also finds such
        // orphans itself when it starts.
        let s = s.clone();
        tokio::spawn(kt_api::trace::carry(async move {
            drop_store_copy(&s, &old.source, &old.key, Some(&old.version)).await
        }));
    }
    Ok(ApiJson(record))
}

/// Refuses `who` (admin aside) a write of `key` owned by a service it does
/// not write: the one whose base path holds it, else its record's. A
/// caller always writes under its own services' base paths.
fn check_owner(registry: &Registry, who: &Principal, key: &Key, now: u64) -> Result<(), ApiError> {
    if !who.asks_owner(key) {
        return Ok(());
    }
    let owner = registry.owner(key, now);
    match who.refuses_takeover(key, owner.as_ref().map(|(o, base)| (o.as_str(), *base))) {
        Some(why) => Err(forbidden(why)),
        None => Ok(()),
    }
}

/// `GET /api/v1/owners/{key}`: which service may write `key` (the store
/// asks before it takes a put from a token limited to some services).
pub(super) async fn key_owner(
    State(s): State<AppState>,
    Path(key): Path<String>,
) -> Result<ApiJson<KeyOwner>, ApiError> {
    let key = Key::parse(&key)?;
    let owner = s.registry.lock().await.owner(&key, now_ms());
    Ok(ApiJson(KeyOwner {
        base_path: owner.as_ref().is_some_and(|(_, base)| *base),
        service: owner.map(|(s, _)| s),
        key,
    }))
}

/// Deletes the store's copy of a key after another holder took the key
/// over (`version`: the one superseded), or after a key another held was
/// deleted (any version: an orphan a failed takeover left). The store keeps
/// it if its record names the store again. Logged, not retried (the store's
/// start-up pass finds what is left).
async fn drop_store_copy(s: &Inner, store_url: &str, key: &Key, version: Option<&str>) {
    let mut query = vec![("orphaned", "true")];
    query.extend(version.map(|v| ("version", v)));
    let deleted = s
        .stores
        .at(store_url)
        .delete(&paths::tree(key))
        .query(&query)
        .ok()
        .await;
    match deleted {
        Ok(()) => {
            tracing::info!(%key, version, "store copy of a key no longer the store's deleted")
        }
        Err(e) if e.code() == ErrorCode::NotFound => {}
        Err(e) => {
            tracing::warn!(%key, version, error = %e, "could not delete the store copy of a key no longer the store's")
        }
    }
}

/// A store key is held by the store; a local key by the agent named in `holder`.
/// The largest `size` a registration may claim: what a manifest may sum
/// to ([`ManifestLimits::max_total_bytes`], 16 TiB). The figure is the
/// registrant's word (nothing here holds the manifest); bounding it keeps
/// the registry's per-service byte sums far from overflow.
fn max_registered_size() -> u64 {
    ManifestLimits::default().max_total_bytes
}

fn check_registration(reg: &RegisterKey) -> Result<(), ApiError> {
    let max = max_registered_size();
    if reg.size > max {
        return Err(ApiError::bad_request(format!(
            "size {} bytes is more than a key may hold ({max} bytes, the manifest limit): \
             register the sum of the version's file sizes",
            reg.size
        )));
    }
    check_service(reg.options.service.as_deref())?;
    check_url("source", &reg.source)?;
    match (reg.locale, reg.holder.as_deref()) {
        (Locale::Store, None | Some(STORE_HOLDER)) => Ok(()),
        (Locale::Store, Some(h)) => Err(ApiError::bad_request(format!(
            "a locale=store key is held by the store, not by {h:?}"
        ))),
        (Locale::Local, Some(h)) => check_agent_id(h),
        (Locale::Local, None) => Err(ApiError::bad_request(
            "a locale=local key needs its holder: the id of the agent serving it",
        )),
    }
}

pub(super) async fn get_key(
    State(s): State<AppState>,
    Extension(who): Extension<Principal>,
    Path(key): Path<String>,
) -> Result<ApiJson<KeyRecord>, ApiError> {
    let key = Key::parse(&key)?;
    let now = now_ms();
    let registry = s.registry.lock().await;
    // Refused first: a key the caller may not read is not said to be stale.
    if let Some(r) = registry.get_unexpired(&key, now) {
        kt_service::check_read(&who, &key, &r.service)?;
    }
    Ok(ApiJson(registry.served(&key, now)?.clone()))
}

/// `GET /api/v1/keys`: only the keys of services the caller's token reads.
pub(super) async fn list_keys(
    State(s): State<AppState>,
    Extension(who): Extension<Principal>,
    Query(q): Query<ListQuery>,
) -> Result<ApiJson<ListResponse>, ApiError> {
    let prefix = KeyPrefix::parse(&q.prefix)?;
    let visible = |r: &KeyRecord| who.reads(&r.service);
    let registry = s.registry.lock().await;
    let entries = if q.recursive {
        registry.list_below(&prefix, now_ms(), &visible)
    } else {
        registry.list(&prefix, now_ms(), &visible)
    };
    drop(registry);
    Ok(ApiJson(ListResponse {
        prefix: prefix.to_string(),
        entries,
    }))
}

pub(super) async fn delete_key(
    State(s): State<AppState>,
    Extension(who): Extension<Principal>,
    Path(key): Path<String>,
    Query(q): Query<DeleteQuery>,
) -> Result<ApiJson<DeleteResponse>, ApiError> {
    let key = Key::parse(&key)?;
    let now = now_ms();
    // A token that reads only some services sees no key of the others
    // here either (as in `ls`): they are neither named nor deleted.
    let visible = |r: &KeyRecord| who.reads(&r.service);
    let targets: Vec<KeyRecord> = {
        let reg = s.registry.lock().await;
        let has_children = || {
            if who.reads_all() {
                reg.has_children(&key, now)
            } else {
                reg.keys_within(&KeyPrefix::from(key.clone()), now)
                    .iter()
                    .any(|r| r.key != key && visible(r))
            }
        };
        if q.recursive {
            let mut within = reg.keys_within(&KeyPrefix::from(key.clone()), now);
            within.retain(visible);
            within
        } else {
            match reg.get_unexpired(&key, now).filter(|r| visible(r)) {
                Some(r) if q.version.as_ref().is_some_and(|v| *v != r.version) => {
                    return Err(ApiError::new(
                        ErrorCode::Conflict,
                        format!(
                            "{key} is at version {}, not {}: left as it is",
                            r.version,
                            q.version.as_deref().unwrap_or_default()
                        ),
                    ));
                }
                Some(r) => vec![r.clone()],
                None if has_children() => {
                    return Err(ApiError::new(
                        ErrorCode::Conflict,
                        format!(
                            "{key} is not a key but has keys below it; delete recursively (-r)"
                        ),
                    ));
                }
                None => return Err(ApiError::not_found(format!("key {key} not found"))),
            }
        }
    };
    if targets.is_empty() {
        return Err(ApiError::not_found(format!("nothing under {key}")));
    }
    // An agent drops only keys it holds; a workload only its services'
    // (the owner of a key under a service's base path is that service).
    {
        let mut registry = s.registry.lock().await;
        let new = note_services(&mut registry, &who);
        s.db.write(&Batch {
            put_services: new,
            ..Batch::default()
        })
        .map_err(db_err)?;
        let owner = |r: &KeyRecord| match registry.base_owner(&r.key) {
            Some(base) => base.to_owned(),
            None => r.service.clone(),
        };
        let writes = |r: &KeyRecord| who.serves(r.key.service()) || who.serves(&owner(r));
        if let Some(r) = targets.iter().find(|r| match who.role {
            Role::Admin => false,
            Role::Agent => !who.is_agent(&r.holder),
            Role::Pod => !who.is_agent(&r.holder) && !writes(r),
            _ => !writes(r),
        }) {
            return Err(forbidden(format!(
                "a {} token may not delete {} (service {:?}, held by {}): nothing was deleted",
                who.role,
                r.key,
                owner(r),
                r.holder
            )));
        }
    }
    let mut deleted = Vec::new();
    for r in targets {
        if let Err(e) = delete_one(&s, &r).await {
            return Err(partly_deleted(e, &deleted));
        }
        deleted.push(r.key);
    }
    Ok(ApiJson(DeleteResponse { deleted }))
}

/// A recursive delete that fails part way says which keys are gone
/// already: the caller must not think the tree is whole.
fn partly_deleted(e: ApiError, deleted: &[Key]) -> ApiError {
    const SHOWN: usize = 5;
    if deleted.is_empty() {
        return e;
    }
    let mut names = deleted
        .iter()
        .take(SHOWN)
        .map(ToString::to_string)
        .collect::<Vec<_>>()
        .join(", ");
    if deleted.len() > SHOWN {
        names.push_str(&format!(" and {} more", deleted.len() - SHOWN));
    }
    ApiError::new(
        e.code,
        format!(
            "{} ({} key(s) before it were deleted: {names})",
            e.message,
            deleted.len()
        ),
    )
}

/// Deletes a key's data at the store, then its record. A local key's record is
/// just dropped: its agent learns it from the `drop` list of its next beat.
pub(super) async fn delete_one(s: &AppState, r: &KeyRecord) -> Result<(), ApiError> {
    if r.locale == Locale::Store && r.holder == STORE_HOLDER {
        // Only the version this record names: a put that published since is kept.
        let deleted = s
            .stores
            .at(&r.source)
            .delete(&paths::tree(&r.key))
            .query(&[("version", r.version.as_str())])
            .ok()
            .await;
        match deleted {
            Ok(()) => {}
            Err(e) if e.code() == ErrorCode::NotFound => {}
            Err(e) if e.code() == ErrorCode::Conflict => {
                return Err(ApiError::new(
                    ErrorCode::Conflict,
                    format!(
                        "{} changed while it was being deleted and was kept; try again",
                        r.key
                    ),
                ));
            }
            Err(e @ kt_api::CallError::Transport { .. }) => {
                return Err(ApiError::new(
                    ErrorCode::Unavailable,
                    format!("store unreachable while deleting {}: {e}", r.key),
                ));
            }
            Err(e) => {
                return Err(ApiError::new(
                    ErrorCode::Unavailable,
                    format!("store refused to delete {}: {e}", r.key),
                ));
            }
        }
    }
    let mut registry = s.registry.lock().await;
    // A newer version registered meanwhile keeps its record.
    if registry
        .get_any(&r.key)
        .is_some_and(|cur| cur.version == r.version)
    {
        s.db.remove_record(&r.key).map_err(db_err)?;
        registry.remove(&r.key, now_ms());
        tracing::info!(key = %r.key, "key deleted");
        drop(registry);
        // A key an agent held may have left a store copy behind (a takeover
        // whose deletion failed): it goes now, unless the store holds it
        // for a record of its own again.
        if r.holder != STORE_HOLDER
            && let Some(store) = s.store_url.lock().await.clone()
        {
            let (s, key) = (s.clone(), r.key.clone());
            tokio::spawn(kt_api::trace::carry(async move {
                drop_store_copy(&s, &store, &key, None).await
            }));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_delete_failing_part_way_names_what_is_gone() {
        let e = || {
            ApiError::new(
                ErrorCode::Unavailable,
                "store unreachable while deleting t/c",
            )
        };
        assert_eq!(partly_deleted(e(), &[]).message, e().message);
        let keys: Vec<Key> = (0..7).map(|i| format!("t/k{i}").parse().unwrap()).collect();
        let two = partly_deleted(e(), &keys[..2]);
        assert_eq!(two.code, ErrorCode::Unavailable);
        assert!(
            two.message
                .ends_with("(2 key(s) before it were deleted: t/k0, t/k1)"),
            "{}",
            two.message
        );
        let seven = partly_deleted(e(), &keys);
        assert!(
            seven.message.contains("t/k4 and 2 more)"),
            "{}",
            seven.message
        );
    }
    use kt_types::api::PutOptions;

    fn reg(size: u64) -> RegisterKey {
        RegisterKey {
            locale: Locale::Store,
            source: "http://store".into(),
            holder: None,
            version: "v1".into(),
            is_dir: false,
            size,
            files: 1,
            tensors: None,
            digest: None,
            options: PutOptions::default(),
            only_if: None,
        }
    }

    /// A claimed size past the manifest limit is a 400 naming both
    /// figures; the limit itself is accepted.
    #[test]
    fn sizes_past_the_manifest_limit_are_refused() {
        let max = ManifestLimits::default().max_total_bytes;
        check_registration(&reg(max)).unwrap();
        check_registration(&reg(0)).unwrap();
        for size in [max + 1, u64::MAX / 2 + 1, u64::MAX] {
            let e = check_registration(&reg(size)).unwrap_err();
            assert_eq!(e.status(), axum::http::StatusCode::BAD_REQUEST);
            let text = e.to_string();
            assert!(
                text.contains(&size.to_string()) && text.contains(&max.to_string()),
                "{text}"
            );
        }
    }
}
