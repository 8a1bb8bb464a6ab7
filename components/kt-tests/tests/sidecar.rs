//! A pod whose node agent is run for it (a sidecar, a testbed's supervisor:
//! `KT_AGENT_AUTOSTART=0`) and whose workload holds a workload token, the
//! agent an agent token. When a `kt` call finds the agent down for a moment
//! (it is being restarted), `kt` waits for it to come back; it never starts
//! an agent of its own, which would present the workload's token and be
//! refused by the metadata server as an agent ("a workload token may not
//! call PUT /api/v1/keys/...", 403) for as long as it ran — the chaos
//! soak's 403s.

use std::task::Poll;

use kt_client::agent::AgentConn;
use kt_service::{Auth, Token};
use kt_tests::{Cluster, write_files};
use kt_types::Key;
use kt_types::api::PutOptions;

const AGENT: &str = "agent-token-pod-a-0123";
const WORKLOAD: &str = "workload-token-0123456";

fn roles(dir: &std::path::Path) -> Auth {
    let file = format!(
        r#"{{"tokens": [{{"token": "{AGENT}", "role": "agent", "name": "pod-a"}},
                        {{"token": "{WORKLOAD}", "role": "workload"}}]}}"#
    );
    let path = dir.join("auth.json");
    std::fs::write(&path, file).unwrap();
    Auth::from_file(&path).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_call_that_finds_the_pods_agent_restarting_waits_for_it_and_starts_none() {
    let roles_dir = tempfile::tempdir().unwrap();
    let cluster = Cluster::start_authed(Some(roles(roles_dir.path())), |_| {}).await;
    let mut agent = cluster
        .start_agent_with("pod-a", |c| c.server.token = Token::new(AGENT).unwrap())
        .await;
    let socket = agent.socket().to_owned();
    let client = cluster.client_with(|c| {
        c.token = WORKLOAD.into();
        c.agent_socket = socket.clone();
        c.agent_autostart = false;
    });
    write_files(
        cluster.dir.path(),
        &[("src/a", b"alpha"), ("src/b", b"beta")],
    );
    let src = cluster.dir.path().join("src");
    let key = Key::parse("pod/shard").unwrap();
    let url = cluster.metadata_url();

    let mut put = None;
    let mut early = None;
    agent
        .restart_after(async {
            // The race, forced: a connection attempt that has already found
            // no agent (polled once: its first connect failed, it waits)...
            let mut waiting = Box::pin(AgentConn::connect_or_start_as(
                &socket, &url, WORKLOAD, false,
            ));
            let first = futures::poll!(waiting.as_mut());
            assert!(
                matches!(first, Poll::Pending),
                "with the agent down, the call waits for it (got {:?})",
                first.map(|r| r.map(|c| c.id))
            );
            early = Some(waiting);
            // ... and a local put under way while the agent is down.
            let (client, src, key) = (client.clone(), src.clone(), key.clone());
            put = Some(tokio::spawn(async move {
                client.put_local(&key, &src, PutOptions::default()).await
            }));
        })
        .await;

    // Both reach the agent the pod runs, not one kt started.
    let conn = early
        .unwrap()
        .await
        .expect("the pod's agent, once it is back");
    assert_eq!(conn.id, "pod-a");
    let summary = put
        .unwrap()
        .await
        .unwrap()
        .expect("the local put rides through the agent's restart");
    let record = summary.record.expect("the put registered the key");
    assert_eq!(record.holder, "pod-a");
    assert_eq!(client.stat(&key).await.unwrap().holder, "pod-a");
    // kt started no agent: one would have logged beside the socket.
    assert!(
        !socket.with_extension("log").exists(),
        "kt started an agent of its own"
    );
    // The agent's registrations keep working (no 403 later either).
    let again = client
        .put_local(&key, &src, PutOptions::default())
        .await
        .expect("a second local put");
    assert_eq!(again.record.unwrap().holder, "pod-a");
    agent.stop().await;
    cluster.stop().await;
}
