//! The writer: create, writes (a new object streamed by `upload.rs`, or one continued at
//! its end), the closes that commit it (flush, fsync, release), truncation, and the
//! completion of every upload at unmount.

use super::*;

impl S3Fs {
    pub(super) fn new_upload(&self, key: String) -> Upload {
        Upload::new(
            self.client.clone(),
            key,
            self.cfg.part_size,
            self.cfg.max_concurrency,
            self.upload_budget.clone(),
        )
        .keep_for(self.data_cache.get())
    }

    /// Registers a writer on `ino` whose object starts `size` bytes long, failing if
    /// another handle already writes it.
    pub(super) fn start_writing(&self, ino: u64, fh: u64, size: u64) -> FsResult<()> {
        let mut t = self.inodes();
        let i = t.get_mut(ino).ok_or(FsError::NotFound)?;
        if i.writer.is_some_and(|w| w != fh) {
            return Err(FsError::Busy("the file is already open for writing"));
        }
        i.writer = Some(fh);
        i.size = size;
        Ok(())
    }

    /// Undoes `start_writing` after the upload could not start.
    pub(super) fn stop_writing(&self, ino: u64, fh: u64) {
        let mut t = self.inodes();
        if let Some(i) = t.get_mut(ino).filter(|i| i.writer == Some(fh)) {
            i.writer = None;
            i.validated = None;
        }
    }

    pub async fn create(&self, parent: u64, name: &str, mode: OpenMode) -> FsResult<(Attr, u64)> {
        self.writable()?;
        check_name(name)?;
        let p = self.dir_inode(parent)?;
        let key = format!("{}{}", p.key, name);
        if key.len() > MAX_KEY_LEN {
            return Err(FsError::NameTooLong);
        }
        let known = self
            .inodes()
            .child(parent, name)
            .map(|c| (c.ino, c.kind == Kind::File && c.being_written()));
        if let Some((ino, writing)) = known {
            if writing {
                // `>` onto a file another descriptor writes: its descriptors share one
                // staged copy, emptied here (as O_TRUNC on an open file does).
                if mode.exclusive {
                    return Err(FsError::Exists);
                }
                let truncate = OpenMode {
                    write: true,
                    truncate: true,
                    ..mode
                };
                let fh = self.open(ino, truncate).await?;
                return Ok((self.attr_of(&self.inode(ino)?), fh));
            }
            // A new version must not be overtaken by the empty PUT of the previous one; if
            // that PUT failed, the name is gone and this creates it afresh.
            let _ = self.await_pending(ino).await;
        }
        let ino = {
            let mut t = self.inodes();
            if let Some(existing) = t.child(parent, name) {
                if existing.kind == Kind::Dir {
                    return Err(FsError::IsDir);
                }
                if existing.being_written() {
                    return Err(FsError::Busy("the file is already open for writing"));
                }
            }
            t.create_local(parent, name, Kind::File)
                .ok_or(FsError::NotFound)?
        };
        let fh = self.new_fh(Handle::File(Arc::new(tokio::sync::Mutex::new(OpenFile {
            writers: Writers::default(),
            ino,
            key: key.clone(),
            writable: true,
            append: mode.append,
            created: true,
            state: FileState::Write(match mode.exclusive {
                true => self
                    .new_upload(key)
                    .create_only(self.conditional_writes.clone()),
                false => self.new_upload(key),
            }),
        }))));
        let mut t = self.inodes();
        let i = t.get_mut(ino).ok_or(FsError::NotFound)?;
        i.writer = Some(fh);
        i.open_handles += 1;
        i.lookups += 1;
        Ok((self.attr_of(i), fh))
    }

    /// A write through handle `fh` by lock owner `owner` (see `Writers`).
    ///
    /// A handle that is not writing yet (opened without O_TRUNC), or whose upload a close
    /// or fsync completed, may go on writing at the end of the object: a new upload then
    /// starts from the version of the object this mount knows (`continue_upload`), so
    /// appends, `{ a; b; } > f` with its several closes, and writes after fsync all work,
    /// each close making what was written so far durable. Writes anywhere else in an
    /// existing object are refused (EOPNOTSUPP).
    pub async fn write(
        &self,
        fh: u64,
        offset: u64,
        data: &[u8],
        owner: Option<u64>,
    ) -> FsResult<usize> {
        self.writable()?;
        let file = self.file_handle(fh)?;
        let mut f = file.lock().await;
        if !f.writable {
            return Err(FsError::BadHandle);
        }
        let ino = f.ino;
        let stage = match &f.state {
            FileState::Staged(_) => true,
            FileState::Write(up) => offset != up.written() || self.staged_of(ino).is_some(),
            FileState::Read(_) | FileState::Committed => {
                // Whatever this writes must land after the file's empty object, if its PUT
                // is still under way, and the size below is the one it made.
                self.await_pending(ino).await?;
                let base = self.inode(ino)?;
                offset != base.size || base.being_written() || self.staged_of(ino).is_some()
            }
            FileState::Failed | FileState::Discarded => false,
        };
        if stage {
            let s = self.stage_handle(&mut f, fh).await?;
            let mut staged = s.lock().await;
            // O_APPEND: at the end of the staged copy, whatever the kernel thought the size was.
            let at = if f.append { staged.size() } else { offset };
            let n = staged.write_through(&self.client, at, data).await?;
            let size = staged.size();
            drop(staged);
            if let Some(i) = self.inodes().get_mut(ino) {
                i.size = size;
                i.mtime = SystemTime::now();
                i.mtime_from_writes = i.meta.is_some();
            }
            f.writers.note(owner);
            return Ok(n);
        }
        match &f.state {
            FileState::Read(_) | FileState::Committed => {
                let base = self.inode(ino)?;
                self.start_writing(ino, fh, base.size)?;
                // The inode's key, not the handle's: the file may have been renamed since.
                let mut up = self.new_upload(base.key.clone());
                up.set_meta(self.upload_headers(ino));
                if let Err(e) = self.continue_upload(&mut up, &base).await {
                    self.stop_writing(ino, fh);
                    return Err(e);
                }
                f.state = FileState::Write(up);
            }
            FileState::Failed => {
                tracing::warn!(key = %f.key, "write after this handle's upload failed");
                return Err(FsError::UploadFailed(S3Error::Other(
                    "an earlier upload through this descriptor failed".into(),
                )));
            }
            FileState::Write(_) | FileState::Discarded | FileState::Staged(_) => {}
        }
        match &mut f.state {
            FileState::Write(up) => {
                if !up.has_meta() {
                    up.set_meta(self.upload_headers(ino));
                }
                let n = up.write(offset, data).await.inspect_err(|e| {
                    tracing::warn!(key = %up.key(), offset, error = %e, "write refused");
                })?;
                let written = up.written();
                if let Some(i) = self.inodes().get_mut(ino) {
                    i.size = written;
                    i.mtime = SystemTime::now();
                    i.mtime_from_writes = i.meta.is_some();
                }
                f.writers.note(owner);
                Ok(n)
            }
            FileState::Discarded => Ok(data.len()),
            _ => unreachable!("a writer was started above"),
        }
    }

    /// Makes `up` begin with the object `base` as this mount last saw it (key + ETag):
    /// nothing to do for an empty one; a short one (below S3's 5 MiB minimum part) is read
    /// back and sent again, a longer one copied on the server (UploadPartCopy). Both ask
    /// for that exact version, so an object another client replaced in the meantime is
    /// never mixed into ours: the write fails (EIO) and S3 keeps the other client's data.
    pub(super) async fn continue_upload(&self, up: &mut Upload, base: &Inode) -> FsResult<()> {
        if base.size == 0 {
            return Ok(());
        }
        let etag = match &base.etag {
            Some(e) => e.clone(),
            None => {
                let meta = self.client.head_object(&base.key).await?;
                match meta.etag {
                    Some(e) if meta.size == base.size => e,
                    _ => return Err(FsError::S3(S3Error::PreconditionFailed)),
                }
            }
        };
        up.continue_from(base.size, &etag).await.inspect_err(|e| {
            tracing::warn!(key = %base.key, size = base.size, error = %e,
                "could not continue the object (changed in S3 by another client?)");
        })
    }

    /// close() of a descriptor of `fh` by lock owner `owner`: completes the upload of a
    /// handle that is writing, unless only other owners wrote since the last commit (see
    /// `Writers::flush_commits`; release commits whatever is left). Errors mean the data
    /// is NOT in S3 and must reach the application. A flush before anything was written
    /// commits an empty object (durable at close for an existing file; a new file does
    /// not wait for its PUT, see `defer_empty`, but closing any other descriptor of it
    /// does). Writes after a commit continue the object (see `write`): shells that open,
    /// `dup2` and close the original descriptor before writing, or whose children close
    /// an inherited descriptor, end up with everything every process wrote.
    pub async fn flush(&self, fh: u64, owner: u64) -> FsResult<()> {
        let file = self.file_handle(fh)?;
        let mut f = file.lock().await;
        if let FileState::Write(_) | FileState::Staged(_) = &f.state {
            if !f.writers.flush_commits(owner) {
                tracing::debug!(key = %f.key, owner, "close by an owner that did not write; not committing");
                return Ok(());
            }
        }
        if let FileState::Staged(s) = &f.state {
            let s = s.clone();
            f.writers = Writers::default();
            return self.settle_staged(f.ino, &s, false).await;
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
    pub(super) async fn commit(&self, f: &mut OpenFile, fh: u64, may_defer: bool) -> FsResult<()> {
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
            f.writers = Writers::default();
            return Ok(());
        }
        let FileState::Write(up) = &mut f.state else {
            return Ok(());
        };
        let ino = f.ino;
        // The metadata as it is now goes with the upload (see `meta_update.rs`).
        let meta_change = self.inode(ino).map(|i| i.meta_changes).unwrap_or(0);
        up.set_meta(self.upload_headers(ino));
        let result = up.finish().await;
        let meta_in_s3 = up.meta_in_s3();
        f.state = if result.is_ok() {
            FileState::Committed
        } else {
            FileState::Failed
        };
        f.writers = Writers::default();
        let mut t = self.inodes();
        let unlinked = t.get(ino).is_none_or(|i| i.writer != Some(fh));
        if result.is_ok() {
            t.now_in_s3(ino);
        }
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
                    i.meta_stamp = None;
                    i.mtime_from_writes = false;
                    if meta_in_s3 {
                        i.meta_saved = i.meta_saved.max(meta_change);
                    }
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
        let resave = t.get(ino).is_some_and(|i| i.meta_changes != i.meta_saved);
        drop(t);
        if result.is_ok() && resave {
            // A multipart upload started with older metadata, or a change came meanwhile.
            self.schedule_save(ino);
        }
        if let Err(FsError::UploadFailed(S3Error::PreconditionFailed)) = &result {
            tracing::error!(key = %f.key,
                "another client created or replaced the object meanwhile (an O_EXCL create, \
                 or writing on after a commit): theirs is kept, the application gets EIO");
        } else if let Err(e) = &result {
            tracing::error!(key = %f.key, error = %e, "upload failed; the application gets EIO");
        } else if unlinked {
            tracing::debug!(key = %f.key, "file was unlinked or replaced while being written");
        }
        result.map(|_| ())
    }

    pub async fn fsync(&self, fh: u64) -> FsResult<()> {
        let file = match self.handle(fh) {
            Some(Handle::File(f)) => f,
            Some(Handle::Dir(_)) => return Ok(()),
            None => return Err(FsError::BadHandle),
        };
        let mut f = file.lock().await;
        if let FileState::Staged(s) = &f.state {
            let s = s.clone();
            return self.settle_staged(f.ino, &s, true).await;
        }
        self.commit(&mut f, fh, false).await?;
        self.await_pending(f.ino).await?;
        self.save_meta(f.ino).await
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
        let staged: Vec<(u64, edit::Staged)> = lock(&self.staged)
            .iter()
            .map(|(ino, s)| (*ino, s.clone()))
            .collect();
        for (ino, s) in staged {
            if self.commit_staged(ino, &s).await.is_err() {
                s.lock()
                    .await
                    .keep_lost("the mount stopped before it could be committed");
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
        failed += self.save_all_meta().await;
        failed + self.deletes.drain().await
    }

    /// The size part of setattr (modes, owners and times: `meta_update.rs`).
    /// Truncation to any size works: to 0 of a file nobody writes is one empty PUT, of a
    /// stream that sent nothing yet a reset; anything else stages the file (see
    /// `edit.rs`). A truncate by path with no handle (`truncate -s`) commits at once; one
    /// through a descriptor, at its close.
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
        if let Some(writer_fh) = i.writer.filter(|_| self.staged_of(ino).is_none()) {
            let file = self.file_handle(fh.unwrap_or(writer_fh))?;
            let mut f = file.lock().await;
            if let FileState::Write(up) = &mut f.state {
                if size == up.written() {
                    return Ok(self.attr_of(&self.inode(ino)?));
                }
                if size == 0 && up.can_truncate() {
                    up.truncate()?;
                    let mut t = self.inodes();
                    let i = t.get_mut(ino).ok_or(FsError::NotFound)?;
                    i.size = 0;
                    i.mtime = SystemTime::now();
                    i.mtime_from_writes = i.meta.is_some();
                    return Ok(self.attr_of(i));
                }
            }
        }
        if i.writer.is_none() && self.staged_of(ino).is_none() {
            let current = self.getattr(ino).await?;
            if current.size == size {
                return Ok(current);
            }
            if size == 0 {
                // A size change is a change of the data: mtime and ctime are now, also in
                // the stored metadata that goes with the PUT.
                if let Some(i) = self.inodes().get_mut(ino) {
                    i.mtime = SystemTime::now();
                    i.mtime_from_writes = i.meta.is_some();
                }
                let meta = match self.upload_headers(ino) {
                    Some(h) => {
                        self.client
                            .put_object_with_meta(&i.key, Bytes::new(), &h)
                            .await?
                    }
                    None => self.client.put_object(&i.key, Bytes::new()).await?,
                };
                let mut t = self.inodes();
                let i = t.get_mut(ino).ok_or(FsError::NotFound)?;
                i.size = 0;
                i.etag = meta.etag;
                i.validated = Some(Instant::now());
                i.mtime_from_writes = false; // the PUT stored it
                return Ok(self.attr_of(i));
            }
        }
        let own = match fh.map(|fh| (fh, self.file_handle(fh))) {
            Some((fh, Ok(file))) => Some((fh, file)),
            _ => None,
        };
        let s = match &own {
            Some((fh, file)) => {
                let mut f = file.lock().await;
                self.stage_handle(&mut f, *fh).await?
            }
            None => self.stage_inode(ino, edit::NO_HANDLE).await?,
        };
        s.lock().await.truncate(size)?;
        {
            let mut t = self.inodes();
            if let Some(i) = t.get_mut(ino) {
                i.size = size;
                i.mtime = SystemTime::now();
                i.mtime_from_writes = i.meta.is_some();
            }
        }
        if own.is_none() && self.keeps_for_write_back(ino, &s) {
            self.settle_staged(ino, &s, false).await?;
            if self.inodes().get(ino).is_some_and(|i| i.open_handles == 0) {
                self.write_back_after_last_close(ino);
            }
        } else if own.is_none() {
            // No descriptor will close this: make it durable now.
            self.commit_and_drop_if_unused(ino, &s).await?;
        }
        Ok(self.attr_of(&self.inode(ino)?))
    }
}
