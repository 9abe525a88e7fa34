//! `idem console`: the plane in a browser, served on loopback.
//!
//! One page shows what is in flight by scope, the orphans waiting for a
//! re-drive, the journaled failures (and whether each can be sent back),
//! dead letters by scope (a queue's scope is `queue.<name>` unless its
//! consumer set one), the sweep's backlog and plots of claims, replays and
//! failures over time, each read through the plane's own bounded
//! functions. Three actions, each confirmed on the page first: send
//! failures back after a fix, ask a scope's re-drive route for a pass
//! (as `idem redrive --to` does), and end a stuck claim as a failure when
//! it is unchanged since it was shown.
//!
//! Safe by construction: this process holds the service key and calls the
//! plane; the browser only talks to this process, whose page carries a
//! per-session token every API request must present. The console answers
//! its own address only (DNS rebinding), sends no CORS header, forbids
//! framing and inline script. It binds 127.0.0.1 unless told otherwise,
//! and refuses an address beyond loopback without `--allow-non-loopback`.

mod api;
mod guard;
mod page;
mod routes;
mod session;

use std::io::Write;
use std::net::SocketAddr;
use std::process::ExitCode;
use std::sync::Arc;

use idempotency_plane::PostgrestRepository;

use crate::{exit, remote, signal, BoxError};

/// Options of `idem console`.
#[derive(Debug, clap::Args)]
pub(crate) struct ConsoleArgs {
    /// The address to serve the page on; port 0 picks a free one. Loopback
    /// only, unless --allow-non-loopback.
    #[arg(long, value_name = "ADDR:PORT", default_value = "127.0.0.1:0")]
    listen: SocketAddr,
    /// Serve on an address beyond loopback. Whoever reaches it can act on
    /// the plane with the service key: put it behind a network only
    /// operators reach.
    #[arg(long)]
    allow_non_loopback: bool,
    /// A scope's (or a family's, webhook.*) re-drive route, which the
    /// page's "re-drive now" asks for a pass, as `idem redrive --to URL
    /// --scope SCOPE` does: https://, or plain http:// to loopback or the
    /// plane's own host (it gets the service key). Repeatable.
    #[arg(long = "route", value_name = "SCOPE=URL")]
    routes: Vec<String>,
    #[command(flatten)]
    target: remote::Target,
}

/// Why the console would not serve on an address.
#[derive(Debug, thiserror::Error)]
enum ListenError {
    /// Every address at once: the Host check needs one.
    #[error(
        "--listen {0}: name one address (127.0.0.1, or with --allow-non-loopback the interface's own), not every one"
    )]
    Unspecified(SocketAddr),
    /// Beyond loopback without the flag that allows it.
    #[error(
        "--listen {0} is not loopback: whoever reaches it acts on the plane with the service key; \
         add --allow-non-loopback to serve there anyway"
    )]
    NotLoopback(SocketAddr),
}

/// Checks the address, serves the console until Ctrl-C or SIGTERM. Its first
/// line on stdout is the page's URL.
pub(crate) async fn run(args: ConsoleArgs) -> Result<ExitCode, BoxError> {
    let client = remote::client(&args.target)?;
    let routes = routes::Routes::parse(&client, &args.routes).map_err(exit::usage_error)?;
    check_listen(args.listen, args.allow_non_loopback).map_err(exit::usage_error)?;
    let token = session::SessionToken::new()?;
    let listener = tokio::net::TcpListener::bind(args.listen).await?;
    let bound = listener.local_addr()?;
    let plane = client.config().redacted_url();
    let console = Arc::new(api::Console::new(PostgrestRepository::new(client), routes));
    let app =
        guard::guarded(page::router(&token).merge(api::router(console)), Arc::new(guard::Gate::new(bound, token)));
    // The URL alone on stdout: a reader may close it once it has the line
    // (`| head -n 1`, a test), so nothing more is written there.
    let mut stdout = std::io::stdout().lock();
    writeln!(stdout, "http://{bound}/")?;
    stdout.flush()?;
    drop(stdout);
    eprintln!("idem console: the plane at {plane}; Ctrl-C stops");
    tracing::info!(%bound, "console: serving");
    axum::serve(listener, app)
        .with_graceful_shutdown(async {
            match signal::shutdown().await {
                Ok(signal) => tracing::info!(signal, "console: stopping"),
                Err(error) => tracing::error!(%error, "console: cannot wait for a signal; stopping"),
            }
        })
        .await?;
    Ok(exit::ok())
}

/// Loopback, or beyond it with `allow_non_loopback`; never every address.
fn check_listen(listen: SocketAddr, allow_non_loopback: bool) -> Result<(), ListenError> {
    if listen.ip().is_unspecified() {
        return Err(ListenError::Unspecified(listen));
    }
    if !listen.ip().is_loopback() && !allow_non_loopback {
        return Err(ListenError::NotLoopback(listen));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn loopback_is_served_and_beyond_it_only_when_allowed_and_never_every_address() {
        let addr = |text: &str| text.parse::<SocketAddr>().unwrap();
        assert!(check_listen(addr("127.0.0.1:0"), false).is_ok());
        assert!(check_listen(addr("[::1]:8080"), false).is_ok());
        assert!(matches!(check_listen(addr("192.168.1.5:8080"), false), Err(ListenError::NotLoopback(_))));
        assert!(check_listen(addr("192.168.1.5:8080"), true).is_ok());
        assert!(matches!(check_listen(addr("0.0.0.0:8080"), true), Err(ListenError::Unspecified(_))));
        assert!(matches!(check_listen(addr("[::]:8080"), true), Err(ListenError::Unspecified(_))));
    }
}
