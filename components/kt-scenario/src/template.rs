//! `{{ name }}` substitution in step fields.
//!
//! Names: `scenario` (the scenario's name), `run` (this run's id, unique per
//! run, so keys and broadcast groups never collide with an earlier run),
//! `vars.NAME` (the scenario's `vars`), and in per-pod fields `pod` (the pod
//! instance) and `index` (its replica index).

use std::collections::BTreeMap;

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum TemplateError {
    #[error("unclosed `{{{{` in `{0}`")]
    Unclosed(String),
    #[error("unknown template variable `{name}` (known: scenario, run, pod, index, vars.NAME)")]
    Unknown { name: String },
}

/// Values for one expansion.
#[derive(Debug, Clone, Default)]
pub struct Context {
    pub values: BTreeMap<String, String>,
}

impl Context {
    pub fn new(scenario: &str, run: &str, vars: &BTreeMap<String, String>) -> Context {
        let mut values = BTreeMap::new();
        values.insert("scenario".to_owned(), scenario.to_owned());
        values.insert("run".to_owned(), run.to_owned());
        for (k, v) in vars {
            values.insert(format!("vars.{k}"), v.clone());
        }
        Context { values }
    }

    /// This context plus the per-pod names.
    pub fn for_pod(&self, pod: &str, index: usize) -> Context {
        let mut c = self.clone();
        c.values.insert("pod".to_owned(), pod.to_owned());
        c.values.insert("index".to_owned(), index.to_string());
        c
    }

    pub fn expand(&self, s: &str) -> Result<String, TemplateError> {
        expand_with(s, |name| self.values.get(name).cloned())
    }
}

/// Names used in `s`, in order (for validation without values).
pub fn names(s: &str) -> Result<Vec<String>, TemplateError> {
    let mut out = Vec::new();
    expand_with(s, |name| {
        out.push(name.to_owned());
        Some(String::new())
    })?;
    Ok(out)
}

fn expand_with(
    s: &str,
    mut lookup: impl FnMut(&str) -> Option<String>,
) -> Result<String, TemplateError> {
    let mut out = String::with_capacity(s.len());
    let mut rest = s;
    while let Some(start) = rest.find("{{") {
        out.push_str(&rest[..start]);
        let after = &rest[start + 2..];
        let end = after
            .find("}}")
            .ok_or_else(|| TemplateError::Unclosed(s.to_owned()))?;
        let name = after[..end].trim();
        let value = lookup(name).ok_or_else(|| TemplateError::Unknown {
            name: name.to_owned(),
        })?;
        out.push_str(&value);
        rest = &after[end + 2..];
    }
    out.push_str(rest);
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn expands_known_names() {
        let vars = BTreeMap::from([("v".to_owned(), "1".to_owned())]);
        let c = Context::new("rt", "abcd", &vars).for_pod("getter-3", 3);
        assert_eq!(
            c.expand("{{scenario}}/{{ vars.v }}/{{pod}}-{{index}}@{{run}}")
                .unwrap(),
            "rt/1/getter-3-3@abcd"
        );
        assert_eq!(c.expand("plain").unwrap(), "plain");
    }

    #[test]
    fn refuses_unknown_and_unclosed() {
        let c = Context::new("rt", "r", &BTreeMap::new());
        assert_eq!(
            c.expand("{{ nope }}"),
            Err(TemplateError::Unknown {
                name: "nope".into()
            })
        );
        assert!(matches!(c.expand("a{{b"), Err(TemplateError::Unclosed(_))));
        assert!(matches!(
            c.expand("{{pod}}"),
            Err(TemplateError::Unknown { .. })
        ));
        assert_eq!(names("{{a}}x{{ b.c }}").unwrap(), vec!["a", "b.c"]);
    }
}
