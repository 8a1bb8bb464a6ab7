//! Traces end to end: one `kt get` is one trace, and its id is on the log
//! lines of every component the get went through — the client, the
//! metadata server, and the source it read from (the node agent serving a
//! `locale=local` key, the store for a store key) — and on the agent's
//! calls to the metadata server for a local put (the control socket, then
//! HTTP). A component that drops the `traceparent` logs under a trace of
//! its own, and the test fails.
//!
//! The servers run in this process, so the log lines are captured by a
//! `tracing` layer that notes, for each event, the trace id of the span it
//! was logged in and the component (a request span's `server`, the
//! client's `op` span).

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;
use std::sync::{Arc, Mutex, OnceLock};

use kt_api::trace::TraceParent;
use kt_client::{Client, GetOptions, Progress};
use kt_tests::{Cluster, bytes, write_files};
use kt_types::Key;
use kt_types::api::PutOptions;
use tracing::field::{Field, Visit};
use tracing::span::{Attributes, Id, Record};
use tracing_subscriber::layer::{Context, SubscriberExt};
use tracing_subscriber::registry::LookupSpan;

/// Component -> trace ids seen on its log lines.
type Seen = Arc<Mutex<BTreeMap<String, BTreeSet<String>>>>;

/// What a span says of its trace and component.
#[derive(Debug, Default, Clone)]
struct Tag {
    trace_id: Option<String>,
    component: Option<String>,
}

impl Visit for Tag {
    fn record_debug(&mut self, field: &Field, value: &dyn std::fmt::Debug) {
        let v = format!("{value:?}").trim_matches('"').to_owned();
        match field.name() {
            "trace_id" => self.trace_id = Some(v),
            "server" => self.component = Some(v),
            _ => {}
        }
    }
    fn record_str(&mut self, field: &Field, value: &str) {
        self.record_debug(field, &value);
    }
}

/// Notes the (component, trace id) of every event logged in a traced span.
struct Capture(Seen);

impl<S: tracing::Subscriber + for<'a> LookupSpan<'a>> tracing_subscriber::Layer<S> for Capture {
    fn on_new_span(&self, attrs: &Attributes<'_>, id: &Id, ctx: Context<'_, S>) {
        let mut tag = Tag::default();
        attrs.record(&mut tag);
        if attrs.metadata().name() == "op" {
            tag.component = Some("client".to_owned());
        }
        if let Some(span) = ctx.span(id) {
            span.extensions_mut().insert(tag);
        }
    }

    fn on_record(&self, id: &Id, values: &Record<'_>, ctx: Context<'_, S>) {
        if let Some(span) = ctx.span(id)
            && let Some(tag) = span.extensions_mut().get_mut::<Tag>()
        {
            values.record(tag);
        }
    }

    fn on_event(&self, event: &tracing::Event<'_>, ctx: Context<'_, S>) {
        let Some(scope) = ctx.event_scope(event) else {
            return;
        };
        for span in scope {
            let ext = span.extensions();
            if let Some(Tag {
                trace_id: Some(t),
                component: Some(c),
            }) = ext.get::<Tag>()
            {
                self.0
                    .lock()
                    .unwrap()
                    .entry(c.clone())
                    .or_default()
                    .insert(t.clone());
                return;
            }
        }
    }
}

fn seen() -> &'static Seen {
    static SEEN: OnceLock<Seen> = OnceLock::new();
    SEEN.get_or_init(|| {
        let seen = Seen::default();
        let subscriber = tracing_subscriber::registry()
            .with(tracing_subscriber::EnvFilter::new("debug"))
            .with(Capture(seen.clone()));
        tracing::subscriber::set_global_default(subscriber).expect("one subscriber");
        seen
    })
}

/// The components whose log lines carried `trace`.
fn components_of(trace: &TraceParent) -> BTreeSet<String> {
    let id = trace.trace_id().to_string();
    seen()
        .lock()
        .unwrap()
        .iter()
        .filter(|(_, ids)| ids.contains(&id))
        .map(|(c, _)| c.clone())
        .collect()
}

fn key(s: &str) -> Key {
    Key::parse(s).unwrap()
}

fn set(names: &[&str]) -> BTreeSet<String> {
    names.iter().map(|s| (*s).to_owned()).collect()
}

/// One get of `k` into `dest` as one traced operation, as `kt get` runs it.
async fn traced_get(client: &Client, k: &Key, dest: &Path) -> TraceParent {
    let trace = TraceParent::new();
    let traced = client.traced(trace);
    kt_client::trace::operation(
        "get",
        trace,
        traced.get_with(k, dest, &GetOptions::default(), Progress::none()),
    )
    .await
    .expect("the get");
    trace
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_get_is_one_trace_through_client_metadata_and_its_source() {
    seen();
    let c = Cluster::start().await;
    let agent = c.start_agent("pod-a").await;
    let src = c.dir.path().join("src");
    write_files(&src, &[("a.txt", b"a"), ("d/b.bin", &bytes(3, 5000))]);

    // A local put: client -> agent (control socket) -> metadata server.
    let producer = c.client_with(|cfg| {
        cfg.agent_socket = agent.socket().to_path_buf();
    });
    let put = TraceParent::new();
    kt_client::trace::operation(
        "put",
        put,
        producer
            .traced(put)
            .put_local(&key("team/local"), &src, PutOptions::default()),
    )
    .await
    .expect("the local put");
    // A store put.
    c.client()
        .put(
            &key("team/stored"),
            &src,
            PutOptions::default(),
            Progress::none(),
        )
        .await
        .expect("the store put");

    // Getters elsewhere: no agent of their own to serve copies.
    let getter = c.client_with(|cfg| cfg.serve_copies = false);
    let local = traced_get(&getter, &key("team/local"), &c.dir.path().join("got-local")).await;
    let stored = traced_get(
        &getter,
        &key("team/stored"),
        &c.dir.path().join("got-stored"),
    )
    .await;
    assert_eq!(
        kt_tests::fingerprint(&c.dir.path().join("got-local")),
        kt_tests::fingerprint(&src)
    );

    let expect = |trace: &TraceParent, want: &[&str], what: &str| {
        let got = components_of(trace);
        assert!(
            got.is_superset(&set(want)),
            "{what} (trace {}): logged by {got:?}, not by all of {want:?}",
            trace.trace_id()
        );
    };
    expect(&put, &["agent", "client", "metadata"], "the local put");
    expect(
        &local,
        &["agent", "client", "metadata"],
        "the get of a local key",
    );
    expect(
        &stored,
        &["client", "metadata", "store"],
        "the get of a store key",
    );
    // Each operation is a trace of its own.
    assert_ne!(local.trace_id(), stored.trace_id());
    agent.stop().await;
    c.stop().await;
}

/// A server's error answer names the trace of the request it failed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_error_answer_names_the_callers_trace() {
    let c = Cluster::start().await;
    let trace = TraceParent::new();
    let err = kt_client::trace::operation(
        "get",
        trace,
        c.client().traced(trace).get_with(
            &key("team/missing"),
            &c.dir.path().join("nothing"),
            &GetOptions::default(),
            Progress::none(),
        ),
    )
    .await
    .expect_err("no such key");
    assert_eq!(err.code(), Some(kt_types::ErrorCode::NotFound), "{err}");
    let resp = kt_api::client()
        .get(format!(
            "{}{}",
            c.metadata_url(),
            kt_types::paths::key(&key("team/missing"))
        ))
        .bearer_auth(kt_tests::TOKEN)
        .header(kt_api::trace::HEADER, trace.to_string())
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 404);
    let body: kt_types::ErrorBody = resp.json().await.unwrap();
    assert_eq!(
        body.error.trace_id,
        Some(trace.trace_id().to_string()),
        "{body:?}"
    );
    c.stop().await;
}
