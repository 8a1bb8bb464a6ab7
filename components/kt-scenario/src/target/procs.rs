//! Processes the process-based targets (local, netns) run: long-lived
//! servers with a log file, and commands executed "inside" a pod. Every
//! process gets its own process group, so a signal reaches everything it
//! started and the terminal's Ctrl-C reaches only the runner (which then
//! cleans up).

use std::collections::{HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use rustix::process::{Pid, Signal as Sig, kill_process_group};
use tokio::io::{AsyncBufReadExt, AsyncReadExt, BufReader};
use tokio::process::{Child, Command};
use tokio::sync::mpsc;
use tokio::task::JoinHandle;

use super::{ExecOutput, PodProcess, TargetError};
use crate::format::Signal;

pub fn sig(s: Signal) -> Sig {
    match s {
        Signal::KILL => Sig::KILL,
        Signal::TERM => Sig::TERM,
        Signal::STOP => Sig::STOP,
        Signal::CONT => Sig::CONT,
    }
}

fn signal_group(pid: u32, s: Signal) {
    if let Some(pid) = i32::try_from(pid).ok().and_then(Pid::from_raw) {
        // ESRCH: already gone, which is what we want.
        let _ = kill_process_group(pid, sig(s));
    }
}

/// A server process (metadata, store, later agents) that can be stopped and
/// started again with the same command line.
#[derive(Debug)]
pub struct Server {
    pub name: String,
    argv: Vec<String>,
    env: Vec<(String, String)>,
    log: PathBuf,
    child: Option<Child>,
}

impl Server {
    /// `argv[0]` is the program. Output goes to `log`, appended across restarts.
    pub fn new(name: &str, argv: Vec<String>, env: Vec<(String, String)>, log: PathBuf) -> Server {
        Server {
            name: name.to_owned(),
            argv,
            env,
            log,
            child: None,
        }
    }

    pub fn log_path(&self) -> &Path {
        &self.log
    }

    pub fn start(&mut self) -> Result<(), TargetError> {
        if self.child.is_some() {
            return Err(TargetError::Failed(format!(
                "{} is already running",
                self.name
            )));
        }
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.log)
            .map_err(TargetError::io(format!("opening {}", self.log.display())))?;
        let err = log
            .try_clone()
            .map_err(TargetError::io("duplicating a log handle"))?;
        let mut cmd = Command::new(&self.argv[0]);
        cmd.args(&self.argv[1..])
            .envs(self.env.iter().cloned())
            .stdin(Stdio::null())
            .stdout(log)
            .stderr(err)
            .process_group(0)
            .kill_on_drop(true);
        let child = cmd.spawn().map_err(TargetError::io(format!(
            "starting {} ({})",
            self.name, self.argv[0]
        )))?;
        self.child = Some(child);
        Ok(())
    }

    /// Signals the server's process group and waits for it to exit
    /// (STOP and CONT only freeze and thaw it).
    pub async fn stop(&mut self, s: Signal, grace: Duration) -> Result<(), TargetError> {
        if s.freezes() {
            if let Some(pid) = self.child.as_ref().and_then(Child::id) {
                signal_group(pid, s);
            }
            return Ok(());
        }
        let Some(mut child) = self.child.take() else {
            return Ok(());
        };
        if let Some(pid) = child.id() {
            // A frozen process would never see TERM.
            signal_group(pid, Signal::CONT);
        }
        if let Some(pid) = child.id() {
            signal_group(pid, s);
            if tokio::time::timeout(grace, child.wait()).await.is_err() {
                signal_group(pid, Signal::KILL);
            }
        }
        child
            .wait()
            .await
            .map_err(TargetError::io(format!("waiting for {}", self.name)))?;
        Ok(())
    }

    /// The exit status if the process has ended on its own.
    pub fn exited(&mut self) -> Option<std::process::ExitStatus> {
        self.child
            .as_mut()
            .and_then(|c| c.try_wait().ok().flatten())
    }

    pub fn is_running(&self) -> bool {
        self.child.is_some()
    }

    /// Polls `url` (a `/readyz`) until it answers 200, the process exits, or
    /// `timeout` passes. Errors carry the end of the log.
    pub async fn wait_ready(
        &mut self,
        http: &reqwest::Client,
        url: &str,
        timeout: Duration,
    ) -> Result<(), TargetError> {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(status) = self.exited() {
                self.child = None;
                return Err(TargetError::Failed(format!(
                    "{} exited ({status}) before it was ready; log:\n{}",
                    self.name,
                    log_tail(&self.log, 20)
                )));
            }
            if let Ok(r) = http.get(url).send().await
                && r.status().is_success()
            {
                return Ok(());
            }
            if Instant::now() >= deadline {
                return Err(TargetError::Failed(format!(
                    "{} not ready at {url} after {timeout:?}; log:\n{}",
                    self.name,
                    log_tail(&self.log, 20)
                )));
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }
}

/// The last `n` lines of a log file (for error messages).
pub fn log_tail(path: &Path, n: usize) -> String {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(n)..].join("\n")
}

type Running = Arc<Mutex<HashMap<String, HashSet<u32>>>>;

fn lock_running(r: &Running) -> std::sync::MutexGuard<'_, HashMap<String, HashSet<u32>>> {
    r.lock().unwrap_or_else(|e| e.into_inner())
}

/// Commands running inside pods, by pod, so `kill pod` reaches all of them.
#[derive(Debug, Default)]
pub struct PodProcs {
    running: Running,
}

impl PodProcs {
    /// Runs `cmd` as a command of `pod`, capturing its output.
    pub async fn run(&self, pod: &str, mut cmd: Command) -> Result<ExecOutput, TargetError> {
        cmd.stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .process_group(0);
        let started = Instant::now();
        let child = cmd
            .spawn()
            .map_err(TargetError::io(format!("starting a command in pod {pod}")))?;
        let pid = child.id();
        if let Some(pid) = pid {
            self.lock().entry(pod.to_owned()).or_default().insert(pid);
        }
        // If this future is dropped (a step timeout, Ctrl-C), the guard kills
        // the command's whole process group, not only the direct child.
        let guard = GroupGuard {
            procs: self,
            pod,
            pid,
        };
        let out = child.wait_with_output().await;
        let duration = started.elapsed();
        guard.forget();
        let out = out.map_err(TargetError::io(format!(
            "waiting for a command in pod {pod}"
        )))?;
        Ok(ExecOutput {
            status: exit_status(&out.status),
            stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
            stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
            duration,
        })
    }

    /// Starts `cmd` as a command of `pod` and returns at once: its stdout
    /// comes line by line, its end with [`PodProcess::wait`].
    pub fn spawn(&self, pod: &str, mut cmd: Command) -> Result<Spawned, TargetError> {
        cmd.stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .process_group(0);
        let started = Instant::now();
        let mut child = cmd
            .spawn()
            .map_err(TargetError::io(format!("starting a command in pod {pod}")))?;
        let pid = child.id();
        if let Some(pid) = pid {
            self.lock().entry(pod.to_owned()).or_default().insert(pid);
        }
        let (tx, lines) = mpsc::unbounded_channel();
        let (stdout, stderr) = (child.stdout.take(), child.stderr.take());
        let running = self.running.clone();
        let owner = pod.to_owned();
        let task = tokio::spawn(async move {
            let read_out = async {
                let mut all = String::new();
                if let Some(out) = stdout {
                    let mut out = BufReader::new(out).lines();
                    while let Ok(Some(l)) = out.next_line().await {
                        all.push_str(&l);
                        all.push('\n');
                        // Nobody listening any more is fine.
                        let _ = tx.send(l);
                    }
                }
                all
            };
            let read_err = async {
                let mut buf = Vec::new();
                if let Some(mut err) = stderr {
                    let _ = err.read_to_end(&mut buf).await;
                }
                String::from_utf8_lossy(&buf).into_owned()
            };
            let (stdout, stderr) = tokio::join!(read_out, read_err);
            let status = child.wait().await;
            if let Some(pid) = pid
                && let Some(set) = lock_running(&running).get_mut(&owner)
            {
                set.remove(&pid);
            }
            let status = status.map_err(TargetError::io(format!(
                "waiting for a command in pod {owner}"
            )))?;
            Ok(ExecOutput {
                status: exit_status(&status),
                stdout,
                stderr,
                duration: started.elapsed(),
            })
        });
        Ok(Spawned {
            pid,
            lines,
            task: Some(task),
            ended: None,
        })
    }

    /// Signals every command running in `pod`.
    pub fn signal(&self, pod: &str, s: Signal) {
        for pid in self.lock().get(pod).into_iter().flatten() {
            signal_group(*pid, s);
        }
    }

    /// Signals every command of every pod.
    pub fn signal_all(&self, s: Signal) {
        for pids in self.lock().values() {
            for pid in pids {
                signal_group(*pid, s);
            }
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, HashSet<u32>>> {
        lock_running(&self.running)
    }
}

/// A command [`PodProcs::spawn`] started; dropping it kills its process
/// group if it still runs.
#[derive(Debug)]
pub struct Spawned {
    pid: Option<u32>,
    lines: mpsc::UnboundedReceiver<String>,
    task: Option<JoinHandle<Result<ExecOutput, TargetError>>>,
    ended: Option<ExecOutput>,
}

impl Spawned {
    fn running(&self) -> bool {
        self.task.as_ref().is_some_and(|t| !t.is_finished())
    }
}

#[async_trait]
impl PodProcess for Spawned {
    async fn line(&mut self) -> Option<String> {
        self.lines.recv().await
    }

    async fn signal(&mut self, s: Signal) -> Result<(), TargetError> {
        if self.running()
            && let Some(pid) = self.pid
        {
            signal_group(pid, s);
        }
        Ok(())
    }

    async fn wait(&mut self) -> Result<ExecOutput, TargetError> {
        if let Some(task) = self.task.take() {
            let out = task
                .await
                .map_err(|e| TargetError::Failed(format!("waiting for a pod command: {e}")))??;
            self.ended = Some(out);
        }
        self.ended
            .clone()
            .ok_or_else(|| TargetError::Failed("a pod command was waited for twice".into()))
    }
}

impl Drop for Spawned {
    fn drop(&mut self) {
        if self.running()
            && let Some(pid) = self.pid
        {
            signal_group(pid, Signal::KILL);
        }
    }
}

/// Unregisters a pod command when it ends; kills its process group when the
/// wait was abandoned.
struct GroupGuard<'a> {
    procs: &'a PodProcs,
    pod: &'a str,
    pid: Option<u32>,
}

impl GroupGuard<'_> {
    /// The command exited: only unregister it.
    fn forget(mut self) {
        self.unregister();
        self.pid = None;
    }

    fn unregister(&self) {
        if let Some(pid) = self.pid
            && let Some(set) = self.procs.lock().get_mut(self.pod)
        {
            set.remove(&pid);
        }
    }
}

impl Drop for GroupGuard<'_> {
    fn drop(&mut self) {
        if let Some(pid) = self.pid {
            signal_group(pid, Signal::KILL);
            self.unregister();
        }
    }
}

fn exit_status(s: &std::process::ExitStatus) -> i32 {
    use std::os::unix::process::ExitStatusExt;
    s.code().unwrap_or_else(|| 128 + s.signal().unwrap_or(0))
}

/// A port that was free on `ip` a moment ago (servers bind it next).
pub fn free_port(ip: std::net::IpAddr) -> Result<u16, TargetError> {
    let l = std::net::TcpListener::bind((ip, 0))
        .map_err(TargetError::io(format!("finding a free port on {ip}")))?;
    l.local_addr()
        .map(|a| a.port())
        .map_err(TargetError::io("reading a bound address"))
}

/// The path of a binary in `bin_dir`, checked to exist.
pub fn binary(bin_dir: &Path, name: &str) -> Result<String, TargetError> {
    let p = bin_dir.join(name);
    if !p.is_file() {
        return Err(TargetError::Unavailable(format!(
            "{} not found; build it first (make release) or pass --bin-dir",
            p.display()
        )));
    }
    Ok(p.display().to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn exec_captures_output_and_status() {
        let procs = PodProcs::default();
        let mut cmd = Command::new("sh");
        cmd.args(["-c", "echo out; echo err >&2; exit 3"]);
        let out = procs.run("p", cmd).await.unwrap();
        assert_eq!(out.status, 3);
        assert_eq!(out.stdout, "out\n");
        assert_eq!(out.stderr, "err\n");
    }

    #[tokio::test]
    async fn killing_a_pod_ends_its_commands() {
        let procs = std::sync::Arc::new(PodProcs::default());
        let p2 = procs.clone();
        let task = tokio::spawn(async move {
            let mut cmd = Command::new("sh");
            cmd.args(["-c", "sleep 30 & wait"]);
            p2.run("victim", cmd).await.unwrap()
        });
        // Wait on the condition "the command is registered", not on time.
        let deadline = Instant::now() + Duration::from_secs(10);
        while procs.lock().get("victim").is_none_or(|s| s.is_empty()) {
            assert!(Instant::now() < deadline, "command never started");
            tokio::task::yield_now().await;
        }
        procs.signal("victim", Signal::KILL);
        let out = task.await.unwrap();
        assert_eq!(out.status, 128 + 9);
    }

    #[tokio::test]
    async fn spawned_commands_stream_lines_and_end_on_a_signal() {
        let procs = PodProcs::default();
        let mut cmd = Command::new("sh");
        cmd.args([
            "-c",
            "trap 'echo bye; exit 0' TERM; echo ready; while :; do sleep 0.05; done",
        ]);
        let mut p = procs.spawn("holder", cmd).unwrap();
        assert_eq!(p.line().await.as_deref(), Some("ready"));
        assert_eq!(procs.lock().get("holder").map(HashSet::len), Some(1));
        p.signal(Signal::TERM).await.unwrap();
        let out = p.wait().await.unwrap();
        assert_eq!(out.status, 0, "{out:?}");
        assert_eq!(out.stdout, "ready\nbye\n");
        assert_eq!(p.line().await.as_deref(), Some("bye"));
        assert_eq!(p.line().await, None);
        assert!(procs.lock().get("holder").is_some_and(HashSet::is_empty));
        // Signalling what has ended is harmless.
        p.signal(Signal::KILL).await.unwrap();
    }

    #[tokio::test]
    async fn killing_a_pod_ends_its_spawned_commands() {
        let procs = PodProcs::default();
        let mut cmd = Command::new("sh");
        cmd.args(["-c", "echo up; sleep 30 & wait"]);
        let mut p = procs.spawn("victim", cmd).unwrap();
        assert_eq!(p.line().await.as_deref(), Some("up"));
        procs.signal("victim", Signal::KILL);
        assert_eq!(p.wait().await.unwrap().status, 128 + 9);
    }

    #[tokio::test]
    async fn a_server_that_exits_early_reports_its_log() {
        let dir = tempfile::tempdir().unwrap();
        let mut s = Server::new(
            "boom",
            vec!["sh".into(), "-c".into(), "echo cannot bind; exit 1".into()],
            vec![],
            dir.path().join("boom.log"),
        );
        s.start().unwrap();
        let http = kt_api::client();
        let err = s
            .wait_ready(&http, "http://127.0.0.1:9/readyz", Duration::from_secs(10))
            .await
            .unwrap_err()
            .to_string();
        assert!(err.contains("cannot bind"), "{err}");
    }
}
