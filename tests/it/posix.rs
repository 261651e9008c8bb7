//! The project's POSIX conformance test (`tests/posix/conformance.py`, table-driven like
//! pjdfstest; issue 16) over a real mount on each S3 server, moto and the embedded one: every
//! case, then the mount is stopped and started again and the persistence cases run. Fails on
//! any unexpected failure; the known ones are explained in the script's table (and README's
//! semantics table). Prints the script's summary lines (the pass counts).

use crate::common;

use common::*;
use std::path::Path;
use std::process::Command;

fn script() -> std::path::PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/posix/conformance.py")
}

/// Runs the script on `dir`; returns its summary line, or panics with every line that is
/// not a pass.
fn run_script(server: &str, dir: &Path, extra: &[&str], mount: &Mount) -> String {
    let out = Command::new("python3")
        .arg(script())
        .arg(dir)
        .args(extra)
        .output()
        .expect("python3");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let summary = stdout.lines().last().unwrap_or_default().to_string();
    if !out.status.success() {
        let notable: Vec<&str> = stdout
            .lines()
            .filter(|l| !l.starts_with("PASS") && !l.starts_with("KNOWN"))
            .collect();
        panic!(
            "conformance.py {extra:?} on {server}: {}\n{}\n{}\nmount log:\n{}",
            out.status,
            notable.join("\n"),
            String::from_utf8_lossy(&out.stderr),
            mount.log_text()
        );
    }
    summary
}

/// The whole table, a remount, then the persistence cases.
fn conformance(server: &str, endpoint: &str, bucket: &str, env: &[(&str, &str)]) {
    let opts = ["--allow-other"];
    let mut m =
        Mount::try_start_with(endpoint, bucket, &opts, env).unwrap_or_else(|e| panic!("{e}"));
    let first = run_script(server, &m.dir, &[], &m);
    // A clean stop saves every pending metadata change; a new mounter starts from S3 alone.
    m.stop();
    let m = Mount::try_start_with(endpoint, bucket, &opts, env).unwrap_or_else(|e| panic!("{e}"));
    let second = run_script(server, &m.dir, &["--after-remount"], &m);
    eprintln!("[posix conformance, {server}] before the remount: {first}");
    eprintln!("[posix conformance, {server}] after it: {second}");
}

#[test]
fn posix_conformance_on_moto() {
    let bucket = new_bucket("posix");
    conformance("moto", &s3().endpoint, &bucket, &[]);
}

#[test]
fn posix_conformance_on_the_embedded_server() {
    let server = runtime().block_on(start_embedded_server("posix"));
    conformance(
        "the embedded server",
        &server.endpoint(),
        "posix",
        &EMBEDDED_KEYS,
    );
    runtime().block_on(server.stop());
}

/// `rm -r` of a tree another S3 client wrote: its directories have no marker object, so
/// each one is gone from S3 with its last file, and the rmdir that follows must still
/// succeed (it was ENOENT, so `rm -r` failed).
#[test]
fn rm_r_of_a_tree_without_directory_markers() {
    use s3csi::s3::ObjectClient;
    let bucket = new_bucket("posix-implicit");
    let c = client(&bucket);
    for key in ["t/a", "t/b", "t/sub/c", "t/sub/deeper/d", "u/e"] {
        runtime()
            .block_on(c.put_object(key, bytes::Bytes::from_static(b"x")))
            .unwrap();
    }
    let mut m = Mount::start(&bucket, &[]);
    let out = Command::new("rm")
        .arg("-r")
        .arg(m.path("t"))
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "rm -r: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(!m.path("t").exists());
    std::fs::remove_file(m.path("u/e")).unwrap();
    std::fs::remove_dir(m.path("u")).unwrap();
    assert_eq!(std::fs::read_dir(&m.dir).unwrap().count(), 0);
    m.stop(); // waits for the DELETEs sent in the background
    assert_eq!(s3_keys(&bucket, ""), Vec::<String>::new());
}
