//! Streams a file written sequentially into S3.
//!
//! Small files become one PutObject at close. Once a part's worth of data has been
//! written, a multipart upload starts and full parts go up in the background, at most
//! `max_inflight` at a time per file, and together only as many as the mount's
//! [`UploadBudget`] holds, so memory stays bounded whatever the file size and however many
//! files are written at once. Part sizes double every 1000 parts so that the 10 000-part
//! limit is never reached before S3's 5 TiB object limit. Nothing is acknowledged as
//! durable until [`Upload::finish`] has completed the upload; any failure there, or of
//! an earlier part, is returned so close/fsync can report EIO.

use super::cache::DataCache;
use super::error::{FsError, FsResult};
use super::prefetch::BUDGET_UNIT;
use crate::s3::{
    CompletedPart, ConditionalWrites, ObjectClient, ObjectMeta, S3Error, S3Result, WriteCondition,
};
use bytes::{Bytes, BytesMut};
use std::collections::VecDeque;
use std::sync::Arc;
use tokio::sync::Semaphore;
use tokio::task::JoinHandle;

/// Memory for parts in flight, shared by every upload of a mount: a part waits for its
/// share before it is sent and returns it when S3 has answered.
#[derive(Clone)]
pub struct UploadBudget {
    units: Arc<Semaphore>,
    total: u32,
}

impl UploadBudget {
    pub fn new(bytes: u64) -> Self {
        let total = (bytes / BUDGET_UNIT).clamp(1, u32::MAX as u64 / 2) as u32;
        Self {
            units: Arc::new(Semaphore::new(total as usize)),
            total,
        }
    }

    /// The whole budget, in bytes.
    pub fn bytes(&self) -> u64 {
        self.total as u64 * BUDGET_UNIT
    }

    /// Memory for a body of `bytes` bytes, waited for; held until dropped.
    pub async fn take_for(&self, bytes: usize) -> Option<tokio::sync::OwnedSemaphorePermit> {
        self.take(bytes).await
    }

    async fn take(&self, bytes: usize) -> Option<tokio::sync::OwnedSemaphorePermit> {
        // A part larger than the whole budget takes all of it, so it can still go.
        let n = (bytes as u64)
            .div_ceil(BUDGET_UNIT)
            .clamp(1, self.total as u64) as u32;
        self.units.clone().acquire_many_owned(n).await.ok()
    }
}

const MAX_PART: u64 = 5 * 1024 * 1024 * 1024;
/// S3's most parts per upload.
const MAX_PARTS: i32 = 10_000;
/// S3's smallest part but the last: an object continued from a shorter one is read back
/// and sent again, from a longer one copied on the server.
pub const MIN_PART: u64 = 5 * 1024 * 1024;
/// Largest range one UploadPartCopy copies when an upload continues an object.
const COPY_PART: u64 = 512 * 1024 * 1024;

pub struct Upload {
    client: Arc<dyn ObjectClient>,
    key: String,
    base_part_size: u64,
    /// Parts never grow past the mount's upload budget: a part is buffered whole before it
    /// is sent, so a larger one would be memory outside the budget.
    max_part: u64,
    max_inflight: usize,
    budget: UploadBudget,
    written: u64,
    buf: BytesMut,
    upload_id: Option<String>,
    next_part: i32,
    inflight: VecDeque<JoinHandle<Result<CompletedPart, S3Error>>>,
    parts: Vec<CompletedPart>,
    failed: Option<S3Error>,
    /// User metadata the object gets (see `set_meta`), and what the multipart upload, if
    /// one was started, was created with.
    meta: Option<crate::s3::UserMeta>,
    meta_sent: Option<crate::s3::UserMeta>,
    /// The object must not exist when it is written (`If-None-Match: *`, see `create_only`),
    /// as far as the store honours conditions.
    create_only: Option<Arc<ConditionalWrites>>,
    /// What was sent, kept for the data cache until S3 names the version (see `keep_for`).
    kept: Option<KeptForCache>,
}

/// An upload's parts held for the data cache, within its write queue's allowance (past
/// it, nothing more is kept: the rest is cached when first read).
struct KeptForCache {
    cache: Arc<DataCache>,
    pieces: Vec<(u64, Bytes)>,
    bytes: u64,
}

impl KeptForCache {
    fn keep(&mut self, at: u64, body: &Bytes) -> bool {
        let len = body.len() as u64;
        if !self.cache.hold(len) {
            return false;
        }
        self.bytes += len;
        self.pieces.push((at, body.clone()));
        true
    }

    fn offer(mut self, key: &str, meta: &ObjectMeta, size: u64) {
        if let Some(etag) = &meta.etag {
            self.cache.unhold(std::mem::take(&mut self.bytes));
            let pieces = std::mem::take(&mut self.pieces);
            self.cache.offer_written(key, etag, size, pieces);
        }
    }
}

impl Drop for KeptForCache {
    fn drop(&mut self) {
        self.cache.unhold(self.bytes);
    }
}

impl Upload {
    pub fn new(
        client: Arc<dyn ObjectClient>,
        key: String,
        part_size: u64,
        max_inflight: usize,
        budget: UploadBudget,
    ) -> Self {
        Self {
            client,
            key,
            base_part_size: part_size,
            max_part: budget.bytes().max(MIN_PART),
            max_inflight: max_inflight.max(1),
            budget,
            written: 0,
            buf: BytesMut::new(),
            upload_id: None,
            next_part: 1,
            inflight: VecDeque::new(),
            parts: Vec::new(),
            failed: None,
            meta: None,
            meta_sent: None,
            create_only: None,
            kept: None,
        }
    }

    /// What this upload sends is offered to `cache` once it is in S3.
    pub fn keep_for(mut self, cache: Option<&Arc<DataCache>>) -> Self {
        self.kept = cache.map(|cache| KeptForCache {
            cache: cache.clone(),
            pieces: Vec::new(),
            bytes: 0,
        });
        self
    }

    /// `body`, starting at `at`, is sent: the data cache may have it too.
    fn keep_sent(&mut self, at: u64, body: &Bytes) {
        if let Some(k) = &mut self.kept {
            if !k.keep(at, body) {
                self.kept = None;
            }
        }
    }

    /// The object is written only if the key does not exist by then (an `O_EXCL` create):
    /// S3 refuses it otherwise (`PreconditionFailed`, EIO) and keeps what is there. A
    /// store that does not implement the condition gets the write without it.
    pub fn create_only(mut self, conditions: Arc<ConditionalWrites>) -> Self {
        self.create_only = Some(conditions);
        self
    }

    pub fn is_create_only(&self) -> bool {
        self.create_only.is_some()
    }

    /// The user metadata the object is to carry. Takes effect for the multipart upload
    /// only if it has not started yet; see `meta_in_s3`.
    pub fn set_meta(&mut self, meta: Option<crate::s3::UserMeta>) {
        self.meta = meta;
    }

    pub fn has_meta(&self) -> bool {
        self.meta.is_some()
    }

    /// After `finish`: the object carries the metadata last set (else it needs a copy).
    pub fn meta_in_s3(&self) -> bool {
        self.meta.is_none() || self.meta_sent == self.meta
    }

    async fn start_multipart(&mut self) -> Result<String, S3Error> {
        let id = match &self.meta {
            Some(m) => self.client.create_multipart_with_meta(&self.key, m).await?,
            None => self.client.create_multipart(&self.key).await?,
        };
        self.meta_sent = self.meta.clone();
        Ok(id)
    }

    pub fn key(&self) -> &str {
        &self.key
    }

    pub fn written(&self) -> u64 {
        self.written
    }

    /// Size of part `n` (1-based).
    pub fn part_size(base: u64, n: i32) -> u64 {
        let doublings = ((n.max(1) - 1) / 1000) as u32;
        base.saturating_mul(1u64 << doublings.min(20)).min(MAX_PART)
    }

    /// True while nothing has left the process, so the upload can still start over.
    pub fn can_truncate(&self) -> bool {
        self.upload_id.is_none()
    }

    /// Everything written so far, taken out of an upload that has sent nothing
    /// (`can_truncate`); the upload is left empty.
    pub fn take_buffer(&mut self) -> Bytes {
        debug_assert!(self.can_truncate());
        self.written = 0;
        std::mem::take(&mut self.buf).freeze()
    }

    pub fn truncate(&mut self) -> FsResult<()> {
        if !self.can_truncate() {
            return Err(FsError::Unsupported("truncate after parts were uploaded"));
        }
        self.buf.clear();
        self.written = 0;
        Ok(())
    }

    /// Makes a new upload begin with bytes `0..size` of the version `etag` of the object
    /// at its key, so that writes go on at `size`: read back below `MIN_PART`, else
    /// copied on the server in parts of at most `COPY_PART` (each at least `MIN_PART`, as
    /// S3 requires of every part but the last). `PreconditionFailed` if the key holds
    /// another version by now; nothing is left behind then.
    pub async fn continue_from(&mut self, size: u64, etag: &str) -> FsResult<()> {
        debug_assert!(self.written == 0 && self.upload_id.is_none());
        if size == 0 {
            return Ok(());
        }
        if size < MIN_PART {
            let body = self
                .client
                .get_range_if_match(&self.key, etag, 0, size)
                .await?;
            if body.len() as u64 != size {
                return Err(FsError::S3(S3Error::PreconditionFailed));
            }
            self.buf.extend_from_slice(&body);
            self.written = size;
            return Ok(());
        }
        let id = self.start_multipart().await?;
        self.upload_id = Some(id.clone());
        let chunk = size.div_ceil(size.div_ceil(COPY_PART));
        let mut start = 0;
        while start < size {
            let end = (start + chunk).min(size);
            let copied = self
                .client
                .upload_part_copy(
                    &self.key,
                    &id,
                    self.next_part,
                    &self.key,
                    Some(etag),
                    start,
                    end,
                )
                .await;
            match copied {
                Ok(part) => self.parts.push(part),
                Err(e) => {
                    self.failed = Some(e.clone());
                    self.abort().await;
                    return Err(FsError::S3(e));
                }
            }
            self.next_part += 1;
            start = end;
        }
        self.written = size;
        Ok(())
    }

    pub async fn write(&mut self, offset: u64, data: &[u8]) -> FsResult<usize> {
        if let Some(e) = &self.failed {
            return Err(FsError::UploadFailed(e.clone()));
        }
        if offset != self.written {
            return Err(FsError::Unsupported("non-sequential write"));
        }
        if self.next_part >= MAX_PARTS && (self.buf.len() + data.len()) as u64 > self.max_part {
            tracing::warn!(key = %self.key, written = self.written,
                "file too large for S3's 10 000 parts within --max-upload-memory; EFBIG");
            return Err(FsError::TooBig);
        }
        if self.next_part > 1 && self.buf.capacity() - self.buf.len() < data.len() {
            // Past the first part the buffer fills up to a whole part: allocate that once,
            // not by doubling from the write size (which copied 7 MiB per 8 MiB part).
            let want = self.next_part_size().max(self.buf.len() + data.len());
            self.buf.reserve(want - self.buf.len());
        }
        self.buf.extend_from_slice(data);
        self.written += data.len() as u64;
        loop {
            let size = self.next_part_size();
            if self.buf.len() < size {
                break;
            }
            if self.next_part >= MAX_PARTS {
                // The last part S3 allows goes at finish, with whatever is left.
                break;
            }
            let at = self.written - self.buf.len() as u64;
            let part = self.buf.split_to(size).freeze();
            self.keep_sent(at, &part);
            if let Err(e) = self.send_part(part).await {
                self.failed = Some(e.clone());
                return Err(FsError::UploadFailed(e));
            }
        }
        Ok(data.len())
    }

    /// The size of the part the buffer fills next.
    fn next_part_size(&self) -> usize {
        Self::part_size(self.base_part_size, self.next_part).min(self.max_part) as usize
    }

    async fn send_part(&mut self, body: Bytes) -> Result<(), S3Error> {
        if self.upload_id.is_none() {
            self.upload_id = Some(self.start_multipart().await?);
        }
        while self.inflight.len() >= self.max_inflight {
            self.reap_one().await?;
        }
        let share = self.budget.take(body.len()).await;
        let client = self.client.clone();
        let key = self.key.clone();
        let id = self.upload_id.clone().unwrap_or_default();
        let n = self.next_part;
        self.next_part += 1;
        self.inflight.push_back(tokio::spawn(async move {
            let res = client.upload_part(&key, &id, n, body).await;
            drop(share);
            res
        }));
        Ok(())
    }

    async fn reap_one(&mut self) -> Result<(), S3Error> {
        if let Some(handle) = self.inflight.pop_front() {
            let part = handle
                .await
                .map_err(|e| S3Error::Other(format!("part upload task failed: {e}")))??;
            self.parts.push(part);
        }
        Ok(())
    }

    /// Makes everything written durable in S3. On failure the multipart upload is
    /// aborted (so it does not linger and bill) and the error is returned.
    pub async fn finish(&mut self) -> FsResult<ObjectMeta> {
        let result = self.try_finish().await;
        if let Err(e) = &result {
            self.failed = Some(e.clone());
            self.abort().await;
        }
        result.map_err(FsError::UploadFailed)
    }

    async fn try_finish(&mut self) -> Result<ObjectMeta, S3Error> {
        if let Some(e) = &self.failed {
            return Err(e.clone());
        }
        // Not for an empty body: moto never answers a conditional PUT of one.
        let conditions = self.create_only.clone().filter(|_| self.written > 0);
        let rest_at = self.written - self.buf.len() as u64;
        let Some(id) = self.upload_id.clone() else {
            let body = std::mem::take(&mut self.buf).freeze();
            self.keep_sent(rest_at, &body);
            self.meta_sent = self.meta.clone();
            let (client, key, meta) = (&self.client, &self.key, self.meta.as_ref());
            let meta = send_create_only(conditions.as_deref(), |cond| {
                let body = body.clone();
                async move { client.put_object_if(key, body, cond.as_ref(), meta).await }
            })
            .await?;
            self.offer_kept(&meta);
            return Ok(meta);
        };
        if !self.buf.is_empty() {
            let rest = std::mem::take(&mut self.buf).freeze();
            self.keep_sent(rest_at, &rest);
            self.send_part(rest).await?;
        }
        while !self.inflight.is_empty() {
            self.reap_one().await?;
        }
        let parts = std::mem::take(&mut self.parts);
        let (client, key, id) = (&self.client, &self.key, &id);
        let meta = send_create_only(conditions.as_deref(), |cond| {
            let parts = parts.clone();
            async move {
                client
                    .complete_multipart_if(key, id, parts, cond.as_ref())
                    .await
            }
        })
        .await?;
        self.upload_id = None;
        self.offer_kept(&meta);
        Ok(meta)
    }

    fn offer_kept(&mut self, meta: &ObjectMeta) {
        if let Some(k) = self.kept.take() {
            k.offer(&self.key, meta, self.written);
        }
    }

    /// Abandons the upload: nothing written becomes visible.
    pub async fn abort(&mut self) {
        for h in self.inflight.drain(..) {
            h.abort();
        }
        if let Some(id) = self.upload_id.take() {
            if let Err(e) = self.client.abort_multipart(&self.key, &id).await {
                tracing::warn!(key = %self.key, error = %e, "could not abort multipart upload");
            }
        }
        self.buf.clear();
    }
}

/// Runs `send` with `If-None-Match: *` as `conditions` allow (a create-only upload), or
/// without a condition.
async fn send_create_only<T, F, Fut>(conditions: Option<&ConditionalWrites>, send: F) -> S3Result<T>
where
    F: Fn(Option<WriteCondition>) -> Fut,
    Fut: std::future::Future<Output = S3Result<T>>,
{
    match conditions {
        Some(c) => c.send(Some(WriteCondition::IfNoneMatch), send).await,
        None => send(None).await,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::s3::mem::MemClient;

    const MIB: u64 = 1024 * 1024;

    #[test]
    fn part_sizes_cover_five_tib_in_ten_thousand_parts() {
        let base = 8 * 1024 * 1024;
        let total: u64 = (1..=10_000).map(|n| Upload::part_size(base, n)).sum();
        assert!(total >= 5 * 1024u64.pow(4), "{total}");
        assert_eq!(Upload::part_size(base, 1), base);
        assert_eq!(Upload::part_size(base, 1001), 2 * base);
    }

    #[tokio::test]
    async fn multipart_stream_round_trips() {
        let mem = Arc::new(MemClient::new());
        let mut up = Upload::new(mem.clone(), "k".into(), 5, 2, UploadBudget::new(1 << 20));
        let data: Vec<u8> = (0..23u8).collect();
        for chunk in data.chunks(3).enumerate() {
            up.write((chunk.0 * 3) as u64, chunk.1).await.unwrap();
        }
        assert!(
            up.write(0, b"x").await.is_err(),
            "non-sequential write accepted"
        );
        let meta = up.finish().await.unwrap();
        assert_eq!(meta.size, 23);
        assert_eq!(mem.get("k").unwrap().as_ref(), &data[..]);
        assert_eq!(mem.open_uploads(), 0);
    }

    /// An `O_EXCL` create on a store that answers 501 to `If-None-Match`: written without
    /// the condition (one PUT, or the multipart upload completed), and the mount's later
    /// writes send none.
    #[tokio::test]
    async fn exclusive_create_on_a_store_without_conditions_is_written() {
        for size in [4usize, 23] {
            let mem = Arc::new(MemClient::new());
            mem.without_conditional_writes();
            let conditions = Arc::new(ConditionalWrites::default());
            let mut up = Upload::new(mem.clone(), "k".into(), 5, 2, UploadBudget::new(1 << 20))
                .create_only(conditions.clone());
            let data: Vec<u8> = (0..size as u8).collect();
            up.write(0, &data).await.unwrap();
            up.finish().await.unwrap();
            assert_eq!(mem.get("k").unwrap().as_ref(), &data[..], "{size} bytes");
            assert_eq!(mem.open_uploads(), 0);
            assert!(!conditions.honoured());
        }
    }

    #[tokio::test]
    async fn continues_a_short_object_by_reading_it_back() {
        let mem = Arc::new(MemClient::new());
        mem.insert("k", &b"hello "[..]);
        let etag = mem.head_object("k").await.unwrap().etag.unwrap();
        let mut up = Upload::new(
            mem.clone(),
            "k".into(),
            5 * MIB,
            2,
            UploadBudget::new(1 << 20),
        );
        up.continue_from(6, &etag).await.unwrap();
        up.write(6, b"world").await.unwrap();
        up.finish().await.unwrap();
        assert_eq!(mem.get("k").unwrap().as_ref(), b"hello world");
    }

    #[tokio::test]
    async fn continues_a_long_object_by_copying_it_on_the_server() {
        let mem = Arc::new(MemClient::new());
        let first: Vec<u8> = (0..6 * MIB as u32).map(|i| (i % 253) as u8).collect();
        mem.insert("k", first.clone());
        let etag = mem.head_object("k").await.unwrap().etag.unwrap();
        let mut up = Upload::new(
            mem.clone(),
            "k".into(),
            5 * MIB,
            2,
            UploadBudget::new(64 * MIB),
        );
        up.continue_from(first.len() as u64, &etag).await.unwrap();
        assert!(!up.can_truncate(), "the copy is a multipart upload already");
        up.write(first.len() as u64, b"tail").await.unwrap();
        up.finish().await.unwrap();
        let mut want = first;
        want.extend_from_slice(b"tail");
        assert_eq!(mem.get("k").unwrap().as_ref(), &want[..]);
        assert_eq!(mem.open_uploads(), 0);
    }

    #[tokio::test]
    async fn never_continues_a_version_another_client_replaced() {
        let mem = Arc::new(MemClient::new());
        for (size, body) in [
            (3usize, b"abc".to_vec()),
            (6 * MIB as usize, vec![7u8; 6 * MIB as usize]),
        ] {
            mem.insert("k", body.clone());
            let etag = mem.head_object("k").await.unwrap().etag.unwrap();
            let theirs = vec![9u8; size];
            mem.insert("k", theirs.clone());
            let mut up = Upload::new(
                mem.clone(),
                "k".into(),
                5 * MIB,
                2,
                UploadBudget::new(64 * MIB),
            );
            let res = up.continue_from(size as u64, &etag).await;
            assert!(
                matches!(res, Err(FsError::S3(S3Error::PreconditionFailed))),
                "{size}: {res:?}"
            );
            assert_eq!(mem.get("k").unwrap().as_ref(), &theirs[..], "theirs kept");
            assert_eq!(mem.open_uploads(), 0, "no upload left behind");
        }
    }

    #[tokio::test]
    async fn small_file_is_one_put() {
        let mem = Arc::new(MemClient::new());
        let mut up = Upload::new(
            mem.clone(),
            "small".into(),
            1024,
            2,
            UploadBudget::new(1 << 20),
        );
        up.write(0, b"hello").await.unwrap();
        up.finish().await.unwrap();
        assert_eq!(mem.get("small").unwrap().as_ref(), b"hello");
    }

    #[tokio::test]
    async fn uploads_sharing_a_budget_smaller_than_their_parts_all_complete() {
        let mem = Arc::new(MemClient::new());
        // Parts of 256 KiB against a budget of 64 KiB: one part in flight at a time, mount-wide.
        let budget = UploadBudget::new(BUDGET_UNIT);
        let data: Vec<u8> = (0..1_000_000u32).map(|i| (i % 251) as u8).collect();
        let writers = (0..4).map(|w| {
            let (mem, budget, data) = (mem.clone(), budget.clone(), data.clone());
            tokio::spawn(async move {
                let mut up = Upload::new(mem, format!("f{w}"), 256 * 1024, 8, budget);
                for (i, c) in data.chunks(100_000).enumerate() {
                    up.write((i * 100_000) as u64, c).await.unwrap();
                }
                up.finish().await.unwrap();
            })
        });
        for w in writers.collect::<Vec<_>>() {
            w.await.unwrap();
        }
        for w in 0..4 {
            assert_eq!(mem.get(&format!("f{w}")).unwrap().as_ref(), &data[..]);
        }
        assert_eq!(budget.units.available_permits(), 1);
    }
}
