//! Prometheus metrics of the CSI services: `s3csi csi --metrics-address HOST:PORT` serves
//! `GET /metrics` in the text exposition format 0.0.4 over plain HTTP (any other path is 404).
//! The metrics are prometheus-client's, encoded by its 0.0.4 text encoder.
//!
//! - `s3csi_build_info{version}` — always 1;
//! - `s3csi_grpc_requests_total{method,code}` — CSI calls served, by RPC name and gRPC status
//!   code as grpc-go spells it (`OK`, `InvalidArgument`, ...), counted by [`Metered`] around
//!   every service;
//! - `s3csi_grpc_request_duration_seconds{method}` — a histogram of the time spent in those
//!   calls (prometheus-client has no summary; `_sum` and `_count` are what they were);
//! - values read when scraped ([`Registry::gauge`], [`Registry::counter`]): the node service
//!   registers `s3csi_mounts` and `s3csi_mounter_replacements_total`;
//! - the node service's mounters' own metrics, by volume ([`Registry::scrape_mounters`],
//!   [`mounters`]).
//!
//! Nothing is global: [`crate::csi::serve`] makes one [`Registry`] per run.

pub mod mounters;

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{
    prometheus_text, DescriptorEncoder, EncodeLabelSet, EncodeMetric,
};
use prometheus_client::metrics::counter::{ConstCounter, Counter};
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::{ConstGauge, Gauge};
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::metrics::MetricType;
use std::convert::Infallible;
use std::future::Future;
use std::net::{Ipv4Addr, Ipv6Addr, SocketAddr};
use std::path::PathBuf;
use std::pin::Pin;
use std::str::FromStr;
use std::sync::{Arc, Mutex, OnceLock};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};
use tonic::codegen::{http, Service};

/// The `Content-Type` of the text exposition format.
pub const CONTENT_TYPE: &str = prometheus_text::CONTENT_TYPE;

/// Where to serve metrics: `IP:PORT`, `[IPv6]:PORT`, or `:PORT` for every interface.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MetricsAddress {
    /// `:PORT`: every interface, IPv6 and IPv4 when the host has IPv6, else IPv4 only.
    Any(u16),
    Ip(SocketAddr),
}

/// A `--metrics-address` that is not one.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "{0:?} is not HOST:PORT with an IP address \
     (e.g. 0.0.0.0:9809, 127.0.0.1:9809, [::]:9809, or :9809 for every interface)"
)]
pub struct BadMetricsAddress(String);

/// The metrics port cannot be opened.
#[derive(Debug, thiserror::Error)]
#[error("--metrics-address {address}: cannot listen: {source}")]
pub struct MetricsListenError {
    address: MetricsAddress,
    source: std::io::Error,
}

impl FromStr for MetricsAddress {
    type Err = BadMetricsAddress;

    fn from_str(s: &str) -> Result<Self, BadMetricsAddress> {
        let bad = || BadMetricsAddress(s.to_string());
        match s.strip_prefix(':') {
            Some(port) => port.parse().map(Self::Any).map_err(|_| bad()),
            None => s.parse().map(Self::Ip).map_err(|_| bad()),
        }
    }
}

impl std::fmt::Display for MetricsAddress {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Any(port) => write!(f, ":{port}"),
            Self::Ip(addr) => write!(f, "{addr}"),
        }
    }
}

impl MetricsAddress {
    /// Opens the listening socket (so that a port in use fails at startup).
    pub async fn bind(self) -> Result<tokio::net::TcpListener, MetricsListenError> {
        use tokio::net::TcpListener;
        let result = match self {
            Self::Ip(addr) => TcpListener::bind(addr).await,
            Self::Any(port) => match TcpListener::bind((Ipv6Addr::UNSPECIFIED, port)).await {
                Ok(l) => Ok(l),
                // A host without IPv6.
                Err(e) if e.kind() != std::io::ErrorKind::AddrInUse => {
                    TcpListener::bind((Ipv4Addr::UNSPECIFIED, port)).await
                }
                Err(e) => Err(e),
            },
        };
        result.map_err(|source| MetricsListenError {
            address: self,
            source,
        })
    }
}

/// The labels of `s3csi_grpc_requests_total`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct CallLabels {
    method: String,
    code: &'static str,
}

/// The labels of `s3csi_grpc_request_duration_seconds`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct MethodLabels {
    method: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct VersionLabels {
    version: &'static str,
}

/// Bucket bounds of the gRPC latency histogram: a Probe takes microseconds, a publish
/// waits for a mounter and S3 (up to the mount timeout).
const GRPC_SECONDS_BUCKETS: [f64; 13] = [
    0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
];

fn grpc_histogram() -> Histogram {
    Histogram::new(GRPC_SECONDS_BUCKETS)
}

/// A value read when scraped, as a gauge or a counter: a prometheus-client collector.
pub struct Sampled {
    name: &'static str,
    help: &'static str,
    metric_type: MetricType,
    read: Box<dyn Fn() -> u64 + Send + Sync>,
}

impl std::fmt::Debug for Sampled {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Sampled").field("name", &self.name).finish()
    }
}

impl Sampled {
    /// A gauge whose value `read` returns at every scrape.
    pub fn gauge(
        name: &'static str,
        help: &'static str,
        read: impl Fn() -> u64 + Send + Sync + 'static,
    ) -> Self {
        Self {
            name,
            help,
            metric_type: MetricType::Gauge,
            read: Box::new(read),
        }
    }

    /// A counter that `read` returns at every scrape; `name` without the `_total` that the
    /// encoder appends.
    pub fn counter(
        name: &'static str,
        help: &'static str,
        read: impl Fn() -> u64 + Send + Sync + 'static,
    ) -> Self {
        Self {
            name,
            help,
            metric_type: MetricType::Counter,
            read: Box::new(read),
        }
    }
}

impl Collector for Sampled {
    fn encode(&self, mut encoder: DescriptorEncoder) -> std::fmt::Result {
        let value = (self.read)();
        let metric = encoder.encode_descriptor(self.name, self.help, None, self.metric_type)?;
        match self.metric_type {
            MetricType::Counter => ConstCounter::new(value).encode(metric),
            _ => ConstGauge::new(value as i64).encode(metric),
        }
    }
}

/// The metrics of one run of the CSI services: a prometheus-client registry, plus the
/// mounters of the node service when [`Registry::scrape_mounters`] was called.
pub struct Registry {
    /// Locked to register (the node service adds its gauges after the start) and to encode.
    families: Mutex<prometheus_client::registry::Registry>,
    calls: Family<CallLabels, Counter>,
    call_seconds: Family<MethodLabels, Histogram, fn() -> Histogram>,
    mounters: OnceLock<mounters::MounterScraper>,
}

impl Registry {
    pub fn new() -> Arc<Self> {
        let mut families = prometheus_client::registry::Registry::default();
        let build_info = Family::<VersionLabels, Gauge>::default();
        build_info
            .get_or_create(&VersionLabels {
                version: env!("CARGO_PKG_VERSION"),
            })
            .set(1);
        // prometheus-client appends the final period of every help text.
        families.register(
            "s3csi_build_info",
            "Version of the s3csi binary (the value is always 1)",
            build_info,
        );
        let calls = Family::<CallLabels, Counter>::default();
        // Registered without `_total`: the encoder appends it to every counter.
        families.register(
            "s3csi_grpc_requests",
            "CSI gRPC calls served, by method and gRPC status code",
            calls.clone(),
        );
        let call_seconds: Family<MethodLabels, Histogram, fn() -> Histogram> =
            Family::new_with_constructor(grpc_histogram);
        families.register(
            "s3csi_grpc_request_duration_seconds",
            "Time spent serving CSI gRPC calls, by method",
            call_seconds.clone(),
        );
        Arc::new(Self {
            families: Mutex::new(families),
            calls,
            call_seconds,
            mounters: OnceLock::new(),
        })
    }

    /// Counts one finished gRPC call.
    pub fn observe_call(&self, method: &str, code: tonic::Code, elapsed: Duration) {
        self.calls
            .get_or_create(&CallLabels {
                method: method.to_string(),
                code: code_name(code),
            })
            .inc();
        self.call_seconds
            .get_or_create(&MethodLabels {
                method: method.to_string(),
            })
            .observe(elapsed.as_secs_f64());
    }

    /// A gauge whose value `read` returns at every scrape.
    pub fn gauge(
        &self,
        name: &'static str,
        help: &'static str,
        read: impl Fn() -> u64 + Send + Sync + 'static,
    ) {
        self.register_collector(Sampled::gauge(name, help, read));
    }

    /// A counter (a value that only grows) that `read` returns at every scrape; `name`
    /// without the `_total` that the encoder appends.
    pub fn counter(
        &self,
        name: &'static str,
        help: &'static str,
        read: impl Fn() -> u64 + Send + Sync + 'static,
    ) {
        self.register_collector(Sampled::counter(name, help, read));
    }

    fn register_collector(&self, collector: Sampled) {
        self.families
            .lock()
            .unwrap()
            .register_collector(Box::new(collector));
    }

    /// Adds the metrics of the node's mounters to every scrape: `list` names the mounts
    /// (volume ID, handoff directory) at scrape time. Once per registry.
    pub fn scrape_mounters(
        &self,
        list: impl Fn() -> Vec<(String, PathBuf)> + Send + Sync + 'static,
    ) {
        let scraper = mounters::MounterScraper::new(Box::new(list));
        self.families.lock().unwrap().register(
            "s3csi_mounter_scrape_errors",
            "Mounters that did not answer a scrape in time (their metrics were left out)",
            scraper.errors.clone(),
        );
        if self.mounters.set(scraper).is_err() {
            tracing::warn!("metrics: mounters registered twice; keeping the first");
        }
    }

    /// Every metric in the text exposition format 0.0.4: ours, then the mounters'.
    pub async fn render(&self) -> String {
        // The mounters first: a scrape that fails is counted in this very exposition.
        let mounter_text = match self.mounters.get() {
            Some(scraper) => Some(scraper.collect().await),
            None => None,
        };
        let mut out = String::new();
        let families = self.families.lock().unwrap();
        // Writing to a String cannot fail; a collector that could would be a bug.
        if let Err(e) = prometheus_text::encode(&mut out, &families) {
            tracing::error!(error = %e, "metrics: cannot encode");
        }
        drop(families);
        if let Some(merged) = mounter_text {
            merged.append_to(&mut out);
        }
        out
    }
}

/// The name gRPC gives a status code (as grpc-go spells it: `OK`, `Canceled`, ...).
fn code_name(code: tonic::Code) -> &'static str {
    use tonic::Code::*;
    match code {
        Ok => "OK",
        Cancelled => "Canceled",
        Unknown => "Unknown",
        InvalidArgument => "InvalidArgument",
        DeadlineExceeded => "DeadlineExceeded",
        NotFound => "NotFound",
        AlreadyExists => "AlreadyExists",
        PermissionDenied => "PermissionDenied",
        ResourceExhausted => "ResourceExhausted",
        FailedPrecondition => "FailedPrecondition",
        Aborted => "Aborted",
        OutOfRange => "OutOfRange",
        Unimplemented => "Unimplemented",
        Internal => "Internal",
        Unavailable => "Unavailable",
        DataLoss => "DataLoss",
        Unauthenticated => "Unauthenticated",
    }
}

/// The RPC name of a gRPC path (`/csi.v1.Node/NodePublishVolume` → `NodePublishVolume`);
/// anything odd becomes `unknown`, so that clients cannot invent label values.
fn method_of(path: &str) -> &str {
    let name = path.rsplit('/').next().unwrap_or_default();
    if !name.is_empty() && name.len() <= 64 && name.bytes().all(|b| b.is_ascii_alphanumeric()) {
        name
    } else {
        "unknown"
    }
}

/// A tonic service that counts its calls in a [`Registry`].
///
/// The status code is read from the response headers: a unary call that fails is answered
/// "trailers-only", with `grpc-status` in the headers; a call that succeeds sends its message
/// and then `grpc-status: 0` in the trailers, so no `grpc-status` header means OK. (Every CSI
/// RPC is unary.)
#[derive(Clone)]
pub struct Metered<S> {
    inner: S,
    registry: Arc<Registry>,
}

impl<S> Metered<S> {
    pub fn new(inner: S, registry: Arc<Registry>) -> Self {
        Self { inner, registry }
    }
}

impl<S: tonic::server::NamedService> tonic::server::NamedService for Metered<S> {
    const NAME: &'static str = S::NAME;
}

impl<S, B, R> Service<http::Request<B>> for Metered<S>
where
    S: Service<http::Request<B>, Response = http::Response<R>, Error = Infallible>,
    S::Future: Send + 'static,
{
    type Response = http::Response<R>;
    type Error = Infallible;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, Infallible>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: http::Request<B>) -> Self::Future {
        let method = method_of(req.uri().path()).to_string();
        let registry = self.registry.clone();
        let start = Instant::now();
        let response = self.inner.call(req);
        Box::pin(async move {
            let response = response.await?;
            let code = response
                .headers()
                .get("grpc-status")
                .and_then(|v| v.to_str().ok()?.parse::<i32>().ok())
                .map_or(tonic::Code::Ok, tonic::Code::from);
            registry.observe_call(&method, code, start.elapsed());
            Ok(response)
        })
    }
}

/// Serves `GET /metrics` on `listener` until the returned task is aborted (which also ends
/// every open connection).
pub fn serve(
    listener: tokio::net::TcpListener,
    registry: Arc<Registry>,
) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        let mut conns = tokio::task::JoinSet::new();
        loop {
            tokio::select! {
                accepted = listener.accept() => match accepted {
                    Ok((stream, _)) => {
                        let registry = registry.clone();
                        conns.spawn(async move {
                            let svc = hyper::service::service_fn(move |req| {
                                let registry = registry.clone();
                                async move { Ok::<_, Infallible>(respond(&req, &registry).await) }
                            });
                            let _ = hyper::server::conn::http1::Builder::new()
                                .timer(hyper_util::rt::TokioTimer::new())
                                .header_read_timeout(Duration::from_secs(10))
                                .serve_connection(hyper_util::rt::TokioIo::new(stream), svc)
                                .await;
                        });
                    }
                    Err(e) => {
                        tracing::warn!(error = %e, "metrics: accept failed");
                        tokio::time::sleep(Duration::from_millis(50)).await;
                    }
                },
                Some(_) = conns.join_next(), if !conns.is_empty() => {}
            }
        }
    })
}

async fn respond<B>(req: &http::Request<B>, registry: &Registry) -> http::Response<String> {
    use http::{header, Method, StatusCode};
    let reply = |status: StatusCode, body: String| {
        let mut r = http::Response::new(body);
        *r.status_mut() = status;
        r
    };
    if req.uri().path() != "/metrics" {
        return reply(
            StatusCode::NOT_FOUND,
            "not found: metrics are at /metrics\n".into(),
        );
    }
    if req.method() != Method::GET && req.method() != Method::HEAD {
        let mut r = reply(StatusCode::METHOD_NOT_ALLOWED, "use GET\n".into());
        r.headers_mut()
            .insert(header::ALLOW, http::HeaderValue::from_static("GET, HEAD"));
        return r;
    }
    let mut r = reply(StatusCode::OK, registry.render().await);
    r.headers_mut().insert(
        header::CONTENT_TYPE,
        http::HeaderValue::from_static(CONTENT_TYPE),
    );
    r
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn addresses() {
        assert_eq!(":9809".parse(), Ok(MetricsAddress::Any(9809)));
        assert_eq!(
            "127.0.0.1:9809".parse(),
            Ok(MetricsAddress::Ip("127.0.0.1:9809".parse().unwrap()))
        );
        assert_eq!(
            "[::1]:1".parse(),
            Ok(MetricsAddress::Ip("[::1]:1".parse().unwrap()))
        );
        for bad in [
            "",
            "9809",
            ":",
            ":70000",
            "localhost:9809",
            "0.0.0.0",
            "1.2.3.4:x",
        ] {
            let err = bad.parse::<MetricsAddress>().unwrap_err().to_string();
            assert!(err.contains("HOST:PORT"), "{bad}: {err}");
        }
    }

    #[test]
    fn methods() {
        assert_eq!(
            method_of("/csi.v1.Node/NodePublishVolume"),
            "NodePublishVolume"
        );
        assert_eq!(method_of("/csi.v1.Node/"), "unknown");
        assert_eq!(method_of("/csi.v1.Node/a\"b"), "unknown");
    }

    #[tokio::test]
    async fn text_format() {
        let r = Registry::new();
        r.observe_call("Probe", tonic::Code::Ok, Duration::from_millis(2));
        r.observe_call("Probe", tonic::Code::Ok, Duration::from_millis(1));
        r.observe_call(
            "NodePublishVolume",
            tonic::Code::InvalidArgument,
            Duration::from_millis(1),
        );
        let n = Arc::new(std::sync::atomic::AtomicU64::new(3));
        let n2 = n.clone();
        r.gauge("s3csi_mounts", "Mounts.", move || {
            n2.load(std::sync::atomic::Ordering::Relaxed)
        });
        r.counter("s3csi_mounter_replacements", "Replacements.", || 7);
        let text = r.render().await;
        assert!(text.contains("s3csi_grpc_requests_total{method=\"Probe\",code=\"OK\"} 2\n"));
        assert!(text.contains(
            "s3csi_grpc_requests_total{method=\"NodePublishVolume\",code=\"InvalidArgument\"} 1\n"
        ));
        assert!(text.contains("# TYPE s3csi_grpc_requests_total counter\n"));
        assert!(text.contains("# TYPE s3csi_grpc_request_duration_seconds histogram\n"));
        assert!(text.contains("s3csi_grpc_request_duration_seconds_count{method=\"Probe\"} 2\n"));
        assert!(text.contains(
            "s3csi_grpc_request_duration_seconds_bucket{method=\"Probe\",le=\"0.005\"} 2\n"
        ));
        assert!(text.contains("# TYPE s3csi_mounts gauge\ns3csi_mounts 3\n"));
        assert!(text.contains(
            "# TYPE s3csi_mounter_replacements_total counter\ns3csi_mounter_replacements_total 7\n"
        ));
        assert!(!text.contains("# EOF"), "{text}");
        n.store(5, std::sync::atomic::Ordering::Relaxed);
        assert!(r.render().await.contains("s3csi_mounts 5\n"));
        assert!(text.contains(&format!(
            "# TYPE s3csi_build_info gauge\ns3csi_build_info{{version=\"{}\"}} 1\n",
            env!("CARGO_PKG_VERSION")
        )));
    }
}
