//! Persistence of the registry in redb: every mutation is committed before it is answered.

use std::path::Path;

use kt_types::api::AgentInfo;
use kt_types::{Key, KeyRecord};
use redb::{Database, ReadableTable, TableDefinition};

use crate::broadcast::GroupRecord;

const KEYS: TableDefinition<&str, &[u8]> = TableDefinition::new("keys");
const META: TableDefinition<&str, &str> = TableDefinition::new("meta");
/// Node agents by id (JSON [`AgentInfo`]; `last_seen_ms` is not meaningful after a restart).
const AGENTS: TableDefinition<&str, &[u8]> = TableDefinition::new("agents");
/// Broadcast groups by id (JSON [`GroupRecord`]: no members, which rejoin).
const BROADCASTS: TableDefinition<&str, &[u8]> = TableDefinition::new("broadcasts");
const STORE_URL: &str = "store_url";

#[derive(Debug, thiserror::Error)]
pub enum DbError {
    #[error("state database: {0}")]
    Redb(String),
    #[error("state database holds a corrupt record for {key}: {source}")]
    Corrupt {
        key: String,
        #[source]
        source: serde_json::Error,
    },
    #[error("state directory {path}: {source}")]
    Dir {
        path: String,
        #[source]
        source: std::io::Error,
    },
}

fn redb_err(e: impl std::fmt::Display) -> DbError {
    DbError::Redb(e.to_string())
}

#[derive(Debug)]
pub struct Db {
    db: Database,
}

/// What the database held at start.
#[derive(Debug, Default)]
pub struct Loaded {
    pub records: Vec<KeyRecord>,
    pub agents: Vec<AgentInfo>,
    pub store_url: Option<String>,
    pub groups: Vec<GroupRecord>,
}

/// Mutations committed together, in one transaction.
#[derive(Debug, Default, Clone, PartialEq)]
pub struct Batch {
    pub put_records: Vec<KeyRecord>,
    pub remove_keys: Vec<Key>,
    pub put_agents: Vec<AgentInfo>,
    pub remove_agents: Vec<String>,
    pub put_groups: Vec<GroupRecord>,
    /// Broadcast group ids.
    pub remove_groups: Vec<String>,
}

impl Batch {
    pub fn is_empty(&self) -> bool {
        self.put_records.is_empty()
            && self.remove_keys.is_empty()
            && self.put_agents.is_empty()
            && self.remove_agents.is_empty()
            && self.put_groups.is_empty()
            && self.remove_groups.is_empty()
    }
}

impl Db {
    pub fn open(state_dir: &Path) -> Result<(Self, Loaded), DbError> {
        std::fs::create_dir_all(state_dir).map_err(|source| DbError::Dir {
            path: state_dir.display().to_string(),
            source,
        })?;
        let db = Database::create(state_dir.join("registry.redb")).map_err(redb_err)?;
        let tx = db.begin_write().map_err(redb_err)?;
        tx.open_table(KEYS).map_err(redb_err)?;
        tx.open_table(META).map_err(redb_err)?;
        tx.open_table(AGENTS).map_err(redb_err)?;
        tx.open_table(BROADCASTS).map_err(redb_err)?;
        tx.commit().map_err(redb_err)?;
        let this = Db { db };
        let loaded = this.load()?;
        Ok((this, loaded))
    }

    fn load(&self) -> Result<Loaded, DbError> {
        let tx = self.db.begin_read().map_err(redb_err)?;
        let records = read_json(&tx.open_table(KEYS).map_err(redb_err)?)?;
        let agents = read_json(&tx.open_table(AGENTS).map_err(redb_err)?)?;
        let groups = read_json(&tx.open_table(BROADCASTS).map_err(redb_err)?)?;
        let meta = tx.open_table(META).map_err(redb_err)?;
        let store_url = meta
            .get(STORE_URL)
            .map_err(redb_err)?
            .map(|v| v.value().to_owned());
        Ok(Loaded {
            records,
            agents,
            store_url,
            groups,
        })
    }

    /// Commits `batch` (nothing when it is empty).
    pub fn write(&self, batch: &Batch) -> Result<(), DbError> {
        if batch.is_empty() {
            return Ok(());
        }
        let tx = self.db.begin_write().map_err(redb_err)?;
        {
            let mut keys = tx.open_table(KEYS).map_err(redb_err)?;
            for r in &batch.put_records {
                let bytes = serde_json::to_vec(r).map_err(redb_err)?;
                keys.insert(r.key.as_str(), bytes.as_slice())
                    .map_err(redb_err)?;
            }
            for k in &batch.remove_keys {
                keys.remove(k.as_str()).map_err(redb_err)?;
            }
            let mut agents = tx.open_table(AGENTS).map_err(redb_err)?;
            for a in &batch.put_agents {
                let bytes = serde_json::to_vec(a).map_err(redb_err)?;
                agents
                    .insert(a.id.as_str(), bytes.as_slice())
                    .map_err(redb_err)?;
            }
            for id in &batch.remove_agents {
                agents.remove(id.as_str()).map_err(redb_err)?;
            }
            let mut groups = tx.open_table(BROADCASTS).map_err(redb_err)?;
            for g in &batch.put_groups {
                // Reservations are committed from several tasks: whatever
                // order they land in, the one kept is the largest.
                let stored = groups
                    .get(g.id.as_str())
                    .map_err(redb_err)?
                    .and_then(|v| serde_json::from_slice::<GroupRecord>(v.value()).ok());
                let mut g = g.clone();
                if let Some(stored) = stored {
                    g.reserved = g.reserved.max(stored.reserved);
                }
                let bytes = serde_json::to_vec(&g).map_err(redb_err)?;
                groups
                    .insert(g.id.as_str(), bytes.as_slice())
                    .map_err(redb_err)?;
            }
            for id in &batch.remove_groups {
                groups.remove(id.as_str()).map_err(redb_err)?;
            }
        }
        tx.commit().map_err(redb_err)
    }

    pub fn put_record(&self, r: &KeyRecord) -> Result<(), DbError> {
        self.write(&Batch {
            put_records: vec![r.clone()],
            ..Batch::default()
        })
    }

    pub fn remove_record(&self, key: &Key) -> Result<(), DbError> {
        self.write(&Batch {
            remove_keys: vec![key.clone()],
            ..Batch::default()
        })
    }

    pub fn set_store_url(&self, url: &str) -> Result<(), DbError> {
        let tx = self.db.begin_write().map_err(redb_err)?;
        tx.open_table(META)
            .map_err(redb_err)?
            .insert(STORE_URL, url)
            .map_err(redb_err)?;
        tx.commit().map_err(redb_err)
    }
}

/// Every row of a table of JSON values.
fn read_json<T: serde::de::DeserializeOwned>(
    table: &redb::ReadOnlyTable<&str, &[u8]>,
) -> Result<Vec<T>, DbError> {
    let mut out = Vec::new();
    for row in table.iter().map_err(redb_err)? {
        let (k, v) = row.map_err(redb_err)?;
        let value = serde_json::from_slice(v.value()).map_err(|source| DbError::Corrupt {
            key: k.value().to_owned(),
            source,
        })?;
        out.push(value);
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use kt_types::{Lifespan, Locale};

    #[test]
    fn survives_reopen() {
        let d = tempfile::tempdir().unwrap();
        let rec = KeyRecord {
            holder: kt_types::STORE_HOLDER.to_owned(),
            peers: vec![],
            key: Key::parse("a/b").unwrap(),
            locale: Locale::Store,
            source: "http://s".into(),
            version: "v".into(),
            is_dir: false,
            size: 1,
            files: 1,
            tensors: None,
            digest: Some(kt_types::Hash([7; 32])),
            lifespan: Lifespan::Resource,
            service: "a".into(),
            expires_at_ms: Some(5),
            created_at_ms: 1,
            updated_at_ms: 2,
        };
        let agent = |id: &str| AgentInfo {
            id: id.into(),
            url: format!("http://{id}"),
            service: Some("a".into()),
            last_seen_ms: 7,
        };
        let mut local = rec.clone();
        local.key = Key::parse("a/local").unwrap();
        local.locale = Locale::Local;
        local.holder = "p1".into();
        local.peers = vec![kt_types::Source {
            id: "p2".into(),
            url: "http://p2".into(),
            version: "v".into(),
        }];
        {
            let (db, loaded) = Db::open(d.path()).unwrap();
            assert!(loaded.records.is_empty() && loaded.agents.is_empty());
            db.put_record(&rec).unwrap();
            db.set_store_url("http://s").unwrap();
            db.write(&Batch {
                put_records: vec![local.clone()],
                put_agents: vec![agent("p1"), agent("p2")],
                ..Batch::default()
            })
            .unwrap();
        }
        let (db, loaded) = Db::open(d.path()).unwrap();
        assert_eq!(loaded.records, vec![rec.clone(), local.clone()]);
        assert_eq!(loaded.agents, vec![agent("p1"), agent("p2")]);
        assert_eq!(loaded.store_url.as_deref(), Some("http://s"));
        db.remove_record(&rec.key).unwrap();
        db.write(&Batch {
            remove_agents: vec!["p2".into()],
            ..Batch::default()
        })
        .unwrap();
        drop(db);
        let loaded = Db::open(d.path()).unwrap().1;
        assert_eq!(loaded.records, vec![local]);
        assert_eq!(loaded.agents, vec![agent("p1")]);
    }

    #[test]
    fn broadcast_groups_survive_reopen() {
        let d = tempfile::tempdir().unwrap();
        let group = |id: &str, reserved: u32| GroupRecord {
            id: id.into(),
            key: Key::parse("a/b").unwrap(),
            version: "v1".into(),
            fanout: 50,
            origin: kt_types::broadcast::Parent {
                rank: 0,
                url: "http://s".into(),
                id: "store".into(),
                key: None,
            },
            created_ms: 1,
            window_ms: 60_000,
            named: true,
            reserved,
            auto_fanout: false,
            secret_key: "ab".repeat(32),
        };
        {
            let (db, loaded) = Db::open(d.path()).unwrap();
            assert!(loaded.groups.is_empty());
            db.write(&Batch {
                put_groups: vec![group("g1", 257), group("g2", 257)],
                ..Batch::default()
            })
            .unwrap();
            db.write(&Batch {
                put_groups: vec![group("g1", 769)],
                remove_groups: vec!["g2".into()],
                ..Batch::default()
            })
            .unwrap();
            // A reservation that lands late never shrinks the stored one.
            let mut late = group("g1", 513);
            late.window_ms = 1;
            db.write(&Batch {
                put_groups: vec![late],
                ..Batch::default()
            })
            .unwrap();
        }
        let loaded = Db::open(d.path()).unwrap().1;
        let mut want = group("g1", 769);
        want.window_ms = 1;
        assert_eq!(loaded.groups, vec![want]);
    }
}
