//! Names to inodes: lookup (HEAD and LIST together), the listing of siblings ahead of
//! their lookups, getattr, and the kernel forgetting inodes.

use super::*;
use crate::s3::UserMeta;

/// What the inode table alone knows of a name (see `S3Fs::table_answer`).
enum FromTable {
    /// Known and fresh: its attributes (with a kernel reference taken if asked).
    Found(Attr),
    /// Not there, and the directory's listing is fresh: no such name.
    Absent,
    /// Fresh from a listing, its metadata not loaded yet: one HEAD.
    NeedsMeta(Box<Inode>),
    /// Not known well enough: S3 must be asked.
    Ask,
}

impl S3Fs {
    /// Asks S3 what `name` under `parent_key` is: HEAD of the file key and a one-key LIST
    /// of the directory prefix, concurrently, so a lookup costs one round trip. With
    /// stored metadata honoured, the HEAD brings the file's metadata and a HEAD of the
    /// directory marker goes along (third request, same round trip); the user metadata is
    /// then `Some` (empty for an object without any, or an implicit directory).
    pub(super) async fn probe(
        &self,
        parent_key: &str,
        name: &str,
    ) -> FsResult<
        Option<(
            Kind,
            crate::s3::ObjectMeta,
            Option<UserMeta>,
            Option<String>,
        )>,
    > {
        let file_key = format!("{parent_key}{name}");
        if file_key.len() + 1 > MAX_KEY_LEN {
            return Err(FsError::NameTooLong);
        }
        let dir_prefix = format!("{file_key}/");
        let with_meta = self.cfg.posix_metadata;
        let head = async {
            if with_meta {
                self.client
                    .head_object_with_meta(&file_key)
                    .await
                    .map(|(m, h)| (m, Some(h)))
            } else {
                self.client.head_object(&file_key).await.map(|m| (m, None))
            }
        };
        let marker = async {
            if !with_meta {
                return Ok(None);
            }
            match self.client.head_object_with_meta(&dir_prefix).await {
                Ok((_, h)) => Ok(Some(h)),
                Err(S3Error::NotFound) => Ok(Some(UserMeta::new())),
                Err(e) => Err(e),
            }
        };
        // The `dir_$folder$` object older s3fs versions and Hadoop mark a directory with
        // (s3fs asks for it too); goes along with the marker's HEAD, same round trip.
        let folder_key = format!("{file_key}{}", super::readdir::FOLDER_SUFFIX);
        let folder = async {
            if !with_meta {
                return None;
            }
            self.client.head_object(&folder_key).await.ok()
        };
        let (head, list, marker, folder) = tokio::join!(
            head,
            self.client.list(ListRequest {
                prefix: &dir_prefix,
                delimiter: Some("/"),
                continuation: None,
                start_after: None,
                max_keys: 1,
            }),
            marker,
            folder
        );
        let list = list?;
        let dir_meta = crate::s3::ObjectMeta {
            size: 0,
            mtime: self.mount_time,
            etag: None,
        };
        let legacy = folder.map(|_| folder_key);
        if !list.objects.is_empty() || !list.prefixes.is_empty() {
            return Ok(Some((Kind::Dir, dir_meta, marker?, legacy)));
        }
        match head {
            Ok((meta, h)) => Ok(Some((Kind::File, meta, h, None))),
            Err(S3Error::NotFound) if legacy.is_some() => {
                Ok(Some((Kind::Dir, dir_meta, marker?, legacy)))
            }
            Err(S3Error::NotFound) => Ok(None),
            Err(e) => Err(e.into()),
        }
    }

    /// The kernel's LOOKUP: the child's attributes, and one more reference the kernel
    /// holds until it forgets it.
    pub async fn lookup(&self, parent: u64, name: &str) -> FsResult<Attr> {
        self.find(parent, name, true).await
    }

    /// The child `name` of `parent` as the file system's own operations need it (rename,
    /// unlink): the same answer as `lookup`, without a kernel reference. Going through the
    /// kernel's counting instead (lookup, then forget) dropped inodes a replacement mounter
    /// had restored, whose counts it cannot know.
    pub(super) async fn resolve(&self, parent: u64, name: &str) -> FsResult<Inode> {
        let attr = self.find(parent, name, false).await?;
        self.inode(attr.ino)
    }

    /// The kernel's LOOKUP when the table answers it without a request (the FUSE thread
    /// replies at once, skipping a task and a wake-up); `None`: ask `lookup`.
    pub fn lookup_now(&self, parent: u64, name: &str) -> Option<FsResult<Attr>> {
        check_existing_name(name).ok()?;
        match self.table_answer(parent, name, true) {
            FromTable::Found(attr) => Some(Ok(attr)),
            FromTable::Absent if name.len() > NAME_MAX => Some(Err(FsError::NameTooLong)),
            FromTable::Absent => Some(Err(FsError::NotFound)),
            FromTable::NeedsMeta(_) | FromTable::Ask => None,
        }
    }

    /// What the table alone says of `name` under directory `parent`.
    fn table_answer(&self, parent: u64, name: &str, kernel_ref: bool) -> FromTable {
        let mut t = self.inodes();
        match t.child(parent, name) {
            Some(child) if self.fresh(child) => {
                if self.needs_meta(child) {
                    return FromTable::NeedsMeta(Box::new(child.clone()));
                }
                let attr = self.attr_of(child);
                if kernel_ref {
                    t.add_lookup(attr.ino);
                }
                FromTable::Found(attr)
            }
            Some(_) => FromTable::Ask,
            None => match t.get(parent) {
                Some(p) if p.kind == Kind::Dir && self.listing_fresh(p) => FromTable::Absent,
                _ => FromTable::Ask,
            },
        }
    }

    async fn find(&self, parent: u64, name: &str, kernel_ref: bool) -> FsResult<Attr> {
        check_existing_name(name)?;
        match self.find_existing(parent, name, kernel_ref).await {
            // A long name that does not exist is one this mount could not have made:
            // ENAMETOOLONG, as on a local file system (and it stops link and the like
            // before they ask further).
            Err(FsError::NotFound) if name.len() > NAME_MAX => Err(FsError::NameTooLong),
            found => found,
        }
    }

    async fn find_existing(&self, parent: u64, name: &str, kernel_ref: bool) -> FsResult<Attr> {
        let parent_inode = self.dir_inode(parent)?;
        // A child known from a listing, which tells no metadata, needs one HEAD first. If
        // the table evicts it meanwhile (a directory larger than the table's cap), it is
        // looked up again: a name that exists is never ENOENT for want of an inode.
        for _ in 0..3 {
            let load_first = match self.table_answer(parent, name, kernel_ref) {
                FromTable::Found(attr) => return Ok(attr),
                FromTable::Absent => return Err(FsError::NotFound),
                FromTable::NeedsMeta(child) => child,
                FromTable::Ask => break,
            };
            self.load_meta_for_stat(&load_first).await;
            let mut t = self.inodes();
            let Some(child) = t
                .get(load_first.ino)
                .filter(|c| c.parent == parent && c.name == name)
            else {
                continue;
            };
            // The HEAD may have shown an older s3fs directory object: the name is bound
            // to that directory now (see `InodeTable::settle_legacy_dir`).
            let child = match t.child(parent, name) {
                Some(bound) if bound.kind != child.kind => bound,
                _ => child,
            };
            let attr = self.attr_of(child);
            if kernel_ref {
                t.add_lookup(attr.ino);
            }
            return Ok(attr);
        }
        self.list_ahead(&parent_inode);
        match self.probe(&parent_inode.key, name).await? {
            Some((kind, meta, headers, legacy)) => {
                let mut t = self.inodes();
                // A writer that appeared meanwhile wins over what S3 said.
                if let Some(child) = t.child(parent, name) {
                    if child.being_written() || child.local_only {
                        let attr = self.attr_of(child);
                        if kernel_ref {
                            t.add_lookup(attr.ino);
                        }
                        return Ok(attr);
                    }
                }
                let mtime = meta.mtime;
                let ino = t.upsert(parent, name, kind, meta.size, meta.mtime, meta.etag);
                if let (Some(legacy), Some(i)) = (legacy, t.get_mut(ino)) {
                    i.legacy_marker = Some(legacy);
                }
                if let Some(h) = headers {
                    t.set_meta(ino, &h, mtime);
                }
                // An older s3fs directory object is bound as its directory now.
                let ino = t.child(parent, name).map_or(ino, |c| c.ino);
                if kernel_ref {
                    t.add_lookup(ino);
                }
                let i = t.get(ino).ok_or(FsError::NotFound)?;
                Ok(self.attr_of(i))
            }
            None => {
                let mut t = self.inodes();
                if let Some(child) = t.child(parent, name) {
                    if child.being_written() || child.local_only {
                        let attr = self.attr_of(child);
                        if kernel_ref {
                            t.add_lookup(attr.ino);
                        }
                        return Ok(attr);
                    }
                }
                t.unbind(parent, name);
                Err(FsError::NotFound)
            }
        }
    }

    /// After a lookup miss, lists the whole directory in the background (once per TTL, at
    /// most `LIST_AHEAD_PAGES` pages): tools that stat or open one entry usually go on
    /// with its siblings (`ls -l`, `find`, `rm -r`), which then cost no request at all,
    /// and a complete listing answers for names that do not exist too.
    pub(super) fn list_ahead(&self, dir: &Inode) {
        {
            let mut t = self.inodes();
            let Some(d) = t.get_mut(dir.ino) else {
                return;
            };
            if d.list_ahead_at
                .is_some_and(|at| at.elapsed() < self.cfg.metadata_ttl)
            {
                return;
            }
            d.list_ahead_at = Some(Instant::now());
        }
        let client = self.client.clone();
        let inodes = self.inodes.clone();
        let (ino, key, dir_mtime) = (dir.ino, dir.key.clone(), self.mount_time);
        let with_meta = self.cfg.posix_metadata && self.stat_ahead.statting(dir.ino);
        let fs_heads = self.head_starter();
        tokio::spawn(async move {
            let (started, forgotten, changes) = {
                let t = lock(&inodes);
                (Instant::now(), t.forgotten_names, t.namespace_changes)
            };
            let mut token: Option<String> = None;
            for _ in 0..LIST_AHEAD_PAGES {
                let request = ListRequest {
                    prefix: &key,
                    delimiter: Some("/"),
                    continuation: token.as_deref(),
                    start_after: None,
                    max_keys: LIST_PAGE,
                };
                let page = match client.list(request).await {
                    Ok(p) => p,
                    Err(e) => {
                        tracing::debug!(key = %key, error = %e, "background listing failed");
                        return;
                    }
                };
                let (heads, whole) = absorb_background_page(
                    &inodes, ino, &key, &page, changes, dir_mtime, with_meta,
                );
                // The siblings' metadata too while they are being stat'ed, so that their
                // lookups cost nothing.
                fs_heads.start(heads);
                let mut t = lock(&inodes);
                token = page.next_token;
                if token.is_none() {
                    // `whole` is false for this page once it is for any: the count of
                    // namespace changes only grows.
                    if whole && forgotten == t.forgotten_names {
                        if let Some(d) = t.get_mut(ino) {
                            d.complete_as_of = Some(started);
                        }
                    }
                    return;
                }
            }
        });
    }

    pub fn forget(&self, ino: u64, n: u64) {
        self.inodes().forget(ino, n);
    }

    /// The kernel's GETATTR when the table answers it without a request; `None`: ask
    /// `getattr`.
    pub fn getattr_now(&self, ino: u64) -> Option<Attr> {
        let t = self.inodes();
        let i = t.get(ino)?;
        ((i.kind == Kind::Dir || self.fresh(i)) && !self.needs_meta(i)).then(|| self.attr_of(i))
    }

    pub async fn getattr(&self, ino: u64) -> FsResult<Attr> {
        if let Some(attr) = self.getattr_now(ino) {
            return Ok(attr);
        }
        let i = self.inode(ino)?;
        if i.kind == Kind::Dir || self.fresh(&i) {
            self.load_meta_for_stat(&i).await;
            return Ok(self.attr_of(&self.inode(ino)?));
        }
        self.head_attr(ino, &i).await
    }

    /// Asks S3 for the object's metadata (HEAD, with its user metadata when it is
    /// honoured), whatever the table knows.
    pub(super) async fn head_attr(&self, ino: u64, i: &Inode) -> FsResult<Attr> {
        let head = if self.cfg.posix_metadata {
            self.client
                .head_object_with_meta(&i.key)
                .await
                .map(|(m, h)| (m, Some(h)))
        } else {
            self.client.head_object(&i.key).await.map(|m| (m, None))
        };
        match head {
            Ok((meta, headers)) => {
                let mut t = self.inodes();
                let i = t.get_mut(ino).ok_or(FsError::NotFound)?;
                if !i.being_written() {
                    i.size = meta.size;
                    i.mtime = meta.mtime;
                    i.etag = meta.etag;
                    if let Some(h) = headers {
                        t.set_meta(ino, &h, meta.mtime);
                    }
                }
                let i = t.get_mut(ino).ok_or(FsError::NotFound)?;
                i.validated = Some(Instant::now());
                Ok(self.attr_of(i))
            }
            Err(S3Error::NotFound) => Err(FsError::NotFound),
            Err(e) => Err(e.into()),
        }
    }
}
