//! `s3csi demo`: the whole driver on one machine, with no cloud account.
//!
//! Starts the embedded S3 server ([`crate::s3server`]) on loopback over a temporary
//! directory, creates a bucket, serves the CSI services (mode all) on a temporary unix
//! socket in this process, and then calls them over that socket exactly as the
//! external-provisioner and kubelet would: CreateVolume with StorageClass parameters and
//! provisioner secrets, NodePublishVolume with the returned volume context and node publish
//! secrets. The node service mounts the volume with a real `s3csi mount` child. A file is
//! written and read back through the mount, the mount path is printed, and the demo waits.
//! SIGINT/SIGTERM: NodeUnpublishVolume, DeleteVolume, stop the services and the server,
//! remove the temporary directory, exit 0.

use crate::config::volume::{
    KEY_BASE_PREFIX, KEY_BUCKET, KEY_ENDPOINT_URL, KEY_FORCE_PATH_STYLE, KEY_REGION,
    SECRET_ACCESS_KEY_ID, SECRET_SECRET_ACCESS_KEY,
};
use crate::csi::pb::{self, controller_client::ControllerClient, node_client::NodeClient};
use crate::s3server::{self, DEMO_ACCESS_KEY, DEMO_SECRET_KEY};
use clap::Parser;
use std::collections::HashMap;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};
use tonic::transport::Channel;

pub const DEMO_BUCKET: &str = "demo-bucket";
const VOLUME_NAME: &str = "pvc-demo";
const BASE_PREFIX: &str = "volumes/";
const HELLO: &str = "hello.txt";
const HELLO_TEXT: &str = "Hello from s3csi: this file is an object in an S3 bucket.\n";

#[derive(Debug, Clone, clap::Args)]
#[command(
    about = "Run the CSI driver against an embedded S3 server and mount a volume, as Kubernetes would",
    after_help = "Starts an S3 server on 127.0.0.1 over a temporary directory and the CSI \
                  services on a temporary unix socket, provisions a volume (CreateVolume) and \
                  mounts it (NodePublishVolume) as the external-provisioner and kubelet would, \
                  then waits. Ctrl-C unmounts, deletes the volume and removes everything it \
                  created. Needs FUSE: root (or /dev/fuse access) and fusermount3."
)]
pub struct DemoArgs {
    /// Create the demo's temporary directory under DIR instead of $TMPDIR
    #[arg(long, value_name = "DIR")]
    pub dir: Option<PathBuf>,
    /// Log level of the services: error, warn, info, debug or trace (RUST_LOG overrides it)
    #[arg(long, default_value = "warn", value_parser = ["error", "warn", "info", "debug", "trace"])]
    pub log_level: String,
    /// Clean up and exit after the self-check (the file written and read back through the
    /// mount) instead of waiting for Ctrl-C; for scripts and the test of README's quick start
    #[arg(long, env = "S3CSI_DEMO_EXIT", value_parser = clap::builder::BoolishValueParser::new())]
    pub exit: bool,
}

/// Why the demo stopped short, or could not clean up.
#[derive(Debug, thiserror::Error)]
enum DemoError {
    #[error("{}: {source}", .dir.display())]
    CreateParent {
        dir: PathBuf,
        source: std::io::Error,
    },
    #[error("cannot create {}: {source}", .dir.display())]
    CreateDir {
        dir: PathBuf,
        source: std::io::Error,
    },
    #[error("cannot create a directory under {}", .0.display())]
    NoFreeName(PathBuf),
    #[error("interrupted by {0}")]
    Interrupted(&'static str),
    #[error(transparent)]
    S3Server(#[from] s3server::ServerError),
    #[error("cannot create the demo bucket: {0}")]
    CreateBucket(s3server::store::StoreError),
    #[error("internal error building the CSI options: {0}")]
    CsiOptions(clap::Error),
    #[error("the CSI services stopped at start (see the log above)")]
    CsiStoppedAtStart,
    #[error("{0}")]
    CsiEndpoint(tonic::transport::Error),
    #[error("cannot connect to {}: {source}", .socket.display())]
    Connect {
        socket: PathBuf,
        source: tonic::transport::Error,
    },
    #[error("the CSI socket {} did not appear", .0.display())]
    NoSocket(PathBuf),
    #[error("CreateVolume failed: {}", status_text(.0))]
    CreateVolume(tonic::Status),
    #[error("CreateVolume returned no volume")]
    NoVolume,
    #[error("cannot create the pod directory: {0}")]
    PodDir(std::io::Error),
    #[error("NodePublishVolume failed: {} (mounter logs under {})", status_text(.status), .logs.display())]
    Publish {
        status: tonic::Status,
        logs: PathBuf,
    },
    #[error("{0}")]
    Task(#[from] tokio::task::JoinError),
    #[error("cannot use the mount at {}: {source}", .target.display())]
    UseMount {
        target: PathBuf,
        source: std::io::Error,
    },
    #[error("read back {back:?} from {}", .path.display())]
    ReadBack { back: String, path: PathBuf },
    #[error("NodeUnpublishVolume failed: {}", status_text(.0))]
    Unpublish(tonic::Status),
    #[error("DeleteVolume failed: {}", status_text(.0))]
    DeleteVolume(tonic::Status),
    /// The CSI services' own error, as they report it (text).
    #[error("CSI services: {0}")]
    CsiServices(crate::csi::StartError),
    #[error("CSI services: {0}")]
    CsiServicesTask(tokio::task::JoinError),
    #[error("the CSI services did not stop within 10s")]
    CsiStopTimeout,
}

/// Writes one line to stdout at once (a test or a script may be waiting for it).
fn say(text: impl AsRef<str>) {
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "{}", text.as_ref());
    let _ = out.flush();
}

fn make_temp_dir(parent: &Path) -> Result<PathBuf, DemoError> {
    use std::os::unix::fs::PermissionsExt;
    std::fs::create_dir_all(parent).map_err(|source| DemoError::CreateParent {
        dir: parent.to_path_buf(),
        source,
    })?;
    for n in 0..1000u32 {
        let dir = parent.join(format!("s3csi-demo-{}-{n}", std::process::id()));
        match std::fs::create_dir(&dir) {
            Ok(()) => {
                let _ = std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o700));
                return Ok(dir);
            }
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => continue,
            Err(source) => return Err(DemoError::CreateDir { dir, source }),
        }
    }
    Err(DemoError::NoFreeName(parent.to_path_buf()))
}

/// `s3csi demo`. Returns the exit code.
pub fn run(args: DemoArgs) -> i32 {
    crate::logging::init(&args.log_level);
    let parent = args.dir.clone().unwrap_or_else(std::env::temp_dir);
    let root = match make_temp_dir(&parent) {
        Ok(d) => d,
        Err(e) => {
            eprintln!("s3csi demo: {e}");
            return 1;
        }
    };
    let rt = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .thread_name("s3csi-demo")
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("s3csi demo: cannot start runtime: {e}");
            let _ = std::fs::remove_dir_all(&root);
            return 1;
        }
    };
    let code = rt.block_on(Demo::new(root.clone()).run(args.exit));
    drop(rt);
    if let Err(e) = std::fs::remove_dir_all(&root) {
        if e.kind() != std::io::ErrorKind::NotFound {
            eprintln!("s3csi demo: cannot remove {}: {e}", root.display());
            return 1;
        }
    }
    code
}

/// What has been started, so that a failure at any step undoes exactly that much.
struct Demo {
    root: PathBuf,
    server: Option<s3server::RunningServer>,
    csi_stop: Option<tokio::sync::oneshot::Sender<()>>,
    csi_task: Option<tokio::task::JoinHandle<Result<(), crate::csi::StartError>>>,
    channel: Option<Channel>,
    volume: Option<pb::Volume>,
    published: Option<PathBuf>,
}

fn secrets() -> HashMap<String, String> {
    HashMap::from([
        (
            SECRET_ACCESS_KEY_ID.to_string(),
            DEMO_ACCESS_KEY.to_string(),
        ),
        (
            SECRET_SECRET_ACCESS_KEY.to_string(),
            DEMO_SECRET_KEY.to_string(),
        ),
    ])
}

fn capability() -> pb::VolumeCapability {
    use pb::volume_capability as vc;
    pb::VolumeCapability {
        access_type: Some(vc::AccessType::Mount(vc::MountVolume::default())),
        access_mode: Some(vc::AccessMode {
            mode: vc::access_mode::Mode::MultiNodeMultiWriter as i32,
        }),
    }
}

fn status_text(s: &tonic::Status) -> String {
    format!("{:?}: {}", s.code(), s.message())
}

impl Demo {
    fn new(root: PathBuf) -> Demo {
        Demo {
            root,
            server: None,
            csi_stop: None,
            csi_task: None,
            channel: None,
            volume: None,
            published: None,
        }
    }

    /// `exit_after_check`: stop as soon as the mount has been checked, as if interrupted.
    async fn run(mut self, exit_after_check: bool) -> i32 {
        use tokio::signal::unix::{signal, SignalKind};
        let (mut term, mut int) = match (
            signal(SignalKind::terminate()),
            signal(SignalKind::interrupt()),
        ) {
            (Ok(t), Ok(i)) => (t, i),
            _ => {
                eprintln!("s3csi demo: cannot handle signals");
                return 1;
            }
        };
        let result = tokio::select! {
            r = self.start() => r,
            _ = term.recv() => Err(DemoError::Interrupted("SIGTERM")),
            _ = int.recv() => Err(DemoError::Interrupted("SIGINT")),
        };
        let mut code = 0;
        match result {
            Ok(()) if exit_after_check => say("\n--exit: cleaning up"),
            Ok(()) => {
                let signal = tokio::select! {
                    _ = term.recv() => "SIGTERM",
                    _ = int.recv() => "SIGINT",
                };
                say(format!("\n{signal}: cleaning up"));
            }
            Err(e) => {
                eprintln!("s3csi demo: {e}");
                code = 1;
            }
        }
        if let Err(e) = self.stop().await {
            eprintln!("s3csi demo: {e}");
            code = 1;
        }
        if code == 0 {
            say("s3csi demo: volume unpublished and deleted, everything stopped");
        }
        code
    }

    async fn start(&mut self) -> Result<(), DemoError> {
        let root = self.root.clone();
        // 1. The S3 server, with a bucket.
        let server = s3server::start(s3server::ServerConfig {
            listen: "127.0.0.1:0".parse().expect("a socket address"),
            dir: root.join("s3"),
            access_key: DEMO_ACCESS_KEY.into(),
            secret_key: DEMO_SECRET_KEY.into(),
        })
        .await?;
        server
            .store
            .create_bucket(DEMO_BUCKET)
            .map_err(DemoError::CreateBucket)?;
        let endpoint = server.endpoint();
        self.server = Some(server);
        say(format!(
            "s3csi demo: S3 server on {endpoint} (bucket {DEMO_BUCKET}, data in {})",
            root.join("s3").display()
        ));

        // 2. The CSI services, in this process, on a unix socket.
        let socket = root.join("csi").join("csi.sock");
        #[derive(Parser)]
        struct Wrap {
            #[command(flatten)]
            csi: crate::csi::CsiArgs,
        }
        let state_dir = root.join("state");
        let csi = Wrap::try_parse_from([
            "csi".to_string(),
            format!("--endpoint=unix://{}", socket.display()),
            "--node-id=demo-node".into(),
            "--mode=all".into(),
            format!("--state-dir={}", state_dir.display()),
            format!("--s3-endpoint-url={endpoint}"),
            "--s3-region=us-east-1".into(),
            "--s3-force-path-style".into(),
            "--unmount-timeout=10".into(),
        ])
        .map_err(DemoError::CsiOptions)?
        .csi;
        let (tx, rx) = tokio::sync::oneshot::channel::<()>();
        self.csi_stop = Some(tx);
        self.csi_task = Some(tokio::spawn(crate::csi::serve(csi, async {
            let _ = rx.await;
        })));
        let channel = self.connect(&socket).await?;
        self.channel = Some(channel.clone());
        say(format!(
            "s3csi demo: CSI services (identity, controller, node) on unix://{}",
            socket.display()
        ));

        // 3. What the external-provisioner does for a PVC: CreateVolume.
        let parameters = HashMap::from([
            (KEY_BUCKET.to_string(), DEMO_BUCKET.to_string()),
            (KEY_BASE_PREFIX.to_string(), BASE_PREFIX.to_string()),
            (KEY_ENDPOINT_URL.to_string(), endpoint.clone()),
            (KEY_REGION.to_string(), "us-east-1".to_string()),
            (KEY_FORCE_PATH_STYLE.to_string(), "true".to_string()),
        ]);
        let volume = ControllerClient::new(channel.clone())
            .create_volume(pb::CreateVolumeRequest {
                name: VOLUME_NAME.into(),
                volume_capabilities: vec![capability()],
                parameters,
                secrets: secrets(),
                ..Default::default()
            })
            .await
            .map_err(DemoError::CreateVolume)?
            .into_inner()
            .volume
            .ok_or(DemoError::NoVolume)?;
        say(format!(
            "s3csi demo: CreateVolume {VOLUME_NAME} -> volume id {}",
            volume.volume_id
        ));
        self.volume = Some(volume.clone());

        // 4. What kubelet does when a pod uses it: NodePublishVolume.
        let target = root
            .join("pods")
            .join("demo-pod")
            .join("volumes")
            .join("mount");
        std::fs::create_dir_all(target.parent().expect("has a parent"))
            .map_err(DemoError::PodDir)?;
        self.published = Some(target.clone());
        NodeClient::new(channel.clone())
            .node_publish_volume(pb::NodePublishVolumeRequest {
                volume_id: volume.volume_id.clone(),
                target_path: target.to_string_lossy().into_owned(),
                volume_capability: Some(capability()),
                volume_context: volume.volume_context.clone(),
                secrets: secrets(),
                ..Default::default()
            })
            .await
            .map_err(|status| DemoError::Publish {
                status,
                logs: state_dir.clone(),
            })?;

        // 5. Use it.
        let hello = target.join(HELLO);
        let path = hello.clone();
        tokio::task::spawn_blocking(move || -> std::io::Result<String> {
            std::fs::write(&path, HELLO_TEXT)?;
            std::fs::read_to_string(&path)
        })
        .await?
        .map_err(|source| DemoError::UseMount {
            target: target.clone(),
            source,
        })
        .and_then(|back| {
            if back == HELLO_TEXT {
                Ok(())
            } else {
                Err(DemoError::ReadBack {
                    back,
                    path: hello.clone(),
                })
            }
        })?;
        let key = format!(
            "{}{HELLO}",
            volume
                .volume_context
                .get("prefix")
                .map(String::as_str)
                .unwrap_or("")
        );
        say(format!(
            "s3csi demo: NodePublishVolume -> mounted at {}",
            target.display()
        ));
        say(format!(
            "s3csi demo: wrote and read back {} (object s3://{DEMO_BUCKET}/{key})",
            hello.display()
        ));
        say(format!(
            "\nTry it, from another terminal:\n  \
             ls -la {t}\n  \
             cat {t}/{HELLO}\n  \
             mkdir {t}/docs && cp /etc/hostname {t}/docs/\n\
             and look at the bucket with any S3 client (path-style, region us-east-1):\n  \
             AWS_ACCESS_KEY_ID={DEMO_ACCESS_KEY} AWS_SECRET_ACCESS_KEY={DEMO_SECRET_KEY} \\\n    \
             aws --endpoint-url {endpoint} s3 ls --recursive s3://{DEMO_BUCKET}/\n\n\
             Press Ctrl-C to unpublish and delete the volume and stop.",
            t = target.display()
        ));
        Ok(())
    }

    async fn connect(&self, socket: &Path) -> Result<Channel, DemoError> {
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            if let Some(task) = &self.csi_task {
                if task.is_finished() {
                    return Err(DemoError::CsiStoppedAtStart);
                }
            }
            if std::os::unix::net::UnixStream::connect(socket).is_ok() {
                let ep =
                    tonic::transport::Endpoint::from_shared(format!("unix://{}", socket.display()))
                        .map_err(DemoError::CsiEndpoint)?;
                match ep.connect().await {
                    Ok(c) => return Ok(c),
                    Err(source) if Instant::now() > deadline => {
                        return Err(DemoError::Connect {
                            socket: socket.to_path_buf(),
                            source,
                        })
                    }
                    Err(_) => {}
                }
            }
            if Instant::now() > deadline {
                return Err(DemoError::NoSocket(socket.to_path_buf()));
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Undoes whatever was started, in reverse order; reports the first failure.
    async fn stop(&mut self) -> Result<(), DemoError> {
        let mut first_error: Option<DemoError> = None;
        let mut fail = |e: DemoError| {
            eprintln!("s3csi demo: {e}");
            first_error.get_or_insert(e);
        };
        if let (Some(channel), Some(target), Some(volume)) =
            (&self.channel, self.published.take(), &self.volume)
        {
            match NodeClient::new(channel.clone())
                .node_unpublish_volume(pb::NodeUnpublishVolumeRequest {
                    volume_id: volume.volume_id.clone(),
                    target_path: target.to_string_lossy().into_owned(),
                })
                .await
            {
                Ok(_) => say(format!(
                    "s3csi demo: NodeUnpublishVolume {}",
                    target.display()
                )),
                Err(s) => fail(DemoError::Unpublish(s)),
            }
        }
        if let (Some(channel), Some(volume)) = (&self.channel, self.volume.take()) {
            match ControllerClient::new(channel.clone())
                .delete_volume(pb::DeleteVolumeRequest {
                    volume_id: volume.volume_id.clone(),
                    secrets: secrets(),
                })
                .await
            {
                Ok(_) => say(format!("s3csi demo: DeleteVolume {}", volume.volume_id)),
                Err(s) => fail(DemoError::DeleteVolume(s)),
            }
        }
        self.channel = None;
        if let Some(tx) = self.csi_stop.take() {
            let _ = tx.send(());
        }
        if let Some(task) = self.csi_task.take() {
            match tokio::time::timeout(Duration::from_secs(10), task).await {
                Ok(Ok(Ok(()))) => {}
                Ok(Ok(Err(e))) => fail(DemoError::CsiServices(e)),
                Ok(Err(e)) => fail(DemoError::CsiServicesTask(e)),
                Err(_) => fail(DemoError::CsiStopTimeout),
            }
        }
        if let Some(server) = self.server.take() {
            server.stop().await;
        }
        match first_error {
            None => Ok(()),
            Some(e) => Err(e),
        }
    }
}
