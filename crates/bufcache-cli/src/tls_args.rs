//! `bufcache serve` TLS flags, with nbdkit's names so its users' habits carry over. Every
//! file is loaded at start-up: a missing or malformed one is refused naming the flag and the
//! file (and the line, for PSK files), exit status 2, never a server running without the
//! protection it was asked for.

use std::path::PathBuf;

use bufcache_nbd::{ExportPolicy, ServerConfig, TlsConfig, TlsMode};
use clap::Args;

/// TLS flags of `bufcache serve`.
#[derive(Args, Debug)]
pub struct TlsArgs {
    /// TLS: off; on (clients may upgrade with NBD_OPT_STARTTLS); require (every option but
    /// STARTTLS and ABORT is refused until they do).
    #[arg(long, value_name = "off|on|require", default_value = "off")]
    tls: TlsMode,
    /// Directory with ca-cert.pem, server-cert.pem, server-key.pem and optionally
    /// ca-crl.pem (nbdkit's layout).
    #[arg(long, value_name = "DIR")]
    tls_certificates: Option<PathBuf>,
    /// Require a client certificate signed by the directory's ca-cert.pem.
    #[arg(long)]
    tls_verify_peer: bool,
    /// Pre-shared keys, a psktool file: one identity:hexkey per line.
    #[arg(long, value_name = "FILE")]
    tls_psk: Option<PathBuf>,
    /// Only this TLS identity (PSK identity or client certificate common name) may open the
    /// export, EXPORT=IDENTITY; repeatable, several identities per export allowed. Other
    /// clients do not see the export in lists and are told it does not exist.
    #[arg(long, value_name = "EXPORT=IDENTITY", value_parser = export_and_value)]
    export_identity: Vec<(String, String)>,
    /// Serve this export read-only (the empty name is the default export); repeatable.
    #[arg(long, value_name = "EXPORT")]
    export_read_only: Vec<String>,
}

impl TlsArgs {
    /// How a client on this host reaches the server when TLS is required: the `nbds` scheme
    /// and the libnbd URI parameters for the same PSK file (and its first identity) or the
    /// same certificate directory. None when plain `nbd://` works.
    pub fn client_uri(&self, plain: &str) -> Option<String> {
        if self.tls != TlsMode::Require {
            return None;
        }
        let (scheme, rest) = if let Some(rest) = plain.strip_prefix("nbd+unix://") {
            ("nbds+unix://", rest)
        } else {
            ("nbds://", plain.strip_prefix("nbd://")?)
        };
        let mut user = String::new();
        let mut parameters = Vec::new();
        if let Some(psk) = &self.tls_psk {
            parameters.push(format!("tls-psk-file={}", psk.display()));
            // libnbd takes the PSK identity from the URI's user part.
            let identity = std::fs::read_to_string(psk).ok().and_then(|text| {
                text.lines()
                    .find_map(|line| line.split_once(':').map(|(name, _)| name.to_string()))
            });
            if let Some(identity) = identity {
                user = format!("{identity}@");
            }
        } else if let Some(directory) = &self.tls_certificates {
            parameters.push(format!("tls-certificates={}", directory.display()));
        }
        let uri = format!("{scheme}{user}{rest}");
        let separator = if uri.contains('?') { '&' } else { '?' };
        Some(if parameters.is_empty() {
            uri
        } else {
            format!("{uri}{separator}{}", parameters.join("&"))
        })
    }
}

/// Parses EXPORT=VALUE.
fn export_and_value(text: &str) -> Result<(String, String), String> {
    match text.split_once('=') {
        Some((export, value)) if !value.is_empty() => Ok((export.to_string(), value.to_string())),
        _ => Err(format!("{text:?} is not EXPORT=IDENTITY")),
    }
}

impl TlsArgs {
    /// Puts the settings into `config` after loading every file once.
    pub fn apply(&self, config: &mut ServerConfig) {
        let tls = TlsConfig {
            mode: self.tls,
            certificates: self.tls_certificates.clone(),
            verify_peer: self.tls_verify_peer,
            psk_file: self.tls_psk.clone(),
        };
        if let Err(error) = tls.validate() {
            clap::Error::raw(
                clap::error::ErrorKind::ValueValidation,
                format!("{error}\n"),
            )
            .exit();
        }
        config.tls = tls;
        let mut policies: Vec<(String, ExportPolicy)> = Vec::new();
        for (export, identity) in &self.export_identity {
            policy_of(&mut policies, export)
                .identities
                .push(identity.clone());
        }
        for export in &self.export_read_only {
            policy_of(&mut policies, export).read_only = true;
        }
        config.export_policies = policies;
    }
}

/// The policy of `export` in `policies`, added when absent.
fn policy_of<'a>(
    policies: &'a mut Vec<(String, ExportPolicy)>,
    export: &str,
) -> &'a mut ExportPolicy {
    let index = match policies.iter().position(|(name, _)| name == export) {
        Some(index) => index,
        None => {
            policies.push((export.to_string(), ExportPolicy::default()));
            policies.len() - 1
        }
    };
    &mut policies[index].1
}
