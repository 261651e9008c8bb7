//! One listing, several LISTs in flight. ListObjectsV2 pages follow each other through
//! continuation tokens, so a long listing waits one round trip per 1 000 keys. Keys are
//! ordered, though, and `StartAfter` starts anywhere: after a page, the rest of the key
//! space is cut at points guessed from that page's first and last names (a run of digits
//! counted on, or the next letters at the first position where they differ), and each
//! range `(after, until]` is listed on its own, in parallel. Pages come out in key order.
//!
//! Correct whatever the guess: every range is listed until a page reaches its end or the
//! listing ends, entries outside a range are dropped, and the last range is unbounded. A
//! good guess (a counter, `f000000` … `f099999`) costs no more requests than listing in
//! turn; a bad one costs at most one request per range. Memory: at most one page per
//! range (two for the one being read) and `MAX_RANGES` ranges.

use super::{ListPage, ListRequest, ObjectClient, S3Error, S3Result};
use futures::stream::{FuturesUnordered, StreamExt};
use std::collections::VecDeque;
use std::ops::RangeFrom;
use std::sync::Arc;
use tokio::sync::mpsc;

/// Ranges listed at once at most (each with one LIST in flight).
pub const MAX_RANGES: usize = 8;

/// The sort key of every entry of a page: object keys and common prefixes.
fn entry_keys(page: &ListPage) -> impl Iterator<Item = &str> {
    page.objects
        .iter()
        .map(|o| o.key.as_str())
        .chain(page.prefixes.iter().map(String::as_str))
}

/// The greatest entry of a page (S3 orders a common prefix by its text among the keys).
pub fn last_entry(page: &ListPage) -> Option<&str> {
    entry_keys(page).max()
}

/// Keeps the entries in `(after, until]`. A common prefix cannot straddle a bound: bounds
/// hold no delimiter past the listed prefix, so each prefix's keys lie on one side.
pub fn retain_range(page: &mut ListPage, after: Option<&str>, until: Option<&str>) {
    let inside = |k: &str| after.is_none_or(|a| k > a) && until.is_none_or(|u| k <= u);
    page.objects.retain(|o| inside(&o.key));
    page.prefixes.retain(|p| inside(p));
}

/// Up to `n` increasing keys after `last`, each guessed to be about one page further on
/// than the page `first ..= last` (see the module doc); none when nothing can be guessed.
pub fn split_points(first: &str, last: &str, n: usize) -> Vec<String> {
    let (first, last) = (
        first.strip_suffix('/').unwrap_or(first),
        last.strip_suffix('/').unwrap_or(last),
    );
    let (f, l) = (first.as_bytes(), last.as_bytes());
    let Some(i) = f.iter().zip(l).position(|(a, b)| a != b) else {
        return Vec::new();
    };
    // Both bytes ASCII: `i` is a char boundary of both.
    if !f[i].is_ascii() || !l[i].is_ascii() {
        return Vec::new();
    }
    if f[i].is_ascii_digit() && l[i].is_ascii_digit() {
        if let Some(points) = counted_on(first, last, i, n) {
            return points;
        }
    }
    next_letters(f[i], last, i, n)
}

/// A run of digits at the first difference, counted on by the page's span:
/// `f000000 … f000999` → `f001999`, `f002999`, …
fn counted_on(first: &str, last: &str, i: usize, n: usize) -> Option<Vec<String>> {
    let (f, l) = (first.as_bytes(), last.as_bytes());
    let digits = |at: usize| {
        f.get(at).is_some_and(u8::is_ascii_digit) && l.get(at).is_some_and(u8::is_ascii_digit)
    };
    let mut start = i;
    while start > 0 && digits(start - 1) {
        start -= 1;
    }
    let mut end = i + 1;
    while digits(end) {
        end += 1;
    }
    let width = end - start;
    if width > 30 {
        return None;
    }
    let a: u128 = first[start..end].parse().ok()?;
    let b: u128 = last[start..end].parse().ok()?;
    let step = b.checked_sub(a)? + 1;
    let limit = 10u128.pow(width as u32);
    let points = (1..=n as u128)
        .map_while(|k| b.checked_add(k * step).filter(|v| *v < limit))
        .map(|v| format!("{}{v:0width$}{}", &last[..start], &last[end..]))
        .collect();
    Some(points)
}

/// The next letters of the alphabet of `last[i]` at position `i`, stepping by the page's
/// span there: `00a3… 02f1…` → `05`, `08`, …
fn next_letters(first_at: u8, last: &str, i: usize, n: usize) -> Vec<String> {
    const ALPHABETS: [&[u8]; 3] = [
        b"0123456789abcdefghijklmnopqrstuvwxyz",
        b"0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZ",
        b"0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz",
    ];
    let at = last.as_bytes()[i];
    let Some(alphabet) = ALPHABETS.iter().find(|a| a.contains(&at)) else {
        return Vec::new();
    };
    let pos = |c: u8| alphabet.iter().position(|x| *x == c);
    let li = pos(at).unwrap_or(0);
    let step = pos(first_at).map_or(1, |fi| li.saturating_sub(fi).max(1));
    (1..=n)
        .map(|k| li + k * step)
        .take_while(|v| *v < alphabet.len())
        .map(|v| format!("{}{}", &last[..i], alphabet[v] as char))
        .collect()
}

/// One range of the key space and what was listed of it.
struct Range {
    /// Names the range in the requests in flight (ranges are inserted as they are cut).
    id: u64,
    after: Option<String>,
    until: Option<String>,
    token: Option<String>,
    pages: VecDeque<ListPage>,
    error: Option<S3Error>,
    busy: bool,
    done: bool,
}

impl Range {
    fn new(id: u64, after: Option<String>, until: Option<String>, token: Option<String>) -> Self {
        Range {
            id,
            after,
            until,
            token,
            pages: VecDeque::new(),
            error: None,
            busy: false,
            done: false,
        }
    }
}

/// The pages of a listing after its first one, in order, fetched ahead in parallel.
/// Dropping it stops the fetching.
pub struct SplitListing {
    pages: mpsc::Receiver<S3Result<ListPage>>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for SplitListing {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl SplitListing {
    /// Lists what follows `first`, a truncated page of `prefix` (with `delimiter`).
    pub fn continuing(
        client: Arc<dyn ObjectClient>,
        prefix: String,
        delimiter: Option<String>,
        first: &ListPage,
        page_size: i32,
    ) -> Self {
        let mut ranges = VecDeque::from([Range::new(0, None, None, first.next_token.clone())]);
        let mut cuts = Cuts { ids: 1.., batch: 1 };
        split(&mut ranges, 0, first, &mut cuts);
        let (tx, rx) = mpsc::channel(1);
        let task = tokio::spawn(run(client, prefix, delimiter, page_size, ranges, cuts, tx));
        SplitListing { pages: rx, task }
    }

    /// The next page; `None` at the end. After an error nothing more comes.
    pub async fn next_page(&mut self) -> Option<S3Result<ListPage>> {
        self.pages.recv().await
    }
}

/// How ranges are cut: the next range's id, and how many points the next cut makes. A
/// listing starts with one cut point and doubles it with every cut, so that a listing
/// of a few pages sends few requests past its end, and a long one soon lists
/// `MAX_RANGES` ranges at once.
struct Cuts {
    ids: RangeFrom<u64>,
    batch: usize,
}

/// Cuts range `at`, of which `page` was just listed, at the points guessed from it that
/// fall inside it, as far as `MAX_RANGES` allows.
fn split(ranges: &mut VecDeque<Range>, at: usize, page: &ListPage, cuts: &mut Cuts) {
    let open = ranges.iter().filter(|r| !r.done).count();
    let n = cuts.batch.min(MAX_RANGES.saturating_sub(open));
    let (Some(first), Some(last)) = (entry_keys(page).min(), last_entry(page)) else {
        return;
    };
    let until = ranges[at].until.clone();
    let points: Vec<String> = split_points(first, last, n)
        .into_iter()
        .filter(|p| p.as_str() > last && until.as_ref().is_none_or(|u| p < u))
        .collect();
    let Some(head) = points.first() else {
        return;
    };
    cuts.batch *= 2;
    ranges[at].until = Some(head.clone());
    for (k, after) in points.iter().enumerate() {
        let until = points.get(k + 1).cloned().or_else(|| until.clone());
        let id = cuts.ids.next().expect("ids do not run out");
        ranges.insert(at + 1 + k, Range::new(id, Some(after.clone()), until, None));
    }
}

async fn run(
    client: Arc<dyn ObjectClient>,
    prefix: String,
    delimiter: Option<String>,
    page_size: i32,
    mut ranges: VecDeque<Range>,
    mut cuts: Cuts,
    tx: mpsc::Sender<S3Result<ListPage>>,
) {
    let mut in_flight = FuturesUnordered::new();
    loop {
        for (k, r) in ranges.iter_mut().enumerate() {
            let wanted = if k == 0 { 2 } else { 1 };
            if r.done || r.busy || r.pages.len() >= wanted {
                continue;
            }
            r.busy = true;
            let (client, prefix, delimiter) = (client.clone(), prefix.clone(), delimiter.clone());
            let (token, after) = (r.token.clone(), r.after.clone());
            let id = r.id;
            in_flight.push(async move {
                let page = client
                    .list(ListRequest {
                        prefix: &prefix,
                        delimiter: delimiter.as_deref(),
                        continuation: token.as_deref(),
                        start_after: after.as_deref(),
                        max_keys: page_size,
                    })
                    .await;
                (id, page)
            });
        }
        while ranges.front().is_some_and(|r| r.done && r.pages.is_empty()) {
            let r = ranges.pop_front().expect("front exists");
            if let Some(e) = r.error {
                let _ = tx.send(Err(e)).await;
                return;
            }
        }
        if ranges.is_empty() {
            return;
        }
        let ready = !ranges[0].pages.is_empty();
        tokio::select! {
            permit = tx.reserve(), if ready => {
                let Ok(permit) = permit else { return };
                let page = ranges[0].pages.pop_front().expect("a page is ready");
                permit.send(Ok(page));
            }
            Some((id, listed)) = in_flight.next() => {
                let Some(at) = ranges.iter().position(|r| r.id == id) else {
                    continue;
                };
                let r = &mut ranges[at];
                r.busy = false;
                match listed {
                    Err(e) => {
                        r.error = Some(e);
                        r.done = true;
                    }
                    Ok(mut page) => {
                        let reached = r
                            .until
                            .as_deref()
                            .is_some_and(|u| last_entry(&page).is_some_and(|l| l >= u));
                        retain_range(&mut page, r.after.as_deref(), r.until.as_deref());
                        r.token = page.next_token.take();
                        r.done = reached || r.token.is_none();
                        let more = !r.done;
                        if more {
                            split(&mut ranges, at, &page, &mut cuts);
                        }
                        if !page.objects.is_empty() || !page.prefixes.is_empty() {
                            ranges[at].pages.push_back(page);
                        }
                    }
                }
            }
            // Not reached (the front range has a page ready or a LIST in flight); were it,
            // an error, never an end that would make the listing look complete.
            else => {
                let _ = tx.send(Err(S3Error::Other("parallel listing stalled".into()))).await;
                return;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::s3::mem::MemClient;
    use bytes::Bytes;

    #[test]
    fn a_counter_is_counted_on_by_the_page_span() {
        assert_eq!(
            split_points("d/f000000", "d/f000999", 3),
            ["d/f001999", "d/f002999", "d/f003999"]
        );
        assert_eq!(
            split_points("d/img_0000.jpg", "d/img_0099.jpg", 2),
            ["d/img_0199.jpg", "d/img_0299.jpg"]
        );
        // The counter's width bounds it.
        assert_eq!(split_points("d/f00", "d/f49", 5), ["d/f99"]);
    }

    #[test]
    fn other_names_step_through_their_alphabet() {
        assert_eq!(split_points("d/aa3", "d/cf1", 3), ["d/e", "d/g", "d/i"]);
        // Digits are counted on, what follows them kept.
        assert_eq!(split_points("d/00a3", "d/02f1", 2), ["d/05f1", "d/08f1"]);
        assert_eq!(split_points("d/Apple/", "d/Cherry", 2), ["d/E", "d/G"]);
        assert!(split_points("d/a", "d/a", 3).is_empty());
        assert!(split_points("d/é1", "d/éz", 3).is_empty());
        assert!(split_points("d/x~", "d/y~", 3)
            .iter()
            .all(|p| p.as_str() > "d/y~"));
    }

    async fn listed_through(client: Arc<MemClient>, prefix: &str, page: i32) -> Vec<String> {
        let client: Arc<dyn ObjectClient> = client;
        let req = ListRequest {
            prefix,
            delimiter: Some("/"),
            continuation: None,
            start_after: None,
            max_keys: page,
        };
        let first = client.list(req).await.unwrap();
        let sorted = |p: &ListPage| {
            let mut keys: Vec<String> = entry_keys(p).map(str::to_string).collect();
            keys.sort();
            keys
        };
        let mut names = sorted(&first);
        if first.next_token.is_some() {
            let mut rest =
                SplitListing::continuing(client, prefix.into(), Some("/".into()), &first, page);
            while let Some(p) = rest.next_page().await {
                names.extend(sorted(&p.unwrap()));
            }
        }
        names
    }

    /// Every name exactly once and in order, whatever the names do to the guesses.
    #[tokio::test]
    async fn every_entry_comes_once_and_in_order() {
        let sets: Vec<Vec<String>> = vec![
            (0..5_000).map(|i| format!("f{i:06}")).collect(),
            (0..3_000).map(|i| format!("f{}", i * 7)).collect(),
            (0..3_000)
                .map(|i: u64| format!("{:016x}", i.wrapping_mul(0x9e37_79b9_7f4a_7c15)))
                .collect(),
            (0..2_000)
                .flat_map(|i| {
                    [
                        format!("n{i:05}"),
                        format!("n{i:05}.d/x"),
                        format!("n{i:05}-"),
                    ]
                })
                .collect(),
            (0..1_500).map(|i| format!("Z{i}é{}", i % 13)).collect(),
        ];
        for names in sets {
            let client = Arc::new(MemClient::new());
            for n in &names {
                client.insert(&format!("dir/{n}"), Bytes::new());
            }
            client.insert("dir0", Bytes::new());
            client.insert("dia", Bytes::new());
            let mut want: Vec<String> = names
                .iter()
                .map(|n| match n.find('/') {
                    Some(i) => format!("dir/{}", &n[..=i]),
                    None => format!("dir/{n}"),
                })
                .collect();
            want.sort();
            want.dedup();
            for page in [1, 7, 100, 1000] {
                let got = listed_through(client.clone(), "dir/", page).await;
                let differs = got.iter().zip(&want).position(|(g, w)| g != w);
                assert_eq!(
                    (got.len(), differs),
                    (want.len(), None),
                    "page {page}, names from {:?}, first difference {:?}",
                    names.first(),
                    differs.map(|i| (&got[i], &want[i]))
                );
            }
        }
    }

    /// A counter costs no more LISTs than listing page after page.
    #[tokio::test]
    async fn a_counter_costs_no_extra_list() {
        let client = Arc::new(MemClient::new());
        for i in 0..10_000 {
            client.insert(&format!("dir/f{i:06}"), Bytes::new());
        }
        let before = client.lists();
        let got = listed_through(client.clone(), "dir/", 1000).await;
        assert_eq!(got.len(), 10_000);
        assert!(
            client.lists() - before <= 11,
            "{} LISTs",
            client.lists() - before
        );
    }
}
