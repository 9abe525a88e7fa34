//! The README's SQL surface table lists exactly the functions the crate
//! knows as the surface (`repo::SQL_SURFACE`), with their argument names in
//! order. (`stack_surface` checks the same list against the migrations on a
//! real database; `idem doctor` checks it against a deployment.)

use idempotency_plane::repo::SQL_SURFACE;

/// `(name, argument names)` of each row of the README's SQL surface table.
fn readme_rows() -> Vec<(String, Vec<String>)> {
    let readme = include_str!("../../README.md");
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
