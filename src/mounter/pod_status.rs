//! Why a mounter Pod does not serve, from what the API server says about it: its status
//! (phase, conditions, the container's state) and the Events about it.
//!
//! While the node service waits for a new mounter Pod's control socket it reads both every
//! [`INSPECT_EVERY`] ([`super::pod::PodLauncher::inspect`]) and feeds them to a
//! [`StartWatch`], which fails the mount
//! - at once when the Pod will never serve by itself: phase Failed (kubelet refused it at
//!   admission, evicted it) or Succeeded, its container terminated (`restartPolicy:
//!   Never`), or the container waits on an image that cannot be pulled or a container that
//!   cannot be created ([`FATAL_WAITING`]);
//! - after [`STUCK_GRACE`] when the Pod is stuck on something the scheduler or kubelet
//!   retries but that seldom clears by itself: unschedulable, no sandbox, a volume that
//!   cannot be mounted ([`STUCK_EVENTS`]);
//!
//! and otherwise remembers the last thing it saw (ContainerCreating, `Pulling image …`),
//! which the mount timeout reports.

use k8s_openapi::api::core::v1::{ContainerStateTerminated, Event, Pod};
use k8s_openapi::jiff::Timestamp;
use std::fmt;
use std::time::{Duration, Instant};

use super::{FailureKind, MountError};

/// How often the node service reads a starting mounter Pod's status and Events.
pub const INSPECT_EVERY: Duration = Duration::from_secs(1);

/// How long a mounter Pod may be stuck on something the scheduler or kubelet retries before
/// the publish fails with that reason: long enough for a hiccup (one failed sandbox
/// attempt) to clear, far shorter than the mount timeout. kubelet retries the publish
/// anyway, with a new Pod.
pub const STUCK_GRACE: Duration = Duration::from_secs(10);

/// The mounter Pod's only container.
pub const CONTAINER: &str = "mounter";

/// Container waiting reasons (kubelet's names) after which the container does not run by
/// itself. kubelet does retry image pulls (`ErrImagePull` → `ImagePullBackOff` → …), but an
/// image that is missing, private or not on the node with `imagePullPolicy: Never` stays so
/// until someone fixes it, and a publish that waits the whole mount timeout for it helps
/// nobody: kubelet retries the publish itself.
pub const FATAL_WAITING: [&str; 13] = [
    "ErrImagePull",
    "ImagePullBackOff",
    "ErrImageNeverPull",
    "InvalidImageName",
    "ImageInspectError",
    "RegistryUnavailable",
    "SignatureValidationFailed",
    "CreateContainerConfigError",
    "CreateContainerError",
    "PreCreateHookError",
    "PreStartHookError",
    "RunContainerError",
    "CrashLoopBackOff",
];

/// Warning Events (their reasons) that mean the Pod is stuck before its container can be
/// created: the scheduler or kubelet keeps retrying, which seldom helps.
pub const STUCK_EVENTS: [&str; 6] = [
    "FailedScheduling",
    "FailedCreatePodSandBox",
    "FailedPodSandBoxStatus",
    "FailedMount",
    "FailedAttachVolume",
    "NetworkNotReady",
];

/// Longest message kept from a status or an Event (sandbox errors quote whole CNI
/// answers): the reason and the Pod's name must stay readable in a gRPC status.
const MAX_MESSAGE: usize = 400;

/// Something the API server said about a mounter Pod.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PodReason {
    /// A Kubernetes reason: `ErrImagePull`, `Unschedulable`, `FailedCreatePodSandBox`, …
    pub reason: String,
    pub message: String,
    /// Where it was seen: `container mounter waiting`, `condition PodScheduled`, `Warning
    /// event from kubelet, 3 times`, …
    pub seen_in: String,
}

impl PodReason {
    fn new(reason: &str, message: Option<&str>, seen_in: impl Into<String>) -> Self {
        let mut message = message.unwrap_or("").trim().replace('\n', " ");
        if message.len() > MAX_MESSAGE {
            let mut end = MAX_MESSAGE;
            while !message.is_char_boundary(end) {
                end -= 1;
            }
            message.truncate(end);
            message.push('…');
        }
        Self {
            reason: reason.to_string(),
            message,
            seen_in: seen_in.into(),
        }
    }

    fn scrubbed(mut self, scrub: &[String]) -> Self {
        self.message = super::scrub_text(&self.message, scrub);
        self
    }
}

impl fmt::Display for PodReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.message.is_empty() {
            true => write!(f, "{} ({})", self.reason, self.seen_in),
            false => write!(f, "{}: {} ({})", self.reason, self.message, self.seen_in),
        }
    }
}

/// What a mounter Pod's status and Events say about it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PodState {
    /// Its container runs: the node service waits for its control socket.
    Running,
    /// Being scheduled, pulled, created; with the latest thing said about it, if any.
    Starting(Option<PodReason>),
    /// Stuck on something the scheduler or kubelet retries.
    Stuck(PodReason),
    /// It will never serve.
    Failed(PodReason),
    /// The Pod object is gone (deleted by someone else, or garbage-collected).
    Deleted,
}

fn terminated(t: &ContainerStateTerminated, seen_in: &str) -> PodReason {
    let reason = t.reason.as_deref().unwrap_or("Terminated");
    let mut message = match t.signal {
        Some(sig) => format!("exit code {}, signal {sig}", t.exit_code),
        None => format!("exit code {}", t.exit_code),
    };
    if let Some(m) = t.message.as_deref().filter(|m| !m.trim().is_empty()) {
        message = format!("{}; {message}", m.trim());
    }
    PodReason::new(reason, Some(&message), seen_in)
}

/// When an Event last happened (the events.k8s.io fields first, then the core/v1 ones).
fn event_time(e: &Event) -> Option<Timestamp> {
    e.series
        .as_ref()
        .and_then(|s| s.last_observed_time.as_ref().map(|t| t.0))
        .or(e.last_timestamp.as_ref().map(|t| t.0))
        .or(e.event_time.as_ref().map(|t| t.0))
        .or(e.first_timestamp.as_ref().map(|t| t.0))
        .or(e.metadata.creation_timestamp.as_ref().map(|t| t.0))
}

fn from_event(e: &Event) -> PodReason {
    let kind = e.type_.as_deref().unwrap_or("Normal");
    let by = e
        .source
        .as_ref()
        .and_then(|s| s.component.as_deref())
        .or(e.reporting_component.as_deref())
        .filter(|c| !c.is_empty());
    let count = e
        .series
        .as_ref()
        .and_then(|s| s.count)
        .or(e.count)
        .unwrap_or(1);
    let mut seen_in = format!("{kind} event");
    if let Some(by) = by {
        seen_in.push_str(&format!(" from {by}"));
    }
    if count > 1 {
        seen_in.push_str(&format!(", {count} times"));
    }
    PodReason::new(
        e.reason.as_deref().unwrap_or("Unknown"),
        e.message.as_deref(),
        seen_in,
    )
}

/// Reads a Pod's status and the Events about it (any Pod of that name: only those about
/// this one, by uid, count).
pub fn assess(pod: &Pod, events: &[Event]) -> PodState {
    let status = pod.status.as_ref();
    let phase = status.and_then(|s| s.phase.as_deref()).unwrap_or("Pending");
    let container = status
        .and_then(|s| s.container_statuses.as_ref())
        .and_then(|cs| cs.iter().find(|c| c.name == CONTAINER).or(cs.first()));
    let state = container.and_then(|c| c.state.as_ref());
    if matches!(phase, "Failed" | "Succeeded") {
        // kubelet's own reason first (admission refusals: OutOfcpu, NodeAffinity,
        // UnexpectedAdmissionError; Evicted), else what the container ended with.
        let own = status.and_then(|s| s.reason.as_deref()).map(|r| {
            PodReason::new(
                r,
                status.and_then(|s| s.message.as_deref()),
                format!("pod phase {phase}"),
            )
        });
        let ended = state
            .and_then(|s| s.terminated.as_ref())
            .map(|t| terminated(t, &format!("pod phase {phase}, container {CONTAINER}")));
        return PodState::Failed(own.or(ended).unwrap_or_else(|| {
            PodReason::new(
                phase,
                status.and_then(|s| s.message.as_deref()),
                "pod phase",
            )
        }));
    }
    let mut waiting = None;
    if let Some(state) = state {
        if let Some(t) = &state.terminated {
            return PodState::Failed(terminated(t, &format!("container {CONTAINER} terminated")));
        }
        if state.running.is_some() {
            return PodState::Running;
        }
        if let Some(w) = &state.waiting {
            let reason = w.reason.as_deref().unwrap_or("Waiting");
            let seen = PodReason::new(
                reason,
                w.message.as_deref(),
                format!("container {CONTAINER} waiting"),
            );
            if FATAL_WAITING.contains(&reason) {
                return PodState::Failed(seen);
            }
            waiting = Some(seen);
        }
    }
    let unscheduled = status.and_then(|s| s.conditions.as_ref()).and_then(|cs| {
        cs.iter()
            .find(|c| c.type_ == "PodScheduled" && c.status == "False")
    });
    if let Some(c) = unscheduled {
        let seen = PodReason::new(
            c.reason.as_deref().unwrap_or("Unschedulable"),
            c.message.as_deref(),
            "condition PodScheduled",
        );
        // A nominated node: the scheduler is preempting lower-priority Pods for it.
        return match status.and_then(|s| s.nominated_node_name.as_deref()) {
            Some(node) if !node.is_empty() => PodState::Starting(Some(PodReason {
                seen_in: format!("condition PodScheduled; preempting Pods on {node}"),
                ..seen
            })),
            _ => PodState::Stuck(seen),
        };
    }
    let uid = pod.metadata.uid.as_deref();
    let latest = events
        .iter()
        .filter(|e| match (e.involved_object.uid.as_deref(), uid) {
            (Some(a), Some(b)) => a == b,
            _ => true,
        })
        // Newest first; core/v1 times have whole seconds and events.k8s.io ones
        // microseconds, so within a second a Warning is the news.
        .max_by_key(|e| {
            (
                event_time(e).map(|t| t.as_second()),
                e.type_.as_deref() == Some("Warning"),
            )
        });
    match latest {
        Some(e)
            if e.type_.as_deref() == Some("Warning")
                && STUCK_EVENTS.contains(&e.reason.as_deref().unwrap_or("")) =>
        {
            PodState::Stuck(from_event(e))
        }
        Some(e) => PodState::Starting(Some(from_event(e))),
        None => PodState::Starting(waiting),
    }
}

/// Follows one starting mounter Pod: fails when it will not serve, remembers what it last
/// said for the mount timeout's message. Every message it keeps is scrubbed.
pub struct StartWatch {
    pod: String,
    scrub: Vec<String>,
    /// Stuck (on whatever reason) without a break since.
    stuck_since: Option<Instant>,
    last: Option<PodReason>,
}

impl StartWatch {
    pub fn new(pod: &str, scrub: &[String]) -> Self {
        Self {
            pod: pod.to_string(),
            scrub: scrub.to_vec(),
            stuck_since: None,
            last: None,
        }
    }

    pub fn pod(&self) -> &str {
        &self.pod
    }

    /// The last thing the API server said about the Pod.
    pub fn last(&self) -> Option<&PodReason> {
        self.last.as_ref()
    }

    fn remember(&mut self, reason: &PodReason) {
        if self.last.as_ref() != Some(reason) {
            tracing::info!(pod = self.pod, %reason, "mounter pod not serving yet");
            self.last = Some(reason.clone());
        }
    }

    /// Takes in what the Pod's status and Events say now. An error when the Pod will never
    /// serve, or has been stuck for [`STUCK_GRACE`].
    pub fn observe(&mut self, state: PodState, now: Instant) -> Result<(), MountError> {
        // These are final failures of the publish: the node service deletes the Pod and
        // its Secret before answering, so nothing is left in progress. FailureKind::Other
        // becomes gRPC Internal, which kubelet counts as final (the mount did not happen);
        // DeadlineExceeded or Unavailable would make it treat the volume as possibly
        // mounted ("uncertain"). kubelet retries the publish with back-off either way, each
        // time with a new Pod.
        let fail = |message: String| MountError {
            kind: FailureKind::Other,
            message,
        };
        match state {
            PodState::Running => {
                self.stuck_since = None;
                Ok(())
            }
            PodState::Starting(seen) => {
                self.stuck_since = None;
                if let Some(seen) = seen {
                    self.remember(&seen.scrubbed(&self.scrub));
                }
                Ok(())
            }
            PodState::Failed(seen) => {
                let seen = seen.scrubbed(&self.scrub);
                self.remember(&seen);
                Err(fail(format!(
                    "the mounter pod {} cannot run: {seen}",
                    self.pod
                )))
            }
            PodState::Deleted => Err(fail(format!(
                "the mounter pod {} was deleted before it served{}",
                self.pod,
                self.last
                    .as_ref()
                    .map(|r| format!("; last seen: {r}"))
                    .unwrap_or_default()
            ))),
            PodState::Stuck(seen) => {
                let seen = seen.scrubbed(&self.scrub);
                self.remember(&seen);
                let since = *self.stuck_since.get_or_insert(now);
                if now.duration_since(since) < STUCK_GRACE {
                    return Ok(());
                }
                Err(fail(format!(
                    "the mounter pod {} did not start within {}s: {seen}",
                    self.pod,
                    STUCK_GRACE.as_secs()
                )))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::{json, Value};

    fn pod(status: Value) -> Pod {
        serde_json::from_value(json!({
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": "s3csi-mounter-x-0", "namespace": "ns", "uid": "uid-1"},
            "spec": {"containers": [{"name": "mounter", "image": "img"}]},
            "status": status,
        }))
        .unwrap()
    }

    fn event(uid: &str, kind: &str, reason: &str, message: &str, last: &str, count: i32) -> Event {
        serde_json::from_value(json!({
            "apiVersion": "v1", "kind": "Event",
            "metadata": {"name": format!("s3csi-mounter-x-0.{reason}"), "namespace": "ns"},
            "involvedObject": {"apiVersion": "v1", "kind": "Pod", "name": "s3csi-mounter-x-0",
                               "namespace": "ns", "uid": uid},
            "reason": reason, "message": message, "type": kind, "count": count,
            "source": {"component": "kubelet", "host": "n"},
            "firstTimestamp": last, "lastTimestamp": last,
        }))
        .unwrap()
    }

    fn waiting(reason: &str, message: &str) -> Value {
        json!({"phase": "Pending", "containerStatuses": [{
            "name": "mounter", "image": "img", "imageID": "", "ready": false,
            "restartCount": 0, "started": false,
            "state": {"waiting": {"reason": reason, "message": message}}}]})
    }

    #[test]
    fn image_errors_are_fatal_container_creating_is_not() {
        for reason in ["ErrImagePull", "ImagePullBackOff", "ErrImageNeverPull"] {
            let PodState::Failed(r) = assess(&pod(waiting(reason, "no image")), &[]) else {
                panic!("{reason}");
            };
            assert_eq!(r.reason, reason);
            assert_eq!(
                r.to_string(),
                format!("{reason}: no image (container mounter waiting)")
            );
        }
        let state = assess(&pod(waiting("ContainerCreating", "")), &[]);
        assert!(
            matches!(&state, PodState::Starting(Some(r)) if r.reason == "ContainerCreating"),
            "{state:?}"
        );
    }

    #[test]
    fn the_latest_event_of_this_pod_counts() {
        let sandbox = event(
            "uid-1",
            "Warning",
            "FailedCreatePodSandBox",
            "Failed to create pod sandbox: cni down",
            "2025-01-01T00:00:05Z",
            3,
        );
        let p = pod(waiting("ContainerCreating", ""));
        let state = assess(&p, std::slice::from_ref(&sandbox));
        let PodState::Stuck(r) = &state else {
            panic!("{state:?}")
        };
        assert_eq!(
            r.to_string(),
            "FailedCreatePodSandBox: Failed to create pod sandbox: cni down \
             (Warning event from kubelet, 3 times)"
        );
        // Progress after the failure: starting again.
        let pulling = event(
            "uid-1",
            "Normal",
            "Pulling",
            "Pulling image \"img\"",
            "2025-01-01T00:00:09Z",
            1,
        );
        let state = assess(&p, &[sandbox.clone(), pulling]);
        assert!(
            matches!(&state, PodState::Starting(Some(r)) if r.reason == "Pulling"),
            "{state:?}"
        );
        // An earlier Pod of the same name is not this one.
        let other = event(
            "uid-0",
            "Warning",
            "FailedCreatePodSandBox",
            "old",
            "2025-01-01T00:00:09Z",
            1,
        );
        assert_eq!(assess(&p, &[other]), assess(&p, &[]));
    }

    #[test]
    fn unschedulable_is_stuck_unless_preempting() {
        let mut status = json!({"phase": "Pending", "conditions": [{
            "type": "PodScheduled", "status": "False", "reason": "Unschedulable",
            "message": "0/1 nodes are available: 1 Insufficient memory.",
            "lastProbeTime": null, "lastTransitionTime": "2025-01-01T00:00:00Z"}]});
        let state = assess(&pod(status.clone()), &[]);
        assert!(
            matches!(&state, PodState::Stuck(r) if r.reason == "Unschedulable"
                && r.message.contains("Insufficient memory")),
            "{state:?}"
        );
        status["nominatedNodeName"] = json!("n");
        assert!(matches!(
            assess(&pod(status), &[]),
            PodState::Starting(Some(_))
        ));
    }

    #[test]
    fn failed_pods_name_kubelets_reason_or_the_containers() {
        let state = assess(
            &pod(json!({"phase": "Failed", "reason": "OutOfmemory",
                        "message": "Pod was rejected: Node didn't have enough resource: memory"})),
            &[],
        );
        assert!(
            matches!(&state, PodState::Failed(r) if r.reason == "OutOfmemory"
                && r.message.starts_with("Pod was rejected")),
            "{state:?}"
        );
        let state = assess(
            &pod(json!({"phase": "Failed", "containerStatuses": [{
                "name": "mounter", "image": "img", "imageID": "", "ready": false,
                "restartCount": 0,
                "state": {"terminated": {"exitCode": 137, "reason": "OOMKilled"}}}]})),
            &[],
        );
        assert!(
            matches!(&state, PodState::Failed(r) if r.to_string()
                == "OOMKilled: exit code 137 (pod phase Failed, container mounter)"),
            "{state:?}"
        );
    }

    #[test]
    fn stuck_fails_after_the_grace_and_messages_are_scrubbed() {
        let scrub = vec!["topsecretvalue".to_string()];
        let mut w = StartWatch::new("p", &scrub);
        let stuck = PodState::Stuck(PodReason::new(
            "FailedMount",
            Some("cannot mount topsecretvalue"),
            "event",
        ));
        let t0 = Instant::now();
        w.observe(stuck.clone(), t0).unwrap();
        w.observe(stuck.clone(), t0 + STUCK_GRACE / 2).unwrap();
        let e = w.observe(stuck.clone(), t0 + STUCK_GRACE).unwrap_err();
        assert_eq!(e.kind, FailureKind::Other);
        assert!(e.message.contains("FailedMount"), "{}", e.message);
        assert!(!e.message.contains("topsecretvalue"), "{}", e.message);
        // Progress in between restarts the grace.
        let mut w = StartWatch::new("p", &[]);
        w.observe(stuck.clone(), t0).unwrap();
        w.observe(PodState::Running, t0 + STUCK_GRACE / 2).unwrap();
        w.observe(stuck, t0 + STUCK_GRACE).unwrap();
    }
}
