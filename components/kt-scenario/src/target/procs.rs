//! Processes the process-based targets (local, netns) run: long-lived
//! servers with a log file, and commands executed "inside" a pod. Every
//! process gets its own process group, so a signal reaches everything it
//! started and the terminal's Ctrl-C reaches only the runner (which then
//! cleans up).

use std::collections::{HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use rustix::process::{Pid, Signal as Sig, kill_process_group};
use tokio::process::{Child, Command};

use super::{ExecOutput, TargetError};
use crate::format::Signal;

fn sig(s: Signal) -> Sig {
    match s {
        Signal::KILL => Sig::KILL,
        Signal::TERM => Sig::TERM,
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

    /// Signals the server's process group and waits for it to exit.
    pub async fn stop(&mut self, s: Signal, grace: Duration) -> Result<(), TargetError> {
        let Some(mut child) = self.child.take() else {
            return Ok(());
        };
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

/// Commands running inside pods, by pod, so `kill pod` reaches all of them.
#[derive(Debug, Default)]
pub struct PodProcs {
    running: Mutex<HashMap<String, HashSet<u32>>>,
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
        self.running.lock().unwrap_or_else(|e| e.into_inner())
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
    async fn a_server_that_exits_early_reports_its_log() {
        let dir = tempfile::tempdir().unwrap();
        let mut s = Server::new(
            "boom",
            vec!["sh".into(), "-c".into(), "echo cannot bind; exit 1".into()],
            vec![],
            dir.path().join("boom.log"),
        );
        s.start().unwrap();
        let http = reqwest::Client::new();
        let err = s
            .wait_ready(&http, "http://127.0.0.1:9/readyz", Duration::from_secs(10))
            .await
            .unwrap_err()
            .to_string();
        assert!(err.contains("cannot bind"), "{err}");
    }
}
