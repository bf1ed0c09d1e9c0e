//! LLM APIs: how many tokens a request will spend, what the answer says it spent, and
//! what the provider's headers say is left (docs/tokens.md). Pure functions, no I/O.
//!
//! * this module — the dialects and a request's estimate;
//! * [`headers`] — the token limits a provider announces in its answer's headers;
//! * [`usage`] — the usage an answer reports in its body, JSON or a stream of events,
//!   read as the bytes pass.

pub mod headers;
pub mod usage;

use serde::de::IgnoredAny;
use serde::Deserialize;

/// Bytes of a request body per estimated prompt token. A real tokenizer gives about
/// one token per four bytes of English, and a little more per byte of JSON's quotes
/// and keys, which the body also holds: dividing the whole body errs on the side of
/// more tokens, so a reservation is rarely short (BENCHMARKS.md has the error).
pub const BYTES_PER_TOKEN: u64 = 4;

/// The request format a group's upstream speaks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Dialect {
    /// OpenAI's API and the many servers that copy it (Azure OpenAI, Groq, vLLM…).
    #[serde(rename = "openai")]
    OpenAi,
    /// Anthropic's Messages API.
    Anthropic,
    /// Either, told apart by each request's path and headers.
    Auto,
}

impl Dialect {
    /// The dialect of one request: `Auto` decided by its path and headers; `None` when
    /// the request is not one of an LLM API's (it then counts as a request only).
    pub fn of_request(self, path: &str, headers: &http::HeaderMap) -> Option<Dialect> {
        match self {
            Dialect::Auto if headers.contains_key("anthropic-version") => Some(Dialect::Anthropic),
            Dialect::Auto if path.ends_with("/messages") => Some(Dialect::Anthropic),
            Dialect::Auto
                if ["/chat/completions", "/completions", "/responses"]
                    .iter()
                    .any(|p| path.ends_with(p)) =>
            {
                Some(Dialect::OpenAi)
            }
            Dialect::Auto => None,
            known => Some(known),
        }
    }
}

/// The tokens a request is expected to spend: reserved before it leaves, replaced by
/// the usage its answer reports.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Tokens {
    /// Prompt (input) tokens.
    pub input: u32,
    /// Completion (output) tokens.
    pub output: u32,
}

impl Tokens {
    /// Input and output together.
    pub fn total(self) -> u64 {
        u64::from(self.input) + u64::from(self.output)
    }
}

/// The fields of a request body that bound its output, in either dialect; everything
/// else is skipped unparsed.
#[derive(Deserialize)]
struct Limits {
    max_tokens: Option<u32>,
    max_completion_tokens: Option<u32>,
    max_output_tokens: Option<u32>,
    #[serde(flatten)]
    _rest: IgnoredAny,
}

/// The estimate of a request whose whole `body` was read: its bytes as prompt tokens
/// ([`BYTES_PER_TOKEN`]) and the output limit it names, else `max_output`. `None`
/// when the body is not a JSON object (the request then counts as a request only).
pub fn estimate(body: &[u8], max_output: u32) -> Option<Tokens> {
    let limits: Limits = serde_json::from_slice(body).ok()?;
    let output = limits
        .max_completion_tokens
        .or(limits.max_tokens)
        .or(limits.max_output_tokens)
        .unwrap_or(max_output);
    Some(Tokens {
        input: input_of(body.len() as u64),
        output,
    })
}

/// The estimate of a request whose body is too large to read before it leaves: its
/// `Content-Length` as prompt tokens, and `max_output`.
pub fn estimate_unread(content_length: u64, max_output: u32) -> Tokens {
    Tokens {
        input: input_of(content_length),
        output: max_output,
    }
}

fn input_of(bytes: u64) -> u32 {
    u32::try_from(bytes.div_ceil(BYTES_PER_TOKEN)).unwrap_or(u32::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_dialect_of_a_request() {
        let none = http::HeaderMap::new();
        let mut anthropic = http::HeaderMap::new();
        anthropic.insert("anthropic-version", "2023-06-01".parse().unwrap());
        let cases = [
            (
                Dialect::Auto,
                "/v1/chat/completions",
                &none,
                Some(Dialect::OpenAi),
            ),
            (
                Dialect::Auto,
                "/openai/deployments/x/chat/completions",
                &none,
                Some(Dialect::OpenAi),
            ),
            (Dialect::Auto, "/v1/responses", &none, Some(Dialect::OpenAi)),
            (
                Dialect::Auto,
                "/v1/messages",
                &none,
                Some(Dialect::Anthropic),
            ),
            (
                Dialect::Auto,
                "/anything",
                &anthropic,
                Some(Dialect::Anthropic),
            ),
            (Dialect::Auto, "/v1/models", &none, None),
            (Dialect::OpenAi, "/v1/models", &none, Some(Dialect::OpenAi)),
            (
                Dialect::Anthropic,
                "/v1/messages",
                &none,
                Some(Dialect::Anthropic),
            ),
        ];
        for (dialect, path, headers, want) in cases {
            assert_eq!(
                dialect.of_request(path, headers),
                want,
                "{dialect:?} {path}"
            );
        }
    }

    #[test]
    fn a_request_is_estimated_from_its_bytes_and_output_limit() {
        let cases: [(&str, Option<(u32, u32)>); 7] = [
            (
                r#"{"model":"m","messages":[],"max_tokens":100}"#,
                Some((11, 100)),
            ),
            (
                r#"{"model":"m","max_completion_tokens":7,"max_tokens":9}"#,
                Some((14, 7)),
            ),
            (r#"{"input":"hi","max_output_tokens":50}"#, Some((10, 50))),
            (r#"{"model":"m"}"#, Some((4, 4096))),
            (r#"{"max_tokens":"many"}"#, None),
            ("not json", None),
            ("[1,2]", None),
        ];
        for (body, want) in cases {
            let got = estimate(body.as_bytes(), 4096).map(|t| (t.input, t.output));
            assert_eq!(got, want, "{body}");
        }
        assert_eq!(
            estimate_unread(4097, 10),
            Tokens {
                input: 1025,
                output: 10
            }
        );
    }
}
