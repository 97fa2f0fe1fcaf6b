//! Credentials from the standard places. The `object_store` builder reads the environment
//! (`AWS_ACCESS_KEY_ID`, `AWS_SECRET_ACCESS_KEY`, `AWS_SESSION_TOKEN`, web identity, ECS and
//! EC2 instance metadata); it does not read the shared credentials file, so this module adds
//! that: `AWS_SHARED_CREDENTIALS_FILE` or `~/.aws/credentials`, profile `AWS_PROFILE` or
//! `default`. Values are never logged or put in error messages.
//!
//! With none of these (nor web identity or container credentials) the client would ask the
//! instance-metadata service (169.254.169.254); it does so only when the URL asks for it
//! (`credentials=instance`) or names no `endpoint=` (AWS itself). Otherwise opening fails
//! with one line naming where credentials were looked for.

use std::path::PathBuf;

/// A key pair (and session token) found in the shared credentials file.
pub struct SharedCredentials {
    pub access_key_id: String,
    pub secret_access_key: String,
    pub session_token: Option<String>,
}

/// The shared credentials file's entry for the active profile, when the environment does not
/// already name a key. Returns None when there is no file or no such profile.
pub fn shared_file_credentials() -> Option<SharedCredentials> {
    if std::env::var_os("AWS_ACCESS_KEY_ID").is_some() {
        return None;
    }
    let (path, profile) = shared_file_place();
    let text = std::fs::read_to_string(path?).ok()?;
    parse_profile(&text, &profile)
}

/// Where the shared credentials file is looked for (None: no `HOME` to find it under) and
/// the profile read from it.
pub fn shared_file_place() -> (Option<PathBuf>, String) {
    let path = match std::env::var_os("AWS_SHARED_CREDENTIALS_FILE") {
        Some(path) => Some(PathBuf::from(path)),
        None => std::env::var_os("HOME").map(|home| PathBuf::from(home).join(".aws/credentials")),
    };
    let profile = std::env::var("AWS_PROFILE").unwrap_or_else(|_| "default".to_string());
    (path, profile)
}

/// Where the credentials were looked for, for the error that found none: the environment
/// variables, the shared credentials file and its profile.
pub fn places_looked() -> String {
    let (path, profile) = shared_file_place();
    let file = match path {
        Some(path) => format!("`{}`", path.display()),
        None => "`~/.aws/credentials` (HOME is not set)".to_string(),
    };
    format!(
        "AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY in the environment, profile `{profile}` \
         (AWS_PROFILE) of the credentials file {file} (AWS_SHARED_CREDENTIALS_FILE)"
    )
}

/// The entry of `profile` in an INI-style credentials file.
fn parse_profile(text: &str, profile: &str) -> Option<SharedCredentials> {
    let mut in_profile = false;
    let (mut key, mut secret, mut token) = (None, None, None);
    for line in text.lines() {
        let line = line.trim();
        if line.starts_with('#') || line.starts_with(';') || line.is_empty() {
            continue;
        }
        if let Some(section) = line.strip_prefix('[').and_then(|l| l.strip_suffix(']')) {
            in_profile = section.trim() == profile;
            continue;
        }
        if !in_profile {
            continue;
        }
        if let Some((name, value)) = line.split_once('=') {
            let value = value.trim().to_string();
            match name.trim() {
                "aws_access_key_id" => key = Some(value),
                "aws_secret_access_key" => secret = Some(value),
                "aws_session_token" => token = Some(value),
                _ => {}
            }
        }
    }
    Some(SharedCredentials {
        access_key_id: key?,
        secret_access_key: secret?,
        session_token: token,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    // Goal: the profile's keys are found and other profiles ignored. Method: parse a file with
    // two profiles and comments.
    #[test]
    fn the_named_profile_is_read_from_the_credentials_file() {
        let text = "# comment\n[default]\naws_access_key_id = AKDEFAULT\naws_secret_access_key = s1\n\
                    \n[work]\naws_access_key_id=AKWORK\naws_secret_access_key=s2\naws_session_token=t\n";
        let work = parse_profile(text, "work").unwrap();
        assert_eq!(work.access_key_id, "AKWORK");
        assert_eq!(work.secret_access_key, "s2");
        assert_eq!(work.session_token.as_deref(), Some("t"));
        let default = parse_profile(text, "default").unwrap();
        assert_eq!(default.access_key_id, "AKDEFAULT");
        assert!(default.session_token.is_none());
        assert!(parse_profile(text, "absent").is_none());
    }
}
