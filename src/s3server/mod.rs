//! An embedded S3-compatible server: `s3csi s3-server` and the server behind `s3csi demo`.
//!
//! The S3 protocol (HTTP routing, SigV4, XML) is the `s3s` crate's; the storage is ours
//! ([`store`]): flat keys exactly as S3 keeps them, so `dir/` marker objects, a key `x`
//! beside keys under `x/`, and ListObjectsV2 pagination across common prefixes behave as
//! on S3. Objects live in files under one directory and survive a restart; multipart
//! uploads in progress do not. HTTP/1.1 only, one set of keys, no versioning, ACLs,
//! policies or checksums beyond ETags. Meant for demos, tests and local development, not
//! for production data.

pub mod service;
pub mod store;

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use store::Store;

/// The keys `s3csi demo` and a bare `s3csi s3-server` use. Loopback use only.
pub const DEMO_ACCESS_KEY: &str = "s3csi-demo";
pub const DEMO_SECRET_KEY: &str = "s3csi-demo-secret";
/// Environment variable holding the server's secret key (never a flag).
pub const SECRET_ENV: &str = "S3CSI_S3_SECRET_KEY";

#[derive(Debug, Clone, clap::Args)]
#[command(
    about = "Serve a directory as a small S3-compatible server (for demos, tests and local development)",
    after_help = "The secret key comes from the environment only: S3CSI_S3_SECRET_KEY \
                  (default: the demo secret, s3csi-demo-secret). The first line on stdout is \
                  `listening on http://ADDR`, so --listen 127.0.0.1:0 works in scripts."
)]
pub struct S3ServerArgs {
    /// Address to listen on (port 0 picks a free one)
    #[arg(long, default_value = "127.0.0.1:9000")]
    pub listen: SocketAddr,
    /// Directory holding the buckets and objects (created if missing; kept)
    #[arg(long)]
    pub dir: PathBuf,
    /// The access key id clients sign with
    #[arg(long, env = "S3CSI_S3_ACCESS_KEY", default_value = DEMO_ACCESS_KEY)]
    pub access_key: String,
    /// Buckets to create at start if they do not exist (repeatable)
    #[arg(long = "bucket")]
    pub buckets: Vec<String>,
    /// Log level: error, warn, info, debug or trace (RUST_LOG overrides it)
    #[arg(long, default_value = "info", value_parser = ["error", "warn", "info", "debug", "trace"])]
    pub log_level: String,
}

/// What a server needs. The secret is redacted in `Debug`.
#[derive(Clone)]
pub struct ServerConfig {
    pub listen: SocketAddr,
    pub dir: PathBuf,
    pub access_key: String,
    pub secret_key: String,
}

impl std::fmt::Debug for ServerConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ServerConfig")
            .field("listen", &self.listen)
            .field("dir", &self.dir)
            .field("access_key", &self.access_key)
            .field("secret_key", &"<redacted>")
            .finish()
    }
}

/// Why a server could not start.
#[derive(Debug, thiserror::Error)]
pub enum ServerError {
    #[error("cannot open {}: {source}", .dir.display())]
    OpenStore {
        dir: PathBuf,
        source: store::StoreError,
    },
    #[error("cannot listen on {addr}: {source}")]
    Listen {
        addr: SocketAddr,
        source: std::io::Error,
    },
    /// The listening socket has no address (it always has one once bound).
    #[error("{0}")]
    LocalAddr(std::io::Error),
    /// Opening the store panicked or was cancelled.
    #[error("{0}")]
    Join(#[from] tokio::task::JoinError),
}

/// A server running on the current tokio runtime; [`RunningServer::stop`] ends it.
pub struct RunningServer {
    pub addr: SocketAddr,
    pub store: Arc<Store>,
    /// Requests served so far, by kind (tests count the round trips a mount makes).
    pub requests: Arc<RequestCounts>,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    task: Option<tokio::task::JoinHandle<()>>,
}

/// Requests a server answered, by kind.
#[derive(Debug, Default)]
pub struct RequestCounts {
    heads: std::sync::atomic::AtomicU64,
    lists: std::sync::atomic::AtomicU64,
    others: std::sync::atomic::AtomicU64,
}

impl RequestCounts {
    fn note<B>(&self, req: &hyper::Request<B>) {
        use std::sync::atomic::Ordering::Relaxed;
        // Path-style: `/bucket?list-type=2…` is a listing, `/bucket/key` an object.
        let object = req.uri().path().trim_matches('/').contains('/');
        let counter = match *req.method() {
            hyper::Method::HEAD => &self.heads,
            hyper::Method::GET if !object && req.uri().query().is_some() => &self.lists,
            _ => &self.others,
        };
        counter.fetch_add(1, Relaxed);
    }

    pub fn heads(&self) -> u64 {
        self.heads.load(std::sync::atomic::Ordering::Relaxed)
    }

    pub fn lists(&self) -> u64 {
        self.lists.load(std::sync::atomic::Ordering::Relaxed)
    }

    pub fn others(&self) -> u64 {
        self.others.load(std::sync::atomic::Ordering::Relaxed)
    }
}

impl RunningServer {
    /// `http://ADDR`, for clients' endpoint URL (path-style addressing).
    pub fn endpoint(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Stops accepting, drops every open connection and waits for the accept loop.
    pub async fn stop(mut self) {
        if let Some(tx) = self.stop.take() {
            let _ = tx.send(());
        }
        if let Some(task) = self.task.take() {
            let _ = task.await;
        }
    }
}

impl Drop for RunningServer {
    fn drop(&mut self) {
        if let Some(tx) = self.stop.take() {
            let _ = tx.send(());
        }
    }
}

/// Opens the store under `config.dir` and serves it on `config.listen`.
pub async fn start(config: ServerConfig) -> Result<RunningServer, ServerError> {
    let dir = config.dir.clone();
    let store = tokio::task::spawn_blocking(move || open_store(&dir)).await??;
    let store = Arc::new(store);
    let listener = tokio::net::TcpListener::bind(config.listen)
        .await
        .map_err(|source| ServerError::Listen {
            addr: config.listen,
            source,
        })?;
    let addr = listener.local_addr().map_err(ServerError::LocalAddr)?;
    let service = {
        let mut b = s3s::service::S3ServiceBuilder::new(service::Backend {
            store: store.clone(),
        });
        b.set_auth(s3s::auth::SimpleAuth::from_single(
            config.access_key.clone(),
            config.secret_key.clone(),
        ));
        b.build()
    };
    let requests = Arc::new(RequestCounts::default());
    let counts = requests.clone();
    let (tx, mut rx) = tokio::sync::oneshot::channel::<()>();
    let task = tokio::spawn(async move {
        let mut conns = tokio::task::JoinSet::new();
        loop {
            tokio::select! {
                _ = &mut rx => break,
                accepted = listener.accept() => match accepted {
                    Ok((stream, _)) => {
                        let _ = stream.set_nodelay(true);
                        let svc = service.clone();
                        let counts = counts.clone();
                        conns.spawn(async move {
                            type Incoming = hyper::Request<hyper::body::Incoming>;
                            let io = hyper_util::rt::TokioIo::new(stream);
                            let counted = hyper::service::service_fn(move |req: Incoming| {
                                counts.note(&req);
                                hyper::service::Service::<Incoming>::call(&svc, req)
                            });
                            let _ = hyper::server::conn::http1::Builder::new()
                                .keep_alive(true)
                                .serve_connection(io, counted)
                                .await;
                        });
                    }
                    Err(e) => {
                        tracing::warn!(error = %e, "accept failed");
                        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
                    }
                },
                Some(_) = conns.join_next(), if !conns.is_empty() => {}
            }
        }
        conns.shutdown().await;
    });
    Ok(RunningServer {
        addr,
        store,
        requests,
        stop: Some(tx),
        task: Some(task),
    })
}

fn open_store(dir: &Path) -> Result<Store, ServerError> {
    Store::open(dir).map_err(|source| ServerError::OpenStore {
        dir: dir.to_path_buf(),
        source,
    })
}

/// `s3csi s3-server`: serves until SIGINT/SIGTERM. Returns the exit code.
pub fn run_command(args: S3ServerArgs) -> i32 {
    crate::logging::init(&args.log_level);
    let secret = std::env::var(SECRET_ENV)
        .ok()
        .filter(|s| !s.is_empty())
        .unwrap_or_else(|| {
            if !args.listen.ip().is_loopback() {
                tracing::warn!(
                    "serving on a non-loopback address with the demo secret key; set {SECRET_ENV}"
                );
            }
            DEMO_SECRET_KEY.to_string()
        });
    let rt = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .thread_name("s3csi-s3")
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("s3csi: cannot start runtime: {e}");
            return 1;
        }
    };
    rt.block_on(async move {
        let server = match start(ServerConfig {
            listen: args.listen,
            dir: args.dir.clone(),
            access_key: args.access_key.clone(),
            secret_key: secret,
        })
        .await
        {
            Ok(s) => s,
            Err(e) => {
                eprintln!("s3csi: {e}");
                return 1;
            }
        };
        for b in &args.buckets {
            match server.store.create_bucket(b) {
                Ok(()) | Err(store::StoreError::BucketAlreadyOwnedByYou) => {}
                Err(e) => {
                    eprintln!("s3csi: cannot create bucket {b:?}: {e}");
                    return 1;
                }
            }
        }
        {
            use std::io::Write;
            let mut out = std::io::stdout().lock();
            let _ = writeln!(out, "listening on {}", server.endpoint());
            let _ = out.flush();
        }
        tracing::info!(
            endpoint = %server.endpoint(),
            dir = %args.dir.display(),
            access_key = %args.access_key,
            "serving S3 (path-style addressing)"
        );
        let signal = wait_for_stop().await;
        tracing::info!(signal, "stopping");
        server.stop().await;
        0
    })
}

/// Waits for SIGINT or SIGTERM; returns which.
pub async fn wait_for_stop() -> &'static str {
    use tokio::signal::unix::{signal, SignalKind};
    let (Ok(mut term), Ok(mut int)) = (
        signal(SignalKind::terminate()),
        signal(SignalKind::interrupt()),
    ) else {
        return std::future::pending().await;
    };
    tokio::select! {
        _ = term.recv() => "SIGTERM",
        _ = int.recv() => "SIGINT",
    }
}
