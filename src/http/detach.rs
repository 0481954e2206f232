//! Running the owner's work so that a client hanging up cannot cut it in half.

use std::{
    future::Future,
    pin::Pin,
    task::{Context, Poll},
};

type BoxFuture<T> = Pin<Box<dyn Future<Output = T> + Send + 'static>>;

/// Drives a future in the caller's task; if the caller is dropped before it finishes (the
/// client disconnected), the rest of it is handed to a new tokio task and runs to completion
/// there.
///
/// Spawning every handler up front would give the same guarantee, but costs a task and a
/// cross-thread wake-up per request; this only pays for a task when a client actually leaves.
pub(crate) struct DetachOnDrop<T: Send + 'static> {
    work: Option<BoxFuture<T>>,
}

impl<T: Send + 'static> DetachOnDrop<T> {
    pub(crate) fn new(work: impl Future<Output = T> + Send + 'static) -> Self {
        Self {
            work: Some(Box::pin(work)),
        }
    }
}

impl<T: Send + 'static> Future for DetachOnDrop<T> {
    type Output = T;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<T> {
        let work = self
            .work
            .as_mut()
            .expect("DetachOnDrop polled after completion");
        let output = std::task::ready!(work.as_mut().poll(cx));
        self.work = None;
        Poll::Ready(output)
    }
}

impl<T: Send + 'static> Drop for DetachOnDrop<T> {
    fn drop(&mut self) {
        let Some(work) = self.work.take() else {
            return;
        };
        match tokio::runtime::Handle::try_current() {
            Ok(runtime) => {
                tracing::debug!("caller went away; the handler finishes in the background");
                runtime.spawn(async move {
                    let _ = work.await;
                });
            }
            // No runtime to finish it on: dropping it drops its claim, which releases the key
            // (or, failing that, leaves it to the lease).
            Err(_) => drop(work),
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::{
        atomic::{AtomicBool, Ordering},
        Arc,
    };

    use super::*;

    #[tokio::test]
    async fn work_left_by_a_dropped_caller_still_finishes() {
        let finished = Arc::new(AtomicBool::new(false));
        let work = DetachOnDrop::new({
            let finished = finished.clone();
            async move {
                tokio::time::sleep(std::time::Duration::from_millis(50)).await;
                finished.store(true, Ordering::SeqCst);
            }
        });
        // The caller gives up after 10 ms.
        assert!(
            tokio::time::timeout(std::time::Duration::from_millis(10), work)
                .await
                .is_err()
        );
        assert!(!finished.load(Ordering::SeqCst));
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
        assert!(
            finished.load(Ordering::SeqCst),
            "the detached rest never ran"
        );
    }
}
