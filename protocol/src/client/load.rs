//! Preload jobs on one worker (`/v1/load`).

use http_body_util::{BodyExt, Full};

use super::{empty, ClientError, WorkerClient};
use crate::{FreeResult, FreeSpec, LoadProgress, LoadSpec};

impl WorkerClient {
    /// Starts job `id` on this worker (or finds it running with `spec`).
    pub async fn load_start(&self, id: &str, spec: &LoadSpec) -> Result<LoadProgress, ClientError> {
        let req = self.json_request(http::Method::POST, &format!("/v1/load/{id}"), spec)?;
        self.load_call(req).await
    }

    pub async fn load_status(&self, id: &str) -> Result<LoadProgress, ClientError> {
        self.get_json(&format!("/v1/load/{id}")).await
    }

    /// Cancels job `id`; what it fetched stays cached.
    pub async fn load_cancel(&self, id: &str) -> Result<LoadProgress, ClientError> {
        let req = self
            .request(http::Method::DELETE, &format!("/v1/load/{id}"))
            .body(empty())
            .map_err(|e| ClientError::Decode(e.to_string()))?;
        self.load_call(req).await
    }

    /// The caller's jobs on this worker.
    pub async fn load_jobs(&self) -> Result<Vec<LoadProgress>, ClientError> {
        self.get_json("/v1/load").await
    }

    /// Evicts this worker's cached pages under `s3://bucket/prefix`.
    pub async fn free(&self, bucket: &str, prefix: &str) -> Result<FreeResult, ClientError> {
        let spec = FreeSpec {
            prefix: prefix.to_string(),
        };
        let req = self.json_request(http::Method::POST, &format!("/v1/free/{bucket}"), &spec)?;
        self.load_call(req).await
    }

    /// A request carrying `body` as JSON.
    pub(super) fn json_request(
        &self,
        method: http::Method,
        path: &str,
        body: &impl serde::Serialize,
    ) -> Result<http::Request<super::RequestBody>, ClientError> {
        let body = serde_json::to_vec(body).map_err(|e| ClientError::Decode(e.to_string()))?;
        self.request(method, path)
            .header(http::header::CONTENT_TYPE, "application/json")
            .body(Full::new(body.into()).map_err(|e| match e {}).boxed())
            .map_err(|e| ClientError::Decode(e.to_string()))
    }

    pub(super) async fn load_call<T: serde::de::DeserializeOwned>(
        &self,
        req: http::Request<super::RequestBody>,
    ) -> Result<T, ClientError> {
        let resp = self.send_quick(req).await?;
        let body = self.collect(resp.into_body()).await?;
        serde_json::from_slice(&body).map_err(|e| ClientError::Decode(e.to_string()))
    }
}
