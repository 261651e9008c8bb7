//! One crash story, told for every way a mounter runs (process, Pod): files held open
//! across `kill -9` of the mounter, and a kill while a close waits for S3.

use super::fault_proxy::{Fault, FaultProxy, Rule};
use super::node_service::{publish_req, wait_replaced};
use super::{is_mountpoint, s3, s3_get};
use s3csi::csi::pb;
use s3csi::csi::pb::node_client::NodeClient;
use std::io::Write;
use std::path::Path;
use std::time::{Duration, Instant};
use tonic::transport::Channel;

/// Waits until `pid` is gone or a zombie (kill(2) returns before it is).
pub fn wait_dead(pid: u32) {
    let deadline = Instant::now() + Duration::from_secs(5);
    while std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|st| {
        !st.rsplit_once(')')
            .is_some_and(|(_, r)| r.trim_start().starts_with('Z'))
    }) {
        assert!(Instant::now() < deadline, "the mounter survived SIGKILL");
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// Runs `work` on a thread of its own and fails the test if it does not return within
/// `limit`: a call that hangs in the kernel cannot be cancelled, only waited for.
pub fn bounded<T: Send + 'static>(
    what: &str,
    limit: Duration,
    work: impl FnOnce() -> T + Send + 'static,
) -> T {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(work());
    });
    rx.recv_timeout(limit)
        .unwrap_or_else(|_| panic!("{what}: no answer within {limit:?} (the mount hangs)"))
}

/// The mount serves: new files written and read back, by path, in bounded time.
pub fn serves(target: &Path, tag: &str) {
    let (target, tag) = (target.to_path_buf(), tag.to_string());
    bounded(
        "new files after the replacement",
        Duration::from_secs(20),
        move || {
            for i in 0..10 {
                let p = target.join(format!("{tag}-{i}.txt"));
                std::fs::write(&p, format!("{tag} {i}")).unwrap();
                assert_eq!(std::fs::read_to_string(&p).unwrap(), format!("{tag} {i}"));
            }
        },
    );
}

/// The workload: a process of its own (as a pod's is) that holds files open on the mount
/// and makes the calls it is told to, one per line on stdin, answering `ok VALUE` or
/// `err ERRNO` per call. It must not be the test process: the fake kubelet starts mounter
/// Pods by forking the test process, and a fork that inherits open FUSE files closes them
/// at exec, which waits for the very mounter being started.
pub struct Workload {
    child: std::process::Child,
    input: std::process::ChildStdin,
    /// The workload's answers, read on a thread so that a hang fails the test instead of
    /// blocking it.
    answers: std::sync::mpsc::Receiver<String>,
}

const WORKLOAD: &str = r#"
import os, sys, threading
fds, out = {}, threading.Lock()
def say(line):
    with out:
        print(line, flush=True)
def call(f):
    try:
        r = f()
        return "ok" if r is None else "ok %s" % r
    except OSError as e:
        return "err %d" % e.errno
for line in sys.stdin:
    op, name, *rest = line.split()
    if op == "open_r":
        say(call(lambda: fds.__setitem__(name, os.open(name, os.O_RDONLY))))
    elif op == "open_w":
        say(call(lambda: fds.__setitem__(name, os.open(name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC))))
    elif op == "read":
        say(call(lambda: len(os.read(fds[name], 4))))
    elif op == "write":
        say(call(lambda: os.write(fds[name], rest[0].encode())))
    elif op == "fsync":
        say(call(lambda: os.fsync(fds[name])))
    elif op == "close":
        say(call(lambda: os.close(fds[name])))
    elif op == "close_later":
        fd = fds[name]
        threading.Thread(target=lambda: say("closed " + call(lambda: os.close(fd)))).start()
        say("ok")
"#;

impl Workload {
    pub fn start(dir: &Path) -> Workload {
        use std::io::BufRead;
        use std::process::{Command, Stdio};
        let mut child = Command::new("python3")
            .args(["-u", "-c", WORKLOAD])
            .current_dir(dir)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .expect("start the workload (python3)");
        let input = child.stdin.take().unwrap();
        let output = std::io::BufReader::new(child.stdout.take().unwrap());
        let (tx, answers) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for line in output.lines().map_while(Result::ok) {
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        Workload {
            child,
            input,
            answers,
        }
    }

    /// Sends one call; its answer comes from [`Self::answer`].
    pub fn send(&mut self, call: &str) {
        writeln!(self.input, "{call}").unwrap();
    }

    /// The next answer, or panics after `limit` (the mount hangs).
    pub fn answer(&mut self, limit: Duration) -> String {
        self.answers.recv_timeout(limit).unwrap_or_else(|_| {
            panic!("the workload got no answer within {limit:?} (the mount hangs)")
        })
    }

    /// One call and its answer, within 10 s.
    pub fn call(&mut self, call: &str) -> String {
        self.send(call);
        self.answer(Duration::from_secs(10))
    }
}

impl Drop for Workload {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Publishes `bucket` at `target` through a fault proxy, then: a workload process holds a
/// file open for reading and one open for writing across `kill_mounter()`; every call on
/// them, `close` included, answers EBADF at once (README's semantics table), the unclosed
/// file is not in S3, the mount goes on serving (a release of a handle the replacement did
/// not know once deadlocked it for good). Then a second kill while a close waits for its
/// PUT: that close answers EBADF at once too. Unpublishes at the end.
pub fn files_open_across_mounter_kills(
    rt: &tokio::runtime::Runtime,
    node: &mut NodeClient<Channel>,
    bucket: &str,
    target: &Path,
    mut kill_mounter: impl FnMut(),
) {
    let proxy = FaultProxy::start(&s3().endpoint, 11);
    let stalled_put = proxy.add_rule(
        Rule::new(
            |r| r.method == "PUT" && r.path.ends_with("/slow.txt"),
            1.0,
            Fault::Stall,
        )
        .limit(1),
    );
    let mut req = publish_req(bucket, target);
    req.volume_context
        .insert("endpointUrl".to_string(), proxy.endpoint());
    rt.block_on(node.node_publish_volume(req)).unwrap();

    std::fs::write(target.join("r.txt"), b"read me").unwrap();
    let mut w = Workload::start(target);
    assert_eq!(w.call("open_r r.txt"), "ok");
    assert_eq!(w.call("read r.txt"), "ok 4");
    assert_eq!(w.call("open_w w.txt"), "ok");
    assert_eq!(w.call("write w.txt written,never-closed"), "ok 20");
    kill_mounter();
    rt.block_on(wait_replaced(node, bucket, target, 1));
    let ebadf = format!("err {}", libc::EBADF);
    for call in [
        "read r.txt",
        "write w.txt more",
        "fsync w.txt",
        "close r.txt",
        "close w.txt",
    ] {
        assert_eq!(w.call(call), ebadf, "{call} on the dead mounter's file");
    }
    assert_eq!(s3_get(bucket, "w.txt"), None, "lost, as README says");
    serves(target, "after-first");
    assert_eq!(std::fs::read(target.join("r.txt")).unwrap(), b"read me");

    // The second kill comes while a close waits for its PUT.
    proxy.enable(true);
    assert_eq!(w.call("open_w slow.txt"), "ok");
    assert_eq!(w.call("write slow.txt slow-data"), "ok 9");
    assert_eq!(w.call("close_later slow.txt"), "ok");
    let deadline = Instant::now() + Duration::from_secs(10);
    while stalled_put.fired() == 0 {
        assert!(Instant::now() < deadline, "the close never reached S3");
        std::thread::sleep(Duration::from_millis(20));
    }
    std::thread::sleep(Duration::from_millis(300));
    kill_mounter();
    rt.block_on(wait_replaced(node, bucket, target, 2));
    assert_eq!(
        w.answer(Duration::from_secs(10)),
        format!("closed {ebadf}"),
        "the close in flight at the crash: the replacement does not know the handle"
    );
    serves(target, "after-second");
    drop(w);
    rt.block_on(node.node_unpublish_volume(pb::NodeUnpublishVolumeRequest {
        volume_id: bucket.to_string(),
        target_path: target.to_string_lossy().to_string(),
    }))
    .unwrap();
    assert!(!is_mountpoint(target));
}
