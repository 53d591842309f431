//! Request paths as an upstream would read them, so that `//api/x`, `/./api/x`, `/x/../api/x`
//! and `/%61pi/x` cannot slip past a rule on `/api/`.
//!
//! [`normalize`] follows RFC 3986: percent-encoded unreserved characters are decoded
//! (section 6.2.2.2), dot segments are removed (5.2.4); beyond the RFC, as Envoy's
//! `merge_slashes` and `path_with_escaped_slashes_action` do, repeated slashes are merged and
//! encoded slashes (`%2F`, `%5C`) and backslashes count as slashes. Other escapes keep their
//! encoding, with upper-case hex digits. The query string is dropped.

use std::borrow::Cow;

/// The normalized path of `raw` (`/a/b?q` → `/a/b`); always starts with `/`.
pub fn normalize(raw: &str) -> Cow<'_, str> {
    let path = raw.split_once('?').map_or(raw, |(path, _)| path);
    if is_normal(path) {
        return Cow::Borrowed(path);
    }
    let decoded = decode_unreserved(path);
    let mut segments: Vec<&str> = Vec::new();
    let mut trailing_slash = false;
    for segment in decoded.split('/') {
        trailing_slash = false;
        match segment {
            "" => trailing_slash = true,
            "." => trailing_slash = true,
            ".." => {
                segments.pop();
                trailing_slash = true;
            }
            s => segments.push(s),
        }
    }
    let mut out = String::with_capacity(decoded.len() + 1);
    for segment in &segments {
        out.push('/');
        out.push_str(segment);
    }
    if trailing_slash || segments.is_empty() {
        out.push('/');
    }
    Cow::Owned(out)
}

/// The common case, checked without allocating: nothing to decode, no dot segment, no empty
/// segment except a trailing one.
fn is_normal(path: &str) -> bool {
    let bytes = path.as_bytes();
    if bytes.first() != Some(&b'/') {
        return false;
    }
    if bytes.iter().any(|&b| b == b'%' || b == b'\\') {
        return false;
    }
    path[1..]
        .split('/')
        .enumerate()
        .all(|(i, segment)| match segment {
            "." | ".." => false,
            "" => i == path[1..].split('/').count() - 1,
            _ => true,
        })
}

/// Decodes `%XX` escapes of unreserved characters and of slashes; turns `\` into `/`; other
/// escapes are kept, their hex digits in upper case.
fn decode_unreserved(path: &str) -> String {
    let bytes = path.as_bytes();
    let mut out = String::with_capacity(bytes.len() + 1);
    if bytes.first() != Some(&b'/') {
        out.push('/');
    }
    let mut i = 0;
    while i < bytes.len() {
        let b = bytes[i];
        if b == b'%' && i + 2 < bytes.len() {
            if let (Some(hi), Some(lo)) = (hex(bytes[i + 1]), hex(bytes[i + 2])) {
                let c = hi << 4 | lo;
                // A hex digit decoded after a `%` that starts no escape (`%%61`, `%4%31`) would
                // make a new escape, which a second normalization would decode: kept encoded.
                let tail = out.as_bytes();
                let makes_escape = hex(c).is_some()
                    && (tail.last() == Some(&b'%')
                        || (tail.len() >= 2
                            && tail[tail.len() - 2] == b'%'
                            && hex(tail[tail.len() - 1]).is_some()));
                if makes_escape {
                    out.push('%');
                    out.push(bytes[i + 1].to_ascii_uppercase() as char);
                    out.push(bytes[i + 2].to_ascii_uppercase() as char);
                } else if c.is_ascii_alphanumeric() || matches!(c, b'-' | b'.' | b'_' | b'~') {
                    out.push(c as char);
                } else if c == b'/' || c == b'\\' {
                    out.push('/');
                } else {
                    out.push('%');
                    out.push(bytes[i + 1].to_ascii_uppercase() as char);
                    out.push(bytes[i + 2].to_ascii_uppercase() as char);
                }
                i += 3;
                continue;
            }
        }
        if b == b'\\' {
            out.push('/');
            i += 1;
            continue;
        }
        // Copy the whole UTF-8 character.
        let len = utf8_len(b);
        let end = (i + len).min(bytes.len());
        out.push_str(path.get(i..end).unwrap_or("\u{fffd}"));
        i = end;
    }
    out
}

fn utf8_len(first: u8) -> usize {
    match first {
        0x00..=0x7f => 1,
        0xc0..=0xdf => 2,
        0xe0..=0xef => 3,
        0xf0..=0xf7 => 4,
        _ => 1,
    }
}

fn hex(b: u8) -> Option<u8> {
    match b {
        b'0'..=b'9' => Some(b - b'0'),
        b'a'..=b'f' => Some(b - b'a' + 10),
        b'A'..=b'F' => Some(b - b'A' + 10),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn tricks_come_out_as_the_path_they_mean() {
        for (raw, normal) in [
            ("/api/x", "/api/x"),
            ("/api/x?y=1", "/api/x"),
            ("/api/", "/api/"),
            ("/", "/"),
            ("", "/"),
            ("//api/x", "/api/x"),
            ("/./api/x", "/api/x"),
            ("/x/../api/x", "/api/x"),
            ("/%61pi/x", "/api/x"),
            ("/%2e/api/x", "/api/x"),
            ("/%2E%2E/api/x", "/api/x"),
            ("/api//x", "/api/x"),
            ("/api/x/.", "/api/x/"),
            ("/api/x/..", "/api/"),
            ("/../../api/x", "/api/x"),
            ("/x%2f..%2fapi/x", "/api/x"),
            ("/x%5c..%5capi/x", "/api/x"),
            ("\\api\\x", "/api/x"),
            ("api/x", "/api/x"),
            ("/a%20b/%zz/%", "/a%20b/%zz/%"),
            ("/a%3fb", "/a%3Fb"),
            // a `%` that starts no escape and a decoded hex digit do not make one
            ("/%%610", "/%%610"),
            ("/%4%31", "/%4%31"),
            ("/é/x", "/é/x"),
        ] {
            assert_eq!(normalize(raw), normal, "normalize({raw:?})");
        }
    }

    #[test]
    fn a_normal_path_is_not_copied() {
        assert!(matches!(normalize("/api/v1/users/"), Cow::Borrowed(_)));
        assert!(matches!(normalize("/api/x?q=1"), Cow::Borrowed(_)));
    }

    proptest! {
        #[test]
        fn normalizing_is_idempotent_and_never_panics(raw in "[/a.%2eEfF5c16\\\\?é]{0,24}") {
            let once = normalize(&raw).into_owned();
            prop_assert!(once.starts_with('/'));
            prop_assert!(!once.contains("//"), "{once}");
            prop_assert!(!once.split('/').any(|s| s == "." || s == ".."), "{once}");
            prop_assert_eq!(normalize(&once).into_owned(), once);
        }
    }
}
