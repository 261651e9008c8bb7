//! What CreateVolume records in S3 about each volume it makes, and where.
//!
//! A volume is the prefix `base/<leaf>/`; its record is the small JSON object
//! `base/.s3csi-volumes/<leaf>.json` next to it. The record is how a repeated CreateVolume
//! tells the same request from an incompatible one (another capacity, another name that
//! sanitises to the same leaf) after any restart of the controller, and how DeleteVolume
//! tells a volume it made from any other prefix, which it never deletes.
//!
//! Why beside the prefix and not in it: an object under the prefix would show in the
//! volume's mount (where a workload could delete it, or an application that wants an
//! empty directory would trip over it), and the marker object `base/<leaf>/` cannot carry
//! it, as MinIO refuses a key ending in `/` with a body. Beside it, the record stays under
//! the StorageClass's `basePrefix`, so credentials limited to that prefix reach it.

use super::error::Result;
use crate::s3::{ObjectClient, S3Error};
use bytes::Bytes;

/// The directory of records in each base prefix. No volume may have this leaf: its prefix
/// would hold the records of its neighbours.
pub const RECORDS_DIR: &str = ".s3csi-volumes";

/// Largest record we read; anything bigger at a record's key is not one of ours.
const MAX_RECORD_BYTES: u64 = 4096;

/// What CreateVolume gave the volume.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VolumeRecord {
    /// The CreateVolume name (the PV name), before it was sanitised into the leaf.
    pub name: String,
    /// The capacity CreateVolume returned; 0 when the request had no capacity range.
    pub capacity_bytes: i64,
}

/// What is at a record's key.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Recorded {
    Volume(VolumeRecord),
    Nothing,
    /// Something that is not a record we wrote.
    Unreadable(String),
}

/// The key of the record of the volume at `prefix` (`base/<leaf>/`). None where
/// CreateVolume never makes a volume: the whole bucket, and a records directory.
pub fn record_key(prefix: &str) -> Option<String> {
    let path = prefix.trim_end_matches('/');
    let (base, leaf) = match path.rsplit_once('/') {
        Some((base, leaf)) => (format!("{base}/"), leaf),
        None => (String::new(), path),
    };
    if leaf.is_empty() || leaf == RECORDS_DIR {
        return None;
    }
    Some(format!("{base}{RECORDS_DIR}/{leaf}.json"))
}

impl VolumeRecord {
    pub fn to_json(&self) -> Bytes {
        let value = serde_json::json!({
            "name": self.name,
            "capacityBytes": self.capacity_bytes,
        });
        Bytes::from(value.to_string())
    }

    pub fn from_json(body: &[u8]) -> Option<Self> {
        let value: serde_json::Value = serde_json::from_slice(body).ok()?;
        Some(Self {
            name: value.get("name")?.as_str()?.to_string(),
            capacity_bytes: value.get("capacityBytes")?.as_i64().filter(|c| *c >= 0)?,
        })
    }
}

/// Reads the record at `key`. A missing bucket is an error (NotFound), not `Nothing`.
pub async fn read(client: &dyn ObjectClient, key: &str) -> Result<Recorded> {
    let meta = match client.head_object(key).await {
        Ok(meta) => meta,
        Err(S3Error::NotFound) => return Ok(Recorded::Nothing),
        Err(e) => return Err(e.into()),
    };
    if meta.size == 0 || meta.size > MAX_RECORD_BYTES {
        return Ok(Recorded::Unreadable(format!(
            "{key} has {} bytes, not a volume record",
            meta.size
        )));
    }
    let body = match client.get_range(key, 0, meta.size).await {
        Ok(body) => body,
        // Deleted between the two requests: a DeleteVolume finished meanwhile.
        Err(S3Error::NotFound) => return Ok(Recorded::Nothing),
        Err(e) => return Err(e.into()),
    };
    Ok(match VolumeRecord::from_json(&body) {
        Some(record) => Recorded::Volume(record),
        None => Recorded::Unreadable(format!("{key} is not a volume record")),
    })
}

/// Writes (or rewrites) the record at `key`.
pub async fn write(client: &dyn ObjectClient, key: &str, record: &VolumeRecord) -> Result<()> {
    client.put_object(key, record.to_json()).await?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::s3::mem::MemClient;

    #[test]
    fn records_sit_beside_the_volume_under_its_base_prefix() {
        assert_eq!(
            record_key("k8s/pvc-1/").as_deref(),
            Some("k8s/.s3csi-volumes/pvc-1.json")
        );
        assert_eq!(
            record_key("a/b/pvc-1/").as_deref(),
            Some("a/b/.s3csi-volumes/pvc-1.json")
        );
        assert_eq!(
            record_key("pvc-1/").as_deref(),
            Some(".s3csi-volumes/pvc-1.json")
        );
        assert_eq!(record_key(""), None);
        assert_eq!(record_key("k8s/.s3csi-volumes/"), None);
        // Never inside the volume, whatever the names.
        for prefix in ["k8s/pvc-1/", "x/", ".s3csi-volumes/x/"] {
            assert!(!record_key(prefix).unwrap().starts_with(prefix), "{prefix}");
        }
    }

    #[test]
    fn records_read_back_and_strangers_are_not_records() {
        let r = VolumeRecord {
            name: "pvc \"1\"".into(),
            capacity_bytes: 10 << 30,
        };
        assert_eq!(VolumeRecord::from_json(&r.to_json()), Some(r));
        for other in [
            &b""[..],
            b"hello",
            b"{}",
            b"{\"name\":\"x\"}",
            b"{\"name\":\"x\",\"capacityBytes\":-1}",
            b"{\"name\":1,\"capacityBytes\":1}",
        ] {
            assert_eq!(VolumeRecord::from_json(other), None, "{other:?}");
        }
    }

    #[tokio::test]
    async fn read_tells_records_nothing_and_strangers_apart() {
        let mem = MemClient::new();
        let r = VolumeRecord {
            name: "pvc-1".into(),
            capacity_bytes: 1,
        };
        write(&mem, "a/.s3csi-volumes/pvc-1.json", &r)
            .await
            .unwrap();
        mem.put_object("a/.s3csi-volumes/x.json", Bytes::from_static(b"not json"))
            .await
            .unwrap();
        assert_eq!(
            read(&mem, "a/.s3csi-volumes/pvc-1.json").await.unwrap(),
            Recorded::Volume(r)
        );
        assert_eq!(
            read(&mem, "a/.s3csi-volumes/none.json").await.unwrap(),
            Recorded::Nothing
        );
        assert!(matches!(
            read(&mem, "a/.s3csi-volumes/x.json").await.unwrap(),
            Recorded::Unreadable(_)
        ));
    }
}
