/// `(file name, contents)` of each file named, from `supabase/migrations/`.
macro_rules! supabase_migrations {
    ($($file:literal),* $(,)?) => {
        &[$(($file, include_str!(concat!("../supabase/migrations/", $file)))),*]
    };
}

/// The migrations, in the order they apply, as `(file name, contents)`: the
/// files of `supabase/migrations/`, which the Supabase CLI applies too. They
/// are the deployed history: a change is a new file, never an edit.
pub const MIGRATIONS: &[(&str, &str)] = supabase_migrations![
    "20261130000001_roles.sql",
    "20261130000002_idempotency_keys.sql",
    "20261130000003_runs.sql",
    "20261130000004_privileges.sql",
    "20261130000005_provider_jobs.sql",
    "20261130000006_operator_probes.sql",
    "20261130000007_clocks_locks_admission.sql",
    "20261130000008_surface_v2.sql",
    "20261130000009_lean_hot_path.sql",
    "20261130000010_http_scopes.sql",
    "20261130000011_functions_only.sql",
    "20261130000012_fenced_admission.sql",
    "20261130000013_sweep.sql",
    "20261130000014_claims_by_organization.sql",
    "20261130000015_max_run_duration.sql",
    "20261130000016_lease_token_stays_with_its_holder.sql",
    "20261130000017_work_outlives_its_worker.sql",
    "20261130000018_failures_recovered_after_a_fix.sql",
    "20261130000019_many_claims_in_one_round_trip.sql",
    "20261130000020_queue_scopes.sql",
    "20261204151330_surface_reports_owners.sql",
    "20261204212742_one_holder_in_every_path.sql",
    "20261204230500_webhook_body_limit.sql",
    "20261205013000_queue_in_one_transaction.sql",
    "20261205053426_queue_letters_and_items_read_once.sql",
    "20261205062447_operators_told_why.sql",
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
