//! Which PostgreSQL the suite runs on. CI runs it on the shared cluster (15)
//! and again on a cluster of PostgreSQL 17 (`.ci/with-postgres-17.sh`, which
//! sets `IDEM_EXPECT_PG_MAJOR`): a run meant for one major version fails on
//! another, so a wrong `DATABASE_URL` cannot pass for it.

use crate::support::harness::*;

#[tokio::test]
async fn the_suite_runs_on_the_major_version_it_was_meant_for() {
    let stack = stack().await;
    let version: i32 = sqlx::query_scalar("select current_setting('server_version_num')::int")
        .fetch_one(stack.db())
        .await
        .expect("the server's version");
    println!("PostgreSQL {version}");
    assert!(version >= 150_000, "the plane needs PostgreSQL 15 or later, got {version}");
    if let Ok(major) = std::env::var("IDEM_EXPECT_PG_MAJOR") {
        let major: i32 = major.parse().expect("IDEM_EXPECT_PG_MAJOR is a major version number");
        assert_eq!(version / 10_000, major, "this run is meant for PostgreSQL {major}");
    }
    stack.stop().await.expect("stopped");
}
