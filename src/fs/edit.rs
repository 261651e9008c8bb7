//! Editing in place: when a file becomes staged (see `staging.rs`), how open handles share
//! its staged copy, and when that copy is committed and dropped.
//!
//! One staged copy per inode, shared by every handle of it: writes from several
//! descriptors land in one place, and reads through any descriptor see them. A handle
//! streaming a new version (`upload.rs`) that must give way (a write elsewhere than at its
//! end, a read, a second writer, a truncate) is turned into a staged copy: from its buffer
//! when nothing was sent yet, else by completing its upload first. A flush by a writer and
//! fsync commit the copy; it is dropped when the inode's last handle is released.

use super::cache::DataCache;
use super::staging::{CommitConfig, StagedFile, StagingArea};
use super::*;
use futures::StreamExt;

pub(super) type Staged = Arc<tokio::sync::Mutex<StagedFile>>;
type StagedGuard = tokio::sync::OwnedMutexGuard<StagedFile>;

/// An edit open while a rename moves its file: committed, so that S3 holds every byte
/// written so far and the rename copies them, and locked, so that nothing is written to
/// it or committed under the old name until `moved_edit` gives it the new one.
pub(super) struct HeldEdit {
    ino: u64,
    file: StagedGuard,
}

impl HeldEdit {
    pub(super) fn ino(&self) -> u64 {
        self.ino
    }

    pub(super) fn size(&self) -> u64 {
        self.file.size()
    }

    /// The version S3 holds of it (`None`: a store that gave no ETag).
    pub(super) fn etag(&self) -> Option<String> {
        self.file.base_etag().map(str::to_string)
    }
}

/// No handle: `stage_inode` for a caller that is not a handle of the file.
pub(super) const NO_HANDLE: u64 = 0;

/// `--write-back` uploads sent at once.
const WRITE_BACKS_IN_FLIGHT: usize = 16;
/// Longest wait before a failed write-back upload is tried again.
const WRITE_BACK_RETRY_MAX: Duration = Duration::from_secs(300);

impl S3Fs {
    /// The mount's staging area, created at first use (or by `open_staging`).
    pub(super) fn staging(&self) -> FsResult<&Arc<StagingArea>> {
        if let Some(a) = self.staging.get() {
            return Ok(a);
        }
        let area = match &self.cfg.cache_dir {
            Some(dir) => StagingArea::open(dir, self.cfg.cache_size),
            None => StagingArea::temporary(self.cfg.cache_size),
        }
        .map_err(|e| {
            tracing::error!(error = %e, "cannot open the staging directory (--cache-dir)");
            FsError::Local(e.to_string())
        })?;
        Ok(self.staging.get_or_init(|| area))
    }

    /// Opens the staging area now, so that edits a dead predecessor left are recovered
    /// (see `StagingArea::open`) when the mount starts, not at the first edit.
    pub fn open_staging(&self) -> FsResult<PathBuf> {
        let area = self.staging()?.clone();
        if let (true, Some(dir)) = (self.cfg.posix_metadata, &self.cfg.cache_dir) {
            let path = dir.join(KNOWN_VERSIONS_FILE);
            match self.inodes().persist_known_versions(&path) {
                Ok(n) => tracing::debug!(versions = n, "metadata of versions read before is known"),
                // The mount still works: first stats HEAD again.
                Err(e) => tracing::warn!(path = %path.display(), error = %e,
                    "cannot keep the metadata of versions read on disk"),
            }
        }
        if let (true, Some(dir)) = (self.cfg.data_cache, &self.cfg.cache_dir) {
            let staged = area.clone();
            let opened = DataCache::open(
                &dir.join("data"),
                self.cfg.cache_size,
                self.cfg.cache_free_percent,
                Box::new(move || staged.used()),
            );
            match opened {
                Ok(cache) => {
                    let weak = Arc::downgrade(&cache);
                    area.on_growth(Box::new(move || {
                        if let Some(c) = weak.upgrade() {
                            c.yield_to_edits();
                        }
                    }));
                    let _ = self.data_cache.set(cache);
                }
                // The mount still works, from S3 only.
                Err(e) => tracing::warn!(error = %e, "running without the data cache"),
            }
        }
        Ok(area.dir().to_path_buf())
    }

    /// The data cache, when `--data-cache` is on and its directory could be used.
    pub fn data_cache(&self) -> Option<&Arc<DataCache>> {
        self.data_cache.get()
    }

    /// `--cache-memory`'s cache, if it is on.
    pub fn memory_cache(&self) -> Option<&Arc<super::memcache::MemoryCache>> {
        self.memory_cache.as_ref()
    }

    fn commit_config(&self) -> CommitConfig {
        CommitConfig {
            client: self.client.clone(),
            part_size: self.cfg.part_size,
            concurrency: self.cfg.max_concurrency,
            budget: self.upload_budget.clone(),
            conditions: self.conditional_writes.clone(),
        }
    }

    pub(super) fn staged_of(&self, ino: u64) -> Option<Staged> {
        lock(&self.staged).get(&ino).cloned()
    }

    /// The staged copy of `ino`, made from the object as S3 holds it if there is none.
    /// A handle other than `me` streaming a new version is completed first (`me`'s own
    /// stream is the caller's to convert: it holds that handle's lock).
    pub(super) async fn stage_inode(&self, ino: u64, me: u64) -> FsResult<Staged> {
        loop {
            if let Some(s) = self.staged_of(ino) {
                return Ok(s);
            }
            let i = self.inode(ino)?;
            match i.writer {
                Some(w) if w != me => {
                    let file = self.file_handle(w)?;
                    let mut other = file.lock().await;
                    Box::pin(self.stage_handle(&mut other, w)).await?;
                }
                Some(_) => return Err(FsError::Busy("the handle's own upload is under way")),
                None => break,
            }
        }
        self.await_pending(ino).await?;
        let i = self.inode(ino)?;
        let (size, etag) = if i.local_only {
            (0, None)
        } else if self.fresh(&i) && i.etag.is_some() {
            (i.size, i.etag.clone())
        } else {
            match self.client.head_object(&i.key).await {
                Ok(m) => (m.size, m.etag),
                Err(S3Error::NotFound) => (0, None),
                Err(e) => return Err(e.into()),
            }
        };
        let file = StagedFile::of_object(self.staging()?, &i.key, size, etag)?;
        Ok(self.install_staged(ino, file, size))
    }

    /// Registers `file` as the staged copy of `ino`, unless another got there first.
    fn install_staged(&self, ino: u64, file: StagedFile, size: u64) -> Staged {
        let mut staged = lock(&self.staged);
        if let Some(s) = staged.get(&ino) {
            return s.clone();
        }
        let s = Arc::new(tokio::sync::Mutex::new(file));
        staged.insert(ino, s.clone());
        drop(staged);
        if let Some(i) = self.inodes().get_mut(ino) {
            i.staged = true;
            i.size = size;
        }
        s
    }

    /// Turns handle `f` (number `fh`) into a user of the inode's staged copy. A stream it
    /// was writing becomes that copy: moved over whole while nothing was sent, else
    /// completed (made durable) and staged from the result.
    pub(super) async fn stage_handle(&self, f: &mut OpenFile, fh: u64) -> FsResult<Staged> {
        if let FileState::Staged(s) = &f.state {
            return Ok(s.clone());
        }
        let ino = f.ino;
        if let FileState::Write(up) = &mut f.state {
            if up.can_truncate() {
                let create_only = up.is_create_only();
                let data = up.take_buffer();
                let mut file = StagedFile::of_bytes(self.staging()?, &f.key, &data)?;
                if create_only {
                    file.set_create_only();
                }
                let size = data.len() as u64;
                {
                    let mut t = self.inodes();
                    if let Some(i) = t.get_mut(ino).filter(|i| i.writer == Some(fh)) {
                        i.writer = None;
                    }
                }
                let s = self.install_staged(ino, file, size);
                f.state = FileState::Staged(s.clone());
                return Ok(s);
            }
            self.commit(f, fh, false).await?;
        }
        if matches!(f.state, FileState::Failed) {
            return Err(FsError::UploadFailed(S3Error::Other(
                "an earlier upload through this descriptor failed".into(),
            )));
        }
        let s = self.stage_inode(ino, fh).await?;
        f.state = FileState::Staged(s.clone());
        Ok(s)
    }

    /// Commits the staged copy `s` of `ino`. A conflict (another client replaced the
    /// object) keeps the edit in lost+found and drops the copy; any other failure keeps
    /// it, so that a later fsync or close can try again.
    pub(super) async fn commit_staged(&self, ino: u64, s: &Staged) -> FsResult<()> {
        self.commit_locked(ino, s, s.clone().lock_owned().await)
            .await
            .map(drop)
    }

    /// `commit_staged` of the copy `file` locks; it is handed back locked once committed.
    async fn commit_locked(
        &self,
        ino: u64,
        s: &Staged,
        mut file: StagedGuard,
    ) -> FsResult<StagedGuard> {
        // The metadata as it is now goes with the commit (see `meta_update.rs`).
        let meta_change = self.inode(ino).map(|i| i.meta_changes).unwrap_or(0);
        let headers = self.upload_headers(ino);
        match file.commit(&self.commit_config(), headers.as_ref()).await {
            Ok(None) => Ok(file),
            Ok(Some(meta)) => {
                if let (Some(cache), Some(etag)) = (self.data_cache.get(), &meta.etag) {
                    // The new version's local bytes: reading it back needs no GET.
                    let mut held = 0;
                    let pieces = file.local_blocks(super::cache::BLOCK, |n| {
                        let ok = cache.hold(n);
                        held += if ok { n } else { 0 };
                        ok
                    });
                    cache.unhold(held);
                    cache.offer_written(file.key(), etag, file.size(), pieces);
                }
                let mut t = self.inodes();
                t.now_in_s3(ino);
                if let Some(i) = t.get_mut(ino) {
                    i.size = meta.size;
                    i.etag = meta.etag;
                    i.mtime = SystemTime::now();
                    i.validated = Some(Instant::now());
                    i.meta_stamp = None;
                    i.mtime_from_writes = false;
                    if headers.is_some() {
                        i.meta_saved = i.meta_saved.max(meta_change);
                    }
                }
                drop(t);
                Ok(file)
            }
            Err(FsError::Conflict) => {
                tracing::error!(key = %file.key(),
                    "the object was replaced in S3 by another client while edited here; \
                     the edit is not committed (EIO)");
                file.keep_lost("another client replaced the object meanwhile");
                drop(file);
                self.unstage(ino, s);
                if let Some(i) = self.inodes().get_mut(ino) {
                    i.validated = None;
                }
                Err(FsError::Conflict)
            }
            Err(e) => {
                tracing::error!(key = %file.key(), error = %e,
                    "commit of an edited file failed; the edit stays staged for a retry");
                Err(e)
            }
        }
    }

    /// Forgets `s` as the staged copy of `ino` (handles holding it keep their reference).
    pub(super) fn unstage(&self, ino: u64, s: &Staged) {
        let mut staged = lock(&self.staged);
        if staged.get(&ino).is_some_and(|cur| Arc::ptr_eq(cur, s)) {
            staged.remove(&ino);
            drop(staged);
            let unsaved = {
                let mut t = self.inodes();
                t.get_mut(ino).is_some_and(|i| {
                    i.staged = false;
                    i.meta_changes != i.meta_saved && !i.being_written()
                })
            };
            if unsaved {
                // A chmod/utimes that came while staged, with no commit to carry it.
                self.schedule_save(ino);
            }
        }
    }

    /// The last close of a staged file: a final commit, then the copy goes. Data a
    /// final commit could not write is kept in lost+found. With `--write-back` the copy
    /// stays, kept for its upload (`settle_staged`).
    pub(super) async fn release_staged(&self, ino: u64, s: &Staged, last: bool) -> FsResult<()> {
        if !last {
            return Ok(());
        }
        if self.keeps_for_write_back(ino, s) {
            self.settle_staged(ino, s, false).await?;
            self.write_back_after_last_close(ino);
            return Ok(());
        }
        let result = self.commit_staged(ino, s).await;
        if let Err(e) = &result {
            if !matches!(e, FsError::Conflict) {
                s.lock()
                    .await
                    .keep_lost("the last close could not commit it");
            }
            if let Some(i) = self.inodes().get_mut(ino) {
                i.validated = None;
            }
        }
        self.unstage(ino, s);
        result
    }

    /// close(2) and fsync(2) of a staged file: commits it, or with `--write-back` keeps
    /// it on local disk (`durable`: synced, for fsync) for an upload `write_back` after
    /// the last close (`release_staged`, `run_write_back`). A copy no longer registered
    /// for its inode (unstaged while a handle still held it) is committed at once.
    pub(super) async fn settle_staged(&self, ino: u64, s: &Staged, durable: bool) -> FsResult<()> {
        if !self.keeps_for_write_back(ino, s) {
            return self.commit_staged(ino, s).await;
        }
        let headers = self.upload_headers(ino);
        s.lock()
            .await
            .keep_for_upload(&self.client, durable, headers)
            .await
    }

    pub(super) fn keeps_for_write_back(&self, ino: u64, s: &Staged) -> bool {
        self.cfg.write_back.is_some()
            && !self.stopping.load(Ordering::SeqCst)
            && lock(&self.staged)
                .get(&ino)
                .is_some_and(|cur| Arc::ptr_eq(cur, s))
    }

    /// Commits `s` now, then drops it unless a handle has the file open or wrote to the
    /// copy since (it is then committed again at its close).
    pub(super) async fn commit_and_drop_if_unused(&self, ino: u64, s: &Staged) -> FsResult<()> {
        self.commit_staged(ino, s).await?;
        let unused = self.inodes().get(ino).is_none_or(|i| i.open_handles == 0);
        if unused && !s.lock().await.is_dirty() {
            self.unstage(ino, s);
        }
        Ok(())
    }

    /// The last close of a kept edit: its upload is due `--write-back` from now.
    pub(super) fn write_back_after_last_close(&self, ino: u64) {
        self.schedule_write_back(ino, self.cfg.write_back.unwrap_or_default(), 0);
    }

    /// Due for upload `after` from now (an earlier due time is replaced: the delay runs
    /// from the last close); `failures`: uploads of it that failed so far.
    fn schedule_write_back(&self, ino: u64, after: Duration, failures: u32) {
        lock(&self.write_back).insert(ino, (Instant::now() + after, failures));
        self.write_back_wake.notify_one();
    }

    /// `--write-back`: uploads kept edits once due, several at once. A failed upload is
    /// tried again later (5 s, doubling to 5 min); a conflict goes to lost+found (see
    /// `commit_staged`); whatever is still kept at unmount is committed by `flush_all`.
    pub(super) async fn run_write_back(self: Arc<Self>) {
        loop {
            let now = Instant::now();
            let (due, next) = {
                let mut wb = lock(&self.write_back);
                let due: Vec<(u64, u32)> = wb
                    .iter()
                    .filter(|(_, (at, _))| *at <= now)
                    .map(|(ino, (_, n))| (*ino, *n))
                    .collect();
                for (ino, _) in &due {
                    wb.remove(ino);
                }
                (due, wb.values().map(|(at, _)| *at).min())
            };
            futures::stream::iter(due)
                .for_each_concurrent(WRITE_BACKS_IN_FLIGHT, |(ino, failures)| {
                    let fs = self.clone();
                    async move { fs.write_back_now(ino, failures).await }
                })
                .await;
            let wake = self.write_back_wake.notified();
            match next {
                Some(at) => {
                    tokio::select! {
                        _ = tokio::time::sleep_until(at.into()) => {}
                        _ = wake => {}
                    }
                }
                None => wake.await,
            }
        }
    }

    /// Uploads the kept edit of `ino` now; the copy goes once nobody has the file open.
    async fn write_back_now(&self, ino: u64, failures: u32) {
        let Some(s) = self.staged_of(ino) else {
            return;
        };
        match self.commit_and_drop_if_unused(ino, &s).await {
            Ok(()) | Err(FsError::Conflict) => {}
            Err(e) => {
                let retry = Duration::from_secs(5 << failures.min(6)).min(WRITE_BACK_RETRY_MAX);
                let key = s.lock().await.key().to_string();
                tracing::error!(key = %key, error = %e, retry_in = ?retry,
                    "write-back upload failed; the edit stays on local disk");
                self.schedule_write_back(ino, retry, failures + 1);
            }
        }
    }

    /// A kept edit of `ino` nobody has open is uploaded now and its copy dropped, for
    /// what cannot wait (rename copies the object in S3). False if it could not be.
    pub(super) async fn write_back_idle(&self, ino: u64) -> bool {
        let Some(s) = self.staged_of(ino) else {
            return true;
        };
        if self.cfg.write_back.is_none() || self.inode(ino).is_ok_and(|i| i.open_handles > 0) {
            return true;
        }
        lock(&self.write_back).remove(&ino);
        self.commit_and_drop_if_unused(ino, &s).await.is_ok()
    }

    /// Commits the edits a dead predecessor kept for upload (`--write-back`), before
    /// the mount serves: each is uploaded on the version it was made from, or kept in
    /// lost+found. Returns how many could not be uploaded.
    pub async fn upload_recovered(&self) -> usize {
        let Some(area) = self.staging.get() else {
            return 0;
        };
        let cfg = self.commit_config();
        let mut failed = 0;
        for mut file in area.take_recovered() {
            // A predecessor of an older version may have recorded no Content-Type.
            let meta = Some(self.typed(
                file.recovered_meta().cloned().unwrap_or_default(),
                file.key(),
            ));
            match file.commit(&cfg, meta.as_ref()).await {
                Ok(_) => {
                    tracing::info!(key = %file.key(), "uploaded an edit a previous mounter kept")
                }
                Err(e) => {
                    failed += 1;
                    tracing::error!(key = %file.key(), error = %e,
                        "cannot upload an edit a previous mounter kept");
                    file.keep_lost(&format!("upload after a mounter restart failed: {e}"));
                }
            }
        }
        failed
    }

    /// The edit of `ino`, a file being written (streamed or staged), committed and held
    /// for a rename (see `HeldEdit`): a stream is turned into the staged copy first.
    pub(super) async fn hold_open_edit(&self, ino: u64) -> FsResult<HeldEdit> {
        let s = self.stage_inode(ino, NO_HANDLE).await?;
        let file = self
            .commit_locked(ino, &s, s.clone().lock_owned().await)
            .await?;
        Ok(HeldEdit { ino, file })
    }

    /// The rename copied a held edit's object to `key`: the staged copy builds on that
    /// copy from now on (its ETag asked for: a copy's may differ from its source's).
    pub(super) async fn moved_edit(&self, mut held: HeldEdit, key: &str) {
        let etag = match self.client.head_object(key).await {
            Ok(m) => m.etag,
            Err(e) => {
                // Still correct, only dearer: the next commit re-uploads it whole.
                tracing::warn!(key, error = %e, "cannot read the ETag of a renamed open file");
                None
            }
        };
        if let Err(e) = held.file.rekey(key, etag.clone()) {
            tracing::warn!(key, error = %e, "cannot record the new name of a renamed open file");
        }
        if let Some(i) = self.inodes().get_mut(held.ino) {
            i.etag = etag;
            i.validated = Some(Instant::now());
        }
    }

    /// fallocate(2) on an open file (see `StagedFile::fallocate`).
    pub async fn fallocate(&self, fh: u64, offset: u64, len: u64, mode: i32) -> FsResult<()> {
        self.writable()?;
        let file = self.file_handle(fh)?;
        let mut f = file.lock().await;
        if !f.writable {
            return Err(FsError::BadHandle);
        }
        let s = self.stage_handle(&mut f, fh).await?;
        let mut staged = s.lock().await;
        staged.fallocate(offset, len, mode)?;
        let size = staged.size();
        drop(staged);
        if let Some(i) = self.inodes().get_mut(f.ino) {
            i.size = size;
            i.mtime = SystemTime::now();
        }
        Ok(())
    }
}
