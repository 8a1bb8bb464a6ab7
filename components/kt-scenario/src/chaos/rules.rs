//! What the chaos soak tolerates: each kind of operation names the failures
//! an injected fault explains, by the error code the failed `kt` call names
//! (never by the wording of its message), and the largest share of its runs
//! that may fail so. Anything else is a violation: a 403 or a 500, a failure
//! that names no code, a kind that may not fail at all (store puts and gets,
//! broadcasts), a hang (the soak bounds every call), or a tolerated share
//! above its bound.

use std::collections::BTreeMap;

use kt_types::ErrorCode;

/// The failures of one kind of operation that faults explain.
#[derive(Debug)]
pub struct Rule {
    /// The operation kind, as the report counts it.
    pub kind: &'static str,
    /// Each code a fault explains, and which fault.
    pub explained: &'static [(ErrorCode, &'static str)],
    /// At most this many percent of the kind's runs may fail so (checked
    /// once the kind ran [`MIN_RUNS`] times).
    pub max_percent: u64,
}

/// Below this many runs of a kind its share is not judged (a few unlucky
/// operations next to one fault are no trend).
pub const MIN_RUNS: u64 = 20;

/// A put's registration waits a few seconds for a restarting metadata
/// server (`kt_agent::metadata::REGISTER_RETRIES`), not for one that is
/// frozen or away longer.
const AGENT_AWAY: &str = "the pod's agent killed, frozen or restarting, or the metadata server \
                          frozen or away longer than a registration waits";
const NOT_PUT: &str = "the key not put yet, or its holder gone with its agent";
const HOLDER_AWAY: &str = "its holder's agent down at that moment";
const CUT: &str = "a link cut or a frozen peer mid-transfer";

/// What explains a failed get of a local key.
const LOCAL_GET: &[(ErrorCode, &str)] = &[
    (ErrorCode::NotFound, NOT_PUT),
    (ErrorCode::NoSource, HOLDER_AWAY),
];

/// The rules; a kind not listed tolerates no failure.
pub const RULES: &[Rule] = &[
    Rule {
        kind: "local-put",
        explained: &[(ErrorCode::Unavailable, AGENT_AWAY)],
        max_percent: 25,
    },
    Rule {
        kind: "local-get",
        explained: LOCAL_GET,
        max_percent: 50,
    },
    Rule {
        kind: "local-get-after-kill",
        explained: LOCAL_GET,
        max_percent: 50,
    },
    Rule {
        kind: "tensor-put",
        explained: &[(ErrorCode::Unavailable, AGENT_AWAY)],
        max_percent: 25,
    },
    Rule {
        kind: "tensor-get",
        explained: &[
            (ErrorCode::NotFound, NOT_PUT),
            (ErrorCode::NoSource, HOLDER_AWAY),
            (ErrorCode::Unavailable, CUT),
        ],
        max_percent: 50,
    },
];

/// A failed `kt` call, as the soak judges it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Failure {
    /// Its exit status.
    pub status: i32,
    /// The error code it names: the one its error line ends with (`(no_source,
    /// HTTP 503)`, the answer of the server or agent that refused), else
    /// its exit status's class (`kt`'s exit codes: 2 bad input, 3 not found,
    /// 4 refused, 5 unavailable); `None` for any other failure.
    pub code: Option<ErrorCode>,
}

impl Failure {
    /// The failure of a `kt` call that exited with `status`, saying `stderr`.
    pub fn of(status: i32, stderr: &str) -> Failure {
        let by_exit = match status {
            2 => Some(ErrorCode::InvalidRequest),
            3 => Some(ErrorCode::NotFound),
            4 => Some(ErrorCode::Forbidden),
            5 => Some(ErrorCode::Unavailable),
            _ => None,
        };
        Failure {
            status,
            code: named_code(stderr).or(by_exit),
        }
    }
}

/// The code `kt: error: ... (code, HTTP status)` ends with, on the last
/// error line of `stderr`.
fn named_code(stderr: &str) -> Option<ErrorCode> {
    let line = stderr
        .lines()
        .rev()
        .find(|l| l.contains("error:"))?
        .trim_end();
    let inner = line.strip_suffix(')')?;
    let (code, status) = inner[inner.rfind('(')? + 1..].split_once(", HTTP ")?;
    status.parse::<u16>().ok()?;
    serde_json::from_value(serde_json::Value::String(code.to_owned())).ok()
}

/// The rule of `kind`, if it tolerates anything.
pub fn rule(kind: &str) -> Option<&'static Rule> {
    RULES.iter().find(|r| r.kind == kind)
}

/// Whether a failure of `kind` is one a fault explains: its code, or why
/// it is a violation.
pub fn judge(kind: &str, f: Failure) -> Result<ErrorCode, String> {
    let Some(code) = f.code else {
        return Err(format!("exit {} names no error code", f.status));
    };
    match rule(kind) {
        Some(r) if r.explained.iter().any(|(c, _)| *c == code) => Ok(code),
        Some(r) => Err(format!(
            "{code} is no failure a fault explains for a {kind} (those: {})",
            r.explained
                .iter()
                .map(|(c, why)| format!("{c}: {why}"))
                .collect::<Vec<_>>()
                .join("; ")
        )),
        None => Err(format!("a {kind} may not fail ({code})")),
    }
}

/// The kinds whose tolerated failures passed their bound: `ok` counts each
/// kind's successes, `tolerated` its tolerated failures by code
/// ([`ErrorCode::as_str`]).
pub fn over_bound(
    ok: &BTreeMap<String, u64>,
    tolerated: &BTreeMap<(String, &'static str), u64>,
) -> Vec<String> {
    let mut out = Vec::new();
    for r in RULES {
        let failed: u64 = (tolerated.iter())
            .filter(|((kind, _), _)| kind == r.kind)
            .map(|(_, n)| n)
            .sum();
        let runs = failed + ok.get(r.kind).copied().unwrap_or(0);
        if runs >= MIN_RUNS && failed * 100 > runs * r.max_percent {
            out.push(format!(
                "{failed} of {runs} {}s failed, above the bound of {}% (each failure was explained one by one; so many are not)",
                r.kind, r.max_percent
            ));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_code_comes_from_the_error_line_else_from_the_exit_status() {
        let forbidden = "kt: error: put of chaos/t0: node agent: metadata server: a workload \
                         token may not call PUT /api/v1/keys/chaos/t0 (forbidden, HTTP 403)\n";
        assert_eq!(Failure::of(4, forbidden).code, Some(ErrorCode::Forbidden));
        let relayed =
            "WARN something\nkt: error: get of chaos/l0: no live source (no_source, HTTP 503)";
        assert_eq!(Failure::of(5, relayed).code, Some(ErrorCode::NoSource));
        // No code in the line: the exit status's class.
        let away = "kt: error: no node agent listens at /p/agent.sock (waited 30s)";
        assert_eq!(Failure::of(5, away).code, Some(ErrorCode::Unavailable));
        assert_eq!(Failure::of(3, "").code, Some(ErrorCode::NotFound));
        // A failure that is nothing kt names: no code.
        assert_eq!(Failure::of(1, "kt: error: boom").code, None);
        assert_eq!(Failure::of(137, "").code, None);
        // Something that only looks like a code is none.
        assert_eq!(Failure::of(1, "kt: error: (bogus, HTTP 500)").code, None);
        assert_eq!(
            Failure::of(1, "kt: error: internal (internal, HTTP 500)").code,
            Some(ErrorCode::Internal)
        );
    }

    #[test]
    fn only_the_codes_a_rule_names_are_tolerated() {
        let f = |status, code| Failure { status, code };
        assert_eq!(
            judge("tensor-get", f(5, Some(ErrorCode::NoSource))),
            Ok(ErrorCode::NoSource)
        );
        assert_eq!(
            judge("local-put", f(5, Some(ErrorCode::Unavailable))),
            Ok(ErrorCode::Unavailable)
        );
        // The 403 the soak once tolerated, a 500, no code at all.
        let forbidden = judge("tensor-put", f(4, Some(ErrorCode::Forbidden))).unwrap_err();
        assert!(forbidden.contains("forbidden"), "{forbidden}");
        assert!(judge("tensor-get", f(1, Some(ErrorCode::Internal))).is_err());
        // A second live putter of a key in one pod is refused by design;
        // the soak never starts one, so a conflict is never explained.
        let conflict = judge("tensor-put", f(4, Some(ErrorCode::Conflict))).unwrap_err();
        assert!(conflict.contains("conflict"), "{conflict}");
        assert!(judge("local-get", f(1, None)).is_err());
        // Kinds with no rule tolerate nothing.
        for kind in ["put", "get", "get-after-kill", "broadcast-member"] {
            assert!(rule(kind).is_none());
            assert!(judge(kind, f(5, Some(ErrorCode::Unavailable))).is_err());
        }
    }

    #[test]
    fn a_share_above_the_bound_is_a_violation() {
        let ok = BTreeMap::from([("tensor-get".to_owned(), 10), ("local-put".to_owned(), 100)]);
        let mut tolerated = BTreeMap::from([
            (("tensor-get".to_owned(), ErrorCode::NoSource.as_str()), 6),
            (("tensor-get".to_owned(), ErrorCode::NotFound.as_str()), 4),
            (("local-put".to_owned(), ErrorCode::Unavailable.as_str()), 2),
        ]);
        // 10 of 20 tensor gets: at the bound, not over it.
        assert!(over_bound(&ok, &tolerated).is_empty());
        tolerated.insert(
            ("tensor-get".to_owned(), ErrorCode::Unavailable.as_str()),
            1,
        );
        let over = over_bound(&ok, &tolerated);
        assert_eq!(over.len(), 1, "{over:?}");
        assert!(over[0].starts_with("11 of 21 tensor-gets"), "{over:?}");
        // Too few runs to judge.
        let few = BTreeMap::from([(("local-put".to_owned(), ErrorCode::Unavailable.as_str()), 5)]);
        assert!(over_bound(&BTreeMap::new(), &few).is_empty());
    }
}
