//! Deferred creation of empty files: `touch` (create + close with nothing written) returns
//! without waiting for the empty object's PUT; everything ordered after that PUT waits for
//! it. Real mounts against moto through `common::fault_proxy`, which delays every PUT so
//! that the window in which a file is still being created is wide.

use crate::common;

use common::fault_proxy::{Fault, FaultProxy, Req, Rule};
use common::*;
use std::fs;
use std::io::Write;
use std::process::Command;
use std::time::{Duration, Instant};

/// Long enough that a close that waited for the PUT is told apart from one that did not,
/// even while other tests keep both cores busy (at 400 ms, a busy machine's 237 ms touch
/// once failed the check).
const PUT_DELAY: Duration = Duration::from_millis(1000);

/// A mount whose PUTs (and copies) each take `PUT_DELAY` longer.
fn slow_put_mount(hint: &str, extra: &[&str]) -> (Mount, std::sync::Arc<FaultProxy>) {
    let bucket = new_bucket(hint);
    let proxy = FaultProxy::start(&s3().endpoint, 1);
    proxy.add_rule(Rule::new(
        |r: &Req| r.op() == "PutObject/CopyObject",
        1.0,
        Fault::Delay(PUT_DELAY),
    ));
    proxy.enable(true);
    let m = Mount::try_start_with(&proxy.endpoint(), &bucket, extra, &[])
        .unwrap_or_else(|e| panic!("{e}"));
    (m, proxy)
}

fn touch(path: &std::path::Path) -> Duration {
    let start = Instant::now();
    let f = fs::File::create(path).unwrap();
    close_checked(f).unwrap();
    start.elapsed()
}

#[test]
fn touch_returns_before_the_put_and_the_file_is_visible_at_once() {
    let (m, _proxy) = slow_put_mount("ec-visible", &[]);
    let took = touch(&m.path("new"));
    assert!(took < PUT_DELAY / 2, "touch waited for the PUT: {took:?}");
    // Visible through the mount while its PUT is still under way.
    let meta = fs::metadata(m.path("new")).unwrap();
    assert!(meta.is_file() && meta.len() == 0);
    let names: Vec<String> = fs::read_dir(&m.dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    assert_eq!(names, ["new"]);
    assert_eq!(fs::read(m.path("new")).unwrap(), b"");
    // Closing that reading descriptor waited for the PUT.
    assert_eq!(s3_get(&m.bucket, "new").unwrap(), b"");
}

#[test]
fn many_touches_then_sigterm_leave_every_object() {
    let (mut m, _proxy) = slow_put_mount("ec-sigterm", &[]);
    fs::create_dir(m.path("d")).unwrap();
    let start = Instant::now();
    for i in 0..200 {
        touch(&m.path(&format!("d/f{i:03}")));
    }
    let took = start.elapsed();
    m.stop();
    assert!(
        took < PUT_DELAY * 20,
        "200 touches took {took:?}: not deferred"
    );
    let mut keys = s3_keys(&m.bucket, "d/");
    keys.sort();
    let mut want: Vec<String> = (0..200).map(|i| format!("d/f{i:03}")).collect();
    want.push("d/".into());
    want.sort();
    assert_eq!(keys, want);
    for k in ["d/f000", "d/f123", "d/f199"] {
        assert_eq!(s3_get(&m.bucket, k).unwrap(), b"", "{k}");
    }
    assert!(
        !m.log_text().contains("could not create"),
        "{}",
        m.log_text()
    );
}

#[test]
fn touch_then_unlink_leaves_nothing() {
    let (m, _proxy) = slow_put_mount("ec-unlink", &[]);
    for i in 0..5 {
        let name = format!("gone{i}");
        touch(&m.path(&name));
        fs::remove_file(m.path(&name)).unwrap();
        assert!(s3_get(&m.bucket, &name).is_none(), "{name} after unlink");
        assert!(!m.path(&name).exists());
    }
    std::thread::sleep(PUT_DELAY * 2);
    assert!(
        s3_keys(&m.bucket, "").is_empty(),
        "{:?}",
        s3_keys(&m.bucket, "")
    );
}

#[test]
fn touch_then_write_keeps_the_content() {
    let (m, _proxy) = slow_put_mount("ec-write", &[]);
    // Written again without O_TRUNC (allowed on an empty object), with O_TRUNC, and by a
    // shell redirection (open, dup2, close of the original before the write).
    touch(&m.path("a"));
    let mut f = fs::OpenOptions::new()
        .write(true)
        .open(m.path("a"))
        .unwrap();
    f.write_all(b"content a").unwrap();
    close_checked(f).unwrap();
    touch(&m.path("b"));
    fs::write(m.path("b"), b"content b").unwrap();
    let out = Command::new("sh")
        .arg("-c")
        .arg(format!("echo content c > '{}'", m.path("c").display()))
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    assert_eq!(s3_get(&m.bucket, "a").unwrap(), b"content a");
    assert_eq!(s3_get(&m.bucket, "b").unwrap(), b"content b");
    assert_eq!(s3_get(&m.bucket, "c").unwrap(), b"content c\n");
    std::thread::sleep(PUT_DELAY * 2);
    assert_eq!(s3_get(&m.bucket, "a").unwrap(), b"content a");
    assert_eq!(s3_get(&m.bucket, "b").unwrap(), b"content b");
    assert_eq!(s3_get(&m.bucket, "c").unwrap(), b"content c\n");
    assert_eq!(fs::read(m.path("c")).unwrap(), b"content c\n");
}

#[test]
fn touch_then_rename_moves_the_empty_object() {
    let (m, _proxy) = slow_put_mount("ec-rename", &[]);
    touch(&m.path("src"));
    fs::rename(m.path("src"), m.path("dst")).unwrap();
    assert_eq!(s3_get(&m.bucket, "dst").unwrap(), b"");
    assert!(s3_get(&m.bucket, "src").is_none());
    // Onto a file whose own creation is under way.
    fs::write(m.path("full"), b"full").unwrap();
    touch(&m.path("target"));
    fs::rename(m.path("full"), m.path("target")).unwrap();
    std::thread::sleep(PUT_DELAY * 2);
    assert_eq!(s3_get(&m.bucket, "target").unwrap(), b"full");
    let mut keys = s3_keys(&m.bucket, "");
    keys.sort();
    assert_eq!(keys, ["dst", "target"]);
}

#[test]
fn fsync_makes_an_empty_file_durable() {
    let (m, _proxy) = slow_put_mount("ec-fsync", &[]);
    // On the creating descriptor, before close.
    let f = fs::File::create(m.path("synced")).unwrap();
    f.sync_all().unwrap();
    assert_eq!(s3_get(&m.bucket, "synced").unwrap(), b"");
    close_checked(f).unwrap();
    // On a later descriptor, after a close that did not wait.
    touch(&m.path("later"));
    let f = fs::File::open(m.path("later")).unwrap();
    f.sync_all().unwrap();
    assert_eq!(s3_get(&m.bucket, "later").unwrap(), b"");
}

#[test]
fn sync_create_makes_close_wait() {
    for opts in [&["--sync-create"][..], &["-o", "sync_create"][..]] {
        let (m, _proxy) = slow_put_mount("ec-sync", opts);
        let took = touch(&m.path("f"));
        assert_eq!(s3_get(&m.bucket, "f").unwrap(), b"", "{opts:?}");
        assert!(took >= PUT_DELAY, "{opts:?}: close took {took:?}");
    }
}

#[test]
fn a_failed_background_put_is_logged_and_the_file_disappears() {
    let bucket = new_bucket("ec-fail");
    let proxy = FaultProxy::start(&s3().endpoint, 2);
    let m = Mount::try_start_with(
        &proxy.endpoint(),
        &bucket,
        &["--metadata-ttl", "200ms"],
        &[
            ("S3CSI_CONNECT_TIMEOUT", "2s"),
            ("S3CSI_READ_TIMEOUT", "3s"),
        ],
    )
    .unwrap_or_else(|e| panic!("{e}"));
    proxy.add_rule(Rule::new(
        |r: &Req| r.op() == "PutObject/CopyObject",
        1.0,
        Fault::Error500,
    ));
    proxy.enable(true);
    touch(&m.path("doomed"));
    let deadline = Instant::now() + Duration::from_secs(30);
    while !m
        .log_text()
        .contains("could not create empty file doomed in S3")
    {
        assert!(
            Instant::now() < deadline,
            "no error logged: {}",
            m.log_text()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    proxy.enable(false);
    std::thread::sleep(Duration::from_millis(300));
    assert!(!m.path("doomed").exists(), "the file is still shown");
    assert!(s3_get(&bucket, "doomed").is_none());
    // The name can be used again.
    fs::write(m.path("doomed"), b"second try").unwrap();
    assert_eq!(s3_get(&bucket, "doomed").unwrap(), b"second try");
}

#[test]
fn touches_then_umount_leave_every_object() {
    let (mut m, _proxy) = slow_put_mount("ec-umount", &[]);
    for i in 0..50 {
        touch(&m.path(&format!("f{i:02}")));
    }
    assert!(Command::new("umount")
        .arg(&m.dir)
        .status()
        .unwrap()
        .success());
    m.stop();
    let mut keys = s3_keys(&m.bucket, "");
    keys.sort();
    let want: Vec<String> = (0..50).map(|i| format!("f{i:02}")).collect();
    assert_eq!(keys, want);
}
