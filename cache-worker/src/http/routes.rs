//! Request routing and the handlers of the `/v1` API.

use std::sync::{Arc, OnceLock};

use bytes::Bytes;
use futures::StreamExt;
use http::{header, HeaderValue, Method, StatusCode};
use http_body::Frame;
use http_body_util::{BodyExt, BodyStream, StreamBody};
use hyper::body::Incoming;
use lakecache_protocol::{
    header_lists, user_meta_from_headers, validate_bucket, ErrorBody, ErrorCode, Health,
    ListResponse, ObjectStat, ObjectUri, ReadKind, UserMeta, WriteBackStatus, WriteMode,
    WriteOutcome, BODY_CRC32C_TRAILER, COPY_SOURCE_HEADER, FROM_HEADER, KEEPALIVE_HEADER,
    MAX_KEY_BYTES, METADATA_DIRECTIVE_HEADER, OFFSET_HEADER, READ_AHEAD_HEADER, SENT_AT_HEADER,
    WRITE_MODE_HEADER,
};

use super::auth::{Access, AccessPolicy};
use super::body_check::{body_error, CheckedBody};
use super::limits::{Admitted, IdleTimeoutBody, TenantLimiter};
use super::peer_writeback::{
    confirm_replica, drop_replica, pending_entry, replica_delete, replica_role,
};
use super::range::{parse_range, resolve};
use super::read_crc::with_crc_trailer;
use super::response::{
    cache_error, cache_error_code, error, full, json, json_when_ready, BoxError, Response,
};
use super::table::{find, AccessRule, Handler, Miss};
use super::HttpLimits;
use crate::cache::{Cache, CacheError};
use crate::metrics::Metrics;
use crate::store::{ObjectMeta, StoreError};
use crate::writeback::WriteRole;

pub struct AppState {
    pub cache: Arc<Cache>,
    pub metrics: Arc<Metrics>,
    pub limits: HttpLimits,
    pub s3_stall_timeout: std::time::Duration,
    pub access: AccessPolicy,
    pub tenants: TenantLimiter,
}

/// Returns the denial response when a check fails.
macro_rules! check {
    ($checked:expr) => {
        if let Err(denied) = $checked {
            return *denied;
        }
    };
}

/// Dispatches a request; returns the operation name (for metrics and
/// spans) and the response.
pub async fn route(state: &AppState, req: http::Request<Incoming>) -> (&'static str, Response) {
    let uri_len = req.uri().path().len() + req.uri().query().map_or(0, str::len);
    if uri_len > state.limits.max_uri_bytes {
        let msg = format!(
            "request URI is {uri_len} bytes; the limit is {}",
            state.limits.max_uri_bytes
        );
        return ("invalid", error(ErrorCode::UriTooLong, msg));
    }
    let head_bytes: usize = uri_len
        + req
            .headers()
            .iter()
            .map(|(k, v)| k.as_str().len() + v.len() + 4)
            .sum::<usize>();
    if head_bytes > state.limits.max_header_bytes {
        let msg = format!(
            "request headers are {head_bytes} bytes; the limit is {}",
            state.limits.max_header_bytes
        );
        return ("invalid", error(ErrorCode::HeadersTooLarge, msg));
    }
    let path = req.uri().path().to_string();
    let method = req.method().clone();
    let (spec, rest) = match find(method.as_str(), &path) {
        Ok(found) => found,
        Err(Miss::Path) => {
            let msg = format!("no route for {path}");
            return ("invalid", error(ErrorCode::RouteNotFound, msg));
        }
        Err(Miss::Method { allow, rule }) => {
            // Who may ask first: the methods of a route are no secret,
            // but an unauthenticated caller learns nothing it may not.
            let known = match rule {
                AccessRule::Operational => {
                    Access::operator_endpoint(&state.access, req.headers()).map(|_| ())
                }
                _ => state.access.authenticate(req.headers()).map(|_| ()),
            };
            if let Err(denied) = known {
                return ("denied", *denied);
            }
            return ("invalid", method_not_allowed(&allow));
        }
    };
    let rest = rest.to_string();
    if spec.rule == AccessRule::Operational {
        if let Err(denied) = Access::operator_endpoint(&state.access, req.headers()) {
            return ("denied", *denied);
        }
        return operator_route(state, spec.handler).await;
    }
    let access = match state.access.authenticate(req.headers()) {
        Ok(a) => a,
        Err(denied) => return ("denied", *denied),
    };
    let by_rule = match spec.rule {
        AccessRule::Peer => access.peer(),
        AccessRule::Scoped => access.not_peer(),
        _ => Ok(()),
    };
    if let Err(denied) = by_rule {
        return ("denied", *denied);
    }
    if spec.handler == Handler::Writeback {
        // Not a tenant's request: no tenant slot (the backlog is what an
        // operator looks at while tenants are throttled).
        let query = req.uri().query().unwrap_or("");
        return ("writeback", writeback_status(state, &access, query).await);
    }
    if let Some(tenant) = access.tenant() {
        tracing::Span::current().record("tenant", tenant);
    }
    let slot = match state
        .tenants
        .admit(access.tenant().unwrap_or("anonymous"))
        .await
    {
        Ok(slot) => slot,
        Err(busy) => return ("throttled", *busy),
    };
    let tenant = access.tenant().map(std::sync::Arc::<str>::from);
    let (op, resp) = crate::tenant::scope(
        tenant,
        object_route(state, &access, spec.handler, &rest, method, req),
    )
    .await;
    (op, Admitted::wrap(resp, slot))
}

/// Serves a request the table admitted.
async fn object_route(
    state: &AppState,
    access: &Access<'_>,
    handler: Handler,
    rest: &str,
    method: Method,
    req: http::Request<Incoming>,
) -> (&'static str, Response) {
    let query = req.uri().query().unwrap_or("").to_string();
    let query = query.as_str();
    match handler {
        Handler::Read => ("read", read(state, access, rest, &req, true).await),
        Handler::Head => ("head", read(state, access, rest, &req, false).await),
        Handler::Write => ("write", write(state, access, rest, req).await),
        Handler::Delete => ("delete", delete(state, access, rest).await),
        Handler::Stat => ("stat", stat(state, access, rest).await),
        Handler::Version => (
            "version",
            super::versions::route(state, access, rest, query).await,
        ),
        Handler::List => ("list", list(state, access, rest, query).await),
        Handler::LoadList | Handler::LoadJob => {
            super::load::route(state, access, rest, method, req).await
        }
        Handler::Free => super::load::free(state, access, rest, method, req).await,
        Handler::Plan => (
            "plan",
            super::plans::publish(state, access, rest, req).await,
        ),
        Handler::AcceptPages => ("accept_pages", accept_pages(state, access, rest, req).await),
        Handler::PendingEntry => (
            "pending_entry",
            pending_entry(state, access, rest, query).await,
        ),
        Handler::DropReplica => (
            "drop_replica",
            drop_replica(state, access, rest, query).await,
        ),
        Handler::ReplicaDelete => (
            "replica_delete",
            replica_delete(state, access, rest, query, req.headers()).await,
        ),
        Handler::ConfirmReplica => (
            "confirm_replica",
            confirm_replica(state, access, rest, query).await,
        ),
        Handler::Health | Handler::Metrics | Handler::Writeback => {
            let msg = format!("{handler:?} is not served here");
            ("invalid", error(ErrorCode::Internal, msg))
        }
    }
}

async fn operator_route(state: &AppState, handler: Handler) -> (&'static str, Response) {
    if handler == Handler::Health {
        return ("health", health(state).await);
    }
    // Rendering reads the write-back journal (see writeback_status).
    let metrics = state.metrics.clone();
    let text = match tokio::task::spawn_blocking(move || metrics.render()).await {
        Ok(text) => text,
        Err(e) => {
            let msg = format!("rendering metrics failed: {e}");
            return ("metrics", error(ErrorCode::Internal, msg));
        }
    };
    let mut resp = http::Response::new(full(text));
    resp.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/plain; version=0.0.4"),
    );
    ("metrics", resp)
}

pub(super) fn method_not_allowed(allow: &str) -> Response {
    let mut resp = error(
        ErrorCode::MethodNotAllowed,
        format!("allowed methods: {allow}"),
    );
    if let Ok(value) = HeaderValue::from_str(allow) {
        resp.headers_mut().insert(header::ALLOW, value);
    }
    resp
}

pub(super) fn parse_uri(rest: &str) -> Result<ObjectUri, Box<Response>> {
    ObjectUri::from_api_path(rest)
        .map_err(|e| Box::new(error(ErrorCode::InvalidPath, e.to_string())))
}

pub(super) fn stat_body(uri: &ObjectUri, meta: &ObjectMeta) -> ObjectStat {
    ObjectStat {
        uri: uri.to_string(),
        size: meta.size,
        etag: meta.etag.clone(),
        last_modified_ms: meta.last_modified_ms,
        written_as: None,
        meta: meta.user.clone(),
        held_by: None,
    }
}

/// Built off the runtime's threads: tenants' pending bytes come from the
/// write-back journal, whose lock is held across fsyncs, and a readiness
/// probe must not stall every other request behind a slow disk.
async fn health(state: &AppState) -> Response {
    let cache = state.cache.clone();
    let body_idle = state.limits.body_idle_timeout;
    let s3_stall = state.s3_stall_timeout;
    let built = tokio::task::spawn_blocking(move || {
        let buckets = cache.traffic();
        let wb = cache.write_back_state().ok().map(|wb| &wb.config);
        let deadlines = lakecache_protocol::WorkerDeadlines {
            body_idle_ms: body_idle.as_millis() as u64,
            s3_stall_ms: s3_stall.as_millis() as u64,
            replica_progress_ms: wb.map(|c| c.replica_progress.as_millis() as u64),
            staging_stall_ms: wb.map(|c| c.stall_timeout.as_millis() as u64),
        };
        Health {
            status: "ok".into(),
            cache_used_bytes: cache.used_bytes(),
            cache_capacity_bytes: cache.config.capacity,
            page_size: cache.page_size(),
            hit_bytes: buckets.values().map(|b| b.hit_bytes).sum(),
            miss_bytes: buckets.values().map(|b| b.miss_bytes).sum(),
            pinned_bytes: cache.pinned_bytes(),
            buckets,
            tenants: cache.tenant_usage(),
            deadlines: Some(deadlines),
            ring_workers: cache.peers.placement().map(|p| p.ring_workers() as u64),
        }
    })
    .await;
    match built {
        Ok(health) => json(StatusCode::OK, &health),
        Err(e) => error(ErrorCode::Internal, format!("health check failed: {e}")),
    }
}

/// `?prefix=s3://bucket/prefix` narrows the backlog to one prefix.
/// `&uri=s3://bucket/key` adds the writes of that object (a peer's
/// question before it uploads its own version of it).
async fn writeback_status(state: &AppState, access: &Access<'_>, query: &str) -> Response {
    let mut prefix = String::new();
    let mut object = None;
    let decoded = |v: &str| {
        percent_encoding::percent_decode_str(v)
            .decode_utf8()
            .map(|v| v.into_owned())
            .ok()
    };
    for pair in query.split('&').filter(|p| !p.is_empty()) {
        match pair.split_once('=') {
            Some(("prefix", v)) => match decoded(v) {
                Some(v) => prefix = v,
                None => return error(ErrorCode::BadRequest, "prefix is not valid UTF-8"),
            },
            Some(("uri", v)) => match decoded(v) {
                Some(v) => object = Some(v),
                None => return error(ErrorCode::BadRequest, "uri is not valid UTF-8"),
            },
            _ => {
                return error(
                    ErrorCode::BadRequest,
                    format!("unknown query parameter in {pair:?}; only prefix=s3://bucket/prefix and uri=s3://bucket/key"),
                )
            }
        }
    }
    if !prefix.is_empty() && !prefix.starts_with("s3://") {
        return error(
            ErrorCode::BadRequest,
            "prefix must be an s3://bucket/prefix URI",
        );
    }
    if let Some(uri) = &object {
        if let Err(e) = uri.parse::<ObjectUri>() {
            return error(ErrorCode::BadRequest, format!("uri: {e}"));
        }
        if !uri.starts_with(&prefix) {
            return error(
                ErrorCode::BadRequest,
                format!("uri {uri:?} is not under prefix {prefix:?}"),
            );
        }
        check!(access.writeback_status(uri));
    }
    check!(access.writeback_status(&prefix));
    let Some(wb) = state.cache.writeback.clone() else {
        return json(StatusCode::OK, &WriteBackStatus::default());
    };
    // Off the runtime's threads: the journal lock is held across fsyncs.
    let status = move || {
        let mut status = wb.status(&prefix);
        if let Some(uri) = &object {
            status.writes_of_uri = wb.writes_of(uri);
        }
        status
    };
    match tokio::task::spawn_blocking(status).await {
        Ok(status) => json(StatusCode::OK, &status),
        Err(e) => error(
            ErrorCode::Internal,
            format!("write-back status failed: {e}"),
        ),
    }
}

async fn stat(state: &AppState, access: &Access<'_>, rest: &str) -> Response {
    let uri = match parse_uri(rest) {
        Ok(u) => u,
        Err(resp) => return *resp,
    };
    check!(access.read(&uri));
    match state.cache.stat(&uri).await {
        Ok(meta) => {
            let mut body = stat_body(&uri, &meta);
            body.written_as = state
                .cache
                .writeback
                .as_ref()
                .and_then(|wb| wb.written_as(&body.uri, &meta.etag));
            json(StatusCode::OK, &body)
        }
        Err(e) => cache_error(&e),
    }
}

fn set_header(resp: &mut Response, name: header::HeaderName, value: String) {
    if let Ok(v) = HeaderValue::from_str(&value) {
        resp.headers_mut().insert(name, v);
    }
}

async fn read(
    state: &AppState,
    access: &Access<'_>,
    rest: &str,
    req: &http::Request<Incoming>,
    with_body: bool,
) -> Response {
    let uri = match parse_uri(rest) {
        Ok(u) => u,
        Err(resp) => return *resp,
    };
    check!(access.read(&uri));
    let spec = match req.headers().get(header::RANGE) {
        None => None,
        Some(v) => match v
            .to_str()
            .map_err(|_| ())
            .and_then(|s| parse_range(s).map_err(|_| ()))
        {
            Ok(spec) => Some(spec),
            Err(()) => {
                let raw = String::from_utf8_lossy(v.as_bytes()).into_owned();
                return error(ErrorCode::InvalidRange, format!("unsupported Range header {raw:?}; use bytes=FIRST-LAST, bytes=FIRST- or bytes=-SUFFIX"));
            }
        },
    };
    let kind = match req
        .headers()
        .get(READ_AHEAD_HEADER)
        .map(HeaderValue::as_bytes)
    {
        None => ReadKind::Demand,
        Some(b"1") => ReadKind::Ahead,
        Some(v) => {
            let raw = String::from_utf8_lossy(v).into_owned();
            return error(
                ErrorCode::BadRequest,
                format!("{READ_AHEAD_HEADER} is {raw:?}; send 1 for a read-ahead, or leave it out"),
            );
        }
    };
    let if_match = if_match(req);
    // A read that finds the object changed under its cached ETag starts
    // over once against the new version.
    for attempt in 0..2 {
        // A reader holding the cache version of a since-uploaded write
        // gets the same bytes under the version it asked for.
        let mut served_as = None;
        let mut meta = match state.cache.stat(&uri).await {
            Ok(m) => m,
            Err(e) => return cache_error(&e),
        };
        if let Some(want) = if_match.as_deref().filter(|w| *w != "*") {
            let uploaded = state.cache.uploaded_as(&uri, want);
            if uploaded.as_deref() == Some(&meta.etag) {
                served_as = Some(want.to_string());
            }
            if want != meta.etag && uploaded.as_deref() != Some(&meta.etag) {
                // Our metadata may be stale: ask S3 before refusing.
                meta = match state.cache.revalidate(&uri).await {
                    Ok(m) => m,
                    Err(e) => return cache_error(&e),
                };
                if uploaded.as_deref() == Some(&meta.etag) {
                    served_as = Some(want.to_string());
                }
                if want != meta.etag && uploaded.as_deref() != Some(&meta.etag) {
                    return error(
                        ErrorCode::PreconditionFailed,
                        format!("object has ETag {}, not {want}", meta.etag),
                    );
                }
            }
        }
        let range = match spec {
            None => 0..meta.size,
            Some(s) => match resolve(s, meta.size) {
                Some(r) => r,
                None => {
                    let mut resp = error(
                        ErrorCode::RangeNotSatisfiable,
                        format!("range not satisfiable for an object of {} bytes", meta.size),
                    );
                    set_header(
                        &mut resp,
                        header::CONTENT_RANGE,
                        format!("bytes */{}", meta.size),
                    );
                    return resp;
                }
            },
        };
        let mut served = None;
        let mut resp = if with_body {
            match state.cache.read(&uri, &meta, range.clone(), kind).await {
                Ok((stream, first)) => {
                    served = Some(first);
                    let frames =
                        stream.map(|r| r.map(Frame::data).map_err(|e| -> BoxError { Box::new(e) }));
                    http::Response::new(BodyExt::boxed_unsync(StreamBody::new(frames)))
                }
                Err(CacheError::Store(StoreError::PreconditionFailed)) if attempt == 0 => {
                    if let Err(e) = state.cache.revalidate(&uri).await {
                        return cache_error(&e);
                    }
                    continue;
                }
                Err(e) => return cache_error(&e),
            }
        } else {
            http::Response::new(full(Bytes::new()))
        };
        if spec.is_some() {
            *resp.status_mut() = StatusCode::PARTIAL_CONTENT;
            set_header(
                &mut resp,
                header::CONTENT_RANGE,
                format!(
                    "bytes {}-{}/{}",
                    range.start,
                    range.end.saturating_sub(1),
                    meta.size
                ),
            );
        }
        set_header(
            &mut resp,
            header::CONTENT_LENGTH,
            (range.end - range.start).to_string(),
        );
        let etag = served_as.as_deref().unwrap_or(&meta.etag);
        set_header(&mut resp, header::ETAG, format!("\"{etag}\""));
        resp.headers_mut()
            .insert(header::ACCEPT_RANGES, HeaderValue::from_static("bytes"));
        if let Some(first) = served {
            resp.headers_mut().insert(
                lakecache_protocol::CACHE_HEADER,
                HeaderValue::from_static(first.as_str()),
            );
        }
        resp.headers_mut().insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/octet-stream"),
        );
        // `TE: trailers` (RFC 9110 §10.1.4): the client takes them.
        if with_body && header_lists(req.headers(), header::TE, "trailers") {
            return with_crc_trailer(resp, range.end - range.start);
        }
        return resp;
    }
    error(
        ErrorCode::PreconditionFailed,
        "object kept changing during the read; retry",
    )
}

/// The client's CRC32C of the whole body, from the trailers.
fn if_match(req: &http::Request<Incoming>) -> Option<String> {
    req.headers()
        .get(header::IF_MATCH)
        .and_then(|v| v.to_str().ok())
        .map(|v| {
            v.trim()
                .trim_start_matches("W/")
                .trim_matches('"')
                .to_string()
        })
}

async fn write(
    state: &AppState,
    access: &Access<'_>,
    rest: &str,
    req: http::Request<Incoming>,
) -> Response {
    let uri = match parse_uri(rest) {
        Ok(u) => u,
        Err(resp) => return *resp,
    };
    let role = match replica_role(req.headers()) {
        Ok(role) => role,
        Err(resp) => return *resp,
    };
    match role {
        WriteRole::Primary => check!(access.write(&uri)),
        WriteRole::Replica { .. } => check!(access.peer_object(&uri)),
    }
    let mut user = match user_meta_from_headers(req.headers()) {
        Ok(m) => m,
        Err(e) => return error(ErrorCode::BadRequest, e.to_string()),
    };
    // Only a write-back upload sets its write stamp: one a client sends
    // (copied from a stat, or forged) could make workers skip later writes.
    user.remove(lakecache_protocol::WRITTEN_STAMP_META);
    if let Some(source) = req.headers().get(COPY_SOURCE_HEADER) {
        let replace = match req
            .headers()
            .get(METADATA_DIRECTIVE_HEADER)
            .map(|v| v.to_str())
        {
            None => false,
            Some(Ok(v)) if v.eq_ignore_ascii_case("replace") => true,
            Some(Ok(v)) if v.eq_ignore_ascii_case("copy") => false,
            Some(_) => {
                return error(
                    ErrorCode::BadRequest,
                    format!("{METADATA_DIRECTIVE_HEADER} must be copy or replace"),
                )
            }
        };
        let user = replace.then_some(user);
        return copy(state, access, source, if_match(&req), &uri, user).await;
    }
    let limit = state.limits.max_body_bytes;
    let declared = req
        .headers()
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    if declared.is_some_and(|n| n > limit) {
        return error(
            ErrorCode::BodyTooLarge,
            format!(
                "body of {} bytes exceeds the limit of {limit}",
                declared.unwrap_or(0)
            ),
        );
    }
    let mode = match req.headers().get(WRITE_MODE_HEADER).map(|v| v.to_str()) {
        None => WriteMode::Through,
        Some(Ok(v)) => match v.parse::<WriteMode>() {
            Ok(m) => m,
            Err(e) => return error(ErrorCode::BadRequest, e),
        },
        Some(Err(_)) => return error(ErrorCode::BadRequest, "write mode is not ASCII"),
    };
    // A write-through behind pending write-backs of the same object would
    // reach S3 before them and be overwritten: it queues behind them.
    let mode = match state.cache.pending_meta(&uri) {
        Ok(Some(_)) | Err(_) => WriteMode::Back,
        Ok(None) => mode,
    };
    if mode != WriteMode::Back && matches!(role, WriteRole::Replica { .. }) {
        return error(ErrorCode::BadRequest, "a replica copy must be a write-back");
    }
    // A declared checksum trailer is required: its absence fails the
    // write rather than skipping the check.
    let crc_required = header_lists(req.headers(), header::TRAILER, BODY_CRC32C_TRAILER);
    let keepalive = req.headers().contains_key(KEEPALIVE_HEADER);
    let patience = client_patience(req.headers());
    let client_crc = Arc::new(OnceLock::new());
    let body = IdleTimeoutBody::new(req.into_body(), state.limits.body_idle_timeout);
    let (body, arrived) = CheckedBody::new(body, limit, crc_required, client_crc.clone());
    // The write runs in its own task: if the client goes away, hyper
    // drops this handler, but the task sees the body end in an error and
    // aborts the multipart upload and frees its staged pages.
    let (cache, task_uri) = (state.cache.clone(), uri.clone());
    // A copy's answer names who holds it: the sender checks it is the
    // worker it chose (a stale ring can route to another).
    let held_by = match role {
        WriteRole::Replica { .. } => state.cache.ring_address(),
        WriteRole::Primary => None,
    };
    let mut task = if mode == WriteMode::Back {
        crate::tenant::spawn(crate::fence::scope(patience, async move {
            cache
                .write_back(&task_uri, Box::pin(body), client_crc, role, user)
                .await
        }))
    } else {
        crate::tenant::spawn(crate::fence::scope(patience, async move {
            cache.write(&task_uri, Box::pin(body), &user).await
        }))
    };
    if keepalive {
        // The head goes out once the body is in; then spaces while the
        // object is stored, so the client can tell work from silence.
        tokio::select! {
            _ = arrived => {}
            done = &mut task => return write_answer(&uri, done, held_by),
        }
        let outcome = tokio::spawn(async move {
            match task.await {
                Ok(Ok(meta)) => WriteOutcome::Stored(ObjectStat {
                    held_by,
                    ..stat_body(&uri, &meta)
                }),
                Ok(Err(e)) => {
                    WriteOutcome::Failed(ErrorBody::new(cache_error_code(&e), e.to_string()))
                }
                Err(e) => WriteOutcome::Failed(ErrorBody::new(
                    ErrorCode::Internal,
                    format!("write task failed: {e}"),
                )),
            }
        });
        return json_when_ready(outcome);
    }
    write_answer(&uri, task.await, held_by)
}

/// A watched write's client: how long it waits, and when it sent.
fn client_patience(headers: &http::HeaderMap) -> Option<crate::fence::ClientPatience> {
    let number = |name: &str| {
        headers
            .get(name)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.trim().parse::<u64>().ok())
    };
    Some(crate::fence::ClientPatience {
        deadline: std::time::Duration::from_millis(number(KEEPALIVE_HEADER)?),
        sent_ms: number(SENT_AT_HEADER)?,
    })
}

fn write_answer(
    uri: &ObjectUri,
    done: Result<Result<ObjectMeta, CacheError>, tokio::task::JoinError>,
    held_by: Option<String>,
) -> Response {
    match done {
        Ok(Ok(meta)) => json(
            StatusCode::OK,
            &ObjectStat {
                held_by,
                ..stat_body(uri, &meta)
            },
        ),
        Ok(Err(e)) => cache_error(&e),
        Err(e) => cache_error(&CacheError::Local(format!("write task failed: {e}"))),
    }
}

/// Pages of a written object handed over by the worker that took the
/// write (see `placement.rs`).
async fn accept_pages(
    state: &AppState,
    access: &Access<'_>,
    rest: &str,
    req: http::Request<Incoming>,
) -> Response {
    let uri = match parse_uri(rest) {
        Ok(u) => u,
        Err(resp) => return *resp,
    };
    check!(access.peer_object(&uri));
    let Some(etag) = if_match(&req).filter(|e| !e.is_empty() && e != "*") else {
        return error(
            ErrorCode::BadRequest,
            "a page hand-off needs If-Match with the object's ETag",
        );
    };
    let offset = req
        .headers()
        .get(OFFSET_HEADER)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    let Some(offset) = offset else {
        return error(
            ErrorCode::BadRequest,
            format!("a page hand-off needs {OFFSET_HEADER}: a byte offset"),
        );
    };
    let len = req
        .headers()
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    let Some(len) = len else {
        return error(
            ErrorCode::BadRequest,
            "a page hand-off needs a Content-Length",
        );
    };
    let from = req
        .headers()
        .get(FROM_HEADER)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("")
        .to_string();
    let body = IdleTimeoutBody::new(req.into_body(), state.limits.body_idle_timeout);
    let body = BodyStream::new(body).filter_map(|frame| {
        std::future::ready(match frame {
            Ok(frame) => frame.into_data().ok().map(Ok),
            Err(e) => Some(Err(body_error(e))),
        })
    });
    match state
        .cache
        .accept_pages(&uri, &etag, offset, len, &from, Box::pin(body))
        .await
    {
        Ok(pages) => json(StatusCode::OK, &serde_json::json!({ "pages": pages })),
        Err(e) => cache_error(&e),
    }
}

async fn copy(
    state: &AppState,
    access: &Access<'_>,
    source: &HeaderValue,
    etag: Option<String>,
    to: &ObjectUri,
    user: Option<UserMeta>,
) -> Response {
    let from = source
        .to_str()
        .ok()
        .and_then(|s| s.strip_prefix("/v1/objects/"))
        .ok_or_else(|| "expected /v1/objects/{bucket}/{key}".to_string())
        .and_then(|rest| ObjectUri::from_api_path(rest).map_err(|e| e.to_string()));
    let from = match from {
        Ok(u) => u,
        Err(e) => {
            return error(
                ErrorCode::InvalidPath,
                format!("bad {COPY_SOURCE_HEADER} header: {e}"),
            )
        }
    };
    check!(access.read(&from));
    match state
        .cache
        .copy(&from, etag.as_deref(), to, user.as_ref())
        .await
    {
        Ok(meta) => json(StatusCode::OK, &stat_body(to, &meta)),
        Err(e) => cache_error(&e),
    }
}

async fn delete(state: &AppState, access: &Access<'_>, rest: &str) -> Response {
    let uri = match parse_uri(rest) {
        Ok(u) => u,
        Err(resp) => return *resp,
    };
    check!(access.write(&uri));
    match state.cache.delete(&uri).await {
        Ok(()) => {
            let mut resp = http::Response::new(full(Bytes::new()));
            *resp.status_mut() = StatusCode::NO_CONTENT;
            resp
        }
        Err(e) => cache_error(&e),
    }
}

async fn list(state: &AppState, access: &Access<'_>, bucket: &str, query: &str) -> Response {
    if let Err(e) = validate_bucket(bucket) {
        return error(ErrorCode::InvalidPath, e.to_string());
    }
    let mut prefix = String::new();
    let mut delimiter = None;
    let mut token = None;
    let mut max_keys = 1000u32;
    let mut with_meta = false;
    for pair in query.split('&').filter(|p| !p.is_empty()) {
        let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
        let spaced = v.replace('+', " ");
        let Ok(v) = percent_encoding::percent_decode_str(&spaced).decode_utf8() else {
            return error(
                ErrorCode::BadRequest,
                format!("query parameter {k} is not valid UTF-8"),
            );
        };
        let v = v.into_owned();
        match k {
            "prefix" => prefix = v,
            "delimiter" => delimiter = Some(v).filter(|d| !d.is_empty()),
            "continuation-token" => token = Some(v).filter(|t| !t.is_empty()),
            "metadata" => match v.as_str() {
                "true" | "1" => with_meta = true,
                "false" | "0" => with_meta = false,
                _ => return error(ErrorCode::BadRequest, "metadata must be true or false"),
            },
            "max-keys" => match v.parse::<u32>() {
                Ok(n) if (1..=1000).contains(&n) => max_keys = n,
                _ => return error(ErrorCode::BadRequest, "max-keys must be 1..=1000"),
            },
            other => {
                return error(
                    ErrorCode::BadRequest,
                    format!("unknown query parameter {other:?}"),
                )
            }
        }
    }
    if prefix.len() > MAX_KEY_BYTES || prefix.chars().any(char::is_control) {
        return error(
            ErrorCode::InvalidPath,
            "prefix is too long or contains control characters",
        );
    }
    if prefix.split('/').any(|c| c == "..") {
        return error(ErrorCode::InvalidPath, "prefix contains a '..' component");
    }
    check!(access.list(bucket, &prefix));
    let listed: Result<ListResponse, CacheError> = state
        .cache
        .list(
            bucket,
            &prefix,
            delimiter.as_deref(),
            token.as_deref(),
            max_keys,
        )
        .await;
    match listed {
        Ok(mut resp) => {
            access.filter_listing(bucket, &mut resp);
            if with_meta {
                // One HEAD per object S3 listed without metadata we know:
                // a page can take longer than a client waits for a byte.
                use tracing::Instrument as _;
                let cache = state.cache.clone();
                let bucket = bucket.to_string();
                let work = crate::tenant::spawn(
                    async move {
                        cache.add_user_meta(&bucket, &mut resp).await;
                        resp
                    }
                    .in_current_span(),
                );
                return json_when_ready(work);
            }
            json(StatusCode::OK, &resp)
        }
        Err(e) => cache_error(&e),
    }
}
