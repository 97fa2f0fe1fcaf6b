//! Configuration files: `bufcache serve --config FILE` reads flags from TOML.
//!
//! Every key is a long flag of `serve` (kebab-case or snake_case): `cache-size = "1G"`,
//! `listen = ["tcp:0.0.0.0:10809", "unix:/run/bufcache.sock"]`, `read-only = true`. The file's
//! flags are placed before the command line's, so a flag given on the command line wins.
//! Unknown keys and values of the wrong type are errors naming the file, the line and the key.
//! `bufcache config --print-default` prints every key with its default, commented out.

use std::ffi::OsString;
use std::path::Path;

use anyhow::{bail, Context};
use bufcache::{format_size, CacheConfig};
use clap::{ArgAction, Command};

/// Keys that are not flags to read from a file.
const NOT_CONFIGURABLE: [&str; 3] = ["help", "config", "version"];

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
    let from_file = flags_from_file(Path::new(&path), serve)?;
    let mut expanded = arguments[..=serve_index].to_vec();
    expanded.extend(from_file);
    expanded.extend(rest);
    Ok(expanded)
}

fn flags_from_file(path: &Path, serve: &Command) -> anyhow::Result<Vec<OsString>> {
    let text = std::fs::read_to_string(path)
        .with_context(|| format!("cannot read config file {}", path.display()))?;
    let table: toml::Table = text
        .parse()
        .map_err(|error| anyhow::anyhow!("{}: {error}", path.display()))?;
    let mut flags = Vec::new();
    for (key, value) in &table {
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
        match value {
            toml::Value::Boolean(enabled) if is_switch => {
                if *enabled {
                    flags.push(OsString::from(format!("--{name}")));
                }
            }
            toml::Value::Array(items) if repeatable => {
                for item in items {
                    flags.push(OsString::from(format!("--{name}")));
                    flags.push(scalar(item).with_context(|| {
                        format!("{where_}: array items must be strings or numbers")
                    })?);
                }
            }
            _ if is_switch => bail!("{where_} is a switch: use true or false"),
            other => {
                flags.push(OsString::from(format!("--{name}")));
                flags.push(
                    scalar(other)
                        .with_context(|| format!("{where_}: expected a string or a number"))?,
                );
            }
        }
    }
    Ok(flags)
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
        "buffer-size-max" => size(config.buffer_size_max_bytes),
        "transfer-size-max" => size(config.transfer_size_max_bytes),
        "cluster-size-max" => size(config.cluster_size_max_bytes),
        "readahead-size-max" => size(config.readahead_size_max_bytes),
        "policy" => format!("\"{}\"", config.policy),
        "dirty-age-max" => config.dirty_age_max.as_secs().to_string(),
        "dirty-background-percent" => config.dirty_background_percent.to_string(),
        "dirty-limit-percent" => config.dirty_limit_percent.to_string(),
        "io-queue" => "\"elevator\"".into(),
        "io-queue-depth" => "32".into(),
        "request-size-max" => size(32 << 20),
        "create-size" => size(crate::serve::DEFAULT_BACKING_SIZE_BYTES),
        "metrics" => "\"127.0.0.1:9187\"".into(),
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
        _ => return None,
    })
}

/// A commented configuration file holding every serve flag and its default.
pub fn print_default(command: &Command) -> anyhow::Result<()> {
    let serve = command
        .find_subcommand("serve")
        .context("serve subcommand")?;
    println!("# bufcache serve configuration: `bufcache serve --config FILE`.");
    println!("# Every key is a serve flag; flags on the command line override the file.");
    println!("# Sizes take binary units (4k, 64KiB, 1M, 2GiB). Uncomment to change a default.");
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
        println!();
        for line in help.lines() {
            println!("# {line}");
        }
        let value = match argument.get_action() {
            ArgAction::SetTrue => "false".to_string(),
            _ => default_value(name).unwrap_or_else(|| "\"\"".into()),
        };
        println!("# {name} = {value}");
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory;

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
                "--cache-size",
                "1G",
                "--listen",
                "unix:/a",
                "--listen",
                "tcp:127.0.0.1:1",
                "--read-only",
                "--cache-size",
                "2G"
            ]
        );
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
