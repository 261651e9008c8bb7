//! POSIX metadata in the inode table and in S3 (encodings in `meta.rs`): loading it
//! (one HEAD per object a listing showed, many in parallel), chmod/chown/utimes and
//! xattrs, symlinks and special files.
//!
//! Saving a change: the inode's metadata changes at once (the reply shows it) and a save
//! is scheduled `SAVE_DELAY` later, a CopyObject of the object onto itself with the new
//! headers (`ObjectClient::replace_metadata`, conditional on the ETag). Changes that
//! arrive meanwhile (tar's and rsync's chown + chmod + utimes of one file, one after the
//! other) ride along in that one copy. A file being written takes its metadata with its
//! upload instead (`writer.rs`), and so does a new file. fsync, rename and unmount save
//! what is pending first. A save that finds another version in S3 (another client
//! replaced the object) drops our change: theirs is newer.

use super::meta::{NodeType, PosixMeta, S_IFLNK, S_IFMT, S_IFREG};
use super::*;
use crate::config::content_type::ContentTypes;
use crate::s3::{S3Result, UserMeta, CONTENT_TYPE};
use futures::StreamExt;

/// How long a metadata change waits for others to share its CopyObject, by default
/// (`FsConfig::meta_save_delay`).
pub(super) const SAVE_DELAY: Duration = Duration::from_millis(100);
/// HEADs in flight at once when a listing's metadata is loaded.
const HEADS_IN_FLIGHT: usize = 128;
/// HEADs in flight at once for all listings together (a tree walk loads several
/// directories ahead, see `walk_ahead.rs`): each needs a connection of its own.
static ALL_HEADS_IN_FLIGHT: tokio::sync::Semaphore = tokio::sync::Semaphore::const_new(256);
/// Longest symlink target (Linux's PATH_MAX).
const MAX_LINK: usize = 4096;

/// True when `i`'s metadata is unknown and S3 can tell it (see `S3Fs::needs_meta`).
pub(super) fn unknown_meta(i: &Inode) -> bool {
    i.meta.is_none() && !i.being_written() && !i.local_only && i.ino != inode::ROOT_INO
}

/// HEADs `todo` (inode, key, kind), `HEADS_IN_FLIGHT` at once, stores what each says
/// and calls `done` with the inode once it is stored. Failures leave the metadata
/// unknown (the defaults show, the next access asks).
pub(super) async fn head_batch(
    client: &Arc<dyn ObjectClient>,
    inodes: &Mutex<InodeTable>,
    todo: Vec<(u64, String, Kind)>,
    mount_time: SystemTime,
    mut done: impl FnMut(u64),
) {
    if todo.is_empty() {
        return;
    }
    let mut heads = futures::stream::iter(todo)
        .map(|(ino, key, kind)| async move {
            let _slot = ALL_HEADS_IN_FLIGHT.acquire().await;
            let res = client.head_object_with_meta(&key).await;
            (ino, key, kind, res)
        })
        .buffer_unordered(HEADS_IN_FLIGHT);
    while let Some((ino, key, kind, res)) = heads.next().await {
        store_head(inodes, ino, &key, kind, res, mount_time);
        done(ino);
    }
    lock(inodes).flush_known_versions();
}

fn store_head(
    inodes: &Mutex<InodeTable>,
    ino: u64,
    key: &str,
    kind: Kind,
    res: S3Result<(crate::s3::ObjectMeta, UserMeta)>,
    mount_time: SystemTime,
) {
    let mut t = lock(inodes);
    let Some(i) = t.get_mut(ino).filter(|i| i.meta_key() == key) else {
        if let (Kind::File, Ok((m, h))) = (kind, &res) {
            if let Some(etag) = &m.etag {
                t.remember_version(key, etag, h, m.mtime);
            }
        }
        return;
    };
    if i.being_written() || i.local_only {
        return;
    }
    match res {
        Ok((m, h)) => {
            if kind == Kind::File {
                i.size = m.size;
                i.etag = m.etag;
                i.mtime = m.mtime;
                // As good as a listing: the stat this HEAD was started for may come more
                // than a TTL after the page was listed (a loaded machine), and must not
                // HEAD the object again.
                i.validated = Some(Instant::now());
            }
            t.set_meta(ino, &h, m.mtime);
        }
        // An implicit directory: no marker, no metadata.
        Err(S3Error::NotFound) if kind == Kind::Dir => {
            // (An old-style marker removed by another client leaves it implicit too.)
            i.legacy_marker = None;
            t.set_meta(ino, &UserMeta::new(), mount_time)
        }
        // Deleted since the listing: the next lookup asks S3 again.
        Err(S3Error::NotFound) => i.validated = None,
        Err(e) => tracing::debug!(key = %i.key, error = %e, "could not load metadata"),
    }
}

/// What a setattr asks to change besides the size.
#[derive(Debug, Clone, Copy, Default)]
pub struct SetAttrs {
    pub mode: Option<u32>,
    pub uid: Option<u32>,
    pub gid: Option<u32>,
    pub atime: Option<SystemTime>,
    pub mtime: Option<SystemTime>,
}

impl SetAttrs {
    pub fn is_empty(&self) -> bool {
        self.mode.is_none()
            && self.uid.is_none()
            && self.gid.is_none()
            && self.atime.is_none()
            && self.mtime.is_none()
    }
}

/// Who creates a file, for its stored owner.
#[derive(Debug, Clone, Copy)]
pub struct Creator {
    pub uid: u32,
    pub gid: u32,
}

pub(super) fn new_meta(mode: u32, who: Creator) -> PosixMeta {
    let now = SystemTime::now();
    PosixMeta {
        mode: Some(mode),
        uid: Some(who.uid),
        gid: Some(who.gid),
        mtime: Some(now),
        ctime: Some(now),
        atime: Some(now),
        ..Default::default()
    }
}

/// The `x-amz-meta-mode` to store for permission bits `perm` of an inode of `kind` that
/// shows `shown` and has `stored` now: its file type kept (or the shown one), none for a
/// directory marker, as s3fs keeps S_IFDIR off them.
fn stored_mode(kind: Kind, stored: Option<u32>, shown: &Attr, perm: u32) -> u32 {
    if kind == Kind::Dir {
        return perm & 0o7777;
    }
    let ifmt = match stored {
        Some(old) if old & S_IFMT != 0 => old & S_IFMT,
        _ => shown.node.ifmt(),
    };
    ifmt | (perm & 0o7777)
}

/// `h` with a Content-Type: the one it carries (an existing object's, which is kept),
/// else the one `types` gives a new object at `key`.
pub(super) fn with_content_type(types: &ContentTypes, mut h: UserMeta, key: &str) -> UserMeta {
    h.entry(CONTENT_TYPE.to_string())
        .or_insert_with(|| types.for_key(key));
    h
}

impl S3Fs {
    /// `headers` for a write of `key`, with their Content-Type (see `with_content_type`).
    pub(super) fn typed(&self, headers: UserMeta, key: &str) -> UserMeta {
        with_content_type(&self.cfg.content_type, headers, key)
    }

    /// The headers the next upload of `ino` carries: its Content-Type (the stored one,
    /// else the name's, recorded as the object's), and its POSIX metadata if stored
    /// metadata is honoured. A file written since it was last saved gets the time of its
    /// last write as mtime. `None` only for an inode no longer known.
    pub(super) fn upload_headers(&self, ino: u64) -> Option<UserMeta> {
        let mut t = self.inodes();
        let i = t.get_mut(ino)?;
        let written_at = i.mtime;
        let m = match i.meta.as_mut() {
            Some(m) if self.cfg.posix_metadata => m,
            _ => return Some(self.typed(UserMeta::new(), &i.key)),
        };
        if i.mtime_from_writes || m.content_type.is_none() {
            let m = Arc::make_mut(m);
            if i.mtime_from_writes {
                m.mtime = Some(written_at);
                m.ctime = Some(written_at);
            }
            if m.content_type.is_none() {
                m.content_type = Some(self.cfg.content_type.for_key(&i.key));
            }
        }
        Some(m.to_headers())
    }

    /// A new file's metadata: its mode (after the umask) and the creator's ids, saved by
    /// its upload.
    pub fn init_meta(&self, ino: u64, mode: u32, who: Creator) {
        if !self.cfg.posix_metadata {
            return;
        }
        let mut t = self.inodes();
        if let Some(i) = t.get_mut(ino) {
            i.meta = Some(Arc::new(new_meta(S_IFREG | (mode & 0o7777), who)));
            i.meta_stamp = None;
        }
    }

    /// The mode of a new file, directory or special file created with `mode` and the
    /// caller's `umask` in `parent`, and the ACLs it inherits: with `--posix-acl`, a
    /// parent's default ACL gives the new entry its access ACL (and a directory that
    /// default ACL too), limited by `mode`, and the umask does not apply (POSIX.1e).
    pub async fn new_entry_mode(
        &self,
        parent: u64,
        mode: u32,
        umask: u32,
        dir: bool,
    ) -> (u32, Vec<(String, Vec<u8>)>) {
        let masked = mode & !(umask & 0o777);
        if !self.cfg.posix_acl {
            return (masked, Vec::new());
        }
        self.load_meta(&[parent]).await;
        let default = self.inode(parent).ok().and_then(|p| {
            let v = p.meta.as_ref()?.xattrs.get(acl::DEFAULT)?.clone();
            Some((acl::Acl::parse(&v).ok()?, v))
        });
        let Some((default, raw)) = default else {
            return (masked, Vec::new());
        };
        let (access, mode) = default.inherit(mode);
        let mut inherited = Vec::new();
        if !access.is_minimal() {
            inherited.push((acl::ACCESS.to_string(), access.to_bytes()));
        }
        if dir {
            inherited.push((acl::DEFAULT.to_string(), raw));
        }
        (mode, inherited)
    }

    /// Gives the new entry `made` the ACLs `new_entry_mode` said it inherits: carried by
    /// its upload if one is due, else saved as any metadata change (one more PUT of a
    /// directory marker, or a copy of a special file). What the entry shows now.
    pub fn add_inherited(&self, made: Attr, inherited: Vec<(String, Vec<u8>)>) -> Attr {
        let ino = made.ino;
        if !inherited.is_empty() {
            self.inherit_xattrs(ino, inherited);
        }
        self.entry_attr(ino).unwrap_or(made)
    }

    fn inherit_xattrs(&self, ino: u64, inherited: Vec<(String, Vec<u8>)>) {
        let schedule = {
            let mut t = self.inodes();
            let Some(i) = t.get_mut(ino) else {
                return;
            };
            let m = Arc::make_mut(i.meta.get_or_insert_with(Default::default));
            m.xattrs.extend(inherited);
            i.meta_changes += 1;
            !i.being_written() && !i.local_only
        };
        if schedule {
            self.schedule_save(ino);
        }
    }

    /// chmod, chown, utimensat (`setattr` without a size).
    pub async fn set_attrs(&self, ino: u64, set: SetAttrs) -> FsResult<Attr> {
        if !self.cfg.posix_metadata || set.is_empty() {
            return self.getattr(ino).await;
        }
        self.writable()?;
        self.load_meta(&[ino]).await;
        let now = SystemTime::now();
        let (attr, schedule) = {
            let mut t = self.inodes();
            let i = t.get_mut(ino).ok_or(FsError::NotFound)?;
            let shown = self.attr_of(i);
            let m = Arc::make_mut(i.meta.get_or_insert_with(Default::default));
            if let Some(mode) = set.mode {
                m.mode = Some(stored_mode(i.kind, m.mode, &shown, mode));
                if let Some(v) = m.xattrs.get_mut(acl::ACCESS).filter(|_| self.cfg.posix_acl) {
                    // The ACL's owner, group-class and other entries follow the mode.
                    if let Ok(mut a) = acl::Acl::parse(v) {
                        a.chmod(mode);
                        *v = a.to_bytes();
                    }
                }
            } else if m.mode.is_none() && i.kind == Kind::File {
                // The first stored mode must say what the file shows now.
                m.mode = Some(shown.node.ifmt() | u32::from(shown.perm));
            }
            if set.uid.is_some() || set.gid.is_some() {
                m.uid = Some(set.uid.unwrap_or(shown.uid));
                m.gid = Some(set.gid.unwrap_or(shown.gid));
            }
            if let Some(t) = set.mtime {
                m.mtime = Some(t);
                i.mtime_from_writes = false;
                // A time set explicitly (touch -d, rsync -t, tar) wins over the entries'
                // changes before it.
                i.entries_changed_at = None;
            } else if m.mtime.is_none() {
                m.mtime = Some(shown.mtime);
            }
            if let Some(t) = set.atime {
                m.atime = Some(t);
            }
            m.ctime = Some(now);
            i.meta_changes += 1;
            (self.attr_of(i), !i.being_written())
        };
        if schedule {
            self.schedule_save(ino);
        }
        Ok(attr)
    }

    /// Clears the set-user-ID bit of file `ino`, and its set-group-ID bit if it is
    /// group-executable, as the kernel does when a process without CAP_FSETID writes or
    /// truncates a file: direct I/O writes and `O_TRUNC` opens (atomic here) reach us
    /// without the SETATTR the kernel sends otherwise. Costs nothing unless a bit is set;
    /// then it is a metadata change like chmod's.
    pub async fn drop_set_id_bits(&self, ino: u64) -> FsResult<()> {
        let perm = {
            let t = self.inodes();
            match t.get(ino) {
                Some(i) if i.kind == Kind::File => self.attr_of(i).perm,
                _ => return Ok(()),
            }
        };
        let kill = set_id_bits_to_kill(perm);
        if kill == 0 {
            return Ok(());
        }
        let mode = Some(u32::from(perm & !kill));
        self.set_attrs(
            ino,
            SetAttrs {
                mode,
                ..Default::default()
            },
        )
        .await
        .map(|_| ())
    }

    /// Saves `ino`'s metadata `meta_save_delay` from now (see the module doc).
    pub(super) fn schedule_save(&self, ino: u64) {
        let saver = self.saver();
        let delay = self.cfg.meta_save_delay;
        tokio::spawn(async move {
            tokio::time::sleep(delay).await;
            saver.save(ino).await
        });
    }

    fn saver(&self) -> Saver {
        Saver {
            client: self.client.clone(),
            inodes: self.inodes.clone(),
            pending: self.pending.clone(),
            saving: self.saving.clone(),
            content_type: self.cfg.content_type.clone(),
        }
    }

    /// Saves what is pending for `ino` now (fsync, rename, unmount).
    pub(super) async fn save_meta(&self, ino: u64) -> FsResult<()> {
        self.saver().save(ino).await
    }

    #[cfg(test)]
    pub(super) async fn fsync_meta_for_tests(&self, ino: u64) {
        self.save_meta(ino).await.unwrap()
    }

    /// Saves every pending metadata change (unmount); returns how many failed.
    pub(super) async fn save_all_meta(&self) -> usize {
        let dirty: Vec<u64> = {
            let t = self.inodes();
            t.dirty_meta()
        };
        let saver = self.saver();
        futures::stream::iter(dirty)
            .map(|ino| {
                let saver = &saver;
                async move { saver.save(ino).await.is_err() as usize }
            })
            .buffer_unordered(HEADS_IN_FLIGHT)
            .fold(0, |a, b| async move { a + b })
            .await
    }

    // ---- xattrs ------------------------------------------------------------------

    fn xattr_name_ok(&self, name: &str) -> FsResult<()> {
        // Security labels mean something to the kernel that S3 cannot keep; POSIX ACLs
        // only where the kernel enforces them (`--posix-acl`).
        let acl = self.cfg.posix_acl && acl::is_acl_name(name);
        if name.starts_with("user.") || name.starts_with("trusted.") || acl {
            Ok(())
        } else {
            Err(FsError::Unsupported(
                "only user.* and trusted.* xattrs (and POSIX ACLs with --posix-acl)",
            ))
        }
    }

    pub async fn getxattr(&self, ino: u64, name: &str) -> FsResult<Vec<u8>> {
        if !self.cfg.posix_metadata || self.xattr_name_ok(name).is_err() {
            return Err(FsError::NoAttr);
        }
        self.load_meta(&[ino]).await;
        let i = self.inode(ino)?;
        i.meta
            .as_ref()
            .and_then(|m| m.xattrs.get(name).cloned())
            .ok_or(FsError::NoAttr)
    }

    pub async fn listxattr(&self, ino: u64) -> FsResult<Vec<u8>> {
        if !self.cfg.posix_metadata {
            return Ok(Vec::new());
        }
        self.load_meta(&[ino]).await;
        let i = self.inode(ino)?;
        let mut out = Vec::new();
        let names = i.meta.iter().flat_map(|m| m.xattrs.keys());
        for name in names.filter(|n| self.xattr_name_ok(n).is_ok()) {
            out.extend_from_slice(name.as_bytes());
            out.push(0);
        }
        Ok(out)
    }

    /// setxattr (`value` Some) and removexattr; `flags` are XATTR_CREATE/XATTR_REPLACE.
    pub async fn change_xattr(
        &self,
        ino: u64,
        name: &str,
        value: Option<&[u8]>,
        flags: i32,
    ) -> FsResult<()> {
        if !self.cfg.posix_metadata {
            return Err(FsError::Unsupported("xattrs need stored metadata"));
        }
        self.xattr_name_ok(name)?;
        self.writable()?;
        let access_acl = match value {
            Some(v) if acl::is_acl_name(name) => {
                Some(acl::Acl::parse(v)?).filter(|_| name == acl::ACCESS)
            }
            _ => None,
        };
        self.load_meta(&[ino]).await;
        let schedule = {
            let mut t = self.inodes();
            let i = t.get_mut(ino).ok_or(FsError::NotFound)?;
            let shown = self.attr_of(i);
            let m = Arc::make_mut(i.meta.get_or_insert_with(Default::default));
            let exists = m.xattrs.contains_key(name);
            if let Some(a) = &access_acl {
                // The kernel leaves the mode to us: it shows the ACL's owner, group-class
                // and other bits; an ACL that says no more than them is not kept.
                let special = u32::from(shown.perm) & 0o7000;
                m.mode = Some(stored_mode(i.kind, m.mode, &shown, special | a.mode_bits()));
            }
            match value {
                Some(_) if access_acl.as_ref().is_some_and(|a| a.is_minimal()) => {
                    m.xattrs.remove(name);
                }
                Some(v) => {
                    if flags & libc::XATTR_CREATE != 0 && exists {
                        return Err(FsError::Exists);
                    }
                    if flags & libc::XATTR_REPLACE != 0 && !exists {
                        return Err(FsError::NoAttr);
                    }
                    let mut x = m.xattrs.clone();
                    x.insert(name.to_string(), v.to_vec());
                    if meta::format_xattrs(&x).len() > meta::MAX_XATTR_HEADER {
                        return Err(FsError::XattrTooBig);
                    }
                    m.xattrs = x;
                }
                None => {
                    // Removing an ACL that is not there (`setfacl -b` of a plain mode) is
                    // no error.
                    if m.xattrs.remove(name).is_none() && !acl::is_acl_name(name) {
                        return Err(FsError::NoAttr);
                    }
                }
            }
            if m.mode.is_none() && i.kind == Kind::File {
                m.mode = Some(shown.node.ifmt() | u32::from(shown.perm));
            }
            m.ctime = Some(SystemTime::now());
            i.meta_changes += 1;
            !i.being_written()
        };
        if schedule {
            self.schedule_save(ino);
        }
        Ok(())
    }

    // ---- symlinks and special files -------------------------------------------------

    /// An object whose body is the target and whose mode has S_IFLNK (s3fs's format).
    pub async fn symlink(
        &self,
        parent: u64,
        name: &str,
        target: &str,
        who: Creator,
    ) -> FsResult<Attr> {
        if target.len() > MAX_LINK {
            return Err(FsError::NameTooLong);
        }
        let ino = self
            .create_object(
                parent,
                name,
                S_IFLNK | 0o777,
                None,
                who,
                Bytes::copy_from_slice(target.as_bytes()),
            )
            .await?;
        let mut t = self.inodes();
        let i = t.get_mut(ino).ok_or(FsError::NotFound)?;
        i.link_target = Some(Arc::from(target));
        Ok(self.attr_of(i))
    }

    /// mknod: a fifo, socket or device node is an empty object whose mode says what it
    /// is, and a device node's number in `rdev` (as s3fs stores them); a regular file is
    /// created empty.
    pub async fn mknod(
        &self,
        parent: u64,
        name: &str,
        mode: u32,
        rdev: u32,
        who: Creator,
    ) -> FsResult<Attr> {
        let ifmt = if mode & S_IFMT == 0 {
            S_IFREG
        } else {
            mode & S_IFMT
        };
        let rdev = match NodeType::from_mode(ifmt) {
            Some(NodeType::Dir | NodeType::Symlink) | None => {
                return Err(FsError::Invalid("mknod of this file type"))
            }
            Some(NodeType::CharDev | NodeType::BlockDev) => Some(rdev),
            Some(_) => None,
        };
        let ino = self
            .create_object(
                parent,
                name,
                ifmt | (mode & 0o7777),
                rdev,
                who,
                Bytes::new(),
            )
            .await?;
        Ok(self.attr_of(&self.inode(ino)?))
    }

    /// PUTs a new object with its metadata (symlink, mknod) and binds it.
    async fn create_object(
        &self,
        parent: u64,
        name: &str,
        mode: u32,
        rdev: Option<u32>,
        who: Creator,
        body: Bytes,
    ) -> FsResult<u64> {
        if !self.cfg.posix_metadata {
            return Err(FsError::Unsupported(
                "symlinks and special files need stored metadata (--ignore-metadata is set)",
            ));
        }
        self.writable()?;
        check_name(name)?;
        let p = self.dir_inode(parent)?;
        let key = format!("{}{}", p.key, name);
        if key.len() + 1 > MAX_KEY_LEN {
            return Err(FsError::NameTooLong);
        }
        if self.inodes().child(parent, name).is_some() {
            return Err(FsError::Exists);
        }
        if !self.listing_fresh(&p) && self.probe(&p.key, name).await?.is_some() {
            return Err(FsError::Exists);
        }
        let mut m = new_meta(mode, who);
        m.rdev = rdev;
        m.content_type = Some(self.cfg.content_type.for_key(&key));
        let size = body.len() as u64;
        let put = self
            .client
            .put_object_with_meta(&key, body, &m.to_headers())
            .await?;
        let mut t = self.inodes();
        let ino = t.upsert(parent, name, Kind::File, size, SystemTime::now(), put.etag);
        t.entries_changed(parent);
        let i = t.get_mut(ino).ok_or(FsError::NotFound)?;
        i.meta = Some(Arc::new(m));
        i.meta_stamp = None;
        t.add_lookup(ino);
        Ok(ino)
    }

    pub async fn readlink(&self, ino: u64) -> FsResult<Vec<u8>> {
        self.load_meta(&[ino]).await;
        let i = self.inode(ino)?;
        if self.attr_of(&i).node != NodeType::Symlink {
            return Err(FsError::Invalid("not a symlink"));
        }
        if let Some(t) = &i.link_target {
            return Ok(t.as_bytes().to_vec());
        }
        let size = i.size.min(MAX_LINK as u64);
        let body = match &i.etag {
            Some(etag) => self.client.get_range_if_match(&i.key, etag, 0, size).await,
            None => self.client.get_range(&i.key, 0, size).await,
        }?;
        let target: Arc<str> = Arc::from(String::from_utf8_lossy(&body).as_ref());
        if let Some(i) = self.inodes().get_mut(ino) {
            i.link_target = Some(target.clone());
        }
        Ok(target.as_bytes().to_vec())
    }

    /// The attributes READDIRPLUS returns for an entry `readdir` produced; `None` for one
    /// the table no longer holds.
    pub fn entry_attr(&self, ino: u64) -> Option<Attr> {
        self.inodes().get(ino).map(|i| self.attr_of(i))
    }

    /// The kernel took references to these entries of a READDIRPLUS reply.
    pub fn add_lookups(&self, inos: &[u64]) {
        let mut t = self.inodes();
        for ino in inos {
            t.add_lookup(*ino);
        }
    }
}

/// What a metadata save needs, apart from the file system (it runs in its own task).
struct Saver {
    client: Arc<dyn ObjectClient>,
    inodes: Arc<Mutex<InodeTable>>,
    pending: Arc<Mutex<HashMap<u64, PendingCreate>>>,
    saving: SavesUnderWay,
    /// For objects whose type is unknown here: the copy must name one (see
    /// `ObjectClient::replace_metadata`).
    content_type: ContentTypes,
}

/// One turn per inode whose metadata is being saved: its saves run one at a time.
pub(super) type SavesUnderWay = Arc<Mutex<HashMap<u64, Arc<tokio::sync::Mutex<()>>>>>;

impl Saver {
    /// Saves `ino`'s pending change, after any save of it under way: that one may take
    /// this change along, and two at once both copied the object (tar's three calls each
    /// schedule a save, and the timers fire together).
    async fn save(&self, ino: u64) -> FsResult<()> {
        let turn = lock(&self.saving).entry(ino).or_default().clone();
        let result = {
            let _turn = turn.lock().await;
            self.save_now(ino).await
        };
        let mut saving = lock(&self.saving);
        // Nobody else holds or waits for this turn (taking it needs the map's lock).
        if Arc::strong_count(&turn) == 2 {
            saving.remove(&ino);
        }
        result
    }

    async fn save_now(&self, ino: u64) -> FsResult<()> {
        // A new empty file's PUT must be in S3 before its copy.
        let done = lock(&self.pending).get(&ino).map(|p| p.done.clone());
        if let Some(done) = done {
            // A failed PUT unbound the name: nothing is saved below.
            let _ = done.outcome().await;
        }
        let (key, kind, etag, size, headers, change, legacy) = {
            let t = lock(&self.inodes);
            let Some(i) = t.get(ino) else {
                return Ok(());
            };
            if i.meta_changes == i.meta_saved || i.being_written() || i.local_only {
                // Saved already, or the upload under way takes it along.
                return Ok(());
            }
            if !t.is_bound(ino) {
                // Unlinked or replaced while open (`keep_while_open`): no object is its own.
                return Ok(());
            }
            let headers = i.meta.as_ref().map(|m| m.to_headers()).unwrap_or_default();
            // The copy replaces the Content-Type as well: the stored one goes with it.
            let headers = with_content_type(&self.content_type, headers, &i.key);
            (
                i.key.clone(),
                i.kind,
                i.etag.clone(),
                i.size,
                headers,
                i.meta_changes,
                i.legacy_marker.clone(),
            )
        };
        let result = match kind {
            // A marker is empty: writing it anew is the copy, and creates it for an
            // implicit directory.
            Kind::Dir => {
                let put = self
                    .client
                    .put_object_with_meta(&key, Bytes::new(), &headers)
                    .await
                    .map(|m| m.etag);
                // The marker `dir/` replaces an older s3fs directory object: removed once
                // the marker holds the metadata, so the directory never lacks both.
                if let (Ok(_), Some(legacy)) = (&put, &legacy) {
                    match self.client.delete_object(legacy).await {
                        Ok(()) => {
                            if let Some(i) = lock(&self.inodes).get_mut(ino) {
                                i.legacy_marker = None;
                            }
                        }
                        Err(e) => tracing::warn!(key = %legacy, error = %e,
                            "could not remove an old-style directory object after writing its marker"),
                    }
                }
                put
            }
            Kind::File => {
                let etag = match etag {
                    Some(e) => Ok(e),
                    None => self.client.head_object(&key).await.and_then(|m| {
                        m.etag
                            .ok_or_else(|| S3Error::Other("HEAD returned no ETag".into()))
                    }),
                };
                match etag {
                    Ok(etag) => self
                        .client
                        .replace_metadata(&key, &etag, size, &headers)
                        .await
                        .map(|m| m.etag.or(Some(etag))),
                    Err(e) => Err(e),
                }
            }
        };
        let mut t = lock(&self.inodes);
        let Some(i) = t.get_mut(ino) else {
            return Ok(());
        };
        match result {
            Ok(etag) => {
                i.meta_saved = i.meta_saved.max(change);
                if kind == Kind::File {
                    i.etag = etag;
                    // The copy has a new Last-Modified, which the next listing supplies.
                    i.meta_stamp = None;
                }
                Ok(())
            }
            Err(e) => {
                if e == S3Error::NotFound {
                    // Unlinked (or renamed by another client) before the save: nothing to keep.
                    tracing::debug!(key = %key, "metadata not saved: the object is gone");
                } else {
                    tracing::warn!(key = %key, error = %e,
                        "could not save metadata (chmod/chown/utimes/xattr); S3 keeps what it had");
                }
                // Ours is dropped: what S3 holds shows from the next lookup on.
                i.meta_saved = i.meta_changes;
                i.meta = None;
                i.validated = None;
                Err(FsError::S3(e))
            }
        }
    }
}

/// The set-ID bits a write without CAP_FSETID clears from `perm`: S_ISUID, and S_ISGID
/// when the group may execute (without it, S_ISGID marks mandatory locking and stays).
fn set_id_bits_to_kill(perm: u16) -> u16 {
    let mut kill = perm & 0o4000;
    if perm & 0o2010 == 0o2010 {
        kill |= 0o2000;
    }
    kill
}
