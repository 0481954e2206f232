/* The bounds of the model and the switches of its variants. Every value can be overridden
   from the command line (spin -DNAME=value); model/check does that for each run. */

#ifndef N
#define N 2          /* processes delivering the same key (each a client with its server) */
#endif
#ifndef LEASE
#define LEASE 4      /* a claim's lease, in ticks of the store's clock */
#endif
#ifndef RENEW
#define RENEW 1      /* renewal period, in ticks of the owner's clock (the code: lease / 4) */
#endif
#ifndef SKEW
#define SKEW 1       /* how far a process clock may run ahead of or behind the store's */
#endif
#ifndef WORK
#define WORK 2       /* renewals a handler may need before it must finish */
#endif
#ifndef CRASHES
#define CRASHES 1    /* owner crashes (kill -9) in one run, at any step */
#endif
#ifndef STALLS
#define STALLS 0     /* owner stalls (SIGSTOP, a long pause) in one run, at any step */
#endif
#ifndef FAILS
#define FAILS 1      /* handler failures (an error, a 5xx, a panic): the key is released */
#endif

/* Mode: the separate mode unless TX is defined (the transactional mode, PostgreSQL's form;
   with ROW_CLAIM as well, the form of MySQL / MariaDB and SQLite).

   Properties:
     ONE_EFFECT   assert that the key's effect happens at most once and every client gets
                  the committed answer (on for the runs whose mode promises it).
     LOST_SOUND   assert that an owner that ClaimStatus calls "not lost" holds the key when
                  it makes its effect (the check a handler makes before an irreversible step).

   Mutants and documented limits (each must give a counterexample; model/check runs them):
     NO_FENCE_COMPLETE   complete writes without checking the token
     RENEW_NO_FENCE      renew extends any live claim, also one taken over
     CRASH_AFTER_EFFECT  separate mode: a crash between the effect and the record
     RECORD_FAILS        separate mode: every attempt to write the record fails
     LOOKUP_THEN_INSERT  the claim looks the key up, then writes on what it saw
     NO_TAKEOVER         a claim never takes over an expired lease
     NO_UNIQUE           transactional: the commit's INSERT ignores a record written meanwhile
     SESSION_LOCK        transactional: the key's lock outlives a rollback (a session-level
                         advisory lock on a pooled connection)
     LOST_BY_CLOCK       ClaimStatus also reports lost once the owner's own clock says the
                         lease ended, LOST_MARGIN ticks early (a proposed fix, not the code)
     LEASE_FENCE         transactional, ROW_CLAIM: the commit's complete also checks the
                         row's lease, not only the token (the code before finding 2's fix) */
/* RENEW_TIMEOUT=T: a renewal attempt reaches the store up to T ticks of the owner's clock
   after it was sent, or times out after T (at most RFAILS times in a run) and is retried
   RETRY ticks later: the timings EngineConfig::validate reasons about. Without it a renewal
   is one atomic step. */
#ifndef RETRY
#define RETRY 1
#endif
#ifndef RFAILS
#define RFAILS 2
#endif
#ifndef LOST_MARGIN
#define LOST_MARGIN 0
#endif
