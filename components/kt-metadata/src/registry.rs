//! The key registry as a plain state machine: no I/O, no clock (callers pass `now`).

use std::collections::BTreeMap;

use kt_types::api::{ListEntry, RegisterKey};
use kt_types::{Key, KeyPrefix, KeyRecord};

#[derive(Debug, Default, Clone)]
pub struct Registry {
    keys: BTreeMap<Key, KeyRecord>,
}

impl Registry {
    pub fn from_records(records: impl IntoIterator<Item = KeyRecord>) -> Self {
        Registry {
            keys: records.into_iter().map(|r| (r.key.clone(), r)).collect(),
        }
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

    pub fn insert(&mut self, record: KeyRecord) {
        self.keys.insert(record.key.clone(), record);
    }

    /// The record a registration would produce, without applying it.
    pub fn record_for(&self, key: Key, reg: RegisterKey, now_ms: u64) -> KeyRecord {
        let created_at_ms = self
            .keys
            .get(&key)
            .map(|r| r.created_at_ms)
            .unwrap_or(now_ms);
        let service = reg
            .options
            .service
            .clone()
            .unwrap_or_else(|| key.service().to_owned());
        KeyRecord {
            locale: reg.locale,
            source: reg.source,
            holder: reg
                .holder
                .unwrap_or_else(|| kt_types::STORE_HOLDER.to_owned()),
            // A new version: earlier copies no longer match.
            peers: Vec::new(),
            version: reg.version,
            is_dir: reg.is_dir,
            size: reg.size,
            files: reg.files,
            lifespan: reg.options.lifespan,
            service,
            expires_at_ms: reg
                .options
                .ttl_secs
                .map(|t| now_ms.saturating_add(t.saturating_mul(1000))),
            created_at_ms,
            updated_at_ms: now_ms,
            key,
        }
    }

    /// A live (unexpired) record.
    pub fn get(&self, key: &Key, now_ms: u64) -> Option<&KeyRecord> {
        self.keys.get(key).filter(|r| !is_expired(r, now_ms))
    }

    /// A record, expired or not.
    pub fn get_any(&self, key: &Key) -> Option<&KeyRecord> {
        self.keys.get(key)
    }

    pub fn remove(&mut self, key: &Key) -> Option<KeyRecord> {
        self.keys.remove(key)
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

    /// The immediate children of `prefix`: one entry per name, merged across keys.
    pub fn list(&self, prefix: &KeyPrefix, now_ms: u64) -> Vec<ListEntry> {
        let mut out: BTreeMap<String, ListEntry> = BTreeMap::new();
        for r in self.keys_within(prefix, now_ms) {
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
            && let Some(r) = self.get(&key, now_ms)
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

    /// Records whose TTL has passed.
    pub fn expired(&self, now_ms: u64) -> Vec<KeyRecord> {
        self.keys
            .values()
            .filter(|r| is_expired(r, now_ms))
            .cloned()
            .collect()
    }
}

fn is_expired(r: &KeyRecord, now_ms: u64) -> bool {
    r.expires_at_ms.is_some_and(|t| t <= now_ms)
}

#[cfg(test)]
mod tests {
    use super::*;
    use kt_types::api::PutOptions;
    use kt_types::{Lifespan, Locale};

    fn reg(ttl: Option<u64>) -> RegisterKey {
        RegisterKey {
            holder: None,
            locale: Locale::Store,
            source: "http://store".into(),
            version: "v1".into(),
            is_dir: true,
            size: 10,
            files: 2,
            options: PutOptions {
                lifespan: Lifespan::Cluster,
                ttl_secs: ttl,
                service: None,
            },
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
            r.list(&KeyPrefix::parse(p).unwrap(), 1)
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
    fn ttl_hides_and_reports_expired() {
        let mut r = Registry::default();
        r.upsert(k("t/x"), reg(Some(10)), 1_000);
        assert!(r.get(&k("t/x"), 10_999).is_some());
        assert!(r.get(&k("t/x"), 11_000).is_none());
        assert_eq!(r.expired(11_000).len(), 1);
        assert!(r.list(&KeyPrefix::root(), 11_000).is_empty());
    }
}
