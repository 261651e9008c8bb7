//! The commands README.md and docs/ show, run as written. A shell block is runnable when
//! the line before its fence is `<!-- runnable -->`, or `<!-- runnable; then: CMD -->`
//! where CMD (run after the block, in the same shell) checks what the block left and
//! cleans it up. Each block runs with bash (`set -e`) from the repository's root in a
//! process group of its own, `s3csi` first on PATH (the binary this suite built) and
//! `S3CSI_DEMO_EXIT=1` so that `s3csi demo` exits after its self-check instead of waiting
//! for Ctrl-C; the group is killed afterwards (what the block started in the background).
//! Blocks that need AWS or a cluster are not marked (the e2e suite installs the chart).

use crate::common::*;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

const MARK: &str = "<!-- runnable";

/// One marked block: where it is, its text, and the check that follows it.
struct Runnable {
    at: String,
    script: String,
    then: Option<String>,
}

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn runnable_blocks(file: &Path) -> Vec<Runnable> {
    let text = std::fs::read_to_string(file).unwrap_or_else(|e| panic!("{file:?}: {e}"));
    let lines: Vec<&str> = text.lines().collect();
    let mut out = Vec::new();
    for (i, line) in lines.iter().enumerate() {
        let Some(rest) = line.trim().strip_prefix(MARK) else {
            continue;
        };
        let at = format!(
            "{}:{}",
            file.strip_prefix(root()).unwrap_or(file).display(),
            i + 1
        );
        let rest = rest
            .strip_suffix("-->")
            .unwrap_or_else(|| panic!("{at}: the marker ends with -->"))
            .trim();
        let then = match rest.strip_prefix(';') {
            None if rest.is_empty() => None,
            Some(r) => Some(
                r.trim()
                    .strip_prefix("then:")
                    .unwrap_or_else(|| panic!("{at}: expected `; then: CMD`"))
                    .trim()
                    .to_string(),
            ),
            None => panic!("{at}: unknown marker {rest:?}"),
        };
        let fence = lines.get(i + 1).copied().unwrap_or("");
        assert!(
            fence == "```sh" || fence == "```bash",
            "{at}: the marker must be followed by a ```sh fence, not {fence:?}"
        );
        let body: Vec<&str> = lines[i + 2..]
            .iter()
            .take_while(|l| !l.starts_with("```"))
            .copied()
            .collect();
        out.push(Runnable {
            at,
            script: body.join("\n"),
            then,
        });
    }
    out
}

fn all_runnable_blocks() -> Vec<Runnable> {
    let mut files = vec![root().join("README.md")];
    let mut docs: Vec<PathBuf> = std::fs::read_dir(root().join("docs"))
        .expect("docs/")
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "md"))
        .collect();
    docs.sort();
    files.extend(docs);
    files.iter().flat_map(|f| runnable_blocks(f)).collect()
}

/// Runs one block; returns its combined output, or panics with it.
fn run(block: &Runnable) -> String {
    let bin_dir = s3csi_bin().parent().unwrap().to_path_buf();
    let path = format!(
        "{}:{}",
        bin_dir.display(),
        std::env::var("PATH").unwrap_or_default()
    );
    let mut script = format!("set -e\n{}\n", block.script);
    if let Some(then) = &block.then {
        script += &format!("{then}\n");
    }
    let log = scratch_dir("doc-block").join("out");
    std::fs::create_dir_all(log.parent().unwrap()).unwrap();
    let out = std::fs::File::create(&log).unwrap();
    let mut cmd = Command::new("bash");
    cmd.arg("-c")
        .arg(&script)
        .current_dir(root())
        .env("PATH", path)
        .env("S3CSI_DEMO_EXIT", "1")
        .stdin(Stdio::null())
        .stdout(out.try_clone().unwrap())
        .stderr(out);
    std::os::unix::process::CommandExt::process_group(&mut cmd, 0);
    let mut child = cmd.spawn().expect("bash");
    let pgid = child.id() as i32;
    let deadline = Instant::now() + Duration::from_secs(600);
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break Some(s);
        }
        if Instant::now() > deadline {
            break None;
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    // What the block left running in the background (a server started with `&`).
    unsafe { libc::killpg(pgid, libc::SIGTERM) };
    let _ = child.wait();
    let output = std::fs::read_to_string(&log).unwrap_or_default();
    let _ = std::fs::remove_dir_all(log.parent().unwrap());
    match status {
        Some(s) if s.success() => output,
        Some(s) => panic!("{}: exited with {s}:\n{script}\n---\n{output}", block.at),
        None => panic!(
            "{}: still running after 600s:\n{script}\n---\n{output}",
            block.at
        ),
    }
}

/// README's quick start and local-server example are among the marked blocks: a marker
/// lost in an edit fails here rather than leaving the commands unchecked.
#[test]
fn readme_and_docs_commands_run_as_written() {
    let blocks = all_runnable_blocks();
    let scripts: Vec<&str> = blocks.iter().map(|b| b.script.as_str()).collect();
    assert!(
        scripts.contains(&"cargo run --release -- demo"),
        "README's quick start is not marked runnable: {scripts:?}"
    );
    assert!(
        scripts.iter().any(|s| s.contains("s3csi s3-server")),
        "README's local-server example is not marked runnable: {scripts:?}"
    );
    for block in &blocks {
        let t = Instant::now();
        let output = run(block);
        eprintln!("{}: ran in {:.1?}", block.at, t.elapsed());
        eprintln!("{output}");
        if block.script.contains("-- demo") {
            assert!(
                output.contains("volume unpublished and deleted, everything stopped"),
                "{}: the demo did not finish its round:\n{output}",
                block.at
            );
        }
    }
}
