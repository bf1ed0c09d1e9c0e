//! The usage an answer reports, read from its body as it passes.
//!
//! * a JSON answer ends with its `usage` (OpenAI `prompt_tokens`/`completion_tokens`,
//!   Anthropic and OpenAI's Responses API `input_tokens`/`output_tokens`): only the
//!   last [`TAIL`] bytes are kept, and read when the body ends;
//! * a stream of server-sent events carries usage in some events: OpenAI's last chunk
//!   (with `stream_options.include_usage`), Anthropic's `message_start` (input) and
//!   `message_delta` (output so far, cumulative). Each `data:` line is read when its
//!   end passes; the latest figure of each kind wins.
//!
//! Nothing is held back or copied into the client's stream: the scanner sees each
//! chunk after it was handed on.

use serde::Deserialize;

/// The bytes of a JSON answer kept for its usage, and the longest event line read.
pub const TAIL: usize = 64 * 1024;

/// Tokens an answer reported, by kind; `None` where it said nothing.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Usage {
    /// Input (prompt) tokens, with those written to a prompt cache.
    pub input: Option<u32>,
    /// Output (completion) tokens.
    pub output: Option<u32>,
}

/// Reads an answer's usage from its body's chunks.
#[derive(Debug)]
pub struct Scanner {
    /// A stream of events (read line by line), or one JSON document (its tail).
    events: bool,
    buf: Vec<u8>,
    /// An event line longer than [`TAIL`] is skipped to its end.
    skipping: bool,
    seen: Usage,
    /// A stream's last event has passed: the answer is whole, whatever becomes of
    /// the connection after it.
    over: bool,
}

impl Scanner {
    /// A scanner for an answer of `content_type`.
    pub fn new(content_type: Option<&str>) -> Scanner {
        let events = content_type.is_some_and(|t| t.trim_start().starts_with("text/event-stream"));
        Scanner {
            events,
            buf: Vec::new(),
            skipping: false,
            seen: Usage::default(),
            over: false,
        }
    }

    /// Whether a stream's last event has passed (OpenAI's `data: [DONE]`, Anthropic's
    /// `message_stop`, the Responses API's `response.completed`): a client may close
    /// the connection before the body's end is read, and the usage is still whole.
    pub fn is_over(&self) -> bool {
        self.over
    }

    /// Reads the next chunk of the body.
    pub fn feed(&mut self, mut chunk: &[u8]) {
        if !self.events {
            self.buf.extend_from_slice(chunk);
            if self.buf.len() > 2 * TAIL {
                self.buf.drain(..self.buf.len() - TAIL);
            }
            return;
        }
        while let Some(end) = chunk.iter().position(|&b| b == b'\n') {
            if !self.skipping {
                self.buf.extend_from_slice(&chunk[..end]);
                let line = std::mem::take(&mut self.buf);
                self.line(&line);
                self.buf = line;
            }
            self.buf.clear();
            self.skipping = false;
            chunk = &chunk[end + 1..];
        }
        if !self.skipping {
            self.buf.extend_from_slice(chunk);
            if self.buf.len() > TAIL {
                self.buf.clear();
                self.skipping = true;
            }
        }
    }

    /// The usage read, once the body has ended.
    pub fn finish(mut self) -> Usage {
        let rest = std::mem::take(&mut self.buf);
        if !self.skipping {
            self.line(&rest);
        }
        self.seen
    }

    fn line(&mut self, line: &[u8]) {
        const LAST: [&[u8]; 3] = [
            b"data: [DONE]",
            b"\"type\":\"message_stop\"",
            b"\"type\":\"response.completed\"",
        ];
        let line = line.trim_ascii_end();
        if LAST
            .iter()
            .any(|end| line.windows(end.len()).any(|w| w == *end))
        {
            self.over = true;
        }
        if let Some(found) = last_usage(line) {
            self.seen.input = found.input.or(self.seen.input);
            self.seen.output = found.output.or(self.seen.output);
        }
    }
}

/// The fields of a `usage` object, in either dialect.
#[derive(Deserialize)]
struct Fields {
    prompt_tokens: Option<u32>,
    completion_tokens: Option<u32>,
    input_tokens: Option<u32>,
    output_tokens: Option<u32>,
    cache_creation_input_tokens: Option<u32>,
}

/// The last `"usage": {…}` object in `text` that reads as one.
fn last_usage(text: &[u8]) -> Option<Usage> {
    const KEY: &[u8] = b"\"usage\"";
    let mut end = text.len();
    while let Some(at) = text[..end].windows(KEY.len()).rposition(|w| w == KEY) {
        end = at;
        // Inside a string (the model wrote the word), the quote is escaped.
        if at > 0 && text[at - 1] == b'\\' {
            continue;
        }
        let rest = text[at + KEY.len()..].trim_ascii_start();
        let Some(rest) = rest.strip_prefix(b":") else {
            continue;
        };
        let mut values = serde_json::Deserializer::from_slice(rest).into_iter::<Fields>();
        if let Some(Ok(f)) = values.next() {
            let input = f.input_tokens.or(f.prompt_tokens);
            let cached = f.cache_creation_input_tokens.unwrap_or(0);
            return Some(Usage {
                input: input.map(|i| i.saturating_add(cached)),
                output: f.output_tokens.or(f.completion_tokens),
            });
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The usage `body` reports, fed in chunks of `size` bytes.
    fn scan(content_type: &str, body: &str, size: usize) -> Usage {
        let mut s = Scanner::new(Some(content_type));
        for chunk in body.as_bytes().chunks(size) {
            s.feed(chunk);
        }
        s.finish()
    }

    fn usage(input: u32, output: u32) -> Usage {
        Usage {
            input: Some(input),
            output: Some(output),
        }
    }

    const OPENAI_JSON: &str = r#"{
  "id": "chatcmpl-abc123",
  "object": "chat.completion",
  "choices": [{"index": 0, "message": {"role": "assistant", "content": "the \"usage\": {\"prompt_tokens\": 1}"}, "finish_reason": "stop"}],
  "usage": {
    "prompt_tokens": 19,
    "completion_tokens": 10,
    "total_tokens": 29,
    "prompt_tokens_details": {"cached_tokens": 0}
  }
}"#;

    const ANTHROPIC_JSON: &str = r#"{"id":"msg_01","type":"message","role":"assistant","content":[{"type":"text","text":"Hi"}],"stop_reason":"end_turn","usage":{"input_tokens":2095,"cache_creation_input_tokens":5,"cache_read_input_tokens":0,"output_tokens":503}}"#;

    const OPENAI_SSE: &str = "data: {\"id\":\"c\",\"choices\":[{\"index\":0,\"delta\":{\"content\":\"Hi\"}}],\"usage\":null}\n\n\
data: {\"id\":\"c\",\"choices\":[],\"usage\":{\"prompt_tokens\":9,\"completion_tokens\":12,\"total_tokens\":21}}\n\n\
data: [DONE]\n\n";

    const ANTHROPIC_SSE: &str = "event: message_start\n\
data: {\"type\":\"message_start\",\"message\":{\"id\":\"msg_1\",\"usage\":{\"input_tokens\":25,\"output_tokens\":1}}}\n\n\
event: content_block_delta\n\
data: {\"type\":\"content_block_delta\",\"index\":0,\"delta\":{\"type\":\"text_delta\",\"text\":\"Hello\"}}\n\n\
event: message_delta\n\
data: {\"type\":\"message_delta\",\"delta\":{\"stop_reason\":\"end_turn\"},\"usage\":{\"output_tokens\":15}}\n\n\
event: message_stop\n\
data: {\"type\":\"message_stop\"}\n\n";

    #[test]
    fn usage_as_each_dialect_reports_it_in_any_chunking() {
        let cases = [
            ("application/json", OPENAI_JSON, usage(19, 10)),
            ("application/json", ANTHROPIC_JSON, usage(2100, 503)),
            ("text/event-stream; charset=utf-8", OPENAI_SSE, usage(9, 12)),
            ("text/event-stream", ANTHROPIC_SSE, usage(25, 15)),
            (
                "application/json",
                r#"{"error":{"type":"rate_limit_error"}}"#,
                Usage::default(),
            ),
            (
                "text/event-stream",
                "data: {\"usage\":null}\n",
                Usage::default(),
            ),
        ];
        for (content_type, body, want) in cases {
            for size in [1, 7, 64, 100_000] {
                assert_eq!(scan(content_type, body, size), want, "{body} by {size}");
            }
        }
    }

    #[test]
    fn a_stream_is_over_at_its_last_event() {
        for (body, over) in [
            (OPENAI_SSE, true),
            (ANTHROPIC_SSE, true),
            ("data: {\"usage\":{\"output_tokens\":1}}\n\n", false),
            (
                "event: response.completed\ndata: {\"type\":\"response.completed\"}\n",
                true,
            ),
        ] {
            let mut s = Scanner::new(Some("text/event-stream"));
            s.feed(body.as_bytes());
            assert_eq!(s.is_over(), over, "{body}");
        }
    }

    #[test]
    fn a_long_answer_keeps_only_its_tail() {
        let text = "x".repeat(5 * TAIL);
        let body =
            format!(r#"{{"content":"{text}","usage":{{"input_tokens":3,"output_tokens":4}}}}"#);
        let mut s = Scanner::new(Some("application/json"));
        for chunk in body.as_bytes().chunks(4096) {
            s.feed(chunk);
            assert!(s.buf.len() <= 2 * TAIL + 4096);
        }
        assert_eq!(s.finish(), usage(3, 4));
        // An event line too long to keep is skipped; the next one is read.
        let long = format!("data: {{\"usage\":{{\"output_tokens\":1}},\"x\":\"{text}\"}}\ndata: {{\"usage\":{{\"output_tokens\":2}}}}\n");
        let got = scan("text/event-stream", &long, 1000);
        assert_eq!(
            got,
            Usage {
                input: None,
                output: Some(2)
            }
        );
    }
}
