//! `idem up`: serve the embedded local stack until Ctrl-C.

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
}

/// Starts the stack, prints how to reach it, serves until a signal, stops.
pub(crate) async fn run(args: UpArgs) -> Result<ExitCode, BoxError> {
    let config = LocalStackConfig::default().with_max_rows(args.max_rows).with_port(args.port);
    let stack = LocalStack::start(config).await?;
    print_banner(&stack);

    let signal = signal::shutdown().await;
    match &signal {
        Ok(name) => println!("{name}: stopping"),
        Err(error) => eprintln!("could not wait for a signal ({error}): stopping"),
    }
    let database = stack.database_name().to_owned();
    stack.stop().await?;
    signal?;
    println!("stopped; database {database} dropped");
    Ok(ExitCode::SUCCESS)
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
