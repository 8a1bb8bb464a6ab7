//! The bearer token a caller presents: a fixed value, or a file read again
//! as it changes. A projected ServiceAccount token (kt in a cluster with
//! `--kube-auth`) is rotated by the kubelet well before it expires; a
//! process that read it once would start failing after an hour.

use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

/// How long a token read from a file is used before the file is read
/// again (the kubelet rewrites a projected token at 80% of its life, so
/// minutes are plenty).
pub const RECHECK: Duration = Duration::from_secs(30);

/// A bearer token (cheap to clone; clones share the file's last read).
#[derive(Clone)]
pub struct Credential(Arc<Source>);

enum Source {
    Fixed(Arc<str>),
    File {
        path: PathBuf,
        last: Mutex<(Arc<str>, Instant)>,
    },
}

impl fmt::Debug for Credential {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &*self.0 {
            Source::Fixed(_) => f.write_str("Credential(<redacted>)"),
            Source::File { path, .. } => write!(f, "Credential(file {})", path.display()),
        }
    }
}

fn read(path: &Path) -> std::io::Result<Arc<str>> {
    let text = std::fs::read_to_string(path)?;
    let v = text.trim();
    if v.is_empty() {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            format!("{}: the token file is empty", path.display()),
        ));
    }
    Ok(Arc::from(v))
}

impl Credential {
    /// A token that never changes.
    pub fn fixed(value: &str) -> Credential {
        Credential(Arc::new(Source::Fixed(Arc::from(value.trim()))))
    }

    /// The token in the file at `path`, read now and again every
    /// [`RECHECK`] (a failed read keeps the last token).
    pub fn file(path: &Path) -> std::io::Result<Credential> {
        let value = read(path)?;
        Ok(Credential(Arc::new(Source::File {
            path: path.to_owned(),
            last: Mutex::new((value, Instant::now())),
        })))
    }

    /// The token in `file` when there is one and it can be read (a
    /// rotated token), else `value` (what was read of it at start, or
    /// given).
    pub fn file_or(file: Option<&Path>, value: &str) -> Credential {
        file.and_then(|f| Credential::file(f).ok())
            .unwrap_or_else(|| Credential::fixed(value))
    }

    /// The token to present now.
    pub fn value(&self) -> Arc<str> {
        match &*self.0 {
            Source::Fixed(v) => v.clone(),
            Source::File { path, last } => {
                let mut last = last.lock().unwrap_or_else(PoisonError::into_inner);
                if last.1.elapsed() >= RECHECK {
                    if let Ok(v) = read(path) {
                        last.0 = v;
                    }
                    last.1 = Instant::now();
                }
                last.0.clone()
            }
        }
    }

    /// The file it is read from, if any.
    pub fn path(&self) -> Option<&Path> {
        match &*self.0 {
            Source::Fixed(_) => None,
            Source::File { path, .. } => Some(path),
        }
    }
}

impl From<&str> for Credential {
    fn from(v: &str) -> Credential {
        Credential::fixed(v)
    }
}

impl From<&String> for Credential {
    fn from(v: &String) -> Credential {
        Credential::fixed(v)
    }
}

impl From<String> for Credential {
    fn from(v: String) -> Credential {
        Credential::fixed(&v)
    }
}

impl From<&Credential> for Credential {
    fn from(v: &Credential) -> Credential {
        v.clone()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_file_token_is_read_again_when_it_is_rotated() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("token");
        std::fs::write(&path, "first\n").unwrap();
        let c = Credential::file(&path).unwrap();
        assert_eq!(&*c.value(), "first");
        std::fs::write(&path, "second").unwrap();
        // Until the recheck, the last read.
        assert_eq!(&*c.value(), "first");
        if let Source::File { last, .. } = &*c.0 {
            last.lock().unwrap().1 = Instant::now() - RECHECK;
        }
        assert_eq!(&*c.clone().value(), "second");
        // A failed read keeps the last token.
        std::fs::remove_file(&path).unwrap();
        if let Source::File { last, .. } = &*c.0 {
            last.lock().unwrap().1 = Instant::now() - RECHECK;
        }
        assert_eq!(&*c.value(), "second");
        assert!(Credential::file(&dir.path().join("none")).is_err());
        std::fs::write(&path, " \n").unwrap();
        assert!(Credential::file(&path).is_err());
        assert_eq!(
            format!("{:?}", Credential::fixed("s")),
            "Credential(<redacted>)"
        );
    }
}
