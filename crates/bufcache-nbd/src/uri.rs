//! NBD URIs as the client accepts them: `nbd://HOST[:PORT]/EXPORT` and
//! `nbd+unix:///EXPORT?socket=PATH` (the forms qemu and libnbd use).
//!
//! Parsing is strict and every refusal says what was expected, because a URI usually comes
//! straight from a command line. Export names and socket paths are percent-decoded; the
//! original text is kept for messages so errors show what the user typed.

use std::fmt;
use std::path::PathBuf;
use std::str::FromStr;

use crate::protocol::DEFAULT_PORT;

/// Where an NBD server is.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum NbdAddress {
    Tcp { host: String, port: u16 },
    Unix(PathBuf),
}

/// TLS settings of an `nbds://` or `nbds+unix://` URI, with libnbd's parameter names:
/// `nbds://USER@HOST/EXPORT?tls-psk-file=FILE` or `?tls-certificates=DIR` (ca-cert.pem and,
/// for client authentication, client-cert.pem and client-key.pem), `tls-hostname=NAME`.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ClientTls {
    /// The PSK identity (the URI's user, or `tls-username=`).
    pub username: Option<String>,
    pub psk_file: Option<PathBuf>,
    pub certificates: Option<PathBuf>,
    /// The name the server certificate must carry; default the host of a TCP URI.
    pub hostname: Option<String>,
}

/// A parsed NBD URI.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NbdUri {
    pub address: NbdAddress,
    pub export_name: String,
    /// Set for `nbds://` and `nbds+unix://`.
    pub tls: Option<ClientTls>,
    /// The URI as given, for messages.
    pub text: String,
}

/// Why a URI was refused.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum UriError {
    #[error("{0:?}: unsupported URI scheme; expected nbd://HOST[:PORT]/EXPORT or nbd+unix:///EXPORT?socket=PATH")]
    Scheme(String),
    #[error("{0:?}: nbds:// needs credentials: ?tls-psk-file=FILE or ?tls-certificates=DIR")]
    Tls(String),
    #[error("{0:?}: missing host; expected nbd://HOST[:PORT]/EXPORT")]
    MissingHost(String),
    #[error("{uri:?}: invalid port {port:?}; expected 1 to 65535")]
    Port { uri: String, port: String },
    #[error("{0:?}: nbd+unix:// URIs take no host; expected nbd+unix:///EXPORT?socket=PATH")]
    UnixHost(String),
    #[error("{0:?}: missing ?socket=PATH; expected nbd+unix:///EXPORT?socket=PATH")]
    MissingSocket(String),
    #[error("{uri:?}: unsupported query parameter {parameter:?}")]
    Query { uri: String, parameter: String },
    #[error("{0:?}: invalid percent-encoding")]
    PercentEncoding(String),
}

impl FromStr for NbdUri {
    type Err = UriError;

    fn from_str(text: &str) -> Result<Self, Self::Err> {
        if let Some(rest) = text.strip_prefix("nbds+unix://") {
            return with_tls(text, rest, parse_unix);
        }
        if let Some(rest) = text.strip_prefix("nbds://") {
            return with_tls(text, rest, parse_tcp);
        }
        if let Some(rest) = text.strip_prefix("nbd+unix://") {
            return parse_unix(text, rest);
        }
        if let Some(rest) = text.strip_prefix("nbd://") {
            return parse_tcp(text, rest);
        }
        Err(UriError::Scheme(text.to_string()))
    }
}

impl fmt::Display for NbdUri {
    fn fmt(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        formatter.write_str(&self.text)
    }
}

/// Parses a TLS URI: takes the user and the `tls-*` query parameters out, parses the rest
/// as the plain form, and attaches the TLS settings.
fn with_tls(
    text: &str,
    rest: &str,
    parse: fn(&str, &str) -> Result<NbdUri, UriError>,
) -> Result<NbdUri, UriError> {
    let (before_query, query) = match rest.split_once('?') {
        Some((before, query)) => (before, query),
        None => (rest, ""),
    };
    let mut tls = ClientTls::default();
    let (authority, path) = before_query.split_once('/').unwrap_or((before_query, ""));
    let authority = match authority.rsplit_once('@') {
        Some((user, host)) => {
            tls.username = Some(percent_decode(text, user)?);
            host
        }
        None => authority,
    };
    let mut kept = Vec::new();
    for parameter in query.split('&').filter(|parameter| !parameter.is_empty()) {
        let (key, value) = parameter.split_once('=').unwrap_or((parameter, ""));
        let value = percent_decode(text, value)?;
        match key {
            "tls-psk-file" => tls.psk_file = Some(PathBuf::from(value)),
            "tls-certificates" => tls.certificates = Some(PathBuf::from(value)),
            "tls-username" => tls.username = Some(value),
            "tls-hostname" => tls.hostname = Some(value),
            _ => kept.push(parameter),
        }
    }
    if tls.psk_file.is_none() && tls.certificates.is_none() {
        return Err(UriError::Tls(text.to_string()));
    }
    let mut plain = format!("{authority}/{path}");
    if !kept.is_empty() {
        plain.push('?');
        plain.push_str(&kept.join("&"));
    }
    let mut uri = parse(text, &plain)?;
    uri.tls = Some(tls);
    Ok(uri)
}

/// Splits `authority/path?query` into its three parts.
fn split_rest(rest: &str) -> (&str, &str, Option<&str>) {
    let (before_query, query) = match rest.split_once('?') {
        Some((before, query)) => (before, Some(query)),
        None => (rest, None),
    };
    match before_query.split_once('/') {
        Some((authority, path)) => (authority, path, query),
        None => (before_query, "", query),
    }
}

fn parse_tcp(text: &str, rest: &str) -> Result<NbdUri, UriError> {
    let (authority, path, query) = split_rest(rest);
    if let Some(query) = query {
        let parameter = query.split('&').next().unwrap_or_default().to_string();
        return Err(UriError::Query {
            uri: text.to_string(),
            parameter,
        });
    }
    let (host, port_text) = split_host_port(authority);
    if host.is_empty() {
        return Err(UriError::MissingHost(text.to_string()));
    }
    let port = match port_text {
        None => DEFAULT_PORT,
        Some(port_text) => match port_text.parse::<u16>() {
            Ok(port) if port != 0 => port,
            _ => {
                return Err(UriError::Port {
                    uri: text.to_string(),
                    port: port_text.to_string(),
                })
            }
        },
    };
    Ok(NbdUri {
        address: NbdAddress::Tcp {
            host: host.to_string(),
            port,
        },
        export_name: percent_decode(text, path)?,
        tls: None,
        text: text.to_string(),
    })
}

/// Splits `host[:port]`, with IPv6 hosts in brackets (`[::1]:10809`); brackets are kept so
/// the host can be joined with a port again.
fn split_host_port(authority: &str) -> (&str, Option<&str>) {
    if authority.starts_with('[') {
        if let Some(close) = authority.find(']') {
            let host = &authority[..=close];
            let port = authority[close + 1..].strip_prefix(':');
            return (host, port);
        }
    }
    match authority.rsplit_once(':') {
        Some((host, port)) => (host, Some(port)),
        None => (authority, None),
    }
}

fn parse_unix(text: &str, rest: &str) -> Result<NbdUri, UriError> {
    let (authority, path, query) = split_rest(rest);
    if !authority.is_empty() {
        return Err(UriError::UnixHost(text.to_string()));
    }
    let mut socket = None;
    for parameter in query.unwrap_or_default().split('&') {
        if parameter.is_empty() {
            continue;
        }
        match parameter.strip_prefix("socket=") {
            Some(value) => socket = Some(percent_decode(text, value)?),
            None => {
                return Err(UriError::Query {
                    uri: text.to_string(),
                    parameter: parameter.to_string(),
                })
            }
        }
    }
    let socket = socket
        .filter(|socket| !socket.is_empty())
        .ok_or_else(|| UriError::MissingSocket(text.to_string()))?;
    Ok(NbdUri {
        address: NbdAddress::Unix(PathBuf::from(socket)),
        export_name: percent_decode(text, path)?,
        tls: None,
        text: text.to_string(),
    })
}

/// Decodes `%XX` escapes; the result must be UTF-8. A `%` not followed by two hex digits is
/// refused (the decoder itself would keep it as it is).
fn percent_decode(uri: &str, encoded: &str) -> Result<String, UriError> {
    let error = || UriError::PercentEncoding(uri.to_string());
    let escapes_whole = encoded.split('%').skip(1).all(|after| {
        after
            .as_bytes()
            .get(..2)
            .is_some_and(|hex| hex.iter().all(u8::is_ascii_hexdigit))
    });
    if !escapes_whole {
        return Err(error());
    }
    percent_encoding::percent_decode_str(encoded)
        .decode_utf8()
        .map(|decoded| decoded.into_owned())
        .map_err(|_| error())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(text: &str) -> Result<NbdUri, UriError> {
        text.parse()
    }

    #[test]
    fn tcp_uris_parse_with_default_port_and_ipv6() {
        let uri = parse("nbd://example.com/disk%201").unwrap();
        assert_eq!(
            uri.address,
            NbdAddress::Tcp {
                host: "example.com".into(),
                port: 10809
            }
        );
        assert_eq!(uri.export_name, "disk 1");
        let uri = parse("nbd://[::1]:10810").unwrap();
        assert_eq!(
            uri.address,
            NbdAddress::Tcp {
                host: "[::1]".into(),
                port: 10810
            }
        );
        assert_eq!(uri.export_name, "");
    }

    #[test]
    fn unix_uris_parse() {
        let uri = parse("nbd+unix:///cache?socket=/tmp/a%20b.sock").unwrap();
        assert_eq!(uri.address, NbdAddress::Unix("/tmp/a b.sock".into()));
        assert_eq!(uri.export_name, "cache");
    }

    #[test]
    fn bad_uris_say_what_was_expected() {
        assert!(matches!(parse("http://x/"), Err(UriError::Scheme(_))));
        assert!(matches!(parse("nbds://x/"), Err(UriError::Tls(_))));
        let uri = parse("nbds://alice@host:10810/disk?tls-psk-file=/k%20s.psk").unwrap();
        assert_eq!(
            uri.address,
            NbdAddress::Tcp {
                host: "host".into(),
                port: 10810
            }
        );
        assert_eq!(uri.export_name, "disk");
        let tls = uri.tls.unwrap();
        assert_eq!(tls.username.as_deref(), Some("alice"));
        assert_eq!(tls.psk_file, Some(PathBuf::from("/k s.psk")));
        let uri =
            parse("nbds+unix:///d?socket=/s.sock&tls-certificates=/pki&tls-hostname=srv").unwrap();
        assert_eq!(uri.address, NbdAddress::Unix("/s.sock".into()));
        let tls = uri.tls.unwrap();
        assert_eq!(tls.certificates, Some(PathBuf::from("/pki")));
        assert_eq!(tls.hostname.as_deref(), Some("srv"));
        assert!(matches!(parse("nbd:///e"), Err(UriError::MissingHost(_))));
        assert!(matches!(parse("nbd://h:0/e"), Err(UriError::Port { .. })));
        assert!(matches!(parse("nbd://h:x/e"), Err(UriError::Port { .. })));
        assert!(matches!(
            parse("nbd+unix:///e"),
            Err(UriError::MissingSocket(_))
        ));
        assert!(matches!(
            parse("nbd+unix://h/e?socket=/s"),
            Err(UriError::UnixHost(_))
        ));
        assert!(matches!(
            parse("nbd+unix:///e?sock=/s"),
            Err(UriError::Query { .. })
        ));
        for malformed in ["nbd://h/%zz", "nbd://h/a%2", "nbd://h/%", "nbd://h/%ff%fe"] {
            assert!(
                matches!(parse(malformed), Err(UriError::PercentEncoding(_))),
                "{malformed}"
            );
        }
        let message = parse("nbd+unix:///e").unwrap_err().to_string();
        assert!(message.contains("socket=PATH"), "{message}");
    }
}
