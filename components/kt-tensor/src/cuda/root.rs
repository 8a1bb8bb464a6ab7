//! NCCL's unique id, made in a short-lived helper process.
//!
//! `ncclGetUniqueId` starts NCCL's bootstrap root in the calling process: a
//! thread and a listening socket that wait for every rank of the
//! communicator, forever when one never comes (a failed transfer). Made in
//! the agent, each such failure would leak both for the agent's life. So
//! rank 0 asks a helper process for the id instead: this very executable,
//! started again with [`ROOT_HELPER_ENV`] set, which makes the id, prints
//! it and lives on (its bootstrap root with it) until rank 0 has connected
//! (the backend closes the helper's stdin) or its lifetime is over,
//! whichever is first. Every binary that runs a [`super::CudaBackend`]
//! calls [`serve_root_helper`] first thing in `main`.

use std::io::{BufRead, BufReader, Read, Write};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::mpsc;
use std::time::Duration;

use crate::transport::TransportError;

/// Set (to the lifetime in milliseconds) in the helper process.
pub const ROOT_HELPER_ENV: &str = kt_types::env::NCCL_ROOT_HELPER;

/// What the helper's answer starts with: the id's hex follows
/// ([`ID`]) or the reason there is none ([`ERROR`]). Looked for anywhere in
/// a line: a test harness prints "test name ... " before it, on the same
/// line.
const ID: &str = kt_types::env::NCCL_ROOT_ID_PREFIX;
const ERROR: &str = kt_types::env::NCCL_ROOT_ERROR_PREFIX;

/// How long the helper has to print the id.
pub(crate) const ANSWER_WITHIN: Duration = Duration::from_secs(60);

/// In a helper process (see the module docs): makes the id, prints it,
/// waits, and returns what `main` should exit with. `None` elsewhere.
pub fn serve_root_helper() -> Option<Result<(), String>> {
    let lifetime = std::env::var(ROOT_HELPER_ENV).ok()?;
    Some(serve(&lifetime))
}

fn serve(lifetime: &str) -> Result<(), String> {
    let lifetime = lifetime
        .trim()
        .parse::<u64>()
        .map(Duration::from_millis)
        .map_err(|_| format!("{ROOT_HELPER_ENV}={lifetime:?} is not a number of milliseconds"))?;
    let line = match super::nccl::unique_id() {
        Ok(id) => format!("{ID}{}", super::to_hex(&id.to_bytes())),
        Err(e) => format!("{ERROR}{}", e.to_string().replace('\n', " ")),
    };
    let mut out = std::io::stdout().lock();
    writeln!(out, "{line}")
        .and_then(|_| out.flush())
        .map_err(|e| format!("answering the agent: {e}"))?;
    drop(out);
    // Until the agent closes stdin (its rank 0 connected, or it died) or
    // the lifetime is over; then the bootstrap root goes with the process.
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let _ = std::io::stdin().read_to_end(&mut Vec::new());
        let _ = tx.send(());
    });
    let _ = rx.recv_timeout(lifetime);
    Ok(())
}

/// A running helper: its stdin is closed, and it is reaped, on drop.
pub(crate) struct RootHelper {
    child: Option<Child>,
    stdin: Option<ChildStdin>,
}

impl std::fmt::Debug for RootHelper {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RootHelper")
            .field("pid", &self.child.as_ref().map(Child::id))
            .finish()
    }
}

impl RootHelper {
    /// Starts `cmd` as a helper living at most `lifetime`, and reads its
    /// answer: the unique id's hex.
    pub(crate) fn start(
        mut cmd: Command,
        lifetime: Duration,
        answer_within: Duration,
    ) -> Result<(RootHelper, String), TransportError> {
        let program = cmd.get_program().to_string_lossy().into_owned();
        cmd.env(ROOT_HELPER_ENV, lifetime.as_millis().to_string())
            .stdin(Stdio::piped())
            .stdout(Stdio::piped());
        let mut child = cmd.spawn().map_err(|e| {
            TransportError::io(format!("starting {program} for NCCL's unique id"), e)
        })?;
        let stdout = child.stdout.take().expect("piped");
        let helper = RootHelper {
            stdin: child.stdin.take(),
            child: Some(child),
        };
        let (tx, rx) = mpsc::channel();
        // The answer is the first line that is one (a test harness prints
        // its own lines first); the end of output without one is an error.
        std::thread::spawn(move || {
            let mut lines = BufReader::new(stdout).lines();
            let r = loop {
                match lines.next() {
                    Some(Ok(l)) if l.contains(ID) || l.contains(ERROR) => break Ok(l),
                    Some(Ok(_)) => continue,
                    Some(Err(e)) => break Err(e),
                    None => break Ok(String::new()),
                }
            };
            let _ = tx.send(r);
            // Whatever the helper prints later (NCCL_DEBUG writes to
            // stdout) is read and dropped: a closed pipe would kill it, and
            // its bootstrap root with it.
            for _ in lines {}
        });
        let answer = match rx.recv_timeout(answer_within) {
            Ok(Ok(line)) => {
                let line = line.trim();
                if let Some((_, hex)) = line.split_once(ID) {
                    return Ok((helper, hex.to_owned()));
                } else if let Some((_, why)) = line.split_once(ERROR) {
                    TransportError::Peer(format!("ncclGetUniqueId: {why}"))
                } else {
                    TransportError::Peer(format!(
                        "{program} exited without NCCL's unique id (is {ROOT_HELPER_ENV} served first thing in its main?)"
                    ))
                }
            }
            Ok(Err(e)) => TransportError::io(format!("reading NCCL's unique id from {program}"), e),
            Err(_) => TransportError::Timeout(format!(
                "{program} gave no NCCL unique id within {answer_within:?}"
            )),
        };
        // No id: the helper has nothing left to do.
        helper.kill();
        Err(answer)
    }

    /// Ends the helper at once (it gave no id).
    fn kill(mut self) {
        if let Some(c) = self.child.as_mut() {
            let _ = c.kill();
        }
    }

    /// Whether the helper still runs (not past its lifetime).
    pub(crate) fn running(&mut self) -> bool {
        self.child
            .as_mut()
            .is_some_and(|c| matches!(c.try_wait(), Ok(None)))
    }

    #[cfg(test)]
    pub(crate) fn pid(&self) -> u32 {
        self.child.as_ref().map(Child::id).unwrap_or(0)
    }
}

impl Drop for RootHelper {
    fn drop(&mut self) {
        drop(self.stdin.take());
        if let Some(mut child) = self.child.take() {
            // Reaped off this thread: the helper exits at once on EOF, or at
            // the end of its lifetime if it missed it.
            std::thread::spawn(move || {
                let _ = child.wait();
            });
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Instant;

    use super::*;

    fn sh(script: &str) -> Command {
        let mut c = Command::new("sh");
        c.args(["-c", script]);
        c
    }

    fn alive(pid: u32) -> bool {
        // A reaped child's /proc entry is gone; a zombie's state is Z.
        std::fs::read_to_string(format!("/proc/{pid}/stat"))
            .map(|s| {
                !s.rsplit(')')
                    .next()
                    .unwrap_or("")
                    .trim_start()
                    .starts_with('Z')
            })
            .unwrap_or(false)
    }

    fn wait_gone(pid: u32) {
        let deadline = Instant::now() + Duration::from_secs(10);
        while alive(pid) {
            assert!(Instant::now() < deadline, "helper {pid} still running");
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    #[test]
    fn the_helper_lives_until_the_backend_is_done_with_it() {
        // Prints the id, then waits for stdin's end, as serve() does.
        let (h, id) = RootHelper::start(
            sh("echo KT_NCCL_ROOT_ID=00ff; cat >/dev/null; echo \"$KT_NCCL_ROOT_HELPER\" >&2"),
            Duration::from_secs(60),
            Duration::from_secs(10),
        )
        .unwrap();
        assert_eq!(id, "00ff");
        let pid = h.pid();
        assert!(alive(pid));
        drop(h);
        wait_gone(pid);
    }

    #[test]
    fn a_helper_that_fails_or_says_nothing_is_an_error() {
        let e = RootHelper::start(
            sh("echo KT_NCCL_ROOT_ERROR=no NCCL here"),
            Duration::from_secs(1),
            Duration::from_secs(10),
        )
        .unwrap_err();
        assert!(
            matches!(&e, TransportError::Peer(m) if m == "ncclGetUniqueId: no NCCL here"),
            "{e}"
        );
        let e = RootHelper::start(
            sh("exec sleep 30"),
            Duration::from_secs(1),
            Duration::from_millis(200),
        )
        .unwrap_err();
        assert!(
            matches!(&e, TransportError::Timeout(m) if m.contains("no NCCL unique id")),
            "{e}"
        );
        // After a harness's own words, on the same line (seen on a GPU
        // machine: libtest's "test name ... ").
        let script =
            "echo running 1 test; printf 'test t ... '; echo KT_NCCL_ROOT_ID=ab; cat >/dev/null";
        let (_h, id) =
            RootHelper::start(sh(script), Duration::from_secs(60), Duration::from_secs(10))
                .unwrap();
        assert_eq!(id, "ab");
        let e = RootHelper::start(
            sh("echo hello"),
            Duration::from_secs(1),
            Duration::from_secs(10),
        )
        .unwrap_err();
        assert!(e.to_string().contains("served first thing"), "{e}");
    }

    #[test]
    fn the_helper_process_answers_and_ends_with_its_lifetime() {
        // serve() itself, in this test binary: without NCCL it answers an
        // error line; with NCCL an id. Either way it is bounded by its
        // lifetime when stdin stays open.
        let exe = std::env::current_exe().unwrap();
        let mut cmd = Command::new(exe);
        cmd.args([
            "--exact",
            "cuda::root::tests::helper_child",
            "--ignored",
            "--nocapture",
            "--test-threads=1",
        ]);
        let t = Instant::now();
        match RootHelper::start(cmd, Duration::from_millis(300), Duration::from_secs(60)) {
            Ok((h, id)) => {
                assert_eq!(id.len(), 2 * super::super::UNIQUE_ID_BYTES);
                let pid = h.pid();
                // stdin stays open: the lifetime ends it.
                std::mem::forget(h);
                wait_gone(pid);
            }
            Err(e) => assert!(e.to_string().starts_with("ncclGetUniqueId: "), "{e}"),
        }
        assert!(t.elapsed() < Duration::from_secs(30));
    }

    #[test]
    #[ignore = "run by the_helper_process_answers_and_ends_with_its_lifetime"]
    fn helper_child() {
        if let Some(r) = serve_root_helper() {
            r.unwrap();
        }
    }
}
