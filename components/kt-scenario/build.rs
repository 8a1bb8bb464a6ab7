//! Tells the tests who builds them: in a build by any user but root, the
//! netns target's root-only tests are `#[ignore]`d, so the test harness
//! shows them as skipped instead of passing them unrun (see
//! src/target/netns/mod.rs).

fn main() {
    println!("cargo::rustc-check-cfg=cfg(kt_unprivileged_build)");
    println!("cargo::rerun-if-changed=build.rs");
    // Whoever builds next (sudo sets these, and so do logins) runs this
    // again; the tests also check at run time (testing.rs).
    for var in ["USER", "LOGNAME", "SUDO_UID"] {
        println!("cargo::rerun-if-env-changed={var}");
    }
    if !effective_root() {
        println!("cargo::rustc-cfg=kt_unprivileged_build");
    }
}

/// Is this process's effective uid 0? (`Uid:` in /proc/self/status: real,
/// effective, saved, filesystem.) Not on Linux: no.
fn effective_root() -> bool {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix("Uid:"))
        .and_then(|ids| ids.split_whitespace().nth(1))
        .is_some_and(|euid| euid == "0")
}
