//! Commands left running in a container's pod (docker, kind/k3d), where
//! the runner holds no process of its own to signal or wait for: the
//! command runs under a shell that prints its pid (`kt-scenario-pid P`)
//! and, at its end, its exit status (`kt-scenario-exit S`) on stdout;
//! signals go to that pid through another exec (`kill -s SIG P`).

use std::sync::Arc;
use std::time::{Duration, Instant};

use async_trait::async_trait;
use futures::StreamExt;
use futures::future::BoxFuture;
use futures::stream::BoxStream;
use tokio::sync::{mpsc, watch};
use tokio::task::JoinHandle;

use super::{ExecOutput, PodProcess, TargetError};
use crate::format::Signal;

const PID: &str = "kt-scenario-pid ";
const EXIT: &str = "kt-scenario-exit ";
/// How long a signal waits for the command's pid line.
const PID_TIMEOUT: Duration = Duration::from_secs(10);

/// `argv` under the reporting shell. With `merge_stderr`, the command's
/// stderr comes on stdout (for exec channels that drop stderr).
pub fn wrap(argv: Vec<String>, merge_stderr: bool) -> Vec<String> {
    let redirect = if merge_stderr { " 2>&1" } else { "" };
    let script =
        format!("\"$@\"{redirect} & p=$!; echo \"{PID}$p\"; wait \"$p\"; echo \"{EXIT}$?\"");
    let mut out = vec!["sh".to_owned(), "-c".to_owned(), script, "sh".to_owned()];
    out.extend(argv);
    out
}

/// What the exec channel delivers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Chunk {
    Stdout(Vec<u8>),
    Stderr(Vec<u8>),
}

/// Sends a signal to a pid inside the pod.
pub type Killer =
    Arc<dyn Fn(Signal, u32) -> BoxFuture<'static, Result<(), TargetError>> + Send + Sync>;

/// The `kill` command line that signals `pid` inside a pod.
pub fn kill_argv(signal: Signal, pid: u32) -> Vec<String> {
    vec![
        "sh".to_owned(),
        "-c".to_owned(),
        format!("kill -s {} {pid}", signal.name()),
    ]
}

/// A command under the reporting shell, read from its exec channel.
pub struct Wrapped {
    pid: watch::Receiver<Option<u32>>,
    lines: mpsc::UnboundedReceiver<String>,
    task: Option<JoinHandle<ExecOutput>>,
    ended: Option<ExecOutput>,
    killer: Killer,
}

impl std::fmt::Debug for Wrapped {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Wrapped")
            .field("pid", &*self.pid.borrow())
            .finish_non_exhaustive()
    }
}

/// Reads `chunks` (the wrapped command's exec channel) in a task of its
/// own. With `merged`, stdout doubles as stderr (the command's errors came
/// on it).
pub fn start(chunks: BoxStream<'static, Chunk>, killer: Killer, merged: bool) -> Wrapped {
    let (pid_tx, pid) = watch::channel(None);
    let (tx, lines) = mpsc::unbounded_channel();
    let started = Instant::now();
    let task = tokio::spawn(async move {
        let mut chunks = chunks;
        let mut pending: Vec<u8> = Vec::new();
        let mut stdout = String::new();
        let mut stderr: Vec<u8> = Vec::new();
        let mut status = None;
        let mut line = |raw: &[u8]| {
            let text = String::from_utf8_lossy(raw);
            let text = text.trim_end_matches(['\n', '\r']);
            if let Some(p) = text.strip_prefix(PID).and_then(|p| p.trim().parse().ok()) {
                let _ = pid_tx.send(Some(p));
            } else if let Some(s) = text.strip_prefix(EXIT).and_then(|s| s.trim().parse().ok()) {
                status = Some(s);
            } else {
                stdout.push_str(text);
                stdout.push('\n');
                let _ = tx.send(text.to_owned());
            }
        };
        while let Some(chunk) = chunks.next().await {
            match chunk {
                Chunk::Stderr(b) => stderr.extend_from_slice(&b),
                Chunk::Stdout(b) => {
                    pending.extend_from_slice(&b);
                    while let Some(i) = pending.iter().position(|&c| c == b'\n') {
                        let l: Vec<u8> = pending.drain(..=i).collect();
                        line(&l);
                    }
                }
            }
        }
        if !pending.is_empty() {
            line(&pending);
        }
        let stderr = if merged {
            stdout.clone()
        } else {
            String::from_utf8_lossy(&stderr).into_owned()
        };
        ExecOutput {
            // No exit line: the pod died under it.
            status: status.unwrap_or(128 + 9),
            stdout,
            stderr,
            duration: started.elapsed(),
        }
    });
    Wrapped {
        pid,
        lines,
        task: Some(task),
        ended: None,
        killer,
    }
}

impl Wrapped {
    fn running(&self) -> bool {
        self.task.as_ref().is_some_and(|t| !t.is_finished())
    }
}

#[async_trait]
impl PodProcess for Wrapped {
    async fn line(&mut self) -> Option<String> {
        self.lines.recv().await
    }

    async fn signal(&mut self, signal: Signal) -> Result<(), TargetError> {
        if !self.running() {
            return Ok(());
        }
        let pid = tokio::time::timeout(PID_TIMEOUT, self.pid.wait_for(Option::is_some))
            .await
            .map_err(|_| TargetError::Failed("the pod command never told its pid".into()))?
            .map_err(|_| TargetError::Failed("the pod command ended unread".into()))?
            .unwrap_or_default();
        (self.killer)(signal, pid).await
    }

    async fn wait(&mut self) -> Result<ExecOutput, TargetError> {
        if let Some(task) = self.task.take() {
            let out = task
                .await
                .map_err(|e| TargetError::Failed(format!("reading a pod command: {e}")))?;
            self.ended = Some(out);
        }
        self.ended
            .clone()
            .ok_or_else(|| TargetError::Failed("a pod command was waited for twice".into()))
    }
}

impl Drop for Wrapped {
    fn drop(&mut self) {
        let pid = *self.pid.borrow();
        if self.running()
            && let Some(pid) = pid
            && let Ok(rt) = tokio::runtime::Handle::try_current()
        {
            rt.spawn((self.killer)(Signal::KILL, pid));
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Mutex;

    use super::*;

    #[test]
    fn the_wrapper_reports_pid_and_status() {
        let argv = wrap(vec!["kt".into(), "tensor".into()], true);
        assert_eq!(argv[..2], ["sh", "-c"]);
        assert!(argv[2].contains("\"$@\" 2>&1 &"), "{}", argv[2]);
        assert_eq!(argv[3..], ["sh", "kt", "tensor"]);
        assert!(!wrap(vec![], false)[2].contains("2>&1"));
        assert_eq!(kill_argv(Signal::TERM, 7)[2], "kill -s TERM 7");
    }

    /// The wrapper itself, run by a real shell.
    #[tokio::test]
    async fn a_real_shell_runs_the_wrapper() {
        let argv = wrap(
            vec![
                "sh".into(),
                "-c".into(),
                "echo up; echo oops >&2; exit 3".into(),
            ],
            false,
        );
        let out = tokio::process::Command::new(&argv[0])
            .args(&argv[1..])
            .output()
            .await
            .unwrap();
        let text = String::from_utf8_lossy(&out.stdout);
        let lines: Vec<&str> = text.lines().collect();
        assert!(lines.iter().any(|l| l.starts_with(PID)), "{text}");
        assert!(lines.contains(&"up"), "{text}");
        assert_eq!(lines.last(), Some(&"kt-scenario-exit 3"), "{text}");
    }

    /// The signals a killer was asked to send, with their pids.
    type Sent = Arc<Mutex<Vec<(Signal, u32)>>>;

    fn recording_killer() -> (Killer, Sent) {
        let seen = Arc::new(Mutex::new(Vec::new()));
        let s = seen.clone();
        let killer: Killer = Arc::new(move |sig, pid| {
            s.lock().unwrap().push((sig, pid));
            Box::pin(async { Ok(()) })
        });
        (killer, seen)
    }

    #[tokio::test]
    async fn lines_pid_and_status_are_read_from_chunks() {
        let (chunk_tx, chunk_rx) = mpsc::unbounded_channel();
        let chunks = tokio_stream_of(chunk_rx);
        let (killer, seen) = recording_killer();
        let mut w = start(chunks, killer, false);
        chunk_tx
            .send(Chunk::Stdout(b"kt-scenario-pid 42\n{\"op\"".to_vec()))
            .unwrap();
        chunk_tx
            .send(Chunk::Stdout(b":1}\nholding".to_vec()))
            .unwrap();
        chunk_tx
            .send(Chunk::Stdout(b" k (pid 42)\n".to_vec()))
            .unwrap();
        assert_eq!(w.line().await.as_deref(), Some("{\"op\":1}"));
        assert_eq!(w.line().await.as_deref(), Some("holding k (pid 42)"));
        w.signal(Signal::TERM).await.unwrap();
        assert_eq!(*seen.lock().unwrap(), [(Signal::TERM, 42)]);
        chunk_tx.send(Chunk::Stderr(b"bye\n".to_vec())).unwrap();
        chunk_tx
            .send(Chunk::Stdout(b"kt-scenario-exit 0\n".to_vec()))
            .unwrap();
        drop(chunk_tx);
        let out = w.wait().await.unwrap();
        assert_eq!(out.status, 0);
        assert_eq!(out.stdout, "{\"op\":1}\nholding k (pid 42)\n");
        assert_eq!(out.stderr, "bye\n");
        // Ended: nothing more to signal.
        w.signal(Signal::KILL).await.unwrap();
        assert_eq!(seen.lock().unwrap().len(), 1);
    }

    #[tokio::test]
    async fn a_channel_that_ends_without_a_status_was_killed() {
        let (chunk_tx, chunk_rx) = mpsc::unbounded_channel();
        let mut w = start(tokio_stream_of(chunk_rx), recording_killer().0, true);
        chunk_tx
            .send(Chunk::Stdout(b"kt: error: boom".to_vec()))
            .unwrap();
        drop(chunk_tx);
        let out = w.wait().await.unwrap();
        assert_eq!(out.status, 128 + 9);
        assert_eq!(out.stderr, "kt: error: boom\n");
    }

    fn tokio_stream_of(mut rx: mpsc::UnboundedReceiver<Chunk>) -> BoxStream<'static, Chunk> {
        futures::stream::poll_fn(move |cx| rx.poll_recv(cx)).boxed()
    }
}
