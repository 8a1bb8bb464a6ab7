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
    let run = cluster.dir.path().join("flight-agent");
    let mut cfg = kt_agent::Config::new(
        "flight-agent",
        cluster.metadata_url(),
        Token::new(TOKEN).unwrap(),
        run.join("agent.sock"),
    );
    cfg.shm_dir = cluster.shm_dir();
    cfg.flight = Some(flight);
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
