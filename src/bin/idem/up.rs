//! `idem up`: serve the embedded local stack until Ctrl-C.
//!
//! **Credentials.** `idem up` verifies tokens with the Supabase CLI's own
//! local JWT secret (`super-secret-jwt-token-with-at-least-32-characters-long`,
//! publicly known) and hands out the CLI's demo `service_role` and `anon`
//! keys (`exp` 1983812996, 2032) and its `sb_secret_…` and
//! `sb_publishable_…` keys, exactly as `supabase start` does (the `sb_` keys
//! are understood beneath `/rest/v1`, where a gateway maps each to its role
//! as Supabase's does). The
//! keys, and so the env file, are the same on every start: a key written
//! into a `.env` keeps working across restarts, and code written against
//! `supabase start` runs unchanged. A public secret protects nothing, which
//! is acceptable here only because the server listens on 127.0.0.1 alone:
//! whoever can reach it is a local user, who could reach the PostgreSQL
//! beneath it anyway. (The tests, `idem demo` and `idem bench` keep a random
//! secret per start.) The public secret is why the server's other doors
//! stay shut (see `idempotency_plane::local`): it logs in as `authenticator`
//! only, refuses tokens of any role but the API roles, answers loopback
//! `Host`s only, and sends no CORS headers unless asked.
//!
//! **Database.** Without `--database`, a throwaway copy of the migrations'
//! template, dropped on stop. With `--database NAME`, that database, kept
//! across restarts; see `LocalStackConfig::with_database`.

use std::ffi::OsString;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use idempotency_plane::local::{
    DatabaseName, LocalStack, LocalStackConfig, SUPABASE_CLI_JWT_SECRET, SUPABASE_REST_PATH,
};

use crate::{signal, BoxError};

/// Options of `idem up`.
#[derive(Debug, clap::Args)]
#[command(after_help = "The server listens on 127.0.0.1 only. It signs and accepts the Supabase CLI's \
    public local JWT secret, so its service_role and anon keys are the CLI's demo keys: the same on \
    every start, valid until 2032. Never expose the port beyond this machine. It logs in to PostgreSQL \
    as authenticator, never as DATABASE_URL's superuser (on a cluster that asks authenticator for a \
    password, set IDEM_AUTHENTICATOR_PASSWORD), accepts tokens of anon, authenticated and service_role \
    only, answers loopback Host names only, and sends CORS headers only to --cors-origin.")]
pub(crate) struct UpArgs {
    /// The port to serve on, on 127.0.0.1; 0 picks a free one. The REST
    /// API answers at the root and at /rest/v1 (where supabase-js calls).
    #[arg(long, default_value_t = 0)]
    port: u16,
    /// The server's row cap (PostgREST's db-max-rows).
    #[arg(long, default_value_t = 1000, value_parser = clap::value_parser!(u32).range(1..))]
    max_rows: u32,
    /// Serve the database NAME and keep it across restarts, instead of a
    /// throwaway one dropped on stop: created from the migrations when
    /// absent, reused when present. Refused when it was built from other
    /// migrations (use --reset) or not by idem up. NAME: lowercase letters,
    /// digits and _, at most 63 bytes, not starting with idem_local_ or
    /// idem_tpl_.
    #[arg(long, value_name = "NAME")]
    database: Option<DatabaseName>,
    /// With --database: drop the database (and its rows) and create it
    /// afresh from this build's migrations.
    #[arg(long, requires = "database")]
    reset: bool,
    /// Once serving, also write the connection details to this file, one
    /// NAME=value line each (sourceable by a shell, readable as a dotenv
    /// file): IDEM_POSTGREST_URL (the root URL), IDEM_SERVICE_KEY (the
    /// service_role JWT) and IDEM_MAX_ROWS for the Rust client and `idem`;
    /// then what a hosted Edge Function gets: SUPABASE_URL (the same root:
    /// /rest/v1 is added), SUPABASE_SERVICE_ROLE_KEY and SUPABASE_ANON_KEY
    /// (the legacy JWTs), SUPABASE_SECRET_KEYS and SUPABASE_PUBLISHABLE_KEYS
    /// (JSON maps, {"default":"sb_secret_…"}, single-quoted). Both clients
    /// and `idem` read IDEM_POSTGREST_URL and IDEM_SERVICE_KEY first: with
    /// both unset they call SUPABASE_URL/rest/v1 with SUPABASE_SECRET_KEYS,
    /// as on a hosted project.
    /// The same on every start on the same port. The file appears whole
    /// (written beside it as PATH.tmp, then renamed), readable by its owner
    /// only, and is removed on stop if it still holds what was written. An
    /// existing file is replaced only when an earlier `idem up` wrote it
    /// (it holds exactly these variables), so a project's own `.env` is
    /// never overwritten; --force replaces any file.
    #[arg(long, value_name = "PATH")]
    env_file: Option<PathBuf>,
    /// With --env-file: replace the file even when it is not one an
    /// `idem up` wrote.
    #[arg(long, requires = "env_file")]
    force: bool,
    /// Also answer requests whose Host is HOST (a name, or name:port) besides
    /// 127.0.0.1, localhost and [::1]; others get 403 (no web page can reach
    /// the server through a name of its own: DNS rebinding). Repeatable.
    #[arg(long, value_name = "HOST")]
    allow_host: Vec<String>,
    /// Send CORS headers to browser pages from ORIGIN (e.g.
    /// http://localhost:5173); without it the server sends none, so no page
    /// may read its answers. Repeatable.
    #[arg(long, value_name = "ORIGIN")]
    cors_origin: Vec<String>,
    /// Install Supabase Queues: pgmq (its own SQL, embedded in the pgmq
    /// crate) and the pgmq_public wrappers Supabase's Data API serves when
    /// queues are exposed, served beside agent, callable by service_role.
    #[arg(long)]
    with_pgmq: bool,
    /// With --with-pgmq: create the queue NAME when absent (a-z, 0-9 and
    /// _; e.g. orders, and orders_dlq for its dead letters). Repeatable.
    #[arg(long = "queue", value_name = "NAME", requires = "with_pgmq")]
    queues: Vec<String>,
}

/// Starts the stack, prints how to reach it, serves until a signal, stops.
pub(crate) async fn run(args: UpArgs) -> Result<ExitCode, BoxError> {
    let mut config = LocalStackConfig::default()
        .with_max_rows(args.max_rows)
        .with_port(args.port)
        .with_jwt_secret(SUPABASE_CLI_JWT_SECRET)
        .with_reset(args.reset);
    if let Some(name) = args.database {
        config = config.with_database(name);
    }
    for host in args.allow_host {
        config = config.with_allowed_host(host);
    }
    for origin in args.cors_origin {
        config = config.with_cors_origin(origin);
    }
    if args.with_pgmq {
        config = config.with_queues(args.queues);
    }
    // Refused before anything starts: a project's own file is not ours to replace.
    if let Some(path) = &args.env_file {
        check_env_file_replaceable(path, args.force)?;
    }
    let stack = crate::plane::start_local(config).await?;
    let mut written = None;
    if let Some(path) = &args.env_file {
        match write_env_file(path, &stack) {
            Ok(contents) => written = Some(contents),
            Err(error) => {
                stack.stop().await?;
                return Err(format!("writing the env file {}: {error}", path.display()).into());
            }
        }
    }
    print_banner(&stack);
    if let Some(path) = &args.env_file {
        println!("connection details written to {}", path.display());
    }

    let signal = signal::shutdown().await;
    match &signal {
        Ok(name) => println!("{name}: stopping"),
        Err(error) => eprintln!("could not wait for a signal ({error}): stopping"),
    }
    let database = stack.database_name().to_owned();
    let kept = stack.keeps_database();
    if let (Some(path), Some(written)) = (&args.env_file, &written) {
        // The details name a server that is going away; a file changed
        // since (by its owner, or another idem up) is not ours to remove.
        match std::fs::read_to_string(path) {
            Ok(now) if now == *written => {
                if let Err(error) = std::fs::remove_file(path) {
                    eprintln!("could not remove the env file {} ({error})", path.display());
                }
            }
            Ok(_) => eprintln!("the env file {} changed since it was written: left in place", path.display()),
            Err(error) => eprintln!("could not read the env file {} back ({error}): left alone", path.display()),
        }
    }
    stack.stop().await?;
    signal?;
    match kept {
        true => println!("stopped; database {database} kept"),
        false => println!("stopped; database {database} dropped"),
    }
    Ok(crate::exit::ok())
}

/// The variables of an env file, in order: what the Rust tools read, then
/// what a hosted Edge Function gets.
const ENV_FILE_VARIABLES: [&str; 8] = [
    "IDEM_POSTGREST_URL",
    "IDEM_SERVICE_KEY",
    "IDEM_MAX_ROWS",
    "SUPABASE_URL",
    "SUPABASE_SERVICE_ROLE_KEY",
    "SUPABASE_ANON_KEY",
    "SUPABASE_SECRET_KEYS",
    "SUPABASE_PUBLISHABLE_KEYS",
];

/// The variables of an env file an earlier `idem up` wrote, before it
/// handed out `sb_` keys: replaced like one of today's.
const EARLIER_ENV_FILE_VARIABLES: [&str; 7] = [
    "IDEM_POSTGREST_URL",
    "IDEM_SERVICE_KEY",
    "IDEM_MAX_ROWS",
    "SUPABASE_URL",
    "SUPABASE_SERVICE_ROLE_KEY",
    "SUPABASE_SECRET_KEY",
    "SUPABASE_ANON_KEY",
];

/// Refuses an existing `path` that an `idem up` did not write (one whose
/// lines are not exactly [`ENV_FILE_VARIABLES`], each once, as `NAME=value`),
/// unless `force`; and anything that is not a regular file.
fn check_env_file_replaceable(path: &Path, force: bool) -> Result<(), BoxError> {
    let metadata = match std::fs::symlink_metadata(path) {
        Err(error) if error.kind() == std::io::ErrorKind::NotFound => return Ok(()),
        Err(error) => return Err(format!("the env file {}: {error}", path.display()).into()),
        Ok(metadata) => metadata,
    };
    if !metadata.is_file() {
        return Err(
            format!("the env file {} exists and is not a regular file: pick another path", path.display()).into()
        );
    }
    if force {
        return Ok(());
    }
    let ours = std::fs::read_to_string(path).is_ok_and(|contents| written_by_idem_up(&contents));
    if ours {
        return Ok(());
    }
    Err(format!(
        "the env file {} exists and was not written by idem up (it holds other lines than {}):          it is left alone and nothing was started; pick another path, or pass --force to replace it          (idem up removes it again on stop)",
        path.display(),
        ENV_FILE_VARIABLES.join(", ")
    )
    .into())
}

/// Whether `contents` is an env file as `idem up` writes it.
fn written_by_idem_up(contents: &str) -> bool {
    let names: Vec<&str> = contents.lines().map(|line| line.split_once('=').map_or("", |(name, _)| name)).collect();
    (names == ENV_FILE_VARIABLES || names == EARLIER_ENV_FILE_VARIABLES) && contents.ends_with('\n')
}

/// The env file's lines, [`ENV_FILE_VARIABLES`] in order. Nothing in it
/// depends on the start but the port.
fn env_file_contents(stack: &LocalStack) -> String {
    let (url, service_key) = (stack.url(), stack.service_key());
    let max_rows = stack.max_rows().to_string();
    let secret_keys = key_map(stack.secret_key());
    let publishable_keys = key_map(stack.publishable_key());
    let values = [url, service_key, &max_rows, url, service_key, stack.anon_key(), &secret_keys, &publishable_keys];
    ENV_FILE_VARIABLES.iter().zip(values).map(|(name, value)| format!("{name}={value}\n")).collect()
}

/// `{"default":"<key>"}`, single-quoted as a shell and a dotenv reader both
/// take it: Supabase's shape of `SUPABASE_SECRET_KEYS`. An `sb_` key holds
/// no quote, so nothing needs escaping.
fn key_map(key: &str) -> String {
    format!("'{}'", serde_json::json!({ "default": key }))
}

/// Writes the stack's connection details to `path` atomically: a reader that
/// waits for the file never sees it half written. Answers what it wrote.
fn write_env_file(path: &Path, stack: &LocalStack) -> std::io::Result<String> {
    let contents = env_file_contents(stack);
    let mut tmp = OsString::from(path.as_os_str());
    tmp.push(".tmp");
    let tmp = PathBuf::from(tmp);
    // A leftover from a killed run may carry wider permissions than ours.
    let _ = std::fs::remove_file(&tmp);
    let written = (|| {
        let mut options = std::fs::OpenOptions::new();
        options.write(true).create(true).truncate(true);
        #[cfg(unix)]
        {
            // It carries a service key.
            use std::os::unix::fs::OpenOptionsExt;
            options.mode(0o600);
        }
        let mut file = options.open(&tmp)?;
        file.write_all(contents.as_bytes())?;
        file.sync_all()?;
        drop(file);
        std::fs::rename(&tmp, path)
    })();
    if written.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    written.map(|()| contents)
}

fn print_banner(stack: &LocalStack) {
    let url = stack.url();
    let key = stack.service_key();
    println!("idem up: the local idempotency plane is serving");
    println!();
    println!("  url          {url}");
    println!("               (REST at the root and at {url}{SUPABASE_REST_PATH}; use it as SUPABASE_URL)");
    println!("  secret key   {}   (sb_ keys: beneath {url}{SUPABASE_REST_PATH}, in apikey)", stack.secret_key());
    println!("  publishable  {}", stack.publishable_key());
    println!("  service key  {key}");
    println!("  anon key     {}", stack.anon_key());
    println!("               (the Supabase CLI's public demo keys: loopback only, the same on every start)");
    match stack.keeps_database() {
        true => println!("  database     {} (kept across restarts)", stack.database_name()),
        false => println!("  database     {} (dropped on stop)", stack.database_name()),
    }
    println!("  max rows     {}", stack.max_rows());
    println!();
    println!("try it:");
    println!("  curl -sS -X POST '{url}{SUPABASE_REST_PATH}/rpc/idempotency_get' \\");
    println!("    -H 'Content-Type: application/json' \\");
    println!("    -H 'Content-Profile: agent' \\");
    println!("    -H 'apikey: {}' \\", stack.secret_key());
    println!(
        "    -d '{{\"p_organization_id\":\"00000000-0000-4000-8000-000000000001\",\"p_scope\":\"tool.email.send\",\"p_key\":\"run-1:step-3\"}}'"
    );
    println!("  (supabase-js: createClient('{url}', secret key).schema('agent').rpc('idempotency_get', {{...}}))");
    println!();
    println!("run the demo against it, from another terminal:");
    println!("  IDEM_POSTGREST_URL={url} IDEM_SERVICE_KEY={key} IDEM_MAX_ROWS={} \\", stack.max_rows());
    println!("    cargo run --release --features local -- demo --remote");
    println!();
    println!("serving; Ctrl-C to stop");
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_a_file_of_exactly_the_stacks_variables_is_taken_for_one_idem_up_wrote() {
        let ours: String = ENV_FILE_VARIABLES.iter().map(|name| format!("{name}=x\n")).collect();
        assert!(written_by_idem_up(&ours));
        let earlier: String = EARLIER_ENV_FILE_VARIABLES.iter().map(|name| format!("{name}=x\n")).collect();
        assert!(written_by_idem_up(&earlier), "an earlier idem up's file");
        for theirs in [
            String::new(),
            "DATABASE_URL=postgres://prod\n".to_owned(),
            format!("{ours}STRIPE_SECRET=sk_live_x\n"),
            format!("# mine\n{ours}"),
            ours.trim_end().to_owned(),
            ours.replacen("IDEM_MAX_ROWS", "IDEM_MAX_ROW", 1),
        ] {
            assert!(!written_by_idem_up(&theirs), "{theirs:?}");
        }
    }
}
