//! `idem up`: serve the embedded local stack until Ctrl-C.

use std::ffi::OsString;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use idempotency_plane::local::{LocalStack, LocalStackConfig};

use crate::{signal, BoxError};

/// Options of `idem up`.
#[derive(Debug, clap::Args)]
pub(crate) struct UpArgs {
    /// The port to serve on, on 127.0.0.1; 0 picks a free one.
    #[arg(long, default_value_t = 0)]
    port: u16,
    /// The server's row cap (PostgREST's db-max-rows).
    #[arg(long, default_value_t = 1000, value_parser = clap::value_parser!(u32).range(1..))]
    max_rows: u32,
    /// Once serving, also write the connection details to this file as
    /// `IDEM_POSTGREST_URL=`, `IDEM_SERVICE_KEY=` and `IDEM_MAX_ROWS=` lines
    /// (sourceable by a shell, readable as a dotenv file). The file appears
    /// whole (written beside it as PATH.tmp, then renamed), readable by its
    /// owner only, and is removed on stop.
    #[arg(long, value_name = "PATH")]
    env_file: Option<PathBuf>,
}

/// Starts the stack, prints how to reach it, serves until a signal, stops.
pub(crate) async fn run(args: UpArgs) -> Result<ExitCode, BoxError> {
    let config = LocalStackConfig::default().with_max_rows(args.max_rows).with_port(args.port);
    let stack = LocalStack::start(config).await?;
    if let Some(path) = &args.env_file {
        if let Err(error) = write_env_file(path, &stack) {
            stack.stop().await?;
            return Err(format!("writing the env file {}: {error}", path.display()).into());
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
    if let Some(path) = &args.env_file {
        // The details name a server that is going away.
        if let Err(error) = std::fs::remove_file(path) {
            eprintln!("could not remove the env file {} ({error})", path.display());
        }
    }
    stack.stop().await?;
    signal?;
    println!("stopped; database {database} dropped");
    Ok(crate::exit::ok())
}

/// Writes the stack's connection details to `path` atomically: a reader that
/// waits for the file never sees it half written.
fn write_env_file(path: &Path, stack: &LocalStack) -> std::io::Result<()> {
    let contents = format!(
        "IDEM_POSTGREST_URL={}\nIDEM_SERVICE_KEY={}\nIDEM_MAX_ROWS={}\n",
        stack.url(),
        stack.service_key(),
        stack.max_rows()
    );
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
    written
}

fn print_banner(stack: &LocalStack) {
    let url = stack.url();
    let key = stack.service_key();
    println!("idem up: the local idempotency plane is serving");
    println!();
    println!("  url          {url}");
    println!("  service key  {key}");
    println!("               (a throwaway service_role key, signed by this stack only)");
    println!("  database     {} (dropped on stop)", stack.database_name());
    println!("  max rows     {}", stack.max_rows());
    println!();
    println!("try it:");
    println!("  curl -sS -X POST '{url}/rpc/idempotency_get' \\");
    println!("    -H 'Content-Type: application/json' \\");
    println!("    -H 'Content-Profile: agent' \\");
    println!("    -H 'Authorization: Bearer {key}' \\");
    println!(
        "    -d '{{\"p_organization_id\":\"00000000-0000-0000-0000-000000000001\",\"p_scope\":\"tool.email.send\",\"p_key\":\"run-1:step-3\"}}'"
    );
    println!();
    println!("run the demo against it, from another terminal:");
    println!("  IDEM_POSTGREST_URL={url} IDEM_SERVICE_KEY={key} IDEM_MAX_ROWS={} \\", stack.max_rows());
    println!("    cargo run --release --features local -- demo");
    println!();
    println!("serving; Ctrl-C to stop");
}
