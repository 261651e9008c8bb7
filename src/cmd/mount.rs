//! `s3csi mount`: parse options, check the bucket, mount, serve, and unmount cleanly.
//!
//! Like mount helpers, the command detaches into the background by default, but only
//! once the mount is live: the parent waits on a pipe for the child to report either
//! "mounted" or the one-line reason it could not mount, and exits 0 or 1 accordingly.
//! With `--handoff-dir` it is the CSI node service's mounter instead: it never mounts,
//! it serves the descriptor the node service hands over (see `mounter::handoff`).

use crate::config::{MountArgs, MountConfig};
use crate::fs::fuse::FuseAdapter;
use crate::fs::session::{serve_descriptor, HandoffFiles};
use crate::fs::{FsConfig, S3Fs};
use crate::metrics::Sampled;
use crate::mounter::handoff::{self, Failure};
use crate::mounter::FailureKind;
use crate::s3::aws::AwsClient;
use crate::s3::metered::{MeteredClient, S3Metrics};
use crate::s3::{ListRequest, ObjectClient, S3Error};
use prometheus_client::encoding::prometheus_text;
use prometheus_client::registry::Registry;
use std::io::{Read, Write};
use std::os::fd::OwnedFd;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

/// Why `s3csi mount` cannot get as far as mounting: each says so in one line.
#[derive(Debug, thiserror::Error)]
enum MountCommandError {
    #[error("mountpoint {}: {source}", .path.display())]
    Mountpoint {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("mountpoint {} is not a directory", .0.display())]
    NotADirectory(PathBuf),
    #[error("mountpoint {} is already mounted", .0.display())]
    AlreadyMounted(PathBuf),
    #[error("bucket {0:?} does not exist")]
    NoSuchBucket(String),
    #[error(
        "access to bucket {bucket:?} denied ({detail}); check the credentials from the AWS default chain"
    )]
    AccessDenied { bucket: String, detail: String },
    #[error("cannot reach S3 endpoint {endpoint}: {detail}")]
    Unreachable { endpoint: String, detail: String },
    #[error("S3 endpoint {0} did not answer in time")]
    Timeout(String),
    #[error("cannot access bucket {bucket:?}: {source}")]
    Bucket { bucket: String, source: S3Error },
    #[error("pipe: {0}")]
    Pipe(nix::errno::Errno),
    #[error("fork: {0}")]
    Fork(nix::errno::Errno),
}

impl MountCommandError {
    /// What the node service makes of it (the gRPC status kubelet gets).
    fn kind(&self) -> FailureKind {
        match self {
            Self::NoSuchBucket(_) => FailureKind::NotFound,
            Self::AccessDenied { .. } => FailureKind::PermissionDenied,
            _ => FailureKind::Other,
        }
    }
}

fn check_mountpoint(path: &Path) -> Result<PathBuf, MountCommandError> {
    let canonical =
        std::fs::canonicalize(path).map_err(|source| MountCommandError::Mountpoint {
            path: path.to_path_buf(),
            source,
        })?;
    if !canonical.is_dir() {
        return Err(MountCommandError::NotADirectory(path.to_path_buf()));
    }
    if crate::mounter::mountinfo::find(&canonical).is_some() {
        return Err(MountCommandError::AlreadyMounted(path.to_path_buf()));
    }
    Ok(canonical)
}

/// One clear line for the usual ways the first S3 request fails.
fn describe_access_error(cfg: &MountConfig, e: S3Error) -> MountCommandError {
    let bucket = cfg.source.bucket.clone();
    let endpoint = || {
        cfg.endpoint
            .endpoint_url
            .as_deref()
            .unwrap_or("(AWS default)")
            .to_string()
    };
    match e {
        S3Error::NoSuchBucket => MountCommandError::NoSuchBucket(bucket),
        S3Error::AccessDenied(detail) => MountCommandError::AccessDenied { bucket, detail },
        S3Error::Unreachable(detail) => MountCommandError::Unreachable {
            endpoint: endpoint(),
            detail,
        },
        S3Error::Timeout => MountCommandError::Timeout(endpoint()),
        source => MountCommandError::Bucket { bucket, source },
    }
}

async fn check_bucket(client: &AwsClient, cfg: &MountConfig) -> Result<(), MountCommandError> {
    let probe = client.list(ListRequest {
        prefix: &cfg.source.prefix,
        delimiter: Some("/"),
        continuation: None,
        start_after: None,
        max_keys: 1,
    });
    match tokio::time::timeout(Duration::from_secs(20), probe).await {
        Ok(Ok(_)) => Ok(()),
        Ok(Err(e)) => Err(describe_access_error(cfg, e)),
        Err(_) => Err(describe_access_error(cfg, S3Error::Timeout)),
    }
}

/// Reports readiness to the waiting parent (when detached).
struct Readiness(Option<std::fs::File>);

impl Readiness {
    fn report(&mut self, msg: &str) {
        if let Some(mut f) = self.0.take() {
            let _ = f.write_all(msg.as_bytes());
        }
    }
}

/// Forks; the parent waits for the child's verdict and exits with it.
fn detach() -> Result<Readiness, MountCommandError> {
    let (read, write): (OwnedFd, OwnedFd) = nix::unistd::pipe().map_err(MountCommandError::Pipe)?;
    // SAFETY: called before any thread exists (no runtime, no logger threads yet).
    match unsafe { nix::unistd::fork() }.map_err(MountCommandError::Fork)? {
        nix::unistd::ForkResult::Parent { .. } => {
            drop(write);
            let mut msg = String::new();
            let _ = std::fs::File::from(read).read_to_string(&mut msg);
            if msg == "OK" {
                std::process::exit(0);
            }
            let msg = if msg.is_empty() {
                "the mount process exited before the mount was ready".to_string()
            } else {
                msg
            };
            eprintln!("s3csi: {msg}");
            std::process::exit(1);
        }
        nix::unistd::ForkResult::Child => {
            drop(read);
            let _ = nix::unistd::setsid();
            Ok(Readiness(Some(std::fs::File::from(write))))
        }
    }
}

fn redirect_stdio(log_file: Option<&Path>) {
    let devnull = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open("/dev/null");
    if let Ok(null) = &devnull {
        let _ = nix::unistd::dup2_stdin(null);
        let _ = nix::unistd::dup2_stdout(null);
    }
    let err_target = match log_file {
        Some(p) => std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(p),
        None => devnull,
    };
    if let Ok(f) = err_target {
        let _ = nix::unistd::dup2_stderr(&f);
    }
}

fn start_logging(cfg: &MountConfig) {
    crate::logging::init(if cfg.debug {
        "s3csi=debug,info"
    } else {
        "info"
    });
}

/// The runtime S3 requests and FUSE requests run on.
fn io_runtime() -> std::io::Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .thread_name("s3csi-io")
        .build()
}

/// Runs `s3csi mount`; returns the process exit code.
pub fn run_mount_command(args: MountArgs) -> i32 {
    let fail = |ready: &mut Readiness, msg: String| -> i32 {
        tracing::error!("{msg}");
        if ready.0.is_some() {
            ready.report(&msg);
        } else {
            eprintln!("s3csi: {msg}");
        }
        1
    };
    let mut ready = Readiness(None);
    let cfg = match args.to_config() {
        Ok(c) => c,
        Err(e) => {
            if let Some(dir) = &args.handoff_dir {
                record_failure(
                    dir,
                    &Failure::new(FailureKind::InvalidArgument, e.to_string()),
                );
            }
            return fail(&mut ready, e.to_string());
        }
    };
    if let Some(dir) = args.handoff_dir.clone() {
        return run_handoff(&args, &cfg, &dir);
    }
    let mountpoint = match check_mountpoint(&args.mountpoint) {
        Ok(p) => p,
        Err(e) => return fail(&mut ready, e.to_string()),
    };
    if !args.foreground {
        match detach() {
            Ok(r) => ready = r,
            Err(e) => return fail(&mut ready, e.to_string()),
        }
        redirect_stdio(args.log_file.as_deref());
    } else if let Some(p) = &args.log_file {
        redirect_stdio(Some(p));
        if let Ok(null) = std::fs::File::open("/dev/null") {
            let _ = nix::unistd::dup2_stdin(&null);
        }
    }
    start_logging(&cfg);
    let rt = match io_runtime() {
        Ok(rt) => rt,
        Err(e) => return fail(&mut ready, format!("cannot start runtime: {e}")),
    };
    let client = rt.block_on(AwsClient::new(&cfg.source.bucket, &cfg.endpoint));
    if let Err(e) = rt.block_on(check_bucket(&client, &cfg)) {
        return fail(&mut ready, e.to_string());
    }
    let fs_cfg = FsConfig {
        cache_dir: Some(
            args.cache_dir
                .clone()
                .unwrap_or_else(|| default_cache_dir(&mountpoint)),
        ),
        // A cache directory given by hand is one meant for the data, as in s3fs's
        // `use_cache=DIR` and Mountpoint's `--cache DIR`.
        data_cache: cfg.data_cache || args.cache_dir.is_some(),
        ..FsConfig::from(&cfg)
    };
    let fs = Arc::new(S3Fs::new(Arc::new(client), fs_cfg));
    if let Err(e) = fs.open_staging() {
        return fail(&mut ready, format!("cannot use the cache directory: {e}"));
    }
    rt.block_on(fs.upload_recovered());
    fs.start_background(rt.handle());
    let adapter = FuseAdapter::new(fs.clone(), rt.handle().clone());
    let mut options = vec![
        fuser::MountOption::FSName(format!("s3csi:{}", cfg.source.bucket)),
        fuser::MountOption::Subtype("s3csi".into()),
        fuser::MountOption::NoDev,
        fuser::MountOption::NoSuid,
    ];
    if !cfg.no_default_permissions {
        options.push(fuser::MountOption::DefaultPermissions);
    }
    if cfg.read_only {
        options.push(fuser::MountOption::RO);
    }
    let mut fuse_cfg = fuser::Config::default();
    fuse_cfg.mount_options = options;
    fuse_cfg.acl = if cfg.allow_other {
        fuser::SessionACL::All
    } else if cfg.allow_root {
        fuser::SessionACL::RootAndOwner
    } else {
        fuser::SessionACL::Owner
    };
    let session = match fuser::Session::new(adapter, &mountpoint, &fuse_cfg) {
        Ok(s) => s,
        Err(e) => {
            return fail(
                &mut ready,
                format!("cannot mount on {}: {e}", mountpoint.display()),
            )
        }
    };
    let background = match session.spawn() {
        Ok(b) => b,
        Err(e) => return fail(&mut ready, format!("cannot start the FUSE session: {e}")),
    };
    tracing::info!(
        bucket = %cfg.source.bucket,
        prefix = %cfg.source.prefix,
        mountpoint = %mountpoint.display(),
        "mounted"
    );
    ready.report("OK");
    drop(ready);

    let stop = rt.block_on(wait_for_stop(&background));
    if let Some(signal) = stop {
        tracing::info!(signal, "stopping: completing open uploads, then unmounting");
        let failed = rt.block_on(fs.flush_all());
        if failed > 0 {
            tracing::error!(failed, "some uploads failed while stopping");
        }
        if let Err(e) = nix::mount::umount(&mountpoint) {
            tracing::warn!(error = %e, "unmount failed (busy?); detaching lazily");
            let _ = nix::mount::umount2(&mountpoint, nix::mount::MntFlags::MNT_DETACH);
        }
    }
    end_session(background);
    tracing::info!("unmounted");
    0
}

/// Waits for the session thread, which ends when the kernel closes the connection, and
/// then drops nothing: fuser's `Mount` would unmount the mountpoint *by path* once more,
/// and by then that path may hold the next mount of the same directory (`umount DIR;
/// s3csi mount ... DIR` right after), which it would take down.
fn end_session(background: fuser::BackgroundSession) {
    while !background.guard.is_finished() {
        std::thread::sleep(Duration::from_millis(20));
    }
    std::mem::forget(background);
}

/// Waits for SIGTERM/SIGINT/SIGHUP (returns its name) or for the session to end because
/// someone unmounted us (returns None).
async fn wait_for_stop(background: &fuser::BackgroundSession) -> Option<&'static str> {
    use tokio::signal::unix::{signal, SignalKind};
    let (mut term, mut int, mut hup) = match (
        signal(SignalKind::terminate()),
        signal(SignalKind::interrupt()),
        signal(SignalKind::hangup()),
    ) {
        (Ok(a), Ok(b), Ok(c)) => (a, b, c),
        _ => return None,
    };
    let mut tick = tokio::time::interval(Duration::from_millis(200));
    loop {
        tokio::select! {
            _ = term.recv() => return Some("SIGTERM"),
            _ = int.recv() => return Some("SIGINT"),
            _ = hup.recv() => return Some("SIGHUP"),
            _ = tick.tick() => {
                if background.guard.is_finished() {
                    return None;
                }
            }
        }
    }
}

/// `/var/tmp/s3csi/<hash of the mountpoint>`: on disk (not a tmpfs), private to root or
/// the mounting user, the same for every mount of one directory, so a remount finds
/// edits a crashed predecessor left.
fn default_cache_dir(mountpoint: &Path) -> PathBuf {
    use std::hash::{Hash, Hasher};
    let mut h = std::collections::hash_map::DefaultHasher::new();
    mountpoint.hash(&mut h);
    let uid = nix::unistd::geteuid().as_raw();
    let base = if uid == 0 {
        PathBuf::from("/var/tmp/s3csi")
    } else {
        PathBuf::from(format!("/var/tmp/s3csi-{uid}"))
    };
    base.join(format!("{:016x}", h.finish()))
}

/// Leaves the reason we are giving up in the handoff directory: in pod mode our stderr
/// belongs to the container runtime, and the node service reports this to kubelet.
fn record_failure(dir: &Path, failure: &Failure) {
    if let Err(e) = handoff::record_failure(dir, failure) {
        tracing::warn!(error = %e, "cannot record the failure in the handoff directory");
    }
}

/// `s3csi mount --handoff-dir DIR`: the CSI node service has mounted (or will mount) the
/// target itself and hands us the /dev/fuse descriptor over `DIR/control.sock`; see
/// `mounter::handoff`. We never mount or unmount; SIGTERM completes open uploads and exits,
/// the node service unmounts.
fn run_handoff(args: &MountArgs, cfg: &MountConfig, dir: &Path) -> i32 {
    use std::os::unix::net::UnixListener;
    if let Some(p) = &args.log_file {
        redirect_stdio(Some(p));
    }
    if let Ok(null) = std::fs::File::open("/dev/null") {
        let _ = nix::unistd::dup2_stdin(&null);
    }
    start_logging(cfg);
    let fail_as = |kind: FailureKind, msg: String| -> i32 {
        tracing::error!("{msg}");
        eprintln!("s3csi: {msg}");
        record_failure(dir, &Failure::new(kind, msg));
        1
    };
    let fail = |msg: String| fail_as(FailureKind::Other, msg);
    let rt = match io_runtime() {
        Ok(rt) => rt,
        Err(e) => return fail(format!("cannot start runtime: {e}")),
    };
    let client = rt.block_on(AwsClient::new(&cfg.source.bucket, &cfg.endpoint));
    if !args.recover {
        // A replacement serves even while S3 is unreachable: requests fail with EIO
        // instead of hanging until S3 answers.
        if let Err(e) = rt.block_on(check_bucket(&client, cfg)) {
            return fail_as(e.kind(), e.to_string());
        }
    }
    let sock = handoff::control_socket(dir);
    let _ = std::fs::remove_file(&sock);
    let listener = match UnixListener::bind(&sock) {
        Ok(l) => l,
        Err(e) => return fail(format!("cannot listen on {}: {e}", sock.display())),
    };
    {
        use std::os::unix::fs::PermissionsExt;
        let _ = std::fs::set_permissions(&sock, std::fs::Permissions::from_mode(0o600));
    }
    tracing::info!(socket = %sock.display(), recover = args.recover, "waiting for the FUSE descriptor");
    // Wait for SERVE + descriptor.
    let (conn, fuse_fd) = loop {
        let conn = match listener.accept() {
            Ok((c, _)) => c,
            Err(e) => return fail(format!("control socket: {e}")),
        };
        let _ = conn.set_read_timeout(Some(Duration::from_secs(10)));
        match handoff::recv(&conn) {
            Ok((line, Some(fd))) if line == "SERVE" => break (conn, fd),
            Ok((line, _)) if line == "PING" => {
                let _ = handoff::send(&conn, &format!("OK pid={}", std::process::id()), None);
            }
            Ok((line, _)) => {
                let _ = handoff::send(&conn, &format!("ERR not serving yet: {line:?}"), None);
            }
            Err(e) => tracing::warn!(error = %e, "control connection failed"),
        }
    };
    let s3_metrics = Arc::new(S3Metrics::default());
    let client = MeteredClient::new(Arc::new(client), s3_metrics.clone());
    // In the mount's state directory: a replacement mounter finds what its predecessor
    // staged (see `StagingArea::open`).
    let fs_cfg = FsConfig {
        cache_dir: Some(args.cache_dir.clone().unwrap_or_else(|| dir.join("cache"))),
        ..FsConfig::from(cfg)
    };
    let fs = Arc::new(S3Fs::new(Arc::new(client), fs_cfg));
    if let Err(e) = fs.open_staging() {
        return fail(format!("cannot use the cache directory: {e}"));
    }
    rt.block_on(fs.upload_recovered());
    fs.start_background(rt.handle());
    let metrics = mounter_metrics(&s3_metrics, &fs);
    // The kernel enforces access (allow_other or only root, set by the node service).
    let acl = if cfg.allow_root && !cfg.allow_other {
        fuser::SessionACL::RootAndOwner
    } else {
        fuser::SessionACL::All
    };
    let files = HandoffFiles {
        init: dir.join(handoff::INIT_FILE),
        init_reply: dir.join(handoff::INIT_REPLY_FILE),
        inode_log: dir.join(handoff::INODE_LOG),
    };
    let background = match serve_descriptor(&fs, acl, &files, &fuse_fd, args.recover, &rt) {
        Ok(b) => b,
        Err(e) => {
            let failure = Failure::new(FailureKind::Other, e.to_string());
            let _ = handoff::send(&conn, &handoff::refusal(&failure), None);
            return fail(e.to_string());
        }
    };
    tracing::info!(
        bucket = %cfg.source.bucket,
        prefix = %cfg.source.prefix,
        mountpoint = %args.mountpoint.display(),
        recovered = args.recover,
        "serving the FUSE descriptor handed over by the node service"
    );
    let _ = handoff::send(&conn, "OK", None);
    drop(conn);
    std::thread::Builder::new()
        .name("s3csi-control".into())
        .spawn(move || serve_control(listener, fuse_fd, metrics))
        .ok();

    let stop = rt.block_on(wait_for_stop(&background));
    if let Some(signal) = stop {
        tracing::info!(
            signal,
            "stopping: completing open uploads; the node service unmounts"
        );
        let failed = rt.block_on(fs.flush_all());
        if failed > 0 {
            tracing::error!(failed, "some uploads failed while stopping");
        }
        tracing::info!("stopped");
        return 0;
    }
    let _ = background.join();
    tracing::info!("unmounted");
    0
}

/// What a mounter answers to METRICS: its S3 requests and open files.
fn mounter_metrics(s3: &S3Metrics, fs: &Arc<S3Fs>) -> Registry {
    let mut registry = Registry::default();
    s3.register(&mut registry);
    if let Some(cache) = fs.data_cache() {
        register_cache_metrics(&mut registry, cache);
    }
    if let Some(memory) = fs.memory_cache() {
        let m = Arc::downgrade(memory);
        registry.register_collector(Box::new(Sampled::counter(
            "s3csi_cache_memory_hits",
            "Reads served from --cache-memory",
            move || {
                m.upgrade()
                    .map_or(0, |m| m.hits.load(std::sync::atomic::Ordering::Relaxed))
            },
        )));
    }
    // Weak: the control thread must not keep the file system alive past the mount.
    let fs = Arc::downgrade(fs);
    registry.register_collector(Box::new(Sampled::gauge(
        "s3csi_open_file_handles",
        "Files open on the mount (directories not counted)",
        move || fs.upgrade().map_or(0, |fs| fs.open_file_handles() as u64),
    )));
    registry
}

/// The data cache's counters (`--data-cache`), read at every scrape.
fn register_cache_metrics(registry: &mut Registry, cache: &Arc<crate::fs::cache::DataCache>) {
    use std::sync::atomic::{AtomicU64, Ordering};
    type Stat = fn(&crate::fs::cache::CacheStats) -> &AtomicU64;
    let counters: [(&'static str, &'static str, Stat); 7] = [
        (
            "s3csi_cache_hits",
            "Reads served from the data cache",
            |s| &s.hits,
        ),
        (
            "s3csi_cache_hit_bytes",
            "Bytes served from the data cache",
            |s| &s.hit_bytes,
        ),
        (
            "s3csi_cache_passthrough_opens",
            "Opens of wholly cached files whose reads the kernel serves from the cache file",
            |s| &s.passthrough_opens,
        ),
        (
            "s3csi_cache_misses",
            "Reads of a cacheable version that needed S3",
            |s| &s.misses,
        ),
        (
            "s3csi_cache_written_bytes",
            "Bytes written to the data cache",
            |s| &s.written_bytes,
        ),
        (
            "s3csi_cache_evictions",
            "Objects the data cache gave up to make room",
            |s| &s.evictions,
        ),
        (
            "s3csi_cache_dropped_blocks",
            "Fetched blocks not kept (writer behind, no room, disk error)",
            |s| &s.dropped,
        ),
    ];
    for (name, help, stat) in counters {
        let c = Arc::downgrade(cache);
        registry.register_collector(Box::new(Sampled::counter(name, help, move || {
            c.upgrade()
                .map_or(0, |c| stat(&c.stats).load(Ordering::Relaxed))
        })));
    }
    let c = Arc::downgrade(cache);
    registry.register_collector(Box::new(Sampled::gauge(
        "s3csi_cache_bytes",
        "Bytes of object data in the data cache",
        move || c.upgrade().map_or(0, |c| c.used()),
    )));
}

/// Answers the node service on the control socket once serving: `FD` gets our descriptor,
/// `METRICS` the text exposition of `metrics`.
fn serve_control(listener: std::os::unix::net::UnixListener, fuse_fd: OwnedFd, metrics: Registry) {
    use std::os::fd::AsRawFd;
    for conn in listener.incoming() {
        let Ok(conn) = conn else { continue };
        let _ = conn.set_read_timeout(Some(Duration::from_secs(5)));
        let _ = conn.set_write_timeout(Some(Duration::from_secs(5)));
        match handoff::recv(&conn) {
            Ok((line, _)) if line == "FD" => {
                tracing::info!("handing our FUSE descriptor to the node service");
                let _ = handoff::send(&conn, "OK", Some(fuse_fd.as_raw_fd()));
            }
            Ok((line, _)) if line == "PING" => {
                let _ = handoff::send(&conn, &format!("OK pid={}", std::process::id()), None);
            }
            Ok((line, _)) if line == "METRICS" => {
                let mut text = String::new();
                match prometheus_text::encode(&mut text, &metrics) {
                    Ok(()) => {
                        let _ = handoff::send_metrics(&conn, &text);
                    }
                    Err(e) => {
                        let _ = handoff::send(&conn, &format!("ERR cannot encode: {e}"), None);
                    }
                }
            }
            Ok((line, _)) => {
                let _ = handoff::send(&conn, &format!("ERR unknown request {line:?}"), None);
            }
            Err(_) => {}
        }
    }
}
