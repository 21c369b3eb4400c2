//! A test's own PostgreSQL and RabbitMQ servers, for faults that stop or restart a service:
//! the machine's shared services stay up for every other test.
//!
//! Each server runs from Debian's packages in a temporary directory on free loopback ports and
//! is stopped (and its directory removed) when its handle is dropped, a failed test included.
//! A [`RabbitNode`] can join another into a cluster ([`rabbit_cluster`]). Both are started and
//! stopped with the packages' own tools, so what a test does is what an operator would do.
//! A [`PrivatePostgres`] can be given a streaming standby ([`PrivatePostgres::standby_of`]),
//! killed like a lost machine and its standby promoted: the failover drill's pair.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};

use crate::{Services, free_port};

/// Where Debian puts PostgreSQL's server programs (`initdb`, `pg_ctl`): the newest version.
fn postgres_bin() -> anyhow::Result<PathBuf> {
    let mut versions: Vec<PathBuf> = std::fs::read_dir("/usr/lib/postgresql")
        .context("PostgreSQL's server programs are not installed (/usr/lib/postgresql)")?
        .filter_map(|e| e.ok().map(|e| e.path().join("bin")))
        .filter(|bin| bin.join("pg_ctl").exists())
        .collect();
    versions.sort();
    versions
        .pop()
        .context("no PostgreSQL version with pg_ctl under /usr/lib/postgresql")
}

fn is_root() -> bool {
    // `id -u` rather than libc: this crate forbids unsafe code.
    Command::new("id")
        .arg("-u")
        .output()
        .is_ok_and(|out| out.stdout.trim_ascii() == b"0")
}

/// Runs `program args` (as the `postgres` user when this is root: PostgreSQL refuses to run as
/// root) and fails with its output when it fails.
fn run_as_postgres(program: &Path, args: &[&str]) -> anyhow::Result<()> {
    let mut command = if is_root() {
        let mut c = Command::new("runuser");
        c.args(["-u", "postgres", "--"]).arg(program);
        c
    } else {
        Command::new(program)
    };
    let out = command
        .args(args)
        .stdin(Stdio::null())
        .output()
        .with_context(|| format!("failed to run {}", program.display()))?;
    if !out.status.success() {
        bail!(
            "{} {} failed: {}{}",
            program.display(),
            args.join(" "),
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    Ok(())
}

fn temp_dir(kind: &str) -> anyhow::Result<PathBuf> {
    let id = uuid::Uuid::new_v4().simple().to_string();
    let dir = std::env::temp_dir().join(format!("nudge-{kind}-{}", &id[..10]));
    std::fs::create_dir_all(&dir)?;
    Ok(dir)
}

/// A PostgreSQL server of the test's own, trusting loopback connections as `postgres`.
#[derive(Debug)]
pub struct PrivatePostgres {
    dir: PathBuf,
    bin: PathBuf,
    pub port: u16,
}

impl PrivatePostgres {
    /// Creates a cluster in a temporary directory and starts it on a free port.
    pub fn start() -> anyhow::Result<Self> {
        let bin = postgres_bin()?;
        let dir = temp_dir("postgres")?;
        if is_root() {
            let status = Command::new("chown")
                .args(["postgres:postgres"])
                .arg(&dir)
                .status()?;
            if !status.success() {
                bail!("could not give {} to the postgres user", dir.display());
            }
        }
        let server = Self {
            dir,
            bin,
            port: free_port(),
        };
        // From here on a failure drops `server`, which removes the directory.
        let data_arg = server.data_arg();
        run_as_postgres(
            &server.bin.join("initdb"),
            &[
                "-D",
                &data_arg,
                "-A",
                "trust",
                "-U",
                "postgres",
                "--no-sync",
            ],
        )?;
        server.start_server()?;
        Ok(server)
    }

    /// The maintenance database's URL.
    pub fn admin_url(&self) -> String {
        format!("postgres://postgres@127.0.0.1:{}/postgres", self.port)
    }

    /// `127.0.0.1:<port>`.
    pub fn addr(&self) -> String {
        format!("127.0.0.1:{}", self.port)
    }

    fn data_arg(&self) -> String {
        self.dir.join("data").to_string_lossy().into_owned()
    }

    fn start_server(&self) -> anyhow::Result<()> {
        let options = format!(
            "-p {} -c listen_addresses=127.0.0.1 -k {} -c fsync=off -c max_connections=200",
            self.port,
            self.dir.display()
        );
        let log = self.dir.join("server.log").to_string_lossy().into_owned();
        run_as_postgres(
            &self.bin.join("pg_ctl"),
            &[
                "-D",
                &self.data_arg(),
                "-o",
                &options,
                "-l",
                &log,
                "-w",
                "-t",
                "60",
                "start",
            ],
        )
    }

    /// Stops the server the way an operator's restart does (`pg_ctl stop -m fast`: open
    /// sessions are ended, in-flight transactions rolled back).
    pub fn stop(&self) -> anyhow::Result<()> {
        run_as_postgres(
            &self.bin.join("pg_ctl"),
            &[
                "-D",
                &self.data_arg(),
                "-m",
                "fast",
                "-w",
                "-t",
                "60",
                "stop",
            ],
        )
    }

    /// Starts the stopped server again on the same port.
    pub fn restart(&self) -> anyhow::Result<()> {
        self.start_server()
    }
}

/// A standby's and a primary's part in a failover drill: streaming replication from a
/// [`PrivatePostgres`] to another, the primary killed as in a lost machine, the standby promoted.
impl PrivatePostgres {
    /// A hot standby of `primary` in a temporary directory of its own, on a free port:
    /// `pg_basebackup -R` (the standby's `primary_conninfo` names it `application_name`, the name
    /// the primary's `synchronous_standby_names` lists), started and streaming.
    pub fn standby_of(primary: &PrivatePostgres, application_name: &str) -> anyhow::Result<Self> {
        Self::standby_streaming_from(primary, application_name, primary.port)
    }

    /// As [`standby_of`](Self::standby_of), but the standby streams from `127.0.0.1:<port>`
    /// (a proxy in front of `primary`, so a drill can slow or stall the replication link); the
    /// base backup is still taken from `primary` itself.
    pub fn standby_streaming_from(
        primary: &PrivatePostgres,
        application_name: &str,
        port: u16,
    ) -> anyhow::Result<Self> {
        let dir = temp_dir("postgres-standby")?;
        if is_root() {
            let status = Command::new("chown")
                .args(["postgres:postgres"])
                .arg(&dir)
                .status()?;
            if !status.success() {
                bail!("could not give {} to the postgres user", dir.display());
            }
        }
        let standby = Self {
            dir,
            bin: primary.bin.clone(),
            port: free_port(),
        };
        let data_arg = standby.data_arg();
        let primary_port = primary.port.to_string();
        run_as_postgres(
            &standby.bin.join("pg_basebackup"),
            &[
                "-D",
                &data_arg,
                "-h",
                "127.0.0.1",
                "-p",
                &primary_port,
                "-U",
                "postgres",
                "-X",
                "stream",
                "-R",
                "--no-sync",
            ],
        )?;
        // `-R` wrote a `primary_conninfo` without a name; the last setting in the file wins.
        let conninfo = format!(
            "\nprimary_conninfo = 'host=127.0.0.1 port={port} user=postgres \
             application_name={application_name}'\n"
        );
        let auto_conf = standby.dir.join("data").join("postgresql.auto.conf");
        let mut file = std::fs::OpenOptions::new()
            .append(true)
            .open(&auto_conf)
            .with_context(|| format!("failed to open {}", auto_conf.display()))?;
        std::io::Write::write_all(&mut file, conninfo.as_bytes())?;
        standby.start_server()?;
        Ok(standby)
    }

    /// `postgres://postgres@127.0.0.1:<port>/<database>`.
    pub fn url(&self, database: &str) -> String {
        format!("postgres://postgres@127.0.0.1:{}/{database}", self.port)
    }

    /// SIGKILL to the postmaster and every process it started, at once, as when the machine
    /// is lost: no shutdown checkpoint, no goodbye to the clients or the standby. The postmaster
    /// is stopped (SIGSTOP) first, so it forks nothing between the listing and the kill.
    pub fn kill(&self) -> anyhow::Result<()> {
        let pid_file = self.dir.join("data").join("postmaster.pid");
        let text = std::fs::read_to_string(&pid_file)
            .with_context(|| format!("failed to read {}", pid_file.display()))?;
        let postmaster = text
            .lines()
            .next()
            .map(str::trim)
            .filter(|pid| !pid.is_empty() && pid.bytes().all(|b| b.is_ascii_digit()))
            .with_context(|| format!("{} names no process", pid_file.display()))?
            .to_owned();
        let stop = Command::new("kill").args(["-STOP", &postmaster]).status()?;
        if !stop.success() {
            bail!("could not stop the postmaster {postmaster}");
        }
        let children = Command::new("ps")
            .args(["-o", "pid=", "--ppid", &postmaster])
            .output()
            .context("failed to list the postmaster's processes")?;
        let mut pids = vec![postmaster.clone()];
        pids.extend(
            String::from_utf8_lossy(&children.stdout)
                .split_whitespace()
                .map(str::to_owned),
        );
        let status = Command::new("kill").arg("-KILL").args(&pids).status()?;
        if !status.success() {
            bail!("kill -KILL {} failed", pids.join(" "));
        }
        Ok(())
    }

    /// `pg_ctl promote -w`: returns once the standby has left recovery and takes writes.
    pub fn promote(&self) -> anyhow::Result<()> {
        run_as_postgres(
            &self.bin.join("pg_ctl"),
            &["-D", &self.data_arg(), "-w", "-t", "60", "promote"],
        )
    }
}

impl Drop for PrivatePostgres {
    fn drop(&mut self) {
        let _ = run_as_postgres(
            &self.bin.join("pg_ctl"),
            &["-D", &self.data_arg(), "-m", "immediate", "-w", "stop"],
        );
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

const RABBIT_BIN: &str = "/usr/lib/rabbitmq/bin";
/// Shared by every node a test starts, so the nodes (and `rabbitmqctl`) can talk to each other.
const COOKIE: &str = "NUDGEPRIVATENODECOOKIE";

/// A RabbitMQ node of the test's own: its own node name, AMQP and distribution ports, data
/// and log directories, no plugins. The guest account may connect over loopback.
#[derive(Debug)]
pub struct RabbitNode {
    dir: PathBuf,
    pub name: String,
    pub port: u16,
    dist_port: u16,
    running: bool,
}

impl RabbitNode {
    /// Starts a node and waits until it takes AMQP connections.
    pub fn start(label: &str) -> anyhow::Result<Self> {
        if !Path::new(RABBIT_BIN).join("rabbitmq-server").exists() {
            bail!("RabbitMQ's server is not installed ({RABBIT_BIN})");
        }
        let dir = temp_dir("rabbitmq")?;
        let home = dir.join("home");
        std::fs::create_dir_all(&home)?;
        let cookie = home.join(".erlang.cookie");
        std::fs::write(&cookie, COOKIE)?;
        let status = Command::new("chmod").arg("400").arg(&cookie).status()?;
        if !status.success() {
            bail!("could not protect the Erlang cookie");
        }
        let port = free_port();
        std::fs::write(
            dir.join("rabbitmq.conf"),
            format!("listeners.tcp.default = 127.0.0.1:{port}\nloopback_users = none\n"),
        )?;
        std::fs::write(
            dir.join("env.conf"),
            "ERL_EPMD_ADDRESS=127.0.0.1\nSERVER_ADDITIONAL_ERL_ARGS=\"-kernel inet_dist_use_interface {127,0,0,1}\"\n",
        )?;
        std::fs::write(dir.join("plugins"), "[].\n")?;
        let id = uuid::Uuid::new_v4().simple().to_string();
        let mut node = Self {
            name: format!("nudge-{label}-{}@localhost", &id[..6]),
            dir,
            port,
            dist_port: free_port(),
            running: false,
        };
        node.boot()?;
        Ok(node)
    }

    /// `amqp://guest:guest@127.0.0.1:<port>/%2f`.
    pub fn url(&self) -> String {
        format!("amqp://guest:guest@127.0.0.1:{}/%2f", self.port)
    }

    /// `127.0.0.1:<port>`.
    pub fn addr(&self) -> String {
        format!("127.0.0.1:{}", self.port)
    }

    fn command(&self, program: &str) -> Command {
        let mut c = Command::new(Path::new(RABBIT_BIN).join(program));
        let d = &self.dir;
        c.env("HOME", d.join("home"))
            .env("RABBITMQ_NODENAME", &self.name)
            .env("RABBITMQ_DIST_PORT", self.dist_port.to_string())
            .env("RABBITMQ_CONFIG_FILE", d.join("rabbitmq"))
            .env("RABBITMQ_CONF_ENV_FILE", d.join("env.conf"))
            .env("RABBITMQ_MNESIA_BASE", d.join("mnesia"))
            .env("RABBITMQ_LOG_BASE", d.join("log"))
            .env("RABBITMQ_ENABLED_PLUGINS_FILE", d.join("plugins"))
            .env("RABBITMQ_PID_FILE", d.join("pid"))
            .stdin(Stdio::null());
        c
    }

    /// Runs `rabbitmqctl -n <node> args` and returns its standard output.
    pub fn ctl(&self, args: &[&str]) -> anyhow::Result<String> {
        let out = self
            .command("rabbitmqctl")
            .args(["-n", &self.name])
            .args(args)
            .output()
            .context("failed to run rabbitmqctl")?;
        if !out.status.success() {
            bail!(
                "rabbitmqctl {} on {} failed: {}{}",
                args.join(" "),
                self.name,
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            );
        }
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    }

    fn boot(&mut self) -> anyhow::Result<()> {
        let status = self
            .command("rabbitmq-server")
            .arg("-detached")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .context("failed to start rabbitmq-server")?;
        if !status.success() {
            bail!("rabbitmq-server -detached failed for {}", self.name);
        }
        self.running = true;
        let pid = self.dir.join("pid").to_string_lossy().into_owned();
        self.ctl(&["wait", &pid, "--timeout", "90"])?;
        let deadline = Instant::now() + Duration::from_secs(30);
        while std::net::TcpStream::connect(self.addr()).is_err() {
            if Instant::now() > deadline {
                bail!("{} runs but does not take AMQP connections", self.name);
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        Ok(())
    }

    /// Stops the whole node (`rabbitmqctl stop`): every connection drops, as in a broker restart
    /// or a lost machine. Quorum queues keep their messages on disk.
    pub fn stop(&mut self) -> anyhow::Result<()> {
        let pid = self.dir.join("pid").to_string_lossy().into_owned();
        self.ctl(&["stop", &pid])?;
        self.running = false;
        Ok(())
    }

    /// Starts the stopped node again, with its data; waits until it takes connections.
    pub fn restart(&mut self) -> anyhow::Result<()> {
        self.boot()
    }

    /// Makes this (fresh) node a member of `leader`'s cluster.
    pub fn join(&self, leader: &RabbitNode) -> anyhow::Result<()> {
        self.ctl(&["stop_app"])?;
        self.ctl(&["join_cluster", &leader.name])?;
        self.ctl(&["start_app"])?;
        self.ctl(&["await_startup", "--timeout", "90"])?;
        Ok(())
    }
}

impl Drop for RabbitNode {
    fn drop(&mut self) {
        if self.running {
            let pid = self.dir.join("pid").to_string_lossy().into_owned();
            if self.ctl(&["stop", &pid]).is_err() {
                // The node did not answer its tools: end its Erlang VM by its pid file.
                if let Ok(pid) = std::fs::read_to_string(self.dir.join("pid")) {
                    let _ = Command::new("kill").args(["-9", pid.trim()]).status();
                }
            }
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// `size` nodes joined into one cluster; the first is where the others joined.
pub fn rabbit_cluster(size: usize) -> anyhow::Result<Vec<RabbitNode>> {
    let mut nodes = Vec::with_capacity(size);
    for i in 0..size {
        nodes.push(RabbitNode::start(&format!("c{}", i + 1))?);
    }
    if let Some((first, rest)) = nodes.split_first() {
        for node in rest {
            node.join(first)?;
        }
    }
    Ok(nodes)
}

/// Services on a private PostgreSQL and the shared RabbitMQ.
pub fn with_private_postgres(postgres: &PrivatePostgres) -> Services {
    Services {
        admin_url: postgres.admin_url(),
        ..Services::shared()
    }
}

/// Services on the shared PostgreSQL and a private RabbitMQ node.
pub fn with_private_rabbit(node: &RabbitNode) -> Services {
    Services {
        amqp_url: node.url(),
        ..Services::shared()
    }
}
