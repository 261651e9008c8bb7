//! POSIX metadata over a real mount on moto (issue 16): chmod/chown/utimes survive a
//! remount, symlinks and fifos, `tar x` + `tar d` and `rsync -a` keep modes, owners and
//! times, and the real s3fs binary (Debian's 1.90) reads what s3csi wrote and the other
//! way round.

use crate::common;

use common::*;
use s3csi::s3::ObjectClient;
use std::fs;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::Path;
use std::process::Command;
use std::time::Duration;

fn head_meta(bucket: &str, key: &str) -> s3csi::s3::UserMeta {
    let c = client(bucket);
    runtime()
        .block_on(c.head_object_with_meta(key))
        .unwrap_or_else(|e| panic!("HEAD {key}: {e}"))
        .1
}

fn run(cmd: &mut Command) -> String {
    let out = cmd.output().expect("spawn");
    assert!(
        out.status.success(),
        "{cmd:?}: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn sh(dir: &Path, script: &str) -> String {
    run(Command::new("sh").arg("-ec").arg(script).current_dir(dir))
}

#[test]
fn chmod_chown_touch_symlinks_and_fifos_survive_a_remount() {
    let bucket = new_bucket("meta-remount");
    let mut m = Mount::start(&bucket, &[]);
    sh(
        &m.dir,
        "echo hi > f; chown 1234:5678 f; chmod 4751 f; touch -d '2020-01-02 03:04:05.25' f; \
         mkdir -m 705 d; ln -s ../f d/lnk; mkfifo -m 640 d/fifo; chmod 700 d",
    );
    // The saves are coalesced and sent shortly after; unmount waits for them.
    m.stop();
    let h = head_meta(&bucket, "f");
    assert_eq!(h["mode"], (libc::S_IFREG | 0o4751).to_string());
    assert_eq!((h["uid"].as_str(), h["gid"].as_str()), ("1234", "5678"));
    assert_eq!(h["mtime"], "1577934245.250000000");
    assert_eq!(
        head_meta(&bucket, "d/")["mode"],
        "448",
        "s3fs's dir mode: no S_IFDIR"
    );
    assert_eq!(head_meta(&bucket, "d/lnk")["mode"], "41471");
    let m = Mount::start(&bucket, &[]);
    let f = fs::metadata(m.path("f")).unwrap();
    assert_eq!(f.permissions().mode() & 0o7777, 0o4751);
    assert_eq!((f.uid(), f.gid()), (1234, 5678));
    assert_eq!((f.mtime(), f.mtime_nsec()), (1577934245, 250_000_000));
    assert_eq!(
        fs::metadata(m.path("d")).unwrap().permissions().mode() & 0o7777,
        0o700
    );
    assert_eq!(
        fs::read_link(m.path("d/lnk")).unwrap().to_str(),
        Some("../f")
    );
    assert_eq!(fs::read(m.path("d/lnk")).unwrap(), b"hi\n", "followed");
    let fifo = fs::symlink_metadata(m.path("d/fifo")).unwrap();
    assert!(std::os::unix::fs::FileTypeExt::is_fifo(&fifo.file_type()));
    assert_eq!(fifo.permissions().mode() & 0o777, 0o640);
    assert_eq!(
        fs::hard_link(m.path("f"), m.path("hard"))
            .unwrap_err()
            .raw_os_error(),
        Some(libc::EPERM)
    );
}

/// A tree with what tar and rsync must keep: modes (setgid, sticky, executable bits,
/// read-only), owners, times in the past, symlinks, empty directories.
fn make_tree(root: &Path) {
    fs::create_dir_all(root).unwrap();
    sh(
        root,
        "mkdir -p a/b empty sticky; echo one > a/one; printf 'x%.0s' $(seq 3000) > a/b/big; \
         echo '#!/bin/sh' > run.sh; chmod 755 run.sh; chmod 2750 a; chmod 1777 sticky; \
         chmod 400 a/one; ln -s a/one link; ln -s /nowhere dangling; \
         chown -h 101:202 a/one link; chown 303:404 a/b; \
         touch -h -d '2001-02-03 04:05:06' a/one a/b/big run.sh link a/b empty sticky a",
    );
}

#[test]
fn tar_x_then_tar_d_and_rsync_a_twice_keep_everything() {
    let bucket = new_bucket("meta-tar");
    let src = scratch_dir("tar-src");
    make_tree(&src.join("t"));
    let tarball = src.join("t.tar");
    run(Command::new("tar")
        .args(["-cf"])
        .arg(&tarball)
        .arg("-C")
        .arg(&src)
        .arg("t"));
    let m = Mount::start(&bucket, &[]);
    run(Command::new("tar")
        .arg("-xpf")
        .arg(&tarball)
        .arg("-C")
        .arg(&m.dir));
    // tar d compares contents, modes, owners, mtimes and symlink targets.
    let diff = Command::new("tar")
        .arg("-df")
        .arg(&tarball)
        .arg("-C")
        .arg(&m.dir)
        .output()
        .unwrap();
    assert!(
        diff.status.success(),
        "tar d found differences: {}{}",
        String::from_utf8_lossy(&diff.stdout),
        String::from_utf8_lossy(&diff.stderr)
    );
    // rsync -a onto the mount twice: the second run has nothing to transfer.
    let dst = m.path("r");
    let rsync = |extra: &str| {
        run(Command::new("rsync")
            .args(["-a", "--itemize-changes", extra])
            .arg(format!("{}/", src.join("t").display()))
            .arg(&dst))
    };
    rsync("--stats");
    std::thread::sleep(Duration::from_millis(300));
    let second = rsync("--out-format=%i %n");
    let changed: Vec<&str> = second.lines().filter(|l| !l.trim().is_empty()).collect();
    assert!(changed.is_empty(), "second rsync -a changed: {changed:?}");
    drop(m);
    // After a remount too (everything came from S3 this time).
    let m = Mount::start(&bucket, &[]);
    let diff = Command::new("tar")
        .arg("-df")
        .arg(&tarball)
        .arg("-C")
        .arg(&m.dir)
        .output()
        .unwrap();
    assert!(
        diff.status.success(),
        "after remount: {}",
        String::from_utf8_lossy(&diff.stdout)
    );
    let _ = fs::remove_dir_all(&src);
}

/// Mounts `bucket` with the real s3fs on the shared moto; `None` (and a message) when
/// s3fs is not installed.
struct S3fs {
    dir: std::path::PathBuf,
}

impl S3fs {
    fn start(bucket: &str) -> Option<S3fs> {
        if Command::new("s3fs").arg("--version").output().is_err() {
            eprintln!("s3fs is not installed (apt-get install s3fs): interoperability not checked");
            return None;
        }
        let dir = scratch_dir("s3fs");
        let passwd = dir.with_extension("passwd");
        fs::write(&passwd, format!("{}:{}\n", ACCESS_KEY, SECRET_KEY)).unwrap();
        fs::set_permissions(&passwd, fs::Permissions::from_mode(0o600)).unwrap();
        let opts = format!(
            "url={},use_path_request_style,passwd_file={},use_xattr,stat_cache_expire=1",
            s3().endpoint,
            passwd.display()
        );
        run(Command::new("s3fs")
            .arg(bucket)
            .arg(&dir)
            .arg("-o")
            .arg(opts));
        for _ in 0..100 {
            if is_mountpoint(&dir) {
                return Some(S3fs { dir });
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        panic!("s3fs did not mount");
    }
}

impl Drop for S3fs {
    fn drop(&mut self) {
        let _ = Command::new("fusermount3")
            .arg("-u")
            .arg(&self.dir)
            .status();
    }
}

#[test]
fn s3fs_reads_what_s3csi_wrote_and_the_other_way_round() {
    let bucket = new_bucket("meta-s3fs");
    let mut m = Mount::start(&bucket, &[]);
    sh(
        &m.dir,
        "mkdir -m 750 ours; echo data > ours/f; chown 42:43 ours/f; chmod 640 ours/f; \
         touch -d '2001-02-03 04:05:06.5' ours/f; ln -s f ours/l; mkfifo ours/p",
    );
    m.stop();
    let Some(s) = S3fs::start(&bucket) else {
        return;
    };
    let stat = |p: &str| fs::symlink_metadata(s.dir.join(p)).unwrap();
    let f = stat("ours/f");
    assert_eq!(f.permissions().mode() & 0o7777, 0o640);
    assert_eq!((f.uid(), f.gid(), f.mtime()), (42, 43, 981173106));
    assert_eq!(stat("ours").permissions().mode() & 0o7777, 0o750);
    assert!(stat("ours/l").file_type().is_symlink());
    assert_eq!(
        fs::read_link(s.dir.join("ours/l")).unwrap().to_str(),
        Some("f")
    );
    assert!(std::os::unix::fs::FileTypeExt::is_fifo(
        &stat("ours/p").file_type()
    ));
    // And what s3fs writes, s3csi shows.
    sh(
        &s.dir,
        "mkdir -m 705 theirs; echo x > theirs/g; chown 7:8 theirs/g; chmod 4711 theirs/g; \
         touch -d '2010-01-01 00:00:01' theirs/g; ln -s ../ours/f theirs/l; mkfifo theirs/p",
    );
    let set = Command::new("python3")
        .arg("-c")
        .arg("import os,sys; os.setxattr(sys.argv[1], 'user.k', b'v\\x00w')")
        .arg(s.dir.join("theirs/g"))
        .status()
        .unwrap();
    assert!(set.success());
    drop(s);
    let m = Mount::start(&bucket, &[]);
    let stat = |p: &str| fs::symlink_metadata(m.path(p)).unwrap();
    let g = stat("theirs/g");
    assert_eq!(g.permissions().mode() & 0o7777, 0o4711);
    assert_eq!((g.uid(), g.gid(), g.mtime()), (7, 8, 1262304001));
    assert_eq!(stat("theirs").permissions().mode() & 0o7777, 0o705);
    assert_eq!(
        fs::read_link(m.path("theirs/l")).unwrap().to_str(),
        Some("../ours/f")
    );
    assert_eq!(fs::read(m.path("theirs/l")).unwrap(), b"data\n");
    assert!(std::os::unix::fs::FileTypeExt::is_fifo(
        &stat("theirs/p").file_type()
    ));
    let x = Command::new("python3")
        .arg("-c")
        .arg("import os,sys; print(os.getxattr(sys.argv[1], 'user.k'))")
        .arg(m.path("theirs/g"))
        .output()
        .unwrap();
    assert_eq!(String::from_utf8_lossy(&x.stdout).trim(), "b'v\\x00w'");
}

#[test]
fn ignore_metadata_shows_the_mount_defaults() {
    let bucket = new_bucket("meta-ignore");
    let c = client(&bucket);
    let h: s3csi::s3::UserMeta = [("mode", "33216"), ("uid", "5")]
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    runtime()
        .block_on(c.put_object_with_meta("f", bytes::Bytes::from_static(b"x"), &h))
        .unwrap();
    let m = Mount::start(&bucket, &["--ignore-metadata", "--file-mode", "0640"]);
    let f = fs::metadata(m.path("f")).unwrap();
    assert_eq!(f.permissions().mode() & 0o7777, 0o640);
    assert_ne!(f.uid(), 5);
    let m2 = Mount::start(&bucket, &[]);
    let f = fs::metadata(m2.path("f")).unwrap();
    assert_eq!((f.permissions().mode() & 0o7777, f.uid()), (0o700, 5));
    drop(m);
}

/// Runs `script` (Python) as uid/gid 65534 with `path` as its argument; its stdout, or
/// the errno name it failed with.
fn as_nobody(script: &str, path: &Path) -> String {
    let out = Command::new("python3")
        .arg("-c")
        .arg(format!(
            "import os, sys, errno\nos.setgid(65534); os.setuid(65534)\np = sys.argv[1]\n\
             try:\n{}\nexcept OSError as e:\n    print(errno.errorcode[e.errno])",
            script
                .lines()
                .map(|l| format!("    {l}\n"))
                .collect::<String>()
        ))
        .arg(path)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).trim().to_string()
}

/// The kernel enforces the stored mode and owner (`default_permissions`) unless the mount
/// says `--no-default-permissions`; the mode stays stored and shown either way.
#[test]
fn default_permissions_can_be_turned_off() {
    let bucket = new_bucket("meta-perms");
    let write = "open(p, 'a').write('x'); print(open(p).read())";
    {
        let m = Mount::start(&bucket, &["--allow-other"]);
        sh(&m.dir, "echo secret > f; chmod 600 f");
        assert_eq!(as_nobody(write, &m.path("f")), "EACCES");
    }
    let m = Mount::start(&bucket, &["--allow-other", "--no-default-permissions"]);
    assert_eq!(as_nobody(write, &m.path("f")), "secret\nx");
    let f = fs::metadata(m.path("f")).unwrap();
    assert_eq!((f.permissions().mode() & 0o7777, f.uid()), (0o600, 0));
}

/// Strict mode (`--metadata-ttl 0`): whatever another client did through the S3 API just
/// before is what the mount shows next, as s3fs's "external change" tests expect.
#[test]
fn strict_mode_shows_other_clients_changes_at_once() {
    use std::os::unix::fs::FileTypeExt;
    let bucket = new_bucket("meta-strict");
    let c = client(&bucket);
    let put = |key: &str, body: &'static [u8], meta: &[(&str, &str)]| {
        let h: s3csi::s3::UserMeta = meta
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        runtime()
            .block_on(c.put_object_with_meta(key, bytes::Bytes::from_static(body), &h))
            .unwrap();
    };
    let m = Mount::start(&bucket, &["--metadata-ttl", "0"]);
    let names = || -> Vec<String> {
        let mut v: Vec<String> = fs::read_dir(&m.dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .collect();
        v.sort();
        v
    };
    // Created after a negative lookup and after a listing.
    assert!(fs::metadata(m.path("f")).is_err());
    assert_eq!(names(), Vec::<String>::new());
    put("f", b"one", &[]);
    assert_eq!(fs::read(m.path("f")).unwrap(), b"one");
    assert_eq!(names(), ["f"]);
    // Replaced with the same size, then another size.
    put("f", b"two", &[]);
    assert_eq!(fs::read(m.path("f")).unwrap(), b"two");
    put("f", b"three", &[]);
    assert_eq!(fs::read(m.path("f")).unwrap(), b"three");
    // Its metadata changed.
    put("f", b"three", &[("mode", "33152"), ("uid", "4321")]);
    let a = fs::metadata(m.path("f")).unwrap();
    assert_eq!((a.permissions().mode() & 0o7777, a.uid()), (0o600, 4321));
    // Deleted, then re-created.
    runtime().block_on(c.delete_object("f")).unwrap();
    assert!(fs::metadata(m.path("f")).is_err());
    assert_eq!(names(), Vec::<String>::new());
    put("f", b"back", &[]);
    assert_eq!(fs::read(m.path("f")).unwrap(), b"back");
    // A directory, a symlink and a fifo made by another client.
    put("d/x", b"x", &[]);
    put("lnk", b"d/x", &[("mode", "41471")]);
    put("fifo", b"", &[("mode", "4516")]);
    assert!(fs::metadata(m.path("d")).unwrap().is_dir());
    assert_eq!(fs::read_link(m.path("lnk")).unwrap(), Path::new("d/x"));
    assert!(fs::symlink_metadata(m.path("fifo"))
        .unwrap()
        .file_type()
        .is_fifo());
    assert_eq!(names(), ["d", "f", "fifo", "lnk"]);
}

/// `cp -a` of a tree with a symlink, an executable, a setgid directory and old times, and
/// `git clone` of a repository with a symlink and an executable: both keep everything.
#[test]
fn cp_a_and_git_clone_keep_symlinks_modes_and_times() {
    let bucket = new_bucket("meta-cpa");
    let src = scratch_dir("cpa-src");
    make_tree(&src);
    let m = Mount::start(&bucket, &[]);
    run(Command::new("cp").arg("-a").arg(&src).arg(m.path("copy")));
    let listing = |dir: &Path| {
        sh(
            dir,
            "find . -printf '%p %y %m %U:%G %s %TY-%Tm-%Td %TH:%TM:%TS %l\\n' | sort",
        )
    };
    // Directory sizes differ by file system.
    let strip = |s: String| {
        s.lines()
            .map(|l| {
                let f: Vec<&str> = l.split(' ').collect();
                match f.get(1) {
                    Some(&"d") => format!("{} {} {} {}", f[0], f[1], f[2], f[3]),
                    _ => l.to_string(),
                }
            })
            .collect::<Vec<_>>()
            .join("\n")
    };
    assert_eq!(strip(listing(&m.path("copy"))), strip(listing(&src)));
    if Command::new("git").arg("--version").output().is_err() {
        eprintln!("git not installed: the git part is skipped");
        return;
    }
    let repo = scratch_dir("cpa-repo");
    sh(
        &repo,
        "git init -q; printf '#!/bin/sh\\necho ok\\n' > run.sh; chmod 755 run.sh; \
         echo data > data.txt; ln -s data.txt link; git add .; \
         git -c user.name=t -c user.email=t@t commit -qm first",
    );
    sh(
        &m.dir,
        &format!("git clone -q {} clone", repo.to_str().unwrap()),
    );
    let clone = m.path("clone");
    assert_eq!(sh(&clone, "./run.sh").trim(), "ok");
    assert_eq!(
        fs::read_link(clone.join("link")).unwrap(),
        Path::new("data.txt")
    );
    assert_eq!(sh(&clone, "git status --porcelain").trim(), "");
    assert_eq!(
        fs::metadata(clone.join("data.txt"))
            .unwrap()
            .permissions()
            .mode()
            & 0o111,
        0
    );
}

#[test]
fn names_longer_than_255_bytes_from_other_clients_are_listed_read_and_removed() {
    let bucket = new_bucket("meta-longname");
    let c = client(&bucket);
    let long = "n".repeat(300);
    runtime()
        .block_on(c.put_object(&format!("d/{long}"), bytes::Bytes::from_static(b"long")))
        .unwrap();
    let m = Mount::start(&bucket, &[]);
    let listed = sh(&m.path("d"), "ls");
    assert_eq!(listed.trim(), long);
    assert_eq!(fs::read(m.path("d").join(&long)).unwrap(), b"long");
    fs::remove_file(m.path("d").join(&long)).unwrap();
    // (A DELETE may be sent in the background: see deferred_delete.rs.)
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while runtime()
        .block_on(c.head_object(&format!("d/{long}")))
        .is_ok()
    {
        assert!(
            std::time::Instant::now() < deadline,
            "the object is still there"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    // Names this mount creates keep NAME_MAX.
    let err = fs::write(m.path("d").join(&long), b"x").unwrap_err();
    assert_eq!(err.raw_os_error(), Some(libc::ENAMETOOLONG));
}

/// Issue 40.3, through a real mount on moto: what older s3fs versions and Hadoop wrote.
#[test]
fn older_s3fs_and_hadoop_directory_objects_are_directories() {
    let bucket = new_bucket("meta-olddirs");
    let c = client(&bucket);
    let h: s3csi::s3::UserMeta = [
        (s3csi::s3::CONTENT_TYPE, "application/x-directory"),
        ("mode", "16877"),
    ]
    .iter()
    .map(|(k, v)| (k.to_string(), v.to_string()))
    .collect();
    let rt = runtime();
    rt.block_on(c.put_object_with_meta("old", bytes::Bytes::new(), &h))
        .unwrap();
    rt.block_on(c.put_object("hadoop_$folder$", bytes::Bytes::new()))
        .unwrap();
    let m = Mount::start(&bucket, &[]);
    assert_eq!(
        sh(&m.dir, "stat -c %F old hadoop").trim(),
        "directory\ndirectory"
    );
    assert_eq!(sh(&m.dir, "ls -p").trim(), "hadoop/\nold/");
    sh(&m.dir, "touch old/f && rmdir hadoop");
    assert_eq!(sh(&m.path("old"), "ls").trim(), "f");
    sh(&m.dir, "rm old/f && rmdir old");
    // (DELETEs may be sent in the background: see deferred_delete.rs.)
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    for key in ["old", "hadoop_$folder$"] {
        while rt.block_on(c.head_object(key)).is_ok() {
            assert!(std::time::Instant::now() < deadline, "{key} is still there");
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

/// Issue 40.7, `--posix-acl` through a real mount on moto: the kernel enforces what
/// setfacl sets, the ACL survives a remount in s3fs's xattr header, chmod moves its mask,
/// and a directory's default ACL is inherited by what is created in it.
#[test]
fn posix_acls_are_enforced_stored_and_inherited() {
    let bucket = new_bucket("meta-acl");
    let read = "print(open(p).read().strip())";
    {
        let m = Mount::start(&bucket, &["--allow-other"]);
        sh(&m.dir, "echo one > f");
        let out = Command::new("setfacl")
            .args(["-m", "u:65534:r"])
            .arg(m.path("f"))
            .output()
            .unwrap();
        assert!(
            !out.status.success(),
            "ACLs are refused without --posix-acl"
        );
    }
    let m = Mount::start(&bucket, &["--allow-other", "--posix-acl"]);
    sh(&m.dir, "chmod 600 f");
    assert_eq!(as_nobody(read, &m.path("f")), "EACCES");
    sh(&m.dir, "setfacl -m u:65534:r f");
    assert_eq!(as_nobody(read, &m.path("f")), "one");
    assert_eq!(
        sh(&m.dir, "stat -c %a f").trim(),
        "640",
        "the mask shows as the group bits"
    );
    // chmod g-r clears the mask: the named entry no longer grants anything.
    sh(&m.dir, "chmod 600 f");
    assert_eq!(as_nobody(read, &m.path("f")), "EACCES");
    sh(&m.dir, "chmod 640 f");
    sh(
        &m.dir,
        "mkdir d && setfacl -d -m u:65534:rwx d && umask 077 && echo two > d/new && mkdir d/sub",
    );
    assert_eq!(as_nobody(read, &m.path("d/new")), "two");
    let new_acl = sh(&m.dir, "getfacl -cpn d/new");
    assert!(new_acl.contains("user:65534:rwx"), "{new_acl}");
    assert!(
        new_acl.contains("mask::rw-"),
        "limited by the mode: {new_acl}"
    );
    let sub = sh(&m.dir, "getfacl -cpn d/sub");
    assert!(sub.contains("default:user:65534:rwx"), "{sub}");
    assert!(
        head_meta(&bucket, "f").contains_key("xattr"),
        "stored as s3fs stores xattrs"
    );
    drop(m);

    let m = Mount::start(&bucket, &["--allow-other", "--posix-acl"]);
    assert_eq!(as_nobody(read, &m.path("f")), "one");
    assert!(sh(&m.dir, "getfacl -cpn d/sub").contains("default:user:65534:rwx"));
    sh(&m.dir, "setfacl -b f");
    assert_eq!(as_nobody(read, &m.path("f")), "EACCES");
    assert_eq!(
        sh(&m.dir, "getfacl -cpn f").trim(),
        "user::rw-\ngroup::---\nother::---"
    );
}
