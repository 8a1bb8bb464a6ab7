//! Who may call what: roles, and the tokens file that grants them.
//!
//! Every API call presents a bearer token; the server resolves it to a
//! [`Principal`] and each route allows some roles (`admin` every one):
//!
//! - `store`: the store server (registers itself, registers the keys it
//!   committed);
//! - `agent`: a node agent, as the one agent it is named (heartbeats,
//!   keys it holds, quorums, other agents' tensor sessions);
//! - `workload`: an application (put, get, ls, rm, teardown, broadcasts),
//!   within the services it is given;
//! - `admin`: everything (operators, the metadata server's calls to the
//!   store, the scenario runner's probes).
//!
//! Outside a cluster the grants come from a tokens file ([`AuthFile`],
//! `--auth-file`); `KT_TOKEN` alone keeps meaning admin, for the
//! one-command local setup.

use serde::{Deserialize, Serialize};

/// What a token may do.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Role {
    /// Everything.
    Admin,
    /// The store server.
    Store,
    /// A node agent (named).
    Agent,
    /// An application (within its services).
    Workload,
}

impl Role {
    /// The name in files and messages.
    pub fn as_str(self) -> &'static str {
        match self {
            Role::Admin => "admin",
            Role::Store => "store",
            Role::Agent => "agent",
            Role::Workload => "workload",
        }
    }

    /// Every role (tests walk them).
    pub const ALL: [Role; 4] = [Role::Admin, Role::Store, Role::Agent, Role::Workload];
}

impl std::fmt::Display for Role {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Who a request comes from, as its token says.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Principal {
    /// Its role.
    pub role: Role,
    /// An agent's id (the pod name); `None` for the other roles.
    pub name: Option<String>,
    /// A workload's services; `None`: every service.
    pub services: Option<Vec<String>>,
}

impl Principal {
    /// The principal of `KT_TOKEN` alone.
    pub fn admin() -> Principal {
        Principal {
            role: Role::Admin,
            name: None,
            services: None,
        }
    }

    /// Whether it may touch the keys of `service`.
    pub fn serves(&self, service: &str) -> bool {
        self.role == Role::Admin
            || self
                .services
                .as_ref()
                .is_none_or(|s| s.iter().any(|x| x == service))
    }

    /// Whether it is agent `id` (or an admin).
    pub fn is_agent(&self, id: &str) -> bool {
        self.role == Role::Admin || (self.role == Role::Agent && self.name.as_deref() == Some(id))
    }
}

/// The tokens file (`--auth-file`, JSON): `{"tokens": [{"token": "...",
/// "role": "agent", "name": "pod-a"}, ...]}`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AuthFile {
    /// Every token the server accepts.
    pub tokens: Vec<Grant>,
}

/// One token of an [`AuthFile`] and what it may do.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Grant {
    /// The bearer token: 16 to 4096 printable characters, no spaces.
    pub token: String,
    /// Its role.
    pub role: Role,
    /// An agent token's agent id (required for `agent`, refused otherwise).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    /// A workload token's services (absent: every service; refused for
    /// other roles).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub services: Option<Vec<String>>,
}

impl Grant {
    /// What the token resolves to.
    pub fn principal(&self) -> Principal {
        Principal {
            role: self.role,
            name: self.name.clone(),
            services: self.services.clone(),
        }
    }
}

impl AuthFile {
    /// Checks every grant: token shape, unique tokens, a name for (and
    /// only for) agents, services for workloads only.
    pub fn validate(&self) -> Result<(), String> {
        if self.tokens.is_empty() {
            return Err("the tokens file grants no token".into());
        }
        let mut seen = std::collections::HashSet::new();
        for (i, g) in self.tokens.iter().enumerate() {
            let at = format!("tokens[{i}] ({})", g.role);
            let t = &g.token;
            if t.len() < 16 || t.len() > 4096 || !t.bytes().all(|b| b.is_ascii_graphic()) {
                return Err(format!(
                    "{at}: a token is 16 to 4096 printable characters without spaces"
                ));
            }
            if !seen.insert(t.as_str()) {
                return Err(format!("{at}: the same token is granted twice"));
            }
            match (g.role, &g.name) {
                (Role::Agent, None) => {
                    return Err(format!("{at}: an agent token names its agent (name)"));
                }
                (Role::Agent, Some(n)) => {
                    if let Some(why) = crate::agent_id_problem(n) {
                        return Err(format!("{at}: {why}"));
                    }
                }
                (_, Some(_)) => return Err(format!("{at}: only agent tokens have a name")),
                (_, None) => {}
            }
            if let Some(s) = &g.services {
                if g.role != Role::Workload {
                    return Err(format!("{at}: only workload tokens have services"));
                }
                if s.iter().any(|x| x.is_empty() || x.len() > 253) {
                    return Err(format!("{at}: a service name is 1 to 253 characters"));
                }
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn grant(role: Role, name: Option<&str>, services: Option<&[&str]>) -> Grant {
        Grant {
            token: format!("token-of-{role}-0123456789"),
            role,
            name: name.map(str::to_owned),
            services: services.map(|s| s.iter().map(|x| x.to_string()).collect()),
        }
    }

    #[test]
    fn tokens_files_are_checked() {
        let ok = AuthFile {
            tokens: vec![
                grant(Role::Store, None, None),
                grant(Role::Agent, Some("pod-a"), None),
                grant(Role::Workload, None, Some(&["train"])),
                grant(Role::Admin, None, None),
            ],
        };
        ok.validate().unwrap();
        let bad = |g: Grant, what: &str| {
            let e = AuthFile { tokens: vec![g] }.validate().unwrap_err();
            assert!(e.contains(what), "{e}");
        };
        bad(grant(Role::Agent, None, None), "names its agent");
        bad(grant(Role::Store, Some("s"), None), "only agent tokens");
        bad(
            grant(Role::Agent, Some("pod-a"), Some(&["x"])),
            "only workload",
        );
        bad(grant(Role::Agent, Some("pod a"), None), "agent id");
        let mut short = grant(Role::Admin, None, None);
        short.token = "short".into();
        bad(short, "16 to 4096");
        let twice = AuthFile {
            tokens: vec![
                grant(Role::Store, None, None),
                grant(Role::Store, None, None),
            ],
        };
        assert!(twice.validate().unwrap_err().contains("twice"));
        let parsed: AuthFile = serde_json::from_str(
            r#"{"tokens":[{"token":"aaaaaaaaaaaaaaaaaaaa","role":"agent","name":"pod-1"}]}"#,
        )
        .unwrap();
        parsed.validate().unwrap();
        assert!(serde_json::from_str::<AuthFile>(r#"{"tokens":[],"x":1}"#).is_err());
    }

    #[test]
    fn principals_say_what_they_may_touch() {
        let w = grant(Role::Workload, None, Some(&["train"])).principal();
        assert!(w.serves("train") && !w.serves("eval"));
        assert!(grant(Role::Workload, None, None).principal().serves("eval"));
        assert!(Principal::admin().serves("anything") && Principal::admin().is_agent("pod-a"));
        let a = grant(Role::Agent, Some("pod-a"), None).principal();
        assert!(a.is_agent("pod-a") && !a.is_agent("pod-b"));
        assert!(!w.is_agent("pod-a"));
    }
}
