/* The transactional mode on PostgreSQL (src/transactional/, postgres.rs): the key's
   advisory lock is taken inside the owner's transaction; the handler's writes and the
   completed record commit together, or the server rolls them back. No lease: the server
   releases the lock when the transaction ends, or its connection dies.

   With ROW_CLAIM, the form of MySQL / MariaDB and SQLite (transactional/mysql.rs,
   sqlite.rs): the claim is the separate mode's row insert, made inside the transaction (its
   row lock, NOWAIT or SQLite's one writer, keeps everyone else out), with a lease on the
   store's clock; the commit is a complete fenced by the token alone (complete_held: the
   open transaction holds the row, so the lease does not matter) followed by COMMIT. No
   server idle limit ends a stalled owner. LEASE_FENCE: the commit's complete also requires
   a live lease, as the code did before (a mutant: a handler slower than the lease never
   commits). */

proctype Transactional(byte i) {
  byte tok;        /* 1 + i while this process owns the key: the payload it would commit
                     (a counter like the separate mode's tokens would grow with every retry,
                     and no fence reads it here) */
  byte snap;       /* the claim statement's snapshot of the record */
  byte snap_pay;
  bool got;        /* pg_try_advisory_xact_lock answered true */
  bool pending;    /* the handler's writes, uncommitted in the transaction */

attempt:
  tok = 0;
  pending = false;
#ifndef ROW_CLAIM
  /* begin_claim: one statement. Its snapshot is taken when it starts; the lock is tried
     while it runs, so a record committed in between is not in the snapshot. */
  atomic { snap = rec; snap_pay = rec_pay }
#endif
  atomic {
#ifdef ROW_CLAIM
    /* The locking insert sees the newest committed row. */
    snap = rec;
    snap_pay = rec_pay;
#endif
    if
    :: lock_owner == 0 -> lock_owner = i + 1; got = true
    :: else -> got = false
    fi;
    if
    :: snap == DONE ->
       /* A live record: roll back (the lock goes with it), replay. */
       if :: got -> lock_owner = 0 :: else -> skip fi;
       assert(snap_pay == first_pay);
       ANSWER(i, snap_pay);
       goto finished
    :: snap != DONE && got ->
       tok = i + 1;
#ifdef ROW_CLAIM
       lease_left = LEASE;   /* the uncommitted row's lease */
#endif
       killed[i] = false
    :: else -> skip   /* Busy */
    fi
  }
  if
  :: tok == 0 ->
     /* wait_for: await_owner / probe until the owner's transaction ended. */
     (lock_owner == 0 || rec == DONE);
     goto attempt
  :: else -> skip
  fi;

  do
  /* The handler's writes, in the lent transaction (TxSlot). */
  :: atomic { !stalled[i] && !killed[i] && !pending -> pending = true }
  :: !stalled[i] && !killed[i] && pending -> break
  /* The handler failed: TxOwner::rollback. */
  :: atomic { !stalled[i] && !killed[i] && fails < FAILS ->
       fails++;
#ifndef SESSION_LOCK
       lock_owner = 0;
#endif
       pending = false };
     goto attempt
  /* kill -9: the connection dies and the server rolls back. */
  :: atomic { crashes < CRASHES ->
       crashes++;
       if :: lock_owner == i + 1 -> lock_owner = 0 :: else -> skip fi;
       stalled[i] = false;
       idle_left[i] = 0;
       killed[i] = false };
     goto attempt
  /* A stall: the session sits idle in its transaction; the server's idle limit (the lease)
     runs on the store's clock (clock.pml IDLE_TICK). */
#ifdef ROW_CLAIM
  :: atomic { !stalled[i] && !killed[i] && stalls < STALLS -> stalls++; stalled[i] = true }
#else
  :: atomic { !stalled[i] && !killed[i] && stalls < STALLS ->
       stalls++; stalled[i] = true; idle_left[i] = LEASE }
#endif
  :: atomic { stalled[i] -> stalled[i] = false; idle_left[i] = 0 }
  /* Back from a stall to a session the server ended: the next statement fails, the request
     fails, the client retries. */
  :: atomic { !stalled[i] && killed[i] -> killed[i] = false };
     goto attempt
  od;

  /* commit_with: INSERT the completed record; COMMIT. A record committed since the claim's
     snapshot makes the INSERT a unique violation: KeyTaken, everything rolls back. */
  atomic {
    if
#if defined(ROW_CLAIM) && defined(LEASE_FENCE)
    /* complete_on's fence: the row's lease ran out (the handler took longer than the
       lease, or stalled): StaleToken, the transaction rolls back, the client retries. */
    :: lease_left == 0 ->
       lock_owner = 0;
       pending = false;
       tok = 0
#endif
#ifndef NO_UNIQUE
    :: rec == DONE ->
       lock_owner = 0;
       pending = false;
       tok = 0
#endif
    :: else ->
       rec = DONE;
       rec_pay = tok;
       if :: first_pay == 0 -> first_pay = tok :: else -> skip fi;
       effects++;
       EFFECT_ONCE;
       lock_owner = 0
    fi
  }
  if
  :: tok == 0 -> goto attempt   /* KeyTaken: wait for the key, replay; StaleToken: retry */
  :: else -> skip
  fi;
  /* The reply to COMMIT lost with the connection (the outcome unknown to the owner), or a
     crash right after: the client retries and must get the replay. */
  if
  :: atomic { crashes < CRASHES -> crashes++ }; goto attempt
  :: else -> skip
  fi;
  ANSWER(i, tok);
finished:
  skip
}
