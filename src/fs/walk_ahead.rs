//! Walking a tree ahead of the walker. `ls -laR`, `find`, `du`, `rsync` and `os.walk` open
//! the subdirectories of a directory one after the other, in listing order, and each one
//! costs a LIST and (with stored metadata honoured) a HEAD per entry: several round trips
//! that the walker waits for in turn. When a subdirectory of a listed directory is opened,
//! the next `DIRS_AHEAD` siblings are listed and their entries' metadata loaded in the
//! background, so that by the time the walker opens them their first page is here.
//!
//! A page fetched ahead is used only by the first readdir of that directory, only while
//! younger than `--metadata-ttl` (so never with `--metadata-ttl 0`), and only if no name
//! was renamed or removed through this mount since it was fetched; otherwise the readdir
//! lists as usual. Memory: at most `DIRS_AHEAD` pages per walk, and the order of the
//! subdirectories of the `ORDERS_KEPT` directories listed last.

use super::*;
use tokio::sync::OnceCell;

/// Subdirectories listed ahead of the one being opened.
const DIRS_AHEAD: usize = 8;
/// Directories whose subdirectory order is remembered.
const ORDERS_KEPT: usize = 64;
/// Subdirectories remembered per directory.
const ORDER_MAX: usize = 10_000;

/// A first LIST page fetched ahead, with the table's counters when it was sent.
pub(super) struct AheadPage {
    pub(super) started: Instant,
    pub(super) forgotten: u64,
    namespace_changes: u64,
    /// `None` when the LIST failed, or when a readdir came first and listed itself.
    page: OnceCell<Option<ListPage>>,
}

#[derive(Default)]
pub(super) struct WalkAhead {
    /// Subdirectories of recently listed directories (inode, in listing order) by parent.
    order: HashMap<u64, (Instant, Vec<u64>)>,
    pages: HashMap<u64, Arc<AheadPage>>,
}

impl WalkAhead {
    /// Notes the subdirectories one LIST page of `dir` showed; `first`: the listing's
    /// first page (the order starts over).
    pub(super) fn note_subdirs(&mut self, dir: u64, first: bool, subdirs: &[u64]) {
        if first {
            self.order.remove(&dir);
        }
        if subdirs.is_empty() {
            return;
        }
        if self.order.len() >= ORDERS_KEPT && !self.order.contains_key(&dir) {
            if let Some(oldest) = self.order.iter().min_by_key(|(_, (at, _))| *at) {
                let oldest = *oldest.0;
                self.order.remove(&oldest);
            }
        }
        let (at, list) = self
            .order
            .entry(dir)
            .or_insert_with(|| (Instant::now(), Vec::new()));
        *at = Instant::now();
        let room = ORDER_MAX.saturating_sub(list.len());
        list.extend(subdirs.iter().take(room));
    }

    /// The siblings after `ino` under `parent` that have no page fetched ahead yet, each
    /// now registered as fetched ahead (the caller starts the fetches).
    fn claim_next(
        &mut self,
        parent: u64,
        ino: u64,
        counters: (u64, u64),
        ttl: Duration,
    ) -> Vec<(u64, Arc<AheadPage>)> {
        self.pages.retain(|_, p| p.started.elapsed() < ttl);
        let Some((_, order)) = self.order.get(&parent) else {
            return Vec::new();
        };
        let Some(at) = order.iter().position(|i| *i == ino) else {
            return Vec::new();
        };
        let mut claimed = Vec::new();
        for next in order[at + 1..].iter().take(DIRS_AHEAD) {
            if self.pages.contains_key(next) {
                continue;
            }
            let page = Arc::new(AheadPage {
                started: Instant::now(),
                forgotten: counters.0,
                namespace_changes: counters.1,
                page: OnceCell::new(),
            });
            self.pages.insert(*next, page.clone());
            claimed.push((*next, page));
        }
        claimed
    }

    fn take(&mut self, dir: u64) -> Option<Arc<AheadPage>> {
        self.pages.remove(&dir)
    }
}

impl S3Fs {
    /// Called when directory `ino` is opened: lists its next siblings ahead (see the
    /// module doc).
    pub(super) fn walk_ahead(&self, ino: u64, parent: u64) {
        let ttl = self.cfg.metadata_ttl;
        if ttl.is_zero() || ino == parent {
            return;
        }
        let (counters, keys) = {
            let t = self.inodes();
            let counters = (t.forgotten_names, t.namespace_changes);
            let claimed = lock(&self.walk).claim_next(parent, ino, counters, ttl);
            let keys: Vec<_> = claimed
                .into_iter()
                .filter_map(|(dir, page)| Some((dir, t.get(dir)?.key.clone(), page)))
                .collect();
            (counters, keys)
        };
        // Their entries' metadata too while the walker stats what it lists (`ls -lR`),
        // not for a names-only walk (`find -name`).
        let with_meta = self.cfg.posix_metadata
            && (self.stat_ahead.statting(parent) || self.stat_ahead.statting(ino));
        for (dir, key, ahead) in keys {
            let client = self.client.clone();
            let inodes = self.inodes.clone();
            let heads_of = self.head_starter();
            let dir_mtime = self.mount_time;
            tokio::spawn(async move {
                ahead
                    .page
                    .get_or_init(|| async {
                        let request = ListRequest {
                            prefix: &key,
                            delimiter: Some("/"),
                            continuation: None,
                            start_after: None,
                            max_keys: LIST_PAGE,
                        };
                        let page = match client.list(request).await {
                            Ok(p) => p,
                            Err(e) => {
                                tracing::debug!(key = %key, error = %e, "listing ahead failed");
                                return None;
                            }
                        };
                        let (heads, whole) = absorb_background_page(
                            &inodes, dir, &key, &page, counters.1, dir_mtime, with_meta,
                        );
                        heads_of.start(heads);
                        whole.then_some(page)
                    })
                    .await;
            });
        }
    }

    /// The first LIST page of `dir` if it was fetched ahead and may still be used: the
    /// page, and when its LIST was sent with the forgotten-name count then.
    pub(super) async fn page_fetched_ahead(&self, dir: u64) -> Option<(ListPage, Instant, u64)> {
        let ahead = lock(&self.walk).take(dir)?;
        // Waits for a fetch under way; one not begun yet is cancelled (`None` wins).
        let page = ahead.page.get_or_init(|| async { None }).await.clone()?;
        let fresh = ahead.started.elapsed() < self.cfg.metadata_ttl;
        let unchanged = self.inodes().namespace_changes == ahead.namespace_changes;
        (fresh && unchanged).then_some((page, ahead.started, ahead.forgotten))
    }
}
