use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(
    name = "s3csi",
    version,
    about = "S3 buckets as file systems: standalone FUSE mount and Kubernetes CSI driver"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

// One value, parsed once at start: the sizes of its variants do not matter.
#[allow(clippy::large_enum_variant)]
#[derive(Subcommand)]
enum Command {
    /// Mount a bucket (or a prefix of it) on a directory.
    Mount(s3csi::config::MountArgs),
    /// Serve the Kubernetes CSI driver on a unix socket.
    Csi(s3csi::csi::CsiArgs),
    /// Try the driver end to end on this machine: embedded S3, CSI services, a mounted volume.
    Demo(s3csi::demo::DemoArgs),
    /// Serve a directory as a small S3-compatible server (demos, tests, local development).
    S3Server(s3csi::s3server::S3ServerArgs),
}

fn main() {
    // Installed as /sbin/mount.s3csi, mount(8) runs us as `mount.s3csi SOURCE DIR -o ...`.
    let mut args: Vec<std::ffi::OsString> = std::env::args_os().collect();
    let invoked_as_helper = args
        .first()
        .and_then(|a| std::path::Path::new(a).file_name())
        .is_some_and(|n| n == "mount.s3csi");
    if invoked_as_helper {
        args.insert(1, "mount".into());
    }
    let cli = Cli::parse_from(args);
    let code = match cli.command {
        Command::Mount(args) => s3csi::cmd::mount::run_mount_command(args),
        Command::Csi(args) => s3csi::csi::run(args),
        Command::Demo(args) => s3csi::demo::run(args),
        Command::S3Server(args) => s3csi::s3server::run_command(args),
    };
    std::process::exit(code);
}
