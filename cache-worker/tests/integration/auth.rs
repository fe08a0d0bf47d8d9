//! Tokens and the allow-list, route by route: no token is 401; a forged,
//! expired, foreign-key or out-of-scope token is 403; a token in scope
//! works; a read-only token cannot write, delete or copy. Nothing refused
//! reaches S3.

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use lakecache_protocol::token::{Claims, KeyRing, SigningKey};
use lakecache_protocol::{ClientError, WorkerClient};
use lakecache_worker::AccessPolicy;

use crate::harness::{uri, Harness, OTHER_BUCKET};

fn claims(tenant: &str, read: &[&str], write: &[&str], exp: u64) -> Claims {
    Claims {
        tenant: tenant.into(),
        kid: String::new(),
        exp,
        read: read.iter().map(|s| s.to_string()).collect(),
        write: write.iter().map(|s| s.to_string()).collect(),
        peer: false,
        operator: false,
        members_key: None,
    }
}

const LATER: u64 = 4_000_000_000;

/// The code of a refusal, or "ok".
fn outcome<T>(r: Result<T, ClientError>) -> String {
    match r {
        Ok(_) => "ok".into(),
        Err(ClientError::Api { code, status, .. }) => format!("{status} {code:?}"),
        Err(e) => format!("error {e}"),
    }
}

struct Callers {
    none: WorkerClient,
    team_a: WorkerClient,
    read_only: WorkerClient,
    team_b: WorkerClient,
    expired: WorkerClient,
    forged: WorkerClient,
}

fn callers(h: &Harness, key: &SigningKey) -> Callers {
    let with = |token: String| h.client.clone().with_token(Some(&token)).unwrap();
    let team_a = claims(
        "team-a",
        &["s3://data/datasets/"],
        &["s3://data/team-a/"],
        LATER,
    );
    let mut forged_token = key.mint(&claims("team-b", &[], &["s3://data/team-b/"], LATER));
    // Swap in team-a's payload under team-b's signature.
    let a = key.mint(&team_a);
    let (a_head, _) = a.rsplit_once('.').unwrap();
    let (_, b_tag) = forged_token.rsplit_once('.').unwrap();
    forged_token = format!("{a_head}.{b_tag}");
    Callers {
        none: h.client.clone(),
        team_a: with(key.mint(&team_a)),
        read_only: with(key.mint(&claims(
            "readers",
            &["s3://data/datasets/", "s3://data/team-a/"],
            &[],
            LATER,
        ))),
        team_b: with(key.mint(&claims(
            "team-b",
            &["s3://data/team-b/"],
            &["s3://data/team-b/"],
            LATER,
        ))),
        expired: with(key.mint(&claims("team-a", &["s3://data/"], &["s3://data/"], 1))),
        forged: with(forged_token),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn every_route_checks_the_token_before_touching_s3() {
    let key = SigningKey::generate("k1");
    let keys = KeyRing::new(key.clone(), None);
    let h = Harness::with(|o| {
        o.access = AccessPolicy {
            keys: Some(keys),
            allow: Vec::new(),
            protect_metrics: false,
        }
    })
    .await;
    h.put_direct("datasets/shard-0.bin", b"tokens").await;
    h.put_direct("team-a/ckpt.pt", b"weights").await;
    let c = callers(&h, &key);
    let shard = uri("datasets/shard-0.bin");
    let ckpt = uri("team-a/ckpt.pt");
    let gets = h.gets();

    // Reads: only tokens whose scope covers the object.
    for (who, client, want) in [
        ("none", &c.none, "401 Unauthenticated"),
        ("expired", &c.expired, "403 OutOfScope"),
        ("forged", &c.forged, "403 OutOfScope"),
        ("team-b", &c.team_b, "403 OutOfScope"),
        ("team-a", &c.team_a, "ok"),
        ("read-only", &c.read_only, "ok"),
    ] {
        assert_eq!(
            outcome(client.read(&shard, None).await),
            want,
            "read by {who}"
        );
        assert_eq!(outcome(client.stat(&shard).await), want, "stat by {who}");
    }
    assert_eq!(h.gets(), gets + 1, "refused reads reached S3");

    // Writes and deletes need write scope.
    let body = Bytes::from_static(b"new");
    for (who, client, want) in [
        ("none", &c.none, "401 Unauthenticated"),
        ("read-only", &c.read_only, "403 OutOfScope"),
        ("team-b", &c.team_b, "403 OutOfScope"),
        ("expired", &c.expired, "403 OutOfScope"),
    ] {
        assert_eq!(
            outcome(client.put_bytes(&ckpt, body.clone()).await),
            want,
            "put by {who}"
        );
        assert_eq!(outcome(client.delete(&ckpt).await), want, "delete by {who}");
        assert_eq!(
            outcome(
                client
                    .copy(&shard, None, &uri("team-a/copy.bin"), None)
                    .await
            ),
            want,
            "copy by {who}"
        );
    }
    let untouched = h
        .direct
        .get_range(&ckpt, 0..7, &h.direct.head(&ckpt).await.unwrap().etag)
        .await;
    assert_eq!(
        &untouched.unwrap()[..],
        b"weights",
        "a refused write changed the object"
    );
    assert_eq!(outcome(c.team_a.put_bytes(&ckpt, body.clone()).await), "ok");

    // Copies: the source must be readable and the target writable.
    let other = lakecache_protocol::ObjectUri::new(OTHER_BUCKET, "loot.bin").unwrap();
    assert_eq!(
        outcome(c.team_a.copy(&shard, None, &other, None).await),
        "403 OutOfScope",
        "copy into another bucket"
    );
    assert_eq!(
        outcome(
            c.team_a
                .copy(&uri("team-b/x"), None, &uri("team-a/x"), None)
                .await
        ),
        "403 OutOfScope",
        "copy from outside the scope"
    );
    assert_eq!(
        outcome(
            c.team_a
                .copy(&shard, None, &uri("team-a/shard-copy.bin"), None)
                .await
        ),
        "ok"
    );

    // Listings: refused outside the scope, filtered where they lead to it.
    assert_eq!(
        outcome(c.none.list("data", "", Some("/"), None, None).await),
        "401 Unauthenticated"
    );
    assert_eq!(
        outcome(c.team_b.list("data", "datasets/", None, None, None).await),
        "403 OutOfScope"
    );
    let root = c
        .team_a
        .list("data", "", Some("/"), None, None)
        .await
        .unwrap();
    assert_eq!(root.common_prefixes, vec!["datasets/", "team-a/"]);
    let root_b = c
        .team_b
        .list("data", "", Some("/"), None, None)
        .await
        .unwrap();
    assert!(root_b.common_prefixes.is_empty(), "{root_b:?}");

    // Health and metrics stay open unless protected.
    assert_eq!(outcome(c.none.health().await), "ok");
    assert_eq!(outcome(c.none.metrics().await), "ok");

    // The write-back backlog counts every tenant's pending writes: it
    // needs a token even with metrics open, and a tenant sees it only
    // under prefixes it may list.
    for (who, client, prefix, want) in [
        ("none", &c.none, None, "401 Unauthenticated"),
        ("forged", &c.forged, None, "403 OutOfScope"),
        ("expired", &c.expired, Some("s3://data/"), "403 OutOfScope"),
        ("team-a, all", &c.team_a, None, "403 OutOfScope"),
        (
            "team-b",
            &c.team_b,
            Some("s3://data/datasets/"),
            "403 OutOfScope",
        ),
        (
            "team-a, bucket",
            &c.team_a,
            Some("s3://data/"),
            "403 OutOfScope",
        ),
        ("team-a, own", &c.team_a, Some("s3://data/datasets/"), "ok"),
    ] {
        assert_eq!(
            outcome(client.writeback_status(prefix).await),
            want,
            "write-back status for {who}"
        );
    }

    // Write-back copies and their bookkeeping are for workers only, even
    // inside a tenant's write scope.
    let own = uri("team-a/ckpt");
    let asked = c.team_a.pending_entry(&own, "lc-0123abcd").await;
    assert_eq!(outcome(asked), "403 OutOfScope");
    let dropped = c.team_a.drop_replica(&own, "lc-0123abcd").await;
    assert_eq!(outcome(dropped), "403 OutOfScope");

    // Page hand-offs are for workers only. Last: a refusal sent before
    // the body was read closes the connection it came on.
    let etag = h.direct.head(&shard).await.unwrap().etag;
    let body = Full::new(Bytes::from_static(b"tokens"))
        .map_err(|e| match e {})
        .boxed();
    let pages = c
        .team_a
        .put_pages(&shard, &etag, 0, 6, "someone", body)
        .await;
    assert_eq!(outcome(pages), "403 OutOfScope");

    // A peer token may hand over pages of any object the allow-list
    // admits, though it names no object scope of its own.
    let peer = Claims {
        peer: true,
        ..claims("cluster-peer", &[], &[], LATER)
    };
    let peer = h.client.clone().with_token(Some(&key.mint(&peer))).unwrap();
    assert_eq!(outcome(peer.writeback_status(None).await), "ok");
    let body = Full::new(Bytes::from(vec![1u8; 6]))
        .map_err(|e| match e {})
        .boxed();
    let handed = peer.put_pages(&shard, &etag, 0, 6, "someone", body).await;
    assert!(
        !matches!(
            handed,
            Err(ClientError::Api {
                status: 401 | 403,
                ..
            })
        ),
        "{handed:?}"
    );
    // A copy sent with a tenant's token (refused before its body is read).
    let posed = c
        .team_a
        .put_replica(
            &own,
            "lc-0123abcd",
            "journal 127.0.0.1:1",
            futures::stream::iter([Ok(Bytes::from_static(b"posing"))]),
            &Default::default(),
            None,
        )
        .await;
    assert_eq!(outcome(posed), "403 OutOfScope");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_allow_list_bounds_every_token_and_rotation_keeps_old_tokens() {
    let old = SigningKey::generate("k1");
    let new = SigningKey::generate("k2");
    let h = Harness::with(|o| {
        o.access = AccessPolicy {
            keys: Some(KeyRing::new(new.clone(), Some(old.clone()))),
            allow: vec!["s3://data/datasets/".into()],
            protect_metrics: true,
        }
    })
    .await;
    h.put_direct("datasets/a.bin", b"a").await;
    h.put_direct("private/b.bin", b"b").await;
    let everything = claims("ops", &["s3://"], &["s3://"], LATER);
    let wide_old = h
        .client
        .clone()
        .with_token(Some(&old.mint(&everything)))
        .unwrap();
    let wide_new = h
        .client
        .clone()
        .with_token(Some(&new.mint(&everything)))
        .unwrap();
    for client in [&wide_old, &wide_new] {
        assert_eq!(
            outcome(client.read(&uri("datasets/a.bin"), None).await),
            "ok"
        );
        assert_eq!(
            outcome(client.read(&uri("private/b.bin"), None).await),
            "403 OutOfScope"
        );
        let root = client
            .list("data", "", Some("/"), None, None)
            .await
            .unwrap();
        assert_eq!(root.common_prefixes, vec!["datasets/"]);
    }
    // A token from a key that was rotated out twice is refused.
    let retired = SigningKey::generate("k0").mint(&everything);
    let client = h.client.clone().with_token(Some(&retired)).unwrap();
    assert_eq!(
        outcome(client.read(&uri("datasets/a.bin"), None).await),
        "403 OutOfScope"
    );
    // Protected metrics need the operator's token; a tenant's, however
    // wide its scope, is not one.
    assert_eq!(outcome(h.client.metrics().await), "401 Unauthenticated");
    assert_eq!(outcome(wide_new.metrics().await), "403 OutOfScope");
    let mut operator = claims("ops", &[], &[], LATER);
    operator.operator = true;
    let ops = h
        .client
        .clone()
        .with_token(Some(&new.mint(&operator)))
        .unwrap();
    assert_eq!(outcome(ops.metrics().await), "ok");
}

/// Connections beyond `max_connections` wait to be accepted instead of
/// each holding a task and buffers; one closing lets the next in.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn connections_over_the_cap_wait_for_a_free_slot() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let h = Harness::with(|o| o.limits.max_connections = 1).await;
    let addr = h.addr();
    let mut held = tokio::net::TcpStream::connect(addr).await.unwrap();
    held.write_all(b"GET /v1/health HTTP/1.1\r\nhost: x\r\n\r\n")
        .await
        .unwrap();
    let mut buf = [0u8; 512];
    let n = held.read(&mut buf).await.unwrap();
    assert!(
        buf[..n].starts_with(b"HTTP/1.1 200"),
        "first connection served"
    );
    let quick =
        WorkerClient::new(&addr.to_string(), std::time::Duration::from_millis(500)).unwrap();
    assert!(
        quick.health().await.is_err(),
        "a second connection was served while the cap was taken"
    );
    drop(held);
    let patient = WorkerClient::new(&addr.to_string(), std::time::Duration::from_secs(5)).unwrap();
    assert_eq!(outcome(patient.health().await), "ok");
}
