/* Time: the store's clock and one clock per process, all counting ticks of the same length.

   Leases are the store's (src/store/mod.rs, contract point 4); each process schedules its
   renewals by its own clock (src/engine/renewal.rs). The clocks may disagree by at most SKEW
   ticks: d[i] is process i's elapsed time minus the store's since it claimed, kept within
   [-SKEW, SKEW]. Time is relative (timers count down to 0), so the state space is finite
   without a horizon.

   A live, running owner is "urgent" when its renewal is due or its handler has used up its
   WORK renewal periods: its clock does not move on until it has acted. This is the
   assumption that a process that is not stopped gets scheduled within a tick; a stall
   (SIGSTOP, a pause) is exactly the fault that breaks it, and is injected on its own. */

short d[N];          /* process clock minus store clock, while the process owns the key */
bool counting[N];    /* process i owns the key in the separate mode: its clock matters */
bool stalled[N];     /* process i is stopped: it takes no step (its clock still runs) */
byte renew_in[N];    /* ticks of its clock until its next renewal is due */
bool renewing[N];    /* its renewal task runs (stopped when settled, or once refused) */
byte work[N];        /* renewal periods its handler may still take before it must finish */
bool lost[N];        /* the flag behind ClaimStatus::is_lost() (src/engine/status.rs) */
byte held_left[N];   /* ticks of its clock until the lease ends as it counts it (renew) */
byte idle_left[N];   /* transactional: store ticks until the server ends its idle session */
bool killed[N];      /* transactional: the server ended its session (and transaction) */
bool inflight[N];    /* RENEW_TIMEOUT: a renewal attempt of process i awaits its answer */
byte flight[N];      /* RENEW_TIMEOUT: ticks of its clock until that attempt times out */
byte rfails;         /* RENEW_TIMEOUT: renewal attempts that failed (timed out) so far */

#define MAY_LAG(i)  (!counting[i] || d[i] > -SKEW)
#define URGENT(i)   (counting[i] && !stalled[i] && ((renewing[i] && !inflight[i] && renew_in[i] == 0) || work[i] == 0 || (inflight[i] && flight[i] == 0)))
#define MAY_TICK(i) (counting[i] && d[i] < SKEW && !URGENT(i))

#if N == 2
#define STORE_MAY_TICK (MAY_LAG(0) && MAY_LAG(1))
#elif N == 3
#define STORE_MAY_TICK (MAY_LAG(0) && MAY_LAG(1) && MAY_LAG(2))
#else
#error "N must be 2 or 3"
#endif

/* Process i's timers, on a tick of its clock. */
#define TIMERS(i) \
  if :: renew_in[i] > 0 -> renew_in[i]-- :: else -> skip fi; \
  if :: held_left[i] > 0 -> held_left[i]-- :: else -> skip fi; \
  if :: flight[i] > 0 -> flight[i]-- :: else -> skip fi

/* A tick of process i's clock alone: it gains on the store's. */
#define LOCAL_TICK(i) \
  :: d_step { MAY_TICK(i) -> d[i]++; TIMERS(i) }

/* On a tick of the store's clock: the server ends an idle transaction whose idle limit ran
   out (idle_in_transaction_session_timeout), which releases its lock and rolls back its
   writes. */
#define IDLE_TICK(i) \
  if :: stalled[i] && idle_left[i] > 0 -> idle_left[i]--; \
        if :: idle_left[i] == 0 -> killed[i] = true; \
              if :: lock_owner == i + 1 -> lock_owner = 0 :: else -> skip fi \
           :: else -> skip fi \
     :: else -> skip fi

#define STORE_TICK \
  if :: lease_left > 0 -> lease_left-- :: else -> skip fi; \
  IDLE_TICK(0); IDLE_TICK(1); IDLE3

/* Both clocks move: process i's timers run, its skew stays. */
#define BOTH(i) if :: counting[i] -> TIMERS(i) :: else -> skip fi
/* The store's clock alone moves: process i falls behind it. */
#define LAG(i)  if :: counting[i] -> d[i]-- :: else -> skip fi

#if N == 3
#define IDLE3 IDLE_TICK(2)
#define ALL_MAY_TICK (!URGENT(0) && !URGENT(1) && !URGENT(2))
#define ALL_BOTH BOTH(0); BOTH(1); BOTH(2)
#define ALL_LAG LAG(0); LAG(1); LAG(2)
#else
#define IDLE3 skip
#define ALL_MAY_TICK (!URGENT(0) && !URGENT(1))
#define ALL_BOTH BOTH(0); BOTH(1)
#define ALL_LAG LAG(0); LAG(1)
#endif

active proctype Clock() {
end:
  do
  /* A tick of every clock at once. */
  :: d_step { ALL_MAY_TICK -> STORE_TICK; ALL_BOTH }
  /* A tick of the store's clock alone. */
  :: d_step { STORE_MAY_TICK -> STORE_TICK; ALL_LAG }
  LOCAL_TICK(0)
  LOCAL_TICK(1)
#if N == 3
  LOCAL_TICK(2)
#endif
  od
}
