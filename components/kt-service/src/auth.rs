//! Bearer-token authentication.

use std::path::Path;
use std::sync::Arc;

use axum::extract::{Request, State};
use axum::http::header::AUTHORIZATION;
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use kt_types::ErrorCode;
use kt_types::auth::{AuthFile, Principal, Role};

use crate::ApiError;

/// The shared secret every API call must present as `Authorization: Bearer <token>`.
#[derive(Clone)]
pub struct Token(Arc<str>);

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
        Ok(Token(Arc::from(v)))
    }

    /// The token from a file (preferred) or a literal value (usually `KT_TOKEN`).
    pub fn resolve(value: Option<&str>, file: Option<&Path>) -> Result<Self, TokenError> {
        if let Some(path) = file {
            let text = std::fs::read_to_string(path).map_err(|source| TokenError::File {
                path: path.display().to_string(),
                source,
            })?;
            return Token::new(text);
        }
        value.map(Token::new).unwrap_or(Err(TokenError::Missing))
    }

    pub fn expose(&self) -> &str {
        &self.0
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
}

impl std::fmt::Debug for Auth {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let roles: Vec<String> = self
            .grants
            .iter()
            .map(|(_, p)| p.role.to_string())
            .collect();
        f.debug_struct("Auth").field("grants", &roles).finish()
    }
}

impl From<Token> for Auth {
    /// `KT_TOKEN` alone: admin.
    fn from(t: Token) -> Auth {
        Auth {
            grants: Arc::new(vec![(t, Principal::admin())]),
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
        })
    }

    /// Who `presented` is: every grant is compared (in constant time),
    /// whichever matches.
    pub fn resolve(&self, presented: &str) -> Option<Principal> {
        let mut found = None;
        for (t, p) in self.grants.iter() {
            if t.matches(presented) && found.is_none() {
                found = Some(p.clone());
            }
        }
        found
    }
}

/// Resolves the bearer token to a [`Principal`] (a request extension for
/// [`only`] and the handlers); 401 when none matches.
pub async fn require_token(State(auth): State<Auth>, mut req: Request, next: Next) -> Response {
    let who = req
        .headers()
        .get(AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .and_then(|t| auth.resolve(t.trim()));
    match who {
        Some(p) => {
            req.extensions_mut().insert(p);
            next.run(req).await
        }
        None => {
            ApiError::new(ErrorCode::Unauthorized, "missing or wrong bearer token").into_response()
        }
    }
}

/// A route layer: only `roles` (and admin) pass, others get 403.
/// `route_layer(from_fn_with_state(&[Role::Agent], only))`.
pub async fn only(State(roles): State<&'static [Role]>, req: Request, next: Next) -> Response {
    let role = req.extensions().get::<Principal>().map(|p| p.role);
    match role {
        Some(Role::Admin) => next.run(req).await,
        Some(r) if roles.contains(&r) => next.run(req).await,
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
}
