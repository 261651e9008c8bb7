//! Metadata loaded when a stat needs it, ahead of the stats that follow.
//!
//! LIST tells no POSIX metadata (mode, owner, times, symlink): only a HEAD does. A
//! listing therefore costs LISTs alone (`ls`, `find -name`, `os.scandir`, a data loader
//! opening files by name), and an entry whose metadata is unknown goes to the kernel with
//! a TTL of 0, so that its first `stat` comes back here as a LOOKUP or GETATTR. That one
//! waits for its own HEAD, and starts the HEADs of the entries listed after it on the
//! same page (`ls -l`, `stat *`, `rsync` stat in listing order); a directory one of whose
//! files was stat'ed is *statting* for `STATTING_FOR`, and the pages listed in it then (and
//! the pages of its siblings listed ahead of a tree walk) have their metadata loaded as
//! they arrive. A stat of an entry whose HEAD is under way waits for that HEAD: no object
//! is HEADed twice at once.
//!
//! Memory: the last page's inodes per directory listed recently (at most `PAGES_KEPT`
//! directories) and one watch channel per HEAD in flight.

use super::meta_update::head_batch;
use super::*;
use tokio::sync::watch;

/// How long a directory counts as statting after the last stat of one of its files that
/// needed a HEAD.
const STATTING_FOR: Duration = Duration::from_secs(10);
/// Directories whose last listed page is remembered.
const PAGES_KEPT: usize = 256;

#[derive(Default)]
struct State {
    /// HEADs under way, by inode: `true` is sent once the answer is in the table.
    in_flight: HashMap<u64, watch::Receiver<bool>>,
    /// The children of the page listed last in each directory, in listing order, and when.
    pages: HashMap<u64, (Instant, Arc<[u64]>)>,
    /// Directories with a recent stat of a file that needed a HEAD.
    statting: HashMap<u64, Instant>,
}

/// Shared by the file system and its background listings.
#[derive(Default)]
pub(super) struct StatAhead {
    state: Mutex<State>,
}

impl StatAhead {
    /// Remembers the children one page of `dir` listed, in order.
    pub(super) fn note_page(&self, dir: u64, children: Vec<u64>) {
        let mut s = lock(&self.state);
        if s.pages.len() >= PAGES_KEPT && !s.pages.contains_key(&dir) {
            let oldest = s
                .pages
                .iter()
                .min_by_key(|(_, (at, _))| *at)
                .map(|(d, _)| *d);
            if let Some(oldest) = oldest {
                s.pages.remove(&oldest);
            }
        }
        s.pages.insert(dir, (Instant::now(), children.into()));
    }

    /// True when metadata of `dir`'s children is wanted as they are listed.
    pub(super) fn statting(&self, dir: u64) -> bool {
        lock(&self.state)
            .statting
            .get(&dir)
            .is_some_and(|at| at.elapsed() < STATTING_FOR)
    }

    fn mark_statting(&self, dirs: &[u64]) {
        let mut s = lock(&self.state);
        s.statting.retain(|_, at| at.elapsed() < STATTING_FOR);
        for d in dirs {
            s.statting.insert(*d, Instant::now());
        }
    }

    /// `child` and the entries listed after it on `dir`'s last page (only directories,
    /// when `child` is one).
    fn page_after(&self, dir: u64, child: u64) -> Vec<u64> {
        let s = lock(&self.state);
        let Some((_, page)) = s.pages.get(&dir) else {
            return vec![child];
        };
        match page.iter().position(|i| *i == child) {
            Some(at) => page[at..].to_vec(),
            None => vec![child],
        }
    }
}

/// What starts HEADs, apart from the file system (background listings hold one).
pub(super) struct HeadStarter {
    client: Arc<dyn ObjectClient>,
    inodes: Arc<Mutex<InodeTable>>,
    ahead: Arc<StatAhead>,
    mount_time: SystemTime,
}

impl HeadStarter {
    /// Starts the HEADs of those of `todo` (inode, key, kind) that are not under way yet,
    /// in the background; returns at once.
    pub(super) fn start(&self, todo: Vec<(u64, String, Kind)>) {
        let mut senders: HashMap<u64, watch::Sender<bool>> = HashMap::new();
        let heads: Vec<(u64, String, Kind)> = {
            let mut s = lock(&self.ahead.state);
            todo.into_iter()
                .filter(|(ino, _, _)| {
                    if s.in_flight.contains_key(ino) || senders.contains_key(ino) {
                        return false;
                    }
                    let (tx, rx) = watch::channel(false);
                    s.in_flight.insert(*ino, rx);
                    senders.insert(*ino, tx);
                    true
                })
                .collect()
        };
        if heads.is_empty() {
            return;
        }
        let client = self.client.clone();
        let inodes = self.inodes.clone();
        let ahead = self.ahead.clone();
        let mount_time = self.mount_time;
        tokio::spawn(async move {
            head_batch(&client, &inodes, heads, mount_time, |ino| {
                lock(&ahead.state).in_flight.remove(&ino);
                if let Some(tx) = senders.remove(&ino) {
                    let _ = tx.send(true);
                }
            })
            .await;
            // A HEAD that never ran must not leave a stale entry (its waiters are woken by
            // the sender's drop).
            let mut s = lock(&ahead.state);
            for ino in senders.keys() {
                s.in_flight.remove(ino);
            }
        });
    }
}

impl S3Fs {
    pub(super) fn head_starter(&self) -> HeadStarter {
        HeadStarter {
            client: self.client.clone(),
            inodes: self.inodes.clone(),
            ahead: self.stat_ahead.clone(),
            mount_time: self.mount_time,
        }
    }

    /// See [`HeadStarter::start`].
    pub(super) fn start_heads(&self, todo: Vec<(u64, String, Kind)>) {
        self.head_starter().start(todo);
    }

    /// Waits until none of `inos` has a HEAD under way.
    async fn wait_heads(&self, inos: &[u64]) {
        let waits: Vec<watch::Receiver<bool>> = {
            let s = lock(&self.stat_ahead.state);
            inos.iter()
                .filter_map(|ino| s.in_flight.get(ino).cloned())
                .collect()
        };
        for mut rx in waits {
            // An error: the sender is gone, the HEAD with it.
            let _ = rx.wait_for(|done| *done).await;
        }
    }

    /// The (inode, key, kind) of those of `inos` whose metadata must still be loaded.
    pub(super) fn unknown_of(&self, inos: &[u64]) -> Vec<(u64, String, Kind)> {
        let t = self.inodes();
        inos.iter()
            .filter_map(|ino| t.get(*ino))
            .filter(|i| self.needs_meta(i))
            .map(|i| (i.ino, i.meta_key().to_string(), i.kind))
            .collect()
    }

    /// Loads the metadata of those of `inos` whose metadata is unknown, joining HEADs
    /// under way. Failures leave it unknown (the defaults show, the next access asks).
    pub(super) async fn load_meta(&self, inos: &[u64]) {
        let todo = self.unknown_of(inos);
        self.start_heads(todo);
        self.wait_heads(inos).await;
    }

    /// Loads the metadata of `i` for a stat of it, and starts loading that of the
    /// entries listed after it (see the module doc).
    pub(super) async fn load_meta_for_stat(&self, i: &Inode) {
        let mut wanted = self.stat_ahead.page_after(i.parent, i.ino);
        if i.kind == Kind::File {
            self.stat_ahead
                .mark_statting(&[i.parent, self.parent_of(i.parent)]);
        } else {
            let t = self.inodes();
            wanted.retain(|c| t.get(*c).is_some_and(|c| c.kind == Kind::Dir));
        }
        let todo = self.unknown_of(&wanted);
        self.start_heads(todo);
        self.wait_heads(&[i.ino]).await;
    }

    fn parent_of(&self, dir: u64) -> u64 {
        self.inodes().get(dir).map_or(dir, |d| d.parent)
    }
}
