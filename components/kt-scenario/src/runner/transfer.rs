//! Transfer steps: `put`, `get`, `broadcast`, `ls`, `rm` and `teardown`,
//! each a `kt` command in pods, and the records they leave.

use std::path::Path;
use std::time::Instant;

use kt_types::api::{ListEntry, TransferSummary};
use serde_json::{Value, json};

use super::exec::{Invocation, PodRun};
use super::{Scn, StepError, StepResult};
use crate::argv::Argv;
use crate::data::Digest;
use crate::format::{Action, Auth, Expect, GetStep, LsStep, PutStep, RmStep, Step, TeardownStep};
use crate::template::Context;

impl Scn<'_> {
    /// `put`: `kt put` of a data set or a path in every pod it names.
    pub(super) async fn put(
        &self,
        step: &Step,
        p: &PutStep,
        started: Instant,
        result: &mut StepResult,
    ) -> Result<(), StepError> {
        let pods = self.select(&p.pod);
        let src = match (&p.data, &p.src) {
            (Some(d), _) => Some(
                self.data
                    .get(d)
                    .ok_or_else(|| StepError::Input(format!("no data set {d}")))?
                    .clone(),
            ),
            _ => None,
        };
        let runs = self
            .in_pods(
                &pods,
                Invocation::kt(p.auth),
                |pod, ctx| {
                    let src = match (&src, &p.src) {
                        (Some(host), _) => self.target.data_path(&pod.name, host)?,
                        (None, Some(s)) => ctx.expand(s)?,
                        (None, None) => {
                            return Err(StepError::Input("a put needs data or src".into()));
                        }
                    };
                    let mut a = Argv::new(["put".to_owned(), ctx.expand(&p.key)?]);
                    a.words(["--src".to_owned(), src])
                        .words(["-o", "json"])
                        .opt("--locale", p.locale.as_deref())
                        .opt("--lifespan", p.lifespan.as_deref())
                        .opt("--ttl", p.ttl.as_deref())
                        .opt("--service", p.service.as_deref())
                        .opt("--deadline", p.deadline.as_deref())
                        .opt("--stall-timeout", p.stall_timeout.as_deref());
                    Ok(a.into_vec())
                },
                started,
                &result.index,
            )
            .await;
        self.settle(step, &runs, result)?;
        let sums = self.summaries(&runs, p.max_sent)?;
        result.record = Some(transfer_record(&sums));
        Ok(())
    }

    /// `get` and `broadcast`: `kt get` in every pod named, then the check of
    /// what arrived against `verify`.
    pub(super) async fn get(
        &self,
        step: &Step,
        g: &GetStep,
        started: Instant,
        result: &mut StepResult,
    ) -> Result<(), StepError> {
        let broadcast = matches!(step.action, Action::Broadcast(_));
        let group = g.group.as_deref().map(|t| self.expand(t)).transpose()?;
        let pods = self.select(&g.pod);
        let dest = |ctx: &Context| -> Result<String, StepError> {
            match &g.dest {
                Some(d) => Ok(ctx.expand(d)?),
                None => Ok(format!("get/{}", key_dir(&ctx.expand(&g.key)?))),
            }
        };
        let runs = self
            .in_pods(
                &pods,
                Invocation::kt(g.auth),
                |_, ctx| {
                    let mut a = Argv::new(["get".to_owned(), ctx.expand(&g.key)?]);
                    a.words(["--dest".to_owned(), dest(ctx)?])
                        .words(["-o", "json"])
                        .flag("--no-serve", !g.serve)
                        .flag("--delete", g.delete)
                        .opt("--deadline", g.deadline.as_deref())
                        .opt("--stall-timeout", g.stall_timeout.as_deref());
                    if broadcast {
                        a.flag("--broadcast", true)
                            .opt("--group", group.as_deref())
                            .opt("--fanout", g.fanout)
                            .opt("--timeout", g.window.as_deref());
                    }
                    Ok(a.into_vec())
                },
                started,
                &result.index,
            )
            .await;
        self.settle(step, &runs, result)?;
        let sums = self.summaries(&runs, g.max_sent)?;
        let mut record = transfer_record(&sums);
        if broadcast {
            let groups: std::collections::BTreeSet<&str> = sums
                .iter()
                .filter_map(|s| s.broadcast.as_ref().map(|b| b.group.as_str()))
                .collect();
            if let Some(grp) = group.as_deref().or(groups.first().copied()) {
                record["broadcast"] = self.tree(grp).await?;
            }
            record["groups"] = json!(groups.len());
            if g.timings {
                record["members"] = member_timings(&sums);
            }
        }
        result.record = Some(record);
        if !g.verify.is_empty() && step.expect == Expect::Ok {
            let t = Instant::now();
            let mut want: Vec<(String, Digest)> = Vec::new();
            for n in &g.verify {
                want.push((n.clone(), self.digest_of_set(n).await?));
            }
            for p in &pods {
                let ctx = self.ctx.for_pod(&p.name, p.index);
                let rel = dest(&ctx)?;
                self.target.fetch(&p.name, Path::new(&rel)).await?;
                let path = self.target.pod_dir(&p.name).join(rel);
                self.verify_tree(&p.name, &path, &want).await?;
            }
            result.verify = t.elapsed();
        }
        Ok(())
    }

    /// `ls`: `kt ls` in one pod, recorded as a listing.
    pub(super) async fn ls(
        &self,
        step: &Step,
        l: &LsStep,
        started: Instant,
        result: &mut StepResult,
    ) -> Result<(), StepError> {
        let pod = self.pod_or_first(l.pod.as_deref())?;
        let mut args = Argv::new(["ls".to_owned(), self.expand(&l.prefix)?]);
        args.words(["-o", "json"]);
        let runs = self
            .kt_in(step, &[pod], l.auth, args.into_vec(), started, result)
            .await?;
        if let Some(Ok(o)) = runs.first().map(|r| &r.out)
            && o.status == 0
        {
            let entries: Vec<ListEntry> = serde_json::from_str(&o.stdout).map_err(|e| {
                StepError::Command(format!("unreadable kt ls output ({e}): {}", o.stdout))
            })?;
            result.record = Some(listing(&entries));
        }
        Ok(())
    }

    /// `rm`: `kt rm` in one pod.
    pub(super) async fn rm(
        &self,
        step: &Step,
        r: &RmStep,
        started: Instant,
        result: &mut StepResult,
    ) -> Result<(), StepError> {
        let pod = self.pod_or_first(r.pod.as_deref())?;
        let mut args = Argv::new(["rm".to_owned(), self.expand(&r.key)?]);
        args.flag("-r", r.recursive);
        let runs = self
            .kt_in(step, &[pod], r.auth, args.into_vec(), started, result)
            .await?;
        record_stdout(&runs, result);
        Ok(())
    }

    /// `teardown`: `kt teardown` of a service in one pod.
    pub(super) async fn teardown(
        &self,
        step: &Step,
        t: &TeardownStep,
        started: Instant,
        result: &mut StepResult,
    ) -> Result<(), StepError> {
        let pod = self.pod_or_first(t.pod.as_deref())?;
        let args = vec!["teardown".into(), t.service.clone()];
        let runs = self
            .kt_in(step, &[pod], Auth::Valid, args, started, result)
            .await?;
        record_stdout(&runs, result);
        Ok(())
    }

    /// Transfer summaries of successful put/get runs, checked against `max_sent`.
    fn summaries(
        &self,
        runs: &[PodRun],
        max_sent: Option<crate::format::Size>,
    ) -> Result<Vec<TransferSummary>, StepError> {
        let mut out = Vec::new();
        for run in runs {
            let Ok(o) = &run.out else { continue };
            if o.status != 0 {
                continue;
            }
            // One summary, or one per key of a prefix get (`kt get a/b/`),
            // which counts as the pod's one transfer.
            let text = o.stdout.trim();
            let s = serde_json::from_str::<TransferSummary>(text)
                .or_else(|_| serde_json::from_str::<Vec<TransferSummary>>(text).map(combined))
                .map_err(|e| {
                    let why = format!("unreadable kt summary ({e}): {}", o.stdout);
                    StepError::at(&run.pod, StepError::Command(why))
                })?;
            if let Some(max) = max_sent
                && s.stats.bytes_sent > max.0
            {
                let why = format!(
                    "sent {} bytes, more than max_sent {max}",
                    s.stats.bytes_sent
                );
                return Err(StepError::at(&run.pod, StepError::Check(why)));
            }
            out.push(s);
        }
        Ok(out)
    }
}

/// The summaries of a prefix get's keys as one transfer: files and bytes
/// added up, the longest time.
fn combined(sums: Vec<TransferSummary>) -> TransferSummary {
    let mut all = TransferSummary {
        op: "get".into(),
        key: format!("{} keys", sums.len()),
        files: 0,
        stats: Default::default(),
        unchanged: false,
        seconds: 0.0,
        dest: None,
        broadcast: None,
    };
    for s in sums {
        all.files += s.files;
        all.stats.files_sent += s.stats.files_sent;
        all.stats.bytes_sent += s.stats.bytes_sent;
        all.stats.bytes_skipped += s.stats.bytes_skipped;
        all.seconds = all.seconds.max(s.seconds);
    }
    all
}

/// Each broadcast member's place and where its time went, by rank
/// (`rank`, `parents`, `relayed`, `seconds`, then the phases of
/// [`kt_types::api::MemberTimings`]).
fn member_timings(sums: &[TransferSummary]) -> Value {
    let mut members: Vec<(u32, Value)> = sums
        .iter()
        .filter_map(|s| {
            let b = s.broadcast.as_ref()?;
            let mut m = serde_json::Map::new();
            m.insert("rank".into(), json!(b.rank));
            m.insert("parents".into(), json!(b.parents));
            m.insert("relayed".into(), json!(b.relayed));
            m.insert("seconds".into(), json!(s.seconds));
            if let Some(Value::Object(t)) = b.timings.as_ref().map(|t| json!(t)) {
                m.extend(t);
            }
            Some((b.rank, Value::Object(m)))
        })
        .collect();
    members.sort_by_key(|(rank, _)| *rank);
    Value::Array(members.into_iter().map(|(_, m)| m).collect())
}

/// The observable result of puts/gets: one summary, or totals over pods.
fn transfer_record(sums: &[TransferSummary]) -> Value {
    match sums {
        [s] => json!({
            "files": s.files,
            "files_sent": s.stats.files_sent,
            "bytes_sent": s.stats.bytes_sent,
            "bytes_skipped": s.stats.bytes_skipped,
            "unchanged": s.unchanged,
        }),
        many => json!({
            "pods": many.len(),
            "files": many.iter().map(|s| s.files).max().unwrap_or(0),
            "files_sent_total": many.iter().map(|s| s.stats.files_sent).sum::<u64>(),
            "bytes_sent_total": many.iter().map(|s| s.stats.bytes_sent).sum::<u64>(),
        }),
    }
}

pub(super) fn listing(entries: &[ListEntry]) -> Value {
    Value::Array(
        entries
            .iter()
            .map(|e| {
                let mut v = json!({ "name": e.name, "key": e.key, "has_children": e.has_children });
                if let Some(r) = &e.record {
                    v["record"] = serde_json::to_value(r).unwrap_or(Value::Null);
                }
                v
            })
            .collect(),
    )
}

fn key_dir(key: &str) -> String {
    key.replace('/', "_")
}

/// Records the first pod's stdout lines.
fn record_stdout(runs: &[PodRun], result: &mut StepResult) {
    if let Some(Ok(o)) = runs.first().map(|r| &r.out) {
        result.record = Some(json!({ "stdout": o.stdout.lines().collect::<Vec<_>>() }));
    }
}
