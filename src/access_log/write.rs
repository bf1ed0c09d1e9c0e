//! Writing access lines: each formatted by hand into a buffer of its thread's own, and
//! written to stderr in batches, as nginx's `access_log … buffer=` does.
//!
//! A `tracing` event per request cost about 2 µs of formatting (the field visitor,
//! `core::fmt` per field) and a `write` system call of its own, about 1 µs more: most
//! of what the access log cost a request. Here a line is a few appends to a `Vec` the
//! thread keeps, and its thread writes the batch once it holds [`BATCH`] bytes, on the
//! serving loop's tick each second, and when the thread ends; so a line reaches stderr
//! within about a second, and a thread holds at most one batch. The write holds
//! stderr's lock, so a batch never interleaves with other log lines. Like any write to
//! stderr it blocks while a full pipe does (a log reader that stopped reading).
//!
//! The binary asks for this ([`to_stderr`]); without it (a library user, the tests
//! that run tollgate in their own process) each line is a `tracing` event, in the
//! subscriber's format. `RUST_LOG` decides either way: the `access` target at `info`.

use std::cell::RefCell;
use std::io::Write;
use std::sync::OnceLock;

use super::{millis, Count, Record};

/// How lines are written: `key=value` text, or JSON, as `--log-format` says.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Format {
    /// `<time>  INFO access: client=… user=…`, as tracing's text format writes events.
    Text,
    /// `{"timestamp":…,"level":"INFO","fields":{…},"target":"access"}`, as tracing's
    /// JSON format does.
    Json,
}

/// Bytes a thread gathers before it writes them.
const BATCH: usize = 32 * 1024;

static TO_STDERR: OnceLock<Format> = OnceLock::new();

/// Writes access lines to stderr in batches, in `format`, from now on.
pub fn to_stderr(format: Format) {
    let _ = TO_STDERR.set(format);
}

/// The lines a thread has not written yet; written when the thread ends.
struct Pending(Vec<u8>);

impl Drop for Pending {
    fn drop(&mut self) {
        write(&mut self.0);
    }
}

thread_local! {
    static PENDING: RefCell<Pending> = const { RefCell::new(Pending(Vec::new())) };
}

/// Logs `record`: batched to stderr, or as a `tracing` event.
pub(super) fn emit(record: &Record) {
    if !tracing::enabled!(target: "access", tracing::Level::INFO) {
        return;
    }
    let Some(format) = TO_STDERR.get() else {
        return record.event();
    };
    let written = PENDING.try_with(|pending| {
        let pending = &mut pending.borrow_mut().0;
        line(record, *format, pending);
        if pending.len() >= BATCH {
            write(pending);
        }
    });
    // The thread is ending and its buffer is gone: the line goes on its own.
    if written.is_err() {
        let mut alone = Vec::new();
        line(record, *format, &mut alone);
        write(&mut alone);
    }
}

/// Writes the lines this thread holds.
pub fn flush_thread() {
    let _ = PENDING.try_with(|pending| write(&mut pending.borrow_mut().0));
}

fn write(pending: &mut Vec<u8>) {
    if pending.is_empty() {
        return;
    }
    // Nowhere to report a failed write to stderr: the lines are dropped.
    let _ = std::io::stderr().lock().write_all(pending);
    pending.clear();
    // A burst's buffer is not kept for good.
    pending.shrink_to(BATCH + 1024);
}

/// A field's value: written as it displays in text; in JSON, a string quoted (and
/// escaped, unless it is one of tollgate's own words or an address), a number as it
/// is (as tracing's JSON format writes `%` and plain fields).
enum Value<'a> {
    Str(&'a dyn std::fmt::Display),
    Word(&'a dyn std::fmt::Display),
    Num(&'a dyn std::fmt::Debug),
}

/// Appends `record`'s line, with its newline, to `out`.
pub fn line(record: &Record, format: Format, out: &mut Vec<u8>) {
    use Value::{Num, Str, Word};
    let now = humantime::format_rfc3339_micros(std::time::SystemTime::now());
    let tokens = record.tokens();
    let (wait, upstream) = (millis(record.timing.wait), millis(record.timing.upstream));
    let (tokens_in, tokens_out) = (Count(tokens.map(|t| t.0)), Count(tokens.map(|t| t.1)));
    let fields: [(&str, Value); 15] = [
        ("client", Word(&record.client)),
        ("user", Str(&record.user.as_deref().unwrap_or("-"))),
        ("method", Word(&record.method)),
        ("url", Str(&record.url)),
        ("group", Str(&record.group.as_deref().unwrap_or("-"))),
        ("status", Num(&record.status)),
        ("answered", Word(&record.answered)),
        ("wait_ms", Num(&wait)),
        ("upstream_ms", Num(&upstream)),
        ("retries", Num(&record.timing.retries)),
        ("bytes", Num(&record.bytes)),
        ("complete", Num(&record.complete)),
        ("tunnel", Word(&record.tunnel.unwrap_or("-"))),
        ("tokens_in", Word(&tokens_in)),
        ("tokens_out", Word(&tokens_out)),
    ];
    // A JSON string is escaped from its text, written here first.
    let mut scratch = String::new();
    // Writing to a `Vec` cannot fail.
    let _ = match format {
        Format::Text => write!(out, "{now}  INFO access:"),
        Format::Json => write!(
            out,
            "{{\"timestamp\":\"{now}\",\"level\":\"INFO\",\"fields\":{{"
        ),
    };
    for (i, (name, value)) in fields.iter().enumerate() {
        let _ = match (format, value) {
            (Format::Text, Str(v) | Word(v)) => write!(out, " {name}={v}"),
            (Format::Text, Num(v)) => write!(out, " {name}={v:?}"),
            (Format::Json, value) => {
                let comma = if i == 0 { "" } else { "," };
                let _ = write!(out, "{comma}\"{name}\":");
                match value {
                    Str(v) => {
                        use std::fmt::Write as _;
                        scratch.clear();
                        let _ = write!(scratch, "{v}");
                        serde_json::to_writer(&mut *out, scratch.as_str()).map_err(Into::into)
                    }
                    Word(v) => write!(out, "\"{v}\""),
                    Num(v) => write!(out, "{v:?}"),
                }
            }
        };
    }
    let _ = match format {
        Format::Text => writeln!(out),
        Format::Json => writeln!(out, "}},\"target\":\"access\"}}"),
    };
}

#[cfg(test)]
mod tests {
    use std::sync::{Arc, Mutex};
    use std::time::Duration;

    use super::*;
    use crate::access_log::{Answered, Timing};

    fn record(user: Option<&str>, tokens: Option<(u32, u32)>) -> Record {
        let spent = tokens.map(|t| {
            let spent = crate::access_log::Spent::default();
            spent.set(t).unwrap();
            spent
        });
        Record {
            client: "10.0.0.7:51234".parse().unwrap(),
            user: user.map(str::to_string),
            method: http::Method::POST,
            url: "https://api.example.com/v1/a\"b".into(),
            group: Some("api".into()),
            status: 429,
            answered: Answered::Tollgate("http_request_denied"),
            timing: Timing {
                wait: Duration::from_micros(412_345),
                upstream: Duration::from_millis(40_000),
                retries: 2,
                tokens: spent,
            },
            bytes: 42,
            complete: true,
            tunnel: Some("blind"),
        }
    }

    /// The line as tracing's own formatter writes the event, in `format`.
    fn traced(record: &Record, format: Format) -> String {
        #[derive(Clone, Default)]
        struct Captured(Arc<Mutex<Vec<u8>>>);
        impl std::io::Write for Captured {
            fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
                self.0.lock().unwrap().extend_from_slice(buf);
                Ok(buf.len())
            }
            fn flush(&mut self) -> std::io::Result<()> {
                Ok(())
            }
        }
        let captured = Captured::default();
        let writer = {
            let captured = captured.clone();
            move || captured.clone()
        };
        let builder = tracing_subscriber::fmt()
            .with_ansi(false)
            .with_writer(writer);
        match format {
            Format::Text => tracing::subscriber::with_default(builder.finish(), || record.event()),
            Format::Json => {
                tracing::subscriber::with_default(builder.json().finish(), || record.event())
            }
        }
        let bytes = captured.0.lock().unwrap().clone();
        String::from_utf8(bytes).unwrap()
    }

    fn written(record: &Record, format: Format) -> String {
        let mut out = Vec::new();
        line(record, format, &mut out);
        String::from_utf8(out).unwrap()
    }

    #[test]
    fn text_lines_read_as_tracing_writes_them() {
        for record in [record(None, None), record(Some("alice"), Some((12, 3400)))] {
            let (ours, theirs) = (
                written(&record, Format::Text),
                traced(&record, Format::Text),
            );
            // The same after the timestamp (RFC 3339 with microseconds, 27 bytes).
            assert_eq!(ours[27..], theirs[27..], "\n{ours}{theirs}");
            assert_eq!(ours.len(), theirs.len());
        }
    }

    #[test]
    fn json_lines_read_as_tracing_writes_them() {
        for record in [
            record(None, None),
            record(Some("al\"ice"), Some((12, 3400))),
        ] {
            let parse = |line: &str| serde_json::from_str::<serde_json::Value>(line).unwrap();
            let mut ours = parse(&written(&record, Format::Json));
            let mut theirs = parse(&traced(&record, Format::Json));
            assert!(ours["timestamp"].as_str().unwrap().ends_with('Z'), "{ours}");
            ours["timestamp"] = serde_json::Value::Null;
            theirs["timestamp"] = serde_json::Value::Null;
            assert_eq!(ours, theirs);
        }
    }
}
