-- dlock lease tables for SQLite 3.42+ (the embedded default store).
-- Apply with sqlitelock.(*Backend).Migrate or `dlock migrate`. A key's row in
-- dlock_locks is kept after release so that its fencing counter, shared by
-- every mode, never goes back.
CREATE TABLE IF NOT EXISTS "dlock_locks" (
  name        TEXT    NOT NULL PRIMARY KEY,  -- the key, byte for byte (BINARY collation)
  token       BLOB    NOT NULL,              -- random owner token of the exclusive holder
  owner       TEXT    NOT NULL DEFAULT '',
  fence       INTEGER NOT NULL,              -- fencing counter, +1 per acquisition in any mode
  acquired_us INTEGER NOT NULL,              -- Unix µs, host clock read by SQLite
  expires_us  INTEGER NOT NULL,              -- Unix µs; past = no exclusive holder
  metadata    TEXT    NOT NULL DEFAULT '',
  writer_us   INTEGER NOT NULL DEFAULT 0,    -- Unix µs; until then new shared requests wait for a writer
  freed_us    INTEGER NOT NULL DEFAULT 0     -- Unix µs of the key's last release in any mode; 0 = none recorded
) WITHOUT ROWID;
-- Shared and limited holders, one row each; a row goes at its release.
CREATE TABLE IF NOT EXISTS "dlock_shares" (
  name        TEXT    NOT NULL,              -- the key, as in dlock_locks
  token       BLOB    NOT NULL,              -- random owner token of the holder
  owner       TEXT    NOT NULL DEFAULT '',
  fence       INTEGER NOT NULL,              -- from the key's counter in dlock_locks
  acquired_us INTEGER NOT NULL,
  expires_us  INTEGER NOT NULL,              -- Unix µs; past = free
  metadata    TEXT    NOT NULL DEFAULT '',
  mode        TEXT    NOT NULL CHECK (mode IN ('shared', 'limited')),
  lim         INTEGER NOT NULL DEFAULT 0,    -- the key's holder limit, for 'limited'
  PRIMARY KEY (name, token)
) WITHOUT ROWID;
