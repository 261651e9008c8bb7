//! Pod mode: each mounter runs in a Pod of its own, created by the node service through
//! the Kubernetes API, so that restarting or upgrading the node plugin's Pod (which kills
//! every process it started) leaves the mounters serving.
//!
//! The node service still mounts by descriptor ([`super::handoff`]): the mounter Pod gets
//! the mount's handoff directory (a hostPath under the node service's state directory,
//! mounted at the same path) and waits there for the `/dev/fuse` descriptor, so it needs
//! no privilege, no `/dev/fuse` and no capabilities.
//!
//! What the node service asks for, per mount:
//! - Pod `s3csi-mounter-<mount>-<generation>` in the driver's namespace, labelled with the
//!   node and the mount (so a restarted node service finds its Pods), owned by the Node
//!   (deleting the Node garbage-collects its mounters; deleting the node plugin does not),
//!   pinned to this node by node affinity on `metadata.name`, tolerating every taint,
//!   `restartPolicy: Never` (a dead mounter is replaced by the node service, which must
//!   hand the replacement the descriptor), unprivileged: all capabilities dropped, no
//!   privilege escalation, read-only root file system, no service-account token (the AWS
//!   SDK's web-identity token for IRSA is a separate projected volume);
//! - Secret `s3csi-mounter-<mount>` when there are static credentials (the volume's, or the
//!   node service's own), read by the Pod through `secretKeyRef`, so credentials never
//!   appear in the Pod object.
//!
//! A mounter Pod is considered gone once its control socket refuses connections (its
//! process exited; the node service removes a dead mounter's socket before starting the
//! next one), or it left `last-error` in the handoff directory.
//! No API polling is needed for that: the socket is on this node. Only while a new Pod has
//! not started serving yet does the node service read its status and Events
//! ([`PodLauncher::inspect`], [`super::pod_status`]), to tell why it does not start.

use super::backend::{ExitFlag, MounterBackend, MounterHandle};
use super::pod_status::{self, PodState};
use super::state::MountRecord;
use super::{blocking, handoff, mount_id, FailureKind, MountError, MountRequest, SUPERVISE_EVERY};
use async_trait::async_trait;
use k8s_openapi::api::core::v1::{Event, Node, Pod, ResourceRequirements, Secret};
use kube::api::{DeleteParams, ListParams, PostParams};
use kube::{Api, Client};
use serde_json::json;
use std::collections::BTreeMap;
use std::path::Path;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use std::time::Instant;

pub const LABEL_MANAGED_BY: &str = "app.kubernetes.io/managed-by";
pub const LABEL_NAME: &str = "app.kubernetes.io/name";
pub const LABEL_NODE: &str = "s3csi.dev/node";
pub const LABEL_MOUNT: &str = "s3csi.dev/mount";
const MANAGER: &str = "s3csi";

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum MounterMode {
    /// Mounters are children of the node service (outside Kubernetes, tests).
    Process,
    /// One mounter Pod per volume, created through the Kubernetes API.
    Pod,
}

/// The node service's mounter flags (the chart's `mounter` values).
#[derive(Debug, Clone, clap::Args)]
pub struct MounterArgs {
    /// Where mounters run: `process` (children of the node service) or `pod` (one Pod per
    /// volume on this node, which outlives restarts and upgrades of the node plugin)
    #[arg(long, value_enum, default_value = "process")]
    pub mounter: MounterMode,
    /// (pod mode) Image of the mounter Pods, normally the driver's own
    #[arg(long, env = "S3CSI_MOUNTER_IMAGE")]
    pub mounter_image: Option<String>,
    /// (pod mode) imagePullPolicy of the mounter Pods
    #[arg(long, default_value = "IfNotPresent", value_parser = ["Always", "IfNotPresent", "Never"])]
    pub mounter_image_pull_policy: String,
    /// (pod mode) The s3csi binary inside the image
    #[arg(long, default_value = "/usr/local/bin/s3csi")]
    pub mounter_command: String,
    /// (pod mode) Namespace of the mounter Pods (the node plugin's own, from the downward API)
    #[arg(long, env = "POD_NAMESPACE")]
    pub mounter_namespace: Option<String>,
    /// (pod mode) Service account of the mounter Pods: the one whose IAM role (IRSA, EKS
    /// Pod Identity) reaches the buckets
    #[arg(long)]
    pub mounter_service_account: Option<String>,
    /// (pod mode) priorityClassName of the mounter Pods
    #[arg(long)]
    pub mounter_priority_class: Option<String>,
    /// (pod mode) Resources of the mounter container, as a JSON ResourceRequirements object,
    /// e.g. {"requests":{"memory":"128Mi"},"limits":{"memory":"1Gi"}}
    #[arg(long, default_value = "{}", value_parser = parse_resources)]
    pub mounter_resources: ResourceRequirements,
    /// (pod mode) Seconds a mounter Pod gets to complete its uploads when it is deleted
    #[arg(long, default_value = "30")]
    pub mounter_grace_seconds: u32,
    /// (pod mode) Run the mounter Pods in the host's network namespace (hostNetwork, with
    /// dnsPolicy ClusterFirstWithHostNet), e.g. to reach the instance metadata service
    #[arg(long)]
    pub mounter_host_network: bool,
}

/// Why pod mode cannot start.
#[derive(Debug, thiserror::Error)]
pub enum PodSetupError {
    #[error("--mounter=pod needs --mounter-image")]
    NoImage,
    #[error("--mounter=pod needs --mounter-namespace (or POD_NAMESPACE)")]
    NoNamespace,
    #[error("cannot reach the Kubernetes API server: {0}")]
    ApiServer(kube::Error),
}

#[derive(Debug, thiserror::Error)]
#[error("not a ResourceRequirements object: {0}")]
pub struct BadResources(serde_json::Error);

fn parse_resources(text: &str) -> Result<ResourceRequirements, BadResources> {
    serde_json::from_str(text).map_err(BadResources)
}

impl MounterArgs {
    /// The Pod settings for pod mode, None in process mode.
    pub fn pod_settings(&self, node_name: &str) -> Result<Option<PodSettings>, PodSetupError> {
        if self.mounter == MounterMode::Process {
            return Ok(None);
        }
        let image = self
            .mounter_image
            .clone()
            .filter(|i| !i.is_empty())
            .ok_or(PodSetupError::NoImage)?;
        let namespace = self
            .mounter_namespace
            .clone()
            .filter(|n| !n.is_empty())
            .ok_or(PodSetupError::NoNamespace)?;
        Ok(Some(PodSettings {
            namespace,
            node_name: node_name.to_string(),
            image,
            image_pull_policy: self.mounter_image_pull_policy.clone(),
            command: self.mounter_command.clone(),
            service_account: self.mounter_service_account.clone(),
            priority_class: self.mounter_priority_class.clone(),
            resources: self.mounter_resources.clone(),
            termination_grace_seconds: self.mounter_grace_seconds,
            host_network: self.mounter_host_network,
        }))
    }
}

/// What a mounter Pod looks like.
#[derive(Debug, Clone)]
pub struct PodSettings {
    pub namespace: String,
    pub node_name: String,
    pub image: String,
    pub image_pull_policy: String,
    /// The binary inside the image.
    pub command: String,
    pub service_account: Option<String>,
    pub priority_class: Option<String>,
    pub resources: ResourceRequirements,
    pub termination_grace_seconds: u32,
    /// hostNetwork: true (and dnsPolicy: ClusterFirstWithHostNet, so that cluster Service
    /// names still resolve).
    pub host_network: bool,
}

pub struct PodLauncher {
    pods: Api<Pod>,
    secrets: Api<Secret>,
    events: Api<Event>,
    /// The API server refused to list Events (RBAC of an older chart): status only.
    events_denied: AtomicBool,
    settings: PodSettings,
    node_uid: Option<String>,
}

/// How long one look at a starting Pod (its status, its Events) may take.
const INSPECT_TIMEOUT: Duration = Duration::from_secs(5);

/// Credentials that may be handed to a mounter, as environment variable names.
use super::process::{mount_credential_keys, CREDENTIAL_KEYS};

fn api_error(what: &str, e: kube::Error) -> MountError {
    let kind = match &e {
        kube::Error::Api(s) if s.code == 403 => FailureKind::PermissionDenied,
        _ => FailureKind::Other,
    };
    MountError {
        kind,
        message: format!("{what}: {e}"),
    }
}

fn is_status(e: &kube::Error, code: u16) -> bool {
    matches!(e, kube::Error::Api(s) if s.code == code)
}

impl PodLauncher {
    /// Connects with the usual configuration (KUBECONFIG, else in-cluster) and looks up
    /// this node, which owns the mounter Pods.
    pub async fn connect(settings: PodSettings) -> Result<Self, PodSetupError> {
        let client = Client::try_default()
            .await
            .map_err(PodSetupError::ApiServer)?;
        let node_uid = match Api::<Node>::all(client.clone())
            .get(&settings.node_name)
            .await
        {
            Ok(node) => node.metadata.uid,
            Err(e) => {
                // Pods still work without an owner; the node service cleans them up itself.
                tracing::warn!(node = settings.node_name, error = %e,
                    "cannot read this node's object; mounter pods will have no owner");
                None
            }
        };
        Ok(Self {
            pods: Api::namespaced(client.clone(), &settings.namespace),
            secrets: Api::namespaced(client.clone(), &settings.namespace),
            events: Api::namespaced(client, &settings.namespace),
            events_denied: AtomicBool::new(false),
            settings,
            node_uid,
        })
    }

    pub fn settings(&self) -> &PodSettings {
        &self.settings
    }

    pub fn pod_name(mount: &str, generation: u32) -> String {
        format!("s3csi-mounter-{mount}-{generation}")
    }

    pub fn secret_name(mount: &str) -> String {
        format!("s3csi-mounter-{mount}")
    }

    fn labels(&self, mount: &str) -> serde_json::Value {
        json!({
            LABEL_NAME: "s3csi-mounter",
            LABEL_MANAGED_BY: MANAGER,
            LABEL_NODE: label_value(&self.settings.node_name),
            LABEL_MOUNT: mount,
        })
    }

    fn selector(&self) -> String {
        format!(
            "{LABEL_MANAGED_BY}={MANAGER},{LABEL_NODE}={}",
            label_value(&self.settings.node_name)
        )
    }

    fn owner(&self) -> serde_json::Value {
        match &self.node_uid {
            Some(uid) => json!([{
                "apiVersion": "v1",
                "kind": "Node",
                "name": self.settings.node_name,
                "uid": uid,
            }]),
            None => json!([]),
        }
    }

    /// The Pod that runs `s3csi mount --handoff-dir DIR ... SOURCE TARGET` for `req`.
    pub fn pod_manifest(
        &self,
        req: &MountRequest,
        mount: &str,
        dir: &Path,
        recover: bool,
        generation: u32,
        secret: Option<&str>,
    ) -> Result<Pod, MountError> {
        let s = &self.settings;
        let dir_text = dir.to_string_lossy();
        let mut args = vec![
            "mount".to_string(),
            "--foreground".into(),
            "--handoff-dir".into(),
            dir_text.to_string(),
        ];
        if recover {
            args.push("--recover".into());
        }
        args.extend(req.args.iter().cloned());
        args.push(req.source.clone());
        args.push(req.target.to_string_lossy().into_owned());
        let env: Vec<serde_json::Value> = match secret {
            Some(name) => mount_credential_keys()
                .map(|k| {
                    json!({"name": k, "valueFrom": {"secretKeyRef": {
                        "name": name, "key": k, "optional": true}}})
                })
                .collect(),
            None => vec![],
        };
        let mut spec = json!({
            "restartPolicy": "Never",
            "automountServiceAccountToken": false,
            "terminationGracePeriodSeconds": s.termination_grace_seconds,
            "affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
                "nodeSelectorTerms": [{"matchFields": [{
                    "key": "metadata.name", "operator": "In", "values": [s.node_name]}]}]}}},
            "tolerations": [{"operator": "Exists"}],
            "containers": [{
                "name": pod_status::CONTAINER,
                "image": s.image,
                "imagePullPolicy": s.image_pull_policy,
                "command": [s.command],
                "args": args,
                "env": env,
                "resources": s.resources,
                "securityContext": {
                    "privileged": false,
                    "allowPrivilegeEscalation": false,
                    "readOnlyRootFilesystem": true,
                    "capabilities": {"drop": ["ALL"]},
                },
                "volumeMounts": [{"name": "handoff", "mountPath": dir_text}],
            }],
            "volumes": [{"name": "handoff", "hostPath": {"path": dir_text, "type": "Directory"}}],
        });
        if let Ok(kept) = std::fs::read_link(dir.join("cache").join("data")) {
            // A kept data cache (`keepCache`) lives outside the handoff directory.
            let kept = kept.to_string_lossy();
            if let Some(v) = spec["containers"][0]["volumeMounts"].as_array_mut() {
                v.push(json!({"name": "cache", "mountPath": kept}));
            }
            if let Some(v) = spec["volumes"].as_array_mut() {
                v.push(json!({"name": "cache", "hostPath": {"path": kept, "type": "Directory"}}));
            }
        }
        if let Some(sa) = &s.service_account {
            spec["serviceAccountName"] = json!(sa);
        }
        if let Some(pc) = &s.priority_class {
            spec["priorityClassName"] = json!(pc);
        }
        if s.host_network {
            spec["hostNetwork"] = json!(true);
            spec["dnsPolicy"] = json!("ClusterFirstWithHostNet");
        }
        let pod = json!({
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {
                "name": Self::pod_name(mount, generation),
                "namespace": s.namespace,
                "labels": self.labels(mount),
                "annotations": {
                    "s3csi.dev/volume-id": req.volume_id,
                    "s3csi.dev/target": req.target.to_string_lossy(),
                    "s3csi.dev/generation": generation.to_string(),
                },
                "ownerReferences": self.owner(),
            },
            "spec": spec,
        });
        serde_json::from_value(pod)
            .map_err(|e| MountError::other(format!("cannot build the mounter pod: {e}")))
    }

    /// Creates (or recreates) the credentials Secret of a mount.
    async fn put_secret(
        &self,
        mount: &str,
        env: &[(&'static str, String)],
    ) -> Result<String, MountError> {
        let name = Self::secret_name(mount);
        let data: BTreeMap<&str, &str> = env
            .iter()
            .filter(|(k, _)| mount_credential_keys().any(|c| c == *k))
            .map(|(k, v)| (*k, v.as_str()))
            .collect();
        let secret: Secret = serde_json::from_value(json!({
            "apiVersion": "v1",
            "kind": "Secret",
            "metadata": {"name": name, "namespace": self.settings.namespace,
                         "labels": self.labels(mount), "ownerReferences": self.owner()},
            "type": "Opaque",
            "stringData": data,
        }))
        .map_err(|e| MountError::other(format!("cannot build the mounter secret: {e}")))?;
        match self.secrets.create(&PostParams::default(), &secret).await {
            Ok(_) => Ok(name),
            Err(e) if is_status(&e, 409) => {
                // Left by an earlier mount of the same target: its keys may be stale.
                self.delete_secret(&name).await?;
                self.secrets
                    .create(&PostParams::default(), &secret)
                    .await
                    .map_err(|e| api_error("cannot create the mounter secret", e))?;
                Ok(name)
            }
            Err(e) => Err(api_error("cannot create the mounter secret", e)),
        }
    }

    /// Starts the mounter Pod of `mount`. Its credentials, in this order: the volume's own
    /// (`req.env`, from the CSI secrets); for a replacement, the mount's existing Secret;
    /// the node service's own static keys (the chart's `awsCredentials`), which a child
    /// process would have inherited; none (the mounter's service account role).
    pub async fn start(
        &self,
        req: &MountRequest,
        mount: &str,
        dir: &Path,
        recover: bool,
        generation: u32,
    ) -> Result<String, MountError> {
        let name = Self::secret_name(mount);
        let existing = if recover {
            match self.secrets.get_opt(&name).await {
                Ok(found) => found.map(|_| name.clone()),
                Err(e) => return Err(api_error("cannot read the mounter secret", e)),
            }
        } else {
            None
        };
        if recover
            && existing.is_none()
            && req.env.is_empty()
            && dir.join(super::pod_credentials::TOKEN_FILE).exists()
        {
            // It ran with a pod's own credentials, which were in that Secret: never
            // replace them with the node's.
            return Err(MountError::other(format!(
                "the mounter secret {name} of a mount with a pod's credentials is gone; not \
                 replacing its mounter with other credentials"
            )));
        }
        let secret = match (existing, req.env.is_empty(), node_credentials()) {
            (_, false, _) => Some(self.put_secret(mount, &req.env).await?),
            (Some(found), true, _) => Some(found),
            (None, true, Some(own)) => Some(self.put_secret(mount, &own).await?),
            (None, true, None) => {
                // A Secret left by an earlier mount of this target must not be used.
                self.delete_secret(&name).await?;
                None
            }
        };
        let pod = self.pod_manifest(req, mount, dir, recover, generation, secret.as_deref())?;
        let name = Self::pod_name(mount, generation);
        match self.pods.create(&PostParams::default(), &pod).await {
            Ok(_) => {}
            Err(e) if is_status(&e, 409) => {
                // A Pod of the same generation outlived its node service: it cannot hold
                // our descriptor, so it goes.
                self.delete_pod(&name, 0).await?;
                self.pods
                    .create(&PostParams::default(), &pod)
                    .await
                    .map_err(|e| api_error("cannot create the mounter pod", e))?;
            }
            Err(e) => return Err(api_error("cannot create the mounter pod", e)),
        }
        tracing::info!(
            pod = name,
            namespace = self.settings.namespace,
            recover,
            "created mounter pod"
        );
        Ok(name)
    }

    /// Deletes a Pod (`grace` seconds for its SIGTERM: the mounter completes uploads).
    /// A Pod that is already gone is fine.
    pub async fn delete_pod(&self, name: &str, grace: u32) -> Result<(), MountError> {
        let params = DeleteParams {
            grace_period_seconds: Some(grace),
            ..Default::default()
        };
        match self.pods.delete(name, &params).await {
            Ok(_) => Ok(()),
            Err(e) if is_status(&e, 404) => Ok(()),
            Err(e) => Err(api_error("cannot delete the mounter pod", e)),
        }
    }

    pub async fn delete_secret(&self, name: &str) -> Result<(), MountError> {
        match self.secrets.delete(name, &DeleteParams::default()).await {
            Ok(_) => Ok(()),
            Err(e) if is_status(&e, 404) => Ok(()),
            Err(e) => Err(api_error("cannot delete the mounter secret", e)),
        }
    }

    /// What the API server says about the (starting) mounter Pod `name`: its status and
    /// the Events about it. Events are optional: without RBAC for them (an older chart),
    /// the status alone is read, and that is logged once.
    pub async fn inspect(&self, name: &str) -> Result<PodState, MountError> {
        let look = async {
            let Some(pod) = self
                .pods
                .get_opt(name)
                .await
                .map_err(|e| api_error("cannot read the mounter pod", e))?
            else {
                return Ok(PodState::Deleted);
            };
            let mut events = vec![];
            if !self.events_denied.load(Ordering::Relaxed) {
                let params = ListParams::default().fields(&format!(
                    "involvedObject.kind=Pod,involvedObject.name={name}"
                ));
                match self.events.list(&params).await {
                    Ok(list) => events = list.items,
                    Err(e) if is_status(&e, 403) => {
                        self.events_denied.store(true, Ordering::Relaxed);
                        tracing::warn!(error = %e,
                            "cannot list events; a mounter pod that does not start is \
                             explained from its status only (the chart's node RBAC grants \
                             list on events)");
                    }
                    Err(e) => tracing::debug!(pod = name, error = %e, "cannot list events"),
                }
            }
            Ok(pod_status::assess(&pod, &events))
        };
        match tokio::time::timeout(INSPECT_TIMEOUT, look).await {
            Ok(state) => state,
            Err(_) => Err(MountError::other(format!(
                "the API server did not answer within {INSPECT_TIMEOUT:?}"
            ))),
        }
    }

    /// Names of this node's mounter Pods and Secrets, with the mount each belongs to.
    pub async fn list_managed(
        &self,
    ) -> Result<(Vec<(String, String)>, Vec<(String, String)>), MountError> {
        let params = ListParams::default().labels(&self.selector());
        let mount_of = |m: &kube::api::ObjectMeta| {
            (
                m.name.clone().unwrap_or_default(),
                m.labels
                    .as_ref()
                    .and_then(|l| l.get(LABEL_MOUNT).cloned())
                    .unwrap_or_default(),
            )
        };
        let pods = self
            .pods
            .list(&params)
            .await
            .map_err(|e| api_error("cannot list mounter pods", e))?
            .items
            .iter()
            .map(|p| mount_of(&p.metadata))
            .collect();
        let secrets = self
            .secrets
            .list(&params)
            .await
            .map_err(|e| api_error("cannot list mounter secrets", e))?
            .items
            .iter()
            .map(|s| mount_of(&s.metadata))
            .collect();
        Ok((pods, secrets))
    }
}

/// The node service's own static keys, if it has them in its environment.
fn node_credentials() -> Option<Vec<(&'static str, String)>> {
    let env: Vec<(&'static str, String)> = CREDENTIAL_KEYS
        .iter()
        .filter_map(|k| std::env::var(k).ok().map(|v| (*k, v)))
        .filter(|(_, v)| !v.is_empty())
        .collect();
    let has = |k: &str| env.iter().any(|(key, _)| *key == k);
    (has("AWS_ACCESS_KEY_ID") && has("AWS_SECRET_ACCESS_KEY")).then_some(env)
}

/// A label value from a node name: node names are DNS subdomains (≤ 253 characters), label
/// values are at most 63.
fn label_value(s: &str) -> String {
    if s.len() <= 63 {
        return s.to_string();
    }
    let mut h: u64 = 0xcbf29ce484222325;
    for b in s.bytes() {
        h ^= b as u64;
        h = h.wrapping_mul(0x100000001b3);
    }
    format!("{}-{h:016x}", &s[..46])
}

/// Watches a mounter Pod from this node: it has exited once its control socket refuses
/// connections, or once it left a failure in the handoff directory. The watch ends when
/// nobody else holds the returned flag any more (the mount was dropped).
fn watch_pod(dir: &Path, name: &str) -> ExitFlag {
    let exited: ExitFlag = Arc::new(Mutex::new(None));
    let flag = exited.clone();
    let dir = dir.to_path_buf();
    let name = name.to_string();
    tokio::spawn(async move {
        loop {
            tokio::time::sleep(SUPERVISE_EVERY).await;
            if Arc::strong_count(&flag) == 1 {
                return;
            }
            if let Some(failure) = handoff::read_failure(&dir) {
                *flag.lock().unwrap() = Some(format!("failed: {failure}"));
                return;
            }
            let d = dir.clone();
            if blocking(move || handoff::ping(&d)).await == handoff::Answer::Refused {
                tracing::info!(pod = name, "mounter pod stopped serving");
                *flag.lock().unwrap() = Some("its control socket is closed".into());
                return;
            }
        }
    });
    exited
}

impl PodLauncher {
    async fn delete_now(&self, m: &MounterHandle) {
        if let Some(name) = &m.pod {
            if let Err(e) = self.delete_pod(name, 0).await {
                tracing::warn!(pod = name, error = %e, "cannot delete the mounter pod");
            }
        }
    }
}

#[async_trait]
impl MounterBackend for PodLauncher {
    async fn start(
        &self,
        req: &MountRequest,
        dir: &Path,
        recover: bool,
        generation: u32,
    ) -> Result<MounterHandle, MountError> {
        let name =
            PodLauncher::start(self, req, &mount_id(&req.target), dir, recover, generation).await?;
        let mut handle = MounterHandle::new(0, Some(name.clone()), watch_pod(dir, &name));
        handle.start_watch = Some(Arc::new(Mutex::new(pod_status::StartWatch::new(
            &name, &req.scrub,
        ))));
        Ok(handle)
    }

    fn answered_by(&self, _m: &MounterHandle, pong: &str) -> bool {
        // A Pod's process has a pid of its own namespace; its socket is its alone.
        pong.starts_with("OK pid=")
    }

    fn gone(&self, m: &MounterHandle) -> Option<String> {
        let exited = m.exited.lock().unwrap();
        exited.as_ref().map(|s| format!("{m} stopped ({s})"))
    }

    async fn kill(&self, m: &MounterHandle) {
        self.delete_now(m).await
    }

    async fn discard(&self, m: &MounterHandle) {
        // Its process is gone; the Pod object (phase Failed) is not.
        self.delete_now(m).await
    }

    async fn stop(&self, _target: &Path, m: &MounterHandle, deadline: Instant) {
        let Some(name) = &m.pod else { return };
        // Deleting the Pod gives the mounter its SIGTERM and grace period.
        let grace = deadline
            .saturating_duration_since(Instant::now())
            .as_secs()
            .max(1) as u32;
        if let Err(e) = self.delete_pod(name, grace).await {
            tracing::warn!(pod = name, error = %e, "cannot delete the mounter pod");
        }
        while !m.has_exited() && Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        if !m.has_exited() {
            tracing::warn!(
                pod = name,
                "mounter pod did not stop in time; deleting it now"
            );
            self.delete_now(m).await;
        }
    }

    async fn check_start(&self, m: &MounterHandle) -> Result<(), MountError> {
        let Some(watch) = &m.start_watch else {
            return Ok(());
        };
        let pod = watch.lock().unwrap().pod().to_string();
        match self.inspect(&pod).await {
            Ok(state) => watch.lock().unwrap().observe(state, Instant::now()),
            Err(e) => {
                tracing::debug!(pod, error = %e, "cannot read the mounter pod's status");
                Ok(())
            }
        }
    }

    async fn exit_error(&self, m: &MounterHandle, _scrub: &[String]) -> MountError {
        let Some(watch) = &m.start_watch else {
            return MountError::other(format!("{m} stopped without a message"));
        };
        let pod = watch.lock().unwrap().pod().to_string();
        // The API server may lag kubelet a little behind the socket.
        let until = Instant::now() + Duration::from_secs(3);
        loop {
            if let Ok(state) = self.inspect(&pod).await {
                if let Err(e) = watch.lock().unwrap().observe(state, Instant::now()) {
                    return e;
                }
            }
            if Instant::now() >= until {
                break;
            }
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
        let last = watch.lock().unwrap().last().map(|r| r.to_string());
        MountError::other(format!(
            "the mounter pod {pod} stopped without a message{}",
            last.map(|r| format!("; last seen: {r}"))
                .unwrap_or_default()
        ))
    }

    fn start_timeout(&self, m: &MounterHandle, waited: Duration, _scrub: &[String]) -> String {
        let watch = m.start_watch.as_ref().map(|w| w.lock().unwrap());
        let last = watch
            .as_ref()
            .and_then(|w| w.last().map(|r| r.to_string()))
            .unwrap_or_else(|| "no reason in its status or events".to_string());
        format!(
            "the mounter pod {} was not ready within {waited:?}; last seen: {last}",
            m.pod.as_deref().unwrap_or("?")
        )
    }

    fn adopt(&self, record: &MountRecord) -> (MounterHandle, bool) {
        let name = record.pod.clone().unwrap_or_default();
        let alive = handoff::ping(&record.handoff_dir) == handoff::Answer::Serving;
        let exited = watch_pod(&record.handoff_dir, &name);
        (MounterHandle::new(record.pid, Some(name), exited), alive)
    }

    fn replacement_credentials(&self, _record: &MountRecord) -> Vec<(&'static str, String)> {
        // A mounter Pod's credentials stay in its Secret, which its replacement reads too.
        vec![]
    }

    async fn release(&self, target: &Path) {
        if let Err(e) = self
            .delete_secret(&PodLauncher::secret_name(&mount_id(target)))
            .await
        {
            tracing::warn!(error = %e, "cannot delete the mounter secret");
        }
    }

    async fn reconcile(&self, live: &[(PathBuf, MounterHandle)]) -> Result<(), MountError> {
        let live_pods: Vec<&str> = live.iter().filter_map(|(_, m)| m.pod.as_deref()).collect();
        let live_mounts: Vec<String> = live.iter().map(|(t, _)| mount_id(t)).collect();
        let (found_pods, found_secrets) = self.list_managed().await?;
        for (name, _) in found_pods
            .iter()
            .filter(|(n, _)| !live_pods.contains(&n.as_str()))
        {
            tracing::info!(pod = name, "deleting a mounter pod that serves no mount");
            self.delete_pod(name, self.settings().termination_grace_seconds)
                .await?;
        }
        for (name, mount) in found_secrets.iter() {
            if !live_mounts.contains(mount) {
                tracing::info!(secret = name, "deleting a mounter secret of no mount");
                self.delete_secret(name).await?;
            }
        }
        Ok(())
    }
}
