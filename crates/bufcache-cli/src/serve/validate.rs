//! `serve`'s flags checked, before anything is opened: every refusal a start can give without
//! reading a disk (bad values, flags that do not go together, flags with nothing to act on)
//! comes from here, so that it leaves every store as it was.

use std::os::fd::OwnedFd;

use anyhow::{bail, Context};
use bufcache::CacheConfig;
use bufcache_nbd::{ListenAddress, ServerConfig};

use super::{FlushToArg, ServeArgs, DEFAULT_BACKING_FILE};

/// One export the flags name: `--export NAME=BACKEND`, or `--backend` (or the default file)
/// under `--export-name`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) struct ExportSpec {
    pub name: String,
    /// The backend as the user wrote it.
    pub backend: String,
    /// The default backing file, created when missing.
    pub is_default: bool,
}

/// What the flags say, checked: the engine's configuration, the server's, the exports.
pub(super) struct Validated {
    pub config: CacheConfig,
    pub block_size: u32,
    pub server_config: ServerConfig,
    /// The listening sockets systemd passed (socket activation), if it did.
    pub inherited: Option<Vec<OwnedFd>>,
    pub specs: Vec<ExportSpec>,
}

/// Checks every flag and combination of flags, in the order users have seen the refusals
/// in; opens nothing (but takes the sockets systemd passed, and makes --run's private socket
/// directory).
pub(super) fn validate(args: &ServeArgs) -> anyhow::Result<Validated> {
    check_values(args)?;
    let config = args.engine.config()?;
    let block_size = args.engine.block_size_bytes(&config)?;
    // Checked here, before any disk is opened for writing; each export's queue is made later.
    args.engine.queue_config(&config)?;
    let (server_config, inherited) = server_config(args, &config)?;
    let specs = export_specs(args)?;
    check_exports(args, &specs, &server_config)?;
    if let Some(path) = &args.pid_file {
        crate::daemon::check_pid_file(path)?;
    }
    Ok(Validated {
        config,
        block_size,
        server_config,
        inherited,
        specs,
    })
}

/// The flags whose values alone can be wrong.
fn check_values(args: &ServeArgs) -> anyhow::Result<()> {
    if args.standby && args.read_only {
        return Err(crate::UsageError(
            "--standby waits to take the disk over and write it, and -r never writes: for a server that follows the writer read-only, use -r with follow=SECONDS in the URL".into(),
        )
        .into());
    }
    if args.fork {
        return Err(crate::UsageError(
            "--fork: bufcache serve always stays in the foreground; start it from a service \
             manager (docs/operations.md) or with `&`, and use --pid-file to find it"
                .into(),
        )
        .into());
    }
    if !(0.0..=86_400.0).contains(&args.shutdown_timeout) {
        bail!(
            "--shutdown-timeout {} is invalid: must be from 0 to 86400 seconds",
            args.shutdown_timeout
        );
    }
    if let Some(blocks) = args.local_cache_sampled_blocks {
        if blocks > bufcache_tier::config::SAMPLED_BLOCKS_LIMIT {
            bail!(
                "--local-cache-sampled-blocks {blocks} is invalid: must be from 0 to {}",
                bufcache_tier::config::SAMPLED_BLOCKS_LIMIT
            );
        }
    }
    if let Some(seconds) = args.local_cache_stall_max {
        if !(seconds > 0.0 && seconds <= 86_400.0) {
            bail!("--local-cache-stall-max {seconds} is invalid: must be above 0 and at most 86400 seconds");
        }
    }
    for (flag, value) in [
        ("--reconnect-delay-initial", args.reconnect_delay_initial),
        ("--reconnect-delay-max", args.reconnect_delay_max),
        ("--reconnect-give-up", args.reconnect_give_up),
    ] {
        if !(0.0..=86_400.0 * 365.0).contains(&value) {
            bail!("{flag} {value} is invalid: must be from 0 to 31536000 seconds");
        }
    }
    if args.create_size == Some(0) {
        bail!("--create-size 0 is invalid: an export needs at least one byte");
    }
    Ok(())
}

/// The server's configuration: where it listens (the flags, --run's private socket, or the
/// sockets systemd passed, returned apart), its request size, limits and TLS.
fn server_config(
    args: &ServeArgs,
    config: &CacheConfig,
) -> anyhow::Result<(ServerConfig, Option<Vec<OwnedFd>>)> {
    let mut server_config = ServerConfig::default();
    let mut listen = args.listen.clone();
    if args.port.is_some() || args.bind.is_some() {
        let host = match args.bind.as_deref() {
            None => "127.0.0.1".to_string(),
            Some(host) if host.contains(':') && !host.starts_with('[') => format!("[{host}]"),
            Some(host) => host.to_string(),
        };
        listen.push(ListenAddress::Tcp(format!(
            "{host}:{}",
            args.port.unwrap_or(10809)
        )));
    }
    if let Some(path) = &args.unix {
        listen.push(ListenAddress::Unix(path.clone()));
    }
    let inherited = crate::daemon::inherited_sockets()?;
    if inherited.is_some() && !listen.is_empty() {
        bail!("started by systemd socket activation (LISTEN_FDS), which passes the listening sockets: --listen, --port and --unix cannot be used too");
    }
    if args.run.is_some() && listen.is_empty() && inherited.is_none() {
        listen.push(ListenAddress::Unix(crate::daemon::private_socket_path()?));
    }
    if !listen.is_empty() {
        server_config.listen = listen;
    }
    if let Some(size) = args.request_size_max {
        if !(4096..=1 << 30).contains(&size) {
            bail!("--request-size-max {size} is invalid: must be from 4KiB to 1GiB");
        }
        server_config.request_size_max = size as u32;
        server_config.connection_inflight_bytes_max =
            server_config.connection_inflight_bytes_max.max(size);
    }
    args.limits
        .apply(&mut server_config, config.memory_bytes_max);
    args.tls.apply(&mut server_config);
    server_config.validate()?;
    Ok((server_config, inherited))
}

/// The exports the flags name, in order: every `--export`, then `--backend` (or the default
/// file when no export is named at all).
pub(super) fn export_specs(args: &ServeArgs) -> anyhow::Result<Vec<ExportSpec>> {
    let mut specs = Vec::new();
    for export in &args.exports {
        let (name, backend) = export
            .split_once('=')
            .with_context(|| format!("--export `{export}` is not NAME=BACKEND"))?;
        specs.push(ExportSpec {
            name: name.to_string(),
            backend: backend.to_string(),
            is_default: false,
        });
    }
    let name = args.export_name.clone().unwrap_or_default();
    match (&args.backend, specs.is_empty()) {
        (Some(backend), _) => specs.push(ExportSpec {
            name,
            backend: backend.clone(),
            is_default: false,
        }),
        (None, true) => specs.push(ExportSpec {
            name,
            backend: DEFAULT_BACKING_FILE.to_string(),
            is_default: true,
        }),
        (None, false) if args.export_name.is_some() => {
            bail!("--export-name names the --backend export; with only --export NAME=BACKEND, put the name there")
        }
        (None, false) => {}
    }
    Ok(specs)
}

/// True when a backend is a file or block device path (no other backend's prefix).
fn is_file(backend: &str) -> bool {
    ![
        "memory:",
        "nbd://",
        "nbd+unix://",
        "nbds://",
        "nbds+unix://",
        "s3://",
    ]
    .iter()
    .any(|prefix| backend.starts_with(prefix))
}

/// The flags that act on some kind of backend, refused when no export has one; the flags
/// of --standby, --local-cache and the per-export policies.
fn check_exports(
    args: &ServeArgs,
    specs: &[ExportSpec],
    server_config: &ServerConfig,
) -> anyhow::Result<()> {
    if args.standby_warm_bytes_max.is_some() && !args.standby {
        return Err(crate::UsageError(
            "--standby-warm-bytes-max bounds what a --standby server reads into its cache while it waits, and --standby is not given".into(),
        )
        .into());
    }
    if args.standby {
        if let Some(spec) = specs.iter().find(|spec| !spec.backend.starts_with("s3://")) {
            return Err(crate::UsageError(format!("--standby takes over an S3 log-layout disk when its writer's lease lapses, and backend `{}` is not an s3:// disk", spec.backend)).into());
        }
    }
    if args.file_io_threads > 0 && args.file_io_uring_depth > 0 {
        bail!(
            "--file-io-threads and --file-io-uring-depth are two ways to do a file's requests; \
             give one of them"
        );
    }
    if !specs.iter().any(|spec| is_file(&spec.backend)) {
        check_file_flags_without_files(args, specs)?;
    }
    check_local_cache_flags(args, specs)?;
    // Everything that can refuse the start without writing to a disk is checked, and every
    // listen address bound (they listen only once the exports are ready, so a client or a
    // readiness probe that connects is served), before the first disk is written to:
    // opening an S3 disk for writing takes its lock and raises its generation, so a start
    // refused after that (another export that does not open, an address in use) would
    // leave the store changed and the disk's rescue file stale.
    for (policy_export, _) in &server_config.export_policies {
        if !specs.iter().any(|spec| spec.name == *policy_export) {
            clap::Error::raw(
                clap::error::ErrorKind::ValueValidation,
                format!(
                    "--export-identity / --export-read-only name {policy_export:?}, which is not an export\n"
                ),
            )
            .exit();
        }
    }
    Ok(())
}

/// Refuses the flags that act on backing files when no backend is a file.
fn check_file_flags_without_files(args: &ServeArgs, specs: &[ExportSpec]) -> anyhow::Result<()> {
    if args.direct {
        bail!("--direct opens backing files with O_DIRECT, and no backend is a file");
    }
    if args.create_size.is_some() && !specs.iter().any(|spec| spec.backend.starts_with("s3://")) {
        bail!("--create-size creates a backing file or S3 disk, and no backend is either");
    }
    if args.file_io_threads > 0 {
        bail!("--file-io-threads gives backing files worker threads, and no backend is a file");
    }
    if args.file_io_uring_depth > 0 {
        bail!("--file-io-uring-depth gives backing files an io_uring, and no backend is a file");
    }
    Ok(())
}

/// Refuses the --local-cache flags without a --local-cache, a local cache shared by several
/// exports, and one with --control.
fn check_local_cache_flags(args: &ServeArgs, specs: &[ExportSpec]) -> anyhow::Result<()> {
    if args.local_cache.is_none() {
        if args.local_cache_size.is_some() {
            bail!("--local-cache-size sizes the --local-cache file, and no --local-cache is given");
        }
        if args.flush_to == Some(FlushToArg::Local) {
            bail!("--flush-to local needs a --local-cache to flush to");
        }
        if args.local_cache_stall_max.is_some() {
            bail!("--local-cache-stall-max bounds waits of a --local-cache, and no --local-cache is given");
        }
        if args.local_cache_replay_prefix {
            bail!("--local-cache-replay-prefix replays a damaged --local-cache, and no --local-cache is given");
        }
    } else if specs.len() != 1 {
        bail!("--local-cache belongs to one backend, and {} exports are given: serve one export per local cache", specs.len());
    } else if args.control.is_some() {
        bail!("--control takes snapshots of a disk as its store has it, and with --local-cache acknowledged writes may be only in the local cache: serve without one to take snapshots");
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    /// `bufcache serve` parsed from `flags`.
    fn serve_args(flags: &[&str]) -> ServeArgs {
        let arguments = ["bufcache", "serve"].iter().chain(flags);
        match crate::Cli::try_parse_from(arguments)
            .expect("clap accepts the flags")
            .command
        {
            crate::Command::Serve(args) => *args,
            _ => unreachable!("a serve command"),
        }
    }

    fn refusal(flags: &[&str]) -> String {
        match validate(&serve_args(flags)) {
            Ok(_) => panic!("{flags:?} was accepted"),
            Err(error) => error.to_string(),
        }
    }

    #[test]
    fn combinations_that_cannot_work_are_refused_with_the_messages_users_know() {
        // Goal: the refusals a start gives for flags that do not go together are worded as
        // they have always been (users and tests grep them), and come before anything is
        // opened. Method: each bad combination validated alone, its message compared whole.
        for (flags, expected) in [
            (
                &["--backend", "memory:1G", "--direct"][..],
                "--direct opens backing files with O_DIRECT, and no backend is a file",
            ),
            (
                &["--backend", "memory:1G", "--create-size", "1G"],
                "--create-size creates a backing file or S3 disk, and no backend is either",
            ),
            (
                &["--file-io-threads", "2", "--file-io-uring-depth", "8"],
                "--file-io-threads and --file-io-uring-depth are two ways to do a file's \
                 requests; give one of them",
            ),
            (
                &[
                    "--export",
                    "a=x.img",
                    "--export",
                    "b=y.img",
                    "--local-cache",
                    "l",
                ],
                "--local-cache belongs to one backend, and 2 exports are given: serve one \
                 export per local cache",
            ),
            (
                &["--local-cache-size", "1G"],
                "--local-cache-size sizes the --local-cache file, and no --local-cache is given",
            ),
            (
                &["--local-cache", "l", "--control", "c.sock"],
                "--control takes snapshots of a disk as its store has it, and with \
                 --local-cache acknowledged writes may be only in the local cache: serve \
                 without one to take snapshots",
            ),
            (
                &["--flush-to", "local"],
                "--flush-to local needs a --local-cache to flush to",
            ),
            (
                &["--export", "a=x.img", "--export-name", "b"],
                "--export-name names the --backend export; with only --export NAME=BACKEND, \
                 put the name there",
            ),
            (
                &["--export", "x.img"],
                "--export `x.img` is not NAME=BACKEND",
            ),
            (
                &["--standby", "--backend", "disk.img"],
                "--standby takes over an S3 log-layout disk when its writer's lease lapses, \
                 and backend `disk.img` is not an s3:// disk",
            ),
            (
                &["--shutdown-timeout", "90000"],
                "--shutdown-timeout 90000 is invalid: must be from 0 to 86400 seconds",
            ),
            (
                &["--create-size", "0"],
                "--create-size 0 is invalid: an export needs at least one byte",
            ),
            (
                &["--request-size-max", "1K"],
                "--request-size-max 1024 is invalid: must be from 4KiB to 1GiB",
            ),
        ] {
            assert_eq!(refusal(flags), expected, "{flags:?}");
        }
    }

    #[test]
    fn exports_are_named_in_order_with_the_backend_last_and_the_default_file_alone() {
        // Goal: the exports keep their order (an export's index names it in traces and
        // metrics): every --export, then --backend under --export-name; the default file
        // only when nothing is named. Method: the specs of three spellings.
        let specs = export_specs(&serve_args(&[
            "--export",
            "a=memory:1M",
            "--backend",
            "memory:2M",
            "--export-name",
            "b",
        ]))
        .unwrap();
        let names: Vec<(&str, &str, bool)> = specs
            .iter()
            .map(|spec| (spec.name.as_str(), spec.backend.as_str(), spec.is_default))
            .collect();
        assert_eq!(
            names,
            [("a", "memory:1M", false), ("b", "memory:2M", false)]
        );
        let specs = export_specs(&serve_args(&[])).unwrap();
        assert_eq!(
            specs,
            [ExportSpec {
                name: String::new(),
                backend: DEFAULT_BACKING_FILE.to_string(),
                is_default: true,
            }]
        );
        assert!(is_file("disk.img") && is_file("/dev/sdb"));
        assert!(!is_file("memory:1G") && !is_file("s3://b/p") && !is_file("nbd://h/e"));
    }
}
