//! [`ObjectClient`] over aws-sdk-s3. Credentials come only from the SDK's default chain
//! (environment, profile, web identity / IRSA, container / Pod Identity, IMDS).

use super::*;
use crate::config::units::parse_duration;
use crate::config::Endpoint;
use aws_sdk_s3::error::{ProvideErrorMetadata, SdkError};
use aws_sdk_s3::primitives::ByteStream;
use aws_sdk_s3::types::{CompletedMultipartUpload, CompletedPart as SdkPart};
use aws_sdk_s3::Client;
use std::time::Duration;

/// Client-side time limits. The defaults suit real S3; tests shorten them through the
/// environment (`S3CSI_CONNECT_TIMEOUT`, `S3CSI_READ_TIMEOUT`, `S3CSI_ATTEMPT_TIMEOUT`,
/// durations like `2s` or `500ms`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Timeouts {
    /// Establishing a connection.
    pub connect: Duration,
    /// Waiting for the response to start, and (for downloads) for each further piece of
    /// the body.
    pub read: Duration,
    /// One attempt of one request, until its response headers.
    pub attempt: Duration,
}

/// Attempts per request (the first one and retries), SDK standard retry with backoff.
pub const MAX_ATTEMPTS: u32 = 5;
/// Extra attempts to finish a download whose body broke off after the SDK returned.
const BODY_RETRIES: u32 = 4;

impl Default for Timeouts {
    fn default() -> Self {
        Self {
            connect: Duration::from_secs(5),
            read: Duration::from_secs(30),
            attempt: Duration::from_secs(120),
        }
    }
}

impl Timeouts {
    /// The defaults, overridden by `S3CSI_*_TIMEOUT` variables where set and valid.
    pub fn from_env() -> Self {
        let mut t = Self::default();
        for (var, slot) in [
            ("S3CSI_CONNECT_TIMEOUT", &mut t.connect),
            ("S3CSI_READ_TIMEOUT", &mut t.read),
            ("S3CSI_ATTEMPT_TIMEOUT", &mut t.attempt),
        ] {
            if let Ok(v) = std::env::var(var) {
                match parse_duration(&v) {
                    Ok(d) if !d.is_zero() => *slot = d,
                    _ => tracing::warn!(var, value = %v, "ignoring an invalid timeout"),
                }
            }
        }
        t
    }
}

#[derive(Clone)]
pub struct AwsClient {
    client: Client,
    bucket: String,
    timeouts: Timeouts,
}

impl std::fmt::Debug for AwsClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AwsClient")
            .field("bucket", &self.bucket)
            .finish()
    }
}

impl AwsClient {
    pub async fn new(bucket: &str, endpoint: &Endpoint) -> Self {
        let mut loader = aws_config::defaults(aws_config::BehaviorVersion::latest());
        // S3-compatible stores often have no region; SigV4 still needs one.
        // With a custom endpoint there is no point asking IMDS for a region.
        let region = endpoint
            .region
            .clone()
            .or_else(|| std::env::var("AWS_REGION").ok())
            .or_else(|| std::env::var("AWS_DEFAULT_REGION").ok())
            .or_else(|| {
                endpoint
                    .endpoint_url
                    .as_ref()
                    .map(|_| "us-east-1".to_string())
            });
        if let Some(r) = region {
            loader = loader.region(aws_config::Region::new(r));
        }
        let limits = Timeouts::from_env();
        let timeouts = aws_config::timeout::TimeoutConfig::builder()
            .connect_timeout(limits.connect)
            .read_timeout(limits.read)
            .operation_attempt_timeout(limits.attempt)
            .build();
        let retry = aws_config::retry::RetryConfig::standard().with_max_attempts(MAX_ATTEMPTS);
        loader = loader.timeout_config(timeouts).retry_config(retry);
        let shared = loader.load().await;
        let mut conf = aws_sdk_s3::config::Builder::from(&shared);
        if shared.region().is_none() {
            conf = conf.region(aws_config::Region::new("us-east-1"));
        }
        if let Some(url) = &endpoint.endpoint_url {
            conf = conf.endpoint_url(url);
        }
        conf = conf.force_path_style(endpoint.force_path_style);
        // Checksums only where S3 requires them: many S3-compatible stores reject the
        // newer default trailing checksums on multipart uploads.
        conf = conf
            .request_checksum_calculation(
                aws_sdk_s3::config::RequestChecksumCalculation::WhenRequired,
            )
            .response_checksum_validation(
                aws_sdk_s3::config::ResponseChecksumValidation::WhenRequired,
            );
        Self {
            client: Client::from_conf(conf.build()),
            bucket: bucket.to_string(),
            timeouts: limits,
        }
    }

    /// Like [`AwsClient::new`], but signs with these static credentials instead of the
    /// default chain (the CSI controller's provisioner secrets).
    pub async fn with_static_credentials(
        bucket: &str,
        endpoint: &Endpoint,
        access_key_id: &str,
        secret_access_key: &str,
        session_token: Option<&str>,
    ) -> Self {
        let base = Self::new(bucket, endpoint).await;
        let creds = aws_sdk_s3::config::Credentials::new(
            access_key_id,
            secret_access_key,
            session_token.map(str::to_string),
            None,
            "s3csi-secret",
        );
        let conf = base
            .client
            .config()
            .to_builder()
            .credentials_provider(creds)
            .build();
        Self {
            client: Client::from_conf(conf),
            bucket: base.bucket,
            timeouts: base.timeouts,
        }
    }

    pub fn bucket(&self) -> &str {
        &self.bucket
    }
}

/// Error codes with which S3 refuses the credentials themselves (unknown, revoked or
/// expired keys, a bad signature), as opposed to a policy denying an allowed identity.
const CREDENTIAL_CODES: &[&str] = &[
    "InvalidAccessKeyId",
    "SignatureDoesNotMatch",
    "ExpiredToken",
    "InvalidToken",
    "TokenRefreshRequired",
    "InvalidClientTokenId",
];

/// Maps an SDK failure to our error. Never includes request headers (they carry signatures).
fn map_err<E: ProvideErrorMetadata + std::error::Error + Send + Sync + 'static>(
    err: SdkError<E, aws_sdk_s3::config::http::HttpResponse>,
) -> S3Error {
    match &err {
        SdkError::TimeoutError(_) => S3Error::Timeout,
        SdkError::DispatchFailure(d) => {
            // The request was never sent because the credential chain failed (STS refused
            // the web identity token, no credentials anywhere, ...): say so, not "unreachable".
            if let Some(cause) = d.as_connector_error().and_then(credentials_failure) {
                report_access_problem(
                    "credentials",
                    &format!(
                        "could not obtain AWS credentials ({cause}); file operations fail \
                         with EACCES until the credential source recovers"
                    ),
                );
                return S3Error::AccessDenied(format!("could not obtain AWS credentials: {cause}"));
            }
            if d.is_timeout() {
                S3Error::Timeout
            } else {
                S3Error::Unreachable(
                    d.as_connector_error()
                        .map(|c| format!("{c}"))
                        .unwrap_or_else(|| "connection failed".into()),
                )
            }
        }
        SdkError::ServiceError(_) => {
            let status = err.raw_response().map(|r| r.status().as_u16());
            let code = err.code().unwrap_or("");
            let message = err.message().unwrap_or("").to_string();
            match (code, status) {
                ("NoSuchKey" | "NotFound", _) => S3Error::NotFound,
                ("NoSuchBucket", _) => S3Error::NoSuchBucket,
                (code, _) if CREDENTIAL_CODES.contains(&code) => {
                    let detail = format!("{code}: {}", clip(&message, 200));
                    report_access_problem(
                        code,
                        &format!(
                            "S3 rejected our credentials ({detail}); file operations fail with \
                             EACCES until the AWS credential chain provides valid ones"
                        ),
                    );
                    S3Error::AccessDenied(detail)
                }
                ("AccessDenied" | "Forbidden", _) | (_, Some(403)) => {
                    if code.is_empty() {
                        // A HEAD answer has no body to name a cause; the LIST sent with
                        // it (or the next GET) does, and is the one logged.
                        tracing::debug!("S3 answered 403 Forbidden without an error code");
                        return S3Error::AccessDenied("403 Forbidden".to_string());
                    }
                    let detail = format!("{code}: {}", clip(&message, 200));
                    report_access_problem(
                        code,
                        &format!(
                            "S3 denied access ({detail}): the credentials are not allowed this \
                             request; it fails with EACCES"
                        ),
                    );
                    S3Error::AccessDenied(detail)
                }
                ("PreconditionFailed", _) | (_, Some(412)) => S3Error::PreconditionFailed,
                ("NotImplemented", _) | (_, Some(501)) => {
                    S3Error::NotImplemented(clip(&message, 200))
                }
                (_, Some(404)) => S3Error::NotFound,
                (_, _) if code.is_empty() => {
                    // Only the error chain, never the raw response with its headers.
                    let detail = err
                        .as_service_error()
                        .map(|e| e.to_string())
                        .unwrap_or_default();
                    S3Error::Other(format!(
                        "HTTP {}: {}",
                        status.map(|s| s.to_string()).unwrap_or_else(|| "?".into()),
                        detail.chars().take(300).collect::<String>()
                    ))
                }
                _ => S3Error::Other(format!(
                    "{code} (HTTP {}){}{}",
                    status.map(|s| s.to_string()).unwrap_or_else(|| "?".into()),
                    if message.is_empty() { "" } else { ": " },
                    message
                )),
            }
        }
        SdkError::ResponseError(_) => S3Error::Other("malformed response from S3".into()),
        SdkError::ConstructionFailure(_) => S3Error::Other("could not build the S3 request".into()),
        _ => S3Error::Other("S3 request failed".into()),
    }
}

/// At most `max` characters, on one line (line breaks and runs of spaces become one space).
fn clip(s: &str, max: usize) -> String {
    s.split(|c: char| c.is_whitespace() || c.is_control())
        .filter(|w| !w.is_empty())
        .collect::<Vec<_>>()
        .join(" ")
        .chars()
        .take(max)
        .collect()
}

/// Whether `e` is the SDK's `CredentialsError`. aws-credential-types is not a direct
/// dependency; its error type is named through the provider trait aws-sdk-s3 re-exports.
fn is_credentials_error(e: &(dyn std::error::Error + 'static)) -> bool {
    use aws_sdk_s3::config::{ProvideCredentials, SharedCredentialsProvider};
    fn error_of<'a, F, T, E>(
        _: fn(&'a SharedCredentialsProvider) -> F,
        e: &(dyn std::error::Error + 'static),
    ) -> bool
    where
        F: std::future::Future<Output = Result<T, E>>,
        E: std::error::Error + 'static,
    {
        e.is::<E>()
    }
    error_of(
        <SharedCredentialsProvider as ProvideCredentials>::provide_credentials,
        e,
    )
}

/// If a request failed before sending because no credentials could be obtained, the cause
/// as one line (the credential error and what it says about its source). Credentials
/// redact themselves in errors; the text is clipped all the same.
fn credentials_failure(d: &aws_sdk_s3::error::ConnectorError) -> Option<String> {
    use std::error::Error;
    let mut cur: Option<&(dyn Error + 'static)> = d.source();
    while let Some(e) = cur {
        // The identity cache's own limit on loading credentials.
        if is_credentials_error(e) || e.to_string().starts_with("identity resolver timed out") {
            let mut parts: Vec<String> = Vec::new();
            let mut next: Option<&(dyn Error + 'static)> = Some(e);
            while let Some(x) = next {
                let text = x.to_string();
                if !text.is_empty() && !parts.iter().any(|p| p.contains(&text)) {
                    parts.push(text);
                }
                next = x.source();
            }
            return Some(clip(&parts.join(": "), 400));
        }
        cur = e.source();
    }
    None
}

/// One error line for a refused or missing identity, at most once a minute per cause: when
/// credentials expire, every file operation fails the same way, and the operator needs the
/// reason once, not a line per `stat`.
fn report_access_problem(cause: &str, line: &str) {
    use std::sync::Mutex;
    use std::time::Instant;
    static LAST: Mutex<Vec<(String, Instant)>> = Mutex::new(Vec::new());
    const EVERY: Duration = Duration::from_secs(60);
    let mut last = LAST.lock().unwrap_or_else(|p| p.into_inner());
    let now = Instant::now();
    match last.iter_mut().find(|(c, _)| c == cause) {
        Some((_, at)) if now.duration_since(*at) < EVERY => return,
        Some((_, at)) => *at = now,
        None => last.push((cause.to_string(), now)),
    }
    drop(last);
    tracing::error!("{line}");
}

fn to_meta(
    size: Option<i64>,
    mtime: Option<&aws_smithy_types::DateTime>,
    etag: Option<&str>,
) -> ObjectMeta {
    ObjectMeta {
        size: size.unwrap_or(0).max(0) as u64,
        mtime: mtime
            .and_then(|t| SystemTime::try_from(*t).ok())
            .unwrap_or(SystemTime::UNIX_EPOCH),
        etag: etag.map(str::to_string),
    }
}

/// `bucket/key` for x-amz-copy-source, percent-encoded except for `/`.
/// The SDK's view of user metadata (it adds and strips the `x-amz-meta-` prefix itself).
fn user_meta(m: Option<&std::collections::HashMap<String, String>>) -> UserMeta {
    m.into_iter()
        .flatten()
        .map(|(k, v)| (k.to_ascii_lowercase(), v.clone()))
        .collect()
}

/// The `x-amz-meta-*` headers of `m`: everything but its Content-Type ([`CONTENT_TYPE`]).
fn sdk_meta(m: &UserMeta) -> Option<std::collections::HashMap<String, String>> {
    let h: std::collections::HashMap<String, String> = m
        .iter()
        .filter(|(k, _)| k.as_str() != CONTENT_TYPE)
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect();
    (!h.is_empty()).then_some(h)
}

/// The Content-Type `m` carries.
fn sdk_content_type(m: &UserMeta) -> Option<String> {
    m.get(CONTENT_TYPE).cloned()
}

fn copy_source(bucket: &str, key: &str) -> String {
    let mut out = String::with_capacity(bucket.len() + key.len() + 1);
    out.push_str(bucket);
    out.push('/');
    for b in key.bytes() {
        match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' | b'/' => {
                out.push(b as char)
            }
            _ => out.push_str(&format!("%{b:02X}")),
        }
    }
    out
}

/// The If-Match / If-None-Match headers of a conditional write.
fn condition_headers(cond: Option<&WriteCondition>) -> (Option<String>, Option<String>) {
    match cond {
        None => (None, None),
        Some(WriteCondition::IfMatch(etag)) => (Some(etag.clone()), None),
        Some(WriteCondition::IfNoneMatch) => (None, Some("*".into())),
    }
}

impl AwsClient {
    /// Ranged GET, of one version of the object when `etag` is given.
    async fn get_version_range(
        &self,
        key: &str,
        etag: Option<&str>,
        start: u64,
        end: u64,
    ) -> S3Result<Bytes> {
        if end <= start {
            return Ok(Bytes::new());
        }
        // The SDK retries a GET until its response headers arrive; the body streams after
        // that, outside its retry loop. A body that breaks off (connection reset) or stalls
        // for longer than the read timeout is resumed here with a GET of the rest.
        let mut buf = bytes::BytesMut::with_capacity((end - start).min(64 << 20) as usize);
        let mut body_failures = 0;
        loop {
            let from = start + buf.len() as u64;
            let out = self
                .client
                .get_object()
                .bucket(&self.bucket)
                .key(key)
                .range(format!("bytes={}-{}", from, end - 1))
                .set_if_match(etag.map(str::to_string))
                .send()
                .await
                .map_err(map_err)?;
            let mut body = out.body;
            let broke = loop {
                match tokio::time::timeout(self.timeouts.read, body.next()).await {
                    Ok(Some(Ok(piece))) => buf.extend_from_slice(&piece),
                    Ok(None) => break None,
                    Ok(Some(Err(e))) => break Some(format!("reading object body: {e}")),
                    Err(_) => {
                        break Some(format!("object body stalled for {:?}", self.timeouts.read))
                    }
                }
            };
            let Some(why) = broke else {
                return Ok(buf.freeze());
            };
            if buf.len() as u64 >= end - start {
                return Ok(buf.freeze());
            }
            body_failures += 1;
            if body_failures > BODY_RETRIES {
                return Err(S3Error::Other(why));
            }
            tracing::debug!(key, got = buf.len(), error = %why, "download broke off; resuming");
            tokio::time::sleep(Duration::from_millis(100 << body_failures)).await;
        }
    }
}

#[async_trait]
impl ObjectClient for AwsClient {
    async fn head_object(&self, key: &str) -> S3Result<ObjectMeta> {
        Ok(self.head_object_with_meta(key).await?.0)
    }

    async fn list(&self, req: ListRequest<'_>) -> S3Result<ListPage> {
        let out = self
            .client
            .list_objects_v2()
            .bucket(&self.bucket)
            .prefix(req.prefix)
            .set_delimiter(req.delimiter.map(str::to_string))
            .set_continuation_token(req.continuation.map(str::to_string))
            .set_start_after(req.start_after.map(str::to_string))
            .max_keys(req.max_keys)
            .send()
            .await
            .map_err(map_err)?;
        Ok(ListPage {
            objects: out
                .contents()
                .iter()
                .filter_map(|o| {
                    Some(ListedObject {
                        key: o.key()?.to_string(),
                        meta: to_meta(o.size(), o.last_modified(), o.e_tag()),
                    })
                })
                .collect(),
            prefixes: out
                .common_prefixes()
                .iter()
                .filter_map(|p| p.prefix().map(str::to_string))
                .collect(),
            next_token: if out.is_truncated().unwrap_or(false) {
                out.next_continuation_token().map(str::to_string)
            } else {
                None
            },
        })
    }

    async fn get_range(&self, key: &str, start: u64, end: u64) -> S3Result<Bytes> {
        self.get_version_range(key, None, start, end).await
    }

    async fn get_range_if_match(
        &self,
        key: &str,
        etag: &str,
        start: u64,
        end: u64,
    ) -> S3Result<Bytes> {
        self.get_version_range(key, Some(etag), start, end).await
    }

    async fn put_object_if(
        &self,
        key: &str,
        body: Bytes,
        cond: Option<&WriteCondition>,
        meta: Option<&UserMeta>,
    ) -> S3Result<ObjectMeta> {
        let size = body.len() as u64;
        let (if_match, if_none_match) = condition_headers(cond);
        let out = self
            .client
            .put_object()
            .bucket(&self.bucket)
            .key(key)
            .set_if_match(if_match)
            .set_if_none_match(if_none_match)
            .set_metadata(meta.and_then(sdk_meta))
            .set_content_type(meta.and_then(sdk_content_type))
            .body(ByteStream::from(body))
            .send()
            .await
            .map_err(map_err)?;
        Ok(ObjectMeta {
            size,
            mtime: SystemTime::now(),
            etag: out.e_tag().map(str::to_string),
        })
    }

    async fn create_multipart(&self, key: &str) -> S3Result<String> {
        self.create_multipart_with_meta(key, &UserMeta::new()).await
    }

    async fn upload_part(
        &self,
        key: &str,
        upload_id: &str,
        part_number: i32,
        body: Bytes,
    ) -> S3Result<CompletedPart> {
        let out = self
            .client
            .upload_part()
            .bucket(&self.bucket)
            .key(key)
            .upload_id(upload_id)
            .part_number(part_number)
            .body(ByteStream::from(body))
            .send()
            .await
            .map_err(map_err)?;
        Ok(CompletedPart {
            part_number,
            etag: out.e_tag().unwrap_or_default().to_string(),
        })
    }

    async fn complete_multipart_if(
        &self,
        key: &str,
        upload_id: &str,
        parts: Vec<CompletedPart>,
        cond: Option<&WriteCondition>,
    ) -> S3Result<ObjectMeta> {
        let (if_match, if_none_match) = condition_headers(cond);
        let parts: Vec<SdkPart> = parts
            .into_iter()
            .map(|p| {
                SdkPart::builder()
                    .part_number(p.part_number)
                    .e_tag(p.etag)
                    .build()
            })
            .collect();
        let part_count = parts.len();
        let result = self
            .client
            .complete_multipart_upload()
            .bucket(&self.bucket)
            .key(key)
            .upload_id(upload_id)
            .set_if_match(if_match)
            .set_if_none_match(if_none_match)
            .multipart_upload(
                CompletedMultipartUpload::builder()
                    .set_parts(Some(parts))
                    .build(),
            )
            .send()
            .await;
        let etag = match result {
            Ok(out) => out.e_tag().map(str::to_string),
            // Some S3-compatible servers (moto among them) answer 200 with a body under
            // another root element, which the SDK cannot parse. A real failure inside a
            // 200 carries an error code; with none, ask S3 whether the object now is
            // the multipart object we completed.
            Err(SdkError::ServiceError(ctx))
                if ctx.raw().status().as_u16() == 200 && ctx.err().code().is_none() =>
            {
                let meta = self.head_object(key).await?;
                let suffix = format!("-{part_count}\"");
                if !meta.etag.as_deref().is_some_and(|e| e.ends_with(&suffix)) {
                    return Err(S3Error::Other(
                        "CompleteMultipartUpload answer unreadable and the object is not the upload".into(),
                    ));
                }
                return Ok(meta);
            }
            // A retried Complete whose first attempt did complete (only the answer was
            // lost) finds the upload gone. If the object now is a multipart object of
            // exactly our part count, that first attempt was ours: report success rather
            // than an EIO for data that is in fact durable.
            Err(e) if e.code() == Some("NoSuchUpload") => {
                let meta = self.head_object(key).await.map_err(|_| map_err(e))?;
                let suffix = format!("-{part_count}\"");
                if !meta.etag.as_deref().is_some_and(|t| t.ends_with(&suffix)) {
                    return Err(S3Error::Other(
                        "CompleteMultipartUpload: the upload is gone and the object is not it"
                            .into(),
                    ));
                }
                tracing::info!(
                    key,
                    "CompleteMultipartUpload answer was lost; the object is complete"
                );
                return Ok(meta);
            }
            Err(e) => return Err(map_err(e)),
        };
        // Reaching here means the object exists. Its size is learnt by HEAD.
        let meta = self.head_object(key).await?;
        Ok(ObjectMeta {
            etag: etag.or(meta.etag),
            ..meta
        })
    }

    async fn abort_multipart(&self, key: &str, upload_id: &str) -> S3Result<()> {
        self.client
            .abort_multipart_upload()
            .bucket(&self.bucket)
            .key(key)
            .upload_id(upload_id)
            .send()
            .await
            .map_err(map_err)?;
        Ok(())
    }

    async fn copy_object_if(
        &self,
        src: &str,
        dst: &str,
        size: u64,
        src_etag: Option<&str>,
        content_type: Option<&str>,
    ) -> S3Result<()> {
        let source = copy_source(&self.bucket, src);
        if size <= MAX_SINGLE_COPY && content_type.is_none() {
            // MetadataDirective=COPY: the user metadata and the Content-Type go along.
            self.client
                .copy_object()
                .bucket(&self.bucket)
                .key(dst)
                .copy_source(&source)
                .set_copy_source_if_match(src_etag.map(str::to_string))
                .send()
                .await
                .map_err(map_err)?;
            return Ok(());
        }
        // A new Content-Type needs MetadataDirective=REPLACE, which replaces the user
        // metadata (POSIX mode, owner, times as s3fs stores them) too; and above 5 GiB S3
        // refuses CopyObject, and a multipart upload takes neither along by itself. Both
        // are read from the source, of the version copied, and given to the copy.
        let (head, mut meta) = self.head_object_with_meta(src).await?;
        if let Some(want) = src_etag {
            if head.etag.as_deref() != Some(want) {
                return Err(S3Error::PreconditionFailed);
            }
        }
        if let Some(t) = content_type {
            meta.insert(CONTENT_TYPE.to_string(), t.to_string());
        }
        if size <= MAX_SINGLE_COPY {
            self.client
                .copy_object()
                .bucket(&self.bucket)
                .key(dst)
                .copy_source(&source)
                .set_copy_source_if_match(src_etag.map(str::to_string))
                .metadata_directive(aws_sdk_s3::types::MetadataDirective::Replace)
                .set_metadata(sdk_meta(&meta))
                .set_content_type(sdk_content_type(&meta))
                .send()
                .await
                .map_err(map_err)?;
            return Ok(());
        }
        // Copied in 512 MiB ranges with UploadPartCopy.
        const COPY_PART: u64 = 512 * 1024 * 1024;
        let upload_id = self.create_multipart_with_meta(dst, &meta).await?;
        let mut parts = Vec::new();
        let mut start = 0;
        let mut number = 1;
        while start < size {
            let end = (start + COPY_PART).min(size);
            let res = self
                .upload_part_copy(dst, &upload_id, number, src, src_etag, start, end)
                .await;
            match res {
                Ok(part) => parts.push(part),
                Err(e) => {
                    let _ = self.abort_multipart(dst, &upload_id).await;
                    return Err(e);
                }
            }
            start = end;
            number += 1;
        }
        if let Err(e) = self.complete_multipart(dst, &upload_id, parts).await {
            let _ = self.abort_multipart(dst, &upload_id).await;
            return Err(e);
        }
        Ok(())
    }

    async fn head_object_with_meta(&self, key: &str) -> S3Result<(ObjectMeta, UserMeta)> {
        let out = self
            .client
            .head_object()
            .bucket(&self.bucket)
            .key(key)
            .send()
            .await
            .map_err(map_err)?;
        let meta = to_meta(out.content_length(), out.last_modified(), out.e_tag());
        let mut headers = user_meta(out.metadata());
        if let Some(t) = out.content_type() {
            headers.insert(CONTENT_TYPE.to_string(), t.to_string());
        }
        Ok((meta, headers))
    }

    async fn create_multipart_with_meta(&self, key: &str, meta: &UserMeta) -> S3Result<String> {
        let out = self
            .client
            .create_multipart_upload()
            .bucket(&self.bucket)
            .key(key)
            .set_metadata(sdk_meta(meta))
            .set_content_type(sdk_content_type(meta))
            .send()
            .await
            .map_err(map_err)?;
        out.upload_id()
            .map(str::to_string)
            .ok_or_else(|| S3Error::Other("CreateMultipartUpload returned no upload id".into()))
    }

    async fn replace_metadata(
        &self,
        key: &str,
        etag: &str,
        size: u64,
        meta: &UserMeta,
    ) -> S3Result<ObjectMeta> {
        if size <= MAX_SINGLE_COPY {
            let out = self
                .client
                .copy_object()
                .bucket(&self.bucket)
                .key(key)
                .copy_source(copy_source(&self.bucket, key))
                .copy_source_if_match(etag)
                .metadata_directive(aws_sdk_s3::types::MetadataDirective::Replace)
                .set_metadata(sdk_meta(meta))
                .set_content_type(sdk_content_type(meta))
                .send()
                .await
                .map_err(map_err)?;
            let r = out.copy_object_result();
            return Ok(ObjectMeta {
                size,
                mtime: r
                    .and_then(|r| r.last_modified())
                    .and_then(|t| SystemTime::try_from(*t).ok())
                    .unwrap_or_else(SystemTime::now),
                etag: r.and_then(|r| r.e_tag()).map(str::to_string),
            });
        }
        super::replace_metadata_by_parts(self, key, etag, size, meta).await
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
        let out = self
            .client
            .upload_part_copy()
            .bucket(&self.bucket)
            .key(key)
            .upload_id(upload_id)
            .part_number(part_number)
            .copy_source(copy_source(&self.bucket, src))
            .copy_source_range(format!("bytes={}-{}", start, end - 1))
            .set_copy_source_if_match(src_etag.map(str::to_string))
            .send()
            .await
            .map_err(map_err)?;
        Ok(CompletedPart {
            part_number,
            etag: out
                .copy_part_result()
                .and_then(|r| r.e_tag())
                .unwrap_or_default()
                .to_string(),
        })
    }

    async fn delete_object(&self, key: &str) -> S3Result<()> {
        self.client
            .delete_object()
            .bucket(&self.bucket)
            .key(key)
            .send()
            .await
            .map_err(map_err)?;
        Ok(())
    }

    async fn delete_objects(&self, keys: Vec<String>) -> S3Result<usize> {
        use aws_sdk_s3::types::{Delete, ObjectIdentifier};
        let mut deleted = 0;
        for chunk in keys.chunks(1000) {
            let ids: Vec<ObjectIdentifier> = chunk
                .iter()
                .filter_map(|k| ObjectIdentifier::builder().key(k).build().ok())
                .collect();
            let delete = Delete::builder()
                .set_objects(Some(ids))
                .quiet(true)
                .build()
                .map_err(|e| S3Error::Other(e.to_string()))?;
            let out = self
                .client
                .delete_objects()
                .bucket(&self.bucket)
                .delete(delete)
                .send()
                .await
                .map_err(map_err)?;
            if let Some(e) = out.errors().first() {
                return Err(S3Error::Other(format!(
                    "DeleteObjects failed for {:?}: {}",
                    e.key().unwrap_or(""),
                    e.code().unwrap_or("error")
                )));
            }
            deleted += chunk.len();
        }
        Ok(deleted)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    #[test]
    fn copy_source_encodes_everything_but_slash() {
        assert_eq!(copy_source("b", "a b/c+d"), "b/a%20b/c%2Bd");
    }
}
