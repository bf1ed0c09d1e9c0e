//! Reading an upstream's rate-limit headers (`X-RateLimit-*`, IETF `RateLimit`).
