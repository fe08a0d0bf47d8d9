//! A job's published read order (a plan, issue #35) turned into the pages
//! it names, for eviction by plan (`plan_order`). Objects are resolved to
//! their current versions here; an entry naming an object that does not
//! exist is skipped and reported, never an error for the whole plan.

use std::collections::HashMap;
use std::ops::Range;
use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt as _;
use lakecache_protocol::{ObjectUri, ReadKind};

use super::plan_fetch::PlannedRead;
use super::{Cache, CacheError};
use crate::pages::PageKey;
use crate::plan_order::MAX_PLAN_PAGES;
use crate::store::ObjectMeta;

/// Objects looked up at once while a plan is resolved.
const LOOKUPS_AT_ONCE: usize = 16;
/// Skipped entries named in a report at most (the count is exact).
const SKIPS_NAMED: usize = 8;

/// One entry of a plan: bytes of an object, read in this order.
#[derive(Debug, Clone)]
pub struct PlanEntry {
    pub uri: ObjectUri,
    pub range: Range<u64>,
}

/// What installing a plan did.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct PlanReport {
    /// Pages the plan names, in order (a page counted once per run of
    /// entries inside it).
    pub pages: usize,
    pub skipped_entries: usize,
    /// The first few skipped entries, with why.
    pub skipped: Vec<String>,
}

impl Cache {
    /// Installs (or renews) plan `name`, live for `ttl` unless renewed.
    /// Ranges are clamped to the objects' sizes; entries naming objects
    /// that cannot be found are skipped and named in the report.
    pub async fn install_plan(
        self: &Arc<Self>,
        name: &str,
        entries: &[PlanEntry],
        ttl: Duration,
    ) -> Result<PlanReport, CacheError> {
        let metas = self.plan_objects(entries).await;
        let ps = self.config.page_size;
        let mut report = PlanReport::default();
        let mut pages: Vec<PageKey> = Vec::new();
        // For prefetch: each page's object (an index into `objects`) and
        // page number.
        let mut objects: Vec<(ObjectUri, ObjectMeta)> = Vec::new();
        let mut object_at: HashMap<String, u32> = HashMap::new();
        let mut at: Vec<(u32, u64)> = Vec::new();
        // Per position, the part of its page the plan reads there.
        let mut reads: Vec<PlannedRead> = Vec::new();
        for entry in entries {
            let key = entry.uri.to_string();
            let meta = match metas.get(&key) {
                Some(Ok(meta)) => meta,
                Some(Err(why)) => {
                    report.skipped_entries += 1;
                    if report.skipped.len() < SKIPS_NAMED {
                        report.skipped.push(format!("{key}: {why}"));
                    }
                    continue;
                }
                None => continue,
            };
            let end = entry.range.end.min(meta.size);
            if entry.range.start >= end {
                continue;
            }
            let obj = match object_at.get(&key) {
                Some(obj) => *obj,
                None => {
                    objects.push((entry.uri.clone(), meta.clone()));
                    let obj = objects.len() as u32 - 1;
                    object_at.insert(key.clone(), obj);
                    obj
                }
            };
            for idx in entry.range.start / ps..=(end - 1) / ps {
                let page = PageKey::new(&key, &meta.etag, idx);
                let read = PlannedRead::of(idx * ps, entry.range.start, end, ps);
                if pages.last() != Some(&page) {
                    pages.push(page);
                    at.push((obj, idx));
                    reads.push(read);
                } else if let Some(last) = reads.last_mut() {
                    *last = last.joined(read);
                }
            }
            if pages.len() > MAX_PLAN_PAGES {
                return Err(CacheError::Invalid(format!(
                    "the plan names more than {MAX_PLAN_PAGES} pages of {ps} bytes; nothing was installed"
                )));
            }
        }
        if report.skipped_entries > 0 {
            tracing::warn!(plan = name, skipped = report.skipped_entries, first = ?report.skipped.first(), "plan entries skipped");
        }
        // A plan ranks the pages of the tenant that published it.
        let tenant = crate::tenant::current();
        let spans: Vec<(u32, u32)> = reads.iter().map(PlannedRead::span).collect();
        self.lru
            .install_plan(name, tenant.clone(), &pages, &spans, ttl)
            .map_err(|e| CacheError::Invalid(format!("{e}; nothing was installed")))?;
        report.pages = pages.len();
        self.plan_fetches.install(
            name,
            super::plan_fetch::PlanFetch::new(tenant, objects, pages, at, reads),
        );
        Ok(report)
    }

    /// The current version of each object the entries name, or why not.
    async fn plan_objects(
        self: &Arc<Self>,
        entries: &[PlanEntry],
    ) -> HashMap<String, Result<ObjectMeta, String>> {
        let mut uris: Vec<ObjectUri> = Vec::new();
        let mut named = std::collections::HashSet::new();
        for entry in entries {
            if named.insert(entry.uri.to_string()) {
                uris.push(entry.uri.clone());
            }
        }
        // Owned futures: a stream of ones borrowing `self` is not `Send`
        // for every lifetime, which the server's spawned tasks need.
        let lookups = uris.into_iter().map(|uri| {
            let this = self.clone();
            async move {
                let meta = this.stat(&uri).await.map_err(|e| e.to_string());
                (uri.to_string(), meta)
            }
        });
        futures::stream::iter(lookups)
            .buffer_unordered(LOOKUPS_AT_ONCE)
            .collect()
            .await
    }

    /// A client read `part` (page-relative) of page `idx`: the plans it
    /// was next for move on (nothing to do, and no hashing, while no plan
    /// is installed). Returns whether some plan reads the page again: then
    /// a miss fetches it whole.
    pub(crate) fn note_planned_read(
        &self,
        uri: &ObjectUri,
        etag: &str,
        idx: u64,
        part: std::ops::Range<u64>,
        kind: ReadKind,
    ) -> bool {
        if !self.lru.has_plans() {
            return false;
        }
        if kind == ReadKind::Demand {
            self.plan_fetches.demand_read();
        }
        self.lru
            .planned_read(&PageKey::new(&uri.to_string(), etag, idx), part, kind)
    }
}
