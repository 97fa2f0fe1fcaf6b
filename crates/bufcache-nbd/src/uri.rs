//! NBD URIs as the client accepts them: `nbd://[USER@]HOST[:PORT]/EXPORT`,
//! `nbd+unix:///EXPORT?socket=PATH` and their TLS forms `nbds://` and `nbds+unix://` (the
//! NBD URI standard, doc/uri.md of the NBD project, as qemu and libnbd read it).
//!
//! Parsing is strict and every refusal says what was expected, because a URI usually comes
//! straight from a command line. The authority (user, host, IPv6 literal, port) is parsed by
//! the `url` crate; export names, socket paths, user names and TLS parameters are
//! percent-decoded by `percent-encoding` (strictly: a `%` must start an escape, and `+` is a
//! plus, as in RFC 3986). The original text is kept for messages so errors show what the user
//! typed.
//!
//! Where `url` (a WHATWG parser) and the NBD standard (RFC 3986) disagree, the standard wins:
//! - the export name is the path as typed, minus its leading `/`, then percent-decoded; `url`
//!   would resolve `.` and `..` segments (also `%2e`), but an export name is free text
//!   (`nbd://h/a/../b` names export `a/../b`, `nbd://h//disk` names `/disk`);
//! - `#` is not a fragment delimiter but part of the name or value it is in, as before;
//! - tabs and newlines are kept (`url` drops them silently, which would change a host name);
//! - `nbds+unix://USER@/…` gives the PSK identity (`url` refuses a user without a host);
//! - an empty port (`nbd://h:/e`) is refused, not read as the default port.
//!
//! What `url` normalises and is kept: an IPv6 host is written in its compressed form
//! (`[0:0::1]` becomes `[::1]`), the same address. A host name is percent-decoded (RFC 3986
//! §3.2.2), so `nbd://h%C3%A9/` reaches host `hé` as `nbd://hé/` does.

use std::fmt;
use std::path::PathBuf;
use std::str::FromStr;

use percent_encoding::{
    percent_decode_str, utf8_percent_encode, AsciiSet, CONTROLS, NON_ALPHANUMERIC,
};

use crate::protocol::DEFAULT_PORT;

/// Where an NBD server is.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum NbdAddress {
    /// A host name, an IPv4 address or a bracketed IPv6 address (`[::1]`), and a port.
    Tcp {
        host: String,
        port: u16,
    },
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
    #[error("{uri:?}: invalid host: {reason}; expected nbd://HOST[:PORT]/EXPORT, an IPv6 host in brackets")]
    Host { uri: String, reason: String },
    #[error("{uri:?}: invalid port {port:?}; expected 1 to 65535")]
    Port { uri: String, port: String },
    #[error("{0:?}: a user name is the TLS PSK identity, for nbds:// and nbds+unix:// only")]
    User(String),
    #[error("{0:?}: NBD URIs take no password; the PSK is read from ?tls-psk-file=FILE")]
    Password(String),
    #[error("{0:?}: nbd+unix:// URIs take no host; expected nbd+unix:///EXPORT?socket=PATH")]
    UnixHost(String),
    #[error("{0:?}: missing ?socket=PATH; expected nbd+unix:///EXPORT?socket=PATH")]
    MissingSocket(String),
    #[error("{uri:?}: unsupported query parameter {parameter:?}")]
    Query { uri: String, parameter: String },
    #[error("{0:?}: invalid percent-encoding")]
    PercentEncoding(String),
}

/// The transport and security a scheme names.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Scheme {
    Tcp { tls: bool },
    Unix { tls: bool },
}

impl Scheme {
    const ALL: [(&'static str, Scheme); 4] = [
        ("nbd", Scheme::Tcp { tls: false }),
        ("nbds", Scheme::Tcp { tls: true }),
        ("nbd+unix", Scheme::Unix { tls: false }),
        ("nbds+unix", Scheme::Unix { tls: true }),
    ];

    fn tls(self) -> bool {
        match self {
            Scheme::Tcp { tls } | Scheme::Unix { tls } => tls,
        }
    }
}

/// Characters escaped in a path (export name) or query value: all but RFC 3986's unreserved
/// characters and `/`.
const PATH_ESCAPED: &AsciiSet = &NON_ALPHANUMERIC
    .remove(b'-')
    .remove(b'.')
    .remove(b'_')
    .remove(b'~')
    .remove(b'/');

/// Characters escaped in a user name: as in a path, and `/` too.
const USER_ESCAPED: &AsciiSet = &PATH_ESCAPED.add(b'/');

/// Characters escaped in an authority before `url` reads it, and decoded from the host it
/// returns: `url` would drop tabs and newlines and cut at `#`, changing the host silently.
const AUTHORITY_ESCAPED: &AsciiSet = &CONTROLS.add(b' ').add(b'#');

impl FromStr for NbdUri {
    type Err = UriError;

    fn from_str(text: &str) -> Result<Self, Self::Err> {
        let (scheme, rest) = Scheme::ALL
            .iter()
            .find_map(|(name, scheme)| {
                let rest = text.strip_prefix(name)?.strip_prefix("://")?;
                Some((*scheme, rest))
            })
            .ok_or_else(|| UriError::Scheme(text.to_string()))?;
        // RFC 3986's generic split (section 3): the authority ends at the first `/` or `?`,
        // the path at the first `?`.
        let (before_query, query) = match rest.split_once('?') {
            Some((before, query)) => (before, Some(query)),
            None => (rest, None),
        };
        let (authority, path) = before_query.split_once('/').unwrap_or((before_query, ""));
        let parameters = Parameters::parse(text, scheme, query)?;
        let mut tls = parameters.tls;
        let address = match scheme {
            Scheme::Tcp { .. } => {
                let (host, port, user) = parse_tcp_authority(text, authority)?;
                if user.is_some() && !scheme.tls() {
                    return Err(UriError::User(text.to_string()));
                }
                if let (Some(tls), Some(user)) = (&mut tls, user) {
                    tls.username.get_or_insert(user);
                }
                NbdAddress::Tcp { host, port }
            }
            Scheme::Unix { .. } => {
                // Only a user (`nbds+unix://USER@/…`) may precede the empty host.
                match (authority.strip_suffix('@'), &mut tls) {
                    _ if authority.is_empty() => {}
                    (Some(user), Some(_)) if user.contains(':') => {
                        return Err(UriError::Password(text.to_string()))
                    }
                    (Some(user), Some(tls)) if !user.contains('@') => {
                        let user = percent_decode(text, user)?;
                        tls.username.get_or_insert(user);
                    }
                    _ => return Err(UriError::UnixHost(text.to_string())),
                }
                let socket = parameters
                    .socket
                    .filter(|socket| !socket.is_empty())
                    .ok_or_else(|| UriError::MissingSocket(text.to_string()))?;
                NbdAddress::Unix(PathBuf::from(socket))
            }
        };
        Ok(NbdUri {
            address,
            export_name: percent_decode(text, path)?,
            tls,
            text: text.to_string(),
        })
    }
}

/// The query parameters of a URI, each checked against its scheme.
struct Parameters {
    /// Set for a TLS scheme (with at least one credential parameter).
    tls: Option<ClientTls>,
    /// `socket=` of a Unix scheme, decoded.
    socket: Option<String>,
}

impl Parameters {
    /// Reads `query`: `tls-*` parameters for a TLS scheme, `socket=` for a Unix one. An
    /// unknown parameter is refused (the standard asks parsers to diagnose them), after a
    /// TLS scheme without credentials.
    fn parse(text: &str, scheme: Scheme, query: Option<&str>) -> Result<Parameters, UriError> {
        if let (Scheme::Tcp { tls: false }, Some(query)) = (scheme, query) {
            return Err(UriError::Query {
                uri: text.to_string(),
                parameter: query.split('&').next().unwrap_or_default().to_string(),
            });
        }
        let mut tls = ClientTls::default();
        let mut socket = None;
        let mut unknown = None;
        let pairs = query.into_iter().flat_map(|query| query.split('&'));
        for parameter in pairs.filter(|parameter| !parameter.is_empty()) {
            let Some((key, value)) = parameter.split_once('=') else {
                unknown.get_or_insert(parameter);
                continue;
            };
            let value = percent_decode(text, value)?;
            match (key, scheme) {
                ("socket", Scheme::Unix { .. }) => socket = Some(value),
                ("tls-psk-file", _) if scheme.tls() => tls.psk_file = Some(value.into()),
                ("tls-certificates", _) if scheme.tls() => tls.certificates = Some(value.into()),
                ("tls-username", _) if scheme.tls() => tls.username = Some(value),
                ("tls-hostname", _) if scheme.tls() => tls.hostname = Some(value),
                _ => {
                    unknown.get_or_insert(parameter);
                }
            }
        }
        if scheme.tls() && tls.psk_file.is_none() && tls.certificates.is_none() {
            return Err(UriError::Tls(text.to_string()));
        }
        if let Some(parameter) = unknown {
            return Err(UriError::Query {
                uri: text.to_string(),
                parameter: parameter.to_string(),
            });
        }
        Ok(Parameters {
            tls: scheme.tls().then_some(tls),
            socket,
        })
    }
}

/// The host, port and user of a TCP URI's authority, read by `url`.
fn parse_tcp_authority(
    text: &str,
    authority: &str,
) -> Result<(String, u16, Option<String>), UriError> {
    if authority.is_empty() {
        return Err(UriError::MissingHost(text.to_string()));
    }
    let escaped = utf8_percent_encode(authority, AUTHORITY_ESCAPED);
    let port_error = || UriError::Port {
        uri: text.to_string(),
        port: typed_port(authority).unwrap_or_default().to_string(),
    };
    let parsed = match url::Url::parse(&format!("nbd://{escaped}")) {
        Ok(parsed) => parsed,
        Err(url::ParseError::InvalidPort) => return Err(port_error()),
        Err(url::ParseError::EmptyHost) => return Err(UriError::MissingHost(text.to_string())),
        Err(error) => {
            return Err(UriError::Host {
                uri: text.to_string(),
                reason: error.to_string(),
            })
        }
    };
    // `url` reads `@h` and `alice:@h` as no user and no password: the typed `@` and `:` say
    // what was meant (an empty PSK identity; a password, refused).
    let userinfo = authority.rsplit_once('@').map(|(userinfo, _)| userinfo);
    if userinfo.is_some_and(|userinfo| userinfo.contains(':')) {
        return Err(UriError::Password(text.to_string()));
    }
    let port = match (parsed.port(), typed_port(authority)) {
        (Some(0), _) | (None, Some(_)) => return Err(port_error()),
        (Some(port), _) => port,
        (None, None) => DEFAULT_PORT,
    };
    let host = match parsed.host() {
        Some(url::Host::Ipv6(address)) => format!("[{address}]"),
        Some(_) => percent_decode(text, parsed.host_str().unwrap_or_default())?,
        None => return Err(UriError::MissingHost(text.to_string())),
    };
    let user = match userinfo {
        Some(_) => Some(percent_decode(text, parsed.username())?),
        None => None,
    };
    Ok((host, port, user))
}

/// The port as typed in `authority` (what follows the host's `:`), for messages and to
/// refuse an empty one.
fn typed_port(authority: &str) -> Option<&str> {
    let host_and_port = authority
        .rsplit_once('@')
        .map_or(authority, |(_, host)| host);
    let after_host = match host_and_port.rsplit_once(']') {
        Some((_, after)) => after,
        None => host_and_port,
    };
    after_host.rsplit_once(':').map(|(_, port)| port)
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
    percent_decode_str(encoded)
        .decode_utf8()
        .map(|decoded| decoded.into_owned())
        .map_err(|_| error())
}

impl NbdUri {
    /// The URI of `address`, `export_name` and `tls`, escaped so that parsing it gives them
    /// back: the PSK identity as the URI's user (`tls-username=` for a Unix socket), every
    /// other TLS setting and the socket as query parameters.
    pub fn new(address: NbdAddress, export_name: String, tls: Option<ClientTls>) -> NbdUri {
        let secure = if tls.is_some() { "s" } else { "" };
        let export = utf8_percent_encode(&export_name, PATH_ESCAPED);
        let mut parameters = Vec::new();
        let user = tls.as_ref().and_then(|tls| tls.username.as_deref());
        let mut text = match &address {
            NbdAddress::Tcp { host, port } => {
                let user = user.map_or(String::new(), |user| {
                    format!("{}@", utf8_percent_encode(user, USER_ESCAPED))
                });
                // A host name is escaped like a user name (it is decoded when read); an IPv6
                // literal is written as it is, in its brackets.
                let host = match host.starts_with('[') {
                    true => host.to_string(),
                    false => utf8_percent_encode(host, USER_ESCAPED).to_string(),
                };
                format!("nbd{secure}://{user}{host}:{port}/{export}")
            }
            NbdAddress::Unix(socket) => {
                parameters.push(("socket", socket.to_string_lossy().into_owned()));
                if let Some(user) = user {
                    parameters.push(("tls-username", user.to_string()));
                }
                format!("nbd{secure}+unix:///{export}")
            }
        };
        if let Some(tls) = &tls {
            let paths = [
                ("tls-psk-file", &tls.psk_file),
                ("tls-certificates", &tls.certificates),
            ];
            for (key, path) in paths {
                if let Some(path) = path {
                    parameters.push((key, path.to_string_lossy().into_owned()));
                }
            }
            if let Some(hostname) = &tls.hostname {
                parameters.push(("tls-hostname", hostname.clone()));
            }
        }
        for (index, (key, value)) in parameters.iter().enumerate() {
            let separator = if index == 0 { '?' } else { '&' };
            let value = utf8_percent_encode(value, PATH_ESCAPED);
            text.push_str(&format!("{separator}{key}={value}"));
        }
        NbdUri {
            address,
            export_name,
            tls,
            text,
        }
    }
}

impl fmt::Display for NbdUri {
    fn fmt(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        formatter.write_str(&self.text)
    }
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
