//! What the root-only tests share.
//!
//! Why root-only tests are built as ignored when not built by root: see
//! the parent module.

use super::exec::Cmd;
use super::layout::{bridge_name, forward_rule};
use super::sweep::{state_path, sweep_stale};

/// Root tests share 198.18.0.0/15, so they run one at a time.
static ROOT: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn is_root() -> bool {
    rustix::process::geteuid().is_root()
}

/// The start of a root-only test: the one netns testbed to itself, after a
/// sweep of what killed runs left. Fails the test when not root.
pub(super) fn root() -> std::sync::MutexGuard<'static, ()> {
    assert!(
        is_root(),
        "needs root (network namespaces), and this test binary was built as root (or the test \
         was run with --run-ignored): run it as root, or rebuild it as this user to skip it"
    );
    let guard = ROOT.lock().unwrap_or_else(|e| e.into_inner());
    for line in sweep_stale() {
        println!("{line}");
    }
    guard
}

/// A build that ignores the root-only tests must not run as root, where
/// they must run: a binary built by another user (and not rebuilt since)
/// fails here instead of skipping them.
#[cfg(kt_unprivileged_build)]
#[test]
fn a_build_that_skips_root_tests_does_not_run_as_root() {
    assert!(
        !is_root(),
        "running as root, but this test binary was built as another user, so its root-only \
         tests are ignored: rebuild as root (touch components/kt-scenario/build.rs)"
    );
}

pub(super) fn assert_gone(id: &str) {
    let netns = Cmd::new(&["ip", "netns", "list"]).run().unwrap();
    assert!(!netns.contains(&format!("kt-{id}-")), "{netns}");
    let links = Cmd::new(&["ip", "link", "show"]).run().unwrap();
    assert!(!links.contains(&format!("ktb{id}")), "{links}");
    assert!(!links.contains(&format!("ktv{id}")), "{links}");
    let br = bridge_name(id);
    assert!(Cmd::new(&forward_rule("-C", &br)).run().is_err());
    assert!(!state_path(id).exists());
}
