//! A store call under the engine's time limit.

use std::{
    future::Future,
    pin::Pin,
    task::{ready, Context, Poll},
    time::Duration,
};

use tokio::{task::coop::Unconstrained, time::Sleep};

use crate::store::StoreError;

pin_project_lite::pin_project! {
    /// `call`, failed with [`StoreError::Timeout`] if it takes longer than `after`.
    ///
    /// Unlike `tokio::time::timeout`, the timer is only set once the call has to wait: a call
    /// that answers on its first poll (the memory store always does) costs no clock read and
    /// no timer. The limit then counts from that first poll, microseconds after the call was
    /// made. The timer is boxed: a round trip dwarfs the allocation, and every request's
    /// future would otherwise carry its 112 bytes through each store call.
    ///
    /// The timer is polled outside the task's cooperative budget, as `tokio::time::timeout`
    /// does when its future spent the budget: a call that uses up the budget on every poll
    /// would otherwise keep the timer from ever firing.
    pub(crate) struct Bounded<F> {
        #[pin]
        call: F,
        after: Duration,
        timer: Option<Pin<Box<Unconstrained<Sleep>>>>,
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
        let this = self.project();
        if let Poll::Ready(outcome) = this.call.poll(cx) {
            return Poll::Ready(outcome);
        }
        let after = *this.after;
        let timer = this.timer.get_or_insert_with(|| {
            Box::pin(tokio::task::coop::unconstrained(tokio::time::sleep(after)))
        });
        ready!(timer.as_mut().poll(cx));
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

    /// A call that spends the whole cooperative budget on every poll (a store client reading
    /// a busy socket could) still times out.
    #[tokio::test]
    async fn a_call_that_spends_the_budget_on_every_poll_still_times_out() {
        let greedy = Bounded::new(
            async {
                loop {
                    tokio::task::coop::consume_budget().await;
                }
                #[allow(unreachable_code)]
                Ok::<(), StoreError>(())
            },
            Duration::from_millis(20),
        );
        let outcome = tokio::time::timeout(Duration::from_secs(10), greedy)
            .await
            .expect("the store call's own limit never fired");
        assert!(matches!(outcome, Err(StoreError::Timeout { .. })));
    }
}
