//! In-memory [`ObjectClient`] for unit tests of file-system logic. It keeps keys
//! exactly as S3 does (flat, sorted, `dir/` markers are ordinary keys).

use super::*;
use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};

#[derive(Default)]
pub struct MemClient {
    objects: Mutex<BTreeMap<String, (Bytes, SystemTime)>>,
    uploads: Mutex<HashMap<String, BTreeMap<i32, Bytes>>>,
    next_upload: Mutex<u64>,
    /// HEAD and LIST requests answered, so tests can count round trips.
    metadata_requests: std::sync::atomic::AtomicU64,
    /// Body bytes received by PutObject and UploadPart (not copies made on the server).
    bytes_received: std::sync::atomic::AtomicU64,
    /// User metadata by key (kept apart so the object map stays as it is), and the
    /// metadata multipart uploads will give their objects.
    user_meta: Mutex<HashMap<String, UserMeta>>,
    upload_meta: Mutex<HashMap<String, UserMeta>>,
    /// Content-Type by key, as the metadata written gave it ([`CONTENT_TYPE`]); none: the
    /// object was stored without one.
    content_types: Mutex<HashMap<String, String>>,
    /// Times a metadata replacement was asked for (tests check coalescing with it).
    meta_replacements: std::sync::atomic::AtomicU64,
    /// Ranged GETs answered.
    gets: std::sync::atomic::AtomicU64,
    /// LIST requests answered (also counted in `metadata_requests`).
    lists: std::sync::atomic::AtomicU64,
    /// Conditional writes answered 501, as by a store that does not implement them.
    conditions_not_implemented: std::sync::atomic::AtomicBool,
    /// Metadata replacements wait for a permit here (see `hold_metadata_replacements`).
    replacements_gate: Mutex<Option<Arc<tokio::sync::Semaphore>>>,
    /// A PUT of this key panics (see `panic_on_put`).
    panics_on_put: Mutex<Option<String>>,
}

impl MemClient {
    pub fn new() -> Self {
        Self::default()
    }
    pub fn insert(&self, key: &str, body: impl Into<Bytes>) {
        self.objects
            .lock()
            .unwrap()
            .insert(key.to_string(), (body.into(), SystemTime::now()));
    }
    pub fn get(&self, key: &str) -> Option<Bytes> {
        self.objects.lock().unwrap().get(key).map(|v| v.0.clone())
    }
    pub fn keys(&self) -> Vec<String> {
        self.objects.lock().unwrap().keys().cloned().collect()
    }
    /// The user metadata `key` carries.
    pub fn user_meta(&self, key: &str) -> UserMeta {
        self.user_meta
            .lock()
            .unwrap()
            .get(key)
            .cloned()
            .unwrap_or_default()
    }
    /// Stores an object with user metadata (and a Content-Type under [`CONTENT_TYPE`]),
    /// as another client (s3fs) would.
    pub fn insert_with_meta(&self, key: &str, body: impl Into<Bytes>, meta: UserMeta) {
        self.insert(key, body);
        self.set_user_meta(key, Some(meta));
    }
    /// The Content-Type `key` was stored with.
    pub fn content_type(&self, key: &str) -> Option<String> {
        self.content_types.lock().unwrap().get(key).cloned()
    }
    pub fn meta_replacements(&self) -> u64 {
        self.meta_replacements
            .load(std::sync::atomic::Ordering::SeqCst)
    }
    /// Stores `meta` as what `key` carries: its Content-Type apart, the rest as its user
    /// metadata (`None`: neither, as a write without them leaves an object).
    fn set_user_meta(&self, key: &str, mut meta: Option<UserMeta>) {
        let content_type = meta.as_mut().and_then(|m| m.remove(CONTENT_TYPE));
        {
            let mut types = self.content_types.lock().unwrap();
            match content_type {
                Some(t) => types.insert(key.to_string(), t),
                None => types.remove(key),
            };
        }
        let mut m = self.user_meta.lock().unwrap();
        match meta.filter(|m| !m.is_empty()) {
            Some(meta) => m.insert(key.to_string(), meta),
            None => m.remove(key),
        };
    }
    pub fn metadata_requests(&self) -> u64 {
        self.metadata_requests
            .load(std::sync::atomic::Ordering::SeqCst)
    }
    pub fn gets(&self) -> u64 {
        self.gets.load(std::sync::atomic::Ordering::SeqCst)
    }
    pub fn lists(&self) -> u64 {
        self.lists.load(std::sync::atomic::Ordering::SeqCst)
    }
    /// HEAD requests answered: the metadata requests that were not LISTs.
    pub fn heads(&self) -> u64 {
        self.metadata_requests() - self.lists()
    }
    pub fn bytes_received(&self) -> u64 {
        self.bytes_received
            .load(std::sync::atomic::Ordering::SeqCst)
    }

    /// From now on, each metadata replacement (counted when it arrives) waits for a
    /// permit the test adds to the returned semaphore.
    pub fn hold_metadata_replacements(&self) -> Arc<tokio::sync::Semaphore> {
        let gate = Arc::new(tokio::sync::Semaphore::new(0));
        *self.replacements_gate.lock().unwrap() = Some(gate.clone());
        gate
    }

    /// From now on, a PUT of `key` panics, as a bug in the task that sends it would.
    pub fn panic_on_put(&self, key: &str) {
        *self.panics_on_put.lock().unwrap() = Some(key.to_string());
    }

    /// From now on, a write with a condition is answered `NotImplemented` (HTTP 501).
    pub fn without_conditional_writes(&self) {
        self.conditions_not_implemented
            .store(true, std::sync::atomic::Ordering::SeqCst);
    }

    fn refuses(&self, cond: Option<&WriteCondition>) -> S3Result<()> {
        match cond.is_some()
            && self
                .conditions_not_implemented
                .load(std::sync::atomic::Ordering::SeqCst)
        {
            true => Err(S3Error::NotImplemented("conditional writes".into())),
            false => Ok(()),
        }
    }

    /// Stores `body` at `key` if `cond` holds, atomically.
    fn store_if(
        &self,
        key: &str,
        body: Bytes,
        cond: Option<&WriteCondition>,
    ) -> S3Result<ObjectMeta> {
        let now = SystemTime::now();
        let meta = Self::meta(&body, now);
        let mut objs = self.objects.lock().unwrap();
        let holds = match (cond, objs.get(key)) {
            (None, _) | (Some(WriteCondition::IfNoneMatch), None) => true,
            (Some(WriteCondition::IfMatch(etag)), Some((old, _))) => Self::etag_of(old) == *etag,
            _ => false,
        };
        if !holds {
            return Err(S3Error::PreconditionFailed);
        }
        objs.insert(key.to_string(), (body, now));
        Ok(meta)
    }

    pub fn open_uploads(&self) -> usize {
        self.uploads.lock().unwrap().len()
    }
    fn meta(body: &Bytes, mtime: SystemTime) -> ObjectMeta {
        ObjectMeta {
            size: body.len() as u64,
            mtime,
            etag: Some(Self::etag_of(body)),
        }
    }
    /// A digest of the content, as S3's single-part ETags are, so that two versions differ.
    fn etag_of(body: &Bytes) -> String {
        use std::hash::{Hash, Hasher};
        let mut h = std::collections::hash_map::DefaultHasher::new();
        body.hash(&mut h);
        format!("\"{:016x}\"", h.finish())
    }
    fn check_version(&self, key: &str, etag: &str) -> S3Result<()> {
        let objs = self.objects.lock().unwrap();
        let (body, _) = objs.get(key).ok_or(S3Error::NotFound)?;
        if Self::etag_of(body) != etag {
            return Err(S3Error::PreconditionFailed);
        }
        Ok(())
    }
}

#[async_trait]
impl ObjectClient for MemClient {
    async fn head_object(&self, key: &str) -> S3Result<ObjectMeta> {
        self.metadata_requests
            .fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        let objs = self.objects.lock().unwrap();
        // Last-Modified is an HTTP date, to the second, where LIST says milliseconds (as
        // moto and the embedded server do).
        let to_second = |t: SystemTime| {
            let secs = t
                .duration_since(SystemTime::UNIX_EPOCH)
                .map_or(0, |d| d.as_secs());
            SystemTime::UNIX_EPOCH + std::time::Duration::from_secs(secs)
        };
        objs.get(key)
            .map(|(b, t)| Self::meta(b, to_second(*t)))
            .ok_or(S3Error::NotFound)
    }

    async fn list(&self, req: ListRequest<'_>) -> S3Result<ListPage> {
        self.metadata_requests
            .fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        self.lists.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        let objs = self.objects.lock().unwrap();
        let mut page = ListPage::default();
        let mut last_returned: Option<String> = None;
        let mut count = 0;
        for (key, (body, mtime)) in objs.range(req.prefix.to_string()..) {
            if !key.starts_with(req.prefix) {
                break;
            }
            if req.continuation.is_none() && req.start_after.is_some_and(|a| key.as_str() <= a) {
                continue;
            }
            let rest = &key[req.prefix.len()..];
            let common = req.delimiter.and_then(|d| {
                rest.find(d)
                    .map(|i| format!("{}{}", req.prefix, &rest[..i + d.len()]))
            });
            let order_name = common.clone().unwrap_or_else(|| key.clone());
            if req
                .continuation
                .is_some_and(|after| order_name.as_str() <= after)
            {
                continue;
            }
            if last_returned.as_deref() == Some(order_name.as_str()) {
                continue;
            }
            if count == req.max_keys {
                page.next_token = last_returned;
                break;
            }
            count += 1;
            last_returned = Some(order_name);
            match common {
                Some(p) => page.prefixes.push(p),
                None => page.objects.push(ListedObject {
                    key: key.clone(),
                    meta: Self::meta(body, *mtime),
                }),
            }
        }
        Ok(page)
    }

    async fn get_range(&self, key: &str, start: u64, end: u64) -> S3Result<Bytes> {
        self.gets.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        let objs = self.objects.lock().unwrap();
        let (body, _) = objs.get(key).ok_or(S3Error::NotFound)?;
        let end = end.min(body.len() as u64) as usize;
        let start = (start as usize).min(end);
        Ok(body.slice(start..end))
    }

    async fn get_range_if_match(
        &self,
        key: &str,
        etag: &str,
        start: u64,
        end: u64,
    ) -> S3Result<Bytes> {
        self.check_version(key, etag)?;
        self.get_range(key, start, end).await
    }

    async fn put_object_if(
        &self,
        key: &str,
        body: Bytes,
        cond: Option<&WriteCondition>,
        meta: Option<&UserMeta>,
    ) -> S3Result<ObjectMeta> {
        if self.panics_on_put.lock().unwrap().as_deref() == Some(key) {
            panic!("PUT of {key}: the test asked for a panic");
        }
        self.refuses(cond)?;
        self.bytes_received
            .fetch_add(body.len() as u64, std::sync::atomic::Ordering::SeqCst);
        let done = self.store_if(key, body, cond)?;
        self.set_user_meta(key, meta.cloned());
        Ok(done)
    }

    async fn create_multipart(&self, key: &str) -> S3Result<String> {
        let mut n = self.next_upload.lock().unwrap();
        *n += 1;
        let id = format!("{key}#{n}");
        self.uploads
            .lock()
            .unwrap()
            .insert(id.clone(), BTreeMap::new());
        Ok(id)
    }

    async fn upload_part(
        &self,
        _key: &str,
        upload_id: &str,
        part_number: i32,
        body: Bytes,
    ) -> S3Result<CompletedPart> {
        self.bytes_received
            .fetch_add(body.len() as u64, std::sync::atomic::Ordering::SeqCst);
        let mut ups = self.uploads.lock().unwrap();
        let parts = ups.get_mut(upload_id).ok_or(S3Error::NotFound)?;
        parts.insert(part_number, body);
        Ok(CompletedPart {
            part_number,
            etag: format!("p{part_number}"),
        })
    }

    async fn complete_multipart_if(
        &self,
        key: &str,
        upload_id: &str,
        parts: Vec<CompletedPart>,
        cond: Option<&WriteCondition>,
    ) -> S3Result<ObjectMeta> {
        // Refused before the upload is touched: it can be completed without the condition.
        self.refuses(cond)?;
        let stored = self
            .uploads
            .lock()
            .unwrap()
            .remove(upload_id)
            .ok_or(S3Error::NotFound)?;
        let mut body = Vec::new();
        for p in parts {
            body.extend_from_slice(stored.get(&p.part_number).ok_or(S3Error::NotFound)?);
        }
        let meta = self.upload_meta.lock().unwrap().remove(upload_id);
        let done = self.store_if(key, body.into(), cond)?;
        self.set_user_meta(key, meta);
        Ok(done)
    }

    async fn abort_multipart(&self, _key: &str, upload_id: &str) -> S3Result<()> {
        self.uploads.lock().unwrap().remove(upload_id);
        Ok(())
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
        if let Some(etag) = src_etag {
            self.check_version(src, etag)?;
        }
        let body = self.get_range(src, start, end).await?;
        let _ = key;
        let mut ups = self.uploads.lock().unwrap();
        let parts = ups.get_mut(upload_id).ok_or(S3Error::NotFound)?;
        parts.insert(part_number, body);
        Ok(CompletedPart {
            part_number,
            etag: format!("p{part_number}"),
        })
    }

    async fn copy_object_if(
        &self,
        src: &str,
        dst: &str,
        _size: u64,
        src_etag: Option<&str>,
        content_type: Option<&str>,
    ) -> S3Result<()> {
        if let Some(want) = src_etag {
            if self.head_object(src).await?.etag.as_deref() != Some(want) {
                return Err(S3Error::PreconditionFailed);
            }
        }
        let body = self.get(src).ok_or(S3Error::NotFound)?;
        // CopyObject keeps the source's metadata (MetadataDirective=COPY); a new
        // Content-Type replaces only that (REPLACE with the source's user metadata).
        let mut meta = self.user_meta(src);
        if let Some(t) = content_type
            .map(str::to_string)
            .or_else(|| self.content_type(src))
        {
            meta.insert(CONTENT_TYPE.to_string(), t);
        }
        self.put_object(dst, body).await?;
        self.set_user_meta(dst, Some(meta));
        Ok(())
    }

    async fn delete_object(&self, key: &str) -> S3Result<()> {
        self.objects.lock().unwrap().remove(key);
        self.set_user_meta(key, None);
        Ok(())
    }

    async fn head_object_with_meta(&self, key: &str) -> S3Result<(ObjectMeta, UserMeta)> {
        let meta = self.head_object(key).await?;
        let mut headers = self.user_meta(key);
        if let Some(t) = self.content_type(key) {
            headers.insert(CONTENT_TYPE.to_string(), t);
        }
        Ok((meta, headers))
    }

    async fn create_multipart_with_meta(&self, key: &str, meta: &UserMeta) -> S3Result<String> {
        let id = self.create_multipart(key).await?;
        self.upload_meta
            .lock()
            .unwrap()
            .insert(id.clone(), meta.clone());
        Ok(id)
    }

    async fn replace_metadata(
        &self,
        key: &str,
        etag: &str,
        _size: u64,
        meta: &UserMeta,
    ) -> S3Result<ObjectMeta> {
        self.meta_replacements
            .fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        let gate = self.replacements_gate.lock().unwrap().clone();
        if let Some(gate) = gate {
            gate.acquire()
                .await
                .map_err(|_| S3Error::Other("gate closed".into()))?
                .forget();
        }
        self.check_version(key, etag)?;
        // A copy onto itself: same bytes and ETag, a new Last-Modified.
        let now = SystemTime::now();
        let mut objs = self.objects.lock().unwrap();
        let entry = objs.get_mut(key).ok_or(S3Error::NotFound)?;
        entry.1 = now;
        let out = Self::meta(&entry.0, now);
        drop(objs);
        self.set_user_meta(key, Some(meta.clone()));
        Ok(out)
    }
}
