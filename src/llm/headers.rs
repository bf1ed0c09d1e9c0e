//! The token limits an LLM API announces with each answer.
//!
//! * OpenAI (and Azure OpenAI, Groq, compatible servers): `x-ratelimit-limit-tokens`,
//!   `x-ratelimit-remaining-tokens`, `x-ratelimit-reset-tokens`, the reset a Go-style
//!   duration until the bucket is full again (`1s`, `6m0s`, `12ms`, `2m59.56s`) or,
//!   from Azure, whole seconds;
//! * Anthropic: `anthropic-ratelimit-{tokens,input-tokens,output-tokens}-{limit,
//!   remaining,reset}`, the reset an RFC 3339 time.
//!
//! Both providers describe a token bucket that refills continuously: `limit` tokens
//! when full, `remaining` now, full again after `reset`.

use std::time::{Duration, SystemTime};

use http::HeaderMap;

/// The limits one kind of token has.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Announced {
    /// Tokens the bucket holds when full (per minute, as both providers document).
    pub limit: u64,
    /// Tokens left now.
    pub remaining: u64,
    /// Until the bucket is full again.
    pub reset: Duration,
}

/// What one answer's headers announce, by kind of token.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct TokenLimits {
    /// Input and output tokens together.
    pub total: Option<Announced>,
    /// Input (prompt) tokens.
    pub input: Option<Announced>,
    /// Output (completion) tokens.
    pub output: Option<Announced>,
}

impl TokenLimits {
    /// Whether fewer tokens of some kind remain than `estimate` asks for: a refusal
    /// that announces so was on tokens.
    pub fn short_of(&self, estimate: crate::llm::Tokens) -> bool {
        let short = |said: Option<Announced>, n: u64| said.is_some_and(|a| a.remaining < n);
        short(self.total, estimate.total())
            || short(self.input, u64::from(estimate.input))
            || short(self.output, u64::from(estimate.output))
    }

    /// Whether the headers announced nothing.
    pub fn is_empty(&self) -> bool {
        self.total.is_none() && self.input.is_none() && self.output.is_none()
    }
}

/// The token limits `headers` announce, read at `now` (an Anthropic reset is a time).
pub fn parse(headers: &HeaderMap, now: SystemTime) -> TokenLimits {
    let openai = announced(
        headers,
        [
            "x-ratelimit-limit-tokens",
            "x-ratelimit-remaining-tokens",
            "x-ratelimit-reset-tokens",
        ],
        go_duration,
    );
    let anthropic = |kind: &str| {
        let name = |part: &str| format!("anthropic-ratelimit-{kind}-{part}");
        let [l, r, s] = [name("limit"), name("remaining"), name("reset")];
        announced(headers, [&l, &r, &s], |v| until(v, now))
    };
    let (input, output) = (anthropic("input-tokens"), anthropic("output-tokens"));
    // Anthropic's `tokens-*` tell the most restrictive of its limits, which are
    // input's and output's when it sends those.
    let either = input.is_some() || output.is_some();
    TokenLimits {
        total: openai.or_else(|| (!either).then(|| anthropic("tokens")).flatten()),
        input,
        output,
    }
}

fn announced(
    headers: &HeaderMap,
    [limit, remaining, reset]: [&str; 3],
    reset_of: impl Fn(&str) -> Option<Duration>,
) -> Option<Announced> {
    let text = |name: &str| headers.get(name)?.to_str().ok().map(str::trim);
    let count = |name: &str| text(name)?.parse::<u64>().ok();
    let limit = count(limit)?;
    let remaining = count(remaining)?.min(limit);
    let reset = match text(reset) {
        Some(value) => reset_of(value)?,
        // Full: nothing to wait for.
        None if remaining == limit => Duration::ZERO,
        None => return None,
    };
    Some(Announced {
        limit,
        remaining,
        reset,
    })
}

/// A Go duration (`6m0s`, `12ms`, `2m59.56s`, `1h2m`), or bare seconds (`20`, `0.5`).
pub fn go_duration(text: &str) -> Option<Duration> {
    if let Ok(seconds) = text.parse::<f64>() {
        return Duration::try_from_secs_f64(seconds).ok();
    }
    let mut rest = text;
    let mut total = 0.0;
    while !rest.is_empty() {
        let digits = rest
            .find(|c: char| !(c.is_ascii_digit() || c == '.'))
            .filter(|&n| n > 0)?;
        let value: f64 = rest[..digits].parse().ok()?;
        rest = &rest[digits..];
        let unit = rest
            .find(|c: char| c.is_ascii_digit() || c == '.')
            .unwrap_or(rest.len());
        let seconds = match &rest[..unit] {
            "h" => 3600.0,
            "m" => 60.0,
            "s" => 1.0,
            "ms" => 1e-3,
            "us" | "µs" => 1e-6,
            "ns" => 1e-9,
            _ => return None,
        };
        total += value * seconds;
        rest = &rest[unit..];
    }
    Duration::try_from_secs_f64(total).ok()
}

/// The time from `now` to an RFC 3339 `time` (zero when it has passed).
fn until(time: &str, now: SystemTime) -> Option<Duration> {
    let at = humantime::parse_rfc3339_weak(time).ok()?;
    Some(at.duration_since(now).unwrap_or_default())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn go_durations() {
        let ms = Duration::from_millis;
        let cases = [
            ("1s", Some(ms(1000))),
            ("6m0s", Some(ms(360_000))),
            ("12ms", Some(ms(12))),
            ("2m59.56s", Some(ms(179_560))),
            ("1h2m", Some(ms(3_720_000))),
            ("20", Some(ms(20_000))),
            ("0.5", Some(ms(500))),
            ("7m", Some(ms(420_000))),
            ("", Some(ms(0))),
            ("s", None),
            ("3x", None),
            ("1.2.3s", None),
        ];
        for (text, want) in cases {
            let got = go_duration(text).map(|d| Duration::from_micros(d.as_micros() as u64));
            assert_eq!(got, want, "{text:?}");
        }
    }

    fn headers(pairs: &[(&str, &str)]) -> HeaderMap {
        pairs
            .iter()
            .map(|(k, v)| (k.parse().unwrap(), v.parse().unwrap()))
            .collect()
    }

    #[test]
    fn openai_headers_as_the_api_sends_them() {
        // From OpenAI's rate-limit guide.
        let h = headers(&[
            ("x-ratelimit-limit-requests", "60"),
            ("x-ratelimit-limit-tokens", "150000"),
            ("x-ratelimit-remaining-requests", "59"),
            ("x-ratelimit-remaining-tokens", "149984"),
            ("x-ratelimit-reset-requests", "1s"),
            ("x-ratelimit-reset-tokens", "6m0s"),
        ]);
        let got = parse(&h, SystemTime::UNIX_EPOCH);
        assert_eq!(
            got.total,
            Some(Announced {
                limit: 150_000,
                remaining: 149_984,
                reset: Duration::from_secs(360)
            })
        );
        assert_eq!((got.input, got.output), (None, None));
        // Azure: whole seconds.
        let azure = headers(&[
            ("x-ratelimit-limit-tokens", "1000"),
            ("x-ratelimit-remaining-tokens", "400"),
            ("x-ratelimit-reset-tokens", "36"),
        ]);
        let got = parse(&azure, SystemTime::UNIX_EPOCH).total.unwrap();
        assert_eq!(got.reset, Duration::from_secs(36));
    }

    #[test]
    fn anthropic_headers_as_the_api_sends_them() {
        let now = humantime::parse_rfc3339("2025-01-01T12:00:00Z").unwrap();
        let h = headers(&[
            ("anthropic-ratelimit-requests-limit", "50"),
            ("anthropic-ratelimit-requests-remaining", "49"),
            ("anthropic-ratelimit-requests-reset", "2025-01-01T12:00:01Z"),
            ("anthropic-ratelimit-tokens-limit", "90000"),
            ("anthropic-ratelimit-tokens-remaining", "89000"),
            ("anthropic-ratelimit-tokens-reset", "2025-01-01T12:00:01Z"),
            ("anthropic-ratelimit-input-tokens-limit", "50000"),
            ("anthropic-ratelimit-input-tokens-remaining", "49500"),
            (
                "anthropic-ratelimit-input-tokens-reset",
                "2025-01-01T12:00:00.600Z",
            ),
            ("anthropic-ratelimit-output-tokens-limit", "10000"),
            ("anthropic-ratelimit-output-tokens-remaining", "9000"),
            (
                "anthropic-ratelimit-output-tokens-reset",
                "2025-01-01T11:59:00Z",
            ),
        ]);
        let got = parse(&h, now);
        // The most restrictive of input's and output's: not a limit of its own.
        assert_eq!(got.total, None);
        let only_tokens = headers(
            &h.iter()
                .filter(|(k, _)| k.as_str().contains("-tokens-") && !k.as_str().contains("put-"))
                .map(|(k, v)| (k.as_str(), v.to_str().unwrap()))
                .collect::<Vec<_>>(),
        );
        assert_eq!(
            parse(&only_tokens, now).total.unwrap().reset,
            Duration::from_secs(1)
        );
        assert_eq!(got.input.unwrap().reset, Duration::from_millis(600));
        assert_eq!(got.input.unwrap().remaining, 49_500);
        // A reset in the past: full now.
        assert_eq!(got.output.unwrap().reset, Duration::ZERO);
        assert_eq!(got.output.unwrap().limit, 10_000);
    }

    #[test]
    fn a_refusal_is_on_tokens_when_fewer_remain_than_asked_for() {
        let h = headers(&[
            ("anthropic-ratelimit-input-tokens-limit", "1000"),
            ("anthropic-ratelimit-input-tokens-remaining", "500"),
            (
                "anthropic-ratelimit-input-tokens-reset",
                "2025-01-01T12:00:01Z",
            ),
        ]);
        let said = parse(
            &h,
            humantime::parse_rfc3339("2025-01-01T12:00:00Z").unwrap(),
        );
        let ask = |input, output| crate::llm::Tokens { input, output };
        assert!(said.short_of(ask(501, 0)));
        assert!(!said.short_of(ask(500, 9000)));
        assert!(!TokenLimits::default().short_of(ask(1 << 20, 1 << 20)));
    }

    #[test]
    fn incomplete_or_odd_headers_announce_nothing() {
        let now = SystemTime::UNIX_EPOCH;
        let cases: [&[(&str, &str)]; 4] = [
            &[("x-ratelimit-limit-tokens", "100")],
            &[
                ("x-ratelimit-limit-tokens", "100"),
                ("x-ratelimit-remaining-tokens", "50"),
            ],
            &[
                ("x-ratelimit-limit-tokens", "lots"),
                ("x-ratelimit-remaining-tokens", "50"),
                ("x-ratelimit-reset-tokens", "1s"),
            ],
            &[
                ("x-ratelimit-limit-tokens", "100"),
                ("x-ratelimit-remaining-tokens", "50"),
                ("x-ratelimit-reset-tokens", "soon"),
            ],
        ];
        for case in cases {
            assert!(parse(&headers(case), now).is_empty(), "{case:?}");
        }
        // Full, without a reset: nothing to wait for.
        let full = headers(&[
            ("x-ratelimit-limit-tokens", "100"),
            ("x-ratelimit-remaining-tokens", "100"),
        ]);
        assert_eq!(parse(&full, now).total.unwrap().reset, Duration::ZERO);
    }
}
