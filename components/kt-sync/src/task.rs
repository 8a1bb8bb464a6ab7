//! Blocking work (file I/O, hashing, network plumbing) off the async
//! threads, with the error type of whoever asks: the one helper the
//! client, the servers and the testbed share.

/// A blocking task that did not return: it panicked or was cancelled.
#[derive(Debug, thiserror::Error)]
#[error("worker failed: {0}")]
pub struct WorkerLost(pub String);

/// Runs `f` on tokio's blocking threads and returns what it returned; a
/// task that did not return becomes `E::from(WorkerLost)`.
pub async fn blocking<T, E>(f: impl FnOnce() -> Result<T, E> + Send + 'static) -> Result<T, E>
where
    T: Send + 'static,
    E: From<WorkerLost> + Send + 'static,
{
    tokio::task::spawn_blocking(f)
        .await
        .map_err(|e| E::from(WorkerLost(e.to_string())))?
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, PartialEq)]
    enum E {
        Mine(&'static str),
        Lost(String),
    }

    impl From<WorkerLost> for E {
        fn from(w: WorkerLost) -> Self {
            E::Lost(w.to_string())
        }
    }

    #[tokio::test]
    async fn results_and_panics_come_back_as_the_callers_errors() {
        assert_eq!(blocking(|| Ok::<_, E>(7)).await, Ok(7));
        assert_eq!(
            blocking(|| Err::<u8, _>(E::Mine("no"))).await,
            Err(E::Mine("no"))
        );
        let lost = blocking(|| -> Result<u8, E> { panic!("boom") }).await;
        assert!(matches!(lost, Err(E::Lost(m)) if m.starts_with("worker failed")));
    }
}
