//! The store's advertised URL in the rendered bundle, as the bundle
//! target's kubelet gives it (`$(POD_NAMESPACE)` from the downward API),
//! names a DNS name the bundle target serves for the store's pod: every
//! client of the store reaches it by that URL, from kt's namespace and
//! from others (`kt-store.<namespace>.svc`).

use std::path::Path;

use kt_scenario::target::bundle::install::{Downward, Install, environment};

fn advertised(rendered: &str) -> (String, Vec<String>) {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../manifests")
        .join(rendered);
    let yaml = std::fs::read_to_string(&path).expect("rendered install (make manifests)");
    let install = Install::parse(&yaml).expect("install");
    let pod = install
        .pods
        .iter()
        .find(|p| p.owner == "StatefulSet/kt-store")
        .expect("the store's pod");
    let store = pod
        .spec
        .containers
        .iter()
        .find(|c| c.name == "kt-store")
        .expect("kt-store container");
    let down = Downward {
        pod,
        pod_ip: "10.1.0.5".into(),
        node: "node".into(),
        api_host: "10.1.0.1".into(),
        api_port: 6443,
        service_addrs: Vec::new(),
    };
    let env = environment(store, &down, &install).expect("environment");
    let url = env
        .iter()
        .find(|(k, _)| k == kt_types::env::ADVERTISE_URL)
        .map(|(_, v)| v.clone())
        .expect("the store's advertised URL");
    (url, install.dns_names(pod).expect("dns names"))
}

#[test]
fn the_store_advertises_a_namespace_qualified_name_the_target_resolves() {
    for rendered in ["kind.yaml", "production.yaml"] {
        let (url, names) = advertised(rendered);
        assert_eq!(url, "http://kt-store.kt.svc:8082", "{rendered}");
        let host = url
            .trim_start_matches("http://")
            .split(':')
            .next()
            .unwrap_or_default();
        assert!(
            names.iter().any(|n| n == host),
            "{rendered}: {host} not in {names:?}"
        );
    }
}
