//! The Kubernetes CSI driver: `s3csi csi --endpoint unix:///csi/csi.sock --mode node|controller|all`.
//!
//! Thin gRPC adapters ([`identity`], [`node`], [`controller`]) over typed configuration
//! (`config::volume`), the mounter (`mounter`) and the S3 client; every error becomes a
//! `tonic::Status` once, in [`error`]. Served on a unix socket only (mode 0600, its
//! directory 0700 when we create it); SIGTERM/SIGINT stop serving gracefully and leave
//! the mounts running for the next start to adopt.
//!
//! Advertised capabilities: plugin CONTROLLER_SERVICE (when the controller runs);
//! controller CREATE_DELETE_VOLUME; node GET_VOLUME_STATS, VOLUME_CONDITION,
//! VOLUME_MOUNT_GROUP.
//!
//! With `--register-with-kubelet DIR` the node service also registers itself with the
//! kubelet ([`registration`]), in place of the node-driver-registrar sidecar.

pub mod controller;
pub mod error;
pub mod identity;
pub mod node;
pub mod pb;
pub mod pod_identity;
pub mod registration;
pub mod volume_record;

use crate::config::Endpoint;
use crate::metrics::Metered;
use crate::mounter::backend::MounterBackend;
use crate::mounter::kernel::RealKernel;
use crate::mounter::process::ProcessBackend;
use crate::mounter::{MountManager, SharedMounts, Timeouts};
use error::CsiError;
use std::collections::HashSet;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Mode {
    Node,
    Controller,
    All,
}

#[derive(Debug, Clone, clap::Args)]
#[command(
    about = "Serve the Kubernetes CSI driver (identity, node and/or controller) on a unix socket"
)]
pub struct CsiArgs {
    /// The socket to serve on: unix:///path/csi.sock (or a plain path)
    #[arg(long, env = "CSI_ENDPOINT", default_value = "unix:///csi/csi.sock")]
    pub endpoint: String,
    /// This node's name, as NodeGetInfo reports it (required for the node service)
    #[arg(long, env = "CSI_NODE_ID")]
    pub node_id: Option<String>,
    /// Which services to serve
    #[arg(long, value_enum, default_value = "all")]
    pub mode: Mode,
    /// The driver name (CSIDriver object, StorageClass provisioner)
    #[arg(long, default_value = "s3csi.dev")]
    pub driver_name: String,
    /// Where mount records and mounter logs live (must survive a restart of the node service)
    #[arg(long, default_value = "/var/lib/s3csi")]
    pub state_dir: PathBuf,
    /// Where a volume's one FUSE mount per node is made, which every pod's target
    /// bind-mounts (one mounter per volume, options and credentials on each node). In a
    /// container it must be below a Bidirectional mount (the chart uses the plugin's
    /// directory under the kubelet's). Default: STATE_DIR/shared
    #[arg(long, value_name = "DIR")]
    pub shared_mounts_dir: Option<PathBuf>,
    /// Refuse target paths outside this directory (kubelet's root, e.g. /var/lib/kubelet)
    #[arg(long)]
    pub kubelet_dir: Option<PathBuf>,
    /// Default S3 endpoint for volumes whose context names none (and for DeleteVolume)
    #[arg(long, env = "S3CSI_ENDPOINT_URL")]
    pub s3_endpoint_url: Option<String>,
    /// Default S3 region for volumes whose context names none (and for DeleteVolume)
    #[arg(long, env = "S3CSI_REGION")]
    pub s3_region: Option<String>,
    /// Default to path-style addressing (ENDPOINT/BUCKET)
    #[arg(long, env = "S3CSI_FORCE_PATH_STYLE")]
    pub s3_force_path_style: bool,
    /// How long a mount may take to appear, in seconds
    #[arg(long, default_value = "60")]
    pub mount_timeout: u64,
    /// How long a mounter gets to complete its uploads when its volume is unpublished,
    /// in seconds (then it is killed; a mount still busy a second later is detached lazily)
    #[arg(long, default_value = "30")]
    pub unmount_timeout: u64,
    /// Kept data caches (`keepCache`) that no mount on this node used for this long are
    /// removed (checked at start and hourly), e.g. 12h or 7d; 0 keeps them for ever
    #[arg(long, default_value = "7d", value_parser = crate::config::units::parse_duration)]
    pub kept_cache_max_idle: std::time::Duration,
    /// Log level: error, warn, info, debug or trace (RUST_LOG overrides it)
    #[arg(long, default_value = "info", value_parser = ["error", "warn", "info", "debug", "trace"])]
    pub log_level: String,
    #[command(flatten)]
    pub mounter: crate::mounter::pod::MounterArgs,
    /// Serve Prometheus metrics on http://ADDRESS/metrics: IP:PORT, [IPv6]:PORT, or :PORT
    /// for every interface (e.g. 0.0.0.0:9809 or :9809). Off when not given
    #[arg(long, value_name = "HOST:PORT")]
    pub metrics_address: Option<crate::metrics::MetricsAddress>,
    /// Register with the kubelet ourselves, without the node-driver-registrar sidecar: serve
    /// the kubelet's plugin-registration API on DIR/<driver-name>-reg.sock, DIR being the
    /// kubelet's plugins_registry directory (/var/lib/kubelet/plugins_registry) as seen here.
    /// Node service only
    #[arg(long, value_name = "DIR")]
    pub register_with_kubelet: Option<PathBuf>,
    /// (--register-with-kubelet) The CSI socket's path on the node, where the kubelet calls
    /// it, e.g. /var/lib/kubelet/plugins/s3csi.dev/csi.sock. Default: the --endpoint path
    #[arg(long, value_name = "PATH", requires = "register_with_kubelet")]
    pub kubelet_registration_path: Option<PathBuf>,
}

/// One operation at a time per key (a target path, or `volume:<id>`); a second concurrent
/// call gets ABORTED, as the CSI spec asks.
#[derive(Clone, Default)]
pub struct InFlight(Arc<Mutex<HashSet<PathBuf>>>);

pub struct InFlightGuard {
    set: Arc<Mutex<HashSet<PathBuf>>>,
    key: PathBuf,
}

impl InFlight {
    pub fn try_begin(&self, key: &Path) -> Result<InFlightGuard, CsiError> {
        let mut set = self.0.lock().unwrap();
        if !set.insert(key.to_path_buf()) {
            return Err(CsiError::Aborted(format!(
                "an operation on {} is already in progress",
                key.display()
            )));
        }
        Ok(InFlightGuard {
            set: self.0.clone(),
            key: key.to_path_buf(),
        })
    }
}

impl Drop for InFlightGuard {
    fn drop(&mut self) {
        self.set.lock().unwrap().remove(&self.key);
    }
}

/// `unix:///a/b.sock`, `unix:/a/b.sock` or `/a/b.sock` → `/a/b.sock`.
pub fn socket_path(endpoint: &str) -> Result<PathBuf, StartError> {
    let path = endpoint
        .strip_prefix("unix://")
        .or_else(|| endpoint.strip_prefix("unix:"))
        .unwrap_or(endpoint);
    if endpoint.contains("://") && !endpoint.starts_with("unix://") {
        return Err(StartError::Endpoint(
            endpoint.to_string(),
            "only unix:// sockets are served",
        ));
    }
    let p = PathBuf::from(path);
    if !p.is_absolute() {
        return Err(StartError::Endpoint(
            endpoint.to_string(),
            "the socket path must be absolute",
        ));
    }
    Ok(p)
}

/// Binds the socket: creates its directory (0700), replaces a stale socket file, refuses
/// to steal a live one, and makes the socket 0600.
fn bind_socket(path: &Path) -> Result<tokio::net::UnixListener, StartError> {
    let io = |what: &'static str, p: &Path| {
        let path = p.to_path_buf();
        move |source| StartError::Socket { what, path, source }
    };
    use std::os::unix::fs::{FileTypeExt, PermissionsExt};
    if let Some(dir) = path.parent() {
        if !dir.exists() {
            std::fs::create_dir_all(dir).map_err(io("create", dir))?;
            let _ = std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o700));
        }
    }
    if let Ok(meta) = std::fs::symlink_metadata(path) {
        if !meta.file_type().is_socket() {
            return Err(StartError::NotASocket(path.to_path_buf()));
        }
        if std::os::unix::net::UnixStream::connect(path).is_ok() {
            return Err(StartError::SocketInUse(path.to_path_buf()));
        }
        std::fs::remove_file(path).map_err(io("remove stale socket", path))?;
    }
    let listener = tokio::net::UnixListener::bind(path).map_err(io("listen on", path))?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600))
        .map_err(io("restrict", path))?;
    Ok(listener)
}

async fn shutdown_signal() {
    use tokio::signal::unix::{signal, SignalKind};
    let (Ok(mut term), Ok(mut int)) = (
        signal(SignalKind::terminate()),
        signal(SignalKind::interrupt()),
    ) else {
        return std::future::pending().await;
    };
    let name = tokio::select! {
        _ = term.recv() => "SIGTERM",
        _ = int.recv() => "SIGINT",
    };
    tracing::info!(signal = name, "stopping; mounts keep running");
}

/// Why the CSI services could not start (or stopped serving).
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    #[error("endpoint {0:?}: {1}")]
    Endpoint(String, &'static str),
    #[error("cannot {what} {}: {source}", .path.display())]
    Socket {
        what: &'static str,
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{} exists and is not a socket", .0.display())]
    NotASocket(PathBuf),
    #[error("another server is listening on {}", .0.display())]
    SocketInUse(PathBuf),
    #[error("--node-id is required for the node service")]
    NodeIdMissing,
    #[error("--register-with-kubelet needs the node service (--mode node or all)")]
    RegistrationWithoutNode,
    #[error("--kubelet-registration-path {}: must be an absolute path", .0.display())]
    RegistrationPath(PathBuf),
    #[error("cannot find our own binary: {0}")]
    OwnBinary(std::io::Error),
    #[error("cannot use state directory {}: {source}", .dir.display())]
    StateDir {
        dir: PathBuf,
        source: std::io::Error,
    },
    #[error("--kubelet-dir {}: {source}", .dir.display())]
    KubeletDir {
        dir: PathBuf,
        source: std::io::Error,
    },
    #[error(transparent)]
    PodMode(#[from] crate::mounter::pod::PodSetupError),
    #[error(transparent)]
    Metrics(#[from] crate::metrics::MetricsListenError),
    #[error("--metrics-address: {0}")]
    MetricsAddress(std::io::Error),
    #[error("server failed: {0}")]
    Serve(tonic::transport::Error),
}

/// Serves until SIGTERM/SIGINT. Returns the process exit code.
pub fn run(args: CsiArgs) -> i32 {
    crate::logging::init(&args.log_level);
    let rt = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .thread_name("s3csi-csi")
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("s3csi: cannot start runtime: {e}");
            return 1;
        }
    };
    match rt.block_on(serve(args, shutdown_signal())) {
        Ok(()) => 0,
        Err(e) => {
            tracing::error!("{e}");
            eprintln!("s3csi: {e}");
            1
        }
    }
}

/// Builds the services `args` asks for and serves them until `shutdown` completes.
pub async fn serve(
    args: CsiArgs,
    shutdown: impl std::future::Future<Output = ()> + Send,
) -> Result<(), StartError> {
    use pb::controller_server::ControllerServer;
    use pb::identity_server::IdentityServer;
    use pb::node_server::NodeServer;
    let node = matches!(args.mode, Mode::Node | Mode::All);
    let controller = matches!(args.mode, Mode::Controller | Mode::All);
    let defaults = Endpoint {
        region: args.s3_region.clone(),
        endpoint_url: args.s3_endpoint_url.clone(),
        force_path_style: args.s3_force_path_style,
    };
    let path = socket_path(&args.endpoint)?;
    let registration = match &args.register_with_kubelet {
        Some(_) if !node => return Err(StartError::RegistrationWithoutNode),
        Some(dir) => {
            let endpoint = args
                .kubelet_registration_path
                .clone()
                .unwrap_or(path.clone());
            if !endpoint.is_absolute() {
                return Err(StartError::RegistrationPath(endpoint));
            }
            Some((
                registration::socket_in(dir, &args.driver_name),
                registration::RegistrationService::new(&args.driver_name, &endpoint),
            ))
        }
        None => None,
    };
    let in_flight = InFlight::default();
    let registry = crate::metrics::Registry::new();
    // Bound first, so that a port in use fails the start before anything else happens.
    let metrics_listener = match args.metrics_address {
        Some(address) => Some(address.bind().await?),
        None => None,
    };

    let node_service = if node {
        raise_open_file_limit();
        let node_id = args
            .node_id
            .clone()
            .filter(|n| !n.is_empty())
            .ok_or(StartError::NodeIdMissing)?;
        let bin = std::env::current_exe().map_err(StartError::OwnBinary)?;
        let state_error = |source| StartError::StateDir {
            dir: args.state_dir.clone(),
            source,
        };
        let backend: Arc<dyn MounterBackend> = match args.mounter.pod_settings(&node_id)? {
            Some(settings) => {
                let namespace = settings.namespace.clone();
                let pods = crate::mounter::pod::PodLauncher::connect(settings).await?;
                tracing::info!(namespace, "mounters run as pods");
                Arc::new(pods)
            }
            None => Arc::new(ProcessBackend::new(
                bin,
                MountManager::logs_dir(&args.state_dir).map_err(state_error)?,
            )),
        };
        let manager = MountManager::new(
            Arc::new(RealKernel),
            backend,
            args.state_dir.clone(),
            Timeouts {
                mount: Duration::from_secs(args.mount_timeout.max(1)),
                unmount: Duration::from_secs(args.unmount_timeout.max(1)),
            },
        )
        .map_err(state_error)?;
        let manager = Arc::new(manager);
        let shared_dir = args
            .shared_mounts_dir
            .clone()
            .unwrap_or_else(|| args.state_dir.join("shared"));
        let mounter = SharedMounts::new(manager.clone(), shared_dir, args.state_dir.join("shares"))
            .map_err(state_error)?;
        let mounter = Arc::new(mounter);
        let recovered =
            recover_in_background(manager.clone(), mounter.clone(), args.kept_cache_max_idle);
        let m = manager.clone();
        registry.gauge(
            "s3csi_mounts",
            "Mounts the node service tracks (starting, serving or being unmounted).",
            move || m.mount_count() as u64,
        );
        let m = mounter.clone();
        registry.gauge(
            "s3csi_mounters",
            "Mounters on this node: one per volume, options and credentials, whatever the number of pods using it.",
            move || m.mounter_count() as u64,
        );
        let m = mounter.clone();
        registry.gauge(
            "s3csi_published_targets",
            "Pod volume targets published on this node (each served by one of the mounters).",
            move || m.target_count() as u64,
        );
        let m = manager.clone();
        registry.counter(
            "s3csi_mounter_replacements",
            "Mounter processes that died and were replaced while their mount was held.",
            move || m.replacements_total(),
        );
        // Each mounter's own metrics (S3 requests, bytes, open files), by volume.
        let m = manager.clone();
        registry.scrape_mounters(move || m.mounter_endpoints());
        let kubelet_dir = match &args.kubelet_dir {
            Some(d) => Some(
                std::fs::canonicalize(d).map_err(|source| StartError::KubeletDir {
                    dir: d.clone(),
                    source,
                })?,
            ),
            None => None,
        };
        Some(NodeServer::new(node::NodeService {
            node_id,
            mounter,
            kubelet_dir,
            defaults: defaults.clone(),
            in_flight: in_flight.clone(),
            service_accounts: Default::default(),
            recovered,
        }))
    } else {
        None
    };
    let controller_service = controller.then(|| {
        ControllerServer::new(controller::ControllerService {
            defaults: defaults.clone(),
            in_flight: in_flight.clone(),
        })
    });

    let listener = bind_socket(&path)?;
    tracing::info!(
        socket = %path.display(),
        driver = %args.driver_name,
        mode = ?args.mode,
        version = env!("CARGO_PKG_VERSION"),
        "serving CSI"
    );
    let metrics_task = match metrics_listener {
        Some(listener) => {
            let addr = listener.local_addr().map_err(StartError::MetricsAddress)?;
            tracing::info!("serving metrics on http://{addr}/metrics");
            Some(crate::metrics::serve(listener, registry.clone()))
        }
        None => None,
    };
    let router = tonic::transport::Server::builder()
        .add_service(Metered::new(
            IdentityServer::new(identity::IdentityService {
                driver_name: args.driver_name.clone(),
                controller,
            }),
            registry.clone(),
        ))
        .add_optional_service(node_service.map(|s| Metered::new(s, registry.clone())))
        .add_optional_service(controller_service.map(|s| Metered::new(s, registry.clone())));
    let incoming = tokio_stream::wrappers::UnixListenerStream::new(listener);
    // One shutdown for both servers: the CSI one and, when asked for, the registration one.
    // A registration server that fails stops the CSI one too (the process exits with the
    // error), since the kubelet could no longer register the driver.
    let (stop, stopped) = tokio::sync::watch::channel(false);
    let stop = Arc::new(stop);
    let until_stopped = |mut rx: tokio::sync::watch::Receiver<bool>| async move {
        let _ = rx.wait_for(|s| *s).await;
    };
    // Bound after the CSI socket: the kubelet calls NodeGetInfo there as soon as it finds
    // the registration socket.
    let registration_task = match registration {
        Some((reg_path, service)) => {
            let listener = bind_socket(&reg_path)?;
            tracing::info!(socket = %reg_path.display(), "serving kubelet plugin registration");
            let server = tonic::transport::Server::builder().add_service(service.into_server());
            let incoming = tokio_stream::wrappers::UnixListenerStream::new(listener);
            let until = until_stopped(stopped.clone());
            let stop = stop.clone();
            Some((
                reg_path,
                tokio::spawn(async move {
                    let served = server.serve_with_incoming_shutdown(incoming, until).await;
                    let _ = stop.send(true);
                    served
                }),
            ))
        }
        None => None,
    };
    let until = until_stopped(stopped);
    let result = router
        .serve_with_incoming_shutdown(incoming, async {
            tokio::select! {
                _ = shutdown => {}
                _ = until => {}
            }
        })
        .await
        .map_err(StartError::Serve);
    let _ = stop.send(true);
    if let Some(task) = metrics_task {
        task.abort();
    }
    let mut result = result;
    if let Some((reg_path, task)) = registration_task {
        // Removing the registration socket unregisters the driver from the kubelet.
        let _ = std::fs::remove_file(&reg_path);
        if let Ok(Err(e)) = task.await {
            if result.is_ok() {
                result = Err(StartError::Serve(e));
            }
        }
    }
    let _ = std::fs::remove_file(&path);
    result
}

/// Adopts the mounts an earlier node service left (their mounters may each take seconds
/// to hand their descriptors back) while the socket already serves: kubelet's registration,
/// probes and identity calls are answered at once, and node calls wait on the returned
/// flag. Then starts the supervisor, which replaces mounters that die while their mount is
/// held.
fn recover_in_background(
    manager: Arc<MountManager>,
    mounter: Arc<SharedMounts>,
    kept_cache_max_idle: std::time::Duration,
) -> tokio::sync::watch::Receiver<bool> {
    let (done, recovered) = tokio::sync::watch::channel(false);
    let supervised = manager.clone();
    let adoption = tokio::spawn(async move {
        let started = std::time::Instant::now();
        let m = manager.clone();
        let adopted = tokio::task::spawn_blocking(move || m.recover())
            .await
            .unwrap_or(0);
        let m = mounter.clone();
        let targets = tokio::task::spawn_blocking(move || m.recover())
            .await
            .unwrap_or(0);
        if let Err(e) = mounter.reconcile().await {
            tracing::warn!(error = %e, "cannot clean up mounter pods; trying again at the next start");
        }
        if adopted + targets > 0 {
            tracing::info!(
                adopted,
                targets,
                took_ms = started.elapsed().as_millis() as u64,
                "adopted the mounts of a previous run"
            );
        }
    });
    tokio::spawn(async move {
        if let Err(e) = adoption.await {
            tracing::error!(error = %e, "adopting the mounts of a previous run failed");
        }
        // Node calls go on either way; replacements of dying mounters start now.
        supervised.start_supervisor();
        let _ = done.send(true);
        if kept_cache_max_idle.is_zero() {
            return;
        }
        // After adoption, so that the links of adopted mounts count as uses.
        let mut hourly = tokio::time::interval(std::time::Duration::from_secs(3600));
        loop {
            hourly.tick().await;
            let m = supervised.clone();
            let _ = tokio::task::spawn_blocking(move || m.collect_kept_caches(kept_cache_max_idle))
                .await;
        }
    });
    recovered
}

/// The node service holds one or two descriptors per mount (its duplicate of /dev/fuse, a
/// control connection): the usual soft limit of 1024 would run out near 500 volumes.
fn raise_open_file_limit() {
    let mut limit = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: plain syscalls on a stack value.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) } != 0 {
        return;
    }
    let wanted = limit.rlim_max.min(1 << 20);
    if limit.rlim_cur >= wanted {
        return;
    }
    let before = limit.rlim_cur;
    limit.rlim_cur = wanted;
    if unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &limit) } == 0 {
        tracing::info!(before, now = wanted, "raised the open-file limit");
    } else {
        tracing::warn!(
            limit = before,
            error = %std::io::Error::last_os_error(),
            "cannot raise the open-file limit; about half as many volumes as that can be published"
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn endpoints() {
        assert_eq!(
            socket_path("unix:///csi/csi.sock").unwrap(),
            PathBuf::from("/csi/csi.sock")
        );
        assert_eq!(
            socket_path("unix:/a.sock").unwrap(),
            PathBuf::from("/a.sock")
        );
        assert!(socket_path("tcp://0.0.0.0:1").is_err());
        assert!(socket_path("unix://rel.sock").is_err());
    }

    #[test]
    fn in_flight_guard() {
        let f = InFlight::default();
        let g = f.try_begin(Path::new("/t")).unwrap();
        assert!(matches!(
            f.try_begin(Path::new("/t")),
            Err(CsiError::Aborted(_))
        ));
        drop(g);
        assert!(f.try_begin(Path::new("/t")).is_ok());
    }
}
