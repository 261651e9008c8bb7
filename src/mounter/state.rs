//! The record of each mount in `STATE_DIR/mounts/*.state`, so that a restarted node
//! service adopts its mounts and can replace their mounters later. No credentials, ever.

use std::path::{Path, PathBuf};

#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct MountRecord {
    pub volume_id: String,
    pub target: PathBuf,
    /// The mounter's process (0 for a Pod: its pid is in another namespace).
    pub pid: u32,
    /// Pod mode: the mounter Pod serving this mount.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pod: Option<String>,
    /// The mount's handoff directory (control socket, saved INIT, inode log).
    pub handoff_dir: PathBuf,
    #[serde(default)]
    pub replacements: u32,
    /// What a replacement is started with: `BUCKET[:PREFIX]` and the options.
    pub source: String,
    pub args: Vec<String>,
}

/// Why a state file was not read.
#[derive(Debug, thiserror::Error)]
pub enum RecordError {
    #[error("cannot read {0}: {1}")]
    Io(PathBuf, std::io::Error),
    #[error("{0} is not a mount record: {1}")]
    Malformed(PathBuf, String),
}

impl MountRecord {
    pub fn to_json(&self) -> String {
        serde_json::to_string_pretty(self).expect("a record always serialises")
    }

    pub fn read(path: &Path) -> Result<Self, RecordError> {
        let text =
            std::fs::read_to_string(path).map_err(|e| RecordError::Io(path.to_path_buf(), e))?;
        if text.trim_start().starts_with('{') {
            serde_json::from_str(&text)
                .map_err(|e| RecordError::Malformed(path.to_path_buf(), e.to_string()))
        } else {
            Self::from_key_values(&text)
                .ok_or_else(|| RecordError::Malformed(path.to_path_buf(), "missing fields".into()))
        }
    }

    /// The `key=value` lines earlier node services wrote, so that an upgrade adopts
    /// the mounts they left. Records of mounters that mounted themselves (no handoff
    /// directory) are not adopted any more.
    fn from_key_values(text: &str) -> Option<Self> {
        let field = |key: &str| {
            text.lines()
                .find_map(|l| l.split_once('=').filter(|(k, _)| *k == key).map(|(_, v)| v))
        };
        Some(Self {
            volume_id: field("volume_id")?.to_string(),
            target: PathBuf::from(field("target")?),
            pid: field("pid")?.parse().ok()?,
            pod: field("pod").map(str::to_string),
            handoff_dir: PathBuf::from(field("handoff")?),
            replacements: field("replacements")
                .and_then(|n| n.parse().ok())
                .unwrap_or(0),
            source: field("source")?.to_string(),
            args: text
                .lines()
                .filter_map(|l| l.strip_prefix("arg="))
                .map(str::to_string)
                .collect(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record() -> MountRecord {
        MountRecord {
            volume_id: "vol-1".into(),
            target: "/var/lib/kubelet/pods/x/volumes/kubernetes.io~csi/pv/mount".into(),
            pid: 42,
            pod: Some("s3csi-mounter-abc-0".into()),
            handoff_dir: "/var/lib/s3csi/handoff/mount-abc".into(),
            replacements: 2,
            source: "bucket:prefix/".into(),
            args: vec![
                "--uid".into(),
                "1000".into(),
                "--endpoint-url=http://a,b".into(),
            ],
        }
    }

    #[test]
    fn records_round_trip_through_their_file() {
        let dir = crate::mounter::tests::Scratch::new();
        let path = dir.0.join("m.state");
        std::fs::write(&path, record().to_json()).unwrap();
        assert_eq!(MountRecord::read(&path).unwrap(), record());
        std::fs::write(&path, "{ not json").unwrap();
        assert!(matches!(
            MountRecord::read(&path),
            Err(RecordError::Malformed(..))
        ));
    }

    #[test]
    fn records_of_the_previous_version_are_adopted() {
        let dir = crate::mounter::tests::Scratch::new();
        let path = dir.0.join("m.state");
        let r = record();
        let old = format!(
            "volume_id={}\ntarget={}\npid={}\nhandoff={}\nreplacements=2\npod={}\nsource={}\narg=--uid\narg=1000\narg=--endpoint-url=http://a,b\n",
            r.volume_id,
            r.target.display(),
            r.pid,
            r.handoff_dir.display(),
            r.pod.as_deref().unwrap(),
            r.source
        );
        std::fs::write(&path, old).unwrap();
        assert_eq!(MountRecord::read(&path).unwrap(), r);
        // A self-mounting mounter's record (no handoff directory) is not adopted.
        std::fs::write(&path, "volume_id=v\ntarget=/t\npid=1\n").unwrap();
        assert!(MountRecord::read(&path).is_err());
    }
}
