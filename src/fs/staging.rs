//! Staged files: objects edited in place, kept in a sparse local file until committed.
//!
//! A file written anywhere but at the end of a streamed upload (`upload.rs`), truncated to
//! a size other than 0, or written by two descriptors at once is staged. The local file
//! holds the bytes written and the bytes read back so far ([`StagedFile::present`]); the
//! rest is still only in S3, in the version (key + ETag) the edit started from, and is
//! fetched by ranged GETs that name that ETag when a read or the commit needs it. Nothing
//! is ever loaded whole into memory.
//!
//! A commit (close, fsync) makes one new version of the object: one PUT when it fits in a
//! part, else a multipart upload whose parts nobody wrote are copied on the server from the
//! old version (UploadPartCopy) and whose written parts are uploaded from the local file,
//! so an append or an edit of a few places in a large object sends only those places. The
//! commit is conditional on the old version's ETag: an object another client replaced in
//! the meantime is never overwritten; the edit goes to `lost+found` instead.
//!
//! Space: every local byte counts against the area's limit (`--cache-size`). A write past
//! it fails with ENOSPC; bytes read back past it are served without being kept.

use super::error::{FsError, FsResult};
use super::ranges::RangeSet;
use super::upload::{UploadBudget, MIN_PART};
use crate::s3::{
    CompletedPart, ConditionalWrites, ObjectClient, ObjectMeta, S3Error, UserMeta, WriteCondition,
};
use bytes::Bytes;
use futures::StreamExt;
use serde::{Deserialize, Serialize};
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

/// Smallest ranged GET that brings back bytes of the old version: 4 KiB page reads of a
/// database then cost one GET per MiB, not one per page.
const FETCH_BLOCK: u64 = 1024 * 1024;
/// Fills (each waited for by a write or a read) after which a file up to
/// `WHOLE_FILL_MAX` is fetched whole: scattered edits (a database, 1000 random writes)
/// then wait for S3 a few times, not once per MiB they touch.
const FILLS_BEFORE_WHOLE: u32 = 4;
const WHOLE_FILL_MAX: u64 = 2 * 1024 * 1024 * 1024;
/// A fill's GETs: at most this long each, this many in flight.
const FILL_GET_MAX: u64 = 8 * 1024 * 1024;
const FILL_GETS_IN_FLIGHT: usize = 4;
/// Largest range one UploadPartCopy copies.
const COPY_PART: u64 = 512 * 1024 * 1024;
const MAX_PARTS: u64 = 10_000;
pub const LOST_FOUND: &str = "lost+found";

/// Where staged files live, and how much space they may take together.
pub struct StagingArea {
    dir: PathBuf,
    limit: u64,
    used: AtomicU64,
    next_id: AtomicU64,
    /// Removed with the area: a private directory nobody asked to keep.
    temporary: bool,
    /// Edits a dead predecessor kept for upload (`--write-back`), for the mount to commit.
    recovered: std::sync::Mutex<Vec<StagedFile>>,
    /// Told when staged files took more space (the data cache then makes room).
    on_growth: std::sync::OnceLock<Box<dyn Fn() + Send + Sync>>,
}

/// What a staged file's sidecar records, so that a replacement mounter knows what it finds.
#[derive(Debug, Serialize, Deserialize)]
struct Sidecar {
    key: String,
    base_etag: Option<String>,
    /// Everything local was committed: nothing is lost if the file is dropped.
    clean: bool,
    /// Write-back: the local file is the whole new version, to be uploaded even by a
    /// replacement mounter (see `StagedFile::keep_for_upload`).
    #[serde(default)]
    upload: bool,
    /// The user metadata that upload carries (the file's POSIX metadata).
    #[serde(default)]
    meta: Option<UserMeta>,
}

impl StagingArea {
    /// The area in `dir` (created, mode 0700). Staged files a dead predecessor left there
    /// are moved to `lost+found` when they held uncommitted data, else removed.
    pub fn open(dir: &Path, limit: u64) -> std::io::Result<Arc<Self>> {
        Self::open_as(dir.to_path_buf(), limit, false)
    }

    /// A private area in the system's temporary directory, removed when dropped.
    pub fn temporary(limit: u64) -> std::io::Result<Arc<Self>> {
        static N: AtomicU64 = AtomicU64::new(0);
        let dir = std::env::temp_dir().join(format!(
            "s3csi-staging-{}-{}",
            std::process::id(),
            N.fetch_add(1, Ordering::Relaxed)
        ));
        Self::open_as(dir, limit, true)
    }

    fn open_as(dir: PathBuf, limit: u64, temporary: bool) -> std::io::Result<Arc<Self>> {
        use std::os::unix::fs::DirBuilderExt;
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(&dir)?;
        let area = Self {
            dir,
            limit,
            used: AtomicU64::new(0),
            next_id: AtomicU64::new(1),
            temporary,
            recovered: Default::default(),
            on_growth: Default::default(),
        };
        let area = Arc::new(area);
        area.recover();
        Ok(area)
    }

    /// Edits a dead predecessor kept for upload, taken once (see `recover`).
    pub fn take_recovered(&self) -> Vec<StagedFile> {
        std::mem::take(&mut *self.recovered.lock().unwrap_or_else(|p| p.into_inner()))
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    pub fn used(&self) -> u64 {
        self.used.load(Ordering::Relaxed)
    }

    /// `f` is called whenever staged files take more space.
    pub fn on_growth(&self, f: Box<dyn Fn() + Send + Sync>) {
        let _ = self.on_growth.set(f);
    }

    fn reserve(&self, bytes: u64) -> bool {
        let mut used = self.used.load(Ordering::Relaxed);
        loop {
            if used.saturating_add(bytes) > self.limit {
                return false;
            }
            match self.used.compare_exchange_weak(
                used,
                used + bytes,
                Ordering::Relaxed,
                Ordering::Relaxed,
            ) {
                Ok(_) => break,
                Err(now) => used = now,
            }
        }
        if let Some(f) = self.on_growth.get() {
            f();
        }
        true
    }

    fn release(&self, bytes: u64) {
        let _ = self
            .used
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |u| {
                Some(u.saturating_sub(bytes))
            });
    }

    /// Staged files of a dead predecessor: committed ones are dropped; those kept for
    /// upload (`--write-back`: closed or fsync'd) wait in `recovered` for the mount to
    /// commit them; the others go to `lost+found` (we cannot tell whether their writer
    /// still wanted them).
    fn recover(self: &Arc<Self>) {
        let Ok(entries) = std::fs::read_dir(&self.dir) else {
            return;
        };
        let entries: Vec<PathBuf> = entries.flatten().map(|e| e.path()).collect();
        // New staged files must not reuse the name of one kept for upload.
        let last_id = entries
            .iter()
            .filter_map(|p| p.file_stem()?.to_str()?.parse::<u64>().ok())
            .max()
            .unwrap_or(0);
        self.next_id.fetch_max(last_id + 1, Ordering::Relaxed);
        for path in entries {
            if path.extension().is_none_or(|x| x != "json") {
                continue;
            }
            let data = path.with_extension("staged");
            let sidecar: Option<Sidecar> = std::fs::read(&path)
                .ok()
                .and_then(|b| serde_json::from_slice(&b).ok());
            match sidecar {
                Some(s) if !s.clean && s.upload && data.exists() => {
                    match StagedFile::kept_for_upload(self, data.clone(), s) {
                        Ok(f) => {
                            tracing::info!(key = %f.key,
                                "an edit a previous mounter kept for upload is uploaded now");
                            lock_vec(&self.recovered).push(f);
                            continue;
                        }
                        Err(e) => tracing::warn!(error = %e, file = %data.display(),
                            "cannot reopen an edit kept for upload; it stays in the cache dir"),
                    }
                    continue;
                }
                Some(s) if !s.clean && data.exists() => {
                    match self.keep_lost(&data, &s.key, s.base_etag.as_deref(), "mounter restart") {
                        Ok(at) => tracing::warn!(key = %s.key, saved = %at.display(),
                            "an edit a previous mounter never committed is kept in lost+found"),
                        Err(e) => tracing::warn!(key = %s.key, error = %e,
                            "cannot keep an uncommitted edit in lost+found"),
                    }
                }
                _ => {}
            }
            let _ = std::fs::remove_file(&data);
            let _ = std::fs::remove_file(&path);
        }
    }

    /// Moves `data` to `lost+found` as `<seconds>-<key with / as %2F>`, with a note
    /// `<that name>.note.json` naming the key (appended, not an extension replaced: an edit
    /// of `x.json` would otherwise be overwritten by its own note); returns where it went.
    fn keep_lost(
        &self,
        data: &Path,
        key: &str,
        base_etag: Option<&str>,
        why: &str,
    ) -> std::io::Result<PathBuf> {
        let dir = self.dir.join(LOST_FOUND);
        std::fs::create_dir_all(&dir)?;
        let secs = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_secs())
            .unwrap_or(0);
        let mut name: String = format!("{secs}-{}", key.replace('%', "%25").replace('/', "%2F"));
        name.truncate(200);
        let mut at = dir.join(&name);
        let mut n = 1;
        while at.exists() || lost_note(&at).exists() {
            at = dir.join(format!("{name}.{n}"));
            n += 1;
        }
        std::fs::rename(data, &at)?;
        let note = serde_json::json!({
            "key": key,
            "edited_version_etag": base_etag,
            "why": why,
            "note": "bytes of the edited version that were never read through the mount are zeros here",
        });
        std::fs::write(lost_note(&at), note.to_string())?;
        Ok(at)
    }
}

/// The note beside an edit kept in `lost+found`.
pub fn lost_note(kept: &Path) -> PathBuf {
    let mut name = kept.as_os_str().to_owned();
    name.push(".note.json");
    PathBuf::from(name)
}

fn lock_vec<T>(m: &std::sync::Mutex<Vec<T>>) -> std::sync::MutexGuard<'_, Vec<T>> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl Drop for StagingArea {
    fn drop(&mut self) {
        if self.temporary {
            let _ = std::fs::remove_dir_all(&self.dir);
        }
    }
}

/// How commits reach S3.
#[derive(Clone)]
pub struct CommitConfig {
    pub client: Arc<dyn ObjectClient>,
    pub part_size: u64,
    pub concurrency: usize,
    pub budget: UploadBudget,
    pub conditions: Arc<ConditionalWrites>,
}

pub struct StagedFile {
    area: Arc<StagingArea>,
    path: PathBuf,
    file: File,
    key: String,
    /// The version this edit builds on, named in every GET and in the commit's condition;
    /// `None`: no such condition (a new file, or a store that gave no ETag).
    base_etag: Option<String>,
    /// Bytes below this offset that are not local are the base version's, fetched on
    /// demand; unwritten bytes above it are zeros (truncated away, or never existed).
    fetch_limit: u64,
    size: u64,
    /// Bytes held by the local file (written, or read back from S3).
    present: RangeSet,
    /// Bytes written since the last commit.
    dirty: RangeSet,
    /// The size changed since the last commit.
    resized: bool,
    /// The file was unlinked: nothing is committed any more.
    discarded: bool,
    /// What the sidecar says now.
    sidecar_clean: bool,
    /// The sidecar says "upload this" (see `keep_for_upload`).
    sidecar_upload: bool,
    /// The metadata recorded with it.
    meta: Option<UserMeta>,
    /// A new file created `O_EXCL`: its first commit is refused if the key exists by then.
    create_only: bool,
    /// Fills that sent a GET (see `FILLS_BEFORE_WHOLE`).
    fills: u32,
}

impl StagedFile {
    /// Stages the object `key` of `size` bytes in its version `etag` (`None`: a store
    /// without ETags; the object is then read back without a condition).
    pub fn of_object(
        area: &Arc<StagingArea>,
        key: &str,
        size: u64,
        etag: Option<String>,
    ) -> FsResult<Self> {
        let mut f = Self::create(area, key, etag)?;
        f.size = size;
        f.fetch_limit = size;
        f.file.set_len(size).map_err(local_io)?;
        f.write_sidecar()?;
        Ok(f)
    }

    /// Stages a file whose whole content is `data` (a new file still in memory): nothing
    /// needs to be read back, and it is dirty until committed.
    pub fn of_bytes(area: &Arc<StagingArea>, key: &str, data: &[u8]) -> FsResult<Self> {
        let mut f = Self::create(area, key, None)?;
        f.sidecar_clean = true;
        f.write(0, data)?;
        f.resized = true;
        Ok(f)
    }

    fn create(area: &Arc<StagingArea>, key: &str, etag: Option<String>) -> FsResult<Self> {
        let id = area.next_id.fetch_add(1, Ordering::Relaxed);
        let path = area.dir.join(format!("{id}.staged"));
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .open(&path)
            .map_err(local_io)?;
        Ok(Self {
            area: area.clone(),
            path,
            file,
            key: key.to_string(),
            base_etag: etag,
            fetch_limit: 0,
            size: 0,
            present: RangeSet::default(),
            dirty: RangeSet::default(),
            resized: false,
            discarded: false,
            sidecar_clean: true,
            sidecar_upload: false,
            meta: None,
            create_only: false,
            fills: 0,
        })
    }

    /// The first commit is made with `If-None-Match: *` (an `O_EXCL` create).
    pub fn set_create_only(&mut self) {
        self.create_only = true;
    }

    /// A file a dead predecessor kept for upload (see `keep_for_upload`): the local file
    /// is the whole new version, all of it to be uploaded.
    fn kept_for_upload(area: &Arc<StagingArea>, path: PathBuf, s: Sidecar) -> FsResult<Self> {
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(&path)
            .map_err(local_io)?;
        let size = file.metadata().map_err(local_io)?.len();
        area.used.fetch_add(size, Ordering::Relaxed);
        let mut all = RangeSet::default();
        all.insert(0, size);
        Ok(Self {
            area: area.clone(),
            path,
            file,
            key: s.key,
            base_etag: s.base_etag,
            fetch_limit: size,
            size,
            present: all.clone(),
            dirty: all,
            resized: true,
            discarded: false,
            sidecar_clean: false,
            sidecar_upload: true,
            meta: s.meta,
            create_only: false,
            fills: 0,
        })
    }

    /// The user metadata a recovered edit carries (`kept_for_upload`).
    pub fn recovered_meta(&self) -> Option<&UserMeta> {
        self.meta.as_ref()
    }

    /// Write-back (`--write-back`): marks the edit for upload by whoever runs next, should
    /// this mount die before its upload. The base version's bytes are fetched first, so
    /// that the local file alone is the new version (ENOSPC where they do not fit);
    /// `durable` also syncs it to disk, as fsync(2) asks. `meta`: the metadata the upload
    /// is to carry.
    pub async fn keep_for_upload(
        &mut self,
        client: &Arc<dyn ObjectClient>,
        durable: bool,
        meta: Option<UserMeta>,
    ) -> FsResult<()> {
        if !self.is_dirty() || self.discarded {
            return Ok(());
        }
        self.fetch_all(client).await?;
        if durable {
            self.file.sync_data().map_err(local_io)?;
        }
        if !self.sidecar_upload || self.meta != meta {
            self.meta = meta;
            self.save_sidecar(false, true, durable)?;
        }
        Ok(())
    }

    fn write_sidecar(&mut self) -> FsResult<()> {
        self.save_sidecar(!self.is_dirty(), false, false)
    }

    /// The sidecar says "dirty" before the first uncommitted byte is acknowledged.
    fn mark_dirty(&mut self) -> FsResult<()> {
        if self.sidecar_clean && !self.discarded {
            self.save_sidecar(false, false, false)?;
        }
        Ok(())
    }

    /// Replaces the sidecar (atomically: written aside, then renamed over it); `durable`
    /// syncs it to disk first. The metadata is recorded only with `upload`.
    fn save_sidecar(&mut self, clean: bool, upload: bool, durable: bool) -> FsResult<()> {
        let s = Sidecar {
            key: self.key.clone(),
            base_etag: self.base_etag.clone(),
            clean,
            upload,
            meta: if upload { self.meta.clone() } else { None },
        };
        let json = serde_json::to_vec(&s).map_err(|e| FsError::Local(e.to_string()))?;
        let at = self.path.with_extension("json");
        let tmp = self.path.with_extension("json.tmp");
        let written = std::fs::File::create(&tmp).and_then(|mut f| {
            use std::io::Write;
            f.write_all(&json)?;
            if durable {
                f.sync_all()?;
            }
            std::fs::rename(&tmp, &at)
        });
        written.map_err(local_io)?;
        self.sidecar_clean = clean;
        self.sidecar_upload = upload;
        Ok(())
    }

    pub fn size(&self) -> u64 {
        self.size
    }

    pub fn key(&self) -> &str {
        &self.key
    }

    pub fn base_etag(&self) -> Option<&str> {
        self.base_etag.as_deref()
    }

    /// The object was moved (renamed) to `key`, where S3 holds the version this copy
    /// builds on as `etag`: reads and commits go there from now on.
    pub fn rekey(&mut self, key: &str, etag: Option<String>) -> FsResult<()> {
        self.key = key.to_string();
        self.base_etag = etag;
        let (clean, upload) = (self.sidecar_clean, self.sidecar_upload);
        self.save_sidecar(clean, upload, false)
    }

    pub fn is_dirty(&self) -> bool {
        !self.discarded && (self.resized || !self.dirty.is_empty())
    }

    pub fn discard(&mut self) {
        self.discarded = true;
    }

    /// The object is about to be deleted while descriptors still use this copy (unlink
    /// of an open file): every byte of the version it builds on is fetched first, so that
    /// the local file alone is the file from now on (ENOSPC where the bytes do not fit);
    /// then nothing is committed any more, and a crash leaves nothing to recover. The copy
    /// goes at the last close.
    pub async fn keep_unlinked(&mut self, client: &Arc<dyn ObjectClient>) -> FsResult<()> {
        self.fetch_all(client).await?;
        self.fetch_limit = 0;
        self.discarded = true;
        self.save_sidecar(true, false, false)
    }

    /// Fetches every byte of the base version not yet local: ENOSPC where they do not fit.
    async fn fetch_all(&mut self, client: &Arc<dyn ObjectClient>) -> FsResult<()> {
        if !self.fill(client, 0, self.fetch_limit).await?.is_empty() {
            return Err(FsError::NoSpace);
        }
        Ok(())
    }

    /// A write from the application: the rest of each `FETCH_BLOCK` it touches is read
    /// back first (the commit needs those bytes anyway), so the local file never holds a
    /// written range whose neighbours are unknown — what `lost+found` keeps is then
    /// whole around every edit.
    pub async fn write_through(
        &mut self,
        client: &Arc<dyn ObjectClient>,
        offset: u64,
        data: &[u8],
    ) -> FsResult<usize> {
        let end = offset
            .checked_add(data.len() as u64)
            .ok_or(FsError::TooBig)?;
        let block_start = offset - offset % FETCH_BLOCK;
        let block_end = end.div_ceil(FETCH_BLOCK).saturating_mul(FETCH_BLOCK);
        for (s, e) in [(block_start, offset), (end, block_end)] {
            if s < e {
                // Bytes that do not fit are not kept; the write below then decides ENOSPC.
                self.fill(client, s, e).await?;
            }
        }
        self.write(offset, data)
    }

    pub fn write(&mut self, offset: u64, data: &[u8]) -> FsResult<usize> {
        let end = offset
            .checked_add(data.len() as u64)
            .ok_or(FsError::TooBig)?;
        let new = (data.len() as u64) - self.present.covered(offset, end);
        if !self.area.reserve(new) {
            tracing::warn!(key = %self.key, used = self.area.used(), limit = self.area.limit,
                "staging space exhausted (--cache-size); the write gets ENOSPC");
            return Err(FsError::NoSpace);
        }
        self.mark_dirty()?;
        if let Err(e) = self.file.write_all_at(data, offset) {
            self.area.release(new);
            return Err(local_io(e));
        }
        self.present.insert(offset, end);
        self.dirty.insert(offset, end);
        if end > self.size {
            self.size = end;
        }
        Ok(data.len())
    }

    /// truncate(2) to `size`: shrinking drops what lies beyond; growing adds zeros.
    pub fn truncate(&mut self, size: u64) -> FsResult<()> {
        if size == self.size {
            return Ok(());
        }
        self.mark_dirty()?;
        self.file.set_len(size).map_err(local_io)?;
        if size < self.size {
            let freed = self.present.truncate(size);
            self.dirty.truncate(size);
            self.area.release(freed);
            self.fetch_limit = self.fetch_limit.min(size);
        }
        self.size = size;
        self.resized = true;
        Ok(())
    }

    /// fallocate(2): mode 0 and KEEP_SIZE reserve nothing S3 could honour, so they only
    /// grow the file (mode 0); PUNCH_HOLE and ZERO_RANGE write zeros.
    pub fn fallocate(&mut self, offset: u64, len: u64, mode: i32) -> FsResult<()> {
        let end = offset.checked_add(len).ok_or(FsError::TooBig)?;
        let keep_size = mode & libc::FALLOC_FL_KEEP_SIZE != 0;
        match mode & !libc::FALLOC_FL_KEEP_SIZE {
            0 => {
                if !keep_size && end > self.size {
                    self.truncate(end)?;
                }
                Ok(())
            }
            libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_ZERO_RANGE => {
                let end = if keep_size { end.min(self.size) } else { end };
                let zeros = vec![0u8; FETCH_BLOCK as usize];
                let mut at = offset;
                while at < end {
                    let n = (end - at).min(FETCH_BLOCK);
                    self.write(at, &zeros[..n as usize])?;
                    at += n;
                }
                Ok(())
            }
            _ => Err(FsError::Unsupported("this fallocate mode")),
        }
    }

    /// The blocks of `block` bytes (the last one shorter) whose every byte is local, read,
    /// for as long as `take` allows each one: what the data cache may keep of this content
    /// once committed. Bytes above the fetch limit are local zeros.
    pub fn local_blocks(&self, block: u64, mut take: impl FnMut(u64) -> bool) -> Vec<(u64, Bytes)> {
        let mut out = Vec::new();
        let mut at = 0;
        while at < self.size {
            let end = (at + block).min(self.size);
            let base_end = end.min(self.fetch_limit);
            let local = at >= base_end || self.present.covered(at, base_end) == base_end - at;
            if local && take(end - at) {
                let mut buf = vec![0u8; (end - at) as usize];
                if self.file.read_exact_at(&mut buf, at).is_err() {
                    break;
                }
                out.push((at, Bytes::from(buf)));
            } else if local {
                break;
            }
            at = end;
        }
        out
    }

    /// Bytes `offset..offset+len` (clipped to the size), fetching from the base version
    /// what is not local.
    pub async fn read(
        &mut self,
        client: &Arc<dyn ObjectClient>,
        offset: u64,
        len: u64,
    ) -> FsResult<Bytes> {
        if offset >= self.size || len == 0 {
            return Ok(Bytes::new());
        }
        let end = (offset + len).min(self.size);
        let unkept = self.fill(client, offset, end).await?;
        let mut buf = vec![0u8; (end - offset) as usize];
        self.file
            .read_exact_at(&mut buf, offset)
            .map_err(local_io)?;
        for (at, bytes) in unkept {
            let from = at.max(offset);
            let to = (at + bytes.len() as u64).min(end);
            if from < to {
                buf[(from - offset) as usize..(to - offset) as usize]
                    .copy_from_slice(&bytes[(from - at) as usize..(to - at) as usize]);
            }
        }
        Ok(buf.into())
    }

    /// Makes `start..end` local where it is the base version's, in GETs of at least
    /// `FETCH_BLOCK`. Bytes that do not fit in the area's space are returned instead.
    async fn fill(
        &mut self,
        client: &Arc<dyn ObjectClient>,
        start: u64,
        end: u64,
    ) -> FsResult<Vec<(u64, Bytes)>> {
        let mut unkept = Vec::new();
        let (mut start, mut limit) = (start, end.min(self.fetch_limit));
        if start >= limit || self.present.covered(start, limit) == limit - start {
            return Ok(unkept);
        }
        let missing = self.fetch_limit - self.present.covered(0, self.fetch_limit);
        if self.fills >= FILLS_BEFORE_WHOLE
            && self.fetch_limit <= WHOLE_FILL_MAX
            && self.area.used() + missing <= self.area.limit
        {
            (start, limit) = (0, self.fetch_limit);
        }
        self.fills += 1;
        let mut gets: Vec<(u64, u64)> = Vec::new();
        for (s, e) in self.present.gaps(start, limit) {
            let s = s - s % FETCH_BLOCK;
            let e = e
                .div_ceil(FETCH_BLOCK)
                .saturating_mul(FETCH_BLOCK)
                .min(self.fetch_limit);
            match gets.last_mut() {
                Some(last) if last.1 >= s => last.1 = last.1.max(e),
                _ => gets.push((s, e)),
            }
        }
        let pieces = gets.into_iter().flat_map(|(s, e)| {
            (s..e)
                .step_by(FILL_GET_MAX as usize)
                .map(move |at| (at, (at + FILL_GET_MAX).min(e)))
        });
        // Owned copies: the stream must not borrow `self`, which each answer changes.
        let (key, etag) = (self.key.clone(), self.base_etag.clone());
        let (key, etag) = (&key, &etag);
        let mut bodies = futures::stream::iter(pieces)
            .map(|(s, e)| async move {
                let body = match etag {
                    Some(etag) => client.get_range_if_match(key, etag, s, e).await,
                    None => client.get_range(key, s, e).await,
                };
                (s, e, body)
            })
            .buffered(FILL_GETS_IN_FLIGHT);
        while let Some((s, e, body)) = bodies.next().await {
            let body = body.map_err(|err| match err {
                S3Error::PreconditionFailed | S3Error::NotFound => FsError::Stale,
                other => FsError::S3(other),
            })?;
            if body.len() as u64 != e - s {
                tracing::warn!(key = %self.key, want = e - s, got = body.len(),
                    "short body from S3 for an edited object");
                return Err(FsError::Stale);
            }
            // Only the bytes not written meanwhile: a fetch never overwrites an edit.
            let mut all_kept = true;
            for (gs, ge) in self.present.gaps(s, e) {
                let piece = &body[(gs - s) as usize..(ge - s) as usize];
                if !self.area.reserve(ge - gs) {
                    all_kept = false;
                    continue;
                }
                if let Err(err) = self.file.write_all_at(piece, gs) {
                    self.area.release(ge - gs);
                    return Err(local_io(err));
                }
                self.present.insert(gs, ge);
            }
            if !all_kept {
                // What was not kept is still not present: overlay it on the answer only.
                unkept.push((s, body));
            }
        }
        Ok(unkept)
    }

    /// Makes the local content the object's new version, carrying `meta` as its user
    /// metadata (the file's POSIX metadata, see `meta_update.rs`). `Ok(None)`: nothing to
    /// commit. A version replaced in S3 by another client is `Conflict`: nothing is
    /// overwritten.
    pub async fn commit(
        &mut self,
        cfg: &CommitConfig,
        meta: Option<&UserMeta>,
    ) -> FsResult<Option<ObjectMeta>> {
        if !self.is_dirty() {
            return Ok(None);
        }
        let part = segment_size(cfg.part_size, self.size);
        let meta = if self.size <= part {
            match self.read(&cfg.client, 0, self.size).await {
                Ok(body) => {
                    self.conditional(cfg, |c, cond| {
                        let body = body.clone();
                        let key = self.key.clone();
                        async move { c.put_object_if(&key, body, cond.as_ref(), meta).await }
                    })
                    .await
                }
                Err(e) => Err(e),
            }
        } else {
            self.commit_multipart(cfg, part, meta).await
        };
        let meta = meta.map_err(|e| match e {
            // The old version is gone: either its copy or reading it back failed.
            FsError::S3(S3Error::PreconditionFailed) | FsError::Stale => FsError::Conflict,
            other => other,
        })?;
        self.base_etag = meta.etag.clone();
        self.fetch_limit = self.size;
        self.dirty.clear();
        self.resized = false;
        self.write_sidecar()?;
        Ok(Some(meta))
    }

    /// Runs a write on the condition that the base version is still there (or, for a
    /// create, that nothing is), as far as the store honours conditions.
    async fn conditional<F, Fut>(&self, cfg: &CommitConfig, send: F) -> FsResult<ObjectMeta>
    where
        F: Fn(Arc<dyn ObjectClient>, Option<WriteCondition>) -> Fut,
        Fut: std::future::Future<Output = Result<ObjectMeta, S3Error>>,
    {
        let cond = match &self.base_etag {
            Some(etag) => Some(WriteCondition::IfMatch(etag.clone())),
            // Not for an empty body: moto never answers a conditional PUT of one.
            None if self.create_only && self.size > 0 => Some(WriteCondition::IfNoneMatch),
            None => None,
        };
        cfg.conditions
            .send(cond, |cond| send(cfg.client.clone(), cond))
            .await
            .map_err(FsError::S3)
    }

    async fn commit_multipart(
        &mut self,
        cfg: &CommitConfig,
        part: u64,
        meta: Option<&UserMeta>,
    ) -> FsResult<ObjectMeta> {
        let plan = self.plan(part);
        let id = match meta {
            Some(m) => cfg.client.create_multipart_with_meta(&self.key, m).await?,
            None => cfg.client.create_multipart(&self.key).await?,
        };
        let result = self.send_parts(cfg, &id, plan).await;
        let parts = match result {
            Ok(p) => p,
            Err(e) => {
                let _ = cfg.client.abort_multipart(&self.key, &id).await;
                return Err(e);
            }
        };
        let key = self.key.clone();
        let done = self
            .conditional(cfg, |c, cond| {
                let (key, id, parts) = (key.clone(), id.clone(), parts.clone());
                async move {
                    c.complete_multipart_if(&key, &id, parts, cond.as_ref())
                        .await
                }
            })
            .await;
        if done.is_err() {
            let _ = cfg.client.abort_multipart(&self.key, &id).await;
        }
        done
    }

    /// The parts of the new version: runs of segments nobody wrote, below the fetch
    /// limit, are copied from the old version; every other segment is uploaded.
    fn plan(&self, part: u64) -> Vec<Part> {
        let mut plan: Vec<Part> = Vec::new();
        let mut at = 0;
        while at < self.size {
            let end = (at + part).min(self.size);
            let copyable = self.base_etag.is_some()
                && end <= self.fetch_limit
                && !self.dirty.intersects(at, end);
            match plan.last_mut() {
                Some(Part::Copy(_, e)) if copyable && *e == at => *e = end,
                _ if copyable => plan.push(Part::Copy(at, end)),
                _ => plan.push(Part::Upload(at, end)),
            }
            at = end;
        }
        // Copies of at most COPY_PART, split evenly so each stays above S3's part minimum.
        plan.into_iter()
            .flat_map(|p| match p {
                Part::Copy(s, e) if e - s > COPY_PART => {
                    let n = (e - s).div_ceil(COPY_PART);
                    let chunk = (e - s).div_ceil(n);
                    (0..n)
                        .map(|i| Part::Copy(s + i * chunk, (s + (i + 1) * chunk).min(e)))
                        .collect::<Vec<_>>()
                }
                p => vec![p],
            })
            .collect()
    }

    async fn send_parts(
        &mut self,
        cfg: &CommitConfig,
        id: &str,
        plan: Vec<Part>,
    ) -> FsResult<Vec<CompletedPart>> {
        let slots = Arc::new(tokio::sync::Semaphore::new(cfg.concurrency.max(1)));
        let mut tasks = tokio::task::JoinSet::new();
        for (i, p) in plan.into_iter().enumerate() {
            let n = i as i32 + 1;
            let (client, key, id) = (cfg.client.clone(), self.key.clone(), id.to_string());
            let slot = slots.clone().acquire_owned().await.expect("never closed");
            match p {
                Part::Copy(s, e) => {
                    let etag = self.base_etag.clone();
                    tasks.spawn(async move {
                        let r = client
                            .upload_part_copy(&key, &id, n, &key, etag.as_deref(), s, e)
                            .await;
                        drop(slot);
                        r
                    });
                }
                Part::Upload(s, e) => {
                    let body = self.read(&cfg.client, s, e - s).await;
                    let body = match body {
                        Ok(b) => b,
                        Err(err) => {
                            tasks.abort_all();
                            return Err(err);
                        }
                    };
                    let share = cfg.budget.take_for(body.len()).await;
                    tasks.spawn(async move {
                        let r = client.upload_part(&key, &id, n, body).await;
                        drop((share, slot));
                        r
                    });
                }
            }
        }
        let mut parts = Vec::new();
        while let Some(r) = tasks.join_next().await {
            let part = r.map_err(|e| FsError::S3(S3Error::Other(format!("part task: {e}"))))??;
            parts.push(part);
        }
        parts.sort_by_key(|p| p.part_number);
        Ok(parts)
    }

    /// After a conflict or a final failure: keeps the local data in `lost+found`.
    pub fn keep_lost(&mut self, why: &str) -> Option<PathBuf> {
        let at = self
            .area
            .keep_lost(&self.path, &self.key, self.base_etag.as_deref(), why);
        match at {
            Ok(at) => {
                tracing::error!(key = %self.key, saved = %at.display(), reason = why,
                    "the edit was not committed; its data is kept in lost+found");
                self.discarded = true;
                Some(at)
            }
            Err(e) => {
                tracing::error!(key = %self.key, error = %e, reason = why,
                    "the edit was not committed and could not be kept in lost+found");
                None
            }
        }
    }
}

impl Drop for StagedFile {
    fn drop(&mut self) {
        self.area.release(self.present.total());
        let _ = std::fs::remove_file(&self.path);
        let _ = std::fs::remove_file(self.path.with_extension("json"));
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Part {
    Copy(u64, u64),
    Upload(u64, u64),
}

/// The commit's part size: the mount's, or larger where 10 000 parts would not cover
/// the file, in whole MiB, never below S3's minimum.
fn segment_size(part_size: u64, size: u64) -> u64 {
    let need = size.div_ceil(MAX_PARTS).div_ceil(1 << 20) << 20;
    part_size.max(need).max(MIN_PART)
}

fn local_io(e: std::io::Error) -> FsError {
    tracing::warn!(error = %e, "staging file I/O failed");
    if e.raw_os_error() == Some(libc::ENOSPC) {
        FsError::NoSpace
    } else {
        FsError::Local(e.to_string())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::s3::mem::MemClient;

    const MIB: u64 = 1024 * 1024;

    fn pattern(n: u64, seed: u8) -> Vec<u8> {
        (0..n).map(|i| (i % 251) as u8 ^ seed).collect()
    }

    fn cfg(mem: &Arc<MemClient>) -> CommitConfig {
        CommitConfig {
            client: mem.clone(),
            part_size: 5 * MIB,
            concurrency: 4,
            budget: UploadBudget::new(64 * MIB),
            conditions: Default::default(),
        }
    }

    async fn staged(mem: &Arc<MemClient>, area: &Arc<StagingArea>, key: &str) -> StagedFile {
        let m = mem.head_object(key).await.unwrap();
        StagedFile::of_object(area, key, m.size, m.etag).unwrap()
    }

    #[tokio::test]
    async fn edits_in_three_places_copy_the_rest_on_the_server() {
        let mem = Arc::new(MemClient::new());
        let old = pattern(40 * MIB, 0);
        mem.insert("big", old.clone());
        let area = StagingArea::temporary(u64::MAX).unwrap();
        let mut f = staged(&mem, &area, "big").await;
        let mut want = old.clone();
        for at in [3 * MIB + 7, 20 * MIB, 40 * MIB - 2] {
            f.write(at, b"EDIT").unwrap();
            let at = at as usize;
            want.resize(want.len().max(at + 4), 0);
            want[at..at + 4].copy_from_slice(b"EDIT");
        }
        let before = mem.bytes_received();
        f.commit(&cfg(&mem), None).await.unwrap().unwrap();
        assert_eq!(mem.get("big").unwrap().as_ref(), &want[..]);
        let sent = mem.bytes_received() - before;
        assert!(
            sent <= 3 * 5 * MIB + 4,
            "uploaded {sent} bytes for three edits"
        );
        assert!(area.used() <= 3 * 5 * MIB + 8, "kept {} bytes", area.used());
        assert_eq!(mem.open_uploads(), 0);
    }

    #[tokio::test]
    async fn scattered_writes_fetch_the_whole_file_after_a_few_fills() {
        let mem = Arc::new(MemClient::new());
        let old = pattern(30 * MIB, 3);
        mem.insert("db", old.clone());
        let area = StagingArea::temporary(u64::MAX).unwrap();
        let client: Arc<dyn ObjectClient> = mem.clone();
        let mut f = staged(&mem, &area, "db").await;
        let mut want = old.clone();
        let ats = (0..=FILLS_BEFORE_WHOLE as u64).map(|i| i * 7 * MIB / 2 + 4096 * i);
        for (n, at) in ats.enumerate() {
            f.write_through(&client, at, b"PAGE").await.unwrap();
            want[at as usize..at as usize + 4].copy_from_slice(b"PAGE");
            let whole = f.present.covered(0, f.size) == f.size;
            assert_eq!(whole, n as u32 == FILLS_BEFORE_WHOLE, "after write {n}");
        }
        // Every later write and read is local; nothing fetched overwrote an edit.
        assert_eq!(&f.read(&client, 0, 30 * MIB).await.unwrap()[..], &want[..]);
        f.commit(&cfg(&mem), None).await.unwrap().unwrap();
        assert_eq!(mem.get("db").unwrap().as_ref(), &want[..]);
    }

    /// Past `WHOLE_FILL_MAX` (or the space left), fills stay the size of what is asked.
    #[tokio::test]
    async fn a_file_that_does_not_fit_is_never_fetched_whole() {
        let mem = Arc::new(MemClient::new());
        mem.insert("big", pattern(20 * MIB, 4));
        let area = StagingArea::temporary(12 * MIB).unwrap();
        let client: Arc<dyn ObjectClient> = mem.clone();
        let mut f = staged(&mem, &area, "big").await;
        for i in 0..8 {
            f.write_through(&client, i * 2 * MIB + 10, b"x")
                .await
                .unwrap();
        }
        assert_eq!(f.present.covered(0, f.size), 8 * MIB);
    }

    #[tokio::test]
    async fn truncate_shrink_grow_and_read_back() {
        let mem = Arc::new(MemClient::new());
        mem.insert("k", pattern(100, 1));
        let area = StagingArea::temporary(u64::MAX).unwrap();
        let mut f = staged(&mem, &area, "k").await;
        f.truncate(10).unwrap();
        f.truncate(20).unwrap();
        let got = f
            .read(&(mem.clone() as Arc<dyn ObjectClient>), 0, 100)
            .await
            .unwrap();
        let mut want = pattern(10, 1);
        want.resize(20, 0);
        assert_eq!(got.as_ref(), &want[..]);
        f.commit(&cfg(&mem), None).await.unwrap();
        assert_eq!(mem.get("k").unwrap().as_ref(), &want[..]);
    }

    /// The note is beside the kept edit, never over it: an edit of `d.json` once became
    /// `<secs>-d.json` and its note was written to the same path.
    #[tokio::test]
    async fn a_kept_edit_of_a_json_file_keeps_its_bytes_beside_its_note() {
        let mem = Arc::new(MemClient::new());
        mem.insert("d.json", pattern(100, 1));
        let area = StagingArea::temporary(u64::MAX).unwrap();
        let mut f = staged(&mem, &area, "d.json").await;
        f.write(5, b"mine").unwrap();
        let at = f.keep_lost("test").unwrap();
        assert_eq!(&std::fs::read(&at).unwrap()[5..9], b"mine");
        let note = std::fs::read_to_string(lost_note(&at)).unwrap();
        assert!(note.contains("\"key\":\"d.json\""), "{note}");
    }

    #[tokio::test]
    async fn a_version_replaced_meanwhile_is_never_overwritten() {
        let mem = Arc::new(MemClient::new());
        for size in [100, 12 * MIB] {
            mem.insert("k", pattern(size, 1));
            let area = StagingArea::temporary(u64::MAX).unwrap();
            let mut f = staged(&mem, &area, "k").await;
            f.write(5, b"mine").unwrap();
            let theirs = pattern(size, 9);
            mem.insert("k", theirs.clone());
            let r = f.commit(&cfg(&mem), None).await;
            assert!(matches!(r, Err(FsError::Conflict)), "{size}: {r:?}");
            assert_eq!(mem.get("k").unwrap().as_ref(), &theirs[..]);
            assert_eq!(mem.open_uploads(), 0);
            let at = f.keep_lost("test").unwrap();
            let kept = std::fs::read(&at).unwrap();
            assert_eq!(&kept[5..9], b"mine");
            let note = std::fs::read_to_string(lost_note(&at)).unwrap();
            assert!(note.contains("\"key\":\"k\""), "{note}");
        }
    }

    #[tokio::test]
    async fn writes_past_the_space_limit_are_enospc_reads_still_work() {
        let mem = Arc::new(MemClient::new());
        mem.insert("k", pattern(4 * MIB, 3));
        let area = StagingArea::temporary(MIB + 10).unwrap();
        let mut f = staged(&mem, &area, "k").await;
        f.write(0, &vec![1u8; MIB as usize]).unwrap();
        assert!(matches!(
            f.write(2 * MIB, &[0u8; 100]),
            Err(FsError::NoSpace)
        ));
        let client: Arc<dyn ObjectClient> = mem.clone();
        let got = f.read(&client, 2 * MIB, MIB).await.unwrap();
        assert_eq!(
            got.as_ref(),
            &pattern(4 * MIB, 3)[2 * MIB as usize..3 * MIB as usize]
        );
        drop(f);
        assert_eq!(area.used(), 0, "space returned when the staged file goes");
    }

    #[tokio::test]
    async fn reads_of_a_replaced_version_are_stale_not_mixed() {
        let mem = Arc::new(MemClient::new());
        mem.insert("k", pattern(3 * MIB, 1));
        let area = StagingArea::temporary(u64::MAX).unwrap();
        let mut f = staged(&mem, &area, "k").await;
        let client: Arc<dyn ObjectClient> = mem.clone();
        f.read(&client, 0, 10).await.unwrap();
        mem.insert("k", pattern(3 * MIB, 2));
        assert!(matches!(
            f.read(&client, 2 * MIB, 10).await,
            Err(FsError::Stale)
        ));
        assert_eq!(
            f.read(&client, 0, 10).await.unwrap().as_ref(),
            &pattern(10, 1)[..]
        );
    }

    #[test]
    fn leftovers_of_a_dead_mounter_go_to_lost_found_when_dirty() {
        let dir =
            std::env::temp_dir().join(format!("s3csi-staging-recover-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        {
            let area = StagingArea::open(&dir, u64::MAX).unwrap();
            let mut dirty = StagedFile::of_object(&area, "a/dirty", 0, None).unwrap();
            dirty.write(0, b"unsaved").unwrap();
            let clean = StagedFile::of_object(&area, "a/clean", 0, None).unwrap();
            // A crash: neither is dropped.
            std::mem::forget(dirty);
            std::mem::forget(clean);
        }
        let area = StagingArea::open(&dir, u64::MAX).unwrap();
        let lost: Vec<String> = std::fs::read_dir(area.dir().join(LOST_FOUND))
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        assert_eq!(lost.len(), 2, "{lost:?}");
        assert!(lost.iter().any(|n| n.ends_with("a%2Fdirty")), "{lost:?}");
        let left: Vec<_> = std::fs::read_dir(area.dir())
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .filter(|n| n != LOST_FOUND)
            .collect();
        assert!(left.is_empty(), "{left:?}");
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[tokio::test]
    async fn an_edit_kept_for_upload_is_made_whole_and_recovered_for_its_upload() {
        let dir = std::env::temp_dir().join(format!("s3csi-staging-kept-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let mem = Arc::new(MemClient::new());
        let old = pattern(3 * MIB, 1);
        mem.put_object("k", old.clone().into()).await.unwrap();
        let client: Arc<dyn ObjectClient> = mem.clone();
        {
            let area = StagingArea::open(&dir, u64::MAX).unwrap();
            let mut f = staged(&mem, &area, "k").await;
            f.write(MIB + 5, b"EDIT").unwrap();
            let meta: UserMeta = [("mode".to_string(), "33188".to_string())].into();
            f.keep_for_upload(&client, true, Some(meta)).await.unwrap();
            assert_eq!(
                f.present.total(),
                3 * MIB,
                "the base version's bytes were fetched"
            );
            std::mem::forget(f); // a crash
        }
        let area = StagingArea::open(&dir, u64::MAX).unwrap();
        let mut kept = area.take_recovered();
        assert_eq!(kept.len(), 1);
        let mut f = kept.pop().unwrap();
        let other = StagedFile::of_object(&area, "x", 0, None).unwrap();
        assert_ne!(
            other.path, f.path,
            "a new staged file does not take a kept one's name"
        );
        assert_eq!(f.recovered_meta().unwrap()["mode"], "33188");
        let meta = f.recovered_meta().cloned();
        f.commit(&cfg(&mem), meta.as_ref()).await.unwrap().unwrap();
        let mut want = old;
        want[(MIB + 5) as usize..(MIB + 9) as usize].copy_from_slice(b"EDIT");
        let now = mem.get_range("k", 0, 3 * MIB).await.unwrap();
        assert!(now[..] == want[..], "S3 holds the whole edited file");
        assert!(area.take_recovered().is_empty());
        let _ = std::fs::remove_dir_all(&dir);
    }
}
