//! Publishing a rank's read order to one worker (`/v1/plans`).

use super::{ClientError, WorkerClient};
use crate::{PlanResult, PlanSpec};

impl WorkerClient {
    /// Installs or renews plan `name` (`job/rank`) on this worker.
    pub async fn publish_plan(
        &self,
        name: &str,
        spec: &PlanSpec,
    ) -> Result<PlanResult, ClientError> {
        let req = self.json_request(http::Method::PUT, &format!("/v1/plans/{name}"), spec)?;
        self.load_call(req).await
    }
}
