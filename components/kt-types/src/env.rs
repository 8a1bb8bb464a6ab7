//! Environment variable names, in one place. Every CLI flag has one of these.

pub const METADATA_URL: &str = "KT_METADATA_URL";
pub const TOKEN: &str = "KT_TOKEN";
pub const TOKEN_FILE: &str = "KT_TOKEN_FILE";
pub const NAMESPACE: &str = "KT_NAMESPACE";
pub const LISTEN: &str = "KT_LISTEN";
pub const STATE_DIR: &str = "KT_STATE_DIR";
pub const DATA_DIR: &str = "KT_DATA_DIR";
pub const ADVERTISE_URL: &str = "KT_ADVERTISE_URL";
pub const LOG: &str = "KT_LOG";
pub const LOG_FORMAT: &str = "KT_LOG_FORMAT";
pub const MAX_CONNECTIONS: &str = "KT_MAX_CONNECTIONS";
pub const CHUNK_SIZE: &str = "KT_CHUNK_SIZE";
pub const STREAMS: &str = "KT_STREAMS";
pub const PROGRESS: &str = "KT_PROGRESS";
/// The pod's own IP (set by the pod spec, or the testbed): agents advertise
/// it, and broadcast relays listen on it.
pub const POD_IP: &str = "KT_POD_IP";
/// The port (or range, `8091-8099`) broadcast relays listen on.
pub const RELAY_PORT: &str = "KT_RELAY_PORT";
