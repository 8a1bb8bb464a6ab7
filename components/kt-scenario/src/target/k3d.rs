//! The `k3d` target: k3s in Docker. Everything but the cluster's own
//! commands is in [`super::cluster`]; the cluster is made from
//! `testbed/k3d/config.yaml` (a k3d Simple config).

use std::path::Path;

use super::cluster::Flavor;
use super::cluster::shell::Cmd;

#[derive(Debug, Default, Clone, Copy)]
pub struct K3d;

impl Flavor for K3d {
    fn name(&self) -> &'static str {
        "k3d"
    }

    fn tool(&self) -> &'static str {
        "k3d"
    }

    fn list(&self) -> Cmd {
        Cmd::new("k3d").args(["cluster", "list", "-o", "json"])
    }

    fn cluster_names(&self, stdout: &str) -> Vec<String> {
        let v: serde_json::Value = serde_json::from_str(stdout).unwrap_or_default();
        v.as_array()
            .into_iter()
            .flatten()
            .filter_map(|c| c["name"].as_str().map(String::from))
            .collect()
    }

    fn create(&self, name: &str, config: &Path, _kubeconfig: &Path) -> Cmd {
        // The name given here wins over the config's `metadata.name`; the
        // user's kubeconfig is left alone (the session asks for ours).
        Cmd::new("k3d").args([
            "cluster".to_owned(),
            "create".to_owned(),
            name.to_owned(),
            "--config".to_owned(),
            config.display().to_string(),
            "--kubeconfig-update-default=false".to_owned(),
            "--kubeconfig-switch-context=false".to_owned(),
            "--wait".to_owned(),
            "--timeout".to_owned(),
            "180s".to_owned(),
        ])
    }

    fn kubeconfig(&self, name: &str) -> Cmd {
        Cmd::new("k3d").args(["kubeconfig", "get", name])
    }

    fn load_images(&self, name: &str, images: &[String]) -> Cmd {
        Cmd::new("k3d")
            .args(["image", "import"])
            .args(images.iter().cloned())
            .args(["--cluster", name])
    }

    fn delete(&self, name: &str) -> Cmd {
        Cmd::new("k3d").args(["cluster", "delete", name])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cluster_names_come_from_the_json_listing() {
        let out = r#"[{"name":"kt-scenario","serversRunning":1},{"name":"other"}]"#;
        assert_eq!(K3d.cluster_names(out), ["kt-scenario", "other"]);
        assert!(K3d.cluster_names("").is_empty());
    }
}
