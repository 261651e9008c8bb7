//! Directory streams: LIST pages turned into entries, merged with names only this mount
//! knows yet, buffered so that a full reply buffer loses nothing.

use super::meta::NodeType;
use super::meta_update::unknown_meta;
use super::*;
use crate::s3::split_list::{last_entry, retain_range, SplitListing};
use crate::s3::S3Result;

pub(super) struct DirStream {
    pub(super) ino: u64,
    pub(super) key: String,
    pub(super) parent: u64,
    pub(super) buffered: VecDeque<DirEntry>,
    pub(super) next_offset: u64,
    pub(super) listing: Listing,
    /// The greatest entry listed so far, where a failed parallel listing resumes.
    pub(super) last_listed: Option<String>,
    pub(super) started: bool,
    /// When this listing pass began, and the table's forgotten-name count then.
    pub(super) pass_start: Option<(Instant, u64)>,
    pub(super) local_names: HashSet<String>,
}

/// Where a directory stream's LIST pages stand.
pub(super) enum Listing {
    First,
    /// The pages after a truncated first one, listed ahead in parallel (`split_list.rs`).
    Split(SplitListing),
    /// Page after page: from a continuation token, or after an entry (where a failed
    /// parallel listing stopped).
    Token(String),
    After(String),
    Listed,
}

/// One page of `dir_key`'s children.
async fn list_page(
    client: &dyn ObjectClient,
    dir_key: &str,
    continuation: Option<&str>,
    start_after: Option<&str>,
) -> S3Result<ListPage> {
    client
        .list(ListRequest {
            prefix: dir_key,
            delimiter: Some("/"),
            continuation,
            start_after,
            max_keys: LIST_PAGE,
        })
        .await
}

impl DirStream {
    /// The next LIST page of this directory (`ahead`: the first page, fetched ahead),
    /// `None` once every page was listed. A failed LIST is tried again by the next call.
    async fn next_page(
        &mut self,
        client: &Arc<dyn ObjectClient>,
        ahead: Option<ListPage>,
    ) -> S3Result<Option<ListPage>> {
        let list =
            |continuation, start_after| list_page(&**client, &self.key, continuation, start_after);
        let page = match &mut self.listing {
            Listing::Listed => return Ok(None),
            Listing::First => match ahead {
                Some(page) => page,
                None => list(None, None).await?,
            },
            Listing::Token(token) => list(Some(token), None).await?,
            Listing::After(after) => {
                let mut page = list(None, Some(after)).await?;
                retain_range(&mut page, Some(after), None);
                page
            }
            Listing::Split(rest) => match rest.next_page().await {
                Some(Ok(page)) => page,
                Some(Err(e)) => {
                    self.listing = match self.last_listed.clone() {
                        Some(after) => Listing::After(after),
                        None => Listing::First,
                    };
                    return Err(e);
                }
                None => {
                    self.listing = Listing::Listed;
                    return Ok(None);
                }
            },
        };
        if let Some(last) = last_entry(&page) {
            self.last_listed = Some(last.to_string());
        }
        self.listing = match std::mem::replace(&mut self.listing, Listing::Listed) {
            Listing::Split(rest) => Listing::Split(rest),
            Listing::First if page.next_token.is_some() => {
                Listing::Split(SplitListing::continuing(
                    client.clone(),
                    self.key.clone(),
                    Some("/".into()),
                    &page,
                    LIST_PAGE,
                ))
            }
            _ => page
                .next_token
                .clone()
                .map_or(Listing::Listed, Listing::Token),
        };
        Ok(Some(page))
    }
}

/// A listing name is shown only if it is a valid single path component (longer than
/// NAME_MAX included: another client's key may have one).
pub(super) fn visible_name(name: &str) -> bool {
    check_existing_name(name).is_ok()
}

/// One child as a LIST page shows it.
pub(super) struct ListedEntry {
    pub(super) kind: Kind,
    pub(super) name: String,
    pub(super) size: u64,
    pub(super) mtime: SystemTime,
    pub(super) etag: Option<String>,
    /// A directory marked by an older form of marker (see `Inode::legacy_marker`).
    pub(super) legacy_marker: Option<String>,
}

/// What older s3fs versions, Hadoop and some consoles mark a directory `dir` with.
pub(super) const FOLDER_SUFFIX: &str = "_$folder$";

/// `dir` for a listed name `dir_$folder$`.
fn folder_of(name: &str) -> Option<&str> {
    name.strip_suffix(FOLDER_SUFFIX).filter(|n| !n.is_empty())
}

/// The children one LIST page of `dir_key` shows, sorted by name: common prefixes are
/// directories, and so are `name_$folder$` objects; a file with the same name as a
/// directory is hidden by it, the directory's own marker and names that are not a single
/// valid path component are skipped. (A zero-byte `name` of type
/// `application/x-directory`, the other old form, is a file until a HEAD tells its type:
/// LIST does not, see `meta_update::store_head`.)
pub(super) fn page_entries(
    dir_key: &str,
    page: &ListPage,
    dir_mtime: SystemTime,
) -> Vec<ListedEntry> {
    let mut dirs: HashMap<&str, Option<String>> = page
        .prefixes
        .iter()
        .filter_map(|p| p.strip_prefix(dir_key))
        .map(|p| (p.trim_end_matches('/'), None))
        .collect();
    for o in &page.objects {
        if let Some(name) = o.key.strip_prefix(dir_key).and_then(folder_of) {
            dirs.entry(name)
                .or_default()
                .get_or_insert_with(|| o.key.clone());
        }
    }
    let files: Vec<ListedEntry> = page
        .objects
        .iter()
        .filter_map(|o| {
            let name = o.key.strip_prefix(dir_key)?;
            (!dirs.contains_key(name) && folder_of(name).is_none()).then(|| ListedEntry {
                kind: Kind::File,
                name: name.to_string(),
                size: o.meta.size,
                mtime: o.meta.mtime,
                etag: o.meta.etag.clone(),
                legacy_marker: None,
            })
        })
        .collect();
    let dirs = dirs.into_iter().map(|(name, legacy_marker)| ListedEntry {
        kind: Kind::Dir,
        name: name.to_string(),
        size: 0,
        mtime: dir_mtime,
        etag: None,
        legacy_marker,
    });
    let mut entries: Vec<ListedEntry> = dirs
        .chain(files)
        .filter(|e| visible_name(&e.name))
        .collect();
    entries.sort_by(|a, b| a.name.cmp(&b.name));
    entries
}

/// Binds a listed entry under `dir` (see `InodeTable::upsert`); 0 if it could not be.
fn upsert_listed(t: &mut InodeTable, dir: u64, e: &ListedEntry) -> u64 {
    let ino = t.upsert(dir, &e.name, e.kind, e.size, e.mtime, e.etag.clone());
    if let (Some(legacy), Some(i)) = (&e.legacy_marker, t.get_mut(ino)) {
        i.legacy_marker.get_or_insert_with(|| legacy.clone());
    }
    ino
}

/// Puts one LIST page of directory `dir` (key `dir_key`) fetched in the background into
/// the table, and returns the children whose metadata must still be loaded and whether the
/// page was taken whole. Not whole when a name was renamed or removed through the mount
/// since the LIST was sent (`namespace_changes` was `changes`): the page may be stale about
/// names, so it only confirms the children still bound to the versions it shows (an
/// `rm` of many files then probes none of them) and adds or drops none.
pub(super) fn absorb_background_page(
    inodes: &Mutex<InodeTable>,
    dir: u64,
    dir_key: &str,
    page: &ListPage,
    changes: u64,
    dir_mtime: SystemTime,
    with_meta: bool,
) -> (Vec<(u64, String, Kind)>, bool) {
    let mut t = lock(inodes);
    let whole = t.namespace_changes == changes;
    let heads = page_entries(dir_key, page, dir_mtime)
        .into_iter()
        .filter_map(|e| {
            let child = if whole {
                upsert_listed(&mut t, dir, &e)
            } else {
                t.confirm(dir, &e.name, e.kind, e.size, e.mtime, e.etag)?
            };
            let c = t.get(child).filter(|c| with_meta && unknown_meta(c))?;
            Some((c.ino, c.meta_key().to_string(), c.kind))
        })
        .collect();
    (heads, whole)
}

impl S3Fs {
    pub async fn opendir(&self, ino: u64) -> FsResult<u64> {
        let d = self.dir_inode(ino)?;
        self.walk_ahead(ino, d.parent);
        Ok(
            self.new_fh(Handle::Dir(Arc::new(tokio::sync::Mutex::new(DirStream {
                ino,
                key: d.key,
                parent: d.parent,
                buffered: VecDeque::new(),
                next_offset: 1,
                listing: Listing::First,
                last_listed: None,
                started: false,
                pass_start: None,
                local_names: HashSet::new(),
            })))),
        )
    }

    /// The attributes of a READDIRPLUS reply's entries, each pinned in the table (the
    /// kernel takes a reference to every entry it receives): an entry whose inode was
    /// evicted since its page was listed is bound again to the version listed, so that no
    /// listed name goes missing. `settle_reply` says which the kernel got.
    pub fn reply_entries(&self, dir: u64, entries: Vec<DirEntry>) -> Vec<(DirEntry, Attr)> {
        let mut t = self.inodes();
        let mut out = Vec::with_capacity(entries.len());
        for mut e in entries {
            if e.name == "." || e.name == ".." {
                if let Some(i) = t.get(e.ino) {
                    out.push((e, self.attr_of(i)));
                }
                continue;
            }
            let current = t
                .get(e.ino)
                .filter(|i| i.parent == dir && i.name == e.name)
                .map(|i| i.ino)
                .or_else(|| t.child(dir, &e.name).map(|i| i.ino));
            let ino = match (current, &e.listed) {
                (Some(ino), _) => ino,
                (None, Some(v)) => t.upsert(dir, &e.name, e.kind, v.size, v.mtime, v.etag.clone()),
                // A local file gone meanwhile: unlinked through this mount.
                (None, None) => continue,
            };
            t.pin(ino);
            let Some(i) = t.get(ino) else {
                continue;
            };
            e.ino = ino;
            out.push((e, self.attr_of(i)));
        }
        out
    }

    /// After a READDIRPLUS reply: the kernel now holds `sent` (logged for a replacement
    /// mounter); the pins of the entries that did not fit are dropped.
    pub fn settle_reply(&self, sent: &[u64], unsent: &[u64]) {
        let mut t = self.inodes();
        for ino in sent {
            t.add_lookup(*ino);
            t.unpin(*ino);
        }
        for ino in unsent {
            t.unpin(*ino);
        }
    }

    pub fn releasedir(&self, fh: u64) {
        lock(&self.handles).remove(&fh);
    }

    /// Up to `max` entries after `offset`, listing the next page when none is buffered.
    /// Entries stay buffered until the kernel asks for an offset past them, so a reply
    /// buffer that fills up loses nothing. Memory is bounded by one LIST page per open
    /// directory. A call returning fewer than `max` has returned all that was buffered.
    pub async fn readdir(&self, fh: u64, offset: u64, max: usize) -> FsResult<Vec<DirEntry>> {
        let Some(Handle::Dir(stream)) = self.handle(fh) else {
            return Err(FsError::BadHandle);
        };
        let mut d = stream.lock().await;
        let behind = d.buffered.front().is_some_and(|e| offset + 1 < e.offset)
            || (d.buffered.is_empty() && offset + 1 < d.next_offset);
        if (offset == 0 && d.started) || behind {
            // rewinddir or a seek backwards: start the listing over.
            d.buffered.clear();
            d.next_offset = 1;
            d.listing = Listing::First;
            d.last_listed = None;
            d.started = false;
            d.pass_start = None;
            d.local_names.clear();
        }
        loop {
            while d.buffered.front().is_some_and(|e| e.offset <= offset) {
                d.buffered.pop_front();
            }
            if !d.buffered.is_empty() || matches!(d.listing, Listing::Listed) {
                break;
            }
            self.fill(&mut d).await?;
        }
        Ok(d.buffered.iter().take(max).cloned().collect())
    }

    pub(super) async fn fill(&self, d: &mut DirStream) -> FsResult<()> {
        let push = |d: &mut DirStream,
                    ino: u64,
                    kind: Kind,
                    node: NodeType,
                    name: String,
                    listed: Option<ListedVersion>| {
            let offset = d.next_offset;
            d.next_offset += 1;
            d.buffered.push_back(DirEntry {
                ino,
                offset,
                kind,
                node,
                name,
                listed,
            });
        };
        if !d.started {
            d.started = true;
            d.pass_start = Some((Instant::now(), self.inodes().forgotten_names));
            let (ino, parent) = (d.ino, d.parent);
            push(d, ino, Kind::Dir, NodeType::Dir, ".".into(), None);
            push(d, parent, Kind::Dir, NodeType::Dir, "..".into(), None);
            // Files created here and not uploaded yet: S3 cannot list them.
            let locals: Vec<(u64, Kind, NodeType, String)> = self
                .inodes()
                .children_of(ino)
                .filter(|c| c.local_only)
                .map(|c| (c.ino, c.kind, self.attr_of(c).node, c.name.clone()))
                .collect();
            for (ino, kind, node, name) in locals {
                d.local_names.insert(name.clone());
                push(d, ino, kind, node, name, None);
            }
            return Ok(());
        }
        let first_page = matches!(d.listing, Listing::First);
        let ahead = match first_page {
            true => self.page_fetched_ahead(d.ino).await,
            false => None,
        };
        let ahead = ahead.map(|(page, sent, forgotten)| {
            // The listing began when that LIST was sent.
            d.pass_start = Some((sent, forgotten));
            page
        });
        let Some(page) = d.next_page(&self.client, ahead).await? else {
            self.note_listed_all(d);
            return Ok(());
        };
        let mut entries = page_entries(&d.key, &page, self.mount_time);
        entries.retain(|e| !d.local_names.contains(&e.name));
        let listed: Vec<(u64, Kind, String, ListedVersion)> = {
            let mut t = self.inodes();
            entries
                .into_iter()
                .map(|e| {
                    let version = ListedVersion {
                        size: e.size,
                        mtime: e.mtime,
                        etag: e.etag.clone(),
                    };
                    let ino = upsert_listed(&mut t, d.ino, &e);
                    // What the table made of it (an old s3fs directory object is a file
                    // to LIST).
                    let kind = t.get(ino).map_or(e.kind, |i| i.kind);
                    (ino, kind, e.name, version)
                })
                .filter(|(ino, _, _, _)| *ino != 0)
                .collect()
        };
        // LIST tells no metadata, and a names-only walk needs none: entries whose metadata
        // is unknown go out uncached, and their HEADs wait for the first stat, unless
        // the directory's files are being stat'ed already (see `stat_ahead.rs`).
        if self.cfg.posix_metadata {
            let inos: Vec<u64> = listed.iter().map(|(ino, ..)| *ino).collect();
            // A sibling's files were stat'ed (`ls -lR`, `rsync`): so will these be.
            if self.stat_ahead.statting(d.ino) || self.stat_ahead.statting(d.parent) {
                self.start_heads(self.unknown_of(&inos));
            }
            self.stat_ahead.note_page(d.ino, inos);
        }
        let t = self.inodes();
        let subdirs: Vec<u64> = listed
            .iter()
            .filter(|(_, kind, ..)| *kind == Kind::Dir)
            .map(|(ino, ..)| *ino)
            .collect();
        lock(&self.walk).note_subdirs(d.ino, first_page, &subdirs);
        for (ino, kind, name, version) in listed {
            // An inode evicted since (a table at its cap) is bound again by the reply.
            let node = match t.get(ino) {
                Some(i) => self.attr_of(i).node,
                None if kind == Kind::Dir => NodeType::Dir,
                None => NodeType::File,
            };
            push(d, ino, kind, node, name, Some(version));
        }
        drop(t);
        if matches!(d.listing, Listing::Listed) {
            self.note_listed_all(d);
        }
        Ok(())
    }

    /// Every child is in the table now, unless some were dropped meanwhile.
    fn note_listed_all(&self, d: &DirStream) {
        let Some((started, forgotten)) = d.pass_start else {
            return;
        };
        let mut t = self.inodes();
        if forgotten == t.forgotten_names {
            if let Some(dir) = t.get_mut(d.ino) {
                dir.complete_as_of = Some(started);
            }
        }
    }
}
