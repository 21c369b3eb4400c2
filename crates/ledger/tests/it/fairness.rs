#![allow(clippy::unwrap_used, clippy::expect_used)]

//! Fair claiming (invariant 14): a channel's due work is claimed in weighted turns per tenant,
//! oldest first within a tenant, so one tenant's backlog never sets another's lateness.

use std::collections::HashMap;

use chrono::{DateTime, Utc};
use nudge_domain::{Channel, ClaimWeight, TenantId, TenantOffer, claim_order};
use nudge_ledger::test_support::*;
use nudge_ledger::{DueDelivery, Ledger};
use sha2::{Digest, Sha256};
use sqlx::PgPool;

/// `count` SMS reminders of `tenant`, due `minutes_ago` minutes before `t0()` and on.
async fn backlog(ledger: &Ledger, tenant: TenantId, prefix: &str, count: usize, minutes_ago: i64) {
    for i in 0..count {
        let at = t0() - secs(60 * minutes_ago) + secs(i64::try_from(i).unwrap());
        owed(
            ledger,
            tenant,
            &format!("{prefix}-{i}"),
            &[Channel::Sms],
            at,
        )
        .await;
    }
}

fn by_tenant(claimed: &[DueDelivery]) -> HashMap<TenantId, usize> {
    let mut counts = HashMap::new();
    for d in claimed {
        *counts.entry(d.tenant_id).or_default() += 1;
    }
    counts
}

#[sqlx::test(migrator = "nudge_ledger::MIGRATOR")]
async fn a_small_tenants_due_work_is_claimed_beside_a_large_backlog_not_behind_it(pool: PgPool) {
    let ledger = Ledger::from_pool(pool);
    let big = ledger.create_tenant("big", &ops(t0())).await.unwrap();
    let small = ledger.create_tenant("small", &ops(t0())).await.unwrap();
    // The backlog is older: oldest first across tenants would claim only big's.
    backlog(&ledger, big.id, "big", 60, 30).await;
    backlog(&ledger, small.id, "small", 5, 1).await;

    let claimed = ledger
        .claim_due(Channel::Sms, 10, at(t0() + secs(120)))
        .await
        .unwrap();

    let counts = by_tenant(&claimed);
    assert_eq!(counts.get(&small.id), Some(&5), "{counts:?}");
    assert_eq!(counts.get(&big.id), Some(&5), "{counts:?}");
    // In turns: the batch is published alternating (which of the two leads a turn is the
    // claim's draw), each tenant's oldest first.
    let order: Vec<bool> = claimed.iter().map(|d| d.tenant_id == big.id).collect();
    assert!(
        order.chunks(2).all(|turn| turn[0] != turn[1]),
        "one of each per turn: {order:?}"
    );
    let big_times: Vec<_> = claimed
        .iter()
        .filter(|d| d.tenant_id == big.id)
        .map(|d| d.next_attempt_at)
        .collect();
    assert!(
        big_times.windows(2).all(|w| w[0] <= w[1]),
        "oldest first within a tenant"
    );
    assert_eq!(
        big_times[0],
        t0() - secs(30 * 60),
        "big's oldest is claimed first"
    );
}

#[sqlx::test(migrator = "nudge_ledger::MIGRATOR")]
async fn a_tenants_weight_is_its_share_of_each_claim_and_unused_share_goes_to_the_others(
    pool: PgPool,
) {
    let ledger = Ledger::from_pool(pool);
    let big = ledger.create_tenant("big", &ops(t0())).await.unwrap();
    let small = ledger.create_tenant("small", &ops(t0())).await.unwrap();
    backlog(&ledger, big.id, "big", 60, 30).await;
    backlog(&ledger, small.id, "small", 60, 20).await;
    let previous = ledger
        .set_tenant_weight(big.id, 3, &ops(t0()))
        .await
        .unwrap();
    assert_eq!(previous, Some(1));

    let claimed = ledger
        .claim_due(Channel::Sms, 20, at(t0() + secs(120)))
        .await
        .unwrap();
    let counts = by_tenant(&claimed);
    assert_eq!(counts.get(&big.id), Some(&15), "three to one: {counts:?}");
    assert_eq!(counts.get(&small.id), Some(&5), "{counts:?}");

    // Small has 55 left and big 45: a claim of 100 takes all of both (no share is left unused
    // while another tenant has due work).
    let rest = ledger
        .claim_due(Channel::Sms, 100, at(t0() + secs(120)))
        .await
        .unwrap();
    let counts = by_tenant(&rest);
    assert_eq!(counts.get(&big.id), Some(&45), "{counts:?}");
    assert_eq!(counts.get(&small.id), Some(&55), "{counts:?}");
}

#[sqlx::test(migrator = "nudge_ledger::MIGRATOR")]
async fn a_weight_outside_one_to_a_thousand_is_refused_and_an_unknown_tenant_changes_nothing(
    pool: PgPool,
) {
    let ledger = Ledger::from_pool(pool);
    let tenant = ledger.create_tenant("t", &ops(t0())).await.unwrap();
    assert!(
        ledger
            .set_tenant_weight(tenant.id, 0, &ops(t0()))
            .await
            .is_err()
    );
    assert!(
        ledger
            .set_tenant_weight(tenant.id, 1001, &ops(t0()))
            .await
            .is_err()
    );
    let unknown = TenantId::from_uuid(uuid::Uuid::now_v7());
    assert_eq!(
        ledger
            .set_tenant_weight(unknown, 2, &ops(t0()))
            .await
            .unwrap(),
        None
    );
    let audited: i64 =
        sqlx::query_scalar("SELECT count(*) FROM audit_log WHERE action = 'tenant_weight'")
            .fetch_one(ledger.pool())
            .await
            .unwrap();
    assert_eq!(audited, 0);
}

/// A tenant's offer as the claim sees it: due deliveries by (due time, id), the draw's hash.
type Offer = TenantOffer<(DateTime<Utc>, uuid::Uuid), Vec<u8>>;

/// A small deterministic generator, so a failing scenario reproduces from its seed.
struct Draws(u64);

impl Draws {
    fn next(&mut self, below: u64) -> u64 {
        self.0 = self
            .0
            .wrapping_mul(6_364_136_223_846_793_005)
            .wrapping_add(1_442_695_040_888_963_407);
        (self.0 >> 33) % below
    }
}

/// The relay's claim against `nudge_domain::fairness::claim_order`, the rule it implements:
/// random tenants (weights, passes left by earlier claims, due work at random times), three
/// claims in a row of random sizes; each claim takes the same deliveries in the same order, and
/// leaves the same passes, as the domain's function says.
async fn the_claim_is_the_domains_rule(pool: PgPool, seed: u64) {
    let ledger = Ledger::from_pool(pool.clone());
    let mut rng = Draws(seed);
    let mut tenants = Vec::new();
    for t in 0..2 + rng.next(4) {
        let tenant = ledger
            .create_tenant(&format!("tenant-{t}"), &ops(t0()))
            .await
            .unwrap();
        let weight = u32::try_from(1 + rng.next(4)).unwrap();
        ledger
            .set_tenant_weight(tenant.id, weight, &ops(t0()))
            .await
            .unwrap();
        if rng.next(2) == 0 {
            #[allow(clippy::cast_precision_loss)]
            let pass = rng.next(40) as f64 / 4.0;
            sqlx::query(
                "INSERT INTO tenant_claim_passes (channel, tenant_id, pass) VALUES ('sms', $1, $2)",
            )
            .bind(tenant.id.as_uuid())
            .bind(pass)
            .execute(&pool)
            .await
            .unwrap();
        }
        for i in 0..rng.next(25) {
            // Few distinct times, so deliveries due at one instant are common.
            let due = t0() - secs(i64::try_from(rng.next(5)).unwrap() * 10);
            owed(
                &ledger,
                tenant.id,
                &format!("t{t}-{i}"),
                &[Channel::Sms],
                due,
            )
            .await;
        }
        tenants.push((tenant.id, weight));
    }
    let now = t0() + secs(60);
    for round in 0..3 {
        let limit = u32::try_from(1 + rng.next(30)).unwrap();
        let draw = rng.next(u64::MAX);
        let due: Vec<(uuid::Uuid, uuid::Uuid, DateTime<Utc>)> = sqlx::query_as(
            "SELECT id, tenant_id, next_attempt_at FROM deliveries
             WHERE channel = 'sms' AND state IN ('scheduled', 'retry_wait')
               AND next_attempt_at <= $1",
        )
        .bind(now)
        .fetch_all(&pool)
        .await
        .unwrap();
        let passes: HashMap<uuid::Uuid, f64> =
            sqlx::query_as("SELECT tenant_id, pass FROM tenant_claim_passes WHERE channel = 'sms'")
                .fetch_all(&pool)
                .await
                .unwrap()
                .into_iter()
                .collect();
        let offers: Vec<Offer> = tenants
            .iter()
            .map(|&(tenant, weight)| {
                let mut items: Vec<_> = due
                    .iter()
                    .filter(|d| d.1 == tenant.as_uuid())
                    .map(|d| (d.2, d.0))
                    .collect();
                items.sort();
                TenantOffer {
                    weight: ClaimWeight::new(weight).unwrap(),
                    pass: passes.get(&tenant.as_uuid()).copied(),
                    tiebreak: Sha256::digest(format!("{}:{draw}", tenant.as_uuid()).as_bytes())
                        .to_vec(),
                    due: items,
                }
            })
            .collect();
        let expected = claim_order(&offers, usize::try_from(limit).unwrap());

        let claimed = ledger
            .claim_due_drawn(Channel::Sms, limit, at(now), draw)
            .await
            .unwrap();
        let got: Vec<uuid::Uuid> = claimed.iter().map(|d| d.id.as_uuid()).collect();
        let want: Vec<uuid::Uuid> = expected.claimed.iter().map(|c| c.item.1).collect();
        assert_eq!(got, want, "seed {seed}, claim {round} of {limit}");
        let after: HashMap<uuid::Uuid, f64> =
            sqlx::query_as("SELECT tenant_id, pass FROM tenant_claim_passes WHERE channel = 'sms'")
                .fetch_all(&pool)
                .await
                .unwrap()
                .into_iter()
                .collect();
        for (i, &(tenant, _)) in tenants.iter().enumerate() {
            assert_eq!(
                after.get(&tenant.as_uuid()).copied(),
                expected.passes[i],
                "seed {seed}, claim {round}: tenant {i}'s pass"
            );
        }
    }
}

#[sqlx::test(migrator = "nudge_ledger::MIGRATOR")]
async fn the_claim_is_the_domains_rule_seed_1(pool: PgPool) {
    the_claim_is_the_domains_rule(pool, 1).await;
}

#[sqlx::test(migrator = "nudge_ledger::MIGRATOR")]
async fn the_claim_is_the_domains_rule_seed_2(pool: PgPool) {
    the_claim_is_the_domains_rule(pool, 2).await;
}

#[sqlx::test(migrator = "nudge_ledger::MIGRATOR")]
async fn the_claim_is_the_domains_rule_seed_3(pool: PgPool) {
    the_claim_is_the_domains_rule(pool, 3).await;
}

#[sqlx::test(migrator = "nudge_ledger::MIGRATOR")]
async fn the_claim_is_the_domains_rule_seed_4(pool: PgPool) {
    the_claim_is_the_domains_rule(pool, 4).await;
}

#[sqlx::test(migrator = "nudge_ledger::MIGRATOR")]
async fn claims_of_one_serve_tenants_with_equal_backlogs_in_turn(pool: PgPool) {
    let ledger = Ledger::from_pool(pool);
    let mut ids = Vec::new();
    for name in ["a", "b", "c"] {
        let tenant = ledger.create_tenant(name, &ops(t0())).await.unwrap();
        // Every tenant's work due at one instant: only the passes tell them apart.
        for i in 0..4 {
            owed(
                &ledger,
                tenant.id,
                &format!("{name}-{i}"),
                &[Channel::Sms],
                t0(),
            )
            .await;
        }
        ids.push(tenant.id);
    }
    let mut served = Vec::new();
    for _ in 0..9 {
        let claimed = ledger
            .claim_due(Channel::Sms, 1, at(t0() + secs(1)))
            .await
            .unwrap();
        served.push(claimed[0].tenant_id);
    }
    for round in served.chunks(3) {
        let mut round = round.to_vec();
        round.sort();
        let mut all = ids.clone();
        all.sort();
        assert_eq!(
            round, all,
            "each tenant once in every three claims: {served:?}"
        );
    }
}

#[sqlx::test(migrator = "nudge_ledger::MIGRATOR")]
async fn a_pass_another_relay_moved_meanwhile_is_left_as_that_relay_wrote_it(pool: PgPool) {
    let ledger = Ledger::from_pool(pool.clone());
    let a = ledger.create_tenant("a", &ops(t0())).await.unwrap();
    let b = ledger.create_tenant("b", &ops(t0())).await.unwrap();
    for (tenant, name) in [(a.id, "a"), (b.id, "b")] {
        for i in 0..3 {
            owed(
                &ledger,
                tenant,
                &format!("{name}-{i}"),
                &[Channel::Sms],
                t0(),
            )
            .await;
        }
        sqlx::query(
            "INSERT INTO tenant_claim_passes (channel, tenant_id, pass) VALUES ('sms', $1, 0)",
        )
        .bind(tenant.as_uuid())
        .execute(&pool)
        .await
        .unwrap();
    }
    // Another relay's claim, not yet committed, moved a's pass.
    let mut other = pool.begin().await.unwrap();
    sqlx::query("UPDATE tenant_claim_passes SET pass = 7 WHERE tenant_id = $1")
        .bind(a.id.as_uuid())
        .execute(&mut *other)
        .await
        .unwrap();
    let claiming = {
        let ledger = ledger.clone();
        tokio::spawn(async move { ledger.claim_due(Channel::Sms, 2, at(t0() + secs(1))).await })
    };
    // This claim read a's pass as 0 and now waits for the other's row.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    loop {
        let waiting: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM pg_stat_activity
             WHERE wait_event_type = 'Lock' AND query LIKE '%tenant_claim_passes%'",
        )
        .fetch_one(&pool)
        .await
        .unwrap();
        if waiting > 0 {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the claim never waited"
        );
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    other.commit().await.unwrap();
    let claimed = claiming.await.unwrap().unwrap();
    assert_eq!(claimed.len(), 2, "one of each");

    let pass: f64 = sqlx::query_scalar("SELECT pass FROM tenant_claim_passes WHERE tenant_id = $1")
        .bind(a.id.as_uuid())
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(pass, 7.0, "the other relay's turns stand");
    let pass: f64 = sqlx::query_scalar("SELECT pass FROM tenant_claim_passes WHERE tenant_id = $1")
        .bind(b.id.as_uuid())
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(pass, 1.0, "b's own turn is counted");
}
