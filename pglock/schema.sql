-- dlock tables for PostgreSQL 14+.
-- Apply with pglock.(*Backend).Migrate or `dlock migrate`. Rows of the lock
-- tables are kept after release so that each key's fencing counter never goes
-- back. Times are timestamptz written by the server's clock
-- (clock_timestamp()), so the session TimeZone of the clients does not matter.

-- Lease strategy (pglock.New): one row per key ever locked.
CREATE TABLE IF NOT EXISTS "dlock_locks" (
  name        bytea       NOT NULL PRIMARY KEY, -- the key, byte for byte (UTF-8)
  token       bytea       NOT NULL,             -- random 16-byte owner token of the holder
  owner       text        NOT NULL DEFAULT '',  -- explicit owner identity
  fence       bigint      NOT NULL,             -- fencing counter, +1 per grant
  acquired_at timestamptz NOT NULL,             -- server clock
  expires_at  timestamptz NOT NULL,             -- server clock; not in the future = free
  metadata    text        NOT NULL DEFAULT ''
);

-- Lease strategy, shared and limited holders (dlock.ModeShared,
-- dlock.ModeLimited): the lock row summarises them, so that an exclusive
-- acquisition decides from that row alone, and every change to them is made
-- under that row's lock. Added by ALTER so that tables of earlier versions
-- gain them (existing rows and fences are kept).
DO $$
BEGIN
  IF NOT EXISTS (SELECT FROM pg_attribute WHERE attrelid = to_regclass('"dlock_locks"')
      AND attname = 'shared_until' AND NOT attisdropped) THEN
    ALTER TABLE "dlock_locks"
      -- latest expiry of the key's shared or limited holders; not in the future = none
      ADD COLUMN IF NOT EXISTS shared_until timestamptz NOT NULL DEFAULT '-infinity',
      -- their mode while they live: 0 shared, n limited to n holders
      ADD COLUMN IF NOT EXISTS share_limit  integer     NOT NULL DEFAULT 0,
      -- until then, an exclusive acquisition waits behind shared holders and new ones are refused
      ADD COLUMN IF NOT EXISTS writer_until timestamptz NOT NULL DEFAULT '-infinity',
      -- last release of a shared or limited holder (the waiters' grace period counts from it)
      ADD COLUMN IF NOT EXISTS freed_at     timestamptz NOT NULL DEFAULT '-infinity';
  END IF;
END $$;

-- Lease strategy: one row per shared or limited holder, deleted when it is
-- released (the key's fence lives in the lock row).
CREATE TABLE IF NOT EXISTS "dlock_locks_holders" (
  name        bytea       NOT NULL,
  token       bytea       NOT NULL,
  lim         integer     NOT NULL,             -- 0 shared, n limited to n holders
  owner       text        NOT NULL DEFAULT '',
  fence       bigint      NOT NULL,
  acquired_at timestamptz NOT NULL,
  expires_at  timestamptz NOT NULL,
  metadata    text        NOT NULL DEFAULT '',
  PRIMARY KEY (name, token)
);

-- Lease strategy: the queue of clients waiting for a key (pglock's Waiter).
-- For a short grace period after a lease ends, only the waiter that has waited
-- longest may take it, so that a releasing client cannot barge back in ahead
-- of the woken waiters. A row lapses at "until" unless its waiter refreshes it.
CREATE TABLE IF NOT EXISTS "dlock_locks_waiters" (
  name  bytea       NOT NULL,
  token bytea       NOT NULL,                   -- the waiting acquisition's token
  since timestamptz NOT NULL,                   -- queue order
  until timestamptz NOT NULL,
  PRIMARY KEY (name, token)
);

-- Lease strategy: the mode each waiter asks for, so that while a writer
-- mark keeps readers out the key goes to the first waiter that may take it.
-- Added by ALTER so that tables of earlier versions gain it; their rows
-- count as exclusive waiters.
DO $$
BEGIN
  IF NOT EXISTS (SELECT FROM pg_attribute WHERE attrelid = to_regclass('"dlock_locks_waiters"')
      AND attname = 'lim' AND NOT attisdropped) THEN
    ALTER TABLE "dlock_locks_waiters"
      -- -1 exclusive, 0 shared, n limited to n holders
      ADD COLUMN IF NOT EXISTS lim integer NOT NULL DEFAULT -1;
  END IF;
END $$;

-- Lease strategy: who each waiter is, for dlock list --waiters. Added by
-- ALTER so that tables of earlier versions gain them.
DO $$
BEGIN
  IF NOT EXISTS (SELECT FROM pg_attribute WHERE attrelid = to_regclass('"dlock_locks_waiters"')
      AND attname = 'owner' AND NOT attisdropped) THEN
    ALTER TABLE "dlock_locks_waiters"
      ADD COLUMN IF NOT EXISTS owner    text NOT NULL DEFAULT '',
      ADD COLUMN IF NOT EXISTS metadata text NOT NULL DEFAULT '';
  END IF;
END $$;

-- Lease strategy: the lease (microseconds) an exclusive waiter asks for, so
-- that a release grants the key to the first waiter in its own statement;
-- 0 (entries of earlier versions) makes the release wake that waiter
-- instead; -1 marks an entry that was granted the key, kept until its
-- waiter confirms the grant (or the sweep), so that a statement of that
-- waiter that raced the grant cannot queue it again. Added by ALTER so that
-- tables of earlier versions gain it.
DO $$
BEGIN
  IF NOT EXISTS (SELECT FROM pg_attribute WHERE attrelid = to_regclass('"dlock_locks_waiters"')
      AND attname = 'ttl_us' AND NOT attisdropped) THEN
    ALTER TABLE "dlock_locks_waiters" ADD COLUMN IF NOT EXISTS ttl_us bigint NOT NULL DEFAULT 0;
  END IF;
END $$;

-- Advisory strategy (pglock.NewAdvisory): the lock itself is a session-level
-- advisory lock; this row keeps the key's fencing counter and its last holder.
-- UNLOGGED, as are "_readers" and "_epoch_now": their rows describe advisory
-- locks, which end with the server, so a grant that writes only them commits
-- without waiting for a WAL flush. A crash empties them (a clean restart
-- keeps them); the epochs below keep fences increasing across that.
CREATE UNLOGGED TABLE IF NOT EXISTS "dlock_locks_session" (
  name        bytea       NOT NULL PRIMARY KEY,
  lock_id     bigint      NOT NULL,             -- pg_advisory_lock(lock_id >> 32, lock_id & x'ffffffff'): pglock.AdvisoryKeys
  token       bytea       NOT NULL,
  owner       text        NOT NULL DEFAULT '',
  fence       bigint      NOT NULL,             -- fencing counter, +1 per grant
  pid         integer     NOT NULL,             -- pg_backend_pid() of the holder's session
  acquired_at timestamptz NOT NULL,
  metadata    text        NOT NULL DEFAULT ''
);

-- Advisory strategy: until writer_until, an exclusive attempt that found
-- shared holders keeps new shared requests out. Added by ALTER so that
-- tables of earlier versions gain it.
DO $$
BEGIN
  IF NOT EXISTS (SELECT FROM pg_attribute WHERE attrelid = to_regclass('"dlock_locks_session"')
      AND attname = 'writer_until' AND NOT attisdropped) THEN
    ALTER TABLE "dlock_locks_session"
      ADD COLUMN IF NOT EXISTS writer_until timestamptz NOT NULL DEFAULT '-infinity';
  END IF;
END $$;

-- Advisory strategy: the lock-delay of the key's last exclusive grant while
-- it is neither released nor spent, and the instant (server clock) before
-- which no grant is made. Added by ALTER so that tables of earlier versions
-- gain them.
DO $$
BEGIN
  IF NOT EXISTS (SELECT FROM pg_attribute WHERE attrelid = to_regclass('"dlock_locks_session"')
      AND attname = 'delay_until' AND NOT attisdropped) THEN
    ALTER TABLE "dlock_locks_session"
      ADD COLUMN IF NOT EXISTS delay_us bigint NOT NULL DEFAULT 0,
      ADD COLUMN IF NOT EXISTS delay_until timestamptz NOT NULL DEFAULT '-infinity';
  END IF;
END $$;

-- Advisory strategy: one row per shared holder (pg_advisory_lock_shared),
-- deleted when it is released; rows of sessions that ended are dropped by
-- the key's next shared grant. The fence comes from the "_session" row.
CREATE UNLOGGED TABLE IF NOT EXISTS "dlock_locks_readers" (
  name        bytea       NOT NULL,
  token       bytea       NOT NULL,
  owner       text        NOT NULL DEFAULT '',
  fence       bigint      NOT NULL,
  pid         integer     NOT NULL,             -- pg_backend_pid() of the holder's session
  acquired_at timestamptz NOT NULL,
  metadata    text        NOT NULL DEFAULT '',
  PRIMARY KEY (name, token)
);

-- Advisory strategy: tables of earlier versions were logged; their rows
-- and fences are kept (the fence of a key's next grant is greater: see
-- "_epochs").
DO $$
BEGIN
  IF EXISTS (SELECT FROM pg_class WHERE oid = to_regclass('"dlock_locks_session"') AND relpersistence = 'p') THEN
    ALTER TABLE "dlock_locks_session" SET UNLOGGED;
  END IF;
  IF EXISTS (SELECT FROM pg_class WHERE oid = to_regclass('"dlock_locks_readers"') AND relpersistence = 'p') THEN
    ALTER TABLE "dlock_locks_readers" SET UNLOGGED;
  END IF;
END $$;

-- Advisory strategy: a fence is epoch << 40 | n, where n counts the key's
-- grants in the "_session" row and the epoch is the one in "_epoch_now".
-- The first grant that finds "_epoch_now" empty (after a crash emptied the
-- unlogged tables, or on first use) begins an epoch greater than every
-- epoch here and than every fence in "_session" >> 40, records it here in a
-- durable commit, and in "_epoch_now" for the grants that follow.
CREATE TABLE IF NOT EXISTS "dlock_locks_epochs" (
  epoch bigint NOT NULL PRIMARY KEY
);

-- Advisory strategy: the epoch of the fences in the unlogged tables, one row.
CREATE UNLOGGED TABLE IF NOT EXISTS "dlock_locks_epoch_now" (
  one   boolean NOT NULL PRIMARY KEY DEFAULT true CHECK (one),
  epoch bigint  NOT NULL
);

-- Both strategies: a count of the changes of each key's holders (grants,
-- releases, metadata changes, forced releases, ends of sessions), bumped by
-- each change's own statement and carried in its NOTIFY, so that a watch of
-- the key's holders (dlock.HolderWatcher) applies every change in order and
-- tells a missed one. Added by ALTER so that tables of earlier versions
-- gain it.
DO $$
BEGIN
  IF NOT EXISTS (SELECT FROM pg_attribute WHERE attrelid = to_regclass('"dlock_locks"')
      AND attname = 'changes' AND NOT attisdropped) THEN
    ALTER TABLE "dlock_locks" ADD COLUMN IF NOT EXISTS changes bigint NOT NULL DEFAULT 0;
  END IF;
  IF NOT EXISTS (SELECT FROM pg_attribute WHERE attrelid = to_regclass('"dlock_locks_session"')
      AND attname = 'changes' AND NOT attisdropped) THEN
    ALTER TABLE "dlock_locks_session" ADD COLUMN IF NOT EXISTS changes bigint NOT NULL DEFAULT 0;
  END IF;
END $$;

-- The strategy each key is used with (lease or advisory), recorded by its
-- first acquisition: the strategies do not exclude each other, so the other
-- refuses the key (pglock.ErrOtherStrategy).
CREATE TABLE IF NOT EXISTS "dlock_locks_claims" (
  name     bytea NOT NULL PRIMARY KEY,
  strategy text  NOT NULL
);
