//! The end-to-end harness: each test gets a fresh PostgreSQL database, its own RabbitMQ
//! namespace (exchanges and queues prefixed `e2e-<id>.`), its own provider stub, and starts
//! the real nudge binaries as separate processes with a generated configuration file.
//!
//! Everything a test starts is stopped when its [`TestEnv`] is dropped, even when the test
//! panics: processes are killed, the database is dropped and the namespace's queues and
//! exchanges are deleted. Binaries are taken from the cargo target directory the test runs
//! from (`scripts/test.sh` builds them first); a missing binary, or one older than a source
//! file it was built from (cargo's dep-info file beside it lists them), fails the test by name.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::print_stderr)]

use std::collections::{BTreeMap, HashMap};
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use base64::Engine;
use nudge_domain::{Channel, DeliveryState};
use nudge_ledger::{DestinationCipher, Ledger};
use serde_json::Value;

pub mod private;

pub use provider_stub::{KeysReport, Stats};

pub const ADMIN_URL: &str = "postgres://postgres@127.0.0.1:5432/postgres";

pub fn amqp_url() -> String {
    std::env::var("NUDGE_TEST_AMQP_URL")
        .unwrap_or_else(|_| "amqp://guest:guest@127.0.0.1:5672/%2f".to_owned())
}

/// The environment for a child process: this one's, less every `NUDGE_*` variable, so a
/// developer's shell (or CI's) cannot override the generated configuration.
fn clean_command(program: PathBuf) -> Command {
    let mut command = Command::new(program);
    for (name, _) in std::env::vars_os() {
        if name.to_string_lossy().starts_with("NUDGE_") {
            command.env_remove(name);
        }
    }
    command
}

/// The server's maintenance database: `DATABASE_URL`, else [`ADMIN_URL`].
pub fn admin_url() -> String {
    std::env::var("DATABASE_URL").unwrap_or_else(|_| ADMIN_URL.to_owned())
}

/// The subscriber key of every test environment: the harness's ledger handle and `nudgectl`
/// must store references under the same key.
const SUBSCRIBER_KEY: [u8; 32] = [5u8; 32];
/// [`SUBSCRIBER_KEY`], as `crypto.subscriber_key` takes it (standard base64).
const SUBSCRIBER_KEY_B64: &str = "BQUFBQUFBQUFBQUFBQUFBQUFBQUFBQUFBQUFBQUFBQU=";

/// The directory holding the workspace's binaries: next to this test executable's `deps/`.
pub fn bin_dir() -> PathBuf {
    if let Ok(dir) = std::env::var("NUDGE_BIN_DIR") {
        return PathBuf::from(dir);
    }
    // Tests run from target/<profile>/deps, the benchmark binary from target/<profile>.
    let exe = std::env::current_exe().expect("current exe");
    let dir = exe.parent().expect("executable directory");
    if dir.file_name().is_some_and(|n| n == "deps") {
        dir.parent().expect("target directory").to_path_buf()
    } else {
        dir.to_path_buf()
    }
}

/// The binary `name` from [`bin_dir`], refused when missing or older than any source file it
/// was built from: a test must run the code it is checked out with, not an earlier build.
pub fn bin(name: &str) -> PathBuf {
    let path = bin_dir().join(name);
    assert!(
        path.exists(),
        "binary {} not found: build the workspace's binaries first (scripts/test.sh does: \
         cargo build --workspace --bins)",
        path.display()
    );
    if let Some(newer) = newer_source(&path) {
        panic!(
            "binary {} is older than {}, one of its sources: rebuild the binaries first \
             (scripts/test.sh does: cargo build --workspace --bins)",
            path.display(),
            newer.display()
        );
    }
    path
}

/// A source file of `binary` modified after it was built, if any. The sources are those cargo
/// listed in the dep-info file it writes beside the binary (`<binary>.d`: every source file,
/// including the migrations a crate embeds); a missing or unreadable dep-info file counts as
/// stale, since nothing then says what the binary was built from. A listed source that no
/// longer exists counts as newer too.
pub fn newer_source(binary: &Path) -> Option<PathBuf> {
    let dep_info = binary.with_extension("d");
    let built = std::fs::metadata(binary).and_then(|m| m.modified()).ok()?;
    let Ok(text) = std::fs::read_to_string(&dep_info) else {
        return Some(dep_info);
    };
    // `target: source source ...`, with spaces inside paths escaped as `\ `.
    let Some((_, sources)) = text.lines().next().and_then(|l| l.split_once(": ")) else {
        return Some(dep_info);
    };
    let sources = sources.replace("\\ ", "\u{0}");
    sources
        .split_whitespace()
        .map(|s| PathBuf::from(s.replace('\u{0}', " ")))
        .find(|source| {
            std::fs::metadata(source)
                .and_then(|m| m.modified())
                .map_or(true, |modified| modified > built)
        })
}

/// A child process that is killed when dropped.
#[derive(Debug)]
pub struct Proc {
    pub name: String,
    child: Option<Child>,
    pub log: PathBuf,
    /// The binary and configuration file it was started with, to start it again; None for
    /// the stub.
    started_as: Option<(String, PathBuf)>,
}

impl Proc {
    pub fn pid(&self) -> u32 {
        self.child.as_ref().map_or(0, Child::id)
    }

    /// SIGKILL: no chance to clean up, like a crashed container.
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// SIGTERM, then waits (bounded) for the exit; returns the exit code.
    pub fn terminate(&mut self, within: Duration) -> Option<i32> {
        let mut child = self.child.take()?;
        // The workspace forbids unsafe code, so signal through kill(1) rather than libc.
        let _ = Command::new("kill")
            .args(["-TERM", &child.id().to_string()])
            .status();
        let deadline = Instant::now() + within;
        loop {
            if let Ok(Some(status)) = child.try_wait() {
                return status.code();
            }
            if Instant::now() >= deadline {
                let _ = child.kill();
                let _ = child.wait();
                return None;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    pub fn is_running(&mut self) -> bool {
        self.child
            .as_mut()
            .is_some_and(|c| matches!(c.try_wait(), Ok(None)))
    }

    pub fn log_tail(&self, lines: usize) -> String {
        let text = std::fs::read_to_string(&self.log).unwrap_or_default();
        let all: Vec<&str> = text.lines().collect();
        all[all.len().saturating_sub(lines)..].join("\n")
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        self.kill();
    }
}

/// Where a test's PostgreSQL and RabbitMQ are: the shared ones ([`Services::shared`]) or a
/// test's own ([`private`]).
#[derive(Debug, Clone)]
pub struct Services {
    /// The maintenance database, where the test's own database is created and dropped.
    pub admin_url: String,
    pub amqp_url: String,
}

impl Services {
    /// The machine's services: `DATABASE_URL` (else [`ADMIN_URL`]) and `NUDGE_TEST_AMQP_URL`.
    pub fn shared() -> Self {
        Self {
            admin_url: admin_url(),
            amqp_url: amqp_url(),
        }
    }
}

/// One test's world.
pub struct TestEnv {
    pub id: String,
    pub dir: PathBuf,
    pub db_name: String,
    /// The test database, as the harness reaches it.
    pub db_url: String,
    pub services: Services,
    /// The test database as the processes reach it (through a proxy, say); `db_url` by default.
    pub process_db_url: String,
    /// The broker addresses the processes are given (`amqp.urls`); the services' by default.
    pub process_amqp_urls: Vec<String>,
    pub namespace: String,
    pub ledger: Ledger,
    pub cipher: DestinationCipher,
    key_b64: String,
    pub stub_url: String,
    stub: Option<Proc>,
    procs: Vec<Proc>,
    pub http: reqwest::Client,
    /// When set, every process started afterwards serves `/metrics`, `/healthz` and `/readyz`
    /// on a free loopback port ([`TestEnv::admin_url`]).
    pub admin_listeners: bool,
    admin_ports: HashMap<String, u16>,
    /// When set, every process started afterwards exports its spans there
    /// (`telemetry.otlp_endpoint`).
    pub otlp_endpoint: Option<String>,
    /// Set by default: each binary connects as its own database role (`nudge_worker`,
    /// `nudge_producer`, `nudge_intake`, `nudge_janitor`; docs/database-roles.md), as a
    /// deployment runs it. Cleared, every process connects as the harness does (the owner).
    pub binary_roles: bool,
    /// When set, every process started afterwards runs with this `TZ` (a host zone of its
    /// own: nothing nudge computes may depend on it).
    pub host_zone: Option<String>,
}

impl std::fmt::Debug for TestEnv {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TestEnv")
            .field("id", &self.id)
            .finish_non_exhaustive()
    }
}

/// Where and what one reminder sends ([`TestEnv::reminder_to`]).
#[derive(Debug, Clone, Copy)]
pub struct Addressed<'a> {
    pub channel: Channel,
    pub destination: &'a str,
    pub content: &'a Value,
}

/// Extra configuration for a worker process: provider accounts and policy overrides.
#[derive(Debug, Clone)]
pub struct WorkerOptions {
    /// (account, honours_idempotency, default_for_channel)
    pub accounts: Vec<(String, bool, bool)>,
    pub lease_seconds: u64,
    pub prefetch: u16,
    pub retry_base_ms: u64,
    pub retry_max_ms: u64,
    pub max_attempts: u32,
    pub provider_timeout_ms: u64,
    /// Starting rate and burst of every account's bucket; None: not limited.
    pub rate: Option<(f64, u32)>,
    pub max_wait_ms: u64,
    pub closed_recheck_ms: u64,
    /// The longest one provider answer may pause a bucket (`admission.max_pause_s`).
    pub max_pause_s: u64,
    /// How long a delivery routed to an account no live worker has waits before its next
    /// look (`worker.account_recheck_ms`).
    pub account_recheck_ms: u64,
    /// Where the worker serves `GET /metrics`, if anywhere.
    pub metrics_port: Option<u16>,
    /// The provider kind of every account (`generic` when None) and the TOML body of the
    /// kind's own table (`[providers.<kind>]`), added to each account.
    pub kind: Option<(String, String)>,
}

impl WorkerOptions {
    pub fn for_channel(channel: Channel) -> Self {
        Self {
            accounts: vec![(format!("{channel}-main"), true, true)],
            lease_seconds: 5,
            prefetch: 32,
            retry_base_ms: 200,
            retry_max_ms: 1_000,
            max_attempts: 8,
            provider_timeout_ms: 5_000,
            rate: None,
            max_wait_ms: 1_500,
            closed_recheck_ms: 1_000,
            max_pause_s: 60,
            account_recheck_ms: 1_000,
            metrics_port: None,
            kind: None,
        }
    }
}

impl TestEnv {
    /// A fresh database (migrated), namespace and provider stub (the generic shape) on the
    /// shared services.
    pub async fn start(test: &str) -> anyhow::Result<Self> {
        Self::boot(test, Services::shared(), &[]).await
    }

    /// [`TestEnv::start`] on the given services.
    pub async fn start_on(test: &str, services: Services) -> anyhow::Result<Self> {
        Self::boot(test, services, &[]).await
    }

    /// [`TestEnv::start`] with extra arguments for the provider stub (`--shape twilio`, ...).
    pub async fn start_with_stub(test: &str, stub_args: &[String]) -> anyhow::Result<Self> {
        Self::boot(test, Services::shared(), stub_args).await
    }

    /// The one way a test environment starts: on `services`, the stub given `stub_args`.
    async fn boot(test: &str, services: Services, stub_args: &[String]) -> anyhow::Result<Self> {
        let id = uuid::Uuid::new_v4().simple().to_string()[..10].to_owned();
        let dir = std::env::temp_dir().join(format!("nudge-e2e-{test}-{id}"));
        std::fs::create_dir_all(&dir)?;
        let db_name = format!("nudge_e2e_{id}");
        let admin = sqlx::PgPool::connect(&services.admin_url)
            .await
            .context("PostgreSQL must answer for the end-to-end tests (DATABASE_URL)")?;
        sqlx::query(sqlx::AssertSqlSafe(format!("CREATE DATABASE {db_name}")))
            .execute(&admin)
            .await?;
        admin.close().await;
        let base = services.admin_url.clone();
        let db_url = match base.rfind('/') {
            Some(i) => format!("{}/{db_name}", &base[..i]),
            None => bail!("DATABASE_URL has no database path"),
        };
        let ledger = Ledger::connect(&nudge_config::DatabaseConfig {
            url: nudge_config::Secret::new(db_url.clone()),
            max_connections: 8,
            acquire_timeout_ms: 10_000,
            ..nudge_config::DatabaseConfig::default()
        })
        .await?;
        ledger.migrate().await?;
        let key: [u8; 32] = rand_key();
        let key_b64 = base64::engine::general_purpose::STANDARD.encode(key);

        let mut env = Self {
            namespace: format!("e2e-{id}."),
            id,
            dir,
            db_name,
            process_db_url: db_url.clone(),
            process_amqp_urls: vec![services.amqp_url.clone()],
            db_url,
            services,
            ledger,
            cipher: DestinationCipher::new(&key)
                .with_subscriber_key(nudge_ledger::SubscriberKey::new(&SUBSCRIBER_KEY)),
            key_b64,
            stub_url: String::new(),
            stub: None,
            procs: Vec::new(),
            http: reqwest::Client::new(),
            admin_listeners: false,
            admin_ports: HashMap::new(),
            otlp_endpoint: None,
            binary_roles: true,
            host_zone: None,
        };
        env.start_stub(stub_args)?;
        Ok(env)
    }

    /// Stops the stub and starts another with `args` (a `--shape` and its options) instead, for
    /// shapes whose options are files made in the test's directory. `trust`, when set, is a PEM
    /// authority the new stub wrote at start-up (the APNs shape's TLS): this test's HTTP client
    /// then trusts only it, for `https://` URLs.
    pub fn replace_stub(&mut self, args: &[String], trust: Option<&Path>) -> anyhow::Result<()> {
        if let Some(mut stub) = self.stub.take() {
            stub.kill();
        }
        self.start_stub(args)?;
        if let Some(pem) = trust {
            let roots = reqwest::Certificate::from_pem_bundle(&std::fs::read(pem)?)?;
            self.http = reqwest::Client::builder()
                .tls_certs_only(roots)
                .no_proxy()
                .build()?;
        }
        Ok(())
    }

    fn start_stub(&mut self, args: &[String]) -> anyhow::Result<()> {
        let log = self.dir.join("provider-stub.log");
        let mut child = clean_command(bin("provider-stub"))
            .args(["--listen", "127.0.0.1:0"])
            .args(args)
            .env("RUST_LOG", "warn")
            .stdout(Stdio::piped())
            .stderr(std::fs::File::create(&log)?)
            .spawn()
            .context("failed to start provider-stub")?;
        let stdout = child.stdout.take().context("stub stdout")?;
        let mut line = String::new();
        BufReader::new(stdout).read_line(&mut line)?;
        let url = line
            .trim()
            .strip_prefix("listening on ")
            .with_context(|| format!("unexpected first line from provider-stub: {line:?}"))?
            .to_owned();
        self.stub_url = url;
        self.stub = Some(Proc {
            name: "provider-stub".into(),
            child: Some(child),
            log,
            started_as: None,
        });
        Ok(())
    }

    /// The base URL of a provider account on the stub.
    pub fn account_url(&self, account: &str) -> String {
        format!("{}/accounts/{account}", self.stub_url)
    }

    /// Scripts one account on the stub.
    pub async fn script(&self, account: &str, script: Value) -> anyhow::Result<()> {
        let resp = self
            .http
            .put(format!("{}/admin/accounts/{account}", self.stub_url))
            .json(&script)
            .send()
            .await?;
        if !resp.status().is_success() {
            bail!("scripting {account} failed: {}", resp.text().await?);
        }
        Ok(())
    }

    pub async fn stub_stats(&self) -> anyhow::Result<Value> {
        Ok(self
            .http
            .get(format!("{}/stats", self.stub_url))
            .send()
            .await?
            .json()
            .await?)
    }

    pub async fn stub_keys(&self) -> anyhow::Result<Value> {
        Ok(self
            .http
            .get(format!("{}/stats/keys", self.stub_url))
            .send()
            .await?
            .json()
            .await?)
    }

    /// The database, broker and telemetry sections of the process `name`: with a metrics
    /// address when [`TestEnv::admin_listeners`] is set.
    fn common_config(&mut self, name: &str) -> String {
        let admin = self
            .admin_port(name)
            .map(|port| format!("metrics_addr = \"127.0.0.1:{port}\"\n"))
            .unwrap_or_default()
            + &self
                .otlp_endpoint
                .as_ref()
                .map(|url| format!("otlp_endpoint = \"{url}\"\n"))
                .unwrap_or_default();
        format!(
            r#"[database]
url = "{db}"
max_connections = 8

[amqp]
urls = {amqp}
namespace = "{ns}"
delivery_limit = 3

[telemetry]
log_format = "json"
log_filter = "info"
{admin}"#,
            db = self.process_db_url,
            amqp = toml_strings(&self.process_amqp_urls),
            ns = self.namespace,
        )
    }

    /// A free port for the admin listener of `name`, when admin listeners are on.
    fn admin_port(&mut self, name: &str) -> Option<u16> {
        if !self.admin_listeners {
            return None;
        }
        let port = free_port();
        self.admin_ports.insert(name.to_owned(), port);
        Some(port)
    }

    /// `http://127.0.0.1:<port>` of the admin listener of the process started as `name`.
    pub fn admin_url(&self, name: &str) -> Option<String> {
        self.admin_ports
            .get(name)
            .map(|port| format!("http://127.0.0.1:{port}"))
    }

    /// The `/metrics` page of the process started as `name`.
    pub async fn scrape(&self, name: &str) -> anyhow::Result<String> {
        let url = self
            .admin_url(name)
            .with_context(|| format!("{name} has no admin listener"))?;
        let response = self.http.get(format!("{url}/metrics")).send().await?;
        anyhow::ensure!(
            response.status().is_success(),
            "{name}/metrics answered {}",
            response.status()
        );
        Ok(response.text().await?)
    }

    fn write_config(&self, name: &str, body: &str) -> anyhow::Result<PathBuf> {
        let path = self.dir.join(format!("{name}.toml"));
        std::fs::write(&path, body)?;
        Ok(path)
    }

    fn spawn(&mut self, binary: &str, name: &str, config: &Path) -> anyhow::Result<usize> {
        let log = self.dir.join(format!("{name}.log"));
        let child = self.launch(binary, name, config)?;
        self.procs.push(Proc {
            name: name.to_owned(),
            child: Some(child),
            log,
            started_as: Some((binary.to_owned(), config.to_owned())),
        });
        Ok(self.procs.len() - 1)
    }

    /// Starts `binary` with `config`, appending to `name`'s output and log files.
    fn launch(&self, binary: &str, name: &str, config: &Path) -> anyhow::Result<Child> {
        let append = |file: String| {
            std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(self.dir.join(file))
        };
        let mut command = clean_command(bin(binary));
        if let Some(role) = self.binary_roles.then(|| binary_role(binary)).flatten() {
            command.env("NUDGE_DATABASE__URL", with_user(&self.process_db_url, role));
        }
        if let Some(zone) = &self.host_zone {
            command.env("TZ", zone);
        }
        command
            .arg("--config")
            .arg(config)
            .env_remove("RUST_LOG")
            .stdout(append(format!("{name}.out"))?)
            .stderr(append(format!("{name}.log"))?)
            .spawn()
            .with_context(|| format!("failed to start {binary}"))
    }

    /// Starts process `index` again with its binary and configuration, as a supervisor
    /// (systemd, Kubernetes) does after a crash; kills it first if it still runs.
    pub fn restart(&mut self, index: usize) -> anyhow::Result<()> {
        self.procs[index].kill();
        let (binary, config) = self.procs[index]
            .started_as
            .clone()
            .context("this process cannot be started again")?;
        let name = self.procs[index].name.clone();
        let child = self.launch(&binary, &name, &config)?;
        self.procs[index].child = Some(child);
        Ok(())
    }

    /// The names of the processes this test started, by index.
    pub fn proc_names(&self) -> Vec<String> {
        self.procs.iter().map(|p| p.name.clone()).collect()
    }

    pub fn proc(&mut self, index: usize) -> &mut Proc {
        &mut self.procs[index]
    }

    /// The provider stub's process id.
    pub fn stub_pid(&self) -> u32 {
        self.stub.as_ref().map_or(0, Proc::pid)
    }

    /// Starts `binary` (`nudge-producer`, `nudge-janitor`) with only this environment's
    /// database, broker and telemetry settings: every other key at its default, as a
    /// deployment without tuning runs it. Returns its index.
    pub fn start_with_defaults(&mut self, binary: &str, name: &str) -> anyhow::Result<usize> {
        let body = self.common_config(name);
        let config = self.write_config(name, &body)?;
        self.spawn(binary, name, &config)
    }

    /// How many consumers `work.<channel>` has: a worker that consumes is ready.
    pub async fn consumers(&self, channel: Channel) -> anyhow::Result<u32> {
        use nudge_broker::lapin::options::QueueDeclareOptions;
        use nudge_broker::lapin::types::FieldTable;
        let conn = nudge_broker::lapin::Connection::connect(
            &self.services.amqp_url,
            nudge_broker::lapin::ConnectionProperties::default(),
        )
        .await?;
        let declared = match conn.create_channel().await {
            Ok(amqp) => amqp
                .queue_declare(
                    format!("{}work.{channel}", self.namespace).into(),
                    QueueDeclareOptions {
                        passive: true,
                        ..QueueDeclareOptions::default()
                    },
                    FieldTable::default(),
                )
                .await
                .map_err(anyhow::Error::from),
            Err(e) => Err(e.into()),
        };
        let _ = conn.close(0, "e2e probe".into()).await;
        Ok(declared?.consumer_count())
    }

    /// Starts `nudge-producer`; returns its index.
    pub fn start_producer(&mut self, name: &str) -> anyhow::Result<usize> {
        let body = format!(
            "{}\n[producer]\nrelay_interval_ms = 50\nbatch_size = 200\nrepublish_after_s = 5\nschedule_interval_ms = 200\n",
            self.common_config(name)
        );
        let config = self.write_config(name, &body)?;
        self.spawn("nudge-producer", name, &config)
    }

    /// Starts `nudge-janitor`; returns its index.
    pub fn start_janitor(
        &mut self,
        retry_base_ms: u64,
        retry_max_ms: u64,
    ) -> anyhow::Result<usize> {
        self.start_janitor_with(retry_base_ms, retry_max_ms, 600)
    }

    /// Starts `nudge-janitor` whose redrives pause while new work waits longer than
    /// `max_new_work_age_s`; returns its index.
    pub fn start_janitor_with(
        &mut self,
        retry_base_ms: u64,
        retry_max_ms: u64,
        max_new_work_age_s: u64,
    ) -> anyhow::Result<usize> {
        let body = format!(
            "{}\n[janitor]\ninterval_ms = 200\nmetrics_interval_ms = 200\n\n[redrive]\nmax_throttled_ratio = 0.2\nwindow_s = 30\nmin_attempts = 5\nmax_new_work_age_s = {max_new_work_age_s}\n\n[retry]\nbase_delay_ms = {retry_base_ms}\nmax_delay_ms = {retry_max_ms}\n",
            self.common_config("janitor")
        );
        let config = self.write_config("janitor", &body)?;
        self.spawn("nudge-janitor", "janitor", &config)
    }

    /// Starts `nudge-janitor` as `name` with this environment's database, broker and
    /// telemetry settings followed by `sections` (TOML, e.g. a `[retention]` table): every
    /// other key at its default. Returns its index.
    pub fn start_janitor_sections(&mut self, name: &str, sections: &str) -> anyhow::Result<usize> {
        let body = format!("{}\n{sections}", self.common_config(name));
        let config = self.write_config(name, &body)?;
        self.spawn("nudge-janitor", name, &config)
    }

    /// Starts the worker binary of `channel`; returns its index.
    pub fn start_worker(
        &mut self,
        channel: Channel,
        name: &str,
        options: &WorkerOptions,
    ) -> anyhow::Result<usize> {
        self.start_worker_config(channel, name, options, |_| Ok(()))
    }

    /// The worker's configuration from `options`, then whatever `extend` appends to it.
    fn start_worker_config(
        &mut self,
        channel: Channel,
        name: &str,
        options: &WorkerOptions,
        extend: impl FnOnce(&mut String) -> anyhow::Result<()>,
    ) -> anyhow::Result<usize> {
        let mut body = self.common_config(name);
        body = body.replace(
            "delivery_limit = 3",
            &format!("delivery_limit = 3\nprefetch = {}", options.prefetch),
        );
        if let Some(port) = options.metrics_port.filter(|_| !self.admin_listeners) {
            self.admin_ports.insert(name.to_owned(), port);
            body = body.replace(
                "log_filter = \"info\"",
                &format!("log_filter = \"info\"\nmetrics_addr = \"127.0.0.1:{port}\""),
            );
        }
        body.push_str(&format!(
            "\n[crypto]\ndestination_key = \"{key}\"\n\n[worker]\nlease_seconds = {lease}\nshutdown_grace_ms = 5000\naccount_recheck_ms = {account_recheck}\n\n[retry]\nbase_delay_ms = {base}\nmax_delay_ms = {max}\nmax_attempts = {attempts}\nmax_retry_after_s = 60\n\n[admission]\nmax_wait_ms = {max_wait}\nclosed_recheck_ms = {recheck}\nmax_pause_s = {max_pause}\n",
            key = self.key_b64,
            lease = options.lease_seconds,
            base = options.retry_base_ms,
            max = options.retry_max_ms,
            attempts = options.max_attempts,
            max_wait = options.max_wait_ms,
            recheck = options.closed_recheck_ms,
            max_pause = options.max_pause_s,
            account_recheck = options.account_recheck_ms,
        ));
        for (account, idem, default) in &options.accounts {
            body.push_str(&format!(
                "\n[[providers]]\naccount = \"{account}\"\nchannel = \"{channel}\"\nbase_url = \"{url}\"\ntimeout_ms = {timeout}\nconnect_timeout_ms = 1000\nhonours_idempotency = {idem}\ndefault_for_channel = {default}\n",
                url = self.account_url(account),
                timeout = options.provider_timeout_ms,
            ));
            if let Some((rate, burst)) = options.rate {
                body.push_str(&format!("rate_per_second = {rate:?}\nburst = {burst}\n"));
            }
            if let Some((kind, table)) = &options.kind {
                body.push_str(&format!("kind = \"{kind}\"\n[providers.{kind}]\n{table}\n"));
            }
        }
        extend(&mut body)?;
        let config = self.write_config(name, &body)?;
        let binary = format!("nudge-{channel}");
        self.spawn(&binary, name, &config)
    }

    /// Starts the worker binary of `channel` with `providers` as its accounts (serialised from
    /// the config struct, so every kind's own table is written as the worker reads it) and the
    /// policy of `options` (its `accounts` are not used); returns its index.
    pub fn start_worker_with_providers(
        &mut self,
        channel: Channel,
        name: &str,
        options: &WorkerOptions,
        providers: &[nudge_provider::HttpProviderConfig],
    ) -> anyhow::Result<usize> {
        #[derive(serde::Serialize)]
        struct Providers<'a> {
            providers: &'a [nudge_provider::HttpProviderConfig],
        }
        let mut without_accounts = options.clone();
        without_accounts.accounts.clear();
        let index = self.start_worker_config(channel, name, &without_accounts, |body| {
            body.push('\n');
            body.push_str(&toml::to_string(&Providers { providers })?);
            Ok(())
        })?;
        Ok(index)
    }

    /// Imports one reminder with one channel, to a given destination and with given content.
    pub async fn reminder_to(
        &self,
        tenant: nudge_domain::TenantId,
        event: &str,
        to: Addressed<'_>,
        scheduled_at: chrono::DateTime<chrono::Utc>,
        expires_at: chrono::DateTime<chrono::Utc>,
    ) -> anyhow::Result<nudge_ledger::CreatedReminder> {
        let reminder = nudge_ledger::NewReminder::new(
            tenant,
            nudge_domain::EventId::parse(event)?,
            nudge_domain::SubscriberRef::parse(&format!("sub-{event}"))?,
            &[to.channel],
            scheduled_at,
            expires_at,
        )?
        .with_content(serde_json::to_vec(to.content)?)?;
        let contacts = [(to.channel, nudge_ledger::Destination::new(to.destination))];
        Ok(self
            .ledger
            .import_reminder(&reminder, &contacts, &self.cipher, chrono::Utc::now())
            .await?)
    }

    /// Starts `nudge-intake` on a free loopback port, with its configuration serialised from
    /// `IntakeConfig`; returns its index and base URL once it says where it listens.
    pub async fn start_intake(&mut self, name: &str) -> anyhow::Result<(usize, String)> {
        self.start_intake_with(name, nudge_intake::IntakeConfig::default())
            .await
    }

    /// [`TestEnv::start_intake`] from `config` (its `[receipts]`, a fixed listen address), with
    /// the test's database, keys and telemetry filled in.
    pub async fn start_intake_with(
        &mut self,
        name: &str,
        mut config: nudge_intake::IntakeConfig,
    ) -> anyhow::Result<(usize, String)> {
        // The default address is a deployment's; a test listens where it said, else anywhere.
        let listen =
            if config.intake.listen_addr == nudge_intake::IntakeSection::default().listen_addr {
                std::net::SocketAddr::from(([127, 0, 0, 1], 0))
            } else {
                config.intake.listen_addr
            };
        config.database.url = nudge_config::Secret::new(self.process_db_url.clone());
        config.database.max_connections = 8;
        config.telemetry.log_format = nudge_config::LogFormat::Json;
        config.crypto.destination_key = Some(nudge_config::Secret::new(self.key_b64.clone()));
        config.crypto.subscriber_key =
            Some(nudge_config::Secret::new(SUBSCRIBER_KEY_B64.to_owned()));
        config.intake.listen_addr = listen;
        config.telemetry.otlp_endpoint = self.otlp_endpoint.clone();
        config.telemetry.metrics_addr = self
            .admin_port(name)
            .map(|port| std::net::SocketAddr::from(([127, 0, 0, 1], port)));
        let path = self.write_config(name, &toml::to_string(&config)?)?;
        let index = self.spawn("nudge-intake", name, &path)?;
        let out = self.dir.join(format!("{name}.out"));
        let url = self
            .wait_for("the intake to listen", Duration::from_secs(20), || {
                let out = out.clone();
                async move {
                    let text = std::fs::read_to_string(&out).unwrap_or_default();
                    Ok(text
                        .lines()
                        .find_map(|l| l.strip_prefix("listening on "))
                        .map(str::to_owned))
                }
            })
            .await;
        Ok((index, url))
    }

    /// Starts `nudge-events` as `name` with this environment's database and telemetry, the
    /// destination key, and `events` (lines of its `[events]` table); returns its index.
    pub fn start_events(&mut self, name: &str, events: &str) -> anyhow::Result<usize> {
        let body = format!(
            "{}\n[crypto]\ndestination_key = \"{}\"\n\n[events]\n{events}\n",
            self.common_config(name),
            self.key_b64
        );
        let config = self.write_config(name, &body)?;
        self.spawn("nudge-events", name, &config)
    }

    /// Starts `nudge-console` as `name` on a free loopback port, serving plain http (cookies
    /// not marked Secure), with a session key of its own and `console` (more lines of its
    /// `[console]` table); waits until it answers and returns its index and base URL.
    pub async fn start_console(
        &mut self,
        name: &str,
        console: &str,
    ) -> anyhow::Result<(usize, String)> {
        let port = free_port();
        let body = format!(
            "{}\n[console]\nlisten_addr = \"127.0.0.1:{port}\"\nsecure_cookies = false\n\
             session_key = \"{}\"\n{console}\n",
            self.common_config(name),
            base64::engine::general_purpose::STANDARD.encode([7u8; 48])
        );
        let config = self.write_config(name, &body)?;
        let index = self.spawn("nudge-console", name, &config)?;
        let base = format!("http://127.0.0.1:{port}");
        let login = format!("{base}/login");
        until("nudge-console to answer", Duration::from_secs(30), || {
            let login = login.clone();
            async move {
                reqwest::get(&login)
                    .await
                    .is_ok_and(|r| r.status().is_success())
            }
        })
        .await?;
        Ok((index, base))
    }

    /// Rotates `tenant`'s signing secret with `nudgectl` and returns the secret it printed.
    pub fn rotate_secret(&self, tenant: &str) -> anyhow::Result<String> {
        let (code, out, err) = self.nudgectl(&[
            "tenant",
            "secret",
            "rotate",
            tenant,
            "--reason",
            "e2e setup",
        ])?;
        anyhow::ensure!(code == 0, "nudgectl tenant secret rotate failed: {err}");
        Ok(out.trim().to_owned())
    }

    /// A signed request to the intake ([`intake_signature`] now, under `secret`).
    pub fn signed(
        &self,
        method: reqwest::Method,
        url: &str,
        secret: &str,
        body: Vec<u8>,
    ) -> reqwest::RequestBuilder {
        let signature = intake_signature(&method, url, secret, &body);
        self.http
            .request(method, url)
            .header("content-type", "application/json")
            .header("nudge-signature", signature)
            .body(body)
    }

    /// Runs `nudgectl` against this environment's database; returns (exit code, stdout, stderr).
    pub fn nudgectl(&self, args: &[&str]) -> anyhow::Result<(i32, String, String)> {
        let out = clean_command(bin("nudgectl"))
            .args(args)
            .env("NUDGE_DATABASE__URL", &self.db_url)
            .env("NUDGE_CRYPTO__DESTINATION_KEY", &self.key_b64)
            .env("NUDGE_CRYPTO__SUBSCRIBER_KEY", SUBSCRIBER_KEY_B64)
            .output()?;
        Ok((
            out.status.code().unwrap_or(-1),
            String::from_utf8_lossy(&out.stdout).into_owned(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        ))
    }

    /// Waits until `check` returns Some, polling; fails with `what` and the process logs.
    pub async fn wait_for<T, F, Fut>(&mut self, what: &str, within: Duration, mut check: F) -> T
    where
        F: FnMut() -> Fut,
        Fut: std::future::Future<Output = anyhow::Result<Option<T>>>,
    {
        let deadline = Instant::now() + within;
        let mut last_err = None;
        loop {
            match check().await {
                Ok(Some(value)) => return value,
                Ok(None) => {}
                Err(e) => last_err = Some(e),
            }
            if Instant::now() >= deadline {
                let dead: Vec<String> = self
                    .procs
                    .iter_mut()
                    .filter_map(|p| (!p.is_running() && p.child.is_some()).then(|| p.name.clone()))
                    .collect();
                for p in &self.procs {
                    eprintln!(
                        "---- {} ({}) ----\n{}",
                        p.name,
                        p.log.display(),
                        p.log_tail(30)
                    );
                }
                panic!(
                    "timed out after {within:?} waiting for {what}; last error: {last_err:?}; \
                     exited processes: {dead:?}"
                );
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// Delivery counts by state.
    pub async fn states(&self) -> anyhow::Result<HashMap<String, i64>> {
        states_in(&self.ledger).await
    }

    /// Number of deliveries not yet in a terminal or held state.
    pub async fn live(&self) -> anyhow::Result<i64> {
        Ok(sqlx::query_scalar(
            "SELECT count(*) FROM deliveries WHERE state IN ('scheduled','queued','sending','retry_wait')",
        )
        .fetch_one(self.ledger.pool())
        .await?)
    }

    /// A tenant whose producer windows run every second and look `window_seconds` ahead.
    pub async fn tenant(
        &self,
        name: &str,
        window_seconds: u32,
    ) -> anyhow::Result<nudge_domain::TenantId> {
        let by = nudge_ledger::Operator::new("e2e", Some("test setup"), chrono::Utc::now())?;
        let tenant = self.ledger.create_tenant(name, &by).await?;
        self.ledger
            .set_schedule(tenant.id, "* * * * * *", window_seconds, &by)
            .await?;
        Ok(tenant.id)
    }

    /// Imports one reminder for `channels` with a destination for each.
    pub async fn reminder(
        &self,
        tenant: nudge_domain::TenantId,
        event: &str,
        channels: &[Channel],
        scheduled_at: chrono::DateTime<chrono::Utc>,
        expires_at: chrono::DateTime<chrono::Utc>,
    ) -> anyhow::Result<nudge_ledger::CreatedReminder> {
        let reminder = nudge_ledger::NewReminder::new(
            tenant,
            nudge_domain::EventId::parse(event)?,
            nudge_domain::SubscriberRef::parse(&format!("sub-{event}"))?,
            channels,
            scheduled_at,
            expires_at,
        )?
        .with_content(br#"{"template":"appointment"}"#.to_vec())?;
        let contacts: Vec<(Channel, nudge_ledger::Destination)> = channels
            .iter()
            .map(|c| {
                (
                    *c,
                    nudge_ledger::Destination::new(format!("dest-{c}-{event}")),
                )
            })
            .collect();
        Ok(self
            .ledger
            .import_reminder(&reminder, &contacts, &self.cipher, chrono::Utc::now())
            .await?)
    }

    /// Stops every process this test started and has not killed (SIGTERM, then SIGKILL after
    /// `within`) and returns their exit codes by name (None: it had to be killed).
    pub fn stop_all(&mut self, within: Duration) -> Vec<(String, Option<i32>)> {
        self.procs
            .iter_mut()
            .filter(|p| p.child.is_some())
            .map(|p| (p.name.clone(), p.terminate(within)))
            .collect()
    }
}

/// `["a", "b"]`: strings as a TOML array.
fn toml_strings(items: &[String]) -> String {
    toml::Value::Array(items.iter().cloned().map(toml::Value::String).collect()).to_string()
}

fn rand_key() -> [u8; 32] {
    let a = uuid::Uuid::new_v4().into_bytes();
    let b = uuid::Uuid::new_v4().into_bytes();
    let mut key = [0u8; 32];
    key[..16].copy_from_slice(&a);
    key[16..].copy_from_slice(&b);
    key
}

impl Drop for TestEnv {
    fn drop(&mut self) {
        for p in &mut self.procs {
            p.kill();
        }
        if let Some(stub) = &mut self.stub {
            stub.kill();
        }
        let db_name = self.db_name.clone();
        let namespace = self.namespace.clone();
        let services = self.services.clone();
        let pool = self.ledger.pool().clone();
        // Async cleanup from a destructor that may run while a test panics: its own runtime,
        // on its own thread.
        let cleanup = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .expect("cleanup runtime");
            rt.block_on(async move {
                pool.close().await;
                if let Ok(admin) = sqlx::PgPool::connect(&services.admin_url).await {
                    let _ = sqlx::query(sqlx::AssertSqlSafe(format!(
                        "DROP DATABASE IF EXISTS {db_name} WITH (FORCE)"
                    )))
                    .execute(&admin)
                    .await;
                    admin.close().await;
                }
                delete_namespace(&services.amqp_url, &namespace).await;
            });
        });
        let _ = cleanup.join();
        if std::env::var_os("NUDGE_E2E_KEEP_FILES").is_some() {
            eprintln!(
                "test files kept in {} (NUDGE_E2E_KEEP_FILES)",
                self.dir.display()
            );
        } else if !std::thread::panicking() {
            let _ = std::fs::remove_dir_all(&self.dir);
        } else {
            eprintln!("test files kept in {}", self.dir.display());
        }
    }
}

async fn delete_namespace(amqp_url: &str, namespace: &str) {
    use nudge_broker::lapin::options::{ExchangeDeleteOptions, QueueDeleteOptions};
    let Ok(conn) = nudge_broker::lapin::Connection::connect(
        amqp_url,
        nudge_broker::lapin::ConnectionProperties::default(),
    )
    .await
    else {
        return;
    };
    if let Ok(channel) = conn.create_channel().await {
        for channel_name in ["push", "email", "sms"] {
            for kind in ["work", "dead"] {
                let _ = channel
                    .queue_delete(
                        format!("{namespace}{kind}.{channel_name}").into(),
                        QueueDeleteOptions::default(),
                    )
                    .await;
            }
        }
        for exchange in ["nudge.work", "nudge.dead"] {
            let _ = channel
                .exchange_delete(
                    format!("{namespace}{exchange}").into(),
                    ExchangeDeleteOptions::default(),
                )
                .await;
        }
    }
    let _ = conn.close(0, "e2e cleanup".into()).await;
}

/// Parses the stub's `GET /stats/keys` answer.
pub fn keys_report(value: Value) -> anyhow::Result<KeysReport> {
    Ok(serde_json::from_value(value)?)
}

/// Parses the stub's `GET /stats` answer.
pub fn stats(value: Value) -> anyhow::Result<Stats> {
    Ok(serde_json::from_value(value)?)
}

/// The `Nudge-Signature` a client sends for `method` on `url` with `body`, signed now under
/// `secret`: the method, the path and query as reqwest sends them, and the body.
pub fn intake_signature(method: &reqwest::Method, url: &str, secret: &str, body: &[u8]) -> String {
    let target = reqwest::Url::parse(url).map_or_else(
        |_| url.to_owned(),
        |u| match u.query() {
            Some(query) => format!("{}?{query}", u.path()),
            None => u.path().to_owned(),
        },
    );
    nudge_intake::signature::header_value(
        &[secret.as_bytes()],
        chrono::Utc::now().timestamp(),
        &nudge_intake::signature::Signed {
            method: method.as_str(),
            target: &target,
            body,
        },
    )
}

/// The `p`-th percentile (nearest rank) of `sorted`, ascending; NaN when it is empty.
pub fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let rank = ((p / 100.0) * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}

/// A loopback port that was free a moment ago, for a process that binds it itself.
///
/// Asking the kernel for port 0 and releasing it races: the kernel hands the same port to the
/// next `bind(0)` or to an outgoing connection's local end, and two processes of one test once
/// got the same admin port that way. So the ports come from below the kernel's ephemeral range
/// (Linux's default is 32768-60999), walked from an offset of this process's id, and no port is
/// handed out twice by one test process.
pub fn free_port() -> u16 {
    use std::sync::atomic::{AtomicU32, Ordering};
    const FIRST: u32 = 20_000;
    const SPAN: u32 = 12_000;
    static NEXT: AtomicU32 = AtomicU32::new(u32::MAX);
    let _ = NEXT.compare_exchange(
        u32::MAX,
        (std::process::id().wrapping_mul(2_654_435_761)) % SPAN,
        Ordering::SeqCst,
        Ordering::SeqCst,
    );
    for _ in 0..SPAN {
        let port = (FIRST + NEXT.fetch_add(1, Ordering::SeqCst) % SPAN) as u16;
        if std::net::TcpListener::bind(("127.0.0.1", port)).is_ok() {
            return port;
        }
    }
    panic!("no free loopback port between {FIRST} and {}", FIRST + SPAN)
}

/// The database role `binary` connects as in a deployment (docs/database-roles.md); `None`
/// for `nudgectl` and the stub.
fn binary_role(binary: &str) -> Option<&'static str> {
    match binary {
        "nudge-push" | "nudge-email" | "nudge-sms" => Some("nudge_worker"),
        "nudge-producer" => Some("nudge_producer"),
        "nudge-intake" => Some("nudge_intake"),
        "nudge-janitor" => Some("nudge_janitor"),
        "nudge-events" => Some("nudge_events"),
        "nudge-console" => Some("nudge_console"),
        _ => None,
    }
}

/// `url` with `user` as its user name and no password (the test server trusts loopback).
fn with_user(url: &str, user: &str) -> String {
    let Some((scheme, rest)) = url.split_once("://") else {
        return url.to_owned();
    };
    let authority_end = rest.find('/').unwrap_or(rest.len());
    let host = match rest[..authority_end].rfind('@') {
        Some(at) => &rest[at + 1..],
        None => rest,
    };
    format!("{scheme}://{user}@{host}")
}

/// Polls `check` every 100 ms until it holds: how long that took, or `None` after `within`.
/// The drills' one wait for an effect.
pub async fn poll_within<F, Fut>(within: Duration, mut check: F) -> Option<Duration>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let started = Instant::now();
    while !check().await {
        if started.elapsed() >= within {
            return None;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    Some(started.elapsed())
}

/// [`poll_within`], failing with `what` after `within`.
pub async fn until<F, Fut>(what: &str, within: Duration, check: F) -> anyhow::Result<Duration>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    poll_within(within, check)
        .await
        .ok_or_else(|| anyhow::anyhow!("{what}: not within {within:?}"))
}

/// Which binaries a drill or benchmark ran: the profile directory ([`bin_dir`]) and its path.
pub fn build_profile() -> String {
    let dir = bin_dir();
    format!(
        "{} binaries ({})",
        dir.file_name()
            .map_or_else(|| "?".into(), |n| n.to_string_lossy().into_owned()),
        dir.display()
    )
}

/// Each process's log size now (`<dir>/<name>.log`), so what it logs from here on can be read
/// alone ([`logged_since`]).
pub fn log_sizes(dir: &Path, names: &[String]) -> HashMap<String, u64> {
    names
        .iter()
        .map(|name| {
            let size = std::fs::metadata(dir.join(format!("{name}.log"))).map_or(0, |m| m.len());
            (name.clone(), size)
        })
        .collect()
}

/// The warnings and errors each process logged after `offsets` (JSON lines), counted by
/// level and message.
pub fn logged_since(
    dir: &Path,
    names: &[String],
    offsets: &HashMap<String, u64>,
) -> BTreeMap<String, BTreeMap<String, usize>> {
    let mut found = BTreeMap::new();
    for name in names {
        let text = std::fs::read(dir.join(format!("{name}.log"))).unwrap_or_default();
        let from = offsets
            .get(name)
            .and_then(|o| usize::try_from(*o).ok())
            .unwrap_or(0)
            .min(text.len());
        let mut counts: BTreeMap<String, usize> = BTreeMap::new();
        for line in String::from_utf8_lossy(&text[from..]).lines() {
            let Ok(entry) = serde_json::from_str::<serde_json::Value>(line) else {
                continue;
            };
            let level = entry["level"].as_str().unwrap_or_default();
            if level != "WARN" && level != "ERROR" {
                continue;
            }
            let message = entry["fields"]["message"].as_str().unwrap_or_default();
            *counts.entry(format!("{level} {message}")).or_default() += 1;
        }
        found.insert(name.clone(), counts);
    }
    found
}

/// Delivery counts by state in `ledger`: [`TestEnv::states`] for the checks of
/// [`TestEnv::wait_for`], which hold a clone of the ledger, not the environment.
pub async fn states_in(ledger: &Ledger) -> anyhow::Result<HashMap<String, i64>> {
    let rows: Vec<(String, i64)> =
        sqlx::query_as("SELECT state, count(*) FROM deliveries GROUP BY state")
            .fetch_all(ledger.pool())
            .await?;
    Ok(rows.into_iter().collect())
}

/// The number of deliveries in `state` (`"delivered"`, `"sending"`, ...) in `ledger`.
pub async fn count_in(ledger: &Ledger, state: &str) -> anyhow::Result<i64> {
    Ok(states_in(ledger).await?.get(state).copied().unwrap_or(0))
}

/// Of counts by state ([`states_in`]), the deliveries that are settled: terminal, or held for
/// review (not [`DeliveryState::is_live`]).
pub fn settled(states: &HashMap<String, i64>) -> i64 {
    DeliveryState::ALL
        .iter()
        .filter(|state| !state.is_live())
        .filter_map(|state| states.get(state.as_str()))
        .sum()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::SystemTime;

    fn touch(path: &Path, at: SystemTime) {
        std::fs::File::options()
            .write(true)
            .open(path)
            .unwrap()
            .set_modified(at)
            .unwrap();
    }

    fn scratch() -> PathBuf {
        let dir =
            std::env::temp_dir().join(format!("nudge-e2e-stale-{}", uuid::Uuid::new_v4().simple()));
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }

    #[test]
    fn a_binary_older_than_one_of_its_sources_is_refused_and_a_fresh_one_is_not() {
        let dir = scratch();
        let binary = dir.join("nudge-sms");
        let source = dir.join("my source.rs");
        let other = dir.join("lib.rs");
        for file in [&binary, &source, &other] {
            std::fs::write(file, b"x").unwrap();
        }
        std::fs::write(
            binary.with_extension("d"),
            format!(
                "{}: {} {}\n\n{}:\n",
                binary.display(),
                source.display().to_string().replace(' ', "\\ "),
                other.display(),
                source.display()
            ),
        )
        .unwrap();
        let t = SystemTime::now() - Duration::from_secs(60);
        touch(&source, t);
        touch(&other, t);
        touch(&binary, t + Duration::from_secs(10));
        assert_eq!(newer_source(&binary), None);

        touch(&source, t + Duration::from_secs(20));
        assert_eq!(newer_source(&binary), Some(source.clone()));

        std::fs::remove_file(&source).unwrap();
        assert_eq!(newer_source(&binary), Some(source));
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_binary_without_its_dep_info_file_is_refused() {
        let dir = scratch();
        let binary = dir.join("nudge-sms");
        std::fs::write(&binary, b"x").unwrap();
        assert_eq!(newer_source(&binary), Some(binary.with_extension("d")));
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_binarys_database_url_names_its_role_and_keeps_the_rest() {
        assert_eq!(
            super::with_user(
                "postgres://postgres:pw@127.0.0.1:5432/e2e_x",
                "nudge_worker"
            ),
            "postgres://nudge_worker@127.0.0.1:5432/e2e_x"
        );
        assert_eq!(
            super::with_user("postgres://127.0.0.1:5432/e2e_x", "nudge_intake"),
            "postgres://nudge_intake@127.0.0.1:5432/e2e_x"
        );
        assert_eq!(super::binary_role("nudgectl"), None);
        assert_eq!(super::binary_role("nudge-sms"), Some("nudge_worker"));
    }
}
