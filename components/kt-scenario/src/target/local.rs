//! The `local` target: the metadata server and the store are real processes
//! on loopback; every pod is a directory, a loopback address of its own
//! (127.0.x.y) and the process groups of the commands it runs. Needs no
//! root, starts in milliseconds per pod.

use std::collections::HashMap;
use std::net::{IpAddr, Ipv4Addr};
use std::path::{Path, PathBuf};
use std::time::Duration;

use async_trait::async_trait;
use tokio::process::Command;

use super::procs::{PodProcs, Server, binary, free_port};
use super::{Component, ExecOutput, ExecRequest, Plan, Program, Target, TargetError};
use crate::format::Signal;

/// How long a server gets to become ready.
pub const READY_TIMEOUT: Duration = Duration::from_secs(20);
/// How long a TERM gets before KILL.
const GRACE: Duration = Duration::from_secs(10);

const METADATA_IP: Ipv4Addr = Ipv4Addr::new(127, 0, 0, 2);
const STORE_IP: Ipv4Addr = Ipv4Addr::new(127, 0, 0, 3);

/// The loopback address of the `i`th pod: 127.0.1.2, 127.0.1.3, ...
pub fn pod_ip(i: usize) -> Ipv4Addr {
    let n = u32::try_from(i).unwrap_or(u32::MAX);
    Ipv4Addr::new(127, 0, 1 + (n / 250) as u8, 2 + (n % 250) as u8)
}

/// The two servers of a process-based testbed, each with the URL the runner
/// reaches it at. Behind a lock: kill and restart run while pods exec.
#[derive(Debug, Default)]
pub struct Servers {
    pub metadata: Option<(Server, String)>,
    pub store: Option<(Server, String)>,
}

impl Servers {
    pub fn get(&mut self, c: &Component) -> Result<&mut (Server, String), TargetError> {
        match c {
            Component::Metadata => self.metadata.as_mut(),
            Component::Store => self.store.as_mut(),
            Component::Pod(p) => {
                return Err(TargetError::Failed(format!(
                    "pod {p} has no server to restart"
                )));
            }
        }
        .ok_or_else(|| TargetError::Failed("the testbed is not up".into()))
    }

    /// Signals one server and waits for it to exit.
    pub async fn kill(&mut self, c: &Component, signal: Signal) -> Result<(), TargetError> {
        self.get(c)?.0.stop(signal, GRACE).await
    }

    /// Starts one server again and waits until it is ready.
    pub async fn start(
        &mut self,
        http: &reqwest::Client,
        c: &Component,
    ) -> Result<(), TargetError> {
        let (server, url) = self.get(c)?;
        server.start()?;
        server
            .wait_ready(http, &format!("{url}/readyz"), READY_TIMEOUT)
            .await
    }

    /// Stops both, the store first (it talks to the metadata server while
    /// stopping).
    pub async fn stop_all(&mut self) -> Result<(), TargetError> {
        if let Some((s, _)) = self.store.as_mut() {
            s.stop(Signal::TERM, GRACE).await?;
        }
        if let Some((m, _)) = self.metadata.as_mut() {
            m.stop(Signal::TERM, GRACE).await?;
        }
        Ok(())
    }

    pub fn logs(&self) -> impl Iterator<Item = &Server> {
        self.metadata.iter().chain(self.store.iter()).map(|s| &s.0)
    }
}

#[derive(Debug, Default)]
pub struct Local {
    http: reqwest::Client,
    work: PathBuf,
    bin_kt: String,
    metadata_url: String,
    store_url: String,
    servers: tokio::sync::Mutex<Servers>,
    pods: HashMap<String, Ipv4Addr>,
    procs: PodProcs,
}

impl Local {
    pub fn new() -> Local {
        Local::default()
    }
}

/// Builds the metadata and store server command lines; shared with the
/// netns target, which prefixes them with `ip netns exec`.
pub fn server_argvs(
    plan: &Plan,
    metadata_listen: &str,
    metadata_url: &str,
    store_listen: &str,
    store_url: &str,
) -> Result<(Vec<String>, Vec<String>), TargetError> {
    let meta = vec![
        binary(&plan.bin_dir, "kt-metadata")?,
        "--listen".into(),
        metadata_listen.into(),
        "--state-dir".into(),
        plan.work_dir.join("metadata").display().to_string(),
    ];
    let mut store = vec![
        binary(&plan.bin_dir, "kt-store")?,
        "--listen".into(),
        store_listen.into(),
        "--data-dir".into(),
        plan.work_dir.join("store").display().to_string(),
        "--metadata-url".into(),
        metadata_url.into(),
        "--advertise-url".into(),
        store_url.into(),
    ];
    if let Some(cs) = plan.chunk_size {
        store.extend(["--chunk-size".into(), cs.to_string()]);
    }
    Ok((meta, store))
}

/// The networks testbeds use (local: loopback; netns: 198.18.0.0/15).
const TESTBED_NETS: &str = "127.0.0.0/8,198.18.0.0/15,localhost";

/// The environment every command in a pod gets.
pub fn pod_env(
    req: &ExecRequest,
    metadata_url: &str,
    pod_dir: &Path,
    pod_ip: &str,
) -> Vec<(String, String)> {
    let mut env = vec![
        ("KT_METADATA_URL".to_owned(), metadata_url.to_owned()),
        ("KT_PROGRESS".to_owned(), "never".to_owned()),
        ("KT_POD_NAME".to_owned(), req.pod.clone()),
        ("KT_POD_IP".to_owned(), pod_ip.to_owned()),
        ("HOME".to_owned(), pod_dir.display().to_string()),
        (
            "XDG_CACHE_HOME".to_owned(),
            pod_dir.join(".cache").display().to_string(),
        ),
        // Testbed traffic never goes through a proxy the runner's user has set.
        ("NO_PROXY".to_owned(), TESTBED_NETS.to_owned()),
        ("no_proxy".to_owned(), TESTBED_NETS.to_owned()),
    ];
    if let Some(t) = &req.token {
        env.push(("KT_TOKEN".to_owned(), t.clone()));
    }
    env.extend(req.env.iter().cloned());
    env
}

/// The program and arguments of an exec request.
pub fn exec_argv(kt: &str, req: &ExecRequest) -> Vec<String> {
    let mut argv = match req.program {
        Program::Kt => vec![kt.to_owned()],
        Program::Shell => vec!["sh".to_owned(), "-c".to_owned()],
    };
    argv.extend(req.args.iter().cloned());
    argv
}

/// Creates the pod directories below the plan's work dir.
pub fn make_pod_dirs(plan: &Plan) -> Result<(), TargetError> {
    for p in &plan.pods {
        let d = plan.work_dir.join("pods").join(&p.name);
        std::fs::create_dir_all(&d)
            .map_err(TargetError::io(format!("creating {}", d.display())))?;
    }
    std::fs::create_dir_all(plan.work_dir.join("logs"))
        .map_err(TargetError::io("creating the log directory"))
}

/// Copies the log of each server into `dir`.
pub fn copy_logs<'a>(
    servers: impl Iterator<Item = &'a Server>,
    dir: &Path,
) -> Result<(), TargetError> {
    std::fs::create_dir_all(dir).map_err(TargetError::io(format!("creating {}", dir.display())))?;
    for s in servers {
        let to = dir.join(format!("{}.log", s.name));
        if s.log_path().exists() {
            std::fs::copy(s.log_path(), &to).map_err(TargetError::io(format!(
                "copying {}",
                s.log_path().display()
            )))?;
        }
    }
    Ok(())
}

#[async_trait]
impl Target for Local {
    fn name(&self) -> &'static str {
        "local"
    }

    fn unavailable(&self) -> Option<String> {
        None
    }

    async fn up(&mut self, plan: &Plan) -> Result<(), TargetError> {
        self.work = plan.work_dir.clone();
        self.bin_kt = binary(&plan.bin_dir, "kt")?;
        make_pod_dirs(plan)?;
        let mport = free_port(IpAddr::V4(METADATA_IP))?;
        let sport = free_port(IpAddr::V4(STORE_IP))?;
        let metadata_url = format!("http://{METADATA_IP}:{mport}");
        let store_url = format!("http://{STORE_IP}:{sport}");
        let (margv, sargv) = server_argvs(
            plan,
            &format!("{METADATA_IP}:{mport}"),
            &metadata_url,
            &format!("{STORE_IP}:{sport}"),
            &store_url,
        )?;
        let env = vec![("KT_TOKEN".to_owned(), plan.token.clone())];
        let logs = plan.work_dir.join("logs");
        self.metadata_url = metadata_url.clone();
        self.store_url = store_url.clone();
        let servers = self.servers.get_mut();
        servers.metadata = Some((
            Server::new("metadata", margv, env.clone(), logs.join("metadata.log")),
            metadata_url,
        ));
        servers.store = Some((
            Server::new("store", sargv, env, logs.join("store.log")),
            store_url,
        ));
        servers.start(&self.http, &Component::Metadata).await?;
        servers.start(&self.http, &Component::Store).await?;
        self.pods = plan
            .pods
            .iter()
            .enumerate()
            .map(|(i, p)| (p.name.clone(), pod_ip(i)))
            .collect();
        Ok(())
    }

    fn metadata_url(&self) -> String {
        self.metadata_url.clone()
    }

    fn component_url(&self, c: &Component) -> Option<String> {
        match c {
            Component::Metadata => Some(self.metadata_url.clone()),
            Component::Store => Some(self.store_url.clone()),
            Component::Pod(_) => None,
        }
    }

    fn pod_dir(&self, pod: &str) -> PathBuf {
        self.work.join("pods").join(pod)
    }

    async fn exec(&self, req: ExecRequest) -> Result<ExecOutput, TargetError> {
        let ip = self
            .pods
            .get(&req.pod)
            .ok_or_else(|| TargetError::Failed(format!("no pod named {}", req.pod)))?;
        let dir = self.pod_dir(&req.pod);
        let argv = exec_argv(&self.bin_kt, &req);
        let mut cmd = Command::new(&argv[0]);
        cmd.args(&argv[1..]).current_dir(&dir).envs(pod_env(
            &req,
            &self.metadata_url(),
            &dir,
            &ip.to_string(),
        ));
        self.procs.run(&req.pod, cmd).await
    }

    async fn kill(&self, c: &Component, signal: Signal) -> Result<(), TargetError> {
        if let Component::Pod(p) = c {
            self.procs.signal(p, signal);
            return Ok(());
        }
        self.servers.lock().await.kill(c, signal).await
    }

    async fn start(&self, c: &Component) -> Result<(), TargetError> {
        self.servers.lock().await.start(&self.http, c).await
    }

    async fn collect_logs(&self, dir: &Path) -> Result<(), TargetError> {
        copy_logs(self.servers.lock().await.logs(), dir)
    }

    async fn down(&mut self) -> Result<(), TargetError> {
        self.procs.signal_all(Signal::KILL);
        self.servers.get_mut().stop_all().await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pod_addresses_are_distinct_loopback_addresses() {
        let ips: std::collections::HashSet<_> = (0..600).map(pod_ip).collect();
        assert_eq!(ips.len(), 600);
        assert!(ips.iter().all(|ip| ip.is_loopback()));
        assert!(!ips.contains(&METADATA_IP) && !ips.contains(&STORE_IP));
    }
}
