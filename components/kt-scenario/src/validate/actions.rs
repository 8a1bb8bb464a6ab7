//! The checks of each action's body, one method of [`Checker`] per action
//! (the checks every step has, and the dispatch, are in [`Checker::step`]).
//! `body` is the path of the action's mapping (`steps.3.put`).

use super::{BUCKET_MINIMUM, Checker, is_label};
use crate::datasets::{DatasetStep, ReadDatasetStep, WaitDatasetStep};
use crate::format::{
    AssertStep, Condition, ExecStep, Expect, GetStep, KillStep, LinkStep, LsStep, MetricsStep,
    PutStep, PythonStep, RestartStep, RmStep, Signal, SnapshotStep, Step, StopStep, TeardownStep,
    TensorGetStep, TensorLsStep, TensorPutStep, WaitStep,
};

impl Checker<'_> {
    /// `put`: a pod, a key, exactly one source, and its options.
    pub(super) fn put(&mut self, body: &str, p: &PutStep) {
        self.pod(&format!("{body}.pod"), &p.pod);
        self.template(&format!("{body}.key"), &p.key, true);
        match (&p.data, &p.src) {
            (Some(d), None) => self.data(&format!("{body}.data"), d),
            (None, Some(s)) => self.template(&format!("{body}.src"), s, true),
            _ => self.err(
                body,
                "a put needs exactly one of `data` (a data set) or `src` (a path in the pod)",
            ),
        }
        if let Some(l) = &p.locale
            && l != "store"
            && l != "local"
        {
            self.err(&format!("{body}.locale"), "locale is `store` or `local`");
        }
        self.lifespan(body, p.lifespan.as_deref(), p.ttl.as_deref());
        self.durations(
            body,
            &[
                ("deadline", p.deadline.as_deref()),
                ("stall_timeout", p.stall_timeout.as_deref()),
            ],
        );
    }

    /// `get` and `broadcast` (which alone take `group`, `fanout`, `window`
    /// and `timings`).
    pub(super) fn get(&mut self, body: &str, g: &GetStep, broadcast: bool) {
        for (field, set) in [
            ("group", g.group.is_some()),
            ("fanout", g.fanout.is_some()),
            ("window", g.window.is_some()),
            ("timings", g.timings),
        ] {
            if set && !broadcast {
                self.err(
                    &format!("{body}.{field}"),
                    format!(
                        "`{field}` belongs to broadcast steps (use `broadcast:` instead of `get:`)"
                    ),
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
            body,
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

    /// `ls`.
    pub(super) fn ls(&mut self, body: &str, l: &LsStep) {
        self.template(&format!("{body}.prefix"), &l.prefix, false);
        if let Some(p) = &l.pod {
            self.pod(&format!("{body}.pod"), p);
        }
    }

    /// `rm`.
    pub(super) fn rm(&mut self, body: &str, r: &RmStep) {
        self.template(&format!("{body}.key"), &r.key, false);
        if let Some(p) = &r.pod {
            self.pod(&format!("{body}.pod"), p);
        }
    }

    /// `teardown`.
    pub(super) fn teardown(&mut self, body: &str, t: &TeardownStep) {
        if let Some(p) = &t.pod {
            self.pod(&format!("{body}.pod"), p);
        }
    }

    /// `kill`: a component, an agent, or a node alone.
    pub(super) fn kill(&mut self, body: &str, k: &KillStep) {
        if k.node.is_none() {
            return self.victim(body, k.victim());
        }
        let node = k.node.as_deref().unwrap_or_default();
        self.node(&format!("{body}.node"), node);
        if k.component.is_some() || k.agent.is_some() {
            self.err(body, "a node kill names `node` alone");
        }
    }

    /// `restart`: a component or an agent, stopped by TERM or KILL.
    pub(super) fn restart(&mut self, body: &str, r: &RestartStep) {
        self.victim(body, r.victim());
        if r.signal.is_some_and(Signal::freezes) {
            self.err(
                &format!("{body}.signal"),
                "a restart stops with TERM or KILL; freeze with `kill` and signal STOP, thaw with CONT",
            );
        }
    }

    /// `link`: a component's link.
    pub(super) fn link(&mut self, body: &str, l: &LinkStep) {
        self.component(&format!("{body}.component"), &l.component);
    }

    /// `dataset`: apply or delete, where there are nodes.
    pub(super) fn dataset(&mut self, body: &str, d: &DatasetStep) {
        self.nodes(body);
        match (&d.apply, &d.delete) {
            (Some(a), None) => {
                if let Err(e) = crate::datasets::spec_of(a) {
                    self.err(&format!("{body}.apply"), e);
                }
            }
            (None, Some(_)) => {}
            _ => self.err(body, "a dataset step either `apply`s or `delete`s"),
        }
    }

    /// `wait_dataset`: a known phase.
    pub(super) fn wait_dataset(&mut self, body: &str, w: &WaitDatasetStep) {
        self.nodes(body);
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

    /// `read_dataset`.
    pub(super) fn read_dataset(&mut self, body: &str, r: &ReadDatasetStep) {
        self.nodes(body);
        self.pod(&format!("{body}.pod"), &r.pod);
        for (i, d) in r.verify.iter().enumerate() {
            self.data(&format!("{body}.verify.{i}"), d);
        }
    }

    /// `tensor_put`: layout, device, bucket, and a name when held.
    pub(super) fn tensor_put(&mut self, body: &str, p: &TensorPutStep) {
        self.pod(&format!("{body}.pod"), &p.pod);
        self.template(&format!("{body}.key"), &p.key, true);
        self.layout(body, &p.layout, p.repeat);
        self.device(body, p.device.as_deref());
        self.lifespan(body, p.lifespan.as_deref(), p.ttl.as_deref());
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

    /// `tensor_get`: keys and their seeds, layout, device, quorum.
    pub(super) fn tensor_get(&mut self, body: &str, g: &TensorGetStep) {
        self.pod(&format!("{body}.pod"), &g.pod);
        let keys = g.all_keys();
        if keys.is_empty() {
            self.err(body, "a tensor_get needs `key` or `keys`");
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
        self.layout(body, &g.layout, g.repeat);
        self.device(body, g.device.as_deref());
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

    /// `tensor_ls`.
    pub(super) fn tensor_ls(&mut self, body: &str, t: &TensorLsStep) {
        self.pod(&format!("{body}.pod"), &t.pod);
    }

    /// `stop`: a holder an earlier `tensor_put` named.
    pub(super) fn stop(&mut self, body: &str, st: &StopStep) {
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

    /// `wait`: its condition's names and templates.
    pub(super) fn wait(&mut self, body: &str, w: &WaitStep) {
        match &w.condition {
            Condition::Ready(c) => self.component(&format!("{body}.for.ready"), c),
            Condition::Leases(_) => {}
            Condition::Peers(p) => self.template(&format!("{body}.for.peers.key"), &p.key, false),
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
        }
    }

    /// `assert`: at least one check.
    pub(super) fn assert(&mut self, body: &str, a: &AssertStep) {
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
        if a.count.is_none() && a.exists.is_empty() && a.absent.is_empty() && a.files.is_none() {
            self.err(body, "an assert needs count, exists, absent or files");
        }
    }

    /// `snapshot`: a unique name, one capture.
    pub(super) fn snapshot(&mut self, body: &str, s: &SnapshotStep) {
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
                body,
                "a snapshot captures either `metadata: true` or `ls: PREFIX`",
            ),
        }
    }

    /// `metrics`: a component and a kt metric.
    pub(super) fn metrics(&mut self, body: &str, m: &MetricsStep) {
        if m.component != "metadata" && m.component != "store" {
            self.pod(&format!("{body}.component"), &m.component);
        }
        if !m.name.starts_with("kt_") {
            self.err(&format!("{body}.name"), "kt's metrics are named kt_...");
        }
    }

    /// `exec`: a pod, arguments, a program kt or sh.
    pub(super) fn exec(&mut self, body: &str, e: &ExecStep) {
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

    /// `python`: a pod and a script.
    pub(super) fn python(&mut self, body: &str, p: &PythonStep) {
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

    /// `parallel` and `sequence` (their children are checked on their own: [`Step::walk`]).
    pub(super) fn group(&mut self, at: &str, body: &str, step: &Step) {
        if step.children().is_empty() {
            self.err(body, format!("an empty {}", step.action.kind()));
        }
        if step.expect != Expect::Ok {
            self.err(
                &format!("{at}.expect"),
                "groups succeed when all their steps do; put `expect` on the steps",
            );
        }
    }

    /// An `s3_put`: the topology's S3 server and one of its buckets, a
    /// tree data set, a prefix that is empty or ends with `/`.
    pub(super) fn s3_put(&mut self, body: &str, s: &crate::s3::S3PutStep) {
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
    pub(super) fn promql(&mut self, body: &str, q: &crate::prometheus::PromqlStep) {
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
}
