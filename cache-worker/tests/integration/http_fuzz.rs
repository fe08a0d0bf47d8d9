//! HTTP fuzzing against a running worker (loopback, bounded count):
//! random methods, paths, headers, ranges, tokens, bodies and truncated
//! connections. The worker never panics, never answers 500 to a client's
//! mistake, and serves a correct read afterwards.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use bytes::Bytes;
use lakecache_protocol::testing::fuzz_cases;
use lakecache_protocol::token::{Claims, KeyRing, SigningKey};
use lakecache_worker::AccessPolicy;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use crate::harness::{sha, uri, Harness};

static WORKER_PANICS: AtomicUsize = AtomicUsize::new(0);

fn pick<'a>(rng: &mut StdRng, options: &[&'a str]) -> &'a str {
    options[rng.random_range(0..options.len())]
}

fn junk(rng: &mut StdRng, max: usize) -> String {
    const ALPHABET: &[u8] = b"abcXYZ019/._-~%?&=#:;@!$'()*+, \t\"\\<>[]{}|^`\x7f";
    let len = rng.random_range(0..=max);
    (0..len)
        .map(|_| ALPHABET[rng.random_range(0..ALPHABET.len())] as char)
        .collect()
}

/// One request's head and body, with the byte count to send (less than
/// all of it: a truncated connection).
fn request(rng: &mut StdRng, good_token: &str, foreign_token: &str) -> (Vec<u8>, usize) {
    if rng.random_bool(0.25) {
        return plausible(rng, good_token);
    }
    let method = pick(
        rng,
        &[
            "GET", "HEAD", "PUT", "DELETE", "POST", "PATCH", "OPTIONS", "BREW", "get",
        ],
    );
    let route = pick(
        rng,
        &[
            "/v1/objects/",
            "/v1/pages/",
            "/v1/stat/",
            "/v1/list/",
            "/metrics",
            "/v1/health",
            "/",
            "//v1/objects/",
            "/v1/objects",
        ],
    );
    let long_bucket = "b".repeat(70);
    let bucket = pick(
        rng,
        &[
            "data",
            "other",
            "DATA",
            "no_such",
            "",
            "..",
            "%2e%2e",
            "a",
            &long_bucket,
        ],
    );
    let key = match rng.random_range(0..6) {
        0 => "fuzz/known.bin".to_string(),
        1 => format!("fuzz/{}", junk(rng, 30)),
        2 => "../../etc/passwd".into(),
        3 => "%00%ff%fe/%2F%25".into(),
        4 => "k".repeat(rng.random_range(1000..3000)),
        _ => junk(rng, 12),
    };
    let query = match rng.random_range(0..4) {
        0 => String::new(),
        1 => format!(
            "?prefix={}&delimiter=/&max-keys={}",
            junk(rng, 8),
            rng.random_range(-5i64..5000)
        ),
        2 => format!("?{}", junk(rng, 40)),
        _ => "?continuation-token=%ZZ&max-keys=abc".into(),
    };
    let mut head = format!(
        "{method} {route}{bucket}/{key}{query} HTTP/1.1\r\nhost: fuzz\r\nconnection: close\r\n"
    );
    let mut headers = BTreeMap::new();
    if rng.random_bool(0.8) {
        let auth = match rng.random_range(0..5) {
            0 => format!("Bearer {good_token}"),
            1 => format!("Bearer {foreign_token}"),
            2 => format!("Bearer {}", junk(rng, 60)),
            3 => format!("Basic {}", junk(rng, 20)),
            _ => {
                // One character of a good token changed.
                let mut t = good_token.as_bytes().to_vec();
                let i = rng.random_range(0..t.len());
                t[i] = b"AZaz09_-."[rng.random_range(0..9)];
                format!("Bearer {}", String::from_utf8_lossy(&t))
            }
        };
        headers.insert("authorization", auth);
    }
    if rng.random_bool(0.4) {
        let range = match rng.random_range(0..5) {
            0 => format!(
                "bytes={}-{}",
                rng.random_range(0..5000u64),
                rng.random_range(0..5000u64)
            ),
            1 => format!("bytes=-{}", rng.random_range(0..u64::MAX)),
            2 => format!("bytes={}-", rng.random_range(0..u64::MAX)),
            3 => "bytes=0-1,5-9".into(),
            _ => junk(rng, 20),
        };
        headers.insert("range", range);
    }
    if rng.random_bool(0.2) {
        headers.insert("if-match", junk(rng, 20));
    }
    if rng.random_bool(0.15) {
        let src = pick(
            rng,
            &[
                "/v1/objects/other/x",
                "/v1/objects/data/fuzz/known.bin",
                "s3://data/x",
                "",
            ],
        );
        headers.insert("x-lakecache-copy-source", src.to_string() + &junk(rng, 5));
    }
    if rng.random_bool(0.15) {
        headers.insert("x-lakecache-offset", junk(rng, 6));
        headers.insert("x-lakecache-from", junk(rng, 6));
    }
    let body: Vec<u8> = (0..rng.random_range(0..4096))
        .map(|_| rng.random())
        .collect();
    let chunked = rng.random_bool(0.15);
    if chunked {
        headers.insert("transfer-encoding", "chunked".into());
    } else if rng.random_bool(0.9) {
        // Sometimes a length that does not match the body.
        let declared = match rng.random_range(0..6) {
            0 => body.len() + rng.random_range(1..100),
            1 => body.len().saturating_sub(1),
            _ => body.len(),
        };
        headers.insert("content-length", declared.to_string());
    }
    for (k, v) in headers {
        head.push_str(&format!("{k}: {v}\r\n"));
    }
    head.push_str("\r\n");
    let mut bytes = head.into_bytes();
    if chunked {
        bytes
            .extend_from_slice(format!("{:x}\r\n", body.len() + rng.random_range(0..2)).as_bytes());
        bytes.extend_from_slice(&body);
        bytes.extend_from_slice(b"\r\n0\r\n\r\n");
    } else {
        bytes.extend_from_slice(&body);
    }
    let send = if rng.random_bool(0.1) {
        rng.random_range(0..bytes.len())
    } else {
        bytes.len()
    };
    (bytes, send)
}

/// A well-formed request a real client could send, so the fuzz also
/// runs the paths that succeed (reads, ranges, writes, listings, deletes).
fn plausible(rng: &mut StdRng, token: &str) -> (Vec<u8>, usize) {
    let key = pick(
        rng,
        &["fuzz/known.bin", "fuzz/a", "fuzz/b/c", "fuzz/missing"],
    );
    let auth = format!("authorization: Bearer {token}\r\n");
    let head = |line: String, extra: String| {
        format!("{line} HTTP/1.1\r\nhost: fuzz\r\nconnection: close\r\n{auth}{extra}\r\n")
    };
    let bytes = match rng.random_range(0..6) {
        0 | 1 => {
            let start = rng.random_range(0..400_000u64);
            let end = start + rng.random_range(0..100_000u64);
            head(
                format!("GET /v1/objects/data/{key}"),
                format!("range: bytes={start}-{end}\r\n"),
            )
            .into_bytes()
        }
        2 => head(format!("GET /v1/stat/data/{key}"), String::new()).into_bytes(),
        3 => head(
            "GET /v1/list/data?prefix=fuzz/&delimiter=/".into(),
            String::new(),
        )
        .into_bytes(),
        4 if key != "fuzz/known.bin" => {
            let body: Vec<u8> = (0..rng.random_range(0..50_000))
                .map(|_| rng.random())
                .collect();
            let mut bytes = head(
                format!("PUT /v1/objects/data/{key}"),
                format!("content-length: {}\r\n", body.len()),
            )
            .into_bytes();
            bytes.extend_from_slice(&body);
            bytes
        }
        _ if key != "fuzz/known.bin" => {
            head(format!("DELETE /v1/objects/data/{key}"), String::new()).into_bytes()
        }
        _ => head(format!("HEAD /v1/objects/data/{key}"), String::new()).into_bytes(),
    };
    let send = bytes.len();
    (bytes, send)
}

/// Sends `bytes[..send]` (and for a truncated request, closes its side:
/// the client went away) and returns the status (0: none).
async fn exchange(addr: std::net::SocketAddr, bytes: &[u8], send: usize) -> u16 {
    let Ok(mut conn) = tokio::net::TcpStream::connect(addr).await else {
        return 0;
    };
    let _ = conn.write_all(&bytes[..send]).await;
    if send < bytes.len() {
        let _ = conn.shutdown().await;
    }
    let mut buf = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(5), conn.read_to_end(&mut buf)).await;
    String::from_utf8_lossy(&buf)
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn random_requests_never_crash_the_worker_or_get_500() {
    let previous = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        let here = info
            .location()
            .map(|l| l.file().to_string())
            .unwrap_or_default();
        if here.contains("cache-worker/src") || here.contains("protocol/src") {
            WORKER_PANICS.fetch_add(1, Ordering::SeqCst);
        }
        previous(info);
    }));
    let key = SigningKey::generate("k1");
    let keys = KeyRing::new(key.clone(), None);
    let h = Harness::with(|o| {
        o.access = AccessPolicy {
            keys: Some(keys),
            allow: vec!["s3://data/".into()],
            protect_metrics: false,
        };
        o.limits.body_idle_timeout = Duration::from_secs(2);
    })
    .await;
    let claims = |tenant: &str, scope: &str| Claims {
        tenant: tenant.into(),
        kid: String::new(),
        exp: 4_000_000_000,
        read: vec![scope.into()],
        write: vec![scope.into()],
        peer: false,
        operator: false,
        members_key: None,
    };
    let good = key.mint(&claims("fuzz", "s3://data/fuzz/"));
    let foreign = SigningKey::generate("k1").mint(&claims("fuzz", "s3://data/"));
    let known = Bytes::from((0..300_000u32).map(|i| (i % 251) as u8).collect::<Vec<_>>());
    let client = h.client.clone().with_token(Some(&good)).unwrap();
    client
        .put_bytes(&uri("fuzz/known.bin"), known.clone())
        .await
        .unwrap();

    let cases = fuzz_cases(20_000) as usize;
    let mut rng = StdRng::seed_from_u64(0x1a4ec0de);
    let mut statuses: BTreeMap<u16, usize> = BTreeMap::new();
    let mut failures = Vec::new();
    let mut unanswered = Vec::new();
    for batch in 0..cases.div_ceil(16) {
        let requests: Vec<(Vec<u8>, usize)> = (0..16.min(cases - batch * 16))
            .map(|_| request(&mut rng, &good, &foreign))
            .collect();
        let answers = futures::future::join_all(
            requests
                .iter()
                .map(|(bytes, send)| exchange(h.addr(), bytes, *send)),
        )
        .await;
        for ((bytes, send), status) in requests.iter().zip(answers) {
            *statuses.entry(status).or_default() += 1;
            // A refusal sent before a body was read can be lost to the
            // reset of the close; a complete request without a body must
            // always get an answer.
            let bodyless = !String::from_utf8_lossy(bytes).contains("\r\ncontent-length: ")
                && !String::from_utf8_lossy(bytes).contains("transfer-encoding");
            if status == 0 && *send == bytes.len() && bodyless && unanswered.len() < 5 {
                unanswered
                    .push(String::from_utf8_lossy(&bytes[..bytes.len().min(300)]).into_owned());
            }
            if status >= 500 && failures.len() < 5 {
                let head = String::from_utf8_lossy(&bytes[..(*send).min(300)]).into_owned();
                failures.push(format!("{status} for {head:?}"));
            }
        }
    }
    eprintln!("{cases} fuzzed requests, statuses: {statuses:?}");
    assert!(
        failures.is_empty(),
        "server errors for client input: {failures:#?}"
    );
    assert!(
        unanswered.is_empty(),
        "requests left unanswered: {unanswered:#?}"
    );
    assert_eq!(
        WORKER_PANICS.load(Ordering::SeqCst),
        0,
        "the worker panicked"
    );

    // Still serving, and serving the right bytes.
    let read = client.read(&uri("fuzz/known.bin"), None).await.unwrap();
    assert_eq!(sha(&read), sha(&known));
    let part = client
        .read(&uri("fuzz/known.bin"), Some(1000..2000))
        .await
        .unwrap();
    assert_eq!(part, known.slice(1000..2000));
}
