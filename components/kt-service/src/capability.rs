//! Capabilities: what a getter shows a peer source instead of its token.
//!
//! The metadata server mints one with every source lease on a node agent
//! (with every broadcast parent that is an agent, and with every tensor
//! grant, one per key of a point-to-point tensor get): a
//! [`kt_types::auth::Capability`] naming one key's version, the source it
//! is valid at, the getter and an expiry, signed with Ed25519. The agent
//! checks the signature against the public keys the metadata server hands
//! it with every heartbeat reply, so it never calls back, and never sees a
//! bearer token a getter holds. A capability is worth one key's version at
//! one agent for a few minutes; a stolen one reads what its thief was
//! already leased.
//!
//! Signing keys live in the metadata server's state directory
//! (`capability-keys.json`, mode 0600), so a restart does not void the
//! capabilities in flight. A key signs for [`ROTATE_AFTER`]; then a new
//! one is made and the old one is still published for [`RETIRED_FOR`], past
//! the life of any capability it signed.

use std::path::{Path, PathBuf};
use std::sync::RwLock;
use std::time::Duration;

use base64::Engine;
use base64::engine::general_purpose::URL_SAFE_NO_PAD as B64;
use kt_types::auth::{Capability, Scope};
use ring::rand::SystemRandom;
use ring::signature::{ED25519, Ed25519KeyPair, KeyPair, UnparsedPublicKey};
use serde::{Deserialize, Serialize};

/// How long a capability is valid after it is minted: a getter opens the
/// source with it at once (a read lease then carries the transfer).
pub const LIFETIME: Duration = Duration::from_secs(300);
/// How far a source's clock may run ahead of the metadata server's.
pub const CLOCK_SKEW: Duration = Duration::from_secs(60);
/// How long one key signs before a new one is made.
pub const ROTATE_AFTER: Duration = Duration::from_secs(24 * 3600);
/// How long a retired key is still published (longer than [`LIFETIME`]).
pub const RETIRED_FOR: Duration = Duration::from_secs(3600);
/// A capability longer than this is refused unread.
const MAX_LEN: usize = 4096;

#[derive(Debug, thiserror::Error)]
pub enum CapabilityError {
    #[error("capability keys {path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("capability keys {path}: {why}")]
    Damaged { path: PathBuf, why: String },
    #[error("making a signing key: {0}")]
    Crypto(String),
}

/// One signing key.
struct Key {
    pair: Ed25519KeyPair,
    pkcs8: Vec<u8>,
    created_ms: u64,
    kid: String,
}

impl Key {
    fn new(pkcs8: Vec<u8>, created_ms: u64) -> Result<Key, String> {
        let pair = Ed25519KeyPair::from_pkcs8(&pkcs8).map_err(|e| e.to_string())?;
        let kid = kid_of(pair.public_key().as_ref());
        Ok(Key {
            pair,
            pkcs8,
            created_ms,
            kid,
        })
    }

    fn generate(created_ms: u64) -> Result<Key, CapabilityError> {
        let doc = Ed25519KeyPair::generate_pkcs8(&SystemRandom::new())
            .map_err(|e| CapabilityError::Crypto(e.to_string()))?;
        Key::new(doc.as_ref().to_vec(), created_ms).map_err(CapabilityError::Crypto)
    }
}

fn kid_of(public: &[u8]) -> String {
    hex::encode(&blake3::hash(public).as_bytes()[..8])
}

/// The keys file.
#[derive(Serialize, Deserialize)]
struct KeysFile {
    keys: Vec<StoredKey>,
}

#[derive(Serialize, Deserialize)]
struct StoredKey {
    created_ms: u64,
    /// PKCS#8, base64url.
    pkcs8: String,
}

/// The metadata server's signing keys, newest first.
pub struct Signer {
    keys: RwLock<Vec<Key>>,
    /// Where they are kept; `None`: in memory only (tests).
    path: Option<PathBuf>,
}

impl std::fmt::Debug for Signer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Signer")
            .field(
                "kids",
                &self.read().iter().map(|k| &k.kid).collect::<Vec<_>>(),
            )
            .field("path", &self.path)
            .finish()
    }
}

impl Signer {
    /// A signer whose keys live in memory only.
    pub fn ephemeral(now_ms: u64) -> Result<Signer, CapabilityError> {
        Ok(Signer {
            keys: RwLock::new(vec![Key::generate(now_ms)?]),
            path: None,
        })
    }

    /// The keys kept in `dir` (made there the first time), rotated if due.
    pub fn load_or_create(dir: &Path, now_ms: u64) -> Result<Signer, CapabilityError> {
        let path = dir.join("capability-keys.json");
        let damaged = |why: String| CapabilityError::Damaged {
            path: path.clone(),
            why,
        };
        let keys = match std::fs::read(&path) {
            Ok(bytes) => {
                let file: KeysFile =
                    serde_json::from_slice(&bytes).map_err(|e| damaged(e.to_string()))?;
                let mut keys = Vec::new();
                for k in file.keys {
                    let pkcs8 = B64.decode(&k.pkcs8).map_err(|e| damaged(e.to_string()))?;
                    keys.push(Key::new(pkcs8, k.created_ms).map_err(damaged)?);
                }
                keys
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Vec::new(),
            Err(source) => return Err(CapabilityError::Io { path, source }),
        };
        let signer = Signer {
            keys: RwLock::new(keys),
            path: Some(path),
        };
        signer.rotate_if_due(now_ms)?;
        Ok(signer)
    }

    fn read(&self) -> std::sync::RwLockReadGuard<'_, Vec<Key>> {
        self.keys.read().unwrap_or_else(|p| p.into_inner())
    }

    /// Makes a new key when there is none or the newest has signed for
    /// [`ROTATE_AFTER`], drops those retired for longer than
    /// [`RETIRED_FOR`], and saves the set when it changed.
    pub fn rotate_if_due(&self, now_ms: u64) -> Result<(), CapabilityError> {
        let rotate_after = ROTATE_AFTER.as_millis() as u64;
        let due = self
            .read()
            .first()
            .is_none_or(|k| now_ms.saturating_sub(k.created_ms) >= rotate_after);
        if !due {
            return Ok(());
        }
        let mut keys = self.keys.write().unwrap_or_else(|p| p.into_inner());
        if keys
            .first()
            .is_some_and(|k| now_ms.saturating_sub(k.created_ms) < rotate_after)
        {
            return Ok(()); // another caller rotated meanwhile
        }
        let fresh = Key::generate(now_ms)?;
        // A key retires when the next one is made: keep it while its
        // successor is younger than RETIRED_FOR.
        let keep_until = RETIRED_FOR.as_millis() as u64;
        let mut next = vec![fresh];
        let mut successor_made = now_ms;
        for k in keys.drain(..) {
            if now_ms.saturating_sub(successor_made) < keep_until {
                successor_made = k.created_ms;
                next.push(k);
            }
        }
        *keys = next;
        if let Some(path) = &self.path {
            save(path, &keys)?;
        }
        tracing::info!(kid = %keys[0].kid, published = keys.len(), "capability signing key made");
        Ok(())
    }

    /// The public keys to publish (base64url), newest first.
    pub fn public_keys(&self) -> Vec<String> {
        self.read()
            .iter()
            .map(|k| B64.encode(k.pair.public_key().as_ref()))
            .collect()
    }

    /// A capability for `scope` at `source`, minted for `getter`, valid for
    /// [`LIFETIME`] from `now_ms`.
    pub fn mint(&self, scope: Scope, source: &str, getter: &str, now_ms: u64) -> String {
        self.mint_bound(scope, source, getter, None, now_ms)
    }

    /// [`Signer::mint`], bound to the getter's pod IP `ip` when its token is
    /// bound to one ([`Capability::ip`]: a tensor session names it).
    pub fn mint_bound(
        &self,
        scope: Scope,
        source: &str,
        getter: &str,
        ip: Option<std::net::IpAddr>,
        now_ms: u64,
    ) -> String {
        if let Err(e) = self.rotate_if_due(now_ms) {
            // The current key goes on signing: capabilities still work.
            tracing::warn!(error = %e, "rotating the capability signing key");
        }
        let keys = self.read();
        let key = &keys[0];
        let cap = Capability {
            scope,
            source: source.to_owned(),
            getter: getter.to_owned(),
            ip,
            expires_ms: now_ms + LIFETIME.as_millis() as u64,
            kid: key.kid.clone(),
        };
        let payload = B64.encode(serde_json::to_vec(&cap).unwrap_or_default());
        let sig = key.pair.sign(payload.as_bytes());
        format!(
            "{}{payload}.{}",
            Capability::PREFIX,
            B64.encode(sig.as_ref())
        )
    }
}

fn save(path: &Path, keys: &[Key]) -> Result<(), CapabilityError> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    let file = KeysFile {
        keys: keys
            .iter()
            .map(|k| StoredKey {
                created_ms: k.created_ms,
                pkcs8: B64.encode(&k.pkcs8),
            })
            .collect(),
    };
    let io = |source| CapabilityError::Io {
        path: path.to_owned(),
        source,
    };
    let tmp = path.with_extension("json.tmp");
    let _ = std::fs::remove_file(&tmp);
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(&tmp)
        .map_err(io)?;
    f.write_all(&serde_json::to_vec(&file).unwrap_or_default())
        .map_err(io)?;
    f.sync_all().map_err(io)?;
    std::fs::rename(&tmp, path).map_err(io)
}

/// Why a capability is not accepted.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Refused {
    /// Signed by a key this source has not been given yet (it has just
    /// started, or the metadata server made a new key since its last
    /// heartbeat): worth trying again in a moment.
    #[error(
        "capability signed by key {0}, which this agent has not been given yet (it learns the keys with its heartbeats)"
    )]
    UnknownKey(String),
    /// Malformed, forged, for another source, or expired: final.
    #[error("{0}")]
    Invalid(String),
}

// Texts of failures `?` turns into `Invalid`.
impl From<String> for Refused {
    fn from(why: String) -> Refused {
        Refused::Invalid(why)
    }
}

impl From<&str> for Refused {
    fn from(why: &str) -> Refused {
        Refused::Invalid(why.to_owned())
    }
}

/// A source's check of the capabilities it is shown: signed by a key the
/// metadata server published, made for this source, not expired.
#[derive(Debug)]
pub struct Verifier {
    source: String,
    /// (kid, public key), as the last heartbeat reply listed them.
    keys: RwLock<Vec<(String, Vec<u8>)>>,
}

impl Verifier {
    /// The verifier of the source (agent) `source`; it trusts no key until
    /// [`Verifier::set_keys`].
    pub fn new(source: impl Into<String>) -> Verifier {
        Verifier {
            source: source.into(),
            keys: RwLock::default(),
        }
    }

    /// Trusts exactly these public keys (base64url), as published.
    pub fn set_keys(&self, published: &[String]) {
        let keys: Vec<(String, Vec<u8>)> = published
            .iter()
            .filter_map(|k| B64.decode(k).ok())
            .filter(|k| k.len() == 32)
            .map(|k| (kid_of(&k), k))
            .collect();
        *self.keys.write().unwrap_or_else(|p| p.into_inner()) = keys;
    }

    /// The capability `presented` is, checked; why not, otherwise.
    pub fn verify(&self, presented: &str, now_ms: u64) -> Result<Capability, Refused> {
        if presented.len() > MAX_LEN {
            return Err("capability too long".into());
        }
        let rest = presented
            .strip_prefix(Capability::PREFIX)
            .ok_or("not a capability")?;
        let (payload, sig) = rest.split_once('.').ok_or("malformed capability")?;
        let sig = B64
            .decode(sig)
            .map_err(|_| "malformed capability signature")?;
        let claims = B64.decode(payload).map_err(|_| "malformed capability")?;
        let cap: Capability =
            serde_json::from_slice(&claims).map_err(|e| format!("malformed capability: {e}"))?;
        let public = {
            let keys = self.keys.read().unwrap_or_else(|p| p.into_inner());
            keys.iter()
                .find(|(kid, _)| *kid == cap.kid)
                .map(|(_, k)| k.clone())
                .ok_or_else(|| Refused::UnknownKey(cap.kid.clone()))?
        };
        UnparsedPublicKey::new(&ED25519, &public)
            .verify(payload.as_bytes(), &sig)
            .map_err(|_| "capability signature does not verify")?;
        if cap.source != self.source {
            return Err(format!(
                "capability is for source {:?}, not {:?}",
                cap.source, self.source
            )
            .into());
        }
        if now_ms > cap.expires_ms + CLOCK_SKEW.as_millis() as u64 {
            return Err("capability expired".into());
        }
        Ok(cap)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scope(k: &str) -> Scope {
        Scope {
            key: kt_types::Key::parse(k).unwrap(),
            version: "v1".into(),
        }
    }

    #[test]
    fn a_minted_capability_verifies_only_where_and_while_it_is_valid() {
        let signer = Signer::ephemeral(1_000).unwrap();
        let cap = signer.mint(scope("alpha/model"), "pod-a", "pod-g", 1_000);
        let v = Verifier::new("pod-a");
        assert!(
            v.verify(&cap, 1_000)
                .unwrap_err()
                .to_string()
                .contains("not been given")
        );
        v.set_keys(&signer.public_keys());
        let got = v.verify(&cap, 2_000).unwrap();
        assert_eq!(got.scope, scope("alpha/model"));
        assert_eq!(got.getter, "pod-g");
        // Another source, or past its life (and the skew allowed).
        let e = Verifier::new("pod-b");
        e.set_keys(&signer.public_keys());
        assert!(
            e.verify(&cap, 2_000)
                .unwrap_err()
                .to_string()
                .contains("source")
        );
        let late = 1_000 + (LIFETIME + CLOCK_SKEW).as_millis() as u64 + 1;
        assert!(
            v.verify(&cap, late)
                .unwrap_err()
                .to_string()
                .contains("expired")
        );
    }

    #[tokio::test]
    async fn an_agent_not_given_the_key_yet_answers_try_again_not_refused() {
        let signer = Signer::ephemeral(0).unwrap();
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_millis() as u64;
        let cap = signer.mint(scope("alpha/model"), "pod-a", "g", now);
        let v = std::sync::Arc::new(Verifier::new("pod-a"));
        assert!(matches!(v.verify(&cap, now), Err(Refused::UnknownKey(_))));
        let auth = crate::Auth::none().with_capabilities(v.clone());
        let e = auth.resolve(&cap).await.unwrap_err();
        assert_eq!(e.code, kt_types::ErrorCode::Unavailable, "{e}");
        v.set_keys(&signer.public_keys());
        let who = match auth.resolve(&cap).await.unwrap() {
            crate::auth::Verdict::Known(p) => p,
            other => panic!("{other:?}"),
        };
        assert_eq!(who.scope, Some(scope("alpha/model")));
        // Another agent's capability is refused, not "try again".
        let other = signer.mint(scope("alpha/model"), "pod-b", "g", now);
        assert!(matches!(
            auth.resolve(&other).await,
            Ok(crate::auth::Verdict::Refused(_))
        ));
    }

    #[test]
    fn a_tampered_or_foreign_capability_is_refused() {
        let signer = Signer::ephemeral(0).unwrap();
        let v = Verifier::new("pod-a");
        v.set_keys(&signer.public_keys());
        let cap = signer.mint(scope("alpha/model"), "pod-a", "g", 0);
        // The claims changed to another key, the signature kept.
        let (payload, sig) = cap
            .strip_prefix(Capability::PREFIX)
            .unwrap()
            .split_once('.')
            .unwrap();
        let mut claims: serde_json::Value =
            serde_json::from_slice(&B64.decode(payload).unwrap()).unwrap();
        claims["key"] = "alpha/other".into();
        let forged = format!(
            "{}{}.{sig}",
            Capability::PREFIX,
            B64.encode(serde_json::to_vec(&claims).unwrap())
        );
        assert!(
            v.verify(&forged, 0)
                .unwrap_err()
                .to_string()
                .contains("does not verify")
        );
        // Signed by a key the metadata server never published.
        let other = Signer::ephemeral(0).unwrap();
        let foreign = other.mint(scope("alpha/model"), "pod-a", "g", 0);
        assert!(
            v.verify(&foreign, 0)
                .unwrap_err()
                .to_string()
                .contains("not been given")
        );
        for junk in [
            "",
            "kt-cap.",
            "kt-cap.x.y",
            "Bearer x",
            &"kt-cap.a".repeat(1000),
        ] {
            assert!(v.verify(junk, 0).is_err(), "{junk:?}");
        }
    }

    #[test]
    fn keys_persist_and_rotate() {
        let dir = tempfile::tempdir().unwrap();
        let s = Signer::load_or_create(dir.path(), 0).unwrap();
        let first = s.public_keys();
        assert_eq!(first.len(), 1);
        let path = dir.path().join("capability-keys.json");
        use std::os::unix::fs::PermissionsExt;
        let mode = std::fs::metadata(&path).unwrap().permissions().mode();
        assert_eq!(mode & 0o777, 0o600);
        // Reloaded: the same key signs.
        let again = Signer::load_or_create(dir.path(), 1).unwrap();
        assert_eq!(again.public_keys(), first);
        // Due: a new key signs, the old one is still published...
        let day = ROTATE_AFTER.as_millis() as u64;
        again.rotate_if_due(day).unwrap();
        let rotated = again.public_keys();
        assert_eq!(rotated.len(), 2);
        assert_eq!(rotated[1], first[0]);
        let v = Verifier::new("a");
        v.set_keys(&rotated);
        // (Minted before the rotation, by the key it retired.)
        let old = s.mint(scope("x/y"), "a", "g", 1);
        assert!(v.verify(&old, 2).is_ok());
        // ...until it has been retired for RETIRED_FOR.
        let later = day + RETIRED_FOR.as_millis() as u64;
        let reloaded = Signer::load_or_create(dir.path(), later).unwrap();
        assert_eq!(reloaded.public_keys(), rotated);
        reloaded.rotate_if_due(2 * day).unwrap();
        let keys = reloaded.public_keys();
        assert_eq!(keys.len(), 2, "the newest and the one it replaced");
        assert!(!keys.contains(&first[0]));
    }
}
