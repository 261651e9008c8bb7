//! Thin fuser adapter: decode the request, run the matching [`S3Fs`] method on the tokio
//! runtime, reply. No file-system logic lives here.

use super::inode::Kind;
use super::{Attr, FsError, OpenMode, S3Fs};
use fuser::{
    Errno, FileAttr, FileHandle, FileType, Filesystem, FopenFlags, Generation, INodeNo, InitFlags,
    KernelConfig, LockOwner, OpenFlags, RenameFlags, ReplyAttr, ReplyCreate, ReplyData,
    ReplyDirectory, ReplyEmpty, ReplyEntry, ReplyOpen, ReplyStatfs, ReplyWrite, Request, TimeOrNow,
    WriteFlags,
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
}

impl FuseAdapter {
    pub fn new(fs: Arc<S3Fs>, rt: Handle) -> Self {
        Self {
            fs,
            rt,
            file_flags: FopenFlags::empty(),
            inherited_mmap_with_direct_io: None,
        }
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

fn errno(e: &FsError) -> Errno {
    Errno::from_i32(e.errno())
}

fn file_attr(a: &Attr) -> FileAttr {
    FileAttr {
        ino: INodeNo(a.ino),
        size: a.size,
        blocks: a.size.div_ceil(512),
        atime: a.mtime,
        mtime: a.mtime,
        ctime: a.mtime,
        crtime: a.mtime,
        kind: match a.kind {
            Kind::File => FileType::RegularFile,
            Kind::Dir => FileType::Directory,
        },
        perm: a.perm,
        nlink: if a.kind == Kind::Dir { 2 } else { 1 },
        uid: a.uid,
        gid: a.gid,
        rdev: 0,
        blksize: 128 * 1024,
        flags: 0,
    }
}

/// Names S3 cannot store (not UTF-8) are refused at the edge.
fn utf8(name: &OsStr) -> Result<&str, FsError> {
    name.to_str().ok_or(FsError::InvalidName)
}

fn open_mode(flags: i32) -> OpenMode {
    let acc = flags & libc::O_ACCMODE;
    OpenMode {
        write: acc == libc::O_WRONLY || acc == libc::O_RDWR,
        truncate: flags & libc::O_TRUNC != 0,
        append: flags & libc::O_APPEND != 0,
    }
}

impl Filesystem for FuseAdapter {
    fn init(&mut self, _req: &Request, config: &mut KernelConfig) -> std::io::Result<()> {
        // O_TRUNC arrives with open() instead of as a separate truncate, so overwriting a
        // file is one upload, not a PUT of an empty object first.
        let _ = config.add_capabilities(InitFlags::FUSE_ATOMIC_O_TRUNC);
        let _ = config.add_capabilities(InitFlags::FUSE_PARALLEL_DIROPS);
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
        let direct = !self.fs.config().page_cache && mmap_ok;
        self.file_flags = if direct {
            FopenFlags::FOPEN_DIRECT_IO
        } else {
            FopenFlags::empty()
        };
        tracing::info!(
            direct_io = direct,
            page_cache_option = self.fs.config().page_cache,
            mmap_with_direct_io = mmap_ok,
            "file data path"
        );
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
        _mode: Option<u32>,
        _uid: Option<u32>,
        _gid: Option<u32>,
        size: Option<u64>,
        _atime: Option<TimeOrNow>,
        _mtime: Option<TimeOrNow>,
        _ctime: Option<SystemTime>,
        fh: Option<FileHandle>,
        _crtime: Option<SystemTime>,
        _chgtime: Option<SystemTime>,
        _bkuptime: Option<SystemTime>,
        _flags: Option<fuser::BsdFileFlags>,
        reply: ReplyAttr,
    ) {
        let fs = self.fs.clone();
        self.rt.spawn(async move {
            match fs.setattr(ino.0, size, fh.map(|f| f.0)).await {
                Ok(a) => reply.attr(&a.ttl, &file_attr(&a)),
                Err(e) => reply.error(errno(&e)),
            }
        });
    }

    fn mkdir(
        &self,
        _req: &Request,
        parent: INodeNo,
        name: &OsStr,
        _mode: u32,
        _umask: u32,
        reply: ReplyEntry,
    ) {
        let fs = self.fs.clone();
        let name = name.to_owned();
        self.rt.spawn(async move {
            let res = match utf8(&name) {
                Ok(n) => fs.mkdir(parent.0, n).await,
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
        _req: &Request,
        _parent: INodeNo,
        link_name: &OsStr,
        _target: &std::path::Path,
        reply: ReplyEntry,
    ) {
        tracing::warn!(name = ?link_name, "symlinks are not supported");
        reply.error(Errno::from_i32(libc::EOPNOTSUPP));
    }

    fn link(
        &self,
        _req: &Request,
        _ino: INodeNo,
        _newparent: INodeNo,
        newname: &OsStr,
        reply: ReplyEntry,
    ) {
        tracing::warn!(name = ?newname, "hard links are not supported");
        reply.error(Errno::from_i32(libc::EOPNOTSUPP));
    }

    fn mknod(
        &self,
        _req: &Request,
        _parent: INodeNo,
        name: &OsStr,
        _mode: u32,
        _umask: u32,
        _rdev: u32,
        reply: ReplyEntry,
    ) {
        tracing::warn!(name = ?name, "special files are not supported");
        reply.error(Errno::from_i32(libc::EOPNOTSUPP));
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

    fn open(&self, _req: &Request, ino: INodeNo, flags: OpenFlags, reply: ReplyOpen) {
        let fs = self.fs.clone();
        let file_flags = self.file_flags;
        let mode = open_mode(flags.0);
        self.rt.spawn(async move {
            match fs.open(ino.0, mode).await {
                Ok(fh) => reply.opened(FileHandle(fh), file_flags),
                Err(e) => reply.error(errno(&e)),
            }
        });
    }

    fn create(
        &self,
        _req: &Request,
        parent: INodeNo,
        name: &OsStr,
        _mode: u32,
        _umask: u32,
        flags: i32,
        reply: ReplyCreate,
    ) {
        let fs = self.fs.clone();
        let name = name.to_owned();
        let file_flags = self.file_flags;
        self.rt.spawn(async move {
            let res = match utf8(&name) {
                Ok(n) => fs.create(parent.0, n, open_mode(flags)).await,
                Err(e) => Err(e),
            };
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
        _req: &Request,
        _ino: INodeNo,
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
        self.rt.spawn(async move {
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
            match fs.readdir(fh.0, offset).await {
                Ok(entries) => {
                    for e in entries {
                        let kind = match e.kind {
                            Kind::File => FileType::RegularFile,
                            Kind::Dir => FileType::Directory,
                        };
                        if reply.add(INodeNo(e.ino), e.offset, kind, &e.name) {
                            break;
                        }
                    }
                    reply.ok();
                }
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
        _ino: INodeNo,
        _name: &OsStr,
        _size: u32,
        reply: fuser::ReplyXattr,
    ) {
        reply.error(Errno::from_i32(libc::ENODATA));
    }

    fn listxattr(&self, _req: &Request, _ino: INodeNo, size: u32, reply: fuser::ReplyXattr) {
        if size == 0 {
            reply.size(0);
        } else {
            reply.data(&[]);
        }
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
