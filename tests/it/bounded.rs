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
        let batch = fs.readdir(fh, offset).await.unwrap();
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

#[test]
fn many_keys_list_through_a_real_mount() {
    let keys = if full_run() { 100_000 } else { 20_000 };
    let bucket = new_bucket("manykeys");
    let start = Instant::now();
    put_many(
        &bucket,
        (0..keys).map(|i| format!("d/k{i:06}")).collect(),
        bytes::Bytes::from_static(b"."),
    );
    let created = start.elapsed();
    let m = Mount::start(&bucket, &[]);
    let pid = m.child.as_ref().unwrap().id();
    let start = Instant::now();
    let mut n = 0;
    for e in std::fs::read_dir(m.path("d")).unwrap() {
        e.unwrap();
        n += 1;
    }
    let listed = start.elapsed();
    let (hwm, _) = memory_kib(pid);
    eprintln!(
        "{keys} keys: created in {created:?}, listed through the mount in {listed:?}; mounter \
         VmHWM {} MiB",
        hwm / 1024
    );
    assert_eq!(n, keys);
    // ls -l style: stat every entry too, which fills the inode table past its cap.
    if full_run() {
        for e in std::fs::read_dir(m.path("d")).unwrap() {
            std::fs::metadata(e.unwrap().path()).unwrap();
        }
        eprintln!("after stat of all: VmHWM {} MiB", memory_kib(pid).0 / 1024);
    }
}
