//! Request paths in one form, so that routes and cost rules cannot be side-stepped.
//!
//! `/api/../internal`, `/api/%2e%2e/internal` and `/api/./x` name other resources than
//! they seem to; `/%73earch` and `//search` are `/search` to most servers. A route's
//! prefix and a cost rule's `path_prefix` are matched against the normalised path:
//! percent-encoded unreserved characters decoded (RFC 3986 §6.2.2.2, which makes the
//! two spellings the same URI), then dot segments removed (§5.2.4). An encoded `/`
//! (`%2f`) is kept as it is by that rule and would then mean one thing to tollgate and
//! another to an upstream that decodes it, so a routed path carrying one is refused. So
//! is a backslash, written or encoded (`\`, `%5c`: a separator to some servers), and a
//! dot segment with parameters (`..;`, `.;`: a dot segment to servlet containers).

use std::fmt::Write;

/// Why a path is refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PathError {
    /// Its dot segments climb above the root.
    #[error("the path {0:?} climbs above its root with '..'")]
    Climbs(String),
    /// It carries an encoded slash.
    #[error("the path {0:?} carries an encoded '/' (%2F)")]
    EncodedSlash(String),
    /// It carries a backslash, which some servers take for a `/`.
    #[error("the path {0:?} carries a backslash ('\\' or %5C)")]
    Backslash(String),
    /// A segment is a dot segment with parameters (`..;x`), which some servers resolve.
    #[error("the path {0:?} has a dot segment with parameters ('..;' or '.;')")]
    DotParameters(String),
}

/// `path` (the path part of a URI, query excluded) normalised: unreserved characters
/// decoded, dot segments removed. Refused when it climbs above `/` or carries `%2F`.
pub fn normalize(path: &str) -> Result<String, PathError> {
    let decoded = decode_unreserved(path);
    if decoded.contains("%2F") {
        return Err(PathError::EncodedSlash(path.to_string()));
    }
    if decoded.contains('\\') || decoded.contains("%5C") {
        return Err(PathError::Backslash(path.to_string()));
    }
    let dot_parameters = |segment: &str| segment.starts_with("..;") || segment.starts_with(".;");
    if decoded.split('/').any(dot_parameters) {
        return Err(PathError::DotParameters(path.to_string()));
    }
    remove_dot_segments(&decoded).ok_or_else(|| PathError::Climbs(path.to_string()))
}

/// The form cost rules are matched against: runs of `/` taken as one (`//search` is
/// `/search` to most servers), unreserved characters decoded, then dot segments
/// removed, a `..` above the root dropped as RFC 3986 drops it (an upstream that
/// resolves `/../search` serves `/search`).
pub fn for_matching(path: &str) -> String {
    let mut merged = String::with_capacity(path.len());
    for c in decode_unreserved(path).chars() {
        if !(c == '/' && merged.ends_with('/')) {
            merged.push(c);
        }
    }
    let mut depth_kept = Vec::new();
    for segment in merged.split('/').skip(1) {
        match segment {
            "." => {}
            ".." => {
                depth_kept.pop();
            }
            _ => depth_kept.push(segment),
        }
    }
    format!("/{}", depth_kept.join("/"))
}

/// Percent-encodings of unreserved characters (`A-Z a-z 0-9 - . _ ~`) decoded; every
/// other encoding kept, its hex digits in upper case.
fn decode_unreserved(path: &str) -> String {
    let bytes = path.as_bytes();
    let mut out = String::with_capacity(path.len());
    let mut i = 0;
    while i < bytes.len() {
        let hex = |at: usize| (bytes.get(at)).and_then(|b| (*b as char).to_digit(16));
        match (bytes[i], hex(i + 1), hex(i + 2)) {
            (b'%', Some(high), Some(low)) => {
                let byte = (high * 16 + low) as u8;
                if byte.is_ascii_alphanumeric() || matches!(byte, b'-' | b'.' | b'_' | b'~') {
                    out.push(byte as char);
                } else {
                    let _ = write!(out, "%{byte:02X}");
                }
                i += 3;
            }
            _ => {
                // A path is ASCII once hyper has parsed it; anything else goes as it came.
                out.push(bytes[i] as char);
                i += 1;
            }
        }
    }
    out
}

/// RFC 3986 §5.2.4 for an absolute path; `None` when a `..` would go above the root
/// (the RFC drops such segments silently; a proxy that did would let `/api/../x`
/// reach `/x` under a route that only means `/api`).
fn remove_dot_segments(path: &str) -> Option<String> {
    let mut segments: Vec<&str> = Vec::new();
    let mut parts = path.split('/').peekable();
    // An absolute path starts with `/`: the first split part is empty.
    if path.starts_with('/') {
        parts.next();
    }
    let mut trailing_slash = false;
    while let Some(segment) = parts.next() {
        let last = parts.peek().is_none();
        match segment {
            "." => trailing_slash = last,
            ".." => {
                segments.pop()?;
                trailing_slash = last;
            }
            _ => {
                segments.push(segment);
                trailing_slash = false;
            }
        }
    }
    let mut out = String::with_capacity(path.len());
    for segment in &segments {
        out.push('/');
        out.push_str(segment);
    }
    if trailing_slash || out.is_empty() {
        out.push('/');
    }
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paths_are_normalised_or_refused() {
        let cases: &[(&str, Result<&str, ()>)] = &[
            ("/", Ok("/")),
            ("/api/x", Ok("/api/x")),
            ("/api/x/", Ok("/api/x/")),
            ("/api/./x", Ok("/api/x")),
            ("/api/x/.", Ok("/api/x/")),
            ("/api/x/..", Ok("/api/")),
            ("/api/a/../b", Ok("/api/b")),
            ("/api/%2e/x", Ok("/api/x")),
            ("/api/%2E%2e/x", Ok("/x")),
            ("/api/../internal", Ok("/internal")),
            ("/%73earch", Ok("/search")),
            ("/a%20b", Ok("/a%20b")),
            ("/a%3fb", Ok("/a%3Fb")),
            ("/%7Euser", Ok("/~user")),
            ("/..", Err(())),
            ("/api/../../x", Err(())),
            ("/%2e%2e/x", Err(())),
            ("/api/..%2finternal", Err(())),
            ("/api/a%2Fb", Err(())),
            ("/api/..;/internal", Err(())),
            ("/api/.;/x", Err(())),
            ("/api/%2e%2e;x/internal", Err(())),
            ("/api/..\\internal", Err(())),
            ("/api/..%5cinternal", Err(())),
            ("/api/..%5Cinternal", Err(())),
            ("/api/a;b/c", Ok("/api/a;b/c")),
            ("/api/..x/y", Ok("/api/..x/y")),
        ];
        for (path, want) in cases {
            let got = normalize(path);
            match want {
                Ok(want) => assert_eq!(got.as_deref(), Ok(*want), "{path}"),
                Err(()) => assert!(got.is_err(), "{path}: {got:?}"),
            }
        }
    }

    #[test]
    fn cost_rules_see_one_spelling_of_a_path() {
        for path in [
            "/search",
            "//search",
            "/./search",
            "/%73earch",
            "/x/../search",
            "///search",
            "/../search",
            "/x//../search",
        ] {
            assert_eq!(for_matching(path), "/search", "{path}");
        }
        assert_eq!(for_matching("/search/"), "/search/");
    }
}
