//! The `kind` target: Kubernetes in Docker. Everything but the cluster's own
//! commands is in [`super::cluster`]; the cluster is made from
//! `testbed/kind/cluster.yaml`.

use std::path::Path;

use super::cluster::Flavor;
use super::cluster::shell::Cmd;

#[derive(Debug, Default, Clone, Copy)]
pub struct Kind;

impl Flavor for Kind {
    fn name(&self) -> &'static str {
        "kind"
    }

    fn tool(&self) -> &'static str {
        "kind"
    }

    fn list(&self) -> Cmd {
        Cmd::new("kind").args(["get", "clusters"])
    }

    fn cluster_names(&self, stdout: &str) -> Vec<String> {
        stdout
            .lines()
            .map(str::trim)
            .filter(|l| !l.is_empty())
            .map(String::from)
            .collect()
    }

    fn create(&self, name: &str, config: &Path, kubeconfig: &Path) -> Cmd {
        Cmd::new("kind").args([
            "create".to_owned(),
            "cluster".to_owned(),
            "--name".to_owned(),
            name.to_owned(),
            "--config".to_owned(),
            config.display().to_string(),
            // Written there instead of the user's kubeconfig.
            "--kubeconfig".to_owned(),
            kubeconfig.display().to_string(),
            "--wait".to_owned(),
            "180s".to_owned(),
        ])
    }

    fn kubeconfig(&self, name: &str) -> Cmd {
        Cmd::new("kind").args(["get", "kubeconfig", "--name", name])
    }

    fn load_images(&self, name: &str, images: &[String]) -> Cmd {
        Cmd::new("kind")
            .args(["load", "docker-image"])
            .args(images.iter().cloned())
            .args(["--name", name])
    }

    fn delete(&self, name: &str) -> Cmd {
        Cmd::new("kind").args(["delete", "cluster", "--name", name])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cluster_names_are_the_lines_of_get_clusters() {
        assert_eq!(
            Kind.cluster_names("kind\nkt-scenario\n"),
            ["kind", "kt-scenario"]
        );
        assert!(Kind.cluster_names("").is_empty());
    }
}
