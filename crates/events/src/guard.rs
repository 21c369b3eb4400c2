//! Where an endpoint may be (decision 0602): a tenant names its URL, so without a guard it
//! could point nudge-events at the cloud's metadata service or a database inside the network.
//!
//! The guard decides on addresses, before any connection: a literal address in the URL is
//! checked as it is, and a host name is resolved by [`GuardedResolver`] (the HTTP client's only
//! resolver), which refuses the name when any address it resolves to is refused, so the client
//! never holds an address the guard did not pass (a rebinding answer included).
//!
//! Refused unless `events.allow_addresses` names a range holding it: loopback, private
//! (RFC 1918), link-local (169.254.0.0/16, the metadata services), shared (100.64.0.0/10),
//! unspecified, broadcast, multicast, documentation and benchmarking ranges, IPv6 unique-local
//! and link-local, and the IPv4 ranges reached through IPv4-mapped or NAT64 IPv6 addresses.
//!
//! It must never pass an address it did not check, nor let a name through whose resolution
//! failed.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::sync::Arc;

use ipnet::IpNet;

/// An address the guard refuses, and why (the range's name).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("address {address} refused: {range} (events.allow_addresses does not name it)")]
pub struct AddressRefused {
    pub address: IpAddr,
    pub range: &'static str,
}

/// The ranges an endpoint may not be in, with the exceptions configured.
#[derive(Debug, Clone, Default)]
pub struct AddressGuard {
    allowed: Vec<IpNet>,
}

impl AddressGuard {
    /// A guard passing the special-purpose ranges listed in `allowed` (CIDR, `127.0.0.0/8`).
    pub fn new(allowed: Vec<IpNet>) -> Self {
        Self { allowed }
    }

    /// `Err` naming the range when `address` is in a refused one that no exception covers.
    pub fn check(&self, address: IpAddr) -> Result<(), AddressRefused> {
        let Some(range) = special_range(address) else {
            return Ok(());
        };
        if self.allowed.iter().any(|net| net.contains(&address)) {
            return Ok(());
        }
        Err(AddressRefused { address, range })
    }
}

/// The name of the special-purpose range holding `address`, `None` for a public address.
pub fn special_range(address: IpAddr) -> Option<&'static str> {
    match address {
        IpAddr::V4(v4) => special_v4(v4),
        IpAddr::V6(v6) => special_v6(v6),
    }
}

fn special_v4(a: Ipv4Addr) -> Option<&'static str> {
    let [o0, o1, o2, _] = a.octets();
    if a.is_loopback() {
        Some("loopback")
    } else if a.is_private() {
        Some("private (RFC 1918)")
    } else if a.is_link_local() {
        Some("link-local (metadata services)")
    } else if a.is_unspecified() || o0 == 0 {
        Some("unspecified (\"this network\")")
    } else if a.is_broadcast() {
        Some("broadcast")
    } else if a.is_multicast() || o0 >= 240 {
        Some("multicast or reserved")
    } else if o0 == 100 && (64..128).contains(&o1) {
        Some("shared address space (RFC 6598)")
    } else if (o0 == 192 && o1 == 0 && o2 == 0) || (o0 == 192 && o1 == 88 && o2 == 99) {
        Some("IETF protocol assignments")
    } else if a.is_documentation() {
        Some("documentation")
    } else if o0 == 198 && (o1 == 18 || o1 == 19) {
        Some("benchmarking (RFC 2544)")
    } else {
        None
    }
}

fn special_v6(a: Ipv6Addr) -> Option<&'static str> {
    let segments = a.segments();
    if let Some(v4) = a.to_ipv4_mapped() {
        return special_v4(v4);
    }
    // NAT64 (64:ff9b::/96) reaches the IPv4 address in its last 32 bits.
    if segments[..6] == [0x64, 0xff9b, 0, 0, 0, 0] {
        let [.., hi, lo] = segments;
        let v4 = Ipv4Addr::from((u32::from(hi) << 16) | u32::from(lo));
        return special_v4(v4);
    }
    // 6to4 (2002::/16) reaches the IPv4 address in its second and third segments.
    if segments[0] == 0x2002 {
        let v4 = Ipv4Addr::from((u32::from(segments[1]) << 16) | u32::from(segments[2]));
        return special_v4(v4);
    }
    if a.is_loopback() {
        Some("loopback")
    } else if a.is_unspecified() {
        Some("unspecified")
    } else if segments[0] == 0x0064 && segments[1] == 0xff9b && segments[2] == 0x0001 {
        Some("local-use NAT64 (64:ff9b:1::/48)")
    } else if segments[0] == 0x2001 && segments[1] == 0 {
        Some("Teredo (2001::/32)")
    } else if segments[..4] == [0x0100, 0, 0, 0] {
        Some("discard-only (100::/64)")
    } else if (segments[0] & 0xffc0) == 0xfec0 {
        Some("site-local (fec0::/10)")
    } else if a.is_multicast() {
        Some("multicast")
    } else if (segments[0] & 0xfe00) == 0xfc00 {
        Some("unique local (fc00::/7)")
    } else if (segments[0] & 0xffc0) == 0xfe80 {
        Some("link-local (fe80::/10)")
    } else if segments[0] == 0x2001 && segments[1] == 0x0db8 {
        Some("documentation")
    } else if segments[..6] == [0, 0, 0, 0, 0, 0] {
        Some("IPv4-compatible (deprecated)")
    } else {
        None
    }
}

/// The HTTP client's resolver: the system's answer, refused whole when any address in it is
/// refused by the guard.
#[derive(Debug, Clone)]
pub struct GuardedResolver {
    guard: Arc<AddressGuard>,
}

impl GuardedResolver {
    pub fn new(guard: Arc<AddressGuard>) -> Self {
        Self { guard }
    }
}

impl reqwest::dns::Resolve for GuardedResolver {
    fn resolve(&self, name: reqwest::dns::Name) -> reqwest::dns::Resolving {
        let guard = self.guard.clone();
        Box::pin(async move {
            let host = name.as_str().to_owned();
            let addresses: Vec<SocketAddr> =
                tokio::net::lookup_host((host.as_str(), 0)).await?.collect();
            for address in &addresses {
                guard.check(address.ip())?;
            }
            let addresses: reqwest::dns::Addrs = Box::new(addresses.into_iter());
            Ok(addresses)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ip(text: &str) -> IpAddr {
        text.parse()
            .unwrap_or_else(|_| panic!("{text} is an address"))
    }

    #[test]
    fn the_ranges_an_endpoint_may_not_be_in_are_refused_and_named() {
        let guard = AddressGuard::default();
        for (address, range) in [
            ("10.0.0.1", "private (RFC 1918)"),
            ("172.16.5.4", "private (RFC 1918)"),
            ("192.168.1.1", "private (RFC 1918)"),
            ("169.254.169.254", "link-local (metadata services)"),
            ("127.0.0.1", "loopback"),
            ("0.0.0.0", "unspecified (\"this network\")"),
            ("100.64.0.1", "shared address space (RFC 6598)"),
            ("255.255.255.255", "broadcast"),
            ("224.0.0.1", "multicast or reserved"),
            ("::1", "loopback"),
            ("fd00::1", "unique local (fc00::/7)"),
            ("fe80::1", "link-local (fe80::/10)"),
            ("::ffff:10.0.0.1", "private (RFC 1918)"),
            ("::ffff:169.254.169.254", "link-local (metadata services)"),
            ("64:ff9b::a9fe:a9fe", "link-local (metadata services)"),
            ("2002:0a00:0001::1", "private (RFC 1918)"),
            ("2002:a9fe:a9fe::", "link-local (metadata services)"),
            ("64:ff9b:1::a00:1", "local-use NAT64 (64:ff9b:1::/48)"),
            ("2001:0:4136:e378::1", "Teredo (2001::/32)"),
            ("100::1", "discard-only (100::/64)"),
            ("fec0::1", "site-local (fec0::/10)"),
        ] {
            let refused = guard.check(ip(address)).unwrap_err();
            assert_eq!(refused.range, range, "{address}");
            assert!(refused.to_string().contains(range), "{refused}");
        }
    }

    #[test]
    fn public_addresses_pass() {
        let guard = AddressGuard::default();
        for address in [
            "93.184.215.14",
            "8.8.8.8",
            "2606:4700::1111",
            "::ffff:8.8.8.8",
        ] {
            assert_eq!(guard.check(ip(address)), Ok(()), "{address}");
        }
    }

    #[test]
    fn an_allowed_range_passes_and_only_it() {
        let guard = AddressGuard::new(vec!["127.0.0.0/8".parse().unwrap()]);
        assert_eq!(guard.check(ip("127.0.0.1")), Ok(()));
        assert_eq!(guard.check(ip("127.10.0.7")), Ok(()));
        assert!(guard.check(ip("::1")).is_err());
        assert!(guard.check(ip("10.0.0.1")).is_err());
    }

    #[tokio::test]
    async fn the_resolver_refuses_a_name_resolving_to_a_refused_address() {
        use reqwest::dns::Resolve as _;
        let resolver = GuardedResolver::new(Arc::new(AddressGuard::default()));
        let name: reqwest::dns::Name = "localhost".parse().unwrap();
        let Err(e) = resolver.resolve(name).await else {
            panic!("localhost resolved through the guard");
        };
        let refused = e
            .downcast_ref::<AddressRefused>()
            .expect("the guard's refusal");
        assert_eq!(refused.range, "loopback");

        let allowing = GuardedResolver::new(Arc::new(AddressGuard::new(vec![
            "127.0.0.0/8".parse().unwrap(),
            "::1/128".parse().unwrap(),
        ])));
        let name: reqwest::dns::Name = "localhost".parse().unwrap();
        let addresses: Vec<SocketAddr> = allowing.resolve(name).await.unwrap().collect();
        assert!(!addresses.is_empty());
        assert!(addresses.iter().all(|a| a.ip().is_loopback()));
    }
}
