//! `lakecache umount PATH [--abort]`: unmount a lakecache mount; with
//! `--abort`, end one whose daemon is stuck.

use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use clap::Args;

#[derive(Args)]
pub struct UmountCmd {
    /// The mount point
    path: PathBuf,
    /// The mount's daemon is stuck (processes hang in the mount, even
    /// `kill -9` does not end them): abort its kernel FUSE connection, so
    /// every request waiting on it fails at once, then detach the mount
    #[arg(long)]
    abort: bool,
}

impl UmountCmd {
    pub fn run(self) -> Result<()> {
        if self.abort {
            let done = lakecache_fuse::mount::abort_connection(&self.path).with_context(|| {
                format!("aborting the FUSE connection of {}", self.path.display())
            })?;
            eprintln!(
                "aborted FUSE connection {} (/sys/fs/fuse/connections/{}/abort); {}",
                done.connection,
                done.connection,
                if done.detached {
                    "the mount point is detached"
                } else {
                    "detaching the mount point failed: run umount -l on it"
                }
            );
            return Ok(());
        }
        if !lakecache_fuse::mount::is_mounted(&self.path) {
            bail!("{} is not a mount point", self.path.display());
        }
        let status = std::process::Command::new("fusermount3")
            .arg("-u")
            .arg(&self.path)
            .status()
            .context("running fusermount3 (from the fuse3 package)")?;
        if !status.success() {
            bail!(
                "fusermount3 -u {} failed ({status}); if the mount is busy, close what uses it; if its daemon is stuck, use --abort",
                self.path.display()
            );
        }
        Ok(())
    }
}
