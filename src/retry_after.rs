//! When may a refused request be tried again? Parsing `Retry-After` (RFC 9110 §10.2.3).
