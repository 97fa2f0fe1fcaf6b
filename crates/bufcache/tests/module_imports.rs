//! The engine's module imports flow one way.
//!
//! Goal: keep the engine's modules layered (each piece of state has one owning module, and
//! owners below never reach back up), so a newcomer can follow a request downward.
//! Method: read every `crate::MODULE` reference in `src/*.rs`, build the module graph, find its
//! strongly connected components, and fail on any cycle.

use std::collections::{BTreeMap, BTreeSet};

fn module_graph() -> BTreeMap<String, BTreeSet<String>> {
    let source = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut files = BTreeMap::new();
    for entry in std::fs::read_dir(&source).expect("engine sources") {
        let path = entry.expect("directory entry").path();
        if path.extension().is_some_and(|extension| extension == "rs") {
            let name = path.file_stem().unwrap().to_string_lossy().into_owned();
            files.insert(
                name,
                std::fs::read_to_string(&path).expect("readable source"),
            );
        }
    }
    let modules: BTreeSet<String> = files.keys().cloned().collect();
    files
        .iter()
        .filter(|(name, _)| name.as_str() != "lib")
        .map(|(name, text)| {
            let code: String = text
                .lines()
                .filter(|line| !line.trim_start().starts_with("//"))
                .collect::<Vec<_>>()
                .join("\n");
            let targets = code
                .split("crate::")
                .skip(1)
                .filter_map(|rest| {
                    let module: String = rest
                        .chars()
                        .take_while(|c| c.is_alphanumeric() || *c == '_')
                        .collect();
                    (modules.contains(&module) && &module != name).then_some(module)
                })
                .collect();
            (name.clone(), targets)
        })
        .collect()
}

/// Strongly connected components with more than one module (Tarjan's algorithm).
fn cycles(graph: &BTreeMap<String, BTreeSet<String>>) -> Vec<BTreeSet<String>> {
    struct State<'a> {
        graph: &'a BTreeMap<String, BTreeSet<String>>,
        index: BTreeMap<&'a str, usize>,
        low: BTreeMap<&'a str, usize>,
        stack: Vec<&'a str>,
        found: Vec<BTreeSet<String>>,
    }
    fn visit<'a>(state: &mut State<'a>, node: &'a str) {
        let next = state.index.len();
        state.index.insert(node, next);
        state.low.insert(node, next);
        state.stack.push(node);
        for target in state.graph.get(node).into_iter().flatten() {
            let target = target.as_str();
            if !state.index.contains_key(target) {
                visit(state, target);
                let low = state.low[node].min(state.low[target]);
                state.low.insert(node, low);
            } else if state.stack.contains(&target) {
                let low = state.low[node].min(state.index[target]);
                state.low.insert(node, low);
            }
        }
        if state.low[node] == state.index[node] {
            let mut component = BTreeSet::new();
            while let Some(member) = state.stack.pop() {
                component.insert(member.to_string());
                if member == node {
                    break;
                }
            }
            if component.len() > 1 {
                state.found.push(component);
            }
        }
    }
    let mut state = State {
        graph,
        index: BTreeMap::new(),
        low: BTreeMap::new(),
        stack: Vec::new(),
        found: Vec::new(),
    };
    for node in graph.keys() {
        if !state.index.contains_key(node.as_str()) {
            visit(&mut state, node);
        }
    }
    state.found
}

#[test]
fn engine_module_imports_form_a_dag() {
    let graph = module_graph();
    for layer in [
        "cache",
        "table",
        "writeback",
        "object",
        "handle",
        "read",
        "write",
        "residency",
        "guard",
        "bsd",
        "dirty",
        "io",
    ] {
        assert!(
            graph.contains_key(layer),
            "the module reader found the sources ({layer})"
        );
    }
    let found = cycles(&graph);
    assert!(
        found.is_empty(),
        "import cycles among engine modules: {found:?} (graph: {graph:?})"
    );
    // The layering the design describes: the table knows no objects or write-back, object
    // state knows no cache, write-back knows no handles, the handle is a façade over the
    // read and write paths.
    for (module, forbidden) in [
        ("table", &["object", "writeback", "cache", "handle"][..]),
        ("object", &["cache", "table", "writeback", "handle"][..]),
        ("writeback", &["cache", "handle", "bsd"][..]),
        ("cache", &["handle", "bsd", "read", "write", "guard"][..]),
        // The byte-range paths sit below the handle, a façade over them: the read path
        // knows no write path, and a held buffer knows neither.
        ("read", &["handle", "bsd", "write", "residency"][..]),
        ("write", &["handle", "bsd", "residency"][..]),
        ("residency", &["handle", "bsd", "read", "write"][..]),
        (
            "guard",
            &["handle", "bsd", "read", "write", "residency"][..],
        ),
        // The io path knows devices and objects, never the cache's state or its callers.
        (
            "io",
            &[
                "cache",
                "handle",
                "bsd",
                "writeback",
                "table",
                "buffer",
                "dirty",
            ][..],
        ),
    ] {
        for target in forbidden {
            assert!(
                !graph[module].contains(*target),
                "{module} must not import {target} (graph: {graph:?})"
            );
        }
    }
}

#[test]
fn cycle_finder_sees_a_planted_cycle() {
    // The checker itself must catch a cycle: a -> b -> c -> a, plus d -> a outside it.
    let mut graph = BTreeMap::new();
    for (from, to) in [("a", "b"), ("b", "c"), ("c", "a"), ("d", "a")] {
        graph
            .entry(from.to_string())
            .or_insert_with(BTreeSet::new)
            .insert(to.to_string());
    }
    let expected: BTreeSet<String> = ["a", "b", "c"].iter().map(|s| s.to_string()).collect();
    assert_eq!(cycles(&graph), vec![expected]);
}
