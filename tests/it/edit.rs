//! Editing in place through a real mount on moto: writes anywhere, appends, truncates, the
//! requests an edit of a large object costs, conflicts with another S3 client (no lost
//! update, no torn read), the staging space bound, a mounter crash with an uncommitted
//! edit, and real programs (SQLite, git, tar).

use crate::common;

use common::fault_proxy::FaultProxy;
use common::*;
use s3csi::s3::ObjectClient;
use std::fs;
use std::io::{Read, Seek, SeekFrom, Write};
use std::os::unix::fs::FileExt;
use std::process::Command;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

const MIB: u64 = 1024 * 1024;

/// The edits kept in `cache/lost+found` (not the `.note.json` notes beside them).
fn lost_found_edits(cache: &std::path::Path) -> Vec<std::path::PathBuf> {
    fs::read_dir(cache.join("lost+found"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| !p.to_string_lossy().ends_with(".note.json"))
        .collect()
}

fn errno(e: &std::io::Error) -> i32 {
    e.raw_os_error().unwrap_or(-1)
}

fn put(bucket: &str, key: &str, body: Vec<u8>) {
    runtime()
        .block_on(client(bucket).put_object(key, body.into()))
        .unwrap();
}

/// Body bytes of PutObject/UploadPart requests, and how many UploadPart(Copy) requests
/// named a copy source, as the proxy saw them.
#[derive(Default)]
struct Traffic {
    uploaded: AtomicU64,
    copies: AtomicU64,
}

fn counting_proxy_to(upstream: &str) -> (Arc<FaultProxy>, Arc<Traffic>) {
    let proxy = FaultProxy::start(upstream, 1);
    let traffic = Arc::new(Traffic::default());
    let t = traffic.clone();
    proxy.set_hook(move |req, headers, body| {
        if req.method == "PUT" {
            let copy = headers
                .iter()
                .any(|(k, _)| k.eq_ignore_ascii_case("x-amz-copy-source"));
            if copy {
                t.copies.fetch_add(1, Ordering::SeqCst);
            } else {
                t.uploaded.fetch_add(body.len() as u64, Ordering::SeqCst);
            }
        }
        None
    });
    (proxy, traffic)
}

/// What S3 holds at the end, and whether multipart uploads are left open there.
struct Holds<'a> {
    object: &'a dyn Fn() -> Vec<u8>,
    open_uploads: &'a dyn Fn() -> usize,
}

/// Three 6-byte edits of a `size` object, then an append of 1 MiB, through a mount of
/// `bucket` at `upstream` behind a counting proxy: each uploads at most a few parts, the
/// rest is copied on the server.
fn edit_a_large_object(upstream: &str, bucket: &str, env: &[(&str, &str)], size: u64, s3: Holds) {
    let (proxy, traffic) = counting_proxy_to(upstream);
    let m = Mount::try_start_with(&proxy.endpoint(), bucket, &["--part-size", "8MiB"], env)
        .unwrap_or_else(|e| panic!("{e}"));
    let mut rng = Rng::from_env("edit-big", 7);
    let mut want = rng.bytes(size as usize);
    {
        let mut f = fs::File::create(m.path("big")).unwrap();
        for c in want.chunks(4 * MIB as usize) {
            f.write_all(c).unwrap();
        }
        close_checked(f).unwrap();
    }
    let before = traffic.uploaded.load(Ordering::SeqCst);
    let start = Instant::now();
    let f = fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(m.path("big"))
        .unwrap();
    for at in [4096, size / 2 + 12345, size - 100] {
        f.write_all_at(b"EDITED", at).unwrap();
        want[at as usize..at as usize + 6].copy_from_slice(b"EDITED");
    }
    let mut back = [0u8; 6];
    f.read_exact_at(&mut back, size / 2 + 12345).unwrap();
    assert_eq!(
        &back, b"EDITED",
        "a read through the editing descriptor sees the edit"
    );
    close_checked(f).unwrap();
    let took = start.elapsed();
    let sent = traffic.uploaded.load(Ordering::SeqCst) - before;
    let copies = traffic.copies.load(Ordering::SeqCst);
    eprintln!(
        "3 edits of a {} MiB object at {upstream}: {took:?}, {sent} bytes uploaded, {copies} \
         parts copied on the server",
        size / MIB
    );
    assert!(
        sent <= 3 * 8 * MIB,
        "uploaded {sent} bytes for three 6-byte edits"
    );
    assert!(copies >= 2, "the untouched ranges are copied on the server");

    // Append 1 MiB: the old object is copied on the server, only the tail goes up.
    let before = traffic.uploaded.load(Ordering::SeqCst);
    let tail = rng.bytes(MIB as usize);
    let mut f = fs::OpenOptions::new()
        .append(true)
        .open(m.path("big"))
        .unwrap();
    f.write_all(&tail).unwrap();
    close_checked(f).unwrap();
    want.extend_from_slice(&tail);
    let sent = traffic.uploaded.load(Ordering::SeqCst) - before;
    assert!(sent <= 2 * MIB, "append of 1 MiB uploaded {sent} bytes");
    drop(m);
    assert!((s3.object)() == want, "S3 holds the edited object");
    assert_eq!((s3.open_uploads)(), 0, "multipart uploads left open");
}

#[test]
fn edits_of_a_large_object_send_only_the_edited_parts() {
    let size = if full_run() { 1024 * MIB } else { 128 * MIB };
    let bucket = new_bucket("edit-big");
    let holds = Holds {
        object: &|| s3_get(&bucket, "big").unwrap(),
        open_uploads: &|| open_multipart_uploads(&bucket).len(),
    };
    edit_a_large_object(&s3().endpoint, &bucket, &[], size, holds);
}

/// The same with a 1 GiB object on the embedded server, which stores it in seconds where
/// moto takes half a minute.
#[test]
fn edits_of_a_1_gib_object_on_the_embedded_server_send_only_the_edited_parts() {
    let server = runtime().block_on(start_embedded_server("edit"));
    let store = &server.store;
    let holds = Holds {
        object: &|| {
            let (_, mut f) = store.open_object("edit", "big").unwrap();
            let mut v = Vec::new();
            f.read_to_end(&mut v).unwrap();
            v
        },
        open_uploads: &|| {
            store
                .list_uploads("edit", "", None, None, 1000)
                .unwrap()
                .0
                .len()
        },
    };
    edit_a_large_object(
        &server.endpoint(),
        "edit",
        &EMBEDDED_KEYS,
        1024 * MIB,
        holds,
    );
    runtime().block_on(server.stop());
}

#[test]
fn a_reader_of_a_file_being_streamed_sees_what_was_written() {
    let bucket = new_bucket("edit-read-stream");
    let m = Mount::start(&bucket, &["--part-size", "5MiB"]);
    // Small (nothing sent yet) and large (parts already uploaded) streams.
    for (name, first) in [("small", 1000usize), ("large", 12 * MIB as usize)] {
        let mut rng = Rng::from_env("edit-read-stream", first as u64);
        let (a, b) = (rng.bytes(first), rng.bytes(3000));
        let mut w = fs::File::create(m.path(name)).unwrap();
        w.write_all(&a).unwrap();
        // `tail -f`, `cat` of a file being written: no EBUSY, the bytes so far.
        let mut r = fs::File::open(m.path(name)).expect("a reader opens a file being written");
        let mut got = Vec::new();
        r.read_to_end(&mut got).unwrap();
        assert!(got == a, "{name}: the reader sees what was written so far");
        w.write_all(&b).unwrap();
        let mut more = Vec::new();
        r.read_to_end(&mut more).unwrap();
        assert!(more == b, "{name}: and what is written next");
        close_checked(w).unwrap();
        drop(r);
        let want: Vec<u8> = a.iter().chain(&b).copied().collect();
        assert!(
            s3_get(&bucket, name).unwrap() == want,
            "{name}: S3 holds all of it"
        );
    }
}

#[test]
fn writes_anywhere_truncates_and_appends_from_two_descriptors() {
    let bucket = new_bucket("edit-small");
    let m = Mount::start(&bucket, &[]);
    let p = m.path("f");
    fs::write(&p, b"0123456789").unwrap();
    // Python's open(..., 'r+'): overwrite in the middle, then read it back before close.
    let mut f = fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(&p)
        .unwrap();
    f.seek(SeekFrom::Start(3)).unwrap();
    f.write_all(b"abc").unwrap();
    f.seek(SeekFrom::Start(0)).unwrap();
    let mut s = String::new();
    f.read_to_string(&mut s).unwrap();
    assert_eq!(s, "012abc6789");
    // Past the end leaves a hole of zeros.
    f.write_all_at(b"Z", 12).unwrap();
    close_checked(f).unwrap();
    assert_eq!(s3_get(&bucket, "f").unwrap(), b"012abc6789\0\0Z");

    // O_APPEND from two descriptors at once: both land, in order.
    let open = || fs::OpenOptions::new().append(true).open(&p).unwrap();
    let (mut a, mut b) = (open(), open());
    a.write_all(b"<a1>").unwrap();
    b.write_all(b"<b1>").unwrap();
    a.write_all(b"<a2>").unwrap();
    close_checked(a).unwrap();
    close_checked(b).unwrap();
    assert_eq!(
        s3_get(&bucket, "f").unwrap(),
        b"012abc6789\0\0Z<a1><b1><a2>"
    );

    // fallocate grows with zeros; punching a hole zeroes a range.
    let f = fs::OpenOptions::new().write(true).open(&p).unwrap();
    let fd = std::os::fd::AsRawFd::as_raw_fd(&f);
    assert_eq!(unsafe { libc::fallocate(fd, 0, 0, 30) }, 0);
    let punch = libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE;
    assert_eq!(unsafe { libc::fallocate(fd, punch, 0, 3) }, 0);
    close_checked(f).unwrap();
    let mut want = b"\0\0\0abc6789\0\0Z<a1><b1><a2>".to_vec();
    want.resize(30, 0);
    assert_eq!(s3_get(&bucket, "f").unwrap(), want);
}

#[test]
fn another_clients_overwrite_during_an_edit_is_kept_and_the_edit_goes_to_lost_found() {
    let bucket = new_bucket("edit-conflict");
    let cache = scratch_dir("edit-conflict-cache");
    let m = Mount::start(&bucket, &["--cache-dir", cache.to_str().unwrap()]);
    put(&bucket, "doc", b"original text".to_vec());
    std::thread::sleep(Duration::from_millis(100));
    let f = fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(m.path("doc"))
        .unwrap();
    f.write_all_at(b"MINE", 0).unwrap();
    put(&bucket, "doc", b"theirs, written meanwhile".to_vec());
    let err = close_checked(f).expect_err("close of a conflicting edit must fail");
    assert_eq!(errno(&err), libc::EIO, "{err}");
    assert_eq!(
        s3_get(&bucket, "doc").unwrap(),
        b"theirs, written meanwhile"
    );
    let lost = lost_found_edits(&cache);
    let data = lost.first().expect("the edit is in lost+found");
    assert_eq!(&fs::read(data).unwrap()[..4], b"MINE");
    let note = fs::read_to_string(s3csi::fs::staging::lost_note(data)).unwrap();
    assert!(note.contains("\"key\":\"doc\""), "{note}");
    assert!(m.log_text().contains("lost+found"), "one log line names it");
    // The next open starts from their version.
    std::thread::sleep(Duration::from_millis(100));
    let f = fs::OpenOptions::new()
        .write(true)
        .open(m.path("doc"))
        .unwrap();
    f.write_all_at(b"T", 0).unwrap();
    close_checked(f).unwrap();
    assert_eq!(
        s3_get(&bucket, "doc").unwrap(),
        b"Theirs, written meanwhile"
    );
}

#[test]
fn a_reader_gets_one_version_or_estale_never_a_mix() {
    let bucket = new_bucket("edit-torn");
    let m = Mount::start(&bucket, &["--metadata-ttl", "1m"]);
    let old = vec![b'o'; 40 * MIB as usize];
    put(&bucket, "obj", old);
    // Both exist before the mount lists the bucket (it trusts the listing for 1 minute).
    put(&bucket, "small", b"new ".to_vec());
    let mut f = fs::File::open(m.path("obj")).unwrap();
    let mut first = vec![0u8; MIB as usize];
    f.read_exact(&mut first).unwrap();
    assert!(first.iter().all(|b| *b == b'o'));
    // Another client replaces it with a bigger object.
    put(&bucket, "obj", vec![b'n'; 50 * MIB as usize]);
    let mut rest = Vec::new();
    match f.read_to_end(&mut rest) {
        Ok(_) => assert!(
            rest.iter().all(|b| *b == b'o') && rest.len() == 39 * MIB as usize,
            "the old version, whole"
        ),
        Err(e) => assert_eq!(errno(&e), libc::ESTALE, "{e}"),
    }
    assert!(
        rest.iter().all(|b| *b == b'o'),
        "never bytes of the new version"
    );
    drop(f);
    // A small object replaced within the TTL: a new open reads the new version whole
    // (issue 40.1: its first read was ESTALE), not the new bytes cut to the old size.
    assert_eq!(fs::read(m.path("small")).unwrap(), b"new ");
    put(&bucket, "small", b"new new".to_vec());
    assert_eq!(fs::read(m.path("small")).unwrap(), b"new new");
    // The same for a file this mount wrote itself.
    fs::write(m.path("mine"), b"short").unwrap();
    put(&bucket, "mine", b"replaced, longer".to_vec());
    assert_eq!(fs::read(m.path("mine")).unwrap(), b"replaced, longer");
}

#[test]
fn the_staging_bound_is_enospc_for_the_writer() {
    let bucket = new_bucket("edit-enospc");
    let m = Mount::start(&bucket, &["--cache-size", "2MiB"]);
    put(&bucket, "big", vec![1u8; 8 * MIB as usize]);
    std::thread::sleep(Duration::from_millis(100));
    let f = fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(m.path("big"))
        .unwrap();
    f.write_all_at(&vec![2u8; MIB as usize], 0).unwrap();
    let err = f
        .write_all_at(&vec![3u8; 2 * MIB as usize], 4 * MIB)
        .expect_err("past the bound");
    assert_eq!(errno(&err), libc::ENOSPC, "{err}");
    // Reads still work beyond the bound (served without being kept).
    let mut buf = vec![0u8; 1024];
    f.read_exact_at(&mut buf, 7 * MIB).unwrap();
    assert!(buf.iter().all(|b| *b == 1));
    close_checked(f).unwrap();
    let got = s3_get(&bucket, "big").unwrap();
    assert!(
        got[..MIB as usize].iter().all(|b| *b == 2),
        "what was accepted is committed"
    );
    assert!(got[MIB as usize..4 * MIB as usize].iter().all(|b| *b == 1));
    // The space came back with the close.
    let f = fs::OpenOptions::new()
        .write(true)
        .open(m.path("big"))
        .unwrap();
    f.write_all_at(&vec![4u8; MIB as usize], 0).unwrap();
    close_checked(f).unwrap();
}

#[test]
fn an_uncommitted_edit_is_kept_in_lost_found_after_a_mounter_crash() {
    let bucket = new_bucket("edit-crash");
    let cache = scratch_dir("edit-crash-cache");
    let args = ["--cache-dir", cache.to_str().unwrap()];
    let mut m = Mount::start(&bucket, &args);
    fs::write(m.path("f"), b"committed").unwrap();
    let f = fs::OpenOptions::new()
        .write(true)
        .open(m.path("f"))
        .unwrap();
    f.write_all_at(b"UNSAVED", 2).unwrap();
    let pid = m.child.as_ref().unwrap().id();
    unsafe { libc::kill(pid as i32, libc::SIGKILL) };
    let _ = m.child.take().map(|mut c| c.wait());
    drop(f);
    m.stop();
    let m = Mount::start(&bucket, &args);
    assert_eq!(
        fs::read(m.path("f")).unwrap(),
        b"committed",
        "S3 kept the last commit"
    );
    let kept = lost_found_edits(&cache);
    assert_eq!(kept.len(), 1, "{kept:?}");
    assert_eq!(fs::read(&kept[0]).unwrap(), b"coUNSAVED");
    assert!(m.log_text().contains("lost+found"));
}

#[test]
fn an_exclusive_create_does_not_overwrite_another_clients_new_object() {
    let bucket = new_bucket("edit-excl");
    let m = Mount::start(&bucket, &[]);
    fs::create_dir(m.path("d")).unwrap();
    assert_eq!(fs::read_dir(m.path("d")).unwrap().count(), 0);
    // Another client creates the name after this mount listed the directory empty.
    put(&bucket, "d/lock", b"theirs".to_vec());
    let mut f = fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .open(m.path("d/lock"))
        .expect("the mount's listing said the name was free");
    f.write_all(b"mine").unwrap();
    let err = close_checked(f).expect_err("close must fail: the key exists in S3");
    assert_eq!(errno(&err), libc::EIO, "{err}");
    assert_eq!(s3_get(&bucket, "d/lock").unwrap(), b"theirs");
    // Without a rival, O_EXCL creates work as before.
    let mut f = fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .open(m.path("d/free"))
        .unwrap();
    f.write_all(b"mine").unwrap();
    close_checked(f).unwrap();
    assert_eq!(s3_get(&bucket, "d/free").unwrap(), b"mine");
    assert!(
        m.log_text().contains("d/lock"),
        "one log line names the key"
    );
}

/// Renames of files open for writing, as log rotation and tools that rename their output
/// do: S3 holds what was written so far under the new name at once, and the rest at close.
#[test]
fn files_open_for_writing_can_be_renamed() {
    let bucket = new_bucket("edit-rename-open");
    let m = Mount::start(&bucket, &["--part-size", "5MiB"]);
    // An app appending to its log while logrotate moves it away (an edit of an object).
    put(&bucket, "app.log", b"line0\n".to_vec());
    let mut log = fs::OpenOptions::new()
        .append(true)
        .open(m.path("app.log"))
        .unwrap();
    log.write_all(b"line1\n").unwrap();
    fs::rename(m.path("app.log"), m.path("app.log.1")).expect("rename of an open log");
    assert_eq!(s3_get(&bucket, "app.log.1").unwrap(), b"line0\nline1\n");
    log.write_all(b"line2\n").unwrap();
    close_checked(log).unwrap();
    assert_eq!(
        s3_get(&bucket, "app.log.1").unwrap(),
        b"line0\nline1\nline2\n"
    );
    assert!(s3_get(&bucket, "app.log").is_none());

    // A new file being streamed, small (nothing sent yet) and past its first part, moved
    // into another directory that is itself renamed before the writer closes.
    fs::create_dir(m.path("out")).unwrap();
    for (name, first) in [("small", 3000usize), ("large", 12 * MIB as usize)] {
        let mut rng = Rng::from_env("edit-rename-open", first as u64);
        let (a, b) = (rng.bytes(first), rng.bytes(7 * MIB as usize));
        let mut w = fs::File::create(m.path(name)).unwrap();
        w.write_all(&a).unwrap();
        fs::rename(m.path(name), m.path(&format!("out/{name}"))).unwrap();
        fs::rename(m.path("out"), m.path("done")).expect("rename of a directory with an open file");
        fs::rename(m.path("done"), m.path("out")).unwrap();
        w.write_all(&b).unwrap();
        close_checked(w).unwrap();
        let want: Vec<u8> = a.iter().chain(&b).copied().collect();
        assert!(
            s3_get(&bucket, &format!("out/{name}")).unwrap() == want,
            "{name}: S3 holds all of it under the new name"
        );
        assert_eq!(
            fs::read(m.path(&format!("out/{name}"))).unwrap().len(),
            want.len()
        );
    }
    // The old names' DELETEs go in the background (deferred deletes).
    let want = ["app.log.1", "out/", "out/large", "out/small"];
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let mut keys = s3_keys(&bucket, "");
        keys.sort();
        if keys == want || Instant::now() > deadline {
            assert_eq!(keys, want);
            break;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// A new file open for reading and writing.
fn read_write_new(path: &std::path::Path) -> fs::File {
    fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create_new(true)
        .open(path)
        .unwrap()
}

/// A Python script that creates table `t` in the SQLite database `db` and inserts 20
/// transactions of `per_transaction` rows (`row 0`, `row 1`, ...), then closes it.
fn sqlite_inserts(db: &std::path::Path, per_transaction: usize) -> String {
    format!(
        "import sqlite3\n\
         c = sqlite3.connect({db:?})\n\
         c.execute('create table t(i integer primary key, v text)')\n\
         for b in range(20):\n\
         \x20   with c:\n\
         \x20       c.executemany('insert into t(v) values(?)', [('row %d' % (b * {per_transaction} + i),) for i in range({per_transaction})])\n\
         c.close()\n"
    )
}

/// Polls S3 until `key` holds `want` (write-back uploads in the background).
fn wait_for_s3(bucket: &str, key: &str, want: &[u8]) {
    let deadline = Instant::now() + Duration::from_secs(20);
    while s3_get(bucket, key).as_deref() != Some(want) {
        assert!(
            Instant::now() < deadline,
            "{key} never became {:?} in S3",
            String::from_utf8_lossy(want)
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn write_back_keeps_edits_on_local_disk_until_their_upload() {
    let bucket = new_bucket("edit-wb");
    let cache = scratch_dir("edit-wb-cache");
    // A delay no test waits out: what is in S3 before the unmount was put there by
    // something else than the timer (rename, the end of the mount).
    let mut m = Mount::start(
        &bucket,
        &["--write-back", "1h", "--cache-dir", cache.to_str().unwrap()],
    );
    put(&bucket, "f", b"committed".to_vec());
    put(&bucket, "moved", b"original".to_vec());
    let f = fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(m.path("f"))
        .unwrap();
    f.write_all_at(b"EDIT", 2).unwrap();
    f.sync_all().unwrap();
    assert_eq!(
        s3_get(&bucket, "f").unwrap(),
        b"committed",
        "fsync is local"
    );
    assert_eq!(
        fs::read(m.path("f")).unwrap(),
        b"coEDITted",
        "other descriptors see it"
    );
    close_checked(f).unwrap();
    assert_eq!(s3_get(&bucket, "f").unwrap(), b"committed", "so is close");
    assert_eq!(
        fs::read(m.path("f")).unwrap(),
        b"coEDITted",
        "a later open sees it"
    );
    assert_eq!(fs::metadata(m.path("f")).unwrap().len(), 9);
    // Appends and a new file, closed: kept too.
    fs::OpenOptions::new()
        .append(true)
        .open(m.path("f"))
        .unwrap()
        .write_all(b"+more")
        .unwrap();
    let mut g = read_write_new(&m.path("new"));
    g.write_all(b"fresh").unwrap();
    g.seek(SeekFrom::Start(0)).unwrap();
    let mut back = String::new();
    g.read_to_string(&mut back).unwrap();
    assert_eq!(back, "fresh");
    close_checked(g).unwrap();
    assert!(s3_get(&bucket, "new").is_none());
    // A kept file that is removed is never uploaded.
    let mut gone = read_write_new(&m.path("gone"));
    gone.write_all(b"x").unwrap();
    gone.seek(SeekFrom::Start(0)).unwrap();
    gone.read_exact(&mut [0u8; 1]).unwrap();
    drop(gone);
    fs::remove_file(m.path("gone")).unwrap();
    // rename needs the object in S3: the kept edit is uploaded first.
    fs::OpenOptions::new()
        .write(true)
        .open(m.path("moved"))
        .unwrap()
        .write_all_at(b"O", 0)
        .unwrap();
    fs::rename(m.path("moved"), m.path("moved2")).unwrap();
    assert_eq!(s3_get(&bucket, "moved2").unwrap(), b"Original");
    assert!(s3_get(&bucket, "moved").is_none());
    // SQLite at local speed; the unmount uploads what is still kept.
    let db = m.path("db.sqlite");
    run(Command::new("python3").args(["-c", &sqlite_inserts(&db, 100)]));
    m.stop();
    assert_eq!(s3_get(&bucket, "f").unwrap(), b"coEDITted+more");
    assert_eq!(s3_get(&bucket, "new").unwrap(), b"fresh");
    assert!(s3_get(&bucket, "gone").is_none());
    assert!(s3_get(&bucket, "db.sqlite-journal").is_none());
    let m = Mount::start(&bucket, &[]);
    let db = m.path("db.sqlite");
    let check = format!(
        "import sqlite3\n\
         c = sqlite3.connect({db:?})\n\
         print(c.execute('select count(*) from t').fetchone()[0], c.execute('pragma integrity_check').fetchone()[0])\n"
    );
    assert_eq!(
        run(Command::new("python3").args(["-c", &check])).trim(),
        "2000 ok"
    );
    drop(m);
    // With no delay, the upload follows the last close by itself.
    let m = Mount::start(
        &bucket,
        &["--write-back", "0s", "--cache-dir", cache.to_str().unwrap()],
    );
    fs::OpenOptions::new()
        .write(true)
        .open(m.path("f"))
        .unwrap()
        .write_all_at(b"ED", 0)
        .unwrap();
    wait_for_s3(&bucket, "f", b"EDEDITted+more");
}

#[test]
fn write_back_edits_a_crashed_mount_kept_are_uploaded_by_the_next_one() {
    let bucket = new_bucket("edit-wb-crash");
    let cache = scratch_dir("edit-wb-crash-cache");
    let args = ["--write-back", "1h", "--cache-dir", cache.to_str().unwrap()];
    put(&bucket, "saved", b"committed".to_vec());
    put(&bucket, "theirs", b"original".to_vec());
    let mut m = Mount::start(&bucket, &args);
    let mut open = Vec::new();
    for (key, edit) in [("saved", b"SAVED"), ("theirs", b"MINE!")] {
        let f = fs::OpenOptions::new()
            .write(true)
            .open(m.path(key))
            .unwrap();
        f.write_all_at(edit, 2).unwrap();
        f.sync_all().unwrap();
        open.push(f);
    }
    let pid = m.child.as_ref().unwrap().id();
    unsafe { libc::kill(pid as i32, libc::SIGKILL) };
    let _ = m.child.take().map(|mut c| c.wait());
    drop(open);
    m.stop();
    assert_eq!(s3_get(&bucket, "saved").unwrap(), b"committed");
    // Another client replaces one of them meanwhile: that edit must not overwrite it.
    put(&bucket, "theirs", b"replaced by another client".to_vec());
    let m = Mount::start(&bucket, &args);
    assert_eq!(s3_get(&bucket, "saved").unwrap(), b"coSAVEDed");
    assert_eq!(fs::read(m.path("saved")).unwrap(), b"coSAVEDed");
    assert_eq!(
        s3_get(&bucket, "theirs").unwrap(),
        b"replaced by another client"
    );
    let kept = lost_found_edits(&cache);
    assert_eq!(kept.len(), 1, "{kept:?}");
    assert_eq!(fs::read(&kept[0]).unwrap(), b"orMINE!l");
}

fn have(tool: &str) -> bool {
    Command::new("sh")
        .args(["-c", &format!("command -v {tool}")])
        .output()
        .is_ok_and(|o| o.status.success())
}

fn run(cmd: &mut Command) -> String {
    let out = cmd.output().unwrap();
    assert!(
        out.status.success(),
        "{cmd:?}: {}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

#[test]
fn sqlite_git_and_tar_work_on_the_mount() {
    let bucket = new_bucket("edit-programs");
    let m = Mount::start(&bucket, &[]);
    // SQLite: create, 10 000 rows in 20 transactions, reopen, integrity_check.
    let db = m.path("db.sqlite");
    let script = format!(
        "{}c = sqlite3.connect({db:?})\n\
         print(c.execute('select count(*), max(v) from t').fetchone(), c.execute('pragma integrity_check').fetchone()[0])\n",
        sqlite_inserts(&db, 500)
    );
    let start = Instant::now();
    let out = run(Command::new("python3").args(["-c", &script]));
    eprintln!(
        "sqlite: 10 000 rows in 20 transactions in {:?}",
        start.elapsed()
    );
    assert_eq!(out.trim(), "(10000, 'row 9999') ok");

    // tar x of an archive, then tar's own comparison of contents.
    let src = scratch_dir("edit-programs-src");
    let mut rng = Rng::from_env("edit-programs", 3);
    for i in 0..40 {
        let d = src.join(format!("d{}", i % 4));
        fs::create_dir_all(&d).unwrap();
        fs::write(d.join(format!("f{i}")), {
            let n = rng.below(300_000) as usize;
            rng.bytes(n)
        })
        .unwrap();
    }
    let archive = src.with_extension("tar");
    run(Command::new("tar")
        .arg("cf")
        .arg(&archive)
        .arg("-C")
        .arg(&src)
        .arg("."));
    fs::create_dir(m.path("untar")).unwrap();
    run(Command::new("tar")
        .arg("xf")
        .arg(&archive)
        .arg("-C")
        .arg(m.path("untar")));
    let diff = Command::new("tar")
        .arg("df")
        .arg(&archive)
        .current_dir(m.path("untar"))
        .output()
        .unwrap();
    let report = String::from_utf8_lossy(&diff.stdout);
    let content_diffs: Vec<&str> = report
        .lines()
        .filter(|l| l.contains("Contents differ") || l.contains("Size differs"))
        .collect();
    assert!(content_diffs.is_empty(), "{content_diffs:?}");

    if !have("git") {
        eprintln!("git not installed: the git part is skipped");
        return;
    }
    let repo = scratch_dir("edit-programs-repo");
    let git = |dir: &std::path::Path, args: &[&str]| {
        run(Command::new("git")
            .args(["-c", "user.email=t@example.com", "-c", "user.name=t"])
            .args(args)
            .current_dir(dir))
    };
    git(&repo, &["init", "-q"]);
    fs::write(repo.join("a.txt"), "one\n").unwrap();
    git(&repo, &["add", "a.txt"]);
    git(&repo, &["commit", "-qm", "first"]);
    git(&m.dir, &["clone", "-q", repo.to_str().unwrap(), "clone"]);
    let clone = m.path("clone");
    fs::write(clone.join("a.txt"), "one\ntwo\n").unwrap();
    git(&clone, &["commit", "-qam", "second"]);
    let log = git(&clone, &["log", "--oneline"]);
    assert_eq!(log.lines().count(), 2, "{log}");
    git(&clone, &["fsck", "--strict"]);
    assert_eq!(git(&clone, &["status", "--porcelain"]).trim(), "");
}
