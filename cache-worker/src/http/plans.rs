//! `PUT /v1/plans/{job}/{rank}`: a training job publishes one rank's read
//! order for the coming epoch (the format: `lakecache_protocol::PlanSpec`),
//! and this worker evicts its pages by it (`plan_order`). Publishing again
//! renews the plan; one not renewed within its TTL expires.

use std::time::Duration;

use http::StatusCode;
use http_body_util::BodyExt;
use hyper::body::Incoming;
use lakecache_protocol::{validate_plan_name, ErrorCode, PlanResult, PlanSpec, MAX_PLAN_BYTES};

use super::auth::Access;
use super::response::{cache_error, error, json, Response};
use super::routes::AppState;
use crate::cache::{CacheError, PlanEntry};

pub(super) async fn publish(
    state: &AppState,
    access: &Access<'_>,
    name: &str,
    req: http::Request<Incoming>,
) -> Response {
    if let Err(e) = validate_plan_name(name) {
        return error(ErrorCode::BadRequest, e);
    }
    let body = match http_body_util::Limited::new(req.into_body(), MAX_PLAN_BYTES)
        .collect()
        .await
    {
        Ok(b) => b.to_bytes(),
        Err(e) => {
            return error(
                ErrorCode::BadRequest,
                format!("plan body: {e} (at most {MAX_PLAN_BYTES} bytes)"),
            )
        }
    };
    let spec: PlanSpec = match serde_json::from_slice(&body) {
        Ok(s) => s,
        Err(e) => return error(ErrorCode::BadRequest, format!("plan: {e}")),
    };
    drop(body);
    let entries = match spec.checked() {
        Ok(e) => e,
        Err(e) => return error(ErrorCode::BadRequest, format!("plan: {e}")),
    };
    // Every object the plan names must be one the caller may read: a
    // plan is not a way to learn what exists outside its scope.
    for (uri, _) in &entries {
        if let Err(denied) = access.read(uri) {
            return *denied;
        }
    }
    let entries: Vec<PlanEntry> = entries
        .into_iter()
        .map(|(uri, range)| PlanEntry { uri, range })
        .collect();
    // Tenants' plans live apart: one cannot replace another's.
    let scoped_name = format!("{}:{name}", access.tenant().unwrap_or(""));
    let ttl = Duration::from_secs(spec.ttl_seconds);
    match state.cache.install_plan(&scoped_name, &entries, ttl).await {
        Ok(report) => json(
            StatusCode::OK,
            &PlanResult {
                pages: report.pages as u64,
                skipped_entries: report.skipped_entries as u64,
                skipped: report.skipped,
            },
        ),
        Err(CacheError::Invalid(msg)) => error(ErrorCode::BadRequest, format!("plan: {msg}")),
        Err(e) => cache_error(&e),
    }
}
