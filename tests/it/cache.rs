//! The data cache (`--cache-dir`, `--data-cache`) through real mounts on moto, with the
//! GETs counted by a proxy: a second read needs none, also after a remount; an object
//! replaced in S3 is read anew once the metadata TTL has passed; the cache stays within
//! its size; a mounter killed while writing the cache leaves nothing wrong to serve; a
//! cache directory that cannot be used leaves a working mount.

use crate::common;

use common::fault_proxy::FaultProxy;
use common::*;
use s3csi::s3::ObjectClient;
use std::fs;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

const MIB: usize = 1024 * 1024;

/// A proxy to moto that counts GetObject requests (not listings) and their bytes asked.
fn counting_gets() -> (Arc<FaultProxy>, Arc<AtomicU64>) {
    let proxy = FaultProxy::start(&s3().endpoint, 1);
    let gets = Arc::new(AtomicU64::new(0));
    let g = gets.clone();
    proxy.set_hook(move |req, _headers, _body| {
        // `/bucket/key`: a GET with a key is GetObject; `/bucket` or `/bucket/` lists.
        let has_key = req
            .path
            .trim_start_matches('/')
            .split_once('/')
            .is_some_and(|(_, key)| !key.is_empty());
        if req.method == "GET" && has_key {
            g.fetch_add(1, Ordering::SeqCst);
        }
        None
    });
    (proxy, gets)
}

fn put(bucket: &str, key: &str, body: &[u8]) {
    runtime()
        .block_on(client(bucket).put_object(key, body.to_vec().into()))
        .unwrap();
}

/// Bytes of cached blocks under `cache/data`.
fn cached_bytes(cache: &Path) -> u64 {
    use std::os::unix::fs::MetadataExt;
    fs::read_dir(cache.join("data"))
        .map(|d| {
            d.flatten()
                .filter(|e| e.path().extension().is_some_and(|x| x == "blocks"))
                .map(|e| e.metadata().map(|m| m.blocks() * 512).unwrap_or(0))
                .sum()
        })
        .unwrap_or(0)
}

/// Waits until the cache holds at least `want` bytes. Its writer runs in the background
/// on idle CPU only and drops what it cannot keep up with, so `reread` reads the files
/// again now and then: a read offers the blocks still missing.
fn wait_cached_after(cache: &Path, want: u64, reread: &dyn Fn()) {
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut n = 0;
    while cached_bytes(cache) < want {
        assert!(
            Instant::now() < deadline,
            "the cache never held {want} bytes"
        );
        std::thread::sleep(Duration::from_millis(20));
        n += 1;
        if n % 25 == 0 {
            reread();
        }
    }
}

fn wait_cached(cache: &Path, want: u64) {
    wait_cached_after(cache, want, &|| {});
}

#[test]
fn a_second_read_needs_no_get_also_after_a_remount() {
    let bucket = new_bucket("cache-reread");
    let mut rng = Rng::from_env("cache-reread", 1);
    let big = rng.bytes(40 * MIB + 12345);
    let small = rng.bytes(3000);
    put(&bucket, "big", &big);
    put(&bucket, "dir/small", &small);
    let cache = scratch_dir("cache-reread");
    let (proxy, gets) = counting_gets();
    let args = ["--cache-dir", cache.to_str().unwrap()];
    let mut m = Mount::try_start_with(&proxy.endpoint(), &bucket, &args, &[]).unwrap();
    assert!(fs::read(m.path("big")).unwrap() == big);
    assert_eq!(fs::read(m.path("dir/small")).unwrap(), small);
    assert!(gets.load(Ordering::SeqCst) >= 2, "GETs for the first reads");
    wait_cached_after(&cache, (big.len() + small.len()) as u64, &|| {
        let _ = fs::read(m.path("big"));
        let _ = fs::read(m.path("dir/small"));
    });
    let first = gets.load(Ordering::SeqCst);
    // A second read, whole and in random pieces: no GET.
    assert!(fs::read(m.path("big")).unwrap() == big);
    {
        use std::os::unix::fs::FileExt;
        let f = fs::File::open(m.path("big")).unwrap();
        for at in [5 * MIB as u64 + 17, 0, 40 * MIB as u64] {
            let mut buf = vec![0u8; 70_000];
            let n = f.read_at(&mut buf, at).unwrap();
            let s = at as usize;
            assert!(buf[..n] == big[s..(s + 70_000).min(big.len())], "at {at}");
        }
    }
    assert_eq!(gets.load(Ordering::SeqCst), first, "cache hits sent GETs");
    // A new mounter on the same cache directory serves from it too.
    m.stop();
    let m = Mount::try_start_with(&proxy.endpoint(), &bucket, &args, &[]).unwrap();
    assert!(fs::read(m.path("big")).unwrap() == big);
    assert_eq!(fs::read(m.path("dir/small")).unwrap(), small);
    assert_eq!(
        gets.load(Ordering::SeqCst),
        first,
        "the remounted cache sent GETs: {}",
        m.log_text()
    );
}

#[test]
fn an_object_replaced_in_s3_is_read_anew_after_the_metadata_ttl() {
    let bucket = new_bucket("cache-replaced");
    put(&bucket, "f", b"old version");
    let cache = scratch_dir("cache-replaced");
    let m = Mount::start(
        &bucket,
        &[
            "--cache-dir",
            cache.to_str().unwrap(),
            "--metadata-ttl",
            "1s",
        ],
    );
    assert_eq!(fs::read(m.path("f")).unwrap(), b"old version");
    wait_cached(&cache, 1);
    // Same size, other bytes: only the ETag tells them apart.
    put(&bucket, "f", b"NEW VERSION");
    std::thread::sleep(Duration::from_millis(1200));
    assert_eq!(fs::read(m.path("f")).unwrap(), b"NEW VERSION");
    // Another size.
    put(&bucket, "f", b"the newest version");
    std::thread::sleep(Duration::from_millis(1200));
    assert_eq!(fs::read(m.path("f")).unwrap(), b"the newest version");
}

#[test]
fn the_cache_stays_within_its_size_with_many_files() {
    let bucket = new_bucket("cache-evict");
    let mut rng = Rng::from_env("cache-evict", 3);
    let files: Vec<Vec<u8>> = (0..24).map(|_| rng.bytes(MIB + 100)).collect();
    for (i, f) in files.iter().enumerate() {
        put(&bucket, &format!("f{i}"), f);
    }
    let cache = scratch_dir("cache-evict");
    let m = Mount::start(
        &bucket,
        &[
            "--cache-dir",
            cache.to_str().unwrap(),
            "--cache-size",
            "10MiB",
        ],
    );
    for round in 0..2 {
        for (i, want) in files.iter().enumerate() {
            let got = fs::read(m.path(&format!("f{i}"))).unwrap();
            assert!(got == *want, "f{i} in round {round}");
            assert!(
                cached_bytes(&cache) <= 10 * MIB as u64 + 64 * 1024,
                "the cache grew to {} bytes",
                cached_bytes(&cache)
            );
        }
    }
    wait_cached(&cache, 5 * MIB as u64);
}

#[test]
fn a_mounter_killed_while_caching_leaves_only_correct_blocks() {
    let bucket = new_bucket("cache-kill");
    let mut rng = Rng::from_env("cache-kill", 4);
    let files: Vec<Vec<u8>> = (0..6).map(|_| rng.bytes(9 * MIB + 777)).collect();
    for (i, f) in files.iter().enumerate() {
        put(&bucket, &format!("f{i}"), f);
    }
    let cache = scratch_dir("cache-kill");
    let args = ["--cache-dir", cache.to_str().unwrap()];
    let mut m = Mount::start(&bucket, &args);
    for (i, want) in files.iter().enumerate() {
        assert!(fs::read(m.path(&format!("f{i}"))).unwrap() == *want);
    }
    // Killed while its writer thread is still catching up.
    let pid = m.child.as_ref().unwrap().id();
    unsafe { libc::kill(pid as i32, libc::SIGKILL) };
    let _ = m.child.take().map(|mut c| c.wait());
    m.stop();
    // A cached block damaged on disk is found out, not served.
    let data = fs::read_dir(cache.join("data"))
        .unwrap()
        .flatten()
        .map(|e| e.path())
        .find(|p| p.extension().is_some_and(|x| x == "blocks"))
        .expect("something was cached before the kill");
    {
        use std::os::unix::fs::FileExt;
        let f = fs::OpenOptions::new().write(true).open(&data).unwrap();
        f.write_all_at(b"damage", 100).unwrap();
    }
    let m = Mount::start(&bucket, &args);
    for round in 0..2 {
        for (i, want) in files.iter().enumerate() {
            let got = fs::read(m.path(&format!("f{i}"))).unwrap();
            assert!(got == *want, "f{i} differs after the kill (round {round})");
        }
    }
    assert!(
        m.log_text().contains("does not match its checksum"),
        "{}",
        m.log_text()
    );
}

#[test]
fn a_cache_directory_that_cannot_be_used_leaves_a_working_mount() {
    let bucket = new_bucket("cache-bad-dir");
    put(&bucket, "f", b"from S3");
    let cache = scratch_dir("cache-bad-dir");
    let args = ["--cache-dir", cache.to_str().unwrap()];
    let _first = Mount::start(&bucket, &args);
    // A second mounter on the same directory (its lock is held): no data cache, a log line.
    let other = Mount::start(&bucket, &args);
    assert_eq!(fs::read(other.path("f")).unwrap(), b"from S3");
    assert!(other.log_text().contains("running without the data cache"));
    // A cache directory that cannot be created is a clear error at mount.
    let err = Mount::try_start(&bucket, &["--cache-dir", "/proc/no-such/cache"])
        .err()
        .expect("mount must fail");
    assert!(err.contains("cache directory"), "{err}");
}

/// Reads all of `f` on another thread with the mounter stopped: only a passthrough
/// descriptor (the kernel reads the cache file by itself) can answer. The mounter is
/// continued in any case, so a failing test does not leave a hung mount.
fn read_with_mounter_stopped(pid: u32, mut f: fs::File) -> Option<Vec<u8>> {
    use std::io::Read;
    unsafe { libc::kill(pid as i32, libc::SIGSTOP) };
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        // Plain reads: `read_to_end` would fstat first, and attributes are the mounter's.
        let mut out = Vec::new();
        let mut buf = vec![0u8; 256 * 1024];
        let r = loop {
            match f.read(&mut buf) {
                Ok(0) => break Ok(out),
                Ok(n) => out.extend_from_slice(&buf[..n]),
                Err(e) => break Err(e),
            }
        };
        let _ = tx.send(r);
    });
    let got = rx.recv_timeout(Duration::from_secs(5));
    unsafe { libc::kill(pid as i32, libc::SIGCONT) };
    match got {
        Ok(r) => Some(r.unwrap()),
        Err(_) => None,
    }
}

/// Reads `f` once so that all of it is cached, then waits until the reads' handles are
/// released (the kernel releases asynchronously): only then may an open pass through.
fn cache_wholly(m: &Mount, cache: &Path, name: &str, bytes: u64) {
    let _ = fs::read(m.path(name));
    wait_cached_after(cache, bytes, &|| {
        let _ = fs::read(m.path(name));
    });
    std::thread::sleep(Duration::from_millis(300));
}

#[test]
fn wholly_cached_files_are_read_by_the_kernel_itself() {
    let bucket = new_bucket("cache-passthrough");
    let mut rng = Rng::from_env("cache-passthrough", 5);
    let v1 = rng.bytes(3 * MIB + 4321);
    let v2 = rng.bytes(3 * MIB + 4321);
    put(&bucket, "f", &v1);
    let cache = scratch_dir("cache-passthrough");
    let dir = cache.to_str().unwrap();
    let ro = ["--cache-dir", dir, "--metadata-ttl", "1s", "--read-only"];
    let m = Mount::start(&bucket, &ro);
    let pid = m.child.as_ref().unwrap().id();
    cache_wholly(&m, &cache, "f", v1.len() as u64);
    // Opened once the version is wholly cached: its reads never reach the mounter.
    let old = fs::File::open(m.path("f")).unwrap();
    let again = fs::File::open(m.path("f")).unwrap();
    let got = read_with_mounter_stopped(pid, again)
        .unwrap_or_else(|| panic!("the read waited for the mounter: {}", m.log_text()));
    assert!(got == v1, "passthrough read other bytes");
    // Replaced in S3 while `old` is open: opens meanwhile share its backing file (the
    // kernel's rule), so they read the version it holds, whole.
    put(&bucket, "f", &v2);
    std::thread::sleep(Duration::from_millis(1200));
    assert!(
        fs::read(m.path("f")).unwrap() == v1,
        "a pinned open read other bytes"
    );
    let got = read_with_mounter_stopped(pid, old).expect("the old descriptor lost passthrough");
    assert!(got == v1, "an open descriptor changed version");
    // Once the last of them is closed, the next open reads the new version.
    std::thread::sleep(Duration::from_millis(300));
    assert!(
        fs::read(m.path("f")).unwrap() == v2,
        "the old version outlived its opens"
    );
    cache_wholly(&m, &cache, "f", (v1.len() + v2.len()) as u64);
    let f = fs::File::open(m.path("f")).unwrap();
    let got = read_with_mounter_stopped(pid, f).expect("the new version was not passed through");
    assert!(got == v2);
    // mmap of such a file reads the cache file too.
    let f = fs::File::open(m.path("f")).unwrap();
    let len = v2.len();
    let map = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_READ,
            libc::MAP_SHARED,
            std::os::fd::AsRawFd::as_raw_fd(&f),
            0,
        )
    };
    assert_ne!(map, libc::MAP_FAILED, "{}", std::io::Error::last_os_error());
    let mapped = unsafe { std::slice::from_raw_parts(map as *const u8, len) }.to_vec();
    unsafe { libc::munmap(map, len) };
    assert!(mapped == v2, "mmap of a passthrough file");
    drop(f);
    drop(m);

    // --passthrough off: the same reads go through the mounter, from the cache.
    let m = Mount::start(
        &bucket,
        &["--cache-dir", dir, "--read-only", "--passthrough", "off"],
    );
    let pid = m.child.as_ref().unwrap().id();
    let f = fs::File::open(m.path("f")).unwrap();
    assert!(
        read_with_mounter_stopped(pid, f).is_none(),
        "off passed through"
    );
    assert!(fs::read(m.path("f")).unwrap() == v2);
    drop(m);

    // A writable mount passes through only with --passthrough always, and an open for
    // writing of a file read that way is refused (ETXTBSY) until its last reader closes.
    let m = Mount::start(&bucket, &["--cache-dir", dir]);
    let pid = m.child.as_ref().unwrap().id();
    let f = fs::File::open(m.path("f")).unwrap();
    assert!(
        read_with_mounter_stopped(pid, f).is_none(),
        "a writable mount passed through"
    );
    drop(m);
    let m = Mount::start(&bucket, &["--cache-dir", dir, "--passthrough", "always"]);
    let pid = m.child.as_ref().unwrap().id();
    let reader = fs::File::open(m.path("f")).unwrap();
    let err = fs::OpenOptions::new()
        .write(true)
        .open(m.path("f"))
        .expect_err("a writer opened a file read in passthrough");
    assert_eq!(err.raw_os_error(), Some(libc::ETXTBSY), "{err}");
    let got = read_with_mounter_stopped(pid, reader).expect("always did not pass through");
    assert!(got == v2);
    std::thread::sleep(Duration::from_millis(300));
    fs::write(m.path("f"), b"written after the readers").unwrap();
    assert_eq!(fs::read(m.path("f")).unwrap(), b"written after the readers");
}

#[test]
fn files_written_through_the_mount_are_read_back_without_a_get() {
    use std::io::{Seek, SeekFrom, Write};
    let bucket = new_bucket("cache-written");
    let mut rng = Rng::from_env("cache-written", 6);
    let small = rng.bytes(3000);
    let large = rng.bytes(12 * MIB + 555);
    let cache = scratch_dir("cache-written");
    let (proxy, gets) = counting_gets();
    let args = ["--cache-dir", cache.to_str().unwrap()];
    let m = Mount::try_start_with(&proxy.endpoint(), &bucket, &args, &[]).unwrap();
    fs::write(m.path("small"), &small).unwrap();
    fs::write(m.path("large"), &large).unwrap();
    // An edit in place of a small file: its staged copy holds all of it.
    let mut edited = small.clone();
    edited[1000..1004].copy_from_slice(b"EDIT");
    {
        let mut f = fs::OpenOptions::new()
            .write(true)
            .open(m.path("small"))
            .unwrap();
        f.seek(SeekFrom::Start(1000)).unwrap();
        f.write_all(b"EDIT").unwrap();
    }
    let first = gets.load(Ordering::SeqCst);
    wait_cached(&cache, (large.len() + 2 * small.len()) as u64);
    assert!(fs::read(m.path("large")).unwrap() == large);
    assert_eq!(fs::read(m.path("small")).unwrap(), edited);
    assert_eq!(
        gets.load(Ordering::SeqCst),
        first,
        "reading back what was written sent GETs"
    );
    // What S3 has is what was written: the cache did not stand in for it.
    let rt = runtime();
    let c = client(&bucket);
    let whole = |k: &str, n: usize| rt.block_on(c.get_range(k, 0, n as u64)).unwrap();
    assert!(whole("large", large.len()) == large);
    assert_eq!(whole("small", small.len()), edited);
}
