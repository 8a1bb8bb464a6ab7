//! Where each node of a YAML document starts, by path (`steps.3.get.pod`), so
//! checks that run after deserialization can still point at a line and column.

use std::collections::HashMap;

use saphyr_parser::{Event, Parser};

/// 1-based line and column.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Pos {
    pub line: usize,
    pub col: usize,
}

/// Path of a node: mapping keys and sequence indices joined with dots.
#[derive(Debug, Default)]
pub struct Positions {
    nodes: HashMap<String, Pos>,
}

enum Frame {
    Map {
        key: Option<String>,
        expect_key: bool,
    },
    Seq {
        next: usize,
    },
}

impl Positions {
    /// Indexes `src`. A document that does not parse yields an empty index
    /// (serde reports the syntax error with its own position).
    pub fn index(src: &str) -> Positions {
        let mut nodes = HashMap::new();
        let mut stack: Vec<Frame> = Vec::new();
        let mut path: Vec<String> = Vec::new();
        for ev in Parser::new_from_str(src) {
            let Ok((ev, span)) = ev else { break };
            let pos = Pos {
                line: span.start.line(),
                col: span.start.col() + 1,
            };
            // A node begins: is it a mapping key, or a value at a path?
            let is_node = matches!(
                ev,
                Event::Scalar(..)
                    | Event::MappingStart(..)
                    | Event::SequenceStart(..)
                    | Event::Alias(_)
            );
            if is_node {
                match stack.last_mut() {
                    Some(Frame::Map { key, expect_key }) if *expect_key => {
                        if let Event::Scalar(s, ..) = &ev {
                            *key = Some(s.to_string());
                        }
                        *expect_key = false;
                        continue;
                    }
                    Some(Frame::Map { key, expect_key }) => {
                        path.push(key.take().unwrap_or_default());
                        *expect_key = true;
                    }
                    Some(Frame::Seq { next }) => {
                        path.push(next.to_string());
                        *next += 1;
                    }
                    None => {}
                }
                nodes.entry(path.join(".")).or_insert(pos);
            }
            match ev {
                Event::MappingStart(..) => stack.push(Frame::Map {
                    key: None,
                    expect_key: true,
                }),
                Event::SequenceStart(..) => stack.push(Frame::Seq { next: 0 }),
                Event::MappingEnd | Event::SequenceEnd => {
                    stack.pop();
                    if !stack.is_empty() {
                        path.pop();
                    }
                }
                Event::Scalar(..) | Event::Alias(_) if !stack.is_empty() => {
                    path.pop();
                }
                _ => {}
            }
        }
        Positions { nodes }
    }

    /// The position of `path`, or of its nearest ancestor that has one.
    pub fn of(&self, path: &str) -> Pos {
        let mut p = path;
        loop {
            if let Some(pos) = self.nodes.get(p) {
                return *pos;
            }
            match p.rfind('.') {
                Some(i) => p = &p[..i],
                None => {
                    return self
                        .nodes
                        .get("")
                        .copied()
                        .unwrap_or(Pos { line: 1, col: 1 });
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paths_point_at_values() {
        let src =
            "name: x\nsteps:\n  - put:\n      pod: a\n      key: k\n  - get: { pod: b, key: k }\n";
        let p = Positions::index(src);
        assert_eq!(p.of("name"), Pos { line: 1, col: 7 });
        assert_eq!(p.of("steps.0.put.pod"), Pos { line: 4, col: 12 });
        assert_eq!(p.of("steps.1.get.pod"), Pos { line: 6, col: 17 });
        assert_eq!(p.of("steps.1"), Pos { line: 6, col: 5 });
        // Unknown paths fall back to the nearest ancestor.
        assert_eq!(p.of("steps.1.get.nothing"), p.of("steps.1.get"));
    }

    #[test]
    fn broken_documents_index_what_they_can() {
        let p = Positions::index("a: [1, 2\nb: c");
        assert_eq!(p.of("zzz").line, 1);
    }
}
