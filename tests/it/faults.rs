//! Fault injection: a real mount talks to moto through `common::fault_proxy`, which answers
//! some requests with 500/503, resets connections mid-request or mid-response, stalls or
//! delays them. The promise checked: every write that close/fsync acknowledged is in S3
//! with the right bytes; every write that was not acknowledged got an error (EIO) at
//! write/close/fsync — zero silent loss; failed uploads leave no multipart upload behind;
//! a stalled request does not hang the application.
//!
//! Quick by default; `S3CSI_FULL=1` runs the long random workload. `S3CSI_SEED=N` replays.

use crate::common;

use common::fault_proxy::{Fault, FaultProxy, Req, Rule};
use common::*;
use std::collections::BTreeMap;
use std::fs;
use std::io::{Read, Write};
use std::sync::Arc;
use std::time::{Duration, Instant};

const MIB: usize = 1024 * 1024;

/// Short client timeouts so stalls cost seconds, not minutes.
const FAST_TIMEOUTS: &[(&str, &str)] = &[
    ("S3CSI_CONNECT_TIMEOUT", "2s"),
    ("S3CSI_READ_TIMEOUT", "3s"),
    ("S3CSI_ATTEMPT_TIMEOUT", "30s"),
];

fn faulty_mount(bucket: &str, proxy: &FaultProxy, extra: &[&str]) -> Mount {
    Mount::try_start_with(&proxy.endpoint(), bucket, extra, FAST_TIMEOUTS)
        .unwrap_or_else(|e| panic!("{e}"))
}

fn errno(e: &std::io::Error) -> i32 {
    e.raw_os_error().unwrap_or(-1)
}

/// Writes `data` as a whole new file (O_TRUNC), optionally fsyncs, and closes with the
/// close(2) result checked. Ok only if the file system acknowledged the data.
fn write_file(path: &std::path::Path, data: &[u8], fsync: bool) -> Result<(), (String, i32)> {
    let mut f = fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .open(path)
        .map_err(|e| ("open".to_string(), errno(&e)))?;
    for chunk in data.chunks(256 * 1024) {
        if let Err(e) = f.write_all(chunk) {
            let _ = close_checked(f);
            return Err(("write".into(), errno(&e)));
        }
    }
    if fsync {
        if let Err(e) = f.sync_all() {
            let _ = close_checked(f);
            return Err(("fsync".into(), errno(&e)));
        }
    }
    close_checked(f).map_err(|e| ("close".into(), errno(&e)))
}

/// What a key may hold in S3: one state once acknowledged, several after a failure whose
/// effect is unknown (None = absent).
type Possible = Vec<Option<Arc<Vec<u8>>>>;

fn merge(a: &Possible, b: &Possible) -> Possible {
    let mut out = a.clone();
    for x in b {
        if !out.contains(x) {
            out.push(x.clone());
        }
    }
    out
}

#[derive(Default, Debug)]
struct Tally {
    ops: u64,
    acked_writes: u64,
    failed: BTreeMap<String, u64>,
    bytes_written: u64,
    /// Acknowledged bytes checked in S3 right after the acknowledgement.
    bytes_verified: u64,
    bytes_read_back: u64,
}

/// The random workload: writes of small and multipart-sized files (some fsynced),
/// overwrites, renames, deletes, and reads of files whose content is known.
fn workload(m: &Mount, rng: &mut Rng, ops: usize, model: &mut BTreeMap<String, Possible>) -> Tally {
    let names = ["a", "b", "c", "e.bin", "d/x", "d/y", "d/z z", "d/big"];
    let mut t = Tally::default();
    fs::create_dir_all(m.path("d")).unwrap();
    for _ in 0..ops {
        t.ops += 1;
        let name = *rng.pick(&names);
        let existing: Vec<String> = model
            .iter()
            .filter(|(_, p)| p.iter().any(|s| s.is_some()))
            .map(|(k, _)| k.clone())
            .collect();
        let roll = rng.below(100);
        if roll < 45 || existing.is_empty() {
            // (Over)write.
            let len = if rng.chance(0.12) {
                rng.range(5 * MIB as u64, 12 * MIB as u64) as usize
            } else {
                rng.below(300 * 1024) as usize
            };
            let data = Arc::new(rng.bytes(len));
            let fsync = rng.chance(0.2);
            let before = model.get(name).cloned().unwrap_or_else(|| vec![None]);
            match write_file(&m.path(name), &data, fsync) {
                Ok(()) => {
                    // Acknowledged: it must be in S3 now, byte for byte.
                    let key = name.to_string();
                    let got = s3_get(&m.bucket, &key);
                    assert!(
                        got.as_deref() == Some(&data[..]),
                        "{key}: acknowledged {len} bytes, S3 holds {:?}",
                        got.map(|g| g.len())
                    );
                    t.bytes_verified += len as u64;
                    t.acked_writes += 1;
                    t.bytes_written += len as u64;
                    model.insert(name.to_string(), vec![Some(data)]);
                }
                Err((stage, e)) => {
                    assert_eq!(
                        e,
                        libc::EIO,
                        "{name}: {stage} failed with errno {e}, not EIO"
                    );
                    *t.failed.entry(format!("write ({stage})")).or_default() += 1;
                    model.insert(name.to_string(), merge(&before, &vec![Some(data)]));
                }
            }
        } else if roll < 60 {
            let src = rng.pick(&existing).clone();
            let dst = rng.pick(&names).to_string();
            if src == dst {
                continue;
            }
            let src_p = model[&src].clone();
            let dst_p = model.get(&dst).cloned().unwrap_or_else(|| vec![None]);
            match fs::rename(m.path(&src), m.path(&dst)) {
                Ok(()) => {
                    model.insert(dst, src_p);
                    model.insert(src, vec![None]);
                }
                Err(e) if errno(&e) == libc::ENOENT && src_p.contains(&None) => {
                    // An earlier unlink or rename whose outcome was uncertain did remove it.
                    model.insert(src, vec![None]);
                }
                Err(e) => {
                    let e = errno(&e);
                    assert!(
                        [libc::EIO, libc::ETIMEDOUT].contains(&e),
                        "rename {src} {dst}: errno {e}"
                    );
                    *t.failed.entry("rename".into()).or_default() += 1;
                    model.insert(dst, merge(&dst_p, &src_p));
                    model.insert(src.clone(), merge(&src_p, &vec![None]));
                }
            }
        } else if roll < 75 {
            let victim = rng.pick(&existing).clone();
            let before = model[&victim].clone();
            match fs::remove_file(m.path(&victim)) {
                Ok(()) => {
                    // Deferred: a DELETE that then fails in the background (logged) leaves
                    // the object, so an acknowledged unlink is not certain under faults.
                    model.insert(victim, merge(&before, &vec![None]));
                }
                Err(e) if errno(&e) == libc::ENOENT && before.contains(&None) => {
                    model.insert(victim, vec![None]);
                }
                Err(e) => {
                    let e = errno(&e);
                    assert!(
                        [libc::EIO, libc::ETIMEDOUT].contains(&e),
                        "unlink {victim}: errno {e}"
                    );
                    *t.failed.entry("unlink".into()).or_default() += 1;
                    model.insert(victim, merge(&before, &vec![None]));
                }
            }
        } else {
            // Read back a file whose content is certain.
            let certain: Vec<&String> = existing.iter().filter(|k| model[*k].len() == 1).collect();
            let Some(k) = certain.first().map(|_| rng.pick(&certain).to_string()) else {
                continue;
            };
            let want = model[&k][0].clone().unwrap();
            let mut got = Vec::new();
            match fs::File::open(m.path(&k)).and_then(|mut f| f.read_to_end(&mut got)) {
                Ok(_) => {
                    assert!(
                        got.len() == want.len() && got == *want,
                        "{k}: read {} bytes that differ from the {} acknowledged",
                        got.len(),
                        want.len()
                    );
                    t.bytes_read_back += got.len() as u64;
                }
                Err(e) => {
                    let e = errno(&e);
                    assert!(
                        [libc::EIO, libc::ETIMEDOUT].contains(&e),
                        "read {k}: errno {e}"
                    );
                    *t.failed.entry("read".into()).or_default() += 1;
                }
            }
        }
    }
    t
}

/// Checks S3 (directly, not through the proxy) against the model; returns bytes verified.
fn verify(bucket: &str, model: &BTreeMap<String, Possible>) -> u64 {
    let mut verified = 0;
    for (k, possible) in model {
        let got = s3_get(bucket, k);
        let ok = possible
            .iter()
            .any(|p| p.as_deref().map(|v| v.as_slice()) == got.as_deref());
        assert!(
            ok,
            "{k}: S3 holds {:?} bytes, the model allows sizes {:?}",
            got.as_ref().map(|g| g.len()),
            possible
                .iter()
                .map(|p| p.as_ref().map(|v| v.len()))
                .collect::<Vec<_>>()
        );
        if possible.len() == 1 {
            verified += got.map(|g| g.len() as u64).unwrap_or(0);
        }
    }
    let known: Vec<&String> = model.keys().collect();
    for key in s3_keys(bucket, "") {
        assert!(
            key == "d/" || known.contains(&&key),
            "unexpected key {key:?} in S3"
        );
    }
    verified
}

#[test]
fn random_faults_lose_no_acknowledged_write() {
    let mut rng = Rng::from_env("random_faults", 6);
    let ops = if full_run() { 400 } else { 60 };
    let bucket = new_bucket("faults");
    let proxy = FaultProxy::start(&s3().endpoint, rng.next_u64());
    let with_body = |r: &Req| r.body_len > 0;
    // About 16% of requests get a fault; stalls are capped because each costs a timeout.
    proxy.add_rule(Rule::any(0.04, Fault::Error500));
    proxy.add_rule(Rule::any(0.03, Fault::SlowDown503));
    proxy.add_rule(Rule::new(with_body, 0.03, Fault::ResetRequest));
    proxy.add_rule(Rule::new(
        |r: &Req| r.op() != "CreateMultipartUpload",
        0.02,
        Fault::ResetResponse,
    ));
    proxy.add_rule(Rule::op("GetObject", 0.03, Fault::StallBody).limit(3));
    proxy.add_rule(Rule::any(0.01, Fault::Stall).limit(3));
    proxy.add_rule(Rule::any(0.03, Fault::Delay(Duration::from_millis(150))));
    let m = faulty_mount(&bucket, &proxy, &["--part-size", "5MiB"]);
    proxy.enable(true);
    let start = Instant::now();
    let mut model = BTreeMap::new();
    let t = workload(&m, &mut rng, ops, &mut model);
    proxy.enable(false);
    drop(m);
    let verified = verify(&bucket, &model);
    let open = open_multipart_uploads(&bucket);
    let visible: u64 = t.failed.values().sum();
    eprintln!(
        "random_faults: {} ops in {:?}: {} writes acknowledged ({} bytes, all verified in S3 at \
         once), {} application-visible failures {:?}; {} bytes read back through the mount; \
         {} bytes verified in S3 at the end; proxy: {}",
        t.ops,
        start.elapsed(),
        t.acked_writes,
        t.bytes_written,
        visible,
        t.failed,
        t.bytes_read_back,
        verified,
        proxy.summary()
    );
    assert!(
        proxy.faults_total() >= 10,
        "too few faults injected to mean anything"
    );
    // The SDK's retries hide almost every fault from the application.
    assert!(
        visible * 10 <= proxy.faults_total(),
        "{visible} failures visible for {} faults",
        proxy.faults_total()
    );
    assert!(open.is_empty(), "multipart uploads left open: {open:?}");
}

#[test]
fn failed_uploads_report_eio_keep_the_old_object_and_abort_the_upload() {
    let bucket = new_bucket("upfail");
    let proxy = FaultProxy::start(&s3().endpoint, 7);
    let m = faulty_mount(&bucket, &proxy, &["--part-size", "5MiB"]);
    let old = vec![1u8; 1000];
    for k in ["small", "parts", "complete"] {
        write_file(&m.path(k), &old, false).unwrap();
    }
    let on = |key: &'static str, op: &'static str| {
        move |r: &Req| r.op() == op && r.path.ends_with(&format!("/{key}"))
    };
    proxy.add_rule(Rule::new(
        on("small", "PutObject/CopyObject"),
        1.0,
        Fault::Error500,
    ));
    proxy.add_rule(Rule::new(
        on("parts", "UploadPart"),
        1.0,
        Fault::SlowDown503,
    ));
    proxy.add_rule(Rule::new(
        on("complete", "CompleteMultipartUpload"),
        1.0,
        Fault::Error500,
    ));
    proxy.enable(true);
    let start = Instant::now();
    let mut rng = Rng::new(1);
    let big = rng.bytes(11 * MIB);
    for (k, data) in [
        ("small", &big[..4096]),
        ("parts", &big[..]),
        ("complete", &big[..]),
    ] {
        let res = write_file(&m.path(k), data, k == "complete");
        let (stage, e) = res.expect_err(k);
        eprintln!("{k}: refused at {stage} with errno {e}");
        assert_eq!(e, libc::EIO, "{k}: {stage}");
        // The old object is untouched, and readable through the mount.
        assert!(s3_get(&bucket, k).unwrap() == old, "{k}: S3 changed");
        assert!(
            fs::read(m.path(k)).unwrap() == old,
            "{k}: mount shows new data"
        );
    }
    let took = start.elapsed();
    let open = open_multipart_uploads(&bucket);
    eprintln!(
        "failed uploads: 3 writes refused in {took:?}; proxy: {}",
        proxy.summary()
    );
    assert!(open.is_empty(), "multipart uploads left open: {open:?}");
    // Each failing request was tried 5 times (the SDK's standard retry).
    assert_eq!(
        proxy.stats.faults.lock().unwrap()["500 InternalError"] % 5,
        0,
        "{}",
        proxy.summary()
    );
    assert!(m.log_text().contains("upload failed"), "{}", m.log_text());
}

#[test]
fn stalled_and_broken_downloads_neither_hang_nor_corrupt_reads() {
    let bucket = new_bucket("stall");
    let proxy = FaultProxy::start(&s3().endpoint, 8);
    let m = Mount::try_start_with(
        &proxy.endpoint(),
        &bucket,
        &[],
        &[
            ("S3CSI_READ_TIMEOUT", "1s"),
            ("S3CSI_ATTEMPT_TIMEOUT", "10s"),
        ],
    )
    .unwrap();
    let mut rng = Rng::new(2);
    let data = rng.bytes(3 * MIB);
    fs::write(m.path("obj"), &data).unwrap();
    let read_all = |m: &Mount| -> (std::io::Result<Vec<u8>>, Duration) {
        let start = Instant::now();
        let r = fs::read(m.path("obj"));
        (r, start.elapsed())
    };
    // One stalled GET (no response at all): the read timeout (1s here) and a retry.
    for fault in [
        Fault::Stall,
        Fault::StallBody,
        Fault::ResetResponse,
        Fault::Error500,
    ] {
        proxy.clear_rules();
        proxy.add_rule(Rule::op("GetObject", 1.0, fault).limit(1));
        proxy.enable(true);
        std::thread::sleep(Duration::from_millis(1100)); // metadata TTL: fresh open
        let (r, took) = read_all(&m);
        let got = r.unwrap_or_else(|e| panic!("{fault:?}: read failed: {e}"));
        assert!(got == data, "{fault:?}: wrong bytes");
        eprintln!("one {fault:?} on GET: read ok in {took:?}");
        assert!(took < Duration::from_secs(15), "{fault:?}: {took:?}");
    }
    // Every GET stalls: the read fails in bounded time instead of hanging.
    proxy.clear_rules();
    proxy.add_rule(Rule::op("GetObject", 1.0, Fault::Stall));
    let (r, took) = read_all(&m);
    let e = r.expect_err("read through a dead S3 succeeded");
    eprintln!("all GETs stalled: read failed with {e} after {took:?}");
    assert!([libc::EIO, libc::ETIMEDOUT].contains(&errno(&e)), "{e}");
    assert!(took < Duration::from_secs(60), "{took:?}");
    proxy.enable(false);
    // And the mount is still serving.
    assert!(read_all(&m).0.unwrap() == data);
    eprintln!("stalls: proxy: {}", proxy.summary());
}

#[test]
fn sigterm_mid_multipart_write_completes_the_upload() {
    let bucket = new_bucket("sigterm-mp");
    let proxy = FaultProxy::start(&s3().endpoint, 9);
    // Slow parts so that some are in flight when the signal arrives.
    proxy.add_rule(Rule::op(
        "UploadPart",
        1.0,
        Fault::Delay(Duration::from_millis(700)),
    ));
    let mut m = faulty_mount(&bucket, &proxy, &["--part-size", "5MiB"]);
    proxy.enable(true);
    let mut rng = Rng::new(3);
    let data = rng.bytes(17 * MIB);
    let mut f = fs::File::create(m.path("open-big")).unwrap();
    f.write_all(&data).unwrap();
    m.stop();
    drop(f);
    let got = s3_get(&bucket, "open-big").expect("the upload was abandoned");
    assert!(got == data, "{} bytes in S3 differ", got.len());
    assert!(open_multipart_uploads(&bucket).is_empty());
    eprintln!(
        "sigterm: {} bytes completed; proxy: {}",
        got.len(),
        proxy.summary()
    );
}

#[test]
fn lost_answers_to_create_and_complete_multipart() {
    let bucket = new_bucket("lostanswer");
    let proxy = FaultProxy::start(&s3().endpoint, 10);
    let m = faulty_mount(&bucket, &proxy, &["--part-size", "5MiB"]);
    let data = Rng::new(4).bytes(7 * MIB);
    // S3 completes the upload but the answer is lost; the SDK retries and finds no upload.
    proxy.add_rule(Rule::op("CompleteMultipartUpload", 1.0, Fault::ResetResponse).limit(1));
    proxy.enable(true);
    let res = write_file(&m.path("complete-lost"), &data, false);
    assert!(s3_get(&bucket, "complete-lost").unwrap() == data);
    assert!(res.is_ok(), "durable data reported as failed: {res:?}");
    // S3 creates an upload but the answer is lost: the retry creates another one, and the
    // first is unknown to us: only a bucket lifecycle rule
    // (AbortIncompleteMultipartUpload) can clean it up. Measured, not hidden.
    proxy.clear_rules();
    proxy.add_rule(Rule::op("CreateMultipartUpload", 1.0, Fault::ResetResponse).limit(1));
    write_file(&m.path("create-lost"), &data, false).unwrap();
    assert!(s3_get(&bucket, "create-lost").unwrap() == data);
    let open = open_multipart_uploads(&bucket);
    eprintln!(
        "lost answers: orphaned uploads after a lost CreateMultipartUpload answer: {}; proxy: {}",
        open.len(),
        proxy.summary()
    );
    assert!(open.len() <= 1, "{open:?}");
}

/// About 5 % of requests fail, each in a way the SDK retries (5xx, a connection reset
/// before or after the server saw the request).
fn five_percent_faults(proxy: &FaultProxy) {
    let with_body = |r: &Req| r.body_len > 0;
    proxy.add_rule(Rule::any(0.02, Fault::Error500));
    proxy.add_rule(Rule::any(0.01, Fault::SlowDown503));
    proxy.add_rule(Rule::new(with_body, 0.01, Fault::ResetRequest));
    proxy.add_rule(Rule::new(
        |r: &Req| r.op() != "CreateMultipartUpload",
        0.01,
        Fault::ResetResponse,
    ));
}

/// One edit in place through the mount: append, overwrite in the middle, or truncate
/// (shrink or grow), then close with its result checked. Returns the new content if
/// every call succeeded, or the failing call and its errno.
fn edit_file(
    path: &std::path::Path,
    old: &[u8],
    rng: &mut Rng,
) -> (Vec<u8>, Result<(), (String, i32)>) {
    use std::io::{Seek, SeekFrom};
    use std::os::unix::fs::FileExt;
    let mut new = old.to_vec();
    let roll = rng.below(3);
    let open = match roll {
        0 => fs::OpenOptions::new().append(true).open(path),
        _ => fs::OpenOptions::new().read(true).write(true).open(path),
    };
    let mut f = match open {
        Ok(f) => f,
        Err(e) => return (new, Err(("open".into(), errno(&e)))),
    };
    let res = match roll {
        0 => {
            let len = rng.range(1, 700 * 1024) as usize;
            let tail = rng.bytes(len);
            new.extend_from_slice(&tail);
            f.write_all(&tail).map_err(|e| ("append".to_string(), e))
        }
        1 => {
            let at = rng.below(old.len() as u64 + 1) as usize;
            let len = rng.range(1, 300 * 1024) as usize;
            let patch = rng.bytes(len);
            if new.len() < at + patch.len() {
                new.resize(at + patch.len(), 0);
            }
            new[at..at + patch.len()].copy_from_slice(&patch);
            f.write_all_at(&patch, at as u64)
                .map_err(|e| ("pwrite".to_string(), e))
        }
        _ => {
            let len = rng.below(old.len() as u64 * 3 / 2 + 1024);
            new.resize(len as usize, 0);
            f.set_len(len)
                .and_then(|_| f.seek(SeekFrom::End(0)).map(|_| ()))
                .map_err(|e| ("truncate".to_string(), e))
        }
    };
    if let Err((call, e)) = res {
        let _ = close_checked(f);
        return (new, Err((call, errno(&e))));
    }
    (
        new,
        close_checked(f).map_err(|e| ("close".into(), errno(&e))),
    )
}

/// Edits in place (append, overwrite in the middle, truncate) of small and multipart-sized
/// objects while ~5 % of requests fail: every edit close acknowledged is in S3 byte for
/// byte at once; a failed one got EIO and S3 holds the old or the new content, nothing
/// else; no multipart upload is left open.
#[test]
fn edits_in_place_under_faults_lose_nothing_acknowledged() {
    let mut rng = Rng::from_env("edit_faults", 11);
    let ops = if full_run() { 300 } else { 60 };
    let bucket = new_bucket("editfaults");
    let proxy = FaultProxy::start(&s3().endpoint, rng.next_u64());
    five_percent_faults(&proxy);
    let mut model: BTreeMap<String, Vec<u8>> = BTreeMap::new();
    let c = client(&bucket);
    for (name, len) in [("small", 40 * 1024), ("mid", 3 * MIB), ("big", 11 * MIB)] {
        use s3csi::s3::ObjectClient;
        let data = rng.bytes(len);
        runtime()
            .block_on(c.put_object(name, data.clone().into()))
            .unwrap();
        model.insert(name.to_string(), data);
    }
    let m = faulty_mount(&bucket, &proxy, &["--part-size", "5MiB"]);
    proxy.enable(true);
    let (start, mut acked, mut failed) = (Instant::now(), 0, BTreeMap::<String, u64>::new());
    for _ in 0..ops {
        let name = rng.pick(&["small", "mid", "big"]).to_string();
        let old = model[&name].clone();
        let (new, res) = edit_file(&m.path(&name), &old, &mut rng);
        let got = s3_get(&bucket, &name).expect("the object is never deleted");
        match res {
            Ok(()) => {
                assert!(
                    got == new,
                    "{name}: acknowledged {} bytes, S3 holds {}",
                    new.len(),
                    got.len()
                );
                acked += 1;
                model.insert(name, new);
            }
            Err((call, e)) => {
                assert_eq!(
                    e,
                    libc::EIO,
                    "{name}: {call} failed with errno {e}, not EIO"
                );
                assert!(
                    got == old || got == new,
                    "{name}: after a failed {call}, S3 holds neither the old nor the new bytes"
                );
                *failed.entry(call).or_default() += 1;
                model.insert(name, got);
            }
        }
    }
    proxy.enable(false);
    // Everything the mount shows now is what S3 holds.
    for (name, data) in &model {
        assert!(&fs::read(m.path(name)).unwrap() == data, "{name} read back");
    }
    drop(m);
    let open = open_multipart_uploads(&bucket);
    eprintln!(
        "edit_faults: {ops} edits in {:?}: {acked} acknowledged and verified in S3, failures \
         {failed:?}; proxy: {}",
        start.elapsed(),
        proxy.summary()
    );
    assert!(proxy.faults_total() >= 5, "too few faults to mean anything");
    assert!(open.is_empty(), "multipart uploads left open: {open:?}");
}

/// Python's `os.rename` of a directory of 1000 files while ~5 % of requests fail:
/// retried until it succeeds, after which every file is under the new name with its
/// content, none is left under the old one, and nothing is duplicated.
#[test]
fn directory_rename_under_faults_finishes_on_retry() {
    use s3csi::s3::ObjectClient;
    const FILES: usize = 1000;
    let bucket = new_bucket("renamefaults");
    let c = client(&bucket);
    runtime().block_on(async {
        let puts = (0..FILES).map(|i| {
            let c = &c;
            async move {
                let key = format!("src/{}/f{i:04}", i % 10);
                c.put_object(&key, format!("content {i}").into_bytes().into())
                    .await
                    .unwrap();
            }
        });
        futures::future::join_all(puts).await;
    });
    let proxy = FaultProxy::start(&s3().endpoint, 5);
    five_percent_faults(&proxy);
    // Two outages that outlast the SDK's retries: one in the middle of the copies (the
    // first attempt fails), one among the DELETEs (of the copies it removes, or of the old
    // tree once all copies exist).
    let outage = |op: &'static str, after: u64| {
        let seen = std::sync::atomic::AtomicU64::new(0);
        Rule::new(
            move |r: &Req| {
                r.op() == op && seen.fetch_add(1, std::sync::atomic::Ordering::SeqCst) >= after
            },
            1.0,
            Fault::Error500,
        )
        .limit(400)
    };
    proxy.add_rule(outage("PutObject/CopyObject", 400));
    proxy.add_rule(outage("DeleteObject", 300));
    let m = faulty_mount(&bucket, &proxy, &[]);
    proxy.enable(true);
    let start = Instant::now();
    let mut attempts = Vec::new();
    for _ in 0..6 {
        let out = std::process::Command::new("python3")
            .args(["-c", "import os, sys; os.rename(sys.argv[1], sys.argv[2])"])
            .arg(m.path("src"))
            .arg(m.path("dst"))
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr).trim().to_string();
        attempts.push(if out.status.success() {
            "ok".into()
        } else {
            err
        });
        if out.status.success() {
            break;
        }
    }
    proxy.enable(false);
    eprintln!(
        "rename_faults: {FILES} files renamed in {:?}, attempts {attempts:?}; proxy: {}",
        start.elapsed(),
        proxy.summary()
    );
    assert_eq!(
        attempts.last().map(String::as_str),
        Some("ok"),
        "{attempts:?}"
    );
    assert!(!m.path("src").exists());
    assert_eq!(fs::read_dir(m.path("dst")).unwrap().count(), 10);
    drop(m);
    assert_eq!(s3_keys(&bucket, "src/"), Vec::<String>::new());
    let keys = s3_keys(&bucket, "dst/");
    assert_eq!(keys.len(), FILES, "nothing lost, nothing duplicated");
    for i in (0..FILES).step_by(97) {
        let key = format!("dst/{}/f{i:04}", i % 10);
        assert_eq!(
            s3_get(&bucket, &key),
            Some(format!("content {i}").into_bytes())
        );
    }
    assert!(
        proxy.faults_total() >= 20,
        "too few faults to mean anything"
    );
}
