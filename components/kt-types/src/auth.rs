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
//!   within the services it is given: it writes only its `services`, and
//!   reads every service unless it is given `reads` (then only its
//!   services and those);
//! - `pod`: a workload pod and its sidecar agent, which share the pod's
//!   ServiceAccount token (the pod is the trust boundary): what the
//!   agent named after the pod and a workload within its services may do;
//! - `metrics`: `/metrics` of every server and nothing else (Prometheus);
//! - `admin`: everything (operators, the metadata server's calls to the
//!   store, the scenario runner's probes).
//!
//! Outside a cluster the grants come from a tokens file ([`AuthFile`],
//! `--auth-file`); `KT_TOKEN` alone keeps meaning admin, for the
//! one-command local setup. In a cluster (`--kube-auth`) callers present
//! projected ServiceAccount tokens, which the metadata server reviews with
//! the Kubernetes API and maps to principals with an [`AccessMap`].

use std::net::IpAddr;

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
    /// A workload pod with its sidecar agent (an agent named after the pod,
    /// and a workload within its services).
    Pod,
    /// A metrics scraper: `/metrics` alone.
    Metrics,
}

impl Role {
    /// The name in files and messages.
    pub fn as_str(self) -> &'static str {
        match self {
            Role::Admin => "admin",
            Role::Store => "store",
            Role::Agent => "agent",
            Role::Workload => "workload",
            Role::Pod => "pod",
            Role::Metrics => "metrics",
        }
    }

    /// Every role (tests walk them).
    pub const ALL: [Role; 6] = [
        Role::Admin,
        Role::Store,
        Role::Agent,
        Role::Workload,
        Role::Pod,
        Role::Metrics,
    ];

    /// Whether a route that allows `roles` lets this role through: admin
    /// always, a pod where agents or workloads may go.
    pub fn passes(self, roles: &[Role]) -> bool {
        match self {
            Role::Admin => true,
            Role::Pod => roles
                .iter()
                .any(|r| matches!(r, Role::Agent | Role::Workload | Role::Pod)),
            r => roles.contains(&r),
        }
    }
}

impl std::fmt::Display for Role {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Who a request comes from, as its token says.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Principal {
    /// Its role.
    pub role: Role,
    /// An agent's or a pod's id (the pod name); `None` for the other roles.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    /// A workload's or a pod's services (what it writes); `None`: every
    /// service.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub services: Option<Vec<String>>,
    /// The services it reads besides its own `services`; `None`: every
    /// service (keys are shared across services unless an operator says
    /// otherwise).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reads: Option<Vec<String>>,
    /// The pod's IP, when its token is bound to a pod: the URLs it
    /// advertises (agent, sources) must be on it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ip: Option<IpAddr>,
    /// Set for the bearer of a [`Capability`]: it reads this key's version
    /// at the source the capability names, and nothing else.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub scope: Option<Scope>,
}

/// What a [`Capability`] lets its bearer read.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Scope {
    /// The one key.
    pub key: crate::Key,
    /// The one version of it.
    pub version: String,
}

/// What a getter presents to a peer source (a node agent) instead of a
/// bearer token: minted by the metadata server with a source lease (or a
/// tensor grant, [`crate::tensor::TensorGrant`]), bound to one key's
/// version, one source and one getter, expiring soon, and signed (Ed25519)
/// so that the source checks it without calling back
/// (`kt_service::capability`). On the wire: `kt-cap.` + base64url(JSON of
/// this) + `.` + base64url(signature), without padding.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Capability {
    /// The key and version it reads.
    #[serde(flatten)]
    pub scope: Scope,
    /// The source it is valid at: the agent id.
    pub source: String,
    /// Who it was minted for: the getter's agent id (or role, for logs).
    /// A tensor session opened with it must name this agent
    /// (`SessionRequest::agent`).
    pub getter: String,
    /// The getter's pod IP, when the token it was minted for is bound to a
    /// pod: a tensor session opened with it must name this IP
    /// (`SessionRequest::ip`), as that token would have had to. Absent in
    /// file reads' capabilities.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ip: Option<IpAddr>,
    /// Unix milliseconds after which it is refused.
    pub expires_ms: u64,
    /// Which signing key signed it (the first 8 bytes of the blake3 of the
    /// public key, hex).
    pub kid: String,
}

impl Capability {
    /// The prefix of a capability on the wire (no bearer token has it).
    pub const PREFIX: &'static str = "kt-cap.";

    /// The principal its bearer is: a workload reading its scope only.
    pub fn principal(&self) -> Principal {
        Principal {
            role: Role::Workload,
            name: None,
            services: Some(Vec::new()),
            reads: Some(Vec::new()),
            ip: None,
            scope: Some(self.scope.clone()),
        }
    }
}

impl Principal {
    /// The principal of `KT_TOKEN` alone.
    pub fn admin() -> Principal {
        Principal {
            role: Role::Admin,
            name: None,
            services: None,
            reads: None,
            ip: None,
            scope: None,
        }
    }

    /// Whether it may touch (write) the keys of `service`.
    pub fn serves(&self, service: &str) -> bool {
        self.role == Role::Admin
            || self
                .services
                .as_ref()
                .is_none_or(|s| s.iter().any(|x| x == service))
    }

    /// The one service it writes, if it writes exactly one (not admin):
    /// where its puts go when they name no service, instead of the key's
    /// first segment (a pod's puts land in its pod's service).
    pub fn sole_service(&self) -> Option<&str> {
        match self.services.as_deref() {
            Some([one]) if self.role != Role::Admin => Some(one),
            _ => None,
        }
    }

    /// Whether it may read the keys of `service` (get, ls, broadcasts):
    /// every service unless it was given `reads`, then its own services
    /// and those.
    pub fn reads(&self, service: &str) -> bool {
        let listed =
            |l: &Option<Vec<String>>| l.as_ref().is_some_and(|l| l.iter().any(|x| x == service));
        self.role == Role::Admin
            || self.reads.is_none()
            || listed(&self.reads)
            || listed(&self.services)
    }

    /// Why it may not read `key`, which belongs to `service` (`None`: it
    /// may): the message of every refused read.
    pub fn refuses_read(&self, key: &crate::Key, service: &str) -> Option<String> {
        if let Some(scope) = &self.scope {
            return (scope.key != *key)
                .then(|| format!("this capability reads {} only, not {key}", scope.key));
        }
        if self.reads(service) {
            return None;
        }
        let mine: Vec<&String> = self
            .services
            .iter()
            .chain(self.reads.iter())
            .flatten()
            .collect();
        Some(format!(
            "this token may not read {key}: it belongs to service {service:?}, and the token reads only {mine:?}"
        ))
    }

    /// The service a write of `key` goes to: the one it names, else the
    /// one service this token writes (a pod's puts land in its pod's
    /// service), else the key's first segment.
    pub fn write_service(&self, key: &crate::Key, named: Option<&str>) -> String {
        named
            .or_else(|| self.sole_service())
            .unwrap_or_else(|| key.service())
            .to_owned()
    }

    /// Why it may not write `key` for `service` (`None`: it may, as far as
    /// its services go; [`Principal::refuses_takeover`] is the other
    /// rule): the message of every write refused so, at the store (a put)
    /// and the metadata server (a registration).
    pub fn refuses_write(&self, key: &crate::Key, service: &str) -> Option<String> {
        (!self.serves(service)).then(|| {
            format!(
                "this token may not write {key} for service {service:?} (not one of its services)"
            )
        })
    }

    /// Whether a write of `key` by it must first ask who owns the key:
    /// not for admin, a token that writes every service, or one writing
    /// the service the key's first segment names (its own base path).
    pub fn asks_owner(&self, key: &crate::Key) -> bool {
        !(self.role == Role::Admin || self.services.is_none() || self.serves(key.service()))
    }

    /// Why it may not write `key`, which `owner` owns (the service, and
    /// whether by its base path; `None`: no service owns it): a write
    /// would hand another service's key over. `None` when it may.
    pub fn refuses_takeover(
        &self,
        key: &crate::Key,
        owner: Option<(&str, bool)>,
    ) -> Option<String> {
        let (owner, base_path) = owner?;
        if !self.asks_owner(key) || self.serves(owner) {
            return None;
        }
        Some(if base_path {
            format!(
                "{key} is under the base path of service {owner:?}: only {owner:?} (or admin) writes there; nothing was changed"
            )
        } else {
            format!(
                "{key} belongs to service {owner:?}, not one of this token's: it is left as it is"
            )
        })
    }

    /// Whether it reads every service (nothing to look up before a read).
    pub fn reads_all(&self) -> bool {
        self.role == Role::Admin || (self.reads.is_none() && self.scope.is_none())
    }

    /// Whether it is agent `id` (or an admin): an agent token naming it,
    /// or the token of pod `id`.
    pub fn is_agent(&self, id: &str) -> bool {
        self.role == Role::Admin
            || (matches!(self.role, Role::Agent | Role::Pod) && self.name.as_deref() == Some(id))
    }

    /// Whether it may advertise `url` (its agent's, a source's): any URL
    /// unless its token is bound to a pod, then only on the pod's IP.
    pub fn may_advertise(&self, url: &str) -> bool {
        match self.ip {
            None => true,
            Some(ip) => url_ip(url) == Some(ip),
        }
    }
}

/// The IP literal a URL's host is (`http://10.0.0.7:8090/x`,
/// `http://[fd00::7]:8090`), if it is one.
pub fn url_ip(url: &str) -> Option<IpAddr> {
    let rest = url.split_once("://").map_or(url, |(_, r)| r);
    let authority = rest.split(['/', '?', '#']).next()?;
    let host = authority.rsplit_once('@').map_or(authority, |(_, h)| h);
    let host = match host.strip_prefix('[') {
        Some(v6) => v6.split_once(']')?.0,
        None => host.split(':').next()?,
    };
    host.parse().ok()
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
    /// A workload token's services, which it writes (absent: every
    /// service), or an agent token's, whose local keys it registers;
    /// refused for other roles.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub services: Option<Vec<String>>,
    /// The services a workload token reads besides its own (absent: every
    /// service; `[]`: its own only; refused for other roles).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reads: Option<Vec<String>>,
}

impl Grant {
    /// What the token resolves to.
    pub fn principal(&self) -> Principal {
        Principal {
            role: self.role,
            name: self.name.clone(),
            services: self.services.clone(),
            reads: self.reads.clone(),
            ip: None,
            scope: None,
        }
    }
}

impl AuthFile {
    /// Checks every grant: token shape, unique tokens, a name for (and
    /// only for) agents, services for workloads and agents, reads for
    /// workloads and agents.
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
                (Role::Agent | Role::Pod, None) => {
                    return Err(format!("{at}: an agent token names its agent (name)"));
                }
                (Role::Agent | Role::Pod, Some(n)) => {
                    if let Some(why) = crate::agent_id_problem(n) {
                        return Err(format!("{at}: {why}"));
                    }
                }
                (_, Some(_)) => return Err(format!("{at}: only agent tokens have a name")),
                (_, None) => {}
            }
            if g.services.is_some() && !matches!(g.role, Role::Workload | Role::Pod | Role::Agent) {
                return Err(format!(
                    "{at}: only workload and agent tokens have services"
                ));
            }
            if g.reads.is_some() && !matches!(g.role, Role::Workload | Role::Pod | Role::Agent) {
                return Err(format!("{at}: only workload and agent tokens have reads"));
            }
            for (field, s) in [("services", &g.services), ("reads", &g.reads)] {
                if let Some(s) = s {
                    check_services(s).map_err(|e| format!("{at}: {field}: {e}"))?;
                }
            }
        }
        Ok(())
    }
}

fn check_services(s: &[String]) -> Result<(), String> {
    if s.iter().any(|x| x.is_empty() || x.len() > 253) {
        return Err("a service name is 1 to 253 characters".into());
    }
    Ok(())
}

/// Who the Kubernetes API says a token is: a ServiceAccount (a
/// TokenReview's answer) and the pod its token is bound to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KubeIdentity {
    /// The ServiceAccount's namespace.
    pub namespace: String,
    /// The ServiceAccount's name.
    pub service_account: String,
    /// The pod the token is bound to (projected tokens are), as the API
    /// has it now.
    pub pod: Option<BoundPod>,
}

/// The pod a token is bound to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BoundPod {
    /// Its name (an agent's id).
    pub name: String,
    /// Its IP, once it has one.
    pub ip: Option<IpAddr>,
    /// Its `kt.dev/service` label.
    pub service: Option<String>,
}

/// Who may do what in a cluster (`--access-map`, a ConfigMap; YAML or
/// JSON): ServiceAccounts to roles, the first rule that matches wins.
///
/// ```yaml
/// rules:
///   - serviceAccount: kt-store
///     role: store
///   - serviceAccount: trainer
///     role: pod
///     services: [train]
///   - serviceAccount: "*"
///     role: pod
///     podService: true
/// ```
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AccessMap {
    /// In order: the first that matches a token's ServiceAccount decides.
    pub rules: Vec<AccessRule>,
}

/// One rule of an [`AccessMap`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct AccessRule {
    /// The ServiceAccount's name, or `*` for every one of the namespace.
    pub service_account: String,
    /// Its namespace; absent: kt's own.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub namespace: Option<String>,
    /// What it may do. `agent` and `pod` need a token bound to a pod
    /// (a projected ServiceAccount token): the pod's name is the agent's.
    pub role: Role,
    /// The services a `workload` or `pod` may write (put, rm, teardown);
    /// absent (and no `podService`): every service.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub services: Option<Vec<String>>,
    /// `workload` or `pod`: also the service its pod is labelled with
    /// (`kt.dev/service`); with no `services`, only that one.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub pod_service: bool,
    /// `workload` or `pod`: the services it reads besides those it writes;
    /// absent: every service, `[]`: only its own.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reads: Option<Vec<String>>,
}

/// A Kubernetes name (a ServiceAccount's, a namespace's): 1 to 253
/// characters of `a-z`, `0-9`, `-` and `.`.
fn kube_name_problem(what: &str, n: &str) -> Option<String> {
    let ok = !n.is_empty()
        && n.len() <= 253
        && n.bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-' || b == b'.');
    (!ok).then(|| format!("{what} {n:?} is not a Kubernetes name"))
}

impl AccessMap {
    /// Checks every rule: names, and services only where they mean something.
    pub fn validate(&self) -> Result<(), String> {
        if self.rules.is_empty() {
            return Err("the access map has no rule".into());
        }
        for (i, r) in self.rules.iter().enumerate() {
            let at = format!("rules[{i}] ({})", r.service_account);
            if r.service_account != "*"
                && let Some(why) = kube_name_problem("serviceAccount", &r.service_account)
            {
                return Err(format!("{at}: {why}"));
            }
            if let Some(why) = r
                .namespace
                .as_deref()
                .and_then(|n| kube_name_problem("namespace", n))
            {
                return Err(format!("{at}: {why}"));
            }
            let scoped = matches!(r.role, Role::Workload | Role::Pod);
            if (r.services.is_some() || r.pod_service || r.reads.is_some()) && !scoped {
                return Err(format!(
                    "{at}: only workload and pod rules have services, podService or reads"
                ));
            }
            for (field, s) in [("services", &r.services), ("reads", &r.reads)] {
                if let Some(s) = s {
                    check_services(s).map_err(|e| format!("{at}: {field}: {e}"))?;
                }
            }
        }
        Ok(())
    }

    /// The principal `who` is, by the first rule that matches (`home`:
    /// kt's namespace, that of rules naming none); why not, otherwise.
    pub fn principal(&self, who: &KubeIdentity, home: &str) -> Result<Principal, String> {
        let sa = format!("{}/{}", who.namespace, who.service_account);
        let rule = self
            .rules
            .iter()
            .find(|r| {
                r.namespace.as_deref().unwrap_or(home) == who.namespace
                    && (r.service_account == "*" || r.service_account == who.service_account)
            })
            .ok_or_else(|| format!("ServiceAccount {sa} has no rule in kt's access map"))?;
        let mut p = Principal {
            role: rule.role,
            name: None,
            services: None,
            reads: rule.reads.clone(),
            ip: None,
            scope: None,
        };
        if matches!(rule.role, Role::Agent | Role::Pod) {
            let pod = who.pod.as_ref().ok_or_else(|| {
                format!(
                    "ServiceAccount {sa} is a {} in kt's access map, but its token is bound to no pod (mount a projected ServiceAccount token)",
                    rule.role
                )
            })?;
            if let Some(why) = crate::agent_id_problem(&pod.name) {
                return Err(format!("pod {}: {why}", pod.name));
            }
            p.name = Some(pod.name.clone());
            p.ip = Some(
                pod.ip
                    .ok_or_else(|| format!("pod {} has no IP yet", pod.name))?,
            );
        }
        if rule.services.is_some() || rule.pod_service {
            let mut services = rule.services.clone().unwrap_or_default();
            if rule.pod_service
                && let Some(s) = who.pod.as_ref().and_then(|p| p.service.clone())
                && !services.contains(&s)
            {
                services.push(s);
            }
            p.services = Some(services);
        }
        Ok(p)
    }
}

/// `POST /api/v1/auth/review`: who a token is (the store and agents ask the
/// metadata server, which reviews it with the Kubernetes API).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TokenQuery {
    /// The bearer token a caller presented.
    pub token: String,
}

/// The answer to a [`TokenQuery`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TokenAnswer {
    /// Who it is; `None`: nobody kt knows (answer 401).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub principal: Option<Principal>,
    /// Why not, when not.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    /// How long the answer may be kept (ms).
    pub ttl_ms: u64,
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
            reads: None,
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
                Grant {
                    token: "token-of-agent-b-0123456789".into(),
                    ..grant(Role::Agent, Some("pod-b"), Some(&["train"]))
                },
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
            grant(Role::Store, None, Some(&["x"])),
            "only workload and agent",
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

    #[test]
    fn a_token_writing_one_service_puts_into_it() {
        let one = grant(Role::Workload, None, Some(&["train"])).principal();
        assert_eq!(one.sole_service(), Some("train"));
        let two = grant(Role::Workload, None, Some(&["train", "eval"])).principal();
        assert_eq!(two.sole_service(), None);
        assert_eq!(
            grant(Role::Workload, None, None).principal().sole_service(),
            None
        );
    }

    /// The write rules as a table: who, the key, the service named, the
    /// key's owner; whether the write is refused, and by which rule.
    #[test]
    fn writes_follow_one_decision_table() {
        let key = |k: &str| crate::Key::parse(k).unwrap();
        let admin = Principal::admin();
        let every = grant(Role::Workload, None, None).principal();
        let train = grant(Role::Workload, None, Some(&["train"])).principal();
        let both = grant(Role::Workload, None, Some(&["train", "eval"])).principal();
        let agent = grant(Role::Agent, Some("pod-a"), Some(&["train"])).principal();
        // (who, key, named service, owner) -> refused by: "" none,
        // "service" (not one of its services), "base" (another service's
        // base path), "owned" (another service's key).
        type Row<'a> = (
            &'a Principal,
            &'a str,
            Option<&'a str>,
            Option<(&'a str, bool)>,
            &'a str,
        );
        let table: [Row; 14] = [
            (&admin, "eval/k", None, Some(("eval", true)), ""),
            (&admin, "x/k", Some("eval"), Some(("train", false)), ""),
            (&every, "eval/k", None, Some(("eval", true)), ""),
            (&every, "x/k", None, Some(("train", false)), ""),
            // A token writing one service: its puts land there.
            (&train, "train/k", None, None, ""),
            (&train, "x/k", None, None, ""),
            (&train, "x/k", Some("eval"), None, "service"),
            (&train, "x/k", None, Some(("eval", false)), "owned"),
            (
                &train,
                "eval/k",
                Some("train"),
                Some(("eval", true)),
                "base",
            ),
            // Its own base path is its own, whoever put there.
            (&train, "train/k", None, Some(("eval", false)), ""),
            // Two services: the key's first segment decides.
            (&both, "x/k", None, None, "service"),
            (&both, "eval/k", None, Some(("train", false)), ""),
            (&agent, "x/k", None, Some(("train", false)), ""),
            (&agent, "eval/k", None, Some(("eval", true)), "base"),
        ];
        for (who, k, named, owner, refused) in table {
            let k = key(k);
            let service = who.write_service(&k, named);
            let by_service = who.refuses_write(&k, &service);
            let by_owner = who.refuses_takeover(&k, owner);
            let got = match (&by_service, &by_owner) {
                (Some(_), _) => "service",
                (None, Some(m)) if m.contains("base path") => "base",
                (None, Some(_)) => "owned",
                (None, None) => "",
            };
            assert_eq!(
                got, refused,
                "{:?} writing {k} ({named:?}, owner {owner:?})",
                who.role
            );
        }
        // The one message of each rule names the key and the services.
        let k = key("x/k");
        assert_eq!(
            train.refuses_write(&k, "eval").unwrap(),
            "this token may not write x/k for service \"eval\" (not one of its services)"
        );
        assert!(!train.asks_owner(&key("train/k")) && train.asks_owner(&k));
        assert!(!every.asks_owner(&k) && !admin.asks_owner(&k));
        assert_eq!(train.write_service(&k, None), "train");
        assert_eq!(both.write_service(&k, None), "x");
        assert_eq!(both.write_service(&k, Some("eval")), "eval");
    }

    #[test]
    fn reads_are_every_service_unless_listed() {
        // No `reads`: a workload writing only train reads every service.
        let w = grant(Role::Workload, None, Some(&["train"])).principal();
        assert!(w.reads("train") && w.reads("eval") && w.reads_all());
        // `reads: [datasets]`: its own services and datasets, nothing else.
        let mut g = grant(Role::Workload, None, Some(&["train"]));
        g.reads = Some(vec!["datasets".into()]);
        let r = g.principal();
        assert!(r.reads("train") && r.reads("datasets") && !r.reads("eval"));
        assert!(!r.reads_all());
        // `reads: []` and no services of its own: it reads nothing.
        let mut g = grant(Role::Workload, None, None);
        g.reads = Some(Vec::new());
        assert!(!g.principal().reads("eval"));
        assert!(Principal::admin().reads("eval") && Principal::admin().reads_all());
        // Only workload (and agent) tokens have reads; names are checked.
        let mut bad = grant(Role::Store, None, None);
        bad.reads = Some(vec!["x".into()]);
        let e = AuthFile { tokens: vec![bad] }.validate().unwrap_err();
        assert!(
            e.contains("only workload and agent tokens have reads"),
            "{e}"
        );
        let mut bad = grant(Role::Workload, None, None);
        bad.reads = Some(vec![String::new()]);
        let e = AuthFile { tokens: vec![bad] }.validate().unwrap_err();
        assert!(e.contains("reads: a service name"), "{e}");
    }

    fn identity(sa: &str, pod: Option<(&str, &str)>) -> KubeIdentity {
        KubeIdentity {
            namespace: "kt".into(),
            service_account: sa.into(),
            pod: pod.map(|(name, service)| BoundPod {
                name: name.into(),
                ip: Some("10.0.0.7".parse().unwrap()),
                service: Some(service.into()),
            }),
        }
    }

    #[test]
    fn access_maps_grant_by_service_account() {
        let map: AccessMap = serde_json::from_str(
            r#"{"rules":[
                {"serviceAccount":"kt-store","role":"store"},
                {"serviceAccount":"ops","namespace":"tools","role":"admin"},
                {"serviceAccount":"trainer","role":"pod","services":["train"],"podService":true},
                {"serviceAccount":"eval","role":"pod","podService":true,"reads":["train"]},
                {"serviceAccount":"*","role":"pod","podService":true,"reads":[]}
            ]}"#,
        )
        .unwrap();
        map.validate().unwrap();
        let store = map.principal(&identity("kt-store", Some(("kt-store-0", "x"))), "kt");
        assert_eq!(store.unwrap().role, Role::Store);
        // A pod: its name is its agent's, its IP what it may advertise,
        // its label (and the rule's services) what it may write.
        let p = map
            .principal(&identity("trainer", Some(("trainer-0", "eval"))), "kt")
            .unwrap();
        assert_eq!(p.role, Role::Pod);
        assert!(p.is_agent("trainer-0") && !p.is_agent("other-0"));
        assert!(p.serves("train") && p.serves("eval") && !p.serves("other"));
        assert!(p.may_advertise("http://10.0.0.7:8090"));
        assert!(!p.may_advertise("http://10.0.0.8:8090"));
        assert!(!p.may_advertise("http://kt-store:8082"));
        let other = map
            .principal(&identity("default", Some(("web-1", "web"))), "kt")
            .unwrap();
        assert_eq!(other.services, Some(vec!["web".to_string()]));
        // Reads: the trainer (no `reads`) every service; the catch-all only
        // its pod's; eval its pod's and train.
        assert!(p.reads("other"));
        assert!(other.reads("web") && !other.reads("train"));
        let eval = map
            .principal(&identity("eval", Some(("eval-0", "eval"))), "kt")
            .unwrap();
        assert!(eval.reads("eval") && eval.reads("train") && !eval.reads("web"));
        assert!(!eval.serves("train"));
        // A pod rule needs a pod-bound token; other namespaces need a rule.
        let e = map.principal(&identity("default", None), "kt").unwrap_err();
        assert!(e.contains("bound to no pod"), "{e}");
        let mut elsewhere = identity("default", Some(("a", "b")));
        elsewhere.namespace = "prod".into();
        let e = map.principal(&elsewhere, "kt").unwrap_err();
        assert!(e.contains("no rule"), "{e}");
        elsewhere.namespace = "tools".into();
        elsewhere.service_account = "ops".into();
        assert_eq!(map.principal(&elsewhere, "kt").unwrap().role, Role::Admin);
        // Rules are checked.
        let bad = |json: &str, what: &str| {
            let m: AccessMap = serde_json::from_str(json).unwrap();
            let e = m.validate().unwrap_err();
            assert!(e.contains(what), "{e}");
        };
        bad(r#"{"rules":[]}"#, "no rule");
        bad(
            r#"{"rules":[{"serviceAccount":"Bad_Name","role":"admin"}]}"#,
            "not a Kubernetes name",
        );
        bad(
            r#"{"rules":[{"serviceAccount":"s","role":"store","podService":true}]}"#,
            "only workload and pod",
        );
        bad(
            r#"{"rules":[{"serviceAccount":"s","role":"agent","reads":["a"]}]}"#,
            "only workload and pod",
        );
        assert!(
            serde_json::from_str::<AccessMap>(
                r#"{"rules":[{"serviceAccount":"s","role":"root"}]}"#
            )
            .is_err()
        );
    }

    #[test]
    fn roles_pass_routes() {
        use Role::*;
        assert!(Admin.passes(&[]) && !Store.passes(&[]) && !Pod.passes(&[]));
        assert!(Pod.passes(&[Agent]) && Pod.passes(&[Workload]) && !Pod.passes(&[Store]));
        assert!(Agent.passes(&[Agent]) && !Agent.passes(&[Workload]));
        assert_eq!(url_ip("http://[fd00::7]:80/x"), "fd00::7".parse().ok());
        assert_eq!(url_ip("https://u@10.1.2.3/x"), "10.1.2.3".parse().ok());
        assert_eq!(url_ip("http://kt-store:8082"), None);
    }
}
