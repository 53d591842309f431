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
    // The common case, what Envoy writes for IPv4, `a.b.c.d:port`, read without a full parse.
    if let Some(colon) = peer.bytes().position(|b| b == b':') {
        let (ip, port) = (&peer[..colon], &peer[colon + 1..]);
        if port.parse::<u16>().is_ok() && ip.parse::<std::net::Ipv4Addr>().is_ok() {
            return ip;
        }
    }
    if let Ok(sock) = peer.parse::<SocketAddr>() {
        // Borrow the address text back out of the original string.
        let ip_len = match sock {
            SocketAddr::V4(_) => peer.rfind(':').unwrap_or(peer.len()),
            SocketAddr::V6(_) => {
                return peer
                    .strip_prefix('[')
                    .and_then(|rest| rest.split_once(']'))
                    .map(|(ip, _)| ip)
                    .unwrap_or(peer)
            }
        };
        return &peer[..ip_len];
    }
    peer
}

/// The client address: the peer when `trusted_hops` is 0, else the `trusted_hops`-th
/// `X-Forwarded-For` entry from the right. When the header has fewer entries than trusted hops,
/// the peer is used: a client must not be able to choose its own key.
pub fn client_address<'a>(peer: &'a str, xff: Option<&'a str>, trusted_hops: u32) -> &'a str {
    if trusted_hops == 0 {
        return strip_port(peer);
    }
    let Some(xff) = xff else {
        return strip_port(peer);
    };
    match xff.rsplit(',').nth(trusted_hops as usize - 1) {
        Some(entry) if !entry.trim().is_empty() => entry.trim(),
        _ => strip_port(peer),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
        ] {
            assert_eq!(strip_port(peer), peer);
        }
    }

    #[test]
    fn forwarded_for_counts_trusted_hops_from_the_right() {
        let xff = Some("203.0.113.9, 198.51.100.2, 10.0.0.7");
        assert_eq!(client_address("10.0.0.9:1", xff, 0), "10.0.0.9");
        assert_eq!(client_address("10.0.0.9:1", xff, 1), "10.0.0.7");
        assert_eq!(client_address("10.0.0.9:1", xff, 2), "198.51.100.2");
        assert_eq!(client_address("10.0.0.9:1", xff, 3), "203.0.113.9");
        assert_eq!(
            client_address("10.0.0.9:1", xff, 4),
            "10.0.0.9",
            "fewer entries than hops: the peer, not a spoofable entry"
        );
        assert_eq!(client_address("10.0.0.9:1", None, 1), "10.0.0.9");
    }
}
