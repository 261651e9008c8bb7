//! Mount by descriptor: the node service mounts, the mounter only serves.
//!
//! The node service opens `/dev/fuse`, performs the kernel mount on the target itself
//! (`kernel::Kernel::mount_fuse`) and hands the descriptor to the mounter over the mounter's *control
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
//! - `METRICS` (once serving): answer `OK <length>` and then exactly `<length>` bytes, the
//!   mounter's metrics in the text exposition format 0.0.4 (which spans many lines, hence
//!   the length: the answer is one line followed by a body the line announces).
//!
//! Files in the handoff directory (0700, owned by the node service's user):
//! - `control.sock`: the mounter's listening socket;
//! - `init.bin`: the kernel's FUSE_INIT request as the first mounter read it; a replacement
//!   replays it to set up its session the way the first one did (the kernel sends INIT
//!   once per connection);
//! - `inodes.log`: the mounter's inode bindings (`fs::inode_log`).

use super::FailureKind;
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
pub fn serve_fd(dir: &Path, fd: RawFd, timeout: Duration) -> Result<(), Failure> {
    let other =
        |what: &str, e: std::io::Error| Failure::new(FailureKind::Other, format!("{what}: {e}"));
    let s = connect(dir, timeout).map_err(|e| other("cannot reach the mounter", e))?;
    send(&s, "SERVE", Some(fd)).map_err(|e| other("cannot hand over the descriptor", e))?;
    match recv(&s) {
        Ok((line, _)) if line == "OK" => Ok(()),
        Ok((line, _)) => Err(Failure::from_line(
            line.strip_prefix("ERR ").unwrap_or(&line),
        )),
        Err(e) => Err(other("the mounter did not confirm serving", e)),
    }
}

/// The largest METRICS answer the node service reads (a mounter's exposition is a few KiB).
pub const MAX_METRICS_BYTES: usize = 16 << 20;

/// Why a mounter's metrics could not be read.
#[derive(Debug, thiserror::Error)]
pub enum MetricsFetchError {
    #[error("control socket: {0}")]
    Io(#[from] std::io::Error),
    #[error("no answer within {0:?}")]
    Timeout(Duration),
    #[error("the mounter answered {0:?}")]
    Refused(String),
    #[error("an answer of {0} bytes is over the limit")]
    TooLarge(usize),
    #[error("the metrics are not UTF-8")]
    NotText,
}

/// Asks the mounter behind `dir` for its metrics; the whole exchange within `timeout`.
/// Async, unlike the other requests: a scrape asks every mounter at once.
pub async fn fetch_metrics(dir: &Path, timeout: Duration) -> Result<String, MetricsFetchError> {
    use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
    let exchange = async {
        let mut stream = tokio::net::UnixStream::connect(control_socket(dir)).await?;
        stream.write_all(b"METRICS\n").await?;
        let mut reader = BufReader::new(stream);
        let mut header = String::new();
        // The header is one short line: a peer that never ends it is not read forever.
        (&mut reader).take(256).read_line(&mut header).await?;
        let header = header.trim_end_matches('\n');
        let length: usize = header
            .strip_prefix("OK ")
            .and_then(|n| n.parse().ok())
            .ok_or_else(|| MetricsFetchError::Refused(header.to_string()))?;
        if length > MAX_METRICS_BYTES {
            return Err(MetricsFetchError::TooLarge(length));
        }
        let mut body = vec![0; length];
        reader.read_exact(&mut body).await?;
        String::from_utf8(body).map_err(|_| MetricsFetchError::NotText)
    };
    tokio::time::timeout(timeout, exchange)
        .await
        .map_err(|_| MetricsFetchError::Timeout(timeout))?
}

/// The mounter's answer to METRICS: the `OK <length>` line, then `text`.
pub fn send_metrics(mut stream: &UnixStream, text: &str) -> std::io::Result<()> {
    use std::io::Write;
    let mut answer = format!("OK {}\n", text.len()).into_bytes();
    answer.extend_from_slice(text.as_bytes());
    stream.write_all(&answer)
}

pub use super::kernel::KernelMount;

/// Why a mounter gave up, as it tells the node service: in `FAILURE_FILE` when it stops
/// before or while listening, and after `ERR ` on the control socket when it cannot serve
/// a handed-over descriptor. Typed, so that the node service maps it to a gRPC status
/// without reading the mounter's log.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize, thiserror::Error)]
#[error("{message}")]
pub struct Failure {
    pub kind: FailureKind,
    pub message: String,
}

impl Failure {
    pub fn new(kind: FailureKind, message: impl Into<String>) -> Self {
        Self {
            kind,
            message: message.into(),
        }
    }

    fn to_line(&self) -> String {
        serde_json::to_string(self).unwrap_or_else(|_| self.message.clone())
    }

    /// A record or an `ERR` line; the plain text of an older mounter is kept as it is.
    fn from_line(line: &str) -> Self {
        serde_json::from_str(line).unwrap_or_else(|_| Self::new(FailureKind::Other, line))
    }
}

/// The file a mounter in handoff mode leaves its [`Failure`] in before it exits (in pod
/// mode its stderr belongs to the container runtime).
pub const FAILURE_FILE: &str = "last-error";

/// Leaves `failure` in the handoff directory, whole or not at all.
pub fn record_failure(dir: &Path, failure: &Failure) -> std::io::Result<()> {
    let path = dir.join(FAILURE_FILE);
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, format!("{}\n", failure.to_line()))?;
    std::fs::rename(&tmp, &path)
}

/// The failure a mounter left in its handoff directory, if any (read, not removed).
pub fn read_failure(dir: &Path) -> Option<Failure> {
    let text = std::fs::read_to_string(dir.join(FAILURE_FILE)).ok()?;
    let line = text.trim();
    (!line.is_empty()).then(|| Failure::from_line(line))
}

/// Removes a failure left by an earlier mounter of the same directory.
pub fn clear_failure(dir: &Path) {
    let _ = std::fs::remove_file(dir.join(FAILURE_FILE));
}

/// The `ERR` answer to SERVE.
pub fn refusal(failure: &Failure) -> String {
    format!("ERR {}", failure.to_line())
}

/// What the control socket of a mounter says about it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Answer {
    /// It answered a PING.
    Serving,
    /// The socket file exists but nobody listens: the mounter process is gone.
    Refused,
    /// No socket yet: the mounter has not started listening.
    Absent,
    /// It did not answer in time (busy), or something else went wrong.
    Unknown,
}

/// Asks the mounter behind `dir` whether it is there.
pub fn ping(dir: &Path) -> Answer {
    use std::io::ErrorKind;
    match connect(dir, Duration::from_secs(2)) {
        Ok(s) => {
            let ok = send(&s, "PING", None)
                .and_then(|_| recv(&s))
                .is_ok_and(|(line, _)| line.starts_with("OK pid="));
            if ok {
                Answer::Serving
            } else {
                Answer::Unknown
            }
        }
        Err(e) if e.kind() == ErrorKind::ConnectionRefused => Answer::Refused,
        Err(e) if e.kind() == ErrorKind::NotFound => Answer::Absent,
        Err(_) => Answer::Unknown,
    }
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

    #[tokio::test]
    async fn metrics_cross_the_control_socket_with_their_length() {
        let dir =
            std::env::temp_dir().join(format!("s3csi-handoff-metrics-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let _ = std::fs::remove_file(control_socket(&dir));
        let listener = std::os::unix::net::UnixListener::bind(control_socket(&dir)).unwrap();
        let text = "# TYPE a counter\na_total 1\n";
        let mounter = std::thread::spawn(move || {
            for answer in [Some(text), None] {
                let (conn, _) = listener.accept().unwrap();
                let (line, _) = recv(&conn).unwrap();
                assert_eq!(line, "METRICS");
                match answer {
                    Some(text) => send_metrics(&conn, text).unwrap(),
                    None => send(&conn, "ERR not serving yet", None).unwrap(),
                }
            }
        });
        let got = fetch_metrics(&dir, Duration::from_secs(5)).await.unwrap();
        assert_eq!(got, text);
        let err = fetch_metrics(&dir, Duration::from_secs(5))
            .await
            .unwrap_err();
        assert!(
            matches!(err, MetricsFetchError::Refused(ref l) if l == "ERR not serving yet"),
            "{err}"
        );
        mounter.join().unwrap();
        let _ = std::fs::remove_dir_all(&dir);
    }
}
