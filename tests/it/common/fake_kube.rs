//! A fake Kubernetes API server, with a fake scheduler and a fake kubelet behind it, for
//! the node service's pod mode: the part of the core/v1 API that mode uses (get a Node;
//! create, get, list by label, delete Pods and Secrets; list Events by field selector;
//! get the ServiceAccounts a test put in, for `authenticationSource: pod`),
//! over plain HTTP on 127.0.0.1, reached through a kubeconfig file as any client would.
//!
//! What a real cluster would do with a created Pod, the fakes do on this machine, and they
//! report it as a real cluster does: in the Pod's `status` (phase, conditions,
//! `containerStatuses[].state`) and in core/v1 Events about it.
//! - The scheduler binds the Pod to the node (`spec.nodeName`, Event `Scheduled`) if its
//!   node affinity names the node and its resource requests fit the node's allocatable
//!   minus what the Pods already bound there request; otherwise the Pod stays Pending with
//!   condition `PodScheduled=False, reason Unschedulable` and Events `FailedScheduling`.
//!   It tries again at every read, as the real one does when the cluster changes.
//! - The kubelet creates the sandbox (fails with `FailedCreatePodSandBox` Events while
//!   [`FakeKube::break_sandboxes`] is in force, as with a broken CNI plugin), mounts the
//!   hostPath volumes (`FailedMount` if one is not a directory), gets the image from the
//!   node's store or the fake registry, which hold [`TEST_IMAGE`] only (`ErrImageNeverPull`,
//!   `ErrImagePull` then `ImagePullBackOff`, as kubelet reports them), builds the
//!   environment from literal values and `secretKeyRef`s only (nothing inherited, so
//!   credentials must come through the Secret; a missing one is
//!   `CreateContainerConfigError`), and runs the Pod's only container as a process — its
//!   command mapped to the s3csi binary under test, its arguments as given. A container
//!   that exits is `terminated` (exit code, 128+signal when killed) in a Failed or
//!   Succeeded Pod (`restartPolicy: Never`).
//! - Deleting the Pod sends SIGTERM (SIGKILL with a zero grace period); its Events stay,
//!   as they do for an hour in a real cluster.
//!
//! Every request is recorded for the test to check.

use k8s_openapi::jiff::Timestamp;
use serde_json::{json, Value};
use std::collections::{BTreeMap, BTreeSet};
use std::convert::Infallible;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// The mounter image the tests use: in the fake registry, and already on the node.
pub const TEST_IMAGE: &str = "registry.example/s3csi:test";
/// What the fake node can give its Pods.
pub const NODE_ALLOCATABLE: [(&str, &str); 3] = [("cpu", "2"), ("memory", "8Gi"), ("pods", "110")];
/// How long the fake kubelet waits before it retries a failed step (and says so again).
const KUBELET_RETRY: Duration = Duration::from_millis(1000);

#[derive(Debug, Clone)]
pub struct Request {
    pub method: String,
    /// Path and query.
    pub uri: String,
    pub body: Value,
}

/// Where a Pod created through the API is in its life.
#[derive(Debug, Clone)]
enum Stage {
    Unscheduled,
    /// Bound to the node: sandbox, volumes, image, container next.
    Scheduled,
    /// Pulling its image from the registry (which does not answer while pulls stall).
    Pulling,
    /// The pull failed at this instant; `ImagePullBackOff` after a retry interval.
    PullFailed(Instant, String),
    /// The image is on the node.
    Pulled,
    Running,
    /// Its container ended; the Pod stays Failed or Succeeded.
    Done,
}

#[derive(Default)]
struct State {
    pods: BTreeMap<String, Value>,
    secrets: BTreeMap<String, Value>,
    /// By `namespace/name`.
    service_accounts: BTreeMap<String, Value>,
    events: Vec<Value>,
    stages: BTreeMap<String, Stage>,
    processes: BTreeMap<String, Child>,
    requests: Vec<Request>,
    next_uid: u64,
    /// Why sandboxes cannot be created (the CNI plugin is broken), while it is so.
    sandbox_error: Option<String>,
    /// The registry does not answer: pulls never end.
    stall_pulls: bool,
    registry: BTreeSet<String>,
    node_images: BTreeSet<String>,
}

impl State {
    fn uid(&mut self) -> String {
        self.next_uid += 1;
        format!("uid-{}", self.next_uid)
    }
}

fn now_time() -> String {
    Timestamp::now().strftime("%Y-%m-%dT%H:%M:%SZ").to_string()
}

/// Within the fake kubelet's retry interval from now.
fn recent(t: Timestamp) -> bool {
    Timestamp::now().duration_since(t).as_millis() < KUBELET_RETRY.as_millis() as i128
}

fn now_micro_time() -> String {
    Timestamp::now()
        .strftime("%Y-%m-%dT%H:%M:%S%.6fZ")
        .to_string()
}

/// A Kubernetes quantity ("50m", "64Mi", "1Gi", "2") as a number.
fn quantity(q: &str) -> Option<f64> {
    const SUFFIXES: [(&str, f64); 13] = [
        ("Ki", 1024.0),
        ("Mi", 1048576.0),
        ("Gi", 1073741824.0),
        ("Ti", 1099511627776.0),
        ("Pi", 1125899906842624.0),
        ("Ei", 1152921504606846976.0),
        ("n", 1e-9),
        ("u", 1e-6),
        ("m", 1e-3),
        ("k", 1e3),
        ("M", 1e6),
        ("G", 1e9),
        ("T", 1e12),
    ];
    for (suffix, factor) in SUFFIXES {
        if let Some(n) = q.strip_suffix(suffix) {
            return n.parse::<f64>().ok().map(|n| n * factor);
        }
    }
    q.parse().ok()
}

/// What a Pod requests of `resource` (API defaulting: the limit when no request is given).
fn request_of(pod: &Value, resource: &str) -> f64 {
    pod["spec"]["containers"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|c| {
            let r = &c["resources"];
            r["requests"][resource]
                .as_str()
                .or(r["limits"][resource].as_str())
                .and_then(quantity)
                .unwrap_or(0.0)
        })
        .sum()
}

fn condition(kind: &str, ok: bool, reason: Option<&str>, message: Option<&str>, at: &str) -> Value {
    let mut c = json!({"type": kind, "status": if ok { "True" } else { "False" },
                       "lastProbeTime": null, "lastTransitionTime": at});
    if let Some(r) = reason {
        c["reason"] = json!(r);
    }
    if let Some(m) = message {
        c["message"] = json!(m);
    }
    c
}

pub struct FakeKube {
    pub addr: SocketAddr,
    pub kubeconfig: PathBuf,
    pub node: String,
    pub node_uid: String,
    state: Arc<Mutex<State>>,
    bin: PathBuf,
    logs: PathBuf,
}

fn status(code: u16, reason: &str, message: &str) -> (u16, Value) {
    (
        code,
        json!({"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
               "message": message, "reason": reason, "code": code}),
    )
}

fn matches_selector(obj: &Value, selector: &str) -> bool {
    selector.split(',').filter(|s| !s.is_empty()).all(|term| {
        let Some((k, v)) = term.split_once('=') else {
            return false;
        };
        obj["metadata"]["labels"][k].as_str() == Some(v)
    })
}

fn query_param(query: &str, key: &str) -> Option<String> {
    query.split('&').find_map(|kv| {
        let (k, v) = kv.split_once('=')?;
        (k == key).then(|| percent_decode(v))
    })
}

fn percent_decode(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::new();
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'%' && i + 2 < b.len() {
            if let Ok(n) = u8::from_str_radix(&s[i + 1..i + 3], 16) {
                out.push(n);
                i += 3;
                continue;
            }
        }
        out.push(if b[i] == b'+' { b' ' } else { b[i] });
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

impl FakeKube {
    /// Starts the server; `dir` holds the kubeconfig and the fake kubelet's container logs.
    pub fn start(dir: &Path, node: &str, bin: PathBuf) -> FakeKube {
        let std_listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        std_listener.set_nonblocking(true).unwrap();
        let addr = std_listener.local_addr().unwrap();
        let state = Arc::new(Mutex::new(State {
            registry: BTreeSet::from([TEST_IMAGE.to_string()]),
            node_images: BTreeSet::from([TEST_IMAGE.to_string()]),
            ..State::default()
        }));
        let logs = dir.join("kubelet-logs");
        std::fs::create_dir_all(&logs).unwrap();
        let kubeconfig = dir.join("kubeconfig");
        std::fs::write(
            &kubeconfig,
            format!(
                "apiVersion: v1\nkind: Config\nclusters:\n- name: fake\n  cluster:\n    server: http://{addr}\n\
                 users:\n- name: node\n  user:\n    token: fake-token\ncontexts:\n- name: fake\n  context:\n    cluster: fake\n    user: node\n\
                 current-context: fake\n"
            ),
        )
        .unwrap();
        let fake = FakeKube {
            addr,
            kubeconfig,
            node: node.to_string(),
            node_uid: "3f6c1a52-node-uid".to_string(),
            state,
            bin,
            logs,
        };
        let server = fake.handle();
        std::thread::Builder::new()
            .name("fake-kube".into())
            .spawn(move || {
                let rt = tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                    .unwrap();
                rt.block_on(async move {
                    let listener = tokio::net::TcpListener::from_std(std_listener).unwrap();
                    loop {
                        let Ok((stream, _)) = listener.accept().await else {
                            continue;
                        };
                        let server = server.clone();
                        tokio::spawn(async move {
                            let svc = hyper::service::service_fn(move |req| {
                                let server = server.clone();
                                async move { Ok::<_, Infallible>(server.serve(req).await) }
                            });
                            let io = hyper_util::rt::TokioIo::new(stream);
                            let _ = hyper::server::conn::http1::Builder::new()
                                .serve_connection(io, svc)
                                .await;
                        });
                    }
                });
            })
            .unwrap();
        fake
    }

    fn handle(&self) -> Handle {
        Handle {
            state: self.state.clone(),
            node: self.node.clone(),
            node_uid: self.node_uid.clone(),
            bin: self.bin.clone(),
            logs: self.logs.clone(),
        }
    }

    pub fn requests(&self) -> Vec<Request> {
        self.state.lock().unwrap().requests.clone()
    }

    pub fn pods(&self) -> Vec<Value> {
        let mut st = self.state.lock().unwrap();
        self.handle().advance_all(&mut st);
        st.pods.values().cloned().collect()
    }

    /// Every Event recorded, about any object.
    pub fn events(&self) -> Vec<Value> {
        let mut st = self.state.lock().unwrap();
        self.handle().advance_all(&mut st);
        st.events.clone()
    }

    /// From now on, sandboxes cannot be created, with this error (a broken CNI plugin);
    /// None repairs them.
    pub fn break_sandboxes(&self, error: Option<&str>) {
        self.state.lock().unwrap().sandbox_error = error.map(str::to_string);
    }

    /// From now on (or no longer), image pulls from the registry never end.
    pub fn stall_pulls(&self, stall: bool) {
        self.state.lock().unwrap().stall_pulls = stall;
    }

    pub fn secrets(&self) -> Vec<Value> {
        self.state
            .lock()
            .unwrap()
            .secrets
            .values()
            .cloned()
            .collect()
    }

    /// The pid of the running container process of Pod `name`.
    pub fn pid_of(&self, name: &str) -> Option<u32> {
        let mut st = self.state.lock().unwrap();
        let child = st.processes.get_mut(name)?;
        match child.try_wait() {
            Ok(None) => Some(child.id()),
            _ => None,
        }
    }

    /// Creates a Pod as another client would (without running it; its status is what the
    /// test gives).
    /// A ServiceAccount `namespace/name` with these annotations.
    pub fn insert_service_account(
        &self,
        namespace: &str,
        name: &str,
        annotations: &[(&str, &str)],
    ) {
        let annotations: serde_json::Map<String, Value> = annotations
            .iter()
            .map(|(k, v)| (k.to_string(), json!(v)))
            .collect();
        let sa = json!({"apiVersion": "v1", "kind": "ServiceAccount",
            "metadata": {"name": name, "namespace": namespace, "annotations": annotations}});
        self.state
            .lock()
            .unwrap()
            .service_accounts
            .insert(format!("{namespace}/{name}"), sa);
    }

    pub fn insert_pod(&self, pod: Value) {
        let name = pod["metadata"]["name"].as_str().unwrap().to_string();
        self.state.lock().unwrap().pods.insert(name, pod);
    }

    /// Deletes a Pod as another client would (its container, if any, is killed).
    pub fn remove_pod(&self, name: &str) {
        let mut st = self.state.lock().unwrap();
        st.pods.remove(name);
        st.stages.remove(name);
        if let Some(mut child) = st.processes.remove(name) {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// What the container of Pod `name` wrote to stderr.
    pub fn container_log(&self, name: &str) -> String {
        std::fs::read_to_string(self.logs.join(format!("{name}.log"))).unwrap_or_default()
    }
}

impl Drop for FakeKube {
    fn drop(&mut self) {
        let mut st = self.state.lock().unwrap();
        for (_, mut c) in std::mem::take(&mut st.processes) {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

#[derive(Clone)]
struct Handle {
    state: Arc<Mutex<State>>,
    node: String,
    node_uid: String,
    bin: PathBuf,
    logs: PathBuf,
}

impl Handle {
    async fn serve(
        &self,
        req: hyper::Request<hyper::body::Incoming>,
    ) -> hyper::Response<http_body_util::Full<bytes::Bytes>> {
        use http_body_util::BodyExt;
        let method = req.method().to_string();
        let path = req.uri().path().to_string();
        let query = req.uri().query().unwrap_or("").to_string();
        let uri = req.uri().to_string();
        let body = req
            .into_body()
            .collect()
            .await
            .map(|b| b.to_bytes())
            .unwrap_or_default();
        let body: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
        self.state.lock().unwrap().requests.push(Request {
            method: method.clone(),
            uri,
            body: body.clone(),
        });
        let (code, answer) = self.route(&method, &path, &query, body);
        hyper::Response::builder()
            .status(code)
            .header("content-type", "application/json")
            .body(http_body_util::Full::new(bytes::Bytes::from(
                answer.to_string(),
            )))
            .unwrap()
    }

    fn route(&self, method: &str, path: &str, query: &str, body: Value) -> (u16, Value) {
        let parts: Vec<&str> = path.trim_matches('/').split('/').collect();
        match (method, parts.as_slice()) {
            ("GET", ["api", "v1", "nodes", name]) if *name == self.node => {
                let resources: serde_json::Map<String, Value> = NODE_ALLOCATABLE
                    .iter()
                    .map(|(k, v)| (k.to_string(), json!(v)))
                    .collect();
                (
                    200,
                    json!({"apiVersion": "v1", "kind": "Node",
                           "metadata": {"name": name, "uid": self.node_uid},
                           "status": {"capacity": resources, "allocatable": resources}}),
                )
            }
            ("GET", ["api", "v1", "nodes", name]) => {
                status(404, "NotFound", &format!("nodes \"{name}\" not found"))
            }
            ("GET", ["api", "v1", "namespaces", ns, "events"]) => self.list_events(ns, query),
            ("GET", ["api", "v1", "namespaces", ns, "serviceaccounts", name]) => {
                let key = format!("{ns}/{name}");
                match self.state.lock().unwrap().service_accounts.get(&key) {
                    Some(sa) => (200, sa.clone()),
                    None => status(
                        404,
                        "NotFound",
                        &format!("serviceaccounts \"{name}\" not found"),
                    ),
                }
            }
            (_, ["api", "v1", "namespaces", ns, kind @ ("pods" | "secrets"), rest @ ..]) => {
                self.objects(method, ns, kind, rest.first().copied(), query, body)
            }
            _ => status(404, "NotFound", &format!("no route for {method} {path}")),
        }
    }

    fn objects(
        &self,
        method: &str,
        ns: &str,
        kind: &str,
        name: Option<&str>,
        query: &str,
        body: Value,
    ) -> (u16, Value) {
        let mut st = self.state.lock().unwrap();
        self.advance_all(&mut st);
        let singular = if kind == "pods" { "Pod" } else { "Secret" };
        match (method, name) {
            ("GET", None) => {
                let selector = query_param(query, "labelSelector").unwrap_or_default();
                let store = if kind == "pods" {
                    &st.pods
                } else {
                    &st.secrets
                };
                let items: Vec<Value> = store
                    .values()
                    .filter(|o| o["metadata"]["namespace"].as_str() == Some(ns))
                    .filter(|o| matches_selector(o, &selector))
                    .cloned()
                    .collect();
                (
                    200,
                    json!({"apiVersion": "v1", "kind": format!("{singular}List"),
                           "metadata": {"resourceVersion": "1"}, "items": items}),
                )
            }
            ("GET", Some(name)) => {
                let store = if kind == "pods" {
                    &st.pods
                } else {
                    &st.secrets
                };
                match store.get(name) {
                    Some(o) => (200, o.clone()),
                    None => status(404, "NotFound", &format!("{kind} \"{name}\" not found")),
                }
            }
            ("POST", None) => {
                let mut obj = body;
                let Some(name) = obj["metadata"]["name"].as_str().map(str::to_string) else {
                    return status(422, "Invalid", "metadata.name is required");
                };
                let exists = if kind == "pods" {
                    st.pods.contains_key(&name)
                } else {
                    st.secrets.contains_key(&name)
                };
                if exists {
                    return status(
                        409,
                        "AlreadyExists",
                        &format!("{kind} \"{name}\" already exists"),
                    );
                }
                obj["metadata"]["uid"] = json!(st.uid());
                obj["metadata"]["namespace"] = json!(ns);
                obj["metadata"]["resourceVersion"] = json!(st.next_uid.to_string());
                obj["metadata"]["creationTimestamp"] = json!(now_time());
                if kind == "pods" {
                    obj["status"] = json!({"phase": "Pending", "qosClass": qos_class(&obj)});
                    st.pods.insert(name.clone(), obj);
                    st.stages.insert(name.clone(), Stage::Unscheduled);
                    self.advance(&mut st, &name);
                    obj = st.pods[&name].clone();
                } else {
                    st.secrets.insert(name, obj.clone());
                }
                (201, obj)
            }
            ("DELETE", Some(name)) => {
                let removed = if kind == "pods" {
                    st.pods.remove(name)
                } else {
                    st.secrets.remove(name)
                };
                let Some(obj) = removed else {
                    return status(404, "NotFound", &format!("{kind} \"{name}\" not found"));
                };
                if kind == "pods" {
                    st.stages.remove(name);
                    let grace = body["gracePeriodSeconds"].as_u64().unwrap_or(30);
                    if let Some(child) = st.processes.get(name) {
                        let signal = if grace == 0 {
                            libc::SIGKILL
                        } else {
                            libc::SIGTERM
                        };
                        unsafe {
                            libc::kill(child.id() as i32, signal);
                        }
                    }
                }
                (200, obj)
            }
            _ => status(
                405,
                "MethodNotAllowed",
                "not supported by the fake API server",
            ),
        }
    }

    /// Moves every Pod created through the API as far as it can go now.
    fn advance_all(&self, st: &mut State) {
        let names: Vec<String> = st.stages.keys().cloned().collect();
        for name in names {
            self.advance(st, &name);
        }
    }

    /// The scheduler and the kubelet: moves Pod `name` through its life as far as it can go
    /// now, reporting in its status and in Events as they do.
    fn advance(&self, st: &mut State, name: &str) {
        loop {
            let (Some(stage), Some(pod)) = (st.stages.get(name).cloned(), st.pods.get(name)) else {
                return;
            };
            let pod = pod.clone();
            let next = match stage {
                Stage::Unscheduled => self.schedule(st, &pod),
                Stage::Scheduled => self.prepare(st, &pod),
                Stage::Pulling | Stage::PullFailed(..) => self.pull(st, &pod, &stage),
                Stage::Pulled => self.start_container(st, &pod),
                Stage::Running => self.check_container(st, &pod),
                Stage::Done => None,
            };
            match next {
                Some(next) => {
                    st.stages.insert(name.to_string(), next);
                }
                None => return,
            }
        }
    }

    fn set_status(&self, st: &mut State, pod: &Value, status: Value) {
        let name = pod["metadata"]["name"].as_str().unwrap_or_default();
        if let Some(p) = st.pods.get_mut(name) {
            let mut status = status;
            status["qosClass"] = json!(qos_class(p));
            p["status"] = status;
        }
    }

    /// Records an Event about `pod`, or counts it again as the real recorders do (no more
    /// than once per retry interval).
    fn event(&self, st: &mut State, pod: &Value, kind: &str, reason: &str, message: &str) {
        let uid = pod["metadata"]["uid"]
            .as_str()
            .unwrap_or_default()
            .to_string();
        let scheduler = reason == "Scheduled" || reason == "FailedScheduling";
        let same = st.events.iter_mut().find(|e| {
            e["involvedObject"]["uid"] == uid.as_str()
                && e["reason"] == reason
                && e["message"] == message
        });
        if let Some(e) = same {
            if scheduler {
                // events.k8s.io recorder: a series.
                let last = e["series"]["lastObservedTime"]
                    .as_str()
                    .or(e["eventTime"].as_str())
                    .and_then(|t| t.parse::<Timestamp>().ok());
                if last.is_some_and(recent) {
                    return;
                }
                let count = e["series"]["count"].as_u64().unwrap_or(1) + 1;
                e["series"] = json!({"count": count, "lastObservedTime": now_micro_time()});
            } else {
                // core/v1 recorder: count and lastTimestamp.
                let last = e["lastTimestamp"]
                    .as_str()
                    .and_then(|t| t.parse::<Timestamp>().ok());
                if last.is_some_and(recent) {
                    return;
                }
                e["count"] = json!(e["count"].as_u64().unwrap_or(1) + 1);
                e["lastTimestamp"] = json!(now_time());
            }
            return;
        }
        let pod_name = pod["metadata"]["name"].as_str().unwrap_or_default();
        let ns = pod["metadata"]["namespace"].as_str().unwrap_or_default();
        let event_uid = st.uid();
        let mut involved = json!({"apiVersion": "v1", "kind": "Pod", "name": pod_name,
            "namespace": ns, "uid": uid,
            "resourceVersion": pod["metadata"]["resourceVersion"]});
        if [
            "Pulling",
            "Pulled",
            "Failed",
            "BackOff",
            "Created",
            "Started",
            "ErrImageNeverPull",
        ]
        .contains(&reason)
        {
            involved["fieldPath"] = json!("spec.containers{mounter}");
        }
        let mut e = json!({
            "apiVersion": "v1", "kind": "Event",
            "metadata": {
                "name": format!("{pod_name}.{:x}", Timestamp::now().as_nanosecond()),
                "namespace": ns, "uid": event_uid, "resourceVersion": st.next_uid.to_string(),
                "creationTimestamp": now_time(),
            },
            "involvedObject": involved,
            "reason": reason, "message": message, "type": kind,
        });
        if scheduler {
            e["eventTime"] = json!(now_micro_time());
            e["firstTimestamp"] = Value::Null;
            e["lastTimestamp"] = Value::Null;
            e["source"] = json!({});
            e["action"] = json!(if reason == "Scheduled" {
                "Binding"
            } else {
                "Scheduling"
            });
            e["reportingComponent"] = json!("default-scheduler");
            e["reportingInstance"] = json!(format!("default-scheduler-{}", self.node));
        } else {
            e["eventTime"] = Value::Null;
            e["firstTimestamp"] = json!(now_time());
            e["lastTimestamp"] = json!(now_time());
            e["count"] = json!(1);
            e["source"] = json!({"component": "kubelet", "host": self.node});
            e["reportingComponent"] = json!("kubelet");
            e["reportingInstance"] = json!(self.node);
        }
        st.events.push(e);
    }

    /// The scheduler: binds the Pod to the node if it may go there and fits.
    fn schedule(&self, st: &mut State, pod: &Value) -> Option<Stage> {
        let created = pod["metadata"]["creationTimestamp"]
            .as_str()
            .unwrap_or_default()
            .to_string();
        let affinity = pod["spec"]["affinity"]["nodeAffinity"].to_string();
        let unfit = if !affinity.contains(&format!("\"{}\"", self.node)) {
            Some("1 node(s) didn't match Pod's node affinity/selector".to_string())
        } else {
            let name = &pod["metadata"]["name"];
            let short: Vec<&str> = NODE_ALLOCATABLE
                .iter()
                .filter(|(resource, _)| *resource != "pods")
                .filter(|(resource, allocatable)| {
                    let used: f64 = st
                        .pods
                        .values()
                        .filter(|p| p["metadata"]["name"] != *name)
                        .filter(|p| p["spec"]["nodeName"] == self.node.as_str())
                        .filter(|p| {
                            !matches!(p["status"]["phase"].as_str(), Some("Failed" | "Succeeded"))
                        })
                        .map(|p| request_of(p, resource))
                        .sum();
                    used + request_of(pod, resource) > quantity(allocatable).unwrap_or(0.0)
                })
                .map(|(resource, _)| *resource)
                .collect();
            (!short.is_empty()).then(|| {
                short
                    .iter()
                    .map(|r| format!("1 Insufficient {r}"))
                    .collect::<Vec<_>>()
                    .join(", ")
            })
        };
        if let Some(why) = unfit {
            let preemption = if why.contains("affinity") {
                "Preemption is not helpful for scheduling"
            } else {
                "No preemption victims found for incoming pod"
            };
            let message = format!(
                "0/1 nodes are available: {why}. preemption: 0/1 nodes are available: 1 {preemption}."
            );
            self.event(st, pod, "Warning", "FailedScheduling", &message);
            self.set_status(st, pod, json!({"phase": "Pending", "conditions": [
                condition("PodScheduled", false, Some("Unschedulable"), Some(&message), &created)]}));
            return None;
        }
        let name = pod["metadata"]["name"]
            .as_str()
            .unwrap_or_default()
            .to_string();
        let ns = pod["metadata"]["namespace"]
            .as_str()
            .unwrap_or_default()
            .to_string();
        if let Some(p) = st.pods.get_mut(&name) {
            p["spec"]["nodeName"] = json!(self.node);
        }
        self.event(
            st,
            pod,
            "Normal",
            "Scheduled",
            &format!("Successfully assigned {ns}/{name} to {}", self.node),
        );
        self.set_status(
            st,
            pod,
            self.kubelet_status(
                pod,
                "Pending",
                false,
                json!({"waiting": {"reason": "ContainerCreating"}}),
            ),
        );
        Some(Stage::Scheduled)
    }

    /// The status kubelet reports for a Pod bound to this node.
    fn kubelet_status(&self, pod: &Value, phase: &str, sandbox: bool, state: Value) -> Value {
        let at = pod["metadata"]["creationTimestamp"]
            .as_str()
            .unwrap_or_default();
        let running = state.get("running").is_some();
        let ended = state.get("terminated").is_some();
        let unready = if ended {
            Some(if phase == "Succeeded" {
                "PodCompleted"
            } else {
                "PodFailed"
            })
        } else if running {
            None
        } else {
            Some("ContainersNotReady")
        };
        let unready_message = (unready == Some("ContainersNotReady"))
            .then_some("containers with unready status: [mounter]");
        let image = pod["spec"]["containers"][0]["image"]
            .as_str()
            .unwrap_or_default();
        let mut container = json!({
            "name": "mounter", "state": state, "lastState": {}, "ready": running,
            "restartCount": 0, "image": image, "imageID": "", "started": running,
        });
        if running || ended {
            // A 64-digit id of this Pod's container (FNV-1a of its uid, four times).
            let hex = format!(
                "{:016x}",
                pod["metadata"]["uid"]
                    .as_str()
                    .unwrap_or_default()
                    .bytes()
                    .fold(0xcbf29ce484222325u64, |h, b| {
                        (h ^ b as u64).wrapping_mul(0x100000001b3)
                    })
            );
            container["containerID"] = json!(format!("containerd://{hex}{hex}{hex}{hex}"));
            container["imageID"] = json!(format!(
                "{}@sha256:{hex}{hex}{hex}{hex}",
                image.split(':').next().unwrap_or(image)
            ));
        }
        let mut status = json!({
            "phase": phase,
            "conditions": [
                condition("PodReadyToStartContainers", sandbox && !ended, None, None, at),
                condition("Initialized", true, None, None, at),
                condition("Ready", unready.is_none(), unready, unready_message, at),
                condition("ContainersReady", unready.is_none(), unready, unready_message, at),
                condition("PodScheduled", true, None, None, at),
            ],
            "hostIP": "127.0.0.1", "hostIPs": [{"ip": "127.0.0.1"}],
            "startTime": at,
            "containerStatuses": [container],
        });
        if sandbox {
            status["podIP"] = json!("10.88.0.7");
            status["podIPs"] = json!([{"ip": "10.88.0.7"}]);
        }
        status
    }

    /// The kubelet: sandbox and volumes.
    fn prepare(&self, st: &mut State, pod: &Value) -> Option<Stage> {
        let creating = json!({"waiting": {"reason": "ContainerCreating"}});
        if let Some(error) = st.sandbox_error.clone() {
            self.event(
                st,
                pod,
                "Warning",
                "FailedCreatePodSandBox",
                &format!("Failed to create pod sandbox: {error}"),
            );
            self.set_status(
                st,
                pod,
                self.kubelet_status(pod, "Pending", false, creating),
            );
            return None;
        }
        for v in pod["spec"]["volumes"].as_array().into_iter().flatten() {
            let Some(path) = v["hostPath"]["path"].as_str() else {
                continue;
            };
            if v["hostPath"]["type"] == "Directory" && !Path::new(path).is_dir() {
                let message = format!(
                    "MountVolume.SetUp failed for volume \"{}\" : hostPath type check failed: {path} is not a directory",
                    v["name"].as_str().unwrap_or_default()
                );
                self.event(st, pod, "Warning", "FailedMount", &message);
                self.set_status(st, pod, self.kubelet_status(pod, "Pending", true, creating));
                return None;
            }
        }
        self.set_status(
            st,
            pod,
            self.kubelet_status(pod, "Pending", true, creating.clone()),
        );
        let container = &pod["spec"]["containers"][0];
        let image = container["image"].as_str().unwrap_or_default().to_string();
        let policy = container["imagePullPolicy"]
            .as_str()
            .unwrap_or("IfNotPresent");
        let present = st.node_images.contains(&image);
        match policy {
            "Never" if !present => {
                let message =
                    format!("Container image \"{image}\" is not present with pull policy of Never");
                self.event(st, pod, "Warning", "ErrImageNeverPull", &message);
                self.set_status(
                    st,
                    pod,
                    self.kubelet_status(
                        pod,
                        "Pending",
                        true,
                        json!({"waiting": {"reason": "ErrImageNeverPull", "message": message}}),
                    ),
                );
                None
            }
            "Never" | "IfNotPresent" if present => {
                self.event(
                    st,
                    pod,
                    "Normal",
                    "Pulled",
                    &format!("Container image \"{image}\" already present on machine"),
                );
                Some(Stage::Pulled)
            }
            _ => {
                self.event(
                    st,
                    pod,
                    "Normal",
                    "Pulling",
                    &format!("Pulling image \"{image}\""),
                );
                Some(Stage::Pulling)
            }
        }
    }

    /// The kubelet pulls from the fake registry.
    fn pull(&self, st: &mut State, pod: &Value, stage: &Stage) -> Option<Stage> {
        let image = pod["spec"]["containers"][0]["image"]
            .as_str()
            .unwrap_or_default()
            .to_string();
        if let Stage::PullFailed(at, error) = stage {
            if at.elapsed() < KUBELET_RETRY {
                return None;
            }
            // Back-off: kubelet says so, and keeps saying it between its (failing) retries.
            self.event(
                st,
                pod,
                "Normal",
                "BackOff",
                &format!("Back-off pulling image \"{image}\""),
            );
            self.event(st, pod, "Warning", "Failed", "Error: ImagePullBackOff");
            self.set_status(
                st,
                pod,
                self.kubelet_status(
                    pod,
                    "Pending",
                    true,
                    json!({"waiting": {
                "reason": "ImagePullBackOff",
                "message": format!("Back-off pulling image \"{image}\": ErrImagePull: {error}")}}),
                ),
            );
            return None;
        }
        if st.stall_pulls {
            return None;
        }
        if st.registry.contains(&image) {
            st.node_images.insert(image.clone());
            self.event(st, pod, "Normal", "Pulled", &format!(
                "Successfully pulled image \"{image}\" in 412ms (412ms including waiting). Image size: 31457280 bytes."));
            return Some(Stage::Pulled);
        }
        let error = format!(
            "rpc error: code = NotFound desc = failed to pull and unpack image \"{image}\": \
             failed to resolve reference \"{image}\": {image}: not found"
        );
        self.event(
            st,
            pod,
            "Warning",
            "Failed",
            &format!("Failed to pull image \"{image}\": {error}"),
        );
        self.event(st, pod, "Warning", "Failed", "Error: ErrImagePull");
        self.set_status(
            st,
            pod,
            self.kubelet_status(
                pod,
                "Pending",
                true,
                json!({"waiting": {"reason": "ErrImagePull", "message": error.clone()}}),
            ),
        );
        Some(Stage::PullFailed(Instant::now(), error))
    }

    /// The kubelet creates and starts the container: a process here.
    fn start_container(&self, st: &mut State, pod: &Value) -> Option<Stage> {
        let name = pod["metadata"]["name"]
            .as_str()
            .unwrap_or_default()
            .to_string();
        let mut cmd = match self.container_command(st, pod) {
            Ok(cmd) => cmd,
            Err(message) => {
                // kubelet retries, so a Secret created later still works.
                self.event(st, pod, "Warning", "Failed", &format!("Error: {message}"));
                self.set_status(
                    st,
                    pod,
                    self.kubelet_status(
                        pod,
                        "Pending",
                        true,
                        json!({"waiting": {
                    "reason": "CreateContainerConfigError", "message": message}}),
                    ),
                );
                return None;
            }
        };
        self.event(st, pod, "Normal", "Created", "Created container: mounter");
        let at = now_time();
        match cmd.spawn() {
            Ok(child) => {
                st.processes.insert(name, child);
                self.event(st, pod, "Normal", "Started", "Started container mounter");
                self.set_status(
                    st,
                    pod,
                    self.kubelet_status(
                        pod,
                        "Running",
                        true,
                        json!({"running": {"startedAt": at}}),
                    ),
                );
                Some(Stage::Running)
            }
            Err(e) => {
                let message = format!(
                    "failed to create containerd task: failed to create shim task: OCI runtime create failed: \
                     runc create failed: unable to start container process: exec: {e}: unknown"
                );
                self.event(st, pod, "Warning", "Failed", &format!("Error: {message}"));
                self.set_status(
                    st,
                    pod,
                    self.kubelet_status(
                        pod,
                        "Failed",
                        false,
                        json!({"terminated": {
                    "exitCode": 128, "reason": "StartError", "message": message,
                    "startedAt": "1970-01-01T00:00:00Z", "finishedAt": at}}),
                    ),
                );
                Some(Stage::Done)
            }
        }
    }

    /// The kubelet notices that the container ended.
    fn check_container(&self, st: &mut State, pod: &Value) -> Option<Stage> {
        use std::os::unix::process::ExitStatusExt;
        let name = pod["metadata"]["name"].as_str().unwrap_or_default();
        let child = st.processes.get_mut(name)?;
        let Ok(Some(exit)) = child.try_wait() else {
            return None;
        };
        let code = exit
            .code()
            .or(exit.signal().map(|s| 128 + s))
            .unwrap_or(255);
        let (phase, reason) = if code == 0 {
            ("Succeeded", "Completed")
        } else {
            ("Failed", "Error")
        };
        let started =
            pod["status"]["containerStatuses"][0]["state"]["running"]["startedAt"].clone();
        let status = self.kubelet_status(
            pod,
            phase,
            false,
            json!({"terminated": {
            "exitCode": code, "reason": reason, "startedAt": started, "finishedAt": now_time()}}),
        );
        self.set_status(st, pod, status);
        Some(Stage::Done)
    }

    /// The container's process: its command is the s3csi binary under test.
    fn container_command(&self, st: &State, pod: &Value) -> Result<Command, String> {
        let container = &pod["spec"]["containers"][0];
        let args: Vec<String> = container["args"]
            .as_array()
            .map(|a| {
                a.iter()
                    .filter_map(|v| v.as_str().map(str::to_string))
                    .collect()
            })
            .unwrap_or_default();
        let mut cmd = Command::new(&self.bin);
        cmd.args(&args).env_clear();
        for key in ["PATH", "AWS_EC2_METADATA_DISABLED", "AWS_REGION"] {
            if let Ok(v) = std::env::var(key) {
                cmd.env(key, v);
            }
        }
        let ns = pod["metadata"]["namespace"].as_str().unwrap_or_default();
        for e in container["env"].as_array().cloned().unwrap_or_default() {
            let name = e["name"].as_str().unwrap_or_default();
            if let Some(v) = e["value"].as_str() {
                cmd.env(name, v);
            } else if let Some(r) = e.get("valueFrom").and_then(|v| v.get("secretKeyRef")) {
                let secret = r["name"].as_str().unwrap_or_default();
                let key = r["key"].as_str().unwrap_or_default();
                let optional = r["optional"].as_bool() == Some(true);
                let Some(s) = st.secrets.get(secret) else {
                    if optional {
                        continue;
                    }
                    return Err(format!("secret \"{secret}\" not found"));
                };
                match s["stringData"][key].as_str() {
                    Some(v) => {
                        cmd.env(name, v);
                    }
                    None if optional => {}
                    None => return Err(format!("couldn't find key {key} in Secret {ns}/{secret}")),
                }
            }
        }
        let name = pod["metadata"]["name"].as_str().unwrap_or("pod");
        let log = std::fs::File::create(self.logs.join(format!("{name}.log")))
            .map_err(|e| e.to_string())?;
        unsafe {
            use std::os::unix::process::CommandExt;
            cmd.pre_exec(|| {
                libc::setsid();
                Ok(())
            });
        }
        cmd.stdin(Stdio::null()).stdout(Stdio::null()).stderr(log);
        Ok(cmd)
    }

    /// GET /api/v1/namespaces/NS/events?fieldSelector=...: the fields the API server
    /// selects Events by, `=`/`==`/`!=` terms joined by commas.
    fn list_events(&self, ns: &str, query: &str) -> (u16, Value) {
        const FIELDS: [&str; 10] = [
            "involvedObject.kind",
            "involvedObject.namespace",
            "involvedObject.name",
            "involvedObject.uid",
            "involvedObject.apiVersion",
            "involvedObject.resourceVersion",
            "involvedObject.fieldPath",
            "reason",
            "source",
            "type",
        ];
        let selector = query_param(query, "fieldSelector").unwrap_or_default();
        let mut terms = vec![];
        for term in selector.split(',').filter(|t| !t.is_empty()) {
            let (field, negate, value) = if let Some((f, v)) = term.split_once("!=") {
                (f, true, v)
            } else if let Some((f, v)) = term.split_once("==").or(term.split_once('=')) {
                (f, false, v)
            } else {
                return status(
                    400,
                    "BadRequest",
                    &format!("invalid selector: '{selector}'"),
                );
            };
            if !FIELDS.contains(&field) && field != "metadata.name" && field != "metadata.namespace"
            {
                return status(
                    400,
                    "BadRequest",
                    &format!("field label not supported: {field}"),
                );
            }
            terms.push((field.to_string(), negate, value.to_string()));
        }
        let mut st = self.state.lock().unwrap();
        self.advance_all(&mut st);
        let items: Vec<Value> = st
            .events
            .iter()
            .filter(|e| e["metadata"]["namespace"] == ns)
            .filter(|e| {
                terms.iter().all(|(field, negate, value)| {
                    let e: &Value = e;
                    let got = match field.as_str() {
                        "source" => &e["source"]["component"],
                        f => f.split('.').fold(e, |v, k| &v[k]),
                    };
                    (got.as_str().unwrap_or("") == value) != *negate
                })
            })
            .cloned()
            .collect();
        (
            200,
            json!({"apiVersion": "v1", "kind": "EventList",
                   "metadata": {"resourceVersion": st.next_uid.to_string()}, "items": items}),
        )
    }
}

/// The QoS class the API server gives a Pod.
fn qos_class(pod: &Value) -> &'static str {
    let resources = &pod["spec"]["containers"][0]["resources"];
    let empty = |v: &Value| v.as_object().is_none_or(|o| o.is_empty());
    if empty(&resources["requests"]) && empty(&resources["limits"]) {
        "BestEffort"
    } else if !empty(&resources["limits"])
        && resources["requests"]
            .as_object()
            .into_iter()
            .flatten()
            .all(|(k, v)| resources["limits"][k] == *v)
        && ["cpu", "memory"]
            .iter()
            .all(|r| !resources["limits"][r].is_null())
    {
        "Guaranteed"
    } else {
        "Burstable"
    }
}
