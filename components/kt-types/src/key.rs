//! The one key grammar used everywhere.
//!
//! A key is a `/`-separated path of segments. Leading and trailing `/` are
//! stripped; each segment is non-empty, made of `[A-Za-z0-9._-]`, and is neither
//! `.` nor `..`. The normalised key is at most [`MAX_KEY_LEN`] bytes.

use std::fmt;

use serde::{Deserialize, Serialize};

/// Longest normalised key, in bytes.
pub const MAX_KEY_LEN: usize = 1024;

/// Why a string is not a key. Every variant names the offending part.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum KeyError {
    /// Nothing is left once leading and trailing `/` are stripped.
    #[error("key is empty")]
    Empty,
    /// The normalised key is longer than [`MAX_KEY_LEN`].
    #[error("key is {len} bytes long; the limit is {MAX_KEY_LEN}")]
    TooLong {
        /// Length in bytes of the normalised key.
        len: usize,
    },
    /// Two `/` follow each other.
    #[error("key {key:?} has an empty segment at position {position} (a doubled '/')")]
    EmptySegment {
        /// The normalised key.
        key: String,
        /// Zero-based index of the empty segment.
        position: usize,
    },
    /// A segment is `.` or `..`.
    #[error(
        "key {key:?} has a {segment:?} segment at position {position}; relative segments are not allowed"
    )]
    DotSegment {
        /// The normalised key.
        key: String,
        /// The offending segment: `.` or `..`.
        segment: String,
        /// Zero-based index of the segment.
        position: usize,
    },
    /// A segment holds a character outside `[A-Za-z0-9._-]`.
    #[error(
        "key {key:?}: segment {segment:?} contains {ch:?}; allowed are letters, digits, '.', '_' and '-'"
    )]
    BadChar {
        /// The normalised key.
        key: String,
        /// The segment holding the character.
        segment: String,
        /// The first character not allowed.
        ch: char,
    },
}

fn valid_char(c: char) -> bool {
    c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-')
}

fn check_segments(key: &str) -> Result<(), KeyError> {
    for (position, segment) in key.split('/').enumerate() {
        if segment.is_empty() {
            return Err(KeyError::EmptySegment {
                key: key.to_owned(),
                position,
            });
        }
        if segment == "." || segment == ".." {
            return Err(KeyError::DotSegment {
                key: key.to_owned(),
                segment: segment.to_owned(),
                position,
            });
        }
        if let Some(ch) = segment.chars().find(|c| !valid_char(*c)) {
            return Err(KeyError::BadChar {
                key: key.to_owned(),
                segment: segment.to_owned(),
                ch,
            });
        }
    }
    Ok(())
}

fn normalise(raw: &str) -> Result<&str, KeyError> {
    let trimmed = raw.trim_matches('/');
    if trimmed.len() > MAX_KEY_LEN {
        return Err(KeyError::TooLong { len: trimmed.len() });
    }
    Ok(trimmed)
}

/// A validated, normalised key such as `team/project/artifact/v1`.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub struct Key(String);

impl Key {
    /// Parses and normalises `raw`.
    pub fn parse(raw: &str) -> Result<Self, KeyError> {
        let key = normalise(raw)?;
        if key.is_empty() {
            return Err(KeyError::Empty);
        }
        check_segments(key)?;
        Ok(Key(key.to_owned()))
    }

    /// The normalised key, as it goes on the wire and into URL paths.
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// The `/`-separated segments, first to last (never empty ones).
    pub fn segments(&self) -> impl Iterator<Item = &str> {
        self.0.split('/')
    }

    /// The service a key belongs to by default: its first segment.
    pub fn service(&self) -> &str {
        self.segments().next().unwrap_or_default()
    }

    /// The last segment.
    pub fn name(&self) -> &str {
        self.0.rsplit('/').next().unwrap_or_default()
    }

    /// True when `self` equals `prefix` or lies below it.
    pub fn is_within(&self, prefix: &KeyPrefix) -> bool {
        match prefix.as_str() {
            "" => true,
            p => self.0 == p || (self.0.starts_with(p) && self.0.as_bytes()[p.len()] == b'/'),
        }
    }
}

impl fmt::Display for Key {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl TryFrom<String> for Key {
    type Error = KeyError;
    fn try_from(value: String) -> Result<Self, Self::Error> {
        Key::parse(&value)
    }
}

impl From<Key> for String {
    fn from(k: Key) -> String {
        k.0
    }
}

impl std::str::FromStr for Key {
    type Err = KeyError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Key::parse(s)
    }
}

/// A listing prefix: a key, or the empty prefix (the whole namespace).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub struct KeyPrefix(String);

impl KeyPrefix {
    /// Parses and normalises `raw` like [`Key::parse`], except that an empty
    /// result (`""` or `/`) is accepted as the root prefix.
    pub fn parse(raw: &str) -> Result<Self, KeyError> {
        let p = normalise(raw)?;
        if !p.is_empty() {
            check_segments(p)?;
        }
        Ok(KeyPrefix(p.to_owned()))
    }

    /// The empty prefix: every key lies within it.
    pub fn root() -> Self {
        KeyPrefix(String::new())
    }

    /// The normalised prefix; `""` for the root.
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// The segment of `key` directly below this prefix, and whether more segments follow.
    /// `None` when `key` is not strictly below the prefix.
    pub fn child_of<'k>(&self, key: &'k Key) -> Option<(&'k str, bool)> {
        let rest = if self.0.is_empty() {
            key.as_str()
        } else {
            key.as_str()
                .strip_prefix(self.0.as_str())?
                .strip_prefix('/')?
        };
        match rest.split_once('/') {
            Some((child, _)) => Some((child, true)),
            None => Some((rest, false)),
        }
    }
}

impl From<Key> for KeyPrefix {
    fn from(k: Key) -> Self {
        KeyPrefix(k.0)
    }
}

impl TryFrom<String> for KeyPrefix {
    type Error = KeyError;
    fn try_from(value: String) -> Result<Self, Self::Error> {
        KeyPrefix::parse(&value)
    }
}

impl From<KeyPrefix> for String {
    fn from(k: KeyPrefix) -> String {
        k.0
    }
}

impl fmt::Display for KeyPrefix {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn normalises_slashes() {
        assert_eq!(Key::parse("/a/b/").unwrap().as_str(), "a/b");
        assert_eq!(Key::parse("a").unwrap().service(), "a");
        assert_eq!(Key::parse("a/b/c").unwrap().name(), "c");
    }

    #[test]
    fn rejects_bad_keys_naming_the_part() {
        assert_eq!(Key::parse("//"), Err(KeyError::Empty));
        let e = Key::parse("a//b").unwrap_err();
        assert!(
            matches!(e, KeyError::EmptySegment { position: 1, .. }),
            "{e}"
        );
        let e = Key::parse("a/../b").unwrap_err();
        assert!(e.to_string().contains("\"..\""), "{e}");
        let e = Key::parse("a/./b").unwrap_err();
        assert!(matches!(e, KeyError::DotSegment { position: 1, .. }));
        let e = Key::parse("a/b c").unwrap_err();
        assert!(
            e.to_string().contains("' '") && e.to_string().contains("\"b c\""),
            "{e}"
        );
        let e = Key::parse("a/é").unwrap_err();
        assert!(matches!(e, KeyError::BadChar { ch: 'é', .. }));
        assert!(Key::parse(&"a".repeat(1024)).is_ok());
        assert_eq!(
            Key::parse(&"a".repeat(1025)),
            Err(KeyError::TooLong { len: 1025 })
        );
    }

    #[test]
    fn dots_inside_segments_are_fine() {
        assert!(Key::parse("a/v1.2/..x/.hidden").is_ok());
    }

    #[test]
    fn serde_validates() {
        let k: Result<Key, _> = serde_json::from_str("\"a/../b\"");
        assert!(k.is_err());
        let k: Key = serde_json::from_str("\"/a/b\"").unwrap();
        assert_eq!(k.as_str(), "a/b");
    }

    #[test]
    fn prefixes() {
        let k = Key::parse("a/b/c").unwrap();
        assert!(k.is_within(&KeyPrefix::parse("a/b").unwrap()));
        assert!(k.is_within(&KeyPrefix::parse("a/b/c").unwrap()));
        assert!(!k.is_within(&KeyPrefix::parse("a/bc").unwrap()));
        assert!(k.is_within(&KeyPrefix::root()));
        assert_eq!(
            KeyPrefix::parse("a").unwrap().child_of(&k),
            Some(("b", true))
        );
        assert_eq!(
            KeyPrefix::parse("a/b").unwrap().child_of(&k),
            Some(("c", false))
        );
        assert_eq!(KeyPrefix::parse("a/b/c").unwrap().child_of(&k), None);
        assert_eq!(KeyPrefix::root().child_of(&k), Some(("a", true)));
        assert!(KeyPrefix::parse("/").unwrap().as_str().is_empty());
    }
}
