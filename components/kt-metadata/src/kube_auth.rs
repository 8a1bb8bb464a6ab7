//! `--kube-auth`: bearer tokens are projected ServiceAccount tokens, which
//! the Kubernetes API reviews ([`kt_kube::review`]) and the access map
//! turns into principals. The store and agents ask this server
//! (`kt_service::auth::review_routes`), so one place holds the map and the
//! RBAC to create TokenReviews.

use std::path::Path;
use std::time::Duration;

use kt_service::auth::{ReviewError, ReviewFuture, Reviewed, Reviewer, Verdict};
use kt_types::auth::AccessMap;

/// Reviews tokens with the Kubernetes API and maps them.
pub struct KubeReviewer {
    client: kube::Client,
    audience: String,
    namespace: String,
    map: AccessMap,
}

impl KubeReviewer {
    /// Tokens for `audience`, in kt's `namespace`, mapped by `map`.
    pub fn new(client: kube::Client, audience: &str, namespace: &str, map: AccessMap) -> Self {
        KubeReviewer {
            client,
            audience: audience.to_owned(),
            namespace: namespace.to_owned(),
            map,
        }
    }
}

impl std::fmt::Debug for KubeReviewer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KubeReviewer")
            .field("audience", &self.audience)
            .field("namespace", &self.namespace)
            .field("rules", &self.map.rules.len())
            .finish_non_exhaustive()
    }
}

/// How long an answer is kept when the token says nothing of its expiry.
const DEFAULT_TTL: Duration = Duration::from_secs(60);

impl Reviewer for KubeReviewer {
    fn review<'a>(&'a self, token: &'a str) -> ReviewFuture<'a> {
        Box::pin(async move {
            use kt_kube::review::{Answer, review};
            let answer = review(&self.client, token, &self.audience, &self.namespace)
                .await
                .map_err(|e| ReviewError(format!("the Kubernetes API: {e}")))?;
            Ok(match answer {
                Answer::ServiceAccount(who, valid) => {
                    match self.map.principal(&who, &self.namespace) {
                        Ok(p) => {
                            tracing::debug!(
                                service_account = %who.service_account,
                                pod = ?who.pod.as_ref().map(|p| &p.name),
                                role = %p.role,
                                "token reviewed"
                            );
                            Reviewed {
                                verdict: Verdict::Known(p),
                                ttl: valid.unwrap_or(DEFAULT_TTL),
                            }
                        }
                        Err(why) => refused(why),
                    }
                }
                Answer::Refused(why) => refused(why),
            })
        })
    }

    /// A projected ServiceAccount token is a JWT: anything else is refused
    /// without a TokenReview (made-up tokens cost the API server nothing).
    fn screen(&self, token: &str) -> Option<String> {
        (!kt_service::auth::jwt_shaped(token)).then(|| {
            "invalid bearer token: not a Kubernetes ServiceAccount token (a JWT)".to_owned()
        })
    }
}

fn refused(why: String) -> Reviewed {
    tracing::debug!(why = %why, "token refused");
    Reviewed {
        verdict: Verdict::Refused(why),
        ttl: DEFAULT_TTL,
    }
}

/// The access map at `path` (YAML or JSON), checked.
pub fn load_access_map(path: &Path) -> Result<AccessMap, String> {
    let shown = path.display();
    let text = std::fs::read_to_string(path).map_err(|e| format!("access map {shown}: {e}"))?;
    let map: AccessMap =
        serde_yaml_ng::from_str(&text).map_err(|e| format!("access map {shown}: {e}"))?;
    map.validate()
        .map_err(|e| format!("access map {shown}: {e}"))?;
    Ok(map)
}
