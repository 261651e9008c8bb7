//! Where mounters run: the one seam between the mount manager and a child process or a
//! Pod. The manager never asks which one it has.

use super::state::MountRecord;
use super::{MountError, MountRequest};
use async_trait::async_trait;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Instant;

/// Set once a mounter has stopped, to what its exit looked like.
pub type ExitFlag = Arc<Mutex<Option<String>>>;

/// A started or adopted mounter.
#[derive(Clone)]
pub struct MounterHandle {
    /// Its process, as this node sees it; 0 for a Pod (its pid is in another namespace).
    pub pid: u32,
    /// Pod mode: the Pod.
    pub pod: Option<String>,
    pub exited: ExitFlag,
    /// Where its stderr goes, and how long that file was when it started: its last words
    /// when it stopped without a [`super::handoff::Failure`] (a panic, a signal).
    pub log: Option<(PathBuf, u64)>,
    /// Pod mode, while starting: what the Pod's status and Events said so far.
    pub start_watch: Option<Arc<Mutex<super::pod_status::StartWatch>>>,
}

impl MounterHandle {
    pub fn new(pid: u32, pod: Option<String>, exited: ExitFlag) -> Self {
        Self {
            pid,
            pod,
            exited,
            log: None,
            start_watch: None,
        }
    }

    pub fn has_exited(&self) -> bool {
        self.exited.lock().unwrap().is_some()
    }
}

impl std::fmt::Display for MounterHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &self.pod {
            Some(pod) => write!(f, "the mounter pod {pod}"),
            None => write!(f, "the mounter process {}", self.pid),
        }
    }
}

#[async_trait]
pub trait MounterBackend: Send + Sync + 'static {
    /// Starts `s3csi mount --foreground --handoff-dir DIR [--recover] ARGS SOURCE TARGET`;
    /// `generation` counts the mounters this mount has had.
    async fn start(
        &self,
        req: &MountRequest,
        dir: &Path,
        recover: bool,
        generation: u32,
    ) -> Result<MounterHandle, MountError>;

    /// Is `pong`, the answer to PING on the mount's control socket, this mounter's?
    fn answered_by(&self, m: &MounterHandle, pong: &str) -> bool;

    /// Why the mounter no longer serves, if it does not.
    fn gone(&self, m: &MounterHandle) -> Option<String>;

    /// Stops it at once (SIGKILL, or Pod deletion without grace).
    async fn kill(&self, m: &MounterHandle);

    /// Removes what is left of a mounter that died (its Pod object); nothing for a process,
    /// whose pid may already be someone else's.
    async fn discard(&self, m: &MounterHandle);

    /// Asks it to stop (it completes open uploads), waits until `deadline`, then kills it.
    async fn stop(&self, target: &Path, m: &MounterHandle, deadline: Instant);

    /// Called about once a second while a started mounter is not listening yet: an error
    /// once it is clear it never will (its Pod cannot start).
    async fn check_start(&self, m: &MounterHandle) -> Result<(), MountError>;

    /// Why a mounter that stopped before listening, and left no failure record, did so.
    async fn exit_error(&self, m: &MounterHandle, scrub: &[String]) -> MountError;

    /// What a mounter not listening by its deadline was doing (it is being killed).
    fn start_timeout(
        &self,
        m: &MounterHandle,
        waited: std::time::Duration,
        scrub: &[String],
    ) -> String;

    /// The mounter an earlier node service left for `record`, and whether it still
    /// answers (a dead one is adopted too while its mount is there: it is replaced).
    fn adopt(&self, record: &MountRecord) -> (MounterHandle, bool);

    /// Credentials a replacement of the adopted mounter of `record` needs, read back from
    /// where they live (never from disk).
    fn replacement_credentials(&self, record: &MountRecord) -> Vec<(&'static str, String)>;

    /// Deletes what the backend keeps for the mount on `target` once it is gone (Secrets).
    async fn release(&self, target: &Path);

    /// After recovery: deletes this node's mounter objects that serve none of `live`
    /// (targets with their mounters).
    async fn reconcile(&self, live: &[(PathBuf, MounterHandle)]) -> Result<(), MountError>;
}
