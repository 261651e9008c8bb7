//! Test harness: a real S3-compatible server (moto) on 127.0.0.1, started once per test
//! binary, plus helpers to create buckets and run real `s3csi mount` processes.
#![allow(dead_code)]

pub mod crash;
pub mod fake_kube;
pub mod fault_proxy;
pub mod node_service;

use s3csi::{config::Endpoint, s3::aws::AwsClient};
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

pub const ACCESS_KEY: &str = "testing-access-key";
pub const SECRET_KEY: &str = "testing-secret-key";

pub struct S3Server {
    pub endpoint: String,
    _child: Child,
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// `moto_server` on 127.0.0.1:`port` (the binary from $MOTO_SERVER if set), killed when
/// the thread that spawns it exits.
fn moto_command(port: u16) -> (String, Command) {
    let bin = std::env::var("MOTO_SERVER").unwrap_or_else(|_| "moto_server".into());
    let mut cmd = Command::new(&bin);
    cmd.args(["-H", "127.0.0.1", "-p", &port.to_string()])
        .stdout(Stdio::null())
        .stderr(Stdio::null());
    unsafe {
        use std::os::unix::process::CommandExt;
        cmd.pre_exec(|| {
            libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
            Ok(())
        });
    }
    (bin, cmd)
}

fn wait_for_moto(port: u16) {
    let deadline = Instant::now() + Duration::from_secs(30);
    while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
        assert!(Instant::now() < deadline, "moto_server did not start");
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// The shared moto server, started on first use. Killed with the test process
/// (moto_server is spawned with a parent-death signal).
pub fn s3() -> &'static S3Server {
    static SERVER: OnceLock<S3Server> = OnceLock::new();
    SERVER.get_or_init(|| {
        let port = free_port();
        let (bin, mut cmd) = moto_command(port);
        // PR_SET_PDEATHSIG fires when the spawning *thread* exits, so spawn from a
        // thread that lives as long as the test process.
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let child = cmd.spawn();
            let failed = child.is_err();
            let _ = tx.send(child);
            if !failed {
                loop {
                    std::thread::park();
                }
            }
        });
        let child = rx
            .recv()
            .unwrap()
            .unwrap_or_else(|e| panic!("cannot start {bin} (pip install 'moto[server]'): {e}"));
        wait_for_moto(port);
        S3Server {
            endpoint: format!("http://127.0.0.1:{port}"),
            _child: child,
        }
    })
}

/// A moto server of a test's own (e.g. one that enforces IAM authentication), killed on
/// drop or when the test thread that started it exits.
pub struct OwnMoto {
    pub endpoint: String,
    child: Child,
}

impl OwnMoto {
    pub fn start(env: &[(&str, &str)]) -> OwnMoto {
        let port = free_port();
        let (bin, mut cmd) = moto_command(port);
        let child = cmd
            .envs(env.iter().copied())
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start {bin} (pip install 'moto[server]'): {e}"));
        wait_for_moto(port);
        OwnMoto {
            endpoint: format!("http://127.0.0.1:{port}"),
            child,
        }
    }
}

impl Drop for OwnMoto {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Environment every S3 client in tests uses: static test keys, a region.
pub fn set_test_env() {
    static ONCE: OnceLock<()> = OnceLock::new();
    ONCE.get_or_init(|| {
        std::env::set_var("AWS_ACCESS_KEY_ID", ACCESS_KEY);
        std::env::set_var("AWS_SECRET_ACCESS_KEY", SECRET_KEY);
        std::env::set_var("AWS_REGION", "us-east-1");
        std::env::remove_var("AWS_PROFILE");
        std::env::set_var("AWS_EC2_METADATA_DISABLED", "true");
    });
}

pub fn endpoint() -> Endpoint {
    Endpoint {
        region: Some("us-east-1".into()),
        endpoint_url: Some(s3().endpoint.clone()),
        force_path_style: true,
    }
}

pub fn runtime() -> &'static tokio::runtime::Runtime {
    static RT: OnceLock<tokio::runtime::Runtime> = OnceLock::new();
    RT.get_or_init(|| tokio::runtime::Runtime::new().unwrap())
}

/// A client for `bucket` talking to the test server.
pub fn client(bucket: &str) -> AwsClient {
    set_test_env();
    runtime().block_on(AwsClient::new(bucket, &endpoint()))
}

/// Creates a fresh, uniquely named bucket.
pub fn new_bucket(hint: &str) -> String {
    static N: AtomicU32 = AtomicU32::new(0);
    let name = format!(
        "{}-{}-{}",
        hint.to_ascii_lowercase().replace('_', "-"),
        std::process::id(),
        N.fetch_add(1, Ordering::SeqCst)
    );
    let ep = s3().endpoint.clone();
    // Bucket creation is outside the ObjectClient seam (the file system never creates
    // buckets), so use a plain HTTP PUT, which moto accepts unsigned.
    let status = Command::new("curl")
        .args(["-sf", "-X", "PUT", &format!("{ep}/{name}")])
        .status()
        .expect("curl");
    assert!(status.success(), "create bucket {name}");
    name
}

/// The embedded S3 server on a free loopback port, serving a fresh scratch directory
/// with one bucket, `bucket`. Mounts sign for it with [`EMBEDDED_KEYS`].
pub async fn start_embedded_server(bucket: &str) -> s3csi::s3server::RunningServer {
    use s3csi::s3server::{self, ServerConfig, DEMO_ACCESS_KEY, DEMO_SECRET_KEY};
    let server = s3server::start(ServerConfig {
        listen: "127.0.0.1:0".parse().unwrap(),
        dir: scratch_dir(&format!("{bucket}-s3server")),
        access_key: DEMO_ACCESS_KEY.into(),
        secret_key: DEMO_SECRET_KEY.into(),
    })
    .await
    .expect("start the embedded S3 server");
    server.store.create_bucket(bucket).expect("create bucket");
    server
}

/// The environment a mount of the embedded server signs with.
pub const EMBEDDED_KEYS: [(&str, &str); 2] = [
    ("AWS_ACCESS_KEY_ID", s3csi::s3server::DEMO_ACCESS_KEY),
    ("AWS_SECRET_ACCESS_KEY", s3csi::s3server::DEMO_SECRET_KEY),
];

pub fn s3csi_bin() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_s3csi"))
}

pub fn scratch_dir(name: &str) -> PathBuf {
    static N: AtomicU32 = AtomicU32::new(0);
    let dir = std::env::temp_dir().join(format!(
        "s3csi-test-{}-{}-{}",
        name,
        std::process::id(),
        N.fetch_add(1, Ordering::SeqCst)
    ));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

pub fn is_mountpoint(path: &Path) -> bool {
    let target = path.to_string_lossy().to_string();
    std::fs::read_to_string("/proc/self/mountinfo")
        .unwrap_or_default()
        .lines()
        .any(|l| l.split(' ').nth(4) == Some(target.as_str()))
}

/// A running `s3csi mount --foreground` process; unmounts and reaps on drop.
pub struct Mount {
    pub dir: PathBuf,
    pub bucket: String,
    pub child: Option<Child>,
    pub log: PathBuf,
}

impl Mount {
    pub fn start(bucket: &str, extra: &[&str]) -> Mount {
        Self::try_start(bucket, extra).unwrap_or_else(|e| panic!("{e}"))
    }

    pub fn try_start(bucket: &str, extra: &[&str]) -> Result<Mount, String> {
        Self::try_start_with(&s3().endpoint, bucket, extra, &[])
    }

    /// A mount talking to `endpoint` (e.g. a fault proxy), with extra environment.
    pub fn try_start_with(
        endpoint: &str,
        bucket: &str,
        extra: &[&str],
        env: &[(&str, &str)],
    ) -> Result<Mount, String> {
        Self::try_start_env(endpoint, bucket, extra, env, &[])
    }

    /// Like [`Mount::try_start_with`], and without the inherited variables `remove` (e.g.
    /// the static test keys, so that the mount takes its credentials from web identity).
    pub fn try_start_env(
        endpoint: &str,
        bucket: &str,
        extra: &[&str],
        env: &[(&str, &str)],
        remove: &[&str],
    ) -> Result<Mount, String> {
        Self::try_start_wrapped(&[], endpoint, bucket, extra, env, remove)
    }

    /// A mount in a pid namespace of its own, as the node plugin's container is: the
    /// processes that use the mount are in none it can see, so FUSE reports pid 0 for them.
    pub fn start_in_own_pid_namespace(bucket: &str, extra: &[&str]) -> Mount {
        Self::try_start_wrapped(
            &["unshare", "--pid", "--fork", "--kill-child=SIGTERM"],
            &s3().endpoint,
            bucket,
            extra,
            &[],
            &[],
        )
        .unwrap_or_else(|e| panic!("{e}"))
    }

    fn try_start_wrapped(
        wrapper: &[&str],
        endpoint: &str,
        bucket: &str,
        extra: &[&str],
        env: &[(&str, &str)],
        remove: &[&str],
    ) -> Result<Mount, String> {
        set_test_env();
        let dir = scratch_dir("mnt");
        let log = dir.with_extension("log");
        let logf = std::fs::File::create(&log).unwrap();
        let mut cmd = match wrapper.split_first() {
            Some((program, args)) => {
                let mut c = Command::new(program);
                c.args(args).arg(s3csi_bin());
                c
            }
            None => Command::new(s3csi_bin()),
        };
        cmd.arg("mount")
            .arg("--foreground")
            .args(["--endpoint-url", endpoint, "--force-path-style"])
            .args(["--region", "us-east-1"])
            .args(extra)
            .arg(bucket)
            .arg(&dir)
            .envs(env.iter().copied())
            .stdout(Stdio::null())
            .stderr(logf);
        for var in remove {
            cmd.env_remove(var);
        }
        let mut child = cmd.spawn().map_err(|e| e.to_string())?;
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            if is_mountpoint(&dir) {
                break;
            }
            if let Ok(Some(status)) = child.try_wait() {
                return Err(format!(
                    "mount exited with {status}: {}",
                    std::fs::read_to_string(&log).unwrap_or_default()
                ));
            }
            if Instant::now() > deadline {
                let _ = child.kill();
                return Err("mount did not appear within 30s".into());
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        Ok(Mount {
            dir,
            bucket: bucket.to_string(),
            child: Some(child),
            log,
        })
    }

    pub fn path(&self, rel: &str) -> PathBuf {
        self.dir.join(rel)
    }

    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// Sends SIGTERM and waits for a clean exit (flushes uploads, unmounts). The signal
    /// goes to the mount's children too: under a wrapper (unshare) they are the mount.
    pub fn stop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let pid = child.id();
            let children = std::fs::read_to_string(format!("/proc/{pid}/task/{pid}/children"))
                .unwrap_or_default();
            for p in children
                .split_whitespace()
                .filter_map(|p| p.parse::<i32>().ok())
            {
                unsafe {
                    libc::kill(p, libc::SIGTERM);
                }
            }
            unsafe {
                libc::kill(pid as i32, libc::SIGTERM);
            }
            let deadline = Instant::now() + Duration::from_secs(30);
            while child.try_wait().ok().flatten().is_none() && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(50));
            }
            let _ = child.kill();
            let _ = child.wait();
        }
        if is_mountpoint(&self.dir) {
            let _ = Command::new("umount").arg("-l").arg(&self.dir).status();
        }
    }
}

impl Drop for Mount {
    fn drop(&mut self) {
        self.stop();
        let _ = std::fs::remove_dir(&self.dir);
    }
}

/// A small seeded PRNG (splitmix64) for randomized tests: the seed is printed, so a
/// failure can be replayed with `S3CSI_SEED=N`.
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Rng {
        Rng(seed)
    }

    /// `S3CSI_SEED` if set, else `default`; printed either way.
    pub fn from_env(test: &str, default: u64) -> Rng {
        let seed = std::env::var("S3CSI_SEED")
            .ok()
            .and_then(|s| s.parse().ok())
            .unwrap_or(default);
        eprintln!("{test}: seed {seed} (replay with S3CSI_SEED={seed})");
        Rng(seed)
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in `0..n` (n > 0).
    pub fn below(&mut self, n: u64) -> u64 {
        self.next_u64() % n.max(1)
    }

    pub fn range(&mut self, lo: u64, hi: u64) -> u64 {
        lo + self.below(hi - lo + 1)
    }

    pub fn chance(&mut self, p: f64) -> bool {
        ((self.next_u64() >> 11) as f64 / (1u64 << 53) as f64) < p
    }

    pub fn pick<'a, T>(&mut self, items: &'a [T]) -> &'a T {
        &items[self.below(items.len() as u64) as usize]
    }

    pub fn bytes(&mut self, len: usize) -> Vec<u8> {
        let mut out = Vec::with_capacity(len + 8);
        while out.len() < len {
            out.extend_from_slice(&self.next_u64().to_le_bytes());
        }
        out.truncate(len);
        out
    }
}

/// Whether the long variants of randomized tests run (`S3CSI_FULL=1`).
pub fn full_run() -> bool {
    std::env::var("S3CSI_FULL").is_ok_and(|v| v != "0" && !v.is_empty())
}

/// close(2) with its result: `File`'s drop ignores errors, and a FUSE file system reports
/// upload failures exactly there.
pub fn close_checked(f: std::fs::File) -> std::io::Result<()> {
    use std::os::fd::IntoRawFd;
    let fd = f.into_raw_fd();
    if unsafe { libc::close(fd) } == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}

/// The whole object, straight from the S3 server (not through any proxy), or None.
pub fn s3_get(bucket: &str, key: &str) -> Option<Vec<u8>> {
    use s3csi::s3::ObjectClient;
    let c = client(bucket);
    let meta = runtime().block_on(c.head_object(key)).ok()?;
    // Deleted between the two requests (a DELETE sent in the background): gone.
    match runtime().block_on(c.get_range(key, 0, meta.size)) {
        Err(s3csi::s3::S3Error::NotFound) => None,
        res => Some(res.unwrap().to_vec()),
    }
}

/// Every key in the bucket under `prefix`, straight from the S3 server.
pub fn s3_keys(bucket: &str, prefix: &str) -> Vec<String> {
    use s3csi::s3::{ListRequest, ObjectClient};
    let c = client(bucket);
    let mut out = Vec::new();
    let mut token: Option<String> = None;
    loop {
        let page = runtime()
            .block_on(c.list(ListRequest {
                prefix,
                delimiter: None,
                continuation: token.as_deref(),
                start_after: None,
                max_keys: 1000,
            }))
            .unwrap();
        out.extend(page.objects.into_iter().map(|o| o.key));
        token = page.next_token;
        if token.is_none() {
            return out;
        }
    }
}

/// Multipart uploads still in progress in `bucket` (key, upload id): what would go on
/// billing. Uses aws-sdk-s3 directly: the file system never lists uploads.
pub fn open_multipart_uploads(bucket: &str) -> Vec<(String, String)> {
    set_test_env();
    runtime().block_on(async {
        let shared = aws_config::defaults(aws_config::BehaviorVersion::latest())
            .region(aws_config::Region::new("us-east-1"))
            .load()
            .await;
        let conf = aws_sdk_s3::config::Builder::from(&shared)
            .endpoint_url(&s3().endpoint)
            .force_path_style(true)
            .build();
        let c = aws_sdk_s3::Client::from_conf(conf);
        let out = c
            .list_multipart_uploads()
            .bucket(bucket)
            .send()
            .await
            .expect("ListMultipartUploads");
        out.uploads()
            .iter()
            .map(|u| {
                (
                    u.key().unwrap_or_default().to_string(),
                    u.upload_id().unwrap_or_default().to_string(),
                )
            })
            .collect()
    })
}

/// Peak resident memory (VmHWM) and current (VmRSS) of a process, in KiB.
pub fn memory_kib(pid: u32) -> (u64, u64) {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    let field = |name: &str| {
        status
            .lines()
            .find(|l| l.starts_with(name))
            .and_then(|l| l.split_whitespace().nth(1))
            .and_then(|v| v.parse().ok())
            .unwrap_or(0)
    };
    (field("VmHWM:"), field("VmRSS:"))
}
