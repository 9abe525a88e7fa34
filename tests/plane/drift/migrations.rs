//! `sql/` and `supabase/migrations/` hold the same migrations, and the crate
//! embeds exactly those files.

use std::collections::BTreeMap;
use std::fs;
use std::path::Path;

use idempotency_plane::migrations::MIGRATIONS;

/// `0002_idempotency_keys.sql` -> `idempotency_keys.sql`, and
/// `20261130000002_idempotency_keys.sql` -> the same, with its order number.
fn by_name(dir: &str) -> BTreeMap<String, (String, String)> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join(dir);
    let mut files = BTreeMap::new();
    for entry in fs::read_dir(&root).unwrap_or_else(|e| panic!("reading {}: {e}", root.display())) {
        let path = entry.expect("directory entry").path();
        let file = path.file_name().and_then(|n| n.to_str()).expect("UTF-8 file name").to_owned();
        if !file.ends_with(".sql") {
            continue;
        }
        let (order, name) = file.split_once('_').unwrap_or_else(|| panic!("{dir}/{file} has no order prefix"));
        let contents = fs::read_to_string(&path).expect("read migration");
        let previous = files.insert(name.to_owned(), (order.to_owned(), contents));
        assert!(previous.is_none(), "{dir} holds two migrations named {name}");
    }
    files
}

#[test]
fn sql_and_supabase_migrations_never_drift() {
    let sql = by_name("sql");
    let supabase = by_name("supabase/migrations");
    assert!(!sql.is_empty());
    assert_eq!(
        sql.keys().collect::<Vec<_>>(),
        supabase.keys().collect::<Vec<_>>(),
        "the two folders hold different migrations"
    );
    for (name, (_, contents)) in &sql {
        assert_eq!(contents, &supabase[name].1, "{name} differs between sql/ and supabase/migrations/");
    }
    // Both folders apply in the same order.
    let order = |m: &BTreeMap<String, (String, String)>| {
        let mut names: Vec<(&String, &String)> = m.iter().map(|(n, (o, _))| (o, n)).collect();
        names.sort();
        names.into_iter().map(|(_, n)| n.clone()).collect::<Vec<_>>()
    };
    assert_eq!(order(&sql), order(&supabase));
}

#[test]
fn the_crate_embeds_exactly_the_sql_folder_in_order() {
    let sql = by_name("sql");
    let mut on_disk: Vec<(String, String)> =
        sql.into_iter().map(|(name, (order, c))| (format!("{order}_{name}"), c)).collect();
    on_disk.sort();
    let embedded: Vec<(String, String)> = MIGRATIONS.iter().map(|(f, c)| (f.to_string(), c.to_string())).collect();
    assert_eq!(embedded, on_disk);
}
