//! Who a bearer token is in the cluster: a TokenReview (audience kt) says
//! which ServiceAccount presents it and the pod it is bound to; the pod
//! itself (GET, in kt's namespace) gives its IP and its service label.
//! The metadata server maps the answer to a role with its access map
//! (`kt_types::auth::AccessMap`).

use std::collections::BTreeMap;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use k8s_openapi::api::authentication::v1::{TokenReview, TokenReviewSpec};
use k8s_openapi::api::core::v1::Pod;
use kt_types::auth::{BoundPod, KubeIdentity};

use crate::SERVICE_LABEL;

/// The audience kt's tokens are made for (a projected ServiceAccount
/// token's `audience`): a token for the API server, or for another
/// service, is refused.
pub const AUDIENCE: &str = "kt";

/// What the API server said of a token.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Answer {
    /// A ServiceAccount, and how long its token is valid (from its `exp`).
    ServiceAccount(KubeIdentity, Option<Duration>),
    /// Not a token kt accepts, and why.
    Refused(String),
}

/// The extra fields a pod-bound token's review carries.
const POD_NAME: &str = "authentication.kubernetes.io/pod-name";
const POD_UID: &str = "authentication.kubernetes.io/pod-uid";

/// Reviews `token` for `audience`; `home`: kt's namespace (pods are read
/// only there). `Err`: the API could not be asked.
pub async fn review(
    client: &kube::Client,
    token: &str,
    audience: &str,
    home: &str,
) -> Result<Answer, kube::Error> {
    let ask = TokenReview {
        spec: TokenReviewSpec {
            audiences: Some(vec![audience.to_owned()]),
            token: Some(token.to_owned()),
        },
        ..TokenReview::default()
    };
    let api: kube::Api<TokenReview> = kube::Api::all(client.clone());
    let done = api.create(&kube::api::PostParams::default(), &ask).await?;
    let status = done.status.unwrap_or_default();
    if status.authenticated != Some(true) {
        let why = status.error.unwrap_or_else(|| "not authenticated".into());
        return Ok(Answer::Refused(format!(
            "the Kubernetes API refused the token: {why}"
        )));
    }
    if !status
        .audiences
        .as_ref()
        .is_none_or(|a| a.iter().any(|x| x == audience))
    {
        return Ok(Answer::Refused(format!(
            "the token is not for audience {audience:?}"
        )));
    }
    let user = status.user.unwrap_or_default();
    let name = user.username.unwrap_or_default();
    let Some((namespace, service_account)) = name
        .strip_prefix("system:serviceaccount:")
        .and_then(|r| r.split_once(':'))
    else {
        return Ok(Answer::Refused(format!(
            "{name:?} is not a ServiceAccount: kt takes ServiceAccount tokens"
        )));
    };
    let extra = user.extra.unwrap_or_default();
    let pod = match one(&extra, POD_NAME) {
        Some(pod) if namespace == home => {
            match bound_pod(client, home, pod, one(&extra, POD_UID)).await? {
                Ok(p) => Some(p),
                Err(why) => return Ok(Answer::Refused(why)),
            }
        }
        Some(pod) => Some(BoundPod {
            name: pod.to_owned(),
            ip: None,
            service: None,
        }),
        None => None,
    };
    let identity = KubeIdentity {
        namespace: namespace.to_owned(),
        service_account: service_account.to_owned(),
        pod,
    };
    Ok(Answer::ServiceAccount(identity, expires_in(token)))
}

fn one<'a>(extra: &'a BTreeMap<String, Vec<String>>, key: &str) -> Option<&'a str> {
    extra.get(key).and_then(|v| v.first()).map(String::as_str)
}

/// The pod a token is bound to, as it is now: gone, or another pod of the
/// same name (another uid), is a refusal.
async fn bound_pod(
    client: &kube::Client,
    ns: &str,
    name: &str,
    uid: Option<&str>,
) -> Result<Result<BoundPod, String>, kube::Error> {
    let pods: kube::Api<Pod> = kube::Api::namespaced(client.clone(), ns);
    let pod = match pods.get(name).await {
        Ok(pod) => pod,
        Err(kube::Error::Api(e)) if e.code == 404 => {
            return Ok(Err(format!("the token's pod {name} is gone")));
        }
        Err(e) => return Err(e),
    };
    if let Some(uid) = uid
        && pod.metadata.uid.as_deref() != Some(uid)
    {
        return Ok(Err(format!(
            "the token was made for an earlier pod named {name}"
        )));
    }
    let ip = pod
        .status
        .as_ref()
        .and_then(|s| s.pod_ip.as_deref())
        .and_then(|ip| ip.parse().ok());
    let service = pod
        .metadata
        .labels
        .as_ref()
        .and_then(|l| l.get(SERVICE_LABEL))
        .cloned();
    Ok(Ok(BoundPod {
        name: name.to_owned(),
        ip,
        service,
    }))
}

/// How long a JWT is valid by its `exp` claim (read without checking the
/// signature: the API server has just vouched for the token).
pub fn expires_in(token: &str) -> Option<Duration> {
    let payload = token.split('.').nth(1)?;
    let json = base64url(payload)?;
    let claims: serde_json::Value = serde_json::from_slice(&json).ok()?;
    let exp = claims.get("exp")?.as_u64()?;
    let now = SystemTime::now().duration_since(UNIX_EPOCH).ok()?.as_secs();
    Some(Duration::from_secs(exp.saturating_sub(now)))
}

/// Unpadded base64url (a JWT's segments).
fn base64url(s: &str) -> Option<Vec<u8>> {
    let mut out = Vec::with_capacity(s.len() * 3 / 4);
    let mut acc = 0u32;
    let mut bits = 0;
    for b in s.trim_end_matches('=').bytes() {
        let v = match b {
            b'A'..=b'Z' => b - b'A',
            b'a'..=b'z' => b - b'a' + 26,
            b'0'..=b'9' => b - b'0' + 52,
            b'-' => 62,
            b'_' => 63,
            _ => return None,
        };
        acc = (acc << 6) | u32::from(v);
        bits += 6;
        if bits >= 8 {
            bits -= 8;
            out.push((acc >> bits) as u8);
            acc &= (1 << bits) - 1;
        }
    }
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn expiry_comes_from_the_token() {
        // {"alg":"none"}.{"exp":<now+600>}.sig, unpadded base64url.
        let now = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap()
            .as_secs();
        let claims = format!("{{\"exp\":{},\"sub\":\"x\"}}", now + 600);
        let token = format!("eyJhbGciOiJub25lIn0.{}.c2ln", encode(claims.as_bytes()));
        let left = expires_in(&token).unwrap().as_secs();
        assert!((590..=600).contains(&left), "{left}");
        assert_eq!(expires_in("opaque"), None);
        assert_eq!(expires_in("a.!!.c"), None);
        assert_eq!(base64url("aGk_-w").unwrap(), b"hi?\xfb");
    }

    fn encode(b: &[u8]) -> String {
        const A: &[u8] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_";
        let mut out = String::new();
        for c in b.chunks(3) {
            let n = c.iter().fold(0u32, |a, &x| (a << 8) | u32::from(x)) << (8 * (3 - c.len()));
            for i in 0..=c.len() {
                out.push(A[((n >> (18 - 6 * i)) & 63) as usize] as char);
            }
        }
        out
    }
}
