//! The retry policy: capped exponential backoff with full jitter, and the limits that bound it.

use std::fmt;
use std::time::Duration;

use rand::rngs::StdRng;
use rand::{Rng, RngExt, SeedableRng};

/// A source of randomness for backoff, injected so that tests (and the decision function's
/// property tests) can pin the exact delay chosen.
pub trait Jitter {
    /// A value in `0..=max_inclusive_ms`. Callers still clamp the result, so a misbehaving
    /// implementation cannot push a delay past its cap.
    fn up_to(&mut self, max_inclusive_ms: u64) -> u64;
}

impl<J: Jitter + ?Sized> Jitter for &mut J {
    fn up_to(&mut self, max_inclusive_ms: u64) -> u64 {
        (**self).up_to(max_inclusive_ms)
    }
}

/// Uniform jitter from any `rand` generator.
pub struct RandJitter<R> {
    rng: R,
}

impl<R: Rng> RandJitter<R> {
    pub fn new(rng: R) -> Self {
        Self { rng }
    }
}

impl RandJitter<StdRng> {
    /// Seeded once from the thread's OS-seeded generator. `StdRng` rather than `ThreadRng`
    /// because it is `Send`, so a worker can hold it across `.await` points.
    pub fn from_entropy() -> Self {
        Self::new(StdRng::from_rng(&mut rand::rng()))
    }
}

impl<R: Rng> Jitter for RandJitter<R> {
    fn up_to(&mut self, max_inclusive_ms: u64) -> u64 {
        self.rng.random_range(0..=max_inclusive_ms)
    }
}

impl<R> fmt::Debug for RandJitter<R> {
    // The generator's state is not interesting and, for seeded generators, predicts the future.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RandJitter").finish_non_exhaustive()
    }
}

/// Always the same value (capped at the maximum): for tests that need an exact delay.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct FixedJitter {
    value_ms: u64,
}

impl FixedJitter {
    pub const fn new(value_ms: u64) -> Self {
        Self { value_ms }
    }

    /// No jitter at all: every backoff is zero. Useful to make tests fast, not in production.
    pub const fn zero() -> Self {
        Self { value_ms: 0 }
    }
}

impl Jitter for FixedJitter {
    fn up_to(&mut self, max_inclusive_ms: u64) -> u64 {
        self.value_ms.min(max_inclusive_ms)
    }
}

/// Always the maximum: the worst case of full jitter, i.e. plain capped exponential backoff.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct MaxJitter;

impl Jitter for MaxJitter {
    fn up_to(&mut self, max_inclusive_ms: u64) -> u64 {
        max_inclusive_ms
    }
}

/// Why a [`RetryPolicy`] was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum InvalidPolicy {
    /// Backoff is computed in whole milliseconds, so a smaller base would be zero: a hot loop.
    #[error("base delay must be at least 1 ms")]
    BaseDelayTooSmall,
    #[error("max delay must be at least the base delay")]
    MaxDelayBelowBase,
    #[error("max attempts must be at least 1")]
    ZeroMaxAttempts,
    #[error("max Retry-After must be greater than zero")]
    ZeroMaxRetryAfter,
}

/// How long to wait between attempts and when to stop.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RetryPolicy {
    base_delay: Duration,
    max_delay: Duration,
    max_attempts: u32,
    max_retry_after: Duration,
}

impl RetryPolicy {
    /// `max_retry_after` is the longest a provider's `Retry-After` may make us hold a delivery;
    /// beyond it we dead-letter rather than send earlier than the provider asked.
    pub fn new(
        base_delay: Duration,
        max_delay: Duration,
        max_attempts: u32,
        max_retry_after: Duration,
    ) -> Result<Self, InvalidPolicy> {
        if base_delay < Duration::from_millis(1) {
            return Err(InvalidPolicy::BaseDelayTooSmall);
        }
        if max_delay < base_delay {
            return Err(InvalidPolicy::MaxDelayBelowBase);
        }
        if max_attempts == 0 {
            return Err(InvalidPolicy::ZeroMaxAttempts);
        }
        if max_retry_after.is_zero() {
            return Err(InvalidPolicy::ZeroMaxRetryAfter);
        }
        Ok(Self {
            base_delay,
            max_delay,
            max_attempts,
            max_retry_after,
        })
    }

    pub fn base_delay(&self) -> Duration {
        self.base_delay
    }

    pub fn max_delay(&self) -> Duration {
        self.max_delay
    }

    pub fn max_attempts(&self) -> u32 {
        self.max_attempts
    }

    pub fn max_retry_after(&self) -> Duration {
        self.max_retry_after
    }

    /// The upper bound of the backoff after attempt `attempt_number` (1-based) failed:
    /// `min(max_delay, base * 2^(attempt_number - 1))`, in whole milliseconds, saturating.
    pub fn backoff_cap(&self, attempt_number: u32) -> Duration {
        Duration::from_millis(self.backoff_cap_ms(attempt_number))
    }

    fn backoff_cap_ms(&self, attempt_number: u32) -> u64 {
        let base_ms = millis_saturating(self.base_delay);
        let max_ms = millis_saturating(self.max_delay);
        let exponent = attempt_number.saturating_sub(1);
        let factor = 1u64.checked_shl(exponent).unwrap_or(u64::MAX);
        base_ms.saturating_mul(factor).min(max_ms)
    }

    /// Full jitter: uniform in `[0, backoff_cap(attempt_number)]`, so that replicas throttled
    /// together do not come back together. Never panics, whatever the attempt number or jitter.
    pub fn backoff(&self, attempt_number: u32, jitter: &mut impl Jitter) -> Duration {
        let cap = self.backoff_cap_ms(attempt_number);
        Duration::from_millis(jitter.up_to(cap).min(cap))
    }
}

impl Default for RetryPolicy {
    fn default() -> Self {
        Self {
            base_delay: Duration::from_secs(1),
            max_delay: Duration::from_secs(5 * 60),
            max_attempts: 8,
            max_retry_after: Duration::from_secs(60 * 60),
        }
    }
}

fn millis_saturating(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

#[cfg(test)]
#[allow(clippy::unwrap_used)] // A failed unwrap is a failed test, with its location.
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn secs(s: u64) -> Duration {
        Duration::from_secs(s)
    }

    /// Misbehaves on purpose: ignores the maximum it was given.
    struct Rogue(u64);

    impl Jitter for Rogue {
        fn up_to(&mut self, _max_inclusive_ms: u64) -> u64 {
            self.0
        }
    }

    #[test]
    fn the_default_policy_is_one_second_to_five_minutes_eight_attempts_one_hour_ceiling() {
        let p = RetryPolicy::default();
        assert_eq!(p.base_delay(), secs(1));
        assert_eq!(p.max_delay(), secs(300));
        assert_eq!(p.max_attempts(), 8);
        assert_eq!(p.max_retry_after(), secs(3600));
        assert_eq!(RetryPolicy::new(secs(1), secs(300), 8, secs(3600)), Ok(p));
    }

    #[test]
    fn a_policy_that_could_hot_loop_or_never_try_is_refused() {
        assert_eq!(
            RetryPolicy::new(Duration::ZERO, secs(1), 1, secs(1)),
            Err(InvalidPolicy::BaseDelayTooSmall)
        );
        assert_eq!(
            RetryPolicy::new(Duration::from_micros(999), secs(1), 1, secs(1)),
            Err(InvalidPolicy::BaseDelayTooSmall)
        );
        assert_eq!(
            RetryPolicy::new(secs(2), secs(1), 1, secs(1)),
            Err(InvalidPolicy::MaxDelayBelowBase)
        );
        assert_eq!(
            RetryPolicy::new(secs(1), secs(1), 0, secs(1)),
            Err(InvalidPolicy::ZeroMaxAttempts)
        );
        assert_eq!(
            RetryPolicy::new(secs(1), secs(1), 1, Duration::ZERO),
            Err(InvalidPolicy::ZeroMaxRetryAfter)
        );
        assert!(
            RetryPolicy::new(
                Duration::from_millis(1),
                Duration::from_millis(1),
                1,
                secs(1)
            )
            .is_ok()
        );
    }

    #[test]
    fn the_backoff_cap_doubles_per_attempt_until_max_delay() {
        let p = RetryPolicy::default();
        let caps: Vec<_> = (1..=10).map(|n| p.backoff_cap(n).as_secs()).collect();
        assert_eq!(caps, [1, 2, 4, 8, 16, 32, 64, 128, 256, 300]);
    }

    #[test]
    fn max_jitter_gives_the_cap_and_fixed_jitter_gives_its_value_below_the_cap() {
        let p = RetryPolicy::default();
        assert_eq!(p.backoff(3, &mut MaxJitter), secs(4));
        assert_eq!(
            p.backoff(3, &mut FixedJitter::new(1_500)),
            Duration::from_millis(1_500)
        );
        assert_eq!(p.backoff(1, &mut FixedJitter::new(1_500)), secs(1));
        assert_eq!(p.backoff(5, &mut FixedJitter::zero()), Duration::ZERO);
    }

    #[test]
    fn attempt_zero_is_treated_like_the_first_attempt() {
        let p = RetryPolicy::default();
        assert_eq!(p.backoff(0, &mut MaxJitter), secs(1));
    }

    #[test]
    fn huge_attempt_numbers_saturate_at_max_delay() {
        let p = RetryPolicy::new(secs(1), Duration::MAX, 1, secs(1)).unwrap();
        assert_eq!(
            p.backoff(u32::MAX, &mut MaxJitter),
            Duration::from_millis(u64::MAX)
        );
        assert_eq!(
            p.backoff(64, &mut MaxJitter),
            Duration::from_millis(u64::MAX)
        );
        assert_eq!(
            RetryPolicy::default().backoff(u32::MAX, &mut MaxJitter),
            secs(300)
        );
    }

    #[test]
    fn a_jitter_that_ignores_its_maximum_is_clamped_to_the_cap() {
        let p = RetryPolicy::default();
        assert_eq!(p.backoff(2, &mut Rogue(u64::MAX)), secs(2));
    }

    #[test]
    fn rand_jitter_stays_within_the_range_and_reaches_both_ends() {
        let mut j = RandJitter::new(StdRng::seed_from_u64(7));
        let draws: Vec<_> = (0..2_000).map(|_| j.up_to(3)).collect();
        assert!(draws.iter().all(|&d| d <= 3));
        assert!(draws.contains(&0) && draws.contains(&3));
        assert_eq!(j.up_to(0), 0);
        let _ = j.up_to(u64::MAX);
        let mut os = RandJitter::from_entropy();
        assert!(os.up_to(10) <= 10);
    }

    #[test]
    fn a_jitter_can_be_passed_as_a_trait_object() {
        let mut inner = MaxJitter;
        let dyn_jitter: &mut dyn Jitter = &mut inner;
        assert_eq!(
            RetryPolicy::default().backoff(2, &mut &mut *dyn_jitter),
            secs(2)
        );
    }

    proptest! {
        #[test]
        fn backoff_never_exceeds_the_capped_exponential_for_any_attempt_or_jitter(
            base_ms in 1u64..=10_000_000,
            extra_ms in 0u64..=100_000_000,
            n in any::<u32>(),
            jitter_value in any::<u64>(),
        ) {
            let base = Duration::from_millis(base_ms);
            let max = Duration::from_millis(base_ms + extra_ms);
            let p = RetryPolicy::new(base, max, 1, secs(1)).unwrap();
            let exponential = (base_ms as u128)
                .saturating_mul(1u128.checked_shl(n.saturating_sub(1)).unwrap_or(u128::MAX));
            let bound = exponential.min(max.as_millis());
            for d in [
                p.backoff(n, &mut FixedJitter::new(jitter_value)),
                p.backoff(n, &mut Rogue(jitter_value)),
                p.backoff(n, &mut MaxJitter),
            ] {
                prop_assert!(d.as_millis() <= bound);
            }
            prop_assert_eq!(p.backoff(n, &mut MaxJitter).as_millis(), bound);
        }
    }
}
