//! Command lines built from a step's fields: words, then a flag per field
//! that is set.

use std::fmt::Display;

/// A command line under construction.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Argv(Vec<String>);

impl Argv {
    /// A command line starting with `words`.
    pub fn new<S: Into<String>>(words: impl IntoIterator<Item = S>) -> Argv {
        Argv(words.into_iter().map(Into::into).collect())
    }

    /// Appends `words` as they are.
    pub fn words<S: Into<String>>(&mut self, words: impl IntoIterator<Item = S>) -> &mut Argv {
        self.0.extend(words.into_iter().map(Into::into));
        self
    }

    /// `flag value` when there is a value.
    pub fn opt(&mut self, flag: &str, value: Option<impl Display>) -> &mut Argv {
        if let Some(v) = value {
            self.0.extend([flag.to_owned(), v.to_string()]);
        }
        self
    }

    /// `flag` when `on`.
    pub fn flag(&mut self, flag: &str, on: bool) -> &mut Argv {
        if on {
            self.0.push(flag.to_owned());
        }
        self
    }

    pub fn into_vec(self) -> Vec<String> {
        self.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn set_fields_become_flags_and_unset_ones_nothing() {
        let mut a = Argv::new(["get", "k"]);
        a.opt("--group", Some("g"))
            .opt("--fanout", None::<u32>)
            .opt("--repeat", Some(3))
            .flag("--pack", true)
            .flag("--no-serve", false)
            .words(["-o", "json"]);
        assert_eq!(
            a.into_vec(),
            [
                "get", "k", "--group", "g", "--repeat", "3", "--pack", "-o", "json"
            ]
        );
    }
}
