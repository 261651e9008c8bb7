//! POSIX metadata stored as S3 user metadata, in exactly the headers and encodings s3fs
//! (1.90, checked against the real binary on moto) uses, so that a bucket written by one
//! mounts with its permissions in the other:
//!
//! | header | value |
//! |---|---|
//! | `x-amz-meta-mode` | `st_mode` in decimal, S_IFMT included for files, symlinks and special files (`33188` = 0100644); s3fs writes directory markers' mode *without* S_IFDIR (`mkdir -m 705` gives `453`): the key's trailing `/` says what it is |
//! | `x-amz-meta-uid`, `-gid` | decimal |
//! | `x-amz-meta-mtime`, `-ctime`, `-atime` | seconds since the epoch, `SECS` or `SECS.NNNNNNNNN` (9 digits) when there are nanoseconds |
//! | `x-amz-meta-xattr` | URL-encoded JSON object, name → base64 of the value: `%7B%22user.foo%22%3A%22YmFy%22%7D` |
//!
//! A symlink is an object whose body is the target and whose mode has S_IFLNK; a fifo,
//! socket or device node is an empty object whose mode says so; a device node's number is
//! `x-amz-meta-rdev` (decimal, as newer s3fs writes it; 1.90 kept none).
//! Headers other clients wrote that we do not understand are kept on every rewrite; a
//! malformed value is ignored (debug log) and the mount's default used instead: another
//! client's bad header must never fail a lookup.

use crate::s3::UserMeta;
use std::collections::BTreeMap;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

pub const S_IFMT: u32 = libc::S_IFMT;
pub const S_IFREG: u32 = libc::S_IFREG;
pub const S_IFDIR: u32 = libc::S_IFDIR;
pub const S_IFLNK: u32 = libc::S_IFLNK;
pub const S_IFIFO: u32 = libc::S_IFIFO;
pub const S_IFSOCK: u32 = libc::S_IFSOCK;
pub const S_IFCHR: u32 = libc::S_IFCHR;
pub const S_IFBLK: u32 = libc::S_IFBLK;

/// Largest `x-amz-meta-xattr` value we write. S3 allows 2 KiB of user metadata in all;
/// the rest of the headers (mode, owners, times) take ~120 bytes.
pub const MAX_XATTR_HEADER: usize = 1800;

const MODE: &str = "mode";
const UID: &str = "uid";
const GID: &str = "gid";
const MTIME: &str = "mtime";
const CTIME: &str = "ctime";
const ATIME: &str = "atime";
const XATTR: &str = "xattr";
const RDEV: &str = "rdev";

/// What `stat` shows as the file type.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NodeType {
    File,
    Dir,
    Symlink,
    Fifo,
    Socket,
    CharDev,
    BlockDev,
}

impl NodeType {
    pub fn from_mode(mode: u32) -> Option<NodeType> {
        Some(match mode & S_IFMT {
            S_IFREG => NodeType::File,
            S_IFDIR => NodeType::Dir,
            S_IFLNK => NodeType::Symlink,
            S_IFIFO => NodeType::Fifo,
            S_IFSOCK => NodeType::Socket,
            S_IFCHR => NodeType::CharDev,
            S_IFBLK => NodeType::BlockDev,
            _ => return None,
        })
    }

    pub fn ifmt(self) -> u32 {
        match self {
            NodeType::File => S_IFREG,
            NodeType::Dir => S_IFDIR,
            NodeType::Symlink => S_IFLNK,
            NodeType::Fifo => S_IFIFO,
            NodeType::Socket => S_IFSOCK,
            NodeType::CharDev => S_IFCHR,
            NodeType::BlockDev => S_IFBLK,
        }
    }
}

/// The POSIX attributes one object carries. `None` fields were not stored (or not
/// readable) and fall back to the mount's defaults.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PosixMeta {
    /// As stored: may lack S_IFMT (s3fs's directory markers, old clients).
    pub mode: Option<u32>,
    pub uid: Option<u32>,
    pub gid: Option<u32>,
    pub mtime: Option<SystemTime>,
    pub ctime: Option<SystemTime>,
    pub atime: Option<SystemTime>,
    pub xattrs: BTreeMap<String, Vec<u8>>,
    /// A device node's number, as FUSE encodes it (`st_rdev`).
    pub rdev: Option<u32>,
    /// The object's Content-Type (HEAD's, or the one its last write here gave it), kept on
    /// every rewrite (see `config::content_type`).
    pub content_type: Option<String>,
    /// User metadata we do not interpret, written back unchanged.
    pub other: UserMeta,
}

impl PosixMeta {
    pub fn from_headers(h: &UserMeta, key: &str) -> PosixMeta {
        let mut m = PosixMeta::default();
        for (name, value) in h {
            let ok = match name.as_str() {
                MODE => parse_mode(value).map(|v| m.mode = Some(v)).is_some(),
                UID => value.trim().parse().map(|v| m.uid = Some(v)).is_ok(),
                GID => value.trim().parse().map(|v| m.gid = Some(v)).is_ok(),
                MTIME => parse_time(value).map(|v| m.mtime = Some(v)).is_some(),
                CTIME => parse_time(value).map(|v| m.ctime = Some(v)).is_some(),
                ATIME => parse_time(value).map(|v| m.atime = Some(v)).is_some(),
                XATTR => parse_xattrs(value).map(|v| m.xattrs = v).is_some(),
                RDEV => value.trim().parse().map(|v| m.rdev = Some(v)).is_ok(),
                crate::s3::CONTENT_TYPE => {
                    m.content_type = Some(value.clone());
                    true
                }
                _ => {
                    m.other.insert(name.clone(), value.clone());
                    true
                }
            };
            if !ok {
                tracing::debug!(key, header = %name, value = %value,
                    "ignoring a malformed metadata header; the mount's default applies");
            }
        }
        m
    }

    /// The headers to store: ours in s3fs's encoding, then everything else we read.
    pub fn to_headers(&self) -> UserMeta {
        let mut h = self.other.clone();
        if let Some(v) = self.mode {
            h.insert(MODE.into(), v.to_string());
        }
        if let Some(v) = self.uid {
            h.insert(UID.into(), v.to_string());
        }
        if let Some(v) = self.gid {
            h.insert(GID.into(), v.to_string());
        }
        if let Some(v) = self.rdev {
            h.insert(RDEV.into(), v.to_string());
        }
        for (name, t) in [
            (MTIME, self.mtime),
            (CTIME, self.ctime),
            (ATIME, self.atime),
        ] {
            if let Some(t) = t {
                h.insert(name.into(), format_time(t));
            }
        }
        if !self.xattrs.is_empty() {
            h.insert(XATTR.into(), format_xattrs(&self.xattrs));
        }
        if let Some(t) = &self.content_type {
            h.insert(crate::s3::CONTENT_TYPE.into(), t.clone());
        }
        h
    }

    /// The file type the stored mode says, if it says one.
    pub fn node_type(&self) -> Option<NodeType> {
        self.mode.and_then(NodeType::from_mode)
    }

    /// True for what older s3fs versions stored as a directory: an object `dir` (no
    /// slash) of type `application/x-directory`, or whose mode says S_IFDIR.
    pub fn marks_directory(&self) -> bool {
        let typed = self.content_type.as_deref().is_some_and(|t| {
            t.split(';')
                .next()
                .is_some_and(|t| t.trim().eq_ignore_ascii_case("application/x-directory"))
        });
        typed || self.node_type() == Some(NodeType::Dir)
    }

    /// Permission bits (incl. setuid/setgid/sticky), if stored.
    pub fn perm(&self) -> Option<u16> {
        self.mode.map(|m| (m & 0o7777) as u16)
    }
}

/// s3fs parses modes with `strtol(.., 0)`: decimal, or octal with a leading `0`, or hex.
fn parse_mode(s: &str) -> Option<u32> {
    let s = s.trim();
    let v = if let Some(hex) = s.strip_prefix("0x").or_else(|| s.strip_prefix("0X")) {
        u32::from_str_radix(hex, 16).ok()?
    } else if s.len() > 1 && s.starts_with('0') {
        u32::from_str_radix(&s[1..], 8).ok()?
    } else {
        s.parse().ok()?
    };
    // Only a known file type (or none, as on s3fs's directories) and nothing above it.
    (v <= 0o177777 && (v & S_IFMT == 0 || NodeType::from_mode(v).is_some())).then_some(v)
}

pub fn format_time(t: SystemTime) -> String {
    let d = t.duration_since(UNIX_EPOCH).unwrap_or_default();
    if d.subsec_nanos() == 0 {
        d.as_secs().to_string()
    } else {
        format!("{}.{:09}", d.as_secs(), d.subsec_nanos())
    }
}

pub fn parse_time(s: &str) -> Option<SystemTime> {
    let s = s.trim();
    let (secs, frac) = s.split_once('.').unwrap_or((s, ""));
    let secs: u64 = secs.parse().ok()?;
    if frac.len() > 9 || !frac.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    let nanos = if frac.is_empty() {
        0
    } else {
        format!("{frac:0<9}").parse().ok()?
    };
    UNIX_EPOCH.checked_add(Duration::new(secs, nanos))
}

/// `{"name":"base64",...}` (sorted by name, as s3fs's std::map), URL-encoded.
pub fn format_xattrs(x: &BTreeMap<String, Vec<u8>>) -> String {
    let json: BTreeMap<&str, String> = x
        .iter()
        .map(|(k, v)| (k.as_str(), aws_smithy_types::base64::encode(v)))
        .collect();
    let text = serde_json::to_string(&json).unwrap_or_else(|_| "{}".into());
    url_encode(&text)
}

fn parse_xattrs(s: &str) -> Option<BTreeMap<String, Vec<u8>>> {
    let text = url_decode(s)?;
    let json: BTreeMap<String, String> = serde_json::from_str(&text).ok()?;
    json.into_iter()
        .map(|(k, v)| Some((k, aws_smithy_types::base64::decode(v).ok()?)))
        .collect()
}

/// Everything but RFC 3986's unreserved characters, as s3fs's urlEncode does.
fn url_encode(s: &str) -> String {
    let mut out = String::with_capacity(s.len() * 3);
    for b in s.bytes() {
        match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => {
                out.push(b as char)
            }
            _ => out.push_str(&format!("%{b:02X}")),
        }
    }
    out
}

fn url_decode(s: &str) -> Option<String> {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'%' {
            let hex = std::str::from_utf8(b.get(i + 1..i + 3)?).ok()?;
            out.push(u8::from_str_radix(hex, 16).ok()?);
            i += 3;
        } else {
            out.push(if b[i] == b'+' { b' ' } else { b[i] });
            i += 1;
        }
    }
    String::from_utf8(out).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn headers(pairs: &[(&str, &str)]) -> UserMeta {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    /// What s3fs 1.90 wrote on moto for `echo hi > f; chown 1234:5678 f; chmod 751 f;
    /// touch -d @1577934245.123456789 f; setfattr user.bin, user.foo` (with `-o use_xattr`).
    #[test]
    fn reads_what_s3fs_wrote_and_writes_it_back_identically() {
        let h = headers(&[
            ("atime", "1577934245.123456789"),
            ("ctime", "1796139820"),
            ("gid", "5678"),
            ("mode", "33257"),
            ("mtime", "1577934245.123456789"),
            ("uid", "1234"),
            (
                "xattr",
                "%7B%22user.bin%22%3A%22AP8vKz0geA%3D%3D%22%2C%22user.foo%22%3A%22YmFy%22%7D",
            ),
        ]);
        let m = PosixMeta::from_headers(&h, "f");
        assert_eq!(m.mode, Some(0o100751));
        assert_eq!(m.node_type(), Some(NodeType::File));
        assert_eq!((m.uid, m.gid), (Some(1234), Some(5678)));
        assert_eq!(
            m.mtime,
            Some(UNIX_EPOCH + Duration::new(1577934245, 123456789))
        );
        assert_eq!(m.ctime, Some(UNIX_EPOCH + Duration::from_secs(1796139820)));
        assert_eq!(m.xattrs["user.foo"], b"bar");
        assert_eq!(m.xattrs["user.bin"], b"\x00\xff/+= x");
        assert_eq!(m.to_headers(), h);
    }

    #[test]
    fn s3fs_directory_markers_and_special_files() {
        // mkdir -m 705 d; ln -s target/x lnk; mkfifo fifo; mknod cdev c 1 3 (s3fs 1.90).
        assert_eq!(
            PosixMeta::from_headers(&headers(&[("mode", "453")]), "d/").perm(),
            Some(0o705)
        );
        let types = [
            ("41471", NodeType::Symlink),
            ("4516", NodeType::Fifo),
            ("8612", NodeType::CharDev),
            ("24996", NodeType::BlockDev),
        ];
        for (mode, t) in types {
            let m = PosixMeta::from_headers(&headers(&[("mode", mode)]), "x");
            assert_eq!(m.node_type(), Some(t), "{mode}");
        }
    }

    #[test]
    fn malformed_headers_are_ignored_and_unknown_ones_kept() {
        let h = headers(&[
            ("mode", "rwxr-xr-x"),
            ("uid", "-1"),
            ("gid", "99999999999"),
            ("mtime", "yesterday"),
            ("ctime", "1.1234567890"),
            ("xattr", "%7Bnot json"),
            ("color", "blue"),
        ]);
        let m = PosixMeta::from_headers(&h, "k");
        assert_eq!(
            m,
            PosixMeta {
                other: headers(&[("color", "blue")]),
                ..Default::default()
            }
        );
        // An unknown file type is refused too; octal and hex as strtol(.., 0) reads them.
        assert_eq!(parse_mode("0o170644"), None);
        assert_eq!(parse_mode(&(0o170644u32).to_string()), None);
        assert_eq!(parse_mode("0100644"), Some(0o100644));
        assert_eq!(parse_mode("0x81a4"), Some(0o100644));
    }

    #[test]
    fn times_round_trip_in_s3fs_format() {
        let t = UNIX_EPOCH + Duration::new(1_700_000_000, 5);
        assert_eq!(format_time(t), "1700000000.000000005");
        assert_eq!(parse_time("1700000000.000000005"), Some(t));
        assert_eq!(
            format_time(UNIX_EPOCH + Duration::from_secs(7)),
            "7".to_string()
        );
        assert_eq!(
            parse_time("7.5"),
            Some(UNIX_EPOCH + Duration::new(7, 500_000_000))
        );
    }
}
