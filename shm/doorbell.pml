/*
 * doorbell.pml -- the doorbell wake-up protocol of shm/ (DOORBELL.md), one
 * consumer and NPROD producers, each producer feeding its own SPSC ring.
 *
 * Checked by shm/check-doorbell-model. Properties:
 *   safety   (spin -a; cc -DSAFETY; ./pan): no invalid end state. The consumer
 *            blocked in futex_wait is a valid end state only when every
 *            producer has finished and every ring is empty (label end_idle);
 *            blocked with a record in some ring is an invalid end state, i.e. a
 *            lost wake-up.
 *   liveness (spin -DLIVENESS -a; cc; ./pan -a -f): under weak fairness every
 *            run reaches and stays in "all NREC records of every ring consumed",
 *            so every published record is eventually consumed.
 *
 * Modelling assumption: every step below is one sequentially consistent
 * access. The real code's two seq_cst fences (P2, C3) are what make this sound
 * for the accesses that matter: the producer's store to tail[r] (P1) and load
 * of word (P3), and the consumer's store to word (C2) and loads of tail[]
 * (C4), form the store-buffering (Dekker) pattern, and the C++ rule for two
 * seq_cst fences (or x86 mfence) forbids both loads missing both stores.
 * The exchange (P4) is a locked RMW and futex_wait's compare-and-block is
 * atomic in the kernel (both are single steps here).
 *
 * The consumer scans rings one load at a time, starting at a ring it picks
 * non-deterministically, so no scan order and no torn snapshot of tail[] is
 * assumed. It goes to C2 as soon as one scan finds nothing: a longer spin adds
 * only failed, side-effect-free loads, which change no state.
 *
 * Variants (spin -D...):
 *   NREC=n                 records per producer (default 3)
 *   SPURIOUS=n             allow up to n spurious returns from futex_wait.
 *                          An unused one is enabled in every blocked state,
 *                          so it would hide a lost wake-up from both checks:
 *                          the no-spurious model is the check of the
 *                          protocol, this one only shows spurious returns
 *                          break nothing.
 *   BROKEN_NO_RECHECK      negative control: consumer omits the re-check C4
 *   BROKEN_EARLY_CHECK     negative control: producer reads word before P1
 *   BROKEN_NONATOMIC_WAIT  negative control: futex_wait compares, then blocks,
 *                          in two steps (a user-space check before the sleep)
 * Each negative control must make spin find a lost wake-up.
 */

#ifndef NREC
#define NREC 3
#endif
#define NPROD 2      /* all_empty, all_consumed and init name both rings */
#define NONE 255

byte word;           /* the doorbell: 0 = awake, 1 = sleeping */
byte tail[NPROD];    /* written by producer r only */
byte head[NPROD];    /* written by the consumer only */

/* The kernel's futex wait queue for &word. One consumer, so one slot: true
 * while the consumer is queued. futex_wake dequeues every waiter. */
bool queued;

byte done;           /* ghost: producers that have published all NREC records */
#ifdef SPURIOUS
byte spurious = SPURIOUS;  /* ghost: spurious wake-ups still allowed */
#endif

#define all_empty (head[0] == tail[0] && head[1] == tail[1])
#define all_consumed (head[0] == NREC && head[1] == NREC)

/* P3, P4: ring the doorbell if the consumer says it is (about to be) asleep. */
inline ring_doorbell() {
    if
    :: word == 1 ->                                 /* P3: relaxed load */
        atomic { old = word; word = 0 };            /* P4: exchange(word, 0) */
        if
        :: old == 1 -> queued = false               /* futex_wake(&word) */
        :: else -> skip
        fi;
        old = 0
    :: else -> skip
    fi
}

proctype producer(byte me) {
    byte old;
    do
    :: tail[me] < NREC ->
#ifdef BROKEN_EARLY_CHECK
        ring_doorbell();
        tail[me] = tail[me] + 1;                    /* P1, too late */
#else
        tail[me] = tail[me] + 1;                    /* P1: release store */
        /* P2: seq_cst fence (SC interleaving) */
        ring_doorbell();
#endif
    :: else -> break
    od;
    done++
}

/* Sets r to a ring whose head != tail, or NONE. One load of tail[] per step;
 * head[] is the consumer's own. Leaves first and i at 0 to keep states few. */
inline scan_rings() {
    if
    :: first = 0
    :: first = 1
    fi;
    r = NONE;
    i = 0;
    do
    :: i < NPROD ->
        if
        :: head[(first + i) % NPROD] != tail[(first + i) % NPROD] ->
            r = (first + i) % NPROD;
            break
        :: else -> i++
        fi
    :: else -> break
    od;
    first = 0;
    i = 0
}

active proctype consumer() {
    byte first, i, r;

C1: scan_rings();
    if
    :: r != NONE -> head[r]++; r = NONE; goto C1    /* consume one record */
    :: else -> skip
    fi;

C2: word = 1;                                       /* relaxed store */
    /* C3: seq_cst fence (SC interleaving) */

#ifndef BROKEN_NO_RECHECK
C4: scan_rings();
    if
    :: r != NONE -> r = NONE; word = 0; goto C1
    :: else -> skip
    fi;
#endif

C5: /* futex_wait(&word, 1) */
#ifdef BROKEN_NONATOMIC_WAIT
    if
    :: word == 1 -> skip
    :: else -> goto C6
    fi;
    queued = true;
#else
    atomic {
        if
        :: word == 1 -> queued = true               /* block */
        :: else -> skip                             /* EAGAIN */
        fi
    }
#endif
    if
    :: !queued -> skip                              /* woken, or EAGAIN */
#ifdef SPURIOUS
    :: queued && spurious > 0 -> queued = false; spurious--
#endif
    :: queued && done == NPROD && all_empty ->
        /* Ghost step: nothing is pending and nobody is left to publish, so
         * sleeping here for ever is correct. Any other blocked state --
         * queued with a record in a ring after the producers finished -- has
         * the consumer stuck above, outside an end label: a lost wake-up. */
end_idle:
        !queued
    fi;

C6: word = 0;
    goto C1
}

init {
    atomic {
        run producer(0);
        run producer(1)
    }
}

#ifdef LIVENESS
/* Every published record is eventually consumed: each producer publishes
 * exactly NREC records (it always terminates under weak fairness), and head[r]
 * reaches NREC only after records 0..NREC-1 of ring r have been consumed. */
ltl eventually_all_consumed { <> [] all_consumed }

/* Turns a deadlock (the consumer blocked for ever) into an infinite run that
 * the claim can reject. Spin's implicit stutter extension does this without
 * -f, but with -f (pan 6.5.2) the broken variants' searches run to the depth
 * limit instead of reporting the cycle, so the stutter is explicit. Safety runs
 * leave it out: it would hide every deadlock from the end-state check. */
active proctype stutter() {
end:
    do
    :: timeout -> skip
    od
}
#endif
