//! The `idem` binary, run as a user runs it.

use std::process::Command;

#[test]
fn idem_demo_runs_every_effect_exactly_once_and_exits_zero() {
    let output = Command::new(env!("CARGO_BIN_EXE_idem"))
        .args(["demo", "--workers", "8", "--keys", "12", "--calls-per-key", "3"])
        .env_remove("IDEM_POSTGREST_URL")
        .env_remove("SUPABASE_URL")
        .output()
        .expect("run idem demo");
    let stdout = String::from_utf8_lossy(&output.stdout);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(output.status.success(), "idem demo failed ({:?}):\n{stdout}\n{stderr}", output.status.code());
    assert!(stdout.contains("every effect happened exactly once"), "{stdout}");
    assert!(stdout.contains("LeaseMovedOn"), "the stalled worker was fenced off: {stdout}");
    assert!(!stdout.lines().any(|l| l.trim_start().starts_with("FAIL")), "{stdout}");
}
