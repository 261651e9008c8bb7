//! Deferred deletes: once one DELETE has succeeded, `unlink` returns before S3 answers the
//! next ones; the name is gone through the mount at once, a new file of the same name is
//! never removed by the older DELETE, and unmount/SIGTERM waits for all of them. Real
//! mounts against moto through `common::fault_proxy`, which holds every DELETE back so the
//! window in which a delete is under way is wide.

use crate::common;

use common::fault_proxy::{Fault, FaultProxy, Rule};
use common::*;
use std::fs;
use std::process::Command;
use std::time::{Duration, Instant};

const DELETE_DELAY: Duration = Duration::from_millis(1500);

/// A mount with `files` written through it (parent directories first), so they are in S3,
/// whose later DELETEs each take `DELETE_DELAY` longer; the first `rm` (synchronous, before
/// the delay) has been made.
fn mount_with_slow_deletes(
    hint: &str,
    extra: &[&str],
    files: &[&str],
) -> (Mount, std::sync::Arc<FaultProxy>) {
    let bucket = new_bucket(hint);
    let proxy = FaultProxy::start(&s3().endpoint, 1);
    let m = Mount::try_start_with(&proxy.endpoint(), &bucket, extra, &[])
        .unwrap_or_else(|e| panic!("{e}"));
    fs::write(m.path("first"), b"x").unwrap();
    fs::remove_file(m.path("first")).unwrap();
    assert!(s3_get(&bucket, "first").is_none(), "the first unlink waits");
    for f in files {
        if let Some((dir, _)) = f.rsplit_once('/') {
            fs::create_dir_all(m.path(dir)).unwrap();
        }
        fs::write(m.path(f), f.as_bytes()).unwrap();
    }
    proxy.add_rule(Rule::op("DeleteObject", 1.0, Fault::Delay(DELETE_DELAY)));
    proxy.enable(true);
    (m, proxy)
}

fn names(m: &Mount) -> Vec<String> {
    let mut v: Vec<String> = fs::read_dir(&m.dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    v.sort();
    v
}

#[test]
fn rm_returns_before_the_delete_and_the_name_is_gone_at_once() {
    let (m, _proxy) = mount_with_slow_deletes("dd-gone", &[], &["a", "b"]);
    fs::remove_file(m.path("a")).unwrap();
    // The DELETE is still held back, so S3 has the object, but the mount does not show it.
    assert_eq!(s3_get(&m.bucket, "a").as_deref(), Some(&b"a"[..]));
    assert!(!m.path("a").exists());
    assert!(fs::File::open(m.path("a")).is_err());
    // A listing waits for the DELETEs in its directory, then cannot show the name.
    assert_eq!(names(&m), ["b"]);
    assert!(s3_get(&m.bucket, "a").is_none());
    assert_eq!(s3_keys(&m.bucket, ""), ["b"]);
}

#[test]
fn a_file_created_again_after_rm_survives_the_older_delete() {
    let (mut m, _proxy) = mount_with_slow_deletes("dd-again", &[], &["k", "src"]);
    fs::remove_file(m.path("k")).unwrap();
    fs::write(m.path("k"), b"new contents").unwrap();
    assert_eq!(fs::read(m.path("k")).unwrap(), b"new contents");
    // A rename onto a name whose DELETE is under way lands after it too.
    fs::write(m.path("r"), b"old r").unwrap();
    fs::remove_file(m.path("r")).unwrap();
    fs::rename(m.path("src"), m.path("r")).unwrap();
    // An empty file, created after its name's rm, whose PUT runs in the background.
    fs::write(m.path("e"), b"e").unwrap();
    fs::remove_file(m.path("e")).unwrap();
    close_checked(fs::File::create(m.path("e")).unwrap()).unwrap();
    m.stop();
    assert_eq!(s3_get(&m.bucket, "k").unwrap(), b"new contents");
    assert_eq!(s3_get(&m.bucket, "r").unwrap(), b"src");
    assert_eq!(s3_get(&m.bucket, "e").unwrap(), b"");
    let mut keys = s3_keys(&m.bucket, "");
    keys.sort();
    assert_eq!(keys, ["e", "k", "r"]);
}

#[test]
fn rm_r_then_sigterm_deletes_everything() {
    let mut files: Vec<String> = (0..40).map(|i| format!("d/f{i:02}")).collect();
    files.push("keep".into());
    let files: Vec<&str> = files.iter().map(String::as_str).collect();
    let (mut m, _proxy) = mount_with_slow_deletes("dd-rmr", &[], &files);
    let start = Instant::now();
    assert!(Command::new("rm")
        .arg("-r")
        .arg(m.path("d"))
        .status()
        .unwrap()
        .success());
    // 41 DELETEs held 1.5 s each: only the listing before the directory's own DELETE
    // waits, for the 40 file DELETEs at once.
    assert!(
        start.elapsed() < DELETE_DELAY * 10,
        "rm -r took {:?}: the DELETEs did not overlap",
        start.elapsed()
    );
    assert!(!m.path("d").exists());
    fs::write(m.path("after"), b"1").unwrap();
    fs::remove_file(m.path("after")).unwrap();
    m.stop();
    assert_eq!(s3_keys(&m.bucket, ""), ["keep"]);
}

#[test]
fn a_failed_background_delete_is_logged_and_the_next_rm_waits_and_fails() {
    let (m, proxy) =
        mount_with_slow_deletes("dd-fail", &["--metadata-ttl", "200ms"], &["doomed", "next"]);
    proxy.clear_rules();
    proxy.add_rule(Rule::op("DeleteObject", 1.0, Fault::Error500));
    fs::remove_file(m.path("doomed")).unwrap();
    let deadline = Instant::now() + Duration::from_secs(60);
    while !m.log_text().contains("could not delete doomed in S3") {
        assert!(
            Instant::now() < deadline,
            "no error logged: {}",
            m.log_text()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    // The object is still there, and the mount shows it again once its metadata expires.
    assert_eq!(s3_get(&m.bucket, "doomed").unwrap(), b"doomed");
    std::thread::sleep(Duration::from_millis(400));
    assert_eq!(fs::read(m.path("doomed")).unwrap(), b"doomed");
    // The next rm is synchronous again, so its failure reaches the caller.
    let err = fs::remove_file(m.path("next")).unwrap_err();
    assert_eq!(err.raw_os_error(), Some(libc::EIO), "{err}");
    proxy.enable(false);
    fs::remove_file(m.path("next")).unwrap();
    fs::remove_file(m.path("doomed")).unwrap();
    assert!(s3_get(&m.bucket, "next").is_none());
}

#[test]
fn sync_delete_makes_rm_wait() {
    for opts in [&["--sync-delete"][..], &["-o", "sync_delete"][..]] {
        let (m, _proxy) = mount_with_slow_deletes("dd-sync", opts, &["a"]);
        fs::remove_file(m.path("a")).unwrap();
        assert!(s3_get(&m.bucket, "a").is_none(), "{opts:?}");
    }
}
