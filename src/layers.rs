//! The layering of docs/ARCHITECTURE.md ("Layers"), checked: every `crate::` path in
//! the sources (outside tests) goes to a module of the same layer or one above it in
//! the table, and the top-level modules use each other in no cycle.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// The table's layers: module → its layer's number.
fn layers() -> BTreeMap<String, u32> {
    let doc = include_str!("../docs/ARCHITECTURE.md");
    let table = doc
        .split("## Layers")
        .nth(1)
        .expect("ARCHITECTURE.md has a Layers section");
    let mut layers = BTreeMap::new();
    for row in table.lines().take_while(|l| !l.starts_with("## ")) {
        let cells: Vec<&str> = row.split('|').map(str::trim).collect();
        let Some(layer) = cells.get(1).and_then(|c| c.parse::<u32>().ok()) else {
            continue;
        };
        for module in cells[2].split(',') {
            let module = module.trim().trim_matches('`');
            assert!(
                layers.insert(module.to_string(), layer).is_none(),
                "{module} is in two layers"
            );
        }
    }
    layers
}

/// The top-level modules `lib.rs` declares, tests aside.
fn modules() -> BTreeSet<String> {
    let lines: Vec<&str> = include_str!("lib.rs").lines().map(str::trim).collect();
    let mut modules = BTreeSet::new();
    for (i, line) in lines.iter().enumerate() {
        let declared = line
            .strip_suffix(';')
            .and_then(|l| l.rsplit_once("mod "))
            .filter(|(vis, _)| vis.is_empty() || vis.starts_with("pub"));
        let test = i > 0 && lines[i - 1] == "#[cfg(test)]";
        if let (Some((_, name)), false) = (declared, test) {
            modules.insert(name.to_string());
        }
    }
    modules
}

/// The source files of `module`, with what tests alone compile left out.
fn sources(module: &str) -> Vec<(PathBuf, String)> {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut files = vec![];
    let mut dirs = vec![src.join(module)];
    if src.join(format!("{module}.rs")).exists() {
        files.push(src.join(format!("{module}.rs")));
    }
    while let Some(dir) = dirs.pop() {
        let Ok(entries) = std::fs::read_dir(&dir) else {
            continue;
        };
        for entry in entries.flatten() {
            let path = entry.path();
            if path.is_dir() {
                dirs.push(path);
            } else if path.extension().is_some_and(|e| e == "rs") {
                files.push(path);
            }
        }
    }
    let texts: Vec<(PathBuf, String)> = files
        .into_iter()
        .map(|f| {
            let text = std::fs::read_to_string(&f).unwrap();
            (f, text)
        })
        .collect();
    // Modules declared `#[cfg(test)] mod name;` are tests, with their directories.
    let tests: Vec<String> = texts
        .iter()
        .flat_map(|(_, text)| {
            let lines: Vec<&str> = text.lines().collect();
            lines
                .windows(2)
                .filter(|w| w[0].trim() == "#[cfg(test)]")
                .filter_map(|w| w[1].trim().strip_prefix("mod ")?.strip_suffix(';'))
                .map(str::to_string)
                .collect::<Vec<_>>()
        })
        .collect();
    texts
        .into_iter()
        .filter(|(path, _)| {
            !path.iter().any(|part| {
                let part = part.to_string_lossy();
                tests
                    .iter()
                    .any(|t| part == *t || part == format!("{t}.rs"))
            })
        })
        .map(|(path, text)| {
            let code = text.split("#[cfg(test)]\nmod tests").next().unwrap_or("");
            let code: Vec<&str> = code
                .lines()
                .map(|l| l.split("//").next().unwrap_or(""))
                .collect();
            (path, code.join("\n"))
        })
        .collect()
}

/// The top-level modules `code` names through `crate::`.
fn imports(code: &str) -> BTreeSet<String> {
    let mut named = BTreeSet::new();
    for (i, _) in code.match_indices("crate::") {
        let rest = &code[i + "crate::".len()..];
        if let Some(group) = rest.strip_prefix('{') {
            // `crate::{a, b::c, d::{e, f}}`: the names at the group's top level.
            let mut depth = 0;
            let mut start = true;
            for (j, c) in group.char_indices() {
                match c {
                    '{' => depth += 1,
                    '}' if depth == 0 => break,
                    '}' => depth -= 1,
                    ',' if depth == 0 => start = true,
                    c if start && (c.is_alphanumeric() || c == '_') => {
                        let name: String = group[j..]
                            .chars()
                            .take_while(|c| c.is_alphanumeric() || *c == '_')
                            .collect();
                        named.insert(name);
                        start = false;
                    }
                    _ => {}
                }
            }
        } else {
            let name: String = rest
                .chars()
                .take_while(|c| c.is_alphanumeric() || *c == '_')
                .collect();
            named.insert(name);
        }
    }
    named
}

#[test]
fn every_import_points_down_the_layers_of_architecture_md() {
    let layers = layers();
    let modules = modules();
    let unplaced: Vec<&String> = modules
        .iter()
        .filter(|m| !layers.contains_key(*m))
        .collect();
    assert!(unplaced.is_empty(), "modules without a layer: {unplaced:?}");
    let mut uses: BTreeMap<&str, BTreeSet<String>> = BTreeMap::new();
    let mut wrong = vec![];
    for module in &modules {
        for (path, code) in sources(module) {
            for used in imports(&code) {
                if used == *module || !modules.contains(&used) {
                    continue;
                }
                if layers[&used] > layers[module] {
                    wrong.push(format!(
                        "{} uses crate::{used} (layer {} uses layer {})",
                        path.strip_prefix(env!("CARGO_MANIFEST_DIR"))
                            .unwrap()
                            .display(),
                        layers[module],
                        layers[&used]
                    ));
                }
                uses.entry(module).or_default().insert(used);
            }
        }
    }
    assert!(
        wrong.is_empty(),
        "imports against the layers:\n{}",
        wrong.join("\n")
    );
    // Within a layer, no cycle: a depth-first walk meets no module on its own path.
    fn walk<'a>(
        m: &'a str,
        uses: &'a BTreeMap<&str, BTreeSet<String>>,
        path: &mut Vec<&'a str>,
        done: &mut BTreeSet<&'a str>,
    ) {
        if let Some(start) = path.iter().position(|p| *p == m) {
            panic!("an import cycle: {}", path[start..].join(" → ") + " → " + m);
        }
        if !done.insert(m) {
            return;
        }
        path.push(m);
        for next in uses.get(m).into_iter().flatten() {
            walk(next, uses, path, done);
        }
        path.pop();
    }
    let mut done = BTreeSet::new();
    for module in &modules {
        walk(module, &uses, &mut vec![], &mut done);
    }
}

#[test]
fn the_import_reader_finds_paths_and_groups() {
    let code = "use crate::a::B;\nuse crate::{c, d::{e, f}, g::H};\nlet x = crate::i::j();";
    let expected: BTreeSet<String> = ["a", "c", "d", "g", "i"].map(String::from).into();
    assert_eq!(imports(code), expected);
}
