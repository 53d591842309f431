//! Verified JWT claims as Envoy hands them to a Wasm filter, and the text a claim keys by.
//!
//! Envoy's `jwt_authn` writes a verified token's payload into the request's dynamic metadata, a
//! `google.protobuf.Struct` under `filter_metadata["envoy.filters.http.jwt_authn"][payload_in_metadata]`.
//! Read leaf by leaf (`proxy_get_property` on the claim's path), a claim comes as Envoy's
//! `serializeValue` writes it: a string as its bytes, a number as the 8 bytes of an `f64`, a bool as
//! one byte, an object or a list as proxy-wasm pairs, a `null` not at all; a string of 8 bytes cannot
//! be told from a number. So the filter reads the property `metadata` once per request, which Envoy
//! hands over as the serialized `envoy.config.core.v3.Metadata` message, and [`Payload::from_metadata`]
//! decodes jwt_authn's entry of it: every claim with its JSON type.
//!
//! A claim keys by its canonical JSON text ([`Payload::claim`]): a string by its text as it is, a
//! number by its shortest form (`12345`, `1.5`, `-0` as `0`), `true`, `false` and `null` by their
//! words, an object (keys sorted) or a list by its compact JSON; an object or list whose text would be
//! longer than [`MAX_KEY_BYTES`] by a SHA-256 of that text, computed as it is written (never held whole).

use std::fmt::Write;

use prost::Message;
use prost_types::{value::Kind, Struct, Value};
use sha2::{Digest, Sha256};

use crate::request::MARK;
use sluice_protocol::MAX_KEY_BYTES;

/// The `filter_metadata` namespace Envoy's `jwt_authn` writes.
pub const JWT_AUTHN: &str = "envoy.filters.http.jwt_authn";

/// `envoy.config.core.v3.Metadata`, as far as sluice reads it: `filter_metadata` (field 1, a map of
/// filter name to `google.protobuf.Struct`; on the wire, a repeated entry of key 1 and value 2).
/// `typed_filter_metadata` (field 2) is skipped.
#[derive(Clone, PartialEq, Message)]
struct Metadata {
    #[prost(message, repeated, tag = "1")]
    filter_metadata: Vec<Entry>,
}

/// One entry of `filter_metadata`: the other filters' structs are left as bytes, never decoded.
#[derive(Clone, PartialEq, Message)]
struct Entry {
    #[prost(bytes = "vec", tag = "1")]
    key: Vec<u8>,
    #[prost(bytes = "vec", tag = "2")]
    value: Vec<u8>,
}

/// A verified token's payload: every claim, with its JSON type.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Payload {
    claims: Struct,
}

impl Payload {
    /// The payload `jwt_authn` wrote under `payload_in_metadata`, from the bytes of the request's
    /// `metadata` property. `None` when there is none (no verified token) or the bytes do not decode
    /// (then every claim is absent: a rule counts the request under its missing bucket).
    pub fn from_metadata(metadata: &[u8], payload_in_metadata: &str) -> Option<Payload> {
        let metadata = Metadata::decode(metadata).ok()?;
        // A map's last entry of a key wins, as protobuf decodes maps.
        let entry = metadata
            .filter_metadata
            .iter()
            .rev()
            .find(|entry| entry.key == JWT_AUTHN.as_bytes())?;
        let filter = Struct::decode(entry.value.as_slice()).ok()?;
        match filter.fields.get(payload_in_metadata)?.kind.as_ref()? {
            Kind::StructValue(claims) => Some(Payload {
                claims: claims.clone(),
            }),
            _ => None,
        }
    }

    /// A payload of these claims (tests and tools).
    pub fn from_json(claims: &serde_json::Map<String, serde_json::Value>) -> Payload {
        Payload {
            claims: Struct {
                fields: claims
                    .iter()
                    .map(|(name, value)| (name.clone(), from_json(value)))
                    .collect(),
            },
        }
    }

    /// The canonical text of a claim (a dotted name walks into objects, and into lists by index:
    /// `org.id`, `roles.0`), `None` when the payload does not hold it, when it is the empty string,
    /// or when it cannot be read.
    pub fn claim(&self, name: &str) -> Option<String> {
        let mut segments = name.split('.');
        let mut value = self.claims.fields.get(segments.next()?)?;
        for segment in segments {
            value = match value.kind.as_ref()? {
                Kind::StructValue(object) => object.fields.get(segment)?,
                Kind::ListValue(list) => list.values.get(segment.parse::<usize>().ok()?)?,
                _ => return None,
            };
        }
        text(value).filter(|text| !text.is_empty())
    }
}

/// A JSON value as a `google.protobuf.Value`, as Envoy converts a payload (numbers as `f64`).
fn from_json(value: &serde_json::Value) -> Value {
    use serde_json::Value as J;
    let kind = match value {
        J::Null => Kind::NullValue(0),
        J::Bool(b) => Kind::BoolValue(*b),
        J::Number(n) => Kind::NumberValue(n.as_f64().unwrap_or(f64::NAN)),
        J::String(s) => Kind::StringValue(s.clone()),
        J::Array(values) => Kind::ListValue(prost_types::ListValue {
            values: values.iter().map(from_json).collect(),
        }),
        J::Object(fields) => Kind::StructValue(Struct {
            fields: fields
                .iter()
                .map(|(k, v)| (k.clone(), from_json(v)))
                .collect(),
        }),
    };
    Value { kind: Some(kind) }
}

/// The canonical text of one claim's value (see the module's documentation). A string starting
/// with [`MARK`] gets one more in front, so that no claim equals a marker sluice writes itself.
pub fn text(value: &Value) -> Option<String> {
    match value.kind.as_ref()? {
        Kind::StringValue(s) => Some(crate::request::unmarked(s).into_owned()),
        _ => {
            let mut out = Capped::default();
            write_json(value, &mut out)?;
            Some(out.finish())
        }
    }
}

/// Text kept up to [`MAX_KEY_BYTES`]; past that, only a SHA-256 of all of it.
#[derive(Default)]
struct Capped {
    text: String,
    digest: Option<Sha256>,
}

impl Capped {
    fn push(&mut self, part: &str) {
        if let Some(digest) = &mut self.digest {
            digest.update(part.as_bytes());
        } else if self.text.len() + part.len() <= MAX_KEY_BYTES {
            self.text.push_str(part);
        } else {
            let mut digest = Sha256::new();
            digest.update(self.text.as_bytes());
            digest.update(part.as_bytes());
            self.digest = Some(digest);
            self.text = String::new();
        }
    }

    fn finish(self) -> String {
        match self.digest {
            None => self.text,
            Some(digest) => {
                let mut out = String::with_capacity(8 + 64);
                out.push(MARK);
                out.push_str("sha256:");
                for byte in digest.finalize() {
                    let _ = write!(out, "{byte:02x}");
                }
                out
            }
        }
    }
}

/// Compact JSON, object keys in byte order (a `Struct`'s fields are held sorted); `None` for a
/// value without a kind (nothing Envoy writes).
fn write_json(value: &Value, out: &mut Capped) -> Option<()> {
    match value.kind.as_ref()? {
        Kind::NullValue(_) => out.push("null"),
        Kind::BoolValue(true) => out.push("true"),
        Kind::BoolValue(false) => out.push("false"),
        Kind::NumberValue(n) => out.push(&number(*n)),
        Kind::StringValue(s) => write_string(s, out),
        Kind::ListValue(list) => {
            out.push("[");
            for (i, item) in list.values.iter().enumerate() {
                if i > 0 {
                    out.push(",");
                }
                write_json(item, out)?;
            }
            out.push("]");
        }
        Kind::StructValue(object) => {
            out.push("{");
            for (i, (name, item)) in object.fields.iter().enumerate() {
                if i > 0 {
                    out.push(",");
                }
                write_string(name, out);
                out.push(":");
                write_json(item, out)?;
            }
            out.push("}");
        }
    }
    Some(())
}

/// A number's shortest text that reads back as the same `f64` (`12345`, `1.5`, `0.1`); `-0` is `0`.
/// Not finite (never from a JSON payload): `NaN`, `inf`, `-inf`.
pub fn number(n: f64) -> String {
    if n == 0.0 {
        return "0".to_string();
    }
    format!("{n}")
}

/// A JSON string literal, escaped as `serde_json` writes it.
fn write_string(s: &str, out: &mut Capped) {
    out.push("\"");
    let mut start = 0;
    for (at, c) in s.char_indices() {
        let escaped = match c {
            '"' => "\\\"",
            '\\' => "\\\\",
            '\n' => "\\n",
            '\r' => "\\r",
            '\t' => "\\t",
            '\u{8}' => "\\b",
            '\u{c}' => "\\f",
            c if (c as u32) < 0x20 => "",
            _ => continue,
        };
        out.push(&s[start..at]);
        if escaped.is_empty() {
            out.push(&format!("\\u{:04x}", c as u32));
        } else {
            out.push(escaped);
        }
        start = at + c.len_utf8();
    }
    out.push(&s[start..]);
    out.push("\"");
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    /// `metadata` as Envoy serializes it: `filter_metadata` with `entries` (filter name, struct).
    fn metadata(entries: &[(&str, Struct)]) -> Vec<u8> {
        Metadata {
            filter_metadata: entries
                .iter()
                .map(|(name, value)| Entry {
                    key: name.as_bytes().to_vec(),
                    value: value.encode_to_vec(),
                })
                .collect(),
        }
        .encode_to_vec()
    }

    fn jwt(payload: serde_json::Value) -> Struct {
        let serde_json::Value::Object(claims) = json!({ "jwt_payload": payload }) else {
            unreachable!()
        };
        Payload::from_json(&claims).claims
    }

    fn payload(claims: serde_json::Value) -> Payload {
        let bytes = metadata(&[
            ("envoy.lb", jwt(json!({"other": 1}))),
            (JWT_AUTHN, jwt(claims)),
        ]);
        Payload::from_metadata(&bytes, "jwt_payload").expect("a payload")
    }

    #[test]
    fn every_json_type_keys_by_its_canonical_text() {
        let p = payload(json!({
            "s": "alice", "n": 12345, "f": 1.5, "neg0": -0.0, "z": 0, "t": true, "no": false,
            "null": null, "big": 1e21, "small": 0.1, "eight": "12345678", "empty": "",
            "obj": {"b": [1, "x"], "a": {"d": null, "c": "q\"\n\u{1}"}},
            "list": [3, 1.25, "two", false],
            "org": {"id": 42, "name": "acme"}, "roles": ["admin", "dev"],
        }));
        let claim = |name: &str| p.claim(name);
        assert_eq!(claim("s").as_deref(), Some("alice"));
        assert_eq!(claim("n").as_deref(), Some("12345"));
        assert_eq!(claim("f").as_deref(), Some("1.5"));
        assert_eq!(claim("neg0").as_deref(), Some("0"));
        assert_eq!(claim("z").as_deref(), Some("0"));
        assert_eq!(claim("t").as_deref(), Some("true"));
        assert_eq!(claim("no").as_deref(), Some("false"));
        assert_eq!(claim("null").as_deref(), Some("null"));
        assert_eq!(claim("big").as_deref(), Some("1000000000000000000000"));
        assert_eq!(claim("small").as_deref(), Some("0.1"));
        assert_eq!(
            claim("eight").as_deref(),
            Some("12345678"),
            "a string of 8 bytes is a string"
        );
        assert_eq!(claim("empty"), None, "an empty claim is absent");
        assert_eq!(
            claim("obj").as_deref(),
            Some(r#"{"a":{"c":"q\"\n\u0001","d":null},"b":[1,"x"]}"#)
        );
        assert_eq!(claim("list").as_deref(), Some(r#"[3,1.25,"two",false]"#));
        assert_eq!(claim("org.id").as_deref(), Some("42"));
        assert_eq!(claim("roles.1").as_deref(), Some("dev"));
        for absent in ["nope", "org.nope", "roles.2", "roles.x", "s.x", "n.0", ""] {
            assert_eq!(claim(absent), None, "{absent:?}");
        }
    }

    #[test]
    fn the_payload_is_read_only_from_jwt_authn_under_its_name() {
        let other = metadata(&[("envoy.filters.http.other", jwt(json!({"sub": "x"})))]);
        assert_eq!(Payload::from_metadata(&other, "jwt_payload"), None);
        let bytes = metadata(&[(JWT_AUTHN, jwt(json!({"sub": "alice"})))]);
        assert_eq!(Payload::from_metadata(&bytes, "claims"), None);
        assert_eq!(Payload::from_metadata(&[], "jwt_payload"), None);
        let p = Payload::from_metadata(&bytes, "jwt_payload").unwrap();
        assert_eq!(p.claim("sub").as_deref(), Some("alice"));
        // A payload that is not an object is no payload.
        let scalar = metadata(&[(JWT_AUTHN, {
            let mut s = Struct::default();
            s.fields
                .insert("jwt_payload".into(), from_json(&json!("x")));
            s
        })]);
        assert_eq!(Payload::from_metadata(&scalar, "jwt_payload"), None);
    }

    #[test]
    fn garbage_and_truncated_metadata_decode_to_nothing_without_a_panic() {
        let bytes = metadata(&[(JWT_AUTHN, jwt(json!({"sub": "alice", "n": [1, {"a": 2}]})))]);
        for cut in 0..bytes.len() {
            let _ = Payload::from_metadata(&bytes[..cut], "jwt_payload");
        }
        for junk in [
            &[0xff_u8; 16][..],
            &[0x0a, 0xff, 0xff, 0xff, 0xff, 0x0f],
            &[0x0a],
        ] {
            assert_eq!(Payload::from_metadata(junk, "jwt_payload"), None);
        }
        // Nesting deeper than protobuf's recursion limit: refused, not a stack overflow.
        let mut deep = json!("bottom");
        for _ in 0..200 {
            deep = json!({ "a": deep });
        }
        let bytes = metadata(&[(JWT_AUTHN, jwt(json!({ "d": deep })))]);
        assert_eq!(Payload::from_metadata(&bytes, "jwt_payload"), None);
    }

    #[test]
    fn a_huge_claim_keys_by_a_digest_of_bounded_size() {
        let roles: Vec<String> = (0..50_000).map(|i| format!("role-{i}")).collect();
        let p = payload(json!({ "roles": roles, "other": roles[..49_999] }));
        let text = p.claim("roles").unwrap();
        assert!(text.starts_with("\u{1e}sha256:"), "{text:?}");
        assert_eq!(text.len(), 1 + 7 + 64);
        assert_ne!(p.claim("other"), p.claim("roles"), "every byte is digested");
        // Just at the bound: the text itself.
        let s = "x".repeat(MAX_KEY_BYTES - 4);
        assert_eq!(
            payload(json!({ "l": [s] })).claim("l").unwrap().len(),
            MAX_KEY_BYTES
        );
        let s = "x".repeat(MAX_KEY_BYTES - 3);
        assert_eq!(payload(json!({ "l": [s] })).claim("l").unwrap().len(), 72);
    }

    #[test]
    fn a_claim_cannot_pass_for_a_marker() {
        let p = payload(json!({"sub": "\u{1e}missing"}));
        assert_eq!(p.claim("sub").as_deref(), Some("\u{1e}\u{1e}missing"));
        assert_ne!(p.claim("sub").as_deref(), Some(crate::request::MISSING));
    }
}
