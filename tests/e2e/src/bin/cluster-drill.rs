//! The RabbitMQ cluster drill: three RabbitMQ nodes of this machine's Debian packages joined
//! into one cluster (their own node names, ports and data directories), the real producer,
//! janitor and two SMS workers given all three addresses (`amqp.urls`, each process in another
//! order), and N SMS deliveries (default 10,000). Once a quarter of them are delivered, the node
//! that leads `work.sms` is stopped; once deliveries move again it is started again. Reports
//! what was lost (must be 0), how many keys the provider saw more than once (must be 0: the
//! account does not dedup by key, so the ledger is the only guard), how the quorum queues were
//! replicated, and the times to recover. Prints a table and writes
//! `bench/results/cluster-<time>.json` and `bench/results/cluster-latest.md`.
//!
//!   scripts/rabbitmq-cluster-test.sh [--deliveries N]   (builds the binaries, runs this)
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::print_stdout,
    clippy::print_stderr
)]

use std::collections::HashMap;
use std::time::{Duration, Instant};

use anyhow::Context;
use chrono::Utc;
use clap::Parser;
use nudge_domain::Channel;
use nudge_e2e::private::{RabbitNode, rabbit_cluster};
use nudge_e2e::{Services, TestEnv, WorkerOptions, keys_report, stats, until};
use serde::Serialize;

#[derive(Debug, Parser)]
#[command(about = "Stops the node leading work.sms of a three-node RabbitMQ cluster mid-run")]
struct Args {
    /// SMS deliveries due at the start.
    #[arg(long, default_value_t = 10_000)]
    deliveries: usize,
    /// Each provider answer takes this long (ms), so work is in flight when the node stops.
    #[arg(long, default_value_t = 5)]
    send_delay_ms: u64,
    /// The account's bucket rate (sends/s): paces the run so the stop lands mid-run.
    #[arg(long, default_value_t = 150.0)]
    rate: f64,
}

#[derive(Debug, Serialize)]
struct Report {
    deliveries: usize,
    nodes: Vec<String>,
    queue_members_before: usize,
    stopped_node: String,
    /// Delivered when the stop command returned (the node is down).
    delivered_when_stopped: i64,
    /// How long `rabbitmqctl stop` took (it returns once the node is down).
    stop_command_ms: u128,
    /// The processes that lost their connection with the node and failed over to another.
    failed_over: Vec<String>,
    /// From the node being down until deliveries move again.
    deliveries_resumed_after_ms: u128,
    /// From the node being down until every process answers `/readyz` (broker connected).
    processes_ready_after_ms: u128,
    /// From starting the stopped node until it is a running member of the cluster again.
    node_rejoined_after_ms: u128,
    leader_after: String,
    queue_members_online_after: usize,
    total_s: f64,
    states: HashMap<String, i64>,
    /// Deliveries not delivered (any other state); the drill fails unless 0.
    lost: i64,
    provider_requests: u64,
    provider_unique_keys: u64,
    keys_sent_more_than_once: usize,
    held_ambiguous: i64,
}

/// `name`, `leader`, `members` and `online` of the quorum queue `queue`, from `rabbitmqctl`.
fn queue_placement(node: &RabbitNode, queue: &str) -> anyhow::Result<(String, usize, usize)> {
    let out = node.ctl(&[
        "list_queues",
        "name",
        "leader",
        "members",
        "online",
        "--formatter",
        "json",
    ])?;
    let rows: Vec<serde_json::Value> =
        serde_json::from_str(&out).context("rabbitmqctl list_queues did not answer JSON")?;
    let row = rows
        .iter()
        .find(|r| r["name"] == queue)
        .with_context(|| format!("{queue} is not declared"))?;
    let count = |field: &str| row[field].as_array().map_or(0, Vec::len);
    Ok((
        row["leader"].as_str().unwrap_or_default().to_owned(),
        count("members"),
        count("online"),
    ))
}

async fn delivered(env: &TestEnv) -> anyhow::Result<i64> {
    Ok(
        sqlx::query_scalar("SELECT count(*) FROM deliveries WHERE state = 'delivered'")
            .fetch_one(env.ledger.pool())
            .await?,
    )
}

async fn all_ready(env: &TestEnv, names: &[String]) -> bool {
    for name in names {
        let Some(url) = env.admin_url(name) else {
            return false;
        };
        let ok = env
            .http
            .get(format!("{url}/readyz"))
            .timeout(Duration::from_secs(2))
            .send()
            .await
            .is_ok_and(|r| r.status().is_success());
        if !ok {
            return false;
        }
    }
    true
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let mut terminate = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
    // Interrupted, the drill's future is dropped: its nodes and processes are stopped on the way.
    tokio::select! {
        result = drill(args) => result,
        _ = tokio::signal::ctrl_c() => anyhow::bail!("interrupted; nodes and processes stopped"),
        _ = terminate.recv() => anyhow::bail!("terminated; nodes and processes stopped"),
    }
}

async fn drill(args: Args) -> anyhow::Result<()> {
    eprintln!("starting a three-node RabbitMQ cluster");
    let mut nodes = rabbit_cluster(3)?;
    let urls: Vec<String> = nodes.iter().map(RabbitNode::url).collect();
    let mut env = TestEnv::start_on(
        "cluster",
        Services {
            amqp_url: urls[0].clone(),
            ..Services::shared()
        },
    )
    .await?;
    env.admin_listeners = true;

    eprintln!("seeding {} SMS reminders", args.deliveries);
    let tenant = env.tenant("clinic-cluster", 2).await?;
    let now = Utc::now();
    for i in 0..args.deliveries {
        env.reminder(
            tenant,
            &format!("c-{i}"),
            &[Channel::Sms],
            now,
            now + chrono::Duration::hours(1),
        )
        .await?;
    }
    env.script(
        "sms-main",
        serde_json::json!({"default": {"status": 202, "delay_ms": args.send_delay_ms}}),
    )
    .await?;
    let mut options = WorkerOptions::for_channel(Channel::Sms);
    // The account does not dedup by key: a resend would be a second message to the patient.
    options.accounts = vec![("sms-main".into(), false, true)];
    options.lease_seconds = 15;
    options.prefetch = 32;
    options.rate = Some((args.rate, 10));

    // Each process tries the nodes in its own order, so connections spread over the cluster.
    let rotated = |by: usize| {
        let mut order = urls.clone();
        order.rotate_left(by % urls.len());
        order
    };
    let started = Instant::now();
    env.process_amqp_urls = rotated(0);
    env.start_producer("producer")?;
    env.process_amqp_urls = rotated(1);
    env.start_janitor(200, 1_000)?;
    env.process_amqp_urls = rotated(2);
    env.start_worker(Channel::Sms, "worker-a", &options)?;
    env.process_amqp_urls = rotated(0);
    env.start_worker(Channel::Sms, "worker-b", &options)?;
    let names = env.proc_names();

    let quarter = i64::try_from(args.deliveries / 4).unwrap_or(i64::MAX);
    until("a quarter delivered", Duration::from_secs(600), || async {
        delivered(&env).await.is_ok_and(|d| d >= quarter)
    })
    .await?;
    let queue = format!("{}work.sms", env.namespace);
    let (leader, members_before, _) = queue_placement(&nodes[0], &queue)?;
    let leader_index = nodes
        .iter()
        .position(|n| n.name == leader)
        .with_context(|| format!("the leader {leader} is not one of the drill's nodes"))?;
    let survivor = (leader_index + 1) % nodes.len();
    eprintln!("stopping {leader}, the leader of {queue} ({members_before} members)");
    let stop_started = Instant::now();
    nodes[leader_index].stop()?;
    let stop_command_ms = stop_started.elapsed().as_millis();
    let stopped_at = Instant::now();
    let delivered_when_stopped = delivered(&env).await?;
    until(
        "deliveries to move again",
        Duration::from_secs(300),
        || async {
            delivered(&env)
                .await
                .is_ok_and(|d| d > delivered_when_stopped)
        },
    )
    .await?;
    let resumed_ms = stopped_at.elapsed().as_millis();
    until("every process ready", Duration::from_secs(300), || async {
        all_ready(&env, &names).await
    })
    .await?;
    let ready_ms = stopped_at.elapsed().as_millis();
    eprintln!("deliveries moved again after {resumed_ms} ms; starting {leader} again");

    let restarting = Instant::now();
    nodes[leader_index].restart()?;
    until("the node to rejoin", Duration::from_secs(300), || async {
        queue_placement(&nodes[survivor], &queue).is_ok_and(|(_, _, online)| online == 3)
    })
    .await?;
    let node_rejoined = restarting.elapsed();
    // Each process logs one line per reconnect, naming the node it reached.
    let failed_over: Vec<String> = names
        .iter()
        .filter(|name| {
            std::fs::read_to_string(env.dir.join(format!("{name}.log")))
                .is_ok_and(|log| log.contains("reconnected to RabbitMQ"))
        })
        .cloned()
        .collect();

    let total = i64::try_from(args.deliveries).unwrap_or(i64::MAX);
    until(
        "every delivery settled",
        Duration::from_secs(900),
        || async { env.live().await.is_ok_and(|live| live == 0) },
    )
    .await?;
    let total_s = started.elapsed().as_secs_f64();
    let states = env.states().await?;
    let stub = stats(env.stub_stats().await?)?;
    let keys = keys_report(env.stub_keys().await?)?;
    let (leader_after, _, online_after) = queue_placement(&nodes[survivor], &queue)?;
    let delivered_total = states.get("delivered").copied().unwrap_or(0);
    let report = Report {
        deliveries: args.deliveries,
        nodes: nodes.iter().map(|n| n.name.clone()).collect(),
        queue_members_before: members_before,
        stopped_node: leader,
        delivered_when_stopped,
        stop_command_ms,
        failed_over,
        deliveries_resumed_after_ms: resumed_ms,
        processes_ready_after_ms: ready_ms,
        node_rejoined_after_ms: node_rejoined.as_millis(),
        leader_after,
        queue_members_online_after: online_after,
        total_s,
        lost: total - delivered_total,
        held_ambiguous: states.get("ambiguous").copied().unwrap_or(0),
        states,
        provider_requests: stub.total.requests,
        provider_unique_keys: stub.total.unique_keys,
        keys_sent_more_than_once: keys.keys.iter().filter(|k| k.requests.len() > 1).count(),
    };
    env.stop_all(Duration::from_secs(10));
    drop(env);
    drop(nodes);
    write_report(&report)?;
    anyhow::ensure!(report.lost == 0, "{} deliveries lost", report.lost);
    anyhow::ensure!(
        report.keys_sent_more_than_once == 0,
        "{} keys sent more than once",
        report.keys_sent_more_than_once
    );
    Ok(())
}

fn write_report(report: &Report) -> anyhow::Result<()> {
    let table = format!(
        "| measure | value |\n|---|---|\n\
         | deliveries | {} |\n\
         | quorum queue members before the stop | {} |\n\
         | stopped node (leader of work.sms) | {} |\n\
         | `rabbitmqctl stop` took (returns once the node is down) | {} ms |\n\
         | delivered when the node was down | {} |\n\
         | processes that failed over to another node | {} |\n\
         | deliveries moved again, after the node was down | {} ms |\n\
         | every process ready again, after the node was down | {} ms |\n\
         | the node rejoined after its restart in | {} ms |\n\
         | leader afterwards / members online | {} / {} |\n\
         | whole run | {:.1} s |\n\
         | states | {:?} |\n\
         | lost (not delivered) | {} |\n\
         | provider requests / unique keys | {} / {} |\n\
         | keys sent more than once | {} |\n\
         | held ambiguous | {} |\n",
        report.deliveries,
        report.queue_members_before,
        report.stopped_node,
        report.stop_command_ms,
        report.delivered_when_stopped,
        if report.failed_over.is_empty() {
            "none".to_owned()
        } else {
            report.failed_over.join(", ")
        },
        report.deliveries_resumed_after_ms,
        report.processes_ready_after_ms,
        report.node_rejoined_after_ms,
        report.leader_after,
        report.queue_members_online_after,
        report.total_s,
        report.states,
        report.lost,
        report.provider_requests,
        report.provider_unique_keys,
        report.keys_sent_more_than_once,
        report.held_ambiguous,
    );
    println!("{table}");
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../bench/results");
    std::fs::create_dir_all(&dir)?;
    let stamp = Utc::now().format("%Y%m%dT%H%M%SZ");
    std::fs::write(
        dir.join(format!("cluster-{stamp}.json")),
        serde_json::to_string_pretty(report)?,
    )?;
    std::fs::write(
        dir.join("cluster-latest.md"),
        format!(
            "# RabbitMQ cluster drill ({stamp})\n\n`scripts/rabbitmq-cluster-test.sh --deliveries {}` \
             (debug build, three nodes on one 2-core machine)\n\n{table}",
            report.deliveries
        ),
    )?;
    Ok(())
}
