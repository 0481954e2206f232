/* The separate mode (src/engine/): claim, the handler's effect outside the store, then a
   fenced complete. One process is one delivery of the key: its client sends it and retries
   until it gets a final answer, also after the process crashed. */

/* Becoming the owner (Claim::new, Renewal::start): renewals every RENEW ticks of this
   process' clock; its clock may start anywhere within the skew of the store's. */
inline own(i) {
  counting[i] = true;
  d[i] = -SKEW;
  do
  :: d[i] < SKEW -> d[i]++
  :: break
  od;
  renew_in[i] = RENEW;
  held_left[i] = LEASE;
  renewing[i] = true;
  work[i] = WORK;
  lost[i] = false
}

/* The process stops owning: settled, crashed or gone. Its clock no longer matters. */
inline disown(i) {
  counting[i] = false;
  d[i] = 0;
  renew_in[i] = 0;
  held_left[i] = 0;
  renewing[i] = false;
  work[i] = 0;
  lost[i] = false;
  stalled[i] = false;
  inflight[i] = false;
  flight[i] = 0
}

/* ClaimStatus::is_lost() as the handler would read it before its effect. */
#ifdef LOST_BY_CLOCK
#define SAYS_LOST(i) (lost[i] || held_left[i] <= LOST_MARGIN)
#else
#define SAYS_LOST(i) (lost[i])
#endif

proctype Separate(byte i) {
  byte tok;        /* this attempt's token; 0 while it owns nothing */
  bool effected;   /* the handler made its effect */
#ifdef LOOKUP_THEN_INSERT
  bool seen_free;  /* what the lookup saw */
#endif

attempt:
  tok = 0;
  effected = false;
  /* Engine::claim -> Store::claim, one atomic operation. A live claim blocks this delivery
     until it ends (Engine::wait: woken in process, or polling); that is the same as looking
     again until the claim is completed, released or expired. */
#ifdef LOOKUP_THEN_INSERT
  /* The bug this crate exists to avoid: look the key up, decide, then write. */
  (rec == DONE || CLAIMABLE);
  atomic { seen_free = CLAIMABLE }
#endif
  atomic {
    if
    :: rec == DONE ->
       /* Engine::existing: Begin::Replay */
       COMMITTED_STAYS;
       ANSWER(i, rec_pay);
       goto finished
#ifdef LOOKUP_THEN_INSERT
    :: rec != DONE && seen_free ->
#else
    :: CLAIMABLE ->
#endif
       issued++;
       tok = issued;
       rec = INPROG;
       rec_tok = tok;
       lease_left = LEASE;
       own(i)
    fi
  }

  do
  /* The renewal task (renewal.rs renew): due every RENEW ticks; refused means lost. */
#ifndef RENEW_TIMEOUT
  :: atomic { !stalled[i] && renewing[i] && renew_in[i] == 0 ->
       if
       :: RENEW_ACTS(tok) ->
          FENCED_WRITE(tok);
          lease_left = LEASE;
          renew_in[i] = RENEW;
          held_left[i] = LEASE;
          if :: work[i] > 0 -> work[i]-- :: else -> skip fi
       :: else ->
          lost[i] = true;
          renewing[i] = false
       fi }
#else
  /* Sent at `attempt`; bounded by the store timeout (Engine::bounded). */
  :: atomic { !stalled[i] && renewing[i] && !inflight[i] && renew_in[i] == 0 ->
       inflight[i] = true;
       flight[i] = RENEW_TIMEOUT }
  /* It reaches the store, at most the timeout after it was sent; the answer comes back at
     once. held_until = attempt + lease, next = attempt + renew_every, both by this clock. */
  :: atomic { !stalled[i] && inflight[i] ->
       inflight[i] = false;
       if
       :: RENEW_ACTS(tok) ->
          FENCED_WRITE(tok);
          lease_left = LEASE;
          held_left[i] = LEASE - (RENEW_TIMEOUT - flight[i]);
          if
          :: RENEW > RENEW_TIMEOUT - flight[i] -> renew_in[i] = RENEW - (RENEW_TIMEOUT - flight[i])
          :: else -> renew_in[i] = 0
          fi;
          if :: work[i] > 0 -> work[i]-- :: else -> skip fi
       :: else ->
          lost[i] = true;
          renewing[i] = false
       fi }
  /* It times out: lost if the lease is over by this clock, else retried after RETRY. */
  :: atomic { !stalled[i] && inflight[i] && flight[i] == 0 && rfails < RFAILS ->
       rfails++;
       inflight[i] = false;
       if
       :: held_left[i] == 0 -> lost[i] = true; renewing[i] = false
       :: else -> renew_in[i] = RETRY
       fi }
#endif
  /* The handler's effect: a card charged, an e-mail sent; outside the store. */
  :: atomic { !stalled[i] && !effected ->
#ifdef LOST_SOUND
       assert(SAYS_LOST(i) || HOLDS(tok));
#endif
       effects++;
       EFFECT_ONCE;
       effected = true;
       work[i] = 0 }
  /* The response ends: Recorder -> Claim::complete (settle stops renewals first). */
  :: !stalled[i] && effected -> break
  /* The handler failed (error, non-final status, panic): Claim::release. */
  :: atomic { !stalled[i] && !effected && fails < FAILS ->
       fails++;
       if
       :: RELEASE_ACTS(tok) ->
          FENCED_WRITE(tok);
          rec = ABSENT
       :: else -> skip
       fi;
       disown(i) };
     goto attempt
  /* kill -9 at any step: nothing is released; the client retries. */
#ifdef CRASH_AFTER_EFFECT
  :: atomic { crashes < CRASHES ->
#else
  :: atomic { crashes < CRASHES && !effected ->
#endif
       crashes++;
       disown(i) };
     goto attempt
  :: atomic { !stalled[i] && stalls < STALLS -> stalls++; stalled[i] = true }
  :: atomic { stalled[i] -> stalled[i] = false }
  od;

  /* Claim::complete: one fenced write (with_retries), then the answer. The response was
     already streamed to the client (http/tee.rs), so its client has this payload whether
     or not the store took it. */
  atomic {
    renewing[i] = false;
    inflight[i] = false;   /* Renewal::stop aborts an attempt under way */
    if
#ifdef RECORD_FAILS
    /* Every attempt fails (store unreachable): RunError::NotRecorded. */
    :: fails < FAILS -> fails++
#endif
    :: COMPLETE_ACTS(tok) ->
       FENCED_WRITE(tok);
       rec = DONE;
       rec_pay = tok;
       if :: first_pay == 0 -> first_pay = tok :: else -> skip fi;
       COMMITTED_STAYS
    :: else ->
       /* StaleToken. Claim::recorded looks the record up: ours only if it holds this
          very payload, which a completed record of another owner never does. */
       assert(!(rec == DONE && rec_pay == tok))
    fi;
    ANSWER(i, tok);
    disown(i)
  }
finished:
  skip
}
