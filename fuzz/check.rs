// The checks the fuzz target runs on one input, kept apart from libFuzzer so that
// `tests/fuzz_seeds.rs` runs the same code over the seeds in every `cargo test`.
// Included (`include!`) by both; the includer imports what it uses.

/// The header names `pause_hint` reads, plus `Date`, which it reads as the reference.
const NAMES: [&str; 7] = [
    "x-ratelimit-remaining",
    "x-ratelimit-reset",
    "ratelimit-remaining",
    "ratelimit-reset",
    "ratelimit",
    "ratelimit-policy",
    "date",
];

/// Runs every parser on `data` and asserts nothing panics or exceeds `max_pause`.
pub fn check_input(data: &[u8]) {
    // Layout: 8 bytes of `now`, 4 of `max_pause`, then NUL-separated field values.
    if data.len() < 12 {
        return;
    }
    let (head, rest) = data.split_at(12);
    let now_secs = u64::from_le_bytes(head[..8].try_into().unwrap());
    // Any wall clock SystemTime can hold, 1970 to far beyond year 9999.
    let now = UNIX_EPOCH + Duration::from_secs(now_secs % (1 << 40));
    let max_pause = match u32::from_le_bytes(head[8..12].try_into().unwrap()) {
        u32::MAX => Duration::MAX,
        n => Duration::from_millis(u64::from(n)),
    };
    let fields: Vec<&[u8]> = rest.split(|&b| b == 0).collect();

    // Retry-After and Date as lossy UTF-8: any text the caller could hand over, and more.
    let value = String::from_utf8_lossy(fields[0]);
    let date = fields.get(1).map(|d| String::from_utf8_lossy(d));
    check(
        retry_after(&value, date.as_deref(), now, max_pause),
        max_pause,
    );
    check(retry_after(&value, None, now, max_pause), max_pause);

    // The same bytes as header values, each field under the next name in turn.
    let mut headers = HeaderMap::new();
    for (i, field) in fields.iter().enumerate() {
        if let Ok(v) = HeaderValue::from_bytes(field) {
            headers.append(HeaderName::from_static(NAMES[i % NAMES.len()]), v);
        }
    }
    check(pause_hint(&headers, now, max_pause), max_pause);

    // Backoff from the same bytes: any attempt, any jitter bits (NaN, infinities, ...).
    let attempt = now_secs as u32;
    let jitter = f64::from_bits(now_secs.rotate_left(17));
    assert!(backoff(attempt, max_pause, jitter) <= max_pause);
}

fn check(answer: Option<Duration>, max_pause: Duration) {
    if let Some(d) = answer {
        assert!(d <= max_pause, "{d:?} > {max_pause:?}");
    }
}
