//! Loading and checking scenario files: syntax and shape errors from the YAML
//! deserializer, then checks across fields (pods, data sets, templates,
//! regexes, budgets), every one reported as `file:line:column: message`.
//! [`Checker::step`] checks what every step has and hands the action's body
//! to its own check ([`actions`]); [`Step::walk`] reaches nested steps.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::path::{Path, PathBuf};

use crate::format::{Action, Expect, Scenario, Step, TensorBroadcast, Victim};
use crate::locate::{Pos, Positions};
use crate::target::parse_link;
use crate::template;

mod actions;

/// One problem in a scenario file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Diagnostic {
    pub file: PathBuf,
    pub pos: Pos,
    pub message: String,
}

impl fmt::Display for Diagnostic {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{}:{}:{}: {}",
            self.file.display(),
            self.pos.line,
            self.pos.col,
            self.message
        )
    }
}

/// A scenario that passed every check.
#[derive(Debug, Clone)]
pub struct Loaded {
    pub file: PathBuf,
    pub name: String,
    pub scenario: Scenario,
}

/// Reads and checks one file.
pub fn load(file: &Path) -> Result<Loaded, Vec<Diagnostic>> {
    let src = std::fs::read_to_string(file).map_err(|e| {
        vec![Diagnostic {
            file: file.to_owned(),
            pos: Pos { line: 1, col: 1 },
            message: format!("cannot read: {e}"),
        }]
    })?;
    parse(file, &src)
}

/// Checks `src` as the contents of `file`.
pub fn parse(file: &Path, src: &str) -> Result<Loaded, Vec<Diagnostic>> {
    let scenario: Scenario = serde_yaml_ng::from_str(src).map_err(|e| {
        let pos = e
            .location()
            .map(|l| Pos {
                line: l.line(),
                col: l.column(),
            })
            .unwrap_or(Pos { line: 1, col: 1 });
        // serde_yaml_ng appends " at line L column C"; the position leads instead.
        let msg = e.to_string();
        let msg = msg.split(" at line ").next().unwrap_or(&msg).to_owned();
        vec![Diagnostic {
            file: file.to_owned(),
            pos,
            message: msg,
        }]
    })?;
    let name = scenario.name.clone().unwrap_or_else(|| {
        file.file_stem()
            .map(|s| s.to_string_lossy().into_owned())
            .unwrap_or_default()
    });
    let mut c = Checker {
        file,
        pos: Positions::index(src),
        out: Vec::new(),
        pods: BTreeMap::new(),
        records: BTreeSet::new(),
        holders: BTreeSet::new(),
        scenario: &scenario,
    };
    c.check(&name);
    if c.out.is_empty() {
        Ok(Loaded {
            file: file.to_owned(),
            name,
            scenario,
        })
    } else {
        c.out.sort_by_key(|d| (d.pos.line, d.pos.col));
        Err(c.out)
    }
}

const BUCKET_MINIMUM: &str = "buckets are at least 1MiB (kt_types::tensor::MIN_BUCKET_BYTES)";

struct Checker<'a> {
    file: &'a Path,
    pos: Positions,
    out: Vec<Diagnostic>,
    /// Pod group and instance names → number of instances.
    pods: BTreeMap<String, usize>,
    records: BTreeSet<String>,
    /// `as` names of held tensor puts, in step order.
    holders: BTreeSet<String>,
    scenario: &'a Scenario,
}

fn is_label(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 40
        && s.bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
        && !s.starts_with('-')
        && !s.ends_with('-')
}

impl Checker<'_> {
    fn err(&mut self, path: &str, message: impl Into<String>) {
        self.out.push(Diagnostic {
            file: self.file.to_owned(),
            pos: self.pos.of(path),
            message: message.into(),
        });
    }

    fn check(&mut self, name: &str) {
        let s = self.scenario;
        if !is_label(name) {
            self.err(
                "name",
                format!("scenario name `{name}` must be lowercase letters, digits and dashes"),
            );
        }
        for (i, t) in s.tags.iter().enumerate() {
            if !is_label(t) {
                self.err(
                    &format!("tags.{i}"),
                    format!("tag `{t}` must be a lowercase word"),
                );
            }
        }
        if let Some(l) = &s.topology.link
            && let Err(e) = parse_link(l)
        {
            self.err("topology.link", e);
        }
        for (i, p) in s.topology.pods.iter().enumerate() {
            let at = format!("topology.pods.{i}");
            if !is_label(&p.name) {
                self.err(
                    &format!("{at}.name"),
                    format!("pod name `{}` must be a DNS label", p.name),
                );
            }
            if p.replicas == 0 {
                self.err(&format!("{at}.replicas"), "replicas must be at least 1");
            }
            if let Some(l) = &p.link
                && let Err(e) = parse_link(l)
            {
                self.err(&format!("{at}.link"), e);
            }
            if let Some(why) = (p.node.as_deref()).and_then(kt_types::tensor::node_name_problem) {
                self.err(&format!("{at}.node"), why);
            }
            let mut names = vec![p.name.clone()];
            if p.replicas > 1 {
                names.extend((0..p.replicas).map(|r| format!("{}-{r}", p.name)));
            }
            for n in names {
                if self.pods.insert(n.clone(), p.replicas).is_some() {
                    self.err(
                        &format!("{at}.name"),
                        format!("pod name `{n}` is used twice"),
                    );
                }
            }
        }
        let m = &s.topology.metadata;
        for (name, v) in [
            ("agent_ttl", &m.agent_ttl),
            ("heartbeat_interval", &m.heartbeat_interval),
            ("lease_ttl", &m.lease_ttl),
        ] {
            if let Some(v) = v
                && let Err(e) = humantime::parse_duration(v)
            {
                self.err(&format!("topology.metadata.{name}"), format!("{name}: {e}"));
            }
        }
        if let Some(l) = &s.topology.store.link
            && let Err(e) = parse_link(l)
        {
            self.err("topology.store.link", e);
        }
        if let Some(cs) = s.topology.store.chunk_size
            && (!cs.0.is_power_of_two() || cs.0 < 4096)
        {
            self.err(
                "topology.store.chunk_size",
                "chunk_size must be a power of two of at least 4KiB",
            );
        }
        if let Some(s3) = &s.topology.s3 {
            if s3.buckets.is_empty() {
                self.err("topology.s3.buckets", "name at least one bucket");
            }
            for (i, b) in s3.buckets.iter().enumerate() {
                if let Some(problem) = crate::s3::bucket_problem(b) {
                    self.err(&format!("topology.s3.buckets.{i}"), problem);
                }
            }
        }
        for (name, message) in crate::data::check(&s.data) {
            self.err(&format!("data.{name}"), message);
        }
        if s.steps.is_empty() {
            self.err("steps", "a scenario needs at least one step");
        }
        for (i, step) in s.steps.iter().enumerate() {
            step.walk(&format!("steps.{i}"), &mut |at, st| self.step(at, st));
        }
        for (i, step) in s.finally.iter().enumerate() {
            step.walk(&format!("finally.{i}"), &mut |at, st| self.step(at, st));
        }
    }

    fn template(&mut self, path: &str, value: &str, per_pod: bool) {
        match template::names(value) {
            Err(e) => self.err(path, e.to_string()),
            Ok(names) => {
                for n in names {
                    let known = matches!(n.as_str(), "scenario" | "run")
                        || (n == "s3" && self.scenario.topology.s3.is_some())
                        || (per_pod && matches!(n.as_str(), "pod" | "index"))
                        || n.strip_prefix("vars.")
                            .is_some_and(|v| self.scenario.vars.contains_key(v));
                    if !known {
                        let hint = if matches!(n.as_str(), "pod" | "index") {
                            " (pod and index exist only in fields evaluated per pod)"
                        } else {
                            ""
                        };
                        self.err(path, format!("unknown template variable `{n}`{hint}"));
                    }
                }
            }
        }
    }

    fn pod(&mut self, path: &str, name: &str) {
        if !self.pods.contains_key(name) {
            let known: Vec<&String> = self.pods.keys().collect();
            self.err(
                path,
                format!("no pod named `{name}` in the topology (pods: {known:?})"),
            );
        }
    }

    /// A step that needs the topology's `nodes`.
    fn nodes(&mut self, path: &str) {
        if self.scenario.topology.nodes.is_none() {
            self.err(
                path,
                "dataset steps need Kubernetes nodes: topology `nodes: N`",
            );
        }
    }

    fn node(&mut self, path: &str, name: &str) {
        self.nodes(path);
        let count = self.scenario.topology.nodes.as_ref().map_or(0, |n| n.count);
        if !(1..=count).any(|i| format!("node-{i}") == name) {
            self.err(
                path,
                format!("no node named `{name}` (nodes are node-1..node-{count})"),
            );
        }
    }

    fn component(&mut self, path: &str, name: &str) {
        if name != "metadata" && name != "store" && !self.pods.contains_key(name) {
            self.err(
                path,
                format!("`{name}` is not a component: use metadata, store or a pod name"),
            );
        }
    }

    /// A put's `lifespan` and `ttl`.
    fn lifespan(&mut self, body: &str, lifespan: Option<&str>, ttl: Option<&str>) {
        if let Some(l) = lifespan
            && l != "cluster"
            && l != "resource"
        {
            self.err(
                &format!("{body}.lifespan"),
                "lifespan is `cluster` or `resource`",
            );
        }
        if let Some(t) = ttl
            && let Err(e) = humantime::parse_duration(t)
        {
            self.err(&format!("{body}.ttl"), format!("ttl: {e}"));
        }
    }

    fn victim(&mut self, body: &str, v: Result<Victim<'_>, &'static str>) {
        match v {
            Ok(Victim::Component(c)) => self.component(&format!("{body}.component"), c),
            Ok(Victim::Agent(p)) => self.pod(&format!("{body}.agent"), p),
            Err(e) => self.err(body, e),
        }
    }

    /// Fields that hold a duration such as `30s`.
    fn durations(&mut self, body: &str, fields: &[(&str, Option<&str>)]) {
        for (field, value) in fields {
            if let Some(v) = value
                && humantime::parse_duration(v).is_err()
            {
                self.err(
                    &format!("{body}.{field}"),
                    format!("{v:?} is not a duration like 30s"),
                );
            }
        }
    }

    fn layout(&mut self, body: &str, layout: &str, repeat: Option<u32>) {
        if repeat == Some(0) {
            self.err(&format!("{body}.repeat"), "repeat must be at least 1");
        }
        let at = format!("{body}.layout");
        let before = self.out.len();
        self.template(&at, layout, false);
        if self.out.len() > before {
            return;
        }
        // Layouts name no run: only `vars` matter to their shape.
        let ctx = template::Context::new("", "", &self.scenario.vars);
        match ctx.expand(layout) {
            Err(e) => self.err(&at, e.to_string()),
            Ok(l) => {
                if let Err(e) = kt_client::tensor::layout::parse(&l, repeat.unwrap_or(1)) {
                    self.err(&at, format!("layout: {e}"));
                }
            }
        }
    }

    fn device(&mut self, body: &str, device: Option<&str>) {
        let Some(d) = device else { return };
        match d.parse::<kt_types::tensor::Device>() {
            Err(e) => self.err(&format!("{body}.device"), format!("device: {e}")),
            Ok(kt_types::tensor::Device::Cuda(_)) if !self.gpu() => self.err(
                &format!("{body}.device"),
                "CUDA tensors need a CUDA machine: tag the scenario `gpu` so it runs only where there is one",
            ),
            Ok(_) => {}
        }
    }

    fn gpu(&self) -> bool {
        let s = self.scenario;
        s.tags.iter().any(|t| t == "gpu") || s.topology.pods.iter().any(|p| p.gpu)
    }

    fn tensor_broadcast(&mut self, at: &str, b: &TensorBroadcast) {
        if let Some(g) = &b.group {
            self.template(&format!("{at}.group"), g, false);
        }
        if b.world_size == Some(0) {
            self.err(&format!("{at}.world_size"), "world_size must be at least 1");
        }
        if b.fanout == Some(0) {
            self.err(&format!("{at}.fanout"), "fanout must be at least 1");
        }
        if let Some(w) = &b.window
            && humantime::parse_duration(w).is_err()
        {
            self.err(
                &format!("{at}.window"),
                format!("{w:?} is not a duration like 30s"),
            );
        }
        for (i, p) in b.ips.iter().enumerate() {
            self.pod(&format!("{at}.ips.{i}"), p);
        }
    }

    fn data(&mut self, path: &str, name: &str) {
        if !self.scenario.data.contains_key(name) {
            self.err(path, format!("no data set named `{name}` under `data:`"));
        }
    }

    fn regex(&mut self, path: &str, re: &str) {
        if let Err(e) = regex::Regex::new(re) {
            self.err(path, format!("invalid regex: {e}"));
        }
    }

    fn step(&mut self, at: &str, step: &Step) {
        let kind = step.action.kind();
        let body = format!("{at}.{kind}");
        if let Expect::Error {
            message: Some(m), ..
        } = &step.expect
        {
            self.regex(&format!("{at}.expect.message"), m);
        }
        if let Some(r) = &step.record {
            let records = step.action.records();
            if !records {
                self.err(
                    &format!("{at}.record"),
                    format!(
                        "a {kind} step has no result to record ({} do)",
                        Action::recording().collect::<Vec<_>>().join(", ")
                    ),
                );
            } else if !is_label(r) {
                self.err(&format!("{at}.record"), "record names are lowercase words");
            } else if !self.records.insert(r.clone()) {
                self.err(&format!("{at}.record"), format!("`{r}` is recorded twice"));
            }
        }
        if let Some(b) = &step.budget {
            if let (Some(min), Some(max)) = (b.min, b.max)
                && min > max
            {
                self.err(&format!("{at}.budget"), "budget min is above max");
            }
            if b.max.is_none() && b.p50.is_none() && b.p95.is_none() && b.min.is_none() {
                self.err(
                    &format!("{at}.budget"),
                    "an empty budget: give max, min, p50 or p95",
                );
            }
            if matches!(step.action, Action::Parallel(_) | Action::Sequence(_))
                && (b.p50.is_some() || b.p95.is_some())
            {
                self.err(
                    &format!("{at}.budget"),
                    "p50/p95 apply to steps that run in pods, not to groups",
                );
            }
        }
        match &step.action {
            Action::Put(p) => self.put(&body, p),
            Action::Get(g) => self.get(&body, g, false),
            Action::Broadcast(g) => self.get(&body, g, true),
            Action::Ls(l) => self.ls(&body, l),
            Action::Rm(r) => self.rm(&body, r),
            Action::Teardown(t) => self.teardown(&body, t),
            Action::Kill(k) => self.kill(&body, k),
            Action::Restart(r) => self.restart(&body, r),
            Action::Link(l) => self.link(&body, l),
            Action::Wait(w) => self.wait(&body, w),
            Action::Assert(a) => self.assert(&body, a),
            Action::Snapshot(s) => self.snapshot(&body, s),
            Action::Exec(e) => self.exec(&body, e),
            Action::Python(p) => self.python(&body, p),
            Action::Metrics(m) => self.metrics(&body, m),
            Action::TensorPut(p) => self.tensor_put(&body, p),
            Action::TensorGet(g) => self.tensor_get(&body, g),
            Action::TensorLs(t) => self.tensor_ls(&body, t),
            Action::Stop(st) => self.stop(&body, st),
            Action::Dataset(d) => self.dataset(&body, d),
            Action::WaitDataset(w) => self.wait_dataset(&body, w),
            Action::ReadDataset(r) => self.read_dataset(&body, r),
            Action::S3Put(s) => self.s3_put(&body, s),
            Action::Promql(q) => self.promql(&body, q),
            Action::Parallel(_) | Action::Sequence(_) => self.group(at, &body, step),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn errors(src: &str) -> Vec<String> {
        match parse(Path::new("s.yaml"), src) {
            Ok(_) => vec![],
            Err(d) => d.iter().map(|d| d.to_string()).collect(),
        }
    }

    const GOOD: &str = "\
tags: [smoke]
topology:
  pods:
    - name: producer
    - name: getter
      replicas: 3
data:
  tree: { seed: 1, files: 10 }
steps:
  - put: { pod: producer, key: \"{{scenario}}/t\", data: tree }
  - get: { pod: getter, key: \"{{scenario}}/t\", verify: [tree], dest: \"out/{{pod}}\" }
    budget: { p95: 5s }
  - parallel:
      - kill: { component: store }
      - sequence:
          - wait: { for: { ready: metadata } }
  - exec: { pod: getter-1, args: [ls] }
    expect: { error: not-found, message: \"no key\" }
";

    #[test]
    fn a_good_file_loads() {
        let l = parse(Path::new("dir/roundtrip.yaml"), GOOD).unwrap();
        assert_eq!(l.name, "roundtrip");
        assert_eq!(l.scenario.steps.len(), 4);
    }

    #[test]
    fn shape_errors_carry_line_and_column() {
        let e = errors("steps:\n  - put: { pod: a, key: k, dta: x }\n");
        assert_eq!(e.len(), 1, "{e:?}");
        assert!(e[0].starts_with("s.yaml:2:"), "{e:?}");
        assert!(e[0].contains("unknown field `dta`"), "{e:?}");

        let e = errors("steps:\n  - frobnicate: {}\n");
        assert!(
            e[0].starts_with("s.yaml:2:") && e[0].contains("frobnicate"),
            "{e:?}"
        );

        let e = errors("steps:\n  - put: { pod: a, key: k }\n    get: { pod: a, key: k }\n");
        assert!(e[0].contains("one action"), "{e:?}");
    }

    #[test]
    fn cross_field_errors_point_at_the_field() {
        let src = "\
topology:
  pods: [ { name: a } ]
steps:
  - put: { pod: b, key: \"{{nope}}\", data: missing }
  - wait: { for: { ready: nobody } }
  - exec: { pod: a, args: [x], stdout: \"(\" }
";
        let e = errors(src);
        assert!(
            e.iter()
                .any(|m| m.starts_with("s.yaml:4:17:") && m.contains("no pod named `b`")),
            "{e:?}"
        );
        assert!(
            e.iter()
                .any(|m| m.starts_with("s.yaml:4:") && m.contains("`nope`")),
            "{e:?}"
        );
        assert!(
            e.iter().any(|m| m.contains("no data set named `missing`")),
            "{e:?}"
        );
        assert!(
            e.iter()
                .any(|m| m.starts_with("s.yaml:5:") && m.contains("`nobody`")),
            "{e:?}"
        );
        assert!(
            e.iter()
                .any(|m| m.starts_with("s.yaml:6:") && m.contains("invalid regex")),
            "{e:?}"
        );
    }

    #[test]
    fn per_pod_names_only_where_evaluated_per_pod() {
        let src = "topology: { pods: [ { name: a } ] }\nsteps:\n  - rm: { key: \"x/{{pod}}\" }\n";
        let e = errors(src);
        assert!(e[0].contains("only in fields evaluated per pod"), "{e:?}");
    }

    #[test]
    fn broadcast_options_only_in_broadcast_steps() {
        let src = "topology: { pods: [ { name: a } ] }\nsteps:\n  - get: { pod: a, key: k, fanout: 2 }\n  - broadcast: { pod: a, key: k, fanout: 0, window: soon }\n";
        let e = errors(src);
        assert!(
            e[0].starts_with("s.yaml:3:") && e[0].contains("belongs to broadcast steps"),
            "{e:?}"
        );
        assert!(e[1].contains("at least 1"), "{e:?}");
        assert!(e[2].contains("not a duration"), "{e:?}");
    }

    #[test]
    fn patience_durations_freezes_and_pod_metrics_are_checked() {
        let src = "topology: { pods: [ { name: a } ] }\nsteps:\n  - get: { pod: a, key: k, deadline: later }\n  - put: { pod: a, key: k, src: x, stall_timeout: 2 }\n  - restart: { component: store, signal: STOP }\n  - kill: { component: a, signal: STOP }\n  - wait: { for: { metric: { component: a, name: m, at_least: 1 } } }\n  - wait: { for: { metric: { component: b, name: m, at_least: 1 } } }\n";
        let e = errors(src);
        assert_eq!(e.len(), 4, "{e:?}");
        assert!(
            e[0].starts_with("s.yaml:3:") && e[0].contains("\"later\" is not a duration"),
            "{e:?}"
        );
        assert!(
            e[1].starts_with("s.yaml:4:") && e[1].contains("not a duration"),
            "{e:?}"
        );
        assert!(
            e[2].starts_with("s.yaml:5:") && e[2].contains("freeze with `kill`"),
            "{e:?}"
        );
        // A pod's metrics are fine (line 7); an unknown component is not.
        assert!(
            e[3].starts_with("s.yaml:8:") && e[3].contains("`b` is not a component"),
            "{e:?}"
        );
    }

    #[test]
    fn link_cuts_name_a_component_and_a_state() {
        let good = "topology: { pods: [ { name: a } ] }\nsteps:\n  - link: { component: a, state: down }\n  - link: { component: store, state: up }\n";
        assert!(errors(good).is_empty(), "{:?}", errors(good));
        let e = errors(
            "topology: { pods: [ { name: a } ] }\nsteps:\n  - link: { component: b, state: down }\n",
        );
        assert!(
            e.len() == 1
                && e[0].starts_with("s.yaml:3:")
                && e[0].contains("`b` is not a component"),
            "{e:?}"
        );
        let e = errors(
            "topology: { pods: [ { name: a } ] }\nsteps:\n  - link: { component: a, state: sideways }\n",
        );
        assert!(e.len() == 1 && e[0].contains("sideways"), "{e:?}");
    }

    #[test]
    fn link_rates_are_checked_for_pods_and_the_store() {
        let good = "topology:\n  link: 1gbit\n  store: { chunk_size: 4MiB, link: 1gbit }\n  pods: [ { name: a, link: 100mbit } ]\nsteps:\n  - ls: {}\n";
        assert!(errors(good).is_empty(), "{:?}", errors(good));
        let src = "topology:\n  store:\n    link: fast\n  pods:\n    - { name: a, link: 10mb }\nsteps:\n  - ls: {}\n";
        let e = errors(src);
        assert_eq!(e.len(), 2, "{e:?}");
        assert!(
            e.iter()
                .any(|m| m.starts_with("s.yaml:3:") && m.contains("`fast` is not a link rate")),
            "{e:?}"
        );
        assert!(
            e.iter()
                .any(|m| m.starts_with("s.yaml:5:") && m.contains("unknown link rate unit")),
            "{e:?}"
        );
    }

    const TENSORS: &str = "\
topology:
  pods: [ { name: trainer }, { name: worker, replicas: 3 } ]
steps:
  - tensor_put: { pod: trainer, key: \"{{scenario}}/w\", layout: \"w=f32[64,64];b=f16[64]\", repeat: 50,
                  seed: 7, hold: true, as: weights }
    record: put
  - tensor_get: { pod: worker, key: \"{{scenario}}/w\", layout: \"w=f32[64,64];b=f16[64]\", repeat: 50,
                  seed: 7, pack: false, bucket: 1MiB }
    record: got
  - parallel:
      - tensor_put: { pod: trainer, key: b, layout: \"u8[1024]\", seed: 1,
                      broadcast: { group: \"g-{{run}}\", world_size: 4, pack: true }, bucket: 2MiB }
      - tensor_get: { pod: worker, keys: [b], seeds: [1], layout: \"u8[1024]\",
                      broadcast: { group: \"g-{{run}}\", world_size: 4, window: 5s, ips: [worker, trainer] } }
  - tensor_ls: { pod: trainer }
    record: regs
  - restart: { agent: trainer }
  - kill: { agent: worker-1, signal: TERM }
  - stop: { holder: weights, signal: KILL }
";

    #[test]
    fn tensor_steps_load() {
        let l = parse(Path::new("t.yaml"), TENSORS).unwrap();
        let Action::TensorPut(p) = &l.scenario.steps[0].action else {
            panic!("not a tensor_put")
        };
        assert_eq!((p.repeat, p.seed, p.hold), (Some(50), Some(7), true));
        assert_eq!(p.name.as_deref(), Some("weights"));
        let Action::TensorGet(g) = &l.scenario.steps[1].action else {
            panic!("not a tensor_get")
        };
        assert!(!g.pack);
        assert_eq!(g.bucket, Some(crate::format::Size(1 << 20)));
        let Action::Restart(r) = &l.scenario.steps[4].action else {
            panic!("not a restart")
        };
        assert_eq!(r.victim(), Ok(Victim::Agent("trainer")));
    }

    #[test]
    fn tensor_steps_are_checked() {
        let src = "\
topology:
  pods: [ { name: a } ]
steps:
  - tensor_put: { pod: a, key: k, layout: \"w=c64[2]\", hold: true }
  - tensor_put: { pod: a, key: k, layout: \"f32[2]\", as: x, device: \"cuda:0\", repeat: 0 }
  - tensor_get: { pod: a, layout: \"f32[2]\", seed: 1, seeds: [2], bucket: 64KiB }
  - tensor_get: { pod: a, keys: [k, l, m], seeds: [1, 2], layout: \"f32[2]\",
                  broadcast: { world_size: 0, ips: [nobody], window: soon }, pack: false }
  - stop: { holder: ghost }
  - kill: { component: a, agent: a }
  - restart: { agent: b }
";
        let e = errors(src);
        let has = |line: &str, what: &str| {
            e.iter()
                .any(|m| m.starts_with(&format!("s.yaml:{line}:")) && m.contains(what))
        };
        assert!(has("4", "layout:"), "{e:?}");
        assert!(has("4", "needs `as: NAME`"), "{e:?}");
        assert!(has("5", "add `hold: true`"), "{e:?}");
        assert!(has("5", "tag the scenario `gpu`"), "{e:?}");
        assert!(has("5", "repeat must be at least 1"), "{e:?}");
        assert!(has("6", "needs `key` or `keys`"), "{e:?}");
        assert!(has("6", "not both"), "{e:?}");
        assert!(has("6", "at least 1MiB"), "{e:?}");
        assert!(has("7", "2 seeds for 3 keys"), "{e:?}");
        assert!(has("8", "world_size must be at least 1"), "{e:?}");
        assert!(has("8", "no pod named `nobody`"), "{e:?}");
        assert!(has("8", "not a duration"), "{e:?}");
        assert!(has("8", "broadcast.pack"), "{e:?}");
        assert!(has("9", "no earlier tensor_put holds `ghost`"), "{e:?}");
        assert!(has("10", "exactly one of `component`"), "{e:?}");
        assert!(has("11", "no pod named `b`"), "{e:?}");
    }

    #[test]
    fn cuda_devices_are_fine_in_gpu_scenarios() {
        let src = "tags: [gpu]\ntopology: { pods: [ { name: a } ] }\nsteps:\n  - tensor_get: { pod: a, key: k, layout: \"f32[2]\", device: \"cuda:0\" }\n";
        assert!(errors(src).is_empty(), "{:?}", errors(src));
    }
}
