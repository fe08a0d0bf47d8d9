//! Every route the worker serves, each with the rule for who may call
//! it. Requests are dispatched through this table only, so a route
//! cannot be served without a rule, and the authorization test walks
//! the table against every kind of caller.

/// Who may call a route when the worker requires tokens (with tokens
/// off, every rule admits everyone: the operator chose that).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AccessRule {
    /// Health and metrics: open unless `protect_metrics`; then an
    /// operator's or a peer worker's token.
    Operational,
    /// A tenant's data: a valid token whose scope (and the worker's
    /// allow-list) covers the object or prefix. Peer workers are refused
    /// here: their tokens carry no data scope.
    Scoped,
    /// As [`AccessRule::Scoped`], and a peer worker may reach the object
    /// too (a version another worker holds pending, a write-back copy).
    ScopedOrPeer,
    /// A valid token; answers only about jobs its own tenant started
    /// (another's job reads as absent).
    OwnJobs,
    /// Worker to worker only: a peer token.
    Peer,
    /// The write-back backlog: whole for an operator or a peer worker, a
    /// tenant's only under a prefix inside its own scope.
    Backlog,
}

/// How a route's path is matched.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PathMatch {
    Exact(&'static str),
    /// The path starts with this; the rest names the target.
    Under(&'static str),
}

/// Which handler serves a route.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Handler {
    Health,
    Metrics,
    Writeback,
    Read,
    Head,
    Write,
    Delete,
    Stat,
    Version,
    List,
    LoadList,
    /// Start, progress and cancel of one load job (`load::route`).
    LoadJob,
    Free,
    AcceptPages,
    PendingEntry,
    DropReplica,
    ReplicaDelete,
    /// A primary confirms a copy once its own journal holds the write.
    ConfirmReplica,
    /// A job's read order for one rank (`plans::publish`).
    Plan,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RouteSpec {
    pub method: &'static str,
    pub path: PathMatch,
    pub rule: AccessRule,
    pub handler: Handler,
}

const fn route(
    method: &'static str,
    path: PathMatch,
    rule: AccessRule,
    handler: Handler,
) -> RouteSpec {
    RouteSpec {
        method,
        path,
        rule,
        handler,
    }
}

use AccessRule::*;
use PathMatch::{Exact, Under};

/// The worker's whole API.
pub static ROUTES: &[RouteSpec] = &[
    route("GET", Exact("/v1/health"), Operational, Handler::Health),
    route("GET", Exact("/metrics"), Operational, Handler::Metrics),
    route("GET", Exact("/v1/writeback"), Backlog, Handler::Writeback),
    route("GET", Under("/v1/objects/"), ScopedOrPeer, Handler::Read),
    route("HEAD", Under("/v1/objects/"), ScopedOrPeer, Handler::Head),
    route("PUT", Under("/v1/objects/"), ScopedOrPeer, Handler::Write),
    route("DELETE", Under("/v1/objects/"), Scoped, Handler::Delete),
    route("GET", Under("/v1/stat/"), ScopedOrPeer, Handler::Stat),
    route("GET", Under("/v1/version/"), ScopedOrPeer, Handler::Version),
    route("GET", Under("/v1/list/"), Scoped, Handler::List),
    route("GET", Exact("/v1/load"), OwnJobs, Handler::LoadList),
    route("POST", Under("/v1/load/"), Scoped, Handler::LoadJob),
    route("GET", Under("/v1/load/"), OwnJobs, Handler::LoadJob),
    route("DELETE", Under("/v1/load/"), OwnJobs, Handler::LoadJob),
    route("POST", Under("/v1/free/"), Scoped, Handler::Free),
    route("PUT", Under("/v1/plans/"), Scoped, Handler::Plan),
    route("PUT", Under("/v1/pages/"), Peer, Handler::AcceptPages),
    route("GET", Under("/v1/pending/"), Peer, Handler::PendingEntry),
    route("DELETE", Under("/v1/replica/"), Peer, Handler::DropReplica),
    route("POST", Under("/v1/replica/"), Peer, Handler::ReplicaDelete),
    route("POST", Under("/v1/confirm/"), Peer, Handler::ConfirmReplica),
];

/// Why a request matched no route.
#[derive(Debug, PartialEq, Eq)]
pub enum Miss {
    /// No route has this path.
    Path,
    /// Routes have this path, with these methods.
    Method {
        allow: String,
        /// The rule of the path's routes, to authenticate before saying
        /// which methods exist.
        rule: AccessRule,
    },
}

impl PathMatch {
    /// The rest of `path` after the match (empty for an exact one).
    fn rest<'p>(&self, path: &'p str) -> Option<&'p str> {
        match *self {
            Exact(p) => (path == p).then_some(""),
            Under(p) => path.strip_prefix(p),
        }
    }
}

/// The route serving `method` on `path`, and the rest of the path.
pub fn find<'p>(method: &str, path: &'p str) -> Result<(&'static RouteSpec, &'p str), Miss> {
    let mut same_path = ROUTES
        .iter()
        .filter_map(|r| r.path.rest(path).map(|rest| (r, rest)))
        .peekable();
    let Some(&(first, _)) = same_path.peek() else {
        return Err(Miss::Path);
    };
    let mut allow = Vec::new();
    for (r, rest) in same_path {
        if r.method == method {
            return Ok((r, rest));
        }
        allow.push(r.method);
    }
    Err(Miss::Method {
        allow: allow.join(", "),
        rule: first.rule,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_method_and_path_has_one_route() {
        for (i, a) in ROUTES.iter().enumerate() {
            for b in &ROUTES[i + 1..] {
                assert!(
                    !(a.method == b.method && a.path == b.path),
                    "two routes for {} {:?}",
                    a.method,
                    a.path
                );
            }
        }
    }

    #[test]
    fn paths_find_their_route_and_misses_say_why() {
        let (r, rest) = find("PUT", "/v1/objects/data/a/b").unwrap();
        assert_eq!((r.handler, rest), (Handler::Write, "data/a/b"));
        assert_eq!(
            find("GET", "/v1/load").unwrap().0.handler,
            Handler::LoadList
        );
        assert_eq!(find("GET", "/v1/load/j1").unwrap().1, "j1");
        assert_eq!(find("GET", "/v1/loads"), Err(Miss::Path));
        assert_eq!(find("GET", "/v1/object/x"), Err(Miss::Path));
        assert_eq!(
            find("PATCH", "/v1/objects/data/k"),
            Err(Miss::Method {
                allow: "GET, HEAD, PUT, DELETE".into(),
                rule: ScopedOrPeer
            })
        );
        assert_eq!(
            find("POST", "/metrics"),
            Err(Miss::Method {
                allow: "GET".into(),
                rule: Operational
            })
        );
    }
}
