//! fsx-style data integrity: a seeded random loop over the operations the file system
//! supports (create + sequential write + close, O_TRUNC overwrite, fsync, random-range
//! reads, truncate to any size, rename, unlink, mkdir, rmdir, append, writing on after
//! fsync, writes anywhere in an existing file, a second writer, reading a writing
//! descriptor, edit sessions of many random writes, reads and truncates through one
//! descriptor) and over the ones it refuses (links), checked against an in-memory model
//! after every operation through the mount, and against S3 at the end.
//!
//! Quick by default (300 steps); `S3CSI_FULL=1` runs until 100 000 operations were
//! checked. `S3CSI_SEED=N` replays.

use crate::common;

use common::*;
use std::collections::BTreeMap;
use std::fs;
use std::io::{Read, Seek, SeekFrom, Write};
use std::os::unix::fs::FileExt;
use std::time::Instant;

#[derive(Debug, Clone, PartialEq)]
enum Node {
    File(Vec<u8>),
    Dir,
}

struct Fsx<'a> {
    m: &'a Mount,
    rng: Rng,
    model: BTreeMap<String, Node>,
    counts: BTreeMap<&'static str, u64>,
    bytes_checked: u64,
    /// What was done, for the failure message.
    history: Vec<String>,
    steps: u64,
}

fn errno(e: &std::io::Error) -> i32 {
    e.raw_os_error().unwrap_or(-1)
}

const DIRS: [&str; 3] = ["d1", "d2", "d1/sub"];
const NAMES: [&str; 5] = ["f0", "f1", "f2", "long name with spaces", "f.ü"];

impl Fsx<'_> {
    fn p(&self, rel: &str) -> std::path::PathBuf {
        self.m.path(rel)
    }

    fn count(&mut self, what: &'static str) {
        *self.counts.entry(what).or_default() += 1;
    }

    fn note(&mut self, what: String) {
        self.history.push(what);
    }

    fn dirs(&self) -> Vec<String> {
        let mut v = vec![String::new()];
        v.extend(
            self.model
                .iter()
                .filter(|(_, n)| **n == Node::Dir)
                .map(|(k, _)| k.clone()),
        );
        v
    }

    fn files(&self) -> Vec<String> {
        self.model
            .iter()
            .filter(|(_, n)| matches!(n, Node::File(_)))
            .map(|(k, _)| k.clone())
            .collect()
    }

    fn join(dir: &str, name: &str) -> String {
        if dir.is_empty() {
            name.to_string()
        } else {
            format!("{dir}/{name}")
        }
    }

    fn random_file_path(&mut self) -> String {
        let dirs = self.dirs();
        let d = self.rng.pick(&dirs).clone();
        let n = *self.rng.pick(&NAMES);
        Self::join(&d, n)
    }

    fn data(&mut self) -> Vec<u8> {
        let len = match self.rng.below(10) {
            0 => 0,
            1 => self.rng.range(5 * 1024 * 1024, 7 * 1024 * 1024), // multipart
            2..=4 => self.rng.below(4096),
            _ => self.rng.below(400 * 1024),
        } as usize;
        self.rng.bytes(len)
    }

    /// Writes `data` in random-sized sequential chunks.
    fn write_chunks(&mut self, f: &mut fs::File, data: &[u8]) {
        let mut off = 0;
        while off < data.len() {
            let n = (self.rng.range(1, 300_000) as usize).min(data.len() - off);
            f.write_all(&data[off..off + n]).unwrap();
            off += n;
        }
    }

    /// The file at `rel` holds exactly what the model says, read through the mount.
    fn check_file(&mut self, rel: &str) {
        match self.model.get(rel) {
            Some(Node::File(want)) => {
                let want = want.clone();
                let meta = fs::metadata(self.p(rel)).unwrap_or_else(|e| panic!("{rel}: {e}"));
                assert!(meta.is_file(), "{rel}");
                assert_eq!(meta.len(), want.len() as u64, "{rel}: size");
                let got = fs::read(self.p(rel)).unwrap_or_else(|e| panic!("{rel}: {e}"));
                assert!(got == *want, "{rel}: content differs from the model");
                self.bytes_checked += got.len() as u64;
            }
            Some(Node::Dir) => assert!(self.p(rel).is_dir(), "{rel}"),
            None => assert!(!self.p(rel).exists(), "{rel} exists, the model says no"),
        }
    }

    /// Every directory lists exactly the model's children.
    fn check_tree(&self) {
        for d in self.dirs() {
            let mut got: Vec<String> = fs::read_dir(self.p(&d))
                .unwrap_or_else(|e| panic!("readdir {d:?}: {e}"))
                .map(|e| e.unwrap().file_name().into_string().unwrap())
                .collect();
            got.sort();
            let mut want: Vec<String> = self
                .model
                .keys()
                .filter_map(|k| {
                    let (parent, name) = k.rsplit_once('/').unwrap_or(("", k));
                    (parent == d).then(|| name.to_string())
                })
                .collect();
            want.sort();
            assert_eq!(got, want, "listing of {d:?}");
        }
    }

    fn step(&mut self) {
        self.steps += 1;
        let files = self.files();
        let roll = self.rng.below(100);
        match roll {
            0..=24 => {
                // create or O_TRUNC overwrite, sequential writes, close (maybe fsync first)
                let rel = self.random_file_path();
                if self.model.get(&rel) == Some(&Node::Dir) {
                    return;
                }
                let data = self.data();
                self.note(format!("write {rel} ({} bytes)", data.len()));
                let mut f = fs::File::create(self.p(&rel)).unwrap();
                self.write_chunks(&mut f, &data);
                if self.rng.chance(0.3) {
                    f.sync_all().unwrap();
                    self.count("fsync");
                }
                close_checked(f).unwrap();
                self.count(if self.model.contains_key(&rel) {
                    "overwrite"
                } else {
                    "create"
                });
                self.model.insert(rel.clone(), Node::File(data));
                self.check_file(&rel);
            }
            25..=44 if !files.is_empty() => {
                // reads of random ranges
                let rel = self.rng.pick(&files).clone();
                let Some(Node::File(want)) = self.model.get(&rel).cloned() else {
                    unreachable!()
                };
                self.note(format!("read ranges of {rel}"));
                let f = fs::File::open(self.p(&rel)).unwrap();
                for _ in 0..self.rng.range(1, 6) {
                    let off = self.rng.below(want.len() as u64 + 10);
                    let len = self.rng.range(1, 200_000) as usize;
                    let mut buf = vec![0u8; len];
                    let mut got = 0;
                    loop {
                        let n = f.read_at(&mut buf[got..], off + got as u64).unwrap();
                        if n == 0 || got + n == len {
                            got += n;
                            break;
                        }
                        got += n;
                    }
                    let s = (off as usize).min(want.len());
                    let e = (off as usize + len).min(want.len());
                    assert!(buf[..got] == want[s..e], "{rel}: range {off}+{len}");
                    self.bytes_checked += got as u64;
                }
                self.count("read ranges");
            }
            45..=51 if !files.is_empty() => {
                // truncate to 0, by path or through a descriptor
                let rel = self.rng.pick(&files).clone();
                self.note(format!("truncate {rel} to 0"));
                if self.rng.chance(0.5) {
                    nix::unistd::truncate(&self.p(&rel), 0).unwrap();
                } else {
                    let f = fs::OpenOptions::new()
                        .write(true)
                        .open(self.p(&rel))
                        .unwrap();
                    f.set_len(0).unwrap();
                    close_checked(f).unwrap();
                }
                self.model.insert(rel.clone(), Node::File(Vec::new()));
                self.count("truncate 0");
                self.check_file(&rel);
            }
            52..=63 if !files.is_empty() => {
                let src = self.rng.pick(&files).clone();
                let dst = self.random_file_path();
                if src == dst || self.model.get(&dst) == Some(&Node::Dir) {
                    return;
                }
                self.note(format!("rename {src} -> {dst}"));
                fs::rename(self.p(&src), self.p(&dst))
                    .unwrap_or_else(|e| panic!("rename {src} {dst}: {e}"));
                let node = self.model.remove(&src).unwrap();
                self.model.insert(dst.clone(), node);
                self.count("rename");
                self.check_file(&src);
                self.check_file(&dst);
            }
            64..=71 if !files.is_empty() => {
                let rel = self.rng.pick(&files).clone();
                self.note(format!("unlink {rel}"));
                fs::remove_file(self.p(&rel)).unwrap();
                self.model.remove(&rel);
                self.count("unlink");
                self.check_file(&rel);
            }
            72..=77 => {
                let d = self.rng.pick(&DIRS[1..]).to_string();
                self.note(format!("mkdir/rmdir {d}"));
                let parent_ok = d
                    .rsplit_once('/')
                    .is_none_or(|(p, _)| self.model.get(p) == Some(&Node::Dir));
                match self.model.get(&d) {
                    None if parent_ok => {
                        fs::create_dir(self.p(&d)).unwrap();
                        self.model.insert(d.clone(), Node::Dir);
                        self.count("mkdir");
                    }
                    Some(Node::Dir) => {
                        let prefix = format!("{d}/");
                        let empty = !self.model.keys().any(|k| k.starts_with(&prefix));
                        match fs::remove_dir(self.p(&d)) {
                            Ok(()) => {
                                assert!(empty, "rmdir of non-empty {d} succeeded");
                                self.model.remove(&d);
                                self.count("rmdir");
                            }
                            Err(e) => {
                                assert!(!empty, "rmdir {d}: {e}");
                                assert_eq!(errno(&e), libc::ENOTEMPTY, "rmdir {d}");
                                self.count("refused: rmdir non-empty");
                            }
                        }
                    }
                    _ => {}
                }
                self.check_file(&d);
            }
            78..=99 => self.refused(),
            _ => {}
        }
    }

    /// Many random writes, reads, appends and truncates through one read-write
    /// descriptor of a new or existing file, each read checked against the model.
    fn edit_session(&mut self) {
        let files = self.files();
        let rel = if !files.is_empty() && self.rng.chance(0.7) {
            self.rng.pick(&files).clone()
        } else {
            self.random_file_path()
        };
        if self.model.get(&rel) == Some(&Node::Dir) {
            return;
        }
        let mut d = match self.model.get(&rel) {
            Some(Node::File(d)) => d.clone(),
            _ => Vec::new(),
        };
        let ops = self.rng.range(1, 60);
        self.note(format!("edit session of {ops} operations on {rel}"));
        let f = fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(self.p(&rel))
            .unwrap_or_else(|e| panic!("open {rel}: {e}"));
        for _ in 0..ops {
            match self.rng.below(10) {
                0..=4 => {
                    let at = self.rng.below(d.len() as u64 + 70_000) as usize;
                    let len = self.rng.range(1, 70_000) as usize;
                    let piece = self.rng.bytes(len);
                    f.write_all_at(&piece, at as u64).unwrap();
                    if d.len() < at + len {
                        d.resize(at + len, 0);
                    }
                    d[at..at + len].copy_from_slice(&piece);
                    self.count("edit: write anywhere");
                }
                5..=7 => {
                    let at = self.rng.below(d.len() as u64 + 10) as usize;
                    let mut buf = vec![0u8; self.rng.range(1, 150_000) as usize];
                    let mut got = 0;
                    while got < buf.len() {
                        let n = f.read_at(&mut buf[got..], (at + got) as u64).unwrap();
                        if n == 0 {
                            break;
                        }
                        got += n;
                    }
                    let (s, e) = (at.min(d.len()), (at + buf.len()).min(d.len()));
                    assert!(buf[..got] == d[s..e], "{rel}: edit read at {at}");
                    self.bytes_checked += got as u64;
                    self.count("edit: read");
                }
                8 => {
                    let to = self.rng.below(d.len() as u64 * 2 + 1000) as usize;
                    f.set_len(to as u64).unwrap();
                    d.resize(to, 0);
                    self.count("edit: truncate");
                }
                _ => {
                    f.sync_all().unwrap();
                    self.count("edit: fsync");
                }
            }
        }
        close_checked(f).unwrap();
        self.model.insert(rel.clone(), Node::File(d));
        self.check_file(&rel);
    }

    /// An operation the file system refuses: the documented errno, nothing changed.
    fn refused(&mut self) {
        let files = self.files();
        let nonempty: Vec<String> = files
            .iter()
            .filter(|k| matches!(self.model.get(*k), Some(Node::File(d)) if !d.is_empty()))
            .cloned()
            .collect();
        let kind = self.rng.below(10);
        self.note(format!("refused op kind {kind}"));
        let expect = |what: &str, r: std::io::Result<()>, code: i32| {
            let e = r.expect_err(&format!("{what} succeeded"));
            assert_eq!(errno(&e), code, "{what}: {e}");
        };
        match kind {
            0 if !nonempty.is_empty() => {
                let rel = self.rng.pick(&nonempty).clone();
                let mut f = fs::OpenOptions::new()
                    .append(true)
                    .open(self.p(&rel))
                    .unwrap();
                f.write_all(b"more").unwrap();
                close_checked(f).unwrap();
                if let Some(Node::File(d)) = self.model.get_mut(&rel) {
                    d.extend_from_slice(b"more");
                }
                self.count("append");
                self.check_file(&rel);
            }
            1 => self.edit_session(),
            8 if !nonempty.is_empty() => {
                // O_APPEND from two descriptors, interleaved.
                let rel = self.rng.pick(&nonempty).clone();
                self.note(format!("append from two descriptors to {rel}"));
                let open = || {
                    fs::OpenOptions::new()
                        .append(true)
                        .open(self.p(&rel))
                        .unwrap()
                };
                let (mut a, mut b) = (open(), open());
                let mut added = Vec::new();
                for i in 0..self.rng.range(2, 8) {
                    let n = self.rng.range(1, 5000) as usize;
                    let piece = self.rng.bytes(n);
                    if i % 2 == 0 { &mut a } else { &mut b }
                        .write_all(&piece)
                        .unwrap();
                    added.extend_from_slice(&piece);
                }
                close_checked(a).unwrap();
                close_checked(b).unwrap();
                if let Some(Node::File(d)) = self.model.get_mut(&rel) {
                    d.extend_from_slice(&added);
                }
                self.count("append from two descriptors");
                self.check_file(&rel);
            }
            2 if !nonempty.is_empty() => {
                let rel = self.rng.pick(&nonempty).clone();
                let Some(Node::File(d)) = self.model.get(&rel) else {
                    unreachable!()
                };
                let size = d.len() as u64;
                let to = if self.rng.chance(0.5) {
                    size / 2
                } else {
                    size + 100
                };
                if to == 0 || to == size {
                    return;
                }
                self.note(format!("truncate {rel} to {to}"));
                if self.rng.chance(0.5) {
                    nix::unistd::truncate(&self.p(&rel), to as i64).unwrap();
                } else {
                    let f = fs::OpenOptions::new()
                        .write(true)
                        .open(self.p(&rel))
                        .unwrap();
                    f.set_len(to).unwrap();
                    close_checked(f).unwrap();
                }
                if let Some(Node::File(d)) = self.model.get_mut(&rel) {
                    d.resize(to as usize, 0);
                }
                self.count("truncate to another size");
                self.check_file(&rel);
            }
            3 => {
                let dirs = self.dirs();
                if dirs.len() < 2 {
                    return;
                }
                let d = self.rng.pick(&dirs[1..]).clone();
                let to = self
                    .rng
                    .pick(&["moved-1", "moved-2", "moved-3"])
                    .to_string();
                if d == to {
                    return;
                }
                self.note(format!("rename dir {d} -> {to}"));
                let (from_prefix, to_prefix) = (format!("{d}/"), format!("{to}/"));
                let onto_non_empty = self.model.keys().any(|k| k.starts_with(&to_prefix));
                match fs::rename(self.p(&d), self.p(&to)) {
                    Ok(()) => {
                        assert!(
                            !onto_non_empty,
                            "rename of {d} onto non-empty {to} succeeded"
                        );
                        let moved: Vec<(String, Node)> = self
                            .model
                            .iter()
                            .filter(|(k, _)| **k == d || k.starts_with(&from_prefix))
                            .map(|(k, n)| (k.clone(), n.clone()))
                            .collect();
                        self.model.remove(&to);
                        for (k, n) in moved {
                            self.model.remove(&k);
                            self.model.insert(format!("{to}{}", &k[d.len()..]), n);
                        }
                        self.count("rename dir");
                    }
                    Err(e) => {
                        assert!(onto_non_empty, "rename dir {d} -> {to}: {e}");
                        assert_eq!(errno(&e), libc::ENOTEMPTY, "rename dir {d} -> {to}");
                        self.count("refused: rename dir onto non-empty");
                    }
                }
                self.check_tree();
            }
            4 => {
                let link = self.random_file_path();
                if self.model.contains_key(&link) {
                    return;
                }
                // Symlinks work (tests/it/metadata.rs; the model has no links); hard
                // links are refused.
                if let Some(src) = files.first() {
                    expect(
                        "hard link",
                        fs::hard_link(self.p(src), self.p(&link)),
                        libc::EPERM,
                    );
                }
                self.count("refused: links");
                self.check_file(&link);
            }
            5..=7 => {
                // A writer in progress: a second writer shares it, a read through the
                // writing descriptor sees what was written; then close commits.
                let rel = self.random_file_path();
                if self.model.get(&rel) == Some(&Node::Dir) {
                    return;
                }
                let len = self.rng.below(100_000) as usize + 1;
                let data = self.rng.bytes(len);
                let mut f = fs::OpenOptions::new()
                    .read(true)
                    .write(true)
                    .create(true)
                    .truncate(true)
                    .open(self.p(&rel))
                    .unwrap();
                f.write_all(&data).unwrap();
                let mut data = data;
                let mut rel = rel;
                let dst = self.random_file_path();
                if self.rng.chance(0.3) && dst != rel && self.model.get(&dst) != Some(&Node::Dir) {
                    // Log rotation: the file moves while its writer goes on.
                    self.note(format!("rename {rel} -> {dst} while open for writing"));
                    fs::rename(self.p(&rel), self.p(&dst))
                        .unwrap_or_else(|e| panic!("rename {rel} {dst} while writing: {e}"));
                    self.model.remove(&rel);
                    self.check_file(&rel);
                    rel = dst;
                    self.count("rename while writing");
                }
                match kind {
                    5 => {
                        let second = fs::OpenOptions::new()
                            .write(true)
                            .open(self.p(&rel))
                            .unwrap();
                        second.write_all_at(b"SECOND", 0).unwrap();
                        f.write_all(b"tail").unwrap();
                        let orig = data.len();
                        data.resize(orig.max(6), 0);
                        data[..6].copy_from_slice(b"SECOND");
                        data.resize(data.len().max(orig + 4), 0);
                        data[orig..orig + 4].copy_from_slice(b"tail");
                        close_checked(second).unwrap();
                        self.count("second writer");
                    }
                    6 => {
                        let mut buf = vec![0u8; 10];
                        f.seek(SeekFrom::Start(0)).unwrap();
                        let n = f.read(&mut buf).unwrap();
                        assert!(
                            buf[..n] == data[..10.min(data.len())],
                            "read while writing returned other bytes"
                        );
                        f.seek(SeekFrom::End(0)).unwrap();
                        self.count("read while writing");
                    }
                    _ => {
                        f.sync_all().unwrap();
                        f.write_all(b"late").unwrap();
                        data.extend_from_slice(b"late");
                        self.count("write after fsync");
                    }
                }
                close_checked(f).unwrap();
                self.model.insert(rel.clone(), Node::File(data));
                self.check_file(&rel);
            }
            _ => {
                // ENOENT for a missing file, EEXIST for mkdir over a file.
                if let Some(rel) = files.first() {
                    expect(
                        "mkdir over a file",
                        fs::create_dir(self.p(rel)),
                        libc::EEXIST,
                    );
                }
                expect(
                    "unlink missing",
                    fs::remove_file(self.p("no-such-file")),
                    libc::ENOENT,
                );
                self.count("refused: exists/missing");
            }
        }
    }
}

#[test]
fn random_operations_match_the_model() {
    // Steps in the quick run; the full run goes on until 100 000 operations were checked.
    run_fsx("fsx", &["--part-size", "5MiB"], 300, 100_000);
}

/// The same with `--write-back`: uploads after the last close race with what follows.
#[test]
fn random_operations_match_the_model_with_write_back() {
    run_fsx(
        "fsx-wb",
        &["--part-size", "5MiB", "--write-back", "10ms"],
        300,
        30_000,
    );
}

fn run_fsx(hint: &str, args: &[&str], quick_steps: usize, full_ops: u64) {
    let bucket = new_bucket(hint);
    let cache = scratch_dir(&format!("{hint}-cache"));
    let mut args = args.to_vec();
    args.extend(["--cache-dir", cache.to_str().unwrap()]);
    let m = Mount::start(&bucket, &args);
    fs::create_dir(m.path("d1")).unwrap();
    let mut fsx = Fsx {
        m: &m,
        rng: Rng::from_env("fsx", 2024),
        model: BTreeMap::from([("d1".to_string(), Node::Dir)]),
        counts: BTreeMap::new(),
        bytes_checked: 0,
        history: Vec::new(),
        steps: 0,
    };
    let start = Instant::now();
    for i in 0.. {
        let done = match full_run() {
            true => fsx.counts.values().sum::<u64>() >= full_ops,
            false => i >= quick_steps,
        };
        if done {
            break;
        }
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            fsx.step();
            if i % 10 == 0 {
                fsx.check_tree();
            }
        }));
        if let Err(p) = r {
            let h = &fsx.history;
            eprintln!(
                "fsx failed at step {i}; last operations:\n  {}",
                h[h.len().saturating_sub(400)..].join("\n  ")
            );
            std::panic::resume_unwind(p);
        }
    }
    fsx.check_tree();
    let model = fsx.model.clone();
    let (counts, checked, steps) = (fsx.counts.clone(), fsx.bytes_checked, fsx.steps);
    drop(m);
    // S3 holds exactly the model: file keys with their bytes, a marker per directory.
    let mut s3_bytes = 0;
    let mut want_keys: Vec<String> = model
        .iter()
        .map(|(k, n)| match n {
            Node::Dir => format!("{k}/"),
            Node::File(_) => k.clone(),
        })
        .collect();
    want_keys.sort();
    let mut got_keys = s3_keys(&bucket, "");
    got_keys.sort();
    assert_eq!(got_keys, want_keys, "keys in S3");
    for (k, n) in &model {
        if let Node::File(want) = n {
            let got = s3_get(&bucket, k).unwrap();
            assert!(got == *want, "{k}: S3 content differs");
            s3_bytes += got.len() as u64;
        }
    }
    assert!(open_multipart_uploads(&bucket).is_empty());
    let total: u64 = counts.values().sum();
    eprintln!(
        "fsx: {steps} steps ({total} operations) in {:?}: {counts:?}; {checked} bytes checked \
         through the mount, {s3_bytes} bytes in {} keys checked in S3",
        start.elapsed(),
        got_keys.len()
    );
}
