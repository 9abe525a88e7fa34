//! The crate embeds exactly `supabase/migrations/`, the one copy of the
//! migrations that the Supabase CLI applies too, in the CLI's order.

use std::fs;
use std::path::Path;

use idempotency_plane::migrations::MIGRATIONS;

/// Every `.sql` file of `supabase/migrations/`, as `(file name, contents)`,
/// sorted by name: the order `supabase db push` applies them in.
fn on_disk() -> Vec<(String, String)> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("supabase/migrations");
    let mut files = Vec::new();
    for entry in fs::read_dir(&root).unwrap_or_else(|e| panic!("reading {}: {e}", root.display())) {
        let path = entry.expect("directory entry").path();
        let file = path.file_name().and_then(|n| n.to_str()).expect("UTF-8 file name").to_owned();
        if file.ends_with(".sql") {
            files.push((file, fs::read_to_string(&path).expect("read migration")));
        }
    }
    files.sort();
    files
}

#[test]
fn the_crate_embeds_exactly_the_supabase_migrations_in_order() {
    let on_disk = on_disk();
    assert!(!on_disk.is_empty());
    let embedded: Vec<(String, String)> = MIGRATIONS.iter().map(|(f, c)| (f.to_string(), c.to_string())).collect();
    let names = |files: &[(String, String)]| files.iter().map(|(f, _)| f.clone()).collect::<Vec<_>>();
    assert_eq!(names(&embedded), names(&on_disk), "src/migrations.rs lists other files than supabase/migrations/");
    assert_eq!(embedded, on_disk);
}

#[test]
fn every_migration_is_named_as_the_supabase_cli_expects() {
    // `<14-digit version>_<name>.sql`: the CLI records the version in
    // supabase_migrations.schema_migrations and skips a file named otherwise.
    for (file, _) in on_disk() {
        let (version, name) = file.split_once('_').unwrap_or_else(|| panic!("{file} has no version prefix"));
        assert!(version.len() == 14 && version.bytes().all(|b| b.is_ascii_digit()), "{file}: version {version:?}");
        assert!(name.len() > ".sql".len(), "{file} has no name after its version");
    }
}
