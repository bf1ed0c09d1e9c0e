//! The token budgets of a group that calls an LLM API (docs/tokens.md): `tokens`,
//! `input_tokens`, `output_tokens`, `llm` and `max_output_tokens` in `[defaults]` or
//! a `[[limit]]`.

use toml::Spanned;

use super::values::{Rate, Rates};
use crate::llm::Dialect;

/// The output a request is estimated to ask for when its body names no limit.
pub const MAX_OUTPUT_TOKENS: u32 = 4096;

/// A group's token budgets, beside its request rates.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TokenSettings {
    /// Input and output tokens together (`tokens`): all must allow.
    pub total: Vec<Rate>,
    /// Input (prompt) tokens (`input_tokens`).
    pub input: Vec<Rate>,
    /// Output (completion) tokens (`output_tokens`).
    pub output: Vec<Rate>,
    /// How requests and answers are read (`llm`); `None`: not at all, the group
    /// counts requests only. Any token rate implies `auto`.
    pub llm: Option<Dialect>,
    /// The output estimate of a request whose body names no limit.
    pub max_output: u32,
}

impl Default for TokenSettings {
    fn default() -> Self {
        TokenSettings {
            total: Vec::new(),
            input: Vec::new(),
            output: Vec::new(),
            llm: None,
            max_output: MAX_OUTPUT_TOKENS,
        }
    }
}

impl TokenSettings {
    /// Whether requests are read for their tokens.
    pub fn counted(&self) -> bool {
        self.llm.is_some()
    }
}

/// The token keys of a table as written.
#[derive(Debug, Default)]
pub(super) struct RawTokens {
    pub(super) tokens: Option<Rates>,
    pub(super) input_tokens: Option<Rates>,
    pub(super) output_tokens: Option<Rates>,
    pub(super) llm: Option<Dialect>,
    pub(super) max_output_tokens: Option<Spanned<u32>>,
}

impl RawTokens {
    /// These keys over `base`'s.
    pub(super) fn resolve(
        self,
        base: &TokenSettings,
    ) -> Result<TokenSettings, (std::ops::Range<usize>, String)> {
        let rates =
            |set: Option<Rates>, base: &Vec<Rate>| set.map_or_else(|| base.clone(), |r| r.0);
        let max_output = match self.max_output_tokens {
            Some(m) if *m.get_ref() == 0 => {
                return Err((m.span(), "max_output_tokens must be at least 1".into()))
            }
            Some(m) => m.into_inner(),
            None => base.max_output,
        };
        let (total, input, output) = (
            rates(self.tokens, &base.total),
            rates(self.input_tokens, &base.input),
            rates(self.output_tokens, &base.output),
        );
        let any_rate = !(total.is_empty() && input.is_empty() && output.is_empty());
        let llm = self.llm.or(base.llm).or(any_rate.then_some(Dialect::Auto));
        Ok(TokenSettings {
            total,
            input,
            output,
            llm,
            max_output,
        })
    }
}
