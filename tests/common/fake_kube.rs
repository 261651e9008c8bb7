//! A fake Kubernetes API server, with a fake kubelet behind it, for the node service's pod
//! mode: the part of the core/v1 API that mode uses (get a Node; create, get, list by
//! label, delete Pods and Secrets), over plain HTTP on 127.0.0.1, reached through a
//! kubeconfig file as any client would.
//!
//! What a real cluster would do with a created Pod, the fake kubelet does on this
//! machine: it runs the Pod's only container as a process — its command mapped to the
//! s3csi binary under test, its arguments as given, its environment from literal values
//! and `secretKeyRef`s only (nothing inherited, so credentials must come through the
//! Secret) — and deleting the Pod sends SIGTERM (SIGKILL with a zero grace period).
//! Every request is recorded for the test to check.

use serde_json::{json, Value};
use std::collections::BTreeMap;
use std::convert::Infallible;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};

#[derive(Debug, Clone)]
pub struct Request {
    pub method: String,
    /// Path and query.
    pub uri: String,
    pub body: Value,
}

#[derive(Default)]
struct State {
    pods: BTreeMap<String, Value>,
    secrets: BTreeMap<String, Value>,
    processes: BTreeMap<String, Child>,
    requests: Vec<Request>,
    next_uid: u64,
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
        let state = Arc::new(Mutex::new(State::default()));
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
        self.state.lock().unwrap().pods.values().cloned().collect()
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

    /// Creates a Pod as another client would (without running it).
    pub fn insert_pod(&self, pod: Value) {
        let name = pod["metadata"]["name"].as_str().unwrap().to_string();
        self.state.lock().unwrap().pods.insert(name, pod);
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
            ("GET", ["api", "v1", "nodes", name]) if *name == self.node => (
                200,
                json!({"apiVersion": "v1", "kind": "Node",
                       "metadata": {"name": name, "uid": self.node_uid}}),
            ),
            ("GET", ["api", "v1", "nodes", name]) => {
                status(404, "NotFound", &format!("nodes \"{name}\" not found"))
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
                st.next_uid += 1;
                obj["metadata"]["uid"] = json!(format!("uid-{}", st.next_uid));
                obj["metadata"]["namespace"] = json!(ns);
                obj["metadata"]["resourceVersion"] = json!(st.next_uid.to_string());
                if kind == "pods" {
                    match self.run(&st, &obj) {
                        Ok(child) => {
                            obj["status"] = json!({"phase": "Running"});
                            st.processes.insert(name.clone(), child);
                        }
                        Err(e) => {
                            obj["status"] = json!({"phase": "Failed", "message": e});
                        }
                    }
                    st.pods.insert(name, obj.clone());
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

    /// The fake kubelet: runs the Pod's container here.
    fn run(&self, st: &State, pod: &Value) -> Result<Child, String> {
        if pod["spec"]["affinity"]["nodeAffinity"]
            .to_string()
            .find(&format!("\"{}\"", self.node))
            .is_none()
        {
            return Err("not scheduled onto this node".into());
        }
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
        for e in container["env"].as_array().cloned().unwrap_or_default() {
            let name = e["name"].as_str().unwrap_or_default();
            if let Some(v) = e["value"].as_str() {
                cmd.env(name, v);
            } else if let Some(r) = e.get("valueFrom").and_then(|v| v.get("secretKeyRef")) {
                let secret = r["name"].as_str().unwrap_or_default();
                let key = r["key"].as_str().unwrap_or_default();
                let value = st
                    .secrets
                    .get(secret)
                    .and_then(|s| s["stringData"][key].as_str().map(str::to_string));
                match value {
                    Some(v) => {
                        cmd.env(name, v);
                    }
                    None if r["optional"].as_bool() == Some(true) => {}
                    None => return Err(format!("secret {secret} has no key {key}")),
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
        cmd.stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .map_err(|e| e.to_string())
    }
}
