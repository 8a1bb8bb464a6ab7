//! A real Prometheus in a scenario: topology `prometheus` starts Debian's
//! `prometheus` binary beside the runner, scraping the testbed's metadata
//! server, store and every pod's agent (their URLs as the runner reaches
//! them: loopback on `local`, the namespaces' addresses on `netns`) with
//! the run's token; `promql` steps run an instant query on its HTTP API
//! and bound the one number it returns.
//!
//! ```yaml
//! topology:
//!   prometheus: { scrape_interval: 500ms }   # or `prometheus: true` (1s)
//! steps:
//!   - promql:
//!       query: 'kt_bytes_sent_total{job="store"}'
//!       at_least: 48MiB                      # a number, a size or a duration
//!       at_most: 56MiB
//!     record: store-egress                   # the query and its bounds, never the value
//! ```
//!
//! Jobs are `metadata`, `store` and `agent` (label `pod`: the pod's name).
//! A `promql` step first waits until every target has been scraped since
//! the step began (so what the steps before it did is in the data), then
//! queries once. The query is not a template (PromQL has braces of its
//! own). A failed step's message holds the PromQL, the answer and the
//! bounds; Prometheus's log is in the scenario's work directory.
//!
//! Invariant: the server lives as long as the [`Prometheus`] value (it is
//! killed when dropped).

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, SystemTime};

use serde::{Deserialize, Deserializer};
use serde_json::Value;

use crate::format::OnOrSpec;

/// The binary (Debian's `prometheus` package).
pub const BINARY: &str = "prometheus";

/// How often targets are scraped unless the topology says.
pub const DEFAULT_SCRAPE_INTERVAL: Duration = Duration::from_secs(1);

/// The topology's `prometheus`: `true`, or `{ scrape_interval: 500ms }`.
#[derive(Debug, Clone, PartialEq)]
pub struct PrometheusSpec {
    pub scrape_interval: Duration,
}

impl<'de> Deserialize<'de> for PrometheusSpec {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        #[derive(Deserialize)]
        #[serde(deny_unknown_fields)]
        struct Full {
            #[serde(default, with = "crate::format::opt_duration")]
            scrape_interval: Option<Duration>,
        }
        let full = match OnOrSpec::<Full>::deserialize_for(d, "prometheus")? {
            OnOrSpec::On => None,
            OnOrSpec::Spec(f) => f.scrape_interval,
        };
        Ok(PrometheusSpec {
            scrape_interval: full.unwrap_or(DEFAULT_SCRAPE_INTERVAL),
        })
    }
}

/// A bound of a `promql` result: a number, a size (`48MiB`) or a duration
/// (`250ms`, in seconds).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Bound(pub f64);

impl<'de> Deserialize<'de> for Bound {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum Form {
            Number(f64),
            Text(String),
        }
        match Form::deserialize(d)? {
            Form::Number(n) => Ok(Bound(n)),
            Form::Text(s) => parse_bound(&s).map(Bound).map_err(serde::de::Error::custom),
        }
    }
}

fn parse_bound(s: &str) -> Result<f64, String> {
    if let Ok(n) = s.trim().parse::<f64>() {
        return Ok(n);
    }
    if let Ok(n) = kt_client::size::parse(s) {
        return Ok(n as f64);
    }
    humantime::parse_duration(s.trim())
        .map(|d| d.as_secs_f64())
        .map_err(|_| format!("{s:?} is neither a number, a size (48MiB) nor a duration (250ms)"))
}

/// `promql: { query, at_least, at_most }`.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PromqlStep {
    /// An instant query whose answer is one number (one series or a scalar).
    pub query: String,
    #[serde(default)]
    pub at_least: Option<Bound>,
    #[serde(default)]
    pub at_most: Option<Bound>,
}

impl PromqlStep {
    /// Why `value` is out of bounds, if it is.
    pub fn violation(&self, value: f64) -> Option<String> {
        if value.is_nan() {
            return Some("the answer is NaN (no data, or a quantile of no observations)".into());
        }
        if let Some(Bound(lo)) = self.at_least
            && value < lo
        {
            return Some(format!("{value} is below at_least {lo}"));
        }
        if let Some(Bound(hi)) = self.at_most
            && value > hi
        {
            return Some(format!("{value} is above at_most {hi}"));
        }
        None
    }
}

/// Why no Prometheus can run here, if so.
pub fn unavailable() -> Option<String> {
    let found = std::process::Command::new(BINARY)
        .arg("--version")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    (!found).then(|| {
        "runs Prometheus (topology `prometheus`), whose binary is not here: apt-get install prometheus"
            .to_owned()
    })
}

/// One scrape target: its job, address (`host:port`), scheme and the
/// pod it is the agent of.
#[derive(Debug, Clone, PartialEq)]
pub struct ScrapeTarget {
    pub job: &'static str,
    pub url: String,
    pub pod: Option<String>,
}

/// The scrape configuration for `targets`, each sending the token in
/// `token_file`.
pub fn config(spec: &PrometheusSpec, targets: &[ScrapeTarget], token_file: &Path) -> String {
    let interval = format!("{}ms", spec.scrape_interval.as_millis().max(100));
    let mut out = format!(
        "global:\n  scrape_interval: {interval}\n  scrape_timeout: {interval}\n  evaluation_interval: {interval}\nscrape_configs:\n"
    );
    let mut jobs: Vec<(&str, &str)> = Vec::new();
    for t in targets {
        let scheme = if t.url.starts_with("https://") {
            "https"
        } else {
            "http"
        };
        if !jobs.contains(&(t.job, scheme)) {
            jobs.push((t.job, scheme));
        }
    }
    for (job, scheme) in jobs {
        // Two jobs of one name cannot be; a testbed mixes no schemes.
        out.push_str(&format!(
            "  - job_name: {job}\n    scheme: {scheme}\n    metrics_path: /metrics\n    authorization:\n      type: Bearer\n      credentials_file: {}\n",
            token_file.display()
        ));
        if scheme == "https" {
            out.push_str("    tls_config:\n      insecure_skip_verify: true\n");
        }
        out.push_str("    static_configs:\n");
        for t in targets.iter().filter(|t| t.job == job) {
            let addr = t
                .url
                .trim_start_matches("http://")
                .trim_start_matches("https://")
                .trim_end_matches('/');
            out.push_str(&format!("      - targets: [\"{addr}\"]\n"));
            if let Some(p) = &t.pod {
                out.push_str(&format!("        labels: {{ pod: \"{p}\" }}\n"));
            }
        }
    }
    out
}

/// A running Prometheus.
#[derive(Debug)]
pub struct Prometheus {
    child: tokio::process::Child,
    /// `http://127.0.0.1:PORT`.
    pub url: String,
    pub log: PathBuf,
    /// Targets it scrapes.
    pub targets: usize,
    http: reqwest::Client,
}

impl Drop for Prometheus {
    fn drop(&mut self) {
        let _ = self.child.start_kill();
    }
}

/// A free port on 127.0.0.1 (the kernel's choice, released for the child).
fn free_port() -> std::io::Result<u16> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port())
}

impl Prometheus {
    /// Starts Prometheus in `dir` scraping `targets`, and waits until it
    /// is ready and has scraped each of them once, up (within `wait`).
    pub async fn start(
        spec: &PrometheusSpec,
        targets: Vec<ScrapeTarget>,
        token: &str,
        dir: &Path,
        wait: Duration,
    ) -> Result<Prometheus, String> {
        let io = |what: &str, e: std::io::Error| format!("prometheus: {what}: {e}");
        std::fs::create_dir_all(dir).map_err(|e| io("its directory", e))?;
        let token_file = dir.join("token");
        std::fs::write(&token_file, token).map_err(|e| io("the token file", e))?;
        {
            use std::os::unix::fs::PermissionsExt;
            std::fs::set_permissions(&token_file, std::fs::Permissions::from_mode(0o600))
                .map_err(|e| io("the token file", e))?;
        }
        let config_file = dir.join("prometheus.yml");
        std::fs::write(&config_file, config(spec, &targets, &token_file))
            .map_err(|e| io("its configuration", e))?;
        let log = dir.join("prometheus.log");
        let http = kt_api::client_builder()
            .timeout(Duration::from_secs(5))
            .build()
            .map_err(|e| format!("prometheus: an HTTP client: {e}"))?;
        // The port is free when chosen; if another process takes it before
        // Prometheus binds it, Prometheus exits and another is tried.
        let mut last = String::new();
        for _ in 0..3 {
            let port = free_port().map_err(|e| io("a free port", e))?;
            let url = format!("http://127.0.0.1:{port}");
            let out = std::fs::File::create(&log).map_err(|e| io("its log", e))?;
            let err = out.try_clone().map_err(|e| io("its log", e))?;
            let child = tokio::process::Command::new(BINARY)
                .arg(format!("--config.file={}", config_file.display()))
                .arg(format!(
                    "--storage.tsdb.path={}",
                    dir.join("data").display()
                ))
                .arg(format!("--web.listen-address=127.0.0.1:{port}"))
                .arg("--storage.tsdb.retention.time=1d")
                .arg("--log.level=info")
                .stdin(Stdio::null())
                .stdout(out)
                .stderr(err)
                .kill_on_drop(true)
                .spawn()
                .map_err(|e| io("starting it", e))?;
            let mut p = Prometheus {
                child,
                url,
                log: log.clone(),
                targets: targets.len(),
                http: http.clone(),
            };
            match p.wait_ready(wait).await {
                Ok(()) => return Ok(p),
                Err(e) => last = e,
            }
            if p.child.try_wait().ok().flatten().is_none() {
                // Running but not ready or not scraping: no other port helps.
                return Err(last);
            }
        }
        Err(last)
    }

    /// The end of its log (for errors).
    pub fn log_tail(&self) -> String {
        let text = std::fs::read_to_string(&self.log).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        lines[lines.len().saturating_sub(15)..].join("\n")
    }

    async fn wait_ready(&mut self, wait: Duration) -> Result<(), String> {
        let deadline = tokio::time::Instant::now() + wait;
        loop {
            if let Ok(Some(status)) = self.child.try_wait() {
                return Err(format!(
                    "prometheus exited ({status}) before it was ready:\n{}",
                    self.log_tail()
                ));
            }
            let ready = self
                .http
                .get(format!("{}/-/ready", self.url))
                .send()
                .await
                .is_ok_and(|r| r.status().is_success());
            if ready {
                let up = self.query("count(up == 1)").await.unwrap_or(f64::NAN);
                if up == self.targets as f64 {
                    return Ok(());
                }
            }
            if tokio::time::Instant::now() >= deadline {
                let up = self
                    .query_raw("up")
                    .await
                    .map(|v| v.to_string())
                    .unwrap_or_else(|e| e);
                return Err(format!(
                    "prometheus did not scrape all {} targets up within {wait:?} (up: {up}):\n{}",
                    self.targets,
                    self.log_tail()
                ));
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// Waits until every target has been scraped at or after `since`.
    pub async fn scraped_since(&self, since: SystemTime) -> Result<(), String> {
        let since = since
            .duration_since(SystemTime::UNIX_EPOCH)
            .map(|d| d.as_secs_f64())
            .unwrap_or_default();
        loop {
            let oldest = self.query("min(timestamp(up))").await?;
            let all = self.query("count(up)").await?;
            if oldest >= since && all == self.targets as f64 {
                return Ok(());
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// The `data` of an instant query's answer.
    pub async fn query_raw(&self, query: &str) -> Result<Value, String> {
        let resp = self
            .http
            .get(format!("{}/api/v1/query", self.url))
            .query(&[("query", query)])
            .send()
            .await
            .map_err(|e| format!("querying prometheus: {e}"))?;
        let status = resp.status();
        let body: Value = resp
            .json()
            .await
            .map_err(|e| format!("prometheus's answer ({status}): {e}"))?;
        if body.get("status").and_then(Value::as_str) != Some("success") {
            return Err(format!("prometheus refused the query ({status}): {body}"));
        }
        Ok(body.get("data").cloned().unwrap_or(Value::Null))
    }

    /// An instant query whose answer is one number.
    pub async fn query(&self, query: &str) -> Result<f64, String> {
        one_number(&self.query_raw(query).await?)
    }
}

/// The one number of an instant query's `data`: a scalar or a vector of
/// one sample.
pub fn one_number(data: &Value) -> Result<f64, String> {
    let value = match data.get("resultType").and_then(Value::as_str) {
        Some("scalar") => data.get("result"),
        Some("vector") => {
            let result = data.get("result").and_then(Value::as_array);
            match result.map(Vec::as_slice) {
                Some([one]) => one.get("value"),
                Some(many) => {
                    return Err(format!(
                        "the answer has {} series, not one (aggregate it, e.g. sum(...)): {data}",
                        many.len()
                    ));
                }
                None => None,
            }
        }
        _ => None,
    };
    value
        .and_then(|v| v.get(1))
        .and_then(Value::as_str)
        .and_then(|s| s.parse::<f64>().ok())
        .ok_or_else(|| format!("not one number: {data}"))
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    #[test]
    fn bounds_read_numbers_sizes_and_durations() {
        let b = |s: &str| serde_yaml_ng::from_str::<Bound>(s).map(|b| b.0);
        assert_eq!(b("3").unwrap(), 3.0);
        assert_eq!(b("0.25").unwrap(), 0.25);
        assert_eq!(b("48MiB").unwrap(), (48u64 << 20) as f64);
        assert_eq!(b("250ms").unwrap(), 0.25);
        assert!(b("soon").is_err());
    }

    #[test]
    fn a_step_bounds_its_answer() {
        let step: PromqlStep =
            serde_yaml_ng::from_str("{ query: 'up', at_least: 1, at_most: 2s }").unwrap();
        assert_eq!(step.violation(1.5), None);
        assert!(step.violation(0.5).unwrap().contains("below at_least 1"));
        assert!(step.violation(3.0).unwrap().contains("above at_most 2"));
        assert!(step.violation(f64::NAN).unwrap().contains("NaN"));
    }

    #[test]
    fn answers_are_one_number() {
        let v = json!({"resultType": "vector", "result": [{"metric": {}, "value": [1.0, "42"]}]});
        assert_eq!(one_number(&v).unwrap(), 42.0);
        let s = json!({"resultType": "scalar", "result": [1.0, "0.5"]});
        assert_eq!(one_number(&s).unwrap(), 0.5);
        let two = json!({"resultType": "vector", "result": [
            {"metric": {"a": "1"}, "value": [1.0, "1"]}, {"metric": {"a": "2"}, "value": [1.0, "2"]}]});
        assert!(one_number(&two).unwrap_err().contains("2 series"));
        let none = json!({"resultType": "vector", "result": []});
        assert!(one_number(&none).is_err());
    }

    #[test]
    fn the_config_names_every_target_with_the_token() {
        let spec = PrometheusSpec {
            scrape_interval: Duration::from_millis(500),
        };
        let targets = vec![
            ScrapeTarget {
                job: "metadata",
                url: "http://127.0.0.1:8081".into(),
                pod: None,
            },
            ScrapeTarget {
                job: "agent",
                url: "http://10.0.0.2:9000".into(),
                pod: Some("getter-0".into()),
            },
        ];
        let c = config(&spec, &targets, Path::new("/w/token"));
        assert!(c.contains("scrape_interval: 500ms"), "{c}");
        assert!(c.contains("job_name: metadata"), "{c}");
        assert!(c.contains("targets: [\"127.0.0.1:8081\"]"), "{c}");
        assert!(c.contains("labels: { pod: \"getter-0\" }"), "{c}");
        assert!(c.contains("credentials_file: /w/token"), "{c}");
        let yaml: serde_yaml_ng::Value = serde_yaml_ng::from_str(&c).unwrap();
        assert_eq!(yaml["scrape_configs"].as_sequence().unwrap().len(), 2);
    }
}
