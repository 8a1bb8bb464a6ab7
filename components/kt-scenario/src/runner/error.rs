//! Why a step failed. The runner prints a failed step's error, records it in
//! the report, the failure dump and the snapshot (`failed: ...`), and a
//! step that expects an error matches its `message` against it: every
//! variant's Display is the exact text the runner has always written, so
//! snapshots and `expect` patterns do not change with the type.

use std::path::PathBuf;
use std::time::Duration;

use kt_client::ClientError;
use kt_types::KeyError;

use crate::format::{ErrorClass, Expect};
use crate::report::BudgetCheck;
use crate::target::TargetError;
use crate::template::TemplateError;

/// Why a step failed.
#[derive(Debug, thiserror::Error)]
pub(super) enum StepError {
    /// An outcome (of a step that runs no command in pods) is not the one
    /// the step's `expect` asks for.
    #[error(transparent)]
    Expectation(#[from] Mismatch),
    /// Pods whose commands did not meet the step's expectation, each with
    /// why, of `pods` that ran; the message names the first three.
    #[error("{}", pods_message(.failed, *.pods))]
    Pods {
        failed: Vec<(String, Mismatch)>,
        pods: usize,
    },
    /// Something the step checks of the testbed does not hold: an
    /// assertion, `max_sent`, a metric's `at_most`, an exec's `stdout`.
    #[error("{0}")]
    Check(String),
    /// A tree a pod received is not the data set (any of `sets`) it should
    /// be: `got` its (files, bytes), `want` the first set's.
    #[error(
        "{pod}: {} ({} files, {} bytes) does not equal data set {sets} ({} files, {} bytes)",
        .path.display(),
        .got.0,
        .got.1,
        .want.0,
        .want.1
    )]
    Verify {
        pod: String,
        path: PathBuf,
        got: (u64, u64),
        sets: String,
        want: (u64, u64),
    },
    /// The step ran past its limit (its own, or what the scenario's left).
    #[error("timed out after {}", humantime::format_duration(*.0))]
    Timeout(Duration),
    /// The limits of the step's timing budget that it broke.
    #[error("{}", budget_message(.0))]
    Budget(Vec<BudgetCheck>),
    /// Several failures: of a `parallel` group's children, or of an
    /// `assert`'s checks.
    #[error("{}", join(.0))]
    Several(Vec<StepError>),
    /// The target could not do what the step asked (run, fetch, signal,
    /// start, ...).
    #[error(transparent)]
    Target(#[from] TargetError),
    /// A kt command's output is not what the runner reads: an unreadable
    /// summary or listing, a held `kt tensor put` without its `holding`
    /// line.
    #[error("{0}")]
    Command(String),
    /// The runner's kt client got an error from the metadata server.
    #[error(transparent)]
    Client(#[from] ClientError),
    /// The runner's own look at the testbed failed: an HTTP request (the
    /// metadata API, `/metrics`), or it has no client for the metadata
    /// server.
    #[error("{0}")]
    Probe(String),
    /// A `{{ ... }}` template in the step does not expand.
    #[error(transparent)]
    Template(#[from] TemplateError),
    /// Hashing a data set or a received tree failed.
    #[error("{0}")]
    Digest(String),
    /// The step names what is not there or says what cannot be used: an
    /// unknown data set, pod, component or holder; a bad key, prefix or
    /// pattern.
    #[error("{0}")]
    Input(String),
    /// A failure of one pod, component or agent, named by `at`.
    #[error("{at}: {source}")]
    At { at: String, source: Box<StepError> },
}

/// A key or prefix that does not parse is bad input.
impl From<KeyError> for StepError {
    fn from(e: KeyError) -> StepError {
        StepError::Input(e.to_string())
    }
}

impl StepError {
    /// `source`, about `at` (a pod, a component, an agent).
    pub(super) fn at(at: impl std::fmt::Display, source: impl Into<StepError>) -> StepError {
        StepError::At {
            at: at.to_string(),
            source: Box::new(source.into()),
        }
    }
}

fn pods_message(failed: &[(String, Mismatch)], pods: usize) -> String {
    let each: Vec<String> = failed.iter().map(|(p, e)| format!("{p}: {e}")).collect();
    if each.len() > 3 {
        format!(
            "{} of {} pods: {}; ...",
            each.len(),
            pods,
            each[..3].join("; ")
        )
    } else {
        each.join("; ")
    }
}

fn budget_message(broken: &[BudgetCheck]) -> String {
    let each: Vec<String> = broken
        .iter()
        .map(|c| {
            format!(
                "budget {} {:.0}ms broken: {:.0}ms",
                c.kind, c.limit_ms, c.actual_ms
            )
        })
        .collect();
    each.join(", ")
}

fn join(errors: &[StepError]) -> String {
    let each: Vec<String> = errors.iter().map(ToString::to_string).collect();
    each.join("; ")
}

/// How an outcome differs from the expectation.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub(super) enum Mismatch {
    /// It failed where success was expected.
    #[error("failed ({}): {message}", class_name(*.class))]
    Failed { class: ErrorClass, message: String },
    /// It succeeded where an error was expected.
    #[error("succeeded, but an error was expected")]
    Succeeded,
    /// It failed with another class of error than the expected one.
    #[error(
        "failed with {} where {} was expected: {message}",
        class_name(*.got),
        class_name(*.want)
    )]
    Class {
        got: ErrorClass,
        want: ErrorClass,
        message: String,
    },
    /// Its error message does not match the expected pattern.
    #[error("error message does not match /{pattern}/: {message}")]
    Message { pattern: String, message: String },
}

/// Checks one outcome against the expectation; Err says why not.
pub(super) fn check_expect(
    expect: &Expect,
    class: Option<ErrorClass>,
    message: &str,
) -> Result<(), Mismatch> {
    match (expect, class) {
        (Expect::Ok, None) => Ok(()),
        (Expect::Ok, Some(c)) => Err(Mismatch::Failed {
            class: c,
            message: message.to_owned(),
        }),
        (Expect::Error { .. }, None) => Err(Mismatch::Succeeded),
        (Expect::Error { code, message: re }, Some(c)) => {
            if !code.accepts(c) {
                return Err(Mismatch::Class {
                    got: c,
                    want: *code,
                    message: message.to_owned(),
                });
            }
            if let Some(re) = re {
                let ok = regex::Regex::new(re)
                    .map(|r| r.is_match(message))
                    .unwrap_or(false);
                if !ok {
                    return Err(Mismatch::Message {
                        pattern: re.clone(),
                        message: message.to_owned(),
                    });
                }
            }
            Ok(())
        }
    }
}

fn class_name(c: ErrorClass) -> String {
    serde_json::to_value(c)
        .ok()
        .and_then(|v| v.as_str().map(str::to_owned))
        .unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn expectations() {
        assert!(check_expect(&Expect::Ok, None, "").is_ok());
        assert!(
            check_expect(&Expect::Ok, Some(ErrorClass::Failed), "boom")
                .unwrap_err()
                .to_string()
                .contains("boom")
        );
        let nf = Expect::Error {
            code: ErrorClass::NotFound,
            message: Some("no such key".into()),
        };
        assert!(check_expect(&nf, Some(ErrorClass::NotFound), "kt: error: no such key x").is_ok());
        assert!(check_expect(&nf, Some(ErrorClass::NotFound), "other").is_err());
        assert!(check_expect(&nf, Some(ErrorClass::Invalid), "no such key").is_err());
        assert!(check_expect(&nf, None, "").is_err());
        let any = Expect::Error {
            code: ErrorClass::Any,
            message: None,
        };
        assert!(check_expect(&any, Some(ErrorClass::Unavailable), "x").is_ok());
    }

    /// The messages are the runner's words as they were when they were
    /// strings: snapshots and `expect` patterns compare them.
    #[test]
    fn messages_keep_their_words() {
        let nf = Expect::Error {
            code: ErrorClass::NotFound,
            message: Some("no such key".into()),
        };
        let said = |e: &Expect, c, m| check_expect(e, c, m).unwrap_err().to_string();
        assert_eq!(
            said(&Expect::Ok, Some(ErrorClass::NotFound), "kt: error: x"),
            "failed (not-found): kt: error: x"
        );
        assert_eq!(said(&nf, None, ""), "succeeded, but an error was expected");
        assert_eq!(
            said(&nf, Some(ErrorClass::Invalid), "bad"),
            "failed with invalid where not-found was expected: bad"
        );
        assert_eq!(
            said(&nf, Some(ErrorClass::NotFound), "other"),
            "error message does not match /no such key/: other"
        );
        let m = Mismatch::Succeeded;
        let pods = |n: usize| StepError::Pods {
            failed: (0..n).map(|i| (format!("p-{i}"), m.clone())).collect(),
            pods: 10,
        };
        assert_eq!(
            pods(2).to_string(),
            "p-0: succeeded, but an error was expected; p-1: succeeded, but an error was expected"
        );
        assert_eq!(
            pods(4).to_string(),
            "4 of 10 pods: p-0: succeeded, but an error was expected; \
             p-1: succeeded, but an error was expected; \
             p-2: succeeded, but an error was expected; ..."
        );
        assert_eq!(
            StepError::Timeout(Duration::from_millis(1500)).to_string(),
            "timed out after 1s 500ms"
        );
        let check = |kind: &str, limit_ms, actual_ms| BudgetCheck {
            kind: kind.to_owned(),
            limit_ms,
            actual_ms,
            ok: false,
        };
        assert_eq!(
            StepError::Budget(vec![check("max", 100.0, 120.4), check("p50", 20.0, 30.0)])
                .to_string(),
            "budget max 100ms broken: 120ms, budget p50 20ms broken: 30ms"
        );
        assert_eq!(
            StepError::Verify {
                pod: "g".into(),
                path: PathBuf::from("/w/pods/g/get/x"),
                got: (3, 30),
                sets: "a or b".into(),
                want: (4, 40),
            }
            .to_string(),
            "g: /w/pods/g/get/x (3 files, 30 bytes) does not equal data set a or b (4 files, 40 bytes)"
        );
        let several = StepError::Several(vec![
            StepError::Input("no pod named x".into()),
            StepError::at("the agent of pod y", TargetError::Failed("gone".into())),
        ]);
        assert_eq!(
            several.to_string(),
            "no pod named x; the agent of pod y: gone"
        );
    }
}
