//! The chat page `GET /` serves (`--no-webui` turns it off): one HTML document with its CSS and
//! JavaScript (`webui.html`, embedded in the binary; it fetches nothing from elsewhere). It chats
//! through `/v1/chat/completions` with `"stream": true` and shows `/stats` beside the chat.
//!
//! Model output is only ever set as text (the page's Markdown renderer builds elements and text
//! nodes; it never parses output as HTML). As a second line of defence the page is served with a
//! Content-Security-Policy that runs only its own script and style (a fresh nonce per response),
//! fetches only from this server, and loads no image but `data:` ones.

use axum::http::{header, HeaderValue};
use axum::response::{IntoResponse, Response};

const PAGE: &str = include_str!("webui.html");

/// The placeholder in `webui.html` each response's nonce replaces.
const NONCE: &str = "__CSP_NONCE__";

/// 128 random bits, hex: from the kernel's generator, or (where it cannot be read) from the
/// clock and the address of a fresh allocation.
fn nonce() -> String {
    use std::io::Read;
    let mut b = [0u8; 16];
    let read = std::fs::File::open("/dev/urandom").and_then(|mut f| f.read_exact(&mut b));
    if read.is_err() {
        let t = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos());
        let at = Box::new(0u8);
        let x = t ^ ((&*at as *const u8 as usize as u128) << 64);
        b = x.to_le_bytes();
    }
    b.iter().map(|x| format!("{x:02x}")).collect()
}

pub(crate) fn page() -> Response {
    let nonce = nonce();
    let csp = format!(
        "default-src 'none'; script-src 'nonce-{nonce}'; style-src 'nonce-{nonce}'; connect-src 'self'; \
         img-src 'self' data:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
    );
    let headers = [
        (
            header::CONTENT_TYPE,
            HeaderValue::from_static("text/html; charset=utf-8"),
        ),
        (header::CACHE_CONTROL, HeaderValue::from_static("no-store")),
        (header::X_CONTENT_TYPE_OPTIONS, HeaderValue::from_static("nosniff")),
        (header::REFERRER_POLICY, HeaderValue::from_static("no-referrer")),
        (
            header::CONTENT_SECURITY_POLICY,
            HeaderValue::from_str(&csp).expect("a nonce is hex"),
        ),
    ];
    (headers, PAGE.replace(NONCE, &nonce)).into_response()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_page_is_self_contained_and_every_nonce_is_replaced() {
        // Two places take the nonce: the style and the script.
        assert_eq!(PAGE.matches(NONCE).count(), 2);
        // Nothing is loaded from elsewhere (the policy would refuse it anyway).
        for bad in [
            "src=\"http",
            "href=\"http",
            "@import",
            "url(http",
            "<link rel=\"stylesheet\"",
        ] {
            assert!(!PAGE.contains(bad), "the page loads {bad}…");
        }
        // Model output is never parsed as HTML.
        for bad in [
            "innerHTML",
            "outerHTML",
            "insertAdjacentHTML",
            "document.write",
            "eval(",
        ] {
            assert!(!PAGE.contains(bad), "the page uses {bad}");
        }
        let (a, b) = (nonce(), nonce());
        assert_eq!(a.len(), 32);
        assert_ne!(a, b);
    }
}
