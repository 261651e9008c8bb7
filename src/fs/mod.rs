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
//! - Files are written as whole objects, durable at close/fsync: create or O_TRUNC and
//!   sequential writes stream (see `upload.rs`); a write at the end of an existing object
//!   continues it (server-side copy of what is there); any other write, truncate or second
//!   writer stages the file on local disk and commits it with server-side copies of what
//!   nobody touched (`edit.rs`, `staging.rs`).
//!
//! Layout: the metadata layer is `inode.rs` (the inode table, persisted for a replacement
//! mounter by `inode_log.rs`), `lookup.rs`, `namespace.rs` and `meta.rs` + `meta_update.rs`
//! (s3fs-compatible POSIX metadata); the data layer is `handles.rs`, `writer.rs` (+
//! `upload.rs`), `edit.rs` (+ `staging.rs`, `ranges.rs`), `pending_create.rs`, `readdir.rs`
//! and `prefetch.rs`; `deletes.rs` orders DELETEs at the client seam. This file holds the
//! shared state ([`S3Fs`]) and the small helpers every part uses.

mod acl;
pub mod cache;
pub mod deletes;
mod edit;
pub mod error;
pub mod fuse;
mod handles;
pub mod inode;
pub mod inode_log;
mod known_versions;
mod lookup;
pub mod memcache;
pub mod meta;
mod meta_update;
mod namespace;
mod passthrough;
mod pending_create;
pub mod prefetch;
pub mod ranges;
mod read_ahead;
mod readdir;
pub mod session;
pub mod staging;
mod stat_ahead;
pub mod upload;
mod walk_ahead;
mod writer;

use crate::config::{BucketSource, MountConfig};
use crate::s3::{ListPage, ListRequest, ObjectClient, S3Error};
use bytes::Bytes;
use deletes::DeferredDeletes;
pub use error::{FsError, FsResult};
use inode::{Inode, InodeTable, Kind};
use prefetch::{PrefetchConfig, Prefetcher, BUDGET_UNIT};
use std::collections::{HashMap, HashSet, VecDeque};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicU8, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};
use tokio::sync::Semaphore;
use upload::Upload;

use handles::*;
use pending_create::*;
use readdir::*;

/// S3 refuses keys longer than this.
const MAX_KEY_LEN: usize = 1024;
const LIST_PAGE: i32 = 1000;
/// Pages a background listing after a lookup miss reads at most (see `list_ahead`).
const LIST_AHEAD_PAGES: usize = 5;
/// In the cache directory: the metadata of the versions read (see `known_versions.rs`).
const KNOWN_VERSIONS_FILE: &str = "known-versions";
/// How long the mount waits for its conditional-write check (`start_background`).
const CONDITION_PROBE_TIMEOUT: Duration = Duration::from_secs(30);

/// A random number, for names nobody else uses.
fn rand_u64() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u128(
        SystemTime::now()
            .duration_since(SystemTime::UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or(0),
    );
    h.finish()
}

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
    /// Inode table size above which entries nobody holds are dropped (`--max-entries`).
    pub max_entries: usize,
    /// Versions whose metadata stays known apart from the inodes (`--max-known-versions`).
    pub max_known_versions: usize,
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
    /// Where staged files (edits in place) live; `None`: a private temporary directory.
    pub cache_dir: Option<std::path::PathBuf>,
    /// Space staged files and the data cache may take together.
    pub cache_size: u64,
    /// Object data read is kept in `cache_dir/data` for later reads (see `cache.rs`).
    pub data_cache: bool,
    /// A read-only open of a version wholly in the data cache lets the kernel read the
    /// cache file itself (FUSE passthrough; see `fuse.rs`).
    pub passthrough: bool,
    /// The data cache keeps this share (percent) of its disk free.
    pub cache_free_percent: u8,
    /// Bytes of randomly read data kept in memory for every handle (see `memcache.rs`).
    pub cache_memory: u64,
    /// Edits in place are uploaded this long after their last close/fsync, which return
    /// once the edit is on local disk (see `edit.rs`); `None`: close and fsync upload.
    pub write_back: Option<Duration>,
    /// Stored POSIX metadata (`meta.rs`) is read and written; off: every file shows the
    /// defaults above and chmod/chown/utimes are accepted and forgotten, as before.
    pub posix_metadata: bool,
    /// POSIX ACLs are enforced by the kernel and stored with the xattrs (see `acl.rs`).
    pub posix_acl: bool,
    /// The Content-Type new objects get (`--content-type`; see `S3Fs::typed`).
    pub content_type: crate::config::content_type::ContentTypes,
    /// How long a metadata change waits for others to share its CopyObject (see
    /// `meta_update.rs`).
    pub meta_save_delay: Duration,
}

impl From<&MountConfig> for FsConfig {
    fn from(cfg: &MountConfig) -> Self {
        FsConfig {
            prefix: cfg.source.prefix.clone(),
            uid: cfg.uid,
            gid: cfg.gid,
            file_mode: cfg.file_mode,
            dir_mode: cfg.dir_mode,
            metadata_ttl: cfg.metadata_ttl,
            max_entries: cfg.max_entries,
            max_known_versions: cfg.max_known_versions,
            read_only: cfg.read_only,
            part_size: cfg.part_size,
            max_concurrency: cfg.max_concurrency,
            max_prefetch_memory: cfg.max_prefetch_memory,
            max_upload_memory: cfg.max_upload_memory,
            prefetch: PrefetchConfig::default(),
            sync_create: cfg.sync_create,
            sync_delete: cfg.sync_delete,
            page_cache: cfg.page_cache,
            cache_dir: None,
            cache_size: cfg.cache_size,
            data_cache: cfg.data_cache,
            passthrough: match cfg.passthrough {
                crate::config::mount::Passthrough::Always => true,
                crate::config::mount::Passthrough::ReadOnly => cfg.read_only,
                crate::config::mount::Passthrough::Off => false,
            },
            cache_free_percent: cfg.cache_free_percent,
            cache_memory: cfg.cache_memory,
            write_back: cfg.write_back,
            posix_metadata: !cfg.ignore_metadata,
            posix_acl: cfg.posix_acl && !cfg.ignore_metadata,
            content_type: cfg.content_type.clone(),
            meta_save_delay: meta_update::SAVE_DELAY,
        }
    }
}

/// A mount of a whole bucket with every option at its default ([`MountConfig::new`]).
impl Default for FsConfig {
    fn default() -> Self {
        let whole_bucket = BucketSource::new("bucket", "").expect("a valid bucket name");
        Self::from(&MountConfig::new(whole_bucket))
    }
}

/// What `stat` shows for an inode.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Attr {
    pub ino: u64,
    pub kind: Kind,
    /// The file type `stat` shows: `kind`, or what the stored mode says (symlink, fifo...).
    pub node: meta::NodeType,
    pub size: u64,
    pub mtime: SystemTime,
    pub ctime: SystemTime,
    pub atime: SystemTime,
    /// Permission bits, setuid/setgid/sticky included.
    pub perm: u16,
    pub uid: u32,
    pub gid: u32,
    /// Links: 1 for a file; for a directory whose entries are all known, 2 and one per
    /// subdirectory (see `Inode::subdirs`), else 1.
    pub nlink: u32,
    /// A device node's number (`st_rdev`); 0 for the rest.
    pub rdev: u32,
    /// How long the kernel may cache this.
    pub ttl: Duration,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DirEntry {
    pub ino: u64,
    /// Opaque cookie the kernel hands back to continue after this entry.
    pub offset: u64,
    pub kind: Kind,
    /// The type `d_type` shows (what the stored mode says, when known).
    pub node: meta::NodeType,
    pub name: String,
    /// The version the listing showed (`None` for `.`, `..` and files only this mount
    /// knows): what a READDIRPLUS reply binds the name to again if the table evicted
    /// `ino` meanwhile.
    pub listed: Option<ListedVersion>,
}

/// What a LIST page says of one child.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ListedVersion {
    pub size: u64,
    pub mtime: SystemTime,
    pub etag: Option<String>,
}

/// How a file was opened, reduced to what matters here.
#[derive(Debug, Clone, Copy, Default)]
pub struct OpenMode {
    pub write: bool,
    pub truncate: bool,
    pub append: bool,
    /// `O_CREAT | O_EXCL`: the new file's first upload is refused if the key exists in S3
    /// by then (`If-None-Match: *`), as another client may have created it meanwhile.
    pub exclusive: bool,
}

pub struct S3Fs {
    /// `deletes`, seen as the object client.
    client: Arc<dyn ObjectClient>,
    deletes: Arc<DeferredDeletes>,
    cfg: FsConfig,
    inodes: Arc<Mutex<InodeTable>>,
    /// Crash recovery: the inode log, flushed whenever the table's lock is released.
    inode_log: std::sync::OnceLock<inode_log::InodeLog>,
    handles: Mutex<HashMap<u64, Handle>>,
    next_fh: AtomicU64,
    prefetch_budget: Arc<Semaphore>,
    upload_budget: upload::UploadBudget,
    mount_time: SystemTime,
    /// Empty new files whose PUT is under way, by inode.
    pending: Arc<Mutex<HashMap<u64, PendingCreate>>>,
    /// Metadata saves under way, by inode (see `meta_update::Saver::save`).
    saving: meta_update::SavesUnderWay,
    create_slots: Arc<Semaphore>,
    /// Set by `flush_all`: from then on every close waits for its upload.
    stopping: AtomicBool,
    staging: std::sync::OnceLock<Arc<staging::StagingArea>>,
    /// Whether writes go with `If-Match`/`If-None-Match` (see `start_background`).
    conditional_writes: Arc<crate::s3::ConditionalWrites>,
    /// `--data-cache` (see `open_staging`).
    data_cache: std::sync::OnceLock<Arc<cache::DataCache>>,
    memory_cache: Option<Arc<memcache::MemoryCache>>,
    /// The staged copy of each file being edited in place, by inode (see `edit.rs`).
    staged: Mutex<HashMap<u64, edit::Staged>>,
    /// Directory listings fetched ahead of a tree walk (see `walk_ahead.rs`).
    walk: Mutex<walk_ahead::WalkAhead>,
    /// Metadata HEADs under way and what a stat loads ahead (see `stat_ahead.rs`).
    stat_ahead: Arc<stat_ahead::StatAhead>,
    /// `--write-back`: staged files to upload, by inode, when and after how many failures.
    write_back: Mutex<HashMap<u64, (Instant, u32)>>,
    write_back_wake: tokio::sync::Notify,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    // A panic while holding the lock must not take the whole mount down with it.
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// The inode table, locked. Dropping it releases the lock first and then writes what the
/// holder queued for the inode log, so no one waits for that file I/O on the table.
struct Inodes<'a> {
    table: Option<std::sync::MutexGuard<'a, InodeTable>>,
    log: Option<&'a inode_log::InodeLog>,
}

impl std::ops::Deref for Inodes<'_> {
    type Target = InodeTable;
    fn deref(&self) -> &InodeTable {
        self.table.as_ref().expect("held until dropped")
    }
}

impl std::ops::DerefMut for Inodes<'_> {
    fn deref_mut(&mut self) -> &mut InodeTable {
        self.table.as_mut().expect("held until dropped")
    }
}

impl Drop for Inodes<'_> {
    fn drop(&mut self) {
        drop(self.table.take());
        if let Some(log) = self.log {
            log.flush();
        }
    }
}

/// Names this mount creates: a path component of at most 255 bytes (NAME_MAX, what
/// `statfs` reports and what programs size their buffers by).
fn check_name(name: &str) -> FsResult<()> {
    check_existing_name(name)?;
    if name.len() > NAME_MAX {
        return Err(FsError::NameTooLong);
    }
    Ok(())
}

/// Names of entries that may already exist: other clients write keys whose last
/// component passes 255 bytes, and those are listed, looked up, opened, renamed and
/// removed up to the kernel's FUSE limit of 1 024 bytes (a key's own limit as well).
fn check_existing_name(name: &str) -> FsResult<()> {
    if name.is_empty() || name == "." || name == ".." || name.contains('/') || name.contains('\0') {
        return Err(FsError::InvalidName);
    }
    if name.len() > FUSE_NAME_MAX {
        return Err(FsError::NameTooLong);
    }
    Ok(())
}

const NAME_MAX: usize = 255;
const FUSE_NAME_MAX: usize = 1024;

impl S3Fs {
    pub fn new(client: Arc<dyn ObjectClient>, cfg: FsConfig) -> Self {
        let mount_time = SystemTime::now();
        let units = (cfg.max_prefetch_memory / BUDGET_UNIT).min(u32::MAX as u64 / 2) as usize;
        let deletes = Arc::new(DeferredDeletes::new(client, !cfg.sync_delete));
        let upload_budget = upload::UploadBudget::new(cfg.max_upload_memory);
        let memory_cache =
            (cfg.cache_memory > 0).then(|| Arc::new(memcache::MemoryCache::new(cfg.cache_memory)));
        Self {
            inodes: Arc::new(Mutex::new(
                InodeTable::new(cfg.prefix.clone(), mount_time, cfg.max_entries)
                    .with_known_versions(cfg.max_known_versions),
            )),
            inode_log: std::sync::OnceLock::new(),
            client: deletes.clone(),
            deletes,
            cfg,
            handles: Mutex::new(HashMap::new()),
            next_fh: AtomicU64::new(1),
            prefetch_budget: Arc::new(Semaphore::new(units)),
            upload_budget,
            mount_time,
            pending: Arc::new(Mutex::new(HashMap::new())),
            saving: Default::default(),
            create_slots: Arc::new(Semaphore::new(CREATE_PUTS_IN_FLIGHT)),
            stopping: AtomicBool::new(false),
            staging: std::sync::OnceLock::new(),
            conditional_writes: Default::default(),
            data_cache: std::sync::OnceLock::new(),
            memory_cache,
            staged: Mutex::new(HashMap::new()),
            walk: Mutex::new(Default::default()),
            stat_ahead: Default::default(),
            write_back: Mutex::new(HashMap::new()),
            write_back_wake: tokio::sync::Notify::new(),
        }
    }

    /// Starts the mount's background work on `rt`: the write-back of edits (`edit.rs`),
    /// and on a writable mount the check whether the store honours conditional writes
    /// (a store that ignores `If-Match` would let an edit overwrite another client's
    /// version unseen; one that answers 501 is found at the first commit anyway).
    pub fn start_background(self: &Arc<Self>, rt: &tokio::runtime::Handle) {
        if self.cfg.write_back.is_some() {
            rt.spawn(self.clone().run_write_back());
        }
        if !self.cfg.read_only {
            let fs = self.clone();
            rt.spawn(async move {
                let key = format!("{}.s3csi-probe-{:016x}", fs.cfg.prefix, rand_u64());
                let answer = tokio::time::timeout(
                    CONDITION_PROBE_TIMEOUT,
                    crate::s3::honours_conditional_writes(fs.deletes.unordered().as_ref(), &key),
                )
                .await;
                match answer {
                    Ok(Some(false)) => fs
                        .conditional_writes
                        .not_honoured("a PUT with If-Match on a missing key was not refused"),
                    Ok(Some(true)) => tracing::debug!("the store honours conditional writes"),
                    _ => tracing::debug!(
                        "could not tell whether the store honours conditional writes"
                    ),
                }
            });
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
        let _ = self.inode_log.set(log.clone());
        self.inodes()
            .restore_and_log(&restored.bindings, restored.max_ino, log);
        self.next_fh.fetch_max(first_fh, Ordering::Relaxed);
    }

    fn attr_of(&self, i: &Inode) -> Attr {
        let m = self.stored_meta(i);
        let default_node = match i.kind {
            Kind::File => meta::NodeType::File,
            Kind::Dir => meta::NodeType::Dir,
        };
        // The key decides between directory and the rest: a stored mode claiming otherwise
        // (another client's mistake) is not believed.
        let node = m
            .and_then(|m| m.node_type())
            .filter(|t| (*t == meta::NodeType::Dir) == (i.kind == Kind::Dir))
            .unwrap_or(default_node);
        let mtime = if i.mtime_from_writes {
            i.mtime
        } else {
            m.and_then(|m| m.mtime).unwrap_or(if i.kind == Kind::Dir {
                self.mount_time
            } else {
                i.mtime
            })
        };
        // Changes made here show at once, at no request (see `Inode::entries_changed_at`).
        let mtime = mtime.max(i.entries_changed_at.unwrap_or(mtime));
        let ctime = [i.entries_changed_at, i.renamed_at]
            .into_iter()
            .flatten()
            .fold(m.and_then(|m| m.ctime).unwrap_or(mtime), SystemTime::max);
        Attr {
            ino: i.ino,
            kind: i.kind,
            node,
            size: i.size,
            mtime,
            ctime,
            atime: m.and_then(|m| m.atime).unwrap_or(mtime),
            perm: m.and_then(|m| m.perm()).unwrap_or(match i.kind {
                Kind::File => self.cfg.file_mode,
                Kind::Dir => self.cfg.dir_mode,
            }),
            uid: m.and_then(|m| m.uid).unwrap_or(self.cfg.uid),
            gid: m.and_then(|m| m.gid).unwrap_or(self.cfg.gid),
            nlink: match i.kind {
                Kind::File => 1,
                // 1 is "not known" to tree walkers (the FUSE FAQ's convention): fts and
                // find never take it to mean there are no subdirectories left to visit.
                Kind::Dir if i.complete_as_of.is_some() => 2 + i.subdirs,
                Kind::Dir => 1,
            },
            rdev: match node {
                meta::NodeType::CharDev | meta::NodeType::BlockDev => {
                    m.and_then(|m| m.rdev).unwrap_or(0)
                }
                _ => 0,
            },
            // Also while a file is being written: every write goes through the kernel, which
            // updates the size itself and drops its cached times, so a cached answer cannot go
            // stale; and `stat` right after creating a file costs no round trip to us. An
            // entry listed without its metadata is not cached at all: its first stat comes
            // back for the HEAD (see `stat_ahead.rs`), by name, so that a symlink or special
            // file a listing could not tell from a file gets an inode of its type.
            ttl: if self.needs_meta(i) {
                Duration::ZERO
            } else {
                self.cfg.metadata_ttl
            },
        }
    }

    /// The metadata `stat` honours for `i`: none when the mount ignores stored metadata.
    fn stored_meta<'a>(&self, i: &'a Inode) -> Option<&'a meta::PosixMeta> {
        if self.cfg.posix_metadata {
            i.meta.as_deref()
        } else {
            None
        }
    }

    /// True when answering for `i` needs a HEAD first: its metadata is not known.
    fn needs_meta(&self, i: &Inode) -> bool {
        self.cfg.posix_metadata && meta_update::unknown_meta(i)
    }

    fn fresh(&self, i: &Inode) -> bool {
        i.being_written()
            || i.local_only
            || i.validated
                .is_some_and(|t| t.elapsed() < self.cfg.metadata_ttl)
    }

    /// True when the parent's children are all known (see `Inode::complete_as_of`).
    fn listing_fresh(&self, dir: &Inode) -> bool {
        dir.complete_as_of
            .is_some_and(|t| t.elapsed() < self.cfg.metadata_ttl)
    }

    fn inodes(&self) -> Inodes<'_> {
        Inodes {
            table: Some(lock(&self.inodes)),
            log: self.inode_log.get(),
        }
    }

    fn inode(&self, ino: u64) -> FsResult<Inode> {
        self.inodes().get(ino).cloned().ok_or(FsError::NotFound)
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

    pub fn inode_count(&self) -> usize {
        self.inodes().len()
    }
}

#[cfg(test)]
mod tests;
