//! The metadata of object versions this mount has read, kept apart from the inodes.
//!
//! LIST tells no user metadata; a HEAD does, once per version. A version is its key,
//! ETag and Last-Modified to the second (a metadata change by any client, a CopyObject
//! onto itself, changes Last-Modified), and S3 never changes a version: what a HEAD said
//! of one stays true. So an entry evicted from the inode table and listed again, a second
//! walk, a remount of the same cache directory and a replacement mounter need no HEAD for
//! a version already read.
//!
//! Memory: keys and ETags are kept as 64-bit hashes (FNV-1a; both would have to collide,
//! with the same Last-Modified second, for a wrong answer): 32 bytes an entry in a hash
//! table kept between 7/16 and 7/8 full, so 37 to 75 bytes an entry. Objects without
//! metadata (most) share one `PosixMeta`. Past the cap (`--max-known-versions`), the
//! table keeps only keys whose mixed hash is below a threshold, lowered so that a quarter
//! goes, and admits no key above it: which keys are kept does not depend on the order they
//! came in, so walks of more versions than the cap, repeated, find the same 3/4 to all of
//! a cap's worth every time, where dropping the oldest first would find none.
//!
//! On disk (`persist_in`, in the mount's cache directory): an append-only file of
//! records `key hash, ETag hash, Last-Modified (s), length, headers as JSON` (little
//! endian; length 0 for no metadata), compacted when opened. A torn last record (a crash)
//! is ignored; a file of another format is started over.

use super::meta::PosixMeta;
use crate::s3::UserMeta;
use std::collections::HashMap;
use std::io::{BufWriter, Read, Write};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::SystemTime;

const MAGIC: &[u8; 24] = b"s3csi known versions v1\n";
/// Headers of one version larger than this are not kept on disk (they are on the inode).
const MAX_RECORD_META: usize = 64 * 1024;

/// The metadata of an object without any (most objects): one allocation for all.
pub(super) fn no_meta() -> Arc<PosixMeta> {
    static EMPTY: std::sync::OnceLock<Arc<PosixMeta>> = std::sync::OnceLock::new();
    EMPTY.get_or_init(|| Arc::new(PosixMeta::default())).clone()
}

/// A stable 64-bit hash (FNV-1a) of a key or an ETag.
fn fnv64(s: &str) -> u64 {
    s.bytes().fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ b as u64).wrapping_mul(0x0100_0000_01b3)
    })
}

/// splitmix64's finaliser: every bit of the result depends on every bit of `x`.
fn mix(mut x: u64) -> u64 {
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

fn seconds(t: SystemTime) -> u64 {
    t.duration_since(SystemTime::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

struct Known {
    etag: u64,
    stamp: u64,
    meta: Arc<PosixMeta>,
}

pub(super) struct KnownVersions {
    by_key: HashMap<u64, Known>,
    cap: usize,
    /// Only keys whose `mix` is below this are kept (see the module's doc).
    admit_below: u64,
    log: Option<(PathBuf, BufWriter<std::fs::File>)>,
}

impl KnownVersions {
    pub(super) fn new(cap: usize) -> Self {
        Self {
            by_key: HashMap::new(),
            cap: cap.max(1),
            admit_below: u64::MAX,
            log: None,
        }
    }

    #[cfg(test)]
    pub(super) fn len(&self) -> usize {
        self.by_key.len()
    }

    /// What a HEAD said of version (`key`, `etag`, Last-Modified `stamp`).
    pub(super) fn remember(
        &mut self,
        key: &str,
        etag: &str,
        stamp: SystemTime,
        meta: Arc<PosixMeta>,
    ) {
        let (key, etag, stamp) = (fnv64(key), fnv64(etag), seconds(stamp));
        if let Some((path, w)) = &mut self.log {
            if let Err(e) = write_record(w, key, etag, stamp, &meta) {
                tracing::warn!(path = %path.display(), error = %e,
                    "cannot keep the metadata of versions read on disk any more");
                self.log = None;
            }
        }
        self.insert(key, Known { etag, stamp, meta });
    }

    fn insert(&mut self, key: u64, known: Known) {
        if mix(key) >= self.admit_below {
            return;
        }
        self.by_key.insert(key, known);
        if self.by_key.len() > self.cap {
            self.thin();
        }
    }

    /// Lowers the threshold to the mixed hash a quarter from the top: that quarter goes.
    fn thin(&mut self) {
        let mut mixed: Vec<u64> = self.by_key.keys().map(|&k| mix(k)).collect();
        let keep = (self.cap - self.cap / 4).min(mixed.len() - 1);
        let (_, &mut nth, _) = mixed.select_nth_unstable(keep);
        self.admit_below = nth;
        let below = self.admit_below;
        self.by_key.retain(|&key, _| mix(key) < below);
    }

    /// The metadata known for version (`key`, `etag`, Last-Modified `mtime`).
    pub(super) fn recall(
        &self,
        key: &str,
        etag: &str,
        mtime: SystemTime,
    ) -> Option<Arc<PosixMeta>> {
        let k = self.by_key.get(&fnv64(key))?;
        (k.etag == fnv64(etag) && k.stamp == seconds(mtime)).then(|| k.meta.clone())
    }

    /// Loads what `path` holds (a previous mount of the same cache directory), rewrites
    /// it with only what is kept, and appends to it from now on. Returns the versions known.
    pub(super) fn persist_in(&mut self, path: &Path) -> std::io::Result<usize> {
        match std::fs::File::open(path) {
            Ok(f) => self.load(f),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(e),
        }
        let tmp = path.with_extension("tmp");
        let mut w = BufWriter::with_capacity(64 * 1024, std::fs::File::create(&tmp)?);
        w.write_all(MAGIC)?;
        for (key, k) in &self.by_key {
            write_record(&mut w, *key, k.etag, k.stamp, &k.meta)?;
        }
        w.flush()?;
        std::fs::rename(&tmp, path)?;
        let f = std::fs::OpenOptions::new().append(true).open(path)?;
        self.log = Some((path.to_path_buf(), BufWriter::with_capacity(64 * 1024, f)));
        Ok(self.by_key.len())
    }

    fn load(&mut self, f: std::fs::File) {
        let mut bytes = Vec::new();
        if std::io::BufReader::new(f).read_to_end(&mut bytes).is_err() || !bytes.starts_with(MAGIC)
        {
            return;
        }
        let mut at = MAGIC.len();
        let u64_at = |b: &[u8], i: usize| u64::from_le_bytes(b[i..i + 8].try_into().unwrap());
        while at + 28 <= bytes.len() {
            let (key, etag, stamp) = (
                u64_at(&bytes, at),
                u64_at(&bytes, at + 8),
                u64_at(&bytes, at + 16),
            );
            let len = u32::from_le_bytes(bytes[at + 24..at + 28].try_into().unwrap()) as usize;
            let Some(json) = bytes.get(at + 28..at + 28 + len) else {
                break; // torn by a crash
            };
            at += 28 + len;
            let meta = if len == 0 {
                no_meta()
            } else {
                match serde_json::from_slice::<UserMeta>(json) {
                    Ok(h) => Arc::new(PosixMeta::from_headers(&h, "(known versions file)")),
                    Err(_) => continue,
                }
            };
            self.insert(key, Known { etag, stamp, meta });
        }
    }

    /// Writes out what was appended (a crash loses at most the buffer: HEADs again).
    pub(super) fn flush(&mut self) {
        if let Some((_, w)) = &mut self.log {
            let _ = w.flush();
        }
    }
}

fn write_record(
    w: &mut impl Write,
    key: u64,
    etag: u64,
    stamp: u64,
    meta: &PosixMeta,
) -> std::io::Result<()> {
    let json = if *meta == PosixMeta::default() {
        Vec::new()
    } else {
        serde_json::to_vec(&meta.to_headers()).map_err(std::io::Error::other)?
    };
    if json.len() > MAX_RECORD_META {
        return Ok(());
    }
    w.write_all(&key.to_le_bytes())?;
    w.write_all(&etag.to_le_bytes())?;
    w.write_all(&stamp.to_le_bytes())?;
    w.write_all(&(json.len() as u32).to_le_bytes())?;
    w.write_all(&json)
}

impl Drop for KnownVersions {
    fn drop(&mut self) {
        self.flush();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn versions_are_recalled_exactly_and_survive_a_reopen() {
        let dir = std::env::temp_dir().join(format!("s3csi-known-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("known-versions");
        let t = SystemTime::UNIX_EPOCH + Duration::from_secs(1_700_000_000);
        let owned = Arc::new(PosixMeta {
            mode: Some(0o100600),
            uid: Some(1000),
            ..Default::default()
        });
        let mut k = KnownVersions::new(10);
        k.persist_in(&path).unwrap();
        k.remember("d/a", "\"e1\"", t, owned.clone());
        k.remember("d/b", "\"e2\"", t, no_meta());
        assert_eq!(
            k.recall("d/a", "\"e1\"", t + Duration::from_millis(300)),
            Some(owned.clone())
        );
        // Another ETag, or the same one with another Last-Modified (a metadata change).
        assert!(k.recall("d/a", "\"e9\"", t).is_none());
        assert!(k
            .recall("d/a", "\"e1\"", t + Duration::from_secs(1))
            .is_none());
        drop(k);
        // A torn record after the two good ones.
        let mut f = std::fs::OpenOptions::new()
            .append(true)
            .open(&path)
            .unwrap();
        f.write_all(&[1, 2, 3]).unwrap();
        drop(f);
        let mut k = KnownVersions::new(10);
        assert_eq!(k.persist_in(&path).unwrap(), 2);
        assert_eq!(k.recall("d/a", "\"e1\"", t), Some(owned));
        assert_eq!(k.recall("d/b", "\"e2\"", t), Some(no_meta()));
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// Walks of twice the cap, in the same order each time: every walk still finds a good
    /// share of what it read before (dropping the oldest first, it would find none).
    #[test]
    fn walks_longer_than_the_cap_keep_finding_versions() {
        let t = SystemTime::UNIX_EPOCH + Duration::from_secs(1_700_000_000);
        let mut k = KnownVersions::new(1000);
        let mut found = Vec::new();
        for _walk in 0..4 {
            let mut hits = 0;
            for n in 0..2000 {
                let key = format!("d/f{n:06}");
                match k.recall(&key, "e", t) {
                    Some(_) => hits += 1,
                    None => k.remember(&key, "e", t, no_meta()),
                }
                assert!(k.len() <= 1000);
            }
            found.push(hits);
        }
        assert_eq!(found[0], 0);
        assert!(
            found[1..].iter().all(|&h| h >= 750),
            "hits per walk: {found:?}"
        );
    }
}
