//! The table against the benchmark's targets, the per-case figures, and the files under
//! `bench/results/`.

use std::fmt::Write as _;
use std::path::Path;

use chrono::Utc;

use crate::Results;
use crate::load::LoadSample;
use crate::run::RunSample;

const NOT_LOADED: &str = "n/a (pg_stat_statements not loaded)";

/// The run with the median rate (the lower middle one for an even count).
fn median(samples: &[RunSample]) -> Option<&RunSample> {
    let mut sorted: Vec<&RunSample> = samples.iter().collect();
    sorted.sort_by(|a, b| a.per_second.total_cmp(&b.per_second));
    sorted.get(sorted.len().saturating_sub(1) / 2).copied()
}

fn median_load(samples: &[LoadSample]) -> Option<&LoadSample> {
    let mut sorted: Vec<&LoadSample> = samples.iter().collect();
    sorted.sort_by(|a, b| a.per_second.total_cmp(&b.per_second));
    sorted.get(sorted.len().saturating_sub(1) / 2).copied()
}

fn yes_no(met: bool) -> &'static str {
    if met { "yes" } else { "**no**" }
}

fn cpu(sample: &RunSample, process: &str) -> f64 {
    sample
        .cpu_s_per_1000
        .iter()
        .filter(|(name, _)| name.starts_with(process))
        .map(|(_, s)| *s)
        .sum()
}

fn targets(results: &Results) -> String {
    let mut t = String::from("| target | measured | met |\n|---|---|---|\n");
    let rate = |index: usize| median(&results.cases[index].1).map_or(0.0, |s| s.per_second);
    let (bucket, open) = (rate(0), rate(1));
    let _ = writeln!(
        t,
        "| one worker, bucket configured: >= 2,000 deliveries/s | {bucket:.0}/s | {} |",
        yes_no(bucket >= 2000.0)
    );
    let _ = writeln!(
        t,
        "| one worker, no bucket: >= 2,500 deliveries/s | {open:.0}/s | {} |",
        yes_no(open >= 2500.0)
    );
    let commits = results
        .cases
        .iter()
        .filter_map(|(_, samples)| median(samples))
        .map(|s| s.commits_per_delivery)
        .fold(0.0, f64::max);
    let _ = writeln!(
        t,
        "| <= 1 commit per delivery, all processes (worst case) | {commits:.2} | {} |",
        yes_no(commits <= 1.0)
    );
    let rss = results
        .cases
        .iter()
        .flat_map(|(_, samples)| samples.iter())
        .map(|s| s.worker_peak_rss_mib)
        .fold(0.0, f64::max);
    let _ = writeln!(
        t,
        "| worker peak RSS <= 32 MiB (largest of all runs) | {rss:.1} MiB | {} |",
        yes_no(rss <= 32.0)
    );
    let load = median_load(&results.load).map_or(0.0, |l| l.per_second);
    let _ = writeln!(
        t,
        "| `nudgectl reminders load` >= 10,000 reminders/s | {load:.0}/s | {} |",
        yes_no(load >= 10_000.0)
    );
    match &results.large_ledger {
        Some((size, samples)) => {
            let large = median(samples).map_or(0.0, |s| s.per_second);
            let ratio = large / bucket.max(1e-9);
            let _ = writeln!(
                t,
                "| with {size} future reminders: >= 0.9 of the empty ledger's rate | {ratio:.2} ({large:.0}/s vs {bucket:.0}/s) | {} |",
                yes_no(ratio >= 0.9)
            );
        }
        None => {
            let _ = writeln!(
                t,
                "| with 1,000,000 future reminders: >= 0.9 of the empty ledger's rate | not run (`--scale`) | |"
            );
        }
    }
    t
}

fn per_case(results: &Results) -> String {
    let mut t = String::from(
        "| case | deliveries/s (median) | all runs | commits/delivery | statements/delivery \
         | CPU s per 1,000: producer | workers | janitor | stub | postgres | worker peak RSS MiB \
         | producer peak RSS MiB |\n|---|---|---|---|---|---|---|---|---|---|---|---|\n",
    );
    let mut rows: Vec<(String, &[RunSample])> = results
        .cases
        .iter()
        .map(|(name, samples)| (name.clone(), samples.as_slice()))
        .collect();
    if let Some((size, samples)) = &results.large_ledger {
        rows.push((
            format!("1 worker, bucket, {size} future reminders in the ledger"),
            samples.as_slice(),
        ));
    }
    for (name, samples) in rows {
        let Some(m) = median(samples) else { continue };
        let all: Vec<String> = samples
            .iter()
            .map(|s| format!("{:.0}", s.per_second))
            .collect();
        let statements = m
            .statements_per_delivery
            .map_or_else(|| NOT_LOADED.to_owned(), |s| format!("{s:.2}"));
        let _ = writeln!(
            t,
            "| {name} | {:.0} | {} | {:.2} | {statements} | {:.3} | {:.3} | {:.3} | {:.3} | {:.3} | {:.1} | {:.1} |",
            m.per_second,
            all.join(", "),
            m.commits_per_delivery,
            cpu(m, "producer"),
            cpu(m, "worker"),
            cpu(m, "janitor"),
            cpu(m, "provider-stub"),
            cpu(m, "postgres"),
            m.worker_peak_rss_mib,
            m.peak_rss_mib.get("producer").copied().unwrap_or(0.0),
        );
    }
    if let Some(load) = median_load(&results.load) {
        let all: Vec<String> = results
            .load
            .iter()
            .map(|l| format!("{:.0}", l.per_second))
            .collect();
        let _ = writeln!(
            t,
            "\n`nudgectl reminders load` of {} lines: {:.0} reminders/s (median; all runs: {}), {:.1} s.",
            load.lines,
            load.per_second,
            all.join(", "),
            load.seconds
        );
    }
    if let Some(w) = &results.window {
        let _ = writeln!(
            t,
            "\nOne producer window in which {} reminders fall due: {} deliveries materialised in \
             {:.1} s; producer peak RSS {:.1} MiB before, {:.1} MiB after. Another tenant whose \
             windows run every second ran {} windows meanwhile; its longest gap between two \
             windows was {:.1} s.",
            w.reminders,
            w.deliveries_created,
            w.seconds,
            w.producer_peak_rss_mib_before,
            w.producer_peak_rss_mib_after,
            w.other_windows_meanwhile,
            w.other_longest_gap_s
        );
    }
    t
}

pub fn write(results: &Results, dir: &Path) -> anyhow::Result<()> {
    let host = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|c| {
            c.lines()
                .find(|l| l.starts_with("model name"))
                .map(|l| l.split(':').nth(1).unwrap_or("").trim().to_owned())
        })
        .unwrap_or_default();
    let cores = std::thread::available_parallelism().map_or(0, |n| n.get());
    let stamp = Utc::now().format("%Y%m%dT%H%M%SZ");
    // The benchmark is built with the binaries it runs (scripts/bench-throughput.sh: release).
    let build = if cfg!(debug_assertions) {
        "debug"
    } else {
        "release"
    };
    let targets = targets(results);
    let cases = per_case(results);
    println!("{targets}\n{cases}");

    let loads: Vec<&str> = results
        .cases
        .iter()
        .flat_map(|(_, s)| s.iter().map(|r| r.load_average_before.as_str()))
        .collect();
    let scale_note = if results.large_ledger.is_some() {
        "The large ledger's future reminders (spread over the next seven days, starting ten \
         minutes ahead) and the window's reminders were written with bulk SQL \
         (`generate_series`) as the intake and producer shape them: keyed subscriber \
         references, content and a contact per subscriber (random bytes in place of \
         ciphertext, as none of them is sent), and for the large ledger `scheduled` deliveries \
         with a run intent covering them, keys checked against the domain's. Its due reminders \
         were imported like the other cases', one tenant per run in the same ledger. \
         Before its runs, one retention run counted the large ledger (deleting nothing), as \
         the hourly run of a ledger in service would have; the janitor started with each run \
         schedules its next retention run an interval after that one."
            .to_owned()
            + &results
                .large_ledger_retention_s
                .map(|s| format!(" That retention run took {s:.1} s."))
                .unwrap_or_default()
    } else {
        "Scale cases not run (`--scale`).".to_owned()
    };
    std::fs::create_dir_all(dir)?;
    std::fs::write(
        dir.join(format!("throughput-{stamp}.json")),
        serde_json::to_string_pretty(&serde_json::json!({
            "at": Utc::now(), "cpu": host, "cores": cores, "build": build, "results": results,
        }))?,
    )?;
    std::fs::write(
        dir.join("throughput-latest.md"),
        format!(
            "# Throughput benchmark\n\nRun {stamp} on {cores} cores ({host}), {build} build, \
             {n} SMS due now per run, median of {runs} run(s) per case, {secs:.0} s in all. \
             Produced by `scripts/bench-throughput.sh`; the JSON next to this file has every \
             run's figures. The machine is shared: load average before each run {loads}.\n\n\
             Rate: deliveries over the span from the first attempt's start to the last \
             attempt's finish. Commits: `pg_stat_database.xact_commit` of the run's database \
             from before any process started until all had exited (all processes, start-up \
             and idle polling included; the benchmark's own queries taken out). CPU: each \
             process over its life; postgres: the backends serving the run's database. The \
             bucket cases configure the account at 100,000/s: admission runs, never waits. \
             Producer and janitor run with their default configuration; each worker with \
             `amqp.prefetch` = {prefetch}. Delivery events: {events}. {scale_note}\n\n\
             ## Against the targets\n\n{targets}\n## Per case\n\n{cases}",
            n = results.deliveries,
            runs = results.runs,
            prefetch = results.prefetch,
            events = match results.events {
                crate::Events::On => {
                    "on (the ledger's default; the loaded reminders' `scheduled` events are \
                     numbered before the timed window, as the janitor does while they wait, \
                     so the window holds what sending writes)"
                }
                crate::Events::Off => "off in the delivery cases (`--events off`)",
            },
            secs = results.seconds,
            loads = loads.join("; "),
        ),
    )?;
    Ok(())
}
