//! Security, checked the way Supabase's database linter would, and over HTTP
//! for every function: only the service role reaches the plane, and no
//! secret leaks through Debug or errors.

use idempotency_plane::postgrest::{ClientConfig, ClientError, PostgrestClient, Repeat};
use idempotency_plane::{IdempotencyService, PostgrestRepository};
use serde_json::{json, Map, Value};
use sqlx::AssertSqlSafe;

use crate::support::harness::*;

/// Rows a linter query finds; every one of them is a finding.
async fn findings(stack: &idempotency_plane::local::LocalStack, query: &'static str) -> Vec<String> {
    sqlx::query_scalar(query).fetch_all(stack.db()).await.unwrap_or_else(|e| panic!("{query}: {e}"))
}

#[tokio::test]
async fn the_schema_passes_the_linter_checks() {
    let stack = stack().await;
    let checks: [(&str, &'static str); 9] = [
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
            // The functions are the only way in: each runs as the plane's
            // owner. The internal helpers run only inside those; the surface
            // report answers its caller's own privileges; the event trigger
            // function is called by no one.
            "a function in agent that does not run as idempotency_owner",
            "select p.proname::text from pg_proc p
              where p.pronamespace = 'agent'::regnamespace
                and p.proname not in ('idempotency_decide', 'idempotency_policy', 'idempotency_claim_of',
                                      'idempotency_json_size', 'idempotency_check_key',
                                      'idempotency_surface', 'idempotency_private_functions',
                                      'idempotency_failures_scope', 'idempotency_check_batch',
                                      'idempotency_check_item', 'idempotency_item_text', 'idempotency_item_uuid',
                                      'idempotency_check_work', 'idempotency_json_number', 'idempotency_utf16_order',
                                      'idempotency_canonical_json', 'idempotency_request_hash',
                                      'idempotency_queue_check', 'idempotency_queue_letter', 'idempotency_queue_items',
                                      'idempotency_queue_lock', 'idempotency_queue_privileges',
                                      'idempotency_check_traceparent', 'idempotency_count_replays', 'idempotency_trim_replays',
                                      'idempotency_version')
                and not (p.prosecdef and p.proowner = 'idempotency_owner'::regrole)",
        ),
        (
            "a table or type in agent not owned by idempotency_owner",
            "select t.typname::text from pg_type t
              where t.typnamespace = 'agent'::regnamespace and t.typtype = 'c'
                and t.typowner <> 'idempotency_owner'::regrole",
        ),
        (
            "a table privilege in agent held by an API role or PUBLIC",
            "select g.grantee || ' ' || g.privilege_type || ' on ' || g.table_name
               from information_schema.role_table_grants g
              where g.table_schema = 'agent' and g.grantee in ('anon', 'authenticated', 'service_role', 'PUBLIC')
                and not (g.table_name in ('idempotency_rows', 'idempotency_work')
                         and g.grantee = 'service_role' and g.privilege_type = 'SELECT')",
        ),
        (
            "an internal helper executable by an API role",
            "select p.proname || ' by ' || r.rolname from pg_proc p
               cross join (select rolname from pg_roles where rolname in ('anon', 'authenticated', 'service_role')) r
              where p.pronamespace = 'agent'::regnamespace
                and p.proname in ('idempotency_decide', 'idempotency_policy', 'idempotency_claim_of',
                                  'idempotency_json_size', 'idempotency_check_key', 'idempotency_private_functions',
                                  'idempotency_json_number', 'idempotency_utf16_order', 'idempotency_canonical_json',
                                  'idempotency_queue_check', 'idempotency_queue_letter', 'idempotency_queue_items',
                                  'idempotency_queue_lock', 'idempotency_queue_privileges')
                and has_function_privilege(r.rolname, p.oid, 'execute')",
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
            // The bounded reads answer the table's rows as rows of the view:
            // every column but the work a claim carries, the audit of
            // failures sent back to re-drive and the trace it came from
            // (handed out with the work alone), in order.
            "agent.idempotency_rows without exactly the columns of agent.idempotency_keys but the work, in order",
            "select 'columns differ' where
               (select string_agg(a.attname || ' ' || a.atttypid::regtype, ', ' order by a.attnum) from pg_attribute a
                 where a.attrelid = 'agent.idempotency_keys'::regclass and a.attnum > 0 and not a.attisdropped
                   and a.attname not in ('request', 'redrive_at', 'replaced', 'dead_lettered_at', 'traceparent'))
               is distinct from
               (select string_agg(a.attname || ' ' || a.atttypid::regtype, ', ' order by a.attnum) from pg_attribute a
                 where a.attrelid = 'agent.idempotency_rows'::regclass and a.attnum > 0 and not a.attisdropped)",
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
            "uuid[]" | "bigint[]" => json!([]),
            "bigint" | "integer" | "numeric" => json!(1000),
            "boolean" => json!(false),
            "jsonb" => json!({}),
            _ => json!("x"),
        };
        args.insert(name.to_owned(), value);
    }
    Value::Object(args)
}

/// Helpers the plane's functions call, executable by their owner alone;
/// [`internal_helpers_are_refused_to_every_api_role_over_http_and_in_sql`]
/// calls them.
const INTERNAL_HELPERS: &[&str] = &[
    "idempotency_claim_of",
    "idempotency_policy",
    "idempotency_decide",
    "idempotency_json_size",
    "idempotency_check_key",
    "idempotency_private_functions",
    "idempotency_json_number",
    "idempotency_utf16_order",
    "idempotency_canonical_json",
    "idempotency_queue_check",
    "idempotency_queue_letter",
    "idempotency_queue_items",
    "idempotency_queue_lock",
    "idempotency_queue_privileges",
];

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

/// Whether `role` may execute `function`, by the catalog and by calling it.
async fn executable_by(conn: &mut sqlx::PgConnection, role: &str, function: &str) -> (bool, bool) {
    let granted: bool = sqlx::query_scalar("select has_function_privilege($1, $2, 'execute')")
        .bind(role)
        .bind(function)
        .fetch_one(&mut *conn)
        .await
        .expect("the catalog");
    sqlx::query("savepoint call").execute(&mut *conn).await.expect("savepoint");
    sqlx::query(AssertSqlSafe(format!("set local role {role}"))).execute(&mut *conn).await.expect("set role");
    let called = sqlx::query(AssertSqlSafe(format!("select {function}"))).execute(&mut *conn).await.is_ok();
    sqlx::query("rollback to savepoint call").execute(&mut *conn).await.expect("rollback to savepoint");
    (granted, called)
}

#[tokio::test]
async fn a_function_created_later_in_schema_agent_by_the_migrating_role_or_another_is_executable_by_its_owner_alone() {
    let mut stack = stack().await;
    // Arrange: one function created by the role that ran the migrations
    // (postgres, here and on Supabase), and one by another role, named
    // supabase_admin as the role Supabase's own tooling creates objects
    // with. It exists for this transaction only, and is no superuser: on
    // Supabase, where supabase_admin is one, supautils skips event
    // triggers for it, and the missing USAGE on schema agent is what keeps
    // anon and authenticated away from such a function.
    let mut conn = stack.db().acquire().await.expect("a connection");
    sqlx::query("create function agent.added_later() returns integer language sql as 'select 1'")
        .execute(&mut *conn)
        .await
        .expect("create a function as postgres");
    sqlx::query("begin").execute(&mut *conn).await.unwrap();
    sqlx::raw_sql(
        "do $$ begin
           if not exists (select 1 from pg_roles where rolname = 'supabase_admin') then
             create role supabase_admin nologin;
           end if;
         end $$;
         grant usage, create on schema agent to supabase_admin;
         set local role supabase_admin;
         create function agent.added_by_admin() returns integer language sql as 'select 2';
         create procedure agent.added_by_admin_proc() language sql as 'select 3';
         reset role;",
    )
    .execute(&mut *conn)
    .await
    .expect("create functions as supabase_admin");

    // Assert: by the catalog and by calling, nobody but the owner executes them.
    let mut seen = Vec::new();
    for function in ["agent.added_later()", "agent.added_by_admin()"] {
        for role in ["anon", "authenticated", "service_role", "authenticator"] {
            seen.push((function, role, executable_by(&mut conn, role, function).await));
        }
    }
    let public: Vec<String> = sqlx::query_scalar(
        "select p.proname::text from pg_proc p, aclexplode(coalesce(p.proacl, acldefault('f', p.proowner))) a
          where p.pronamespace = 'agent'::regnamespace and a.grantee = 0
            and p.proname in ('added_later', 'added_by_admin', 'added_by_admin_proc')",
    )
    .fetch_all(&mut *conn)
    .await
    .unwrap();
    let owners: (bool, bool) = sqlx::query_as(
        "select has_function_privilege('postgres', 'agent.added_later()', 'execute'),
                has_function_privilege('supabase_admin', 'agent.added_by_admin()', 'execute')",
    )
    .fetch_one(&mut *conn)
    .await
    .unwrap();
    sqlx::query("rollback").execute(&mut *conn).await.unwrap();
    drop(conn);
    for (function, role, executable) in &seen {
        assert_eq!(*executable, (false, false), "{function} executable by {role} (catalog, call)");
    }
    assert!(public.is_empty(), "executable by PUBLIC: {public:?}");
    assert_eq!(owners, (true, true), "each owner executes its own");

    // And over HTTP the service role is refused the one that stayed.
    stack.restart_server().await.expect("reload the schema cache");
    let refused = client(&stack).rpc::<Value>("added_later", &json!({}), Repeat::Safe).await;
    assert_eq!(refused.as_ref().err().and_then(ClientError::code), Some("42501"), "{refused:?}");
    stack.stop().await.unwrap();
}

/// The plane's tables, and the views of the claim table that the bounded
/// reads and the re-drive answer rows of (which the service role may name,
/// not read through).
const TABLES: [&str; 6] =
    ["idempotency_keys", "idempotency_scopes", "runs", "provider_jobs", "idempotency_rows", "idempotency_work"];

/// The roles PostgREST switches to.
const API_ROLES: [&str; 3] = ["anon", "authenticated", "service_role"];

/// A completed claim written by a superuser, to see that nothing changes it.
async fn a_stored_answer(stack: &idempotency_plane::local::LocalStack) -> Value {
    sqlx::query(
        "insert into agent.idempotency_keys
           (organization_id, scope, key, request_hash, status, lease_token, response,
            lease_expires_at, retain_until)
         values (gen_random_uuid(), 'tool.x', 'k2', repeat('a', 64), 'completed', gen_random_uuid(),
                 '{\"charged\": 1}', now(), now() + interval '30 days')",
    )
    .execute(stack.db())
    .await
    .expect("a stored answer");
    stored(stack).await
}

async fn stored(stack: &idempotency_plane::local::LocalStack) -> Value {
    sqlx::query_scalar("select jsonb_agg(to_jsonb(k) order by k.id) from agent.idempotency_keys k")
        .fetch_one(stack.db())
        .await
        .expect("the table")
}

#[tokio::test]
async fn every_table_endpoint_answers_4xx_to_every_api_role_and_changes_nothing() {
    let stack = stack().await;
    let before = a_stored_answer(&stack).await;
    let http = reqwest::Client::new();
    let org = uuid::Uuid::new_v4();
    let forged = json!({
        "organization_id": org, "scope": "tool.x", "key": "forged", "request_hash": "b".repeat(64),
        "status": "completed", "lease_token": uuid::Uuid::new_v4(), "response": {"forged": true},
        "lease_expires_at": "2000-01-01T00:00:00Z", "retain_until": "2000-01-01T00:00:00Z"
    });
    let mut answered = Vec::new();
    for role in API_ROLES {
        let token = stack.token_for(role);
        for table in TABLES {
            let url = format!("{}/{table}", stack.url());
            let filtered = format!("{url}?key=eq.k2");
            let requests = [
                ("GET", http.get(&url).header("accept-profile", "agent")),
                ("POST", http.post(&url).header("content-profile", "agent").json(&forged)),
                ("PATCH", http.patch(&filtered).header("content-profile", "agent").json(&json!({"response": {}}))),
                ("DELETE", http.delete(&filtered).header("content-profile", "agent")),
            ];
            for (method, request) in requests {
                let response = request.bearer_auth(&token).send().await.expect("an answer");
                let status = response.status().as_u16();
                let body: Value = response.json().await.unwrap_or(Value::Null);
                answered.push((role, method, table, status, body["code"].as_str().map(str::to_owned)));
            }
        }
    }
    // 42501: PostgreSQL refused the privilege. PGRST205: the server offers
    // no such endpoint to the role (the embedded server lists a relation
    // only to roles that hold something on it; PostgREST lists it and
    // PostgreSQL refuses). Both mean there is no way in.
    for (role, method, table, status, code) in &answered {
        assert!((400..500).contains(status), "{role} {method} /{table}: {status} {code:?}");
        assert!(matches!(code.as_deref(), Some("42501" | "PGRST205")), "{role} {method} /{table}: {status} {code:?}");
    }
    let refused_by_postgres = answered.iter().filter(|(_, _, _, _, code)| code.as_deref() == Some("42501")).count();
    assert!(refused_by_postgres > 0, "some request reached PostgreSQL and was refused there: {answered:?}");
    assert_eq!(stored(&stack).await, before, "nothing read or written around the functions");
    stack.stop().await.unwrap();
}

#[tokio::test]
async fn every_api_role_is_refused_every_statement_on_the_tables_in_sql() {
    let stack = stack().await;
    let before = a_stored_answer(&stack).await;
    let mut conn = stack.db().acquire().await.expect("a connection");
    let mut allowed = Vec::new();
    for role in API_ROLES {
        for table in TABLES {
            let column = match table {
                "idempotency_scopes" => "retain",
                "idempotency_rows" | "idempotency_work" => "key",
                _ => "organization_id",
            };
            for statement in [
                format!("select * from agent.{table}"),
                format!("insert into agent.{table} default values"),
                format!("update agent.{table} set {column} = {column}"),
                format!("delete from agent.{table}"),
            ] {
                sqlx::query("begin").execute(&mut *conn).await.unwrap();
                sqlx::query(AssertSqlSafe(format!("set local role {role}"))).execute(&mut *conn).await.unwrap();
                let result = sqlx::query(AssertSqlSafe(statement.clone())).execute(&mut *conn).await;
                sqlx::query("rollback").execute(&mut *conn).await.unwrap();
                let code =
                    result.err().and_then(|e| e.as_database_error().and_then(|d| d.code().map(|c| c.into_owned())));
                if code.as_deref() != Some("42501") {
                    allowed.push(format!("{role}: {statement} -> {code:?}"));
                }
            }
        }
    }
    drop(conn);
    assert!(allowed.is_empty(), "not refused for lack of privilege: {allowed:#?}");
    assert_eq!(stored(&stack).await, before);
    stack.stop().await.unwrap();
}

#[tokio::test]
async fn internal_helpers_are_refused_to_every_api_role_over_http_and_in_sql() {
    let stack = stack().await;
    let org = uuid::Uuid::new_v4();
    // The decision itself, with the NULL hash that once skipped the hash check.
    let decide = json!({
        "p_organization_id": org, "p_scope": "tool.x", "p_key": "k", "p_request_hash": "a".repeat(64),
        "p_lease_token": uuid::Uuid::new_v4(), "p_lease_ms": 60000, "p_retain_ms": 60000,
        "p_may_insert": true, "p_may_take_over": true
    });
    let calls = [
        ("idempotency_decide", decide),
        ("idempotency_policy", json!({"p_scope": "tool.x"})),
        ("idempotency_json_size", json!({"p_value": {}})),
        ("idempotency_check_key", json!({"p_organization_id": org, "p_scope": "tool.x", "p_key": "k"})),
    ];
    for role in API_ROLES {
        let client = PostgrestClient::new(ClientConfig::new(stack.url(), stack.token_for(role)).unwrap()).unwrap();
        for (function, args) in &calls {
            let refused = client.rpc::<Value>(function, args, Repeat::Unsafe).await;
            assert_eq!(
                refused.as_ref().err().and_then(ClientError::code),
                Some("42501"),
                "{role} {function}: {refused:?}"
            );
        }
    }
    let mut conn = stack.db().acquire().await.expect("a connection");
    let mut allowed = Vec::new();
    for role in API_ROLES {
        for call in [
            "select * from agent.idempotency_decide(gen_random_uuid(), 'tool.x', 'k', null, gen_random_uuid(), 60000, null, false, false)",
            "select * from agent.idempotency_policy('tool.x')",
            "select agent.idempotency_json_size('{}')",
            "select agent.idempotency_check_key(gen_random_uuid(), 'tool.x', 'k')",
            "select agent.idempotency_claim_of(k) from agent.idempotency_keys k",
        ] {
            sqlx::query("begin").execute(&mut *conn).await.unwrap();
            sqlx::query(AssertSqlSafe(format!("set local role {role}"))).execute(&mut *conn).await.unwrap();
            let result = sqlx::query(call).execute(&mut *conn).await;
            sqlx::query("rollback").execute(&mut *conn).await.unwrap();
            let code = result.err().and_then(|e| e.as_database_error().and_then(|d| d.code().map(|c| c.into_owned())));
            if code.as_deref() != Some("42501") {
                allowed.push(format!("{role}: {call} -> {code:?}"));
            }
        }
    }
    drop(conn);
    assert!(allowed.is_empty(), "{allowed:#?}");
    assert_eq!(count_rows(&stack).await, 0);
    stack.stop().await.unwrap();
}

/// The migrations as Supabase applies them: as `postgres` there, a role with
/// CREATEROLE that is not a superuser. Here a role of that kind, made for
/// this test, migrates a database of its own.
#[tokio::test]
async fn the_migrations_apply_as_a_createrole_role_that_is_no_superuser_and_hand_everything_to_the_owner() {
    use sqlx::{Connection, Executor};
    let admin_url = url::Url::parse(&idempotency_plane::local::LocalStackConfig::default().database_url).unwrap();
    let mut admin = sqlx::PgConnection::connect(admin_url.as_str()).await.expect("the maintenance database");
    let suffix = format!("{:016x}", rand::random::<u64>());
    let (role, database) = (format!("idem_migrator_{suffix}"), format!("idem_migrate_{suffix}"));
    // Both names are ours: letters, digits and '_'.
    admin.execute(AssertSqlSafe(format!("create role {role} login createrole nosuperuser"))).await.unwrap();
    admin.execute(AssertSqlSafe(format!("create database {database} owner {role}"))).await.unwrap();
    let version: i32 =
        sqlx::query_scalar("select current_setting('server_version_num')::int").fetch_one(&mut admin).await.unwrap();
    if version >= 160_000 {
        // On Supabase the migrating role created the owner role, and from
        // PostgreSQL 16 a creator holds what it created with ADMIN only, no
        // INHERIT or SET. Roles are the cluster's, and this cluster's owner
        // role may have been created by another test's superuser: give this
        // migrator a creator's membership, no more.
        admin
            .execute(AssertSqlSafe(format!(
                "do $$ begin create role idempotency_owner nologin noinherit;
                 exception when duplicate_object then null; end $$;
                 grant idempotency_owner to {role} with admin true, inherit false, set false"
            )))
            .await
            .unwrap();
    }
    let mut migrator_url = admin_url.clone();
    migrator_url.set_username(&role).unwrap();
    migrator_url.set_password(None).unwrap();
    migrator_url.set_path(&format!("/{database}"));
    let mut applied = Vec::new();
    match sqlx::PgConnection::connect(migrator_url.as_str()).await {
        Ok(mut migrator) => {
            for (file, sql) in idempotency_plane::migrations::MIGRATIONS {
                let result = sqlx::raw_sql(*sql).execute(&mut migrator).await;
                applied.push((*file, result.err().map(|e| e.to_string())));
            }
            let _ = migrator.close().await;
        }
        Err(error) => applied.push(("(connect)", Some(error.to_string()))),
    }
    let mut db_url = admin_url.clone();
    db_url.set_path(&format!("/{database}"));
    let owners: Result<Vec<(String, String)>, sqlx::Error> = async {
        let mut db = sqlx::PgConnection::connect(db_url.as_str()).await?;
        let owners = sqlx::query_as(
            "select c.relname::text, c.relowner::regrole::text from pg_class c
              where c.relnamespace = 'agent'::regnamespace and c.relkind in ('r', 'v') order by 1",
        )
        .fetch_all(&mut db)
        .await?;
        // And the plane works: a claim as the service role.
        sqlx::raw_sql(
            "begin; set local role service_role;
             select * from agent.idempotency_claim(gen_random_uuid(), 'tool.x', 'k', repeat('a', 64), gen_random_uuid(), 60000);
             commit;",
        )
        .execute(&mut db)
        .await?;
        let _ = db.close().await;
        Ok(owners)
    }
    .await;

    // What the migrations left the migrator: the owner's privileges
    // (INHERIT) and, from PostgreSQL 16, the right to hand objects to it
    // (SET), which the roles migration asks for there.
    let (usage, set): (bool, bool) = sqlx::query_as(AssertSqlSafe(format!(
        "select pg_has_role('{role}', 'idempotency_owner', 'usage'),
                case when current_setting('server_version_num')::int >= 160000
                     then pg_has_role('{role}', 'idempotency_owner', 'set') else true end"
    )))
    .fetch_one(&mut admin)
    .await
    .unwrap();
    admin.execute(AssertSqlSafe(format!("drop database if exists {database} with (force)"))).await.unwrap();
    admin.execute(AssertSqlSafe(format!("drop role if exists {role}"))).await.unwrap();
    assert!(
        usage && set,
        "the migrator holds the owner role with INHERIT and SET (PostgreSQL {version}): {usage} {set}"
    );
    for (file, error) in &applied {
        assert_eq!(error, &None, "{file} as a CREATEROLE role");
    }
    assert_eq!(applied.len(), idempotency_plane::migrations::MIGRATIONS.len());
    let owners = owners.expect("the migrated database");
    assert!(owners.len() == 9 && owners.iter().all(|(_, owner)| owner == "idempotency_owner"), "{owners:?}");
}

/// One RPC as curl or an Edge Function calls it, with the service key: the
/// rows it answers, as JSON.
async fn rpc_rows(stack: &idempotency_plane::local::LocalStack, function: &str, args: Value) -> Vec<Value> {
    let answer = reqwest::Client::new()
        .post(format!("{}/rpc/{function}", stack.url()))
        .bearer_auth(stack.service_key())
        .header("Content-Profile", "agent")
        .header("Accept-Profile", "agent")
        .json(&args)
        .send()
        .await
        .expect("the server answers");
    assert!(answer.status().is_success(), "{function}: {}", answer.status());
    match answer.json::<Value>().await.expect("JSON") {
        Value::Array(rows) => rows,
        other => panic!("{function}: not a set of rows: {other}"),
    }
}

/// The lease token is the fence: whoever presents it may record any ending.
/// Only its holder receives it (the claim, the claim repeated with the same
/// token, its own completion); every read answers it as null, whoever asks,
/// over HTTP and in SQL, on either layout (CI runs this file on both).
#[tokio::test]
async fn a_lease_token_is_answered_to_its_holder_alone_and_never_by_a_read() {
    let stack = stack().await;
    let org = org();
    let token = uuid::Uuid::new_v4();
    let claim_args = json!({
        "p_organization_id": org, "p_scope": "tool.email.send", "p_key": "secret-fence",
        "p_request_hash": hash("x").as_str(), "p_lease_token": token, "p_lease_ms": 60_000,
    });
    let claimed = rpc_rows(&stack, "idempotency_claim", claim_args.clone()).await;
    assert_eq!(
        (claimed[0]["outcome"].as_str(), claimed[0]["lease_token"].as_str()),
        (Some("claimed"), Some(&*token.to_string()))
    );
    let repeated = rpc_rows(&stack, "idempotency_claim", claim_args.clone()).await;
    assert_eq!(repeated[0]["lease_token"], token.to_string(), "the holder's repeat after a lost answer");
    let mut other = claim_args.clone();
    other["p_lease_token"] = json!(uuid::Uuid::new_v4());
    let processing = rpc_rows(&stack, "idempotency_claim", other).await;
    assert_eq!((processing[0]["outcome"].as_str(), &processing[0]["lease_token"]), (Some("processing"), &Value::Null));

    // The read, over HTTP: held (lease_live), but no token.
    let get_args = json!({"p_organization_id": org, "p_scope": "tool.email.send", "p_key": "secret-fence"});
    let read = rpc_rows(&stack, "idempotency_get", get_args.clone()).await;
    assert_eq!(read.len(), 1);
    assert_eq!((&read[0]["lease_token"], read[0]["lease_live"].as_bool()), (&Value::Null, Some(true)), "{}", read[0]);
    assert!(!read[0].to_string().contains(&token.to_string()));

    // In SQL, as the service role and as the table's owner's caller alike.
    let mut conn = stack.db().acquire().await.unwrap();
    for role in ["service_role", "postgres"] {
        sqlx::query("begin").execute(&mut *conn).await.unwrap();
        if role != "postgres" {
            sqlx::query(AssertSqlSafe(format!("set local role {role}"))).execute(&mut *conn).await.unwrap();
        }
        let (held, shown): (bool, Option<uuid::Uuid>) = sqlx::query_as(
            "select lease_live, lease_token from agent.idempotency_get($1, 'tool.email.send', 'secret-fence')",
        )
        .bind(org)
        .fetch_one(&mut *conn)
        .await
        .unwrap();
        sqlx::query("rollback").execute(&mut *conn).await.unwrap();
        assert_eq!((held, shown), (true, None), "{role}");
    }

    // The sweeper's bounded read: a processing row past retention (its
    // worker long gone) answers no token either, so nobody can complete it
    // before the sweep deletes it.
    sqlx::query(
        "update agent.idempotency_keys
            set claimed_at = now() - interval '40 days', lease_expires_at = now() - interval '40 days',
                retain_until = now() - interval '1 day'
          where organization_id = $1",
    )
    .bind(org)
    .execute(stack.db())
    .await
    .unwrap();
    let expired = rpc_rows(&stack, "idempotency_expired", json!({"p_limit": 10})).await;
    let ours: Vec<&Value> = expired.iter().filter(|row| row["organization_id"] == org.to_string()).collect();
    assert_eq!(ours.len(), 1, "{expired:?}");
    assert_eq!((ours[0]["status"].as_str(), &ours[0]["lease_token"]), (Some("processing"), &Value::Null));
    drop(conn);
    stack.stop().await.unwrap();
}
