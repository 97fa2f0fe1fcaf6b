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

/// A parsed NBD URI.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NbdUri {
    pub address: NbdAddress,
    pub export_name: String,
    /// The URI as given, for messages.
    pub text: String,
}

/// Why a URI was refused.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum UriError {
    #[error("{0:?}: unsupported URI scheme; expected nbd://HOST[:PORT]/EXPORT or nbd+unix:///EXPORT?socket=PATH")]
    Scheme(String),
    #[error("{0:?}: TLS (nbds://) is not supported")]
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
        if text.starts_with("nbds://") || text.starts_with("nbds+unix://") {
            return Err(UriError::Tls(text.to_string()));
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
        text: text.to_string(),
    })
}

/// Decodes `%XX` escapes; the result must be UTF-8.
fn percent_decode(uri: &str, encoded: &str) -> Result<String, UriError> {
    let error = || UriError::PercentEncoding(uri.to_string());
    let bytes = encoded.as_bytes();
    let mut decoded = Vec::with_capacity(bytes.len());
    let mut index = 0;
    while index < bytes.len() {
        if bytes[index] == b'%' {
            let hex = encoded.get(index + 1..index + 3).ok_or_else(error)?;
            decoded.push(u8::from_str_radix(hex, 16).map_err(|_| error())?);
            index += 3;
        } else {
            decoded.push(bytes[index]);
            index += 1;
        }
    }
    String::from_utf8(decoded).map_err(|_| error())
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
        assert!(matches!(
            parse("nbd://h/%zz"),
            Err(UriError::PercentEncoding(_))
        ));
        let message = parse("nbd+unix:///e").unwrap_err().to_string();
        assert!(message.contains("socket=PATH"), "{message}");
    }
}
