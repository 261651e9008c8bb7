//! The inode bindings a replacement mounter needs, persisted as they are made.
//!
//! When a mounter dies, the kernel keeps the inode numbers it handed out (an open
//! directory, a cwd, cached dentries) and sends them to the replacement. The replacement
//! loads this log and so resolves every such number to the same key.
//!
//! Which bindings: an inode is logged when the kernel learns its number (its first
//! lookup, or create) and unlogged when its name is dropped or it is removed from the
//! table. Inodes that only a listing created are not logged (readdir does not give the
//! kernel an inode). Each record is written with one write(2) to an O_APPEND file before
//! the reply that hands the number out, so a kill -9 loses nothing (no fsync: a node
//! crash takes the mount with it anyway). The file is rewritten from the live table once
//! it holds far more records than live bindings.
//!
//! Format, one record per line, fields separated by tabs, `\t` `\n` `\\` escaped:
//! ```text
//! s3csi-inodes 1 <root key>
//! B <ino> <parent> <d|f> <key>
//! U <ino>
//! ```
//! The name of a bound inode is the last component of its key.

use super::inode::{Inode, Kind};
use std::fs::File;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

const MAGIC: &str = "s3csi-inodes 1";
/// Rewrite when the file holds this many records more than the live bindings (×2).
const COMPACT_SLACK: usize = 4096;

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Binding {
    pub ino: u64,
    pub parent: u64,
    pub kind: Kind,
    pub key: String,
}

impl Binding {
    pub fn of(i: &Inode) -> Binding {
        Binding {
            ino: i.ino,
            parent: i.parent,
            kind: i.kind,
            key: i.key.clone(),
        }
    }

    /// The last path component of the key.
    pub fn name(&self) -> &str {
        let k = self.key.strip_suffix('/').unwrap_or(&self.key);
        k.rsplit('/').next().unwrap_or(k)
    }
}

fn escape(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '\t' => out.push_str("\\t"),
            '\n' => out.push_str("\\n"),
            c => out.push(c),
        }
    }
    out
}

fn unescape(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    let mut it = s.chars();
    while let Some(c) = it.next() {
        if c != '\\' {
            out.push(c);
            continue;
        }
        match it.next() {
            Some('t') => out.push('\t'),
            Some('n') => out.push('\n'),
            Some(o) => out.push(o),
            None => out.push('\\'),
        }
    }
    out
}

fn bind_line(b: &Binding) -> String {
    let kind = match b.kind {
        Kind::Dir => 'd',
        Kind::File => 'f',
    };
    format!("B\t{}\t{}\t{kind}\t{}\n", b.ino, b.parent, escape(&b.key))
}

/// What a log file says: the live bindings (in the order they were made) and the highest
/// inode number it ever mentioned.
#[derive(Debug, Default)]
pub struct Loaded {
    pub bindings: Vec<Binding>,
    pub max_ino: u64,
}

/// Reads `path`. A missing file, or one written for another root key, yields nothing;
/// a torn last line (a write cut short) is ignored.
pub fn load(path: &Path, root_key: &str) -> std::io::Result<Loaded> {
    let text = match std::fs::read_to_string(path) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Loaded::default()),
        Err(e) => return Err(e),
    };
    let mut lines = text.split_terminator('\n');
    let header = format!("{MAGIC} {}", escape(root_key));
    if lines.next() != Some(header.as_str()) {
        return Ok(Loaded::default());
    }
    let complete = if text.ends_with('\n') {
        usize::MAX
    } else {
        text.split_terminator('\n').count() - 1
    };
    let mut live: std::collections::BTreeMap<u64, (u64, Binding)> = Default::default();
    let mut max_ino = 0;
    for (seq, line) in lines.enumerate() {
        if seq + 1 >= complete {
            break;
        }
        let f: Vec<&str> = line.split('\t').collect();
        match f.as_slice() {
            ["B", ino, parent, kind, key] => {
                let (Ok(ino), Ok(parent)) = (ino.parse::<u64>(), parent.parse::<u64>()) else {
                    continue;
                };
                let kind = if *kind == "d" { Kind::Dir } else { Kind::File };
                max_ino = max_ino.max(ino);
                let b = Binding {
                    ino,
                    parent,
                    kind,
                    key: unescape(key),
                };
                live.insert(ino, (seq as u64, b));
            }
            ["U", ino] => {
                if let Ok(ino) = ino.parse::<u64>() {
                    max_ino = max_ino.max(ino);
                    live.remove(&ino);
                }
            }
            _ => {}
        }
    }
    let mut bindings: Vec<(u64, Binding)> = live.into_values().collect();
    bindings.sort_by_key(|(seq, _)| *seq);
    Ok(Loaded {
        bindings: bindings.into_iter().map(|(_, b)| b).collect(),
        max_ino,
    })
}

/// The log a mounter appends to. Bindings are queued under the inode table's lock (in
/// memory, in order) and written by [`InodeLog::flush`] once that lock is released, before
/// the reply that tells the kernel about them goes out: a FUSE request never waits for
/// another one's file I/O while holding the table.
#[derive(Clone)]
pub struct InodeLog {
    shared: Arc<Shared>,
}

struct Shared {
    pending: Mutex<Vec<Entry>>,
    /// Something is queued: the common case, nothing, costs one load.
    dirty: AtomicBool,
    /// Records in the file plus those queued, for the compaction decision.
    records: AtomicUsize,
    file: Mutex<LogFile>,
}

enum Entry {
    Line(String),
    /// Rewrite the file with only these bindings.
    Snapshot(Vec<Binding>),
}

struct LogFile {
    path: PathBuf,
    root_key: String,
    file: File,
    failed: bool,
}

impl InodeLog {
    /// Starts `path` afresh with `live` as its content.
    pub fn create(path: &Path, root_key: &str, live: &[Binding]) -> std::io::Result<InodeLog> {
        let file = write_snapshot(path, root_key, live)?;
        Ok(InodeLog {
            shared: Arc::new(Shared {
                pending: Mutex::new(Vec::new()),
                dirty: AtomicBool::new(false),
                records: AtomicUsize::new(live.len()),
                file: Mutex::new(LogFile {
                    path: path.to_path_buf(),
                    root_key: root_key.to_string(),
                    file,
                    failed: false,
                }),
            }),
        })
    }

    fn queue(&self, entry: Entry) {
        let mut pending = self
            .shared
            .pending
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        pending.push(entry);
        self.shared.dirty.store(true, Ordering::Release);
    }

    pub fn bind(&self, b: &Binding) {
        self.shared.records.fetch_add(1, Ordering::Relaxed);
        self.queue(Entry::Line(bind_line(b)));
    }

    pub fn unbind(&self, ino: u64) {
        self.shared.records.fetch_add(1, Ordering::Relaxed);
        self.queue(Entry::Line(format!("U\t{ino}\n")));
    }

    pub fn wants_compaction(&self, live: usize) -> bool {
        self.shared.records.load(Ordering::Relaxed) > 2 * live + COMPACT_SLACK
    }

    /// Rewrites the file with only `live` (a temporary file renamed over it), after what
    /// is queued before it.
    pub fn compact(&self, live: &[Binding]) {
        self.shared.records.store(live.len(), Ordering::Relaxed);
        self.queue(Entry::Snapshot(live.to_vec()));
    }

    /// Writes everything queued so far, in order. Whoever flushes writes the others'
    /// entries too, so once this returns the caller's own are in the file.
    pub fn flush(&self) {
        if !self.shared.dirty.load(Ordering::Acquire) {
            return;
        }
        let mut file = self.shared.file.lock().unwrap_or_else(|p| p.into_inner());
        let entries = {
            let mut pending = self
                .shared
                .pending
                .lock()
                .unwrap_or_else(|p| p.into_inner());
            self.shared.dirty.store(false, Ordering::Release);
            std::mem::take(&mut *pending)
        };
        let mut text = String::new();
        for entry in entries {
            match entry {
                Entry::Line(line) => text.push_str(&line),
                Entry::Snapshot(live) => {
                    file.append(&std::mem::take(&mut text));
                    file.snapshot(&live);
                }
            }
        }
        file.append(&text);
    }
}

impl LogFile {
    fn append(&mut self, text: &str) {
        if text.is_empty() {
            return;
        }
        if let Err(e) = self.file.write_all(text.as_bytes()) {
            if !self.failed {
                tracing::error!(path = %self.path.display(), error = %e,
                    "cannot persist inode bindings; a replacement mounter may not resolve them");
                self.failed = true;
            }
        }
    }

    fn snapshot(&mut self, live: &[Binding]) {
        match write_snapshot(&self.path, &self.root_key, live) {
            Ok(f) => self.file = f,
            Err(e) => tracing::warn!(error = %e, "cannot compact the inode log"),
        }
    }
}

fn write_snapshot(path: &Path, root_key: &str, live: &[Binding]) -> std::io::Result<File> {
    let tmp = path.with_extension("tmp");
    let mut text = format!("{MAGIC} {}\n", escape(root_key));
    for b in live {
        text.push_str(&bind_line(b));
    }
    std::fs::write(&tmp, text)?;
    std::fs::rename(&tmp, path)?;
    std::fs::OpenOptions::new().append(true).open(path)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn b(ino: u64, parent: u64, kind: Kind, key: &str) -> Binding {
        Binding {
            ino,
            parent,
            kind,
            key: key.into(),
        }
    }

    #[test]
    fn bindings_survive_a_reload_and_unbinds_remove_them() {
        let dir = std::env::temp_dir().join(format!("s3csi-inolog-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("inodes.log");
        let log = InodeLog::create(&path, "p/", &[b(2, 1, Kind::Dir, "p/d/")]).unwrap();
        log.bind(&b(3, 2, Kind::File, "p/d/we\tird\nname\\"));
        log.bind(&b(4, 1, Kind::File, "p/x"));
        log.unbind(4);
        log.bind(&b(5, 2, Kind::File, "p/d/y"));
        assert_eq!(
            load(&path, "p/").unwrap().bindings.len(),
            1,
            "queued, not written yet"
        );
        log.flush();
        let loaded = load(&path, "p/").unwrap();
        assert_eq!(loaded.max_ino, 5);
        let keys: Vec<&str> = loaded.bindings.iter().map(|b| b.key.as_str()).collect();
        assert_eq!(keys, ["p/d/", "p/d/we\tird\nname\\", "p/d/y"]);
        assert_eq!(loaded.bindings[0].name(), "d");
        assert_eq!(loaded.bindings[1].name(), "we\tird\nname\\");
        // Another root, or a torn last record, is not trusted.
        assert!(load(&path, "q/").unwrap().bindings.is_empty());
        let mut f = std::fs::OpenOptions::new()
            .append(true)
            .open(&path)
            .unwrap();
        f.write_all(b"B\t9\t1\tf\tp/torn").unwrap();
        assert_eq!(load(&path, "p/").unwrap().bindings.len(), 3);
        log.compact(&loaded.bindings);
        log.flush();
        assert_eq!(load(&path, "p/").unwrap().bindings, loaded.bindings);
        let _ = std::fs::remove_dir_all(&dir);
    }
}
