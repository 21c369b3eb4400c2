//! When a send may still start: the lease and the delivery's expiry, less a margin, as one
//! object the worker and the adapter share.
//!
//! The fence confirms the lease just before a send, but an adapter may wait after it (FCM's
//! access token, APNs's provider token) for longer than the lease lasts. So the worker hands the
//! adapter a [`SendWindow`]; the adapter calls [`SendWindow::open`] as the last step before its
//! request leaves, and builds every expiry-derived field (FCM's `ttl`, APNs's
//! `apns-expiration`, Twilio's `ValidityPeriod`) from the [`Expiry`] it returns, so they are
//! computed when the request is built rather than before a wait. Past the window, `open`
//! refuses and the request is never started. The worker stops waiting for an adapter that has
//! not opened the window by [`SendWindow::deadline`] (whatever it is waiting for), and the
//! attempt is [`SendOutcome::FailedBeforeSend`] with [`SEND_DEADLINE_PASSED`]: never sent, so
//! never "maybe sent".
//!
//! A lease's end is either fixed, or a [`LeaseEnd`] its holder's heartbeat renews while the
//! holder lives (`nudge-worker`). Under a fixed end a request may start only if it can be
//! answered before the end; under a renewed one, while the lease is held with the margin to
//! spare, since the heartbeat keeps renewing it for as long as the request runs (and should
//! the holder lose the ledger, the reaper decides a send that started as maybe sent).

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicI64, Ordering};
use std::time::Duration;

use chrono::{DateTime, Utc};
use nudge_domain::SendOutcome;
use tokio::time::Instant;

use crate::Expiry;

/// The reason of an attempt whose request was not started because its window had closed
/// (the lease would end before an answer, or the delivery expires): it never left.
pub const SEND_DEADLINE_PASSED: &str = "send_deadline_passed";

/// The end of a lease as its holder last renewed it, by the database's clock: shared by the
/// holder's heartbeat, which moves it on, and the sends under the lease, which read it.
#[derive(Debug)]
pub struct LeaseEnd(AtomicI64);

impl LeaseEnd {
    pub fn new(at: DateTime<Utc>) -> Self {
        Self(AtomicI64::new(nanos(at)))
    }

    /// Moves the end to `at`, never back: a renewal read late does not shorten a later one.
    pub fn renewed(&self, at: DateTime<Utc>) {
        self.0.fetch_max(nanos(at), Ordering::SeqCst);
    }

    pub fn get(&self) -> DateTime<Utc> {
        DateTime::from_timestamp_nanos(self.0.load(Ordering::SeqCst))
    }
}

/// Nanoseconds since the epoch (saturating: an instant past 2262 reads as then).
fn nanos(at: DateTime<Utc>) -> i64 {
    at.timestamp_nanos_opt().unwrap_or(i64::MAX)
}

#[derive(Debug)]
enum LeaseEnds {
    At(DateTime<Utc>),
    Renewed(Arc<LeaseEnd>),
}

impl LeaseEnds {
    fn get(&self) -> DateTime<Utc> {
        match self {
            LeaseEnds::At(at) => *at,
            LeaseEnds::Renewed(end) => end.get(),
        }
    }
}

/// The window one send may start in. See the module docs.
#[derive(Debug)]
pub struct SendWindow {
    expires_at: DateTime<Utc>,
    lease_ends: LeaseEnds,
    margin: chrono::Duration,
    /// The database's clock as the sender saw it at `base`.
    base_now: DateTime<Utc>,
    base: Instant,
    started: AtomicBool,
}

impl SendWindow {
    /// A window for a send whose sender reads the database's clock as `now`, for a delivery
    /// that expires at `expires_at` under a lease that ends at `lease_ends_at`. No request may
    /// start within `margin` of the expiry, and none that could still be running (its
    /// `request_timeout`) within `margin` of the lease's end: the margin is for recording the
    /// outcome while the lease is still held.
    pub fn new(
        now: DateTime<Utc>,
        expires_at: DateTime<Utc>,
        lease_ends_at: DateTime<Utc>,
        margin: Duration,
    ) -> Self {
        Self::with_lease(now, expires_at, LeaseEnds::At(lease_ends_at), margin)
    }

    /// A window for a send under a lease its holder renews while it lives (see the module
    /// docs): a request may start while the lease's current end is more than `margin` away
    /// and the delivery's expiry is too, however long the request may take.
    pub fn renewed(
        now: DateTime<Utc>,
        expires_at: DateTime<Utc>,
        lease_end: Arc<LeaseEnd>,
        margin: Duration,
    ) -> Self {
        Self::with_lease(now, expires_at, LeaseEnds::Renewed(lease_end), margin)
    }

    fn with_lease(
        now: DateTime<Utc>,
        expires_at: DateTime<Utc>,
        lease_ends: LeaseEnds,
        margin: Duration,
    ) -> Self {
        Self {
            expires_at,
            lease_ends,
            margin: chrono::Duration::from_std(margin).unwrap_or(chrono::Duration::MAX),
            base_now: now,
            base: Instant::now(),
            started: AtomicBool::new(false),
        }
    }

    /// The database's clock, as the sender knows it, now.
    pub fn now(&self) -> DateTime<Utc> {
        let elapsed = chrono::Duration::from_std(self.base.elapsed()).unwrap_or_default();
        self.base_now + elapsed
    }

    /// The delivery's expiry.
    pub fn expires_at(&self) -> DateTime<Utc> {
        self.expires_at
    }

    /// When a send that has not started is given up: the earlier of the lease's end and the
    /// expiry, less the margin (a local instant, for timers). Under a renewed lease the
    /// deadline moves on with each renewal: ask again when it has passed.
    pub fn deadline(&self) -> Instant {
        let last = self.expires_at.min(self.lease_ends.get()) - self.margin;
        let left = (last - self.base_now).to_std().unwrap_or(Duration::ZERO);
        self.base + left
    }

    /// Whether a request that starts now and runs for up to `request_timeout` may start. The
    /// last step before a request leaves: on `Ok` the window records that the send started and
    /// returns the expiry as of now, for the expiry-derived fields; on `Err` nothing may be
    /// sent and the error is the attempt's outcome.
    pub fn open(&self, request_timeout: Duration) -> Result<Expiry, SendOutcome> {
        let now = self.now();
        let timeout = chrono::Duration::from_std(request_timeout).unwrap_or(chrono::Duration::MAX);
        let before_expiry = now + self.margin < self.expires_at;
        let answered_in_lease = match &self.lease_ends {
            LeaseEnds::At(ends_at) => now
                .checked_add_signed(timeout)
                .and_then(|t| t.checked_add_signed(self.margin))
                .is_some_and(|t| t <= *ends_at),
            LeaseEnds::Renewed(end) => now + self.margin < end.get(),
        };
        if !(before_expiry && answered_in_lease) {
            return Err(SendOutcome::FailedBeforeSend {
                reason: SEND_DEADLINE_PASSED.to_owned(),
            });
        }
        self.started.store(true, Ordering::SeqCst);
        Ok(Expiry {
            expires_at: self.expires_at,
            now,
        })
    }

    /// Whether [`Self::open`] let a request start.
    pub fn started(&self) -> bool {
        self.started.load(Ordering::SeqCst)
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn secs(s: i64) -> chrono::Duration {
        chrono::Duration::seconds(s)
    }

    #[tokio::test(start_paused = true)]
    async fn a_request_opens_only_while_it_can_be_answered_within_the_lease_and_before_expiry() {
        let now = Utc::now();
        let window = SendWindow::new(now, now + secs(60), now + secs(30), Duration::from_secs(1));
        // 30 s of lease: a 10 s request fits, a 29.5 s one does not (1 s margin).
        assert!(window.open(Duration::from_millis(29_500)).is_err());
        assert!(!window.started());
        let expiry = window.open(Duration::from_secs(10)).unwrap();
        assert!(window.started());
        assert_eq!(expiry.seconds_left(), 60);
        // 20 s later the expiry is computed anew, and a 10 s request no longer fits.
        tokio::time::advance(Duration::from_secs(20)).await;
        let expiry = window.open(Duration::from_secs(5)).unwrap();
        assert_eq!(expiry.seconds_left(), 40);
        assert!(window.open(Duration::from_secs(10)).is_err());
    }

    #[tokio::test(start_paused = true)]
    async fn no_request_opens_within_the_margin_of_the_expiry() {
        let now = Utc::now();
        let window = SendWindow::new(now, now + secs(5), now + secs(60), Duration::from_secs(1));
        assert!(window.open(Duration::from_secs(1)).is_ok());
        tokio::time::advance(Duration::from_millis(4_000)).await;
        assert_eq!(
            window.open(Duration::from_secs(1)).unwrap_err(),
            SendOutcome::FailedBeforeSend {
                reason: SEND_DEADLINE_PASSED.to_owned()
            }
        );
    }

    #[tokio::test(start_paused = true)]
    async fn under_a_renewed_lease_a_request_longer_than_the_lease_opens_while_it_is_held() {
        let now = Utc::now();
        let end = Arc::new(LeaseEnd::new(now + secs(5)));
        let window = SendWindow::renewed(now, now + secs(600), end.clone(), Duration::from_secs(1));
        // 5 s of lease, a 30 s request: the heartbeat keeps the lease while it runs.
        assert!(window.open(Duration::from_secs(30)).is_ok());
        // 4.5 s on, within the margin of the lease's end: nothing may start...
        tokio::time::advance(Duration::from_millis(4_500)).await;
        assert!(window.open(Duration::from_secs(1)).is_err());
        // ...until the heartbeat renews it; a renewal read late never moves it back.
        end.renewed(now + secs(10));
        end.renewed(now + secs(6));
        assert_eq!(end.get(), now + secs(10));
        assert!(window.open(Duration::from_secs(30)).is_ok());
    }

    #[tokio::test(start_paused = true)]
    async fn under_a_renewed_lease_the_deadline_moves_on_with_each_renewal() {
        let now = Utc::now();
        let start = Instant::now();
        let end = Arc::new(LeaseEnd::new(now + secs(5)));
        let window = SendWindow::renewed(now, now + secs(600), end.clone(), Duration::from_secs(1));
        assert_eq!(window.deadline() - start, Duration::from_secs(4));
        end.renewed(now + secs(9));
        assert_eq!(window.deadline() - start, Duration::from_secs(8));
    }

    #[tokio::test(start_paused = true)]
    async fn the_deadline_is_the_earlier_of_lease_end_and_expiry_less_the_margin() {
        let now = Utc::now();
        let start = Instant::now();
        let lease_first =
            SendWindow::new(now, now + secs(60), now + secs(30), Duration::from_secs(2));
        assert_eq!(lease_first.deadline() - start, Duration::from_secs(28));
        let expiry_first =
            SendWindow::new(now, now + secs(10), now + secs(30), Duration::from_secs(2));
        assert_eq!(expiry_first.deadline() - start, Duration::from_secs(8));
        let past = SendWindow::new(now, now - secs(10), now + secs(30), Duration::from_secs(2));
        assert_eq!(past.deadline(), start);
    }
}
