//! Persistence of the registry in redb: every mutation is committed before it is answered.
//!
//! The layout is versioned ([`FORMAT`], in the `meta` table): a database
//! written by an older kt is migrated when it is opened, in one
//! transaction, losing no record; one written by a newer kt is refused.
//!
//! - format 1 (no `format` entry): keys, agents, broadcasts, the store's URL.
//! - format 2: records may carry `lifespan_by_rule` (absent in format 1,
//!   whose records keep the lifespan they were put with), and the
//!   `services` table lists the known services (seeded from the agents'
//!   announced services when a format 1 database is migrated).

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
/// Known services by name (value: unused, empty); format 2.
const SERVICES: TableDefinition<&str, &[u8]> = TableDefinition::new("services");
const STORE_URL: &str = "store_url";
/// The `meta` entry holding the layout's version (absent: format 1).
const FORMAT_KEY: &str = "format";
/// The layout this build writes.
pub const FORMAT: u32 = 2;

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
    #[error(
        "state database is in format {found}, newer than this kt-metadata's {FORMAT}: run a newer kt-metadata (nothing was changed)"
    )]
    Newer { found: String },
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
    /// Known services, by name.
    pub services: Vec<String>,
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
    /// Services that became known.
    pub put_services: Vec<String>,
}

impl Batch {
    pub fn is_empty(&self) -> bool {
        self.put_records.is_empty()
            && self.remove_keys.is_empty()
            && self.put_agents.is_empty()
            && self.remove_agents.is_empty()
            && self.put_groups.is_empty()
            && self.remove_groups.is_empty()
            && self.put_services.is_empty()
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
        tx.open_table(AGENTS).map_err(redb_err)?;
        tx.open_table(BROADCASTS).map_err(redb_err)?;
        tx.open_table(SERVICES).map_err(redb_err)?;
        {
            let mut meta = tx.open_table(META).map_err(redb_err)?;
            let found = meta
                .get(FORMAT_KEY)
                .map_err(redb_err)?
                .map(|v| v.value().to_owned());
            match found.as_deref().map(str::parse::<u32>) {
                Some(Ok(FORMAT)) => {}
                // Format 1: no entry (a new database has nothing to migrate).
                None => {
                    let (records, services) = migrate_v1(&tx)?;
                    if records > 0 || services > 0 {
                        tracing::info!(
                            records,
                            services,
                            "state database migrated from format 1 to {FORMAT}"
                        );
                    }
                    meta.insert(FORMAT_KEY, FORMAT.to_string().as_str())
                        .map_err(redb_err)?;
                }
                Some(_) => {
                    // Dropped without a commit: the database is left as it was.
                    return Err(DbError::Newer {
                        found: found.unwrap_or_default(),
                    });
                }
            }
        }
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
        let mut services = Vec::new();
        for row in tx
            .open_table(SERVICES)
            .map_err(redb_err)?
            .iter()
            .map_err(redb_err)?
        {
            services.push(row.map_err(redb_err)?.0.value().to_owned());
        }
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
            services,
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
            let mut services = tx.open_table(SERVICES).map_err(redb_err)?;
            for name in &batch.put_services {
                services
                    .insert(name.as_str(), [].as_slice())
                    .map_err(redb_err)?;
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

/// Rewrites a format 1 database's records in format 2 (each must parse:
/// one that does not fails the open, and the uncommitted transaction
/// leaves the database as it was) and makes the services its agents
/// announced known. The records and services it wrote.
fn migrate_v1(tx: &redb::WriteTransaction) -> Result<(usize, usize), DbError> {
    let mut keys = tx.open_table(KEYS).map_err(redb_err)?;
    let mut records: Vec<KeyRecord> = Vec::new();
    for row in keys.iter().map_err(redb_err)? {
        let (k, v) = row.map_err(redb_err)?;
        // Format 1 records lack `lifespan_by_rule`: read as false, they
        // keep the lifespan they were put with.
        let r = serde_json::from_slice(v.value()).map_err(|source| DbError::Corrupt {
            key: k.value().to_owned(),
            source,
        })?;
        records.push(r);
    }
    for r in &records {
        let bytes = serde_json::to_vec(r).map_err(redb_err)?;
        keys.insert(r.key.as_str(), bytes.as_slice())
            .map_err(redb_err)?;
    }
    let mut announced = std::collections::BTreeSet::new();
    for row in tx
        .open_table(AGENTS)
        .map_err(redb_err)?
        .iter()
        .map_err(redb_err)?
    {
        let (k, v) = row.map_err(redb_err)?;
        let a: AgentInfo =
            serde_json::from_slice(v.value()).map_err(|source| DbError::Corrupt {
                key: k.value().to_owned(),
                source,
            })?;
        announced.extend(a.service);
    }
    let mut services = tx.open_table(SERVICES).map_err(redb_err)?;
    for name in &announced {
        services
            .insert(name.as_str(), [].as_slice())
            .map_err(redb_err)?;
    }
    Ok((records.len(), announced.len()))
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
            lifespan_by_rule: false,
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

    /// Writes `keys`, `agents` and `meta` rows as a kt before the format
    /// entry did (format 1), with redb directly.
    fn write_v1(dir: &Path, keys: &[(&str, &str)], agents: &[(&str, &str)]) {
        let db = Database::create(dir.join("registry.redb")).unwrap();
        let tx = db.begin_write().unwrap();
        {
            let mut t = tx.open_table(KEYS).unwrap();
            for (k, json) in keys {
                t.insert(*k, json.as_bytes()).unwrap();
            }
            let mut t = tx.open_table(AGENTS).unwrap();
            for (k, json) in agents {
                t.insert(*k, json.as_bytes()).unwrap();
            }
            tx.open_table(BROADCASTS).unwrap();
            tx.open_table(META)
                .unwrap()
                .insert(STORE_URL, "http://s")
                .unwrap();
        }
        tx.commit().unwrap();
    }

    #[test]
    fn a_format_1_database_is_migrated_without_losing_a_record() {
        let d = tempfile::tempdir().unwrap();
        // Records as kt wrote them before the lifespan rule: no
        // `lifespan_by_rule`, a lifespan each.
        let keys = [
            (
                "models/final",
                r#"{"key":"models/final","locale":"store","source":"http://s","holder":"store",
                "version":"v1","is_dir":true,"size":3,"files":1,"lifespan":"cluster",
                "service":"models","created_at_ms":1,"updated_at_ms":2}"#,
            ),
            (
                "trainer/keep",
                r#"{"key":"trainer/keep","locale":"store","source":"http://s","version":"v2",
                "is_dir":false,"size":1,"files":1,"lifespan":"cluster","service":"trainer",
                "expires_at_ms":99,"created_at_ms":1,"updated_at_ms":1}"#,
            ),
            (
                "trainer/temp",
                r#"{"key":"trainer/temp","locale":"local","source":"http://p1","holder":"p1",
                "peers":[{"id":"p2","url":"http://p2","version":"v3"}],"version":"v3",
                "is_dir":true,"size":5,"files":2,"lifespan":"resource","service":"trainer",
                "created_at_ms":3,"updated_at_ms":4}"#,
            ),
        ];
        let agents = [
            (
                "p1",
                r#"{"id":"p1","url":"http://p1","service":"trainer","last_seen_ms":7}"#,
            ),
            ("p2", r#"{"id":"p2","url":"http://p2","last_seen_ms":7}"#),
        ];
        write_v1(d.path(), &keys, &agents);
        let (db, loaded) = Db::open(d.path()).unwrap();
        let found: Vec<(String, Lifespan, bool)> = loaded
            .records
            .iter()
            .map(|r| (r.key.to_string(), r.lifespan, r.lifespan_by_rule))
            .collect();
        // Every record, each with the lifespan it was put with.
        assert_eq!(
            found,
            [
                ("models/final".to_owned(), Lifespan::Cluster, false),
                ("trainer/keep".to_owned(), Lifespan::Cluster, false),
                ("trainer/temp".to_owned(), Lifespan::Resource, false),
            ]
        );
        let temp = &loaded.records[2];
        assert_eq!((temp.holder.as_str(), temp.peers.len()), ("p1", 1));
        assert_eq!(loaded.records[1].expires_at_ms, Some(99));
        assert_eq!(loaded.agents.len(), 2);
        assert_eq!(loaded.store_url.as_deref(), Some("http://s"));
        // The services agents announced are known.
        assert_eq!(loaded.services, ["trainer"]);
        drop(db);
        // Stamped: opened again, nothing changes.
        let tx = Database::create(d.path().join("registry.redb"))
            .unwrap()
            .begin_read()
            .unwrap()
            .open_table(META)
            .unwrap()
            .get(FORMAT_KEY)
            .unwrap()
            .map(|v| v.value().to_owned());
        assert_eq!(tx.as_deref(), Some("2"));
        let again = Db::open(d.path()).unwrap().1;
        assert_eq!(again.records, loaded.records);
        assert_eq!(again.services, loaded.services);
    }

    #[test]
    fn a_corrupt_format_1_record_fails_the_open_and_changes_nothing() {
        let d = tempfile::tempdir().unwrap();
        write_v1(d.path(), &[("a/b", "{not json")], &[]);
        let err = Db::open(d.path()).unwrap_err();
        assert!(
            matches!(&err, DbError::Corrupt { key, .. } if key == "a/b"),
            "{err}"
        );
        // Not stamped: a fixed build may still migrate it.
        let db = Database::create(d.path().join("registry.redb")).unwrap();
        let meta = db.begin_read().unwrap().open_table(META).unwrap();
        assert!(meta.get(FORMAT_KEY).unwrap().is_none());
    }

    #[test]
    fn a_newer_format_is_refused_untouched() {
        let d = tempfile::tempdir().unwrap();
        {
            let db = Database::create(d.path().join("registry.redb")).unwrap();
            let tx = db.begin_write().unwrap();
            tx.open_table(META)
                .unwrap()
                .insert(FORMAT_KEY, "3")
                .unwrap();
            tx.commit().unwrap();
        }
        let err = Db::open(d.path()).unwrap_err();
        assert!(err.to_string().contains("format 3, newer than"), "{err}");
    }

    #[test]
    fn known_services_survive_reopen() {
        let d = tempfile::tempdir().unwrap();
        {
            let (db, loaded) = Db::open(d.path()).unwrap();
            assert!(loaded.services.is_empty());
            db.write(&Batch {
                put_services: vec!["b".into(), "a".into()],
                ..Batch::default()
            })
            .unwrap();
        }
        assert_eq!(Db::open(d.path()).unwrap().1.services, ["a", "b"]);
    }
}
