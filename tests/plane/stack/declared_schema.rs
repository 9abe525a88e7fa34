//! `supabase/schemas/` declares what the plane is, one file per object;
//! `supabase/migrations/` is how a deployed database got there. One database
//! built from each must have the same catalog: every function with its body
//! and settings, every table, view, type, column, constraint, index, policy,
//! owner, grant, comment and event trigger, and the scopes the plane ships
//! with. So neither can change without the other. Roles are the cluster's,
//! not a database's: both databases see the same ones, so they are not
//! compared here.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

use sqlx::{AssertSqlSafe, Connection, Executor, PgConnection};

use idempotency_plane::migrations::MIGRATIONS;

/// What is compared, by name: one query each, answering one text per object.
/// Everything is rendered by PostgreSQL itself (`pg_get_functiondef`,
/// `pg_get_constraintdef`, ...), so two catalogs read alike when every
/// object of schema `agent`, its privileges and its shipped rows do.
const CATALOG: &[(&str, &str)] = &[
    (
        "schema",
        "select json_build_array(n.nspname, pg_get_userbyid(n.nspowner), n.nspacl::text,
                                 obj_description(n.oid, 'pg_namespace'))::text
           from pg_namespace n where n.nspname = 'agent'",
    ),
    (
        "functions",
        "select json_build_array(p.oid::regprocedure::text, pg_get_functiondef(p.oid),
                                 pg_get_userbyid(p.proowner), p.proacl::text, obj_description(p.oid, 'pg_proc'))::text
           from pg_proc p where p.pronamespace = 'agent'::regnamespace",
    ),
    (
        "relations",
        "select json_build_array(c.relname, c.relkind, pg_get_userbyid(c.relowner), c.relacl::text,
                                 c.relrowsecurity, c.relforcerowsecurity, c.reloptions::text, c.relpersistence,
                                 c.relreplident, obj_description(c.oid, 'pg_class'),
                                 case when c.relkind in ('v', 'm') then pg_get_viewdef(c.oid) end)::text
           from pg_class c where c.relnamespace = 'agent'::regnamespace",
    ),
    (
        // Columns by their place among the live ones: a column a migration
        // dropped leaves a gap in attnum that a declared table has not.
        "columns",
        "select json_build_array(c.relname, row_number() over (partition by c.oid order by a.attnum), a.attname,
                                 format_type(a.atttypid, a.atttypmod), a.attnotnull, pg_get_expr(d.adbin, d.adrelid),
                                 a.attidentity, a.attgenerated, a.attacl::text, a.attstorage, a.attcollation::regcollation::text,
                                 col_description(c.oid, a.attnum))::text
           from pg_class c join pg_attribute a on a.attrelid = c.oid and a.attnum > 0 and not a.attisdropped
           left join pg_attrdef d on d.adrelid = c.oid and d.adnum = a.attnum
          where c.relnamespace = 'agent'::regnamespace",
    ),
    (
        "constraints",
        "select json_build_array(conrelid::regclass::text, contypid::regtype::text, conname, contype,
                                 pg_get_constraintdef(oid), condeferrable, condeferred, convalidated,
                                 obj_description(oid, 'pg_constraint'))::text
           from pg_constraint where connamespace = 'agent'::regnamespace",
    ),
    (
        "indexes",
        "select json_build_array(i.indexrelid::regclass::text, pg_get_indexdef(i.indexrelid), i.indisclustered,
                                 i.indisreplident)::text
           from pg_index i join pg_class c on c.oid = i.indrelid where c.relnamespace = 'agent'::regnamespace",
    ),
    (
        "policies",
        "select json_build_array(p.polrelid::regclass::text, p.polname, p.polcmd, p.polpermissive,
                                 p.polroles::regrole[]::text, pg_get_expr(p.polqual, p.polrelid),
                                 pg_get_expr(p.polwithcheck, p.polrelid), obj_description(p.oid, 'pg_policy'))::text
           from pg_policy p join pg_class c on c.oid = p.polrelid where c.relnamespace = 'agent'::regnamespace",
    ),
    (
        "triggers",
        "select json_build_array(t.tgrelid::regclass::text, t.tgname, pg_get_triggerdef(t.oid), t.tgenabled)::text
           from pg_trigger t join pg_class c on c.oid = t.tgrelid
          where c.relnamespace = 'agent'::regnamespace and not t.tgisinternal",
    ),
    (
        "types",
        "select json_build_array(t.typname, t.typtype, pg_get_userbyid(t.typowner), t.typacl::text,
                                 obj_description(t.oid, 'pg_type'))::text
           from pg_type t where t.typnamespace = 'agent'::regnamespace",
    ),
    (
        "event triggers",
        "select json_build_array(e.evtname, e.evtevent, e.evtfoid::regprocedure::text, e.evttags::text,
                                 e.evtenabled, pg_get_userbyid(e.evtowner))::text
           from pg_event_trigger e",
    ),
    (
        "default privileges",
        "select json_build_array(pg_get_userbyid(d.defaclrole), d.defaclnamespace::regnamespace::text,
                                 d.defaclobjtype, d.defaclacl::text)::text
           from pg_default_acl d",
    ),
    (
        "extended statistics",
        "select json_build_array(s.stxname, pg_get_statisticsobjdef(s.oid))::text
           from pg_statistic_ext s where s.stxnamespace = 'agent'::regnamespace",
    ),
    ("scopes shipped", "select to_jsonb(s)::text from agent.idempotency_scopes s"),
];

type Catalog = BTreeMap<&'static str, BTreeSet<String>>;

async fn catalog(db: &mut PgConnection) -> Result<Catalog, String> {
    let mut catalog = Catalog::new();
    for (name, query) in CATALOG {
        let rows: Vec<String> = sqlx::query_scalar(AssertSqlSafe(*query))
            .fetch_all(&mut *db)
            .await
            .map_err(|e| format!("reading {name}: {e}"))?;
        let count = rows.len();
        let rows: BTreeSet<String> = rows.into_iter().collect();
        if rows.len() != count {
            return Err(format!("{name}: two objects read alike"));
        }
        catalog.insert(name, rows);
    }
    Ok(catalog)
}

/// Every difference, named by what differs and on which side.
fn differences(migrated: &Catalog, declared: &Catalog) -> Vec<String> {
    let mut found = Vec::new();
    for (name, rows) in migrated {
        let other = &declared[name];
        found.extend(rows.difference(other).map(|row| format!("{name}, only from the migrations: {row}")));
        found.extend(other.difference(rows).map(|row| format!("{name}, only from the declared schema: {row}")));
    }
    found
}

/// The declared schema's files, in the order `supabase db diff` applies
/// them (`schema_paths = ["./schemas/*.sql"]`: lexicographic).
fn declared_schema() -> Vec<(String, String)> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("supabase/schemas");
    let mut files: Vec<(String, String)> = std::fs::read_dir(&root)
        .unwrap_or_else(|e| panic!("reading {}: {e}", root.display()))
        .map(|entry| entry.expect("directory entry").path())
        .filter(|path| path.extension().is_some_and(|e| e == "sql"))
        .map(|path| {
            let name = path.file_name().and_then(|n| n.to_str()).expect("UTF-8 file name").to_owned();
            (name, std::fs::read_to_string(&path).expect("read schema file"))
        })
        .collect();
    files.sort();
    files
}

#[test]
fn the_supabase_cli_reads_the_declared_schema_in_file_name_order() {
    let config = std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("supabase/config.toml"))
        .expect("supabase/config.toml");
    let config: toml::Table = config.parse().expect("supabase/config.toml is TOML");
    let paths = config
        .get("db")
        .and_then(|db| db.get("migrations"))
        .and_then(|m| m.get("schema_paths"))
        .and_then(|p| p.as_array())
        .expect("[db.migrations] schema_paths");
    assert_eq!(paths, &vec![toml::Value::from("./schemas/*.sql")]);
    // Names order the files: each starts with two digits and a '_', and the
    // roles come first, the grants last.
    let names: Vec<String> = declared_schema().into_iter().map(|(name, _)| name).collect();
    for name in &names {
        let bytes = name.as_bytes();
        assert!(bytes.len() > 3 && bytes[..2].iter().all(u8::is_ascii_digit) && bytes[2] == b'_', "{name}");
    }
    assert_eq!(names.first().map(String::as_str), Some("00_roles.sql"));
    assert_eq!(names.last().map(String::as_str), Some("90_grants.sql"));
}

/// A database of its own on the shared cluster, `files` applied one by one,
/// then `changes` (SQL run after them), and its catalog.
async fn build(
    admin: &mut PgConnection,
    admin_url: &url::Url,
    database: &str,
    files: &[(String, String)],
    changes: &str,
) -> Result<Catalog, String> {
    // The name is ours: letters, digits and '_'.
    admin.execute(AssertSqlSafe(format!("create database {database}"))).await.map_err(|e| e.to_string())?;
    let mut url = admin_url.clone();
    url.set_path(&format!("/{database}"));
    let mut db = PgConnection::connect(url.as_str()).await.map_err(|e| format!("connect to {database}: {e}"))?;
    for (file, sql) in files {
        sqlx::raw_sql(AssertSqlSafe(sql.as_str())).execute(&mut db).await.map_err(|e| format!("{file}: {e}"))?;
    }
    sqlx::raw_sql(AssertSqlSafe(changes)).execute(&mut db).await.map_err(|e| format!("the changes: {e}"))?;
    let catalog = catalog(&mut db).await;
    let _ = db.close().await;
    catalog
}

#[tokio::test]
async fn the_declared_schema_and_the_migrations_build_the_same_catalog() {
    let admin_url = url::Url::parse(&idempotency_plane::local::LocalStackConfig::default().database_url).unwrap();
    let mut admin = PgConnection::connect(admin_url.as_str()).await.expect("the maintenance database");
    let suffix = format!("{:016x}", rand::random::<u64>());
    let databases =
        [format!("idem_migrated_{suffix}"), format!("idem_declared_{suffix}"), format!("idem_changed_{suffix}")];
    let migrations: Vec<(String, String)> = MIGRATIONS.iter().map(|(f, s)| (f.to_string(), s.to_string())).collect();
    let declared_files = declared_schema();
    // The comparison sees a difference where there is one: the declared
    // schema again, with a function's setting, a table's comment and a
    // shipped scope changed.
    let changes = "alter function agent.idempotency_get(uuid, text, text) set lock_timeout = '7s';
                   comment on table agent.runs is 'changed';
                   delete from agent.idempotency_scopes where scope = 'queue.*';";

    let built = async {
        let migrated = build(&mut admin, &admin_url, &databases[0], &migrations, "").await?;
        let declared = build(&mut admin, &admin_url, &databases[1], &declared_files, "").await?;
        let changed = build(&mut admin, &admin_url, &databases[2], &declared_files, changes).await?;
        Ok::<_, String>((migrated, declared, changed))
    }
    .await;
    // Dropped whatever happened: the event trigger makes a leftover database
    // anything but inert.
    for database in &databases {
        admin.execute(AssertSqlSafe(format!("drop database if exists {database} with (force)"))).await.unwrap();
    }
    let (migrated, declared, changed) = built.unwrap_or_else(|e| panic!("{e}"));

    // Every kind of object is there to compare: an empty category would
    // compare equal whatever the files say.
    for (name, rows) in &migrated {
        let may_be_empty = ["policies", "triggers", "default privileges", "extended statistics"];
        assert!(!rows.is_empty() || may_be_empty.contains(name), "the migrations built no {name}");
    }
    assert!(migrated["functions"].len() >= 30, "{}", migrated["functions"].len());
    let found = differences(&migrated, &declared);
    assert!(found.is_empty(), "the declared schema and the migrations differ:\n{}", found.join("\n"));

    let found = differences(&migrated, &changed);
    let of = |category: &str, object: &str| {
        found.iter().filter(|d| d.starts_with(&format!("{category},")) && d.contains(object)).count()
    };
    assert_eq!(of("functions", "idempotency_get"), 2, "{found:#?}");
    assert_eq!(of("relations", "\"runs\""), 2, "{found:#?}");
    assert_eq!(of("scopes shipped", "queue.*"), 1, "{found:#?}");
    assert_eq!(found.len(), 5, "nothing else differs: {found:#?}");
}
