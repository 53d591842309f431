//! Client addresses: CIDR blocks and the address behind `X-Forwarded-For`.

use std::net::{IpAddr, SocketAddr};

/// An address block such as `10.0.0.0/8` or `::1/128`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Cidr {
    network: IpAddr,
    prefix: u8,
}

impl Cidr {
    pub fn parse(text: &str) -> Result<Cidr, String> {
        let (addr, prefix) = match text.split_once('/') {
            Some((addr, prefix)) => (addr, Some(prefix)),
            None => (text, None),
        };
        let network: IpAddr = addr
            .trim()
            .parse()
            .map_err(|_| format!("{text:?} is not an IP address or CIDR block"))?;
        let max = if network.is_ipv4() { 32 } else { 128 };
        let prefix = match prefix {
            None => max,
            Some(p) => p
                .trim()
                .parse::<u8>()
                .ok()
                .filter(|p| *p <= max)
                .ok_or_else(|| format!("{text:?} has a prefix length outside 0..={max}"))?,
        };
        Ok(Cidr { network, prefix })
    }

    pub fn contains(&self, addr: IpAddr) -> bool {
        match (self.network, addr) {
            (IpAddr::V4(net), IpAddr::V4(a)) => mask_eq(
                u32::from(net) as u128,
                u32::from(a) as u128,
                self.prefix,
                32,
            ),
            (IpAddr::V6(net), IpAddr::V6(a)) => {
                mask_eq(u128::from(net), u128::from(a), self.prefix, 128)
            }
            (IpAddr::V4(_), IpAddr::V6(a)) => match a.to_ipv4_mapped() {
                Some(v4) => self.contains(IpAddr::V4(v4)),
                None => false,
            },
            (IpAddr::V6(_), IpAddr::V4(_)) => false,
        }
    }
}

fn mask_eq(a: u128, b: u128, prefix: u8, bits: u32) -> bool {
    if prefix == 0 {
        return true;
    }
    let shift = bits - prefix as u32;
    (a >> shift) == (b >> shift)
}

/// The address part of a peer address as the proxy reports it (`1.2.3.4:5678`, `[::1]:80`, or a
/// bare address).
pub fn strip_port(peer: &str) -> &str {
    peer.get(strip_port_range(peer)).unwrap_or(peer)
}

/// Where [`strip_port`]'s address lies in `peer`: the filter cuts the peer's own string down
/// to it instead of copying it.
pub fn strip_port_range(peer: &str) -> std::ops::Range<usize> {
    // The common case, what Envoy writes for IPv4, `a.b.c.d:port`, read without a full parse.
    if let Some(colon) = ipv4_end(peer.as_bytes()) {
        if peer.as_bytes().get(colon + 1..).is_some_and(is_port) {
            return 0..colon;
        }
    }
    match peer.parse::<SocketAddr>() {
        // Borrow the address text back out of the original string.
        Ok(SocketAddr::V4(_)) => 0..peer.rfind(':').unwrap_or(peer.len()),
        Ok(SocketAddr::V6(_)) => match peer.strip_prefix('[').and_then(|r| r.find(']')) {
            Some(end) => 1..1 + end,
            None => 0..peer.len(),
        },
        Err(_) => 0..peer.len(),
    }
}

/// A port as a socket address's parse takes it: 1 to 5 digits, at most 65535 (no sign).
fn is_port(text: &[u8]) -> bool {
    let mut value = 0u32;
    for &b in text {
        if !b.is_ascii_digit() {
            return false;
        }
        value = value * 10 + u32::from(b - b'0');
        if value > u16::MAX as u32 {
            return false;
        }
    }
    !text.is_empty()
}

/// Where a dotted-quad IPv4 address at the start of `text` ends, if a `:` follows it: in one
/// pass, with the rules of `Ipv4Addr`'s parse (four decimal octets of at most 255, without
/// leading zeros), so that it agrees with [`is_ipv4`] on the text before the first `:`.
fn ipv4_end(text: &[u8]) -> Option<usize> {
    let (mut dots, mut digits, mut value, mut zero) = (0, 0, 0u32, false);
    for (at, &b) in text.iter().enumerate() {
        match b {
            b'0'..=b'9' => {
                if zero || digits == 3 {
                    return None;
                }
                zero = digits == 0 && b == b'0';
                value = value * 10 + u32::from(b - b'0');
                digits += 1;
                if value > 255 {
                    return None;
                }
            }
            b'.' if digits > 0 && dots < 3 => {
                (dots, digits, value, zero) = (dots + 1, 0, 0, false);
            }
            b':' if digits > 0 && dots == 3 => return Some(at),
            _ => return None,
        }
    }
    None
}

/// A dotted-quad IPv4 address as `Ipv4Addr`'s parse takes it: four decimal octets of at most
/// 255, without leading zeros.
#[cfg(test)]
fn is_ipv4(text: &[u8]) -> bool {
    let mut octets = 0;
    for part in text.split(|&b| b == b'.') {
        octets += 1;
        let valid = match part {
            [d] => d.is_ascii_digit(),
            [b'1'..=b'9', rest @ ..] if rest.len() <= 2 => {
                rest.iter().all(u8::is_ascii_digit)
                    && part.iter().fold(0u32, |n, &d| n * 10 + u32::from(d - b'0')) <= 255
            }
            _ => false,
        };
        if !valid || octets > 4 {
            return false;
        }
    }
    octets == 4
}

/// The `trusted_hops`-th `X-Forwarded-For` entry from the right, if the header has that many
/// and it is not blank; else the peer is the client (see [`client_address`]).
pub fn forwarded_entry(xff: Option<&str>, trusted_hops: u32) -> Option<&str> {
    let hops = (trusted_hops as usize).checked_sub(1)?;
    match xff?.rsplit(',').nth(hops) {
        Some(entry) if !entry.trim().is_empty() => Some(entry.trim()),
        _ => None,
    }
}

/// The address an `X-Forwarded-For` entry names, as the text of a parsed address: `1.2.3.4`, and
/// with a port (Azure Application Gateway writes `1.2.3.4:5678`) without it; `[2001:db8::1]:443`
/// and `[2001:db8::1]` as `2001:db8::1`; `2001:DB8::1` as `2001:db8::1`. `None` when the entry is
/// not an address (`unknown`, an obfuscated `_hidden`): the request then has no client address,
/// which a rule keyed on it counts under its missing bucket, never as a fresh key per text.
pub fn forwarded_address(entry: &str) -> Option<String> {
    let entry = entry.trim();
    let ip = match entry.parse::<IpAddr>() {
        Ok(ip) => ip,
        Err(_) => match entry.parse::<SocketAddr>() {
            Ok(socket) => socket.ip(),
            Err(_) => entry
                .strip_prefix('[')
                .and_then(|rest| rest.strip_suffix(']'))
                .and_then(|inner| inner.parse::<std::net::Ipv6Addr>().ok())
                .map(IpAddr::V6)?,
        },
    };
    Some(ip.to_string())
}

/// Where [`resolve_client`] found the client address.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ClientFrom {
    /// The `trusted_hops`-th `X-Forwarded-For` entry from the right.
    Forwarded,
    /// That entry, which is not an address: the request has no client address.
    ForwardedNotAnAddress,
    /// The peer: `trusted_hops` is 0, or `X-Forwarded-For` has fewer entries than that (a client
    /// must not be able to choose its own key).
    Peer,
    /// No peer either.
    Nothing,
}

/// The client address, resolved in one place for the filter, `sluice explain` and the tests:
/// the `trusted_hops`-th `X-Forwarded-For` entry from the right ([`forwarded_address`]) when
/// `trusted_hops` is over 0 and the header has that many, else the peer without its port.
/// `xff` gives the header's lines (a repeated header is one list, RFC 9110 5.3: counted from the
/// right across all its lines); it is read only when `trusted_hops` is over 0. The peer's own
/// string is cut down to its address rather than copied.
pub fn resolve_client<'a, I>(
    mut peer: String,
    xff: impl FnOnce() -> I,
    trusted_hops: u32,
) -> (Option<String>, ClientFrom)
where
    I: IntoIterator<Item = &'a [u8]>,
{
    if trusted_hops > 0 {
        let mut joined = String::new();
        for line in xff() {
            if !joined.is_empty() {
                joined.push(',');
            }
            joined.push_str(&String::from_utf8_lossy(line));
        }
        if let Some(entry) = forwarded_entry(Some(&joined), trusted_hops) {
            return match forwarded_address(entry) {
                Some(address) => (Some(address), ClientFrom::Forwarded),
                None => (None, ClientFrom::ForwardedNotAnAddress),
            };
        }
    }
    let address = strip_port_range(&peer);
    if peer.get(address.clone()).is_some() {
        peer.truncate(address.end);
        // IPv4 starts the string: nothing to move (only IPv6 loses its bracket).
        if address.start > 0 {
            peer.drain(..address.start);
        }
    }
    if peer.is_empty() {
        (None, ClientFrom::Nothing)
    } else {
        (Some(peer), ClientFrom::Peer)
    }
}

/// [`resolve_client`] on a peer and one `X-Forwarded-For` value, the address alone.
pub fn client_address(peer: &str, xff: Option<&str>, trusted_hops: u32) -> Option<String> {
    resolve_client(peer.to_string(), || xff.map(str::as_bytes), trusted_hops).0
}

#[cfg(test)]
mod tests {
    use super::*;

    fn resolve(peer: &str, lines: &[&str], hops: u32) -> (Option<String>, ClientFrom) {
        resolve_client(
            peer.to_string(),
            || lines.iter().map(|l| l.as_bytes()),
            hops,
        )
    }

    #[test]
    fn one_resolver_for_the_client_address() {
        let peer = "192.0.2.9:4711";
        // trusted_hops 0: the peer, whatever X-Forwarded-For says.
        let seen = resolve(peer, &["203.0.113.7"], 0);
        assert_eq!(seen, (Some("192.0.2.9".into()), ClientFrom::Peer));
        // A repeated header is one list, counted from the right across its lines.
        let lines = ["198.51.100.1, 203.0.113.7", "10.0.0.1"];
        let seen = resolve(peer, &lines, 2);
        assert_eq!(seen, (Some("203.0.113.7".into()), ClientFrom::Forwarded));
        let seen = resolve(peer, &lines, 3);
        assert_eq!(seen, (Some("198.51.100.1".into()), ClientFrom::Forwarded));
        // Fewer entries than trusted hops: the peer, never an entry the client wrote.
        let seen = resolve(peer, &lines, 4);
        assert_eq!(seen, (Some("192.0.2.9".into()), ClientFrom::Peer));
        // An entry that is no address gives no address, never the peer's.
        let seen = resolve(peer, &["unknown"], 1);
        assert_eq!(seen, (None, ClientFrom::ForwardedNotAnAddress));
        let seen = resolve("[2001:db8::1]:443", &[], 1);
        assert_eq!(seen, (Some("2001:db8::1".into()), ClientFrom::Peer));
        assert_eq!(resolve("", &[], 0), (None, ClientFrom::Nothing));
    }

    #[test]
    fn cidr_contains() {
        let block = Cidr::parse("10.1.0.0/16").unwrap();
        assert!(block.contains("10.1.200.3".parse().unwrap()));
        assert!(!block.contains("10.2.0.1".parse().unwrap()));
        assert!(Cidr::parse("::1").unwrap().contains("::1".parse().unwrap()));
        assert!(Cidr::parse("0.0.0.0/0")
            .unwrap()
            .contains("8.8.8.8".parse().unwrap()));
        assert!(Cidr::parse("10.0.0.0/33").is_err());
        assert!(Cidr::parse("nope").is_err());
    }

    #[test]
    fn peer_port_is_stripped() {
        assert_eq!(strip_port("127.0.0.1:5000"), "127.0.0.1");
        assert_eq!(strip_port("[::1]:5000"), "::1");
        assert_eq!(strip_port("10.0.0.1"), "10.0.0.1");
        // What is not an address and a port stays whole, as a full parse would leave it.
        for peer in [
            "1.2.3.4:99999",
            "01.2.3.4:80",
            "1.2.3:80",
            "1.2.3.4:",
            "1.2.3.4:8a",
            "x:80",
            "1.2.3.4:+80",
            "1.2.3.4.5:80",
            "1..3.4:80",
            "256.2.3.4:80",
        ] {
            assert_eq!(strip_port(peer), peer);
        }
    }

    #[test]
    fn the_fast_path_agrees_with_a_full_parse() {
        // What the full parse of a socket address leaves of `peer`, as the fast path must.
        fn full(peer: &str) -> &str {
            match peer.parse::<SocketAddr>() {
                Ok(SocketAddr::V4(_)) => &peer[..peer.rfind(':').unwrap_or(peer.len())],
                Ok(SocketAddr::V6(_)) => &peer[1..peer.find(']').unwrap_or(1)],
                Err(_) => peer,
            }
        }
        let octets = [
            "0", "1", "09", "10", "99", "100", "199", "255", "256", "300", "999", "1000", "", "+1",
            "a",
        ];
        let ports = [
            "0", "80", "65535", "65536", "99999", "000080", "", "+80", "8a",
        ];
        for (i, a) in octets.iter().enumerate() {
            for b in &octets {
                let ip = format!("{a}.{b}.{}.{}", octets[(i + 3) % octets.len()], a);
                for port in ports {
                    let peer = format!("{ip}:{port}");
                    assert_eq!(strip_port(&peer), full(&peer), "{peer:?}");
                    assert_eq!(strip_port(&ip), ip);
                }
            }
        }
        for peer in [
            "[::1]:80",
            "[::ffff:1.2.3.4]:443",
            "::1",
            "[::1]",
            "1.2.3.4:5:6",
        ] {
            let expected = if peer.parse::<SocketAddr>().is_ok() {
                full(peer)
            } else {
                peer
            };
            assert_eq!(strip_port(peer), expected, "{peer:?}");
        }
    }

    #[test]
    fn the_one_pass_ipv4_agrees_with_the_octet_rules() {
        let parts = [
            "0", "00", "01", "1", "9", "10", "99", "100", "255", "256", "300", "1000", "",
        ];
        for a in parts {
            for b in parts {
                for (c, d) in [("1", "2"), ("255", "0"), ("0", "256"), ("", "1"), ("1", "")] {
                    for text in [
                        format!("{a}.{b}.{c}.{d}"),
                        format!("{a}.{b}.{c}"),
                        format!("{a}.{b}.{c}.{d}.1"),
                        format!("{a}.{b}x{c}.{d}"),
                    ] {
                        let with_port = format!("{text}:80");
                        let expected = is_ipv4(text.as_bytes()).then_some(text.len());
                        assert_eq!(ipv4_end(with_port.as_bytes()), expected, "{with_port:?}");
                        assert_eq!(ipv4_end(text.as_bytes()), None, "{text:?}: no colon");
                    }
                }
            }
        }
    }

    #[test]
    fn forwarded_for_counts_trusted_hops_from_the_right() {
        let xff = Some("203.0.113.9, 198.51.100.2, 10.0.0.7");
        let at = |hops| client_address("10.0.0.9:1", xff, hops);
        assert_eq!(at(0).as_deref(), Some("10.0.0.9"));
        assert_eq!(at(1).as_deref(), Some("10.0.0.7"));
        assert_eq!(at(2).as_deref(), Some("198.51.100.2"));
        assert_eq!(at(3).as_deref(), Some("203.0.113.9"));
        assert_eq!(
            at(4).as_deref(),
            Some("10.0.0.9"),
            "fewer entries than hops: the peer, not a spoofable entry"
        );
        assert_eq!(
            client_address("10.0.0.9:1", None, 1).as_deref(),
            Some("10.0.0.9")
        );
        assert_eq!(client_address("", None, 0), None, "no peer: no address");
    }

    #[test]
    fn a_forwarded_entry_with_a_port_is_its_address() {
        for (entry, address) in [
            ("203.0.113.9", Some("203.0.113.9")),
            ("203.0.113.9:5678", Some("203.0.113.9")),
            (" 203.0.113.9:443 ", Some("203.0.113.9")),
            ("[2001:db8::1]:443", Some("2001:db8::1")),
            ("[2001:db8::1]", Some("2001:db8::1")),
            ("2001:db8::1", Some("2001:db8::1")),
            ("2001:DB8:0:0::1", Some("2001:db8::1")),
            ("::ffff:203.0.113.9", Some("::ffff:203.0.113.9")),
            ("unknown", None),
            ("_hidden", None),
            ("203.0.113.9:99999", None),
            ("203.0.113.9:", None),
            ("[203.0.113.9]", None),
            ("[2001:db8::1]:", None),
            ("", None),
        ] {
            assert_eq!(forwarded_address(entry).as_deref(), address, "{entry:?}");
        }
        // Every source port of one client is one address.
        let xff = |port: u16| format!("198.18.0.1, 203.0.113.9:{port}");
        let ports: Vec<_> = (1000..1010)
            .map(|port| client_address("10.0.0.9:1", Some(&xff(port)), 1))
            .collect();
        assert!(
            ports.iter().all(|a| a.as_deref() == Some("203.0.113.9")),
            "{ports:?}"
        );
        assert_eq!(
            client_address("10.0.0.9:1", Some("198.18.0.1, unknown"), 1),
            None,
            "a trusted entry that is no address: no address, not the peer and not the text"
        );
    }
}
