//! Token accounting: how far the estimate of a request's prompt is from a real
//! tokenizer's count, and what reading requests and answers costs.
//!
//! `cargo bench --bench tokens` prints, first, the estimate's error on 50 sample
//! prompts (English prose, code, configuration, and text in four other scripts, taken
//! from this repository and a few sentences below) against OpenAI's `o200k_base`
//! tokenizer (tiktoken-rs), for tollgate's estimate (the request body's bytes / 4)
//! and for the prompt's characters / 4; then criterion's times for the estimate, the
//! tokenizer, and the usage scanner over a JSON answer and a stream of events.

use std::hint::black_box;

use criterion::{criterion_group, criterion_main, Criterion};
use tollgate::parts::{estimate, Scanner};

/// Text in scripts other than Latin, where bytes per token differ most.
const OTHER_SCRIPTS: [&str; 4] = [
    "Die Warteschlange hält jede Anfrage zurück, bis das Budget des Anbieters sie zulässt; \
     so erhält die Anwendung eine langsamere Antwort statt eines Fehlers. ",
    "レート制限に達すると、リクエストはキューで待機し、許可されたペースで送信されます。\
     アプリケーションはエラーではなく、少し遅い応答を受け取ります。",
    "当请求会超出限制时，tollgate 会让它排队等待，而不是失败；上游返回 429 时，整个组暂停，\
     被拒绝的请求会为应用重新发送。",
    "Когда запрос превысил бы лимит, tollgate ждёт вместо того, чтобы вернуть ошибку: \
     запросы стоят в очереди и уходят с разрешённой скоростью. ",
];

/// 50 prompts of 0.1 to 4 KiB: slices of this repository's docs, code and config, and
/// of the texts above repeated.
fn samples() -> Vec<String> {
    let root = env!("CARGO_MANIFEST_DIR");
    let files = [
        "README.md",
        "docs/budget.md",
        "docs/tokens.md",
        "docs/operations.md",
        "src/limit/gcra.rs",
        "src/proxy/mod.rs",
        "config.toml",
        "tests/upstreams/llm-upstream.py",
    ];
    let texts: Vec<String> = files
        .iter()
        .map(|f| std::fs::read_to_string(format!("{root}/{f}")).expect(f))
        .collect();
    let mut out = Vec::new();
    for i in 0..42 {
        let text = &texts[i % texts.len()];
        let len = 100 + (i * 97) % 3996;
        let start = (i * 1013) % text.len().saturating_sub(len).max(1);
        out.push(char_slice(text, start, len));
    }
    for (i, text) in OTHER_SCRIPTS.iter().enumerate() {
        for n in [1, 8] {
            out.push(text.repeat(n + i));
        }
    }
    out
}

/// About `len` bytes of `text` from `start`, on character boundaries.
fn char_slice(text: &str, start: usize, len: usize) -> String {
    let start = (start..text.len())
        .find(|&i| text.is_char_boundary(i))
        .unwrap_or(0);
    let end = ((start + len).min(text.len())..=text.len())
        .find(|&i| text.is_char_boundary(i))
        .unwrap_or(text.len());
    text[start..end].to_string()
}

/// A chat request with `prompt` as its one message.
fn body(prompt: &str) -> Vec<u8> {
    serde_json::to_vec(&serde_json::json!({
        "model": "gpt-4o",
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": 100,
    }))
    .unwrap()
}

/// The error of each estimator against the tokenizer, printed.
fn accuracy() {
    let bpe = tiktoken_rs::o200k_base().unwrap();
    let mut rows: Vec<(f64, f64)> = Vec::new();
    for prompt in samples() {
        // OpenAI counts 3 tokens per message and 3 to prime the answer.
        let truth = bpe.encode_with_special_tokens(&prompt).len() as f64 + 6.0;
        let ours = estimate(&body(&prompt), 100).unwrap().input as f64;
        let chars = (prompt.chars().count() as f64 / 4.0).ceil();
        rows.push((ours / truth - 1.0, chars / truth - 1.0));
    }
    let summary = |pick: fn(&(f64, f64)) -> f64| {
        let mut errors: Vec<f64> = rows.iter().map(pick).collect();
        errors.sort_by(f64::total_cmp);
        let mean_abs = errors.iter().map(|e| e.abs()).sum::<f64>() / errors.len() as f64;
        let under = errors.iter().filter(|e| **e < 0.0).count();
        format!(
            "mean |error| {:.0} %, median {:+.0} %, range {:+.0} % .. {:+.0} %, under by more than 10 %: {} of {}",
            mean_abs * 100.0,
            errors[errors.len() / 2] * 100.0,
            errors[0] * 100.0,
            errors[errors.len() - 1] * 100.0,
            errors.iter().filter(|e| **e < -0.1).count(),
            errors.len()
        ) + &format!(" (under at all: {under})")
    };
    println!("estimate vs o200k_base on {} prompts", rows.len());
    println!("  body bytes / 4 (tollgate): {}", summary(|r| r.0));
    println!("  prompt chars / 4:          {}", summary(|r| r.1));
}

fn costs(c: &mut Criterion) {
    accuracy();
    let prompt = char_slice(&samples().concat(), 0, 4000);
    let request = body(&prompt);
    assert!(request.len() >= 4000, "a 4 KiB request at least");
    c.bench_function("estimate a 4 KiB request (bytes / 4)", |b| {
        b.iter(|| estimate(black_box(&request), 4096))
    });
    let bpe = tiktoken_rs::o200k_base().unwrap();
    c.bench_function("count a 4 KiB prompt (o200k_base)", |b| {
        b.iter(|| bpe.encode_with_special_tokens(black_box(&prompt)).len())
    });
    let answer = serde_json::to_vec(&serde_json::json!({
        "id": "chatcmpl-1",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": prompt}}],
        "usage": {"prompt_tokens": 1000, "completion_tokens": 900},
    }))
    .unwrap();
    c.bench_function("scan a 4 KiB JSON answer for its usage", |b| {
        b.iter(|| {
            let mut s = Scanner::new(Some("application/json"));
            s.feed(black_box(&answer));
            s.finish()
        })
    });
    let chunk = b"data: {\"id\":\"c\",\"choices\":[{\"index\":0,\"delta\":{\"content\":\"a few words of the answer\"}}]}\n\n";
    c.bench_function("scan one event of a stream", |b| {
        let mut s = Scanner::new(Some("text/event-stream"));
        b.iter(|| s.feed(black_box(chunk)))
    });
}

criterion_group!(benches, costs);
criterion_main!(benches);
