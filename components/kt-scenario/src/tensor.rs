//! The `kt tensor` steps' plumbing: their command lines, and what the
//! commands' JSON summaries put into a scenario's record (counts, bytes,
//! collectives and digests — never durations, and never which pod got
//! which rank, which varies from run to run).

use serde::Deserialize;
use serde_json::{Value, json};

use crate::argv::Argv;
use crate::format::{TensorBroadcast, TensorGetStep, TensorPutStep};

/// A tensor step's fields that the runner expands before the command line
/// is made: the layout (templates), and the quorum's group and addresses.
#[derive(Debug, Clone, Copy, Default)]
pub struct Resolved<'a> {
    pub layout: &'a str,
    pub group: Option<&'a str>,
    /// The addresses of the pods `broadcast.ips` names.
    pub ips: &'a [String],
}

/// `kt tensor put` of `key` (already expanded).
pub fn put_args(p: &TensorPutStep, key: &str, r: Resolved<'_>) -> Vec<String> {
    let mut a = Argv::new(["tensor", "put", key, "--layout", r.layout]);
    common(&mut a, p.repeat, p.device.as_deref());
    a.opt("--seed", p.seed)
        .opt("--lifespan", p.lifespan.as_deref())
        .opt("--ttl", p.ttl.as_deref())
        .opt("--service", p.service.as_deref());
    if let Some(b) = &p.broadcast {
        broadcast_args(b, r, &mut a);
    }
    a.opt("--bucket", p.bucket.map(|b| b.0))
        .flag("--hold", p.hold)
        .words(["-o", "json"]);
    a.into_vec()
}

/// `kt tensor get` of `keys` (already expanded), verified against the
/// step's seeds.
pub fn get_args(g: &TensorGetStep, keys: &[String], r: Resolved<'_>) -> Vec<String> {
    let mut a = Argv::new(["tensor", "get"]);
    a.words(keys.iter().cloned()).words(["--layout", r.layout]);
    common(&mut a, g.repeat, g.device.as_deref());
    for s in g.all_seeds() {
        a.opt("--seed", Some(s));
    }
    if let Some(b) = &g.broadcast {
        broadcast_args(b, r, &mut a);
    }
    a.flag("--no-pack", !g.pack)
        .opt("--bucket", g.bucket.map(|b| b.0))
        .words(["-o", "json"]);
    a.into_vec()
}

fn common(a: &mut Argv, repeat: Option<u32>, device: Option<&str>) {
    a.opt("--repeat", repeat).opt("--device", device);
}

fn broadcast_args(b: &TensorBroadcast, r: Resolved<'_>, a: &mut Argv) {
    a.flag("--broadcast", true)
        .opt("--group", r.group)
        .opt("--world-size", b.world_size)
        .opt("--window", b.window.as_deref())
        .opt("--ips", (!r.ips.is_empty()).then(|| r.ips.join(",")))
        .opt("--fanout", b.fanout)
        .flag("--pack", b.pack);
}

/// Is `line` what `kt tensor put --hold` prints once it holds the key
/// (`holding KEY (pid P)`)?
pub fn is_holding(line: &str) -> bool {
    line.strip_prefix("holding ")
        .and_then(|rest| rest.trim_end().strip_suffix(')'))
        .and_then(|rest| rest.rsplit_once(" (pid "))
        .is_some_and(|(key, pid)| !key.is_empty() && pid.parse::<u32>().is_ok())
}

/// The summary `kt tensor put -o json` prints.
#[derive(Debug, Clone, Deserialize)]
pub struct PutOutput {
    pub tensors: u64,
    pub bytes: u64,
    /// The broadcast's counters (null without one).
    #[serde(default)]
    pub stats: Value,
}

/// The summary `kt tensor get -o json` prints.
#[derive(Debug, Clone, Deserialize)]
pub struct GetOutput {
    pub keys: Vec<String>,
    pub tensors: u64,
    pub bytes: u64,
    pub collectives: u64,
    pub backend: String,
    pub packed: bool,
    #[serde(default)]
    pub rank: Option<u32>,
    #[serde(default)]
    pub world: Option<u32>,
    /// Ran on a communicator kept from the group's last round.
    #[serde(default)]
    pub reused: bool,
    pub digest: String,
    /// Where the quorum's plan put the rank among its members' nodes
    /// (absent unless the members' agents reported their nodes).
    #[serde(default)]
    pub placement: Option<kt_types::tensor::Placement>,
}

/// The summary line of a command's stdout: the last line that is a JSON
/// object (a held put prints its `holding` line after it).
pub fn summary<T: serde::de::DeserializeOwned>(stdout: &str) -> Result<T, String> {
    let line = stdout
        .lines()
        .rev()
        .find(|l| l.trim_start().starts_with('{'))
        .ok_or_else(|| format!("no JSON summary in kt's output: {stdout}"))?;
    serde_json::from_str(line).map_err(|e| format!("unreadable kt summary ({e}): {line}"))
}

/// One value when every pod agrees on it, else all of them, sorted.
fn agreed(mut values: Vec<Value>) -> Value {
    if values.windows(2).all(|w| w[0] == w[1]) {
        return values.into_iter().next().unwrap_or(Value::Null);
    }
    values.sort_by(|a, b| match (a.as_f64(), b.as_f64()) {
        (Some(x), Some(y)) => x.total_cmp(&y),
        _ => a.to_string().cmp(&b.to_string()),
    });
    Value::Array(values)
}

/// Ranks, sorted: which pod got which varies, the set does not.
fn ranks(values: impl Iterator<Item = Option<u64>>) -> Value {
    let mut r: Vec<u64> = values.flatten().collect();
    r.sort_unstable();
    json!(r)
}

/// Per-field agreement over objects (`rank` becomes `ranks`; times and
/// `version` are left out).
fn merge(objects: &[&serde_json::Map<String, Value>]) -> Value {
    let mut fields: Vec<&String> = objects.iter().flat_map(|o| o.keys()).collect();
    fields.sort();
    fields.dedup();
    let mut out = serde_json::Map::new();
    for f in fields {
        match f.as_str() {
            "seconds" | "call_seconds" | "version" => {}
            "rank" if objects.len() > 1 => {
                out.insert(
                    "ranks".to_owned(),
                    ranks(
                        objects
                            .iter()
                            .map(|o| o.get("rank").and_then(Value::as_u64)),
                    ),
                );
            }
            _ => {
                let v = objects
                    .iter()
                    .map(|o| o.get(f).cloned().unwrap_or(Value::Null))
                    .collect();
                out.insert(f.clone(), agreed(v));
            }
        }
    }
    Value::Object(out)
}

/// The record of a `tensor_put` over its pods.
pub fn put_record(outs: &[PutOutput]) -> Value {
    let mut r = json!({
        "tensors": agreed(outs.iter().map(|o| json!(o.tensors)).collect()),
        "bytes": agreed(outs.iter().map(|o| json!(o.bytes)).collect()),
    });
    if outs.len() > 1 {
        r["pods"] = json!(outs.len());
    }
    let stats: Vec<&serde_json::Map<String, Value>> =
        outs.iter().filter_map(|o| o.stats.as_object()).collect();
    if !stats.is_empty() {
        r["broadcast"] = merge(&stats);
    }
    r
}

/// The record of a `tensor_get` over its pods.
pub fn get_record(outs: &[GetOutput]) -> Value {
    let objects: Vec<serde_json::Map<String, Value>> = outs
        .iter()
        .map(|o| {
            let mut m = serde_json::Map::new();
            m.insert("keys".into(), json!(o.keys));
            m.insert("tensors".into(), json!(o.tensors));
            m.insert("bytes".into(), json!(o.bytes));
            m.insert("collectives".into(), json!(o.collectives));
            m.insert("backend".into(), json!(o.backend));
            m.insert("packed".into(), json!(o.packed));
            m.insert("digest".into(), json!(o.digest));
            if let Some(r) = o.rank {
                m.insert("rank".into(), json!(r));
            }
            if let Some(w) = o.world {
                m.insert("world".into(), json!(w));
            }
            if o.reused {
                m.insert("reused".into(), json!(true));
            }
            if let Some(p) = &o.placement {
                m.insert("placement".into(), json!(p));
            }
            m
        })
        .collect();
    let refs: Vec<&serde_json::Map<String, Value>> = objects.iter().collect();
    let mut r = merge(&refs);
    if outs.len() > 1 {
        r["pods"] = json!(outs.len());
    }
    r
}

/// One agent's registrations as `kt tensor ls -o json` lists them, without
/// what varies from run to run (pids, versions), sorted by key.
pub fn ls_record(stdout: &str) -> Result<Value, String> {
    let regs: Vec<kt_types::tensor::TensorRegistration> = serde_json::from_str(stdout.trim())
        .map_err(|e| format!("unreadable kt tensor ls output ({e}): {stdout}"))?;
    let mut rows: Vec<Value> = regs
        .iter()
        .map(|r| {
            json!({
                "key": r.key.as_str(),
                "tensors": r.tensors,
                "bytes": r.bytes,
                "device": r.device.to_string(),
            })
        })
        .collect();
    rows.sort_by(|a, b| a["key"].to_string().cmp(&b["key"].to_string()));
    Ok(Value::Array(rows))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::format::Size;

    fn put() -> TensorPutStep {
        serde_yaml_ng::from_str("{ pod: p, key: k, layout: \"w=f32[4,4]\" }").unwrap()
    }

    fn get() -> TensorGetStep {
        serde_yaml_ng::from_str("{ pod: p, key: k, layout: \"w=f32[4,4]\" }").unwrap()
    }

    #[test]
    fn put_command_lines() {
        let mut p = put();
        let plain = Resolved {
            layout: &p.layout.clone(),
            ..Resolved::default()
        };
        assert_eq!(
            put_args(&p, "a/b", plain),
            [
                "tensor",
                "put",
                "a/b",
                "--layout",
                "w=f32[4,4]",
                "-o",
                "json"
            ]
        );
        p.repeat = Some(50);
        p.seed = Some(7);
        p.hold = true;
        p.ttl = Some("1h".into());
        p.bucket = Some(Size(1 << 20));
        p.broadcast = Some(TensorBroadcast {
            world_size: Some(5),
            window: Some("2s".into()),
            pack: true,
            fanout: Some(2),
            ..Default::default()
        });
        let ips = vec!["127.0.1.2".to_owned(), "127.0.1.3".to_owned()];
        assert_eq!(
            put_args(
                &p,
                "a/b",
                Resolved {
                    group: Some("g-1"),
                    ips: &ips,
                    ..plain
                }
            )
            .join(" "),
            "tensor put a/b --layout w=f32[4,4] --repeat 50 --seed 7 --ttl 1h --broadcast \
             --group g-1 --world-size 5 --window 2s --ips 127.0.1.2,127.0.1.3 --fanout 2 --pack \
             --bucket 1048576 --hold -o json"
        );
    }

    #[test]
    fn get_command_lines() {
        let mut g = get();
        let r = Resolved {
            layout: "w=f32[4,4]",
            ..Resolved::default()
        };
        g.keys = vec!["x".into()];
        g.seed = Some(3);
        g.pack = false;
        g.device = Some("cuda:0".into());
        assert_eq!(
            get_args(&g, &["a/k".into(), "a/x".into()], r).join(" "),
            "tensor get a/k a/x --layout w=f32[4,4] --device cuda:0 --seed 3 --no-pack -o json"
        );
        g.seed = None;
        g.seeds = vec![1, 2];
        g.pack = true;
        g.broadcast = Some(TensorBroadcast::default());
        assert_eq!(
            get_args(&g, &["a/k".into()], r).join(" "),
            "tensor get a/k --layout w=f32[4,4] --device cuda:0 --seed 1 --seed 2 --broadcast -o json"
        );
    }

    #[test]
    fn holding_lines() {
        assert!(is_holding("holding a/b (pid 42)"));
        assert!(is_holding("holding a/b (pid 42)\r"));
        assert!(!is_holding("holding a/b"));
        assert!(!is_holding("holding  (pid 1)"));
        assert!(!is_holding("holding a/b (pid x)"));
        assert!(!is_holding("{\"op\":\"tensor-put\"}"));
    }

    #[test]
    fn summaries_are_the_json_line() {
        let out = "{\"op\":\"tensor-put\",\"key\":\"a/b\",\"version\":\"v1\",\"tensors\":3,\"bytes\":48,\"stats\":null}\nholding a/b (pid 9)\n";
        let p: PutOutput = summary(out).unwrap();
        assert_eq!((p.tensors, p.bytes), (3, 48));
        assert!(p.stats.is_null());
        assert!(summary::<PutOutput>("holding a/b (pid 9)\n").is_err());
    }

    fn got(rank: Option<u32>, collectives: u64) -> GetOutput {
        GetOutput {
            keys: vec!["a/b".into()],
            tensors: 150,
            bytes: 1 << 20,
            collectives,
            backend: "host".into(),
            packed: true,
            rank,
            world: rank.map(|_| 5),
            reused: false,
            digest: "ab".into(),
            placement: None,
        }
    }

    #[test]
    fn get_records_agree_over_pods_and_never_name_a_pods_rank() {
        let one = get_record(&[got(None, 1)]);
        assert_eq!(
            one,
            json!({ "keys": ["a/b"], "tensors": 150, "bytes": 1048576, "collectives": 1,
                    "backend": "host", "packed": true, "digest": "ab" })
        );
        let many = get_record(&[got(Some(3), 2), got(Some(1), 1), got(Some(2), 2)]);
        assert_eq!(many["pods"], 3);
        assert_eq!(many["ranks"], json!([1, 2, 3]));
        assert_eq!(many["world"], 5);
        assert_eq!(many["collectives"], json!([1, 2, 2]));
        assert_eq!(many["digest"], "ab");
        assert!(many.get("rank").is_none());
    }

    #[test]
    fn put_records_drop_seconds() {
        let p = PutOutput {
            tensors: 3,
            bytes: 48,
            stats: json!({ "tensors": 3, "bytes": 48, "collectives": 1, "seconds": 0.25,
                           "backend": "host", "rank": 0, "world": 4 }),
        };
        let r = put_record(std::slice::from_ref(&p));
        assert_eq!(
            r["broadcast"],
            json!({ "tensors": 3, "bytes": 48, "collectives": 1, "backend": "host",
                    "rank": 0, "world": 4 })
        );
        let mut q = p.clone();
        q.stats["rank"] = json!(1);
        let r = put_record(&[p, q]);
        assert_eq!(r["pods"], 2);
        assert_eq!(r["broadcast"]["ranks"], json!([0, 1]));
        let plain = put_record(&[PutOutput {
            tensors: 1,
            bytes: 4,
            stats: Value::Null,
        }]);
        assert_eq!(plain, json!({ "tensors": 1, "bytes": 4 }));
    }

    #[test]
    fn ls_records_leave_out_pids_and_versions() {
        let out = r#"[{"key":"s/b","version":"v2","pid":7,"tensors":2,"bytes":8,"device":"cpu"},
                      {"key":"s/a","version":"v1","pid":7,"tensors":1,"bytes":4,"device":"cpu"}]"#;
        assert_eq!(
            ls_record(out).unwrap(),
            json!([{ "key": "s/a", "tensors": 1, "bytes": 4, "device": "cpu" },
                   { "key": "s/b", "tensors": 2, "bytes": 8, "device": "cpu" }])
        );
        assert!(ls_record("nope").is_err());
    }
}
