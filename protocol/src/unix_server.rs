//! The server side shared by this host's Unix sockets (the worker's
//! short-circuit reads, the mount's tier socket): a socket file only its
//! user can open, a peer check behind the file mode, and framed requests
//! (a 4-byte little-endian length, then the body) with the descriptor
//! that may ride on their first byte.

use std::io;
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::fs::PermissionsExt;
use std::path::Path;

use tokio::io::AsyncReadExt;
use tokio::io::Interest;
use tokio::net::{UnixListener, UnixStream};

use crate::local_read::recvmsg_fd;

/// Binds the socket at `path` (a stale one from an earlier run is
/// replaced) with mode 0600.
pub fn bind_private(path: &Path) -> io::Result<UnixListener> {
    match std::fs::remove_file(path) {
        Err(e) if e.kind() != io::ErrorKind::NotFound => return Err(e),
        _ => {}
    }
    let listener = UnixListener::bind(path)?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600))?;
    Ok(listener)
}

/// The file mode keeps others out; this keeps out a process that was
/// handed a connected socket by someone else, too. `role` names this
/// end in the refusal ("worker", "mount").
pub fn same_user(stream: &UnixStream, role: &str) -> Result<(), String> {
    let cred = stream.peer_cred().map_err(|e| e.to_string())?;
    // SAFETY: geteuid has no preconditions.
    let me = unsafe { libc::geteuid() };
    if cred.uid() == me || cred.uid() == 0 {
        Ok(())
    } else {
        Err(format!("uid {} is not the {role}'s user {me}", cred.uid()))
    }
}

/// Reads one request of at most `max` bytes, with the descriptor that
/// rode on its first byte.
pub async fn read_request(
    stream: &mut UnixStream,
    max: usize,
) -> io::Result<(Vec<u8>, Option<OwnedFd>)> {
    let mut len = [0u8; 4];
    let raw = stream.as_raw_fd();
    let (got, fd) = stream
        .async_io(Interest::READABLE, || recvmsg_fd(raw, &mut len))
        .await?;
    if got == 0 {
        return Err(io::ErrorKind::UnexpectedEof.into());
    }
    stream.read_exact(&mut len[got..]).await?;
    let n = u32::from_le_bytes(len) as usize;
    if n > max {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            "request too long",
        ));
    }
    let mut body = vec![0u8; n];
    stream.read_exact(&mut body).await?;
    Ok((body, fd))
}
