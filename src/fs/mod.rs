//! The S3 file system, independent of FUSE.
//!
//! [`S3Fs`] answers file-system operations with S3 requests. `fuse.rs` is a thin adapter
//! from fuser's callbacks to these async methods; everything here can be unit-tested with
//! the in-memory client.
//!
//! Design notes:
//! - Directories are key prefixes. A directory exists when some key starts with
//!   `dir/` (implicit) or a `dir/` marker object exists (mkdir writes one, so empty
//!   directories persist). When both a file `a` and keys under `a/` exist, the
//!   directory wins and the file is hidden.
//! - Metadata learnt from HEAD or LIST is trusted for `metadata_ttl`; after that the
//!   next lookup or getattr asks S3 again, which is how changes by others show up.
//! - Files are written as whole new objects: create or O_TRUNC, sequential writes,
//!   durable at close/fsync (see `upload.rs`). Everything else that would need a
//!   read-modify-write of an object is refused with a clear errno.

pub mod deletes;
pub mod error;
pub mod fuse;
pub mod inode;
pub mod inode_log;
pub mod prefetch;
pub mod session;
pub mod upload;

use crate::s3::{ListPage, ListRequest, ObjectClient, S3Error};
use bytes::Bytes;
use deletes::DeferredDeletes;
pub use error::{FsError, FsResult};
use inode::{Inode, InodeTable, Kind};
use prefetch::{PrefetchConfig, Prefetcher, BUDGET_UNIT};
use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicU8, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};
use tokio::sync::Semaphore;
use upload::Upload;

/// S3 refuses keys longer than this.
const MAX_KEY_LEN: usize = 1024;
const LIST_PAGE: i32 = 1000;
/// Pages a background listing after a lookup miss reads at most (see `list_ahead`).
const LIST_AHEAD_PAGES: usize = 5;
/// Inode table size above which entries nobody holds are dropped.
const INODE_CAP: usize = 50_000;
/// Empty-file PUTs (see `S3Fs::defer_empty`) in flight at once; more wait their turn.
const CREATE_PUTS_IN_FLIGHT: usize = 64;

#[derive(Debug, Clone)]
pub struct FsConfig {
    pub prefix: String,
    pub uid: u32,
    pub gid: u32,
    pub file_mode: u16,
    pub dir_mode: u16,
    pub metadata_ttl: Duration,
    pub read_only: bool,
    pub part_size: u64,
    pub max_concurrency: usize,
    pub max_prefetch_memory: u64,
    pub max_upload_memory: u64,
    pub prefetch: PrefetchConfig,
    /// Close of a new empty file waits for its PUT (see `S3Fs::defer_empty`).
    pub sync_create: bool,
    /// `unlink` waits for S3 to answer its DELETE (see `deletes.rs`).
    pub sync_delete: bool,
    /// Reads and writes go through the kernel's page cache instead of direct I/O.
    pub page_cache: bool,
}

impl Default for FsConfig {
    fn default() -> Self {
        Self {
            prefix: String::new(),
            uid: 0,
            gid: 0,
            file_mode: 0o644,
            dir_mode: 0o755,
            metadata_ttl: Duration::from_secs(5),
            read_only: false,
            part_size: 8 * 1024 * 1024,
            max_concurrency: 16,
            max_prefetch_memory: 512 * 1024 * 1024,
            max_upload_memory: 256 * 1024 * 1024,
            prefetch: PrefetchConfig::default(),
            sync_create: false,
            sync_delete: false,
            page_cache: false,
        }
    }
}

/// What `stat` shows for an inode.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Attr {
    pub ino: u64,
    pub kind: Kind,
    pub size: u64,
    pub mtime: SystemTime,
    pub perm: u16,
    pub uid: u32,
    pub gid: u32,
    /// How long the kernel may cache this.
    pub ttl: Duration,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DirEntry {
    pub ino: u64,
    /// Opaque cookie the kernel hands back to continue after this entry.
    pub offset: u64,
    pub kind: Kind,
    pub name: String,
}

/// How a file was opened, reduced to what matters here.
#[derive(Debug, Clone, Copy, Default)]
pub struct OpenMode {
    pub write: bool,
    pub truncate: bool,
    pub append: bool,
}

enum FileState {
    Read(Prefetcher),
    Write(Upload),
    /// The upload completed (close/fsync); writing more would need an append.
    Committed,
    /// The file was unlinked while open: writes vanish, as they would on a local disk.
    Discarded,
}

struct OpenFile {
    /// Process (thread group) that opened the file: only its close commits the upload.
    opener: Option<u32>,
    ino: u64,
    key: String,
    writable: bool,
    append: bool,
    /// Opened by create(): a close with nothing written may defer the empty PUT.
    created: bool,
    state: FileState,
}

/// The empty object of a new file whose close did not wait for its PUT (see
/// `S3Fs::defer_empty`).
struct PendingCreate {
    /// The handle whose close started the PUT: its own later flushes need not wait.
    creator: u64,
    /// Held by the PUT task until the PUT is done, then holds its outcome.
    done: Arc<tokio::sync::Mutex<Option<Result<(), S3Error>>>>,
    /// `PUT_QUEUED` until the task sends the PUT (`PUT_SENT`), unless `unlink` got there
    /// first (`PUT_CANCELLED`).
    state: Arc<AtomicU8>,
}

const PUT_QUEUED: u8 = 0;
const PUT_SENT: u8 = 1;
const PUT_CANCELLED: u8 = 2;

struct DirStream {
    ino: u64,
    key: String,
    parent: u64,
    buffered: VecDeque<DirEntry>,
    next_offset: u64,
    token: Option<String>,
    started: bool,
    listed_all: bool,
    /// When this listing pass began, and the table's forgotten-name count then.
    pass_start: Option<(Instant, u64)>,
    local_names: HashSet<String>,
}

enum Handle {
    File(Arc<tokio::sync::Mutex<OpenFile>>),
    Dir(Arc<tokio::sync::Mutex<DirStream>>),
}

pub struct S3Fs {
    /// `deletes`, seen as the object client.
    client: Arc<dyn ObjectClient>,
    deletes: Arc<DeferredDeletes>,
    cfg: FsConfig,
    inodes: Arc<Mutex<InodeTable>>,
    handles: Mutex<HashMap<u64, Handle>>,
    next_fh: AtomicU64,
    prefetch_budget: Arc<Semaphore>,
    upload_budget: upload::UploadBudget,
    mount_time: SystemTime,
    /// Empty new files whose PUT is under way, by inode.
    pending: Arc<Mutex<HashMap<u64, PendingCreate>>>,
    create_slots: Arc<Semaphore>,
    /// Set by `flush_all`: from then on every close waits for its upload.
    stopping: AtomicBool,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    // A panic while holding the lock must not take the whole mount down with it.
    m.lock().unwrap_or_else(|p| p.into_inner())
}

fn check_name(name: &str) -> FsResult<()> {
    if name.is_empty() || name == "." || name == ".." || name.contains('/') || name.contains('\0') {
        return Err(FsError::InvalidName);
    }
    if name.len() > 255 {
        return Err(FsError::NameTooLong);
    }
    Ok(())
}

/// A listing name is shown only if it is a valid single path component.
fn visible_name(name: &str) -> bool {
    check_name(name).is_ok()
}

/// One child as a LIST page shows it.
struct ListedEntry {
    kind: Kind,
    name: String,
    size: u64,
    mtime: SystemTime,
    etag: Option<String>,
}

/// The children one LIST page of `dir_key` shows, sorted by name: common prefixes are
/// directories, a file with the same name as a directory is hidden by it, the directory's
/// own marker and names that are not a single valid path component are skipped.
fn page_entries(dir_key: &str, page: &ListPage, dir_mtime: SystemTime) -> Vec<ListedEntry> {
    let dir_names: HashSet<&str> = page
        .prefixes
        .iter()
        .filter_map(|p| p.strip_prefix(dir_key))
        .map(|p| p.trim_end_matches('/'))
        .collect();
    let dirs = dir_names.iter().map(|name| ListedEntry {
        kind: Kind::Dir,
        name: name.to_string(),
        size: 0,
        mtime: dir_mtime,
        etag: None,
    });
    let files = page.objects.iter().filter_map(|o| {
        let name = o.key.strip_prefix(dir_key)?;
        (!dir_names.contains(name)).then(|| ListedEntry {
            kind: Kind::File,
            name: name.to_string(),
            size: o.meta.size,
            mtime: o.meta.mtime,
            etag: o.meta.etag.clone(),
        })
    });
    let mut entries: Vec<ListedEntry> = dirs
        .chain(files)
        .filter(|e| visible_name(&e.name))
        .collect();
    entries.sort_by(|a, b| a.name.cmp(&b.name));
    entries
}

impl S3Fs {
    pub fn new(client: Arc<dyn ObjectClient>, cfg: FsConfig) -> Self {
        let mount_time = SystemTime::now();
        let units = (cfg.max_prefetch_memory / BUDGET_UNIT).min(u32::MAX as u64 / 2) as usize;
        let deletes = Arc::new(DeferredDeletes::new(client, !cfg.sync_delete));
        let upload_budget = upload::UploadBudget::new(cfg.max_upload_memory);
        Self {
            inodes: Arc::new(Mutex::new(InodeTable::new(
                cfg.prefix.clone(),
                mount_time,
                INODE_CAP,
            ))),
            client: deletes.clone(),
            deletes,
            cfg,
            handles: Mutex::new(HashMap::new()),
            next_fh: AtomicU64::new(1),
            prefetch_budget: Arc::new(Semaphore::new(units)),
            upload_budget,
            mount_time,
            pending: Arc::new(Mutex::new(HashMap::new())),
            create_slots: Arc::new(Semaphore::new(CREATE_PUTS_IN_FLIGHT)),
            stopping: AtomicBool::new(false),
        }
    }

    pub fn config(&self) -> &FsConfig {
        &self.cfg
    }

    /// Crash recovery, for a mounter that may be replaced (see `inode_log`): restores the
    /// inode bindings a dead predecessor persisted, persists new ones to `log`, and starts
    /// file handles at `first_fh` so that none equals a handle the dead one gave out.
    pub fn enable_recovery(
        &self,
        restored: inode_log::Loaded,
        log: inode_log::InodeLog,
        first_fh: u64,
    ) {
        lock(&self.inodes).restore_and_log(&restored.bindings, restored.max_ino, log);
        self.next_fh.fetch_max(first_fh, Ordering::Relaxed);
    }

    fn attr_of(&self, i: &Inode) -> Attr {
        Attr {
            ino: i.ino,
            kind: i.kind,
            size: i.size,
            mtime: if i.kind == Kind::Dir {
                self.mount_time
            } else {
                i.mtime
            },
            perm: match i.kind {
                Kind::File => self.cfg.file_mode,
                Kind::Dir => self.cfg.dir_mode,
            },
            uid: self.cfg.uid,
            gid: self.cfg.gid,
            // Also while a file is being written: every write goes through the kernel, which
            // updates the size itself and drops its cached times, so a cached answer cannot go
            // stale; and `stat` right after creating a file costs no round trip to us.
            ttl: self.cfg.metadata_ttl,
        }
    }

    fn fresh(&self, i: &Inode) -> bool {
        i.writer.is_some()
            || i.local_only
            || i.validated
                .is_some_and(|t| t.elapsed() < self.cfg.metadata_ttl)
    }

    /// True when the parent's children are all known (see `Inode::complete_as_of`).
    fn listing_fresh(&self, dir: &Inode) -> bool {
        dir.complete_as_of
            .is_some_and(|t| t.elapsed() < self.cfg.metadata_ttl)
    }

    fn inode(&self, ino: u64) -> FsResult<Inode> {
        lock(&self.inodes)
            .get(ino)
            .cloned()
            .ok_or(FsError::NotFound)
    }

    fn dir_inode(&self, ino: u64) -> FsResult<Inode> {
        let i = self.inode(ino)?;
        if i.kind != Kind::Dir {
            return Err(FsError::NotDir);
        }
        Ok(i)
    }

    fn writable(&self) -> FsResult<()> {
        if self.cfg.read_only {
            Err(FsError::ReadOnly)
        } else {
            Ok(())
        }
    }

    /// Asks S3 what `name` under `parent_key` is: HEAD of the file key and a one-key LIST
    /// of the directory prefix, concurrently, so a lookup costs one round trip.
    async fn probe(
        &self,
        parent_key: &str,
        name: &str,
    ) -> FsResult<Option<(Kind, crate::s3::ObjectMeta)>> {
        let file_key = format!("{parent_key}{name}");
        if file_key.len() + 1 > MAX_KEY_LEN {
            return Err(FsError::NameTooLong);
        }
        let dir_prefix = format!("{file_key}/");
        let (head, list) = tokio::join!(
            self.client.head_object(&file_key),
            self.client.list(ListRequest {
                prefix: &dir_prefix,
                delimiter: Some("/"),
                continuation: None,
                max_keys: 1,
            })
        );
        let list = list?;
        if !list.objects.is_empty() || !list.prefixes.is_empty() {
            let meta = crate::s3::ObjectMeta {
                size: 0,
                mtime: self.mount_time,
                etag: None,
            };
            return Ok(Some((Kind::Dir, meta)));
        }
        match head {
            Ok(meta) => Ok(Some((Kind::File, meta))),
            Err(S3Error::NotFound) => Ok(None),
            Err(e) => Err(e.into()),
        }
    }

    pub async fn lookup(&self, parent: u64, name: &str) -> FsResult<Attr> {
        check_name(name)?;
        let parent_inode = self.dir_inode(parent)?;
        {
            let mut t = lock(&self.inodes);
            if let Some(child) = t.child(parent, name) {
                if self.fresh(child) {
                    let attr = self.attr_of(child);
                    t.add_lookup(attr.ino);
                    return Ok(attr);
                }
            } else if self.listing_fresh(&parent_inode) {
                return Err(FsError::NotFound);
            }
        }
        self.list_ahead(&parent_inode);
        match self.probe(&parent_inode.key, name).await? {
            Some((kind, meta)) => {
                let mut t = lock(&self.inodes);
                // A writer that appeared meanwhile wins over what S3 said.
                if let Some(child) = t.child(parent, name) {
                    if child.writer.is_some() || child.local_only {
                        let attr = self.attr_of(child);
                        t.add_lookup(attr.ino);
                        return Ok(attr);
                    }
                }
                let ino = t.upsert(parent, name, kind, meta.size, meta.mtime, meta.etag);
                t.add_lookup(ino);
                let i = t.get(ino).ok_or(FsError::NotFound)?;
                Ok(self.attr_of(i))
            }
            None => {
                let mut t = lock(&self.inodes);
                if let Some(child) = t.child(parent, name) {
                    if child.writer.is_some() || child.local_only {
                        let attr = self.attr_of(child);
                        t.add_lookup(attr.ino);
                        return Ok(attr);
                    }
                }
                t.unbind(parent, name);
                Err(FsError::NotFound)
            }
        }
    }

    /// After a lookup miss, lists the whole directory in the background (once per TTL, at
    /// most `LIST_AHEAD_PAGES` pages): tools that stat or open one entry usually go on
    /// with its siblings (`ls -l`, `find`, `rm -r`), which then cost no request at all,
    /// and a complete listing answers for names that do not exist too.
    fn list_ahead(&self, dir: &Inode) {
        {
            let mut t = lock(&self.inodes);
            let Some(d) = t.get_mut(dir.ino) else {
                return;
            };
            if d.list_ahead_at
                .is_some_and(|at| at.elapsed() < self.cfg.metadata_ttl)
            {
                return;
            }
            d.list_ahead_at = Some(Instant::now());
        }
        let client = self.client.clone();
        let inodes = self.inodes.clone();
        let (ino, key, dir_mtime) = (dir.ino, dir.key.clone(), self.mount_time);
        tokio::spawn(async move {
            let (started, forgotten) = (Instant::now(), lock(&inodes).forgotten_names);
            let mut token: Option<String> = None;
            for _ in 0..LIST_AHEAD_PAGES {
                let request = ListRequest {
                    prefix: &key,
                    delimiter: Some("/"),
                    continuation: token.as_deref(),
                    max_keys: LIST_PAGE,
                };
                let page = match client.list(request).await {
                    Ok(p) => p,
                    Err(e) => {
                        tracing::debug!(key = %key, error = %e, "background listing failed");
                        return;
                    }
                };
                let mut t = lock(&inodes);
                for e in page_entries(&key, &page, dir_mtime) {
                    t.upsert(ino, &e.name, e.kind, e.size, e.mtime, e.etag);
                }
                token = page.next_token;
                if token.is_none() {
                    if forgotten == t.forgotten_names {
                        if let Some(d) = t.get_mut(ino) {
                            d.complete_as_of = Some(started);
                        }
                    }
                    return;
                }
            }
        });
    }

    pub fn forget(&self, ino: u64, n: u64) {
        lock(&self.inodes).forget(ino, n);
    }

    pub async fn getattr(&self, ino: u64) -> FsResult<Attr> {
        let i = self.inode(ino)?;
        if i.kind == Kind::Dir || self.fresh(&i) {
            return Ok(self.attr_of(&i));
        }
        match self.client.head_object(&i.key).await {
            Ok(meta) => {
                let mut t = lock(&self.inodes);
                let i = t.get_mut(ino).ok_or(FsError::NotFound)?;
                if i.writer.is_none() {
                    i.size = meta.size;
                    i.mtime = meta.mtime;
                    i.etag = meta.etag;
                }
                i.validated = Some(Instant::now());
                Ok(self.attr_of(i))
            }
            Err(S3Error::NotFound) => Err(FsError::NotFound),
            Err(e) => Err(e.into()),
        }
    }

    /// chmod/chown/utimes are accepted and ignored (S3 keeps no such metadata here);
    /// truncation to 0 or to the current size works, other sizes are refused.
    pub async fn setattr(&self, ino: u64, size: Option<u64>, fh: Option<u64>) -> FsResult<Attr> {
        let Some(size) = size else {
            return self.getattr(ino).await;
        };
        self.writable()?;
        self.await_pending(ino).await?;
        let i = self.inode(ino)?;
        if i.kind == Kind::Dir {
            return Err(FsError::IsDir);
        }
        if let Some(writer_fh) = i.writer {
            let file = self.file_handle(fh.unwrap_or(writer_fh))?;
            let mut f = file.lock().await;
            if let FileState::Write(up) = &mut f.state {
                if size == up.written() {
                    return Ok(self.attr_of(&self.inode(ino)?));
                }
                if size == 0 {
                    up.truncate()?;
                    let mut t = lock(&self.inodes);
                    let i = t.get_mut(ino).ok_or(FsError::NotFound)?;
                    i.size = 0;
                    return Ok(self.attr_of(i));
                }
            }
            tracing::warn!(key = %i.key, size, "refusing truncate of a file being written to a non-zero size");
            return Err(FsError::Unsupported("truncate to a size other than 0"));
        }
        let current = self.getattr(ino).await?;
        if current.size == size {
            return Ok(current);
        }
        if size != 0 {
            tracing::warn!(key = %i.key, size, "refusing truncate to a non-zero size");
            return Err(FsError::Unsupported("truncate to a size other than 0"));
        }
        let meta = self.client.put_object(&i.key, Bytes::new()).await?;
        let mut t = lock(&self.inodes);
        let i = t.get_mut(ino).ok_or(FsError::NotFound)?;
        i.size = 0;
        i.mtime = SystemTime::now();
        i.etag = meta.etag;
        i.validated = Some(Instant::now());
        Ok(self.attr_of(i))
    }

    fn new_fh(&self, handle: Handle) -> u64 {
        let fh = self.next_fh.fetch_add(1, Ordering::Relaxed);
        lock(&self.handles).insert(fh, handle);
        fh
    }

    fn file_handle(&self, fh: u64) -> FsResult<Arc<tokio::sync::Mutex<OpenFile>>> {
        match lock(&self.handles).get(&fh) {
            Some(Handle::File(f)) => Ok(f.clone()),
            _ => Err(FsError::BadHandle),
        }
    }

    fn new_upload(&self, key: String) -> Upload {
        Upload::new(
            self.client.clone(),
            key,
            self.cfg.part_size,
            self.cfg.max_concurrency,
            self.upload_budget.clone(),
        )
    }

    /// Registers a writer on `ino`, failing if another handle already writes it.
    fn start_writing(&self, ino: u64, fh: u64) -> FsResult<()> {
        let mut t = lock(&self.inodes);
        let i = t.get_mut(ino).ok_or(FsError::NotFound)?;
        if i.writer.is_some_and(|w| w != fh) {
            return Err(FsError::Busy("the file is already open for writing"));
        }
        i.writer = Some(fh);
        i.size = 0;
        Ok(())
    }

    pub async fn create(
        &self,
        parent: u64,
        name: &str,
        mode: OpenMode,
        opener: Option<u32>,
    ) -> FsResult<(Attr, u64)> {
        self.writable()?;
        check_name(name)?;
        let p = self.dir_inode(parent)?;
        let key = format!("{}{}", p.key, name);
        if key.len() > MAX_KEY_LEN {
            return Err(FsError::NameTooLong);
        }
        let known = lock(&self.inodes).child(parent, name).map(|c| c.ino);
        if let Some(ino) = known {
            // A new version must not be overtaken by the empty PUT of the previous one; if
            // that PUT failed, the name is gone and this creates it afresh.
            let _ = self.await_pending(ino).await;
        }
        let ino = {
            let mut t = lock(&self.inodes);
            if let Some(existing) = t.child(parent, name) {
                if existing.kind == Kind::Dir {
                    return Err(FsError::IsDir);
                }
                if existing.writer.is_some() {
                    return Err(FsError::Busy("the file is already open for writing"));
                }
            }
            t.create_local(parent, name, Kind::File)
                .ok_or(FsError::NotFound)?
        };
        let fh = self.new_fh(Handle::File(Arc::new(tokio::sync::Mutex::new(OpenFile {
            opener,
            ino,
            key: key.clone(),
            writable: true,
            append: mode.append,
            created: true,
            state: FileState::Write(self.new_upload(key)),
        }))));
        let mut t = lock(&self.inodes);
        let i = t.get_mut(ino).ok_or(FsError::NotFound)?;
        i.writer = Some(fh);
        i.open_handles += 1;
        i.lookups += 1;
        Ok((self.attr_of(i), fh))
    }

    pub async fn open(&self, ino: u64, mode: OpenMode, opener: Option<u32>) -> FsResult<u64> {
        let mut i = self.inode(ino)?;
        if i.kind == Kind::Dir {
            return Err(FsError::IsDir);
        }
        if mode.write {
            self.writable()?;
            // Whatever this handle writes must land after the empty object, not before.
            self.await_pending(ino).await?;
            i = self.inode(ino)?;
        }
        if i.writer.is_some() {
            return Err(FsError::Busy(
                "the file is being written; open it after close",
            ));
        }
        let state = if mode.write && mode.truncate {
            FileState::Write(self.new_upload(i.key.clone()))
        } else {
            let size = if self.fresh(&i) {
                i.size
            } else {
                self.getattr(ino).await?.size
            };
            FileState::Read(Prefetcher::new(
                self.client.clone(),
                i.key.clone(),
                size,
                self.cfg.prefetch,
                self.prefetch_budget.clone(),
            ))
        };
        let writing = matches!(state, FileState::Write(_));
        let fh = self.new_fh(Handle::File(Arc::new(tokio::sync::Mutex::new(OpenFile {
            opener,
            ino,
            key: i.key.clone(),
            writable: mode.write,
            append: mode.append,
            created: false,
            state,
        }))));
        if writing {
            if let Err(e) = self.start_writing(ino, fh) {
                lock(&self.handles).remove(&fh);
                return Err(e);
            }
        }
        if let Some(i) = lock(&self.inodes).get_mut(ino) {
            i.open_handles += 1;
        }
        Ok(fh)
    }

    pub async fn read(&self, fh: u64, offset: u64, size: u32) -> FsResult<Bytes> {
        let file = self.file_handle(fh)?;
        let mut f = file.lock().await;
        match &mut f.state {
            FileState::Read(p) => p.read(offset, size).await,
            _ => {
                tracing::warn!(key = %f.key, "read from a handle that is writing a new object");
                Err(FsError::Unsupported("reading a file while writing it"))
            }
        }
    }

    pub async fn write(&self, fh: u64, offset: u64, data: &[u8]) -> FsResult<usize> {
        self.writable()?;
        let file = self.file_handle(fh)?;
        let mut f = file.lock().await;
        if !f.writable {
            return Err(FsError::BadHandle);
        }
        if matches!(f.state, FileState::Committed) && offset == 0 && self.inode(f.ino)?.size == 0 {
            // Committed empty (a shell's dup2 + close before writing): start the object over,
            // once the empty object is in S3, so that it cannot land after the content.
            let ino = f.ino;
            self.await_pending(ino).await?;
            self.start_writing(ino, fh)?;
            f.state = FileState::Write(self.new_upload(f.key.clone()));
        }
        if let FileState::Read(_) = &f.state {
            // Opened for writing without O_TRUNC: only an empty object may be (re)written,
            // from its start. Anything else would need a read-modify-write of the object.
            let ino = f.ino;
            let size = self.inode(ino)?.size;
            if size != 0 || offset != 0 {
                tracing::warn!(key = %f.key, offset, size, append = f.append,
                    "refusing write into an existing object (modify/append not supported)");
                return Err(FsError::Unsupported("writing into an existing object"));
            }
            self.await_pending(ino).await?;
            self.start_writing(ino, fh)?;
            f.state = FileState::Write(self.new_upload(f.key.clone()));
        }
        let ino = f.ino;
        match &mut f.state {
            FileState::Write(up) => {
                let n = up.write(offset, data).await.inspect_err(|e| {
                    tracing::warn!(key = %up.key(), offset, error = %e, "write refused");
                })?;
                let written = up.written();
                if let Some(i) = lock(&self.inodes).get_mut(ino) {
                    i.size = written;
                    i.mtime = SystemTime::now();
                }
                Ok(n)
            }
            FileState::Discarded => Ok(data.len()),
            FileState::Committed => {
                tracing::warn!(key = %f.key, "write after the upload was completed by close/fsync");
                Err(FsError::Unsupported(
                    "writing after fsync/close completed the upload",
                ))
            }
            FileState::Read(_) => unreachable!("replaced by a writer above"),
        }
    }

    /// close(): completes the upload of a handle that is writing. Errors mean the data is
    /// NOT in S3 and must reach the application.
    ///
    /// A flush from another process than the opener is not a commit: a child that
    /// inherited the descriptor (fork + exec closes it) must not end the parent's upload;
    /// release commits then. A flush before anything was written does commit (an empty
    /// object: durable at close for an existing file; a new file does not wait for its
    /// PUT, see `defer_empty`, but closing any other descriptor of it does); shells that
    /// open, `dup2` and close the original descriptor before writing then restart the
    /// upload from offset 0 once that PUT is done, see `write`.
    pub async fn flush(&self, fh: u64, caller: Option<u32>) -> FsResult<()> {
        let file = self.file_handle(fh)?;
        let mut f = file.lock().await;
        if let FileState::Write(_) = &f.state {
            if f.opener.is_some() && caller.is_some() && f.opener != caller {
                tracing::debug!(key = %f.key, ?caller, opener = ?f.opener, "flush from another process; not committing");
                return Ok(());
            }
        }
        self.commit(&mut f, fh, true).await?;
        let created_by_this_handle = lock(&self.pending)
            .get(&f.ino)
            .is_some_and(|p| p.creator == fh);
        if created_by_this_handle {
            return Ok(());
        }
        self.await_pending(f.ino).await
    }

    /// Completes the upload of a handle that is writing. With `may_defer`, a new file
    /// closed empty is only started (see `defer_empty`).
    async fn commit(&self, f: &mut OpenFile, fh: u64, may_defer: bool) -> FsResult<()> {
        let FileState::Write(up) = &mut f.state else {
            return Ok(());
        };
        if may_defer
            && f.created
            && up.written() == 0
            && up.can_truncate()
            && !self.cfg.sync_create
            && !self.stopping.load(Ordering::SeqCst)
            && self.defer_empty(f.ino, &f.key, fh)
        {
            f.state = FileState::Committed;
            return Ok(());
        }
        let FileState::Write(up) = &mut f.state else {
            return Ok(());
        };
        let result = up.finish().await;
        let ino = f.ino;
        f.state = FileState::Committed;
        let mut t = lock(&self.inodes);
        let unlinked = t.get(ino).is_none_or(|i| i.writer != Some(fh));
        if let Some(i) = t.get_mut(ino) {
            if i.writer == Some(fh) {
                i.writer = None;
            }
            match &result {
                Ok(meta) => {
                    i.size = meta.size;
                    i.mtime = SystemTime::now();
                    i.etag = meta.etag.clone();
                    i.validated = Some(Instant::now());
                    i.local_only = false;
                }
                Err(_) => {
                    // What S3 holds now is unknown to us: ask again next time.
                    i.validated = None;
                    if i.local_only {
                        i.local_only = false;
                        let (parent, name) = (i.parent, i.name.clone());
                        t.unbind(parent, &name);
                    }
                }
            }
        }
        drop(t);
        if let Err(e) = &result {
            tracing::error!(key = %f.key, error = %e, "upload failed; the application gets EIO");
        } else if unlinked {
            tracing::debug!(key = %f.key, "file was unlinked or replaced while being written");
        }
        result.map(|_| ())
    }

    /// A new file this mount created, closed with nothing written and never uploaded:
    /// the empty object is PUT in the background and close returns at once, since no data
    /// is at stake. Until the PUT is done the inode stays `local_only` (lookups, getattr,
    /// listings and reads answer from this table) and `pending` holds it: everything that
    /// must be ordered after the PUT waits for it (`await_pending`): opening for write,
    /// writing, truncate, unlink, rename, create of the same name, fsync and the close of
    /// another descriptor, and `flush_all` on unmount/SIGTERM. A PUT that fails even after
    /// the SDK's retries is logged, and the name disappears (the next lookup asks S3).
    /// Returns false, changing nothing, when the file does not qualify.
    fn defer_empty(&self, ino: u64, key: &str, fh: u64) -> bool {
        let done = Arc::new(tokio::sync::Mutex::new(None));
        let mine = done.clone();
        let state = Arc::new(AtomicU8::new(PUT_QUEUED));
        let Ok(mut guard) = done.clone().try_lock_owned() else {
            return false;
        };
        {
            let mut t = lock(&self.inodes);
            let Some(i) = t.get_mut(ino) else {
                return false;
            };
            if i.writer != Some(fh) || !i.local_only {
                return false;
            }
            i.writer = None;
            i.size = 0;
            i.mtime = SystemTime::now();
            lock(&self.pending).insert(
                ino,
                PendingCreate {
                    creator: fh,
                    done,
                    state: state.clone(),
                },
            );
        }
        let (deletes, inodes, pending, slots) = (
            self.deletes.clone(),
            self.inodes.clone(),
            self.pending.clone(),
            self.create_slots.clone(),
        );
        let key = key.to_string();
        tokio::spawn(async move {
            let slot = slots.acquire_owned().await;
            // After an earlier DELETE of this name; waited for here, before the PUT counts
            // as sent, because an `unlink` of this file from then on makes its own DELETE
            // wait for this PUT (`delete_after`), and the two must not wait for each other.
            deletes.settle(&key).await;
            let sending =
                state.compare_exchange(PUT_QUEUED, PUT_SENT, Ordering::SeqCst, Ordering::SeqCst);
            if sending.is_err() {
                // Unlinked before its turn came: the file never reaches S3 (see `cancel_put`).
                lock(&inodes).forget(ino, 0);
                *guard = Some(Ok(()));
                let mut p = lock(&pending);
                if p.get(&ino).is_some_and(|p| Arc::ptr_eq(&p.done, &mine)) {
                    p.remove(&ino);
                }
                return;
            }
            let result = deletes.unordered().put_object(&key, Bytes::new()).await;
            drop(slot);
            let mut t = lock(&inodes);
            if let Some(i) = t
                .get_mut(ino)
                .filter(|i| i.local_only && i.writer.is_none())
            {
                i.local_only = false;
                match &result {
                    Ok(meta) => {
                        i.etag = meta.etag.clone();
                        i.validated = Some(Instant::now());
                    }
                    Err(_) => {
                        i.validated = None;
                        let (parent, name) = (i.parent, i.name.clone());
                        if t.child(parent, &name).is_some_and(|c| c.ino == ino) {
                            t.unbind(parent, &name);
                        }
                    }
                }
            }
            t.forget(ino, 0);
            drop(t);
            match &result {
                Ok(_) => tracing::debug!(key = %key, "empty file created in S3"),
                Err(e) => {
                    tracing::error!(key = %key, "could not create empty file {key} in S3: {e}")
                }
            }
            *guard = Some(result.map(|_| ()));
            let mut p = lock(&pending);
            if p.get(&ino).is_some_and(|p| Arc::ptr_eq(&p.done, &mine)) {
                p.remove(&ino);
            }
        });
        true
    }

    /// Drops the empty PUT of `ino` if it has not been sent yet, so that unlinking a file
    /// that never reached S3 costs no request at all; true then. The inode stays
    /// `local_only`, which tells `unlink` there is nothing to DELETE.
    fn cancel_put(&self, ino: u64) -> bool {
        lock(&self.pending).get(&ino).is_some_and(|p| {
            p.state
                .compare_exchange(
                    PUT_QUEUED,
                    PUT_CANCELLED,
                    Ordering::SeqCst,
                    Ordering::SeqCst,
                )
                .is_ok()
        })
    }

    /// Waits until the empty object of `ino` is in S3, if its PUT is under way; EIO if
    /// that PUT failed.
    async fn await_pending(&self, ino: u64) -> FsResult<()> {
        let done = lock(&self.pending).get(&ino).map(|p| p.done.clone());
        let Some(done) = done else {
            return Ok(());
        };
        let outcome = done.lock().await.clone();
        match outcome {
            Some(Err(e)) => Err(FsError::UploadFailed(e)),
            _ => Ok(()),
        }
    }

    pub async fn fsync(&self, fh: u64) -> FsResult<()> {
        match lock(&self.handles).get(&fh) {
            Some(Handle::Dir(_)) => return Ok(()),
            None => return Err(FsError::BadHandle),
            _ => {}
        }
        let file = self.file_handle(fh)?;
        let mut f = file.lock().await;
        self.commit(&mut f, fh, false).await?;
        self.await_pending(f.ino).await
    }

    pub async fn release(&self, fh: u64) -> FsResult<()> {
        let file = match lock(&self.handles).get(&fh) {
            Some(Handle::File(f)) => f.clone(),
            _ => {
                lock(&self.handles).remove(&fh);
                return Ok(());
            }
        };
        let mut f = file.lock().await;
        // Normally flush already committed; this covers handles closed without one (an
        // empty new file, or a descriptor last closed by another process). The handle stays
        // registered until the commit is done, so that `flush_all` on unmount waits for it.
        let result = self.commit(&mut f, fh, true).await;
        lock(&self.handles).remove(&fh);
        let mut t = lock(&self.inodes);
        if let Some(i) = t.get_mut(f.ino) {
            i.open_handles = i.open_handles.saturating_sub(1);
        }
        t.forget(f.ino, 0);
        result
    }

    /// Completes every open upload and every empty file's PUT (see `defer_empty`); used
    /// on unmount and on SIGTERM. Closes after this wait for their uploads.
    pub async fn flush_all(&self) -> usize {
        self.stopping.store(true, Ordering::SeqCst);
        let files: Vec<(u64, Arc<tokio::sync::Mutex<OpenFile>>)> = lock(&self.handles)
            .iter()
            .filter_map(|(fh, h)| match h {
                Handle::File(f) => Some((*fh, f.clone())),
                _ => None,
            })
            .collect();
        let mut failed = 0;
        for (fh, file) in files {
            let mut f = file.lock().await;
            if self.commit(&mut f, fh, false).await.is_err() {
                failed += 1;
            }
        }
        loop {
            let waiting: Vec<u64> = lock(&self.pending).keys().copied().collect();
            if waiting.is_empty() {
                break;
            }
            for ino in waiting {
                if self.await_pending(ino).await.is_err() {
                    failed += 1;
                }
            }
        }
        failed + self.deletes.drain().await
    }

    pub async fn mkdir(&self, parent: u64, name: &str) -> FsResult<Attr> {
        self.writable()?;
        check_name(name)?;
        let p = self.dir_inode(parent)?;
        if let Some(existing) = lock(&self.inodes).child(parent, name) {
            if self.fresh(existing) {
                return Err(FsError::Exists);
            }
        }
        if self.probe(&p.key, name).await?.is_some() {
            return Err(FsError::Exists);
        }
        let key = format!("{}{}/", p.key, name);
        if key.len() > MAX_KEY_LEN {
            return Err(FsError::NameTooLong);
        }
        let probed_at = Instant::now();
        self.client.put_object(&key, Bytes::new()).await?;
        let mut t = lock(&self.inodes);
        let ino = t.upsert(parent, name, Kind::Dir, 0, SystemTime::now(), None);
        t.add_lookup(ino);
        let i = t.get_mut(ino).ok_or(FsError::NotFound)?;
        // Nothing existed under it a moment ago: the new directory is known to be empty.
        i.complete_as_of = Some(probed_at);
        Ok(self.attr_of(i))
    }

    pub async fn rmdir(&self, parent: u64, name: &str) -> FsResult<()> {
        self.writable()?;
        check_name(name)?;
        let p = self.dir_inode(parent)?;
        let key = format!("{}{}/", p.key, name);
        if let Some(child) = lock(&self.inodes).child(parent, name) {
            if child.kind != Kind::Dir {
                return Err(FsError::NotDir);
            }
        }
        let page = self
            .client
            .list(ListRequest {
                prefix: &key,
                delimiter: None,
                continuation: None,
                max_keys: 2,
            })
            .await?;
        if page.objects.is_empty() && page.prefixes.is_empty() {
            if self.probe(&p.key, name).await?.is_some() {
                return Err(FsError::NotDir);
            }
            return Err(FsError::NotFound);
        }
        if page.objects.iter().any(|o| o.key != key) {
            return Err(FsError::NotEmpty);
        }
        {
            let t = lock(&self.inodes);
            if let Some(dir) = t.child(parent, name) {
                let dino = dir.ino;
                if t.children_of(dino)
                    .any(|c| c.local_only || c.writer.is_some())
                {
                    return Err(FsError::NotEmpty);
                }
            }
        }
        self.client.delete_object(&key).await?;
        lock(&self.inodes).unbind(parent, name);
        Ok(())
    }

    pub async fn unlink(&self, parent: u64, name: &str) -> FsResult<()> {
        self.writable()?;
        check_name(name)?;
        let p = self.dir_inode(parent)?;
        let known = lock(&self.inodes).child(parent, name).cloned();
        let child = match known {
            Some(c) => c,
            None => {
                self.lookup(parent, name).await?;
                let c = lock(&self.inodes).child(parent, name).cloned();
                self.forget(c.as_ref().map(|c| c.ino).unwrap_or(0), 1);
                c.ok_or(FsError::NotFound)?
            }
        };
        if child.kind == Kind::Dir {
            return Err(FsError::IsDir);
        }
        // An empty file's PUT that has not been sent is dropped: nothing reaches S3. One
        // that is under way is followed by the DELETE (even if it fails: it may have landed
        // all the same), without waiting for it here.
        if !self.cancel_put(child.ino) {
            let put = lock(&self.pending).get(&child.ino).map(|p| p.done.clone());
            if let Some(put) = put {
                let key = format!("{}{}", p.key, name);
                let put_done = async move { drop(put.lock().await) };
                self.deletes.delete_after(&key, put_done).await?;
                lock(&self.inodes).unbind(parent, name);
                return Ok(());
            }
        }
        let child = lock(&self.inodes)
            .child(parent, name)
            .cloned()
            .ok_or(FsError::NotFound)?;
        if let Some(writer) = child.writer {
            // Abandon the upload so closing the file does not bring it back.
            if let Ok(file) = self.file_handle(writer) {
                let mut f = file.lock().await;
                if let FileState::Write(up) = &mut f.state {
                    up.abort().await;
                }
                f.state = FileState::Discarded;
            }
            if let Some(i) = lock(&self.inodes).get_mut(child.ino) {
                i.writer = None;
                i.local_only = false;
            }
        }
        if !child.local_only {
            self.client
                .delete_object(&format!("{}{}", p.key, name))
                .await?;
        }
        lock(&self.inodes).unbind(parent, name);
        Ok(())
    }

    pub async fn rename(
        &self,
        parent: u64,
        name: &str,
        new_parent: u64,
        new_name: &str,
        no_replace: bool,
    ) -> FsResult<()> {
        self.writable()?;
        check_name(name)?;
        check_name(new_name)?;
        let src_dir = self.dir_inode(parent)?;
        let dst_dir = self.dir_inode(new_parent)?;
        self.lookup(parent, name).await?;
        let src = lock(&self.inodes).child(parent, name).cloned();
        let Some(src) = src else {
            return Err(FsError::NotFound);
        };
        self.forget(src.ino, 1);
        if src.kind == Kind::File {
            // An empty file's PUT must be done before it can be copied, or deleted.
            self.await_pending(src.ino).await?;
        }
        if src.kind == Kind::Dir {
            tracing::info!(key = %src.key, "directory rename refused with EXDEV; mv copies instead");
            return Err(FsError::CrossDevice);
        }
        if src.writer.is_some() {
            return Err(FsError::Busy(
                "rename of a file that is still being written",
            ));
        }
        let dst_key = format!("{}{}", dst_dir.key, new_name);
        if dst_key.len() > MAX_KEY_LEN {
            return Err(FsError::NameTooLong);
        }
        match self.lookup(new_parent, new_name).await {
            Ok(a) => {
                self.forget(a.ino, 1);
                // The copy must land after the target's own empty PUT, if one is under way.
                let _ = self.await_pending(a.ino).await;
                if no_replace {
                    return Err(FsError::Exists);
                }
                if a.kind == Kind::Dir {
                    return Err(FsError::IsDir);
                }
                let busy = lock(&self.inodes)
                    .get(a.ino)
                    .is_some_and(|i| i.writer.is_some());
                if busy {
                    return Err(FsError::Busy("rename onto a file that is being written"));
                }
            }
            Err(FsError::NotFound) => {}
            Err(e) => return Err(e),
        }
        let src_key = format!("{}{}", src_dir.key, name);
        if src_key != dst_key {
            self.client
                .copy_object(&src_key, &dst_key, src.size)
                .await?;
            self.client.delete_object(&src_key).await?;
        }
        let mut t = lock(&self.inodes);
        t.rebind(src.ino, new_parent, new_name);
        if let Some(i) = t.get_mut(src.ino) {
            i.validated = Some(Instant::now());
        }
        Ok(())
    }

    pub async fn opendir(&self, ino: u64) -> FsResult<u64> {
        let d = self.dir_inode(ino)?;
        Ok(
            self.new_fh(Handle::Dir(Arc::new(tokio::sync::Mutex::new(DirStream {
                ino,
                key: d.key,
                parent: d.parent,
                buffered: VecDeque::new(),
                next_offset: 1,
                token: None,
                started: false,
                listed_all: false,
                pass_start: None,
                local_names: HashSet::new(),
            })))),
        )
    }

    pub fn releasedir(&self, fh: u64) {
        lock(&self.handles).remove(&fh);
    }

    /// Entries after `offset`. Entries stay buffered until the kernel asks for an offset
    /// past them, so a reply buffer that fills up loses nothing. Memory is bounded by one
    /// LIST page per open directory.
    pub async fn readdir(&self, fh: u64, offset: u64) -> FsResult<Vec<DirEntry>> {
        let stream = match lock(&self.handles).get(&fh) {
            Some(Handle::Dir(d)) => d.clone(),
            _ => return Err(FsError::BadHandle),
        };
        let mut d = stream.lock().await;
        let behind = d.buffered.front().is_some_and(|e| offset + 1 < e.offset)
            || (d.buffered.is_empty() && offset + 1 < d.next_offset);
        if (offset == 0 && d.started) || behind {
            // rewinddir or a seek backwards: start the listing over.
            d.buffered.clear();
            d.next_offset = 1;
            d.token = None;
            d.started = false;
            d.listed_all = false;
            d.pass_start = None;
            d.local_names.clear();
        }
        loop {
            while d.buffered.front().is_some_and(|e| e.offset <= offset) {
                d.buffered.pop_front();
            }
            if !d.buffered.is_empty() || d.listed_all {
                break;
            }
            self.fill(&mut d).await?;
        }
        Ok(d.buffered.iter().cloned().collect())
    }

    async fn fill(&self, d: &mut DirStream) -> FsResult<()> {
        let push = |d: &mut DirStream, ino: u64, kind: Kind, name: String| {
            let offset = d.next_offset;
            d.next_offset += 1;
            d.buffered.push_back(DirEntry {
                ino,
                offset,
                kind,
                name,
            });
        };
        if !d.started {
            d.started = true;
            d.pass_start = Some((Instant::now(), lock(&self.inodes).forgotten_names));
            let (ino, parent) = (d.ino, d.parent);
            push(d, ino, Kind::Dir, ".".into());
            push(d, parent, Kind::Dir, "..".into());
            // Files created here and not uploaded yet: S3 cannot list them.
            let locals: Vec<(u64, Kind, String)> = lock(&self.inodes)
                .children_of(ino)
                .filter(|c| c.local_only)
                .map(|c| (c.ino, c.kind, c.name.clone()))
                .collect();
            for (ino, kind, name) in locals {
                d.local_names.insert(name.clone());
                push(d, ino, kind, name);
            }
            return Ok(());
        }
        let page = self
            .client
            .list(ListRequest {
                prefix: &d.key,
                delimiter: Some("/"),
                continuation: d.token.as_deref(),
                max_keys: LIST_PAGE,
            })
            .await?;
        let mut entries = page_entries(&d.key, &page, self.mount_time);
        entries.retain(|e| !d.local_names.contains(&e.name));
        let mut t = lock(&self.inodes);
        for e in entries {
            let ino = t.upsert(d.ino, &e.name, e.kind, e.size, e.mtime, e.etag);
            if ino != 0 {
                push(d, ino, e.kind, e.name);
            }
        }
        d.token = page.next_token;
        d.listed_all = d.token.is_none();
        if let (true, Some((started, forgotten))) = (d.listed_all, d.pass_start) {
            // Every child is in the table now, unless some were dropped meanwhile.
            if forgotten == t.forgotten_names {
                if let Some(dir) = t.get_mut(d.ino) {
                    dir.complete_as_of = Some(started);
                }
            }
        }
        Ok(())
    }

    pub fn inode_count(&self) -> usize {
        lock(&self.inodes).len()
    }
}

#[cfg(test)]
mod tests;
