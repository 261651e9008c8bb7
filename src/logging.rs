//! Log setup shared by every subcommand: plain text on stderr, `RUST_LOG` overrides.

/// Installs the global subscriber with `default_filter` (e.g. `info`) unless `RUST_LOG`
/// is set. A second call is a no-op.
pub fn init(default_filter: &str) {
    use tracing_subscriber::EnvFilter;
    let filter =
        EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new(default_filter));
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(false)
        .try_init();
}
