//! The README's SQL surface table lists exactly the functions the crate
//! knows as the surface (`repo::SQL_SURFACE`), with their argument names in
//! order. (`stack::surface` checks the same list against the migrations on a
//! real database; `idem doctor` checks it against a deployment.)

use idempotency_plane::repo::SQL_SURFACE;

/// `(name, argument names)` of each row of the README's SQL surface table.
fn readme_rows() -> Vec<(String, Vec<String>)> {
    let readme = include_str!("../../../README.md");
    let section = readme.split("## The SQL surface").nth(1).expect("the README has a SQL surface section");
    let table = section.split("\n## ").next().unwrap_or(section);
    table
        .lines()
        .filter_map(|line| line.strip_prefix("| `"))
        .filter_map(|row| {
            let signature = row.split('`').next()?;
            let (name, arguments) = signature.split_once('(')?;
            let names = arguments
                .trim_end_matches(')')
                .split(", ")
                .map(|argument| argument.trim_end_matches('?').to_owned())
                .filter(|argument| !argument.is_empty() && argument != "…same…")
                .collect();
            Some((name.to_owned(), names))
        })
        .collect()
}

#[test]
fn the_readme_lists_every_function_of_the_sql_surface_and_no_other() {
    let rows = readme_rows();
    let mut listed: Vec<&str> = rows.iter().map(|(name, _)| name.as_str()).collect();
    let mut surface: Vec<&str> = SQL_SURFACE.iter().map(|f| f.name).collect();
    listed.sort_unstable();
    surface.sort_unstable();
    assert_eq!(listed, surface);
    for (name, arguments) in &rows {
        let function = SQL_SURFACE.iter().find(|f| f.name == name).expect("listed");
        if !arguments.is_empty() {
            let expected: Vec<&str> = function.argument_names().collect();
            assert_eq!(arguments, &expected, "the README's arguments of {name}");
        }
    }
}

/// The README's migration that adds a scope (under "A scope of your own")
/// applies, and a claim in that scope is then taken, with its retention.
#[cfg(feature = "local")]
#[tokio::test]
async fn the_readme_migration_that_adds_a_scope_applies_and_the_scope_claims() {
    let readme = include_str!("../../../README.md");
    let after = readme.split("**A scope of your own**").nth(1).expect("the README shows a scope migration");
    let sql = after.split("```sql\n").nth(1).and_then(|block| block.split("```").next()).expect("an sql block");
    let stack = crate::support::harness::stack().await;
    let service = stack.service().expect("service");
    let org = uuid::Uuid::new_v4();
    let hash = idempotency_plane::RequestHash::of_json(&serde_json::json!({"invoice": "in_1"}));
    let before = service.claim(org, "billing.invoice.send", "inv_1", &hash, std::time::Duration::from_secs(30)).await;
    // No policy row covers the scope before the migration: refused, nothing written.
    assert!(matches!(before, Err(idempotency_plane::Error::UnknownScope { .. })), "{before:?}");
    sqlx::raw_sql(sqlx::AssertSqlSafe(sql)).execute(stack.db()).await.expect("the README's migration applies");
    sqlx::raw_sql(sqlx::AssertSqlSafe(sql)).execute(stack.db()).await.expect("and applies again (on conflict)");
    let claimed = service.claim(org, "billing.invoice.send", "inv_2", &hash, std::time::Duration::from_secs(30)).await;
    assert!(matches!(claimed, Ok(idempotency_plane::ClaimOutcome::Claimed(_))), "{claimed:?}");
    let retained: f64 = sqlx::query_scalar(
        "select extract(epoch from retain_until - claimed_at)::float8 from agent.idempotency_keys where key = 'inv_2'",
    )
    .fetch_one(stack.db())
    .await
    .expect("the row");
    // 7 days, counted from the claim or from its 30 s lease's end.
    assert!((7.0 * 86_400.0..7.0 * 86_400.0 + 35.0).contains(&retained), "retained {retained} s");
    stack.stop().await.expect("stop");
}

/// The README stays a front page: at most 400 lines, the detail in docs/.
#[test]
fn the_readme_stays_at_most_400_lines() {
    let lines = include_str!("../../../README.md").lines().count();
    assert!(lines <= 400, "the README has {lines} lines: move detail to docs/");
}

/// Every problem type's URI lands on its slug: the README (the page the
/// `type` URIs name) holds an anchor `idempotency-key-problems-<slug>` for
/// each type of the catalogue, so a link from a problem body scrolls to it.
#[cfg(feature = "axum")]
#[test]
fn every_problem_type_uri_has_its_anchor_in_the_readme() {
    use idempotency_plane::callers::idempotency_key::ProblemType;
    let readme = include_str!("../../../README.md");
    for problem in ProblemType::ALL {
        let anchor = format!("<a id=\"idempotency-key-problems-{}\"></a>", problem.slug());
        assert_eq!(readme.matches(&anchor).count(), 1, "the README holds {anchor} once");
    }
}
