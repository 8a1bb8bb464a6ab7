//! Per-component tokens of the process and docker testbeds (local, netns,
//! docker): the library runs with least privilege, so every scenario
//! proves the roles hold (`kt_types::auth`).
//!
//! The run's token stays the admin's (the runner's probes, the metadata
//! server's calls to the store); the store gets a `store` token, each pod's
//! agent an `agent` token naming it, and every command in a pod its pod's
//! `workload` token. A pod with a service writes only that service and the
//! scenario's own (`{{scenario}}/...` keys, the scenario's name being their
//! first segment), and its agent registers local keys of those only; a pod
//! without one writes every service. The servers and
//! agents accept exactly those, from a tokens file in the run's work
//! directory (`--auth-file`). A command the runner gives another token (a
//! scenario testing a wrong one) keeps it.

use std::collections::HashMap;
use std::path::PathBuf;

use kt_types::auth::{AuthFile, Grant, Role};

use super::{ExecRequest, Plan, TargetError};

/// The tokens of one run.
#[derive(Debug, Clone)]
pub struct Roles {
    file: PathBuf,
    admin: String,
    /// Each pod's workload token.
    workloads: HashMap<String, String>,
}

impl Roles {
    /// Writes the run's tokens file (mode 0600) for `plan`'s pods.
    pub fn write(plan: &Plan) -> Result<Roles, TargetError> {
        let admin = plan.token.clone();
        let roles = Roles {
            file: plan.work_dir.join("auth.json"),
            workloads: plan
                .pods
                .iter()
                .map(|p| (p.name.clone(), format!("{admin}-workload-{}", p.name)))
                .collect(),
            admin,
        };
        let grant = |token: String, role, name: Option<String>| Grant {
            token,
            role,
            name,
            services: None,
            reads: None,
        };
        let mut tokens = vec![
            grant(roles.admin.clone(), Role::Admin, None),
            grant(roles.store(), Role::Store, None),
        ];
        for p in &plan.pods {
            let mut services = p.service.iter().cloned().collect::<Vec<_>>();
            if !services.is_empty() && !services.contains(&plan.scenario) {
                services.push(plan.scenario.clone());
            }
            let services = (!services.is_empty()).then_some(services);
            tokens.push(Grant {
                services: services.clone(),
                ..grant(roles.workloads[&p.name].clone(), Role::Workload, None)
            });
            // Its agent registers local keys of the same services only.
            tokens.push(Grant {
                services,
                ..grant(roles.agent(&p.name), Role::Agent, Some(p.name.clone()))
            });
        }
        let file = AuthFile { tokens };
        file.validate()
            .map_err(|e| TargetError::Failed(format!("the run's tokens file: {e}")))?;
        let text = serde_json::to_vec_pretty(&file)
            .map_err(|e| TargetError::Failed(format!("the run's tokens file: {e}")))?;
        write_private(&roles.file, &text)
            .map_err(|e| TargetError::Failed(format!("{}: {e}", roles.file.display())))?;
        Ok(roles)
    }

    fn store(&self) -> String {
        format!("{}-store", self.admin)
    }

    fn agent(&self, pod: &str) -> String {
        format!("{}-agent-{pod}", self.admin)
    }

    fn server_env(&self, token: String) -> Vec<(String, String)> {
        vec![
            (kt_types::env::TOKEN.to_owned(), token),
            (
                kt_types::env::AUTH_FILE.to_owned(),
                self.file.display().to_string(),
            ),
        ]
    }

    /// The metadata server's environment: admin (it deletes at the store).
    pub fn metadata_env(&self) -> Vec<(String, String)> {
        self.server_env(self.admin.clone())
    }

    /// The store's environment.
    pub fn store_env(&self) -> Vec<(String, String)> {
        self.server_env(self.store())
    }

    /// The environment of `pod`'s agent (its token names it).
    pub fn agent_env(&self, pod: &str) -> Vec<(String, String)> {
        self.server_env(self.agent(pod))
    }

    /// `req` as a pod's command: the run's token becomes the pod's
    /// workload token.
    pub fn in_pod(&self, req: &ExecRequest) -> ExecRequest {
        let mut r = req.clone();
        if r.token.as_deref() == Some(self.admin.as_str())
            && let Some(w) = self.workloads.get(&req.pod)
        {
            r.token = Some(w.clone());
        }
        r
    }
}

fn write_private(path: &std::path::Path, bytes: &[u8]) -> std::io::Result<()> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .open(path)?;
    f.write_all(bytes)
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use super::*;
    use crate::target::{PodPlan, Program};

    #[test]
    fn each_component_gets_its_own_role_and_pods_the_workloads() {
        let dir = tempfile::tempdir().unwrap();
        let pod = |name: &str| PodPlan {
            name: name.into(),
            group: "pod".into(),
            index: 0,
            service: None,
            labels: BTreeMap::new(),
            gpu: false,
            link_bps: None,
            node: None,
        };
        let plan = Plan {
            run_id: "r".into(),
            scenario: "s".into(),
            work_dir: dir.path().to_owned(),
            bin_dir: dir.path().to_owned(),
            token: "kt-scenario-0123456789".into(),
            chunk_size: None,
            store_link_bps: None,
            metadata_flags: vec![],
            pods: vec![
                pod("a"),
                PodPlan {
                    service: Some("train".into()),
                    ..pod("b")
                },
            ],
            python: None,
            nodes: None,
            s3: None,
        };
        let roles = Roles::write(&plan).unwrap();
        let file: AuthFile =
            serde_json::from_slice(&std::fs::read(dir.path().join("auth.json")).unwrap()).unwrap();
        type Granted<'a> = (Role, Option<&'a str>, Option<Vec<String>>);
        let granted: Vec<Granted> = file
            .tokens
            .iter()
            .map(|g| (g.role, g.name.as_deref(), g.services.clone()))
            .collect();
        // Pod b has a service: its workload writes it and the scenario's keys.
        let svc = |s: &[&str]| Some(s.iter().map(|x| x.to_string()).collect());
        assert_eq!(
            granted,
            [
                (Role::Admin, None, None),
                (Role::Store, None, None),
                (Role::Workload, None, None),
                (Role::Agent, Some("a"), None),
                (Role::Workload, None, svc(&["train", "s"])),
                (Role::Agent, Some("b"), svc(&["train", "s"])),
            ]
        );
        assert_eq!(
            file.tokens[0].token, plan.token,
            "the runner's probes are admin"
        );
        use std::os::unix::fs::PermissionsExt;
        let mode = std::fs::metadata(dir.path().join("auth.json"))
            .unwrap()
            .permissions()
            .mode();
        assert_eq!(mode & 0o777, 0o600);
        let token_of = |env: Vec<(String, String)>| {
            env.into_iter()
                .find(|(k, _)| k == kt_types::env::TOKEN)
                .map(|(_, v)| v)
                .unwrap()
        };
        assert_eq!(token_of(roles.agent_env("b")), file.tokens[5].token);
        assert_eq!(token_of(roles.store_env()), file.tokens[1].token);
        assert_eq!(token_of(roles.metadata_env()), plan.token);
        // Pod commands run as their pod's workload, unless a scenario hands
        // a command another token on purpose.
        let req = |token: Option<&str>| ExecRequest {
            pod: "a".into(),
            program: Program::Kt,
            args: vec![],
            env: vec![],
            token: token.map(str::to_owned),
        };
        assert_eq!(
            roles.in_pod(&req(Some(&plan.token))).token.as_deref(),
            Some(file.tokens[2].token.as_str())
        );
        assert_eq!(
            roles.in_pod(&req(Some("wrong"))).token.as_deref(),
            Some("wrong")
        );
        assert_eq!(roles.in_pod(&req(None)).token, None);
        let in_b = ExecRequest {
            pod: "b".into(),
            ..req(Some(&plan.token))
        };
        assert_eq!(
            roles.in_pod(&in_b).token.as_deref(),
            Some(file.tokens[4].token.as_str())
        );
    }
}
