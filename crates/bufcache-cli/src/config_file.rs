//! Configuration files: `bufcache serve --config FILE` reads flags from TOML.
//!
//! Every key is a long flag of `serve` (kebab-case or snake_case): `cache-size = "1G"`,
//! `listen = ["tcp:0.0.0.0:10809", "unix:/run/bufcache.sock"]`, `read-only = true`. The file's
//! flags are placed before the command line's, and a key also given on the command line (long
//! or short form) is dropped from the file's, so the command line wins, a list replacing the
//! file's whole list. Where to listen is one setting: any of `--listen`, `-p`, `-b`, `-U`/`-k`
//! on the command line drops all of the file's `listen`, `port`, `bind` and `unix`.
//! Unknown keys and values of the wrong type are errors naming the file, the line and the key.
//! `bufcache config --print-default` prints every key with its default, commented out.

use std::ffi::OsString;
use std::path::Path;

use anyhow::{bail, Context};
use bufcache::{format_size, CacheConfig};
use clap::{ArgAction, Command};

/// Keys that are not flags to read from a file.
const NOT_CONFIGURABLE: [&str; 5] = ["help", "config", "version", "run", "fork"];

/// The keys that together say where the server listens: any one of them on the command line
/// replaces all of them in the file, so `--listen unix:PATH` never also opens the file's port.
const LISTEN_KEYS: [&str; 4] = ["listen", "port", "bind", "unix"];

/// Replaces `--config FILE` after the `serve` subcommand by the flags the file holds.
pub fn expand(arguments: Vec<OsString>, command: &Command) -> anyhow::Result<Vec<OsString>> {
    let Some(serve_index) = arguments.iter().position(|argument| argument == "serve") else {
        return Ok(arguments);
    };
    let mut rest = arguments[serve_index + 1..].to_vec();
    let Some(config_index) = rest
        .iter()
        .position(|a| a == "--config" || a.to_string_lossy().starts_with("--config="))
    else {
        return Ok(arguments);
    };
    let flag = rest.remove(config_index).to_string_lossy().to_string();
    let path = match flag.strip_prefix("--config=") {
        Some(path) => path.to_string(),
        None if config_index < rest.len() => {
            rest.remove(config_index).to_string_lossy().to_string()
        }
        None => bail!("--config needs a FILE"),
    };
    let serve = command
        .find_subcommand("serve")
        .context("serve subcommand")?;
    let mut given = flags_given(&rest, serve);
    if given
        .iter()
        .any(|name| LISTEN_KEYS.contains(&name.as_str()))
    {
        given.extend(LISTEN_KEYS.iter().map(|key| key.to_string()));
    }
    let from_file: Vec<OsString> = flags_from_file(Path::new(&path), serve)?
        .into_iter()
        .filter(|(name, _)| !given.contains(name) && !given.contains(&negation(name)))
        .flat_map(|(_, flags)| flags)
        .collect();
    let mut expanded = arguments[..=serve_index].to_vec();
    expanded.extend(from_file);
    expanded.extend(rest);
    Ok(expanded)
}

/// The flag saying the opposite of `name` (`no-prefault` for `prefault` and back): the command
/// line's one overrides the file's too.
fn negation(name: &str) -> String {
    match name.strip_prefix("no-") {
        Some(positive) => positive.to_string(),
        None => format!("no-{name}"),
    }
}

/// Long names of the flags on the command line (short ones mapped to their long name): the
/// file's value of each is dropped, so the command line overrides it, a list included.
fn flags_given(arguments: &[OsString], serve: &Command) -> Vec<String> {
    let mut names = Vec::new();
    for argument in arguments {
        let argument = argument.to_string_lossy();
        if argument == "--" {
            break;
        }
        if let Some(long) = argument.strip_prefix("--") {
            let name = long.split('=').next().unwrap_or_default();
            // An alias (`--socket`) stands for its flag's long name (`unix`).
            let canonical = serve
                .get_arguments()
                .find(|a| {
                    a.get_long() == Some(name)
                        || a.get_all_aliases().is_some_and(|all| all.contains(&name))
                })
                .and_then(|a| a.get_long())
                .unwrap_or(name);
            names.push(canonical.to_string());
        } else if let Some(short) = argument.strip_prefix('-') {
            // A cluster like -rv names several short flags; aliases (-k) count as their flag.
            for letter in short.chars() {
                if let Some(long) = serve
                    .get_arguments()
                    .find(|a| {
                        a.get_short() == Some(letter)
                            || a.get_all_short_aliases()
                                .is_some_and(|all| all.contains(&letter))
                    })
                    .and_then(|a| a.get_long())
                {
                    names.push(long.to_string());
                }
            }
        }
    }
    names
}

/// Each key of the file as (flag name, the flags it stands for).
fn flags_from_file(path: &Path, serve: &Command) -> anyhow::Result<Vec<(String, Vec<OsString>)>> {
    let text = std::fs::read_to_string(path)
        .with_context(|| format!("cannot read config file {}", path.display()))?;
    let table: toml::Table = text
        .parse()
        .map_err(|error| anyhow::anyhow!("{}: {error}", path.display()))?;
    let mut keys = Vec::new();
    for (key, value) in &table {
        let mut flags = Vec::new();
        let name = key.replace('_', "-");
        let line = line_of(&text, key);
        let where_ = format!("{}:{line}: key `{key}`", path.display());
        let Some(argument) = serve.get_arguments().find(|a| {
            a.get_long() == Some(name.as_str()) && !NOT_CONFIGURABLE.contains(&name.as_str())
        }) else {
            bail!("{where_} is not a serve option (see `bufcache config --print-default`)");
        };
        let is_switch = matches!(argument.get_action(), ArgAction::SetTrue | ArgAction::Count);
        let repeatable = matches!(argument.get_action(), ArgAction::Append);
        // An option whose value may be left out (`--prefault` or `--prefault=WHEN`).
        let value_optional = argument
            .get_num_args()
            .is_some_and(|range| range.min_values() == 0);
        // `--name=VALUE` in one argument: options whose value may be left out take no other
        // form.
        let with_value = |value: OsString| {
            let mut flag = OsString::from(format!("--{name}="));
            flag.push(value);
            flag
        };
        match value {
            toml::Value::Boolean(enabled) if is_switch => {
                if *enabled {
                    flags.push(OsString::from(format!("--{name}")));
                }
            }
            toml::Value::Boolean(enabled) if value_optional => {
                let negated = format!("no-{name}");
                if *enabled {
                    flags.push(OsString::from(format!("--{name}")));
                } else if serve
                    .get_arguments()
                    .any(|a| a.get_long() == Some(negated.as_str()))
                {
                    flags.push(OsString::from(format!("--{negated}")));
                } else {
                    bail!("{where_} takes a value, or true for the flag without one");
                }
            }
            toml::Value::Array(items) if repeatable => {
                for item in items {
                    flags.push(with_value(scalar(item).with_context(|| {
                        format!("{where_}: array items must be strings or numbers")
                    })?));
                }
            }
            _ if is_switch => bail!("{where_} is a switch: use true or false"),
            other => {
                flags.push(with_value(scalar(other).with_context(|| {
                    format!("{where_}: expected a string or a number")
                })?));
            }
        }
        keys.push((name, flags));
    }
    Ok(keys)
}

fn scalar(value: &toml::Value) -> anyhow::Result<OsString> {
    match value {
        toml::Value::String(text) => Ok(OsString::from(text)),
        toml::Value::Integer(number) => Ok(OsString::from(number.to_string())),
        toml::Value::Float(number) => Ok(OsString::from(number.to_string())),
        _ => bail!("not a string or a number"),
    }
}

fn line_of(text: &str, key: &str) -> usize {
    text.lines()
        .position(|line| line.trim_start().starts_with(key) && line.contains('='))
        .map_or(0, |index| index + 1)
}

/// The default of each configurable flag, as a TOML value, where it has one.
fn default_value(name: &str) -> Option<String> {
    let config = CacheConfig::default();
    let size = |bytes: u64| format!("\"{}\"", format_size(bytes));
    Some(match name {
        "backend" => format!("\"{}\"", crate::serve::DEFAULT_BACKING_FILE),
        "listen" => "[\"tcp:127.0.0.1:10809\"]".into(),
        "export" => "[\"name=memory:1G\"]".into(),
        "cache-size" => size(config.memory_bytes_max),
        "buffers-max" => config.buffers_max.to_string(),
        "block-size" => size(4096),
        "buffer-size-max" => size(config.buffer_bytes_max),
        "transfer-size-max" => size(config.transfer_bytes_max),
        "cluster-size-max" => size(config.cluster_bytes_max),
        "readahead-size-max" => size(config.readahead_bytes_max),
        "readahead-latency-size-max" => size(config.readahead_latency_bytes_max),
        "policy" => format!("\"{}\"", config.policy),
        "dirty-age-max" => config.dirty_age_max.as_secs().to_string(),
        "dirty-background-percent" => config.dirty_background_percent.to_string(),
        "dirty-limit-percent" => config.dirty_limit_percent.to_string(),
        "io-queue" => "\"elevator\"".into(),
        "io-queue-depth" => "32".into(),
        "io-queue-read-batches-ahead-max" => "8".into(),
        "writeback-inflight-max" => config.writeback_inflight_max.to_string(),
        "request-size-max" => size(32 << 20),
        "file-io-threads" => "0".into(),
        "file-io-uring-depth" => "0".into(),
        "local-cache" => "\"/var/cache/bufcache/disk.cache\"".into(),
        "local-cache-size" => size(16 << 30),
        "flush-to" => "\"local\"".into(),
        "local-cache-stall-max" => "10".into(),
        "local-cache-sampled-blocks" => "32".into(),
        "create-size" => size(crate::serve::DEFAULT_BACKING_SIZE_BYTES),
        "metrics" => "\"127.0.0.1:9187\"".into(),
        "control" => "\"/run/bufcache/control.sock\"".into(),
        "standby-warm-bytes-max" => size(crate::serve::STANDBY_WARM_BYTES_MAX_DEFAULT),
        "connections-max" => crate::limit_args::DEFAULT_CONNECTIONS_MAX.to_string(),
        "handshake-connections-max" => {
            crate::limit_args::DEFAULT_HANDSHAKE_CONNECTIONS_MAX.to_string()
        }
        "handshake-connections-per-peer-max" => {
            crate::limit_args::DEFAULT_HANDSHAKE_CONNECTIONS_PER_PEER_MAX.to_string()
        }
        "handshake-timeout" => crate::limit_args::DEFAULT_HANDSHAKE_TIMEOUT_SECONDS.to_string(),
        "idle-timeout" => "60".into(),
        "tls" => "\"off\"".into(),
        "tls-certificates" => "\"/etc/bufcache/tls\"".into(),
        "tls-psk" => "\"/etc/bufcache/keys.psk\"".into(),
        "export-identity" => "[\"a=alice\"]".into(),
        "export-read-only" => "[\"b\"]".into(),
        "allow" => "[\"192.168.0.0/16\"]".into(),
        "deny" => "[\"192.168.66.0/24\"]".into(),
        "inflight-bytes-max" => size(config.memory_bytes_max),
        "port" => "10809".into(),
        "bind" => "\"127.0.0.1\"".into(),
        "rescue-file" => "\"/var/lib/bufcache/bufcache.rescue\"".into(),
        "unix" => "\"/run/bufcache/nbd.sock\"".into(),
        "export-name" => "\"\"".into(),
        "pid-file" => "\"/run/bufcache/bufcache.pid\"".into(),
        "trace" => "\"/var/log/bufcache/requests.csv\"".into(),
        "trace-size-max" => size(1 << 30),
        "whatif-sampling-rate" => "0.01".into(),
        _ => return None,
    })
}

/// The default clap declares for `argument`, as a TOML value: a number bare, text quoted.
fn clap_default(argument: &clap::Arg) -> Option<String> {
    let value = argument
        .get_default_values()
        .first()?
        .to_string_lossy()
        .to_string();
    if value.parse::<f64>().is_ok() {
        Some(value)
    } else {
        Some(toml::Value::String(value).to_string())
    }
}

/// A commented configuration file holding every serve flag and its default.
pub fn default_text(command: &Command) -> anyhow::Result<String> {
    use std::fmt::Write;
    let mut text = String::new();
    let serve = command
        .find_subcommand("serve")
        .context("serve subcommand")?;
    // Explanations start with "##" and settings with "# ", so uncommenting every line
    // (stripping one "# ") gives a valid file that sets every default explicitly.
    writeln!(
        text,
        "## bufcache serve configuration: `bufcache serve --config FILE`."
    )?;
    writeln!(
        text,
        "## Every key is a serve flag; a flag on the command line overrides the file's key"
    )?;
    writeln!(
        text,
        "## (a list included). Sizes take binary units (4k, 64KiB, 1M, 2GiB)."
    )?;
    writeln!(text, "## Uncomment a line to change a default.")?;
    for argument in serve.get_arguments() {
        let Some(name) = argument.get_long() else {
            continue;
        };
        if NOT_CONFIGURABLE.contains(&name) {
            continue;
        }
        let help = argument
            .get_help()
            .map(|help| help.to_string())
            .unwrap_or_default();
        writeln!(text)?;
        for line in help.lines() {
            writeln!(text, "## {line}")?;
        }
        let value = match argument.get_action() {
            ArgAction::SetTrue => "false".to_string(),
            _ => default_value(name)
                .or_else(|| clap_default(argument))
                .with_context(|| format!("no default to print for --{name}"))?,
        };
        writeln!(text, "# {name} = {value}")?;
    }
    Ok(text)
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::{CommandFactory, Parser};

    fn expand_with(file: &str, command_line: &[&str]) -> anyhow::Result<Vec<String>> {
        let directory = tempfile::tempdir().unwrap();
        let path = directory.path().join("serve.toml");
        std::fs::write(&path, file).unwrap();
        let mut arguments: Vec<OsString> = vec![
            "bufcache".into(),
            "serve".into(),
            "--config".into(),
            path.clone().into(),
        ];
        arguments.extend(command_line.iter().map(OsString::from));
        let expanded = expand(arguments, &crate::Cli::command())?;
        Ok(expanded
            .into_iter()
            .map(|a| a.to_string_lossy().to_string())
            .collect())
    }

    #[test]
    fn file_flags_come_before_command_line_flags() {
        let expanded = expand_with(
            "cache-size = \"1G\"\nlisten = [\"unix:/a\", \"tcp:127.0.0.1:1\"]\nread_only = true\n",
            &["--cache-size", "2G"],
        )
        .unwrap();
        assert_eq!(
            expanded[2..],
            [
                "--listen=unix:/a",
                "--listen=tcp:127.0.0.1:1",
                "--read-only",
                "--cache-size",
                "2G"
            ]
        );
    }

    #[test]
    fn command_line_flags_replace_the_files_value_of_the_same_key() {
        // Goal: the README's promise that flags override the file, for scalars, switches'
        // short forms and lists. Method: expand a file setting each, with the same keys on
        // the command line, and check only the command line's values remain.
        let expanded = expand_with(
            "cache-size = \"1G\"\nlisten = [\"unix:/a\", \"tcp:127.0.0.1:1\"]\npolicy = \"lru\"\n",
            &[
                "--cache-size",
                "2G",
                "--listen=unix:/b",
                "--dirty-age-max",
                "5",
            ],
        )
        .unwrap();
        assert_eq!(
            expanded[2..],
            [
                "--policy=lru",
                "--cache-size",
                "2G",
                "--listen=unix:/b",
                "--dirty-age-max",
                "5"
            ]
        );
        let parsed = crate::Cli::try_parse_from(&expanded).expect("clap accepts the result");
        let crate::Command::Serve(args) = parsed.command else {
            panic!("not serve");
        };
        assert_eq!(args.listen_addresses().len(), 1);
    }

    #[test]
    fn any_listen_flag_on_the_command_line_replaces_every_listen_key_of_the_file() {
        // Goal: the README's promise that a command-line listen replaces the file's: a file
        // with `port`, `bind`, `unix` and `listen` never opens any of them when the command
        // line names where to listen in any of its forms (--listen, -p, -b, -k, -U, --socket).
        // Method: expand the file with each form and check no listen key of the file is left.
        let file = "port = 10809\nbind = \"127.0.0.1\"\nunix = \"/run/a.sock\"\n\
                    listen = [\"tcp:127.0.0.1:1\"]\ncache-size = \"1G\"\n";
        for command_line in [
            &["--listen", "unix:/b"][..],
            &["--listen=unix:/b"][..],
            &["-p", "2000"][..],
            &["-b", "127.0.0.2"][..],
            &["-k", "/b"][..],
            &["-U", "/b"][..],
            &["--socket=/b"][..],
        ] {
            let expanded = expand_with(file, command_line).unwrap();
            let from_file: Vec<&String> = expanded[2..expanded.len() - command_line.len()]
                .iter()
                .collect();
            assert_eq!(
                from_file,
                ["--cache-size=1G"],
                "command line {command_line:?} left {from_file:?} of the file"
            );
            crate::Cli::try_parse_from(&expanded).expect("clap accepts the result");
        }
    }

    #[test]
    fn printed_default_parses_and_is_accepted_with_every_line_uncommented() {
        // Goal: `config --print-default`, with every line uncommented (one "# " stripped),
        // is a valid config file serve accepts. Method: strip, expand, parse with clap.
        let text = default_text(&crate::Cli::command()).unwrap();
        let uncommented: String = text
            .lines()
            .map(|line| format!("{}\n", line.strip_prefix("# ").unwrap_or(line)))
            .collect();
        let table: toml::Table = uncommented.parse().expect("valid TOML");
        assert!(table.contains_key("shutdown-timeout") && table.contains_key("listen"));
        let expanded = expand_with(&uncommented, &[]).expect("every key is a serve flag");
        crate::Cli::try_parse_from(&expanded).expect("clap accepts every default");
    }

    #[test]
    fn an_option_whose_value_may_be_left_out_takes_a_value_or_a_boolean() {
        // Goal: `prefault`, whose value may be left out on the command line, works from a
        // file as a value (`"off"`), as true (the bare flag, as before it took a value) and as
        // false (its `no-` flag), and the command line's `--no-prefault` overrides the file's
        // `prefault`. Method: expand each file and parse the result with clap.
        for (file, command_line, expected) in [
            ("prefault = \"off\"\n", &[][..], &["--prefault=off"][..]),
            ("prefault = true\n", &[][..], &["--prefault"][..]),
            ("prefault = false\n", &[][..], &["--no-prefault"][..]),
            (
                "prefault = \"startup\"\n",
                &["--no-prefault"][..],
                &["--no-prefault"][..],
            ),
        ] {
            let expanded = expand_with(file, command_line).unwrap();
            assert_eq!(expanded[2..], *expected, "{file}");
            crate::Cli::try_parse_from(&expanded).expect("clap accepts the result");
        }
    }

    #[test]
    fn unknown_keys_and_bad_types_name_the_line() {
        let error = expand_with("cache-size = \"1G\"\ncolour = \"blue\"\n", &[]).unwrap_err();
        assert!(error.to_string().contains(":2: key `colour`"), "{error}");
        let error = expand_with("read-only = \"yes\"\n", &[]).unwrap_err();
        assert!(error.to_string().contains("switch"), "{error}");
        let error = expand_with("cache-size = \n", &[]).unwrap_err();
        assert!(error.to_string().contains("serve.toml"), "{error}");
    }
}
