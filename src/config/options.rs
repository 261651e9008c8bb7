//! The options of `s3csi mount`, described once: [`MOUNT_OPTIONS`]. Parsing
//! ([`super::MountConfig::apply_option`]), the defaults ([`super::MountConfig::new`]), the
//! mounter's argv ([`super::MountConfig::to_args`]), `s3csi mount --help`
//! ([`super::MountArgs`]) and the options table in docs/configuration.md (checked by a test here) all come
//! from this table.

/// Which option a row describes; [`super::MountConfig`] maps each to its field.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum OptionId {
    EndpointUrl,
    Region,
    ForcePathStyle,
    Prefix,
    ReadOnly,
    Uid,
    Gid,
    FileMode,
    DirMode,
    AllowOther,
    AllowRoot,
    NoDefaultPermissions,
    MetadataTtl,
    MaxEntries,
    MaxKnownVersions,
    PartSize,
    MaxConcurrency,
    MaxPrefetchMemory,
    MaxUploadMemory,
    SyncDelete,
    SyncCreate,
    PageCache,
    CacheDir,
    CacheSize,
    DataCache,
    Passthrough,
    CacheFree,
    CacheMemory,
    WriteBack,
    IgnoreMetadata,
    PosixAcl,
    ContentType,
    Foreground,
    LogFile,
    Debug,
}

/// What an option takes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OptionValue {
    /// Nothing: a switch, off unless given (`--allow-other`; `allow-other=false` in `-o`
    /// lists). No switch defaults to on, so "off" never needs to be written on an argv.
    Switch,
    /// A value, shown as `placeholder` in help and README (`--uid UID`).
    Text {
        placeholder: &'static str,
        default: OptionDefault,
    },
}

/// An option's value when it is not given.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OptionDefault {
    /// Written as a user would write it: [`super::MountConfig::new`] parses it like one.
    Value(&'static str),
    /// No value of its own; what happens instead, in words (shown as is in README, without
    /// the backticks in `--help`).
    Described(&'static str),
}

/// Where an option may be given.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Scope {
    /// A setting of the mount: a flag, an item of a `-o` list or fstab entry, and (CSI) a
    /// PersistentVolume's `mountOptions`.
    Mount,
    /// A setting of the `s3csi mount` process itself (whether it detaches, where it logs):
    /// a flag only. The CSI node service decides these for its mounters.
    Process,
}

/// One row of [`MOUNT_OPTIONS`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OptionSpec {
    pub id: OptionId,
    /// The long flag without `--`, and the name in `-o` lists (where `_` works for `-`).
    pub name: &'static str,
    /// Other names in `-o` lists (mount(8) habits such as `ro`).
    pub aliases: &'static [&'static str],
    /// A name in `-o` lists that turns this switch off (`rw`); any value it has is ignored.
    pub negation: Option<&'static str>,
    pub value: OptionValue,
    /// One line for `--help`.
    pub help: &'static str,
    pub scope: Scope,
}

impl OptionSpec {
    const fn switch(id: OptionId, name: &'static str, help: &'static str) -> Self {
        Self {
            id,
            name,
            aliases: &[],
            negation: None,
            value: OptionValue::Switch,
            help,
            scope: Scope::Mount,
        }
    }

    const fn text(
        id: OptionId,
        name: &'static str,
        placeholder: &'static str,
        default: OptionDefault,
        help: &'static str,
    ) -> Self {
        Self {
            value: OptionValue::Text {
                placeholder,
                default,
            },
            ..Self::switch(id, name, help)
        }
    }

    const fn aliases(self, aliases: &'static [&'static str]) -> Self {
        Self { aliases, ..self }
    }

    const fn negation(self, negation: &'static str) -> Self {
        Self {
            negation: Some(negation),
            ..self
        }
    }

    const fn process_only(self) -> Self {
        Self {
            scope: Scope::Process,
            ..self
        }
    }

    /// The row for `id`.
    pub fn of(id: OptionId) -> &'static OptionSpec {
        MOUNT_OPTIONS
            .iter()
            .find(|s| s.id == id)
            .expect("every option id has a row")
    }

    pub fn takes_value(&self) -> bool {
        matches!(self.value, OptionValue::Text { .. })
    }

    /// May be given in `-o` lists, fstab and a PV's `mountOptions`.
    pub fn is_mount_option(&self) -> bool {
        self.scope == Scope::Mount
    }

    pub fn placeholder(&self) -> Option<&'static str> {
        match self.value {
            OptionValue::Text { placeholder, .. } => Some(placeholder),
            OptionValue::Switch => None,
        }
    }

    /// The `--help` line: the help text and, for options with a value, the default.
    pub fn help_line(&self) -> String {
        match self.value {
            OptionValue::Switch => self.help.to_string(),
            OptionValue::Text {
                default: OptionDefault::Value(v),
                ..
            } => format!("{} [default: {v}]", self.help),
            OptionValue::Text {
                default: OptionDefault::Described(d),
                ..
            } => format!("{} [default: {}]", self.help, d.replace('`', "")),
        }
    }

    /// README's "Option" cell: `` `--uid UID` ``, aliases after it: `` `--read-only` (`ro`) ``.
    pub fn readme_option_cell(&self) -> String {
        let mut cell = match self.placeholder() {
            Some(p) => format!("`--{} {p}`", self.name),
            None => format!("`--{}`", self.name),
        };
        if !self.aliases.is_empty() {
            let names: Vec<String> = self.aliases.iter().map(|a| format!("`{a}`")).collect();
            cell.push_str(&format!(" ({})", names.join(", ")));
        }
        cell
    }

    /// README's "Default" cell: `off`, `` `5s` ``, or the words of a described default.
    pub fn readme_default_cell(&self) -> String {
        match self.value {
            OptionValue::Switch => "off".to_string(),
            OptionValue::Text {
                default: OptionDefault::Value(v),
                ..
            } => format!("`{v}`"),
            OptionValue::Text {
                default: OptionDefault::Described(d),
                ..
            } => d.to_string(),
        }
    }
}

/// A name in an option list, resolved.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Named {
    Option(&'static OptionSpec),
    /// The spec's `negation` (`rw`).
    Negation(&'static OptionSpec),
    /// A generic option mount(8) and fstab pass to every helper; it means nothing here.
    Ignored,
}

/// Resolves an option-list name (already trimmed, `_` turned into `-`) among the mount
/// options: the single allow-list of `-o` lists, fstab, PV `mountOptions` and flags.
pub fn find_mount_option(key: &str) -> Option<Named> {
    if IGNORED_MOUNT8_OPTIONS.contains(&key) {
        return Some(Named::Ignored);
    }
    let spec = MOUNT_OPTIONS
        .iter()
        .filter(|s| s.is_mount_option())
        .find(|s| s.name == key || s.aliases.contains(&key) || s.negation == Some(key))?;
    Some(if spec.negation == Some(key) {
        Named::Negation(spec)
    } else {
        Named::Option(spec)
    })
}

/// Generic options of mount(8) and fstab (`_netdev` arrives as `-netdev`).
const IGNORED_MOUNT8_OPTIONS: &[&str] = &[
    "defaults",
    "auto",
    "noauto",
    "user",
    "nouser",
    "users",
    "-netdev",
    "netdev",
    "nofail",
    "exec",
    "noexec",
    "suid",
    "nosuid",
    "dev",
    "nodev",
    "atime",
    "noatime",
    "relatime",
    "nodiratime",
    "async",
];

use OptionDefault::{Described, Value};
use OptionId as Id;

/// Every option of `s3csi mount`, in the order of `--help` and README.
pub static MOUNT_OPTIONS: &[OptionSpec] = &[
    OptionSpec::text(
        Id::EndpointUrl,
        "endpoint-url",
        "URL",
        Described("AWS"),
        "S3 endpoint, for S3-compatible stores (e.g. http://127.0.0.1:9000)",
    )
    .aliases(&["endpoint"]),
    OptionSpec::text(
        Id::Region,
        "region",
        "REGION",
        Described("env/profile/IMDS, else `us-east-1`"),
        "AWS region",
    ),
    OptionSpec::switch(
        Id::ForcePathStyle,
        "force-path-style",
        "Address the bucket as ENDPOINT/BUCKET instead of BUCKET.ENDPOINT",
    ),
    OptionSpec::text(
        Id::Prefix,
        "prefix",
        "PREFIX",
        Described("none"),
        "Mount only keys under this prefix (same as BUCKET:PREFIX)",
    ),
    OptionSpec::switch(Id::ReadOnly, "read-only", "Refuse every change")
        .aliases(&["ro"])
        .negation("rw"),
    OptionSpec::text(
        Id::Uid,
        "uid",
        "UID",
        Described("mounting user"),
        "Owner of all files",
    ),
    OptionSpec::text(
        Id::Gid,
        "gid",
        "GID",
        Described("mounting user's group"),
        "Group of all files",
    ),
    OptionSpec::text(
        Id::FileMode,
        "file-mode",
        "MODE",
        Value("0644"),
        "Permission bits of files, octal",
    ),
    OptionSpec::text(
        Id::DirMode,
        "dir-mode",
        "MODE",
        Value("0755"),
        "Permission bits of directories, octal",
    ),
    OptionSpec::switch(
        Id::AllowOther,
        "allow-other",
        "Let users other than the mounting one access the mount",
    ),
    OptionSpec::switch(Id::AllowRoot, "allow-root", "Let root access the mount too"),
    OptionSpec::switch(
        Id::NoDefaultPermissions,
        "no-default-permissions",
        "The kernel checks no permissions: whoever reaches the mount (see --allow-other) may \
         read, write, chmod and remove every file whatever its mode and owner; modes and \
         owners are still stored and shown",
    ),
    OptionSpec::text(
        Id::MetadataTtl,
        "metadata-ttl",
        "DURATION",
        Value("5s"),
        "How long metadata from S3 is trusted, e.g. 1s, 500ms, 5m",
    ),
    OptionSpec::text(
        Id::MaxEntries,
        "max-entries",
        "N",
        Value("100000"),
        "Directory entries (inodes) kept in memory, ~0.5 KiB each; past N, the oldest that \
         nothing uses (no open file, not held by the kernel) are dropped and listed again \
         when needed. Listings and lookups stay complete at any directory size",
    ),
    OptionSpec::text(
        Id::MaxKnownVersions,
        "max-known-versions",
        "N",
        Value("1000000"),
        "Object versions whose metadata stays known apart from the inodes (~70 bytes each \
         at most, also kept in --cache-dir), so that listing them again, after a remount \
         too, costs no HEAD; past N, the same 3/4 to all of N (chosen by a hash of the key) stay \
         known, so repeated walks of more versions still skip that many HEADs",
    ),
    OptionSpec::text(
        Id::PartSize,
        "part-size",
        "SIZE",
        Value("8MiB"),
        "Multipart upload part size, 5MiB..5GiB; doubles every 1000 parts",
    ),
    OptionSpec::text(
        Id::MaxConcurrency,
        "max-concurrency",
        "N",
        Value("16"),
        "Maximum parallel S3 requests per open file",
    ),
    OptionSpec::text(
        Id::MaxPrefetchMemory,
        "max-prefetch-memory",
        "SIZE",
        Value("512MiB"),
        "Read-ahead memory shared by all open files",
    ),
    OptionSpec::text(
        Id::MaxUploadMemory,
        "max-upload-memory",
        "SIZE",
        Value("256MiB"),
        "Memory for upload parts in flight, shared by all files being written",
    ),
    OptionSpec::switch(
        Id::SyncDelete,
        "sync-delete",
        "Make every unlink wait until S3 has deleted the object",
    ),
    OptionSpec::switch(
        Id::SyncCreate,
        "sync-create",
        "Make close of a new empty file wait until the object is in S3",
    ),
    OptionSpec::switch(
        Id::PageCache,
        "page-cache",
        "Let the kernel cache file data while a file is open (default: direct I/O, which \
         copies reads and writes once, on Linux 6.6+; see docs/semantics.md)",
    ),
    OptionSpec::text(
        Id::CacheDir,
        "cache-dir",
        "DIR",
        Described("`/var/tmp/s3csi/<hash of the mountpoint>`; CSI: the volume's state directory on the node"),
        "Where files edited in place are staged (and `lost+found` keeps edits that could not be committed), \
         and where the metadata of the object versions read is kept (`known-versions`: a remount of the \
         same directory HEADs no version it has read)",
    )
    .process_only(),
    OptionSpec::text(
        Id::CacheSize,
        "cache-size",
        "SIZE",
        Value("10GiB"),
        "Local disk space files edited in place (and the data cache) may take together; past it, \
         edits get ENOSPC and the data cache gives up its least recently used objects",
    ),
    OptionSpec::switch(
        Id::DataCache,
        "data-cache",
        "Keep the object data read in the cache directory, so that reading it again needs no \
         S3 request (on by default when --cache-dir is given; see docs/semantics.md, \"Data cache\")",
    ),
    OptionSpec::text(
        Id::Passthrough,
        "passthrough",
        "WHEN",
        Value("read-only"),
        "When the kernel reads wholly cached files itself (FUSE passthrough, Linux 6.9+): \
         read-only (on read-only mounts), always (also on writable ones: opening a file for \
         writing while it is read that way gives ETXTBSY), off (through the mounter); see \
         docs/semantics.md, \"Data cache\"",
    ),
    OptionSpec::text(
        Id::CacheFree,
        "cache-free",
        "PERCENT",
        Value("5%"),
        "The data cache gives up objects while its disk has less than this share free",
    ),
    OptionSpec::text(
        Id::CacheMemory,
        "cache-memory",
        "SIZE",
        Value("0"),
        "Keep up to SIZE of what random reads fetched in memory, for every open file to \
         read again (footers, indexes); 0: off",
    ),
    OptionSpec::text(
        Id::WriteBack,
        "write-back",
        "DELAY",
        Described("off: close and fsync return once S3 has the file"),
        "Files edited in place are uploaded DELAY after their last close or fsync, which then \
         return once the edit is on local disk (fsync'd); a crashed mount uploads it when it \
         starts again. Trades durability in S3 for local-disk speed (SQLite, editors), e.g. 0s, 2s",
    ),
    OptionSpec::switch(
        Id::IgnoreMetadata,
        "ignore-metadata",
        "Ignore POSIX metadata stored with objects (s3fs's x-amz-meta-mode/uid/gid/mtime): \
         every file shows --uid/--gid/--file-mode/--dir-mode and chmod, chown, utimes are \
         accepted and forgotten; saves the HEAD per object a listing otherwise costs",
    ),
    OptionSpec::switch(
        Id::PosixAcl,
        "posix-acl",
        "POSIX ACLs (setfacl/getfacl), enforced by the kernel and stored with the xattrs as \
         s3fs stores them; new entries inherit a directory's default ACL. Costs a HEAD for the \
         first permission check of a file whose metadata no stat has loaded yet",
    ),
    OptionSpec::text(
        Id::ContentType,
        "content-type",
        "TYPE",
        Value("infer"),
        "Content-Type of the objects written: infer (from the file name's extension, else \
         application/octet-stream), off (always application/octet-stream) or one MIME type \
         for every file (e.g. text/plain). An existing object keeps its type through edits, \
         chmod/chown/utimes and renames; a rename that changes the extension re-infers it",
    ),
    OptionSpec::switch(
        Id::Foreground,
        "foreground",
        "Stay in the foreground instead of detaching once mounted",
    )
    .process_only(),
    OptionSpec::text(
        Id::LogFile,
        "log-file",
        "PATH",
        Described("stderr (`/dev/null` once detached)"),
        "Write logs here",
    )
    .process_only(),
    OptionSpec::switch(Id::Debug, "debug", "Log every request at debug level"),
];

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashSet;

    #[test]
    fn names_are_unique_and_resolve_to_their_row() {
        let mut seen = HashSet::new();
        for spec in MOUNT_OPTIONS {
            assert_eq!(OptionSpec::of(spec.id), spec);
            for name in [spec.name]
                .iter()
                .chain(spec.aliases)
                .chain(spec.negation.iter())
            {
                assert!(seen.insert(*name), "{name} twice");
                assert!(!IGNORED_MOUNT8_OPTIONS.contains(name), "{name}");
                assert!(
                    !name.contains('_') && !name.contains(',') && !name.contains('='),
                    "{name}"
                );
                let found = find_mount_option(name);
                if spec.is_mount_option() {
                    let expected = if spec.negation == Some(*name) {
                        Named::Negation(spec)
                    } else {
                        Named::Option(spec)
                    };
                    assert_eq!(found, Some(expected), "{name}");
                } else {
                    assert_eq!(found, None, "{name} is a flag only");
                }
            }
            assert!(
                spec.negation.is_none() || !spec.takes_value(),
                "{}: only switches have a negation",
                spec.name
            );
        }
        assert_eq!(find_mount_option("-netdev"), Some(Named::Ignored));
        assert_eq!(find_mount_option("bogus"), None);
    }

    /// The rows of README's options table: (Option cell, Default cell).
    fn readme_rows(readme: &str) -> Vec<(String, String)> {
        let lines = readme
            .lines()
            .skip_while(|l| l.trim() != "| Option | Default | Meaning |")
            .skip(2);
        let mut rows = Vec::new();
        for line in lines.take_while(|l| l.starts_with('|')) {
            let cells: Vec<&str> = line.split('|').map(str::trim).collect();
            assert!(cells.len() >= 4, "README options row {line:?}");
            rows.push((cells[1].to_string(), cells[2].to_string()));
        }
        rows
    }

    #[test]
    fn readme_options_table_matches_the_table() {
        let path = concat!(env!("CARGO_MANIFEST_DIR"), "/docs/configuration.md");
        let readme = std::fs::read_to_string(path).expect("docs/configuration.md");
        let documented = readme_rows(&readme);
        let expected: Vec<(String, String)> = MOUNT_OPTIONS
            .iter()
            .map(|s| (s.readme_option_cell(), s.readme_default_cell()))
            .collect();
        let row = |r: Option<&(String, String)>| match r {
            Some((option, default)) => format!("| {option} | {default} |"),
            None => "(no row)".to_string(),
        };
        for i in 0..documented.len().max(expected.len()) {
            let (found, wanted) = (documented.get(i), expected.get(i));
            assert!(
                found == wanted,
                "docs/configuration.md's options table, row {}: has\n  {}\nwhere config::options::MOUNT_OPTIONS \
                 says\n  {}\n(first two columns, in the table's order)",
                i + 1,
                row(found),
                row(wanted),
            );
        }
    }

    /// README and docs/ link to each other and to files of the repository: every
    /// relative link must name a file that exists.
    #[test]
    fn relative_links_in_readme_and_docs_resolve() {
        let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
        let mut pages = vec![root.join("README.md")];
        for e in std::fs::read_dir(root.join("docs")).expect("docs/") {
            pages.push(e.unwrap().path());
        }
        for page in pages {
            let text = std::fs::read_to_string(&page).unwrap();
            for link in text.split("](").skip(1) {
                let target = link.split(')').next().unwrap_or_default();
                let file = target.split('#').next().unwrap_or_default();
                if file.is_empty() || file.contains("://") || file.contains(' ') {
                    continue;
                }
                let at = page.parent().unwrap().join(file);
                assert!(
                    at.exists(),
                    "{}: link to {target} names no file",
                    page.display()
                );
            }
        }
    }

    /// The chart's comments name mount options, their defaults and pages of docs/: each
    /// option in a `mountOptions` example is one of the table's, with a value it accepts;
    /// each "NAME (default X)" gives the table's default; each `docs/PAGE.md, "Heading"`
    /// names a page and a heading that exist (README once held these and moved).
    #[test]
    fn chart_comments_follow_the_options_table_and_the_docs() {
        let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
        let values = std::fs::read_to_string(root.join("charts/s3csi/values.yaml")).unwrap();
        // The comments as one text: a list or a phrase may continue on the next line.
        let text: String = values
            .lines()
            .filter_map(|l| l.trim_start().strip_prefix('#'))
            .map(|l| l.trim())
            .collect::<Vec<_>>()
            .join(" ");
        let mut examples = 0;
        for (at, _) in text.match_indices("mountOptions") {
            let rest = &text[at..];
            let (Some(open), Some(close)) = (rest.find('['), rest.find(']')) else {
                continue;
            };
            if open > 60 || close < open {
                continue;
            }
            // `-o` list syntax once the YAML quotes are gone (items are trimmed there).
            let list = rest[open + 1..close].replace('"', "");
            let mut cfg = crate::config::MountConfig::new(
                crate::config::BucketSource::new("my-bucket", "").unwrap(),
            );
            cfg.apply_option_list(&list)
                .unwrap_or_else(|e| panic!("values.yaml: mountOptions {list:?}: {e}"));
            examples += 1;
        }
        assert!(
            examples >= 2,
            "values.yaml: {examples} mountOptions examples found"
        );
        for spec in MOUNT_OPTIONS {
            let OptionValue::Text {
                default: OptionDefault::Value(default),
                ..
            } = spec.value
            else {
                continue;
            };
            let phrase = format!("{} (default ", spec.name);
            for (at, _) in text.match_indices(&phrase) {
                let cited = text[at + phrase.len()..].split(')').next().unwrap();
                assert_eq!(cited, default, "values.yaml: {phrase}{cited})");
            }
        }
        for (at, _) in text.match_indices("docs/") {
            let page = text[at..]
                .split(|c: char| !(c.is_alphanumeric() || "/._-".contains(c)))
                .next()
                .unwrap()
                .trim_end_matches('.');
            let doc = std::fs::read_to_string(root.join(page))
                .unwrap_or_else(|e| panic!("values.yaml names {page}: {e}"));
            let after = &text[at + page.len()..];
            if let Some(quoted) = after.strip_prefix(", \"") {
                let heading = quoted.split('"').next().unwrap();
                assert!(
                    doc.lines()
                        .any(|l| l.starts_with('#') && l.trim_start_matches('#').trim() == heading),
                    "values.yaml: {page} has no heading \"{heading}\""
                );
            }
        }
    }
}
