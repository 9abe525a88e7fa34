//! What only the in-memory repository has: a policy table a test can
//! extend. Its other behaviour is the conformance suite's, next to the
//! database's. Runs under default features.

use std::time::Duration;

use idempotency_plane::{Error, IdempotencyService, MemoryRepository};
use uuid::Uuid;

use crate::support::{claimed, hash, LEASE};

#[tokio::test]
async fn the_in_memory_policy_table_refuses_a_short_tool_retention_and_takes_new_scopes() {
    let short = MemoryRepository::new().with_policy("tool.crm.*", Duration::from_secs(86_400), 65_536);
    assert!(matches!(short, Err(Error::Store(_))), "a tool scope keeps 30 days: {short:?}");
    let repo = MemoryRepository::new().with_policy("payments.charge", Duration::from_secs(7 * 86_400), 4096).unwrap();
    let service = IdempotencyService::new(repo);
    let org = Uuid::new_v4();
    let claim = claimed(service.claim(org, "payments.charge", "p-1", &hash("x"), LEASE).await);
    assert_eq!(claim.retain_until() - claim.lease_expires_at(), chrono::TimeDelta::days(7));
    let unknown = service.claim(org, "payments.refund", "p-1", &hash("x"), LEASE).await;
    assert!(matches!(unknown, Err(Error::UnknownScope { .. })), "{unknown:?}");
}
