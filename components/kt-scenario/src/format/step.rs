//! A step and its action, from one table.
//!
//! [`actions!`] below is the one list of step actions: each row names the
//! action's YAML key, its [`Action`] variant and body type, whether the
//! step has a result to `record`, and a smallest valid body. From it come
//! the [`Action`] enum, [`ACTIONS`], the keys a step mapping may hold,
//! [`Action::kind`], [`Action::records`] and the step deserializer's
//! dispatch. Adding an action is one row here, plus its checks in
//! [`crate::validate`] and its execution in [`crate::runner`] (both match
//! on [`Action`] exhaustively, so the compiler lists what is missing).
//!
//! A declarative macro rather than a trait implemented once per action:
//! the runner and the validator match on a plain enum (several variants
//! share a body type, `get` and `broadcast` both take a [`GetStep`]), and a
//! trait would need either a registry of boxed deserializers or the same
//! list written out again to build one; the macro keeps the table one
//! readable block of rows.
//!
//! [`Step::walk`] is the one walk over nested steps (`parallel` and
//! `sequence` hold steps): validation and the runner's questions about a
//! scenario ("does it freeze something?") use it.

use std::fmt;
use std::time::Duration;

use serde::de::{self, MapAccess, Visitor};
use serde::{Deserialize, Deserializer};

use super::{
    AssertStep, Budget, ExecStep, Expect, GetStep, KillStep, LinkStep, LsStep, MetricsStep,
    PutStep, PythonStep, RestartStep, RmStep, SnapshotStep, StopStep, TeardownStep, TensorGetStep,
    TensorLsStep, TensorPutStep, WaitStep,
};

/// One step: an action and the fields every step has.
#[derive(Debug, Clone)]
pub struct Step {
    pub name: Option<String>,
    pub expect: Expect,
    pub timeout: Option<Duration>,
    pub budget: Option<Budget>,
    /// Record this step's observable result (ls listing, transfer stats)
    /// in the scenario's snapshot under this name.
    pub record: Option<String>,
    pub action: Action,
}

/// The keys every step may hold beside its action.
const COMMON_KEYS: [&str; 5] = ["name", "expect", "timeout", "budget", "record"];

/// One row of the action table, as data.
#[derive(Debug, Clone, Copy)]
pub struct ActionInfo {
    /// The YAML key (and [`Action::kind`]).
    pub key: &'static str,
    /// Whether the step has a result that `record` can name.
    pub records: bool,
    /// A smallest valid body (in flow YAML), for tests and docs.
    pub example: &'static str,
}

macro_rules! actions {
    ($(
        $(#[doc = $doc:literal])*
        $key:literal => $variant:ident($ty:ty), records: $records:literal, example: $example:literal;
    )*) => {
        /// What a step does: one variant per row of the action table.
        #[derive(Debug, Clone)]
        pub enum Action {
            $( $(#[doc = $doc])* $variant($ty), )*
        }

        /// Every action's key, in the table's order.
        pub const ACTIONS: &[&str] = &[$($key),*];

        /// The action table.
        pub const TABLE: &[ActionInfo] = &[
            $( ActionInfo { key: $key, records: $records, example: $example }, )*
        ];

        /// Every key a step mapping may hold.
        const STEP_KEYS: &[&str] = &[
            COMMON_KEYS[0], COMMON_KEYS[1], COMMON_KEYS[2], COMMON_KEYS[3], COMMON_KEYS[4],
            $($key),*
        ];

        impl Action {
            /// The action's YAML key.
            pub fn kind(&self) -> &'static str {
                match self {
                    $( Action::$variant(_) => $key, )*
                }
            }

            /// Whether the step has a result that `record` can name.
            pub fn records(&self) -> bool {
                match self {
                    $( Action::$variant(_) => $records, )*
                }
            }

            /// The action under `key`, its body read from `map`; None when
            /// `key` names no action.
            fn read<'de, A: MapAccess<'de>>(
                key: &str,
                map: &mut A,
            ) -> Result<Option<Action>, A::Error> {
                Ok(Some(match key {
                    $( $key => Action::$variant(map.next_value()?), )*
                    _ => return Ok(None),
                }))
            }
        }
    };
}

actions! {
    "put" => Put(PutStep), records: true, example: "{ pod: a, key: k, data: d }";
    "get" => Get(GetStep), records: true, example: "{ pod: a, key: k }";
    "ls" => Ls(LsStep), records: true, example: "{}";
    "rm" => Rm(RmStep), records: true, example: "{ key: k }";
    /// A get whose pods join one broadcast tree (`kt get --broadcast`).
    "broadcast" => Broadcast(GetStep), records: true, example: "{ pod: a, key: k }";
    "teardown" => Teardown(TeardownStep), records: true, example: "{ service: s }";
    "kill" => Kill(KillStep), records: false, example: "{ component: store }";
    "restart" => Restart(RestartStep), records: false, example: "{ agent: a }";
    /// Cuts or restores a network link.
    "link" => Link(LinkStep), records: false, example: "{ component: a, state: down }";
    "wait" => Wait(WaitStep), records: false, example: "{ for: { ready: metadata } }";
    "assert" => Assert(AssertStep), records: false, example: "{ exists: [k] }";
    "snapshot" => Snapshot(SnapshotStep), records: false, example: "{ name: s, metadata: true }";
    "exec" => Exec(ExecStep), records: true, example: "{ pod: a, args: [ls] }";
    /// A Python script in pods (`import kt`).
    "python" => Python(PythonStep), records: true, example: "{ pod: a, script: \"print(1)\" }";
    /// Reads one metric from every instance of a component (e.g. the agents
    /// of a pod group) and records its spread.
    "metrics" => Metrics(MetricsStep), records: true, example: "{ component: a, name: kt_x }";
    "tensor_put" => TensorPut(TensorPutStep), records: true,
        example: "{ pod: a, key: k, layout: \"f32[2]\" }";
    "tensor_get" => TensorGet(TensorGetStep), records: true,
        example: "{ pod: a, key: k, layout: \"f32[2]\" }";
    "tensor_ls" => TensorLs(TensorLsStep), records: true, example: "{ pod: a }";
    /// Ends held processes (`tensor_put` with `hold`).
    "stop" => Stop(StopStep), records: false, example: "{ holder: h }";
    /// Applies or deletes a `Dataset` (topology `nodes`).
    "dataset" => Dataset(crate::datasets::DatasetStep), records: false,
        example: "{ delete: d }";
    /// Waits for a `Dataset`'s phase and records its status.
    "wait_dataset" => WaitDataset(crate::datasets::WaitDatasetStep), records: true,
        example: "{ name: d, phase: Ready }";
    /// Schedules a pod onto a node holding a dataset and verifies it there.
    "read_dataset" => ReadDataset(crate::datasets::ReadDatasetStep), records: true,
        example: "{ dataset: d, pod: a }";
    /// Makes an S3 bucket prefix hold a data set (topology `s3`).
    "s3_put" => S3Put(crate::s3::S3PutStep), records: true,
        example: "{ bucket: b, prefix: p/, data: d }";
    /// Bounds one PromQL answer of the topology's Prometheus.
    "promql" => Promql(crate::prometheus::PromqlStep), records: true,
        example: "{ query: up, at_least: 1 }";
    /// Children run at the same time; the step ends when all have.
    "parallel" => Parallel(Vec<Step>), records: false, example: "[ { ls: {} } ]";
    /// Children run one after another (a branch of a `parallel`).
    "sequence" => Sequence(Vec<Step>), records: false, example: "[ { ls: {} } ]";
}

impl Action {
    /// The keys of the actions whose steps can `record`, in table order.
    pub fn recording() -> impl Iterator<Item = &'static str> {
        TABLE.iter().filter(|a| a.records).map(|a| a.key)
    }
}

impl Step {
    /// The steps nested directly in this one (a group's; none for others).
    pub fn children(&self) -> &[Step] {
        match &self.action {
            Action::Parallel(c) | Action::Sequence(c) => c,
            _ => &[],
        }
    }

    /// Visits this step, then every step nested in it, depth first and in
    /// order; `at` is this step's path in the file (`steps.3`), and a
    /// child's path is its group's plus `.KIND.INDEX` (`steps.3.parallel.0`),
    /// as [`crate::locate`] names positions.
    pub fn walk<'s>(&'s self, at: &str, f: &mut impl FnMut(&str, &'s Step)) {
        f(at, self);
        let kind = self.action.kind();
        for (i, c) in self.children().iter().enumerate() {
            c.walk(&format!("{at}.{kind}.{i}"), f);
        }
    }

    /// Does this step, or one nested in it, satisfy `p`?
    pub fn any(&self, p: &impl Fn(&Step) -> bool) -> bool {
        p(self) || self.children().iter().any(|c| c.any(p))
    }
}

impl<'de> Deserialize<'de> for Step {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = Step;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a step: a mapping with one action key (put, get, ls, ...)")
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Step, A::Error> {
                let mut name = None;
                let mut expect = None;
                let mut timeout = None;
                let mut budget = None;
                let mut record = None;
                let mut action: Option<Action> = None;
                while let Some(k) = map.next_key::<String>()? {
                    match k.as_str() {
                        "name" => name = Some(map.next_value()?),
                        "expect" => expect = Some(map.next_value()?),
                        "timeout" => {
                            let s: String = map.next_value()?;
                            timeout =
                                Some(humantime::parse_duration(&s).map_err(de::Error::custom)?)
                        }
                        "budget" => budget = Some(map.next_value()?),
                        "record" => record = Some(map.next_value()?),
                        other => {
                            let Some(a) = Action::read(other, &mut map)? else {
                                return Err(de::Error::unknown_field(other, STEP_KEYS));
                            };
                            if let Some(prev) = &action {
                                return Err(de::Error::custom(format!(
                                    "a step has one action, this one has `{}` and `{}`",
                                    prev.kind(),
                                    a.kind()
                                )));
                            }
                            action = Some(a);
                        }
                    }
                }
                let action = action.ok_or_else(|| {
                    de::Error::custom(format!(
                        "a step needs an action: one of {}",
                        ACTIONS.join(", ")
                    ))
                })?;
                Ok(Step {
                    name,
                    expect: expect.unwrap_or_default(),
                    timeout,
                    budget,
                    record,
                    action,
                })
            }
        }
        d.deserialize_map(V)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn step(yaml: &str) -> Result<Step, String> {
        serde_yaml_ng::from_str(yaml).map_err(|e| e.to_string())
    }

    #[test]
    fn every_action_of_the_table_round_trips() {
        assert_eq!(ACTIONS.len(), TABLE.len());
        for (info, key) in TABLE.iter().zip(ACTIONS) {
            assert_eq!(info.key, *key);
            let s = step(&format!("{{ {key}: {}, name: n }}", info.example))
                .unwrap_or_else(|e| panic!("{key}: {e}"));
            assert_eq!(s.action.kind(), *key);
            assert_eq!(s.action.records(), info.records, "{key}");
            assert_eq!(s.name.as_deref(), Some("n"));
        }
        // Every key is one action, and no action shadows a common key.
        let mut keys: Vec<&str> = STEP_KEYS.to_vec();
        keys.sort_unstable();
        keys.dedup();
        assert_eq!(keys.len(), STEP_KEYS.len(), "a key is listed twice");
        assert_eq!(STEP_KEYS.len(), COMMON_KEYS.len() + ACTIONS.len());
    }

    #[test]
    fn an_unknown_key_is_rejected_naming_the_known_ones() {
        let e = step("{ frobnicate: {} }").unwrap_err();
        assert!(e.contains("unknown field `frobnicate`"), "{e}");
        for key in STEP_KEYS {
            assert!(e.contains(&format!("`{key}`")), "{key} missing from: {e}");
        }
        let e = step("{ name: n }").unwrap_err();
        assert!(e.contains("needs an action: one of put, get"), "{e}");
        let e = step("{ put: { pod: a, key: k }, ls: {} }").unwrap_err();
        assert!(e.contains("has `put` and `ls`"), "{e}");
    }

    #[test]
    fn walk_visits_nested_steps_in_order_with_their_paths() {
        let s =
            step("{ parallel: [ { ls: {} }, { sequence: [ { rm: { key: k } }, { ls: {} } ] } ] }")
                .unwrap();
        let mut seen = Vec::new();
        s.walk("steps.2", &mut |at, s| {
            seen.push(format!("{at} {}", s.action.kind()))
        });
        assert_eq!(
            seen,
            [
                "steps.2 parallel",
                "steps.2.parallel.0 ls",
                "steps.2.parallel.1 sequence",
                "steps.2.parallel.1.sequence.0 rm",
                "steps.2.parallel.1.sequence.1 ls",
            ]
        );
        assert!(s.any(&|s| matches!(s.action, Action::Rm(_))));
        assert!(!s.any(&|s| matches!(s.action, Action::Put(_))));
    }
}
