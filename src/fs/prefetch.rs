//! Reads one open object, turning sequential access into parallel ranged GETs.
//!
//! A read at the offset where the previous one ended (or inside the data already being
//! fetched) counts as sequential: chunks ahead of it are requested concurrently, in a
//! window between `initial_window` and `max_window` that follows what the reader gets
//! from the network ([`ReadAheadWindow`]). Any other read is random and costs one ranged GET
//! of at least `MIN_RANDOM_GET`, kept until the next random GET: with direct I/O there is
//! no page cache, so a reader that reads a footer or index in small pieces, or twice, is
//! served from that block. Speculative chunks take their memory from a budget
//! shared by all open files; a chunk the current read needs is fetched even when the
//! budget is exhausted, so progress never waits on other files.

use super::cache::{DataCache, Entry, BLOCK};
use super::error::{FsError, FsResult};
use super::memcache::MemoryCache;
use super::read_ahead::ReadAheadWindow;
use crate::s3::{ObjectClient, S3Error};
use bytes::{Bytes, BytesMut};
use std::collections::VecDeque;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio::task::JoinHandle;

/// Budget accounting unit: permits are 64 KiB each.
pub const BUDGET_UNIT: u64 = 64 * 1024;

/// Smallest ranged GET for a random read: at S3 latencies 128 KiB costs hardly more than
/// 4 KiB, and neighbouring small reads (headers, footers, index pages) then need no GET.
pub const MIN_RANDOM_GET: u64 = 128 * 1024;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PrefetchConfig {
    pub initial_window: u64,
    pub max_window: u64,
    pub max_chunk: u64,
}

impl Default for PrefetchConfig {
    fn default() -> Self {
        Self {
            // Two 4 MiB GETs at once from the first read; up to sixteen 8 MiB GETs (as many
            // as the raw-S3 baseline keeps in flight) while more in flight reads faster.
            initial_window: 8 * 1024 * 1024,
            max_window: 128 * 1024 * 1024,
            max_chunk: 8 * 1024 * 1024,
        }
    }
}

enum ChunkData {
    Pending(JoinHandle<Result<Bytes, S3Error>>),
    Ready(Bytes),
}

struct Chunk {
    start: u64,
    end: u64,
    data: ChunkData,
    _permit: Option<OwnedSemaphorePermit>,
    /// Given to the data cache already.
    cached: bool,
}

impl Drop for Chunk {
    fn drop(&mut self) {
        if let ChunkData::Pending(h) = &self.data {
            h.abort();
        }
    }
}

impl Chunk {
    async fn bytes(&mut self) -> Result<Bytes, S3Error> {
        if let ChunkData::Pending(h) = &mut self.data {
            let b = h
                .await
                .map_err(|e| S3Error::Other(format!("read task failed: {e}")))??;
            self.data = ChunkData::Ready(b);
        }
        match &self.data {
            ChunkData::Ready(b) => Ok(b.clone()),
            ChunkData::Pending(_) => unreachable!("chunk resolved above"),
        }
    }
}

/// Bytes `start..end` of `key`, of the version `etag` when one is known, and exactly
/// that many: a short body means the object is not the one that was opened.
async fn get_exact(
    client: &Arc<dyn ObjectClient>,
    key: &str,
    etag: Option<&str>,
    start: u64,
    end: u64,
) -> Result<Bytes, S3Error> {
    let body = match etag {
        Some(e) => client.get_range_if_match(key, e, start, end).await?,
        None => client.get_range(key, start, end).await?,
    };
    if body.len() as u64 != end - start {
        tracing::warn!(
            key,
            want = end - start,
            got = body.len(),
            "short body from S3"
        );
        return Err(S3Error::PreconditionFailed);
    }
    Ok(body)
}

/// A read's failure; `PreconditionFailed` means the object was replaced since it was opened.
fn read_error(e: S3Error) -> FsError {
    match e {
        S3Error::PreconditionFailed => FsError::Stale,
        e => FsError::S3(e),
    }
}

pub struct Prefetcher {
    client: Arc<dyn ObjectClient>,
    key: String,
    /// The version opened: every GET asks for it.
    etag: Option<String>,
    size: u64,
    cfg: PrefetchConfig,
    budget: Arc<Semaphore>,
    chunks: VecDeque<Chunk>,
    /// End of the last chunk requested.
    next_fetch: u64,
    window: ReadAheadWindow,
    last_end: Option<u64>,
    /// The last random GET: (start offset, bytes).
    random_block: Option<(u64, Bytes)>,
    /// GET requests issued, for tests and stats.
    pub requests: u64,
    /// This version's entry in the data cache: reads it holds need no GET, and what
    /// GETs bring back is offered to it.
    cache: Option<CachedVersion>,
    /// Every read so far continued the previous one from offset 0: a whole-file reader.
    in_order_from_start: bool,
    /// `--cache-memory`: what random reads fetched, shared by every handle.
    memory: Option<Arc<MemoryCache>>,
    /// A read returned bytes of this version: from then on a replaced object is ESTALE
    /// for this reader (see [`Prefetcher::served_any`]).
    served: bool,
}

struct CachedVersion {
    cache: Arc<DataCache>,
    entry: Arc<Entry>,
    /// Read to its end: at the close, what the cache did not keep is fetched again.
    backfill: Option<Arc<dyn ObjectClient>>,
}

impl Drop for CachedVersion {
    fn drop(&mut self) {
        if let Some(client) = self.backfill.take() {
            if !self.entry.is_complete() {
                self.cache.backfill(&self.entry, client);
            }
        }
        self.cache.release(&self.entry);
    }
}

impl Prefetcher {
    /// The object it reads.
    pub fn key(&self) -> &str {
        &self.key
    }

    pub fn new(
        client: Arc<dyn ObjectClient>,
        key: String,
        etag: Option<String>,
        size: u64,
        cfg: PrefetchConfig,
        budget: Arc<Semaphore>,
    ) -> Self {
        Self {
            client,
            key,
            etag,
            size,
            cfg,
            budget,
            chunks: VecDeque::new(),
            next_fetch: 0,
            window: ReadAheadWindow::new(cfg.initial_window, cfg.max_window, cfg.max_chunk),
            last_end: None,
            random_block: None,
            requests: 0,
            cache: None,
            in_order_from_start: true,
            memory: None,
            served: false,
        }
    }

    /// Whether a read returned bytes yet. A reader that has returned none may move to
    /// the current version of a replaced object without mixing two versions.
    pub fn served_any(&self) -> bool {
        self.served
    }

    /// Reads go to the data cache first, and what is fetched goes into it (only for a
    /// version with an ETag: the cache names versions by it).
    pub fn with_cache(mut self, cache: &Arc<DataCache>) -> Self {
        if let Some(etag) = &self.etag {
            self.cache = cache
                .entry(&self.key, etag, self.size)
                .map(|entry| CachedVersion {
                    cache: cache.clone(),
                    entry,
                    backfill: None,
                });
        }
        self
    }

    /// Random reads are looked up in, and what they fetch kept in, `memory`.
    pub fn with_memory(mut self, memory: Arc<MemoryCache>) -> Self {
        if self.etag.is_some() {
            self.memory = Some(memory);
        }
        self
    }

    /// This version's entry in the data cache, if it has one.
    pub fn cached(&self) -> Option<(&Arc<DataCache>, &Arc<Entry>)> {
        self.cache.as_ref().map(|c| (&c.cache, &c.entry))
    }

    fn reset(&mut self, at: u64) {
        self.chunks.clear();
        self.next_fetch = at;
        self.window.reset();
    }

    pub async fn read(&mut self, offset: u64, len: u32) -> FsResult<Bytes> {
        let r = self.read_range(offset, len).await;
        if r.as_ref().is_ok_and(|b| !b.is_empty()) {
            self.served = true;
        }
        r
    }

    async fn read_range(&mut self, offset: u64, len: u32) -> FsResult<Bytes> {
        if offset >= self.size || len == 0 {
            return Ok(Bytes::new());
        }
        let end = (offset + len as u64).min(self.size);
        if self.last_end != Some(offset) && !(self.last_end.is_none() && offset == 0) {
            self.in_order_from_start = false;
        }
        if let Some(c) = &mut self.cache {
            // Only a reader of the whole file asks for the rest: a footer read must not
            // fetch the object.
            if end == self.size && self.in_order_from_start && c.backfill.is_none() {
                c.backfill = Some(self.client.clone());
            }
            if let Some(hit) = c.entry.read(&c.cache, offset, end) {
                self.last_end = Some(end);
                return Ok(hit);
            }
            c.cache.stats.misses.fetch_add(1, Ordering::Relaxed);
        }
        if let (Some(m), Some(etag)) = (&self.memory, &self.etag) {
            if let Some(hit) = m.get(&self.key, etag, offset, end) {
                self.last_end = Some(end);
                return Ok(hit);
            }
        }
        if let Some((start, block)) = &self.random_block {
            if *start <= offset && end <= start + block.len() as u64 {
                let from = (offset - start) as usize;
                let out = block.slice(from..from + (end - offset) as usize);
                self.last_end = Some(end);
                return Ok(out);
            }
        }
        let in_window = self
            .chunks
            .front()
            .is_some_and(|c| c.start <= offset && offset < self.next_fetch);
        // A first read at offset 0 is how sequential readers (cp, cat, tar) begin.
        let continues = self.last_end == Some(offset) || (self.last_end.is_none() && offset == 0);
        if !in_window && !continues {
            // Slightly behind the window: an out-of-order kernel readahead request.
            // Serve it directly and keep the stream going.
            let just_behind = self
                .chunks
                .front()
                .is_some_and(|c| offset < c.start && c.start - offset <= self.cfg.max_chunk);
            if !just_behind {
                self.reset(end);
                self.last_end = Some(end);
            }
            self.requests += 1;
            let (mut fetch_start, mut fetch_end) = (offset, end.max(offset + MIN_RANDOM_GET));
            if self.cache.is_some() {
                // Whole blocks: what the data cache can keep.
                fetch_start = offset / BLOCK * BLOCK;
                fetch_end = fetch_end.div_ceil(BLOCK) * BLOCK;
            }
            let fetch_end = fetch_end.min(self.size);
            let block = get_exact(
                &self.client,
                &self.key,
                self.etag.as_deref(),
                fetch_start,
                fetch_end,
            )
            .await
            .map_err(read_error)?;
            if let Some(c) = &self.cache {
                c.cache.offer_read(&c.entry, fetch_start, block.clone());
            }
            if let (Some(m), Some(etag)) = (&self.memory, &self.etag) {
                m.put(&self.key, etag, fetch_start, block.clone());
            }
            let from = ((offset - fetch_start) as usize).min(block.len());
            let to = (from + (end - offset) as usize).min(block.len());
            let out = block.slice(from..to);
            self.random_block = Some((fetch_start, block));
            return Ok(out);
        }
        if !in_window {
            self.reset(offset);
        }
        while self.chunks.front().is_some_and(|c| c.end <= offset) {
            self.chunks.pop_front();
        }
        let started = Instant::now();
        self.schedule(end);
        let out = self.collect(offset, end).await;
        match &out {
            Ok((bytes, waited)) => {
                self.window
                    .consumed(bytes.len() as u64, *waited, started, Instant::now())
            }
            Err(_) => self.reset(end),
        }
        self.last_end = Some(end);
        out.map(|(bytes, _)| bytes)
    }

    fn schedule(&mut self, needed_end: u64) {
        let window = self.window.current();
        while self.next_fetch < self.size && self.next_fetch < needed_end + window {
            // Half a window at most, so that two GETs are in flight from the start.
            let chunk_len = (window / 2)
                .max(BUDGET_UNIT)
                .min(self.cfg.max_chunk)
                .max(
                    needed_end
                        .saturating_sub(self.next_fetch)
                        .min(self.cfg.max_chunk),
                )
                .min(self.size - self.next_fetch);
            let needed = self.next_fetch < needed_end;
            let units = chunk_len.div_ceil(BUDGET_UNIT) as u32;
            let permit = self.budget.clone().try_acquire_many_owned(units).ok();
            if permit.is_none() && !needed {
                break;
            }
            // Over budget, fetch only what this read needs: memory then grows by one read
            // per open file, not by one window.
            let chunk_len = if permit.is_none() {
                needed_end - self.next_fetch
            } else {
                chunk_len
            };
            let (start, end) = (self.next_fetch, self.next_fetch + chunk_len);
            let client = self.client.clone();
            let key = self.key.clone();
            let etag = self.etag.clone();
            self.requests += 1;
            let task =
                tokio::spawn(
                    async move { get_exact(&client, &key, etag.as_deref(), start, end).await },
                );
            self.chunks.push_back(Chunk {
                start,
                end,
                data: ChunkData::Pending(task),
                _permit: permit,
                cached: false,
            });
            self.next_fetch = end;
        }
    }

    /// Bytes `offset..end` from the chunks, and how long the read waited for them.
    async fn collect(&mut self, offset: u64, end: u64) -> FsResult<(Bytes, Duration)> {
        let mut parts: Vec<Bytes> = Vec::new();
        let mut waited = Duration::ZERO;
        for chunk in self.chunks.iter_mut() {
            if chunk.end <= offset {
                continue;
            }
            if chunk.start >= end {
                break;
            }
            let bytes = if matches!(chunk.data, ChunkData::Pending(_)) {
                let t = Instant::now();
                let bytes = chunk.bytes().await;
                waited += t.elapsed();
                bytes
            } else {
                chunk.bytes().await
            }
            .map_err(read_error)?;
            if let (Some(c), false) = (&self.cache, chunk.cached) {
                chunk.cached = true;
                c.cache.offer_read(&c.entry, chunk.start, bytes.clone());
            }
            let from = (offset.max(chunk.start) - chunk.start) as usize;
            let to = ((end.min(chunk.end) - chunk.start) as usize).min(bytes.len());
            parts.push(bytes.slice(from.min(to)..to));
        }
        if parts.len() == 1 {
            return Ok((parts.pop().unwrap_or_default(), waited));
        }
        let mut out = BytesMut::with_capacity((end - offset) as usize);
        for p in parts {
            out.extend_from_slice(&p);
        }
        Ok((out.freeze(), waited))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::s3::mem::MemClient;

    fn setup(size: usize, budget_units: usize) -> (Arc<MemClient>, Vec<u8>, Arc<Semaphore>) {
        let mem = Arc::new(MemClient::new());
        let data: Vec<u8> = (0..size).map(|i| (i * 7 % 251) as u8).collect();
        mem.insert("obj", data.clone());
        (mem, data, Arc::new(Semaphore::new(budget_units)))
    }

    fn cfg() -> PrefetchConfig {
        PrefetchConfig {
            initial_window: 4096,
            max_window: 64 * 1024,
            max_chunk: 16 * 1024,
        }
    }

    #[tokio::test]
    async fn sequential_read_returns_exact_bytes_with_few_requests() {
        let (mem, data, budget) = setup(1_000_000, 1000);
        let mut p = Prefetcher::new(mem, "obj".into(), None, data.len() as u64, cfg(), budget);
        let mut got = Vec::new();
        let mut off = 0;
        while off < data.len() as u64 {
            let b = p.read(off, 4096).await.unwrap();
            off += b.len() as u64;
            got.extend_from_slice(&b);
        }
        assert_eq!(got, data);
        // 16 KiB chunks once the window has grown: far fewer GETs than 4 KiB reads.
        assert!(p.requests < 100, "{} requests", p.requests);
    }

    #[tokio::test]
    async fn random_reads_are_exact() {
        let (mem, data, budget) = setup(100_000, 1000);
        let mut p = Prefetcher::new(mem, "obj".into(), None, data.len() as u64, cfg(), budget);
        for off in [90_000u64, 5, 50_000, 99_990, 12_345] {
            let b = p.read(off, 1000).await.unwrap();
            let end = (off as usize + 1000).min(data.len());
            assert_eq!(&b[..], &data[off as usize..end]);
        }
    }

    #[tokio::test]
    async fn small_random_reads_near_each_other_cost_one_get() {
        let (mem, data, budget) = setup(1_000_000, 1000);
        let mut p = Prefetcher::new(mem, "obj".into(), None, data.len() as u64, cfg(), budget);
        // a footer read the way a Parquet or zip reader does: the tail, then pieces of it
        let tail = data.len() as u64 - 100_000;
        for (off, len) in [
            (tail, 8u32),
            (tail + 50_000, 4096),
            (tail, 4096),
            (tail + 99_990, 10),
        ] {
            let b = p.read(off, len).await.unwrap();
            let end = (off as usize + len as usize).min(data.len());
            assert_eq!(&b[..], &data[off as usize..end], "read at {off}");
        }
        assert_eq!(p.requests, 1);
        // far away: another GET, exact bytes
        let b = p.read(10_000, 100).await.unwrap();
        assert_eq!(&b[..], &data[10_000..10_100]);
        assert_eq!(p.requests, 2);
    }

    #[tokio::test]
    async fn exhausted_budget_still_makes_progress() {
        let (mem, data, budget) = setup(200_000, 0);
        let mut p = Prefetcher::new(mem, "obj".into(), None, data.len() as u64, cfg(), budget);
        let mut off = 0;
        while off < data.len() as u64 {
            let b = p.read(off, 8192).await.unwrap();
            assert_eq!(&b[..], &data[off as usize..off as usize + b.len()]);
            off += b.len() as u64;
        }
    }
}
