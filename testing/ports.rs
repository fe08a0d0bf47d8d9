//! Loopback ports for servers a test restarts on the address they had,
//! shared by the test trees of several crates (each includes this file
//! with `#[path]`).
//!
//! A server that picks port 0 gets one from the kernel's ephemeral range,
//! which is also where outgoing connections get their local ports. While
//! such a server is down for a restart, a connection made by any test
//! running beside it can take the port, and the restart then fails with
//! "Address already in use" (CI saw it both for a worker whose static
//! ring named its port in advance and for a worker restarted after a
//! simulated power cut). Ports drawn here lie outside that range, so only
//! another draw could take one, and no process hands a port out twice.

use std::collections::BTreeSet;
use std::sync::Mutex;

/// A loopback port nothing listens on, outside the ephemeral range, never
/// handed out before by this process.
pub fn unused_port() -> u16 {
    static GIVEN: Mutex<BTreeSet<u16>> = Mutex::new(BTreeSet::new());
    let (eph_lo, eph_hi) = ephemeral_range();
    let mut given = GIVEN.lock().unwrap_or_else(|e| e.into_inner());
    let seed = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or(0)
        ^ (u64::from(std::process::id()) << 32);
    for draw in 0..10_000u64 {
        let port = 10_000 + (splitmix(seed ^ draw) % 55_000) as u16;
        if (eph_lo..=eph_hi).contains(&port) || given.contains(&port) {
            continue;
        }
        if std::net::TcpListener::bind(("127.0.0.1", port)).is_ok() {
            given.insert(port);
            return port;
        }
    }
    panic!("no free loopback port outside the ephemeral range {eph_lo}-{eph_hi} in 10000 draws")
}

/// The kernel's range for the ports it picks itself (Linux's default
/// where the file cannot be read).
pub fn ephemeral_range() -> (u16, u16) {
    std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|text| {
            let mut words = text.split_whitespace().map(|w| w.parse::<u16>().ok());
            Some((words.next()??, words.next()??))
        })
        .unwrap_or((32_768, 60_999))
}

fn splitmix(x: u64) -> u64 {
    let mut z = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}
