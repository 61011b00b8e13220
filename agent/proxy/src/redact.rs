//! What of a tool call's request is kept out of the journal: headers that look like
//! secrets, the headers a tool names, and the JSON values it points at. The journal is
//! append-only and hash-chained, so a secret written there cannot be taken back; the
//! request the tool receives is never changed, and its fingerprint is taken from the
//! bytes as sent.

use bytes::Bytes;
use http::{HeaderMap, HeaderName};
use outrigger_journal::Headers;

use crate::headers;

/// What replaces a redacted JSON value in the journaled request body.
pub const REDACTED: &str = "<redacted>";

/// Words that make a request header's (or query parameter's) name look like it
/// carries a secret. `key` covers `x-api-key`, `api_key`, `x-functions-key` and
/// `ocp-apim-subscription-key` alike.
const SECRET_WORDS: [&str; 10] = [
    "auth",
    "token",
    "secret",
    "password",
    "passwd",
    "key",
    "credential",
    "cookie",
    "session",
    "signature",
];

/// The request's target as journaled: the tool's base URL and the path, with the
/// value of each query parameter whose name looks like it carries a secret
/// replaced by `<redacted>` (see [`secret_parameter`]).
pub fn target(base: &str, rest: &str) -> String {
    let base = base.trim_end_matches('/');
    let Some((path, query)) = rest.split_once('?') else {
        return format!("{base}{rest}");
    };
    let params: Vec<String> = query
        .split('&')
        .map(|param| match param.split_once('=') {
            Some((name, _)) if secret_parameter(name) => format!("{name}={REDACTED}"),
            _ => param.to_owned(),
        })
        .collect();
    format!("{base}{path}?{}", params.join("&"))
}

/// A query parameter's name that looks like it carries a secret, word by word
/// (words split at punctuation and at camelCase humps, so a parameter such as
/// `author` or `keyword` is data): a word that is `sig`, `auth` or
/// `authorization`, that contains `password`, `passwd`, `secret`, `token`,
/// `credential`, `signature`, `session` or `cookie` (plurals and run-together
/// names such as `jsessionid` included), or that ends in `key` or `keys`
/// (`api_key`, `apiKey`, `userPassword`, `access_tokens`, `X-Amz-Security-Token`,
/// `oauthSignature`). Over-redacting a data parameter costs the journal a value; a
/// secret written there cannot be taken back.
fn secret_parameter(name: &str) -> bool {
    const WHOLE: [&str; 3] = ["sig", "auth", "authorization"];
    const WITHIN: [&str; 8] = [
        "password",
        "passwd",
        "secret",
        "token",
        "credential",
        "signature",
        "session",
        "cookie",
    ];
    // Either way of splitting may find it: `userPassword` by its humps,
    // `passWord` only whole.
    words(name, false).chain(words(name, true)).any(|word| {
        WHOLE.contains(&word.as_str())
            || WITHIN.iter().any(|w| word.contains(w))
            || word.ends_with("key")
            || word.ends_with("keys")
    })
}

/// The words of a name, lower-cased: split at anything not alphanumeric and, with
/// `humps`, where a lower-case letter or digit is followed by an upper-case one
/// (`apiKey`).
fn words(name: &str, humps: bool) -> impl Iterator<Item = String> + '_ {
    let mut words = Vec::new();
    let mut word = String::new();
    let mut prev_lower = false;
    for c in name.chars() {
        if !c.is_ascii_alphanumeric() {
            words.push(std::mem::take(&mut word));
            prev_lower = false;
            continue;
        }
        if humps && c.is_ascii_uppercase() && prev_lower {
            words.push(std::mem::take(&mut word));
        }
        prev_lower = c.is_ascii_lowercase() || c.is_ascii_digit();
        word.push(c.to_ascii_lowercase());
    }
    words.push(word);
    words.into_iter().filter(|w| !w.is_empty())
}

/// A tool's own redactions, on top of the built-in ones.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Redactions {
    /// Request headers never journaled (lower-case names).
    pub headers: Vec<HeaderName>,
    /// JSON Pointers (RFC 6901) into the request body whose values are journaled as
    /// `"<redacted>"`.
    pub json: Vec<String>,
}

/// Whether a request header is kept out of the journal: the agent's credentials,
/// any name containing one of [`SECRET_WORDS`], and the tool's own list.
pub fn is_secret_request_header(name: &HeaderName, tool: &Redactions) -> bool {
    headers::is_credential(name)
        || SECRET_WORDS.iter().any(|w| name.as_str().contains(w))
        || tool.headers.contains(name)
}

/// The request headers as journaled.
pub fn request_headers(h: &HeaderMap, tool: &Redactions) -> Headers {
    Headers::redacted(
        h.iter()
            .filter(|(k, _)| !is_secret_request_header(k, tool))
            .map(|(k, v)| {
                (
                    k.to_string(),
                    String::from_utf8_lossy(v.as_bytes()).into_owned(),
                )
            }),
    )
}

/// The request body as journaled: with the tool's JSON Pointers, each value they
/// reach is replaced by `"<redacted>"`. A pointer that reaches nothing leaves the
/// body as it is. A body the pointers cannot be applied to (not JSON to this
/// parser: compressed, too deeply nested, a lone surrogate) could hold what they
/// name, so it is not kept: a placeholder with its size and SHA-256 stands for it.
pub fn request_body(body: &Bytes, tool: &Redactions) -> Bytes {
    if tool.json.is_empty() || body.trim_ascii().is_empty() {
        return body.clone();
    }
    let Ok(mut value) = serde_json::from_slice::<serde_json::Value>(body) else {
        use sha2::Digest;
        return Bytes::from(format!(
            "<not journaled: {} bytes that redact_json could not be applied to (not JSON); \
             sha256 {}>",
            body.len(),
            crate::keys::hex(&sha2::Sha256::digest(body))
        ));
    };
    let mut changed = false;
    for pointer in &tool.json {
        if let Some(v) = value.pointer_mut(pointer) {
            *v = serde_json::Value::String(REDACTED.to_owned());
            changed = true;
        }
    }
    if !changed {
        return body.clone();
    }
    serde_json::to_vec(&value).map_or_else(|_| body.clone(), Bytes::from)
}

/// Why a JSON Pointer from the configuration is not one (`None`: it is).
pub fn pointer_problem(pointer: &str) -> Option<String> {
    if pointer.is_empty() {
        return Some(
            "an empty pointer would redact the whole body; name the values, e.g. \"/card/number\""
                .into(),
        );
    }
    if !pointer.starts_with('/') {
        return Some(format!(
            "{pointer:?} is not a JSON Pointer: it must start with '/', e.g. \"/card/number\""
        ));
    }
    // `~` must be followed by 0 or 1 (RFC 6901 §3).
    let mut chars = pointer.chars().peekable();
    while let Some(c) = chars.next() {
        if c == '~' && !matches!(chars.peek(), Some('0' | '1')) {
            return Some(format!(
                "{pointer:?}: '~' must be written ~0 and '/' inside a name ~1 (RFC 6901)"
            ));
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    fn map(pairs: &[(&'static str, &'static str)]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for (k, v) in pairs {
            h.append(*k, v.parse().unwrap());
        }
        h
    }

    #[test]
    fn secret_looking_and_named_headers_are_not_journaled() {
        let tool = Redactions {
            headers: vec![HeaderName::from_static("x-tenant")],
            json: Vec::new(),
        };
        let h = map(&[
            ("content-type", "application/json"),
            ("authorization", "Bearer a"),
            ("x-auth-token", "b"),
            ("x-goog-api-key", "c"),
            ("x-amz-security-token", "d"),
            ("x-client-secret", "e"),
            ("x-session-id", "f"),
            ("x-hub-signature-256", "g"),
            ("ocp-apim-subscription-key", "i"),
            ("x-functions-key", "j"),
            ("api_key", "k"),
            ("x-credential", "l"),
            ("x-tenant", "h"),
            ("x-trace", "keep"),
        ]);
        let kept: Vec<(String, String)> = request_headers(&h, &tool)
            .iter()
            .map(|(k, v)| (k.to_owned(), v.to_owned()))
            .collect();
        assert_eq!(
            kept,
            [
                ("content-type".to_owned(), "application/json".to_owned()),
                ("x-trace".to_owned(), "keep".to_owned()),
            ]
        );
    }

    #[test]
    fn secret_looking_query_parameters_are_not_journaled() {
        assert_eq!(
            target(
                "https://maps.example/",
                "/geocode?q=paris&key=AIza1&Sig=abc&limit=5"
            ),
            "https://maps.example/geocode?q=paris&key=<redacted>&Sig=<redacted>&limit=5"
        );
        assert_eq!(
            target("http://t", "/a?access_token=x&flag&page=2"),
            "http://t/a?access_token=<redacted>&flag&page=2"
        );
        assert_eq!(target("http://t/", "/plain"), "http://t/plain");
        // Data whose names only contain such a word is kept.
        assert_eq!(
            target(
                "http://t",
                "/s?author=tolstoy&keyword=rust&apiKey=k&X-Amz-Security-Token=t"
            ),
            "http://t/s?author=tolstoy&keyword=rust&apiKey=<redacted>&X-Amz-Security-Token=<redacted>"
        );
        // Run together, camelCase and plural.
        for name in [
            "userPassword",
            "newPassword",
            "sessionId",
            "jsessionid",
            "oauthSignature",
            "api_keys",
            "tokens",
            "client_secrets",
            "AUTH",
            "refreshToken",
            "user%5Fpassword",
            "passWord",
            "PassWd",
            "sessionID",
        ] {
            assert!(secret_parameter(name), "{name}");
        }
        for name in ["author", "keyword", "q", "page", "sort_by", "authority"] {
            assert!(!secret_parameter(name), "{name}");
        }
        assert_eq!(
            words("X-Amz-Security-Token", true).collect::<Vec<_>>(),
            ["x", "amz", "security", "token"]
        );
        assert_eq!(
            words("userID2Key", true).collect::<Vec<_>>(),
            ["user", "id2", "key"]
        );
        assert_eq!(
            words("userID2Key", false).collect::<Vec<_>>(),
            ["userid2key"]
        );
    }

    #[test]
    fn pointed_json_values_are_replaced() {
        let tool = Redactions {
            headers: Vec::new(),
            json: vec![
                "/card/number".into(),
                "/items/1/code".into(),
                "/a~1b".into(),
                "/absent".into(),
            ],
        };
        let body = Bytes::from_static(
            br#"{"card":{"number":"4111","exp":"12/29"},"items":[{"code":1},{"code":{"x":2}}],"a/b":true}"#,
        );
        let out: serde_json::Value = serde_json::from_slice(&request_body(&body, &tool)).unwrap();
        assert_eq!(
            out,
            serde_json::json!({
                "card": {"number": "<redacted>", "exp": "12/29"},
                "items": [{"code": 1}, {"code": "<redacted>"}],
                "a/b": "<redacted>",
            })
        );
        // Nothing pointed at: the bytes as they were.
        let other = Bytes::from_static(br#"{ "x" : 1 }"#);
        assert_eq!(request_body(&other, &tool), other);
        // What the pointers cannot be applied to is not kept: its size and digest.
        for body in [
            &b"card=4111"[..],
            br#"{"card":{"number":"4111"},"note":"\ud83d"}"#,
            b"\x1f\x8b\x08\x00card",
        ] {
            let out = request_body(&Bytes::copy_from_slice(body), &tool);
            let out = String::from_utf8(out.to_vec()).expect("text");
            assert!(!out.contains("4111"), "{out}");
            assert!(
                out.starts_with(&format!("<not journaled: {} bytes", body.len()))
                    && out.contains("sha256 "),
                "{out}"
            );
        }
        // No body (a keyed GET or DELETE) is no body.
        assert_eq!(request_body(&Bytes::new(), &tool), Bytes::new());
        // Without pointers nothing is redacted, whatever the body.
        let none = Redactions::default();
        let text = Bytes::from_static(b"card=4111");
        assert_eq!(request_body(&text, &none), text);
    }

    #[test]
    fn pointers_are_checked() {
        assert_eq!(pointer_problem("/card/number"), None);
        assert_eq!(pointer_problem("/a~0b/c~1d"), None);
        assert!(pointer_problem("").is_some());
        assert!(
            pointer_problem("card")
                .unwrap()
                .contains("must start with '/'")
        );
        assert!(pointer_problem("/a~2").unwrap().contains("RFC 6901"));
    }
}
