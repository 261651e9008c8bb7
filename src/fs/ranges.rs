//! Sets of byte ranges: which bytes of a staged file are local, which were written.

use std::collections::BTreeMap;

/// Disjoint, non-adjacent half-open ranges `start..end`, kept merged.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RangeSet(BTreeMap<u64, u64>);

impl RangeSet {
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// Bytes covered in all.
    pub fn total(&self) -> u64 {
        self.0.iter().map(|(s, e)| e - s).sum()
    }

    pub fn iter(&self) -> impl Iterator<Item = (u64, u64)> + '_ {
        self.0.iter().map(|(s, e)| (*s, *e))
    }

    /// Bytes of `start..end` the set covers.
    pub fn covered(&self, start: u64, end: u64) -> u64 {
        if start >= end {
            return 0;
        }
        self.0
            .range(..end)
            .rev()
            .take_while(|(_, &e)| e > start)
            .map(|(&s, &e)| e.min(end) - s.max(start))
            .sum()
    }

    pub fn intersects(&self, start: u64, end: u64) -> bool {
        self.covered(start, end) > 0
    }

    /// Adds `start..end`; returns how many of its bytes were not covered before.
    pub fn insert(&mut self, start: u64, end: u64) -> u64 {
        if start >= end {
            return 0;
        }
        let new = (end - start) - self.covered(start, end);
        let touching: Vec<(u64, u64)> = self
            .0
            .range(..=end)
            .rev()
            .take_while(|(_, &e)| e >= start)
            .map(|(&s, &e)| (s, e))
            .collect();
        let (mut s, mut e) = (start, end);
        for (ts, te) in touching {
            self.0.remove(&ts);
            s = s.min(ts);
            e = e.max(te);
        }
        self.0.insert(s, e);
        new
    }

    /// Drops everything at or above `size`; returns how many bytes that removed.
    pub fn truncate(&mut self, size: u64) -> u64 {
        let removed = self.covered(size, u64::MAX);
        let above: Vec<u64> = self.0.range(size..).map(|(&s, _)| s).collect();
        for s in above {
            self.0.remove(&s);
        }
        if let Some((_, e)) = self.0.range_mut(..size).next_back() {
            if *e > size {
                *e = size;
            }
        }
        removed
    }

    /// The parts of `start..end` the set does not cover, in order.
    pub fn gaps(&self, start: u64, end: u64) -> Vec<(u64, u64)> {
        let mut out = Vec::new();
        let mut at = start;
        if let Some((_, &e)) = self.0.range(..=start).next_back() {
            at = at.max(e);
        }
        for (&s, &e) in self.0.range(start..end) {
            if s > at {
                out.push((at, s));
            }
            at = at.max(e);
        }
        if at < end {
            out.push((at, end));
        }
        out
    }

    pub fn clear(&mut self) {
        self.0.clear();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn inserts_merge_and_count_new_bytes() {
        let mut r = RangeSet::default();
        assert_eq!(r.insert(10, 20), 10);
        assert_eq!(r.insert(30, 40), 10);
        assert_eq!(r.insert(15, 35), 10);
        assert_eq!(r.iter().collect::<Vec<_>>(), vec![(10, 40)]);
        assert_eq!(r.insert(40, 41), 1, "adjacent ranges merge");
        assert_eq!(r.iter().collect::<Vec<_>>(), vec![(10, 41)]);
        assert_eq!(r.insert(0, 5), 5);
        assert_eq!(r.total(), 36);
    }

    #[test]
    fn gaps_and_coverage() {
        let mut r = RangeSet::default();
        r.insert(10, 20);
        r.insert(30, 40);
        assert_eq!(r.gaps(0, 50), vec![(0, 10), (20, 30), (40, 50)]);
        assert_eq!(r.gaps(15, 35), vec![(20, 30)]);
        assert_eq!(r.gaps(12, 18), vec![]);
        assert_eq!(r.covered(15, 35), 10);
        assert!(r.intersects(19, 21) && !r.intersects(20, 30));
    }

    #[test]
    fn truncate_cuts_and_drops() {
        let mut r = RangeSet::default();
        r.insert(10, 20);
        r.insert(30, 40);
        assert_eq!(r.truncate(15), 15);
        assert_eq!(r.iter().collect::<Vec<_>>(), vec![(10, 15)]);
        assert_eq!(r.truncate(100), 0);
    }

    #[test]
    fn matches_a_bitmap_model() {
        let mut seed = 7u64;
        let mut next = |n: u64| {
            seed = seed
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            (seed >> 33) % n
        };
        let mut r = RangeSet::default();
        let mut bits = [false; 200];
        for _ in 0..2000 {
            let a = next(200);
            let b = (a + next(30)).min(200);
            if next(10) == 0 {
                let cut = next(200);
                let want = bits[cut as usize..].iter().filter(|b| **b).count() as u64;
                assert_eq!(r.truncate(cut), want);
                bits[cut as usize..].iter_mut().for_each(|b| *b = false);
            } else {
                let want = bits[a as usize..b as usize].iter().filter(|b| !**b).count() as u64;
                assert_eq!(r.insert(a, b), want);
                bits[a as usize..b as usize]
                    .iter_mut()
                    .for_each(|b| *b = true);
            }
            let (x, y) = (next(200), next(200));
            let (x, y) = (x.min(y), x.max(y));
            let gaps: u64 = r.gaps(x, y).iter().map(|(s, e)| e - s).sum();
            let want = bits[x as usize..y as usize].iter().filter(|b| !**b).count() as u64;
            assert_eq!(gaps, want);
            assert_eq!(r.covered(x, y), (y - x) - want);
        }
    }
}
