//! Which paths a workload may have its agent serve.
//!
//! An agent reads with its own rights, which may be wider than the
//! workload's (another uid, root): what it exports must be what the
//! workload means to share, never the system's or the agent's own files.
//! Paths are compared in canonical form (links resolved), so a link into a
//! refused place is refused too.

use std::path::{Path, PathBuf};

/// Places no export may be in or contain, whatever the roots.
const SYSTEM: &[&str] = &[
    "/etc",
    "/proc",
    "/sys",
    "/dev",
    "/boot",
    "/run/secrets",
    "/var/run/secrets",
];

/// Where exports may be.
#[derive(Debug, Clone)]
pub struct Exportable {
    /// Exports must lie below one of these (canonical); empty: anywhere
    /// not refused.
    roots: Vec<PathBuf>,
    /// Exports may neither lie in nor contain these (canonical).
    refused: Vec<PathBuf>,
}

impl Exportable {
    /// `roots` (`--export-root`; empty: anywhere), never the system's
    /// places nor `own` (the agent's state directory).
    /// Roots that do not exist are left out, with a warning.
    pub fn new(roots: &[PathBuf], own: &[&Path]) -> Exportable {
        let canonical = |p: &Path| std::fs::canonicalize(p).unwrap_or_else(|_| p.to_owned());
        let roots = roots
            .iter()
            .filter_map(|r| match std::fs::canonicalize(r) {
                Ok(c) => Some(c),
                Err(e) => {
                    tracing::warn!(root = %r.display(), error = %e, "export root left out");
                    None
                }
            })
            .collect();
        let refused = SYSTEM
            .iter()
            .map(|p| canonical(Path::new(p)))
            .chain(own.iter().map(|p| canonical(p)))
            .collect();
        Exportable { roots, refused }
    }

    /// Why `path` (canonical) may not be exported; `None`: it may.
    pub fn refuses(&self, path: &Path) -> Option<String> {
        if path.parent().is_none() {
            return Some("the whole file system is not exported".into());
        }
        if let Some(r) = self
            .refused
            .iter()
            .find(|r| path.starts_with(r) || r.starts_with(path))
        {
            return Some(format!(
                "{} is or holds {}, which this agent never serves",
                path.display(),
                r.display()
            ));
        }
        if !self.roots.is_empty() && !self.roots.iter().any(|r| path.starts_with(r)) {
            let roots: Vec<String> = self.roots.iter().map(|r| r.display().to_string()).collect();
            return Some(format!(
                "{} is outside this agent's export roots ({}; --export-root, KT_EXPORT_ROOTS)",
                path.display(),
                roots.join(", ")
            ));
        }
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn system_places_and_the_agents_own_are_refused_wherever_the_roots_are() {
        let tmp = tempfile::tempdir().unwrap();
        let state = tmp.path().join("agent.state");
        let data = tmp.path().join("data");
        std::fs::create_dir_all(&state).unwrap();
        std::fs::create_dir_all(data.join("run")).unwrap();
        let anywhere = Exportable::new(&[], &[&state]);
        for refused in [
            "/",
            "/etc",
            "/etc/shadow",
            "/proc/self",
            "/var/run/secrets/x",
        ] {
            assert!(anywhere.refuses(Path::new(refused)).is_some(), "{refused}");
        }
        let state = std::fs::canonicalize(&state).unwrap();
        assert!(anywhere.refuses(&state.join("exports")).is_some());
        // A parent of the state directory would serve it too.
        assert!(anywhere.refuses(state.parent().unwrap()).is_some());
        let data = std::fs::canonicalize(&data).unwrap();
        assert_eq!(anywhere.refuses(&data.join("run")), None);

        let rooted = Exportable::new(&[data.clone(), tmp.path().join("missing")], &[&state]);
        assert_eq!(rooted.refuses(&data.join("run")), None);
        let why = rooted.refuses(Path::new("/usr/share")).unwrap();
        assert!(why.contains("outside this agent's export roots"), "{why}");
        assert!(rooted.refuses(Path::new("/etc/shadow")).is_some());
    }
}
