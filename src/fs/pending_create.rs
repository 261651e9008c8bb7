//! Empty new files whose close does not wait for their PUT, and the ordering of everything
//! that must come after that PUT.

use super::*;
use crate::s3::{ObjectMeta, S3Result};
use tokio::sync::watch;

/// What a deferred empty PUT ended with: `None` while it runs.
type PutOutcome = Option<Result<(), S3Error>>;

/// Where waiters learn how a deferred empty PUT ended.
#[derive(Clone)]
pub(super) struct PutDone(watch::Receiver<PutOutcome>);

impl PutDone {
    /// Waits until the PUT is done or given up. A task that ended without an outcome (it
    /// panicked, or the runtime stopped under it) counts as failed: nobody can say the
    /// object is in S3.
    pub(super) async fn outcome(mut self) -> Result<(), S3Error> {
        let ended = self.0.wait_for(Option::is_some).await;
        match ended.as_deref() {
            Ok(Some(outcome)) => outcome.clone(),
            _ => Err(S3Error::Other(
                "the empty file's PUT task ended without an outcome".into(),
            )),
        }
    }
}

/// Held by the task of one deferred PUT: the inode's one way out of "PUT queued". It
/// leaves `pending` when the task ends, with an outcome (`finish`, `cancelled`) or
/// without one (dropped: a panic, or the runtime stopping), which counts as a failed PUT,
/// so that nothing waits for it for ever and no waiter takes it for created.
struct PutTask {
    /// `None` once an outcome was sent.
    tx: Option<watch::Sender<PutOutcome>>,
    mine: watch::Receiver<PutOutcome>,
    ino: u64,
    key: String,
    /// The metadata change the PUT carries (the file's headers when it was closed).
    meta_change: u64,
    pending: Arc<Mutex<HashMap<u64, PendingCreate>>>,
    inodes: Arc<Mutex<InodeTable>>,
    log: Option<inode_log::InodeLog>,
}

impl PutTask {
    /// Unlinked before its turn came: the file never reaches S3 (see `cancel_put`).
    fn cancelled(mut self) {
        lock(&self.inodes).forget(self.ino, 0);
        self.log.iter().for_each(inode_log::InodeLog::flush);
        self.send(Ok(()));
    }

    /// The PUT's answer: the inode is in S3 now, or its name goes (the next lookup asks S3).
    fn finish(mut self, result: S3Result<ObjectMeta>) {
        self.settle(&result);
        match &result {
            Ok(_) => tracing::debug!(key = %self.key, "empty file created in S3"),
            Err(e) => tracing::error!(key = %self.key,
                "could not create empty file {} in S3: {e}", self.key),
        }
        self.send(result.map(|_| ()));
    }

    fn settle(&self, result: &S3Result<ObjectMeta>) {
        let ino = self.ino;
        let mut t = lock(&self.inodes);
        let settled = t
            .get(ino)
            .is_some_and(|i| i.local_only && i.writer.is_none());
        if settled && result.is_ok() {
            t.now_in_s3(ino);
        }
        if let Some(i) = t.get_mut(ino).filter(|_| settled) {
            i.local_only = false;
            match result {
                Ok(meta) => {
                    i.etag = meta.etag.clone();
                    i.validated = Some(Instant::now());
                    i.meta_saved = i.meta_saved.max(self.meta_change);
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
        self.log.iter().for_each(inode_log::InodeLog::flush);
    }

    /// The entry goes first, so that a waiter woken by the outcome finds it gone.
    fn send(&mut self, outcome: Result<(), S3Error>) {
        self.leave_pending();
        if let Some(tx) = self.tx.take() {
            tx.send_replace(Some(outcome));
        }
    }

    fn leave_pending(&self) {
        let mut p = lock(&self.pending);
        if p.get(&self.ino)
            .is_some_and(|p| p.done.0.same_channel(&self.mine))
        {
            p.remove(&self.ino);
        }
    }
}

impl Drop for PutTask {
    fn drop(&mut self) {
        if self.tx.is_some() {
            tracing::error!(key = %self.key, "the PUT of empty file {} ended without an answer", self.key);
            self.settle(&Err(S3Error::Other(
                "the PUT task ended without an answer".into(),
            )));
            // The sender goes with `self`: waiters see a failure.
            self.leave_pending();
        }
    }
}

/// The empty object of a new file whose close did not wait for its PUT (see
/// `S3Fs::defer_empty`).
pub(super) struct PendingCreate {
    /// The handle whose close started the PUT: its own later flushes need not wait.
    pub(super) creator: u64,
    /// How the PUT ended, once it has.
    pub(super) done: PutDone,
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
        let (tx, rx) = watch::channel(None);
        let state = Arc::new(AtomicU8::new(PUT_QUEUED));
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
                    done: PutDone(rx.clone()),
                    state: state.clone(),
                },
            );
        }
        let task = PutTask {
            tx: Some(tx),
            mine: rx,
            ino,
            key: key.to_string(),
            meta_change,
            pending: self.pending.clone(),
            inodes: self.inodes.clone(),
            log: self.inode_log.get().cloned(),
        };
        let (deletes, slots) = (self.deletes.clone(), self.create_slots.clone());
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
                return task.cancelled();
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
            task.finish(result);
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
        done.outcome().await.map_err(FsError::UploadFailed)
    }
}
