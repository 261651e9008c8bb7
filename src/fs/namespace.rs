//! Changes to the namespace: mkdir, rmdir, unlink and rename (of files, and of directories
//! by copying every object under them on the server).

use super::*;
use crate::s3::S3Result;
use futures::StreamExt;

impl S3Fs {
    pub async fn mkdir(&self, parent: u64, name: &str) -> FsResult<Attr> {
        self.mkdir_as(parent, name, None).await
    }

    /// mkdir whose marker carries the mode (after the umask) and the creator's ids, when
    /// stored metadata is honoured.
    pub async fn mkdir_as(
        &self,
        parent: u64,
        name: &str,
        mode: Option<(u32, super::meta_update::Creator)>,
    ) -> FsResult<Attr> {
        self.writable()?;
        check_name(name)?;
        let p = self.dir_inode(parent)?;
        if let Some(existing) = self.inodes().child(parent, name) {
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
        // As s3fs: the marker's mode has no S_IFDIR (its trailing `/` says it).
        let m = mode
            .filter(|_| self.cfg.posix_metadata)
            .map(|(mode, who)| super::meta_update::new_meta(mode & 0o7777, who));
        let headers = self.typed(m.as_ref().map(|m| m.to_headers()).unwrap_or_default(), &key);
        self.client
            .put_object_with_meta(&key, Bytes::new(), &headers)
            .await?;
        let mut t = self.inodes();
        let ino = t.upsert(parent, name, Kind::Dir, 0, SystemTime::now(), None);
        t.entries_changed(parent);
        t.add_lookup(ino);
        let i = t.get_mut(ino).ok_or(FsError::NotFound)?;
        if self.cfg.posix_metadata {
            i.meta = Some(Arc::new(m.unwrap_or_default()));
        }
        // Nothing existed under it a moment ago: the new directory is known to be empty.
        i.complete_as_of = Some(probed_at);
        Ok(self.attr_of(i))
    }

    pub async fn rmdir(&self, parent: u64, name: &str) -> FsResult<()> {
        self.writable()?;
        check_existing_name(name)?;
        let p = self.dir_inode(parent)?;
        let key = format!("{}{}/", p.key, name);
        if let Some(child) = self.inodes().child(parent, name) {
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
                start_after: None,
                max_keys: 2,
            })
            .await?;
        let legacy = self
            .inodes()
            .child(parent, name)
            .and_then(|c| c.legacy_marker.clone());
        if let Some(legacy) = legacy {
            // An older s3fs directory object marks it (a marker `dir/` may exist too).
            let local_children = {
                let t = self.inodes();
                t.child(parent, name).is_some_and(|d| {
                    t.children_of(d.ino)
                        .any(|c| c.local_only || c.being_written())
                })
            };
            if page.objects.iter().any(|o| o.key != key)
                || !page.prefixes.is_empty()
                || local_children
            {
                return Err(FsError::NotEmpty);
            }
            if !page.objects.is_empty() {
                self.deletes.delete_now(&key).await?;
            }
            self.deletes.delete_now(&legacy).await?;
            self.inodes().remove_here(parent, name);
            return Ok(());
        }
        if page.objects.is_empty() && page.prefixes.is_empty() {
            if self.probe(&p.key, name).await?.is_some() {
                return Err(FsError::NotDir);
            }
            // An implicit directory (no marker, only the keys under it) whose last entries
            // were just removed is gone from S3 already: that is what the caller asked for
            // (`rm -r` of a tree another client wrote removes each file, then rmdir).
            let known_dir = self
                .inodes()
                .child(parent, name)
                .is_some_and(|c| c.kind == Kind::Dir);
            if known_dir {
                self.inodes().remove_here(parent, name);
                return Ok(());
            }
            return Err(FsError::NotFound);
        }
        if page.objects.iter().any(|o| o.key != key) {
            return Err(FsError::NotEmpty);
        }
        {
            let t = self.inodes();
            if let Some(dir) = t.child(parent, name) {
                let dino = dir.ino;
                if t.children_of(dino)
                    .any(|c| c.local_only || c.being_written())
                {
                    return Err(FsError::NotEmpty);
                }
            }
        }
        self.client.delete_object(&key).await?;
        self.inodes().remove_here(parent, name);
        Ok(())
    }

    /// Replaces the older s3fs object that marks directory `ino` (if one does) with a
    /// marker `dir/` carrying the same metadata: a PUT, then a DELETE of the old object.
    async fn retire_legacy_marker(&self, ino: u64) -> FsResult<()> {
        let Some((key, legacy, headers)) = self.inodes().get(ino).and_then(|i| {
            let legacy = i.legacy_marker.clone()?;
            let headers = i.meta.as_ref().map(|m| m.to_headers()).unwrap_or_default();
            Some((i.key.clone(), legacy, headers))
        }) else {
            return Ok(());
        };
        let headers = self.typed(headers, &key);
        self.client
            .put_object_with_meta(&key, Bytes::new(), &headers)
            .await?;
        self.deletes.delete_now(&legacy).await?;
        if let Some(i) = self.inodes().get_mut(ino) {
            i.legacy_marker = None;
        }
        Ok(())
    }

    pub async fn unlink(&self, parent: u64, name: &str) -> FsResult<()> {
        self.writable()?;
        check_existing_name(name)?;
        let p = self.dir_inode(parent)?;
        let known = self.inodes().child(parent, name).cloned();
        let child = match known {
            Some(c) => c,
            None => self.resolve(parent, name).await?,
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
                let put_done = async move {
                    let _ = put.outcome().await;
                };
                self.deletes.delete_after(&key, put_done).await?;
                self.inodes().remove_here(parent, name);
                return Ok(());
            }
        }
        let child = self
            .inodes()
            .child(parent, name)
            .cloned()
            .ok_or(FsError::NotFound)?;
        self.detach_from_its_name(child.ino).await;
        let child = self.inode(child.ino)?;
        if !child.local_only {
            self.client
                .delete_object(&format!("{}{}", p.key, name))
                .await?;
        }
        self.inodes().remove_here(parent, name);
        Ok(())
    }

    /// `ino` loses its name (unlink, or a rename onto it): descriptors that have it open
    /// keep it (`keep_while_open`); where that fails, what they write reaches no object
    /// (`abandon_writes`).
    async fn detach_from_its_name(&self, ino: u64) {
        let open = self.inode(ino).is_ok_and(|i| i.open_handles > 0);
        if open && self.keep_while_open(ino).await {
            return;
        }
        // As it is now: a failed keep may have staged it.
        if let Ok(i) = self.inode(ino) {
            self.abandon_writes(&i).await;
        }
    }

    /// `ino` is unlinked while open: as on a local disk, its descriptors go on reading
    /// and writing it until the last close. The file becomes its staged copy with every
    /// byte fetched (a stream being written moves there, or completes first if it had sent
    /// parts), which is never committed and goes at the last close. False where it could
    /// not be kept (the bytes do not fit under `--cache-size`, no staging area, an S3
    /// error): the descriptors then lose the data, as before.
    async fn keep_while_open(&self, ino: u64) -> bool {
        let kept = match self.stage_inode(ino, edit::NO_HANDLE).await {
            Ok(s) => s.lock().await.keep_unlinked(&self.client).await,
            Err(e) => Err(e),
        };
        match kept {
            Ok(()) => true,
            Err(e) => {
                let key = self.inode(ino).map(|i| i.key).unwrap_or_default();
                tracing::warn!(key = %key, error = %e,
                    "a file unlinked while open could not be kept for its descriptors; \
                     their reads and writes fail from now on");
                false
            }
        }
    }

    /// `i` is unlinked or replaced while it may be open for writing: what its descriptors
    /// write from now on reaches no object. A stream is aborted (closing the file must not
    /// bring it back); a staged copy stays readable and writable for its descriptors, and
    /// is never committed.
    async fn abandon_writes(&self, i: &Inode) {
        if let Some(writer) = i.writer {
            if let Ok(file) = self.file_handle(writer) {
                let mut f = file.lock().await;
                if let FileState::Write(up) = &mut f.state {
                    up.abort().await;
                }
                f.state = FileState::Discarded;
            }
            if let Some(i) = self.inodes().get_mut(i.ino) {
                i.writer = None;
                i.local_only = false;
            }
        }
        if let Some(s) = self.staged_of(i.ino) {
            s.lock().await.discard();
            self.unstage(i.ino, &s);
        }
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
        check_existing_name(name)?;
        check_name(new_name)?;
        let src_dir = self.dir_inode(parent)?;
        let dst_dir = self.dir_inode(new_parent)?;
        let src = self.resolve(parent, name).await?;
        if src.kind == Kind::File {
            // An empty file's PUT must be done before it can be copied, or deleted.
            self.await_pending(src.ino).await?;
        }
        if src.kind == Kind::Dir {
            return self
                .rename_dir(&src, new_parent, &dst_dir, new_name, no_replace)
                .await;
        }
        let dst_key = format!("{}{}", dst_dir.key, new_name);
        if dst_key.len() > MAX_KEY_LEN {
            return Err(FsError::NameTooLong);
        }
        let replaced = match self.resolve(new_parent, new_name).await {
            Ok(a) => {
                // The copy must land after the target's own empty PUT, if one is under way.
                let _ = self.await_pending(a.ino).await;
                if no_replace {
                    return Err(FsError::Exists);
                }
                if a.kind == Kind::Dir {
                    return Err(FsError::IsDir);
                }
                Some(a)
            }
            Err(FsError::NotFound) => None,
            Err(e) => return Err(e),
        };
        let src_key = format!("{}{}", src_dir.key, name);
        if src_key == dst_key {
            return Ok(());
        }
        // A file open for writing moves with what was written so far: committed first,
        // and held until its staged copy knows the new name.
        // (An edit kept for write-back that nobody has open is simply uploaded first.)
        let writing = !self.write_back_idle(src.ino).await
            || self
                .inodes()
                .get(src.ino)
                .is_some_and(|i| i.being_written());
        let held = if writing {
            Some(self.hold_open_edit(src.ino).await?)
        } else {
            None
        };
        let (size, etag) = match &held {
            Some(h) => (h.size(), h.etag()),
            None => (src.size, src.etag.clone()),
        };
        if let Some(a) = &replaced {
            // An edit of the target kept for write-back is acknowledged data: uploaded
            // first, since the rename may still fail.
            if !self.write_back_idle(a.ino).await {
                return Err(FsError::Busy(
                    "rename onto a file whose kept edit cannot be uploaded",
                ));
            }
            // Its descriptors keep the replaced file, as after an unlink: before the copy,
            // so that none of their commits lands after it.
            self.detach_from_its_name(a.ino).await;
        }
        // The copy takes the object's metadata along: a pending change goes first.
        if let Err(e) = self.save_meta(src.ino).await {
            tracing::debug!(key = %src_key, error = %e, "metadata not saved before rename");
        }
        // The type goes along, unless the extension changes (see `config::content_type`).
        let new_type = self.cfg.content_type.on_rename(&src_key, &dst_key);
        self.client
            .copy_object_if(
                &src_key,
                &dst_key,
                size,
                etag.as_deref(),
                new_type.as_deref(),
            )
            .await?;
        self.client.delete_object(&src_key).await?;
        {
            let mut t = self.inodes();
            t.rebind(src.ino, new_parent, new_name);
            if let Some(i) = t.get_mut(src.ino) {
                // The size is known; the copy's ETag is not (a multipart object's copy has
                // a plain one): the next open asks S3 (see `open`), so reads name the version.
                i.validated = Some(Instant::now());
                i.etag = None;
                // The copy's Last-Modified is new (same ETag): the next listing supplies it.
                i.meta_stamp = None;
                if let (Some(ct), Some(m)) = (&new_type, i.meta.as_mut()) {
                    Arc::make_mut(m).content_type = Some(ct.clone());
                }
            }
        }
        if let Some(h) = held {
            self.moved_edit(h, &dst_key).await;
        }
        Ok(())
    }

    /// Renames a directory as S3 allows: every object under it is copied on the server
    /// to the new prefix, and only once all copies exist are the old ones deleted, so a
    /// failure leaves the old tree whole (copies already made are removed again). Not
    /// atomic: another client listing meanwhile sees both trees, or parts of the new one.
    async fn rename_dir(
        &self,
        src: &Inode,
        new_parent: u64,
        dst_dir: &Inode,
        new_name: &str,
        no_replace: bool,
    ) -> FsResult<()> {
        let src_prefix = src.key.clone();
        let dst_prefix = format!("{}{}/", dst_dir.key, new_name);
        if dst_prefix == src_prefix {
            return Ok(());
        }
        if dst_prefix.starts_with(&src_prefix) {
            return Err(FsError::Invalid("a directory cannot move into itself"));
        }
        match self.resolve(new_parent, new_name).await {
            Ok(_) if no_replace => return Err(FsError::Exists),
            Ok(a) if a.kind != Kind::Dir => return Err(FsError::NotDir),
            Ok(_) => {
                let there = self.first_keys(&dst_prefix, MAX_DIR_RENAME_OBJECTS).await?;
                if there.iter().any(|o| o.key != dst_prefix)
                    && !self
                        .left_by_an_interrupted_rename(&there, &src_prefix, &dst_prefix)
                        .await?
                {
                    return Err(FsError::NotEmpty);
                }
            }
            Err(FsError::NotFound) => {}
            Err(e) => return Err(e),
        }
        // An older s3fs directory object is not under the prefix the copies take: a
        // marker replaces it first, and moves with the rest.
        self.retire_legacy_marker(src.ino).await?;
        // Files under it whose empty PUT is under way must be in S3 to be copied, and so
        // must edits kept for write-back; files being written cannot move.
        let kept: Vec<u64> = {
            let t = self.inodes();
            t.descendants(src.ino)
                .into_iter()
                .filter(|d| t.get(*d).is_some_and(|i| i.staged && i.open_handles == 0))
                .collect()
        };
        for ino in kept {
            self.write_back_idle(ino).await;
        }
        let (descendants, writing) = {
            let t = self.inodes();
            let descendants = t.descendants(src.ino);
            let mut writing: Vec<u64> = descendants
                .iter()
                .copied()
                .filter(|d| t.get(*d).is_some_and(|i| i.being_written()))
                .collect();
            writing.sort_unstable();
            (descendants, writing)
        };
        // Files open for writing move with what was written so far (as for a file).
        let mut held = Vec::with_capacity(writing.len());
        for ino in writing {
            held.push(self.hold_open_edit(ino).await?);
        }
        for ino in &descendants {
            self.await_pending(*ino).await?;
        }
        // The copies take the objects' metadata along: pending changes go first, as for a
        // file. Left to their timer, they could be saved onto the old keys while those are
        // being copied, and be deleted with them.
        let concurrency = self.cfg.max_concurrency.max(1);
        let saving: Vec<_> = std::iter::once(src.ino)
            .chain(descendants.iter().copied())
            .map(|ino| async move { (ino, self.save_meta(ino).await) })
            .collect();
        let saved: Vec<(u64, FsResult<()>)> = futures::stream::iter(saving)
            .buffer_unordered(concurrency)
            .collect()
            .await;
        for (ino, e) in saved
            .into_iter()
            .filter_map(|(i, r)| r.err().map(|e| (i, e)))
        {
            tracing::debug!(ino, error = %e, "metadata not saved before directory rename");
        }
        let objects = self
            .first_keys(&src_prefix, MAX_DIR_RENAME_OBJECTS + 1)
            .await?;
        if objects.len() > MAX_DIR_RENAME_OBJECTS {
            tracing::info!(key = %src_prefix, "directory rename of more than {MAX_DIR_RENAME_OBJECTS} objects refused with EXDEV; mv copies instead");
            return Err(FsError::CrossDevice);
        }
        // Owned futures, collected first: a stream that holds a closure over borrowed
        // items is not provably Send for the FUSE adapter's spawn.
        let copying: Vec<_> = objects
            .iter()
            .map(|o| {
                let (client, key, size) = (self.client.clone(), o.key.clone(), o.size);
                let etag = o.etag.clone();
                let to = format!("{dst_prefix}{}", &key[src_prefix.len()..]);
                async move {
                    // Only the version listed: one replaced meanwhile fails the rename.
                    let done = client
                        .copy_object_if(&key, &to, size, etag.as_deref(), None)
                        .await;
                    (to, done)
                }
            })
            .collect();
        let copies: Vec<(String, S3Result<()>)> = futures::stream::iter(copying)
            .buffer_unordered(concurrency)
            .collect()
            .await;
        if let Some(failed) = copies.iter().find_map(|(_, r)| r.clone().err()) {
            let removing: Vec<_> = copies
                .iter()
                .filter(|(_, r)| r.is_ok())
                .map(|(to, _)| {
                    let (deletes, to) = (self.deletes.clone(), to.clone());
                    async move {
                        if let Err(e) = deletes.delete_now(&to).await {
                            tracing::warn!(key = %to, error = %e, "cannot remove a copy of a failed directory rename");
                        }
                    }
                })
                .collect();
            futures::stream::iter(removing)
                .buffer_unordered(concurrency)
                .collect::<Vec<()>>()
                .await;
            return Err(failed.into());
        }
        let deleting: Vec<_> = objects
            .iter()
            .map(|o| {
                let (deletes, key) = (self.deletes.clone(), o.key.clone());
                async move { deletes.delete_now(&key).await }
            })
            .collect();
        let deletes: Vec<S3Result<()>> = futures::stream::iter(deleting)
            .buffer_unordered(concurrency)
            .collect()
            .await;
        if let Some(e) = deletes.into_iter().find_map(Result::err) {
            // The new tree is whole; some old objects stay behind and show again.
            tracing::error!(key = %src_prefix, error = %e, "directory renamed, but not all old objects could be deleted");
            return Err(e.into());
        }
        {
            let mut t = self.inodes();
            t.rebind(src.ino, new_parent, new_name);
            if let Some(i) = t.get_mut(src.ino) {
                i.validated = Some(Instant::now());
                // The copy's Last-Modified is new (same ETag): the next listing supplies it.
                i.meta_stamp = None;
            }
        }
        for h in held {
            if let Ok(i) = self.inode(h.ino()) {
                self.moved_edit(h, &i.key).await;
            }
        }
        Ok(())
    }

    /// A destination that holds only identical copies (same relative key, same ETag) of
    /// objects of the source is what a rename of the source that was interrupted while
    /// copying left behind: the retry may take it over and finish the job.
    async fn left_by_an_interrupted_rename(
        &self,
        there: &[ListedKey],
        src_prefix: &str,
        dst_prefix: &str,
    ) -> FsResult<bool> {
        let ours = self.first_keys(src_prefix, MAX_DIR_RENAME_OBJECTS).await?;
        let by_name: HashMap<&str, &ListedKey> = ours
            .iter()
            .map(|o| (&o.key[src_prefix.len()..], o))
            .collect();
        // A copy has its source's name, size and ETag, is not older than it, and carries
        // the same user metadata (CopyObject keeps it). The last test tells a copy from an
        // unrelated file that merely has the same bytes (two empty files, say): what s3csi
        // and s3fs write carries its own mtime, to the nanosecond.
        let secs = inode::whole_seconds;
        let mut pairs = Vec::new();
        for o in there.iter().filter(|o| o.key != dst_prefix) {
            let Some(src) = by_name.get(&o.key[dst_prefix.len()..]) else {
                return Ok(false);
            };
            let same = o.etag.is_some()
                && o.etag == src.etag
                && o.size == src.size
                && secs(o.mtime) >= secs(src.mtime);
            if !same {
                return Ok(false);
            }
            pairs.push((src.key.clone(), o.key.clone()));
        }
        let concurrency = self.cfg.max_concurrency.max(1);
        let heads: Vec<_> = pairs
            .into_iter()
            .map(|(src, dst)| {
                let client = self.client.clone();
                async move {
                    let (a, b) = futures::join!(
                        client.head_object_with_meta(&src),
                        client.head_object_with_meta(&dst)
                    );
                    Ok::<bool, S3Error>(a?.1 == b?.1)
                }
            })
            .collect();
        let same: Vec<Result<bool, S3Error>> = futures::stream::iter(heads)
            .buffer_unordered(concurrency)
            .collect()
            .await;
        for s in same {
            match s {
                Ok(true) => {}
                // Gone since the listing, or different: not our copy.
                Ok(false) | Err(S3Error::NotFound) => return Ok(false),
                Err(e) => return Err(e.into()),
            }
        }
        Ok(true)
    }

    /// Up to `max` objects under `prefix`, in key order.
    async fn first_keys(&self, prefix: &str, max: usize) -> FsResult<Vec<ListedKey>> {
        let mut out = Vec::new();
        let mut token: Option<String> = None;
        loop {
            let page = self
                .client
                .list(ListRequest {
                    prefix,
                    delimiter: None,
                    continuation: token.as_deref(),
                    start_after: None,
                    max_keys: 1000,
                })
                .await?;
            out.extend(page.objects.into_iter().map(|o| ListedKey {
                key: o.key,
                size: o.meta.size,
                etag: o.meta.etag,
                mtime: o.meta.mtime,
            }));
            if out.len() >= max || page.next_token.is_none() {
                out.truncate(max);
                return Ok(out);
            }
            token = page.next_token;
        }
    }
}

struct ListedKey {
    key: String,
    size: u64,
    etag: Option<String>,
    mtime: SystemTime,
}

/// Above this many objects a directory rename is refused with EXDEV (`mv` then copies
/// file by file, showing progress, and can be interrupted).
const MAX_DIR_RENAME_OBJECTS: usize = 10_000;
