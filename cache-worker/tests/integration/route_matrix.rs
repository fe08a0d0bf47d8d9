//! Every route in the worker's route table, called by every kind of
//! caller: none, a forged token, another tenant, the tenant that owns
//! the data, a peer worker and the operator. What each may do follows
//! from the route's declared rule; a route added to the table needs a
//! sample request here (the match below has no catch-all), so it cannot
//! slip in untested.

use lakecache_protocol::token::{Claims, KeyRing, SigningKey};
use lakecache_protocol::{OFFSET_HEADER, REPLICA_OF_HEADER, VERSION_HEADER};
use lakecache_worker::http::table::{AccessRule, Handler, PathMatch, RouteSpec, ROUTES};
use lakecache_worker::AccessPolicy;

use crate::harness::{raw_request, Harness};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Who {
    Nobody,
    Forged,
    OtherTenant,
    Tenant,
    PeerWorker,
    Operator,
}

const EVERYONE: [Who; 6] = [
    Who::Nobody,
    Who::Forged,
    Who::OtherTenant,
    Who::PeerWorker,
    Who::Operator,
    // Last: its DELETE of the load job must not hide the job from the
    // checks of the others.
    Who::Tenant,
];

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Expect {
    /// 401.
    Unauthenticated,
    /// 403.
    Refused,
    /// Authorized: any answer but 401 or 403 (the sample may still be
    /// a 404 or a 400 for reasons of its own).
    Served,
    /// Another tenant's job reads as absent (404, or missing from a list).
    Hidden,
}

/// What a rule promises each caller. Written out here, apart from the
/// worker's code, so a dispatcher that drifts from its table fails.
fn expected(rule: AccessRule, who: Who) -> Expect {
    use AccessRule as R;
    use Expect::*;
    use Who::*;
    match (rule, who) {
        (_, Nobody) => Unauthenticated,
        (_, Forged) => Refused,
        (R::Operational, PeerWorker | Operator) => Served,
        (R::Operational, _) => Refused,
        (R::Scoped, Tenant) => Served,
        (R::Scoped, _) => Refused,
        (R::ScopedOrPeer, Tenant | PeerWorker) => Served,
        (R::ScopedOrPeer, _) => Refused,
        (R::OwnJobs, Tenant) => Served,
        (R::OwnJobs, _) => Hidden,
        (R::Peer, PeerWorker) => Served,
        (R::Peer, _) => Refused,
        // The whole backlog (the sample asks for no prefix).
        (R::Backlog, PeerWorker | Operator) => Served,
        (R::Backlog, _) => Refused,
    }
}

fn claims(tenant: &str, scope: &[&str], peer: bool, operator: bool) -> Claims {
    let scope: Vec<String> = scope.iter().map(|s| s.to_string()).collect();
    Claims {
        tenant: tenant.into(),
        kid: String::new(),
        exp: 4_000_000_000,
        read: scope.clone(),
        write: scope,
        peer,
        operator,
        members_key: None,
    }
}

fn token(key: &SigningKey, who: Who) -> Option<String> {
    let tenant = claims("team-a", &["s3://data/team-a/"], false, false);
    Some(match who {
        Who::Nobody => return None,
        Who::Tenant => key.mint(&tenant),
        Who::OtherTenant => key.mint(&claims("team-b", &["s3://data/team-b/"], false, false)),
        Who::PeerWorker => key.mint(&claims("worker-2", &[], true, false)),
        Who::Operator => key.mint(&claims("ops", &[], false, true)),
        Who::Forged => {
            // The tenant's claims, signed by another key under the id of
            // the worker's key.
            let real = key.mint(&tenant);
            let other = SigningKey::generate("k1").mint(&tenant);
            let (head, _) = real.rsplit_once('.').unwrap();
            let (_, tag) = other.rsplit_once('.').unwrap();
            format!("{head}.{tag}")
        }
    })
}

const LOAD_JOB: &str = "matrix-job";
const LOAD_SPEC: &str = r#"{"bucket":"data","prefix":"team-a/"}"#;

struct Sample {
    path: String,
    headers: Vec<(&'static str, String)>,
    body: Vec<u8>,
}

/// A request that reaches `route`'s handler, aimed at the tenant's data.
fn sample(route: &RouteSpec, who: Who) -> Sample {
    let base = match route.path {
        PathMatch::Exact(p) | PathMatch::Under(p) => p,
    };
    let object = format!("{base}data/team-a/matrix.bin");
    let version = "?version=lc-0000000000000001";
    let (path, headers, body) = match route.handler {
        Handler::Health | Handler::Metrics | Handler::Writeback | Handler::LoadList => {
            (base.to_string(), vec![], vec![])
        }
        Handler::Read | Handler::Head | Handler::Stat | Handler::Version | Handler::Delete => {
            (object, vec![], vec![])
        }
        Handler::Write => {
            let mut headers = vec![];
            if who == Who::PeerWorker {
                // A write-back copy: the only write a peer makes.
                headers.push((REPLICA_OF_HEADER, "journal-x 127.0.0.1:1".to_string()));
                headers.push((VERSION_HEADER, "lc-0000000000000001".to_string()));
            }
            (
                format!("{base}data/team-a/matrix-put.bin"),
                headers,
                b"new".to_vec(),
            )
        }
        Handler::List => (format!("{base}data?prefix=team-a/"), vec![], vec![]),
        Handler::LoadJob => {
            let body = if route.method == "POST" {
                LOAD_SPEC.as_bytes().to_vec()
            } else {
                vec![]
            };
            (format!("{base}{LOAD_JOB}"), vec![], body)
        }
        Handler::Free => (
            format!("{base}data"),
            vec![],
            br#"{"prefix":"team-a/"}"#.to_vec(),
        ),
        Handler::Plan => (
            format!("{base}matrix-job/0"),
            vec![],
            br#"{"format":"lakecache-plan","version":1,"ttl_seconds":60,"entries":[{"bucket":"data","key":"team-a/matrix.bin","start":0,"end":3}]}"#.to_vec(),
        ),
        Handler::AcceptPages => (
            object,
            vec![
                ("If-Match", "\"etag\"".to_string()),
                (OFFSET_HEADER, "0".to_string()),
            ],
            b"page".to_vec(),
        ),
        Handler::PendingEntry | Handler::DropReplica | Handler::ConfirmReplica => {
            (format!("{object}{version}"), vec![], vec![])
        }
        Handler::ReplicaDelete => (
            format!("{object}{version}"),
            vec![(REPLICA_OF_HEADER, "journal-x 127.0.0.1:1".to_string())],
            vec![],
        ),
    };
    Sample {
        path,
        headers,
        body,
    }
}

async fn call(h: &Harness, method: &str, sample: &Sample, token: Option<&str>) -> (u16, String) {
    let mut req = format!(
        "{method} {} HTTP/1.1\r\nHost: worker\r\nConnection: close\r\nContent-Length: {}\r\n",
        sample.path,
        sample.body.len()
    );
    if let Some(t) = token {
        req.push_str(&format!("Authorization: Bearer {t}\r\n"));
    }
    for (name, value) in &sample.headers {
        req.push_str(&format!("{name}: {value}\r\n"));
    }
    req.push_str("\r\n");
    let mut bytes = req.into_bytes();
    bytes.extend_from_slice(&sample.body);
    raw_request(h.addr(), &bytes).await
}

fn outcome(route: &RouteSpec, status: u16, body: &str) -> Expect {
    match status {
        401 => Expect::Unauthenticated,
        403 => Expect::Refused,
        404 if route.rule == AccessRule::OwnJobs => Expect::Hidden,
        200 if route.handler == Handler::LoadList && !body.contains(LOAD_JOB) => Expect::Hidden,
        _ => Expect::Served,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn every_route_in_the_table_admits_exactly_the_callers_its_rule_names() {
    let key = SigningKey::generate("k1");
    let h = Harness::with(|o| {
        o.access = AccessPolicy {
            keys: Some(KeyRing::new(key.clone(), None)),
            allow: Vec::new(),
            protect_metrics: true,
        }
    })
    .await;
    h.put_direct("team-a/matrix.bin", b"tenant data").await;
    let tenant = token(&key, Who::Tenant);
    // The tenant's load job, which the others must not see.
    let start = Sample {
        path: format!("/v1/load/{LOAD_JOB}"),
        headers: vec![],
        body: LOAD_SPEC.as_bytes().to_vec(),
    };
    let (status, text) = call(&h, "POST", &start, tenant.as_deref()).await;
    assert_eq!(status, 202, "starting the tenant's load job: {text}");

    let mut failures = Vec::new();
    let mut checked = 0;
    for route in ROUTES {
        for who in EVERYONE {
            let sample = sample(route, who);
            let t = token(&key, who);
            let (status, text) = call(&h, route.method, &sample, t.as_deref()).await;
            let (want, got) = (expected(route.rule, who), outcome(route, status, &text));
            checked += 1;
            if want != got {
                let head = text.lines().last().unwrap_or("").chars().take(200);
                failures.push(format!(
                    "{} {} ({:?}) by {who:?}: expected {want:?}, got {status} {}",
                    route.method,
                    sample.path,
                    route.rule,
                    head.collect::<String>()
                ));
            }
        }
    }
    assert!(
        failures.is_empty(),
        "{} of {checked} calls broke their route's rule:\n{}",
        failures.len(),
        failures.join("\n")
    );
    assert_eq!(checked, ROUTES.len() * EVERYONE.len());

    // A tenant sees the backlog under its own prefix, not another's.
    for (who, prefix, want) in [
        (Who::Tenant, "s3://data/team-a/", 200),
        (Who::OtherTenant, "s3://data/team-a/", 403),
        (Who::OtherTenant, "s3://data/team-b/", 200),
        // One object's writes (a peer's question before an upload): the
        // object must lie under the prefix, and be a valid URI.
        (Who::Tenant, "s3://data/team-a/&uri=s3://data/team-a/x", 200),
        (Who::Tenant, "s3://data/team-a/&uri=s3://data/team-b/x", 400),
        (
            Who::OtherTenant,
            "s3://data/team-a/&uri=s3://data/team-a/x",
            403,
        ),
        (Who::Tenant, "s3://data/team-a/&uri=s3://data/", 400),
        (Who::Tenant, "s3://data/team-a/&uri=%FF", 400),
    ] {
        let sample = Sample {
            path: format!("/v1/writeback?prefix={prefix}"),
            headers: vec![],
            body: vec![],
        };
        let (status, text) = call(&h, "GET", &sample, token(&key, who).as_deref()).await;
        assert_eq!(status, want, "backlog under {prefix} by {who:?}: {text}");
    }
}

/// Paths outside the table are refused as such, and a known path with
/// the wrong method names the methods it has, after authentication.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn paths_outside_the_table_and_wrong_methods_get_specific_errors() {
    let key = SigningKey::generate("k1");
    let h = Harness::with(|o| {
        o.access = AccessPolicy {
            keys: Some(KeyRing::new(key.clone(), None)),
            allow: Vec::new(),
            protect_metrics: false,
        }
    })
    .await;
    let empty = |path: &str| Sample {
        path: path.to_string(),
        headers: vec![],
        body: vec![],
    };
    let tenant = token(&key, Who::Tenant);
    let (status, text) = call(&h, "GET", &empty("/v1/nothing"), tenant.as_deref()).await;
    assert_eq!(status, 404, "{text}");
    assert!(text.contains("route_not_found"), "{text}");
    let patch = empty("/v1/objects/data/team-a/x");
    let (status, text) = call(&h, "PATCH", &patch, None).await;
    assert_eq!(status, 401, "wrong method, no token: {text}");
    let (status, text) = call(&h, "PATCH", &patch, tenant.as_deref()).await;
    assert_eq!(status, 405, "{text}");
    assert!(text.contains("GET, HEAD, PUT, DELETE"), "{text}");
    // Open metrics stay open, for any method's answer too.
    let (status, text) = call(&h, "POST", &empty("/metrics"), None).await;
    assert_eq!(status, 405, "{text}");
}
