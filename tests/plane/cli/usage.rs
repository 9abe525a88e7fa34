//! The `idem` binary keeps its word: every usage or configuration error
//! exits 2 before any request, and every subcommand's `--help` names the
//! environment variables it reads. The plane each command is pointed at
//! here is a TCP listener that never answers: a command that sent anything
//! would have connected to it, and the test checks that none did.

use std::io::Write;
use std::net::TcpListener;
use std::process::{Command, Output, Stdio};

use idempotency_plane::service::MAX_KEY_CHARS;

const IDEM: &str = env!("CARGO_BIN_EXE_idem");
const ORG: &str = "00000000-0000-0000-0000-000000000001";

/// A syntactically valid service-role JWT (its signature is never checked:
/// nothing is sent).
const SERVICE_JWT: &str = "eyJhbGciOiJIUzI1NiIsInR5cCI6IkpXVCJ9.eyJyb2xlIjoic2VydmljZV9yb2xlIn0.c2lnbmF0dXJl";

/// A plane that records whether anyone connected.
struct Silent(TcpListener);

impl Silent {
    fn new() -> Silent {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind a local port");
        listener.set_nonblocking(true).expect("non-blocking");
        Silent(listener)
    }

    fn url(&self) -> String {
        format!("http://{}", self.0.local_addr().expect("local address"))
    }

    fn was_reached(&self) -> bool {
        self.0.accept().is_ok()
    }
}

/// Runs `idem args…` with only `env` set, `stdin` on its input.
fn idem(args: &[&str], env: &[(&str, &str)], stdin: &str) -> Output {
    let mut child = Command::new(IDEM)
        .args(args)
        .env_clear()
        .envs(env.iter().copied())
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("idem starts");
    // A command that never reads its input closes the pipe first: ignore that.
    let _ = child.stdin.take().expect("stdin").write_all(stdin.as_bytes());
    child.wait_with_output().expect("idem ends")
}

/// Asserts `args` exit 2 with a message, reaching nothing.
fn assert_usage_error(args: &[&str], env: &[(&str, &str)], stdin: &str, plane: &Silent) {
    let output = idem(args, env, stdin);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(output.status.code(), Some(2), "idem {args:?} (env {env:?}): {stderr}");
    assert!(!stderr.trim().is_empty(), "idem {args:?} says what is wrong");
    assert!(output.stdout.is_empty(), "idem {args:?} printed a result: {}", String::from_utf8_lossy(&output.stdout));
    assert!(!plane.was_reached(), "idem {args:?} sent a request before refusing");
}

/// Environment variables a case sets.
type Env<'a> = Vec<(&'a str, &'a str)>;

/// The commands that act on a deployment, with the arguments each needs.
fn remote_commands() -> [(&'static str, Vec<&'static str>); 7] {
    [
        ("sweep", vec!["--bound", "100"]),
        // Nothing listens on port 1: a request would fail with exit 1, not 2.
        ("redrive", vec!["--to", "http://127.0.0.1:1/redrive"]),
        ("failures", vec!["--scope", "webhook.*"]),
        ("get", vec!["--org", ORG, "--scope", "tool.email.send", "--key", "k"]),
        ("claim", vec!["--org", ORG, "--scope", "tool.email.send", "--key", "k"]),
        ("doctor", vec![]),
        ("console", vec![]),
    ]
}

#[test]
fn every_usage_or_configuration_error_of_a_remote_command_exits_2_before_any_request() {
    let plane = Silent::new();
    let url = plane.url();
    for (command, needed) in remote_commands() {
        let with = |extra: &[&str]| -> Vec<String> {
            let mut args = vec![command.to_owned()];
            args.extend(needed.iter().map(|a| a.to_string()));
            args.extend(extra.iter().map(|a| a.to_string()));
            args
        };
        let cases: Vec<(Vec<String>, Env)> = vec![
            // No plane named by flags or environment.
            (with(&[]), vec![]),
            // A flag it does not have.
            (with(&["--url", &url, "--service-key", SERVICE_JWT, "--no-such-flag"]), vec![]),
            // A URL that is not one.
            (with(&["--url", "not a url", "--service-key", SERVICE_JWT]), vec![]),
            // A publishable key, from the flag and from the environment.
            (with(&["--url", &url, "--service-key", "sb_publishable_abc"]), vec![]),
            (with(&[]), vec![("IDEM_POSTGREST_URL", url.as_str()), ("IDEM_SERVICE_KEY", "sb_publishable_abc")]),
            // A URL without a key.
            (with(&["--url", &url]), vec![]),
            // A row cap that is not a number.
            (with(&["--url", &url, "--service-key", SERVICE_JWT]), vec![("IDEM_MAX_ROWS", "many")]),
        ];
        for (args, env) in cases {
            let args: Vec<&str> = args.iter().map(String::as_str).collect();
            assert_usage_error(&args, &env, "{}", &plane);
        }
    }
}

#[test]
fn input_the_library_refuses_exits_2_before_any_request() {
    let plane = Silent::new();
    let url = plane.url();
    let target = ["--url", url.as_str(), "--service-key", SERVICE_JWT];
    let long_key = "k".repeat(MAX_KEY_CHARS + 1);
    let cases: Vec<(Vec<&str>, &str)> = vec![
        (vec!["sweep", "--bound", "5000"], ""),
        (vec!["sweep", "--bound", "0"], ""),
        (vec!["sweep", "--bound", "100", "--every", "soon"], ""),
        (vec!["sweep", "--bound", "100", "--align"], ""),
        (vec!["get", "--org", "not-a-uuid", "--scope", "tool.email.send", "--key", "k"], ""),
        (vec!["get", "--org", ORG, "--scope", "", "--key", "k"], ""),
        (vec!["get", "--org", ORG, "--scope", "tool.email.send", "--key", ""], ""),
        (vec!["get", "--org", ORG, "--scope", "tool.email.send", "--key", &long_key], ""),
        (vec!["claim", "--org", ORG, "--scope", "tool.email.send", "--key", "k"], "not json"),
        (vec!["claim", "--org", ORG, "--scope", "", "--key", "k"], "{}"),
        (vec!["claim", "--org", ORG, "--scope", "tool.email.send", "--key", &long_key], "{}"),
        (vec!["claim", "--org", ORG, "--scope", "tool.email.send", "--key", "k", "--hold", "--lease-ms", "5"], "{}"),
        (vec!["claim", "--org", ORG, "--scope", "tool.email.send", "--key", "k", "--release"], "{}"),
    ];
    for (mut args, stdin) in cases {
        args.extend(target);
        assert_usage_error(&args, &[], stdin, &plane);
    }
    // `idem redrive` sends the service key to the route it is given: a
    // route it would send it to in clear, or a bound above the row cap, is
    // refused before any request.
    let route = format!("{url}/redrive");
    let redrive: Vec<Vec<&str>> = vec![
        vec!["redrive"],
        vec!["redrive", "--to", "not a url"],
        vec!["redrive", "--to", "http://example.com/functions/v1/webhooks/redrive"],
        vec!["redrive", "--to", "ftp://127.0.0.1/redrive"],
        vec!["redrive", "--to", &route, "--bound", "5000"],
        vec!["redrive", "--to", &route, "--bound", "0"],
        vec!["redrive", "--to", &route, "--every", "soon"],
        vec!["redrive", "--to", &route, "--align"],
    ];
    for mut args in redrive {
        args.extend(target);
        assert_usage_error(&args, &[], "", &plane);
    }
    // `idem console` serves the plane with the service key: on loopback
    // only unless told otherwise, never on every address, and its re-drive
    // routes are checked as `idem redrive --to` checks them; refused before
    // anything is served or sent.
    let console: Vec<Vec<&str>> = vec![
        vec!["console", "--listen", "192.0.2.10:0"],
        vec!["console", "--listen", "0.0.0.0:0", "--allow-non-loopback"],
        vec!["console", "--listen", "[::]:0", "--allow-non-loopback"],
        vec!["console", "--listen", "localhost"],
        vec!["console", "--route", "webhook.stripe"],
        vec!["console", "--route", "webhook.stripe=not a url"],
        vec!["console", "--route", "webhook.stripe=http://example.com/functions/v1/webhooks/redrive"],
        vec!["console", "--route", "a.b=https://x.example/r", "--route", "a.b=https://x.example/s"],
    ];
    for mut args in console {
        args.extend(target);
        assert_usage_error(&args, &[], "", &plane);
    }
}

/// What each subcommand's `--help` must name.
const PLANE_VARIABLES: &[&str] = &[
    "IDEM_POSTGREST_URL",
    "SUPABASE_URL",
    "IDEM_SERVICE_KEY",
    "SUPABASE_SECRET_KEY",
    "SUPABASE_SERVICE_ROLE_KEY",
    "IDEM_APIKEY",
    "IDEM_MAX_ROWS",
    "RUST_LOG",
];

fn assert_help_names(command: &str, variables: &[&str]) {
    let output = idem(&[command, "--help"], &[], "");
    let help = String::from_utf8_lossy(&output.stdout);
    assert_eq!(output.status.code(), Some(0), "idem {command} --help: {}", String::from_utf8_lossy(&output.stderr));
    for variable in variables {
        assert!(help.contains(variable), "idem {command} --help does not name {variable}:\n{help}");
    }
}

#[test]
fn the_help_of_every_remote_command_names_the_environment_it_reads() {
    for (command, _) in remote_commands() {
        assert_help_names(command, PLANE_VARIABLES);
    }
    assert_help_names("doctor", &["IDEM_WEBHOOK_BODY_LIMIT_BYTES", "IDEM_WEBHOOK_SCOPE"]);
}

#[test]
fn a_webhook_body_limit_that_is_not_a_number_exits_2_before_any_request() {
    let plane = Silent::new();
    let url = plane.url();
    let target = ["doctor", "--url", url.as_str(), "--service-key", SERVICE_JWT];
    assert_usage_error(&target, &[("IDEM_WEBHOOK_BODY_LIMIT_BYTES", "256k")], "", &plane);
    let flagged: Vec<&str> = target.iter().copied().chain(["--webhook-body-limit", "-1"]).collect();
    assert_usage_error(&flagged, &[], "", &plane);
}

#[cfg(feature = "local")]
mod local {
    use super::*;

    #[test]
    fn the_help_of_every_local_command_names_the_environment_it_reads() {
        for command in ["up", "demo", "bench"] {
            assert_help_names(command, &["DATABASE_URL", "PGSSLMODE", "IDEM_LAYOUT", "RUST_LOG"]);
        }
        // `demo --remote` acts on a deployment, named as the remote commands are.
        assert_help_names("demo", PLANE_VARIABLES);
    }

    #[test]
    fn a_local_command_with_an_unusable_configuration_exits_2() {
        let plane = Silent::new();
        let not_a_url = [("DATABASE_URL", "not a url")];
        for args in [
            &["up"][..],
            &["demo"],
            &["bench"],
            &["demo", "--remote"],
            &["bench", "--workers", "x"],
            &["up", "--no-such-flag"],
        ] {
            assert_usage_error(args, &not_a_url, "", &plane);
        }
        let unknown_layout = [("IDEM_LAYOUT", "sharded")];
        for args in [&["up"][..], &["demo"], &["bench"]] {
            assert_usage_error(args, &unknown_layout, "", &plane);
        }
    }
}
