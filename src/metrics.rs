//! Prometheus metrics of the CSI services: `s3csi csi --metrics-address HOST:PORT` serves
//! `GET /metrics` in the text exposition format 0.0.4 over plain HTTP (any other path is 404).
//!
//! - `s3csi_build_info{version}` — always 1;
//! - `s3csi_grpc_requests_total{method,code}` — CSI calls served, by RPC name and gRPC status
//!   code as grpc-go spells it (`OK`, `InvalidArgument`, ...), counted by [`Metered`] around
//!   every service;
//! - `s3csi_grpc_request_duration_seconds{method}` — a summary (sum and count) of the time
//!   spent in those calls;
//! - values read when scraped ([`Registry::gauge`], [`Registry::counter`]): the node service
//!   registers `s3csi_mounts` and `s3csi_mounter_replacements_total`.
//!
//! Nothing is global: [`crate::csi::serve`] makes one [`Registry`] per run.

use std::collections::BTreeMap;
use std::convert::Infallible;
use std::fmt::Write as _;
use std::future::Future;
use std::net::{Ipv4Addr, Ipv6Addr, SocketAddr};
use std::pin::Pin;
use std::str::FromStr;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};
use tonic::codegen::{http, Service};

/// The `Content-Type` of the text exposition format.
pub const CONTENT_TYPE: &str = "text/plain; version=0.0.4; charset=utf-8";

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

#[derive(Default, Clone, Copy)]
struct Calls {
    count: u64,
    seconds: f64,
}

type Read = Box<dyn Fn() -> f64 + Send + Sync>;

struct Sampled {
    name: &'static str,
    help: &'static str,
    kind: &'static str,
    read: Read,
}

/// The metrics of one run of the CSI services.
#[derive(Default)]
pub struct Registry {
    /// (method, code) → calls.
    calls: Mutex<BTreeMap<(String, String), Calls>>,
    sampled: Mutex<Vec<Sampled>>,
}

impl Registry {
    pub fn new() -> Arc<Self> {
        Arc::default()
    }

    /// Counts one finished gRPC call.
    pub fn observe_call(&self, method: &str, code: tonic::Code, elapsed: Duration) {
        let mut calls = self.calls.lock().unwrap();
        let c = calls
            .entry((method.to_string(), code_name(code).to_string()))
            .or_default();
        c.count += 1;
        c.seconds += elapsed.as_secs_f64();
    }

    /// A gauge whose value `read` returns at every scrape.
    pub fn gauge(
        &self,
        name: &'static str,
        help: &'static str,
        read: impl Fn() -> f64 + Send + Sync + 'static,
    ) {
        self.sample(name, help, "gauge", Box::new(read));
    }

    /// A counter (a value that only grows) that `read` returns at every scrape.
    pub fn counter(
        &self,
        name: &'static str,
        help: &'static str,
        read: impl Fn() -> f64 + Send + Sync + 'static,
    ) {
        self.sample(name, help, "counter", Box::new(read));
    }

    fn sample(&self, name: &'static str, help: &'static str, kind: &'static str, read: Read) {
        self.sampled.lock().unwrap().push(Sampled {
            name,
            help,
            kind,
            read,
        });
    }

    /// Every metric in the text exposition format.
    pub fn render(&self) -> String {
        let mut out = String::new();
        header(
            &mut out,
            "s3csi_build_info",
            "gauge",
            "Version of the s3csi binary (the value is always 1).",
        );
        let _ = writeln!(
            out,
            "s3csi_build_info{{version=\"{}\"}} 1",
            escape(env!("CARGO_PKG_VERSION"))
        );

        let calls = self.calls.lock().unwrap().clone();
        header(
            &mut out,
            "s3csi_grpc_requests_total",
            "counter",
            "CSI gRPC calls served, by method and gRPC status code.",
        );
        let mut by_method: BTreeMap<&str, Calls> = BTreeMap::new();
        for ((method, code), c) in &calls {
            let _ = writeln!(
                out,
                "s3csi_grpc_requests_total{{method=\"{}\",code=\"{}\"}} {}",
                escape(method),
                escape(code),
                c.count
            );
            let m = by_method.entry(method).or_default();
            m.count += c.count;
            m.seconds += c.seconds;
        }
        header(
            &mut out,
            "s3csi_grpc_request_duration_seconds",
            "summary",
            "Time spent serving CSI gRPC calls, by method.",
        );
        for (method, c) in by_method {
            let method = escape(method);
            let _ = writeln!(
                out,
                "s3csi_grpc_request_duration_seconds_sum{{method=\"{method}\"}} {}\n\
                 s3csi_grpc_request_duration_seconds_count{{method=\"{method}\"}} {}",
                c.seconds, c.count
            );
        }

        for s in self.sampled.lock().unwrap().iter() {
            header(&mut out, s.name, s.kind, s.help);
            let _ = writeln!(out, "{} {}", s.name, (s.read)());
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

fn header(out: &mut String, name: &str, kind: &str, help: &str) {
    let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} {kind}");
}

/// A label value as the text format wants it.
fn escape(value: &str) -> String {
    value
        .replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
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
                                let response = respond(&req, &registry);
                                async move { Ok::<_, Infallible>(response) }
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

fn respond<B>(req: &http::Request<B>, registry: &Registry) -> http::Response<String> {
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
    let mut r = reply(StatusCode::OK, registry.render());
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

    #[test]
    fn text_format() {
        let r = Registry::new();
        r.observe_call("Probe", tonic::Code::Ok, Duration::from_millis(2));
        r.observe_call("Probe", tonic::Code::Ok, Duration::from_millis(1));
        r.observe_call(
            "NodePublishVolume",
            tonic::Code::InvalidArgument,
            Duration::from_millis(1),
        );
        let n = Arc::new(std::sync::atomic::AtomicUsize::new(3));
        let n2 = n.clone();
        r.gauge("s3csi_mounts", "Mounts.", move || {
            n2.load(std::sync::atomic::Ordering::Relaxed) as f64
        });
        let text = r.render();
        assert!(text.contains("s3csi_grpc_requests_total{method=\"Probe\",code=\"OK\"} 2\n"));
        assert!(text.contains(
            "s3csi_grpc_requests_total{method=\"NodePublishVolume\",code=\"InvalidArgument\"} 1\n"
        ));
        assert!(text.contains("s3csi_grpc_request_duration_seconds_count{method=\"Probe\"} 2\n"));
        assert!(text.contains("# TYPE s3csi_mounts gauge\ns3csi_mounts 3\n"));
        n.store(5, std::sync::atomic::Ordering::Relaxed);
        assert!(r.render().contains("s3csi_mounts 5\n"));
        assert!(text.contains(&format!(
            "s3csi_build_info{{version=\"{}\"}} 1\n",
            env!("CARGO_PKG_VERSION")
        )));
        assert_eq!(escape("a\"b\\c\nd"), "a\\\"b\\\\c\\nd");
    }
}
