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

-- Advisory strategy (pglock.NewAdvisory): the lock itself is a session-level
-- advisory lock; this row keeps the key's fencing counter and its last holder.
CREATE TABLE IF NOT EXISTS "dlock_locks_session" (
  name        bytea       NOT NULL PRIMARY KEY,
  lock_id     bigint      NOT NULL,             -- pg_advisory_lock(lock_id >> 32, lock_id & x'ffffffff'): pglock.AdvisoryKeys
  token       bytea       NOT NULL,
  owner       text        NOT NULL DEFAULT '',
  fence       bigint      NOT NULL,             -- fencing counter, +1 per grant
  pid         integer     NOT NULL,             -- pg_backend_pid() of the holder's session
  acquired_at timestamptz NOT NULL,
  metadata    text        NOT NULL DEFAULT ''
);

-- The strategy each key is used with (lease or advisory), recorded by its
-- first acquisition: the strategies do not exclude each other, so the other
-- refuses the key (pglock.ErrOtherStrategy).
CREATE TABLE IF NOT EXISTS "dlock_locks_claims" (
  name     bytea NOT NULL PRIMARY KEY,
  strategy text  NOT NULL
);
