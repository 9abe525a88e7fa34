/// The migrations under `sql/`, in the order they apply.
pub const MIGRATIONS: &[(&str, &str)] = &[
    ("0001_roles.sql", include_str!("../sql/0001_roles.sql")),
    ("0002_idempotency_keys.sql", include_str!("../sql/0002_idempotency_keys.sql")),
    ("0003_runs.sql", include_str!("../sql/0003_runs.sql")),
    ("0004_privileges.sql", include_str!("../sql/0004_privileges.sql")),
    ("0005_provider_jobs.sql", include_str!("../sql/0005_provider_jobs.sql")),
    ("0006_operator_probes.sql", include_str!("../sql/0006_operator_probes.sql")),
    ("0007_clocks_locks_admission.sql", include_str!("../sql/0007_clocks_locks_admission.sql")),
    ("0008_surface_v2.sql", include_str!("../sql/0008_surface_v2.sql")),
    ("0009_lean_hot_path.sql", include_str!("../sql/0009_lean_hot_path.sql")),
    ("0010_http_scopes.sql", include_str!("../sql/0010_http_scopes.sql")),
    ("0011_functions_only.sql", include_str!("../sql/0011_functions_only.sql")),
    ("0012_fenced_admission.sql", include_str!("../sql/0012_fenced_admission.sql")),
    ("0013_sweep.sql", include_str!("../sql/0013_sweep.sql")),
    ("0014_claims_by_organization.sql", include_str!("../sql/0014_claims_by_organization.sql")),
];
