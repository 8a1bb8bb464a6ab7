//! What the root-only tests share.

use super::exec::Cmd;
use super::layout::{bridge_name, forward_rule};
use super::sweep::{state_path, sweep_stale};

/// Root tests share 198.18.0.0/15, so they run one at a time.
static ROOT: std::sync::Mutex<()> = std::sync::Mutex::new(());

pub(super) fn root() -> Option<std::sync::MutexGuard<'static, ()>> {
    if !rustix::process::geteuid().is_root() {
        println!("skipped: needs root");
        return None;
    }
    let guard = ROOT.lock().unwrap_or_else(|e| e.into_inner());
    for line in sweep_stale() {
        println!("{line}");
    }
    Some(guard)
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
