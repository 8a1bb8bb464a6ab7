//! The node agent's local control protocol, spoken over a Unix socket by the
//! `kt` client and by applications registering tensors.
//!
//! Framing: every message is a 4-byte big-endian length followed by that
//! many bytes of UTF-8 JSON. The client's first message is
//! [`ControlRequest::Hello`] with the version it speaks; the agent answers
//! [`ControlReply::Hello`] with the same version (or an error when it does
//! not speak it). Then requests and replies alternate, one reply per
//! request. Any peer that can write a length and JSON (Python's
//! `struct.pack(">I", n)`) can speak it.
//!
//! Versions: 1 has the file operations (`export_local`, `export_copy`,
//! `status`); 2 adds GPU data (`put_tensors`, `get_tensors`,
//! `drop_tensors`, see [`crate::tensor`]). An agent speaks both; a version
//! 1 connection is refused tensor operations. Tensor registrations belong
//! to the process on the other end of the connection (its pid, from the
//! socket's peer credentials): they are dropped when it exits, or, when the
//! agent cannot see its pid (another pid namespace), when the connection
//! that made them closes.
//!
//! Keepalive: a client that says `keepalive: true` in its hello (and an
//! agent that answers it in kind) gets [`ControlReply::Working`] every
//! [`KEEPALIVE`] while a request runs (an export scan can take minutes),
//! so it can tell a busy agent from a frozen one by silence alone. Both
//! fields default to false: either side may be older.
//!
//! Shared memory: an agent names its shared-memory directory in its hello
//! (`shm_dir`; absent from older agents), so a client creates the host
//! tensors it lends there without `KT_SHM_DIR` having to match.

use serde::{Deserialize, Serialize};

use crate::api::PutOptions;
use crate::error::ErrorCode;
use crate::key::Key;
use crate::manifest::Manifest;
use crate::model::KeyRecord;
use crate::tensor::{GetTensors, PutTensors, TensorRegistration, TensorStats, TensorsPut};

/// The newest protocol version this build speaks.
pub const CONTROL_VERSION: u32 = 2;
/// The oldest version an agent still accepts.
pub const MIN_CONTROL_VERSION: u32 = 1;
/// The first version with tensor operations.
pub const TENSOR_VERSION: u32 = 2;

/// How often an agent says [`ControlReply::Working`] while a request runs,
/// on connections that asked for it.
pub const KEEPALIVE: std::time::Duration = std::time::Duration::from_secs(2);

/// Largest control message accepted (a manifest of a big tree fits).
pub const MAX_CONTROL_MESSAGE: u32 = 256 << 20;

/// A message from a client to the agent, tagged by `op` (the variant's
/// snake_case name): `{"op":"hello","version":2}`. The fields of a
/// variant that wraps a struct sit beside `op`
/// (`{"op":"put_tensors","key":...,"tensors":[...]}`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case")]
pub enum ControlRequest {
    /// The first message of a connection: the protocol version the client
    /// speaks. Any other request first is refused and the connection closed.
    Hello {
        /// From [`MIN_CONTROL_VERSION`] to [`CONTROL_VERSION`]; another one
        /// is an error, and the connection is closed.
        version: u32,
        /// Send [`ControlReply::Working`] while requests run (see the
        /// module docs). Absent: false.
        #[serde(default, skip_serializing_if = "is_false")]
        keepalive: bool,
    },
    /// `kt put --locale local`: serve the file or tree at `path` (absolute)
    /// under `key`, and register it as the key's origin. Nothing is copied.
    ExportLocal {
        /// The key to publish.
        key: Key,
        /// Absolute path of the file or directory, as the agent sees it.
        path: String,
        /// The key's lifecycle; the defaults of [`PutOptions`] when absent.
        #[serde(default)]
        options: PutOptions,
    },
    /// After a `kt get`: serve the downloaded copy at `path` (absolute) of
    /// `version` of `key` (this manifest's entries, nothing else there).
    ExportCopy {
        /// The key downloaded.
        key: Key,
        /// The version downloaded (1 to 256 bytes, no control characters):
        /// the agent serves it as that version.
        version: String,
        /// Absolute path of the copy: a directory or a file, as the
        /// manifest's root says.
        path: String,
        /// The version's manifest (validated by the agent).
        manifest: Manifest,
    },
    /// What the agent serves.
    Status,
    /// Version 2: register (and publish, or broadcast) tensors.
    PutTensors(PutTensors),
    /// Version 2: receive tensors into lent memory.
    GetTensors(GetTensors),
    /// Version 2: drop this process's registration of a key (the key is
    /// unregistered at the metadata server too).
    DropTensors {
        /// The key to drop; it must have been registered by the same process.
        key: Key,
    },
    /// Version 2: withdraw this process's broadcast puts of a key that
    /// still wait for their quorum (the caller interrupted the put: its
    /// connection stays open for what it lent, so the agent cannot see it
    /// go). Sent on any connection of the same process; an agent that
    /// cannot see callers' pids withdraws nothing. Agents that predate it
    /// answer `invalid_request`.
    WithdrawPut {
        /// The key whose waiting broadcast puts are withdrawn.
        key: Key,
    },
}

/// One key an agent serves.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ExportInfo {
    /// The key served.
    pub key: Key,
    /// The version served.
    pub version: String,
    /// Canonical absolute path of the served file or directory.
    pub path: String,
    /// True for `locale=local` puts (this pod is the key's origin).
    pub origin: bool,
    /// Files in the export.
    pub files: u64,
    /// Sum of the file sizes, in bytes.
    pub size: u64,
}

fn is_false(b: &bool) -> bool {
    !b
}

/// The agent's answer to one [`ControlRequest`], tagged by `op` like it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case")]
pub enum ControlReply {
    /// The answer to [`ControlRequest::Hello`].
    Hello {
        /// The version the client said, which this connection now speaks.
        version: u32,
        /// The agent's id (its pod's name).
        agent: String,
        /// Base URL of the agent's read protocol.
        url: String,
        /// This agent sends [`ControlReply::Working`] on this connection.
        #[serde(default, skip_serializing_if = "is_false")]
        keepalive: bool,
        /// The agent's shared-memory directory (canonical): host tensors
        /// lent to it must be files in it. Absent from older agents (then
        /// `KT_SHM_DIR`, default `/dev/shm`, must match theirs).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        shm_dir: Option<String>,
    },
    /// Not an answer: the request is still running (every [`KEEPALIVE`],
    /// on connections that asked for it). The answer follows.
    Working,
    /// The export is registered (for a local put: the key's record).
    Exported {
        /// What the agent now serves.
        export: ExportInfo,
        /// The record the metadata server made (a local put); absent for a
        /// copy.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        record: Option<Box<KeyRecord>>,
    },
    /// The answer to [`ControlRequest::Status`].
    Status {
        /// The agent's id.
        agent: String,
        /// Base URL of the agent's read protocol.
        url: String,
        /// Every export: origin copies and downloaded copies.
        exports: Vec<ExportInfo>,
        /// Every tensor registration (of every process); omitted when none.
        #[serde(default, skip_serializing_if = "Vec::is_empty")]
        tensors: Vec<TensorRegistration>,
    },
    /// The answer to [`ControlRequest::PutTensors`] (after the transfer,
    /// for a put with a broadcast window).
    TensorsPut(TensorsPut),
    /// The answer to [`ControlRequest::GetTensors`]: the tensors are in
    /// the destination memory.
    TensorsGot {
        /// What moved, summed over every transfer the get took.
        stats: TensorStats,
    },
    /// The answer to [`ControlRequest::DropTensors`].
    TensorsDropped {
        /// The key dropped.
        key: Key,
    },
    /// The answer to [`ControlRequest::WithdrawPut`].
    PutWithdrawn {
        /// The key.
        key: Key,
        /// How many waiting joins were withdrawn (0: none was waiting).
        joins: u32,
    },
    /// The request failed. The agent then closes the connection when the
    /// handshake failed (an unreadable message, another request or a version
    /// it does not speak before a successful `hello`) or the message was
    /// over [`MAX_CONTROL_MESSAGE`]; otherwise the connection goes on.
    Error {
        /// What kind of failure (the same codes as the HTTP APIs).
        code: ErrorCode,
        /// What went wrong, for people.
        message: String,
    },
}

/// Encodes one frame.
pub fn encode_frame<T: Serialize>(msg: &T) -> Result<Vec<u8>, serde_json::Error> {
    let body = serde_json::to_vec(msg)?;
    let mut out = Vec::with_capacity(4 + body.len());
    out.extend_from_slice(&(body.len() as u32).to_be_bytes());
    out.extend_from_slice(&body);
    Ok(out)
}

/// [`encode_frame`] carrying the caller's W3C `traceparent` as the
/// object's first member (`{"traceparent":"00-…","op":…}`), so the agent
/// runs the request in the caller's trace ([`frame_traceparent`]); agents
/// that do not know the member ignore it.
pub fn encode_traced_frame<T: Serialize>(
    msg: &T,
    traceparent: Option<&str>,
) -> Result<Vec<u8>, serde_json::Error> {
    let Some(tp) = traceparent else {
        return encode_frame(msg);
    };
    let body = serde_json::to_vec(msg)?;
    let Some(rest) = body.strip_prefix(b"{") else {
        return encode_frame(msg);
    };
    let member = format!("{{{TRACEPARENT_MEMBER}{}", serde_json::to_string(tp)?);
    let comma = if rest.starts_with(b"}") { "" } else { "," };
    let n = member.len() + comma.len() + rest.len();
    let mut out = Vec::with_capacity(4 + n);
    out.extend_from_slice(&(n as u32).to_be_bytes());
    out.extend_from_slice(member.as_bytes());
    out.extend_from_slice(comma.as_bytes());
    out.extend_from_slice(rest);
    Ok(out)
}

const TRACEPARENT_MEMBER: &str = "\"traceparent\":";

/// The `traceparent` a request's body carries as its first member
/// ([`encode_traced_frame`]), unchecked (the caller validates it); found
/// without parsing the body (a manifest may be large).
pub fn frame_traceparent(body: &[u8]) -> Option<&str> {
    let rest = body.strip_prefix(b"{")?;
    let rest = rest.strip_prefix(TRACEPARENT_MEMBER.as_bytes())?;
    let rest = rest.strip_prefix(b"\"")?;
    let end = rest.iter().take(256).position(|&c| c == b'"')?;
    std::str::from_utf8(&rest[..end]).ok()
}

/// The length announced by a frame header, checked against the limit.
pub fn frame_len(header: [u8; 4]) -> Result<usize, String> {
    let n = u32::from_be_bytes(header);
    if n > MAX_CONTROL_MESSAGE {
        return Err(format!(
            "control message of {n} bytes is over the {MAX_CONTROL_MESSAGE}-byte limit"
        ));
    }
    Ok(n as usize)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_traced_frame_carries_the_traceparent_first_and_still_parses() {
        let tp = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
        let f = encode_traced_frame(&ControlRequest::Status, Some(tp)).unwrap();
        let n = frame_len(f[..4].try_into().unwrap()).unwrap();
        assert_eq!(n, f.len() - 4);
        assert_eq!(
            &f[4..],
            format!(r#"{{"traceparent":"{tp}","op":"status"}}"#).as_bytes()
        );
        assert_eq!(frame_traceparent(&f[4..]), Some(tp));
        let back: ControlRequest = serde_json::from_slice(&f[4..]).unwrap();
        assert_eq!(back, ControlRequest::Status);
        // Untraced frames, and a member elsewhere, give none.
        let plain = encode_traced_frame(&ControlRequest::Status, None).unwrap();
        assert_eq!(frame_traceparent(&plain[4..]), None);
        assert_eq!(
            frame_traceparent(br#"{"op":"status","traceparent":"x"}"#),
            None
        );
        assert_eq!(frame_traceparent(br#"{"traceparent":"unterminated"#), None);
    }

    #[test]
    fn frames_carry_tagged_json() {
        let f = encode_frame(&ControlRequest::Hello {
            version: 1,
            keepalive: false,
        })
        .unwrap();
        let n = frame_len(f[..4].try_into().unwrap()).unwrap();
        assert_eq!(n, f.len() - 4);
        assert_eq!(&f[4..], br#"{"op":"hello","version":1}"#);
        let back: ControlRequest = serde_json::from_slice(&f[4..]).unwrap();
        assert_eq!(
            back,
            ControlRequest::Hello {
                version: 1,
                keepalive: false
            }
        );
        // Keepalive is said only when asked for, and read as false when
        // absent (either side may be older).
        let on: ControlRequest =
            serde_json::from_str(r#"{"op":"hello","version":2,"keepalive":true}"#).unwrap();
        assert_eq!(
            on,
            ControlRequest::Hello {
                version: 2,
                keepalive: true
            }
        );
        let r: ControlReply =
            serde_json::from_str(r#"{"op":"hello","version":2,"agent":"a","url":"u"}"#).unwrap();
        assert!(matches!(
            r,
            ControlReply::Hello {
                keepalive: false,
                shm_dir: None,
                ..
            }
        ));
        assert_eq!(
            serde_json::to_string(&ControlReply::Working).unwrap(),
            r#"{"op":"working"}"#
        );
        assert!(frame_len(u32::MAX.to_be_bytes()).is_err());
    }
}
