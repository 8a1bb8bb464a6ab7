//! `kt dataset apply|get|ls|rm`: `Dataset` resources through the
//! Kubernetes API server (a kubeconfig, or the pod's ServiceAccount), with
//! [`kt_client::datasets`]. They need no kt token: the API server's RBAC
//! decides who may declare datasets.

use std::io::Read;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context;
use clap::Subcommand;
use kt_client::datasets::{self, Datasets, SpecArgs};
use kt_kube::dataset::Phase;

// Parsed once per run: the size of the largest variant costs nothing.
#[allow(clippy::large_enum_variant)]
#[derive(Debug, Subcommand)]
pub enum DatasetCmd {
    /// Create or update datasets: from manifests (-f FILE, - for stdin), or
    /// one named NAME from flags.
    Apply {
        /// The dataset's name (with flags; not with -f).
        name: Option<String>,
        /// Manifests of kind Dataset (kt.dev/v1alpha1), `---`-separated.
        #[arg(short = 'f', long, conflicts_with = "name")]
        filename: Option<PathBuf>,
        #[command(flatten)]
        spec: SpecArgs,
        #[command(flatten)]
        wait: WaitArgs,
    },
    /// Show a dataset: its phase, version and nodes.
    Get {
        name: String,
        #[arg(short, long, default_value = "text")]
        output: Format,
        #[command(flatten)]
        wait: WaitArgs,
    },
    /// List the namespace's datasets.
    Ls {
        #[arg(short, long, default_value = "text")]
        output: Format,
    },
    /// Delete a dataset: its node copies and labels are removed.
    Rm {
        name: String,
        /// Wait until the controller has removed them.
        #[arg(long)]
        wait: bool,
        /// How long --wait waits.
        #[arg(long, default_value = "5m", value_parser = humantime::parse_duration)]
        timeout: Duration,
    },
}

#[derive(Debug, Clone, Copy, clap::ValueEnum)]
pub enum Format {
    Text,
    Json,
    Yaml,
}

#[derive(Debug, clap::Args)]
pub struct WaitArgs {
    /// Wait until the dataset reaches this phase (e.g. Ready); a dataset
    /// that ends Failed exits non-zero with its reason.
    #[arg(long, value_parser = parse_phase)]
    wait: Option<Phase>,
    /// How long --wait waits.
    #[arg(long, default_value = "10m", value_parser = humantime::parse_duration)]
    timeout: Duration,
}

fn parse_phase(s: &str) -> Result<Phase, String> {
    serde_json::from_value(serde_json::Value::String(s.to_owned()))
        .map_err(|_| format!("{s:?} is not a phase (Pending, Ingesting, Seeding, Ready, Failed)"))
}

pub async fn run(cmd: DatasetCmd, opts: &kt_kube::portforward::KubeOptions) -> anyhow::Result<()> {
    let api = Datasets::connect(opts).await?;
    match cmd {
        DatasetCmd::Apply {
            name,
            filename,
            spec,
            wait,
        } => {
            let manifests = match (filename, name) {
                (Some(file), _) => {
                    anyhow::ensure!(
                        !spec.any(),
                        "-f takes the whole dataset from the manifest: drop the source and placement flags"
                    );
                    let text = if file.as_os_str() == "-" {
                        let mut s = String::new();
                        std::io::stdin().read_to_string(&mut s)?;
                        s
                    } else {
                        std::fs::read_to_string(&file)
                            .with_context(|| format!("{}", file.display()))?
                    };
                    datasets::parse_manifests(&text)?
                }
                (None, Some(name)) => vec![datasets::dataset(&name, spec.spec()?)],
                (None, None) => anyhow::bail!("name a dataset, or give its manifests with -f"),
            };
            for ds in &manifests {
                let applied = api.apply(ds).await?;
                println!(
                    "dataset {} applied (generation {})",
                    applied.metadata.name.as_deref().unwrap_or("?"),
                    applied.metadata.generation.unwrap_or(0)
                );
            }
            if let Some(phase) = wait.wait {
                for ds in &manifests {
                    let name = ds.metadata.name.as_deref().unwrap_or_default();
                    let done = api.wait(name, phase, wait.timeout).await?;
                    print_one(&done, Format::Text)?;
                }
            }
        }
        DatasetCmd::Get { name, output, wait } => {
            let ds = match wait.wait {
                Some(phase) => api.wait(&name, phase, wait.timeout).await?,
                None => api.get(&name).await?,
            };
            print_one(&ds, output)?;
        }
        DatasetCmd::Ls { output } => {
            let all = api.list().await?;
            match output {
                Format::Json => println!("{}", serde_json::to_string_pretty(&all)?),
                Format::Yaml => print!("{}", serde_yaml_ng::to_string(&all)?),
                Format::Text => {
                    let rows = datasets::rows(&all);
                    println!(
                        "{:<24} {:<10} {:<14} {:>7} {:>10}  REASON",
                        "NAME", "PHASE", "VERSION", "READY", "BYTES"
                    );
                    for r in rows {
                        println!(
                            "{:<24} {:<10} {:<14} {:>7} {:>10}  {}",
                            r.name,
                            r.phase,
                            r.version,
                            r.ready,
                            r.bytes.map_or("-".into(), kt_types::size::human),
                            r.reason
                        );
                    }
                }
            }
        }
        DatasetCmd::Rm {
            name,
            wait,
            timeout,
        } => {
            if !api.delete(&name).await? {
                anyhow::bail!(
                    "dataset {name:?} not found in namespace {:?}",
                    api.namespace()
                );
            }
            if wait {
                datasets::wait_deleted(&api, &name, timeout).await?;
                println!("dataset {name} deleted");
            } else {
                println!("dataset {name} deleting (its node copies are being removed)");
            }
        }
    }
    Ok(())
}

fn print_one(ds: &kt_kube::dataset::Dataset, output: Format) -> anyhow::Result<()> {
    match output {
        Format::Json => println!("{}", serde_json::to_string_pretty(ds)?),
        Format::Yaml => print!("{}", serde_yaml_ng::to_string(ds)?),
        Format::Text => {
            let st = ds.status.clone().unwrap_or_default();
            println!(
                "{}: {:?}{} — {}/{} nodes, version {}, {}",
                ds.metadata.name.as_deref().unwrap_or("?"),
                st.phase,
                st.reason.map(|r| format!(" ({r})")).unwrap_or_default(),
                st.ready_nodes,
                ds.spec.placement.replicas(),
                st.version.as_deref().unwrap_or("-"),
                st.bytes.map_or("-".into(), kt_types::size::human),
            );
            for n in &st.nodes {
                println!(
                    "  {:<20} {:<9} {} {}",
                    n.name,
                    format!("{:?}", n.state),
                    n.version.as_deref().unwrap_or("-"),
                    n.message.as_deref().unwrap_or("")
                );
            }
            for c in &st.conditions {
                if c.status != "True" {
                    println!("  {} {}: {} {}", c.type_, c.status, c.reason, c.message);
                }
            }
        }
    }
    Ok(())
}
