//! File-system logic without a kernel: against the in-memory client, and (the tests named
//! in `on_both_stores!`) also against the embedded S3 server through the real client.

use super::*;
use crate::s3::mem::MemClient;

fn fs_with(mem: Arc<MemClient>, prefix: &str) -> S3Fs {
    S3Fs::new(
        mem,
        FsConfig {
            prefix: prefix.to_string(),
            part_size: 5,
            metadata_ttl: Duration::from_secs(60),
            ..FsConfig::default()
        },
    )
}

/// The object store a file-system test runs on: the in-memory double, or the embedded
/// S3 server on 127.0.0.1 through the real client (signing, HTTP, its error mapping).
enum Store {
    Mem(Arc<MemClient>),
    Server {
        server: crate::s3server::RunningServer,
        client: Arc<crate::s3::aws::AwsClient>,
        _dir: crate::mounter::tests::Scratch,
    },
}

const BUCKET: &str = "fs-tests";

impl Store {
    fn mem() -> Self {
        Store::Mem(Arc::new(MemClient::new()))
    }

    async fn server() -> Self {
        let dir = crate::mounter::tests::Scratch::new();
        let server = crate::s3server::start(crate::s3server::ServerConfig {
            listen: "127.0.0.1:0".parse().unwrap(),
            dir: dir.0.clone(),
            access_key: "fs-tests".into(),
            secret_key: "fs-tests-secret".into(),
        })
        .await
        .unwrap();
        server.store.create_bucket(BUCKET).unwrap();
        let endpoint = crate::config::Endpoint {
            endpoint_url: Some(server.endpoint()),
            force_path_style: true,
            region: None,
        };
        let client = crate::s3::aws::AwsClient::with_static_credentials(
            BUCKET,
            &endpoint,
            "fs-tests",
            "fs-tests-secret",
            None,
        )
        .await;
        Store::Server {
            server,
            client: Arc::new(client),
            _dir: dir,
        }
    }

    fn client(&self) -> Arc<dyn ObjectClient> {
        match self {
            Store::Mem(mem) => mem.clone(),
            Store::Server { client, .. } => client.clone(),
        }
    }

    async fn put(&self, key: &str, body: &str) {
        self.client()
            .put_object(key, Bytes::copy_from_slice(body.as_bytes()))
            .await
            .unwrap();
    }

    async fn get(&self, key: &str) -> Option<Bytes> {
        let client = self.client();
        let meta = match client.head_object(key).await {
            Ok(meta) => meta,
            Err(crate::s3::S3Error::NotFound) => return None,
            Err(e) => panic!("HEAD {key}: {e}"),
        };
        Some(client.get_range(key, 0, meta.size).await.unwrap())
    }

    async fn keys(&self) -> Vec<String> {
        let page = self
            .client()
            .list(crate::s3::ListRequest {
                prefix: "",
                delimiter: None,
                continuation: None,
                start_after: None,
                max_keys: 1000,
            })
            .await
            .unwrap();
        page.objects.into_iter().map(|o| o.key).collect()
    }

    /// Multipart uploads begun and neither completed nor aborted.
    async fn open_uploads(&self) -> usize {
        match self {
            Store::Mem(mem) => mem.open_uploads(),
            Store::Server { server, .. } => server
                .store
                .list_uploads(BUCKET, "", None, None, 1000)
                .unwrap()
                .0
                .len(),
        }
    }
}

/// A file system on `store`; parts as small as the store allows, so that tests of a few
/// bytes use multipart uploads on the in-memory double.
fn fs_with_store(store: &Store, prefix: &str) -> S3Fs {
    let part_size = match store {
        Store::Mem(_) => 5,
        Store::Server { .. } => 5 * 1024 * 1024,
    };
    S3Fs::new(
        store.client(),
        FsConfig {
            prefix: prefix.to_string(),
            part_size,
            metadata_ttl: Duration::from_secs(60),
            ..FsConfig::default()
        },
    )
}

/// Runs each named test on both stores, as `NAME::mem` and `NAME::s3_server`.
macro_rules! on_both_stores {
    ($($name:ident),* $(,)?) => {
        $(mod $name {
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn mem() {
                super::$name(super::Store::mem()).await
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn s3_server() {
                super::$name(super::Store::server().await).await
            }
        })*
    };
}

on_both_stores!(
    a_fresh_open_of_an_object_replaced_in_s3_reads_the_new_version,
    directories_rename_with_everything_under_them,
    implicit_and_marker_directories_are_listed,
    write_read_rename_unlink_round_trip,
    existing_objects_are_edited_in_place,
    closes_commit_what_their_owner_wrote_and_later_writes_continue,
    unlinking_a_file_being_written_discards_it,
    a_file_unlinked_or_replaced_while_open_keeps_its_data_until_the_last_close,
    s3fs_metadata_is_shown_and_listings_load_it_in_one_batch,
    chmod_chown_utimes_persist_in_one_copy_each_file,
    new_files_directories_symlinks_and_fifos_carry_s3fs_headers,
    xattrs_round_trip_in_s3fs_encoding,
    posix_acls_set_the_mode_follow_chmod_and_are_inherited,
    content_types_are_inferred_and_kept,
    names_longer_than_255_bytes_written_elsewhere_are_listed_opened_and_removed,
    older_s3fs_directory_objects_are_directories,
);

const ROOT: u64 = inode::ROOT_INO;
const W: OpenMode = OpenMode {
    write: true,
    truncate: true,
    append: false,
    exclusive: false,
};
/// Opened for writing without O_TRUNC: an edit in place.
const RW: OpenMode = OpenMode {
    write: true,
    truncate: false,
    append: false,
    exclusive: false,
};
const APPEND: OpenMode = OpenMode { append: true, ..RW };
const R: OpenMode = OpenMode {
    write: false,
    truncate: false,
    append: false,
    exclusive: false,
};

async fn names(fs: &S3Fs, ino: u64) -> Vec<String> {
    let fh = fs.opendir(ino).await.unwrap();
    let mut out = Vec::new();
    let mut off = 0;
    loop {
        let batch = fs.readdir(fh, off, usize::MAX).await.unwrap();
        if batch.is_empty() {
            break;
        }
        // Take only some entries per call, as a full kernel buffer would.
        for e in batch.iter().take(3) {
            out.push(e.name.clone());
            off = e.offset;
        }
    }
    fs.releasedir(fh);
    out
}

async fn directories_rename_with_everything_under_them(store: Store) {
    store.put("a/", "").await;
    store.put("a/x", "x").await;
    store.put("a/sub/y", "yy").await;
    store.put("other/z", "z").await;
    store.put("f", "f").await;
    let fs = fs_with_store(&store, "");
    let a = fs.lookup(ROOT, "a").await.unwrap();
    let sub = fs.lookup(a.ino, "sub").await.unwrap();
    let y = fs.lookup(sub.ino, "y").await.unwrap();
    fs.rename(ROOT, "a", ROOT, "b", false).await.unwrap();
    assert_eq!(fs.flush_all().await, 0);
    let mut keys = store.keys().await;
    keys.sort();
    assert_eq!(keys, ["b/", "b/sub/y", "b/x", "f", "other/z"]);
    // Inodes the kernel holds keep working, at their new keys.
    let fh = fs.open(y.ino, R).await.unwrap();
    assert_eq!(fs.read(fh, 0, 2).await.unwrap().as_ref(), b"yy");
    fs.release(fh).await.unwrap();
    assert_eq!(fs.lookup(ROOT, "b").await.unwrap().ino, a.ino);
    let r = fs.lookup(ROOT, "a").await;
    assert!(
        matches!(r, Err(FsError::NotFound)),
        "{r:?} {:?}",
        store.keys().await
    );
    assert_eq!(names(&fs, sub.ino).await, [".", "..", "y"]);

    assert!(matches!(
        fs.rename(ROOT, "b", sub.ino, "inner", false).await,
        Err(FsError::Invalid(_))
    ));
    assert!(matches!(
        fs.rename(ROOT, "b", ROOT, "other", false).await,
        Err(FsError::NotEmpty)
    ));
    assert!(matches!(
        fs.rename(ROOT, "b", ROOT, "f", false).await,
        Err(FsError::NotDir)
    ));
    let empty = fs.mkdir(ROOT, "empty").await.unwrap();
    assert!(matches!(
        fs.rename(ROOT, "b", ROOT, "empty", true).await,
        Err(FsError::Exists)
    ));
    // A file being written under it moves with it: what was written so far at once,
    // what is written after the rename at its close, under the new name.
    let (_, fh) = fs.create(sub.ino, "w", W).await.unwrap();
    fs.write(fh, 0, b"w", Some(1)).await.unwrap();
    fs.rename(ROOT, "b", ROOT, "c", false).await.unwrap();
    assert_eq!(store.get("c/sub/w").await.unwrap().as_ref(), b"w");
    fs.write(fh, 1, b"+", Some(1)).await.unwrap();
    fs.flush(fh, 1).await.unwrap();
    fs.release(fh).await.unwrap();
    assert_eq!(store.get("c/sub/w").await.unwrap().as_ref(), b"w+");
    fs.rename(ROOT, "c", ROOT, "b", false).await.unwrap();
    assert!(store.get("b/sub/w").await.is_some());
    // A destination holding only identical copies of the source's objects (what a rename
    // interrupted while copying leaves) is taken over by the retry; any other is not.
    store.put("p/one", "1").await;
    store.put("p/two", "2").await;
    store.put("q/one", "1").await;
    store.put("r/one", "1").await;
    store.put("s/one", "not a copy").await;
    // (A new mount: this one has listed the root, and trusts that for the metadata TTL.)
    let other = fs_with_store(&store, "");
    other.rename(ROOT, "p", ROOT, "q", false).await.unwrap();
    assert!(matches!(
        other.rename(ROOT, "r", ROOT, "s", false).await,
        Err(FsError::NotEmpty)
    ));
    assert_eq!(other.flush_all().await, 0);
    let mut keys = store.keys().await;
    keys.retain(|k| ["p/", "q/", "r/", "s/"].iter().any(|p| k.starts_with(p)));
    keys.sort();
    assert_eq!(keys, ["q/one", "q/two", "r/one", "s/one"]);
    // Onto an empty directory: it is replaced.
    fs.rename(ROOT, "b", ROOT, "empty", false).await.unwrap();
    assert_eq!(fs.lookup(ROOT, "empty").await.unwrap().ino, a.ino);
    assert_ne!(a.ino, empty.ino);
    assert_eq!(fs.flush_all().await, 0);
    let mut keys = store.keys().await;
    keys.retain(|k| !["q/", "r/", "s/"].iter().any(|p| k.starts_with(p)));
    keys.sort();
    assert_eq!(
        keys,
        [
            "empty/",
            "empty/sub/w",
            "empty/sub/y",
            "empty/x",
            "f",
            "other/z"
        ]
    );
}

async fn implicit_and_marker_directories_are_listed(store: Store) {
    store.put("p/a/b/c.txt", "c").await;
    store.put("p/empty/", "").await;
    store.put("p/top.txt", "top").await;
    store.put("other/x", "x").await;
    let fs = fs_with_store(&store, "p/");
    let mut root = names(&fs, ROOT).await;
    root.sort();
    assert_eq!(root, [".", "..", "a", "empty", "top.txt"]);
    let a = fs.lookup(ROOT, "a").await.unwrap();
    assert_eq!(a.kind, Kind::Dir);
    let b = fs.lookup(a.ino, "b").await.unwrap();
    assert_eq!(names(&fs, b.ino).await, [".", "..", "c.txt"]);
    let e = fs.lookup(ROOT, "empty").await.unwrap();
    assert_eq!(names(&fs, e.ino).await, [".", ".."]);
    assert!(matches!(fs.lookup(ROOT, "x").await, Err(FsError::NotFound)));
}

#[tokio::test]
async fn large_directory_lists_every_key_across_pages() {
    let mem = Arc::new(MemClient::new());
    for i in 0..2500 {
        mem.insert(&format!("big/f{i:05}"), "");
    }
    let fs = fs_with(mem, "");
    let big = fs.lookup(ROOT, "big").await.unwrap();
    let listed = names(&fs, big.ino).await;
    assert_eq!(listed.len(), 2502);
    let unique: HashSet<_> = listed.iter().collect();
    assert_eq!(unique.len(), 2502);
}

/// Issue 40.1: another client replaces a file within the metadata TTL. An open that has
/// returned no byte yet reads the new version (it was ESTALE); a descriptor that did return
/// bytes of the old one never gets bytes of the new (see `edit.rs` in the integration tests).
async fn a_fresh_open_of_an_object_replaced_in_s3_reads_the_new_version(store: Store) {
    let fs = fs_with_store(&store, "");
    let (attr, fh) = fs.create(ROOT, "f", W).await.unwrap();
    fs.write(fh, 0, b"short", Some(1)).await.unwrap();
    fs.flush(fh, 1).await.unwrap();
    fs.release(fh).await.unwrap();
    store.put("f", "a longer version").await;
    let fh = fs.open(attr.ino, R).await.unwrap();
    assert_eq!(
        fs.read(fh, 0, 4096).await.unwrap().as_ref(),
        b"a longer version"
    );
    fs.release(fh).await.unwrap();
    assert_eq!(fs.getattr(attr.ino).await.unwrap().size, 16);
}

/// Issue 40.4: as on a local disk, a directory's mtime and ctime move when an entry is
/// created, removed or renamed in it, and a renamed entry's ctime moves; at no request.
#[tokio::test]
async fn directory_times_follow_their_entries_and_rename_changes_ctime() {
    let mem = Arc::new(MemClient::new());
    let fs = fs_with(mem.clone(), "");
    let d = fs.mkdir(ROOT, "d").await.unwrap();
    let tick = || tokio::time::sleep(Duration::from_millis(20));
    let mut last = fs.getattr(d.ino).await.unwrap();
    let mut moved = |what: &str, now: Attr| {
        assert!(
            now.mtime > last.mtime && now.ctime > last.ctime,
            "{what}: {:?} -> {:?}",
            (last.mtime, last.ctime),
            (now.mtime, now.ctime)
        );
        last = now;
    };
    tick().await;
    let (f, fh) = fs.create(d.ino, "f", W).await.unwrap();
    fs.write(fh, 0, b"x", Some(1)).await.unwrap();
    fs.flush(fh, 1).await.unwrap();
    fs.release(fh).await.unwrap();
    moved("create", fs.getattr(d.ino).await.unwrap());
    let file_before = fs.getattr(f.ino).await.unwrap();
    tick().await;
    fs.rename(d.ino, "f", d.ino, "g", false).await.unwrap();
    let asked = mem.metadata_requests();
    moved("rename", fs.getattr(d.ino).await.unwrap());
    let file_after = fs.getattr(f.ino).await.unwrap();
    assert!(
        file_after.ctime > file_before.ctime,
        "the renamed file's ctime"
    );
    assert_eq!(
        file_after.mtime, file_before.mtime,
        "rename keeps the mtime"
    );
    assert_eq!(mem.metadata_requests(), asked, "shown from memory");
    tick().await;
    fs.mkdir(d.ino, "sub").await.unwrap();
    moved("mkdir", fs.getattr(d.ino).await.unwrap());
    tick().await;
    fs.rmdir(d.ino, "sub").await.unwrap();
    moved("rmdir", fs.getattr(d.ino).await.unwrap());
    tick().await;
    fs.unlink(d.ino, "g").await.unwrap();
    moved("unlink", fs.getattr(d.ino).await.unwrap());
}

async fn write_read_rename_unlink_round_trip(store: Store) {
    let fs = fs_with_store(&store, "");
    let (attr, fh) = fs.create(ROOT, "f", W).await.unwrap();
    fs.write(fh, 0, b"hello ", Some(1)).await.unwrap();
    fs.write(fh, 6, b"world, multipart", Some(1)).await.unwrap();
    // A write behind the end stages the file (its buffer moves to local disk).
    fs.write(fh, 3, b"L", Some(1)).await.unwrap();
    assert_eq!(fs.read(fh, 0, 5).await.unwrap().as_ref(), b"helLo");
    // Visible in listings before it is uploaded.
    assert!(names(&fs, ROOT).await.contains(&"f".to_string()));
    fs.flush(fh, 1).await.unwrap();
    fs.release(fh).await.unwrap();
    assert_eq!(
        store.get("f").await.unwrap().as_ref(),
        b"helLo world, multipart"
    );
    assert_eq!(store.open_uploads().await, 0);

    let fh = fs.open(attr.ino, R).await.unwrap();
    assert_eq!(fs.read(fh, 6, 5).await.unwrap().as_ref(), b"world");
    fs.release(fh).await.unwrap();

    let d = fs.mkdir(ROOT, "d").await.unwrap();
    assert!(store.get("d/").await.is_some(), "mkdir writes a marker");
    fs.rename(ROOT, "f", d.ino, "g", false).await.unwrap();
    assert!(store.get("f").await.is_none());
    assert_eq!(
        store.get("d/g").await.unwrap().as_ref(),
        b"helLo world, multipart"
    );
    assert!(matches!(fs.rmdir(ROOT, "d").await, Err(FsError::NotEmpty)));
    // A directory moves with what is under it, and back.
    fs.rename(ROOT, "d", ROOT, "e", false).await.unwrap();
    assert_eq!(
        store.get("e/g").await.unwrap().as_ref(),
        b"helLo world, multipart"
    );
    fs.rename(ROOT, "e", ROOT, "d", false).await.unwrap();
    fs.unlink(d.ino, "g").await.unwrap();
    fs.rmdir(ROOT, "d").await.unwrap();
    // Deletes after the first one are sent in the background (see `deletes.rs`).
    assert_eq!(fs.flush_all().await, 0);
    assert!(store.keys().await.is_empty(), "{:?}", store.keys().await);
}

async fn existing_objects_are_edited_in_place(store: Store) {
    store.put("obj", "old contents").await;
    let fs = fs_with_store(&store, "");
    let a = fs.lookup(ROOT, "obj").await.unwrap();
    let fh = fs.open(a.ino, RW).await.unwrap();
    fs.write(fh, 0, b"O", Some(1)).await.unwrap();
    fs.write(fh, 12, b", appended", Some(1)).await.unwrap();
    assert_eq!(store.get("obj").await.unwrap().as_ref(), b"old contents");
    assert_eq!(
        fs.read(fh, 0, 100).await.unwrap().as_ref(),
        b"Old contents, appended"
    );
    // A second descriptor shares the staged copy and sees the edits.
    let other = fs.open(a.ino, R).await.unwrap();
    assert_eq!(fs.read(other, 0, 3).await.unwrap().as_ref(), b"Old");
    fs.flush(fh, 1).await.unwrap();
    assert_eq!(
        store.get("obj").await.unwrap().as_ref(),
        b"Old contents, appended"
    );
    fs.release(fh).await.unwrap();
    fs.release(other).await.unwrap();

    // Someone else replaces the object: an append to the version we knew must not mix.
    let fh = fs.open(a.ino, RW).await.unwrap();
    store.put("obj", "theirs, 22 bytes long!").await;
    assert!(fs.write(fh, 22, b"mine", Some(1)).await.is_err());
    fs.release(fh).await.unwrap();
    assert_eq!(
        store.get("obj").await.unwrap().as_ref(),
        b"theirs, 22 bytes long!"
    );

    // Nor may an edit in the middle overwrite it: the close fails.
    let _ = fs.getattr(a.ino).await;
    let fh = fs.open(a.ino, RW).await.unwrap();
    assert_eq!(fs.read(fh, 0, 6).await.unwrap().as_ref(), b"theirs");
    fs.write(fh, 1, b"X", Some(1)).await.unwrap();
    store.put("obj", "theirs again").await;
    assert!(
        fs.flush(fh, 1).await.is_err(),
        "a conflicting commit must fail"
    );
    let _ = fs.release(fh).await;
    assert_eq!(store.get("obj").await.unwrap().as_ref(), b"theirs again");

    let fh = fs.open(a.ino, W).await.unwrap();
    fs.write(fh, 0, b"new", Some(1)).await.unwrap();
    fs.flush(fh, 1).await.unwrap();
    fs.release(fh).await.unwrap();
    assert_eq!(store.get("obj").await.unwrap().as_ref(), b"new");

    // Truncate to any size: shrink, then grow with zeros.
    fs.setattr(a.ino, Some(1), None).await.unwrap();
    assert_eq!(store.get("obj").await.unwrap().as_ref(), b"n");
    fs.setattr(a.ino, Some(4), None).await.unwrap();
    assert_eq!(store.get("obj").await.unwrap().as_ref(), b"n\0\0\0");
    assert_eq!(fs.getattr(a.ino).await.unwrap().size, 4);
    fs.setattr(a.ino, Some(0), None).await.unwrap();
    assert_eq!(store.get("obj").await.unwrap().len(), 0);
}

async fn closes_commit_what_their_owner_wrote_and_later_writes_continue(store: Store) {
    let fs = fs_with_store(&store, "");
    let (shell, child, idle) = (100, 200, 300);
    let (_, fh) = fs.create(ROOT, "f", W).await.unwrap();
    fs.write(fh, 0, b"abc", Some(shell)).await.unwrap();
    // A forked child that never wrote closes its inherited copy: no commit.
    fs.flush(fh, idle).await.unwrap();
    assert!(store.get("f").await.is_none());
    // A child that wrote commits at its close (its output is durable then) ...
    fs.write(fh, 3, b"def", Some(child)).await.unwrap();
    fs.flush(fh, child).await.unwrap();
    assert_eq!(store.get("f").await.unwrap().as_ref(), b"abcdef");
    // ... and the shell's next write continues the object, in any pid namespace.
    fs.write(fh, 6, b"ghi", Some(shell)).await.unwrap();
    fs.fsync(fh).await.unwrap();
    assert_eq!(store.get("f").await.unwrap().as_ref(), b"abcdefghi");
    fs.write(fh, 9, b"jkl", None).await.unwrap();
    fs.flush(fh, shell).await.unwrap();
    assert_eq!(store.get("f").await.unwrap().as_ref(), b"abcdefghijkl");
    // The last close has nothing left to do.
    fs.release(fh).await.unwrap();
    assert_eq!(store.get("f").await.unwrap().as_ref(), b"abcdefghijkl");
    assert_eq!(store.open_uploads().await, 0);
}

/// Handles a dead predecessor opened: every call answers at once. A self-deadlock on a
/// std mutex would block the runtime's thread, so the calls run on a thread of their own.
#[test]
fn handles_of_a_dead_predecessor_answer_at_once() {
    let (done, finished) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(async {
            let fs = fs_with(Arc::new(MemClient::new()), "");
            let unknown = 4242;
            assert!(matches!(
                fs.flush(unknown, 1).await,
                Err(FsError::BadHandle)
            ));
            assert!(matches!(fs.fsync(unknown).await, Err(FsError::BadHandle)));
            assert!(matches!(
                fs.write(unknown, 0, b"x", Some(1)).await,
                Err(FsError::BadHandle)
            ));
            assert!(matches!(
                fs.read(unknown, 0, 1).await,
                Err(FsError::BadHandle)
            ));
            fs.release(unknown).await.unwrap();
            fs.releasedir(unknown);
        });
        done.send(()).unwrap();
    });
    finished
        .recv_timeout(std::time::Duration::from_secs(10))
        .expect("a call on an unknown handle hung (or panicked)");
}

async fn unlinking_a_file_being_written_discards_it(store: Store) {
    let fs = fs_with_store(&store, "");
    let (_, fh) = fs.create(ROOT, "tmp", W).await.unwrap();
    fs.write(fh, 0, b"0123456789abc", Some(1)).await.unwrap();
    fs.unlink(ROOT, "tmp").await.unwrap();
    fs.release(fh).await.unwrap();
    assert!(store.get("tmp").await.is_none());
    assert_eq!(store.open_uploads().await, 0);
}

/// As on a local disk: descriptors opened before `unlink` (or before a rename replaced
/// the file) go on reading and writing it, `fstat` answers, the object is gone from S3 at
/// once, and nothing is committed or left in the staging area after the last close.
async fn a_file_unlinked_or_replaced_while_open_keeps_its_data_until_the_last_close(store: Store) {
    let big: String = (0..300_000).map(|n| format!("{:07}\n", n)).collect();
    store.put("big", &big).await;
    store.put("log", "old log").await;
    store.put("target", "replaced").await;
    store.put("source", "renamed").await;
    let fs = fs_with_store(&store, "");
    let f = fs.lookup(ROOT, "big").await.unwrap();
    let reader = fs.open(f.ino, R).await.unwrap();
    assert_eq!(fs.read(reader, 0, 8).await.unwrap().as_ref(), b"0000000\n");
    let writer = fs.open(f.ino, RW).await.unwrap();
    fs.unlink(ROOT, "big").await.unwrap();
    assert!(store.get("big").await.is_none(), "the object goes at once");
    assert!(matches!(
        fs.lookup(ROOT, "big").await,
        Err(FsError::NotFound)
    ));
    // Bytes the reader never read before the unlink, far beyond its read-ahead.
    let at = 8 * 250_000;
    assert_eq!(fs.read(reader, at, 8).await.unwrap().as_ref(), b"0250000\n");
    let end = big.len() as u64;
    fs.write(writer, end, b"after unlink", Some(1))
        .await
        .unwrap();
    fs.flush(writer, 1).await.unwrap();
    assert_eq!(fs.getattr(f.ino).await.unwrap().size, end + 12);
    assert_eq!(
        fs.read(reader, end - 8, 100).await.unwrap().as_ref(),
        b"0299999\nafter unlink"
    );
    fs.release(writer).await.unwrap();
    fs.release(reader).await.unwrap();
    assert!(
        store.get("big").await.is_none(),
        "nothing committed at close"
    );
    fs.flush_all().await;
    assert!(!store.keys().await.contains(&"big".to_string()));
    assert_eq!(
        fs.staging().unwrap().used(),
        0,
        "the copy went at the last close"
    );

    // A new file under the same name while the old one is still open is its own file.
    let old = fs.lookup(ROOT, "log").await.unwrap();
    let fh = fs.open(old.ino, R).await.unwrap();
    fs.unlink(ROOT, "log").await.unwrap();
    let (_, new) = fs.create(ROOT, "log", W).await.unwrap();
    fs.write(new, 0, b"new log", Some(1)).await.unwrap();
    fs.release(new).await.unwrap();
    assert_eq!(fs.read(fh, 0, 100).await.unwrap().as_ref(), b"old log");
    fs.release(fh).await.unwrap();
    assert_eq!(store.get("log").await.unwrap().as_ref(), b"new log");

    // rename onto an open file: its descriptor keeps the replaced content.
    let t = fs.lookup(ROOT, "target").await.unwrap();
    let fh = fs.open(t.ino, R).await.unwrap();
    fs.rename(ROOT, "source", ROOT, "target", false)
        .await
        .unwrap();
    assert_eq!(fs.read(fh, 0, 100).await.unwrap().as_ref(), b"replaced");
    fs.release(fh).await.unwrap();
    fs.flush_all().await;
    assert_eq!(store.get("target").await.unwrap().as_ref(), b"renamed");
    assert!(store.get("source").await.is_none());
}

#[tokio::test]
async fn read_only_refuses_changes() {
    let mem = Arc::new(MemClient::new());
    mem.insert("a", "a");
    let fs = S3Fs::new(
        mem,
        FsConfig {
            read_only: true,
            ..FsConfig::default()
        },
    );
    assert!(matches!(
        fs.create(ROOT, "b", W).await,
        Err(FsError::ReadOnly)
    ));
    assert!(matches!(fs.mkdir(ROOT, "d").await, Err(FsError::ReadOnly)));
    assert!(matches!(fs.unlink(ROOT, "a").await, Err(FsError::ReadOnly)));
}

async fn names_longer_than_255_bytes_written_elsewhere_are_listed_opened_and_removed(store: Store) {
    let long = "n".repeat(300);
    let longer = "m".repeat(400);
    store.put(&format!("d/{long}"), "long").await;
    store.put(&format!("d/{longer}/f"), "under").await;
    let fs = fs_with_store(&store, "");
    let d = fs.lookup(ROOT, "d").await.unwrap();
    let mut shown = names(&fs, d.ino).await;
    shown.sort();
    assert_eq!(shown, vec![".", "..", &longer, &long]);
    let f = fs.lookup(d.ino, &long).await.unwrap();
    let fh = fs.open(f.ino, R).await.unwrap();
    assert_eq!(fs.read(fh, 0, 10).await.unwrap().as_ref(), b"long");
    fs.release(fh).await.unwrap();
    // Renamed to a name this mount could create, and removed.
    fs.rename(d.ino, &long, d.ino, "short", false)
        .await
        .unwrap();
    assert_eq!(store.get("d/short").await.unwrap().as_ref(), b"long");
    let sub = fs.lookup(d.ino, &longer).await.unwrap();
    fs.unlink(sub.ino, "f").await.unwrap();
    fs.rmdir(d.ino, &longer).await.unwrap();
    fs.unlink(d.ino, "short").await.unwrap();
    assert_eq!(fs.flush_all().await, 0);
    assert!(store.get("d/short").await.is_none());
    assert!(store.get(&format!("d/{longer}/f")).await.is_none());
    // A new name still has NAME_MAX.
    assert!(matches!(
        fs.create(d.ino, &long, W).await,
        Err(FsError::NameTooLong)
    ));
}

#[tokio::test]
async fn a_directory_links_two_and_one_per_subdirectory() {
    let mem = Arc::new(MemClient::new());
    mem.insert("d/sub1/f", "x");
    mem.insert("d/sub2/", "");
    mem.insert("d/file", "x");
    let fs = fs_with(mem, "");
    let d = fs.lookup(ROOT, "d").await.unwrap();
    assert_eq!(
        d.nlink, 1,
        "not known until it is listed: 1, not a count that misleads find"
    );
    names(&fs, d.ino).await;
    assert_eq!(fs.getattr(d.ino).await.unwrap().nlink, 4);
    assert_eq!(fs.lookup(d.ino, "file").await.unwrap().nlink, 1);
    let e = fs.mkdir(d.ino, "e").await.unwrap();
    assert_eq!((e.nlink, fs.getattr(d.ino).await.unwrap().nlink), (2, 5));
    fs.rename(d.ino, "e", ROOT, "e", false).await.unwrap();
    assert_eq!(fs.getattr(d.ino).await.unwrap().nlink, 4);
    fs.rmdir(d.ino, "sub2").await.unwrap();
    assert_eq!(fs.getattr(d.ino).await.unwrap().nlink, 3);
}

#[tokio::test]
async fn names_s3_cannot_hold_are_refused() {
    let fs = fs_with(Arc::new(MemClient::new()), "");
    assert!(matches!(
        fs.create(ROOT, &"x".repeat(300), W).await,
        Err(FsError::NameTooLong)
    ));
    assert!(matches!(
        fs.mkdir(ROOT, "..").await,
        Err(FsError::InvalidName)
    ));
}

#[tokio::test]
async fn lookups_in_a_fully_known_directory_need_no_request() {
    let mem = Arc::new(MemClient::new());
    mem.insert("d/a", "a");
    let fs = fs_with(mem.clone(), "");
    let d = fs.lookup(ROOT, "d").await.unwrap();
    assert_eq!(names(&fs, d.ino).await.len(), 3);
    // Someone else adds a key: within the TTL the complete listing still answers.
    mem.insert("d/b", "b");
    assert!(matches!(
        fs.lookup(d.ino, "b").await,
        Err(FsError::NotFound)
    ));
    // A new directory is known to be empty, and our own creates keep it complete.
    let e = fs.mkdir(ROOT, "e").await.unwrap();
    let (_, fh) = fs.create(e.ino, "new", W).await.unwrap();
    fs.release(fh).await.unwrap();
    assert!(fs.lookup(e.ino, "new").await.is_ok());
    assert!(matches!(
        fs.lookup(e.ino, "other").await,
        Err(FsError::NotFound)
    ));
}

#[tokio::test]
async fn a_lookup_miss_lists_the_directory_for_its_siblings() {
    let mem = Arc::new(MemClient::new());
    for i in 0..50 {
        mem.insert(&format!("d/f{i}"), "x");
    }
    let fs = fs_with(mem.clone(), "");
    let d = fs.lookup(ROOT, "d").await.unwrap();
    fs.lookup(d.ino, "f0").await.unwrap();
    // Let the background listing land.
    for _ in 0..100 {
        tokio::task::yield_now().await;
    }
    tokio::time::sleep(Duration::from_millis(20)).await;
    // The listing tells names and sizes, not metadata: the first stat of a sibling HEADs
    // it and the siblings listed after it, each once, and sends no LIST.
    let (lists, heads) = (mem.lists(), mem.heads());
    for i in 1..50 {
        assert_eq!(fs.lookup(d.ino, &format!("f{i}")).await.unwrap().size, 1);
    }
    assert!(matches!(
        fs.lookup(d.ino, "missing").await,
        Err(FsError::NotFound)
    ));
    assert_eq!(mem.lists(), lists, "siblings should come from the listing");
    assert!(mem.heads() - heads <= 49, "{} HEADs", mem.heads() - heads);
    let before = mem.metadata_requests();
    for i in 1..50 {
        fs.lookup(d.ino, &format!("f{i}")).await.unwrap();
    }
    assert_eq!(mem.metadata_requests(), before, "all known now");
}

/// `ls`, `find -name`, `os.scandir` without stat: a walk that needs names only costs
/// LISTs (and a HEAD per directory, whose marker may restrict access), never a HEAD per
/// file; the entries go out uncached until their metadata is known.
#[tokio::test]
async fn a_names_only_walk_costs_lists_only() {
    let mem = Arc::new(MemClient::new());
    for d in 0..3 {
        for f in 0..40 {
            mem.insert(&format!("t/d{d}/f{f:02}"), "x");
        }
    }
    let fs = fs_with(mem.clone(), "");
    let t = fs.lookup(ROOT, "t").await.unwrap();
    // The lookup miss lists the root in the background.
    tokio::time::sleep(Duration::from_millis(50)).await;
    let (lists, heads) = (mem.lists(), mem.heads());
    let mut files = 0;
    for e in all_entries(&fs, t.ino).await {
        if e.name.starts_with('d') {
            let dir = fs.lookup(t.ino, &e.name).await.unwrap();
            for f in all_entries(&fs, dir.ino).await {
                if f.name.starts_with('f') {
                    files += 1;
                    assert_eq!(fs.entry_attr(f.ino).unwrap().ttl, Duration::ZERO);
                }
            }
        }
    }
    assert_eq!(files, 120);
    // Let the walk's background listings land.
    tokio::time::sleep(Duration::from_millis(50)).await;
    assert!(mem.lists() - lists <= 4, "{} LISTs", mem.lists() - lists);
    assert!(mem.heads() - heads <= 3, "{} HEADs", mem.heads() - heads);
}

/// `rm` of many files once the TTL has passed: the listing fetched after the first lookup
/// lands after the first unlink changed the namespace. It then confirms the siblings it
/// shows unchanged (so their unlinks probe nothing) but never brings a removed name back
/// nor counts as a complete listing.
#[tokio::test]
async fn a_listing_stale_about_names_still_confirms_the_unchanged_siblings() {
    let mem = Arc::new(MemClient::new());
    for i in 0..20 {
        mem.insert(&format!("d/f{i:02}"), "x");
    }
    mem.insert("d/changed", "old");
    let fs = S3Fs::new(
        mem.clone(),
        FsConfig {
            metadata_ttl: Duration::from_millis(100),
            ..FsConfig::default()
        },
    );
    let d = fs.lookup(ROOT, "d").await.unwrap();
    assert_eq!(names(&fs, d.ino).await.len(), 23);
    // `ls -l`: every entry's metadata is known.
    for n in names(&fs, d.ino).await {
        if n != "." && n != ".." {
            fs.lookup(d.ino, &n).await.unwrap();
        }
    }
    tokio::time::sleep(Duration::from_millis(150)).await;
    // The LIST is sent (this one, not the mount's own listing ahead), and meanwhile f00 is
    // removed through the mount and `changed` replaced by it.
    let changes = {
        let mut t = lock(&fs.inodes);
        t.get_mut(d.ino).unwrap().list_ahead_at = Some(Instant::now());
        t.namespace_changes
    };
    let page = mem
        .list(crate::s3::ListRequest {
            prefix: "d/",
            delimiter: Some("/"),
            continuation: None,
            start_after: None,
            max_keys: 1000,
        })
        .await
        .unwrap();
    fs.unlink(d.ino, "f00").await.unwrap();
    let c = fs.lookup(d.ino, "changed").await.unwrap();
    let fh = fs.open(c.ino, W).await.unwrap();
    fs.write(fh, 0, b"new bytes", None).await.unwrap();
    fs.release(fh).await.unwrap();
    let (heads, whole) = readdir::absorb_background_page(
        &fs.inodes,
        d.ino,
        "d/",
        &page,
        changes,
        fs.mount_time,
        true,
    );
    assert!(!whole);
    assert!(heads.is_empty(), "{heads:?}");
    let before = mem.metadata_requests();
    for i in 1..20 {
        fs.lookup(d.ino, &format!("f{i:02}")).await.unwrap();
    }
    assert_eq!(
        mem.metadata_requests(),
        before,
        "the siblings were confirmed"
    );
    // Not brought back: the removed name, and the old version of the rewritten file.
    assert!(matches!(
        fs.lookup(d.ino, "f00").await,
        Err(FsError::NotFound)
    ));
    let now = fs.lookup(d.ino, "changed").await.unwrap();
    assert_eq!((now.ino, now.size), (c.ino, 9));
    assert!(!fs.listing_fresh(&fs.inode(d.ino).unwrap()));
}

/// close(2) waits for FLUSH (the commit) but not for RELEASE: a rename onto (or of) a
/// file whose last descriptor was just closed must not fail with EBUSY because its
/// RELEASE is still on its way (fsx's full run found it), nor bring back the old bytes.
#[tokio::test]
async fn a_rename_onto_a_file_whose_release_is_on_its_way_replaces_it() {
    let mem = Arc::new(MemClient::new());
    mem.insert("t", "old");
    mem.insert("s", "src");
    let fs = Arc::new(fs_with(mem.clone(), ""));
    let t = fs.lookup(ROOT, "t").await.unwrap();
    // Two writers: the second stages the file.
    let (a, b) = (
        fs.open(t.ino, APPEND).await.unwrap(),
        fs.open(t.ino, APPEND).await.unwrap(),
    );
    fs.write(a, 3, b"+a", Some(1)).await.unwrap();
    fs.write(b, 5, b"+b", Some(2)).await.unwrap();
    fs.flush(a, 1).await.unwrap();
    fs.flush(b, 2).await.unwrap();
    assert_eq!(mem.get("t").unwrap().as_ref(), b"old+a+b");
    let late = fs.clone();
    let releases = tokio::spawn(async move {
        tokio::time::sleep(Duration::from_millis(50)).await;
        late.release(a).await.unwrap();
        late.release(b).await.unwrap();
    });
    fs.rename(ROOT, "s", ROOT, "t", false).await.unwrap();
    releases.await.unwrap();
    assert_eq!(mem.get("t").unwrap().as_ref(), b"src");
}

/// A non-empty destination is taken over only when it holds copies a rename left; a
/// file that merely has the same name and bytes (two empty files) keeps it ENOTEMPTY
/// (fsx's full run found `rename dir` onto such a directory succeeding).
#[tokio::test]
async fn a_directory_of_identical_bytes_is_not_taken_for_a_renames_copies() {
    let mem = Arc::new(MemClient::new());
    let meta = |t: &str| [("mtime".to_string(), t.to_string())].into_iter().collect();
    mem.insert_with_meta("a/f", "", meta("1000.5"));
    mem.insert_with_meta("b/f", "", meta("2000.25"));
    let fs = fs_with(mem.clone(), "");
    fs.lookup(ROOT, "a").await.unwrap();
    fs.lookup(ROOT, "b").await.unwrap();
    assert!(matches!(
        fs.rename(ROOT, "a", ROOT, "b", false).await,
        Err(FsError::NotEmpty)
    ));
    // What an interrupted rename leaves (copies with the source's metadata) is taken over.
    mem.insert_with_meta("c/f", "", meta("1000.5"));
    fs.lookup(ROOT, "c").await.unwrap();
    fs.rename(ROOT, "a", ROOT, "c", false).await.unwrap();
    assert!(mem.get("a/f").is_none());
    assert!(mem.get("c/f").is_some());
}

/// LIST says milliseconds where HEAD says whole seconds: a second listing of the same
/// versions must not forget the metadata the first one loaded (and HEAD it all again).
#[tokio::test]
async fn listing_again_keeps_the_metadata_of_unchanged_objects() {
    let mem = Arc::new(MemClient::new());
    for i in 0..20 {
        let meta = [("mode".to_string(), "33152".to_string())]
            .into_iter()
            .collect();
        mem.insert_with_meta(&format!("d/f{i}"), "x", meta);
    }
    let fs = fs_with(mem.clone(), "");
    let d = fs.lookup(ROOT, "d").await.unwrap();
    all_entries(&fs, d.ino).await;
    let before = mem.metadata_requests();
    all_entries(&fs, d.ino).await;
    assert_eq!(mem.metadata_requests(), before + 1, "one LIST, no HEAD");
    assert_eq!(fs.lookup(d.ino, "f3").await.unwrap().perm, 0o600);
}

/// A tree walk (`ls -laR`, `find`): opening one subdirectory lists the next ones ahead,
/// so that opening, listing and stat-ing them costs no request.
#[tokio::test]
async fn opening_a_subdirectory_lists_its_next_siblings_ahead() {
    let mem = Arc::new(MemClient::new());
    for d in 0..4 {
        for f in 0..10 {
            let meta = [("mode".to_string(), "33152".to_string())]
                .into_iter()
                .collect();
            mem.insert_with_meta(&format!("t/d{d}/f{f}"), "x", meta);
        }
    }
    let fs = fs_with(mem.clone(), "");
    let t = fs.lookup(ROOT, "t").await.unwrap();
    all_entries(&fs, t.ino).await;
    let d0 = fs.lookup(t.ino, "d0").await.unwrap();
    all_entries(&fs, d0.ino).await;
    // `ls -lR` stats what it lists: the tree's files are being stat'ed from now on.
    for f in 0..10 {
        fs.lookup(d0.ino, &format!("f{f}")).await.unwrap();
    }
    // Let the listings ahead land.
    let mut settled = mem.metadata_requests();
    for _ in 0..50 {
        tokio::time::sleep(Duration::from_millis(10)).await;
        let now = mem.metadata_requests();
        if now == settled && now > 0 {
            break;
        }
        settled = now;
    }
    let (lists, heads) = (mem.lists(), mem.heads());
    for d in 1..4 {
        let dir = fs.lookup(t.ino, &format!("d{d}")).await.unwrap();
        let names: Vec<String> = all_entries(&fs, dir.ino)
            .await
            .into_iter()
            .map(|e| e.name)
            .collect();
        assert_eq!(names.len(), 12, "{names:?}");
        for f in 0..10 {
            let a = fs.lookup(dir.ino, &format!("f{f}")).await.unwrap();
            assert_eq!(a.perm, 0o600);
        }
    }
    // No LIST: every page was fetched ahead. The files' HEADs started as their pages
    // were taken (their directory's sibling was being stat'ed), each file's once.
    assert_eq!(mem.lists(), lists, "all listed ahead");
    assert!(mem.heads() - heads <= 33, "{} HEADs", mem.heads() - heads);
}

/// A page listed ahead is not used once a name changed through the mount since.
#[tokio::test]
async fn a_page_listed_ahead_is_dropped_after_a_change() {
    let mem = Arc::new(MemClient::new());
    for d in 0..2 {
        mem.insert(&format!("t/d{d}/f"), "x");
    }
    let fs = fs_with(mem.clone(), "");
    let t = fs.lookup(ROOT, "t").await.unwrap();
    all_entries(&fs, t.ino).await;
    let d0 = fs.lookup(t.ino, "d0").await.unwrap();
    let fh = fs.opendir(d0.ino).await.unwrap();
    tokio::time::sleep(Duration::from_millis(50)).await;
    let d1 = fs.lookup(t.ino, "d1").await.unwrap();
    fs.unlink(d1.ino, "f").await.unwrap();
    mem.insert("t/d1/g", "y");
    let names: Vec<String> = all_entries(&fs, d1.ino)
        .await
        .into_iter()
        .map(|e| e.name)
        .collect();
    assert_eq!(names, [".", "..", "g"]);
    fs.releasedir(fh);
}

/// The kernel holds an inode a dead mounter handed out; its replacement restored it from
/// the inode log without knowing the kernel's count. Renaming it must keep it: rename's
/// own lookups must not go through the kernel's reference counting.
#[tokio::test]
async fn renaming_an_inode_a_replacement_restored_keeps_it() {
    use inode_log::{Binding, InodeLog, Loaded};
    let mem = Arc::new(MemClient::new());
    mem.insert("a", "content");
    let fs = fs_with(mem.clone(), "");
    let dir = std::env::temp_dir().join(format!("s3csi-rename-restored-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let ino = 7;
    let restored = Loaded {
        bindings: vec![Binding {
            ino,
            parent: ROOT,
            kind: Kind::File,
            key: "a".into(),
        }],
        max_ino: ino,
    };
    let log = InodeLog::create(&dir.join("inodes.log"), "", &[]).unwrap();
    fs.enable_recovery(restored, log, 1);
    fs.rename(ROOT, "a", ROOT, "b", false).await.unwrap();
    let attr = fs
        .getattr(ino)
        .await
        .expect("the renamed inode is still known");
    assert_eq!(attr.size, 7);
    assert_eq!(fs.lookup(ROOT, "b").await.unwrap().ino, ino);
    assert_eq!(mem.get("b").unwrap().as_ref(), b"content");
    let _ = std::fs::remove_dir_all(&dir);
}

// ---- POSIX metadata (meta.rs, meta_update.rs) ---------------------------------------

fn headers(pairs: &[(&str, &str)]) -> crate::s3::UserMeta {
    pairs
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

impl Store {
    async fn put_meta(&self, key: &str, body: &str, meta: &[(&str, &str)]) {
        self.client()
            .put_object_with_meta(key, Bytes::copy_from_slice(body.as_bytes()), &headers(meta))
            .await
            .unwrap();
    }

    async fn meta(&self, key: &str) -> crate::s3::UserMeta {
        self.client().head_object_with_meta(key).await.unwrap().1
    }
}

async fn all_entries(fs: &S3Fs, ino: u64) -> Vec<DirEntry> {
    let fh = fs.opendir(ino).await.unwrap();
    let mut out: Vec<DirEntry> = Vec::new();
    let mut off = 0;
    loop {
        let batch = fs.readdir(fh, off, usize::MAX).await.unwrap();
        let Some(last) = batch.last() else { break };
        off = last.offset;
        out.extend(batch);
    }
    fs.releasedir(fh);
    out
}

async fn s3fs_metadata_is_shown_and_listings_load_it_in_one_batch(store: Store) {
    use meta::NodeType;
    // As s3fs 1.90 wrote them (see meta.rs).
    store
        .put_meta(
            "d/f",
            "hi",
            &[
                ("mode", "35305"),
                ("uid", "1234"),
                ("gid", "5678"),
                ("mtime", "1577934245.5"),
            ],
        )
        .await;
    store.put_meta("d/lnk", "f", &[("mode", "41471")]).await;
    store.put_meta("d/fifo", "", &[("mode", "4516")]).await;
    store.put_meta("d/sub/", "", &[("mode", "448")]).await;
    store
        .put_meta("d/bad", "x", &[("mode", "rwx"), ("uid", "-3")])
        .await;
    store.put("d/plain", "p").await;
    let fs = fs_with_store(&store, "");
    let d = fs.lookup(ROOT, "d").await.unwrap();
    let entries = all_entries(&fs, d.ino).await;
    // A listing tells no metadata: its entries go out uncached, so that the first stat
    // of each asks (and a symlink gets an inode of its type then).
    for e in entries.iter().filter(|e| e.name != "." && e.name != "..") {
        assert_eq!(
            fs.entry_attr(e.ino).unwrap().ttl,
            Duration::ZERO,
            "{}",
            e.name
        );
    }
    // The first stat loads the metadata of the entries listed after it in one batch. Those
    // HEADs run in the background: a listing shows their types once they are answered.
    let a = fs.lookup(d.ino, "bad").await.unwrap();
    assert_eq!(a.node, NodeType::File);
    let deadline = Instant::now() + Duration::from_secs(10);
    let entries = loop {
        let entries = all_entries(&fs, d.ino).await;
        let lnk = entries.iter().find(|e| e.name == "lnk").map(|e| e.node);
        if lnk == Some(NodeType::Symlink) || Instant::now() > deadline {
            break entries;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    let node = |n: &str| entries.iter().find(|e| e.name == n).unwrap().node;
    assert_eq!(node("lnk"), NodeType::Symlink);
    assert_eq!(node("fifo"), NodeType::Fifo);
    assert_eq!(node("sub"), NodeType::Dir);
    let a = fs.lookup(d.ino, "f").await.unwrap();
    assert_eq!((a.perm, a.uid, a.gid), (0o4751, 1234, 5678));
    assert_eq!(
        a.mtime,
        std::time::UNIX_EPOCH + Duration::new(1577934245, 500_000_000)
    );
    assert_eq!(fs.lookup(d.ino, "sub").await.unwrap().perm, 0o700);
    let l = fs.lookup(d.ino, "lnk").await.unwrap();
    assert_eq!(fs.readlink(l.ino).await.unwrap(), b"f");
    // Malformed headers and objects without any keep the mount's defaults.
    let cfg = fs.config().clone();
    for name in ["bad", "plain"] {
        let a = fs.lookup(d.ino, name).await.unwrap();
        assert_eq!(
            (a.perm, a.uid, a.node),
            (cfg.file_mode, cfg.uid, NodeType::File)
        );
    }
    if let Store::Mem(mem) = &store {
        // The listing's HEADs answered every lookup above: none asks S3 again (once the
        // listing's last HEADs, sent in the background, are answered).
        let mut before = mem.metadata_requests();
        loop {
            tokio::time::sleep(Duration::from_millis(30)).await;
            let now = mem.metadata_requests();
            if now == before {
                break;
            }
            before = now;
        }
        for n in ["f", "lnk", "fifo", "sub", "bad", "plain"] {
            fs.lookup(d.ino, n).await.unwrap();
        }
        assert_eq!(mem.metadata_requests(), before);
    }
}

async fn chmod_chown_utimes_persist_in_one_copy_each_file(store: Store) {
    use meta_update::SetAttrs;
    store.put("f", "content").await;
    // tar's three calls come within microseconds; a loaded test machine may take longer
    // between them than the default 100 ms window.
    let fs = S3Fs::new(
        store.client(),
        FsConfig {
            part_size: match store {
                Store::Mem(_) => 5,
                Store::Server { .. } => 5 * 1024 * 1024,
            },
            metadata_ttl: Duration::from_secs(60),
            meta_save_delay: Duration::from_secs(1),
            ..FsConfig::default()
        },
    );
    let a = fs.lookup(ROOT, "f").await.unwrap();
    let t = std::time::UNIX_EPOCH + Duration::new(1_000_000_000, 123);
    // tar's order: chown, chmod, utimes; each answered at once.
    for set in [
        SetAttrs {
            uid: Some(7),
            gid: Some(8),
            ..Default::default()
        },
        SetAttrs {
            mode: Some(0o640),
            ..Default::default()
        },
        SetAttrs {
            mtime: Some(t),
            atime: Some(t),
            ..Default::default()
        },
    ] {
        fs.set_attrs(a.ino, set).await.unwrap();
    }
    let shown = fs.getattr(a.ino).await.unwrap();
    assert_eq!(
        (shown.perm, shown.uid, shown.gid, shown.mtime),
        (0o640, 7, 8, t)
    );
    tokio::time::sleep(Duration::from_millis(1400)).await;
    if let Store::Mem(mem) = &store {
        assert_eq!(
            mem.meta_replacements(),
            1,
            "one CopyObject for the three changes"
        );
    }
    let h = store.meta("f").await;
    assert_eq!(h["mode"], "33184");
    assert_eq!((h["uid"].as_str(), h["gid"].as_str()), ("7", "8"));
    assert_eq!(h["mtime"], "1000000000.000000123");
    assert_eq!(store.get("f").await.unwrap().as_ref(), b"content");
    // A new mount (a remount) shows them.
    let again = fs_with_store(&store, "");
    let b = again.lookup(ROOT, "f").await.unwrap();
    assert_eq!((b.perm, b.uid, b.gid, b.mtime), (0o640, 7, 8, t));
    // A file being written takes its metadata with its upload: no copy.
    let (c, fh) = fs.create(ROOT, "w", W).await.unwrap();
    fs.init_meta(c.ino, 0o600, meta_update::Creator { uid: 1, gid: 2 });
    fs.write(fh, 0, b"abc", None).await.unwrap();
    fs.set_attrs(
        c.ino,
        SetAttrs {
            mode: Some(0o604),
            mtime: Some(t),
            ..Default::default()
        },
    )
    .await
    .unwrap();
    fs.release(fh).await.unwrap();
    let h = store.meta("w").await;
    assert_eq!((h["mode"].as_str(), h["uid"].as_str()), ("33156", "1"));
    assert_eq!(h["mtime"], "1000000000.000000123");
    if let Store::Mem(mem) = &store {
        tokio::time::sleep(Duration::from_millis(300)).await;
        assert_eq!(mem.meta_replacements(), 1);
    }
}

/// Two saves of one file's metadata at once (the timers of tar's chown, chmod and utimes
/// fire together; an fsync meets a timer) send one CopyObject: the second waits for the
/// first, which took its change along. Before, each copied the object.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn saves_of_one_file_run_one_at_a_time() {
    use meta_update::SetAttrs;
    let mem = Arc::new(MemClient::new());
    mem.insert("f", "content");
    let fs = S3Fs::new(
        mem.clone(),
        FsConfig {
            metadata_ttl: Duration::from_secs(60),
            // Only the saves this test starts.
            meta_save_delay: Duration::from_secs(3600),
            ..FsConfig::default()
        },
    );
    let a = fs.lookup(ROOT, "f").await.unwrap();
    let chmod = SetAttrs {
        mode: Some(0o600),
        ..Default::default()
    };
    fs.set_attrs(a.ino, chmod).await.unwrap();
    let gate = mem.hold_metadata_replacements();
    let release = async {
        while mem.meta_replacements() == 0 {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        // Time for the second save to reach the store too, if it would.
        tokio::time::sleep(Duration::from_millis(100)).await;
        gate.add_permits(2);
    };
    let (first, second, ()) = tokio::join!(fs.save_meta(a.ino), fs.save_meta(a.ino), release);
    first.unwrap();
    second.unwrap();
    assert_eq!(mem.meta_replacements(), 1);
    assert_eq!(mem.user_meta("f")["mode"], "33152");
    assert_eq!(fs.getattr(a.ino).await.unwrap().perm, 0o600);
}

async fn new_files_directories_symlinks_and_fifos_carry_s3fs_headers(store: Store) {
    use meta_update::Creator;
    let who = Creator {
        uid: 1000,
        gid: 100,
    };
    let fs = fs_with_store(&store, "");
    let (a, fh) = fs.create(ROOT, "f", W).await.unwrap();
    fs.init_meta(a.ino, 0o751, who);
    fs.write(fh, 0, b"x", None).await.unwrap();
    fs.release(fh).await.unwrap();
    let d = fs.mkdir_as(ROOT, "d", Some((0o705, who))).await.unwrap();
    assert_eq!(d.perm, 0o705);
    let l = fs.symlink(d.ino, "l", "../f", who).await.unwrap();
    assert_eq!(l.node, meta::NodeType::Symlink);
    let p = fs
        .mknod(d.ino, "p", libc::S_IFIFO | 0o644, 0, who)
        .await
        .unwrap();
    assert_eq!(p.node, meta::NodeType::Fifo);
    let dev = libc::makedev(1, 3) as u32;
    let c = fs
        .mknod(d.ino, "c", libc::S_IFCHR | 0o600, dev, who)
        .await
        .unwrap();
    assert_eq!((c.node, c.rdev), (meta::NodeType::CharDev, dev));
    fs.flush_all().await;
    assert_eq!(store.meta("d/c").await["rdev"], dev.to_string());
    let f = store.meta("f").await;
    assert_eq!(
        (f["mode"].as_str(), f["uid"].as_str(), f["gid"].as_str()),
        ("33257", "1000", "100")
    );
    assert!(meta::parse_time(&f["mtime"]).is_some() && f.contains_key("ctime"));
    assert_eq!(store.meta("d/").await["mode"], "453", "no S_IFDIR, as s3fs");
    assert_eq!(store.meta("d/l").await["mode"], "41471");
    assert_eq!(store.get("d/l").await.unwrap().as_ref(), b"../f");
    assert_eq!(store.meta("d/p").await["mode"], "4516");
    // Read back by a new mount.
    let again = fs_with_store(&store, "");
    let d2 = again.lookup(ROOT, "d").await.unwrap();
    let l2 = again.lookup(d2.ino, "l").await.unwrap();
    assert_eq!(again.readlink(l2.ino).await.unwrap(), b"../f");
    assert_eq!(again.lookup(d2.ino, "c").await.unwrap().rdev, dev);
    assert!(matches!(
        fs.symlink(d.ino, "l", "elsewhere", who).await,
        Err(FsError::Exists)
    ));
}

/// `--posix-acl` (issue 40.7): an ACL's value in the kernel's xattr form.
fn acl_value(entries: &[(u16, u16, u32)]) -> Vec<u8> {
    let mut v = 2u32.to_le_bytes().to_vec();
    for (tag, perm, id) in entries {
        v.extend_from_slice(&tag.to_le_bytes());
        v.extend_from_slice(&perm.to_le_bytes());
        v.extend_from_slice(&id.to_le_bytes());
    }
    v
}

async fn posix_acls_set_the_mode_follow_chmod_and_are_inherited(store: Store) {
    const ACCESS: &str = "system.posix_acl_access";
    const DEFAULT: &str = "system.posix_acl_default";
    store.put("f", "x").await;
    let plain = fs_with_store(&store, "");
    let f = plain.lookup(ROOT, "f").await.unwrap();
    let named = acl_value(&[
        (1, 6, 0),
        (2, 4, 65534),
        (4, 4, 0),
        (0x10, 4, 0),
        (0x20, 0, 0),
    ]);
    assert!(
        matches!(
            plain.change_xattr(f.ino, ACCESS, Some(&named), 0).await,
            Err(FsError::Unsupported(_))
        ),
        "no ACLs without --posix-acl: the kernel would not enforce them"
    );
    let fs = S3Fs::new(
        store.client(),
        FsConfig {
            posix_acl: true,
            metadata_ttl: Duration::from_secs(60),
            ..FsConfig::default()
        },
    );
    let f = fs.lookup(ROOT, "f").await.unwrap();
    assert!(matches!(
        fs.change_xattr(f.ino, ACCESS, Some(b"junk"), 0).await,
        Err(FsError::Invalid(_))
    ));
    fs.change_xattr(f.ino, ACCESS, Some(&named), 0)
        .await
        .unwrap();
    assert_eq!(
        fs.getattr(f.ino).await.unwrap().perm,
        0o640,
        "owner, mask, other"
    );
    assert_eq!(fs.getxattr(f.ino, ACCESS).await.unwrap(), named);
    // chmod moves the mask, not the named entry.
    fs.set_attrs(
        f.ino,
        meta_update::SetAttrs {
            mode: Some(0o600),
            ..Default::default()
        },
    )
    .await
    .unwrap();
    let chmodded = acl_value(&[
        (1, 6, 0),
        (2, 4, 65534),
        (4, 4, 0),
        (0x10, 0, 0),
        (0x20, 0, 0),
    ]);
    assert_eq!(fs.getxattr(f.ino, ACCESS).await.unwrap(), chmodded);
    fs.fsync_meta_for_tests(f.ino).await;
    assert_eq!(
        store.meta("f").await["mode"],
        (libc::S_IFREG | 0o600).to_string()
    );
    let again = S3Fs::new(
        store.client(),
        FsConfig {
            posix_acl: true,
            ..FsConfig::default()
        },
    );
    let g = again.lookup(ROOT, "f").await.unwrap();
    assert_eq!(again.getxattr(g.ino, ACCESS).await.unwrap(), chmodded);
    // An ACL that says no more than the mode is the mode.
    let minimal = acl_value(&[(1, 7, 0), (4, 5, 0), (0x20, 5, 0)]);
    again
        .change_xattr(g.ino, ACCESS, Some(&minimal), 0)
        .await
        .unwrap();
    assert_eq!(again.getattr(g.ino).await.unwrap().perm, 0o755);
    assert!(matches!(
        again.getxattr(g.ino, ACCESS).await,
        Err(FsError::NoAttr)
    ));
    again.change_xattr(g.ino, ACCESS, None, 0).await.unwrap();

    // A directory's default ACL: new entries inherit it, the umask does not apply.
    let d = fs.mkdir(ROOT, "d").await.unwrap();
    let default = acl_value(&[
        (1, 7, 0),
        (8, 6, 2000),
        (4, 5, 0),
        (0x10, 7, 0),
        (0x20, 5, 0),
    ]);
    fs.change_xattr(d.ino, DEFAULT, Some(&default), 0)
        .await
        .unwrap();
    let (mode, inherited) = fs
        .new_entry_mode(d.ino, libc::S_IFREG | 0o666, 0o077, false)
        .await;
    assert_eq!(mode, libc::S_IFREG | 0o664, "mask rw, other r: no umask");
    assert_eq!(
        inherited,
        vec![(
            ACCESS.to_string(),
            acl_value(&[
                (1, 6, 0),
                (8, 6, 2000),
                (4, 5, 0),
                (0x10, 6, 0),
                (0x20, 4, 0)
            ])
        )]
    );
    let (mode, inherited) = fs.new_entry_mode(d.ino, 0o777, 0o077, true).await;
    assert_eq!(mode, 0o775);
    assert_eq!(
        inherited.len(),
        2,
        "a subdirectory also gets the default ACL"
    );
    let sub = fs
        .mkdir_as(
            d.ino,
            "sub",
            Some((mode, meta_update::Creator { uid: 0, gid: 0 })),
        )
        .await
        .unwrap();
    fs.add_inherited(sub, inherited);
    fs.flush_all().await;
    let again = S3Fs::new(
        store.client(),
        FsConfig {
            posix_acl: true,
            ..FsConfig::default()
        },
    );
    let d2 = again.lookup(ROOT, "d").await.unwrap();
    let sub2 = again.lookup(d2.ino, "sub").await.unwrap();
    assert_eq!(again.getxattr(sub2.ino, DEFAULT).await.unwrap(), default);
    assert!(again.getxattr(sub2.ino, ACCESS).await.is_ok());
    // Without a default ACL the umask applies.
    let (mode, inherited) = again
        .new_entry_mode(ROOT, libc::S_IFREG | 0o666, 0o022, false)
        .await;
    assert_eq!((mode, inherited.len()), (libc::S_IFREG | 0o644, 0));
}

async fn xattrs_round_trip_in_s3fs_encoding(store: Store) {
    store.put("f", "x").await;
    let fs = fs_with_store(&store, "");
    let a = fs.lookup(ROOT, "f").await.unwrap();
    fs.change_xattr(a.ino, "user.foo", Some(b"bar"), 0)
        .await
        .unwrap();
    fs.change_xattr(a.ino, "user.bin", Some(b"\x00\xff/+= x"), 0)
        .await
        .unwrap();
    assert!(matches!(
        fs.change_xattr(a.ino, "user.foo", Some(b"again"), libc::XATTR_CREATE)
            .await,
        Err(FsError::Exists)
    ));
    assert!(matches!(
        fs.change_xattr(a.ino, "security.selinux", Some(b"x"), 0)
            .await,
        Err(FsError::Unsupported(_))
    ));
    assert!(matches!(
        fs.change_xattr(a.ino, "user.big", Some(&[b'x'; 3000]), 0)
            .await,
        Err(FsError::XattrTooBig)
    ));
    assert_eq!(fs.listxattr(a.ino).await.unwrap(), b"user.bin\0user.foo\0");
    fs.fsync_meta_for_tests(a.ino).await;
    assert_eq!(
        store.meta("f").await["xattr"],
        "%7B%22user.bin%22%3A%22AP8vKz0geA%3D%3D%22%2C%22user.foo%22%3A%22YmFy%22%7D"
    );
    let again = fs_with_store(&store, "");
    let b = again.lookup(ROOT, "f").await.unwrap();
    assert_eq!(again.getxattr(b.ino, "user.foo").await.unwrap(), b"bar");
    again
        .change_xattr(b.ino, "user.foo", None, 0)
        .await
        .unwrap();
    assert!(matches!(
        again.getxattr(b.ino, "user.foo").await,
        Err(FsError::NoAttr)
    ));
    assert!(matches!(
        again.change_xattr(b.ino, "user.foo", None, 0).await,
        Err(FsError::NoAttr)
    ));
}

#[tokio::test]
async fn an_exclusive_create_never_overwrites_what_another_client_created_meanwhile() {
    let mem = Arc::new(MemClient::new());
    let fs = fs_with(mem.clone(), "");
    assert!(!names(&fs, ROOT).await.contains(&"streamed".to_string()));
    // Created by another client after this mount's listing said the name was free.
    mem.insert("streamed", "theirs");
    mem.insert("staged", "theirs");
    let excl = OpenMode {
        exclusive: true,
        ..W
    };
    let (_, fh) = fs.create(ROOT, "streamed", excl).await.unwrap();
    fs.write(fh, 0, b"mine", Some(1)).await.unwrap();
    assert!(fs.flush(fh, 1).await.is_err(), "refused: the key exists");
    let _ = fs.release(fh).await;
    let (_, fh) = fs.create(ROOT, "staged", excl).await.unwrap();
    fs.write(fh, 0, b"mine", Some(1)).await.unwrap();
    fs.write(fh, 1, b"I", Some(1)).await.unwrap(); // staged now
    assert!(fs.flush(fh, 1).await.is_err(), "refused: the key exists");
    let _ = fs.release(fh).await;
    assert_eq!(mem.get("streamed").unwrap().as_ref(), b"theirs");
    assert_eq!(mem.get("staged").unwrap().as_ref(), b"theirs");
    // Without a rival the same creates go through.
    for name in ["a", "b"] {
        let (_, fh) = fs.create(ROOT, name, excl).await.unwrap();
        fs.write(fh, 0, b"mine", Some(1)).await.unwrap();
        if name == "b" {
            fs.write(fh, 1, b"I", Some(1)).await.unwrap();
        }
        fs.flush(fh, 1).await.unwrap();
        fs.release(fh).await.unwrap();
    }
    assert_eq!(mem.get("a").unwrap().as_ref(), b"mine");
    assert_eq!(mem.get("b").unwrap().as_ref(), b"mIne");
}

#[tokio::test]
async fn rename_copies_only_the_version_this_mount_knows() {
    let mem = Arc::new(MemClient::new());
    mem.insert("a", "v1");
    let fs = fs_with(mem.clone(), "");
    let a = fs.lookup(ROOT, "a").await.unwrap();
    assert_eq!(a.size, 2);
    // Another client replaces it within the metadata TTL: the copy must not take theirs
    // under the new name while this mount believes it moved v1.
    mem.insert("a", "v2 by another client");
    assert!(fs.rename(ROOT, "a", ROOT, "b", false).await.is_err());
    assert_eq!(mem.get("a").unwrap().as_ref(), b"v2 by another client");
    assert!(mem.get("b").is_none());
}

/// A file open for writing can be renamed (log rotation, a tool that renames its output
/// while writing it): S3 holds what was written so far under the new name at once, and
/// what is written next reaches the new name at close; readers follow it too.
#[tokio::test]
async fn a_file_open_for_writing_moves_with_what_was_written() {
    let mem = Arc::new(MemClient::new());
    mem.insert("log", "old ");
    let fs = fs_with(mem.clone(), "");
    // A stream (create + sequential writes) and an edit of an existing object.
    let (_, stream) = fs.create(ROOT, "new", W).await.unwrap();
    fs.write(stream, 0, b"streamed", Some(1)).await.unwrap();
    let log = fs.lookup(ROOT, "log").await.unwrap();
    let edit = fs.open(log.ino, APPEND).await.unwrap();
    let reader = fs.open(log.ino, R).await.unwrap();
    fs.write(edit, 4, b"line1 ", Some(1)).await.unwrap();
    fs.rename(ROOT, "new", ROOT, "new.1", false).await.unwrap();
    fs.rename(ROOT, "log", ROOT, "log.1", false).await.unwrap();
    // (The old keys' DELETEs are sent in the background: see `deletes.rs`.)
    for gone in ["new", "log"] {
        assert!(matches!(
            fs.lookup(ROOT, gone).await,
            Err(FsError::NotFound)
        ));
    }
    assert_eq!(mem.get("new.1").unwrap().as_ref(), b"streamed");
    assert_eq!(mem.get("log.1").unwrap().as_ref(), b"old line1 ");
    fs.write(stream, 8, b" on", Some(1)).await.unwrap();
    fs.write(edit, 10, b"line2", Some(1)).await.unwrap();
    assert_eq!(
        fs.read(reader, 0, 64).await.unwrap().as_ref(),
        b"old line1 line2"
    );
    for fh in [stream, edit] {
        fs.flush(fh, 1).await.unwrap();
        fs.release(fh).await.unwrap();
    }
    fs.release(reader).await.unwrap();
    assert_eq!(fs.flush_all().await, 0);
    assert_eq!(mem.get("new.1").unwrap().as_ref(), b"streamed on");
    assert_eq!(mem.get("log.1").unwrap().as_ref(), b"old line1 line2");
    assert!(mem.get("new").is_none() && mem.get("log").is_none());
    // A reader opened before a rename of a file nobody writes reads on from the new name.
    let fh = fs.open(log.ino, R).await.unwrap();
    assert_eq!(fs.read(fh, 0, 3).await.unwrap().as_ref(), b"old");
    fs.rename(ROOT, "log.1", ROOT, "log.2", false)
        .await
        .unwrap();
    let rest = fs.read(fh, 3, 64).await.unwrap();
    assert_eq!(rest.as_ref(), b" line1 line2");
    fs.release(fh).await.unwrap();
}

/// `--cache-memory`: what one handle's random read fetched (a footer) serves the next
/// handle's reads of it with no GET; another version of the object is not served from it.
#[tokio::test]
async fn random_reads_are_kept_in_memory_for_every_handle() {
    let mem = Arc::new(MemClient::new());
    let body: Vec<u8> = (0..4_000_000u32).map(|i| (i % 251) as u8).collect();
    mem.insert("f", body.clone());
    let fs = S3Fs::new(
        mem.clone(),
        FsConfig {
            cache_memory: 8 << 20,
            metadata_ttl: Duration::ZERO,
            ..FsConfig::default()
        },
    );
    let a = fs.lookup(ROOT, "f").await.unwrap();
    let tail = 3_990_000usize;
    let read = |at: usize, n: u32| {
        let fs = &fs;
        async move {
            let fh = fs.open(a.ino, R).await.unwrap();
            let got = fs.read(fh, at as u64, n).await.unwrap();
            fs.release(fh).await.unwrap();
            got
        }
    };
    assert_eq!(read(tail, 1000).await.as_ref(), &body[tail..tail + 1000]);
    let gets = mem.gets();
    assert_eq!(
        read(tail + 100, 500).await.as_ref(),
        &body[tail + 100..tail + 600]
    );
    assert_eq!(mem.gets(), gets, "the second handle's read sent a GET");
    // Replaced: the next open learns the new ETag, and reads the new bytes.
    let other: Vec<u8> = body.iter().map(|b| b ^ 0xff).collect();
    mem.insert("f", other.clone());
    assert_eq!(
        read(tail + 100, 500).await.as_ref(),
        &other[tail + 100..tail + 600]
    );
}

/// A directory five times the table's cap (`--max-entries`), walked as `ls -f` and then
/// as `ls -l` does through the kernel (READDIRPLUS replies of which only some entries fit,
/// the kernel holding those and dropping them a batch at a time as its cache would, a
/// stat of each name), then stat'ed at random past the TTL: every listed name resolves
/// every time, to the inode the listing gave, while eviction runs all along.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_directory_larger_than_the_entry_cap_never_loses_a_name() {
    const KEYS: usize = 5_000;
    const CAP: usize = 1_000;
    let mem = Arc::new(MemClient::new());
    for i in 0..KEYS {
        mem.insert(&format!("big/f{i:05}"), "x");
    }
    let fs = S3Fs::new(
        mem.clone(),
        FsConfig {
            max_entries: CAP,
            metadata_ttl: Duration::from_millis(300),
            ..FsConfig::default()
        },
    );
    let big = fs.lookup(ROOT, "big").await.unwrap();
    let listed = all_entries(&fs, big.ino).await;
    assert_eq!(listed.len(), KEYS + 2);
    assert!(fs.inode_count() <= CAP + 2, "{} inodes", fs.inode_count());

    let fh = fs.opendir(big.ino).await.unwrap();
    let (mut off, mut seen, mut peak) = (0, 0, 0);
    let mut held: Vec<u64> = Vec::new();
    let mut last = String::new();
    loop {
        let batch = fs.readdir(fh, off, usize::MAX).await.unwrap();
        if batch.is_empty() {
            break;
        }
        // What fits a kernel buffer: 40 entries.
        let replied = fs.reply_entries(big.ino, batch);
        let (sent, unsent) = replied.split_at(replied.len().min(40));
        let inos = |v: &[(DirEntry, Attr)]| -> Vec<u64> {
            v.iter()
                .filter(|(e, _)| e.name != "." && e.name != "..")
                .map(|(e, _)| e.ino)
                .collect()
        };
        fs.settle_reply(&inos(sent), &inos(unsent));
        for (e, a) in sent {
            off = e.offset;
            if e.name == "." || e.name == ".." {
                continue;
            }
            assert!(e.name > last, "{} after {last}", e.name);
            last = e.name.clone();
            assert_eq!(a.ino, e.ino);
            held.push(e.ino);
            let s = fs.lookup(big.ino, &e.name).await.unwrap();
            assert_eq!(s.ino, e.ino, "{}", e.name);
            assert_eq!(s.size, 1);
            held.push(s.ino);
            seen += 1;
        }
        peak = peak.max(fs.inode_count());
        if held.len() > 600 {
            for ino in held.drain(..) {
                fs.forget(ino, 1);
            }
        }
    }
    fs.releasedir(fh);
    assert_eq!(seen, KEYS);
    assert!(peak <= CAP + 700, "the table grew to {peak}");

    tokio::time::sleep(Duration::from_millis(350)).await;
    for i in (0..KEYS).step_by(7) {
        let a = fs.lookup(big.ino, &format!("f{i:05}")).await.unwrap();
        fs.forget(a.ino, 1);
    }
    assert!(matches!(
        fs.lookup(big.ino, "f99999").await,
        Err(FsError::NotFound)
    ));
}

// ---- Content-Type (config::content_type) ---------------------------------------------

/// The Content-Type `key` has in the store (`None`: stored without one).
async fn content_type_of(store: &Store, key: &str) -> Option<String> {
    store.meta(key).await.get(crate::s3::CONTENT_TYPE).cloned()
}

async fn content_types_are_inferred_and_kept(store: Store) {
    use meta_update::SetAttrs;
    // Another client's object with a type of its own.
    store
        .put_meta("e.dat", "theirs", &[(crate::s3::CONTENT_TYPE, "x/custom")])
        .await;
    let fs = fs_with_store(&store, "");
    for (name, body) in [
        ("a.html", "<p>hello</p>"),
        ("b.json", "{\"k\": 1}"),
        ("c", "x"),
    ] {
        let (f, fh) = fs.create(ROOT, name, W).await.unwrap();
        fs.init_meta(f.ino, 0o644, meta_update::Creator { uid: 1, gid: 2 });
        fs.write(fh, 0, body.as_bytes(), None).await.unwrap();
        fs.release(fh).await.unwrap();
    }
    assert_eq!(fs.flush_all().await, 0);
    let ct = |t: Option<String>| t.unwrap_or_else(|| "(none)".into());
    assert_eq!(ct(content_type_of(&store, "a.html").await), "text/html");
    assert_eq!(
        ct(content_type_of(&store, "b.json").await),
        "application/json"
    );
    assert_eq!(
        ct(content_type_of(&store, "c").await),
        "application/octet-stream"
    );
    // chmod: a copy onto itself that replaces the metadata, the type included.
    let b = fs.lookup(ROOT, "b.json").await.unwrap();
    let chmod = |mode| SetAttrs {
        mode: Some(mode),
        ..Default::default()
    };
    fs.set_attrs(b.ino, chmod(0o600)).await.unwrap();
    fs.fsync_meta_for_tests(b.ino).await;
    let h = store.meta("b.json").await;
    assert_eq!(h["mode"], (libc::S_IFREG | 0o600).to_string());
    assert_eq!(
        ct(h.get(crate::s3::CONTENT_TYPE).cloned()),
        "application/json"
    );
    // A rename that changes the extension re-infers the type, as s3fs does.
    fs.rename(ROOT, "a.html", ROOT, "a.txt", false)
        .await
        .unwrap();
    assert_eq!(ct(content_type_of(&store, "a.txt").await), "text/plain");
    assert_eq!(store.get("a.txt").await.unwrap().as_ref(), b"<p>hello</p>");
    assert!(store.get("a.html").await.is_none());
    // ... and the inode knows it: a chmod after it keeps the new type.
    let a = fs.lookup(ROOT, "a.txt").await.unwrap();
    fs.set_attrs(a.ino, chmod(0o640)).await.unwrap();
    fs.fsync_meta_for_tests(a.ino).await;
    assert_eq!(ct(content_type_of(&store, "a.txt").await), "text/plain");

    // Another client's type survives an edit in place, a chmod and a rename that keeps
    // the extension.
    let e = fs.lookup(ROOT, "e.dat").await.unwrap();
    let fh = fs.open(e.ino, RW).await.unwrap();
    fs.write(fh, 0, b"T", Some(1)).await.unwrap();
    fs.flush(fh, 1).await.unwrap();
    fs.release(fh).await.unwrap();
    assert_eq!(store.get("e.dat").await.unwrap().as_ref(), b"Theirs");
    assert_eq!(ct(content_type_of(&store, "e.dat").await), "x/custom");
    fs.set_attrs(e.ino, chmod(0o604)).await.unwrap();
    fs.fsync_meta_for_tests(e.ino).await;
    let h = store.meta("e.dat").await;
    assert_eq!(h["mode"], (libc::S_IFREG | 0o604).to_string());
    assert_eq!(ct(h.get(crate::s3::CONTENT_TYPE).cloned()), "x/custom");
    fs.rename(ROOT, "e.dat", ROOT, "f.dat", false)
        .await
        .unwrap();
    assert_eq!(ct(content_type_of(&store, "f.dat").await), "x/custom");
    // A rewrite from the start (O_TRUNC) is an edit too: the type stays.
    let f = fs.lookup(ROOT, "f.dat").await.unwrap();
    let fh = fs.open(f.ino, W).await.unwrap();
    fs.write(fh, 0, b"rewritten", Some(1)).await.unwrap();
    fs.release(fh).await.unwrap();
    assert_eq!(store.get("f.dat").await.unwrap().as_ref(), b"rewritten");
    assert_eq!(ct(content_type_of(&store, "f.dat").await), "x/custom");
    // Directory markers are typed as s3fs types them.
    fs.mkdir(ROOT, "d").await.unwrap();
    assert_eq!(
        ct(content_type_of(&store, "d/").await),
        "application/x-directory"
    );
}

/// `--content-type off` and a fixed type: new objects get that; existing ones keep theirs.
#[tokio::test]
async fn content_type_off_and_fixed() {
    use crate::config::content_type::ContentTypes;
    for (mode, want) in [
        (ContentTypes::Off, "application/octet-stream"),
        (ContentTypes::Fixed("text/x-mine".into()), "text/x-mine"),
    ] {
        let mem = Arc::new(MemClient::new());
        mem.insert_with_meta(
            "old.html",
            "old",
            [(crate::s3::CONTENT_TYPE.to_string(), "x/custom".to_string())].into(),
        );
        let fs = S3Fs::new(
            mem.clone(),
            FsConfig {
                part_size: 5,
                metadata_ttl: Duration::from_secs(60),
                content_type: mode.clone(),
                ..FsConfig::default()
            },
        );
        // Larger than a part: a multipart upload, which carries the type too.
        let (_, fh) = fs.create(ROOT, "a.html", W).await.unwrap();
        fs.write(fh, 0, b"<p>hello</p>", None).await.unwrap();
        fs.release(fh).await.unwrap();
        assert_eq!(fs.flush_all().await, 0);
        assert_eq!(mem.content_type("a.html").as_deref(), Some(want), "{mode}");
        fs.rename(ROOT, "old.html", ROOT, "old.txt", false)
            .await
            .unwrap();
        let kept = match mode {
            ContentTypes::Off => "x/custom",
            _ => want,
        };
        assert_eq!(mem.content_type("old.txt").as_deref(), Some(kept), "{mode}");
        fs.mkdir(ROOT, "d").await.unwrap();
        let marker = match mode {
            ContentTypes::Off => "application/octet-stream",
            _ => "application/x-directory",
        };
        assert_eq!(mem.content_type("d/").as_deref(), Some(marker), "{mode}");
    }
}

/// Issue 40.3: the directory objects older s3fs versions, Hadoop and consoles write.
async fn older_s3fs_directory_objects_are_directories(store: Store) {
    use meta_update::SetAttrs;
    let ct = crate::s3::CONTENT_TYPE;
    let old_dir = [
        (ct, "application/x-directory"),
        ("mode", "16877"),
        ("uid", "7"),
    ];
    store.put_meta("old", "", &old_dir).await;
    store.put("old/inside", "x").await;
    store.put_meta("empty", "", &old_dir).await;
    store.put_meta("direct", "", &old_dir).await;
    store.put("hadoop_$folder$", "").await;
    store.put("hadoop2_$folder$", "").await;
    store.put("hadoop2/f", "y").await;
    store.put("plain", "").await;
    let fs = fs_with_store(&store, "");
    let listed = names(&fs, ROOT).await;
    for name in ["old", "empty", "direct", "hadoop", "hadoop2", "plain"] {
        assert!(listed.contains(&name.to_string()), "{name} in {listed:?}");
    }
    assert!(!listed.iter().any(|n| n.contains("$folder$")), "{listed:?}");
    for name in ["old", "empty", "hadoop", "hadoop2"] {
        let a = fs.lookup(ROOT, name).await.unwrap();
        assert_eq!(a.kind, Kind::Dir, "{name}");
    }
    assert_eq!(fs.lookup(ROOT, "plain").await.unwrap().kind, Kind::File);
    let old = fs.lookup(ROOT, "old").await.unwrap();
    let empty = fs.lookup(ROOT, "empty").await.unwrap();
    assert_eq!(
        (empty.uid, empty.perm),
        (7, 0o755),
        "the old object's metadata"
    );
    assert_eq!(names(&fs, old.ino).await, [".", "..", "inside"]);
    // Listed again: still the same directory.
    names(&fs, ROOT).await;
    assert_eq!(fs.lookup(ROOT, "old").await.unwrap().ino, old.ino);
    // A change of its metadata writes the marker `dir/` in place of the old object.
    let chmod = SetAttrs {
        mode: Some(0o700),
        ..Default::default()
    };
    fs.set_attrs(empty.ino, chmod).await.unwrap();
    fs.fsync_meta_for_tests(empty.ino).await;
    let keys = store.keys().await;
    assert!(
        keys.contains(&"empty/".to_string()) && !keys.contains(&"empty".to_string()),
        "{keys:?}"
    );
    assert_eq!(store.meta("empty/").await["uid"], "7");
    // rmdir removes whichever form marks it; a non-empty one is refused.
    assert!(matches!(
        fs.rmdir(ROOT, "old").await,
        Err(FsError::NotEmpty)
    ));
    fs.rmdir(ROOT, "hadoop").await.unwrap();
    fs.rmdir(ROOT, "empty").await.unwrap();

    // A rename moves the directory, its old marker replaced by a marker.
    fs.rename(ROOT, "hadoop2", ROOT, "moved", false)
        .await
        .unwrap();
    // rmdir's DELETE is deferred (as every unlink's is): wait for it.
    assert_eq!(fs.flush_all().await, 0);
    let keys = store.keys().await;
    for gone in [
        "hadoop_$folder$",
        "hadoop2_$folder$",
        "hadoop2/f",
        "empty",
        "empty/",
    ] {
        assert!(
            !keys.contains(&gone.to_string()),
            "{gone} still in {keys:?}"
        );
    }
    assert!(keys.contains(&"moved/f".to_string()), "{keys:?}");
    // A lookup that no listing preceded (HEAD + LIST + HEAD of the marker) sees it too.
    let fresh = fs_with_store(&store, "");
    let direct = fresh.lookup(ROOT, "direct").await.unwrap();
    assert_eq!(direct.kind, Kind::Dir);
    fresh.rmdir(ROOT, "direct").await.unwrap();
    assert_eq!(fresh.flush_all().await, 0);
    assert!(!store.keys().await.contains(&"direct".to_string()));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_directory_removed_right_after_its_chmod_stays_removed() {
    use meta_update::SetAttrs;
    let store = Store::mem();
    store.put("e/", "").await;
    let fs = fs_with_store(&store, "");
    let e = fs.lookup(ROOT, "e").await.unwrap();
    let chmod = SetAttrs {
        mode: Some(0o700),
        ..Default::default()
    };
    fs.set_attrs(e.ino, chmod).await.unwrap();
    fs.fsync_meta_for_tests(e.ino).await;
    fs.rmdir(ROOT, "e").await.unwrap();
    assert_eq!(fs.flush_all().await, 0);
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(store.keys().await, Vec::<String>::new());
}

/// A new file closed empty has its PUT sent by a task (`defer_empty`). If that task ends
/// without an outcome (it panicked; the runtime stopped), nobody may take the file for
/// created: waiters get EIO, the unmount's `flush_all` ends, and the name goes as after a
/// failed PUT.
/// Before, the task's held mutex was its only signal: waiters saw no outcome as success,
/// the pending entry stayed, and `flush_all` went round its loop for ever.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_empty_put_task_that_dies_fails_its_waiters_and_lets_unmount_end() {
    let mem = Arc::new(MemClient::new());
    mem.panic_on_put("e");
    let fs = S3Fs::new(mem.clone(), FsConfig::default());
    let (a, fh) = fs.create(ROOT, "e", W).await.unwrap();
    fs.release(fh).await.unwrap();
    let fsync = tokio::time::timeout(Duration::from_secs(10), fs.await_pending(a.ino))
        .await
        .expect("a waiter for the dead task's PUT returns");
    assert!(fsync.is_err(), "no outcome taken for success: {fsync:?}");
    // The failure was told to the waiter above (and logged); nothing is left to wait for.
    tokio::time::timeout(Duration::from_secs(10), fs.flush_all())
        .await
        .expect("flush_all ends");
    assert!(mem.get("e").is_none());
    // As after a failed PUT, the name is gone (the lookup asks S3).
    assert!(matches!(fs.lookup(ROOT, "e").await, Err(FsError::NotFound)));
}
