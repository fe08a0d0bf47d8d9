//! Who may do what. With signing keys configured, every request but
//! health and metrics (unless protected) carries `Authorization: Bearer
//! <token>`; the token's signature, expiry and scope are checked before
//! anything touches the cache or S3. The operator's allow-list bounds
//! every request, with or without tokens, so a leaked token reaches no
//! further than the buckets the worker was meant to cache.

use std::time::{SystemTime, UNIX_EPOCH};

use http::HeaderMap;
use lakecache_protocol::token::{scope_covers, scope_reaches, Claims, KeyRing, TokenError};
use lakecache_protocol::{ErrorCode, ListResponse, ObjectUri};

use super::response::{error, Response};

/// The worker's access rules.
#[derive(Debug, Clone, Default)]
pub struct AccessPolicy {
    /// Signing keys; `None` serves requests without tokens.
    pub keys: Option<KeyRing>,
    /// `s3://bucket/` or `s3://bucket/prefix` scopes any request may
    /// reach; empty: every bucket the worker's credentials reach.
    pub allow: Vec<String>,
    /// Require an operator's (or a peer worker's) token for `/metrics`
    /// and `/v1/health` too.
    pub protect_metrics: bool,
}

/// What one request's caller may do.
pub struct Access<'a> {
    policy: &'a AccessPolicy,
    claims: Option<Claims>,
}

type Denied = Box<Response>;

/// A refusal before it becomes an HTTP answer (the local socket sends
/// the same code and message).
#[derive(Debug, Clone)]
pub struct Refusal {
    pub code: ErrorCode,
    pub message: String,
}

impl From<Refusal> for Denied {
    fn from(r: Refusal) -> Self {
        Box::new(error(r.code, r.message))
    }
}

fn out_of_scope(message: String) -> Denied {
    refused(message).into()
}

fn refused(message: String) -> Refusal {
    Refusal {
        code: ErrorCode::OutOfScope,
        message,
    }
}

fn now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

impl AccessPolicy {
    /// Checks the request's token, if this worker requires one.
    pub fn authenticate(&self, headers: &HeaderMap) -> Result<Access<'_>, Denied> {
        if self.keys.is_none() {
            return self.authenticate_token(None).map_err(Into::into);
        }
        let Some(value) = headers.get(http::header::AUTHORIZATION) else {
            return self.authenticate_token(None).map_err(Into::into);
        };
        let token = value
            .to_str()
            .ok()
            .and_then(|v| v.strip_prefix("Bearer "))
            .map(str::trim)
            .ok_or_else(|| {
                Box::new(error(
                    ErrorCode::Unauthenticated,
                    "Authorization must be: Bearer <token>",
                ))
            })?;
        self.authenticate_token(Some(token)).map_err(Into::into)
    }

    /// Checks a bearer token (`None`: the request carried none).
    pub fn authenticate_token(&self, token: Option<&str>) -> Result<Access<'_>, Refusal> {
        let Some(keys) = &self.keys else {
            return Ok(Access {
                policy: self,
                claims: None,
            });
        };
        let unauthenticated = |m: &str| Refusal {
            code: ErrorCode::Unauthenticated,
            message: m.to_string(),
        };
        let Some(token) = token else {
            return Err(unauthenticated(
                "this worker requires a token: send Authorization: Bearer <token> (lakecache token create)",
            ));
        };
        match keys.verify(token, now()) {
            Ok(claims) => Ok(Access {
                policy: self,
                claims: Some(claims),
            }),
            Err(TokenError::Malformed) => {
                Err(unauthenticated("the bearer value is not a lakecache token"))
            }
            Err(e) => Err(refused(e.to_string())),
        }
    }

    fn allows(&self, target: &str) -> bool {
        self.allow.is_empty() || scope_covers(&self.allow, target)
    }

    fn allows_listing(&self, target: &str) -> bool {
        self.allow.is_empty() || scope_reaches(&self.allow, target)
    }
}

impl Access<'_> {
    pub fn tenant(&self) -> Option<&str> {
        self.claims.as_ref().map(|c| c.tenant.as_str())
    }

    fn tenant_label(&self) -> &str {
        self.tenant().unwrap_or("anonymous")
    }

    pub fn read(&self, uri: &ObjectUri) -> Result<(), Denied> {
        self.may_read(uri).map_err(Into::into)
    }

    pub fn may_read(&self, uri: &ObjectUri) -> Result<(), Refusal> {
        if self.claims.as_ref().is_some_and(|c| c.peer) {
            // A worker reading a pending version another worker holds
            // (a rename onto a key it owns); the writer's scope was
            // checked where the write came in.
            return self.may_reach_as_peer(uri);
        }
        self.object(uri, "read", Claims::may_read)
    }

    pub fn write(&self, uri: &ObjectUri) -> Result<(), Denied> {
        self.may_write(uri).map_err(Into::into)
    }

    pub fn may_write(&self, uri: &ObjectUri) -> Result<(), Refusal> {
        self.object(uri, "write", Claims::may_write)
    }

    /// Any write at all: a token with no write scope may not have the
    /// worker prepare for write-back bursts (disk it spends up front).
    pub fn may_write_somewhere(&self) -> Result<(), Refusal> {
        match &self.claims {
            Some(c) if c.write.is_empty() => Err(refused(format!(
                "tenant {} may not write anything",
                c.tenant
            ))),
            _ => Ok(()),
        }
    }

    /// The allow-list first, then the token's scope.
    fn object(
        &self,
        uri: &ObjectUri,
        verb: &str,
        granted: fn(&Claims, &ObjectUri) -> bool,
    ) -> Result<(), Refusal> {
        if !self.policy.allows(&uri.to_string()) {
            return Err(refused(format!(
                "{uri} is outside this worker's allow-list"
            )));
        }
        match &self.claims {
            Some(c) if !granted(c, uri) => {
                Err(refused(format!("tenant {} may not {verb} {uri}", c.tenant)))
            }
            _ => Ok(()),
        }
    }

    pub fn list(&self, bucket: &str, prefix: &str) -> Result<(), Denied> {
        let target = format!("s3://{bucket}/{prefix}");
        if !self.policy.allows_listing(&target) {
            return Err(out_of_scope(format!(
                "{target} is outside this worker's allow-list"
            )));
        }
        match &self.claims {
            Some(c) if !c.may_list(bucket, prefix) => Err(out_of_scope(format!(
                "tenant {} may not list {target}",
                self.tenant_label()
            ))),
            _ => Ok(()),
        }
    }

    /// The write-back backlog under `prefix` (an `s3://` URI, or empty
    /// for all of it): whole for an operator's or a peer worker's token,
    /// or with tokens off; for a tenant only under a prefix it may list,
    /// since the backlog counts other tenants' pending writes.
    pub fn writeback_status(&self, prefix: &str) -> Result<(), Denied> {
        match &self.claims {
            None => Ok(()),
            Some(c) if c.peer || c.operator => Ok(()),
            Some(c) => {
                // Inside a scope, not merely leading to one (as a listing
                // may): counts over a parent would include others' writes.
                let inside = prefix.starts_with("s3://")
                    && (scope_covers(&c.read, prefix) || scope_covers(&c.write, prefix));
                if inside && self.policy.allows(prefix) {
                    return Ok(());
                }
                Err(out_of_scope(format!(
                    "tenant {} may see the write-back backlog only under its own prefixes: ask with ?prefix=s3://bucket/prefix inside its scope, or use an operator token (lakecache token create --operator) for all of it",
                    self.tenant_label()
                )))
            }
        }
    }

    /// Evicting a prefix: the allow-list, and write scope over all of it.
    pub fn free(&self, bucket: &str, prefix: &str) -> Result<(), Denied> {
        let target = format!("s3://{bucket}/{prefix}");
        if !self.policy.allows_listing(&target) {
            return Err(out_of_scope(format!(
                "{target} is outside this worker's allow-list"
            )));
        }
        match &self.claims {
            Some(c) if !c.may_write_prefix(bucket, prefix) => Err(out_of_scope(format!(
                "tenant {} may not evict {target} (needs write scope over all of it)",
                self.tenant_label()
            ))),
            _ => Ok(()),
        }
    }

    /// Drops what the caller may not see from a listing it may make.
    pub fn filter_listing(&self, bucket: &str, listing: &mut ListResponse) {
        let policy = self.policy;
        listing.objects.retain(|o| {
            policy.allows(&format!("s3://{bucket}/{}", o.key))
                && self
                    .claims
                    .as_ref()
                    .is_none_or(|c| c.may_show_object(bucket, &o.key))
        });
        listing.common_prefixes.retain(|p| {
            policy.allows_listing(&format!("s3://{bucket}/{p}"))
                && self
                    .claims
                    .as_ref()
                    .is_none_or(|c| c.may_show_prefix(bucket, p))
        });
    }

    /// Pages handed over by a peer: a peer token (when tokens are on)
    /// and the allow-list. The sending worker checked the writer's scope;
    /// peer tokens name no object scopes of their own.
    pub fn peer_object(&self, uri: &ObjectUri) -> Result<(), Denied> {
        self.may_reach_as_peer(uri).map_err(Into::into)
    }

    fn may_reach_as_peer(&self, uri: &ObjectUri) -> Result<(), Refusal> {
        self.may_call_as_peer()?;
        if !self.policy.allows(&uri.to_string()) {
            return Err(refused(format!(
                "{uri} is outside this worker's allow-list"
            )));
        }
        Ok(())
    }

    /// A tenant's routes refuse peer workers' tokens: they carry no data
    /// scope, and no worker calls these on another.
    pub fn not_peer(&self) -> Result<(), Denied> {
        match &self.claims {
            Some(c) if c.peer => Err(out_of_scope(
                "a peer worker's token may not call this route".to_string(),
            )),
            _ => Ok(()),
        }
    }

    /// Worker-to-worker calls need a peer token when tokens are on.
    pub fn peer(&self) -> Result<(), Denied> {
        self.may_call_as_peer().map_err(Into::into)
    }

    fn may_call_as_peer(&self) -> Result<(), Refusal> {
        match &self.claims {
            Some(c) if !c.peer => Err(refused(format!(
                "tenant {} is not a cluster worker",
                c.tenant
            ))),
            _ => Ok(()),
        }
    }

    /// Health and metrics: open unless the policy protects them; then
    /// an operator's or a peer worker's token. A tenant's token is not
    /// enough: both name every tenant and count its traffic.
    pub fn operator_endpoint(policy: &AccessPolicy, headers: &HeaderMap) -> Result<(), Denied> {
        if !policy.protect_metrics {
            return Ok(());
        }
        let access = policy.authenticate(headers)?;
        match &access.claims {
            Some(c) if !(c.operator || c.peer) => Err(out_of_scope(format!(
                "tenant {} may not read this worker's health or metrics: they are protected (--protect-metrics); use an operator token (lakecache token create --operator)",
                c.tenant
            ))),
            _ => Ok(()),
        }
    }
}
