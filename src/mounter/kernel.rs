//! The kernel seam: the mount syscalls the node service makes, behind one trait.
//!
//! [`RealKernel`] calls `mount`, `umount2`, `statvfs` and reads `/proc/self/mountinfo`;
//! [`FakeKernel`] keeps a mount table in memory, so that everything above it (the mount
//! manager, the supervisor, recovery) is unit-tested without root.

use super::mountinfo::{self, MountEntry};
use std::collections::HashMap;
use std::os::fd::{AsRawFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::Duration;

/// How the node service mounts a volume.
#[derive(Debug, Clone, Default)]
pub struct KernelMount {
    /// Shown as the mount's source, e.g. `s3csi:bucket`.
    pub fsname: String,
    pub read_only: bool,
    /// `allow_other` in the kernel (the mount options allow-other or allow-root).
    pub allow_other: bool,
    /// No `default_permissions`: the kernel checks no permissions.
    pub no_default_permissions: bool,
}

/// Why a mounted file system gave no usage figures.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ProbeError {
    #[error("{0}: transport endpoint is not connected (the mounter is gone)")]
    NotConnected(PathBuf),
    #[error("{0}: the file system did not answer within {1:?}")]
    NoAnswer(PathBuf, Duration),
    #[error("{0}: {1}")]
    Os(PathBuf, nix::errno::Errno),
}

/// What `statvfs` says, in the units CSI reports.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Usage {
    pub total_bytes: u64,
    pub free_bytes: u64,
    pub available_bytes: u64,
    pub total_inodes: u64,
    pub free_inodes: u64,
}

/// How long a probe of a mount (statvfs) waits for an answer.
pub const PROBE_TIMEOUT: Duration = Duration::from_secs(5);

pub trait Kernel: Send + Sync + 'static {
    /// Opens `/dev/fuse` and mounts a `fuse.s3csi` file system served through it on
    /// `target`. The first request on the descriptor is the kernel's FUSE_INIT.
    fn mount_fuse(&self, target: &Path, how: &KernelMount) -> std::io::Result<OwnedFd>;
    /// Bind-mounts the mount on `from` onto `to` (the same file system, the same FUSE
    /// connection: one mounter serves both).
    fn bind(&self, from: &Path, to: &Path) -> std::io::Result<()>;
    /// `umount2(target)`, with `MNT_DETACH` when `lazy`.
    fn unmount(&self, target: &Path, lazy: bool) -> std::io::Result<()>;
    /// The mount table, in mount order.
    fn mounts(&self) -> Vec<MountEntry>;
    /// statvfs that gives up after `timeout`: on a mount whose mounter died while we hold
    /// its descriptor, the call waits until a replacement answers.
    fn usage_within(&self, target: &Path, timeout: Duration) -> Result<Usage, ProbeError>;

    /// The topmost mount on `target`, if any.
    fn find(&self, target: &Path) -> Option<MountEntry> {
        mountinfo::topmost(&self.mounts(), target).cloned()
    }

    /// `Some(reason)` when the mount on `target` does not answer (ENOTCONN and friends).
    fn probe(&self, target: &Path) -> Option<String> {
        self.usage_within(target, PROBE_TIMEOUT)
            .err()
            .map(|e| e.to_string())
    }
}

/// The machine's kernel. Needs CAP_SYS_ADMIN to mount.
pub struct RealKernel;

impl Kernel for RealKernel {
    fn mount_fuse(&self, target: &Path, m: &KernelMount) -> std::io::Result<OwnedFd> {
        use nix::mount::{mount, MsFlags};
        let dev = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open("/dev/fuse")?;
        let fd: OwnedFd = dev.into();
        let mut data = format!("fd={},rootmode=40000,user_id=0,group_id=0", fd.as_raw_fd());
        if !m.no_default_permissions {
            data.push_str(",default_permissions");
        }
        if m.allow_other {
            data.push_str(",allow_other");
        }
        let mut flags = MsFlags::MS_NOSUID | MsFlags::MS_NODEV;
        if m.read_only {
            flags |= MsFlags::MS_RDONLY;
        }
        let fsname = if m.fsname.is_empty() {
            "s3csi"
        } else {
            m.fsname.as_str()
        };
        mount(
            Some(fsname),
            target,
            Some("fuse.s3csi"),
            flags,
            Some(data.as_str()),
        )
        .map_err(std::io::Error::from)?;
        Ok(fd)
    }

    fn bind(&self, from: &Path, to: &Path) -> std::io::Result<()> {
        use nix::mount::{mount, MsFlags};
        mount(Some(from), to, None::<&str>, MsFlags::MS_BIND, None::<&str>)
            .map_err(std::io::Error::from)
    }

    fn unmount(&self, target: &Path, lazy: bool) -> std::io::Result<()> {
        use nix::mount::{umount2, MntFlags};
        let flags = if lazy {
            MntFlags::MNT_DETACH
        } else {
            MntFlags::empty()
        };
        umount2(target, flags).map_err(std::io::Error::from)
    }

    fn mounts(&self) -> Vec<MountEntry> {
        mountinfo::read()
    }

    fn usage_within(&self, target: &Path, timeout: Duration) -> Result<Usage, ProbeError> {
        statvfs_within(target, timeout).map(|s| {
            let frsize = s.fragment_size().max(1);
            Usage {
                total_bytes: s.blocks() * frsize,
                free_bytes: s.blocks_free() * frsize,
                available_bytes: s.blocks_available() * frsize,
                total_inodes: s.files(),
                free_inodes: s.files_free(),
            }
        })
    }
}

/// statvfs that gives up after `timeout`. (The thread that waits ends when the answer
/// comes.)
fn statvfs_within(
    target: &Path,
    timeout: Duration,
) -> Result<nix::sys::statvfs::Statvfs, ProbeError> {
    let (tx, rx) = std::sync::mpsc::channel();
    let path = target.to_path_buf();
    let spawned = std::thread::Builder::new()
        .name("s3csi-statvfs".into())
        .spawn(move || {
            let _ = tx.send(nix::sys::statvfs::statvfs(&path));
        });
    if spawned.is_err() {
        return Err(ProbeError::Os(target.into(), nix::errno::Errno::EAGAIN));
    }
    match rx.recv_timeout(timeout) {
        Ok(Ok(s)) => Ok(s),
        Ok(Err(nix::errno::Errno::ENOTCONN)) => Err(ProbeError::NotConnected(target.into())),
        Ok(Err(e)) => Err(ProbeError::Os(target.into(), e)),
        Err(_) => Err(ProbeError::NoAnswer(target.into(), timeout)),
    }
}

/// What a [`FakeKernel`] mount answers to statvfs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FakeHealth {
    Serving,
    NotConnected,
    Hung,
}

#[derive(Debug)]
struct FakeMount {
    entry: MountEntry,
    busy: bool,
    health: FakeHealth,
}

/// An in-memory mount table. `mount_fuse` hands out one end of a socket pair as the
/// "/dev/fuse" descriptor (the other end is kept, as the kernel keeps the connection).
#[derive(Default)]
pub struct FakeKernel {
    mounts: Mutex<Vec<FakeMount>>,
    connections: Mutex<HashMap<PathBuf, OwnedFd>>,
    /// The next `mount_fuse` fails with this errno.
    fail_next_mount: Mutex<Option<i32>>,
}

impl FakeKernel {
    pub fn new() -> Self {
        Self::default()
    }

    /// A plain unmount of `target` fails with EBUSY while `busy` (a lazy one succeeds).
    pub fn set_busy(&self, target: &Path, busy: bool) {
        for m in self
            .lock()
            .iter_mut()
            .filter(|m| m.entry.mount_point == target)
        {
            m.busy = busy;
        }
    }

    pub fn set_health(&self, target: &Path, health: FakeHealth) {
        for m in self
            .lock()
            .iter_mut()
            .filter(|m| m.entry.mount_point == target)
        {
            m.health = health;
        }
    }

    pub fn fail_next_mount(&self, errno: i32) {
        *self.fail_next_mount.lock().unwrap() = Some(errno);
    }

    /// Adds a mount that someone else made (an earlier node service, another driver).
    pub fn add_mount(&self, target: &Path, fs_type: &str) {
        self.lock().push(FakeMount {
            entry: MountEntry {
                mount_point: target.to_path_buf(),
                fs_type: fs_type.to_string(),
                source: "fake".into(),
            },
            busy: false,
            health: FakeHealth::Serving,
        });
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Vec<FakeMount>> {
        self.mounts.lock().unwrap()
    }
}

impl Kernel for FakeKernel {
    fn mount_fuse(&self, target: &Path, how: &KernelMount) -> std::io::Result<OwnedFd> {
        if let Some(errno) = self.fail_next_mount.lock().unwrap().take() {
            return Err(std::io::Error::from_raw_os_error(errno));
        }
        let (ours, kernel_end) = std::os::unix::net::UnixStream::pair()?;
        self.connections
            .lock()
            .unwrap()
            .insert(target.to_path_buf(), kernel_end.into());
        self.lock().push(FakeMount {
            entry: MountEntry {
                mount_point: target.to_path_buf(),
                fs_type: "fuse.s3csi".into(),
                source: how.fsname.clone(),
            },
            busy: false,
            health: FakeHealth::Serving,
        });
        Ok(ours.into())
    }

    fn bind(&self, from: &Path, to: &Path) -> std::io::Result<()> {
        let mut mounts = self.lock();
        let Some(m) = mounts.iter().rev().find(|m| m.entry.mount_point == from) else {
            return Err(std::io::Error::from_raw_os_error(libc::EINVAL));
        };
        let bound = FakeMount {
            entry: MountEntry {
                mount_point: to.to_path_buf(),
                ..m.entry.clone()
            },
            busy: false,
            health: m.health,
        };
        mounts.push(bound);
        Ok(())
    }

    fn unmount(&self, target: &Path, lazy: bool) -> std::io::Result<()> {
        let mut mounts = self.lock();
        let Some(i) = mounts.iter().rposition(|m| m.entry.mount_point == target) else {
            return Err(std::io::Error::from_raw_os_error(libc::EINVAL));
        };
        if mounts[i].busy && !lazy {
            return Err(std::io::Error::from_raw_os_error(libc::EBUSY));
        }
        mounts.remove(i);
        self.connections.lock().unwrap().remove(target);
        Ok(())
    }

    fn mounts(&self) -> Vec<MountEntry> {
        self.lock().iter().map(|m| m.entry.clone()).collect()
    }

    fn usage_within(&self, target: &Path, timeout: Duration) -> Result<Usage, ProbeError> {
        let health = self
            .lock()
            .iter()
            .rev()
            .find(|m| m.entry.mount_point == target)
            .map(|m| m.health);
        match health {
            Some(FakeHealth::Serving) => Ok(Usage {
                total_bytes: 1 << 50,
                free_bytes: 1 << 50,
                available_bytes: 1 << 50,
                total_inodes: 1 << 30,
                free_inodes: 1 << 30,
            }),
            Some(FakeHealth::NotConnected) => Err(ProbeError::NotConnected(target.into())),
            Some(FakeHealth::Hung) => Err(ProbeError::NoAnswer(target.into(), timeout)),
            // A plain directory: statvfs of the file system it is on.
            None => Ok(Usage::default()),
        }
    }
}
