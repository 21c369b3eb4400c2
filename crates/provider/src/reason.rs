//! The stable reason codes carried by [`nudge_domain::SendOutcome::FailedBeforeSend`] and
//! [`nudge_domain::SendOutcome::UnknownAfterSend`]. They are metric-label safe and never hold request data.
//!
//! Must never: hold request data (they are metric labels and stored reasons).

/// Refused, reset while connecting, DNS or TLS failure: the request never left.
pub const CONNECT_ERROR: &str = "connect_error";
/// The connection was not established within `connect_timeout_ms`: the request never left.
pub const CONNECT_TIMEOUT: &str = "connect_timeout";
/// The request could not be built (nothing was sent).
pub const REQUEST_BUILD_ERROR: &str = "request_build_error";
/// `timeout_ms` passed after the connection was up: the provider may have the request.
pub const TIMEOUT_AFTER_SEND: &str = "timeout_after_send";
/// The connection broke after it was up and before an answer: it may have been sent.
pub const RESET_AFTER_SEND: &str = "reset_after_send";
/// Writing the request body failed part-way: it may have been sent.
pub const BODY_ERROR: &str = "body_error";
/// The answer's status is outside HTTP's classes (600-999, which the `http` crate accepts):
/// something answered that is not following HTTP, after the request arrived, so whether
/// the provider acted on it is unknown. Its status is not recorded.
pub const STATUS_OUT_OF_RANGE: &str = "status_out_of_range";
