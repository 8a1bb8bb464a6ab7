//! The roles table (`tests/roles.rs`'s `TABLE`, the contract the
//! security docs point to) against the routers: every route a server's
//! router declares with `allow(ROLES, method(handler))` has a row with the
//! same roles, and every row names a route the router has, with those
//! roles. The routers are read from their source, as written.

use std::collections::BTreeSet;

use super::root;

/// The files whose routers each server of the table mounts (test modules
/// aside). A node-cache agent serves an agent's routes and its own.
const ROUTERS: &[(&str, &[&str])] = &[
    (
        "meta",
        &[
            "components/kt-metadata/src/server/mod.rs",
            "components/kt-metadata/src/quorum/routes.rs",
            "components/kt-service/src/auth.rs",
            "components/kt-service/src/lib.rs",
        ],
    ),
    (
        "store",
        &[
            "components/kt-store/src/server.rs",
            "components/kt-service/src/reads.rs",
            "components/kt-service/src/lib.rs",
        ],
    ),
    (
        "agent",
        &[
            "components/kt-service/src/reads.rs",
            "components/kt-agent/src/tensors/http.rs",
            "components/kt-service/src/lib.rs",
        ],
    ),
    ("node-cache", &["components/kt-agent/src/datasets.rs"]),
];

/// Where a router with `allow` may be written: a file here that declares
/// one must be in [`ROUTERS`].
const SERVER_CRATES: &[&str] = &[
    "components/kt-metadata/src",
    "components/kt-store/src",
    "components/kt-agent/src",
    "components/kt-service/src",
];

/// Routes outside auth (no token, no role): health.
const PUBLIC: &[&str] = &["/healthz", "/readyz"];

/// A route path written as a call rather than a literal, and its value.
type PathCall = (&'static str, fn() -> String);

/// Route paths written as calls rather than literals.
const PATH_CALLS: &[PathCall] = &[(
    "&kt_types::paths::auth_review()",
    kt_types::paths::auth_review,
)];

/// The table's role aliases (`use Role::{Agent as A, ...}` in roles.rs).
const ALIASES: &[(&str, &str)] = &[
    ("A", "Agent"),
    ("M", "Metrics"),
    ("S", "Store"),
    ("W", "Workload"),
];

const METHODS: &[&str] = &["get", "post", "put", "delete", "patch"];

/// One route: server, method (upper case), path (a row's is concrete, a
/// router's a pattern), the roles allowed besides admin.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Route {
    server: String,
    method: String,
    path: String,
    roles: BTreeSet<String>,
    /// Where it is written (file, for a router's).
    at: String,
}

impl std::fmt::Display for Route {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} {} {} {:?}",
            self.server, self.method, self.path, self.roles
        )
    }
}

/// `src` without `//` comments (outside string literals) and without its
/// test module (`#[cfg(test)] mod ...` and everything after it).
fn strip(src: &str) -> String {
    let mut lines = Vec::new();
    let mut it = src.lines().peekable();
    while let Some(line) = it.next() {
        if line.trim() == "#[cfg(test)]"
            && it
                .peek()
                .is_some_and(|l| l.trim_start().starts_with("mod "))
        {
            break;
        }
        let mut out = String::new();
        let mut in_str = false;
        let mut prev = ' ';
        let mut chars = line.chars().peekable();
        while let Some(c) = chars.next() {
            if c == '"' && prev != '\\' {
                in_str = !in_str;
            }
            if !in_str && c == '/' && chars.peek() == Some(&'/') {
                break;
            }
            out.push(c);
            prev = if prev == '\\' && c == '\\' { ' ' } else { c };
        }
        lines.push(out);
    }
    lines.join("\n")
}

/// The text inside the parenthesis that opens at `open` (`s[open] == '('`).
fn balanced(s: &str, open: usize) -> &str {
    let mut depth = 0;
    let mut in_str = false;
    for (i, c) in s[open..].char_indices() {
        match c {
            '"' => in_str = !in_str,
            '(' | '[' | '{' if !in_str => depth += 1,
            ')' | ']' | '}' if !in_str => {
                depth -= 1;
                if depth == 0 {
                    return &s[open + 1..open + i];
                }
            }
            _ => {}
        }
    }
    panic!("unbalanced parenthesis at byte {open}")
}

/// Splits `s` at its first comma outside brackets.
fn first_arg(s: &str) -> (&str, &str) {
    let mut depth = 0;
    let mut in_str = false;
    for (i, c) in s.char_indices() {
        match c {
            '"' => in_str = !in_str,
            '(' | '[' | '{' | '<' if !in_str => depth += 1,
            ')' | ']' | '}' | '>' if !in_str => depth -= 1,
            ',' if !in_str && depth == 0 => return (s[..i].trim(), s[i + 1..].trim()),
            _ => {}
        }
    }
    (s.trim(), "")
}

/// Each call `name(...)` in `s` (`name` not the tail of a longer
/// identifier): the text inside its parenthesis.
fn calls<'a>(s: &'a str, name: &str) -> Vec<&'a str> {
    let pat = format!("{name}(");
    let mut out = Vec::new();
    let mut from = 0;
    while let Some(i) = s[from..].find(&pat) {
        let at = from + i;
        let before = s[..at].chars().next_back();
        if !before.is_some_and(|c| c.is_alphanumeric() || c == '_') {
            out.push(balanced(s, at + name.len()));
        }
        from = at + pat.len();
    }
    out
}

/// The roles an `allow` names: `ADMIN` (none but admin), `&[Role, ...]`,
/// or a `const`/`let` of the file holding one of these.
fn roles(expr: &str, file: &str, src: &str) -> Result<BTreeSet<String>, String> {
    let expr = expr.trim();
    if expr == "ADMIN" {
        return Ok(BTreeSet::new());
    }
    if let Some(list) = expr.strip_prefix("&[").and_then(|e| e.strip_suffix(']')) {
        return Ok(list
            .split(',')
            .map(|r| r.trim().rsplit("::").next().unwrap_or("").to_owned())
            .filter(|r| !r.is_empty())
            .collect());
    }
    if expr.chars().all(|c| c.is_alphanumeric() || c == '_') {
        for intro in [
            format!("const {expr}:"),
            format!("let {expr}:"),
            format!("let {expr} ="),
        ] {
            if let Some(i) = src.find(&intro) {
                let rest = &src[i..];
                let value = rest[rest.find('=').unwrap() + 1..rest.find(';').unwrap()].trim();
                return roles(value, file, src);
            }
        }
    }
    Err(format!(
        "{file}: allow({expr}, ..): the roles are neither ADMIN, &[Role, ...] nor a const or let \
         of them in the file; write them so (or teach tidy/roles_table.rs)"
    ))
}

/// The routes of a router file: one per method of every `allow` of every
/// `.route(path, ...)`.
fn router_routes(server: &str, file: &str) -> Result<Vec<Route>, Vec<String>> {
    let src = strip(&std::fs::read_to_string(root().join(file)).unwrap());
    let mut out = Vec::new();
    let mut problems = Vec::new();
    for call in calls(&src, ".route") {
        let (path, handlers) = first_arg(call);
        let path = match path.strip_prefix('"').and_then(|p| p.strip_suffix('"')) {
            Some(p) => p.to_owned(),
            None => match PATH_CALLS.iter().find(|(e, _)| *e == path) {
                Some((_, f)) => f(),
                None => {
                    problems.push(format!(
                        "{file}: route path {path} is not a string literal (add it to PATH_CALLS \
                         in tidy/roles_table.rs)"
                    ));
                    continue;
                }
            },
        };
        if PUBLIC.contains(&path.as_str()) {
            continue;
        }
        let allows = calls(handlers, "allow");
        if allows.is_empty() {
            problems.push(format!(
                "{file}: route {path} declares no roles: wrap its handlers in \
                 kt_service::allow(ROLES, ..)"
            ));
        }
        for allow in allows {
            let (who, methods) = first_arg(allow);
            let roles = match roles(who, file, &src) {
                Ok(r) => r,
                Err(e) => {
                    problems.push(e);
                    continue;
                }
            };
            for m in METHODS {
                if !calls(methods, m).is_empty() {
                    out.push(Route {
                        server: server.to_owned(),
                        method: m.to_ascii_uppercase(),
                        path: path.clone(),
                        roles: roles.clone(),
                        at: file.to_owned(),
                    });
                }
            }
        }
    }
    if problems.is_empty() {
        Ok(out)
    } else {
        Err(problems)
    }
}

/// The rows of `TABLE` in roles.rs.
fn table(src: &str) -> Vec<Route> {
    let start = src.find("const TABLE").expect("roles.rs has a const TABLE");
    let body = &src[start..];
    let body = &body[body.find("= &[").unwrap() + 3..];
    let body = balanced(body, 0);
    let mut rows = Vec::new();
    let mut i = 0;
    while let Some(open) = body[i..].find('(') {
        let row = balanced(body, i + open);
        i += open + row.len() + 2;
        let (server, rest) = first_arg(row);
        let (method, rest) = first_arg(rest);
        let (path, roles) = first_arg(rest);
        let unquote = |s: &str| s.trim_matches('"').to_owned();
        let roles = roles
            .trim_end_matches(',')
            .trim()
            .trim_start_matches("&[")
            .trim_end_matches(']')
            .split(',')
            .map(str::trim)
            .filter(|r| !r.is_empty())
            .map(|r| {
                ALIASES
                    .iter()
                    .find(|(a, _)| *a == r)
                    .map_or(r, |(_, name)| name)
                    .to_owned()
            })
            .collect();
        rows.push(Route {
            server: unquote(server),
            method: unquote(method),
            path: unquote(path),
            roles,
            at: "tests/roles.rs".into(),
        });
    }
    rows
}

/// How well a router pattern fits a concrete path: `None` if it does not;
/// else one rank per segment (static 2, `{param}` 1, `{*rest}` 0), so that
/// the greatest is the one axum picks.
fn fit(pattern: &str, path: &str) -> Option<Vec<u8>> {
    let path = path.split('?').next().unwrap_or(path);
    let (pat, segs): (Vec<&str>, Vec<&str>) =
        (pattern.split('/').collect(), path.split('/').collect());
    let mut rank = Vec::new();
    for (i, p) in pat.iter().enumerate() {
        if p.starts_with("{*") {
            return (segs.len() > i && segs[i..].iter().all(|s| !s.is_empty())).then(|| {
                rank.push(0);
                rank
            });
        }
        let s = segs.get(i)?;
        if p.starts_with('{') {
            if s.is_empty() {
                return None;
            }
            rank.push(1);
        } else if p == s {
            rank.push(2);
        } else {
            return None;
        }
    }
    (pat.len() == segs.len()).then_some(rank)
}

/// What differs between `rows` and `routes`, each naming its route.
fn drift(rows: &[Route], routes: &[Route]) -> Vec<String> {
    let mut problems = Vec::new();
    let mut covered = BTreeSet::new();
    for row in rows {
        let best = routes
            .iter()
            .enumerate()
            .filter(|(_, r)| r.server == row.server && r.method == row.method)
            .filter_map(|(i, r)| fit(&r.path, &row.path).map(|rank| (rank, i)))
            .max();
        match best {
            None => problems.push(format!(
                "roles table row {row}: no such route in the {} router",
                row.server
            )),
            Some((_, i)) => {
                covered.insert(i);
                let r = &routes[i];
                if r.roles != row.roles {
                    problems.push(format!(
                        "{} {} {} ({}): the router allows {:?}, the roles table {:?}",
                        r.server, r.method, r.path, r.at, r.roles, row.roles
                    ));
                }
            }
        }
    }
    for (i, r) in routes.iter().enumerate() {
        if !covered.contains(&i) {
            problems.push(format!(
                "{} {} {} ({}, allows {:?}): no row in the roles table (tests/roles.rs TABLE)",
                r.server, r.method, r.path, r.at, r.roles
            ));
        }
    }
    problems
}

fn all_router_routes() -> (Vec<Route>, Vec<String>) {
    let mut routes = Vec::new();
    let mut problems = Vec::new();
    for (server, files) in ROUTERS {
        for file in *files {
            match router_routes(server, file) {
                Ok(r) => routes.extend(r),
                Err(p) => problems.extend(p),
            }
        }
    }
    (routes, problems)
}

#[test]
fn the_roles_table_matches_the_routers() {
    let rows =
        table(&std::fs::read_to_string(root().join("components/kt-tests/tests/roles.rs")).unwrap());
    assert!(
        rows.len() > 40,
        "the roles table parsed to {} rows",
        rows.len()
    );
    let (routes, mut problems) = all_router_routes();
    problems.extend(drift(&rows, &routes));
    // A router written elsewhere would escape the check.
    let listed: BTreeSet<&str> = ROUTERS
        .iter()
        .flat_map(|(_, f)| f.iter().copied())
        .collect();
    for dir in SERVER_CRATES {
        for path in super::rust_files(&root().join(dir)) {
            let rel = path
                .strip_prefix(root())
                .unwrap()
                .to_string_lossy()
                .into_owned();
            let src = strip(&std::fs::read_to_string(&path).unwrap());
            let routes_here = calls(&src, ".route")
                .iter()
                .any(|c| !calls(c, "allow").is_empty());
            if routes_here && !listed.contains(rel.as_str()) {
                problems.push(format!(
                    "{rel} declares routes with allow(..) but is not in ROUTERS (tidy/roles_table.rs): \
                     say which server mounts them"
                ));
            }
        }
    }
    assert!(
        problems.is_empty(),
        "the roles table (tests/roles.rs, the contract docs/security.md points to) and the \
         routers disagree; fix the one that is wrong:\n{}",
        problems.join("\n")
    );
}

#[test]
fn the_roles_check_catches_a_changed_role_a_missing_row_and_an_unknown_route() {
    let route = |method: &str, path: &str, roles: &[&str]| Route {
        server: "meta".into(),
        method: method.into(),
        path: path.into(),
        roles: roles.iter().map(|r| r.to_string()).collect(),
        at: "x.rs".into(),
    };
    let routes = [
        route("GET", "/api/v1/quorums/{group}/{transfer}", &[]),
        route("POST", "/api/v1/quorums/{group}/join", &["Agent"]),
        route("GET", "/api/v1/keys/{*key}", &["Workload"]),
    ];
    let rows = [
        route("GET", "/api/v1/quorums/g1/t1", &[]),
        route("POST", "/api/v1/quorums/g1/join", &["Agent"]),
        route("GET", "/api/v1/keys/a/b", &["Workload"]),
    ];
    assert!(
        drift(&rows, &routes).is_empty(),
        "{:?}",
        drift(&rows, &routes)
    );
    let changed = [
        rows[0].clone(),
        rows[1].clone(),
        route("GET", "/api/v1/keys/a/b", &["Store"]),
    ];
    let found = drift(&changed, &routes);
    assert!(
        found.len() == 1 && found[0].contains("GET /api/v1/keys/{*key}"),
        "{found:?}"
    );
    let found = drift(&rows[..2], &routes);
    assert!(found.len() == 1 && found[0].contains("no row"), "{found:?}");
    let extra = [
        rows[0].clone(),
        rows[1].clone(),
        rows[2].clone(),
        route("PUT", "/api/v1/x", &[]),
    ];
    let found = drift(&extra, &routes);
    assert!(
        found.len() == 1 && found[0].contains("no such route"),
        "{found:?}"
    );
    // The parser reads roles through a const and skips comments and tests.
    let src = "const W: &[Role] = &[Workload];\nRouter::new()\n    // .route(\"/c\", get(x))\n    .route(\"/a\", allow(W, put(a).delete(b)))\n    .route(\"/b\", allow(ADMIN, get(c)).merge(allow(&[Role::Store], post(d))));\n#[cfg(test)]\nmod tests {\n .route(\"/t\", get(t))\n}\n";
    let s = strip(src);
    let found: Vec<String> = calls(&s, ".route")
        .iter()
        .flat_map(|c| {
            let (path, h) = first_arg(c);
            calls(h, "allow")
                .into_iter()
                .map(|a| {
                    let (who, m) = first_arg(a);
                    format!("{path} {:?} {}", roles(who, "x", &s).unwrap(), m)
                })
                .collect::<Vec<_>>()
        })
        .collect();
    assert_eq!(
        found,
        [
            "\"/a\" {\"Workload\"} put(a).delete(b)",
            "\"/b\" {} get(c)",
            "\"/b\" {\"Store\"} post(d)"
        ]
    );
}
