//! The CSI node service as kubelet sees it: a real `s3csi csi --mode node` process on a
//! unix socket, with its state directory and pod directories under a scratch directory,
//! and the requests kubelet sends it.

use super::{is_mountpoint, s3, s3csi_bin};
use s3csi::csi::pb::node_client::NodeClient;
use s3csi::csi::pb::{self, volume_capability as vc};
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};
use tonic::transport::Channel;

pub struct Server {
    child: Option<Child>,
    dir: PathBuf,
    socket: PathBuf,
    log: PathBuf,
}

impl Server {
    pub fn start_in(dir: PathBuf) -> Server {
        Self::start_with(dir, &[], &[])
    }

    /// With extra flags and environment variables.
    pub fn start_with(dir: PathBuf, extra: &[&str], env: &[(&str, &str)]) -> Server {
        super::set_test_env();
        let socket = dir.join("plugin").join("csi.sock");
        let log = dir.join("server.log");
        let logf = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&log)
            .unwrap();
        let child = Command::new(s3csi_bin())
            .arg("csi")
            .args(["--endpoint", &format!("unix://{}", socket.display())])
            .args(["--node-id", "test-node", "--mode", "node"])
            .arg("--state-dir")
            .arg(dir.join("state"))
            .args([
                "--s3-endpoint-url",
                &s3().endpoint,
                "--s3-region",
                "us-east-1",
            ])
            .arg("--s3-force-path-style")
            .args(["--unmount-timeout", "10"])
            .args(extra)
            .envs(env.iter().copied())
            .stdout(Stdio::null())
            .stderr(logf)
            .spawn()
            .expect("start s3csi csi");
        let deadline = Instant::now() + Duration::from_secs(20);
        while std::os::unix::net::UnixStream::connect(&socket).is_err() {
            assert!(
                Instant::now() < deadline,
                "csi server did not start: {}",
                read(&log)
            );
            std::thread::sleep(Duration::from_millis(50));
        }
        Server {
            child: Some(child),
            dir,
            socket,
            log,
        }
    }

    pub async fn node(&self) -> NodeClient<Channel> {
        let ch =
            tonic::transport::Endpoint::from_shared(format!("unix://{}", self.socket.display()))
                .unwrap()
                .connect()
                .await
                .expect("connect to the csi socket");
        NodeClient::new(ch)
    }

    pub fn target(&self, pod: &str) -> PathBuf {
        let parent = self.dir.join("pods").join(pod).join("volumes");
        std::fs::create_dir_all(&parent).unwrap();
        parent.join("mount")
    }

    /// The recorded mounter pid of the only mount.
    pub fn mounter_pid(&self) -> u32 {
        let dir = self.dir.join("state").join("mounts");
        let mut pids = vec![];
        for e in std::fs::read_dir(dir).unwrap().flatten() {
            let text = read(&e.path());
            pids.extend(
                text.lines()
                    .filter_map(|l| l.strip_prefix("pid="))
                    .filter_map(|p| p.parse::<u32>().ok()),
            );
        }
        assert_eq!(pids.len(), 1, "{pids:?}");
        pids[0]
    }

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

impl Drop for Server {
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
    }
}

/// Leftovers of a failed test: mounters and mounts under `dir`.
pub fn cleanup(dir: &Path) {
    if let Ok(entries) = std::fs::read_dir(dir.join("state").join("mounts")) {
        for e in entries.flatten() {
            for pid in read(&e.path())
                .lines()
                .filter_map(|l| l.strip_prefix("pid="))
                .filter_map(|p| p.parse::<i32>().ok())
                .filter(|p| *p > 0)
            {
                unsafe {
                    libc::kill(pid, libc::SIGKILL);
                }
            }
        }
    }
    let prefix = dir.to_string_lossy().to_string();
    for line in read(Path::new("/proc/self/mountinfo")).lines() {
        if let Some(mp) = line.split(' ').nth(4) {
            if mp.starts_with(&prefix) {
                let _ = Command::new("umount").arg("-l").arg(mp).status();
            }
        }
    }
}

pub fn read(p: &Path) -> String {
    std::fs::read_to_string(p).unwrap_or_default()
}

pub fn publish_req(volume_id: &str, target: &Path) -> pb::NodePublishVolumeRequest {
    pb::NodePublishVolumeRequest {
        volume_id: volume_id.to_string(),
        target_path: target.to_string_lossy().to_string(),
        volume_capability: Some(pb::VolumeCapability {
            access_type: Some(vc::AccessType::Mount(vc::MountVolume::default())),
            access_mode: Some(vc::AccessMode {
                mode: vc::access_mode::Mode::MultiNodeMultiWriter as i32,
            }),
        }),
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
