//! provider-stub: a real HTTP server standing in for push, email and SMS providers in tests and
//! the demo, emulating many provider accounts at once.
//!
//! Owns: the provider API (`POST /accounts/{account}/v1/messages`), per-account scripts (a token
//! bucket answering 429 with every `Retry-After` form, a per-idempotency-key sequence of
//! statuses, delays and hangs), dedup by `Idempotency-Key` like a real provider, and the
//! counters that tests and benchmarks read (`GET /stats`, `GET /stats/keys`). Beside the
//! providers, a webhook receiver ([`webhooks`]) for what nudge pushes to a client: it keeps each
//! request as sent, for a test to verify afterwards.
//!
//! Must never: keep a destination or message content (a provider request's body is checked
//! and dropped; only counts, statuses, times and keys are kept), log one, or listen beyond
//! loopback unless told to. A webhook's body is kept: nudge's delivery events carry no PHI.
//!
//! # HTTP
//!
//! | route | what |
//! |---|---|
//! | `POST /accounts/{account}/v1/messages` | the provider API (shape `generic`, the default); body `{"channel", "to", "content"}` |
//! | `POST /accounts/{account}/2010-04-01/Accounts/{sid}/Messages.json` | shape `twilio`: Twilio's form, answers and error codes; status callbacks signed with `X-Twilio-Signature` |
//! | `POST /accounts/{account}/v3/mail/send` | shape `sendgrid`: SendGrid's JSON, `X-Message-Id`, `X-RateLimit-*`; event webhook batches signed with ECDSA P-256 |
//! | `POST /accounts/{account}/token`, `POST /accounts/{account}/v1/projects/{project}/messages:send`, `GET /stats/fcm` | shape `fcm`: Google's OAuth 2 token endpoint (RS256 assertions checked with `--fcm-public-key`), FCM HTTP v1's send and error bodies ([`fcm`]) |
//! | `POST /accounts/{account}/3/device/{token}`, `GET /stats/apns` | shape `apns`, over TLS and HTTP/2 with an authority written to `--tls-ca-out`: ES256 provider tokens checked with `--apns-public-key`, APNs's headers and reasons ([`apns`]) |
//! | `PUT /admin/accounts/{account}` | set the account's [`Script`] (JSON); `GET` reads it back |
//! | `POST /admin/reset` | forget every script, key, counter and webhook request |
//! | `POST /admin/inbound` | shape `twilio`: send a patient's reply `{"url", "from", "to", "body", "message_sid"?}` to an incoming-message webhook (loopback), signed with `X-Twilio-Signature`; answers the webhook's `{"status", "body", "message_sid"}` |
//! | `GET /stats` | [`Stats`] |
//! | `GET /stats/keys` | [`KeysReport`] |
//! | `POST /webhooks/{name}`, `GET /stats/webhooks/{name}` | the webhook receiver: each request kept as sent (its Standard Webhooks headers and body), answered `204`; read back as a [`WebhookReport`] ([`webhooks`]) |
//! | `GET /healthz` | `ok` |
//!
//! # Rules, in order
//!
//! 1. The account's token bucket: past it, 429 with `Retry-After` in the configured form.
//! 2. A bad `Idempotency-Key` header or body, or a missing key when the script requires one: 400.
//! 3. A key that already got a 2xx: the same status and `{"id"}` again, counted as a duplicate.
//! 4. The key's next step of `sequence`, then `default` (202 `{"id": "msg_<n>"}` when unset).
//!    A request without a key always gets `sequence[0]` and is never deduplicated.
//!
//! 429, 5xx and 4xx answers are not cached. Rules 1 to 3 do not advance a key's sequence.
//! The real providers' shapes skip rule 3 (they do not deduplicate) and read the key from where
//! their adapter puts it (Twilio: the `StatusCallback`'s `key`; SendGrid: `custom_args.nudge_key`);
//! see [`Shape`].

pub mod apns;
mod cli;
pub mod fcm;
mod push_common;
mod script;
mod sendgrid;
mod server;
mod shape;
mod state;
mod stats;
pub mod tls;
mod twilio;
pub mod webhooks;

pub use cli::{Args, bind, load_scripts, shutdown_signal};
pub use script::{
    RateLimit, RetryAfterForm, RetryAfterSpec, Script, ScriptError, Step, StepStatus,
};
pub use sendgrid::{SIGNATURE_HEADER, TIMESTAMP_HEADER, sendgrid_signature};
pub use server::{MAX_HANG, serve, serve_tls};
pub use shape::{Shape, ShapeConfig};
pub use state::StubState;
pub use stats::{
    AccountStats, AnswerKind, KeyReport, KeyRequest, KeysReport, SlidingWindowMax, Stats,
    rfc3339_ms,
};
pub use twilio::twilio_signature;
pub use webhooks::{WebhookName, WebhookReport, WebhookRequest};
