//! The command layer of the cluster targets: every `kind`, `k3d`, `kubectl`,
//! `docker`, `git` and `tar` command goes through [`Shell`], so a dry run
//! records the commands instead of running them ([`Recorder`]) and tests
//! answer them with canned outputs.

use std::fmt;
use std::path::PathBuf;
use std::process::Stdio;
use std::sync::Mutex;
use std::time::Duration;

use async_trait::async_trait;
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, Command};

use crate::target::TargetError;

/// One command line.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Cmd {
    pub program: String,
    pub args: Vec<String>,
    /// Feed this file to the command's stdin.
    pub stdin: Option<PathBuf>,
    /// Write the command's stdout into this file instead of capturing it.
    pub stdout: Option<PathBuf>,
    /// Runs on the runner's host only (renders, packs, reads git): a dry run
    /// may execute it; everything else touches a cluster or the Docker engine.
    pub local: bool,
}

impl Cmd {
    pub fn new(program: &str) -> Cmd {
        Cmd {
            program: program.to_owned(),
            args: Vec::new(),
            stdin: None,
            stdout: None,
            local: false,
        }
    }

    pub fn arg(mut self, a: impl Into<String>) -> Cmd {
        self.args.push(a.into());
        self
    }

    pub fn args<I, S>(mut self, a: I) -> Cmd
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
    {
        self.args.extend(a.into_iter().map(Into::into));
        self
    }

    pub fn stdin(mut self, p: impl Into<PathBuf>) -> Cmd {
        self.stdin = Some(p.into());
        self
    }

    pub fn stdout(mut self, p: impl Into<PathBuf>) -> Cmd {
        self.stdout = Some(p.into());
        self
    }

    pub fn local(mut self) -> Cmd {
        self.local = true;
        self
    }
}

/// Quotes a word for a POSIX shell when it needs it.
pub fn quote(s: &str) -> String {
    let plain = !s.is_empty()
        && s.chars()
            .all(|c| c.is_ascii_alphanumeric() || "-_./:=,@%+".contains(c));
    if plain {
        s.to_owned()
    } else {
        format!("'{}'", s.replace('\'', r"'\''"))
    }
}

impl fmt::Display for Cmd {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&quote(&self.program))?;
        for a in &self.args {
            write!(f, " {}", quote(a))?;
        }
        if let Some(p) = &self.stdin {
            write!(f, " < {}", quote(&p.display().to_string()))?;
        }
        if let Some(p) = &self.stdout {
            write!(f, " > {}", quote(&p.display().to_string()))?;
        }
        Ok(())
    }
}

/// How a command ended.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Output {
    /// Exit code, or 128 + signal number.
    pub status: i32,
    /// Empty when [`Cmd::stdout`] sent it to a file.
    pub stdout: String,
    pub stderr: String,
}

impl Output {
    pub fn ok(stdout: &str) -> Output {
        Output {
            status: 0,
            stdout: stdout.to_owned(),
            stderr: String::new(),
        }
    }

    pub fn fail(status: i32, stderr: &str) -> Output {
        Output {
            status,
            stdout: String::new(),
            stderr: stderr.to_owned(),
        }
    }

    pub fn success(&self) -> bool {
        self.status == 0
    }
}

/// A long-running command (a `kubectl port-forward`).
#[async_trait]
pub trait Background: Send + Sync {
    /// The next line of its stdout; None once it has ended.
    async fn line(&mut self) -> Option<String>;
    /// Ends it (idempotent).
    async fn stop(&mut self);
}

#[async_trait]
pub trait Shell: Send + Sync {
    /// Runs a command to its end.
    async fn run(&self, cmd: &Cmd) -> Result<Output, TargetError>;
    /// Starts a long-running command.
    async fn spawn(&self, cmd: &Cmd) -> Result<Box<dyn Background>, TargetError>;
    /// Is `program` on PATH?
    fn has(&self, program: &str) -> bool;
}

/// Runs `cmd` and fails unless it exits 0; the error carries its stderr.
pub async fn check(shell: &dyn Shell, cmd: &Cmd) -> Result<Output, TargetError> {
    let out = shell.run(cmd).await?;
    if out.success() {
        Ok(out)
    } else {
        Err(TargetError::Failed(format!(
            "`{cmd}` exited with {}: {}",
            out.status,
            out.stderr.trim()
        )))
    }
}

/// The real thing: processes on this machine.
#[derive(Debug, Default)]
pub struct Real;

fn on_path(program: &str) -> bool {
    std::env::var_os("PATH").is_some_and(|paths| {
        std::env::split_paths(&paths).any(|d| {
            let p = d.join(program);
            std::fs::metadata(&p).is_ok_and(|m| {
                use std::os::unix::fs::PermissionsExt;
                m.is_file() && m.permissions().mode() & 0o111 != 0
            })
        })
    })
}

fn command(cmd: &Cmd) -> Result<Command, TargetError> {
    let mut c = Command::new(&cmd.program);
    c.args(&cmd.args).kill_on_drop(true);
    match &cmd.stdin {
        Some(p) => {
            let f = std::fs::File::open(p)
                .map_err(TargetError::io(format!("opening {}", p.display())))?;
            c.stdin(f);
        }
        None => {
            c.stdin(Stdio::null());
        }
    }
    match &cmd.stdout {
        Some(p) => {
            let f = std::fs::File::create(p)
                .map_err(TargetError::io(format!("creating {}", p.display())))?;
            c.stdout(f);
        }
        None => {
            c.stdout(Stdio::piped());
        }
    }
    c.stderr(Stdio::piped());
    Ok(c)
}

#[async_trait]
impl Shell for Real {
    async fn run(&self, cmd: &Cmd) -> Result<Output, TargetError> {
        // Not `output()`: it would pipe stdout even when it goes to a file.
        let out = command(cmd)?
            .spawn()
            .map_err(TargetError::io(format!("starting `{cmd}`")))?
            .wait_with_output()
            .await
            .map_err(TargetError::io(format!("running `{cmd}`")))?;
        use std::os::unix::process::ExitStatusExt;
        let status = out
            .status
            .code()
            .or_else(|| out.status.signal().map(|s| 128 + s))
            .unwrap_or(-1);
        Ok(Output {
            status,
            stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
            stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
        })
    }

    async fn spawn(&self, cmd: &Cmd) -> Result<Box<dyn Background>, TargetError> {
        let mut c = command(cmd)?;
        // Its stderr is not read: never let it fill a pipe.
        c.stderr(Stdio::null());
        let mut child = c
            .spawn()
            .map_err(TargetError::io(format!("starting `{cmd}`")))?;
        // Read to its end whatever happens: a port-forward prints a line per
        // connection and would block once the pipe is full. Lines nobody
        // waits for are dropped.
        let (tx, lines) = tokio::sync::mpsc::channel(64);
        if let Some(out) = child.stdout.take() {
            tokio::spawn(async move {
                let mut out = BufReader::new(out).lines();
                while let Ok(Some(l)) = out.next_line().await {
                    let _ = tx.try_send(l);
                }
            });
        }
        Ok(Box::new(RealBackground { child, lines }))
    }

    fn has(&self, program: &str) -> bool {
        on_path(program)
    }
}

struct RealBackground {
    child: Child,
    lines: tokio::sync::mpsc::Receiver<String>,
}

#[async_trait]
impl Background for RealBackground {
    async fn line(&mut self) -> Option<String> {
        self.lines.recv().await
    }

    async fn stop(&mut self) {
        let _ = self.child.start_kill();
        let _ = self.child.wait().await;
    }
}

/// A canned answer of a [`Recorder`]: the first rule whose `contains`
/// occurs in the command line answers it.
#[derive(Debug)]
pub struct Rule {
    pub contains: String,
    /// Successive answers: the n-th matching command gets the n-th, and
    /// every later one the last.
    pub outputs: Vec<Output>,
    /// Lines a spawned command prints.
    pub lines: Vec<String>,
    used: std::sync::atomic::AtomicUsize,
}

impl Rule {
    fn new(contains: &str, outputs: Vec<Output>, lines: Vec<String>) -> Rule {
        Rule {
            contains: contains.to_owned(),
            outputs,
            lines,
            used: Default::default(),
        }
    }

    fn next_output(&self) -> Output {
        let n = self.used.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        self.outputs
            .get(n.min(self.outputs.len().saturating_sub(1)))
            .cloned()
            .unwrap_or_default()
    }
}

/// Records every command; answers from its rules (default: success with no
/// output). With `execute_local`, commands marked [`Cmd::local`] really
/// run (a dry run renders the manifests with `kubectl kustomize`).
#[derive(Default)]
pub struct Recorder {
    pub commands: Mutex<Vec<String>>,
    rules: Vec<Rule>,
    execute_local: bool,
    /// Programs [`Shell::has`] says are missing.
    pub missing: Vec<String>,
}

impl fmt::Debug for Recorder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Recorder")
            .field("commands", &self.commands())
            .finish_non_exhaustive()
    }
}

impl Recorder {
    pub fn new() -> Recorder {
        Recorder::default()
    }

    /// Really runs commands marked local.
    pub fn executing_local(mut self) -> Recorder {
        self.execute_local = true;
        self
    }

    /// Answers commands whose line contains `contains` with `output`.
    pub fn answer(self, contains: &str, output: Output) -> Recorder {
        self.answers(contains, vec![output])
    }

    /// Answers the commands whose line contains `contains` with `outputs`
    /// in turn (the last one again once they are used up): a status that
    /// changes between polls.
    pub fn answers(mut self, contains: &str, outputs: Vec<Output>) -> Recorder {
        self.rules.push(Rule::new(contains, outputs, Vec::new()));
        self
    }

    /// Spawned commands whose line contains `contains` print `lines`.
    pub fn prints(mut self, contains: &str, lines: &[&str]) -> Recorder {
        let lines = lines.iter().map(|l| (*l).to_owned()).collect();
        self.rules
            .push(Rule::new(contains, vec![Output::ok("")], lines));
        self
    }

    pub fn commands(&self) -> Vec<String> {
        self.commands.lock().map(|c| c.clone()).unwrap_or_default()
    }

    fn record(&self, line: String) {
        if let Ok(mut c) = self.commands.lock() {
            c.push(line);
        }
    }

    fn rule(&self, line: &str) -> Option<&Rule> {
        self.rules.iter().find(|r| line.contains(&r.contains))
    }
}

/// How long a dry run lets a local command take.
const LOCAL_TIMEOUT: Duration = Duration::from_secs(60);

#[async_trait]
impl Shell for Recorder {
    async fn run(&self, cmd: &Cmd) -> Result<Output, TargetError> {
        let line = cmd.to_string();
        self.record(line.clone());
        if self.execute_local && cmd.local {
            return tokio::time::timeout(LOCAL_TIMEOUT, Real.run(cmd))
                .await
                .map_err(|_| TargetError::Failed(format!("`{cmd}` timed out")))?;
        }
        let out = self.rule(&line).map(Rule::next_output).unwrap_or_default();
        if let (Some(p), true) = (&cmd.stdout, out.success()) {
            std::fs::write(p, &out.stdout)
                .map_err(TargetError::io(format!("writing {}", p.display())))?;
            return Ok(Output {
                stdout: String::new(),
                ..out
            });
        }
        Ok(out)
    }

    async fn spawn(&self, cmd: &Cmd) -> Result<Box<dyn Background>, TargetError> {
        let line = cmd.to_string();
        self.record(format!("{line} &"));
        let lines = self
            .rule(&line)
            .map(|r| r.lines.clone())
            .unwrap_or_default();
        Ok(Box::new(Canned { lines }))
    }

    fn has(&self, program: &str) -> bool {
        !self.missing.iter().any(|m| m == program)
    }
}

struct Canned {
    lines: Vec<String>,
}

#[async_trait]
impl Background for Canned {
    async fn line(&mut self) -> Option<String> {
        if self.lines.is_empty() {
            None
        } else {
            Some(self.lines.remove(0))
        }
    }

    async fn stop(&mut self) {}
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn command_lines_quote_what_a_shell_would_split() {
        let c = Cmd::new("kubectl")
            .args(["exec", "p-0", "--", "sh", "-c", "cd /work && exec \"$@\""])
            .stdout("/tmp/a b");
        assert_eq!(
            c.to_string(),
            r#"kubectl exec p-0 -- sh -c 'cd /work && exec "$@"' > '/tmp/a b'"#
        );
        assert_eq!(quote("it's"), r"'it'\''s'");
        assert_eq!(quote(""), "''");
    }

    #[tokio::test]
    async fn real_commands_write_stdout_files_and_read_stdin_files() {
        let dir = tempfile::tempdir().unwrap();
        let (a, b) = (dir.path().join("a"), dir.path().join("b"));
        std::fs::write(&a, "hello\n").unwrap();
        let out = Real
            .run(&Cmd::new("cat").stdin(&a).stdout(&b))
            .await
            .unwrap();
        assert!(out.success());
        assert_eq!(std::fs::read_to_string(&b).unwrap(), "hello\n");
        let out = Real
            .run(&Cmd::new("sh").args(["-c", "echo out; echo err >&2; exit 3"]))
            .await
            .unwrap();
        assert_eq!(
            (out.status, out.stdout.as_str(), out.stderr.as_str()),
            (3, "out\n", "err\n")
        );
    }

    #[tokio::test]
    async fn a_background_command_is_read_to_its_end() {
        // More output than a pipe holds: the command must still finish.
        let cmd = Cmd::new("sh").args(["-c", "echo first; seq 1 200000; echo done"]);
        let mut p = Real.spawn(&cmd).await.unwrap();
        assert_eq!(p.line().await.as_deref(), Some("first"));
        tokio::time::sleep(Duration::from_millis(50)).await;
        let mut last = None;
        while let Some(l) = tokio::time::timeout(Duration::from_secs(20), p.line())
            .await
            .unwrap()
        {
            last = Some(l);
        }
        assert!(last.is_some());
        p.stop().await;
    }

    #[tokio::test]
    async fn the_recorder_answers_from_its_rules_and_writes_stdout_files() {
        let dir = tempfile::tempdir().unwrap();
        let r = Recorder::new().answer("get clusters", Output::ok("a\nb\n"));
        let out = r.run(&Cmd::new("kind").args(["get", "clusters"])).await;
        assert_eq!(out.unwrap().stdout, "a\nb\n");
        let f = dir.path().join("x");
        let out = r
            .run(&Cmd::new("kind").args(["get", "clusters"]).stdout(&f))
            .await
            .unwrap();
        assert_eq!(out.stdout, "");
        assert_eq!(std::fs::read_to_string(&f).unwrap(), "a\nb\n");
        assert_eq!(r.commands().len(), 2);
    }
}
