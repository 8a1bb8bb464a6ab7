//! External commands (`ip`, `tc`, `iptables`), in the root namespace or
//! inside a run's, one by one, as batches or many at once.

use std::io::Write;
use std::process::Stdio;

use crate::target::TargetError;

/// Setup commands run at once.
const PARALLEL: usize = 16;
pub(super) const NETNS_DIR: &str = "/run/netns";

pub(super) fn on_path(prog: &str) -> bool {
    std::env::var_os("PATH")
        .is_some_and(|p| std::env::split_paths(&p).any(|d| d.join(prog).is_file()))
}

/// An external command (`ip`, `tc`, `iptables`), optionally fed `lines` as
/// a `-batch -`. Its errors name the command line and carry its stderr and,
/// for a batch, the line that failed.
#[derive(Debug)]
pub(super) struct Cmd {
    argv: Vec<String>,
    lines: Option<Vec<String>>,
}

type Started = (std::process::Child, std::io::Result<()>);

impl Cmd {
    pub(super) fn new(argv: &[&str]) -> Cmd {
        let argv = argv.iter().map(|a| (*a).to_owned()).collect();
        Cmd { argv, lines: None }
    }

    /// `argv -batch -`, reading `lines`.
    pub(super) fn batch(argv: &[&str], lines: Vec<String>) -> Cmd {
        let mut cmd = Cmd::new(argv);
        cmd.argv.extend(["-batch".to_owned(), "-".to_owned()]);
        cmd.lines = Some(lines);
        cmd
    }

    /// The command inside namespace `ns`. `nsenter` switches only the
    /// network namespace: several times cheaper than `ip -n`, which also
    /// remounts /sys.
    pub(super) fn inside(mut self, ns: &str) -> Cmd {
        let enter = ["nsenter".to_owned(), format!("--net={NETNS_DIR}/{ns}")];
        self.argv.splice(0..0, enter);
        self
    }

    fn line(&self) -> String {
        self.argv.join(" ")
    }

    /// Runs the command and returns its stdout.
    pub(super) fn run(&self) -> Result<String, TargetError> {
        self.spawn().and_then(|started| self.finish(started))
    }

    fn spawn(&self) -> Result<Started, TargetError> {
        let mut child = std::process::Command::new(&self.argv[0])
            .args(&self.argv[1..])
            .stdin(if self.lines.is_some() {
                Stdio::piped()
            } else {
                Stdio::null()
            })
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .map_err(TargetError::io(format!("running `{}`", self.line())))?;
        // A failing batch stops reading: its status and stderr then say
        // more than the broken pipe, so `finish` looks at them first.
        let wrote = match (&self.lines, child.stdin.take()) {
            (Some(lines), Some(mut stdin)) => {
                stdin.write_all(format!("{}\n", lines.join("\n")).as_bytes())
            }
            _ => Ok(()),
        };
        Ok((child, wrote))
    }

    fn finish(&self, (child, wrote): Started) -> Result<String, TargetError> {
        let out = child
            .wait_with_output()
            .map_err(TargetError::io(format!("waiting for `{}`", self.line())))?;
        if !out.status.success() {
            let stderr = String::from_utf8_lossy(&out.stderr);
            // iproute2 names the line of a batch that failed: "Command failed -:<n>".
            let at = stderr.rsplit_once("Command failed -:").and_then(|(_, n)| {
                let n: usize = n.trim().parse().ok()?;
                self.lines.as_ref()?.get(n.checked_sub(1)?)
            });
            return Err(TargetError::Failed(format!(
                "`{}` failed ({}): {}{}",
                self.line(),
                out.status,
                stderr.trim(),
                at.map(|l| format!(" (at `{l}`)")).unwrap_or_default()
            )));
        }
        wrote.map_err(TargetError::io(format!("feeding `{}`", self.line())))?;
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    }
}

/// Runs `cmds`, [`PARALLEL`] at a time: namespace setup mostly waits on
/// the kernel, so this is several times faster than one by one.
pub(super) fn run_all(cmds: &[Cmd]) -> Result<(), TargetError> {
    for chunk in cmds.chunks(PARALLEL) {
        let started: Vec<_> = chunk.iter().map(|c| (c, c.spawn())).collect();
        // Every started command is waited for before an error returns.
        let done: Vec<_> = started
            .into_iter()
            .map(|(c, s)| s.and_then(|s| c.finish(s)))
            .collect();
        done.into_iter().collect::<Result<Vec<_>, _>>()?;
    }
    Ok(())
}

/// Runs blocking network plumbing off the async runtime.
pub(super) async fn blocking<T: Send + 'static>(
    f: impl FnOnce() -> Result<T, TargetError> + Send + 'static,
) -> Result<T, TargetError> {
    kt_sync::task::blocking(f).await
}

/// `argv` run inside namespace `ns`.
pub(super) fn in_netns(ns: &str, argv: Vec<String>) -> Vec<String> {
    ["ip", "netns", "exec", ns]
        .into_iter()
        .map(str::to_owned)
        .chain(argv)
        .collect()
}
