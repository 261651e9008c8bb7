//! Thin fuser adapter: decode the request, run the matching [`S3Fs`] method on the tokio
//! runtime, reply. No file-system logic lives here.

use super::meta::NodeType;
use super::meta_update::{Creator, SetAttrs};
use super::passthrough::BackingTable;
use super::{Attr, DirEntry, FsError, OpenMode, S3Fs};
use fuser::{
    Errno, FileAttr, FileHandle, FileType, Filesystem, FopenFlags, Generation, INodeNo, InitFlags,
    KernelConfig, LockOwner, OpenFlags, RenameFlags, ReplyAttr, ReplyCreate, ReplyData,
    ReplyDirectory, ReplyDirectoryPlus, ReplyEmpty, ReplyEntry, ReplyOpen, ReplyStatfs, ReplyWrite,
    Request, TimeOrNow, WriteFlags,
};
use std::ffi::OsStr;
use std::sync::Arc;
use std::time::SystemTime;
use tokio::runtime::Handle;

pub struct FuseAdapter {
    fs: Arc<S3Fs>,
    rt: Handle,
    /// What `open` and `create` tell the kernel about a file's data; decided at INIT.
    file_flags: FopenFlags,
    /// Set for a replacement mounter: whether the connection it takes over negotiated
    /// FUSE_DIRECT_IO_ALLOW_MMAP (the replayed INIT cannot change what was negotiated).
    inherited_mmap_with_direct_io: Option<bool>,
    /// Files the kernel reads from the data cache by itself (FUSE passthrough).
    backing: Arc<BackingTable>,
    /// A mounter a replacement may take over (CSI): no passthrough, since the kernel
    /// would demand every later open of such a file be passthrough with a backing id the
    /// replacement does not know (EIO otherwise).
    replaceable: bool,
}

impl FuseAdapter {
    pub fn new(fs: Arc<S3Fs>, rt: Handle) -> Self {
        Self {
            fs,
            rt,
            file_flags: FopenFlags::empty(),
            inherited_mmap_with_direct_io: None,
            backing: Arc::new(BackingTable::new(false)),
            replaceable: false,
        }
    }

    /// For a mounter of a connection a replacement may take over (see `session.rs`).
    pub fn replaceable(mut self) -> Self {
        self.replaceable = true;
        self
    }

    /// For a mounter that takes over a connection: `negotiated` says whether the first
    /// mounter's INIT reply enabled MAP_SHARED on direct-I/O files.
    pub fn taking_over(mut self, negotiated: bool) -> Self {
        self.inherited_mmap_with_direct_io = Some(negotiated);
        self
    }
}

/// Does this FUSE_INIT reply (out header + fuse_init_out) enable
/// FUSE_DIRECT_IO_ALLOW_MMAP? That bit lives in `flags2`, bytes 48..52.
pub fn init_reply_allows_direct_io_mmap(reply: &[u8]) -> bool {
    const FLAGS2: usize = 16 + 32;
    let bit = (InitFlags::FUSE_DIRECT_IO_ALLOW_MMAP.bits() >> 32) as u32;
    reply
        .get(FLAGS2..FLAGS2 + 4)
        .map(|b| u32::from_ne_bytes([b[0], b[1], b[2], b[3]]) & bit != 0)
        .unwrap_or(false)
}

/// Directory entries prepared per step of a readdir reply: the kernel's buffer takes a few
/// dozen (4 KiB), and an entry prepared but not sent costs a pin and an attribute each.
const REPLY_CHUNK: usize = 64;

/// Fills one readdir reply from handle `fh`'s stream, `REPLY_CHUNK` entries at a time,
/// until the reply is full or the buffered page is used up. `add` puts entries into the
/// reply and returns the offset of the last one that fitted (`None`: none did) and whether
/// the reply is full. An error after some entries were added ends the reply with those
/// (the next call meets it again).
async fn fill_reply(
    fs: &S3Fs,
    fh: u64,
    mut offset: u64,
    mut add: impl FnMut(Vec<DirEntry>) -> (Option<u64>, bool),
) -> Result<(), FsError> {
    let mut added = false;
    loop {
        let entries = match fs.readdir(fh, offset, REPLY_CHUNK).await {
            Ok(entries) => entries,
            Err(_) if added => return Ok(()),
            Err(e) => return Err(e),
        };
        let whole_buffer = entries.len() < REPLY_CHUNK;
        let (last, full) = add(entries);
        if let Some(last) = last {
            added = true;
            offset = last;
        }
        if full || whole_buffer {
            return Ok(());
        }
    }
}

fn errno(e: &FsError) -> Errno {
    Errno::from_i32(e.errno())
}

fn file_type(n: NodeType) -> FileType {
    match n {
        NodeType::File => FileType::RegularFile,
        NodeType::Dir => FileType::Directory,
        NodeType::Symlink => FileType::Symlink,
        NodeType::Fifo => FileType::NamedPipe,
        NodeType::Socket => FileType::Socket,
        NodeType::CharDev => FileType::CharDevice,
        NodeType::BlockDev => FileType::BlockDevice,
    }
}

fn file_attr(a: &Attr) -> FileAttr {
    FileAttr {
        ino: INodeNo(a.ino),
        size: a.size,
        blocks: a.size.div_ceil(512),
        atime: a.atime,
        mtime: a.mtime,
        ctime: a.ctime,
        crtime: a.mtime,
        kind: file_type(a.node),
        perm: a.perm,
        nlink: a.nlink,
        uid: a.uid,
        gid: a.gid,
        rdev: a.rdev,
        blksize: 128 * 1024,
        flags: 0,
    }
}

/// Names S3 cannot store (not UTF-8) are refused at the edge.
fn utf8(name: &OsStr) -> Result<&str, FsError> {
    name.to_str().ok_or(FsError::InvalidName)
}

fn creator(req: &Request) -> Creator {
    Creator {
        uid: req.uid(),
        gid: req.gid(),
    }
}

fn time_of(t: TimeOrNow) -> SystemTime {
    match t {
        TimeOrNow::SpecificTime(t) => t,
        TimeOrNow::Now => SystemTime::now(),
    }
}

/// Answers a getxattr/listxattr: the size when asked for it, ERANGE when it does not fit.
fn reply_xattr(reply: fuser::ReplyXattr, size: u32, value: &[u8]) {
    if size == 0 {
        reply.size(value.len() as u32);
    } else if value.len() > size as usize {
        reply.error(Errno::from_i32(libc::ERANGE));
    } else {
        reply.data(value);
    }
}

fn open_mode(flags: i32) -> OpenMode {
    let acc = flags & libc::O_ACCMODE;
    OpenMode {
        write: acc == libc::O_WRONLY || acc == libc::O_RDWR,
        truncate: flags & libc::O_TRUNC != 0,
        append: flags & libc::O_APPEND != 0,
        exclusive: flags & libc::O_EXCL != 0,
    }
}

impl Filesystem for FuseAdapter {
    fn init(&mut self, _req: &Request, config: &mut KernelConfig) -> std::io::Result<()> {
        // O_TRUNC arrives with open() instead of as a separate truncate, so overwriting a
        // file is one upload, not a PUT of an empty object first.
        let _ = config.add_capabilities(InitFlags::FUSE_ATOMIC_O_TRUNC);
        let _ = config.add_capabilities(InitFlags::FUSE_PARALLEL_DIROPS);
        // READDIRPLUS: a listing hands the kernel every entry's attributes (their metadata
        // HEADs went out in parallel, see `S3Fs::fill`), instead of one LOOKUP per entry
        // after it; AUTO lets the kernel use plain READDIR when nobody stats the entries.
        let _ = config.add_capabilities(InitFlags::FUSE_DO_READDIRPLUS);
        let _ = config.add_capabilities(InitFlags::FUSE_READDIRPLUS_AUTO);
        // Direct I/O: a read is copied from our reply straight into the reader's buffer and
        // a write straight from the writer's, instead of through page-cache pages that the
        // kernel must allocate for every byte and throws away at the next open anyway (no
        // FOPEN_KEEP_CACHE: another client may have replaced the object). The prefetcher
        // and the uploader do the batching that readahead and write-back would. Only where
        // MAP_SHARED keeps working on such files (Linux 6.6+); elsewhere the page cache.
        let kernel_allows = config
            .add_capabilities(InitFlags::FUSE_DIRECT_IO_ALLOW_MMAP)
            .is_ok();
        // A replacement mounter's answer to the replayed INIT goes nowhere: what counts is
        // what the first mounter negotiated.
        let mmap_ok = self.inherited_mmap_with_direct_io.unwrap_or(kernel_allows);
        let fs_cfg = self.fs.config();
        let direct = !fs_cfg.page_cache && mmap_ok;
        self.file_flags = if direct {
            FopenFlags::FOPEN_DIRECT_IO
        } else {
            FopenFlags::empty()
        };
        // Passthrough: a read-only open of a version wholly in the data cache names the
        // cache file, and the kernel reads it by itself, as from a local file. Only beside
        // direct I/O: the kernel refuses passthrough on an inode a page-cache descriptor
        // has open. Stack depth 1: the cache file lies on a plain local file system, and
        // an overlayfs may still be stacked on this mount.
        let passthrough = fs_cfg.data_cache
            && fs_cfg.passthrough
            && direct
            && !self.replaceable
            && config.add_capabilities(InitFlags::FUSE_PASSTHROUGH).is_ok()
            && config.set_max_stack_depth(1).is_ok();
        self.backing = Arc::new(BackingTable::new(passthrough));
        tracing::info!(
            direct_io = direct,
            page_cache_option = fs_cfg.page_cache,
            mmap_with_direct_io = mmap_ok,
            passthrough,
            "file data path"
        );
        // POSIX ACLs: the kernel checks them (they imply default_permissions) and reads
        // them with getxattr; DONT_MASK leaves the umask to us, which a parent's default
        // ACL overrides (see `S3Fs::new_entry_mode`).
        if fs_cfg.posix_acl {
            let acl = config.add_capabilities(InitFlags::FUSE_POSIX_ACL).is_ok()
                && config.add_capabilities(InitFlags::FUSE_DONT_MASK).is_ok();
            if !acl {
                tracing::warn!(
                    "the kernel offers no POSIX ACLs over FUSE; --posix-acl has no effect"
                );
            }
        }
        let _ = config.set_max_readahead(1024 * 1024);
        let _ = config.set_max_background(64);
        let _ = config.set_congestion_threshold(48);
        Ok(())
    }

    fn destroy(&mut self) {
        let fs = self.fs.clone();
        let failed = self.rt.block_on(async move { fs.flush_all().await });
        if failed > 0 {
            tracing::error!(failed, "uploads failed while unmounting");
        }
    }

    fn lookup(&self, _req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEntry) {
        let known = name.to_str().and_then(|n| self.fs.lookup_now(parent.0, n));
        match known {
            Some(Ok(a)) => return reply.entry(&a.ttl, &file_attr(&a), Generation(0)),
            Some(Err(e)) => return reply.error(errno(&e)),
            None => {}
        }
        let fs = self.fs.clone();
        let name = name.to_owned();
        self.rt.spawn(async move {
            let res = match utf8(&name) {
                Ok(n) => fs.lookup(parent.0, n).await,
                Err(_) => Err(FsError::NotFound),
            };
            match res {
                Ok(a) => reply.entry(&a.ttl, &file_attr(&a), Generation(0)),
                Err(e) => reply.error(errno(&e)),
            }
        });
    }

    fn forget(&self, _req: &Request, ino: INodeNo, nlookup: u64) {
        self.fs.forget(ino.0, nlookup);
    }

    fn getattr(&self, _req: &Request, ino: INodeNo, _fh: Option<FileHandle>, reply: ReplyAttr) {
        if let Some(a) = self.fs.getattr_now(ino.0) {
            return reply.attr(&a.ttl, &file_attr(&a));
        }
        let fs = self.fs.clone();
        self.rt.spawn(async move {
            match fs.getattr(ino.0).await {
                Ok(a) => reply.attr(&a.ttl, &file_attr(&a)),
                Err(e) => reply.error(errno(&e)),
            }
        });
    }

    fn setattr(
        &self,
        _req: &Request,
        ino: INodeNo,
        mode: Option<u32>,
        uid: Option<u32>,
        gid: Option<u32>,
        size: Option<u64>,
        atime: Option<TimeOrNow>,
        mtime: Option<TimeOrNow>,
        _ctime: Option<SystemTime>,
        fh: Option<FileHandle>,
        _crtime: Option<SystemTime>,
        _chgtime: Option<SystemTime>,
        _bkuptime: Option<SystemTime>,
        _flags: Option<fuser::BsdFileFlags>,
        reply: ReplyAttr,
    ) {
        let fs = self.fs.clone();
        let set = SetAttrs {
            mode,
            uid,
            gid,
            atime: atime.map(time_of),
            mtime: mtime.map(time_of),
        };
        self.rt.spawn(async move {
            let res = match fs.setattr(ino.0, size, fh.map(|f| f.0)).await {
                Ok(a) if set.is_empty() => Ok(a),
                Ok(_) => fs.set_attrs(ino.0, set).await,
                Err(e) => Err(e),
            };
            match res {
                Ok(a) => reply.attr(&a.ttl, &file_attr(&a)),
                Err(e) => reply.error(errno(&e)),
            }
        });
    }

    fn mkdir(
        &self,
        req: &Request,
        parent: INodeNo,
        name: &OsStr,
        mode: u32,
        umask: u32,
        reply: ReplyEntry,
    ) {
        let fs = self.fs.clone();
        let name = name.to_owned();
        let who = creator(req);
        self.rt.spawn(async move {
            let res = match utf8(&name) {
                Ok(n) => {
                    let (mode, inherited) = fs.new_entry_mode(parent.0, mode, umask, true).await;
                    let made = fs.mkdir_as(parent.0, n, Some((mode, who))).await;
                    made.map(|a| fs.add_inherited(a, inherited))
                }
                Err(e) => Err(e),
            };
            match res {
                Ok(a) => reply.entry(&a.ttl, &file_attr(&a), Generation(0)),
                Err(e) => reply.error(errno(&e)),
            }
        });
    }

    fn unlink(&self, _req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEmpty) {
        let fs = self.fs.clone();
        let name = name.to_owned();
        self.rt.spawn(async move {
            let res = match utf8(&name) {
                Ok(n) => fs.unlink(parent.0, n).await,
                Err(_) => Err(FsError::NotFound),
            };
            match res {
                Ok(()) => reply.ok(),
                Err(e) => reply.error(errno(&e)),
            }
        });
    }

    fn rmdir(&self, _req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEmpty) {
        let fs = self.fs.clone();
        let name = name.to_owned();
        self.rt.spawn(async move {
            let res = match utf8(&name) {
                Ok(n) => fs.rmdir(parent.0, n).await,
                Err(_) => Err(FsError::NotFound),
            };
            match res {
                Ok(()) => reply.ok(),
                Err(e) => reply.error(errno(&e)),
            }
        });
    }

    fn symlink(
        &self,
        req: &Request,
        parent: INodeNo,
        link_name: &OsStr,
        target: &std::path::Path,
        reply: ReplyEntry,
    ) {
        let fs = self.fs.clone();
        let name = link_name.to_owned();
        let target = target.as_os_str().to_owned();
        let who = creator(req);
        self.rt.spawn(async move {
            let res = match (utf8(&name), utf8(&target)) {
                (Ok(n), Ok(t)) => fs.symlink(parent.0, n, t, who).await,
                _ => Err(FsError::InvalidName),
            };
            match res {
                Ok(a) => reply.entry(&a.ttl, &file_attr(&a), Generation(0)),
                Err(e) => reply.error(errno(&e)),
            }
        });
    }

    fn readlink(&self, _req: &Request, ino: INodeNo, reply: ReplyData) {
        let fs = self.fs.clone();
        self.rt.spawn(async move {
            match fs.readlink(ino.0).await {
                Ok(t) => reply.data(&t),
                Err(e) => reply.error(errno(&e)),
            }
        });
    }

    fn link(
        &self,
        _req: &Request,
        _ino: INodeNo,
        _newparent: INodeNo,
        newname: &OsStr,
        reply: ReplyEntry,
    ) {
        // S3 has no second name for an object; EPERM is what link(2) answers on file
        // systems without hard links.
        tracing::debug!(name = ?newname, "hard links are not supported");
        reply.error(Errno::from_i32(libc::EPERM));
    }

    fn mknod(
        &self,
        req: &Request,
        parent: INodeNo,
        name: &OsStr,
        mode: u32,
        umask: u32,
        rdev: u32,
        reply: ReplyEntry,
    ) {
        let fs = self.fs.clone();
        let name = name.to_owned();
        let who = creator(req);
        self.rt.spawn(async move {
            let res = match utf8(&name) {
                Ok(n) => {
                    let (mode, inherited) = fs.new_entry_mode(parent.0, mode, umask, false).await;
                    let made = fs.mknod(parent.0, n, mode, rdev, who).await;
                    made.map(|a| fs.add_inherited(a, inherited))
                }
                Err(e) => Err(e),
            };
            match res {
                Ok(a) => reply.entry(&a.ttl, &file_attr(&a), Generation(0)),
                Err(e) => reply.error(errno(&e)),
            }
        });
    }

    fn rename(
        &self,
        _req: &Request,
        parent: INodeNo,
        name: &OsStr,
        newparent: INodeNo,
        newname: &OsStr,
        flags: RenameFlags,
        reply: ReplyEmpty,
    ) {
        if flags.contains(RenameFlags::RENAME_EXCHANGE)
            || flags.contains(RenameFlags::RENAME_WHITEOUT)
        {
            reply.error(Errno::from_i32(libc::EINVAL));
            return;
        }
        let no_replace = flags.contains(RenameFlags::RENAME_NOREPLACE);
        let fs = self.fs.clone();
        let (name, newname) = (name.to_owned(), newname.to_owned());
        self.rt.spawn(async move {
            let res = match (utf8(&name), utf8(&newname)) {
                (Ok(a), Ok(b)) => fs.rename(parent.0, a, newparent.0, b, no_replace).await,
                _ => Err(FsError::InvalidName),
            };
            match res {
                Ok(()) => reply.ok(),
                Err(e) => reply.error(errno(&e)),
            }
        });
    }

    fn open(&self, req: &Request, ino: INodeNo, flags: OpenFlags, reply: ReplyOpen) {
        let fs = self.fs.clone();
        let file_flags = self.file_flags;
        let mode = open_mode(flags.0);
        let backing = self.backing.clone();
        // An atomic O_TRUNC open is a truncate the kernel sends no SETATTR for.
        let drop_set_id = mode.write && flags.0 & libc::O_TRUNC != 0 && req.uid() != 0;
        self.rt.spawn(async move {
            if drop_set_id {
                if let Err(e) = fs.drop_set_id_bits(ino.0).await {
                    return reply.error(errno(&e));
                }
            }
            if !backing.negotiated() {
                return match fs.open(ino.0, mode).await {
                    Ok(fh) => reply.opened(FileHandle(fh), file_flags),
                    Err(e) => reply.error(errno(&e)),
                };
            }
            // See `passthrough.rs`: how an open may open an inode depends on the others.
            if mode.write && !backing.writer_opening(ino.0).await {
                return reply.error(Errno::from_i32(libc::ETXTBSY));
            }
            let opened = fs.open(ino.0, mode).await;
            // Found (and checked) before the table is taken: that may read the whole file.
            let file = match &opened {
                Ok(fh) if !mode.write && backing.entering() => fs.backing_file(*fh).await,
                _ => None,
            };
            let mut t = backing.lock().await;
            if mode.write {
                BackingTable::writer_opened(&mut t, ino.0);
            }
            let fh = match opened {
                Ok(fh) => fh,
                Err(e) => return reply.error(errno(&e)),
            };
            if !mode.write {
                if let Some(id) = t.join(ino.0, fh) {
                    return reply.opened_passthrough(FileHandle(fh), FopenFlags::empty(), &id);
                }
                // Still the inode's only handle: no other open decided meanwhile.
                if let Some(file) = file.filter(|_| t.may_enter(ino.0) && fs.sole_handle(fh)) {
                    let register = |f: &std::fs::File| reply.open_backing(f);
                    if let Some(id) = t.enter(&backing, ino.0, fh, &file, register) {
                        return reply.opened_passthrough(FileHandle(fh), FopenFlags::empty(), &id);
                    }
                }
            }
            reply.opened(FileHandle(fh), file_flags)
        });
    }

    fn create(
        &self,
        req: &Request,
        parent: INodeNo,
        name: &OsStr,
        mode: u32,
        umask: u32,
        flags: i32,
        reply: ReplyCreate,
    ) {
        let fs = self.fs.clone();
        let name = name.to_owned();
        let file_flags = self.file_flags;
        let who = creator(req);
        let backing = self.backing.clone();
        self.rt.spawn(async move {
            // A create of a name that exists opens that file (see `open`): as a writer,
            // since the reply cannot name a backing file. O_EXCL fails on it anyway.
            let existing = utf8(&name)
                .ok()
                .and_then(|n| fs.child_ino(parent.0, n))
                .filter(|_| backing.negotiated() && !open_mode(flags).exclusive);
            if let Some(ino) = existing {
                if !backing.writer_opening(ino).await {
                    return reply.error(Errno::from_i32(libc::ETXTBSY));
                }
            }
            let (mode, inherited) = fs.new_entry_mode(parent.0, mode, umask, false).await;
            let res = match utf8(&name) {
                Ok(n) => fs.create(parent.0, n, open_mode(flags)).await,
                Err(e) => Err(e),
            };
            if let Some(ino) = existing {
                BackingTable::writer_opened(&mut *backing.lock().await, ino);
            }
            // Its mode and owner go with its upload.
            let res = res.map(|(a, fh)| {
                fs.init_meta(a.ino, mode, who);
                (fs.add_inherited(a, inherited), fh)
            });
            match res {
                Ok((a, fh)) => reply.created(
                    &a.ttl,
                    &file_attr(&a),
                    Generation(0),
                    FileHandle(fh),
                    file_flags,
                ),
                Err(e) => reply.error(errno(&e)),
            }
        });
    }

    fn read(
        &self,
        _req: &Request,
        _ino: INodeNo,
        fh: FileHandle,
        offset: u64,
        size: u32,
        _flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        reply: ReplyData,
    ) {
        let fs = self.fs.clone();
        self.rt.spawn(async move {
            match fs.read(fh.0, offset, size).await {
                Ok(data) => reply.data(&data),
                Err(e) => reply.error(errno(&e)),
            }
        });
    }

    fn write(
        &self,
        req: &Request,
        ino: INodeNo,
        fh: FileHandle,
        offset: u64,
        data: &[u8],
        _write_flags: WriteFlags,
        _flags: OpenFlags,
        lock_owner: Option<LockOwner>,
        reply: ReplyWrite,
    ) {
        let fs = self.fs.clone();
        let data = data.to_vec();
        let owner = lock_owner.map(|o| o.0);
        // Root stands for CAP_FSETID (page-cache writeback comes as root: the kernel has
        // cleared the bits itself then).
        let drop_set_id = req.uid() != 0;
        self.rt.spawn(async move {
            if drop_set_id {
                if let Err(e) = fs.drop_set_id_bits(ino.0).await {
                    return reply.error(errno(&e));
                }
            }
            match fs.write(fh.0, offset, &data, owner).await {
                Ok(n) => reply.written(n as u32),
                Err(e) => reply.error(errno(&e)),
            }
        });
    }

    fn flush(
        &self,
        _req: &Request,
        _ino: INodeNo,
        fh: FileHandle,
        lock_owner: LockOwner,
        reply: ReplyEmpty,
    ) {
        let fs = self.fs.clone();
        self.rt.spawn(async move {
            match fs.flush(fh.0, lock_owner.0).await {
                Ok(()) => reply.ok(),
                Err(e) => reply.error(errno(&e)),
            }
        });
    }

    fn release(
        &self,
        _req: &Request,
        _ino: INodeNo,
        fh: FileHandle,
        _flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        _flush: bool,
        reply: ReplyEmpty,
    ) {
        self.backing.release(fh.0);
        let fs = self.fs.clone();
        self.rt.spawn(async move {
            match fs.release(fh.0).await {
                Ok(()) => reply.ok(),
                Err(e) => reply.error(errno(&e)),
            }
        });
    }

    fn fsync(
        &self,
        _req: &Request,
        _ino: INodeNo,
        fh: FileHandle,
        _datasync: bool,
        reply: ReplyEmpty,
    ) {
        let fs = self.fs.clone();
        self.rt.spawn(async move {
            match fs.fsync(fh.0).await {
                Ok(()) => reply.ok(),
                Err(e) => reply.error(errno(&e)),
            }
        });
    }

    fn opendir(&self, _req: &Request, ino: INodeNo, _flags: OpenFlags, reply: ReplyOpen) {
        let fs = self.fs.clone();
        self.rt.spawn(async move {
            match fs.opendir(ino.0).await {
                Ok(fh) => reply.opened(FileHandle(fh), FopenFlags::empty()),
                Err(e) => reply.error(errno(&e)),
            }
        });
    }

    fn readdir(
        &self,
        _req: &Request,
        _ino: INodeNo,
        fh: FileHandle,
        offset: u64,
        mut reply: ReplyDirectory,
    ) {
        let fs = self.fs.clone();
        self.rt.spawn(async move {
            let filled = fill_reply(&fs, fh.0, offset, |entries| {
                let mut last = None;
                for e in entries {
                    if reply.add(INodeNo(e.ino), e.offset, file_type(e.node), &e.name) {
                        return (last, true);
                    }
                    last = Some(e.offset);
                }
                (last, false)
            })
            .await;
            match filled {
                Ok(()) => reply.ok(),
                Err(e) => reply.error(errno(&e)),
            }
        });
    }

    fn readdirplus(
        &self,
        _req: &Request,
        ino: INodeNo,
        fh: FileHandle,
        offset: u64,
        mut reply: ReplyDirectoryPlus,
    ) {
        let fs = self.fs.clone();
        self.rt.spawn(async move {
            let filled = fill_reply(&fs, fh.0, offset, |entries| {
                // The kernel takes a reference to every entry it receives but `.` and
                // `..`; only those that fit in the reply count.
                let mut sent = Vec::new();
                let mut unsent = Vec::new();
                let (mut last, mut full) = (None, false);
                for (e, a) in fs.reply_entries(ino.0, entries) {
                    let counted = e.name != "." && e.name != "..";
                    if !full {
                        full = reply.add(
                            INodeNo(e.ino),
                            e.offset,
                            &e.name,
                            &a.ttl,
                            &file_attr(&a),
                            Generation(0),
                        );
                        if !full {
                            last = Some(e.offset);
                        }
                    }
                    match (counted, full) {
                        (false, _) => {}
                        (true, false) => sent.push(e.ino),
                        (true, true) => unsent.push(e.ino),
                    }
                }
                fs.settle_reply(&sent, &unsent);
                (last, full)
            })
            .await;
            match filled {
                Ok(()) => reply.ok(),
                Err(e) => reply.error(errno(&e)),
            }
        });
    }

    fn releasedir(
        &self,
        _req: &Request,
        _ino: INodeNo,
        fh: FileHandle,
        _flags: OpenFlags,
        reply: ReplyEmpty,
    ) {
        self.fs.releasedir(fh.0);
        reply.ok();
    }

    fn fsyncdir(
        &self,
        _req: &Request,
        _ino: INodeNo,
        _fh: FileHandle,
        _datasync: bool,
        reply: ReplyEmpty,
    ) {
        reply.ok();
    }

    fn statfs(&self, _req: &Request, _ino: INodeNo, reply: ReplyStatfs) {
        // S3 has no capacity; report a large nominal one (1 EiB in 4 KiB blocks) so that
        // df works and tools checking free space proceed.
        const BLOCKS: u64 = 1 << 48;
        const FILES: u64 = 1 << 40;
        reply.statfs(BLOCKS, BLOCKS, BLOCKS, FILES, FILES, 4096, 255, 4096);
    }

    fn getxattr(
        &self,
        _req: &Request,
        ino: INodeNo,
        name: &OsStr,
        size: u32,
        reply: fuser::ReplyXattr,
    ) {
        let fs = self.fs.clone();
        let name = name.to_owned();
        self.rt.spawn(async move {
            let res = match utf8(&name) {
                Ok(n) => fs.getxattr(ino.0, n).await,
                Err(_) => Err(FsError::NoAttr),
            };
            match res {
                Ok(v) => reply_xattr(reply, size, &v),
                Err(e) => reply.error(errno(&e)),
            }
        });
    }

    fn listxattr(&self, _req: &Request, ino: INodeNo, size: u32, reply: fuser::ReplyXattr) {
        let fs = self.fs.clone();
        self.rt.spawn(async move {
            match fs.listxattr(ino.0).await {
                Ok(v) => reply_xattr(reply, size, &v),
                Err(e) => reply.error(errno(&e)),
            }
        });
    }

    fn setxattr(
        &self,
        _req: &Request,
        ino: INodeNo,
        name: &OsStr,
        value: &[u8],
        flags: i32,
        _position: u32,
        reply: ReplyEmpty,
    ) {
        let fs = self.fs.clone();
        let name = name.to_owned();
        let value = value.to_vec();
        self.rt.spawn(async move {
            let res = match utf8(&name) {
                Ok(n) => fs.change_xattr(ino.0, n, Some(&value), flags).await,
                Err(e) => Err(e),
            };
            match res {
                Ok(()) => reply.ok(),
                Err(e) => reply.error(errno(&e)),
            }
        });
    }

    fn removexattr(&self, _req: &Request, ino: INodeNo, name: &OsStr, reply: ReplyEmpty) {
        let fs = self.fs.clone();
        let name = name.to_owned();
        self.rt.spawn(async move {
            let res = match utf8(&name) {
                Ok(n) => fs.change_xattr(ino.0, n, None, 0).await,
                Err(_) => Err(FsError::NoAttr),
            };
            match res {
                Ok(()) => reply.ok(),
                Err(e) => reply.error(errno(&e)),
            }
        });
    }

    fn fallocate(
        &self,
        _req: &Request,
        _ino: INodeNo,
        fh: FileHandle,
        offset: u64,
        length: u64,
        mode: i32,
        reply: ReplyEmpty,
    ) {
        let fs = self.fs.clone();
        self.rt.spawn(async move {
            match fs.fallocate(fh.0, offset, length, mode).await {
                Ok(()) => reply.ok(),
                Err(e) => reply.error(errno(&e)),
            }
        });
    }
}
