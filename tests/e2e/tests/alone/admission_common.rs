//! Helpers shared by the admission tests. Their bounds are tight, so they do not run in parallel
//! with other tests (each takes [`crate::alone`]).
#![allow(
    dead_code,
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::print_stderr
)]

use std::time::Duration;

use nudge_domain::Channel;
use nudge_e2e::{TestEnv, WorkerOptions};

pub fn limited(channel: Channel, rate: f64, burst: u32) -> WorkerOptions {
    let mut options = WorkerOptions::for_channel(channel);
    options.rate = Some((rate, burst));
    options.prefetch = 64;
    options
}

pub async fn wait_delivered(env: &mut TestEnv, channel: Channel, n: i64, within: Duration) {
    let ledger = env.ledger.clone();
    env.wait_for(&format!("{n} {channel} deliveries"), within, || {
        let ledger = ledger.clone();
        async move {
            let done: i64 = sqlx::query_scalar(
                "SELECT count(*) FROM deliveries WHERE channel = $1 AND state = 'delivered'",
            )
            .bind(channel.as_str())
            .fetch_one(ledger.pool())
            .await?;
            Ok((done >= n).then_some(()))
        }
    })
    .await;
}
