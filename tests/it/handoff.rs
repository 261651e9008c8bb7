//! Mounts that outlive their processes: the node service mounts by descriptor, keeps a
//! duplicate, replaces a mounter killed with SIGKILL, and re-collects descriptors after
//! its own SIGKILL. Real `s3csi csi` and `s3csi mount` processes, real FUSE mounts, the
//! moto S3 server; the CSI calls go over the unix socket as kubelet makes them.

use crate::common;

use common::node_service::{publish_req, read, wait_replaced, CsiServer};
use common::{is_mountpoint, new_bucket, s3, s3_get, scratch_dir};
use s3csi::csi::pb;
use std::io::Read;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::fs::MetadataExt;
use std::path::Path;
use std::time::{Duration, Instant};

fn kill9(pid: u32) {
    unsafe {
        libc::kill(pid as i32, libc::SIGKILL);
    }
}

fn open_dir(path: &Path) -> OwnedFd {
    let c = std::ffi::CString::new(path.as_os_str().as_encoded_bytes()).unwrap();
    let fd = unsafe { libc::open(c.as_ptr(), libc::O_RDONLY | libc::O_DIRECTORY) };
    assert!(
        fd >= 0,
        "open {}: {}",
        path.display(),
        std::io::Error::last_os_error()
    );
    unsafe { OwnedFd::from_raw_fd(fd) }
}

fn fstat_ino(fd: &OwnedFd) -> std::io::Result<u64> {
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    if unsafe { libc::fstat(fd.as_raw_fd(), &mut st) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(st.st_ino)
}

fn read_at(dir: &OwnedFd, name: &str) -> std::io::Result<Vec<u8>> {
    let c = std::ffi::CString::new(name).unwrap();
    let fd = unsafe { libc::openat(dir.as_raw_fd(), c.as_ptr(), libc::O_RDONLY) };
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    let mut f = unsafe { std::fs::File::from_raw_fd(fd) };
    let mut out = vec![];
    f.read_to_end(&mut out)?;
    Ok(out)
}

fn wait_for_object(bucket: &str, key: &str) -> Vec<u8> {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        if let Some(v) = s3_get(bucket, key) {
            return v;
        }
        assert!(Instant::now() < deadline, "{key} never appeared in S3");
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// Files (not only directories) held open for reading and for writing across `kill -9` of
/// the mounter process, then a second kill while a close waits for S3: see
/// [`common::crash::files_open_across_mounter_kills`].
#[test]
fn files_open_across_mounter_kills_answer_every_call() {
    let server = CsiServer::start_in(scratch_dir("handoff-files"));
    let bucket = new_bucket("handoff-files");
    let target = server.target("files");
    let rt = tokio::runtime::Runtime::new().unwrap();
    let mut node = rt.block_on(server.node());
    common::crash::files_open_across_mounter_kills(&rt, &mut node, &bucket, &target, || {
        let pid = server.mounter_pid();
        kill9(pid);
        common::crash::wait_dead(pid);
    });
    drop(server);
}

#[test]
fn killed_mounter_is_replaced_and_the_workload_carries_on() {
    let server = CsiServer::start_in(scratch_dir("handoff-kill"));
    let bucket = new_bucket("handoff-kill");
    let target = server.target("w");
    let rt = tokio::runtime::Runtime::new().unwrap();
    let mut node = rt.block_on(server.node());
    rt.block_on(node.node_publish_volume(publish_req(&bucket, &target)))
        .unwrap();
    // The node service mounted it, and says so.
    let entry = read(Path::new("/proc/self/mountinfo"))
        .lines()
        .find(|l| l.split(' ').nth(4) == Some(target.to_str().unwrap()))
        .map(str::to_string)
        .unwrap();
    assert!(entry.contains(" - fuse.s3csi s3csi:"), "{entry}");

    // The workload: files written before, a directory it holds open, a file it opened.
    std::fs::write(target.join("before.txt"), b"written before").unwrap();
    std::fs::create_dir(target.join("work")).unwrap();
    std::fs::write(target.join("work/a.txt"), b"in work").unwrap();
    std::fs::write(target.join("work/unread.txt"), b"opened, never read").unwrap();
    let held = open_dir(&target.join("work"));
    let ino = fstat_ino(&held).unwrap();
    let open_file = std::fs::File::open(target.join("work/unread.txt")).unwrap();
    let old_pid = server.mounter_pid();

    kill9(old_pid);
    // kill(2) returns before the process is gone; ask the node service only once it is.
    common::crash::wait_dead(old_pid);
    let abnormal = rt.block_on(wait_replaced(&mut node, &bucket, &target, 1));
    eprintln!("conditions while replacing: {abnormal:?}");
    assert!(
        abnormal.iter().any(|m| m.contains(&old_pid.to_string())),
        "stats never reported the dead mounter: {abnormal:?}"
    );
    let new_pid = server.mounter_pid();
    assert_ne!(new_pid, old_pid);

    // Let the kernel's attribute and entry caches (1 s) expire: what follows reaches the
    // replacement, with inode numbers the dead mounter handed out.
    std::thread::sleep(Duration::from_millis(1500));
    let names: Vec<String> = std::fs::read_dir(&target)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    assert!(
        names.contains(&"before.txt".to_string()) && names.contains(&"work".to_string()),
        "{names:?}"
    );
    assert_eq!(
        std::fs::read(target.join("before.txt")).unwrap(),
        b"written before"
    );
    assert_eq!(
        fstat_ino(&held).unwrap(),
        ino,
        "the held directory changed inode"
    );
    assert_eq!(std::fs::metadata(target.join("work")).unwrap().ino(), ino);
    assert_eq!(read_at(&held, "a.txt").unwrap(), b"in work");
    // New files, through the held directory and by path.
    let c = std::ffi::CString::new("new.txt").unwrap();
    let fd = unsafe {
        libc::openat(
            held.as_raw_fd(),
            c.as_ptr(),
            libc::O_WRONLY | libc::O_CREAT | libc::O_TRUNC,
            0o644,
        )
    };
    assert!(
        fd >= 0,
        "openat O_CREAT: {}",
        std::io::Error::last_os_error()
    );
    let mut f = unsafe { std::fs::File::from_raw_fd(fd) };
    std::io::Write::write_all(&mut f, b"written after").unwrap();
    common::close_checked(f).unwrap();
    std::fs::write(target.join("after.txt"), b"after, by path").unwrap();
    assert_eq!(read_at(&held, "new.txt").unwrap(), b"written after");
    assert_eq!(wait_for_object(&bucket, "work/new.txt"), b"written after");
    assert_eq!(wait_for_object(&bucket, "after.txt"), b"after, by path");
    // A file handle of the dead mounter is gone: EBADF, not someone else's file.
    let mut buf = [0u8; 16];
    let err = (&open_file).read(&mut buf).unwrap_err();
    assert_eq!(err.raw_os_error(), Some(libc::EBADF), "{err}");
    drop(open_file);

    let log = server.log_text();
    assert!(
        log.contains("mounter died; starting a replacement"),
        "{log}"
    );
    assert!(log.contains("replacement mounter serving"), "{log}");
    drop(held);
    rt.block_on(node.node_unpublish_volume(pb::NodeUnpublishVolumeRequest {
        volume_id: bucket.clone(),
        target_path: target.to_string_lossy().to_string(),
    }))
    .unwrap();
    assert!(!is_mountpoint(&target) && !target.exists());
    drop(server);
}

#[test]
fn mounts_survive_a_node_service_kill_and_the_new_one_can_replace_mounters() {
    let dir = scratch_dir("handoff-restart");
    let mut first = CsiServer::start_in(dir.clone());
    let bucket = new_bucket("handoff-restart");
    let target = first.target("r");
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        first
            .node()
            .await
            .node_publish_volume(publish_req(&bucket, &target))
            .await
    })
    .unwrap();
    std::fs::write(target.join("before.txt"), b"1").unwrap();
    let held = open_dir(&target);
    first.kill9();
    // The mount keeps serving without its node service.
    std::fs::write(target.join("during.txt"), b"2").unwrap();
    assert_eq!(std::fs::read(target.join("before.txt")).unwrap(), b"1");
    assert_eq!(wait_for_object(&bucket, "during.txt"), b"2");

    let second = CsiServer::start_in(dir);
    let mut node = rt.block_on(second.node());
    let log = second.log_text();
    assert!(
        log.contains("adopted mount") && log.contains("descriptor=true"),
        "{log}"
    );
    // The adopted mounter dies: the new node service replaces it with the collected descriptor.
    let pid = second.mounter_pid();
    kill9(pid);
    rt.block_on(wait_replaced(&mut node, &bucket, &target, 1));
    std::thread::sleep(Duration::from_millis(1200));
    assert_eq!(std::fs::read(target.join("before.txt")).unwrap(), b"1");
    assert_eq!(std::fs::read(target.join("during.txt")).unwrap(), b"2");
    assert_eq!(read_at(&held, "during.txt").unwrap(), b"2");
    std::fs::write(target.join("after.txt"), b"3").unwrap();
    assert_eq!(wait_for_object(&bucket, "after.txt"), b"3");
    drop(held);
    rt.block_on(node.node_unpublish_volume(pb::NodeUnpublishVolumeRequest {
        volume_id: bucket.clone(),
        target_path: target.to_string_lossy().to_string(),
    }))
    .unwrap();
    assert!(!is_mountpoint(&target));
    drop(second);
    drop(first);
}

#[test]
fn a_call_in_flight_when_the_mounter_dies_is_answered_by_the_replacement() {
    use common::fault_proxy::{Fault, FaultProxy, Rule};
    use s3csi::s3::ObjectClient;
    let server = CsiServer::start_in(scratch_dir("handoff-inflight"));
    let bucket = new_bucket("handoff-inflight");
    common::runtime()
        .block_on(
            common::client(&bucket).put_object("slow.txt", bytes::Bytes::from_static(b"slow")),
        )
        .unwrap();
    // The first HEAD of slow.txt never gets an answer: the mounter that sent it is stuck.
    let proxy = FaultProxy::start(&s3().endpoint, 7);
    let rule = proxy.add_rule(
        Rule::new(
            |r| r.method == "HEAD" && r.path.ends_with("/slow.txt"),
            1.0,
            Fault::Stall,
        )
        .limit(1),
    );
    proxy.enable(true);
    let target = server.target("f");
    let rt = tokio::runtime::Runtime::new().unwrap();
    let mut node = rt.block_on(server.node());
    let mut req = publish_req(&bucket, &target);
    req.volume_context
        .insert("endpointUrl".to_string(), proxy.endpoint());
    rt.block_on(node.node_publish_volume(req)).unwrap();

    let path = target.join("slow.txt");
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(std::fs::metadata(&path).map(|m| m.len()));
    });
    let deadline = Instant::now() + Duration::from_secs(10);
    while rule.fired() == 0 {
        assert!(Instant::now() < deadline, "the lookup never reached S3");
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(
        rx.recv_timeout(Duration::from_millis(300)).is_err(),
        "the stat did not wait"
    );
    kill9(server.mounter_pid());
    rt.block_on(wait_replaced(&mut node, &bucket, &target, 1));
    // The kernel resent the unanswered lookup to the replacement, which answered it.
    let size = rx
        .recv_timeout(Duration::from_secs(10))
        .expect("the stat in flight at the crash never returned")
        .expect("the stat in flight at the crash failed");
    assert_eq!(size, 4);
    rt.block_on(node.node_unpublish_volume(pb::NodeUnpublishVolumeRequest {
        volume_id: bucket.clone(),
        target_path: target.to_string_lossy().to_string(),
    }))
    .unwrap();
    drop(server);
}
