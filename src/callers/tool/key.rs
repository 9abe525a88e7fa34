//! The keys of a tool call: the plane's, built from the Run and the
//! orchestrator step, and the vendor's, derived from the tenant's.

use std::borrow::Cow;

use sha2::{Digest, Sha256};
use uuid::Uuid;

/// The idempotency key of one tool call, built from stable identifiers of
/// the Run and the orchestrator step that makes the call.
///
/// There is deliberately no way to build one from the model's tool-call id:
/// a restarted Agent segment makes the model mint a new one, so that key
/// would miss the earlier claim and repeat the effect.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct ToolKey(String);

impl ToolKey {
    /// The key of the call made by step `step_id` of Run `run_id`. The step
    /// id is the orchestrator's (e.g. Inngest's), which a replay recomputes;
    /// never pass the model's tool-call id here.
    ///
    /// Distinct `(run, step)` and `(run, step, index)` never share a key: a
    /// `:` or `%` in the step id is percent-encoded, so the step id ends
    /// where the key says it does. (A step id without either is used as
    /// given.)
    pub fn for_step(run_id: Uuid, step_id: &str) -> Self {
        ToolKey(format!("run:{run_id}:step:{}", escape_step(step_id)))
    }

    /// The key of the `call_index`-th distinct call a step makes, for a step
    /// that fans out to several calls. The index is the call's position in
    /// the step's plan, which a replay recomputes. The same call proposed
    /// twice must keep one index, so the duplicate meets the live claim.
    pub fn for_step_call(run_id: Uuid, step_id: &str, call_index: u32) -> Self {
        ToolKey(format!("run:{run_id}:step:{}:call:{call_index}", escape_step(step_id)))
    }

    /// The key as stored.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

/// `step_id` with `%` and `:` percent-encoded: injective, and the identity
/// on the step ids orchestrators make, so their keys are unchanged.
fn escape_step(step_id: &str) -> Cow<'_, str> {
    if step_id.contains([':', '%']) {
        Cow::Owned(step_id.replace('%', "%25").replace(':', "%3A"))
    } else {
        Cow::Borrowed(step_id)
    }
}

/// The tenant's key for a vendor's own idempotency (Stripe's
/// `Idempotency-Key`, a downstream service's): `hex(sha256(organization
/// ":" scope ":" key))`, the organization as its 16 bytes. Stable across
/// attempts, so a downstream that saw the first attempt's effect applies a
/// re-drive's once; distinct across tenants sharing one vendor account.
/// The TypeScript client's `vendorKey` derives the same key.
pub fn vendor_key(organization_id: Uuid, scope: &str, key: &str) -> String {
    let mut hasher = Sha256::new();
    hasher.update(organization_id.as_bytes());
    hasher.update(b":");
    hasher.update(scope.as_bytes());
    hasher.update(b":");
    hasher.update(key.as_bytes());
    hex::encode(hasher.finalize())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn step_keys_are_stable_and_distinct_per_call() {
        let run = Uuid::new_v4();
        assert_eq!(ToolKey::for_step(run, "s1"), ToolKey::for_step(run, "s1"));
        assert_eq!(ToolKey::for_step(run, "s1").as_str(), format!("run:{run}:step:s1"), "unchanged for plain ids");
        assert_ne!(ToolKey::for_step_call(run, "s1", 0), ToolKey::for_step_call(run, "s1", 1));
        assert_ne!(ToolKey::for_step(run, "s1"), ToolKey::for_step_call(run, "s1", 0));
    }

    #[test]
    fn tool_keys_never_collide_when_a_step_id_looks_like_a_call_suffix() {
        let run = Uuid::new_v4();
        assert_ne!(ToolKey::for_step(run, "charge:call:0"), ToolKey::for_step_call(run, "charge", 0));
        assert_ne!(ToolKey::for_step(run, "a%3Ab"), ToolKey::for_step(run, "a:b"));
        assert_ne!(ToolKey::for_step_call(run, "a:call:1", 2), ToolKey::for_step_call(run, "a", 1));
    }

    /// Which call a key was built for: `(run, step, index)`.
    type Call = (u8, String, Option<u32>);

    fn key_of((run, step, index): &Call) -> ToolKey {
        let run = Uuid::from_u128(u128::from(*run));
        match index {
            None => ToolKey::for_step(run, step),
            Some(index) => ToolKey::for_step_call(run, step, *index),
        }
    }

    proptest::proptest! {
        #[test]
        fn distinct_run_step_index_tuples_never_produce_the_same_key(
            a in (0u8..3, "[a-c:%0-9]{0,12}", proptest::option::of(0u32..3)),
            b in (0u8..3, "[a-c:%0-9]{0,12}", proptest::option::of(0u32..3)),
        ) {
            proptest::prop_assert_eq!(a == b, key_of(&a) == key_of(&b), "{:?} and {:?}", a, b);
        }
    }

    #[test]
    fn the_vendor_key_is_stable_and_distinct_per_tenant() {
        // The TypeScript client's tests pin the same value.
        let pinned = Uuid::parse_str("0f1e2d3c-4b5a-6978-8796-a5b4c3d2e1f0").unwrap();
        assert_eq!(
            vendor_key(pinned, "tool.email.send", "run:1:step:2"),
            "3aa05fba1bec70f2b5b4cda4819d67efe3d250b2e4970c266b7b9448155f71df"
        );
        let org = Uuid::new_v4();
        let key = vendor_key(org, "tool.email.send", "run:1:step:2");
        assert_eq!(key, vendor_key(org, "tool.email.send", "run:1:step:2"));
        assert_ne!(key, vendor_key(Uuid::new_v4(), "tool.email.send", "run:1:step:2"));
        assert_ne!(key, vendor_key(org, "tool.email.send", "run:1:step:3"));
        assert_eq!(key.len(), 64);
    }
}
