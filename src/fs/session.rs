//! A FUSE session on a `/dev/fuse` descriptor that someone else mounted (the CSI node
//! service, see `mounter::handoff`), for the first mounter of a connection and for a
//! replacement that takes over from a dead one.

use super::fuse::FuseAdapter;
use super::S3Fs;
use std::os::fd::{AsFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// Where a mounter keeps what its replacement needs.
pub struct HandoffFiles {
    /// The kernel's FUSE_INIT request as the first mounter read it.
    pub init: PathBuf,
    /// The first mounter's reply to it: what the connection negotiated.
    pub init_reply: PathBuf,
    /// The inode bindings (`inode_log`).
    pub inode_log: PathBuf,
}

/// Why the session on a handed-over descriptor could not be set up.
#[derive(Debug, thiserror::Error)]
pub enum SessionError {
    #[error("cannot read {}: {source}", .path.display())]
    ReadInodeLog {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("cannot write {}: {source}", .path.display())]
    WriteInodeLog {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("cannot read the saved FUSE_INIT {}: {source}", .path.display())]
    ReadSavedInit {
        path: PathBuf,
        source: std::io::Error,
    },
    /// Saving what a replacement mounter needs: `what` is "FUSE_INIT" or its reply.
    #[error("cannot save {what}: {source}")]
    Save {
        what: &'static str,
        source: std::io::Error,
    },
    /// A system call on the descriptor or the socket pair; `step` says which.
    #[error("{step}: {source}")]
    Sys {
        step: &'static str,
        source: nix::errno::Errno,
    },
    #[error("FUSE handshake: {0}")]
    Handshake(std::io::Error),
    #[error("dup3: {0}")]
    Dup(std::io::Error),
    #[error("cannot start the FUSE session: {0}")]
    Spawn(std::io::Error),
}

fn sys(step: &'static str) -> impl FnOnce(nix::errno::Errno) -> SessionError {
    move |source| SessionError::Sys { step, source }
}

/// FUSE_NOTIFY_RESEND (Linux 6.9+): the kernel puts every request a dead daemon had read
/// but not answered back in the queue, for the new daemon to answer.
const FUSE_NOTIFY_RESEND: i32 = 7;

/// Asks the kernel to send again every request that was read from this connection but
/// never answered (the dead mounter's). Harmless when there are none; fails with EINVAL on
/// kernels before 6.9.
fn notify_resend(fd: impl AsFd) -> std::io::Result<()> {
    let mut msg = [0u8; 16];
    msg[0..4].copy_from_slice(&16u32.to_ne_bytes());
    msg[4..8].copy_from_slice(&FUSE_NOTIFY_RESEND.to_ne_bytes());
    // unique = 0 marks a notification.
    nix::unistd::write(fd, &msg).map_err(std::io::Error::from)?;
    Ok(())
}

/// Writes `data` to `path` so that a replacement mounter reads either all of it or the
/// previous file, never a torn one.
fn save_whole(path: &Path, data: &[u8]) -> std::io::Result<()> {
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, data)?;
    std::fs::rename(&tmp, path)
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
pub fn serve_descriptor(
    fs: &Arc<S3Fs>,
    acl: fuser::SessionACL,
    files: &HandoffFiles,
    fuse_fd: &OwnedFd,
    recover: bool,
    rt: &tokio::runtime::Runtime,
) -> Result<fuser::BackgroundSession, SessionError> {
    use super::inode_log::{self, InodeLog};
    use nix::sys::socket::{socketpair, AddressFamily, SockFlag, SockType};
    use std::os::fd::AsRawFd;

    let root_key = fs.config().prefix.clone();
    let log_path = &files.inode_log;
    let restored = if recover {
        inode_log::load(log_path, &root_key).map_err(|source| SessionError::ReadInodeLog {
            path: log_path.clone(),
            source,
        })?
    } else {
        inode_log::Loaded::default()
    };
    let log = InodeLog::create(log_path, &root_key, &[]).map_err(|source| {
        SessionError::WriteInodeLog {
            path: log_path.clone(),
            source,
        }
    })?;
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

    let init_path = &files.init;
    let init = if recover {
        std::fs::read(init_path).map_err(|source| SessionError::ReadSavedInit {
            path: init_path.clone(),
            source,
        })?
    } else {
        // The first request on a fresh connection is INIT; /dev/fuse wants a buffer that
        // can take the largest write request.
        let mut buf = vec![0u8; (16 << 20) + 8192];
        let n = nix::unistd::read(fuse_fd, &mut buf).map_err(sys("reading FUSE_INIT"))?;
        buf.truncate(n);
        save_whole(init_path, &buf).map_err(|source| SessionError::Save {
            what: "FUSE_INIT",
            source,
        })?;
        buf
    };
    let (ours, theirs) = socketpair(
        AddressFamily::Unix,
        SockType::SeqPacket,
        None,
        SockFlag::SOCK_CLOEXEC,
    )
    .map_err(sys("socketpair"))?;
    nix::unistd::write(&ours, &init).map_err(sys("replaying FUSE_INIT"))?;

    let reply_path = &files.init_reply;
    let mut adapter = FuseAdapter::new(fs.clone(), rt.handle().clone()).replaceable();
    if recover {
        // A mounter from before direct I/O saved no reply: its connection has no
        // FUSE_DIRECT_IO_ALLOW_MMAP, so direct I/O would break MAP_SHARED there.
        let negotiated = std::fs::read(reply_path)
            .map(|r| super::fuse::init_reply_allows_direct_io_mmap(&r))
            .unwrap_or(false);
        adapter = adapter.taking_over(negotiated);
    }
    let mut fuse_cfg = fuser::Config::default();
    fuse_cfg.acl = acl;
    let session =
        fuser::Session::from_fd(adapter, theirs, acl, fuse_cfg).map_err(SessionError::Handshake)?;
    let mut reply = vec![0u8; 64 * 1024];
    let n = nix::unistd::read(&ours, &mut reply).map_err(sys("FUSE_INIT reply"))?;
    if !recover {
        save_whole(reply_path, &reply[..n]).map_err(|source| SessionError::Save {
            what: "the FUSE_INIT reply",
            source,
        })?;
        nix::unistd::write(fuse_fd, &reply[..n]).map_err(sys("answering FUSE_INIT"))?;
    }
    // SAFETY: the session's descriptor is not in use by any thread yet; dup3 atomically
    // makes that number refer to /dev/fuse (closing the socket end it referred to), and
    // the session keeps owning (and eventually closing) the number.
    let raw = session.as_fd().as_raw_fd();
    if unsafe { libc::dup3(fuse_fd.as_raw_fd(), raw, libc::O_CLOEXEC) } < 0 {
        return Err(SessionError::Dup(std::io::Error::last_os_error()));
    }
    drop(ours);
    let background = session.spawn().map_err(SessionError::Spawn)?;
    if recover {
        match notify_resend(fuse_fd.as_fd()) {
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
