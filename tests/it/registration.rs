//! Built-in kubelet plugin registration (`s3csi csi --register-with-kubelet DIR`), called over
//! its unix socket as the kubelet's plugin watcher calls it: GetInfo, then NodeGetInfo on the
//! endpoint it names, then NotifyRegistrationStatus; also with the socket path as
//! `:authority`, as the kubelet of 1.20 sends it. The real kubelet does the same in tests/e2e.

use crate::common;
use common::node_service::{CsiServer, Mode};
use common::scratch_dir;
use s3csi::csi::pb;
use s3csi::csi::pb::node_client::NodeClient;
use s3csi::csi::registration::pb as reg;
use s3csi::csi::registration::pb::registration_client::RegistrationClient;
use std::path::Path;
use std::time::{Duration, Instant};
use tonic::transport::Channel;

async fn channel(socket: &Path) -> Channel {
    tonic::transport::Endpoint::from_shared(format!("unix://{}", socket.display()))
        .unwrap()
        .connect()
        .await
        .expect("connect")
}

fn wait_for_log(server: &CsiServer, text: &str) -> String {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let log = server.log_text();
        if log.contains(text) {
            return log;
        }
        assert!(Instant::now() < deadline, "no {text:?} in the log:\n{log}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_kubelet_registers_the_node_plugin() {
    let dir = scratch_dir("registration");
    let registry = dir.join("plugins_registry");
    std::fs::create_dir_all(&registry).unwrap();
    let server = CsiServer::options(dir.clone())
        .mode(Mode::Node)
        .flags(&["--register-with-kubelet", registry.to_str().unwrap()])
        .start();
    let reg_socket = registry.join("s3csi.dev-reg.sock");
    let deadline = Instant::now() + Duration::from_secs(10);
    while std::os::unix::net::UnixStream::connect(&reg_socket).is_err() {
        assert!(Instant::now() < deadline, "{}", server.log_text());
        std::thread::sleep(Duration::from_millis(20));
    }

    // GetInfo: the kubelet's view of the plugin. The endpoint defaults to --endpoint's path.
    let mut kubelet = RegistrationClient::new(channel(&reg_socket).await);
    let info = kubelet
        .get_info(reg::InfoRequest {})
        .await
        .unwrap()
        .into_inner();
    assert_eq!(info.r#type, "CSIPlugin");
    assert_eq!(info.name, "s3csi.dev");
    assert_eq!(info.endpoint, server.socket().to_string_lossy());
    assert_eq!(info.supported_versions, vec!["1.0.0".to_string()]);

    // The kubelet then asks the endpoint for the node's id.
    let mut node = NodeClient::new(channel(Path::new(&info.endpoint)).await);
    let node_info = node
        .node_get_info(pb::NodeGetInfoRequest {})
        .await
        .unwrap()
        .into_inner();
    assert_eq!(node_info.node_id, "test-node");

    // And tells the plugin the outcome, which it logs either way.
    kubelet
        .notify_registration_status(reg::RegistrationStatus {
            plugin_registered: false,
            error: "RegisterPlugin error -- no handler registered for plugin type".into(),
        })
        .await
        .unwrap();
    wait_for_log(&server, "no handler registered for plugin type");
    kubelet
        .notify_registration_status(reg::RegistrationStatus {
            plugin_registered: true,
            error: String::new(),
        })
        .await
        .unwrap();
    wait_for_log(&server, "registered with the kubelet");

    // The 1.20 kubelet's grpc-go sends the socket path as :authority.
    let s = reg_socket.clone();
    let answer = tokio::task::spawn_blocking(move || {
        let authority = s.to_string_lossy().to_string();
        crate::csi::raw_grpc_call(
            &s,
            "/pluginregistration.Registration/GetInfo",
            &authority,
            &[],
        )
    })
    .await
    .unwrap();
    let raw = <reg::PluginInfo as prost::Message>::decode(&answer[5..]).unwrap();
    assert_eq!(raw, info);

    // Stopping removes the registration socket: the kubelet unregisters the driver.
    drop(node);
    drop(kubelet);
    drop(server);
    assert!(
        !reg_socket.exists(),
        "the registration socket outlived the server"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_registration_names_the_node_path_of_the_socket() {
    let dir = scratch_dir("registration-path");
    let registry = dir.join("registry");
    let server = CsiServer::options(dir.clone())
        .mode(Mode::All)
        .flags(&[
            "--register-with-kubelet",
            registry.to_str().unwrap(),
            "--kubelet-registration-path",
            "/var/lib/kubelet/plugins/s3csi.dev/csi.sock",
        ])
        .start();
    let reg_socket = registry.join("s3csi.dev-reg.sock");
    let deadline = Instant::now() + Duration::from_secs(10);
    while std::os::unix::net::UnixStream::connect(&reg_socket).is_err() {
        assert!(Instant::now() < deadline, "{}", server.log_text());
        std::thread::sleep(Duration::from_millis(20));
    }
    let info = RegistrationClient::new(channel(&reg_socket).await)
        .get_info(reg::InfoRequest {})
        .await
        .unwrap()
        .into_inner();
    assert_eq!(info.endpoint, "/var/lib/kubelet/plugins/s3csi.dev/csi.sock");
}

#[test]
fn registration_needs_the_node_service() {
    let dir = scratch_dir("registration-controller");
    let options = CsiServer::options(dir.clone())
        .mode(Mode::Controller)
        .flags(&["--register-with-kubelet", dir.join("r").to_str().unwrap()]);
    let out = options.command().output().unwrap();
    assert!(!out.status.success());
    let log = std::fs::read_to_string(dir.join("server.log")).unwrap();
    assert!(
        log.contains("--register-with-kubelet needs the node service"),
        "{log}"
    );
}
