//! `--cache-memory`: a small in-memory cache of what random reads fetched (a Parquet
//! footer, an index, a header read by every open), shared by all open files, least
//! recently used first out. Keyed by version (key + ETag) like the data cache, so an
//! object replaced in S3 is never served from it. Sequential reads do not go in: a
//! stream would push out everything else and is served well by read-ahead anyway.

use bytes::Bytes;
use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;

type Version = (String, String);

#[derive(Default)]
struct State {
    /// Per version, its pieces by start offset.
    pieces: HashMap<Version, BTreeMap<u64, (Bytes, u64)>>,
    /// (tick → version, start), oldest first.
    lru: BTreeMap<u64, (Version, u64)>,
    tick: u64,
    bytes: u64,
}

pub struct MemoryCache {
    limit: u64,
    state: Mutex<State>,
    pub hits: AtomicU64,
}

impl MemoryCache {
    pub fn new(limit: u64) -> Self {
        Self {
            limit,
            state: Mutex::default(),
            hits: AtomicU64::new(0),
        }
    }

    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Bytes `offset..end` of version `etag` of `key`, if one kept piece holds them all.
    pub fn get(&self, key: &str, etag: &str, offset: u64, end: u64) -> Option<Bytes> {
        let mut st = self.state();
        let version = (key.to_string(), etag.to_string());
        let (start, bytes, old_tick) = {
            let pieces = st.pieces.get(&version)?;
            let (start, (bytes, tick)) = pieces.range(..=offset).next_back()?;
            if start + (bytes.len() as u64) < end {
                return None;
            }
            (*start, bytes.clone(), *tick)
        };
        st.tick += 1;
        let now = st.tick;
        st.lru.remove(&old_tick);
        st.lru.insert(now, (version.clone(), start));
        if let Some(p) = st.pieces.get_mut(&version).and_then(|p| p.get_mut(&start)) {
            p.1 = now;
        }
        self.hits.fetch_add(1, Ordering::Relaxed);
        let from = (offset - start) as usize;
        Some(bytes.slice(from..from + (end - offset) as usize))
    }

    /// Keeps `bytes` fetched at `start` of version `etag` of `key`, giving up the least
    /// recently used pieces for room. Pieces larger than a quarter of the cache are not
    /// kept: they would empty it for one reader.
    pub fn put(&self, key: &str, etag: &str, start: u64, bytes: Bytes) {
        let len = bytes.len() as u64;
        if len == 0 || len > self.limit / 4 {
            return;
        }
        let mut st = self.state();
        let version = (key.to_string(), etag.to_string());
        st.tick += 1;
        let now = st.tick;
        let old = st
            .pieces
            .entry(version.clone())
            .or_default()
            .insert(start, (bytes, now));
        if let Some((b, t)) = old {
            st.lru.remove(&t);
            st.bytes -= b.len() as u64;
        }
        st.lru.insert(now, (version, start));
        st.bytes += len;
        while st.bytes > self.limit {
            let Some((_, (v, s))) = st.lru.pop_first() else {
                break;
            };
            let (freed, empty) = match st.pieces.get_mut(&v) {
                Some(p) => (
                    p.remove(&s).map_or(0, |(b, _)| b.len() as u64),
                    p.is_empty(),
                ),
                None => (0, false),
            };
            if empty {
                st.pieces.remove(&v);
            }
            st.bytes -= freed;
        }
    }

    pub fn bytes(&self) -> u64 {
        self.state().bytes
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn serves_kept_pieces_by_version_and_gives_up_the_oldest() {
        let m = MemoryCache::new(4000);
        m.put("k", "e1", 100, Bytes::from(vec![1u8; 1000]));
        assert_eq!(m.get("k", "e1", 150, 1100).unwrap().len(), 950);
        assert!(m.get("k", "e2", 150, 200).is_none(), "another version");
        assert!(
            m.get("k", "e1", 50, 200).is_none(),
            "starts before the piece"
        );
        assert!(m.get("k", "e1", 150, 1101).is_none(), "ends after it");
        m.put("k", "e1", 5000, Bytes::from(vec![2u8; 1000]));
        m.put("j", "e1", 0, Bytes::from(vec![3u8; 1000]));
        // The first piece was used last but one: the second goes first.
        assert!(m.get("k", "e1", 100, 200).is_some());
        m.put("j", "e1", 9000, Bytes::from(vec![4u8; 1000]));
        m.put("j", "e1", 19000, Bytes::from(vec![5u8; 1000]));
        assert!(m.bytes() <= 4000);
        assert!(m.get("k", "e1", 5000, 5001).is_none(), "the oldest went");
        assert_eq!(&m.get("k", "e1", 100, 102).unwrap()[..], &[1, 1]);
        // Too large a piece is not kept.
        m.put("big", "e", 0, Bytes::from(vec![0u8; 1001]));
        assert!(m.get("big", "e", 0, 1).is_none());
    }
}
