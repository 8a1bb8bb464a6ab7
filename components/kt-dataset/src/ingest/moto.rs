//! An S3-compatible server for tests and the ingest bench: moto's server
//! mode (`moto_server`, from PyPI's `moto[server]`), a separate, real
//! implementation of the S3 API, started as a child process on
//! `127.0.0.1:0`.
//!
//! Why moto rather than the `s3s-fs` crate in process: it is an
//! implementation we did not write and do not link (so the ingest is tested
//! against an S3 server's behaviour, not against the same Rust HTTP stack),
//! and it costs a pinned Python package in a venv instead of a heavy build
//! of the whole workspace's test profile. It keeps objects in memory.
//!
//! Where it is found ([`find`]): `$KT_MOTO_SERVER`, else
//! `<target>/s3env/bin/moto_server` (the venv `bash testbed/s3/moto.sh`
//! creates; `make test` runs it), else `moto_server` on `PATH`.
//!
//! Readiness is a condition, not a sleep: the server prints the address it
//! bound, which is read from its stderr (with a timeout).

use std::path::PathBuf;
use std::process::Stdio;
use std::time::Duration;

use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, Command};

/// How long moto may take to start (importing it takes seconds).
pub const START_TIMEOUT: Duration = Duration::from_secs(60);

/// Finds `moto_server`, or says how to install it.
pub fn find() -> Result<PathBuf, String> {
    if let Some(p) = std::env::var_os(kt_types::env::MOTO_SERVER) {
        let p = PathBuf::from(p);
        return if p.is_file() {
            Ok(p)
        } else {
            Err(format!(
                "{}={} is not a file",
                kt_types::env::MOTO_SERVER,
                p.display()
            ))
        };
    }
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..");
    let target = std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .map(|t| if t.is_absolute() { t } else { root.join(t) })
        .unwrap_or_else(|| root.join("target"));
    let venv = target.join("s3env/bin/moto_server");
    if venv.is_file() {
        return Ok(venv);
    }
    if let Some(path) = std::env::var_os("PATH") {
        for dir in std::env::split_paths(&path) {
            let p = dir.join("moto_server");
            if p.is_file() {
                return Ok(p);
            }
        }
    }
    Err(format!(
        "moto_server (PyPI moto[server]) not found: not in KT_MOTO_SERVER, {}, or PATH; \
         install it with `bash testbed/s3/moto.sh` (make test does)",
        venv.display()
    ))
}

/// A running moto server; killed when dropped.
#[derive(Debug)]
pub struct Moto {
    child: Child,
    endpoint: String,
    http: reqwest::Client,
}

impl Moto {
    /// Starts moto; any credentials are accepted.
    pub async fn start() -> Result<Moto, String> {
        Self::start_inner(None).await
    }

    /// What a test does with [`Moto::start`]'s answer: the server, or
    /// `None` (skip, saying why) where moto is not installed; with `CI`
    /// set, a server that cannot start fails the test (CI installs moto).
    pub fn or_skip(started: Result<Moto, String>) -> Option<Moto> {
        match started {
            Ok(m) => Some(m),
            Err(e) if matches!(std::env::var("CI").as_deref(), Ok("true" | "1")) => {
                panic!("CI=true and the S3 test server cannot start: {e}")
            }
            Err(e) => {
                eprintln!("skipping: the S3 test server cannot start: {e}");
                None
            }
        }
    }

    /// Starts moto checking every request's credentials against its own
    /// IAM (which knows none): every signed request is refused as a wrong
    /// credential.
    pub async fn start_checking_credentials() -> Result<Moto, String> {
        Self::start_inner(Some("0")).await
    }

    async fn start_inner(no_auth_count: Option<&str>) -> Result<Moto, String> {
        let bin = find()?;
        let mut cmd = Command::new(&bin);
        cmd.args(["-H", "127.0.0.1", "-p", "0"])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .kill_on_drop(true);
        if let Some(n) = no_auth_count {
            cmd.env("INITIAL_NO_AUTH_ACTION_COUNT", n);
        }
        let mut child = cmd
            .spawn()
            .map_err(|e| format!("starting {}: {e}", bin.display()))?;
        let stderr = child.stderr.take().ok_or("moto's stderr")?;
        let mut lines = BufReader::new(stderr).lines();
        let mut seen = Vec::new();
        let endpoint = tokio::time::timeout(START_TIMEOUT, async {
            while let Some(line) = lines.next_line().await.map_err(|e| e.to_string())? {
                if let Some(at) = line.find("Running on http://") {
                    let url = line[at + "Running on ".len()..].trim().to_owned();
                    return Ok(url);
                }
                seen.push(line);
            }
            Err(format!(
                "moto exited before it listened: {}",
                seen.join(" | ")
            ))
        })
        .await
        .map_err(|_| format!("moto did not listen within {START_TIMEOUT:?}"))??;
        // Its request log goes on; drain it so the server never blocks on
        // a full pipe.
        tokio::spawn(async move { while let Ok(Some(_)) = lines.next_line().await {} });
        Ok(Moto {
            child,
            endpoint,
            http: kt_api::client(),
        })
    }

    /// `http://127.0.0.1:PORT`.
    pub fn endpoint(&self) -> &str {
        &self.endpoint
    }

    /// The server's process id.
    pub fn pid(&self) -> Option<u32> {
        self.child.id()
    }

    /// Creates a bucket (an unsigned request, which moto accepts).
    pub async fn create_bucket(&self, bucket: &str) -> Result<(), String> {
        self.send(self.http.put(format!("{}/{bucket}", self.endpoint)))
            .await
    }

    /// A signed client of `bucket` (moto accepts any credentials, but
    /// refuses anonymous overwrites and deletes).
    fn signed(&self, bucket: &str) -> Result<object_store::aws::AmazonS3, String> {
        object_store::aws::AmazonS3Builder::new()
            .with_bucket_name(bucket)
            .with_region("us-east-1")
            .with_endpoint(&self.endpoint)
            .with_allow_http(true)
            .with_access_key_id("moto")
            .with_secret_access_key("moto")
            .build()
            .map_err(|e| e.to_string())
    }

    /// Puts one object (single part: its ETag is its MD5), signed. A key
    /// the S3 client refuses to name (`a/../b`, `a//b`) is sent raw and
    /// unsigned instead (every byte but the unreserved ones
    /// percent-encoded, `/` too, so no URL normalisation touches it); moto
    /// takes that only for a key that does not exist yet.
    pub async fn put_object(&self, bucket: &str, key: &str, body: Vec<u8>) -> Result<(), String> {
        use object_store::ObjectStore;
        match object_store::path::Path::parse(key) {
            Ok(path) if path.as_ref() == key => self
                .signed(bucket)?
                .put(&path, body.into())
                .await
                .map(|_| ())
                .map_err(|e| e.to_string()),
            _ => {
                self.send(
                    self.http
                        .put(format!("{}/{bucket}/{}", self.endpoint, encode_key(key)))
                        .header("content-type", "application/octet-stream")
                        .body(body),
                )
                .await
            }
        }
    }

    /// Deletes one object, signed.
    pub async fn delete_object(&self, bucket: &str, key: &str) -> Result<(), String> {
        use object_store::ObjectStore;
        let path = object_store::path::Path::parse(key).map_err(|e| e.to_string())?;
        self.signed(bucket)?
            .delete(&path)
            .await
            .map_err(|e| e.to_string())
    }

    async fn send(&self, req: reqwest::RequestBuilder) -> Result<(), String> {
        let resp = req.send().await.map_err(|e| e.to_string())?;
        let status = resp.status();
        if status.is_success() {
            return Ok(());
        }
        let body = resp.text().await.unwrap_or_default();
        Err(format!("moto answered {status}: {body}"))
    }
}

/// Percent-encodes all but RFC 3986's unreserved characters.
fn encode_key(key: &str) -> String {
    let mut out = String::with_capacity(key.len() * 3);
    for b in key.bytes() {
        if b.is_ascii_alphanumeric() || b"-._~".contains(&b) {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}
