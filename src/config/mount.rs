//! Options of one mount: where the bucket is, how files look, how I/O is tuned.
//!
//! Which options exist, their names and defaults are [`super::options::MOUNT_OPTIONS`];
//! this file maps each to its typed field: [`MountConfig::apply_option`] parses one (the
//! single allow-list of flags, `-o` lists, fstab, PV `mountOptions` and volume contexts),
//! [`MountConfig::to_args`] writes a whole configuration back as `s3csi mount` flags.

use super::content_type::ContentTypes;
use super::options::{find_mount_option, Named, OptionDefault, OptionId, OptionValue};
use super::options::{OptionSpec, MOUNT_OPTIONS};
use super::units::{format_duration, format_size, parse_duration, parse_size, GIB, MIB};
use super::Endpoint;
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

fn invalid(option: &str, reason: impl ToString) -> MountOptionError {
    MountOptionError::Invalid {
        option: option.to_string(),
        reason: reason.to_string(),
    }
}

/// Why a bucket name or a prefix is refused.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum NameError {
    #[error("invalid bucket name {0:?}")]
    BucketName(String),
    #[error("prefix longer than 512 bytes")]
    PrefixTooLong,
    #[error("prefix {0:?} has an empty, '.' or '..' component")]
    PrefixComponent(String),
    #[error("prefix {0:?} contains control characters")]
    PrefixControlCharacters(String),
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

/// `BUCKET` or `BUCKET:PREFIX` (without the trailing `/`): what [`BucketSource::parse`] reads.
impl std::fmt::Display for BucketSource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.prefix.trim_end_matches('/') {
            "" => write!(f, "{}", self.bucket),
            prefix => write!(f, "{}:{prefix}", self.bucket),
        }
    }
}

/// S3 bucket naming rules, loosely: S3-compatible stores allow a little more.
pub fn validate_bucket_name(b: &str) -> Result<(), NameError> {
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
        Err(NameError::BucketName(b.to_string()))
    }
}

/// Prefixes are key paths: no empty, `.` or `..` components; stored with a trailing `/`.
pub fn normalize_prefix(p: &str) -> Result<String, NameError> {
    let trimmed = p.trim_matches('/');
    if trimmed.is_empty() {
        return Ok(String::new());
    }
    if trimmed.len() > 512 {
        return Err(NameError::PrefixTooLong);
    }
    for part in trimmed.split('/') {
        if part.is_empty() || part == "." || part == ".." {
            return Err(NameError::PrefixComponent(p.to_string()));
        }
        if part.chars().any(|c| c.is_control()) {
            return Err(NameError::PrefixControlCharacters(p.to_string()));
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
    /// The kernel enforces no permissions (default: `default_permissions`).
    pub no_default_permissions: bool,
    pub metadata_ttl: Duration,
    /// Inodes kept in memory before idle ones are dropped.
    pub max_entries: usize,
    /// Versions whose metadata is kept known (`known_versions.rs`).
    pub max_known_versions: usize,
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
    /// Local space staged files (edits in place) and the data cache may take together.
    pub cache_size: u64,
    /// Object data read is kept on local disk for later reads.
    pub data_cache: bool,
    /// When wholly cached files are read by the kernel itself (FUSE passthrough).
    pub passthrough: Passthrough,
    /// The data cache keeps this share (percent) of its disk free.
    pub cache_free_percent: u8,
    /// Bytes of randomly read data kept in memory for later reads (0: none).
    pub cache_memory: u64,
    /// Edits in place are uploaded this long after their last close/fsync, which return
    /// once the edit is on local disk (default: close and fsync upload).
    pub write_back: Option<Duration>,
    /// Stored POSIX metadata is neither shown nor written (default: it is, as s3fs does).
    pub ignore_metadata: bool,
    /// POSIX ACLs are enforced and stored (`--posix-acl`; needs stored metadata).
    pub posix_acl: bool,
    /// The Content-Type objects written get (`--content-type`).
    pub content_type: ContentTypes,
    pub debug: bool,
}

/// When the kernel may read a wholly cached file by itself (`--passthrough`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Passthrough {
    /// On read-only mounts, where no open can need a writer's path.
    ReadOnly,
    /// Also on writable mounts: opening a file for writing while it is read in
    /// passthrough gives ETXTBSY (see `fs::passthrough`).
    Always,
    Off,
}

impl MountConfig {
    /// Every option at its default: the table's default values, parsed as if given.
    pub fn new(source: BucketSource) -> Self {
        let mut cfg = Self {
            source,
            endpoint: Endpoint::default(),
            // Described defaults: the ids of the process that mounts.
            uid: nix::unistd::geteuid().as_raw(),
            gid: nix::unistd::getegid().as_raw(),
            // Switches are off unless given (see `OptionValue::Switch`).
            read_only: false,
            allow_other: false,
            allow_root: false,
            no_default_permissions: false,
            sync_create: false,
            sync_delete: false,
            page_cache: false,
            data_cache: false,
            passthrough: Passthrough::ReadOnly,
            ignore_metadata: false,
            posix_acl: false,
            // Placeholder, replaced by its table default just below.
            content_type: ContentTypes::Off,
            write_back: None,
            debug: false,
            // Placeholders, each replaced by its table default just below.
            file_mode: 0,
            dir_mode: 0,
            metadata_ttl: Duration::ZERO,
            max_entries: 0,
            max_known_versions: 0,
            part_size: 0,
            max_concurrency: 0,
            max_prefetch_memory: 0,
            max_upload_memory: 0,
            cache_size: 0,
            cache_free_percent: 0,
            cache_memory: 0,
        };
        for spec in MOUNT_OPTIONS {
            if let OptionValue::Text {
                default: OptionDefault::Value(text),
                ..
            } = spec.value
            {
                cfg.set(spec, spec.name, Some(text))
                    .expect("the option table's defaults are valid values");
            }
        }
        cfg
    }

    /// Applies one `name[=value]` option. Names accept `-` or `_`.
    pub fn apply_option(
        &mut self,
        name: &str,
        value: Option<&str>,
    ) -> Result<(), MountOptionError> {
        let key = name.trim().replace('_', "-");
        match find_mount_option(&key) {
            Some(Named::Option(spec)) => self.set(spec, &key, value),
            Some(Named::Negation(spec)) => self.set(spec, &key, Some("false")),
            Some(Named::Ignored) => Ok(()),
            None => Err(MountOptionError::Unknown(name.to_string())),
        }
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

    /// The `s3csi mount` flags that make a mounter arrive at exactly this configuration,
    /// given [`BucketSource`]'s `Display` as its source argument (which carries the prefix):
    /// `--name` or `--name=value` for every option that differs from the default, one argv
    /// element each, so no value is ever split or quoted.
    pub fn to_args(&self) -> Vec<String> {
        let defaults = Self::new(self.source.clone());
        let mut args = Vec::new();
        for spec in MOUNT_OPTIONS.iter().filter(|s| s.is_mount_option()) {
            if spec.id == OptionId::Prefix {
                continue;
            }
            let value = self.written(spec.id);
            if value == defaults.written(spec.id) {
                continue;
            }
            // The defaults are every option's not-given state (switches off, no region), so
            // an option can only differ from them by having a value.
            if let Some(v) = value {
                args.push(match spec.value {
                    OptionValue::Switch => format!("--{}", spec.name),
                    OptionValue::Text { .. } => format!("--{}={v}", spec.name),
                });
            }
        }
        args
    }

    /// Sets the option of `spec` from its text; errors name it as `key` (how it was given).
    fn set(
        &mut self,
        spec: &OptionSpec,
        key: &str,
        value: Option<&str>,
    ) -> Result<(), MountOptionError> {
        let text = || match value {
            Some(v) if !v.is_empty() => Ok(v),
            _ => Err(invalid(key, "needs a value")),
        };
        let switch = || match value {
            None | Some("true" | "1" | "yes") => Ok(true),
            Some("false" | "0" | "no") => Ok(false),
            Some(other) => Err(invalid(
                key,
                format!("expected true or false, got {other:?}"),
            )),
        };
        let memory = || {
            let size = parse_size(text()?).map_err(|e| invalid(key, e))?;
            if size < 8 * MIB {
                return Err(invalid(key, "must be at least 8 MiB"));
            }
            Ok(size)
        };
        let count = || -> Result<usize, MountOptionError> {
            text()?
                .parse()
                .map_err(|_| invalid(key, "expected a number"))
        };
        let count_at_least = |min: usize| {
            let n = count()?;
            if n < min {
                return Err(invalid(key, format!("must be at least {min}")));
            }
            Ok(n)
        };
        use OptionId::*;
        match spec.id {
            EndpointUrl => {
                let url = text()?;
                if !(url.starts_with("http://") || url.starts_with("https://")) {
                    return Err(invalid(key, "must start with http:// or https://"));
                }
                // It travels inside `-o` lists: a comma would smuggle in another option.
                if url
                    .chars()
                    .any(|c| c == ',' || c.is_whitespace() || c.is_control())
                {
                    return Err(invalid(
                        key,
                        "must not contain commas, spaces or control characters",
                    ));
                }
                self.endpoint.endpoint_url = Some(url.to_string());
            }
            Region => {
                let r = text()?;
                if !r.bytes().all(|c| c.is_ascii_alphanumeric() || c == b'-') {
                    return Err(invalid(key, "invalid region name"));
                }
                self.endpoint.region = Some(r.to_string());
            }
            ForcePathStyle => self.endpoint.force_path_style = switch()?,
            Prefix => {
                self.source.prefix = normalize_prefix(text()?).map_err(|e| invalid(key, e))?
            }
            ReadOnly => self.read_only = switch()?,
            Uid => self.uid = parse_id(key, text()?)?,
            Gid => self.gid = parse_id(key, text()?)?,
            FileMode => self.file_mode = parse_mode(key, text()?)?,
            DirMode => self.dir_mode = parse_mode(key, text()?)?,
            AllowOther => self.allow_other = switch()?,
            AllowRoot => self.allow_root = switch()?,
            NoDefaultPermissions => self.no_default_permissions = switch()?,
            MetadataTtl => {
                self.metadata_ttl = parse_duration(text()?).map_err(|e| invalid(key, e))?
            }
            PartSize => {
                let size = parse_size(text()?).map_err(|e| invalid(key, e))?;
                if !(5 * MIB..=5 * GIB).contains(&size) {
                    return Err(invalid(key, "must be between 5 MiB and 5 GiB (S3 limits)"));
                }
                self.part_size = size;
            }
            MaxEntries => self.max_entries = count_at_least(1000)?,
            MaxKnownVersions => self.max_known_versions = count_at_least(1000)?,
            MaxConcurrency => {
                let n = count()?;
                if !(1..=256).contains(&n) {
                    return Err(invalid(key, "must be between 1 and 256"));
                }
                self.max_concurrency = n;
            }
            MaxPrefetchMemory => self.max_prefetch_memory = memory()?,
            MaxUploadMemory => self.max_upload_memory = memory()?,
            SyncDelete => self.sync_delete = switch()?,
            SyncCreate => self.sync_create = switch()?,
            PageCache => self.page_cache = switch()?,
            CacheSize => self.cache_size = parse_size(text()?).map_err(|e| invalid(key, e))?,
            DataCache => self.data_cache = switch()?,
            Passthrough => {
                self.passthrough = match text()? {
                    "read-only" | "read_only" | "ro" => self::Passthrough::ReadOnly,
                    "always" => self::Passthrough::Always,
                    "off" | "never" => self::Passthrough::Off,
                    v => {
                        return Err(invalid(
                            key,
                            format!("expected read-only, always or off, got {v:?}"),
                        ))
                    }
                }
            }
            CacheFree => {
                let v = text()?;
                self.cache_free_percent = v
                    .trim_end_matches('%')
                    .parse::<u8>()
                    .ok()
                    .filter(|p| *p <= 90)
                    .ok_or_else(|| {
                        invalid(key, format!("expected a percentage up to 90%, got {v:?}"))
                    })?
            }
            CacheMemory => self.cache_memory = parse_size(text()?).map_err(|e| invalid(key, e))?,
            WriteBack => {
                self.write_back = Some(parse_duration(text()?).map_err(|e| invalid(key, e))?)
            }
            IgnoreMetadata => self.ignore_metadata = switch()?,
            PosixAcl => self.posix_acl = switch()?,
            ContentType => {
                self.content_type = ContentTypes::parse(text()?).map_err(|e| invalid(key, e))?
            }
            Debug => self.debug = switch()?,
            // Settings of the `s3csi mount` process, not of the mount (`MountArgs` has them).
            Foreground | LogFile | CacheDir => {
                return Err(MountOptionError::Unknown(key.to_string()))
            }
        }
        Ok(())
    }

    /// The option's current value as `set` reads it back: `None` in its not-given state (a
    /// switch off, no region, the whole bucket), `"true"` for a switch that is on.
    fn written(&self, id: OptionId) -> Option<String> {
        let on = |b: bool| b.then(|| "true".to_string());
        use OptionId::*;
        match id {
            EndpointUrl => self.endpoint.endpoint_url.clone(),
            Region => self.endpoint.region.clone(),
            ForcePathStyle => on(self.endpoint.force_path_style),
            Prefix => {
                Some(self.source.prefix.trim_end_matches('/').to_string()).filter(|p| !p.is_empty())
            }
            ReadOnly => on(self.read_only),
            Uid => Some(self.uid.to_string()),
            Gid => Some(self.gid.to_string()),
            FileMode => Some(format!("{:04o}", self.file_mode)),
            DirMode => Some(format!("{:04o}", self.dir_mode)),
            AllowOther => on(self.allow_other),
            AllowRoot => on(self.allow_root),
            NoDefaultPermissions => on(self.no_default_permissions),
            MetadataTtl => Some(format_duration(self.metadata_ttl)),
            PartSize => Some(format_size(self.part_size)),
            MaxEntries => Some(self.max_entries.to_string()),
            MaxKnownVersions => Some(self.max_known_versions.to_string()),
            MaxConcurrency => Some(self.max_concurrency.to_string()),
            MaxPrefetchMemory => Some(format_size(self.max_prefetch_memory)),
            MaxUploadMemory => Some(format_size(self.max_upload_memory)),
            SyncDelete => on(self.sync_delete),
            SyncCreate => on(self.sync_create),
            PageCache => on(self.page_cache),
            CacheSize => Some(format_size(self.cache_size)),
            DataCache => on(self.data_cache),
            Passthrough => Some(
                match self.passthrough {
                    self::Passthrough::ReadOnly => "read-only",
                    self::Passthrough::Always => "always",
                    self::Passthrough::Off => "off",
                }
                .to_string(),
            ),
            CacheFree => Some(format!("{}%", self.cache_free_percent)),
            CacheMemory => Some(format_size(self.cache_memory)),
            WriteBack => self.write_back.map(format_duration),
            IgnoreMetadata => on(self.ignore_metadata),
            PosixAcl => on(self.posix_acl),
            ContentType => Some(self.content_type.to_string()),
            Debug => on(self.debug),
            Foreground | LogFile | CacheDir => None,
        }
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
        for text in ["bkt", "bkt:a/b", "bkt:a:b/c d,e"] {
            let s = BucketSource::parse(text).unwrap();
            assert_eq!(s.to_string(), text);
            assert_eq!(BucketSource::parse(&s.to_string()).unwrap(), s);
        }
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
        c.apply_option_list("rw=whatever,endpoint=https://s3.example,content_type=text/csv")
            .unwrap();
        assert!(!c.read_only);
        assert_eq!(c.content_type, ContentTypes::Fixed("text/csv".into()));
        assert_eq!(
            c.endpoint.endpoint_url.as_deref(),
            Some("https://s3.example")
        );
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
            ("content-type=text", "content-type"),
            ("uid", "uid"),
            // Flags of the process, not mount options.
            ("foreground", "foreground"),
            ("log-file=/tmp/x", "log-file"),
        ] {
            let err = c.apply_option_list(opt).unwrap_err().to_string();
            assert!(err.contains(needle), "{opt}: {err}");
        }
    }

    /// The defaults the code runs with, written out once more, as the documentation states
    /// them (README, `--help`): a change of the table shows up here as well.
    #[test]
    fn defaults() {
        let c = cfg();
        assert_eq!(c.endpoint, Endpoint::default());
        assert_eq!((c.file_mode, c.dir_mode), (0o644, 0o755));
        assert_eq!(c.metadata_ttl, Duration::from_secs(5));
        assert_eq!(c.part_size, 8 * MIB);
        assert_eq!(c.max_concurrency, 16);
        assert_eq!(
            (c.max_prefetch_memory, c.max_upload_memory),
            (512 * MIB, 256 * MIB)
        );
        assert!(!(c.read_only || c.allow_other || c.allow_root || c.debug));
        assert!(!(c.sync_create || c.sync_delete || c.page_cache));
        assert_eq!(c.uid, nix::unistd::geteuid().as_raw());
        assert_eq!(c.source.prefix, "");
        assert_eq!(c.content_type, ContentTypes::Infer);
        assert!(c.to_args().is_empty(), "{:?}", c.to_args());
        // Every option reads back its own written value unchanged.
        for spec in MOUNT_OPTIONS.iter().filter(|s| s.is_mount_option()) {
            let mut again = c.clone();
            if let Some(v) = c.written(spec.id) {
                again.apply_option(spec.name, Some(&v)).unwrap();
                assert_eq!(again, c, "{}={v}", spec.name);
            }
        }
    }

    #[test]
    fn to_args_writes_only_what_differs() {
        let mut c = MountConfig::new(BucketSource::parse("bkt:p").unwrap());
        c.apply_option_list(
            "allow-other,metadata-ttl=1500ms,part-size=5242881,region=eu-west-1,file-mode=0600",
        )
        .unwrap();
        assert_eq!(
            c.to_args(),
            [
                "--region=eu-west-1",
                "--file-mode=0600",
                "--allow-other",
                "--metadata-ttl=1500ms",
                "--part-size=5242881",
            ]
        );
    }
}
