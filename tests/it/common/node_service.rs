//! A real `s3csi csi` process as kubelet and the external-provisioner see it: started on a
//! unix socket in a scratch directory (its state directory, pod directories and log below
//! it), the generated tonic clients connected over that socket, and the requests kubelet
//! sends. [`CsiServer::options`] sets what a test needs (mode, environment, extra flags,
//! metrics address, kubelet directory, log file name); dropping the server stops it and
//! clears up what a failed test left behind.

use super::{is_mountpoint, s3, s3csi_bin};
use s3csi::csi::pb::controller_client::ControllerClient;
use s3csi::csi::pb::identity_client::IdentityClient;
use s3csi::csi::pb::node_client::NodeClient;
use s3csi::csi::pb::{self, volume_capability as vc};
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};
use tonic::transport::Channel;

/// Which CSI services the process serves (`--mode`).
#[derive(Clone, Copy, Debug)]
pub enum Mode {
    Node,
    Controller,
    All,
}

impl Mode {
    fn as_str(self) -> &'static str {
        match self {
            Mode::Node => "node",
            Mode::Controller => "controller",
            Mode::All => "all",
        }
    }
}

/// How to start a [`CsiServer`]. The defaults: node mode, node id `test-node`, the test
/// process's environment (static test keys in AWS_*), the moto server as default S3
/// endpoint, no metrics, pods under the scratch dir, the log in `server.log`.
pub struct Options {
    dir: PathBuf,
    mode: Mode,
    node_id: String,
    bare_env: bool,
    env: Vec<(String, String)>,
    flags: Vec<String>,
    s3_flags: bool,
    metrics_address: Option<String>,
    kubelet_dir: bool,
    log_name: String,
    open_file_soft_limit: Option<u64>,
}

impl Options {
    pub fn mode(mut self, mode: Mode) -> Self {
        self.mode = mode;
        self
    }

    pub fn node_id(mut self, id: &str) -> Self {
        self.node_id = id.to_string();
        self
    }

    /// Nothing of the test process's environment but PATH, and no instance metadata: no
    /// AWS credentials anywhere. Variables from [`Options::env`] are still set.
    pub fn bare_env(mut self) -> Self {
        self.bare_env = true;
        self
    }

    /// An extra environment variable.
    pub fn env(mut self, key: &str, value: &str) -> Self {
        self.env.push((key.to_string(), value.to_string()));
        self
    }

    /// Extra command line flags, after the usual ones.
    pub fn flags(mut self, flags: &[&str]) -> Self {
        self.flags.extend(flags.iter().map(|f| f.to_string()));
        self
    }

    /// Without the `--s3-*` flags that point the default S3 endpoint at the moto server.
    pub fn without_s3_flags(mut self) -> Self {
        self.s3_flags = false;
        self
    }

    /// `--metrics-address ADDR`.
    pub fn metrics_address(mut self, addr: &str) -> Self {
        self.metrics_address = Some(addr.to_string());
        self
    }

    /// `--kubelet-dir DIR/kubelet`, with targets under it rather than under the scratch dir.
    pub fn kubelet_dir(mut self) -> Self {
        self.kubelet_dir = true;
        self
    }

    /// The file under the scratch dir that the server's stderr is appended to.
    pub fn log_name(mut self, name: &str) -> Self {
        self.log_name = name.to_string();
        self
    }

    /// Starts the process with this soft RLIMIT_NOFILE (the hard limit unchanged), as
    /// under a container runtime whose default soft limit is low.
    pub fn open_file_soft_limit(mut self, soft: u64) -> Self {
        self.open_file_soft_limit = Some(soft);
        self
    }

    fn socket(&self) -> PathBuf {
        self.dir.join("plugin").join("csi.sock")
    }

    fn log(&self) -> PathBuf {
        self.dir.join(&self.log_name)
    }

    fn kubelet(&self) -> Option<PathBuf> {
        self.kubelet_dir.then(|| self.dir.join("kubelet"))
    }

    /// The command [`Options::start`] spawns, stderr appended to the log, for a test that
    /// runs it itself (e.g. one that expects it to fail).
    pub fn command(&self) -> Command {
        let logf = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.log())
            .unwrap();
        let mut cmd = Command::new(s3csi_bin());
        cmd.arg("csi")
            .args(["--endpoint", &format!("unix://{}", self.socket().display())])
            .args(["--node-id", &self.node_id, "--mode", self.mode.as_str()])
            .arg("--state-dir")
            .arg(self.dir.join("state"));
        if let Some(kubelet) = self.kubelet() {
            cmd.arg("--kubelet-dir").arg(kubelet);
        }
        if self.s3_flags {
            cmd.args([
                "--s3-endpoint-url",
                &s3().endpoint,
                "--s3-region",
                "us-east-1",
            ])
            .arg("--s3-force-path-style");
        }
        if let Some(addr) = &self.metrics_address {
            cmd.args(["--metrics-address", addr]);
        }
        cmd.args(["--unmount-timeout", "10"])
            .args(&self.flags)
            .stdout(Stdio::null())
            .stderr(logf);
        if self.bare_env {
            cmd.env_clear()
                .env("PATH", std::env::var("PATH").unwrap_or_default())
                .env("AWS_EC2_METADATA_DISABLED", "true");
        }
        cmd.envs(self.env.iter().map(|(k, v)| (k, v)));
        if let Some(soft) = self.open_file_soft_limit {
            use std::os::unix::process::CommandExt;
            // SAFETY: only getrlimit/setrlimit between fork and exec.
            unsafe {
                cmd.pre_exec(move || {
                    let mut limit = libc::rlimit {
                        rlim_cur: 0,
                        rlim_max: 0,
                    };
                    if libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) != 0 {
                        return Err(std::io::Error::last_os_error());
                    }
                    limit.rlim_cur = soft.min(limit.rlim_max);
                    if libc::setrlimit(libc::RLIMIT_NOFILE, &limit) != 0 {
                        return Err(std::io::Error::last_os_error());
                    }
                    Ok(())
                });
            }
        }
        cmd
    }

    /// Starts the server and waits until its socket accepts connections.
    pub fn start(self) -> CsiServer {
        super::set_test_env();
        let kubelet = self.kubelet();
        if let Some(kubelet) = &kubelet {
            std::fs::create_dir_all(kubelet.join("pods")).unwrap();
        }
        let socket = self.socket();
        let log = self.log();
        let child = self.command().spawn().expect("start s3csi csi");
        let deadline = Instant::now() + Duration::from_secs(20);
        while std::os::unix::net::UnixStream::connect(&socket).is_err() {
            assert!(
                Instant::now() < deadline,
                "csi server did not start: {}",
                read(&log)
            );
            std::thread::sleep(Duration::from_millis(50));
        }
        CsiServer {
            child: Some(child),
            dir: self.dir,
            kubelet,
            socket,
            log,
        }
    }
}

/// A running `s3csi csi` process on a socket in a scratch dir.
pub struct CsiServer {
    child: Option<Child>,
    dir: PathBuf,
    kubelet: Option<PathBuf>,
    socket: PathBuf,
    log: PathBuf,
}

impl CsiServer {
    /// Options for a server in `dir` (its state, socket, log and pods go below it).
    pub fn options(dir: PathBuf) -> Options {
        Options {
            dir,
            mode: Mode::Node,
            node_id: "test-node".to_string(),
            bare_env: false,
            env: vec![],
            flags: vec![],
            s3_flags: true,
            metrics_address: None,
            kubelet_dir: false,
            log_name: "server.log".to_string(),
            open_file_soft_limit: None,
        }
    }

    /// A node service in `dir` with the default options.
    pub fn start_in(dir: PathBuf) -> CsiServer {
        Self::options(dir).start()
    }

    /// The scratch dir: `state/`, `plugin/csi.sock`, the log, and `pods/` unless
    /// [`Options::kubelet_dir`] moved them.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    pub fn socket(&self) -> &Path {
        &self.socket
    }

    /// `--kubelet-dir`, if [`Options::kubelet_dir`] set it.
    pub fn kubelet_dir(&self) -> Option<&Path> {
        self.kubelet.as_deref()
    }

    pub async fn channel(&self) -> Channel {
        tonic::transport::Endpoint::from_shared(format!("unix://{}", self.socket.display()))
            .unwrap()
            .connect()
            .await
            .expect("connect to the csi socket")
    }

    pub async fn identity(&self) -> IdentityClient<Channel> {
        IdentityClient::new(self.channel().await)
    }

    pub async fn node(&self) -> NodeClient<Channel> {
        NodeClient::new(self.channel().await)
    }

    pub async fn controller(&self) -> ControllerClient<Channel> {
        ControllerClient::new(self.channel().await)
    }

    /// A target path for a volume of `pod`, as kubelet makes it: its parent exists.
    pub fn target(&self, pod: &str) -> PathBuf {
        let root = self.kubelet.as_deref().unwrap_or(&self.dir);
        let parent = root.join("pods").join(pod).join("volumes");
        std::fs::create_dir_all(&parent).unwrap();
        parent.join("mount")
    }

    /// Mounter pids the node service recorded (0 for a mounter that runs in a Pod).
    pub fn mounter_pids(&self) -> Vec<u32> {
        mounter_pids(&self.dir)
    }

    /// The recorded mounter pid of the only mount.
    pub fn mounter_pid(&self) -> u32 {
        let pids = self.mounter_pids();
        assert_eq!(pids.len(), 1, "{pids:?}");
        pids[0]
    }

    /// The process id of the `s3csi csi` process.
    pub fn pid(&self) -> u32 {
        self.child.as_ref().expect("the server was killed").id()
    }

    /// Whether the process is still running (not exited, not killed with [`Self::kill9`]).
    pub fn is_running(&mut self) -> bool {
        match &mut self.child {
            Some(c) => c.try_wait().unwrap().is_none(),
            None => false,
        }
    }

    /// SIGKILL, as when the node service's container is killed.
    pub fn kill9(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    pub fn log_text(&self) -> String {
        read(&self.log)
    }
}

impl Drop for CsiServer {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            unsafe {
                libc::kill(c.id() as i32, libc::SIGTERM);
            }
            let deadline = Instant::now() + Duration::from_secs(10);
            while c.try_wait().ok().flatten().is_none() && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(20));
            }
            let _ = c.kill();
            let _ = c.wait();
        }
        cleanup(&self.dir);
    }
}

fn mounter_pids(dir: &Path) -> Vec<u32> {
    let mut pids = vec![];
    if let Ok(entries) = std::fs::read_dir(dir.join("state").join("mounts")) {
        for e in entries.flatten() {
            if let Ok(record) = s3csi::mounter::state::MountRecord::read(&e.path()) {
                pids.push(record.pid);
            }
        }
    }
    pids
}

/// Leftovers of a failed test: mounters recorded under `dir` (never pid 0, which a mounter
/// in a Pod records, nor anything that is not a single process id) and mounts under `dir`.
fn cleanup(dir: &Path) {
    for pid in mounter_pids(dir) {
        if let Ok(pid @ 1..) = i32::try_from(pid) {
            unsafe {
                libc::kill(pid, libc::SIGKILL);
            }
        }
    }
    for line in read(Path::new("/proc/self/mountinfo")).lines() {
        if let Some(mp) = line.split(' ').nth(4) {
            if Path::new(mp).starts_with(dir) {
                let _ = Command::new("umount").arg("-l").arg(mp).status();
            }
        }
    }
}

pub fn read(p: &Path) -> String {
    std::fs::read_to_string(p).unwrap_or_default()
}

/// A mount capability with these mount flags, access mode and volume mount group.
pub fn mount_cap(flags: &[&str], mode: vc::access_mode::Mode, group: &str) -> pb::VolumeCapability {
    pb::VolumeCapability {
        access_type: Some(vc::AccessType::Mount(vc::MountVolume {
            fs_type: String::new(),
            mount_flags: flags.iter().map(|s| s.to_string()).collect(),
            volume_mount_group: group.to_string(),
        })),
        access_mode: Some(vc::AccessMode { mode: mode as i32 }),
    }
}

/// Read-write for many nodes, no flags: what most tests mount with.
pub fn rw() -> pb::VolumeCapability {
    mount_cap(&[], vc::access_mode::Mode::MultiNodeMultiWriter, "")
}

pub fn publish_req(volume_id: &str, target: &Path) -> pb::NodePublishVolumeRequest {
    pb::NodePublishVolumeRequest {
        volume_id: volume_id.to_string(),
        target_path: target.to_string_lossy().to_string(),
        volume_capability: Some(rw()),
        volume_context: HashMap::from([
            ("endpointUrl".to_string(), s3().endpoint.clone()),
            ("region".to_string(), "us-east-1".to_string()),
            ("forcePathStyle".to_string(), "true".to_string()),
        ]),
        ..Default::default()
    }
}

pub fn stats_req(volume_id: &str, target: &Path) -> pb::NodeGetVolumeStatsRequest {
    pb::NodeGetVolumeStatsRequest {
        volume_id: volume_id.to_string(),
        volume_path: target.to_string_lossy().to_string(),
        staging_target_path: String::new(),
    }
}

/// Polls NodeGetVolumeStats every 10 ms until the condition is normal again and says the
/// mounter was replaced `n` times. Returns the abnormal messages seen on the way, and
/// checks the target stayed a mount point all along.
pub async fn wait_replaced(
    node: &mut NodeClient<Channel>,
    volume_id: &str,
    target: &Path,
    n: u32,
) -> Vec<String> {
    let deadline = Instant::now() + Duration::from_secs(20);
    let mut abnormal = vec![];
    loop {
        assert!(is_mountpoint(target), "the mount left mountinfo");
        let cond = node
            .node_get_volume_stats(stats_req(volume_id, target))
            .await
            .unwrap()
            .into_inner()
            .volume_condition
            .unwrap();
        if cond.abnormal {
            if abnormal.last() != Some(&cond.message) {
                abnormal.push(cond.message.clone());
            }
        } else if cond.message.contains(&format!("replaced {n} time")) {
            return abnormal;
        }
        assert!(
            Instant::now() < deadline,
            "not replaced in time; last condition {cond:?}"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}
