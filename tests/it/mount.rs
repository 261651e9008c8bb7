//! `s3csi mount` for real: a FUSE mount of a bucket on the local moto S3 server, driven
//! through ordinary file-system calls, with results checked through the S3 API too.

use crate::common;

use common::*;
use s3csi::s3::ObjectClient;
use std::fs;
use std::io::{Read, Seek, SeekFrom, Write};
use std::os::unix::fs::OpenOptionsExt;
use std::process::Command;
use std::time::{Duration, Instant};

fn put(bucket: &str, key: &str, body: &[u8]) {
    let c = client(bucket);
    runtime()
        .block_on(c.put_object(key, bytes::Bytes::copy_from_slice(body)))
        .unwrap();
}

fn errno_of(e: std::io::Error) -> i32 {
    e.raw_os_error().unwrap_or(-1)
}

#[test]
fn files_and_directories_round_trip() {
    let bucket = new_bucket("basic");
    let mut m = Mount::start(&bucket, &[]);
    fs::write(m.path("hello.txt"), b"hello world").unwrap();
    assert_eq!(fs::read(m.path("hello.txt")).unwrap(), b"hello world");
    assert_eq!(s3_get(&bucket, "hello.txt").unwrap(), b"hello world");

    fs::create_dir(m.path("dir")).unwrap();
    assert!(
        s3_keys(&bucket, "").contains(&"dir/".to_string()),
        "mkdir writes a marker"
    );
    fs::write(m.path("dir/inner"), b"x").unwrap();
    assert_eq!(
        errno_of(fs::remove_dir(m.path("dir")).unwrap_err()),
        libc::ENOTEMPTY
    );
    fs::rename(m.path("dir/inner"), m.path("moved")).unwrap();
    assert_eq!(s3_get(&bucket, "moved").unwrap(), b"x");
    assert!(s3_get(&bucket, "dir/inner").is_none());
    fs::remove_dir(m.path("dir")).unwrap();
    assert!(!m.path("dir").exists());

    let mut names: Vec<String> = fs::read_dir(&m.dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    names.sort();
    assert_eq!(names, ["hello.txt", "moved"]);
    assert_eq!(fs::metadata(m.path("hello.txt")).unwrap().len(), 11);

    fs::remove_file(m.path("hello.txt")).unwrap();
    assert!(!m.path("hello.txt").exists());
    assert_eq!(
        errno_of(fs::remove_file(m.path("nope")).unwrap_err()),
        libc::ENOENT
    );
    // rename onto an existing file replaces it
    fs::write(m.path("a"), b"aaa").unwrap();
    fs::rename(m.path("moved"), m.path("a")).unwrap();
    assert_eq!(fs::read(m.path("a")).unwrap(), b"x");
    // Deletes after the first are sent in the background; unmount waits for them.
    m.stop();
    assert_eq!(s3_keys(&bucket, ""), ["a"]);
}

#[test]
fn empty_directories_persist_across_mounts() {
    let bucket = new_bucket("emptydir");
    {
        let m = Mount::start(&bucket, &[]);
        fs::create_dir_all(m.path("a/b/c")).unwrap();
        fs::File::create(m.path("a/empty-file")).unwrap();
    }
    let m = Mount::start(&bucket, &[]);
    assert!(m.path("a/b/c").is_dir());
    assert_eq!(fs::metadata(m.path("a/empty-file")).unwrap().len(), 0);
}

#[test]
fn implicit_directories_markers_and_prefix_mounts() {
    let bucket = new_bucket("implicit");
    put(&bucket, "x/y/z.txt", b"deep");
    put(&bucket, "marker/", b"");
    put(&bucket, "top", b"t");
    let m = Mount::start(&bucket, &[]);
    assert!(m.path("x").is_dir() && m.path("x/y").is_dir());
    assert_eq!(fs::read(m.path("x/y/z.txt")).unwrap(), b"deep");
    assert!(m.path("marker").is_dir());
    assert_eq!(fs::read_dir(m.path("marker")).unwrap().count(), 0);
    drop(m);

    let m = Mount::start(&format!("{bucket}:x"), &[]);
    assert_eq!(fs::read(m.path("y/z.txt")).unwrap(), b"deep");
    fs::write(m.path("new"), b"n").unwrap();
    assert_eq!(s3_get(&bucket, "x/new").unwrap(), b"n");
    assert!(!m.path("top").exists());
}

#[test]
fn ten_thousand_keys_list_completely() {
    let bucket = new_bucket("many");
    let c = std::sync::Arc::new(client(&bucket));
    runtime().block_on(async {
        let sem = std::sync::Arc::new(tokio::sync::Semaphore::new(32));
        let mut tasks = Vec::new();
        for i in 0..10_000 {
            let c = c.clone();
            let permit = sem.clone().acquire_owned().await.unwrap();
            tasks.push(tokio::spawn(async move {
                c.put_object(&format!("big/f{i:05}"), bytes::Bytes::from_static(b"."))
                    .await
                    .unwrap();
                drop(permit);
            }));
        }
        for t in tasks {
            t.await.unwrap();
        }
    });
    let m = Mount::start(&bucket, &[]);
    let mut names: Vec<String> = fs::read_dir(m.path("big"))
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    names.sort();
    names.dedup();
    assert_eq!(names.len(), 10_000);
    assert_eq!(names[0], "f00000");
    assert_eq!(names[9_999], "f09999");
    assert_eq!(fs::metadata(m.path("big/f04321")).unwrap().len(), 1);
}

/// Deterministic pseudo-random bytes so the test needs no big fixture.
fn pattern(offset: u64, buf: &mut [u8]) {
    for (i, b) in buf.iter_mut().enumerate() {
        let x = (offset + i as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15);
        *b = (x >> 56) as u8 ^ (x >> 17) as u8;
    }
}

fn fnv(h: &mut u64, data: &[u8]) {
    for b in data {
        *h = (*h ^ *b as u64).wrapping_mul(0x100_0000_01b3);
    }
}

#[test]
fn large_file_streams_through_multipart_and_reads_back() {
    const SIZE: u64 = 256 * 1024 * 1024;
    let bucket = new_bucket("large");
    let m = Mount::start(&bucket, &[]);
    let mut written_hash = 0xcbf2_9ce4_8422_2325u64;
    {
        let mut f = fs::File::create(m.path("big.bin")).unwrap();
        let mut buf = vec![0u8; 1024 * 1024];
        let mut off = 0;
        while off < SIZE {
            pattern(off, &mut buf);
            fnv(&mut written_hash, &buf);
            f.write_all(&buf).unwrap();
            off += buf.len() as u64;
        }
        f.sync_all().unwrap();
    }
    assert_eq!(fs::metadata(m.path("big.bin")).unwrap().len(), SIZE);
    // Read back through the mount.
    let mut read_hash = 0xcbf2_9ce4_8422_2325u64;
    let mut f = fs::File::open(m.path("big.bin")).unwrap();
    let mut buf = vec![0u8; 1024 * 1024];
    let mut total = 0;
    loop {
        let n = f.read(&mut buf).unwrap();
        if n == 0 {
            break;
        }
        fnv(&mut read_hash, &buf[..n]);
        total += n as u64;
    }
    assert_eq!(total, SIZE);
    assert_eq!(read_hash, written_hash, "bytes read back differ");
    // Random reads land on the right bytes.
    for off in [SIZE - 10, 12_345_678, 3, 200 * 1024 * 1024 + 17] {
        f.seek(SeekFrom::Start(off)).unwrap();
        let mut got = vec![0u8; 10];
        let n = f.read(&mut got).unwrap();
        let mut want = vec![0u8; n];
        pattern(off, &mut want);
        assert_eq!(&got[..n], &want[..]);
    }
    // And through the S3 API, in ranges.
    let c = client(&bucket);
    let meta = runtime().block_on(c.head_object("big.bin")).unwrap();
    assert_eq!(meta.size, SIZE);
    let mut s3_hash = 0xcbf2_9ce4_8422_2325u64;
    let mut off = 0;
    while off < SIZE {
        let end = (off + 32 * 1024 * 1024).min(SIZE);
        let chunk = runtime()
            .block_on(c.get_range("big.bin", off, end))
            .unwrap();
        fnv(&mut s3_hash, &chunk);
        off = end;
    }
    assert_eq!(s3_hash, written_hash, "bytes in S3 differ");
}

/// Direct I/O (the default) and `--page-cache` move the same bytes: small and odd-sized
/// writes, small and unaligned reads, MAP_SHARED and MAP_PRIVATE maps, and a program run
/// from the mount (exec maps it). Which path is in use shows in a read through a
/// descriptor that is writing: only the page cache can answer it.
#[test]
fn direct_io_and_page_cache_serve_the_same_bytes() {
    use std::os::unix::fs::FileExt;
    const SIZE: usize = 3 * 1024 * 1024 + 777;
    let mut want = vec![0u8; SIZE];
    pattern(5, &mut want);
    for extra in [&[][..], &["--page-cache"][..], &["-o", "page_cache"][..]] {
        let bucket = new_bucket("dataio");
        let mut args = vec!["--file-mode", "0755"];
        args.extend_from_slice(extra);
        let m = Mount::start(&bucket, &args);
        {
            let f = fs::OpenOptions::new()
                .read(true)
                .write(true)
                .create(true)
                .truncate(true)
                .open(m.path("rw.bin"))
                .unwrap();
            f.write_all_at(&want[..8192], 0).unwrap();
            // Reading through the writing descriptor: served from the staged copy
            // (or the page cache).
            let mut got = [0u8; 4096];
            assert_eq!(f.read_at(&mut got, 0).unwrap(), 4096, "{extra:?}");
            assert_eq!(&got[..], &want[..4096], "{extra:?}");
            close_checked(f).unwrap();
        }
        {
            let mut f = fs::File::create(m.path("f.bin")).unwrap();
            // 1 byte, then 4 KiB, then odd sizes: nothing is aligned to a page
            let mut off = 0;
            for len in [1usize, 4096, 65_537, 1_000_003].iter().cycle() {
                if off == SIZE {
                    break;
                }
                let end = (off + len).min(SIZE);
                f.write_all(&want[off..end]).unwrap();
                off = end;
            }
            close_checked(f).unwrap();
        }
        assert_eq!(
            s3_get(&bucket, "f.bin").as_deref(),
            Some(&want[..]),
            "{extra:?}"
        );
        let f = fs::File::open(m.path("f.bin")).unwrap();
        let mut small = Vec::new();
        let mut buf = [0u8; 4096];
        let mut r = fs::File::open(m.path("f.bin")).unwrap();
        loop {
            let n = r.read(&mut buf).unwrap();
            if n == 0 {
                break;
            }
            small.extend_from_slice(&buf[..n]);
        }
        assert!(small == want, "4 KiB reads differ ({extra:?})");
        for off in [0usize, 1, 4095, 1_048_577, SIZE - 3] {
            let mut got = [0u8; 10];
            let n = f.read_at(&mut got, off as u64).unwrap();
            assert_eq!(
                &got[..n],
                &want[off..(off + 10).min(SIZE)],
                "pread at {off} ({extra:?})"
            );
        }
        for flags in [libc::MAP_SHARED, libc::MAP_PRIVATE] {
            use std::os::fd::AsRawFd;
            // SAFETY: a fresh read-only mapping of an open file, unmapped before `f` closes.
            let mapped = unsafe {
                let p = libc::mmap(
                    std::ptr::null_mut(),
                    SIZE,
                    libc::PROT_READ,
                    flags,
                    f.as_raw_fd(),
                    0,
                );
                assert_ne!(
                    p,
                    libc::MAP_FAILED,
                    "mmap flags {flags} ({extra:?}): {}",
                    std::io::Error::last_os_error()
                );
                let same = std::slice::from_raw_parts(p as *const u8, SIZE) == &want[..];
                libc::munmap(p, SIZE);
                same
            };
            assert!(mapped, "mapped bytes differ, flags {flags} ({extra:?})");
        }
        fs::copy("/bin/echo", m.path("echo")).unwrap();
        let out = Command::new(m.path("echo"))
            .arg("ran from s3")
            .output()
            .unwrap();
        assert_eq!(
            String::from_utf8_lossy(&out.stdout),
            "ran from s3\n",
            "{extra:?}"
        );
    }
}

#[test]
fn overwrite_append_truncate_and_refused_modifications() {
    let bucket = new_bucket("semantics");
    let m = Mount::start(&bucket, &[]);
    let p = m.path("f");
    fs::write(&p, b"first version").unwrap();
    fs::write(&p, b"second").unwrap(); // O_TRUNC overwrite
    assert_eq!(s3_get(&bucket, "f").unwrap(), b"second");

    // Appending to an existing object continues it.
    let mut app = fs::OpenOptions::new().append(true).open(&p).unwrap();
    app.write_all(b" more").unwrap();
    close_checked(app).unwrap();
    assert_eq!(s3_get(&bucket, "f").unwrap(), b"second more");
    // Writing into its middle edits it in place, durable at close.
    let mut rw = fs::OpenOptions::new().write(true).open(&p).unwrap();
    rw.seek(SeekFrom::Start(2)).unwrap();
    rw.write_all(b"XX").unwrap();
    close_checked(rw).unwrap();
    assert_eq!(s3_get(&bucket, "f").unwrap(), b"seXXnd more");

    // truncate to any size: shrink, grow with zeros, then 0.
    let f = fs::OpenOptions::new().write(true).open(&p).unwrap();
    f.set_len(3).unwrap();
    close_checked(f).unwrap();
    assert_eq!(s3_get(&bucket, "f").unwrap(), b"seX");
    nix::unistd::truncate(&p, 5).unwrap();
    assert_eq!(s3_get(&bucket, "f").unwrap(), b"seX\0\0");
    let f = fs::OpenOptions::new().write(true).open(&p).unwrap();
    f.set_len(0).unwrap();
    close_checked(f).unwrap();
    assert_eq!(s3_get(&bucket, "f").unwrap(), b"");

    // Directory rename: every object under it moves on the server (as os.rename, git do).
    fs::create_dir_all(m.path("d/sub")).unwrap();
    fs::write(m.path("d/sub/x"), b"x").unwrap();
    fs::write(m.path("d/y"), b"y").unwrap();
    fs::rename(m.path("d"), m.path("e")).unwrap();
    assert_eq!(fs::read(m.path("e/sub/x")).unwrap(), b"x");
    assert!(!m.path("d").exists());
    assert_eq!(s3_get(&bucket, "e/y").unwrap(), b"y");
    assert_eq!(s3_get(&bucket, "e/sub/x").unwrap(), b"x");
    let until = std::time::Instant::now() + Duration::from_secs(10);
    while !s3_keys(&bucket, "d/").is_empty() {
        assert!(
            std::time::Instant::now() < until,
            "{:?}",
            s3_keys(&bucket, "d/")
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    // Onto a non-empty directory: ENOTEMPTY; into itself: EINVAL.
    fs::create_dir(m.path("full")).unwrap();
    fs::write(m.path("full/z"), b"z").unwrap();
    assert_eq!(
        errno_of(fs::rename(m.path("e"), m.path("full")).unwrap_err()),
        libc::ENOTEMPTY
    );
    assert_eq!(
        errno_of(fs::rename(m.path("e"), m.path("e/sub/inner")).unwrap_err()),
        libc::EINVAL
    );
    let out = Command::new("mv")
        .arg(m.path("e"))
        .arg(m.path("g"))
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(m.path("g/sub").is_dir() && !m.path("e").exists());

    // Symlinks work (tests/it/metadata.rs); hard links: EPERM.
    std::os::unix::fs::symlink("f", m.path("link")).unwrap();
    assert_eq!(fs::read_link(m.path("link")).unwrap().to_str(), Some("f"));
    fs::remove_file(m.path("link")).unwrap();
    assert_eq!(
        errno_of(fs::hard_link(&p, m.path("hard")).unwrap_err()),
        libc::EPERM
    );
    // An existing empty object may be written from the start without O_TRUNC.
    let mut w = fs::OpenOptions::new().write(true).open(&p).unwrap();
    w.write_all(b"refilled").unwrap();
    drop(w);
    assert_eq!(s3_get(&bucket, "f").unwrap(), b"refilled");
}

#[test]
fn changes_by_others_show_up_after_the_metadata_ttl() {
    let bucket = new_bucket("ttl");
    put(&bucket, "shared", b"v1");
    let m = Mount::start(&bucket, &["--metadata-ttl", "1s"]);
    assert_eq!(fs::read(m.path("shared")).unwrap(), b"v1");
    put(&bucket, "shared", b"version 2");
    put(&bucket, "added", b"new");
    std::thread::sleep(Duration::from_millis(1500));
    assert_eq!(fs::read(m.path("shared")).unwrap(), b"version 2");
    assert_eq!(fs::read(m.path("added")).unwrap(), b"new");
    let c = client(&bucket);
    runtime().block_on(c.delete_object("added")).unwrap();
    std::thread::sleep(Duration::from_millis(1500));
    assert!(!m.path("added").exists());
}

#[test]
fn statfs_and_df_answer() {
    let bucket = new_bucket("statfs");
    let m = Mount::start(&bucket, &[]);
    let st = nix::sys::statvfs::statvfs(&m.dir).unwrap();
    assert!(st.blocks() > 1 << 40);
    let out = Command::new("df").arg(&m.dir).output().unwrap();
    assert!(out.status.success());
    assert!(String::from_utf8_lossy(&out.stdout).contains(&format!("s3csi:{bucket}")));
}

#[test]
fn read_only_mount_refuses_writes() {
    let bucket = new_bucket("ro");
    put(&bucket, "a", b"a");
    let m = Mount::start(&bucket, &["--read-only"]);
    assert_eq!(fs::read(m.path("a")).unwrap(), b"a");
    assert_eq!(
        errno_of(fs::write(m.path("b"), b"b").unwrap_err()),
        libc::EROFS
    );
    assert_eq!(
        errno_of(fs::remove_file(m.path("a")).unwrap_err()),
        libc::EROFS
    );
}

fn mount_cmd(args: &[&str]) -> (bool, String, Duration) {
    set_test_env();
    let start = Instant::now();
    let out = Command::new(s3csi_bin())
        .arg("mount")
        .args(args)
        .output()
        .unwrap();
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stderr).to_string(),
        start.elapsed(),
    )
}

#[test]
fn bad_input_fails_fast_with_one_clear_line() {
    let ep = s3().endpoint.clone();
    let dir = scratch_dir("bad");
    let d = dir.to_str().unwrap();
    let base = ["--endpoint-url", ep.as_str(), "--force-path-style"];

    let (ok, err, _) = mount_cmd(&[&base[..], &["no-such-bucket-xyz", d]].concat());
    assert!(!ok);
    assert!(err.contains("does not exist"), "{err}");
    assert_eq!(err.trim().lines().count(), 1, "{err}");

    let (ok, err, _) = mount_cmd(&[&base[..], &["some-bucket", "/nonexistent/mnt"]].concat());
    assert!(!ok && err.contains("/nonexistent/mnt"), "{err}");

    let (ok, err, took) = mount_cmd(&["--endpoint-url", "http://127.0.0.1:1", "some-bucket", d]);
    assert!(!ok && err.contains("127.0.0.1:1"), "{err}");
    assert!(took < Duration::from_secs(40), "took {took:?}");

    let (ok, err, _) = mount_cmd(&[&base[..], &["-o", "bogus-option", "some-bucket", d]].concat());
    assert!(!ok && err.contains("bogus-option"), "{err}");

    let (ok, err, _) = mount_cmd(&[&base[..], &["Bad_Bucket!", d]].concat());
    assert!(!ok && err.contains("Bad_Bucket!"), "{err}");

    // Already mounted.
    let bucket = new_bucket("twice");
    let m = Mount::start(&bucket, &[]);
    let (ok, err, _) =
        mount_cmd(&[&base[..], &[bucket.as_str(), m.dir.to_str().unwrap()]].concat());
    assert!(!ok && err.contains("already mounted"), "{err}");
}

#[test]
fn wrong_credentials_are_reported() {
    // A second moto that checks signatures against the keys it knows (none).
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let mut moto = Command::new("moto_server")
        .args(["-H", "127.0.0.1", "-p", &port.to_string()])
        .env("INITIAL_NO_AUTH_ACTION_COUNT", "0")
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(30);
    while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
        assert!(Instant::now() < deadline);
        std::thread::sleep(Duration::from_millis(100));
    }
    let dir = scratch_dir("creds");
    let ep = format!("http://127.0.0.1:{port}");
    let (ok, err, _) = mount_cmd(&[
        "--endpoint-url",
        &ep,
        "--force-path-style",
        "any-bucket",
        dir.to_str().unwrap(),
    ]);
    let _ = moto.kill();
    let _ = moto.wait();
    assert!(!ok);
    assert!(err.contains("denied"), "{err}");
    assert!(!err.contains(SECRET_KEY), "secret leaked: {err}");
}

#[test]
fn detaches_only_once_mounted_and_unmounts_cleanly() {
    let bucket = new_bucket("detach");
    let dir = scratch_dir("detach");
    let ep = s3().endpoint.clone();
    let (ok, err, _) = mount_cmd(&[
        "--endpoint-url",
        &ep,
        "--force-path-style",
        &bucket,
        dir.to_str().unwrap(),
    ]);
    assert!(ok, "{err}");
    assert!(is_mountpoint(&dir), "mounted when the command returned");
    fs::write(dir.join("f"), b"detached").unwrap();
    assert!(Command::new("umount").arg(&dir).status().unwrap().success());
    assert_eq!(s3_get(&bucket, "f").unwrap(), b"detached");
}

#[test]
fn sigterm_completes_open_uploads_before_unmounting() {
    let bucket = new_bucket("sigterm");
    let mut m = Mount::start(&bucket, &[]);
    // A writer that keeps its file open: the data is only in the mount's buffers.
    let mut f = fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o644)
        .open(m.path("open-file"))
        .unwrap();
    f.write_all(&vec![7u8; 3 * 1024 * 1024]).unwrap();
    m.stop();
    drop(f);
    assert_eq!(s3_get(&bucket, "open-file").unwrap().len(), 3 * 1024 * 1024);
    assert!(
        m.log_text().contains("completing open uploads"),
        "{}",
        m.log_text()
    );
}

/// `sh -c script` in `dir`, which must succeed.
fn sh(dir: &std::path::Path, script: &str) {
    let out = Command::new("sh")
        .arg("-c")
        .arg(script)
        .current_dir(dir)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{script}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// What shells and build tools do with descriptors, with the mounter in a pid namespace
/// of its own (as the node plugin's container is, without hostPID): FUSE reports pid 0 for
/// every caller, so nothing may depend on process ids. Each close of a descriptor that
/// wrote makes what it wrote durable, and writes at the end of the object go on.
#[test]
fn shell_redirections_work_when_the_mounter_sees_no_pids() {
    for extra in [&[][..], &["--page-cache"][..]] {
        let bucket = new_bucket("shell");
        let m = Mount::start_in_own_pid_namespace(&bucket, extra);
        let d = &m.dir;
        let cases: &[(&str, &str, &[u8])] = &[
            // A compound command: the shell dups the file onto stdout and closes the
            // original, `true` (a child) closes its inherited copy at exit, echo writes.
            ("compound", "{ true; echo one; /bin/echo two; echo three; } > compound", b"one\ntwo\nthree\n"),
            ("exec", "exec 3>exec; echo a >&3; echo b >&3; exec 3>&-", b"a\nb\n"),
            (
                "inherited",
                "exec 4>inherited; echo parent >&4; sh -c 'echo child >&4'; echo after >&4; exec 4>&-",
                b"parent\nchild\nafter\n",
            ),
            ("tee", "echo x | tee -a tee >/dev/null; echo y | tee -a tee >/dev/null", b"x\ny\n"),
            ("append", "echo 1 > append; echo 2 >> append; echo 3 >> append", b"1\n2\n3\n"),
        ];
        for (key, script, want) in cases {
            sh(d, script);
            assert_eq!(
                fs::read(d.join(key)).unwrap(),
                *want,
                "{key} through the mount ({extra:?})"
            );
            assert_eq!(
                s3_get(&bucket, key).unwrap(),
                *want,
                "{key} in S3 ({extra:?})"
            );
        }
        // Appending to an object above S3's 5 MiB part minimum copies it on the server.
        sh(
            d,
            "head -c 6291456 /dev/zero | tr '\\0' 'z' > big && echo end >> big",
        );
        let big = s3_get(&bucket, "big").unwrap();
        assert_eq!(big.len(), 6 * 1024 * 1024 + 4, "{extra:?}");
        assert!(big[..6 * 1024 * 1024].iter().all(|&b| b == b'z'));
        assert_eq!(&big[6 * 1024 * 1024..], b"end\n");
        let log = m.log_text();
        assert!(!log.contains("refusing"), "{log}");
    }
}

/// `umount DIR` and at once `s3csi mount ... DIR` again: the old process, ending, must not
/// take the new mount down with it (fuser unmounted by path once more).
#[test]
fn a_remount_right_after_umount_stays_mounted() {
    let bucket = new_bucket("remount");
    let start = |dir: &std::path::Path| {
        let child = Command::new(s3csi_bin())
            .arg("mount")
            .arg("--foreground")
            .args(["--endpoint-url", &s3().endpoint, "--force-path-style"])
            .args(["--region", "us-east-1"])
            .arg(&bucket)
            .arg(dir)
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .unwrap();
        let deadline = Instant::now() + Duration::from_secs(30);
        while !is_mountpoint(dir) {
            assert!(Instant::now() < deadline, "not mounted within 30 s");
            std::thread::sleep(Duration::from_millis(20));
        }
        child
    };
    set_test_env();
    let dir = scratch_dir("remount");
    let mut first = start(&dir);
    nix::mount::umount(&dir).unwrap();
    let mut second = start(&dir);
    first.wait().unwrap();
    // The old process polled for its end every 200 ms; give it time to do harm.
    std::thread::sleep(Duration::from_millis(600));
    assert!(is_mountpoint(&dir), "the second mount was taken down");
    fs::write(dir.join("f"), b"still here").unwrap();
    assert_eq!(s3_get(&bucket, "f").as_deref(), Some(&b"still here"[..]));
    unsafe {
        libc::kill(second.id() as i32, libc::SIGTERM);
    }
    second.wait().unwrap();
    assert!(!is_mountpoint(&dir));
}
