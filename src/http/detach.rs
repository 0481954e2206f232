//! Running the owner's work so that a client hanging up cannot cut it in half.

use std::{
    future::Future,
    pin::Pin,
    sync::Arc,
    task::{Context, Poll},
};

use tokio::{sync::Semaphore, time::Instant};

/// Work on the heap: boxed once by its maker, so the request's own future holds a pointer
/// rather than the whole state of the claim and the handler.
pub(crate) type BoxFuture<T> = Pin<Box<dyn Future<Output = T> + Send + 'static>>;

/// Drives a future in the caller's task; if the caller is dropped before it finishes (the
/// client disconnected), the rest of it is handed to a new tokio task and runs to completion
/// there.
///
/// Spawning every handler up front would give the same guarantee, but costs a task and a
/// cross-thread wake-up per request; this only pays for a task when a client actually leaves.
///
/// Outer layers (timeouts, concurrency limits) stop bounding the work once it is detached, so
/// it is bounded here: a detached piece of work holds one of the `slots` permits, and is
/// dropped at `deadline`. Work that finds no free slot, or reaches its deadline, is dropped —
/// which drops its claim, which releases the key.
pub(crate) struct DetachOnDrop<T> {
    work: Option<BoxFuture<T>>,
    slots: Arc<Semaphore>,
    deadline: Instant,
    /// [`detach`] for this `T`, chosen where `T: Send + 'static` is known, so that the type
    /// itself needs no bounds and the HTTP layer's public response future can hold it inline.
    detach: fn(BoxFuture<T>, &Arc<Semaphore>, Instant),
}

impl<T: Send + 'static> DetachOnDrop<T> {
    pub(crate) fn new(work: BoxFuture<T>, slots: Arc<Semaphore>, deadline: Instant) -> Self {
        Self {
            work: Some(work),
            slots,
            deadline,
            detach: detach::<T>,
        }
    }
}

impl<T> Future for DetachOnDrop<T> {
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

impl<T> Drop for DetachOnDrop<T> {
    fn drop(&mut self) {
        if let Some(work) = self.work.take() {
            (self.detach)(work, &self.slots, self.deadline);
        }
    }
}

/// Hands unfinished `work` (a handler, or the rest of a response body whose caller left) to
/// a task of its own, within a free slot and until `deadline`; otherwise drops it, which
/// releases the key of the claim it holds.
pub(crate) fn detach<T: Send + 'static>(
    work: BoxFuture<T>,
    slots: &Arc<Semaphore>,
    deadline: Instant,
) {
    let Ok(slot) = slots.clone().try_acquire_owned() else {
        tracing::warn!("caller went away and the detached-work limit is reached; dropping the rest of its request and releasing its key");
        return;
    };
    match tokio::runtime::Handle::try_current() {
        Ok(runtime) => {
            tracing::debug!("caller went away; the rest of its request finishes in the background");
            runtime.spawn(async move {
                if tokio::time::timeout_at(deadline, work).await.is_err() {
                    tracing::warn!(
                        "detached work reached its request's maximum lifetime; dropped, its key released"
                    );
                }
                drop(slot);
            });
        }
        // No runtime to finish it on: dropping it drops its claim, which releases the key
        // (or, failing that, leaves it to the lease).
        Err(_) => drop(work),
    }
}

/// Runs `work` (settling a claim or a transaction) in the background; without a runtime it
/// is dropped, and what it held ends as a dropped claim or transaction does.
pub(crate) fn spawn_or_drop(work: BoxFuture<()>) {
    if let Ok(runtime) = tokio::runtime::Handle::try_current() {
        runtime.spawn(work);
    }
}

#[cfg(test)]
mod tests {
    use std::sync::{
        atomic::{AtomicBool, Ordering},
        Arc,
    };

    use super::*;

    fn far() -> Instant {
        Instant::now() + std::time::Duration::from_secs(60)
    }

    #[tokio::test]
    async fn work_left_by_a_dropped_caller_still_finishes() {
        let finished = Arc::new(AtomicBool::new(false));
        let work = DetachOnDrop::new(
            Box::pin({
                let finished = finished.clone();
                async move {
                    tokio::time::sleep(std::time::Duration::from_millis(50)).await;
                    finished.store(true, Ordering::SeqCst);
                }
            }),
            Arc::new(Semaphore::new(1)),
            far(),
        );
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

    /// Dropped work is observable through a guard it owns: the guard's drop is the claim's.
    #[tokio::test]
    async fn work_beyond_the_slots_or_the_deadline_is_dropped() {
        struct Guard(Arc<AtomicBool>);
        impl Drop for Guard {
            fn drop(&mut self) {
                self.0.store(true, Ordering::SeqCst);
            }
        }
        let slots = Arc::new(Semaphore::new(1));
        let endless = |dropped: &Arc<AtomicBool>| {
            let guard = Guard(dropped.clone());
            async move {
                let _guard = guard;
                std::future::pending::<()>().await
            }
        };
        // Takes the only slot, and ends at its deadline.
        let first = Arc::new(AtomicBool::new(false));
        let soon = Instant::now() + std::time::Duration::from_millis(50);
        drop(DetachOnDrop::new(
            Box::pin(endless(&first)),
            slots.clone(),
            soon,
        ));
        // No slot left: dropped at once.
        let second = Arc::new(AtomicBool::new(false));
        drop(DetachOnDrop::new(
            Box::pin(endless(&second)),
            slots.clone(),
            far(),
        ));
        assert!(
            second.load(Ordering::SeqCst),
            "work over the limit was detached"
        );
        assert!(!first.load(Ordering::SeqCst));
        tokio::time::timeout(std::time::Duration::from_secs(5), async {
            while !first.load(Ordering::SeqCst) {
                tokio::time::sleep(std::time::Duration::from_millis(5)).await;
            }
        })
        .await
        .expect("detached work outlived its deadline");
        let _slot = tokio::time::timeout(std::time::Duration::from_secs(5), slots.acquire())
            .await
            .expect("the slot came back");
    }
}
