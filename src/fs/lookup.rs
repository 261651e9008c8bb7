//! Names to inodes: lookup (HEAD and LIST together), the listing of siblings ahead of
//! their lookups, getattr, and the kernel forgetting inodes.

use super::*;

impl S3Fs {
    /// Asks S3 what `name` under `parent_key` is: HEAD of the file key and a one-key LIST
    /// of the directory prefix, concurrently, so a lookup costs one round trip.
    pub(super) async fn probe(
        &self,
        parent_key: &str,
        name: &str,
    ) -> FsResult<Option<(Kind, crate::s3::ObjectMeta)>> {
        let file_key = format!("{parent_key}{name}");
        if file_key.len() + 1 > MAX_KEY_LEN {
            return Err(FsError::NameTooLong);
        }
        let dir_prefix = format!("{file_key}/");
        let (head, list) = tokio::join!(
            self.client.head_object(&file_key),
            self.client.list(ListRequest {
                prefix: &dir_prefix,
                delimiter: Some("/"),
                continuation: None,
                max_keys: 1,
            })
        );
        let list = list?;
        if !list.objects.is_empty() || !list.prefixes.is_empty() {
            let meta = crate::s3::ObjectMeta {
                size: 0,
                mtime: self.mount_time,
                etag: None,
            };
            return Ok(Some((Kind::Dir, meta)));
        }
        match head {
            Ok(meta) => Ok(Some((Kind::File, meta))),
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

    async fn find(&self, parent: u64, name: &str, kernel_ref: bool) -> FsResult<Attr> {
        check_name(name)?;
        let parent_inode = self.dir_inode(parent)?;
        {
            let mut t = self.inodes();
            if let Some(child) = t.child(parent, name) {
                if self.fresh(child) {
                    let attr = self.attr_of(child);
                    if kernel_ref {
                        t.add_lookup(attr.ino);
                    }
                    return Ok(attr);
                }
            } else if self.listing_fresh(&parent_inode) {
                return Err(FsError::NotFound);
            }
        }
        self.list_ahead(&parent_inode);
        match self.probe(&parent_inode.key, name).await? {
            Some((kind, meta)) => {
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
                let ino = t.upsert(parent, name, kind, meta.size, meta.mtime, meta.etag);
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
        tokio::spawn(async move {
            let (started, forgotten) = (Instant::now(), lock(&inodes).forgotten_names);
            let mut token: Option<String> = None;
            for _ in 0..LIST_AHEAD_PAGES {
                let request = ListRequest {
                    prefix: &key,
                    delimiter: Some("/"),
                    continuation: token.as_deref(),
                    max_keys: LIST_PAGE,
                };
                let page = match client.list(request).await {
                    Ok(p) => p,
                    Err(e) => {
                        tracing::debug!(key = %key, error = %e, "background listing failed");
                        return;
                    }
                };
                let mut t = lock(&inodes);
                for e in page_entries(&key, &page, dir_mtime) {
                    t.upsert(ino, &e.name, e.kind, e.size, e.mtime, e.etag);
                }
                token = page.next_token;
                if token.is_none() {
                    if forgotten == t.forgotten_names {
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

    pub async fn getattr(&self, ino: u64) -> FsResult<Attr> {
        let i = self.inode(ino)?;
        if i.kind == Kind::Dir || self.fresh(&i) {
            return Ok(self.attr_of(&i));
        }
        self.head_attr(ino, &i).await
    }

    /// Asks S3 for the object's metadata (HEAD), whatever the table knows.
    pub(super) async fn head_attr(&self, ino: u64, i: &Inode) -> FsResult<Attr> {
        match self.client.head_object(&i.key).await {
            Ok(meta) => {
                let mut t = self.inodes();
                let i = t.get_mut(ino).ok_or(FsError::NotFound)?;
                if !i.being_written() {
                    i.size = meta.size;
                    i.mtime = meta.mtime;
                    i.etag = meta.etag;
                }
                i.validated = Some(Instant::now());
                Ok(self.attr_of(i))
            }
            Err(S3Error::NotFound) => Err(FsError::NotFound),
            Err(e) => Err(e.into()),
        }
    }
}
