//! The one seam between the file system and the object store.
//!
//! Everything above this module talks to [`ObjectClient`]; the real implementation
//! ([`aws::AwsClient`]) wraps aws-sdk-s3, and [`mem::MemClient`] is an in-memory double
//! for unit tests of file-system logic. Integration tests always use the real client
//! against a real S3-compatible server.

pub mod aws;
pub mod mem;
pub mod metered;
pub mod split_list;

use async_trait::async_trait;
use bytes::Bytes;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::SystemTime;

/// Largest object a single CopyObject may copy; above it we copy part by part.
pub const MAX_SINGLE_COPY: u64 = 5 * 1024 * 1024 * 1024;

#[derive(Debug, thiserror::Error, Clone, PartialEq, Eq)]
pub enum S3Error {
    #[error("no such key")]
    NotFound,
    #[error("bucket does not exist")]
    NoSuchBucket,
    #[error("access denied: {0}")]
    AccessDenied(String),
    #[error("precondition failed")]
    PreconditionFailed,
    /// The store does not implement a request or a header of it (HTTP 501), e.g. a
    /// conditional write.
    #[error("not implemented by the S3 store: {0}")]
    NotImplemented(String),
    #[error("cannot reach the S3 endpoint: {0}")]
    Unreachable(String),
    #[error("S3 request timed out")]
    Timeout,
    #[error("S3 error: {0}")]
    Other(String),
}

impl S3Error {
    /// The errno a file-system operation reports for this failure.
    pub fn errno(&self) -> i32 {
        match self {
            S3Error::NotFound => libc::ENOENT,
            S3Error::AccessDenied(_) => libc::EACCES,
            S3Error::Timeout => libc::ETIMEDOUT,
            _ => libc::EIO,
        }
    }
}

pub type S3Result<T> = Result<T, S3Error>;

/// An object's user metadata: its `x-amz-meta-*` headers, names lower-case and without
/// that prefix (`mode`, `uid`, ... as s3fs writes them, see `fs::meta`), and its
/// Content-Type under the name [`CONTENT_TYPE`]: HEAD returns it there, and PutObject,
/// CreateMultipartUpload and `replace_metadata` send it as the object's Content-Type, so
/// the type travels (and is kept) wherever the rest of the metadata does.
pub type UserMeta = std::collections::BTreeMap<String, String>;

/// The name under which a [`UserMeta`] carries the object's Content-Type. No header can
/// have it (`:` is not allowed in a header name), so no user metadata clashes with it; a
/// client sends it as `Content-Type`, never as `x-amz-meta-*`.
pub const CONTENT_TYPE: &str = ":content-type";

/// Metadata of one object, from HeadObject or a listing.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ObjectMeta {
    pub size: u64,
    pub mtime: SystemTime,
    pub etag: Option<String>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ListedObject {
    pub key: String,
    pub meta: ObjectMeta,
}

/// One page of ListObjectsV2.
#[derive(Debug, Clone, Default)]
pub struct ListPage {
    pub objects: Vec<ListedObject>,
    /// Common prefixes (with their trailing delimiter), only when a delimiter was given.
    pub prefixes: Vec<String>,
    pub next_token: Option<String>,
}

#[derive(Debug, Clone)]
pub struct ListRequest<'a> {
    pub prefix: &'a str,
    pub delimiter: Option<&'a str>,
    pub continuation: Option<&'a str>,
    /// Keys after this one only (ignored with a continuation token, as S3 does).
    pub start_after: Option<&'a str>,
    pub max_keys: i32,
}

/// A condition on a write (PutObject, CompleteMultipartUpload): S3 refuses the write with
/// `PreconditionFailed` when it does not hold, so a concurrent writer is never overwritten.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum WriteCondition {
    /// The key still holds the version with this ETag.
    IfMatch(String),
    /// The key holds no object.
    IfNoneMatch,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CompletedPart {
    pub part_number: i32,
    pub etag: String,
}

/// Whether this mount sends conditions with its writes: yes until the store is seen not
/// to honour them (the probe below, or a write refused as not implemented), then never
/// again, with one warning. Shared by every writer of a mount.
#[derive(Debug)]
pub struct ConditionalWrites(AtomicBool);

impl Default for ConditionalWrites {
    fn default() -> Self {
        Self(AtomicBool::new(true))
    }
}

impl ConditionalWrites {
    pub fn honoured(&self) -> bool {
        self.0.load(Ordering::Relaxed)
    }

    pub fn not_honoured(&self, why: &str) {
        if self.0.swap(false, Ordering::Relaxed) {
            tracing::warn!(reason = %why,
                "the S3 store does not honour conditional writes: edits in place are \
                 last-writer-wins and O_EXCL creates are not exclusive on this mount");
        }
    }

    /// Runs `send` with `cond` while conditions are honoured, and once more without it
    /// when the store answers that it does not implement them.
    pub async fn send<T, F, Fut>(&self, cond: Option<WriteCondition>, send: F) -> S3Result<T>
    where
        F: Fn(Option<WriteCondition>) -> Fut,
        Fut: std::future::Future<Output = S3Result<T>>,
    {
        let cond = cond.filter(|_| self.honoured());
        match send(cond.clone()).await {
            Err(S3Error::NotImplemented(why)) if cond.is_some() => {
                self.not_honoured(&why);
                send(None).await
            }
            other => other,
        }
    }
}

/// Whether the store honours conditional writes, learnt from one PUT that must be refused:
/// `If-Match` on `probe_key`, a key nobody uses, so a store that checks the condition
/// answers 404/412 and writes nothing. `Some(false)`: 501, or the object was written (the
/// header was ignored; the object is removed again). `None`: no answer that tells (an
/// error, no permission to write).
pub async fn honours_conditional_writes(
    client: &dyn ObjectClient,
    probe_key: &str,
) -> Option<bool> {
    let never = WriteCondition::IfMatch("\"s3csi-probe-matches-no-object\"".into());
    // One byte: moto never answers a conditional PUT of an empty body.
    match client
        .put_object_if(probe_key, Bytes::from_static(b"p"), Some(&never), None)
        .await
    {
        Err(S3Error::NotFound | S3Error::PreconditionFailed) => Some(true),
        Err(S3Error::NotImplemented(_)) => Some(false),
        Ok(_) => {
            let _ = client.delete_object(probe_key).await;
            Some(false)
        }
        Err(_) => None,
    }
}

#[async_trait]
pub trait ObjectClient: Send + Sync + 'static {
    async fn head_object(&self, key: &str) -> S3Result<ObjectMeta>;
    async fn list(&self, req: ListRequest<'_>) -> S3Result<ListPage>;
    /// Bytes `start..end` (end exclusive) of `key`.
    async fn get_range(&self, key: &str, start: u64, end: u64) -> S3Result<Bytes>;
    /// Bytes `start..end` of the version of `key` whose ETag is `etag`;
    /// `PreconditionFailed` once the key holds another version.
    async fn get_range_if_match(
        &self,
        key: &str,
        etag: &str,
        start: u64,
        end: u64,
    ) -> S3Result<Bytes>;
    async fn put_object(&self, key: &str, body: Bytes) -> S3Result<ObjectMeta> {
        self.put_object_if(key, body, None, None).await
    }
    /// PutObject, refused (`PreconditionFailed`) unless `cond` holds, carrying `meta` as
    /// the object's user metadata when given. A client without metadata support drops it.
    async fn put_object_if(
        &self,
        key: &str,
        body: Bytes,
        cond: Option<&WriteCondition>,
        meta: Option<&UserMeta>,
    ) -> S3Result<ObjectMeta>;
    async fn create_multipart(&self, key: &str) -> S3Result<String>;
    async fn upload_part(
        &self,
        key: &str,
        upload_id: &str,
        part_number: i32,
        body: Bytes,
    ) -> S3Result<CompletedPart>;
    async fn complete_multipart(
        &self,
        key: &str,
        upload_id: &str,
        parts: Vec<CompletedPart>,
    ) -> S3Result<ObjectMeta> {
        self.complete_multipart_if(key, upload_id, parts, None)
            .await
    }
    /// CompleteMultipartUpload, refused (`PreconditionFailed`) unless `cond` holds.
    async fn complete_multipart_if(
        &self,
        key: &str,
        upload_id: &str,
        parts: Vec<CompletedPart>,
        cond: Option<&WriteCondition>,
    ) -> S3Result<ObjectMeta>;
    async fn abort_multipart(&self, key: &str, upload_id: &str) -> S3Result<()>;
    /// Part `part_number` of upload `upload_id` of `key`, copied on the server from bytes
    /// `start..end` of `src`; with `src_etag`, only from that version of `src`
    /// (`PreconditionFailed` otherwise).
    #[allow(clippy::too_many_arguments)]
    async fn upload_part_copy(
        &self,
        key: &str,
        upload_id: &str,
        part_number: i32,
        src: &str,
        src_etag: Option<&str>,
        start: u64,
        end: u64,
    ) -> S3Result<CompletedPart>;
    /// Copy `src` onto `dst` within the bucket; `size` picks single or multipart copy.
    /// The copy keeps the source's user metadata and Content-Type.
    async fn copy_object(&self, src: &str, dst: &str, size: u64) -> S3Result<()> {
        self.copy_object_if(src, dst, size, None, None).await
    }
    /// The same, only from the version of `src` whose ETag is `src_etag` when given
    /// (`x-amz-copy-source-if-match`): `PreconditionFailed` once `src` holds another.
    /// With `content_type`, the copy gets that Content-Type and the source's user metadata
    /// (read by a HEAD, then a copy with `MetadataDirective=REPLACE`).
    async fn copy_object_if(
        &self,
        src: &str,
        dst: &str,
        size: u64,
        src_etag: Option<&str>,
        content_type: Option<&str>,
    ) -> S3Result<()>;
    async fn delete_object(&self, key: &str) -> S3Result<()>;

    // ---- user metadata. The defaults drop it, so that a client without metadata
    // support still works (and stored metadata is then simply not honoured).

    /// HeadObject with the object's user metadata.
    async fn head_object_with_meta(&self, key: &str) -> S3Result<(ObjectMeta, UserMeta)> {
        Ok((self.head_object(key).await?, UserMeta::new()))
    }
    /// PutObject carrying `meta` as the object's user metadata.
    async fn put_object_with_meta(
        &self,
        key: &str,
        body: Bytes,
        meta: &UserMeta,
    ) -> S3Result<ObjectMeta> {
        self.put_object_if(key, body, None, Some(meta)).await
    }
    /// CreateMultipartUpload whose object will carry `meta`.
    async fn create_multipart_with_meta(&self, key: &str, meta: &UserMeta) -> S3Result<String> {
        let _ = meta;
        self.create_multipart(key).await
    }
    /// Replaces the user metadata of the version `etag` (`size` bytes) of `key`: a copy
    /// onto itself with `MetadataDirective=REPLACE` and `x-amz-copy-source-if-match`, part
    /// by part above 5 GiB. The object's Content-Type becomes `meta`'s [`CONTENT_TYPE`]
    /// (REPLACE replaces it too: without one, the store picks its default). `PreconditionFailed` once the key holds another version, so a
    /// metadata update never resurrects data another client replaced.
    async fn replace_metadata(
        &self,
        key: &str,
        etag: &str,
        size: u64,
        meta: &UserMeta,
    ) -> S3Result<ObjectMeta> {
        let _ = (key, etag, size, meta);
        Err(S3Error::Other("this client cannot replace metadata".into()))
    }

    /// Deletes many keys; returns how many were deleted.
    async fn delete_objects(&self, keys: Vec<String>) -> S3Result<usize> {
        let n = keys.len();
        for k in keys {
            self.delete_object(&k).await?;
        }
        Ok(n)
    }
}

/// `replace_metadata` above 5 GiB, where S3 refuses CopyObject: a multipart upload onto
/// the key carrying `meta`, its parts copied on the server from that exact version.
pub async fn replace_metadata_by_parts<C: ObjectClient + ?Sized>(
    client: &C,
    key: &str,
    etag: &str,
    size: u64,
    meta: &UserMeta,
) -> S3Result<ObjectMeta> {
    const COPY_PART: u64 = 512 * 1024 * 1024;
    let upload_id = client.create_multipart_with_meta(key, meta).await?;
    let mut parts = Vec::new();
    let (mut start, mut number) = (0, 1);
    while start < size {
        let end = (start + COPY_PART).min(size);
        match client
            .upload_part_copy(key, &upload_id, number, key, Some(etag), start, end)
            .await
        {
            Ok(part) => parts.push(part),
            Err(e) => {
                let _ = client.abort_multipart(key, &upload_id).await;
                return Err(e);
            }
        }
        start = end;
        number += 1;
    }
    match client.complete_multipart(key, &upload_id, parts).await {
        Ok(m) => Ok(m),
        Err(e) => {
            let _ = client.abort_multipart(key, &upload_id).await;
            Err(e)
        }
    }
}
