//! PostgREST's `Content-Range` header.
//!
//! PostgREST writes `{lower}-{upper}/{total}` with no unit prefix: `0-24/*`,
//! `0-999/5000`, `*/0`, `*/*` (PostgREST's documentation, "Pagination and Count"). The range part is
//! `*` when no rows came back; the total is `*` when nothing was counted.

use std::fmt;
use std::str::FromStr;

/// A parsed `Content-Range` value. Always consistent: its lower bound is at
/// most its upper bound, and a counted total lies beyond the range, whether
/// it was parsed or built with [`ContentRange::new`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ContentRange {
    range: Option<(u64, u64)>,
    total: Option<u64>,
}

/// A `Content-Range` value that is not one of PostgREST's forms.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("malformed Content-Range {value:?}: {reason}")]
pub struct ContentRangeError {
    /// The header as received (lossily decoded when it was not UTF-8).
    pub value: String,
    /// What is wrong with it.
    pub reason: &'static str,
}

impl ContentRange {
    /// A range of rows `lower..=upper` (`None` for `*`, no rows) out of
    /// `total` (`None` for `*`, not counted). Refused, like a header saying
    /// the same, when the upper bound is below the lower one or the range
    /// ends at or past the total.
    pub fn new(range: Option<(u64, u64)>, total: Option<u64>) -> Result<Self, ContentRangeError> {
        let candidate = ContentRange { range, total };
        let fail = |reason| ContentRangeError { value: candidate.to_string(), reason };
        if let Some((lower, upper)) = range {
            if upper < lower {
                return Err(fail("upper bound below lower bound"));
            }
            if total.is_some_and(|total| upper >= total) {
                return Err(fail("range ends past the total"));
            }
        }
        Ok(candidate)
    }

    /// The rows this response holds, inclusive; `None` for `*` (no rows).
    pub fn range(&self) -> Option<(u64, u64)> {
        self.range
    }

    /// The whole result's size; `None` for `*` (not counted).
    pub fn total(&self) -> Option<u64> {
        self.total
    }

    /// How many rows the response says it holds.
    pub fn rows(&self) -> u64 {
        match self.range {
            // Saturates: `0-18446744073709551615` parses, and its 2^64 rows do not fit.
            Some((lower, upper)) => (upper - lower).saturating_add(1),
            None => 0,
        }
    }

    /// True when the server counted more rows than this response holds from
    /// its offset on, that is when it cut the result short.
    pub fn is_truncated(&self) -> bool {
        match (self.range, self.total) {
            (Some((_, upper)), Some(total)) => upper < total.saturating_sub(1),
            (None, Some(total)) => total > 0,
            (_, None) => false,
        }
    }
}

impl FromStr for ContentRange {
    type Err = ContentRangeError;

    fn from_str(value: &str) -> Result<Self, Self::Err> {
        let fail = |reason| ContentRangeError { value: value.to_owned(), reason };
        let (range, total) = value.split_once('/').ok_or_else(|| fail("expected `range/total`"))?;
        let total = match total {
            "*" => None,
            digits => Some(parse_number(digits).ok_or_else(|| fail("total is not a number"))?),
        };
        let range = match range {
            "*" => None,
            bounds => {
                let (lower, upper) = bounds.split_once('-').ok_or_else(|| fail("expected `lower-upper`"))?;
                let lower = parse_number(lower).ok_or_else(|| fail("lower bound is not a number"))?;
                let upper = parse_number(upper).ok_or_else(|| fail("upper bound is not a number"))?;
                Some((lower, upper))
            }
        };
        ContentRange::new(range, total).map_err(|e| fail(e.reason))
    }
}

/// Plain ASCII digits only: no sign, no spaces, no `+`, which `u64::from_str` would take.
fn parse_number(s: &str) -> Option<u64> {
    if s.is_empty() || !s.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    s.parse().ok()
}

impl fmt::Display for ContentRange {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.range {
            Some((lower, upper)) => write!(f, "{lower}-{upper}/")?,
            None => f.write_str("*/")?,
        }
        match self.total {
            Some(total) => write!(f, "{total}"),
            None => f.write_str("*"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(s: &str) -> Result<ContentRange, ContentRangeError> {
        s.parse()
    }

    #[test]
    fn parses_every_postgrest_form() {
        let cases = [
            ("0-24/*", Some((0, 24)), None, 25, false),
            ("0-999/5000", Some((0, 999)), Some(5000), 1000, true),
            ("0-4/5", Some((0, 4)), Some(5), 5, false),
            ("*/0", None, Some(0), 0, false),
            ("*/*", None, None, 0, false),
            ("*/15", None, Some(15), 0, true),
            ("1-1/2", Some((1, 1)), Some(2), 1, false),
        ];
        for (text, range, total, rows, truncated) in cases {
            let parsed = parse(text).unwrap();
            assert_eq!(parsed.range, range, "{text}");
            assert_eq!(parsed.total, total, "{text}");
            assert_eq!(parsed.rows(), rows, "{text}");
            assert_eq!(parsed.is_truncated(), truncated, "{text}");
            assert_eq!(parsed.to_string(), text);
        }
    }

    #[test]
    fn a_hand_built_range_is_checked_like_a_parsed_one() {
        assert!(matches!(
            ContentRange::new(Some((5, 1)), None),
            Err(ContentRangeError { reason: "upper bound below lower bound", .. })
        ));
        assert!(matches!(
            ContentRange::new(Some((0, 9)), Some(5)),
            Err(ContentRangeError { reason: "range ends past the total", .. })
        ));
        let widest = ContentRange::new(Some((0, u64::MAX)), None).unwrap();
        assert_eq!((widest.rows(), widest.is_truncated()), (u64::MAX, false));
        assert!(ContentRange::new(Some((0, u64::MAX - 1)), Some(u64::MAX)).is_ok_and(|r| !r.is_truncated()));
        assert_eq!(ContentRange::new(None, Some(3)).unwrap().to_string(), "*/3");
    }

    #[test]
    fn rows_of_the_widest_range_does_not_overflow() {
        let widest = parse("0-18446744073709551615/*").unwrap();
        assert_eq!(widest.rows(), u64::MAX);
    }

    #[test]
    fn rejects_malformed_values_without_panicking() {
        for text in [
            "",
            "*",
            "0-24",
            "bytes 0-24/*",
            "items=0-9/10",
            "a-b/*",
            "0-/5",
            "-1/5",
            "5-1/*",
            "0-9/5",
            "0-24/x",
            "0-24/",
            "+1-2/*",
            " 0-1/2",
            "0-1/ 2",
            "*/-1",
            "0-99999999999999999999/*",
            "0-1/2/3",
        ] {
            let err = parse(text).unwrap_err();
            assert_eq!(err.value, text);
        }
    }
}
