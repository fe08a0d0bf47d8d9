//! `/v1/load`: preload jobs. `POST /v1/load/{id}` with a JSON
//! [`LoadSpec`] starts one (or returns it when it runs already),
//! `GET /v1/load/{id}` reports its progress, `DELETE /v1/load/{id}`
//! cancels it, `GET /v1/load` lists the caller's jobs. A job belongs to
//! the tenant that started it; others see no such job.

use http::{Method, StatusCode};
use http_body_util::BodyExt;
use hyper::body::Incoming;
use lakecache_protocol::{
    validate_bucket, validate_load_id, ErrorCode, FreeResult, FreeSpec, LoadProgress, LoadSpec,
};

use super::auth::Access;
use super::response::{error, json, Response};
use super::routes::AppState;
use crate::preload::PreloadError;

/// A spec is a bucket, a prefix and a pattern: small.
const MAX_SPEC_BYTES: usize = 16 * 1024;

pub(super) async fn route(
    state: &AppState,
    access: &Access<'_>,
    rest: &str,
    method: Method,
    req: http::Request<Incoming>,
) -> (&'static str, Response) {
    let id = rest.trim_start_matches('/');
    if id.is_empty() {
        return match method {
            Method::GET => ("load_list", list(state, access)),
            _ => ("invalid", super::routes::method_not_allowed("GET")),
        };
    }
    if let Err(e) = validate_load_id(id) {
        return ("invalid", error(ErrorCode::BadRequest, e));
    }
    match method {
        Method::POST => ("load_start", start(state, access, id, req).await),
        Method::GET => (
            "load_status",
            match own_job(state, access, id) {
                Ok(job) => json(StatusCode::OK, &job.progress()),
                Err(resp) => *resp,
            },
        ),
        Method::DELETE => (
            "load_cancel",
            match own_job(state, access, id) {
                Ok(job) => {
                    job.cancel();
                    json(StatusCode::OK, &job.progress())
                }
                Err(resp) => *resp,
            },
        ),
        _ => (
            "invalid",
            super::routes::method_not_allowed("GET, POST, DELETE"),
        ),
    }
}

/// `POST /v1/free/{bucket}` with a JSON [`FreeSpec`]: evicts this
/// worker's pages under the prefix.
pub(super) async fn free(
    state: &AppState,
    access: &Access<'_>,
    bucket: &str,
    method: Method,
    req: http::Request<Incoming>,
) -> (&'static str, Response) {
    if method != Method::POST {
        return ("invalid", super::routes::method_not_allowed("POST"));
    }
    let spec: FreeSpec = match read_spec(req, "free").await {
        Ok(s) => s,
        Err(resp) => return ("free", *resp),
    };
    if let Err(e) = validate_bucket(bucket) {
        return ("free", error(ErrorCode::InvalidPath, e.to_string()));
    }
    if let Err(resp) = check_prefix(&spec.prefix) {
        return ("free", *resp);
    }
    if let Err(denied) = access.free(bucket, &spec.prefix) {
        return ("free", *denied);
    }
    let resp = match state.cache.free(bucket, &spec.prefix).await {
        Ok((pages, bytes)) => json(StatusCode::OK, &FreeResult { pages, bytes }),
        Err(e) => error(ErrorCode::Internal, format!("freeing pages: {e}")),
    };
    ("free", resp)
}

async fn read_spec<T: serde::de::DeserializeOwned>(
    req: http::Request<Incoming>,
    what: &str,
) -> Result<T, Box<Response>> {
    let body = match http_body_util::Limited::new(req.into_body(), MAX_SPEC_BYTES)
        .collect()
        .await
    {
        Ok(b) => b.to_bytes(),
        Err(e) => {
            return Err(Box::new(error(
                ErrorCode::BadRequest,
                format!("{what} spec body: {e} (at most {MAX_SPEC_BYTES} bytes)"),
            )))
        }
    };
    serde_json::from_slice(&body)
        .map_err(|e| Box::new(error(ErrorCode::BadRequest, format!("{what} spec: {e}"))))
}

fn check_prefix(prefix: &str) -> Result<(), Box<Response>> {
    if prefix.len() > lakecache_protocol::MAX_KEY_BYTES
        || prefix.chars().any(char::is_control)
        || prefix.split('/').any(|c| c == "..")
    {
        return Err(Box::new(error(
            ErrorCode::InvalidPath,
            "prefix is too long, contains control characters or a '..' component",
        )));
    }
    Ok(())
}

async fn start(
    state: &AppState,
    access: &Access<'_>,
    id: &str,
    req: http::Request<Incoming>,
) -> Response {
    let spec: LoadSpec = match read_spec(req, "load").await {
        Ok(s) => s,
        Err(resp) => return *resp,
    };
    if let Err(e) = validate_bucket(&spec.bucket) {
        return error(ErrorCode::InvalidPath, e.to_string());
    }
    if let Err(resp) = check_prefix(&spec.prefix) {
        return *resp;
    }
    if let Some(n) = spec
        .replicas
        .filter(|n| !(1..=lakecache_protocol::MAX_LOAD_REPLICAS).contains(n))
    {
        return error(
            ErrorCode::BadRequest,
            format!(
                "replicas must be 1..={}, got {n}",
                lakecache_protocol::MAX_LOAD_REPLICAS
            ),
        );
    }
    if let Err(denied) = access.list(&spec.bucket, &spec.prefix) {
        return *denied;
    }
    let tenant = access.tenant().map(str::to_string);
    match state.cache.preloads.start(&state.cache, id, spec, tenant) {
        Ok(job) => json(StatusCode::ACCEPTED, &job.progress()),
        Err(e @ PreloadError::Conflict(_)) => error(ErrorCode::Conflict, e.to_string()),
        Err(e @ PreloadError::TooMany) => error(ErrorCode::TooManyRequests, e.to_string()),
        Err(e @ PreloadError::BadPattern { .. }) => error(ErrorCode::BadRequest, e.to_string()),
    }
}

fn own_job(
    state: &AppState,
    access: &Access<'_>,
    id: &str,
) -> Result<std::sync::Arc<crate::preload::LoadJob>, Box<Response>> {
    match state.cache.preloads.get(id) {
        Some(job) if job.tenant.as_deref() == access.tenant() => Ok(job),
        _ => Err(Box::new(error(
            ErrorCode::NotFound,
            format!("no load job {id:?} on this worker"),
        ))),
    }
}

fn list(state: &AppState, access: &Access<'_>) -> Response {
    let jobs: Vec<LoadProgress> = state
        .cache
        .preloads
        .all()
        .iter()
        .filter(|j| j.tenant.as_deref() == access.tenant())
        .map(|j| j.progress())
        .collect();
    json(StatusCode::OK, &jobs)
}
