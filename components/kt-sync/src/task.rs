//! Blocking work (file I/O, hashing, network plumbing) off the async
//! threads, with the error type of whoever asks: the one helper the
//! client, the servers and the testbed share.

/// A blocking task that did not return: it panicked or was cancelled.
#[derive(Debug, thiserror::Error)]
#[error("worker failed: {0}")]
pub struct WorkerLost(pub String);

/// Runs `f` on tokio's blocking threads and returns what it returned; a
/// task that did not return becomes `E::from(WorkerLost)`. It starts when
/// first polled; [`spawn`] starts one now.
pub async fn blocking<T, E>(f: impl FnOnce() -> Result<T, E> + Send + 'static) -> Result<T, E>
where
    T: Send + 'static,
    E: From<WorkerLost> + Send + 'static,
{
    spawn(f).result().await
}

/// A blocking task already running (from [`spawn`]). Awaiting it gives what
/// its closure returned, or [`WorkerLost`]; dropping it lets it run on
/// unawaited (fire and forget).
#[derive(Debug)]
pub struct Task<R>(tokio::task::JoinHandle<R>);

/// Starts `f` on tokio's blocking threads now (a writer fed while the caller
/// does other work, a cleanup nobody waits for) and returns its handle. The
/// one place the workspace calls `spawn_blocking` (tidy checks it).
pub fn spawn<R: Send + 'static>(f: impl FnOnce() -> R + Send + 'static) -> Task<R> {
    Task(tokio::task::spawn_blocking(f))
}

impl<R> std::future::Future for Task<R> {
    type Output = Result<R, WorkerLost>;

    fn poll(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Self::Output> {
        std::pin::Pin::new(&mut self.0)
            .poll(cx)
            .map(|r| r.map_err(|e| WorkerLost(e.to_string())))
    }
}

impl<T, E: From<WorkerLost>> Task<Result<T, E>> {
    /// What the closure returned, a lost worker as the caller's error.
    pub async fn result(self) -> Result<T, E> {
        self.await.map_err(E::from)?
    }
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

    #[tokio::test]
    async fn a_spawned_task_runs_before_it_is_awaited_and_detaches_when_dropped() {
        let (tx, rx) = std::sync::mpsc::channel();
        let task = spawn(move || {
            tx.send(1).unwrap();
            Ok::<_, E>(2)
        });
        // It ran without being polled: the send happened.
        let got = blocking(move || Ok::<_, E>(rx.recv().unwrap())).await;
        assert_eq!(got, Ok(1));
        assert_eq!(task.result().await, Ok(2));
        let (tx, rx) = std::sync::mpsc::channel();
        drop(spawn(move || tx.send(3).unwrap()));
        assert_eq!(
            blocking(move || Ok::<_, E>(rx.recv().unwrap())).await,
            Ok(3)
        );
        let lost = spawn(|| -> u8 { panic!("boom") }).await;
        assert!(lost.is_err_and(|w| w.to_string().starts_with("worker failed")));
    }
}
