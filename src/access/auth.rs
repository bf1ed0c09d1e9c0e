//! Proxy authentication: who may use the proxy, from an htpasswd file of bcrypt hashes.
//!
//! With `[access] users = "/etc/tollgate/users"`, every request and every CONNECT
//! carries `Proxy-Authorization: Basic base64(name:password)` (RFC 9110 §11.7.4,
//! RFC 7617), checked by [`Users::verify`] against a file as `htpasswd -B` writes it:
//!
//! ```text
//! # Blank lines and lines starting with `#` are skipped.
//! alice:$2y$05$KMcD36pRByoBG5gGYCsNCORoG/mzi14ABDdmbeiGPje.YklUWXdE6
//! ```
//!
//! Only bcrypt (`$2a$`, `$2b$`, `$2y$`) is accepted: htpasswd's other formats (MD5
//! `$apr1$`, SHA-1 `{SHA}`, crypt, plain text) are fast to brute-force once the file
//! leaks, so [`Users::load`] refuses them and says how to make a bcrypt entry.
//!
//! A bcrypt check costs milliseconds by design (cost 5, htpasswd's default, is about
//! 2 ms; each step of cost doubles it), far too much to pay on every request of a
//! kept-alive client. A verified credential is therefore cached, keyed by the SHA-256
//! of the exact header value, and so is a failed one, for [`FAILURE_TTL`]: a client
//! that sends the same wrong credential again and again costs one check. [`Users::verify`] is
//! synchronous and blocks for one bcrypt check on a cache miss, so an async caller runs
//! it where blocking is allowed (e.g. `tokio::task::spawn_blocking`) when it matters.
//!
//! Nothing here logs or prints a password or a `Proxy-Authorization` value, and load
//! errors describe a bad hash without quoting it, since a "hash" in plain text is the
//! password itself.

use std::collections::hash_map::Entry;
use std::collections::HashMap;
use std::fmt;
use std::path::Path;
use std::sync::{Mutex, PoisonError, RwLock};
use std::time::Duration;

use base64::engine::general_purpose::STANDARD_PAD_INDIFFERENT;
use base64::Engine;
use http::HeaderValue;
use prometheus_client::metrics::counter::Counter;
use ring::digest::{digest, SHA256};
use tokio::time::Instant;

/// Cached credentials at most; when full, the cache is cleared.
///
/// Only verified credentials are cached, but one valid credential has many spellings
/// (the scheme's letter case, spaces, base64 padding), so the bound keeps a client that
/// knows one password from growing the cache without end. Clearing costs each active
/// client one more bcrypt check, and needs no bookkeeping on the hot path.
const CACHE_CAPACITY: usize = 1024;

/// How long a failed credential is answered from the cache: long enough that a client
/// retrying the same wrong credential costs one bcrypt check, short enough that a user
/// added to the file with that password (a reload makes a new `Users` anyway) is not
/// kept out for long.
pub const FAILURE_TTL: Duration = Duration::from_secs(10);

/// The cache key: SHA-256 of the exact `Proxy-Authorization` value.
///
/// A SHA-256 rather than a `std::hash` (SipHash with a per-process key) plus the header
/// bytes kept for comparison: the header bytes are the password in clear (base64 is
/// an encoding, not a hash), and SHA-256 keeps it out of the cache. The whole digest is
/// the map's key and is compared in full on a hit, so a wrong password could only
/// reach a cached user through a SHA-256 collision. `ring` is already built for rustls,
/// so the digest adds no crate.
type Key = [u8; 32];

/// The users allowed through the proxy, loaded from an htpasswd file of bcrypt hashes.
///
/// Immutable once loaded: to pick up a changed file, load a new `Users` and replace
/// the old one (the cache goes with it, so a removed user or a changed password takes
/// effect at once).
pub struct Users {
    /// Name → bcrypt hash.
    hashes: HashMap<String, String>,
    /// A real hash from the file, checked for unknown names so that they take as long
    /// as known names with a wrong password: the answer time does not tell which names
    /// exist.
    decoy: String,
    /// Verified credentials: header digest → user name.
    cache: RwLock<HashMap<Key, String>>,
    /// Failed credentials: header digest → when the failure stops being answered.
    failures: Mutex<HashMap<Key, Instant>>,
    /// bcrypt checks made (`tollgate_credential_checks_total`).
    checks: Counter,
}

// The proxy shares one `Users` between all connections.
const _: () = {
    const fn shared<T: Send + Sync>() {}
    shared::<Users>()
};

/// Why a users file could not be loaded, with where.
///
/// No message quotes a hash or a line, since either may be a password in clear.
#[derive(Debug, thiserror::Error)]
pub enum UsersError {
    /// The file could not be read (missing, no permission, not UTF-8).
    #[error("{file}: cannot read: {source}")]
    Read {
        /// The file name as given.
        file: String,
        /// The I/O error.
        source: std::io::Error,
    },
    /// A line that is neither blank, a comment nor `NAME:HASH`.
    #[error("{file}:{line}: expected NAME:HASH, but the line has no ':'")]
    NoColon {
        /// The file name as given.
        file: String,
        /// 1-based line.
        line: usize,
    },
    /// A line starting with `:`.
    #[error("{file}:{line}: the user name before ':' is empty")]
    EmptyName {
        /// The file name as given.
        file: String,
        /// 1-based line.
        line: usize,
    },
    /// A hash that is not a well-formed bcrypt hash.
    #[error(
        "{file}:{line}: user {name:?} has {found}; tollgate accepts bcrypt hashes only: \
         set the password again with `htpasswd -B {file} {name}` \
         (a new file: `htpasswd -B -c FILE NAME`)"
    )]
    NotBcrypt {
        /// The file name as given.
        file: String,
        /// 1-based line.
        line: usize,
        /// The user whose hash it is.
        name: String,
        /// What the hash looks like instead, e.g. "an MD5 hash ($apr1$, htpasswd -m)".
        found: String,
    },
    /// A name on two lines: which password would count is ambiguous.
    #[error("{file}:{line}: user {name:?} is already on line {first}")]
    Duplicate {
        /// The file name as given.
        file: String,
        /// 1-based line of the second entry.
        line: usize,
        /// The user name.
        name: String,
        /// 1-based line of the first entry.
        first: usize,
    },
    /// No `NAME:HASH` line at all: no one could use the proxy.
    #[error("{file}: no users: make one with `htpasswd -B -c {file} NAME`")]
    NoUsers {
        /// The file name as given.
        file: String,
    },
}

impl Users {
    /// Reads and checks an htpasswd file.
    pub fn load(path: &Path) -> Result<Users, UsersError> {
        let file = path.display().to_string();
        let text = std::fs::read_to_string(path).map_err(|source| UsersError::Read {
            file: file.clone(),
            source,
        })?;
        Users::parse(&text, &file)
    }

    /// Parses and checks htpasswd text; `file` names it in errors.
    pub fn parse(text: &str, file: &str) -> Result<Users, UsersError> {
        // Name → (hash, line), the line for the duplicate error.
        let mut entries: HashMap<String, (String, usize)> = HashMap::new();
        let mut decoy = None;
        for (index, line) in text.lines().enumerate() {
            let at = index + 1;
            let line = line.trim();
            if line.is_empty() || line.starts_with('#') {
                continue;
            }
            let Some((name, hash)) = line.split_once(':') else {
                return Err(UsersError::NoColon {
                    file: file.to_string(),
                    line: at,
                });
            };
            if name.is_empty() {
                return Err(UsersError::EmptyName {
                    file: file.to_string(),
                    line: at,
                });
            }
            if let Some(found) = not_bcrypt(hash) {
                return Err(UsersError::NotBcrypt {
                    file: file.to_string(),
                    line: at,
                    name: name.to_string(),
                    found,
                });
            }
            match entries.entry(name.to_string()) {
                Entry::Occupied(first) => {
                    return Err(UsersError::Duplicate {
                        file: file.to_string(),
                        line: at,
                        name: name.to_string(),
                        first: first.get().1,
                    })
                }
                Entry::Vacant(slot) => {
                    slot.insert((hash.to_string(), at));
                }
            }
            decoy.get_or_insert_with(|| hash.to_string());
        }
        let Some(decoy) = decoy else {
            return Err(UsersError::NoUsers {
                file: file.to_string(),
            });
        };
        Ok(Users {
            hashes: entries
                .into_iter()
                .map(|(name, (hash, _))| (name, hash))
                .collect(),
            decoy,
            cache: RwLock::new(HashMap::new()),
            failures: Mutex::new(HashMap::new()),
            checks: Counter::default(),
        })
    }

    /// The user a `Proxy-Authorization` value authenticates, or `None`.
    ///
    /// `None` for a missing header, a scheme other than `Basic` (matched without regard
    /// to case, RFC 9110 §11.1), bad base64, no `:` in the decoded text, an unknown user
    /// or a wrong password. A cache miss costs one bcrypt check (milliseconds; see the
    /// module documentation), also for an unknown user.
    pub fn verify(&self, header: Option<&HeaderValue>) -> Option<String> {
        let value = header?.as_bytes();
        let token = basic_token(value)?;
        let key = cache_key(value);
        if let Some(name) = self.cached_key(&key) {
            return Some(name);
        }
        if self.failed_lately(&key) {
            return None;
        }

        let Some(decoded) = decode(token) else {
            tracing::debug!("proxy authentication: the Basic credentials are malformed");
            return None;
        };
        let (name, password) = split(&decoded);
        let Some((name, hash)) = self.known(name) else {
            self.bcrypt(password, &self.decoy);
            self.failed(key);
            // The name may be a password typed in the wrong field: not logged.
            tracing::debug!("proxy authentication: unknown user");
            return None;
        };
        if !self.bcrypt(password, hash) {
            self.failed(key);
            tracing::debug!(user = %name, "proxy authentication: wrong password");
            return None;
        }
        self.remember(key, name);
        Some(name.clone())
    }

    /// The bcrypt cost of the check [`Users::verify`] makes of a credential: that of its
    /// user's hash, or of the hash an unknown name is checked against. A credential
    /// that cannot be decoded is refused without a check: its cost is that of the
    /// unknown name too, which is all a bound needs.
    pub fn cost_of(&self, header: Option<&HeaderValue>) -> u32 {
        let decoded = header.and_then(|h| decode(basic_token(h.as_bytes())?));
        let known = decoded.as_deref().and_then(|d| self.known(split(d).0));
        cost(known.map_or(&self.decoy, |(_, hash)| hash))
    }

    /// The name and hash of the user `name` names, if the file has it.
    fn known(&self, name: &[u8]) -> Option<(&String, &String)> {
        let name = std::str::from_utf8(name).ok()?;
        self.hashes.get_key_value(name)
    }

    /// The user a credential verified before authenticates: [`Users::verify`] without
    /// the bcrypt check, so an async caller can answer at once when this says `Some`
    /// and take the blocking path otherwise.
    pub fn cached(&self, header: Option<&HeaderValue>) -> Option<String> {
        self.cached_key(&cache_key(header?.as_bytes()))
    }

    /// Whether a credential failed within [`FAILURE_TTL`]: answered at once, without
    /// waiting for a check.
    pub fn failed_before(&self, header: Option<&HeaderValue>) -> bool {
        header.is_some_and(|h| self.failed_lately(&cache_key(h.as_bytes())))
    }

    fn cached_key(&self, key: &Key) -> Option<String> {
        self.cache
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .get(key)
            .cloned()
    }

    /// Counts its bcrypt checks in `checks` (the metric's counter) from now on.
    pub fn count_checks_in(mut self, checks: Counter) -> Users {
        self.checks = checks;
        self
    }

    /// Whether `key` failed within [`FAILURE_TTL`].
    fn failed_lately(&self, key: &Key) -> bool {
        let failures = self.failures.lock().unwrap_or_else(PoisonError::into_inner);
        failures
            .get(key)
            .is_some_and(|until| Instant::now() < *until)
    }

    /// Remembers a failed credential for [`FAILURE_TTL`]; bounded as the cache is.
    fn failed(&self, key: Key) {
        let mut failures = self.failures.lock().unwrap_or_else(PoisonError::into_inner);
        if failures.len() >= CACHE_CAPACITY {
            let now = Instant::now();
            failures.retain(|_, until| now < *until);
            if failures.len() >= CACHE_CAPACITY {
                failures.clear();
            }
        }
        failures.insert(key, Instant::now() + FAILURE_TTL);
    }

    /// Checks a password against a hash that [`Users::parse`] has already validated.
    fn bcrypt(&self, password: &[u8], hash: &str) -> bool {
        self.checks.inc();
        // Passwords past 72 bytes are truncated, as by htpasswd and every other bcrypt,
        // so a file made elsewhere verifies the same here. An error can only come from
        // a malformed hash, which `parse` refuses.
        bcrypt::verify(password, hash).unwrap_or(false)
    }

    /// Caches a verified credential.
    fn remember(&self, key: Key, name: &str) {
        let mut cache = self.cache.write().unwrap_or_else(PoisonError::into_inner);
        if cache.len() >= CACHE_CAPACITY && !cache.contains_key(&key) {
            cache.clear();
        }
        cache.insert(key, name.to_string());
    }
}

// Names only: the hashes and cached credentials stay out of logs and panics.
impl fmt::Debug for Users {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut names: Vec<&str> = self.hashes.keys().map(String::as_str).collect();
        names.sort_unstable();
        f.debug_struct("Users").field("names", &names).finish()
    }
}

/// The token68 of a `Basic` credentials value, or `None` for another scheme.
fn basic_token(value: &[u8]) -> Option<&[u8]> {
    let value = value.trim_ascii();
    let space = value.iter().position(|&b| b == b' ')?;
    let (scheme, rest) = value.split_at(space);
    if !scheme.eq_ignore_ascii_case(b"Basic") {
        return None;
    }
    // `credentials = auth-scheme [ 1*SP token68 ]`: one or more spaces.
    let token = rest.trim_ascii_start();
    (!token.is_empty()).then_some(token)
}

/// `user-id:password` from a `Basic` token, when it is base64 and has the `:`.
fn decode(token: &[u8]) -> Option<Vec<u8>> {
    let decoded = STANDARD_PAD_INDIFFERENT.decode(token).ok()?;
    decoded.contains(&b':').then_some(decoded)
}

/// The user-id and the password of decoded credentials. RFC 7617: the user-id cannot
/// contain ':', the password can.
fn split(decoded: &[u8]) -> (&[u8], &[u8]) {
    let colon = decoded
        .iter()
        .position(|&b| b == b':')
        .unwrap_or(decoded.len());
    (
        &decoded[..colon],
        decoded.get(colon + 1..).unwrap_or_default(),
    )
}

/// The cost of a hash [`Users::parse`] has accepted: `$2y$NN$...`.
fn cost(hash: &str) -> u32 {
    hash.get(4..6).and_then(|n| n.parse().ok()).unwrap_or(31)
}

fn cache_key(value: &[u8]) -> Key {
    let mut key = [0; 32];
    key.copy_from_slice(digest(&SHA256, value).as_ref());
    key
}

/// What `hash` is instead of a usable bcrypt hash, or `None` when it is one.
///
/// The description never quotes the hash: plain text would be the password.
fn not_bcrypt(hash: &str) -> Option<String> {
    if ["$2a$", "$2b$", "$2y$"].iter().any(|p| hash.starts_with(p)) {
        return match hash.parse::<bcrypt::HashParts>() {
            // bcrypt itself refuses costs outside 4..=31 at verification.
            Ok(parts) if (4..=31).contains(&parts.get_cost()) => None,
            Ok(parts) => Some(format!(
                "a bcrypt hash of cost {}, outside 4 to 31",
                parts.get_cost()
            )),
            Err(bcrypt::BcryptError::InvalidHash(why)) => {
                Some(format!("a malformed bcrypt hash ({why})"))
            }
            Err(_) => Some("a malformed bcrypt hash".to_string()),
        };
    }
    let found = if hash.is_empty() {
        "an empty hash"
    } else if hash.starts_with("$apr1$") {
        "an MD5 hash ($apr1$, htpasswd's default or -m)"
    } else if hash.starts_with("{SHA}") {
        "a SHA-1 hash ({SHA}, htpasswd -s)"
    } else if hash.starts_with("$2x$") {
        "a $2x$ hash (bcrypt from a crypt_blowfish with a known flaw)"
    } else if hash.starts_with("$1$") {
        "an MD5-crypt hash ($1$)"
    } else if hash.starts_with("$5$") {
        "a SHA-256-crypt hash ($5$, htpasswd -2)"
    } else if hash.starts_with("$6$") {
        "a SHA-512-crypt hash ($6$, htpasswd -5)"
    } else if hash.starts_with('$') {
        "a crypt hash of another kind"
    } else if hash.len() == 13
        && hash
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'.' || b == b'/')
    {
        "a DES crypt hash (htpasswd -d) or plain text"
    } else {
        "plain text or an unknown kind of hash (htpasswd -p)"
    };
    Some(found.to_string())
}

#[cfg(test)]
mod tests {
    use std::io::Write;
    use std::sync::OnceLock;

    use super::*;

    /// Made by `htpasswd -nbB alice 'open sesame'` (Apache 2.4.71, cost 5): the
    /// `$2y$` form and cost that real files have.
    const ALICE: &str = "alice:$2y$05$KMcD36pRByoBG5gGYCsNCORoG/mzi14ABDdmbeiGPje.YklUWXdE6";

    /// bob's password contains ':', which RFC 7617 allows in passwords.
    fn users_file() -> &'static str {
        static TEXT: OnceLock<String> = OnceLock::new();
        TEXT.get_or_init(|| {
            let bob = bcrypt::hash("pa:ss", 4).unwrap();
            let carol = bcrypt::hash("", 4).unwrap();
            format!(
                "# tollgate users\n\n{ALICE}\r\n  # indented comment\nbob:{bob}\ncarol:{carol}\n"
            )
        })
    }

    /// Loads `text` through a real file, as the proxy does.
    fn load(text: &str) -> Users {
        let mut file = tempfile::NamedTempFile::new().unwrap();
        file.write_all(text.as_bytes()).unwrap();
        Users::load(file.path()).unwrap()
    }

    fn basic(credentials: &str) -> HeaderValue {
        let token = base64::engine::general_purpose::STANDARD.encode(credentials);
        HeaderValue::from_str(&format!("Basic {token}")).unwrap()
    }

    fn checks(users: &Users) -> usize {
        users.checks.get() as usize
    }

    #[test]
    fn parse_errors_name_the_line() {
        let good = "$2y$04$8eZjFjdPzbc5quoH5R2ziuoSMdNfzbNK4hnoq8sVbZNeteNqolMd6";
        let dup = format!("alice:{good}\nbob:{good}\n\n# alice again\nalice:{good}\n");
        let bad_cost = format!("{}99{}", &good[..4], &good[6..]);
        let cases: &[(&str, &str, &[&str])] = &[
            ("alice\n", "users:1:", &["no ':'"]),
            ("# users\n\n:$2y$\n", "users:3:", &["name", "empty"]),
            (
                "alice:$apr1$0f/xOdW1$ATT5pDbhzUphA0pMRfzGp0",
                "users:1:",
                &[
                    "user \"alice\"",
                    "MD5",
                    "bcrypt hashes only",
                    "htpasswd -B users alice",
                    "htpasswd -B -c FILE NAME",
                ],
            ),
            (
                "dave:{SHA}EfatjsUqKYSrqv18O1FlA3hcIHI=",
                "users:1:",
                &["SHA-1", "bcrypt hashes only"],
            ),
            ("erin:XcY.udfF6JQfI", "users:1:", &["DES crypt"]),
            ("f:$1$abc$def", "users:1:", &["MD5-crypt"]),
            (
                "g:$5$4DEGvlSmjDI/IV2R$c6XXIw4v5E",
                "users:1:",
                &["SHA-256-crypt"],
            ),
            (
                "h:$6$AWlm/ersDR4BTNCI$CGv63K6etW",
                "users:1:",
                &["SHA-512-crypt"],
            ),
            ("i:$y$j9T$abc", "users:1:", &["another kind"]),
            ("frank:x", "users:1:", &["plain text", "bcrypt hashes only"]),
            ("frank:", "users:1:", &["empty hash"]),
            ("x:$2x$04$8eZjFjdPzbc5quoH5R2zi", "users:1:", &["$2x$"]),
            ("x:$2y$05$KMcD36pRBy", "users:1:", &["malformed bcrypt"]),
            (&dup, "users:5:", &["\"alice\"", "already on line 1"]),
            ("", "users:", &["no users", "htpasswd -B -c users NAME"]),
            ("# nobody yet\n\n   \n", "users:", &["no users"]),
        ];
        for (text, at, phrases) in cases {
            let error = Users::parse(text, "users").unwrap_err().to_string();
            assert!(error.starts_with(at), "{text:?}: {error}");
            for phrase in *phrases {
                assert!(error.contains(phrase), "{text:?}: {error}");
            }
        }
        let error = Users::parse(&format!("x:{bad_cost}"), "users").unwrap_err();
        assert!(error.to_string().contains("cost 99"), "{error}");
    }

    #[test]
    fn errors_never_quote_a_password() {
        for text in ["alice:s3cret-pw", "s3cret-pw", "alice:$2y$s3cret-pw"] {
            let error = Users::parse(text, "users").unwrap_err().to_string();
            assert!(!error.contains("s3cret"), "{error}");
        }
    }

    #[test]
    fn unreadable_file() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("missing");
        let error = Users::load(&path).unwrap_err();
        assert!(matches!(error, UsersError::Read { .. }));
        assert!(
            error
                .to_string()
                .starts_with(&format!("{}: cannot read", path.display())),
            "{error}"
        );
    }

    #[test]
    fn loads_comments_blank_lines_and_crlf() {
        let users = load(users_file());
        assert_eq!(
            format!("{users:?}"),
            r#"Users { names: ["alice", "bob", "carol"] }"#
        );
    }

    #[test]
    fn verify() {
        let users_file = users_file();
        let token = base64::engine::general_purpose::STANDARD.encode("alice:open sesame");
        let raw = |s: &str| Some(HeaderValue::from_str(s).unwrap());
        let cases: &[(&str, Option<HeaderValue>, Option<&str>)] = &[
            ("good", Some(basic("alice:open sesame")), Some("alice")),
            (
                "lower-case scheme",
                raw(&format!("basic {token}")),
                Some("alice"),
            ),
            (
                "upper-case scheme",
                raw(&format!("BASIC {token}")),
                Some("alice"),
            ),
            (
                "several spaces",
                raw(&format!("Basic   {token}")),
                Some("alice"),
            ),
            (
                "no padding",
                raw(&format!("Basic {}", token.trim_end_matches('='))),
                Some("alice"),
            ),
            ("password with ':'", Some(basic("bob:pa:ss")), Some("bob")),
            ("empty password", Some(basic("carol:")), Some("carol")),
            ("missing", None, None),
            ("other scheme", raw(&format!("Bearer {token}")), None),
            ("scheme only", raw("Basic"), None),
            ("scheme and spaces", raw("Basic   "), None),
            ("bad base64", raw("Basic !!not-base64!!"), None),
            ("no colon", Some(basic("alice")), None),
            ("unknown user", Some(basic("mallory:open sesame")), None),
            ("wrong password", Some(basic("alice:open sesame!")), None),
            ("password cut at ':'", Some(basic("bob:pa")), None),
            ("empty for non-empty", Some(basic("alice:")), None),
            ("name case matters", Some(basic("Alice:open sesame")), None),
        ];
        for (what, header, expected) in cases {
            let users = load(users_file);
            assert_eq!(
                users.verify(header.as_ref()).as_deref(),
                *expected,
                "{what}"
            );
        }
    }

    #[test]
    fn a_credential_costs_what_its_user_s_hash_costs() {
        let users = load(users_file());
        let raw = |s: &str| Some(HeaderValue::from_str(s).unwrap());
        assert_eq!(users.cost_of(Some(&basic("alice:anything"))), 5);
        assert_eq!(users.cost_of(Some(&basic("bob:pa:ss"))), 4);
        // Unknown or malformed: the hash an unknown name is checked against (alice's).
        assert_eq!(users.cost_of(Some(&basic("mallory:x"))), 5);
        assert_eq!(users.cost_of(raw("Basic !!not-base64!!").as_ref()), 5);
        assert_eq!(users.cost_of(None), 5);
        assert_eq!(checks(&users), 0, "no check is made to tell");
    }

    #[test]
    fn second_verify_hits_the_cache() {
        let users = load(users_file());
        let good = basic("alice:open sesame");
        assert_eq!(users.verify(Some(&good)).as_deref(), Some("alice"));
        assert_eq!(checks(&users), 1);
        assert_eq!(users.verify(Some(&good)).as_deref(), Some("alice"));
        assert_eq!(checks(&users), 1, "the second check is a cache hit");
    }

    #[test]
    fn a_failure_is_answered_from_the_cache_until_it_expires() {
        let users = load(users_file());
        let wrong = basic("alice:guess");
        let unknown = basic("mallory:guess");
        for _ in 1..=3 {
            assert_eq!(users.verify(Some(&wrong)), None);
            // Unknown users cost a bcrypt check too, so timing does not tell them apart.
            assert_eq!(users.verify(Some(&unknown)), None);
            assert_eq!(checks(&users), 2, "one check per wrong credential");
        }
        // The good password is checked, not refused from the cache of another spelling.
        assert!(users.verify(Some(&basic("alice:open sesame"))).is_some());
        assert_eq!(checks(&users), 3);
    }

    #[tokio::test(start_paused = true)]
    async fn a_failure_is_checked_again_after_its_ttl() {
        let users = load(users_file());
        let wrong = basic("alice:guess");
        assert_eq!(users.verify(Some(&wrong)), None);
        tokio::time::advance(FAILURE_TTL).await;
        assert_eq!(users.verify(Some(&wrong)), None);
        assert_eq!(checks(&users), 2);
    }

    #[test]
    fn a_cached_user_does_not_accept_another_password() {
        let users = load(users_file());
        assert!(users.verify(Some(&basic("alice:open sesame"))).is_some());
        for other in [
            "alice:open sesame ",
            "alice:Open sesame",
            "alice:",
            "bob:open sesame",
        ] {
            assert_eq!(users.verify(Some(&basic(other))), None, "{other}");
        }
        assert_eq!(
            checks(&users),
            5,
            "each other password is checked by bcrypt"
        );
    }

    #[test]
    fn the_cache_is_bounded() {
        let users = load(users_file());
        for n in 0..CACHE_CAPACITY {
            users.remember(cache_key(n.to_string().as_bytes()), "alice");
        }
        assert_eq!(users.cache.read().unwrap().len(), CACHE_CAPACITY);
        // A key already cached does not clear it.
        users.remember(cache_key(b"0"), "alice");
        assert_eq!(users.cache.read().unwrap().len(), CACHE_CAPACITY);
        users.remember(cache_key(b"one more"), "alice");
        assert_eq!(users.cache.read().unwrap().len(), 1);
    }
}
