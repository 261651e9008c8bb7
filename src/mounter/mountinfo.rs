//! Reading `/proc/self/mountinfo`: is this path a mount point, and of what.

use std::path::{Path, PathBuf};

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MountEntry {
    pub mount_point: PathBuf,
    pub fs_type: String,
    pub source: String,
}

impl MountEntry {
    /// Our own FUSE mounts show as `fuse.s3csi` (any `fuse*` type is accepted).
    pub fn is_fuse(&self) -> bool {
        self.fs_type == "fuse" || self.fs_type.starts_with("fuse.") || self.fs_type == "fuseblk"
    }
}

/// Undoes the octal escapes mountinfo uses for space, tab, newline and backslash.
fn unescape(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'\\' && i + 4 <= b.len() {
            let d = &b[i + 1..i + 4];
            if d.iter().all(|c| (b'0'..=b'7').contains(c)) {
                let v = (d[0] - b'0') as u32 * 64 + (d[1] - b'0') as u32 * 8 + (d[2] - b'0') as u32;
                if let Ok(v) = u8::try_from(v) {
                    out.push(v);
                    i += 4;
                    continue;
                }
            }
        }
        out.push(b[i]);
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// Parses mountinfo text.
pub fn parse(text: &str) -> Vec<MountEntry> {
    text.lines()
        .filter_map(|line| {
            let (left, right) = line.split_once(" - ")?;
            let mount_point = left.split(' ').nth(4)?;
            let mut r = right.split(' ');
            let fs_type = r.next()?;
            let source = r.next().unwrap_or("");
            Some(MountEntry {
                mount_point: PathBuf::from(unescape(mount_point)),
                fs_type: fs_type.to_string(),
                source: unescape(source),
            })
        })
        .collect()
}

pub fn read() -> Vec<MountEntry> {
    parse(&std::fs::read_to_string("/proc/self/mountinfo").unwrap_or_default())
}

/// The topmost mount on `path`, if any.
pub fn find(path: &Path) -> Option<MountEntry> {
    topmost(&read(), path).cloned()
}

/// The topmost of `entries` (in mount order) on `path`.
pub fn topmost<'a>(entries: &'a [MountEntry], path: &Path) -> Option<&'a MountEntry> {
    entries.iter().rev().find(|e| e.mount_point == path)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_escaped_fuse_entries() {
        let text = "36 35 98:0 / /mnt/with\\040space rw,noatime master:1 - fuse.s3csi s3csi:bkt rw,user_id=0\n\
                    37 35 98:0 / /proc rw - proc proc rw\n";
        let e = parse(text);
        assert_eq!(e[0].mount_point, PathBuf::from("/mnt/with space"));
        assert!(e[0].is_fuse());
        assert_eq!(e[0].source, "s3csi:bkt");
        assert!(!e[1].is_fuse());
        assert_eq!(unescape("a\\134b"), "a\\b");
        assert_eq!(unescape("trailing\\"), "trailing\\");
    }
}
