//! A PostgreSQL 15 cluster of a test's own, for what must never happen to
//! the machine's shared cluster: loading an extension at start, a
//! `kill -9`, a standby promoted, every connection taken.
//!
//! `initdb` in a temporary directory, a free port on 127.0.0.1, trust
//! authentication for the `postgres` superuser. As root, the server binaries
//! run as the `postgres` system user (initdb refuses root). Dropping a
//! [`Cluster`] stops its server (`pg_ctl stop -m immediate`) and removes its
//! directory, whether the test passed or failed.
//!
//! Needs PostgreSQL 15's server binaries (`/usr/lib/postgresql/15/bin`).
//! [`server_binaries_missing`] says when they are not there; a test then
//! fails under CI and is skipped, saying so, elsewhere.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::{Duration, Instant};

use sqlx::{Connection, PgConnection};

pub const PG_BIN: &str = "/usr/lib/postgresql/15/bin";

/// How long `pg_ctl` waits for a start, a stop or a promotion.
const PG_CTL_WAIT_SECONDS: &str = "60";

/// Whether a test that needs a cluster of its own must skip: `false` when
/// the server binaries are here. Without them it panics under CI (`CI` or
/// `IDEM_REQUIRE_OWN_CLUSTER` set) and answers `true`, with a notice,
/// elsewhere.
pub fn server_binaries_missing(test: &str) -> bool {
    let missing: Vec<String> = ["initdb", "pg_ctl", "pg_basebackup"]
        .iter()
        .map(|program| format!("{PG_BIN}/{program}"))
        .filter(|path| !Path::new(path).exists())
        .collect();
    if missing.is_empty() {
        return false;
    }
    let set = |name: &str| std::env::var(name).is_ok_and(|value| !value.is_empty() && value != "false" && value != "0");
    let message = format!("{test}: PostgreSQL 15's server binaries are not installed ({})", missing.join(", "));
    assert!(!(set("CI") || set("IDEM_REQUIRE_OWN_CLUSTER")), "CI is set, so this test must run: {message}");
    eprintln!("SKIPPED {message}");
    true
}

/// Runs `command`; panics with its output unless it succeeded.
pub fn run(command: &mut Command, what: &str) -> Output {
    let output = command.output().unwrap_or_else(|e| panic!("{what}: could not run {command:?}: {e}"));
    assert!(
        output.status.success(),
        "{what} failed ({}):\n{}{}",
        output.status,
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    output
}

/// The trimmed standard output of `program args`.
fn stdout_of(program: &str, args: &[&str]) -> String {
    let output = run(Command::new(program).args(args), program);
    String::from_utf8_lossy(&output.stdout).trim().to_owned()
}

/// A free port on 127.0.0.1 a moment ago.
fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").and_then(|listener| listener.local_addr()).expect("a free port").port()
}

/// A PostgreSQL 15 cluster of the test's own. Stopped and removed on drop.
pub struct Cluster {
    dir: PathBuf,
    port: u16,
    /// Server options beyond port, socket directory and listen address.
    options: String,
    /// Root runs the server binaries as the `postgres` system user.
    as_postgres: bool,
    running: bool,
}

impl Cluster {
    /// initdb, then starts the server with `options` (`-c name=value ...`)
    /// added to the defaults. `purpose` names the directory.
    pub fn start(purpose: &str, options: &str) -> Cluster {
        Cluster::initdb_and_start(Cluster::empty(purpose, options), &["--auth=trust"])
    }

    /// A cluster that asks every TCP login for a password (SCRAM), as the
    /// official postgres container image and Debian's defaults do; the
    /// `postgres` superuser's is `password`. The Unix socket stays trust.
    pub fn start_with_passwords(purpose: &str, password: &str) -> Cluster {
        let cluster = Cluster::empty(purpose, "");
        let pwfile = cluster.dir.join("pwfile");
        std::fs::write(&pwfile, password).expect("write the password file");
        let pwfile = format!("--pwfile={}", pwfile.display());
        Cluster::initdb_and_start(cluster, &["--auth-local=trust", "--auth-host=scram-sha-256", &pwfile])
    }

    fn initdb_and_start(mut cluster: Cluster, auth: &[&str]) -> Cluster {
        let data = cluster.data();
        let mut args = vec!["-D", &data, "-U", "postgres", "--no-sync", "-E", "UTF8", "--locale=C"];
        args.extend_from_slice(auth);
        run(cluster.server_binary("initdb").args(args), "initdb");
        cluster.start_on_a_free_port();
        cluster
    }

    /// A streaming standby of the primary reached on `port` (directly, or
    /// through a forwarder it then streams through), made with
    /// `pg_basebackup -R` and started with `options`. It connects as
    /// `application_name`, the name `synchronous_standby_names` can list.
    /// The primary must allow replication connections (initdb's defaults
    /// do, for trust on 127.0.0.1) and run with `wal_level` replica or above
    /// (the default).
    pub fn standby_streaming_from(port: u16, application_name: &str, options: &str) -> Cluster {
        let mut standby = Cluster::empty(&format!("{application_name}-standby"), options);
        let data = standby.data();
        let connection = format!("host=127.0.0.1 port={port} user=postgres application_name={application_name}");
        run(
            standby.server_binary("pg_basebackup").args([
                "-D",
                &data,
                "-d",
                &connection,
                "-X",
                "stream",
                "-R",
                "--checkpoint=fast",
                "--no-sync",
            ]),
            "pg_basebackup",
        );
        // -R wrote primary_conninfo from -d. The port is not copied: the
        // primary's came from its command line, and the standby gets its own.
        standby.start_on_a_free_port();
        standby
    }

    fn empty(purpose: &str, options: &str) -> Cluster {
        let as_postgres = stdout_of("id", &["-u"]) == "0";
        let dir =
            std::env::temp_dir().join(format!("idem-{purpose}-{}-{:08x}", std::process::id(), rand::random::<u32>()));
        std::fs::create_dir(&dir).unwrap_or_else(|e| panic!("creating {}: {e}", dir.display()));
        // From here on, dropping the cluster removes the directory.
        let cluster = Cluster { dir, port: 0, options: options.to_owned(), as_postgres, running: false };
        if as_postgres {
            let uid: u32 = stdout_of("id", &["-u", "postgres"]).parse().expect("the postgres user's uid");
            let gid: u32 = stdout_of("id", &["-g", "postgres"]).parse().expect("the postgres user's gid");
            std::os::unix::fs::chown(&cluster.dir, Some(uid), Some(gid)).expect("hand the directory to postgres");
        }
        cluster
    }

    /// Starts the server; a port free a moment ago may be taken by the time
    /// the server binds it, so up to three ports are tried.
    fn start_on_a_free_port(&mut self) {
        for attempt in 1..=3 {
            self.port = free_port();
            if self.pg_ctl_start() {
                return;
            }
            assert!(attempt < 3, "pg_ctl start failed three times; the server's log:\n{}", self.log());
        }
    }

    fn pg_ctl_start(&mut self) -> bool {
        let options = format!(
            "-p {port} -k {dir} -c listen_addresses=127.0.0.1 -c fsync=off {extra}",
            port = self.port,
            dir = self.dir.display(),
            extra = self.options
        );
        let (data, log) = (self.data(), self.log_path());
        let started = self
            .server_binary("pg_ctl")
            .args(["-D", &data, "-l", &log, "-w", "-t", PG_CTL_WAIT_SECONDS, "-o", &options, "start"])
            .output()
            .expect("run pg_ctl start");
        self.running = started.status.success();
        self.running
    }

    /// Starts the server again, on the same directory and port, after
    /// [`Cluster::kill`] (crash recovery runs first).
    pub fn restart(&mut self) {
        assert!(self.pg_ctl_start(), "the cluster did not start again; the server's log:\n{}", self.log());
    }

    /// `kill -9` of the postmaster, as a crash would: no shutdown
    /// checkpoint, no goodbye to clients. Its backends end when they notice
    /// (PostgreSQL's postmaster-death check), so this waits until the port
    /// refuses connections.
    pub fn kill(&mut self) {
        let pid_file = self.dir.join("data").join("postmaster.pid");
        let pid = std::fs::read_to_string(&pid_file)
            .unwrap_or_else(|e| panic!("reading {}: {e}", pid_file.display()))
            .lines()
            .next()
            .unwrap_or_default()
            .trim()
            .to_owned();
        run(Command::new("kill").args(["-9", &pid]), "kill -9 of the postmaster");
        self.running = false;
        let began = Instant::now();
        while std::net::TcpStream::connect(("127.0.0.1", self.port)).is_ok() {
            assert!(began.elapsed() < Duration::from_secs(30), "the killed postmaster's port still answers");
            std::thread::sleep(Duration::from_millis(20));
        }
        // The killed postmaster may linger as a zombie of this test's process
        // tree, and PostgreSQL takes a live PID in its lock files for a
        // running server. Once it is gone or a zombie, the stale lock files
        // are removed, as an operator would after a crash.
        let state = || {
            std::fs::read_to_string(format!("/proc/{pid}/stat"))
                .ok()
                .and_then(|stat| stat.rsplit(')').next().map(|rest| rest.trim().chars().next()))
                .flatten()
        };
        while !matches!(state(), None | Some('Z')) {
            assert!(began.elapsed() < Duration::from_secs(30), "the killed postmaster {pid} does not exit");
            std::thread::sleep(Duration::from_millis(20));
        }
        std::fs::remove_file(&pid_file).unwrap_or_else(|e| panic!("removing {}: {e}", pid_file.display()));
        // The socket's lock file names the same PID.
        let socket_lock = self.dir.join(format!(".s.PGSQL.{}.lock", self.port));
        if socket_lock.exists() {
            std::fs::remove_file(&socket_lock).unwrap_or_else(|e| panic!("removing {}: {e}", socket_lock.display()));
        }
    }

    /// Promotes a standby to primary and waits until it accepts writes.
    pub fn promote(&self) {
        let data = self.data();
        run(
            self.server_binary("pg_ctl").args(["-D", &data, "-w", "-t", PG_CTL_WAIT_SECONDS, "promote"]),
            "pg_ctl promote",
        );
    }

    /// A command running one of PostgreSQL 15's server binaries.
    fn server_binary(&self, program: &str) -> Command {
        let path = format!("{PG_BIN}/{program}");
        if self.as_postgres {
            let mut command = Command::new("runuser");
            command.args(["-u", "postgres", "--", &path]);
            command
        } else {
            Command::new(path)
        }
    }

    pub fn port(&self) -> u16 {
        self.port
    }

    /// The URL of `database` as the `postgres` superuser.
    pub fn url(&self, database: &str) -> String {
        format!("postgres://postgres@127.0.0.1:{}/{database}", self.port)
    }

    fn data(&self) -> String {
        self.dir.join("data").display().to_string()
    }

    fn log_path(&self) -> String {
        self.dir.join("server.log").display().to_string()
    }

    /// The server's log so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.log_path()).unwrap_or_default()
    }

    /// The `postgres` database, as `user`.
    pub async fn connect(&self, user: &str) -> PgConnection {
        let url = format!("postgres://{user}@127.0.0.1:{}/postgres", self.port);
        PgConnection::connect(&url).await.unwrap_or_else(|e| panic!("connecting to {url}: {e}"))
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        // A start that timed out may have left a server running all the same.
        if self.running || self.dir.join("data").join("postmaster.pid").exists() {
            let data = self.data();
            let stopped = self.server_binary("pg_ctl").args(["-D", &data, "-m", "immediate", "-w", "stop"]).output();
            if !stopped.as_ref().is_ok_and(|output| output.status.success()) {
                eprintln!("pg_ctl stop of the test's cluster in {} failed: {stopped:?}", self.dir.display());
            }
        }
        if let Err(error) = std::fs::remove_dir_all(&self.dir) {
            eprintln!("removing the test's cluster in {}: {error}", self.dir.display());
        }
    }
}
