//! `idem up` run as a user runs it: its env file, the keys it writes
//! surviving a restart, and a named database kept across restarts.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use idempotency_plane::local::{
    mint_stable_token, LocalStack, LocalStackConfig, SUPABASE_CLI_JWT_SECRET, SUPABASE_CLI_PUBLISHABLE_KEY,
    SUPABASE_CLI_SECRET_KEY,
};
use idempotency_plane::postgrest::{ClientConfig, PostgrestClient};
use idempotency_plane::{ClaimOutcome, IdempotencyService, PostgrestRepository, ReadOutcome};
use serde_json::json;
use sqlx::{AssertSqlSafe, Connection, Executor, PgConnection};
use tokio::io::AsyncReadExt;

use crate::support::harness::{hash, org, within, LEASE};

/// How long `idem up` may take to write its env file, and to stop.
const READY: Duration = Duration::from_secs(90);
const STOP: Duration = Duration::from_secs(30);

/// A running `idem up`, killed if the test drops it without stopping it.
struct Up {
    child: tokio::process::Child,
    env_file: PathBuf,
    contents: String,
}

/// The env file's variables.
type Vars = BTreeMap<String, String>;

impl Up {
    /// Starts `idem up <args> --env-file <env_file>` and waits for the file.
    async fn start(args: &[&str], env_file: &Path) -> Result<Up, String> {
        let _ = std::fs::remove_file(env_file);
        Up::start_over(args, env_file).await
    }

    /// As [`Up::start`], over whatever `env_file` holds now: waits until it
    /// holds something else.
    async fn start_over(args: &[&str], env_file: &Path) -> Result<Up, String> {
        let before = std::fs::read_to_string(env_file).ok();
        let mut child = tokio::process::Command::new(env!("CARGO_BIN_EXE_idem"))
            .arg("up")
            .args(args)
            .arg("--env-file")
            .arg(env_file)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .expect("start idem up");
        let ready = tokio::time::timeout(READY, async {
            loop {
                if let Ok(contents) = std::fs::read_to_string(env_file) {
                    if Some(&contents) != before.as_ref() {
                        return Ok(contents);
                    }
                }
                if let Some(status) = child.try_wait().expect("poll idem up") {
                    return Err(status);
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        })
        .await;
        match ready {
            Ok(Ok(contents)) => Ok(Up { child, env_file: env_file.to_owned(), contents }),
            Ok(Err(status)) => {
                let mut stderr = String::new();
                if let Some(mut pipe) = child.stderr.take() {
                    let _ = pipe.read_to_string(&mut stderr).await;
                }
                Err(format!("idem up exited ({status}): {stderr}"))
            }
            Err(_) => panic!("idem up {args:?} wrote no env file within {READY:?}"),
        }
    }

    fn vars(&self) -> Vars {
        parse_env(&self.contents)
    }

    /// Sends SIGTERM, as Ctrl-C or a service manager would, and answers
    /// what it printed; panics unless it stopped cleanly and removed its
    /// env file.
    async fn stop(self) -> String {
        let env_file = self.env_file.clone();
        let stdout = self.stop_keeping_env_file().await;
        assert!(!env_file.exists(), "the env file is removed on stop");
        stdout
    }

    /// As [`Up::stop`], with the env file left as it is.
    async fn stop_keeping_env_file(self) -> String {
        let pid = self.child.id().expect("idem up is running").to_string();
        let sent = std::process::Command::new("kill").args(["-TERM", &pid]).status().expect("run kill");
        assert!(sent.success(), "kill -TERM {pid}");
        let output = within(STOP, "idem up stops", self.child.wait_with_output()).await.expect("idem up's output");
        let stdout = String::from_utf8_lossy(&output.stdout).into_owned();
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert!(output.status.success(), "idem up failed when stopped ({:?}):\n{stdout}\n{stderr}", output.status);
        stdout
    }
}

fn parse_env(contents: &str) -> Vars {
    contents
        .lines()
        .map(|line| {
            let (name, value) = line.split_once('=').unwrap_or_else(|| panic!("not NAME=value: {line:?}"));
            // Single quotes as a shell and a dotenv reader take them: literal.
            let value = value.strip_prefix('\'').and_then(|v| v.strip_suffix('\'')).unwrap_or(value);
            (name.to_owned(), value.to_owned())
        })
        .collect()
}

/// `idem up <args>` that must refuse to start: its exit code and stderr.
async fn refused(args: &[&str]) -> (Option<i32>, String) {
    let mut command = tokio::process::Command::new(env!("CARGO_BIN_EXE_idem"));
    command.arg("up").args(args).stdin(Stdio::null()).kill_on_drop(true);
    let output = within(READY, "idem up refuses", command.output()).await.expect("run idem up");
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(!stdout.contains("serving"), "idem up {args:?} served:\n{stdout}");
    (output.status.code(), String::from_utf8_lossy(&output.stderr).into_owned())
}

/// A client of the plane the env file's variables name, read as the Rust
/// tools read them (`ClientConfig::from_vars`).
fn client_of(vars: &Vars) -> PostgrestClient {
    let config = ClientConfig::from_vars(|name| vars.get(name).cloned()).expect("a configuration").expect("a URL");
    PostgrestClient::new(config).expect("a client")
}

fn service_of(client: &PostgrestClient) -> IdempotencyService<PostgrestRepository> {
    IdempotencyService::new(PostgrestRepository::new(client.clone()))
}

/// A free port of 127.0.0.1 (for a moment: another process may take it).
fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").expect("bind").local_addr().expect("address").port()
}

fn scratch_dir() -> tempdir::Dir {
    tempdir::Dir::new()
}

mod tempdir {
    /// A directory of this test's own, removed on drop.
    pub struct Dir(pub std::path::PathBuf);

    impl Dir {
        pub fn new() -> Dir {
            let path = std::env::temp_dir().join(format!("idem-up-test-{}", uuid::Uuid::new_v4().simple()));
            std::fs::create_dir(&path).expect("a scratch directory");
            Dir(path)
        }
    }

    impl Drop for Dir {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }
}

#[tokio::test]
async fn idem_up_writes_the_supabase_variables_and_the_same_file_with_keys_that_work_after_a_restart() {
    let dir = scratch_dir();
    let env_file = dir.0.join("plane.env");
    // The port is free when picked; should another process take it first,
    // `idem up` fails to bind and another is tried.
    let mut tries = 0;
    let (first, port) = loop {
        tries += 1;
        let port = free_port();
        match Up::start(&["--port", &port.to_string()], &env_file).await {
            Ok(up) => break (up, port),
            Err(error) if tries < 5 && error.contains("binding") => eprintln!("port {port} taken: {error}"),
            Err(error) => panic!("{error}"),
        }
    };
    let vars = first.vars();
    let url = format!("http://127.0.0.1:{port}");
    let service_key = mint_stable_token(SUPABASE_CLI_JWT_SECRET, "service_role");
    let anon_key = mint_stable_token(SUPABASE_CLI_JWT_SECRET, "anon");
    let expected: Vars = [
        ("IDEM_POSTGREST_URL", url.as_str()),
        ("IDEM_SERVICE_KEY", &service_key),
        ("IDEM_MAX_ROWS", "1000"),
        ("SUPABASE_URL", &url),
        ("SUPABASE_SERVICE_ROLE_KEY", &service_key),
        ("SUPABASE_ANON_KEY", &anon_key),
        ("SUPABASE_SECRET_KEYS", &format!(r#"{{"default":"{SUPABASE_CLI_SECRET_KEY}"}}"#)),
        ("SUPABASE_PUBLISHABLE_KEYS", &format!(r#"{{"default":"{SUPABASE_CLI_PUBLISHABLE_KEY}"}}"#)),
    ]
    .into_iter()
    .map(|(name, value)| (name.to_owned(), value.to_owned()))
    .collect();
    assert_eq!(vars, expected, "the Supabase CLI's demo keys, at the root URL");

    // What a hosted Edge Function has, and nothing else: SUPABASE_URL and
    // SUPABASE_SECRET_KEYS. `idem doctor` passes on it, through the
    // gateway beneath /rest/v1 that maps the sb_secret_ key to service_role.
    let hosted = tokio::process::Command::new(env!("CARGO_BIN_EXE_idem"))
        .arg("doctor")
        .env_clear()
        .env("SUPABASE_URL", &vars["SUPABASE_URL"])
        .env("SUPABASE_SECRET_KEYS", &vars["SUPABASE_SECRET_KEYS"])
        .stdin(Stdio::null())
        .kill_on_drop(true)
        .output();
    let hosted = within(READY, "idem doctor", hosted).await.expect("run idem doctor");
    let report = String::from_utf8_lossy(&hosted.stdout);
    assert!(hosted.status.success(), "{report}{}", String::from_utf8_lossy(&hosted.stderr));
    assert!(report.contains("all checks passed") && report.contains("SUPABASE_SECRET_KEYS"), "{report}");

    // The first run's file, read as the Rust tools read it, serves claims.
    let client = client_of(&vars);
    let (org, request) = (org(), hash("restart"));
    let claim = service_of(&client).claim(org, "tool.email.send", "before", &request, LEASE).await;
    assert!(matches!(claim, Ok(ClaimOutcome::Claimed(_))), "{claim:?}");
    let stopped = first.stop().await;
    assert!(stopped.contains("stopped; database idem_local_") && stopped.contains(" dropped"), "{stopped}");

    // A restart on the same port writes the same file, and the first run's
    // keys work against it: the service key claims, and the anon key is a
    // valid token whose role may execute nothing.
    let second = Up::start(&["--port", &port.to_string()], &env_file).await.expect("idem up again");
    assert_eq!(second.contents, env_text(&vars), "the same file on every start");
    let again = service_of(&client).claim(org, "tool.email.send", "after", &request, LEASE).await;
    assert!(matches!(again, Ok(ClaimOutcome::Claimed(_))), "the first run's key, after a restart: {again:?}");
    for base in [url.clone(), format!("{url}/rest/v1")] {
        let answer = reqwest::Client::new()
            .post(format!("{base}/rpc/idempotency_get"))
            .header("apikey", &vars["SUPABASE_ANON_KEY"])
            .bearer_auth(&vars["SUPABASE_ANON_KEY"])
            .header("content-profile", "agent")
            .json(&json!({"p_organization_id": org, "p_scope": "tool.email.send", "p_key": "after"}))
            .send()
            .await
            .expect("an answer");
        let body: serde_json::Value = answer.json().await.expect("a JSON error");
        assert_eq!(body["code"], "42501", "anon is known and refused, not an unknown token: {body}");
    }
    second.stop().await;
}

/// The env file text `vars` were read from, in the order `idem up` writes.
fn env_text(vars: &Vars) -> String {
    [
        "IDEM_POSTGREST_URL",
        "IDEM_SERVICE_KEY",
        "IDEM_MAX_ROWS",
        "SUPABASE_URL",
        "SUPABASE_SERVICE_ROLE_KEY",
        "SUPABASE_ANON_KEY",
        "SUPABASE_SECRET_KEYS",
        "SUPABASE_PUBLISHABLE_KEYS",
    ]
    .iter()
    .map(|name| match name.ends_with("_KEYS") {
        true => format!("{name}='{}'\n", vars[*name]),
        false => format!("{name}={}\n", vars[*name]),
    })
    .collect()
}

/// A superuser session on the maintenance database.
async fn admin() -> PgConnection {
    PgConnection::connect(&LocalStackConfig::default().database_url).await.expect("connect to PostgreSQL")
}

async fn comment_of(admin: &mut PgConnection, name: &str) -> Option<Option<String>> {
    sqlx::query_scalar("select shobj_description(oid, 'pg_database') from pg_database where datname = $1")
        .bind(name)
        .fetch_optional(admin)
        .await
        .expect("look the database up")
}

/// Drops the named databases on drop, whatever the test did.
struct DropDatabases(Vec<String>);

impl Drop for DropDatabases {
    fn drop(&mut self) {
        let names = std::mem::take(&mut self.0);
        let dropping = std::thread::spawn(move || {
            let Ok(runtime) = tokio::runtime::Builder::new_current_thread().enable_all().build() else { return };
            runtime.block_on(async {
                let mut admin = admin().await;
                for name in names {
                    // The names are this test's own: letters, digits and _.
                    let _ =
                        admin.execute(AssertSqlSafe(format!("drop database if exists \"{name}\" with (force)"))).await;
                }
            });
        });
        let _ = dropping.join();
    }
}

#[tokio::test]
async fn idem_up_database_keeps_its_rows_across_restarts_and_refuses_what_it_must() {
    let suffix = uuid::Uuid::new_v4().simple().to_string();
    let name = format!("idem_test_up_{}", &suffix[..12]);
    let foreign = format!("{name}_foreign");
    let _cleanup = DropDatabases(vec![name.clone(), foreign.clone()]);
    let dir = scratch_dir();
    let env_file = dir.0.join("plane.env");
    let mut admin = admin().await;

    // Created on the first start, with a row in it, kept on stop.
    let first = Up::start(&["--database", &name], &env_file).await.expect("idem up --database");
    let (org, request) = (org(), hash("kept"));
    let client = client_of(&first.vars());
    let claim = service_of(&client).claim(org, "tool.email.send", "kept", &request, LEASE).await;
    assert!(matches!(claim, Ok(ClaimOutcome::Claimed(_))), "{claim:?}");
    let stopped = first.stop().await;
    assert!(stopped.contains(&format!("stopped; database {name} kept")), "{stopped}");
    let comment = comment_of(&mut admin, &name).await.expect("the database is kept").expect("a comment");
    assert!(comment.starts_with("idempotency-plane local database") && comment.contains("idem_tpl_"), "{comment}");

    // Another stack's start cleans up stale databases: it leaves this one.
    let other = LocalStack::start(LocalStackConfig::default()).await.expect("another stack");
    other.stop().await.expect("stop it");

    // Reused on the next start: the row is still there.
    let second = Up::start(&["--database", &name], &env_file).await.expect("idem up --database again");
    let read = service_of(&client_of(&second.vars())).read(org, "tool.email.send", "kept", &request).await;
    assert!(matches!(read, Ok(ReadOutcome::Processing { .. })), "the claim survived the restart: {read:?}");
    second.stop().await;

    // Built from another migration set: refused, saying how to reset.
    let stale = "idempotency-plane local database, kept across starts; migrations idem_tpl_0000000000000000";
    admin.execute(AssertSqlSafe(format!("comment on database \"{name}\" is '{stale}'"))).await.expect("age it");
    let (code, stderr) = refused(&["--database", &name]).await;
    assert_eq!(code, Some(1), "{stderr}");
    assert!(stderr.contains("another migration set") && stderr.contains("--reset"), "{stderr}");

    // --reset drops and recreates it: a fresh database of this build.
    let reset = Up::start(&["--database", &name, "--reset"], &env_file).await.expect("idem up --reset");
    let read = service_of(&client_of(&reset.vars())).read(org, "tool.email.send", "kept", &request).await;
    assert!(matches!(read, Ok(ReadOutcome::Absent)), "the reset dropped the rows: {read:?}");
    reset.stop().await;
    assert_eq!(comment_of(&mut admin, &name).await, Some(Some(comment)), "it records this build's migrations again");

    // A database idem up did not create is neither used nor reset.
    admin.execute(AssertSqlSafe(format!("create database \"{foreign}\""))).await.expect("a foreign database");
    for args in [&["--database", &foreign][..], &["--database", &foreign, "--reset"]] {
        let (code, stderr) = refused(args).await;
        assert_eq!(code, Some(1), "{args:?}: {stderr}");
        assert!(stderr.contains("not created by idem up"), "{args:?}: {stderr}");
    }
    assert_eq!(comment_of(&mut admin, &foreign).await, Some(None), "left alone");

    // Names it must refuse, before touching anything: usage errors.
    for bad in
        ["idem_local_20000101000000_1_00000000", "idem_tpl_0123456789abcdef", "Mixed_Case", "a-b", "postgres", ""]
    {
        let (code, stderr) = refused(&["--database", bad]).await;
        assert_eq!(code, Some(2), "{bad:?}: {stderr}");
        assert!(stderr.contains("--database"), "{bad:?}: {stderr}");
    }
    let (code, stderr) = refused(&["--reset"]).await;
    assert_eq!(code, Some(2), "--reset needs --database: {stderr}");
    let _ = admin.close().await;
}

/// `--env-file` never replaces a project's own file (a `.env` holding other
/// variables) unless told to with `--force`; it replaces its own leftover
/// from a killed run; and on stop it removes the file only if it still
/// holds what it wrote.
#[tokio::test]
async fn idem_up_env_file_never_replaces_or_removes_a_file_it_did_not_write() {
    let dir = scratch_dir();
    let env_file = dir.0.join(".env");
    let project = "DATABASE_URL=postgres://prod.example/app\nSTRIPE_SECRET_KEY=sk_live_keep\n";
    std::fs::write(&env_file, project).unwrap();
    let path = env_file.to_str().expect("a UTF-8 path");
    let (code, stderr) = refused(&["--env-file", path]).await;
    assert_eq!(code, Some(1), "{stderr}");
    assert!(stderr.contains("was not written by idem up") && stderr.contains("--force"), "{stderr}");
    assert_eq!(std::fs::read_to_string(&env_file).unwrap(), project, "the project's file is untouched");
    let (code, stderr) = refused(&["--env-file", dir.0.to_str().expect("UTF-8")]).await;
    assert!(code == Some(1) && stderr.contains("not a regular file"), "{stderr}");

    // Asked by name, it replaces the file (and removes it on stop, as it warned).
    let forced = Up::start_over(&["--force"], &env_file).await.expect("idem up --force");
    assert!(forced.vars().contains_key("IDEM_SERVICE_KEY"));
    forced.stop().await;

    // Its own leftover (a killed run's, with a port long gone; here one an
    // idem up wrote before it handed out sb_ keys) is replaced.
    let leftover: String = [
        "IDEM_POSTGREST_URL",
        "IDEM_SERVICE_KEY",
        "IDEM_MAX_ROWS",
        "SUPABASE_URL",
        "SUPABASE_SERVICE_ROLE_KEY",
        "SUPABASE_SECRET_KEY",
        "SUPABASE_ANON_KEY",
    ]
    .iter()
    .map(|name| format!("{name}=stale\n"))
    .collect();
    std::fs::write(&env_file, &leftover).unwrap();
    let up = Up::start_over(&[], &env_file).await.expect("idem up over its own leftover");
    assert_ne!(up.vars()["IDEM_POSTGREST_URL"], "stale");

    // Changed by its owner meanwhile: left in place on stop.
    let edited = format!("{}# mine now\n", up.contents);
    std::fs::write(&env_file, &edited).unwrap();
    let stdout = up.stop_keeping_env_file().await;
    assert!(stdout.contains("stopped; database"), "{stdout}");
    assert_eq!(std::fs::read_to_string(&env_file).unwrap(), edited);
}
