//! Options of one mount: where the bucket is, how files look, how I/O is tuned.
//!
//! The same option names work as long flags (`--file-mode 0640`), in `-o` lists
//! (`-o file-mode=0640,allow-other`, underscores accepted for fstab habits) and in a CSI
//! PersistentVolume's `mountOptions`; [`MountConfig::apply_option`] is the single
//! allow-list that all three go through.

use crate::s3::aws::Endpoint;
use std::time::Duration;

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum MountOptionError {
    #[error("unknown mount option {0:?}")]
    Unknown(String),
    #[error("mount option {option:?}: {reason}")]
    Invalid { option: String, reason: String },
    #[error("invalid bucket source {0:?}: expected BUCKET[:PREFIX]")]
    BadSource(String),
}

fn invalid(option: &str, reason: impl Into<String>) -> MountOptionError {
    MountOptionError::Invalid {
        option: option.to_string(),
        reason: reason.into(),
    }
}

/// `BUCKET[:PREFIX]`, with the prefix normalised to end in `/` (or be empty).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BucketSource {
    pub bucket: String,
    pub prefix: String,
}

impl BucketSource {
    pub fn new(bucket: &str, prefix: &str) -> Result<Self, MountOptionError> {
        validate_bucket_name(bucket)
            .map_err(|_| MountOptionError::BadSource(format!("{bucket}:{prefix}")))?;
        Ok(Self {
            bucket: bucket.to_string(),
            prefix: normalize_prefix(prefix).map_err(|r| invalid("prefix", r))?,
        })
    }

    pub fn parse(s: &str) -> Result<Self, MountOptionError> {
        let (bucket, prefix) = s.split_once(':').unwrap_or((s, ""));
        Self::new(bucket, prefix)
    }
}

/// S3 bucket naming rules, loosely: S3-compatible stores allow a little more.
pub fn validate_bucket_name(b: &str) -> Result<(), String> {
    let ok_len = (3..=63).contains(&b.len());
    let ok_chars = b
        .bytes()
        .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || matches!(c, b'-' | b'.' | b'_'));
    let ok_ends = b
        .bytes()
        .next()
        .zip(b.bytes().last())
        .is_some_and(|(f, l)| f.is_ascii_alphanumeric() && l.is_ascii_alphanumeric());
    if ok_len && ok_chars && ok_ends {
        Ok(())
    } else {
        Err(format!("invalid bucket name {b:?}"))
    }
}

/// Prefixes are key paths: no empty, `.` or `..` components; stored with a trailing `/`.
pub fn normalize_prefix(p: &str) -> Result<String, String> {
    let trimmed = p.trim_matches('/');
    if trimmed.is_empty() {
        return Ok(String::new());
    }
    if trimmed.len() > 512 {
        return Err("prefix longer than 512 bytes".into());
    }
    for part in trimmed.split('/') {
        if part.is_empty() || part == "." || part == ".." {
            return Err(format!("prefix {p:?} has an empty, '.' or '..' component"));
        }
        if part.chars().any(|c| c.is_control()) {
            return Err(format!("prefix {p:?} contains control characters"));
        }
    }
    Ok(format!("{trimmed}/"))
}

#[derive(Debug, Clone, PartialEq)]
pub struct MountConfig {
    pub source: BucketSource,
    pub endpoint: Endpoint,
    pub read_only: bool,
    pub uid: u32,
    pub gid: u32,
    pub file_mode: u16,
    pub dir_mode: u16,
    pub allow_other: bool,
    pub allow_root: bool,
    pub metadata_ttl: Duration,
    pub part_size: u64,
    pub max_concurrency: usize,
    /// Bytes of read-ahead data all open files may hold together.
    pub max_prefetch_memory: u64,
    /// Bytes of upload parts all files being written may have in flight together.
    pub max_upload_memory: u64,
    /// Close of a new empty file waits until the object is in S3 (default: it does not).
    pub sync_create: bool,
    /// `unlink` waits until S3 has deleted the object (default: only the first one does).
    pub sync_delete: bool,
    /// File data goes through the kernel's page cache (default: direct I/O).
    pub page_cache: bool,
    pub debug: bool,
}

const MIB: u64 = 1024 * 1024;

impl MountConfig {
    pub fn new(source: BucketSource) -> Self {
        Self {
            source,
            endpoint: Endpoint::default(),
            read_only: false,
            uid: nix::unistd::geteuid().as_raw(),
            gid: nix::unistd::getegid().as_raw(),
            file_mode: 0o644,
            dir_mode: 0o755,
            allow_other: false,
            allow_root: false,
            metadata_ttl: Duration::from_secs(5),
            part_size: 8 * MIB,
            max_concurrency: 16,
            max_prefetch_memory: 512 * MIB,
            max_upload_memory: 256 * MIB,
            sync_create: false,
            sync_delete: false,
            page_cache: false,
            debug: false,
        }
    }

    /// Applies one `name[=value]` option. Names accept `-` or `_`.
    pub fn apply_option(
        &mut self,
        name: &str,
        value: Option<&str>,
    ) -> Result<(), MountOptionError> {
        let key = name.trim().replace('_', "-");
        let need = |v: Option<&str>| -> Result<String, MountOptionError> {
            match v {
                Some(v) if !v.is_empty() => Ok(v.to_string()),
                _ => Err(invalid(&key, "needs a value")),
            }
        };
        let flag = |v: Option<&str>| -> Result<bool, MountOptionError> {
            match v {
                None => Ok(true),
                Some("true" | "1" | "yes") => Ok(true),
                Some("false" | "0" | "no") => Ok(false),
                Some(other) => Err(invalid(
                    &key,
                    format!("expected true or false, got {other:?}"),
                )),
            }
        };
        match key.as_str() {
            "endpoint-url" | "endpoint" => {
                let url = need(value)?;
                if !(url.starts_with("http://") || url.starts_with("https://")) {
                    return Err(invalid(&key, "must start with http:// or https://"));
                }
                // It travels inside `-o` lists: a comma would smuggle in another option.
                if url
                    .chars()
                    .any(|c| c == ',' || c.is_whitespace() || c.is_control())
                {
                    return Err(invalid(
                        &key,
                        "must not contain commas, spaces or control characters",
                    ));
                }
                self.endpoint.endpoint_url = Some(url);
            }
            "region" => {
                let r = need(value)?;
                if !r.bytes().all(|c| c.is_ascii_alphanumeric() || c == b'-') {
                    return Err(invalid(&key, "invalid region name"));
                }
                self.endpoint.region = Some(r);
            }
            "force-path-style" => self.endpoint.force_path_style = flag(value)?,
            "prefix" => {
                self.source.prefix =
                    normalize_prefix(&need(value)?).map_err(|r| invalid(&key, r))?
            }
            "read-only" | "ro" => self.read_only = flag(value)?,
            "rw" => self.read_only = false,
            "uid" => self.uid = parse_id(&key, &need(value)?)?,
            "gid" => self.gid = parse_id(&key, &need(value)?)?,
            "file-mode" => self.file_mode = parse_mode(&key, &need(value)?)?,
            "dir-mode" => self.dir_mode = parse_mode(&key, &need(value)?)?,
            "allow-other" => self.allow_other = flag(value)?,
            "allow-root" => self.allow_root = flag(value)?,
            "metadata-ttl" => self.metadata_ttl = parse_duration(&key, &need(value)?)?,
            "part-size" => {
                let size = parse_size(&key, &need(value)?)?;
                if !(5 * MIB..=5 * 1024 * MIB).contains(&size) {
                    return Err(invalid(&key, "must be between 5 MiB and 5 GiB (S3 limits)"));
                }
                self.part_size = size;
            }
            "max-concurrency" => {
                let n: usize = need(value)?
                    .parse()
                    .map_err(|_| invalid(&key, "expected a number"))?;
                if !(1..=256).contains(&n) {
                    return Err(invalid(&key, "must be between 1 and 256"));
                }
                self.max_concurrency = n;
            }
            "max-prefetch-memory" => {
                let size = parse_size(&key, &need(value)?)?;
                if size < 8 * MIB {
                    return Err(invalid(&key, "must be at least 8 MiB"));
                }
                self.max_prefetch_memory = size;
            }
            "max-upload-memory" => {
                let size = parse_size(&key, &need(value)?)?;
                if size < 8 * MIB {
                    return Err(invalid(&key, "must be at least 8 MiB"));
                }
                self.max_upload_memory = size;
            }
            "sync-create" => self.sync_create = flag(value)?,
            "sync-delete" => self.sync_delete = flag(value)?,
            "page-cache" => self.page_cache = flag(value)?,
            "debug" => self.debug = flag(value)?,
            // Generic options mount(8) and fstab pass to every helper; they mean nothing here.
            "defaults" | "auto" | "noauto" | "user" | "nouser" | "users" | "-netdev" | "netdev"
            | "nofail" | "exec" | "noexec" | "suid" | "nosuid" | "dev" | "nodev" | "atime"
            | "noatime" | "relatime" | "nodiratime" | "async" => {}
            _ => return Err(MountOptionError::Unknown(name.to_string())),
        }
        Ok(())
    }

    /// Applies a comma-separated `-o` list.
    pub fn apply_option_list(&mut self, list: &str) -> Result<(), MountOptionError> {
        for item in list.split(',').map(str::trim).filter(|s| !s.is_empty()) {
            let (name, value) = match item.split_once('=') {
                Some((n, v)) => (n, Some(v)),
                None => (item, None),
            };
            self.apply_option(name, value)?;
        }
        Ok(())
    }
}

fn parse_id(key: &str, v: &str) -> Result<u32, MountOptionError> {
    v.parse::<u32>()
        .ok()
        .filter(|id| *id != u32::MAX)
        .ok_or_else(|| invalid(key, format!("expected a numeric id, got {v:?}")))
}

fn parse_mode(key: &str, v: &str) -> Result<u16, MountOptionError> {
    let digits = v.strip_prefix("0o").unwrap_or(v);
    u16::from_str_radix(digits, 8)
        .ok()
        .filter(|m| *m <= 0o777)
        .ok_or_else(|| invalid(key, format!("expected an octal mode like 0644, got {v:?}")))
}

/// `5`, `1.5`, `500ms`, `2s`, `1m`, `1h`; plain numbers are seconds.
pub fn parse_duration(key: &str, v: &str) -> Result<Duration, MountOptionError> {
    let (num, unit) = split_unit(v);
    let n: f64 = num
        .parse()
        .map_err(|_| invalid(key, format!("expected a duration like 5s, got {v:?}")))?;
    let secs = match unit {
        "" | "s" => n,
        "ms" => n / 1000.0,
        "m" | "min" => n * 60.0,
        "h" => n * 3600.0,
        _ => return Err(invalid(key, format!("unknown unit {unit:?}"))),
    };
    if !(0.0..=86_400.0 * 365.0).contains(&secs) {
        return Err(invalid(key, "out of range"));
    }
    Ok(Duration::from_secs_f64(secs))
}

/// `8388608`, `8M`, `8MiB`, `1G`...; binary units.
pub fn parse_size(key: &str, v: &str) -> Result<u64, MountOptionError> {
    let (num, unit) = split_unit(v);
    let n: u64 = num
        .parse()
        .map_err(|_| invalid(key, format!("expected a size like 8MiB, got {v:?}")))?;
    let mult = match unit.to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "k" | "kb" | "kib" => 1024,
        "m" | "mb" | "mib" => MIB,
        "g" | "gb" | "gib" => 1024 * MIB,
        _ => return Err(invalid(key, format!("unknown unit {unit:?}"))),
    };
    n.checked_mul(mult).ok_or_else(|| invalid(key, "too large"))
}

fn split_unit(v: &str) -> (&str, &str) {
    let v = v.trim();
    let i = v
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(v.len());
    (&v[..i], v[i..].trim())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg() -> MountConfig {
        MountConfig::new(BucketSource::parse("bucket").unwrap())
    }

    #[test]
    fn source_parses_bucket_and_prefix() {
        let s = BucketSource::parse("my-bucket:a/b").unwrap();
        assert_eq!(
            (s.bucket.as_str(), s.prefix.as_str()),
            ("my-bucket", "a/b/")
        );
        assert_eq!(BucketSource::parse("bkt:/x/").unwrap().prefix, "x/");
        assert!(BucketSource::parse("Bad_Bucket!").is_err());
        assert!(BucketSource::parse("bkt:a/../b").is_err());
        assert!(BucketSource::parse("").is_err());
    }

    #[test]
    fn option_list_applies_every_known_option() {
        let mut c = cfg();
        c.apply_option_list(
            "ro,uid=1000,gid=2000,file_mode=0640,dir-mode=750,allow_other,metadata-ttl=500ms,\
             part-size=16MiB,max-concurrency=4,region=eu-west-1,endpoint-url=http://127.0.0.1:9000,\
             force-path-style,prefix=p,sync_create,sync-delete,page_cache,defaults,_netdev,nofail",
        )
        .unwrap();
        assert!(c.read_only && c.allow_other && c.endpoint.force_path_style);
        assert!(c.sync_create && c.sync_delete && c.page_cache);
        assert_eq!(
            (c.uid, c.gid, c.file_mode, c.dir_mode),
            (1000, 2000, 0o640, 0o750)
        );
        assert_eq!(c.metadata_ttl, Duration::from_millis(500));
        assert_eq!(c.part_size, 16 * MIB);
        assert_eq!(c.max_concurrency, 4);
        assert_eq!(c.source.prefix, "p/");
    }

    #[test]
    fn bad_options_name_the_option() {
        let mut c = cfg();
        for (opt, needle) in [
            ("bogus", "bogus"),
            ("uid=abc", "uid"),
            ("file-mode=999", "file-mode"),
            ("part-size=1M", "part-size"),
            ("metadata-ttl=soon", "metadata-ttl"),
            ("endpoint-url=ftp://x", "endpoint-url"),
            ("max-concurrency=0", "max-concurrency"),
            ("read-only=maybe", "read-only"),
            ("uid", "uid"),
        ] {
            let err = c.apply_option_list(opt).unwrap_err().to_string();
            assert!(err.contains(needle), "{opt}: {err}");
        }
    }

    #[test]
    fn sizes_and_durations() {
        assert_eq!(parse_size("x", "8M").unwrap(), 8 * MIB);
        assert_eq!(parse_size("x", "1GiB").unwrap(), 1024 * MIB);
        assert!(parse_size("x", "99999999999999999999G").is_err());
        assert_eq!(parse_duration("x", "2m").unwrap(), Duration::from_secs(120));
        assert_eq!(
            parse_duration("x", "1.5").unwrap(),
            Duration::from_millis(1500)
        );
        assert!(parse_duration("x", "-1").is_err());
    }
}
