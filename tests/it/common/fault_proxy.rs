//! A fault-injecting HTTP/1.1 proxy for tests: sits on 127.0.0.1 between an S3 client
//! (a mount, `--endpoint-url http://PROXY`) and the moto server, and by rule answers
//! 500 InternalError / 503 SlowDown with a proper S3 XML error body, resets the connection
//! while the request body is arriving or after the response was sent in part, stalls, or
//! delays.
//!
//! It understands just enough HTTP/1.1 to forward requests one at a time per connection:
//! the request line, headers, a `Content-Length` or chunked body, `Expect: 100-continue`,
//! and responses framed by `Content-Length`, chunking or connection close.
//!
//! Rules are tried in order; the first whose matcher accepts the request and whose dice
//! roll (`share`, from a seeded PRNG) comes up fires, at most `limit` times. Counts of
//! requests and of each fault kind are kept for the test to print.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::{TcpListener, TcpStream};

/// Keeps a stalled connection open, discarding what the client sends, until the client
/// gives up and closes it (or 10 minutes pass).
async fn hold_until_closed(client: &mut (impl tokio::io::AsyncRead + Unpin)) {
    let mut sink = [0u8; 1024];
    let _ = tokio::time::timeout(Duration::from_secs(600), async {
        loop {
            match client.read(&mut sink).await {
                Ok(0) | Err(_) => break,
                Ok(_) => {}
            }
        }
    })
    .await;
}

/// What a firing rule does to the request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fault {
    /// 500 InternalError, after reading the whole request.
    Error500,
    /// 503 SlowDown, after reading the whole request.
    SlowDown503,
    /// Reset the connection (RST) when half of the request body has arrived; the request
    /// never reaches S3.
    ResetRequest,
    /// Forward the request (S3 executes it), then send only part of the response and
    /// reset: the client cannot know whether its request took effect.
    ResetResponse,
    /// Forward the request, send the response headers and half of its body, then hang
    /// without closing (a stalled download).
    StallBody,
    /// Never answer; hold the connection open until the client gives up.
    Stall,
    /// Wait this long, then forward normally.
    Delay(Duration),
}

impl Fault {
    pub fn name(&self) -> &'static str {
        match self {
            Fault::Error500 => "500 InternalError",
            Fault::SlowDown503 => "503 SlowDown",
            Fault::ResetRequest => "reset mid-request",
            Fault::ResetResponse => "reset mid-response",
            Fault::StallBody => "stalled body",
            Fault::Stall => "stall",
            Fault::Delay(_) => "delay",
        }
    }
}

/// The parts of a request a rule can look at.
#[derive(Debug, Clone)]
pub struct Req {
    pub method: String,
    /// Path without the query, e.g. `/bucket/key`.
    pub path: String,
    /// Query string without `?` (may be empty).
    pub query: String,
    pub body_len: u64,
}

impl Req {
    /// The S3 operation this is, roughly (enough for rules and stats).
    pub fn op(&self) -> &'static str {
        let q = &self.query;
        let has = |k: &str| {
            q.split('&')
                .any(|p| p == k || p.starts_with(&format!("{k}=")))
        };
        match self.method.as_str() {
            "GET" if has("uploads") => "ListMultipartUploads",
            "GET" if has("list-type") || (self.path.matches('/').count() <= 1) => "ListObjects",
            "GET" => "GetObject",
            "HEAD" => "HeadObject",
            "PUT" if has("partNumber") => "UploadPart",
            "PUT" => "PutObject/CopyObject",
            "POST" if has("uploads") => "CreateMultipartUpload",
            "POST" if has("uploadId") => "CompleteMultipartUpload",
            "POST" if has("delete") => "DeleteObjects",
            "DELETE" if has("uploadId") => "AbortMultipartUpload",
            "DELETE" => "DeleteObject",
            _ => "other",
        }
    }
}

pub type Matcher = Arc<dyn Fn(&Req) -> bool + Send + Sync>;

/// Sees every request once its body has arrived: its headers and body (raw, as framed),
/// which it may rewrite (the `Content-Length` is fixed up for unchunked bodies). Returning a
/// raw HTTP response answers with it instead of forwarding (and instead of any fault).
pub type Hook =
    Arc<dyn Fn(&Req, &[(String, String)], &mut Vec<u8>) -> Option<Vec<u8>> + Send + Sync>;

pub struct Rule {
    pub matcher: Matcher,
    /// Probability of firing for a matching request, 0.0..=1.0.
    pub share: f64,
    /// Fire at most this many times.
    pub limit: Option<u64>,
    pub fault: Fault,
    fired: AtomicU64,
}

impl Rule {
    pub fn new(
        matcher: impl Fn(&Req) -> bool + Send + Sync + 'static,
        share: f64,
        fault: Fault,
    ) -> Rule {
        Rule {
            matcher: Arc::new(matcher),
            share,
            limit: None,
            fault,
            fired: AtomicU64::new(0),
        }
    }

    pub fn limit(mut self, n: u64) -> Rule {
        self.limit = Some(n);
        self
    }

    /// Any request.
    pub fn any(share: f64, fault: Fault) -> Rule {
        Rule::new(|_| true, share, fault)
    }

    /// Requests of one S3 operation (see [`Req::op`]).
    pub fn op(op: &'static str, share: f64, fault: Fault) -> Rule {
        Rule::new(move |r| r.op() == op, share, fault)
    }

    pub fn fired(&self) -> u64 {
        self.fired.load(Ordering::Relaxed)
    }
}

#[derive(Default)]
pub struct Stats {
    pub requests: AtomicU64,
    pub faults: Mutex<BTreeMap<&'static str, u64>>,
    /// Requests seen per S3 operation.
    pub ops: Mutex<BTreeMap<&'static str, u64>>,
}

pub struct FaultProxy {
    pub addr: SocketAddr,
    upstream: SocketAddr,
    rules: Mutex<Vec<Arc<Rule>>>,
    enabled: AtomicBool,
    rng: Mutex<u64>,
    hook: Mutex<Option<Hook>>,
    pub stats: Stats,
}

fn splitmix(state: &mut u64) -> u64 {
    *state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
    let mut z = *state;
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

impl FaultProxy {
    /// Starts a proxy to `upstream` (e.g. the moto endpoint `http://127.0.0.1:PORT`) on the
    /// shared test runtime. Faults are off until [`FaultProxy::enable`].
    pub fn start(upstream: &str, seed: u64) -> Arc<FaultProxy> {
        let upstream: SocketAddr = upstream
            .trim_start_matches("http://")
            .trim_end_matches('/')
            .parse()
            .expect("upstream must be http://IP:PORT");
        let std_listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        std_listener.set_nonblocking(true).unwrap();
        let addr = std_listener.local_addr().unwrap();
        let proxy = Arc::new(FaultProxy {
            addr,
            upstream,
            rules: Mutex::new(Vec::new()),
            enabled: AtomicBool::new(false),
            rng: Mutex::new(seed),
            hook: Mutex::new(None),
            stats: Stats::default(),
        });
        let p = proxy.clone();
        super::runtime().spawn(async move {
            let listener = TcpListener::from_std(std_listener).unwrap();
            loop {
                let Ok((sock, _)) = listener.accept().await else {
                    continue;
                };
                let p = p.clone();
                tokio::spawn(async move {
                    let _ = p.serve(sock).await;
                });
            }
        });
        proxy
    }

    pub fn endpoint(&self) -> String {
        format!("http://{}", self.addr)
    }

    pub fn add_rule(&self, rule: Rule) -> Arc<Rule> {
        let rule = Arc::new(rule);
        self.rules.lock().unwrap().push(rule.clone());
        rule
    }

    /// Installs the request hook (see [`Hook`]), replacing any earlier one.
    pub fn set_hook(
        &self,
        hook: impl Fn(&Req, &[(String, String)], &mut Vec<u8>) -> Option<Vec<u8>>
            + Send
            + Sync
            + 'static,
    ) {
        *self.hook.lock().unwrap() = Some(Arc::new(hook));
    }

    pub fn clear_rules(&self) {
        self.rules.lock().unwrap().clear();
    }

    pub fn enable(&self, on: bool) {
        self.enabled.store(on, Ordering::SeqCst);
    }

    pub fn faults_total(&self) -> u64 {
        self.stats.faults.lock().unwrap().values().sum()
    }

    pub fn summary(&self) -> String {
        format!(
            "{} requests {:?}; {} faults {:?}",
            self.stats.requests.load(Ordering::Relaxed),
            self.stats.ops.lock().unwrap(),
            self.faults_total(),
            self.stats.faults.lock().unwrap()
        )
    }

    fn decide(&self, req: &Req) -> Option<Fault> {
        self.stats.requests.fetch_add(1, Ordering::Relaxed);
        *self.stats.ops.lock().unwrap().entry(req.op()).or_default() += 1;
        if !self.enabled.load(Ordering::SeqCst) {
            return None;
        }
        let rules = self.rules.lock().unwrap().clone();
        for rule in rules {
            if !(rule.matcher)(req) {
                continue;
            }
            if rule.limit.is_some_and(|l| rule.fired() >= l) {
                continue;
            }
            let roll = (splitmix(&mut self.rng.lock().unwrap()) >> 11) as f64 / (1u64 << 53) as f64;
            if roll < rule.share {
                rule.fired.fetch_add(1, Ordering::Relaxed);
                *self
                    .stats
                    .faults
                    .lock()
                    .unwrap()
                    .entry(rule.fault.name())
                    .or_default() += 1;
                return Some(rule.fault);
            }
        }
        None
    }

    async fn serve(self: Arc<Self>, client: TcpStream) -> std::io::Result<()> {
        let _ = client.set_nodelay(true);
        let mut client = BufReader::new(client);
        let mut upstream: Option<BufReader<TcpStream>> = None;
        loop {
            let Some(head) = read_head(&mut client).await? else {
                return Ok(());
            };
            let (method, target, headers) = parse_head(&head)?;
            let (path, query) = target.split_once('?').unwrap_or((&target, ""));
            let header = |name: &str| {
                headers
                    .iter()
                    .find(|(k, _)| k.eq_ignore_ascii_case(name))
                    .map(|(_, v)| v.as_str())
            };
            let chunked = header("transfer-encoding").is_some_and(|v| v.contains("chunked"));
            let length: u64 = header("content-length")
                .and_then(|v| v.trim().parse().ok())
                .unwrap_or(0);
            let expect = header("expect").is_some_and(|v| v.eq_ignore_ascii_case("100-continue"));
            let req = Req {
                method: method.clone(),
                path: path.to_string(),
                query: query.to_string(),
                body_len: length,
            };
            let fault = self.decide(&req);
            if expect {
                client
                    .get_mut()
                    .write_all(b"HTTP/1.1 100 Continue\r\n\r\n")
                    .await?;
            }
            if fault == Some(Fault::ResetRequest) {
                // Take half the body (at least a byte if there is one), then RST.
                let mut half = vec![0u8; (length / 2) as usize];
                let _ = client.read_exact(&mut half).await;
                reset(client.into_inner());
                return Ok(());
            }
            let mut body = if chunked {
                read_chunked(&mut client).await?
            } else {
                let mut b = vec![0u8; length as usize];
                client.read_exact(&mut b).await?;
                b
            };
            let hook = self.hook.lock().unwrap().clone();
            if let Some(hook) = hook {
                if let Some(answer) = hook(&req, &headers, &mut body) {
                    client.get_mut().write_all(&answer).await?;
                    continue;
                }
            }
            match fault {
                Some(Fault::Error500) | Some(Fault::SlowDown503) => {
                    let (status, code, msg) = if fault == Some(Fault::Error500) {
                        (
                            "500 Internal Server Error",
                            "InternalError",
                            "We encountered an internal error. Please try again.",
                        )
                    } else {
                        (
                            "503 Slow Down",
                            "SlowDown",
                            "Please reduce your request rate.",
                        )
                    };
                    let xml = format!(
                        "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n<Error><Code>{code}</Code>\
                         <Message>{msg}</Message><Resource>{path}</Resource>\
                         <RequestId>FAULTPROXY</RequestId></Error>"
                    );
                    let body_len = if method == "HEAD" { 0 } else { xml.len() };
                    let mut resp = format!(
                        "HTTP/1.1 {status}\r\nContent-Type: application/xml\r\n\
                         x-amz-request-id: FAULTPROXY\r\nContent-Length: {}\r\n\r\n",
                        xml.len()
                    )
                    .into_bytes();
                    if body_len > 0 {
                        resp.extend_from_slice(xml.as_bytes());
                    }
                    client.get_mut().write_all(&resp).await?;
                    continue;
                }
                Some(Fault::Stall) => {
                    hold_until_closed(&mut client).await;
                    return Ok(());
                }
                Some(Fault::Delay(d)) => tokio::time::sleep(d).await,
                _ => {}
            }
            // Forward, reconnecting once if a kept-alive upstream connection went away.
            let mut out = Vec::with_capacity(head.len() + body.len());
            for line in head.split(|b| *b == b'\n') {
                let l = String::from_utf8_lossy(line);
                if l.to_ascii_lowercase().starts_with("expect:") {
                    continue;
                }
                if !chunked
                    && body.len() as u64 != length
                    && l.to_ascii_lowercase().starts_with("content-length:")
                {
                    out.extend_from_slice(format!("Content-Length: {}\r\n", body.len()).as_bytes());
                    continue;
                }
                if line.is_empty() || line == b"\r" {
                    continue;
                }
                out.extend_from_slice(line);
                out.push(b'\n');
            }
            out.extend_from_slice(b"\r\n");
            out.extend_from_slice(&body);
            let mut response = None;
            for _ in 0..2 {
                if upstream.is_none() {
                    let s = TcpStream::connect(self.upstream).await?;
                    let _ = s.set_nodelay(true);
                    upstream = Some(BufReader::new(s));
                }
                let up = upstream.as_mut().unwrap();
                let sent = up.get_mut().write_all(&out).await;
                let got = match sent {
                    Ok(()) => read_response(up, &method).await,
                    Err(e) => Err(e),
                };
                match got {
                    Ok(r) => {
                        response = Some(r);
                        break;
                    }
                    Err(_) => upstream = None,
                }
            }
            let Some((resp, close)) = response else {
                reset(client.into_inner());
                return Ok(());
            };
            if close {
                upstream = None;
            }
            match fault {
                Some(Fault::ResetResponse) => {
                    // The first half of the response, then RST.
                    let _ = client.get_mut().write_all(&resp[..resp.len() / 2]).await;
                    reset(client.into_inner());
                    return Ok(());
                }
                Some(Fault::StallBody) => {
                    let head_end = resp
                        .windows(4)
                        .position(|w| w == b"\r\n\r\n")
                        .map(|p| p + 4)
                        .unwrap_or(0);
                    let cut = head_end + (resp.len() - head_end) / 2;
                    client.get_mut().write_all(&resp[..cut]).await?;
                    hold_until_closed(&mut client).await;
                    return Ok(());
                }
                _ => {}
            }
            client.get_mut().write_all(&resp).await?;
            if close {
                return Ok(());
            }
        }
    }
}

/// Closes with RST instead of FIN.
#[allow(deprecated)] // zero linger never blocks: it is exactly the RST we want
fn reset(stream: TcpStream) {
    let _ = stream.set_linger(Some(Duration::ZERO));
    drop(stream);
}

/// Reads up to and including the blank line; None on a clean EOF before any byte.
async fn read_head<R: AsyncBufReadExt + Unpin>(r: &mut R) -> std::io::Result<Option<Vec<u8>>> {
    let mut head = Vec::new();
    loop {
        let n = r.read_until(b'\n', &mut head).await?;
        if n == 0 {
            if head.is_empty() {
                return Ok(None);
            }
            return Err(std::io::ErrorKind::UnexpectedEof.into());
        }
        if head.ends_with(b"\r\n\r\n") || head == b"\r\n" {
            if head == b"\r\n" {
                head.clear();
                continue;
            }
            return Ok(Some(head));
        }
        if head.len() > 1 << 20 {
            return Err(std::io::ErrorKind::InvalidData.into());
        }
    }
}

/// The first line's first two words (method and target, or version and status) and the
/// headers.
type Head = (String, String, Vec<(String, String)>);

fn parse_head(head: &[u8]) -> std::io::Result<Head> {
    let text = String::from_utf8_lossy(head);
    let mut lines = text.split("\r\n");
    let first = lines.next().unwrap_or("");
    let mut parts = first.split(' ');
    let (Some(a), Some(b)) = (parts.next(), parts.next()) else {
        return Err(std::io::ErrorKind::InvalidData.into());
    };
    let headers = lines
        .filter_map(|l| l.split_once(':'))
        .map(|(k, v)| (k.trim().to_string(), v.trim().to_string()))
        .collect();
    Ok((a.to_string(), b.to_string(), headers))
}

/// A chunked body, returned raw (as it was framed) so it can be forwarded unchanged.
async fn read_chunked<R: AsyncBufReadExt + Unpin>(r: &mut R) -> std::io::Result<Vec<u8>> {
    let mut raw = Vec::new();
    loop {
        let start = raw.len();
        if r.read_until(b'\n', &mut raw).await? == 0 {
            return Err(std::io::ErrorKind::UnexpectedEof.into());
        }
        let line = String::from_utf8_lossy(&raw[start..]).to_string();
        let size_hex = line
            .trim()
            .split(';')
            .next()
            .unwrap_or("")
            .trim()
            .to_string();
        let size = u64::from_str_radix(&size_hex, 16)
            .map_err(|_| std::io::Error::from(std::io::ErrorKind::InvalidData))?;
        if size == 0 {
            // Trailers up to the blank line.
            loop {
                let s = raw.len();
                if r.read_until(b'\n', &mut raw).await? == 0 {
                    return Err(std::io::ErrorKind::UnexpectedEof.into());
                }
                if &raw[s..] == b"\r\n" {
                    return Ok(raw);
                }
            }
        }
        let s = raw.len();
        raw.resize(s + size as usize + 2, 0);
        r.read_exact(&mut raw[s..]).await?;
    }
}

/// One whole response, raw; and whether the server closes the connection after it.
async fn read_response(
    r: &mut BufReader<TcpStream>,
    method: &str,
) -> std::io::Result<(Vec<u8>, bool)> {
    let mut out = Vec::new();
    loop {
        let head = read_head(r)
            .await?
            .ok_or(std::io::Error::from(std::io::ErrorKind::UnexpectedEof))?;
        let (_version, status, headers) = parse_head(&head)?;
        out.extend_from_slice(&head);
        let status: u16 = status.parse().unwrap_or(0);
        if (100..200).contains(&status) {
            continue; // an interim response; the real one follows
        }
        let header = |name: &str| {
            headers
                .iter()
                .find(|(k, _)| k.eq_ignore_ascii_case(name))
                .map(|(_, v)| v.clone())
        };
        let close = header("connection").is_some_and(|v| v.eq_ignore_ascii_case("close"))
            || head.starts_with(b"HTTP/1.0");
        if method == "HEAD" || status == 204 || status == 304 {
            return Ok((out, close));
        }
        if header("transfer-encoding").is_some_and(|v| v.contains("chunked")) {
            out.extend(read_chunked(r).await?);
            return Ok((out, close));
        }
        if let Some(len) = header("content-length").and_then(|v| v.parse::<usize>().ok()) {
            let s = out.len();
            out.resize(s + len, 0);
            r.read_exact(&mut out[s..]).await?;
            return Ok((out, close));
        }
        r.read_to_end(&mut out).await?;
        return Ok((out, true));
    }
}
