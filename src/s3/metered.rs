//! [`MeteredClient`]: any [`ObjectClient`], counted. A mounter wraps its S3 client in one so
//! that its metrics (`s3csi_s3_*`, answered on the control socket) say what the file system
//! asked of S3, how long it took and how many bytes moved. One trait call is one request
//! here, named after the S3 API call it stands for (a large `CopyObject` is several requests
//! on the wire, counted as one).

use super::{
    CompletedPart, ListPage, ListRequest, ObjectClient, ObjectMeta, S3Error, S3Result, UserMeta,
    WriteCondition,
};
use async_trait::async_trait;
use bytes::Bytes;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::Registry;
use std::future::Future;
use std::sync::Arc;
use std::time::Instant;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct RequestLabels {
    operation: &'static str,
    outcome: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct OperationLabels {
    operation: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct DirectionLabels {
    direction: &'static str,
}

/// 1 ms to 33 s, doubling: a cached HEAD on a LAN to a large part over a slow link.
fn s3_histogram() -> Histogram {
    Histogram::new(exponential_buckets(0.001, 2.0, 16))
}

/// The S3 metrics of one mounter.
#[derive(Debug)]
pub struct S3Metrics {
    requests: Family<RequestLabels, Counter>,
    seconds: Family<OperationLabels, Histogram, fn() -> Histogram>,
    bytes: Family<DirectionLabels, Counter>,
}

impl Default for S3Metrics {
    fn default() -> Self {
        Self {
            requests: Family::default(),
            seconds: Family::new_with_constructor(s3_histogram),
            bytes: Family::default(),
        }
    }
}

impl S3Metrics {
    /// Adds the families to `registry` (names without the `_total` of counters: the encoder
    /// appends it).
    pub fn register(&self, registry: &mut Registry) {
        registry.register(
            "s3csi_s3_requests",
            "S3 requests, by operation and outcome",
            self.requests.clone(),
        );
        registry.register(
            "s3csi_s3_request_duration_seconds",
            "Time S3 requests took, by operation",
            self.seconds.clone(),
        );
        registry.register(
            "s3csi_s3_bytes",
            "Object bytes received from S3 (read) and sent to it (written)",
            self.bytes.clone(),
        );
    }

    fn observe(&self, operation: &'static str, error: Option<&S3Error>, elapsed: f64) {
        self.requests
            .get_or_create(&RequestLabels {
                operation,
                outcome: outcome(error),
            })
            .inc();
        self.seconds
            .get_or_create(&OperationLabels { operation })
            .observe(elapsed);
    }

    fn add_bytes(&self, direction: &'static str, n: usize) {
        self.bytes
            .get_or_create(&DirectionLabels { direction })
            .inc_by(n as u64);
    }
}

/// The `outcome` label: `ok`, or what kind of failure.
fn outcome(error: Option<&S3Error>) -> &'static str {
    match error {
        None => "ok",
        Some(S3Error::NotFound) => "not_found",
        Some(S3Error::NoSuchBucket) => "no_such_bucket",
        Some(S3Error::AccessDenied(_)) => "access_denied",
        Some(S3Error::PreconditionFailed) => "precondition_failed",
        Some(S3Error::Unreachable(_)) => "unreachable",
        Some(S3Error::Timeout) => "timeout",
        Some(S3Error::NotImplemented(_)) => "not_implemented",
        Some(S3Error::Other(_)) => "error",
    }
}

const READ: &str = "read";
const WRITTEN: &str = "written";

/// An [`ObjectClient`] that counts every request in [`S3Metrics`].
pub struct MeteredClient {
    inner: Arc<dyn ObjectClient>,
    metrics: Arc<S3Metrics>,
}

impl MeteredClient {
    pub fn new(inner: Arc<dyn ObjectClient>, metrics: Arc<S3Metrics>) -> Self {
        Self { inner, metrics }
    }

    async fn timed<T>(
        &self,
        operation: &'static str,
        request: impl Future<Output = S3Result<T>>,
    ) -> S3Result<T> {
        let start = Instant::now();
        let result = request.await;
        self.metrics.observe(
            operation,
            result.as_ref().err(),
            start.elapsed().as_secs_f64(),
        );
        result
    }

    /// Counts `body` as sent once the request that carried it succeeded.
    fn written<T>(&self, result: S3Result<T>, body: usize) -> S3Result<T> {
        if result.is_ok() {
            self.metrics.add_bytes(WRITTEN, body);
        }
        result
    }

    fn read(&self, result: S3Result<Bytes>) -> S3Result<Bytes> {
        if let Ok(bytes) = &result {
            self.metrics.add_bytes(READ, bytes.len());
        }
        result
    }
}

#[async_trait]
impl ObjectClient for MeteredClient {
    async fn head_object(&self, key: &str) -> S3Result<ObjectMeta> {
        self.timed("HeadObject", self.inner.head_object(key)).await
    }

    async fn list(&self, req: ListRequest<'_>) -> S3Result<ListPage> {
        self.timed("ListObjectsV2", self.inner.list(req)).await
    }

    async fn get_range(&self, key: &str, start: u64, end: u64) -> S3Result<Bytes> {
        let result = self
            .timed("GetObject", self.inner.get_range(key, start, end))
            .await;
        self.read(result)
    }

    async fn get_range_if_match(
        &self,
        key: &str,
        etag: &str,
        start: u64,
        end: u64,
    ) -> S3Result<Bytes> {
        let result = self
            .timed(
                "GetObject",
                self.inner.get_range_if_match(key, etag, start, end),
            )
            .await;
        self.read(result)
    }

    async fn put_object_if(
        &self,
        key: &str,
        body: Bytes,
        cond: Option<&WriteCondition>,
        meta: Option<&UserMeta>,
    ) -> S3Result<ObjectMeta> {
        let len = body.len();
        let result = self
            .timed("PutObject", self.inner.put_object_if(key, body, cond, meta))
            .await;
        self.written(result, len)
    }

    async fn create_multipart(&self, key: &str) -> S3Result<String> {
        self.timed("CreateMultipartUpload", self.inner.create_multipart(key))
            .await
    }

    async fn upload_part(
        &self,
        key: &str,
        upload_id: &str,
        part_number: i32,
        body: Bytes,
    ) -> S3Result<CompletedPart> {
        let len = body.len();
        let result = self
            .timed(
                "UploadPart",
                self.inner.upload_part(key, upload_id, part_number, body),
            )
            .await;
        self.written(result, len)
    }

    async fn complete_multipart_if(
        &self,
        key: &str,
        upload_id: &str,
        parts: Vec<CompletedPart>,
        cond: Option<&WriteCondition>,
    ) -> S3Result<ObjectMeta> {
        self.timed(
            "CompleteMultipartUpload",
            self.inner
                .complete_multipart_if(key, upload_id, parts, cond),
        )
        .await
    }

    async fn abort_multipart(&self, key: &str, upload_id: &str) -> S3Result<()> {
        self.timed(
            "AbortMultipartUpload",
            self.inner.abort_multipart(key, upload_id),
        )
        .await
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
        self.timed(
            "UploadPartCopy",
            self.inner
                .upload_part_copy(key, upload_id, part_number, src, src_etag, start, end),
        )
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
        self.timed(
            "CopyObject",
            self.inner
                .copy_object_if(src, dst, size, src_etag, content_type),
        )
        .await
    }

    async fn delete_object(&self, key: &str) -> S3Result<()> {
        self.timed("DeleteObject", self.inner.delete_object(key))
            .await
    }

    async fn head_object_with_meta(&self, key: &str) -> S3Result<(ObjectMeta, UserMeta)> {
        self.timed("HeadObject", self.inner.head_object_with_meta(key))
            .await
    }

    async fn create_multipart_with_meta(&self, key: &str, meta: &UserMeta) -> S3Result<String> {
        self.timed(
            "CreateMultipartUpload",
            self.inner.create_multipart_with_meta(key, meta),
        )
        .await
    }

    async fn replace_metadata(
        &self,
        key: &str,
        etag: &str,
        size: u64,
        meta: &UserMeta,
    ) -> S3Result<ObjectMeta> {
        self.timed(
            "CopyObject",
            self.inner.replace_metadata(key, etag, size, meta),
        )
        .await
    }

    async fn delete_objects(&self, keys: Vec<String>) -> S3Result<usize> {
        self.timed("DeleteObjects", self.inner.delete_objects(keys))
            .await
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::s3::mem::MemClient;
    use prometheus_client::encoding::prometheus_text;

    fn exposition(metrics: &S3Metrics) -> String {
        let mut registry = Registry::default();
        metrics.register(&mut registry);
        let mut text = String::new();
        prometheus_text::encode(&mut text, &registry).unwrap();
        text
    }

    #[tokio::test]
    async fn requests_outcomes_and_bytes_are_counted() {
        let metrics = Arc::new(S3Metrics::default());
        let client = MeteredClient::new(Arc::new(MemClient::new()), metrics.clone());
        client
            .put_object("a", Bytes::from_static(b"hello world"))
            .await
            .unwrap();
        assert_eq!(client.get_range("a", 0, 5).await.unwrap(), "hello");
        assert_eq!(client.head_object("missing").await, Err(S3Error::NotFound));
        // A failed read moves no bytes.
        assert!(client.get_range("missing", 0, 5).await.is_err());
        let text = exposition(&metrics);
        for line in [
            "s3csi_s3_requests_total{operation=\"PutObject\",outcome=\"ok\"} 1\n",
            "s3csi_s3_requests_total{operation=\"GetObject\",outcome=\"ok\"} 1\n",
            "s3csi_s3_requests_total{operation=\"HeadObject\",outcome=\"not_found\"} 1\n",
            "s3csi_s3_requests_total{operation=\"GetObject\",outcome=\"not_found\"} 1\n",
            "s3csi_s3_request_duration_seconds_count{operation=\"GetObject\"} 2\n",
            "s3csi_s3_request_duration_seconds_bucket{operation=\"PutObject\",le=\"+Inf\"} 1\n",
            "s3csi_s3_bytes_total{direction=\"written\"} 11\n",
            "s3csi_s3_bytes_total{direction=\"read\"} 5\n",
            "# TYPE s3csi_s3_requests_total counter\n",
            "# TYPE s3csi_s3_request_duration_seconds histogram\n",
        ] {
            assert!(text.contains(line), "no {line:?} in\n{text}");
        }
    }
}
