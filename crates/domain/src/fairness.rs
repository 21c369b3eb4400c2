//! Fairness between tenants on a shared channel and provider account (invariant 14).
//!
//! Two rules, each with one home:
//! - **Whose work is claimed next** ([`claim_order`]): stride scheduling over the tenants with
//!   due work. Each tenant has a *pass* per channel, the virtual time of its next turn; its n-th
//!   offered delivery is at turn `start + (n - 1) / weight`, and a claim takes the earliest
//!   turns (oldest first within a turn). The pass is kept between claims, so a claim of one
//!   delivery serves tenants in turn as a claim of a hundred does, and by weight. A tenant
//!   with no pass yet, or one left behind while it had nothing due, starts at the lowest pass
//!   of those with due work (it banks no credit while idle); one far ahead starts at most one
//!   turn above it (a lead earned while the others were idle is not held against it). The
//!   relay's SQL (`ledger::deliveries::claim`) is this function; a ledger test holds them
//!   together on random inputs.
//! - **How much a tenant may take of an account** ([`MaxShare`]): an optional cap, a share of
//!   the bucket's admitting rate enforced by admission (`admission::admit_capped`) even when the
//!   tenant is alone.
//!
//! [`fair_shares`] says what each tenant is owed when several wait together: the account's rate
//! split by weight, a capped tenant held to its cap and a tenant that needs less given what it
//! needs, the rest shared again among the others (max-min fairness). The property tests below
//! run the two rules together against it.

use std::cmp::Ordering;

pub use crate::admission::MaxShare;

/// Why a [`ClaimWeight`] was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum InvalidFairness {
    #[error("a claim weight is a whole number from 1 to 1000")]
    Weight,
}

/// A tenant's weight in the claim's turns: 1 to 1000 (default 1).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct ClaimWeight(u32);

impl ClaimWeight {
    pub const DEFAULT: Self = Self(1);

    pub fn new(weight: u32) -> Result<Self, InvalidFairness> {
        if (1..=1000).contains(&weight) {
            Ok(Self(weight))
        } else {
            Err(InvalidFairness::Weight)
        }
    }

    pub fn get(self) -> u32 {
        self.0
    }
}

/// One tenant's offer to a claim: its weight, its pass on the channel (None when it has
/// none yet), the claim's draw for it (`tiebreak`: orders tenants whose turns are equal) and
/// its due deliveries, oldest first (whatever orders them: time, then id).
#[derive(Debug, Clone)]
pub struct TenantOffer<T, K = u64> {
    pub weight: ClaimWeight,
    pub pass: Option<f64>,
    pub tiebreak: K,
    pub due: Vec<T>,
}

/// What a claim takes: each item with its tenant (index into the offers) and turn, in the
/// order the claim publishes them; and each tenant's pass after it: one turn after its last
/// item claimed, its start for a tenant with due work that got nothing, unchanged for one with
/// nothing due.
#[derive(Debug, Clone, PartialEq)]
pub struct ClaimOrder<T> {
    pub claimed: Vec<Claimed<T>>,
    pub passes: Vec<Option<f64>>,
}

#[derive(Debug, Clone, PartialEq)]
pub struct Claimed<T> {
    pub tenant: usize,
    pub turn: f64,
    pub item: T,
}

/// The claim's rule (see the module): at most `limit` items, in turn order; tenants at the same
/// turn in the order of the claim's draw, so no tenant is first at every turn (the relay draws
/// afresh for every claim: one that always went first would be served first by admission too,
/// claim after claim); oldest first within a tenant. Each tenant offers at most `limit` items.
pub fn claim_order<T: Ord + Clone, K: Ord>(
    offers: &[TenantOffer<T, K>],
    limit: usize,
) -> ClaimOrder<T> {
    let floor = offers
        .iter()
        .filter(|o| !o.due.is_empty())
        .filter_map(|o| o.pass)
        .min_by(f64::total_cmp)
        .unwrap_or(0.0);
    let mut turns: Vec<Claimed<T>> = Vec::new();
    for (tenant, offer) in offers.iter().enumerate() {
        let start = start_of(offer, floor);
        let weight = f64::from(offer.weight.get());
        for (n, item) in offer.due.iter().take(limit).enumerate() {
            // The same operations, in the same order, as the SQL: (n - 1) / weight, then added.
            #[allow(clippy::cast_precision_loss)]
            let step = n as f64 / weight;
            turns.push(Claimed {
                tenant,
                turn: start + step,
                item: item.clone(),
            });
        }
    }
    turns.sort_by(|a, b| match a.turn.total_cmp(&b.turn) {
        Ordering::Equal => offers[a.tenant]
            .tiebreak
            .cmp(&offers[b.tenant].tiebreak)
            .then_with(|| a.item.cmp(&b.item)),
        other => other,
    });
    turns.truncate(limit);
    let mut passes: Vec<Option<f64>> = offers.iter().map(|o| o.pass).collect();
    for (tenant, offer) in offers.iter().enumerate() {
        if offer.due.is_empty() {
            continue;
        }
        let last = turns
            .iter()
            .filter(|c| c.tenant == tenant)
            .map(|c| c.turn)
            .max_by(f64::total_cmp);
        passes[tenant] = Some(match last {
            Some(last) => last + 1.0 / f64::from(offer.weight.get()),
            // Waited this claim: it keeps the start it was given, so a tenant seen for the
            // first time is ahead of one served at the same start.
            None => start_of(offer, floor),
        });
    }
    ClaimOrder {
        claimed: turns,
        passes,
    }
}

/// Where a tenant's turns start in a claim whose lowest pass with due work is `floor`.
fn start_of<T, K>(offer: &TenantOffer<T, K>, floor: f64) -> f64 {
    offer.pass.unwrap_or(floor).max(floor).min(floor + 1.0)
}

/// What one tenant asks of an account: its weight, its cap, and the rate it could use (its
/// demand: `f64::INFINITY` for a backlog).
#[derive(Debug, Clone, Copy)]
pub struct Contender {
    pub weight: ClaimWeight,
    pub max_share: Option<MaxShare>,
    pub demand: f64,
}

/// Each contender's fair share of `rate` (max-min fairness by weight): every tenant gets its
/// weighted part of what is left, unless its cap or its demand is smaller, in which case it
/// gets that and the rest is shared again among the others. The shares never add up to more
/// than `rate`.
pub fn fair_shares(rate: f64, contenders: &[Contender]) -> Vec<f64> {
    let mut shares = vec![0.0; contenders.len()];
    let mut open: Vec<usize> = (0..contenders.len())
        .filter(|&i| contenders[i].demand > 0.0)
        .collect();
    let mut left = rate.max(0.0);
    while !open.is_empty() {
        let total: f64 = open
            .iter()
            .map(|&i| f64::from(contenders[i].weight.get()))
            .sum();
        let limit = |i: usize| {
            let c = contenders[i];
            c.demand
                .min(c.max_share.map_or(f64::INFINITY, |s| s.get() * rate))
        };
        let held: Vec<usize> = open
            .iter()
            .copied()
            .filter(|&i| limit(i) <= left * f64::from(contenders[i].weight.get()) / total)
            .collect();
        if held.is_empty() {
            for &i in &open {
                shares[i] = left * f64::from(contenders[i].weight.get()) / total;
            }
            break;
        }
        for &i in &held {
            shares[i] = limit(i);
            left -= shares[i];
        }
        open.retain(|i| !held.contains(i));
    }
    shares
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::cast_precision_loss)]

    use chrono::{DateTime, TimeDelta, TimeZone, Utc};
    use proptest::prelude::*;

    use super::*;
    use crate::admission::{
        Admission, AdmissionSettings, BucketConfig, BucketState, TenantCap, admit_capped,
    };
    use crate::lane::Lane;

    fn weight(w: u32) -> ClaimWeight {
        ClaimWeight::new(w).unwrap()
    }

    fn offer(w: u32, pass: Option<f64>, due: &[u32]) -> TenantOffer<u32> {
        TenantOffer {
            weight: weight(w),
            pass,
            tiebreak: 0,
            due: due.to_vec(),
        }
    }

    fn tenants_of(order: &ClaimOrder<u32>) -> Vec<usize> {
        order.claimed.iter().map(|c| c.tenant).collect()
    }

    #[test]
    fn a_weight_or_share_out_of_range_is_refused_and_a_share_of_one_is_no_cap() {
        assert_eq!(ClaimWeight::new(0), Err(InvalidFairness::Weight));
        assert_eq!(ClaimWeight::new(1001), Err(InvalidFairness::Weight));
        assert_eq!(ClaimWeight::new(1000).unwrap().get(), 1000);
        for bad in [0.0, -0.5, 1.01, f64::NAN, f64::INFINITY] {
            assert_eq!(
                MaxShare::new(bad),
                Err(crate::admission::InvalidShare),
                "{bad}"
            );
        }
        assert_eq!(MaxShare::new(1.0), Ok(None));
        assert_eq!(MaxShare::new(0.5).unwrap().unwrap().get(), 0.5);
        let tenth = MaxShare::new(0.1).unwrap().unwrap();
        assert_eq!((tenth.burst(40), tenth.burst(5), tenth.burst(1)), (4, 1, 1));
    }

    #[test]
    fn claims_of_one_serve_equal_tenants_in_turn_by_their_passes() {
        // Three tenants with backlogs, a claim of one at a time: round robin, whatever the
        // order of their items.
        let mut passes = vec![None, None, None];
        let due = [vec![1, 2, 3, 4], vec![10, 11, 12, 13], vec![20, 21, 22, 23]];
        let mut served = Vec::new();
        for round in 0..9 {
            let offers: Vec<_> = (0..3)
                .map(|t| {
                    let taken = served.iter().filter(|&&s| s == t).count();
                    offer(1, passes[t], &due[t][taken..])
                })
                .collect();
            let order = claim_order(&offers, 1);
            assert_eq!(order.claimed.len(), 1, "round {round}");
            served.push(order.claimed[0].tenant);
            passes = order.passes;
        }
        assert_eq!(served, vec![0, 1, 2, 0, 1, 2, 0, 1, 2]);
    }

    #[test]
    fn a_heavier_tenant_gets_its_weight_in_turns_across_claims() {
        let mut passes = vec![None, None];
        let mut counts = [0usize; 2];
        for _ in 0..40 {
            let offers = vec![
                offer(3, passes[0], &[counts[0] as u32]),
                offer(1, passes[1], &[1_000 + counts[1] as u32]),
            ];
            let order = claim_order(&offers, 1);
            counts[order.claimed[0].tenant] += 1;
            passes = order.passes;
        }
        assert_eq!(counts, [30, 10]);
    }

    #[test]
    fn a_tenant_coming_back_banks_no_credit_and_a_stale_lead_is_cut_to_one_turn() {
        // Tenant 0 comes back after idling (pass 2) beside tenant 1 at 100: the floor is the
        // lowest pass with due work, and 1's lead is cut to one turn above it, so 0 is ahead
        // by one turn, not by 98.
        let order = claim_order(
            &[
                offer(1, Some(2.0), &[1, 2]),
                offer(1, Some(100.0), &[10, 11]),
            ],
            4,
        );
        assert_eq!(tenants_of(&order), vec![0, 0, 1, 1]);
        assert_eq!(order.passes, vec![Some(4.0), Some(5.0)]);
        // A tenant without a pass starts level with the others.
        let order = claim_order(
            &[offer(1, Some(7.0), &[1, 2]), offer(1, None, &[10, 11])],
            3,
        );
        assert_eq!(tenants_of(&order), vec![0, 1, 0]);
        assert_eq!(order.passes, vec![Some(9.0), Some(8.0)]);
    }

    #[test]
    fn shares_split_by_weight_give_a_capped_or_small_tenant_its_need_and_the_rest_to_others() {
        let c = |w: u32, cap: Option<f64>, demand: f64| Contender {
            weight: weight(w),
            max_share: cap.map(|s| MaxShare::new(s).unwrap().unwrap()),
            demand,
        };
        assert_eq!(
            fair_shares(
                40.0,
                &[c(1, None, f64::INFINITY), c(1, None, f64::INFINITY)]
            ),
            vec![20.0, 20.0]
        );
        assert_eq!(
            fair_shares(
                40.0,
                &[c(3, None, f64::INFINITY), c(1, None, f64::INFINITY)]
            ),
            vec![30.0, 10.0]
        );
        assert_eq!(
            fair_shares(
                40.0,
                &[c(1, Some(0.25), f64::INFINITY), c(1, None, f64::INFINITY)]
            ),
            vec![10.0, 30.0]
        );
        assert_eq!(
            fair_shares(40.0, &[c(1, None, 4.0), c(1, None, f64::INFINITY)]),
            vec![4.0, 36.0]
        );
        assert_eq!(
            fair_shares(40.0, &[c(1, Some(0.5), f64::INFINITY)]),
            vec![20.0]
        );
        assert_eq!(fair_shares(40.0, &[c(1, None, 0.0)]), vec![0.0]);
    }

    fn t0() -> DateTime<Utc> {
        Utc.with_ymd_and_hms(2030, 1, 1, 0, 0, 0).unwrap()
    }

    /// Sends in the busiest window of `width` among `times`.
    fn busiest(mut times: Vec<DateTime<Utc>>, width: TimeDelta) -> usize {
        times.sort();
        let mut best = 0;
        let mut start = 0;
        for end in 0..times.len() {
            while times[end] - times[start] >= width {
                start += 1;
            }
            best = best.max(end - start + 1);
        }
        best
    }

    struct Sim {
        sends: Vec<Vec<DateTime<Utc>>>,
        finished: Vec<Option<DateTime<Utc>>>,
    }

    /// The relay and the workers on one account, in ticks of `tick_ms`: each tick the relay
    /// claims (by [`claim_order`]) what the in-flight window has room for, `window` messages,
    /// and a worker asks admission for each in the order published; a delivery without a slot
    /// within the wait goes back, due at the slot it was told. Every tenant's backlog is due
    /// at the start.
    fn simulate(
        config: &BucketConfig,
        tenants: &[(u32, Option<f64>, usize)],
        window: usize,
        tick_ms: i64,
        seconds: i64,
    ) -> Sim {
        // As deployed: the relay's window (`producer.in_flight_seconds`, 1 s of the rate) fits
        // inside the workers' admission wait (`admission.max_wait_ms`, 1.5 s), so what the
        // relay claims finds a slot and keeps the turn it was claimed in. With a wait shorter
        // than the window, the surplus of every claim goes back and loses its turn to a
        // backlog's fresh work: a small tenant then took four times its share's time.
        let settings = AdmissionSettings {
            max_wait: std::time::Duration::from_millis(1_500),
            ..AdmissionSettings::default()
        };
        let mut state = BucketState::fresh(config);
        let mut caps: Vec<Option<DateTime<Utc>>> = vec![None; tenants.len()];
        // Per tenant: (due at, sequence) of what is owed.
        let mut owed: Vec<Vec<(DateTime<Utc>, usize)>> = tenants
            .iter()
            .map(|&(_, _, n)| (0..n).map(|i| (t0(), i)).collect())
            .collect();
        let mut passes: Vec<Option<f64>> = vec![None; tenants.len()];
        let mut in_flight: Vec<(DateTime<Utc>, usize)> = Vec::new();
        let mut sim = Sim {
            sends: vec![Vec::new(); tenants.len()],
            finished: vec![None; tenants.len()],
        };
        let end = t0() + TimeDelta::seconds(seconds);
        let mut now = t0();
        // The relay's draw, a fixed sequence so a failure reproduces.
        let mut draw: u64 = 0x5eed;
        while now < end {
            in_flight.retain(|&(at, _)| at > now);
            let mut deferred = vec![0u32; tenants.len()];
            let room = window.saturating_sub(in_flight.len());
            let offers: Vec<TenantOffer<(DateTime<Utc>, usize)>> = tenants
                .iter()
                .enumerate()
                .map(|(t, &(w, _, _))| {
                    let mut due: Vec<_> = owed[t].iter().copied().filter(|d| d.0 <= now).collect();
                    due.sort();
                    draw = draw
                        .wrapping_mul(6_364_136_223_846_793_005)
                        .wrapping_add(1_442_695_040_888_963_407);
                    TenantOffer {
                        weight: weight(w),
                        pass: passes[t],
                        tiebreak: draw >> 33,
                        due,
                    }
                })
                .collect();
            let order = claim_order(&offers, room);
            passes = order.passes;
            for claimed in order.claimed {
                let t = claimed.tenant;
                owed[t].retain(|d| *d != claimed.item);
                let cap = tenants[t].1.map(|s| TenantCap {
                    share: MaxShare::new(s).unwrap().unwrap(),
                    tat: &mut caps[t],
                    deferred: &mut deferred[t],
                });
                match admit_capped(config, &mut state, Lane::New, now, &settings, cap) {
                    Admission::Admitted { send_at } => {
                        sim.sends[t].push(send_at);
                        in_flight.push((send_at, t));
                        if owed[t].is_empty() {
                            sim.finished[t] = Some(send_at);
                        }
                    }
                    Admission::Deferred { until, .. } => owed[t].push((until, claimed.item.1)),
                }
            }
            now += TimeDelta::milliseconds(tick_ms);
        }
        sim
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(24))]

        /// Tenants with backlogs, weights and caps share one account through the claim's turns
        /// and admission: the account's rate plus burst bounds every second, a capped tenant
        /// never passes its cap, and every other tenant gets at least its fair share of the
        /// run (what the capped ones left, split by weight), less what the in-flight window
        /// can hold back.
        #[test]
        fn no_tenant_falls_below_its_share_while_it_has_due_work_and_the_rate_is_never_exceeded(
            rate in 20.0f64..200.0,
            burst in 1u32..10,
            tenants in proptest::collection::vec(
                (1u32..4, proptest::option::weighted(0.3, 0.1f64..0.9)), 2..6),
            tick_ms in prop_oneof![Just(20i64), Just(50), Just(100)],
        ) {
            let config = BucketConfig::new(rate, burst, 0.2, 0.1).unwrap();
            let seconds = 20;
            // Backlogs larger than the whole run can send: every tenant has due work throughout.
            let backlog = (rate as usize + 10) * seconds as usize;
            let spec: Vec<_> = tenants.iter().map(|&(w, cap)| (w, cap, backlog)).collect();
            let window = (rate.ceil() as usize).max(20);
            let sim = simulate(&config, &spec, window, tick_ms, seconds);
            let end = t0() + TimeDelta::seconds(seconds);
            let all: Vec<DateTime<Utc>> = sim.sends.iter().flatten().copied().collect();
            let limit = rate + f64::from(burst);
            prop_assert!(busiest(all, TimeDelta::seconds(1)) as f64 <= limit);
            // A capped tenant is held to its cap (checked below) and may take less than it:
            // the cap holds a request back to the tenant's own next slot, and the relay claims
            // it again only after. What it did not take is owed to the others, so its demand
            // is what it sent.
            let contenders: Vec<Contender> = tenants
                .iter()
                .enumerate()
                .map(|(t, &(w, cap))| Contender {
                    weight: weight(w),
                    max_share: cap.map(|s| MaxShare::new(s).unwrap().unwrap()),
                    demand: if cap.is_some() {
                        sim.sends[t].iter().filter(|&&at| at < end).count() as f64 / seconds as f64
                    } else {
                        f64::INFINITY
                    },
                })
                .collect();
            let shares = fair_shares(rate, &contenders);
            for (t, &(_, cap)) in tenants.iter().enumerate() {
                let sent = sim.sends[t].iter().filter(|&&at| at < end).count();
                if let Some(share) = cap {
                    let capped = MaxShare::new(share).unwrap().unwrap();
                    let most = share * rate + f64::from(capped.burst(burst));
                    let seen = busiest(sim.sends[t].clone(), TimeDelta::seconds(1));
                    prop_assert!(seen as f64 <= most + 1e-9,
                        "tenant {} capped at {} sent {} in a second", t, share, seen);
                }
                if cap.is_some() {
                    continue;
                }
                // Owed over the run: its share for the whole run, less the first second (the
                // window fills) and one window of work (claimed, then held back by the wait).
                let owed = shares[t] * (seconds - 1) as f64 - window as f64;
                prop_assert!(sent as f64 >= owed,
                    "tenant {} sent {} of {:.0} owed (share {:.1}/s of {:.1})",
                    t, sent, owed, shares[t], rate);
            }
        }

        /// A small tenant joining a large tenant's backlog finishes about as soon as its
        /// share allows, not behind the backlog.
        #[test]
        fn a_small_tenant_beside_a_backlog_finishes_within_its_share_of_the_rate(
            rate in 20.0f64..200.0,
            small in 1usize..40,
            big_weight in 1u32..4,
        ) {
            let config = BucketConfig::new(rate, 5, 0.2, 0.1).unwrap();
            let backlog = rate as usize * 30;
            let spec = [(big_weight, None, backlog), (1, None, small)];
            let window = (rate.ceil() as usize).max(20);
            let sim = simulate(&config, &spec, window, 50, 30);
            let done = sim.finished[1].expect("the small tenant finished");
            let share = rate / f64::from(big_weight + 1);
            // Its items at its share, plus one window of work ahead of it (claimed with its
            // first items and sent in turn with them) and half a second. Served after the
            // backlog it would take 30 s.
            let bound = small as f64 / share + window as f64 / rate + 0.5;
            let took = (done - t0()).num_milliseconds() as f64 / 1_000.0;
            prop_assert!(took <= bound, "took {:.2} s, bound {:.2} s", took, bound);
        }
    }
}
