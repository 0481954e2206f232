/* A model of tower-idempotency's key protocol. See README.md beside it; model/check runs
   every configuration. */

#include "config.pml"
#include "store.pml"
#include "clock.pml"
#ifdef TX
#include "transactional.pml"
#else
#include "separate.pml"
#endif

init {
  byte k;
  atomic {
    do
    :: k < N ->
#ifdef TX
       run Transactional(k);
#else
       run Separate(k);
#endif
       k++
    :: else -> break
    od
  }
#ifdef ONE_EFFECT
  /* Every client got the same answer: the committed outcome. */
  (answered == N);
  atomic {
    k = 0;
    do
    :: k < N -> assert(ans[k] == first_pay); k++
    :: else -> break
    od
  }
#endif
}

/* Liveness: every delivery eventually gets a final answer, whoever owned the key and
   however it died (checked with weak fairness: spin -a, pan -a -f). */
ltl answered_all { <> (answered == N) }
