//! Benchmark tools for `bench/run.sh`: a latency-injecting TCP proxy, a raw S3 client
//! (parallel ranged GETs / parallel multipart PUT over s3csi's own `AwsClient`), a bucket
//! populator and the file-system workloads run inside a mount. Every measuring command
//! prints one `RESULT key=value ...` line on stdout.

use anyhow::{bail, Context, Result};
use bytes::{Bytes, BytesMut};
use clap::{Parser, Subcommand};
use futures::{StreamExt, TryStreamExt};
use s3csi::config::units::parse_size;
use s3csi::config::Endpoint;
use s3csi::s3::aws::AwsClient;
use s3csi::s3::ObjectClient;
use std::io::{Read, Write};
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

#[derive(Parser)]
#[command(
    name = "s3bench",
    about = "Benchmark tools for s3csi (see bench/run.sh)"
)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(clap::Args, Clone)]
struct S3Args {
    /// S3 endpoint, e.g. http://127.0.0.1:9000 (path-style addressing is used)
    #[arg(long)]
    endpoint: String,
    #[arg(long)]
    bucket: String,
}

#[derive(Subcommand)]
enum Cmd {
    /// TCP proxy that delays every chunk by --delay-ms in each direction (pipelined, no
    /// throughput cap) and adds one round trip to every new connection (a TCP handshake).
    Proxy {
        #[arg(long)]
        listen: String,
        #[arg(long)]
        upstream: String,
        #[arg(long, default_value_t = 5)]
        delay_ms: u64,
        /// Keep the number of bytes clients sent upstream so far in this file (rewritten
        /// every 100 ms), for the bench's "bytes sent" rows.
        #[arg(long)]
        bytes_file: Option<std::path::PathBuf>,
        /// Keep the requests clients sent so far in this file, by kind (`HEAD:3 LIST:1 GET:2`;
        /// LIST is a GET with a query and no key), rewritten every 100 ms.
        #[arg(long)]
        requests_file: Option<std::path::PathBuf>,
    },
    /// Read one object with parallel ranged GETs (consumed in order, like a sequential reader).
    RawRead {
        #[command(flatten)]
        s3: S3Args,
        #[arg(long)]
        key: String,
        #[arg(long, default_value = "8MiB", value_parser = parse_size)]
        part: u64,
        #[arg(long, default_value_t = 16)]
        concurrency: usize,
        #[command(flatten)]
        barrier: Barrier,
    },
    /// Write one object with a parallel multipart upload (PutObject below 5 MiB).
    RawWrite {
        #[command(flatten)]
        s3: S3Args,
        #[arg(long)]
        key: String,
        #[arg(long, value_parser = parse_size)]
        size: u64,
        #[arg(long, default_value = "8MiB", value_parser = parse_size)]
        part: u64,
        #[arg(long, default_value_t = 16)]
        concurrency: usize,
    },
    /// Print an object's size (HeadObject).
    Head {
        #[command(flatten)]
        s3: S3Args,
        #[arg(long)]
        key: String,
    },
    /// Create PREFIX/dNNN/fNNNN objects through the S3 API.
    Populate {
        #[command(flatten)]
        s3: S3Args,
        #[arg(long, default_value = "tree")]
        prefix: String,
        #[arg(long, default_value_t = 100)]
        dirs: usize,
        #[arg(long, default_value_t = 100)]
        files: usize,
        #[arg(long, default_value_t = 64)]
        size: usize,
        #[arg(long, default_value_t = 32)]
        concurrency: usize,
        /// Give every object s3fs-style POSIX metadata (mode, uid, gid, mtime).
        #[arg(long)]
        with_metadata: bool,
    },
    /// File-system workloads, run inside a mount.
    Fs {
        #[command(subcommand)]
        op: FsOp,
    },
}

#[derive(Subcommand)]
enum FsOp {
    /// Read a file sequentially to the end.
    SeqRead {
        path: PathBuf,
        #[arg(long, default_value = "1MiB", value_parser = parse_size)]
        bs: u64,
    },
    /// Write a new file sequentially, then close it (durable at close on every mount tested).
    SeqWrite {
        path: PathBuf,
        #[arg(long, value_parser = parse_size)]
        size: u64,
        #[arg(long, default_value = "1MiB", value_parser = parse_size)]
        bs: u64,
    },
    /// N x touch (open O_CREAT, futimens, close), as coreutils touch does.
    Touch {
        dir: PathBuf,
        #[arg(long, default_value_t = 500)]
        n: usize,
    },
    /// N x (create + write SIZE bytes + close, then unlink).
    WriteUnlink {
        dir: PathBuf,
        #[arg(long, default_value_t = 1000)]
        n: usize,
        #[arg(long, default_value_t = 1024)]
        size: usize,
    },
    /// mdtest-like: create N empty files, stat them all, remove them all; ops/s per phase.
    Mdtest {
        dir: PathBuf,
        #[arg(long, default_value_t = 1000)]
        n: usize,
        /// Run one phase only (create, stat or remove), e.g. to count requests per phase.
        #[arg(long, default_value = "all")]
        phase: String,
        #[command(flatten)]
        barrier: Barrier,
    },
}

async fn client(s3: &S3Args) -> AwsClient {
    AwsClient::new(
        &s3.bucket,
        &Endpoint {
            region: None,
            endpoint_url: Some(s3.endpoint.clone()),
            force_path_style: true,
        },
    )
    .await
}

fn mib_s(bytes: u64, secs: f64) -> f64 {
    bytes as f64 / (1u64 << 20) as f64 / secs
}

/// A deterministic, incompressible-looking buffer.
fn pattern(len: usize) -> Bytes {
    let mut v = vec![0u8; len];
    let mut x: u64 = 0x9E37_79B9_7F4A_7C15;
    for chunk in v.chunks_mut(8) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        let b = x.to_le_bytes();
        chunk.copy_from_slice(&b[..chunk.len()]);
    }
    Bytes::from(v)
}

// ---------------------------------------------------------------- proxy

async fn proxy(
    listen: &str,
    upstream: &str,
    delay: Duration,
    bytes_file: Option<std::path::PathBuf>,
    requests_file: Option<std::path::PathBuf>,
) -> Result<()> {
    let listener = TcpListener::bind(listen)
        .await
        .with_context(|| format!("bind {listen}"))?;
    let sent = Arc::new(std::sync::atomic::AtomicU64::new(0));
    let requests: RequestCounts = Default::default();
    if let Some(path) = requests_file {
        let requests = requests.clone();
        keep_in_file(path, move || {
            let r = requests.lock().unwrap();
            let text: String = r.iter().map(|(k, v)| format!("{k}:{v} ")).collect();
            text.trim_end().to_string()
        });
    }
    if let Some(path) = bytes_file {
        let sent = sent.clone();
        keep_in_file(path, move || {
            sent.load(std::sync::atomic::Ordering::Relaxed).to_string()
        });
    }
    let mut n: u64 = 0;
    loop {
        let (down, _) = listener.accept().await?;
        n += 1;
        println!("conn {n}");
        let upstream = upstream.to_string();
        let sent = sent.clone();
        let requests = RequestCounter::new(requests.clone());
        tokio::spawn(async move {
            let accepted = tokio::time::Instant::now();
            let Ok(up) = TcpStream::connect(&upstream).await else {
                return;
            };
            let _ = down.set_nodelay(true);
            let _ = up.set_nodelay(true);
            // The handshake round trip: nothing moves before one RTT has passed.
            let gate = accepted + delay * 2;
            let (dr, dw) = down.into_split();
            let (ur, uw) = up.into_split();
            let a = tokio::spawn(pipe(dr, uw, gate, delay, Some((sent, requests))));
            let b = tokio::spawn(pipe(ur, dw, gate, delay, None));
            let _ = tokio::join!(a, b);
        });
    }
}

/// Keeps what `now` says in `path` (written anew, atomically, when it changed; checked
/// every 100 ms), for a script to read while the proxy runs.
fn keep_in_file(path: std::path::PathBuf, now: impl Fn() -> String + Send + 'static) {
    tokio::spawn(async move {
        let mut last = None;
        loop {
            let text = now();
            if last.as_ref() != Some(&text) {
                let tmp = path.with_extension("tmp");
                if std::fs::write(&tmp, &text).is_ok() {
                    let _ = std::fs::rename(&tmp, &path);
                }
                last = Some(text);
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    });
}

/// Requests seen so far, by kind (`HEAD`, `LIST`, `GET`, ...).
type RequestCounts = Arc<std::sync::Mutex<std::collections::BTreeMap<String, u64>>>;

/// Counts the HTTP/1.1 requests of one connection's client side by kind: request heads
/// are read up to their blank line and bodies of `Content-Length` skipped. A chunked body
/// cannot be skipped this cheaply: counting stops for that connection (`UNCOUNTED:1`).
struct RequestCounter {
    counts: RequestCounts,
    head: Vec<u8>,
    body_left: u64,
    lost: bool,
}

impl RequestCounter {
    fn new(counts: RequestCounts) -> Self {
        Self {
            counts,
            head: Vec::new(),
            body_left: 0,
            lost: false,
        }
    }

    fn feed(&mut self, mut data: &[u8]) {
        while !data.is_empty() && !self.lost {
            if self.body_left > 0 {
                let n = (self.body_left as usize).min(data.len());
                self.body_left -= n as u64;
                data = &data[n..];
                continue;
            }
            let Some(end) = find_blank_line(&self.head, data) else {
                self.head.extend_from_slice(data);
                return;
            };
            let taken = end - self.head.len();
            self.head.extend_from_slice(&data[..taken]);
            data = &data[taken..];
            let head = std::mem::take(&mut self.head);
            self.count(&String::from_utf8_lossy(&head));
        }
    }

    fn count(&mut self, head: &str) {
        let mut lines = head.split("\r\n");
        let mut parts = lines.next().unwrap_or("").split(' ');
        let (method, target) = (parts.next().unwrap_or(""), parts.next().unwrap_or(""));
        let mut chunked = false;
        for line in lines {
            let Some((name, value)) = line.split_once(':') else {
                continue;
            };
            match name.trim().to_ascii_lowercase().as_str() {
                "content-length" => self.body_left = value.trim().parse().unwrap_or(0),
                "transfer-encoding" => chunked = value.to_ascii_lowercase().contains("chunked"),
                _ => {}
            }
        }
        // Path-style: `/bucket?list-type=2&…` is a LIST, `/bucket/key…` names an object.
        let (path, query) = target.split_once('?').unwrap_or((target, ""));
        let object = path.trim_matches('/').contains('/');
        let kind = match method {
            "GET" if !object && !query.is_empty() => "LIST",
            m => m,
        };
        let mut counts = self.counts.lock().unwrap();
        *counts.entry(kind.to_string()).or_default() += 1;
        if chunked {
            *counts.entry("UNCOUNTED".to_string()).or_default() += 1;
            self.lost = true;
        }
    }
}

/// Where the head that `seen` + `more` begins ends (just past its `\r\n\r\n`), as an
/// offset into `seen` + `more`.
fn find_blank_line(seen: &[u8], more: &[u8]) -> Option<usize> {
    let start = seen.len().saturating_sub(3);
    let mut window: Vec<u8> = seen[start..].to_vec();
    window.extend_from_slice(more);
    window
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .map(|i| start + i + 4)
}

/// Forwards `r` to `w`; every chunk leaves `delay` after it arrived (never before `gate`).
/// Reading and writing run concurrently, so the delay does not cap throughput.
async fn pipe(
    mut r: tokio::net::tcp::OwnedReadHalf,
    mut w: tokio::net::tcp::OwnedWriteHalf,
    gate: tokio::time::Instant,
    delay: Duration,
    mut counted: Option<(Arc<std::sync::atomic::AtomicU64>, RequestCounter)>,
) {
    let (tx, mut rx) = tokio::sync::mpsc::channel::<(tokio::time::Instant, Option<Bytes>)>(4096);
    let reader = async move {
        let mut buf = BytesMut::with_capacity(256 << 10);
        loop {
            if buf.capacity() < 64 << 10 {
                buf.reserve(256 << 10);
            }
            let res = r.read_buf(&mut buf).await;
            let due = tokio::time::Instant::now().max(gate) + delay;
            match res {
                Ok(0) | Err(_) => {
                    let _ = tx.send((due, None)).await;
                    break;
                }
                Ok(_) => {
                    let chunk = buf.split().freeze();
                    if let Some((c, requests)) = &mut counted {
                        c.fetch_add(chunk.len() as u64, std::sync::atomic::Ordering::Relaxed);
                        requests.feed(&chunk);
                    }
                    if tx.send((due, Some(chunk))).await.is_err() {
                        break;
                    }
                }
            }
        }
    };
    let writer = async move {
        while let Some((due, chunk)) = rx.recv().await {
            tokio::time::sleep_until(due).await;
            match chunk {
                Some(c) => {
                    if w.write_all(&c).await.is_err() {
                        break;
                    }
                }
                None => {
                    let _ = w.shutdown().await;
                    break;
                }
            }
        }
    };
    tokio::join!(reader, writer);
}

// ---------------------------------------------------------------- raw S3

/// Where several processes run at once, as mdtest's MPI ranks do: each starts its timed
/// work at the same moment, once all have loaded and set up.
#[derive(clap::Args, Debug, Clone, Copy)]
struct Barrier {
    /// Wait until this time (seconds since the UNIX epoch) before the timed work.
    #[arg(long)]
    start_at: Option<f64>,
}

impl Barrier {
    /// How long to wait still.
    fn left(self) -> std::time::Duration {
        let left = self.start_at.map_or(0.0, |at| at - epoch_secs());
        std::time::Duration::from_secs_f64(left.max(0.0))
    }
}

/// Seconds since the UNIX epoch: the start and end a run prints, so that a script running
/// several processes at once can time them together from the first start to the last end
/// (a process's own start-up, such as loading this binary, is not in it).
fn epoch_secs() -> f64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

async fn raw_read(s3: &S3Args, key: &str, part: u64, conc: usize, barrier: Barrier) -> Result<()> {
    let c = client(s3).await;
    tokio::time::sleep(barrier.left()).await;
    let start = epoch_secs();
    let t = Instant::now();
    let size = c.head_object(key).await?.size;
    let ranges: Vec<(u64, u64)> = (0..size)
        .step_by(part as usize)
        .map(|s| (s, (s + part).min(size)))
        .collect();
    // Each GET a task of its own: the runtime's threads then receive and copy bodies in
    // parallel (`buffered` alone would poll every body from this one task).
    let c = Arc::new(c);
    let total = futures::stream::iter(ranges)
        .map(|(s, e)| {
            let (c, key) = (c.clone(), key.to_string());
            async move {
                match tokio::spawn(async move { c.get_range(&key, s, e).await }).await {
                    Ok(got) => got.map(|b| b.len() as u64).map_err(anyhow::Error::from),
                    Err(e) => Err(anyhow::Error::from(e)),
                }
            }
        })
        .buffered(conc)
        .try_fold(0u64, |acc, n| async move { Ok(acc + n) })
        .await?;
    let secs = t.elapsed().as_secs_f64();
    if total != size {
        bail!("read {total} bytes, object has {size}");
    }
    println!(
        "RESULT op=raw-read bytes={total} secs={secs:.3} mibps={:.1} start={start:.6} end={:.6}",
        mib_s(total, secs),
        epoch_secs()
    );
    Ok(())
}

async fn raw_write(s3: &S3Args, key: &str, size: u64, part: u64, conc: usize) -> Result<()> {
    let c = client(s3).await;
    let buf = pattern(part.min(size).max(1) as usize);
    let t = Instant::now();
    if size < 5 << 20 {
        c.put_object(key, buf.slice(0..size as usize)).await?;
    } else {
        let id = c.create_multipart(key).await?;
        let nparts = size.div_ceil(part);
        let (c, key, id, buf) = (&c, key, &id, &buf);
        let res = futures::stream::iter(1..=nparts)
            .map(|i| async move {
                let len = part.min(size - (i - 1) * part) as usize;
                c.upload_part(key, id, i as i32, buf.slice(0..len)).await
            })
            .buffer_unordered(conc)
            .try_collect::<Vec<_>>()
            .await;
        let mut parts = match res {
            Ok(p) => p,
            Err(e) => {
                let _ = c.abort_multipart(key, id).await;
                return Err(e.into());
            }
        };
        parts.sort_by_key(|p| p.part_number);
        c.complete_multipart(key, id, parts).await?;
    }
    let secs = t.elapsed().as_secs_f64();
    println!(
        "RESULT op=raw-write bytes={size} secs={secs:.3} mibps={:.1}",
        mib_s(size, secs)
    );
    Ok(())
}

async fn populate(
    s3: &S3Args,
    prefix: &str,
    dirs: usize,
    files: usize,
    size: usize,
    conc: usize,
    meta: Option<s3csi::s3::UserMeta>,
) -> Result<()> {
    let c = client(s3).await;
    let meta = &meta;
    let body = pattern(size);
    let t = Instant::now();
    let keys: Vec<String> = (0..dirs)
        .flat_map(|d| (0..files).map(move |f| format!("{prefix}/d{d:03}/f{f:04}")))
        .collect();
    let n = keys.len();
    let (c, body) = (&c, &body);
    futures::stream::iter(keys)
        .map(|k| async move {
            match meta {
                Some(m) => c.put_object_with_meta(&k, body.clone(), m).await,
                None => c.put_object(&k, body.clone()).await,
            }
        })
        .buffer_unordered(conc)
        .try_for_each(|_| async { Ok(()) })
        .await?;
    println!(
        "RESULT op=populate objects={n} secs={:.3}",
        t.elapsed().as_secs_f64()
    );
    Ok(())
}

// ---------------------------------------------------------------- file-system workloads

fn fs_op(op: FsOp) -> Result<()> {
    match op {
        FsOp::SeqRead { path, bs } => {
            let t = Instant::now();
            let mut f = std::fs::File::open(&path).with_context(|| format!("open {path:?}"))?;
            let mut buf = vec![0u8; bs as usize];
            let mut total = 0u64;
            loop {
                let n = f.read(&mut buf).context("read")?;
                if n == 0 {
                    break;
                }
                total += n as u64;
            }
            drop(f);
            let secs = t.elapsed().as_secs_f64();
            let size = std::fs::metadata(&path)?.len();
            if total != size {
                bail!("read {total} bytes, file has {size}");
            }
            println!(
                "RESULT op=seq-read bytes={total} secs={secs:.3} mibps={:.1}",
                mib_s(total, secs)
            );
        }
        FsOp::SeqWrite { path, size, bs } => {
            let buf = pattern(bs as usize);
            let t = Instant::now();
            let mut f = std::fs::File::create(&path).with_context(|| format!("create {path:?}"))?;
            let mut left = size;
            while left > 0 {
                let n = left.min(bs) as usize;
                f.write_all(&buf[..n]).context("write")?;
                left -= n as u64;
            }
            // close(2) is where every mount tested makes the data durable; report its error.
            let fd = std::os::fd::IntoRawFd::into_raw_fd(f);
            if unsafe { libc::close(fd) } != 0 {
                bail!("close: {}", std::io::Error::last_os_error());
            }
            let secs = t.elapsed().as_secs_f64();
            println!(
                "RESULT op=seq-write bytes={size} secs={secs:.3} mibps={:.1}",
                mib_s(size, secs)
            );
        }
        FsOp::Touch { dir, n } => {
            std::fs::create_dir_all(&dir)?;
            let t = Instant::now();
            for i in 0..n {
                touch(&dir.join(format!("t{i:05}")))?;
            }
            let secs = t.elapsed().as_secs_f64();
            println!(
                "RESULT op=touch n={n} secs={secs:.3} ms_per_file={:.2}",
                secs * 1000.0 / n as f64
            );
        }
        FsOp::WriteUnlink { dir, n, size } => {
            std::fs::create_dir_all(&dir)?;
            let body = pattern(size);
            let t = Instant::now();
            for i in 0..n {
                let p = dir.join(format!("w{i:05}"));
                let mut f = std::fs::File::create(&p).with_context(|| format!("create {p:?}"))?;
                f.write_all(&body)?;
                close_checked(f)?;
                std::fs::remove_file(&p).with_context(|| format!("unlink {p:?}"))?;
            }
            let secs = t.elapsed().as_secs_f64();
            println!(
                "RESULT op=write-unlink n={n} secs={secs:.3} ms_per_file={:.2}",
                secs * 1000.0 / n as f64
            );
        }
        FsOp::Mdtest {
            dir,
            n,
            phase,
            barrier,
        } => {
            if !["all", "create", "stat", "remove"].contains(&phase.as_str()) {
                bail!("--phase must be all, create, stat or remove");
            }
            std::fs::create_dir_all(&dir)?;
            let paths: Vec<PathBuf> = (0..n).map(|i| dir.join(format!("m{i:05}"))).collect();
            let run = |name: &str| phase == "all" || phase == name;
            std::thread::sleep(barrier.left());
            let mut out = format!("RESULT op=mdtest n={n}");
            let span = |start: f64| format!(" start={start:.6} end={:.6}", epoch_secs());
            if run("create") {
                let start = epoch_secs();
                let t = Instant::now();
                for p in &paths {
                    let f = std::fs::OpenOptions::new()
                        .write(true)
                        .create(true)
                        .truncate(true)
                        .mode(0o644)
                        .open(p)
                        .with_context(|| format!("create {p:?}"))?;
                    close_checked(f)?;
                }
                out += &format!(" create_ops={:.1}", n as f64 / t.elapsed().as_secs_f64());
                out += &span(start);
            }
            if run("stat") {
                let start = epoch_secs();
                let t = Instant::now();
                for p in &paths {
                    std::fs::metadata(p).with_context(|| format!("stat {p:?}"))?;
                }
                out += &format!(" stat_ops={:.1}", n as f64 / t.elapsed().as_secs_f64());
                out += &span(start);
            }
            if run("remove") {
                let start = epoch_secs();
                let t = Instant::now();
                for p in &paths {
                    std::fs::remove_file(p).with_context(|| format!("unlink {p:?}"))?;
                }
                out += &format!(" remove_ops={:.1}", n as f64 / t.elapsed().as_secs_f64());
                out += &span(start);
            }
            println!("{out}");
        }
    }
    Ok(())
}

fn close_checked(f: std::fs::File) -> Result<()> {
    let fd = std::os::fd::IntoRawFd::into_raw_fd(f);
    if unsafe { libc::close(fd) } != 0 {
        bail!("close: {}", std::io::Error::last_os_error());
    }
    Ok(())
}

/// What coreutils `touch FILE` does: open(O_WRONLY|O_CREAT|O_NOCTTY|O_NONBLOCK), futimens, close.
fn touch(p: &Path) -> Result<()> {
    let f = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .custom_flags(libc::O_NOCTTY | libc::O_NONBLOCK)
        .mode(0o666)
        .open(p)
        .with_context(|| format!("touch {p:?}"))?;
    let fd = std::os::fd::AsRawFd::as_raw_fd(&f);
    if unsafe { libc::futimens(fd, std::ptr::null()) } != 0 {
        bail!("futimens {p:?}: {}", std::io::Error::last_os_error());
    }
    close_checked(f)
}

fn main() -> Result<()> {
    let cli = Cli::parse();
    if let Cmd::Fs { op } = cli.cmd {
        return fs_op(op);
    }
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    rt.block_on(async move {
        match cli.cmd {
            Cmd::Proxy {
                listen,
                upstream,
                delay_ms,
                bytes_file,
                requests_file,
            } => {
                proxy(
                    &listen,
                    &upstream,
                    Duration::from_millis(delay_ms),
                    bytes_file,
                    requests_file,
                )
                .await
            }
            Cmd::RawRead {
                s3,
                key,
                part,
                concurrency,
                barrier,
            } => raw_read(&s3, &key, part, concurrency.max(1), barrier).await,
            Cmd::RawWrite {
                s3,
                key,
                size,
                part,
                concurrency,
            } => raw_write(&s3, &key, size, part.max(5 << 20), concurrency.max(1)).await,
            Cmd::Head { s3, key } => {
                let m = client(&s3).await.head_object(&key).await?;
                println!("RESULT op=head size={}", m.size);
                Ok(())
            }
            Cmd::Populate {
                s3,
                prefix,
                dirs,
                files,
                size,
                concurrency,
                with_metadata,
            } => {
                let meta = with_metadata.then(|| {
                    [("mode", "33200"), ("uid", "1000"), ("gid", "1000")]
                        .iter()
                        .map(|(k, v)| (k.to_string(), v.to_string()))
                        .chain([("mtime".to_string(), "1700000000".to_string())])
                        .collect::<s3csi::s3::UserMeta>()
                });
                populate(&s3, &prefix, dirs, files, size, concurrency.max(1), meta).await
            }
            Cmd::Fs { .. } => unreachable!(),
        }
    })
}
