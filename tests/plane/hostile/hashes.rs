//! Request hashes: the hash ignores key order, whitespace and
//! string escapes at every depth, is SHA-256 of the independently written
//! JCS form, survives a JSON text round trip, changes with any leaf or key,
//! and parses back only from 64 lowercase hex digits.

use idempotency_plane::{InvalidInput, RequestHash};
use proptest::prelude::*;
use proptest::sample::Index;
use serde_json::{json, Map, Number, Value};
use sha2::{Digest, Sha256};

use crate::hostile::proptest_config;

fn is_lower_hex_sha256(s: &str) -> bool {
    s.len() == 64 && s.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'))
}

/// Strings that stress escaping and ordering: any chars (controls, NUL,
/// astral), and a few chosen ones.
fn text() -> impl Strategy<Value = String> {
    prop_oneof![
        4 => prop::collection::vec(any::<char>(), 0..12).prop_map(String::from_iter),
        1 => prop::sample::select(vec![
            "", "\"", "\\", "/", "\u{0}", "\u{1F}", "\u{7F}", "\u{2028}", "é", "e\u{301}", "🦀", "\u{FFFF}",
            "\u{E000}", "\u{10000}", "שלום", "\u{202E}abc", "a", "A", "aa", "{}", "[]", "null",
        ])
        .prop_map(str::to_owned),
    ]
}

/// Numbers: any i64 and u64, finite f64, and decimal spellings beyond u64
/// (`arbitrary_precision` keeps them exact).
fn number() -> impl Strategy<Value = Number> {
    prop_oneof![
        any::<i64>().prop_map(Number::from),
        any::<u64>().prop_map(Number::from),
        any::<f64>().prop_filter_map("finite", Number::from_f64),
        "-?[1-9][0-9]{0,39}(\\.[0-9]{1,12})?([eE][+-]?[0-9]{1,2})?"
            .prop_filter_map("a JSON number", |s| s.parse::<Number>().ok()),
    ]
}

fn leaf() -> impl Strategy<Value = Value> {
    prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::Bool),
        number().prop_map(Value::Number),
        text().prop_map(Value::String),
        Just(json!([])),
        Just(json!({})),
    ]
}

fn json_value() -> impl Strategy<Value = Value> {
    leaf().prop_recursive(4, 48, 6, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..6).prop_map(Value::Array),
            prop::collection::vec((text(), inner), 0..6)
                .prop_map(|entries| Value::Object(entries.into_iter().collect::<Map<String, Value>>())),
        ]
    })
}

/// A small deterministic PRNG, so a rendering is a function of its seed and
/// shrinks with it.
struct SplitMix(u64);

impl SplitMix {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
}

/// Insignificant JSON whitespace.
fn whitespace(rng: &mut SplitMix, out: &mut String) {
    for _ in 0..rng.below(3) {
        out.push([' ', '\n', '\t', '\r'][rng.below(4)]);
    }
}

/// A JSON string literal for `s`, escaping each character one of the ways
/// JSON allows (`\uXXXX` with surrogate pairs, short escapes, or raw).
fn render_string(s: &str, rng: &mut SplitMix, out: &mut String) {
    out.push('"');
    for c in s.chars() {
        let must_escape = c == '"' || c == '\\' || (c as u32) < 0x20;
        if must_escape || rng.below(3) == 0 {
            if c == '/' && rng.below(2) == 0 {
                out.push_str("\\/");
                continue;
            }
            let mut units = [0u16; 2];
            for unit in c.encode_utf16(&mut units) {
                out.push_str(&format!("\\u{unit:04x}"));
            }
        } else {
            out.push(c);
        }
    }
    out.push('"');
}

/// `value` as JSON text with every object's keys in a random order, random
/// whitespace and random string escapes. Numbers keep their spelling.
fn render(value: &Value, rng: &mut SplitMix, out: &mut String) {
    whitespace(rng, out);
    match value {
        Value::Object(map) => {
            let mut entries: Vec<(&String, &Value)> = map.iter().collect();
            for i in (1..entries.len()).rev() {
                entries.swap(i, rng.below(i + 1));
            }
            out.push('{');
            for (i, (key, item)) in entries.into_iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                whitespace(rng, out);
                render_string(key, rng, out);
                whitespace(rng, out);
                out.push(':');
                render(item, rng, out);
            }
            whitespace(rng, out);
            out.push('}');
        }
        Value::Array(items) => {
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                render(item, rng, out);
            }
            whitespace(rng, out);
            out.push(']');
        }
        Value::String(s) => render_string(s, rng, out),
        scalar => out.push_str(&scalar.to_string()),
    }
    whitespace(rng, out);
}

fn rendered(value: &Value, seed: u64) -> Value {
    let mut text = String::new();
    render(value, &mut SplitMix(seed), &mut text);
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("the rendering {text:?} is not JSON: {e}"))
}

/// The documented canonical form, written independently: keys sorted by
/// their UTF-8 bytes at every depth, no whitespace, numbers by value (64-bit
/// integers as digits; else the f64, integral below 2^53 as an integer,
/// otherwise its shortest round-trip text), other scalars as serde_json
/// writes them.
fn canonical(value: &Value, out: &mut String) {
    match value {
        Value::Object(map) => {
            let mut entries: Vec<(&String, &Value)> = map.iter().collect();
            // RFC 8785: member names in the order of their UTF-16 code units.
            entries.sort_by_key(|(name, _)| name.encode_utf16().collect::<Vec<u16>>());
            out.push('{');
            for (i, (key, item)) in entries.into_iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                out.push_str(&Value::String(key.clone()).to_string());
                out.push(':');
                canonical(item, out);
            }
            out.push('}');
        }
        Value::Array(items) => {
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                canonical(item, out);
            }
            out.push(']');
        }
        // RFC 8785: the double a number denotes, as ECMAScript writes it
        // (the vectors pin that against the reference implementation).
        Value::Number(n) => match n.as_f64() {
            Some(f) if f.is_finite() => out.push_str(ryu_js::Buffer::new().format_finite(f)),
            _ => out.push_str(&n.to_string()),
        },
        scalar => out.push_str(&scalar.to_string()),
    }
}

/// Every leaf, counting empty arrays and objects as leaves.
/// Whether two leaves denote the same JSON value, as RFC 8785 reads them: a
/// number by the double it denotes (`-0`, `0.0` and `0` are one number, and
/// so are `1e1` and `10`), anything else as written. A leaf replaced by the
/// same value is no change of the request.
fn same_leaf(a: &Value, b: &Value) -> bool {
    match (a, b) {
        (Value::Number(a), Value::Number(b)) => a.as_f64() == b.as_f64(),
        _ => a == b,
    }
}

fn leaves_mut(value: &mut Value) -> Vec<&mut Value> {
    let is_leaf = match &*value {
        Value::Array(items) => items.is_empty(),
        Value::Object(map) => map.is_empty(),
        _ => true,
    };
    if is_leaf {
        return vec![value];
    }
    match value {
        Value::Array(items) => items.iter_mut().flat_map(leaves_mut).collect(),
        Value::Object(map) => map.values_mut().flat_map(leaves_mut).collect(),
        _ => Vec::new(),
    }
}

/// Non-empty objects, counted in pre-order.
fn count_objects(value: &Value) -> usize {
    match value {
        Value::Array(items) => items.iter().map(count_objects).sum(),
        Value::Object(map) => usize::from(!map.is_empty()) + map.values().map(count_objects).sum::<usize>(),
        _ => 0,
    }
}

/// The `n`th non-empty object in pre-order.
fn nth_object<'a>(value: &'a mut Value, n: &mut usize) -> Option<&'a mut Map<String, Value>> {
    match value {
        Value::Array(items) => items.iter_mut().find_map(|item| nth_object(item, n)),
        Value::Object(map) => {
            if !map.is_empty() {
                if *n == 0 {
                    return Some(map);
                }
                *n -= 1;
            }
            map.values_mut().find_map(|item| nth_object(item, n))
        }
        _ => None,
    }
}

proptest! {
    #![proptest_config(proptest_config())]

    #[test]
    fn the_request_hash_ignores_key_order_whitespace_and_string_escapes_at_every_depth(
        value in json_value(),
        seeds in (any::<u64>(), any::<u64>()),
    ) {
        let hash = RequestHash::of_json(&value);
        prop_assert_eq!(RequestHash::of_json(&rendered(&value, seeds.0)), hash.clone());
        prop_assert_eq!(RequestHash::of_json(&rendered(&value, seeds.1)), hash);
    }

    #[test]
    fn the_request_hash_is_sha256_of_the_jcs_form(value in json_value()) {
        let mut text = String::new();
        canonical(&value, &mut text);
        let hash = RequestHash::of_json(&value);
        prop_assert_eq!(hash.as_str(), hex::encode(Sha256::digest(text.as_bytes())));
    }

    #[test]
    fn a_request_hash_survives_a_json_text_round_trip(value in json_value()) {
        // What a retry sees when the request was journaled as JSON text and
        // parsed again. Holds with `arbitrary_precision` (feature `local`);
        // serde_json's default float parsing is not exact, see the report.
        let text = serde_json::to_string(&value).expect("a Value serializes");
        let parsed: Value = serde_json::from_str(&text).expect("its own text parses");
        prop_assert_eq!(RequestHash::of_json(&parsed), RequestHash::of_json(&value));
    }

    #[test]
    fn changing_any_leaf_changes_the_request_hash(value in json_value(), pick in any::<Index>(), replacement in leaf()) {
        let mut changed = value.clone();
        let same = {
            let mut leaves = leaves_mut(&mut changed);
            let slot = pick.index(leaves.len());
            let same = same_leaf(leaves[slot], &replacement);
            *leaves[slot] = replacement;
            same
        };
        prop_assume!(!same);
        prop_assert_ne!(RequestHash::of_json(&changed), RequestHash::of_json(&value));
    }

    #[test]
    fn renaming_any_object_key_changes_the_request_hash(value in json_value(), picks in (any::<Index>(), any::<Index>()), name in text()) {
        let objects = count_objects(&value);
        prop_assume!(objects > 0);
        let mut changed = value.clone();
        {
            let map = nth_object(&mut changed, &mut picks.0.index(objects)).expect("the nth object");
            prop_assume!(!map.contains_key(&name));
            let old = map.keys().nth(picks.1.index(map.len())).expect("a non-empty map").clone();
            let item = map.remove(&old).expect("the key is there");
            map.insert(name, item);
        }
        prop_assert_ne!(RequestHash::of_json(&changed), RequestHash::of_json(&value));
    }

    #[test]
    fn every_request_hash_is_64_lowercase_hex_and_parses_back(value in json_value(), bytes in prop::collection::vec(any::<u8>(), 0..64)) {
        for hash in [RequestHash::of_json(&value), RequestHash::of_bytes(&bytes)] {
            prop_assert!(is_lower_hex_sha256(hash.as_str()), "{hash:?}");
            prop_assert_eq!(hash.to_string(), hash.as_str());
            prop_assert_eq!(hash.as_str().parse::<RequestHash>(), Ok(hash.clone()));
        }
    }

    #[test]
    fn request_hash_parsing_accepts_64_lowercase_hex_digits(s in "[0-9a-f]{64}") {
        let parsed = s.parse::<RequestHash>().expect("64 lowercase hex digits");
        prop_assert_eq!(parsed.as_str(), s.as_str());
    }

    #[test]
    fn request_hash_parsing_refuses_one_wrong_character_or_a_wrong_length(
        hex in "[0-9a-f]{64}",
        position in 0usize..64,
        wrong in any::<char>().prop_filter("not lowercase hex", |c| !matches!(c, '0'..='9' | 'a'..='f')),
        length in prop_oneof![0usize..64, 65usize..200],
    ) {
        let mut one_wrong: Vec<char> = hex.chars().collect();
        one_wrong[position] = wrong;
        let one_wrong = String::from_iter(one_wrong);
        let wrong_length = "0123456789abcdef".chars().cycle().take(length).collect::<String>();
        for bad in [one_wrong, wrong_length] {
            let expected = InvalidInput::MalformedHash { value: bad.chars().take(80).collect() };
            prop_assert_eq!(bad.parse::<RequestHash>(), Err(expected), "{:?}", bad);
        }
    }

    #[test]
    fn request_hash_parsing_accepts_an_arbitrary_string_only_when_it_is_64_lowercase_hex(
        s in prop_oneof![
            prop::collection::vec(any::<char>(), 0..100).prop_map(String::from_iter),
            "[0-9a-fA-F \u{e9}]{62,66}",
        ],
    ) {
        match s.parse::<RequestHash>() {
            Ok(hash) => {
                prop_assert!(is_lower_hex_sha256(&s), "{s:?} was accepted");
                prop_assert_eq!(hash.as_str(), s.as_str());
            }
            Err(error) => {
                prop_assert!(!is_lower_hex_sha256(&s), "{s:?} was refused");
                prop_assert_eq!(error, InvalidInput::MalformedHash { value: s.chars().take(80).collect() });
            }
        }
    }
}
