//! The S3 operations, as a thin `s3s::S3` adapter over [`Store`]: decode the request's
//! fields, call the store, encode its answer; every store error becomes an S3 error
//! (code, status, message) in one place, [`s3_err`].

use super::store::{ListQuery, ListResult, ObjectInfo, Store, StoreError, WriteIf, MAX_KEYS};
use futures::StreamExt;
use s3s::dto::*;
use s3s::{s3_error, S3Error, S3Request, S3Response, S3Result};
use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::SystemTime;

/// Chunk size of GET bodies.
pub const READ_CHUNK: usize = 1024 * 1024;

pub struct Backend {
    pub store: Arc<Store>,
}

fn s3_err(e: StoreError) -> S3Error {
    match e {
        StoreError::NoSuchBucket => s3_error!(NoSuchBucket),
        StoreError::NoSuchKey => s3_error!(NoSuchKey),
        StoreError::NoSuchUpload => s3_error!(NoSuchUpload),
        StoreError::BucketNotEmpty => s3_error!(BucketNotEmpty),
        StoreError::BucketAlreadyOwnedByYou => s3_error!(BucketAlreadyOwnedByYou),
        StoreError::InvalidBucketName => s3_error!(InvalidBucketName),
        StoreError::InvalidPart(m) => s3_error!(InvalidPart, "{m}"),
        StoreError::InvalidPartOrder => s3_error!(InvalidPartOrder),
        StoreError::EntityTooSmall => s3_error!(EntityTooSmall),
        StoreError::InvalidArgument(m) => s3_error!(InvalidArgument, "{m}"),
        StoreError::InvalidRequest(m) => s3_error!(InvalidRequest, "{m}"),
        StoreError::PreconditionFailed => s3_error!(PreconditionFailed),
        StoreError::IncompleteBody(m) => s3_error!(IncompleteBody, "{m}"),
        StoreError::Io(e) => {
            tracing::error!(error = %e, "storage error");
            s3_error!(InternalError, "storage error: {e}")
        }
    }
}

fn etag(info: &ObjectInfo) -> ETag {
    ETag::Strong(info.etag.clone())
}

/// `x-amz-meta-*` as s3s hands them over (names without the prefix), kept lower-case as
/// S3 does.
fn user_meta_in(m: Option<std::collections::HashMap<String, String>>) -> BTreeMap<String, String> {
    m.into_iter()
        .flatten()
        .map(|(k, v)| (k.to_ascii_lowercase(), v))
        .collect()
}

fn user_meta_out(info: &ObjectInfo) -> Option<std::collections::HashMap<String, String>> {
    (!info.user_meta.is_empty()).then(|| {
        info.user_meta
            .iter()
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect()
    })
}

fn ts(t: SystemTime) -> Timestamp {
    Timestamp::from(t)
}

fn non_empty(s: &Option<String>) -> Option<&str> {
    s.as_deref().filter(|s| !s.is_empty())
}

/// `encoding-type=url`: keys and prefixes percent-encoded (all but unreserved and `/`).
fn url_encode(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for b in s.bytes() {
        if b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.' | b'~' | b'/') {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

/// Checks If-Match / If-None-Match against the object's ETag (GET and HEAD).
fn check_conditions(
    info: &ObjectInfo,
    if_match: &Option<ETagCondition>,
    if_none_match: &Option<ETagCondition>,
) -> S3Result<()> {
    let current = etag(info);
    if let Some(cond) = if_match {
        let ok = match cond {
            ETagCondition::Any => true,
            ETagCondition::ETag(e) => e.strong_cmp(&current),
        };
        if !ok {
            return Err(s3_error!(PreconditionFailed));
        }
    }
    if let Some(cond) = if_none_match {
        let hit = match cond {
            ETagCondition::Any => true,
            ETagCondition::ETag(e) => e.weak_cmp(&current),
        };
        if hit {
            return Err(s3_error!(NotModified));
        }
    }
    Ok(())
}

/// The condition of a conditional write (PutObject, CompleteMultipartUpload): S3 accepts
/// `If-Match: ETAG` and `If-None-Match: *` there.
fn write_condition(
    if_match: &Option<ETagCondition>,
    if_none_match: &Option<ETagCondition>,
) -> S3Result<Option<WriteIf>> {
    match (if_match, if_none_match) {
        (None, None) => Ok(None),
        (Some(ETagCondition::ETag(e)), None) => {
            Ok(Some(WriteIf::Etag(e.value().trim_matches('"').to_string())))
        }
        (None, Some(ETagCondition::Any)) => Ok(Some(WriteIf::Absent)),
        _ => Err(s3_error!(
            NotImplemented,
            "only If-Match: ETAG or If-None-Match: * are supported on writes"
        )),
    }
}

fn copy_source(src: &CopySource) -> S3Result<(&str, &str)> {
    match src {
        CopySource::Bucket {
            bucket,
            key,
            version_id: None,
        } => Ok((bucket, key)),
        CopySource::Bucket { .. } => Err(s3_error!(
            NotImplemented,
            "versioned copy sources are not supported"
        )),
        _ => Err(s3_error!(
            NotImplemented,
            "access point copy sources are not supported"
        )),
    }
}

/// `bytes=first-last` of x-amz-copy-source-range → (first, last + 1).
fn parse_copy_range(text: &str) -> S3Result<(u64, u64)> {
    let bad = || {
        s3_error!(InvalidArgument, "The x-amz-copy-source-range value must be of the form bytes=first-last where first and last are the zero-based offsets of the first and last bytes to copy")
    };
    let (a, b) = text
        .trim()
        .strip_prefix("bytes=")
        .and_then(|r| r.split_once('-'))
        .ok_or_else(bad)?;
    let first: u64 = a.parse().map_err(|_| bad())?;
    let last: u64 = b.parse().map_err(|_| bad())?;
    if last < first {
        return Err(bad());
    }
    Ok((first, last + 1))
}

struct Listing {
    result: ListResult,
    max_keys: i32,
    encode: bool,
}

impl Backend {
    fn list(
        &self,
        bucket: &str,
        prefix: &Option<String>,
        delimiter: &Option<String>,
        after: Option<&str>,
        max_keys: Option<i32>,
        encoding: &Option<EncodingType>,
    ) -> S3Result<Listing> {
        let max_keys = max_keys.unwrap_or(MAX_KEYS as i32);
        if max_keys < 0 {
            return Err(s3_error!(InvalidArgument, "max-keys must not be negative"));
        }
        let encode = match encoding {
            None => false,
            Some(e) if e.as_str() == EncodingType::URL => true,
            Some(_) => {
                return Err(s3_error!(
                    InvalidArgument,
                    "Invalid Encoding Method specified in Request"
                ))
            }
        };
        let result = self
            .store
            .list(
                bucket,
                &ListQuery {
                    prefix: prefix.as_deref().unwrap_or(""),
                    delimiter: non_empty(delimiter),
                    after,
                    max_keys: (max_keys as usize).min(MAX_KEYS),
                },
            )
            .map_err(s3_err)?;
        Ok(Listing {
            result,
            max_keys,
            encode,
        })
    }
}

impl Listing {
    fn enc(&self, s: &str) -> String {
        if self.encode {
            url_encode(s)
        } else {
            s.to_string()
        }
    }

    fn contents(&self) -> Option<Vec<Object>> {
        let objects: Vec<Object> = self
            .result
            .objects
            .iter()
            .map(|(key, info)| Object {
                key: Some(self.enc(key)),
                size: Some(info.size as i64),
                e_tag: Some(etag(info)),
                last_modified: Some(ts(info.mtime)),
                storage_class: Some(ObjectStorageClass::from_static(
                    ObjectStorageClass::STANDARD,
                )),
                ..Default::default()
            })
            .collect();
        (!objects.is_empty()).then_some(objects)
    }

    fn common_prefixes(&self) -> Option<Vec<CommonPrefix>> {
        let prefixes: Vec<CommonPrefix> = self
            .result
            .prefixes
            .iter()
            .map(|p| CommonPrefix {
                prefix: Some(self.enc(p)),
            })
            .collect();
        (!prefixes.is_empty()).then_some(prefixes)
    }

    fn opt_enc(&self, s: &Option<String>) -> Option<String> {
        s.as_deref().map(|s| self.enc(s))
    }
}

fn body_stream(
    body: Option<StreamingBlob>,
) -> impl futures::Stream<Item = Result<bytes::Bytes, super::store::BodyError>> + Send {
    match body {
        Some(b) => b.left_stream(),
        None => futures::stream::empty().right_stream(),
    }
}

#[async_trait::async_trait]
impl s3s::S3 for Backend {
    async fn create_bucket(
        &self,
        req: S3Request<CreateBucketInput>,
    ) -> S3Result<S3Response<CreateBucketOutput>> {
        self.store
            .create_bucket(&req.input.bucket)
            .map_err(s3_err)?;
        Ok(S3Response::new(CreateBucketOutput {
            location: Some(format!("/{}", req.input.bucket)),
        }))
    }

    async fn head_bucket(
        &self,
        req: S3Request<HeadBucketInput>,
    ) -> S3Result<S3Response<HeadBucketOutput>> {
        self.store.head_bucket(&req.input.bucket).map_err(s3_err)?;
        Ok(S3Response::new(HeadBucketOutput::default()))
    }

    async fn delete_bucket(
        &self,
        req: S3Request<DeleteBucketInput>,
    ) -> S3Result<S3Response<DeleteBucketOutput>> {
        self.store
            .delete_bucket(&req.input.bucket)
            .map_err(s3_err)?;
        Ok(S3Response::new(DeleteBucketOutput {}))
    }

    async fn get_bucket_location(
        &self,
        req: S3Request<GetBucketLocationInput>,
    ) -> S3Result<S3Response<GetBucketLocationOutput>> {
        self.store.head_bucket(&req.input.bucket).map_err(s3_err)?;
        Ok(S3Response::new(GetBucketLocationOutput::default()))
    }

    async fn list_buckets(
        &self,
        _req: S3Request<ListBucketsInput>,
    ) -> S3Result<S3Response<ListBucketsOutput>> {
        let buckets = self
            .store
            .list_buckets()
            .into_iter()
            .map(|b| Bucket {
                name: Some(b.name),
                creation_date: Some(ts(b.created)),
                bucket_region: None,
            })
            .collect();
        Ok(S3Response::new(ListBucketsOutput {
            buckets: Some(buckets),
            owner: Some(Owner {
                display_name: Some("s3csi".into()),
                id: Some("s3csi".into()),
            }),
            ..Default::default()
        }))
    }

    async fn head_object(
        &self,
        req: S3Request<HeadObjectInput>,
    ) -> S3Result<S3Response<HeadObjectOutput>> {
        let input = req.input;
        let info = self.store.head(&input.bucket, &input.key).map_err(s3_err)?;
        check_conditions(&info, &input.if_match, &input.if_none_match)?;
        Ok(S3Response::new(HeadObjectOutput {
            content_length: Some(info.size as i64),
            content_type: info.content_type.clone(),
            e_tag: Some(etag(&info)),
            last_modified: Some(ts(info.mtime)),
            accept_ranges: Some("bytes".into()),
            metadata: user_meta_out(&info),
            ..Default::default()
        }))
    }

    async fn get_object(
        &self,
        req: S3Request<GetObjectInput>,
    ) -> S3Result<S3Response<GetObjectOutput>> {
        let input = req.input;
        let (info, file) = self
            .store
            .open_object(&input.bucket, &input.key)
            .map_err(s3_err)?;
        check_conditions(&info, &input.if_match, &input.if_none_match)?;
        let (range, content_range) = match &input.range {
            None => (0..info.size, None),
            Some(r) => {
                let range = r.check(info.size)?;
                let cr = format!("bytes {}-{}/{}", range.start, range.end - 1, info.size);
                (range, Some(cr))
            }
        };
        let body = super::store::FileBody::new(file, range.start, range.end, READ_CHUNK);
        Ok(S3Response::new(GetObjectOutput {
            body: Some(StreamingBlob::wrap(body)),
            content_length: Some((range.end - range.start) as i64),
            content_range,
            content_type: info.content_type.clone(),
            e_tag: Some(etag(&info)),
            last_modified: Some(ts(info.mtime)),
            accept_ranges: Some("bytes".into()),
            ..Default::default()
        }))
    }

    async fn put_object(
        &self,
        req: S3Request<PutObjectInput>,
    ) -> S3Result<S3Response<PutObjectOutput>> {
        let input = req.input;
        let cond = write_condition(&input.if_match, &input.if_none_match)?;
        let info = self
            .store
            .put(
                &input.bucket,
                &input.key,
                body_stream(input.body),
                input.content_type,
                user_meta_in(input.metadata),
                cond.as_ref(),
            )
            .await
            .map_err(s3_err)?;
        if let Some(expected) = input.content_length {
            if expected >= 0 && expected as u64 != info.size {
                // hyper enforces Content-Length; this catches decoded aws-chunked bodies.
                tracing::warn!(
                    key = input.key,
                    expected,
                    got = info.size,
                    "body length mismatch"
                );
            }
        }
        Ok(S3Response::new(PutObjectOutput {
            e_tag: Some(etag(&info)),
            size: Some(info.size as i64),
            ..Default::default()
        }))
    }

    async fn delete_object(
        &self,
        req: S3Request<DeleteObjectInput>,
    ) -> S3Result<S3Response<DeleteObjectOutput>> {
        self.store
            .delete(&req.input.bucket, &req.input.key)
            .map_err(s3_err)?;
        Ok(S3Response::new(DeleteObjectOutput::default()))
    }

    async fn delete_objects(
        &self,
        req: S3Request<DeleteObjectsInput>,
    ) -> S3Result<S3Response<DeleteObjectsOutput>> {
        let input = req.input;
        self.store.head_bucket(&input.bucket).map_err(s3_err)?;
        let quiet = input.delete.quiet.unwrap_or(false);
        let mut deleted = vec![];
        let mut errors = vec![];
        for obj in input.delete.objects {
            match self.store.delete(&input.bucket, &obj.key) {
                Ok(()) => deleted.push(DeletedObject {
                    key: Some(obj.key),
                    ..Default::default()
                }),
                Err(e) => {
                    let e = s3_err(e);
                    errors.push(Error {
                        code: Some(e.code().as_str().to_string()),
                        key: Some(obj.key),
                        message: e.message().map(str::to_string),
                        version_id: None,
                    })
                }
            }
        }
        Ok(S3Response::new(DeleteObjectsOutput {
            deleted: (!quiet).then_some(deleted),
            errors: (!errors.is_empty()).then_some(errors),
            ..Default::default()
        }))
    }

    async fn copy_object(
        &self,
        req: S3Request<CopyObjectInput>,
    ) -> S3Result<S3Response<CopyObjectOutput>> {
        let input = req.input;
        let (src_bucket, src_key) = copy_source(&input.copy_source)?;
        let replace = input
            .metadata_directive
            .as_ref()
            .is_some_and(|d| d.as_str() == MetadataDirective::REPLACE);
        if input.copy_source_if_match.is_some() || input.copy_source_if_none_match.is_some() {
            let src = self.store.head(src_bucket, src_key).map_err(s3_err)?;
            check_conditions(
                &src,
                &input.copy_source_if_match,
                &input.copy_source_if_none_match,
            )
            .map_err(|_| s3_error!(PreconditionFailed))?;
        }
        let info = self
            .store
            .copy(
                src_bucket,
                src_key,
                &input.bucket,
                &input.key,
                replace.then_some(input.content_type),
                user_meta_in(input.metadata),
            )
            .await
            .map_err(s3_err)?;
        Ok(S3Response::new(CopyObjectOutput {
            copy_object_result: Some(CopyObjectResult {
                e_tag: Some(etag(&info)),
                last_modified: Some(ts(info.mtime)),
                ..Default::default()
            }),
            ..Default::default()
        }))
    }

    async fn list_objects_v2(
        &self,
        req: S3Request<ListObjectsV2Input>,
    ) -> S3Result<S3Response<ListObjectsV2Output>> {
        let input = req.input;
        let token = match non_empty(&input.continuation_token) {
            Some(t) => Some(
                super::store::unhex(t)
                    .and_then(|b| String::from_utf8(b).ok())
                    .ok_or_else(|| {
                        s3_error!(
                            InvalidArgument,
                            "The continuation token provided is incorrect"
                        )
                    })?,
            ),
            None => None,
        };
        // The token wins; start-after only applies to the first page.
        let after = token.as_deref().or(non_empty(&input.start_after));
        let listing = self.list(
            &input.bucket,
            &input.prefix,
            &input.delimiter,
            after,
            input.max_keys,
            &input.encoding_type,
        )?;
        let r = &listing.result;
        let next = r
            .truncated
            .then(|| r.last.as_deref().map(|l| super::store::hex(l.as_bytes())))
            .flatten();
        Ok(S3Response::new(ListObjectsV2Output {
            name: Some(input.bucket.clone()),
            prefix: Some(listing.enc(input.prefix.as_deref().unwrap_or(""))),
            delimiter: listing.opt_enc(&input.delimiter),
            max_keys: Some(listing.max_keys),
            key_count: Some((r.objects.len() + r.prefixes.len()) as i32),
            is_truncated: Some(r.truncated),
            continuation_token: input.continuation_token.clone(),
            next_continuation_token: next,
            start_after: listing.opt_enc(&input.start_after),
            contents: listing.contents(),
            common_prefixes: listing.common_prefixes(),
            encoding_type: input.encoding_type.clone(),
            ..Default::default()
        }))
    }

    async fn list_objects(
        &self,
        req: S3Request<ListObjectsInput>,
    ) -> S3Result<S3Response<ListObjectsOutput>> {
        let input = req.input;
        let listing = self.list(
            &input.bucket,
            &input.prefix,
            &input.delimiter,
            non_empty(&input.marker),
            input.max_keys,
            &input.encoding_type,
        )?;
        let r = &listing.result;
        let next_marker = if r.truncated {
            r.last.as_deref().map(|l| listing.enc(l))
        } else {
            None
        };
        Ok(S3Response::new(ListObjectsOutput {
            name: Some(input.bucket.clone()),
            prefix: Some(listing.enc(input.prefix.as_deref().unwrap_or(""))),
            marker: Some(listing.enc(input.marker.as_deref().unwrap_or(""))),
            delimiter: listing.opt_enc(&input.delimiter),
            max_keys: Some(listing.max_keys),
            is_truncated: Some(r.truncated),
            next_marker,
            contents: listing.contents(),
            common_prefixes: listing.common_prefixes(),
            encoding_type: input.encoding_type.clone(),
            ..Default::default()
        }))
    }

    async fn create_multipart_upload(
        &self,
        req: S3Request<CreateMultipartUploadInput>,
    ) -> S3Result<S3Response<CreateMultipartUploadOutput>> {
        let input = req.input;
        let upload_id = self
            .store
            .create_upload(
                &input.bucket,
                &input.key,
                input.content_type,
                user_meta_in(input.metadata),
            )
            .map_err(s3_err)?;
        Ok(S3Response::new(CreateMultipartUploadOutput {
            bucket: Some(input.bucket),
            key: Some(input.key),
            upload_id: Some(upload_id),
            ..Default::default()
        }))
    }

    async fn upload_part(
        &self,
        req: S3Request<UploadPartInput>,
    ) -> S3Result<S3Response<UploadPartOutput>> {
        let input = req.input;
        let etag = self
            .store
            .upload_part(
                &input.bucket,
                &input.key,
                &input.upload_id,
                input.part_number,
                body_stream(input.body),
            )
            .await
            .map_err(s3_err)?;
        Ok(S3Response::new(UploadPartOutput {
            e_tag: Some(ETag::Strong(etag)),
            ..Default::default()
        }))
    }

    async fn upload_part_copy(
        &self,
        req: S3Request<UploadPartCopyInput>,
    ) -> S3Result<S3Response<UploadPartCopyOutput>> {
        let input = req.input;
        let (src_bucket, src_key) = copy_source(&input.copy_source)?;
        let range = input
            .copy_source_range
            .as_deref()
            .map(parse_copy_range)
            .transpose()?;
        let (etag, mtime) = self
            .store
            .upload_part_copy(
                &input.bucket,
                &input.key,
                &input.upload_id,
                input.part_number,
                src_bucket,
                src_key,
                range,
                |src| {
                    check_conditions(
                        src,
                        &input.copy_source_if_match,
                        &input.copy_source_if_none_match,
                    )
                    .is_ok()
                },
            )
            .await
            .map_err(s3_err)?;
        Ok(S3Response::new(UploadPartCopyOutput {
            copy_part_result: Some(CopyPartResult {
                e_tag: Some(ETag::Strong(etag)),
                last_modified: Some(ts(mtime)),
                ..Default::default()
            }),
            ..Default::default()
        }))
    }

    async fn complete_multipart_upload(
        &self,
        req: S3Request<CompleteMultipartUploadInput>,
    ) -> S3Result<S3Response<CompleteMultipartUploadOutput>> {
        let input = req.input;
        let parts: Vec<(i32, String)> = input
            .multipart_upload
            .and_then(|m| m.parts)
            .unwrap_or_default()
            .into_iter()
            .map(|p| {
                (
                    p.part_number.unwrap_or(0),
                    p.e_tag.map(|e| e.into_value()).unwrap_or_default(),
                )
            })
            .collect();
        if parts.is_empty() {
            return Err(s3_error!(
                MalformedXML,
                "The XML you provided was not well-formed or did not validate against our published schema"
            ));
        }
        let cond = write_condition(&input.if_match, &input.if_none_match)?;
        let info = self
            .store
            .complete_upload(
                &input.bucket,
                &input.key,
                &input.upload_id,
                &parts,
                cond.as_ref(),
            )
            .await
            .map_err(s3_err)?;
        Ok(S3Response::new(CompleteMultipartUploadOutput {
            bucket: Some(input.bucket.clone()),
            key: Some(input.key.clone()),
            e_tag: Some(etag(&info)),
            location: Some(format!("/{}/{}", input.bucket, input.key)),
            ..Default::default()
        }))
    }

    async fn abort_multipart_upload(
        &self,
        req: S3Request<AbortMultipartUploadInput>,
    ) -> S3Result<S3Response<AbortMultipartUploadOutput>> {
        let input = req.input;
        self.store
            .abort_upload(&input.bucket, &input.key, &input.upload_id)
            .map_err(s3_err)?;
        Ok(S3Response::new(AbortMultipartUploadOutput::default()))
    }

    async fn list_multipart_uploads(
        &self,
        req: S3Request<ListMultipartUploadsInput>,
    ) -> S3Result<S3Response<ListMultipartUploadsOutput>> {
        let input = req.input;
        let max = input.max_uploads.unwrap_or(1000).clamp(0, 1000) as usize;
        let (uploads, truncated) = self
            .store
            .list_uploads(
                &input.bucket,
                input.prefix.as_deref().unwrap_or(""),
                non_empty(&input.key_marker),
                non_empty(&input.upload_id_marker),
                max,
            )
            .map_err(s3_err)?;
        let last = uploads.last().cloned();
        let uploads: Vec<MultipartUpload> = uploads
            .into_iter()
            .map(|u| MultipartUpload {
                key: Some(u.key),
                upload_id: Some(u.upload_id),
                initiated: Some(ts(u.initiated)),
                storage_class: Some(StorageClass::from_static(StorageClass::STANDARD)),
                ..Default::default()
            })
            .collect();
        Ok(S3Response::new(ListMultipartUploadsOutput {
            bucket: Some(input.bucket),
            prefix: input.prefix,
            key_marker: input.key_marker,
            upload_id_marker: input.upload_id_marker,
            max_uploads: Some(max as i32),
            is_truncated: Some(truncated),
            next_key_marker: last.as_ref().filter(|_| truncated).map(|u| u.key.clone()),
            next_upload_id_marker: last.filter(|_| truncated).map(|u| u.upload_id),
            uploads: (!uploads.is_empty()).then_some(uploads),
            ..Default::default()
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn copy_ranges() {
        assert_eq!(parse_copy_range("bytes=0-9").unwrap(), (0, 10));
        assert!(parse_copy_range("bytes=9-0").is_err());
        assert!(parse_copy_range("0-9").is_err());
    }

    #[test]
    fn url_encoding() {
        assert_eq!(url_encode("a b/c+d~é"), "a%20b/c%2Bd~%C3%A9");
    }
}
