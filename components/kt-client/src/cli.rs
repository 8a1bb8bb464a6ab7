use std::io::IsTerminal;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use clap::{Parser, Subcommand, ValueEnum};
use kt_client::broadcast::BroadcastOptions;
use kt_client::{Client, ClientConfig, ClientError, GetOptions, Progress};
use kt_types::api::{BroadcastPlace, ListEntry, PutOptions, TransferStats, TransferSummary};
use kt_types::size::human as human_bytes;
use kt_types::{ErrorCode, Key, KeyPrefix, Lifespan, Locale};

/// kt: an in-cluster data store. Move files and trees under hierarchical keys.
#[derive(Debug, Parser)]
#[command(name = "kt", version)]
struct Cli {
    /// URL of the metadata server.
    #[arg(
        long,
        global = true,
        env = kt_types::env::METADATA_URL,
        default_value = "http://127.0.0.1:8081"
    )]
    metadata_url: String,
    /// Bearer token (prefer --token-file).
    #[arg(long, global = true, env = kt_types::env::TOKEN, hide_env_values = true)]
    token: Option<String>,
    /// File holding the bearer token.
    #[arg(long, global = true, env = kt_types::env::TOKEN_FILE)]
    token_file: Option<PathBuf>,
    /// Parallel streams per transfer.
    #[arg(long, global = true, env = kt_types::env::STREAMS, default_value_t = 4)]
    streams: usize,
    /// How long a call may go on failing to reach the metadata server
    /// before it first answers (refused, no route, DNS, no answer), e.g. 4s:
    /// a stopped server fails a call within about twice this.
    #[arg(long, global = true, env = kt_types::env::CONNECT_TIMEOUT, default_value = "4s", value_parser = humantime::parse_duration)]
    connect_timeout: Duration,
    /// How long a transfer keeps trying while its sources fail transiently
    /// (a store restarting, a peer unreachable), counted from its last
    /// progress, e.g. 5m. A transfer that moves is never cut by it.
    #[arg(long, global = true, env = kt_types::env::DEADLINE, default_value = "5m", value_parser = humantime::parse_duration)]
    deadline: Duration,
    /// How long a data request may receive nothing before its source
    /// counts as stalled (frozen, or its link cut) and another is tried.
    #[arg(long, global = true, env = kt_types::env::STALL_TIMEOUT, default_value = "20s", value_parser = humantime::parse_duration)]
    stall_timeout: Duration,
    /// Progress bars: auto (on a terminal), always or never.
    #[arg(long, global = true, env = kt_types::env::PROGRESS, default_value = "auto")]
    progress: ProgressMode,
    /// Say more: the operation's trace id (on stderr first), which the
    /// servers' log lines and error answers for it carry too.
    #[arg(short, long, global = true)]
    verbose: bool,
    #[command(flatten)]
    kube: KubeArgs,
    #[command(subcommand)]
    cmd: Cmd,
}

/// `kt get PREFIX/ --shard RANK/WORLD`: one training rank's share of the
/// files below a prefix (balanced by bytes; every rank computes the same
/// split).
#[derive(Debug, clap::Args)]
struct ShardArgs {
    /// Fetch only rank RANK of WORLD's share of the files below PREFIX/
    /// (e.g. 2/8), into DEST/<path below the prefix>.
    #[arg(long, value_name = "RANK/WORLD")]
    shard: Option<kt_types::shard::Shard>,
    /// The epoch whose order --shuffle uses.
    #[arg(long, requires = "shard", default_value_t = 0)]
    epoch: u64,
    /// Read the share in a per-(epoch, rank) shuffled order (the order
    /// `-o json` lists the files in).
    #[arg(long, requires = "shard")]
    shuffle: bool,
}

/// Reaching kt from outside the cluster.
#[derive(Debug, clap::Args)]
struct KubeArgs {
    /// Reach kt from outside the cluster through the Kubernetes API's
    /// port-forward (token from Secret kt-token unless KT_TOKEN or
    /// --token-file is given; --metadata-url is not used).
    #[arg(long = "kube", global = true, env = kt_types::env::KUBE, value_parser = clap::builder::BoolishValueParser::new())]
    enabled: bool,
    /// Kubeconfig file (default: $KUBECONFIG, then ~/.kube/config).
    #[arg(long, global = true)]
    kubeconfig: Option<PathBuf>,
    /// Kubeconfig context (default: the current one).
    #[arg(long, global = true, env = kt_types::env::KUBE_CONTEXT)]
    context: Option<String>,
    /// Namespace kt is installed in (default: the context's).
    #[arg(long, global = true, env = kt_types::env::NAMESPACE)]
    namespace: Option<String>,
}

#[derive(Debug, Clone, Copy, ValueEnum)]
enum ProgressMode {
    Auto,
    Always,
    Never,
}

#[derive(Debug, Clone, Copy, ValueEnum)]
enum Output {
    Table,
    Wide,
    Json,
    Yaml,
}

/// How put and get report what they did.
#[derive(Debug, Clone, Copy, ValueEnum)]
pub(crate) enum SummaryFormat {
    /// One human-readable line.
    Text,
    /// One JSON object (`kt_types::api::TransferSummary`).
    Json,
}

#[derive(Debug, Subcommand)]
enum Cmd {
    /// Store a file or directory tree under KEY.
    Put {
        key: String,
        /// The file or directory to store.
        #[arg(long)]
        src: PathBuf,
        /// store (copied into the store) or local (stays on this pod, served by
        /// its node agent, which is started if none runs).
        #[arg(long, default_value = "store")]
        locale: Locale,
        /// cluster (kept until deleted) or resource (deleted with its service,
        /// or stale once its holder pod ends). Absent: resource under a
        /// service's base path and for locale=local, else cluster.
        #[arg(long)]
        lifespan: Option<Lifespan>,
        /// Time to live, e.g. 30m or 2h.
        #[arg(long, value_parser = humantime::parse_duration)]
        ttl: Option<Duration>,
        /// Owning service (default: the one service your token writes, if it
        /// writes exactly one, as a pod's does in a cluster; else the key's
        /// first segment).
        #[arg(long)]
        service: Option<String>,
        #[arg(short, long, default_value = "text")]
        output: SummaryFormat,
    },
    /// Fetch KEY into a local path. A KEY ending in `/` fetches every key
    /// below it, each into DEST/<its path below KEY>.
    Get {
        key: String,
        /// Destination: a directory for tree keys; a file path or a directory
        /// for file keys (default: ./<KEY's last segment>; for a KEY ending
        /// in `/`, the current directory).
        #[arg(long)]
        dest: Option<PathBuf>,
        /// Mirror: afterwards DEST holds exactly the key's tree (files the
        /// key does not name are removed). Default: additive.
        #[arg(long)]
        delete: bool,
        /// Do not have this pod's agent serve the copy to other getters.
        #[arg(long)]
        no_serve: bool,
        /// Join a broadcast: getters form a tree, each fetching from its
        /// parent while that parent is still downloading.
        #[arg(long)]
        broadcast: bool,
        /// Broadcast group id, unique per run (default: the key's open group).
        #[arg(long, requires = "broadcast")]
        group: Option<String>,
        /// Children per node of the broadcast tree (set by the group's first getter).
        #[arg(long, requires = "broadcast")]
        fanout: Option<u32>,
        /// How long the broadcast group accepts joins, e.g. 60s (set by its first getter).
        #[arg(long, requires = "broadcast", value_parser = humantime::parse_duration)]
        timeout: Option<Duration>,
        #[command(flatten)]
        shard: ShardArgs,
        #[arg(short, long, default_value = "text")]
        output: SummaryFormat,
    },
    /// List keys below PREFIX.
    Ls {
        prefix: Option<String>,
        #[arg(short, long, default_value = "table")]
        output: Output,
    },
    /// Tear down SERVICE: delete its `resource` keys and stop using its pods
    /// as sources.
    Teardown { service: String },
    /// What the cluster holds and does: servers, agents, keys and bytes by
    /// service, transfers in flight and the store's rates (admin).
    Status {
        #[arg(short, long, default_value = "text")]
        output: SummaryFormat,
        /// How long the store's byte counters are watched for its rates.
        #[arg(long, default_value = "1s", value_parser = humantime::parse_duration)]
        interval: Duration,
    },
    /// Delete KEY (with -r, everything below it too).
    Rm {
        key: String,
        #[arg(short, long)]
        recursive: bool,
    },
    /// GPU data: tensors and state dicts, moved by this pod's node agent.
    Tensor {
        #[command(subcommand)]
        cmd: crate::tensor_cli::TensorCmd,
    },
    /// Datasets placed on nodes before jobs start (the Dataset resource,
    /// through the Kubernetes API: --kubeconfig, --context, --namespace).
    #[cfg(feature = "kube")]
    Dataset {
        #[command(subcommand)]
        cmd: crate::dataset_cli::DatasetCmd,
    },
}

impl Cmd {
    /// The operation's name, as its trace's span names it.
    fn name(&self) -> &'static str {
        match self {
            Cmd::Put { .. } => "put",
            Cmd::Get { .. } => "get",
            Cmd::Ls { .. } => "ls",
            Cmd::Teardown { .. } => "teardown",
            Cmd::Status { .. } => "status",
            Cmd::Rm { .. } => "rm",
            Cmd::Tensor { .. } => "tensor",
            #[cfg(feature = "kube")]
            Cmd::Dataset { .. } => "dataset",
        }
    }
}

fn progress(mode: ProgressMode) -> Progress {
    Progress::terminal_bar(match mode {
        ProgressMode::Always => true,
        ProgressMode::Never => false,
        ProgressMode::Auto => std::io::stderr().is_terminal(),
    })
}

fn summary(verb: &str, key: &Key, files: u64, s: &TransferStats, d: Duration) -> String {
    format!(
        "{verb} {key}: {} of {files} files sent ({}), {} skipped as unchanged, in {:.2}s",
        s.files_sent,
        human_bytes(s.bytes_sent),
        human_bytes(s.bytes_skipped),
        d.as_secs_f64()
    )
}

fn when(ms: u64) -> String {
    humantime::format_rfc3339_seconds(std::time::UNIX_EPOCH + Duration::from_millis(ms)).to_string()
}

/// Where `kt get KEY` puts what it fetches without `--dest`: a prefix
/// (`team/run/`) into the current directory, a key into `./<its last
/// segment>`, as the reference's `kt.get(key, dest=".")`.
fn default_dest(key: &str) -> PathBuf {
    if is_prefix(key) {
        return PathBuf::from(".");
    }
    let last = key.trim_end_matches('/').rsplit('/').next().unwrap_or(key);
    PathBuf::from(".").join(last)
}

fn print_table(entries: &[ListEntry], wide: bool) {
    let mut head = vec![
        "NAME", "TYPE", "LOCALE", "SIZE", "LIFESPAN", "EXPIRES", "UPDATED",
    ];
    if wide {
        head.extend(["FILES", "PEERS", "SOURCE"]);
    }
    let mut rows = vec![head.into_iter().map(String::from).collect::<Vec<_>>()];
    for e in entries {
        if let Some(r) = &e.record {
            let mut row = vec![
                e.name.clone(),
                match (&r.tensors, r.is_dir) {
                    (Some(_), _) => "tensors",
                    (None, true) => "dir",
                    (None, false) => "file",
                }
                .into(),
                r.locale_label(),
                human_bytes(r.size),
                format!("{:?}", r.lifespan).to_lowercase(),
                r.expires_at_ms.map(when).unwrap_or_else(|| "-".into()),
                when(r.updated_at_ms),
            ];
            if wide {
                row.push(r.files.to_string());
                row.push(r.peers.len().to_string());
                row.push(r.source.clone());
            }
            rows.push(row);
        }
        if e.has_children {
            let mut row = vec![format!("{}/", e.name), "prefix".into()];
            row.resize(rows[0].len(), "-".into());
            rows.push(row);
        }
    }
    let widths: Vec<usize> = (0..rows[0].len())
        .map(|c| rows.iter().map(|r| r[c].chars().count()).max().unwrap_or(0))
        .collect();
    for r in rows {
        let line: Vec<String> = r
            .iter()
            .enumerate()
            .map(|(i, v)| format!("{v:<w$}", w = widths[i]))
            .collect();
        println!("{}", line.join("  ").trim_end());
    }
}

/// The token given (file first, then KT_TOKEN), if any.
fn given_token(cli: &Cli) -> anyhow::Result<Option<String>> {
    Ok(match (&cli.token_file, &cli.token) {
        (Some(f), _) => Some(
            std::fs::read_to_string(f)
                .with_context(|| format!("reading token file {}", f.display()))?
                .trim()
                .to_owned(),
        ),
        (None, Some(t)) => Some(t.clone()),
        (None, None) => None,
    })
}

/// What `--kube` cannot do from outside the cluster.
fn check_external(cmd: &Cmd) -> anyhow::Result<()> {
    match cmd {
        Cmd::Put {
            locale: Locale::Local,
            ..
        } => anyhow::bail!(
            "--kube: a --locale local put is served by the pod's node agent; run it in a pod"
        ),
        Cmd::Get {
            broadcast: true, ..
        } => anyhow::bail!(
            "--kube: a broadcast getter serves its children from its pod; run it in a pod"
        ),
        Cmd::Tensor { .. } => anyhow::bail!(
            "--kube: tensors are moved by a pod's node agent from its memory; run kt tensor in a pod"
        ),
        _ => Ok(()),
    }
}

#[cfg(feature = "kube")]
async fn run(cli: Cli) -> anyhow::Result<()> {
    let opts = kt_kube::portforward::KubeOptions {
        kubeconfig: cli.kube.kubeconfig.clone(),
        context: cli.kube.context.clone(),
        namespace: cli.kube.namespace.clone(),
    };
    // Datasets are resources of the API server: no kt server, no kt token.
    if let Cmd::Dataset { cmd } = cli.cmd {
        return crate::dataset_cli::run(cmd, &opts).await;
    }
    if !cli.kube.enabled {
        return run_with(cli, None).await;
    }
    check_external(&cli.cmd)?;
    let token = given_token(&cli)?;
    let external = crate::external::External::connect(&opts, token.is_none()).await?;
    let reach = Reach {
        metadata_url: external.metadata_url.clone(),
        token: token.or_else(|| external.token.clone()),
        url_map: Some(external.url_map()),
    };
    let result = run_with(cli, Some(reach)).await;
    external.close().await;
    result
}

#[cfg(not(feature = "kube"))]
async fn run(cli: Cli) -> anyhow::Result<()> {
    if cli.kube.enabled {
        check_external(&cli.cmd)?;
        anyhow::bail!("--kube: this kt was built without the `kube` feature");
    }
    run_with(cli, None).await
}

/// How `kt --kube` reaches kt instead of `--metadata-url`.
struct Reach {
    metadata_url: String,
    token: Option<String>,
    url_map: Option<Arc<dyn kt_client::UrlMap>>,
}

fn client(
    cfg: ClientConfig,
    url_map: &Option<Arc<dyn kt_client::UrlMap>>,
) -> anyhow::Result<Client> {
    let c = Client::new(cfg)?;
    Ok(match url_map {
        Some(m) => c.with_url_map(m.clone()),
        None => c,
    })
}

async fn run_with(cli: Cli, reach: Option<Reach>) -> anyhow::Result<()> {
    let (metadata_url, token, url_map) = match reach {
        Some(r) => (r.metadata_url, r.token, r.url_map),
        None => (cli.metadata_url.clone(), given_token(&cli)?, None),
    };
    let token = token.context("no token: set KT_TOKEN or pass --token-file")?;
    if let Cmd::Tensor { cmd } = cli.cmd {
        return crate::tensor_cli::run(cmd, &metadata_url, &token).await;
    }
    let mut cfg = ClientConfig::new(&metadata_url, token);
    cfg.token_file = cli.token_file.clone().filter(|_| url_map.is_none());
    cfg.streams = cli.streams.max(1);
    cfg.connect_timeout = cli.connect_timeout.max(Duration::from_millis(100));
    cfg.deadline = cli.deadline;
    cfg.stall = cli.stall_timeout.max(Duration::from_millis(100));
    // Outside the cluster there is no agent to serve copies to other pods.
    cfg.serve_copies = url_map.is_none();
    let mut client = client(cfg, &url_map)?;
    if let Some(trace) = kt_api::trace::current() {
        // Calls made from spawned tasks carry it too.
        client = client.traced(trace);
    }
    match cli.cmd {
        Cmd::Put {
            key,
            src,
            locale,
            lifespan,
            ttl,
            service,
            output,
        } => {
            let key = Key::parse(&key)?;
            let opts = PutOptions {
                lifespan,
                ttl_secs: ttl.map(|d| d.as_secs().max(1)),
                service,
            };
            let s = match locale {
                Locale::Store => client.put(&key, &src, opts, progress(cli.progress)).await?,
                Locale::Local => client.put_local(&key, &src, opts).await?,
            };
            match output {
                SummaryFormat::Text => {
                    let verb = if s.unchanged {
                        "put (unchanged)"
                    } else {
                        "put"
                    };
                    println!("{}", summary(verb, &key, s.files, &s.stats, s.duration));
                }
                SummaryFormat::Json => println!(
                    "{}",
                    serde_json::to_string(&TransferSummary {
                        op: "put".into(),
                        key: key.to_string(),
                        files: s.files,
                        stats: s.stats,
                        unchanged: s.unchanged,
                        seconds: s.duration.as_secs_f64(),
                        dest: None,
                        broadcast: None,
                    })?
                ),
            }
        }
        Cmd::Get {
            key,
            dest,
            delete,
            no_serve,
            broadcast,
            group,
            fanout,
            timeout,
            shard,
            output,
        } => {
            let dest = dest.unwrap_or_else(|| default_dest(&key));
            if let Some(rank) = shard.shard {
                if !is_prefix(&key) || broadcast || delete {
                    anyhow::bail!(
                        "--shard reads a share of the files below a prefix (KEY ending in /), without --broadcast or --delete"
                    );
                }
                let prefix = KeyPrefix::parse(&key)?;
                let spec = kt_types::shard::ShareSpec {
                    shard: rank,
                    epoch: shard.epoch,
                    shuffle: shard.shuffle,
                };
                let got = client.get_share(&prefix, &spec, &dest).await?;
                print_share(&got, &spec, &dest, output)?;
                return Ok(());
            }
            let client = if no_serve {
                let mut cfg = client.config().clone();
                cfg.serve_copies = false;
                self::client(cfg, &url_map)?
            } else {
                client
            };
            if is_prefix(&key) {
                if broadcast {
                    anyhow::bail!("--broadcast gets one key, not every key below {key}");
                }
                let prefix = KeyPrefix::parse(&key)?;
                let got = client
                    .get_prefix(&prefix, &dest, &GetOptions { delete })
                    .await?;
                print_prefix(&got, output)?;
                return Ok(());
            }
            let key = Key::parse(&key)?;
            let (s, place) = if broadcast {
                let options = BroadcastOptions {
                    group,
                    fanout,
                    window: timeout,
                    delete,
                };
                let b = client
                    .get_broadcast(&key, &dest, &options, progress(cli.progress))
                    .await?;
                let place = BroadcastPlace {
                    group: b.group,
                    rank: b.rank,
                    parents: b.parents,
                    relayed: b.relayed,
                    timings: Some(b.timings),
                };
                (b.get, Some(place))
            } else {
                (
                    client
                        .get_with(&key, &dest, &GetOptions { delete }, progress(cli.progress))
                        .await?,
                    None,
                )
            };
            match output {
                SummaryFormat::Text => {
                    let tree = place.map_or(String::new(), |p| {
                        format!(
                            " (broadcast {} rank {} from {}, relayed {})",
                            p.group,
                            p.rank,
                            p.parents
                                .iter()
                                .map(|r| r.to_string())
                                .collect::<Vec<_>>()
                                .join(" then "),
                            human_bytes(p.relayed)
                        )
                    });
                    println!(
                        "{} -> {}{tree}",
                        summary("get", &key, s.files, &s.stats, s.duration),
                        s.dest.display()
                    )
                }
                SummaryFormat::Json => println!(
                    "{}",
                    serde_json::to_string(&TransferSummary {
                        broadcast: place,
                        ..got_summary(&key, &s)
                    })?
                ),
            }
        }
        Cmd::Ls { prefix, output } => {
            let prefix = KeyPrefix::parse(prefix.as_deref().unwrap_or(""))?;
            let list = client.ls(&prefix).await?;
            match output {
                Output::Table => print_table(&list.entries, false),
                Output::Wide => print_table(&list.entries, true),
                Output::Json => println!("{}", serde_json::to_string_pretty(&list.entries)?),
                Output::Yaml => print!("{}", serde_yaml_ng::to_string(&list.entries)?),
            }
        }
        Cmd::Teardown { service } => {
            let r = client.teardown(&service).await?;
            for k in &r.deleted {
                println!("deleted {k}");
            }
            for a in &r.evicted {
                println!("evicted {a}");
            }
            if r.deleted.is_empty() && r.evicted.is_empty() {
                println!("nothing to tear down for service {service}");
            }
        }
        Cmd::Status { output, interval } => {
            let r = client.status(interval).await?;
            match output {
                SummaryFormat::Text => print!("{}", kt_client::status::render(&r)),
                SummaryFormat::Json => println!("{}", serde_json::to_string_pretty(&r)?),
            }
        }
        Cmd::Rm { key, recursive } => {
            let key = Key::parse(&key)?;
            let r = client.rm(&key, recursive).await?;
            for k in r.deleted {
                println!("deleted {k}");
            }
        }
        Cmd::Tensor { .. } => unreachable!("handled before the client is built"),
        #[cfg(feature = "kube")]
        Cmd::Dataset { .. } => unreachable!("handled before kt is reached"),
    }
    Ok(())
}

/// A key that ends in `/` names every key below it (a prefix get).
fn is_prefix(key: &str) -> bool {
    let k = key.trim();
    k.ends_with('/') && !k.trim_matches('/').is_empty()
}

/// What a prefix get did: a line per key and a total (text), or one
/// summary per key (JSON, an array).
fn print_prefix(got: &kt_client::PrefixSummary, output: SummaryFormat) -> anyhow::Result<()> {
    match output {
        SummaryFormat::Text => {
            let bytes = print_key_gets(&got.gets, &got.skipped);
            println!("got {} keys ({} moved)", got.gets.len(), human_bytes(bytes));
        }
        SummaryFormat::Json => {
            let all: Vec<TransferSummary> = got
                .gets
                .iter()
                .map(|(key, s)| got_summary(key, s))
                .collect();
            println!("{}", serde_json::to_string(&all)?);
        }
    }
    Ok(())
}

/// A line per key fetched and per key skipped; the bytes moved.
fn print_key_gets(
    gets: &[(kt_types::Key, kt_client::GetSummary)],
    skipped: &[(kt_types::Key, String)],
) -> u64 {
    for (key, s) in gets {
        println!(
            "{} -> {}",
            summary("get", key, s.files, &s.stats, s.duration),
            s.dest.display()
        );
    }
    for (key, why) in skipped {
        println!("skipped {key}: {why}");
    }
    gets.iter().map(|(_, s)| s.stats.bytes_sent).sum()
}

fn print_share(
    got: &kt_client::stream::ShareSummary,
    spec: &kt_types::shard::ShareSpec,
    dest: &std::path::Path,
    output: SummaryFormat,
) -> anyhow::Result<()> {
    match output {
        SummaryFormat::Text => {
            let moved = print_key_gets(&got.gets, &got.skipped);
            println!(
                "shard {}: {} files, {} ({} moved)",
                spec.shard,
                got.files.len(),
                human_bytes(got.bytes()),
                human_bytes(moved)
            );
        }
        SummaryFormat::Json => {
            let files: Vec<serde_json::Value> = got
                .files
                .iter()
                .map(|f| {
                    serde_json::json!({
                        "path": f.path,
                        "key": f.key.to_string(),
                        "size": f.size,
                        "local": dest.join(&f.path).display().to_string(),
                    })
                })
                .collect();
            let gets: Vec<TransferSummary> = got
                .gets
                .iter()
                .map(|(key, s)| got_summary(key, s))
                .collect();
            let doc = serde_json::json!({
                "rank": spec.shard.rank,
                "world": spec.shard.world,
                "epoch": spec.epoch,
                "shuffle": spec.shuffle,
                "bytes": got.bytes(),
                "files": files,
                "gets": gets,
            });
            println!("{}", serde_json::to_string(&doc)?);
        }
    }
    Ok(())
}

/// The `-o json` summary of one get.
fn got_summary(key: &Key, s: &kt_client::GetSummary) -> TransferSummary {
    TransferSummary {
        op: "get".into(),
        key: key.to_string(),
        files: s.files,
        stats: s.stats,
        unchanged: false,
        seconds: s.duration.as_secs_f64(),
        dest: Some(s.dest.display().to_string()),
        broadcast: None,
    }
}

/// Exit codes: 0 ok, 1 failure, 2 bad input, 3 not found, 4 unauthorized, 5 unavailable.
fn exit_code(e: &anyhow::Error) -> u8 {
    if e.downcast_ref::<kt_types::KeyError>().is_some() {
        return 2;
    }
    match e.downcast_ref::<ClientError>().and_then(ClientError::code) {
        Some(
            ErrorCode::InvalidKey
            | ErrorCode::InvalidRequest
            | ErrorCode::InvalidManifest
            | ErrorCode::Conflict,
        ) => 2,
        Some(ErrorCode::NotFound) => 3,
        Some(ErrorCode::Unauthorized | ErrorCode::Forbidden) => 4,
        Some(
            ErrorCode::NoStore
            | ErrorCode::NoSource
            | ErrorCode::Unavailable
            | ErrorCode::InsufficientStorage,
        ) => 5,
        _ => 1,
    }
}

pub fn main() -> ExitCode {
    let cli = Cli::parse();
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env(kt_types::env::LOG)
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        )
        .with_ansi(kt_service::telemetry::stderr_color())
        .with_writer(std::io::stderr)
        .init();
    let rt = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("kt: error: starting runtime: {e}");
            return ExitCode::from(1);
        }
    };
    // One trace per invocation: every call of the operation carries it.
    let trace = kt_api::trace::TraceParent::new();
    if cli.verbose {
        eprintln!("kt: trace id {}", trace.trace_id());
    }
    let op = cli.cmd.name();
    match rt.block_on(kt_client::trace::operation(op, trace, run(cli))) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            // Each cause once: skip causes the message already spells out.
            let mut msg = String::new();
            for cause in e.chain().map(|c| c.to_string()) {
                if !msg.contains(&cause) {
                    if !msg.is_empty() {
                        msg.push_str(": ");
                    }
                    msg.push_str(&cause);
                }
            }
            let msg = msg.replace('\n', " ");
            let ca = std::env::var_os(kt_api::tls::CA_FILE);
            eprintln!("kt: error: {msg}{}", tls_hint(&msg, ca.as_deref()));
            ExitCode::from(exit_code(&e))
        }
    }
}

/// What to do about a server certificate kt does not trust: kt trusts the
/// CAs of `KT_CA_FILE` (`ca`) alone, not the system's.
fn tls_hint(msg: &str, ca: Option<&std::ffi::OsStr>) -> String {
    let untrusted = [
        "UnknownIssuer",
        "invalid peer certificate",
        "certificate verify",
    ]
    .iter()
    .any(|s| msg.contains(s));
    if !untrusted {
        return String::new();
    }
    match ca {
        Some(f) => format!(
            " (hint: the server's certificate is not signed by a CA of {}={})",
            kt_api::tls::CA_FILE,
            f.to_string_lossy()
        ),
        None => format!(
            " (hint: set {} to the PEM file of the CA that signed the server's certificate; kt trusts no other)",
            kt_api::tls::CA_FILE
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::Path;

    #[test]
    fn boolean_env_flags_take_1_0_yes_no_on_off() {
        kt_service::cli::assert_boolish_env_flags::<Cli>();
    }

    #[test]
    fn get_without_dest_writes_to_the_keys_last_segment() {
        let d = |k: &str| default_dest(k);
        assert_eq!(
            d("/my_train_svc/train_profile"),
            Path::new("./train_profile")
        );
        assert_eq!(d("a"), Path::new("./a"));
        assert_eq!(d("/data_proc_svc/train/"), Path::new("."));
        // Parsed as the CLI gets it: no --dest needed.
        let cli = Cli::try_parse_from(["kt", "get", "/my_train_svc/train_profile"]).unwrap();
        assert!(matches!(cli.cmd, Cmd::Get { dest: None, .. }));
    }

    #[test]
    fn shard_flags_parse_as_one_group_and_refuse_bad_shards() {
        let cli = Cli::try_parse_from([
            "kt",
            "get",
            "svc/train/",
            "--shard",
            "2/8",
            "--epoch",
            "3",
            "--shuffle",
        ])
        .unwrap();
        let Cmd::Get { shard, .. } = cli.cmd else {
            panic!("not a get")
        };
        assert_eq!(
            shard.shard,
            Some(kt_types::shard::Shard { rank: 2, world: 8 })
        );
        assert_eq!((shard.epoch, shard.shuffle), (3, true));
        let e = Cli::try_parse_from(["kt", "get", "svc/train/", "--shard", "8/8"]).unwrap_err();
        assert!(e.to_string().contains("not below the world size"), "{e}");
        // --epoch and --shuffle only with --shard.
        assert!(Cli::try_parse_from(["kt", "get", "svc/train/", "--shuffle"]).is_err());
    }

    #[test]
    fn an_untrusted_certificate_names_kt_ca_file() {
        let e = "https://127.0.0.1:1/api/v1/keys/a: error sending request: invalid peer certificate: UnknownIssuer";
        let h = tls_hint(e, None);
        assert!(h.contains("set KT_CA_FILE"), "{h}");
        let h = tls_hint(e, Some(std::ffi::OsStr::new("/etc/kt/ca.crt")));
        assert!(
            h.contains("not signed by a CA of KT_CA_FILE=/etc/kt/ca.crt"),
            "{h}"
        );
        assert_eq!(tls_hint("connection refused", None), "");
    }
}
