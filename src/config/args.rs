//! The `s3csi mount` command line: flags, `-o` lists and mount(8)'s helper conventions,
//! turned into one [`MountConfig`].
//!
//! The flags are built from [`MOUNT_OPTIONS`] with clap's builder API (the derive would
//! need every option written again as a struct field, with its name, help and default),
//! so a row of the table is a flag, with its real default in `--help`.

use super::options::{OptionId, OptionSpec, MOUNT_OPTIONS};
use super::{BucketSource, MountConfig, MountOptionError};
use clap::{Arg, ArgAction, ArgMatches, Command, FromArgMatches};
use std::path::PathBuf;

/// What `s3csi mount` was given; [`MountArgs::to_config`] parses the mount's part of it.
#[derive(Debug, Clone)]
pub struct MountArgs {
    /// `BUCKET` or `BUCKET:PREFIX`.
    pub source: String,
    pub mountpoint: PathBuf,
    pub foreground: bool,
    pub log_file: Option<PathBuf>,
    /// Where staged files live (`--cache-dir`); `None`: the default (see `cmd::mount`).
    pub cache_dir: Option<PathBuf>,
    /// (CSI node service only) serve the descriptor handed over in this directory.
    pub handoff_dir: Option<PathBuf>,
    /// (CSI node service only) with `handoff_dir`: take over from a mounter that died.
    pub recover: bool,
    /// The `-o` lists, in order.
    pub option_lists: Vec<String>,
    /// Mount options given as flags, with their values (`None` for a switch).
    flags: Vec<(&'static OptionSpec, Option<String>)>,
}

const SOURCE: &str = "source";
const MOUNTPOINT: &str = "mountpoint";
const OPTION_LISTS: &str = "options";
const HANDOFF_DIR: &str = "handoff-dir";
const RECOVER: &str = "recover";

const MOUNT_HELP: &str = "\
Credentials come only from the AWS SDK default chain: AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY,
AWS_PROFILE, web identity (IRSA), container credentials (EKS Pod Identity), or the instance
profile. They are never accepted on the command line.

As a mount(8) helper (install the binary as /sbin/mount.s3csi):
  mount -t s3csi my-bucket:some/prefix /mnt/data -o allow-other,uid=1000
  fstab: my-bucket /mnt/data s3csi _netdev,allow-other,region=eu-west-1 0 0";

fn flag_of(spec: &'static OptionSpec) -> Arg {
    let arg = Arg::new(spec.name).long(spec.name).help(spec.help_line());
    match spec.placeholder() {
        Some(placeholder) => {
            let arg = arg.value_name(placeholder).action(ArgAction::Set);
            if matches!(spec.id, OptionId::LogFile | OptionId::CacheDir) {
                arg.value_parser(clap::value_parser!(PathBuf))
            } else {
                // Parsed by `MountConfig::apply_option`, after the `-o` lists.
                arg.value_parser(clap::value_parser!(String))
            }
        }
        None => arg.action(ArgAction::SetTrue),
    }
}

/// mount(8) passes these to every helper; they mean nothing here.
fn ignored_mount8_flag(short: char, id: &'static str) -> Arg {
    Arg::new(id)
        .short(short)
        .action(ArgAction::SetTrue)
        .hide(true)
        .help("Ignored; mount(8) passes it to helpers")
}

impl clap::Args for MountArgs {
    fn augment_args(cmd: Command) -> Command {
        let cmd = cmd
            .about("Mount an S3 bucket (or a prefix of it) on a directory")
            .after_help(MOUNT_HELP)
            .arg(
                Arg::new(SOURCE)
                    .required(true)
                    .value_name("SOURCE")
                    .help("BUCKET or BUCKET:PREFIX"),
            )
            .arg(
                Arg::new(MOUNTPOINT)
                    .required(true)
                    .value_name("MOUNTPOINT")
                    .value_parser(clap::value_parser!(PathBuf))
                    .help("Existing empty directory to mount on"),
            );
        let cmd = MOUNT_OPTIONS
            .iter()
            .fold(cmd, |cmd, spec| cmd.arg(flag_of(spec)));
        cmd.arg(
            Arg::new(OPTION_LISTS)
                .short('o')
                .value_name("OPTS")
                .action(ArgAction::Append)
                .help(
                    "Options as mount(8) passes them: name[=value],... (same names as the flags)",
                ),
        )
        .arg(ignored_mount8_flag('n', "no-mtab"))
        .arg(ignored_mount8_flag('s', "sloppy"))
        .arg(ignored_mount8_flag('v', "verbose"))
        .arg(
            Arg::new(HANDOFF_DIR)
                .long(HANDOFF_DIR)
                .value_name("DIR")
                .value_parser(clap::value_parser!(PathBuf))
                .hide(true)
                .help(
                    "(CSI node service only) do not mount: serve the /dev/fuse descriptor the \
                     node service hands over on DIR/control.sock, and keep crash-recovery state \
                     in DIR",
                ),
        )
        .arg(
            Arg::new(RECOVER)
                .long(RECOVER)
                .action(ArgAction::SetTrue)
                .requires(HANDOFF_DIR)
                .hide(true)
                .help("(CSI node service only) with --handoff-dir: take over from a mounter that died"),
        )
    }

    fn augment_args_for_update(cmd: Command) -> Command {
        Self::augment_args(cmd)
    }
}

impl FromArgMatches for MountArgs {
    fn from_arg_matches(m: &ArgMatches) -> Result<Self, clap::Error> {
        let process_flag = |id: OptionId| OptionSpec::of(id).name;
        let flags = MOUNT_OPTIONS
            .iter()
            .filter(|spec| spec.is_mount_option())
            .filter_map(|spec| {
                if spec.takes_value() {
                    let value = m.get_one::<String>(spec.name)?;
                    Some((spec, Some(value.clone())))
                } else {
                    m.get_flag(spec.name).then_some((spec, None))
                }
            })
            .collect();
        Ok(Self {
            source: m.get_one::<String>(SOURCE).cloned().unwrap_or_default(),
            mountpoint: m
                .get_one::<PathBuf>(MOUNTPOINT)
                .cloned()
                .unwrap_or_default(),
            foreground: m.get_flag(process_flag(OptionId::Foreground)),
            log_file: m
                .get_one::<PathBuf>(process_flag(OptionId::LogFile))
                .cloned(),
            cache_dir: m
                .get_one::<PathBuf>(process_flag(OptionId::CacheDir))
                .cloned(),
            handoff_dir: m.get_one::<PathBuf>(HANDOFF_DIR).cloned(),
            recover: m.get_flag(RECOVER),
            option_lists: m
                .get_many::<String>(OPTION_LISTS)
                .map(|lists| lists.cloned().collect())
                .unwrap_or_default(),
            flags,
        })
    }

    fn update_from_arg_matches(&mut self, m: &ArgMatches) -> Result<(), clap::Error> {
        *self = Self::from_arg_matches(m)?;
        Ok(())
    }
}

impl MountArgs {
    /// Turns the command line into a validated [`MountConfig`]. `-o` options apply first,
    /// explicit flags override them.
    pub fn to_config(&self) -> Result<MountConfig, MountOptionError> {
        let mut cfg = MountConfig::new(BucketSource::parse(&self.source)?);
        for list in &self.option_lists {
            cfg.apply_option_list(list)?;
        }
        for (spec, value) in &self.flags {
            cfg.apply_option(spec.name, value.as_deref())?;
        }
        Ok(cfg)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::options::OptionValue;
    use clap::Parser;
    use std::time::Duration;

    #[derive(Parser, Debug)]
    struct Cli {
        #[command(flatten)]
        mount: MountArgs,
    }

    /// `s3csi mount ARGS SOURCE /mnt/x` as the mounter parses it; clap must accept it.
    fn parse(args: &[String], source: &str) -> Result<MountConfig, MountOptionError> {
        let mut argv = vec!["s3csi".to_string()];
        argv.extend(args.iter().cloned());
        argv.extend([source.to_string(), "/mnt/x".to_string()]);
        let cli = Cli::try_parse_from(&argv).unwrap_or_else(|e| panic!("{argv:?}: {e}"));
        cli.mount.to_config()
    }

    #[test]
    fn help_lists_every_option_with_its_default() {
        let help = <Cli as clap::CommandFactory>::command()
            .render_help()
            .to_string();
        for spec in MOUNT_OPTIONS {
            let line = help
                .lines()
                .find(|l| l.trim_start().starts_with(&format!("--{} ", spec.name)))
                .unwrap_or_else(|| panic!("--{} missing from\n{help}", spec.name));
            assert!(line.contains(&spec.help_line()), "{line}");
            if let OptionValue::Text { placeholder, .. } = spec.value {
                assert!(line.contains(&format!("<{placeholder}>")), "{line}");
                assert!(line.contains("[default: "), "{line}");
            }
        }
        assert!(help.contains("--metadata-ttl <DURATION>"), "{help}");
        assert!(help.contains("[default: 5s]"), "{help}");
        assert!(!help.contains("handoff"), "{help}");
    }

    #[test]
    fn flags_override_option_lists() {
        let args: Vec<String> = ["-o", "uid=7,ro", "--uid", "8", "-o", "gid=9", "-n"]
            .iter()
            .map(|s| s.to_string())
            .collect();
        let c = parse(&args, "bkt:p").unwrap();
        assert_eq!((c.uid, c.gid, c.read_only), (8, 9, true));
        assert_eq!(c.source.prefix, "p/");
        let err = parse(&["--uid=x".to_string()], "bkt")
            .unwrap_err()
            .to_string();
        assert!(err.contains("mount option \"uid\""), "{err}");
        // Process flags are flags only.
        assert!(parse(&["--foreground".to_string()], "bkt").is_ok());
        let err = parse(&["-o".to_string(), "foreground".to_string()], "bkt")
            .unwrap_err()
            .to_string();
        assert!(err.contains("unknown mount option \"foreground\""), "{err}");
    }

    /// Tiny deterministic generator: the property below needs variety, not quality.
    struct Rng(u64);

    impl Rng {
        fn below(&mut self, n: u64) -> u64 {
            self.0 ^= self.0 << 13;
            self.0 ^= self.0 >> 7;
            self.0 ^= self.0 << 17;
            self.0 % n.max(1)
        }

        fn chance(&mut self) -> bool {
            self.below(2) == 0
        }

        fn pick<'a>(&mut self, items: &[&'a str]) -> &'a str {
            items[self.below(items.len() as u64) as usize]
        }
    }

    /// A random valid configuration, by fields (not through the parser it checks).
    fn random_config(rng: &mut Rng) -> MountConfig {
        let prefix = rng.pick(&["", "p", "a/b", "x y,z=1", "-dash", "日本"]);
        let mut c = MountConfig::new(BucketSource::new("bkt", prefix).unwrap());
        if rng.chance() {
            c.endpoint.endpoint_url = Some(
                rng.pick(&["http://127.0.0.1:9000", "https://s3.example/a?b=c"])
                    .into(),
            );
        }
        if rng.chance() {
            c.endpoint.region = Some(rng.pick(&["eu-west-1", "us-east-1", "x"]).into());
        }
        c.endpoint.force_path_style = rng.chance();
        c.read_only = rng.chance();
        c.allow_other = rng.chance();
        c.allow_root = rng.chance();
        c.no_default_permissions = rng.chance();
        c.sync_create = rng.chance();
        c.sync_delete = rng.chance();
        c.page_cache = rng.chance();
        c.ignore_metadata = rng.chance();
        c.posix_acl = rng.chance();
        c.content_type = crate::config::content_type::ContentTypes::parse(rng.pick(&[
            "infer",
            "off",
            "text/plain",
            "application/vnd.x+json;charset=utf-8",
        ]))
        .expect("valid");
        c.debug = rng.chance();
        if rng.chance() {
            c.uid = rng.below(u32::MAX as u64) as u32;
            c.gid = rng.below(u32::MAX as u64) as u32;
        }
        if rng.chance() {
            c.file_mode = rng.below(0o1000) as u16;
            c.dir_mode = rng.below(0o1000) as u16;
        }
        if rng.chance() {
            c.metadata_ttl = match rng.below(3) {
                0 => Duration::from_secs(rng.below(86_400 * 365)),
                1 => Duration::from_millis(rng.below(100_000)),
                _ => Duration::from_nanos(rng.below(86_400 * 365 * 1_000_000_000)),
            };
        }
        if rng.chance() {
            c.write_back = Some(Duration::from_millis(rng.below(100_000)));
        }
        let mib = crate::config::units::MIB;
        if rng.chance() {
            c.part_size = 5 * mib + rng.below(5 * 1024 * mib - 5 * mib + 1);
        }
        if rng.chance() {
            c.max_concurrency = 1 + rng.below(256) as usize;
        }
        if rng.chance() {
            c.max_known_versions = 1000 + rng.below(1 << 32) as usize;
        }
        if rng.chance() {
            c.max_prefetch_memory = 8 * mib + rng.below(u64::MAX - 8 * mib);
            c.max_upload_memory = 8 * mib + rng.below(1 << 40);
        }
        c
    }

    #[test]
    fn the_mounter_argv_parses_back_to_the_same_config() {
        let mut rng = Rng(0x5eed_1234_abcd_9876);
        for case in 0..5_000 {
            let c = random_config(&mut rng);
            let args = c.to_args();
            let back = parse(&args, &c.source.to_string())
                .unwrap_or_else(|e| panic!("case {case}: {args:?}: {e}"));
            assert_eq!(back, c, "case {case}: {args:?}");
        }
    }
}
