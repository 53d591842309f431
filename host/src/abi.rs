//! The proxy-wasm ABI 0.2.1 wire vocabulary: status codes, enum values and the header-map codec.

/// A proxy-wasm status (`WasmResult` in proxy-wasm-cpp-host), as returned by every host call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u32)]
pub enum Status {
    Ok = 0,
    NotFound = 1,
    BadArgument = 2,
    SerializationFailure = 3,
    ParseFailure = 4,
    InvalidMemoryAccess = 6,
    Empty = 7,
    CasMismatch = 8,
    InternalFailure = 10,
    BrokenConnection = 11,
    Unimplemented = 12,
}

/// A proxy-wasm log level (`proxy_log`, `proxy_get_log_level`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum LogLevel {
    Trace = 0,
    Debug = 1,
    Info = 2,
    Warn = 3,
    Error = 4,
    Critical = 5,
}

impl LogLevel {
    /// The level for a raw ABI value; values above `Critical` are clamped to it.
    pub fn from_raw(raw: u32) -> LogLevel {
        match raw {
            0 => LogLevel::Trace,
            1 => LogLevel::Debug,
            2 => LogLevel::Info,
            3 => LogLevel::Warn,
            4 => LogLevel::Error,
            _ => LogLevel::Critical,
        }
    }
}

/// What a filter callback asked the host to do with the stream.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Action {
    Continue,
    Pause,
}

impl Action {
    pub(crate) fn from_raw(raw: u32) -> Action {
        if raw == 0 {
            Action::Continue
        } else {
            Action::Pause
        }
    }
}

/// `proxy_get_header_map_pairs` & co: which header map.
pub(crate) mod map_type {
    pub const REQUEST_HEADERS: u32 = 0;
    pub const REQUEST_TRAILERS: u32 = 1;
    pub const RESPONSE_HEADERS: u32 = 2;
    pub const RESPONSE_TRAILERS: u32 = 3;
    pub const GRPC_INITIAL_METADATA: u32 = 4;
    pub const GRPC_TRAILING_METADATA: u32 = 5;
    pub const HTTP_CALL_RESPONSE_HEADERS: u32 = 6;
    pub const HTTP_CALL_RESPONSE_TRAILERS: u32 = 7;
}

/// `proxy_get_buffer_bytes`: which buffer.
pub(crate) mod buffer_type {
    pub const HTTP_REQUEST_BODY: u32 = 0;
    pub const HTTP_CALL_RESPONSE_BODY: u32 = 4;
    pub const VM_CONFIGURATION: u32 = 6;
    pub const PLUGIN_CONFIGURATION: u32 = 7;
    pub const MAX: u32 = 8;
}

/// `proxy_continue_stream` / `proxy_close_stream`: which direction.
pub(crate) mod stream_type {
    pub const HTTP_REQUEST: u32 = 0;
    pub const HTTP_RESPONSE: u32 = 1;
}

/// An ordered list of header (or metadata) pairs, keys as the filter or test spelled them.
pub type Headers = Vec<(String, String)>;

/// Serializes pairs the way the host hands them to the guest: a u32 count, then a (key length,
/// value length) u32 pair per entry, then each key and value followed by a NUL byte.
pub(crate) fn serialize_pairs(pairs: &[(String, String)]) -> Vec<u8> {
    let size: usize = 4 + pairs
        .iter()
        .map(|(k, v)| 10 + k.len() + v.len())
        .sum::<usize>();
    let mut bytes = Vec::with_capacity(size);
    bytes.extend_from_slice(&(pairs.len() as u32).to_le_bytes());
    for (key, value) in pairs {
        bytes.extend_from_slice(&(key.len() as u32).to_le_bytes());
        bytes.extend_from_slice(&(value.len() as u32).to_le_bytes());
    }
    for (key, value) in pairs {
        bytes.extend_from_slice(key.as_bytes());
        bytes.push(0);
        bytes.extend_from_slice(value.as_bytes());
        bytes.push(0);
    }
    bytes
}

/// Parses pairs a guest serialized; `None` when the bytes are malformed. Invalid UTF-8 is
/// replaced rather than refused: header values are bytes on the wire.
pub(crate) fn deserialize_pairs(bytes: &[u8]) -> Option<Headers> {
    if bytes.is_empty() {
        return Some(Vec::new());
    }
    let word = |at: usize| -> Option<usize> {
        let raw: [u8; 4] = bytes.get(at..at.checked_add(4)?)?.try_into().ok()?;
        Some(u32::from_le_bytes(raw) as usize)
    };
    let count = word(0)?;
    let mut sizes = Vec::with_capacity(count.min(1024));
    for i in 0..count {
        let at = 4usize.checked_add(i.checked_mul(8)?)?;
        sizes.push((word(at)?, word(at + 4)?));
    }
    let mut at = 4usize.checked_add(count.checked_mul(8)?)?;
    let mut pairs = Vec::with_capacity(sizes.len());
    for (key_len, value_len) in sizes {
        let key = bytes.get(at..at.checked_add(key_len)?)?;
        at = at.checked_add(key_len)?.checked_add(1)?;
        let value = bytes.get(at..at.checked_add(value_len)?)?;
        at = at.checked_add(value_len)?.checked_add(1)?;
        pairs.push((
            String::from_utf8_lossy(key).into_owned(),
            String::from_utf8_lossy(value).into_owned(),
        ));
    }
    Some(pairs)
}

/// The first value of `name` (ASCII case-insensitive) in `headers`.
pub fn header<'a>(headers: &'a [(String, String)], name: &str) -> Option<&'a str> {
    headers
        .iter()
        .find(|(key, _)| key.eq_ignore_ascii_case(name))
        .map(|(_, value)| value.as_str())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pairs_round_trip() {
        let pairs = vec![
            (":path".to_string(), "/a".to_string()),
            ("x-empty".to_string(), String::new()),
        ];
        assert_eq!(deserialize_pairs(&serialize_pairs(&pairs)), Some(pairs));
    }

    #[test]
    fn malformed_pairs_are_refused_not_panicked_on() {
        assert_eq!(deserialize_pairs(&[1, 0, 0, 0, 5]), None);
        assert_eq!(deserialize_pairs(&[255, 255, 255, 255]), None);
        let mut truncated = serialize_pairs(&[("k".into(), "value".into())]);
        truncated.truncate(truncated.len() - 3);
        assert_eq!(deserialize_pairs(&truncated), None);
    }
}
