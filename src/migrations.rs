/// `(file name, contents)` of each file named, from `supabase/migrations/`.
macro_rules! supabase_migrations {
    ($($file:literal),* $(,)?) => {
        &[$(($file, include_str!(concat!("../supabase/migrations/", $file)))),*]
    };
}

/// The migrations, in the order they apply, as `(file name, contents)`: the
/// files of `supabase/migrations/`, which the Supabase CLI applies too. v0.1
/// shipped two, written by `scripts/draft-migration.sh --baseline` from
/// `supabase/schemas/`: the roles (cluster-wide, so a file of their own),
/// then the baseline, the rest of the declared schema. They are the deployed
/// history: each change since is a new file (`scripts/draft-migration.sh
/// NAME`), never an edit.
pub const MIGRATIONS: &[(&str, &str)] = supabase_migrations![
    "20261130000001_roles.sql",
    "20261205000000_v0_1_baseline.sql",
    "20261205122510_traces_and_console.sql"
];

/// The optional layout that hash-partitions the claim table by
/// `organization_id` (`sql/layouts/`), applied after [`MIGRATIONS`].
pub const PARTITIONED_BY_ORGANIZATION: (&str, &str) =
    ("layouts/partitioned_by_organization.sql", include_str!("../sql/layouts/partitioned_by_organization.sql"));

/// How the claim table is laid out. Every function, rule and answer is the
/// same in both; what differs is how the rows are stored.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum Layout {
    /// One table: [`MIGRATIONS`] alone. The default.
    #[default]
    Single,
    /// Hash-partitioned by `organization_id` into 16 partitions:
    /// [`MIGRATIONS`], then [`PARTITIONED_BY_ORGANIZATION`].
    PartitionedByOrganization,
}

/// The environment variable [`Layout::from_env`] reads.
pub const LAYOUT_VAR: &str = "IDEM_LAYOUT";

/// A layout name that is not one: [`Layout::from_name`] knows `single` and
/// `partitioned`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown layout {0:?}: expected `single` or `partitioned`")]
pub struct UnknownLayout(pub String);

impl Layout {
    /// Its name: `single` or `partitioned`.
    pub fn name(self) -> &'static str {
        match self {
            Layout::Single => "single",
            Layout::PartitionedByOrganization => "partitioned",
        }
    }

    /// The layout called `name` ([`Layout::name`]).
    pub fn from_name(name: &str) -> Result<Layout, UnknownLayout> {
        match name {
            "single" => Ok(Layout::Single),
            "partitioned" => Ok(Layout::PartitionedByOrganization),
            other => Err(UnknownLayout(other.to_owned())),
        }
    }

    /// The layout [`LAYOUT_VAR`] names; [`Layout::Single`] when it is unset
    /// or empty.
    pub fn from_env() -> Result<Layout, UnknownLayout> {
        match std::env::var(LAYOUT_VAR) {
            Ok(name) if !name.is_empty() => Layout::from_name(&name),
            _ => Ok(Layout::Single),
        }
    }

    /// Every migration this layout applies, in order, as `(file name, contents)`.
    pub fn migrations(self) -> &'static [(&'static str, &'static str)] {
        static PARTITIONED: std::sync::OnceLock<Vec<(&str, &str)>> = std::sync::OnceLock::new();
        match self {
            Layout::Single => MIGRATIONS,
            Layout::PartitionedByOrganization => PARTITIONED
                .get_or_init(|| MIGRATIONS.iter().copied().chain([PARTITIONED_BY_ORGANIZATION]).collect())
                .as_slice(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_layout_is_named_and_found_by_its_name() {
        for layout in [Layout::Single, Layout::PartitionedByOrganization] {
            assert_eq!(Layout::from_name(layout.name()), Ok(layout));
        }
        assert_eq!(Layout::from_name("sharded"), Err(UnknownLayout("sharded".into())));
    }

    #[test]
    fn the_partitioned_layout_applies_every_migration_then_its_own() {
        let partitioned = Layout::PartitionedByOrganization.migrations();
        assert_eq!(&partitioned[..MIGRATIONS.len()], MIGRATIONS);
        assert_eq!(partitioned.last(), Some(&PARTITIONED_BY_ORGANIZATION));
        assert_eq!(Layout::Single.migrations(), MIGRATIONS);
    }
}
