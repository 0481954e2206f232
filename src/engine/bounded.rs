//! A store call under the engine's time limit.

use std::{
    future::Future,
    pin::Pin,
    task::{ready, Context, Poll},
    time::Duration,
};

use tokio::time::Sleep;

use crate::store::StoreError;

pin_project_lite::pin_project! {
    /// `call`, failed with [`StoreError::Timeout`] if it takes longer than `after`.
    ///
    /// Unlike `tokio::time::timeout`, the timer is only set once the call has to wait: a call
    /// that answers on its first poll (the memory store always does) costs no clock read and
    /// no timer. The limit then counts from that first poll, microseconds after the call was
    /// made.
    pub(crate) struct Bounded<F> {
        #[pin]
        call: F,
        after: Duration,
        #[pin]
        timer: Option<Sleep>,
    }
}

impl<F> Bounded<F> {
    pub(crate) fn new(call: F, after: Duration) -> Self {
        Self {
            call,
            after,
            timer: None,
        }
    }
}

impl<T, F> Future for Bounded<F>
where
    F: Future<Output = Result<T, StoreError>>,
{
    type Output = Result<T, StoreError>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let mut this = self.project();
        if let Poll::Ready(outcome) = this.call.poll(cx) {
            return Poll::Ready(outcome);
        }
        if this.timer.is_none() {
            this.timer.set(Some(tokio::time::sleep(*this.after)));
        }
        let timer = this.timer.as_pin_mut().expect("set above");
        ready!(timer.poll(cx));
        Poll::Ready(Err(StoreError::Timeout { after: *this.after }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn a_call_past_the_limit_is_a_timeout_and_one_within_it_is_not() {
        let slow = Bounded::new(
            async {
                tokio::time::sleep(Duration::from_secs(2)).await;
                Ok::<_, StoreError>(())
            },
            Duration::from_secs(1),
        );
        assert!(
            matches!(slow.await, Err(StoreError::Timeout { after }) if after == Duration::from_secs(1))
        );
        let quick = Bounded::new(
            async {
                tokio::time::sleep(Duration::from_millis(500)).await;
                Ok::<_, StoreError>(7)
            },
            Duration::from_secs(1),
        );
        assert_eq!(quick.await.unwrap(), 7);
        let at_once = Bounded::new(async { Ok::<_, StoreError>(8) }, Duration::ZERO);
        assert_eq!(at_once.await.unwrap(), 8);
    }
}
