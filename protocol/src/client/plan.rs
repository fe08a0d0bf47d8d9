//! Publishing a rank's read order to one worker (`/v1/plans`).

use http_body_util::{BodyExt, Full};

use super::{ClientError, WorkerClient};
use crate::{PlanResult, PlanSpec};

impl WorkerClient {
    /// Installs or renews plan `name` (`job/rank`) on this worker.
    pub async fn publish_plan(
        &self,
        name: &str,
        spec: &PlanSpec,
    ) -> Result<PlanResult, ClientError> {
        let body = serde_json::to_vec(spec).map_err(|e| ClientError::Decode(e.to_string()))?;
        let req = self
            .request(http::Method::PUT, &format!("/v1/plans/{name}"))
            .header(http::header::CONTENT_TYPE, "application/json")
            .body(Full::new(body.into()).map_err(|e| match e {}).boxed())
            .map_err(|e| ClientError::Decode(e.to_string()))?;
        let resp = self.send_quick(req).await?;
        let body = self.collect(resp.into_body()).await?;
        serde_json::from_slice(&body).map_err(|e| ClientError::Decode(e.to_string()))
    }
}
