//! Content-Range: parsing never panics, anything it accepts is
//! consistent and round-trips, every value PostgREST can write is accepted,
//! and ranges that end below their start or past their total are refused.

use idempotency_plane::postgrest::ContentRange;
use proptest::prelude::*;

use crate::hostile::proptest_config;

/// Strings near PostgREST's grammar (digits, `-`, `/`, `*`, signs, spaces,
/// u64-overflowing digit runs) and arbitrary unicode.
fn content_range_text() -> impl Strategy<Value = String> {
    prop_oneof![
        "[0-9*/+ -]{0,24}",
        "[0-9]{1,22}-[0-9]{1,22}/([0-9]{1,22}|\\*)",
        "\\*/[0-9*]{0,22}",
        prop::collection::vec(any::<char>(), 0..32).prop_map(String::from_iter),
    ]
}

/// A `(lower, upper)` with `lower <= upper`: small, anywhere in u64, or at its edges.
fn bounds() -> impl Strategy<Value = (u64, u64)> {
    prop_oneof![
        (0u64..2_000, 0u64..2_000),
        (any::<u64>(), any::<u64>()),
        prop::sample::select(vec![(0, 0), (0, u64::MAX), (u64::MAX, u64::MAX), (u64::MAX - 1, u64::MAX)]),
    ]
    .prop_map(|(a, b)| (a.min(b), a.max(b)))
}

/// Every value PostgREST can write: `a-b/*`, `a-b/n` with `b < n`, `*/n`, `*/*`.
fn valid_content_range() -> impl Strategy<Value = ContentRange> {
    let counted = bounds().prop_filter("a total above the range fits in u64", |(_, upper)| *upper < u64::MAX);
    prop_oneof![
        Just(ContentRange::new(None, None).unwrap()),
        any::<u64>().prop_map(|total| ContentRange::new(None, Some(total)).unwrap()),
        bounds().prop_map(|range| ContentRange::new(Some(range), None).unwrap()),
        (counted, any::<u64>()).prop_map(|((lower, upper), extra)| {
            let total = upper + 1 + extra % (u64::MAX - upper);
            ContentRange::new(Some((lower, upper)), Some(total)).unwrap()
        }),
    ]
}

fn total_text() -> impl Strategy<Value = Option<u64>> {
    prop::option::of(any::<u64>())
}

fn show_total(total: Option<u64>) -> String {
    total.map_or_else(|| "*".to_owned(), |t| t.to_string())
}

proptest! {
    #![proptest_config(proptest_config())]

    #[test]
    fn content_range_parsing_never_panics_and_anything_it_accepts_is_consistent(text in content_range_text()) {
        match text.parse::<ContentRange>() {
            Ok(parsed) => {
                if let Some((lower, upper)) = parsed.range() {
                    prop_assert!(lower <= upper, "{text:?} parsed to {parsed:?}");
                    if let Some(total) = parsed.total() {
                        prop_assert!(upper < total, "{text:?} parsed to {parsed:?}");
                    }
                }
                // Neither may overflow on anything the parser accepts.
                let _ = (parsed.rows(), parsed.is_truncated());
                prop_assert_eq!(parsed.to_string().parse::<ContentRange>(), Ok(parsed));
            }
            Err(error) => prop_assert_eq!(error.value, text),
        }
    }

    #[test]
    fn every_valid_content_range_round_trips_through_display_and_parse(range in valid_content_range()) {
        let text = range.to_string();
        prop_assert!(text.bytes().all(|b| b.is_ascii_digit() || b"-/*".contains(&b)), "{text}");
        prop_assert_eq!(text.parse::<ContentRange>(), Ok(range));
        prop_assert_eq!(range.rows(), range.range().map_or(0, |(l, u)| (u - l).saturating_add(1)));
    }

    #[test]
    fn a_content_range_whose_upper_bound_is_below_its_lower_bound_is_refused(
        (upper, gap) in (any::<u64>(), 1u64..=u64::MAX),
        total in total_text(),
    ) {
        let lower = upper.saturating_add(gap);
        prop_assume!(lower > upper);
        let text = format!("{lower}-{upper}/{}", show_total(total));
        let error = text.parse::<ContentRange>().expect_err("upper < lower");
        prop_assert_eq!(error.reason, "upper bound below lower bound");
        prop_assert_eq!(error.value, text);
    }

    #[test]
    fn a_content_range_that_ends_at_or_past_its_total_is_refused((lower, upper) in bounds(), total_pick in any::<u64>()) {
        let total = (u128::from(total_pick) % (u128::from(upper) + 1)) as u64; // 0..=upper
        let text = format!("{lower}-{upper}/{total}");
        let error = text.parse::<ContentRange>().expect_err("upper >= total");
        prop_assert_eq!(error.reason, "range ends past the total");
        prop_assert_eq!(error.value, text);
    }
}
