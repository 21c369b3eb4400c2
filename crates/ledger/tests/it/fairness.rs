#![allow(clippy::unwrap_used, clippy::expect_used)]

//! Fair claiming (invariant 14): a channel's due work is claimed in weighted turns per tenant,
//! oldest first within a tenant, so one tenant's backlog never sets another's lateness.

use std::collections::HashMap;

use nudge_domain::{Channel, TenantId};
use nudge_ledger::test_support::*;
use nudge_ledger::{DueDelivery, Ledger};
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
    // In turns: the batch is published alternating, each tenant's oldest first.
    let order: Vec<bool> = claimed.iter().map(|d| d.tenant_id == big.id).collect();
    assert_eq!(
        order,
        vec![
            true, false, true, false, true, false, true, false, true, false
        ]
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
