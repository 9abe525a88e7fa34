//! The floor: the claim and the completion as the plainest statements that
//! keep the contract, run directly, which the SQL functions are measured
//! against.

use std::time::Duration;

use idempotency_plane::RequestHash;
use serde_json::json;
use sqlx::{PgPool, Row};
use uuid::Uuid;

use super::drive::drive;
use crate::BoxError;

/// The floor: claim → complete with the leanest plain statements that keep
/// the contract (the scope's policy, lease stamped from the clock,
/// retention from the lease's end, the fence, the response limit, and the
/// same answer rows: every claim column and `lease_live`), over direct
/// connections. What the plane's functions cost is measured against it.
pub(super) async fn pairs_floor(
    pool: &PgPool,
    workers: usize,
    duration: Duration,
    round: u32,
) -> Result<(Vec<Duration>, Duration), BoxError> {
    let pool = pool.clone();
    let org = Uuid::new_v4();
    let hash = RequestHash::of_json(&json!({"bench": true})).as_str().to_owned();
    drive(workers, duration, move |worker, i| {
        let (pool, hash) = (pool.clone(), hash.clone());
        async move {
            let token = Uuid::new_v4();
            let row = sqlx::query(
                "with p as (select s.retain from agent.idempotency_scopes s
                             where s.scope = 'tool.bench'
                                or (s.scope like '%.*'
                                    and char_length('tool.bench') > char_length(s.scope) - 1
                                    and left('tool.bench', char_length(s.scope) - 1) = left(s.scope, -1))
                             order by s.scope = 'tool.bench' desc, char_length(s.scope) desc limit 1),
                      c as (select clock_timestamp() as at)
                 insert into agent.idempotency_keys as k
                   (organization_id, scope, key, request_hash, status, lease_token,
                    claimed_at, lease_expires_at, retain_until)
                 select $1, 'tool.bench', $2, $3, 'processing', $4,
                        c.at, c.at + interval '60 seconds', c.at + interval '60 seconds' + p.retain
                   from p, c
                 on conflict (organization_id, scope, key) do nothing
                 returning 'claimed' as outcome, k.id, k.organization_id, k.scope, k.key, k.request_hash,
                           k.status, k.lease_token, k.resource_type, k.resource_id, k.response,
                           k.claimed_at, k.lease_expires_at, k.retain_until,
                           k.lease_expires_at > clock_timestamp() as lease_live",
            )
            .bind(org)
            .bind(format!("floor-{round}-{worker}-{i}"))
            .bind(&hash)
            .bind(token)
            .fetch_one(&pool)
            .await?;
            let id: Uuid = row.try_get("id")?;
            sqlx::query(
                "update agent.idempotency_keys as k
                    set status = 'completed', response = $3,
                        retain_until = greatest(k.retain_until, clock_timestamp() + (k.retain_until - k.lease_expires_at))
                  where k.id = $1 and k.lease_token = $2 and k.status = 'processing'
                    and octet_length($3::text) <= (
                          select s.max_response_bytes from agent.idempotency_scopes s
                           where s.scope = k.scope
                              or (s.scope like '%.*'
                                  and char_length(k.scope) > char_length(s.scope) - 1
                                  and left(k.scope, char_length(s.scope) - 1) = left(s.scope, -1))
                           order by s.scope = k.scope desc, char_length(s.scope) desc limit 1)
                 returning k.id, k.organization_id, k.scope, k.key, k.request_hash, k.status,
                           k.lease_token, k.resource_type, k.resource_id, k.response, k.claimed_at,
                           k.lease_expires_at, k.retain_until, false as lease_live",
            )
            .bind(id)
            .bind(token)
            .bind(json!({"ok": true}))
            .fetch_one(&pool)
            .await?;
            Ok(())
        }
    })
    .await
}
