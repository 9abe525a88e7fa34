//! HS256 tokens for the local server, as Supabase's service key is one.

use std::time::Duration;

use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use base64::Engine;
use hmac::{Hmac, Mac};
use sha2::Sha256;

/// The JWT secret of the Supabase CLI's local stack (`supabase start`):
/// publicly known, and the same on every machine. Only for a server that
/// nobody but this machine reaches; see [`mint_stable_token`].
pub const SUPABASE_CLI_JWT_SECRET: &str = "super-secret-jwt-token-with-at-least-32-characters-long";

/// The `exp` of every [`mint_stable_token`] key: 1983812996, 2032-11-11
/// 19:09:56 UTC, as in the Supabase CLI's demo keys.
pub const STABLE_KEY_EXPIRES_AT: i64 = 1_983_812_996;

/// A JWT whose `role` claim is `role`, valid for `ttl`, signed HS256 with `secret`.
pub fn mint_token(secret: &str, role: &str, ttl: Duration) -> String {
    let now = chrono::Utc::now().timestamp();
    let claims = serde_json::json!({
        "role": role,
        "iat": now,
        "exp": now + i64::try_from(ttl.as_secs()).unwrap_or(i64::MAX / 2),
    });
    sign(secret, &claims.to_string())
}

/// A JWT for `role` that is the same string every time it is minted with
/// the same `secret`: the claims of the Supabase CLI's demo keys,
/// `{"iss":"supabase-demo","role":<role>,"exp":1983812996}` in that order,
/// with no `iat`. With [`SUPABASE_CLI_JWT_SECRET`] the `anon` and
/// `service_role` keys are byte for byte the ones `supabase start` prints.
pub fn mint_stable_token(secret: &str, role: &str) -> String {
    // serde_json quotes the role, so no role can change the claims' shape.
    let role = serde_json::Value::from(role);
    sign(secret, &format!(r#"{{"iss":"supabase-demo","role":{role},"exp":{STABLE_KEY_EXPIRES_AT}}}"#))
}

/// `header.payload.signature` over the claims `payload` (JSON text).
fn sign(secret: &str, payload: &str) -> String {
    let header = URL_SAFE_NO_PAD.encode(br#"{"alg":"HS256","typ":"JWT"}"#);
    let payload = URL_SAFE_NO_PAD.encode(payload);
    let signing_input = format!("{header}.{payload}");
    // HMAC accepts a key of any length, so this cannot fail.
    let mut mac = <Hmac<Sha256> as Mac>::new_from_slice(secret.as_bytes())
        .unwrap_or_else(|_| unreachable!("HMAC takes keys of any length"));
    mac.update(signing_input.as_bytes());
    let signature = URL_SAFE_NO_PAD.encode(mac.finalize().into_bytes());
    format!("{signing_input}.{signature}")
}

/// The `role` of `token` when it is an HS256 JWT signed with `secret`
/// (checked with `Mac::verify_slice`, in constant time) that has not
/// expired; `None` otherwise.
pub(super) fn verified_role(secret: &str, token: &str) -> Option<String> {
    let (signing_input, signature) = token.rsplit_once('.')?;
    let (_, payload) = signing_input.split_once('.')?;
    let signature = URL_SAFE_NO_PAD.decode(signature).ok()?;
    let mut mac = <Hmac<Sha256> as Mac>::new_from_slice(secret.as_bytes()).ok()?;
    mac.update(signing_input.as_bytes());
    mac.verify_slice(&signature).ok()?;
    let claims: serde_json::Value = serde_json::from_slice(&URL_SAFE_NO_PAD.decode(payload).ok()?).ok()?;
    let unexpired = match claims.get("exp") {
        Some(exp) => exp.as_i64().is_some_and(|exp| exp > chrono::Utc::now().timestamp()),
        None => true,
    };
    unexpired.then(|| claims.get("role")?.as_str().map(str::to_owned)).flatten()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_token_is_verified_by_its_signature_and_expiry_before_its_role_is_read() {
        let secret = "a-secret-of-at-least-thirty-two-bytes!!";
        assert_eq!(verified_role(secret, &mint_stable_token(secret, "anon")).as_deref(), Some("anon"));
        let fresh = mint_token(secret, "service_role", Duration::from_secs(60));
        assert_eq!(verified_role(secret, &fresh).as_deref(), Some("service_role"));
        assert_eq!(verified_role("another-secret-of-at-least-thirty-two", &fresh), None, "another signer");
        let expired = sign(secret, r#"{"role":"anon","exp":1}"#);
        assert_eq!(verified_role(secret, &expired), None, "expired");
        let mut forged = fresh.clone();
        let flipped = if fresh.ends_with('A') { "B" } else { "A" };
        forged.replace_range(fresh.len() - 1.., flipped);
        assert_eq!(verified_role(secret, &forged), None, "a changed signature");
        assert_eq!(verified_role(secret, "not-a-jwt"), None);
    }

    /// The keys the Supabase CLI's local stack hands out (`supabase status`).
    const CLI_ANON_KEY: &str = "eyJhbGciOiJIUzI1NiIsInR5cCI6IkpXVCJ9.\
        eyJpc3MiOiJzdXBhYmFzZS1kZW1vIiwicm9sZSI6ImFub24iLCJleHAiOjE5ODM4MTI5OTZ9.\
        CRXP1A7WOeoJeXxjNni43kdQwgnWNReilDMblYTn_I0";
    const CLI_SERVICE_ROLE_KEY: &str = "eyJhbGciOiJIUzI1NiIsInR5cCI6IkpXVCJ9.\
        eyJpc3MiOiJzdXBhYmFzZS1kZW1vIiwicm9sZSI6InNlcnZpY2Vfcm9sZSIsImV4cCI6MTk4MzgxMjk5Nn0.\
        EGIM96RAZx35lJzdJsyH-qQwv8Hdp7fsn3W0YpN81IU";

    #[test]
    fn stable_keys_with_the_cli_secret_are_the_supabase_cli_demo_keys() {
        assert_eq!(mint_stable_token(SUPABASE_CLI_JWT_SECRET, "anon"), CLI_ANON_KEY);
        assert_eq!(mint_stable_token(SUPABASE_CLI_JWT_SECRET, "service_role"), CLI_SERVICE_ROLE_KEY);
    }

    #[test]
    fn stable_keys_depend_on_the_secret_and_the_role_only() {
        let secret = "another-secret-of-at-least-thirty-two-bytes";
        assert_eq!(mint_stable_token(secret, "anon"), mint_stable_token(secret, "anon"));
        assert_ne!(mint_stable_token(secret, "anon"), mint_stable_token(SUPABASE_CLI_JWT_SECRET, "anon"));
        assert_ne!(mint_stable_token(secret, "anon"), mint_stable_token(secret, "service_role"));
        // A role that would break out of its string stays inside it.
        let odd = mint_stable_token(secret, r#"x","role":"service_role"#);
        let payload = odd.split('.').nth(1).expect("a payload");
        let claims: serde_json::Value =
            serde_json::from_slice(&URL_SAFE_NO_PAD.decode(payload).expect("base64url")).expect("JSON");
        assert_eq!(claims["role"], r#"x","role":"service_role"#);
        assert_eq!(claims["exp"], STABLE_KEY_EXPIRES_AT);
    }
}
