//! Mount by descriptor: the node service mounts, the mounter only serves.
//!
//! The node service opens `/dev/fuse`, performs the kernel mount on the target itself
//! ([`kernel_mount`]) and hands the descriptor to the mounter over the mounter's *control
//! socket* (`HANDOFF_DIR/control.sock`, SCM_RIGHTS). It keeps a duplicate of that
//! descriptor: while any copy is open the kernel keeps the FUSE connection, so a mounter
//! that dies leaves requests waiting instead of failing with ENOTCONN, and a replacement
//! given the same descriptor carries on.
//!
//! Protocol: one text line per message, at most one descriptor attached to it.
//! - `SERVE` + fd (node → mounter): serve FUSE on this descriptor; answer `OK` once
//!   serving, or `ERR reason`.
//! - `FD` (node → mounter): send your descriptor back (a restarted node service collects
//!   the descriptors of the mounters that outlived the previous one); answer `OK` + fd.
//! - `PING`: answer `OK pid=N`.
//!
//! Files in the handoff directory (0700, owned by the node service's user):
//! - `control.sock`: the mounter's listening socket;
//! - `init.bin`: the kernel's FUSE_INIT request as the first mounter read it; a replacement
//!   replays it to set up its session the way the first one did (the kernel sends INIT
//!   once per connection);
//! - `inodes.log`: the mounter's inode bindings (`fs::inode_log`).

use nix::sys::socket::{recvmsg, sendmsg, ControlMessage, ControlMessageOwned, MsgFlags};
use std::io::{IoSlice, IoSliceMut};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::time::Duration;

pub const CONTROL_SOCKET: &str = "control.sock";
pub const INIT_FILE: &str = "init.bin";
/// The first mounter's answer to it: what the connection negotiated.
pub const INIT_REPLY_FILE: &str = "init-reply.bin";
pub const INODE_LOG: &str = "inodes.log";

pub fn control_socket(dir: &Path) -> PathBuf {
    dir.join(CONTROL_SOCKET)
}

/// Sends one line, with `fd` attached if given.
pub fn send(stream: &UnixStream, line: &str, fd: Option<RawFd>) -> std::io::Result<()> {
    let mut text = line.as_bytes().to_vec();
    text.push(b'\n');
    let iov = [IoSlice::new(&text)];
    let fds;
    let cmsgs: Vec<ControlMessage> = match fd {
        Some(fd) => {
            fds = [fd];
            vec![ControlMessage::ScmRights(&fds)]
        }
        None => vec![],
    };
    let sent = sendmsg::<()>(stream.as_raw_fd(), &iov, &cmsgs, MsgFlags::empty(), None)
        .map_err(std::io::Error::from)?;
    if sent != text.len() {
        // Unix stream sockets take small messages whole; anything else is a broken peer.
        return Err(std::io::Error::other("short write on the control socket"));
    }
    Ok(())
}

/// Receives one line (without the newline) and the descriptor attached to it, if any.
pub fn recv(stream: &UnixStream) -> std::io::Result<(String, Option<OwnedFd>)> {
    let mut line = Vec::new();
    let mut fd: Option<OwnedFd> = None;
    loop {
        let mut buf = [0u8; 1024];
        let mut cmsg = nix::cmsg_space!([RawFd; 2]);
        let (n, got) = {
            let mut iov = [IoSliceMut::new(&mut buf)];
            let msg = recvmsg::<()>(
                stream.as_raw_fd(),
                &mut iov,
                Some(&mut cmsg),
                MsgFlags::MSG_CMSG_CLOEXEC,
            )
            .map_err(std::io::Error::from)?;
            let mut got = Vec::new();
            for c in msg.cmsgs().map_err(std::io::Error::from)? {
                if let ControlMessageOwned::ScmRights(fds) = c {
                    got.extend(fds);
                }
            }
            (msg.bytes, got)
        };
        for raw in got {
            // SAFETY: the kernel just installed these descriptors for us; nobody else owns them.
            let owned = unsafe { OwnedFd::from_raw_fd(raw) };
            if fd.is_none() {
                fd = Some(owned);
            }
        }
        if n == 0 {
            return Err(std::io::Error::new(
                std::io::ErrorKind::UnexpectedEof,
                "the peer closed the control socket",
            ));
        }
        line.extend_from_slice(&buf[..n]);
        if let Some(end) = line.iter().position(|b| *b == b'\n') {
            line.truncate(end);
            return Ok((String::from_utf8_lossy(&line).into_owned(), fd));
        }
        if line.len() > 64 * 1024 {
            return Err(std::io::Error::other(
                "overlong message on the control socket",
            ));
        }
    }
}

/// Connects to a mounter's control socket with read/write timeouts.
pub fn connect(dir: &Path, timeout: Duration) -> std::io::Result<UnixStream> {
    let s = UnixStream::connect(control_socket(dir))?;
    s.set_read_timeout(Some(timeout))?;
    s.set_write_timeout(Some(timeout))?;
    Ok(s)
}

/// Asks the mounter behind `dir` for its FUSE descriptor.
pub fn collect_fd(dir: &Path, timeout: Duration) -> std::io::Result<OwnedFd> {
    let s = connect(dir, timeout)?;
    send(&s, "FD", None)?;
    match recv(&s)? {
        (line, Some(fd)) if line == "OK" => Ok(fd),
        (line, _) => Err(std::io::Error::other(format!(
            "the mounter answered {line:?} without a descriptor"
        ))),
    }
}

/// Hands `fd` to the mounter behind `dir` and waits until it serves (or refuses).
pub fn serve_fd(dir: &Path, fd: RawFd, timeout: Duration) -> Result<(), String> {
    let s = connect(dir, timeout).map_err(|e| format!("cannot reach the mounter: {e}"))?;
    send(&s, "SERVE", Some(fd)).map_err(|e| format!("cannot hand over the descriptor: {e}"))?;
    match recv(&s) {
        Ok((line, _)) if line == "OK" => Ok(()),
        Ok((line, _)) => Err(line.strip_prefix("ERR ").unwrap_or(&line).to_string()),
        Err(e) => Err(format!("the mounter did not confirm serving: {e}")),
    }
}

/// How the node service mounts a volume.
#[derive(Debug, Clone, Default)]
pub struct KernelMount {
    /// Shown as the mount's source, e.g. `s3csi:bucket`.
    pub fsname: String,
    pub read_only: bool,
    /// `allow_other` in the kernel (the mount options allow-other or allow-root).
    pub allow_other: bool,
}

/// Opens `/dev/fuse` and mounts a `fuse.s3csi` file system served through it on `target`.
/// Needs CAP_SYS_ADMIN. The first request on the descriptor is the kernel's FUSE_INIT.
pub fn kernel_mount(target: &Path, m: &KernelMount) -> std::io::Result<OwnedFd> {
    use nix::mount::{mount, MsFlags};
    let dev = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open("/dev/fuse")?;
    let fd: OwnedFd = dev.into();
    let mut data = format!(
        "fd={},rootmode=40000,user_id=0,group_id=0,default_permissions",
        fd.as_raw_fd()
    );
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lines_and_descriptors_cross_a_socket() {
        let (a, b) = UnixStream::pair().unwrap();
        let file = std::fs::File::open("/dev/null").unwrap();
        send(&a, "SERVE", Some(file.as_raw_fd())).unwrap();
        let (line, fd) = recv(&b).unwrap();
        assert_eq!(line, "SERVE");
        let fd = fd.expect("a descriptor");
        let target = std::fs::read_link(format!("/proc/self/fd/{}", fd.as_raw_fd())).unwrap();
        assert_eq!(target, PathBuf::from("/dev/null"));
        send(&b, "OK", None).unwrap();
        let (line, fd) = recv(&a).unwrap();
        assert!(line == "OK" && fd.is_none());
        drop(b);
        assert!(recv(&a).is_err());
    }
}
