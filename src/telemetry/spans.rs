//! The attributes the crate's spans carry, and the trace context a claim
//! stores and a re-drive links back to.
//!
//! The spans are made whether or not anything exports them (tracing is
//! always on); with the `otel` feature, `telemetry::otel` exports them,
//! a claim that carries work sends the current span's W3C `traceparent` to
//! the plane, and the span that runs work the plane hands out again (a
//! re-drive, a queue redelivery, a failure sent back) is *linked* to the
//! trace that first claimed it. Without the feature nothing is sent and a
//! stored traceparent is ignored.

use sha2::{Digest, Sha256};

/// The scope a span's call or effect is in.
pub const SPAN_SCOPE: &str = "idempotency.scope";
/// What a claim or read found: `claimed`, `reclaimed`, `replayed`,
/// `processing`, `conflict` (and `absent` for a read).
pub const SPAN_OUTCOME: &str = "idempotency.outcome";
/// Whether the answer was an earlier attempt's, replayed.
pub const SPAN_REPLAYED: &str = "idempotency.replayed";
/// Which attempt at the work this is: 1 for the first claim, one more for
/// every re-drive.
pub const SPAN_ATTEMPT: &str = "idempotency.attempt";
/// Whether the claim took over a passed lease.
pub const SPAN_RECLAIMED: &str = "idempotency.reclaimed";
/// How a completion, release or effect ended.
pub const SPAN_ENDING: &str = "idempotency.ending";
/// [`key_hash`] of the idempotency key: the key itself is never recorded.
pub const SPAN_KEY_HASH: &str = "idempotency.key_hash";
/// The kind of error a span ended with ([`Error::kind`](crate::Error::kind),
/// or how an effect was cut); the span's OpenTelemetry status is then
/// `error`.
pub const SPAN_ERROR_TYPE: &str = "error.type";

/// The first 16 hex characters (64 bits) of SHA-256 over the key's UTF-8
/// bytes: what spans and logs carry instead of an idempotency key, which
/// may hold personal data. Equal keys hash equal, so one key's calls can be
/// found across traces; the TypeScript client computes the same value.
///
/// ```
/// assert_eq!(idempotency_plane::telemetry::key_hash("order-42"), "3bf8b157c4238eef");
/// ```
pub fn key_hash(key: &str) -> String {
    let digest = Sha256::digest(key.as_bytes());
    hex::encode(&digest[..8])
}

/// Records an error of kind `kind` on `span` (an error's
/// [`kind`](crate::Error::kind), or how an effect was cut): `error.type` is
/// `kind` and the span's status is `error` (`otel.status_code`). The span
/// must have declared both fields (as `field::Empty`).
pub(crate) fn record_error(span: &tracing::Span, kind: &str) {
    span.record(SPAN_ERROR_TYPE, kind);
    span.record("otel.status_code", "error");
}

/// A count as a span records it: a signed integer (the OpenTelemetry
/// layer exports an unsigned one as text).
pub(crate) fn span_count(n: usize) -> i64 {
    i64::try_from(n).unwrap_or(i64::MAX)
}

/// The W3C traceparent of the current span, for a claim that carries work
/// to store: `None` without the `otel` feature, or when the current span is
/// not recorded by an OpenTelemetry layer.
#[cfg(feature = "otel")]
pub(crate) fn current_traceparent() -> Option<String> {
    use opentelemetry::trace::TraceContextExt;
    use tracing_opentelemetry::OpenTelemetrySpanExt;

    let context = tracing::Span::current().context();
    let span = context.span();
    let span_context = span.span_context();
    span_context.is_valid().then(|| {
        format!(
            "00-{:032x}-{:016x}-{:02x}",
            span_context.trace_id(),
            span_context.span_id(),
            span_context.trace_flags().to_u8()
        )
    })
}

/// Without the `otel` feature a claim sends no traceparent.
#[cfg(not(feature = "otel"))]
pub(crate) fn current_traceparent() -> Option<String> {
    None
}

/// Links `span` to the trace that first claimed its work, `origin` (a W3C
/// traceparent the plane stored): a link, never a parent, so the work's new
/// run stays in the trace that runs it. Nothing when `origin` is absent or
/// malformed, or names `span`'s own trace (a fresh claim answers its own
/// traceparent); nothing at all without the `otel` feature.
#[cfg(feature = "otel")]
pub(crate) fn link_to_origin(span: &tracing::Span, origin: Option<&str>) {
    use opentelemetry::trace::TraceContextExt;
    use tracing_opentelemetry::OpenTelemetrySpanExt;

    let Some(origin) = origin.and_then(parse_traceparent) else { return };
    if span.context().span().span_context().trace_id() == origin.trace_id() {
        return;
    }
    span.add_link(origin);
}

/// Without the `otel` feature a stored traceparent is ignored.
#[cfg(not(feature = "otel"))]
pub(crate) fn link_to_origin(_span: &tracing::Span, _origin: Option<&str>) {}

/// A W3C traceparent of version 00 (`00-<32 hex>-<16 hex>-<2 hex>`,
/// lowercase, neither id all zeros) as a remote span context.
#[cfg(feature = "otel")]
fn parse_traceparent(traceparent: &str) -> Option<opentelemetry::trace::SpanContext> {
    use opentelemetry::trace::{SpanContext, SpanId, TraceFlags, TraceId, TraceState};

    let lower_hex = |part: &str, len: usize| {
        part.len() == len && part.bytes().all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
    };
    let mut parts = traceparent.split('-');
    let (version, trace_id, span_id, flags) = (parts.next()?, parts.next()?, parts.next()?, parts.next()?);
    if parts.next().is_some()
        || version != "00"
        || !lower_hex(trace_id, 32)
        || !lower_hex(span_id, 16)
        || !lower_hex(flags, 2)
    {
        return None;
    }
    let trace_id = TraceId::from_hex(trace_id).ok()?;
    let span_id = SpanId::from_hex(span_id).ok()?;
    let flags = TraceFlags::new(u8::from_str_radix(flags, 16).ok()?);
    let context = SpanContext::new(trace_id, span_id, flags, true, TraceState::default());
    context.is_valid().then_some(context)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn key_hash_is_the_first_16_hex_of_sha256() {
        // sha256("order-42") = 3bf8b157c4238eef…; the TypeScript client's vector.
        assert_eq!(key_hash("order-42"), "3bf8b157c4238eef");
        let full = hex::encode(Sha256::digest("order-42".as_bytes()));
        assert_eq!(key_hash("order-42"), full[..16]);
        assert_eq!(key_hash("é").len(), 16);
        assert_ne!(key_hash("order-42"), key_hash("order-43"));
    }

    #[cfg(feature = "otel")]
    #[test]
    fn only_a_w3c_traceparent_of_version_00_parses() {
        let good = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
        let context = parse_traceparent(good).expect("a valid traceparent");
        assert_eq!(format!("{:032x}", context.trace_id()), "4bf92f3577b34da6a3ce929d0e0e4736");
        assert_eq!(format!("{:016x}", context.span_id()), "00f067aa0ba902b7");
        assert!(context.is_sampled() && context.is_remote());
        for bad in [
            "",
            "01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01",
            "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-extra",
            "00-4bf92f3577b34da6a3ce929d0e0e473-00f067aa0ba902b7-01",
        ] {
            assert!(parse_traceparent(bad).is_none(), "{bad:?} parsed");
        }
    }
}
