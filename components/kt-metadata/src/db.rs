//! Persistence of the registry in redb: every mutation is committed before it is answered.

use std::path::Path;

use kt_types::{Key, KeyRecord};
use redb::{Database, ReadableTable, TableDefinition};

const KEYS: TableDefinition<&str, &[u8]> = TableDefinition::new("keys");
const META: TableDefinition<&str, &str> = TableDefinition::new("meta");
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
    pub store_url: Option<String>,
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
        tx.commit().map_err(redb_err)?;
        let this = Db { db };
        let loaded = this.load()?;
        Ok((this, loaded))
    }

    fn load(&self) -> Result<Loaded, DbError> {
        let tx = self.db.begin_read().map_err(redb_err)?;
        let keys = tx.open_table(KEYS).map_err(redb_err)?;
        let mut records = Vec::new();
        for row in keys.iter().map_err(redb_err)? {
            let (k, v) = row.map_err(redb_err)?;
            let rec: KeyRecord =
                serde_json::from_slice(v.value()).map_err(|source| DbError::Corrupt {
                    key: k.value().to_owned(),
                    source,
                })?;
            records.push(rec);
        }
        let meta = tx.open_table(META).map_err(redb_err)?;
        let store_url = meta
            .get(STORE_URL)
            .map_err(redb_err)?
            .map(|v| v.value().to_owned());
        Ok(Loaded { records, store_url })
    }

    pub fn put_record(&self, r: &KeyRecord) -> Result<(), DbError> {
        let bytes = serde_json::to_vec(r).map_err(redb_err)?;
        let tx = self.db.begin_write().map_err(redb_err)?;
        tx.open_table(KEYS)
            .map_err(redb_err)?
            .insert(r.key.as_str(), bytes.as_slice())
            .map_err(redb_err)?;
        tx.commit().map_err(redb_err)
    }

    pub fn remove_record(&self, key: &Key) -> Result<(), DbError> {
        let tx = self.db.begin_write().map_err(redb_err)?;
        tx.open_table(KEYS)
            .map_err(redb_err)?
            .remove(key.as_str())
            .map_err(redb_err)?;
        tx.commit().map_err(redb_err)
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
            lifespan: Lifespan::Resource,
            service: "a".into(),
            expires_at_ms: Some(5),
            created_at_ms: 1,
            updated_at_ms: 2,
        };
        {
            let (db, loaded) = Db::open(d.path()).unwrap();
            assert!(loaded.records.is_empty());
            db.put_record(&rec).unwrap();
            db.set_store_url("http://s").unwrap();
        }
        let (db, loaded) = Db::open(d.path()).unwrap();
        assert_eq!(loaded.records, vec![rec.clone()]);
        assert_eq!(loaded.store_url.as_deref(), Some("http://s"));
        db.remove_record(&rec.key).unwrap();
        drop(db);
        assert!(Db::open(d.path()).unwrap().1.records.is_empty());
    }
}
