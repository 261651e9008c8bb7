//! The mounters' metrics in the node service's exposition.
//!
//! At every scrape the node service asks each mounter it tracks for its metrics (METRICS on
//! the control socket, see `mounter::handoff`), all at once and each within
//! [`MOUNTER_SCRAPE_TIMEOUT`], so that one stuck mounter cannot stall the scrape. Every
//! sample gets a `volume_id` label; the samples of one family from all mounters are written
//! together under one `# HELP`/`# TYPE` header, as the text format wants. Mounts of one
//! volume on several targets (several pods) have one mounter each: their samples are summed.
//! A mounter that does not answer is left out and counted in
//! `s3csi_mounter_scrape_errors_total`.

use crate::mounter::handoff;
use prometheus_client::metrics::counter::Counter;
use std::collections::{HashMap, HashSet};
use std::path::PathBuf;
use std::time::Duration;

/// How long one mounter may take to answer a scrape.
pub const MOUNTER_SCRAPE_TIMEOUT: Duration = Duration::from_secs(2);

/// Names the mounters at scrape time: (volume ID, handoff directory).
pub(super) type ListMounters = Box<dyn Fn() -> Vec<(String, PathBuf)> + Send + Sync>;

pub(super) struct MounterScraper {
    list: ListMounters,
    /// Mounters that did not answer a scrape.
    pub(super) errors: Counter,
}

impl MounterScraper {
    pub(super) fn new(list: ListMounters) -> Self {
        Self {
            list,
            errors: Counter::default(),
        }
    }

    /// Asks every mounter for its metrics, all at once.
    pub(super) async fn collect(&self) -> MergedExposition {
        let mounts = (self.list)();
        let answers = futures::future::join_all(
            mounts
                .iter()
                .map(|(_, dir)| handoff::fetch_metrics(dir, MOUNTER_SCRAPE_TIMEOUT)),
        )
        .await;
        let mut merged = MergedExposition::default();
        for ((volume_id, dir), answer) in mounts.iter().zip(answers) {
            match answer {
                Ok(text) => merged.add(volume_id, &text),
                Err(e) => {
                    self.errors.inc();
                    tracing::debug!(volume_id, dir = %dir.display(), error = %e, "metrics: mounter skipped");
                }
            }
        }
        merged
    }
}

/// The families of several expositions, each sample labelled with its volume.
#[derive(Default, Debug)]
pub(super) struct MergedExposition {
    families: Vec<MergedFamily>,
    by_name: HashMap<String, usize>,
}

#[derive(Debug)]
struct MergedFamily {
    name: String,
    /// The help text as the mounter wrote it (already escaped).
    help: Option<String>,
    kind: String,
    /// (series: name and labels, value), in the order first seen.
    samples: Vec<(String, f64)>,
    by_series: HashMap<String, usize>,
}

impl MergedExposition {
    /// Adds the exposition (text format 0.0.4) of the mounter of `volume_id`. Lines it
    /// cannot place (a sample before any `# TYPE`, a family whose type differs from what
    /// another mounter said) are left out rather than making the whole scrape invalid.
    pub(super) fn add(&mut self, volume_id: &str, text: &str) {
        let label = format!("volume_id=\"{}\"", escape_label_value(volume_id));
        let mut help: Option<(&str, &str)> = None;
        let mut current: Option<usize> = None;
        for line in text.lines() {
            if let Some(rest) = line.strip_prefix("# HELP ") {
                help = Some(rest.split_once(' ').unwrap_or((rest, "")));
                continue;
            }
            if let Some(rest) = line.strip_prefix("# TYPE ") {
                current = rest.split_once(' ').and_then(|(name, kind)| {
                    let help = help.filter(|(n, _)| *n == name).map(|(_, h)| h);
                    self.family(name, kind, help)
                });
                continue;
            }
            if line.starts_with('#') || line.trim().is_empty() {
                continue;
            }
            let (Some(family), Some((series, value))) = (current, line.rsplit_once(' ')) else {
                continue;
            };
            let Ok(value) = value.parse::<f64>() else {
                continue;
            };
            self.families[family].add(with_label(series, &label), value);
        }
    }

    fn family(&mut self, name: &str, kind: &str, help: Option<&str>) -> Option<usize> {
        if let Some(&i) = self.by_name.get(name) {
            return (self.families[i].kind == kind).then_some(i);
        }
        self.by_name.insert(name.to_string(), self.families.len());
        self.families.push(MergedFamily {
            name: name.to_string(),
            help: help.map(str::to_string),
            kind: kind.to_string(),
            samples: Vec::new(),
            by_series: HashMap::new(),
        });
        Some(self.families.len() - 1)
    }

    /// Appends the merged families to `out`, an exposition, except those that `out`
    /// declares already (a family twice is an invalid exposition).
    pub(super) fn append_to(&self, out: &mut String) {
        use std::fmt::Write as _;
        let declared: HashSet<&str> = out
            .lines()
            .filter_map(|l| l.strip_prefix("# TYPE ")?.split(' ').next())
            .collect();
        let mut text = String::new();
        for family in &self.families {
            if declared.contains(family.name.as_str()) || family.samples.is_empty() {
                continue;
            }
            if let Some(help) = &family.help {
                let _ = writeln!(text, "# HELP {} {help}", family.name);
            }
            let _ = writeln!(text, "# TYPE {} {}", family.name, family.kind);
            for (series, value) in &family.samples {
                let _ = writeln!(text, "{series} {}", format_value(*value));
            }
        }
        out.push_str(&text);
    }
}

impl MergedFamily {
    fn add(&mut self, series: String, value: f64) {
        match self.by_series.get(&series) {
            Some(&i) => self.samples[i].1 += value,
            None => {
                self.by_series.insert(series.clone(), self.samples.len());
                self.samples.push((series, value));
            }
        }
    }
}

/// `name{labels}` or `name` with `label` (`key="value"`) first among its labels.
fn with_label(series: &str, label: &str) -> String {
    match series.split_once('{') {
        Some((name, rest)) if rest.starts_with('}') => format!("{name}{{{label}{rest}"),
        Some((name, rest)) => format!("{name}{{{label},{rest}"),
        None => format!("{series}{{{label}}}"),
    }
}

/// A label value as the text format wants it.
fn escape_label_value(value: &str) -> String {
    value
        .replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

/// A sample value as the text format spells it (Rust's `inf` is `+Inf` there).
fn format_value(value: f64) -> String {
    if value.is_nan() {
        "NaN".into()
    } else if value.is_infinite() {
        if value > 0.0 { "+Inf" } else { "-Inf" }.into()
    } else {
        value.to_string()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MOUNTER: &str = "\
# HELP s3csi_s3_requests_total S3 requests.
# TYPE s3csi_s3_requests_total counter
s3csi_s3_requests_total{operation=\"GetObject\",outcome=\"ok\"} 2
# HELP s3csi_open_file_handles Open files.
# TYPE s3csi_open_file_handles gauge
s3csi_open_file_handles 1
# HELP s3csi_s3_request_duration_seconds Latency.
# TYPE s3csi_s3_request_duration_seconds histogram
s3csi_s3_request_duration_seconds_bucket{operation=\"GetObject\",le=\"0.5\"} 2
s3csi_s3_request_duration_seconds_bucket{operation=\"GetObject\",le=\"+Inf\"} 2
s3csi_s3_request_duration_seconds_sum{operation=\"GetObject\"} 0.25
s3csi_s3_request_duration_seconds_count{operation=\"GetObject\"} 2
";

    #[test]
    fn samples_get_their_volume_and_families_stay_together() {
        let mut merged = MergedExposition::default();
        merged.add("vol-a", MOUNTER);
        merged.add("vol-b", MOUNTER);
        // A second mount of vol-a (another pod): summed into the same series.
        merged.add("vol-a", MOUNTER);
        let mut out =
            "# HELP s3csi_mounts Mounts.\n# TYPE s3csi_mounts gauge\ns3csi_mounts 3\n".to_string();
        merged.append_to(&mut out);
        assert_eq!(
            out.matches("# TYPE s3csi_s3_requests_total counter\n")
                .count(),
            1,
            "{out}"
        );
        assert!(out.contains(
            "# HELP s3csi_s3_requests_total S3 requests.\n# TYPE s3csi_s3_requests_total counter\n\
             s3csi_s3_requests_total{volume_id=\"vol-a\",operation=\"GetObject\",outcome=\"ok\"} 4\n\
             s3csi_s3_requests_total{volume_id=\"vol-b\",operation=\"GetObject\",outcome=\"ok\"} 2\n"
        ), "{out}");
        assert!(
            out.contains("s3csi_open_file_handles{volume_id=\"vol-a\"} 2\n"),
            "{out}"
        );
        assert!(out.contains(
            "s3csi_s3_request_duration_seconds_bucket{volume_id=\"vol-b\",operation=\"GetObject\",le=\"+Inf\"} 2\n"
        ), "{out}");
        assert!(out.contains("s3csi_s3_request_duration_seconds_sum{volume_id=\"vol-a\",operation=\"GetObject\"} 0.5\n"), "{out}");
    }

    #[test]
    fn families_the_node_declares_and_odd_lines_are_left_out() {
        let mut merged = MergedExposition::default();
        merged.add(
            "v\"1",
            "orphan 1\n# TYPE s3csi_mounts gauge\ns3csi_mounts 9\n# TYPE x gauge\nx{} 1\nx{a=\"b c\"} nope\n",
        );
        merged.add("v2", "# TYPE x counter\nx 5\n");
        let mut out = "# TYPE s3csi_mounts gauge\ns3csi_mounts 3\n".to_string();
        merged.append_to(&mut out);
        assert_eq!(
            out,
            "# TYPE s3csi_mounts gauge\ns3csi_mounts 3\n# TYPE x gauge\nx{volume_id=\"v\\\"1\"} 1\n"
        );
    }

    #[test]
    fn values() {
        assert_eq!(format_value(3.0), "3");
        assert_eq!(format_value(0.25), "0.25");
        assert_eq!(format_value(f64::INFINITY), "+Inf");
        assert_eq!(format_value(f64::NAN), "NaN");
        assert_eq!(escape_label_value("a\"b\\c\nd"), "a\\\"b\\\\c\\nd");
    }
}
