//! Security, checked the way Supabase's database linter would, and over HTTP
//! for every function: only the service role reaches the plane, and no
//! secret leaks through Debug or errors.

use idempotency_plane::postgrest::{ClientConfig, ClientError, PostgrestClient, Repeat};
use idempotency_plane::{IdempotencyService, PostgrestRepository};
use serde_json::{json, Map, Value};

use crate::harness::*;

/// Rows a linter query finds; every one of them is a finding.
async fn findings(stack: &idempotency_plane::local::LocalStack, query: &'static str) -> Vec<String> {
    sqlx::query_scalar(query).fetch_all(stack.db()).await.unwrap_or_else(|e| panic!("{query}: {e}"))
}

#[tokio::test]
async fn the_schema_passes_the_linter_checks() {
    let stack = stack().await;
    let checks: [(&str, &'static str); 6] = [
        (
            "a table in agent without row level security",
            "select c.relname::text from pg_class c
              where c.relnamespace = 'agent'::regnamespace and c.relkind in ('r', 'p') and not c.relrowsecurity",
        ),
        (
            "a function in agent without a pinned, empty search_path",
            "select p.proname::text from pg_proc p
              where p.pronamespace = 'agent'::regnamespace
                and not coalesce(p.proconfig, '{}') @> array['search_path=\"\"']",
        ),
        (
            // None has a reason to be one: every function runs as its caller.
            "a SECURITY DEFINER function in agent",
            "select p.proname::text from pg_proc p where p.pronamespace = 'agent'::regnamespace and p.prosecdef",
        ),
        (
            "a table privilege in agent held by anon, authenticated or PUBLIC",
            "select g.grantee || ' ' || g.privilege_type || ' on ' || g.table_name
               from information_schema.role_table_grants g
              where g.table_schema = 'agent' and g.grantee in ('anon', 'authenticated', 'PUBLIC')",
        ),
        (
            "a function in agent executable by anon, authenticated or PUBLIC",
            "select p.proname || ' by ' || r.rolname from pg_proc p
               cross join (select rolname from pg_roles where rolname in ('anon', 'authenticated')) r
              where p.pronamespace = 'agent'::regnamespace and has_function_privilege(r.rolname, p.oid, 'execute')
             union all
             select p.proname || ' by PUBLIC' from pg_proc p, aclexplode(coalesce(p.proacl, acldefault('f', p.proowner))) a
              where p.pronamespace = 'agent'::regnamespace and a.grantee = 0 and a.privilege_type = 'EXECUTE'",
        ),
        (
            "schema agent usable by anon or authenticated",
            "select rolname::text from pg_roles
              where rolname in ('anon', 'authenticated') and has_schema_privilege(rolname, 'agent', 'usage')",
        ),
    ];
    for (finding, query) in checks {
        let found = findings(&stack, query).await;
        assert!(found.is_empty(), "{finding}: {found:?}");
    }
    stack.stop().await.unwrap();
}

/// Arguments of the right names and types, from the catalog's identity arguments.
fn arguments(identity: &str) -> Value {
    let mut args = Map::new();
    for argument in identity.split(", ").filter(|a| !a.is_empty()) {
        let (name, kind) = argument.split_once(' ').expect("name type");
        let value = match kind {
            "uuid" => json!("00000000-0000-0000-0000-000000000000"),
            "uuid[]" => json!([]),
            "bigint" | "integer" => json!(1000),
            "jsonb" => json!({}),
            _ => json!("x"),
        };
        args.insert(name.to_owned(), value);
    }
    Value::Object(args)
}

/// Helpers the plane's functions call, never called over HTTP (they take
/// composite rows or mode flags, or answer OUT parameters). The catalog check
/// above covers their privileges like every other function's.
const INTERNAL_HELPERS: &[&str] =
    &["idempotency_claim_of", "idempotency_policy", "idempotency_decide", "idempotency_json_size"];

#[tokio::test]
async fn every_function_refuses_anonymous_authenticated_and_wrong_secret_tokens() {
    let stack = stack().await;
    let surface: Vec<(String, String)> = sqlx::query_as(
        "select p.proname::text, pg_get_function_identity_arguments(p.oid) from pg_proc p
          where p.pronamespace = 'agent'::regnamespace
            and p.proname not in (select unnest($1::text[]))",
    )
    .bind(INTERNAL_HELPERS)
    .fetch_all(stack.db())
    .await
    .unwrap();
    assert!(surface.len() >= 13, "{surface:?}");
    let wrong_secret = idempotency_plane::local::mint_token(
        "not the server's secret",
        "service_role",
        std::time::Duration::from_secs(60),
    );
    let callers = [
        ("anon", stack.token_for("anon"), &[401u16][..], "42501"),
        // PostgREST answers 403 here, postrust-server 401; the code is the contract.
        ("authenticated", stack.token_for("authenticated"), &[401, 403][..], "42501"),
        ("wrong secret", wrong_secret, &[401][..], "PGRST301"),
    ];
    let before = count_rows(&stack).await;
    for (who, token, statuses, code) in &callers {
        let client = PostgrestClient::new(ClientConfig::new(stack.url(), token.clone()).unwrap()).unwrap();
        for (name, identity) in &surface {
            let function: &'static str = Box::leak(name.clone().into_boxed_str());
            let refused = client.rpc::<Value>(function, &arguments(identity), Repeat::Unsafe).await;
            match refused {
                Err(ClientError::Api { status, error, .. }) => {
                    assert!(statuses.contains(&status), "{who} calling {name}: status {status}");
                    assert_eq!(error.code, *code, "{who} calling {name}");
                }
                other => panic!("{who} calling {name}: expected a refusal, got {other:?}"),
            }
        }
    }
    assert_eq!(count_rows(&stack).await, before, "the refused calls wrote nothing");
    stack.stop().await.unwrap();
}

#[tokio::test]
async fn no_secret_appears_in_debug_output_or_errors() {
    let stack = stack().await;
    let key = stack.service_key().to_owned();
    let config = ClientConfig::new(stack.url(), key.clone()).unwrap().with_apikey(key.clone());
    let client = PostgrestClient::new(config.clone()).unwrap();
    let service = IdempotencyService::new(PostgrestRepository::new(client.clone()));
    for (what, printed) in [
        ("config", format!("{config:?}")),
        ("client", format!("{client:?}")),
        ("service", format!("{service:?}")),
        ("stack", format!("{stack:?}")),
    ] {
        assert!(!printed.contains(&key), "{what} Debug shows the key: {printed}");
    }
    // An error from a refused key names the refusal, never the key.
    let refused_key = idempotency_plane::local::mint_token("wrong", "service_role", std::time::Duration::from_secs(60));
    let refused = PostgrestClient::new(ClientConfig::new(stack.url(), refused_key.clone()).unwrap()).unwrap();
    let error = refused
        .rpc::<Value>("idempotency_get", &arguments("p_organization_id uuid, p_scope text, p_key text"), Repeat::Safe)
        .await
        .unwrap_err();
    for printed in [error.to_string(), format!("{error:?}")] {
        assert!(!printed.contains(&refused_key), "{printed}");
    }
    stack.stop().await.unwrap();
}

#[tokio::test]
async fn a_function_added_later_in_schema_agent_is_executable_by_nobody_but_its_owner() {
    // Arrange: a function created after the migrations, by the role that ran them.
    let mut stack = stack().await;
    sqlx::query("create function agent.added_later() returns integer language sql as 'select 1'")
        .execute(stack.db())
        .await
        .expect("create a function");
    // Assert: the catalog grants it to nobody but its owner.
    let executable: (bool, bool, bool, bool, bool) = sqlx::query_as(
        "select has_function_privilege('service_role', 'agent.added_later()', 'execute'),
                has_function_privilege('anon', 'agent.added_later()', 'execute'),
                has_function_privilege('authenticated', 'agent.added_later()', 'execute'),
                has_function_privilege('authenticator', 'agent.added_later()', 'execute'),
                has_function_privilege(current_user, 'agent.added_later()', 'execute')",
    )
    .fetch_one(stack.db())
    .await
    .unwrap();
    assert_eq!(executable, (false, false, false, false, true));
    // And over HTTP the service role is refused it.
    stack.restart_server().await.expect("reload the schema cache");
    let refused = client(&stack).rpc::<Value>("added_later", &json!({}), Repeat::Safe).await;
    assert_eq!(refused.as_ref().err().and_then(ClientError::code), Some("42501"), "{refused:?}");
    stack.stop().await.unwrap();
}

#[tokio::test]
async fn the_service_role_holds_only_the_table_privileges_the_functions_use() {
    let stack = stack().await;
    let privileges: Vec<String> = sqlx::query_scalar(
        "select g.table_name || ' ' || g.privilege_type
           from information_schema.role_table_grants g
          where g.table_schema = 'agent' and g.grantee = 'service_role'
          order by 1",
    )
    .fetch_all(stack.db())
    .await
    .unwrap();
    let expected = [
        "idempotency_keys DELETE",
        "idempotency_keys INSERT",
        "idempotency_keys SELECT",
        "idempotency_keys UPDATE",
        "idempotency_scopes SELECT",
        "provider_jobs INSERT",
        "provider_jobs SELECT",
        "runs INSERT",
        "runs SELECT",
    ];
    assert_eq!(privileges, expected);
    stack.stop().await.unwrap();
}
