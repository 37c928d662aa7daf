//! The docs' links work: every relative link in `README.md`, `deploy/README.md` and `docs/*.md`
//! names a file that exists, and a `#anchor` names a heading of that file, by GitHub's rules
//! for heading anchors. The code the docs show is the code that is built: a fenced block after
//! a `<!-- file: PATH -->` line is that file of the repository, or the region of it marked
//! `region: NAME` … `endregion: NAME` for `<!-- file: PATH#NAME -->`. (That the config
//! reference lists the fields the parser accepts is checked by devplug-cli's
//! `tests/docs_config.rs`, with the real binary.)
#![allow(clippy::unwrap_used, clippy::expect_used)] // a panic in a test is a failed test

use deploy_check::repo_root;
use std::collections::HashMap;
use std::path::{Path, PathBuf};

/// The Markdown files whose links are checked, relative to the repository root.
fn documents() -> Vec<PathBuf> {
    let root = repo_root();
    let mut docs = vec![
        PathBuf::from("README.md"),
        PathBuf::from("deploy/README.md"),
    ];
    let mut pages: Vec<PathBuf> = std::fs::read_dir(root.join("docs"))
        .expect("docs/ must exist")
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "md"))
        .map(|p| PathBuf::from("docs").join(p.file_name().unwrap()))
        .collect();
    pages.sort();
    docs.extend(pages);
    docs
}

/// The lines of `text` outside fenced code blocks, with their numbers (from 1).
fn prose_lines(text: &str) -> Vec<(usize, &str)> {
    let mut fenced = false;
    let mut out = Vec::new();
    for (n, line) in text.lines().enumerate() {
        if line.trim_start().starts_with("```") {
            fenced = !fenced;
            continue;
        }
        if !fenced {
            out.push((n + 1, line));
        }
    }
    out
}

/// A heading's anchor as GitHub makes it: lowercase, punctuation other than `-` and `_`
/// dropped, each space a `-`.
fn slug(heading: &str) -> String {
    heading
        .trim()
        .to_lowercase()
        .chars()
        .filter_map(|c| match c {
            ' ' => Some('-'),
            '-' | '_' => Some(c),
            c if c.is_alphanumeric() => Some(c),
            _ => None,
        })
        .collect()
}

/// Every anchor of a Markdown text: its headings' slugs, a repeated one numbered `-1`, `-2`…
fn anchors(text: &str) -> Vec<String> {
    let mut seen: HashMap<String, usize> = HashMap::new();
    let mut out = Vec::new();
    for (_, line) in prose_lines(text) {
        let level = line.chars().take_while(|c| *c == '#').count();
        if !(1..=6).contains(&level) || !line[level..].starts_with(' ') {
            continue;
        }
        let base = slug(&line[level..]);
        let count = seen.entry(base.clone()).or_insert(0);
        out.push(if *count == 0 {
            base.clone()
        } else {
            format!("{base}-{count}")
        });
        *count += 1;
    }
    out
}

/// The targets of the inline links `[text](target)` on a line.
fn link_targets(line: &str) -> Vec<&str> {
    let mut out = Vec::new();
    let mut rest = line;
    while let Some(at) = rest.find("](") {
        let after = &rest[at + 2..];
        let Some(end) = after.find(')') else { break };
        out.push(after[..end].trim());
        rest = &after[end..];
    }
    out
}

/// Why `target`, linked from `doc`, does not resolve, if it does not.
fn broken(root: &Path, doc: &Path, target: &str) -> Option<String> {
    if target.contains("://") || target.starts_with("mailto:") {
        return None;
    }
    let (file, anchor) = match target.split_once('#') {
        Some((file, anchor)) => (file, Some(anchor)),
        None => (target, None),
    };
    let path = if file.is_empty() {
        root.join(doc)
    } else {
        root.join(doc.parent().unwrap()).join(file)
    };
    if !path.exists() {
        return Some(format!("{} does not exist", path.display()));
    }
    let anchor = anchor?;
    if path.extension().is_none_or(|e| e != "md") {
        return Some(format!(
            "#{anchor} in {}, which is not Markdown",
            path.display()
        ));
    }
    let text = std::fs::read_to_string(&path).unwrap();
    let known = anchors(&text);
    (!known.iter().any(|a| a == anchor)).then(|| {
        format!(
            "no heading #{anchor} in {} (its anchors: {})",
            path.display(),
            known.join(", ")
        )
    })
}

#[test]
fn slugs_follow_githubs_rules() {
    for (heading, anchor) in [
        (
            "Registration: kubelet.sock or the plugin watcher",
            "registration-kubeletsock-or-the-plugin-watcher",
        ),
        ("`hostdev` USB ids (`usb`)", "hostdev-usb-ids-usb"),
        ("`intel_gpu`", "intel_gpu"),
        (
            "Extended resources on the Node, and a clean uninstall",
            "extended-resources-on-the-node-and-a-clean-uninstall",
        ),
        (
            "A pod stays Pending: `Insufficient <resource>`",
            "a-pod-stays-pending-insufficient-resource",
        ),
    ] {
        assert_eq!(slug(heading), anchor, "{heading}");
    }
    assert_eq!(
        anchors("# A\n```sh\n# not a heading\n```\n## A\n#nope\n"),
        ["a", "a-1"]
    );
    assert_eq!(
        link_targets("see [a](x.md#y) and [b](../c.md), not (d)"),
        ["x.md#y", "../c.md"]
    );
}

#[test]
fn every_relative_link_in_the_docs_resolves() {
    let root = repo_root();
    let docs = documents();
    assert!(
        docs.len() >= 8,
        "expected README.md, deploy/README.md and the docs/ pages, found {docs:?}"
    );
    let mut problems = Vec::new();
    let mut checked = 0;
    for doc in &docs {
        let text = std::fs::read_to_string(root.join(doc))
            .unwrap_or_else(|e| panic!("{}: {e}", doc.display()));
        for (n, line) in prose_lines(&text) {
            for target in link_targets(line) {
                checked += 1;
                if let Some(why) = broken(&root, doc, target) {
                    problems.push(format!("{}:{n}: ({target}): {why}", doc.display()));
                }
            }
        }
    }
    assert!(
        checked > 30,
        "only {checked} links found: is the parser right?"
    );
    assert!(
        problems.is_empty(),
        "broken links:\n{}",
        problems.join("\n")
    );
}

#[test]
fn the_readme_links_every_page_in_docs() {
    let root = repo_root();
    let readme = std::fs::read_to_string(root.join("README.md")).unwrap();
    let linked: Vec<&str> = prose_lines(&readme)
        .into_iter()
        .flat_map(|(_, line)| link_targets(line))
        .collect();
    let missing: Vec<String> = documents()
        .into_iter()
        .filter(|d| d.starts_with("docs"))
        .map(|d| d.display().to_string())
        .filter(|d| {
            !linked
                .iter()
                .any(|t| t.split('#').next() == Some(d.as_str()))
        })
        .collect();
    assert!(
        missing.is_empty(),
        "README.md's \"Where to go next\" does not link {missing:?}"
    );
}

/// The rows of the README's "Layout" table: (path column, what column).
fn layout_rows(readme: &str) -> Vec<(String, String)> {
    let Some(start) = readme.find("## Layout") else {
        return Vec::new();
    };
    readme[start..]
        .lines()
        .skip(1)
        .skip_while(|line| !line.starts_with('|'))
        .take_while(|line| line.starts_with('|'))
        .skip(2) // header and separator
        .filter_map(|line| {
            let mut cells = line.trim_matches('|').splitn(2, '|');
            Some((
                cells.next()?.trim().to_owned(),
                cells.next()?.trim().to_owned(),
            ))
        })
        .collect()
}

/// The backquoted words of `text`.
fn code_spans(text: &str) -> Vec<&str> {
    text.split('`').skip(1).step_by(2).collect()
}

/// Whether a file or folder named `name` is somewhere under `dir`.
fn found_under(dir: &Path, name: &str) -> bool {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return false;
    };
    entries.flatten().any(|entry| {
        let path = entry.path();
        entry.file_name().to_string_lossy() == name || (path.is_dir() && found_under(&path, name))
    })
}

#[test]
fn the_readme_layout_table_matches_the_tree() {
    let root = repo_root();
    let readme = std::fs::read_to_string(root.join("README.md")).unwrap();
    let rows = layout_rows(&readme);
    assert!(rows.len() > 10, "the Layout table was not found: {rows:?}");
    let mut problems = Vec::new();
    for (paths, what) in &rows {
        for path in code_spans(paths) {
            let path = path.trim_end_matches('/');
            if !root.join(path).exists() {
                problems.push(format!("{path}: no such path"));
            }
        }
        // In a crate's row, every file or folder named in the description is in that crate.
        let crate_path = code_spans(paths)
            .into_iter()
            .find(|p| p.starts_with("crates/"));
        let Some(crate_path) = crate_path else {
            continue;
        };
        let crate_dir = root.join(crate_path);
        for name in code_spans(what) {
            let name = name.trim_end_matches('/');
            let is_file_name = (name.ends_with(".rs") || name.ends_with(".yaml"))
                && !name.contains(' ')
                && !name.contains('/');
            if is_file_name && !found_under(&crate_dir, name) {
                problems.push(format!(
                    "{crate_path}: names {name}, which it does not have"
                ));
            }
        }
    }
    // Every crate of the workspace has its row.
    let listed: Vec<&str> = rows.iter().flat_map(|(p, _)| code_spans(p)).collect();
    for entry in std::fs::read_dir(root.join("crates")).unwrap().flatten() {
        let name = format!("crates/{}", entry.file_name().to_string_lossy());
        if !listed.contains(&name.as_str()) {
            problems.push(format!("{name}: no row in the README's Layout table"));
        }
    }
    assert!(
        problems.is_empty(),
        "README layout vs the tree:\n{}",
        problems.join("\n")
    );
}

/// The blocks of a Markdown text that name their file: (line of the marker, the marker's
/// `PATH` or `PATH#REGION`, the block's text with a final newline per line).
fn marked_blocks(text: &str) -> Vec<(usize, String, String)> {
    let lines: Vec<&str> = text.lines().collect();
    let mut out = Vec::new();
    for (n, line) in lines.iter().enumerate() {
        let Some(spec) = line
            .trim()
            .strip_prefix("<!-- file:")
            .and_then(|rest| rest.strip_suffix("-->"))
        else {
            continue;
        };
        let opens = lines.get(n + 1).is_some_and(|l| l.starts_with("```"));
        assert!(
            opens,
            "line {}: a file marker must precede a fenced block",
            n + 1
        );
        let body: Vec<&str> = lines[n + 2..]
            .iter()
            .take_while(|l| !l.starts_with("```"))
            .copied()
            .collect();
        let block: String = body.iter().map(|l| format!("{l}\n")).collect();
        out.push((n + 1, spec.trim().to_owned(), block));
    }
    out
}

/// A file's text, or the lines between its `region: NAME` and `endregion: NAME` comments.
fn region(text: &str, name: Option<&str>) -> Result<String, String> {
    let Some(name) = name else {
        return Ok(text.to_owned());
    };
    let lines: Vec<&str> = text.lines().collect();
    let find = |tag: &str| {
        lines
            .iter()
            .position(|l| l.trim_end().ends_with(&format!(" {tag}: {name}")))
            .ok_or_else(|| format!("no `{tag}: {name}` line"))
    };
    let (start, end) = (find("region")?, find("endregion")?);
    if end <= start {
        return Err(format!("`endregion: {name}` before `region: {name}`"));
    }
    Ok(lines[start + 1..end]
        .iter()
        .map(|l| format!("{l}\n"))
        .collect())
}

#[test]
fn marked_blocks_and_regions_are_read_as_written() {
    let page = "text\n<!-- file: a.rs#one -->\n```rust\nfn a() {}\n\nfn b() {}\n```\n";
    assert_eq!(
        marked_blocks(page),
        [(
            2,
            "a.rs#one".to_owned(),
            "fn a() {}\n\nfn b() {}\n".to_owned()
        )]
    );
    let file = "use x;\n// region: one\nfn a() {}\n// endregion: one\n";
    assert_eq!(region(file, Some("one")).unwrap(), "fn a() {}\n");
    assert_eq!(region(file, None).unwrap(), file);
    assert!(region(file, Some("two")).is_err());
    assert!(region("// region: one-two\n// endregion: one-two\n", Some("two")).is_err());
}

#[test]
fn the_code_the_docs_show_is_the_code_that_is_built() {
    let root = repo_root();
    let mut problems = Vec::new();
    let mut checked = Vec::new();
    for doc in documents() {
        let text = std::fs::read_to_string(root.join(&doc)).unwrap();
        for (line, spec, block) in marked_blocks(&text) {
            let (path, name) = match spec.split_once('#') {
                Some((path, name)) => (path, Some(name)),
                None => (spec.as_str(), None),
            };
            let at = format!("{}:{line} ({spec})", doc.display());
            let shown = std::fs::read_to_string(root.join(path))
                .map_err(|e| e.to_string())
                .and_then(|file| region(&file, name));
            match shown {
                Ok(want) if want == block => checked.push(at),
                Ok(want) => problems.push(format!(
                    "{at}: the block differs from the file; the file says:\n{want}"
                )),
                Err(why) => problems.push(format!("{at}: {why}")),
            }
        }
    }
    assert!(problems.is_empty(), "{}", problems.join("\n\n"));
    // The plugin guide shows its example crate: the manifest, both binaries, the backend.
    for path in [
        "examples/npu-plugin/Cargo.toml",
        "examples/npu-plugin/src/main.rs",
        "examples/npu-plugin/src/bin/npu-dra.rs",
        "examples/npu-plugin/src/lib.rs#claim-backend",
    ] {
        assert!(
            checked
                .iter()
                .any(|c| c.starts_with("docs/writing-a-plugin.md") && c.contains(path)),
            "docs/writing-a-plugin.md shows {path}; checked: {checked:?}"
        );
    }
}

#[test]
fn the_changelog_has_one_heading_per_kind_in_each_release() {
    let changelog = std::fs::read_to_string(repo_root().join("CHANGELOG.md")).unwrap();
    let mut release = String::new();
    let mut seen: Vec<String> = Vec::new();
    let mut repeated = Vec::new();
    for line in changelog.lines() {
        if let Some(name) = line.strip_prefix("## ") {
            release = name.to_owned();
            seen.clear();
        } else if let Some(kind) = line.strip_prefix("### ") {
            if seen.iter().any(|k| k == kind) {
                repeated.push(format!("{release}: {kind}"));
            }
            seen.push(kind.to_owned());
        }
    }
    assert!(
        repeated.is_empty(),
        "CHANGELOG.md repeats a heading: {repeated:?}"
    );
}

/// The quoted names of the array `const NAME: [&str; N] = [...]` in `source`.
fn const_names(source: &str, name: &str) -> Vec<String> {
    let start = source
        .find(&format!("const {name}:"))
        .unwrap_or_else(|| panic!("no const {name}"));
    let body = &source[start..];
    let open = body.find("= [").unwrap() + 3;
    let close = open + body[open..].find(']').unwrap();
    body[open..close]
        .split(',')
        .filter_map(|s| s.trim().strip_prefix('"')?.strip_suffix('"'))
        .map(str::to_owned)
        .collect()
}

/// docs/testing.md says where every binary the tests start comes from: the whole node's, the
/// API server's and the fleet test's gate's, each in its table of binaries.
#[test]
fn testing_md_says_where_every_binary_comes_from() {
    let root = repo_root();
    let read = |p: &str| std::fs::read_to_string(root.join(p)).unwrap();
    let testing = read("docs/testing.md");
    let start = testing
        .find("## Where the binaries come from")
        .expect("docs/testing.md has a section \"Where the binaries come from\"");
    let section = &testing[start..];
    let section = &section[..section[3..].find("\n## ").map_or(section.len(), |e| e + 3)];
    let mut binaries = const_names(
        &read("crates/devplug-testkit/src/node/requirements.rs"),
        "NODE_BINARIES",
    );
    binaries.extend(const_names(
        &read("crates/devplug-testkit/src/api_server/control_plane.rs"),
        "CONTROL_PLANE_BINARIES",
    ));
    let gates = read("crates/test-gates/src/lib.rs");
    let files = gates
        .split("files: &[")
        .skip(1)
        .flat_map(|s| s[..s.find(']').unwrap()].split(','))
        .filter_map(|s| s.trim().strip_prefix('"')?.strip_suffix('"'))
        .map(str::to_owned);
    binaries.extend(files);
    assert!(binaries.len() >= 10, "{binaries:?}");
    let rows: Vec<&str> = section.lines().filter(|l| l.starts_with("| `")).collect();
    let missing: Vec<&String> = binaries
        .iter()
        .filter(|b| {
            !rows.iter().any(|row| {
                let first = row.split(" | ").next().unwrap_or_default();
                first.contains(&format!("`{b}`"))
            })
        })
        .collect();
    assert!(
        missing.is_empty(),
        "docs/testing.md's table of binaries does not say where these come from: {missing:?}"
    );
    // And how this repository's CI gets them, in words a reader outside can follow.
    assert!(
        section.contains("placed beside the checkout") && section.contains("target/k8s-assets"),
        "{section}"
    );
}

/// The Kubernetes version deploy/README.md says the manifests are checked against is the one
/// k8s-openapi is built for.
#[test]
fn deploy_readme_names_the_kubernetes_types_it_is_checked_against() {
    let root = repo_root();
    let cargo = std::fs::read_to_string(root.join("Cargo.toml")).unwrap();
    let line = cargo
        .lines()
        .find(|l| l.starts_with("k8s-openapi"))
        .expect("the workspace names k8s-openapi");
    let feature = line.split("\"v1_").nth(1).expect("a v1_NN feature");
    let minor: String = feature.chars().take_while(char::is_ascii_digit).collect();
    let readme = std::fs::read_to_string(root.join("deploy/README.md")).unwrap();
    let said = format!("Kubernetes 1.{minor} types");
    assert!(
        readme
            .split_whitespace()
            .collect::<Vec<_>>()
            .join(" ")
            .contains(&said),
        "deploy/README.md should say the manifests are checked against the {said}"
    );
}

/// docs/troubleshooting.md describes the log as the chart writes it by default.
#[test]
fn troubleshooting_describes_the_charts_log_format() {
    let root = repo_root();
    let values = std::fs::read_to_string(root.join("deploy/helm/devplug/values.yaml")).unwrap();
    let format = values
        .lines()
        .find_map(|l| l.strip_prefix("logFormat: "))
        .expect("values.yaml has logFormat")
        .trim();
    let page = std::fs::read_to_string(root.join("docs/troubleshooting.md")).unwrap();
    let bullet = page
        .split("\n- ")
        .find(|b| b.starts_with("**The log**"))
        .expect("troubleshooting.md has a bullet on the log");
    assert!(
        bullet.contains(&format!("`logFormat: {format}`, its default")),
        "the log bullet should say the chart's default format, {format}:\n{bullet}"
    );
}

/// A file as a reader who copies a page's blocks of it gets it: without its `//!` header and
/// its `region:` / `endregion:` lines, blank lines between the blocks.
fn as_copied(file: &str) -> String {
    let kept: Vec<&str> = file
        .lines()
        .skip_while(|l| l.starts_with("//!") || l.is_empty())
        .filter(|l| {
            let l = l.trim();
            !(l.starts_with("// region: ") || l.starts_with("// endregion: "))
        })
        .collect();
    let mut text = kept.join("\n");
    text.push('\n');
    text
}

/// The plugin page's test blocks, copied one after the other in the page's order, are the
/// whole test file the workspace builds and runs (`cargo test -p npu-plugin`): the `use` lines
/// and the `Plugin` helper included, nothing left out. So the page's tests compile as copied.
#[test]
fn the_plugin_pages_test_blocks_are_the_whole_test_file() {
    let root = repo_root();
    let page = std::fs::read_to_string(root.join("docs/writing-a-plugin.md")).unwrap();
    let path = "examples/npu-plugin/tests/simulator.rs";
    let blocks: Vec<String> = marked_blocks(&page)
        .into_iter()
        .filter(|(_, spec, _)| spec.split('#').next() == Some(path))
        .map(|(_, _, block)| block)
        .collect();
    assert!(
        blocks.len() >= 3,
        "the page shows {path} in {} blocks",
        blocks.len()
    );
    let copied = blocks.join("\n");
    let file = std::fs::read_to_string(root.join(path)).unwrap();
    let whole = as_copied(&file);
    if copied != whole {
        let at = copied
            .lines()
            .zip(whole.lines())
            .position(|(a, b)| a != b)
            .unwrap_or(copied.lines().count().min(whole.lines().count()));
        panic!(
            "docs/writing-a-plugin.md's blocks of {path}, copied in order, differ from the file \
             at line {} of the copy (the file there: {:?}); show every part of the file, in order",
            at + 1,
            whole.lines().nth(at)
        );
    }
    // A block missing (the helper, the `use` lines) is caught.
    let without_helper: Vec<&String> = blocks
        .iter()
        .filter(|b| !b.contains("struct Plugin"))
        .collect();
    assert_ne!(
        without_helper
            .iter()
            .map(|b| b.as_str())
            .collect::<Vec<_>>()
            .join("\n"),
        whole
    );
}

/// docs/gpus.md's cut-over from NVIDIA's plugin says what an operator otherwise finds out the
/// hard way: the exclusion in every ORed affinity term and for GPU Feature Discovery's
/// DaemonSet too, the GPU image and `image.repository`, where keeping NVIDIA's container toolkit
/// is answered, and that a rollback removes devplug's node labels.
#[test]
fn the_gpu_cut_over_covers_what_operators_trip_on() {
    let page = std::fs::read_to_string(repo_root().join("docs/gpus.md")).unwrap();
    let start = page
        .find("### Cutting over a running cluster")
        .expect("docs/gpus.md has the cut-over section");
    let section = &page[start..];
    let section = &section[..section[4..].find("\n### ").map_or(section.len(), |e| e + 4)];
    let flat = section.split_whitespace().collect::<Vec<_>>().join(" ");
    for words in [
        "into *every* term's `matchExpressions`",
        "two DaemonSets",
        "`devplug:0.1.0-gpu`",
        "--set image.repository=$REGISTRY/devplug",
        "`driver_files: false`",
        "(../deploy/README.md#nvidia)",
        "`devplug labels remove --node NODE`",
    ] {
        assert!(
            flat.contains(words),
            "the cut-over section should say {words:?}"
        );
    }
}
