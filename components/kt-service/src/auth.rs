//! Bearer-token authentication.

use std::path::Path;
use std::sync::Arc;

use axum::extract::{Request, State};
use axum::http::header::AUTHORIZATION;
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use kt_types::ErrorCode;

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

pub async fn require_token(State(token): State<Token>, req: Request, next: Next) -> Response {
    let ok = req
        .headers()
        .get(AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .is_some_and(|t| token.matches(t.trim()));
    if ok {
        next.run(req).await
    } else {
        ApiError::new(ErrorCode::Unauthorized, "missing or wrong bearer token").into_response()
    }
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
