//! `--content-type`: which Content-Type the objects written through the mount get.
//!
//! A new object gets the type its name says ([`ContentTypes::for_key`]); an existing
//! object keeps the type it has through edits, metadata copies (chmod, chown, utimes,
//! xattrs) and renames, and is given its new name's type when a rename changes the
//! extension ([`ContentTypes::on_rename`]), as s3fs does.

use std::fmt;

/// What `application/octet-stream` means to every S3 client: bytes of unknown kind.
pub const OCTET_STREAM: &str = "application/octet-stream";
/// The type s3fs (and rclone) give directory markers (`dir/`).
pub const DIRECTORY: &str = "application/x-directory";

/// The value of `--content-type`.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub enum ContentTypes {
    /// From the file name's extension (the `mime_guess` table), else
    /// `application/octet-stream`; directory markers `application/x-directory`.
    #[default]
    Infer,
    /// Always `application/octet-stream` (what every object got before the option).
    Off,
    /// This MIME type for every file written (directory markers keep
    /// `application/x-directory`).
    Fixed(String),
}

impl ContentTypes {
    /// `infer`, `off` or a MIME type (`type/subtype`, optionally `;param=value`, no spaces
    /// or commas: it travels in `-o` lists).
    pub fn parse(text: &str) -> Result<Self, String> {
        match text {
            "infer" => Ok(Self::Infer),
            "off" => Ok(Self::Off),
            t if is_mime_type(t) => Ok(Self::Fixed(t.to_string())),
            t => Err(format!(
                "expected infer, off or a MIME type such as text/plain, got {t:?}"
            )),
        }
    }

    /// The type a new object at `key` gets.
    pub fn for_key(&self, key: &str) -> String {
        if key.ends_with('/') {
            return match self {
                Self::Off => OCTET_STREAM,
                Self::Infer | Self::Fixed(_) => DIRECTORY,
            }
            .to_string();
        }
        match self {
            Self::Infer => {
                let name = key.rsplit('/').next().unwrap_or(key);
                mime_guess::from_path(name)
                    .first_raw()
                    .unwrap_or(OCTET_STREAM)
                    .to_string()
            }
            Self::Off => OCTET_STREAM.to_string(),
            Self::Fixed(t) => t.clone(),
        }
    }

    /// The type a file renamed from `from` to `to` must be given, or `None` to keep the
    /// one it has: a rename that changes the extension (compared without regard to case)
    /// re-infers it, as s3fs does; with `off` the type is always kept.
    pub fn on_rename(&self, from: &str, to: &str) -> Option<String> {
        if matches!(self, Self::Off) || extension(from) == extension(to) {
            return None;
        }
        Some(self.for_key(to))
    }
}

impl fmt::Display for ContentTypes {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Infer => f.write_str("infer"),
            Self::Off => f.write_str("off"),
            Self::Fixed(t) => f.write_str(t),
        }
    }
}

/// The extension of the last component of `key`, lower-case (`None`: it has none, or is a
/// dot file such as `.bashrc`).
fn extension(key: &str) -> Option<String> {
    let name = key.rsplit('/').next().unwrap_or(key);
    std::path::Path::new(name)
        .extension()
        .map(|e| e.to_string_lossy().to_ascii_lowercase())
}

/// `type/subtype[;param=value...]` in printable ASCII without spaces or commas.
fn is_mime_type(t: &str) -> bool {
    let essence = t.split(';').next().unwrap_or("");
    let token = |s: &str| {
        !s.is_empty()
            && s.bytes()
                .all(|b| b.is_ascii_alphanumeric() || b"!#$&^_.+-".contains(&b))
    };
    let printable = t
        .bytes()
        .all(|b| b.is_ascii_graphic() && b != b',' && b != b'"' && b != b'\\');
    printable && matches!(essence.split_once('/'), Some((a, b)) if token(a) && token(b))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn modes_parse_and_print_back() {
        for text in [
            "infer",
            "off",
            "text/plain",
            "application/vnd.x+json;charset=utf-8",
        ] {
            let m = ContentTypes::parse(text).unwrap();
            assert_eq!(m.to_string(), text);
        }
        assert_eq!(ContentTypes::parse("infer"), Ok(ContentTypes::Infer));
        for bad in [
            "",
            "on",
            "text",
            "text/",
            "/plain",
            "text/plain,x",
            "a b/c",
            "tëxt/x",
        ] {
            let err = ContentTypes::parse(bad).unwrap_err();
            assert!(err.contains("MIME type"), "{bad}: {err}");
        }
    }

    #[test]
    fn types_come_from_the_name() {
        let infer = ContentTypes::Infer;
        assert_eq!(infer.for_key("d/a.html"), "text/html");
        assert_eq!(infer.for_key("b.JSON"), "application/json");
        assert_eq!(infer.for_key("d.x/c"), OCTET_STREAM);
        assert_eq!(infer.for_key("d/.bashrc"), OCTET_STREAM);
        assert_eq!(infer.for_key("d/"), DIRECTORY);
        assert_eq!(ContentTypes::Off.for_key("a.html"), OCTET_STREAM);
        let fixed = ContentTypes::Fixed("x/y".into());
        assert_eq!(fixed.for_key("a.html"), "x/y");
        assert_eq!(fixed.for_key("d/"), DIRECTORY);
    }

    #[test]
    fn renames_re_infer_only_when_the_extension_changes() {
        let infer = ContentTypes::Infer;
        assert_eq!(
            infer.on_rename("a.html", "d/a.txt").as_deref(),
            Some("text/plain")
        );
        assert_eq!(infer.on_rename("a.html", "b.HTML"), None);
        assert_eq!(infer.on_rename("d.x/a", "e.y/b"), None);
        assert_eq!(
            infer.on_rename("a", "a.json").as_deref(),
            Some("application/json")
        );
        assert_eq!(
            infer.on_rename("a.json", "a").as_deref(),
            Some(OCTET_STREAM)
        );
        assert_eq!(ContentTypes::Off.on_rename("a.html", "a.txt"), None);
    }
}
