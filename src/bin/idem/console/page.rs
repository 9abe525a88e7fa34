//! The page: one HTML document carrying the session token, its script and
//! its style sheet, each a same-origin file embedded in the binary (no
//! inline script, nothing fetched from elsewhere).

use std::sync::Arc;

use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::Router;

use super::session::SessionToken;

const INDEX_HTML: &str = include_str!("page/index.html");
const CONSOLE_JS: &str = include_str!("page/console.js");
const CONSOLE_CSS: &str = include_str!("page/console.css");

/// Where the page's HTML holds the token.
const TOKEN_SLOT: &str = "{{SESSION_TOKEN}}";

/// The page's routes: `/`, `/console.js`, `/console.css`, and an empty
/// `/favicon.ico`.
pub(crate) fn router(token: &SessionToken) -> Router {
    // Hex digits only: nothing in the token can break out of the attribute.
    let index: Arc<str> = INDEX_HTML.replace(TOKEN_SLOT, token.as_str()).into();
    Router::new()
        .route("/", get(move || async move { file(index.to_string(), "text/html; charset=utf-8") }))
        .route("/console.js", get(|| async { file(CONSOLE_JS.to_owned(), "text/javascript; charset=utf-8") }))
        .route("/console.css", get(|| async { file(CONSOLE_CSS.to_owned(), "text/css; charset=utf-8") }))
        // The icon browsers ask for by themselves: none.
        .route("/favicon.ico", get(|| async { StatusCode::NO_CONTENT }))
}

fn file(body: String, content_type: &'static str) -> Response {
    ([(header::CONTENT_TYPE, HeaderValue::from_static(content_type))], body).into_response()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_page_has_one_token_slot_and_no_inline_script_or_style() {
        assert_eq!(INDEX_HTML.matches(TOKEN_SLOT).count(), 1);
        assert_eq!(INDEX_HTML.matches("<script").count(), 1, "the one same-origin script");
        assert!(INDEX_HTML.contains(r#"<script src="/console.js" defer></script>"#));
        assert!(!INDEX_HTML.contains("<style") && !INDEX_HTML.contains("style="));
        assert!(!has_event_attribute(INDEX_HTML), "no inline event handler");
        assert!(!INDEX_HTML.contains("http://") && !INDEX_HTML.contains("https://"), "nothing from elsewhere");
        let script = CONSOLE_JS.replace("http://www.w3.org/2000/svg", "");
        assert!(!script.contains("http://") && !script.contains("https://"), "nothing from elsewhere");
        assert!(!script.contains("innerHTML"), "text goes in as text, never as markup");
    }

    /// Whether `html` holds an attribute like ` onclick=`.
    fn has_event_attribute(html: &str) -> bool {
        html.match_indices(" on").any(|(at, _)| {
            let rest = &html[at + 3..];
            let name: String = rest.chars().take_while(char::is_ascii_alphabetic).collect();
            !name.is_empty() && rest[name.len()..].starts_with('=')
        })
    }
}
