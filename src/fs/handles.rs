//! Open files and directories: the handle table, what a file handle is doing (reading,
//! writing, committed), open, read and the last close (release).

use super::*;

pub(super) enum FileState {
    Read(Prefetcher),
    Write(Upload),
    /// The upload completed (close/fsync); a later write at the end of the object
    /// continues it (see `S3Fs::write`).
    Committed,
    /// The last upload through this handle failed: its data is not in S3, so writing on
    /// would build on a lost prefix; every further write gets EIO.
    Failed,
    /// The file was unlinked while open: writes vanish, as they would on a local disk.
    Discarded,
    /// The file is edited in place: reads and writes go to its staged copy, shared with
    /// every other handle of the inode (see `edit.rs`).
    Staged(edit::Staged),
}

/// Who wrote through a handle since its last commit, as the kernel names them: the lock
/// owner of each write (the writing process's table of open files, the same in every pid
/// namespace), where FUSE reports one (direct I/O does; page-cache writes do not).
#[derive(Default)]
pub(super) struct Writers {
    pub(super) owners: Vec<u64>,
    /// A write came without an owner, or from more owners than are worth tracking.
    pub(super) unnamed: bool,
}

impl Writers {
    const MAX_TRACKED: usize = 16;

    pub(super) fn note(&mut self, owner: Option<u64>) {
        match owner {
            Some(o) if self.owners.contains(&o) => {}
            Some(o) if self.owners.len() < Self::MAX_TRACKED => self.owners.push(o),
            _ => self.unnamed = true,
        }
    }

    /// Whether a close by `owner` commits: yes unless everything uncommitted was written
    /// by other owners, which still hold the descriptor or will flush when they close it
    /// (a forked child's exit closes an inherited descriptor it never wrote to, and must
    /// not cost the writer a commit). Nothing written yet also commits (an empty object,
    /// as O_TRUNC promises at close).
    pub(super) fn flush_commits(&self, owner: u64) -> bool {
        self.unnamed || self.owners.is_empty() || self.owners.contains(&owner)
    }
}

pub(super) struct OpenFile {
    /// Who wrote since the last commit: decides which closes commit.
    pub(super) writers: Writers,
    pub(super) ino: u64,
    pub(super) key: String,
    pub(super) writable: bool,
    pub(super) append: bool,
    /// Opened by create(): a close with nothing written may defer the empty PUT.
    pub(super) created: bool,
    pub(super) state: FileState,
}

#[derive(Clone)]
pub(super) enum Handle {
    File(Arc<tokio::sync::Mutex<OpenFile>>),
    Dir(Arc<tokio::sync::Mutex<DirStream>>),
}

impl S3Fs {
    pub(super) fn new_fh(&self, handle: Handle) -> u64 {
        let fh = self.next_fh.fetch_add(1, Ordering::Relaxed);
        lock(&self.handles).insert(fh, handle);
        fh
    }

    /// How many files (not directories) are open: the mounter's `s3csi_open_file_handles`.
    pub fn open_file_handles(&self) -> usize {
        lock(&self.handles)
            .values()
            .filter(|h| matches!(h, Handle::File(_)))
            .count()
    }

    /// The handle `fh`, if this mounter opened it. The table's lock is released before
    /// this returns: callers often need it again (remove) in the same statement's scope.
    pub(super) fn handle(&self, fh: u64) -> Option<Handle> {
        let handles = lock(&self.handles);
        handles.get(&fh).cloned()
    }

    pub(super) fn file_handle(&self, fh: u64) -> FsResult<Arc<tokio::sync::Mutex<OpenFile>>> {
        match self.handle(fh) {
            Some(Handle::File(f)) => Ok(f),
            _ => Err(FsError::BadHandle),
        }
    }

    pub async fn open(&self, ino: u64, mode: OpenMode) -> FsResult<u64> {
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
        let staged = if i.writer.is_some() {
            // A second writer, or a reader of a stream: all share one staged copy from now
            // on, so every descriptor sees every byte written.
            Some(self.stage_inode(ino, edit::NO_HANDLE).await?)
        } else {
            self.staged_of(ino)
        };
        let state = if let Some(s) = staged {
            if mode.write && mode.truncate {
                s.lock().await.truncate(0)?;
                if let Some(i) = self.inodes().get_mut(ino) {
                    i.size = 0;
                }
            }
            FileState::Staged(s)
        } else if mode.write && mode.truncate {
            FileState::Write(self.new_upload(i.key.clone()))
        } else {
            // Reads name the version they read (If-Match): one the table knows without its
            // ETag (just renamed: a copy may have a new one) is asked for first.
            let known = self.fresh(&i) && (i.etag.is_some() || i.being_written() || i.local_only);
            let size = if known {
                i.size
            } else {
                self.head_attr(ino, &i).await?.size
            };
            FileState::Read(self.prefetcher(&self.inode(ino)?, size))
        };
        let writing = matches!(state, FileState::Write(_));
        let fh = self.new_fh(Handle::File(Arc::new(tokio::sync::Mutex::new(OpenFile {
            writers: Writers::default(),
            ino,
            key: i.key.clone(),
            writable: mode.write,
            append: mode.append,
            created: false,
            state,
        }))));
        if writing {
            if let Err(e) = self.start_writing(ino, fh, 0) {
                lock(&self.handles).remove(&fh);
                return Err(e);
            }
        }
        if let Some(i) = self.inodes().get_mut(ino) {
            i.open_handles += 1;
        }
        Ok(fh)
    }

    /// The inode `name` in `parent` names, if this mount knows it (no request).
    pub fn child_ino(&self, parent: u64, name: &str) -> Option<u64> {
        self.inodes().child(parent, name).map(|i| i.ino)
    }

    /// For FUSE passthrough: the cache file that holds every byte of the version the
    /// read-only handle `fh` reads, when the kernel may read it by itself. Only for the
    /// inode's one open handle: once in passthrough, every open of the inode must be (see
    /// `passthrough.rs`), and the kernel refuses it beside a descriptor that could use the
    /// page cache (a shared mmap).
    pub async fn backing_file(&self, fh: u64) -> Option<std::fs::File> {
        if !self.cfg.passthrough || !self.sole_handle(fh) {
            return None;
        }
        let (cache, entry) = {
            let file = self.file_handle(fh).ok()?;
            let f = file.lock().await;
            let FileState::Read(p) = &f.state else {
                return None;
            };
            if f.writable {
                return None;
            }
            let (cache, entry) = p.cached()?;
            (cache.clone(), entry.clone())
        };
        // Checking blocks a predecessor wrote reads them: not on an async worker.
        tokio::task::spawn_blocking(move || entry.backing_file(&cache))
            .await
            .ok()
            .flatten()
    }

    /// Whether `fh` is the only open handle of its inode, and no writer is on it.
    pub fn sole_handle(&self, fh: u64) -> bool {
        let Some(Handle::File(file)) = self.handle(fh) else {
            return false;
        };
        let Ok(f) = file.try_lock() else {
            return false;
        };
        let t = self.inodes();
        t.get(f.ino)
            .is_some_and(|i| i.writer.is_none() && i.open_handles == 1)
    }

    /// A reader of the version of `i` this mount knows (key + ETag), `size` bytes long.
    pub(super) fn prefetcher(&self, i: &Inode, size: u64) -> Prefetcher {
        let p = Prefetcher::new(
            self.client.clone(),
            i.key.clone(),
            i.etag.clone(),
            size,
            self.cfg.prefetch,
            self.prefetch_budget.clone(),
        );
        let p = match self.data_cache.get() {
            Some(c) => p.with_cache(c),
            None => p,
        };
        match &self.memory_cache {
            Some(m) => p.with_memory(m.clone()),
            None => p,
        }
    }

    /// A read through handle `fh`. A file staged by any handle is read from its staged
    /// copy, so every descriptor sees every write; a handle streaming a new version
    /// turns it into a staged copy first. A reader whose object was replaced in S3 since
    /// it was opened gets ESTALE, never bytes of two versions.
    pub async fn read(&self, fh: u64, offset: u64, size: u32) -> FsResult<Bytes> {
        let file = self.file_handle(fh)?;
        let mut f = file.lock().await;
        let ino = f.ino;
        let staged = match &f.state {
            FileState::Staged(s) => Some(s.clone()),
            FileState::Write(_) => Some(self.stage_handle(&mut f, fh).await?),
            _ => self.staged_of(ino),
        };
        if let Some(s) = staged {
            f.state = FileState::Staged(s.clone());
            let mut staged = s.lock().await;
            return staged.read(&self.client, offset, size as u64).await;
        }
        if let FileState::Committed = f.state {
            let i = self.inode(ino)?;
            f.state = FileState::Read(self.prefetcher(&i, i.size));
        }
        let renamed = match &f.state {
            FileState::Read(p) => self.inodes().get(ino).is_some_and(|i| i.key != p.key()),
            _ => false,
        };
        if renamed {
            // Renamed while open: the same bytes, read from the copy under the new name.
            let i = self.inode(ino)?;
            let size = if self.fresh(&i) && i.etag.is_some() {
                i.size
            } else {
                self.head_attr(ino, &i).await?.size
            };
            f.key = i.key.clone();
            f.state = FileState::Read(self.prefetcher(&self.inode(ino)?, size));
        }
        match &mut f.state {
            FileState::Read(p) => {
                let fresh = !p.served_any();
                let r = p.read(offset, size).await;
                if let Err(FsError::Stale) = &r {
                    if let Some(i) = self.inodes().get_mut(ino) {
                        i.validated = None;
                    }
                    if fresh {
                        // Replaced before this descriptor returned a byte: nothing of the
                        // old version was seen, so it reads the current one.
                        return self.reread_current(&mut f, offset, size).await;
                    }
                    tracing::warn!(key = %f.key, "the object changed in S3 while open; ESTALE");
                }
                r
            }
            FileState::Discarded | FileState::Failed => Err(FsError::UploadFailed(S3Error::Other(
                "this descriptor's file was not uploaded".into(),
            ))),
            _ => unreachable!("staged and writing handles were handled above"),
        }
    }

    /// Looks the object up again and reads from its current version: for a reader that
    /// has returned nothing of the version it opened. A second change meanwhile is ESTALE.
    async fn reread_current(&self, f: &mut OpenFile, offset: u64, size: u32) -> FsResult<Bytes> {
        let i = self.inode(f.ino)?;
        let attr = self.head_attr(f.ino, &i).await?;
        tracing::debug!(key = %f.key, size = attr.size, "replaced in S3 before the first read; reading the new version");
        let mut p = self.prefetcher(&self.inode(f.ino)?, attr.size);
        let r = p.read(offset, size).await;
        f.state = FileState::Read(p);
        r
    }

    /// The last close of an open file. A handle this mounter does not know (opened
    /// before a predecessor died, see README "Mounts survive restarts") is released at once.
    pub async fn release(&self, fh: u64) -> FsResult<()> {
        let Some(Handle::File(file)) = self.handle(fh) else {
            lock(&self.handles).remove(&fh);
            return Ok(());
        };
        let mut f = file.lock().await;
        // Normally flush already committed; this covers handles closed without one (an
        // empty new file, or a descriptor last closed by another process). The handle stays
        // registered until the commit is done, so that `flush_all` on unmount waits for it.
        let mut result = self.commit(&mut f, fh, true).await;
        lock(&self.handles).remove(&fh);
        let last = {
            let mut t = self.inodes();
            t.get_mut(f.ino).is_none_or(|i| {
                i.open_handles = i.open_handles.saturating_sub(1);
                i.open_handles == 0
            })
        };
        if let FileState::Staged(s) = &f.state {
            result = result.and(self.release_staged(f.ino, s, last).await);
        }
        self.inodes().forget(f.ino, 0);
        result
    }
}
