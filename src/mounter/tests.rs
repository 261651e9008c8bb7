//! The mount manager and the supervisor against the kernel fake and a fake backend whose
//! "mounters" are threads speaking the real control-socket protocol: no root, no FUSE.

use super::backend::{ExitFlag, MounterBackend, MounterHandle};
use super::handoff::{self, Failure};
use super::kernel::{FakeHealth, FakeKernel, Kernel};
use super::state::MountRecord;
use super::*;
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::net::UnixListener;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

/// A private directory, removed at the end of the test.
pub(crate) struct Scratch(pub PathBuf);

impl Scratch {
    pub fn new() -> Self {
        static N: AtomicU32 = AtomicU32::new(0);
        let dir = std::env::temp_dir().join(format!(
            "s3csi-unit-{}-{}",
            std::process::id(),
            N.fetch_add(1, Ordering::Relaxed)
        ));
        std::fs::create_dir_all(&dir).unwrap();
        Scratch(dir)
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

struct FakeMounter {
    handle: MounterHandle,
    stop: Arc<AtomicBool>,
    /// The descriptor it was handed, once it serves.
    served: Arc<Mutex<Option<OwnedFd>>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

/// Starts "mounters" as threads that listen on the handoff directory's control socket.
#[derive(Default)]
struct FakeBackend {
    next_pid: AtomicU32,
    mounters: Mutex<Vec<FakeMounter>>,
    /// The next mounter gives up before it listens, with this failure.
    fail_before_listening: Mutex<Option<Failure>>,
    /// The next mounter refuses the descriptor with this failure.
    refuse_serving: Mutex<Option<Failure>>,
    released: AtomicUsize,
    stopped: AtomicUsize,
}

impl FakeBackend {
    fn live(&self) -> Vec<u32> {
        self.mounters
            .lock()
            .unwrap()
            .iter()
            .filter(|m| !m.handle.has_exited())
            .map(|m| m.handle.pid)
            .collect()
    }

    /// The descriptor the live mounter `pid` serves.
    fn served_inode(&self, pid: u32) -> Option<u64> {
        let mounters = self.mounters.lock().unwrap();
        let m = mounters.iter().find(|m| m.handle.pid == pid)?;
        let served = m.served.lock().unwrap();
        Some(nix::sys::stat::fstat(served.as_ref()?.as_fd()).ok()?.st_ino)
    }

    /// Ends the mounter `pid` as a crash or a kill would.
    fn crash(&self, pid: u32) {
        let thread = {
            let mut mounters = self.mounters.lock().unwrap();
            let Some(m) = mounters.iter_mut().find(|m| m.handle.pid == pid) else {
                return;
            };
            m.stop.store(true, Ordering::Relaxed);
            m.thread.take()
        };
        if let Some(t) = thread {
            let _ = t.join();
        }
    }
}

fn run_fake_mounter(
    listener: UnixListener,
    pid: u32,
    refuse: Option<Failure>,
    stop: Arc<AtomicBool>,
    served: Arc<Mutex<Option<OwnedFd>>>,
    exited: ExitFlag,
) {
    listener.set_nonblocking(true).unwrap();
    while !stop.load(Ordering::Relaxed) {
        let Ok((conn, _)) = listener.accept() else {
            std::thread::sleep(Duration::from_millis(5));
            continue;
        };
        conn.set_nonblocking(false).unwrap();
        match handoff::recv(&conn) {
            Ok((line, _)) if line == "PING" => {
                let _ = handoff::send(&conn, &format!("OK pid={pid}"), None);
            }
            Ok((line, Some(fd))) if line == "SERVE" => match &refuse {
                Some(f) => {
                    let _ = handoff::send(&conn, &handoff::refusal(f), None);
                    break;
                }
                None => {
                    *served.lock().unwrap() = Some(fd);
                    let _ = handoff::send(&conn, "OK", None);
                }
            },
            Ok((line, _)) if line == "FD" => {
                use std::os::fd::AsRawFd;
                let fd = served.lock().unwrap().as_ref().map(|f| f.as_raw_fd());
                let _ = handoff::send(&conn, "OK", fd);
            }
            _ => {}
        }
    }
    // Like a dead process, it leaves its socket file behind, refusing connections.
    drop(listener);
    *exited.lock().unwrap() = Some("signal: 9 (SIGKILL)".into());
}

#[async_trait]
impl MounterBackend for FakeBackend {
    async fn start(
        &self,
        _req: &MountRequest,
        dir: &Path,
        _recover: bool,
        _generation: u32,
    ) -> Result<MounterHandle, MountError> {
        let pid = 1_000_000 + self.next_pid.fetch_add(1, Ordering::Relaxed);
        let exited: ExitFlag = Arc::new(Mutex::new(None));
        let handle = MounterHandle::new(pid, None, exited.clone());
        let stop = Arc::new(AtomicBool::new(false));
        let served = Arc::new(Mutex::new(None));
        let thread = if let Some(f) = self.fail_before_listening.lock().unwrap().take() {
            handoff::record_failure(dir, &f).unwrap();
            *exited.lock().unwrap() = Some("exit status: 1".into());
            None
        } else {
            let sock = handoff::control_socket(dir);
            let _ = std::fs::remove_file(&sock);
            let listener = UnixListener::bind(&sock).unwrap();
            let refuse = self.refuse_serving.lock().unwrap().take();
            let (stop, served) = (stop.clone(), served.clone());
            Some(std::thread::spawn(move || {
                run_fake_mounter(listener, pid, refuse, stop, served, exited)
            }))
        };
        self.mounters.lock().unwrap().push(FakeMounter {
            handle: handle.clone(),
            stop,
            served,
            thread,
        });
        Ok(handle)
    }

    fn answered_by(&self, m: &MounterHandle, pong: &str) -> bool {
        pong == format!("OK pid={}", m.pid)
    }

    fn gone(&self, m: &MounterHandle) -> Option<String> {
        let exited = m.exited.lock().unwrap();
        exited.as_ref().map(|s| format!("{m} exited ({s})"))
    }

    async fn kill(&self, m: &MounterHandle) {
        self.crash(m.pid);
    }

    async fn discard(&self, _m: &MounterHandle) {}

    async fn stop(&self, _target: &Path, m: &MounterHandle, _deadline: Instant) {
        self.stopped.fetch_add(1, Ordering::Relaxed);
        self.crash(m.pid);
    }

    async fn check_start(&self, _m: &MounterHandle) -> Result<(), MountError> {
        Ok(())
    }

    async fn exit_error(&self, m: &MounterHandle, _scrub: &[String]) -> MountError {
        MountError::other(format!("{m} exited without a message"))
    }

    fn start_timeout(&self, m: &MounterHandle, waited: Duration, _scrub: &[String]) -> String {
        format!("{m} was not ready within {waited:?}")
    }

    fn adopt(&self, record: &MountRecord) -> (MounterHandle, bool) {
        let mounters = self.mounters.lock().unwrap();
        match mounters.iter().find(|m| m.handle.pid == record.pid) {
            Some(m) => (m.handle.clone(), !m.handle.has_exited()),
            None => (
                MounterHandle::new(record.pid, None, Arc::new(Mutex::new(Some("gone".into())))),
                false,
            ),
        }
    }

    fn replacement_credentials(&self, _record: &MountRecord) -> Vec<(&'static str, String)> {
        vec![]
    }

    async fn release(&self, _target: &Path) {
        self.released.fetch_add(1, Ordering::Relaxed);
    }

    async fn reconcile(&self, _live: &[(PathBuf, MounterHandle)]) -> Result<(), MountError> {
        Ok(())
    }
}

struct Node {
    scratch: Scratch,
    kernel: Arc<FakeKernel>,
    backend: Arc<FakeBackend>,
    manager: Arc<MountManager>,
}

impl Node {
    fn new() -> Self {
        let scratch = Scratch::new();
        let kernel = Arc::new(FakeKernel::new());
        let backend = Arc::new(FakeBackend::default());
        let manager = Self::manager(&scratch, &kernel, &backend);
        Node {
            scratch,
            kernel,
            backend,
            manager,
        }
    }

    /// A (re)started node service over the same state directory, kernel and mounters.
    fn manager(
        scratch: &Scratch,
        kernel: &Arc<FakeKernel>,
        backend: &Arc<FakeBackend>,
    ) -> Arc<MountManager> {
        Arc::new(
            MountManager::new(
                kernel.clone(),
                backend.clone(),
                scratch.0.join("state"),
                Timeouts {
                    mount: Duration::from_secs(5),
                    unmount: Duration::from_millis(300),
                },
            )
            .unwrap(),
        )
    }

    fn target(&self, name: &str) -> PathBuf {
        self.scratch.0.join("pods").join(name)
    }

    fn request(&self, name: &str) -> MountRequest {
        MountRequest {
            volume_id: format!("vol-{name}"),
            target: self.target(name),
            source: "bucket:prefix".into(),
            args: vec!["--uid".into(), "1000".into()],
            env: vec![("AWS_SECRET_ACCESS_KEY", "secret-value".into())],
            scrub: vec!["secret-value".into()],
            kernel: handoff::KernelMount {
                fsname: "s3csi:bucket".into(),
                ..Default::default()
            },
            keep_cache: false,
            pod_credentials: None,
        }
    }

    fn records(&self) -> Vec<MountRecord> {
        std::fs::read_dir(self.scratch.0.join("state/mounts"))
            .unwrap()
            .flatten()
            .map(|e| e.path())
            .filter(|p| p.extension().is_some_and(|e| e == "state"))
            .map(|p| MountRecord::read(&p).unwrap())
            .collect()
    }
}

async fn eventually(what: &str, mut check: impl FnMut() -> bool) {
    let until = Instant::now() + Duration::from_secs(10);
    while !check() {
        assert!(Instant::now() < until, "not within 10s: {what}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_publish_serves_and_its_unpublish_leaves_nothing() {
    let node = Node::new();
    let target = node.target("a");
    node.manager.mount(node.request("a")).await.unwrap();

    assert!(node.kernel.find(&target).is_some_and(|e| e.is_fuse()));
    let [pid] = node.backend.live()[..] else {
        panic!("one mounter expected: {:?}", node.backend.live())
    };
    assert!(
        node.backend.served_inode(pid).is_some(),
        "handed the descriptor"
    );
    let status = node.manager.status(&target);
    assert_eq!(status.problem, None);
    assert_eq!(status.volume_id.as_deref(), Some("vol-a"));
    let records = node.records();
    assert_eq!(records.len(), 1);
    assert_eq!(records[0].pid, pid);
    assert_eq!(records[0].args, ["--uid", "1000"]);
    for entry in std::fs::read_dir(node.scratch.0.join("state/mounts")).unwrap() {
        let text = std::fs::read_to_string(entry.unwrap().path()).unwrap();
        assert!(
            !text.contains("secret-value"),
            "no credentials in a record: {text}"
        );
    }

    node.manager.unmount(&target).await.unwrap();
    assert!(node.kernel.find(&target).is_none());
    assert!(node.backend.live().is_empty());
    assert_eq!(node.backend.stopped.load(Ordering::Relaxed), 1);
    assert!(node.records().is_empty());
    assert!(!node.manager.handoff_dir(&target).exists());
    assert_eq!(node.manager.mount_count(), 0);
    // Unpublishing again, or a target we never mounted, is fine.
    node.manager.unmount(&target).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_mounter_that_gives_up_reports_a_typed_failure_and_leaves_nothing() {
    let node = Node::new();
    let target = node.target("b");
    *node.backend.fail_before_listening.lock().unwrap() = Some(Failure::new(
        FailureKind::NotFound,
        "bucket \"nope\" does not exist",
    ));
    let e = node.manager.mount(node.request("b")).await.unwrap_err();
    assert_eq!(e.kind, FailureKind::NotFound);
    assert_eq!(e.message, "bucket \"nope\" does not exist");
    assert!(
        node.kernel.find(&target).is_none(),
        "not mounted before it listened"
    );
    assert_eq!(node.manager.mount_count(), 0);
    assert!(!node.manager.handoff_dir(&target).exists());
    assert!(node.records().is_empty());
    assert_eq!(node.backend.released.load(Ordering::Relaxed), 1);

    // Refusing the descriptor: the kernel mount is undone.
    *node.backend.refuse_serving.lock().unwrap() = Some(Failure::new(
        FailureKind::PermissionDenied,
        "access to bucket \"b\" denied",
    ));
    let e = node.manager.mount(node.request("b")).await.unwrap_err();
    assert_eq!(e.kind, FailureKind::PermissionDenied, "{e}");
    assert!(node.kernel.find(&target).is_none());
    assert!(node.backend.live().is_empty());

    // A kernel that refuses the mount.
    node.kernel.fail_next_mount(libc::EPERM);
    let e = node.manager.mount(node.request("b")).await.unwrap_err();
    assert_eq!(e.kind, FailureKind::PermissionDenied, "{e}");
    assert!(e.message.starts_with("cannot mount on"), "{e}");
    assert!(node.backend.live().is_empty(), "its mounter is stopped");
    assert_eq!(node.manager.mount_count(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_mounter_is_replaced_with_the_same_descriptor() {
    let node = Node::new();
    let target = node.target("c");
    node.manager.start_supervisor();
    node.manager.mount(node.request("c")).await.unwrap();
    let first = node.backend.live()[0];
    let connection = node.backend.served_inode(first).unwrap();

    node.backend.crash(first);
    let status = node.manager.status(&target);
    assert!(status.problem.is_some(), "a dead mounter shows");
    // The record on disk is written last, after the counter (see `MountManager::replace`).
    eventually("a replacement serves and is recorded", || {
        node.backend.live().len() == 1
            && node.manager.replacements_total() == 1
            && node.records().first().is_some_and(|r| r.replacements == 1)
    })
    .await;
    let second = node.backend.live()[0];
    assert_ne!(first, second);
    assert_eq!(
        node.backend.served_inode(second),
        Some(connection),
        "same FUSE connection"
    );
    let status = node.manager.status(&target);
    assert_eq!(status.problem, None);
    assert_eq!(status.replacements, 1);
    assert!(status
        .last_replacement
        .is_some_and(|r| r.contains(&first.to_string())));
    let records = node.records();
    assert_eq!((records[0].pid, records[0].replacements), (second, 1));
    assert!(node.kernel.find(&target).is_some(), "the mount never left");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_busy_mount_is_detached_lazily_after_a_second() {
    let node = Node::new();
    let target = node.target("d");
    node.manager.mount(node.request("d")).await.unwrap();
    node.kernel.set_busy(&target, true);
    let started = Instant::now();
    node.manager.unmount(&target).await.unwrap();
    assert!(
        started.elapsed() >= Duration::from_millis(300),
        "waited for a plain unmount"
    );
    assert!(node.kernel.find(&target).is_none());
    assert!(node.records().is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_node_service_adopts_its_mounts_and_replaces_their_mounters() {
    let node = Node::new();
    let target = node.target("e");
    node.manager.mount(node.request("e")).await.unwrap();
    let first = node.backend.live()[0];
    // A record of a mount that is gone (not mounted, mounter dead) is forgotten.
    let gone = MountRecord {
        volume_id: "vol-gone".into(),
        target: node.target("gone"),
        pid: 42,
        pod: None,
        handoff_dir: node.scratch.0.join("state/handoff/gone"),
        replacements: 0,
        source: "bucket".into(),
        args: vec![],
    };
    std::fs::write(
        node.scratch.0.join("state/mounts/gone.state"),
        gone.to_json(),
    )
    .unwrap();
    std::fs::write(node.scratch.0.join("state/mounts/junk.state"), "{").unwrap();

    let restarted = Node::manager(&node.scratch, &node.kernel, &node.backend);
    assert_eq!(restarted.recover(), 1);
    assert_eq!(node.records().len(), 1, "gone and junk records dropped");
    let status = restarted.status(&target);
    assert_eq!(status.volume_id.as_deref(), Some("vol-e"));
    assert_eq!(status.problem, None);

    restarted.start_supervisor();
    node.backend.crash(first);
    eventually("the adopted mount's mounter is replaced", || {
        restarted.replacements_total() == 1 && node.backend.live().len() == 1
    })
    .await;
    restarted.unmount(&target).await.unwrap();
    assert!(node.kernel.find(&target).is_none());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn status_reports_a_mount_that_does_not_answer() {
    let node = Node::new();
    let target = node.target("f");
    node.kernel.add_mount(&target, "fuse.s3csi");
    node.kernel.set_health(&target, FakeHealth::NotConnected);
    let status = node.manager.status(&target);
    assert_eq!(status.volume_id, None);
    assert!(status.problem.is_some_and(|p| p.contains("not connected")));
    node.kernel.set_health(&target, FakeHealth::Serving);
    assert_eq!(node.manager.status(&target).problem, None);
    // Unpublish of a mount we did not make still unmounts it.
    node.manager.unmount(&target).await.unwrap();
    assert!(node.kernel.find(&target).is_none());
}

#[test]
fn failures_cross_the_handoff_directory_typed() {
    let dir = Scratch::new();
    assert_eq!(handoff::read_failure(&dir.0), None);
    let f = Failure::new(FailureKind::InvalidArgument, "unknown mount option \"x\"");
    handoff::record_failure(&dir.0, &f).unwrap();
    assert_eq!(handoff::read_failure(&dir.0), Some(f));
    // An older mounter's plain line is still read.
    std::fs::write(dir.0.join(handoff::FAILURE_FILE), "bucket gone\n").unwrap();
    assert_eq!(
        handoff::read_failure(&dir.0),
        Some(Failure::new(FailureKind::Other, "bucket gone"))
    );
    handoff::clear_failure(&dir.0);
    assert_eq!(handoff::read_failure(&dir.0), None);
}

#[test]
fn publishes_share_a_mounter_only_when_everything_that_shapes_the_mount_agrees() {
    let node = Node::new();
    let a = node.request("a");
    let mut b = a.clone();
    b.target = node.target("b");
    assert_eq!(a.share_key(), b.share_key(), "the target is not in the key");
    let variants: [fn(&mut MountRequest); 8] = [
        |r| r.volume_id = "vol-other".into(),
        |r| r.source = "bucket:other".into(),
        |r| r.args = vec!["--uid".into(), "2000".into()],
        |r| r.kernel.read_only = true,
        |r| r.keep_cache = true,
        |r| r.env = vec![("AWS_SECRET_ACCESS_KEY", "another-secret".into())],
        |r| r.pod_credentials = Some(pod_credentials("team-a/reader", "role/a", "t1")),
        |r| r.pod_credentials = Some(pod_credentials("team-b/writer", "role/a", "t1")),
    ];
    for change in variants {
        let mut other = a.clone();
        change(&mut other);
        assert_ne!(a.share_key(), other.share_key(), "{other:?}");
    }
    let key = a.share_key();
    assert!(key.starts_with("v-") && key.len() == 18, "{key}");
    // Pods of one service account share, whatever their tokens; another role does not.
    let with = |sa: &str, role: &str, token: &str| {
        let mut r = a.clone();
        r.pod_credentials = Some(pod_credentials(sa, role, token));
        r.share_key()
    };
    assert_eq!(
        with("team-a/reader", "role/a", "t1"),
        with("team-a/reader", "role/a", "t2")
    );
    assert_ne!(
        with("team-a/reader", "role/a", "t1"),
        with("team-a/reader", "role/b", "t1")
    );
}

fn pod_credentials(account: &str, role: &str, token: &str) -> super::PodCredentials {
    super::PodCredentials::new(
        account.into(),
        super::pod_credentials::TokenExchange::WebIdentity {
            role_arn: format!("arn:aws:iam::1:{role}"),
            session_name: "s3csi-test".into(),
            sts_endpoint_url: None,
        },
        token.into(),
    )
}

fn shared(node: &Node, manager: &Arc<MountManager>) -> SharedMounts {
    SharedMounts::new(
        manager.clone(),
        node.scratch.0.join("shared"),
        node.scratch.0.join("state/shares"),
    )
    .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn targets_of_one_share_use_one_mounter_until_the_last_goes() {
    let node = Node::new();
    let shares = shared(&node, &node.manager);
    let (a, b) = (node.target("a"), node.target("b"));
    let mut req = node.request("a");
    shares.mount(req.clone()).await.unwrap();
    req.target = b.clone();
    shares.mount(req.clone()).await.unwrap();
    assert_eq!(node.backend.live().len(), 1);
    assert_eq!((shares.mounter_count(), shares.target_count()), (1, 2));
    for t in [&a, &b] {
        assert!(node.kernel.find(t).is_some_and(|e| e.is_fuse()));
        assert_eq!(shares.status(t).volume_id.as_deref(), Some("vol-a"));
        assert_eq!(shares.status(t).problem, None);
    }

    // A restarted node service finds both targets of the adopted mounter.
    let manager = Node::manager(&node.scratch, &node.kernel, &node.backend);
    assert_eq!(manager.recover(), 1);
    let shares = shared(&node, &manager);
    assert_eq!(shares.recover(), 2);
    shares.reconcile().await.unwrap();
    assert_eq!(node.backend.live().len(), 1, "nothing stopped");

    shares.unmount(&a).await.unwrap();
    assert!(node.kernel.find(&a).is_none());
    assert_eq!(shares.status(&b).problem, None);
    assert_eq!(node.backend.live().len(), 1);
    shares.unmount(&b).await.unwrap();
    assert!(
        node.kernel.mounts().is_empty(),
        "{:?}",
        node.kernel.mounts()
    );
    eventually("the mounter stops", || node.backend.live().is_empty()).await;
    assert_eq!(shares.target_count(), 0);
    assert!(std::fs::read_dir(node.scratch.0.join("state/shares"))
        .unwrap()
        .next()
        .is_none());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_shared_mount_whose_targets_went_while_no_node_service_ran_is_stopped() {
    let node = Node::new();
    let shares = shared(&node, &node.manager);
    let a = node.target("a");
    shares.mount(node.request("a")).await.unwrap();
    // The pod's bind goes (kubelet cleaned up) while the node service is down.
    node.kernel.unmount(&a, false).unwrap();
    let manager = Node::manager(&node.scratch, &node.kernel, &node.backend);
    manager.recover();
    let shares = shared(&node, &manager);
    assert_eq!(shares.recover(), 0);
    shares.reconcile().await.unwrap();
    eventually("the unused mounter stops", || {
        node.backend.live().is_empty()
    })
    .await;
    assert!(node.kernel.mounts().is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kept_caches_go_only_when_no_mount_used_them_for_the_idle_time() {
    let node = Node::new();
    let kept = |name: &str| {
        node.scratch
            .0
            .join("state/cache")
            .join(key_for(Path::new(&format!("vol-{name}"))))
    };
    let with_cache = |name: &str| MountRequest {
        keep_cache: true,
        ..node.request(name)
    };
    // "old": kept, unpublished, then idle for two days; "busy": idle as long, but mounted
    // again; "recent": unpublished just now.
    for name in ["old", "busy", "recent"] {
        node.manager.mount(with_cache(name)).await.unwrap();
        let data = kept(name).join("data");
        assert!(data.is_dir(), "{}", data.display());
        std::fs::write(data.join("blocks"), vec![7u8; 64 * 1024]).unwrap();
        if name != "busy" {
            node.manager.unmount(&node.target(name)).await.unwrap();
        }
    }
    let two_days_ago = std::time::SystemTime::now() - Duration::from_secs(2 * 86_400);
    for name in ["old", "busy"] {
        let last_used = std::fs::File::options()
            .write(true)
            .open(kept(name).join(super::manager::LAST_USED))
            .unwrap();
        last_used.set_modified(two_days_ago).unwrap();
    }

    let freed = node
        .manager
        .collect_kept_caches(Duration::from_secs(86_400));
    assert!(freed >= 64 * 1024, "freed {freed}");
    assert!(
        !kept("old").exists(),
        "idle for two days, no mount: removed"
    );
    assert!(
        kept("busy").join("data/blocks").exists(),
        "a mount links it"
    );
    assert!(
        kept("recent").join("data/blocks").exists(),
        "used a moment ago"
    );

    // The busy one's idle time starts at its unpublish.
    node.manager.unmount(&node.target("busy")).await.unwrap();
    assert_eq!(
        node.manager
            .collect_kept_caches(Duration::from_secs(86_400)),
        0
    );
    assert!(kept("busy").exists());
    // A publish finds its kept cache again after an earlier collection removed another.
    node.manager.mount(with_cache("old")).await.unwrap();
    assert!(kept("old").join("data").is_dir());
}
