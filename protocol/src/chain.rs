//! Display of an error with its whole cause chain, for log lines.

use std::error::Error;
use std::fmt;

/// Displays `a: b: c` for an error and every source after it.
pub struct Chain<'a>(pub &'a (dyn Error + 'static));

impl fmt::Display for Chain<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.0)?;
        let mut next = self.0.source();
        while let Some(cause) = next {
            write!(f, ": {cause}")?;
            next = cause.source();
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::Chain;
    use crate::{ClientError, WorkerClient};

    #[tokio::test]
    async fn a_refused_connection_keeps_its_cause() {
        // Port 1 on loopback: nothing listens there.
        let client = WorkerClient::new("127.0.0.1:1", Duration::from_secs(5)).unwrap();
        let err = client.health().await.unwrap_err();
        assert!(matches!(err, ClientError::Transport { .. }), "{err:?}");
        let top = err.to_string();
        let whole = Chain(&err).to_string();
        assert!(
            whole.starts_with(&top) && whole.len() > top.len(),
            "{whole}"
        );
        assert!(whole.to_lowercase().contains("refused"), "{whole}");
    }
}
