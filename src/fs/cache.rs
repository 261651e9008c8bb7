//! The data cache (`--data-cache`): versions of objects kept on local disk, so that the
//! second read of a file is served from there, not from S3.
//!
//! An entry is one version of one object (key + ETag: an object replaced in S3 is another
//! entry, never served for the old one) in blocks of [`BLOCK`] bytes: a sparse file with
//! the blocks fetched so far, an append-only index naming them, and a header naming the
//! version. A block's index record is appended only once its bytes are written, and
//! carries their CRC-32: a crash leaves at most bytes no record names (never served), and
//! the first read of each block after a restart checks it against its record (a mismatch
//! drops the block, with a log line). Entries live in `<cache-dir>/data`, found again by
//! the next mounter of the same directory (a lock keeps a second one out: it runs
//! without the cache).
//!
//! Space: staged edits and cached blocks share `--cache-size`; the least recently used
//! entries go first, and also while the disk has less than `--cache-free` free. Blocks are
//! written by one background thread from what reads fetched; when it falls behind, a
//! block is dropped, never waited for, so a first read is not slowed by the cache.

use bytes::{Bytes, BytesMut};
use futures::StreamExt;
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, HashMap};
use std::fs::File;
use std::io::{Read, Write};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::{sync_channel, Receiver, SyncSender, TrySendError};
use std::sync::{Arc, Mutex, MutexGuard};

/// Cache granularity: what a miss fetches at least, and what an index record names.
pub const BLOCK: u64 = 1024 * 1024;
/// Fetched bytes waiting for the writer thread (their memory is held meanwhile); past
/// this, new ones are dropped.
const WRITE_QUEUE_BYTES: u64 = 64 * 1024 * 1024;
/// GETs a background fill keeps in flight (`DataCache::backfill`).
const FILL_GETS: usize = 4;
/// Of those, what uploads may hold until S3 names their version: the rest stays for reads.
const HELD_FOR_WRITES: u64 = WRITE_QUEUE_BYTES / 2;
/// The writer thread's nice value where SCHED_IDLE is refused (see `write_blocks`).
const WRITER_NICE: i32 = 19;
/// What the writer thread hands the kernel at once (see `DataCache::write`).
const WRITE_PIECE: usize = 64 * 1024;
/// An index record: block number, length, CRC-32 of the bytes, CRC-32 of those 12 bytes.
const RECORD: usize = 16;

/// What the cache did, for the mounter's metrics.
#[derive(Default)]
pub struct CacheStats {
    /// Reads served wholly from the cache, and their bytes.
    pub hits: AtomicU64,
    pub hit_bytes: AtomicU64,
    /// Opens whose reads the kernel serves from the cache file itself (passthrough).
    pub passthrough_opens: AtomicU64,
    /// Reads of a cached object's version that needed S3.
    pub misses: AtomicU64,
    pub written_bytes: AtomicU64,
    /// Entries removed to make room.
    pub evictions: AtomicU64,
    /// Fetched blocks not kept: the writer was behind, or there was no room.
    pub dropped: AtomicU64,
    /// Blocks whose bytes did not match their record (after a crash, or a damaged disk).
    pub corrupt: AtomicU64,
}

#[derive(Serialize, Deserialize)]
struct Header {
    key: String,
    etag: String,
    size: u64,
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Block {
    Absent,
    /// Written by a predecessor: checked against the CRC before it is first served.
    Unverified(u32),
    Good,
}

/// One version of one object, as far as it is cached.
pub struct Entry {
    name: String,
    key: String,
    etag: String,
    size: u64,
    /// The data and index files, once the first block is written.
    files: Mutex<Option<(File, File)>>,
    blocks: Mutex<Vec<Block>>,
    /// Bytes of the blocks present.
    bytes: AtomicU64,
    /// Position in the LRU order (0: not in it yet).
    tick: AtomicU64,
    /// Evicted or dropped: serves and keeps nothing more.
    dead: AtomicBool,
    /// A background fill of the blocks reads did not keep is running (see `backfill`).
    filling: AtomicBool,
}

struct State {
    entries: HashMap<(String, String), Arc<Entry>>,
    names: HashMap<String, (String, String)>,
    /// Entries with blocks, least recently used first.
    lru: BTreeMap<u64, Arc<Entry>>,
    tick: u64,
    used: u64,
}

pub struct DataCache {
    dir: PathBuf,
    limit: u64,
    /// Keep this share (percent) of the disk free.
    min_free_percent: u8,
    /// Local bytes others (staged edits) take from the same `limit`.
    others: Box<dyn Fn() -> u64 + Send + Sync>,
    state: Mutex<State>,
    queue: SyncSender<Job>,
    /// Bytes in `queue`.
    queued: AtomicU64,
    /// Bytes uploads hold for the cache (see `hold`).
    held: AtomicU64,
    /// When a read last brought fetched bytes (ms after `opened`): the background fill
    /// waits while reads fetch, so that it never takes their share of the link.
    last_read_ms: AtomicU64,
    opened: std::time::Instant,
    pub stats: CacheStats,
    /// Held while this process uses the directory.
    _lock: File,
}

struct Job {
    entry: Arc<Entry>,
    start: u64,
    data: Bytes,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

#[derive(Debug, thiserror::Error)]
pub enum CacheError {
    #[error("cannot use the cache directory {0}: {1}")]
    Dir(PathBuf, std::io::Error),
    #[error("the cache directory {0} is in use by another mounter")]
    InUse(PathBuf),
}

fn record(block: u32, len: u32, crc: u32) -> [u8; RECORD] {
    let mut r = [0u8; RECORD];
    r[0..4].copy_from_slice(&block.to_le_bytes());
    r[4..8].copy_from_slice(&len.to_le_bytes());
    r[8..12].copy_from_slice(&crc.to_le_bytes());
    let check = crc32fast::hash(&r[0..12]);
    r[12..16].copy_from_slice(&check.to_le_bytes());
    r
}

impl Entry {
    fn blocks_of(size: u64) -> usize {
        size.div_ceil(BLOCK) as usize
    }

    fn block_len(&self, b: usize) -> u64 {
        (self.size - b as u64 * BLOCK).min(BLOCK)
    }

    pub fn key(&self) -> &str {
        &self.key
    }

    /// Bytes `offset..end` if every block they touch is cached (and, for blocks a
    /// predecessor wrote, matches its checksum); `None` sends the read to S3.
    pub fn read(&self, cache: &DataCache, offset: u64, end: u64) -> Option<Bytes> {
        if self.dead.load(Ordering::Relaxed) || end <= offset || end > self.size {
            return None;
        }
        let (first, last) = ((offset / BLOCK) as usize, ((end - 1) / BLOCK) as usize);
        let mut unverified = Vec::new();
        {
            let blocks = lock(&self.blocks);
            for b in first..=last {
                match blocks[b] {
                    Block::Absent => return None,
                    Block::Unverified(crc) => unverified.push((b, crc)),
                    Block::Good => {}
                }
            }
        }
        let files = lock(&self.files);
        let (data, _) = files.as_ref()?;
        if !self.verify(cache, data, unverified) {
            return None;
        }
        let mut out = BytesMut::zeroed((end - offset) as usize);
        data.read_exact_at(&mut out, offset).ok()?;
        drop(files);
        cache.touch(self);
        cache.stats.hits.fetch_add(1, Ordering::Relaxed);
        cache
            .stats
            .hit_bytes
            .fetch_add(end - offset, Ordering::Relaxed);
        Some(out.freeze())
    }

    /// Checks blocks a predecessor wrote against their records; false (the first bad one
    /// dropped, with a log line) if one does not match.
    fn verify(&self, cache: &DataCache, data: &File, unverified: Vec<(usize, u32)>) -> bool {
        for (b, crc) in unverified {
            let mut buf = vec![0u8; self.block_len(b) as usize];
            let ok = data.read_exact_at(&mut buf, b as u64 * BLOCK).is_ok()
                && crc32fast::hash(&buf) == crc;
            let mut blocks = lock(&self.blocks);
            if ok {
                blocks[b] = Block::Good;
            } else {
                blocks[b] = Block::Absent;
                drop(blocks);
                cache.stats.corrupt.fetch_add(1, Ordering::Relaxed);
                tracing::warn!(key = %self.key, block = b,
                    "a cached block does not match its checksum; dropped, read from S3");
                self.bytes.fetch_sub(self.block_len(b), Ordering::Relaxed);
                lock(&cache.state).used -= self.block_len(b);
                return false;
            }
        }
        true
    }

    /// A read-only descriptor of the data file, if every block is cached and checked:
    /// what the kernel may read the whole version from by itself (FUSE passthrough). The
    /// file is only ever unlinked while open (eviction), never rewritten, so what it
    /// reads stays this version's bytes. Reads the blocks a predecessor wrote to check
    /// them: call it off the async workers.
    pub fn backing_file(&self, cache: &DataCache) -> Option<File> {
        if self.dead.load(Ordering::Relaxed) {
            return None;
        }
        let unverified = {
            let blocks = lock(&self.blocks);
            let mut v = Vec::new();
            for (b, state) in blocks.iter().enumerate() {
                match state {
                    Block::Absent => return None,
                    Block::Unverified(crc) => v.push((b, *crc)),
                    Block::Good => {}
                }
            }
            v
        };
        let files = lock(&self.files);
        let (data, _) = files.as_ref()?;
        if !self.verify(cache, data, unverified) {
            return None;
        }
        // The descriptor this entry holds, opened again read-only: its path may already
        // name another entry's file (evicted, and the version cached afresh), its inode
        // cannot.
        let fd = std::os::fd::AsRawFd::as_raw_fd(data);
        let file = File::open(format!("/proc/self/fd/{fd}")).ok()?;
        drop(files);
        cache.touch(self);
        cache
            .stats
            .passthrough_opens
            .fetch_add(1, Ordering::Relaxed);
        Some(file)
    }

    /// Blocks not cached (dropped while the writer was behind, or never read).
    fn missing(&self) -> Vec<usize> {
        let blocks = lock(&self.blocks);
        (0..blocks.len())
            .filter(|b| blocks[*b] == Block::Absent)
            .collect()
    }

    /// Whether every block is cached (and none still waits for its check).
    pub fn is_complete(&self) -> bool {
        !self.dead.load(Ordering::Relaxed) && lock(&self.blocks).iter().all(|b| *b == Block::Good)
    }
}

impl DataCache {
    /// The cache in `dir` (created, mode 0700), with what a predecessor left there.
    pub fn open(
        dir: &Path,
        limit: u64,
        min_free_percent: u8,
        others: Box<dyn Fn() -> u64 + Send + Sync>,
    ) -> Result<Arc<Self>, CacheError> {
        use std::os::unix::fs::DirBuilderExt;
        let err = |e| CacheError::Dir(dir.to_path_buf(), e);
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(dir)
            .map_err(err)?;
        let lock_file = std::fs::OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(dir.join("lock"))
            .map_err(err)?;
        // SAFETY: flock on a descriptor we own.
        if unsafe {
            libc::flock(
                std::os::fd::AsRawFd::as_raw_fd(&lock_file),
                libc::LOCK_EX | libc::LOCK_NB,
            )
        } != 0
        {
            return Err(CacheError::InUse(dir.to_path_buf()));
        }
        let (queue, jobs) = sync_channel(1024);
        let cache = Arc::new(Self {
            dir: dir.to_path_buf(),
            limit,
            min_free_percent,
            others,
            state: Mutex::new(State {
                entries: HashMap::new(),
                names: HashMap::new(),
                lru: BTreeMap::new(),
                tick: 0,
                used: 0,
            }),
            queue,
            queued: AtomicU64::new(0),
            held: AtomicU64::new(0),
            last_read_ms: AtomicU64::new(0),
            opened: std::time::Instant::now(),
            stats: CacheStats::default(),
            _lock: lock_file,
        });
        cache.load();
        let writer = Arc::downgrade(&cache);
        std::thread::Builder::new()
            .name("s3csi-cache-writer".into())
            .spawn(move || write_blocks(writer, jobs))
            .map_err(err)?;
        Ok(cache)
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Bytes of cached blocks on disk.
    pub fn used(&self) -> u64 {
        lock(&self.state).used
    }

    /// Entries with at least one block.
    pub fn entries(&self) -> usize {
        lock(&self.state).lru.len()
    }

    /// The entry of version `etag` of `key` (`size` bytes), made if there is none.
    pub fn entry(&self, key: &str, etag: &str, size: u64) -> Option<Arc<Entry>> {
        if size == 0 {
            return None;
        }
        let mut st = lock(&self.state);
        let id = (key.to_string(), etag.to_string());
        if let Some(e) = st.entries.get(&id) {
            if e.size == size {
                return Some(e.clone());
            }
            // The same ETag with another size: not a version we can trust; start afresh.
            let old = e.clone();
            self.remove_locked(&mut st, &old);
        }
        let mut name = version_name(key, etag);
        while st.names.contains_key(&name) {
            name.push('x');
        }
        let e = Arc::new(Entry {
            name: name.clone(),
            key: key.to_string(),
            etag: etag.to_string(),
            size,
            files: Mutex::new(None),
            blocks: Mutex::new(vec![Block::Absent; Entry::blocks_of(size)]),
            bytes: AtomicU64::new(0),
            tick: AtomicU64::new(0),
            dead: AtomicBool::new(false),
            filling: AtomicBool::new(false),
        });
        st.names.insert(name, id.clone());
        st.entries.insert(id, e.clone());
        Some(e)
    }

    /// A reader is done with `e`: an entry that never got a block is forgotten.
    pub fn release(&self, e: &Arc<Entry>) {
        let mut st = lock(&self.state);
        // Ours, the table's: nobody else holds it.
        if e.bytes.load(Ordering::Relaxed) == 0 && Arc::strong_count(e) <= 2 {
            let id = (e.key.clone(), e.etag.clone());
            if st.entries.get(&id).is_some_and(|cur| Arc::ptr_eq(cur, e))
                && e.tick.load(Ordering::Relaxed) == 0
            {
                st.entries.remove(&id);
                st.names.remove(&e.name);
            }
        }
    }

    /// Takes `len` bytes of an allowance for data held until it can be offered (an
    /// upload's parts, until S3 names the version they make): half the write queue's, so
    /// that long uploads never leave reads without room; false when it is used up.
    /// [`Self::unhold`] gives it back.
    pub fn hold(&self, len: u64) -> bool {
        if self.held.fetch_add(len, Ordering::Relaxed) + len > HELD_FOR_WRITES {
            self.held.fetch_sub(len, Ordering::Relaxed);
            return false;
        }
        true
    }

    pub fn unhold(&self, len: u64) {
        self.held.fetch_sub(len, Ordering::Relaxed);
    }

    /// What an upload wrote, now version `etag` of `key` (`size` bytes): the pieces
    /// `(offset, bytes)` are kept like fetched ones, so that reading a file written here
    /// needs no GET.
    pub fn offer_written(&self, key: &str, etag: &str, size: u64, pieces: Vec<(u64, Bytes)>) {
        let Some(e) = self.entry(key, etag, size) else {
            return;
        };
        for (at, bytes) in pieces {
            if at + bytes.len() as u64 <= size {
                self.offer(&e, at, bytes);
            }
        }
        self.release(&e);
    }

    /// What a read fetched from S3 for `e`: kept as [`Self::offer`] keeps it, and the
    /// background fill holds back for a while (see `backfill`).
    pub fn offer_read(&self, e: &Arc<Entry>, start: u64, data: Bytes) {
        self.last_read_ms
            .store(self.opened.elapsed().as_millis() as u64, Ordering::Relaxed);
        self.offer(e, start, data);
    }

    /// Did a read fetch anything in the last 200 ms?
    fn reads_fetching(&self) -> bool {
        let now = self.opened.elapsed().as_millis() as u64;
        now.saturating_sub(self.last_read_ms.load(Ordering::Relaxed)) < 200
    }

    /// Bytes `start..` fetched from S3 for `e`: the whole blocks among them are kept, in
    /// the background (dropped when the writer is behind).
    pub fn offer(&self, e: &Arc<Entry>, start: u64, data: Bytes) {
        let end = start + data.len() as u64;
        let first = start.div_ceil(BLOCK) * BLOCK;
        let last = if end == e.size {
            end
        } else {
            end / BLOCK * BLOCK
        };
        if first >= last || e.dead.load(Ordering::Relaxed) {
            return;
        }
        {
            let blocks = lock(&e.blocks);
            let (b0, b1) = ((first / BLOCK) as usize, (last - 1) / BLOCK);
            if blocks[b0..=b1 as usize].iter().all(|b| *b != Block::Absent) {
                return;
            }
        }
        let len = last - first;
        let blocks = len.div_ceil(BLOCK);
        if self.queued.fetch_add(len, Ordering::Relaxed) + len > WRITE_QUEUE_BYTES {
            self.queued.fetch_sub(len, Ordering::Relaxed);
            self.stats.dropped.fetch_add(blocks, Ordering::Relaxed);
            return;
        }
        let job = Job {
            entry: e.clone(),
            start: first,
            data: data.slice((first - start) as usize..(last - start) as usize),
        };
        if let Err(TrySendError::Full(_) | TrySendError::Disconnected(_)) = self.queue.try_send(job)
        {
            self.queued.fetch_sub(len, Ordering::Relaxed);
            self.stats.dropped.fetch_add(blocks, Ordering::Relaxed);
        }
    }

    /// A reader read `e` to its end, but not every block was kept (the writer thread
    /// runs on idle CPU only and drops what it cannot keep up with, so a fast first read
    /// leaves gaps): the missing blocks are fetched again in the background, in ranges of
    /// at most 8 MiB, `FILL_GETS` at once, only while the write queue has room and no read
    /// fetches, so that the next read is served wholly from the cache (and may pass
    /// through). Costs GETs only for those blocks.
    pub fn backfill(self: &Arc<Self>, e: &Arc<Entry>, client: Arc<dyn crate::s3::ObjectClient>) {
        if e.dead.load(Ordering::Relaxed) || e.filling.swap(true, Ordering::Relaxed) {
            return;
        }
        let Ok(rt) = tokio::runtime::Handle::try_current() else {
            e.filling.store(false, Ordering::Relaxed);
            return;
        };
        let (cache, e) = (self.clone(), e.clone());
        rt.spawn(async move {
            // What is still queued is not missing: let the writer catch up first.
            for _ in 0..500 {
                if cache.queued.load(Ordering::Relaxed) == 0 {
                    break;
                }
                tokio::time::sleep(std::time::Duration::from_millis(20)).await;
            }
            let mut runs: Vec<(usize, usize)> = Vec::new();
            for b in e.missing() {
                match runs.last_mut() {
                    Some(r) if r.1 == b && r.1 - r.0 < 8 => r.1 += 1,
                    _ => runs.push((b, b + 1)),
                }
            }
            // Up to FILL_GETS ranges in flight: one GET at a time leaves a 1 GiB file
            // incomplete for seconds after its read (a round trip per 8 MiB). Each range
            // waits for reads first (they fetch, or the write queue lacks room for it
            // and the ranges before it: a minute at most; the next whole read starts
            // the fill again), so the fill never crowds a reader out.
            let in_flight = Arc::new(AtomicU64::new(0));
            let fetches = runs.into_iter().map(|(first, last)| {
                let (cache, e, client, in_flight) =
                    (cache.clone(), e.clone(), client.clone(), in_flight.clone());
                async move {
                    let start = first as u64 * BLOCK;
                    let end = (last as u64 * BLOCK).min(e.size);
                    let mut waited = 0;
                    while cache.queued.load(Ordering::Relaxed)
                        + in_flight.load(Ordering::Relaxed)
                        + (end - start)
                        > WRITE_QUEUE_BYTES / 2
                        || cache.reads_fetching()
                    {
                        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
                        waited += 1;
                        if waited > 3000 || e.dead.load(Ordering::Relaxed) {
                            return false;
                        }
                    }
                    in_flight.fetch_add(end - start, Ordering::Relaxed);
                    let got = client.get_range_if_match(&e.key, &e.etag, start, end).await;
                    let ok = match got {
                        Ok(body) if body.len() as u64 == end - start => {
                            cache.offer(&e, start, body);
                            true
                        }
                        // Replaced in S3, or failing: the entry stays as it is.
                        _ => false,
                    };
                    in_flight.fetch_sub(end - start, Ordering::Relaxed);
                    ok
                }
            });
            let mut fetches = futures::stream::iter(fetches).buffer_unordered(FILL_GETS);
            while let Some(ok) = fetches.next().await {
                if !ok {
                    break;
                }
            }
            e.filling.store(false, Ordering::Relaxed);
        });
    }

    fn touch(&self, e: &Entry) {
        let mut st = lock(&self.state);
        let old = e.tick.load(Ordering::Relaxed);
        if old == 0 {
            return;
        }
        st.tick += 1;
        let now = st.tick;
        if let Some(entry) = st.lru.remove(&old) {
            e.tick.store(now, Ordering::Relaxed);
            st.lru.insert(now, entry);
        }
    }

    fn remove_locked(&self, st: &mut State, e: &Arc<Entry>) {
        e.dead.store(true, Ordering::Relaxed);
        st.entries.remove(&(e.key.clone(), e.etag.clone()));
        st.names.remove(&e.name);
        st.lru.remove(&e.tick.load(Ordering::Relaxed));
        st.used -= e.bytes.swap(0, Ordering::Relaxed).min(st.used);
        for ext in ["json", "index", "blocks"] {
            let _ = std::fs::remove_file(self.dir.join(format!("{}.{ext}", e.name)));
        }
    }

    /// Room for `need` more bytes (for `keep`): least recently used entries go until the
    /// limit (less what staged edits take) and the disk's free share allow it. False if
    /// no room can be made.
    fn make_room(&self, need: u64, keep: Option<&Arc<Entry>>) -> bool {
        let others = (self.others)();
        let mut short_of_disk = if need > 0 {
            self.disk_shortfall(need)
        } else {
            0
        };
        let mut st = lock(&self.state);
        loop {
            let over = (st.used + need + others).saturating_sub(self.limit);
            if over == 0 && short_of_disk == 0 {
                return true;
            }
            let victim = st
                .lru
                .iter()
                .find(|(_, e)| keep.is_none_or(|k| !Arc::ptr_eq(e, k)))
                .map(|(_, e)| e.clone());
            let Some(v) = victim else {
                return false;
            };
            let freed = v.bytes.load(Ordering::Relaxed);
            self.remove_locked(&mut st, &v);
            self.stats.evictions.fetch_add(1, Ordering::Relaxed);
            short_of_disk = short_of_disk.saturating_sub(freed);
        }
    }

    /// Staged edits grew: cached entries make room for them (edits come first).
    pub fn yield_to_edits(&self) {
        self.make_room(0, None);
    }

    /// How many bytes the disk lacks to keep `--cache-free` free after writing `need`.
    fn disk_shortfall(&self, need: u64) -> u64 {
        match nix::sys::statvfs::statvfs(&self.dir) {
            Ok(s) => {
                let frag = s.fragment_size();
                let total = s.blocks() * frag;
                let free = s.blocks_available() * frag;
                let want = total / 100 * self.min_free_percent as u64 + need;
                want.saturating_sub(free)
            }
            Err(_) => 0,
        }
    }

    /// Writes the whole blocks of `job`, then their index records, then marks them present.
    fn write(&self, job: Job) -> std::io::Result<()> {
        let e = &job.entry;
        let mut files = lock(&e.files);
        if e.dead.load(Ordering::Relaxed) {
            return Ok(());
        }
        if files.is_none() {
            *files = Some(self.create_files(e)?);
        }
        let Some((data, index)) = files.as_mut() else {
            return Ok(());
        };
        let first = (job.start / BLOCK) as usize;
        let mut records = Vec::new();
        let mut written = Vec::new();
        let mut at = 0usize;
        let mut b = first;
        while at < job.data.len() {
            let len = e.block_len(b) as usize;
            let bytes = &job.data[at..at + len];
            let absent = lock(&e.blocks)[b] == Block::Absent;
            if absent {
                if !self.make_room(len as u64, Some(e)) {
                    self.stats.dropped.fetch_add(1, Ordering::Relaxed);
                    break;
                }
                // In pieces: the kernel copies a piece without yielding, so a reader
                // woken on this CPU waits for at most one piece, not a block.
                for (i, piece) in bytes.chunks(WRITE_PIECE).enumerate() {
                    data.write_all_at(piece, b as u64 * BLOCK + (i * WRITE_PIECE) as u64)?;
                }
                records.extend_from_slice(&record(b as u32, len as u32, crc32fast::hash(bytes)));
                written.push((b, len as u64));
            }
            at += len;
            b += 1;
        }
        if records.is_empty() {
            return Ok(());
        }
        index.write_all(&records)?;
        let total: u64 = written.iter().map(|(_, l)| l).sum();
        {
            let mut blocks = lock(&e.blocks);
            for (b, _) in &written {
                blocks[*b] = Block::Good;
            }
        }
        e.bytes.fetch_add(total, Ordering::Relaxed);
        let mut st = lock(&self.state);
        if e.dead.load(Ordering::Relaxed) {
            return Ok(());
        }
        st.used += total;
        if e.tick.load(Ordering::Relaxed) == 0 {
            st.tick += 1;
            let now = st.tick;
            e.tick.store(now, Ordering::Relaxed);
            st.lru.insert(now, e.clone());
        }
        self.stats.written_bytes.fetch_add(total, Ordering::Relaxed);
        Ok(())
    }

    fn create_files(&self, e: &Entry) -> std::io::Result<(File, File)> {
        let path = |ext: &str| self.dir.join(format!("{}.{ext}", e.name));
        let open = |p: PathBuf| {
            std::fs::OpenOptions::new()
                .read(true)
                .write(true)
                .create(true)
                .truncate(true)
                .open(p)
        };
        let data = open(path("blocks"))?;
        data.set_len(e.size)?;
        // Written at its end only (one writer thread): records follow each other.
        let index = std::fs::OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .open(path("index"))?;
        // The header last (atomically): an entry is found again only once all three exist.
        let header = Header {
            key: e.key.clone(),
            etag: e.etag.clone(),
            size: e.size,
        };
        let tmp = path("json.tmp");
        std::fs::write(
            &tmp,
            serde_json::to_vec(&header).map_err(std::io::Error::other)?,
        )?;
        std::fs::rename(&tmp, path("json"))?;
        Ok((data, index))
    }

    /// Finds the entries a predecessor left; damaged ones are removed with a log line.
    fn load(&self) {
        let Ok(dir) = std::fs::read_dir(&self.dir) else {
            return;
        };
        let mut found: Vec<(std::time::SystemTime, Arc<Entry>)> = Vec::new();
        let mut names = Vec::new();
        for f in dir.flatten() {
            let p = f.path();
            let Some(name) = p.file_stem().and_then(|s| s.to_str()).map(str::to_string) else {
                continue;
            };
            match p.extension().and_then(|x| x.to_str()) {
                Some("json") => names.push(name),
                Some("blocks") | Some("index") | Some("tmp") => {}
                _ => continue,
            }
        }
        for name in &names {
            match self.load_entry(name) {
                Ok(Some((mtime, e))) => found.push((mtime, e)),
                Ok(None) => self.remove_files(name),
                Err(why) => {
                    tracing::warn!(entry = %name, reason = %why, "a damaged cache entry is dropped");
                    self.remove_files(name);
                }
            }
        }
        // Leftovers without a header: an entry whose creation was cut short.
        if let Ok(dir) = std::fs::read_dir(&self.dir) {
            for f in dir.flatten() {
                let p = f.path();
                let stem = p
                    .file_stem()
                    .and_then(|s| s.to_str())
                    .unwrap_or_default()
                    .to_string();
                let ext = p.extension().and_then(|x| x.to_str()).unwrap_or_default();
                if matches!(ext, "blocks" | "index" | "tmp") && !names.contains(&stem) {
                    let _ = std::fs::remove_file(&p);
                }
            }
        }
        found.sort_by_key(|(t, _)| *t);
        let mut st = lock(&self.state);
        for (_, e) in found {
            st.tick += 1;
            let now = st.tick;
            e.tick.store(now, Ordering::Relaxed);
            st.used += e.bytes.load(Ordering::Relaxed);
            let id = (e.key.clone(), e.etag.clone());
            st.names.insert(e.name.clone(), id.clone());
            st.lru.insert(now, e.clone());
            st.entries.insert(id, e);
        }
        if !st.lru.is_empty() {
            tracing::info!(entries = st.lru.len(), bytes = st.used, "data cache found");
        }
    }

    fn remove_files(&self, name: &str) {
        for ext in ["json", "index", "blocks", "json.tmp"] {
            let _ = std::fs::remove_file(self.dir.join(format!("{name}.{ext}")));
        }
    }

    #[allow(clippy::type_complexity)]
    fn load_entry(
        &self,
        name: &str,
    ) -> Result<Option<(std::time::SystemTime, Arc<Entry>)>, String> {
        let path = |ext: &str| self.dir.join(format!("{name}.{ext}"));
        let header: Header =
            serde_json::from_slice(&std::fs::read(path("json")).map_err(|e| e.to_string())?)
                .map_err(|e| format!("header: {e}"))?;
        let open = |p: PathBuf, append: bool| {
            std::fs::OpenOptions::new()
                .read(true)
                .write(!append)
                .append(append)
                .open(p)
                .map_err(|e| e.to_string())
        };
        let data = open(path("blocks"), false)?;
        if data.metadata().map_err(|e| e.to_string())?.len() != header.size || header.size == 0 {
            return Err("data file of the wrong size".into());
        }
        let mut index = open(path("index"), true)?;
        let mut raw = Vec::new();
        std::fs::File::open(path("index"))
            .and_then(|mut f| f.read_to_end(&mut raw))
            .map_err(|e| e.to_string())?;
        let n = Entry::blocks_of(header.size);
        let mut blocks = vec![Block::Absent; n];
        let mut bytes = 0;
        let mut valid = 0;
        for r in raw.chunks_exact(RECORD) {
            let word = |i: usize| u32::from_le_bytes(r[i..i + 4].try_into().unwrap_or_default());
            let (b, len, crc, check) = (word(0) as usize, word(4) as u64, word(8), word(12));
            let expect_len = if b < n {
                (header.size - b as u64 * BLOCK).min(BLOCK)
            } else {
                0
            };
            if crc32fast::hash(&r[0..12]) != check || b >= n || len != expect_len {
                // A torn last record (a crash while appending) ends the index.
                break;
            }
            if blocks[b] == Block::Absent {
                bytes += len;
            }
            blocks[b] = Block::Unverified(crc);
            valid += RECORD;
        }
        if valid < raw.len() {
            index.set_len(valid as u64).map_err(|e| e.to_string())?;
            index.flush().map_err(|e| e.to_string())?;
        }
        if bytes == 0 {
            return Ok(None);
        }
        let mtime = std::fs::metadata(path("index"))
            .and_then(|m| m.modified())
            .unwrap_or(std::time::UNIX_EPOCH);
        let e = Arc::new(Entry {
            name: name.to_string(),
            key: header.key,
            etag: header.etag,
            size: header.size,
            files: Mutex::new(Some((data, index))),
            blocks: Mutex::new(blocks),
            bytes: AtomicU64::new(bytes),
            tick: AtomicU64::new(0),
            dead: AtomicBool::new(false),
            filling: AtomicBool::new(false),
        });
        Ok(Some((mtime, e)))
    }
}

/// A file name for a version: the same for every mounter, so a restart finds it.
fn version_name(key: &str, etag: &str) -> String {
    let a = crc32fast::hash(key.as_bytes());
    let mut h = crc32fast::Hasher::new_with_initial(a);
    h.update(b"\0");
    h.update(etag.as_bytes());
    let b = h.finalize();
    let mut h = crc32fast::Hasher::new_with_initial(b ^ 0x5bd1_e995);
    h.update(key.as_bytes());
    format!("{a:08x}{b:08x}{:08x}", h.finalize())
}

/// The writer thread: ends when the cache is dropped (its sender goes with it).
fn write_blocks(cache: std::sync::Weak<DataCache>, jobs: Receiver<Job>) {
    // SCHED_IDLE: it runs only on a CPU nothing else wants, so it never delays a read
    // (a woken reader preempts it at once; at nice 19 the first read of 1 GiB was 12 %
    // slower on 2 cores, at SCHED_IDLE not measurably). Fallback: the lowest nice value.
    // SAFETY: scheduling calls on this thread only (pid 0 / its tid).
    unsafe {
        let param = libc::sched_param { sched_priority: 0 };
        if libc::sched_setscheduler(0, libc::SCHED_IDLE, &param) != 0 {
            libc::setpriority(
                libc::PRIO_PROCESS,
                libc::gettid() as libc::id_t,
                WRITER_NICE,
            );
        }
    }
    let mut failing = false;
    while let Ok(job) = jobs.recv() {
        let Some(cache) = cache.upgrade() else {
            return;
        };
        let key = job.entry.key.clone();
        let len = job.data.len() as u64;
        let written = cache.write(job);
        cache.queued.fetch_sub(len, Ordering::Relaxed);
        match written {
            Ok(()) => failing = false,
            Err(e) => {
                cache.stats.dropped.fetch_add(1, Ordering::Relaxed);
                if !failing {
                    // Once per run of failures: a full or broken disk must not flood the log.
                    tracing::warn!(key = %key, error = %e,
                        "cannot write to the data cache; reads go on from S3");
                }
                failing = true;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bytes(n: usize, seed: u8) -> Bytes {
        (0..n)
            .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
            .collect::<Vec<u8>>()
            .into()
    }

    fn open(dir: &Path, limit: u64) -> Arc<DataCache> {
        DataCache::open(dir, limit, 0, Box::new(|| 0)).unwrap()
    }

    /// Waits until the writer thread has written `want` bytes in all.
    fn settle(c: &DataCache, want: u64) {
        for _ in 0..500 {
            if c.stats.written_bytes.load(Ordering::Relaxed) >= want {
                return;
            }
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
        panic!("the writer never wrote {want} bytes");
    }

    #[test]
    fn blocks_are_served_after_they_are_offered_and_after_a_restart() {
        let dir = tempdir();
        let size = 2 * BLOCK as usize + 1000;
        let body = bytes(size, 1);
        {
            let c = open(&dir, 100 * BLOCK);
            let e = c.entry("k", "e1", size as u64).unwrap();
            assert!(e.read(&c, 0, 10).is_none());
            // Offered from an unaligned start: only whole blocks (and the short last) stay.
            c.offer(&e, 10, body.slice(10..));
            settle(&c, BLOCK + 1000);
            assert!(e.read(&c, 0, 10).is_none(), "block 0 was not whole");
            assert_eq!(
                e.read(&c, BLOCK, 2 * BLOCK + 1000).unwrap(),
                body.slice(BLOCK as usize..)
            );
            c.offer(&e, 0, body.slice(..BLOCK as usize));
            settle(&c, 2 * BLOCK + 1000);
            assert!(e.is_complete());
            // Another version of the same key is another entry.
            assert!(c
                .entry("k", "e2", size as u64)
                .unwrap()
                .read(&c, 0, 10)
                .is_none());
        }
        let c = open(&dir, 100 * BLOCK);
        assert_eq!(c.used(), size as u64);
        let e = c.entry("k", "e1", size as u64).unwrap();
        assert_eq!(e.read(&c, 0, size as u64).unwrap(), body);
        assert!(e.is_complete());
    }

    #[test]
    fn a_block_damaged_on_disk_or_a_torn_index_is_never_served() {
        let dir = tempdir();
        let size = 3 * BLOCK as usize;
        let body = bytes(size, 2);
        let name;
        {
            let c = open(&dir, 100 * BLOCK);
            let e = c.entry("k", "e", size as u64).unwrap();
            name = e.name.clone();
            c.offer(&e, 0, body.clone());
            settle(&c, size as u64);
        }
        // Block 1's bytes damaged; a torn record appended after the last good one.
        let data = std::fs::OpenOptions::new()
            .write(true)
            .open(dir.join(format!("{name}.blocks")))
            .unwrap();
        data.write_all_at(b"garbage", BLOCK + 5).unwrap();
        let mut index = std::fs::OpenOptions::new()
            .append(true)
            .open(dir.join(format!("{name}.index")))
            .unwrap();
        index.write_all(&[1, 2, 3, 4, 5]).unwrap();
        let c = open(&dir, 100 * BLOCK);
        let e = c.entry("k", "e", size as u64).unwrap();
        assert_eq!(e.read(&c, 0, BLOCK).unwrap(), body.slice(..BLOCK as usize));
        assert!(e.read(&c, BLOCK, BLOCK + 10).is_none());
        assert_eq!(c.stats.corrupt.load(Ordering::Relaxed), 1);
        assert_eq!(c.used(), 2 * BLOCK);
        // Fetched again, it is kept again, and the index still parses after a restart.
        c.offer(&e, BLOCK, body.slice(BLOCK as usize..2 * BLOCK as usize));
        settle(&c, BLOCK);
        drop((e, c));
        let c = open(&dir, 100 * BLOCK);
        let e = c.entry("k", "e", size as u64).unwrap();
        assert_eq!(e.read(&c, 0, size as u64).unwrap(), body);
    }

    #[test]
    fn least_recently_used_entries_make_room_and_the_lock_keeps_a_second_mounter_out() {
        let dir = tempdir();
        let c = open(&dir, 3 * BLOCK);
        let body = bytes(BLOCK as usize, 3);
        let mut entries = Vec::new();
        for i in 0..3 {
            let e = c.entry(&format!("k{i}"), "e", BLOCK).unwrap();
            c.offer(&e, 0, body.clone());
            settle(&c, (i + 1) * BLOCK);
            entries.push(e);
        }
        // k0 read again: k1 is now the least recently used, and goes for k3.
        assert!(entries[0].read(&c, 0, 1).is_some());
        let e = c.entry("k3", "e", BLOCK).unwrap();
        c.offer(&e, 0, body.clone());
        settle(&c, 4 * BLOCK);
        assert!(c.used() <= 3 * BLOCK);
        assert!(entries[1].read(&c, 0, 1).is_none());
        assert!(entries[0].read(&c, 0, 1).is_some() && e.read(&c, 0, 1).is_some());
        assert_eq!(c.stats.evictions.load(Ordering::Relaxed), 1);
        assert!(matches!(
            DataCache::open(&dir, BLOCK, 0, Box::new(|| 0)),
            Err(CacheError::InUse(_))
        ));
    }

    fn tempdir() -> PathBuf {
        static N: AtomicU64 = AtomicU64::new(0);
        let d = std::env::temp_dir().join(format!(
            "s3csi-cache-test-{}-{}",
            std::process::id(),
            N.fetch_add(1, Ordering::Relaxed)
        ));
        let _ = std::fs::remove_dir_all(&d);
        d
    }
}
