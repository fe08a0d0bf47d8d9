//! The tenant a piece of work is done for (from the caller's token), so
//! pages it fetches count against that tenant's quota and its S3 requests
//! against that tenant's rate, without passing it through every call.

use std::future::Future;
use std::sync::Arc;

tokio::task_local! {
    static TENANT: Option<Arc<str>>;
}

/// The tenant of the current request or job; `None` for anonymous
/// callers and the worker's own background work.
pub fn current() -> Option<Arc<str>> {
    TENANT.try_with(Clone::clone).ok().flatten()
}

/// Runs `work` on behalf of `tenant`.
pub async fn scope<F: Future>(tenant: Option<Arc<str>>, work: F) -> F::Output {
    TENANT.scope(tenant, work).await
}

/// `tokio::spawn` of work that stays on the current tenant's account.
pub fn spawn<F>(work: F) -> tokio::task::JoinHandle<F::Output>
where
    F: Future + Send + 'static,
    F::Output: Send + 'static,
{
    tokio::spawn(scope(current(), work))
}
