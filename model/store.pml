/* The store's record of the one key, and the ghost variables the properties read.

   The record is what every backend keeps (src/record.rs, src/store/mod.rs): absent, in
   progress under a token with a lease, or completed with a payload. Its lease counts down on
   the store's clock, so "expired" is the store's verdict, never a process's. Retention is
   longer than any run here: a completed record never expires in the model. */

#define ABSENT 0
#define INPROG 1
#define DONE   2

byte rec = ABSENT;  /* the record's state */
byte rec_tok;       /* the token of the claim in progress */
byte rec_pay;       /* the payload of the completed record */
byte lease_left;    /* store ticks until the claim's lease ends; 0: expired */
byte lock_owner;    /* transactional: 1 + the process whose transaction holds the key's lock */

/* Ghosts: history the code never reads, kept for the properties. */
byte issued;        /* the newest token issued; tokens never repeat (1, 2, ...) */
byte effects;       /* effects of the operation: outside the store (separate mode) or
                       committed with a transaction (transactional mode) */
byte first_pay;     /* the first payload ever committed: the key's outcome */
byte answered;      /* processes whose client got a final answer */
byte ans[N];        /* the answer each one got: the payload of the run it came from */
byte crashes;       /* faults injected so far, each within its budget */
byte stalls;
byte fails;

#define LIVE_CLAIM   (rec == INPROG && lease_left > 0)
/* The claim's one atomic decision: a new key, or a lease that ran out, is taken. */
#ifdef NO_TAKEOVER
#define CLAIMABLE    (rec == ABSENT)
#else
#define CLAIMABLE    (rec == ABSENT || (rec == INPROG && lease_left == 0))
#endif
/* The fence every backend applies to renew, complete and release: the live claim held with
   exactly this token (SQL: token = $3 AND expires_at > now(); Redis: the script's compare on
   a key whose PX has not run out; memory: Slot::is_claimed_with). */
#define HOLDS(t)     (rec == INPROG && rec_tok == (t) && lease_left > 0)
#ifdef NO_FENCE_COMPLETE
#define COMPLETE_ACTS(t) (rec != ABSENT)
#else
#define COMPLETE_ACTS(t) HOLDS(t)
#endif
#ifdef RENEW_NO_FENCE
#define RENEW_ACTS(t) LIVE_CLAIM
#else
#define RENEW_ACTS(t) HOLDS(t)
#endif
#define RELEASE_ACTS(t) HOLDS(t)

/* Property: a fenced write that acts carries the key's newest token. After a takeover a
   newer token exists, so every write of the old owner must have been refused. */
#define FENCED_WRITE(t) assert((t) == issued)

/* Property: the committed outcome never changes, and a replay returns it. */
#define COMMITTED_STAYS assert(rec == DONE && rec_pay == first_pay)

/* Property (ONE_EFFECT runs): one effect per key, checked at each effect. */
#ifdef ONE_EFFECT
#define EFFECT_ONCE assert(effects <= 1)
#else
#define EFFECT_ONCE skip
#endif

/* A final answer for process i's client. */
#define ANSWER(i, p) ans[i] = (p); answered++
