//! Keeps the spare page files the bodies' bursts ask for, or a
//! write-back mount on this host announced (see `spares.rs`), written
//! only while no body is being taken: a spare written during a
//! checkpoint would take the disk from it.

use std::sync::{Arc, Weak};
use std::time::Duration;

use super::WriteBack;
use crate::spares::Spares;

/// How soon a filler waiting for the bodies to go quiet looks again.
const LOOK_AGAIN: Duration = Duration::from_millis(50);
/// How long the filler rests after a spare could not be written.
const AFTER_A_FAILURE: Duration = Duration::from_secs(10);

impl WriteBack {
    /// Keeps spare page files of `page_size` in `<writeback>/spare` (up to
    /// `spare_most` bytes); the caller runs [`spare_filler`]. A directory
    /// that cannot be used is logged and the pages go to new files.
    pub(crate) fn keep_spares(&self, page_size: u64) {
        let dir = self.dir.join("spare");
        if self.config.spare_most == 0 {
            // Spares an earlier run kept are disk space no one uses now.
            if let Err(e) = std::fs::remove_dir_all(&dir) {
                if e.kind() != std::io::ErrorKind::NotFound {
                    tracing::warn!(dir = %dir.display(), error = %e, "removing spare page files");
                }
            }
            return;
        }
        match Spares::open(&dir, page_size, self.config.spare_most) {
            Ok(spares) => {
                let spares = Arc::new(spares);
                self.pages.use_spares(spares.clone());
                let _ = self.spares.set(spares);
            }
            Err(e) => tracing::warn!(
                dir = %dir.display(),
                error = %e,
                "spare page files unavailable; write-back pages go to new files"
            ),
        }
    }
}

impl crate::cache::Cache {
    /// A mount on this host writes back through this worker: its spares
    /// are written now, up to `spare_most`, rather than after its first
    /// burst. Returns the bytes of spares kept at most (0: none).
    pub fn prepare_write_back(&self) -> u64 {
        let spares = self.writeback.as_ref().and_then(|wb| wb.spares.get());
        spares.map_or(0, |s| s.prepare())
    }
}

/// Refills the spares after each burst of bodies, one at a time, while
/// the bodies stay quiet; ends when the worker is gone.
pub(crate) async fn spare_filler(wb: Weak<WriteBack>) {
    let Some(spares) = wb.upgrade().and_then(|wb| wb.spares.get().cloned()) else {
        return;
    };
    loop {
        spares.wanted.notified().await;
        loop {
            let Some(strong) = wb.upgrade() else { return };
            if !strong.bodies_quiet() {
                drop(strong);
                tokio::time::sleep(LOOK_AGAIN).await;
                continue;
            }
            drop(strong);
            spares.burst_ended();
            if spares.missing() == 0 || crate::crashsim::power_is_out() {
                break;
            }
            let one = spares.clone();
            match tokio::task::spawn_blocking(move || one.fill_one()).await {
                Ok(Ok(true)) => {}
                Ok(Ok(false)) => {
                    tracing::info!(
                        "the cache directory refuses O_DIRECT; no spare page files are kept"
                    );
                    return;
                }
                Ok(Err(e)) => {
                    tracing::warn!(error = %e, "writing a spare page file failed; trying again later");
                    tokio::time::sleep(AFTER_A_FAILURE).await;
                    break;
                }
                Err(_) => return,
            }
        }
    }
}
