//! `s3csi mount`: parse options, check the bucket, mount, serve, and unmount cleanly.
//!
//! Like mount helpers, the command detaches into the background by default, but only
//! once the mount is live: the parent waits on a pipe for the child to report either
//! "mounted" or the one-line reason it could not mount, and exits 0 or 1 accordingly.

use super::fuse::FuseAdapter;
use super::{FsConfig, S3Fs};
use crate::config::{BucketSource, MountConfig, MountOptionError};
use crate::s3::aws::AwsClient;
use crate::s3::{ListRequest, ObjectClient, S3Error};
use clap::Args;
use std::io::{Read, Write};
use std::os::fd::OwnedFd;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

#[derive(Args, Debug)]
#[command(about = "Mount an S3 bucket (or a prefix of it) on a directory", after_help = MOUNT_HELP)]
pub struct MountArgs {
    /// BUCKET or BUCKET:PREFIX
    pub source: String,
    /// Existing empty directory to mount on
    pub mountpoint: PathBuf,
    /// S3 endpoint, for S3-compatible stores (e.g. http://127.0.0.1:9000)
    #[arg(long, value_name = "URL")]
    pub endpoint_url: Option<String>,
    /// AWS region (default: from the environment / profile, else us-east-1)
    #[arg(long)]
    pub region: Option<String>,
    /// Address the bucket as ENDPOINT/BUCKET instead of BUCKET.ENDPOINT
    #[arg(long)]
    pub force_path_style: bool,
    /// Mount only keys under this prefix (same as BUCKET:PREFIX)
    #[arg(long)]
    pub prefix: Option<String>,
    /// Refuse every change
    #[arg(long)]
    pub read_only: bool,
    /// Owner of all files (default: the mounting user)
    #[arg(long)]
    pub uid: Option<String>,
    /// Group of all files (default: the mounting user's group)
    #[arg(long)]
    pub gid: Option<String>,
    /// Permission bits of files, octal [default: 0644]
    #[arg(long, value_name = "MODE")]
    pub file_mode: Option<String>,
    /// Permission bits of directories, octal [default: 0755]
    #[arg(long, value_name = "MODE")]
    pub dir_mode: Option<String>,
    /// Let users other than the mounting one access the mount
    #[arg(long)]
    pub allow_other: bool,
    /// Let root access the mount too
    #[arg(long)]
    pub allow_root: bool,
    /// Stay in the foreground instead of detaching once mounted
    #[arg(long)]
    pub foreground: bool,
    /// How long metadata from S3 is trusted, e.g. 1s, 500ms, 5m [default: 1s]
    #[arg(long, value_name = "DURATION")]
    pub metadata_ttl: Option<String>,
    /// Multipart upload part size, 5MiB..5GiB; doubles every 1000 parts [default: 8MiB]
    #[arg(long, value_name = "SIZE")]
    pub part_size: Option<String>,
    /// Maximum parallel S3 requests per open file [default: 16]
    #[arg(long, value_name = "N")]
    pub max_concurrency: Option<String>,
    /// Read-ahead memory shared by all open files [default: 512MiB]
    #[arg(long, value_name = "SIZE")]
    pub max_prefetch_memory: Option<String>,
    /// Memory for upload parts in flight, shared by all files being written [default: 256MiB]
    #[arg(long, value_name = "SIZE")]
    pub max_upload_memory: Option<String>,
    /// Make close of a new empty file wait until the object is in S3
    #[arg(long)]
    pub sync_create: bool,
    /// Make every unlink wait until S3 has deleted the object
    #[arg(long)]
    pub sync_delete: bool,
    /// Let the kernel cache file data while a file is open (default: direct I/O, which
    /// copies reads and writes once, on Linux 6.6+; see README "Semantics")
    #[arg(long)]
    pub page_cache: bool,
    /// Log every request at debug level
    #[arg(long)]
    pub debug: bool,
    /// Write logs here (default: stderr; /dev/null once detached)
    #[arg(long, value_name = "PATH")]
    pub log_file: Option<PathBuf>,
    /// Options as mount(8) passes them: name[=value],... (same names as the flags)
    #[arg(short = 'o', value_name = "OPTS")]
    pub options: Vec<String>,
    /// Ignored; mount(8) passes it to helpers
    #[arg(short = 'n', hide = true)]
    pub no_mtab: bool,
    /// Ignored; mount(8) passes it to helpers
    #[arg(short = 's', hide = true)]
    pub sloppy: bool,
    /// Ignored; mount(8) passes it to helpers
    #[arg(short = 'v', hide = true)]
    pub verbose: bool,
    /// (CSI node service only) do not mount: serve the /dev/fuse descriptor the node
    /// service hands over on DIR/control.sock, and keep crash-recovery state in DIR
    #[arg(long, hide = true, value_name = "DIR")]
    pub handoff_dir: Option<PathBuf>,
    /// (CSI node service only) with --handoff-dir: take over from a mounter that died
    #[arg(long, hide = true, requires = "handoff_dir")]
    pub recover: bool,
}

const MOUNT_HELP: &str = "\
Credentials come only from the AWS SDK default chain: AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY,
AWS_PROFILE, web identity (IRSA), container credentials (EKS Pod Identity), or the instance
profile. They are never accepted on the command line.

As a mount(8) helper (install the binary as /sbin/mount.s3csi):
  mount -t s3csi my-bucket:some/prefix /mnt/data -o allow-other,uid=1000
  fstab: my-bucket /mnt/data s3csi _netdev,allow-other,region=eu-west-1 0 0";

impl MountArgs {
    /// Turns the command line into a validated [`MountConfig`]. `-o` options apply first,
    /// explicit flags override them.
    pub fn to_config(&self) -> Result<MountConfig, MountOptionError> {
        let mut cfg = MountConfig::new(BucketSource::parse(&self.source)?);
        for list in &self.options {
            cfg.apply_option_list(list)?;
        }
        let valued = [
            ("endpoint-url", &self.endpoint_url),
            ("region", &self.region),
            ("prefix", &self.prefix),
            ("uid", &self.uid),
            ("gid", &self.gid),
            ("file-mode", &self.file_mode),
            ("dir-mode", &self.dir_mode),
            ("metadata-ttl", &self.metadata_ttl),
            ("part-size", &self.part_size),
            ("max-concurrency", &self.max_concurrency),
            ("max-prefetch-memory", &self.max_prefetch_memory),
            ("max-upload-memory", &self.max_upload_memory),
        ];
        for (name, value) in valued {
            if let Some(v) = value {
                cfg.apply_option(name, Some(v))?;
            }
        }
        for (name, on) in [
            ("force-path-style", self.force_path_style),
            ("read-only", self.read_only),
            ("allow-other", self.allow_other),
            ("allow-root", self.allow_root),
            ("sync-create", self.sync_create),
            ("sync-delete", self.sync_delete),
            ("page-cache", self.page_cache),
            ("debug", self.debug),
        ] {
            if on {
                cfg.apply_option(name, None)?;
            }
        }
        Ok(cfg)
    }
}

pub fn fs_config(cfg: &MountConfig) -> FsConfig {
    FsConfig {
        prefix: cfg.source.prefix.clone(),
        uid: cfg.uid,
        gid: cfg.gid,
        file_mode: cfg.file_mode,
        dir_mode: cfg.dir_mode,
        metadata_ttl: cfg.metadata_ttl,
        read_only: cfg.read_only,
        part_size: cfg.part_size,
        max_concurrency: cfg.max_concurrency,
        max_prefetch_memory: cfg.max_prefetch_memory,
        max_upload_memory: cfg.max_upload_memory,
        sync_create: cfg.sync_create,
        sync_delete: cfg.sync_delete,
        page_cache: cfg.page_cache,
        ..FsConfig::default()
    }
}

/// Writes `data` to `path` so that a replacement mounter reads either all of it or the
/// previous file, never a torn one.
fn save_whole(path: &Path, data: &[u8]) -> std::io::Result<()> {
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, data)?;
    std::fs::rename(&tmp, path)
}

/// Is `path` a mount point right now (per /proc/self/mountinfo)?
pub fn is_mounted(path: &Path) -> bool {
    let target = path.to_string_lossy();
    std::fs::read_to_string("/proc/self/mountinfo")
        .unwrap_or_default()
        .lines()
        .filter_map(|l| l.split(' ').nth(4))
        .any(|mp| unescape_mountinfo(mp) == target)
}

fn unescape_mountinfo(s: &str) -> String {
    s.replace("\\040", " ")
        .replace("\\011", "\t")
        .replace("\\012", "\n")
        .replace("\\134", "\\")
}

fn check_mountpoint(path: &Path) -> Result<PathBuf, String> {
    let canonical =
        std::fs::canonicalize(path).map_err(|e| format!("mountpoint {}: {e}", path.display()))?;
    if !canonical.is_dir() {
        return Err(format!("mountpoint {} is not a directory", path.display()));
    }
    if is_mounted(&canonical) {
        return Err(format!("mountpoint {} is already mounted", path.display()));
    }
    Ok(canonical)
}

/// One clear line for the usual ways the first S3 request fails.
fn describe_access_error(cfg: &MountConfig, e: &S3Error) -> String {
    let bucket = &cfg.source.bucket;
    match e {
        S3Error::NoSuchBucket => format!("bucket {bucket:?} does not exist"),
        S3Error::AccessDenied(detail) => format!(
            "access to bucket {bucket:?} denied ({detail}); check the credentials from the AWS default chain"
        ),
        S3Error::Unreachable(detail) => format!(
            "cannot reach S3 endpoint {}: {detail}",
            cfg.endpoint.endpoint_url.as_deref().unwrap_or("(AWS default)")
        ),
        S3Error::Timeout => format!(
            "S3 endpoint {} did not answer in time",
            cfg.endpoint.endpoint_url.as_deref().unwrap_or("(AWS default)")
        ),
        other => format!("cannot access bucket {bucket:?}: {other}"),
    }
}

async fn check_bucket(client: &AwsClient, cfg: &MountConfig) -> Result<(), String> {
    let probe = client.list(ListRequest {
        prefix: &cfg.source.prefix,
        delimiter: Some("/"),
        continuation: None,
        max_keys: 1,
    });
    match tokio::time::timeout(Duration::from_secs(20), probe).await {
        Ok(Ok(_)) => Ok(()),
        Ok(Err(e)) => Err(describe_access_error(cfg, &e)),
        Err(_) => Err(describe_access_error(cfg, &S3Error::Timeout)),
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
fn detach() -> Result<Readiness, String> {
    let (read, write): (OwnedFd, OwnedFd) =
        nix::unistd::pipe().map_err(|e| format!("pipe: {e}"))?;
    // SAFETY: called before any thread exists (no runtime, no logger threads yet).
    match unsafe { nix::unistd::fork() }.map_err(|e| format!("fork: {e}"))? {
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
                record_failure(dir, &e.to_string());
            }
            return fail(&mut ready, e.to_string());
        }
    };
    if let Some(dir) = args.handoff_dir.clone() {
        return run_handoff(&args, &cfg, &dir);
    }
    let mountpoint = match check_mountpoint(&args.mountpoint) {
        Ok(p) => p,
        Err(e) => return fail(&mut ready, e),
    };
    if !args.foreground {
        match detach() {
            Ok(r) => ready = r,
            Err(e) => return fail(&mut ready, e),
        }
        redirect_stdio(args.log_file.as_deref());
    } else if let Some(p) = &args.log_file {
        redirect_stdio(Some(p));
        if let Ok(null) = std::fs::File::open("/dev/null") {
            let _ = nix::unistd::dup2_stdin(&null);
        }
    }
    crate::logging::init(if cfg.debug {
        "s3csi=debug,info"
    } else {
        "info"
    });
    let rt = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .thread_name("s3csi-io")
        .build()
    {
        Ok(rt) => rt,
        Err(e) => return fail(&mut ready, format!("cannot start runtime: {e}")),
    };
    let client = rt.block_on(AwsClient::new(&cfg.source.bucket, &cfg.endpoint));
    if let Err(msg) = rt.block_on(check_bucket(&client, &cfg)) {
        return fail(&mut ready, msg);
    }
    let fs = Arc::new(S3Fs::new(Arc::new(client), fs_config(&cfg)));
    let adapter = FuseAdapter::new(fs.clone(), rt.handle().clone());
    let mut options = vec![
        fuser::MountOption::FSName(format!("s3csi:{}", cfg.source.bucket)),
        fuser::MountOption::Subtype("s3csi".into()),
        fuser::MountOption::DefaultPermissions,
        fuser::MountOption::NoDev,
        fuser::MountOption::NoSuid,
    ];
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
    // The session thread ends when the kernel closes the connection.
    let _ = background.join();
    tracing::info!("unmounted");
    0
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

/// Leaves the reason we are giving up in the handoff directory: in pod mode our stderr
/// belongs to the container runtime, and the node service reports this to kubelet.
fn record_failure(dir: &Path, msg: &str) {
    use crate::mounter::pod::LAST_ERROR_FILE;
    if let Err(e) = std::fs::write(dir.join(LAST_ERROR_FILE), format!("{msg}\n")) {
        tracing::warn!(error = %e, "cannot record the failure in the handoff directory");
    }
}

/// `s3csi mount --handoff-dir DIR`: the CSI node service has mounted (or will mount) the
/// target itself and hands us the /dev/fuse descriptor over `DIR/control.sock`; see
/// `mounter::handoff`. We never mount or unmount; SIGTERM completes open uploads and exits,
/// the node service unmounts.
fn run_handoff(args: &MountArgs, cfg: &MountConfig, dir: &Path) -> i32 {
    use crate::mounter::handoff;
    use std::os::unix::net::UnixListener;
    if let Some(p) = &args.log_file {
        redirect_stdio(Some(p));
    }
    if let Ok(null) = std::fs::File::open("/dev/null") {
        let _ = nix::unistd::dup2_stdin(&null);
    }
    crate::logging::init(if cfg.debug {
        "s3csi=debug,info"
    } else {
        "info"
    });
    let fail = |msg: String| -> i32 {
        tracing::error!("{msg}");
        eprintln!("s3csi: {msg}");
        record_failure(dir, &msg);
        1
    };
    let rt = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .thread_name("s3csi-io")
        .build()
    {
        Ok(rt) => rt,
        Err(e) => return fail(format!("cannot start runtime: {e}")),
    };
    let client = rt.block_on(AwsClient::new(&cfg.source.bucket, &cfg.endpoint));
    if !args.recover {
        // A replacement serves even while S3 is unreachable: requests fail with EIO
        // instead of hanging until S3 answers.
        if let Err(msg) = rt.block_on(check_bucket(&client, cfg)) {
            return fail(msg);
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
    let fs = Arc::new(S3Fs::new(Arc::new(client), fs_config(cfg)));
    let background = match serve_descriptor(&fs, cfg, dir, &fuse_fd, args.recover, &rt) {
        Ok(b) => b,
        Err(msg) => {
            let _ = handoff::send(&conn, &format!("ERR {msg}"), None);
            return fail(msg);
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
        .spawn(move || serve_control(listener, fuse_fd))
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

/// Answers the node service on the control socket once serving: `FD` gets our descriptor.
fn serve_control(listener: std::os::unix::net::UnixListener, fuse_fd: OwnedFd) {
    use crate::mounter::handoff;
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
            Ok((line, _)) => {
                let _ = handoff::send(&conn, &format!("ERR unknown request {line:?}"), None);
            }
            Err(_) => {}
        }
    }
}

/// Sets up the FUSE session on a descriptor that is already mounted.
///
/// fuser's `Session::from_fd` insists on reading FUSE_INIT first, but the kernel sends
/// INIT once per connection: a replacement never sees it. So the session is created on one
/// end of a socket pair into which we write INIT ourselves — the real one (read from the
/// descriptor and saved to `DIR/init.bin`) for the first mounter, whose reply we forward
/// to the kernel; the saved one for a replacement, whose reply the kernel already had from
/// the first. Then the session's descriptor number is pointed at /dev/fuse with dup3
/// before its loop starts, and a replacement asks the kernel to resend what the dead
/// mounter left unanswered.
fn serve_descriptor(
    fs: &Arc<S3Fs>,
    cfg: &MountConfig,
    dir: &Path,
    fuse_fd: &OwnedFd,
    recover: bool,
    rt: &tokio::runtime::Runtime,
) -> Result<fuser::BackgroundSession, String> {
    use super::inode_log::{self, InodeLog};
    use crate::mounter::handoff;
    use nix::sys::socket::{socketpair, AddressFamily, SockFlag, SockType};
    use std::os::fd::{AsFd, AsRawFd};

    let root_key = fs.config().prefix.clone();
    let log_path = dir.join(handoff::INODE_LOG);
    let restored = if recover {
        inode_log::load(&log_path, &root_key)
            .map_err(|e| format!("cannot read {}: {e}", log_path.display()))?
    } else {
        inode_log::Loaded::default()
    };
    let log = InodeLog::create(&log_path, &root_key, &[])
        .map_err(|e| format!("cannot write {}: {e}", log_path.display()))?;
    let first_fh = if recover {
        // Above every handle an earlier mounter of this volume can have handed out.
        let ms = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_millis() as u64)
            .unwrap_or(1);
        ms << 20
    } else {
        1
    };
    tracing::info!(
        restored = restored.bindings.len(),
        first_fh,
        "inode bindings persisted in {}",
        log_path.display()
    );
    fs.enable_recovery(restored, log, first_fh);

    let init_path = dir.join(handoff::INIT_FILE);
    let init = if recover {
        std::fs::read(&init_path).map_err(|e| {
            format!(
                "cannot read the saved FUSE_INIT {}: {e}",
                init_path.display()
            )
        })?
    } else {
        // The first request on a fresh connection is INIT; /dev/fuse wants a buffer that
        // can take the largest write request.
        let mut buf = vec![0u8; (16 << 20) + 8192];
        let n =
            nix::unistd::read(fuse_fd, &mut buf).map_err(|e| format!("reading FUSE_INIT: {e}"))?;
        buf.truncate(n);
        save_whole(&init_path, &buf).map_err(|e| format!("cannot save FUSE_INIT: {e}"))?;
        buf
    };
    let (ours, theirs) = socketpair(
        AddressFamily::Unix,
        SockType::SeqPacket,
        None,
        SockFlag::SOCK_CLOEXEC,
    )
    .map_err(|e| format!("socketpair: {e}"))?;
    nix::unistd::write(&ours, &init).map_err(|e| format!("replaying FUSE_INIT: {e}"))?;

    let reply_path = dir.join(handoff::INIT_REPLY_FILE);
    let mut adapter = FuseAdapter::new(fs.clone(), rt.handle().clone());
    if recover {
        // A mounter from before direct I/O saved no reply: its connection has no
        // FUSE_DIRECT_IO_ALLOW_MMAP, so direct I/O would break MAP_SHARED there.
        let negotiated = std::fs::read(&reply_path)
            .map(|r| super::fuse::init_reply_allows_direct_io_mmap(&r))
            .unwrap_or(false);
        adapter = adapter.taking_over(negotiated);
    }
    let mut fuse_cfg = fuser::Config::default();
    // The kernel enforces access (allow_other or only root, set by the node service).
    fuse_cfg.acl = if cfg.allow_root && !cfg.allow_other {
        fuser::SessionACL::RootAndOwner
    } else {
        fuser::SessionACL::All
    };
    let acl = fuse_cfg.acl;
    let session = fuser::Session::from_fd(adapter, theirs, acl, fuse_cfg)
        .map_err(|e| format!("FUSE handshake: {e}"))?;
    let mut reply = vec![0u8; 64 * 1024];
    let n = nix::unistd::read(&ours, &mut reply).map_err(|e| format!("FUSE_INIT reply: {e}"))?;
    if !recover {
        save_whole(&reply_path, &reply[..n])
            .map_err(|e| format!("cannot save the FUSE_INIT reply: {e}"))?;
        nix::unistd::write(fuse_fd, &reply[..n])
            .map_err(|e| format!("answering FUSE_INIT: {e}"))?;
    }
    // SAFETY: the session's descriptor is not in use by any thread yet; dup3 atomically
    // makes that number refer to /dev/fuse (closing the socket end it referred to), and
    // the session keeps owning (and eventually closing) the number.
    let raw = session.as_fd().as_raw_fd();
    if unsafe { libc::dup3(fuse_fd.as_raw_fd(), raw, libc::O_CLOEXEC) } < 0 {
        return Err(format!("dup3: {}", std::io::Error::last_os_error()));
    }
    drop(ours);
    let background = session
        .spawn()
        .map_err(|e| format!("cannot start the FUSE session: {e}"))?;
    if recover {
        match handoff::notify_resend(fuse_fd.as_fd()) {
            Ok(()) => tracing::info!(
                "asked the kernel to resend requests the dead mounter left unanswered"
            ),
            Err(e) => {
                tracing::warn!(error = %e, "cannot ask the kernel to resend unanswered requests (Linux < 6.9?); those calls stay blocked")
            }
        }
    }
    Ok(background)
}
