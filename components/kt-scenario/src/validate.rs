//! Loading and checking scenario files: syntax and shape errors from the YAML
//! deserializer, then checks across fields (pods, data sets, templates,
//! regexes, budgets), every one reported as `file:line:column: message`.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::path::{Path, PathBuf};

use crate::format::{Action, Condition, Expect, Scenario, Signal, Step, TensorBroadcast, Victim};
use crate::locate::{Pos, Positions};
use crate::target::parse_link;
use crate::template;

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
            self.step(&format!("steps.{i}"), step);
        }
        for (i, step) in s.finally.iter().enumerate() {
            self.step(&format!("finally.{i}"), step);
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

    /// An `s3_put`: the topology's S3 server and one of its buckets, a
    /// tree data set, a prefix that is empty or ends with `/`.
    fn s3_put(&mut self, body: &str, s: &crate::s3::S3PutStep) {
        match &self.scenario.topology.s3 {
            None => self.err(body, "s3 steps need an S3 server: topology `s3`"),
            Some(spec) if !spec.buckets.contains(&s.bucket) => self.err(
                &format!("{body}.bucket"),
                format!(
                    "no bucket `{}` in topology.s3 (buckets: {:?})",
                    s.bucket, spec.buckets
                ),
            ),
            Some(_) => {}
        }
        self.template(&format!("{body}.prefix"), &s.prefix, false);
        if s.prefix.starts_with('/') || !(s.prefix.is_empty() || s.prefix.ends_with('/')) {
            self.err(
                &format!("{body}.prefix"),
                "a prefix is empty or a folder: `train/`, not `/train` or `tr`",
            );
        }
        self.data(&format!("{body}.data"), &s.data);
        if self
            .scenario
            .data
            .get(&s.data)
            .is_some_and(|d| d.file.is_some())
        {
            self.err(
                &format!("{body}.data"),
                "a single-file data set has no relative names: use a tree",
            );
        }
        if s.concurrency == Some(0) {
            self.err(&format!("{body}.concurrency"), "concurrency is at least 1");
        }
    }

    /// A `promql`: the topology's Prometheus, a query, at least one bound,
    /// bounds in order.
    fn promql(&mut self, body: &str, q: &crate::prometheus::PromqlStep) {
        if self.scenario.topology.prometheus.is_none() {
            self.err(
                body,
                "promql steps need a Prometheus: topology `prometheus`",
            );
        }
        if q.query.trim().is_empty() {
            self.err(&format!("{body}.query"), "a promql step needs a query");
        }
        match (q.at_least, q.at_most) {
            (None, None) => self.err(
                body,
                "a promql step bounds its answer: at_least, at_most or both",
            ),
            (Some(lo), Some(hi)) if lo.0 > hi.0 => {
                self.err(&format!("{body}.at_least"), "at_least is above at_most")
            }
            _ => {}
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
            let records = matches!(
                step.action,
                Action::Put(_)
                    | Action::Get(_)
                    | Action::Broadcast(_)
                    | Action::Ls(_)
                    | Action::Rm(_)
                    | Action::Exec(_)
                    | Action::Python(_)
                    | Action::Metrics(_)
                    | Action::Teardown(_)
                    | Action::TensorPut(_)
                    | Action::TensorGet(_)
                    | Action::TensorLs(_)
                    | Action::WaitDataset(_)
                    | Action::ReadDataset(_)
                    | Action::S3Put(_)
                    | Action::Promql(_)
            );
            if !records {
                self.err(
                    &format!("{at}.record"),
                    format!("a {kind} step has no result to record (put, get, broadcast, ls, rm, exec, python, metrics, teardown and the tensor steps do)"),
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
            Action::Put(p) => {
                self.pod(&format!("{body}.pod"), &p.pod);
                self.template(&format!("{body}.key"), &p.key, true);
                match (&p.data, &p.src) {
                    (Some(d), None) => self.data(&format!("{body}.data"), d),
                    (None, Some(s)) => self.template(&format!("{body}.src"), s, true),
                    _ => self.err(&body, "a put needs exactly one of `data` (a data set) or `src` (a path in the pod)"),
                }
                if let Some(l) = &p.locale
                    && l != "store"
                    && l != "local"
                {
                    self.err(&format!("{body}.locale"), "locale is `store` or `local`");
                }
                self.lifespan(&body, p.lifespan.as_deref(), p.ttl.as_deref());
                self.durations(
                    &body,
                    &[
                        ("deadline", p.deadline.as_deref()),
                        ("stall_timeout", p.stall_timeout.as_deref()),
                    ],
                );
            }
            Action::Get(g) | Action::Broadcast(g) => {
                let broadcast = matches!(step.action, Action::Broadcast(_));
                for (field, set) in [
                    ("group", g.group.is_some()),
                    ("fanout", g.fanout.is_some()),
                    ("window", g.window.is_some()),
                ] {
                    if set && !broadcast {
                        self.err(
                            &format!("{body}.{field}"),
                            format!("`{field}` belongs to broadcast steps (use `broadcast:` instead of `get:`)"),
                        );
                    }
                }
                if let Some(grp) = &g.group {
                    self.template(&format!("{body}.group"), grp, false);
                }
                if g.fanout == Some(0) {
                    self.err(&format!("{body}.fanout"), "fanout must be at least 1");
                }
                self.durations(
                    &body,
                    &[
                        ("window", g.window.as_deref()),
                        ("deadline", g.deadline.as_deref()),
                        ("stall_timeout", g.stall_timeout.as_deref()),
                    ],
                );
                self.pod(&format!("{body}.pod"), &g.pod);
                self.template(&format!("{body}.key"), &g.key, true);
                if let Some(d) = &g.dest {
                    self.template(&format!("{body}.dest"), d, true);
                    if d.starts_with('/') || d.split('/').any(|s| s == "..") {
                        self.err(
                            &format!("{body}.dest"),
                            "dest is a relative path inside the pod",
                        );
                    }
                }
                for (i, v) in g.verify.iter().enumerate() {
                    self.data(&format!("{body}.verify.{i}"), v);
                }
            }
            Action::Ls(l) => {
                self.template(&format!("{body}.prefix"), &l.prefix, false);
                if let Some(p) = &l.pod {
                    self.pod(&format!("{body}.pod"), p);
                }
            }
            Action::Rm(r) => {
                self.template(&format!("{body}.key"), &r.key, false);
                if let Some(p) = &r.pod {
                    self.pod(&format!("{body}.pod"), p);
                }
            }
            Action::Teardown(t) => {
                if let Some(p) = &t.pod {
                    self.pod(&format!("{body}.pod"), p);
                }
            }
            Action::Kill(k) if k.node.is_some() => {
                let node = k.node.as_deref().unwrap_or_default();
                self.node(&format!("{body}.node"), node);
                if k.component.is_some() || k.agent.is_some() {
                    self.err(&body, "a node kill names `node` alone");
                }
            }
            Action::Kill(k) => self.victim(&body, k.victim()),
            Action::Dataset(d) => {
                self.nodes(&body);
                match (&d.apply, &d.delete) {
                    (Some(a), None) => {
                        if let Err(e) = crate::datasets::spec_of(a) {
                            self.err(&format!("{body}.apply"), e);
                        }
                    }
                    (None, Some(_)) => {}
                    _ => self.err(&body, "a dataset step either `apply`s or `delete`s"),
                }
            }
            Action::WaitDataset(w) => {
                self.nodes(&body);
                const PHASES: &[&str] = &["Pending", "Ingesting", "Seeding", "Ready", "Failed"];
                if !PHASES.contains(&w.phase.as_str()) {
                    self.err(
                        &format!("{body}.phase"),
                        format!("phase is one of {PHASES:?}"),
                    );
                }
                if w.ingest_changed.is_some() && !w.new_version {
                    self.err(
                        &format!("{body}.ingest_changed"),
                        "ingest_changed checks the ingest that brought a new version: add `new_version: true`",
                    );
                }
            }
            Action::ReadDataset(r) => {
                self.nodes(&body);
                self.pod(&format!("{body}.pod"), &r.pod);
                for (i, d) in r.verify.iter().enumerate() {
                    self.data(&format!("{body}.verify.{i}"), d);
                }
            }
            Action::S3Put(s) => self.s3_put(&body, s),
            Action::Promql(q) => self.promql(&body, q),
            Action::Link(l) => self.component(&format!("{body}.component"), &l.component),
            Action::Restart(r) => {
                self.victim(&body, r.victim());
                if r.signal.is_some_and(Signal::freezes) {
                    self.err(
                        &format!("{body}.signal"),
                        "a restart stops with TERM or KILL; freeze with `kill` and signal STOP, thaw with CONT",
                    );
                }
            }
            Action::TensorPut(p) => {
                self.pod(&format!("{body}.pod"), &p.pod);
                self.template(&format!("{body}.key"), &p.key, true);
                self.layout(&body, &p.layout, p.repeat);
                self.device(&body, p.device.as_deref());
                self.lifespan(&body, p.lifespan.as_deref(), p.ttl.as_deref());
                if let Some(b) = &p.broadcast {
                    self.tensor_broadcast(&format!("{body}.broadcast"), b);
                }
                if p.bucket
                    .is_some_and(|b| b.0 < kt_types::tensor::MIN_BUCKET_BYTES)
                {
                    self.err(&format!("{body}.bucket"), BUCKET_MINIMUM);
                }
                match (&p.name, p.hold) {
                    (Some(n), true) => {
                        if !is_label(n) {
                            self.err(&format!("{body}.as"), "holder names are lowercase words");
                        } else if !self.holders.insert(n.clone()) {
                            self.err(&format!("{body}.as"), format!("`{n}` holds twice"));
                        }
                    }
                    (None, true) => self.err(
                        &format!("{body}.hold"),
                        "a held put needs `as: NAME`, the name a `stop` step ends it by",
                    ),
                    (Some(_), false) => self.err(
                        &format!("{body}.as"),
                        "`as` names a held process: add `hold: true`",
                    ),
                    (None, false) => {}
                }
            }
            Action::TensorGet(g) => {
                self.pod(&format!("{body}.pod"), &g.pod);
                let keys = g.all_keys();
                if keys.is_empty() {
                    self.err(&body, "a tensor_get needs `key` or `keys`");
                }
                if let Some(k) = &g.key {
                    self.template(&format!("{body}.key"), k, true);
                }
                for (i, k) in g.keys.iter().enumerate() {
                    self.template(&format!("{body}.keys.{i}"), k, true);
                }
                if g.seed.is_some() && !g.seeds.is_empty() {
                    self.err(
                        &format!("{body}.seeds"),
                        "give `seed` (every key) or `seeds` (one per key), not both",
                    );
                } else if g.seeds.len() > 1 && g.seeds.len() != keys.len() {
                    self.err(
                        &format!("{body}.seeds"),
                        format!(
                            "{} seeds for {} keys: give one, or one per key",
                            g.seeds.len(),
                            keys.len()
                        ),
                    );
                }
                self.layout(&body, &g.layout, g.repeat);
                self.device(&body, g.device.as_deref());
                if let Some(b) = &g.broadcast {
                    self.tensor_broadcast(&format!("{body}.broadcast"), b);
                    if !g.pack {
                        self.err(
                            &format!("{body}.pack"),
                            "`pack` is for peer-to-peer gets; a broadcast packs with `broadcast.pack`",
                        );
                    }
                }
                if g.bucket
                    .is_some_and(|b| b.0 < kt_types::tensor::MIN_BUCKET_BYTES)
                {
                    self.err(&format!("{body}.bucket"), BUCKET_MINIMUM);
                }
            }
            Action::TensorLs(t) => self.pod(&format!("{body}.pod"), &t.pod),
            Action::Stop(st) => {
                if !self.holders.contains(&st.holder) {
                    self.err(
                        &format!("{body}.holder"),
                        format!(
                            "no earlier tensor_put holds `{}` (hold: true, as: {})",
                            st.holder, st.holder
                        ),
                    );
                }
            }
            Action::Wait(w) => match &w.condition {
                Condition::Ready(c) => self.component(&format!("{body}.for.ready"), c),
                Condition::Leases(_) => {}
                Condition::Peers(p) => {
                    self.template(&format!("{body}.for.peers.key"), &p.key, false)
                }
                Condition::Members(m) => {
                    self.template(&format!("{body}.for.members.group"), &m.group, false)
                }
                Condition::Key(k) | Condition::NoKey(k) => {
                    self.template(&format!("{body}.for"), k, false)
                }
                // A pod's metrics are its agent's (the first instance of
                // a group).
                Condition::Metric(m) => {
                    self.component(&format!("{body}.for.metric.component"), &m.component)
                }
            },
            Action::Assert(a) => {
                if a.count.is_some() && a.prefix.is_none() {
                    self.err(&format!("{body}.count"), "count needs a prefix");
                }
                if let Some(p) = &a.prefix {
                    self.template(&format!("{body}.prefix"), p, false);
                }
                for (i, k) in a.exists.iter().enumerate() {
                    self.template(&format!("{body}.exists.{i}"), k, false);
                }
                for (i, k) in a.absent.iter().enumerate() {
                    self.template(&format!("{body}.absent.{i}"), k, false);
                }
                if let Some(f) = &a.files {
                    self.pod(&format!("{body}.files.pod"), &f.pod);
                    self.data(&format!("{body}.files.data"), &f.data);
                    self.template(&format!("{body}.files.path"), &f.path, true);
                }
                if a.count.is_none()
                    && a.exists.is_empty()
                    && a.absent.is_empty()
                    && a.files.is_none()
                {
                    self.err(&body, "an assert needs count, exists, absent or files");
                }
            }
            Action::Snapshot(s) => {
                if !is_label(&s.name) {
                    self.err(
                        &format!("{body}.name"),
                        "snapshot names are lowercase words",
                    );
                } else if !self.records.insert(s.name.clone()) {
                    self.err(
                        &format!("{body}.name"),
                        format!("`{}` is recorded twice", s.name),
                    );
                }
                match (&s.ls, s.metadata) {
                    (Some(p), false) => self.template(&format!("{body}.ls"), p, false),
                    (None, true) => {}
                    _ => self.err(
                        &body,
                        "a snapshot captures either `metadata: true` or `ls: PREFIX`",
                    ),
                }
            }
            Action::Metrics(m) => {
                if m.component != "metadata" && m.component != "store" {
                    self.pod(&format!("{body}.component"), &m.component);
                }
                if !m.name.starts_with("kt_") {
                    self.err(&format!("{body}.name"), "kt's metrics are named kt_...");
                }
            }
            Action::Exec(e) => {
                self.pod(&format!("{body}.pod"), &e.pod);
                if e.args.is_empty() {
                    self.err(&format!("{body}.args"), "exec needs arguments");
                }
                for (i, a) in e.args.iter().enumerate() {
                    self.template(&format!("{body}.args.{i}"), a, true);
                }
                if let Some(p) = &e.program
                    && p != "kt"
                    && p != "sh"
                {
                    self.err(&format!("{body}.program"), "program is `kt` or `sh`");
                }
                if let Some(r) = &e.stdout {
                    self.regex(&format!("{body}.stdout"), r);
                }
            }
            Action::Python(p) => {
                self.pod(&format!("{body}.pod"), &p.pod);
                if p.script.trim().is_empty() {
                    self.err(&format!("{body}.script"), "a python step needs a script");
                }
                for (i, a) in p.args.iter().enumerate() {
                    self.template(&format!("{body}.args.{i}"), a, true);
                }
                if let Some(r) = &p.stdout {
                    self.regex(&format!("{body}.stdout"), r);
                }
            }
            Action::Parallel(children) | Action::Sequence(children) => {
                if children.is_empty() {
                    self.err(&body, format!("an empty {kind}"));
                }
                if step.expect != Expect::Ok {
                    self.err(
                        &format!("{at}.expect"),
                        "groups succeed when all their steps do; put `expect` on the steps",
                    );
                }
                for (i, c) in children.iter().enumerate() {
                    self.step(&format!("{body}.{i}"), c);
                }
            }
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
