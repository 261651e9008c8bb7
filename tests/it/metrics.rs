//! `s3csi csi --metrics-address`: a real `s3csi csi` process, called over its unix socket with
//! the generated tonic clients as kubelet and the external-provisioner call it, and its
//! `/metrics` endpoint fetched over plain HTTP, as Prometheus scrapes it.

use crate::common;

use common::node_service::{publish_req, read, CsiServer, Mode, Options};
use common::{client, close_checked, is_mountpoint, new_bucket, runtime, s3csi_bin, scratch_dir};
use s3csi::csi::pb;
use std::collections::{BTreeMap, HashMap};
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;
use tonic::Code;

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// A running `s3csi csi --metrics-address 127.0.0.1:PORT` in a scratch dir.
struct Server {
    csi: CsiServer,
    metrics: u16,
}

/// The server's options: no default S3 endpoint, metrics on `addr`.
fn options(dir: PathBuf, mode: Mode, addr: &str) -> Options {
    CsiServer::options(dir)
        .mode(mode)
        .without_s3_flags()
        .metrics_address(addr)
}

impl Server {
    fn start(mode: Mode) -> Server {
        let dir = scratch_dir("metrics");
        let metrics = free_port();
        let csi = options(dir, mode, &format!("127.0.0.1:{metrics}")).start();
        Server { csi, metrics }
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
            .chain(name.strip_suffix("_bucket"))
            .find(|f| types.contains_key(*f))
            .unwrap_or_else(|| panic!("no # TYPE before {line}"));
        if family != name {
            // `_sum` and `_count` of a summary or a histogram, `_bucket{le}` of a histogram.
            if name.ends_with("_bucket") {
                assert_eq!(types[family], "histogram", "{line}");
                assert!(
                    labels.iter().any(|l| l.starts_with("le=\"")),
                    "a bucket without le: {line}"
                );
            } else {
                assert!(
                    ["summary", "histogram"].contains(&types[family].as_str()),
                    "{line}"
                );
            }
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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_count_csi_calls_and_mounts() {
    let server = Server::start(Mode::All);
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
    let mut id = server.csi.identity().await;
    for _ in 0..3 {
        id.probe(pb::ProbeRequest {}).await.unwrap();
    }
    id.get_plugin_info(pb::GetPluginInfoRequest {})
        .await
        .unwrap();
    let mut node = server.csi.node().await;
    node.node_get_capabilities(pb::NodeGetCapabilitiesRequest {})
        .await
        .unwrap();
    let pods = server.csi.dir().join("pods");
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
    let mut ctl = server.csi.controller().await;
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
        .unwrap_or_else(|e| panic!("publish: {e}\n{}", server.csi.log_text()));
    assert!(is_mountpoint(&target));
    let mounted = server.scrape();
    assert_eq!(mounted.get("s3csi_mounts"), Some(&1.0), "{mounted:?}");
    assert_eq!(requests(&mounted, "NodePublishVolume", "OK"), 1.0);
    assert_eq!(mounted.get("s3csi_mounters"), Some(&1.0), "{mounted:?}");
    assert_eq!(mounted.get("s3csi_published_targets"), Some(&1.0));
    // A second pod of the volume: one more target, the same mounter.
    let second = server.csi.target("m2");
    node.node_publish_volume(publish_req(&bucket, &second))
        .await
        .unwrap();
    let shared = server.scrape();
    assert_eq!(shared.get("s3csi_mounters"), Some(&1.0), "{shared:?}");
    assert_eq!(shared.get("s3csi_published_targets"), Some(&2.0));
    node.node_unpublish_volume(pb::NodeUnpublishVolumeRequest {
        volume_id: bucket.clone(),
        target_path: second.to_string_lossy().to_string(),
    })
    .await
    .unwrap();
    node.node_unpublish_volume(pb::NodeUnpublishVolumeRequest {
        volume_id: bucket.clone(),
        target_path: target.to_string_lossy().to_string(),
    })
    .await
    .unwrap();
    assert!(!is_mountpoint(&target));
    let unmounted = server.scrape();
    assert_eq!(unmounted.get("s3csi_mounts"), Some(&0.0));
    assert_eq!(requests(&unmounted, "NodeUnpublishVolume", "OK"), 2.0);
    assert_eq!(unmounted.get("s3csi_mounters"), Some(&0.0));
    assert_eq!(unmounted.get("s3csi_published_targets"), Some(&0.0));
    assert_eq!(
        unmounted.get("s3csi_mounter_replacements_total"),
        Some(&0.0)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_endpoint_serves_only_metrics() {
    let server = Server::start(Mode::Controller);
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
    let mut ctl = server.csi.controller().await;
    ctl.controller_get_capabilities(pb::ControllerGetCapabilitiesRequest {})
        .await
        .unwrap();
    let mut node = server.csi.node().await;
    let err = node
        .node_get_info(pb::NodeGetInfoRequest {})
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::Unimplemented);
    let samples = server.scrape();
    assert!(!samples.contains_key("s3csi_mounts"), "{samples:?}");
    assert!(!samples.contains_key("s3csi_mounter_replacements_total"));
    assert!(!samples.contains_key("s3csi_mounter_scrape_errors_total"));
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
    let status = options(dir.clone(), Mode::Controller, &addr)
        .log_name("taken.log")
        .command()
        .status()
        .unwrap();
    assert!(!status.success());
    let text = read(&dir.join("taken.log"));
    assert!(
        text.contains(&format!("--metrics-address {addr}: cannot listen")),
        "{text}"
    );
    assert!(!dir.join("plugin").join("csi.sock").exists());
}

/// The samples of family `name` whose labels include every one of `labels` (`key="value"`).
fn matching<'a>(
    samples: &'a BTreeMap<String, f64>,
    name: &str,
    labels: &[&str],
) -> Vec<(&'a String, f64)> {
    samples
        .iter()
        .filter(|(k, _)| {
            k.strip_prefix(name)
                .and_then(|rest| rest.strip_prefix('{'))
                .is_some_and(|rest| {
                    let rest = rest.trim_end_matches('}');
                    labels
                        .iter()
                        .all(|l| rest.split(',').any(|have| have == *l))
                })
        })
        .map(|(k, v)| (k, *v))
        .collect()
}

fn sum(samples: &BTreeMap<String, f64>, name: &str, labels: &[&str]) -> f64 {
    matching(samples, name, labels).iter().map(|(_, v)| v).sum()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_include_each_mounters_s3_requests_by_volume() {
    use s3csi::s3::ObjectClient;
    let server = Server::start(Mode::Node);
    let bucket = new_bucket("mounter-metrics");
    // An object written straight to S3: reading it through the mount must GET it.
    const READ_LEN: usize = 200_000;
    let seed: Vec<u8> = (0..READ_LEN).map(|i| (i % 251) as u8).collect();
    // On a thread of its own: the helpers block on their own runtime.
    let (b, body) = (bucket.clone(), seed.clone());
    std::thread::spawn(move || runtime().block_on(client(&b).put_object("seeded", body.into())))
        .join()
        .unwrap()
        .unwrap();

    let target = server.csi.dir().join("pods").join("mount");
    std::fs::create_dir_all(&target).unwrap();
    let mut node = server.csi.node().await;
    node.node_publish_volume(publish_req(&bucket, &target))
        .await
        .unwrap_or_else(|e| panic!("publish: {e}\n{}", server.csi.log_text()));
    let volume = format!("volume_id=\"{bucket}\"");

    const WRITE_LEN: usize = 300_000;
    let mut f = std::fs::File::create(target.join("written")).unwrap();
    f.write_all(&vec![7u8; WRITE_LEN]).unwrap();
    close_checked(f).unwrap();
    assert_eq!(std::fs::read(target.join("seeded")).unwrap(), seed);
    // One file held open across the scrape.
    let held = std::fs::File::open(target.join("seeded")).unwrap();

    let started = std::time::Instant::now();
    let samples = server.scrape();
    let scrape_time = started.elapsed();
    assert!(scrape_time < Duration::from_secs(2), "{scrape_time:?}");
    let put_ok = sum(
        &samples,
        "s3csi_s3_requests_total",
        &[&volume, "operation=\"PutObject\"", "outcome=\"ok\""],
    );
    let get_ok = sum(
        &samples,
        "s3csi_s3_requests_total",
        &[&volume, "operation=\"GetObject\"", "outcome=\"ok\""],
    );
    assert!(put_ok >= 1.0 && get_ok >= 1.0, "{samples:#?}");
    let written = samples[&format!("s3csi_s3_bytes_total{{{volume},direction=\"written\"}}")];
    let read_bytes = samples[&format!("s3csi_s3_bytes_total{{{volume},direction=\"read\"}}")];
    assert!(
        (WRITE_LEN as f64..=2.0 * WRITE_LEN as f64).contains(&written),
        "{written}"
    );
    // The seeded object at least once; prefetch and the mounter's own reads stay well under
    // a few times both files.
    assert!(
        (READ_LEN as f64..=3.0 * (READ_LEN + WRITE_LEN) as f64).contains(&read_bytes),
        "{read_bytes}"
    );
    assert_eq!(
        samples.get(&format!("s3csi_open_file_handles{{{volume}}}")),
        Some(&1.0),
        "{samples:#?}"
    );
    // The latency histogram counts what the counter counts.
    let get_count = samples
        [&format!("s3csi_s3_request_duration_seconds_count{{{volume},operation=\"GetObject\"}}")];
    let get_all = sum(
        &samples,
        "s3csi_s3_requests_total",
        &[&volume, "operation=\"GetObject\""],
    );
    assert_eq!(get_count, get_all);
    let get_inf = samples[&format!(
        "s3csi_s3_request_duration_seconds_bucket{{{volume},operation=\"GetObject\",le=\"+Inf\"}}"
    )];
    assert_eq!(get_inf, get_count);
    // Every mounter sample names its volume.
    for key in samples.keys().filter(|k| k.starts_with("s3csi_s3_")) {
        assert!(key.contains(&volume), "{key}");
    }
    assert_eq!(
        samples.get("s3csi_mounter_scrape_errors_total"),
        Some(&0.0),
        "{samples:#?}"
    );
    drop(held);

    node.node_unpublish_volume(pb::NodeUnpublishVolumeRequest {
        volume_id: bucket.clone(),
        target_path: target.to_string_lossy().to_string(),
    })
    .await
    .unwrap();
    let unmounted = server.scrape();
    assert!(
        !unmounted.keys().any(|k| k.starts_with("s3csi_s3_")),
        "{unmounted:#?}"
    );
    assert_eq!(
        unmounted.get("s3csi_mounter_scrape_errors_total"),
        Some(&0.0)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_mounter_that_does_not_answer_is_skipped_and_counted() {
    let server = Server::start(Mode::Node);
    let bucket = new_bucket("stuck-mounter");
    let target = server.csi.dir().join("pods").join("mount");
    std::fs::create_dir_all(&target).unwrap();
    let mut node = server.csi.node().await;
    node.node_publish_volume(publish_req(&bucket, &target))
        .await
        .unwrap_or_else(|e| panic!("publish: {e}\n{}", server.csi.log_text()));
    std::fs::write(target.join("f"), b"x").unwrap();
    let pid = server.csi.mounter_pid();
    // First the mounter answers scrapes: on a loaded machine its control socket was not
    // listening yet when the file was written, and the scrape failed at once.
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    let errors_before = loop {
        let samples = server.scrape();
        if samples.keys().any(|k| k.starts_with("s3csi_s3_")) {
            break samples["s3csi_mounter_scrape_errors_total"];
        }
        assert!(std::time::Instant::now() < deadline, "{samples:#?}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    // A stopped mounter: its control socket accepts (the kernel queues the connection) but
    // nobody answers. The scrape must not wait for it longer than the per-mounter timeout.
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(pid as i32),
        nix::sys::signal::Signal::SIGSTOP,
    )
    .unwrap();
    let started = std::time::Instant::now();
    let samples = server.scrape();
    let scrape_time = started.elapsed();
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(pid as i32),
        nix::sys::signal::Signal::SIGCONT,
    )
    .unwrap();
    assert!(
        scrape_time >= Duration::from_millis(1900) && scrape_time < Duration::from_secs(5),
        "{scrape_time:?} (scrape errors {:?}, before {errors_before})",
        samples.get("s3csi_mounter_scrape_errors_total")
    );
    assert_eq!(
        samples.get("s3csi_mounter_scrape_errors_total"),
        Some(&(errors_before + 1.0)),
        "{samples:#?}"
    );
    assert!(!samples.keys().any(|k| k.starts_with("s3csi_s3_")));
    // Our own metrics are all there.
    assert_eq!(samples.get("s3csi_mounts"), Some(&1.0));
    // Running again, it answers again.
    let samples = server.scrape();
    assert!(
        sum(
            &samples,
            "s3csi_s3_requests_total",
            &[&format!("volume_id=\"{bucket}\"")]
        ) > 0.0,
        "{samples:#?}"
    );
    node.node_unpublish_volume(pb::NodeUnpublishVolumeRequest {
        volume_id: bucket.clone(),
        target_path: target.to_string_lossy().to_string(),
    })
    .await
    .unwrap();
}
