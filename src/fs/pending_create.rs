//! Empty new files whose close does not wait for their PUT, and the ordering of everything
//! that must come after that PUT.

use super::*;

/// The empty object of a new file whose close did not wait for its PUT (see
/// `S3Fs::defer_empty`).
pub(super) struct PendingCreate {
    /// The handle whose close started the PUT: its own later flushes need not wait.
    pub(super) creator: u64,
    /// Held by the PUT task until the PUT is done, then holds its outcome.
    pub(super) done: Arc<tokio::sync::Mutex<Option<Result<(), S3Error>>>>,
    /// `PUT_QUEUED` until the task sends the PUT (`PUT_SENT`), unless `unlink` got there
    /// first (`PUT_CANCELLED`).
    pub(super) state: Arc<AtomicU8>,
}

pub(super) const PUT_QUEUED: u8 = 0;
pub(super) const PUT_SENT: u8 = 1;
pub(super) const PUT_CANCELLED: u8 = 2;

impl S3Fs {
    /// A new file this mount created, closed with nothing written and never uploaded:
    /// the empty object is PUT in the background and close returns at once, since no data
    /// is at stake. Until the PUT is done the inode stays `local_only` (lookups, getattr,
    /// listings and reads answer from this table) and `pending` holds it: everything that
    /// must be ordered after the PUT waits for it (`await_pending`): opening for write,
    /// writing, truncate, unlink, rename, create of the same name, fsync and the close of
    /// another descriptor, and `flush_all` on unmount/SIGTERM. A PUT that fails even after
    /// the SDK's retries is logged, and the name disappears (the next lookup asks S3).
    /// Returns false, changing nothing, when the file does not qualify.
    pub(super) fn defer_empty(&self, ino: u64, key: &str, fh: u64) -> bool {
        let done = Arc::new(tokio::sync::Mutex::new(None));
        let mine = done.clone();
        let state = Arc::new(AtomicU8::new(PUT_QUEUED));
        let Ok(mut guard) = done.clone().try_lock_owned() else {
            return false;
        };
        // The empty object carries the file's metadata (see `meta_update.rs`).
        let headers = self.upload_headers(ino);
        let meta_change = self.inode(ino).map(|i| i.meta_changes).unwrap_or(0);
        {
            let mut t = self.inodes();
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
        let (deletes, inodes, log, pending, slots) = (
            self.deletes.clone(),
            self.inodes.clone(),
            self.inode_log.get().cloned(),
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
                log.iter().for_each(inode_log::InodeLog::flush);
                *guard = Some(Ok(()));
                let mut p = lock(&pending);
                if p.get(&ino).is_some_and(|p| Arc::ptr_eq(&p.done, &mine)) {
                    p.remove(&ino);
                }
                return;
            }
            let result = match &headers {
                Some(h) => {
                    deletes
                        .unordered()
                        .put_object_with_meta(&key, Bytes::new(), h)
                        .await
                }
                None => deletes.unordered().put_object(&key, Bytes::new()).await,
            };
            drop(slot);
            let mut t = lock(&inodes);
            let settled = t
                .get(ino)
                .is_some_and(|i| i.local_only && i.writer.is_none());
            if settled && result.is_ok() {
                t.now_in_s3(ino);
            }
            if let Some(i) = t.get_mut(ino).filter(|_| settled) {
                i.local_only = false;
                match &result {
                    Ok(meta) => {
                        i.etag = meta.etag.clone();
                        i.validated = Some(Instant::now());
                        i.meta_saved = i.meta_saved.max(meta_change);
                        i.meta_stamp = None;
                        i.mtime_from_writes = false;
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
            log.iter().for_each(inode_log::InodeLog::flush);
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
    pub(super) fn cancel_put(&self, ino: u64) -> bool {
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
    pub(super) async fn await_pending(&self, ino: u64) -> FsResult<()> {
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
}
