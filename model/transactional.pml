/* The transactional mode on PostgreSQL (src/transactional/, postgres.rs): the key's
   advisory lock is taken inside the owner's transaction; the handler's writes and the
   completed record commit together, or the server rolls them back. No lease: the server
   releases the lock when the transaction ends, or its connection dies. */

proctype Transactional(byte i) {
  byte tok;        /* this attempt's id, the payload it would commit */
  byte snap;       /* the claim statement's snapshot of the record */
  byte snap_pay;
  bool got;        /* pg_try_advisory_xact_lock answered true */
  bool pending;    /* the handler's writes, uncommitted in the transaction */

attempt:
  tok = 0;
  pending = false;
  /* begin_claim: one statement. Its snapshot is taken when it starts; the lock is tried
     while it runs, so a record committed in between is not in the snapshot. */
  atomic { snap = rec; snap_pay = rec_pay }
  atomic {
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
       issued++;
       tok = issued;
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
  :: atomic { !stalled[i] && !killed[i] && stalls < STALLS ->
       stalls++; stalled[i] = true; idle_left[i] = LEASE }
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
  :: tok == 0 -> goto attempt   /* KeyTaken: wait for the key, replay */
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
