//! The inode table: stable inode numbers for the names the kernel knows about.
//!
//! Invariants: the root (ino 1) is never removed; `children` maps each directory to its
//! names and the inodes currently bound to them (so listing a directory's known children
//! costs what it has, not what the table has); an inode is removed once the kernel has forgotten
//! it (lookup count 0) and no handle has it open. Entries that only a listing created
//! (lookup count 0) are evicted oldest first once the table grows past its cap, so huge
//! directories do not pin memory; an eviction makes the directory incomplete (a lookup
//! of a name the table lacks then asks S3), and costs O(1) per entry however many
//! inodes the kernel pins (a scan of the whole table on every insert past the cap made
//! a walk of 100 000 pinned entries quadratic).

use super::inode_log::{Binding, InodeLog};
use super::known_versions::{no_meta, KnownVersions};
use super::meta::PosixMeta;
use crate::s3::UserMeta;
use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::Arc;
use std::time::{Instant, SystemTime};

pub const ROOT_INO: u64 = 1;
/// Lookup count of an inode restored after a mounter crash: never reaches 0 by counting.
const RESTORED_LOOKUPS: u64 = 1 << 40;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    File,
    Dir,
}

#[derive(Debug, Clone)]
pub struct Inode {
    pub ino: u64,
    pub parent: u64,
    pub name: String,
    pub kind: Kind,
    /// Full object key; directories end with `/` (the root is the mount prefix, maybe "").
    pub key: String,
    pub size: u64,
    pub mtime: SystemTime,
    pub etag: Option<String>,
    /// When S3 last confirmed this metadata; `None` forces a refresh.
    pub validated: Option<Instant>,
    pub lookups: u64,
    pub open_handles: u32,
    /// File handle of the writer streaming a new version of this file, if any.
    pub writer: Option<u64>,
    /// The file is staged (edited in place, see `staging.rs`): its size is the local one.
    pub staged: bool,
    /// Created in this mount and not yet uploaded: S3 does not know it yet.
    pub local_only: bool,
    /// For directories: every child was in this table at that instant (a full listing,
    /// or mkdir of an empty directory), and our own changes kept it so since. Lets a
    /// lookup of a missing name answer ENOENT without asking S3, within the TTL.
    pub complete_as_of: Option<Instant>,
    /// For directories: when a background listing was last started (see `S3Fs::list_ahead`).
    pub list_ahead_at: Option<Instant>,
    /// The object's POSIX metadata (see `meta.rs`) for the version this inode shows;
    /// `None` while unknown (LIST does not return it: a HEAD tells).
    pub meta: Option<Arc<PosixMeta>>,
    /// The S3 Last-Modified `meta` was read for. With the ETag it names the version: a
    /// listing that shows another one drops `meta` (a metadata-only change by another
    /// client keeps the ETag but not the Last-Modified). `None` after our own upload,
    /// whose Last-Modified the server did not tell: the next listing with the same ETag
    /// supplies it.
    pub meta_stamp: Option<SystemTime>,
    /// Bumped by every metadata change made here; `meta_saved` is the last one in S3.
    pub meta_changes: u64,
    pub meta_saved: u64,
    /// A symlink's target, once read.
    pub link_target: Option<Arc<str>>,
    /// Written through this mount since its metadata was last saved: its mtime is the
    /// time of the last write (`mtime`), not the stored one.
    pub mtime_from_writes: bool,
    /// When this mount last renamed the inode: shown as its ctime while later than the
    /// stored one (S3 keeps no ctime of its own; see `S3Fs::attr_of`).
    pub renamed_at: Option<SystemTime>,
    /// For directories: when this mount last created, removed or renamed an entry in it:
    /// shown as its mtime and ctime while later than the stored ones, as on a local disk.
    pub entries_changed_at: Option<SystemTime>,
    /// For directories: how many subdirectories the table binds in it (its link count is
    /// 2 more; exact while `complete_as_of` says all children are known). Kept by `bind`
    /// and `unbind_name`, nowhere else.
    pub subdirs: u32,
    /// For directories that older s3fs versions, Hadoop or a console made: the key of the
    /// object that marks it instead of `key` (a zero-byte `dir` of type
    /// `application/x-directory`, or `dir_$folder$`). Its metadata is the directory's;
    /// the first change replaces it with a marker `dir/`, and `rmdir` removes it.
    pub legacy_marker: Option<String>,
}

impl Inode {
    /// This mount is writing the file (streaming or staged): what S3 says of its size and
    /// version is not the file's any more, and it must not move or be forgotten.
    pub fn being_written(&self) -> bool {
        self.writer.is_some() || self.staged
    }

    /// Keeps `meta` only if S3 still holds the version it was read for (see `meta_stamp`).
    /// Directories from a listing carry no version: theirs stays until it expires.
    fn forget_meta_unless(&mut self, etag: Option<&str>, mtime: SystemTime) {
        if self.kind == Kind::Dir || self.meta.is_none() || self.meta_changes != self.meta_saved {
            return;
        }
        if etag.is_none() || self.etag.as_deref() != etag {
            self.meta = None;
            self.link_target = None;
        } else if self.meta_stamp.is_none() {
            self.meta_stamp = Some(mtime);
        } else if self.meta_stamp.map(whole_seconds) != Some(whole_seconds(mtime)) {
            self.meta = None;
        }
    }

    /// The object whose HEAD tells this inode's metadata.
    pub fn meta_key(&self) -> &str {
        self.legacy_marker.as_deref().unwrap_or(&self.key)
    }

    pub fn child_key(&self, name: &str, kind: Kind) -> String {
        match kind {
            Kind::File => format!("{}{}", self.key, name),
            Kind::Dir => format!("{}{}/", self.key, name),
        }
    }
}

pub struct InodeTable {
    /// Boxed: growing the map then moves pointers, not 300-byte inodes, and never needs
    /// two copies of every inode at once (the peak RSS of a 100 000-entry walk).
    by_ino: HashMap<u64, Box<Inode>>,
    /// Directory inode → name → the inode bound to that name.
    children: HashMap<u64, HashMap<String, u64>>,
    next_ino: u64,
    evict_above: usize,
    /// Inodes a listing created, oldest first: the candidates for eviction. May hold
    /// inodes gone or pinned since; eviction skips those.
    evictable: VecDeque<u64>,
    /// Bumped whenever a name is dropped from the table without being deleted in S3, so
    /// a listing that raced with it does not claim to be complete.
    pub forgotten_names: u64,
    /// Bumped by every rename and unlink here, so that a background listing begun before
    /// one does not bring the old name back (see `S3Fs::list_ahead`).
    pub namespace_changes: u64,
    /// Metadata of the object versions read here, surviving the eviction of their inodes.
    known: KnownVersions,
    /// Crash recovery (see `inode_log`): where bindings the kernel knows are persisted.
    log: Option<InodeLog>,
    /// Inodes whose binding is in the log.
    logged: HashSet<u64>,
    /// Inodes restored from a dead mounter's log: the kernel's lookup count is unknown.
    recovered: HashSet<u64>,
}

impl InodeTable {
    pub fn new(root_key: String, mount_time: SystemTime, evict_above: usize) -> Self {
        let root = Inode {
            ino: ROOT_INO,
            parent: ROOT_INO,
            name: String::new(),
            kind: Kind::Dir,
            key: root_key,
            size: 0,
            mtime: mount_time,
            etag: None,
            validated: None,
            lookups: 1,
            open_handles: 0,
            writer: None,
            staged: false,
            local_only: false,
            complete_as_of: None,
            list_ahead_at: None,
            meta: None,
            meta_stamp: None,
            meta_changes: 0,
            meta_saved: 0,
            link_target: None,
            mtime_from_writes: false,
            renamed_at: None,
            entries_changed_at: None,
            subdirs: 0,
            legacy_marker: None,
        };
        Self {
            by_ino: HashMap::from([(ROOT_INO, Box::new(root))]),
            children: HashMap::new(),
            next_ino: ROOT_INO + 1,
            evict_above: evict_above.max(1),
            evictable: VecDeque::new(),
            forgotten_names: 0,
            namespace_changes: 0,
            known: KnownVersions::new(evict_above.max(1)),
            log: None,
            logged: HashSet::new(),
            recovered: HashSet::new(),
        }
    }

    /// Keeps the metadata of up to `cap` versions known apart from the inodes
    /// (`--max-known-versions`; by default as many as inodes).
    pub fn with_known_versions(mut self, cap: usize) -> Self {
        self.known = KnownVersions::new(cap);
        self
    }

    /// Restores the bindings a dead mounter persisted and persists new ones to `log` from
    /// now on. Restored inodes are pinned until the kernel forgets them (their lookup
    /// count is unknown; a FORGET always carries the kernel's whole count).
    pub fn restore_and_log(&mut self, restored: &[Binding], max_ino: u64, log: InodeLog) {
        let mount_time = self.by_ino.get(&ROOT_INO).map(|r| r.mtime);
        for b in restored {
            if b.ino == ROOT_INO || self.by_ino.contains_key(&b.ino) {
                continue;
            }
            self.by_ino.insert(
                b.ino,
                Box::new(Inode {
                    ino: b.ino,
                    parent: b.parent,
                    name: b.name().to_string(),
                    kind: b.kind,
                    key: b.key.clone(),
                    size: 0,
                    mtime: mount_time.unwrap_or_else(SystemTime::now),
                    etag: None,
                    validated: None,
                    lookups: RESTORED_LOOKUPS,
                    open_handles: 0,
                    writer: None,
                    staged: false,
                    local_only: false,
                    complete_as_of: None,
                    list_ahead_at: None,
                    meta: None,
                    meta_stamp: None,
                    meta_changes: 0,
                    meta_saved: 0,
                    link_target: None,
                    mtime_from_writes: false,
                    renamed_at: None,
                    entries_changed_at: None,
                    subdirs: 0,
                    legacy_marker: None,
                }),
            );
            self.bind(b.parent, b.name(), b.ino);
            self.logged.insert(b.ino);
            self.recovered.insert(b.ino);
        }
        self.next_ino = self.next_ino.max(max_ino + 1);
        let live = self.logged_bindings();
        log.compact(&live);
        self.log = Some(log);
    }

    fn logged_bindings(&self) -> Vec<Binding> {
        let mut v: Vec<Binding> = self
            .logged
            .iter()
            .filter_map(|i| self.get(*i))
            .map(Binding::of)
            .collect();
        v.sort_by_key(|b| b.ino);
        v
    }

    /// The kernel now knows `ino`: persist its binding before the reply goes out.
    fn log_known(&mut self, ino: u64) {
        let Some(log) = self.log.as_mut() else {
            return;
        };
        if ino == ROOT_INO || self.logged.contains(&ino) {
            return;
        }
        if let Some(i) = self.by_ino.get(&ino) {
            log.bind(&Binding::of(i));
            self.logged.insert(ino);
            if log.wants_compaction(self.logged.len()) {
                let live = self.logged_bindings();
                if let Some(log) = self.log.as_mut() {
                    log.compact(&live);
                }
            }
        }
    }

    /// `ino` lost its name or left the table: a replacement must not resolve it.
    fn log_gone(&mut self, ino: u64) {
        self.recovered.remove(&ino);
        if self.logged.remove(&ino) {
            if let Some(log) = self.log.as_mut() {
                log.unbind(ino);
            }
        }
    }

    pub fn get(&self, ino: u64) -> Option<&Inode> {
        self.by_ino.get(&ino).map(|i| &**i)
    }

    pub fn get_mut(&mut self, ino: u64) -> Option<&mut Inode> {
        self.by_ino.get_mut(&ino).map(|i| &mut **i)
    }

    pub fn child(&self, parent: u64, name: &str) -> Option<&Inode> {
        self.bound(parent, name).and_then(|i| self.get(i))
    }

    pub fn children_of(&self, parent: u64) -> impl Iterator<Item = &Inode> {
        self.children
            .get(&parent)
            .into_iter()
            .flat_map(|names| names.values())
            .filter_map(|ino| self.get(*ino))
    }

    /// The inode bound to `name` in `parent`.
    fn bound(&self, parent: u64, name: &str) -> Option<u64> {
        self.children.get(&parent)?.get(name).copied()
    }

    /// Whether a name still leads to `ino` (false once it was unlinked or replaced).
    pub fn is_bound(&self, ino: u64) -> bool {
        self.by_ino
            .get(&ino)
            .is_some_and(|i| ino == ROOT_INO || self.bound(i.parent, &i.name) == Some(ino))
    }

    /// Binds `name` in `parent` to `ino`; returns the inode bound to it before.
    fn bind(&mut self, parent: u64, name: &str, ino: u64) -> Option<u64> {
        let before = self
            .children
            .entry(parent)
            .or_default()
            .insert(name.to_string(), ino);
        if let Some(old) = before {
            self.count_subdir(parent, old, false);
        }
        self.count_subdir(parent, ino, true);
        before
    }

    /// Removes the binding of `name` in `parent`, whatever it is bound to.
    fn unbind_name(&mut self, parent: u64, name: &str) -> Option<u64> {
        let names = self.children.get_mut(&parent)?;
        let ino = names.remove(name);
        if names.is_empty() {
            self.children.remove(&parent);
        }
        if let Some(ino) = ino {
            self.count_subdir(parent, ino, false);
        }
        ino
    }

    /// Keeps `parent.subdirs` as the number of directories bound in it (`child` was bound,
    /// or unbound). The child's inode exists at both moments (see `evict`).
    fn count_subdir(&mut self, parent: u64, child: u64, bound: bool) {
        if self.by_ino.get(&child).map(|c| c.kind) != Some(Kind::Dir) {
            return;
        }
        if let Some(p) = self.by_ino.get_mut(&parent) {
            p.subdirs = if bound {
                p.subdirs + 1
            } else {
                p.subdirs.saturating_sub(1)
            };
        }
    }

    /// What `upsert` does, for a child still bound to the version a listing shows (same
    /// kind, ETag and size, not being written): from a listing that may be stale about
    /// names, which then adds and drops none. The child's inode, if it was confirmed.
    pub fn confirm(
        &mut self,
        parent: u64,
        name: &str,
        kind: Kind,
        size: u64,
        mtime: SystemTime,
        etag: Option<String>,
    ) -> Option<u64> {
        let ino = self.bound(parent, name)?;
        let i = self.by_ino.get(&ino)?;
        let same = i.kind == kind
            && !i.being_written()
            && !i.local_only
            && etag.is_some()
            && i.etag == etag
            && i.size == size;
        same.then(|| self.upsert(parent, name, kind, size, mtime, etag))
    }

    /// Binds `name` under `parent` to an inode of `kind` with fresh metadata, reusing the
    /// existing inode when the kind matches, so inode numbers stay stable across refreshes.
    pub fn upsert(
        &mut self,
        parent: u64,
        name: &str,
        kind: Kind,
        size: u64,
        mtime: SystemTime,
        etag: Option<String>,
    ) -> u64 {
        let now = Instant::now();
        if let Some(existing) = self.bound(parent, name) {
            if let Some(inode) = self.by_ino.get_mut(&existing) {
                // The zero-byte object that marks a directory, listed again.
                if kind == Kind::File
                    && inode.kind == Kind::Dir
                    && inode.legacy_marker.as_deref() == inode.key.strip_suffix('/')
                {
                    inode.validated = Some(now);
                    return existing;
                }
                if inode.kind == kind {
                    // A writer's size and a local-only file (an empty new one whose PUT is
                    // under way, see `S3Fs::defer_empty`) are ours to report, not S3's.
                    if !inode.being_written() && !inode.local_only {
                        inode.forget_meta_unless(etag.as_deref(), mtime);
                        inode.size = size;
                        inode.mtime = mtime;
                        inode.etag = etag;
                        inode.local_only = false;
                        if inode.meta.is_none() {
                            recall(&self.known, inode);
                        }
                    }
                    inode.validated = Some(now);
                    return self.settle_legacy_dir(existing);
                }
            }
        }
        let Some(parent_inode) = self.by_ino.get(&parent) else {
            return 0;
        };
        let key = parent_inode.child_key(name, kind);
        // Room first, so that the inode being added is never the one evicted.
        if self.by_ino.len() >= self.evict_above {
            self.evict_oldest();
            if !self.by_ino.contains_key(&parent) {
                // The parent was idle too (a directory only a listing knew).
                return 0;
            }
        }
        let ino = self.next_ino;
        self.next_ino += 1;
        self.by_ino.insert(
            ino,
            Box::new(Inode {
                ino,
                parent,
                name: name.to_string(),
                kind,
                key,
                size,
                mtime,
                etag,
                validated: Some(now),
                lookups: 0,
                open_handles: 0,
                writer: None,
                staged: false,
                local_only: false,
                complete_as_of: None,
                list_ahead_at: None,
                meta: None,
                meta_stamp: None,
                meta_changes: 0,
                meta_saved: 0,
                link_target: None,
                mtime_from_writes: false,
                renamed_at: None,
                entries_changed_at: None,
                subdirs: 0,
                legacy_marker: None,
            }),
        );
        if let Some(i) = self.by_ino.get_mut(&ino) {
            recall(&self.known, i);
        }
        self.bind(parent, name, ino);
        self.evictable.push_back(ino);
        self.settle_legacy_dir(ino)
    }

    /// Takes the metadata S3 returned for `ino`'s version (HEAD: its user metadata and
    /// Last-Modified `stamp`), unless a change made here is not saved yet, and remembers
    /// it for that version.
    /// What a HEAD of file `key` said, for a version whose inode is gone (evicted while
    /// the HEAD was under way): kept for when the name is listed again.
    pub fn remember_version(&mut self, key: &str, etag: &str, h: &UserMeta, stamp: SystemTime) {
        let meta = if h.is_empty() {
            no_meta()
        } else {
            Arc::new(PosixMeta::from_headers(h, key))
        };
        self.known.remember(key, etag, stamp, meta);
    }

    pub fn set_meta(&mut self, ino: u64, h: &UserMeta, stamp: SystemTime) {
        let Some(i) = self.by_ino.get_mut(&ino) else {
            return;
        };
        if i.meta_changes != i.meta_saved {
            return;
        }
        let meta = if h.is_empty() {
            no_meta()
        } else {
            Arc::new(PosixMeta::from_headers(h, &i.key))
        };
        i.meta = Some(meta);
        i.meta_stamp = Some(stamp);
        i.link_target = None;
        if let (Kind::File, Some(etag), Some(meta)) = (i.kind, i.etag.as_deref(), &i.meta) {
            self.known.remember(&i.key, etag, stamp, meta.clone());
        }
        self.settle_legacy_dir(ino);
    }

    /// If file `ino` is in truth an older s3fs directory object (zero bytes, its metadata
    /// says directory: see `PosixMeta::marks_directory`), binds its name to a directory
    /// marked by it instead, with its metadata. The inode now bound at its name.
    fn settle_legacy_dir(&mut self, ino: u64) -> u64 {
        let Some(i) = self.by_ino.get(&ino) else {
            return ino;
        };
        let legacy = i.kind == Kind::File
            && i.size == 0
            && !i.being_written()
            && !i.local_only
            && i.meta.as_ref().is_some_and(|m| m.marks_directory());
        if !legacy || self.bound(i.parent, &i.name) != Some(ino) {
            return ino;
        }
        let (parent, name, key, mtime) = (i.parent, i.name.clone(), i.key.clone(), i.mtime);
        let meta = i.meta.clone();
        let stamp = i.meta_stamp;
        let dir = self.upsert(parent, &name, Kind::Dir, 0, mtime, None);
        if let Some(d) = self.by_ino.get_mut(&dir) {
            d.legacy_marker = Some(key);
            if d.meta_changes == d.meta_saved {
                d.meta = meta;
                d.meta_stamp = stamp;
            }
        }
        dir
    }

    /// Keeps the metadata of the versions read from now on in `path` too, and knows those
    /// a previous mount kept there (see `known_versions.rs`).
    pub fn persist_known_versions(&mut self, path: &std::path::Path) -> std::io::Result<usize> {
        self.known.persist_in(path)
    }

    /// Writes out what `persist_known_versions` buffered.
    pub fn flush_known_versions(&mut self) {
        self.known.flush();
    }

    /// True when nothing but the table refers to `i`: S3 can tell it again.
    fn idle(i: &Inode) -> bool {
        i.ino != ROOT_INO
            && i.lookups == 0
            && i.open_handles == 0
            && !i.being_written()
            && !i.local_only
    }

    /// Evicts the oldest idle inodes until the table is a tenth below its cap (or nothing
    /// idle is left), so that the next evictions are a page's worth of inserts away.
    fn evict_oldest(&mut self) {
        let target = self.evict_above - self.evict_above / 10;
        // The newest candidates are a listing page being handed out: when the kernel pins
        // everything older (`ls -l` of a directory larger than the cap), evicting them would
        // drop each entry before the kernel gets it, and its metadata with it.
        let keep_newest = (self.evict_above / 4).min(RECENT_KEPT);
        while self.by_ino.len() > target && self.evictable.len() > keep_newest {
            let Some(ino) = self.evictable.pop_front() else {
                break;
            };
            if self.by_ino.get(&ino).is_some_and(|i| Self::idle(i)) {
                self.evict(ino);
            }
        }
        // Pinned and removed inodes leave stale candidates behind: drop them before the
        // queue outgrows the table.
        if self.evictable.len() > 2 * self.by_ino.len() + 1024 {
            let by_ino = &self.by_ino;
            self.evictable
                .retain(|ino| by_ino.get(ino).is_some_and(|i| Self::idle(i)));
        }
    }

    fn evict(&mut self, ino: u64) {
        if let Some(i) = self.by_ino.get(&ino) {
            let (parent, name) = (i.parent, i.name.clone());
            if self.bound(parent, &name) == Some(ino) {
                // Unbound while the inode still says what it is (`count_subdir`).
                self.unbind_name(parent, &name);
                self.forget_completeness(parent);
            }
        }
        self.by_ino.remove(&ino);
        self.log_gone(ino);
    }

    /// An entry of `dir` was created, removed or renamed through this mount.
    pub fn entries_changed(&mut self, dir: u64) {
        if let Some(d) = self.by_ino.get_mut(&dir) {
            d.entries_changed_at = Some(SystemTime::now());
        }
    }

    /// Unbinds `name`, removed through this mount: its directory changed.
    pub fn remove_here(&mut self, parent: u64, name: &str) -> Option<u64> {
        self.entries_changed(parent);
        self.unbind(parent, name)
    }

    /// Unbinds `name`; the inode itself lives on until the kernel forgets it.
    pub fn unbind(&mut self, parent: u64, name: &str) -> Option<u64> {
        let ino = self.unbind_name(parent, name)?;
        self.namespace_changes += 1;
        self.log_gone(ino);
        self.maybe_remove(ino);
        Some(ino)
    }

    /// Moves an inode to a new name (after a rename in S3). Returns the inode that was
    /// bound to the target name before, if any.
    pub fn rebind(&mut self, ino: u64, new_parent: u64, new_name: &str) -> Option<u64> {
        self.namespace_changes += 1;
        let (old_parent, old_name) = {
            let i = self.by_ino.get(&ino)?;
            (i.parent, i.name.clone())
        };
        if self.bound(old_parent, &old_name) == Some(ino) {
            self.unbind_name(old_parent, &old_name);
        }
        self.entries_changed(old_parent);
        self.entries_changed(new_parent);
        if let Some(i) = self.by_ino.get_mut(&ino) {
            i.renamed_at = Some(SystemTime::now());
        }
        let replaced = self.bind(new_parent, new_name, ino);
        let kind = self.by_ino.get(&ino).map_or(Kind::File, |i| i.kind);
        let new_key = self
            .by_ino
            .get(&new_parent)
            .map(|p| p.child_key(new_name, kind));
        if let (Some(i), Some(key)) = (self.by_ino.get_mut(&ino), new_key) {
            i.parent = new_parent;
            i.name = new_name.to_string();
            i.key = key;
        }
        // A directory's descendants move with it: their keys follow its new one.
        self.rekey_children(ino);
        if let Some(r) = replaced.filter(|r| *r != ino) {
            self.log_gone(r);
            self.maybe_remove(r);
        }
        if self.logged.remove(&ino) {
            self.log_known(ino);
        }
        replaced
    }

    fn rekey_children(&mut self, dir: u64) {
        let Some(parent) = self.by_ino.get(&dir).cloned() else {
            return;
        };
        let children: Vec<u64> = self
            .children
            .get(&dir)
            .map(|c| c.values().copied().collect())
            .unwrap_or_default();
        for child in children {
            let Some(i) = self.by_ino.get_mut(&child) else {
                continue;
            };
            i.key = parent.child_key(&i.name, i.kind);
            // A copy need not keep the ETag (a multipart object's copy has a plain one):
            // the next open asks S3 for it.
            i.etag = None;
            if self.logged.remove(&child) {
                self.log_known(child);
            }
            self.rekey_children(child);
        }
    }

    /// Every inode bound below `dir`, at any depth.
    pub fn descendants(&self, dir: u64) -> Vec<u64> {
        let mut out = Vec::new();
        let mut todo = vec![dir];
        while let Some(d) = todo.pop() {
            if let Some(c) = self.children.get(&d) {
                for ino in c.values() {
                    out.push(*ino);
                    todo.push(*ino);
                }
            }
        }
        out
    }

    pub fn add_lookup(&mut self, ino: u64) {
        self.pin(ino);
        self.log_known(ino);
    }

    /// One more reference that keeps `ino` from eviction, not logged: a READDIRPLUS
    /// reply pins every entry before it knows which fit (see `S3Fs::reply_entries`).
    pub fn pin(&mut self, ino: u64) {
        if let Some(i) = self.by_ino.get_mut(&ino) {
            i.lookups += 1;
        }
    }

    /// Drops a `pin` that the kernel did not take over; the inode stays (an evictable
    /// listing entry again, its directory still complete).
    pub fn unpin(&mut self, ino: u64) {
        if let Some(i) = self.by_ino.get_mut(&ino) {
            i.lookups = i.lookups.saturating_sub(1);
            if i.lookups == 0 && Self::idle(i) {
                self.evictable.push_back(ino);
            }
        }
    }

    /// A file created here is in S3 now. A listing fetched ahead while it was not (see
    /// `walk_ahead.rs`) does not show it, and the table stops adding it as a local
    /// file: such a listing counts as stale, as after a rename.
    pub fn now_in_s3(&mut self, ino: u64) {
        if let Some(i) = self.by_ino.get_mut(&ino).filter(|i| i.local_only) {
            i.local_only = false;
            self.namespace_changes += 1;
        }
    }

    pub fn forget(&mut self, ino: u64, n: u64) {
        let restored = n > 0 && self.recovered.remove(&ino);
        if let Some(i) = self.by_ino.get_mut(&ino) {
            i.lookups = if restored {
                0
            } else {
                i.lookups.saturating_sub(n)
            };
        }
        self.maybe_remove(ino);
    }

    /// Drops an inode nobody refers to any more: not the kernel, no handle, no name that
    /// a listing might hand out again.
    fn maybe_remove(&mut self, ino: u64) {
        let Some(i) = self.by_ino.get(&ino) else {
            return;
        };
        if ino == ROOT_INO || i.lookups > 0 || i.open_handles > 0 || i.being_written() {
            return;
        }
        let bound = self.bound(i.parent, &i.name) == Some(ino);
        if bound && i.local_only {
            return;
        }
        if bound {
            let (parent, name) = (i.parent, i.name.clone());
            self.unbind_name(parent, &name);
            self.forget_completeness(parent);
        }
        self.by_ino.remove(&ino);
        self.log_gone(ino);
    }

    /// The table no longer holds every child of `dir`.
    fn forget_completeness(&mut self, dir: u64) {
        self.forgotten_names += 1;
        if let Some(d) = self.by_ino.get_mut(&dir) {
            d.complete_as_of = None;
        }
    }

    /// Removes every inode that only a listing created and nobody holds.
    pub fn evict_idle(&mut self) {
        let idle: Vec<u64> = self
            .by_ino
            .values()
            .filter(|i| Self::idle(i))
            .map(|i| i.ino)
            .collect();
        for ino in idle {
            self.evict(ino);
        }
        self.evictable.clear();
    }

    pub fn len(&self) -> usize {
        self.by_ino.len()
    }

    /// Inodes whose metadata changed here and is not saved yet.
    pub fn dirty_meta(&self) -> Vec<u64> {
        self.by_ino
            .values()
            .filter(|i| i.meta_changes != i.meta_saved)
            .map(|i| i.ino)
            .collect()
    }

    pub fn is_empty(&self) -> bool {
        self.by_ino.is_empty()
    }

    /// Inserts a brand-new inode for a name created in this mount.
    pub fn create_local(&mut self, parent: u64, name: &str, kind: Kind) -> Option<u64> {
        let ino = self.upsert(parent, name, kind, 0, SystemTime::now(), None);
        if ino == 0 {
            return None;
        }
        let i = self.by_ino.get_mut(&ino)?;
        i.size = 0;
        i.mtime = SystemTime::now();
        i.etag = None;
        i.local_only = kind == Kind::File;
        self.entries_changed(parent);
        // create() hands the number to the kernel without add_lookup.
        self.log_known(ino);
        Some(ino)
    }
}

/// Inodes a listing created last that eviction leaves alone (two LIST pages).
const RECENT_KEPT: usize = 2000;

/// Gives file `i` the metadata known for the version it shows, if any.
fn recall(known: &KnownVersions, i: &mut Inode) {
    let (Kind::File, Some(etag)) = (i.kind, i.etag.as_deref()) else {
        return;
    };
    if let Some(meta) = known.recall(&i.key, etag, i.mtime) {
        i.meta = Some(meta);
        i.meta_stamp = Some(i.mtime);
        i.link_target = None;
    }
}

/// A time to the second: HEAD's Last-Modified is an HTTP date (whole seconds) where a
/// LIST of the same version may say milliseconds (moto, the embedded server).
pub(super) fn whole_seconds(t: SystemTime) -> u64 {
    t.duration_since(SystemTime::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn upsert_keeps_inode_numbers_stable() {
        let mut t = InodeTable::new(String::new(), SystemTime::now(), 1000);
        let a = t.upsert(ROOT_INO, "a", Kind::File, 1, SystemTime::now(), None);
        let b = t.upsert(ROOT_INO, "a", Kind::File, 2, SystemTime::now(), None);
        assert_eq!(a, b);
        assert_eq!(t.get(a).unwrap().size, 2);
        assert_eq!(t.get(a).unwrap().key, "a");
        let d = t.upsert(ROOT_INO, "d", Kind::Dir, 0, SystemTime::now(), None);
        let f = t.upsert(d, "f", Kind::File, 0, SystemTime::now(), None);
        assert_eq!(t.get(f).unwrap().key, "d/f");
    }

    #[test]
    fn idle_listing_entries_are_evicted_but_looked_up_ones_stay() {
        let mut t = InodeTable::new("p/".into(), SystemTime::now(), 100);
        let kept = t.upsert(ROOT_INO, "kept", Kind::File, 0, SystemTime::now(), None);
        t.add_lookup(kept);
        for n in 0..150 {
            t.upsert(
                ROOT_INO,
                &format!("f{n}"),
                Kind::File,
                0,
                SystemTime::now(),
                None,
            );
        }
        assert!(t.len() <= 101, "table holds {}", t.len());
        assert!(t.get(ROOT_INO).unwrap().complete_as_of.is_none());
        assert!(t.get(kept).is_some());
        t.forget(kept, 1);
        assert!(t.get(kept).is_none());
    }

    #[test]
    fn bindings_the_kernel_knows_are_restored_by_a_replacement() {
        use crate::fs::inode_log::{self, InodeLog};
        let dir = std::env::temp_dir().join(format!("s3csi-inotable-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("inodes.log");
        let mut t = InodeTable::new("p/".into(), SystemTime::now(), 1000);
        t.restore_and_log(&[], 0, InodeLog::create(&path, "p/", &[]).unwrap());
        let d = t.upsert(ROOT_INO, "d", Kind::Dir, 0, SystemTime::now(), None);
        let listed = t.upsert(d, "listed", Kind::File, 1, SystemTime::now(), None);
        let f = t.upsert(d, "f", Kind::File, 1, SystemTime::now(), None);
        t.add_lookup(d);
        t.add_lookup(f);
        let gone = t.upsert(ROOT_INO, "gone", Kind::File, 1, SystemTime::now(), None);
        t.add_lookup(gone);
        t.forget(gone, 1);
        // What the table queued is written once its lock is released (`S3Fs::inodes`).
        t.log.as_ref().unwrap().flush();
        // The dead mounter's table is lost; the log is what a replacement sees.
        let loaded = inode_log::load(&path, "p/").unwrap();
        let mut r = InodeTable::new("p/".into(), SystemTime::now(), 1000);
        r.restore_and_log(
            &loaded.bindings,
            loaded.max_ino,
            InodeLog::create(&path, "p/", &[]).unwrap(),
        );
        assert_eq!(r.get(d).unwrap().key, "p/d/");
        assert_eq!(r.child(d, "f").unwrap().ino, f);
        assert!(r.get(listed).is_none() && r.get(gone).is_none());
        // New numbers never reuse one the kernel may hold.
        let n = r.upsert(ROOT_INO, "new", Kind::File, 0, SystemTime::now(), None);
        assert!(n > gone);
        // Restored inodes survive eviction until the kernel forgets them.
        r.evict_idle();
        assert!(r.get(f).is_some());
        r.forget(f, 3);
        assert!(r.get(f).is_none());
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn rebind_moves_name_and_key() {
        let mut t = InodeTable::new(String::new(), SystemTime::now(), 1000);
        let d = t.upsert(ROOT_INO, "d", Kind::Dir, 0, SystemTime::now(), None);
        let a = t.upsert(ROOT_INO, "a", Kind::File, 3, SystemTime::now(), None);
        t.add_lookup(a);
        t.rebind(a, d, "b");
        assert!(t.child(ROOT_INO, "a").is_none());
        assert_eq!(t.child(d, "b").unwrap().key, "d/b");
    }
}
