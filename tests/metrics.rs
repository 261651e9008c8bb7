//! `s3csi csi --metrics-address`: a real `s3csi csi` process, called over its unix socket with
//! the generated tonic clients as kubelet and the external-provisioner call it, and its
//! `/metrics` endpoint fetched over plain HTTP, as Prometheus scrapes it.

mod common;

use common::{is_mountpoint, new_bucket, s3, s3csi_bin, scratch_dir};
use s3csi::csi::pb::controller_client::ControllerClient;
use s3csi::csi::pb::identity_client::IdentityClient;
use s3csi::csi::pb::node_client::NodeClient;
use s3csi::csi::pb::{self, volume_capability as vc};
use std::collections::{BTreeMap, HashMap};
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};
use tonic::transport::Channel;
use tonic::Code;

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

fn read(p: &Path) -> String {
    std::fs::read_to_string(p).unwrap_or_default()
}

/// A running `s3csi csi --metrics-address 127.0.0.1:PORT` in a scratch dir.
struct Server {
    child: Option<Child>,
    dir: PathBuf,
    socket: PathBuf,
    log: PathBuf,
    metrics: u16,
}

impl Server {
    fn start(mode: &str) -> Server {
        common::set_test_env();
        let dir = scratch_dir("metrics");
        let socket = dir.join("plugin").join("csi.sock");
        let log = dir.join("server.log");
        let metrics = free_port();
        let child = csi_command(&dir, mode, &format!("127.0.0.1:{metrics}"), &log)
            .spawn()
            .expect("start s3csi csi");
        let deadline = Instant::now() + Duration::from_secs(20);
        while std::os::unix::net::UnixStream::connect(&socket).is_err() {
            assert!(
                Instant::now() < deadline,
                "csi server did not start: {}",
                read(&log)
            );
            std::thread::sleep(Duration::from_millis(50));
        }
        Server {
            child: Some(child),
            dir,
            socket,
            log,
            metrics,
        }
    }

    async fn channel(&self) -> Channel {
        tonic::transport::Endpoint::from_shared(format!("unix://{}", self.socket.display()))
            .unwrap()
            .connect()
            .await
            .expect("connect to the csi socket")
    }

    /// GET `path` on the metrics port: (status, content type, body).
    fn get(&self, path: &str) -> (u16, String, String) {
        http_get(self.metrics, "GET", path)
    }

    /// `/metrics`, checked to be valid text format, as {sample with labels: value}.
    fn scrape(&self) -> BTreeMap<String, f64> {
        let (status, content_type, body) = self.get("/metrics");
        assert_eq!(status, 200, "{body}");
        assert_eq!(content_type, "text/plain; version=0.0.4; charset=utf-8");
        parse_text_format(&body)
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            unsafe {
                libc::kill(c.id() as i32, libc::SIGTERM);
            }
            let deadline = Instant::now() + Duration::from_secs(10);
            while c.try_wait().ok().flatten().is_none() && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(20));
            }
            let _ = c.kill();
            let _ = c.wait();
        }
        // Leftovers of a failed test: detach mounts under our dir.
        let prefix = self.dir.to_string_lossy().to_string();
        for line in read(Path::new("/proc/self/mountinfo")).lines() {
            if let Some(mp) = line.split(' ').nth(4) {
                if mp.starts_with(&prefix) {
                    let _ = Command::new("umount").arg("-l").arg(mp).status();
                }
            }
        }
    }
}

fn csi_command(dir: &Path, mode: &str, metrics: &str, log: &Path) -> Command {
    let logf = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(log)
        .unwrap();
    let mut cmd = Command::new(s3csi_bin());
    cmd.arg("csi")
        .args([
            "--endpoint",
            &format!("unix://{}", dir.join("plugin").join("csi.sock").display()),
        ])
        .args(["--node-id", "test-node", "--mode", mode])
        .arg("--state-dir")
        .arg(dir.join("state"))
        .args(["--metrics-address", metrics])
        .args(["--unmount-timeout", "10"])
        .stdout(Stdio::null())
        .stderr(logf);
    cmd
}

/// A plain HTTP/1.1 request over a fresh connection: (status, content type, body).
fn http_get(port: u16, method: &str, path: &str) -> (u16, String, String) {
    let mut stream = std::net::TcpStream::connect(("127.0.0.1", port)).expect("connect metrics");
    stream
        .set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    write!(
        stream,
        "{method} {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nConnection: close\r\n\r\n"
    )
    .unwrap();
    let mut raw = String::new();
    stream.read_to_string(&mut raw).expect("read the response");
    let (head, body) = raw.split_once("\r\n\r\n").expect("an HTTP response");
    let mut lines = head.lines();
    let status = lines
        .next()
        .and_then(|l| l.split(' ').nth(1))
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("bad status line: {head}"));
    let content_type = lines
        .filter_map(|l| l.split_once(':'))
        .find(|(k, _)| k.eq_ignore_ascii_case("content-type"))
        .map(|(_, v)| v.trim().to_string())
        .unwrap_or_default();
    (status, content_type, body.to_string())
}

/// Parses the Prometheus text format (0.0.4) strictly enough to catch what a scraper would
/// reject: every sample is `name{label="value",...} number`, belongs to a family declared by
/// a `# TYPE` line before it, and appears once. Returns {`name{labels}`: value}.
fn parse_text_format(text: &str) -> BTreeMap<String, f64> {
    fn is_name(s: &str, colon: bool) -> bool {
        let mut chars = s.chars();
        chars
            .next()
            .is_some_and(|c| c.is_ascii_alphabetic() || c == '_' || (colon && c == ':'))
            && chars.all(|c| c.is_ascii_alphanumeric() || c == '_' || (colon && c == ':'))
    }
    assert!(
        text.ends_with('\n'),
        "the exposition must end with a newline"
    );
    let mut types: HashMap<String, String> = HashMap::new();
    let mut samples = BTreeMap::new();
    for line in text.lines() {
        if let Some(rest) = line.strip_prefix("# TYPE ") {
            let (name, kind) = rest.split_once(' ').expect(line);
            assert!(is_name(name, true), "{line}");
            assert!(
                ["counter", "gauge", "summary", "histogram", "untyped"].contains(&kind),
                "{line}"
            );
            assert!(
                types.insert(name.to_string(), kind.to_string()).is_none(),
                "TYPE twice: {line}"
            );
            continue;
        }
        if let Some(rest) = line.strip_prefix("# HELP ") {
            assert!(is_name(rest.split(' ').next().unwrap(), true), "{line}");
            continue;
        }
        assert!(
            !line.starts_with('#') && !line.trim().is_empty(),
            "{line:?}"
        );
        // name, then optional {labels}, then one space and the value.
        let name_end = line.find(['{', ' ']).expect(line);
        let name = &line[..name_end];
        assert!(is_name(name, true), "bad metric name in {line}");
        let mut rest = &line[name_end..];
        let mut labels = Vec::new();
        if let Some(inner) = rest.strip_prefix('{') {
            let mut chars = inner.char_indices();
            let mut key = String::new();
            loop {
                let (i, c) = chars.next().expect(line);
                if c == '}' && key.is_empty() {
                    rest = &inner[i + 1..];
                    break;
                }
                if c == '=' {
                    assert!(is_name(&key, false), "bad label name in {line}");
                    assert_eq!(chars.next().map(|(_, c)| c), Some('"'), "{line}");
                    let mut value = String::new();
                    loop {
                        match chars.next().expect(line).1 {
                            '"' => break,
                            '\\' => match chars.next().expect(line).1 {
                                'n' => value.push('\n'),
                                c @ ('\\' | '"') => value.push(c),
                                c => panic!("bad escape \\{c} in {line}"),
                            },
                            c => value.push(c),
                        }
                    }
                    labels.push(format!("{key}=\"{value}\""));
                    key.clear();
                    match chars.next().expect(line) {
                        (_, ',') => {}
                        (i, '}') => {
                            rest = &inner[i + 1..];
                            break;
                        }
                        (_, c) => panic!("unexpected {c:?} in {line}"),
                    }
                } else {
                    key.push(c);
                }
            }
        }
        let value = rest.strip_prefix(' ').expect(line);
        let value: f64 = value
            .parse()
            .unwrap_or_else(|_| panic!("bad value in {line}"));
        let family = [name, name.strip_suffix("_sum").unwrap_or(name)]
            .into_iter()
            .chain(name.strip_suffix("_count"))
            .find(|f| types.contains_key(*f))
            .unwrap_or_else(|| panic!("no # TYPE before {line}"));
        if family != name {
            assert_eq!(types[family], "summary", "{line}");
        }
        let key = if labels.is_empty() {
            name.to_string()
        } else {
            format!("{name}{{{}}}", labels.join(","))
        };
        assert!(samples.insert(key, value).is_none(), "sample twice: {line}");
    }
    samples
}

fn requests(samples: &BTreeMap<String, f64>, method: &str, code: &str) -> f64 {
    samples
        .get(&format!(
            "s3csi_grpc_requests_total{{method=\"{method}\",code=\"{code}\"}}"
        ))
        .copied()
        .unwrap_or(0.0)
}

fn publish_req(bucket: &str, target: &Path) -> pb::NodePublishVolumeRequest {
    pb::NodePublishVolumeRequest {
        volume_id: bucket.to_string(),
        target_path: target.to_string_lossy().to_string(),
        volume_capability: Some(pb::VolumeCapability {
            access_type: Some(vc::AccessType::Mount(vc::MountVolume::default())),
            access_mode: Some(vc::AccessMode {
                mode: vc::access_mode::Mode::MultiNodeMultiWriter as i32,
            }),
        }),
        volume_context: HashMap::from([
            ("endpointUrl".to_string(), s3().endpoint.clone()),
            ("region".to_string(), "us-east-1".to_string()),
            ("forcePathStyle".to_string(), "true".to_string()),
        ]),
        ..Default::default()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_count_csi_calls_and_mounts() {
    let server = Server::start("all");
    let version = env!("CARGO_PKG_VERSION");

    // Before any call: build info, no mounts, no calls.
    let before = server.scrape();
    assert_eq!(
        before.get(&format!("s3csi_build_info{{version=\"{version}\"}}")),
        Some(&1.0),
        "{before:?}"
    );
    assert_eq!(before.get("s3csi_mounts"), Some(&0.0), "{before:?}");
    assert_eq!(
        before.get("s3csi_mounter_replacements_total"),
        Some(&0.0),
        "{before:?}"
    );
    assert!(
        !before.keys().any(|k| k.starts_with("s3csi_grpc_")),
        "{before:?}"
    );

    // Identity, node and controller calls, as kubelet, the registrar, the livenessprobe and
    // the provisioner make them.
    let mut id = IdentityClient::new(server.channel().await);
    for _ in 0..3 {
        id.probe(pb::ProbeRequest {}).await.unwrap();
    }
    id.get_plugin_info(pb::GetPluginInfoRequest {})
        .await
        .unwrap();
    let mut node = NodeClient::new(server.channel().await);
    node.node_get_capabilities(pb::NodeGetCapabilitiesRequest {})
        .await
        .unwrap();
    let pods = server.dir.join("pods");
    std::fs::create_dir_all(&pods).unwrap();
    let target = pods.join("mount");
    let mut bad = publish_req("some-bucket", &target);
    bad.volume_capability = None;
    let err = node.node_publish_volume(bad).await.unwrap_err();
    assert_eq!(err.code(), Code::InvalidArgument);
    let err = node
        .node_publish_volume(publish_req("some-bucket", Path::new("relative/x")))
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::InvalidArgument);
    let mut ctl = ControllerClient::new(server.channel().await);
    ctl.controller_get_capabilities(pb::ControllerGetCapabilitiesRequest {})
        .await
        .unwrap();
    let err = ctl
        .list_volumes(pb::ListVolumesRequest::default())
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::Unimplemented);

    let after = server.scrape();
    assert_eq!(requests(&after, "Probe", "OK"), 3.0, "{after:?}");
    assert_eq!(requests(&after, "GetPluginInfo", "OK"), 1.0);
    assert_eq!(requests(&after, "NodeGetCapabilities", "OK"), 1.0);
    assert_eq!(
        requests(&after, "NodePublishVolume", "InvalidArgument"),
        2.0
    );
    assert_eq!(requests(&after, "NodePublishVolume", "OK"), 0.0);
    assert_eq!(requests(&after, "ControllerGetCapabilities", "OK"), 1.0);
    assert_eq!(requests(&after, "ListVolumes", "Unimplemented"), 1.0);
    assert_eq!(
        after.get("s3csi_grpc_request_duration_seconds_count{method=\"Probe\"}"),
        Some(&3.0)
    );
    assert_eq!(
        after.get("s3csi_grpc_request_duration_seconds_count{method=\"NodePublishVolume\"}"),
        Some(&2.0)
    );
    let sum = after["s3csi_grpc_request_duration_seconds_sum{method=\"Probe\"}"];
    assert!(sum > 0.0 && sum < 10.0, "{sum}");
    // Every call is counted once, under its own method.
    let total: f64 = after
        .iter()
        .filter(|(k, _)| k.starts_with("s3csi_grpc_requests_total{"))
        .map(|(_, v)| v)
        .sum();
    assert_eq!(total, 9.0, "{after:?}");

    // A real mount moves the gauge; unpublishing brings it back.
    let bucket = new_bucket("metrics");
    node.node_publish_volume(publish_req(&bucket, &target))
        .await
        .unwrap_or_else(|e| panic!("publish: {e}\n{}", read(&server.log)));
    assert!(is_mountpoint(&target));
    let mounted = server.scrape();
    assert_eq!(mounted.get("s3csi_mounts"), Some(&1.0), "{mounted:?}");
    assert_eq!(requests(&mounted, "NodePublishVolume", "OK"), 1.0);
    node.node_unpublish_volume(pb::NodeUnpublishVolumeRequest {
        volume_id: bucket.clone(),
        target_path: target.to_string_lossy().to_string(),
    })
    .await
    .unwrap();
    assert!(!is_mountpoint(&target));
    let unmounted = server.scrape();
    assert_eq!(unmounted.get("s3csi_mounts"), Some(&0.0));
    assert_eq!(requests(&unmounted, "NodeUnpublishVolume", "OK"), 1.0);
    assert_eq!(
        unmounted.get("s3csi_mounter_replacements_total"),
        Some(&0.0)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_endpoint_serves_only_metrics() {
    let server = Server::start("controller");
    let (status, _, _) = server.get("/");
    assert_eq!(status, 404);
    let (status, _, _) = server.get("/metricsx");
    assert_eq!(status, 404);
    assert_eq!(http_get(server.metrics, "POST", "/metrics").0, 405);
    // HEAD answers like GET, without a body.
    let (status, content_type, body) = http_get(server.metrics, "HEAD", "/metrics");
    assert_eq!((status, body.as_str()), (200, ""));
    assert!(content_type.starts_with("text/plain; version=0.0.4"));

    // The controller has no node metrics, but counts its calls.
    let mut ctl = ControllerClient::new(server.channel().await);
    ctl.controller_get_capabilities(pb::ControllerGetCapabilitiesRequest {})
        .await
        .unwrap();
    let err = NodeClient::new(server.channel().await)
        .node_get_info(pb::NodeGetInfoRequest {})
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::Unimplemented);
    let samples = server.scrape();
    assert!(!samples.contains_key("s3csi_mounts"), "{samples:?}");
    assert!(!samples.contains_key("s3csi_mounter_replacements_total"));
    assert_eq!(requests(&samples, "ControllerGetCapabilities", "OK"), 1.0);
    // A service this process does not serve is not counted as one of its methods.
    assert_eq!(requests(&samples, "NodeGetInfo", "Unimplemented"), 0.0);
}

#[test]
fn bad_metrics_address_fails_at_start() {
    let dir = scratch_dir("metrics-bad");
    for bad in ["localhost", "9809", "1.2.3.4:x", ":99999"] {
        let out = Command::new(s3csi_bin())
            .args(["csi", "--mode", "controller", "--metrics-address", bad])
            .arg("--endpoint")
            .arg(dir.join("csi.sock"))
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{bad}: {stderr}");
        assert!(
            stderr.contains("--metrics-address") && stderr.contains("HOST:PORT"),
            "{bad}: {stderr}"
        );
    }
    // A port in use: the process exits with the reason, and serves no CSI socket.
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = taken.local_addr().unwrap().to_string();
    let log = dir.join("taken.log");
    let status = csi_command(&dir, "controller", &addr, &log)
        .status()
        .unwrap();
    assert!(!status.success());
    let text = read(&log);
    assert!(
        text.contains(&format!("--metrics-address {addr}: cannot listen")),
        "{text}"
    );
    assert!(!dir.join("plugin").join("csi.sock").exists());
}
