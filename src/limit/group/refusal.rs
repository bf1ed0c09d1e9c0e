//! Why a group did not admit a request: the proxy answers each with its own `503`
//! (`crate::error::ProxyError::refused`).

use std::time::Duration;

/// Why a request was not admitted.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Refusal {
    /// `queue` requests were already waiting.
    QueueFull {
        /// An estimate of when the queue will have room.
        retry_after: Duration,
    },
    /// `flow_queue` requests of its flow were already waiting.
    FlowQueueFull {
        /// An estimate of when its flow will have room.
        retry_after: Duration,
    },
    /// The request's key would be one more than `max_keys`.
    TooManyKeys,
    /// The shared store is unreachable and `on_backend_error = "deny"`.
    BackendDown,
    /// The wait ahead of the request (the upstream's pause, the queue) already
    /// outlasts what is left of its `max_wait`: refused at once rather than at the end.
    WaitTooLong {
        /// The estimated wait ahead.
        ahead: Duration,
    },
    /// The request waited `max_wait` without leaving.
    MaxWait {
        /// How long it waited.
        waited: Duration,
        /// An estimate of when a new request could leave.
        retry_after: Duration,
    },
}
