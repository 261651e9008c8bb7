//! How far ahead of a sequential reader to fetch.
//!
//! Bytes fetched ahead are memory: a window bigger than the network needs to keep the
//! reader fed only holds data that waits. The window is judged in epochs (a window's
//! worth of bytes consumed, and at least [`MIN_EPOCH_GETS`] GETs' worth, so that one GET
//! early or late does not decide). After an epoch in which the reader waited for data it
//! doubles; after one in which the data was always there first it shrinks by a quarter.
//! Each change is a probe judged by the rate the reader got in the epoch after next (the
//! one in between lets the new size take effect): a doubling that did not raise the rate
//! by [`GAIN_TO_KEEP`] (the network, not the window, was the limit), or a shrink that
//! lowered it by more than [`LOSS_TO_UNDO`], is undone, and the size then held for
//! [`HOLD_EPOCHS`]. `--max-prefetch-memory` stays the bound for all files together.

use std::time::{Duration, Instant};

/// A doubled window is kept only if the rate rose by this factor.
const GAIN_TO_KEEP: f64 = 1.10;
/// A smaller window is kept only if the rate fell by less than this share.
const LOSS_TO_UNDO: f64 = 0.05;
/// A reader that waited less than this share of an epoch was slower than the network.
const IDLE_WAIT_SHARE: f64 = 0.02;
/// An epoch spans at least this many of the largest GETs.
pub const MIN_EPOCH_GETS: u64 = 4;
/// Epochs spent at a size after a probe away from it was undone, before the next probe
/// (the network's, the server's or the reader's speed changes).
const HOLD_EPOCHS: u32 = 8;

#[derive(Debug, Clone, Copy)]
pub struct ReadAheadWindow {
    initial: u64,
    max: u64,
    min_epoch: u64,
    current: u64,
    epoch: Option<Epoch>,
    /// The epoch after a change only lets the new size take effect.
    settling: bool,
    /// The last change, to be judged.
    probe: Option<Probe>,
    /// A probe was undone: keep this size for this many epochs.
    hold: u32,
}

#[derive(Debug, Clone, Copy)]
struct Epoch {
    start: Instant,
    bytes: u64,
    waited: Duration,
}

#[derive(Debug, Clone, Copy)]
struct Probe {
    /// The size before the change, and the rate the reader got at it.
    from: u64,
    rate: f64,
}

impl ReadAheadWindow {
    /// A window from `initial` to `max` bytes, for GETs of at most `max_get` bytes.
    pub fn new(initial: u64, max: u64, max_get: u64) -> Self {
        Self::starting(initial, max.max(initial), MIN_EPOCH_GETS * max_get)
    }

    fn starting(initial: u64, max: u64, min_epoch: u64) -> Self {
        Self {
            initial,
            max,
            min_epoch,
            current: initial,
            epoch: None,
            settling: false,
            probe: None,
            hold: 0,
        }
    }

    /// Bytes to keep requested ahead of the reader.
    pub fn current(&self) -> u64 {
        self.current
    }

    /// A seek: what was learnt was about another stretch of reading.
    pub fn reset(&mut self) {
        *self = Self::starting(self.initial, self.max, self.min_epoch);
    }

    /// A sequential read that began at `started` returned `bytes` at `now`, after waiting
    /// `waited` for data still on its way.
    pub fn consumed(&mut self, bytes: u64, waited: Duration, started: Instant, now: Instant) {
        let epoch = self.epoch.get_or_insert(Epoch {
            start: started,
            bytes: 0,
            waited: Duration::ZERO,
        });
        epoch.bytes += bytes;
        epoch.waited += waited;
        if epoch.bytes < self.current.max(self.min_epoch) {
            return;
        }
        let epoch = *epoch;
        self.epoch = None;
        if std::mem::take(&mut self.settling) {
            return;
        }
        let elapsed = now.saturating_duration_since(epoch.start).as_secs_f64();
        let rate = epoch.bytes as f64 / elapsed.max(1e-6);
        let reader_waited = epoch.waited.as_secs_f64() > IDLE_WAIT_SHARE * elapsed;
        let probe = self.probe.take();
        let undo = probe.filter(|p| match p.from < self.current {
            true => rate < p.rate * GAIN_TO_KEEP,
            false => rate < p.rate * (1.0 - LOSS_TO_UNDO),
        });
        tracing::trace!(
            window = self.current,
            rate_mb_s = rate / 1e6,
            waited_share = epoch.waited.as_secs_f64() / elapsed.max(1e-6),
            probe_from = probe.map(|p| p.from),
            probe_mb_s = probe.map(|p| p.rate / 1e6),
            undo = undo.is_some(),
            "read-ahead epoch"
        );
        let size = if let Some(p) = undo {
            self.hold = HOLD_EPOCHS;
            p.from
        } else if self.hold > 0 {
            self.hold -= 1;
            self.current
        } else if reader_waited {
            self.current * 2
        } else {
            self.current - self.current / 4
        };
        let size = size.clamp(self.initial, self.max);
        if size != self.current {
            if undo.is_none() {
                self.probe = Some(Probe {
                    from: self.current,
                    rate,
                });
            }
            self.current = size;
            self.settling = true;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: u64 = 1 << 20;

    /// A reader fed by a link that moves `window / rtt` bytes per second up to `cap`
    /// (`cap` None: the reader itself is the limit at `reader_rate`): where the window
    /// settles after `reads` reads of 1 MiB.
    fn settle(rtt: f64, cap: f64, reader_rate: f64, reads: u32) -> Vec<u64> {
        let mut w = ReadAheadWindow::new(8 * MIB, 128 * MIB, 8 * MIB);
        let mut now = Instant::now();
        let mut sizes = Vec::new();
        for _ in 0..reads {
            let link = (w.current() as f64 / rtt).min(cap);
            let (rate, waited) = if link < reader_rate {
                // The reader waits for the link for what it could have read faster.
                let t = MIB as f64 / link;
                (link, t - MIB as f64 / reader_rate)
            } else {
                (reader_rate, 0.0)
            };
            let t = Duration::from_secs_f64(MIB as f64 / rate);
            let started = now;
            now += t;
            w.consumed(MIB, Duration::from_secs_f64(waited), started, now);
            sizes.push(w.current());
        }
        sizes
    }

    #[test]
    fn grows_until_the_network_is_the_limit_then_stays_near_it() {
        // 10 ms RTT, a link of 2 GB/s from 20 MB of window: the window must reach 32 MiB
        // (and may probe 64), never the 128 MiB cap.
        let sizes = settle(0.01, 2e9, 10e9, 2000);
        let tail = &sizes[1000..];
        assert!(tail.iter().all(|&s| s <= 64 * MIB), "{tail:?}");
        assert!(tail.iter().filter(|&&s| s == 32 * MIB).count() > tail.len() / 2);
    }

    #[test]
    fn a_slow_reader_keeps_the_smallest_window() {
        let sizes = settle(0.01, 2e9, 50e6, 500);
        assert!(sizes.iter().all(|&s| s == 8 * MIB), "{sizes:?}");
    }

    #[test]
    fn a_fast_link_grows_to_the_cap() {
        // Every doubling pays up to the cap: the window gets there and stays.
        let sizes = settle(0.01, 1e12, 1e12, 3000);
        assert_eq!(sizes.last(), Some(&(128 * MIB)));
    }

    #[test]
    fn a_seek_starts_over() {
        let mut w = ReadAheadWindow::new(8 * MIB, 128 * MIB, 8 * MIB);
        let t0 = Instant::now();
        w.consumed(
            32 * MIB,
            Duration::from_millis(50),
            t0,
            t0 + Duration::from_millis(100),
        );
        assert_eq!(w.current(), 16 * MIB);
        w.reset();
        assert_eq!(w.current(), 8 * MIB);
    }
}
