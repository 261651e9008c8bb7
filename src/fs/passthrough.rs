//! FUSE passthrough bookkeeping: which inodes the kernel reads from a data-cache file by
//! itself (no READ reaches the mounter), and through which backing id.
//!
//! The kernel's rules shape it: an inode has one backing file at a time, and while it has
//! one, every open of it must be a passthrough open of that file (any other open fails
//! with EIO). So once an inode is read in passthrough, further read-only opens share its
//! backing id (they read the version it holds, even if S3 has a newer one by now), and an
//! open for writing is refused with ETXTBSY, as for a running executable, until the last
//! passthrough descriptor is released. A writer being opened keeps the inode from
//! entering passthrough meanwhile (`writer_opening`), so that the two never cross.

use fuser::BackingId;
use std::collections::HashMap;
use std::fs::File;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

struct Backed {
    id: Arc<BackingId>,
    handles: usize,
}

#[derive(Default)]
pub struct Table {
    by_ino: HashMap<u64, Backed>,
    /// Passthrough file handles and their inode.
    by_fh: HashMap<u64, u64>,
    /// Inodes with an open for writing in progress, and how many.
    writers_opening: HashMap<u64, usize>,
}

pub struct BackingTable {
    table: tokio::sync::Mutex<Table>,
    /// Negotiated at INIT: opens must consult the table.
    negotiated: bool,
    /// New inodes may enter passthrough: negotiated, and not refused by the kernel since.
    entering: AtomicBool,
}

impl BackingTable {
    pub fn new(enabled: bool) -> Self {
        Self {
            table: tokio::sync::Mutex::default(),
            negotiated: enabled,
            entering: AtomicBool::new(enabled),
        }
    }

    /// Whether opens must go through the table: even after the kernel refused a backing
    /// file, inodes that entered passthrough before still need their id.
    pub fn negotiated(&self) -> bool {
        self.negotiated
    }

    /// Whether an inode may enter passthrough now.
    pub fn entering(&self) -> bool {
        self.entering.load(Ordering::Relaxed)
    }

    /// Held while an open decides how it opens and sends its reply, so that no other
    /// open of the inode decides in between.
    pub async fn lock(&self) -> tokio::sync::MutexGuard<'_, Table> {
        self.table.lock().await
    }

    /// An open for writing of `ino` begins: false (ETXTBSY) if the inode is read in
    /// passthrough. [`Self::writer_opened`] ends it.
    pub async fn writer_opening(&self, ino: u64) -> bool {
        let mut t = self.lock().await;
        if t.by_ino.contains_key(&ino) {
            return false;
        }
        *t.writers_opening.entry(ino).or_default() += 1;
        true
    }

    pub fn writer_opened(t: &mut Table, ino: u64) {
        if let Some(n) = t.writers_opening.get_mut(&ino) {
            *n -= 1;
            if *n == 0 {
                t.writers_opening.remove(&ino);
            }
        }
    }

    /// The kernel released `fh`; the last passthrough handle of an inode closes its id.
    pub fn release(&self, fh: u64) {
        // On the session's thread, not the runtime's: holders release it without waiting
        // for anything but their own reply.
        let mut t = self.table.blocking_lock();
        let Some(ino) = t.by_fh.remove(&fh) else {
            return;
        };
        if let Some(b) = t.by_ino.get_mut(&ino) {
            b.handles -= 1;
            if b.handles == 0 {
                t.by_ino.remove(&ino);
            }
        }
    }
}

impl Table {
    /// The backing id `ino` is read through, if it is, counting `fh` as one more of its
    /// passthrough handles.
    pub fn join(&mut self, ino: u64, fh: u64) -> Option<Arc<BackingId>> {
        let b = self.by_ino.get_mut(&ino)?;
        b.handles += 1;
        let id = b.id.clone();
        self.by_fh.insert(fh, ino);
        Some(id)
    }

    /// Whether `ino` may enter passthrough now: no writer is being opened.
    pub fn may_enter(&self, ino: u64) -> bool {
        !self.writers_opening.contains_key(&ino) && !self.by_ino.contains_key(&ino)
    }

    /// Makes `file` the backing file of `ino`, open as `fh`. `None` if the kernel refuses
    /// (passthrough is then off for the mount, with one log line).
    pub fn enter(
        &mut self,
        owner: &BackingTable,
        ino: u64,
        fh: u64,
        file: &File,
        register: impl FnOnce(&File) -> std::io::Result<BackingId>,
    ) -> Option<Arc<BackingId>> {
        match register(file) {
            Ok(backing) => {
                let id = Arc::new(backing);
                self.by_ino.insert(
                    ino,
                    Backed {
                        id: id.clone(),
                        handles: 1,
                    },
                );
                self.by_fh.insert(fh, ino);
                Some(id)
            }
            Err(e) => {
                if owner.entering.swap(false, Ordering::Relaxed) {
                    tracing::warn!(error = %e,
                        "the kernel refused a passthrough backing file (the mounter needs \
                         CAP_SYS_ADMIN, and the cache directory must not be on a stacked \
                         file system); cached reads go through the mounter");
                }
                None
            }
        }
    }
}
