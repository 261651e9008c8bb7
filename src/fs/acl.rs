//! POSIX ACLs (`--posix-acl`): the kernel enforces them (FUSE_POSIX_ACL) and asks us
//! for `system.posix_acl_access` / `system.posix_acl_default`, which are stored with the
//! other xattrs (s3fs's `x-amz-meta-xattr`). What the kernel leaves to the file system is
//! here: an access ACL sets the mode's permission bits, chmod updates the ACL, and a new
//! entry in a directory with a default ACL inherits it (umask ignored, as POSIX says).
//!
//! The value is the kernel's xattr form: a little-endian `u32` version (2), then 8-byte
//! entries `(u16 tag, u16 perm, u32 id)`.

use super::error::{FsError, FsResult};

pub const ACCESS: &str = "system.posix_acl_access";
pub const DEFAULT: &str = "system.posix_acl_default";

/// Whether xattr `name` is one of the two ACLs.
pub fn is_acl_name(name: &str) -> bool {
    name == ACCESS || name == DEFAULT
}

const VERSION: u32 = 2;
const USER_OBJ: u16 = 0x01;
const USER: u16 = 0x02;
const GROUP_OBJ: u16 = 0x04;
const GROUP: u16 = 0x08;
const MASK: u16 = 0x10;
const OTHER: u16 = 0x20;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Entry {
    tag: u16,
    perm: u16,
    id: u32,
}

/// A parsed ACL: it has one USER_OBJ, GROUP_OBJ and OTHER entry, and a MASK wherever it
/// names users or groups (the kernel checks this before it sends one; we check again, as
/// the value may come from S3).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Acl(Vec<Entry>);

impl Acl {
    pub fn parse(b: &[u8]) -> FsResult<Self> {
        let bad = || FsError::Invalid("not a POSIX ACL");
        if b.len() < 4 || !(b.len() - 4).is_multiple_of(8) {
            return Err(bad());
        }
        if u32::from_le_bytes(b[0..4].try_into().map_err(|_| bad())?) != VERSION {
            return Err(bad());
        }
        let entries: Vec<Entry> = b[4..]
            .chunks_exact(8)
            .map(|c| Entry {
                tag: u16::from_le_bytes([c[0], c[1]]),
                perm: u16::from_le_bytes([c[2], c[3]]),
                id: u32::from_le_bytes([c[4], c[5], c[6], c[7]]),
            })
            .collect();
        let count = |tag| entries.iter().filter(|e| e.tag == tag).count();
        let named = count(USER) + count(GROUP);
        let known = [USER_OBJ, USER, GROUP_OBJ, GROUP, MASK, OTHER];
        if count(USER_OBJ) != 1
            || count(GROUP_OBJ) != 1
            || count(OTHER) != 1
            || count(MASK) > 1
            || (named > 0 && count(MASK) == 0)
            || entries
                .iter()
                .any(|e| !known.contains(&e.tag) || e.perm & !7 != 0)
        {
            return Err(bad());
        }
        Ok(Acl(entries))
    }

    pub fn to_bytes(&self) -> Vec<u8> {
        let mut out = VERSION.to_le_bytes().to_vec();
        for e in &self.0 {
            out.extend_from_slice(&e.tag.to_le_bytes());
            out.extend_from_slice(&e.perm.to_le_bytes());
            out.extend_from_slice(&e.id.to_le_bytes());
        }
        out
    }

    /// Says no more than the mode's permission bits do: not stored, as on a local disk.
    pub fn is_minimal(&self) -> bool {
        self.0
            .iter()
            .all(|e| matches!(e.tag, USER_OBJ | GROUP_OBJ | OTHER))
    }

    /// The entry the mode's group bits stand for: the mask where there is one.
    fn group_class(&mut self) -> Option<&mut Entry> {
        let at = self
            .0
            .iter()
            .position(|e| e.tag == MASK)
            .or_else(|| self.0.iter().position(|e| e.tag == GROUP_OBJ))?;
        self.0.get_mut(at)
    }

    fn perm(&self, tag: u16) -> u32 {
        self.0
            .iter()
            .find(|e| e.tag == tag)
            .map_or(0, |e| u32::from(e.perm))
    }

    /// The permission bits (0o777) this ACL gives the mode.
    pub fn mode_bits(&self) -> u32 {
        let group = if self.0.iter().any(|e| e.tag == MASK) {
            self.perm(MASK)
        } else {
            self.perm(GROUP_OBJ)
        };
        (self.perm(USER_OBJ) << 6) | (group << 3) | self.perm(OTHER)
    }

    /// chmod: the owner, group-class and other entries take the new bits.
    pub fn chmod(&mut self, mode: u32) {
        for e in self.0.iter_mut() {
            match e.tag {
                USER_OBJ => e.perm = ((mode >> 6) & 7) as u16,
                OTHER => e.perm = (mode & 7) as u16,
                _ => {}
            }
        }
        if let Some(e) = self.group_class() {
            e.perm = ((mode >> 3) & 7) as u16;
        }
    }

    /// The access ACL of a new entry created with `mode` in a directory whose default ACL
    /// is `self` (POSIX.1e `posix_acl_create`): owner, group class and other are limited
    /// by the mode, and the mode takes what remains.
    pub fn inherit(&self, mode: u32) -> (Acl, u32) {
        let mut acl = self.clone();
        for e in acl.0.iter_mut() {
            match e.tag {
                USER_OBJ => e.perm &= ((mode >> 6) & 7) as u16,
                OTHER => e.perm &= (mode & 7) as u16,
                _ => {}
            }
        }
        if let Some(e) = acl.group_class() {
            e.perm &= ((mode >> 3) & 7) as u16;
        }
        let bits = acl.mode_bits();
        (acl, (mode & !0o777) | bits)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn acl(entries: &[(u16, u16, u32)]) -> Vec<u8> {
        Acl(entries
            .iter()
            .map(|&(tag, perm, id)| Entry { tag, perm, id })
            .collect())
        .to_bytes()
    }

    #[test]
    fn parse_checks_what_the_kernel_checks_and_round_trips() {
        let full = acl(&[
            (USER_OBJ, 7, 0),
            (USER, 6, 1000),
            (GROUP_OBJ, 5, 0),
            (MASK, 6, 0),
            (OTHER, 0, 0),
        ]);
        let a = Acl::parse(&full).unwrap();
        assert_eq!(a.to_bytes(), full);
        assert!(!a.is_minimal());
        assert_eq!(a.mode_bits(), 0o760, "the mask stands for the group bits");
        let minimal = Acl::parse(&acl(&[(USER_OBJ, 6, 0), (GROUP_OBJ, 4, 0), (OTHER, 4, 0)]));
        assert!(minimal.as_ref().unwrap().is_minimal());
        assert_eq!(minimal.unwrap().mode_bits(), 0o644);
        for bad in [
            vec![],
            vec![1, 0, 0, 0],
            acl(&[
                (USER_OBJ, 7, 0),
                (USER, 6, 1000),
                (GROUP_OBJ, 5, 0),
                (OTHER, 0, 0),
            ]),
            acl(&[(USER_OBJ, 7, 0), (OTHER, 0, 0)]),
            acl(&[(USER_OBJ, 8, 0), (GROUP_OBJ, 5, 0), (OTHER, 0, 0)]),
            acl(&[
                (USER_OBJ, 7, 0),
                (GROUP_OBJ, 5, 0),
                (OTHER, 0, 0),
                (0x40, 0, 0),
            ]),
            full[..full.len() - 1].to_vec(),
        ] {
            assert!(Acl::parse(&bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn chmod_and_inheritance_follow_posix() {
        let mut a = Acl::parse(&acl(&[
            (USER_OBJ, 7, 0),
            (USER, 7, 1000),
            (GROUP_OBJ, 5, 0),
            (MASK, 7, 0),
            (OTHER, 5, 0),
        ]))
        .unwrap();
        a.chmod(0o750);
        assert_eq!(a.mode_bits(), 0o750);
        assert_eq!(
            a.perm(GROUP_OBJ),
            5,
            "the mask took the group bits, not GROUP_OBJ"
        );
        assert_eq!(
            a.perm(USER),
            7,
            "named entries keep theirs (the mask limits them)"
        );

        let default = Acl::parse(&acl(&[
            (USER_OBJ, 7, 0),
            (GROUP, 7, 2000),
            (GROUP_OBJ, 7, 0),
            (MASK, 7, 0),
            (OTHER, 7, 0),
        ]))
        .unwrap();
        let (file, mode) = default.inherit(0o100644);
        assert_eq!(mode, 0o100644);
        assert_eq!(file.perm(MASK), 4);
        assert_eq!(file.perm(GROUP), 7);
        let (_, mode) = default.inherit(0o040755);
        assert_eq!(mode, 0o040755);
    }
}
