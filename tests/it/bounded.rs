//! Bounded resources: the mounter's memory stays near `--max-prefetch-memory` with 100
//! files open for sequential read, and a 100 000-key directory lists completely while the
//! inode table stays capped and only one LIST page is held per open directory.
//!
//! `S3CSI_FULL=1` also lists 100 000 keys through a real mount (slow to create in moto).

use crate::common;

use common::*;
use s3csi::fs::{FsConfig, S3Fs};
use s3csi::s3::mem::MemClient;
use s3csi::s3::ObjectClient;
use std::io::Read;
use std::sync::Arc;
use std::time::{Duration, Instant};

const MIB: u64 = 1024 * 1024;

fn put_many(bucket: &str, keys: Vec<String>, body: bytes::Bytes) {
    let c = Arc::new(client(bucket));
    runtime().block_on(async {
        let sem = Arc::new(tokio::sync::Semaphore::new(32));
        let mut tasks = Vec::new();
        for k in keys {
            let (c, body) = (c.clone(), body.clone());
            let permit = sem.clone().acquire_owned().await.unwrap();
            tasks.push(tokio::spawn(async move {
                c.put_object(&k, body).await.unwrap();
                drop(permit);
            }));
        }
        for t in tasks {
            t.await.unwrap();
        }
    });
}

/// Ignored until the prefetcher honours its budget under many readers: measured VmHWM
/// growth is ~450-480 MiB with a 64 MiB budget (see the closing report of issue 6). Run
/// with `cargo test --release --test it -- bounded:: --ignored`.
#[test]

fn hundred_open_sequential_readers_stay_within_the_prefetch_budget() {
    const FILES: usize = 100;
    const SIZE: u64 = 6 * MIB;
    const BUDGET_MIB: u64 = 64;
    let bucket = new_bucket("rss");
    let body = bytes::Bytes::from(Rng::new(5).bytes(SIZE as usize));
    let start = Instant::now();
    put_many(
        &bucket,
        (0..FILES).map(|i| format!("r/{i:03}")).collect(),
        body.clone(),
    );
    let created = start.elapsed();
    let budget = format!("{BUDGET_MIB}MiB");
    let m = Mount::start(&bucket, &["--max-prefetch-memory", &budget]);
    let pid = m.child.as_ref().unwrap().id();
    assert_eq!(std::fs::read_dir(m.path("r")).unwrap().count(), FILES);
    let (base_hwm, _) = memory_kib(pid);
    let mut files: Vec<std::fs::File> = (0..FILES)
        .map(|i| std::fs::File::open(m.path(&format!("r/{i:03}"))).unwrap())
        .collect();
    // Round-robin sequential reads: every prefetcher is live and wants to grow its window.
    let start = Instant::now();
    let mut buf = vec![0u8; 256 * 1024];
    let mut offsets = vec![0usize; FILES];
    let mut total = 0u64;
    let mut peak_sampled = 0;
    let mut peak_fds = 0;
    loop {
        let mut progressed = false;
        for (i, f) in files.iter_mut().enumerate() {
            let n = f.read(&mut buf).unwrap();
            if n > 0 {
                assert!(
                    buf[..n] == body[offsets[i]..offsets[i] + n],
                    "file {i} at {}",
                    offsets[i]
                );
                offsets[i] += n;
                total += n as u64;
                progressed = true;
            }
        }
        peak_sampled = peak_sampled.max(memory_kib(pid).1);
        peak_fds = peak_fds.max(
            std::fs::read_dir(format!("/proc/{pid}/fd"))
                .map(|d| d.count())
                .unwrap_or(0),
        );
        if !progressed {
            break;
        }
    }
    let took = start.elapsed();
    drop(files);
    let (hwm, rss) = memory_kib(pid);
    assert_eq!(total, FILES as u64 * SIZE);
    let growth_mib = (hwm.saturating_sub(base_hwm)) / 1024;
    eprintln!(
        "100 readers: {} MiB read in {took:?} ({} MiB/s; setup {created:?}); mounter VmHWM \
         {} MiB (before reading {} MiB, growth {growth_mib} MiB; sampled RSS peak {} MiB, \
         now {} MiB); budget {BUDGET_MIB} MiB; peak open fds (S3 connections) {peak_fds}",
        total / MIB,
        total / MIB / took.as_secs().max(1),
        hwm / 1024,
        base_hwm / 1024,
        peak_sampled / 1024,
        rss / 1024
    );
    // The budget plus what reads in flight need beyond it (one demand chunk per file
    // being read at a time) plus allocator slack.
    let bound = BUDGET_MIB + 64;
    assert!(
        growth_mib <= bound,
        "memory grew {growth_mib} MiB with a {BUDGET_MIB} MiB prefetch budget"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hundred_thousand_keys_list_with_a_bounded_inode_table() {
    const KEYS: usize = 100_000;
    let mem = Arc::new(MemClient::new());
    for i in 0..KEYS {
        mem.insert(&format!("big/f{i:06}"), bytes::Bytes::new());
    }
    let fs = S3Fs::new(
        mem.clone(),
        FsConfig {
            metadata_ttl: Duration::from_secs(60),
            max_entries: 50_000,
            ..FsConfig::default()
        },
    );
    let start = Instant::now();
    let big = fs.lookup(1, "big").await.unwrap();
    let fh = fs.opendir(big.ino).await.unwrap();
    let mut offset = 0;
    let mut seen = 0usize;
    let mut last = String::new();
    let mut max_inodes = 0;
    let mut max_batch = 0;
    loop {
        let batch = fs.readdir(fh, offset, usize::MAX).await.unwrap();
        if batch.is_empty() {
            break;
        }
        max_batch = max_batch.max(batch.len());
        // Take a kernel buffer's worth at a time.
        for e in batch.iter().take(100) {
            if e.name != "." && e.name != ".." {
                assert!(e.name > last, "{} after {last}", e.name);
                last = e.name.clone();
                seen += 1;
            }
            offset = e.offset;
        }
        max_inodes = max_inodes.max(fs.inode_count());
    }
    fs.releasedir(fh);
    eprintln!(
        "100k keys: listed {seen} in {:?}; inode table peaked at {max_inodes}, largest batch \
         held {max_batch}",
        start.elapsed()
    );
    assert_eq!(seen, KEYS);
    assert!(
        max_inodes <= 50_000 + 2_000,
        "inode table grew to {max_inodes}"
    );
    assert!(
        max_batch <= 1_002,
        "a directory stream held {max_batch} entries"
    );
    // Entries looked up after the listing still resolve.
    let a = fs.lookup(big.ino, "f000007").await.unwrap();
    assert_eq!(a.size, 0);
}

/// Keys in the one directory of `a_big_directory_…`: 30 000 with `--max-entries 10000`
/// (eviction all along), 100 000 with the default cap under `S3CSI_FULL=1`, or
/// `S3CSI_BIGDIR_KEYS` (e.g. 1000000, the long variant: ~10 min).
fn big_directory_size() -> (usize, Option<&'static str>) {
    match std::env::var("S3CSI_BIGDIR_KEYS")
        .ok()
        .and_then(|v| v.parse().ok())
    {
        Some(n) => (n, None),
        None if full_run() => (100_000, None),
        None => (30_000, Some("10000")),
    }
}

/// Runs `sh -c SCRIPT` and returns (stdout lines, stderr).
fn shell_lines(script: &str) -> (usize, String) {
    let out = std::process::Command::new("sh")
        .args(["-c", script])
        .output()
        .unwrap();
    let lines = String::from_utf8_lossy(&out.stdout).lines().count();
    (lines, String::from_utf8_lossy(&out.stderr).into_owned())
}

/// Issue 39: a directory far larger than the inode table, through a real mount on the
/// embedded server, walked as users do: `ls -f`, `ls -l`, `find`, `stat` of random names,
/// `ls -l` again past the metadata TTL and after a remount. Every name shows every
/// time, and nothing is printed on stderr (before, `ls -l` of 100 000 objects showed
/// half of them and said the rest did not exist). What each walk costs: names only are
/// LISTs only; the first `ls -l` HEADs each object once; past the TTL and after a remount
/// of the same cache directory the versions are known and cost no HEAD.
#[test]
fn a_big_directory_lists_and_stats_every_name_through_a_real_mount() {
    let (keys, cap) = big_directory_size();
    let server = runtime().block_on(start_embedded_server("bigdir"));
    let endpoint = server.endpoint();
    let start = Instant::now();
    let names: Vec<String> = (0..keys).map(|i| format!("f{i:07}")).collect();
    {
        let c = Arc::new(
            runtime().block_on(s3csi::s3::aws::AwsClient::with_static_credentials(
                "bigdir",
                &s3csi::config::Endpoint {
                    region: Some("us-east-1".into()),
                    endpoint_url: Some(endpoint.clone()),
                    force_path_style: true,
                },
                s3csi::s3server::DEMO_ACCESS_KEY,
                s3csi::s3server::DEMO_SECRET_KEY,
                None,
            )),
        );
        runtime().block_on(async {
            let sem = Arc::new(tokio::sync::Semaphore::new(64));
            let mut tasks = Vec::new();
            for n in &names {
                let (c, key) = (c.clone(), format!("big/{n}"));
                let permit = sem.clone().acquire_owned().await.unwrap();
                tasks.push(tokio::spawn(async move {
                    c.put_object(&key, bytes::Bytes::from_static(b"0123456789"))
                        .await
                        .unwrap();
                    drop(permit);
                }));
            }
            for t in tasks {
                t.await.unwrap();
            }
        });
    }
    let created = start.elapsed();
    let cache = scratch_dir("bigdir-cache");
    let cache_arg = cache.display().to_string();
    let mut extra = vec!["--metadata-ttl", "1s", "--cache-dir", &cache_arg];
    if let Some(cap) = cap {
        extra.extend(["--max-entries", cap]);
    }
    let mut m = Mount::try_start_with(&endpoint, "bigdir", &extra, &EMBEDDED_KEYS).unwrap();
    let dir = m.path("big");
    let d = dir.display();
    let mut report = format!("{keys} keys (created in {created:.1?}, --max-entries {cap:?}):");
    let requests = server.requests.clone();
    // Waits until the server has seen no HEAD or LIST for a while: what the mount's
    // stat-ahead and list-ahead still send after a walk ended belongs to that walk, not
    // to the next one (on a loaded CI machine that tail once landed in `find`'s count).
    let settle = || {
        let deadline = Instant::now() + Duration::from_secs(10);
        let mut seen = (requests.heads(), requests.lists());
        while Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(300));
            let now = (requests.heads(), requests.lists());
            if now == seen {
                return;
            }
            seen = now;
        }
    };
    // Runs a walk; returns the HEADs it cost.
    let check = |report: &mut String, what: &str, script: String, want: usize| {
        settle();
        let (heads, lists) = (requests.heads(), requests.lists());
        let t = Instant::now();
        let (lines, err) = shell_lines(&script);
        let elapsed = t.elapsed();
        settle();
        let heads = requests.heads() - heads;
        *report += &format!(
            " {what} {elapsed:.2?} (HEAD {heads}, LIST {});",
            requests.lists() - lists
        );
        assert!(
            err.is_empty(),
            "{what}: stderr: {}",
            &err[..err.len().min(500)]
        );
        assert_eq!(lines, want, "{what}");
        heads
    };
    // Names only.
    let t = Instant::now();
    let mut listed: Vec<String> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    listed.sort();
    report += &format!(" readdir {:.2?};", t.elapsed());
    assert!(listed == names, "readdir showed {} names", listed.len());
    let ls_f_heads = check(&mut report, "ls -f", format!("ls -f {d}"), keys + 2);
    // None per object. `big` itself is revalidated once its 1 s TTL has passed (a probe:
    // HEADs of `big`, `big/` and `big_$folder$`, and a LIST), on a loaded machine twice.
    assert!(ls_f_heads <= 6, "ls -f cost {ls_f_heads} HEADs: {report}");
    let heads = check(&mut report, "ls -l", format!("ls -l {d}"), keys + 1);
    // Each object once; a few more where an entry was evicted while its HEAD ran.
    assert!(
        heads <= keys as u64 * 101 / 100,
        "{heads} HEADs for {keys} objects: {report}"
    );
    // For 10 s after a stat that needed a HEAD (`stat_ahead::STATTING_FOR`) the directory
    // counts as being stat'ed, and a listing then HEADs the entries whose metadata is not
    // known, by design (a second `ls -l`). On a loaded CI machine some entries were still
    // unknown after `ls -l` and `find`, run within those 10 s, HEADed them; wait it out so
    // that `find` shows what a names-only walk costs.
    std::thread::sleep(Duration::from_millis(10_500));
    let find_heads = check(&mut report, "find", format!("find {d}"), keys + 1);
    // A handful, not one per object: the full suite's CI run met 3 even after the wait;
    // which entries those were and why is not known yet (issue 39).
    assert!(
        find_heads <= keys as u64 / 1000,
        "find cost {find_heads} HEADs: {report}"
    );
    let mut rng = Rng::new(39);
    for _ in 0..500 {
        let n = rng.pick(&names);
        let md = std::fs::symlink_metadata(dir.join(n)).unwrap_or_else(|e| panic!("{n}: {e}"));
        assert_eq!(md.len(), 10);
    }
    std::thread::sleep(Duration::from_millis(1200));
    check(
        &mut report,
        "ls -l past the TTL",
        format!("ls -l {d}"),
        keys + 1,
    );
    m.stop();
    let m = Mount::try_start_with(&endpoint, "bigdir", &extra, &EMBEDDED_KEYS).unwrap();
    let pid = m.child.as_ref().unwrap().id();
    check(
        &mut report,
        "ls -l after a remount",
        format!("ls -l {}", m.path("big").display()),
        keys + 1,
    );
    let (hwm, _) = memory_kib(pid);
    eprintln!(
        "{report} mounter VmHWM after the remount's walk {} MiB",
        hwm / 1024
    );
    drop(m);
    runtime().block_on(server.stop());
    let _ = std::fs::remove_dir_all(&cache);
}
