//! The paths of every endpoint a client calls (see [`crate::api`] for what
//! each one takes and answers): the one place where they are built.
//!
//! Keys go in as they are (their grammar, [`Key`], is already safe in a
//! URL path, and the servers match them with a wildcard); every other
//! segment or query value (lease, session, group and transfer ids, service
//! names, versions, prefixes) is percent-encoded, so no value can add a
//! segment or a query parameter of its own.

use crate::api::API_PREFIX;
use crate::key::Key;

/// `s` with everything but RFC 3986's unreserved characters
/// (`A-Z a-z 0-9 - . _ ~`) percent-encoded: safe as one path segment or
/// one query value.
pub fn encode(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for b in s.bytes() {
        if b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.' | b'_' | b'~') {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

fn api(rest: &str) -> String {
    format!("{API_PREFIX}/{rest}")
}

// --- metadata server ------------------------------------------------------

/// `POST` (a store announces itself).
pub fn stores() -> String {
    api("stores")
}

/// `GET`: where the store is.
pub fn store() -> String {
    api("store")
}

/// `GET`: what the metadata server holds and does
/// ([`crate::status::ClusterStatus`]).
pub fn status() -> String {
    api("status")
}

/// `GET ?prefix=`: a listing.
pub fn keys() -> String {
    api("keys")
}

/// `GET`, `PUT`, `DELETE` one key's record.
pub fn key(key: &Key) -> String {
    api(&format!("keys/{key}"))
}

/// `GET`: which service may write a key ([`crate::api::KeyOwner`]).
pub fn owner(key: &Key) -> String {
    api(&format!("owners/{key}"))
}

/// `DELETE` of one version of a key only.
pub fn key_version(key: &Key, version: &str) -> String {
    format!("{}?version={}", self::key(key), encode(version))
}

/// `POST`: a lease on the key's least-loaded source.
pub fn key_lease(key: &Key) -> String {
    api(&format!("keys/{key}/lease"))
}

/// `GET`: every lease.
pub fn leases() -> String {
    api("leases")
}

/// `PUT` (renew), `DELETE` (release) a source lease.
pub fn lease(id: &str) -> String {
    api(&format!("leases/{}", encode(id)))
}

/// `POST`: the leased source failed this getter.
pub fn lease_failed(id: &str) -> String {
    api(&format!("leases/{}/failed", encode(id)))
}

/// `POST` (heartbeat), `GET` (list) node agents.
pub fn agents() -> String {
    api("agents")
}

/// `DELETE`: tears a service down.
pub fn service(name: &str) -> String {
    api(&format!("services/{}", encode(name)))
}

/// `POST`: who a bearer token is ([`crate::auth::TokenQuery`]).
pub fn auth_review() -> String {
    api("auth/review")
}

/// `GET`, upgraded to a broadcast member's WebSocket.
pub fn broadcast_join() -> String {
    api("broadcasts/join")
}

/// `GET`: a broadcast group's members.
pub fn broadcast(group: &str) -> String {
    api(&format!("broadcasts/{}", encode(group)))
}

/// `GET`: a quorum group's open round and kept transfers.
pub fn quorum(group: &str) -> String {
    api(&format!("quorums/{}", encode(group)))
}

/// `POST`: join the group's open round (long-polled).
pub fn quorum_join(group: &str) -> String {
    api(&format!("quorums/{}/join", encode(group)))
}

/// `GET ?wait_ms=`: a closed round's transfer, long-polled until done.
pub fn quorum_transfer(group: &str, transfer: &str) -> String {
    api(&format!("quorums/{}/{}", encode(group), encode(transfer)))
}

/// `PUT` (rank 0), `GET ?wait_ms=` (the others) the transfer's rendezvous.
pub fn quorum_rendezvous(group: &str, transfer: &str) -> String {
    format!("{}/rendezvous", quorum_transfer(group, transfer))
}

/// `POST`: one rank's end of the transfer.
pub fn quorum_done(group: &str, transfer: &str) -> String {
    format!("{}/done", quorum_transfer(group, transfer))
}

// --- store and agents: the sync protocol ---------------------------------

/// `POST`: plan a put (a codec document).
pub fn puts() -> String {
    api("puts")
}

/// `DELETE`: abort an upload session.
pub fn put_session(session: &str) -> String {
    api(&format!("puts/{}", encode(session)))
}

/// `PUT`: a frame stream of small files.
pub fn put_batch(session: &str) -> String {
    format!("{}/batch", put_session(session))
}

/// `PUT`: one chunk of a large file.
pub fn put_chunk(session: &str, index: usize, chunk: u64) -> String {
    format!("{}/files/{index}/chunks/{chunk}", put_session(session))
}

/// `POST`: publish the put.
pub fn put_commit(session: &str) -> String {
    format!("{}/commit", put_session(session))
}

/// `GET`: every tree the store holds.
pub fn trees() -> String {
    api("trees")
}

/// `GET` (open a read lease on the current version), `DELETE` (the store
/// drops the key's data).
pub fn tree(key: &Key) -> String {
    api(&format!("trees/{key}"))
}

/// `DELETE`: release a read lease.
pub fn read(lease: &str) -> String {
    api(&format!("reads/{}", encode(lease)))
}

/// `POST`: a frame stream of the requested small files.
pub fn read_batch(lease: &str) -> String {
    format!("{}/batch", read(lease))
}

/// `GET ?offset=&len=`: a range of one file.
pub fn read_range(lease: &str, index: usize) -> String {
    format!("{}/files/{index}", read(lease))
}

/// `POST` (to a source agent): a point-to-point tensor session.
pub fn tensor_sessions() -> String {
    api("tensors/sessions")
}

/// `POST` (metadata server): a capability to open a tensor session at a
/// key's holder ([`crate::tensor::TensorGrant`]).
pub fn tensor_grant(key: &Key) -> String {
    api(&format!("tensors/grants/{key}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn values_cannot_add_segments_or_parameters() {
        assert_eq!(encode("abc-1.2_3~"), "abc-1.2_3~");
        assert_eq!(encode("a/b?c=d&e f#%"), "a%2Fb%3Fc%3Dd%26e%20f%23%25");
        assert_eq!(encode("é"), "%C3%A9");
        assert_eq!(lease("../stores"), "/api/v1/leases/..%2Fstores");
        assert_eq!(service("x/y"), "/api/v1/services/x%2Fy");
        assert_eq!(
            quorum_done("g 1", "t/2"),
            "/api/v1/quorums/g%201/t%2F2/done"
        );
    }

    #[test]
    fn keys_go_in_as_they_are() {
        let k = Key::parse("team/model/v1").unwrap();
        assert_eq!(key(&k), "/api/v1/keys/team/model/v1");
        assert_eq!(key_lease(&k), "/api/v1/keys/team/model/v1/lease");
        assert_eq!(
            key_version(&k, "v1&recursive=true"),
            "/api/v1/keys/team/model/v1?version=v1%26recursive%3Dtrue"
        );
        assert_eq!(tree(&k), "/api/v1/trees/team/model/v1");
        assert_eq!(put_chunk("s1", 3, 7), "/api/v1/puts/s1/files/3/chunks/7");
        assert_eq!(read_range("l", 2), "/api/v1/reads/l/files/2");
    }
}
