//! The webhook's injection against the kustomize components it stands in
//! for: the workloads of `kustomize/examples/trainer` (a Deployment, a Job,
//! a CronJob; agent-sidecar then agent-identity), their pods injected from
//! the committed template, equal the pod templates kustomize rendered for
//! them into `manifests/examples/trainer.yaml`. Both come from the same
//! components (`make manifests` regenerates the template and the
//! rendering; `make manifests-check` fails when either drifts).

use kt_kube::inject::{PatchOp, Template, patch};
use kt_types::env;
use serde_json::{Value, json};

use kt_kube::mock::{repo_docs as docs, repo_file as read};

/// The committed template with the agent image of agent-image.env, as the
/// bundle gives kt-metadata both.
fn template() -> Template {
    let env = read("kustomize/components/sidecar-injector/agent-image.env");
    let image = env
        .lines()
        .find_map(|l| l.strip_prefix("agent-image="))
        .expect("agent-image.env has agent-image=");
    let t =
        Template::from_yaml(&read("kustomize/components/sidecar-injector/template.yaml")).unwrap();
    assert_eq!(
        t.agent_image(),
        None,
        "the image is kept out of the template"
    );
    t.with_agent_image(image)
}

fn pod_template(workload: &Value) -> &Value {
    match workload["kind"].as_str() {
        Some("CronJob") => &workload["spec"]["jobTemplate"]["spec"]["template"],
        _ => &workload["spec"]["template"],
    }
}

fn apply(pod: &Value, ops: &[PatchOp]) -> Value {
    let p: json_patch::Patch = serde_json::from_value(serde_json::to_value(ops).unwrap()).unwrap();
    let mut out = pod.clone();
    json_patch::patch(&mut out, &p).unwrap();
    out
}

#[test]
fn pods_injected_by_the_webhook_equal_what_the_components_render() {
    let t = template();
    let rendered = docs("manifests/examples/trainer.yaml");
    let mut seen = 0;
    for file in ["deployment.yaml", "job.yaml", "cronjob.yaml"] {
        for source in docs(&format!("kustomize/examples/trainer/{file}")) {
            let name = source["metadata"]["name"].as_str().unwrap().to_owned();
            let tpl = pod_template(&source);
            let pod = json!({
                "apiVersion": "v1",
                "kind": "Pod",
                "metadata": tpl["metadata"],
                "spec": tpl["spec"],
            });
            let ops = patch(&pod, &t).unwrap();
            let injected = apply(&pod, &ops);
            let want = rendered
                .iter()
                .find(|d| d["metadata"]["name"] == name.as_str() && d["kind"] == source["kind"])
                .unwrap_or_else(|| panic!("{name} is not in manifests/examples/trainer.yaml"));
            let want = pod_template(want);
            assert_eq!(
                injected["metadata"], want["metadata"],
                "{name}: pod metadata"
            );
            assert_eq!(injected["spec"], want["spec"], "{name}: pod spec");
            // And the rendering passes through unchanged (kustomize's pods
            // have their agent).
            let kustomized = json!({"metadata": want["metadata"], "spec": want["spec"]});
            assert_eq!(patch(&kustomized, &t).unwrap(), [], "{name}");
            seen += 1;
        }
    }
    assert_eq!(seen, 3);
}

#[test]
fn the_agent_is_a_native_sidecar_with_the_pinned_image() {
    let t = template();
    let pod = json!({"spec": {"containers": [{"name": "app", "image": "app"}]}});
    let out = apply(&pod, &patch(&pod, &t).unwrap());
    let agent = &out["spec"]["initContainers"][0];
    assert_eq!(agent["name"], "kt-agent");
    assert_eq!(agent["restartPolicy"], "Always");
    assert!(
        agent["image"]
            .as_str()
            .unwrap()
            .starts_with("ghcr.io/kt-dev/kt-agent:"),
        "{agent}"
    );
    let env: Vec<&str> = out["spec"]["containers"][0]["env"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["name"].as_str().unwrap())
        .collect();
    for want in [
        env::AGENT_SOCKET,
        env::METADATA_URL,
        env::TOKEN_FILE,
        env::POD_IP,
        env::AGENT_AUTOSTART,
    ] {
        assert!(env.contains(&want), "{want} missing: {env:?}");
    }
    let token = out["spec"]["volumes"]
        .as_array()
        .unwrap()
        .iter()
        .find(|v| v["name"] == "kt-token")
        .unwrap();
    assert_eq!(
        token["projected"]["sources"][0]["serviceAccountToken"]["audience"],
        "kt"
    );
    assert_eq!(out["spec"]["shareProcessNamespace"], true);
    assert_eq!(out["spec"]["enableServiceLinks"], false);
}
