//! Deferred deletes: `unlink` returns before S3 has answered the DELETE.
//!
//! A DELETE's outcome is rarely in doubt once the mount has seen one succeed (the SDK
//! retries transient failures; what is left is a permission the mount lacks), so paying a
//! round trip per `rm` buys little. [`DeferredDeletes`] wraps the object client: once a
//! DELETE has succeeded, later ones are sent in the background and `delete_object` returns
//! at once. Ordering is kept here, at the seam, so the file system above needs no care:
//! - a read of the store never shows a key whose DELETE is under way, or whose DELETE
//!   finished after that read was sent (HEAD answers "no such key"; listings drop it);
//!   a listing first waits for the DELETEs under its prefix, so a directory whose last
//!   file is being deleted does not show as a common prefix;
//! - a write of a key (PUT, multipart completion, copy onto it, another DELETE) waits
//!   until that key's DELETE is done, so a new object is never removed by an older DELETE;
//! - [`DeferredDeletes::drain`] (unmount, SIGTERM) waits for all of them.
//!
//! A background DELETE that fails after the SDK's retries is logged, the next one is sent
//! synchronously again (so a lost permission shows as an error to `rm`), and the name
//! comes back on the next lookup that asks S3. `sync_delete` turns the deferral off.

use super::lock;
use crate::s3::{
    CompletedPart, ListPage, ListRequest, ObjectClient, ObjectMeta, S3Error, S3Result, UserMeta,
    WriteCondition,
};
use async_trait::async_trait;
use bytes::Bytes;
use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use tokio::sync::Semaphore;

/// Background DELETEs sent at once.
const DELETES_IN_FLIGHT: usize = 64;
/// Background DELETEs queued (waiting for a PUT or a slot); `unlink` waits beyond that.
const DELETES_QUEUED: usize = 10_000;

/// Locked by the task that sends the DELETE until it has an answer.
type Done = Arc<tokio::sync::Mutex<()>>;

#[derive(Default)]
struct Ledger {
    /// Keys whose DELETE is under way.
    pending: BTreeMap<String, Done>,
    /// Keys whose background DELETE finished, by the sequence number it finished at; kept
    /// while a read sent before that may still be in flight.
    finished: HashMap<String, u64>,
    /// Reads (HEAD, LIST) in flight, by the sequence number they started at.
    reads: BTreeMap<u64, usize>,
    seq: u64,
}

impl Ledger {
    fn start_read(&mut self) -> u64 {
        let s = self.seq;
        *self.reads.entry(s).or_default() += 1;
        s
    }

    /// Whether a read begun at `started` must not show `key`.
    fn hidden(&self, started: u64, key: &str) -> bool {
        self.pending.contains_key(key) || self.finished.get(key).is_some_and(|at| *at > started)
    }

    fn end_read(&mut self, started: u64) {
        if let Some(n) = self.reads.get_mut(&started) {
            *n -= 1;
            if *n == 0 {
                self.reads.remove(&started);
            }
        }
        // Nobody can still be reading something older than the oldest read in flight.
        let oldest = self.reads.keys().next().copied().unwrap_or(self.seq);
        self.finished.retain(|_, at| *at > oldest);
    }
}

/// Cloned into each background DELETE task: every field is shared.
#[derive(Clone)]
pub struct DeferredDeletes {
    inner: Arc<dyn ObjectClient>,
    ledger: Arc<Mutex<Ledger>>,
    slots: Arc<Semaphore>,
    queue: Arc<Semaphore>,
    /// A DELETE succeeded and none has failed since: deferring is safe.
    proven: Arc<AtomicBool>,
    enabled: bool,
    failed: Arc<AtomicUsize>,
}

impl DeferredDeletes {
    pub fn new(inner: Arc<dyn ObjectClient>, enabled: bool) -> Self {
        Self {
            inner,
            ledger: Arc::default(),
            slots: Arc::new(Semaphore::new(DELETES_IN_FLIGHT)),
            queue: Arc::new(Semaphore::new(DELETES_QUEUED)),
            proven: Arc::new(AtomicBool::new(false)),
            enabled,
            failed: Arc::default(),
        }
    }

    /// Waits for every DELETE under way; returns how many background DELETEs have failed
    /// since the last drain.
    pub async fn drain(&self) -> usize {
        loop {
            let next = lock(&self.ledger).pending.values().next().cloned();
            match next {
                Some(done) => drop(done.lock().await),
                None => return self.failed.swap(0, Ordering::SeqCst),
            }
        }
    }

    /// Waits until no DELETE of `key` is under way.
    pub async fn settle(&self, key: &str) {
        let done = lock(&self.ledger).pending.get(key).cloned();
        if let Some(done) = done {
            drop(done.lock().await);
        }
    }

    /// The wrapped client, for a write whose ordering the caller has settled itself.
    pub fn unordered(&self) -> &Arc<dyn ObjectClient> {
        &self.inner
    }

    async fn settle_prefix(&self, prefix: &str) {
        loop {
            let next = lock(&self.ledger)
                .pending
                .range(prefix.to_string()..)
                .next()
                .filter(|(k, _)| k.starts_with(prefix))
                .map(|(_, d)| d.clone());
            match next {
                Some(done) => drop(done.lock().await),
                None => return,
            }
        }
    }

    fn finish_delete(&self, key: &str, mine: &Done) {
        let mut l = lock(&self.ledger);
        if l.pending.get(key).is_some_and(|d| Arc::ptr_eq(d, mine)) {
            l.pending.remove(key);
        }
        l.seq += 1;
        let seq = l.seq;
        if !l.reads.is_empty() {
            l.finished.insert(key.to_string(), seq);
        }
    }
}

impl DeferredDeletes {
    /// A HEAD of `key`, answered NotFound while its DELETE is pending, or when one
    /// finished after the HEAD began (S3 may have answered with the object still there).
    async fn unless_hidden<T>(
        &self,
        key: &str,
        head: impl std::future::Future<Output = S3Result<T>>,
    ) -> S3Result<T> {
        let started = lock(&self.ledger).start_read();
        let res = head.await;
        let mut ledger = lock(&self.ledger);
        let hidden = ledger.hidden(started, key);
        ledger.end_read(started);
        if hidden {
            return Err(S3Error::NotFound);
        }
        res
    }
}

#[async_trait]
impl ObjectClient for DeferredDeletes {
    async fn head_object(&self, key: &str) -> S3Result<ObjectMeta> {
        self.unless_hidden(key, self.inner.head_object(key)).await
    }

    async fn list(&self, req: ListRequest<'_>) -> S3Result<ListPage> {
        self.settle_prefix(req.prefix).await;
        let started = lock(&self.ledger).start_read();
        let res = self.inner.list(req).await;
        let mut ledger = lock(&self.ledger);
        let res = res.map(|mut page| {
            page.objects.retain(|o| !ledger.hidden(started, &o.key));
            page
        });
        ledger.end_read(started);
        res
    }

    async fn get_range(&self, key: &str, start: u64, end: u64) -> S3Result<Bytes> {
        // An unlinked file that is still open stays readable for as long as S3 has it.
        self.inner.get_range(key, start, end).await
    }

    async fn get_range_if_match(
        &self,
        key: &str,
        etag: &str,
        start: u64,
        end: u64,
    ) -> S3Result<Bytes> {
        self.inner.get_range_if_match(key, etag, start, end).await
    }

    async fn put_object_if(
        &self,
        key: &str,
        body: Bytes,
        cond: Option<&WriteCondition>,
        meta: Option<&UserMeta>,
    ) -> S3Result<ObjectMeta> {
        self.settle(key).await;
        self.inner.put_object_if(key, body, cond, meta).await
    }

    async fn create_multipart(&self, key: &str) -> S3Result<String> {
        self.inner.create_multipart(key).await
    }

    async fn upload_part(
        &self,
        key: &str,
        upload_id: &str,
        part_number: i32,
        body: Bytes,
    ) -> S3Result<CompletedPart> {
        self.inner
            .upload_part(key, upload_id, part_number, body)
            .await
    }

    async fn complete_multipart_if(
        &self,
        key: &str,
        upload_id: &str,
        parts: Vec<CompletedPart>,
        cond: Option<&WriteCondition>,
    ) -> S3Result<ObjectMeta> {
        // The object appears when the completion is done: that must come after the DELETE.
        self.settle(key).await;
        self.inner
            .complete_multipart_if(key, upload_id, parts, cond)
            .await
    }

    async fn abort_multipart(&self, key: &str, upload_id: &str) -> S3Result<()> {
        self.inner.abort_multipart(key, upload_id).await
    }

    async fn upload_part_copy(
        &self,
        key: &str,
        upload_id: &str,
        part_number: i32,
        src: &str,
        src_etag: Option<&str>,
        start: u64,
        end: u64,
    ) -> S3Result<CompletedPart> {
        if lock(&self.ledger).pending.contains_key(src) {
            return Err(S3Error::NotFound);
        }
        self.inner
            .upload_part_copy(key, upload_id, part_number, src, src_etag, start, end)
            .await
    }

    async fn copy_object_if(
        &self,
        src: &str,
        dst: &str,
        size: u64,
        src_etag: Option<&str>,
        content_type: Option<&str>,
    ) -> S3Result<()> {
        self.settle(dst).await;
        if lock(&self.ledger).pending.contains_key(src) {
            return Err(S3Error::NotFound);
        }
        self.inner
            .copy_object_if(src, dst, size, src_etag, content_type)
            .await
    }

    async fn delete_object(&self, key: &str) -> S3Result<()> {
        self.delete_after(key, std::future::ready(())).await
    }

    async fn head_object_with_meta(&self, key: &str) -> S3Result<(ObjectMeta, UserMeta)> {
        self.unless_hidden(key, self.inner.head_object_with_meta(key))
            .await
    }

    async fn create_multipart_with_meta(&self, key: &str, meta: &UserMeta) -> S3Result<String> {
        self.inner.create_multipart_with_meta(key, meta).await
    }

    async fn replace_metadata(
        &self,
        key: &str,
        etag: &str,
        size: u64,
        meta: &UserMeta,
    ) -> S3Result<ObjectMeta> {
        // A copy onto a key whose DELETE is pending would bring it back.
        if lock(&self.ledger).pending.contains_key(key) {
            return Err(S3Error::NotFound);
        }
        self.inner.replace_metadata(key, etag, size, meta).await
    }
}

impl DeferredDeletes {
    /// DELETE of `key` once `after` is done (a PUT of it that is under way), deferred
    /// like any other; reads stop showing `key` at once.
    /// Deletes `key` and waits for S3's answer whatever the mode, for callers that must
    /// report a failure (a directory rename deletes the old tree only once the new one
    /// is whole, and an old object left behind would show under both names).
    pub async fn delete_now(&self, key: &str) -> S3Result<()> {
        self.settle(key).await;
        self.inner.delete_object(key).await
    }

    pub async fn delete_after(
        &self,
        key: &str,
        after: impl std::future::Future<Output = ()> + Send + 'static,
    ) -> S3Result<()> {
        self.settle(key).await;
        if !self.enabled || !self.proven.load(Ordering::SeqCst) {
            after.await;
            let res = self.inner.delete_object(key).await;
            if res.is_ok() {
                self.proven.store(true, Ordering::SeqCst);
            }
            return res;
        }
        let Ok(queued) = self.queue.clone().acquire_owned().await else {
            after.await;
            return self.inner.delete_object(key).await;
        };
        let done: Done = Arc::default();
        let guard = done.clone().lock_owned().await;
        lock(&self.ledger)
            .pending
            .insert(key.to_string(), done.clone());
        let this = self.clone();
        let key = key.to_string();
        tokio::spawn(async move {
            after.await;
            let slot = this.slots.clone().acquire_owned().await;
            let res = this.inner.delete_object(&key).await;
            if let Err(e) = &res {
                this.proven.store(false, Ordering::SeqCst);
                this.failed.fetch_add(1, Ordering::SeqCst);
                tracing::error!(key = %key, "could not delete {key} in S3 after unlink: {e}");
            }
            this.finish_delete(&key, &done);
            drop(guard);
            drop((slot, queued));
        });
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::s3::mem::MemClient;

    async fn client_with(keys: &[&str]) -> (Arc<MemClient>, DeferredDeletes) {
        let mem = Arc::new(MemClient::default());
        for k in keys {
            mem.put_object(k, Bytes::from_static(b"x")).await.unwrap();
        }
        let d = DeferredDeletes::new(mem.clone(), true);
        (mem, d)
    }

    #[tokio::test]
    async fn first_delete_is_synchronous_then_deferred_and_drained() {
        let (mem, d) = client_with(&["a", "b", "c"]).await;
        d.delete_object("a").await.unwrap();
        assert_eq!(mem.head_object("a").await, Err(S3Error::NotFound));
        assert!(d.proven.load(Ordering::SeqCst));
        d.delete_object("b").await.unwrap();
        d.delete_object("c").await.unwrap();
        // Whatever is still under way is invisible through the wrapper.
        assert_eq!(d.head_object("b").await, Err(S3Error::NotFound));
        let page = d
            .list(ListRequest {
                prefix: "",
                delimiter: None,
                continuation: None,
                start_after: None,
                max_keys: 1000,
            })
            .await
            .unwrap();
        assert!(page.objects.is_empty(), "{:?}", page.objects);
        assert_eq!(d.drain().await, 0);
        for k in ["a", "b", "c"] {
            assert_eq!(mem.head_object(k).await, Err(S3Error::NotFound));
        }
    }

    #[tokio::test]
    async fn disabled_never_defers() {
        let (mem, d) = client_with(&["a", "b"]).await;
        let d = DeferredDeletes {
            enabled: false,
            ..d
        };
        d.delete_object("a").await.unwrap();
        d.delete_object("b").await.unwrap();
        assert!(lock(&d.ledger).pending.is_empty());
        assert_eq!(mem.head_object("b").await, Err(S3Error::NotFound));
    }

    #[tokio::test]
    async fn a_put_after_a_deferred_delete_survives_it() {
        let (mem, d) = client_with(&["a", "k"]).await;
        d.delete_object("a").await.unwrap();
        d.delete_object("k").await.unwrap();
        d.put_object("k", Bytes::from_static(b"new")).await.unwrap();
        d.drain().await;
        assert_eq!(mem.get_range("k", 0, 3).await.unwrap(), &b"new"[..]);
    }

    #[test]
    fn a_read_older_than_a_finished_delete_hides_its_key() {
        let mut l = Ledger::default();
        let old = l.start_read();
        l.seq += 1;
        l.finished.insert("k".into(), l.seq);
        let newer = l.start_read();
        assert!(!l.hidden(newer, "k"));
        assert!(l.hidden(old, "k"));
        l.end_read(newer);
        l.end_read(old);
        // With no read in flight the record is dropped.
        assert!(l.finished.is_empty());
    }
}
