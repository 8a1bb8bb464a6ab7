//! The in-memory API server (`kt_kube::apiserver`) driven by kube-rs's own
//! clients and runtime: CRUD, conflicts, selectors, watch + resume + 410,
//! finalizers, the status subresource, patches and server-side apply,
//! kubeconfig and bearer tokens, the events Recorder.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use k8s_openapi::api::core::v1::{ConfigMap, Node, Pod};
use kt_kube::apiserver::{ApiServer, ApiServerConfig, Resource};
use kube::api::{
    Api, DeleteParams, DynamicObject, ListParams, Patch, PatchParams, PostParams, WatchEvent,
    WatchParams,
};
use kube::core::{ApiResource, ObjectMeta};
use kube::runtime::{finalizer, watcher};
use serde_json::json;

const WAIT: Duration = Duration::from_secs(10);

async fn server() -> ApiServer {
    ApiServer::start(ApiServerConfig::default()).await.unwrap()
}

fn cm(name: &str, data: &str) -> ConfigMap {
    ConfigMap {
        metadata: ObjectMeta {
            name: Some(name.into()),
            ..Default::default()
        },
        data: Some(BTreeMap::from([("k".to_owned(), data.to_owned())])),
        ..Default::default()
    }
}

fn code(e: kube::Error) -> u16 {
    match e {
        kube::Error::Api(s) => s.code,
        other => panic!("not an API error: {other:?}"),
    }
}

fn dataset_ar() -> ApiResource {
    ApiResource {
        group: "kt.dev".into(),
        version: "v1alpha1".into(),
        api_version: "kt.dev/v1alpha1".into(),
        kind: "Dataset".into(),
        plural: "datasets".into(),
    }
}

#[tokio::test]
async fn crud_and_conflicts() {
    let s = server().await;
    let api: Api<ConfigMap> = Api::namespaced(s.client().unwrap(), "team");
    let pp = PostParams::default();

    let a = api.create(&pp, &cm("a", "1")).await.unwrap();
    let meta = &a.metadata;
    assert_eq!(meta.namespace.as_deref(), Some("team"));
    assert!(meta.uid.is_some() && meta.creation_timestamp.is_some());
    assert_eq!(meta.generation, Some(1));
    let rv1 = meta.resource_version.clone().unwrap();

    assert_eq!(code(api.create(&pp, &cm("a", "1")).await.unwrap_err()), 409);
    assert_eq!(code(api.get("nope").await.unwrap_err()), 404);
    assert!(api.get_opt("nope").await.unwrap().is_none());

    let mut generated = cm("", "x");
    generated.metadata.name = None;
    generated.metadata.generate_name = Some("gen-".into());
    let g = api.create(&pp, &generated).await.unwrap();
    let gname = g.metadata.name.unwrap();
    assert!(gname.starts_with("gen-") && gname.len() > 4, "{gname}");

    // Replace with the current resourceVersion, then with the stale one.
    let mut b = a.clone();
    b.data = Some(BTreeMap::from([("k".to_owned(), "2".to_owned())]));
    let b = api.replace("a", &pp, &b).await.unwrap();
    assert_ne!(b.metadata.resource_version.as_deref(), Some(rv1.as_str()));
    assert_eq!(b.metadata.uid, a.metadata.uid);
    let mut stale = a.clone();
    stale.data = Some(BTreeMap::from([("k".to_owned(), "3".to_owned())]));
    let err = api.replace("a", &pp, &stale).await.unwrap_err();
    let kube::Error::Api(status) = err else {
        panic!("{err:?}")
    };
    assert_eq!((status.code, status.reason.as_str()), (409, "Conflict"));
    assert_eq!(api.get("a").await.unwrap().data, b.data);

    // A write that changes nothing keeps the resourceVersion.
    let same = api.replace("a", &pp, &b).await.unwrap();
    assert_eq!(same.metadata.resource_version, b.metadata.resource_version);

    let names: Vec<String> = api
        .list(&ListParams::default())
        .await
        .unwrap()
        .items
        .into_iter()
        .filter_map(|c| c.metadata.name)
        .collect();
    assert_eq!(names, vec!["a".to_owned(), gname.clone()]);
    let all: Api<ConfigMap> = Api::all(s.client().unwrap());
    assert_eq!(
        all.list(&ListParams::default()).await.unwrap().items.len(),
        2
    );
    let other: Api<ConfigMap> = Api::namespaced(s.client().unwrap(), "other");
    assert!(
        other
            .list(&ListParams::default())
            .await
            .unwrap()
            .items
            .is_empty()
    );

    assert!(
        api.delete("a", &DeleteParams::default())
            .await
            .unwrap()
            .is_right()
    );
    assert_eq!(code(api.get("a").await.unwrap_err()), 404);
    assert_eq!(
        code(api.delete("a", &DeleteParams::default()).await.unwrap_err()),
        404
    );
    let invalid = cm("Not_A_Name", "1");
    assert_eq!(code(api.create(&pp, &invalid).await.unwrap_err()), 422);
}

#[tokio::test]
async fn label_and_field_selectors() {
    let s = server().await;
    let nodes: Api<Node> = Api::all(s.client().unwrap());
    for (name, zone, gpu) in [("n1", "a", true), ("n2", "b", false), ("n3", "c", true)] {
        let mut labels = BTreeMap::from([("zone".to_owned(), zone.to_owned())]);
        if gpu {
            labels.insert("gpu".into(), "yes".into());
        }
        let node = Node {
            metadata: ObjectMeta {
                name: Some(name.into()),
                labels: Some(labels),
                ..Default::default()
            },
            ..Default::default()
        };
        nodes.create(&PostParams::default(), &node).await.unwrap();
    }
    let names = |sel: &'static str, field: bool| {
        let nodes = nodes.clone();
        async move {
            let lp = if field {
                ListParams::default().fields(sel)
            } else {
                ListParams::default().labels(sel)
            };
            let list = nodes.list(&lp).await.unwrap();
            list.items
                .into_iter()
                .filter_map(|n| n.metadata.name)
                .collect::<Vec<_>>()
                .join(",")
        }
    };
    assert_eq!(names("zone=a", false).await, "n1");
    assert_eq!(names("zone!=a", false).await, "n2,n3");
    assert_eq!(names("zone in (a,b)", false).await, "n1,n2");
    assert_eq!(names("zone notin (a,b)", false).await, "n3");
    assert_eq!(names("gpu", false).await, "n1,n3");
    assert_eq!(names("!gpu", false).await, "n2");
    assert_eq!(names("gpu=yes,zone in (c)", false).await, "n3");
    assert_eq!(names("metadata.name=n2", true).await, "n2");
    assert_eq!(names("metadata.name!=n2", true).await, "n1,n3");

    let pods: Api<Pod> = Api::namespaced(s.client().unwrap(), "kt");
    for (name, node) in [("p1", "n1"), ("p2", "n2")] {
        let pod: Pod = serde_json::from_value(json!({
            "metadata": {"name": name}, "spec": {"nodeName": node, "containers": []},
        }))
        .unwrap();
        pods.create(&PostParams::default(), &pod).await.unwrap();
    }
    let on = pods
        .list(&ListParams::default().fields("spec.nodeName=n2,metadata.namespace=kt"))
        .await
        .unwrap();
    assert_eq!(on.items.len(), 1);
    assert_eq!(on.items[0].metadata.name.as_deref(), Some("p2"));
}

/// Next watch event, or a failure after [`WAIT`].
async fn next<S, K>(stream: &mut S) -> WatchEvent<K>
where
    S: futures::Stream<Item = kube::Result<WatchEvent<K>>> + Unpin,
{
    tokio::time::timeout(WAIT, stream.next())
        .await
        .expect("a watch event in time")
        .expect("the watch is open")
        .expect("a decodable event")
}

fn kind_name(e: &WatchEvent<ConfigMap>) -> (String, String) {
    match e {
        WatchEvent::Added(c) => ("ADDED".into(), c.metadata.name.clone().unwrap()),
        WatchEvent::Modified(c) => ("MODIFIED".into(), c.metadata.name.clone().unwrap()),
        WatchEvent::Deleted(c) => ("DELETED".into(), c.metadata.name.clone().unwrap()),
        WatchEvent::Bookmark(_) => ("BOOKMARK".into(), String::new()),
        WatchEvent::Error(e) => ("ERROR".into(), e.code.to_string()),
    }
}

#[tokio::test]
async fn watch_resume_and_gone() {
    let s = server().await;
    let api: Api<ConfigMap> = Api::namespaced(s.client().unwrap(), "default");
    let pp = PostParams::default();
    let before = api.list(&ListParams::default()).await.unwrap();
    let rv0 = before.metadata.resource_version.unwrap();

    let mut stream = api
        .watch(&WatchParams::default(), &rv0)
        .await
        .unwrap()
        .boxed();
    api.create(&pp, &cm("a", "1")).await.unwrap();
    let patch = json!({"data": {"k": "2"}});
    let modified = api
        .patch("a", &PatchParams::default(), &Patch::Merge(&patch))
        .await
        .unwrap();
    let rv_mid = modified.metadata.resource_version.unwrap();
    api.create(&pp, &cm("b", "1")).await.unwrap();
    api.delete("a", &DeleteParams::default()).await.unwrap();
    let mut seen = Vec::new();
    for _ in 0..4 {
        seen.push(kind_name(&next(&mut stream).await));
    }
    let want = [
        ("ADDED", "a"),
        ("MODIFIED", "a"),
        ("ADDED", "b"),
        ("DELETED", "a"),
    ];
    let want: Vec<(String, String)> = want
        .iter()
        .map(|(k, n)| (k.to_string(), n.to_string()))
        .collect();
    assert_eq!(seen, want);

    // Resume from the middle: only what came after.
    let mut resumed = api
        .watch(&WatchParams::default(), &rv_mid)
        .await
        .unwrap()
        .boxed();
    assert_eq!(
        kind_name(&next(&mut resumed).await),
        ("ADDED".into(), "b".into())
    );
    assert_eq!(
        kind_name(&next(&mut resumed).await),
        ("DELETED".into(), "a".into())
    );

    // A label selector: leaving it is a DELETED, entering it an ADDED.
    let lp = WatchParams::default().labels("pick=yes");
    let now = api
        .list(&ListParams::default())
        .await
        .unwrap()
        .metadata
        .resource_version
        .unwrap();
    let mut picked = api.watch(&lp, &now).await.unwrap().boxed();
    let label = |v: Option<&str>| json!({"metadata": {"labels": {"pick": v}}});
    api.patch(
        "b",
        &PatchParams::default(),
        &Patch::Merge(label(Some("yes"))),
    )
    .await
    .unwrap();
    api.patch("b", &PatchParams::default(), &Patch::Merge(label(None)))
        .await
        .unwrap();
    assert_eq!(
        kind_name(&next(&mut picked).await),
        ("ADDED".into(), "b".into())
    );
    assert_eq!(
        kind_name(&next(&mut picked).await),
        ("DELETED".into(), "b".into())
    );

    // Bookmarks and timeoutSeconds.
    let s2 = ApiServer::start(ApiServerConfig {
        bookmark_interval: Duration::from_millis(50),
        ..ApiServerConfig::default()
    })
    .await
    .unwrap();
    let api2: Api<ConfigMap> = Api::namespaced(s2.client().unwrap(), "default");
    let wp = WatchParams::default().timeout(2);
    let mut marks = api2.watch(&wp, "1").await.unwrap().boxed();
    assert_eq!(kind_name(&next(&mut marks).await).0, "BOOKMARK");
    let ended = tokio::time::timeout(WAIT, async {
        while let Some(e) = marks.next().await {
            e.unwrap();
        }
    })
    .await;
    assert!(ended.is_ok(), "the watch ends after timeoutSeconds");

    // Compacted away: the watch answers a 410 ERROR event, as the real one.
    s.compact();
    let mut gone = api
        .watch(&WatchParams::default(), &rv0)
        .await
        .unwrap()
        .boxed();
    match next(&mut gone).await {
        WatchEvent::Error(e) => assert_eq!((e.code, e.reason.as_str()), (410, "Expired")),
        other => panic!("{other:?}"),
    }
}

#[tokio::test]
async fn runtime_watcher_relists_after_gone() {
    let s = ApiServer::start(ApiServerConfig {
        history: 2,
        ..ApiServerConfig::default()
    })
    .await
    .unwrap();
    let api: Api<ConfigMap> = Api::namespaced(s.client().unwrap(), "default");
    let pp = PostParams::default();
    api.create(&pp, &cm("a", "1")).await.unwrap();
    let (reader, writer) = kube::runtime::reflector::store();
    // Every watcher event, applied to the store before it is yielded.
    let mut stream =
        kube::runtime::reflector(writer, watcher(api.clone(), watcher::Config::default())).boxed();
    let mut errors = Vec::new();
    let mut drive = async |done: &dyn Fn() -> bool, errors: &mut Vec<u16>| {
        tokio::time::timeout(WAIT, async {
            while !done() {
                match stream.next().await {
                    Some(Ok(_)) => {}
                    Some(Err(watcher::Error::WatchError(s))) => errors.push(s.code),
                    Some(Err(e)) => panic!("{e:?}"),
                    None => panic!("the watcher ended"),
                }
            }
        })
        .await
        .expect("the reflector catches up")
    };
    drive(&|| reader.state().len() == 1, &mut errors).await;
    for i in 0..5 {
        api.create(&pp, &cm(&format!("n{i}"), "1")).await.unwrap();
    }
    // The history (2 events) is shorter than what happened: 410, relist.
    drive(&|| reader.state().len() == 6, &mut errors).await;
    assert_eq!(errors, vec![410]);
    s.compact();
    api.delete("a", &DeleteParams::default()).await.unwrap();
    let a = kube::runtime::reflector::ObjectRef::new("a").within("default");
    drive(&|| reader.get(&a).is_none(), &mut errors).await;
}

#[derive(Debug, thiserror::Error)]
#[error("never")]
struct Never;

#[tokio::test]
async fn finalizer_holds_deletion() {
    let s = server().await;
    let api: Api<ConfigMap> = Api::namespaced(s.client().unwrap(), "default");
    api.create(&PostParams::default(), &cm("f", "1"))
        .await
        .unwrap();
    const FIN: &str = "kt.dev/cleanup";
    let run = |api: Api<ConfigMap>| async move {
        let obj = Arc::new(api.get("f").await.unwrap());
        finalizer(&api, FIN, obj, |event| async move {
            Ok::<_, Never>(match event {
                finalizer::Event::Apply(_) => kube::runtime::controller::Action::await_change(),
                finalizer::Event::Cleanup(_) => {
                    kube::runtime::controller::Action::requeue(Duration::from_secs(1))
                }
            })
        })
        .await
        .unwrap()
    };
    // First pass adds the finalizer (JSON patch with test), second applies.
    run(api.clone()).await;
    let held = api.get("f").await.unwrap();
    assert_eq!(held.metadata.finalizers, Some(vec![FIN.to_owned()]));
    run(api.clone()).await;

    let deleted = api.delete("f", &DeleteParams::default()).await.unwrap();
    let marked = deleted.left().expect("still there, marked");
    assert!(marked.metadata.deletion_timestamp.is_some());
    assert!(
        api.get("f")
            .await
            .unwrap()
            .metadata
            .deletion_timestamp
            .is_some()
    );

    // Cleanup removes the finalizer: the object goes.
    run(api.clone()).await;
    assert!(api.get_opt("f").await.unwrap().is_none());
}

#[tokio::test]
async fn status_subresource_and_generation() {
    let s = server().await;
    s.register_crd(&dataset_ar(), true);
    let api: Api<DynamicObject> = Api::namespaced_with(s.client().unwrap(), "ml", &dataset_ar());
    let mut ds = DynamicObject::new("ds", &dataset_ar());
    ds.data = json!({"spec": {"source": {"key": "a/b"}}, "status": {"phase": "Ready"}});
    let created = api.create(&PostParams::default(), &ds).await.unwrap();
    assert!(created.data.get("status").is_none(), "create drops status");
    assert_eq!(created.metadata.generation, Some(1));

    let status = json!({"status": {"phase": "Seeding"}});
    let st = api
        .patch_status("ds", &PatchParams::default(), &Patch::Merge(&status))
        .await
        .unwrap();
    assert_eq!(st.data["status"]["phase"], "Seeding");
    assert_eq!(st.metadata.generation, Some(1));

    // A status write ignores the rest; a main write ignores status.
    let both = json!({"spec": {"source": {"key": "c/d"}}, "status": {"phase": "Failed"}});
    let st = api
        .patch_status("ds", &PatchParams::default(), &Patch::Merge(&both))
        .await
        .unwrap();
    assert_eq!(st.data["spec"]["source"]["key"], "a/b");
    assert_eq!(st.data["status"]["phase"], "Failed");
    let main = api
        .patch("ds", &PatchParams::default(), &Patch::Merge(&both))
        .await
        .unwrap();
    assert_eq!(main.data["spec"]["source"]["key"], "c/d");
    assert_eq!(main.data["status"]["phase"], "Failed");
    assert_eq!(
        main.metadata.generation,
        Some(2),
        "a spec change bumps generation"
    );
    let labelled = api
        .patch(
            "ds",
            &PatchParams::default(),
            &Patch::Merge(json!({"metadata": {"labels": {"x": "y"}}})),
        )
        .await
        .unwrap();
    assert_eq!(labelled.metadata.generation, Some(2), "metadata does not");

    // Replacing /status with a stale resourceVersion conflicts.
    let mut stale = created.clone();
    stale.data = json!({"status": {"phase": "Pending"}});
    let err = api
        .replace_status("ds", &PostParams::default(), &stale)
        .await
        .unwrap_err();
    assert_eq!(code(err), 409);
}

#[tokio::test]
async fn patches_and_apply() {
    let s = server().await;
    let api: Api<ConfigMap> = Api::namespaced(s.client().unwrap(), "default");
    let ssa = PatchParams::apply("test").force();

    // Server-side apply creates, then merges the applied object.
    let applied = json!({
        "apiVersion": "v1", "kind": "ConfigMap",
        "metadata": {"name": "ap", "labels": {"a": "1"}}, "data": {"x": "1"},
    });
    let c = api
        .patch("ap", &ssa, &Patch::Apply(&applied))
        .await
        .unwrap();
    assert_eq!(c.metadata.generation, Some(1));
    let again = json!({
        "apiVersion": "v1", "kind": "ConfigMap",
        "metadata": {"name": "ap", "labels": {"b": "2"}}, "data": {"y": "2"},
    });
    let c = api.patch("ap", &ssa, &Patch::Apply(&again)).await.unwrap();
    let labels = c.metadata.labels.unwrap();
    assert_eq!((labels["a"].as_str(), labels["b"].as_str()), ("1", "2"));
    assert_eq!(c.data.unwrap().len(), 2);

    // Merge patch: null removes.
    let rm = json!({"metadata": {"labels": {"a": null}}});
    let c = api
        .patch("ap", &PatchParams::default(), &Patch::Merge(&rm))
        .await
        .unwrap();
    assert!(!c.metadata.labels.unwrap().contains_key("a"));
    // Strategic merge patch, as a merge patch.
    let sp = json!({"data": {"z": "3"}});
    let c = api
        .patch("ap", &PatchParams::default(), &Patch::Strategic(&sp))
        .await
        .unwrap();
    assert_eq!(c.data.unwrap()["z"], "3");

    // JSON patch: a failing test is Invalid and changes nothing.
    let ops: json_patch::Patch = serde_json::from_value(json!([
        {"op": "test", "path": "/data/x", "value": "nope"},
        {"op": "replace", "path": "/data/x", "value": "9"},
    ]))
    .unwrap();
    let err = api
        .patch("ap", &PatchParams::default(), &Patch::<()>::Json(ops))
        .await
        .unwrap_err();
    assert_eq!(code(err), 422);
    let ops: json_patch::Patch = serde_json::from_value(json!([
        {"op": "test", "path": "/data/x", "value": "1"},
        {"op": "replace", "path": "/data/x", "value": "9"},
    ]))
    .unwrap();
    let c = api
        .patch("ap", &PatchParams::default(), &Patch::<()>::Json(ops))
        .await
        .unwrap();
    assert_eq!(c.data.unwrap()["x"], "9");

    // A merge patch carrying a stale resourceVersion conflicts.
    let stale = json!({"metadata": {"resourceVersion": "1"}, "data": {"x": "0"}});
    let err = api
        .patch("ap", &PatchParams::default(), &Patch::Merge(&stale))
        .await
        .unwrap_err();
    assert_eq!(code(err), 409);
    // Patching what is not there is NotFound.
    let err = api
        .patch("none", &PatchParams::default(), &Patch::Merge(&sp))
        .await
        .unwrap_err();
    assert_eq!(code(err), 404);
}

#[tokio::test]
async fn kubeconfig_token_rust_api_and_events() {
    let s = ApiServer::start(ApiServerConfig {
        token: Some("sesame".into()),
        ..ApiServerConfig::default()
    })
    .await
    .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("kubeconfig");
    s.kubeconfig(&path).unwrap();
    let kc = kube::config::Kubeconfig::read_from(&path).unwrap();
    let config = kube::Config::from_custom_kubeconfig(kc, &Default::default())
        .await
        .unwrap();
    assert_eq!(config.default_namespace, "default");
    let client = kube::Client::try_from(config).unwrap();
    let nodes: Api<Node> = Api::all(client.clone());

    // The Rust API writes status as given (a kubelet's view).
    let node: Node = serde_json::from_value(json!({
        "apiVersion": "v1", "kind": "Node",
        "metadata": {"name": "node-1", "labels": {"kubernetes.io/hostname": "node-1"}},
        "status": {"conditions": [{"type": "Ready", "status": "True"}]},
    }))
    .unwrap();
    s.put(&node).unwrap();
    let got = nodes.get("node-1").await.unwrap();
    assert_eq!(got.status.unwrap().conditions.unwrap()[0].status, "True");
    s.modify("v1", "Node", None, "node-1", |n| {
        n["status"]["conditions"][0]["status"] = "False".into();
    })
    .unwrap();
    let typed: Node = s.get(None, "node-1").unwrap().unwrap();
    assert_eq!(typed.status.unwrap().conditions.unwrap()[0].status, "False");
    assert_eq!(s.list_values("v1", "Node", None).unwrap().len(), 1);
    assert!(s.delete("v1", "Node", None, "node-1").unwrap());
    assert!(s.get::<Node>(None, "node-1").unwrap().is_none());

    // No token: 401.
    let bare = kube::Client::try_from(kube::Config::new(s.url().parse().unwrap())).unwrap();
    let err = Api::<Node>::all(bare)
        .list(&ListParams::default())
        .await
        .unwrap_err();
    assert_eq!(code(err), 401);

    // Discovery and the events Recorder (create, then patch on repeat).
    let discovery = kube::Discovery::new(client.clone())
        .filter(&["", "events.k8s.io"])
        .run()
        .await
        .unwrap();
    assert!(discovery.has_group("events.k8s.io"));
    let reporter = kube::runtime::events::Reporter {
        controller: "test".into(),
        instance: None,
    };
    let recorder = kube::runtime::events::Recorder::new(client.clone(), reporter);
    let pod_ref = k8s_openapi::api::core::v1::ObjectReference {
        api_version: Some("v1".into()),
        kind: Some("Pod".into()),
        name: Some("p".into()),
        namespace: Some("default".into()),
        ..Default::default()
    };
    let ev = kube::runtime::events::Event {
        type_: kube::runtime::events::EventType::Warning,
        reason: "Bad".into(),
        note: Some("bad source".into()),
        action: "Reconcile".into(),
        secondary: None,
    };
    recorder.publish(&ev, &pod_ref).await.unwrap();
    recorder.publish(&ev, &pod_ref).await.unwrap();
    let events: Api<k8s_openapi::api::events::v1::Event> = Api::namespaced(client, "default");
    let list = events.list(&ListParams::default()).await.unwrap();
    assert_eq!(list.items.len(), 1);
    assert_eq!(list.items[0].reason.as_deref(), Some("Bad"));
    assert!(
        list.items[0].series.is_some(),
        "the repeat patched a series in"
    );
}

#[test]
fn builtins_have_status_where_kubernetes_does() {
    let b = Resource::builtins();
    let find = |p: &str| b.iter().find(|r| r.plural == p).unwrap();
    assert!(find("pods").status && find("pods").namespaced);
    assert!(find("nodes").status && !find("nodes").namespaced);
    assert!(!find("configmaps").status);
    assert_eq!(find("configmaps").short_names, vec!["cm".to_owned()]);
}

#[tokio::test]
async fn https_with_a_generated_ca() {
    let s = ApiServer::start(ApiServerConfig {
        tls: true,
        token: Some("sesame".into()),
        ..ApiServerConfig::default()
    })
    .await
    .unwrap();
    assert!(s.url().starts_with("https://127.0.0.1:"), "{}", s.url());
    assert!(s.ca_pem().unwrap().contains("BEGIN CERTIFICATE"));
    let api: Api<ConfigMap> = Api::namespaced(s.client().unwrap(), "default");
    api.create(&PostParams::default(), &cm("t", "1"))
        .await
        .unwrap();

    // Another process's view: the kubeconfig carries the CA and the token.
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("kubeconfig");
    s.kubeconfig(&path).unwrap();
    let kc = kube::config::Kubeconfig::read_from(&path).unwrap();
    let config = kube::Config::from_custom_kubeconfig(kc, &Default::default())
        .await
        .unwrap();
    let via_file: Api<ConfigMap> =
        Api::namespaced(kube::Client::try_from(config).unwrap(), "default");
    assert_eq!(via_file.get("t").await.unwrap().data, cm("t", "1").data);

    // A client that does not trust the CA cannot talk to it.
    let mut untrusting = kube::Config::new(s.url().parse().unwrap());
    untrusting.auth_info.token = Some("sesame".to_owned().into());
    let err = Api::<ConfigMap>::namespaced(kube::Client::try_from(untrusting).unwrap(), "default")
        .get("t")
        .await
        .unwrap_err();
    assert!(!matches!(err, kube::Error::Api(_)), "{err:?}");
}
