//! `bufcache serve` TLS flags, with nbdkit's names so its users' habits carry over. Every
//! file is loaded at start-up: a missing or malformed one is refused naming the flag and the
//! file (and the line, for PSK files), exit status 2, never a server running without the
//! protection it was asked for.

use std::path::PathBuf;

use bufcache_nbd::{ServerConfig, TlsConfig, TlsMode};
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
    }
}
