//! Bearer-token authentication: static grants (`KT_TOKEN`, a tokens
//! file), and tokens a [`Reviewer`] vouches for (`--kube-auth`: the
//! metadata server asks the Kubernetes API, the store and agents ask the
//! metadata server), cached for as long as the answer holds.

use std::collections::HashMap;
use std::future::Future;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use axum::extract::{Request, State};
use axum::http::header::AUTHORIZATION;
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use kt_types::ErrorCode;
use kt_types::auth::{AuthFile, Principal, Role};

use crate::ApiError;

/// The shared secret every API call must present as `Authorization: Bearer <token>`.
#[derive(Clone)]
pub struct Token(Arc<str>, Option<Arc<PathBuf>>);

impl std::fmt::Debug for Token {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Token(<redacted>)")
    }
}

#[derive(Debug, thiserror::Error)]
pub enum TokenError {
    #[error("no token: set KT_TOKEN or pass --token-file")]
    Missing,
    #[error("token file {path}: {source}")]
    File {
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error("the token is empty")]
    Empty,
}

impl Token {
    pub fn new(value: impl AsRef<str>) -> Result<Self, TokenError> {
        let v = value.as_ref().trim();
        if v.is_empty() {
            return Err(TokenError::Empty);
        }
        Ok(Token(Arc::from(v), None))
    }

    /// The token from a file (preferred) or a literal value (usually `KT_TOKEN`).
    pub fn resolve(value: Option<&str>, file: Option<&Path>) -> Result<Self, TokenError> {
        if let Some(path) = file {
            let text = std::fs::read_to_string(path).map_err(|source| TokenError::File {
                path: path.display().to_string(),
                source,
            })?;
            let mut t = Token::new(text)?;
            t.1 = Some(Arc::new(path.to_owned()));
            return Ok(t);
        }
        value.map(Token::new).unwrap_or(Err(TokenError::Missing))
    }

    pub fn expose(&self) -> &str {
        &self.0
    }

    /// This server's credential for its calls to others: the token, read
    /// again from its file as that is rotated (a projected ServiceAccount
    /// token).
    pub fn credential(&self) -> kt_api::Credential {
        kt_api::Credential::file_or(self.1.as_deref().map(PathBuf::as_path), &self.0)
    }

    /// Constant-time comparison with a presented token.
    pub fn matches(&self, presented: &str) -> bool {
        let a = self.0.as_bytes();
        let b = presented.as_bytes();
        let mut diff = (a.len() ^ b.len()) as u8;
        for (i, x) in a.iter().enumerate() {
            diff |= x ^ b.get(i).copied().unwrap_or(0);
        }
        diff == 0 && a.len() == b.len()
    }
}

/// The tokens a server accepts and who each one is (see [`kt_types::auth`]):
/// the static token (`KT_TOKEN`) as admin, or the grants of a tokens file
/// (`--auth-file`; the static token is then only the server's own
/// credential for its calls to others, unless the file lists it).
#[derive(Clone)]
pub struct Auth {
    grants: Arc<Vec<(Token, Principal)>>,
    review: Option<Arc<Review>>,
    /// A peer source's check of capabilities ([`crate::capability`]).
    capabilities: Option<Arc<crate::capability::Verifier>>,
}

impl std::fmt::Debug for Auth {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let roles: Vec<String> = self
            .grants
            .iter()
            .map(|(_, p)| p.role.to_string())
            .collect();
        f.debug_struct("Auth")
            .field("grants", &roles)
            .field("reviewer", &self.review.as_ref().map(|r| &r.reviewer))
            .finish()
    }
}

impl From<Token> for Auth {
    /// `KT_TOKEN` alone: admin.
    fn from(t: Token) -> Auth {
        Auth {
            grants: Arc::new(vec![(t, Principal::admin())]),
            review: None,
            capabilities: None,
        }
    }
}

/// Why a tokens file cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum AuthFileError {
    #[error("tokens file {path}: {source}")]
    Read {
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error("tokens file {path}: {message}")]
    Invalid { path: String, message: String },
    /// The client that asks the metadata server cannot be made.
    #[error(transparent)]
    Ca(#[from] kt_api::tls::CaError),
    #[error("http client: {0}")]
    Client(String),
}

impl Auth {
    /// The grants of the tokens file at `path`.
    pub fn from_file(path: &Path) -> Result<Auth, AuthFileError> {
        let shown = path.display().to_string();
        let text = std::fs::read_to_string(path).map_err(|source| AuthFileError::Read {
            path: shown.clone(),
            source,
        })?;
        let file: AuthFile = serde_json::from_str(&text).map_err(|e| AuthFileError::Invalid {
            path: shown.clone(),
            message: e.to_string(),
        })?;
        file.validate().map_err(|message| AuthFileError::Invalid {
            path: shown.clone(),
            message,
        })?;
        let grants = file
            .tokens
            .iter()
            .map(|g| {
                Token::new(&g.token)
                    .map(|t| (t, g.principal()))
                    .map_err(|e| AuthFileError::Invalid {
                        path: shown.clone(),
                        message: e.to_string(),
                    })
            })
            .collect::<Result<_, _>>()?;
        Ok(Auth {
            grants: Arc::new(grants),
            review: None,
            capabilities: None,
        })
    }

    /// Capabilities ([`crate::capability`]) checked by `verifier` are
    /// accepted too: each reads one key's version here.
    pub fn with_capabilities(mut self, verifier: Arc<crate::capability::Verifier>) -> Auth {
        self.capabilities = Some(verifier);
        self
    }

    /// `token` as `who` too.
    pub fn with_grant(mut self, token: Token, who: Principal) -> Auth {
        Arc::make_mut(&mut self.grants).push((token, who));
        self
    }

    /// Every service a static grant writes (the tokens file's `services`).
    pub fn services(&self) -> std::collections::BTreeSet<String> {
        self.grants
            .iter()
            .filter_map(|(_, p)| p.services.as_ref())
            .flatten()
            .cloned()
            .collect()
    }

    /// No static grant: every token goes to the reviewer.
    pub fn none() -> Auth {
        Auth {
            grants: Arc::new(Vec::new()),
            review: None,
            capabilities: None,
        }
    }

    /// The grants of `base` (none without), and `reviewer` for the
    /// tokens they do not match (`--kube-auth`).
    pub fn asking(base: Option<Auth>, reviewer: Arc<dyn Reviewer>) -> Auth {
        base.unwrap_or_else(Auth::none).with_reviewer(reviewer)
    }

    /// Tokens no grant matches are asked of `reviewer` (answers cached).
    pub fn with_reviewer(mut self, reviewer: Arc<dyn Reviewer>) -> Auth {
        self.review = Some(Arc::new(Review {
            reviewer,
            cache: Mutex::default(),
            gate: tokio::sync::Semaphore::new(MAX_REVIEWS),
        }));
        self
    }

    /// Who `presented` is by the static grants: every grant is compared
    /// (in constant time), whichever matches.
    fn granted(&self, presented: &str) -> Option<Principal> {
        let mut found = None;
        for (t, p) in self.grants.iter() {
            if t.matches(presented) && found.is_none() {
                found = Some(p.clone());
            }
        }
        found
    }

    /// Who `presented` is: a static grant, else the reviewer's answer;
    /// `Err` when the reviewer could not answer (503: not the caller's
    /// fault).
    pub async fn resolve(&self, presented: &str) -> Result<Verdict, ApiError> {
        self.resolve_for(presented).await.map(|(v, _)| v)
    }

    /// [`Auth::resolve`], and how much longer the answer holds.
    pub async fn resolve_for(&self, presented: &str) -> Result<(Verdict, Duration), ApiError> {
        if presented.starts_with(kt_types::auth::Capability::PREFIX) {
            let Some(v) = &self.capabilities else {
                let why = "a capability is accepted only by the source it was minted for";
                return Ok((Verdict::Refused(why.into()), NEGATIVE_TTL));
            };
            let now = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_millis() as u64);
            return match v.verify(presented, now) {
                Ok(cap) => Ok((Verdict::Known(cap.principal()), Duration::ZERO)),
                // Not the caller's fault, and soon mended: 503, retried.
                Err(e @ crate::capability::Refused::UnknownKey(_)) => {
                    Err(ApiError::new(ErrorCode::Unavailable, e.to_string()))
                }
                Err(e) => Ok((Verdict::Refused(e.to_string()), NEGATIVE_TTL)),
            };
        }
        if let Some(p) = self.granted(presented) {
            return Ok((Verdict::Known(p), STATIC_TTL));
        }
        let Some(review) = &self.review else {
            return Ok((Verdict::Refused(WRONG_TOKEN.into()), NEGATIVE_TTL));
        };
        if presented.is_empty() || presented.len() > MAX_TOKEN_LEN {
            return Ok((Verdict::Refused(WRONG_TOKEN.into()), NEGATIVE_TTL));
        }
        review.resolve(presented).await
    }
}

/// The answer for an unknown static token.
const WRONG_TOKEN: &str = "missing or wrong bearer token";
/// How long a static grant's answer holds for those who ask (the store
/// and agents asking the metadata server).
const STATIC_TTL: Duration = Duration::from_secs(60);
/// How long a refusal is kept: a caller retrying a bad token costs the
/// Kubernetes API one review in this time.
const NEGATIVE_TTL: Duration = Duration::from_secs(5);
/// The longest any answer is kept, whatever the token's lifetime: a pod
/// deleted (its token invalidated) loses access within this.
pub const MAX_REVIEW_TTL: Duration = Duration::from_secs(300);
/// Positive answers kept at most.
const MAX_KNOWN: usize = 8192;
/// Refusals kept at most, in their own map: a flood of distinct made-up
/// tokens evicts older refusals, never a positive answer.
const MAX_REFUSED: usize = 4096;
/// Reviews in flight at once.
const MAX_REVIEWS: usize = 64;
/// Longer tokens are refused without a review (a projected token is ~1 KiB).
const MAX_TOKEN_LEN: usize = 16 << 10;

/// Who a token is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Verdict {
    /// Someone kt knows.
    Known(Principal),
    /// Nobody kt knows, and why (answered 401 with it).
    Refused(String),
}

/// A reviewer's answer.
#[derive(Debug, Clone)]
pub struct Reviewed {
    pub verdict: Verdict,
    /// How long it may be kept (capped at [`MAX_REVIEW_TTL`]; a refusal
    /// is kept a few seconds whatever this says).
    pub ttl: Duration,
}

/// The reviewer could not answer (the API it asks is away): 503.
#[derive(Debug, thiserror::Error)]
#[error("cannot check the bearer token now: {0}")]
pub struct ReviewError(pub String);

/// A boxed future of a [`Reviewer`].
pub type ReviewFuture<'a> =
    Pin<Box<dyn Future<Output = Result<Reviewed, ReviewError>> + Send + 'a>>;

/// Who tokens are that no static grant matches.
pub trait Reviewer: Send + Sync + std::fmt::Debug + 'static {
    fn review<'a>(&'a self, token: &'a str) -> ReviewFuture<'a>;

    /// Why `token` cannot be one this reviewer vouches for, told without
    /// asking anyone (refused at no cost, not cached); `None` to review it.
    fn screen(&self, _token: &str) -> Option<String> {
        None
    }
}

/// Whether `token` has a JWT's shape: three non-empty base64url parts
/// separated by dots (a projected ServiceAccount token always has).
pub fn jwt_shaped(token: &str) -> bool {
    let mut parts = 0;
    for part in token.split('.') {
        parts += 1;
        let base64url = |b: u8| b.is_ascii_alphanumeric() || b == b'-' || b == b'_';
        if part.is_empty() || !part.bytes().all(base64url) {
            return false;
        }
    }
    parts == 3
}

struct Review {
    reviewer: Arc<dyn Reviewer>,
    cache: Mutex<Answers>,
    gate: tokio::sync::Semaphore,
}

/// The reviewer's answers, by the token's BLAKE3 hash (the token itself is
/// never kept): positive ones and refusals apart, each bounded.
#[derive(Default)]
struct Answers {
    known: HashMap<[u8; 32], (Principal, Instant)>,
    refused: HashMap<[u8; 32], (String, Instant)>,
    /// The refusals by age (all are kept [`NEGATIVE_TTL`], so the oldest
    /// expires first); an entry whose refusal was replaced is skipped.
    refused_order: std::collections::VecDeque<([u8; 32], Instant)>,
}

impl Answers {
    fn get(&self, key: &[u8; 32], now: Instant) -> Option<(Verdict, Duration)> {
        let (verdict, until) = match (self.known.get(key), self.refused.get(key)) {
            (Some((p, until)), _) => (Verdict::Known(p.clone()), *until),
            (None, Some((why, until))) => (Verdict::Refused(why.clone()), *until),
            (None, None) => return None,
        };
        Some((verdict, until.checked_duration_since(now)?))
    }

    fn insert(&mut self, key: [u8; 32], verdict: Verdict, until: Instant, now: Instant) {
        match verdict {
            Verdict::Known(p) => {
                self.refused.remove(&key);
                if self.known.len() >= MAX_KNOWN && !self.known.contains_key(&key) {
                    self.known.retain(|_, (_, u)| *u > now);
                }
                if self.known.len() >= MAX_KNOWN && !self.known.contains_key(&key) {
                    // All still valid: the one expiring first goes.
                    let first = self.known.iter().min_by_key(|(_, (_, u))| *u);
                    if let Some(k) = first.map(|(k, _)| *k) {
                        self.known.remove(&k);
                    }
                }
                self.known.insert(key, (p, until));
            }
            Verdict::Refused(why) => {
                self.known.remove(&key);
                while let Some(&(k, u)) = self.refused_order.front() {
                    if u > now && self.refused.len() < MAX_REFUSED {
                        break;
                    }
                    self.refused_order.pop_front();
                    if self.refused.get(&k).is_some_and(|(_, at)| *at == u) {
                        self.refused.remove(&k);
                    }
                }
                self.refused.insert(key, (why, until));
                self.refused_order.push_back((key, until));
            }
        }
    }
}

impl Review {
    fn cached(&self, key: &[u8; 32]) -> Option<(Verdict, Duration)> {
        let cache = self.cache.lock().unwrap_or_else(PoisonError::into_inner);
        cache.get(key, Instant::now())
    }

    async fn resolve(&self, token: &str) -> Result<(Verdict, Duration), ApiError> {
        if let Some(why) = self.reviewer.screen(token) {
            return Ok((Verdict::Refused(why), NEGATIVE_TTL));
        }
        let key = *blake3::hash(token.as_bytes()).as_bytes();
        if let Some(hit) = self.cached(&key) {
            return Ok(hit);
        }
        let _permit = self
            .gate
            .acquire()
            .await
            .map_err(|_| ApiError::new(ErrorCode::Unavailable, "shutting down"))?;
        // Another request may have reviewed it while this one waited.
        if let Some(hit) = self.cached(&key) {
            return Ok(hit);
        }
        let r = self
            .reviewer
            .review(token)
            .await
            .map_err(|e| ApiError::new(ErrorCode::Unavailable, e.to_string()))?;
        let ttl = match r.verdict {
            Verdict::Known(_) => r.ttl.min(MAX_REVIEW_TTL),
            Verdict::Refused(_) => NEGATIVE_TTL,
        };
        let now = Instant::now();
        let mut cache = self.cache.lock().unwrap_or_else(PoisonError::into_inner);
        cache.insert(key, r.verdict.clone(), now + ttl, now);
        Ok((r.verdict, ttl))
    }
}

/// Asks the metadata server who a token is (the store and agents under
/// `--kube-auth`: one place reviews tokens and holds the access map).
#[derive(Debug)]
pub struct AskMetadata {
    api: kt_api::Api,
}

impl AskMetadata {
    /// The metadata server at `url`, called with `credential` (this
    /// server's own token, which the metadata server reviews in turn).
    pub fn new(url: &str, credential: kt_api::Credential) -> Result<AskMetadata, AuthFileError> {
        let http = kt_api::tls::http_builder()?
            .timeout(Duration::from_secs(10))
            .build()
            .map_err(|e| AuthFileError::Client(e.to_string()))?;
        Ok(AskMetadata {
            api: kt_api::Api::new(http, url, credential),
        })
    }
}

impl Reviewer for AskMetadata {
    fn review<'a>(&'a self, token: &'a str) -> ReviewFuture<'a> {
        Box::pin(async move {
            let query = kt_types::auth::TokenQuery {
                token: token.to_owned(),
            };
            let a: kt_types::auth::TokenAnswer = self
                .api
                .post(&kt_types::paths::auth_review())
                .json(&query)
                .retry(2)
                .fetch()
                .await
                .map_err(|e| ReviewError(format!("asking the metadata server: {e}")))?;
            let verdict = match a.principal {
                Some(p) => Verdict::Known(p),
                None => Verdict::Refused(a.reason.unwrap_or_else(|| WRONG_TOKEN.into())),
            };
            Ok(Reviewed {
                verdict,
                ttl: Duration::from_millis(a.ttl_ms),
            })
        })
    }
}

/// `POST /api/v1/auth/review` over `auth` (the metadata server's): the
/// store and agents ask who a token they are shown is.
pub fn review_routes(auth: Auth) -> axum::Router {
    use kt_types::auth::Role::{Agent, Store};
    axum::Router::new()
        .route(
            &kt_types::paths::auth_review(),
            allow(
                &[Store, Agent],
                axum::routing::post(answer_review)
                    .layer(axum::extract::DefaultBodyLimit::max(2 * MAX_TOKEN_LEN)),
            ),
        )
        .with_state(auth)
}

async fn answer_review(
    State(auth): State<Auth>,
    axum::Extension(asker): axum::Extension<Principal>,
    crate::ApiJson(q): crate::ApiJson<kt_types::auth::TokenQuery>,
) -> Result<crate::ApiJson<kt_types::auth::TokenAnswer>, ApiError> {
    let (verdict, ttl) = auth.resolve_for(&q.token).await?;
    let ttl_ms = u64::try_from(ttl.as_millis()).unwrap_or(u64::MAX);
    // An agent is shown agents' and pods' tokens (tensor sessions),
    // Prometheus's and operators'; getters show it capabilities. Who a
    // workload's or the store's token is, it is not told.
    let verdict = match verdict {
        Verdict::Known(p)
            if matches!(asker.role, Role::Agent | Role::Pod)
                && matches!(p.role, Role::Workload | Role::Store) =>
        {
            Verdict::Refused("not a token an agent is shown".into())
        }
        v => v,
    };
    Ok(crate::ApiJson(match verdict {
        Verdict::Known(p) => kt_types::auth::TokenAnswer {
            principal: Some(p),
            reason: None,
            ttl_ms,
        },
        Verdict::Refused(why) => kt_types::auth::TokenAnswer {
            principal: None,
            reason: Some(why),
            ttl_ms,
        },
    }))
}

/// The bearer token of a request, if it has one.
fn bearer(req: &Request) -> Option<&str> {
    req.headers()
        .get(AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .map(str::trim)
}

/// Resolves the bearer token to a [`Principal`] (a request extension for
/// [`only`] and the handlers); 401 when nobody kt knows presents it.
pub async fn require_token(State(auth): State<Auth>, mut req: Request, next: Next) -> Response {
    let verdict = match bearer(&req) {
        Some(t) => auth.resolve(t).await,
        None => Ok(Verdict::Refused(WRONG_TOKEN.into())),
    };
    match verdict {
        Ok(Verdict::Known(p)) => {
            req.extensions_mut().insert(p);
            next.run(req).await
        }
        Ok(Verdict::Refused(why)) => ApiError::new(ErrorCode::Unauthorized, why).into_response(),
        Err(e) => e.into_response(),
    }
}

/// A route layer: only `roles` (and admin) pass, others get 403.
/// `route_layer(from_fn_with_state(&[Role::Agent], only))`.
pub async fn only(State(roles): State<&'static [Role]>, req: Request, next: Next) -> Response {
    let role = req.extensions().get::<Principal>().map(|p| p.role);
    match role {
        Some(r) if r.passes(roles) => next.run(req).await,
        Some(r) => forbidden(format!(
            "a {r} token may not call {} {}",
            req.method(),
            req.uri().path()
        ))
        .into_response(),
        None => {
            ApiError::new(ErrorCode::Unauthorized, "missing or wrong bearer token").into_response()
        }
    }
}

/// `m` for `roles` only (and admin): the route's declared roles.
pub fn allow<S>(
    roles: &'static [Role],
    m: axum::routing::MethodRouter<S>,
) -> axum::routing::MethodRouter<S>
where
    S: Clone + Send + Sync + 'static,
{
    m.route_layer(axum::middleware::from_fn_with_state(roles, only))
}

/// A 403 answer: the caller's role, agent or services do not allow it.
pub fn forbidden(message: impl Into<String>) -> ApiError {
    ApiError::new(ErrorCode::Forbidden, message)
}

/// A read of `key`, which belongs to `service`, by `who`: 403 unless its
/// token reads that service ([`Principal::reads`]).
pub fn check_read(who: &Principal, key: &kt_types::Key, service: &str) -> Result<(), ApiError> {
    who.refuses_read(key, service)
        .map_or(Ok(()), |why| Err(forbidden(why)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn compares_exactly() {
        let t = Token::new("secret").unwrap();
        assert!(t.matches("secret"));
        assert!(!t.matches("secreT"));
        assert!(!t.matches("secret2"));
        assert!(!t.matches(""));
        assert!(Token::new("  ").is_err());
        assert!(matches!(
            Token::resolve(None, None),
            Err(TokenError::Missing)
        ));
        assert_eq!(format!("{t:?}"), "Token(<redacted>)");
    }

    /// Knows one token; counts the reviews of each; screens out tokens
    /// that are not JWT-shaped when `jwt_only` (as the Kubernetes one).
    #[derive(Debug, Default)]
    struct Counting {
        reviews: Mutex<HashMap<String, usize>>,
        jwt_only: bool,
    }

    const GOOD: &str = "aGVhZA.Ym9keQ.c2ln";

    impl Reviewer for Counting {
        fn review<'a>(&'a self, token: &'a str) -> ReviewFuture<'a> {
            *self
                .reviews
                .lock()
                .unwrap()
                .entry(token.to_owned())
                .or_default() += 1;
            let verdict = if token == GOOD {
                Verdict::Known(Principal::admin())
            } else {
                Verdict::Refused("unknown".into())
            };
            let ttl = MAX_REVIEW_TTL;
            Box::pin(async move { Ok(Reviewed { verdict, ttl }) })
        }

        fn screen(&self, token: &str) -> Option<String> {
            (self.jwt_only && !jwt_shaped(token)).then(|| "not a JWT".to_owned())
        }
    }

    impl Counting {
        fn count(&self, token: &str) -> usize {
            self.reviews
                .lock()
                .unwrap()
                .get(token)
                .copied()
                .unwrap_or(0)
        }
    }

    #[tokio::test]
    async fn a_flood_of_bad_tokens_does_not_evict_a_good_answer() {
        for jwt_only in [false, true] {
            let reviewer = Arc::new(Counting {
                jwt_only,
                ..Counting::default()
            });
            let auth = Auth::none().with_reviewer(reviewer.clone());
            assert!(matches!(auth.resolve(GOOD).await, Ok(Verdict::Known(_))));
            let bad: Vec<String> = (0..10_000)
                .map(|i| {
                    if i % 2 == 0 {
                        format!("made-up-{i}")
                    } else {
                        format!("a.b.{i}")
                    }
                })
                .collect();
            for t in &bad {
                let v = auth.resolve(t).await.unwrap();
                assert!(matches!(v, Verdict::Refused(_)), "{t}: {v:?}");
            }
            assert!(matches!(auth.resolve(GOOD).await, Ok(Verdict::Known(_))));
            assert_eq!(reviewer.count(GOOD), 1, "the good answer was kept");
            for t in &bad {
                let n = reviewer.count(t);
                let expected = usize::from(!jwt_only || jwt_shaped(t));
                assert_eq!(n, expected, "{t} reviewed {n} times");
            }
            let reviews = reviewer.reviews.lock().unwrap().values().sum::<usize>();
            let cache = auth.review.as_ref().unwrap().cache.lock().unwrap();
            assert!(cache.refused.len() <= MAX_REFUSED, "refusals are bounded");
            assert!(cache.refused_order.len() <= reviews);
        }
    }

    #[test]
    fn jwt_shape() {
        assert!(jwt_shaped(GOOD));
        assert!(jwt_shaped("a-_.b.c"));
        for t in [
            "", "a.b", "a.b.c.d", "a..c", ".b.c", "a.b.", "a.b.c=", "a b.c.d", "tok",
        ] {
            assert!(!jwt_shaped(t), "{t}");
        }
    }
}
