//! The embedded server's storage: buckets of flat keys, exactly as S3 keeps them.
//!
//! Keys are never mapped onto nested files. Each bucket is a directory; each object is a
//! data file named by a number (`<id>`, 16 hex digits) with a sidecar `<id>.meta` that
//! holds the key and its metadata. The sidecar is written (atomically, by rename) only
//! after the data, so its presence is the commit; an index (`BTreeMap` per bucket, key →
//! object) lives in memory and is rebuilt from the sidecars at start. So `dir/`, `a//b`,
//! `.`-named keys and a key `x` next to keys under `x/` are all ordinary keys.
//!
//! Invariants:
//! - Data files are written once and never modified: an overwrite commits a new id and
//!   then removes the old files, so a reader that opened the old file keeps reading a
//!   consistent object.
//! - Files are opened while the index lock is held, so a lookup never races a removal.
//! - On two sidecars for the same key (a crash between commit and cleanup), the higher
//!   id wins. Data files without a sidecar and unfinished multipart uploads are removed at
//!   start.
//!
//! Listing follows ListObjectsV2: lexicographic (byte) order, common prefixes counted
//! toward `max-keys`, the continuation token naming the last entry returned.

use bytes::Bytes;
use futures::{Stream, StreamExt};
use s3s::crypto::{Checksum, Md5};
use std::collections::BTreeMap;
use std::io::{Read, Seek, SeekFrom, Write};
use std::ops::Bound;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};
use tokio::io::AsyncWriteExt;

/// Every part of a multipart upload but the last must be at least this big (as on S3).
pub const MIN_PART_SIZE: u64 = 5 * 1024 * 1024;
/// Most entries one listing page returns, whatever `max-keys` asks for (as on S3).
pub const MAX_KEYS: usize = 1000;
/// Part numbers run from 1 to this.
pub const MAX_PART_NUMBER: i32 = 10_000;
/// Size of the buffer between a request body and its file.
const WRITE_BUFFER: usize = 1024 * 1024;

pub type BodyError = Box<dyn std::error::Error + Send + Sync>;

#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("the specified bucket does not exist")]
    NoSuchBucket,
    #[error("the specified key does not exist")]
    NoSuchKey,
    #[error("the specified multipart upload does not exist")]
    NoSuchUpload,
    #[error("the bucket you tried to delete is not empty")]
    BucketNotEmpty,
    #[error("the bucket you tried to create already exists, and you own it")]
    BucketAlreadyOwnedByYou,
    #[error("the specified bucket name is not valid")]
    InvalidBucketName,
    #[error("{0}")]
    InvalidPart(String),
    #[error("the list of parts was not in ascending order")]
    InvalidPartOrder,
    #[error("your proposed upload is smaller than the minimum allowed object size")]
    EntityTooSmall,
    #[error("{0}")]
    InvalidArgument(String),
    #[error("{0}")]
    InvalidRequest(String),
    #[error("at least one of the preconditions you specified did not hold")]
    PreconditionFailed,
    #[error("the request body could not be read: {0}")]
    IncompleteBody(String),
    #[error("storage error: {0}")]
    Io(#[from] std::io::Error),
}

pub type Result<T, E = StoreError> = std::result::Result<T, E>;

/// What S3 reports about one object.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ObjectInfo {
    pub size: u64,
    /// Without quotes: `hex(md5)` or, after a multipart upload, `hex(md5 of md5s)-N`.
    pub etag: String,
    pub mtime: SystemTime,
    pub content_type: Option<String>,
    /// `x-amz-meta-*` headers, names lower-case without the prefix.
    pub user_meta: BTreeMap<String, String>,
    id: u64,
}

#[derive(Debug, Clone)]
pub struct BucketInfo {
    pub name: String,
    pub created: SystemTime,
}

#[derive(Debug, Clone)]
pub struct UploadInfo {
    pub upload_id: String,
    pub key: String,
    pub initiated: SystemTime,
}

/// One ListObjects(V2) request, in the store's terms.
#[derive(Debug, Clone, Default)]
pub struct ListQuery<'a> {
    pub prefix: &'a str,
    /// `None` also for an empty delimiter, which S3 ignores.
    pub delimiter: Option<&'a str>,
    /// List entries after this one (a continuation token's entry or start-after).
    pub after: Option<&'a str>,
    pub max_keys: usize,
}

#[derive(Debug, Clone, Default, PartialEq)]
pub struct ListResult {
    pub objects: Vec<(String, ObjectInfo)>,
    pub prefixes: Vec<String>,
    pub truncated: bool,
    /// The last entry returned (key or common prefix): where the next page starts.
    pub last: Option<String>,
}

/// A condition on a write, checked atomically as the new object replaces the old one.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum WriteIf {
    /// The key holds the object with this ETag (without quotes).
    Etag(String),
    /// The key holds no object.
    Absent,
}

struct Bucket {
    created: SystemTime,
    objects: BTreeMap<String, ObjectInfo>,
}

struct Part {
    path: PathBuf,
    size: u64,
    etag: String,
}

struct Upload {
    bucket: String,
    key: String,
    content_type: Option<String>,
    user_meta: BTreeMap<String, String>,
    initiated: SystemTime,
    parts: BTreeMap<i32, Part>,
}

#[derive(Default)]
struct State {
    buckets: BTreeMap<String, Bucket>,
    uploads: BTreeMap<String, Upload>,
}

pub struct Store {
    root: PathBuf,
    state: Mutex<State>,
    next_id: AtomicU64,
}

impl std::fmt::Debug for Store {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Store").field("root", &self.root).finish()
    }
}

pub fn hex(bytes: &[u8]) -> String {
    use std::fmt::Write as _;
    let mut s = String::with_capacity(bytes.len() * 2);
    for b in bytes {
        let _ = write!(s, "{b:02x}");
    }
    s
}

pub fn unhex(s: &str) -> Option<Vec<u8>> {
    if !s.len().is_multiple_of(2) {
        return None;
    }
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(s.get(i..i + 2)?, 16).ok())
        .collect()
}

/// The smallest string greater than every string that starts with `prefix`, when it is
/// cheap to name (last character ASCII below DEL); `None` otherwise.
fn prefix_end(prefix: &str) -> Option<String> {
    let last = *prefix.as_bytes().last()?;
    if last >= 0x7f {
        return None;
    }
    let mut s = prefix[..prefix.len() - 1].to_string();
    s.push((last + 1) as char);
    Some(s)
}

/// ListObjectsV2 over one bucket's index.
fn list_index(objects: &BTreeMap<String, ObjectInfo>, q: &ListQuery<'_>) -> ListResult {
    let mut out = ListResult::default();
    if q.max_keys == 0 {
        return out;
    }
    let after = q.after.filter(|a| *a >= q.prefix);
    let mut from: Bound<String> = match after {
        Some(a) => Bound::Excluded(a.to_string()),
        None => Bound::Included(q.prefix.to_string()),
    };
    let mut count = 0;
    'scan: loop {
        let mut skip: Option<String> = None;
        for (key, info) in objects.range::<String, _>((from.clone(), Bound::Unbounded)) {
            if !key.starts_with(q.prefix) {
                break 'scan;
            }
            if skip.as_deref().is_some_and(|s| key.starts_with(s)) {
                continue;
            }
            let common = q.delimiter.and_then(|d| {
                key[q.prefix.len()..]
                    .find(d)
                    .map(|i| &key[..q.prefix.len() + i + d.len()])
            });
            match common {
                Some(cp) => {
                    // A common prefix at or before the marker was returned already (or
                    // lies before where the listing starts).
                    if after.is_none_or(|a| cp > a) {
                        if count == q.max_keys {
                            out.truncated = true;
                            break 'scan;
                        }
                        out.prefixes.push(cp.to_string());
                        out.last = Some(cp.to_string());
                        count += 1;
                    }
                    // Jump over every key under this common prefix.
                    match prefix_end(cp) {
                        Some(end) => {
                            from = Bound::Included(end);
                            continue 'scan;
                        }
                        None => skip = Some(cp.to_string()),
                    }
                }
                None => {
                    if count == q.max_keys {
                        out.truncated = true;
                        break 'scan;
                    }
                    out.objects.push((key.clone(), info.clone()));
                    out.last = Some(key.clone());
                    count += 1;
                }
            }
        }
        break;
    }
    out
}

fn system_time_from(text: &str) -> Option<SystemTime> {
    let (s, n) = text.split_once('.').unwrap_or((text, "0"));
    Some(UNIX_EPOCH + Duration::new(s.parse().ok()?, n.parse().ok()?))
}

fn meta_text(key: &str, info: &ObjectInfo) -> String {
    let t = info.mtime.duration_since(UNIX_EPOCH).unwrap_or_default();
    let mut s = format!(
        "key={}\nsize={}\netag={}\nmtime={}.{:09}\n",
        hex(key.as_bytes()),
        info.size,
        info.etag,
        t.as_secs(),
        t.subsec_nanos()
    );
    if let Some(ct) = &info.content_type {
        s.push_str(&format!("content-type={}\n", hex(ct.as_bytes())));
    }
    for (k, v) in &info.user_meta {
        s.push_str(&format!(
            "meta-{}={}\n",
            hex(k.as_bytes()),
            hex(v.as_bytes())
        ));
    }
    s
}

fn parse_meta(text: &str, id: u64) -> Option<(String, ObjectInfo)> {
    let mut key = None;
    let mut size = None;
    let mut etag = None;
    let mut mtime = None;
    let mut content_type = None;
    let mut user_meta = BTreeMap::new();
    for line in text.lines() {
        let (k, v) = line.split_once('=')?;
        match k {
            "key" => key = Some(String::from_utf8(unhex(v)?).ok()?),
            "size" => size = Some(v.parse().ok()?),
            "etag" => etag = Some(v.to_string()),
            "mtime" => mtime = Some(system_time_from(v)?),
            "content-type" => content_type = Some(String::from_utf8(unhex(v)?).ok()?),
            _ => {
                if let Some(name) = k.strip_prefix("meta-") {
                    user_meta.insert(
                        String::from_utf8(unhex(name)?).ok()?,
                        String::from_utf8(unhex(v)?).ok()?,
                    );
                }
            }
        }
    }
    Some((
        key?,
        ObjectInfo {
            size: size?,
            etag: etag?,
            mtime: mtime?,
            content_type,
            user_meta,
            id,
        },
    ))
}

fn id_name(id: u64) -> String {
    format!("{id:016x}")
}

/// Copies `len` bytes of `src` from `offset` into `dst`, returning their MD5.
fn copy_range(src: &mut std::fs::File, offset: u64, len: u64, dst: &Path) -> Result<[u8; 16]> {
    src.seek(SeekFrom::Start(offset))?;
    let mut out = std::fs::File::create(dst)?;
    let mut md5 = Md5::new();
    let mut buf = vec![0u8; WRITE_BUFFER];
    let mut left = len;
    while left > 0 {
        let n = buf.len().min(left as usize);
        src.read_exact(&mut buf[..n])?;
        md5.update(&buf[..n]);
        out.write_all(&buf[..n])?;
        left -= n as u64;
    }
    Ok(md5.finalize())
}

impl Store {
    /// Opens (or creates) a store under `root`, rebuilding the index from the sidecars.
    pub fn open(root: &Path) -> Result<Store> {
        let buckets_dir = root.join("buckets");
        std::fs::create_dir_all(&buckets_dir)?;
        // Multipart uploads do not survive a restart.
        let uploads = root.join("uploads");
        if uploads.exists() {
            std::fs::remove_dir_all(&uploads)?;
        }
        std::fs::create_dir_all(&uploads)?;
        let mut state = State::default();
        let mut max_id = 0;
        for entry in std::fs::read_dir(&buckets_dir)? {
            let entry = entry?;
            let Some(name) = entry.file_name().to_str().map(str::to_string) else {
                continue;
            };
            if !entry.file_type()?.is_dir() || !s3s::path::check_bucket_name(&name) {
                continue;
            }
            let meta = entry.metadata()?;
            let created = meta.created().or_else(|_| meta.modified())?;
            let (objects, bucket_max) = Self::load_bucket(&entry.path())?;
            max_id = max_id.max(bucket_max);
            state.buckets.insert(name, Bucket { created, objects });
        }
        Ok(Store {
            root: root.to_path_buf(),
            state: Mutex::new(state),
            next_id: AtomicU64::new(max_id + 1),
        })
    }

    fn load_bucket(dir: &Path) -> Result<(BTreeMap<String, ObjectInfo>, u64)> {
        let mut objects: BTreeMap<String, ObjectInfo> = BTreeMap::new();
        let mut files = vec![];
        let mut max_id = 0;
        for entry in std::fs::read_dir(dir)? {
            let entry = entry?;
            let name = entry.file_name().to_string_lossy().to_string();
            files.push(name.clone());
            let Some(id) = name
                .strip_suffix(".meta")
                .and_then(|n| u64::from_str_radix(n, 16).ok())
            else {
                continue;
            };
            max_id = max_id.max(id);
            let text = std::fs::read_to_string(entry.path()).unwrap_or_default();
            let Some((key, info)) = parse_meta(&text, id) else {
                tracing::warn!(file = %entry.path().display(), "ignoring an unreadable object sidecar");
                continue;
            };
            match std::fs::metadata(dir.join(id_name(id))) {
                Ok(m) if m.len() == info.size => {}
                _ => {
                    tracing::warn!(
                        key,
                        "ignoring an object whose data file is missing or short"
                    );
                    continue;
                }
            }
            if objects.get(&key).is_some_and(|old| old.id > id) {
                continue;
            }
            objects.insert(key, info);
        }
        // Remove everything the index does not reference: uncommitted writes, replaced
        // objects whose cleanup did not finish.
        let live: std::collections::HashSet<String> = objects
            .values()
            .flat_map(|o| [id_name(o.id), format!("{}.meta", id_name(o.id))])
            .collect();
        for name in files {
            if !live.contains(&name) {
                let _ = std::fs::remove_file(dir.join(&name));
            }
        }
        for name in live.iter().filter(|n| !n.ends_with(".meta")) {
            if let Ok(id) = u64::from_str_radix(name, 16) {
                max_id = max_id.max(id);
            }
        }
        Ok((objects, max_id))
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn bucket_dir(&self, bucket: &str) -> PathBuf {
        self.root.join("buckets").join(bucket)
    }

    fn new_id(&self) -> u64 {
        self.next_id.fetch_add(1, Ordering::Relaxed)
    }

    // ---- buckets -------------------------------------------------------------------

    pub fn create_bucket(&self, name: &str) -> Result<()> {
        if !s3s::path::check_bucket_name(name) {
            return Err(StoreError::InvalidBucketName);
        }
        let mut state = self.lock();
        if state.buckets.contains_key(name) {
            return Err(StoreError::BucketAlreadyOwnedByYou);
        }
        std::fs::create_dir_all(self.bucket_dir(name))?;
        state.buckets.insert(
            name.to_string(),
            Bucket {
                created: SystemTime::now(),
                objects: BTreeMap::new(),
            },
        );
        Ok(())
    }

    pub fn head_bucket(&self, name: &str) -> Result<()> {
        if self.lock().buckets.contains_key(name) {
            Ok(())
        } else {
            Err(StoreError::NoSuchBucket)
        }
    }

    pub fn delete_bucket(&self, name: &str) -> Result<()> {
        let mut state = self.lock();
        let bucket = state.buckets.get(name).ok_or(StoreError::NoSuchBucket)?;
        if !bucket.objects.is_empty() {
            return Err(StoreError::BucketNotEmpty);
        }
        state.buckets.remove(name);
        let stale: Vec<String> = state
            .uploads
            .iter()
            .filter(|(_, u)| u.bucket == name)
            .map(|(id, _)| id.clone())
            .collect();
        for id in stale {
            state.uploads.remove(&id);
            let _ = std::fs::remove_dir_all(self.root.join("uploads").join(&id));
        }
        drop(state);
        let _ = std::fs::remove_dir_all(self.bucket_dir(name));
        Ok(())
    }

    pub fn list_buckets(&self) -> Vec<BucketInfo> {
        self.lock()
            .buckets
            .iter()
            .map(|(name, b)| BucketInfo {
                name: name.clone(),
                created: b.created,
            })
            .collect()
    }

    // ---- objects -------------------------------------------------------------------

    pub fn head(&self, bucket: &str, key: &str) -> Result<ObjectInfo> {
        let state = self.lock();
        let b = state.buckets.get(bucket).ok_or(StoreError::NoSuchBucket)?;
        b.objects.get(key).cloned().ok_or(StoreError::NoSuchKey)
    }

    /// The object's metadata and its data file, opened.
    pub fn open_object(&self, bucket: &str, key: &str) -> Result<(ObjectInfo, std::fs::File)> {
        let state = self.lock();
        let b = state.buckets.get(bucket).ok_or(StoreError::NoSuchBucket)?;
        let info = b.objects.get(key).cloned().ok_or(StoreError::NoSuchKey)?;
        let file = std::fs::File::open(self.bucket_dir(bucket).join(id_name(info.id)))?;
        Ok((info, file))
    }

    pub fn list(&self, bucket: &str, q: &ListQuery<'_>) -> Result<ListResult> {
        let state = self.lock();
        let b = state.buckets.get(bucket).ok_or(StoreError::NoSuchBucket)?;
        Ok(list_index(&b.objects, q))
    }

    /// Streams `body` into `path`; returns its size and MD5.
    async fn write_body<S>(path: &Path, body: S) -> Result<(u64, [u8; 16])>
    where
        S: Stream<Item = Result<Bytes, BodyError>> + Send,
    {
        let file = tokio::fs::File::create(path).await?;
        let mut out = tokio::io::BufWriter::with_capacity(WRITE_BUFFER, file);
        let mut md5 = Md5::new();
        let mut size = 0u64;
        let mut body = std::pin::pin!(body);
        while let Some(chunk) = body.next().await {
            let chunk = chunk.map_err(|e| StoreError::IncompleteBody(e.to_string()))?;
            size += chunk.len() as u64;
            md5.update(&chunk);
            out.write_all(&chunk).await?;
        }
        out.flush().await?;
        Ok((size, md5.finalize()))
    }

    /// Records `key` → the already written data file `id`, replacing any older object,
    /// if `cond` holds for that older object (checked under the lock that replaces it).
    async fn commit(
        &self,
        bucket: &str,
        key: &str,
        info: ObjectInfo,
        cond: Option<&WriteIf>,
    ) -> Result<ObjectInfo> {
        let dir = self.bucket_dir(bucket);
        let meta = dir.join(format!("{}.meta", id_name(info.id)));
        let tmp = dir.join(format!("{}.meta.tmp", id_name(info.id)));
        let text = meta_text(key, &info);
        let write = async {
            tokio::fs::write(&tmp, text).await?;
            tokio::fs::rename(&tmp, &meta).await
        };
        if let Err(e) = write.await {
            let _ = std::fs::remove_file(&tmp);
            let _ = std::fs::remove_file(dir.join(id_name(info.id)));
            return Err(e.into());
        }
        let old = {
            let mut state = self.lock();
            let holds = |b: &Bucket| match (cond, b.objects.get(key)) {
                (None, _) | (Some(WriteIf::Absent), None) => true,
                (Some(WriteIf::Etag(want)), Some(old)) => old.etag == *want,
                _ => false,
            };
            match state.buckets.get_mut(bucket) {
                Some(b) if !holds(b) => {
                    drop(state);
                    let _ = std::fs::remove_file(&meta);
                    let _ = std::fs::remove_file(dir.join(id_name(info.id)));
                    return Err(StoreError::PreconditionFailed);
                }
                Some(b) => b.objects.insert(key.to_string(), info.clone()),
                None => {
                    drop(state);
                    let _ = std::fs::remove_file(&meta);
                    let _ = std::fs::remove_file(dir.join(id_name(info.id)));
                    return Err(StoreError::NoSuchBucket);
                }
            }
        };
        if let Some(old) = old {
            self.remove_files(bucket, old.id);
        }
        Ok(info)
    }

    fn remove_files(&self, bucket: &str, id: u64) {
        let dir = self.bucket_dir(bucket);
        // Sidecar first: a data file without one is cleaned up at the next start.
        let _ = std::fs::remove_file(dir.join(format!("{}.meta", id_name(id))));
        let _ = std::fs::remove_file(dir.join(id_name(id)));
    }

    pub async fn put<S>(
        &self,
        bucket: &str,
        key: &str,
        body: S,
        content_type: Option<String>,
        user_meta: BTreeMap<String, String>,
        cond: Option<&WriteIf>,
    ) -> Result<ObjectInfo>
    where
        S: Stream<Item = Result<Bytes, BodyError>> + Send,
    {
        self.head_bucket(bucket)?;
        let id = self.new_id();
        let path = self.bucket_dir(bucket).join(id_name(id));
        let (size, md5) = match Self::write_body(&path, body).await {
            Ok(r) => r,
            Err(e) => {
                let _ = std::fs::remove_file(&path);
                return Err(e);
            }
        };
        self.commit(
            bucket,
            key,
            ObjectInfo {
                size,
                etag: hex(&md5),
                mtime: SystemTime::now(),
                content_type,
                user_meta,
                id,
            },
            cond,
        )
        .await
    }

    /// Removes `key`; a missing key is not an error (as on S3).
    pub fn delete(&self, bucket: &str, key: &str) -> Result<()> {
        let old = {
            let mut state = self.lock();
            let b = state
                .buckets
                .get_mut(bucket)
                .ok_or(StoreError::NoSuchBucket)?;
            b.objects.remove(key)
        };
        if let Some(old) = old {
            self.remove_files(bucket, old.id);
        }
        Ok(())
    }

    /// CopyObject. `content_type` is `Some(..)` to replace the source's metadata (content
    /// type and `user_meta`, as MetadataDirective=REPLACE does).
    pub async fn copy(
        &self,
        src_bucket: &str,
        src_key: &str,
        bucket: &str,
        key: &str,
        content_type: Option<Option<String>>,
        user_meta: BTreeMap<String, String>,
    ) -> Result<ObjectInfo> {
        if src_bucket == bucket && src_key == key && content_type.is_none() {
            return Err(StoreError::InvalidRequest(
                "This copy request is illegal because it is trying to copy an object to itself \
                 without changing the object's metadata, storage class, website redirect \
                 location or encryption attributes."
                    .into(),
            ));
        }
        self.head_bucket(bucket)?;
        let (src, mut file) = self.open_object(src_bucket, src_key)?;
        let id = self.new_id();
        let path = self.bucket_dir(bucket).join(id_name(id));
        let dst = path.clone();
        let size = src.size;
        let copied = tokio::task::spawn_blocking(move || -> std::io::Result<()> {
            let mut out = std::fs::File::create(&dst)?;
            // copy_file_range where the kernel offers it.
            let n = std::io::copy(&mut file, &mut out)?;
            if n != size {
                return Err(std::io::Error::other("source changed size while copying"));
            }
            Ok(())
        })
        .await
        .map_err(|e| std::io::Error::other(e.to_string()))
        .and_then(|r| r);
        if let Err(e) = copied {
            let _ = std::fs::remove_file(&path);
            return Err(e.into());
        }
        self.commit(
            bucket,
            key,
            ObjectInfo {
                size,
                etag: src.etag,
                mtime: SystemTime::now(),
                user_meta: if content_type.is_some() {
                    user_meta
                } else {
                    src.user_meta
                },
                content_type: content_type.unwrap_or(src.content_type),
                id,
            },
            None,
        )
        .await
    }

    // ---- multipart uploads -------------------------------------------------------

    pub fn create_upload(
        &self,
        bucket: &str,
        key: &str,
        content_type: Option<String>,
        user_meta: BTreeMap<String, String>,
    ) -> Result<String> {
        let mut state = self.lock();
        if !state.buckets.contains_key(bucket) {
            return Err(StoreError::NoSuchBucket);
        }
        let nanos = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap_or_default()
            .as_nanos() as u64;
        let upload_id = format!("{nanos:016x}{:016x}", self.new_id());
        std::fs::create_dir_all(self.root.join("uploads").join(&upload_id))?;
        state.uploads.insert(
            upload_id.clone(),
            Upload {
                bucket: bucket.to_string(),
                key: key.to_string(),
                content_type,
                user_meta,
                initiated: SystemTime::now(),
                parts: BTreeMap::new(),
            },
        );
        Ok(upload_id)
    }

    fn check_upload(&self, bucket: &str, key: &str, upload_id: &str) -> Result<()> {
        let state = self.lock();
        if !state.buckets.contains_key(bucket) {
            return Err(StoreError::NoSuchBucket);
        }
        match state.uploads.get(upload_id) {
            Some(u) if u.bucket == bucket && u.key == key => Ok(()),
            _ => Err(StoreError::NoSuchUpload),
        }
    }

    fn part_path(&self, upload_id: &str, part_number: i32) -> Result<PathBuf> {
        if !(1..=MAX_PART_NUMBER).contains(&part_number) {
            return Err(StoreError::InvalidArgument(format!(
                "Part number must be an integer between 1 and {MAX_PART_NUMBER}, inclusive"
            )));
        }
        Ok(self
            .root
            .join("uploads")
            .join(upload_id)
            .join(format!("{part_number}.{}", self.new_id())))
    }

    fn record_part(&self, upload_id: &str, part_number: i32, part: Part) -> Result<String> {
        let etag = part.etag.clone();
        let old = {
            let mut state = self.lock();
            let Some(upload) = state.uploads.get_mut(upload_id) else {
                drop(state);
                let _ = std::fs::remove_file(&part.path);
                return Err(StoreError::NoSuchUpload);
            };
            upload.parts.insert(part_number, part)
        };
        if let Some(old) = old {
            let _ = std::fs::remove_file(old.path);
        }
        Ok(etag)
    }

    pub async fn upload_part<S>(
        &self,
        bucket: &str,
        key: &str,
        upload_id: &str,
        part_number: i32,
        body: S,
    ) -> Result<String>
    where
        S: Stream<Item = Result<Bytes, BodyError>> + Send,
    {
        self.check_upload(bucket, key, upload_id)?;
        let path = self.part_path(upload_id, part_number)?;
        let (size, md5) = match Self::write_body(&path, body).await {
            Ok(r) => r,
            Err(e) => {
                let _ = std::fs::remove_file(&path);
                return Err(e);
            }
        };
        self.record_part(
            upload_id,
            part_number,
            Part {
                path,
                size,
                etag: hex(&md5),
            },
        )
    }

    /// UploadPartCopy: bytes `range` (end exclusive; the whole object when `None`) of the
    /// source become the part, provided `source_ok` accepts the version opened (the
    /// x-amz-copy-source-if-* conditions). Returns the part's ETag and the source's mtime.
    #[allow(clippy::too_many_arguments)]
    pub async fn upload_part_copy(
        &self,
        bucket: &str,
        key: &str,
        upload_id: &str,
        part_number: i32,
        src_bucket: &str,
        src_key: &str,
        range: Option<(u64, u64)>,
        source_ok: impl FnOnce(&ObjectInfo) -> bool,
    ) -> Result<(String, SystemTime)> {
        self.check_upload(bucket, key, upload_id)?;
        let path = self.part_path(upload_id, part_number)?;
        let (src, mut file) = self.open_object(src_bucket, src_key)?;
        if !source_ok(&src) {
            return Err(StoreError::PreconditionFailed);
        }
        let (start, end) = range.unwrap_or((0, src.size));
        if start >= end || end > src.size {
            return Err(StoreError::InvalidArgument(format!(
                "Range specified is not valid for source object of size: {}",
                src.size
            )));
        }
        let dst = path.clone();
        let md5 =
            tokio::task::spawn_blocking(move || copy_range(&mut file, start, end - start, &dst))
                .await
                .map_err(|e| std::io::Error::other(e.to_string()))?;
        let md5 = match md5 {
            Ok(m) => m,
            Err(e) => {
                let _ = std::fs::remove_file(&path);
                return Err(e);
            }
        };
        let etag = self.record_part(
            upload_id,
            part_number,
            Part {
                path,
                size: end - start,
                etag: hex(&md5),
            },
        )?;
        Ok((etag, src.mtime))
    }

    /// CompleteMultipartUpload with the client's list of (part number, ETag).
    pub async fn complete_upload(
        &self,
        bucket: &str,
        key: &str,
        upload_id: &str,
        parts: &[(i32, String)],
        cond: Option<&WriteIf>,
    ) -> Result<ObjectInfo> {
        if parts.is_empty() {
            return Err(StoreError::InvalidRequest(
                "You must specify at least one part".into(),
            ));
        }
        // Validate, then take the upload out so that nothing else can touch it.
        let (upload, files, md5s) = {
            let mut state = self.lock();
            if !state.buckets.contains_key(bucket) {
                return Err(StoreError::NoSuchBucket);
            }
            let upload = match state.uploads.get(upload_id) {
                Some(u) if u.bucket == bucket && u.key == key => u,
                _ => return Err(StoreError::NoSuchUpload),
            };
            let mut files = vec![];
            let mut md5s = vec![];
            let mut prev = 0;
            for (i, (number, etag)) in parts.iter().enumerate() {
                if *number <= prev {
                    return Err(StoreError::InvalidPartOrder);
                }
                prev = *number;
                let etag = etag.trim().trim_matches('"');
                let part = upload
                    .parts
                    .get(number)
                    .filter(|p| p.etag == etag)
                    .ok_or_else(|| {
                        StoreError::InvalidPart(format!(
                            "One or more of the specified parts could not be found. The part \
                             may not have been uploaded, or the specified entity tag may not \
                             match the part's entity tag. (part {number})"
                        ))
                    })?;
                if i + 1 < parts.len() && part.size < MIN_PART_SIZE {
                    return Err(StoreError::EntityTooSmall);
                }
                files.push((part.path.clone(), part.size));
                md5s.extend(unhex(&part.etag).unwrap_or_default());
            }
            let upload = state.uploads.remove(upload_id).expect("checked above");
            (upload, files, md5s)
        };
        let id = self.new_id();
        let path = self.bucket_dir(bucket).join(id_name(id));
        let dst = path.clone();
        let joined = tokio::task::spawn_blocking(move || -> std::io::Result<u64> {
            let mut out = std::fs::File::create(&dst)?;
            let mut total = 0;
            for (part, size) in files {
                let mut f = std::fs::File::open(part)?;
                let n = std::io::copy(&mut f, &mut out)?;
                if n != size {
                    return Err(std::io::Error::other("a part changed size"));
                }
                total += n;
            }
            Ok(total)
        })
        .await
        .map_err(|e| std::io::Error::other(e.to_string()))
        .and_then(|r| r);
        let _ = std::fs::remove_dir_all(self.root.join("uploads").join(upload_id));
        let size = match joined {
            Ok(n) => n,
            Err(e) => {
                let _ = std::fs::remove_file(&path);
                return Err(e.into());
            }
        };
        self.commit(
            bucket,
            key,
            ObjectInfo {
                size,
                etag: format!("{}-{}", hex(&Md5::checksum(&md5s)), parts.len()),
                mtime: SystemTime::now(),
                content_type: upload.content_type,
                user_meta: upload.user_meta,
                id,
            },
            cond,
        )
        .await
    }

    pub fn abort_upload(&self, bucket: &str, key: &str, upload_id: &str) -> Result<()> {
        self.check_upload(bucket, key, upload_id)?;
        self.lock().uploads.remove(upload_id);
        let _ = std::fs::remove_dir_all(self.root.join("uploads").join(upload_id));
        Ok(())
    }

    /// In-progress uploads of `bucket` under `prefix`, ordered by key then upload id,
    /// starting after (key_marker, upload_id_marker); at most `max` and whether more exist.
    pub fn list_uploads(
        &self,
        bucket: &str,
        prefix: &str,
        key_marker: Option<&str>,
        upload_id_marker: Option<&str>,
        max: usize,
    ) -> Result<(Vec<UploadInfo>, bool)> {
        let state = self.lock();
        if !state.buckets.contains_key(bucket) {
            return Err(StoreError::NoSuchBucket);
        }
        let mut all: Vec<UploadInfo> = state
            .uploads
            .iter()
            .filter(|(_, u)| u.bucket == bucket && u.key.starts_with(prefix))
            .map(|(id, u)| UploadInfo {
                upload_id: id.clone(),
                key: u.key.clone(),
                initiated: u.initiated,
            })
            .collect();
        all.sort_by(|a, b| (&a.key, &a.upload_id).cmp(&(&b.key, &b.upload_id)));
        let all: Vec<UploadInfo> = all
            .into_iter()
            .filter(|u| match (key_marker, upload_id_marker) {
                (Some(k), Some(id)) => (u.key.as_str(), u.upload_id.as_str()) > (k, id),
                (Some(k), None) => u.key.as_str() > k,
                _ => true,
            })
            .collect();
        let truncated = all.len() > max;
        Ok((all.into_iter().take(max).collect(), truncated))
    }
}

/// A file region as a stream of large chunks, read on blocking threads.
pub struct FileBody {
    file: Arc<std::fs::File>,
    pos: u64,
    end: u64,
    chunk: usize,
    pending: Option<tokio::task::JoinHandle<std::io::Result<Bytes>>>,
}

impl FileBody {
    pub fn new(file: std::fs::File, start: u64, end: u64, chunk: usize) -> FileBody {
        FileBody {
            file: Arc::new(file),
            pos: start,
            end,
            chunk: chunk.max(4096),
            pending: None,
        }
    }

    pub fn remaining(&self) -> u64 {
        self.end - self.pos
    }
}

impl Stream for FileBody {
    type Item = Result<Bytes, std::io::Error>;

    fn poll_next(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Self::Item>> {
        use std::future::Future;
        use std::task::Poll;
        if self.pending.is_none() {
            if self.pos >= self.end {
                return Poll::Ready(None);
            }
            let n = (self.end - self.pos).min(self.chunk as u64) as usize;
            let file = self.file.clone();
            let pos = self.pos;
            self.pending = Some(tokio::task::spawn_blocking(move || {
                use std::os::unix::fs::FileExt;
                let mut buf = vec![0u8; n];
                file.read_exact_at(&mut buf, pos)?;
                Ok(Bytes::from(buf))
            }));
        }
        let handle = self.pending.as_mut().expect("set above");
        let result = match std::pin::Pin::new(handle).poll(cx) {
            Poll::Pending => return Poll::Pending,
            Poll::Ready(r) => r,
        };
        self.pending = None;
        match result {
            Ok(Ok(bytes)) => {
                self.pos += bytes.len() as u64;
                Poll::Ready(Some(Ok(bytes)))
            }
            Ok(Err(e)) => {
                self.pos = self.end;
                Poll::Ready(Some(Err(e)))
            }
            Err(e) => {
                self.pos = self.end;
                Poll::Ready(Some(Err(std::io::Error::other(e.to_string()))))
            }
        }
    }

    fn size_hint(&self) -> (usize, Option<usize>) {
        let left = self.remaining().div_ceil(self.chunk as u64) as usize;
        (left, Some(left))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn index(keys: &[&str]) -> BTreeMap<String, ObjectInfo> {
        keys.iter()
            .enumerate()
            .map(|(i, k)| {
                (
                    k.to_string(),
                    ObjectInfo {
                        size: i as u64,
                        etag: String::new(),
                        mtime: UNIX_EPOCH,
                        content_type: None,
                        user_meta: BTreeMap::new(),
                        id: i as u64,
                    },
                )
            })
            .collect()
    }

    /// Pages through the whole listing; returns entries (prefixes marked with `P:`) per page.
    fn pages(
        idx: &BTreeMap<String, ObjectInfo>,
        prefix: &str,
        delim: Option<&str>,
        max: usize,
    ) -> Vec<Vec<String>> {
        let mut out = vec![];
        let mut after: Option<String> = None;
        loop {
            let r = list_index(
                idx,
                &ListQuery {
                    prefix,
                    delimiter: delim,
                    after: after.as_deref(),
                    max_keys: max,
                },
            );
            let mut page: Vec<String> = r.objects.iter().map(|(k, _)| k.clone()).collect();
            page.extend(r.prefixes.iter().map(|p| format!("P:{p}")));
            page.sort_by(|a, b| a.trim_start_matches("P:").cmp(b.trim_start_matches("P:")));
            out.push(page);
            if !r.truncated {
                return out;
            }
            after = r.last;
        }
    }

    #[test]
    fn flat_keys_and_markers() {
        let idx = index(&["a", "a/", "a/b", "a/b/c", "a/c", "b", "b/", "c/d"]);
        assert_eq!(
            pages(&idx, "", Some("/"), 1000),
            vec![vec!["a", "P:a/", "b", "P:b/", "P:c/"]]
        );
        assert_eq!(
            pages(&idx, "a/", Some("/"), 1000),
            vec![vec!["a/", "a/b", "P:a/b/", "a/c"]]
        );
        assert_eq!(
            pages(&idx, "", None, 3),
            vec![
                vec!["a", "a/", "a/b"],
                vec!["a/b/c", "a/c", "b"],
                vec!["b/", "c/d"]
            ]
        );
    }

    #[test]
    fn common_prefixes_count_toward_max_keys() {
        let mut keys = vec![];
        for d in 0..5 {
            for f in 0..3 {
                keys.push(format!("d{d}/f{f}"));
            }
            keys.push(format!("f{d}"));
        }
        let refs: Vec<&str> = keys.iter().map(String::as_str).collect();
        let idx = index(&refs);
        let p = pages(&idx, "", Some("/"), 2);
        assert_eq!(
            p,
            vec![
                vec!["P:d0/", "P:d1/"],
                vec!["P:d2/", "P:d3/"],
                vec!["P:d4/", "f0"],
                vec!["f1", "f2"],
                vec!["f3", "f4"],
            ]
        );
    }

    #[test]
    fn exact_page_end_is_not_truncated() {
        let idx = index(&["a", "b"]);
        let r = list_index(
            &idx,
            &ListQuery {
                max_keys: 2,
                ..Default::default()
            },
        );
        assert!(!r.truncated);
        let r = list_index(
            &idx,
            &ListQuery {
                max_keys: 1,
                ..Default::default()
            },
        );
        assert!(r.truncated);
        assert_eq!(r.last.as_deref(), Some("a"));
    }

    #[test]
    fn non_ascii_delimiter_and_prefix_end() {
        assert_eq!(prefix_end("a/").as_deref(), Some("a0"));
        assert_eq!(prefix_end("é"), None);
        let idx = index(&["xéa", "xéb", "y"]);
        assert_eq!(pages(&idx, "", Some("é"), 1), vec![vec!["P:xé"], vec!["y"]]);
    }

    #[test]
    fn sidecar_round_trip() {
        let info = ObjectInfo {
            size: 7,
            etag: "abc-2".into(),
            mtime: UNIX_EPOCH + Duration::new(5, 7),
            content_type: Some("text/plain".into()),
            user_meta: BTreeMap::from([("mode".into(), "33188".into())]),
            id: 9,
        };
        let text = meta_text("dir/ with\nnewline/", &info);
        assert_eq!(
            parse_meta(&text, 9),
            Some(("dir/ with\nnewline/".to_string(), info))
        );
    }
}
