//! Arrow Flight `DoGet` of a node agent (kt-agent's `flight` feature)
//! against real servers: a rank's share of Parquet, Arrow IPC file and
//! Arrow IPC stream files, read with the caller's token; tickets, tokens
//! and schemas checked with gRPC codes a Flight client understands.

use std::sync::Arc;
use std::time::Duration;

use arrow_array::{Int32Array, Int64Array, RecordBatch};
use arrow_flight::Ticket;
use arrow_flight::decode::FlightRecordBatchStream;
use arrow_flight::error::FlightError;
use arrow_flight::flight_service_client::FlightServiceClient;
use arrow_schema::{DataType, Field, Schema};
use futures::TryStreamExt;
use kt_service::Token;
use kt_tests::{Cluster, TOKEN};
use kt_types::auth::{AuthFile, Grant, Role};
use kt_types::shard::{Shard, ShareSpec, ShareTicket, share};
use kt_types::{Key, KeyPrefix};
use tokio_util::sync::CancellationToken;
use tonic::Code;

/// A workload of service `other` that reads nothing else.
const OTHER: &str = "workload-other-0123456";

/// A share's rows as (file number, x), or the status that ended it.
type Rows = Result<Vec<(i32, i64)>, tonic::Status>;

/// An agent of `cluster` serving Flight; its Flight address, and what
/// stops it.
async fn flight_agent(
    cluster: &Cluster,
    budget: u64,
) -> (
    std::net::SocketAddr,
    CancellationToken,
    tokio::task::JoinHandle<()>,
) {
    let mut flight = kt_agent::config::FlightConfig::new("127.0.0.1:0".parse().unwrap());
    flight.budget = budget;
    flight_agent_with(cluster, flight).await
}

/// [`flight_agent`] with these Flight settings.
async fn flight_agent_with(
    cluster: &Cluster,
    flight: kt_agent::config::FlightConfig,
) -> (
    std::net::SocketAddr,
    CancellationToken,
    tokio::task::JoinHandle<()>,
) {
    flight_agent_tls(cluster, flight, None).await
}

/// [`flight_agent_with`], serving with this certificate (`--tls-cert`).
async fn flight_agent_tls(
    cluster: &Cluster,
    flight: kt_agent::config::FlightConfig,
    tls: Option<kt_service::tls::Tls>,
) -> (
    std::net::SocketAddr,
    CancellationToken,
    tokio::task::JoinHandle<()>,
) {
    let run = cluster.dir.path().join("flight-agent");
    let mut cfg = kt_agent::Config::new(
        "flight-agent",
        cluster.metadata_url(),
        Token::new(TOKEN).unwrap(),
        run.join("agent.sock"),
    );
    cfg.shm_dir = cluster.shm_dir();
    cfg.flight = Some(flight);
    cfg.server.tls = tls;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let stop = CancellationToken::new();
    let handle = kt_agent::start(listener, cfg, stop.clone()).expect("agent");
    let addr = handle.flight_addr.expect("a Flight address");
    let task = tokio::spawn(async move {
        handle.task.await.unwrap().unwrap();
    });
    (addr, stop, task)
}

/// File `n`'s rows: `rows` of (n, x).
fn batch(schema: &Arc<Schema>, n: i32, rows: usize, from: i64) -> RecordBatch {
    let x: Vec<i64> = (from..from + rows as i64).collect();
    RecordBatch::try_new(
        schema.clone(),
        vec![
            Arc::new(Int32Array::from(vec![n; rows])),
            Arc::new(Int64Array::from(x)),
        ],
    )
    .unwrap()
}

fn schema() -> Arc<Schema> {
    Arc::new(Schema::new(vec![
        Field::new("file", DataType::Int32, false),
        Field::new("x", DataType::Int64, false),
    ]))
}

/// Writes file `n` (`rows` rows in batches of 100) as Parquet (n % 4 of 0
/// or 1), an Arrow IPC file (2) or an Arrow IPC stream (3).
fn write(path: &std::path::Path, n: i32, rows: usize) {
    let schema = schema();
    let batches: Vec<RecordBatch> = (0..rows)
        .step_by(100)
        .map(|from| batch(&schema, n, 100.min(rows - from), from as i64))
        .collect();
    let f = std::fs::File::create(path).unwrap();
    match n % 4 {
        0 | 1 => {
            let mut w = parquet::arrow::ArrowWriter::try_new(f, schema, None).unwrap();
            for b in &batches {
                w.write(b).unwrap();
            }
            w.close().unwrap();
        }
        2 => {
            let mut w = arrow_ipc::writer::FileWriter::try_new(f, &schema).unwrap();
            for b in &batches {
                w.write(b).unwrap();
            }
            w.finish().unwrap();
        }
        _ => {
            let mut w = arrow_ipc::writer::StreamWriter::try_new(f, &schema).unwrap();
            for b in &batches {
                w.write(b).unwrap();
            }
            w.finish().unwrap();
        }
    }
}

/// DoGet of `ticket` with `token` (none: no header).
async fn do_get(addr: std::net::SocketAddr, token: Option<&str>, ticket: &[u8]) -> Rows {
    let channel = tonic::transport::Channel::from_shared(format!("http://{addr}"))
        .unwrap()
        .connect()
        .await
        .expect("connect");
    do_get_on(channel, token, ticket).await
}

/// [`do_get`] on a connected channel.
async fn do_get_on(channel: tonic::transport::Channel, token: Option<&str>, ticket: &[u8]) -> Rows {
    let mut client = FlightServiceClient::new(channel);
    let mut req = tonic::Request::new(Ticket {
        ticket: ticket.to_vec().into(),
    });
    if let Some(t) = token {
        req.metadata_mut()
            .insert("authorization", format!("Bearer {t}").parse().unwrap());
    }
    let data = client.do_get(req).await?.into_inner();
    let batches: Result<Vec<RecordBatch>, FlightError> =
        FlightRecordBatchStream::new_from_flight_data(data.map_err(FlightError::from))
            .try_collect()
            .await;
    let batches = batches.map_err(|e| match e {
        FlightError::Tonic(s) => *s,
        e => tonic::Status::internal(e.to_string()),
    })?;
    let mut rows = Vec::new();
    for b in batches {
        assert_eq!(b.schema(), schema(), "the share's schema, metadata dropped");
        let n = b.column(0).as_any().downcast_ref::<Int32Array>().unwrap();
        let x = b.column(1).as_any().downcast_ref::<Int64Array>().unwrap();
        rows.extend(
            n.iter()
                .zip(x.iter())
                .map(|(n, x)| (n.unwrap(), x.unwrap())),
        );
    }
    Ok(rows)
}

fn ticket(prefix: &str, rank: u32, world: u32, epoch: u64, shuffle: bool) -> Vec<u8> {
    let spec = ShareSpec {
        shard: Shard::new(rank, world).unwrap(),
        epoch,
        shuffle,
    };
    ShareTicket::new(&KeyPrefix::parse(prefix).unwrap(), &spec).to_bytes()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn do_get_streams_exactly_a_ranks_share_of_parquet_and_arrow_ipc_files() {
    let c = Cluster::start().await;
    // A budget above the largest file (14.2 KiB) but below two large
    // ones: the share is fetched a file or so ahead of the one being
    // decoded (a file above the budget is refused: see below).
    let (addr, stop, task) = flight_agent(&c, 16 << 10).await;
    let client = c.client_with(|cfg| cfg.serve_copies = false);
    let src = c.dir.path().join("src");
    std::fs::create_dir_all(&src).unwrap();
    // 12 files of uneven sizes, each its own key; and a `_SUCCESS` marker,
    // which is assigned like any file and then passed over.
    let mut files: Vec<(String, u64)> = Vec::new();
    let mut rows_of = std::collections::BTreeMap::new();
    for n in 0..12 {
        let name = format!("part-{n:02}.data");
        let rows = 100 + (n as usize * 173) % 900;
        write(&src.join(&name), n, rows);
        rows_of.insert(name.clone(), (n, rows));
        files.push((name, 0));
    }
    std::fs::write(src.join("_SUCCESS"), b"").unwrap();
    files.push(("_SUCCESS".into(), 0));
    for (name, size) in &mut files {
        *size = std::fs::metadata(src.join(&*name)).unwrap().len();
        let key = Key::parse(&format!("data/flight/{name}")).unwrap();
        client
            .put(
                &key,
                &src.join(&*name),
                Default::default(),
                kt_client::Progress::none(),
            )
            .await
            .unwrap();
    }
    let expect = |spec: &ShareSpec| -> Vec<(i32, i64)> {
        share(&files, spec)
            .into_iter()
            .filter_map(|i| rows_of.get(&files[i].0))
            .flat_map(|&(n, rows)| (0..rows as i64).map(move |x| (n, x)))
            .collect()
    };
    let world = 3;
    let mut union = Vec::new();
    for rank in 0..world {
        let got = do_get(
            addr,
            Some(TOKEN),
            &ticket("data/flight/", rank, world, 0, false),
        )
        .await
        .unwrap();
        let spec = ShareSpec {
            shard: Shard::new(rank, world).unwrap(),
            epoch: 0,
            shuffle: false,
        };
        assert_eq!(got, expect(&spec), "rank {rank} of {world}");
        union.extend(got);
    }
    union.sort();
    let all: usize = rows_of.values().map(|&(_, rows)| rows).sum();
    assert_eq!(
        union.len(),
        all,
        "the shares are the dataset, each row once"
    );
    union.dedup();
    assert_eq!(union.len(), all);
    // Shuffled: that epoch's order of the same files.
    let spec = ShareSpec {
        shard: Shard::new(1, world).unwrap(),
        epoch: 5,
        shuffle: true,
    };
    let got = do_get(addr, Some(TOKEN), &ticket("data/flight", 1, world, 5, true))
        .await
        .unwrap();
    assert_eq!(got, expect(&spec));
    // More ranks than files: an empty share is an empty stream.
    let got = do_get(addr, Some(TOKEN), &ticket("data/flight", 13, 14, 0, false)).await;
    assert_eq!(got.unwrap(), Vec::new());

    // A file whose columns differ ends the stream, naming both files.
    let odd = c.dir.path().join("odd.arrow");
    let other = Arc::new(Schema::new(vec![Field::new("y", DataType::Utf8, true)]));
    let mut w =
        arrow_ipc::writer::FileWriter::try_new(std::fs::File::create(&odd).unwrap(), &other)
            .unwrap();
    w.finish().unwrap();
    for (name, path) in [("a", src.join("part-00.data")), ("b", odd)] {
        let key = Key::parse(&format!("data/mixed/{name}")).unwrap();
        client
            .put(&key, &path, Default::default(), kt_client::Progress::none())
            .await
            .unwrap();
    }
    let refused = do_get(addr, Some(TOKEN), &ticket("data/mixed", 0, 1, 0, false))
        .await
        .unwrap_err();
    assert_eq!(refused.code(), Code::FailedPrecondition, "{refused:?}");
    assert!(
        refused
            .message()
            .contains("b does not have the columns of a"),
        "{refused:?}"
    );
    // Neither Parquet nor Arrow: refused by name.
    let text = c.dir.path().join("notes.txt");
    std::fs::write(&text, "not a table").unwrap();
    client
        .put(
            &Key::parse("data/text/notes.txt").unwrap(),
            &text,
            Default::default(),
            kt_client::Progress::none(),
        )
        .await
        .unwrap();
    let refused = do_get(addr, Some(TOKEN), &ticket("data/text", 0, 1, 0, false))
        .await
        .unwrap_err();
    assert_eq!(refused.code(), Code::InvalidArgument, "{refused:?}");
    assert!(
        refused
            .message()
            .contains("notes.txt is neither Parquet nor Arrow IPC")
    );
    // Every call's directory is gone, the failed ones' too.
    let scratch = c.dir.path().join("flight-agent/agent.state/flight");
    assert_eq!(std::fs::read_dir(&scratch).unwrap().count(), 0);
    stop.cancel();
    tokio::time::timeout(Duration::from_secs(30), task)
        .await
        .expect("the agent stops")
        .unwrap();
    c.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tickets_and_tokens_are_checked_with_grpc_codes() {
    let dir = tempfile::tempdir().unwrap();
    let file = AuthFile {
        tokens: vec![Grant {
            token: OTHER.into(),
            role: Role::Workload,
            name: None,
            services: Some(vec!["other".into()]),
            reads: Some(Vec::new()),
        }],
    };
    let path = dir.path().join("auth.json");
    std::fs::write(&path, serde_json::to_vec(&file).unwrap()).unwrap();
    let auth = kt_service::Auth::from_file(&path).unwrap();
    let c = Cluster::start_authed(Some(auth), |_| {}).await;
    let (addr, stop, task) = flight_agent(&c, 1 << 20).await;
    let src = c.dir.path().join("one.arrows");
    write(&src, 3, 10);
    c.client_with(|cfg| cfg.serve_copies = false)
        .put(
            &Key::parse("train/set/one.arrows").unwrap(),
            &src,
            Default::default(),
            kt_client::Progress::none(),
        )
        .await
        .unwrap();
    let good = ticket("train/set", 0, 1, 0, false);
    assert_eq!(do_get(addr, Some(TOKEN), &good).await.unwrap().len(), 10);
    let code = |r: Rows| r.unwrap_err();
    let cases: [(&[u8], &str); 6] = [
        (
            br#"{"prefix":"train/set","rank":1,"world":1}"#,
            "rank 1 is not below the world size 1",
        ),
        (
            br#"{"prefix":"train/set","rank":0}"#,
            "missing field `world`",
        ),
        (
            br#"{"prefix":"train/set","rank":0,"world":1,"rnak":2}"#,
            "unknown field `rnak`",
        ),
        (br#"{"prefix":"","rank":0,"world":1}"#, "prefix is empty"),
        (br#"{"prefix":"a//b","rank":0,"world":1}"#, "empty segment"),
        (b"\xff\xfe", "is not JSON"),
    ];
    for (bad, says) in cases {
        let s = code(do_get(addr, Some(TOKEN), bad).await);
        assert_eq!(s.code(), Code::InvalidArgument, "{s:?}");
        assert!(s.message().contains(says), "{says}: {s:?}");
    }
    let s = code(do_get(addr, None, &good).await);
    assert_eq!(s.code(), Code::Unauthenticated, "{s:?}");
    assert!(s.message().contains("authorization: Bearer"), "{s:?}");
    let s = code(do_get(addr, Some("nobody-knows-this-token"), &good).await);
    assert_eq!(s.code(), Code::Unauthenticated, "{s:?}");
    // Another service's token is shown no key below the prefix (as `kt ls`
    // and `kt get PREFIX/` are not): nothing is read, nothing is told.
    let s = code(do_get(addr, Some(OTHER), &good).await);
    assert_eq!(s.code(), Code::NotFound, "{s:?}");
    assert!(!s.message().contains("one.arrows"), "{s:?}");
    stop.cancel();
    tokio::time::timeout(Duration::from_secs(30), task)
        .await
        .expect("the agent stops")
        .unwrap();
    c.stop().await;
}

/// Puts `n` rows of file `n`'s kind as `key`.
async fn put_file(c: &Cluster, key: &str, n: i32, rows: usize) {
    let src = c.dir.path().join(format!("src-{n}"));
    write(&src, n, rows);
    c.client_with(|cfg| cfg.serve_copies = false)
        .put(
            &Key::parse(key).unwrap(),
            &src,
            Default::default(),
            kt_client::Progress::none(),
        )
        .await
        .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_file_larger_than_the_budget_is_refused_by_name() {
    let c = Cluster::start().await;
    let (addr, stop, task) = flight_agent(&c, 1 << 10).await;
    put_file(&c, "big/set/small.arrows", 3, 10).await;
    put_file(&c, "big/set/large.arrows", 3, 2000).await;
    let s = do_get(addr, Some(TOKEN), &ticket("big/set", 0, 1, 0, false))
        .await
        .unwrap_err();
    assert_eq!(s.code(), Code::ResourceExhausted, "{s:?}");
    assert!(s.message().contains("large.arrows"), "{s:?}");
    assert!(s.message().contains("--flight-budget"), "{s:?}");
    stop.cancel();
    tokio::time::timeout(Duration::from_secs(30), task)
        .await
        .expect("the agent stops")
        .unwrap();
    c.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idle_client_loses_its_call_and_a_bogus_token_takes_no_slot() {
    let c = Cluster::start().await;
    let mut flight = kt_agent::config::FlightConfig::new("127.0.0.1:0".parse().unwrap());
    flight.budget = 64 << 20;
    flight.max_calls = 1;
    flight.idle = Duration::from_secs(3);
    let (addr, stop, task) = flight_agent_with(&c, flight).await;
    // Far more than the HTTP/2 windows hold: the decoder waits for the
    // client.
    let rows = 400_000;
    put_file(&c, "idle/set/one.arrows", 3, rows).await;
    let good = ticket("idle/set", 0, 1, 0, false);
    // A call that never reads: it holds the only slot...
    let channel = tonic::transport::Channel::from_shared(format!("http://{addr}"))
        .unwrap()
        .connect()
        .await
        .unwrap();
    let mut req = tonic::Request::new(Ticket {
        ticket: good.clone().into(),
    });
    req.metadata_mut()
        .insert("authorization", format!("Bearer {TOKEN}").parse().unwrap());
    let idle = FlightServiceClient::new(channel)
        .do_get(req)
        .await
        .unwrap()
        .into_inner();
    let s = do_get(addr, Some(TOKEN), &good).await.unwrap_err();
    assert_eq!(s.code(), Code::ResourceExhausted, "{s:?}");
    // ...but a token nobody knows is refused as such, holding none.
    let s = do_get(addr, Some("nobody-knows-this-token"), &good)
        .await
        .unwrap_err();
    assert_eq!(s.code(), Code::Unauthenticated, "{s:?}");
    // Once the idle timeout passes the slot is free again.
    let again = tokio::time::timeout(Duration::from_secs(60), async {
        loop {
            match do_get(addr, Some(TOKEN), &good).await {
                Err(s) if s.code() == Code::ResourceExhausted => tokio::task::yield_now().await,
                r => break r,
            }
        }
    })
    .await
    .expect("the idle call's slot is given back");
    assert_eq!(again.unwrap().len(), rows);
    // The idle client is told its share was cut off, not shown a short one.
    let got: Result<Vec<RecordBatch>, FlightError> =
        FlightRecordBatchStream::new_from_flight_data(idle.map_err(FlightError::from))
            .try_collect()
            .await;
    match got {
        Err(FlightError::Tonic(s)) => {
            assert_eq!(s.code(), Code::DeadlineExceeded, "{s:?}");
            assert!(s.message().contains("took no data"), "{s:?}");
        }
        other => panic!("the cut-off share: {other:?}"),
    }
    stop.cancel();
    tokio::time::timeout(Duration::from_secs(30), task)
        .await
        .expect("the agent stops")
        .unwrap();
    c.stop().await;
}

/// The process's peak resident bytes so far (VmHWM).
fn peak_resident() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    let kb: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse().ok())
        .expect("VmHWM in /proc/self/status");
    kb * 1024
}

/// Writes a one-column (`v`, binary) Parquet file of `rows` rows.
fn write_binary_parquet(
    path: &std::path::Path,
    rows: usize,
    value: &[u8],
    props: parquet::file::properties::WriterProperties,
) {
    let keys = Int32Array::from(vec![0i32; rows]);
    let values = arrow_array::BinaryArray::from(vec![value]);
    let dict = arrow_array::DictionaryArray::<arrow_array::types::Int32Type>::try_new(
        keys,
        Arc::new(values),
    )
    .unwrap();
    let schema = Arc::new(Schema::new(vec![Field::new(
        "v",
        arrow_array::Array::data_type(&dict).clone(),
        false,
    )]));
    let batch = RecordBatch::try_new(schema.clone(), vec![Arc::new(dict)]).unwrap();
    // No Arrow schema in the file: the reader's type is plain Binary.
    let opts = parquet::arrow::arrow_writer::ArrowWriterOptions::new()
        .with_properties(props)
        .with_skip_arrow_metadata(true);
    let f = std::fs::File::create(path).unwrap();
    let mut w = parquet::arrow::ArrowWriter::try_new_with_options(f, schema, opts).unwrap();
    w.write(&batch).unwrap();
    w.close().unwrap();
}

/// Puts the file at `src` as `key`.
async fn put_path(c: &Cluster, key: &str, src: &std::path::Path) {
    c.client_with(|cfg| cfg.serve_copies = false)
        .put(
            &Key::parse(key).unwrap(),
            src,
            Default::default(),
            kt_client::Progress::none(),
        )
        .await
        .unwrap();
}

/// DoGet of `ticket` with `token`: the open stream of its batches.
async fn open_get(
    addr: std::net::SocketAddr,
    token: &str,
    ticket: &[u8],
) -> Result<FlightRecordBatchStream, tonic::Status> {
    let channel = tonic::transport::Channel::from_shared(format!("http://{addr}"))
        .unwrap()
        .connect()
        .await
        .expect("connect");
    let mut req = tonic::Request::new(Ticket {
        ticket: ticket.to_vec().into(),
    });
    req.metadata_mut()
        .insert("authorization", format!("Bearer {token}").parse().unwrap());
    let data = FlightServiceClient::new(channel)
        .do_get(req)
        .await?
        .into_inner();
    Ok(FlightRecordBatchStream::new_from_flight_data(
        data.map_err(FlightError::from),
    ))
}

/// The sum of the samples of `name` whose labels include every one of
/// `labels` (`key="value"`), in a text exposition.
fn sample_sum(text: &str, name: &str, labels: &[&str]) -> f64 {
    text.lines()
        .filter(|l| l.starts_with(&format!("{name}{{")))
        .filter(|l| labels.iter().all(|want| l.contains(want)))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

/// `url`'s metrics (the admin token).
async fn scrape(url: &str) -> String {
    let http = kt_api::client_builder().build().unwrap();
    let resp = http
        .get(format!("{url}/metrics"))
        .bearer_auth(TOKEN)
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200, "{url}/metrics");
    resp.text().await.unwrap()
}

/// Stops the agent and the cluster.
async fn finish(c: Cluster, stop: CancellationToken, task: tokio::task::JoinHandle<()>) {
    stop.cancel();
    tokio::time::timeout(Duration::from_secs(30), task)
        .await
        .expect("the agent stops")
        .unwrap();
    c.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_parquet_page_claiming_more_than_the_cap_is_refused_by_name() {
    let c = Cluster::start().await;
    let (addr, stop, task) = flight_agent(&c, 64 << 20).await;
    // One value of zeros, larger than the cap, zstd-compressed to a few
    // KiB: its page claims its full size uncompressed.
    let value = vec![0u8; kt_agent::flight::MAX_BATCH_BYTES as usize + (1 << 20)];
    let props = parquet::file::properties::WriterProperties::builder()
        .set_dictionary_enabled(false)
        .set_compression(parquet::basic::Compression::ZSTD(Default::default()))
        .set_data_page_size_limit(1 << 30)
        .build();
    let src = c.dir.path().join("claim.parquet");
    write_binary_parquet(&src, 1, &value, props);
    drop(value);
    let size = std::fs::metadata(&src).unwrap().len();
    assert!(size < 1 << 20, "a small file: {size} bytes");
    put_path(&c, "claim/set/zeros.parquet", &src).await;
    let s = do_get(addr, Some(TOKEN), &ticket("claim/set", 0, 1, 0, false))
        .await
        .unwrap_err();
    assert_eq!(s.code(), Code::ResourceExhausted, "{s:?}");
    assert!(s.message().contains("zeros.parquet"), "{s:?}");
    assert!(
        s.message()
            .contains(&kt_agent::flight::MAX_BATCH_BYTES.to_string()),
        "{s:?}"
    );
    finish(c, stop, task).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_parquet_dictionary_bomb_streams_in_bounded_memory() {
    let c = Cluster::start().await;
    let (addr, stop, task) = flight_agent(&c, 64 << 20).await;
    // 200 KiB once in the dictionary, 8192 rows pointing at it: a 200 KB
    // file that a batch of 8192 rows expands to 1.6 GiB.
    let rows = 8192;
    let value = vec![7u8; 200 << 10];
    let props = parquet::file::properties::WriterProperties::builder()
        .set_dictionary_enabled(true)
        .set_dictionary_page_size_limit(1 << 30)
        .set_data_page_size_limit(1 << 30)
        .build();
    let src = c.dir.path().join("bomb.parquet");
    write_binary_parquet(&src, rows, &value, props);
    let size = std::fs::metadata(&src).unwrap().len();
    assert!(size < 1 << 20, "a small file: {size} bytes");
    put_path(&c, "bomb/set/one.parquet", &src).await;
    let before = peak_resident();
    let mut batches = open_get(addr, TOKEN, &ticket("bomb/set", 0, 1, 0, false))
        .await
        .unwrap();
    let mut got = 0;
    for _ in 0..3 {
        let b = batches.try_next().await.unwrap().expect("a batch");
        assert!(b.num_rows() < rows, "rows per batch from the cap");
        let v = b
            .column(0)
            .as_any()
            .downcast_ref::<arrow_array::BinaryArray>()
            .unwrap();
        assert!(v.iter().all(|x| x == Some(&value[..])));
        got += b.num_rows();
    }
    drop(batches);
    let grew = peak_resident().saturating_sub(before);
    assert!(
        grew < 512 << 20,
        "{got} rows read; the peak resident size grew by {grew} bytes"
    );
    finish(c, stop, task).await;
}

/// A call that holds a slot: its stream, opened and never read.
async fn hold(addr: std::net::SocketAddr, token: &str, ticket: &[u8]) -> FlightRecordBatchStream {
    open_get(addr, token, ticket).await.expect("the held call")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn calls_over_the_limit_are_refused_before_any_listing() {
    let c = Cluster::start().await;
    let mut flight = kt_agent::config::FlightConfig::new("127.0.0.1:0".parse().unwrap());
    flight.budget = 64 << 20;
    flight.max_calls = 1;
    flight.idle = Duration::from_secs(300);
    let (addr, stop, task) = flight_agent_with(&c, flight).await;
    put_file(&c, "busy/set/one.arrows", 3, 400_000).await;
    let good = ticket("busy/set", 0, 1, 0, false);
    let held = hold(addr, TOKEN, &good).await;
    let listings = |text: &str| {
        sample_sum(
            text,
            "kt_http_requests_total",
            &[r#"route="/api/v1/keys""#, r#"method="GET""#],
        )
    };
    let before = listings(&scrape(&c.metadata_url()).await);
    let refused =
        futures::future::join_all((0..20).map(|_| do_get(addr, Some(TOKEN), &good))).await;
    for r in refused {
        let s = r.unwrap_err();
        assert_eq!(s.code(), Code::ResourceExhausted, "{s:?}");
        assert!(s.message().contains("--flight-max-calls"), "{s:?}");
    }
    let after = listings(&scrape(&c.metadata_url()).await);
    assert!(
        after - before <= 1.0,
        "refused calls listed the share: {before} listings, then {after}"
    );
    drop(held);
    finish(c, stop, task).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_token_holds_at_most_its_share_of_the_calls() {
    const READER: &str = "workload-reader-0123456789";
    let dir = tempfile::tempdir().unwrap();
    let file = AuthFile {
        tokens: vec![Grant {
            token: READER.into(),
            role: Role::Workload,
            name: None,
            services: Some(vec!["reader".into()]),
            reads: None,
        }],
    };
    let path = dir.path().join("auth.json");
    std::fs::write(&path, serde_json::to_vec(&file).unwrap()).unwrap();
    let auth = kt_service::Auth::from_file(&path).unwrap();
    let c = Cluster::start_authed(Some(auth), |_| {}).await;
    let mut flight = kt_agent::config::FlightConfig::new("127.0.0.1:0".parse().unwrap());
    flight.budget = 64 << 20;
    flight.max_calls = 4;
    flight.per_token = 1;
    flight.idle = Duration::from_secs(300);
    let (addr, stop, task) = flight_agent_with(&c, flight).await;
    put_file(&c, "mine/set/one.arrows", 3, 400_000).await;
    let good = ticket("mine/set", 0, 1, 0, false);
    let held = hold(addr, TOKEN, &good).await;
    let s = do_get(addr, Some(TOKEN), &good).await.unwrap_err();
    assert_eq!(s.code(), Code::ResourceExhausted, "{s:?}");
    assert!(
        s.message().contains("--flight-max-calls-per-token"),
        "{s:?}"
    );
    // Another token still gets a call.
    assert_eq!(
        do_get(addr, Some(READER), &good).await.unwrap().len(),
        400_000
    );
    drop(held);
    finish(c, stop, task).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn marker_files_are_never_fetched() {
    let c = Cluster::start().await;
    let (addr, stop, task) = flight_agent(&c, 1 << 10).await;
    put_file(&c, "mark/set/data.arrows", 3, 10).await;
    // Larger than the whole budget, and a marker: never read.
    let big = c.dir.path().join("big");
    std::fs::write(&big, vec![1u8; 4 << 20]).unwrap();
    put_path(&c, "mark/set/_big", &big).await;
    let sent = |text: &str| {
        sample_sum(
            text,
            "kt_service_bytes_total",
            &[r#"service="mark""#, r#"direction="sent""#],
        )
    };
    let before = sent(&scrape(&c.store_url()).await);
    let rows = do_get(addr, Some(TOKEN), &ticket("mark/set", 0, 1, 0, false))
        .await
        .unwrap();
    assert_eq!(rows.len(), 10);
    let after = sent(&scrape(&c.store_url()).await);
    assert!(
        after - before < f64::from(1 << 20),
        "the store sent {} bytes of mark/set: _big was fetched",
        after - before
    );
    finish(c, stop, task).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_listing_over_the_file_limit_is_refused_by_name() {
    let c = Cluster::start().await;
    let mut flight = kt_agent::config::FlightConfig::new("127.0.0.1:0".parse().unwrap());
    flight.max_files = 2;
    let (addr, stop, task) = flight_agent_with(&c, flight).await;
    for n in 0..3 {
        put_file(&c, &format!("many/set/{n}.arrows"), 3, 10).await;
    }
    let s = do_get(addr, Some(TOKEN), &ticket("many/set", 0, 1, 0, false))
        .await
        .unwrap_err();
    assert_eq!(s.code(), Code::ResourceExhausted, "{s:?}");
    assert!(s.message().contains("--flight-max-files"), "{s:?}");
    finish(c, stop, task).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_call_past_its_longest_duration_is_ended_and_told_so() {
    let c = Cluster::start().await;
    let mut flight = kt_agent::config::FlightConfig::new("127.0.0.1:0".parse().unwrap());
    flight.budget = 64 << 20;
    flight.max_calls = 1;
    flight.max_duration = Duration::from_secs(2);
    flight.idle = Duration::from_secs(300);
    let (addr, stop, task) = flight_agent_with(&c, flight).await;
    put_file(&c, "slow/set/one.arrows", 3, 400_000).await;
    put_file(&c, "slow/small/one.arrows", 3, 10).await;
    // A client that never reads holds the only slot until the call's time
    // is up (its idle timeout is far away)...
    let held = hold(addr, TOKEN, &ticket("slow/set", 0, 1, 0, false)).await;
    let small = ticket("slow/small", 0, 1, 0, false);
    let again = tokio::time::timeout(Duration::from_secs(120), async {
        loop {
            match do_get(addr, Some(TOKEN), &small).await {
                Err(s) if s.code() == Code::ResourceExhausted => tokio::task::yield_now().await,
                r => break r,
            }
        }
    })
    .await
    .expect("the long call's slot is given back");
    assert_eq!(again.unwrap().len(), 10);
    // ...and is then told why its share ended.
    let got: Result<Vec<RecordBatch>, FlightError> =
        tokio::time::timeout(Duration::from_secs(120), held.try_collect())
            .await
            .expect("the call ends");
    match got {
        Err(FlightError::Tonic(s)) => {
            assert_eq!(s.code(), Code::DeadlineExceeded, "{s:?}");
            assert!(s.message().contains("--flight-max-duration"), "{s:?}");
        }
        other => panic!("the call past its duration: {other:?}"),
    }
    finish(c, stop, task).await;
}

/// A gRPC channel to `addr` over TLS, trusting only the CA `ca_der` and
/// asking for ALPN `h2` (as grpc-core and pyarrow do): refused unless the
/// server chose it.
async fn tls_channel(
    addr: std::net::SocketAddr,
    ca_der: Vec<u8>,
) -> Result<tonic::transport::Channel, tonic::transport::Error> {
    let mut roots = rustls::RootCertStore::empty();
    roots.add(ca_der.into()).unwrap();
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut cfg = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_root_certificates(roots)
        .with_no_client_auth();
    cfg.alpn_protocols = vec![b"h2".to_vec()];
    let connector = tokio_rustls::TlsConnector::from(Arc::new(cfg));
    let connect = tower::service_fn(move |_: http::Uri| {
        let connector = connector.clone();
        async move {
            let tcp = tokio::net::TcpStream::connect(addr).await?;
            let name = rustls::pki_types::ServerName::from(addr.ip());
            let tls = connector.connect(name, tcp).await?;
            if tls.get_ref().1.alpn_protocol() != Some(b"h2".as_slice()) {
                return Err(std::io::Error::other("the server did not choose ALPN h2"));
            }
            Ok(hyper_util::rt::TokioIo::new(tls))
        }
    });
    tonic::transport::Channel::from_shared(format!("http://{addr}"))
        .unwrap()
        .connect_timeout(Duration::from_secs(30))
        .connect_with_connector(connect)
        .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_tls_cert_flight_is_served_over_tls_only() {
    let c = Cluster::start().await;
    let ca = kt_tests::certs::ca();
    let (cert, key, _) = kt_tests::certs::issue(&ca, c.dir.path(), "flight");
    let tls = kt_service::tls::Tls::load(&cert, &key).unwrap();
    let flight = kt_agent::config::FlightConfig::new("127.0.0.1:0".parse().unwrap());
    let (addr, stop, task) = flight_agent_tls(&c, flight, Some(tls)).await;
    for n in 0..2 {
        put_file(&c, &format!("tls/set/part-{n}.parquet"), 4 * n, 150).await;
    }
    let t = ticket("tls/set", 0, 1, 0, false);

    let channel = tls_channel(addr, ca.cert.der().to_vec())
        .await
        .expect("a TLS connection");
    let rows = do_get_on(channel, Some(TOKEN), &t)
        .await
        .expect("DoGet over TLS");
    let mut want: Vec<(i32, i64)> = [0, 4]
        .into_iter()
        .flat_map(|n| (0..150).map(move |x| (n, x)))
        .collect();
    let mut got = rows;
    want.sort_unstable();
    got.sort_unstable();
    assert_eq!(got, want, "the whole share, over TLS");

    // A plaintext gRPC client gets nothing from the TLS port (its token is
    // never read in the clear).
    let plain = async {
        let channel = tonic::transport::Channel::from_shared(format!("http://{addr}"))
            .unwrap()
            .connect()
            .await
            .map_err(|e| e.to_string())?;
        do_get_on(channel, Some(TOKEN), &t)
            .await
            .map_err(|s| s.to_string())
    };
    let plain = tokio::time::timeout(Duration::from_secs(120), plain)
        .await
        .expect("the plaintext call ends");
    assert!(plain.is_err(), "plaintext DoGet on the TLS port: {plain:?}");
    finish(c, stop, task).await;
}

/// A Thrift compact `PageHeader` of a PLAIN data page: its sizes and
/// value count, as a writer would put it before the page's bytes.
fn data_page_header(uncompressed: i32, compressed: i32, values: i32) -> Vec<u8> {
    fn zigzag(v: i32) -> Vec<u8> {
        let mut u = ((v << 1) ^ (v >> 31)) as u32;
        let mut out = Vec::new();
        loop {
            let b = (u & 0x7f) as u8;
            u >>= 7;
            if u == 0 {
                out.push(b);
                return out;
            }
            out.push(b | 0x80);
        }
    }
    let mut h = Vec::new();
    // Fields 1-3 (i32): type DATA_PAGE, uncompressed and compressed size.
    for v in [0, uncompressed, compressed] {
        h.push(0x15);
        h.extend(zigzag(v));
    }
    // Field 5 (struct): the data page header: values, PLAIN, RLE, RLE.
    h.push(0x2c);
    for v in [values, 0, 3, 3] {
        h.push(0x15);
        h.extend(zigzag(v));
    }
    h.push(0);
    h.push(0);
    h
}

/// Writes a Parquet file of one required INT64 column `x` whose one column
/// chunk is `chunk` (page headers and bytes as given), compressed with
/// `codec`, of `rows` rows.
fn write_raw_parquet(
    path: &std::path::Path,
    chunk: Vec<u8>,
    rows: i64,
    codec: parquet::basic::Compression,
) {
    use parquet::file::metadata::ColumnChunkMetaData;
    use parquet::file::writer::SerializedFileWriter;
    let schema = Arc::new(
        parquet::schema::parser::parse_message_type("message m { required int64 x; }").unwrap(),
    );
    let props = Arc::new(
        parquet::file::properties::WriterProperties::builder()
            .set_compression(codec)
            .build(),
    );
    let f = std::fs::File::create(path).unwrap();
    let mut w = SerializedFileWriter::new(f, schema, props).unwrap();
    let column = w.schema_descr().column(0);
    let len = chunk.len() as i64;
    let metadata = ColumnChunkMetaData::builder(column)
        .set_compression(codec)
        .set_num_values(rows)
        .set_total_compressed_size(len)
        .set_total_uncompressed_size(len)
        .set_data_page_offset(0)
        .build()
        .unwrap();
    let close = parquet::column::writer::ColumnCloseResult {
        bytes_written: len as u64,
        rows_written: rows as u64,
        metadata,
        bloom_filter: None,
        column_index: None,
        offset_index: None,
    };
    let mut group = w.next_row_group().unwrap();
    group
        .append_column(&bytes::Bytes::from(chunk), close)
        .unwrap();
    group.close().unwrap();
    w.close().unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_parquet_page_over_the_cap_compressed_is_refused_before_it_is_read() {
    let c = Cluster::start().await;
    let (addr, stop, task) = flight_agent(&c, 64 << 20).await;
    // A page claiming 1 KiB uncompressed but MAX_BATCH_BYTES + 1
    // compressed: the reader would hold those bytes whole before it found
    // out they do not decompress to 1 KiB.
    let compressed = kt_agent::flight::MAX_BATCH_BYTES as usize + 1;
    let mut chunk = data_page_header(1024, compressed as i32, 128);
    let at = 4; // the chunk's first byte in the file, after `PAR1`
    chunk.resize(chunk.len() + compressed, 0x5a);
    let src = c.dir.path().join("wide-page.parquet");
    write_raw_parquet(&src, chunk, 128, parquet::basic::Compression::SNAPPY);
    put_path(&c, "compressed/set/wide.parquet", &src).await;
    let s = do_get(addr, Some(TOKEN), &ticket("compressed/set", 0, 1, 0, false))
        .await
        .unwrap_err();
    assert_eq!(s.code(), Code::ResourceExhausted, "{s:?}");
    for want in [
        "wide.parquet".to_string(),
        format!("page at byte {at}"),
        format!("{compressed} bytes compressed"),
        kt_agent::flight::MAX_BATCH_BYTES.to_string(),
    ] {
        assert!(s.message().contains(&want), "{want}: {s:?}");
    }
    finish(c, stop, task).await;
}

/// Writes `batches` as an Arrow IPC file (`stream`: an IPC stream),
/// zstd-compressed.
fn write_zstd_ipc(path: &std::path::Path, batches: &[RecordBatch], stream: bool) {
    let opts = arrow_ipc::writer::IpcWriteOptions::default()
        .try_with_compression(Some(arrow_ipc::CompressionType::ZSTD))
        .unwrap();
    let f = std::fs::File::create(path).unwrap();
    let schema = batches[0].schema();
    if stream {
        let mut w =
            arrow_ipc::writer::StreamWriter::try_new_with_options(f, &schema, opts).unwrap();
        for b in batches {
            w.write(b).unwrap();
        }
        w.finish().unwrap();
    } else {
        let mut w = arrow_ipc::writer::FileWriter::try_new_with_options(f, &schema, opts).unwrap();
        for b in batches {
            w.write(b).unwrap();
        }
        w.finish().unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_compressed_arrow_ipc_batch_is_bounded_by_what_it_claims_before_decoding() {
    let c = Cluster::start().await;
    let (addr, stop, task) = flight_agent(&c, 64 << 20).await;
    let cap = kt_agent::flight::MAX_BATCH_BYTES;
    // One batch whose `x` decodes to twice the cap, of zeros: a file of a
    // few KiB that claims 64 MiB.
    let rows = (2 * cap / 8) as usize;
    let schema = schema();
    let bomb = RecordBatch::try_new(
        schema.clone(),
        vec![
            Arc::new(Int32Array::from(vec![0; rows])),
            Arc::new(Int64Array::from(vec![0i64; rows])),
        ],
    )
    .unwrap();
    for (name, stream) in [("bomb.arrow", false), ("bomb.arrows", true)] {
        let src = c.dir.path().join(name);
        write_zstd_ipc(&src, std::slice::from_ref(&bomb), stream);
        let size = std::fs::metadata(&src).unwrap().len();
        assert!(size < 4 << 20, "{name}: a small file: {size} bytes");
        let prefix = format!("ipc-bomb/{}", if stream { "stream" } else { "file" });
        put_path(&c, &format!("{prefix}/{name}"), &src).await;
        let s = do_get(addr, Some(TOKEN), &ticket(&prefix, 0, 1, 0, false))
            .await
            .unwrap_err();
        assert_eq!(s.code(), Code::ResourceExhausted, "{name}: {s:?}");
        assert!(s.message().contains(name), "{s:?}");
        assert!(s.message().contains(&cap.to_string()), "{s:?}");
    }
    drop(bomb);
    // Compressed batches within the cap stream as before.
    let small: Vec<RecordBatch> = (0..3).map(|i| batch(&schema, 2, 100, i * 100)).collect();
    for (name, stream) in [("small.arrow", false), ("small.arrows", true)] {
        let src = c.dir.path().join(name);
        write_zstd_ipc(&src, &small, stream);
        put_path(&c, &format!("ipc-small/{name}/{name}"), &src).await;
        let rows = do_get(
            addr,
            Some(TOKEN),
            &ticket(&format!("ipc-small/{name}"), 0, 1, 0, false),
        )
        .await
        .unwrap();
        assert_eq!(rows, (0..300).map(|x| (2, x)).collect::<Vec<_>>(), "{name}");
    }
    finish(c, stop, task).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_parquet_row_group_whose_pages_together_are_over_the_budget_is_refused() {
    let c = Cluster::start().await;
    let (addr, stop, task) = flight_agent(&c, 64 << 20).await;
    // Columns of one page each, every page within MAX_BATCH_BYTES, but the
    // reader holds one page of every column at once: together over
    // MAX_READER_BYTES. Zeros, zstd: a file of a few KiB.
    let page = kt_agent::flight::MAX_BATCH_BYTES - (1 << 20);
    let columns = (kt_agent::flight::MAX_READER_BYTES / page + 1) as usize;
    let rows = (page / 8) as usize;
    let zeros: arrow_array::ArrayRef = Arc::new(Int64Array::from(vec![0i64; rows]));
    let fields: Vec<Field> = (0..columns)
        .map(|i| Field::new(format!("c{i}"), DataType::Int64, false))
        .collect();
    let schema = Arc::new(Schema::new(fields));
    let batch = RecordBatch::try_new(schema.clone(), vec![zeros; columns]).unwrap();
    let props = parquet::file::properties::WriterProperties::builder()
        .set_dictionary_enabled(false)
        .set_compression(parquet::basic::Compression::ZSTD(Default::default()))
        .set_data_page_size_limit(1 << 30)
        .set_data_page_row_count_limit(usize::MAX)
        .set_max_row_group_row_count(Some(rows))
        .build();
    let src = c.dir.path().join("wide.parquet");
    let f = std::fs::File::create(&src).unwrap();
    let mut w = parquet::arrow::ArrowWriter::try_new(f, schema, Some(props)).unwrap();
    w.write(&batch).unwrap();
    w.close().unwrap();
    drop(batch);
    let size = std::fs::metadata(&src).unwrap().len();
    assert!(size < 4 << 20, "a small file: {size} bytes");
    put_path(&c, "pages/set/wide.parquet", &src).await;
    let s = do_get(addr, Some(TOKEN), &ticket("pages/set", 0, 1, 0, false))
        .await
        .unwrap_err();
    assert_eq!(s.code(), Code::ResourceExhausted, "{s:?}");
    for want in [
        "wide.parquet".to_string(),
        "row group 0".to_string(),
        kt_agent::flight::MAX_READER_BYTES.to_string(),
    ] {
        assert!(s.message().contains(&want), "{want}: {s:?}");
    }
    finish(c, stop, task).await;
}

#[test]
fn the_flight_dir_is_kept_and_only_what_calls_left_is_removed() {
    use std::os::unix::fs::MetadataExt;
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("flight");
    std::fs::create_dir_all(dir.join("share-old/sub")).unwrap();
    std::fs::write(dir.join("share-old/sub/x"), b"x").unwrap();
    std::fs::write(dir.join("share-file"), b"x").unwrap();
    std::fs::write(dir.join("keep.txt"), b"mine").unwrap();
    std::fs::create_dir(dir.join("data")).unwrap();
    std::fs::write(dir.join("data/y"), b"y").unwrap();
    // A share-* link is removed as a link: what it points at stays.
    std::os::unix::fs::symlink(dir.join("data"), dir.join("share-link")).unwrap();
    let ino = std::fs::metadata(&dir).unwrap().ino();
    let mut cfg = kt_agent::config::FlightConfig::new("127.0.0.1:0".parse().unwrap());
    cfg.budget = 1 << 10;
    kt_agent::flight::Shares::new("http://127.0.0.1:1", dir.clone(), &cfg).unwrap();
    // The directory itself (an emptyDir's mount point in a pod, where
    // removing it fails with EBUSY) is never removed: the same inode.
    assert_eq!(std::fs::metadata(&dir).unwrap().ino(), ino);
    let mut left: Vec<String> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    left.sort();
    assert_eq!(left, ["data", "keep.txt"]);
    assert_eq!(std::fs::read(dir.join("keep.txt")).unwrap(), b"mine");
    assert_eq!(std::fs::read(dir.join("data/y")).unwrap(), b"y");
}
